"""Every evidence source alone and together, on the real H200 capture (issue 34): the profiler
traces alone, traces + Flight Recorder dumps, the dumps alone, and traces whose CPU records were
stripped, each analysed without the NCCL logs, against the capture's ground truth
(``truth/``: every call the workload made, in order) and against the analysis with the logs.
The figures are printed (run with ``-s``)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from data_paths import CAPTURE

from nccltrace.analyze import analyze_run
from nccltrace.pytorch.collectives import nccl_op

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("logless_sources")]

WINDOW = (3, 4, 5)  # the profiled loop iterations
LABELS = ["embd", "embd", "mp", "pp", "pp", "tp", "tp", "world"]


def _raw(tmp: Path, *parts: str, strip_cpu_records: bool = False) -> Path:
    raw = tmp / "raw"
    for part in parts:
        shutil.copytree(CAPTURE / part, raw / part)
    if strip_cpu_records:  # a trace profiled without CPU activity keeps no record_param_comms
        for f in sorted((raw / "kineto").glob("*.json.gz")):
            doc = json.loads(gzip.decompress(f.read_bytes()))
            doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("name") != "record_param_comms"]
            f.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return raw


def _analysed(tmp_path_factory, name: str, *parts: str, **kw) -> tuple[dict, pd.DataFrame]:
    tmp = tmp_path_factory.mktemp(name)
    src = CAPTURE if not parts else _raw(tmp, *parts, **kw)
    summary = analyze_run(src, tmp / "out", progress=False)
    return summary, pd.read_parquet(tmp / "out" / "ops" / "ops.parquet")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, pd.DataFrame]]:
    return {
        "logs": _analysed(tmp_path_factory, "logs"),
        "traces": _analysed(tmp_path_factory, "traces", "kineto"),
        "traces_fr": _analysed(tmp_path_factory, "traces_fr", "kineto", "flight_recorder"),
        "fr": _analysed(tmp_path_factory, "fr", "flight_recorder"),
        "stripped": _analysed(tmp_path_factory, "stripped", "kineto", strip_cpu_records=True),
        "stripped_fr": _analysed(tmp_path_factory, "stripped_fr", "kineto", "flight_recorder", strip_cpu_records=True),
    }


def _truth(window: bool) -> dict[int, list[dict]]:
    out = {}
    for r in range(4):
        calls = json.loads((CAPTURE / "truth" / f"truth_rank{r}.json").read_text())["calls"]
        out[r] = [c for c in calls if not window or c["iter"] in WINDOW]
    return out


def _against_truth(ops: pd.DataFrame, members: dict[int, list[int]], window: bool) -> dict[str, int]:
    """Per rank, the k-th call row (source order) against the workload's k-th call: op, and the
    group's global ranks (the communicator's members)."""
    calls = ops[ops["row_kind"] == "call"]
    right = {"rows": len(calls), "op": 0, "ranks": 0, "rank": 0}
    for r, truth in _truth(window).items():
        mine = calls[calls["global_rank"] == r].sort_values("line")
        assert len(mine) == len(truth), f"rank {r}: {len(mine)} rows, truth {len(truth)}"
        for row, t in zip(mine.itertuples(), truth, strict=True):
            right["op"] += row.op == nccl_op(t["op"]) or (t["op"] == "all_to_all" and row.op == "AlltoAll")
            right["ranks"] += sorted(members.get(row.logical_id, [])) == sorted(t["ranks"])
            right["rank"] += row.global_rank == r
    return right


def _members(summary: dict) -> dict[int, list[int]]:
    comms = pd.read_parquet(Path(summary["outputs"]["communicators"]))
    return {int(lid): [int(m) for m in ms] for lid, ms in zip(comms["logical_id"], comms["members"])}


def test_traces_alone_give_one_row_per_nccl_kernel_with_op_size_group_and_rank(runs):
    summary, ops = runs["traces"]
    calls = ops[ops["row_kind"] == "call"]
    assert len(calls) == 708 and summary["matched"] == 708
    by = calls.groupby(["op_source", "size_source"]).size().to_dict()
    print("traces alone:", by)
    assert by == {("kernel-record", "kernel-record"): 612, ("cpu-record", "cpu-record"): 96}
    assert set(calls["rank_source"]) == {"profiler-distributed-info"}
    right = _against_truth(ops, _members(summary), window=True)
    print("traces alone vs truth:", right)
    assert right == {"rows": 708, "op": 708, "ranks": 708, "rank": 708}


def test_log_less_rows_equal_the_log_run_on_every_window_call(runs):
    """The same directories with the logs give today's tables: the log-less rows equal the log
    run's on op, count, group, label, ranks and kernel times, call by call (joined by kernel)."""
    logged = runs["logs"][1]
    logged = logged[logged["status"] == "matched"]
    cols = ["op", "count", "datatype_name", "nranks", "root", "rank_in_comm", "pg_name", "pg_desc", "parallelism",
            "kernel_start_utc", "kernel_end_utc", "bytes", "message_bytes"]  # fmt: skip
    for name in ("traces", "traces_fr"):
        ops = runs[name][1]
        ops = ops[ops["row_kind"] == "call"]
        j = ops.merge(logged, on=["global_rank", "kernel_correlation_id"], suffixes=("", "_log"))
        same = {c: int((j[c].astype(str) == j[c + "_log"].astype(str)).sum()) for c in cols}
        print(name, "vs log run:", len(j), same)
        assert len(j) == 708 and all(v == 708 for v in same.values()), same
    assert set(logged["source"]) == {"nccl-log"} and set(logged["op_source"]) == {"nccl-log"}


