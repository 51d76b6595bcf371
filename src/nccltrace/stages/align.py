"""Stage align: correlate one process's NCCL call lines with its node's kernels.

A node without a usable export (parse_nsys wrote ``available: false``) gives every call that
needed a kernel the reason ``no_export``; that, an export without NCCL kernels, a check of the
alignment's quality that failed, or no call matched at all makes the alignment partial, with a
reason naming the process and its node."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from nccltrace.align.correlate import align_files
from nccltrace.align.quality import (
    quality_findings,
    quality_problems,
    read_quality,
)
from nccltrace.align.schema import NO_EXPORT_REASON
from nccltrace.align.tuning_carry import read_donor_facts, tuning_donors
from nccltrace.core.layout import (
    CALLS_FILE,
    COMM_RECORDS_FILE,
    KERNELS_FILE,
    LAUNCHES_FILE,
    NVTX_FILE,
    RunLayout,
    process_key,
    process_name,
)
from nccltrace.core.provenance import write_manifest
from nccltrace.core.tables import read_table
from nccltrace.stages import StageResult

__all__ = ["AlignFiles", "align_process_files", "alignment_summary", "run_align"]


def alignment_summary(table: pd.DataFrame, mode: str) -> dict[str, Any]:
    """Counts of an alignment table (what the align manifest records)."""
    calls = table[table["row_kind"] == "call"]
    return {
        "mode": mode,
        "calls": len(calls),
        "matched": int((calls["status"] == "matched").sum()),
        "unmatched_by_reason": {str(k): int(v) for k, v in calls["reason"].value_counts().items()},
        "kernels_without_call": int((table["row_kind"] == "kernel").sum()),
    }


@dataclass(frozen=True)
class AlignFiles:
    """The files one process's alignment reads and writes: the run's layout gives them
    (:func:`run_align`), ``nccltrace align`` takes them from its arguments."""

    calls: Path  # the process's parsed calls
    kernels: Path  # its node's parsed kernels
    session: Path | None  # the export's session record (None: none given)
    launches: Path | None  # launches without a kernel (None: not read)
    nvtx: Path | None  # NVTX ranges (None: not read)
    table: Path  # the alignment table written
    quality: Path  # the alignment-quality record written
    manifest: Path
    listed_calls: Path | None = None  # the calls the manifest names, when ``calls`` is a filtered copy

    @classmethod
    def of_run(cls, layout: RunLayout, proc: str, host: str, *, nvtx: bool = True) -> AlignFiles:
        """Process ``proc``'s files in a run (``nvtx``: read the export's NVTX ranges)."""
        nsys, out = layout.parsed_nsys(host), layout.aligned(proc)
        return cls(layout.parsed_nccl(proc) / CALLS_FILE, nsys / KERNELS_FILE, layout.session(host),
                   nsys / LAUNCHES_FILE, nsys / NVTX_FILE if nvtx else None, layout.alignment(proc),
                   layout.alignment_quality(proc), layout.manifest(out))  # fmt: skip


def run_align(layout: RunLayout, proc: str, host: str, *, mode: str = "default", nccl_version: str | None = None,
              capture_steps: tuple[int, int] | None = None) -> StageResult:  # fmt: skip
    """Align process ``proc`` (``parsed/nccl/<proc>/``) with node ``host``'s parsed export
    (``parsed/nsys/<host>/``) into ``aligned/<proc>/``. ``capture_steps``: the captured steps
    of a step-window capture (0-based loop indices, see :func:`~nccltrace.align.correlate.align_process`)."""
    files = AlignFiles.of_run(layout, proc, host)
    # The pid of the calls is the process's own; a log with no call lines carries none, so its
    # name gives it. (Given no pid, lines of another process in the file are found and set aside.)
    pid = None if pq.read_metadata(files.calls).num_rows else process_key(proc)[1]
    return align_process_files(files, proc, host, mode=mode, pid=pid, nccl_version=nccl_version,
                               capture_steps=capture_steps, carried_tuning=_rank0_tuning(layout, proc))  # fmt: skip


def align_process_files(files: AlignFiles, proc: str, host: str, *, mode: str = "default", pid: int | None = None,
                        nccl_version: str | None = None, capture_steps: tuple[int, int] | None = None,
                        carried_tuning: dict[int, pd.DataFrame] | None = None,
                        config: dict[str, Any] | None = None) -> StageResult:  # fmt: skip
    """The align stage on explicit files: align, judge the result (partial and why), write the
    manifest. ``proc``/``host`` name the process and its node in the messages; ``config``: what
    the manifest records of the call (default: the mode). An export the session marks
    unavailable gives every call that needed a kernel the reason ``no_export``."""
    session = json.loads(files.session.read_text()) if files.session is not None else {}
    available = session.get("available", True)
    table = align_files(files.calls, files.kernels, files.session, files.table, mode=mode,
                        launches_path=files.launches, nvtx_path=files.nvtx if available else None,
                        nccl_version=str(nccl_version) if nccl_version else None, pid=pid,
                        export_available=available, quality_path=files.quality,
                        capture_steps=capture_steps, carried_tuning=carried_tuning)  # fmt: skip
    summary = alignment_summary(table, mode)
    calls_tab = table[table["row_kind"] == "call"]
    # calls that launch a kernel: not duplicate lines, not calls on single-rank communicators
    needing = int((~calls_tab["reason"].isin(["duplicate_line", "single_rank_communicator"])).sum())
    problems = []
    if not available:
        # the cause (which file, what is wrong) comes with the export's manifest, once per node
        problems.append(f"{proc}: {summary['unmatched_by_reason'].get(NO_EXPORT_REASON, 0)} calls have no kernel "
                        f"(reason '{NO_EXPORT_REASON}': no usable nsys export of node {host})")
    record = read_quality(files.quality)
    record = _with_profiler_check(record, files, table, host, proc) if available else record
    problems += quality_problems(proc, record)
    if available and needing and not summary["matched"] and not problems:
        problems.append(f"{proc}: none of its {needing} calls matched a kernel of node {host}'s export "
                        f"({session.get('source_file', host + '.sqlite')}); no times or bandwidths for this rank")
    notes = _window_notes(proc, record) + quality_findings(proc, record)
    outputs = [files.table, files.quality]
    # the members table is read too (rank 0's TUNING lines), but not listed: a manifest takes
    # its inputs' partial flags, and another node's missing export must not mark this one partial
    inputs = [p for p in (files.listed_calls or files.calls, files.kernels, files.session) if p is not None]
    write_manifest(files.manifest, stage="align", inputs=inputs, outputs=outputs,
                   config=config if config is not None else {"mode": mode}, partial=bool(problems),
                   reasons=problems, extra={"summary": summary})  # fmt: skip
    return StageResult("align", outputs, bool(problems), problems, str(summary), notes, details={"summary": summary})


def _with_profiler_check(record: dict[str, Any], files: AlignFiles, table: pd.DataFrame, host: str,
                         proc: str) -> dict[str, Any]:  # fmt: skip
    """The quality record with the profiler trace's own records of the matched calls checked
    (:mod:`~nccltrace.align.profiler_check`), rewritten when the node's kernel source has any."""
    from nccltrace.align.profiler_check import profiler_records_check
    from nccltrace.align.quality import write_quality

    comm_path = files.kernels.parent / COMM_RECORDS_FILE
    try:
        pid = process_key(proc)[1]
    except ValueError:
        return record
    kernels = read_table(files.kernels)
    comm = read_table(comm_path) if comm_path.exists() else None
    check = profiler_records_check(table, read_table(files.calls, columns=["file", "line", "count"]), kernels, comm, pid)
    if check is None:
        return record
    record = {**record, "checks": [*record.get("checks", []), check]}
    write_quality(files.quality, record.get("process", proc), {k: v for k, v in record.items() if k != "process"})
    return record


