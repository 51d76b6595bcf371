"""A collective's TUNING line as evidence on every member of its communicator.

NCCL prints the TUNING line only on the communicator's rank 0, but all members run a collective
with one algorithm and channel count, so rank 0's line says what each member's kernel of the same
call is. The facts are carried only where the call is certainly the same one on both processes
(by opCount or by log time on one host's clock), since the k-th call is not the same call once
either rank lost a line. Details: ``docs/correlation.md`` section 1.6.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from nccltrace.align.sequences import attach_tuning
from nccltrace.core.layout import CALLS_FILE
from nccltrace.nccl.enums import P2P_OPS

__all__ = ["CARRY_KEY", "TIME_MARGIN", "carry_tuning", "donor_facts", "read_donor_facts", "tuning_donors"]

CARRY_KEY = ["op_count", "op", "count", "datatype"]
"""What names one collective on every member of its communicator by opCount (module docstring)."""
SIGNATURE = ["op", "count", "datatype"]
TIME_MARGIN = 4
"""How many times nearer a line must be to its partner on the other rank than to its neighbours."""
_FACTS = ["tuned_channels", "tuned_algo"]
_DONOR_COLUMNS = [*CARRY_KEY, "wall_time_ns", "by_opcount", "same_clock", *_FACTS]


def _collectives(calls: pd.DataFrame) -> pd.DataFrame:
    """One communicator's collective call lines in one log (no duplicates, no Send/Recv)."""
    c = calls[calls["duplicate_of"].isna()] if "duplicate_of" in calls else calls
    return c[~c["op"].isin(list(P2P_OPS))]


def _opcount_certain(calls: pd.DataFrame) -> np.ndarray:
    """Per collective line of ``calls`` (one communicator's lines of one log): whether its opCount
    names it for certain (the module docstring's first certificate)."""
    c = _collectives(calls)
    if calls["op"].isin(list(P2P_OPS)).any() or c["op_count"].nunique() < 2:
        return np.zeros(len(c), bool)
    return ~c["op_count"].duplicated(keep=False).to_numpy(bool)


def donor_facts(calls: pd.DataFrame, tuning: pd.DataFrame | None, *, same_clock: bool = True) -> pd.DataFrame:
    """Rank 0's collective lines on one communicator (``calls``: that communicator's lines of
    rank 0's log; ``tuning``: the log's tuning table) with what their TUNING lines say
    (``tuned_*``, null where none names the call alone), their log time, whether their opCount
    names them for certain (``by_opcount``) and whether their times are on the member's clock
    (``same_clock``: the processes share a host), in log order."""
    facts = attach_tuning(_collectives(calls), tuning).assign(by_opcount=_opcount_certain(calls),
                                                              same_clock=same_clock)
    if "wall_time_ns" not in facts:
        facts["wall_time_ns"] = pd.array([pd.NA] * len(facts), dtype="Int64")
    return facts.sort_values("line", kind="stable")[_DONOR_COLUMNS].reset_index(drop=True)


def _nearest(values: np.ndarray, sorted_ref: np.ndarray) -> np.ndarray:
    """Index of the nearest element of ``sorted_ref`` (ascending, not empty) to each value."""
    pos = np.clip(np.searchsorted(sorted_ref, values), 1, len(sorted_ref) - 1) if len(sorted_ref) > 1 else None
    if pos is None:
        return np.zeros(len(values), np.int64)
    left = values - sorted_ref[pos - 1] <= sorted_ref[pos] - values
    return np.where(left, pos - 1, pos)


def _gap(t: np.ndarray) -> np.ndarray:
    """Per element of ascending ``t``: the distance to its nearer neighbour (inf when alone)."""
    d = np.diff(t).astype(float)
    before = np.concatenate([[np.inf], d])
    after = np.concatenate([d, [np.inf]])
    return np.minimum(before, after)


