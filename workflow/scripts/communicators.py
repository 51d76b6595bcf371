"""Rule communicators: logical communicators and global ranks of one run from its init lines.

Incomplete communicators (members without a log) make the result partial; the reasons name the
global ranks whose logs are missing and the communicators that lack them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.communicators import communicator_problems, infer_run_communicators  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402

dirs = [Path(p).parent for p in snakemake.input.reports]  # noqa: F821
out = Path(snakemake.output.communicators).parent  # noqa: F821
result = infer_run_communicators(dirs, out, dict(snakemake.params.settings))  # noqa: F821
reasons = communicator_problems(result)
comms = result.communicators
incomplete = comms[~comms["complete"].astype(bool)] if len(comms) else comms
write_manifest(snakemake.output.manifest, stage="communicators",  # noqa: F821
               inputs=[d / "comms.parquet" for d in dirs],
               outputs=[snakemake.output.communicators, snakemake.output.members],  # noqa: F821
               partial=bool(reasons), reasons=reasons)
print(f"{len(comms)} communicators, world size {result.world_size}, {len(incomplete)} incomplete")
for row in incomplete.itertuples():
    print(f"communicator {row.logical_id}: {row.problem}")
for r in reasons:
    print(f"PARTIAL: {r}")
