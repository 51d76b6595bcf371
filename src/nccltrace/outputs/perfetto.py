"""Chrome Trace Event export of a run's operations (loads in Perfetto and chrome://tracing).

One gzip-compressed JSON file per run (optionally one per rank): a process per rank, tracks for
NVTX, parallelism, communicators and CUDA streams, flow arrows across each collective instance,
on the synchronised clock. Unmatched lines are not drawn at invented times, only counted; events
are streamed in bounded chunks so large runs fit in memory. Layout and options: ``docs/trace.md``.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from nccltrace.core.layout import KERNELS_FILE, NVTX_FILE, SESSION_FILE, RunLayout
from nccltrace.core.tables import atomic_output, read_table, read_table_batch

__all__ = [
    "SUMMARY_MAX_EVENTS", "TRACE_FORMAT_VERSION", "TraceSummary", "load_run_inputs", "write_chrome_trace",
    "write_run_traces", "write_summary_trace",
]

TRACE_FORMAT_VERSION = 1
UNKNOWN_RANK_PID_BASE = 1_000_000
# Rows formatted at once: bounds the memory of the per-column argument fragments.
_CHUNK_ROWS = 20_000
_GZIP_LEVEL = 5
# NVTX event types that are ranges or marks (nsys NVTX_EVENTS.eventType).
_NVTX_MARK = 34
_NVTX_KINDS = (34, 59, 60, 70, 71)
_METRIC_COLUMNS = [
    "duration_ns", "algbw_gbps", "busbw_gbps", "bus_factor", "wait_ns", "transfer_ns", "transfer_busbw_gbps",
    "arrival_skew_ns", "limit_gbps", "limit_link", "limit_source", "efficiency", "transfer_efficiency",
    "algorithm", "protocol", "algo_source",
    # optional extras of the metrics table, shown when present
    "algbw_limit_gbps", "limit_scope", "kernel_calls", "kernel_busbw_gbps", "arrival_offset_ns",
]  # fmt: skip
# Parallelism kinds first in this order on each rank, others alphabetically after them.
_PAR_ORDER = ["tp", "cp", "ep", "tp-ep", "dp", "dp-cp", "pp", "mp", "embedding", "position-embedding", "world"]


@dataclass
class TraceSummary:
    """What one written trace file contains."""

    path: Path
    events: int
    bytes: int  # compressed file size
    ranks: list[int]  # pids of the processes in the file (global ranks)
    clock: str  # 'sync', 'utc', 'mixed' (some hosts unsynchronised) or 'none' (no kernel times)
    origin_utc_ns: int | None  # UTC ns of ts = 0
    truncated: bool  # max_events cut the trace short
    notes: list[str] = field(default_factory=list)
    json_bytes: int = 0  # uncompressed size
    seconds: float = 0.0  # wall time spent writing (after the inputs were prepared)
    counts: dict[str, int] = field(default_factory=dict)  # events per kind

    @property
    def bytes_per_event(self) -> float:
        return self.bytes / self.events if self.events else 0.0


# --------------------------------------------------------------------------- value formatting


def _is_na(v: Any) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))


def _num(v: Any) -> str | None:
    """A JSON number, or None for null/NaN/inf (JSON has no NaN)."""
    if _is_na(v):
        return None
    if isinstance(v, (bool, np.bool_)):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    f = float(v)
    if not math.isfinite(f):
        return None
    if f.is_integer() and abs(f) < 1e15:
        return str(int(f))
    return f"{f:.6g}"


def _size(n: Any) -> str | None:
    """Human-readable byte count (binary prefixes)."""
    if _is_na(n):
        return None
    n = int(n)
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _hex(v: Any) -> str | None:
    return None if _is_na(v) else f"0x{int(v):x}"


def _obj(s: pd.Series) -> list:
    """Column as a Python list with None for nulls (any pandas dtype)."""
    return s.astype(object).where(s.notna(), None).tolist()


def _int_or(s: pd.Series, fill: int) -> np.ndarray:
    return s.astype("Int64").fillna(fill).to_numpy(dtype=np.int64)


def _format(kind: str, v: Any) -> str | None:
    """JSON text of one argument value of the given kind, None to leave the argument out."""
    if _is_na(v):
        return None
    if kind == "str":
        return json.dumps(str(v))
    if kind == "num":
        return _num(v)
    if kind == "hex":
        return json.dumps(_hex(v))
    if kind == "size":
        return json.dumps(_size(v))
    raise ValueError(kind)  # pragma: no cover - programming error


def _fragments(key: str, kind: str, values: pd.Series) -> np.ndarray:
    """``,"key":value`` per row (empty for nulls) as an object array.

    Each distinct value is formatted once (op names, sizes, datatypes repeat a lot); the
    per-row work is an index into the formatted uniques. Integers and plain strings, the
    high-cardinality cases (ids, log lines), are formatted by vectorised string operations.
    """
    prefix = "," + json.dumps(key) + ":"
    if len(values) <= 64:  # small frames: plain formatting beats the vectorised set-up
        texts = [_format(kind, v) for v in _obj(values)]
        return np.array([("" if t is None else prefix + t) for t in texts], dtype=object)
    codes, uniq = pd.factorize(values, use_na_sentinel=True)
    u = pd.Series(np.asarray(uniq, dtype=object))
    integer = pd.api.types.is_integer_dtype(values.dtype)
    if kind == "num" and len(u) and integer:
        texts = (prefix + u.astype(str)).tolist()
    elif kind == "hex" and integer:
        texts = [f'{prefix}"0x{int(x):x}"' for x in u.tolist()]
    elif kind == "str" and len(u):
        u = u.astype(str)
        # Strings without quotes, backslashes or control characters need no escaping.
        plain = ~u.str.contains(r'["\\\x00-\x1f]', regex=True)
        quoted = prefix + '"' + u + '"'
        if not plain.all():
            quoted[~plain] = [prefix + json.dumps(x) for x in u[~plain].tolist()]
        texts = quoted.tolist()
    else:
        texts = [("" if t is None else prefix + t) for t in (_format(kind, x) for x in u.tolist())]
    return np.array([*texts, ""], dtype=object)[codes]


_FRACTIONS = [f".{i:03d}" for i in range(1000)]


def _ts(rel_ns: np.ndarray) -> list[str]:
    """Microseconds with exactly 3 decimals from non-negative integer ns (no float rounding)."""
    q, r = np.divmod(rel_ns, 1000)
    frac = _FRACTIONS
    return [str(a) + frac[b] for a, b in zip(q.tolist(), r.tolist())]


# Op (call) slice arguments: (key shown in the viewer, column, kind). Kinds: str, num, hex, size.
_OP_ARGS: list[tuple[str, str, str]] = [
    ("Op", "op", "str"),
    ("Op Count", "op_count", "num"),
    ("Op Count (Hex)", "op_count", "hex"),
    ("Communicator Ptr", "comm", "hex"),
    ("Communicator (logical id)", "logical_id", "num"),
    ("Rank in Comm", "rank_in_comm", "num"),
    ("Communicator Size", "nranks", "num"),
    ("Parallelism Type", "parallelism", "str"),
    ("Parallelism Candidates", "_cands", "str"),
    ("Instance", "instance", "str"),
    ("Element Count", "count", "num"),
    ("Data Type", "datatype_name", "str"),
    ("Reduction Op", "_redop", "str"),
    ("Bytes (per rank)", "bytes", "num"),
    ("Message Size (Bytes)", "message_bytes", "num"),
    ("Message Size", "message_bytes", "size"),
    ("Root Rank", "_root", "num"),
    ("Peer Rank", "_peer", "num"),
    ("Send Buffer", "sendbuff", "hex"),
    ("Recv Buffer", "recvbuff", "hex"),
    ("NCCL Stream Ptr", "stream", "hex"),
    ("CUDA Kernel", "kernel_name", "str"),
    ("CUDA Grid", "_grid", "str"),
    ("CUDA Block", "_block", "str"),
    ("Registers Per Thread", "registers_per_thread", "num"),
    ("Shared Mem (Static)", "static_shared_memory", "num"),
    ("Shared Mem (Dynamic)", "dynamic_shared_memory", "num"),
    ("CUDA Stream ID", "kernel_stream_id", "num"),
    ("CUDA Correlation ID", "kernel_correlation_id", "num"),
    ("Duration (ns)", "duration_ns", "num"),
    ("Algo BW (GB/s)", "algbw_gbps", "num"),
    ("Bus BW (GB/s)", "busbw_gbps", "num"),
    ("Bus Factor", "bus_factor", "num"),
    ("Wait (ns)", "wait_ns", "num"),
    ("Transfer (ns)", "transfer_ns", "num"),
    ("Transfer Bus BW (GB/s)", "transfer_busbw_gbps", "num"),
    ("Arrival Skew (ns)", "arrival_skew_ns", "num"),
    ("Kernel Calls", "kernel_calls", "num"),
    ("Kernel Bus BW (GB/s)", "kernel_busbw_gbps", "num"),
    ("Arrival Offset (ns)", "arrival_offset_ns", "num"),
    ("Theo Algo BW (GB/s)", "algbw_limit_gbps", "num"),
    ("Theo Bus BW (GB/s)", "limit_gbps", "num"),
    ("Bottleneck Link", "limit_link", "str"),
    ("Limit Source", "limit_source", "str"),
    ("Limit Scope", "limit_scope", "str"),
    ("Efficiency", "efficiency", "num"),
    ("Transfer Efficiency", "transfer_efficiency", "num"),
    ("NCCL Algorithm", "algorithm", "str"),
    ("NCCL Protocol", "protocol", "str"),
    ("Algorithm Source", "algo_source", "str"),
    ("Log Line", "_logline", "str"),
    ("Match Method", "method", "str"),
    ("Match Confidence", "confidence", "num"),
]
_KERNEL_ARGS: list[tuple[str, str, str]] = [
    ("CUDA Kernel", "kernel_name", "str"),
    ("CUDA Grid", "_grid", "str"),
    ("CUDA Block", "_block", "str"),
    ("CUDA Stream ID", "kernel_stream_id", "num"),
    ("CUDA Correlation ID", "kernel_correlation_id", "num"),
    ("Ops in Launch", "_nops", "num"),
    ("Log Line (first call)", "_logline", "str"),
    ("Match", "_kmatch", "str"),
]
_NVTX_ARGS: list[tuple[str, str, str]] = [
    ("Domain", "domain", "str"),
    ("Category", "category_name", "str"),
    ("NVTX Thread", "tid", "num"),
    ("Payload (int64)", "int64_value", "num"),
    ("Payload (uint64)", "uint64_value", "str"),  # may exceed int64: as text
    ("Payload (double)", "double_value", "num"),
    ("NCCL Message Size (Bytes)", "nccl_message_bytes", "num"),
    ("NCCL Communicator ID", "nccl_comm_id", "hex"),
    ("NCCL Rank", "nccl_rank", "num"),
    ("NCCL nranks", "nccl_nranks", "num"),
    ("NCCL Root", "nccl_root", "num"),
    ("NCCL Peer", "nccl_peer", "num"),
]


# Columns the layout needs besides the argument columns.
_LAYOUT_COLUMNS = ["proc", "t0", "t1", "_flow", "_is_call", "_comm_key", "kernel_global_pid", "kernel_correlation_id",
                   "kernel_stream_id", "kernel_name", "parallelism", "message_bytes", "op"]  # fmt: skip


# --------------------------------------------------------------------------- preparation


@dataclass
class _Prepared:
    """Inputs of one run on one clock, independent of the selection written."""

    procs: pd.DataFrame  # index: pid in the trace; host, os_pid, global_rank, name, sort_index
    rows: pd.DataFrame  # rows with kernel time: proc, t0, t1 + argument columns
    nvtx: pd.DataFrame  # proc, t0, t1 (-1 for marks), text, domain, tid + argument columns
    unmatched: pd.DataFrame  # proc, reason, n: call rows without kernel time
    origin: int | None
    clock: str
    host_clock: dict[str, str]
    comm_names: dict[Any, tuple[str, tuple]]  # comm track key -> (name, sort key)
    notes: list[str]


def _processes(ops: pd.DataFrame, notes: list[str]) -> tuple[pd.DataFrame, pd.Series]:
    """One trace process per (host, pid) of the logs; returns (procs, proc id of each ops row)."""
    host = ops["host"].astype("string").fillna("?")
    key = pd.DataFrame({"host": host, "os_pid": _int_or(ops["pid"], -1),
                        "g": ops["global_rank"].astype("Int64") if "global_rank" in ops else pd.NA})  # fmt: skip
    per = key.groupby(["host", "os_pid"], sort=True)["g"].agg(lambda s: s.dropna().min() if s.notna().any() else pd.NA)
    per = per.reset_index()
    used: set[int] = set()
    ids: list[int] = []
    unknown = 0
    for g in per["g"].tolist():
        if not _is_na(g) and int(g) not in used:
            ids.append(int(g))
            used.add(int(g))
        else:
            if not _is_na(g):
                notes.append(f"global rank {int(g)} claimed by several processes; extra ones shown as unknown")
            ids.append(UNKNOWN_RANK_PID_BASE + unknown)
            unknown += 1
    per["proc"] = ids
    per["name"] = [f"rank {i} ({h})" if i < UNKNOWN_RANK_PID_BASE else f"{h} pid {p} (rank unknown)"
                   for h, p, i in zip(per["host"], per["os_pid"], per["proc"])]  # fmt: skip
    per["sort_index"] = per["proc"]  # global rank; unknown ranks after all known ones
    per["global_rank"] = [i if i < UNKNOWN_RANK_PID_BASE else None for i in per["proc"]]
    row_proc = key.merge(per[["host", "os_pid", "proc"]], on=["host", "os_pid"], how="left")["proc"]
    row_proc.index = ops.index
    return per.set_index("proc"), row_proc


def _host_clocks(ops: pd.DataFrame, notes: list[str]) -> dict[str, str]:
    """Per host: 'sync' if every kernel-timed row has synchronised times, else 'utc'."""
    has = ops["kernel_start_utc"].notna() & ops["kernel_end_utc"].notna()
    if "kernel_start_sync" in ops and "kernel_end_sync" in ops:
        syn = has & ops["kernel_start_sync"].notna() & ops["kernel_end_sync"].notna()
    else:
        syn = pd.Series(False, index=ops.index)
    host = ops["host"].astype("string").fillna("?")
    per = pd.DataFrame({"h": host, "k": has, "s": syn}).groupby("h").sum()
    out: dict[str, str] = {}
    for h, n_k, n_s in zip(per.index, per["k"], per["s"]):
        if n_k == 0:
            continue
        if n_s == n_k:
            out[str(h)] = "sync"
        else:
            out[str(h)] = "utc"
            if n_s:
                notes.append(f"host {h}: only {n_s} of {n_k} kernel rows have synchronised times; its own clock used")
    unsynced = sorted(h for h, c in out.items() if c == "utc")
    if unsynced and len(unsynced) < len(out):
        notes.append("hosts without a clock-sync estimate are on their own clock and may be offset from the "
                     f"others: {', '.join(unsynced)}")  # fmt: skip
    return out


def _overall_clock(host_clock: Mapping[str, str]) -> str:
    kinds = set(host_clock.values())
    if not kinds:
        return "none"
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _sync_map(ops_h: pd.DataFrame) -> tuple[int, float, float]:
    """Linear correction utc -> sync of one host from its rows: (x_ref, a, b), sync = x + a + b (x - x_ref).

    The clock model is linear per host, so two parameters reproduce it (to rounding) for times
    that are not kernel times, such as NVTX ranges.
    """
    x = np.concatenate([ops_h["kernel_start_utc"].to_numpy(dtype=np.int64),
                        ops_h["kernel_end_utc"].to_numpy(dtype=np.int64)])  # fmt: skip
    y = np.concatenate([ops_h["kernel_start_sync"].to_numpy(dtype=np.int64),
                        ops_h["kernel_end_sync"].to_numpy(dtype=np.int64)])  # fmt: skip
    x_ref = int(np.median(x))
    u = (x - x_ref).astype(np.float64)
    d = (y - x).astype(np.float64)
    if len(x) < 2 or np.ptp(u) == 0:
        return x_ref, float(np.median(d)), 0.0
    b, a = np.polyfit(u, d, 1)
    return x_ref, float(a), float(b)


def _prepare_nvtx(
    nvtx: Mapping[str, pd.DataFrame] | None,
    ops: pd.DataFrame,
    row_proc: pd.Series,
    procs: pd.DataFrame,
    host_clock: Mapping[str, str],
    notes: list[str],
) -> pd.DataFrame:
    """NVTX ranges and marks of every export on the trace clock, with the trace pid of their process."""
    cols = ["proc", "t0", "t1", "text", "domain", "tid"] + [c for _, c, _ in _NVTX_ARGS if c not in ("domain", "tid")]
    if not nvtx:
        return pd.DataFrame(columns=cols)
    timed = ops["kernel_start"].notna() & ops["kernel_start_utc"].notna() if "kernel_start" in ops else None
    gpid_proc: dict[int, int] = {}
    if "kernel_global_pid" in ops:
        m = ops["kernel_global_pid"].notna() & row_proc.notna()
        gpid_proc = dict(zip(ops.loc[m, "kernel_global_pid"].astype("int64").tolist(),
                             row_proc[m].astype("int64").tolist()))  # fmt: skip
    hostpid_proc = {(h, int(p)): int(i) for i, h, p in zip(procs.index, procs["host"], procs["os_pid"])}
    out = []
    for export, frame in nvtx.items():
        if frame is None or len(frame) == 0:
            continue
        f = frame
        if "event_type" in f:
            f = f[f["event_type"].isin(_NVTX_KINDS)]
        host = str(f["host"].dropna().iloc[0]) if "host" in f and f["host"].notna().any() else str(export)
        gtid = _int_or(f["global_tid"], 0) if "global_tid" in f else np.zeros(len(f), np.int64)
        gpid = gtid - (gtid & 0xFFFFFF)
        pid = _int_or(f["pid"], -1) if "pid" in f else np.full(len(f), -1)
        # The process by nsys globalPid (exact), else by host and OS pid.
        by_gpid = pd.Series(gpid).map(gpid_proc)
        by_pid = pd.Series(pid).map({p: i for (h, p), i in hostpid_proc.items() if h == host})
        proc = by_gpid.fillna(by_pid).fillna(-1).to_numpy(dtype=np.int64)
        # The clock is the one of the host the log lines name for these processes (the export's
        # own host name may be spelled differently).
        mapped = proc[proc >= 0]
        if len(mapped):
            host = str(procs.loc[np.unique(mapped), "host"].mode().iloc[0])
        # Session clock -> UTC: the export's offset, else the one its kernels in ops imply.
        if "utc_offset_ns" in f and f["utc_offset_ns"].notna().any():
            offset = int(f["utc_offset_ns"].dropna().iloc[0])
        else:
            pos = np.isin(_int_or(ops["kernel_global_pid"], 0), np.unique(gpid)) if "kernel_global_pid" in ops else None
            sel = timed & pd.Series(pos, index=ops.index) if timed is not None and pos is not None else None
            if sel is None or not sel.any():
                notes.append(f"NVTX of {export}: no UTC offset known (no session info, no kernels); skipped")
                continue
            diff = ops.loc[sel, "kernel_start_utc"].astype("int64") - ops.loc[sel, "kernel_start"].astype("int64")
            offset = int(diff.mode().iloc[0])
        start = f["start"].to_numpy(dtype=np.int64) + offset
        end_na = f["end"].isna().to_numpy()
        end = _int_or(f["end"], 0) + offset
        if host_clock.get(host) == "sync":
            h_ops = ops[(ops["host"].astype("string") == host) & ops["kernel_start_sync"].notna()
                        & ops["kernel_end_sync"].notna() & ops["kernel_start_utc"].notna()]  # fmt: skip
            x_ref, a, b = _sync_map(h_ops)
            start = start + np.rint(a + b * (start - x_ref)).astype(np.int64)
            end = end + np.rint(a + b * (end - x_ref)).astype(np.int64)
        etype = _int_or(f["event_type"], 59) if "event_type" in f else np.full(len(f), 59)
        is_mark = etype == _NVTX_MARK
        unterminated = end_na & ~is_mark
        no_proc = proc < 0
        if unterminated.any():
            notes.append(f"NVTX of {export}: {int(unterminated.sum())} unterminated ranges not shown")
        if (no_proc & ~unterminated).any():
            notes.append(f"NVTX of {export}: {int((no_proc & ~unterminated).sum())} events of processes without "
                         "NCCL log lines not shown")  # fmt: skip
        keep = ~unterminated & ~no_proc & (is_mark | (end >= start))
        d = pd.DataFrame({"proc": proc[keep], "t0": start[keep], "t1": np.where(is_mark, -1, end)[keep]})
        for c in cols[3:]:
            d[c] = f[c].to_numpy()[keep] if c in f else None
        if "tid" not in f:
            d["tid"] = 0
        out.append(d)
    if not out:
        return pd.DataFrame(columns=cols)
    res = pd.concat(out, ignore_index=True)
    res["tid"] = _int_or(res["tid"], 0)
    return res


def _comm_names(rows: pd.DataFrame, labels: pd.DataFrame | None) -> dict[Any, tuple[str, tuple]]:
    """Thread name and sort key of each communicator track."""
    info: dict[int, tuple[str, Any]] = {}
    if labels is not None and len(labels) and "logical_id" in labels:
        for lid, par, n in zip(labels["logical_id"], labels.get("parallelism", pd.Series([None] * len(labels))),
                               labels.get("nranks", pd.Series([None] * len(labels)))):  # fmt: skip
            if not _is_na(lid):
                info[int(lid)] = (None if _is_na(par) else str(par), None if _is_na(n) else int(n))
    out: dict[Any, tuple[str, tuple]] = {}
    calls = rows[rows["_comm_key"].notna()]
    firsts = calls.drop_duplicates("_comm_key")
    for key, lid, par, n, comm in zip(firsts["_comm_key"], firsts["logical_id"], firsts["parallelism"],
                                      firsts["nranks"], firsts["comm"]):  # fmt: skip
        if isinstance(key, str) and key.startswith("ptr:"):
            out[key] = (f"comm {_hex(comm)} (unresolved)", (len(_PAR_ORDER) + 1, "~", 1 << 62, key))
            continue
        lid = int(lid)
        lpar, ln = info.get(lid, (None, None))
        par = lpar or (None if _is_na(par) else str(par)) or "unknown"
        n = ln if ln is not None else (None if _is_na(n) else int(n))
        size = f" ({n} rank{'' if n == 1 else 's'})" if n is not None else ""
        order = _PAR_ORDER.index(par) if par in _PAR_ORDER else len(_PAR_ORDER)
        out[key] = (f"{par} comm #{lid}{size}", (order, par, lid, ""))
    return out


def _p2p_keys(ops: pd.DataFrame, row_proc: pd.Series) -> pd.Series:
    """'p2p:<lid>:<src>><dst>#<k>' for Send/Recv call lines, NA otherwise.

    Send/Recv on one communicator between two ranks are matched in order (NCCL delivers P2P
    operations between a pair in issue order): the k-th Send from a to b pairs with the k-th
    Recv at b from a. Sequence numbers count every call line of the process (matched or not),
    so a missing kernel does not shift the pairing; duplicate lines are left out.
    """
    out = pd.Series(pd.NA, index=ops.index, dtype="string")
    need = {"op", "logical_id", "rank_in_comm", "root", "file", "line"}
    if not need <= set(ops.columns):
        return out
    m = ops["op"].isin(["Send", "Recv"]) & ops["logical_id"].notna() & ops["rank_in_comm"].notna() & ops["root"].notna()
    if "row_kind" in ops:
        m &= ops["row_kind"] == "call"
    if "duplicate_of" in ops:
        m &= ops["duplicate_of"].isna()
    if not m.any():
        return out
    p = ops.loc[m, ["op", "logical_id", "rank_in_comm", "root", "file", "line"]].copy()
    p["proc"] = row_proc[m]
    send = p["op"] == "Send"
    p["src"] = np.where(send, p["rank_in_comm"].astype("int64"), p["root"].astype("int64"))
    p["dst"] = np.where(send, p["root"].astype("int64"), p["rank_in_comm"].astype("int64"))
    p = p.sort_values(["proc", "file", "line"])
    p["k"] = p.groupby(["proc", "logical_id", "op", "src", "dst"]).cumcount()
    keys = ("p2p:" + p["logical_id"].astype("int64").astype(str) + ":" + p["src"].astype(str) + ">"
            + p["dst"].astype(str) + "#" + p["k"].astype(str))  # fmt: skip
    # Only keys with exactly one Send and one Recv form a pair.
    g = pd.DataFrame({"key": keys.to_numpy(), "send": send.loc[p.index].to_numpy(dtype=bool)}).groupby("key")["send"]
    good = set(g.size().index[(g.size() == 2) & (g.sum() == 1)])
    keys = keys.where(keys.isin(good))
    out.loc[keys.index] = keys.astype("string")
    return out


def _prepare(
    ops: pd.DataFrame,
    op_metrics: pd.DataFrame | None,
    nvtx: Mapping[str, pd.DataFrame] | None,
    labels: pd.DataFrame | None,
) -> _Prepared:
    notes: list[str] = []
    ops = ops.reset_index(drop=True)
    for c in ("kernel_start_utc", "kernel_end_utc", "host", "pid"):
        if c not in ops:
            raise ValueError(f"ops table lacks column {c!r} (expected the ops.parquet schema)")
    procs, row_proc = _processes(ops, notes)
    host_clock = _host_clocks(ops, notes)
    clock = _overall_clock(host_clock)
    host = ops["host"].astype("string").fillna("?")
    use_sync = host.map(lambda h: host_clock.get(h) == "sync").astype(bool)
    t0 = ops["kernel_start_utc"].astype("Int64")
    t1 = ops["kernel_end_utc"].astype("Int64")
    if use_sync.any():
        t0 = t0.where(~use_sync, ops["kernel_start_sync"].astype("Int64"))
        t1 = t1.where(~use_sync, ops["kernel_end_sync"].astype("Int64"))
    timed = t0.notna() & t1.notna()
    bad = timed & (t1 < t0)
    if bad.any():
        notes.append(f"{int(bad.sum())} rows with kernel end before start not shown")
        timed &= ~bad

    is_call = (
        ops["row_kind"].eq("call").fillna(False).astype(bool) if "row_kind" in ops else pd.Series(True, index=ops.index)
    )
    reason = ops["reason"].astype("string").fillna("unknown") if "reason" in ops else "unknown"
    un = pd.DataFrame({"proc": row_proc, "reason": reason})[is_call & ~timed]
    unmatched = un.groupby(["proc", "reason"]).size().rename("n").reset_index()

    flow = ops["instance"].astype("string") if "instance" in ops else pd.Series(pd.NA, index=ops.index, dtype="string")
    flow = flow.where(flow.notna(), _p2p_keys(ops, row_proc))

    rows = ops[timed].copy()
    rows["proc"] = row_proc[timed].astype("int64")
    rows["t0"] = t0[timed].astype("int64")
    rows["t1"] = t1[timed].astype("int64")
    rows["_flow"] = flow[timed]
    rows["_is_call"] = is_call[timed].to_numpy()
    if op_metrics is not None and len(op_metrics):
        m = op_metrics[[c for c in ["file", "line", *_METRIC_COLUMNS] if c in op_metrics]]
        m = m.drop_duplicates(["file", "line"])
        m = m.astype({"file": "string", "line": "Int64"})
        rows = rows.drop(columns=[c for c in _METRIC_COLUMNS if c in rows and c in m])
        rows = rows.astype({"file": "string", "line": "Int64"}).merge(m, on=["file", "line"], how="left")
    rows = _derived_columns(rows)
    # Keep only what the events need: every later step copies the frame.
    keep = {c for _, c, _ in _OP_ARGS + _KERNEL_ARGS} | set(_LAYOUT_COLUMNS)
    rows = rows[[c for c in rows.columns if c in keep]]
    nv = _prepare_nvtx(nvtx, ops, row_proc, procs, host_clock, notes)

    starts = [rows["t0"].to_numpy()] + ([nv["t0"].to_numpy(dtype=np.int64)] if len(nv) else [])
    allt = np.concatenate(starts) if starts else np.empty(0, np.int64)
    origin = int(allt.min()) if len(allt) else None
    return _Prepared(
        procs=procs,
        rows=rows.reset_index(drop=True),
        nvtx=nv,
        unmatched=unmatched,
        origin=origin,
        clock=clock,
        host_clock=host_clock,
        comm_names=_comm_names(rows, labels),
        notes=notes,
    )


def _derived_columns(rows: pd.DataFrame) -> pd.DataFrame:
    """Columns the argument table needs that are combinations of ops columns."""
    n = len(rows)
    op = rows["op"].astype("string") if "op" in rows else pd.Series(pd.NA, index=rows.index, dtype="string")
    p2p = op.isin(["Send", "Recv"]).fillna(False).astype(bool)
    root = rows["root"] if "root" in rows else pd.Series(pd.NA, index=rows.index)
    rooted = op.isin(["Broadcast", "Reduce", "Gather", "Scatter"]).fillna(False).astype(bool)
    rows["_root"] = root.where(rooted)
    rows["_peer"] = root.where(p2p)
    if "redop_name" in rows:
        rows["_redop"] = rows["redop_name"].where(op.isin(["AllReduce", "ReduceScatter", "Reduce"]).fillna(False))
    if "parallelism_candidates" in rows:
        cand = rows["parallelism_candidates"].astype("string")
        rows["_cands"] = cand.where(cand.str.contains(",", regex=False).fillna(False))
    for what in ("grid", "block"):
        cs = [f"{what}_{a}" for a in "xyz"]
        if all(c in rows for c in cs):
            x, y, z = (rows[c].astype("Int64").astype("string") for c in cs)
            rows[f"_{what}"] = "<<" + x + ", " + y + ", " + z + ">>"
        else:
            rows[f"_{what}"] = [None] * n
    if "file" in rows and "line" in rows:
        ln = rows["line"].astype("Int64").astype("string")
        rows["_logline"] = (rows["file"].astype("string") + ":" + ln).astype(object)
    else:
        rows["_logline"] = None
    is_call = rows["_is_call"].astype(bool)
    rows["_kmatch"] = np.where(is_call, None, "no log line (kernel without a call)")
    rows["_comm_key"] = _comm_key(rows).where(is_call)
    return rows


def _comm_key(rows: pd.DataFrame) -> pd.Series:
    """Communicator track of each row: 'lid:<logical id>', or 'ptr:<pointer>' when unresolved."""
    na = pd.Series(pd.NA, index=rows.index, dtype="string")
    lid = rows["logical_id"].astype("Int64").astype("string") if "logical_id" in rows else na
    comm = rows["comm"].astype("UInt64").astype("string") if "comm" in rows else na
    return ("lid:" + lid).fillna("ptr:" + comm).astype(object).where(lambda x: x.notna(), None)


# --------------------------------------------------------------------------- selection and layout


def _kernel_key(rows: pd.DataFrame) -> np.ndarray:
    """Identifier of each row's kernel launch (rows of one grouped launch share it)."""
    g = _int_or(rows["kernel_global_pid"], -1) if "kernel_global_pid" in rows else np.full(len(rows), -1)
    c = _int_or(rows["kernel_correlation_id"], -1) if "kernel_correlation_id" in rows else np.full(len(rows), -1)
    proc = rows["proc"].to_numpy()
    t0 = rows["t0"].to_numpy()
    # Without a correlation id the launch is identified by process and start time.
    frame = pd.DataFrame({"a": np.where(c >= 0, g, proc), "b": np.where(c >= 0, c, -1 - t0), "p": proc})
    return frame.groupby(["p", "a", "b"], sort=False).ngroup().to_numpy()


