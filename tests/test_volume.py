"""Volume validation: thesis table 5.1 from configuration alone, each equation on hand-computed
cases, observed volume conventions on hand-built ops frames, the comparison's discrepancy text,
and theory vs emulator on the thesis configurations and on an analysed emulated run."""

from __future__ import annotations

import functools
import math

import pandas as pd
import pyarrow.parquet as pq
import pytest

from nccltrace.analyze import analyze_run, resolve_settings
from nccltrace.core.tables import read_table
from nccltrace.emulator.layout import layout_of
from nccltrace.emulator.run import emulate_run
from nccltrace.emulator.schedule import RankProgram
from nccltrace.emulator.thesis import thesis_config
from nccltrace.metrics.volume import (
    VOLUME_SCHEMA,
    call_volumes,
    campaign_volume_validation,
    observed_volume,
    theoretical_volume,
    thesis_observed_bytes,
    volume_validation,
    volume_validation_of_file,
    write_volume_validation,
)

GB = 1e9


def _settings(label: str, **overrides) -> dict:
    """A thesis run's settings as the flat mapping of a run.yaml ``config:`` block."""
    return thesis_config(label, **overrides).to_dict()


def _total(theory: pd.DataFrame, definition: str, role: str = "all") -> float:
    t = theory[(theory["definition"] == definition) & (theory["role"] == role)]
    return float(t["per_run_bytes"].sum())


# --------------------------------------------------------------------------- thesis table 5.1


@pytest.mark.parametrize(
    "label, definition, role, printed",
    [
        ("DP=4", "wire", "all", 1.51),
        ("PP=4", "payload", "first", 1.34),
        ("PP=4", "payload", "last", 1.34),
        ("PP=4", "payload", "middle", 2.68),
        ("TP=4 (no SP)", "wire", "all", 8.05),
        ("TP=4 + SP", "wire", "all", 8.05),
        ("EP=4, alltoall dispatcher", "wire", "all", 3.15),
    ],
)
def test_table_5_1_theory_is_reproduced_from_configuration(label, definition, role, printed):
    theory = theoretical_volume(_settings(label), assumptions="thesis-table-5.1")
    assert round(_total(theory, definition, role) / GB, 2) == printed


def test_table_5_1_decomposes_as_the_thesis_computes_it():
    # DP: eq. 5.3 with P from eq. 5.2 as printed (50,391,121), beta 2, n_DP 4, 10 iterations
    dp = theoretical_volume(_settings("DP=4"), assumptions="thesis-table-5.1")
    p = 12 * 16 * 512**2 * (1 + 1 / 6144 + 51281 / 50331648)
    assert p == pytest.approx(50_391_121)
    assert _total(dp, "wire") == pytest.approx(2 * 3 / 4 * p * 2 * 10)
    # PP: eq. 5.4 b s h beta = 4,194,304 B, 16 microbatches, both directions, 1 or 2 boundaries
    pp = theoretical_volume(_settings("PP=4"), assumptions="thesis-table-5.1")
    assert _total(pp, "payload", "first") == 4 * 1024 * 512 * 2 * 2 * 16 * 10
    assert _total(pp, "payload", "middle") == 2 * _total(pp, "payload", "first")
    # TP: eq. 5.5 with the text's 4 microbatches (Megatron runs 16 with dp = 1)
    tp = theoretical_volume(_settings("TP=4 (no SP)"), assumptions="thesis-table-5.1")
    assert _total(tp, "wire") == pytest.approx(8 * 8 * 4 * 1024 * 512 * 3 / 4 * 2 * 4 * 10)
    assert "Megatron runs 16" in tp["notes"].iloc[0]
    # EP: eq. 5.6 per rank (top-1, 4 MoE layers) + 12/16 of the DP value
    ep = theoretical_volume(_settings("EP=4, alltoall dispatcher"), assumptions="thesis-table-5.1")
    a2a = ep[(ep["parallelism"] == "ep") & (ep["definition"] == "wire")]["per_run_bytes"].sum()
    assert a2a == pytest.approx(4 * 64 * 1024 * 1 * 512 * 3 / 4 * 2 * 4 / 4 * 10)
    nonexpert = ep[(ep["parallelism"] == "dp") & (ep["definition"] == "wire")]["per_run_bytes"].sum()
    assert nonexpert == pytest.approx(2 * 3 / 4 * p * 2 * 12 / 16 * 10)


