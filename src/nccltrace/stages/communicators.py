"""Stage communicators: logical communicators and global ranks of one run from its init lines
(or, for logs without them, from the call sequences, flagged as inferred).

Incomplete communicators (members without a log) make the result partial; the reasons name the
global ranks whose logs are missing and the communicators that lack them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nccltrace.communicators.infer import (
    RANK_SOURCE_WORLD,
    communicator_problems,
    infer_run_communicators,
)
from nccltrace.core.layout import COMMS_FILE, RunLayout
from nccltrace.core.provenance import write_manifest
from nccltrace.core.settings import RunSettings
from nccltrace.stages import StageResult

__all__ = ["run_communicators"]


def run_communicators(layout: RunLayout, procs: Iterable[str],
                      settings: RunSettings | Mapping[str, Any] | None = None,
                      hosts: Iterable[str] = ()) -> StageResult:  # fmt: skip
    """Build ``communicators.parquet`` and ``communicator_members.parquet`` from the parsed logs
    of ``procs`` (and the parsed exports of ``hosts``, whose profiler records can name global
    ranks). ``details['tables']`` is the :class:`~nccltrace.communicators.infer.CommunicatorTables`."""
    settings = RunSettings.of(settings)
    dirs = [layout.parsed_nccl(p) for p in procs]
    sessions = [layout.session(h) for h in hosts if layout.session(h).is_file()]
    dumps = layout.flight_recorder if layout.flight_recorder.is_dir() else None
    result = infer_run_communicators(dirs, layout.communicators_dir, settings, sessions, dumps)
    reasons = communicator_problems(result)
    comms = result.communicators
    incomplete = comms[~comms["complete"].astype(bool)] if len(comms) else comms
    outputs = [layout.communicators, layout.members]
    write_manifest(layout.manifest(layout.communicators_dir), stage="communicators",
                   inputs=[d / COMMS_FILE for d in dirs] + sessions, outputs=outputs, partial=bool(reasons),
                   reasons=reasons, config=dict(settings or {}))  # fmt: skip
    notes = [f"communicator {row.logical_id}: {row.problem}" for row in incomplete.itertuples()]
    if not result.unranked:  # a rank source that could not be used, though others named every rank
        notes += result.rank_notes
    return StageResult("communicators", outputs, bool(reasons), reasons,
                       f"{len(comms)} communicators, world size "
                       f"{'unknown' if result.world_size is None else result.world_size}, {len(incomplete)} incomplete"
                       + "".join(f", global ranks from the {k} for {v} process(es)" for k, v in result.rank_sources.items()
                                 if k != RANK_SOURCE_WORLD),
                       notes, {"tables": result})
