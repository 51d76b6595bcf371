"""Can I trust these matches? Checks of call <-> kernel matches against evidence the alignment
did not optimise, their per-process record, and the messages they give.

The aligner reports a match only when every near-optimal alignment agrees on it, but that is
certainty *within its scoring model*; a capture that breaks the model's assumptions makes all
optimal alignments wrong together. So every match is also checked against evidence outside the
model, and a match a check contradicts is demoted to unmatched with the check's name as reason:

* ``capture_window`` (per process, align stage): where a windowed capture sits in the log
  (log time, a declared step range), or that nothing locates it (the process abstains);
* ``log_time`` (per process, align stage): the kernel was launched inside the log-line ->
  launch window learned from the process's certain matches (one-sided: NCCL launches after
  it logs);
* ``cross_rank`` (per run, ops stage): the kernels of one collective instance on all its
  ranks overlap in synchronised time. A rank's result needs every data source to have
  started: for AllReduce/AllGather/ReduceScatter/AlltoAll every member feeds every other, for
  Broadcast the root feeds the others, for Reduce every member feeds the root. A match shifted
  onto the next instance's kernel starts after the others have finished and is caught here,
  even when each rank is self-consistent.

The per-process record is ``aligned/<process>/alignment_quality.json`` (:func:`write_quality`);
the run's table is ``ops/alignment_quality.parquet`` (``QUALITY_SCHEMA``), shown in the run
report's section "Can I trust these matches?".
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from ..tables import documented_field as _f
from ..tables import write_json_atomic

__all__ = [
    "CHECKS",
    "CROSS_RANK_REASON",
    "QUALITY_FILE",
    "QUALITY_TABLE",
    "QUALITY_SCHEMA",
    "cross_rank_contradictions",
    "quality_problems",
    "quality_rows",
    "read_quality",
    "write_quality",
]

QUALITY_FILE = "alignment_quality.json"
QUALITY_TABLE = "alignment_quality.parquet"
CROSS_RANK_REASON = "contradicted_cross_rank"

CHECKS: dict[str, tuple[str, str]] = {
    # check -> (what it verifies, what to do when it contradicts matches)
    "capture_window": ("the export's capture is located in the log (log time or declared steps)",
                       "log timestamps (NCCL >= 2.26) or declare the captured steps"),
    "log_time": ("each kernel was launched within the learned log-line -> launch window",
                 "check that the log and the export come from the same run and host clock"),
    "cross_rank": ("the kernels of one collective instance on all its ranks overlap in synchronised time",
                   "check the rank's log and export for lost records around the demoted calls; with NCCL >= 2.26 "
                   "log timestamps locate every call"),
}

QUALITY_SCHEMA = pa.schema(
    [
        _f("process", pa.string(), "", "process (log stem nccl_<host>_<pid>, or host:pid)"),
        _f("host", pa.string(), "", "host of the process"),
        _f("pid", pa.int64(), "", "process id"),
        _f("check", pa.string(), "", "'capture_window', 'log_time' or 'cross_rank' (see docs/correlation.md)"),
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


def quality_problems(process: str, quality: Mapping[str, Any]) -> list[str]:
    """The problems a process's quality record makes (each makes the run partial)."""
    return [m for c in quality.get("checks", []) if (m := _message(process, c))]


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


def cross_rank_contradictions(rows: pd.DataFrame, slack: Mapping[str, float] | None = None) -> pd.DataFrame:
    """Matches whose kernel cannot belong to their collective instance.

    ``rows``: one row per matched call of a cross-rank instance with ``instance``, ``member``
    (any id unique within the run, e.g. the global rank), ``clock_domain``, ``op``,
    ``rank_in_comm``, ``root``, ``start_sync``, ``end_sync`` (null when the domain's clock is
    unknown: not checkable), ``comm`` and ``op_count`` (the instance's communicator and its
    place on it, ``ops.instance_parts``). ``slack``: extra tolerance per clock domain (ns).

    Two tests, both on synchronised time:

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
    with ``instance`` and ``member``."""
    cols = ["instance", "member", "clock_domain", "op", "rank_in_comm", "root", "start_sync", "end_sync", "comm",
            "op_count"]
    timed = rows.dropna(subset=["start_sync", "end_sync"])
    if timed.empty:
        return rows.iloc[0:0][["instance", "member"]]
    tol = CROSS_RANK_SLACK_NS + timed["clock_domain"].map(slack or {}).astype(float).fillna(0.0)
    t = timed[cols].assign(tol=tol.to_numpy())
    g = t.groupby("instance", sort=False)
    size = g["member"].transform("size")
    t = t[size >= 2]
    if t.empty:
        return rows.iloc[0:0][["instance", "member"]]
    spread = _end_spread(t)
    # matches ending with a neighbouring instance first (they would skew each instance's median)
    out_idx: list[Any] = _neighbour_ends(t, float(max(t["tol"].max(), END_SPREAD_K * spread)))
    t = t.drop(index=out_idx)
    g = t.groupby("instance", sort=False)
    dev = (t["end_sync"].astype("float64") - g["end_sync"].transform("median").astype("float64")).abs()
    off_end = (dev.to_numpy() > np.maximum(t["tol"].to_numpy(), END_SPREAD_K * spread))
    # fast path for the dependency test: an instance whose latest start precedes its earliest
    # end (within the largest tolerance) is consistent under every dependency pattern
    late = g["start_sync"].transform("max") - g["tol"].transform("max")
    early = g["end_sync"].transform("min")
    bad_inst = set(t.loc[(late > early).to_numpy() | off_end, "instance"])
    for _, inst in t[t["instance"].isin(bad_inst)].groupby("instance", sort=False):
        out_idx += _resolve(inst, END_SPREAD_K * spread)
    return rows.loc[out_idx, ["instance", "member"]]


