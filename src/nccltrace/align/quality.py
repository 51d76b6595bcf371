"""Can I trust these matches? Checks of call <-> kernel matches against evidence the alignment
did not optimise, their per-process record, and the messages they give.

The aligner's certainty holds only within its scoring model, and a capture that breaks the model
makes all optimal alignments wrong together; so each match is also checked against evidence
outside the model (capture window, log time, stream, P2P pairing, cross-rank overlap), and a
contradicted match is demoted to unmatched with the check's name as reason. The checks:
``docs/correlation.md`` section 1.5.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numba as nb
import numpy as np
import pandas as pd
import pyarrow as pa

from nccltrace.core.layout import ALIGNMENT_QUALITY_FILE
from nccltrace.core.tables import documented_field as _f
from nccltrace.core.tables import write_json_atomic

__all__ = [
    "CHECKS",
    "CROSS_RANK_REASON",
    "INFORMATIONAL_CHECKS",
    "P2P_REASON",
    "QUALITY_FILE",
    "QUALITY_SCHEMA",
    "QUALITY_TABLE",
    "contradicts_most",
    "cross_rank_contradictions",
    "cross_rank_scales",
    "end_deviations",
    "p2p_contradictions",
    "quality_findings",
    "quality_problems",
    "quality_rows",
    "read_quality",
    "write_quality",
]

QUALITY_FILE = ALIGNMENT_QUALITY_FILE  # the layout names it
QUALITY_TABLE = "alignment_quality.parquet"
CROSS_RANK_REASON = "contradicted_cross_rank"
P2P_REASON = "contradicted_p2p"

CHECKS: dict[str, tuple[str, str]] = {
    # check -> (what it verifies, what to do when it contradicts matches)
    "capture_window": ("the export's capture is located in the log (log time or declared steps)",
                       "log timestamps (NCCL >= 2.26) or declare the captured steps"),
    "log_time": ("each kernel was launched within the learned log-line -> launch window",
                 "check that the log and the export come from the same run and host clock"),
    "stream": (("each kernel ran on the export stream its line's log stream maps to (one cudaStream_t is one "
               "export stream)"), "check that the log and the export come from the same process"),
    "p2p_pairing": (("a Recv's kernel ends after the kernel of its Send (the k-th Send a->b is the k-th Recv on b "
                    "from a) started"), "check both ranks' logs and exports for lost records around the demoted calls"),
    "cross_rank": ("the kernels of one collective instance on all its ranks overlap in synchronised time",
                   ("check the rank's log and export for lost records around the demoted calls; with NCCL >= 2.26 "
                   "log timestamps locate every call")),
    "profiler_records": (("the profiler trace's own record of each matched kernel's call (kernel arguments, or the "
                          "record_param_comms op of a batched Send/Recv) names the logged call's op and element "
                          "count; contradicted matches are named, not demoted"),
                         "check that the trace and the log come from the same process and run"),
    # where a process has no log, the sources that describe its calls are checked against each other
    "sources_agree": (("the sources that describe one call (profiler kernel and CPU records, Flight Recorder "
                       "entries) name the same op, element count and process group"),
                      "check that the trace and the dump come from the same rank of the same job"),
}

QUALITY_SCHEMA = pa.schema(
    [
        _f("process", pa.string(), "", "process (log stem nccl_<host>_<pid>, or host:pid)"),
        _f("host", pa.string(), "", "host of the process"),
        _f("pid", pa.int64(), "", "process id"),
        _f("check", pa.string(), "", "'capture_window', 'log_time', 'stream', 'nvtx_range', 'cuda_graph', 'log_gaps', 'one_process_per_log', 'kernel_args', 'p2p_pairing', 'cross_rank', 'profiler_records' (logged processes with a profiler trace: its own record of each matched call agrees; contradictions named, not demoted), 'sources_agree' (log-less processes: the sources of one call agree), 'tuning' (a call's own TUNING line as evidence), 'cross_rank_stood_down', 'p2p_pairing_stood_down' or 'log_time_stood_down'; the messages of 'tuning' and the '*_stood_down' records are findings (a check that stood down where the run contradicts its assumption), not gaps: see docs/correlation.md"),
        _f("applicable", pa.bool_(), "", "whether the evidence the check needs exists for this process"),
        _f("confirmed", pa.int64(), "", "matches the check confirmed (capture_window: matches inside the located window)"),
        _f("contradicted", pa.int64(), "", "matches the check contradicted; they were demoted to unmatched"),
        _f("not_checkable", pa.int64(), "", "matches the check could not test (no time, no peer, unsynchronised clock)"),
        _f("message", pa.string(), "", "what the check found and what to do (null when nothing to say)"),
    ]
)


def write_quality(path: Path | str, process: str, quality: Mapping[str, Any]) -> None:
    """Write one process's alignment-quality record (JSON, atomically)."""
    write_json_atomic(Path(path), {"process": process, **quality})


