"""The report stage reads the run's ops table in batches (``stages.report.report_data``): its tables
equal ``summary.run_tables`` on the whole table in memory and its timeline ``plots.timeline_of``,
whatever the batch size (batches of 31 rows cut fused kernels and call groups), on an emulated,
analysed run with duplicate lines, single-rank calls, lost kernels and two nodes; the stage writes
the in-memory tables and figures; op metrics that do not follow the ops table are refused; and
the exact helpers behind it (first-seen kernel keys, medians of counts) agree with pandas."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nccltrace.cli import main
from nccltrace.core.batch_stats import FirstSeen, median_of_counts
from nccltrace.core.layout import RunLayout
from nccltrace.core.tables import iter_record_batches, read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.outputs.plots import TIMELINE_COLUMNS, run_plots, timeline_of
from nccltrace.outputs.summary import (
    OP_METRICS_COLUMNS,
    OPS_COLUMNS,
    RunTablesBuilder,
    iter_run_batches,
    run_tables,
    write_tables,
)
from nccltrace.stages.report import report_data

# PP2 x DP4 on two nodes: fused Send/Recv groups, single-rank (TP=1) communicators, duplicate and
# lost log lines, lost kernel records, kernels of no call, arrival skew and a clock per node.
RUN = {
    "model": "tiny", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
    "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 16, "iterations": 4, "nodes": 2,
    "gpus_per_node": 4, "tp": 1, "pp": 2, "precision": "bf16", "seed": 11,
    "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1, "drop_kernels": 0.02,
                      "duplicate_log_lines": {"ranks": [1, 6], "fraction": 0.2}, "drop_log_lines": 0.01,
                      "kernels_without_log": 0.01, "arrival_skew_ns_max": 20_000,
                      "clock_offset_ns_max": 50_000, "clock_drift_ppm_max": 2},
}  # fmt: skip
SMALL = 31  # rows per batch: a prime, so edges fall anywhere in call groups and fused kernels
REL = 1e-12  # float columns may differ by the order of additions only


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The emulated run, analysed through the report stage."""
    base = tmp_path_factory.mktemp("streamed") / "run"
    emulate_run(RUN, base / "raw")
    assert main(["analyze", str(base / "raw"), "-o", str(base), "-q"]) == 0
    return base


@pytest.fixture(scope="module")
def in_memory(run_dir) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """The whole ops table and its tables computed in memory, as the report did before."""
    layout = RunLayout(run_dir)
    ops = read_table(layout.ops)
    tables = run_tables(ops, read_table(layout.metric("op_metrics")), read_table(layout.volume),
                        read_table(layout.quality), read_table(layout.metric("stragglers")))  # fmt: skip
    return ops, tables


def _differences(got: dict[str, pd.DataFrame], want: dict[str, pd.DataFrame]) -> list[str]:
    """What differs: table names, columns, dtypes, rows; integers and strings exactly, floats to
    a relative 1e-12."""
    out = [f"tables {sorted(got)} != {sorted(want)}"] if sorted(got) != sorted(want) else []
    for name in sorted(set(got) & set(want)):
        a, b = got[name].reset_index(drop=True), want[name].reset_index(drop=True)
        if list(a.columns) != list(b.columns) or list(a.dtypes) != list(b.dtypes) or len(a) != len(b):
            out.append(f"{name}: columns, dtypes or rows differ ({len(a)} vs {len(b)} rows)")
            continue
        for col in a.columns:
            x, y = a[col], b[col]
            if x.dtype.kind == "f" or str(x.dtype) == "Float64":
                u, v = x.astype("float64").to_numpy(), y.astype("float64").to_numpy()
                if not (np.array_equal(np.isnan(u), np.isnan(v))
                        and np.allclose(u[~np.isnan(u)], v[~np.isnan(v)], rtol=REL, atol=0)):  # fmt: skip
                    out.append(f"{name}.{col}")
            elif not x.equals(y):
                out.append(f"{name}.{col}")
    return out


def test_the_run_exercises_what_batches_could_break(run_dir, in_memory):
    """Duplicates, single-rank calls, metrics and stragglers are there; small batches cut through
    fused kernels (calls sharing a kernel fall in two batches)."""
    ops, tables = in_memory
    ov = tables["overview"].iloc[0]
    assert ov["duplicate_lines"] > 0 and ov["calls_single_rank"] > 0 and ov["kernels"] < ov["matched_calls"]
    assert len(tables["bandwidth"]) and len(tables["time_lost"]) and (ops["row_kind"] == "kernel").any()
    calls = ops[(ops["row_kind"] == "call") & (ops["status"] == "matched") & ops["duplicate_of"].isna()]
    key = calls[["host", "kernel_global_pid", "kernel_correlation_id"]].astype(str).agg("|".join, axis=1)
    sizes = [b.num_rows for b in iter_record_batches(RunLayout(run_dir).ops, ["row_kind"], SMALL)]
    batch = np.repeat(np.arange(len(sizes)), sizes)
    assert len(sizes) > 20 and len(batch) == len(ops)
    straddling = (pd.Series(batch[calls.index], index=calls.index).groupby(key).nunique() > 1).sum()
    assert straddling >= 3, "too few fused kernels straddle a batch edge"


