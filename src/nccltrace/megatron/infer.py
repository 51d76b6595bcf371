"""Infer Megatron-LM's parallel sizes from the member sets of a job's communicators.

The candidates are every size tuple Megatron accepts for the world (under the rank orders
tried); a candidate is consistent when one of its group kinds has exactly each observed member
set (a described set: one of the described kind). A size is reported only when every consistent
candidate has the same value, else it is None with the values still possible: member sets alone
often cannot decide (cp and dp swap in the default order), descriptions pin them. Groups are
compared as boxes of dimensions, without generating every group. Rules and measurements:
``docs/correlation.md`` section 2, "Layout inference".
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nccltrace.megatron.behaviour import most_likely
from nccltrace.megatron.groups import (
    DECODER_KINDS,
    DEFAULT_ORDER,
    EXPERT_KINDS,
    KIND_ORDER,
    MEGATRON_DESC,
    complete_order,
    grid_strides,
)

__all__ = [
    "DERIVED_NAMES",
    "KIND_LABEL",
    "SIZE_NAMES",
    "LayoutInference",
    "infer_layout",
    "kind_of_desc",
    "read_layout_input",
]

SIZE_NAMES: tuple[str, ...] = ("tp", "cp", "dp", "pp", "ep", "etp")
DERIVED_NAMES: tuple[str, ...] = ("edp", "tp*cp", "dp*cp", "etp*ep")

# How a kind is shown to users; the rest show as their kind id.
KIND_LABEL: dict[str, str] = {k: k for k in KIND_ORDER} | {
    "mp": "tp-pp (mp)",
    "embd": "embedding",
    "pos-embd": "position-embedding",
}
_BIT: dict[str, int] = {k: 1 << i for i, k in enumerate(KIND_ORDER)}
_WORLD_KINDS: tuple[str, ...] = ("world", "intra-distopt")  # one distributed-optimizer instance

Box = tuple[tuple[int, int], ...]  # canonical (size, stride) dims, strides ascending


def _desc_table() -> dict[str, str]:
    table = {desc.upper(): kind for kind, desc in MEGATRON_DESC.items()}
    table.update({kind.upper(): kind for kind in KIND_ORDER})
    table.update({label.upper(): kind for kind, label in KIND_LABEL.items()})
    # Same member sets as the dp-cp group (Megatron's optional all-gather twin).
    table["DATA_PARALLEL_GROUP_WITH_CP_AG"] = "dp-cp"
    return table


_DESC_TO_KIND = _desc_table()


def kind_of_desc(desc: str) -> str | None:
    """The group kind a PyTorch/Megatron group description names (None when it names none).

    Accepts Megatron's ``group_desc`` strings (``TENSOR_MODEL_PARALLEL_GROUP``, ...), PyTorch's
    ``default_pg``, the kind ids of :data:`.groups.GROUP_KINDS` and their labels; a ``_GLOO``
    suffix is ignored (same members).
    """
    return _DESC_TO_KIND.get(desc.strip().upper().removesuffix("_GLOO"))


# ----------------------------------------------------------------------------- boxes
def _box_of_set(ranks: np.ndarray) -> Box | None:
    """Canonical box of a sorted rank set, or None when the set is no box."""
    d = ranks - ranks[0]
    dims: list[tuple[int, int]] = []
    while len(d) > 1:
        step = int(d[1])
        n = len(d)
        along = d == np.arange(n, dtype=np.int64) * step
        run = n if along.all() else int(np.argmin(along))  # length of the run 0, step, 2*step, ...
        if n % run:
            return None
        rest = d[::run]
        if not np.array_equal(d, (rest[:, None] + np.arange(run, dtype=np.int64) * step).ravel()):
            return None
        dims.append((run, step))
        d = rest
    return tuple(dims)


def _kind_box(dims: Sequence[tuple[int, int]]) -> Box:
    """Canonical box of the dims a kind spans (ascending strides, as Megatron's grids have)."""
    out: list[tuple[int, int]] = []
    for size, stride in dims:
        if size == 1:
            continue
        if out and out[-1][0] * out[-1][1] == stride:  # continues the previous dim: one run
            out[-1] = (out[-1][0] * size, out[-1][1])
        else:
            out.append((size, stride))
    return tuple(out)


def _box_text(box: Box | None) -> str:
    if box is None:
        return "not a Megatron grid group"
    if not box:
        return "1 rank"
    return " x ".join(f"{s} ranks at stride {d}" for s, d in box)


def _bits(mask: np.ndarray) -> int:
    """Bitset (Python int) of a boolean array."""
    return int.from_bytes(np.packbits(mask, bitorder="little").tobytes(), "little")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def _triples(n: int) -> list[tuple[int, int, int]]:
    """Ordered (a, b, c) with a*b*c = n."""
    return [(a, b, n // a // b) for a in _divisors(n) for b in _divisors(n // a)]


# ----------------------------------------------------------------------------- observations
@dataclass
class _Shape:
    r0: np.ndarray  # lowest rank of each observed set of this box
    obs: np.ndarray  # their observation ids


@dataclass
class _Unit:
    """Observed sets that constrain candidates alike: same box, same described kinds."""

    box: Box | None
    hints: tuple[str, ...]
    obs: list[int]
    pos: np.ndarray  # positions in the shape's arrays

    @property
    def full(self) -> int:
        return (1 << len(self.obs)) - 1


def _grid_specs(grid: dict[str, int], tokens: list[str], kinds: dict[str, tuple[str, ...]],
                world: int | None) -> dict[str, tuple[Box, list[tuple[int, int]]]]:  # fmt: skip
    """kind -> (box, dims whose coordinate the lowest rank must have 0) for one grid."""
    strides = grid_strides(tokens, grid)
    specs: dict[str, tuple[Box, list[tuple[int, int]]]] = {}
    for kind, span in kinds.items():
        dims = [(grid[t], strides[t]) for t in tokens if t in span]
        specs[kind] = (_kind_box(dims), [(s, d) for s, d in dims if s > 1])
    if world is not None:  # the decoder grid also carries the pipeline-derived and world groups
        p, d = grid["pp"], strides["pp"]
        zero = [(p, d)] if p > 1 else []
        specs["embd"] = (((2, (p - 1) * d),) if p > 1 else (), zero)
        specs["pos-embd"] = ((), zero)
        for kind in _WORLD_KINDS:
            specs[kind] = (((world, 1),) if world > 1 else (), [])
    return specs


def _hits(specs: dict[str, tuple[Box, list[tuple[int, int]]]], shapes: dict[Box, _Shape]
          ) -> dict[str, tuple[Box, np.ndarray]]:  # fmt: skip
    """kind -> (box, which observed sets of that box are a group of the kind)."""
    out = {}
    for kind, (box, zero) in specs.items():
        shape = shapes.get(box)
        if shape is None:
            continue
        ok = np.ones(len(shape.r0), dtype=bool)
        for s, d in zero:
            ok &= (shape.r0 // d) % s == 0
        out[kind] = (box, ok)
    return out


def _coverage(hits: dict[str, tuple[Box, np.ndarray]], units: list[_Unit]) -> list[tuple[int, ...]]:
    """Per unit: bitset of its sets some kind explains (undescribed), or one bitset per
    described kind."""
    out = []
    for u in units:
        if u.hints:
            out.append(tuple(_bits(hits[k][1][u.pos]) if k in hits and hits[k][0] == u.box else 0 for k in u.hints))
        else:
            acc = 0
            for box, ok in hits.values():
                if box == u.box:
                    acc |= _bits(ok[u.pos])
            out.append((acc,))
    return out


def _label_array(hits: dict[str, tuple[Box, np.ndarray]], shapes: dict[Box, _Shape], n_obs: int) -> np.ndarray:
    arr = np.zeros(n_obs, dtype=np.int64)
    for kind, (box, ok) in hits.items():
        arr[shapes[box].obs[ok]] |= _BIT[kind]
    return arr


def _kinds_of(mask: int) -> list[str]:
    return [KIND_LABEL[k] for k in KIND_ORDER if mask & _BIT[k]]


# ----------------------------------------------------------------------------- result
@dataclass
class LayoutInference:
    """What the observed groups say about a job's Megatron parallel layout.

    ``sizes`` holds a value only where every consistent candidate agrees, else None;
    ``values`` the values still possible. ``candidates`` are the consistent size tuples (the
    best-fitting ones when none is consistent, ``consistent`` False); ``layout`` is the single
    candidate when the data determine it. ``evidence`` names, per size, a minimal set of
    observed group shapes that pins it. ``groups`` labels every input group in input order.
    """

    world_size: int
    orders: tuple[str, ...]
    sizes: dict[str, int | None]
    values: dict[str, list[int]]
    derived: dict[str, int | None]
    candidates: list[dict[str, Any]]
    consistent: bool
    ambiguous: bool
    layout: dict[str, Any] | None
    evidence: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    most_likely: dict[str, Any] | None = None  # the best-ranked candidate (:mod:`.behaviour`)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what ``nccltrace infer-layout`` prints)."""
        return {
            "world_size": self.world_size,
            "orders": list(self.orders),
            "sizes": dict(self.sizes),
            "values": {k: list(v) for k, v in self.values.items()},
            "derived": dict(self.derived),
            "consistent": self.consistent,
            "ambiguous": self.ambiguous,
            "layout": self.layout,
            "most_likely": self.most_likely,
            "candidates": self.candidates,
            "evidence": self.evidence,
            "groups": self.groups,
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON with rank lists kept on one line."""
        return _dumps(self.to_dict(), 0)


def _dumps(obj: Any, level: int) -> str:
    pad, inner = "  " * level, "  " * (level + 1)
    flat = isinstance(obj, dict) and all(not isinstance(v, (dict, list)) or
                                         (isinstance(v, list) and not any(isinstance(x, (dict, list)) for x in v))
                                         for v in obj.values())  # fmt: skip
    if flat and level >= 2:  # a candidate or a group: one line
        return json.dumps(obj)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {_dumps(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(inner + _dumps(v, level + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj)


def _validate(world_size: Any, groups: Any, descs: Any) -> list[tuple[int, ...]]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive integer, got {world_size!r}")
    if not isinstance(groups, Sequence) or isinstance(groups, (str, bytes)):
        raise ValueError("groups: expected a list of rank lists, e.g. [[0, 1], [2, 3]]")
    if descs is not None and (not isinstance(descs, Sequence) or len(descs) != len(groups)):
        raise ValueError("descs: expected one description (or None) per group")
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, Sequence) or isinstance(g, (str, bytes)) or not g:
            raise ValueError(f"groups[{i}]: expected a non-empty list of global ranks, got {g!r}")
        for r in g:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
                raise ValueError(f"groups[{i}]: rank {r!r} is not an integer")
            if not 0 <= r < world_size:
                raise ValueError(f"groups[{i}]: rank {r} is outside 0..{world_size - 1} (world_size {world_size})")
        ranks = tuple(sorted(int(r) for r in g))
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"groups[{i}]: a rank is listed twice in {list(g)}")
        if descs is not None and descs[i] is not None and not isinstance(descs[i], str):
            raise ValueError(f"descs[{i}]: expected a string, got {descs[i]!r}")
        out.append(ranks)
    return out


# ----------------------------------------------------------------------------- inference
@dataclass
class _Observed:
    """The distinct member sets and what they require of a candidate."""

    sets: list[tuple[int, ...]]
    hints: list[set[str]]  # kinds their descriptions name
    input_obs: list[int]  # input group -> distinct set
    required: list[bool]  # constrains candidates (multi-rank non-world, or described)
    shapes: dict[Box, _Shape]
    units: list[_Unit]
    unknown_desc: set[str]


def _observe(world: int, sets: list[tuple[int, ...]], descs: Sequence[str | None] | None) -> _Observed:
    index: dict[tuple[int, ...], int] = {}
    obs = _Observed([], [], [], [], {}, [], set())
    for i, ranks in enumerate(sets):
        j = index.setdefault(ranks, len(obs.sets))
        if j == len(obs.sets):
            obs.sets.append(ranks)
            obs.hints.append(set())
        obs.input_obs.append(j)
        desc = descs[i] if descs is not None else None
        if desc:
            kind = kind_of_desc(desc)
            if kind is None:
                obs.unknown_desc.add(desc)
            else:
                obs.hints[j].add(kind)
    boxes = [_box_of_set(np.asarray(r, dtype=np.int64)) for r in obs.sets]
    by_box: dict[Box, list[int]] = {}
    for j, b in enumerate(boxes):
        if b is not None:
            by_box.setdefault(b, []).append(j)
    obs.shapes = {b: _Shape(np.array([obs.sets[j][0] for j in js], dtype=np.int64), np.array(js, dtype=np.int64))
                  for b, js in by_box.items()}  # fmt: skip
    pos = {int(j): p for sh in obs.shapes.values() for p, j in enumerate(sh.obs)}
    obs.required = [bool(h) or 1 < len(r) < world for r, h in zip(obs.sets, obs.hints)]
    by_unit: dict[tuple[Box | None, tuple[str, ...]], list[int]] = {}
    for j, req in enumerate(obs.required):
        if req:
            by_unit.setdefault((boxes[j], tuple(sorted(obs.hints[j]))), []).append(j)
    obs.units = [_Unit(b, h, js, np.array([pos.get(j, 0) for j in js], dtype=np.int64))
                 for (b, h), js in by_unit.items()]  # fmt: skip
    return obs


@dataclass
class _Entries:
    """Every (size tuple, order) Megatron accepts, and which units it explains."""

    sizes: np.ndarray  # (n, 6) in SIZE_NAMES order
    order: list[int]
    keys: list[tuple[tuple, tuple]]  # (decoder, expert) keys into hits
    explains: np.ndarray  # (n, units) bool: explains every set of the unit
    count: np.ndarray  # (n,) constraining sets explained
    hits: dict[tuple, dict[str, tuple[Box, np.ndarray]]]


def _grid_tuples(world: int, pp: int, order: str, oi: int, obs: _Observed, expert: bool) -> list[tuple]:
    """(sizes, key, pp stride, coverage) of each decoder (tp, cp, dp) or expert (etp, ep, edp)
    grid with this pp that Megatron accepts under ``order``; fills ``_hits`` via the key."""
    out = []
    for a, b, c in _triples(world // pp):
        # Expert grid (etp, cp=1, ep, edp, pp) or decoder grid (tp, cp, ep=1, dp, pp).
        cp, ep = (1, b) if expert else (b, 1)
        grid = {"tp": a, "cp": cp, "ep": ep, "dp": c, "pp": pp}
        try:
            tokens = complete_order(order, grid)
        except ValueError:
            continue  # Megatron refuses this order for these sizes
        specs = _grid_specs(grid, tokens, EXPERT_KINDS if expert else DECODER_KINDS, None if expert else world)
        hits = _hits(specs, obs.shapes)
        key = ("exp" if expert else "dec", oi, a, b, c, pp)
        out.append(((a, b, c), key, grid_strides(tokens, grid)["pp"], _coverage(hits, obs.units), hits))
    return out


def _enumerate(world: int, orders: tuple[str, ...], obs: _Observed) -> _Entries:
    sizes: list[tuple[int, ...]] = []
    order_of: list[int] = []
    keys: list[tuple[tuple, tuple]] = []
    rows: list[list[bool]] = []
    counts: list[int] = []
    hits: dict[tuple, dict[str, tuple[Box, np.ndarray]]] = {}
    for oi, order in enumerate(orders):
        ends_pp = order.lower().endswith("pp")
        for pp in _divisors(world):
            dec = _grid_tuples(world, pp, order, oi, obs, expert=False)
            exp = _grid_tuples(world, pp, order, oi, obs, expert=True)
            hits.update({t[1]: t[4] for t in dec + exp})
            for (tp, cp, dp), dkey, dstride, dcov, _ in dec:
                for (etp, ep, edp), ekey, estride, ecov, _ in exp:
                    # initialize_model_parallel: both grids have the same pipeline groups, and an
                    # order not ending in pp needs edp == dp.
                    if dstride != estride or not (ends_pp or pp == 1 or edp == dp):
                        continue
                    row, cnt = [], 0
                    for u, d_bits, e_bits in zip(obs.units, dcov, ecov):
                        if u.hints:  # each described kind lives in one grid
                            acc = u.full
                            for x, y in zip(d_bits, e_bits):
                                acc &= x | y
                        else:
                            acc = d_bits[0] | e_bits[0]
                        row.append(acc == u.full)
                        cnt += acc.bit_count()
                    sizes.append((tp, cp, dp, pp, ep, etp))
                    order_of.append(oi)
                    keys.append((dkey, ekey))
                    rows.append(row)
                    counts.append(cnt)
    return _Entries(np.array(sizes, dtype=np.int64).reshape(-1, len(SIZE_NAMES)), order_of, keys,
                    np.array(rows, dtype=bool).reshape(len(sizes), len(obs.units)),
                    np.array(counts, dtype=np.int64), hits)  # fmt: skip


def _group_labels(obs: _Observed, ent: _Entries, chosen: np.ndarray, descs: Sequence[str | None] | None
                  ) -> tuple[list[dict[str, Any]], np.ndarray]:  # fmt: skip
    """Per input group: kinds possible / certain under the chosen entries; and the union mask."""
    n_obs = len(obs.sets)
    cache: dict[tuple, np.ndarray] = {}

    def labels(key: tuple) -> np.ndarray:
        if key not in cache:
            cache[key] = _label_array(ent.hits[key], obs.shapes, n_obs)
        return cache[key]

    need = np.array([sum(_BIT[k] for k in h) for h in obs.hints], dtype=np.int64)
    req_any = np.array([r and not h for r, h in zip(obs.required, obs.hints)], dtype=bool)
    union = np.zeros(n_obs, dtype=np.int64)
    inter = np.full(n_obs, -1, dtype=np.int64)
    explained = np.ones(n_obs, dtype=bool)
    for i in chosen:
        m = labels(ent.keys[i][0]) | labels(ent.keys[i][1])
        union |= m
        inter &= m
        explained &= ((m & need) == need) & ((m != 0) | ~req_any)
    out = []
    for i, j in enumerate(obs.input_obs):
        labs = _kinds_of(int(union[j])) or (["unexplained"] if obs.required[j] else ["single-rank"])
        entry: dict[str, Any] = {"ranks": list(obs.sets[j]), "labels": labs, "certain": _kinds_of(int(inter[j])),
                                 "explained": bool(explained[j]) or not obs.required[j],
                                 "evidence": obs.required[j]}  # fmt: skip
        if descs is not None and descs[i]:
            entry["desc"] = descs[i]
        out.append(entry)
    return out, union


def _evidence(obs: _Observed, ent: _Entries, sizes: dict[str, int | None], values: dict[str, list[int]],
              consistent: bool, union: np.ndarray, world: int) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per size: its value(s) and, when determined, a minimal set of units that still pins it
    (greedy: drop units, largest groups first, while the size stays determined)."""
    units = obs.units
    drop_order = sorted(range(len(units)), key=lambda u: (-len(obs.sets[units[u].obs[0]]), len(units[u].obs)))
    out: dict[str, dict[str, Any]] = {}
    for k, name in enumerate(SIZE_NAMES):
        ev: dict[str, Any] = {"value": sizes[name], "values": values[name]}
        if consistent and sizes[name] is not None:
            keep = list(range(len(units)))
            for u in drop_order:
                trial = [x for x in keep if x != u]
                sel = ent.explains[:, trial].all(axis=1)
                if set(ent.sizes[sel, k].tolist()) == {sizes[name]}:
                    keep = trial
            ev["pinned_by"] = [_unit_evidence(units[u], obs.sets, union) for u in keep]
            if not keep:
                ev["note"] = f"the only value world size {world} allows"
        out[name] = ev
    return out


def infer_layout(world_size: int, groups: Sequence[Sequence[int]], *, descs: Sequence[str | None] | None = None,
                 orders: Sequence[str] = (DEFAULT_ORDER,),
                 ops: Mapping[tuple[int, ...], Counter] | None = None) -> LayoutInference:  # fmt: skip
    """Infer tp, cp, dp, pp, ep and etp from the member sets of observed communicators.

    ``groups`` are global-rank lists (any order, duplicates allowed); ``descs`` optionally gives
    each one's PyTorch/Megatron group description (or None), which pins its kind; ``orders``
    are the rank orders to try (Megatron's ``order`` argument); ``ops`` (per member set, the
    collectives its groups ran, e.g. from Flight Recorder entries) ranks the candidates by
    behaviour for ``most_likely``. Raises ValueError on malformed input (naming the offending
    group).
    """
    sets = _validate(world_size, groups, descs)
    orders = tuple(dict.fromkeys(orders))
    if not orders:
        raise ValueError("orders: give at least one rank order, e.g. tp-cp-ep-dp-pp")
    for order in orders:
        complete_order(order, {})  # raises on unknown tokens
    w = world_size
    obs = _observe(w, sets, descs)
    ent = _enumerate(w, orders, obs)
    notes: list[str] = []
    if obs.unknown_desc:
        ignored = ", ".join(sorted(obs.unknown_desc))
        notes.append(f"descriptions naming no modelled Megatron group were ignored: {ignored}")

    # Consistent entries; when there are none, the ones explaining most constraining sets.
    total = sum(len(u.obs) for u in obs.units)
    consistent = bool((ent.count == total).any())
    best = total if consistent else int(ent.count.max())
    chosen = np.flatnonzero(ent.count == best)
    if not consistent:
        notes.append(f"no candidate explains every group: the {len(chosen)} best-fitting entries explain {best} of "
                     f"{total} constraining groups; the unexplained groups are not Megatron groups of the tried "
                     f"order(s) ({', '.join(orders)}) or come from what is not modelled (several "
                     f"distributed-optimizer instances, hierarchical context parallelism, user groups)")

    F = ent.sizes[chosen]
    values = {n: sorted({int(v) for v in F[:, k]}) for k, n in enumerate(SIZE_NAMES)}
    sizes = {n: (v[0] if len(v) == 1 else None) for n, v in values.items()}
    tp, cp, dp, pp, ep, etp = (F[:, k] for k in range(len(SIZE_NAMES)))
    products = {"edp": w // (etp * ep * pp), "tp*cp": tp * cp, "dp*cp": dp * cp, "etp*ep": etp * ep}
    derived = {n: (int(c[0]) if len(set(c.tolist())) == 1 else None) for n, c in products.items()}
    cand_orders: dict[tuple[int, ...], list[str]] = {}
    for i in chosen:
        found = cand_orders.setdefault(tuple(int(x) for x in ent.sizes[i]), [])
        if orders[ent.order[i]] not in found:
            found.append(orders[ent.order[i]])
    candidates = [dict(zip(SIZE_NAMES, t)) | {"edp": w // (t[5] * t[4] * t[3]), "orders": o}
                  for t, o in sorted(cand_orders.items())]  # fmt: skip

    out_groups, union = _group_labels(obs, ent, chosen, descs)
    evidence = _evidence(obs, ent, sizes, values, consistent, union, w)
    if consistent and len(candidates) > 1 and not any(obs.hints):
        notes.append("member sets alone leave the layout ambiguous; group descriptions (desc, e.g. from Flight "
                     "Recorder's pg_config) pin each group's kind")
    if len(sets) > len(obs.sets):
        notes.append(f"{len(sets) - len(obs.sets)} input group(s) repeat a member set listed before (counted once)")
    return LayoutInference(world_size=w, orders=orders, sizes=sizes, values=values, derived=derived,
                           candidates=candidates, consistent=consistent, ambiguous=len(candidates) > 1,
                           layout=candidates[0] if len(candidates) == 1 else None, evidence=evidence,
                           groups=out_groups, notes=notes,
                           most_likely=most_likely(w, candidates, ops) if consistent else None)  # fmt: skip


def _unit_evidence(unit: _Unit, obs_sets: list[tuple[int, ...]], union: np.ndarray) -> dict[str, Any]:
    first = unit.obs[0]
    out: dict[str, Any] = {"example": list(obs_sets[first]), "groups": len(unit.obs), "shape": _box_text(unit.box),
                           "labels": _kinds_of(int(union[first]))}  # fmt: skip
    if unit.hints:
        out["desc_kinds"] = [KIND_LABEL[h] for h in unit.hints]
    return out


# ----------------------------------------------------------------------------- input file
_SHAPE = '{"world_size": N, "groups": [[0, 1], ...]}'


def read_layout_input(path: str | Path) -> tuple[int, list[list[int]], list[str | None] | None]:
    """Read ``{"world_size": N, "groups": [[ranks...] | {"ranks": [...], "desc": "..."}, ...]}``.

    Returns (world_size, member lists, descriptions or None). FileNotFoundError / ValueError
    name the file and the field at fault.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file (pass a JSON file {_SHAPE})")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not a text (JSON) file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object {{\"world_size\": N, \"groups\": [[ranks...], ...]}}")
    for key in ("world_size", "groups"):
        if key not in data:
            raise ValueError(f"{p}: field '{key}' is missing (expected {_SHAPE})")
    w = data["world_size"]
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"{p}: field 'world_size' must be a positive integer (the number of ranks), got {w!r}")
    if not isinstance(data["groups"], list):
        raise ValueError(f"{p}: field 'groups' must be a list of rank lists, e.g. [[0, 1], [2, 3]]")
    groups: list[list[int]] = []
    descs: list[str | None] = []
    for i, g in enumerate(data["groups"]):
        desc = None
        if isinstance(g, dict):
            if "ranks" not in g:
                raise ValueError(f"{p}: groups[{i}]: an object needs 'ranks' (and optionally 'desc')")
            desc = g.get("desc")
            if desc is not None and not isinstance(desc, str):
                raise ValueError(f"{p}: groups[{i}].desc must be a string such as \"TENSOR_MODEL_PARALLEL_GROUP\"")
            g = g["ranks"]
        if not isinstance(g, list):
            raise ValueError(f"{p}: groups[{i}] must be a list of global ranks or {{\"ranks\": [...], \"desc\": ...}}")
        groups.append(g)
        descs.append(desc)
    try:
        _validate(w, groups, descs)
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from None
    return w, groups, (descs if any(d is not None for d in descs) else None)
