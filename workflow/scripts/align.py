"""Rule align: correlate one process's NCCL call lines with its kernels.

A node without a usable export (parse_nsys wrote ``available: false``) gives every call that
needed a kernel the reason ``no_export``; that, an export without NCCL kernels, or no call matched
at all makes the alignment partial, with a reason naming the process and its node."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.align.correlate import NO_EXPORT_REASON, align_files, process_key  # noqa: E402
from nccltrace.align.quality import quality_problems, read_quality  # noqa: E402
from nccltrace.capture import CaptureWindow  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402

inp, out = snakemake.input, snakemake.output  # noqa: F821
mode = snakemake.params.mode  # noqa: F821
version = snakemake.params.nccl_version  # noqa: F821
proc = snakemake.wildcards.proc  # noqa: F821
host, pid = process_key(proc)
session = json.loads(Path(inp.session).read_text())
available = session.get("available", True)
window = CaptureWindow.of_settings(dict(snakemake.params.settings))  # noqa: F821
table = align_files(inp.calls, inp.kernels, inp.session, out.alignment, mode=mode, launches_path=inp.launches,
                    nvtx_path=inp.nvtx if available else None,
                    nccl_version=str(version) if version else None, pid=pid, export_available=available,
                    quality_path=out.quality, capture_steps=window.loop_indices if window else None)
calls = table[table["row_kind"] == "call"]
matched = int((calls["status"] == "matched").sum())
# calls that launch a kernel: not duplicate lines, not calls on single-rank communicators
needing = int((~calls["reason"].isin(["duplicate_line", "single_rank_communicator"])).sum())
summary = {
    "mode": mode,
    "calls": int(len(calls)),
    "matched": matched,
    "unmatched_by_reason": {str(k): int(v) for k, v in calls["reason"].value_counts().items()},
    "kernels_without_call": int((table["row_kind"] == "kernel").sum()),
}
problems = []
if not available:
    # the cause (which file, what is wrong) comes with the export's manifest, once per node
    problems.append(f"{proc}: {summary['unmatched_by_reason'].get(NO_EXPORT_REASON, 0)} calls have no kernel "
                    f"(reason '{NO_EXPORT_REASON}': no usable nsys export of node {host})")
problems += quality_problems(proc, read_quality(out.quality))
if available and needing and not matched and not problems:
    problems.append(f"{proc}: none of its {needing} calls matched a kernel of node {host}'s export "
                    f"({session.get('source_file', host + '.sqlite')}); no times or bandwidths for this rank")
write_manifest(out.manifest, stage="align", inputs=[inp.calls, inp.kernels, inp.session],
               outputs=[out.alignment, out.quality],
               config={"mode": mode}, partial=bool(problems), reasons=problems, extra={"summary": summary})
print(summary)
for p in problems:
    print(f"PARTIAL: {p}")
