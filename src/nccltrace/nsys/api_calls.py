"""The NCCL API calls of an nsys export as call records, for a process that left no NCCL log.

One row per NCCL call range (Send, Recv, AllReduce, ...; not the GroupStart/GroupEnd,
CommCount or CommInit bookkeeping ranges) in the columns every log-less call source shares
(:data:`~nccltrace.pytorch.collectives.RECORD_COLUMNS`), each with the kernel the project's
linker (:mod:`nccltrace.nsys.nccl_api`) gave it. What the export records, and only that: the op
from the range's name, message size, root/peer and communicator id only from decoded NVTX
payloads (NCCL's payloads carry bytes, never a count or a datatype), PyTorch's collective from
PyTorch's own NVTX range around the call (``nccl:all_to_all, op_id = N``), no rank (nsys
records none). Kernels no call claims are returned for the caller to make kernel rows of, with
why. Every gap is one message, said once. Runs on an open export (:func:`export_call_records`),
on its parsed tables (:func:`staged_call_records`, ``parsed/nsys/<host>/``), or on the frames
(:func:`api_call_records`). Design: ``docs/evidence-sources.md``, sections 1.3, 3.3, 3.4, 3.7.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from nccltrace.core.layout import KERNELS_FILE, NVTX_FILE, SESSION_FILE
from nccltrace.core.tables import read_table
from nccltrace.nsys.nccl_api import (
    CALL_OPS,
    STATUSES,
    NcclApiCalls,
    nccl_kernels,
    nccl_range_mask,
)
from nccltrace.pytorch.collectives import RECORD_COLUMNS, nccl_op, torch_collective

__all__ = [
    "COMM_SOURCE",
    "EXTRA_COLUMNS",
    "OP_SOURCE",
    "SIZE_SOURCE",
    "SOURCE",
    "UNCLAIMED_KERNEL_COLUMNS",
    "NsysCallRecords",
    "api_call_records",
    "export_call_records",
    "staged_call_records",
]

SOURCE = "nsys-nvtx"
"""The rows' ``source`` (``inputs.call_records.CALL_SOURCE_SCHEMA``)."""
OP_SOURCE = "nvtx-range"
SIZE_SOURCE = "nvtx-payload"
COMM_SOURCE = "nvtx-comm-id"

EXTRA_COLUMNS: dict[str, str] = {
    "status": "object",
    "group_id": "Int64",
    "start": "int64",
    "end": "int64",
    "kernel_global_pid": "Int64",
}
"""Columns after :data:`RECORD_COLUMNS` in :attr:`NsysCallRecords.records`: the linker's
``status`` of the call (``nccl_api.STATUSES``: ``matched``, ``kernel_missing``, ...), its
outermost NCCL group (calls of one group share their kernel), the range's start and end (ns,
the export's clock) and the kernel's nsys globalPid (with ``kernel_correlation_id``: a row of
the export's ``kernels`` table)."""

UNCLAIMED_KERNEL_COLUMNS: dict[str, str] = {
    "pid": "Int64",
    "global_pid": "Int64",
    "correlation_id": "Int64",
    "start": "Int64",
    "end": "Int64",
    "reason": "object",
}
"""Columns of :attr:`NsysCallRecords.unclaimed_kernels`."""

BEFORE_WINDOW = "launched before the export's window: their API ranges are not in it"
_UNCLAIMED_IN_WINDOW = (
    "launched inside the window but claimed by no call (several kernels or communicators "
    "in one launch range, or launched outside every NCCL API range)"
)
_UNCLAIMED_NO_LAUNCHES = (
    "claimed by no call (the kernels' launch records were not given)"
)
_ROOTED = {"Broadcast", "Reduce", "Gather", "Scatter"}
_P2P = {"Send", "Recv", "PutSignal", "Signal"}
_CALL_NAMES = sorted(set(CALL_OPS.values()))
# PyTorch's NVTX ranges (emit_nvtx, record_function) append ", op_id = N" and other "k = v" facts.
_NVTX_SUFFIX = re.compile(r",\s.*$", re.DOTALL)


