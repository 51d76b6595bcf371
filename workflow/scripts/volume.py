"""Rule volume: theoretical vs observed communication volume per rank of one run (thesis table 5.1
style; nccltrace.stages.volume)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.run_layout import RunLayout  # noqa: E402
from nccltrace.stages.volume import run_volume  # noqa: E402

inp = snakemake.input  # noqa: F821
result = run_volume(RunLayout(Path(inp.ops).parents[1]), snakemake.wildcards.run,  # noqa: F821
                    dict(snakemake.params.settings), raw_dir=Path(inp.raw))  # noqa: F821
print(result.summary)