def time_pairs(t_member: np.ndarray, t_rank0: np.ndarray) -> np.ndarray:
    """Per member line (times ascending, on rank 0's clock): the index of its partner among rank
    0's lines (ascending), -1 where the times do not pair it (mutual nearest, ``TIME_MARGIN``
    times nearer than either line's neighbours)."""
    out = np.full(len(t_member), -1, np.int64)
    if len(t_member) < 2 or len(t_rank0) < 2:
        return out
    tm, tr = t_member.astype(np.int64), t_rank0.astype(np.int64)
    j = _nearest(tm, tr)
    mutual = _nearest(tr[j], tm) == np.arange(len(tm))
    delta = np.abs(tm - tr[j]).astype(float)
    sure = mutual & (TIME_MARGIN * delta < np.minimum(_gap(tm), _gap(tr)[j]))
    out[sure] = j[sure]
    return out


def _time_partners(t_own: np.ndarray, t_donor: np.ndarray) -> np.ndarray:
    """:func:`time_pairs` of lines in log order (a log's times need not be ascending: threads)."""
    om, od = np.argsort(t_own, kind="stable"), np.argsort(t_donor, kind="stable")
    j = time_pairs(t_own[om], t_donor[od])
    out = np.full(len(t_own), -1, np.int64)
    out[om] = np.where(j >= 0, od[np.maximum(j, 0)], -1)
    return out


def _uniform_facts(donor: pd.DataFrame) -> pd.DataFrame:
    """Per signature (op, count, datatype): rank 0's TUNING facts where all its lines of that
    signature that have any say the same (signatures whose lines disagree are left out)."""
    told = donor[donor["tuned_channels"].notna() | donor["tuned_algo"].notna()]
    if told.empty:
        return pd.DataFrame(columns=[*SIGNATURE, *_FACTS])
    g = told.groupby(SIGNATURE, dropna=False)
    same = (g["tuned_channels"].nunique(dropna=False) == 1) & (g["tuned_algo"].nunique(dropna=False) == 1)
    first = g[_FACTS].first()
    return first[same].reset_index()


def _keys(frame: pd.DataFrame, columns: list[str]) -> pd.MultiIndex:
    types = {"op_count": "int64", "op": "string", "count": "int64", "datatype": "int64"}
    return pd.MultiIndex.from_frame(frame[columns].astype({c: types[c] for c in columns}))


def carry_tuning(calls: pd.DataFrame, donors: Mapping[int, pd.DataFrame]) -> tuple[pd.DataFrame, dict[str, int]]:
    """``calls`` (one process's, with :func:`~.sequences.attach_tuning`'s columns) with the
    TUNING facts of its communicators' rank 0 (``donors``: this process's communicator pointer
    -> :func:`donor_facts` of rank 0's lines on the same logical communicator) filled in where
    the process has none of its own and the call is the same one for certain; and how many
    calls got them by each certificate (``by_opcount``, ``by_log_time``)."""
    out = calls.copy()
    counts = {"by_opcount": 0, "by_log_time": 0}
    for comm, donor in donors.items():
        if donor.empty:
            continue
        mine = out[out["comm"].astype("UInt64") == comm]
        own = _collectives(mine).assign(_by_opcount=_opcount_certain(mine)).sort_values("line", kind="stable")
        hit = np.full(len(own), -1, np.int64)
        # certificate 1: the opCount, where it names the call on both sides
        sure = donor[donor["by_opcount"]]
        if own["_by_opcount"].any() and len(sure):
            pos = _keys(sure, CARRY_KEY).get_indexer(_keys(own, CARRY_KEY))
            ok = own["_by_opcount"].to_numpy(bool) & (pos >= 0)
            hit[ok] = sure.index.to_numpy()[pos[ok]]
            counts["by_opcount"] += _fill(out, own, donor, hit, ok)
        # certificate 2: the log time, for the calls the first left
        rest = hit < 0
        if _timed(own, donor) and rest.any():
            j = _time_partners(own["wall_time_ns"].to_numpy(np.int64), donor["wall_time_ns"].to_numpy(np.int64))
            same = _same_signature(own, donor, j)
            if ((j >= 0) & ~same).any():
                continue  # a pair of different calls: the times do not pair this communicator's lines
            uniform = _keys(_uniform_facts(donor), SIGNATURE).get_indexer(_keys(own, SIGNATURE)) >= 0
            ok = rest & (j >= 0) & same & uniform
            hit[ok] = j[ok]
            counts["by_log_time"] += _fill(out, own, donor, hit, ok)
    return out, counts


