"""Memory each workflow job asks the cluster for, from measured per-row costs.

A rule's ``mem_mb`` is ``base + per_row * rows`` of the table that drives its peak, with 50 %
headroom, rounded up to 100 MB: a job asking too little is killed by SLURM, one asking too much
waits in the queue. The costs are peak RSS measured by ``python benchmarks/run_benchmarks.py``;
re-measure and update them with the code they describe. The measured figures per stage:
``docs/benchmarks.md``, section "Memory per job".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COSTS", "JobCost", "mem_mb", "parquet_rows"]

_MIB = 2**20


@dataclass(frozen=True)
class JobCost:
    """Peak RSS of a job: ``base_mib`` plus ``bytes_per_row`` for each driving row and
    ``bytes_per_run_row`` for each row of the run (stages whose peak is one part of the run)."""

    base_mib: float
    bytes_per_row: float = 0.0
    headroom: float = 1.5
    minimum_mb: int = 1000
    bytes_per_run_row: float = 0.0

    def mem_mb(self, rows: int = 0, run_rows: int = 0) -> int:
        mib = self.base_mib + (self.bytes_per_row * max(rows, 0) + self.bytes_per_run_row * max(run_rows, 0)) / _MIB
        mib *= self.headroom
        return max(self.minimum_mb, int(math.ceil(mib * _MIB / 1e6 / 100) * 100))


COSTS: dict[str, JobCost] = {
    "parse_nccl": JobCost(430),
    # rows: bytes of the export file (3.4 B of peak per byte, 284 MB -> 964 MiB)
    "parse_nsys": JobCost(800, 3.4),
    "align": JobCost(550, 1500),
    # rows: the run's ops rows (the clock fit's sample and the checks' parts are bounded)
    "ops": JobCost(800, 60),
    # rows: calls of the largest part (metrics.part_calls); run rows: calls of the run
    "metrics": JobCost(1200, 2000, bytes_per_run_row=60),
    "volume": JobCost(700, 30),
    "trace": JobCost(2400, 0, minimum_mb=4000),
    "report": JobCost(400, 80),
}
"""Measured costs per stage (see the module docstring)."""


def mem_mb(stage: str, rows: int = 0, run_rows: int = 0) -> int:
    """The ``mem_mb`` a job of ``stage`` asks for when ``rows`` (and ``run_rows``) drive its peak."""
    return COSTS[stage].mem_mb(rows, run_rows)


def parquet_rows(path: Path | str) -> int:
    """Rows of a Parquet table from its footer (0 when it does not exist yet, as in a dry run)."""
    import pyarrow.parquet as pq

    p = Path(path)
    return pq.read_metadata(p).num_rows if p.is_file() else 0
