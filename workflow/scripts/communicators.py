"""Rule communicators: logical communicators and global ranks of one run
(nccltrace.stages.communicators)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.core.layout import RunLayout  # noqa: E402
from nccltrace.core.settings import RunSettings  # noqa: E402
from nccltrace.stages.communicators import run_communicators  # noqa: E402

sm = snakemake  # noqa: F821
run_communicators(RunLayout(Path(sm.output.communicators).parents[1]), sm.params.processes,
                  RunSettings.from_mapping(sm.params.settings), sm.params.hosts).echo()