def test_traces_and_dumps_number_every_call_by_its_group_sequence(runs):
    _, ops = runs["traces_fr"]
    calls = ops[ops["row_kind"] == "call"]
    assert calls["pg_seq"].notna().sum() == 708 and set(calls["seq_source"]) == {"flight-recorder"}
    seq = calls.groupby(["global_rank", "pg_desc"])["pg_seq"].agg(["min", "max"])
    print("traces + dumps, pg_seq per rank and group:", seq.to_dict("index"))
    assert {tuple(v) for v in seq.loc[0].to_numpy()} == {(148, 294), (25, 48), (4, 6)}
    assert calls["enqueue_utc"].notna().all()


def test_stripped_traces_leave_batched_send_recv_sizes_null_and_say_it_once(runs):
    summary, ops = runs["stripped"]
    calls = ops[ops["row_kind"] == "call"]
    no_size = calls[calls["count"].isna()]
    print("stripped traces:", len(calls), "rows,", len(no_size), "without size")
    assert len(calls) == 708 and len(no_size) == 96
    assert no_size["op"].isna().all() and no_size["size_source"].isna().all()
    assert set(no_size["kernel_name"]) == {"ncclDevKernel_SendRecv"}
    said = [p for p in summary["problems"] if "have no element count" in p]
    assert len(said) == 1 and "record_param_comms" in said[0] and "Flight Recorder" in said[0]
    sized = calls[calls["count"].notna()]
    assert len(sized) == 612 and set(sized["size_source"]) == {"kernel-record"}


def test_dumps_give_batched_send_recv_kernels_without_records_their_calls(runs):
    """A trace without CPU records says nothing of its batched Send/Recv kernels; the dumps
    give each its calls (by enqueue time), and every row then equals the log run's."""
    summary, ops = runs["stripped_fr"]
    calls = ops[ops["row_kind"] == "call"]
    filled = calls[calls["size_source"] == "flight-recorder"]
    print("stripped traces + dumps:", len(filled), "calls from the dumps;", int(calls["pg_seq"].notna().sum()),
          "numbered")  # fmt: skip
    assert len(calls) == 708 and len(filled) == 96 and calls["count"].notna().all()
    assert set(filled["op"]) == {"Send", "Recv"} and set(filled["count"]) == {1048576}
    assert calls["pg_seq"].notna().all()
    assert not [p for p in summary["problems"] if "have no element count" in p]
    logged = runs["logs"][1]
    j = calls.merge(logged[logged["status"] == "matched"], on=["global_rank", "kernel_correlation_id"],
                    suffixes=("", "_log"))  # fmt: skip
    for c in ("op", "count", "root", "pg_name", "parallelism", "kernel_start_utc"):
        assert (j[c].astype(str) == j[c + "_log"].astype(str)).sum() == 708, c