def read_quality(path: Path | str) -> dict[str, Any]:
    """A record written by :func:`write_quality` (empty checks when the file is absent: an
    alignment made before quality records existed, or by a mode without checks)."""
    p = Path(path)
    if not p.exists():
        return {"process": p.parent.name, "checks": []}
    return json.loads(p.read_text())


def _message(process: str, check: dict[str, Any]) -> str | None:
    if check.get("message"):
        return str(check["message"])
    n = int(check.get("contradicted") or 0)
    if n == 0:
        return None
    what, remedy = CHECKS.get(check["check"], (check["check"], ""))
    return (f"{process}: {n} match(es) contradicted by the {check['check']} check ({what}); demoted to unmatched. "
            f"What to do: {remedy}")


INFORMATIONAL_CHECKS = frozenset({"cross_rank_stood_down", "p2p_pairing_stood_down", "log_time_stood_down",
                                  "tuning"})
"""Checks whose message is a finding about the run, not a gap in its results (the run is not
made partial by them): where a check stood down because the run contradicts its assumption."""


def quality_problems(process: str, quality: Mapping[str, Any]) -> list[str]:
    """The problems a process's quality record makes (each makes the run partial)."""
    return [m for c in quality.get("checks", []) if c.get("check") not in INFORMATIONAL_CHECKS
            and (m := _message(process, c))]  # fmt: skip


def quality_findings(process: str, quality: Mapping[str, Any]) -> list[str]:
    """The findings (``INFORMATIONAL_CHECKS``) of a process's quality record: notes, not problems."""
    return [m for c in quality.get("checks", []) if c.get("check") in INFORMATIONAL_CHECKS
            and (m := _message(process, c))]  # fmt: skip


def quality_rows(process: str, host: str | None, pid: int | None, quality: Mapping[str, Any]) -> list[dict]:
    """Rows of ``QUALITY_SCHEMA`` for one process's record."""
    rows = []
    for c in quality.get("checks", []):
        rows.append({"process": process, "host": host, "pid": pid, "check": c["check"],
                     "applicable": bool(c.get("applicable", False)), "confirmed": int(c.get("confirmed") or 0),
                     "contradicted": int(c.get("contradicted") or 0),
                     "not_checkable": int(c.get("not_checkable") or 0), "message": _message(process, c)})  # fmt: skip
    return rows


# ------------------------------------------------------------------ cross-rank consistency

_SYMMETRIC = {"AllReduce", "AllGather", "ReduceScatter", "AlltoAll"}
CROSS_RANK_SLACK_NS = 2_000
"""Kernel timestamps of one node agree to about a microsecond; across nodes the clock model's
residual (times five) is added."""


