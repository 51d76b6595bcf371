"""Global ranks from the communicators' structure alone, solved against Megatron's group layouts.

A job whose process groups are created lazily may leave no communicator of every rank and no
other record of the ranks, yet its logs still say which processes share each communicator and
each one's rank in it. :func:`solve_global_ranks` searches, exactly and within a step
``budget``, the assignments of global ranks under which every communicator is one of the groups
(or pairs) a Megatron layout creates, members in rank order; the ranks are taken only when a
single assignment fits. Rules, limits and measurements: ``docs/correlation.md`` section 2,
"Global ranks".
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from nccltrace.megatron.groups import (
    DEFAULT_ORDER,
    PAIR_DIMS,
    megatron_groups,
    order_problem,
)
from nccltrace.megatron.sizes import (
    ParallelSizes,
    declares_sizes,
    declares_world,
    flatten_settings,
)

__all__ = ["ORDERS", "ORDER_SETTING", "StructureSolution", "candidate_layouts", "solve_global_ranks"]

ORDERS: tuple[str, ...] = (DEFAULT_ORDER, "tp-cp-ep-pp-dp")
"""The rank orders Megatron-Core accepts (the default, and ``--use-tp-pp-dp-mapping``)."""
ORDER_SETTING = "use_tp_pp_dp_mapping"
"""The run setting (Megatron's argument) that says which of :data:`ORDERS` the job used; without
it both are tried (with pp > 1 and dp > 1 they give different ranks)."""
MAX_FITS = 2  # enough to tell "one assignment" from "several"
DEFAULT_BUDGET = 2_000_000


@dataclass
class StructureSolution:
    """What the structure decides. ``ranks``: process -> global rank when exactly one
    assignment fits (else None); ``fits``: distinct assignments found (stops at 2);
    ``layouts``: the layouts (text) with a fitting assignment; ``reason``: one sentence."""

    ranks: dict[Hashable, int] | None
    fits: int
    layouts: list[str] = field(default_factory=list)
    tried: int = 0
    exhausted: bool = False
    reason: str = ""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(world: int, settings: Mapping[str, Any] | None = None) -> list[tuple[ParallelSizes, str]]:
    """(sizes, order) pairs Megatron accepts for ``world`` ranks: the declared sizes of
    ``settings`` (with the world size ``world``), else every combination of tp, cp, pp, ep, etp
    and dp; under the order :data:`ORDER_SETTING` names, else each of :data:`ORDERS`."""
    flat = flatten_settings(settings or {})
    mapping = flat.get(ORDER_SETTING)
    orders = ORDERS if not isinstance(mapping, bool) else (ORDERS[1],) if mapping else (ORDERS[0],)
    if not declares_sizes(settings):
        return list(_all_layouts(world, orders))
    if not declares_world(flat):
        flat["world_size"] = world
    declared = ParallelSizes.from_settings(flat)
    if declared.world_size != world:
        raise ValueError(f"they describe {declared.world_size} ranks, the logs {world} processes")
    return [(declared, order) for order in orders if order_problem(declared, order) is None]


@lru_cache(maxsize=8)
def _all_layouts(world: int, orders: tuple[str, ...]) -> tuple[tuple[ParallelSizes, str], ...]:
    """Every (sizes, order) Megatron accepts for ``world`` ranks under ``orders``."""
    sizes = []
    for pp in _divisors(world):
        for tp in _divisors(world // pp):
            for cp in _divisors(world // pp // tp):
                # the expert grid's own tensor size too (Megatron-Core MoE jobs often run etp 1)
                for etp in _divisors(world // pp):
                    for ep in _divisors(world // pp // etp):
                        try:
                            sizes.append(ParallelSizes(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, world_size=world))
                        except ValueError:
                            continue
    return tuple((sz, order) for sz in sizes for order in orders if order_problem(sz, order) is None)


def _layout_text(sizes: ParallelSizes, order: str) -> str:
    dims = [f"{k}{getattr(sizes, k)}" for k in ("tp", "cp", "ep", "pp") if getattr(sizes, k) > 1]
    return "·".join(dims + [f"dp{sizes.dp}"]) + f" ({order})"


def _group_sizes(sizes: ParallelSizes) -> set[int]:
    """The sizes of the groups (and pairs of one group's members) ``sizes``' layout creates:
    the kinds of :func:`~.groups.megatron_groups` by the dimensions they span."""
    dims = {**sizes.decoder_grid(), "ep": 1}
    expert = sizes.expert_grid()
    spans = {"tp": dims["tp"], "cp": dims["cp"], "dp": dims["dp"], "pp": dims["pp"], "ep": expert["ep"],
             "etp": expert["tp"], "edp": expert["dp"]}
    out = {int(sizes.world_size), dims["dp"] * dims["cp"], dims["tp"] * dims["pp"], dims["tp"] * dims["dp"] * dims["cp"],
           dims["tp"] * dims["dp"], dims["tp"] * dims["cp"], expert["tp"] * expert["ep"],
           expert["tp"] * expert["ep"] * expert["pp"], 2 if dims["pp"] > 1 else 1, 1, *spans.values()}
    if any(spans[k] >= 2 for k in PAIR_DIMS):
        out.add(2)  # pairs of a group's members
    return out


class _Budget(Exception):
    pass


class _Search:
    """Assignments of ranks to processes under one layout's groups (see the module docstring)."""

    def __init__(self, n_proc: int, comms: list[tuple[int, ...]], groups: Mapping[str, list[list[int]]],
                 fixed: Mapping[int, int], steps: list[int], budget: int, pp2: bool) -> None:  # fmt: skip
        self.n, self.comms, self.steps, self.budget = n_proc, comms, steps, budget
        sizes = {len(c) for c in comms}
        self.mult: dict[tuple[int, ...], int] = {}  # member set -> how many communicators may have it
        self.at: dict[tuple[int, int, int], list[tuple[int, ...]]] = {}  # (size, rank, position) -> groups
        # PyTorch's pair communicators for un-coalesced isend/irecv: any two members of a group P2P
        # may run on, in rank order (with pp = 2 Megatron also sends over the world, a second
        # pair communicator of pipeline neighbours). Looked up per rank, not listed: a data-parallel
        # group of 256 has 32640 pairs.
        self.pair_groups: dict[int, list[tuple[frozenset[int], tuple[int, ...], int]]] = {}
        for kind, kind_groups in groups.items():
            for g in {tuple(x) for x in kind_groups}:  # a kind lists each of its groups once
                if len(g) in sizes:
                    if g not in self.mult:  # several kinds may have one member set: a candidate once
                        for i, r in enumerate(g):
                            self.at.setdefault((len(g), r, i), []).append(g)
                    self.mult[g] = self.mult.get(g, 0) + 1
                if 2 in sizes and kind in PAIR_DIMS and len(g) >= 2:
                    entry = (frozenset(g), g, 2 if kind == "pp" and pp2 else 1)
                    for r in g:
                        self.pair_groups.setdefault(r, []).append(entry)
        self.comms_of: list[list[int]] = [[] for _ in range(n_proc)]
        for c, members in enumerate(comms):
            for p in members:
                self.comms_of[p].append(c)
        self.rank_of = [-1] * n_proc
        self.proc_of = [-1] * n_proc
        self.fixed = dict(fixed)
        self.found: list[tuple[int, ...]] = []

    def _tick(self) -> None:
        self.steps[0] += 1
        if self.steps[0] > self.budget:
            raise _Budget

    def _groups_at(self, size: int, r: int, i: int) -> list[tuple[int, ...]]:
        """Member lists (ascending) of ``size`` that hold rank ``r`` at position ``i``."""
        out = self.at.get((size, r, i), [])
        if size == 2 and r in self.pair_groups:
            pairs = {(r, b) if i == 0 else (b, r) for _, g, _ in self.pair_groups[r] for b in g
                     if (b > r if i == 0 else b < r)}
            out = list(dict.fromkeys([*out, *sorted(pairs)]))
        return out

    def _multiplicity(self, g: tuple[int, ...]) -> int:
        n = self.mult.get(g, 0)
        if len(g) == 2:
            n += sum(extra for members, _, extra in self.pair_groups.get(g[0], ()) if g[1] in members)
        return n

    def _candidates(self, c: int) -> list[tuple[int, ...]] | None:
        """Groups communicator ``c`` can still be (None: none of its members is placed yet)."""
        members = self.comms[c]
        placed = [(i, self.rank_of[p]) for i, p in enumerate(members) if self.rank_of[p] >= 0]
        if not placed:
            return None
        i0, r0 = placed[0]
        out = []
        for g in self._groups_at(len(members), r0, i0):
            self._tick()
            if all(g[i] == r for i, r in placed) and all(
                    self.proc_of[g[j]] in (-1, p) for j, p in enumerate(members)):
                out.append(g)
        return out

    def _place(self, p: int, r: int, trail: list[int], queue: list[int]) -> bool:
        if self.rank_of[p] == r:
            return True
        if self.rank_of[p] >= 0 or self.proc_of[r] >= 0 or self.fixed.get(p, r) != r:
            return False
        self.rank_of[p], self.proc_of[r] = r, p
        trail.append(p)
        queue.extend(self.comms_of[p])
        return True

    def _propagate(self, queue: list[int], trail: list[int]) -> bool:
        while queue:
            c = queue.pop()
            cands = self._candidates(c)
            if cands is None:
                continue
            if not cands:
                return False
            if len(cands) == 1:
                for p, r in zip(self.comms[c], cands[0]):
                    if not self._place(p, r, trail, queue):
                        return False
        return True

    def _undo(self, trail: list[int], to: int) -> None:
        while len(trail) > to:
            p = trail.pop()
            self.proc_of[self.rank_of[p]] = -1
            self.rank_of[p] = -1

    def _complete(self) -> bool:
        used: dict[tuple[int, ...], int] = {}
        for members in self.comms:
            g = tuple(self.rank_of[p] for p in members)
            used[g] = used.get(g, 0) + 1
        return all(n <= self._multiplicity(g) for g, n in used.items())

    def run(self, want: int) -> list[tuple[int, ...]]:
        trail: list[int] = []
        queue: list[int] = []
        for p, r in self.fixed.items():
            if not 0 <= r < self.n or not self._place(p, r, trail, queue):
                return []
        if self._propagate(queue, trail):
            self._branch(trail, want)
        return self.found

    def _branch(self, trail: list[int], want: int) -> None:
        if len(self.found) >= want:
            return
        free = [p for p in range(self.n) if self.rank_of[p] < 0]
        if not free:
            sol = tuple(self.rank_of)
            if sol not in self.found and self._complete():
                self.found.append(sol)
            return
        # the open communicator with the fewest candidates, else a process to place anywhere
        best: tuple[int, list] | None = None
        for c in {c for p in free for c in self.comms_of[p]}:
            cands = self._candidates(c)
            if cands is not None and (best is None or len(cands) < len(best[1])):
                best = (c, cands)
        options: list[list[tuple[int, int]]]
        if best is not None:
            options = [list(zip(self.comms[best[0]], g)) for g in best[1]]
        else:
            p = max(free, key=lambda q: len(self.comms_of[q]))
            options = [[(p, r)] for r in range(self.n) if self.proc_of[r] < 0
                       and all(self._groups_at(len(self.comms[c]), r, self.comms[c].index(p)) for c in self.comms_of[p])]
        for option in options:
            mark = len(trail)
            queue: list[int] = []
            if all(self._place(p, r, trail, queue) for p, r in option) and self._propagate(queue, trail):
                self._branch(trail, want)
            self._undo(trail, mark)
            if len(self.found) >= want:
                return


def solve_global_ranks(processes: Sequence[Hashable], communicators: Iterable[Sequence[Hashable]],
                       settings: Mapping[str, Any] | None = None, *, known: Mapping[Hashable, int] | None = None,
                       budget: int = DEFAULT_BUDGET) -> StructureSolution:  # fmt: skip
    """Global ranks of ``processes`` (the whole job: every rank left a log) from the member lists
    of their ``communicators`` (each by rank in the communicator; complete ones only), solved
    against Megatron's layouts (:func:`candidate_layouts` of ``settings``). ``known``: ranks
    another source named, which every assignment must keep. See the module docstring."""
    procs = list(dict.fromkeys(processes))
    index = {p: i for i, p in enumerate(procs)}
    comms = [tuple(index[p] for p in c) for c in communicators if len(c) > 1]
    world = len(procs)
    fixed = {index[p]: int(r) for p, r in (known or {}).items() if p in index}
    if world < 2 or not comms:
        return StructureSolution(None, 0, reason="no communicator of two or more processes to solve from")
    try:
        layouts = candidate_layouts(world, settings)
    except ValueError as e:
        return StructureSolution(None, 0, reason=f"the declared sizes do not describe {world} ranks ({e})")
    sizes_needed = {len(c) for c in comms}
    # A communicator of every process has the ranks 0..n-1 in its member order: the assignment
    # is forced, and the layouts only have to admit it (the first that does settles it).
    spanning = next((c for c in comms if len(c) == world), None)
    if spanning is not None:
        if any(fixed.get(p, r) != r for r, p in enumerate(spanning)):
            return StructureSolution(None, 0, reason="the ranks given contradict the member order of the communicator "
                                                     "of every process")
        fixed = {p: r for r, p in enumerate(spanning)}
    steps = [0]
    found: dict[tuple[int, ...], list[str]] = {}
    tried = 0
    try:
        for sizes, order in layouts:
            if not sizes_needed <= _group_sizes(sizes):
                continue  # known from the sizes alone: the groups need not be built
            groups = megatron_groups(sizes, order)
            steps[0] += world  # building a layout's groups is work too
            tried += 1
            search = _Search(world, comms, groups, fixed, steps, budget, sizes.pp == 2)
            for sol in search.run(MAX_FITS):
                found.setdefault(sol, []).append(_layout_text(sizes, order))
            if len(found) >= MAX_FITS or (found and len(fixed) == world):
                break  # undecided, or the one possible assignment is admitted
    except _Budget:
        return StructureSolution(None, len(found), sorted({t for v in found.values() for t in v}), tried, True,
                                 f"undecided: the search stopped after {budget} steps")
    texts = sorted({t for v in found.values() for t in v})
    what = "the declared sizes" if declares_sizes(settings) else f"every Megatron layout of {world} ranks"
    if not found:
        return StructureSolution(None, 0, [], tried, reason=f"no assignment fits {what} ({tried} layout(s) tried): "
                                                            "not a Megatron job, or not these sizes")
    if len(found) > 1:
        return StructureSolution(None, len(found), texts, tried, reason=(
            f"at least {len(found)} different assignments fit {what} (e.g. {', '.join(texts[:3])}): swapping "
            "dimensions of one size maps the groups onto each other, so the structure does not decide"))
    (sol,) = found
    return StructureSolution({procs[i]: r for i, r in enumerate(sol)}, 1, texts, tried,
                             reason=f"one assignment fits {what} ({', '.join(texts[:3])})")
