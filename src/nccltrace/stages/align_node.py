"""Stage align_node: the alignment of each of one node's processes (stage align), one after
another in one job, into ``aligned/<host>/<proc>/``.

One job per node rather than one per process (see :mod:`~nccltrace.stages.parse_node`); each
process's alignment, quality record and manifest are the align stage's own. A node without a
usable export gives its calls the reason ``no_export``, as align decides; a process whose
alignment raises does not stop the others, and the job then fails naming it
(:class:`~nccltrace.stages.NodeStageError`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from nccltrace.core.layout import RunLayout
from nccltrace.stages import StageResult, each_process
from nccltrace.stages.align import run_align

__all__ = ["run_align_node"]


def run_align_node(layout: RunLayout, host: str, procs: Iterable[str], *, mode: str = "default",
                   nccl_version: str | None = None, capture_steps: tuple[int, int] | None = None,
                   done: Callable[[str], None] | None = None) -> StageResult:  # fmt: skip
    """Align each process of ``procs`` (every process of node ``host``) with the node's parsed
    export; the options as :func:`~nccltrace.stages.align.run_align` takes them. ``done(proc)``
    after each process (progress)."""
    procs = sorted(procs)
    strangers = [p for p in procs if layout.host_of(p) != host]
    if strangers:
        raise ValueError(f"align_node of node {host}: {', '.join(strangers)} belong to other nodes")
    layout.aligned_node(host).mkdir(parents=True, exist_ok=True)
    return each_process("align_node", host, procs,
                        lambda proc: run_align(layout, proc, host, mode=mode, nccl_version=nccl_version,
                                               capture_steps=capture_steps), done)  # fmt: skip
