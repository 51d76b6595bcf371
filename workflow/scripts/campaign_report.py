"""Rule campaign_report: every configuration side by side (tables, comparison figure, HTML report)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
import pandas as pd  # noqa: E402

from nccltrace.plots import campaign_plots  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402
from nccltrace.report import render_campaign_report  # noqa: E402
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
missing = {run: f"training failed: {failed[run]}" if run in failed else "no results (run not analysed)"
           for run in settings if run not in per_run}
tables = campaign_tables(per_run, settings)
written = write_tables(tables, out.tables)
plots = campaign_plots(tables, out.plots)
render_campaign_report(Path(out.html).parent, out.html, runs=run_dirs, missing=missing, tables_dir=out.tables,
                       plots_dir=out.plots)
write_manifest(out.manifest, stage="campaign_report", inputs=list(inp.reports),
               outputs=[*written.values(), *plots.values(), out.html], config=settings)
print(f"{len(per_run)} runs, {len(missing)} missing; report {out.html}")
