"""Summary tables: counts, volumes, size buckets and bandwidth statistics on a hand-built ops table
(every number known), writing (Parquet + CSV, documented units), campaign stacking, and one
emulated run of the thesis's DP=4 configuration whose kernel counts the thesis reports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from nccltrace.cli import main
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.outputs.summary import (
    CAMPAIGN_RUNS_SCHEMA,
    RUN_SCHEMAS,
    campaign_tables,
    config_row,
    run_tables,
    size_bucket,
    write_tables,
)


def _row(**kw) -> dict:
    base = {
        "row_kind": "call", "file": "r0.log", "line": 1, "host": "n0", "pid": 10, "op": "AllReduce", "comm": 1,
        "op_count": 0, "kernel_global_pid": 100, "kernel_correlation_id": None, "kernel_name": None,
        "kernel_start": None, "kernel_end": None, "status": "unmatched", "reason": None, "duplicate_of": None,
        "nranks": 2, "bytes": 0, "message_bytes": 0, "logical_id": 0, "global_rank": 0, "parallelism": "dp",
        "kernel_start_sync": None, "kernel_end_sync": None,
    }  # fmt: skip
    base.update(kw)
    return base


def _kernel(line: int, corr: int, name: str, t: int, dur: int = 100) -> dict:
    return {"line": line, "kernel_correlation_id": corr, "kernel_name": name, "kernel_start": t,
            "kernel_end": t + dur, "kernel_start_sync": t, "kernel_end_sync": t + dur, "status": "matched"}


@pytest.fixture()
def ops() -> pd.DataFrame:
    """Two ranks: 3 AllReduce (one a duplicate line), a fused Send+Recv pair (one kernel), one
    single-rank Broadcast, one call without a logical communicator, one unexplained kernel row."""
    rows = []
    for rank, file, pid in ((0, "r0.log", 10), (1, "r1.log", 11)):
        common = {"file": file, "pid": pid, "global_rank": rank, "kernel_global_pid": 100 + rank}
        rows += [
            _row(**common, **_kernel(1, 1, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1000), bytes=1 << 20,
                 message_bytes=1 << 20),
            _row(**common, **_kernel(2, 2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2000), bytes=(1 << 20) + 1,
                 message_bytes=(1 << 20) + 1),
            _row(**common, **_kernel(3, 3, "ncclDevKernel_SendRecv", 3000), op="Send", parallelism="pp",
                 bytes=4096, message_bytes=4096, logical_id=1),
            _row(**common, **_kernel(4, 3, "ncclDevKernel_SendRecv", 3000), op="Recv", parallelism="pp",
                 bytes=4096, message_bytes=4096, logical_id=1),
            _row(**common, line=5, op="Broadcast", nranks=1, bytes=64, message_bytes=64, parallelism="tp",
                 reason="single_rank_communicator"),
        ]  # fmt: skip
    # rank 1 logged its first AllReduce twice
    rows.append(_row(file="r1.log", pid=11, global_rank=1, line=6, bytes=1 << 20, duplicate_of=1,
                     reason="duplicate_line"))
    # a call on a communicator without init line: no logical id, parallelism unknown, nranks unknown
    rows.append(_row(line=7, op="AllGather", bytes=0, message_bytes=0, nranks=None, logical_id=None,
                     parallelism=None, reason="no_kernel"))
    rows.append(_row(row_kind="kernel", file=None, line=None, op="AllReduce", reason="no_log_line",
                     kernel_correlation_id=9, kernel_name="ncclDevKernel_AllReduce_Sum_f32_RING_LL"))
    df = pd.DataFrame(rows)
    for c in ("line", "pid", "op_count", "kernel_global_pid", "kernel_correlation_id", "kernel_start", "kernel_end",
              "duplicate_of", "bytes", "message_bytes", "kernel_start_sync", "kernel_end_sync"):
        df[c] = df[c].astype("Int64")
    for c in ("nranks", "logical_id", "global_rank"):
        df[c] = df[c].astype("Int32")
    return df


def test_counts_exclude_duplicates_and_single_rank_calls(ops):
    t = run_tables(ops)
    oc = t["op_counts"].set_index(["parallelism", "op"])
    assert oc.loc[("dp", "AllReduce"), "calls"] == 4  # 2 per rank; the duplicate line is not a call
    assert oc.loc[("dp", "AllReduce"), "duplicate_lines"] == 1
    assert oc.loc[("tp", "Broadcast"), "calls"] == 0
    assert oc.loc[("tp", "Broadcast"), "calls_single_rank"] == 2
    assert oc.loc[("tp", "Broadcast"), "bytes_single_rank"] == 128
    assert oc.loc[("unknown", "AllGather"), "calls"] == 1  # unresolved size: counted, not assumed single-rank
    assert oc["share_calls"].sum() == pytest.approx(1.0)
    assert oc.loc[("pp", "Send"), "matched_calls"] == 2
    ov = t["overview"].iloc[0]
    assert (ov["call_lines"], ov["calls"], ov["calls_single_rank"], ov["duplicate_lines"]) == (12, 9, 2, 1)
    assert ov["ranks"] == 2 and ov["hosts"] == 1


def test_fused_p2p_group_is_one_kernel_and_kernel_rows_are_not_counted(ops):
    kc = run_tables(ops)["kernel_counts"].set_index(["parallelism", "kernel_op"])
    assert kc.loc[("pp", "SendRecv"), "kernels"] == 2  # one per rank for its Send+Recv pair
    assert kc.loc[("dp", "AllReduce"), "kernels"] == 4
    assert kc["kernels"].sum() == 6 and kc["share_kernels"].sum() == pytest.approx(1.0)
    assert kc.loc[("dp", "AllReduce"), "kernel_time_ns"] == 400


def test_volumes_are_payload_bytes_summed_over_ranks(ops):
    t = run_tables(ops)
    vo = t["volume_by_op"].set_index("op")
    assert vo.loc["AllReduce", "bytes"] == 2 * ((1 << 20) + (1 << 20) + 1)
    assert vo.loc["Send", "bytes"] == vo.loc["Recv", "bytes"] == 2 * 4096  # both ends count
    assert vo.loc["AllReduce", "bytes_per_rank_mean"] == pytest.approx(vo.loc["AllReduce", "bytes"] / 2)
    assert vo.loc["Broadcast", "bytes"] == 0 and vo.loc["Broadcast", "bytes_single_rank"] == 128
    vp = t["volume_by_parallelism"].set_index("parallelism")
    assert vp.loc["pp", "bytes"] == 4 * 4096 and vp.loc["pp", "bytes_per_rank_max"] == 2 * 4096
    assert vp["bytes"].sum() == vo["bytes"].sum() == t["overview"]["bytes"].iloc[0]
    rv = t["rank_volume"].set_index("global_rank")
    assert rv.loc[1, "duplicate_lines"] == 1 and rv.loc[0, "duplicate_lines"] == 0
    assert rv.loc[0, "bytes"] == (1 << 20) + (1 << 20) + 1 + 2 * 4096
    assert rv["share_bytes"].sum() == pytest.approx(1.0)
    by_op = t["rank_volume_by_op"]
    assert by_op["bytes"].sum() == rv["bytes"].sum()


def test_size_buckets_are_exact_powers_of_two():
    sizes = pd.Series([0, 1, 2, 3, 1023, 1024, 1025, (1 << 20) - 1, 1 << 20, 2**53 + 1, 2**62], dtype="Int64")
    assert size_bucket(sizes).tolist() == [-1, 0, 1, 1, 9, 10, 10, 19, 20, 53, 62]
    assert size_bucket(pd.Series([None], dtype="Int64")).tolist() == [-1]


def test_message_size_table_puts_each_call_in_its_bucket(ops):
    ms = run_tables(ops)["message_sizes"].set_index(["bucket", "op"])
    assert ms.loc[(20, "AllReduce"), "calls"] == 4  # 1 MiB and 1 MiB + 1 share the bucket
    assert ms.loc[(20, "AllReduce"), "bucket_label"] == "1 MiB"
    assert ms.loc[(20, "AllReduce"), "bucket_lo_bytes"] == 1 << 20
    assert ms.loc[(20, "AllReduce"), "bucket_hi_bytes"] == 1 << 21
    assert ms.loc[(12, "Send"), "calls"] == 2
    assert ms.loc[(-1, "AllGather"), "bucket_label"] == "0 B"
    assert ms.loc[(6, "Broadcast"), "calls"] == 0 and ms.loc[(6, "Broadcast"), "calls_single_rank"] == 2


def test_alignment_table_names_every_reason(ops):
    al = run_tables(ops)["alignment"].set_index(["row_kind", "status", "reason"])
    calls = al.loc["call"]
    assert calls.loc[("unmatched", "duplicate_line"), "rows"] == 1
    assert calls.loc[("unmatched", "single_rank_communicator"), "rows"] == 2
    assert calls.loc[("unmatched", "no_kernel"), "rows"] == 1
    assert al.loc["kernel"]["rows"].sum() == 1
    t = run_tables(ops)["alignment"]
    assert t.loc[t["row_kind"] == "call", "share"].sum() == pytest.approx(1.0)
    assert int(t.loc[(t["row_kind"] == "call") & (t["status"] == "matched"), "rows"].sum()) == 8


def _metrics(ops: pd.DataFrame) -> pd.DataFrame:
    calls = ops[(ops["row_kind"] == "call")].reset_index(drop=True)
    n = len(calls)
    return pd.DataFrame({
        "file": calls["file"], "line": calls["line"], "duration_ns": np.full(n, 1000),
        "busbw_gbps": np.arange(1, n + 1, dtype=float), "algbw_gbps": np.arange(1, n + 1, dtype=float) / 2,
        "wait_ns": np.full(n, 250), "transfer_ns": np.full(n, 750), "transfer_busbw_gbps": np.full(n, 9.0),
        "limit_gbps": np.full(n, 80.0), "limit_link": ["NVL 80 GB/s"] * n, "efficiency": np.full(n, 0.5),
        "algorithm": ["RING"] * (n - 1) + ["TREE"], "protocol": ["LL"] * n,
    })  # fmt: skip


def test_bandwidth_statistics_per_communicator_and_size_bucket(ops):
    m = _metrics(ops)
    t = run_tables(ops, op_metrics=m)
    bw = t["bandwidth"]
    assert list(bw.columns) == RUN_SCHEMAS["bandwidth"].names
    ar = bw[(bw["op"] == "AllReduce") & (bw["bucket"] == 20)].iloc[0]
    # busbw of the four countable AllReduce calls (lines 1 and 2 on both ranks)
    keys = ops[(ops["row_kind"] == "call") & ops["duplicate_of"].isna() & (ops["op"] == "AllReduce")]
    vals = m.merge(keys[["file", "line"]], on=["file", "line"])["busbw_gbps"]
    assert ar["calls"] == 4
    assert ar["busbw_median_gbps"] == pytest.approx(vals.median())
    assert ar["busbw_p10_gbps"] == pytest.approx(vals.quantile(0.1))
    assert ar["busbw_p90_gbps"] == pytest.approx(vals.quantile(0.9))
    assert ar["wait_share_median"] == pytest.approx(0.25) and ar["efficiency_median"] == pytest.approx(0.5)
    assert ar["limit_link"] == "NVL 80 GB/s" and ar["algorithm"] == "RING"
    # single-rank calls and duplicate lines have no bandwidth row even when metrics name them
    assert bw["calls"].sum() == 4 + 2 + 2 + 1
    assert "Broadcast" not in set(bw["op"])
    assert t["overview"]["busbw_median_gbps"].iloc[0] == pytest.approx(vals.median())


def test_bandwidth_is_empty_but_typed_without_metrics(ops):
    bw = run_tables(ops)["bandwidth"]
    assert bw.empty and list(bw.columns) == RUN_SCHEMAS["bandwidth"].names
    assert run_tables(ops, op_metrics=_metrics(ops).drop(columns=["busbw_gbps"]))["bandwidth"].empty


def test_volume_validation_passes_through_with_its_own_columns(ops):
    vv = pd.DataFrame({"parallelism": ["dp"], "role": ["all"], "theory_bytes": [1.5e9], "observed_bytes": [1.6e9],
                       "ratio": [1.6 / 1.5], "new_column": ["kept"]})
    t = run_tables(ops, volume=vv)
    assert list(t["volume_validation"].columns) == list(vv.columns)
    assert "volume_validation" not in run_tables(ops)


def test_write_tables_writes_documented_parquet_and_csv_atomically(ops, tmp_path):
    tables = run_tables(ops, op_metrics=_metrics(ops),
                        volume=pd.DataFrame({"parallelism": ["dp"], "observed_bytes": [3.0]}))
    (tmp_path / "op_counts.csv").write_text("stale\n")
    written = write_tables(tables, tmp_path)
    for name in tables:
        assert written[f"{name}.parquet"].exists() and written[f"{name}.csv"].exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"
    schema = pq.read_schema(tmp_path / "volume_by_op.parquet")
    assert schema.field("bytes").metadata[b"unit"] == b"B"
    assert b"not bytes on the wire" in schema.field("bytes").metadata[b"doc"]
    back = read_table(tmp_path / "op_counts.parquet")
    pd.testing.assert_frame_equal(back, tables["op_counts"], check_dtype=False)
    csv = pd.read_csv(tmp_path / "op_counts.csv")
    assert list(csv.columns) == list(tables["op_counts"].columns) and len(csv) == len(tables["op_counts"])
    assert csv["calls"].sum() == tables["op_counts"]["calls"].sum()
    # an integer column with nulls stays integer in the CSV
    rv = pd.read_csv(tmp_path / "rank_volume.csv")
    assert rv["calls"].dtype.kind == "i"


def test_config_row_fills_megatron_defaults_and_dp():
    row = config_row({"model": "dense", "nodes": 2, "gpus_per_node": 4, "tp": 2, "pp": 2})
    assert (row["world_size"], row["dp"], row["ep"], row["vpp"], row["sequence_parallel"]) == (8, 2, 1, 1, False)
    assert row["moe_token_dispatcher"] is None  # meaningless for a dense model
    from_yaml = config_row({"config": {"name": "moe", "nodes": 1, "gpus_per_node": 4, "ep": 4, "num_experts": 4,
                                       "moe_token_dispatcher": "alltoall", "moe_router_topk": 2},
                            "derived": {"dp": 4}})  # fmt: skip
    assert (from_yaml["model"], from_yaml["dp"], from_yaml["moe_router_topk"]) == ("moe", 4, 2)


def test_campaign_tables_stack_runs_and_keep_runs_without_results(ops, tmp_path):
    a = run_tables(ops)
    b = run_tables(ops[ops["global_rank"] == 0])
    settings = {"a": {"model": "dense", "nodes": 1, "gpus_per_node": 2},
                "b": {"model": "dense", "nodes": 1, "gpus_per_node": 2, "distributed_optimizer": True},
                "failed": {"model": "dense", "nodes": 1, "gpus_per_node": 2, "tp": 2}}  # fmt: skip
    camp = campaign_tables({"b": b, "a": a}, settings)
    runs = camp["runs"]
    assert list(runs["run"]) == ["a", "b", "failed"]  # settings order: the campaign's order
    assert list(runs["available"]) == [True, True, False]
    assert runs.set_index("run").loc["failed", "dp"] == 1 and pd.isna(runs.set_index("run").loc["failed", "calls"])
    assert runs.set_index("run").loc["a", "calls"] == a["overview"]["calls"].iloc[0]
    oc = camp["op_counts"]
    assert list(oc.columns) == ["run"] + list(a["op_counts"].columns)
    assert oc[oc["run"] == "b"]["calls"].sum() == b["overview"]["calls"].iloc[0]
    written = write_tables(camp, tmp_path)
    assert pq.read_schema(written["runs.parquet"]).names == CAMPAIGN_RUNS_SCHEMA.names
    assert pq.read_schema(written["op_counts.parquet"]).field("run").metadata[b"doc"]


# --------------------------------------------------------------------------- an emulated run

# The thesis's DP=4 configuration (chapter 5.3.1, 10 iterations), with duplicated log lines on
# rank 1 so that the run also exercises the duplicate handling.
DP4 = {
    "model": "dense", "num_layers": 16, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 1024,
    "micro_batch_size": 4, "global_batch_size": 64, "iterations": 10, "precision": "fp16", "nodes": 1,
    "gpus_per_node": 4, "hardware": "a100", "nccl_version": "2.21.5", "seed": 1,
    "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1,
                      "duplicate_log_lines": {"ranks": [1], "fraction": 0.2}},
}  # fmt: skip


@pytest.fixture(scope="module")
def dp4_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("dp4")
    emulate_run(DP4, base / "raw")
    assert main(["analyze", str(base / "raw"), "-o", str(base), "-q"]) == 0
    return base


def test_emulated_dp4_run_matches_ground_truth_and_thesis_counts(dp4_run):
    ops = read_table(dp4_run / "ops" / "ops.parquet")
    t = run_tables(ops)
    truth = read_table(dp4_run / "raw" / "ground_truth" / "ops.parquet")
    logged = truth[~truth["line_dropped"].astype(bool)]
    multi = logged[logged["nranks"] > 1]
    assert int(t["overview"]["duplicate_lines"].iloc[0]) > 0  # the run really has duplicates
    assert t["op_counts"].groupby("op")["calls"].sum().to_dict() == multi.groupby("op").size().to_dict()
    assert int(t["overview"]["bytes"].iloc[0]) == int(multi["bytes"].sum())
    # opCount does not advance on single-rank communicators, so a repeated line there cannot be told
    # from a repeated call: such duplicates may stay among the single-rank calls (never among calls)
    assert int(t["overview"]["calls_single_rank"].iloc[0]) >= int((logged["nranks"] == 1).sum())
    # thesis figure 5.4: 220 AllReduce, 84 AllGather, 4 Broadcast over 10 iterations, counted as kernels
    kernels = t["kernel_counts"].groupby("kernel_op")["kernels"].sum().to_dict()
    assert kernels == {"AllReduce": 220, "AllGather": 84, "Broadcast": 4}
    rv = t["rank_volume"]
    assert len(rv) == 4 and rv["bytes"].nunique() == 1  # data parallelism: every rank moves the same


def test_comm_share_of_span_pairs_each_rank_with_its_own_span():
    """Ranks whose rows come in another order than their numbers (here 2, 0, 1): each rank's
    kernel time is divided by its own span (it was divided by the spans in order of appearance)."""
    time_and_span = {2: (300, 400), 0: (100, 1000), 1: (200, 1000)}  # shares 0.75, 0.1, 0.2
    rows, metrics = [], []
    for rank, (busy, span) in time_and_span.items():
        for line, (start, end) in enumerate(((0, 10), (span - 10, span)), start=1):
            rows.append(_row(file=f"r{rank}.log", line=line, global_rank=rank, nranks=3, status="matched",
                             kernel_correlation_id=line, kernel_start_sync=start, kernel_end_sync=end))
            metrics.append({"file": f"r{rank}.log", "line": line, "duration_ns": busy / 2, "wait_ns": 0.0,
                            "transfer_ns": busy / 2, "arrival_skew_ns": 0.0})
    ops = pd.DataFrame(rows)
    for c in ("line", "kernel_correlation_id", "kernel_start_sync", "kernel_end_sync"):
        ops[c] = ops[c].astype("Int64")
    tl = run_tables(ops, op_metrics=pd.DataFrame(metrics))["time_lost"].iloc[0]
    assert tl["comm_share_of_span"] == pytest.approx(0.2)  # median of 0.1, 0.2, 0.75
    assert tl["calls_timed"] == 6 and tl["comm_time_s"] == pytest.approx(600e-9)
