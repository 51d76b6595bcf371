"""The communicator tables' schemas and the result both inferences return (from init lines,
:mod:`nccltrace.communicators.infer`; from call sequences, :mod:`nccltrace.communicators.from_calls`):
one home both import, so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import pyarrow as pa

__all__ = ["COMMUNICATOR_SCHEMA", "MEMBER_SCHEMA", "CommunicatorTables"]

COMMUNICATOR_SCHEMA = pa.schema(
    [
        pa.field("logical_id", pa.int32(), metadata={"doc": "logical communicator id in this run (0-based)"}),
        pa.field("kind", pa.string(), metadata={"doc": "'init' (ncclCommInitRank*) or 'split' (ncclCommSplit)"}),
        pa.field("nranks", pa.int32(), metadata={"doc": "communicator size printed by its init lines"}),
        pa.field("comm_id", pa.uint64(), metadata={"doc": "commId printed by the members (null when not printed)"}),
        pa.field("parent_logical_id", pa.int32(), metadata={"doc": "logical id of the parent of a split comm"}),
        pa.field("color", pa.int64(), metadata={"doc": "split color"}),
        pa.field("split_count", pa.int32(), metadata={"doc": "splitCount/childCount printed (>= 2.24)"}),
        pa.field("members", pa.list_(pa.int32()), metadata={"doc": "global rank of each member, by rank in comm "
                                                                     "(-1 where the member's log is missing or its "
                                                                     "global rank is unknown)"}),
        pa.field("complete", pa.bool_(), metadata={"doc": "every rank 0..nranks-1 present exactly once"}),
        pa.field("problem", pa.string(), metadata={"doc": "why the communicator is incomplete (null if complete)"}),
        pa.field("world", pa.bool_(), metadata={"doc": "the communicator of every rank whose member order gave the "
                                                       "global ranks: its size is the world size"}),
    ]
)
MEMBER_SCHEMA = pa.schema(
    [
        pa.field("logical_id", pa.int32(), metadata={"doc": "logical communicator"}),
        pa.field("host", pa.string(), metadata={"doc": "host of the member process"}),
        pa.field("pid", pa.int64(), metadata={"doc": "process id"}),
        pa.field("comm", pa.uint64(), metadata={"doc": "process-local communicator pointer (join key for calls)"}),
        pa.field("rank_in_comm", pa.int32(), metadata={"doc": "rank of this process in the communicator"}),
        pa.field("global_rank", pa.int32(), metadata={
            "doc": "global rank of this process: its rank in a communicator of every rank, else from the run's "
                   "other records (the profiler trace's distributedInfo.rank, a launcher prefix, the log file name "
                   "the user described, a Flight Recorder dump, the communicators' structure where one assignment "
                   "fits); null when nothing tells it"}),
        pa.field("file", pa.string(), metadata={"doc": "log file of the init line"}),
        pa.field("line", pa.int64(), metadata={"doc": "line of the init line"}),
    ]
)


@dataclass
class CommunicatorTables:
    """Result of :func:`infer_communicators`. ``world_size`` is None when nothing tells it (no
    communicator spans every rank and no other record names the ranks); ``rank_sources``: how
    many processes got their global rank from each source; ``unranked``: the processes
    (``host:pid``) whose global rank is unknown; ``rank_conflicts``: sources that disagree."""

    communicators: pd.DataFrame
    members: pd.DataFrame
    world_size: int | None
    rank_sources: dict[str, int] = field(default_factory=dict)
    unranked: list[str] = field(default_factory=list)
    rank_conflicts: list[str] = field(default_factory=list)
    rank_notes: list[str] = field(default_factory=list)  # why a source could not name a rank

    @property
    def complete(self) -> bool:
        return bool(self.communicators["complete"].all()) if len(self.communicators) else False
