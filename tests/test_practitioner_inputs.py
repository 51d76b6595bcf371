"""The practitioner's path (issue: one pipeline of stages): `nccltrace analyze` on logs and
exports as users have them, not as our launcher names them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from data_paths import FIXTURE_LOGS

from nccltrace.cli import main
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.validation.alignment import SCENARIO_BASE

CALL = re.compile(rb"NCCL INFO \w+: opCount")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """1-node TP2.PP2 run, 4 ranks, NCCL 2.21.5, grouped P2P."""
    raw = tmp_path_factory.mktemp("practitioner") / "raw"
    emulate_run({**SCENARIO_BASE, "iterations": 2, "seed": 3, "imperfections": {"fuse_grouped_p2p": True}}, raw)
    return raw


def test_logs_with_call_lines_only_are_analysed_with_inferred_communicators_and_flagged(small_run, tmp_path, capsys):
    """NCCL_DEBUG_SUBSYS=COLL: no init lines. Communicators come from the call sequences, the
    run is partial with a message that says so and how to get exact ones (was: 'No objects
    to concatenate')."""
    import shutil

    raw = tmp_path / "raw"
    shutil.copytree(small_run, raw)
    for log in (raw / "nccl").glob("*.log"):
        log.write_bytes(b"".join(line for line in log.read_bytes().splitlines(True) if CALL.search(line)))
    assert main(["analyze", str(raw), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "communicators inferred from call sequences" in err and "NCCL_DEBUG_SUBSYS=INIT" in err
    comms = read_table(tmp_path / "out" / "communicators" / "communicators.parquet")
    assert len(comms) and set(comms["kind"].astype(str)) == {"sequence"}
    ops = read_table(tmp_path / "out" / "ops" / "ops.parquet")
    calls = ops[ops["row_kind"] == "call"]
    assert (calls["status"] == "matched").mean() > 0.9
    manifest = json.loads((tmp_path / "out" / "ops" / "manifest.json").read_text())
    assert manifest["partial"]


def _copy_exports(raw, dest, rename=None):
    import shutil

    for i, db in enumerate(sorted((raw / "nsys").glob("*.sqlite"))):
        shutil.copy(db, dest / (rename(i) if rename else db.name))


def test_rank_logs_of_any_name_and_gzip_with_exports_of_any_name_are_found_by_content(small_run, tmp_path, capsys):
    """rank0.log, rank1.txt, rank3.log.gz with application output around the NCCL lines, and
    exports named profile_<i>.sqlite (mapped to nodes by their recorded hostname): every call
    is found and aligned as from the launcher's own layout (was: 'rank0.log' refused)."""
    import gzip

    flat = tmp_path / "flat"
    flat.mkdir()
    logs = sorted((small_run / "nccl").glob("nccl_*.log"))
    for i, log in enumerate(logs):
        data = b"starting rank\n" + log.read_bytes() + b"loss 1.23\n"
        if i == 3:
            (flat / f"rank{i}.log.gz").write_bytes(gzip.compress(data))
        else:
            (flat / (f"rank{i}.txt" if i % 2 else f"rank{i}.log")).write_bytes(data)
    _copy_exports(small_run, flat, lambda i: f"profile_{i}.sqlite")
    assert main(["analyze", str(flat), "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr()
    assert "found by content in 4 file(s)" in out.err and "application line(s)" in out.err
    ops = read_table(tmp_path / "out" / "ops" / "ops.parquet")
    truth = read_table(small_run / "ground_truth" / "ops.parquet")
    calls = ops[(ops["row_kind"] == "call") & ops["duplicate_of"].isna()]
    assert len(calls) == len(truth) and (calls["status"] == "matched").mean() > 0.95
    sources = json.loads((tmp_path / "out" / "inputs" / "nccl" / "sources.json").read_text())
    assert len(sources["logs"]) == len(logs)


@pytest.mark.parametrize("prefix", ["srun", "torchrun", "mpirun"])
def test_one_combined_stdout_of_all_ranks_with_launcher_prefixes_is_split_per_process(small_run, tmp_path, prefix):
    """All ranks in one stdout, lines interleaved, each with its launcher's prefix (srun
    --label, torchrun --tee, mpirun --tag-output), application output between them (was:
    'expected the calls of one process, found pids [...]')."""
    import random

    def tag(rank: int) -> bytes:
        return {"srun": f"{rank}: ", "torchrun": f"[default{rank}]:", "mpirun": f"[1,{rank}]<stdout>:"}[prefix].encode()

    streams = [[tag(r) + line for line in log.read_bytes().splitlines(True)]
               for r, log in enumerate(sorted((small_run / "nccl").glob("nccl_*.log")))]  # fmt: skip
    rnd, merged = random.Random(0), []
    while any(streams):
        merged.append(rnd.choice([s for s in streams if s]).pop(0))
        if rnd.random() < 0.02:
            merged.append(tag(0) + b" iteration 1/2 | lm loss 3.1\n")
    d = tmp_path / "job"
    d.mkdir()
    (d / "slurm-1234.out").write_bytes(b"".join(merged))
    _copy_exports(small_run, d)
    assert main(["analyze", str(d), "-o", str(tmp_path / "out")]) == 0
    ops = read_table(tmp_path / "out" / "ops" / "ops.parquet")
    truth = read_table(small_run / "ground_truth" / "ops.parquet")
    calls = ops[(ops["row_kind"] == "call") & ops["duplicate_of"].isna()]
    assert len(calls) == len(truth) and calls["pid"].nunique() == truth["pid"].nunique()
    assert (calls["status"] == "matched").mean() > 0.95


def test_logs_of_two_jobs_in_one_directory_are_refused_with_the_jobs_listed(small_run, tmp_path, capsys):
    """Two runs' logs in one directory share no communicator: the analysis refuses and lists
    the jobs (was: '50 % matched ... complete', volumes doubled)."""
    other = tmp_path / "other"
    emulate_run({**SCENARIO_BASE, "iterations": 2, "seed": 4, "imperfections": {"fuse_grouped_p2p": True}}, other)
    d = tmp_path / "mixed"
    d.mkdir()
    for i, raw in enumerate((small_run, other)):
        for log in (raw / "nccl").glob("*.log"):
            (d / f"job{i}_{log.name}").write_bytes(log.read_bytes())
    _copy_exports(small_run, d)
    assert main(["analyze", str(d), "-o", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert "2 jobs that share no communicator" in err and "directory of its own" in err
    assert not (tmp_path / "out" / "ops" / "ops.parquet").exists()


def test_analyze_runs_through_the_report_and_says_where_time_is_lost(small_run, tmp_path):
    """`analyze` stopped at ops/ (no metrics, volume, trace or report); the report computed
    stragglers, wait and skew but showed none of it."""
    import html as htmllib

    out = tmp_path / "out"
    assert main(["analyze", str(small_run), "-o", str(out), "-q"]) == 0
    for part in ("metrics/op_metrics.parquet", "volume/volume_validation.csv", "trace/trace.json.gz",
                 "report/report.html", "report/tables/time_lost.parquet"):
        assert (out / part).is_file(), part
    t = read_table(out / "report" / "tables" / "time_lost.parquet")
    assert len(t) and (t["wait_s"].fillna(0) <= t["comm_time_s"] + 1e-12).all()
    assert t["comm_share_of_span"].dropna().between(0, 1).all() and t["top_straggler_rank"].notna().any()
    page = htmllib.unescape((out / "report" / "report.html").read_text())
    assert "Where is time lost?" in page and "top_straggler_rank" in page
    inferred = page[page.index("What was inferred, what was declared"):page.index("Where is time lost?")]
    assert "declared (run.yaml or the command line)" in inferred and "megatron-groups" in inferred
    assert main(["analyze", str(small_run), "-o", str(tmp_path / "ops_only"), "-q", "--until", "ops"]) == 0
    assert not (tmp_path / "ops_only" / "report").exists()


def test_without_declared_sizes_the_world_is_not_labelled_dp_and_labels_are_called_guesses(small_run, tmp_path,
                                                                                             capsys):
    """No run.yaml, no --tp/--pp: the 4-rank world communicator was labelled 'dp' and nothing
    said the labels were guesses. Now the sizes are inferred from the member sets where they
    determine them, else the console says the labels are guesses and how to declare sizes."""
    import shutil

    raw = tmp_path / "raw"
    shutil.copytree(small_run, raw, ignore=shutil.ignore_patterns("run.yaml", "ground_truth"))
    assert main(["analyze", str(raw), "-o", str(tmp_path / "out"), "-q"]) == 0
    err = capsys.readouterr().err
    assert "parallelism labels are guesses" in err or "parallel sizes inferred" in err
    page = (tmp_path / "out" / "report" / "report.html").read_text()
    section = page[page.index("What was inferred, what was declared"):page.index("Where is time lost?")]
    assert "guesses" in section or "inferred from the communicators" in section
    assert "--tp/--pp" in err
    labels = read_table(tmp_path / "out" / "ops" / "parallelism.parquet")
    world = labels[labels["nranks"] == labels["nranks"].max()]
    assert "dp" not in set(world["parallelism"].astype(str))


def test_an_nsys_report_without_export_and_without_nsys_is_named_with_the_export_command(small_run, tmp_path,
                                                                                          capsys, monkeypatch):
    import shutil

    d = tmp_path / "job"
    shutil.copytree(small_run, d, ignore=shutil.ignore_patterns("ground_truth"))
    (d / "nsys" / "node001.nsys-rep").write_bytes(b"report")  # a second node, captured but not exported
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nsys here
    assert main(["analyze", str(d), "-o", str(tmp_path / "out"), "-q", "--until", "ops"]) == 0
    err = capsys.readouterr().err
    assert "node001.nsys-rep" in err and "nsys export --type sqlite" in err


def test_finding_real_logs_by_content_loses_no_call_or_says_which_lines_it_could_not_attribute(tmp_path):
    """Real NCCL log excerpts of other projects (several processes per file, torn lines, lines
    whose prefix was cut): after discovery the log reader finds every call it finds in the
    original file, or discovery names the NCCL lines it could not give to a process."""
    from nccltrace.inputs.logs import discover_logs
    from nccltrace.nccl.log_reader import parse_logs

    checked = 0
    for log in sorted(FIXTURE_LOGS.glob("*.log")):
        work = tmp_path / log.stem
        (work / "in").mkdir(parents=True)
        (work / "in" / log.name).write_bytes(log.read_bytes())
        found = discover_logs([work / "in"], work / "norm")
        before = parse_logs([log], work / "a").counts["call"]
        after = sum(parse_logs([p], work / f"b_{p.stem}").counts["call"] for p in found.logs.values())
        assert after <= before, log.name
        if after < before:
            assert found.unattributed.get(str(work / "in" / log.name), 0) >= before - after, log.name
            assert found.problems(), log.name
        checked += before > 0
    assert checked >= 5  # excerpts with call lines (most of the others are init-only)