@dataclass
class NsysCallRecords:
    """The calls of one export: ``records`` (one row per NCCL call range, columns
    :data:`RECORD_COLUMNS` then :data:`EXTRA_COLUMNS`; ``record`` 0-based per process),
    ``messages`` (each gap once, with its remedy), ``unclaimed_kernels`` (NCCL kernels no call
    claims, :data:`UNCLAIMED_KERNEL_COLUMNS`, for kernel rows with their ``reason``; empty when
    no kernel table was given) and the export's ``payload`` state (``nccl_api.PAYLOAD_STATES``,
    None when unknown). Unpacks as ``records, messages``."""

    records: pd.DataFrame
    messages: list[str] = field(default_factory=list)
    unclaimed_kernels: pd.DataFrame = field(
        default_factory=lambda: _empty(UNCLAIMED_KERNEL_COLUMNS)
    )
    payload: str | None = None

    def __iter__(self) -> Iterator[Any]:
        yield self.records
        yield self.messages


def api_call_records(
    calls: pd.DataFrame | NcclApiCalls,
    nvtx: pd.DataFrame | None = None,
    processes: pd.DataFrame | None = None,
    *,
    kernels: pd.DataFrame | None = None,
    session: Mapping[str, Any] | None = None,
) -> NsysCallRecords:
    """Call records of one export.

    ``calls``: :func:`~nccltrace.nsys.nccl_api.nccl_api_calls`'s result, or its ``calls`` table
    as written (``nccl_api_calls.parquet``). ``nvtx``: the export's NVTX rows (for PyTorch's
    collective around each call; None: ``torch_op`` null). ``processes``: its processes table
    (named in the message of an export without NCCL calls). ``kernels``: its kernels table (for
    the kernels no call claims). ``session``: ``session.json`` as the parse writes it (or the
    same keys): ``hostname`` -> ``host``, ``source_file`` -> ``file``, ``utc_offset_ns`` ->
    ``record_utc``, and, when ``calls`` is a table, ``nccl_api_calls`` (its summary: payload
    state and the re-export remedy).
    """
    session = dict(session or {})
    summary = dict(session.get("nccl_api_calls") or {})
    if isinstance(calls, NcclApiCalls):
        summary.update(payload=calls.payload, payload_warning=calls.payload_warning,
                       nccl_kernels=calls.nccl_kernels,
                       kernels_outside_launch_ranges=calls.kernels_outside_launch_ranges)  # fmt: skip
        calls = calls.calls
    file = session.get("source_file")
    c = _call_rows(calls)
    records = _records(c, nvtx, session)
    unclaimed = _unclaimed(calls, kernels)
    messages = _messages(records, unclaimed, summary, processes, kernels is not None)
    return NsysCallRecords(
        records=records,
        messages=[f"{file}: {m}" if file else m for m in messages],
        unclaimed_kernels=unclaimed,
        payload=summary.get("payload"),
    )


def export_call_records(export: Any) -> NsysCallRecords:
    """Call records of an open :class:`~nccltrace.nsys.reader.NsysExport` (reads its NVTX,
    kernels, processes and launches once)."""
    nvtx, kernels = export.nvtx(), export.kernels()
    api = export.nccl_api_calls(nvtx=nvtx, kernels=kernels)
    session = {
        "hostname": export.hostname,
        "source_file": export.path.name,
        "utc_offset_ns": export.utc_offset_ns,
    }
    return api_call_records(
        api, nvtx, export.processes(), kernels=kernels, session=session
    )


