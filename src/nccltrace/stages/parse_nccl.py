"""Stage parse_nccl: one process's NCCL debug log into its tables.

The result is partial when records could not be read and when the log ends mid-line: the
process was killed while writing (or the copy is incomplete), so the log stops before the run
did; the reasons name the file, the line and what is lost."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nccltrace.core.layout import LOG_ORIGIN_FILE, MANIFEST_FILE, PARSE_REPORT_FILE
from nccltrace.core.provenance import write_manifest
from nccltrace.core.tables import write_json_atomic
from nccltrace.nccl.log_reader import TABLE_NAMES, ParseReport, parse_logs
from nccltrace.nccl.parse_report import log_problems
from nccltrace.stages import StageResult

if TYPE_CHECKING:  # annotations only: the settings code is not in this stage's code stamp
    from nccltrace.core.settings import RunSettings

__all__ = ["log_problems", "run_parse_nccl"]


def _ends_mid_line(log_file: Path) -> bool:
    """NCCL ends every record with a newline; a log that does not stopped while being written."""
    with open(log_file, "rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        if size == 0:
            return False
        fh.seek(size - 1)
        return fh.read(1) != b"\n"


def _cut_problem(log_file: Path, report: ParseReport) -> str:
    """The problem of a log that ends mid-line (its last record is lost)."""
    lines = next((f.lines for f in report.files if Path(f.file).name == log_file.name), "?")
    return (f"{log_file.name}: ends mid-line (line {lines}): the process was killed while writing its log, or the "
            "copy is incomplete; its last record is lost and its calls after that point are missing (their kernels "
            "have no log line). Copy the log again if the copy was cut")


def _log_origin(log_file: Path) -> dict[str, Any] | None:
    import json

    sources = log_file.parent / "sources.json"
    if not sources.is_file():
        return None
    doc = json.loads(sources.read_text())
    launcher = (doc.get("launcher_ranks") or {}).get(log_file.stem)
    own = (doc.get("own_files") or {}).get(log_file.stem)
    out = {"launcher": dict(launcher) if isinstance(launcher, dict) and isinstance(launcher.get("rank"), int) else None,
           "own_file": own if isinstance(own, str) else None}
    return out if any(out.values()) else None


def run_parse_nccl(log_file: Path | str | Sequence[Path | str], out_dir: Path | str,
                   settings: RunSettings | Mapping[str, Any] | None = None, *,
                   progress: Callable[[int], None] | None = None) -> StageResult:  # fmt: skip
    """Parse ``log_file`` (one process's NCCL log) into ``out_dir``: the tables of
    :data:`~nccltrace.nccl.log_reader.TABLE_NAMES`, ``parse_report.json`` and the manifest.
    Several logs (``nccltrace parse-nccl`` of a directory) give one set of tables. The
    :class:`~nccltrace.nccl.log_reader.ParseReport` is ``details["report"]``; the problems of
    logs that end mid-line also ``details["cut"]``. ``progress``: called with bytes consumed."""
    logs = [Path(log_file)] if isinstance(log_file, (str, Path)) else [Path(f) for f in log_file]
    out = Path(out_dir)
    report = parse_logs(logs, out, base=logs[0].parent if len(logs) == 1 else None, progress=progress)
    problems = log_problems(report) if report.partial else []
    cut = [_cut_problem(f, report) for f in logs if _ends_mid_line(f)]
    problems += cut
    counts = report.counts
    notes = []
    if not (counts["call"] or counts["init"] or counts["split"]):
        what = logs[0].name if len(logs) == 1 else f"{len(logs)} logs"
        notes.append(f"{what} has no NCCL call or init lines (NCCL_DEBUG=INFO not set, or a rank that never "
                     "reached NCCL?)")
    outputs = [out / f"{name}.parquet" for name in TABLE_NAMES] + [out / PARSE_REPORT_FILE]
    origin = _log_origin(logs[0]) if len(logs) == 1 else None  # the origin of one process's log
    if origin is not None:  # where log discovery found the lines: evidence of the global rank
        write_json_atomic(out / LOG_ORIGIN_FILE, origin)
        outputs.append(out / LOG_ORIGIN_FILE)
    else:
        (out / LOG_ORIGIN_FILE).unlink(missing_ok=True)
    partial = report.partial or bool(cut)
    write_manifest(out / MANIFEST_FILE, stage="parse_nccl", inputs=logs, outputs=outputs, partial=partial,
                   reasons=problems, config=dict(settings or {}))
    return StageResult("parse_nccl", outputs, partial, problems, str(dict(sorted(counts.items()))), notes,
                       details={"report": report, "cut": cut})