def test_topk_mismatch_between_text_and_launch_is_flagged_both_ways():
    s = _settings("EP=4, alltoall dispatcher")
    assert s["moe_router_topk"] == 2  # what the launch script passed
    run = theoretical_volume(s)
    ep_notes = " ".join(run[run["parallelism"] == "ep"]["notes"])
    assert "top-k = 2" in ep_notes and "assumes top-1" in ep_notes
    thesis = theoretical_volume(s, assumptions="thesis-table-5.1")
    tnotes = " ".join(thesis[thesis["parallelism"] == "ep"]["notes"])
    assert "run settings say top-k = 2" in tnotes and "4x this" in tnotes  # top-2 and 8 MoE layers, not 4
    # the run's top-k doubles the token volume: 8 MoE layers x top-2 vs the text's 4 x top-1
    assert _total(run, "wire") > _total(thesis, "wire")
    ep_run = run[(run["parallelism"] == "ep") & (run["definition"] == "wire")]["per_run_bytes"].sum()
    ep_thesis = thesis[(thesis["parallelism"] == "ep") & (thesis["definition"] == "wire")]["per_run_bytes"].sum()
    assert ep_run == pytest.approx(4 * ep_thesis)
    top1 = theoretical_volume({**s, "moe_router_topk": 1})
    assert "assumes top-1" not in " ".join(top1["notes"])
    top1_ep = top1[(top1["parallelism"] == "ep") & (top1["definition"] == "wire")]["per_run_bytes"].sum()
    assert top1_ep == pytest.approx(ep_run / 2)


def test_unknown_assumptions_are_rejected():
    with pytest.raises(ValueError, match="thesis-table-5.1"):
        theoretical_volume(_settings("DP=4"), assumptions="paper")


# --------------------------------------------------------------------------- equations, small cases

SMALL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256, "vocab_size": 1000,
         "seq_length": 128, "micro_batch_size": 2, "global_batch_size": 8, "iterations": 3, "nodes": 1,
         "gpus_per_node": 4, "precision": "fp16"}  # fmt: skip
# OSU eq. 1 terms: 2 x (4h^2 + 2 h ffn + 8h) + V_pad h (tied, V 1000 -> 1024) + s h + 2h
P_SMALL = 2 * (4 * 64**2 + 2 * 64 * 256 + 8 * 64) + 1024 * 64 + 128 * 64 + 2 * 64


def _comp(theory: pd.DataFrame, definition: str, **where) -> pd.DataFrame:
    t = theory[theory["definition"] == definition]
    for k, v in where.items():
        t = t[t[k] == v]
    return t


