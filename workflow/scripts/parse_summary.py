"""Rule parse_summary: one run's parse results in one file (counts, issues, partial flag)."""

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
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
summary = {
    "run": snakemake.wildcards.run,  # noqa: F821
    "processes": len(processes),
    "nodes": len(nodes),
    "totals": dict(sorted(totals.items())),
    "partial": any(p["partial"] for p in processes),
    "issues": issues,
    "per_process": processes,
    "per_node": nodes,
}
write_json_atomic(Path(snakemake.output[0]), summary)  # noqa: F821
print(json.dumps(summary["totals"]))
