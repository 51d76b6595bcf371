"""Rule parse_nccl: parse one process's NCCL debug log (nccltrace.stages.parse_nccl)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.run_layout import RunLayout  # noqa: E402
from nccltrace.stages.parse_nccl import run_parse_nccl  # noqa: E402

sm = snakemake  # noqa: F821
proc = sm.wildcards.proc
run_parse_nccl(RunLayout.of_raw(sm.input.raw).raw_log(proc), Path(sm.output.report).parent,
               dict(sm.params.settings)).echo()
