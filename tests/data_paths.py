"""Where the suite's test data lies: ``tests/data/`` in the repository (each folder's README.md
names its origin). The one home of these paths; tests import them from here."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_DATA = REPO / "tests" / "data"
FIXTURE_LOGS = TEST_DATA / "fixtures" / "nccl-logs"  # real NCCL log excerpts from public bug reports
NSYS_REFERENCE = TEST_DATA / "reference" / "nsys"  # the real nsys 2022.4 DDL, sample export and schema notes
REAL = TEST_DATA / "real"  # real captures of real jobs
NSYS_SQLITE = REAL / "nsys_sqlite"  # three real nsys exports (nsys-ai)
FR_MEGATRON16 = REAL / "flight_recorder_megatron16"  # Flight Recorder dumps of four 16-rank jobs
CAPTURE = REAL / "torch_nccl228_h200_tp2pp2"  # the real H200 capture (NCCL logs, profiler traces, dumps, truth)