def staged_call_records(directory: Path | str) -> NsysCallRecords:
    """Call records from an export's parsed tables (``parsed/nsys/<host>/``: nccl_api_calls,
    nvtx, processes, kernels and session.json, as ``NsysExport.export_tables`` writes them)."""
    d = Path(directory)
    calls = read_table(d / "nccl_api_calls.parquet")
    nvtx_cols = [
        "start",
        "end",
        "event_type",
        "text",
        "domain",
        "domain_id",
        "global_tid",
        "pid",
        "tid",
    ]
    nvtx = (
        read_table(d / NVTX_FILE, columns=nvtx_cols)
        if (d / NVTX_FILE).is_file()
        else None
    )
    procs = d / "processes.parquet"
    kcols = [
        "global_pid",
        "pid",
        "correlation_id",
        "start",
        "end",
        "short_name",
        "name",
        "launch_start",
    ]
    kernels = (
        read_table(d / KERNELS_FILE, columns=kcols)
        if (d / KERNELS_FILE).is_file()
        else None
    )
    session = (
        json.loads((d / SESSION_FILE).read_text())
        if (d / SESSION_FILE).is_file()
        else {}
    )
    return api_call_records(calls, nvtx, read_table(procs) if procs.is_file() else None, kernels=kernels,
                            session=session)  # fmt: skip


# --------------------------------------------------------------------------- rows


def _empty(spec: Mapping[str, str]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series([], dtype=k) for c, k in spec.items()})


def _call_rows(calls: pd.DataFrame) -> pd.DataFrame:
    """The collective and point-to-point call ranges (not bookkeeping, not legacy wrappers),
    in call order per process."""
    is_call = calls.op.isin(_CALL_NAMES).to_numpy(bool) & (
        calls.status != "wrapper"
    ).to_numpy(bool)
    c = calls[is_call].copy()
    c["_pos"] = np.arange(len(c))
    return c.sort_values(["pid", "start", "tid", "_pos"], kind="stable").reset_index(
        drop=True
    )


def _nullable(values: Any, kind: str) -> pd.Series:
    return (
        pd.Series(pd.array(values, dtype=kind))
        if kind != "object"
        else pd.Series(values, dtype=object)
    )


def _records(
    c: pd.DataFrame, nvtx: pd.DataFrame | None, session: Mapping[str, Any]
) -> pd.DataFrame:
    """The rows in :data:`RECORD_COLUMNS` then :data:`EXTRA_COLUMNS` order and dtypes."""
    n = len(c)
    op = c.op.astype(object).to_numpy()
    nbytes = c.nccl_message_bytes.astype("Int64")
    comm = c.nccl_comm_id.astype("UInt64")
    p2p = np.isin(op, list(_P2P))
    rooted = np.isin(op, list(_ROOTED))
    root = c.nccl_peer.astype("Int64").where(
        p2p, c.nccl_root.astype("Int64").where(rooted, 0)
    )
    offset = session.get("utc_offset_ns")
    start = c.start.astype("int64")
    none = [None] * n
    cols: dict[str, Any] = {
        "file": [session.get("source_file")] * n,
        "record": c.groupby("pid", dropna=False, sort=False)
        .cumcount()
        .to_numpy("int64"),
        "rank": none,
        "host": [session.get("hostname")] * n,
        "pid": c.pid.astype("Int64").array,
        "tid": c.tid.astype("Int64").array,
        "torch_op": _torch_ops(c, nvtx),
        "op": op,
        "op_source": [OP_SOURCE] * n,
        "bytes": nbytes.array,
        "size_source": np.where(nbytes.notna().to_numpy(bool), SIZE_SOURCE, None),
        "root": root.array,
        "comm_id": comm.array,
        "comm_source": np.where(comm.notna().to_numpy(bool), COMM_SOURCE, None),
        "kernel_correlation_id": c.kernel_correlation_id.astype("Int64").array,
        "record_utc": (start + offset).to_numpy() if offset is not None else none,
        "status": c.status.astype(object).to_numpy(),
        "group_id": c.group_id.astype("Int64").array,
        "start": start.to_numpy(),
        "end": c.end.astype("int64").to_numpy(),
        "kernel_global_pid": c.kernel_global_pid.astype("Int64").array,
    }
    spec = {**RECORD_COLUMNS, **EXTRA_COLUMNS}
    return pd.DataFrame(
        {k: _nullable(cols.get(k, none), kind) for k, kind in spec.items()},
        index=pd.RangeIndex(n),
    )


