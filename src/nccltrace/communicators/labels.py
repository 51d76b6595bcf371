"""Which Megatron-LM parallelism each logical communicator serves.

With the run's declared sizes the groups Megatron creates are known exactly
(:class:`~nccltrace.megatron.layout.MegatronLayout`), and each observed communicator is matched
to them by its member set. Kinds with identical member sets get a canonical label and
``parallelism_candidates``, and are told apart only by exact evidence (eager split order, pair
communicators); without sizes the thesis's heuristic is used and reported as such. Details:
``docs/correlation.md`` section 2 and its module notes.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from nccltrace.megatron.groups import GROUP_KINDS, PAIR_DIMS
from nccltrace.megatron.layout import Group, MegatronLayout, megatron_layout
from nccltrace.megatron.sizes import ParallelSizes, declares_sizes

__all__ = [
    "KIND_PREFERENCE",
    "LABEL_SCHEMA",
    "P2P_OPS",
    "PAIR_DIMS",
    "ParallelSizes",
    "communicator_behaviour",
    "declares_sizes",
    "expected_member_sets",
    "kind_description",
    "label_by_behaviour",
    "label_communicators",
    "label_ops",
    "pair_kinds",
    "truth_label",
    "with_logical_ids",
]

P2P_OPS = frozenset({"Send", "Recv"})

# Canonical label among kinds with identical member sets: single dimensions first (what users
# think in), dense before expert, then combined groups, the special groups and the world last.
KIND_PREFERENCE: tuple[str, ...] = (
    "tp", "pp", "dp", "cp", "ep", "etp", "edp", "dp-cp", "tp-cp", "tp-dp", "tp-dp-cp", "mp", "tp-ep",
    "tp-ep-pp", "embd", "pos-embd", "world", "intra-distopt",
)  # fmt: skip
_RANK = {k: i for i, k in enumerate(KIND_PREFERENCE)}

LABEL_SCHEMA = pa.schema(
    [
        pa.field("logical_id", pa.int32(), metadata={"doc": "logical communicator (communicators.parquet)"}),
        pa.field("nranks", pa.int32(), metadata={"doc": "communicator size"}),
        pa.field("members", pa.list_(pa.int32()), metadata={"doc": "global rank of each member by rank in comm "
                                                                     "(-1 unknown), as in communicators.parquet"}),
        pa.field("parallelism", pa.string(), metadata={"doc": "canonical label: a Megatron group kind (layout names, "
                                                              "e.g. 'tp', 'dp-cp', 'mp'), or 'collective'/'unknown'"}),
        pa.field("parallelism_candidates", pa.string(), metadata={
            "doc": "comma-separated kinds the data cannot exclude (identical member sets), canonical first"}),
        pa.field("label_source", pa.string(), metadata={
            "doc": "'megatron-groups' (member set matched to the declared or inferred sizes), 'pg-names' (the "
                   "PyTorch process group's own description), 'behaviour' (matched to the layout most likely from "
                   "what each communicator does: not certain), 'heuristic' (thesis 4.2.3 rules, sizes unknown) or "
                   "'unmatched' (sizes known, no expected group has this member set)"}),
        pa.field("expected_group_index", pa.int32(), metadata={
            "doc": "index of the matched group among the layout's groups of the canonical kind (pairs: of the group "
                   "both ranks share); null when not matched"}),
        pa.field("resolution", pa.string(), metadata={
            "doc": "how the label was decided: 'member-set' (unique kind), 'ambiguous' (several candidates), "
                   "'creation-order' / 'split-parent' (eager split evidence), 'pair', 'partial' (some members "
                   "unknown), 'no-match'; heuristic: 'p2p-only', 'largest', 'other', 'no-calls'; named: "
                   "'kernel-records' / 'pytorch-log' / 'flight-recorder' / 'elimination' (nccltrace.communicators.names); "
                   "behaviour: 'all-layouts' (every "
                   "consistent layout agrees), 'most-likely'"}),
        pa.field("pg_name", pa.string(), metadata={
            "doc": "PyTorch process group of the communicator (its name in pg_config); null when not known"}),
        pa.field("pg_desc", pa.string(), metadata={
            "doc": "the group's description as Megatron set it (TENSOR_MODEL_PARALLEL_GROUP, ...); null when not known"}),
    ]
)


# --------------------------------------------------------------------------- expected groups


def _pref(kinds: Iterable[str]) -> list[str]:
    return sorted(set(kinds), key=lambda k: (_RANK.get(k, len(_RANK)), k))


def expected_member_sets(layout: MegatronLayout) -> dict[frozenset[int], list[Group]]:
    """Member set -> the layout's groups with exactly those ranks, in creation order."""
    out: dict[frozenset[int], list[Group]] = {}
    for g in layout.groups:
        out.setdefault(frozenset(g.ranks), []).append(g)
    return out


