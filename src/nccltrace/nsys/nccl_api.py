"""NCCL API calls from NCCL's NVTX ranges, each linked to the kernel that executed it.

NCCL (>= 2.8.3) wraps every API call in a push/pop range of its own NVTX domain, and launches its
kernels from the calling thread inside the range of an ungrouped call or of the ``ncclGroupEnd``
closing the outermost group; so a kernel's launch record lies inside exactly one launch range,
a link that needs no payload and no log. A call is linked to a kernel only when that is exact,
otherwise the reason is recorded. Details: ``docs/nsys.md``, module notes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from nccltrace.nsys.schema import GPID_MASK, NCCL_COLUMN_KINDS, spec_schema

__all__ = [
    "CALL_OPS",
    "NCCL_API_CALLS_SCHEMA",
    "NCCL_API_CALL_COLUMNS",
    "NCCL_API_NAMES",
    "PAYLOAD_STATES",
    "STATUSES",
    "NcclApiCalls",
    "format_summary",
    "nccl_api_calls",
    "nccl_kernels",
    "nccl_range_mask",
]

# NVTX range name (without the ``nccl`` prefix) -> op as logged; ncclBcast is the legacy name.
CALL_OPS: dict[str, str] = {op: op for op in (
    "AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "Send", "Recv", "AlltoAll", "Gather", "Scatter",
    "PutSignal", "Signal", "WaitSignal")}  # fmt: skip
CALL_OPS["Bcast"] = "Broadcast"

# NCCL API functions that carry an NVTX range in some release (legacy NVTX tracing).
NCCL_API_NAMES: frozenset[str] = frozenset("nccl" + n for n in (
    *CALL_OPS, "GroupStart", "GroupEnd", "GroupSimulateEnd", "CommInitRank", "CommInitRankConfig",
    "CommInitRankScalable", "CommInitAll", "CommSplit", "CommShrink", "CommGrow", "CommFinalize", "CommDestroy",
    "CommAbort", "CommRevoke", "CommCount", "CommCuDevice", "CommUserRank", "CommGetAsyncError", "CommRegister",
    "CommDeregister", "CommWindowRegister", "CommWindowDeregister", "GetUniqueId", "MemAlloc", "MemFree",
    "RedOpCreatePreMulSum", "RedOpDestroy"))  # fmt: skip
_API_NAME = re.compile(r"nccl[A-Z][A-Za-z0-9]*")
# Payload schema entry names only NCCL registers (generic ones such as "Rank" or "Bytes" are left out).
_NCCL_SCHEMA_ENTRIES = frozenset({"NCCL communicator ID", "Parent NCCL communicator ID", "Message size [bytes]",
                                  "Peer rank", "Reduction operation", "No. of ranks"})  # fmt: skip

STATUSES: dict[str, str] = {
    "matched": "linked to the one kernel that executed it (kernel_* columns set)",
    "no_kernel": "its launch range launched no NCCL kernel in the export, or (by communicator) none of its "
                 "range's kernels is its communicator's",
    "kernel_missing": "a kernel launch lies in its launch range but that kernel's record is not in the export "
                      "(lost, or the kernel ran after the capture window)",
    "ambiguous_kernel": "its group launched several kernels (or one plus a lost launch) and which one is this "
                        "call's cannot be told exactly (no communicator ids, or one communicator split into plans)",
    "several_kernels": "the range is itself the launch range (ungrouped call, closing ncclGroupEnd) and launched "
                       "several kernels: all are its own, kernels_in_launch_range says how many",
    "no_launch_range": "a grouped call whose closing ncclGroupEnd is not in the export (capture ended inside the "
                       "group)",
    "not_a_launch": "ncclGroupStart, an inner ncclGroupEnd, communicator management or queries (CommCount, "
                    "CommInitRank, ...): launches no kernel",
    "wrapper": "legacy wrapper range (ncclBcast) around the real call's range, which carries the link",
}
"""Values of the ``status`` column and their meaning."""

PAYLOAD_STATES: dict[str, str] = {
    "decoded": "NCCL payloads were decoded (message size, communicator id, ... columns filled)",
    "missing": "NCCL payload schemas are registered but the export holds no payload data (binaryData NULL, no "
               "JSON, no dynamic payload tables)",
    "undecodable": "payload blobs are present but could not be decoded",
    "none": "no payloads and no NCCL payload schemas (NCCL < 2.16.2, or an nsys that cannot export them)",
    "no_ranges": "the export holds no NCCL API ranges",
}
"""Values of :attr:`NcclApiCalls.payload`."""

_PAYLOAD_COLUMNS = list(NCCL_COLUMN_KINDS)

NCCL_API_CALL_COLUMNS: list[tuple[str, str]] = [
    ("pid", "Int64"), ("tid", "Int64"), ("global_tid", "Int64"), ("domain_id", "Int64"),
    ("start", "int64"), ("end", "int64"), ("op", "object"),
    ("group_id", "Int64"), ("group_depth", "Int64"), ("launch_range_start", "Int64"),
    *NCCL_COLUMN_KINDS.items(), ("payload_source", "object"),
    ("kernel_global_pid", "Int64"), ("kernel_correlation_id", "Int64"),
    ("kernels_in_launch_range", "Int64"), ("lost_launches_in_launch_range", "Int64"), ("status", "object"),
]  # fmt: skip
"""(column, kind) of the ``nccl_api_calls`` table, kinds as the reader's column specs."""

