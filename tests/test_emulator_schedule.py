"""Per-rank NCCL schedule: thesis operation counts, cross-rank consistency, Megatron schedule facts."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import pytest

from nccltrace.emulator.config import EmulatorConfig
from nccltrace.emulator.layout import layout_of
from nccltrace.emulator.params import chunk_params
from nccltrace.emulator.schedule import RankProgram, count_kernels, kernel_op_of_unit
from nccltrace.emulator.thesis import (
    THESIS_COUNTS,
    THESIS_TABLE_4_1,
    THESIS_TABLE_4_2,
    comparison_table,
    thesis_config,
)  # fmt: skip

# Emulated kernel counts derived from Megatron-LM core_r0.13 (docs/emulator.md). They equal the
# thesis's chapter-5 counts exactly; the documented tolerance is therefore 0.
EMULATED_COUNTS = {
    "DP=4": {"AllReduce": 220, "AllGather": 84, "Broadcast": 4},
    "DP=4 + distributed optimizer": {"AllReduce": 220, "AllGather": 84, "ReduceScatter": 40, "Broadcast": 4},
    "PP=4": {"SendRecv": 1080, "AllReduce": 322, "AllGather": 84, "Broadcast": 4},
    "PP=4, VPP=2": {"SendRecv": 4480, "AllReduce": 334, "AllGather": 84, "Broadcast": 8},
    "TP=4 (no SP)": {"AllReduce": 23980, "Broadcast": 3204, "AllGather": 84},
    "TP=4 + SP": {"AllGather": 32724, "ReduceScatter": 21120, "Broadcast": 3204, "AllReduce": 2900},
    "EP=4, alltoall dispatcher": {"SendRecv": 7680, "AllGather": 1364, "AllReduce": 260, "Broadcast": 4},
    "EP=4, allgather dispatcher": {"AllGather": 5204, "ReduceScatter": 3840, "AllReduce": 260, "Broadcast": 4},
}
TOLERANCE = 0


@pytest.mark.parametrize("label", list(THESIS_COUNTS))
def test_thesis_chapter5_kernel_counts(label):
    got = count_kernels(thesis_config(label))["kernels"]
    assert got == EMULATED_COUNTS[label]
    for op, n in THESIS_COUNTS[label].items():
        assert abs(got.get(op, 0) - n) <= TOLERANCE, (label, op, got.get(op), n)


def test_print_thesis_comparison_table(capsys):
    rows, table = comparison_table()
    print("\nEmulated vs thesis chapter 5 (nsys kernel counts, 10 iterations, 4 ranks)\n" + table)
    assert all(r["emulated"] == r["thesis"] for r in rows)
    assert "| PP=4, VPP=2 | SendRecv | 4480 | 4480 | +0 |" in table


def _per_rank(cfg: EmulatorConfig) -> dict[int, tuple[Counter, Counter]]:
    L = layout_of(cfg)
    out = {}
    for r in range(cfg.world_size):
        calls, kernels = Counter(), Counter()
        for u in RankProgram(cfg, L, r).units():
            calls.update(o.op for o in u.ops)
            multi = [o for o in u.ops if o.comm.size > 1]
            if multi:
                kernels[kernel_op_of_unit(multi)] += 1
        out[r] = (calls, kernels)
    return out


@pytest.mark.parametrize("table", [THESIS_TABLE_4_1, THESIS_TABLE_4_2], ids=["table4.1", "table4.2"])
def test_thesis_chapter4_per_rank_log_and_kernel_counts(table):
    """Kernel counts match every rank; log counts match the ranks without doubled lines, with the
    logged-but-kernel-less AllReduces on single-rank communicators (the "+20 AllReduce")."""
    cfg = EmulatorConfig.from_dict({**table["config"], "imperfections": {"single_rank_comm_ops": -1}})
    got = _per_rank(cfg)
    for rank, expected in table["ranks"].items():
        calls, kernels = got[rank]
        for op, (log, nsys) in expected.items():
            assert kernels.get(op, 0) == nsys, (rank, op)
    # ranks without doubled log lines: table 4.2 ranks 1-3 exactly; table 4.1 rank 3 exactly and
    # rank 1 (thesis "rank 2") 11 AllReduce short (documented gap)
    clean = [1, 3] if table is THESIS_TABLE_4_1 else [1, 2, 3]
    for rank in clean:
        calls, _ = got[rank]
        for op, (log, _nsys) in table["ranks"][rank].items():
            if op == "SendRecv":
                continue
            gap = 11 if (table is THESIS_TABLE_4_1 and rank == 1 and op == "AllReduce") else 0
            assert calls.get(op, 0) == log - gap, (rank, op, calls.get(op), log)


def test_one_f_one_b_groups_per_stage():
    """1F1B with pp=4, 16 microbatches: batched p2p groups per stage per iteration."""
    cfg = thesis_config("PP=4", iterations=1)
    L = layout_of(cfg)
    per_stage = []
    for r in range(4):
        per_stage.append(sum(1 for u in RankProgram(cfg, L, r).units() if u.phase.startswith("pp/")))
    assert per_stage == [19, 37, 35, 17]  # 108 per iteration, thesis 5.3.2


def _all_ops(cfg: EmulatorConfig):
    L = layout_of(cfg)
    return L, [o for r in range(cfg.world_size) for o in RankProgram(cfg, L, r).ops()]


@pytest.mark.parametrize(
    "cfg",
    [
        {"nodes": 2, "gpus_per_node": 4, "tp": 2, "pp": 2, "vpp": 2, "num_layers": 8, "sequence_parallel": True,
         "global_batch_size": 16, "micro_batch_size": 2, "iterations": 2},
        {"nodes": 2, "gpus_per_node": 4, "tp": 2, "ep": 2, "num_experts": 4, "precision": "bf16",
         "sequence_parallel": True, "num_layers": 4, "global_batch_size": 16, "iterations": 2,
         "distributed_optimizer": True},
        {"nodes": 1, "gpus_per_node": 8, "cp": 4, "pp": 2, "num_layers": 4, "global_batch_size": 8,
         "micro_batch_size": 1, "iterations": 1, "imperfections": {"single_rank_comm_ops": -1}},
    ],
    ids=["tp2-pp2-vpp2-sp", "tp2-ep2-moe-distopt", "cp4-pp2"],
)
def test_instances_are_consistent_across_ranks(cfg):
    """Every collective instance appears once on every member with identical arguments; every
    Send has exactly one matching Recv (same instance and count) on its peer."""
    cfg = EmulatorConfig.from_dict(cfg)
    L, ops = _all_ops(cfg)
    coll = defaultdict(list)
    sends, recvs = {}, {}
    for o in ops:
        if o.op == "Send":
            assert o.instance not in sends
            sends[o.instance] = o
        elif o.op == "Recv":
            assert o.instance not in recvs
            recvs[o.instance] = o
        else:
            coll[o.instance].append(o)
    for inst, members in coll.items():
        c = members[0].comm
        assert sorted(m.rank for m in members) == list(c.ranks), inst
        assert len({(m.op, m.count, m.dtype, m.redop, m.root, m.comm.uid) for m in members}) == 1
    assert sends.keys() == recvs.keys()
    for inst, s in sends.items():
        r = recvs[inst]
        assert (s.peer, r.peer) == (r.rank, s.rank) and s.count == r.count and s.comm.uid == r.comm.uid
        assert s.root == s.comm.rank_of(r.rank) and r.root == r.comm.rank_of(s.rank)


def test_message_sizes_follow_megatron_shapes():
    cfg = EmulatorConfig.from_dict({"nodes": 2, "tp": 2, "pp": 2, "sequence_parallel": True, "iterations": 1,
                                    "global_batch_size": 8, "micro_batch_size": 2})  # fmt: skip
    L = layout_of(cfg)
    ops = list(RankProgram(cfg, L, 0).ops())
    b, s, h = 2, 1024, 512
    ag = [o for o in ops if o.op == "AllGather" and o.comm.kind == "tp"]
    assert {o.count for o in ag} == {s * b * h // 2}  # per-rank send count with SP
    p2p = [o for o in ops if o.op in ("Send", "Recv")]
    assert {o.count for o in p2p} == {s * b * h // 2} and all(o.dtype == 6 for o in p2p)
    grad = [o for o in ops if o.phase == "grad-sync"]
    assert [o.count for o in grad] == [chunk_params(cfg, 0, 0).dense] and grad[0].dtype == 6
    embd = [o for o in ops if o.phase == "grad-sync/embedding"]
    assert embd[0].count == cfg.padded_vocab_size // 2 * h and embd[0].comm.kind == "embd"
    bcast = [o for o in ops if o.op == "Broadcast" and o.comm.kind == "tp"]
    assert [o.count for o in bcast[:3]] == [b * s, b * s * s, b * s]  # tokens, attention mask, position ids


def test_fp16_overflow_skips_grad_norm_and_param_gather():
    base = {"distributed_optimizer": True, "iterations": 2}
    skipped = count_kernels(EmulatorConfig.from_dict(base))["kernels"]
    stepped = count_kernels(EmulatorConfig.from_dict({**base, "fp16_overflow_iterations": 0}))["kernels"]
    assert stepped["AllGather"] - skipped["AllGather"] == 2 * 4  # param all-gather per rank per iteration
    assert stepped["AllReduce"] - skipped["AllReduce"] == 2 * 4  # grad-norm on the distopt group


def test_single_rank_comm_ops_budget():
    cfg = EmulatorConfig.from_dict({"iterations": 1})
    L = layout_of(cfg)
    assert not any(o.comm.size == 1 for o in RankProgram(cfg, L, 0).ops())
    all_ = [o for o in RankProgram(cfg.replace(imperfections={"single_rank_comm_ops": -1}), L, 0).ops()
            if o.comm.size == 1]  # fmt: skip
    assert len(all_) > 20 and {o.comm.kind for o in all_} >= {"tp", "mp"}
    three = [o for o in RankProgram(cfg.replace(imperfections={"single_rank_comm_ops": 3}), L, 0).ops()
             if o.comm.size == 1]  # fmt: skip
    assert len(three) == 3


def test_program_is_deterministic_and_moe_splits_balance():
    cfg = thesis_config("EP=4, alltoall dispatcher", iterations=1)
    L = layout_of(cfg)
    a = [(o.op, o.count, o.root, o.instance) for o in RankProgram(cfg, L, 2).ops()]
    b = [(o.op, o.count, o.root, o.instance) for o in RankProgram(cfg, L, 2).ops()]
    assert a == b
    _, ops = _all_ops(cfg)
    sent = sum(o.count for o in ops if o.op == "Send")
    recv = sum(o.count for o in ops if o.op == "Recv")
    assert sent == recv > 0
    counts = {o.count for o in ops if o.op == "Send" and o.dtype == 9}
    assert len(counts) > 10  # all-to-all-v: uneven splits


def test_1024_rank_layout_and_schedule_generation_is_fast():
    t0 = time.perf_counter()
    cfg = EmulatorConfig.from_dict({
        "name": "tiny", "nodes": 128, "gpus_per_node": 8, "tp": 8, "pp": 4, "num_layers": 4, "hidden_size": 64,
        "num_attention_heads": 8, "seq_length": 128, "micro_batch_size": 1, "global_batch_size": 128,
        "iterations": 1, "sequence_parallel": True, "vocab_size": 1000,
    })  # fmt: skip
    L = layout_of(cfg)
    n = 0
    per_kind = Counter()
    for r in range(cfg.world_size):
        for o in RankProgram(cfg, L, r).ops():
            n += 1
            per_kind[o.comm.kind] += 1
    assert cfg.world_size == 1024 and cfg.dp == 32 and n > 50_000
    # dp-cp: one grad all-reduce per rank + the loss all-reduce on the 256 last-stage ranks
    assert per_kind["tp"] > 0 and per_kind["pp"] > 0 and per_kind["dp-cp"] == 1024 + 256
    assert time.perf_counter() - t0 < 15