def pair_kinds(layout: MegatronLayout, a: int, b: int) -> list[tuple[str, Group]]:
    """(kind, group) of the single parallel dimensions whose group holds both ranks ``a`` and
    ``b`` - what a two-rank pair communicator between them can belong to - plus the world group
    for pipeline neighbours when pp = 2 (Megatron core_r0.13 ``_p2p_ops`` sends one direction
    over the default group then)."""
    out: list[tuple[str, Group]] = []
    for kind in PAIR_DIMS:
        if kind not in layout.by_kind:
            continue
        ga, gb = layout.group_of(kind, a), layout.group_of(kind, b)
        if ga is not None and ga is gb and ga.size >= 2:
            out.append((kind, ga))
    if layout.pp == 2 and any(k == "pp" for k, _ in out):
        out.append(("world", layout.by_kind["world"][0]))
    return out


# --------------------------------------------------------------------------- labelling


def with_logical_ids(calls: pd.DataFrame, members: pd.DataFrame) -> pd.DataFrame:
    """``calls`` with the ``logical_id`` of each call's (host, pid, comm) from
    ``communicator_members`` (-1 where the pointer has no known communicator)."""
    key = members[["host", "pid", "comm", "logical_id"]].drop_duplicates(["host", "pid", "comm"])
    key = key.astype({"host": object, "pid": "int64", "comm": "uint64", "logical_id": "int64"})
    # (a call no source ties to a communicator, e.g. a profiler kernel without its record, has no comm)
    left = calls.astype({"host": object, "pid": "int64", "comm": "UInt64"})
    out = left.merge(key.astype({"comm": "UInt64"}), on=["host", "pid", "comm"], how="left")
    out["logical_id"] = out["logical_id"].fillna(-1).astype("int64")
    out.index = calls.index
    return out


def _member_lists(communicators: pd.DataFrame) -> dict[int, list[int]]:
    """Per logical id: global rank by rank in comm (-1 unknown)."""
    out: dict[int, list[int]] = {}
    for lid, mem, n in zip(communicators["logical_id"], communicators["members"], communicators["nranks"]):
        out[int(lid)] = [int(x) for x in (mem if mem is not None else [])] or [-1] * int(n)
    return out


def _known_set(lid: int, nranks: int, lst: list[int], by_lid: dict[int, list[int]] | None
               ) -> tuple[frozenset[int], bool]:  # fmt: skip
    """(known global ranks, whether all ``nranks`` are known). Ranks missing from the member list
    (e.g. the sequence fallback, whose ranks in the communicator may be unknown) are taken from
    the members table's global ranks."""
    known = {r for r in lst if r >= 0}
    if len(known) < nranks and by_lid is not None:
        known |= {r for r in by_lid.get(lid, []) if r >= 0}
    return frozenset(known), len(known) == nranks


def _order_key(members: pd.DataFrame | None) -> dict[int, dict[tuple, int]]:
    """logical id -> {(host, pid): init line} (creation position in each member process)."""
    out: dict[int, dict[tuple, int]] = {}
    if members is None or members.empty:
        return out
    for lid, host, pid, line in zip(members["logical_id"], members["host"], members["pid"], members["line"]):
        if pd.isna(line) or int(lid) < 0:
            continue
        out.setdefault(int(lid), {})[(host, int(pid))] = int(line)
    return out