_DOCS: dict[str, tuple[str, str]] = {
    "pid": ("", "process of the calling thread"),
    "tid": ("", "calling thread"),
    "global_tid": ("", "nsys globalTid of the calling thread"),
    "domain_id": ("", "NVTX domain id of NCCL in that process"),
    "start": ("ns", "start of the API call's NVTX range (export timeline)"),
    "end": ("ns", "end of the range"),
    "op": ("", "range name without 'nccl': AllReduce, Send, Recv, GroupStart, GroupEnd, CommCount, CommInitRank, ...; "
               "Bcast -> Broadcast"),
    "group_id": ("", "id of the outermost ncclGroupStart/End group the range belongs to (its GroupStart and GroupEnd "
                     "included); null outside any group"),
    "group_depth": ("", "groups open around the range (its own GroupStart/GroupEnd not counted); 0 outside groups"),
    "launch_range_start": ("ns", "start of the range inside which its kernels are launched: the call itself "
                                 "(ungrouped) or its group's closing ncclGroupEnd; null for ranges that launch "
                                 "nothing"),
    "nccl_message_bytes": ("B", "payload: message size"),
    "nccl_comm_id": ("", "payload: NCCL communicator id (NCCL >= 2.25.1)"),
    "nccl_root": ("", "payload: root rank (rooted collectives)"),
    "nccl_peer": ("", "payload: peer rank (Send/Recv)"),
    "nccl_redop": ("", "payload: ncclRedOp_t value"),
    "nccl_rank": ("", "payload: rank (communicator init)"),
    "nccl_nranks": ("", "payload: communicator size (communicator init)"),
    "nccl_cuda_dev": ("", "payload: CUDA device (communicator init)"),
    "nccl_color": ("", "payload: split color"),
    "nccl_key": ("", "payload: split key"),
    "nccl_parent_comm_id": ("", "payload: parent communicator id (split)"),
    "payload_source": ("", "'dynamic', 'blob', 'json' or null (no payload decoded)"),
    "kernel_global_pid": ("", "globalPid of the kernel that executed the call (null unless status = 'matched')"),
    "kernel_correlation_id": ("", "correlationId of that kernel (with kernel_global_pid: a kernels.parquet row)"),
    "kernels_in_launch_range": ("kernels", "NCCL kernels of the export launched inside the launch range"),
    "lost_launches_in_launch_range": ("launches", "kernel launches inside the launch range whose kernel record is "
                                                  "missing (launches_without_kernel)"),
    "status": ("", "'matched', 'no_kernel', 'kernel_missing', 'ambiguous_kernel', 'several_kernels', "
                   "'no_launch_range', 'not_a_launch' or 'wrapper' (docs/nsys.md)"),
}


def _documented_schema() -> pa.Schema:
    base = spec_schema(NCCL_API_CALL_COLUMNS)
    fields = [f.with_metadata({"unit": _DOCS[f.name][0], "doc": _DOCS[f.name][1]}) for f in base]
    return pa.schema(fields, metadata={"table": "nccl_api_calls", "doc": (
        "Per node (parsed/nsys/<host>/): one row per NCCL API call range of the nsys export (legacy NCCL NVTX), with "
        "its group and the kernel that executed it (nccltrace.nsys.nccl_api).")})  # fmt: skip


NCCL_API_CALLS_SCHEMA: pa.Schema = _documented_schema()
"""Arrow schema of ``nccl_api_calls.parquet``, each field with its unit and meaning."""


