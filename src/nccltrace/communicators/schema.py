"""The communicator tables' schemas and the result both inferences return (from init lines,
:mod:`nccltrace.communicators.infer`; from call sequences, :mod:`nccltrace.communicators.from_calls`):
one home both import, so neither imports the other; and the world size those tables support,
which the ops stage reads without running either inference."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import pyarrow as pa

__all__ = ["COMMUNICATOR_SCHEMA", "MEMBER_SCHEMA", "CommunicatorTables", "run_world_size"]

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


def run_world_size(communicators: pd.DataFrame, members: pd.DataFrame) -> int | None:
    """The world size a run's communicator tables support: the size of the communicator of every
    rank the global ranks came from; else the number of processes when their global ranks are
    0..n-1, one each, and every communicator is whole (a rank beyond them left no log, and a
    rank sharing a communicator with another would leave it a member short; one sharing none is
    no part of this job); else None (unknown: the largest communicator is not the world)."""
    if communicators is None or not len(communicators) or members is None or not len(members):
        return None
    if "world" in communicators and communicators["world"].fillna(False).astype(bool).any():
        return int(communicators.loc[communicators["world"].fillna(False).astype(bool), "nranks"].max())
    if not communicators["complete"].astype(bool).all():
        return None
    ranks = members.drop_duplicates(["host", "pid"])["global_rank"]
    if ranks.isna().any():
        return None
    return len(ranks) if set(ranks.astype(int)) == set(range(len(ranks))) else None
