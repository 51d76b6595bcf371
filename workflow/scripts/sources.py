"""Checkpoint sources: the processes of a run without NCCL logs, from its profiler traces and
Flight Recorder dumps, and the traces read once (nccltrace.stages.sources)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.core.layout import RunLayout  # noqa: E402
from nccltrace.stages.sources import run_sources  # noqa: E402

sm = snakemake  # noqa: F821
run_sources(RunLayout.of_raw(sm.input.raw)).echo()
