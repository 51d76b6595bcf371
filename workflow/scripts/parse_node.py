"""Rule parse_node: one node's NCCL logs (one per process) and nsys export(s), parsed in one job
(nccltrace.stages.parse_node); in a run without logs, the node's kernel source (profiler trace
or nsys export) and each of its processes from its records (nccltrace.stages.sources)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup

setup(snakemake)  # noqa: F821
from nccltrace.acquisition.status import read_status
from nccltrace.core.layout import RunLayout
from nccltrace.core.settings import RunSettings
from nccltrace.stages.parse_node import run_parse_node
from nccltrace.stages.sources import read_source_processes, run_parse_sources_node

sm = snakemake  # noqa: F821
host = sm.wildcards.host
layout = RunLayout.of_raw(sm.input.raw)
if sm.params.recorded:  # processes without an NCCL log (checkpoint sources listed them)
    procs = read_source_processes(layout)[0]
    run_parse_sources_node(layout, host, [procs[p] for p in sm.params.recorded],
                           RunSettings.from_mapping(sm.params.settings), carry=True).echo()
else:
    # judged at import, where the file's surroundings (a leftover journal) were visible
    unusable = (read_status(sm.input.raw).get("unusable_exports") or {}).get(host)
    # one export per node, or one per process (merged on one clock by the parse)
    exports = layout.raw_exports(host)
    run_parse_node(layout, host, {proc: layout.raw_log(proc) for proc in sm.params.processes},
                   exports if len(exports) > 1 else layout.raw_export(host),
                   RunSettings.from_mapping(sm.params.settings), unusable=unusable).echo()
