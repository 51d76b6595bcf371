"""The thesis's 4-GPU experiment configurations and its observed operation counts.

They pin the emulator to what the thesis measured: the configurations of its section 5.2 and
appendix A.3 and the counts of sections 4.1.1 and 5.3, which are nsys kernel counts, as
:func:`schedule.count_kernels` reports them. Where the thesis leaves a model size unstated it is
inferred from the counts. Sources and the comparison: ``docs/emulator.md`` section 5 and its
Module notes.
"""

from __future__ import annotations

from nccltrace.emulator.config import EmulatorConfig
from nccltrace.emulator.schedule import count_kernels

__all__ = ["THESIS_RUNS", "THESIS_COUNTS", "thesis_config", "comparison_table", "THESIS_TABLE_4_1", "THESIS_TABLE_4_2"]

_DENSE: dict = {"name": "dense", "hardware": "a100"}
_MOE: dict = {"name": "dense_moe", "num_experts": 4, "moe_layer_freq": 2, "moe_router_topk": 2,
              "precision": "bf16", "recompute": "selective", "hardware": "a100"}  # fmt: skip
_TP_MODEL: dict = {"num_layers": 8, "num_attention_heads": 4}

THESIS_RUNS: dict[str, dict] = {
    "DP=4": {**_DENSE},
    "DP=4 + distributed optimizer": {**_DENSE, "distributed_optimizer": True},
    "PP=4": {**_DENSE, "pp": 4},
    "PP=4, VPP=2": {**_DENSE, "pp": 4, "vpp": 2},
    "TP=4 (no SP)": {**_DENSE, **_TP_MODEL, "tp": 4},
    "TP=4 + SP": {**_DENSE, **_TP_MODEL, "tp": 4, "sequence_parallel": True},
    "EP=4, alltoall dispatcher": {**_MOE, "ep": 4},
    "EP=4, allgather dispatcher": {**_MOE, "ep": 4, "moe_token_dispatcher": "allgather"},
}

# Chapter 5 counts (10 iterations, all 4 ranks): figures 5.4, 5.7, 5.11, 5.15, 5.17, 5.19, 5.23, 5.25.
THESIS_COUNTS: dict[str, dict[str, int]] = {
    "DP=4": {"AllReduce": 220, "AllGather": 84, "Broadcast": 4},
    "DP=4 + distributed optimizer": {"AllReduce": 220, "AllGather": 84, "ReduceScatter": 40, "Broadcast": 4},
    "PP=4": {"SendRecv": 1080, "AllReduce": 322, "AllGather": 84, "Broadcast": 4},
    "PP=4, VPP=2": {"SendRecv": 4480, "AllReduce": 334, "AllGather": 84, "Broadcast": 8},
    "TP=4 (no SP)": {"AllReduce": 23980, "Broadcast": 3204, "AllGather": 84},
    "TP=4 + SP": {"AllGather": 32724, "ReduceScatter": 21120, "Broadcast": 3204, "AllReduce": 2900},
    "EP=4, alltoall dispatcher": {"SendRecv": 7680, "AllGather": 1364, "AllReduce": 260, "Broadcast": 4},
    "EP=4, allgather dispatcher": {"AllGather": 5204, "ReduceScatter": 3840, "AllReduce": 260, "Broadcast": 4},
}

# Table 4.1 (TP=2, PP=2): per rank, (log count, nsys count); ranks 1 and 3 (1-based) had doubled
# log lines. Model inferred from the counts: 4 layers, micro batch 2 (32 microbatches).
THESIS_TABLE_4_1: dict = {
    "config": {**_DENSE, "tp": 2, "pp": 2, "num_layers": 4, "micro_batch_size": 2},
    "ranks": {  # 0-based rank: {op: (log, nsys)}
        0: {"AllGather": (42, 21), "AllReduce": (5942, 2966), "Broadcast": (1922, 961), "Send": (320, 0),
            "Recv": (320, 0), "SendRecv": (0, 330)},
        1: {"AllGather": (21, 21), "AllReduce": (2987, 2966), "Broadcast": (961, 961), "Send": (320, 0),
            "Recv": (320, 0), "SendRecv": (0, 330)},
        2: {"AllGather": (21, 21), "AllReduce": (7786, 3926), "Broadcast": (1921, 961), "Send": (320, 0),
            "Recv": (320, 0), "SendRecv": (0, 330)},
        3: {"AllGather": (21, 21), "AllReduce": (3946, 3926), "Broadcast": (961, 961), "Send": (320, 0),
            "Recv": (320, 0), "SendRecv": (0, 330)},
    },
}  # fmt: skip

# Table 4.2 (TP=4): per rank (log, nsys); rank 1 (1-based) had doubled log lines. SP was on
# (ReduceScatter present); the counts imply a 4-layer model.
THESIS_TABLE_4_2: dict = {
    "config": {**_DENSE, "tp": 4, "num_layers": 4, "num_attention_heads": 4, "sequence_parallel": True},
    "ranks": {
        0: {"AllGather": (8682, 4341), "AllReduce": (1470, 725), "Broadcast": (1602, 801), "ReduceScatter": (5440, 2720)},
        1: {"AllGather": (4341, 4341), "AllReduce": (745, 725), "Broadcast": (801, 801), "ReduceScatter": (2720, 2720)},
        2: {"AllGather": (4341, 4341), "AllReduce": (745, 725), "Broadcast": (801, 801), "ReduceScatter": (2720, 2720)},
        3: {"AllGather": (4341, 4341), "AllReduce": (745, 725), "Broadcast": (801, 801), "ReduceScatter": (2720, 2720)},
    },
}  # fmt: skip


def thesis_config(label: str, **overrides) -> EmulatorConfig:
    """The emulator configuration of one thesis run (see :data:`THESIS_RUNS`)."""
    return EmulatorConfig.from_dict({**THESIS_RUNS[label], **overrides})


def comparison_table() -> tuple[list[dict], str]:
    """Emulated vs thesis kernel counts for every thesis run: (rows, markdown table)."""
    rows = []
    for label, counts in THESIS_COUNTS.items():
        cfg = thesis_config(label)
        emu = count_kernels(cfg)["kernels"]
        for op in sorted(set(counts) | set(emu)):
            rows.append({"run": label, "run_id": cfg.run_id, "op": op, "thesis": counts.get(op, 0),
                         "emulated": emu.get(op, 0)})  # fmt: skip
    lines = ["| run | op | thesis | emulated | diff |", "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['op']} | {r['thesis']} | {r['emulated']} | {r['emulated'] - r['thesis']:+d} |")
    return rows, "\n".join(lines)