def _rank0_tuning(layout: RunLayout, proc: str) -> dict[int, pd.DataFrame] | None:
    """What the TUNING lines of rank 0 of each of the process's other communicators say of its
    calls (:mod:`~nccltrace.align.tuning_carry`), from the run's members table (the
    communicators stage) and rank 0's parsed log; None before the communicators stage ran."""
    if not layout.members.exists():
        return None
    try:
        host, pid = process_key(proc)
    except ValueError:
        return None
    donors = tuning_donors(read_table(layout.members), host, pid)
    parsed = {(h, p): layout.parsed_nccl(process_name(h, p)) for h, p, _ in donors.values()}
    return read_donor_facts(parsed, donors, host)


_LOCATED_BY = {"profiler_steps": "the trace's step markers", "trace_sequence": "the trace's kernel sequence",
               "declared_steps": "the declared steps", "log_time": "log timestamps"}  # fmt: skip


def _window_notes(proc: str, quality: dict[str, Any]) -> list[str]:
    """Where a located capture window lies in the process's log (console)."""
    window = next((c for c in quality.get("checks", []) if c.get("check") == "capture_window"), None)
    if not window or not window.get("lines") or window.get("located_by") not in _LOCATED_BY:
        return []
    a, b = window["lines"]
    steps = ""
    if window.get("first_step") is not None:
        steps = f"the capture starts at Megatron iteration {int(window['first_step']) + 1} (loop index " \
                f"{int(window['first_step'])}); "
    return [f"{proc}: {steps}its calls are lines {a}-{b} of the log, located by {_LOCATED_BY[window['located_by']]}; "
            f"{int(window.get('outside') or 0)} other call lines outside the capture"]
