"""Rule metrics: bandwidths, wait/transfer per instance, stragglers, limits, algorithms of one run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.metrics import OPS_COLUMNS, compute_run_metrics, write_run_metrics  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402
from nccltrace.tables import read_table  # noqa: E402

inp, out = snakemake.input, snakemake.output  # noqa: F821
# only the columns metrics use: the run's ops table is never loaded whole
ops = read_table(inp.ops, columns=OPS_COLUMNS)
result = compute_run_metrics(ops, [Path(p).parent for p in inp.reports], read_table(inp.communicators))
paths = write_run_metrics(result, Path(out.op_metrics).parent)
write_manifest(out.manifest, stage="metrics", inputs=[inp.ops, inp.communicators, *inp.reports],
               outputs=list(paths.values()), partial=bool(result.problems), extra={"problems": result.problems})
print(f"{len(result.op_metrics)} op rows, {len(result.instances)} instances; problems: {result.problems}")
