"""Rule parse_nccl: parse one process's NCCL debug log."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.nccl.log_reader import parse_logs  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402

log_file = Path(snakemake.input.raw) / "nccl" / f"{snakemake.wildcards.proc}.log"  # noqa: F821
out = Path(snakemake.output.report).parent  # noqa: F821
report = parse_logs([log_file], out, base=log_file.parent)
write_manifest(snakemake.output.manifest, stage="parse_nccl", inputs=[log_file],  # noqa: F821
               outputs=snakemake.output.tables + [snakemake.output.report], partial=report.partial,  # noqa: F821
               config=dict(snakemake.params.settings))  # noqa: F821
print({k: v for k, v in sorted(report.counts.items())})