def test_dp_allreduce_eq_5_3_and_zero_osu_eq_2_3():
    assert P_SMALL == 173_184
    ddp = theoretical_volume(SMALL)  # dp = 4
    assert _total(ddp, "wire") == pytest.approx(2 * 3 / 4 * P_SMALL * 2 * 3)
    assert _total(ddp, "payload") == pytest.approx(P_SMALL * 2 * 3)
    assert ddp["source"].str.contains("eq. 5.3").all()
    # distributed optimizer (ZeRO-1/2): reduce-scatter fp32 grads (bf16) + all-gather bf16 params
    zero = theoretical_volume({**SMALL, "distributed_optimizer": True, "precision": "bf16"})
    rs = _comp(zero, "wire", op="ReduceScatter")["per_run_bytes"].sum()
    ag = _comp(zero, "wire", op="AllGather")["per_run_bytes"].sum()
    assert rs == pytest.approx(3 / 4 * P_SMALL * 4 * 3)
    assert ag == pytest.approx(3 / 4 * P_SMALL * 2 * 3)
    assert _total(zero, "payload") == pytest.approx(P_SMALL / 4 * (4 + 2) * 3)
    # fp16 overflow iterations skip the param all-gather when the settings say so
    skipped = theoretical_volume({**SMALL, "distributed_optimizer": True, "fp16_overflow_iterations": 2})
    ag1 = _comp(skipped, "wire", op="AllGather")
    assert ag1["per_run_bytes"].sum() == pytest.approx(3 / 4 * P_SMALL * 2 * 1)
    assert "1 of 3 iterations step" in ag1["notes"].iloc[0]
    # ZeRO-3: 3 P (d-1)/d (OSU eq. 3)
    z3 = theoretical_volume({**SMALL, "zero_stage": 3})
    assert _total(z3, "wire") == pytest.approx(3 * 3 / 4 * P_SMALL * 2 * 3)
    # no data parallelism, no DP volume
    assert theoretical_volume({**SMALL, "gpus_per_node": 1}).empty


def test_tp_eq_5_5_and_osu_eq_5_with_recomputation_and_sp():
    s = {**SMALL, "tp": 4}  # dp = 1 -> 4 microbatches per iteration
    bsh = 2 * 128 * 64 * 2  # b s h beta
    m, it = 4, 3
    plain = theoretical_volume(s)
    layers = _comp(plain, "wire", component="layer activations (forward + backward)")["per_run_bytes"].sum()
    assert layers == pytest.approx(2 * 8 * bsh * 3 / 4 * m * it)  # thesis eq. 5.5 = L 8 b s h (t-1)/t beta
    # OSU eq. 5 with full recomputation: (12 L + 2) b s h (t-1)/t per microbatch
    full = theoretical_volume({**s, "recompute": "full"})
    assert _total(full, "wire") == pytest.approx((12 * 2 + 2) * bsh * 3 / 4 * m * it)
    sel = theoretical_volume({**s, "recompute": "selective"})
    assert _total(sel, "wire") == _total(plain, "wire") == pytest.approx((8 * 2 + 2) * bsh * 3 / 4 * m * it)
    assert "selective recomputation" in " ".join(sel["notes"])
    # SP: all-gather + reduce-scatter of the shard instead of each all-reduce, same wire volume
    sp = theoretical_volume({**s, "sequence_parallel": True})
    assert _total(sp, "wire") == pytest.approx(_total(plain, "wire"))
    assert _total(sp, "payload") == pytest.approx((8 * 2 + 2) * bsh / 4 * m * it)
    assert set(_comp(sp, "wire")["op"]) == {"AllGather+ReduceScatter"}


def test_megatron_argument_names_give_the_same_theory_as_the_short_names():
    short = theoretical_volume({**SMALL, "tp": 4})
    megatron = theoretical_volume({**{k: v for k, v in SMALL.items() if k != "tp"}, "tensor_model_parallel_size": 4})
    assert _total(megatron, "wire") == pytest.approx(_total(short, "wire")) and _total(short, "wire") > 0


