"""Rule metrics: bandwidths, wait/transfer per instance, stragglers, limits, algorithms of one run
(nccltrace.stages.metrics)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.core.layout import RunLayout  # noqa: E402
from nccltrace.stages.metrics import run_metrics  # noqa: E402

sm = snakemake  # noqa: F821
layout = RunLayout(Path(sm.output.manifest).parents[1])
run_metrics(layout, [layout.parsed_nccl(p) for p in sm.params.processes]).echo()
