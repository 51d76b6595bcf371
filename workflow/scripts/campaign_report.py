"""Rule campaign_report: every configuration side by side (nccltrace.stages.campaign_report)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.stages.campaign_report import run_campaign_report  # noqa: E402

sm = snakemake  # noqa: F821
run_campaign_report(sm.input.reports, Path(sm.output.html).parent, dict(sm.params.settings),
                    dict(sm.params.failed)).echo()
