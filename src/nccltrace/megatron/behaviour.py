"""Which consistent layout is most likely, from what each group does.

Member sets alone often leave several layouts (cp and dp swap, the split of etp·ep); the groups'
behaviour tells them apart as a Megatron engineer would: the busiest group is tensor parallel,
a group running all-to-all is expert parallel, one running only Send/Recv is pipeline (or
context) parallel, and the opt-in dimensions default to 1. Each rule scores the candidates that
satisfy it; the best score is reported with the rules that ranked it and the runner-up. This
ranks; it never makes a size certain. The rules and their points: ``docs/correlation.md``
section 2, "Flight Recorder dumps as input, and the most likely layout".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from nccltrace.megatron.groups import megatron_groups
from nccltrace.megatron.sizes import ParallelSizes

__all__ = ["MIN_TP_REPEATS", "NCCL_OPS", "SPANNING_TP_REPEATS", "POINTS", "Behaviour", "GroupDid", "kinds_by_member_set", "most_likely"]

POINTS = {"busiest_is_tp": 3, "all_to_all_is_ep": 2, "p2p_is_pp": 1, "cp_default": 1, "etp_default": 1,
          "ep_default": 0.5}
_P2P = frozenset({"send", "recv", "coalesced"})
MAX_RANKED = 512
_SIZES = ("tp", "cp", "dp", "pp", "ep", "etp")


def kinds_by_member_set(cand: Mapping[str, Any], world: int) -> dict[tuple[int, ...], set[str]]:
    """Per member set (sorted global ranks): the Megatron group kinds it is in the candidate
    layout (the six sizes and ``orders``, as :func:`~.infer.infer_layout` lists them)."""
    sizes = ParallelSizes(tp=cand["tp"], pp=cand["pp"], cp=cand["cp"], ep=cand["ep"], etp=cand["etp"],
                          world_size=world)  # fmt: skip
    out: dict[tuple[int, ...], set[str]] = {}
    for kind, groups in megatron_groups(sizes, cand["orders"][0]).items():
        for g in groups:
            out.setdefault(tuple(sorted(g)), set()).add(kind)
    return out


def _share(sets: list[tuple[int, ...]], kinds: dict[tuple[int, ...], set[str]], wanted: set[str]) -> float:
    return sum(bool(kinds.get(s, set()) & wanted) for s in sets) / len(sets) if sets else 0.0


class GroupDid(NamedTuple):
    """What one group (communicator) did: its member set, how many calls of each collective its
    members made (Flight Recorder's profiling names: ``all_gather``, ``send``, ...), and, where
    known, how many times per training step a member repeats its most repeated call (same op
    and size): per-layer activations repeat many times a step, gradient buckets once or twice."""

    members: tuple[int, ...]
    ops: Counter
    repeats_per_step: float | None = None


Behaviour = Mapping[tuple[int, ...], Counter] | Sequence[GroupDid]
"""What groups did: per member set (Flight Recorder entries, merged per set) or per group
(:class:`GroupDid`, so that two groups of one member set, e.g. pp and embd, keep their own)."""

MIN_TP_REPEATS = 3
"""A tp group repeats its per-layer calls at least this often per step (two directions of at least
one layer and micro-batch, and more); below it the busiest group is taken for data parallelism's
gradient buckets, not tensor parallelism."""

SPANNING_TP_REPEATS = 8
"""A group of every rank is taken for tensor parallelism (tp = world size) only when its calls
repeat at least this often per step: the world's own logging reductions (learning rate, loss,
grad norm, timers) repeat a few times a step, per-layer activations (4 per layer and
micro-batch without sequence parallelism) far more."""

NCCL_OPS = {"AllGather": "all_gather", "ReduceScatter": "reduce_scatter", "AllReduce": "all_reduce",
            "Broadcast": "broadcast", "Reduce": "reduce", "Send": "send", "Recv": "recv", "AlltoAll": "all_to_all"}
"""NCCL's call names (the log's) in the behaviour's names (Flight Recorder's profiling names)."""


def most_likely(world: int, candidates: Sequence[Mapping[str, Any]], ops: Behaviour | None) -> dict[str, Any] | None:
    """The most likely of the consistent ``candidates`` (each with the six sizes and
    ``orders``) given ``ops`` (:data:`Behaviour`; None: no behaviour known, the defaults alone
    rank): its sizes, ``score``, the ``evidence`` that ranked it, ``by_behaviour`` (whether
    what the groups did ranked it, not the defaults alone), and ``runner_up`` (sizes and score)
    or ``tied`` (how many others score the same: the evidence does not separate them)."""
    if not candidates:
        return None
    # behaviour needs each candidate's groups; beyond a few hundred candidates (a sparse view of a
    # large job) generating them costs more than the ranking is worth: the defaults rank alone
    use_ops = ops if len(candidates) <= MAX_RANKED else None
    groups = ([GroupDid(s, c) for s, c in use_ops.items()] if isinstance(use_ops, Mapping)
              else [GroupDid(*g) for g in use_ops or ()])  # fmt: skip
    live = [g for g in groups if 1 < len(g.members) < world and sum(g.ops.values())]
    # a group's collectives other than all-to-all and Send/Recv (a tp group can run the MoE
    # all-to-all too where ep groups have the same members, etp = 1). A group of every rank is
    # a candidate too where its calls are known to repeat like per-layer ones (tp = world size);
    # otherwise the world's barriers and logging reductions say nothing
    spanning = [g for g in groups if len(g.members) == world > 1 and g.repeats_per_step is not None
                and g.repeats_per_step >= SPANNING_TP_REPEATS]
    coll = [g._replace(ops=Counter({k: n for k, n in g.ops.items() if k != "all_to_all" and k not in _P2P}))
            for g in live + spanning]  # fmt: skip
    coll = [g for g in coll if sum(g.ops.values())]
    busiest_of = max(coll, key=lambda g: (sum(g.ops.values()) / len(g.members), g.members)) if coll else None
    no_tp = None  # the busiest group's calls repeat too rarely a step for per-layer activations
    if busiest_of is not None and busiest_of.repeats_per_step is not None \
            and busiest_of.repeats_per_step < MIN_TP_REPEATS:
        busiest_of, no_tp = None, busiest_of
    busiest = busiest_of.members if busiest_of else None
    live = [(g.members, g.ops) for g in live]
    a2a = sorted(s for s, c in live if c.get("all_to_all"))
    p2p = sorted(s for s, c in live if set(c) <= _P2P)
    scored = []
    for cand in candidates:
        kinds = kinds_by_member_set(cand, world) if live or coll else {}
        why: list[str] = []
        score = 0.0
        behaved = False  # ranked by what the groups did, not the defaults alone
        if busiest is not None and "tp" in kinds.get(busiest, set()):
            score += POINTS["busiest_is_tp"]
            n = sum(busiest_of.ops.values()) / len(busiest)
            why.append(f"the busiest group {list(busiest)} ({n:.0f} collectives per member) is a tp group")
            behaved = True
        if no_tp is not None and cand["tp"] == 1:
            score += POINTS["busiest_is_tp"]
            why.append(f"tp = 1: the busiest group {list(no_tp.members)} repeats its calls "
                       f"{no_tp.repeats_per_step:.1f} times a step (per-layer activations repeat at least "
                       f"{MIN_TP_REPEATS})")
            behaved = True
        if a2a and (share := _share(a2a, kinds, {"ep"})):
            score += POINTS["all_to_all_is_ep"] * share
            why.append(f"{share:.0%} of the {len(a2a)} groups running all-to-all are ep groups")
            behaved = True
        if p2p and (share := _share(p2p, kinds, {"pp", "cp"})):
            score += POINTS["p2p_is_pp"] * share
            why.append(f"{share:.0%} of the {len(p2p)} groups running only Send/Recv are pp (or cp) groups")
            behaved = True
        if cand["cp"] == 1:
            score += POINTS["cp_default"]
            why.append("cp = 1 (context parallelism is opt-in)")
        if cand["etp"] == 1:
            score += POINTS["etp_default"]
            why.append("etp = 1 (expert tensor parallelism is opt-in)")
        if (live or coll) and not a2a and cand["ep"] == 1:
            # weaker: an all-gather token dispatcher runs experts without any all-to-all
            score += POINTS["ep_default"]
            why.append("ep = 1 (no group runs all-to-all)")
        scored.append((score, cand, why, behaved))
    scored.sort(key=lambda x: -x[0])  # stable: candidates keep their order among equal scores
    best, cand, why, behaved = scored[0]
    out: dict[str, Any] = {k: int(cand[k]) for k in _SIZES} | {"score": round(best, 3), "evidence": why,
                                                               "by_behaviour": behaved}
    tied = sum(1 for x in scored[1:] if x[0] == best)
    if tied:
        out["tied"] = tied
    if ops and use_ops is None:
        out["evidence"].append(f"behaviour not used: {len(candidates)} candidates (more than {MAX_RANKED})")
    rest = [x for x in scored[1:] if x[0] < best]
    if rest:
        out["runner_up"] = {k: int(rest[0][1][k]) for k in _SIZES} | {"score": round(rest[0][0], 3)}
    return out
