"""Rule volume: theoretical vs observed communication volume per rank of one run (thesis table 5.1
style; nccltrace.stages.volume)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.core.layout import RunLayout  # noqa: E402
from nccltrace.core.settings import RunSettings  # noqa: E402
from nccltrace.stages.volume import run_volume  # noqa: E402

sm = snakemake  # noqa: F821
layout = RunLayout.of_raw(sm.input.raw)
run_volume(layout, sm.wildcards.run, RunSettings.from_mapping(sm.params.settings), run_yaml=layout.run_yaml).echo()