@dataclass(frozen=True)
class NcclApiCalls:
    """Result of :func:`nccl_api_calls`.

    ``calls``: one row per NCCL API range (:data:`NCCL_API_CALL_COLUMNS`, status values in
    :data:`STATUSES`), ordered by process, thread and start. ``domains``: one row per (process,
    NVTX domain) taken as NCCL's: ``pid``, ``domain_id``, ``domain`` (name, null without creation
    row), ``ranges``, ``recognised_by`` (``domain_name``, ``range_names+payload_schemas`` or
    ``range_names``). ``payload``: one of :data:`PAYLOAD_STATES`; ``payload_warning`` says what is
    missing and how to re-export, or None. ``nccl_kernels``: NCCL kernels in the input;
    ``kernels_outside_launch_ranges``: those launched in no NCCL launch range (launched before the
    capture window, from another thread, or without launch record).
    """

    calls: pd.DataFrame
    domains: pd.DataFrame
    payload: str
    payload_warning: str | None
    nccl_kernels: int
    kernels_outside_launch_ranges: int

    def summary(self) -> dict[str, Any]:
        """Counts for reports: ranges, collective/P2P calls (``api_calls``) per status, calls
        matched to a kernel, kernels linked to at least one range, and the payload state."""
        c = self.calls
        is_call = c.op.isin(list(set(CALL_OPS.values()))).to_numpy(bool) & (c.status != "wrapper").to_numpy(bool)
        linked = c[c.kernel_correlation_id.notna()].drop_duplicates(["kernel_global_pid", "kernel_correlation_id"])
        out: dict[str, Any] = {
            "ranges": len(c),
            "api_calls": int(is_call.sum()),
            "matched": int((is_call & (c.status == "matched").to_numpy(bool)).sum()),
        }
        for s in STATUSES:
            out[f"calls_{s}"] = int((is_call & (c.status == s).to_numpy(bool)).sum())
        out.update({
            "groups": int(c.group_id.nunique()),
            "nccl_kernels": self.nccl_kernels,
            "kernels_linked": len(linked),
            "kernels_outside_launch_ranges": self.kernels_outside_launch_ranges,
            "domains_without_name": int(self.domains.domain.isna().sum()),
            "payload": self.payload,
            "payload_warning": self.payload_warning,
        })  # fmt: skip
        return out


def format_summary(summary: dict[str, Any]) -> str:
    """One line of :meth:`NcclApiCalls.summary` counts for parse reports (the payload warning is
    left to the caller, which prints it where warnings go)."""
    s = summary
    line = (f"NCCL API ranges: {s['ranges']} ({s['api_calls']} collective/P2P calls, {s['matched']} matched to a "
            f"kernel); NCCL kernels linked: {s['kernels_linked']} of {s['nccl_kernels']}")
    return line + f"; payloads: {s['payload']}"


# --------------------------------------------------------------------------- public API


def nccl_range_mask(nvtx: pd.DataFrame) -> np.ndarray:
    """Boolean mask of the rows of ``nvtx`` (:meth:`NsysExport.nvtx` columns) that are NCCL API
    push/pop ranges, by domain name or, without the domain's creation row, by range names (see
    the module docstring). Works on frames lacking ``domain_id``/``global_tid`` (name only)."""
    return _recognise(nvtx, None)[0]


def nccl_kernels(kernels: pd.DataFrame) -> pd.DataFrame:
    """The NCCL kernels of ``kernels`` (short name, else name, starting with ``nccl``), reindexed
    from 0. NCCL calls launch only these; compute kernels in the same frame are left out."""
    name = kernels["short_name"] if "short_name" in kernels.columns else kernels.get("name")
    k = kernels
    if name is not None:
        k = k[name.astype("string").str.lower().str.startswith("nccl").fillna(False).to_numpy(bool)]
    return k.reset_index(drop=True).copy()


def nccl_api_calls(nvtx: pd.DataFrame, kernels: pd.DataFrame, *, lost_launches: pd.DataFrame | None = None,
                   payload_schemas: pd.DataFrame | None = None,
                   undecoded_payload_blobs: int | None = None) -> NcclApiCalls:  # fmt: skip
    """NCCL API call ranges of one export, each with its group and the kernel that executed it.

    ``nvtx``: :meth:`NsysExport.nvtx` rows (all domains; needs ``start``, ``end``, ``text``,
    ``pid``, ``tid``, and for recognition without domain name ``domain_id`` and ``global_tid``).
    ``kernels``: :meth:`NsysExport.kernels` rows (launch columns needed; non-NCCL kernels are
    ignored). ``lost_launches``: :meth:`NsysExport.launches_without_kernel` rows; without them
    a lost kernel record reads as ``no_kernel`` and ``lost_launches_in_launch_range`` is null.
    ``payload_schemas``: :meth:`NsysExport.payload_schema_entries` rows (corroborates domains
    recognised by name and tells "payloads missing" from "no payloads").
    ``undecoded_payload_blobs``: :attr:`NsysExport.undecoded_payload_blobs` after ``nvtx()``.

    Returns an :class:`NcclApiCalls`; never guesses a kernel (rule in the module docstring).
    """
    mask, domains = _recognise(nvtx, payload_schemas)
    use_gpid = "global_tid" in nvtx.columns and "global_pid" in kernels.columns and (
        lost_launches is None or "global_tid" in lost_launches.columns)
    proc = ["_proc"]
    # Only the NCCL rows and the columns used (the NVTX table of an export can be large).
    extra = {"pid": "Int64", "global_tid": "Int64", "domain_id": "Int64", "payload_source": "object"}
    used = ["tid", "start", "end", "text", *extra, *_PAYLOAD_COLUMNS]
    nv = nvtx.loc[mask, [c for c in used if c in nvtx.columns]].copy()
    for col, kind in extra.items():
        if col not in nv.columns:
            nv[col] = pd.Series([None] * len(nv), index=nv.index, dtype=kind)
    nv["_proc"] = _proc_of(nv, "global_tid" if use_gpid else None)
    r = _prepare_ranges(nv, proc, mask=np.ones(len(nv), bool), keep=tuple(extra))
    _link_units(r)
    k = nccl_kernels(kernels)
    for col in ("correlation_id", "stream_id", "global_pid", "launch_tid", "launch_start", "launch_end"):
        if col not in k.columns:
            k[col] = pd.Series([None] * len(k), index=k.index, dtype="Int64")
    k["_proc"] = _int(k.global_pid) if use_gpid else _int(k.pid)
    _kernel_launch_ranges(k, r, proc)
    lost = _lost_launch_ranges(lost_launches, r, use_gpid)
    calls = _assign(r, k, lost)
    return NcclApiCalls(calls=calls, domains=domains, **_payload_state(r, payload_schemas, undecoded_payload_blobs),
                        nccl_kernels=len(k), kernels_outside_launch_ranges=int((k.launch_range < 0).sum()))


