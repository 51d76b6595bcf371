"""Rule campaign_report: every configuration side by side (tables, comparison figure, HTML report)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
import pandas as pd  # noqa: E402

from nccltrace.acquisition.raw import read_status  # noqa: E402
from nccltrace.plots import campaign_plots  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402
from nccltrace.report import render_campaign_report, report_partial  # noqa: E402
from nccltrace.summary import campaign_tables, write_tables  # noqa: E402

inp, out = snakemake.input, snakemake.output  # noqa: F821
settings = dict(snakemake.params.settings)  # noqa: F821
per_run, run_dirs = {}, {}
for manifest in inp.reports:
    tables_dir = Path(manifest).parent / "tables"
    run_dir = Path(manifest).parents[1]
    run_dirs[run_dir.name] = run_dir
    per_run[run_dir.name] = {p.stem: pd.read_parquet(p) for p in sorted(tables_dir.glob("*.parquet"))}
failed = dict(snakemake.params.failed)  # noqa: F821
results = Path(out.html).parents[1]


def _failure(run: str) -> str:
    """Why a run has no results: its recorded acquisition failure, by the step that failed."""
    if run not in failed:
        return "no results (run not analysed)"
    step = read_status(results / run / "raw").get("stage") or "training"
    return f"{step} failed: {failed[run]}"


missing = {run: _failure(run) for run in settings if run not in per_run}
tables = campaign_tables(per_run, settings)
written = write_tables(tables, out.tables)
plots = campaign_plots(tables, out.plots)
render_campaign_report(Path(out.html).parent, out.html, runs=run_dirs, missing=missing, tables_dir=out.tables,
                       plots_dir=out.plots)
# Partial runs are listed by name (their reasons are in their own manifests), failed runs with why.
partial_runs = sorted(run for run, d in run_dirs.items() if report_partial(d / "report" / "manifest.json"))
write_manifest(out.manifest, stage="campaign_report", inputs=list(inp.reports),
               outputs=[*written.values(), *plots.values(), out.html], config=settings,
               partial=bool(partial_runs or missing), propagate=False,
               reasons=[*(f"run {r} is partial" for r in partial_runs), *(f"run {r}: {w}" for r, w in missing.items())],
               extra={"partial_runs": partial_runs, "missing_runs": missing})
print(f"{len(per_run)} runs, {len(missing)} missing, {len(partial_runs)} partial; report {out.html}")
for r, why in missing.items():
    print(f"MISSING: {r}: {why}", file=sys.__stderr__)
for r in partial_runs:
    print(f"PARTIAL: {r} (see {run_dirs[r] / 'report' / 'report.html'})", file=sys.__stderr__)