def _lanes(t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Lane of each slice (input sorted by start, longest first) so that every lane nests strictly."""
    out = np.zeros(len(t0), dtype=np.int64)
    if len(t0) < 2 or bool(np.all(t0[1:] >= np.maximum.accumulate(t1)[:-1])):
        return out  # no two slices overlap: the common case of a stream or a communicator
    stacks: list[list[int]] = []
    for i, (s, e) in enumerate(zip(t0.tolist(), t1.tolist())):
        for k, st in enumerate(stacks):
            while st and st[-1] <= s:
                st.pop()
            if not st or st[-1] >= e:
                st.append(e)
                out[i] = k
                break
        else:
            stacks.append([e])
            out[i] = len(stacks) - 1
    return out


@dataclass
class _Selection:
    rows: pd.DataFrame  # call + kernel rows selected (proc, t0, t1, ...)
    nvtx: pd.DataFrame
    window_abs: tuple[int, int] | None


def _select(prep: _Prepared, ranks: set[int] | None, window_abs: tuple[int, int] | None,
            min_bytes: int | None, start_before: int | None) -> _Selection:  # fmt: skip
    r = prep.rows
    m = np.ones(len(r), dtype=bool)
    if ranks is not None:
        m &= r["proc"].isin(ranks).to_numpy()
    if window_abs is not None:
        w0, w1 = window_abs
        m &= (r["t0"].to_numpy() < w1) & ((r["t1"].to_numpy() > w0) | (r["t0"].to_numpy() >= w0))
    if min_bytes is not None:
        mb = r["message_bytes"].astype("Float64").fillna(-1).to_numpy() if "message_bytes" in r else -np.ones(len(r))
        m &= mb >= min_bytes
    if start_before is not None:
        m &= r["t0"].to_numpy() < start_before
    v = prep.nvtx
    mv = np.ones(len(v), dtype=bool)
    if len(v):
        if ranks is not None:
            mv &= v["proc"].isin(ranks).to_numpy()
        vt0 = v["t0"].to_numpy(dtype=np.int64)
        vt1 = v["t1"].to_numpy(dtype=np.int64)
        if window_abs is not None:
            w0, w1 = window_abs
            mark = vt1 < 0
            mv &= np.where(mark, (vt0 >= w0) & (vt0 < w1), (vt0 < w1) & ((vt1 > w0) | (vt0 >= w0)))
        if start_before is not None:
            mv &= vt0 < start_before
    return _Selection(rows=r[m], nvtx=v[mv], window_abs=window_abs)


@dataclass
class _Layout:
    """Events of one process, ready to format: per kind a frame sorted by start, with tid."""

    kernels: pd.DataFrame
    calls: pd.DataFrame
    par: pd.DataFrame
    nvtx: pd.DataFrame
    threads: list[tuple[int, str]]  # (tid, name) in display order


def _track_codes(name: str, f: pd.DataFrame) -> tuple[np.ndarray, list[tuple]]:
    """Track of each event of one kind: integer codes and the track tuple of each code."""
    if name == "kernels":
        sid = _int_or(f["kernel_stream_id"], -1) if "kernel_stream_id" in f else np.full(len(f), -1)
        codes, uniq = pd.factorize(sid)
        return codes, [("stream", int(u)) for u in uniq]
    if name == "calls":
        codes, uniq = pd.factorize(f["_comm_key"])
        return codes, [("comm", u) for u in uniq]
    if name == "par":
        return np.zeros(len(f), dtype=np.int64), [("par",)]
    dom = f["domain"].astype("string").fillna("")
    codes, uniq = pd.factorize(f["tid"].astype(str) + "|" + dom)
    return codes, [("nvtx", int(u.split("|", 1)[0]), u.split("|", 1)[1]) for u in uniq]


def _layout(prep: _Prepared, rows: pd.DataFrame, nv: pd.DataFrame, flows: pd.DataFrame) -> _Layout:
    """Events of one process per kind, each with the thread (tid) it is drawn on."""
    rows = rows.sort_values(["t0", "t1"], ascending=[True, False], kind="stable")
    kkey = _kernel_key(rows) if len(rows) else np.empty(0, np.int64)
    rows = rows.assign(_kkey=kkey)
    # Kernel slices: one per launch; the count of calls it carried is an argument.
    nops = rows.groupby("_kkey")["_is_call"].transform("sum")
    kern = rows.assign(_nops=nops.to_numpy()).drop_duplicates("_kkey")
    calls = rows[rows["_is_call"].astype(bool) & rows["_comm_key"].notna()]
    calls = calls.join(flows, how="left") if len(flows) else calls.assign(_bind=-1, _in=False, _out=False)
    pname = calls["parallelism"].astype("string").fillna("unknown") if "parallelism" in calls else "unknown"
    par = calls.assign(_pname=pname).drop_duplicates(["_kkey", "_pname"])
    if len(nv):
        nv = nv.assign(_t1s=np.where(nv["t1"].to_numpy() < 0, nv["t0"].to_numpy(), nv["t1"].to_numpy()))
        nv = nv.sort_values(["t0", "_t1s"], ascending=[True, False], kind="stable")
    else:
        nv = nv.assign(_t1s=np.zeros(0, np.int64))

    # Lanes per track, then one thread per (track, lane) in display order.
    frames = {"kernels": kern, "calls": calls, "par": par, "nvtx": nv}
    placed: dict[str, tuple[np.ndarray, np.ndarray, list[tuple]]] = {}
    lanes: dict[tuple, int] = {}
    for name, f in frames.items():
        if not len(f):
            continue
        codes, tracks = _track_codes(name, f)
        lane = np.zeros(len(f), dtype=np.int64)
        t0 = f["t0"].to_numpy(dtype=np.int64)
        t1 = f["_t1s" if name == "nvtx" else "t1"].to_numpy(dtype=np.int64)
        order = np.argsort(codes, kind="stable")  # keeps each track's events in start order
        bounds = np.flatnonzero(np.diff(codes[order])) + 1
        for pos in np.split(order, bounds):
            lane[pos] = _lanes(t0[pos], t1[pos])
            tr = tracks[codes[pos[0]]]
            lanes[tr] = max(lanes.get(tr, 0), int(lane[pos].max()) + 1)
        placed[name] = (codes, lane, tracks)

    def sort_key(tr: tuple) -> tuple:
        if tr[0] == "nvtx":
            return (0, tr[1], tr[2] != "", tr[2])
        if tr[0] == "par":
            return (1,)
        if tr[0] == "comm":
            return (2, *prep.comm_names.get(tr[1], ("", (99, "", 0, "")))[1])
        return (3, tr[1])

    nvtx_tids = {tr[1] for tr in lanes if tr[0] == "nvtx"}
    threads: list[tuple[int, str]] = []
    tid_of: dict[tuple, int] = {}
    for tr in sorted(lanes, key=sort_key):
        if tr[0] == "nvtx":
            base = "NVTX" + (f" {tr[2]}" if tr[2] else "") + (f" (tid {tr[1]})" if len(nvtx_tids) > 1 else "")
        elif tr[0] == "par":
            base = "parallelism"
        elif tr[0] == "comm":
            base = prep.comm_names.get(tr[1], (str(tr[1]), ()))[0]
        else:
            base = f"stream {tr[1]}" if tr[1] >= 0 else "stream (unknown)"
        for k in range(lanes[tr]):
            tid = len(threads) + 1
            tid_of[(tr, k)] = tid
            threads.append((tid, base if k == 0 else f"{base} (lane {k + 1})"))
    for name, f in frames.items():
        if name not in placed:
            frames[name] = f.assign(_tid=np.zeros(len(f), dtype=np.int64))
            continue
        codes, lane, tracks = placed[name]
        width = int(lane.max()) + 1
        table = np.array([tid_of.get((tr, k), 0) for tr in tracks for k in range(width)], dtype=np.int64)
        frames[name] = f.assign(_tid=table[codes * width + lane])
    return _Layout(kernels=frames["kernels"], calls=frames["calls"], par=frames["par"], nvtx=frames["nvtx"],
                   threads=threads)  # fmt: skip


def _flows(rows: pd.DataFrame) -> pd.DataFrame:
    """bind id and flow direction of each selected call row in a cross-rank chain (>= 2 processes)."""
    calls = rows[rows["_is_call"].astype(bool) & rows["_flow"].notna() & rows["_comm_key"].notna()]
    if not len(calls):
        return pd.DataFrame(columns=["_bind", "_in", "_out"])
    f = pd.DataFrame({"key": calls["_flow"].astype(str), "t0": calls["t0"], "proc": calls["proc"]}, index=calls.index)
    f = f.sort_values(["key", "t0", "proc"], kind="stable")
    g = f.groupby("key", sort=False)
    size = g["proc"].transform("size").to_numpy()
    nproc = g["proc"].transform("nunique").to_numpy()
    pos = g.cumcount().to_numpy()
    code = g.ngroup().to_numpy()
    keep = (size >= 2) & (nproc >= 2)
    return pd.DataFrame({"_bind": np.where(keep, code, -1), "_in": keep & (pos > 0), "_out": keep & (pos < size - 1)},
                        index=f.index)  # fmt: skip


# --------------------------------------------------------------------------- writing


class _Sink:
    """Comma-separated JSON events into a gzip stream, counting events and bytes."""

    def __init__(self, fh, max_events: int | None) -> None:
        self.fh = fh
        self.n = 0
        self.json_bytes = 0
        self.max_events = max_events
        self.truncated = False
        self.counts: dict[str, int] = {}

    def write(self, events: list[str], kind: str) -> None:
        if not events:
            return
        if self.max_events is not None and self.n + len(events) > self.max_events:
            events = events[: max(0, self.max_events - self.n)]
            self.truncated = True
            if not events:
                return
        text = ("," if self.n else "") + ",\n".join(events) + "\n"
        data = text.encode()
        self.fh.write(data)
        self.json_bytes += len(data)
        self.n += len(events)
        self.counts[kind] = self.counts.get(kind, 0) + len(events)


def _args_column(frame: pd.DataFrame, spec: list[tuple[str, str, str]]) -> list[str]:
    """The inside of the ``args`` object of each row."""
    cols = [_fragments(key, kind, frame[col]).tolist() for key, col, kind in spec if col in frame]
    if not cols:
        return [""] * len(frame)
    # Every present fragment starts with a comma: drop the first one.
    return ["".join(t)[1:] for t in zip(*cols)]


def _names(values: pd.Series, default: str) -> list[str]:
    """JSON strings of slice names (nulls and empty strings get ``default``)."""
    codes, uniq = pd.factorize(values, use_na_sentinel=True)
    texts = [json.dumps(default if _is_na(u) or str(u) == "" else str(u)) for u in list(uniq)]
    table = np.array(texts + [json.dumps(default)], dtype=object)
    return table[codes].tolist()


def _write_slices(sink: _Sink, f: pd.DataFrame, pid: int, origin: int, kind: str, cat: str, name_col: str,
                  default_name: str, spec: list | None, with_flow: bool = False) -> None:  # fmt: skip
    head = f'{{"ph":"X","cat":"{cat}","pid":{pid},"tid":'
    for a in range(0, len(f), _CHUNK_ROWS):
        c = f.iloc[a : a + _CHUNK_ROWS]
        t0 = c["t0"].to_numpy(dtype=np.int64)
        t1 = c["t1"].to_numpy(dtype=np.int64)
        ts = _ts(t0 - origin)
        dur = _ts(t1 - t0)
        nm = _names(c[name_col], default_name)
        args = _args_column(c, spec) if spec else [""] * len(c)
        tids = c["_tid"].tolist()
        if with_flow:
            binds = c["_bind"].fillna(-1).astype("int64").tolist()
            fin = c["_in"].fillna(False).astype(bool).tolist()
            fout = c["_out"].fillna(False).astype(bool).tolist()
            flow = [("" if b < 0 else f',"bind_id":"0x{b:x}"' + (',"flow_in":true' if i else "")
                     + (',"flow_out":true' if o else "")) for b, i, o in zip(binds, fin, fout)]  # fmt: skip
        else:
            flow = [""] * len(c)
        sink.write([f'{head}{t},"ts":{s},"dur":{d},"name":{n}{fl},"args":{{{ar}}}}}'
                    for t, s, d, n, fl, ar in zip(tids, ts, dur, nm, flow, args)], kind)  # fmt: skip


def _write_nvtx(sink: _Sink, f: pd.DataFrame, pid: int, origin: int) -> None:
    for a in range(0, len(f), _CHUNK_ROWS):
        c = f.iloc[a : a + _CHUNK_ROWS]
        t0 = c["t0"].to_numpy(dtype=np.int64)
        t1 = c["t1"].to_numpy(dtype=np.int64)
        ts = _ts(t0 - origin)
        dur = _ts(np.maximum(t1 - t0, 0))
        nm = _names(c["text"], "(unnamed)")
        args = _args_column(c, _NVTX_ARGS)
        ev = []
        for t, s, d, n, ar, end in zip(c["_tid"].tolist(), ts, dur, nm, args, t1.tolist()):
            if end < 0:  # a mark
                ev.append(
                    f'{{"ph":"i","s":"t","cat":"nvtx","pid":{pid},"tid":{t},"ts":{s},"name":{n},"args":{{{ar}}}}}'
                )
            else:
                ev.append(f'{{"ph":"X","cat":"nvtx","pid":{pid},"tid":{t},"ts":{s},"dur":{d},"name":{n},'
                          f'"args":{{{ar}}}}}')  # fmt: skip
        sink.write(ev, "nvtx")


def _meta(pid: int, tid: int, name: str, args: dict) -> str:
    return json.dumps({"ph": "M", "pid": pid, "tid": tid, "name": name, "args": args}, separators=(",", ":"))


def _unmatched_label(un: pd.DataFrame) -> str | None:
    if not len(un):
        return None
    total = int(un["n"].sum())
    parts = ", ".join(f"{r} {int(n)}" for r, n in sorted(zip(un["reason"], un["n"]), key=lambda x: -x[1]))
    return f"ops without kernel time: {total} ({parts})"


def _event_count(prep: _Prepared, sel: _Selection, flows: pd.DataFrame) -> tuple[int, np.ndarray]:
    """Events the selection would write (exact) and the start times of its data events."""
    total = 1  # trace info
    times = []
    for proc, rows in sel.rows.groupby("proc", sort=False):
        nv = sel.nvtx[sel.nvtx["proc"] == proc] if len(sel.nvtx) else sel.nvtx
        lay = _layout(prep, rows, nv, flows.loc[flows.index.intersection(rows.index)] if len(flows) else flows)
        total += 3 + 2 * len(lay.threads) + len(lay.kernels) + len(lay.calls) + len(lay.par) + len(lay.nvtx)
        for f in (lay.kernels, lay.calls, lay.par, lay.nvtx):
            times.append(f["t0"].to_numpy(dtype=np.int64))
    rest = set(sel.nvtx["proc"].unique()) - set(sel.rows["proc"].unique()) if len(sel.nvtx) else set()
    for proc in rest:
        nv = sel.nvtx[sel.nvtx["proc"] == proc]
        lay = _layout(prep, sel.rows.iloc[0:0], nv, flows.iloc[0:0])
        total += 3 + 2 * len(lay.threads) + len(lay.nvtx)
        times.append(lay.nvtx["t0"].to_numpy(dtype=np.int64))
    return total, (np.concatenate(times) if times else np.empty(0, np.int64))


def _write(prep: _Prepared, out_path: Path, *, ranks: Iterable[int] | None, window_ns: tuple[int, int] | None,
           window_nvtx: str | None, min_message_bytes: int | None, max_events: int | None,
           run_label: str | None = None, read_before: int | None = None) -> TraceSummary:  # fmt: skip
    t_start = time.perf_counter()
    out_path = Path(out_path)
    notes = list(prep.notes)
    origin = prep.origin
    rank_set = None if ranks is None else {int(r) for r in ranks}
    window_abs = None
    if origin is not None and window_ns is not None:
        window_abs = (origin + int(window_ns[0]), origin + int(window_ns[1]))
    if origin is not None and window_nvtx is not None:
        v = prep.nvtx
        hit = v[(v["text"].astype("string") == window_nvtx) & (v["t1"] >= 0)] if len(v) else v
        if not len(hit):
            raise ValueError(f"no NVTX range named {window_nvtx!r} in the run")
        w = (int(hit["t0"].min()), int(hit["t1"].max()))
        window_abs = w if window_abs is None else (max(w[0], window_abs[0]), min(w[1], window_abs[1]))
    sel = _select(prep, rank_set, window_abs, min_message_bytes, None)
    flows = _flows(sel.rows)
    truncated = False
    if max_events is not None and origin is not None:
        n, times = _event_count(prep, sel, flows)
        if n > max_events:
            n_meta = n - len(times) - 1
            budget = max_events - n_meta - 1
            cutoff = origin if budget <= 0 else int(np.partition(times, budget)[budget])
            sel = _select(prep, rank_set, window_abs, min_message_bytes, cutoff)
            flows = _flows(sel.rows)
            truncated = True
            notes.append(f"max_events={max_events}: events starting at or after "
                         f"{(cutoff - origin) / 1e3:.3f} us not written")  # fmt: skip
    if read_before is not None and not truncated:
        # the caller read only the rows before this time (max_events could not hold more)
        truncated = True
        if origin is not None:
            notes.append(f"max_events={max_events}: events starting at or after "
                         f"{(read_before - origin) / 1e3:.3f} us not written")  # fmt: skip

    procs = prep.procs
    shown = set(sel.rows["proc"].unique().tolist()) | (
        set(sel.nvtx["proc"].unique().tolist()) if len(sel.nvtx) else set()
    )
    if rank_set is not None:
        shown |= rank_set & set(procs.index)
    else:
        shown |= set(procs.index)
    shown_list = sorted(int(p) for p in shown)
    un = prep.unmatched[prep.unmatched["proc"].isin(shown_list)]
    if len(un) and window_abs is not None:
        notes.append("ops without kernel time have no time and are counted for the whole run, not the window")
    if len(shown_list) == 1 and len(prep.procs) > 1:
        notes.append("single-process file: cross-rank flow arrows are only in the full trace")

    with atomic_output(out_path) as tmp:  # noqa: SIM117 (one with would not fit a line)
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=_GZIP_LEVEL, mtime=0) as gz:
            gz.write(b'{"traceEvents":[\n')
            sink = _Sink(gz, max_events - 1 if max_events is not None else None)
            by_proc = dict(tuple(sel.rows.groupby("proc", sort=False))) if len(sel.rows) else {}
            nv_by = dict(tuple(sel.nvtx.groupby("proc", sort=False))) if len(sel.nvtx) else {}
            for pid in shown_list:
                rows = by_proc.get(pid, sel.rows.iloc[0:0])
                nv = nv_by.get(pid, sel.nvtx.iloc[0:0])
                fl = flows.loc[flows.index.intersection(rows.index)] if len(flows) else flows
                lay = _layout(prep, rows, nv, fl)
                meta = [_meta(pid, 0, "process_name", {"name": procs.loc[pid, "name"]}),
                        _meta(pid, 0, "process_sort_index", {"sort_index": int(procs.loc[pid, "sort_index"])})]  # fmt: skip
                labels = [f"pid {procs.loc[pid, 'os_pid']}"]
                lab = _unmatched_label(un[un["proc"] == pid])
                if lab:
                    labels.append(lab)
                meta.append(_meta(pid, 0, "process_labels", {"labels": ", ".join(labels)}))
                for k, (tid, tname) in enumerate(lay.threads):
                    meta.append(_meta(pid, tid, "thread_name", {"name": tname}))
                    meta.append(_meta(pid, tid, "thread_sort_index", {"sort_index": k}))
                sink.write(meta, "metadata")
                if origin is None:
                    continue
                _write_nvtx(sink, lay.nvtx, pid, origin)
                _write_slices(sink, lay.par, pid, origin, "parallelism", "parallelism", "_pname", "unknown", None)
                _write_slices(sink, lay.calls, pid, origin, "calls", "op", "op", "(unknown op)", _OP_ARGS,
                              with_flow=True)  # fmt: skip
                _write_slices(sink, lay.kernels, pid, origin, "kernels", "kernel", "kernel_name", "(unnamed kernel)",
                              _KERNEL_ARGS)  # fmt: skip
            truncated = truncated or sink.truncated
            n_flows = int(flows["_bind"].ge(0).sum()) if len(flows) else 0
            info = _info(prep, origin, shown_list, window_abs, window_nvtx, min_message_bytes, max_events, truncated,
                         un, notes, run_label)  # fmt: skip
            info["events"] = sink.n + 1
            info["event_counts"] = {**sink.counts, "info": 1}
            info["flow_bound_slices"] = n_flows
            json_bytes = _close_trace(gz, sink, info, shown_list[0] if shown_list else 0)
            counts = dict(sink.counts)
            events = sink.n
    return TraceSummary(path=out_path, events=events, bytes=out_path.stat().st_size, ranks=shown_list,
                        clock=prep.clock, origin_utc_ns=origin, truncated=truncated, notes=notes,
                        json_bytes=json_bytes, seconds=time.perf_counter() - t_start, counts=counts)  # fmt: skip


def _close_trace(gz: Any, sink: _Sink, info: dict, pid: int) -> int:
    """Write the global "trace info" instant (never cut by the event cap), end the event list and
    write ``otherData``; returns the file's uncompressed size."""
    sink.max_events = None
    sink.write([json.dumps({"ph": "i", "s": "g", "pid": pid, "tid": 0, "ts": 0, "name": "trace info",
                            "cat": "nccltrace", "args": _flat_info(info)}, separators=(",", ":"))], "info")
    tail = '],"displayTimeUnit":"ns","otherData":' + json.dumps(info, separators=(",", ":")) + "}\n"
    gz.write(tail.encode())
    return len('{"traceEvents":[\n') + sink.json_bytes + len(tail)


def _info(prep: _Prepared, origin: int | None, procs: list[int], window_abs, window_nvtx, min_bytes, max_events,
          truncated: bool, un: pd.DataFrame, notes: list[str], run_label: str | None) -> dict:  # fmt: skip
    by_reason = un.groupby("reason")["n"].sum() if len(un) else pd.Series(dtype="int64")
    info: dict[str, Any] = {
        "generator": "nccltrace.outputs.perfetto",
        "trace_format_version": TRACE_FORMAT_VERSION,
        "run": run_label,
        "clock": prep.clock,
        "clock_by_host": dict(sorted(prep.host_clock.items())),
        # UTC ns exceed 2^53: as a string so no JSON reader rounds them.
        "origin_utc_ns": None if origin is None else str(origin),
        "origin_utc": None if origin is None else _iso(origin),
        "time_unit": "ts/dur in microseconds since origin_utc_ns (3 decimals = ns)",
        "processes": procs,
        "window_ns": None if window_abs is None or origin is None else [window_abs[0] - origin, window_abs[1] - origin],
        "window_nvtx": window_nvtx,
        "min_message_bytes": min_bytes,
        "max_events": max_events,
        "truncated": truncated,
        "ops_without_kernel_time": int(un["n"].sum()) if len(un) else 0,
        "ops_without_kernel_time_by_reason": {str(k): int(v) for k, v in by_reason.items()},
        "notes": notes,
    }
    return info


def _flat_info(info: dict) -> dict:
    """The info as viewer args (scalars and short strings)."""
    out = {}
    for k, v in info.items():
        if isinstance(v, (dict, list)):
            out[k] = json.dumps(v, separators=(",", ":"))
        elif v is not None:
            out[k] = v
    return out


def _iso(ns: int) -> str:
    s, r = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(s, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{r:09d}Z"


# --------------------------------------------------------------------------- summary trace

# Events of the summary trace when no budget is given: loads in any viewer within seconds.
SUMMARY_MAX_EVENTS = 200_000
# Kernels closer than this on one (rank, parallelism) track always share a burst.
_SUMMARY_MIN_GAP_NS = 1_000


def _track_gaps(proc: np.ndarray, kind: np.ndarray, t0: np.ndarray, t1: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """For kernel intervals sorted by (proc, kind, t0): where a track starts, the idle gap since
    everything before on the same track, and each interval's share of the busy time (the union
    of intervals, so overlapping kernels count once)."""
    n = len(t0)
    track_start = np.ones(n, dtype=bool)
    if n == 0:
        return track_start, np.zeros(0, np.int64), np.zeros(0, np.int64)
    track_start[1:] = (proc[1:] != proc[:-1]) | (kind[1:] != kind[:-1])
    track_id = np.cumsum(track_start) - 1
    # running max of the end time within each track (ends are >= starts, so offsetting each track
    # by its index times a span larger than any time keeps the cumulative max within the track)
    base = int(t0.min())
    span = int(t1.max()) - base + 1
    run_end = np.maximum.accumulate((t1 - base) + track_id * span) - track_id * span + base
    prev_end = np.empty(n, dtype=np.int64)
    prev_end[0] = t0[0]
    prev_end[1:] = run_end[:-1]
    gap = np.where(track_start, 0, t0 - prev_end)
    busy = np.where(track_start, t1 - t0, np.maximum(0, t1 - np.maximum(t0, prev_end)))
    return track_start, gap, busy


def _gap_threshold(gaps: np.ndarray, n_tracks: int, budget: int) -> int:
    """The smallest burst gap (>= 1 us) that keeps bursts within ``budget``: only gaps strictly
    above it split a track, so at most ``budget - n_tracks`` splits."""
    extra = max(0, budget - n_tracks)
    threshold = _SUMMARY_MIN_GAP_NS
    if len(gaps) > extra:
        threshold = max(threshold, int(np.partition(gaps, len(gaps) - extra - 1)[len(gaps) - extra - 1]))
    return threshold


def _summary_intervals(rows: pd.DataFrame) -> pd.DataFrame:
    """Call rows with kernel time -> one row per call: proc, par, kernel key, t0, t1, op, bytes."""
    rows = rows[rows["_is_call"].astype(bool)]
    par = (rows["parallelism"].astype("string").fillna("unknown") if "parallelism" in rows
           else pd.Series("unknown", index=rows.index, dtype="string"))  # fmt: skip
    return pd.DataFrame({
        "proc": rows["proc"].to_numpy(np.int64), "par": par.to_numpy(), "k": _kernel_key(rows) if len(rows) else [],
        "t0": rows["t0"].to_numpy(np.int64), "t1": rows["t1"].to_numpy(np.int64),
        "op": rows["op"].astype("string").fillna("?").to_numpy() if "op" in rows else "?",
        "bytes": rows["bytes"].astype("Float64").fillna(0).to_numpy(dtype=np.float64) if "bytes" in rows else 0.0,
    })  # fmt: skip


def _kernels_of(f: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray, np.ndarray, np.ndarray]:
    """One interval per kernel launch and parallelism (grouped calls share their kernel), sorted
    by track and start, with the track gaps."""
    kern = f.drop_duplicates(["proc", "par", "k"]).sort_values(["proc", "par", "t0"], kind="stable")
    code = pd.factorize(kern["par"])[0]
    start, gap, busy = _track_gaps(kern["proc"].to_numpy(np.int64), code, kern["t0"].to_numpy(np.int64),
                                   kern["t1"].to_numpy(np.int64))  # fmt: skip
    return kern, start, gap, busy


def _bursts_of(f: pd.DataFrame, threshold: int) -> pd.DataFrame:
    """Bursts of one set of complete tracks: proc, par, t0, t1, kernels, busy, ops, bytes, by_op."""
    if not len(f):
        return pd.DataFrame(columns=["proc", "par", "t0", "t1", "kernels", "busy", "ops", "bytes", "by_op"])
    kern, start, gap, busy = _kernels_of(f)
    kern = kern.assign(_b=np.cumsum(start | (gap > threshold)) - 1, _busy=busy)
    f = f.merge(kern[["proc", "par", "k", "_b"]], on=["proc", "par", "k"], how="left")
    g = kern.groupby("_b", sort=True)
    bursts = pd.DataFrame({"proc": g["proc"].first(), "par": g["par"].first(), "t0": g["t0"].min(),
                           "t1": g["t1"].max(), "kernels": g.size(), "busy": g["_busy"].sum()})  # fmt: skip
    fg = f.groupby("_b", sort=True)
    bursts["ops"] = fg.size()
    bursts["bytes"] = fg["bytes"].sum()
    by_op = f.groupby(["_b", "op"], sort=True).size().rename("n").reset_index()
    by_op["s"] = by_op["op"].astype(str) + " x" + by_op["n"].astype(str)
    bursts["by_op"] = by_op.groupby("_b")["s"].agg(", ".join)
    return bursts


def _write_summary(prep: _Prepared, out_path: Path, *, max_events: int | None, run_label: str | None,
                   chunks: Any = None) -> TraceSummary:  # fmt: skip
    """One slice per burst of communication per rank and parallelism (see write_summary_trace).

    ``chunks``: optional callable returning an iterator of interval frames (``_summary_intervals``
    with the trace's proc ids), each holding whole processes; it is called twice (gaps, then
    bursts), so the rows never need to be in memory together. Default: ``prep.rows``."""
    t_start = time.perf_counter()
    budget_total = SUMMARY_MAX_EVENTS if max_events is None else int(max_events)
    if chunks is None:
        whole = _summary_intervals(prep.rows)

        def chunks():
            return iter([whole])
    procs = prep.procs
    shown = sorted(int(p) for p in procs.index)
    n_meta = 4 * len(shown) + 2 * len(shown) * (len(_PAR_ORDER) + 2)
    nv = prep.nvtx
    iters = nv[(nv["t1"] >= 0) & nv["text"].astype("string").str.fullmatch(r"iteration \d+").fillna(False)] \
        if len(nv) else nv  # fmt: skip
    budget = max(1, budget_total - n_meta - len(iters) - 1)
    gaps, n_tracks = [], 0
    for f in chunks():
        if len(f):
            _kern, start, gap, _busy = _kernels_of(f)
            gaps.append(gap[~start])
            n_tracks += int(start.sum())
    threshold = _gap_threshold(np.concatenate(gaps) if gaps else np.zeros(0, np.int64), n_tracks, budget)
    del gaps
    origin = prep.origin
    notes = list(prep.notes)
    counts: dict[str, int] = {}
    with atomic_output(out_path) as tmp:  # noqa: SIM117 (one with would not fit a line)
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=_GZIP_LEVEL, mtime=0) as gz:
            gz.write(b'{"traceEvents":[\n')
            sink = _Sink(gz, None)
            nv_by = dict(tuple(iters.groupby("proc", sort=False))) if len(iters) else {}
            written: set[int] = set()

            def process_events(pid: int, b: pd.DataFrame) -> None:
                kinds = sorted(b["par"].unique().tolist(),
                               key=lambda k: (_PAR_ORDER.index(k) if k in _PAR_ORDER else len(_PAR_ORDER), k))
                tids = {k: i + 2 for i, k in enumerate(kinds)}
                meta = [_meta(pid, 0, "process_name", {"name": procs.loc[pid, "name"]}),
                        _meta(pid, 0, "process_sort_index", {"sort_index": int(procs.loc[pid, "sort_index"])}),
                        _meta(pid, 1, "thread_name", {"name": "iterations"}),
                        _meta(pid, 1, "thread_sort_index", {"sort_index": 0})]  # fmt: skip
                for k, tid in tids.items():
                    meta.append(_meta(pid, tid, "thread_name", {"name": f"{k} communication"}))
                    meta.append(_meta(pid, tid, "thread_sort_index", {"sort_index": tid}))
                sink.write(meta, "metadata")
                if origin is None:
                    return
                it = nv_by.get(pid)
                if it is not None and len(it):
                    t0 = it["t0"].to_numpy(np.int64)
                    t1 = it["t1"].to_numpy(np.int64)
                    sink.write([f'{{"ph":"X","cat":"nvtx","pid":{pid},"tid":1,"ts":{s},"dur":{d},"name":{json.dumps(str(n))}}}'
                                for s, d, n in zip(_ts(t0 - origin), _ts(np.maximum(t1 - t0, 0)), it["text"].tolist())],
                               "nvtx")  # fmt: skip
                if not len(b):
                    return
                t0 = b["t0"].to_numpy(np.int64)
                t1 = b["t1"].to_numpy(np.int64)
                ev = []
                for s, d, k, nk, no, by, busy, dur, ops in zip(
                        _ts(t0 - origin), _ts(t1 - t0), b["par"].tolist(), b["kernels"].tolist(), b["ops"].tolist(),
                        b["bytes"].tolist(), b["busy"].tolist(), (t1 - t0).tolist(), b["by_op"].tolist()):  # fmt: skip
                    args = {"Ops": int(no), "Kernels": int(nk), "Bytes": int(by), "Bytes (human)": _size(by),
                            "Busy (ns)": int(busy), "Busy Fraction": round(busy / dur, 4) if dur > 0 else 1.0,
                            "Ops by Type": ops}  # fmt: skip
                    ev.append(f'{{"ph":"X","cat":"summary","pid":{pid},"tid":{tids[k]},"ts":{s},"dur":{d},'
                              f'"name":{json.dumps(k)},"args":{json.dumps(args, separators=(",", ":"))}}}')  # fmt: skip
                sink.write(ev, "bursts")

            empty = _bursts_of(pd.DataFrame(), threshold)
            for f in chunks():
                bursts = _bursts_of(f, threshold)
                for pid, b in (bursts.groupby("proc", sort=True) if len(bursts) else []):
                    if int(pid) in procs.index and int(pid) not in written:
                        process_events(int(pid), b)
                        written.add(int(pid))
            for pid in shown:
                if pid not in written:
                    process_events(pid, empty)
            info = _info(prep, origin, shown, None, None, None, budget_total, False, prep.unmatched, notes, run_label)
            info["kind"] = "summary"
            info["summary"] = ("one slice per burst of communication per rank and parallelism: kernels on the "
                               "track separated by at most burst_gap_ns idle time; busy = union of kernel time")
            info["burst_gap_ns"] = int(threshold)
            info["events"] = sink.n + 1
            info["event_counts"] = {**sink.counts, "info": 1}
            json_bytes = _close_trace(gz, sink, info, shown[0] if shown else 0)
            counts = dict(sink.counts)
            events = sink.n
    return TraceSummary(path=out_path, events=events, bytes=out_path.stat().st_size, ranks=shown, clock=prep.clock,
                        origin_utc_ns=origin, truncated=False, notes=notes, json_bytes=json_bytes,
                        seconds=time.perf_counter() - t_start, counts=counts)  # fmt: skip


# --------------------------------------------------------------------------- public API


def write_chrome_trace(
    ops: pd.DataFrame,
    out_path: Path | str,
    *,
    op_metrics: pd.DataFrame | None = None,
    nvtx: Mapping[str, pd.DataFrame] | None = None,
    labels: pd.DataFrame | None = None,
    window_ns: tuple[int, int] | None = None,
    ranks: Iterable[int] | None = None,
    max_events: int | None = None,
    window_nvtx: str | None = None,
    min_message_bytes: int | None = None,
) -> TraceSummary:
    """Write the Chrome Trace Event JSON (gzip) of one run's ops table.

    ``ops``: the ops.parquet table (optionally with kernel columns ``grid_x..block_z``,
    ``registers_per_thread``, ``static_shared_memory``, ``dynamic_shared_memory`` and call
    columns ``sendbuff``, ``recvbuff``, ``stream``, ``redop_name``, shown when present).
    ``op_metrics``: per-op metrics keyed by (file, line); None omits those arguments.
    ``nvtx``: nvtx.parquet frames keyed by nsys export (host) name, times on the session clock;
    a ``host`` column names the host when it differs from the key, a ``utc_offset_ns`` column
    gives the session's UTC offset (else derived from the ops of the same processes).
    ``labels``: parallelism.parquet (communicator track names).
    ``window_ns``: (start, end) in ns relative to the run's first event; ``window_nvtx``: the
    extent of the NVTX ranges with this text (e.g. ``"iteration 3"``), intersected with
    ``window_ns`` if both are given. Slices overlapping the window are written whole.
    ``ranks``: global ranks (trace pids) to include. ``min_message_bytes``: leave out calls
    (and their kernels) below this message size. ``max_events``: cap on events; the trace is
    then cut at a time so that it stays a coherent prefix of every rank (``truncated``).
    The time origin is the run's first event over all ranks whatever is selected, so windowed
    and per-rank files share one time axis.
    """
    prep = _prepare(ops, op_metrics, nvtx, labels)
    return _write(prep, Path(out_path), ranks=ranks, window_ns=window_ns, window_nvtx=window_nvtx,
                  min_message_bytes=min_message_bytes, max_events=max_events)  # fmt: skip


def _read_optional(path: Path, columns: list[str] | None = None) -> pd.DataFrame | None:
    if not path.is_file():
        return None
    if columns is not None:
        import pyarrow.parquet as pq

        have = set(pq.read_schema(path).names)
        columns = [c for c in columns if c in have]
    return read_table(path, columns=columns)


def _ops_filter(before_ns: int | None) -> Any:
    """Rows whose kernel starts before ``before_ns`` on the trace clock, and rows without kernel time."""
    if before_ns is None:
        return None
    import pyarrow.dataset as ds

    sync, utc = ds.field("kernel_start_sync"), ds.field("kernel_start_utc")
    return (sync < before_ns) | (sync.is_null() & ((utc < before_ns) | utc.is_null()))


def _time_cut(ops_path: Path, max_rows: int) -> int | None:
    """The kernel start time (trace clock) before which at most ``max_rows`` timed rows lie, or
    None when every row fits. Reads two int64 columns only."""
    import pyarrow.compute as pc

    t = pq.read_table(ops_path, columns=["kernel_start_sync", "kernel_start_utc"])
    start = pc.coalesce(t["kernel_start_sync"], t["kernel_start_utc"]).drop_null().to_numpy()
    if len(start) <= max_rows:
        return None
    return int(np.partition(start, max_rows)[max_rows])


def _read_matching(path: Path, columns: list[str] | None, keys: pd.DataFrame, batch_rows: int = 200_000
                   ) -> pd.DataFrame | None:  # fmt: skip
    """The rows of a (file, line)-keyed table whose key is in ``keys``, read in batches so that
    memory holds the rows kept, not the table. None if the file or its key columns are missing."""
    if not path.is_file():
        return None
    pf = pq.ParquetFile(path)
    have = set(pf.schema_arrow.names)
    if not {"file", "line"} <= have:
        return None
    cols = None if columns is None else [c for c in columns if c in have]
    table = read_table(path, columns=cols).iloc[0:0] if pf.metadata.num_rows == 0 else None
    if table is not None:
        return table
    parts = []
    for batch in pf.iter_batches(batch_size=batch_rows, columns=cols):
        f = read_table_batch(batch).astype({"file": "string", "line": "Int64"})
        parts.append(f.merge(keys, on=["file", "line"], how="inner"))
    return pd.concat(parts, ignore_index=True)


def load_run_inputs(run_dir: Path | str, *, before_ns: int | None = None, columns: list[str] | None = None,
                    nvtx_text: str | None = None, procs: Iterable[str] | None = None,
                    hosts: Iterable[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The inputs of ``write_chrome_trace`` from a workflow run directory.

    Reads ops/ops.parquet (joined with kernel launch geometry from parsed/nsys/*/kernels.parquet
    and buffers/stream/reduction from parsed/nccl/*/*/calls.parquet when present),
    metrics/op_metrics.parquet, ops/parallelism.parquet and parsed/nsys/*/nvtx.parquet with the
    export's session.json (host name and UTC offset).

    For large runs: ``before_ns`` keeps only ops whose kernel starts before that time (and ops
    without kernel time), and NVTX events starting up to 1 s after it; ``columns`` reads only
    these ops columns and skips the kernel, call and metrics joins; ``nvtx_text`` (a regular
    expression) keeps only NVTX events whose text matches it. Each input is filtered as it is
    read, so memory follows what is kept, not the run. ``procs``/``hosts``: the processes and
    nodes whose parsed tables to read (a stage reads what it was given); default: every one in
    the run directory.
    """
    run_dir = Path(run_dir)
    layout = RunLayout(run_dir)
    ops_path = layout.ops
    if not ops_path.is_file():
        raise FileNotFoundError(f"{ops_path} not found: run the ops stage first")
    ops = read_table(ops_path, columns=columns, filters=_ops_filter(before_ns))
    light = columns is not None
    kcols = ["global_pid", "correlation_id", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
             "registers_per_thread", "static_shared_memory", "dynamic_shared_memory"]  # fmt: skip
    keys = None
    if not light and "kernel_correlation_id" in ops:
        keys = ops[["kernel_global_pid", "kernel_correlation_id"]].dropna().drop_duplicates()
        keys = keys.astype("int64").rename(columns={"kernel_global_pid": "global_pid",
                                                     "kernel_correlation_id": "correlation_id"})  # fmt: skip
    nvtx: dict[str, pd.DataFrame] = {}
    kernels = []
    nsys_dirs = [layout.parsed_nsys(h) for h in (hosts if hosts is not None else layout.find_hosts())]
    for d in nsys_dirs:
        session = {}
        if (d / SESSION_FILE).is_file():
            session = json.loads((d / SESSION_FILE).read_text())
        k = None if keys is None else _read_optional(d / KERNELS_FILE, kcols)
        if k is not None and {"global_pid", "correlation_id"} <= set(k.columns):
            # only the kernels of the ops kept (a semi-join per export keeps memory at one export)
            kernels.append(k.astype({"global_pid": "int64", "correlation_id": "int64"}).merge(keys, how="inner"))
        nv_filter = None
        if before_ns is not None and session.get("utc_offset_ns") is not None:
            # session clock; 1 s of margin covers any clock correction between the hosts
            nv_filter = [("start", "<", before_ns - int(session["utc_offset_ns"]) + 1_000_000_000)]
        v = read_table(d / NVTX_FILE, filters=nv_filter) if (d / NVTX_FILE).is_file() else None
        if v is not None:
            if nvtx_text is not None and "text" in v:
                v = v[v["text"].astype("string").str.fullmatch(nvtx_text).fillna(False).astype(bool)]
            v = v.copy()
            v["host"] = session.get("hostname") or d.name
            if session.get("utc_offset_ns") is not None:
                v["utc_offset_ns"] = int(session["utc_offset_ns"])
            nvtx[d.name] = v
    if kernels and "kernel_correlation_id" in ops:
        k = pd.concat(kernels, ignore_index=True).drop_duplicates(["global_pid", "correlation_id"])
        k = k.rename(columns={"global_pid": "kernel_global_pid", "correlation_id": "kernel_correlation_id"})
        k = k.astype({"kernel_global_pid": "Int64", "kernel_correlation_id": "Int64"})
        ops = ops.merge(k, on=["kernel_global_pid", "kernel_correlation_id"], how="left")
    calls = []
    lines = None
    if not light and {"file", "line"} <= set(ops.columns):
        lines = ops[["file", "line"]].dropna().drop_duplicates().astype({"file": "string", "line": "Int64"})
    call_tables = ([layout.parsed_nccl_table(p, "calls") for p in procs] if procs is not None
                   else [t for t in (layout.parsed_nccl_table(p, "calls") for p in layout.find_processes())
                         if t.is_file()])  # fmt: skip
    for p in [] if lines is None else call_tables:
        c = _read_matching(p, ["file", "line", "sendbuff", "recvbuff", "stream", "redop_name"], lines)
        if c is not None:
            calls.append(c)
    if calls:
        c = pd.concat(calls, ignore_index=True).drop_duplicates(["file", "line"])
        ops = ops.merge(c, on=["file", "line"], how="left")
    metrics = None
    if lines is not None:
        metrics = _read_matching(layout.metric("op_metrics"), None, lines)
    return {
        "ops": ops,
        "op_metrics": metrics,
        "labels": _read_optional(layout.labels),
        "nvtx": nvtx,
    }


# Ops columns the summary trace needs (everything else is left on disk).
_SUMMARY_COLUMNS = ["row_kind", "file", "line", "host", "pid", "comm", "logical_id", "nranks", "root", "rank_in_comm",
                    "global_rank", "op", "op_count", "bytes", "message_bytes", "parallelism", "instance",
                    "kernel_global_pid", "kernel_correlation_id", "kernel_start", "kernel_start_utc", "kernel_end_utc",
                    "kernel_start_sync", "kernel_end_sync", "status", "reason"]  # fmt: skip
# Timed ops rows loaded per capped event: a row becomes about 3 events (call, kernel, parallelism),
# so this loads a little more than the cap needs; the writer then cuts at the exact event count.
_ROWS_PER_EVENT = 0.5


def _process_row_groups(pf: Any) -> list[list[int]]:
    """Row groups of an ops file grouped by process (the ops stage writes each process's rows
    as consecutive row groups)."""
    groups: list[list[int]] = []
    prev = None
    for i in range(pf.num_row_groups):
        t = pf.read_row_group(i, columns=["host", "pid"])
        key = (t["host"][0].as_py(), t["pid"][0].as_py()) if t.num_rows else None
        if groups and key == prev:
            groups[-1].append(i)
        else:
            groups.append([i])
        prev = key
    return groups


def _summary_streamed(run_dir: Path, out_path: Path, *, max_events: int | None, origin: int | None,
                      run_label: str | None, hosts: Iterable[str] | None = None) -> TraceSummary:  # fmt: skip
    """The summary trace of a run directory, reading ops.parquet one process at a time: memory
    holds one process's rows, a sample of rows per process (to name processes and put NVTX on
    the trace clock) and the kernel gaps (8 bytes per kernel)."""
    ops_path = RunLayout(run_dir).ops
    pf = pq.ParquetFile(ops_path)
    cols = [c for c in _SUMMARY_COLUMNS if c in pf.schema_arrow.names]
    groups = _process_row_groups(pf)

    def read(group: list[int]) -> pd.DataFrame:
        return read_table_batch(pf.read_row_groups(group, columns=cols))

    # Pass 0: a sample of every process (first row of each kernel process id, every 64th timed
    # row) and the exact counts of calls without kernel time.
    sample, unmatched = [], []
    for g in groups:
        ops = read(g)
        if not len(ops):
            continue
        timed = ops["kernel_start_utc"].notna()
        pick = np.zeros(len(ops), dtype=bool)
        pick[np.flatnonzero(timed.to_numpy())[::64]] = True
        if "kernel_global_pid" in ops:
            pick[~ops["kernel_global_pid"].duplicated().to_numpy()] = True
        pick[0] = True
        sample.append(ops[pick])
        is_call = ops["row_kind"].eq("call").fillna(False).astype(bool) if "row_kind" in ops else True
        un = ops[is_call & ~(timed & ops["kernel_end_utc"].notna())]
        if len(un):
            reason = un["reason"].astype("string").fillna("unknown") if "reason" in un else "unknown"
            unmatched.append(pd.DataFrame({"host": un["host"].astype("string").fillna("?"),
                                           "os_pid": _int_or(un["pid"], -1), "reason": reason})
                             .groupby(["host", "os_pid", "reason"]).size().rename("n").reset_index())  # fmt: skip
    skeleton = pd.concat(sample, ignore_index=True) if sample else read_table(ops_path, columns=cols).iloc[0:0]
    nvtx = load_run_inputs(run_dir, columns=["host"], nvtx_text=r"iteration \d+", hosts=hosts)["nvtx"]
    prep = _prepare(skeleton, None, nvtx, None)
    del skeleton, sample
    key_to_proc = {(h, int(p)): int(i) for i, h, p in zip(prep.procs.index, prep.procs["host"], prep.procs["os_pid"])}
    if unmatched:
        un = pd.concat(unmatched, ignore_index=True)
        un["proc"] = [key_to_proc.get((h, int(p)), -1) for h, p in zip(un["host"], un["os_pid"])]
        prep.unmatched = un.groupby(["proc", "reason"])["n"].sum().reset_index()
    else:
        prep.unmatched = prep.unmatched.iloc[0:0]
    if origin is not None:
        prep.origin = origin if prep.origin is None else min(origin, prep.origin)

    def chunks():
        for g in groups:
            ops = read(g)
            if not len(ops):
                continue
            cp = _prepare(ops, None, None, None)
            local = {int(i): key_to_proc.get((h, int(p)), -1)
                     for i, h, p in zip(cp.procs.index, cp.procs["host"], cp.procs["os_pid"])}  # fmt: skip
            f = _summary_intervals(cp.rows)
            f["proc"] = f["proc"].map(local).astype("int64")
            yield f

    return _write_summary(prep, out_path, max_events=max_events, run_label=run_label, chunks=chunks)


def write_summary_trace(
    ops: pd.DataFrame,
    out_path: Path | str,
    *,
    nvtx: Mapping[str, pd.DataFrame] | None = None,
    max_events: int | None = SUMMARY_MAX_EVENTS,
    run_label: str | None = None,
) -> TraceSummary:
    """Write a summary trace: per rank, one track per parallelism with one slice per *burst* of
    communication (kernels separated by at most ``burst_gap_ns`` of idle time), with the number
    of ops and kernels, bytes, busy time (union of kernel intervals) and ops by type as
    arguments; plus the ``iteration N`` NVTX ranges. The gap is the smallest that keeps the file
    within ``max_events``, so the file size does not grow with the number of ops, and the time
    axis is the full trace's (same origin)."""
    prep = _prepare(ops, None, nvtx, None)
    return _write_summary(prep, Path(out_path), max_events=max_events, run_label=run_label)


def write_run_traces(
    run_dir: Path | str,
    out_dir: Path | str,
    *,
    split_per_rank: bool = False,
    window_ns: tuple[int, int] | None = None,
    max_events: int | None = None,
    window_nvtx: str | None = None,
    min_message_bytes: int | None = None,
    ranks: Iterable[int] | None = None,
    summary: bool = False,
    summary_max_events: int | None = SUMMARY_MAX_EVENTS,
    name: str = "trace",
    procs: Iterable[str] | None = None,
    hosts: Iterable[str] | None = None,
) -> list[TraceSummary]:
    """Write ``out_dir/<name>.json.gz`` for a run directory; with ``split_per_rank`` also
    ``out_dir/<name>.rank<g>.json.gz`` per process (``max_events`` applies to each file); with
    ``summary`` also ``out_dir/<name>.summary.json.gz`` (see ``write_summary_trace``).

    The inputs are read and put on one clock once; every file shares the run's time origin.
    ``procs``/``hosts``: the processes and nodes whose parsed tables are read (see
    :func:`load_run_inputs`).
    """
    procs = None if procs is None else list(procs)
    hosts = None if hosts is None else list(hosts)
    run_dir = Path(run_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out: list[TraceSummary] = []
    # A capped whole-run trace needs only the earliest rows: the rest are never read.
    cut = None
    if max_events is not None and window_ns is None and window_nvtx is None and ranks is None and not split_per_rank:
        cut = _time_cut(RunLayout(run_dir).ops, max(1, int(max_events * _ROWS_PER_EVENT)))
    inputs = load_run_inputs(run_dir, before_ns=cut, procs=procs, hosts=hosts)
    prep = _prepare(inputs["ops"], inputs["op_metrics"], inputs["nvtx"], inputs["labels"])
    del inputs  # the prepared rows are all that is needed from here on
    kw: dict[str, Any] = {"window_ns": window_ns, "window_nvtx": window_nvtx, "max_events": max_events,
                          "min_message_bytes": min_message_bytes, "run_label": run_dir.name}  # fmt: skip
    out.append(_write(prep, out_dir / f"{name}.json.gz", ranks=ranks, read_before=cut, **kw))
    if summary:
        # The summary needs every op but few columns: read and prepared on its own, on the full
        # trace's time origin (which also counts NVTX events the summary does not show).
        origin = prep.origin
        del prep
        out.append(_summary_streamed(run_dir, out_dir / f"{name}.summary.json.gz", max_events=summary_max_events,
                                     origin=origin, run_label=run_dir.name, hosts=hosts))  # fmt: skip
        if split_per_rank:
            inputs = load_run_inputs(run_dir, procs=procs, hosts=hosts)
            prep = _prepare(inputs["ops"], inputs["op_metrics"], inputs["nvtx"], inputs["labels"])
            del inputs
    if split_per_rank:
        wanted = None if ranks is None else {int(r) for r in ranks}
        for pid in sorted(int(p) for p in prep.procs.index):
            if wanted is not None and pid not in wanted:
                continue
            fname = f"{name}.rank{pid}.json.gz" if pid < UNKNOWN_RANK_PID_BASE else f"{name}.proc{pid}.json.gz"
            out.append(_write(prep, out_dir / fname, ranks=[pid], **kw))
    return out
