"""Acceptance on the real H200 capture (NCCL 2.28.9 logs + PyTorch-profiler traces of loop
iterations 3-5, 4 ranks, TP2 x PP2; ``tests/data/real/torch_nccl228_h200_tp2pp2``).

Ground truth is the capture's own: per rank, call line k of the log is the workload's call k
(``truth/truth_rank<r>.json``, with its loop iteration); the calls of iterations 3-5 pair with the
rank's NCCL kernels in launch (correlation id) order (verified when the capture was made against
each kernel's own collective arguments). Each test says on the console what it measured."""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path

import pandas as pd
import pytest
from data_paths import CAPTURE, REAL

from nccltrace.cli import main
from nccltrace.nsys.reader import NsysExport

WINDOW = (3, 4, 5)  # the loop iterations the profiler captured


def _truth() -> dict[int, dict]:
    """Per pid: the loop iteration of each call line (log order) and the kernel (correlation id)
    of each call in the window."""
    out = {}
    for r in range(4):
        truth = json.loads((CAPTURE / "truth" / f"truth_rank{r}.json").read_text())
        trace = json.loads(gzip.decompress((CAPTURE / "kineto" / f"kineto_rank{r}.json.gz").read_bytes()))
        corr = sorted(e["args"]["correlation"] for e in trace["traceEvents"]
                      if e.get("cat") == "kernel" and e["name"].startswith("nccl"))  # fmt: skip
        iters = [c["iter"] for c in truth["calls"]]
        window = [i for i, it in enumerate(iters) if it in WINDOW]
        assert len(window) == len(corr) == 177
        out[truth["pid"]] = {"kernel": dict(zip(window, corr, strict=True)), "calls": len(iters)}
    return out


def score(out: Path, table: str = "aligned") -> dict[str, int]:
    """Window calls matched right / wrong, other lines located outside the capture, against the truth."""
    tot = {"window_calls": 0, "matched": 0, "right": 0, "wrong": 0, "outside_capture": 0, "other_lines": 0}
    ops = pd.read_parquet(out / "ops" / "ops.parquet") if table == "ops" else None
    for pid, t in _truth().items():
        if ops is None:
            a = pd.read_parquet(out / "aligned" / "vm" / f"nccl_vm_{pid}" / "alignment.parquet")
        else:
            a = ops[ops["pid"] == pid]
        calls = a[a["row_kind"] == "call"].sort_values("line").reset_index(drop=True)
        # the final barrier is logged after the workload's record ends
        assert len(calls) == t["calls"] + 1
        for i, row in calls.iterrows():
            matched = row["status"] == "matched"
            if i in t["kernel"]:
                tot["window_calls"] += 1
                tot["matched"] += matched
                if matched:
                    ok = int(row["kernel_correlation_id"]) == t["kernel"][i]
                    tot["right" if ok else "wrong"] += 1
            else:
                tot["other_lines"] += 1
                tot["wrong"] += matched
                tot["outside_capture"] += row["reason"] == "outside_capture"
    return tot


