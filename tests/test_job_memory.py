"""Memory requests of the workflow's jobs (nccltrace.campaign.job_resources) against measured peaks."""

from __future__ import annotations

import pytest

from nccltrace.campaign.job_resources import COSTS, mem_mb, parquet_rows

# (stage, driving rows, measured peak RSS in MiB) from benchmarks/run_benchmarks.py on the
# 2-core VM of the README (stages: tiled 8-rank run; align: bench_align; nsys: 284 MB export; the
# 256-rank rows: the workflow end to end). Metrics: (calls of the largest part, calls of the run).
MEASURED = [
    # out of core, parts of whole communicators: the 1024-rank run (2.6 M calls, communicators of
    # at most 62 k calls) in parts of 2^18 and of 2*10^4 calls; the tiled 8-rank run (4 M calls,
    # communicators of 0.85 M calls: a part cannot be smaller than a communicator)
    ("metrics", (262_144, 2_595_840), 1543), ("metrics", (62_464, 2_595_840), 1450),
    ("metrics", (851_292, 4_001_800), 2700),
    # the report read in batches: tiled 8-rank runs of 1, 4 and 11.2 M ops
    ("report", 1_001_000, 430), ("report", 4_001_800, 670), ("report", 11_200_200, 1191),
    ("volume", 1_001_000, 699), ("volume", 4_001_800, 816),
    ("trace", 4_001_800, 2348),
    ("align", 1_000_000, 1802), ("align", 100_000, 412),
    ("parse_nsys", 284_000_000, 964),
    # one node of 8 processes (0.5 M calls, 80 MB export): parse_nsys alone, align_node (largest
    # process 63 k calls, 675 MiB alone)
    ("parse_nsys", 80_000_000, 1183), ("align", 63_000, 726),
    ("parse_nccl", 0, 425),
    # ops, its checks in parts of whole communicators: 64 and 256 ranks of the scaling shape,
    # scale-1024 (2.6 M rows) and scale-256 (11 M rows, 100 iterations); the clock fit's input
    # grows up to 2*10^6 instance rows, then only the checks' 9 B per row and the spill
    ("ops", 162_240, 409), ("ops", 648_960, 659), ("ops", 2_595_840, 1113), ("ops", 10_955_904, 1460),
]


@pytest.mark.parametrize("stage, rows, peak_mib", MEASURED)
def test_every_request_covers_the_measured_peak_with_headroom(stage, rows, peak_mib):
    assert mem_mb(stage, *(rows if isinstance(rows, tuple) else (rows,))) >= 1.2 * peak_mib * 2**20 / 1e6


def test_requests_grow_with_the_rows_that_drive_the_peak_and_never_fall_below_the_minimum():
    for stage, cost in COSTS.items():
        assert mem_mb(stage, 0) >= cost.minimum_mb
        assert mem_mb(stage, 10**7) >= mem_mb(stage, 10**5)
    assert mem_mb("report", 10**7) < 4 * mem_mb("report", 10**5)  # streams: far from proportional
    # one part at a time: the run's size adds little beside the part's
    assert mem_mb("metrics", 2**18, 10**7) < 2 * mem_mb("metrics", 2**18, 2**18)
    assert mem_mb("volume", 10**7) < 2 * mem_mb("volume", 10**5)  # streams: nearly flat
    assert mem_mb("ops", 10**7) < 4 * mem_mb("ops", 10**5)  # checks in parts: far from proportional


def test_rows_come_from_the_parquet_footer_and_a_missing_table_counts_zero(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": list(range(1234))}), tmp_path / "t.parquet")
    assert parquet_rows(tmp_path / "t.parquet") == 1234
    assert parquet_rows(tmp_path / "missing.parquet") == 0