# --------------------------------------------------------------------------- recognition


def _int(s: pd.Series, fill: int = -1) -> np.ndarray:
    """Nullable integer column -> int64 array with ``fill`` for nulls."""
    return s.astype("Int64").fillna(fill).to_numpy("int64")


def _codes(frame: pd.DataFrame, cols: list[str]) -> np.ndarray:
    """One int64 code per distinct combination of ``cols`` (nulls are a value of their own)."""
    if len(frame) == 0:
        return np.empty(0, np.int64)
    return frame.groupby(cols, sort=False, dropna=False).ngroup().to_numpy("int64")


def _proc_of(frame: pd.DataFrame, gtid_col: str | None) -> np.ndarray:
    """Process key per row: the process bits of ``gtid_col`` (exact within one export), else pid."""
    if gtid_col is not None and gtid_col in frame.columns:
        g = frame[gtid_col].astype("Int64")
        return np.where(g.notna().to_numpy(bool), g.fillna(0).to_numpy("int64") & GPID_MASK, -1)
    return _int(frame["pid"]) if "pid" in frame.columns else np.full(len(frame), -1, np.int64)


def _schema_domains(payload_schemas: pd.DataFrame | None) -> set[int]:
    """Domain ids under which NCCL payload schemas are registered."""
    if payload_schemas is None or len(payload_schemas) == 0 or not {"domain_id", "name"} <= set(payload_schemas):
        return set()
    hit = payload_schemas[payload_schemas["name"].isin(list(_NCCL_SCHEMA_ENTRIES)).to_numpy(bool)]
    return {int(d) for d in hit.domain_id.dropna()}


def _recognise(nvtx: pd.DataFrame, payload_schemas: pd.DataFrame | None) -> tuple[np.ndarray, pd.DataFrame]:
    """(mask of NCCL push/pop ranges, one row per NCCL (process, domain) with its evidence)."""
    empty = pd.DataFrame({"pid": pd.array([], "Int64"), "domain_id": pd.array([], "Int64"),
                          "domain": pd.Series([], dtype=object), "ranges": pd.array([], "Int64"),
                          "recognised_by": pd.Series([], dtype=object)})  # fmt: skip
    n = len(nvtx)
    if n == 0 or not {"text", "start", "end"} <= set(nvtx.columns):
        return np.zeros(n, bool), empty
    pushpop = nvtx.start.notna().to_numpy(bool) & nvtx.end.notna().to_numpy(bool)
    if "event_type" in nvtx.columns:
        pushpop &= (nvtx.event_type == 59).fillna(False).to_numpy(bool)
    if "tid" in nvtx.columns:
        pushpop &= nvtx.tid.notna().to_numpy(bool)
    domain = nvtx["domain"] if "domain" in nvtx.columns else pd.Series([None] * n, index=nvtx.index, dtype=object)
    named = (domain == "NCCL").fillna(False).to_numpy(bool)
    mask = pushpop & named
    how = np.where(named, "domain_name", None).astype(object)
    if "domain_id" in nvtx.columns:
        did = nvtx.domain_id.astype("Int64")
        cand = pushpop & domain.isna().to_numpy(bool) & did.notna().to_numpy(bool) & (did != 0).fillna(False).to_numpy(
            bool)
        if cand.any():
            text = nvtx.text.astype("string")
            sub = pd.DataFrame({
                "host": nvtx["host"].astype("string") if "host" in nvtx.columns else "",
                "proc": _proc_of(nvtx, "global_tid"), "did": _int(did),
                "api": text.str.fullmatch(_API_NAME.pattern).fillna(False).to_numpy(bool),
                "known": text.isin(list(NCCL_API_NAMES)).fillna(False).to_numpy(bool),
            })[cand]  # fmt: skip
            g = sub.groupby(["host", "proc", "did"], dropna=False)
            ok = (g.api.transform("all") & g.known.transform("any")).to_numpy(bool)
            rows = np.flatnonzero(cand)[ok]
            mask[rows] = True
            schemas = _schema_domains(payload_schemas)
            how[rows] = np.where(np.isin(sub.did.to_numpy()[ok], list(schemas)), "range_names+payload_schemas",
                                 "range_names")
    if not mask.any():
        return mask, empty
    d = pd.DataFrame({
        "host": nvtx["host"].astype("string").to_numpy(object) if "host" in nvtx.columns else "",
        "pid": nvtx["pid"].astype("Int64").to_numpy(object) if "pid" in nvtx.columns else None,
        "domain_id": nvtx["domain_id"].astype("Int64").to_numpy(object) if "domain_id" in nvtx.columns else None,
        "domain": domain.to_numpy(object), "recognised_by": how,
    })[mask]  # fmt: skip
    d = d.groupby(["host", "pid", "domain_id", "recognised_by"], dropna=False, sort=True).agg(
        domain=("domain", "first"), ranges=("recognised_by", "size")).reset_index()
    out = pd.DataFrame({"pid": d.pid.astype("Int64"), "domain_id": d.domain_id.astype("Int64"),
                        "domain": d.domain.astype(object).where(d.domain.notna(), None),
                        "ranges": d.ranges.astype("Int64"), "recognised_by": d.recognised_by.astype(object)})
    return mask, out