def _creation_order(lids: list[int], lines: dict[int, dict[tuple, int]], split_count: dict[int, int | None]
                    ) -> list[int] | None:  # fmt: skip
    """``lids`` in creation order if every member process (and splitCount, when printed for all)
    agrees on it, else None."""
    procs = set.intersection(*(set(lines.get(lid, {})) for lid in lids)) if lids else set()
    if not procs:
        return None
    order = None
    for p in procs:
        o = sorted(lids, key=lambda lid: lines[lid][p])
        if order is None:
            order = o
        elif o != order:
            return None
    counts = [split_count.get(lid) for lid in lids]
    if (order is not None and all(c is not None for c in counts)
            and sorted(lids, key=lambda lid: split_count[lid]) != order):
        return None
    return order


def label_communicators(
    communicators: pd.DataFrame,
    sizes: ParallelSizes | Mapping[str, Any] | None = None,
    *,
    members: pd.DataFrame | None = None,
    calls: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Label every logical communicator with the Megatron parallelism it serves.

    ``communicators`` / ``members``: the tables of :mod:`nccltrace.communicators.infer` (or of the
    sequence fallback). ``members`` supplies init-line order (creation-order resolution) and
    global ranks missing from ``communicators.members``. ``calls`` (the log reader's calls
    table) tells which communicators carry collectives (those are not P2P pair
    communicators) and drives the heuristic. ``sizes``: declared sizes (or settings mapping);
    None selects the thesis heuristic. Returns a DataFrame with :data:`LABEL_SCHEMA` columns.
    """
    if sizes is not None and not isinstance(sizes, ParallelSizes):
        sizes = ParallelSizes.from_settings(sizes)
    comms = communicators.reset_index(drop=True)
    lists = _member_lists(comms)
    by_lid: dict[int, list[int]] | None = None
    if members is not None and not members.empty:
        by_lid = {}
        for lid, gr in zip(members["logical_id"], members["global_rank"]):
            if int(lid) >= 0 and not pd.isna(gr):
                by_lid.setdefault(int(lid), []).append(int(gr))
    ops_by_lid = _ops_by_lid(calls, members)
    if sizes is None:
        rows = _heuristic(comms, lists, ops_by_lid)
    else:
        rows = _match(comms, lists, by_lid, sizes, members, ops_by_lid)
    return _frame(rows)


def _ops_by_lid(calls: pd.DataFrame | None, members: pd.DataFrame | None) -> dict[int, set[str]] | None:
    if calls is None:
        return None
    if "logical_id" not in calls.columns:
        if members is None:
            raise ValueError("calls without logical_id need the members table to join on (host, pid, comm)")
        calls = with_logical_ids(calls, members)
    out: dict[int, set[str]] = {}
    for (lid, op), _ in calls.groupby(["logical_id", "op"], sort=False):
        out.setdefault(int(lid), set()).add(str(op))
    return out


def _heuristic(comms: pd.DataFrame, lists: dict[int, list[int]], ops_by_lid: dict[int, set[str]] | None
               ) -> list[tuple]:  # fmt: skip
    """Thesis 4.2.3: P2P -> pp; the largest communicators -> dp (when there is more than one
    rank); other collectives -> 'collective'; nothing known -> 'unknown'."""
    largest = int(comms["nranks"].max()) if len(comms) else 0
    rows = []
    for lid, n in zip(comms["logical_id"], comms["nranks"]):
        lid, n = int(lid), int(n)
        ops = ops_by_lid.get(lid, set()) if ops_by_lid is not None else set()
        if ops and ops <= P2P_OPS:
            lab, how = "pp", "p2p-only"
        elif n == largest and largest > 1:
            lab, how = "dp", "largest"
        elif ops:
            lab, how = "collective", "other"
        else:
            lab, how = "unknown", "no-calls"
        rows.append((lid, n, lists[lid], lab, lab, "heuristic", None, how))
    return rows


class _CommFacts:
    """What the init lines say of each communicator, by position in the communicators table:
    its kind, parent, commId, size and known member set."""

    def __init__(self, comms: pd.DataFrame, lists: dict[int, list[int]], by_lid: dict[int, list[int]] | None):
        def col(name: str) -> list:
            return comms[name].tolist() if name in comms else [None] * len(comms)

        self.kinds = comms["kind"].astype(object).tolist() if "kind" in comms else [None] * len(comms)
        self.parents = col("parent_logical_id")
        self.comm_ids = col("comm_id")
        self.lids = [int(x) for x in comms["logical_id"]]
        self.nr = [int(x) for x in comms["nranks"]]
        self.split_count = {lid: (None if pd.isna(c) else int(c)) for lid, c in zip(self.lids, col("split_count"))}
        self.id_uses: dict[int, int] = {}
        for c in self.comm_ids:
            if not pd.isna(c):
                self.id_uses[int(c)] = self.id_uses.get(int(c), 0) + 1
        self.world_parent = {int(p) for p, k in zip(self.parents, self.kinds) if k == "split" and not pd.isna(p)}
        self.sets: list[frozenset[int]] = []
        self.full: list[bool] = []
        for i, lid in enumerate(self.lids):
            s, ok = _known_set(lid, self.nr[i], lists[lid], by_lid)
            self.sets.append(s)
            self.full.append(ok)
        # Creation-order resolution per member set (eager splits), see the module docstring.
        self.eager = bool(self.world_parent) or any(v > 1 for v in self.id_uses.values())
        self.legacy = not self.world_parent and self.eager  # NCCL < 2.21.5: splits printed as plain inits

    def split_like(self, i: int) -> bool:
        """A split from the world communicator: printed as such (>= 2.21.5) or, before, a plain
        line whose commId another communicator repeats (commId = f(parent, color))."""
        if self.kinds[i] == "split":
            return not pd.isna(self.parents[i]) and int(self.parents[i]) in self.world_parent
        return not pd.isna(self.comm_ids[i]) and self.id_uses.get(int(self.comm_ids[i]), 0) > 1

    def grouplike(self, i: int) -> bool:
        """Created by the eager split sequence (the world or a split of it). Before 2.21.5 a split
        with a unique color looks like a plain init; only pair communicators (two ranks) are
        plain inits in an eager run, so larger ones count as splits."""
        return self.lids[i] in self.world_parent or self.split_like(i) or (self.legacy and self.nr[i] > 2)


def _match(comms: pd.DataFrame, lists: dict[int, list[int]], by_lid: dict[int, list[int]] | None,
           sizes: ParallelSizes, members: pd.DataFrame | None, ops_by_lid: dict[int, set[str]] | None
           ) -> list[tuple]:  # fmt: skip
    """Label rows of communicators matched to the groups of the Megatron layout of ``sizes``."""
    layout = megatron_layout(sizes)
    expected = expected_member_sets(layout)
    f = _CommFacts(comms, lists, by_lid)
    resolved = _resolve_by_creation(f, expected, _order_key(members), int(sizes.world_size))
    rows = []
    for i, lid in enumerate(f.lids):
        n, s = f.nr[i], f.sets[i]
        if lid in resolved:
            kind, gidx, how = resolved[lid]
            rows.append((lid, n, lists[lid], kind, kind, "megatron-groups", gidx, how))
            continue
        if not s:
            rows.append((lid, n, lists[lid], "unknown", "", "unmatched", None, "no-match"))
            continue
        if f.full[i]:
            ops = ops_by_lid.get(lid) if ops_by_lid is not None else None
            may_be_pair = n == 2 and f.kinds[i] != "split" and not f.split_like(i) and not (ops and ops - P2P_OPS)
            cands, how = _full_set_candidates(f, i, layout, expected, may_be_pair)
        else:
            cands, how = _partial_candidates(layout, n, s, lists[lid]), "partial"
        if not cands:
            rows.append((lid, n, lists[lid], "unknown", "", "unmatched", None, "no-match"))
            continue
        order = _pref(cands)
        if how == "member-set" and len(order) > 1:
            how = "ambiguous"
        rows.append((lid, n, lists[lid], order[0], ",".join(order), "megatron-groups", cands[order[0]], how))
    return rows


def _resolve_by_creation(f: _CommFacts, expected: dict[frozenset[int], list[Group]], lines: dict[int, dict[tuple, int]],
                         world: int) -> dict[int, tuple[str, int, str]]:  # fmt: skip
    """In a run of eager splits, the communicators of one member set labelled by the order they
    were created in (kind, group index, how), where every member process agrees on it."""
    resolved: dict[int, tuple[str, int, str]] = {}
    by_set: dict[frozenset[int], list[int]] = {}
    for i, lid in enumerate(f.lids):
        if f.full[i]:
            by_set.setdefault(f.sets[i], []).append(i)
    for s, idx in by_set.items():
        if not f.eager:
            break
        groups = expected.get(s, [])
        for i in idx:
            if f.lids[i] in f.world_parent and len(s) == world:
                resolved[f.lids[i]] = ("world", 0, "split-parent")
        made = [i for i in idx if f.grouplike(i)]
        if groups and len(made) == len(groups):
            order = _creation_order([f.lids[i] for i in made], lines, f.split_count)
            if order is not None:
                how = "creation-order" if len({g.kind for g in groups}) > 1 else "member-set"
                for lid, g in zip(order, groups):
                    resolved[lid] = (g.kind, g.index, "split-parent" if g.kind == "world" else how)
    return resolved


def _full_set_candidates(f: _CommFacts, i: int, layout: MegatronLayout, expected: dict[frozenset[int], list[Group]],
                         may_be_pair: bool) -> tuple[dict[str, int], str]:  # fmt: skip
    """Group kinds (and indices) communicator ``i`` of known members can be, and how: the groups
    with its member set, or the pairs of its two ranks."""
    s, n = f.sets[i], f.nr[i]
    cands: dict[str, int] = {}
    how = "member-set"
    for g in expected.get(s, []) if len(s) == n else []:
        cands.setdefault(g.kind, g.index)
    pairs: dict[str, int] = {}
    if may_be_pair and len(s) == 2:
        a, b = sorted(s)
        for kind, g in pair_kinds(layout, a, b):
            pairs.setdefault(kind, g.index)
    # Where NCCL prints split lines (>= 2.21.5), a two-rank plain init in an eager-split
    # run is not a split, hence a pair; before, a split with a unique color looks the same.
    if pairs and (not cands or (f.world_parent and f.kinds[i] != "split")):
        cands, how = pairs, "pair"
    else:
        for k, v in pairs.items():
            cands.setdefault(k, v)
    return cands, how


def _partial_candidates(layout: MegatronLayout, n: int, s: frozenset[int], lst: list[int]) -> dict[str, int]:
    """Some members unknown: groups of this size whose ranks agree at every known position."""
    cands: dict[str, int] = {}
    for g in layout.groups:
        if g.size == n and s <= set(g.ranks) and all(r < 0 or r == g.ranks[j] for j, r in enumerate(lst)):
            cands.setdefault(g.kind, g.index)
    return cands


def _frame(rows: list[tuple]) -> pd.DataFrame:
    """The label rows (every column but the process-group names, which :func:`apply_names` sets)."""
    rows = [(*r, None, None) for r in rows]  # pg_name, pg_desc
    cols = list(zip(*rows)) if rows else [[] for _ in LABEL_SCHEMA]
    arrays = [pa.array(list(c), type=f.type) for c, f in zip(cols, LABEL_SCHEMA)]
    return pa.Table.from_arrays(arrays, schema=LABEL_SCHEMA).to_pandas(types_mapper=pd.ArrowDtype)


def apply_names(labels: pd.DataFrame, names: pd.DataFrame) -> pd.DataFrame:
    """Labels with the process-group names of :func:`nccltrace.communicators.names.name_communicators`:
    a named communicator whose description names a Megatron group kind is labelled that kind
    (``label_source`` 'pg-names', ``resolution`` how it was named); every named one gets
    ``pg_name`` and ``pg_desc``."""
    from nccltrace.megatron.infer import kind_of_desc

    out = labels.copy()
    for c in ("pg_name", "pg_desc"):
        if c not in out:
            out[c] = pd.Series([None] * len(out), dtype=object)
    if names.empty:
        return out
    pos = pd.Index(out["logical_id"].astype("int64")).get_indexer(names["logical_id"].astype("int64"))
    for i, (name, desc, src) in zip(pos, names[["pg_name", "pg_desc", "name_source"]].itertuples(index=False)):
        if i < 0:
            continue
        out.at[out.index[i], "pg_name"] = name
        out.at[out.index[i], "pg_desc"] = desc
        kind = kind_of_desc(desc) if isinstance(desc, str) else None
        if kind is not None:
            out.at[out.index[i], "parallelism"] = kind
            out.at[out.index[i], "parallelism_candidates"] = kind
            out.at[out.index[i], "label_source"] = "pg-names"
            out.at[out.index[i], "resolution"] = src
    return out


def communicator_behaviour(call_counts: pd.DataFrame, members: pd.DataFrame) -> list:
    """What each logical communicator did (:class:`nccltrace.megatron.behaviour.GroupDid`), for
    :func:`~nccltrace.megatron.behaviour.most_likely`: its member set (global ranks;
    communicators with a member of unknown rank are left out), how many calls of each collective
    its members logged, and how many times per step a member repeats its most repeated call
    signature (op, count, datatype). Steps are counted as the most common number of times one
    signature repeats in the run (the calls made once per step: gradient buckets, loss and
    logging reductions), the smaller on a tie. ``call_counts``: columns ``host``, ``pid``,
    ``comm``, ``op``, ``count``, ``datatype``, ``calls`` and ``peers`` (distinct Send/Recv peers of
    that member for that signature). PyTorch runs ``all_to_all`` as one NCCL group of Send/Recv
    per peer, so a communicator of 4 or more ranks on which a member exchanges with every other
    member counts as all-to-all, not as point-to-point (a pipeline stage has two neighbours)."""
    from nccltrace.megatron.behaviour import NCCL_OPS, GroupDid

    if call_counts.empty:
        return []
    rows = with_logical_ids(call_counts, members)
    rows = rows[rows["logical_id"].notna()]
    repeats = rows["calls"].astype("int64")
    common = repeats[repeats > 1].value_counts()
    steps = int(min(common.index[common == common.max()])) if len(common) else None
    ranks: dict[int, list[int]] = {}
    for lid, gr in zip(members["logical_id"], members["global_rank"]):
        if int(lid) >= 0:
            ranks.setdefault(int(lid), []).append(-1 if pd.isna(gr) else int(gr))
    out = []
    for lid, part in rows.groupby("logical_id", sort=True):
        s = tuple(sorted(ranks.get(int(lid), [])))
        if not s or s[0] < 0:
            continue
        p2p = part["op"].isin(sorted(P2P_OPS))
        peers = part.loc[p2p].groupby(["host", "pid"])["peers"].sum() if p2p.any() else pd.Series([], dtype="int64")
        fan_out = len(s) >= 4 and len(peers) > 0 and int(peers.max()) >= len(s) - 1
        counts: Counter = Counter()
        for op, n in zip(part["op"].astype(str), part["calls"].astype("int64")):
            counts["all_to_all" if fan_out and op in P2P_OPS else NCCL_OPS.get(op, op.lower())] += int(n)
        per_step = float(part["calls"].max()) / steps if steps else None
        out.append(GroupDid(s, counts, per_step))
    return out


def label_by_behaviour(labels: pd.DataFrame, kinds_per_layout: list[dict[tuple[int, ...], set[str]]]
                       ) -> pd.DataFrame:  # fmt: skip
    """Labels made from the most likely layout (:func:`nccltrace.megatron.behaviour.most_likely`)
    marked as such: ``label_source`` 'behaviour'; ``parallelism_candidates`` every kind any
    consistent layout gives the member set (the most likely one's first); ``resolution``
    'all-layouts' where every consistent layout gives the set the same kinds (as certain as a
    member-set match), else 'most-likely'."""
    out = labels.copy()
    src, res, cands = [], [], []
    for members, cand, source, how in zip(out["members"], out["parallelism_candidates"], out["label_source"],
                                          out["resolution"]):  # fmt: skip
        key = tuple(sorted(int(r) for r in members))
        per = [k.get(key, set()) for k in kinds_per_layout]
        seen = [str(c) for c in str(cand).split(",") if c] if isinstance(cand, str) else []
        union = sorted(set().union(*per) - set(seen), key=lambda k: _RANK.get(k, len(_RANK)))
        if source != "megatron-groups":  # unmatched, or a pair label: as they were
            src.append(source)
            res.append(how)
            cands.append(cand)
            continue
        src.append("behaviour")
        agree = per and per[0] and all(k == per[0] for k in per)  # a pair is no layout group: most likely
        res.append("all-layouts" if agree else "most-likely")
        cands.append(",".join(seen + union))
    out["label_source"], out["resolution"], out["parallelism_candidates"] = src, res, cands
    return out


def label_ops(ops: pd.DataFrame, labels: pd.DataFrame) -> pd.DataFrame:
    """Attach ``parallelism``, ``parallelism_candidates`` and ``label_source`` to per-op rows that
    carry ``logical_id`` (see :func:`with_logical_ids`). Rows of unknown communicators get
    'unknown'. Where the label is heuristic, Send/Recv rows are 'pp' whatever their communicator
    (the thesis classifies point-to-point operations as PP, op by op)."""
    if "logical_id" not in ops.columns:
        raise ValueError("ops need a 'logical_id' column (see with_logical_ids)")
    labels = labels.assign(**{c: labels[c] if c in labels else None for c in ("pg_name", "pg_desc")})
    lab = labels[["logical_id", "parallelism", "parallelism_candidates", "label_source", "pg_name", "pg_desc"]]
    lab = lab.astype({"logical_id": "int64", "parallelism": object, "parallelism_candidates": object,
                      "label_source": object, "pg_name": object, "pg_desc": object})  # fmt: skip
    lid = ops["logical_id"].astype("Int64").fillna(-1).astype("int64").to_numpy()
    idx = pd.Index(lab["logical_id"].to_numpy())
    pos = idx.get_indexer(lid)
    hit = pos >= 0
    out = ops.copy()
    for col, default in (("parallelism", "unknown"), ("parallelism_candidates", ""), ("label_source", "unmatched"),
                         ("pg_name", None), ("pg_desc", None)):  # fmt: skip
        vals = np.full(len(ops), default, dtype=object)
        vals[hit] = lab[col].to_numpy(dtype=object)[pos[hit]]
        out[col] = vals
    if "op" in ops.columns:
        p2p = ops["op"].astype(object).isin(P2P_OPS).to_numpy() & (out["label_source"].to_numpy() == "heuristic")
        out.loc[p2p, "parallelism"] = "pp"
        out.loc[p2p, "parallelism_candidates"] = "pp"
    return out


def kind_description(kind: str) -> str:
    """What a layout group kind is (Megatron's process-group name)."""
    base = kind.split(":", 1)[-1]
    return GROUP_KINDS.get(base, kind)


_PAIR_RE = re.compile(r"^p2p:(.+)$")


def truth_label(kind: str) -> str:
    """Label a ground-truth group kind should get: pair communicators ('p2p:<kind>') are
    labelled by their group's kind."""
    m = _PAIR_RE.match(kind)
    return m.group(1) if m else kind