def test_pp_eq_5_4_edges_middles_and_vpp():
    s = {**SMALL, "num_layers": 8, "pp": 4, "global_batch_size": 16}  # dp = 1, 8 microbatches
    v, m, it = 2 * 128 * 64 * 2, 8, 3
    t = theoretical_volume(s)
    pp = t[t["parallelism"] == "pp"]
    for role, nb in (("first", 1), ("middle", 2), ("last", 1)):
        assert _comp(pp, "wire", role=role)["per_run_bytes"].sum() == pytest.approx(nb * m * v * it)
        assert _comp(pp, "payload", role=role)["per_run_bytes"].sum() == pytest.approx(2 * nb * m * v * it)
    # OSU eq. 4: 2 b s h (p - 1) per microbatch summed over the stages (two middle stages)
    wire = _comp(pp, "wire")
    stages = wire.groupby("role")["per_run_bytes"].sum() * pd.Series({"first": 1, "middle": 2, "last": 1})
    assert stages.sum() == pytest.approx(2 * v * (4 - 1) * m * it)
    # interleaved: pp*vpp - 1 = 7 virtual boundaries, 3 on edge stages and 4 on middle ones
    vpp = theoretical_volume({**s, "vpp": 2})
    vp = vpp[vpp["parallelism"] == "pp"]
    assert _comp(vp, "wire", role="first")["per_run_bytes"].sum() == pytest.approx(3 * m * v * it)
    assert _comp(vp, "wire", role="middle")["per_run_bytes"].sum() == pytest.approx(4 * m * v * it)
    # TP without SP: Megatron-core sends the full tensor (eq. 2.8); with SP the shard (eq. 2.9)
    tp = theoretical_volume({**s, "gpus_per_node": 8, "tp": 2})
    assert _comp(tp[tp["parallelism"] == "pp"], "wire", role="first")["per_run_bytes"].sum() == pytest.approx(m * v * it)
    tsp = theoretical_volume({**s, "gpus_per_node": 8, "tp": 2, "sequence_parallel": True})
    first = _comp(tsp[tsp["parallelism"] == "pp"], "wire", role="first")
    assert first["per_run_bytes"].sum() == pytest.approx(m * v / 2 * it)
    assert first["source"].str.contains("2.9").all()


def test_ep_eq_2_11_alltoall_and_allgather_dispatcher():
    s = {**SMALL, "num_layers": 4, "num_experts": 4, "ep": 4, "moe_layer_freq": 2, "moe_router_topk": 2,
         "precision": "bf16"}  # fmt: skip
    tok, m, it, h, n_moe = 2 * 128, 1, 3, 64, 2  # dp = 4 -> 1 microbatch; layers 0 and 2 are MoE
    t = theoretical_volume(s)
    ep = _comp(t, "wire", parallelism="ep")
    assert ep["per_run_bytes"].sum() == pytest.approx(4 * tok * 2 * h * 3 / 4 * 2 * n_moe * m * it)
    # payload: Send and Recv of every block, the self-copy included
    assert _comp(t, "payload", parallelism="ep")["per_run_bytes"].sum() == pytest.approx(
        2 * 4 * tok * 2 * h * 2 * n_moe * m * it)
    ag = theoretical_volume({**s, "moe_token_dispatcher": "allgather"})
    age = _comp(ag, "wire", parallelism="ep")
    assert age["per_run_bytes"].sum() == pytest.approx(4 * (4 - 1) * tok * h * 2 * n_moe * m * it)  # top-k free
    assert "derived" in age["source"].iloc[0]
    # expert gradients are reduced over expert-dp (world / (etp ep pp) = 1 here: none)
    assert not t["component"].str.contains("expert").any()


# --------------------------------------------------------------------------- observed conventions


def _ops(rows: list[tuple]) -> pd.DataFrame:
    cols = ["global_rank", "op", "nranks", "bytes", "parallelism", "status", "duplicate_of", "root", "rank_in_comm"]
    return pd.DataFrame(rows, columns=cols).astype({"duplicate_of": "Int64"})


HAND = _ops([
    (0, "AllReduce", 4, 1000, "dp", "matched", None, 0, 0),
    (0, "AllReduce", 4, 1000, "dp", "matched", 1, 0, 0),  # duplicate line: excluded
    (0, "AllGather", 4, 100, "dp", "unmatched", None, 0, 0),  # unmatched: still counted
    (0, "ReduceScatter", 4, 100, "dp", "matched", None, 0, 0),
    (0, "Broadcast", 4, 40, "tp", "matched", None, 0, 0),
    (0, "Send", 2, 50, "pp", "matched", None, 1, 0),
    (0, "Recv", 2, 50, "pp", "matched", None, 1, 0),
    (0, "Send", 4, 70, "ep", "matched", None, 0, 0),  # to itself
    (0, "AllReduce", 1, 999, "tp", "unmatched", None, 0, 0),  # single-rank communicator
    (1, "AllReduce", 4, 1000, "dp", "matched", None, 0, 1),
])  # fmt: skip


