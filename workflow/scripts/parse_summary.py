"""Rule parse_summary: one run's parse results in one file (counts, issues, missing ranks, partial).

Every gap in a run's inputs is stated here with the file, what is wrong and what to do: rank logs
missing (per node), nodes without a usable nsys export (missing, unreadable, no NCCL kernels),
damaged logs (truncated, unreadable records) and what the import set aside. Errors make the run
partial; the manifest carries them as reasons for the report."""

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.acquisition.raw import REDO_HINT, missing_export_problem, read_status  # noqa: E402
from nccltrace.align.correlate import process_key  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402
from nccltrace.tables import write_json_atomic  # noqa: E402

sm = snakemake  # noqa: F821
totals: Counter = Counter()
processes, nodes, issues = [], [], []
logs_per_host: Counter = Counter()
for path in map(Path, sm.input.parsed):
    data = json.loads(path.read_text())
    if path.name == "parse_report.json":
        proc = path.parent.name
        logs_per_host[process_key(proc)[0]] += 1
        totals.update(data["totals"])
        processes.append({"process": proc, "partial": data["partial"], "totals": data["totals"]})
        for f in data["files"]:
            where = f["file"]
            issues += [{"process": proc, "file": where, **i,
                        "message": where + (f" line {i['line']}" if i.get("line") else "") + f": {i['message']}"}
                       for i in f["issues"]]  # fmt: skip
            lost = int(f["counts"].get("lost_records", 0))
            if lost:
                issues.append({"process": proc, "file": f["file"], "severity": "error", "line": None,
                               "message": f"{f['file']}: {lost} NCCL record(s) could not be read (damaged or torn "
                                          "lines); tables built from this log miss them"})
        # the parse job's manifest adds what the parser does not judge (a log cut mid-line)
        manifest = json.loads((path.parent / "manifest.json").read_text())
        if manifest.get("partial"):
            processes[-1]["partial"] = True
            known = {i["message"] for i in issues}
            issues += [{"process": proc, "severity": "error", "line": None, "message": r}
                       for r in manifest.get("partial_reasons") or [] if r not in known]
    else:
        host = path.parent.name
        nodes.append({"host": host, **data})
        if data.get("available") is False:
            issues.append({"host": host, "severity": "error", "line": None, "message": data.get("problem")
                           or f"nsys export of node {host} is unusable"})
        issues += [{"host": host, "severity": "error", "line": None, "message": p} for p in data.get("problems") or []]

settings = dict(sm.params.settings)
expected_p = int(sm.params.expected_processes)
expected_n = int(sm.params.expected_nodes)
per_node = int(settings.get("gpus_per_node") or max(expected_p // max(expected_n, 1), 1))
export_hosts = {n["host"] for n in nodes}
# One NCCL log per rank and one nsys export per node are expected; fewer means ranks are missing.
missing_ranks = max(expected_p - len(processes), 0)
if missing_ranks:
    short = {h: n for h, n in sorted(logs_per_host.items()) if n < per_node}
    where = (", ".join(f"node {h} has {n} of {per_node}" for h, n in short.items())
             or f"{len(logs_per_host)} of {expected_n} nodes have logs")
    issues.append({"severity": "error", "line": None,
                   "message": f"{missing_ranks} of {expected_p} rank logs are missing ({where}; found "
                              f"{len(processes)} nccl_<host>_<pid>.log in raw/nccl/): the calls of the missing ranks "
                              "are absent from every table and communicators with them are incomplete. Write one "
                              "log per rank (NCCL_DEBUG_FILE=<dir>/nccl_%h_%p.log) and add the missing ones, "
                              + REDO_HINT})
no_export = sorted(set(logs_per_host) - export_hosts)
for h in no_export:
    issues.append({"host": h, "severity": "error", "line": None, "message": missing_export_problem(h)})
seen_nodes = set(logs_per_host) | export_hosts
if len(seen_nodes) < expected_n:
    issues.append({"severity": "error", "line": None,
                   "message": f"{expected_n - len(seen_nodes)} of {expected_n} nodes have neither NCCL logs nor an "
                              f"nsys export (found {', '.join(sorted(seen_nodes))})"})
for h in sorted(export_hosts - set(logs_per_host)):
    issues.append({"host": h, "severity": "warning", "line": None,
                   "message": f"nsys export {h}.sqlite belongs to no host of the NCCL logs; it is not used"})
status = read_status(sm.input.raw)
issues += [{"severity": "warning", "line": None, "message": str(w)} for w in status.get("warnings") or []]
usable = sum(1 for n in nodes if n.get("available", True) and not n.get("problems"))
partial = any(i["severity"] == "error" for i in issues) or any(p["partial"] for p in processes)
summary = {
    "run": sm.wildcards.run,
    "processes": len(processes),
    "expected_processes": expected_p,
    "nodes": len(nodes),
    "usable_exports": usable,
    "expected_nodes": expected_n,
    "hosts_without_export": no_export,
    "totals": dict(sorted(totals.items())),
    "partial": partial,
    "issues": issues,
    "per_process": processes,
    "per_node": nodes,
}
write_json_atomic(Path(sm.output.summary), summary)
# a partial log's warnings say why it is partial (e.g. it ends mid-line: the job was killed)
partial_procs = {p["process"] for p in processes if p["partial"]}
reasons = [i["message"] for i in issues if i["severity"] == "error" or i.get("process") in partial_procs]
write_manifest(sm.output.manifest, stage="parse_summary", inputs=list(sm.input.parsed), outputs=[sm.output.summary],
               config=settings, partial=partial, reasons=reasons,
               extra={"problems": reasons, "warnings": [i["message"] for i in issues if i["message"] not in reasons]})
print(json.dumps(summary["totals"]))
for i in issues:
    print(f"{i['severity'].upper()}: {i['message']}")
