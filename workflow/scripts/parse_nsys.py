"""Rule parse_nsys: read one node's nsys SQLite export.

An export that is missing, unreadable (garbage, truncated, interrupted) or has no NCCL kernels
does not stop the run: the node's ranks can still be counted from their logs. The job writes
empty tables instead, ``session.json`` says ``available: false`` (or lists the problem) and the
manifest is partial with the reason, which every later stage carries (the align stage marks the
node's calls ``no_export``)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from nccltrace.acquisition.raw import export_hint, missing_export_problem, read_status  # noqa: E402
from nccltrace.nsys import reader  # noqa: E402
from nccltrace.nsys.nccl_api import NCCL_API_CALL_COLUMNS, format_summary  # noqa: E402
from nccltrace.nsys.reader import NsysExport, NsysFormatError  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402
from nccltrace.tables import write_json_atomic  # noqa: E402

host = snakemake.wildcards.host  # noqa: F821
export_file = Path(snakemake.input.raw) / "nsys" / f"{host}.sqlite"  # noqa: F821
out = Path(snakemake.output.session).parent  # noqa: F821
settings = dict(snakemake.params.settings)  # noqa: F821
_HINT = export_hint(host)
_KINDS = {"int64": pa.int64(), "Int64": pa.int64(), "UInt64": pa.uint64(), "float64": pa.float64(),
          "object": pa.string()}
# The reader's column specs of the tables export_tables writes (same names and types).
_SPECS = {"kernels": reader.KERNEL_COLUMNS, "nvtx": reader.NVTX_COLUMNS, "processes": reader.PROCESS_COLUMNS,
          "launches_without_kernel": reader.RUNTIME_COLUMNS, "nccl_api_calls": NCCL_API_CALL_COLUMNS}


def unavailable(problem: str) -> None:
    """Empty tables and a session that says why: the node's ranks get no kernel times."""
    outputs = []
    for name, spec in _SPECS.items():
        path = out / f"{name}.parquet"
        pq.write_table(pa.schema([(c, _KINDS[k]) for c, k in spec]).empty_table(), path)
        outputs.append(path)
    session = {"source_file": export_file.name, "hostname": host, "available": False, "problem": problem,
               "utc_offset_ns": None, "session_start_utc_ns": None}
    write_json_atomic(out / "session.json", session)
    write_manifest(snakemake.output.manifest, stage="parse_nsys", inputs=[export_file],  # noqa: F821
                   outputs=[*outputs, out / "session.json"], config=settings, partial=True, reasons=[problem])
    print(f"PARTIAL: {problem}", file=sys.__stderr__)  # also on Snakemake's console, not only in the log
    print(problem)


out.mkdir(parents=True, exist_ok=True)
found_unusable = read_status(snakemake.input.raw).get("unusable_exports") or {}  # noqa: F821
if host in found_unusable:
    # judged at import, where the file's surroundings (a leftover journal) were visible
    unavailable(f"nsys export of node {host} is unusable: {found_unusable[host]}. The calls of its ranks have no "
                f"kernel times; {_HINT}")
    raise SystemExit(0)
if not export_file.is_file():
    unavailable(missing_export_problem(host))
    raise SystemExit(0)
try:
    export = NsysExport.open(export_file)
    written = export.export_tables(out)
except NsysFormatError as e:
    # The reader's message names the file and the defect (not SQLite, truncated, corrupt page).
    unavailable(f"nsys export of node {host} is unusable: {e}. The calls of its ranks have no kernel times; {_HINT}")
    raise SystemExit(0)
problems = []
kernels = pq.read_metadata(written["kernels"]).num_rows
if kernels == 0:
    traced = "CUPTI_ACTIVITY_KIND_KERNEL" in export.table_names()
    why = ("its kernel table has no kernel named nccl*" if traced
           else "no CUDA kernel table: nsys did not trace CUDA")
    problems.append(f"nsys export {export_file.name} of node {host} contains no NCCL kernels ({why}): no call of "
                    f"its ranks can be aligned, so they have no kernel times or bandwidths; profile with "
                    f"`nsys profile --trace=cuda,nvtx` and re-export")
if problems:
    session = json.loads(written["session"].read_text())
    write_json_atomic(written["session"], {**session, "problems": problems})
    for p in problems:
        print(f"PARTIAL: {p}", file=sys.__stderr__)
api = export.nccl_api_summary
write_manifest(snakemake.output.manifest, stage="parse_nsys", inputs=[export_file],  # noqa: F821
               outputs=list(written.values()), config=settings, partial=bool(problems), reasons=problems,
               extra={"nccl_kernels": kernels, "nccl_api_calls": api["api_calls"],
                      "nccl_api_calls_matched": api["matched"]})
print(f"schema {export.schema_version}, product {export.product_version}: {sorted(written)}, "
      f"{kernels} NCCL kernels; problems: {problems}")
print(format_summary(api))
if api["payload_warning"]:
    # Not a gap in this stage's tables (the call ranges and kernel links are complete), but the
    # arguments of the calls are missing: say so on Snakemake's console too.
    print(f"NOTE: nsys export {export_file.name} of node {host}: {api['payload_warning']}", file=sys.__stderr__)
    print(f"NOTE: {api['payload_warning']}")
