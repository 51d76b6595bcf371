"""Rule parse_summary: one run's parse results in one file (counts, issues, missing ranks, partial)."""

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.provenance import write_manifest  # noqa: E402
from nccltrace.tables import write_json_atomic  # noqa: E402

totals: Counter = Counter()
processes, nodes, issues = [], [], []
for path in map(Path, snakemake.input):  # noqa: F821
    data = json.loads(path.read_text())
    if path.name == "parse_report.json":
        totals.update(data["totals"])
        processes.append({"process": path.parent.name, "partial": data["partial"], "totals": data["totals"]})
        for f in data["files"]:
            issues += [{"process": path.parent.name, **i} for i in f["issues"]]
    else:
        nodes.append({"host": path.parent.name, **data})
expected_p = int(snakemake.params.expected_processes)  # noqa: F821
expected_n = int(snakemake.params.expected_nodes)  # noqa: F821
# One NCCL log per rank and one nsys export per node are expected; fewer means ranks are missing.
if len(processes) < expected_p:
    issues.append({"severity": "error", "line": None,
                   "message": f"{expected_p - len(processes)} of {expected_p} rank logs are missing"})
if len(nodes) < expected_n:
    issues.append({"severity": "error", "line": None,
                   "message": f"{expected_n - len(nodes)} of {expected_n} node exports are missing"})
summary = {
    "run": snakemake.wildcards.run,  # noqa: F821
    "processes": len(processes),
    "expected_processes": expected_p,
    "nodes": len(nodes),
    "expected_nodes": expected_n,
    "totals": dict(sorted(totals.items())),
    "partial": any(p["partial"] for p in processes) or len(processes) < expected_p or len(nodes) < expected_n,
    "issues": issues,
    "per_process": processes,
    "per_node": nodes,
}
write_json_atomic(Path(snakemake.output.summary), summary)  # noqa: F821
write_manifest(snakemake.output.manifest, stage="parse_summary", inputs=list(snakemake.input),  # noqa: F821
               outputs=[snakemake.output.summary], config=dict(snakemake.params.settings),  # noqa: F821
               partial=summary["partial"])
print(json.dumps(summary["totals"]))