def _torch_ops(c: pd.DataFrame, nvtx: pd.DataFrame | None) -> np.ndarray:
    """PyTorch's collective (``torch_collective``) of the innermost PyTorch NVTX range that
    encloses each call on its thread (``nccl:all_to_all, op_id = N`` -> all_to_all); None where
    no such range does."""
    out = np.full(len(c), None, dtype=object)
    need = {"text", "start", "end", "pid", "tid"}
    if nvtx is None or not len(c) or not len(nvtx) or not need <= set(nvtx.columns):
        return out
    t = nvtx[~nccl_range_mask(nvtx)]
    ok = t.start.notna() & t.end.notna() & t.tid.notna() & t.pid.notna()
    if "event_type" in t.columns:
        ok &= (t.event_type == 59).fillna(False)  # push/pop ranges: nested per thread
    t = t[ok.to_numpy(bool)]
    text = t.text.astype("string")
    t = t[text.str.startswith("nccl:").fillna(False).to_numpy(bool)]
    if not len(t):
        return out
    stem = [_NVTX_SUFFIX.sub("", s) for s in t.text.astype(str)]
    known = np.array([nccl_op(s) is not None for s in stem], bool)
    t = t.assign(_torch=[torch_collective(s) for s in stem])[known]
    calls_by_thread = c.groupby(
        [c.pid.astype("Int64"), c.tid.astype("Int64")], sort=False
    ).indices
    for (pid, tid), g in t.groupby(
        [t.pid.astype("Int64"), t.tid.astype("Int64")], sort=False
    ):
        rows = calls_by_thread.get((pid, tid))
        if rows is None:
            continue
        g = g.sort_values(["start", "end"], ascending=[True, False], kind="stable")
        st, en = g.start.to_numpy("int64"), g.end.to_numpy("int64")
        parent = _parents(st, en)
        cs, ce = c.start.to_numpy("int64")[rows], c.end.to_numpy("int64")[rows]
        i = np.searchsorted(st, cs, side="right") - 1
        # The last range starting before the call, else the nearest of its enclosing ranges that
        # also ends after the call.
        while True:
            bad = (i >= 0) & (en[np.maximum(i, 0)] < ce)
            if not bad.any():
                break
            i[bad] = parent[i[bad]]
        names = g._torch.to_numpy(object)
        hit = i >= 0
        out[rows[hit]] = names[i[hit]]
    return out