def test_call_volumes_follow_the_ring_conventions():
    v = call_volumes(HAND)
    assert v["payload"].tolist() == [1000, 1000, 100, 100, 40, 50, 50, 70, 0, 1000]
    # AllReduce 2(n-1)/n S; AllGather/ReduceScatter (n-1)/n x (bytes x n); Broadcast (n-1)/n S;
    # Send S (0 to itself); Recv 0; single-rank 0
    assert v["wire"].tolist() == [1500, 1500, 300, 300, 30, 50, 0, 0, 0, 1500]
    # message_bytes (nccl-tests S) is used when present
    with_msg = HAND.assign(message_bytes=HAND["bytes"] * HAND["nranks"].where(HAND["op"].isin(
        ["AllGather", "ReduceScatter"]), 1))  # fmt: skip
    assert call_volumes(with_msg)["wire"].tolist() == v["wire"].tolist()


def test_observed_volume_excludes_duplicates_keeps_unmatched_and_zeroes_single_rank():
    s = {"tp": 1, "pp": 1, "world_size": 2, "iterations": 2}
    obs = observed_volume(HAND, s)
    wire = obs[obs["definition"] == "wire"].set_index("component")
    # two ranks: rank 0 one AllReduce (the duplicate dropped), rank 1 one
    assert wire.at["AllReduce on dp", "per_run_bytes"] == 1500
    assert wire.at["AllReduce on dp", "calls_per_iteration"] == 0.5
    assert wire.at["AllGather on dp", "per_run_bytes"] == 300 / 2
    assert wire.at["AllGather on dp", "min_rank_bytes"] == 0  # rank 1 has none
    assert wire.at["Recv on pp", "per_run_bytes"] == 0
    pay = obs[obs["definition"] == "payload"].set_index("component")
    assert pay.at["Recv on pp", "per_run_bytes"] == 25
    single = pay.loc["AllReduce on tp (single-rank)"]
    assert single["per_run_bytes"] == 0 and "999 B" in single["notes"]
    assert obs.groupby("definition")["per_run_bytes"].sum().to_dict() == {
        "payload": (1000 + 100 + 100 + 40 + 50 + 50 + 70 + 1000) / 2, "wire": (1500 + 300 + 300 + 30 + 50 + 1500) / 2}


def test_observed_roles_follow_the_pipeline_stage_of_the_global_rank():
    ops = _ops([(r, "Send", 2, 10 * (r + 1), "pp", "matched", None, 1, 0) for r in range(8)])
    obs = observed_volume(ops, {"pp": 4, "world_size": 8})  # stage = rank // 2
    wire = obs[obs["definition"] == "wire"].set_index("role")["per_run_bytes"]
    assert wire.to_dict() == {"first": 15.0, "last": 75.0, "middle": 45.0}


# --------------------------------------------------------------------------- comparison


def _dp_run_ops(settings: dict, extra: list[tuple] = ()) -> pd.DataFrame:
    """Per rank exactly the gradient all-reduces the theory predicts, plus ``extra`` rows."""
    theory = theoretical_volume(settings)
    grad = theory[(theory["definition"] == "payload") & (theory["op"] == "AllReduce")]
    size = float(grad["bytes_per_call"].iloc[0])
    rows = [(r, "AllReduce", 4, size, "dp-cp", "matched", None, 0, r) for r in range(4)
            for _ in range(SMALL["iterations"])]  # fmt: skip
    return _ops(rows + list(extra))


