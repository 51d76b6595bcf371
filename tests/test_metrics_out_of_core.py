"""The out-of-core metrics (parts of whole communicators, spilled and merged back) give the
tables the in-memory computation gives, however the run is cut into parts and batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from emulated_runs import SMALL_MODEL, assert_metrics_tables_equal

from nccltrace.analyze import analyze_run
from nccltrace.core.layout import RunLayout
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.metrics.compute import (
    compute_run_metrics,
    part_calls,
    write_run_metrics_out_of_core,
)

_SMALL = {**SMALL_MODEL, "compute_kernels": False}
RUNS = {
    # dropped and duplicated lines, dropped kernels, clock offsets (incomplete instances), fused
    # grouped P2P (one kernel, several calls), single-rank communicators, TUNING lines of 2.18
    "knobs": {**_SMALL, "tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 2, "nccl_version": "2.18.3", "seed": 5,
              "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1,
                                "duplicate_log_lines": {"ranks": [0], "fraction": 0.3}, "drop_log_lines": 0.05,
                                "drop_kernels": 0.05, "clock_offset_ns_max": 2_000_000,
                                "arrival_skew_ns_max": 50_000}},
    # MoE with expert parallelism and VPP, TUNING lines of a recent build
    "moe": {**_SMALL, "tp": 2, "pp": 2, "vpp": 2, "nodes": 2, "gpus_per_node": 4, "ep": 2, "num_experts": 4,
            "moe_layer_freq": 2, "moe_router_topk": 2, "sequence_parallel": True, "global_batch_size": 8, "precision": "bf16",
            "nccl_version": "2.26.2", "nccl_timestamps": True, "seed": 7},
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, tmp_path_factory) -> RunLayout:
    base = tmp_path_factory.mktemp(f"ooc-{request.param}")
    emulate_run({**RUNS[request.param], "name": request.param}, base / "raw")
    analyze_run(base / "raw", base / "out", progress=False)
    return RunLayout(base / "out")


def _dirs(layout: RunLayout) -> list[Path]:
    return [layout.parsed_nccl(p) for p in layout.find_processes()]


def _in_memory(layout: RunLayout, ops: pd.DataFrame | None = None):
    ops = read_table(layout.ops) if ops is None else ops
    return compute_run_metrics(ops, _dirs(layout), read_table(layout.communicators))



@pytest.mark.parametrize("part_rows,batch_rows", [(1 << 20, 1 << 18), (1, 97), (300, 1000)])
def test_out_of_core_metrics_equal_the_in_memory_tables(run, tmp_path, part_rows, batch_rows):
    expected = _in_memory(run)
    written = write_run_metrics_out_of_core(run.ops, _dirs(run), read_table(run.communicators), tmp_path,
                                            part_rows=part_rows, batch_rows=batch_rows)  # fmt: skip
    assert_metrics_tables_equal(written, expected)
    assert written.op_rows == len(expected.op_metrics) and written.instances == len(expected.instances)
    communicators = expected.op_metrics["logical_id"].nunique()
    if part_rows >= 1 << 20:
        assert written.parts == 1
    if part_rows == 1:  # every communicator (and the calls without one) is a part of its own
        assert written.parts >= communicators
    assert not list(tmp_path.glob(".spill-*")), "the spilled parts are removed"


def test_the_runs_exercise_what_crosses_parts(run):
    """What the comparison above covers: fused kernels and problem messages (knobs), TUNING
    lines routed to the part of their call (moe), many communicators (both)."""
    result = _in_memory(run)
    m = result.op_metrics
    assert m["instance"].notna().any() and m["logical_id"].nunique() > 3
    if run.root.parent.name.startswith("ooc-knobs"):
        assert (m["kernel_calls"] > 1).any() and result.problems
        assert (result.instances["status"] == "incomplete").any()
    else:
        assert (m["algo_source"] == "tuning").any()


def test_communicators_sharing_a_kernel_are_computed_in_one_part(run, tmp_path):
    # a capture where one kernel launch carries calls of two communicators (a fused group across
    # communicators): the kernel's bus bytes add up over both, wherever the part boundaries fall
    ops = read_table(run.ops)
    calls = ops.index[(ops["row_kind"] == "call") & (ops["status"] == "matched")
                      & ops["kernel_correlation_id"].notna() & ops["logical_id"].notna()]  # fmt: skip
    first = calls[0]
    same_proc = ops.loc[calls, "kernel_global_pid"] == ops.at[first, "kernel_global_pid"]
    other_lid = ops.loc[calls, "logical_id"] != ops.at[first, "logical_id"]
    second = ops.loc[calls][same_proc & other_lid].index[0]
    for col in ("kernel_correlation_id", "kernel_start", "kernel_end", "kernel_start_sync", "kernel_end_sync"):
        ops.at[second, col] = ops.at[first, col]
    path = tmp_path / "ops.parquet"
    pq.write_table(pa.Table.from_pandas(ops, preserve_index=False), path)
    expected = _in_memory(run, ops)
    written = write_run_metrics_out_of_core(path, _dirs(run), read_table(run.communicators), tmp_path / "m",
                                            part_rows=1, batch_rows=97)  # fmt: skip
    assert_metrics_tables_equal(written, expected)
    om = read_table(written.paths["op_metrics"])
    call_row = np.cumsum((ops["row_kind"] == "call").to_numpy()) - 1  # op_metrics row of each ops row
    assert om.at[int(call_row[first]), "kernel_calls"] >= 2


def test_an_ops_file_without_calls_gives_empty_tables(run, tmp_path):
    ops = read_table(run.ops)
    path = tmp_path / "ops.parquet"
    pq.write_table(pa.Table.from_pandas(ops[ops["row_kind"] != "call"], preserve_index=False), path)
    written = write_run_metrics_out_of_core(path, _dirs(run), read_table(run.communicators), tmp_path / "m")
    assert written.op_rows == 0 and written.parts == 0
    assert read_table(written.paths["op_metrics"]).empty and read_table(written.paths["instances"]).empty
    # the communicators still have their limits
    assert len(read_table(written.paths["limits"])) == len(read_table(run.communicators).dropna(subset=["logical_id"]))


def test_part_calls_name_the_largest_part_and_the_runs_calls(run, tmp_path):
    ops = read_table(run.ops, columns=["row_kind", "logical_id"])
    calls = ops[ops["row_kind"] == "call"]
    largest = int(calls["logical_id"].value_counts(dropna=False).max())
    assert part_calls(run.ops, part_rows=1) == (largest, len(calls))
    assert part_calls(run.ops, part_rows=10**9) == (len(calls), len(calls))
    written = write_run_metrics_out_of_core(run.ops, _dirs(run), read_table(run.communicators), tmp_path,
                                            part_rows=1)  # fmt: skip
    assert written.parts == calls["logical_id"].nunique(dropna=False)
