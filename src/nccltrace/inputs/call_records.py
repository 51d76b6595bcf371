"""A process's calls from records of sources other than its NCCL log, as the log's tables.

A profiler trace, a Flight Recorder dump or an nsys export describes the calls a process made
(rows in :data:`~nccltrace.pytorch.collectives.RECORD_COLUMNS`). This module writes them in the
tables parsing a log writes (``calls``, ``comms`` and the other log tables empty), so that every
later stage reads a log-less process as it reads one with a log, and a per-process
``call_sources.parquet`` (:data:`CALL_SOURCE_SCHEMA`) that says, per call, which source gave
each fact. A process group stands for the communicator PyTorch created for it: one ``init``
row per group the process's records name, with the group's global ranks (``pg_ranks``) giving
the rank in it and the group size, and a run-wide id made from the group's name and ranks (the
same on every member). Nothing a record lacks is filled: a count no source gave stays null.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from nccltrace.core.layout import CALL_SOURCES_FILE
from nccltrace.core.tables import (
    TABLES,
    coerce_to_schema,
    empty_table,
    frame_to_table,
    write_table_atomic,
)
from nccltrace.inputs.call_sources import CALL_SOURCE_SCHEMA
from nccltrace.nccl.enums import DATATYPE_BY_NAME, DATATYPES, bus_message_bytes

__all__ = [
    "group_ranks",
    "records_tables",
    "write_record_tables",
]

def group_ranks(text: object) -> tuple[int, ...] | None:
    """A process group's global ranks from their text ("[0, 1]", as the profiler and Flight
    Recorder write them), None when absent or unreadable."""
    if text is None or (isinstance(text, float) and np.isnan(text)):
        return None
    try:
        ranks = json.loads(str(text))
    except ValueError:
        return None
    return tuple(int(r) for r in ranks) if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks) else None


def _stable_id(*parts: object) -> int:
    """A 63-bit id stable across processes and runs (the group's run-wide communicator id)."""
    return int.from_bytes(hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest(), "little") >> 1


def _group_key(row: pd.Series) -> tuple[str, tuple[int, ...]] | None:
    ranks = group_ranks(row["pg_ranks"])
    return None if ranks is None or pd.isna(row["pg_name"]) else (str(row["pg_name"]), ranks)


def records_tables(records: pd.DataFrame, host: str, pid: int, rank: int | None, rank_source: str | None,
                   groups: Sequence[tuple[str, str | None, Sequence[int]]] = ()
                   ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """The ``calls``, ``comms`` and call-sources frames of one process's records (rows of
    RECORD_COLUMNS in call order). ``rank``: the process's global rank (None: unknown; its
    groups then have no rank in them). ``groups``: (name, description, global ranks in group
    order) of every group the sources say the process belongs to, calls or not (a profiler's
    ``pg_config``, a dump's). ``comm`` of a call is its group's id in this process; the comms
    frame also carries each group's ``pg_name``/``pg_desc`` (not written: not log columns)."""
    rec = records.reset_index(drop=True)
    keys = [_group_key(r) for _, r in rec.iterrows()]
    comm = pd.array([_comm_of(host, pid, k) if k else pd.NA for k in keys], dtype="UInt64")
    dt = [DATATYPE_BY_NAME.get(n) if isinstance(n, str) else None for n in rec["datatype_name"]]
    size = [DATATYPES[d][1] if d is not None else None for d in dt]
    count = rec["count"].astype("Int64")
    nbytes = [int(c) * s if s is not None and not pd.isna(c) else None for c, s in zip(count, size)]
    nranks = rec["nranks"].astype("Int64")
    msg = [bus_message_bytes(op, int(c), s, int(n)) if s is not None and not pd.isna(c) and not pd.isna(n)
           and isinstance(op, str) else None for op, c, s, n in zip(rec["op"], count, size, nranks)]  # fmt: skip
    fr_seq = rec["seq_source"].eq("flight-recorder").fillna(False)
    calls = pd.DataFrame({
        "file": rec["file"].astype(str), "line": rec["record"].astype("int64") + 1, "host": host, "pid": int(pid),
        "tid": rec["tid"].astype("Int64"), "op": rec["op"], "op_count": rec["pg_seq"].astype("Int64").where(fr_seq),
        "count": count, "datatype": pd.array(dt, dtype="Int8"), "datatype_name": rec["datatype_name"],
        "root": rec["root"].astype("Int32"), "comm": comm, "nranks": nranks.astype("Int32"),
        "bytes": pd.array(nbytes, dtype="Int64"), "message_bytes": pd.array(msg, dtype="Int64"),
    })  # fmt: skip
    comms = _group_inits(rec, keys, host, pid, rank, groups)
    sources = pd.DataFrame({
        "file": calls["file"], "line": calls["line"], "source": rec.get("source"),
        "op_source": rec["op_source"], "size_source": rec["size_source"], "comm_source": rec["comm_source"],
        "rank_source": rank_source if rank is not None else None,
        "time_source": np.where(rec["kernel_correlation_id"].notna(), "kernel",
                                np.where(rec["started_utc"].notna(), "fr-timing", None)),
        "seq_source": rec["seq_source"], "torch_op": rec["torch_op"], "pg_name": rec["pg_name"],
        "pg_desc": rec["pg_desc"], "pg_seq": rec["pg_seq"].astype("Int64"), "record_utc": rec["record_utc"],
        "enqueue_utc": rec["enqueue_utc"], "fr_started_utc": rec["started_utc"], "fr_ended_utc": rec["ended_utc"],
    })  # fmt: skip
    sources["time_source"] = sources["time_source"].where(sources["time_source"].notna(), None)
    return calls, comms, sources


def _comm_of(host: str, pid: int, key: tuple[str, tuple[int, ...]]) -> int:
    """The process-local id of a group (name + member set: the order a source lists them in
    does not matter)."""
    return _stable_id(host, pid, key[0], *sorted(key[1]))


def _group_inits(rec: pd.DataFrame, keys: list, host: str, pid: int, rank: int | None,
                 groups: Sequence[tuple[str, str | None, Sequence[int]]]) -> pd.DataFrame:  # fmt: skip
    """One ``init`` row per process group the records or ``groups`` name (records first, in
    order of appearance): the group's rank of this process (its position in the group's global
    ranks), its size and the run-wide id of the group (name and member set)."""
    descs = {str(n): d for n, d, _ in groups}
    named = [(i, k) for i, k in enumerate(keys) if k is not None]
    named += [(None, (str(n), tuple(int(r) for r in ranks))) for n, _, ranks in groups]
    rows, seen = [], set()
    for i, key in named:
        ident = (key[0], tuple(sorted(key[1])))
        if ident in seen:
            continue
        seen.add(ident)
        ranks = key[1]
        in_group = ranks.index(rank) if rank is not None and rank in ranks else None
        desc = rec.at[i, "pg_desc"] if i is not None and not pd.isna(rec.at[i, "pg_desc"]) else descs.get(key[0])
        # a group without calls is dated before the process's first record (line 0 of its source)
        rows.append({"file": str(rec.at[i if i is not None else 0, "file"]) if len(rec) else "",
                     "line": int(rec.at[i, "record"]) + 1 if i is not None else 0, "host": host, "pid": int(pid),
                     "event": "init", "phase": "COMPLETE", "api": None, "comm": _comm_of(host, pid, key),
                     "rank": in_group, "nranks": len(ranks), "comm_id": _stable_id("process-group", *ident),
                     "pg_name": key[0], "pg_desc": desc})  # fmt: skip
    return pd.DataFrame(rows, columns=["file", "line", "host", "pid", "event", "phase", "api", "comm", "rank",
                                       "nranks", "comm_id", "pg_name", "pg_desc"])  # fmt: skip


def write_record_tables(out_dir: Path, calls: pd.DataFrame, comms: pd.DataFrame,
                        sources: pd.DataFrame) -> list[Path]:  # fmt: skip
    """Write the log tables (``calls``, ``comms``; the others empty) and ``call_sources`` of one
    process into ``out_dir`` (atomically); returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in TABLES:
        path = out_dir / f"{name}.parquet"
        frame = {"calls": calls, "comms": comms}.get(name)
        table = frame_to_table(coerce_to_schema(frame, TABLES[name]), TABLES[name]) if frame is not None and len(frame) else empty_table(name)
        write_table_atomic(table, path)
        written.append(path)
    write_table_atomic(frame_to_table(coerce_to_schema(sources, CALL_SOURCE_SCHEMA), CALL_SOURCE_SCHEMA), out_dir / CALL_SOURCES_FILE)
    return [*written, out_dir / CALL_SOURCES_FILE]
