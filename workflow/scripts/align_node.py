"""Rule align_node: correlate the NCCL call lines of each of one node's processes with the
node's kernels, in one job (nccltrace.stages.align_node); in a run without logs, install the
alignment the processes' records gave at parse (nccltrace.stages.sources)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup

setup(snakemake)  # noqa: F821
from nccltrace.core.layout import RunLayout
from nccltrace.core.settings import RunSettings
from nccltrace.stages.align_node import run_align_node
from nccltrace.stages.sources import run_install_alignments

sm = snakemake  # noqa: F821
layout = RunLayout(Path(sm.output.aligned).parents[1])
if sm.params.recorded:  # processes without an NCCL log: their records named each kernel
    run_install_alignments(layout, sm.wildcards.host, sm.params.recorded).echo()
else:
    window = RunSettings.from_mapping(sm.params.settings).capture
    run_align_node(layout, sm.wildcards.host, sm.params.processes, mode=sm.params.mode,
                   nccl_version=sm.params.nccl_version, capture_steps=window.loop_indices if window else None).echo()
