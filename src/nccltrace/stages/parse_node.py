"""Stage parse_node: one node's inputs in one job: its nsys export (stage parse_nsys), then
the NCCL log of each of its processes (stage parse_nccl, one after another).

One job per node rather than one per process keeps a large run's job count at the order of its
nodes (a scheduler's cost, and an interpreter start-up per job). Each process's outputs are
parse_nccl's own and the export's parse_nsys's; a node with logs but no export gets parse_nsys's
'no export' tables; a stage that raises for one process does not stop the others, and the job
then fails naming it (:class:`~nccltrace.stages.NodeStageError`). The export goes first: its
parse has the larger peak, and it then runs in an interpreter that has parsed nothing yet
(measured: ``docs/benchmarks.md``, "Memory per job").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nccltrace.acquisition.status import WORKFLOW_REMEDY, Remedy
from nccltrace.core.layout import RunLayout
from nccltrace.core.settings import RunSettings
from nccltrace.stages import StageResult, each_process
from nccltrace.stages.parse_nccl import run_parse_nccl
from nccltrace.stages.parse_nsys import run_parse_nsys

__all__ = ["run_parse_node"]


def run_parse_node(layout: RunLayout, host: str, logs: Mapping[str, Path | str],
                   export: Path | str | Sequence[Path | str] | None,
                   settings: RunSettings | Mapping[str, Any] | None = None, *, unusable: str | None = None,
                   remedy: Remedy = WORKFLOW_REMEDY, done: Callable[[str], None] | None = None) -> StageResult:  # fmt: skip
    """Parse node ``host``'s logs (``logs``: process -> its log, every process of the node) into
    ``layout.parsed_nccl(proc)`` and its export into ``layout.parsed_nsys(host)``; ``export`` (one
    export, a list of kernel sources, or None), ``unusable`` and ``remedy`` as
    :func:`~nccltrace.stages.parse_nsys.run_parse_nsys` takes
    them. ``done(unit)`` after the export and after each process (progress)."""
    settings = RunSettings.of(settings)  # read once, for both parsers
    strangers = [p for p in logs if layout.host_of(p) != host]
    if strangers:
        raise ValueError(f"parse_node of node {host}: {', '.join(strangers)} belong to other nodes")
    layout.parsed_nccl_node(host).mkdir(parents=True, exist_ok=True)
    if isinstance(export, (list, tuple)):
        export_unit = f"kernel sources {', '.join(Path(p).name for p in export)}"
    else:
        export_unit = f"export {Path(export).name if export is not None else host + '.sqlite'}"

    def run_one(unit: str) -> StageResult:
        if unit == export_unit:
            return run_parse_nsys(export, layout.parsed_nsys(host), host, settings, unusable=unusable, remedy=remedy)
        return run_parse_nccl(logs[unit], layout.parsed_nccl(unit), settings)

    result = each_process("parse_node", host, [export_unit, *sorted(logs)], run_one, done)
    nsys = result.details.get(export_unit)
    result.details["hostname"] = nsys.details.get("hostname") if nsys is not None else None
    return result
