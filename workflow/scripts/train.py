"""Rule train (backend slurm): run Megatron-LM under nsys with NCCL logging on the job's nodes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.acquisition.launch import TrainingSetup, parse_minutes, run_training  # noqa: E402

sm = snakemake  # noqa: F821
record = run_training(
    sm.wildcards.run,
    dict(sm.params.settings),
    TrainingSetup.from_config(sm.params.training),
    Path(sm.output.capture),
    runtime_minutes=parse_minutes(sm.params.runtime),
)
print(f"{sm.wildcards.run}: {record['status']}" + (f" ({record['reason']})" if record["reason"] else ""))