def test_comparison_names_the_dominant_discrepancy():
    extra = [(r, "AllReduce", 4, 4, "world", "unmatched", None, 0, r) for r in range(4) for _ in range(20)]
    table = volume_validation(SMALL, _dp_run_ops(SMALL, extra), run="small")
    assert list(table.columns) == VOLUME_SCHEMA.names
    row = table.set_index(["parallelism", "definition"])
    assert row.at[("dp", "wire"), "ratio"] == pytest.approx(1.0)
    total = row.loc[("total", "wire")]
    assert total["observed_bytes"] - total["theory_bytes"] == pytest.approx(20 * 4 * 1.5)
    assert total["dominant_discrepancy"].startswith("+20 AllReduce of 4 B on world")
    assert total["dominant_discrepancy_bytes"] == pytest.approx(120)
    assert row.at[("other", "wire"), "theory_bytes"] == 0 and pd.isna(row.at[("other", "wire"), "ratio"])
    assert (table["run"] == "small").all()


def test_comparison_names_a_predicted_call_missing_from_the_log():
    s = {**SMALL, "distributed_optimizer": True}
    theory = theoretical_volume(s)
    rs = theory[(theory["definition"] == "payload") & (theory["op"] == "ReduceScatter")]
    rows = [(r, "ReduceScatter", 4, float(rs["bytes_per_call"].iloc[0]), "dp-cp", "matched", None, 0, r)
            for r in range(4) for _ in range(3)]  # fmt: skip
    row = volume_validation(s, _ops(rows)).set_index(["parallelism", "definition"]).loc[("dp", "wire")]
    assert row["ratio"] == pytest.approx(0.5)
    assert row["dominant_discrepancy"].startswith("-3 AllGather")
    assert "loss-scale overflow" in row["dominant_discrepancy"]


def test_write_and_campaign(tmp_path):
    a = volume_validation(SMALL, _dp_run_ops(SMALL))
    b = volume_validation({**SMALL, "distributed_optimizer": True}, _dp_run_ops(SMALL))
    camp = campaign_volume_validation({"a": a, "b": b})
    assert camp["run"].tolist() == ["a"] * len(a) + ["b"] * len(b)
    paths = write_volume_validation(camp, tmp_path / "volume")
    back = pq.read_table(paths["parquet"])
    assert back.schema.names == VOLUME_SCHEMA.names and back.num_rows == len(camp)
    assert back.schema.field("theory_bytes").metadata[b"unit"] == b"B"
    csv = pd.read_csv(paths["csv"])
    assert len(csv) == len(camp) and list(csv.columns) == VOLUME_SCHEMA.names
    assert sorted(p.name for p in (tmp_path / "volume").iterdir()) == ["volume_validation.csv",
                                                                         "volume_validation.parquet"]


# --------------------------------------------------------------------------- theory vs emulator


@functools.cache
def _thesis_run(label: str) -> tuple[dict, pd.DataFrame]:
    """Settings and program ops of an emulated thesis run (single-rank calls included, as logged)."""
    cfg = thesis_config(label, imperfections={"single_rank_comm_ops": -1})
    return cfg.to_dict(), _program_ops(cfg)


def _program_ops(cfg) -> pd.DataFrame:
    """Every call each rank of an emulated run issues (the emulator's schedule), as ops rows."""
    layout = layout_of(cfg)
    rows = [(r, o.op, o.nbytes, o.comm.size, o.comm.kind.removeprefix("p2p:"), o.root, o.comm.rank_of(r))
            for r in range(cfg.world_size) for o in RankProgram(cfg, layout, r).ops()]  # fmt: skip
    return pd.DataFrame(rows, columns=["global_rank", "op", "bytes", "nranks", "parallelism", "root", "rank_in_comm"])


# (thesis run, kind, role, wire ratio bounds): the tolerances of docs/volume.md
AGREEMENT = [
    ("DP=4", "dp", "all", 0.99, 1.01),
    ("PP=4", "pp", "first", 1 - 1e-9, 1 + 1e-9),
    ("PP=4", "pp", "middle", 1 - 1e-9, 1 + 1e-9),
    ("PP=4, VPP=2", "pp", "middle", 1 - 1e-9, 1 + 1e-9),
    ("TP=4 (no SP)", "tp", "all", 1.0, 1.1),
    ("TP=4 + SP", "tp", "all", 1.2, 1.45),
    ("EP=4, alltoall dispatcher", "ep", "all", 0.99, 1.01),
    ("EP=4, alltoall dispatcher", "dp", "all", 0.99, 1.01),
]