def _prepare_ranges(nvtx: pd.DataFrame, proc: list[str], *, mask: np.ndarray | None = None,
                    keep: tuple[str, ...] = ()) -> pd.DataFrame:  # fmt: skip
    """NCCL push/pop ranges (``mask``, default :func:`nccl_range_mask`), sorted per thread by
    start (outer before inner), classified as ``call`` (op set), ``group_start``, ``group_end``,
    ``init`` (``ncclComm*``) or ``other``; payload columns always present."""
    keep_mask = nccl_range_mask(nvtx) if mask is None else mask
    cols = [*proc, "tid", "start", "end", "text", *[c for c in keep if c not in proc]]
    r = nvtx.loc[keep_mask, cols + [p for p in _PAYLOAD_COLUMNS if p in nvtx.columns]].copy()
    for p, dt in NCCL_COLUMN_KINDS.items():
        r[p] = r[p].astype(dt) if p in r.columns else pd.array([None] * len(r), dtype=dt)
    r["start"] = r["start"].astype("int64")
    r["end"] = r["end"].astype("int64")
    r["tid"] = r["tid"].astype("Int64")
    r = r.sort_values([*proc, "tid", "start", "end"], ascending=[True] * (len(proc) + 2) + [False],
                      kind="stable").reset_index(drop=True)  # fmt: skip
    text = r.text.astype("string")
    op = text.str.removeprefix("nccl").map(CALL_OPS).where(text.str.startswith("nccl").fillna(False))
    kind = np.full(len(r), "other", dtype=object)
    kind[op.notna().to_numpy(bool)] = "call"
    kind[(text == "ncclGroupStart").fillna(False).to_numpy(bool)] = "group_start"
    kind[(text == "ncclGroupEnd").fillna(False).to_numpy(bool)] = "group_end"
    kind[text.str.startswith("ncclComm").fillna(False).to_numpy(bool)] = "init"
    r["_thread"] = _codes(r, [*proc, "tid"])
    # A legacy wrapper range (ncclBcast) containing the real call's range is not a call itself.
    idx = np.flatnonzero(kind == "call")
    if len(idx) > 1:
        cur, nxt = idx[:-1], idx[1:]
        th, st, en = r._thread.to_numpy(), r.start.to_numpy("int64"), r.end.to_numpy("int64")
        wraps = (th[cur] == th[nxt]) & (st[nxt] < en[cur]) & (en[nxt] <= en[cur])
        kind[cur[wraps]] = "other"
    r["kind"] = kind
    r["op"] = op.where(kind == "call")
    return r


# --------------------------------------------------------------------------- NVTX structure


