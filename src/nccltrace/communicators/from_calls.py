"""Logical communicators from call sequences, for logs without init lines (thesis 4.2.3).

Without ``Init``/split lines nothing in a log says which communicator pointers of different
processes are the same communicator, so they are inferred from what every member logs alike.
``method='thesis'`` is the thesis's rule (identical operation-name sequences, eq. 4.5), kept to
measure against; ``method='improved'`` buckets pointers by sizes, call sequences and
point-to-point consistency, and marks a communicator incomplete where the logs cannot decide.
Both write the tables of :mod:`nccltrace.communicators.infer`. Details: ``docs/correlation.md``
section 2 and its module notes.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import pandas as pd
import pyarrow as pa

from nccltrace.communicators.labels import (
    KIND_PREFERENCE,
    P2P_OPS,
    PAIR_DIMS,
    ParallelSizes,
    expected_member_sets,
)
from nccltrace.communicators.schema import (
    COMMUNICATOR_SCHEMA,
    MEMBER_SCHEMA,
    CommunicatorTables,
)
from nccltrace.megatron.layout import megatron_layout

__all__ = ["global_ranks", "infer_communicators_from_calls"]

_MAX_SOLUTIONS = 64
_MAX_STEPS = 20_000
_SIMILARITY = 0.9


# --------------------------------------------------------------------------- global ranks


def _natural(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def global_ranks(calls: pd.DataFrame, *, gpus_per_node: int | None = None, natural_sort: bool = False,
                 fix_shared_devices: bool = False) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], str]]:
    """Global rank of every process by thesis eq. 4.6: node index (hosts sorted by name) x
    GPUs per node + local rank (the ``[cudaDev]`` of the process's lines).

    ``gpus_per_node`` defaults to the larger of the most processes seen on one host and the
    highest cudaDev + 1. ``natural_sort`` orders hosts numerically-aware. ``fix_shared_devices``:
    where processes of a host print the same cudaDev, number them by (cudaDev, pid) instead.
    Returns (rank per (host, pid), problem text per process where the rank is doubtful).
    """
    procs = calls[["host", "pid", "cuda_dev"]].dropna(subset=["host", "pid"])
    dev = procs.groupby(["host", "pid"], sort=False)["cuda_dev"].agg(
        lambda s: int(s.mode().iloc[0]) if s.notna().any() else -1)
    per_host: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for (host, pid), d in dev.items():
        per_host[str(host)].append((int(pid), int(d)))
    hosts = sorted(per_host, key=_natural if natural_sort else str)
    gpn = gpus_per_node or max([len(v) for v in per_host.values()] + [max(d for _, d in v) + 1 for v in per_host.values()]
                               + [1])
    ranks: dict[tuple[str, int], int] = {}
    problems: dict[tuple[str, int], str] = {}
    for node, host in enumerate(hosts):
        entries = per_host[host]
        devs = Counter(d for _, d in entries)
        shared = any(c > 1 for c in devs.values()) or any(d < 0 for _, d in entries)
        if shared and fix_shared_devices:
            for local, (pid, d) in enumerate(sorted(entries, key=lambda e: (e[1], e[0]))):
                ranks[(host, pid)] = node * gpn + local
                problems[(host, pid)] = (f"processes on {host} share cudaDev {d}; local rank taken from the order of "
                                         "(cudaDev, pid)")
        else:
            for pid, d in entries:
                ranks[(host, pid)] = node * gpn + d
                if shared:
                    problems[(host, pid)] = f"processes on {host} share cudaDev {d}; global rank not unique"
    return ranks, problems


# --------------------------------------------------------------------------- streams


@dataclass
class _Stream:
    """The calls of one communicator pointer in one process."""

    host: str
    pid: int
    comm: int
    grank: int
    nranks: int
    first_line: int
    file: str | None
    names: tuple[str, ...]  # op names, all lines (thesis)
    coll: tuple[tuple, ...]  # collective calls (op, count, datatype, redop, root)
    sizes: frozenset  # Send/Recv (count, datatype), direction-free
    # peer rank -> message sizes (elements -> number of messages) sent to / received from it
    send: dict[int, Counter] = field(default_factory=dict)
    recv: dict[int, Counter] = field(default_factory=dict)
    bad_peer: bool = False
    order: int = 0  # position among the process's pointers by first call
    # opCount -> its distinct collective calls (a duplicated line the reader could not flag, at
    # opCount 0, then compares equal)
    plans: dict[int, tuple] = field(default_factory=dict)

    @property
    def proc(self) -> tuple[str, int]:
        return (self.host, self.pid)

    @property
    def has_p2p(self) -> bool:
        return bool(self.send or self.recv)


def _streams(calls: pd.DataFrame, ranks: dict[tuple[str, int], int], dedupe: bool) -> list[_Stream]:
    df = calls
    if dedupe and "duplicate_of" in df.columns:
        df = df[df["duplicate_of"].isna()]
    df = df.dropna(subset=["host", "pid", "comm"]).sort_values(["host", "pid", "comm", "line"], kind="stable")
    cols = {c: df[c].to_numpy(dtype=object) for c in ("host", "pid", "comm", "op", "count", "datatype", "redop",
                                                      "root", "nranks", "line", "op_count")}  # fmt: skip
    files = df["file"].to_numpy(dtype=object) if "file" in df.columns else [None] * len(df)
    out: list[_Stream] = []
    n = len(df)
    i = 0
    while i < n:
        j = i
        key = (cols["host"][i], cols["pid"][i], cols["comm"][i])
        while j < n and (cols["host"][j], cols["pid"][j], cols["comm"][j]) == key:
            j += 1
        names, coll, sizes = [], [], set()
        plans: dict[int, list[tuple]] = defaultdict(list)
        send: dict[int, Counter] = defaultdict(Counter)
        recv: dict[int, Counter] = defaultdict(Counter)
        nr = Counter()
        for k in range(i, j):
            op = str(cols["op"][k])
            names.append(op)
            cnt = int(cols["count"][k]) if not pd.isna(cols["count"][k]) else -1
            dt = int(cols["datatype"][k]) if not pd.isna(cols["datatype"][k]) else -1
            root = int(cols["root"][k]) if not pd.isna(cols["root"][k]) else -1
            if not pd.isna(cols["nranks"][k]):
                nr[int(cols["nranks"][k])] += 1
            if op in P2P_OPS:
                sizes.add((cnt, dt))
                d = send if op == "Send" else recv
                d[root][cnt] += 1
            else:
                red = int(cols["redop"][k]) if not pd.isna(cols["redop"][k]) else 0
                coll.append((op, cnt, dt, red, root))
                oc = cols["op_count"][k]
                plans[-1 if pd.isna(oc) else int(oc)].append(coll[-1])
        host, pid, comm = key
        nranks = nr.most_common(1)[0][0] if nr else 0
        s = _Stream(str(host), int(pid), int(comm), ranks.get((str(host), int(pid)), -1), nranks,
                    int(cols["line"][i]), files[i], tuple(names), tuple(coll), frozenset(sizes),
                    dict(send), dict(recv),
                    plans={oc: tuple(sorted(set(v))) for oc, v in plans.items()})
        s.bad_peer = any(p < 0 or p >= max(nranks, 1) for p in list(s.send) + list(s.recv))
        out.append(s)
        i = j
    by_proc: dict[tuple[str, int], list[_Stream]] = defaultdict(list)
    for s in out:
        by_proc[s.proc].append(s)
    for lst in by_proc.values():
        for k, s in enumerate(sorted(lst, key=lambda s: s.first_line)):
            s.order = k
    return out


# --------------------------------------------------------------------------- rank assignment


def _close(a: Counter, b: Counter, tol: bool) -> bool:
    """Same messages (sizes with multiplicity); with ``tol``, as if a few lines were lost from
    either log: all but up to 10% (at least 2) of the messages pair up by size."""
    if a == b:
        return True
    if not tol:
        return False
    most = max(a.total(), b.total())
    return (a & b).total() >= most - max(2, (most + 9) // 10)


@dataclass
class _Ranks:
    """Point-to-point evidence on the ranks of a candidate group."""

    p2p: bool  # any Send/Recv traffic at all
    consistent: bool  # some rank assignment makes every member's traffic match its peers'
    fixed: list[int]  # rank of each stream where all consistent assignments agree, else -1
    deficit: int = 0  # fewest messages left unpaired by a consistent assignment (lost lines)


def _pair_ok(a: _Stream, ra: int, b: _Stream, rb: int, tol: bool) -> bool:
    zero: Counter = Counter()
    return (_close(a.send.get(rb, zero), b.recv.get(ra, zero), tol)
            and _close(b.send.get(ra, zero), a.recv.get(rb, zero), tol))


def _deficit(group: Sequence[_Stream], ranks: Sequence[int]) -> int:
    """Messages an assignment leaves without a counterpart (0 when the logs are complete)."""
    zero: Counter = Counter()
    out = 0
    for k, (a, ra) in enumerate(zip(group, ranks)):
        for b, rb in zip(group[k:], ranks[k:]):
            for x, y in ((a.send.get(rb, zero), b.recv.get(ra, zero)), (b.send.get(ra, zero), a.recv.get(rb, zero))):
                if x is not y or b is not a:
                    out += max(x.total(), y.total()) - (x & y).total()
    return out


def _talks_to_peers(group: Sequence[_Stream], ranks: Sequence[int]) -> bool:
    """Every member with Send/Recv traffic exchanges some of it with another member: an
    assignment that turns all of a member's traffic into messages to itself is degenerate
    (it would fit any pair whose directions happen to balance)."""
    return all(not s.has_p2p or any(p != r for p in (*s.send, *s.recv)) for s, r in zip(group, ranks))


def _fits(group: Sequence[_Stream], ranks: Sequence[int], tol: bool) -> bool:
    """Does this rank assignment make the group's point-to-point traffic consistent?"""
    if not _talks_to_peers(group, ranks):
        return False
    for k, (a, ra) in enumerate(zip(group, ranks)):
        if not _pair_ok(a, ra, a, ra, tol):
            return False
        for b, rb in zip(group[k + 1:], ranks[k + 1:]):
            if not _pair_ok(a, ra, b, rb, tol):
                return False
    return True


def _solve_ranks(group: Sequence[_Stream], n: int, tol: bool = False) -> _Ranks:
    """Search the rank assignments (one per stream, a permutation of 0..n-1) under which each
    member's Send/Recv traffic to a peer equals that peer's traffic from it (self included)."""
    if not any(s.has_p2p for s in group):
        return _Ranks(False, len(group) == n, [-1] * len(group))
    if any(s.bad_peer for s in group) or len(group) != n:
        return _Ranks(True, False, [-1] * len(group))
    sols: list[tuple[int, ...]] = []
    assign: list[int] = []
    used = [False] * n
    steps = 0

    def rec(k: int) -> bool:
        nonlocal steps
        if k == len(group):
            if _talks_to_peers(group, assign):
                sols.append(tuple(assign))
            return len(sols) >= _MAX_SOLUTIONS
        a = group[k]
        for r in range(n):
            steps += 1
            if steps > _MAX_STEPS:
                return True
            if used[r] or not _pair_ok(a, r, a, r, tol):
                continue
            if not all(_pair_ok(a, r, group[j], rj, tol) for j, rj in enumerate(assign)):
                continue
            used[r] = True
            assign.append(r)
            stop = rec(k + 1)
            assign.pop()
            used[r] = False
            if stop:
                return True
        return False

    aborted = rec(0)
    if not sols:
        return _Ranks(True, False, [-1] * len(group))
    if aborted:  # too many assignments to tell ranks apart
        return _Ranks(True, True, [-1] * len(group))
    fixed = [sols[0][k] if all(sol[k] == sols[0][k] for sol in sols) else -1 for k in range(len(group))]
    return _Ranks(True, True, fixed, min(_deficit(group, sol) for sol in sols) if tol else 0)


def _consistent(group: Sequence[_Stream], n: int, tol: bool) -> bool:
    if len(group) != n or len({s.proc for s in group}) != n:
        return False
    return _solve_ranks(group, n, tol).consistent


# --------------------------------------------------------------------------- partition


def _candidate_sets(ranks: set[int], n: int, sizes: ParallelSizes | None) -> dict[int, list[tuple[frozenset[int], str]]]:
    """Per rank, the member sets a communicator of ``n`` ranks containing it may have, best first
    (with sizes: the layout's groups by kind preference, then pair sets; else equal strides)."""
    out: dict[int, list[tuple[frozenset[int], str]]] = defaultdict(list)
    seen: set[frozenset[int]] = set()

    def add(s: frozenset[int], why: str) -> None:
        if s in seen or not s <= ranks:
            return
        seen.add(s)
        for r in sorted(s):
            out[r].append((s, why))

    if sizes is not None:
        layout = megatron_layout(sizes)
        pref = {k: i for i, k in enumerate(KIND_PREFERENCE)}
        groups = sorted((g for g in layout.groups if g.size == n), key=lambda g: (pref.get(g.kind, len(pref)), g.order))
        for g in groups:
            add(frozenset(g.ranks), f"{g.kind} group of the declared sizes")
        if n == 2:  # pair communicators: two ranks of one group of a parallel dimension
            for kind in PAIR_DIMS:
                for g in layout.by_kind.get(kind, []):
                    inside = [r for r in g.ranks if r in ranks]
                    for i, a in enumerate(inside):
                        for b in inside[i + 1:]:
                            add(frozenset((a, b)), f"{kind} pair of the declared sizes")
    elif ranks:
        lo, hi = min(ranks), max(ranks)
        for stride in range(1, (hi - lo) // max(n - 1, 1) + 1):
            for r in sorted(ranks):
                if r + (n - 1) * stride > hi:
                    break
                if all(r + j * stride in ranks for j in range(1, n)):
                    add(frozenset(r + j * stride for j in range(n)), f"rank stride {stride}")
    return out


@dataclass
class _Group:
    streams: list[_Stream]
    guessed: str | None = None  # rule that chose the membership when the data did not
    tolerant: bool = False


def _partition(bucket: list[_Stream], n: int, sizes: ParallelSizes | None, tol: bool,
               taken: dict[tuple[str, int], Counter], guesses: bool = True) -> tuple[list[_Group], list[_Stream]]:
    """Cut a bucket into groups of ``n`` streams of distinct processes, point-to-point
    consistent. ``taken``: per process, how many communicators it already has per member set;
    with sizes, a set the process already has as many communicators for as Megatron has groups
    with those members is tried last. ``guesses=False`` keeps only groups the calls determine.
    Returns (groups, leftover streams)."""
    if n <= 1:
        return [_Group([s]) for s in bucket], []
    by_rank: dict[int, list[_Stream]] = defaultdict(list)
    for s in bucket:
        by_rank[s.grank].append(s)
    for lst in by_rank.values():
        lst.sort(key=lambda s: (s.order, s.first_line))
    cands = _candidate_sets(set(by_rank), n, sizes)
    # Exactly one communicator's worth of pointers: taken as it is, unless the declared sizes
    # have no such group (then a stray mix, e.g. of pointers that lost different lines).
    if (len(bucket) == n and _consistent(bucket, n, tol)
            and (sizes is None or any(m == set(by_rank) for m, _ in cands.get(bucket[0].grank, [])))):
        return [_Group(list(bucket), tolerant=tol)], []
    caps: dict[frozenset[int], int] = {}
    if sizes is not None:
        caps = {k: len(v) for k, v in expected_member_sets(megatron_layout(sizes)).items()}
    free = {id(s) for s in bucket}
    groups: list[_Group] = []
    several = len(bucket) > n
    steps = 0
    for seed in sorted(bucket, key=lambda s: (s.grank, s.order, s.first_line)):
        if id(seed) not in free:
            continue
        chosen, best = None, 0
        mine = taken.get(seed.proc, Counter())
        options_by_pref = sorted(cands.get(seed.grank, []), key=lambda c: mine[c[0]] >= caps.get(c[0], 1 << 30))
        for members, why in options_by_pref:
            others = sorted(members - {seed.grank})
            options = [[s for s in by_rank[r] if id(s) in free] for r in others]
            if any(not o for o in options):
                continue
            # Prefer the streams created in the same position of their process as the seed.
            for o in options:
                o.sort(key=lambda s: (abs(s.order - seed.order), s.first_line))
            for combo in product(*options):
                steps += 1
                if steps > _MAX_STEPS:
                    break
                group = [seed, *combo]
                if len({s.proc for s in group}) != n:
                    continue
                ev = _solve_ranks(group, n, tol)
                # Complete logs: the first consistent candidate (preference order). Lost lines:
                # the candidate whose traffic pairs up best.
                if ev.consistent and (chosen is None or ev.deficit < best):
                    chosen, best = (group, why), ev.deficit
                    if not tol or best == 0:
                        break
            if (chosen and (not tol or best == 0)) or steps > _MAX_STEPS:
                break
        if chosen is None:
            continue
        group, why = chosen
        # The membership is a guess when the consistency check could not single it out:
        # collectives only, or several candidate sets for this bucket.
        guessed = why if several and not _unique_partner(group, bucket, n, tol) else None
        if guessed and not guesses:
            continue
        for s in group:
            free.discard(id(s))
        groups.append(_Group(group, guessed, tol))
    left = [s for s in bucket if id(s) in free]
    return groups, left


def _unique_partner(group: list[_Stream], bucket: list[_Stream], n: int, tol: bool) -> bool:
    """Two-rank groups: the point-to-point traffic singles the pair out - no other stream of
    the bucket is consistent with either member."""
    if n != 2 or not any(s.has_p2p for s in group):
        return False
    for a, b in (group, group[::-1]):
        for s in bucket:
            if s is not b and s.proc != a.proc and _consistent([a, s], 2, tol):
                return False
    return True


# --------------------------------------------------------------------------- grouping


def _thesis(streams: list[_Stream]) -> list[_Group]:
    buckets: dict[tuple[str, ...], list[_Stream]] = {}
    for s in streams:
        buckets.setdefault(s.names, []).append(s)
    return [_Group(v) for v in buckets.values()]


def _similar(a: _Stream, b: _Stream) -> bool:
    """Collective sequences equal but for a few lines lost from either log. Where opCount
    numbers the calls (it counts kernel plans per communicator) calls are compared by opCount,
    so a lost line costs one call; otherwise by the longest matching blocks."""
    la, lb = len(a.coll), len(b.coll)
    longest = max(la, lb)
    if not longest:
        return True
    slack = max(2, round((1 - _SIMILARITY) * longest))
    if min(la, lb) < longest - slack:
        return False
    if len(a.plans) > 1 and len(b.plans) > 1:
        most = max(len(a.plans), len(b.plans))
        agree = sum(a.plans[k] == b.plans[k] for k in a.plans.keys() & b.plans.keys())
        return agree >= most - max(2, round((1 - _SIMILARITY) * most))
    sm = difflib.SequenceMatcher(None, a.coll[:4000], b.coll[:4000], autojunk=False)
    return sum(m.size for m in sm.get_matching_blocks()) >= min(longest, 4000) - slack


def _sizes_alike(a: _Stream, b: _Stream) -> bool:
    """Send/Recv message sizes mostly shared (lost lines rarely remove a size altogether)."""
    if not a.sizes and not b.sizes:
        return True
    return len(a.sizes & b.sizes) >= 0.5 * len(a.sizes | b.sizes)


def _improved(streams: list[_Stream], sizes: ParallelSizes | None) -> tuple[list[_Group], list[_Stream]]:
    """Facts first: buckets of pointers with identical calls that form exactly one communicator,
    and pairs singled out by their Send/Recv traffic. Then the rest, clustered by similar calls
    (tolerating lost lines), is cut into communicators busiest cluster first - the chattiest
    groups are the tightest ones (TP), which the candidate order tries first."""
    groups: list[_Group] = []
    taken: dict[tuple[str, int], Counter] = defaultdict(Counter)

    def keep(got: list[_Group]) -> None:
        for g in got:
            ranks = frozenset(s.grank for s in g.streams)
            for s in g.streams:
                taken[s.proc][ranks] += 1
        groups.extend(got)

    pending = list(streams)
    for key in (lambda s: (s.nranks, s.coll, s.sizes), lambda s: (s.nranks, s.coll, s.has_p2p)):
        buckets: dict[Any, list[_Stream]] = {}
        for s in pending:
            buckets.setdefault(key(s), []).append(s)
        pending = []
        for (n, *_), bucket in buckets.items():
            got, left = _partition(bucket, n, sizes, False, taken, guesses=False)
            keep(got)
            pending.extend(left)
    clusters: list[list[_Stream]] = []
    for s in sorted(pending, key=lambda s: (s.nranks, s.has_p2p, -len(s.coll), s.grank)):
        for c in clusters:
            rep = c[0]
            if rep.nranks == s.nranks and rep.has_p2p == s.has_p2p and _sizes_alike(rep, s) and _similar(rep, s):
                c.append(s)
                break
        else:
            clusters.append([s])
    rest: list[_Stream] = []
    for c in sorted(clusters, key=lambda c: (len(c) != c[0].nranks, -max(len(s.names) for s in c))):
        # Exact traffic first; what that leaves is cut again as if lines were lost.
        got, left = _partition(c, c[0].nranks, sizes, False, taken)
        keep(got)
        if left:
            got, left = _partition(left, c[0].nranks, sizes, True, taken)
            keep(got)
        rest.extend(left)
    return groups, rest


# --------------------------------------------------------------------------- output


def infer_communicators_from_calls(
    calls: pd.DataFrame,
    *,
    method: str = "improved",
    gpus_per_node: int | None = None,
    sizes: ParallelSizes | dict | None = None,
    comm_info: pd.DataFrame | None = None,
    rank_order: str = "evidence",
) -> CommunicatorTables:
    """Group the communicator pointers of all processes into logical communicators from their
    call sequences (the log reader's ``calls`` table), for logs without init lines.

    ``method``: 'thesis' (identical operation-name sequences) or 'improved' (see the module
    docstring). ``sizes`` (improved only): declared parallel sizes, used to choose among
    partitions the call sequences cannot distinguish. ``comm_info``: the log reader's
    ``comm_info`` table, if the logs have those lines (ranks in communicators).
    ``rank_order``: 'evidence' (ranks only where the logs determine them) or 'pytorch' (fill the
    rest in increasing global rank, PyTorch's order for its process groups).
    """
    if method not in ("thesis", "improved"):
        raise ValueError(f"method: {method!r} is not 'thesis' or 'improved'")
    if rank_order not in ("evidence", "pytorch"):
        raise ValueError(f"rank_order: {rank_order!r} is not 'evidence' or 'pytorch'")
    if sizes is not None and not isinstance(sizes, ParallelSizes):
        sizes = ParallelSizes.from_settings(sizes)
    if calls is None or calls.empty:
        empty = COMMUNICATOR_SCHEMA.empty_table().to_pandas(), MEMBER_SCHEMA.empty_table().to_pandas()
        return CommunicatorTables(*empty, None)
    thesis = method == "thesis"
    ranks, rank_problems = global_ranks(calls, gpus_per_node=gpus_per_node or (sizes.gpus_per_node if sizes else None),
                                        natural_sort=not thesis, fix_shared_devices=not thesis)
    streams = _streams(calls, ranks, dedupe=not thesis)
    if thesis:
        groups, rest = _thesis(streams), []
    else:
        groups, rest = _improved(streams, sizes)
        groups.extend(_Group([s], "no consistent group found") for s in rest)
    info = _comm_info_ranks(comm_info)
    groups.sort(key=lambda g: (min(s.grank for s in g.streams), min(s.first_line for s in g.streams)))

    comm_rows, member_rows = [], []
    for lid, g in enumerate(groups):
        n = Counter(s.nranks for s in g.streams).most_common(1)[0][0]
        problems: list[str] = []
        if len(g.streams) != n:
            problems.append(f"{len(g.streams)} pointers grouped but calls print nranks={n}")
        if len({s.proc for s in g.streams}) != len(g.streams):
            problems.append("several pointers of one process grouped together")
        if g.guessed:
            problems.append(f"membership not determined by the calls; chosen by {g.guessed}")
        rk = [-1] * len(g.streams) if thesis else _ranks_in_comm(g, n, info, rank_order, problems)
        if thesis:
            problems.append("rank in communicator not inferred (thesis sequence matching)")
        members = [-1] * max(n, 0)
        for s, r in zip(g.streams, rk):
            if 0 <= r < n and members[r] == -1:
                members[r] = s.grank
        for s in g.streams:
            if s.proc in rank_problems:
                problems.append(rank_problems[s.proc])
                break
        problems = list(dict.fromkeys(problems))
        comm_rows.append((lid, "sequence", n, None, None, None, None, members, not problems,
                          "; ".join(problems) or None))
        for s, r in zip(g.streams, rk):
            member_rows.append((lid, s.host, s.pid, s.comm, r, s.grank, s.file, s.first_line))

    def frame(rows: list[tuple], schema: pa.Schema) -> pd.DataFrame:
        cols = list(zip(*rows)) if rows else [[] for _ in schema]
        return pa.Table.from_arrays([pa.array(list(c), type=f.type) for c, f in zip(cols, schema)],
                                    schema=schema).to_pandas(types_mapper=pd.ArrowDtype)

    world = len(ranks)
    # its global ranks number every process (eq. 4.6), so a whole communicator of all of them is the world
    comm_rows = [(*row, row[2] == world and row[8]) for row in comm_rows]
    return CommunicatorTables(frame(comm_rows, COMMUNICATOR_SCHEMA), frame(member_rows, MEMBER_SCHEMA), world)


def _comm_info_ranks(comm_info: pd.DataFrame | None) -> dict[tuple[str, int, int], int]:
    if comm_info is None or comm_info.empty:
        return {}
    out = {}
    for host, pid, comm, rank in zip(comm_info["host"], comm_info["pid"], comm_info["comm"], comm_info["rank"]):
        if not (pd.isna(host) or pd.isna(pid) or pd.isna(comm) or pd.isna(rank)):
            out[(str(host), int(pid), int(comm))] = int(rank)
    return out


def _ranks_in_comm(g: _Group, n: int, info: dict[tuple[str, int, int], int], rank_order: str,
                   problems: list[str]) -> list[int]:
    """Rank of each stream of ``g``: comm_info lines, else a unique point-to-point assignment,
    else (rank_order='pytorch') increasing global rank; -1 where undetermined."""
    streams = g.streams
    got = [info.get((s.host, s.pid, s.comm), -1) for s in streams]
    if all(0 <= r < n for r in got) and len(set(got)) == len(got):
        return got
    ev = _solve_ranks(streams, n, g.tolerant) if len(streams) == n else None
    if ev is not None and ev.consistent:
        got = [a if a >= 0 else b for a, b in zip(got, ev.fixed)]
    if rank_order == "pytorch" and any(r < 0 for r in got) and len(streams) == n:
        order = sorted(range(len(streams)), key=lambda k: streams[k].grank)
        sorted_ranks = [0] * len(streams)
        for pos, k in enumerate(order):
            sorted_ranks[k] = pos
        fits = all(r < 0 or r == sorted_ranks[k] for k, r in enumerate(got))
        if fits and (ev is None or not ev.p2p or _fits(streams, sorted_ranks, g.tolerant)):
            problems.append("ranks in communicator assumed in increasing global rank (PyTorch convention)")
            return sorted_ranks
    if any(r < 0 for r in got):
        problems.append("rank in communicator not determined by the calls for "
                        f"{sum(r < 0 for r in got)} of {len(got)} members")
    return got