@pytest.mark.parametrize("label, kind, role, lo, hi", AGREEMENT)
def test_theory_agrees_with_the_emulated_thesis_runs(label, kind, role, lo, hi):
    settings, ops = _thesis_run(label)
    table = volume_validation(settings, ops)
    row = table.set_index(["parallelism", "role", "definition"]).loc[(kind, role, "wire")]
    assert lo <= row["ratio"] <= hi, row["dominant_discrepancy"]
    if label == "TP=4 + SP":  # the backward input re-gather no equation has
        assert row["dominant_discrepancy"].startswith("+2880 AllGather of 1 MiB on tp")


def test_thesis_observed_column_is_payload_without_recv_in_gib():
    expected = {"DP=4": [1.59] * 4, "PP=4": [2.5, 1.5, 1.5, 2.5], "TP=4 (no SP)": [22.15] * 4}
    for label, gib in expected.items():
        got = thesis_observed_bytes(_thesis_run(label)[1]) / 2**30
        digits = 1 if label == "PP=4" else 2
        assert [round(x, digits) for x in got] == gib, label


# --------------------------------------------------------------------------- end to end

E2E = {"model": "tiny", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 256,
       "vocab_size": 1000, "micro_batch_size": 2, "global_batch_size": 16, "iterations": 2, "nodes": 2,
       "gpus_per_node": 4, "tp": 2, "pp": 2, "precision": "bf16", "seed": 3, "compute_kernels": False,
       "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1}}  # fmt: skip


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    base = tmp_path_factory.mktemp("volume")
    emulate_run(E2E, base / "raw")
    analyze_run(base / "raw", base / "out", progress=False)
    settings = resolve_settings(base / "raw" / "run.yaml", None)
    return settings, read_table(base / "out" / "ops" / "ops.parquet"), base / "out" / "ops" / "ops.parquet"


def test_end_to_end_on_an_analysed_emulated_run(analysed, tmp_path):
    settings, ops, _ = analysed
    table = volume_validation(settings, ops)
    wire = table[table["definition"] == "wire"].set_index(["parallelism", "role"])
    assert set(table["role"]) == {"first", "last"} and (table["ranks"] == 4).all()
    for role in ("first", "last"):
        assert wire.at[("pp", role), "ratio"] == pytest.approx(1.0, abs=1e-9)
        assert wire.at[("dp", role), "ratio"] == pytest.approx(1.0, abs=0.02)
        assert 1.0 <= wire.at[("tp", role), "ratio"] <= 1.25
    # pp = 2: the embedding sync shares the pipeline group's ranks; it is not counted as pipeline
    assert "embd" in wire.at[("other", "first"), "dominant_discrepancy"]
    assert math.isclose(wire.at[("total", "first"), "observed_bytes"],
                        wire.xs("first", level="role").drop("total")["observed_bytes"].sum())  # fmt: skip
    obs = observed_volume(ops, settings)
    per_kind = obs[obs["definition"] == "wire"].groupby(["parallelism", "role"])["per_run_bytes"].sum()
    assert per_kind[("tp", "last")] == pytest.approx(wire.at[("tp", "last"), "observed_bytes"])
    paths = write_volume_validation(table, tmp_path)
    assert pq.read_table(paths["parquet"]).num_rows == len(table)


def test_volume_of_the_ops_file_read_in_batches_equals_the_whole_table_in_memory(analysed):
    settings, ops, path = analysed
    whole = volume_validation(settings, ops, run="r")
    # batches far smaller than a process's rows: every rank's calls are split over several parts
    for batch_rows in (97, 1 << 20):
        streamed = volume_validation_of_file(settings, path, run="r", batch_rows=batch_rows)
        pd.testing.assert_frame_equal(streamed, whole, check_exact=False, rtol=1e-12)
