"""Megatron's own ``iteration N/ M`` lines as evidence that numbers a log's training steps.

Unit behaviour of the line reader and the count of completed iterations; log discovery routing
the lines of a combined stdout to the process that printed them; and, on the real H200 capture's
NCCL logs (``tests/data/real/torch_nccl228_h200_tp2pp2``) put into one ``srun --label`` stdout
with Megatron's lines added where its last rank finished each iteration, declared steps located
by those lines, including a job resumed from a checkpoint (Megatron's numbers start at 101),
which the step structure alone cannot number."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from data_paths import CAPTURE

from nccltrace.inputs.logs import discover_logs
from nccltrace.megatron.training_log import (
    completed_before,
    is_iteration_line,
    iteration_lines,
)

REAL = CAPTURE


def _line(k: int, of: int, stamp: bool = True) -> str:
    head = " [2026-11-28 06:14:50]" if stamp else ""
    return f"{head} iteration {k:8d}/{of:8d} | consumed samples: {k * 32:12d} | elapsed time per iteration (ms): 301.2 |"


def test_iteration_lines_are_read_from_application_output_with_and_without_megatrons_timestamp():
    unclassified = pd.DataFrame({"line": [3, 9, 14, 20],
                                 "text": [_line(1, 8), "rank 0 iter 1 done", _line(2, 8, stamp=False), "iteration"]})
    got = iteration_lines(unclassified)
    assert got["line"].tolist() == [3, 14] and got["iteration"].tolist() == [1, 2]
    assert got["train_iters"].tolist() == [8, 8]
    assert is_iteration_line(_line(7, 10).encode()) and not is_iteration_line(b"rank 3 iter 7 done at 8.6s")


def test_completed_iterations_are_told_only_where_the_printed_lines_bracket_a_call():
    marks = pd.DataFrame({"line": [10, 20, 30], "iteration": [1, 2, 3]})
    got = completed_before(marks, np.array([5, 15, 25, 35]))
    assert got.tolist() == [0, 1, 2, 3]  # before "iteration 1": none finished; after the last: 3 (every one printed)
    sparse = pd.DataFrame({"line": [10, 20], "iteration": [100, 200]})  # --log-interval 100
    assert completed_before(sparse, np.array([5, 15, 25])).tolist() == [-1, -1, -1]
    resumed = pd.DataFrame({"line": [10, 20, 30], "iteration": [101, 102, 103]})
    assert completed_before(resumed, np.array([5, 15, 35])).tolist() == [-1, 101, 103]


def test_a_combined_stdout_gives_each_iteration_line_to_the_process_with_the_same_launcher_label(tmp_path):
    nccl = "{h}:{p}:{p} [0] NCCL INFO AllReduce: opCount {o} sendbuff 0x1 recvbuff 0x2 count 4 datatype 7 op 0 " \
           "root 0 comm 0xa [nranks=2] stream 0x3"
    lines = [
        "1: " + _line(0, 8),  # printed before the label's first NCCL line: waits for it
        "0: " + nccl.format(h="n0", p=11, o=0),
        "1: " + nccl.format(h="n1", p=22, o=0),
        "1: " + _line(1, 8),
        "0: some other application output",
        "2: " + _line(1, 8),  # a label with no NCCL line: nobody's
        "1: " + nccl.format(h="n1", p=22, o=1),
    ]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "stdout.txt").write_text("\n".join(lines) + "\n")
    found = discover_logs([tmp_path / "in"], tmp_path / "out")
    mine = (tmp_path / "out" / "nccl_n1_22.log").read_text().splitlines()
    assert [is_iteration_line(x.encode()) for x in mine] == [True, False, True, False]
    other = (tmp_path / "out" / "nccl_n0_11.log").read_text().splitlines()
    assert not any(is_iteration_line(x.encode()) for x in other)
    assert found.skipped_lines[str(tmp_path / "in" / "stdout.txt")] == 2


def test_a_launcher_label_shared_by_two_processes_routes_no_iteration_line(tmp_path):
    nccl = "{h}:{p}:{p} [0] NCCL INFO Bcast: opCount 0 sendbuff 0x1 recvbuff 0x1 count 4 datatype 7 op 0 root 0 " \
           "comm 0xa [nranks=2] stream 0x3"
    # torchrun's [default0] on two nodes of one combined file: the label does not name a process
    lines = ["[default0]:" + nccl.format(h="n0", p=1), "[default0]:" + nccl.format(h="n1", p=2),
             "[default0]:" + _line(1, 8)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "all.log").write_text("\n".join(lines) + "\n")
    discover_logs([tmp_path / "in"], tmp_path / "out")
    for log in (tmp_path / "out").glob("nccl_*.log"):
        assert not any(is_iteration_line(x.encode()) for x in log.read_text().splitlines())


def _combined_stdout(dest: Path, first_iteration: int) -> int:
    """The real capture's four NCCL logs as one ``srun --label`` stdout (rank r's lines prefixed
    ``r: ``, ranks interleaved line by line), with Megatron's iteration line printed by the last
    rank after its last call of each loop iteration (numbered from ``first_iteration``). Returns
    the last rank's pid."""
    out = []
    logs = {}
    last = None
    for r in range(4):
        truth = json.loads((REAL / "truth" / f"truth_rank{r}.json").read_text())
        text = (REAL / "nccl" / f"nccl_vm_{truth['pid']}.log").read_text().splitlines()
        if r == 3:
            last = truth["pid"]
            iters = [c["iter"] for c in truth["calls"]]
            ends = {i for i in range(len(iters)) if i + 1 == len(iters) or iters[i + 1] != iters[i]}
            with_lines, call = [], 0
            for line in text:
                with_lines.append(line)
                if re.search(r"NCCL INFO \w+: opCount ", line):
                    if call in ends:
                        with_lines.append(_line(first_iteration + iters[call], first_iteration + 7))
                    call += 1
            text = with_lines
        logs[r] = text
    for i in range(max(len(t) for t in logs.values())):
        out += [f"{r}: {logs[r][i]}" for r in range(4) if i < len(logs[r])]
    (dest / "stdout.txt").write_text("\n".join(out) + "\n")
    return last


