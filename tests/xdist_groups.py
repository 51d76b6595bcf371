"""pytest plugin: the suite's scheduling groups under pytest-xdist (``--dist loadgroup``).

Every test is put in the group of its test file (``xdist_group`` named after the module), so a
module's fixtures are built once, in one process; a test that shares no fixture with its file may
name a group of its own (``@pytest.mark.xdist_group(...)``), which is kept. The system tests (one
SLURM cluster, apt) share one group, in order, and go first when run with the rest; the README's
test command runs them on their own after the rest (see the README's Tests section).

The longest groups are queued first (``LONGEST_FIRST``; ``--no-loadscope-reorder`` in
pyproject.toml keeps the collection order, where xdist would otherwise order the groups by their
number of tests), so that no long group starts when the other process has nothing left.

xdist learns a test's group from a suffix it adds to the node id in its own
``pytest_collection_modifyitems``, so this plugin's hook runs first (``tryfirst``). pytest 9.2
ignores that suffix and every test is then scheduled alone (pytest-xdist issue 1386): module
fixtures are built once per process and the suite takes minutes longer, so pyproject.toml keeps
pytest below 9.2 and ``tests/test_xdist_groups.py`` fails when the groups are not kept.
"""

from __future__ import annotations

import pytest

# The groups that take longest on 2 cores, longest first (measured with --durations; each is
# minutes). The other groups follow in file order. A name missing here only loses its place.
LONGEST_FIRST = (
    "test_workflow.finished_example",
    "test_real_capture",
    "test_out_of_core_identity",
    "test_workflow_faults",
    "test_match_trust",
    "test_benchmarks",
    "test_practitioner_inputs",
    "test_workflow",
    "test_tables_open_everywhere",
)


def group_of(item: pytest.Item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark.args else mark.kwargs.get("name", "default")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group"):  # a test that shares no fixture may name its own
            continue
        group = "system" if item.get_closest_marker("system") else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable: file order kept within a group and among the rest
    items.sort(key=lambda item: (item.get_closest_marker("system") is None, rank.get(group_of(item), len(rank))))