def cross_rank_contradictions(rows: pd.DataFrame, slack: Mapping[str, float] | None = None,
                              scales: tuple[float, float] | None = None) -> pd.DataFrame:  # fmt: skip
    """Matches whose kernel cannot belong to their collective instance.

    ``rows``: one row per matched call of a cross-rank instance with ``instance``, ``member``
    (any id unique within the run, e.g. the global rank), ``clock_domain``, ``op``,
    ``rank_in_comm``, ``root``, ``start_sync``, ``end_sync`` (null when the domain's clock is
    unknown: not checkable), ``comm`` and ``op_count`` (the instance's communicator and its
    place on it, ``ops.instance_parts``). ``slack``: extra tolerance per clock domain (ns).

    Three tests, all on synchronised time:

    * **order** (first, per communicator): the claimed ends cluster in time and the instances
      must map onto the clusters in opCount order (:func:`_order_consensus`); this holds when
      the members of one instance that were shifted alike outnumber the right ones;
    * **dependency**: member r's kernel must end after every member it needs data from
      started (less the tolerance);
    * **common end**: the members of one collective finish together (the clock model rests
      on it), so a kernel ending further from its instance's median end than ``END_SPREAD_K``
      robust deviations of all instances' end spreads (at least the tolerance) is another
      launch's. This catches a match shifted onto a back-to-back neighbour, which the first
      test cannot.

    Violations are resolved by removing members in order of how many violated dependencies
    they take part in; when two members are equally implicated (a two-rank instance), both go:
    the check cannot tell which one is wrong. Returns the removed rows (index of ``rows``)
    with ``instance`` and ``member``.

    Every test looks at one communicator's rows, given two run-wide scales: the robust end
    spread and the widest tolerance (``cross_rank_scales``). ``scales``: those of the whole
    run, when ``rows`` hold only some of its communicators (a run checked in parts); by
    default they are taken from ``rows``."""
    t = _timed(rows, slack)
    if t.empty:
        return rows.iloc[0:0][["instance", "member"]]
    judged = end_spread_by_comm(t)
    stood_down = judged[judged["stood_down"]]
    relaxed = t["comm"].isin(set(stood_down["comm"])).to_numpy(bool)
    spread, wide = scales if scales is not None else cross_rank_scales(*_deviations(t[~relaxed]))
    size = t.groupby("instance", sort=False)["member"].transform("size")
    # claims off their communicator's instance order first (they would skew each instance's
    # median); a one-member instance still carries its place in that order. Not where the
    # kernels of one collective end too far apart to order them (stood down: dependency only)
    out_idx: list[Any] = _order_consensus(t[~relaxed], wide, 3 * spread)
    t = t[size >= 2].drop(index=out_idx, errors="ignore")
    if t.empty:
        return _with_findings(rows.loc[out_idx, ["instance", "member"]], stood_down)
    relaxed = t["comm"].isin(set(stood_down["comm"])).to_numpy(bool)
    g = t.groupby("instance", sort=False)
    dev = (t["end_sync"].astype("float64") - g["end_sync"].transform("median").astype("float64")).abs()
    off_end = (dev.to_numpy() > np.maximum(t["tol"].to_numpy(), END_SPREAD_K * spread)) & ~relaxed
    # fast path for the dependency test: an instance whose latest start precedes its earliest
    # end (within the largest tolerance) is consistent under every dependency pattern
    late = g["start_sync"].transform("max") - g["tol"].transform("max")
    early = g["end_sync"].transform("min")
    bad_inst = set(t.loc[(late > early).to_numpy() | off_end, "instance"])
    loose = set(stood_down["comm"])
    for _, inst in t[t["instance"].isin(bad_inst)].groupby("instance", sort=False):
        out_idx += _resolve(inst, END_SPREAD_K * spread, common_end=inst["comm"].iloc[0] not in loose)
    return _with_findings(rows.loc[out_idx, ["instance", "member"]], stood_down)