def _parents(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per range (sorted by start, then end descending), the nearest earlier range that encloses
    it, -1 if none."""
    parent = np.full(len(start), -1, np.int64)
    stack: list[int] = []
    for j in range(len(start)):
        while stack and end[stack[-1]] < end[j]:
            stack.pop()
        if stack:
            parent[j] = stack[-1]
        stack.append(j)
    return parent


def _unclaimed(calls: pd.DataFrame, kernels: pd.DataFrame | None) -> pd.DataFrame:
    """The NCCL kernels of ``kernels`` that no call range claims, with why: no launch record in
    the export (launched before its window), or launched in the window but claimed by none."""
    if kernels is None or not len(kernels):
        return _empty(UNCLAIMED_KERNEL_COLUMNS)
    k = nccl_kernels(kernels)
    linked = calls[calls.kernel_correlation_id.notna()]
    gpid = (
        "global_pid" in k.columns
        and k.global_pid.notna().all()
        and linked.kernel_global_pid.notna().all()
    )
    key_k = ("global_pid" if gpid else "pid", "correlation_id")
    key_c = ("kernel_global_pid" if gpid else "pid", "kernel_correlation_id")
    claimed = pd.MultiIndex.from_arrays(
        [linked[key_c[0]].astype("Int64"), linked[key_c[1]].astype("Int64")]
    )
    mine = pd.MultiIndex.from_arrays(
        [k[key_k[0]].astype("Int64"), k[key_k[1]].astype("Int64")]
    )
    k = k[~mine.isin(claimed)]
    if "launch_start" in k.columns:
        reason = np.where(
            k.launch_start.isna().to_numpy(bool), BEFORE_WINDOW, _UNCLAIMED_IN_WINDOW
        )
    else:
        reason = np.full(len(k), _UNCLAIMED_NO_LAUNCHES, dtype=object)
    cols = {
        c: list(k[c]) if c in k.columns else [None] * len(k)
        for c in UNCLAIMED_KERNEL_COLUMNS
    }
    cols["reason"] = list(reason)
    return pd.DataFrame({c: _nullable(cols[c], kind) for c, kind in UNCLAIMED_KERNEL_COLUMNS.items()},
                        index=pd.RangeIndex(len(k)))  # fmt: skip


# --------------------------------------------------------------------------- messages


def _messages(records: pd.DataFrame, unclaimed: pd.DataFrame, summary: Mapping[str, Any],
              processes: pd.DataFrame | None, have_kernels: bool) -> list[str]:  # fmt: skip
    """One message per gap, each once, with what would fill it."""
    n = len(records)
    nk = len(unclaimed) if have_kernels else summary.get("nccl_kernels")
    if n == 0:
        procs = "" if processes is None else f" ({len(processes)} process(es) recorded)"
        if nk == 0:
            return [
                f"no NCCL call or kernel in the export's window{procs}: no call rows from this export"
            ]
        if nk is None:
            return [
                f"no NCCL call in the export's window{procs} (its kernels were not given): no call rows"
            ]
        return [(f"{nk} NCCL kernel(s) but no NCCL API range in the export's window{procs}: no call rows; profile "
                "with `nsys profile --trace=cuda,nvtx` (NCCL >= 2.8.3 marks its calls with NVTX ranges)")]  # fmt: skip
    out: list[str] = []
    st = records.status.value_counts()
    for status, meaning in STATUSES.items():
        if status != "matched" and st.get(status, 0):
            groups = records.group_id[records.status == status].nunique()
            out.append(
                f"{st[status]} NCCL call(s) in {groups} group(s) with status {status!r}: {meaning}"
            )
    before = unclaimed.correlation_id[
        (unclaimed.reason == BEFORE_WINDOW).to_numpy(bool)
    ]
    if len(before):
        ids = ", ".join(str(x) for x in before.head(5)) + (
            ", ..." if len(before) > 5 else ""
        )
        out.append(f"{len(before)} kernels {BEFORE_WINDOW} (correlation ids {ids})")
    elif not have_kernels and summary.get("kernels_outside_launch_ranges"):
        out.append(f"{summary['kernels_outside_launch_ranges']} kernels launched outside every NCCL API range "
                   "(launched before the export's window, or from another thread): no call claims them")  # fmt: skip
    for reason in (_UNCLAIMED_IN_WINDOW, _UNCLAIMED_NO_LAUNCHES):
        if (unclaimed.reason == reason).any():
            out.append(f"{int((unclaimed.reason == reason).sum())} kernel(s) {reason}")
    no_size = int(records["bytes"].isna().sum())
    if no_size:
        warning = summary.get("payload_warning")
        if warning:
            out.append(
                f"{no_size} of {n} NCCL calls have no size, root/peer or communicator id: {warning}"
            )
        elif summary.get("payload") != "decoded":
            out.append(f"{no_size} of {n} NCCL calls have no size, root/peer or communicator id (payload state "
                       f"{summary.get('payload') or 'unknown'}: NCCL < 2.16.2 records no NVTX payloads; else "
                       "the export's parse summary names the remedy)")  # fmt: skip
    no_comm = int((records["bytes"].notna() & records["comm_id"].isna()).sum())
    if no_comm:
        out.append(f"{no_comm} NCCL calls have a size but no communicator id: NCCL's NVTX payloads carry it from "
                   "2.25.1 on")  # fmt: skip
    out.append(f"no rank on the {n} NCCL calls: nsys records none; a profiler trace or Flight Recorder dump of the "
               "same job, or NCCL logs, give it")  # fmt: skip
    return out
