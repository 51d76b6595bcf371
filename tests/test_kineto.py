"""PyTorch-profiler (Kineto) traces as a kernel source: the streaming reader on the real H200
capture's traces and on the capture shapes a real trace can take (other layouts, cut short,
CPU only, another job's, nanoseconds beyond a double's precision)."""

from __future__ import annotations

import gzip
import json
from decimal import Decimal
from pathlib import Path

import pandas as pd
import pytest
from data_paths import CAPTURE

from nccltrace.cli import main
from nccltrace.inputs.kernel_sources import source_kind, stage_traces, traces_of_hosts
from nccltrace.kineto.reader import KinetoFormatError, KinetoTrace, is_kineto_trace
from nccltrace.nsys.reader import NsysExport

REAL = CAPTURE  # tests/data/real/torch_nccl228_h200_tp2pp2
TRACE0 = REAL / "kineto" / "kineto_rank0.json.gz"


def _events(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()), parse_float=Decimal)


def _write_trace(path: Path, doc: dict | list, gz: bool = False) -> Path:
    text = json.dumps(doc, default=str)
    for d in _decimals(doc):  # keep decimal text exactly as Kineto writes it
        text = text.replace(f'"{d}"', str(d), 1)
    data = text.encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _decimals(x):
    if isinstance(x, Decimal):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _decimals(v)
    elif isinstance(x, list):
        for v in x:
            yield from _decimals(v)


def test_real_trace_gives_every_nccl_kernel_with_its_launch_exact_times_and_profiler_arguments():
    doc = _events(TRACE0)
    raw = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
    t = KinetoTrace.open(TRACE0)
    k = t.kernels()
    assert len(k) == len(raw) == 177 and t.rank == 0 and t.world_size == 4 and t.pids == [498]
    assert t.nccl_version == "2.28.9" and {g["desc"] for g in t.pg_config} >= {"TENSOR_MODEL_PARALLEL_GROUP"}
    # nanoseconds from the decimal text, exactly: UTC = baseTimeNanoseconds + ts * 1000
    want = sorted(int(e["ts"] * 1000) for e in raw)
    assert sorted(k["start"].tolist()) == want
    assert t.utc_offset_ns == doc["baseTimeNanoseconds"]
    ends = sorted(int(e["ts"] * 1000) + int(e["dur"] * 1000) for e in raw)
    assert sorted(k["end"].tolist()) == ends
    assert k["launch_api"].eq("cuLaunchKernelEx").all() and k["pid"].eq(498).all() and k["launch_start"].notna().all()
    assert (k["launch_start"] < k["start"]).all()
    with_args = k[k["coll_name"].notna()]
    assert len(with_args) == 153  # the 24 batched Send/Recv kernels carry none
    ag = with_args[with_args["short_name"] == "ncclDevKernel_AllGather_RING_LL"]
    assert set(ag["coll_in_nelems"]) == {1048576} and set(ag["pg_desc"]) == {"TENSOR_MODEL_PARALLEL_GROUP"}
    steps = t.nvtx()
    assert sorted(steps.loc[steps["text"].str.startswith("ProfilerStep#"), "text"]) == [
        "ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]


@pytest.mark.parametrize("block", [997, 4096, 65_537])
def test_streaming_in_small_blocks_gives_the_same_tables(block):
    whole = KinetoTrace.open(TRACE0)
    parts = KinetoTrace.open(TRACE0, block_bytes=block)
    pd.testing.assert_frame_equal(whole.kernels(), parts.kernels())
    pd.testing.assert_frame_equal(whole.nvtx(), parts.nvtx())
    assert parts.rank == 0 and parts.base_time_ns == whole.base_time_ns and parts.truncated is None


def _small_trace() -> dict:
    ts = Decimal("9999999999999.999")  # 116 days of uptime in us: beyond a double's nanoseconds
    return {
        "schemaVersion": 1, "baseTimeNanoseconds": 1_790_000_000_000_000_000,
        "distributedInfo": {"backend": "nccl", "rank": 1, "world_size": 2, "pg_config": [
            {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 2, "ranks": [0, 1]}], "nccl_version": "2.21.5"},
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 42, "tid": 42, "ts": ts,
             "dur": Decimal("100.000")},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 42, "tid": 42,
             "ts": ts + Decimal("1.001"), "dur": Decimal("2.002"), "args": {"correlation": 9, "cbid": 211}},
            {"ph": "X", "cat": "kernel",
             "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
             "pid": 0, "tid": 7, "ts": ts + Decimal("5.005"), "dur": Decimal("7.007"),
             "args": {"device": 0, "stream": 7, "correlation": 9, "grid": [2, 1, 1], "block": [512, 1, 1],
                      "Collective name": "allreduce", "In msg nelems": 8, "Out msg nelems": 8, "Group size": 2,
                      "dtype": "Float", "Process Group Name": "0", "Process Group Description": "default_pg",
                      "Process Group Ranks": "[0, 1]", "note": "a \\\"quoted\\\" [bracket} in a string"}},
            {"ph": "X", "cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4>(...)",
             "pid": 0, "tid": 7, "ts": ts + Decimal("20"), "dur": Decimal("1"), "args": {"correlation": 10}},
        ],
        "traceName": "rank1.json",
    }  # fmt: skip


