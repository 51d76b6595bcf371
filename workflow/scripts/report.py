"""Rule report: a run's summary tables (Parquet + CSV), plots and self-contained HTML report."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.plots import run_plots  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402
from nccltrace.report import render_run_report  # noqa: E402
from nccltrace.summary import OP_METRICS_COLUMNS, OPS_COLUMNS, run_tables, write_tables  # noqa: E402
from nccltrace.tables import read_table  # noqa: E402

inp, out = snakemake.input, snakemake.output  # noqa: F821
run = snakemake.wildcards.run  # noqa: F821
run_dir = Path(inp.ops).parents[1]
# only the columns the tables and plots use: the run's ops table is never loaded whole
ops = read_table(inp.ops, columns=OPS_COLUMNS)
tables = run_tables(ops, read_table(inp.op_metrics, columns=OP_METRICS_COLUMNS), read_table(inp.volume),
                    read_table(inp.quality))
written = write_tables(tables, out.tables)
plots = run_plots(ops, tables, out.plots, title=run)
render_run_report(run_dir, out.html, tables_dir=out.tables, plots_dir=out.plots, run_id=run)
manifest = write_manifest(out.manifest, stage="report",
                          # the parse summary first: its reasons (missing logs, exports) lead the list
                          inputs=[inp.summary, inp.ops, inp.quality, inp.op_metrics, inp.volume, inp.trace],
                          outputs=[*written.values(), *plots.values(), out.html])
print(f"{len(written)} table files, {len(plots)} plots, report {out.html}")
if manifest["partial"]:
    # on Snakemake's console too: a partial run must not look complete there either
    print(f"PARTIAL: run {run}: " + "; ".join(manifest["partial_reasons"][:3]) + f" (see {out.html})",
          file=sys.__stderr__)