def _link_units(r: pd.DataFrame) -> None:
    """Add the group structure of each thread's ranges (rows sorted as by :func:`_prepare_ranges`).

    ``unit``: row of the range that launches a call's kernels (-1 if none, and for non-calls):
    an ungrouped call launches in its own range, a call at group depth > 0 in the ncclGroupEnd
    that brings its thread's depth back to 0 (nested groups launch only then). ``is_unit``:
    ranges inside which NCCL launches kernels. ``group``: id of the outermost group a range
    belongs to (-1 if none); ``depth``: groups open around it.
    """
    n = len(r)
    unit = np.full(n, -1, dtype=np.int64)
    group = np.full(n, -1, dtype=np.int64)
    is_unit = np.zeros(n, bool)
    depth = np.zeros(n, dtype=np.int64)
    if n:
        kind, th = r.kind.to_numpy(), r._thread.to_numpy()
        delta = np.where(kind == "group_start", 1, np.where(kind == "group_end", -1, 0)).astype(np.int64)
        first = np.r_[True, th[1:] != th[:-1]]
        seg = np.cumsum(first) - 1
        cs = np.cumsum(delta)
        walk = cs - (cs - delta)[first][seg]  # per-thread depth after each row, relative to its start
        # A ncclGroupEnd without its start (capture began inside a group): the thread starts at the
        # smallest depth that keeps the walk non-negative, so its earlier calls join that group.
        d0 = -np.minimum(np.minimum.reduceat(walk, np.flatnonzero(first)), 0)[seg]
        after = walk + d0
        before = after - delta
        closing = (kind == "group_end") & (after == 0)
        is_call = kind == "call"
        ungrouped = is_call & (before == 0)
        unit[ungrouped] = np.flatnonzero(ungrouped)
        is_unit = ungrouped | closing
        grouped = np.flatnonzero(is_call & (before > 0))
        close_pos = np.flatnonzero(closing)
        if len(grouped) and len(close_pos):
            nxt = np.searchsorted(close_pos, grouped)
            ok = nxt < len(close_pos)
            cand = close_pos[np.minimum(nxt, len(close_pos) - 1)]
            ok &= th[cand] == th[grouped]  # an unterminated group keeps -1
            unit[grouped[ok]] = cand[ok]
        # Outermost groups open at a GroupStart at depth 0, or at the start of a thread that
        # begins inside a group; threads are contiguous, so a running count numbers them.
        opens = ((kind == "group_start") & (before == 0)) | (first & (d0 > 0))
        number = np.cumsum(opens) - 1
        inside = (before > 0) | (after > 0)
        group[inside] = number[inside]
        depth = np.minimum(before, after)
    r["unit"] = unit
    r["is_unit"] = is_unit
    r["group"] = group
    r["depth"] = depth


def _kernel_launch_ranges(k: pd.DataFrame, r: pd.DataFrame, proc: list[str]) -> None:
    """Add ``launch_range`` to ``k`` (columns ``proc``, ``launch_tid``, ``launch_start``,
    ``launch_end``, index 0..n-1): row of the launch range (ungrouped call or closing
    ncclGroupEnd) on the launching thread that contains the launch API call, -1 if none."""
    out = np.full(len(k), -1, dtype=np.int64)
    key = [*proc, "tid"]
    units = r[r.is_unit.to_numpy(bool)]
    have = (k.launch_tid.notna() & k.launch_start.notna() & k.launch_end.notna()).to_numpy(bool)
    if len(units) and have.any():
        kk = k.loc[have, [*proc, "launch_tid", "launch_start", "launch_end"]].rename(columns={"launch_tid": "tid"})
        ugroups = {t if isinstance(t, tuple) else (t,): g for t, g in units.groupby(key, sort=False)}
        for t, g in kk.groupby(key, sort=False):
            u = ugroups.get(t if isinstance(t, tuple) else (t,))
            if u is None:
                continue
            # Launch ranges of one thread do not overlap: the candidate is the last one starting
            # at or before the launch, and it must also end after the launch.
            st, en = u.start.to_numpy("int64"), u.end.to_numpy("int64")
            ls, le = g.launch_start.to_numpy("int64"), g.launch_end.to_numpy("int64")
            i = np.searchsorted(st, ls, side="right") - 1
            inside = (i >= 0) & (en[np.maximum(i, 0)] >= le)
            out[g.index.to_numpy()[inside]] = u.index.to_numpy()[i[inside]]
    k["launch_range"] = out


def _lost_launch_ranges(lost: pd.DataFrame | None, r: pd.DataFrame, use_gpid: bool) -> pd.DataFrame | None:
    """Launches without kernel record (runtime rows) with their ``launch_range``; None if not given."""
    if lost is None:
        return None
    need = {"tid", "start", "end"} | ({"global_tid"} if use_gpid else {"pid"})
    if not need <= set(lost.columns):
        raise ValueError(f"lost_launches lacks columns {sorted(need - set(lost.columns))}")
    out = pd.DataFrame({"_proc": _proc_of(lost, "global_tid" if use_gpid else None),
                        "launch_tid": lost.tid.astype("Int64").to_numpy(), "launch_start": lost.start.astype(
                            "Int64").to_numpy(), "launch_end": lost.end.astype("Int64").to_numpy()})  # fmt: skip
    _kernel_launch_ranges(out, r, ["_proc"])
    return out


# --------------------------------------------------------------------------- kernels -> calls


