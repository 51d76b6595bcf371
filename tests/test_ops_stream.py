"""The run's ops table is built one process at a time (memory bounded by a process)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from nccltrace.cli import main
from nccltrace.core.layout import RunLayout
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.ops.build import stream_run_ops

CFG = {
    "model": "tiny", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
    "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 8, "iterations": 3, "nodes": 4,
    "gpus_per_node": 2, "tp": 2, "pp": 2, "precision": "bf16", "seed": 5,
    "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1, "clock_offset_ns_max": 50_000,
                      "clock_drift_ppm_max": 2},
}  # fmt: skip


@pytest.fixture(scope="module")
def analysed(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("ops_stream")
    emulate_run(CFG, base / "raw")
    assert main(["analyze", str(base / "raw"), "-o", str(base / "out"), "-q"]) == 0
    return base


def _inputs(base: Path) -> tuple:
    out = base / "out"
    layout = RunLayout(out)
    procs = layout.find_processes()
    sessions = {h: layout.session(h) for h in layout.find_hosts()}
    settings = yaml.safe_load((base / "raw" / "run.yaml").read_text())["config"]
    return ([layout.alignment(p) for p in procs], [layout.parsed_nccl(p) for p in procs],
            out / "communicators" / "communicators.parquet", out / "communicators" / "communicator_members.parquet",
            sessions, settings)  # fmt: skip


def test_streamed_ops_keep_process_order_and_counts(analysed, tmp_path):
    args = _inputs(analysed)
    res = stream_run_ops(*args, tmp_path / "ops.parquet")
    ops = read_table(tmp_path / "ops.parquet")
    assert res.notes == [] and not list(tmp_path.glob(".ops-parts-*"))  # the table is only on disk
    order = [Path(p).parent.name for p in args[0]]
    seen = list(dict.fromkeys(ops["file"].dropna().str.removesuffix(".log")))
    assert seen == order  # processes appear in the order given, each one contiguous
    calls = ops[ops["row_kind"] == "call"]
    assert res.calls == len(calls) and res.matched == int((calls["status"] == "matched").sum())
    assert ops["kernel_start_sync"].notna().sum() == ops["kernel_start_utc"].notna().sum()
    assert ops.equals(read_table(analysed / "out" / "ops" / "ops.parquet"))


def test_clock_fit_on_a_sample_of_instances_stays_close_to_the_full_fit(analysed, tmp_path):
    args = _inputs(analysed)
    stream_run_ops(*args, tmp_path / "full.parquet")
    res = stream_run_ops(*args, tmp_path / "sampled.parquet", clock_rows_budget=300)
    assert len(res.notes) == 1 and "clock sync fitted on" in res.notes[0]
    full = read_table(tmp_path / "full.parquet")
    sampled = read_table(tmp_path / "sampled.parquet")
    diff = (full["kernel_end_sync"] - sampled["kernel_end_sync"]).dropna().abs()
    assert len(diff) == full["kernel_end_sync"].notna().sum()
    assert diff.max() < 2_000  # ns: a sample of whole instances gives nearly the same offsets and drifts
    pd.testing.assert_series_equal(full["kernel_start_utc"], sampled["kernel_start_utc"])


def test_mismatched_input_lists_are_rejected(analysed, tmp_path):
    a, c, *rest = _inputs(analysed)
    with pytest.raises(ValueError, match="alignment tables but"):
        stream_run_ops(a, c[:-1], *rest, tmp_path / "ops.parquet")
    assert not (tmp_path / "ops.parquet").exists()


def test_stages_reading_only_their_declared_ops_columns_give_the_same_tables(analysed):
    """Metrics, volume and the summary tables read only OPS_COLUMNS of the ops table; a column
    used but not declared would change a result (or raise) here."""
    from nccltrace.metrics import compute as metrics
    from nccltrace.metrics import volume
    from nccltrace.outputs import summary

    out = analysed / "out"
    ops_path = out / "ops" / "ops.parquet"
    full = read_table(ops_path)
    settings = yaml.safe_load((analysed / "raw" / "run.yaml").read_text())
    v_full = volume.volume_validation(settings, full, run="r")
    v_cols = volume.volume_validation(settings, read_table(ops_path, columns=volume.OPS_COLUMNS), run="r")
    pd.testing.assert_frame_equal(v_full, v_cols)
    dirs = [RunLayout(out).parsed_nccl(p) for p in RunLayout(out).find_processes()]
    comms = read_table(out / "communicators" / "communicators.parquet")
    m_full = metrics.compute_run_metrics(full, dirs, comms)
    m_cols = metrics.compute_run_metrics(read_table(ops_path, columns=metrics.OPS_COLUMNS), dirs, comms)
    for name in ("op_metrics", "instances", "stragglers", "limits", "algorithms"):
        pd.testing.assert_frame_equal(getattr(m_full, name), getattr(m_cols, name))
    t_full = summary.run_tables(full, m_full.op_metrics, v_full)
    t_cols = summary.run_tables(read_table(ops_path, columns=summary.OPS_COLUMNS), m_full.op_metrics, v_full)
    assert sorted(t_full) == sorted(t_cols)
    for name in t_full:
        pd.testing.assert_frame_equal(t_full[name], t_cols[name])
    assert len(full.columns) > len(set(metrics.OPS_COLUMNS) | set(volume.OPS_COLUMNS) | set(summary.OPS_COLUMNS))
