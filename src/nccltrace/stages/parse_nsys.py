"""Stage parse_nsys: one node's nsys SQLite export into its tables.

An export that is missing, unreadable (garbage, truncated, interrupted) or has no NCCL kernels
does not stop the run: the node's ranks can still be counted from their logs. The stage writes
empty tables instead, ``session.json`` says ``available: false`` (or lists the problem) and the
result is partial with the reason, which every later stage carries (the align stage marks the
node's calls ``no_export``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from nccltrace.acquisition.status import (
    WORKFLOW_REMEDY,
    Remedy,
    export_hint,
    missing_export_problem,
)
from nccltrace.core.layout import MANIFEST_FILE, SESSION_FILE
from nccltrace.core.provenance import write_manifest
from nccltrace.core.tables import write_json_atomic, write_table_atomic
from nccltrace.nsys.nccl_api import NCCL_API_CALLS_SCHEMA, format_summary
from nccltrace.nsys.reader import NsysExport, NsysFormatError
from nccltrace.nsys.schema import KERNEL_SOURCE_TABLES, spec_schema
from nccltrace.stages import StageResult

if TYPE_CHECKING:  # annotations only: the settings code is not in this stage's code stamp
    from nccltrace.core.settings import RunSettings

__all__ = ["NSYS_TABLES", "run_parse_nsys"]

# The schemas of the tables ``NsysExport.export_tables`` writes (same names and types).
_SCHEMAS = {**{name: spec_schema(spec) for name, spec in KERNEL_SOURCE_TABLES.items()},
            "nccl_api_calls": NCCL_API_CALLS_SCHEMA}
NSYS_TABLES: tuple[str, ...] = tuple(_SCHEMAS)
"""The tables of a parsed export (``<name>.parquet``), beside ``session.json``."""


def _unavailable(export_file: Path | None, out: Path, host: str, problem: str,
                 settings: Mapping[str, Any]) -> StageResult:  # fmt: skip
    """Empty tables and a session that says why: the node's ranks get no kernel times."""
    outputs = []
    for name, schema in _SCHEMAS.items():
        path = out / f"{name}.parquet"
        write_table_atomic(schema.empty_table(), path)
        outputs.append(path)
    name = export_file.name if export_file is not None else f"{host}.sqlite"
    write_json_atomic(out / SESSION_FILE, {"source_file": name, "hostname": host, "available": False,
                                             "problem": problem, "utc_offset_ns": None, "session_start_utc_ns": None})
    outputs.append(out / SESSION_FILE)
    write_manifest(out / MANIFEST_FILE, stage="parse_nsys", inputs=[export_file] if export_file else [],
                   outputs=outputs, config=dict(settings), partial=True, reasons=[problem])
    return StageResult("parse_nsys", outputs, True, [problem], f"node {host}: no usable export")


def run_parse_nsys(export_file: Path | str | Sequence[Path | str] | None, out_dir: Path | str, host: str,
                   settings: RunSettings | Mapping[str, Any] | None = None, *, unusable: str | None = None,
                   remedy: Remedy = WORKFLOW_REMEDY) -> StageResult:  # fmt: skip
    """Read node ``host``'s kernel source into ``out_dir``. ``export_file``: its nsys export;
    None or absent: the node has no export; a list: several sources of the node (nsys exports
    per process, and/or directories of profiler-trace tables staged by
    :func:`nccltrace.inputs.kernel_sources.stage_traces`), merged on one clock
    (:func:`nccltrace.inputs.kernel_sources.merge_sources`). ``unusable``: why an earlier look (the
    import, which saw the file's surroundings) judged it unusable. ``remedy``: how the front end
    in use says to fix it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(settings or {})  # recorded as given
    if isinstance(export_file, (list, tuple)):
        sources = [Path(p) for p in export_file]
        if len(sources) == 1 and not sources[0].is_dir():
            export_file = sources[0]
        elif sources and not unusable:
            return _parse_sources(sources, out, host, settings, remedy)
        else:
            export_file = None
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
    write_manifest(out / MANIFEST_FILE, stage="parse_nsys", inputs=[export_file], outputs=list(written.values()),
                   config=settings, partial=bool(problems), reasons=problems,
                   extra={"nccl_kernels": kernels, "nccl_api_calls": api["api_calls"],
                          "nccl_api_calls_matched": api["matched"]})  # fmt: skip
    return StageResult("parse_nsys", list(written.values()), bool(problems), problems,
                       f"{versions}: {sorted(written)}, {kernels} NCCL kernels\n{format_summary(api)}", notes,
                       {"hostname": json.loads(written["session"].read_text()).get("hostname")})


def _parse_sources(sources: list[Path], out: Path, host: str, settings: dict[str, Any],
                   remedy: Remedy) -> StageResult:  # fmt: skip
    """Several kernel sources of one node: each nsys export parsed into ``sources/<name>/``,
    staged profiler-trace tables taken as they are, then merged into the node's tables."""
    from nccltrace.inputs.kernel_sources import merge_sources

    parts: list[Path] = []
    problems: list[str] = []
    notes: list[str] = []
    inputs: list[Path] = []
    for src in sources:
        if src.is_dir():
            parts.append(src)
            inputs.append(src / SESSION_FILE)
            s = json.loads((src / SESSION_FILE).read_text())
            if s.get("truncated"):
                problems.append(f"profiler trace {s.get('source_file')} of node {host} is cut short "
                                f"({s['truncated']}): kernels after the cut are missing; copy the whole trace again")
            continue
        inputs.append(src)
        try:
            with NsysExport.open(src) as export:
                dest = out / "sources" / src.stem
                export.export_tables(dest)
                if export.nccl_api_summary and export.nccl_api_summary.get("payload_warning"):
                    notes.append(f"nsys export {src.name} of node {host}: {export.nccl_api_summary['payload_warning']}")
            parts.append(dest)
        except NsysFormatError as e:
            problems.append(f"nsys export of node {host} is unusable: {e}. The calls of the processes it recorded "
                            f"have no kernel times; {export_hint(host, remedy)}")
    if not parts:
        return _unavailable(sources[0], out, host, "; ".join(problems) or missing_export_problem(host, remedy),
                            settings)
    written = merge_sources(parts, out, host)
    session = json.loads(written["session"].read_text())
    problems += session.get("problems") or []
    kernels = pq.read_metadata(written["kernels"]).num_rows
    if kernels == 0:
        problems.append(f"the kernel sources of node {host} ({session['source_file']}) contain no NCCL kernels: "
                        "no call of its ranks can be aligned, so they have no kernel times or bandwidths; profile with CUDA "
                        "activity traced and NCCL in use")
    if problems:
        write_json_atomic(written["session"], {**session, "problems": problems})
    write_manifest(out / MANIFEST_FILE, stage="parse_nsys", inputs=inputs, outputs=list(written.values()),
                   config=settings, partial=bool(problems), reasons=problems,
                   extra={"nccl_kernels": kernels, "sources": [s.get("source_file") for s in session["sources"]],
                          "source_kind": session["source_kind"]})  # fmt: skip
    return StageResult("parse_nsys", list(written.values()), bool(problems), problems,
                       f"{len(parts)} kernel sources ({session['source_kind']}): {kernels} NCCL kernels", notes,
                       {"hostname": host})
