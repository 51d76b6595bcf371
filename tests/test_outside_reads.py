"""The outside-reads check (tests/outside_reads.py) fails a test that opens a file outside the
repository, names the path and the test, and lets reads of the repository and the temp directory
pass; a read outside any test fails the run. Shown on small suites run by a pytest of their own,
alone and under pytest-xdist."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from data_paths import REPO, TEST_DATA
from outside_reads import READS

PROBE = '''
import os, sqlite3, tempfile
from pathlib import Path

BESIDE = Path({beside!r})


def test_opens_a_file_beside_the_checkout():
    assert (BESIDE / "shared" / "README.md").read_text() == "not test data\\n"


def test_lists_a_directory_beside_the_checkout():
    assert [p.name for p in (BESIDE / "shared").glob("*")] == ["README.md"]


def test_connects_to_a_database_beside_the_checkout():
    sqlite3.connect(BESIDE / "shared" / "x.sqlite").close()


def test_reads_the_repository_and_the_temp_directory(tmp_path):
    assert (Path({data!r}) / "README.md").read_text()
    (tmp_path / "a").write_text("x")
    assert (tmp_path / "a").read_text() == "x" and os.listdir(tmp_path) == ["a"]
    with tempfile.TemporaryFile() as fh:
        fh.write(b"y")
'''

IMPORTS = '''
from pathlib import Path

TEXT = (Path({beside!r}) / "shared" / "README.md").read_text()  # at import: a collection error


def test_never_runs():
    pass
'''

SESSION_END = '''
from pathlib import Path


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput") == {worker!r}:
        (Path({beside!r}) / "shared" / "README.md").read_text()
'''


def test_the_suites_own_process_is_watched():
    assert READS.active and READS.outside("/somewhere/beside/the/checkout")
    assert not READS.outside(str(TEST_DATA / "README.md")) and not READS.outside("tests/data")


XDIST = pytest.mark.parametrize("xdist", [[], ["-n", "1"]], ids=["one-process", "xdist-worker"])


def _inner_run(suite, temp, xdist: list[str]) -> tuple[int, str]:
    """pytest on ``suite`` with this plugin, ``temp`` as its temp directory."""
    (suite / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(REPO / "tests")}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "outside_reads", "-p", "no:cacheprovider", "-q", "-rfE",
                           "--continue-on-collection-errors", *xdist, str(suite)],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def _beside(tmp_path):
    """A temp directory for the inner run and, outside it, a folder like ../shared."""
    temp, beside = tmp_path / "tmp", tmp_path / "beside"
    (beside / "shared").mkdir(parents=True)
    (beside / "shared" / "README.md").write_text("not test data\n")
    (temp / "suite").mkdir(parents=True)
    return temp, beside


@XDIST
def test_a_test_that_opens_a_file_outside_the_repository_fails_and_names_it(tmp_path, xdist):
    temp, beside = _beside(tmp_path)
    suite = temp / "suite"
    (suite / "test_probe.py").write_text(PROBE.format(beside=str(beside), data=str(TEST_DATA)))
    (suite / "test_probe_import.py").write_text(textwrap.dedent(IMPORTS.format(beside=str(beside))))
    rc, out = _inner_run(suite, temp, xdist)
    assert rc == 1, out
    assert "3 failed, 1 passed, 1 error" in out, out
    for test, path, event in (
        ("test_opens_a_file_beside_the_checkout", beside / "shared" / "README.md", "open"),
        ("test_lists_a_directory_beside_the_checkout", beside / "shared", "os.scandir"),
        ("test_connects_to_a_database_beside_the_checkout", beside / "shared" / "x.sqlite", "sqlite3.connect"),
    ):
        assert f"FAILED test_probe.py::{test}" in out, out
        assert f"{path} ({event})" in out, out
    assert "ERROR test_probe_import.py" in out and "opened outside the repository" in out, out
    assert "test_reads_the_repository_and_the_temp_directory" not in out.split("short test summary")[-1], out


@XDIST
def test_a_read_outside_any_test_fails_the_run(tmp_path, xdist):
    """A plugin's read at the session's end (in the worker under xdist): every test passes, the
    run fails and names the path."""
    temp, beside = _beside(tmp_path)
    suite = temp / "suite"
    (suite / "test_fine.py").write_text("def test_fine():\n    pass\n")
    (suite / "conftest.py").write_text(SESSION_END.format(beside=str(beside), worker=bool(xdist)))
    rc, out = _inner_run(suite, temp, xdist)
    assert rc == 1 and "1 passed" in out, out
    assert "outside_reads: outside any test" in out and f"{beside / 'shared' / 'README.md'} (open)" in out, out
