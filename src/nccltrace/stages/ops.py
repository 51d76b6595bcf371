"""Stage ops: the enriched per-operation table of one run (parallelism labels, instances, clock
sync, the run's alignment quality), built one process at a time."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nccltrace.align.quality import QUALITY_FILE
from nccltrace.core.layout import ALIGNMENT_FILE, SESSION_FILE, RunLayout
from nccltrace.core.provenance import write_manifest
from nccltrace.core.settings import RunSettings
from nccltrace.ops.build import stream_run_ops, write_run_ops
from nccltrace.stages import StageResult

__all__ = ["run_ops"]


def run_ops(layout: RunLayout, procs: Iterable[str], hosts: Iterable[str],
            settings: RunSettings | Mapping[str, Any] | None = None) -> StageResult:  # fmt: skip
    """Write ``ops/`` from the aligned processes ``procs`` and the parsed exports of ``hosts``.
    ``details['run_ops']`` is the :class:`~nccltrace.ops.build.RunOps` (labels, counts)."""
    procs, hosts, settings = list(procs), list(hosts), RunSettings.of(settings)
    alignments = [layout.aligned(p) / ALIGNMENT_FILE for p in procs]
    qualities = [layout.aligned(p) / QUALITY_FILE for p in procs]
    sessions = {h: layout.parsed_nsys(h) / SESSION_FILE for h in hosts}
    layout.ops_dir.mkdir(parents=True, exist_ok=True)
    dumps = layout.flight_recorder if layout.flight_recorder.is_dir() else None
    result = stream_run_ops(alignments, [layout.parsed_nccl(p) for p in procs], layout.communicators, layout.members,
                            sessions, settings, layout.ops, quality_paths=qualities,
                            flight_recorder=dumps)  # fmt: skip
    write_run_ops(result, layout.labels, layout.clock, layout.quality)
    outputs = [layout.ops, layout.labels, layout.clock, layout.quality]
    write_manifest(layout.manifest(layout.ops_dir), stage="ops",
                   inputs=[*alignments, *qualities, layout.communicators, layout.members, *sessions.values(),
                           *(sorted(p for p in dumps.iterdir() if p.is_file()) if dumps else [])],
                   outputs=outputs, config=dict(settings or {}), partial=result.partial, reasons=result.problems,
                   extra={"problems": result.problems, "notes": result.notes, "calls": result.calls,
                          "matched": result.matched})  # fmt: skip
    return StageResult("ops", outputs, result.partial, list(result.problems),
                       f"{result.calls} calls, {result.matched} matched", list(result.notes), {"run_ops": result})
