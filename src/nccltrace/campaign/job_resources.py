"""Memory each workflow job asks the cluster for, from measured per-row costs.

A rule's ``mem_mb`` is ``base + per_row * rows`` of the table that drives its peak, with 50 %
headroom, rounded up to 100 MB. The costs are peak RSS figures of this implementation measured
by ``python benchmarks/run_benchmarks.py`` (sections ``parse``, ``nsys``, ``align``, ``stages``;
2-core VM, numpy 2.4, pandas 3.1, pyarrow 26): the interpreter with its imports is the base, the
slope is the growth of the peak with the rows. Re-measure and update them with the code they
describe; a job asking too little is killed by SLURM, one asking too much waits in the queue.

| stage | rows that drive the peak | measured |
|---|---|---|
| parse_nccl | none: streams the log | 305-425 MiB for 10 MB-1 GB logs |
| parse_nsys | kernels of the node (the export's file size stands for them) | 964 MiB for a 284 MB synthetic export; 1,183 MiB for an 80 MB emulated one (8 processes, NVTX ranges): the base is high |
| align | calls of the process (a node job: its largest) | 1.5 KB per call over a base of 0.3-0.55 GiB (1.76 GiB at 10^6; 726 MiB for a node whose largest process has 63 k calls) |
| ops | rows of the run, a little: one process's rows, one part of the checks' rows (whole communicators, about 2^19 rows), the clock fit's input (at most 2*10^6 instance rows) and 9 B per instance row (the cross-rank check's run-wide end spread) | 409 MiB at 0.16 M rows (64 ranks), 659 MiB at 0.65 M (256 ranks), 1,113 MiB at 2.6 M (1024 ranks), 1,460 MiB at 11.0 M (256 ranks, 100 iterations; 5.7 GiB before the checks ran in parts) |
| metrics | calls of the largest part (whole communicators, 2^18 calls or the largest communicator) and, a little, of the run | 1.40-1.54 GiB at 2.6 M calls of 1024 ranks (parts of 2^18), 1.45 GiB with parts of 6*10^4; 2.64 GiB at 4*10^6 calls of 8 ranks (communicators of 8.5*10^5 calls) |
| volume | one batch of 2^18 ops rows and the sums per rank and call group | 0.7 GiB at 10^6, 0.8 GiB at 4*10^6 (batches of 2^20) |
| trace | capped: the earliest 5*10^5 events + streamed summary | 2.3 GiB at 4*10^6 |
| report | ops rows of the run (read in batches: per-group sums and the float values its medians need) | 430 MiB at 10^6, 670 MiB at 4*10^6, 1.16 GiB at 1.12*10^7 ops (tiled 8-rank runs) |
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
