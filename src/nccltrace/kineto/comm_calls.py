"""The calls a PyTorch-profiler trace records: one row per call ProcessGroupNCCL made, each with
its kernel, in the columns every log-less call source shares (:data:`RECORD_COLUMNS`).

A call is a ``record_param_comms`` CPU op (the trace's ``comm_records``) whose collective names
an NCCL call (``wait`` and other bookkeeping records are not calls). Its kernel is the NCCL kernel
with the same ``External id``; a batched Send/Recv (``batch_isend_irecv``, one kernel per batch)
launches a kernel with no ``External id`` and no arguments, inside a ``nccl:coalesced`` range
that opens only *after* the batch's send/recv records have ended (7.5-35 us after, on the real
capture; the launch comes 43-239 us after the record's start). So a kernel without an id
claims the unclaimed call records of its kernel family on its launching thread since the
previous NCCL launch there: every send/recv of the batch shares its kernel.
Kernels no record claims (CPU activity off, or a record lost) are rows too, with what their
own arguments say. Facts name their source (``op_source``, ``size_source``): ``kernel-record``
where the kernel's arguments say it (they win over the CPU record's; a disagreement is
reported), else ``cpu-record``. Design: ``docs/evidence-sources.md`` (3.3, 3.4).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from nccltrace.pytorch.collectives import (
    RECORD_COLUMNS,
    log_count,
    nccl_datatype,
    nccl_op,
    torch_collective,
)

__all__ = ["ProfilerCalls", "profiler_call_records"]

# run by NCCL as grouped P2P (SendRecv kernels)
_P2P = {"Send", "Recv", "AlltoAll", "Gather", "Scatter"}
# root: the 'Rank' PyTorch records (the peer for Send/Recv)
_ROOTED = {"Send", "Recv", "Broadcast", "Reduce", "Gather", "Scatter"}
_KERNEL_FAMILY = re.compile(r"^nccl(?:Sym|Symk)?(?:Dev)?Kernel_([A-Za-z]+)")
_KERNEL_COLUMNS = (
    "correlation_id",
    "external_id",
    "pid",
    "launch_tid",
    "launch_start",
    "start",
    "short_name",
)
_RECORD_COLUMNS = ("start", "pid", "tid", "external_id", "coll_rank")
_ARGS = (
    "coll_name",
    "coll_in_nelems",
    "coll_out_nelems",
    "coll_dtype",
    "coll_group_size",
    "pg_name",
    "pg_desc",
    "pg_ranks",
)


@dataclass
class ProfilerCalls:
    """The call rows (``records``, :data:`RECORD_COLUMNS`) and one message per problem seen
    (kernel and CPU record disagreeing, records without a kernel). Unpacks as
    ``records, messages``."""

    records: pd.DataFrame
    messages: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Any]:
        yield self.records
        yield self.messages


def profiler_call_records(
    kernels: pd.DataFrame,
    comm_records: pd.DataFrame,
    session: dict[str, Any],
    file: str,
) -> ProfilerCalls:
    """One row per NCCL call of one trace, in call order (``record`` 0-based): each
    ``record_param_comms`` call record with its kernel (``kernel_correlation_id``; null when the
    trace holds none), then every NCCL kernel no record claims as a row of its own. ``kernels``:
    the trace's NCCL kernels (``KinetoTrace.kernels``), ``comm_records`` its
    ``KinetoTrace.comm_records`` (empty without CPU activity), ``session`` its
    ``session_info()`` (``rank``, ``utc_offset_ns``, ``hostname``), ``file`` the trace's name."""
    recs = _plain(comm_records, _RECORD_COLUMNS + _ARGS)
    recs = [r for r in recs if nccl_op(r["coll_name"]) is not None]
    recs.sort(key=lambda r: r["start"])
    ks = _plain(kernels, _KERNEL_COLUMNS + _ARGS)
    link, by_id = _link_by_external_id(recs, ks)
    _link_batches(recs, ks, link, {ki for ki in link.values()})
    messages: list[str] = []
    rows = [
        (
            _record_row(r, ks[link[i]] if i in link else None, session, messages),
            r["start"],
            0,
        )
        for i, r in enumerate(recs)
    ]
    claimed = set(link.values())
    rows += [
        (_kernel_row(k, session), _launch_time(k), 1)
        for ki, k in enumerate(ks)
        if ki not in claimed
    ]
    rows.sort(key=lambda x: (x[1] if x[1] is not None else -1, x[2]))
    out = [{**row, "file": file, "record": i} for i, (row, _, _) in enumerate(rows)]
    messages = [f"{file}: {m}" for m in messages]
    lost = len(recs) - len(link)
    if lost:
        messages.append(
            f"{file}: {lost} of {len(recs)} call record(s) have no kernel in the trace (cut short, or "
            "the kernel ran after the profiler stopped): kept with kernel_correlation_id null"
        )
    if by_id:
        messages.append(
            f"{file}: {by_id} NCCL kernel(s) share an External id with another: the first launched "
            "is the record's"
        )
    return ProfilerCalls(_frame(out), messages)


