"""Stage metrics: bandwidths, wait/transfer per instance, stragglers, limits, algorithms of one run."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from nccltrace.core.layout import RunLayout
from nccltrace.core.provenance import write_manifest
from nccltrace.core.tables import read_table
from nccltrace.metrics.compute import PARSED_TABLES, write_run_metrics_out_of_core
from nccltrace.stages import StageResult


def run_metrics(layout: RunLayout, parsed_nccl_dirs: Iterable[Path]) -> StageResult:
    """Compute and write the metrics tables from the ops table, the communicators and each
    process's parsed log tables (tuning lines), in bounded memory: the ops file is read in
    batches and computed in parts of whole communicators (``write_run_metrics_out_of_core``)."""
    dirs = [Path(d) for d in parsed_nccl_dirs]
    written = write_run_metrics_out_of_core(layout.ops, dirs, read_table(layout.communicators), layout.metrics_dir)
    outputs = list(written.paths.values())
    write_manifest(layout.manifest(layout.metrics_dir), stage="metrics",
                   inputs=[layout.ops, layout.communicators, *(d / f"{t}.parquet" for d in dirs for t in PARSED_TABLES)],
                   outputs=outputs, partial=bool(written.problems),
                   extra={"problems": written.problems, "parts": written.parts})  # fmt: skip
    return StageResult("metrics", outputs, bool(written.problems), list(written.problems),
                       f"{written.op_rows} op rows, {written.instances} instances, computed in {written.parts} "
                       "part(s) of whole communicators")  # fmt: skip
