"""The suite's scheduling groups (tests/xdist_groups.py) hold under pytest-xdist, shown on a small
suite run by a pytest of its own with two processes: each test file runs in one process and
builds its module fixture once, a test naming its own group is scheduled apart, and the longest
groups are queued first. When xdist loses the groups (pytest 9.2 with xdist 3.8 schedules every
test alone, and the whole suite then takes minutes longer on 2 cores), this fails."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict

from data_paths import REPO
from xdist_groups import LONGEST_FIRST

MODULE = '''
import os
from pathlib import Path

import pytest

RECORD = Path(os.environ["GROUPS_RECORD"])


def _note(what):
    with RECORD.open("a") as fh:
        fh.write(f"{{__name__}} {{what}} {{os.environ.get('PYTEST_XDIST_WORKER', '-')}}\\n")


@pytest.fixture(scope="module")
def built():
    _note("setup")


@pytest.mark.parametrize("i", range(4))
def test_shares_the_module_fixture(built, i):
    _note("test")
{own}'''

OWN = '''

@pytest.mark.xdist_group("own")
def test_in_a_group_of_its_own():
    _note("own")
'''


def _pytest(suite, *args: str) -> subprocess.CompletedProcess:
    (suite / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "GROUPS_RECORD": str(suite / "record.txt")}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist_groups", "-p", "no:cacheprovider", *args],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_each_test_file_runs_in_one_process_and_builds_its_module_fixtures_once(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    names = ["test_alpha", "test_beta", "test_gamma"]
    for name in names:
        (suite / f"{name}.py").write_text(MODULE.format(own=OWN if name == "test_beta" else ""))
    done = _pytest(suite, "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    workers, setups = defaultdict(set), defaultdict(int)
    lines = (suite / "record.txt").read_text().splitlines()
    for module, what, worker in (line.split() for line in lines):
        assert worker.startswith("gw"), lines  # under xdist
        if what == "setup":
            setups[module] += 1
        elif what == "test":
            workers[module].add(worker)
    assert sorted(workers) == names and all(len(w) == 1 for w in workers.values()), lines
    assert setups == {name: 1 for name in names}, lines
    assert sum(what == "own" for _, what, _ in (line.split() for line in lines)) == 1
    assert {w for ws in workers.values() for w in ws} == {"gw0", "gw1"}, lines  # both processes had work


def test_the_longest_groups_are_queued_first_and_the_rest_keep_file_order(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    longest = LONGEST_FIRST[1]  # a whole test file's group
    names = ["test_alpha", longest, "test_beta"]
    for name in names:
        (suite / f"{name}.py").write_text(MODULE.format(own=""))
    done = _pytest(suite, "--collect-only", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    modules = [line.split("::")[0].removesuffix(".py") for line in done.stdout.splitlines() if "::" in line]
    assert list(dict.fromkeys(modules)) == [longest, "test_alpha", "test_beta"], done.stdout
