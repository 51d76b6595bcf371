"""Rule ops: the enriched per-operation table of one run (+ parallelism labels, clock sync)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.ops import stream_run_ops, write_run_ops  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402

inp, out = snakemake.input, snakemake.output  # noqa: F821
sessions = {Path(p).parent.name: p for p in inp.sessions}
result = stream_run_ops(inp.alignments, [Path(p).parent for p in inp.reports], inp.communicators, inp.members,
                        sessions, dict(snakemake.params.settings), out.ops,  # noqa: F821
                        quality_paths=inp.qualities)
write_run_ops(result, None, out.labels, out.clock, out.quality)
write_manifest(out.manifest, stage="ops",
               inputs=[*inp.alignments, *inp.qualities, inp.communicators, inp.members, *inp.sessions],
               outputs=[out.ops, out.labels, out.clock, out.quality], config=dict(snakemake.params.settings),  # noqa: F821
               partial=result.partial, extra={"problems": result.problems, "notes": result.notes,
                                              "calls": result.calls, "matched": result.matched})
print(f"{result.calls} calls, {result.matched} matched; notes: {result.notes}")
for p in result.problems:
    print(f"PARTIAL: {p}")
