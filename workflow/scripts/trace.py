"""Rule trace: the run's Chrome Trace Event JSON (gzip), one process per rank, for Perfetto
(nccltrace.stages.trace)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.core.layout import RunLayout  # noqa: E402
from nccltrace.stages.trace import run_trace  # noqa: E402

sm = snakemake  # noqa: F821
run_trace(RunLayout(Path(sm.output.manifest).parents[1]), dict(sm.params.options), sm.params.processes,
          sm.params.hosts).echo()