STAND_DOWN_RATIO = 0.25
"""The cross-rank check's common-end and order tests stand down on a communicator whose
collectives' kernels end, on their ranks, further apart than this share of the time between
consecutive collectives of the communicator (medians over its instances): there, ending together
cannot tell a collective from its neighbour, and the tests would contradict correct matches
(ranks time-sharing a GPU: 3-4.5 ms of end spread for 4.7 ms between collectives, a ratio of 0.8,
on the real H200 capture; emulated runs, lossy or not: below 0.01). The dependency test (no
kernel ends before a peer it needs data from started) still runs there."""
_MIN_JUDGED = 4  # instances of two or more timed members needed to judge a communicator


def end_spread_by_comm(timed: pd.DataFrame) -> pd.DataFrame:
    """Per communicator of the timed rows (``_timed``): its instances of two or more timed
    members, the median spread of their kernel ends (latest - earliest, ns), the median time
    between consecutive instances' median ends (ns), their ratio and whether the check stands
    down there (``STAND_DOWN_RATIO``). Medians, so a minority of wrong claims (each widening its
    instance's spread) does not make the check stand down."""
    cols = ["comm", "instances", "end_spread_ns", "gap_ns", "ratio", "stood_down"]
    if timed.empty:
        return pd.DataFrame(columns=cols).astype({"stood_down": bool})
    ends = timed.groupby(["comm", "instance"], sort=False)["end_sync"].agg(["min", "max", "median", "size"])
    ends = ends[ends["size"] >= 2].astype({"min": "float64", "max": "float64", "median": "float64"})
    out = []
    for comm, e in ends.groupby(level="comm", sort=False):
        med = np.sort(e["median"].to_numpy())
        gaps = np.diff(med)
        spread = float(np.median(e["max"] - e["min"])) if len(e) else 0.0
        gap = float(np.median(gaps)) if len(gaps) else float("nan")
        ratio = spread / gap if gap and gap > 0 else float("nan")
        out.append((comm, len(e), spread, gap, ratio, bool(len(e) >= _MIN_JUDGED and ratio > STAND_DOWN_RATIO)))
    return pd.DataFrame(out, columns=cols).astype({"stood_down": bool})


def _with_findings(removed: pd.DataFrame, stood_down: pd.DataFrame) -> pd.DataFrame:
    """The removed rows, carrying the communicators the check stood down on (``attrs``)."""
    removed.attrs["stood_down"] = stood_down.to_dict("records")
    return removed


END_SPREAD_K = 8.0


_CROSS_RANK_COLUMNS = ["instance", "member", "clock_domain", "op", "rank_in_comm", "root", "start_sync", "end_sync",
                       "comm", "op_count"]  # fmt: skip


def _timed(rows: pd.DataFrame, slack: Mapping[str, float] | None) -> pd.DataFrame:
    """The rows with synchronised times, with their tolerance ``tol`` (ns)."""
    timed = rows.dropna(subset=["start_sync", "end_sync"])
    tol = CROSS_RANK_SLACK_NS + timed["clock_domain"].map(slack or {}).astype(float).fillna(0.0)
    return timed[_CROSS_RANK_COLUMNS].assign(tol=tol.to_numpy())


def end_deviations(rows: pd.DataFrame,
                   slack: Mapping[str, float] | None = None) -> tuple[np.ndarray, np.ndarray, float]:  # fmt: skip
    """What the run-wide scales of the cross-rank check are taken from, for ``rows`` (see
    ``cross_rank_contradictions``): per timed member of an instance with two or more timed
    members, its kernel end's distance (ns) from the instance's median end, and whether the
    instance has three or more; and the widest tolerance of the timed rows (-inf without any).
    Instances lie within one communicator, so the arrays of parts of whole communicators
    concatenate to the run's."""
    timed = _timed(rows, slack)
    judged = end_spread_by_comm(timed)
    # a communicator the check stands down on says nothing about the others' end spread
    return _deviations(timed[~timed["comm"].isin(set(judged.loc[judged["stood_down"], "comm"]))])


