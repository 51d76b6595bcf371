"""Megatron-LM rank layout (NVIDIA/Megatron-LM core_r0.13, megatron/core/parallel_state.py).

Expected groups are derived by hand from the rank formula of the default order ``tp-cp-ep-dp-pp``:
decoder ``rank = tp + TP*(cp + CP*(dp + DP*pp))``, expert ``rank = etp + ETP*(ep + EP*(edp + EDP*pp))``.
"""

from __future__ import annotations

from nccltrace.emulator.config import EmulatorConfig
from nccltrace.emulator.layout import layout_of
from nccltrace.megatron.groups import orthogonal_groups
from nccltrace.megatron.layout import MegatronLayout


def _ranks(layout: MegatronLayout, kind: str) -> list[list[int]]:
    return [list(g.ranks) for g in layout.by_kind.get(kind, [])]


def test_generate_masked_orthogonal_groups_docstring_example():
    # parallel_state.generate_masked_orthogonal_rank_groups docstring: sizes [tp, dp, pp] = [2, 3, 4],
    # mask dp -> dp_group[0] = [0, 2, 4], dp_group[1] = [1, 3, 5], ..., dp_group[7] = [19, 21, 23].
    groups = orthogonal_groups([2, 3, 4], [False, True, False])
    assert len(groups) == 8
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[2] == [6, 8, 10]
    assert groups[7] == [19, 21, 23]


def test_initialize_model_parallel_docstring_example_tp2_pp4_16gpus():
    # initialize_model_parallel docstring: 16 GPUs, tp=2, pp=4 -> dp groups [g0,g2],[g1,g3],...;
    # tp groups [g0,g1],...; pp groups [g0,g4,g8,g12],[g1,g5,g9,g13],...
    L = layout_of(EmulatorConfig.from_dict({"nodes": 2, "gpus_per_node": 8, "tp": 2, "pp": 4}))
    assert _ranks(L, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert _ranks(L, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert _ranks(L, "pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_tp2_pp2_dp2_all_groups_in_creation_order():
    L = layout_of(EmulatorConfig.from_dict({"nodes": 2, "gpus_per_node": 4, "tp": 2, "pp": 2}))
    assert L.dp == 2
    assert _ranks(L, "world") == [list(range(8))]
    assert _ranks(L, "dp-cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _ranks(L, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _ranks(L, "cp") == [[r] for r in range(8)]
    assert _ranks(L, "mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _ranks(L, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _ranks(L, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _ranks(L, "embd") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _ranks(L, "pos-embd") == [[0], [1], [2], [3]]
    assert _ranks(L, "tp-dp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _ranks(L, "tp-dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _ranks(L, "tp-cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _ranks(L, "ep") == [[r] for r in range(8)]
    assert _ranks(L, "etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _ranks(L, "tp-ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _ranks(L, "tp-ep-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _ranks(L, "edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _ranks(L, "intra-distopt") == [list(range(8))]
    # creation order: world, dp-cp, dp, cp, mp, tp, (pp, embd, pos-embd) per pipeline, tp-dp-cp, tp-dp,
    # tp-cp, expert ep, expert tp, tp-ep, tp-ep-pp, expert dp, distributed-optimizer instance
    kinds = []
    for g in L.groups:
        if not kinds or kinds[-1] != g.kind:
            kinds.append(g.kind)
    assert kinds == ["world", "dp-cp", "dp", "cp", "mp", "tp"] + ["pp", "embd", "pos-embd"] * 4 + [
        "tp-dp-cp", "tp-dp", "tp-cp", "ep", "etp", "tp-ep", "tp-ep-pp", "edp", "intra-distopt"]  # fmt: skip
    assert [g.order for g in L.groups] == list(range(len(L.groups)))


def test_tp2_ep2_pp2_world16_expert_groups():
    cfg = EmulatorConfig.from_dict({"nodes": 2, "gpus_per_node": 8, "tp": 2, "pp": 2, "ep": 2, "num_experts": 4,
                                    "precision": "bf16", "sequence_parallel": True})  # fmt: skip
    L = layout_of(cfg)
    assert (L.dp, L.etp, L.ep, L.edp) == (4, 2, 2, 2)
    assert _ranks(L, "dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert _ranks(L, "pp") == [[r, r + 8] for r in range(8)]
    assert _ranks(L, "embd") == [[r, r + 8] for r in range(8)]
    assert _ranks(L, "mp") == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert _ranks(L, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert _ranks(L, "etp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert _ranks(L, "tp-ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert _ranks(L, "tp-ep-pp") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert _ranks(L, "edp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert _ranks(L, "intra-distopt") == [list(range(16))]
    c = L.coords(13)
    assert (c["tp"], c["dp"], c["pp"], c["etp"], c["ep"], c["edp"]) == (1, 2, 1, 1, 0, 1)
    assert L.group_of("ep", 13).ranks == (13, 15) and L.group_of("ep", 13).rank_of(13) == 0


def test_nodes_local_ranks_pairs_and_stage_representatives():
    L = layout_of(EmulatorConfig.from_dict({"nodes": 4, "gpus_per_node": 4, "tp": 2, "pp": 2}))
    assert [L.node_of(r) for r in (0, 3, 4, 15)] == [0, 0, 1, 3]
    assert [L.local_rank(r) for r in (0, 3, 4, 15)] == [0, 3, 0, 3]
    assert L.nodes_of(L.group_of("pp", 0).ranks) == 2
    assert [L.stage_representative(s) for s in (0, 1)] == [0, 8]
    pp = L.group_of("pp", 2)
    pair = L.pair(pp, 10, 2)
    assert pair.ranks == (2, 10) and pair.rank_of(10) == 1 and pair.size == 2
    assert pair.uid == L.pair(pp, 2, 10).uid and pair.uid not in L.comm_by_uid
    # rank 4 = (tp 0, dp 2, pp 0): first stage, so its embedding group is {first, last stage}.
    assert L.group_of("embd", 4).ranks == (4, 12)
    assert L.stages_of(L.group_of("mp", 0).ranks) == (0, 1)
