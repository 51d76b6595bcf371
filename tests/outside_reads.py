"""pytest plugin: a test that opens a file or lists a directory outside the repository fails.

The suite must pass on a clone with nothing beside it, so its data lies in ``tests/data/``. An
audit hook (``sys.addaudithook``) sees the pytest process's ``open`` (``open()``, ``os.open``,
``io.open_code``), ``os.listdir``, ``os.scandir`` (``Path.glob``, ``os.walk``, ``shutil.copytree``)
and ``sqlite3.connect`` events and records every path that lies outside

- the repository (this file's ``..``),
- the temp directory (``tempfile.gettempdir()``, where pytest's ``tmp_path`` lives; ``--basetemp``),
- the interpreter and its libraries (``sys.prefix``, ``sys.base_prefix``, site-packages),
- the system (``/usr``, ``/lib``, ``/etc``, ``/proc``, ``/sys``, ``/dev``, ...) and the user's library
  caches and settings (``~/.cache``, ``~/.config``, ``~/.local``).

The reads of a test (setup, call, teardown) turn its report into a failure naming the paths;
those of a collection (a test module's import) make it a collection error; any other (a plugin at
the session's start or end) fails the run. pytest-xdist workers load the plugin too. Subprocesses are not watched (an audit hook is per process). Paths are
compared as strings (made absolute and normalised, never resolved): cheap, but a symbolic link
inside an allowed tree pointing out of it is not seen, nor are reads in C libraries that raise no
audit event (pyarrow's Parquet reader, sqlite's own file access after ``connect``).

Loaded by ``tests/conftest.py``; ``pytest -p outside_reads`` (with ``tests/`` on ``sys.path``)
loads it elsewhere (``test_outside_reads.py`` does so to prove it fails).
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[1])
WATCHED = frozenset({"open", "os.listdir", "os.scandir", "sqlite3.connect"})
SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/proc", "/sys", "/dev", "/run",
          "/var")  # the system tests' SLURM and munge keep their state in /etc, /run and /var
USER = (".cache", ".config", ".local")  # library caches and settings (matplotlib, numba, pip), not test data


def _with_links(paths) -> set[str]:
    out = set()
    for p in paths:
        if p and os.path.isabs(p):
            out.update({os.path.normpath(p), os.path.realpath(p)})
    return out


def allowed_roots(basetemp: str | None = None) -> tuple[str, ...]:
    """The trees a test may read, each ending in ``/`` (a string prefix test)."""
    roots = {REPO, tempfile.gettempdir(), *SYSTEM}
    if basetemp:
        roots.add(os.path.abspath(basetemp))
    roots.update({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})
    roots.update(v for k, v in sysconfig.get_paths().items() if k != "scripts")
    try:
        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    home = os.path.expanduser("~")
    if home != "~":
        roots.update(os.path.join(home, d) for d in USER)
    roots.update(os.environ[v] for v in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR", "NUMBA_CACHE_DIR")
                 if os.environ.get(v))  # fmt: skip
    roots = _with_links(roots)
    roots.discard("/")
    return tuple(sorted(r.rstrip("/") + "/" for r in roots))


class _Reads:
    """What the process opened outside the allowed trees since the last report."""

    def __init__(self) -> None:
        self.allowed: tuple[str, ...] = allowed_roots()
        self.active = False
        self.found: dict[str, str] = {}  # path -> first event
        self.between: dict[str, str] = {}  # read outside any test or collection: reported at the end

    def outside(self, path: str) -> bool:
        if not path.startswith("/"):
            path = os.path.join(os.getcwd(), path)
        if "/." in path or "//" in path:
            path = os.path.normpath(path)
        return not (path + "/").startswith(self.allowed)

    def take(self) -> dict[str, str]:
        found, self.found = self.found, {}
        return found


READS = _Reads()


def _hook(event: str, args: tuple) -> None:
    if event not in WATCHED or not READS.active:
        return
    try:
        path = args[0] if args else None
        if path is None or isinstance(path, int):  # a file descriptor, the current directory
            return
        path = os.fspath(path)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if event == "sqlite3.connect":
            if path.startswith("file:"):
                path = path[5:].split("?", 1)[0]
            if path in ("", ":memory:"):
                return
        if path not in READS.found and READS.outside(path):
            READS.found[path] = event
    except Exception:  # never break the call being audited (a deleted cwd, an odd argument)
        return


sys.addaudithook(_hook)  # an audit hook cannot be removed; it is idle until pytest_configure


def _message(found: dict[str, str]) -> str:
    lines = [f"  {path} ({event})" for path, event in sorted(found.items())]
    return ("opened outside the repository (the suite's data belongs in tests/data/, see tests/outside_reads.py):\n"
            + "\n".join(lines))  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    READS.allowed = allowed_roots(config.getoption("basetemp", None))
    READS.take()
    READS.active = True


def pytest_unconfigure(config: pytest.Config) -> None:
    READS.active = False


def _fail(rep, found: dict[str, str]) -> None:
    text = _message(found)
    if rep.failed:
        rep.sections.append(("outside the repository", text))
    else:
        rep.outcome = "failed"
        rep.longrepr = text


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    READS.between.update(READS.take())
    outcome = yield
    found = READS.take()
    if found:
        _fail(outcome.get_result(), found)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    found = READS.take()
    if found:
        _fail(outcome.get_result(), found)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Reads outside any test or collection (a plugin at the session's start or end) fail the run:
    an xdist worker hands them to the main process, which reports them."""
    found = READS.between | READS.take()
    READS.between = {}
    workeroutput = getattr(session.config, "workeroutput", None)
    if found and workeroutput is not None:
        workeroutput["outside_reads"] = found
    elif found:
        sys.stderr.write(f"\noutside_reads: outside any test, {_message(found)}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # pytest-xdist, main process: a worker is done
    READS.between.update(getattr(node, "workeroutput", {}).get("outside_reads", {}))
