"""Stage report: a run's summary tables (Parquet + CSV), plots and self-contained HTML report."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from nccltrace.core.batch_stats import FirstSeen
from nccltrace.core.layout import RunLayout
from nccltrace.core.provenance import write_manifest
from nccltrace.core.tables import iter_table_batches, read_table
from nccltrace.outputs.plots import WINDOW_COLUMNS, Timeline, TimelineBuilder, run_plots
from nccltrace.outputs.report import render_run_report
from nccltrace.outputs.summary import (
    OP_METRICS_COLUMNS,
    RunTablesBuilder,
    iter_run_batches,
    write_tables,
)
from nccltrace.stages import StageResult

__all__ = ["BATCH_ROWS", "report_data", "run_report"]

BATCH_ROWS = 1 << 16
"""Rows of the ops table read at a time: a batch's working memory is about 0.6 KB per row, and
batches of 2^18 rows were no faster than 2^16 on 10^6 ops."""


def report_data(layout: RunLayout, *, batch_rows: int = BATCH_ROWS) -> tuple[dict[str, pd.DataFrame], Timeline | None]:
    """The run's summary tables and the data of its timeline figure, from its ops table read in
    batches of ``batch_rows`` rows: once whole (only the columns the tables use) with the op
    metrics alongside, then the timeline's columns again for the kernels in its window. Equal to
    ``summary.run_tables`` and ``plots.timeline_of`` on the tables in memory, in memory that grows
    by the distinct kernels and the bandwidth values of the calls, not by whole rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    metrics_path = layout.metric("op_metrics")
    metrics_schema = pq.read_schema(metrics_path)
    # an op-metrics table without rows is no metrics (bandwidth and time_lost stay empty), as in memory
    has_metrics = pq.read_metadata(metrics_path).num_rows > 0
    kernels = FirstSeen()  # one int64 per distinct kernel, for the tables and the timeline alike
    builder = RunTablesBuilder([c for c in OP_METRICS_COLUMNS if c in metrics_schema.names] if has_metrics else None,
                               kernels)  # fmt: skip
    timeline = TimelineBuilder(kernels=kernels)
    for ops, metrics in iter_run_batches(layout.ops, metrics_path, batch_rows=batch_rows):
        builder.add(ops, metrics)
        timeline.add(ops)
        # Arrow's allocator keeps freed pages for reuse: giving them back lowered the peak by
        # ~8 B per op (11 M ops: 1.29 -> 1.20 GiB) for ~5 % more time
        pa.default_memory_pool().release_unused()
    stragglers = read_table(layout.metric("stragglers")) if layout.metric("stragglers").exists() else None
    tables = builder.tables(read_table(layout.volume), read_table(layout.quality), stragglers)
    return tables, timeline.collect(iter_table_batches(layout.ops, WINDOW_COLUMNS, batch_rows))


def run_report(layout: RunLayout, run_id: str, procs: Iterable[str], hosts: Iterable[str],
               run_yaml: Path | None = None) -> StageResult:  # fmt: skip
    """Write the report's tables, plots and HTML from the run's tables and the manifests of
    its stages (processes ``procs``, nodes ``hosts``); partial when any upstream manifest is.
    ``run_yaml``: the run's settings record (default: the layout's raw/run.yaml)."""
    # the ops table is read in batches, never whole: a run of 10^7 ops fits in well under 4 GiB
    tables, timeline = report_data(layout)
    written = write_tables(tables, layout.report_tables)
    plots = run_plots(None, tables, layout.report_plots, title=run_id, timeline=timeline)
    manifests = layout.stage_manifests(procs, hosts)
    render_run_report(layout.root, layout.report_html, tables_dir=layout.report_tables, plots_dir=layout.report_plots,
                      run_id=run_id, manifests=manifests, run_yaml=run_yaml or layout.run_yaml)  # fmt: skip
    inputs = [layout.parse_summary] if layout.parse_summary.exists() else []
    manifest = write_manifest(layout.manifest(layout.report_dir), stage="report",
                              # the parse summary first: its reasons (missing logs, exports) lead the list
                              inputs=[*inputs, layout.ops, layout.quality, layout.metric("op_metrics"), layout.volume,
                                      layout.trace],
                              outputs=[*written.values(), *plots.values(), layout.report_html])  # fmt: skip
    outputs = [*written.values(), *plots.values(), layout.report_html]
    return StageResult("report", outputs, bool(manifest["partial"]), list(manifest.get("partial_reasons") or []),
                       f"{len(written)} table files, {len(plots)} plots, report {layout.report_html}")
