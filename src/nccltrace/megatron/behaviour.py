"""Which consistent layout is most likely, from what each group does.

Member sets alone often leave several layouts (cp and dp swap, the split of etp·ep); the groups'
behaviour tells them apart as a Megatron engineer would:

* the busiest group (most recorded collectives per member, all-to-all aside) carries the
  per-layer all-gather/reduce-scatter (or all-reduce) of activations: tensor parallelism;
* a group running all-to-all dispatches tokens to experts: expert parallelism;
* a group running only Send/Recv passes activations between pipeline stages (or, under context
  parallelism, KV blocks around a ring);
* context parallelism and expert tensor parallelism are opt-in (cp = 1, etp = 1 by default).

Each rule scores the candidates that satisfy it (points below); the best score is the most
likely layout, reported with every rule that ranked it and with the runner-up. This ranks;
it never makes a size certain (that takes every consistent candidate agreeing).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from .groups import megatron_groups
from .sizes import ParallelSizes

__all__ = ["POINTS", "most_likely"]

POINTS = {"busiest_is_tp": 3, "all_to_all_is_ep": 2, "p2p_is_pp": 1, "cp_default": 1, "etp_default": 1}
_P2P = frozenset({"send", "recv", "coalesced"})
MAX_RANKED = 512
_SIZES = ("tp", "cp", "dp", "pp", "ep", "etp")


def _kinds_by_set(cand: Mapping[str, Any], world: int) -> dict[tuple[int, ...], set[str]]:
    sizes = ParallelSizes(tp=cand["tp"], pp=cand["pp"], cp=cand["cp"], ep=cand["ep"], etp=cand["etp"],
                          world_size=world)  # fmt: skip
    out: dict[tuple[int, ...], set[str]] = {}
    for kind, groups in megatron_groups(sizes, cand["orders"][0]).items():
        for g in groups:
            out.setdefault(tuple(g), set()).add(kind)
    return out


def _share(sets: list[tuple[int, ...]], kinds: dict[tuple[int, ...], set[str]], wanted: set[str]) -> float:
    return sum(bool(kinds.get(s, set()) & wanted) for s in sets) / len(sets) if sets else 0.0


def most_likely(world: int, candidates: Sequence[Mapping[str, Any]],
                ops: Mapping[tuple[int, ...], Counter] | None) -> dict[str, Any] | None:  # fmt: skip
    """The most likely of the consistent ``candidates`` (each with the six sizes and
    ``orders``) given ``ops`` (per member set, how many entries of each collective its groups
    ran; None: no behaviour known, the defaults alone rank): its sizes, ``score``, the
    ``evidence`` that ranked it, and ``runner_up`` (sizes and score) or ``tied`` (how many
    others score the same: the evidence does not separate them)."""
    if not candidates:
        return None
    # behaviour needs each candidate's groups; beyond a few hundred candidates (a sparse view of a
    # large job) generating them costs more than the ranking is worth: the defaults rank alone
    use_ops = ops if len(candidates) <= MAX_RANKED else None
    live = {s: c for s, c in (use_ops or {}).items() if len(s) > 1 and len(s) < world and sum(c.values())}
    coll = {s: c for s, c in live.items() if not set(c) & ({"all_to_all"} | _P2P)}
    busiest = max(coll, key=lambda s: (sum(coll[s].values()) / len(s), s)) if coll else None
    a2a = sorted(s for s, c in live.items() if c.get("all_to_all"))
    p2p = sorted(s for s, c in live.items() if set(c) <= _P2P)
    scored = []
    for cand in candidates:
        kinds = _kinds_by_set(cand, world) if live else {}
        why: list[str] = []
        score = 0.0
        if busiest is not None and "tp" in kinds.get(busiest, set()):
            score += POINTS["busiest_is_tp"]
            n = sum(coll[busiest].values()) / len(busiest)
            why.append(f"the busiest group {list(busiest)} ({n:.0f} collectives per member) is a tp group")
        if a2a and (share := _share(a2a, kinds, {"ep"})):
            score += POINTS["all_to_all_is_ep"] * share
            why.append(f"{share:.0%} of the {len(a2a)} groups running all-to-all are ep groups")
        if p2p and (share := _share(p2p, kinds, {"pp", "cp"})):
            score += POINTS["p2p_is_pp"] * share
            why.append(f"{share:.0%} of the {len(p2p)} groups running only Send/Recv are pp (or cp) groups")
        if cand["cp"] == 1:
            score += POINTS["cp_default"]
            why.append("cp = 1 (context parallelism is opt-in)")
        if cand["etp"] == 1:
            score += POINTS["etp_default"]
            why.append("etp = 1 (expert tensor parallelism is opt-in)")
        scored.append((score, cand, why))
    scored.sort(key=lambda x: -x[0])  # stable: candidates keep their order among equal scores
    best, cand, why = scored[0]
    out: dict[str, Any] = {k: int(cand[k]) for k in _SIZES} | {"score": round(best, 3), "evidence": why}
    tied = sum(1 for s, _, _ in scored[1:] if s == best)
    if tied:
        out["tied"] = tied
    if ops and use_ops is None:
        out["evidence"].append(f"behaviour not used: {len(candidates)} candidates (more than {MAX_RANKED})")
    rest = [x for x in scored[1:] if x[0] < best]
    if rest:
        out["runner_up"] = {k: int(rest[0][1][k]) for k in _SIZES} | {"score": round(rest[0][0], 3)}
    return out