def _plain(frame: pd.DataFrame, columns: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows of ``frame`` as dicts of ``columns`` (absent ones None), missing values as None."""
    if frame is None or frame.empty:
        return []
    values = [
        frame[c].astype(object).where(frame[c].notna(), None).tolist()
        if c in frame
        else [None] * len(frame)
        for c in columns
    ]
    return [dict(zip(columns, row, strict=True)) for row in zip(*values, strict=True)]


def _launch_time(k: dict[str, Any]) -> int | None:
    """When the kernel was launched (its start when no launch call is in the trace)."""
    at = k.get("launch_start")
    return at if at is not None else k.get("start")


def _link_by_external_id(
    recs: list[dict[str, Any]], ks: list[dict[str, Any]]
) -> tuple[dict[int, int], int]:
    """Record position -> kernel position where both carry one ``External id`` (the kernel
    launched first when several share it), and how many kernels were passed over so."""
    first: dict[int, int] = {}
    shared = 0
    for ki in sorted(range(len(ks)), key=lambda i: _launch_time(ks[i]) or 0):
        xid = ks[ki].get("external_id")
        if xid is None:
            continue
        if xid in first:
            shared += 1
        else:
            first[xid] = ki
    link = {
        i: first[r["external_id"]]
        for i, r in enumerate(recs)
        if r.get("external_id") in first
    }
    return link, shared


def _family(op: str | None) -> str | None:
    return "SendRecv" if op in _P2P else op


def _kernel_family(short_name: str | None) -> str | None:
    """The NCCL function family a kernel name says (``SendRecv``, ``AllGather``, ...); None for
    a generic or unknown name (any call fits)."""
    m = _KERNEL_FAMILY.match(short_name or "")
    fam = m.group(1) if m else None
    if fam in (None, "Generic"):
        return None
    return "AllGather" if fam == "AllGatherV" else fam


def _link_batches(
    recs: list[dict[str, Any]],
    ks: list[dict[str, Any]],
    link: dict[int, int],
    claimed: set[int],
) -> None:
    """Give each NCCL kernel without an ``External id`` (a batch's kernel) the unclaimed call
    records of its family made on its launching thread after the previous NCCL launch there."""
    free: dict[tuple[Any, Any], list[int]] = {}
    for i, r in enumerate(recs):  # recs are in start order
        if i not in link:
            free.setdefault((r.get("pid"), r.get("tid")), []).append(i)
    starts = {t: [recs[i]["start"] for i in idx] for t, idx in free.items()}
    launches: dict[tuple[Any, Any], list[int]] = {}
    for k in ks:
        if k.get("launch_start") is not None:
            launches.setdefault((k.get("pid"), k.get("launch_tid")), []).append(
                k["launch_start"]
            )
    for times in launches.values():
        times.sort()
    for ki, k in enumerate(ks):
        thread, at = (k.get("pid"), k.get("launch_tid")), k.get("launch_start")
        if (
            ki in claimed
            or k.get("external_id") is not None
            or at is None
            or thread not in free
        ):
            continue
        pos = bisect.bisect_left(launches[thread], at)
        lo = (
            bisect.bisect_right(starts[thread], launches[thread][pos - 1]) if pos else 0
        )
        fam = _kernel_family(k.get("short_name"))
        for i in free[thread][lo : bisect.bisect_left(starts[thread], at)]:
            if i not in link and (
                fam is None or _family(nccl_op(recs[i].get("coll_name"))) == fam
            ):
                link[i] = ki


def _facts(args: dict[str, Any]) -> tuple[str | None, int | None]:
    """(NCCL op, logged element count) of a record's or kernel's call arguments."""
    op = nccl_op(args.get("coll_name"))
    return op, log_count(
        op,
        args.get("coll_in_nelems"),
        args.get("coll_out_nelems"),
        args.get("coll_group_size"),
    )


def _root(op: str | None, rank: int | None) -> int | None:
    """``root`` as NCCL's log prints it: Send/Recv the peer's rank in the group, Broadcast/Reduce
    (Gather/Scatter) the root's, which PyTorch records as ``Rank`` for them (null when not
    recorded), 0 for the other collectives."""
    if op is None:
        return None
    return rank if op in _ROOTED else 0


def _record_row(
    r: dict[str, Any],
    k: dict[str, Any] | None,
    session: dict[str, Any],
    messages: list[str],
) -> dict[str, Any]:
    """The row of call record ``r`` and its kernel ``k`` (None: none found): the kernel's own
    arguments where it has them (a disagreement with the record is reported), else the record's."""
    op, count = _facts(r)
    src = {
        "op_source": "cpu-record",
        "size_source": "cpu-record" if count is not None else None,
    }
    args = r
    if k is not None and k.get("coll_name") is not None:
        kop, kcount = _facts(k)
        if (kop, kcount) != (op, count):
            messages.append(
                f"External id {r.get('external_id')}: the kernel (correlation "
                f"{k.get('correlation_id')}) says {kop} count {kcount}, its CPU record {op} "
                f"count {count}: the kernel's kept"
            )
        if kop is not None:
            op, src["op_source"] = kop, "kernel-record"
        if kcount is not None:
            count, src["size_source"] = kcount, "kernel-record"
        args = {**r, **_known(k)}
    offset = session.get("utc_offset_ns")
    return {
        **_common(args, session),
        **src,
        "op": op,
        "count": count,
        "root": _root(op, r.get("coll_rank")),
        "torch_op": torch_collective(r.get("coll_name")),
        "pid": r.get("pid"),
        "tid": r.get("tid"),
        "kernel_correlation_id": None if k is None else k.get("correlation_id"),
        "record_utc": None if offset is None else r["start"] + offset,
    }


def _known(k: dict[str, Any]) -> dict[str, Any]:
    return {c: k[c] for c in _ARGS if k.get(c) is not None}


def _kernel_row(k: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
    """The row of a kernel no call record claims: what its own arguments say (all null for a
    batch's kernel without them)."""
    op, count = _facts(k)
    return {
        **_common(k, session),
        "op": op,
        "count": count,
        "root": _root(op, None),
        "op_source": "kernel-record" if op else None,
        "size_source": "kernel-record" if count is not None else None,
        "torch_op": torch_collective(k.get("coll_name")),
        "pid": k.get("pid"),
        "tid": k.get("launch_tid"),
        "kernel_correlation_id": k.get("correlation_id"),
        "record_utc": None,
    }


def _common(args: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
    """Datatype, group and process facts of a row, from call arguments and the trace's session."""
    pg = {c: args.get(c) for c in ("pg_name", "pg_desc", "pg_ranks")}
    return {
        **pg,
        "datatype_name": nccl_datatype(args.get("coll_dtype")),
        "nranks": args.get("coll_group_size"),
        "comm_source": "process-group"
        if pg["pg_name"] is not None or pg["pg_ranks"] is not None
        else None,
        "rank": session.get("rank"),
        "host": session.get("hostname"),
    }


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The rows in exactly :data:`RECORD_COLUMNS` (names, order, dtypes); absent facts null."""
    return pd.DataFrame(
        {
            name: pd.Series([row.get(name) for row in rows], dtype=kind)
            for name, kind in RECORD_COLUMNS.items()
        },
        index=pd.RangeIndex(len(rows)),
    )
