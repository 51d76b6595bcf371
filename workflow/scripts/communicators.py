"""Rule communicators: logical communicators and global ranks of one run from its init lines.

Incomplete communicators (members without a log) make the result partial; the reasons name the
global ranks whose logs are missing and the communicators that lack them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.communicators import infer_run_communicators  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402

dirs = [Path(p).parent for p in snakemake.input.reports]  # noqa: F821
out = Path(snakemake.output.communicators).parent  # noqa: F821
result = infer_run_communicators(dirs, out)
comms = result.communicators
incomplete = comms[~comms["complete"].astype(bool)] if len(comms) else comms
reasons = []
if len(incomplete):
    present = set(result.members["global_rank"].dropna().astype(int)) if len(result.members) else set()
    world = int(result.world_size) if result.world_size else None
    absent = sorted(set(range(world)) - present) if world else []
    ids = ", ".join(str(int(i)) for i in incomplete["logical_id"])
    who = (f"global rank(s) {', '.join(map(str, absent))} of world size {world} left no NCCL log" if absent
           else "some member ranks left no init line (missing or truncated rank logs)")
    reasons.append(f"{who}: {len(incomplete)} of {len(comms)} communicators are incomplete ({ids}); their ops "
                   "lack those ranks' calls")
elif not len(comms):
    reasons.append("no communicator init lines in the NCCL logs (NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS including "
                   "INIT is needed to relate processes); nothing can be attributed to communicators")
write_manifest(snakemake.output.manifest, stage="communicators",  # noqa: F821
               inputs=[d / "comms.parquet" for d in dirs],
               outputs=[snakemake.output.communicators, snakemake.output.members],  # noqa: F821
               partial=bool(reasons), reasons=reasons)
print(f"{len(comms)} communicators, world size {result.world_size}, {len(incomplete)} incomplete")
for row in incomplete.itertuples():
    print(f"communicator {row.logical_id}: {row.problem}")
for r in reasons:
    print(f"PARTIAL: {r}")
