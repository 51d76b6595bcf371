"""Exact call <-> kernel correlation from NCCL's NVTX payload ranges (``exact`` mode).

When an nsys export carries NCCL's NVTX payloads (NCCL >= 2.16.2; communicator ids from 2.25.1),
each kernel's launch lies inside the range of the call that issued it, so correlation needs no
heuristic alignment: a line is matched only when every explanation of the thread's lines agrees,
otherwise it is reported ``ambiguous``. Design and limits: ``docs/correlation.md`` section 1.3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

# Which NVTX ranges are NCCL's, their group structure and the kernels launched inside them have
# one home, shared with the nccl_api_calls table of parse-nsys.
from nccltrace.nsys.nccl_api import CALL_OPS as _CALL_OPS
from nccltrace.nsys.nccl_api import (
    _codes,
    _int,
    _kernel_launch_ranges,
    _link_units,
    nccl_kernels,
    nccl_range_mask,
)
from nccltrace.nsys.nccl_api import _prepare_ranges as _nccl_ranges

__all__ = [
    "REASONS",
    "ExactCorrelation",
    "ExactCorrelationError",
    "compare_alignment",
    "exact_correlation",
    "has_nccl_payloads",
]

REASONS = ("no_kernel_single_rank", "kernel_missing", "no_nvtx_range", "ambiguous", "duplicate_line")
"""Why a call line has no kernel (``reason`` is null for matched lines)."""

_ROOTED = {"Broadcast", "Reduce", "Gather", "Scatter"}
_P2P = {"Send", "Recv", "PutSignal", "Signal"}
_REDUCING = {"AllReduce", "ReduceScatter", "Reduce"}
# Log fields that make two lines identical (a possible duplicate); those absent are skipped.
_SIGNATURE = ("op", "op_count", "sendbuff", "recvbuff", "count", "datatype", "redop", "root", "comm", "nranks",
              "stream", "wall_time_ns")  # fmt: skip
_NO_KEY = -1


class ExactCorrelationError(ValueError):
    """The inputs do not allow exact correlation (e.g. the export has no NCCL payloads)."""


@dataclass(frozen=True)
class ExactCorrelation:
    """Result of :func:`exact_correlation`.

    ``call_matches``: one row per call line: ``file``, ``line``, ``kernel_global_pid``,
    ``kernel_correlation_id`` (null when there is no kernel), ``reason`` (null when matched,
    else one of :data:`REASONS`), plus ``pid``, ``tid``, ``nvtx_start`` (start of the line's
    NVTX range, null if none was matched).

    ``kernel_ranges``: one row per (NCCL kernel, NVTX call range it serves): ``kernel_global_pid``,
    ``kernel_correlation_id``, ``pid``, ``stream_id``, ``status``, ``complete``, ``launch_text``
    and ``launch_start`` (its launch range: the call, or ``ncclGroupEnd``), and the call range's
    ``range_tid``, ``range_start``, ``range_end``, ``range_op``, ``range_comm_id``,
    ``range_message_bytes``. ``status``: ``matched`` (rows list its ranges; ``complete`` is
    False when the launch range also holds calls of unknown communicator it may serve too), or,
    in one row with null range columns, ``ambiguous`` (launch range known, its calls not),
    ``no_call_ranges`` (launch range without calls on multi-rank communicators),
    ``no_launch_range`` (launched outside every call / ``ncclGroupEnd`` range, e.g. a kernel
    without a log line), ``no_launch`` (no launch record).
    """

    call_matches: pd.DataFrame
    kernel_ranges: pd.DataFrame

    def summary(self) -> dict[str, int]:
        """Counts: matched lines, lines per reason, kernels per status."""
        cm, kr = self.call_matches, self.kernel_ranges
        out = {"lines": len(cm), "matched": int(cm.reason.isna().sum())}
        out.update({r: int((cm.reason == r).sum()) for r in REASONS})
        per_kernel = kr.drop_duplicates(["kernel_global_pid", "kernel_correlation_id"])
        out["kernels"] = len(per_kernel)
        for status, n in per_kernel.status.value_counts().items():
            out[f"kernels_{status}"] = int(n)
        return out


# --------------------------------------------------------------------------- public API


def has_nccl_payloads(nvtx: pd.DataFrame) -> bool:
    """True if some NCCL-domain collective/P2P range carries a decoded payload (message size).

    NCCL attaches payloads from 2.16.2 on, and an export holds them only as dynamic tables,
    ``binaryData`` blobs or JSON; bare ranges (older NCCL, an export without payloads) are not
    enough for :func:`exact_correlation`.
    """
    needed = {"text", "nccl_message_bytes"}
    if nvtx is None or len(nvtx) == 0 or not needed <= set(nvtx.columns):
        return False
    text = nvtx.text.astype("string")
    mask = nccl_range_mask(nvtx).copy()
    mask &= text.str.startswith("nccl").fillna(False).to_numpy(bool)
    mask &= text.str.removeprefix("nccl").isin(list(_CALL_OPS)).fillna(False).to_numpy(bool)
    return bool(nvtx.nccl_message_bytes[mask].notna().any())


def exact_correlation(calls: pd.DataFrame, kernels: pd.DataFrame, nvtx: pd.DataFrame, *,
                      comms: pd.DataFrame | None = None, lost_launches: pd.DataFrame | None = None,
                      duplicates: Literal["possible", "flagged"] = "possible",
                      require_payloads: bool = True) -> ExactCorrelation:  # fmt: skip
    """Correlate NCCL call lines with their kernels through NCCL's NVTX payload ranges.

    ``calls``: the log reader's ``calls`` table (any number of processes). ``kernels``:
    :meth:`NsysExport.kernels` rows (launch columns needed; non-NCCL kernels are ignored).
    ``nvtx``: :meth:`NsysExport.nvtx` rows (all domains, or ``domain="NCCL"``). Processes are
    joined on ``pid``, or on (``host``, ``pid``) when ``kernels`` and ``nvtx`` both carry a
    ``host`` column (add the export's hostname when several nodes may reuse a pid).
    ``comms`` (optional): the reader's ``comms`` table; its logged ``commId`` links pointers to
    NVTX communicator ids directly where they are equal (NCCL >= 2.26.2, non-split).
    ``lost_launches`` (optional): :meth:`NsysExport.launches_without_kernel` rows, launch calls
    whose kernel record is missing. A launch range holding one may have lost a second kernel of
    the same communicator, so its kernel is then only given to a communicator with one call.
    ``duplicates``: ``"possible"`` (default) treats a line identical to its thread's previous
    line as possibly a duplicate the reader could not flag (NCCL >= 2.27.3 single-node or
    single-rank communicators, where opCount does not advance) and refuses what that makes
    ambiguous; ``"flagged"`` trusts the reader: only ``duplicate_of`` rows are duplicates.

    Returns an :class:`ExactCorrelation`. Never guesses: a line is matched only when the rule in
    the module docstring leaves exactly one range and one kernel for it.

    ``require_payloads=False`` accepts bare ranges (legacy NCCL tracing, an export without
    payload data): lines are then keyed by their op alone, so runs of like calls with lost lines
    stay ambiguous, but every match is still exact (the default mode uses it this way).

    Raises :class:`ExactCorrelationError` when ``nvtx`` has no NCCL payloads (see
    :func:`has_nccl_payloads`) and they are required, when a required column is missing, or
    when a pid occurs on several hosts without ``host`` columns to tell them apart.
    """
    if duplicates not in ("possible", "flagged"):
        raise ValueError(f"duplicates must be 'possible' or 'flagged', not {duplicates!r}")
    if require_payloads and not has_nccl_payloads(nvtx):
        raise ExactCorrelationError(
            "the NVTX table has no NCCL payloads (no decoded message size on any NCCL-domain call range): exact "
            "correlation needs NCCL >= 2.16.2 and an nsys export that keeps the extended payloads "
            "(--dynamic-tables=all or --include-blobs=true); use another alignment mode for this run"
        )
    by_host = "host" in kernels.columns and "host" in nvtx.columns
    calls = _prepare_calls(calls, by_host)
    ranges = _prepare_ranges(nvtx, by_host)
    kern = _prepare_kernels(kernels)
    _link_units(ranges)
    _kernel_launch_ranges(kern, ranges, _proc_columns(by_host))
    lost = _prepare_lost(lost_launches, by_host)
    _kernel_launch_ranges(lost, ranges, _proc_columns(by_host))
    line_range, line_reason = _LineMatcher(calls, ranges, comms, by_host, duplicates == "possible").run()
    return _assign(calls, ranges, kern, lost, line_range, line_reason, by_host)


def compare_alignment(call_matches_exact: pd.DataFrame, call_matches_other: pd.DataFrame) -> dict[str, Any]:
    """Precision/recall/F1 of another alignment's call -> kernel matches against the exact one.

    Both frames need ``file``, ``line``, ``kernel_global_pid``, ``kernel_correlation_id``
    (null = no kernel). Positives are the lines the exact correlation matched to a kernel. A
    prediction is a true positive when it names the same kernel, a false positive when it names
    another kernel or predicts a kernel for a line the exact correlation proved has none
    (``no_kernel_single_rank``, ``kernel_missing``, ``duplicate_line``). Lines the exact
    correlation could not decide (``ambiguous``, ``no_nvtx_range``, or absent) are not scored
    (``unscored`` counts predictions there).
    """
    key = ["file", "line"]
    ex = call_matches_exact[key + ["kernel_global_pid", "kernel_correlation_id"]
                            + (["reason"] if "reason" in call_matches_exact.columns else [])].copy()  # fmt: skip
    if "reason" not in ex.columns:
        ex["reason"] = None
    ot = call_matches_other[key + ["kernel_global_pid", "kernel_correlation_id"]]
    ot = ot[ot.kernel_global_pid.notna() & ot.kernel_correlation_id.notna()]
    if ot.duplicated(key).any():
        raise ValueError("call_matches_other has several kernels for one (file, line)")
    m = ex.merge(ot, on=key, how="outer", suffixes=("", "_pred"))
    has_true = (m.kernel_global_pid.notna() & m.kernel_correlation_id.notna()).to_numpy(bool)
    has_pred = m.kernel_global_pid_pred.notna().to_numpy(bool)
    proven_none = m.reason.isin(["no_kernel_single_rank", "kernel_missing", "duplicate_line"]).to_numpy(bool)
    both = has_true & has_pred
    same = both & (_int(m.kernel_global_pid) == _int(m.kernel_global_pid_pred)) & (
        _int(m.kernel_correlation_id) == _int(m.kernel_correlation_id_pred))
    tp = int(same.sum())
    wrong = int((both & ~same).sum())
    spurious = int((has_pred & ~has_true & proven_none).sum())
    fp = wrong + spurious
    positives = int(has_true.sum())
    fn = positives - tp
    precision = tp / (tp + fp) if tp + fp else float("nan")
    recall = tp / positives if positives else float("nan")
    f1 = 2 * precision * recall / (precision + recall) if tp else 0.0
    return {"positives": positives, "predicted": int(has_pred.sum()), "tp": tp, "fp": fp, "fn": fn,
            "wrong_kernel": wrong, "kernel_for_kernelless_line": spurious,
            "unscored": int((has_pred & ~has_true & ~proven_none).sum()),
            "precision": precision, "recall": recall, "f1": f1}  # fmt: skip


# --------------------------------------------------------------------------- inputs


def _proc_columns(by_host: bool) -> list[str]:
    return ["host", "pid"] if by_host else ["pid"]


def _prepare_calls(calls: pd.DataFrame, by_host: bool) -> pd.DataFrame:
    need = {"file", "line", "pid", "tid", "op", "comm", "nranks", "bytes", "root", "redop", "duplicate_of"}
    if by_host:
        need.add("host")
    missing = need - set(calls.columns)
    if missing:
        raise ExactCorrelationError(f"calls table lacks columns {sorted(missing)}")
    c = calls.reset_index(drop=True).copy()
    if not by_host and "host" in c.columns:
        hosts = c[c.pid.notna()].groupby("pid").host.nunique()
        if (hosts > 1).any():
            raise ExactCorrelationError(
                f"pids {list(hosts[hosts > 1].index[:5])} occur on several hosts: add a 'host' column (the node of "
                "each export) to kernels and nvtx, or correlate one process at a time")
    return c


def _prepare_ranges(nvtx: pd.DataFrame, by_host: bool) -> pd.DataFrame:
    """NCCL push/pop ranges, sorted and classified (see :mod:`nccltrace.nsys.nccl_api`)."""
    return _nccl_ranges(nvtx, _proc_columns(by_host))


def _prepare_kernels(kernels: pd.DataFrame) -> pd.DataFrame:
    need = {"global_pid", "pid", "correlation_id", "stream_id", "launch_tid", "launch_start", "launch_end"}
    missing = need - set(kernels.columns)
    if missing:
        raise ExactCorrelationError(f"kernels table lacks columns {sorted(missing)} (use NsysExport.kernels())")
    # Only NCCL's own kernels are launched by NCCL calls; others (compute) are ignored.
    return nccl_kernels(kernels)


def _prepare_lost(lost: pd.DataFrame | None, by_host: bool) -> pd.DataFrame:
    """Launch calls without kernel record, in the kernels' launch columns."""
    cols = _proc_columns(by_host) + ["launch_tid", "launch_start", "launch_end"]
    if lost is None or len(lost) == 0:
        return pd.DataFrame({c: pd.array([], dtype="string" if c == "host" else "Int64") for c in cols})
    need = set(_proc_columns(by_host)) | {"tid", "start", "end"}
    if not need <= set(lost.columns):
        raise ExactCorrelationError(f"lost_launches lacks columns {sorted(need - set(lost.columns))}")
    out = lost.rename(columns={"tid": "launch_tid", "start": "launch_start", "end": "launch_end"})
    return out[cols].reset_index(drop=True).copy()


# --------------------------------------------------------------------------- line <-> range


class _LineMatcher:
    """Log call lines -> NCCL call ranges, per process (see the module docstring)."""

    def __init__(self, calls: pd.DataFrame, r: pd.DataFrame, comms: pd.DataFrame | None, by_host: bool,
                 unflagged_duplicates: bool) -> None:  # fmt: skip
        self.calls, self.r, self.comms, self.by_host = calls, r, comms, by_host
        self.unflagged_duplicates = unflagged_duplicates
        self.proc = _proc_columns(by_host)
        n = len(calls)
        self.line_range = np.full(n, -1, dtype=np.int64)
        self.reason = np.full(n, None, dtype=object)
        self.ltid = _int(calls.tid, -1)
        self.rtid = r.tid.to_numpy("int64")
        self.ptr = calls.comm.astype("UInt64")
        call_rows = r.kind.to_numpy() == "call"
        # Match keys, coded jointly for lines and ranges. The reduction op is compared only when
        # the export decoded it somewhere (an undecoded enum would mismatch every reduction).
        use_redop = bool(r.nccl_redop[call_rows].notna().any())
        rc = r[call_rows]
        # Bare ranges (no payload data) key lines by op alone: a field no range carries is not
        # compared (it would mismatch every line).
        use_bytes = bool(rc.nccl_message_bytes.notna().any())
        use_who = bool(rc.nccl_root.notna().any() or rc.nccl_peer.notna().any())
        lk = self._keys(calls.op, calls["bytes"], calls.root, calls.root, calls.redop, use_redop, use_bytes, use_who)
        rk = self._keys(rc.op, rc.nccl_message_bytes, rc.nccl_root, rc.nccl_peer, rc.nccl_redop, use_redop, use_bytes,
                        use_who)  # fmt: skip
        code = _codes(pd.concat([lk, rk], ignore_index=True), list(lk.columns))
        self.lcode = code[:n]
        self.rcode = np.full(len(r), -2, dtype=np.int64)
        self.rcode[call_rows] = code[n:]

    @staticmethod
    def _keys(op: pd.Series, nbytes: pd.Series, root: pd.Series, peer: pd.Series, redop: pd.Series,
              use_redop: bool, use_bytes: bool = True, use_who: bool = True) -> pd.DataFrame:  # fmt: skip
        o = op.astype("string").fillna("").to_numpy(dtype=object)
        who = np.where(np.isin(o, list(_ROOTED)), _int(root),
                       np.where(np.isin(o, list(_P2P)), _int(peer), _NO_KEY))  # fmt: skip
        red = np.where(np.isin(o, list(_REDUCING)) & use_redop, _int(redop), _NO_KEY)
        size = _int(nbytes) if use_bytes else np.full(len(o), _NO_KEY, np.int64)
        return pd.DataFrame({"op": o, "bytes": size, "who": who if use_who else np.full(len(o), _NO_KEY, np.int64),
                             "redop": red})

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        calls, reason = self.calls, self.reason
        dup = calls.duplicate_of.notna().to_numpy(bool)
        reason[dup] = "duplicate_line"
        unknown = calls.pid.isna().to_numpy(bool) | calls.tid.isna().to_numpy(bool)
        if self.by_host:
            unknown |= calls.host.isna().to_numpy(bool)
        reason[unknown & ~dup] = "no_nvtx_range"
        active = ~dup & ~unknown
        self.dupable = self._dupable(active) if self.unflagged_duplicates else np.zeros(len(calls), bool)
        self.single = (calls.nranks.astype("Int64") == 1).fillna(False).to_numpy(bool)
        rproc = {t if isinstance(t, tuple) else (t,): g.index.to_numpy()
                 for t, g in self.r[self.r.kind == "call"].groupby(self.proc, sort=False)}  # fmt: skip
        # Lines in file order, split by process without a pass over all lines per process.
        order = np.lexsort((calls.line.to_numpy("int64"), calls.file.astype("string").fillna("").to_numpy(object)))
        act = order[active[order]]
        pcode = _codes(calls.iloc[act], self.proc)
        by_proc = np.argsort(pcode, kind="stable")
        cuts = np.flatnonzero(np.diff(pcode[by_proc])) + 1
        for li in np.split(act[by_proc], cuts) if len(act) else []:
            pkey = tuple(calls[c].iloc[li[0]] for c in self.proc)
            self._process(pkey, li, rproc.get(pkey, np.empty(0, np.int64)))
        return self.line_range, self.reason

    def _dupable(self, active: np.ndarray) -> np.ndarray:
        """True for a line identical (every logged field) to its thread's previous active line."""
        calls = self.calls
        out = np.zeros(len(calls), bool)
        idx = np.flatnonzero(active)
        if len(idx) < 2:
            return out
        sub = calls.iloc[idx]
        fields = [c for c in _SIGNATURE if c in sub.columns] + self.proc + ["tid", "file"]
        thread = _codes(sub, self.proc + ["tid"])
        order = np.lexsort((sub.line.to_numpy("int64"), sub.file.astype("string").fillna("").to_numpy(object),
                            thread))  # fmt: skip
        s = sub.iloc[order]
        same = np.ones(len(s) - 1, bool)
        for c in fields:
            a, b = s[c].iloc[1:].reset_index(drop=True), s[c].iloc[:-1].reset_index(drop=True)
            same &= a.eq(b).fillna(False).to_numpy(bool) | (a.isna() & b.isna()).to_numpy(bool)
        out[idx[order[1:][same]]] = True
        return out

    def _process(self, pkey: tuple, li: np.ndarray, ri: np.ndarray) -> None:
        ids = self.r.nccl_comm_id.to_numpy(dtype=object)[ri] if len(ri) else np.empty(0, object)
        if not pd.notna(ids).any():
            self._store(li, *self._match(li, ri, self.lcode, self.rcode))
            return
        # Communicator ids: link pointers to ids, then match per thread with the communicator as
        # part of the key. (Matching per communicator instead would discard the thread's order
        # across communicators, which is what pins down runs of identical calls.)
        link = self._link(pkey, li, ri)
        # Linked communicators get small codes 0..k-1; unlinked pointers and ids share _NO_KEY.
        code_of = pd.Series(np.arange(len(link), dtype=np.int64), index=pd.Index(list(link.values()), dtype="uint64"))
        by_ptr = pd.Series(np.arange(len(link), dtype=np.int64), index=pd.Index(list(link.keys()), dtype="uint64"))
        lcomm = _lookup(self.ptr.iloc[li], by_ptr)
        rcomm = _lookup(self.r.nccl_comm_id.iloc[ri], code_of)
        # Single-rank communicators launch nothing: their lines and ranges need no match.
        single_ids = set(np.unique(lcomm[self.single[li]]).tolist()) - set(np.unique(lcomm[~self.single[li]]).tolist())
        single_ids.discard(_NO_KEY)
        lkeep = ~np.isin(lcomm, list(single_ids))
        rkeep = ~np.isin(rcomm, list(single_ids))
        li, lcomm, ri, rcomm = li[lkeep], lcomm[lkeep], ri[rkeep], rcomm[rkeep]
        lcode, rcode = self._combine(li, ri, [lcomm], [rcomm])
        pos, why, failed = self._match(li, ri, lcode, rcode)
        # opCount as a further key where it is the communicator's plan index (see _plans).
        lop = _int(self.calls.op_count.iloc[li]) if "op_count" in self.calls.columns else None
        if lop is not None and len(ri):
            plan = self._plans(ri, rcomm)
            hit = pos >= 0
            where = pd.Series(np.arange(len(ri)), index=ri)
            agree = pd.DataFrame({"c": lcomm[hit], "ok": lop[hit] == plan[where.reindex(pos[hit]).to_numpy()]})
            agree = agree[agree.c != _NO_KEY].groupby("c").ok.all()
            trusted = agree.index[agree.to_numpy(bool)].to_numpy()
            if len(trusted):
                lh = np.where(np.isin(lcomm, trusted), lop, _NO_KEY)
                rh = np.where(np.isin(rcomm, trusted), plan, _NO_KEY)
                lcode2, rcode2 = self._combine(li, ri, [lcomm, lh], [rcomm, rh])
                pos2, why2, failed2 = self._match(li, ri, lcode2, rcode2)
                # A thread that the stricter keys cannot explain keeps the first result; so does one
                # where they leave a line without any range (opCount then was not the plan index).
                lost = (why2 == "no_nvtx_range") & (why != "no_nvtx_range")
                tid = self.ltid[li]
                failed2 = failed2 | np.isin(tid, tid[lost])
                take = ~failed2
                pos, why, failed = np.where(take, pos2, pos), np.where(take, why2, why), np.where(take, failed2, failed)
        self._store(li, pos, why, failed)

    def _combine(self, li: np.ndarray, ri: np.ndarray, lextra: list[np.ndarray],
                 rextra: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """Match codes of the base key plus extra integer columns, for lines ``li`` and ranges ``ri``."""
        cols = {"k": np.r_[self.lcode[li], self.rcode[ri]]}
        for j, (a, b) in enumerate(zip(lextra, rextra)):
            cols[f"x{j}"] = np.r_[a, b]
        code = _codes(pd.DataFrame(cols), list(cols))
        lcode = np.full(len(self.lcode), -3, dtype=np.int64)
        rcode = np.full(len(self.rcode), -2, dtype=np.int64)
        lcode[li], rcode[ri] = code[:len(li)], code[len(li):]
        return lcode, rcode

    def _plans(self, ri: np.ndarray, rcomm: np.ndarray) -> np.ndarray:
        """Plan index of each range on its communicator: how many launch ranges with calls on
        that communicator started before the range's own (-1 if unknown).

        NCCL's opCount counts the plans launched on a communicator (before 2.27.3 every plan;
        from 2.27.3 only those with network work), so it equals this index when every plan
        counts and each launch range makes one plan. That is not assumed: the caller uses the
        index only for communicators whose uniquely matched lines all confirm it.
        """
        unit = self.r.unit.to_numpy("int64")[ri]
        start = self.r.start.to_numpy("int64")
        f = pd.DataFrame({"c": rcomm, "u": unit, "t": start[np.maximum(unit, 0)]})
        ok = (f.c != _NO_KEY) & (f.u >= 0)
        plans = f[ok].drop_duplicates(["c", "u"]).sort_values(["c", "t", "u"], kind="stable")
        plans["plan"] = plans.groupby("c").cumcount()
        out = f.merge(plans[["c", "u", "plan"]], on=["c", "u"], how="left").plan
        return np.where(ok.to_numpy(bool), out.fillna(_NO_KEY).to_numpy("int64"), _NO_KEY)

    def _store(self, li: np.ndarray, pos: np.ndarray, why: np.ndarray, failed: np.ndarray) -> None:
        del failed
        hit = pos >= 0
        self.line_range[li[hit]] = pos[hit]
        self.reason[li[~hit]] = why[~hit]

    def _link(self, pkey: tuple, li: np.ndarray, ri: np.ndarray) -> dict[int, int]:
        """Communicator pointer -> NVTX communicator id for one process."""
        r, comms = self.r, self.comms
        ids = {int(x) for x in r.nccl_comm_id.iloc[ri].dropna()}
        link: dict[int, int] = {}
        if comms is not None and len(comms) and {"comm", "comm_id"} <= set(comms.columns):
            sel = comms.comm.notna() & comms.comm_id.notna()
            for c, v in zip(self.proc, pkey):
                sel &= comms[c] == v
            pairs = comms.loc[sel.fillna(False).to_numpy(bool), ["comm", "comm_id"]].astype("uint64").drop_duplicates()
            pairs = pairs[pairs.comm_id.isin(list(ids))]
            link.update(_bijective(pairs.comm.to_numpy(), pairs.comm_id.to_numpy()))
        ptr = self.ptr.iloc[li]
        if ptr.dropna().astype("uint64").isin(list(link)).all():
            return link
        # A first pass without communicator: the uniquely matched lines vote pointer -> id.
        pos, _, _ = self._match(li, ri, self.lcode, self.rcode)
        got = pos >= 0
        p = self.ptr.iloc[li[got]].to_numpy(dtype=object)
        cid = r.nccl_comm_id.to_numpy(dtype=object)[pos[got]]
        ok = pd.notna(p) & pd.notna(cid)
        if ok.any():
            p, cid = p[ok].astype("uint64"), cid[ok].astype("uint64")
            new = ~np.isin(p, list(link)) & ~np.isin(cid, list(link.values()))
            link.update(_bijective(p[new], cid[new]))
        return link

    def _match(self, li: np.ndarray, ri: np.ndarray, lcode: np.ndarray,
               rcode: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """Explain lines ``li`` (file order) by ranges ``ri`` (start order), thread by thread.

        Returns per line of ``li``: range row or -1, reason, and whether its thread's lines
        could not be explained at all.
        """
        pos = np.full(len(li), -1, dtype=np.int64)
        why = np.full(len(li), None, dtype=object)
        failed = np.zeros(len(li), bool)
        ltid = self.ltid[li]
        rtid = self.rtid[ri]
        for t in pd.unique(ltid):
            sel = np.flatnonzero(ltid == t)
            rsub = ri[rtid == t]
            d = self.dupable[li[sel]].copy()
            d[0] = False
            p, w, f = _explain(lcode[li[sel]], d, rcode[rsub])
            pos[sel] = np.where(p >= 0, rsub[np.maximum(p, 0)] if len(rsub) else -1, -1)
            why[sel] = w
            failed[sel] = f
        return pos, why, failed


def _lookup(values: pd.Series, table: pd.Series) -> np.ndarray:
    """``table[value]`` for each (unsigned, nullable) value, _NO_KEY where null or absent."""
    v = values.astype("UInt64")
    out = np.full(len(v), _NO_KEY, dtype=np.int64)
    ok = v.notna().to_numpy(bool)
    if ok.any() and len(table):
        got = table.reindex(pd.Index(v[ok].to_numpy("uint64"), dtype="uint64"))
        out[ok] = got.fillna(_NO_KEY).to_numpy("int64")
    return out


def _bijective(a: np.ndarray, b: np.ndarray) -> dict[int, int]:
    """Pairs (a, b) whose a has no other b and whose b has no other a."""
    if len(a) == 0:
        return {}
    pairs = pd.DataFrame({"a": a, "b": b}).drop_duplicates()
    good = pairs.groupby("a").b.transform("nunique").eq(1) & pairs.groupby("b").a.transform("nunique").eq(1)
    return {int(x): int(y) for x, y in pairs[good.to_numpy(bool)].itertuples(index=False)}


def _explain(a: np.ndarray, dupable: np.ndarray, b: np.ndarray,
             trim: bool = True) -> tuple[np.ndarray, np.ndarray, bool]:  # fmt: skip
    """Exact-or-refuse position of each line key ``a`` among the range keys ``b``.

    Returns (position or -1, reason for -1: ``no_nvtx_range``, ``ambiguous`` or
    ``duplicate_line``, whether no explanation exists). ``dupable[i]``: line i may be a
    duplicate of line i - 1.
    """
    n = len(a)
    pos = np.full(n, -1, dtype=np.int64)
    why = np.full(n, None, dtype=object)
    if n == 0:
        return pos, why, False
    present = np.isin(a, b)
    why[~present] = "no_nvtx_range"  # no range at all has this key
    keep = np.flatnonzero(present)
    if len(keep) == 0:
        return pos, why, False
    a2 = a[keep]
    d2 = dupable[keep].copy()
    d2[1:] &= np.diff(keep) == 1  # a duplicate directly follows its original
    d2[0] = False
    if len(a2) == len(b) and not d2.any() and np.array_equal(a2, b):
        pos[keep] = np.arange(len(b))  # the common case: one line per range, nothing else fits
        return pos, why, False
    left = _leftmost(a2, d2, b)
    if left is None:
        if trim:
            return _explain_trimmed(a, dupable, b, keep, a2, d2, pos, why)
        why[keep] = "ambiguous"  # more lines than ranges can explain
        return pos, why, True
    # Rightmost explanation = leftmost of the reversed sequences; reversed, a line may share
    # the range of the line before it (in reversed order) when that line may be its duplicate.
    d_rev = np.zeros(len(a2), bool)
    d_rev[1:] = d2[::-1][:-1]
    right_rev = _leftmost(a2[::-1], d_rev, b[::-1])
    if right_rev is None:  # cannot happen: the reverse of an explanation explains the reverse
        why[keep] = "ambiguous"
        return pos, why, True
    right = (len(b) - 1 - right_rev)[::-1]
    forced = left == right
    prev_forced = np.r_[False, forced[:-1]]
    prev_left = np.r_[-1, left[:-1]]
    is_dup = d2 & forced & prev_forced & (left == prev_left)
    # A possible duplicate is a call of its own only if both neighbours are pinned apart.
    ok = forced & ~d2 | forced & d2 & prev_forced & (left != prev_left)
    pos[keep[ok]] = left[ok]
    why[keep[is_dup]] = "duplicate_line"
    why[keep[~ok & ~is_dup]] = "ambiguous"
    return pos, why, False


_MAX_EDGE_TRIM = 3


def _explain_trimmed(a, dupable, b, keep, a2, d2, pos, why):
    """More lines than ranges can explain. At the edges of a capture window a line whose range
    lies just outside it is the usual cause, so explanations are sought without up to
    ``_MAX_EDGE_TRIM`` lines at the thread's ends (fewest first); a line is matched only when
    every minimal trim that explains the rest keeps it on the same range. Otherwise (or when no
    trim helps) the thread's lines are ambiguous."""
    n2 = len(a2)
    for t in range(1, _MAX_EDGE_TRIM + 1):
        results = []
        for head in range(t + 1):
            tail = t - head
            if head + tail >= n2:
                continue
            sub = np.arange(head, n2 - tail)
            d_sub = d2[sub].copy()
            d_sub[0] = False
            p_sub, w_sub, failed = _explain(a2[sub], d_sub, b, trim=False)
            if not failed:
                full_p = np.full(n2, -2, np.int64)  # -2: trimmed in this variant
                full_p[sub] = p_sub
                full_w = np.full(n2, "ambiguous", dtype=object)
                full_w[sub] = w_sub
                results.append((full_p, full_w))
        if results:
            ps = np.stack([r[0] for r in results])
            agree = (ps == ps[0]).all(axis=0) & (ps[0] >= 0)
            pos[keep[agree]] = ps[0][agree]
            same_why = np.array([all(r[1][i] == results[0][1][i] for r in results) for i in range(n2)])
            rest = ~agree
            why[keep[rest]] = np.where(same_why[rest] & (ps[0][rest] != -2), results[0][1][rest], "ambiguous")
            return pos, why, False
    why[keep] = "ambiguous"  # more lines than ranges can explain
    return pos, why, True


def _leftmost(a: np.ndarray, dupable: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """Leftmost explanation: each line at the first range with its key after the previous
    line's range; a possible duplicate at its predecessor's range. None if the lines do not fit.

    Stretches where lines equal ranges one to one are taken in vectorised blocks, so the Python
    loop turns once per dropped line or possible duplicate, not once per line.
    """
    n, m = len(a), len(b)
    out = np.empty(n, dtype=np.int64)
    if m == 0:
        return None
    # Sorted key * (m + 1) + position answers "next range with key k after position p".
    stride = np.int64(m + 1)
    comb = np.sort(b.astype(np.int64) * stride + np.arange(m, dtype=np.int64))
    i, p, w = 0, -1, 64
    while i < n:
        if dupable[i]:
            out[i] = out[i - 1]
            i += 1
            continue
        j0 = p + 1
        span = min(w, n - i, m - j0)
        if span > 0:
            ok = (a[i:i + span] == b[j0:j0 + span]) & ~dupable[i:i + span]
            t = span if ok.all() else int(np.argmin(ok))
            if t:
                out[i:i + t] = np.arange(j0, j0 + t)
                i, p = i + t, j0 + t - 1
            if t == span:
                w = min(w * 2, 1 << 16)
                continue
            w = 64
            if dupable[i]:
                continue
        q = int(np.searchsorted(comb, np.int64(a[i]) * stride + p + 1))
        if q >= m or comb[q] // stride != a[i]:
            return None
        p = int(comb[q] % stride)
        out[i] = p
        i += 1
    return out


# --------------------------------------------------------------------------- kernels


def _assign(calls: pd.DataFrame, r: pd.DataFrame, k: pd.DataFrame, lost: pd.DataFrame, line_range: np.ndarray,
            line_reason: np.ndarray, by_host: bool) -> ExactCorrelation:  # fmt: skip
    """Kernels of each launch range -> communicators -> the calls matched to its ranges."""
    n = len(calls)
    matched = line_range >= 0
    rc = _call_ranges(calls, r, line_range, _proc_columns(by_host))
    kernels = _launch_kernels(rc, k, lost)
    out_gpid, out_corr, reason = _line_kernels(rc, kernels, line_range, line_reason)
    # Safety net: a line left with neither a range nor a reason had nothing to match against.
    reason[~matched & pd.isna(reason)] = "no_nvtx_range"
    single = (calls.nranks.astype("Int64") == 1).fillna(False).to_numpy(bool)
    flagged = calls.duplicate_of.notna().to_numpy(bool)
    reason[single & ~flagged] = "no_kernel_single_rank"
    out_gpid[single] = out_corr[single] = None
    nvtx_start = np.full(n, None, dtype=object)
    nvtx_start[matched] = r.start.to_numpy("int64")[line_range[matched]]
    call_matches = pd.DataFrame({
        "file": calls.file.array, "line": calls.line.astype("Int64").array,
        "kernel_global_pid": pd.array(out_gpid, dtype="Int64"),
        "kernel_correlation_id": pd.array(out_corr, dtype="Int64"),
        "reason": pd.array(reason, dtype="string"),
        "pid": calls.pid.astype("Int64").array, "tid": calls.tid.astype("Int64").array,
        "nvtx_start": pd.array(nvtx_start, dtype="Int64"),
    })  # fmt: skip
    return ExactCorrelation(call_matches, _kernel_ranges(kernels.kk, rc, r))


def _call_ranges(calls: pd.DataFrame, r: pd.DataFrame, line_range: np.ndarray, proc: list[str]) -> pd.DataFrame:
    """The call ranges with their communicator key (``ckey``), size and whether they are multi-rank."""
    matched = line_range >= 0
    rc = r.loc[r.kind == "call", proc + ["tid", "start", "end", "op", "unit", "nccl_comm_id",
                                          "nccl_message_bytes"]].copy()  # fmt: skip
    rc["range"] = rc.index.to_numpy()
    lm = pd.DataFrame({"range": line_range[matched], "lrow": np.flatnonzero(matched)}).drop_duplicates("range")
    rc = rc.merge(lm, on="range", how="left")
    has = rc.lrow.notna().to_numpy(bool)
    lrow = rc.lrow.fillna(0).to_numpy("int64")
    line_ptr = pd.Series(pd.array([None] * len(rc), dtype="UInt64"))
    line_nr = pd.Series(pd.array([None] * len(rc), dtype="Int64"))
    if has.any():
        line_ptr[has] = calls.comm.astype("UInt64").to_numpy()[lrow[has]]
        line_nr[has] = calls.nranks.astype("Int64").to_numpy()[lrow[has]]
    # With NVTX communicator ids the id names the communicator, else the matched line's pointer.
    ids_proc = rc.groupby(proc).nccl_comm_id.transform("count").gt(0).to_numpy(bool)
    rc["ckey"] = rc.nccl_comm_id.where(ids_proc, line_ptr).astype("UInt64")
    rc["nranks"] = line_nr
    # Size of a communicator from any matched line or its init payload (same process).
    init = r[(r.kind == "init").to_numpy(bool) & r.nccl_comm_id.notna().to_numpy(bool)
             & r.nccl_nranks.notna().to_numpy(bool)]  # fmt: skip
    known = pd.concat([rc.loc[rc.nranks.notna() & rc.ckey.notna(), proc + ["ckey", "nranks"]],
                       init[proc + ["nccl_comm_id", "nccl_nranks"]].set_axis(proc + ["ckey", "nranks"], axis=1)])
    known = known.drop_duplicates(proc + ["ckey"]).rename(columns={"nranks": "comm_nranks"})
    rc = rc.merge(known, on=proc + ["ckey"], how="left")
    rc["nranks"] = rc.nranks.fillna(rc.comm_nranks)
    rc["multi"] = ~(rc.nranks == 1).fillna(False).to_numpy(bool)
    return rc


@dataclass
class _LaunchKernels:
    """The kernels of the launch ranges and what is known of each launch range."""

    kk: pd.DataFrame  # per kernel: its launch range (``unit``) and, where it can be told, its ``comm``
    in_unit: np.ndarray  # bool per kernel: inside a launch range
    n_k: pd.Series  # kernels per launch range
    unknown_comm: pd.Series  # per launch range: it holds a multi-rank call range of unknown communicator
    all_placed: pd.Series  # per launch range: every kernel in it has a communicator


def _launch_kernels(rc: pd.DataFrame, k: pd.DataFrame, lost: pd.DataFrame) -> _LaunchKernels:
    """Each kernel's launch range and, where its calls tell it, its communicator: the launch
    range's one communicator, else its stream's, unless two kernels of the range would share it
    or a split plan or lost launch leaves the pairing in doubt."""
    mr = rc[rc.multi & (rc.unit >= 0)]
    pairs = mr.loc[mr.ckey.notna(), ["unit", "ckey"]].drop_duplicates()
    ucomm = pairs.groupby("unit").ckey.agg(["nunique", "first"])
    unknown_comm = mr.ckey.isna().groupby(mr.unit).any()
    n_cand = mr.groupby("unit").size()
    kk = k[["global_pid", "pid", "correlation_id", "stream_id", "launch_range", "launch_tid"]].copy()
    kk["unit"] = kk.launch_range.to_numpy("int64")
    in_unit = (kk.unit >= 0).to_numpy(bool)
    n_k = kk[in_unit].groupby("unit").size()
    kk["nk"] = kk.unit.map(n_k).fillna(0).astype(int)
    kk["n_comms"] = kk.unit.map(ucomm["nunique"]).fillna(0).astype(int)
    kk["unknown"] = kk.unit.map(unknown_comm).fillna(False).astype(bool)
    # One kernel and one call range that may need it: that range is the kernel's, whatever its
    # communicator (an ungrouped call whose line is missing, without NVTX communicator ids).
    kk["lone"] = in_unit & (kk.nk == 1).to_numpy(bool) & (kk.unit.map(n_cand).fillna(0) == 1).to_numpy(bool)
    simple = in_unit & (kk.nk == 1).to_numpy(bool) & (kk.n_comms == 1).to_numpy(bool) & ~kk.unknown.to_numpy(bool)
    kk["comm"] = kk.unit.map(ucomm["first"]).astype("UInt64").where(simple)
    kk = _comm_by_stream(kk, simple, in_unit, pairs)
    kk = _drop_doubtful_comms(kk, mr, lost)
    all_placed = (kk.comm.notna() | ~pd.Series(in_unit)).groupby(kk.unit).all()
    return _LaunchKernels(kk, in_unit, n_k, unknown_comm, all_placed)


def _comm_by_stream(kk: pd.DataFrame, simple: np.ndarray, in_unit: np.ndarray, pairs: pd.DataFrame) -> pd.DataFrame:
    """Give kernels their stream's communicator where their launch range has a call range on it."""
    # Stream -> communicator, learned from launch ranges with one kernel and one communicator
    # (a stream serving several communicators teaches nothing).
    sm = kk.loc[simple, ["global_pid", "stream_id", "comm"]].drop_duplicates()
    sm = sm[sm.groupby(["global_pid", "stream_id"]).comm.transform("nunique").eq(1).to_numpy(bool)]
    sm = sm.drop_duplicates(["global_pid", "stream_id"]).rename(columns={"comm": "stream_comm"})
    kk = kk.merge(sm, on=["global_pid", "stream_id"], how="left")
    cand = kk[~simple & in_unit & kk.stream_comm.notna().to_numpy(bool)][["unit", "stream_comm"]]
    member = cand.reset_index().merge(pairs.rename(columns={"ckey": "stream_comm"}), on=["unit", "stream_comm"])
    kk.loc[member["index"].to_numpy(), "comm"] = member.stream_comm.to_numpy()
    return kk


def _drop_doubtful_comms(kk: pd.DataFrame, mr: pd.DataFrame, lost: pd.DataFrame) -> pd.DataFrame:
    """Take the communicator back from kernels whose pairing with their calls is not certain."""
    # Two kernels of one launch range on one communicator: neither can be told apart.
    clash = kk.comm.notna().to_numpy(bool) & kk.groupby(["unit", "comm"], dropna=False).unit.transform(
        "size").gt(1).to_numpy(bool)
    kk.loc[clash, "comm"] = pd.NA
    # Seeing that refutes "one kernel per communicator per launch range" for the process (NCCL
    # splits large groups into several plans), and a launch range holding a lost launch may have
    # lost a sibling: there a lone kernel is not given to several calls of its communicator.
    split_procs = kk.loc[clash, "global_pid"].unique()
    n_lost = lost.loc[lost.launch_range >= 0].groupby("launch_range").size()
    calls_per = mr[mr.ckey.notna()].groupby(["unit", "ckey"]).size().rename("n_calls").reset_index()
    kk = kk.merge(calls_per.rename(columns={"ckey": "comm"}), on=["unit", "comm"], how="left")
    n_unknown = mr.ckey.isna().groupby(mr.unit).sum()
    mates = kk.n_calls.fillna(0).to_numpy() + kk.unit.map(n_unknown).fillna(0).to_numpy()
    suspect = kk.global_pid.isin(split_procs).to_numpy(bool) | (kk.unit.map(n_lost).fillna(0) > 0).to_numpy(bool)
    doubt = suspect & kk.comm.notna().to_numpy(bool) & (mates > 1)
    kk.loc[doubt, "comm"] = pd.NA
    return kk


def _line_kernels(rc: pd.DataFrame, kernels: _LaunchKernels, line_range: np.ndarray,
                  line_reason: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Each matched line: its range's launch range and communicator -> kernel. Returns per line
    the kernel's global pid and correlation id (None without) and the reason (None when matched)."""
    n = len(line_range)
    kk, n_k = kernels.kk, kernels.n_k
    out_gpid = np.full(n, None, dtype=object)
    out_corr = np.full(n, None, dtype=object)
    reason = line_reason.copy()
    rows = np.flatnonzero((line_range >= 0) & pd.isna(reason))
    lines = rc.set_index("range").reindex(line_range[rows])[["unit", "ckey"]].reset_index(drop=True)
    lines["row"] = rows
    placed = kk.loc[kk.comm.notna().to_numpy(bool) & kernels.in_unit, ["unit", "comm", "global_pid", "correlation_id"]]
    lines = lines.merge(placed.rename(columns={"comm": "ckey"}), on=["unit", "ckey"], how="left")
    hit = lines.correlation_id.notna().to_numpy(bool)
    lrows = lines.row.to_numpy()
    out_gpid[lrows[hit]] = lines.global_pid.to_numpy(dtype=object)[hit]
    out_corr[lrows[hit]] = lines.correlation_id.to_numpy(dtype=object)[hit]
    no_kernel = (lines.unit.to_numpy("int64") < 0) | (lines.unit.map(n_k).fillna(0).to_numpy() == 0)
    # Every kernel of the launch range belongs to another communicator: this one's is missing.
    others = (lines.ckey.notna().to_numpy(bool) & lines.unit.map(kernels.all_placed).fillna(False).to_numpy(bool)
              & ~lines.unit.map(kernels.unknown_comm).fillna(False).to_numpy(bool))  # fmt: skip
    reason[lrows[~hit]] = np.where((no_kernel | others)[~hit], "kernel_missing", "ambiguous")
    return out_gpid, out_corr, reason


def _kernel_ranges(kk: pd.DataFrame, rc: pd.DataFrame, r: pd.DataFrame) -> pd.DataFrame:
    """One row per (kernel, call range it serves); kernels without ranges get one row."""
    base = kk[["global_pid", "correlation_id", "pid", "stream_id", "unit", "comm", "n_comms", "unknown", "lone",
               "launch_tid"]].rename(
        columns={"global_pid": "kernel_global_pid", "correlation_id": "kernel_correlation_id"})
    u = base.unit.to_numpy("int64")
    inside = u >= 0
    base["launch_text"] = np.where(inside, r.text.to_numpy(dtype=object)[np.maximum(u, 0)], None)
    base["launch_start"] = pd.array(np.where(inside, r.start.to_numpy("int64")[np.maximum(u, 0)], 0), dtype="Int64")
    base.loc[~inside, "launch_start"] = pd.NA
    lone = base.lone.to_numpy(bool) & base.comm.isna().to_numpy(bool)
    status = np.where(base.comm.notna().to_numpy(bool) | lone, "matched", "ambiguous").astype(object)
    status[inside & (base.n_comms == 0).to_numpy(bool) & ~base.unknown.to_numpy(bool)] = "no_call_ranges"
    status[~inside] = "no_launch_range"
    status[~inside & base.launch_tid.isna().to_numpy(bool)] = "no_launch"
    base["status"] = status
    # The list is complete unless the launch range also holds calls of unknown communicator
    # (no NVTX ids, line not matched) that this kernel may serve as well.
    base["complete"] = (status == "matched") & (lone | ~base.unknown.to_numpy(bool))
    ranges = rc.loc[rc.multi & (rc.unit >= 0), ["unit", "ckey", "tid", "start", "end", "op",
                                                 "nccl_message_bytes", "nccl_comm_id"]].rename(columns={
        "ckey": "comm", "tid": "range_tid", "start": "range_start", "end": "range_end", "op": "range_op",
        "nccl_message_bytes": "range_message_bytes", "nccl_comm_id": "range_comm_id"})  # fmt: skip
    by_comm = base[~lone].merge(ranges[ranges.comm.notna()], on=["unit", "comm"], how="left")
    by_unit = base[lone].merge(ranges.drop(columns="comm"), on="unit", how="left")
    m = pd.concat([by_comm, by_unit], ignore_index=True)
    cols = ["kernel_global_pid", "kernel_correlation_id", "pid", "stream_id", "status", "complete", "launch_text",
            "launch_start",
            "range_tid", "range_start", "range_end", "range_op", "range_comm_id", "range_message_bytes"]
    out = m[cols].copy()
    for c in ("range_tid", "range_start", "range_end", "range_message_bytes"):
        out[c] = out[c].astype("Int64")
    out["range_comm_id"] = out.range_comm_id.astype("UInt64")
    out["range_op"] = out.range_op.astype("string")
    return out.sort_values(["kernel_global_pid", "kernel_correlation_id", "range_start"], kind="stable",
                           na_position="last").reset_index(drop=True)  # fmt: skip
