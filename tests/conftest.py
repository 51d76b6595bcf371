"""Shared test fixtures: the real reference material in ``tests/data/`` (paths in data_paths.py);
the outside_reads plugin fails a test that opens a file outside the repository."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_paths import FIXTURE_LOGS, NSYS_REFERENCE

pytest_plugins = ["outside_reads"]


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Spread the suite over processes (pytest-xdist, ``--dist loadgroup``) one test file at a
    time, so a module's fixtures are built once. The system tests (one SLURM cluster, apt) share
    one process, in order, and go first when run with the rest; the README's test command runs
    them on their own after the rest (see the README's Tests section)."""
    for item in items:
        if item.get_closest_marker("xdist_group"):  # a test that shares no fixture may name its own
            continue
        group = "system" if item.get_closest_marker("system") else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("system") is None)  # stable: file order kept