END_SPREAD_K = 8.0


def _end_spread(t: pd.DataFrame) -> float:
    """Robust spread (ns) of members' kernel ends around their instance's median end, over
    instances of three or more members (whose median one wrong member cannot move)."""
    g = t.groupby("instance", sort=False)
    dev = t["end_sync"].astype("float64") - g["end_sync"].transform("median").astype("float64")
    big = g["member"].transform("size") >= 3
    base = dev[big].abs() if big.sum() >= 32 else dev.abs()
    return 1.4826 * float(base.median()) if len(base) else 0.0


_LOO_EXACT = 8  # instances up to this size get an exact leave-one-out median


def _leave_one_out_median(instance: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per row, the median end of the *other* members of its instance (NaN when alone). Exact
    for instances of up to ``_LOO_EXACT`` members (padded into a matrix, one pass per member
    position); larger instances use their median, which one member cannot move far."""
    codes, _ = pd.factorize(instance)
    order = np.argsort(codes, kind="stable")
    c = codes[order]
    start = np.r_[0, np.flatnonzero(np.diff(c)) + 1]
    size = np.diff(np.r_[start, len(c)])
    pos = np.arange(len(c)) - np.repeat(start, size)  # position of each row inside its instance
    out = np.full(len(end), np.nan)
    small = np.repeat(size <= _LOO_EXACT, size)
    if small.any():
        k = int(np.max(size[size <= _LOO_EXACT]))
        grp = np.repeat(np.arange(len(start)), size)
        m = np.full((len(start), k), np.nan)
        m[grp[small], pos[small]] = end[order][small]
        res = np.full(len(c), np.nan)
        for j in range(k):
            masked = m.copy()
            masked[:, j] = np.nan
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                med_j = np.nanmedian(masked, axis=1)
            at = small & (pos == j)
            res[at] = med_j[grp[at]]
        out[order[small]] = res[small]
    if (~small).any():
        big_med = pd.Series(end).groupby(codes).transform("median").to_numpy()
        out[order[~small]] = big_med[order[~small]]
    return out


def _neighbour_ends(t: pd.DataFrame, tol: float) -> list[Any]:
    """Matches whose kernel ends with a neighbouring instance of the communicator rather than
    with its own: a run of launches aligned one place off on a rank. A row is returned when its
    end is further than ``tol`` from its own instance's other members (their median; the other
    member of a two-member instance) and within ``tol`` of the median end of the previous or
    next instance (by opCount) of the same communicator. In a two-member instance both rows
    can be returned: the check cannot tell which one is off, and abstains on both."""
    e = t["end_sync"].astype("float64").to_numpy()
    # the other members' end: their median without the row itself (two members alike that are
    # both wrong must not make a third, right one look off)
    own = _leave_one_out_median(t["instance"].to_numpy(), e)
    inst = (t.groupby("instance", sort=False).agg(_comm=("comm", "first"), _opc=("op_count", "first"),
                                                  _med=("end_sync", "median"))
            .sort_values(["_comm", "_opc"]))  # fmt: skip
    same = inst["_comm"].to_numpy()
    prev = np.where(np.r_[False, same[1:] == same[:-1]], np.r_[np.nan, inst["_med"].to_numpy(float)[:-1]], np.nan)
    nxt = np.where(np.r_[same[:-1] == same[1:], False], np.r_[inst["_med"].to_numpy(float)[1:], np.nan], np.nan)
    nb = pd.DataFrame({"prev": prev, "next": nxt}, index=inst.index)
    p_end = nb["prev"].reindex(t["instance"]).to_numpy()
    n_end = nb["next"].reindex(t["instance"]).to_numpy()
    off_own = np.abs(e - own) > tol
    near_nb = (np.abs(e - p_end) <= tol) | (np.abs(e - n_end) <= tol)
    return list(t.index[off_own & near_nb])


def _resolve(inst: pd.DataFrame, end_spread: float = 0.0) -> list[Any]:
    """Rows of one instance to remove so that every dependency holds and every end lies near
    the others' (see caller)."""
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
    if op in _SYMMETRIC or op in ("Broadcast", "Reduce"):
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


def cross_rank_summary(checked: pd.DataFrame, removed: Iterable[Any]) -> pd.DataFrame:
    """Per process: matches the cross-rank check confirmed, contradicted and could not test.
    ``checked``: the candidate rows with ``process`` and ``testable``."""
    rm = checked.index.isin(list(removed))
    out = checked.assign(_rm=rm, _ok=checked["testable"] & ~rm, _nt=~checked["testable"])
    return out.groupby("process", sort=False).agg(confirmed=("_ok", "sum"), contradicted=("_rm", "sum"),
                                                    not_checkable=("_nt", "sum")).reset_index()
