"""Stage parse_summary: one run's parse results in one file (counts, issues, missing ranks, partial).

Every gap in a run's inputs is stated here with the file, what is wrong and what to do: rank logs
missing (per node), nodes without a usable nsys export (missing, unreadable, no NCCL kernels),
NCCL kernels of processes without a log, damaged logs (cut, unreadable records) and what the
import set aside. Errors make the run partial; the manifest carries them as reasons for the
report."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from nccltrace.acquisition.status import WORKFLOW_REMEDY, Remedy, missing_export_problem
from nccltrace.core.layout import (
    KERNELS_FILE,
    MANIFEST_FILE,
    PARSE_REPORT_FILE,
    SESSION_FILE,
    SOURCE_RANK_FILE,
    RunLayout,
    process_key,
)
from nccltrace.core.provenance import write_manifest
from nccltrace.core.tables import write_json_atomic
from nccltrace.nccl.parse_report import log_problems
from nccltrace.stages import StageResult

if TYPE_CHECKING:  # annotations only: the settings code is not in this stage's code stamp
    from nccltrace.core.settings import RunSettings

__all__ = ["run_parse_summary"]

_LOG_NAMING = "NCCL_DEBUG_FILE=<dir>/nccl_%h_%p.log"


def _orphan_kernels(kernels: Path, host: str, logged_pids: set[int]) -> str | None:
    """NCCL kernels of pids on ``host`` that left no log: their calls are in no table."""
    if not kernels.is_file():
        return None
    pids = pq.read_table(kernels, columns=["pid"]).column("pid").drop_null().to_pylist()
    orphan = sorted({int(p) for p in pids} - logged_pids)
    if not orphan:
        return None
    return (f"node {host}: NCCL kernels of pid(s) {', '.join(map(str, orphan[:8]))}"
            f"{' ...' if len(orphan) > 8 else ''} have no NCCL log: those processes' calls are absent from every "
            f"table; add their logs ({_LOG_NAMING}), or ignore this if they belong to another job")


@dataclass
class _Parsed:
    """What the parse results of a run's processes and nodes say, gathered for the summary."""

    totals: Counter = field(default_factory=Counter)
    processes: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    issues: list[dict[str, Any]] = field(default_factory=list)
    logs_per_host: Counter = field(default_factory=Counter)
    logged: dict[str, set[int]] = field(default_factory=dict)  # pids with a log, per host
    inputs: list[Path] = field(default_factory=list)
    from_records: set[str] = field(default_factory=set)  # hosts of processes parsed from records, not logs


