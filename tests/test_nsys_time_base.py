"""nsys >= 2025 stores times on the host's monotonic clock: the emulator writes that base for
nsys 2026.4, the reader puts it on UTC, and a log whose timestamps cannot fit an export's span
(a misread base, another run) is named with both spans instead of crashing the alignment."""

from __future__ import annotations

import shutil
import sqlite3

import pytest
from data_paths import NSYS_SQLITE
from emulated_runs import SMALL_MODEL

from nccltrace.cli import main
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.nsys.reader import NsysExport

RUN = {**SMALL_MODEL, "name": "tb", "tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 2, "iterations": 2,
       "nccl_version": "2.28.9", "nccl_timestamps": True, "nsys_version": "2026.4", "seed": 11}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return emulate_run(RUN, tmp_path_factory.mktemp("tb") / "raw")


def test_emulated_2026_exports_store_the_hosts_monotonic_clock_and_read_back_on_utc(run):
    import pandas as pd

    truth = read_table(run.out_dir / "ground_truth" / "clock.parquet").set_index("host")
    kernels = read_table(run.out_dir / "ground_truth" / "kernels.parquet")
    for path in run.nsys_files:
        with NsysExport.open(path) as x:
            assert x.session_start_clock_ns > 86_400 * 10**9  # a day of uptime or more, per node
            assert x.utc_offset_ns == x.session_start_utc_ns - x.session_start_clock_ns
            assert x.utc_offset_ns == int(truth.loc[path.stem, "session_start_utc_ns"]) - x.session_start_clock_ns
            k = x.kernels()
            assert (k["start"] > x.session_start_clock_ns).all()
    clocks = [NsysExport.open(p).session_start_clock_ns for p in run.nsys_files]
    assert len(set(clocks)) == len(clocks)  # every node booted at its own time
    assert len(kernels) and isinstance(kernels, pd.DataFrame)


def test_timestamped_logs_align_on_exports_in_the_monotonic_base(run, tmp_path):
    assert main(["analyze", str(run.out_dir), "-o", str(tmp_path / "out"), "-q", "--until", "ops"]) == 0
    ops = read_table(tmp_path / "out" / "ops" / "ops.parquet")
    calls = ops[ops["row_kind"] == "call"]
    assert (calls["status"] == "matched").mean() > 0.95


def test_a_misread_time_base_is_named_with_both_spans_not_a_crash(run, tmp_path, capsys):
    raw = tmp_path / "raw"
    shutil.copytree(run.out_dir, raw)
    for path in (raw / "nsys").glob("*.sqlite"):
        # what a reader that ignores systemClockNs sees: times taken as session-relative
        db = sqlite3.connect(path)
        db.execute("UPDATE TARGET_INFO_SESSION_START_TIME SET systemClockNs = NULL")
        db.commit()
        db.close()
    assert main(["analyze", str(raw), "-o", str(tmp_path / "out"), "-q", "--until", "ops"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "none of the log's timed call lines" in err and "cannot both be on UTC" in err and "systemClockNs" in err
    ops = read_table(tmp_path / "out" / "ops" / "ops.parquet")
    calls = ops[ops["row_kind"] == "call"]
    assert not (calls["status"] == "matched").any()
    assert (calls["reason"] == "capture_not_located").any()


def test_reader_warnings_are_one_console_line(tmp_path):
    """An export of an untested schema version: the CLI says so in one line, not in Python's
    warning format (file, line, category, source line)."""
    import subprocess
    import sys

    real = NSYS_SQLITE / "nsysai_mfu_2gpu_after.sqlite"
    copy = tmp_path / "x.sqlite"
    shutil.copy(real, copy)
    db = sqlite3.connect(copy)
    table = "META_DATA_EXPORT"
    db.execute(f"UPDATE {table} SET value = '3.99.0' WHERE name = 'EXPORT_SCHEMA_VERSION'")
    db.commit()
    db.close()
    done = subprocess.run([sys.executable, "-m", "nccltrace.cli", "parse-nsys", str(copy), "-o", str(tmp_path / "o")],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "3.99.0" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "NsysSchemaWarning" not in done.stderr
    assert ".py:" not in done.stderr
