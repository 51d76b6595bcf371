"""The gaps a parse report records, as messages: what the parse stage writes to a process's
manifest and the parse summary gathers from every ``parse_report.json``. Reads the report's
dict form (or anything with ``as_dict``), not the reader, so that the summary does not carry
the log reader into its code stamp."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["log_problems"]


class _Report(Protocol):
    def as_dict(self) -> dict[str, Any]: ...


def log_problems(report: _Report | Mapping[str, Any]) -> list[str]:
    """The gaps a parse report (:class:`~nccltrace.nccl.log_reader.ParseReport`, or its dict
    form) records, one message each with file and line: issues of severity error and records
    that could not be read (torn or damaged lines)."""
    data = report if isinstance(report, Mapping) else report.as_dict()
    out: list[str] = []
    for f in data["files"]:
        out += [f"{f['file']}" + (f" line {i['line']}" if i.get("line") else "") + f": {i['message']}"
                for i in f["issues"]]  # fmt: skip
        if f["counts"].get("lost_records"):
            out.append(f"{f['file']}: {f['counts']['lost_records']} NCCL record(s) could not be read (damaged or "
                       "torn lines); tables built from this log miss them")
    return out
