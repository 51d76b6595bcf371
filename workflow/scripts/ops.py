"""Rule ops: the enriched per-operation table of one run (+ parallelism labels, clock sync)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.ops import build_run_ops, write_run_ops  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402

inp, out = snakemake.input, snakemake.output  # noqa: F821
sessions = {Path(p).parent.name: p for p in inp.sessions}
result = build_run_ops(inp.alignments, [Path(p).parent for p in inp.reports], inp.communicators, inp.members,
                       sessions, dict(snakemake.params.settings))  # noqa: F821
write_run_ops(result, out.ops, out.labels, out.clock)
calls = result.ops[result.ops["row_kind"] == "call"]
write_manifest(out.manifest, stage="ops", inputs=[*inp.alignments, inp.communicators, inp.members, *inp.sessions],
               outputs=[out.ops, out.labels, out.clock], config=dict(snakemake.params.settings),  # noqa: F821
               partial=result.partial, extra={"problems": result.problems,
                                              "calls": int(len(calls)),
                                              "matched": int((calls["status"] == "matched").sum())})
print(f"{len(calls)} calls, {(calls['status'] == 'matched').sum()} matched; problems: {result.problems}")