@pytest.mark.parametrize("batch_rows", [1 << 16, SMALL])
def test_streamed_tables_equal_the_in_memory_tables(run_dir, in_memory, batch_rows):
    tables, _ = report_data(RunLayout(run_dir), batch_rows=batch_rows)
    assert _differences(tables, in_memory[1]) == []


def test_a_lost_batch_is_noticed(run_dir, in_memory):
    """The comparison can fail: the tables without one small batch differ."""
    layout = RunLayout(run_dir)
    builder = RunTablesBuilder(OP_METRICS_COLUMNS, FirstSeen())
    for i, (ops, metrics) in enumerate(iter_run_batches(layout.ops, layout.metric("op_metrics"), batch_rows=SMALL)):
        if i != 5:
            builder.add(ops, metrics)
    want = in_memory[1]
    got = builder.tables(read_table(layout.volume), read_table(layout.quality), read_table(layout.metric("stragglers")))
    diff = _differences(got, want)
    assert "overview.calls" in diff and "op_counts.calls" in diff


@pytest.mark.parametrize("batch_rows", [1 << 16, SMALL])
def test_streamed_timeline_equals_the_in_memory_one(run_dir, in_memory, batch_rows):
    _, timeline = report_data(RunLayout(run_dir), batch_rows=batch_rows)
    want = timeline_of(in_memory[0])
    assert (timeline.window, timeline.how, timeline.ranks, timeline.hosts) == (
        want.window, want.how, want.ranks, want.hosts)
    assert "iteration" in timeline.how and len(timeline.kernels) > 0
    pd.testing.assert_frame_equal(timeline.kernels, want.kernels)
    assert set(TIMELINE_COLUMNS) <= set(OPS_COLUMNS)  # the first pass reads them with the tables


def test_report_stage_writes_the_in_memory_tables_and_figures(run_dir, in_memory, tmp_path):
    """What analyze's report stage wrote (streamed) is byte for byte what the tables and figures
    of the whole table in memory give."""
    ops, tables = in_memory
    layout = RunLayout(run_dir)
    title = re.search(r"NCCL communication report: ([^<]+)<", layout.report_html.read_text()).group(1)
    written = write_tables(tables, tmp_path / "tables")
    drawn = run_plots(ops, tables, tmp_path / "plots", title=title)
    assert len(drawn) == 6
    for name, path in [*written.items(), *drawn.items()]:
        stage = (layout.report_tables if path.parent.name == "tables" else layout.report_plots) / name
        if name.endswith(".parquet"):
            assert pq.read_table(stage).equals(pq.read_table(path)), name
        else:
            assert stage.read_bytes() == path.read_bytes(), name


def _rewrite(src: Path, dst: Path, change) -> Path:
    table = change(pq.read_table(src))
    pq.write_table(table, dst)
    return dst


@pytest.mark.parametrize("change, message", [
    (lambda t: t.take(np.r_[1, 0, np.arange(2, t.num_rows)]), r"call row 0 is \("),
    (lambda t: t.slice(0, t.num_rows - 1), "it ends after"),
    (lambda t: pa.concat_tables([t, t.slice(0, 3)]), "3 rows are left"),
])  # fmt: skip
def test_op_metrics_that_do_not_follow_the_ops_table_are_refused(run_dir, tmp_path, change, message):
    layout = RunLayout(run_dir)
    bad = _rewrite(layout.metric("op_metrics"), tmp_path / "op_metrics.parquet", change)
    with pytest.raises(ValueError, match=message) as err:
        for _ in iter_run_batches(layout.ops, bad, batch_rows=SMALL):
            pass
    assert str(bad) in str(err.value) and str(layout.ops) in str(err.value)


def test_first_seen_is_drop_duplicates_over_batches_with_two_questions():
    rng = np.random.default_rng(3)
    n = 5000
    frame = pd.DataFrame({
        "host": pd.array(rng.choice(["a", "b", None], n), dtype="string"),
        "gpid": pd.array(rng.choice([7, 8, None], n), dtype="Int64"),
        # correlation ids with low and high bits set, negative and missing ones
        "corr": pd.array(rng.choice([0, 1, 5, (1 << 41) + 5, -3, None], n, p=[.2, .2, .2, .2, .1, .1]), dtype="Int64")
        + pd.array(rng.integers(0, 40, n), dtype="Int64"),
        "tag": rng.integers(0, 2, n),
    })
    seen, got = FirstSeen(), np.zeros(n, dtype=bool)
    for lo in range(0, n, 333):
        part = frame.iloc[lo:lo + 333]
        for tag in (0, 1):
            rows = np.flatnonzero(part["tag"].to_numpy() == tag)
            got[lo + rows] = seen.first(part["host"].iloc[rows], part["gpid"].iloc[rows], part["corr"].iloc[rows], tag)
    want = np.zeros(n, dtype=bool)
    for tag in (0, 1):
        sub = frame[frame["tag"] == tag]
        want[sub.index[~sub.duplicated(["host", "gpid", "corr"]).to_numpy()]] = True
    assert (got == want).all() and want.sum() < n


@pytest.mark.parametrize("n", [1, 2, 5, 6, 1000])
def test_median_of_counts_is_the_median_of_the_values(n):
    values = np.random.default_rng(n).integers(0, 9, n).astype("int64") * 1024 + 1
    uniq, counts = np.unique(values, return_counts=True)
    assert median_of_counts(uniq, counts) == pd.Series(values).median()
    assert np.isnan(median_of_counts(np.zeros(0), np.zeros(0, dtype=int)))
