"""Rule trace: the run's Chrome Trace Event JSON (gzip), one process per rank, for Perfetto
(nccltrace.stages.trace)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.run_layout import RunLayout  # noqa: E402
from nccltrace.stages.trace import run_trace  # noqa: E402

inp = snakemake.input  # noqa: F821
result = run_trace(RunLayout(Path(inp.ops).parents[1]), dict(snakemake.params.options),  # noqa: F821
                   nvtx=[Path(p) for p in inp.nvtx], sessions=[Path(p) for p in inp.sessions])
print(result.summary)
