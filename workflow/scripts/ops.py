"""Rule ops: the enriched per-operation table of one run (nccltrace.stages.ops)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.core.layout import RunLayout  # noqa: E402
from nccltrace.core.settings import RunSettings  # noqa: E402
from nccltrace.stages.ops import run_ops  # noqa: E402

sm = snakemake  # noqa: F821
run_ops(RunLayout(Path(sm.output.ops).parents[1]), sm.params.processes, sm.params.hosts,
        RunSettings.from_mapping(sm.params.settings)).echo()
