"""Stage report: a run's summary tables (Parquet + CSV), plots and self-contained HTML report."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..plots import run_plots
from ..provenance import write_manifest
from ..report import render_run_report
from ..run_layout import RunLayout
from ..summary import OP_METRICS_COLUMNS, OPS_COLUMNS, run_tables, write_tables
from ..tables import read_table
from . import StageResult

__all__ = ["run_report"]


def run_report(layout: RunLayout, run_id: str, procs: Iterable[str], hosts: Iterable[str],
               run_yaml: Path | None = None) -> StageResult:  # fmt: skip
    """Write the report's tables, plots and HTML from the run's tables and the manifests of
    its stages (processes ``procs``, nodes ``hosts``); partial when any upstream manifest is.
    ``run_yaml``: the run's settings record (default: the layout's raw/run.yaml)."""
    # only the columns the tables and plots use: the run's ops table is never loaded whole
    ops = read_table(layout.ops, columns=OPS_COLUMNS)
    stragglers = read_table(layout.metric("stragglers")) if layout.metric("stragglers").exists() else None
    tables = run_tables(ops, read_table(layout.metric("op_metrics"), columns=OP_METRICS_COLUMNS),
                        read_table(layout.volume), read_table(layout.quality), stragglers)  # fmt: skip
    written = write_tables(tables, layout.report_tables)
    plots = run_plots(ops, tables, layout.report_plots, title=run_id)
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