def test_nanoseconds_are_exact_beyond_a_doubles_precision_and_both_layouts_read(tmp_path):
    doc = _small_trace()
    for path in (_write_trace(tmp_path / "obj.json", doc), _write_trace(tmp_path / "obj.json.gz", doc, gz=True),
                 _write_trace(tmp_path / "events.txt", doc["traceEvents"])):  # JSON Array Format, any name
        assert is_kineto_trace(path) and source_kind(path) == "pytorch_profiler"
        t = KinetoTrace.open(path, block_bytes=61)
        k = t.kernels()
        assert len(k) == 1 and t.kernel_records == 2
        assert int(k["start"].iat[0]) == 10_000_000_000_005_004  # 9999999999999.999 us + 5.005 us
        assert int(k["launch_start"].iat[0]) == 10_000_000_000_001_000 and k["grid_x"].iat[0] == 2
        assert k["coll_in_nelems"].iat[0] == 8
        if path.name != "events.txt":
            assert t.rank == 1 and t.utc_offset_ns == 1_790_000_000_000_000_000
    # the array format may lack its closing bracket (the Chrome trace format allows it)
    text = (tmp_path / "events.txt").read_text().rstrip().removesuffix("]")
    (tmp_path / "open.json").write_text(text)
    t = KinetoTrace.open(tmp_path / "open.json")
    assert len(t.kernels()) == 1


def test_a_truncated_gzip_trace_keeps_its_complete_events_and_says_it_was_cut(tmp_path):
    doc = _small_trace()
    doc["traceEvents"] = doc["traceEvents"] * 200
    full = _write_trace(tmp_path / "full.json.gz", doc, gz=True)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(full.read_bytes()[: len(full.read_bytes()) // 2])
    t = KinetoTrace.open(cut, block_bytes=4096)
    assert t.truncated and 0 < len(t.kernels()) < 200
    assert t.rank == 1  # the header came before the events


def test_not_a_trace_and_a_damaged_event_are_refused_with_the_file_named(tmp_path):
    truth = tmp_path / "truth_rank0.json"
    truth.write_text(json.dumps({"rank": 0, "calls": []}))
    assert not is_kineto_trace(truth) and source_kind(truth) is None
    with pytest.raises(KinetoFormatError, match="truth_rank0.json: not a Chrome-trace"):
        KinetoTrace.open(truth)
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": "soon"}]}')
    with pytest.raises(KinetoFormatError, match="bad.json: damaged trace event"):
        KinetoTrace.open(bad)


def test_cpu_only_and_foreign_traces_are_named_and_not_used(tmp_path):
    doc = _small_trace()
    cpu = dict(doc, traceEvents=[e for e in doc["traceEvents"] if e["cat"] == "user_annotation"])
    _write_trace(tmp_path / "cpu.json", cpu)
    _write_trace(tmp_path / "other_job.json", doc)
    staged = stage_traces([tmp_path / "cpu.json", tmp_path / "other_job.json"], tmp_path / "staged")
    assert "CPU-only trace" in staged[0].problem
    by_host, problems = traces_of_hosts(staged, {"nccl_nodeA_41": ("nodeA", 41)})
    assert by_host == {} and len(problems) == 1 and "other_job.json" in problems[0] and "another job" in problems[0]
    by_host, problems = traces_of_hosts(staged, {"nccl_nodeA_42": ("nodeA", 42)})
    assert [t.path.name for t in by_host["nodeA"]] == ["other_job.json"] and not problems


def test_a_trace_converts_to_an_nsys_export_in_the_real_time_base(tmp_path):
    from nccltrace.kineto.to_nsys import write_nsys_export

    out = write_nsys_export(TRACE0, tmp_path / "vm.sqlite", hostname="vm")
    t = KinetoTrace.open(TRACE0)
    with NsysExport.open(out) as x:
        assert x.session_start_clock_ns is not None and x.session_start_clock_ns > 10**15  # months of uptime
        k = x.kernels()
        assert len(k) == 177
        assert sorted((k["start"] + x.utc_offset_ns).tolist()) == sorted(
            (t.kernels()["start"] + t.utc_offset_ns).tolist())


def test_parse_kineto_writes_the_tables_of_parse_nsys(tmp_path, capsys):
    assert main(["parse-kineto", str(TRACE0), "-o", str(tmp_path / "k")]) == 0
    assert main(["parse-nsys", str(REAL.parent / "nsys_sqlite" / "nsysai_mfu_2gpu_after.sqlite"), "-o",
                 str(tmp_path / "n")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "177 NCCL kernels" in out
    for name in ("kernels", "nvtx", "processes", "launches_without_kernel", "nccl_api_calls"):
        mine = pd.read_parquet(tmp_path / "k" / f"{name}.parquet")
        theirs = pd.read_parquet(tmp_path / "n" / f"{name}.parquet")
        assert set(theirs.columns) <= set(mine.columns), name
    session = json.loads((tmp_path / "k" / "session.json").read_text())
    assert session["source_kind"] == "pytorch_profiler" and session["rank"] == 0


def test_a_trace_of_another_job_is_named_on_the_console_and_in_the_report(tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(REAL / "nccl", run / "nccl")
    doc = _small_trace()  # pid 42: no log of this run
    (run / "kineto").mkdir()
    _write_trace(run / "kineto" / "other.json", doc)
    assert main(["analyze", str(run), "-o", str(tmp_path / "out"), "-q"]) == 0
    err = capsys.readouterr().err
    assert "other.json: its process(es) (pid 42, rank 1) left no NCCL log here" in err
    html = (tmp_path / "out" / "report" / "report.html").read_text()
    assert "other.json" in html and "another job" in html