def test_dumps_alone_give_every_recorded_call_with_group_ranks_and_label(runs):
    summary, ops = runs["fr"]
    right = _against_truth(ops, _members(summary), window=False)
    print("dumps alone vs truth:", right)
    # every call of the run (the log's last line, a barrier after the dump, is no workload call)
    assert right == {"rows": 1892, "op": 1892, "ranks": 1892, "rank": 1892}
    assert ops["kernel_start"].isna().all() and set(ops["reason"]) == {"no_export"}
    assert set(ops["size_source"]) == {"flight-recorder"}
    assert any("no kernel trace (Flight Recorder dumps alone)" in p for p in summary["problems"])


def test_every_source_names_the_communicators_from_the_jobs_own_groups(runs):
    for name in ("traces", "traces_fr", "fr"):
        summary, _ = runs[name]
        labels = pd.read_parquet(Path(summary["outputs"]["parallelism"]))
        print(name, "labels:", sorted(labels["parallelism"]), set(labels["label_source"]))
        assert sorted(labels["parallelism"]) == LABELS
        assert set(labels["label_source"]) == {"pg-names"}


def _nsys_alone(tmp_path: Path, name: str) -> tuple[dict, pd.DataFrame]:
    from data_paths import NSYS_SQLITE

    (tmp_path / "raw").mkdir()
    shutil.copy(NSYS_SQLITE / f"{name}.sqlite", tmp_path / "raw")
    summary = analyze_run(tmp_path / "raw", tmp_path / "out", progress=False)
    return summary, pd.read_parquet(tmp_path / "out" / "ops" / "ops.parquet")


@pytest.mark.parametrize(("name", "calls", "linked", "kernels", "lost"), [
    ("nsysai_mfu_2gpu_before", 264, 256, 64, 8), ("nsysai_mfu_2gpu_after", 240, 240, 60, 0)])  # fmt: skip
def test_an_nsys_export_alone_gives_its_api_calls_with_their_kernels_and_no_sizes(tmp_path, name, calls, linked,
                                                                                  kernels, lost):  # fmt: skip
    summary, ops = _nsys_alone(tmp_path, name)
    c = ops[ops["row_kind"] == "call"]
    m = c[c["status"] == "matched"]
    before = ops[ops["reason"] == "no_call_record"]
    print(name, "alone:", len(c), "calls,", len(m), "linked to", len(m.drop_duplicates(["pid", "kernel_correlation_id"])),
          "kernels;", len(before), "kernels before the window")  # fmt: skip
    assert (len(c), len(m), len(m.drop_duplicates(["pid", "kernel_correlation_id"]))) == (calls, linked, kernels)
    assert int((c["reason"] == "kernel_record_missing").sum()) == lost and len(before) == 2
    assert c["count"].isna().all() and c["global_rank"].isna().all() and c["logical_id"].isna().all()
    assert set(c["op"]) == {"Send", "Recv"} and set(c["torch_op"]) == {"all_to_all"} and set(c["source"]) == {"nsys-nvtx"}
    said = [n for n in summary["notes"] + summary["problems"] if "--include-blobs=true" in n]
    assert len(said) == 1


def test_an_nsys_export_without_nccl_gives_empty_tables_and_says_why(tmp_path):
    summary, ops = _nsys_alone(tmp_path, "nsysai_h100_2gpu_1s")
    assert len(ops) == 0 and summary["processes"] == 0 and not summary["partial"]
    assert any("no NCCL call or kernel in the export's window" in n for n in summary["notes"])