def _deviations(timed: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, float]:
    """``end_deviations`` of the timed rows (``_timed``)."""
    if timed.empty:
        return np.zeros(0), np.zeros(0, bool), float("-inf")
    t = timed[timed.groupby("instance", sort=False)["member"].transform("size").to_numpy() >= 2]
    g = t.groupby("instance", sort=False)
    dev = (t["end_sync"].astype("float64") - g["end_sync"].transform("median").astype("float64")).abs()
    big = (g["member"].transform("size") >= 3).to_numpy(bool)
    return dev.to_numpy(np.float64), big, float(timed["tol"].max())


def cross_rank_scales(dev: np.ndarray, big: np.ndarray, widest_tol: float) -> tuple[float, float]:
    """(robust end spread, widest tolerance) of the cross-rank check from ``end_deviations``:
    the spread (ns) of members' ends around their instance's median end, over instances of
    three or more members (whose median one wrong member cannot move) when there are enough of
    them; the widest of the tolerances and ``END_SPREAD_K`` spreads."""
    base = dev[big] if int(big.sum()) >= 32 else dev
    spread = 1.4826 * float(np.median(base)) if len(base) else 0.0
    return spread, float(max(widest_tol, END_SPREAD_K * spread))


def _resolve(inst: pd.DataFrame, end_spread: float = 0.0, common_end: bool = True) -> list[Any]:
    """Rows of one instance to remove so that every dependency holds and (``common_end``) every
    end lies near the others' (see caller)."""
    op = str(inst["op"].iloc[0])
    idx = list(inst.index)
    start = inst["start_sync"].to_numpy(np.int64)
    end = inst["end_sync"].to_numpy(np.int64)
    tol = inst["tol"].to_numpy(float)
    rk = inst["rank_in_comm"].to_numpy()
    root = inst["root"].to_numpy()
    n = len(idx)
    # need[a, b]: member a's result depends on member b having started
    if op in _SYMMETRIC:
        need = ~np.eye(n, dtype=bool)
    elif op == "Broadcast":
        need = np.zeros((n, n), bool)
        need[:, rk == root] = True
        np.fill_diagonal(need, False)
    elif op == "Reduce":
        need = np.zeros((n, n), bool)
        need[rk == root, :] = True
        np.fill_diagonal(need, False)
    else:
        return []
    pair_tol = np.maximum(tol[:, None], tol[None, :])
    bad = need & (end[:, None] < start[None, :] - pair_tol)
    # ends of one collective agree: a pair further apart than twice the learned spread is wrong
    # on one side (symmetric, so the member apart from most others is removed first)
    if common_end and (op in _SYMMETRIC or op in ("Broadcast", "Reduce")):
        far = np.abs(end[:, None] - end[None, :]) > 2 * np.maximum(pair_tol, end_spread)
        np.fill_diagonal(far, False)
        bad |= far
    alive = np.ones(n, bool)
    removed: list[Any] = []
    while True:
        b = bad & alive[:, None] & alive[None, :]
        if not b.any():
            break
        score = b.sum(axis=0) + b.sum(axis=1)
        worst = np.flatnonzero(score == score.max())
        alive[worst] = False
        removed += [idx[i] for i in worst]
    return removed

# ------------------------------------------------------------------ instance order consensus

@nb.njit(cache=True)
def _fenwick_max_query(tree: np.ndarray, i: int) -> int:
    """Max over positions [0, i) of a Fenwick tree of prefix maxima."""
    best = 0
    while i > 0:
        best = max(best, tree[i])
        i -= i & -i
    return best


@nb.njit(cache=True)
def _fenwick_max_update(tree: np.ndarray, i: int, v: int) -> None:
    i += 1
    while i < len(tree):
        tree[i] = max(tree[i], v)
        i += i & -i


