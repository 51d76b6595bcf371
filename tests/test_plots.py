"""Figures: what each shows (bar heights = table numbers), the timeline's iteration window on a
synthetic run whose iterations are known, skipped figures without data, byte-identical output."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from nccltrace.outputs.plots import (
    _plot_bandwidth,
    _plot_op_counts,
    _plot_timeline,
    _plot_volume_by_op,
    campaign_plots,
    iteration_window,
    run_plots,
    sequence_period,
)
from nccltrace.outputs.summary import campaign_tables, run_tables

MS = 1_000_000
ITERATIONS = 6
T0 = 1_760_000_000_000_000_000
# one iteration: (op, parallelism, logical_id, bytes, start offset ms, duration ms); compute in between
PATTERN = [("AllGather", "tp", 1, 4096, 1.0, 0.05), ("AllGather", "tp", 1, 4096, 2.0, 0.05),
           ("AllReduce", "dp", 0, 1 << 22, 7.0, 0.8), ("AllReduce", "dp", 0, 1 << 20, 8.0, 0.3),
           ("AllReduce", "world", 2, 4, 8.5, 0.01)]  # fmt: skip


def synthetic_ops(ranks: int = 2, with_times: bool = True) -> tuple[pd.DataFrame, dict[int, tuple[int, int]]]:
    """Ops of a run with ``ITERATIONS`` identical 10 ms iterations after a different start-up
    phase; returns (ops, {iteration: (first kernel start, last kernel end)})."""
    rows, bounds = [], {}
    for rank in range(ranks):
        line = 0
        seq = [("Broadcast", "world", 2, 64, 0.2 + 0.1 * k, 0.01, -1) for k in range(3)]
        seq += [(*p, it) for it in range(ITERATIONS) for p in PATTERN]
        for op, par, lid, nbytes, off, dur, it in seq:
            line += 1
            start = T0 + int(((it + 1) * 10 + off) * MS) + rank * 1000
            end = start + int(dur * MS)
            if it >= 0 and rank == 0:
                lo, hi = bounds.get(it, (start, end))
                bounds[it] = (min(lo, start), max(hi, end))
            rows.append({"row_kind": "call", "file": f"r{rank}.log", "line": line, "host": "node000", "pid": 10 + rank,
                         "op": op, "kernel_global_pid": 1, "kernel_correlation_id": rank * 1000 + line,
                         "kernel_name": f"ncclDevKernel_{op}_RING_LL", "kernel_start": start, "kernel_end": end,
                         "status": "matched", "reason": None, "duplicate_of": None, "nranks": 2, "bytes": nbytes,
                         "message_bytes": nbytes, "logical_id": lid, "global_rank": rank, "parallelism": par,
                         "kernel_start_sync": start if with_times else None,
                         "kernel_end_sync": end if with_times else None})  # fmt: skip
        # single-rank calls: no kernel, no time
        rows.append({"row_kind": "call", "file": f"r{rank}.log", "line": line + 1, "host": "node000",
                     "pid": 10 + rank, "op": "Broadcast", "status": "unmatched", "reason": "single_rank_communicator",
                     "nranks": 1, "bytes": 1 << 12, "message_bytes": 1 << 12, "logical_id": 9, "global_rank": rank,
                     "parallelism": "tp", "duplicate_of": None})  # fmt: skip
    df = pd.DataFrame(rows)
    for c in ("line", "pid", "kernel_global_pid", "kernel_correlation_id", "kernel_start", "kernel_end",
              "duplicate_of", "bytes", "message_bytes", "kernel_start_sync", "kernel_end_sync"):
        df[c] = df[c].astype("Int64")
    for c in ("nranks", "logical_id", "global_rank"):
        df[c] = df[c].astype("Int32")
    return df, bounds


def test_sequence_period_finds_the_iteration_not_a_sub_pattern():
    it = ["a", "b", "c", "a", "b", "d"]  # 'a b' repeats inside the iteration
    seq = np.array(["init", "x"] + it * 12 + ["end"])
    p, score = sequence_period(seq)
    assert p == len(it) and score > 0.95
    assert sequence_period(np.array(["a"] * 5)) == (0, 0.0)


def test_iteration_window_spans_one_period_of_the_op_sequence():
    ops, bounds = synthetic_ops()
    a, b, how = iteration_window(ops)
    assert "iteration" in how and "5 kernels" in how
    assert (b - a) == pytest.approx(10 * MS, rel=0.15)
    # without iteration markers the window may start anywhere in an iteration, but it holds every
    # op of the iteration exactly once on every rank and cuts no kernel
    timed = ops[ops["kernel_start_sync"].notna()]
    inside = timed[(timed["kernel_start_sync"] >= a) & (timed["kernel_end_sync"] <= b)]
    cut = timed[(timed["kernel_start_sync"] < b) & (timed["kernel_end_sync"] > a)]
    assert len(cut) == len(inside)
    for rank, g in inside.groupby("global_rank"):
        got = sorted(zip(g["op"], g["logical_id"].astype(int), g["bytes"].astype(int)))
        assert got == sorted((p[0], p[2], p[3]) for p in PATTERN), rank
    # it starts in the middle of the run, not in the start-up phase
    mid = sorted(bounds)[len(bounds) // 2]
    assert bounds[mid - 1][0] <= a <= bounds[mid][1]


def test_timeline_window_falls_back_without_a_period():
    ops, _ = synthetic_ops()
    ops = ops[ops["op"] != "AllGather"].copy()
    ops.loc[ops["op"] == "AllReduce", "logical_id"] = np.arange(int((ops["op"] == "AllReduce").sum())) % 7 + 20
    a, b, how = iteration_window(ops)
    assert "middle tenth" in how and b > a


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[pd.DataFrame, dict[str, pd.DataFrame], dict]:
    """The run figures of the synthetic run with bandwidth metrics, as PNG and SVG (drawn once)."""
    ops, _ = synthetic_ops()
    calls = ops[ops["row_kind"] == "call"]
    metrics = pd.DataFrame({"file": calls["file"], "line": calls["line"], "busbw_gbps": 50.0, "algbw_gbps": 25.0,
                            "limit_gbps": 80.0, "limit_link": "NVL 80 GB/s between two GPUs"})  # fmt: skip
    tables = run_tables(ops, op_metrics=metrics)
    out = run_plots(ops, tables, tmp_path_factory.mktemp("plots"), title="synthetic", formats=("png", "svg"))
    return ops, tables, out


def test_run_plots_draw_every_figure_with_data(rendered):
    _, _, out = rendered
    names = ("op_counts", "volume_by_op", "rank_volume", "message_sizes", "timeline", "bandwidth")
    assert sorted(out) == sorted(f"{n}.{ext}" for n in names for ext in ("png", "svg"))
    for name, path in out.items():
        if name.endswith(".svg"):
            assert path.read_text().lstrip().startswith("<?xml") and "<svg" in path.read_text()
            continue
        img = np.asarray(Image.open(path).convert("L"), dtype=float)
        assert img.shape[0] >= 250 and img.shape[1] >= 600
        assert img.std() > 10 and (img < 200).mean() > 0.01, f"{path.name} looks blank"


def test_figures_without_data_are_skipped(tmp_path):
    no_times, _ = synthetic_ops(with_times=False)
    assert _plot_timeline(no_times, "t", None) is None
    assert _plot_bandwidth(run_tables(no_times), "t") is None  # no metrics
    single = no_times[no_times["nranks"] == 1]
    assert run_plots(single, run_tables(single), tmp_path) == {}  # only single-rank calls: nothing to draw


def test_figures_are_byte_identical_across_renders(rendered, tmp_path):
    ops, tables, first = rendered
    second = run_plots(ops, tables, tmp_path, title="synthetic", formats=("png", "svg"))
    for name, path in first.items():
        assert path.read_bytes() == second[name].read_bytes(), name


def _bar_totals(ax) -> dict[float, float]:
    totals: dict[float, float] = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2, 6)
        totals[x] = totals.get(x, 0.0) + patch.get_height()
    return totals


def test_bar_heights_are_the_table_numbers():
    ops, _ = synthetic_ops()
    tables = run_tables(ops)
    fig = _plot_op_counts(tables, "t")
    calls_ax, kernels_ax = fig.axes[0], fig.axes[1]
    labels = [t.get_text() for t in calls_ax.get_xticklabels()]
    heights = [v for _, v in sorted(_bar_totals(calls_ax).items())]
    expected = tables["op_counts"].groupby("op")["calls"].sum()
    assert dict(zip(labels, heights)) == expected[expected > 0].to_dict()
    assert sum(_bar_totals(kernels_ax).values()) == tables["kernel_counts"]["kernels"].sum()
    vol = _plot_volume_by_op(tables, "t").axes[0]
    assert sum(_bar_totals(vol).values()) * 2**30 == pytest.approx(tables["volume_by_op"]["bytes"].sum())


def test_campaign_figure_shows_every_configuration(tmp_path):
    ops, _ = synthetic_ops()
    small, _ = synthetic_ops(ranks=1)
    settings = {r: {"model": "m", "nodes": 1, "gpus_per_node": 2} for r in ("run_a", "run_b", "run_missing")}
    camp = campaign_tables({"run_a": run_tables(ops), "run_b": run_tables(small)}, settings)
    out = campaign_plots(camp, tmp_path)
    img = Image.open(out["campaign_comparison.png"])
    assert img.size[0] >= 1200 and img.size[1] >= 250
    assert campaign_plots(camp, tmp_path / "again")["campaign_comparison.png"].read_bytes() == \
        out["campaign_comparison.png"].read_bytes()
    assert campaign_plots({}, tmp_path / "none") == {}


def test_campaign_figure_fits_a_page_width_as_a_grid(tmp_path):
    """Was one 2300 x 250 px strip, unreadable in the page: now a 2 x 2 grid no wider than a page
    at 100 dpi and not flatter than 3:1."""
    ops, _ = synthetic_ops()
    settings = {r: {"model": "m", "nodes": 1, "gpus_per_node": 2} for r in ("run_a", "run_b", "run_c")}
    camp = campaign_tables({r: run_tables(ops) for r in settings}, settings)
    w, h = Image.open(campaign_plots(camp, tmp_path)["campaign_comparison.png"]).size
    assert w <= 1400 and w / h <= 3.0, (w, h)


def test_bandwidth_series_have_distinct_colours_and_no_line_across_missing_sizes():
    """Five series were drawn in one red; a line joined 8 B to 32 MiB across sizes never run."""
    ops, _ = synthetic_ops()
    metrics = ops[ops["status"] == "matched"][["file", "line"]].assign(
        busbw_gbps=50.0, algbw_gbps=50.0, duration_ns=1000.0, limit_gbps=80.0, limit_link="NVL 80 GB/s")
    tables = run_tables(ops, metrics)
    fig = _plot_bandwidth(tables, "t")
    lines = [c.lines[0] for c in fig.axes[0].containers]  # each errorbar series' data line
    colours = [ln.get_color() for ln in lines]
    assert len(colours) == len(set(colours)) >= 3
    for ln in lines:  # consecutive points of a series lie in neighbouring size buckets, or a NaN breaks the line
        x, y = np.asarray(ln.get_xdata(), float), np.asarray(ln.get_ydata(), float)
        drawn = ~np.isnan(y[:-1]) & ~np.isnan(y[1:])
        assert (np.log2(x[1:][drawn]) - np.log2(x[:-1][drawn]) <= 1.0 + 1e-9).all()