def test_the_profilers_own_records_measure_the_log_alignment_and_name_disagreements(runs):
    """With the logs, each matched call is checked against the trace's own record of its
    kernel's call: 708 of 708 agree on the real capture; a wrong count is named, with both."""
    from nccltrace.align.profiler_check import profiler_records_check
    from nccltrace.core.layout import RunLayout

    summary, _ = runs["logs"]
    quality = pd.read_parquet(Path(summary["outputs"]["alignment_quality"]))
    rec = quality[quality["check"] == "profiler_records"]
    print("profiler records vs log alignment:", rec[["process", "confirmed", "contradicted", "not_checkable"]]
          .to_dict("records"))  # fmt: skip
    assert int(rec["confirmed"].sum()) == 708 and int(rec["contradicted"].sum()) == 0 and len(rec) == 4
    layout = RunLayout(Path(summary["out_dir"]))
    proc = min(rec["process"])
    host, pid = layout.host_of(proc), int(proc.rsplit("_", 1)[1])
    alignment = pd.read_parquet(layout.alignment(proc))
    calls = pd.read_parquet(layout.parsed_nccl(proc) / "calls.parquet")
    line = int(alignment[alignment["status"] == "matched"]["line"].iloc[0])
    calls.loc[calls["line"] == line, "count"] = 7
    nsys = layout.parsed_nsys(host)
    check = profiler_records_check(alignment, calls, pd.read_parquet(nsys / "kernels.parquet"),
                                   pd.read_parquet(nsys / "comm_records.parquet"), pid)  # fmt: skip
    assert check["contradicted"] == 1 and f"line {line}: log" in check["message"] and "count 7" in check["message"]


@pytest.mark.parametrize(("scenario", "rows", "sizes"), [
    ("gpu_error_1st", 289, "tp=2, pp=4, cp=1, ep=4"), ("gpu_error_2nd", 278, "tp=4, pp=2, cp=1, ep=8"),
    ("lock_gil_1st", 142, "tp=4, pp=2, cp=1, ep=8"), ("lock_gil_2nd", 216, "tp=2, pp=4, cp=1, ep=4")])  # fmt: skip
def test_sixteen_rank_dumps_alone_name_every_group_and_the_layout(tmp_path, scenario, rows, sizes):
    """The 16-rank Megatron jobs' dumps (another PyTorch, other layouts, only each group's tail):
    every call a row, every communicator labelled from its group's own name, the layout from
    the names."""
    from data_paths import FR_MEGATRON16

    summary = analyze_run(FR_MEGATRON16 / scenario, tmp_path / "out", progress=False)
    ops = pd.read_parquet(tmp_path / "out" / "ops" / "ops.parquet")
    labels = pd.read_parquet(Path(summary["outputs"]["parallelism"]))
    print(scenario, len(ops), "rows;", len(labels), "communicators;", set(labels["label_source"]))
    assert len(ops) == rows and summary["processes"] == 16 and ops["global_rank"].notna().all()
    assert set(labels["label_source"]) == {"pg-names"} and ops["pg_desc"].notna().all()
    assert any(f"from the PyTorch process groups' names: {sizes}" in n for n in summary["notes"])


def test_a_dump_whose_groups_do_not_name_its_rank_says_the_rank_rests_on_its_file_name(tmp_path):
    """A rank is the one member every group of the dump shares; where the groups share several
    (only a world-sized group kept), the file name is all that names it: used, and said so."""
    import pickle

    from nccltrace.inputs.evidence import source_processes
    from nccltrace.pytorch.flight_recorder import load_dump

    dump = load_dump(CAPTURE / "flight_recorder" / "fr_rank2.pkl")
    dump["pg_config"] = {k: v for k, v in dump["pg_config"].items() if v.get("desc") == "MODEL_PARALLEL_GROUP"}
    (tmp_path / "_dump_2").write_bytes(pickle.dumps(dump))  # (named as nvidia-resiliency-ext names them)
    (tmp_path / "whole").mkdir()
    shutil.copy(CAPTURE / "flight_recorder" / "fr_rank2.pkl", tmp_path / "whole")
    problems: list[str] = []
    [named] = source_processes([], [tmp_path / "_dump_2"], problems)
    assert (named.rank, named.rank_source) == (2, "file-name")
    assert len(problems) == 1 and "read from the file name only" in problems[0]
    [whole] = source_processes([], [tmp_path / "whole" / "fr_rank2.pkl"], problems)
    assert (whole.rank, whole.rank_source) == (2, "flight-recorder") and len(problems) == 1