@nb.njit(cache=True)
def _chain_through(inst: np.ndarray, clus: np.ndarray, w: np.ndarray, n_clusters: int) -> np.ndarray:
    """For pairs (instance, cluster) of one communicator sorted by instance: the weight of the
    heaviest chain strictly increasing in both that passes through each pair (forward best
    ending at the pair + backward best starting at it - its own weight)."""
    n = len(inst)
    fwd = np.zeros(n, np.int64)
    bwd = np.zeros(n, np.int64)
    tree = np.zeros(n_clusters + 1, np.int64)
    i = 0
    while i < n:  # forward, one instance at a time (pairs of one instance never chain)
        j = i
        while j < n and inst[j] == inst[i]:
            j += 1
        for p in range(i, j):
            fwd[p] = w[p] + _fenwick_max_query(tree, clus[p])
        for p in range(i, j):
            _fenwick_max_update(tree, clus[p], fwd[p])
        i = j
    tree[:] = 0
    j = n
    while j > 0:  # backward on mirrored clusters
        i = j - 1
        while i > 0 and inst[i - 1] == inst[j - 1]:
            i -= 1
        for p in range(i, j):
            bwd[p] = w[p] + _fenwick_max_query(tree, n_clusters - 1 - clus[p])
        for p in range(i, j):
            _fenwick_max_update(tree, n_clusters - 1 - clus[p], bwd[p])
        j = i
    return fwd + bwd - w


def _end_clusters(member: np.ndarray, end: np.ndarray, tol: float, split_gap: float,
                  start: np.ndarray | None = None) -> np.ndarray:
    """Cluster ids (time order) of one communicator's kernel ends: a new cluster where
    consecutive ends are more than ``tol`` apart. A cluster holding two ends of one member
    (two of its launches) holds instances closer than the tolerance: it is cut into as many runs
    as it holds ends of its most frequent member, none holding a member twice, at the widest gaps
    that allow it (``_member_runs``: each member's launches on a communicator run one after
    another), when every member's claimed kernels there do run one after another (``start``:
    claims that overlap on one member's stream cannot both be right); otherwise at its widest gap while that gap exceeds ``split_gap``
    (again for each part); a narrower one holds a claim shifted onto another instance's end, which
    the order consensus then outweighs. (Where one collective's kernels end milliseconds apart,
    ranks time-sharing a GPU, consecutive instances lie within the tolerance with no gap between
    them wider than the spread; the runs still separate them.)"""
    order = np.argsort(end, kind="stable")
    e, m = end[order], member[order]
    st = None if start is None else start[order]
    cuts: set[int] = set((np.flatnonzero(np.diff(e) > tol) + 1).tolist())
    bounds = sorted({0, len(e), *cuts})
    todo = list(itertools.pairwise(bounds))
    while todo:
        a, b = todo.pop()
        if b - a < 2 or len(np.unique(m[a:b])) == b - a:
            continue
        gaps = np.diff(e[a:b])
        runs = _member_runs(m[a:b], gaps) if st is not None and _one_after_another(m[a:b], st[a:b], e[a:b]) else None
        if runs is not None:
            cuts.update(a + c for c in runs)
            continue
        if gaps.max() <= split_gap:
            continue
        cut = a + 1 + int(np.argmax(gaps))
        cuts.add(cut)
        todo += [(a, cut), (cut, b)]
    out = np.empty(len(e), np.int64)
    out[order] = np.searchsorted(np.array(sorted(cuts), np.int64), np.arange(len(e)), side="right")
    return out


def _one_after_another(members: np.ndarray, start: np.ndarray, end: np.ndarray) -> bool:
    """Whether each member's claimed kernels (end order) start after its previous one ended, as
    kernels of one stream do."""
    order = np.lexsort((end, members))
    m, s, e = members[order], start[order], end[order]
    same = m[1:] == m[:-1]
    return bool(np.all(s[1:][same] >= e[:-1][same]))