def _analyze(src: Path, out: Path, *extra: str) -> float:
    t0 = time.perf_counter()
    assert main(["analyze", str(src), "-o", str(out), "-q", *extra]) == 0
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def as_is(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "out"
    seconds = _analyze(CAPTURE, out)
    return out, seconds


@pytest.mark.slow
def test_the_real_capture_as_it_is_matches_every_window_call_to_its_true_kernel(as_is, capsys):
    out, seconds = as_is
    got = score(out)
    ops = score(out, "ops")
    with capsys.disabled():
        print(f"\n[real capture, profiler traces, no options] analyze {seconds:.1f} s; aligned: {got}; ops: {ops}")
    assert got["wrong"] == 0 and ops["wrong"] == 0
    assert got["window_calls"] == 708 and got["right"] == 708
    # the run-level checks confirm them: the cross-rank check stands down on the TP groups, whose
    # kernels end milliseconds apart on ranks sharing the GPU, and names it; nothing is demoted
    assert ops["right"] == 708
    quality = pd.read_parquet(out / "ops" / "alignment_quality.parquet")
    stood = quality[quality["check"] == "cross_rank_stood_down"]
    assert len(stood) == 4 and stood["message"].str.contains(r"end \d\.\d\d ms apart").all()
    assert int(quality.loc[quality["check"] == "cross_rank", "contradicted"].sum()) == 0
    # each kernel's own record (the profiler's element counts) confirms 153 matches per rank;
    # the 24 batched Send/Recv kernels carry none
    args = quality[quality["check"] == "kernel_args"]
    assert args["confirmed"].tolist() == [153] * 4 and args["not_checkable"].tolist() == [24] * 4
    assert not json.loads((out / "ops" / "manifest.json").read_text())["partial"]
    assert "stood down" in (out / "report" / "report.html").read_text()
    assert got["other_lines"] == 1188 and got["outside_capture"] == 1188
    comms = pd.read_parquet(out / "communicators" / "communicators.parquet")
    assert len(comms) == 8 and comms["complete"].all()
    # every communicator named by its PyTorch process group: the kernels' own records name five,
    # the pipeline groups (batched Send/Recv kernels carry no group) and the world are the only
    # groups with their members left; pp and embedding share members and stay apart
    labels = pd.read_parquet(out / "ops" / "parallelism.parquet")
    by_members = labels.groupby(labels["members"].map(tuple))["pg_desc"].apply(sorted).to_dict()
    assert by_members == {(0, 1): ["TENSOR_MODEL_PARALLEL_GROUP"], (2, 3): ["TENSOR_MODEL_PARALLEL_GROUP"],
                          (0, 2): ["EMBEDDING_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP"],
                          (1, 3): ["EMBEDDING_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP"],
                          (0, 1, 2, 3): ["MODEL_PARALLEL_GROUP", "default_pg"]}
    assert sorted(labels["parallelism"]) == ["embd", "embd", "mp", "pp", "pp", "tp", "tp", "world"]
    assert (labels["label_source"] == "pg-names").all()
    assert labels["resolution"].value_counts().to_dict() == {"kernel-records": 5, "elimination": 3}
    # the ops carry the group; the pp calls are Send/Recv, the tp ones the collectives
    ops_calls = pd.read_parquet(out / "ops" / "ops.parquet").query("row_kind == 'call'")
    pp_ops = set(ops_calls.loc[ops_calls["pg_desc"] == "PIPELINE_MODEL_PARALLEL_GROUP", "op"])
    assert pp_ops == {"Send", "Recv"} and ops_calls["pg_name"].notna().all()
    assert sorted(map(tuple, comms["members"])) == sorted(
        [(0, 1, 2, 3), (0, 1), (2, 3), (1, 3), (1, 3), (0, 2), (0, 1, 2, 3), (0, 2)])
    record = json.loads((out / "aligned" / "vm" / "nccl_vm_498" / "alignment_quality.json").read_text())
    window = next(c for c in record["checks"] if c["check"] == "capture_window")
    assert window["located_by"] == "profiler_steps" and window["first_step"] == 3
    ops_table = pd.read_parquet(out / "ops" / "ops.parquet")
    assert ops_table.loc[ops_table["row_kind"] == "call", "steps_verified"].eq(True).all()
    # each collective's TUNING line constrains its kernel on every member of its communicator:
    # rank 0 of each communicator prints it (207 matches), and the opCount names the same call on
    # the other members, which take rank 0's facts (213 more): 105 per rank, every one agreeing
    tuning = quality[quality["check"] == "tuning"]
    assert tuning["confirmed"].tolist() == [105] * 4 and tuning["message"].isna().all()
    manifest = json.loads((out / "manifest.json").read_text())
    assert "kernel times from 4 PyTorch-profiler trace(s)" in manifest["summary"]["notes"]


def _grid_against_rank0_tuning(out: Path) -> pd.DataFrame:
    """Per matched collective kernel of a member: its grid beside the channel count rank 0's
    TUNING line gives the same call (the same logical communicator and opCount)."""
    from nccltrace.align.sequences import attach_tuning
    from nccltrace.core.tables import read_table

    ops = read_table(out / "ops" / "ops.parquet").query("row_kind == 'call' and status == 'matched'")
    told = pd.concat([attach_tuning(read_table(d / "calls.parquet"), read_table(d / "tuning.parquet"))
                      for d in sorted((out / "parsed" / "nccl").glob("*/*"))], ignore_index=True)  # fmt: skip
    ops = ops.merge(told[["file", "line", "tuned_channels"]], on=["file", "line"], how="left")
    rank0 = ops[(ops["rank_in_comm"] == 0) & ops["tuned_channels"].notna() & ops["instance"].notna()]
    rank0 = rank0[["instance", "tuned_channels"]].rename(columns={"tuned_channels": "rank0_channels"})
    kernels = read_table(next((out / "parsed" / "nsys").glob("*/kernels.parquet")),
                         columns=["global_pid", "correlation_id", "grid_x"])  # fmt: skip
    kernels = kernels.rename(columns={"global_pid": "kernel_global_pid", "correlation_id": "kernel_correlation_id"})
    return ops.merge(rank0, on="instance").merge(kernels, on=["kernel_global_pid", "kernel_correlation_id"])


@pytest.mark.slow
def test_every_members_kernel_grid_is_rank0s_tuning_channel_count_for_the_same_call(as_is, capsys):
    """The premise of carrying rank 0's TUNING facts to the members, on the real capture: per
    communicator, every member's kernel grid equals the channel count of rank 0's line for the
    same call (420 of 420 kernels of the window, 213 on ranks other than 0)."""
    m = _grid_against_rank0_tuning(as_is[0])
    same = m["grid_x"].astype("int64") == m["rank0_channels"].astype("int64")
    per = m.assign(same=same).groupby(["logical_id", "rank_in_comm"])["same"].agg(["sum", "count"])
    with capsys.disabled():
        print(f"\n[real capture] member kernel grid = rank 0's TUNING channels: {int(same.sum())} of {len(m)}; "
              f"per (communicator, rank in it): {per.to_dict('index')}")
    assert len(m) == 420 and same.all()
    assert int((m["rank_in_comm"] > 0).sum()) == 213


@pytest.mark.slow
def test_declared_steps_are_checked_against_the_profilers_step_markers(tmp_path, capsys):
    # Megatron's 1-based steps 4-6 are loop iterations 3-5: right; 5-7 contradicts the markers
    for steps, contradicted in (("4-6", False), ("5-7", True)):
        out = tmp_path / steps
        _analyze(CAPTURE, out, "--capture-steps", steps, "--until", "ops")
        got = score(out)
        err = capsys.readouterr().err
        assert got["wrong"] == 0 and got["right"] == 708, (steps, got)
        assert ("contradict the profiler's step markers" in err) is contradicted, err


@pytest.mark.slow
def test_an_nsys_export_in_the_real_time_base_written_from_the_traces_aligns_the_same(tmp_path, capsys):
    from nccltrace.kineto.to_nsys import write_nsys_export

    run = tmp_path / "run"
    shutil.copytree(CAPTURE / "nccl", run / "nccl")
    traces = sorted((CAPTURE / "kineto").glob("*.json.gz"))
    export = write_nsys_export(traces, run / "nsys" / "vm.sqlite", hostname="vm")
    with NsysExport.open(export) as x:
        assert x.session_start_clock_ns > 4_000_000 * 10**9  # the H200's 57.7 days of uptime
    seconds = _analyze(run, tmp_path / "out", "--until", "ops")
    got = score(tmp_path / "out")
    with capsys.disabled():
        print(f"\n[real capture, one nsys export (schema 3.28.1, monotonic time base)] analyze {seconds:.1f} s; {got}")
    assert got["wrong"] == 0 and got["right"] == 708 and got["outside_capture"] == 1188


@pytest.mark.slow
def test_one_nsys_export_per_process_is_read_in_full(tmp_path):
    from nccltrace.kineto.to_nsys import write_nsys_export

    run = tmp_path / "run"
    shutil.copytree(CAPTURE / "nccl", run / "nccl")
    for r, trace in enumerate(sorted((CAPTURE / "kineto").glob("*.json.gz"))):
        write_nsys_export(trace, run / "nsys" / f"trace_{r}.sqlite", hostname="vm")
    _analyze(run, tmp_path / "out", "--until", "ops")
    got = score(tmp_path / "out")
    assert got["wrong"] == 0 and got["right"] >= 703
    kernels = pd.read_parquet(tmp_path / "out" / "parsed" / "nsys" / "vm" / "kernels.parquet")
    assert len(kernels) == 4 * 177 and kernels["pid"].nunique() == 4


@pytest.mark.slow
def test_the_logs_alone_go_through_every_stage_that_needs_no_kernel_times(tmp_path, capsys, as_is):
    """Also: without names or sizes, what each communicator does ranks the 36 layouts that fit
    its member sets; the most likely (tp 2, pp 2) labels all 8 communicators as their PyTorch
    groups' own names do (the run as captured), none of them marked certain."""
    run = tmp_path / "logs_only"
    shutil.copytree(CAPTURE / "nccl", run)
    _analyze(run, tmp_path / "out")
    err = capsys.readouterr().err
    assert "no kernel trace" in err and "torch.profiler" in err and "Traceback" not in err
    ops = pd.read_parquet(tmp_path / "out" / "ops" / "ops.parquet")
    calls = ops[ops["row_kind"] == "call"]
    assert len(calls) == 4 * 474 and (calls["reason"] == "no_export").sum() > 0
    assert not (calls["status"] == "matched").any()
    assert len(pd.read_parquet(tmp_path / "out" / "communicators" / "communicators.parquet")) == 8
    assert (tmp_path / "out" / "volume" / "volume_validation.parquet").is_file()
    html = (tmp_path / "out" / "report" / "report.html").read_text()
    assert "no kernel trace" in html and "torch.profiler" in html
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["partial"]
    named = pd.read_parquet(as_is[0] / "ops" / "parallelism.parquet").set_index("logical_id")
    guessed = pd.read_parquet(tmp_path / "out" / "ops" / "parallelism.parquet").set_index("logical_id")
    assert (named["label_source"] == "pg-names").all() and (guessed["label_source"] == "behaviour").all()
    assert guessed["parallelism"].to_dict() == named["parallelism"].to_dict()
    assert (guessed["resolution"] == "most-likely").all()  # other layouts fit: nothing said to be certain
    assert all(k in str(c).split(",") for k, c in zip(named["parallelism"], guessed["parallelism_candidates"]))
    assert "ranked by what each communicator does" in err and "tp=2, pp=2" in err


@pytest.mark.parametrize("name, utc, clock", [
    ("nsysai_mfu_2gpu_before", 1779782330176752435, 28254349605),
    ("nsysai_mfu_2gpu_after", 1779787126655288414, 38133239887),
    ("nsysai_h100_2gpu_1s", 1779630014975716426, 35255823190),
])  # fmt: skip
def test_real_nsys_2026_exports_are_read_on_the_hosts_monotonic_clock(name, utc, clock, recwarn):
    with NsysExport.open(REAL / "nsys_sqlite" / f"{name}.sqlite") as x:
        assert x.schema_version == "3.25.0"
        assert x.session_start_clock_ns == clock and x.utc_offset_ns == utc - clock
        assert x.time_base_note is None
    assert not [w for w in recwarn if "schema" in str(w.message)]  # a known schema: no warning


@pytest.mark.slow
@pytest.mark.parametrize("steps", ["4-6", "3-5", "5-7"])
def test_declared_steps_without_the_profilers_markers_give_no_wrong_match(tmp_path, capsys, steps):
    """The traces with their ProfilerStep ranges removed: the captured iterations repeat
    identically in the log, so no declaration can be verified: refused with the reason, and the
    places the trace fits named (1-based iterations 2-6: the first iteration counts)."""
    run = tmp_path / "run"
    shutil.copytree(CAPTURE / "nccl", run / "nccl")
    (run / "kineto").mkdir()
    for trace in sorted((CAPTURE / "kineto").glob("*.json.gz")):
        doc = json.loads(gzip.decompress(trace.read_bytes()))
        doc["traceEvents"] = [e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep")]
        (run / "kineto" / trace.name).write_bytes(gzip.compress(json.dumps(doc).encode()))
    _analyze(run, tmp_path / "out", "--capture-steps", steps, "--until", "ops")
    err = capsys.readouterr().err
    got = score(tmp_path / "out")
    assert got["wrong"] == 0 and got["matched"] == 0, got
    assert "declared_unverified" in err and "starting at iterations 2, 3, 4, 5, 6" in err


@pytest.mark.slow
def test_declared_steps_located_from_the_logs_structure_count_the_irregular_first_iteration(tmp_path, capsys):
    """No markers and one kernel record lost per trace, so the trace's sequence fits nowhere: the
    declared steps (4-6) are found from the log's step structure, whose periodic part starts at
    the second iteration (the first has an extra broadcast). Counting that first iteration puts
    the window right; the iteration numbers are said to be unverified."""
    run = tmp_path / "run"
    shutil.copytree(CAPTURE / "nccl", run / "nccl")
    (run / "kineto").mkdir()
    for trace in sorted((CAPTURE / "kineto").glob("*.json.gz")):
        doc = json.loads(gzip.decompress(trace.read_bytes()))
        events = [e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep")]
        nccl = [i for i, e in enumerate(events) if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
        del events[nccl[100]]  # a lost kernel record
        doc["traceEvents"] = events
        (run / "kineto" / trace.name).write_bytes(gzip.compress(json.dumps(doc).encode()))
    _analyze(run, tmp_path / "out", "--capture-steps", "4-6", "--until", "ops")
    err = capsys.readouterr().err
    got = score(tmp_path / "out")
    assert got["wrong"] == 0 and got["right"] >= 690 and got["outside_capture"] == 1188, got
    assert "iteration numbers are unverified" in err
    ops = pd.read_parquet(tmp_path / "out" / "ops" / "ops.parquet")
    calls = ops[ops["row_kind"] == "call"]
    assert calls["steps_verified"].eq(False).all()  # every call row says so: nothing verifies them


def _without_the_default_group(dest: Path, *, model_parallel_group: bool = True) -> None:
    """The capture's logs as a job whose default process group never ran an NCCL collective
    leaves them: no line of the communicator every other one was split from (its init lines, its
    broadcast and final barrier). No communicator then spans every rank as the world: the
    4-rank model-parallel group is a split, which the world never is (its member order still
    gives the global ranks: the communicators' structure). Without ``model_parallel_group``
    its lines go too, as in a job that never ran a collective on it: the tensor- and
    pipeline-parallel pairs are left, which two layouts fit with different ranks."""
    import re

    (dest / "nccl").mkdir(parents=True)
    for log in sorted((CAPTURE / "nccl").glob("*.log")):
        text = log.read_text().splitlines()
        inits = [re.search(r"(ncclCommInitRankConfig|ncclCommSplit) comm (0x[0-9a-f]+) rank \d+ nranks 4 ", x)
                 for x in text]
        gone = {m.group(2) for m in inits if m and (m.group(1) == "ncclCommInitRankConfig" or not model_parallel_group)}
        (dest / "nccl" / log.name).write_text("\n".join(x for x in text if not any(f"comm {c} " in x for c in gone))
                                              + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("source", ["kineto", "flight_recorder"])
def test_without_a_world_communicator_the_profiler_traces_or_the_dumps_name_every_global_rank(tmp_path, capsys,
                                                                                                source):
    """No world communicator: the profiler traces' distributedInfo names each process's rank; so
    do the Flight Recorder dumps, which carry a rank but no pid: each is the process whose
    communicators (size, rank in them) and last calls its groups fit (and, the ranks known, the
    same dumps name every group)."""
    run = tmp_path / "run"
    _without_the_default_group(run)
    shutil.copytree(CAPTURE / source, run / source)
    _analyze(run, tmp_path / "out", "--until", "ops")
    err = capsys.readouterr().err
    members = pd.read_parquet(tmp_path / "out" / "communicators" / "communicator_members.parquet")
    assert dict(zip(members["pid"], members["global_rank"])) == {498: 0, 499: 1, 500: 2, 501: 3}
    assert "global ranks unknown" not in err
    manifest = json.loads((tmp_path / "out" / "communicators" / "manifest.json").read_text())
    assert not any("global rank" in r for r in manifest["partial_reasons"])
    if source == "kineto":
        assert not manifest["partial"]
        got = score_without_world(tmp_path / "out")
        assert got["wrong"] == 0 and got["right"] >= 0.99 * got["window_calls"], got
    else:
        labels = pd.read_parquet(tmp_path / "out" / "ops" / "parallelism.parquet")
        assert (labels["label_source"] == "pg-names").all()


def score_without_world(out: Path) -> dict[str, int]:
    """:func:`score` for logs without the default group's lines: the call lines are the workload's
    calls less its broadcast (iteration 0) and the final barrier."""
    tot = {"window_calls": 0, "right": 0, "wrong": 0}
    for pid, t in _truth().items():
        a = pd.read_parquet(out / "aligned" / "vm" / f"nccl_vm_{pid}" / "alignment.parquet")
        calls = a[a["row_kind"] == "call"].sort_values("line").reset_index(drop=True)
        assert len(calls) == t["calls"] - 1  # the broadcast and the barrier gone
        for i, row in calls.iterrows():
            k = t["kernel"].get(i + 1)  # the workload's call i + 1 (call 0, the broadcast, is gone)
            tot["window_calls"] += k is not None
            if row["status"] == "matched":
                tot["right" if k is not None and int(row["kernel_correlation_id"]) == k else "wrong"] += 1
    return tot


@pytest.mark.slow
def test_without_a_world_communicator_the_model_parallel_groups_member_order_names_the_ranks(tmp_path, capsys):
    """No world communicator and no other record, but the 4-rank model-parallel group spans
    every process: the only assignment of ranks under which every communicator is one of
    Megatron's groups in rank order is the true one, and the note says where it came from."""
    run = tmp_path / "run"
    _without_the_default_group(run)
    _analyze(run, tmp_path / "out", "--until", "ops")
    err = capsys.readouterr().err
    members = pd.read_parquet(tmp_path / "out" / "communicators" / "communicator_members.parquet")
    assert dict(zip(members["pid"], members["global_rank"])) == {498: 0, 499: 1, 500: 2, 501: 3}
    assert "global ranks of 4 process(es) from the communicators' structure: one assignment fits" in err
    assert "global ranks unknown" not in err


@pytest.mark.slow
def test_without_a_world_communicator_or_another_record_the_ranks_are_unknown_and_said_so(tmp_path, capsys):
    """Only the tensor- and pipeline-parallel pairs: the structure fits two assignments (either
    pair could be tensor parallelism), so nothing names the ranks, and that is said."""
    run = tmp_path / "run"
    _without_the_default_group(run, model_parallel_group=False)
    _analyze(run, tmp_path / "out", "--until", "ops")
    err = capsys.readouterr().err
    assert "global ranks unknown for 4 of 4 processes" in err and "the world size is unknown" in err
    assert "at least 2 different assignments fit every Megatron layout of 4 ranks" in err
    assert "world size 2" not in err
    members = pd.read_parquet(tmp_path / "out" / "communicators" / "communicator_members.parquet")
    assert members["global_rank"].isna().all()
    assert json.loads((tmp_path / "out" / "communicators" / "manifest.json").read_text())["partial"]
    ops = pd.read_parquet(tmp_path / "out" / "ops" / "ops.parquet")
    assert ops["global_rank"].isna().all()  # no per-rank attribution on a guess


def _as_one_stdout(logs: Path, dest: Path, label: str) -> None:
    """The per-process logs as one combined stdout, rank r's lines prefixed ``label.format(r)``
    (srun --label: ``'{}: '``; torchrun: ``'[rank{}]:'`` or, a local rank, ``'[default{}]:'``)."""
    texts = []
    for r in range(4):
        pid = json.loads((CAPTURE / "truth" / f"truth_rank{r}.json").read_text())["pid"]
        texts.append((logs / f"nccl_vm_{pid}.log").read_text().splitlines())
    out = [label.format(r) + t[i] for i in range(max(map(len, texts))) for r, t in enumerate(texts) if i < len(t)]
    dest.mkdir(parents=True)
    (dest / "stdout.txt").write_text("\n".join(out) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize(("label", "named"), [("{}: ", True), ("[rank{}]:", True), ("[default{}]:", False)])
def test_without_a_world_communicator_the_launchers_prefixes_name_the_global_ranks(tmp_path, capsys, label, named):
    """srun --label's task number and torchrun's [rankN] are global ranks (one process each);
    torchrun's [defaultN] is a local rank, which names none."""
    _without_the_default_group(tmp_path / "split", model_parallel_group=False)  # the structure does not decide
    _as_one_stdout(tmp_path / "split" / "nccl", tmp_path / "run", label)
    _analyze(tmp_path / "run", tmp_path / "out", "--until", "ops")
    err = capsys.readouterr().err
    members = pd.read_parquet(tmp_path / "out" / "communicators" / "communicator_members.parquet")
    ranks = dict(zip(members["pid"], members["global_rank"]))
    if named:
        assert ranks == {498: 0, 499: 1, 500: 2, 501: 3} and "global ranks unknown" not in err
    else:
        assert members["global_rank"].isna().all() and "global ranks unknown for 4 of 4" in err


@pytest.mark.slow
@pytest.mark.parametrize(("pattern", "name"), [("nccl.{rank}.%h.%p", "nccl.{rank}.vm.{pid}"),
                                               ("rank{rank}/*.log", "rank{rank}/attempt_0.log"),
                                               ("nccl.{rank}.%h.%p", "nccl.{rank}.vm.{other}")])
def test_without_a_world_communicator_log_names_the_user_describes_name_the_global_ranks(tmp_path, capsys,
                                                                                         pattern, name):
    """Logs written with NCCL_DEBUG_FILE=nccl.${SLURM_PROCID}.%h.%p (or one directory per rank)
    and that pattern given: each file's number is its process's rank, and the world size follows
    (ranks 0..3 once each, every communicator whole). A name whose %p is another process's pid
    names none."""
    _without_the_default_group(tmp_path / "split", model_parallel_group=False)  # the structure does not decide
    pids = {r: json.loads((CAPTURE / "truth" / f"truth_rank{r}.json").read_text())["pid"] for r in range(4)}
    for r, pid in pids.items():
        dest = tmp_path / "run" / name.format(rank=r, pid=pid, other=pids[(r + 1) % 4])
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "split" / "nccl" / f"nccl_vm_{pid}.log", dest)
    assert main(["analyze", str(tmp_path / "run"), "-o", str(tmp_path / "out"), "-q", "--until", "ops",
                 "--rank-in-log-name", pattern]) == 0
    err = capsys.readouterr().err
    members = pd.read_parquet(tmp_path / "out" / "communicators" / "communicator_members.parquet")
    settings = json.loads((tmp_path / "out" / "manifest.json").read_text())["config"]
    if "{other}" in name:
        assert members["global_rank"].isna().all() and "global ranks unknown for 4 of 4" in err
        assert "named the global rank of 0 of 4 processes" in err
    else:
        assert dict(zip(members["pid"], members["global_rank"])) == {498: 0, 499: 1, 500: 2, 501: 3}
        assert "global ranks unknown" not in err and settings["world_size"] == 4, settings


@pytest.mark.slow
def test_a_launcher_prefix_that_contradicts_the_world_communicator_is_reported_not_used(tmp_path, capsys):
    """The logs as they are (the default group names every rank) in one stdout whose srun labels
    run backwards: the world communicator's ranks stand, and the disagreement is named."""
    texts = {}
    for r in range(4):
        pid = json.loads((CAPTURE / "truth" / f"truth_rank{r}.json").read_text())["pid"]
        texts[r] = (CAPTURE / "nccl" / f"nccl_vm_{pid}.log").read_text().splitlines()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stdout.txt").write_text("\n".join(
        f"{3 - r}: {t[i]}" for i in range(max(map(len, texts.values()))) for r, t in texts.items() if i < len(t)))
    _analyze(tmp_path / "run", tmp_path / "out", "--until", "ops")
    err = capsys.readouterr().err
    members = pd.read_parquet(tmp_path / "out" / "communicators" / "communicator_members.parquet")
    assert dict(zip(members["pid"], members["global_rank"])) == {498: 0, 499: 1, 500: 2, 501: 3}
    assert "global rank sources disagree: vm:498: rank 0 from the world communicator, 3 from the launcher prefix" in err


@pytest.mark.slow
def test_flight_recorder_dumps_beside_the_logs_name_every_communicator_without_a_profiler_trace(
        tmp_path, capsys, as_is):
    """The logs and the ranks' Flight Recorder dumps, no profiler trace: each dump's groups are
    joined to its rank's communicators by the calls both saw (the dump's last entries against the
    tail of each communicator's calls); the groups it cannot place (the pipeline's batched
    Send/Recv, the default group's broadcast) are the only ones left with their members. Every
    communicator gets the name the kernels' own records give it."""
    run = tmp_path / "run"
    shutil.copytree(CAPTURE / "nccl", run / "nccl")
    shutil.copytree(CAPTURE / "flight_recorder", run / "dumps")
    _analyze(run, tmp_path / "out", "--until", "ops")
    capsys.readouterr()
    named = pd.read_parquet(as_is[0] / "ops" / "parallelism.parquet").set_index("logical_id")
    got = pd.read_parquet(tmp_path / "out" / "ops" / "parallelism.parquet").set_index("logical_id")
    assert got["pg_desc"].to_dict() == named["pg_desc"].to_dict()
    assert got["parallelism"].to_dict() == named["parallelism"].to_dict()
    assert got["resolution"].value_counts().to_dict() == {"flight-recorder": 5, "elimination": 3}
    # the calls the dumps placed carry their group's sequence number: 1, 2, ... in log order
    # (tp: 392 calls per rank, embedding 8, model-parallel 8; the pipeline's and the default
    # group's calls were not placed)
    ops = pd.read_parquet(tmp_path / "out" / "ops" / "ops.parquet").query("row_kind == 'call'")
    for (pid, desc), part in ops[ops["pg_seq"].notna()].sort_values("line").groupby(["pid", "pg_desc"]):
        assert part["pg_seq"].tolist() == list(range(1, len(part) + 1)), (pid, desc)
    assert ops.groupby("pid")["pg_seq"].count().tolist() == [392 + 8 + 8] * 4


@pytest.mark.slow
def test_pytorchs_process_group_lines_in_one_stdout_name_every_communicator(tmp_path, capsys, as_is):
    """The four logs as one torchrun stdout (``[rankN]:`` prefixes) with the line PyTorch writes
    (TORCH_CPP_LOG_LEVEL=INFO) after each communicator's init: ``[PG ID n PG GUID n(DESC) Rank r]
    ProcessGroupNCCL created ncclComm_ <pointer> ...``, the pointer NCCL prints in the init line.
    Which group each pointer belongs to is taken from the capture as analysed with its profiler
    traces (every name from the kernels' records or elimination, checked above). The lines alone,
    no trace, no dump, name all 8 communicators the same way, each by its pointer."""
    import re

    named = pd.read_parquet(as_is[0] / "ops" / "parallelism.parquet").set_index("logical_id")
    members = pd.read_parquet(as_is[0] / "communicators" / "communicator_members.parquet")
    group_of = {(int(p), int(c)): named.loc[int(lid)] for p, c, lid in
                zip(members["pid"], members["comm"], members["logical_id"])}  # fmt: skip
    out = []
    texts = {}
    for r in range(4):
        pid = json.loads((CAPTURE / "truth" / f"truth_rank{r}.json").read_text())["pid"]
        lines = []
        for x in (CAPTURE / "nccl" / f"nccl_vm_{pid}.log").read_text().splitlines():
            lines.append(x)
            m = re.search(r"comm (0x[0-9a-f]+) rank (\d+) .*Init COMPLETE", x)
            if m:
                g = group_of[(pid, int(m.group(1), 16))]
                lines.append(f"I1128 06:14:45.000000 {pid} ProcessGroupNCCL.cpp:2183] [PG ID {g['pg_name']} PG GUID "
                             f"{g['pg_name']}({g['pg_desc']}) Rank {m.group(2)}] ProcessGroupNCCL created ncclComm_ "
                             f"{m.group(1)} on CUDA device: 0")
        texts[r] = lines
    for i in range(max(map(len, texts.values()))):
        out += [f"[rank{r}]:{t[i]}" for r, t in texts.items() if i < len(t)]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stdout.txt").write_text("\n".join(out) + "\n")
    _analyze(tmp_path / "run", tmp_path / "out", "--until", "ops")
    capsys.readouterr()
    got = pd.read_parquet(tmp_path / "out" / "ops" / "parallelism.parquet").set_index("logical_id")
    assert got["pg_desc"].to_dict() == named["pg_desc"].to_dict()
    assert got["parallelism"].to_dict() == named["parallelism"].to_dict()
    assert (got["resolution"] == "pytorch-log").all()


@pytest.mark.slow
def test_with_a_rank_log_missing_the_world_communicator_still_gives_the_world_size(tmp_path, capsys):
    """Rank 3's log left out: the world communicator is a member short (incomplete), but its size
    is the world's, so the layout inference still runs on the complete groups (no sizes
    declared). The world size is the world communicator's, recorded in communicators.parquet."""
    from nccltrace.communicators.schema import run_world_size

    (tmp_path / "run" / "nccl").mkdir(parents=True)
    for log in (CAPTURE / "nccl").glob("*.log"):
        if log.name != "nccl_vm_501.log":
            shutil.copy(log, tmp_path / "run" / "nccl" / log.name)
    _analyze(tmp_path / "run", tmp_path / "out", "--until", "ops")
    err = capsys.readouterr().err
    comms = pd.read_parquet(tmp_path / "out" / "communicators" / "communicators.parquet")
    members = pd.read_parquet(tmp_path / "out" / "communicators" / "communicator_members.parquet")
    assert not comms["complete"].all() and comms["world"].sum() == 1
    assert run_world_size(comms, members) == 4
    assert "layouts fit the member sets" in err and "no communicator to infer them from" not in err
