"""Rule report: a run's summary tables (Parquet + CSV), plots and self-contained HTML report
(nccltrace.stages.report)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.run_layout import RunLayout  # noqa: E402
from nccltrace.stages.report import run_report  # noqa: E402

inp = snakemake.input  # noqa: F821
run = snakemake.wildcards.run  # noqa: F821
result = run_report(RunLayout(Path(inp.ops).parents[1]), run)
print(result.summary)
if result.partial:
    # on Snakemake's console too: a partial run must not look complete there either
    print(f"PARTIAL: run {run}: " + "; ".join(result.problems[:3]) + f" (see {snakemake.output.html})",  # noqa: F821
          file=sys.__stderr__)