def _member_runs(members: np.ndarray, gaps: np.ndarray) -> list[int] | None:
    """Cut the ends of one cluster (time order; ``gaps[i]`` between ends i and i+1) into as many
    consecutive runs as the cluster holds ends of its most frequent member, none holding a member
    twice: the cut positions (a cut at i starts a run at end i), at the widest gaps that allow it
    (largest sum); None when no such cut exists (the ends of its instances interleave)."""
    codes = pd.factorize(members)[0]
    n = len(codes)
    d = int(np.bincount(codes).max())
    lo = np.zeros(n, np.int64)  # lo[j]: first start of a run ending at j that holds no member twice
    last: dict[int, int] = {}
    start = 0
    for j, c in enumerate(codes.tolist()):
        if c in last and last[c] >= start:
            start = last[c] + 1
        last[c] = j
        lo[j] = start
    best = np.full((n + 1, d + 1), -np.inf)
    best[0, 0] = 0.0
    arg = np.full((n + 1, d + 1), -1, np.int64)
    for j in range(1, n + 1):
        for i in range(int(lo[j - 1]), j):  # the run [i, j)
            gain = float(gaps[i - 1]) if i > 0 else 0.0
            for k in range(1, d + 1):
                v = best[i, k - 1] + gain
                if v > best[j, k]:
                    best[j, k], arg[j, k] = v, i
    if not np.isfinite(best[n, d]):
        return None
    cuts, j = [], n
    for k in range(d, 0, -1):
        j = int(arg[j, k])
        if j > 0:
            cuts.append(j)
    return sorted(cuts)


def _order_consensus(t: pd.DataFrame, tol: float, split_gap: float) -> list[Any]:
    """Claims that break the communicator's instance order. Per communicator, the claimed
    kernel ends cluster in time (one collective's members end together) and the instances
    (opCount order) must map onto the clusters (time order) monotonically, one to one. The
    heaviest such map (weight: claims a pair of instance and cluster carries) is the run's
    consensus; a claim is kept only when its pair lies on every heaviest map (no other pair
    of its instance or of its cluster reaches the same weight). Unlike a vote inside each
    instance, this holds when the members of one instance that lost a line and a kernel alike
    outnumber the right ones: their claims sit on the clusters of other instances, whose own
    members outweigh them along the order."""
    out: list[Any] = []
    for _, c in t.groupby("comm", sort=False):
        c = c.sort_values("op_count", kind="stable")
        clus = _end_clusters(c["member"].to_numpy(), c["end_sync"].to_numpy(np.float64), tol, split_gap,
                             c["start_sync"].to_numpy(np.float64))
        pairs = pd.DataFrame({"k": c["op_count"].to_numpy(), "c": clus}).groupby(["k", "c"], sort=True).size()
        k = pd.factorize(pairs.index.get_level_values(0), sort=True)[0].astype(np.int64)
        cl = pairs.index.get_level_values(1).to_numpy(np.int64)
        through = _chain_through(k, cl, pairs.to_numpy(np.int64), int(clus.max()) + 1)
        best = through.max()
        top = through == best
        alone = top & (pd.Series(top).groupby(k).transform("sum").to_numpy() == 1) & (
            pd.Series(top).groupby(cl).transform("sum").to_numpy() == 1)  # fmt: skip
        keep = pd.Series(alone, index=pairs.index)
        ok = keep.reindex(pd.MultiIndex.from_arrays([c["op_count"].to_numpy(), clus])).to_numpy()
        out += list(c.index[~ok])
    return out


MASS_CONTRADICTION_SHARE = 0.2
MASS_CONTRADICTION_MIN = 10


def contradicts_most(contradicted: int, tested: int) -> bool:
    """Whether a check would contradict so much of what it tests that its assumption, not the
    matches, fails there: more than ``MASS_CONTRADICTION_SHARE`` of the tested and at least
    ``MASS_CONTRADICTION_MIN``. A check that would overrule most of a run's evidence stands down
    there instead, with a finding (on the real H200 capture the cross-rank check demoted 83 % of
    correct matches before it learned to; the inconsistencies the checks exist for, a shifted
    claim or an early Recv, are a few percent of a run at most)."""
    return contradicted >= MASS_CONTRADICTION_MIN and contradicted > MASS_CONTRADICTION_SHARE * tested