def _assign(r: pd.DataFrame, k: pd.DataFrame, lost: pd.DataFrame | None) -> pd.DataFrame:
    """Status and kernel of every range (rule in the module docstring)."""
    n = len(r)
    rows = np.arange(n)
    kind = r.kind.to_numpy(object)
    text = r.text.astype("string")
    stem = text.str.removeprefix("nccl")
    op = stem.map(CALL_OPS).fillna(stem).where(text.str.startswith("nccl").fillna(False), text)
    wrapper = (kind == "other") & stem.isin(list(CALL_OPS)).fillna(False).to_numpy(bool)
    # Launch range of each row: a call's unit, a closing ncclGroupEnd's own row.
    is_unit = r.is_unit.to_numpy(bool)
    lr = r.unit.to_numpy("int64").copy()
    lr[is_unit] = rows[is_unit]
    has_lr = lr >= 0
    klr = k.launch_range.to_numpy("int64")
    nk = np.bincount(klr[klr >= 0], minlength=n)
    nl = np.zeros(n, np.int64)
    if lost is not None:
        llr = lost.launch_range.to_numpy("int64")
        nl = np.bincount(llr[llr >= 0], minlength=n)
    K = np.where(has_lr, nk[np.maximum(lr, 0)], 0)
    L = np.where(has_lr, nl[np.maximum(lr, 0)], 0)
    # The kernel of launch ranges with exactly one.
    only = np.full(n, -1, np.int64)
    only[klr[klr >= 0]] = np.flatnonzero(klr >= 0)
    only[nk != 1] = -1
    kernel = np.full(n, -1, np.int64)  # row of k
    status = np.full(n, "not_a_launch", dtype=object)
    status[wrapper] = "wrapper"
    call = kind == "call"
    status[call & ~has_lr] = "no_launch_range"
    launching = has_lr & (call | is_unit)
    zero = launching & (K == 0)
    status[zero] = np.where(L[zero] > 0, "kernel_missing", "no_kernel")
    own = launching & is_unit & (K > 0)  # the row is its launch range
    one = own & (K == 1) & (L == 0)
    status[own] = "several_kernels"
    status[one] = "matched"
    kernel[one] = only[lr[one]]
    # Grouped calls: communicators of each launch range's calls.
    grouped = launching & ~is_unit & (K > 0)
    ccode = pd.factorize(r.nccl_comm_id.astype("UInt64"))[0].astype(np.int64)  # -1: no communicator id
    in_unit = call & has_lr
    cdf = pd.DataFrame({"u": lr[in_unit], "comm": ccode[in_unit]})
    cdf = cdf[cdf.comm >= 0]
    n_comm = np.zeros(n, np.int64)
    nc = cdf.drop_duplicates().u.value_counts()
    n_comm[nc.index.to_numpy("int64")] = nc.to_numpy("int64")
    null_comm = np.bincount(lr[in_unit & (ccode < 0)], minlength=n) > 0
    simple_unit = (nk == 1) & (nl == 0) & (n_comm <= 1)
    simple = grouped & simple_unit[np.maximum(lr, 0)]
    status[simple] = "matched"
    kernel[simple] = only[lr[simple]]
    rest = grouped & ~simple
    if rest.any():
        kernel, status = _by_communicator(r, k, lr, ccode, rest, simple_unit & (n_comm == 1) & ~null_comm, nl, kernel,
                                          status)
    return _output(r, k, op, lr, launching, K, L if lost is not None else None, kernel, status)