def _timed(own: pd.DataFrame, donor: pd.DataFrame) -> bool:
    """Whether every line of both logs has a time, on one clock."""
    return bool("wall_time_ns" in own and len(own) and own["wall_time_ns"].notna().all()
                and donor["wall_time_ns"].notna().all() and donor["same_clock"].all())  # fmt: skip


def _same_signature(own: pd.DataFrame, donor: pd.DataFrame, j: np.ndarray) -> np.ndarray:
    """Whether each own line and rank 0's line ``j`` (-1: none) have the same op, count, datatype."""
    safe = np.where(j >= 0, j, 0)
    out = j >= 0
    for c in SIGNATURE:
        a = own[c].astype(object).to_numpy()
        b = donor[c].astype(object).to_numpy()[safe]
        out &= np.array([x == y for x, y in zip(a, b, strict=True)], bool)
    return out


def _fill(out: pd.DataFrame, own: pd.DataFrame, donor: pd.DataFrame, hit: np.ndarray, ok: np.ndarray) -> int:
    """Write rank 0's facts of lines ``hit`` into the rows ``ok`` of ``own`` that have none yet."""
    rows = own.index[ok]
    src = donor.iloc[hit[ok]]
    empty = out.loc[rows, "tuned_channels"].isna().to_numpy() & out.loc[rows, "tuned_algo"].isna().to_numpy()
    told = (src["tuned_channels"].notna() | src["tuned_algo"].notna()).to_numpy()
    take = empty & told
    out.loc[rows[take], "tuned_channels"] = pd.array(src["tuned_channels"].to_numpy()[take], dtype="Int64")
    out.loc[rows[take], "tuned_algo"] = pd.array(src["tuned_algo"].to_numpy()[take], dtype="string")
    return int(take.sum())


def tuning_donors(members: pd.DataFrame, host: str, pid: int) -> dict[int, tuple[str, int, int]]:
    """For each communicator of process (``host``, ``pid``) on which it is not rank 0: rank 0's
    (host, pid, communicator pointer), from the run's ``communicator_members`` table. A pointer
    that names two logical communicators in the process (reused after a destroy), or a
    communicator whose rank 0 is not exactly one process, gives none."""
    m = members.dropna(subset=["logical_id", "comm", "rank_in_comm"])
    own = m[(m["host"] == host) & (m["pid"] == pid)]
    own = own[~own["comm"].duplicated(keep=False)]
    zero = m[m["rank_in_comm"] == 0]
    zero = zero[~zero["logical_id"].duplicated(keep=False)].set_index("logical_id")
    out: dict[int, tuple[str, int, int]] = {}
    for row in own[own["rank_in_comm"] > 0].itertuples():
        if row.logical_id in zero.index:
            d = zero.loc[row.logical_id]
            out[int(row.comm)] = (str(d["host"]), int(d["pid"]), int(d["comm"]))
    return out


def read_donor_facts(parsed: Mapping[tuple[str, int], Path], donors: Mapping[int, tuple[str, int, int]],
                     host: str) -> dict[int, pd.DataFrame]:  # fmt: skip
    """:func:`donor_facts` for each communicator of :func:`tuning_donors` of a process of
    ``host``, read from the donors' parsed tables (``parsed``: (host, pid) -> the process's
    ``parsed/nccl`` directory; a donor without one gives nothing). Each donor's calls are read
    filtered to its communicators."""
    from nccltrace.core.tables import read_table

    by_donor: dict[tuple[str, int], dict[int, int]] = {}
    for comm, (host, pid, dcomm) in donors.items():
        by_donor.setdefault((host, pid), {})[dcomm] = comm
    out: dict[int, pd.DataFrame] = {}
    for proc, comms in by_donor.items():
        d = parsed.get(proc)
        if d is None or not (d / CALLS_FILE).exists() or not (d / "tuning.parquet").exists():
            continue
        calls = read_table(d / CALLS_FILE, columns=["file", "line", "op", "op_count", "count", "datatype", "comm",
                                                         "duplicate_of", "wall_time_ns"],
                           filters=[("comm", "in", list(comms))])  # fmt: skip
        tuning = read_table(d / "tuning.parquet")
        for dcomm, comm in comms.items():
            out[comm] = donor_facts(calls[calls["comm"].astype("UInt64") == dcomm], tuning, same_clock=proc[0] == host)
    return out
