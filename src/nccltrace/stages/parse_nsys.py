"""Stage parse_nsys: one node's nsys SQLite export into its tables.

An export that is missing, unreadable (garbage, truncated, interrupted) or has no NCCL kernels
does not stop the run: the node's ranks can still be counted from their logs. The stage writes
empty tables instead, ``session.json`` says ``available: false`` (or lists the problem) and the
result is partial with the reason, which every later stage carries (the align stage marks the
node's calls ``no_export``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from ..acquisition.raw import (
    WORKFLOW_REMEDY,
    Remedy,
    export_hint,
    missing_export_problem,
)
from ..nsys import reader
from ..nsys.nccl_api import NCCL_API_CALL_COLUMNS, format_summary
from ..nsys.reader import NsysExport, NsysFormatError
from ..provenance import write_manifest
from ..tables import write_json_atomic, write_table_atomic
from . import StageResult

__all__ = ["NSYS_TABLES", "run_parse_nsys"]

# The reader's column specs of the tables ``NsysExport.export_tables`` writes (same names and types).
_SPECS = {"kernels": reader.KERNEL_COLUMNS, "nvtx": reader.NVTX_COLUMNS, "processes": reader.PROCESS_COLUMNS,
          "launches_without_kernel": reader.RUNTIME_COLUMNS, "nccl_api_calls": NCCL_API_CALL_COLUMNS}
NSYS_TABLES: tuple[str, ...] = tuple(_SPECS)
"""The tables of a parsed export (``<name>.parquet``), beside ``session.json``."""


def _unavailable(export_file: Path | None, out: Path, host: str, problem: str,
                 settings: Mapping[str, Any]) -> StageResult:  # fmt: skip
    """Empty tables and a session that says why: the node's ranks get no kernel times."""
    outputs = []
    for name, spec in _SPECS.items():
        path = out / f"{name}.parquet"
        write_table_atomic(reader.spec_schema(spec).empty_table(), path)
        outputs.append(path)
    name = export_file.name if export_file is not None else f"{host}.sqlite"
    write_json_atomic(out / "session.json", {"source_file": name, "hostname": host, "available": False,
                                             "problem": problem, "utc_offset_ns": None, "session_start_utc_ns": None})
    outputs.append(out / "session.json")
    write_manifest(out / "manifest.json", stage="parse_nsys", inputs=[export_file] if export_file else [],
                   outputs=outputs, config=dict(settings), partial=True, reasons=[problem])
    return StageResult("parse_nsys", outputs, True, [problem], f"node {host}: no usable export")


def run_parse_nsys(export_file: Path | str | None, out_dir: Path | str, host: str,
                   settings: Mapping[str, Any] | None = None, *, unusable: str | None = None,
                   remedy: Remedy = WORKFLOW_REMEDY) -> StageResult:  # fmt: skip
    """Read node ``host``'s export into ``out_dir``. ``export_file`` None or absent: the node
    has no export. ``unusable``: why an earlier look (the import, which saw the file's
    surroundings) judged it unusable. ``remedy``: how the front end in use says to fix it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(settings or {})
    export_file = Path(export_file) if export_file is not None else None
    hint = export_hint(host, remedy)
    if unusable:
        return _unavailable(export_file, out, host, f"nsys export of node {host} is unusable: {unusable}. The calls "
                                                    f"of its ranks have no kernel times; {hint}", settings)
    if export_file is None or not export_file.is_file():
        return _unavailable(export_file, out, host, missing_export_problem(host, remedy), settings)
    try:
        with NsysExport.open(export_file) as export:
            written = export.export_tables(out)
            traced = "CUPTI_ACTIVITY_KIND_KERNEL" in export.table_names()
            api = export.nccl_api_summary
            versions = f"schema {export.schema_version}, product {export.product_version}"
    except NsysFormatError as e:
        # The reader's message names the file and the defect (not SQLite, truncated, corrupt page).
        return _unavailable(export_file, out, host, f"nsys export of node {host} is unusable: {e}. The calls of its "
                                                    f"ranks have no kernel times; {hint}", settings)
    problems = []
    kernels = pq.read_metadata(written["kernels"]).num_rows
    if kernels == 0:
        why = "its kernel table has no kernel named nccl*" if traced else "no CUDA kernel table: nsys did not trace CUDA"
        problems.append(f"nsys export {export_file.name} of node {host} contains no NCCL kernels ({why}): no call of "
                        f"its ranks can be aligned, so they have no kernel times or bandwidths; profile with "
                        f"`nsys profile --trace=cuda,nvtx` and re-export")
        session = json.loads(written["session"].read_text())
        write_json_atomic(written["session"], {**session, "problems": problems})
    # Not a gap in this stage's tables (the call ranges and kernel links are complete), but the
    # arguments of the calls are missing: worth saying.
    notes = [f"nsys export {export_file.name} of node {host}: {api['payload_warning']}"] if api["payload_warning"] else []
    write_manifest(out / "manifest.json", stage="parse_nsys", inputs=[export_file], outputs=list(written.values()),
                   config=settings, partial=bool(problems), reasons=problems,
                   extra={"nccl_kernels": kernels, "nccl_api_calls": api["api_calls"],
                          "nccl_api_calls_matched": api["matched"]})  # fmt: skip
    return StageResult("parse_nsys", list(written.values()), bool(problems), problems,
                       f"{versions}: {sorted(written)}, {kernels} NCCL kernels\n{format_summary(api)}", notes,
                       {"hostname": json.loads(written["session"].read_text()).get("hostname")})
