"""Stage campaign_report: every configuration of a campaign side by side (tables, comparison
figure, HTML report); runs that failed are listed with why, partial runs are named."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from nccltrace.acquisition.status import read_status
from nccltrace.core.layout import MANIFEST_FILE, RunLayout
from nccltrace.core.provenance import write_manifest
from nccltrace.outputs.plots import campaign_plots
from nccltrace.outputs.report import render_campaign_report, report_partial
from nccltrace.outputs.summary import campaign_tables, write_tables
from nccltrace.stages import StageResult

__all__ = ["run_campaign_report"]


def run_campaign_report(report_manifests: Iterable[Path | str], out_dir: Path | str,
                        settings: Mapping[str, Mapping[str, Any]], failed: Mapping[str, str]) -> StageResult:  # fmt: skip
    """Combine the runs whose report manifests are given into ``out_dir`` (``tables/``,
    ``plots/``, ``report.html``, manifest). ``settings``: run id -> settings of every run of the
    campaign; ``failed``: run id -> why its acquisition failed."""
    out = Path(out_dir)
    manifests = [Path(m) for m in report_manifests]
    per_run, layouts = {}, {}
    for manifest in manifests:
        layout = RunLayout(manifest.parents[1])
        layouts[layout.root.name] = layout
        per_run[layout.root.name] = {p.stem: pd.read_parquet(p) for p in sorted(layout.report_tables.glob("*.parquet"))}

    def failure(run: str) -> str:
        """Why a run has no results: its recorded acquisition failure, by the step that failed."""
        if run not in failed:
            return "no results (run not analysed)"
        step = read_status(RunLayout(out.parent / run).raw).get("stage") or "training"
        return f"{step} failed: {failed[run]}"

    missing = {run: failure(run) for run in settings if run not in per_run}
    tables = campaign_tables(per_run, dict(settings))
    written = write_tables(tables, out / "tables")
    plots = campaign_plots(tables, out / "plots")
    html = out / "report.html"
    render_campaign_report(out, html, runs={r: lay.root for r, lay in layouts.items()}, missing=missing,
                           tables_dir=out / "tables", plots_dir=out / "plots")  # fmt: skip
    # Partial runs are listed by name (their reasons are in their own manifests), failed runs with why.
    partial_runs = sorted(r for r, lay in layouts.items() if report_partial(lay.manifest(lay.report_dir)))
    problems = [*(f"run {r} is partial (see {layouts[r].report_html})" for r in partial_runs),
                *(f"run {r}: {w}" for r, w in missing.items())]  # fmt: skip
    outputs = [*written.values(), *plots.values(), html]
    write_manifest(out / MANIFEST_FILE, stage="campaign_report", inputs=manifests, outputs=outputs,
                   config=dict(settings), partial=bool(problems), propagate=False, reasons=problems,
                   extra={"partial_runs": partial_runs, "missing_runs": missing})  # fmt: skip
    return StageResult("campaign_report", outputs, bool(problems), problems,
                       f"{len(per_run)} runs, {len(missing)} missing, {len(partial_runs)} partial; report {html}")