def _traces_without_markers(dest: Path) -> None:
    """The profiler traces with their ProfilerStep ranges removed and one kernel record lost each,
    so that the trace's own sequence cannot place the window (the declared steps are used)."""
    (dest / "kineto").mkdir()
    for trace in sorted((REAL / "kineto").glob("*.json.gz")):
        doc = json.loads(gzip.decompress(trace.read_bytes()))
        events = [e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep")]
        nccl = [i for i, e in enumerate(events) if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
        del events[nccl[100]]
        doc["traceEvents"] = events
        (dest / "kineto" / trace.name).write_bytes(gzip.compress(json.dumps(doc).encode()))


def _window(out: Path, pid: int) -> dict:
    doc = json.loads((out / "aligned" / "vm" / f"nccl_vm_{pid}" / "alignment_quality.json").read_text())
    return next(c for c in doc["checks"] if c["check"] == "capture_window")


@pytest.mark.slow
@pytest.mark.parametrize(("first", "steps"), [(1, "4-6"), (101, "104-106")])
def test_megatrons_iteration_lines_number_the_declared_steps_of_the_process_that_printed_them(
        tmp_path, capsys, first, steps):
    """Loop iterations 3-5 are Megatron's 4-6 in a fresh job and 104-106 in one resumed from
    iteration 100. The last rank's lines number its log's steps in both; the other ranks have
    only the step structure, which counts from the log's start: right for the fresh job, and for
    the resumed one the declared steps lie beyond their 8 logged steps, so they are refused."""
    from test_real_capture import score

    from nccltrace.cli import main

    run = tmp_path / "run"
    run.mkdir()
    last = _combined_stdout(run, first)
    _traces_without_markers(run)
    assert main(["analyze", str(run), "-o", str(tmp_path / "out"), "-q", "--capture-steps", steps,
                 "--until", "ops"]) == 0
    capsys.readouterr()
    window = _window(tmp_path / "out", last)
    assert window["located_by"] == "declared_steps" and window["steps_numbered_by"] == "megatron_iterations"
    assert window["first_step"] == first + 2 and window["iterations_verified"] is False
    got = score(tmp_path / "out")
    assert got["wrong"] == 0, got
    others = [_window(tmp_path / "out", p)["located_by"] for p in (498, 499, 500)]
    if first == 1:
        assert got["right"] >= 4 * 177 - 20 and others == ["declared_steps"] * 3, got
    else:
        assert others == [None] * 3 and 176 <= got["right"] <= 177, got


@pytest.mark.slow
def test_in_a_resumed_job_the_lines_tell_an_unverifiable_window_from_a_contradicted_one(tmp_path, capsys):
    """Markers removed, every kernel kept: the trace's sequence fits the log at five places one
    step apart. For the last rank the lines count 101-105 iterations before them, so the declared
    104-106 fit one place but cannot be verified (identical steps); the other ranks count from the
    log's start and find the declaration contradicted. No window is used on any rank."""
    from test_real_capture import score

    from nccltrace.cli import main

    run = tmp_path / "run"
    run.mkdir()
    last = _combined_stdout(run, 101)
    (run / "kineto").mkdir()
    for trace in sorted((REAL / "kineto").glob("*.json.gz")):
        doc = json.loads(gzip.decompress(trace.read_bytes()))
        doc["traceEvents"] = [e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep")]
        (run / "kineto" / trace.name).write_bytes(gzip.compress(json.dumps(doc).encode()))
    assert main(["analyze", str(run), "-o", str(tmp_path / "out"), "-q", "--capture-steps", "104-106",
                 "--until", "ops"]) == 0
    capsys.readouterr()
    assert "declared_unverified" in _window(tmp_path / "out", last)["message"]
    for pid in (498, 499, 500):
        assert "contradict the trace" in _window(tmp_path / "out", pid)["message"]
    got = score(tmp_path / "out")
    assert got["wrong"] == 0 and got["matched"] == 0, got