def run_parse_summary(layout: RunLayout, procs: Iterable[str], hosts: Iterable[str], *, run_id: str | None,
                      expected_processes: int | None, expected_nodes: int | None,
                      settings: RunSettings | Mapping[str, Any] | None = None, warnings: Iterable[str] = (),
                      input_problems: Iterable[str] = (), remedy: Remedy = WORKFLOW_REMEDY) -> StageResult:  # fmt: skip
    """Summarise the parse of processes ``procs`` (``parsed/nccl/<proc>/``) and nodes ``hosts``
    (``parsed/nsys/<host>/``) into ``layout.parse_summary``. ``expected_*``: how many rank logs
    and nodes the run has (None: unknown, not checked); ``warnings``: what finding the inputs
    noted; ``input_problems``: what finding them lost (e.g. NCCL lines no process prefix names)."""
    settings = dict(settings or {})
    procs, hosts = list(procs), list(hosts)
    parsed = _Parsed()
    for proc in procs:
        _add_process(parsed, layout, proc)
    for host in hosts:
        _add_node(parsed, layout, host)
    processes, nodes, issues = parsed.processes, parsed.nodes, parsed.issues
    per_node = int(settings.get("gpus_per_node") or 0) or (
        max((expected_processes or 0) // max(expected_nodes or 1, 1), 1))
    no_export = _coverage_issues(parsed, set(hosts), per_node, expected_processes, expected_nodes, remedy)
    issues += [{"severity": "error", "line": None, "message": str(m)} for m in input_problems]
    issues += [{"severity": "warning", "line": None, "message": str(w)} for w in warnings]
    usable = sum(1 for n in nodes if n.get("available", True) and not n.get("problems"))
    partial = any(i["severity"] == "error" for i in issues) or any(p["partial"] for p in processes)
    summary = {
        "run": run_id,
        "processes": len(processes),
        "expected_processes": expected_processes,
        "nodes": len(nodes),
        "usable_exports": usable,
        "expected_nodes": expected_nodes,
        "hosts_without_export": no_export,
        "totals": dict(sorted(parsed.totals.items())),
        "partial": partial,
        "issues": issues,
        "per_process": processes,
        "per_node": nodes,
    }
    write_json_atomic(layout.parse_summary, summary)
    # a partial log's warnings say why it is partial (e.g. it ends mid-line: the job was killed)
    partial_procs = {p["process"] for p in processes if p["partial"]}
    reasons = list(dict.fromkeys(i["message"] for i in issues
                                 if i["severity"] == "error" or i.get("process") in partial_procs))  # fmt: skip
    warned = list(dict.fromkeys(i["message"] for i in issues if i["message"] not in reasons))
    write_manifest(layout.manifest(layout.parse_summary.parent), stage="parse_summary", inputs=parsed.inputs,
                   outputs=[layout.parse_summary], config=settings, partial=partial, reasons=reasons,
                   extra={"problems": reasons, "warnings": warned})
    return StageResult("parse_summary", [layout.parse_summary], partial, reasons, json.dumps(summary["totals"]),
                       warned, {"summary": summary})


def _add_process(parsed: _Parsed, layout: RunLayout, proc: str) -> None:
    """Add one process's parse report and parse manifest: its totals, partial flag and issues."""
    d = layout.parsed_nccl(proc)
    issues = parsed.issues
    data = json.loads((d / PARSE_REPORT_FILE).read_text())
    host, pid = process_key(proc)
    if (d / SOURCE_RANK_FILE).exists():  # parsed from other sources' records, not from a log
        parsed.from_records.add(host)
    parsed.logs_per_host[host] += 1
    parsed.logged.setdefault(host, set()).add(pid)
    parsed.totals.update(data["totals"])
    parsed.processes.append({"process": proc, "partial": data["partial"], "totals": data["totals"]})
    # issues of every severity are listed; the gaps (errors, lost records) carry one message each
    gaps = set(log_problems(data))
    for f in data["files"]:
        for i in f["issues"]:
            msg = f["file"] + (f" line {i['line']}" if i.get("line") else "") + f": {i['message']}"
            issues.append({"process": proc, "file": f["file"], **i, "message": msg})
    issues += [{"process": proc, "severity": "error", "line": None, "message": m}
               for m in gaps if m not in {i["message"] for i in issues}]  # fmt: skip
    # the parse stage's manifest adds what the parser does not judge (a log cut mid-line)
    manifest = json.loads((d / MANIFEST_FILE).read_text())
    if manifest.get("partial"):
        parsed.processes[-1]["partial"] = True
        known = {i["message"] for i in issues}
        issues += [{"process": proc, "severity": "error", "line": None, "message": r}
                   for r in manifest.get("partial_reasons") or [] if r not in known]
    parsed.inputs += [d / PARSE_REPORT_FILE, d / MANIFEST_FILE]


def _add_node(parsed: _Parsed, layout: RunLayout, host: str) -> None:
    """Add one node's export session: unusable exports, their problems, kernels of unlogged pids."""
    d = layout.parsed_nsys(host)
    data = json.loads((d / SESSION_FILE).read_text())
    parsed.nodes.append({"host": host, **data})
    parsed.inputs.append(d / SESSION_FILE)
    if data.get("available") is False:
        parsed.issues.append({"host": host, "severity": "error", "line": None,
                              "message": data.get("problem") or f"nsys export of node {host} is unusable"})
    parsed.issues += [{"host": host, "severity": "error", "line": None, "message": p}
                      for p in data.get("problems") or []]  # fmt: skip
    orphan = _orphan_kernels(d / KERNELS_FILE, host, parsed.logged.get(host, set()))
    if orphan:
        parsed.issues.append({"host": host, "severity": "error", "line": None, "message": orphan})
        parsed.inputs.append(d / KERNELS_FILE)


def _coverage_issues(parsed: _Parsed, export_hosts: set[str], per_node: int, expected_processes: int | None,
                     expected_nodes: int | None, remedy: Remedy) -> list[str]:  # fmt: skip
    """Add the issues of missing rank logs, exports and nodes, and of exports of no logged host;
    returns the hosts with logs but no export."""
    issues, logs_per_host = parsed.issues, parsed.logs_per_host
    # One NCCL log per rank and one nsys export per node are expected; fewer means ranks are missing.
    missing_ranks = max((expected_processes or 0) - len(parsed.processes), 0)
    if missing_ranks:
        short = {h: n for h, n in sorted(logs_per_host.items()) if n < per_node}
        where = (", ".join(f"node {h} has {n} of {per_node}" for h, n in short.items())
                 or f"{len(logs_per_host)} of {expected_nodes or '?'} nodes have logs")
        issues.append({"severity": "error", "line": None,
                       "message": f"{missing_ranks} of {expected_processes} rank logs are missing ({where}; found "
                                  f"{len(parsed.processes)} process logs): the calls of the missing ranks are absent "
                                  "from every table and communicators with them are incomplete. Write one log per "
                                  f"rank ({_LOG_NAMING}), add the missing ones to {remedy.inputs_dir}, {remedy.redo}"})
    no_export = sorted(set(logs_per_host) - export_hosts)
    for h in (h for h in no_export if h not in parsed.from_records):  # (their run says it once, with its sources)
        issues.append({"host": h, "severity": "error", "line": None, "message": missing_export_problem(h, remedy)})
    seen_nodes = set(logs_per_host) | export_hosts
    if expected_nodes and len(seen_nodes) < expected_nodes:
        issues.append({"severity": "error", "line": None,
                       "message": f"{expected_nodes - len(seen_nodes)} of {expected_nodes} nodes have neither NCCL "
                                  f"logs nor an nsys export (found {', '.join(sorted(seen_nodes))})"})
    for h in sorted(export_hosts - set(logs_per_host)):
        issues.append({"host": h, "severity": "warning", "line": None,
                       "message": f"nsys export of {h} belongs to no host of the NCCL logs; it is not used"})
    return no_export
