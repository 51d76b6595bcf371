"""The out-of-core run-level stages give the tables of the whole run in memory, on every run of
the embedded example campaign and on a 64-rank run of eight nodes with unsynchronised clocks:
the ops stage's checks in parts of 40 rows against one part, and the metrics in parts of 300
calls, read in batches of 97 rows, against the in-memory computation."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml
from emulated_runs import SMALL_MODEL, assert_metrics_tables_equal

from nccltrace.align.quality import QUALITY_FILE
from nccltrace.analyze import analyze_run
from nccltrace.campaign.matrix import expand_campaign, load_campaign
from nccltrace.core.layout import RunLayout
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.metrics.compute import compute_run_metrics, write_run_metrics_out_of_core
from nccltrace.ops.build import stream_run_ops

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = {r.run_id: r.settings for r in expand_campaign(load_campaign(REPO / "config" / "config.yaml"))
           if r.backend == "emulate"}  # fmt: skip
# 64 ranks: TP4 PP4 DP4 on eight 8-GPU nodes, clocks offset and drifting per node
SIXTY_FOUR = {**SMALL_MODEL, "name": "ranks-64", "nodes": 8, "gpus_per_node": 8, "tp": 4, "pp": 4,
              "sequence_parallel": True, "global_batch_size": 16, "precision": "bf16", "nccl_version": "2.28.3",
              "nccl_timestamps": True, "seed": 11,
              "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1, "clock_offset_ns_max": 2_000_000,
                                "clock_drift_ppm_max": 5.0, "arrival_skew_ns_max": 50_000}}  # fmt: skip
RUNS = {**{f"example/{k}": v for k, v in EXAMPLE.items()}, "ranks-64": SIXTY_FOUR}


@pytest.fixture(scope="module", params=sorted(RUNS))
def analysed(request, tmp_path_factory) -> tuple[RunLayout, dict]:
    base = tmp_path_factory.mktemp("identity")
    settings = {k: v for k, v in RUNS[request.param].items() if k not in ("env", "megatron_args")}
    emulate_run(settings, base / "raw")
    analyze_run(base / "raw", base / "out", progress=False, until="ops")
    return RunLayout(base / "out"), yaml.safe_load((base / "raw" / "run.yaml").read_text())["config"]


def test_the_example_campaign_is_all_here():
    assert len(EXAMPLE) >= 8  # the embedded default's emulated runs


@pytest.mark.slow
def test_ops_checks_in_parts_give_the_ops_tables_of_the_whole_run(analysed, tmp_path):
    layout, settings = analysed
    procs, hosts = layout.find_processes(), layout.find_hosts()
    args = ([layout.alignment(p) for p in procs], [layout.parsed_nccl(p) for p in procs], layout.communicators,
            layout.members, {h: layout.parsed_nsys(h) / "session.json" for h in hosts}, settings)  # fmt: skip
    quality = [layout.aligned(p) / QUALITY_FILE for p in procs]
    whole = stream_run_ops(*args, tmp_path / "whole.parquet", quality_paths=quality, check_part_rows=1 << 40)
    parts = stream_run_ops(*args, tmp_path / "parts.parquet", quality_paths=quality, check_part_rows=40)
    pd.testing.assert_frame_equal(read_table(tmp_path / "parts.parquet"), read_table(tmp_path / "whole.parquet"))
    pd.testing.assert_frame_equal(parts.quality, whole.quality)
    pd.testing.assert_frame_equal(parts.clock, whole.clock)
    assert (parts.problems, parts.matched, parts.partial) == (whole.problems, whole.matched, whole.partial)
    # the check had rows to look at (a single-node communicator of NCCL >= 2.27.3 logs opCount 0:
    # its instances are keyed by the k-th call, which the check does not test)
    cross = whole.quality[whole.quality["check"] == "cross_rank"]
    assert (cross["confirmed"] + cross["not_checkable"]).sum() > 0


@pytest.mark.slow
def test_metrics_in_parts_give_the_in_memory_tables(analysed, tmp_path):
    layout, _ = analysed
    dirs = [layout.parsed_nccl(p) for p in layout.find_processes()]
    comms = read_table(layout.communicators)
    expected = compute_run_metrics(read_table(layout.ops), dirs, comms)
    written = write_run_metrics_out_of_core(layout.ops, dirs, comms, tmp_path, part_rows=300, batch_rows=97)
    assert_metrics_tables_equal(written, expected)
    assert written.parts > 1 or expected.op_metrics["logical_id"].nunique() == 1
