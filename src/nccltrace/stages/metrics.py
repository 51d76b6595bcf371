"""Stage metrics: bandwidths, wait/transfer per instance, stragglers, limits, algorithms of one run."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..metrics import OPS_COLUMNS, PARSED_TABLES, compute_run_metrics, write_run_metrics
from ..provenance import write_manifest
from ..run_layout import RunLayout
from ..tables import read_table
from . import StageResult


def run_metrics(layout: RunLayout, parsed_nccl_dirs: Iterable[Path]) -> StageResult:
    """Compute and write the metrics tables from the ops table, the communicators and each
    process's parsed log tables (tuning lines)."""
    dirs = [Path(d) for d in parsed_nccl_dirs]
    # only the columns metrics use: the run's ops table is never loaded whole
    ops = read_table(layout.ops, columns=OPS_COLUMNS)
    result = compute_run_metrics(ops, dirs, read_table(layout.communicators))
    paths = write_run_metrics(result, layout.metrics_dir)
    write_manifest(layout.manifest(layout.metrics_dir), stage="metrics",
                   inputs=[layout.ops, layout.communicators, *(d / f"{t}.parquet" for d in dirs for t in PARSED_TABLES)],
                   outputs=list(paths.values()), partial=bool(result.problems),
                   extra={"problems": result.problems})  # fmt: skip
    return StageResult("metrics", list(paths.values()), bool(result.problems), list(result.problems),
                       f"{len(result.op_metrics)} op rows, {len(result.instances)} instances")
