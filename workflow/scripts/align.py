"""Rule align: correlate one process's NCCL call lines with its kernels."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.align.correlate import align_files, process_key  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402

inp, out = snakemake.input, snakemake.output  # noqa: F821
mode = snakemake.params.mode  # noqa: F821
version = snakemake.params.nccl_version  # noqa: F821
table = align_files(inp.calls, inp.kernels, inp.session, out.alignment, mode=mode, launches_path=inp.launches,
                    nvtx_path=inp.nvtx if mode == "exact" else None,
                    nccl_version=str(version) if version else None,
                    pid=process_key(snakemake.wildcards.proc)[1])  # noqa: F821
calls = table[table["row_kind"] == "call"]
summary = {
    "mode": mode,
    "calls": int(len(calls)),
    "matched": int((calls["status"] == "matched").sum()),
    "unmatched_by_reason": {str(k): int(v) for k, v in calls["reason"].value_counts().items()},
    "kernels_without_call": int((table["row_kind"] == "kernel").sum()),
}
write_manifest(out.manifest, stage="align", inputs=[inp.calls, inp.kernels, inp.session], outputs=[out.alignment],
               config={"mode": mode}, partial=False, extra={"summary": summary})
print(summary)