def _by_communicator(r: pd.DataFrame, k: pd.DataFrame, lr: np.ndarray, ccode: np.ndarray, rest: np.ndarray,
                     teach: np.ndarray, nl: np.ndarray, kernel: np.ndarray,
                     status: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Grouped calls of launch ranges with several kernels (or communicators): kernel by the
    communicator its CUDA stream serves, learned from the ``teach`` launch ranges (one kernel,
    one communicator id)."""
    n = len(r)
    klr = k.launch_range.to_numpy("int64")
    kproc, kstream = k._proc.to_numpy("int64"), _int(k.stream_id)
    call_rows = np.flatnonzero((r.kind.to_numpy(object) == "call") & (lr >= 0) & (ccode >= 0))
    unit_comm = np.full(n, -1, np.int64)
    unit_comm[lr[call_rows]] = ccode[call_rows]  # teaching ranges have one communicator
    # Stream -> communicator where every teaching launch range on the stream agrees.
    ti = np.flatnonzero((klr >= 0) & teach[np.maximum(klr, 0)])
    learn = pd.DataFrame({"_proc": kproc[ti], "stream": kstream[ti], "comm": unit_comm[klr[ti]]})
    learn = learn[(learn.stream >= 0).to_numpy(bool) & (learn.comm >= 0).to_numpy(bool)]
    per_stream = learn.groupby(["_proc", "stream"]).comm.agg(["nunique", "first"])
    stream_comm = per_stream.loc[per_stream["nunique"] == 1, "first"].rename("comm")
    # Each kernel of a launch range placed on a communicator of that range's calls, or not (-1).
    ki = np.flatnonzero(klr >= 0)
    kk = pd.DataFrame({"u": klr[ki], "krow": ki, "_proc": kproc[ki], "stream": kstream[ki]})
    kk = kk.join(stream_comm, on=["_proc", "stream"])
    kc = kk.comm.fillna(-1).to_numpy("int64").copy()
    members = pd.MultiIndex.from_arrays([lr[call_rows], ccode[call_rows]])
    kc[~pd.MultiIndex.from_arrays([kk.u.to_numpy("int64"), kc]).isin(members)] = -1
    kk["comm"] = kc
    unplaced = np.bincount(kk.u.to_numpy("int64")[kc < 0], minlength=n)
    on_comm = kk[kc >= 0].groupby(["u", "comm"]).krow.agg(["size", "first"])
    # Each remaining call: its communicator's kernels in its launch range.
    ri = np.flatnonzero(rest)
    q = pd.DataFrame({"u": lr[ri], "comm": ccode[ri]}).join(on_comm, on=["u", "comm"])
    n_on = q["size"].fillna(0).to_numpy("int64")
    certain = (ccode[ri] >= 0) & (unplaced[lr[ri]] == 0) & (nl[lr[ri]] == 0)
    status[ri] = "ambiguous_kernel"
    m = certain & (n_on == 1)
    status[ri[m]] = "matched"
    kernel[ri[m]] = q["first"].to_numpy()[m].astype(np.int64)
    status[ri[certain & (n_on == 0)]] = "no_kernel"
    return kernel, status


def _output(r: pd.DataFrame, k: pd.DataFrame, op: pd.Series, lr: np.ndarray, launching: np.ndarray, K: np.ndarray,
            L: np.ndarray | None, kernel: np.ndarray, status: np.ndarray) -> pd.DataFrame:  # fmt: skip
    """The table in :data:`NCCL_API_CALL_COLUMNS` order and dtypes."""
    n = len(r)
    has_k = kernel >= 0
    pick = np.maximum(kernel, 0)
    kpid = _int(k.global_pid)[pick] if len(k) else np.zeros(n, np.int64)
    kcorr = _int(k.correlation_id)[pick] if len(k) else np.zeros(n, np.int64)

    def nullable(values: np.ndarray, valid: np.ndarray) -> pd.arrays.IntegerArray:
        return pd.arrays.IntegerArray(np.where(valid, values, 0).astype(np.int64), ~valid)

    def text(values: pd.Series) -> pd.Series:
        arr = values.astype(object).to_numpy()
        return pd.Series(np.where(pd.isna(arr), None, arr), dtype=object)

    start = r.start.to_numpy("int64")
    grp = r.group.to_numpy("int64")
    cols: dict[str, Any] = {
        "pid": r.pid.astype("Int64").array, "tid": r.tid.astype("Int64").array,
        "global_tid": r.global_tid.astype("Int64").array, "domain_id": r.domain_id.astype("Int64").array,
        "start": start, "end": r.end.to_numpy("int64"), "op": text(op),
        "group_id": nullable(grp, grp >= 0), "group_depth": pd.array(r.depth.to_numpy("int64"), dtype="Int64"),
        "launch_range_start": nullable(start[np.maximum(lr, 0)], launching),
        **{c: r[c].astype(kind).array for c, kind in NCCL_COLUMN_KINDS.items()},
        "payload_source": text(r.payload_source),
        "kernel_global_pid": nullable(kpid, has_k), "kernel_correlation_id": nullable(kcorr, has_k),
        "kernels_in_launch_range": nullable(K, launching),
        "lost_launches_in_launch_range": nullable(K if L is None else L, launching & (L is not None)),
        "status": pd.Series(status, dtype=object),
    }  # fmt: skip
    return pd.DataFrame({c: pd.Series(cols[c], copy=False).reset_index(drop=True) for c, _ in NCCL_API_CALL_COLUMNS},
                        index=pd.RangeIndex(n))


# --------------------------------------------------------------------------- payloads


def _payload_state(r: pd.DataFrame, payload_schemas: pd.DataFrame | None, undecoded: int | None) -> dict[str, Any]:
    """``payload`` state (:data:`PAYLOAD_STATES`) and the warning that names the fix."""
    if len(r) == 0:
        return {"payload": "no_ranges", "payload_warning": None}
    if r.payload_source.notna().any():
        return {"payload": "decoded", "payload_warning": None}
    if undecoded:
        return {"payload": "undecodable", "payload_warning": (
            f"{undecoded} NVTX payload blob(s) could not be decoded (unknown byte layout), so the NCCL API calls have "
            "no message size or communicator id; re-export with `nsys export --type sqlite --include-json=true` "
            "where supported (or --dynamic-tables=all)")}  # fmt: skip
    if _schema_domains(payload_schemas):
        return {"payload": "missing", "payload_warning": (
            "the export registers NCCL payload schemas (NCCL >= 2.16.2) but carries no payload data (binaryData NULL "
            "everywhere, no JSON, no dynamic payload tables), so the NCCL API calls have no message size or "
            "communicator id; re-export with `nsys export --type sqlite --include-blobs=true` (and "
            "`--include-json=true` where supported)")}  # fmt: skip
    return {"payload": "none", "payload_warning": None}