def p2p_contradictions(rows: pd.DataFrame, slack: Mapping[str, float] | None = None,
                       ) -> tuple[pd.Index, pd.Index, list[dict]]:  # fmt: skip
    """Matched Send/Recv calls whose pairing contradicts their kernels (see the module docstring).

    ``rows``: every non-duplicate Send/Recv call row of the run with ``comm`` (logical id),
    ``rank`` and ``peer`` (global ranks), ``op``, ``seq`` (log order within the process),
    ``clock_domain``, ``start_sync``/``end_sync`` (null when unmatched or not synchronised).
    Returns the index of the rows to demote, of the rows the check could test, and where it stood
    down: one record per communicator whose pairs it would mostly contradict (``contradicts_most``;
    nothing there is demoted): comm, pairs tested, pairs contradicted, their median lead (how long
    before its Send started the Recv ended, ns) and the rows of the communicator."""
    if rows.empty:
        return rows.index[:0], rows.index[:0], []
    r = rows.sort_values(["comm", "rank", "peer", "seq"], kind="stable")
    send = r[r["op"] == "Send"]
    recv = r[r["op"] == "Recv"]
    # channel (comm, sender, receiver): the k-th Send on the sender, the k-th Recv on the receiver
    send = send.assign(_k=send.groupby(["comm", "rank", "peer"]).cumcount().to_numpy(),
                       _n=send.groupby(["comm", "rank", "peer"])["seq"].transform("size").to_numpy())
    recv = recv.assign(_k=recv.groupby(["comm", "rank", "peer"]).cumcount().to_numpy(),
                       _n=recv.groupby(["comm", "rank", "peer"])["seq"].transform("size").to_numpy())
    pairs = send.reset_index().merge(recv.reset_index(), left_on=["comm", "rank", "peer", "_k"],
                                     right_on=["comm", "peer", "rank", "_k"], suffixes=("_s", "_r"))
    pairs = pairs[(pairs["_n_s"] == pairs["_n_r"]) & pairs["start_sync_s"].notna() & pairs["end_sync_r"].notna()]
    if pairs.empty:
        return rows.index[:0], rows.index[:0], []
    sl = slack or {}
    tol = (CROSS_RANK_SLACK_NS + pairs["clock_domain_s"].map(sl).astype(float).fillna(0.0)
           + pairs["clock_domain_r"].map(sl).astype(float).fillna(0.0))
    lead = pairs["start_sync_s"].astype("float64") - pairs["end_sync_r"].astype("float64")
    bad = lead > tol
    stood_down = []
    for comm, grp in pairs.groupby("comm", sort=True):
        n_bad = int(bad[grp.index].sum())
        if contradicts_most(n_bad, len(grp)):
            stood_down.append({"comm": comm, "pairs": len(grp), "contradicted": n_bad,
                               "median_lead_ns": float(lead[grp.index][bad[grp.index]].median()),
                               "rows": np.r_[grp["index_s"].to_numpy(), grp["index_r"].to_numpy()]})  # fmt: skip
            bad[grp.index] = False
    checked = pd.Index(pd.unique(np.r_[pairs["index_s"].to_numpy(), pairs["index_r"].to_numpy()]))
    removed = pd.Index(pd.unique(np.r_[pairs.loc[bad, "index_s"].to_numpy(), pairs.loc[bad, "index_r"].to_numpy()]))
    return removed, checked, stood_down


def cross_rank_summary(checked: pd.DataFrame, removed: Iterable[Any]) -> pd.DataFrame:
    """Per process: matches the cross-rank check confirmed, contradicted and could not test.
    ``checked``: the candidate rows with ``process`` and ``testable``."""
    rm = checked.index.isin(list(removed))
    out = checked.assign(_rm=rm, _ok=checked["testable"] & ~rm, _nt=~checked["testable"] & ~rm)
    return out.groupby("process", sort=False).agg(confirmed=("_ok", "sum"), contradicted=("_rm", "sum"),
                                                    not_checkable=("_nt", "sum")).reset_index()
