"""Rule report: a run's summary tables (Parquet + CSV), plots and self-contained HTML report
(nccltrace.stages.report)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.core.layout import RunLayout  # noqa: E402
from nccltrace.stages.report import run_report  # noqa: E402

sm = snakemake  # noqa: F821
result = run_report(RunLayout(Path(sm.output.manifest).parents[1]), sm.wildcards.run, sm.params.processes,
                    sm.params.hosts)
print(result.summary)
if result.partial:
    # on Snakemake's console too: a partial run must not look complete there either
    print(f"PARTIAL: run {sm.wildcards.run}: " + "; ".join(result.problems[:3]) + f" (see {sm.output.html})",
          file=sys.__stderr__)
