"""Shared test fixtures: the real reference material in ``tests/data/`` (paths in data_paths.py);
the outside_reads plugin fails a test that opens a file outside the repository; the xdist_groups
plugin spreads the suite over processes one test file at a time, the longest files first."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_paths import FIXTURE_LOGS, NSYS_REFERENCE

pytest_plugins = ["outside_reads", "xdist_groups"]


@pytest.fixture(scope="session")
def fixture_logs() -> Path:
    """Real NCCL log excerpts from public bug reports (tests/data/fixtures/nccl-logs)."""
    assert FIXTURE_LOGS.is_dir(), f"real NCCL log fixtures missing at {FIXTURE_LOGS}"
    return FIXTURE_LOGS


@pytest.fixture(scope="session")
def nsys_reference() -> Path:
    """Real nsys DDL and sample export (tests/data/reference/nsys)."""
    assert NSYS_REFERENCE.is_dir(), f"nsys reference files missing at {NSYS_REFERENCE}"
    return NSYS_REFERENCE
