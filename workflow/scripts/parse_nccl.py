"""Rule parse_nccl: parse one process's NCCL debug log.

The result is partial when records could not be read and when the log ends mid-line: the
process was killed while writing (or the copy is incomplete), so the log stops before the run
did; the manifest's reasons say which file and what is lost."""

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
with open(log_file, "rb") as fh:
    fh.seek(0, 2)
    size = fh.tell()
    fh.seek(max(size - 1, 0))
    # NCCL ends every record with a newline; a log that does not stopped while being written
    cut = size > 0 and fh.read(1) != b"\n"
partial = report.partial or cut
reasons = []
if partial:
    files = report.as_dict()["files"]
    for f in files:
        reasons += [f"{f['file']}" + (f" line {i['line']}" if i.get("line") else "") + f": {i['message']}"
                    for i in f["issues"]]  # fmt: skip
        if f["counts"].get("lost_records"):
            reasons.append(f"{f['file']}: {f['counts']['lost_records']} NCCL record(s) could not be read (damaged "
                           "or torn lines); tables built from this log miss them")
    if cut:
        lines = files[0]["lines"] if files else "?"
        reasons.append(f"{log_file.name}: ends mid-line (line {lines}): the process was killed while writing its "
                       "log, or the copy is incomplete; its last record is lost and its calls after that point are "
                       "missing (their kernels have no log line). Copy the log again if the copy was cut")
write_manifest(snakemake.output.manifest, stage="parse_nccl", inputs=[log_file],  # noqa: F821
               outputs=snakemake.output.tables + [snakemake.output.report], partial=partial,  # noqa: F821
               reasons=reasons, config=dict(snakemake.params.settings))  # noqa: F821
print({k: v for k, v in sorted(report.counts.items())})
for r in reasons:
    print(f"PARTIAL: {r}")
