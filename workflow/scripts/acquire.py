"""Rule acquire: a run's immutable raw/ directory, by backend (nccltrace.stages.acquire)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup

setup(snakemake)  # noqa: F821
from nccltrace.campaign.code_stamps import stage_code_hash
from nccltrace.stages.acquire import run_acquire

sm = snakemake  # noqa: F821
emulated = sm.params.backend == "emulate"
run_acquire(sm.output.raw, sm.wildcards.run, sm.params.backend, sm.params.settings, nsys=sm.params.nsys,
            capture=getattr(sm.input, "capture", None), exports=list(getattr(sm.input, "exports", [])),
            workers=sm.threads, emulator_code=stage_code_hash("emulate") if emulated else None)
