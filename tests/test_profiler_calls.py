"""The calls a PyTorch-profiler trace records (``kineto.comm_calls.profiler_call_records``) on the
real H200 capture's traces: one row per call ProcessGroupNCCL made, each with its kernel, op and
count against the capture's own truth (``truth/truth_rank<r>.json``: every call in order, with
its loop iteration; the traces hold iterations 3-5). With the ``record_param_comms`` CPU ops
(kept by the reader as ``comm_records``) all 708 calls are right; without them (CPU activity
off: the ops stripped from a copy) the 96 batched Send/Recv kernels carry no op or size."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import msgspec
import pandas as pd
import pytest
from data_paths import CAPTURE

from nccltrace.inputs.kernel_sources import merge_sources
from nccltrace.kineto.comm_calls import profiler_call_records
from nccltrace.kineto.reader import KinetoTrace
from nccltrace.pytorch.collectives import RECORD_COLUMNS

RANKS = range(4)
WINDOW = (3, 4, 5)  # the profiled loop iterations
TRUTH_OPS = {"all_gather": "AllGather", "reduce_scatter": "ReduceScatter", "all_to_all": "AlltoAll",
             "all_reduce": "AllReduce", "send": "Send", "recv": "Recv"}  # fmt: skip


def _truth(r: int) -> tuple[int, list[tuple[str, int]]]:
    """(rank, [(NCCL op, count as NCCL's log prints it)] of the window's calls in order)."""
    t = json.loads((CAPTURE / "truth" / f"truth_rank{r}.json").read_text())
    calls = [c for c in t["calls"] if c["iter"] in WINDOW]
    # the log's AlltoAll count is per peer: the tensor's elements / group size
    return t["rank"], [(TRUTH_OPS[c["op"]], c["numel"] // len(c["ranks"]) if c["op"] == "all_to_all" else c["numel"])
                       for c in calls]  # fmt: skip


def _events(path: Path) -> tuple[dict[str, msgspec.Raw], list[msgspec.Raw]]:
    """A trace's top level and its events, each kept as its exact JSON text."""
    doc = msgspec.json.decode(
        gzip.decompress(path.read_bytes()), type=dict[str, msgspec.Raw]
    )
    return doc, msgspec.json.decode(doc["traceEvents"], type=list[msgspec.Raw])


def _write(path: Path, doc: dict[str, msgspec.Raw], events: list[msgspec.Raw]) -> Path:
    out = {
        **doc,
        "traceEvents": msgspec.Raw(b"[" + b",\n".join(bytes(e) for e in events) + b"]"),
    }
    path.write_bytes(gzip.compress(msgspec.json.encode(out)))
    return path


def _strip(src: Path, dest: Path, drop) -> Path:
    """A copy of trace ``src`` without the events ``drop(event as dict)`` selects."""
    doc, events = _events(src)
    return _write(dest, doc, [e for e in events if not drop(msgspec.json.decode(e))])


def _calls(trace: KinetoTrace, comm_records: pd.DataFrame | None = None):
    records = trace.comm_records() if comm_records is None else comm_records
    return profiler_call_records(
        trace.kernels(), records, trace.session_info(), trace.path.name
    )


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, dict[int, KinetoTrace]]:
    """Each rank's trace as captured and, beside it, with its record_param_comms ops stripped."""
    d = tmp_path_factory.mktemp("kineto")
    shutil.copytree(CAPTURE / "kineto", d / "kineto")
    out: dict[str, dict[int, KinetoTrace]] = {"full": {}, "stripped": {}}
    for r in RANKS:
        src = d / "kineto" / f"kineto_rank{r}.json.gz"
        out["full"][r] = KinetoTrace.open(src)
        bare = _strip(
            src,
            d / f"cpu_off_rank{r}.json.gz",
            lambda e: e.get("name") == "record_param_comms",
        )
        out["stripped"][r] = KinetoTrace.open(bare)
    return out


def test_the_reader_keeps_every_record_param_comms_with_its_arguments_and_exact_times(
    traces,
):
    events = (
        msgspec.json.decode(e)
        for e in _events(CAPTURE / "kineto" / "kineto_rank0.json.gz")[1]
    )
    raw = [e for e in events if e.get("name") == "record_param_comms"]
    t = traces["full"][0]
    c = t.comm_records()
    assert len(c) == len(raw) == 201  # 177 calls + 24 wait
    assert c["coll_name"].value_counts().to_dict() == {"_allgather_base": 48, "_reduce_scatter_base": 48,
                                                       "all_to_allv": 48, "wait": 24, "send": 12, "recv": 12,
                                                       "allreduce": 9}  # fmt: skip
    assert (
        c["start"].is_monotonic_increasing
        and c["pid"].eq(498).all()
        and c["tid"].eq(498).all()
    )
    by_id = {e["args"]["External id"]: e for e in raw}
    send = c[c["coll_name"] == "send"].iloc[0]
    e = by_id[send["external_id"]]
    assert int(send["start"]) == round(e["ts"] * 1000) and int(
        send["end"] - send["start"]
    ) == round(e["dur"] * 1000)
    # rank 0 sends to global rank 2, rank 1 of the group [0, 2]: 'Rank' is the peer's group rank
    assert (
        send["dst_rank"],
        send["coll_rank"],
        send["pg_ranks"],
        send["coll_in_nelems"],
    ) == (2, 1, "[0, 2]", 1048576)
    assert t.comm_records().equals(c) and traces["stripped"][0].comm_records().empty


def test_export_tables_write_comm_records_and_the_kernels_external_id(traces, tmp_path):
    t = traces["full"][1]
    paths = t.export_tables(tmp_path / "t")
    assert paths["comm_records"].name == "comm_records.parquet"
    pd.testing.assert_frame_equal(
        pd.read_parquet(paths["comm_records"]), t.comm_records(), check_dtype=False
    )
    kernels = pd.read_parquet(paths["kernels"])
    assert (
        kernels["external_id"].notna().sum() == 153
    )  # the 24 batched Send/Recv kernels carry none
    # a merge with a source that writes no comm_records (an nsys export's tables) keeps the trace's
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "t", other)
    (other / "comm_records.parquet").unlink()
    merged = merge_sources([tmp_path / "t", other], tmp_path / "node", "vm")
    assert len(pd.read_parquet(merged["comm_records"])) == len(t.comm_records()) == 201


def test_every_call_of_every_rank_with_its_kernel_op_and_count_against_the_truth(
    traces,
):
    total, right = 0, 0
    for r in RANKS:
        rank, truth = _truth(r)
        rows, messages = _calls(traces["full"][r])
        assert list(rows.columns) == list(RECORD_COLUMNS) and messages == []
        assert {c: str(rows[c].dtype) for c in rows} == {c: k if k != "object" else "object"
                                                         for c, k in RECORD_COLUMNS.items()}  # fmt: skip
        assert len(rows) == 177 and rows["record"].tolist() == list(range(177))
        assert (
            rows["kernel_correlation_id"].notna().all() and rows["rank"].eq(rank).all()
        )
        right += sum(
            got == want
            for got, want in zip(zip(rows["op"], rows["count"]), truth, strict=True)
        )
        total += len(rows)
        by_source = rows.groupby(["op_source", "size_source"]).size().to_dict()
        assert by_source == {
            ("kernel-record", "kernel-record"): 153,
            ("cpu-record", "cpu-record"): 24,
        }
        p2p = rows[rows["op"].isin(["Send", "Recv"])]
        assert (
            len(p2p) == 24
            and p2p["op_source"].eq("cpu-record").all()
            and p2p["nranks"].eq(2).all()
        )
        assert (
            p2p["root"].eq(1 if rank in (0, 1) else 0).all()
        )  # the peer's rank in its pipeline group
        assert (
            rows["comm_source"].eq("process-group").all()
            and rows["seq_source"].isna().all()
        )
        assert (
            rows["record_utc"].notna().all()
            and rows["datatype_name"].isin(["bfloat16", "float32"]).all()
        )
    assert (total, right) == (708, 708)


def test_each_row_links_to_its_kernel_by_external_id_and_batches_by_their_launch(
    traces,
):
    for r in RANKS:
        t = traces["full"][r]
        rows = _calls(t).records
        kernels = t.kernels().set_index("correlation_id")
        records = t.comm_records().set_index("start")
        rec = records.loc[rows["record_utc"] - t.utc_offset_ns]
        k = kernels.loc[rows["kernel_correlation_id"]]
        linked = k["external_id"].notna().to_numpy()
        assert (
            linked.sum() == 153
            and (
                k["external_id"].to_numpy()[linked]
                == rec["external_id"].to_numpy()[linked]
            ).all()
        )
        batch = k[~linked]
        assert (
            len(batch) == 24 and batch["short_name"].eq("ncclDevKernel_SendRecv").all()
        )
        assert (
            batch["coll_name"].isna().all()
            and (batch["launch_start"].to_numpy() > rec.index[~linked]).all()
        )
        assert rows[
            "kernel_correlation_id"
        ].is_unique  # one send or recv per batch in this job


def test_without_cpu_records_every_kernel_is_a_row_and_batched_p2p_has_no_op_or_size(
    traces,
):
    right = nulls = 0
    for r in RANKS:
        rank, truth = _truth(r)
        rows, messages = _calls(traces["stripped"][r])
        assert len(rows) == 177 and rows["rank"].eq(rank).all() and messages == []
        bare = rows["op"].isna()
        assert (
            bare.sum() == 24
            and rows.loc[bare, "count"].isna().all()
            and rows.loc[bare, "op_source"].isna().all()
        )
        assert (
            rows.loc[bare, "size_source"].isna().all()
            and rows["record_utc"].isna().all()
        )
        assert rows.loc[~bare, "op_source"].eq("kernel-record").all()
        right += sum(got == want for got, want, b in zip(zip(rows["op"], rows["count"]), truth, bare, strict=True)
                     if not b)  # fmt: skip
        nulls += int(bare.sum())
        # the same rows as with the CPU records, where the kernels' own arguments speak
        full = _calls(traces["full"][r]).records
        assert (
            rows["kernel_correlation_id"].tolist()
            == full["kernel_correlation_id"].tolist()
        )
    assert (right, nulls) == (612, 96)


def test_a_record_whose_kernel_is_missing_or_a_trace_cut_short_keeps_the_row_without_a_kernel(
    traces, tmp_path
):
    src = CAPTURE / "kineto" / "kineto_rank0.json.gz"
    gone = int(
        traces["full"][0]
        .kernels()
        .dropna(subset=["external_id"])["external_id"]
        .iloc[10]
    )
    lost = KinetoTrace.open(
        _strip(
            src,
            tmp_path / "lost.json.gz",
            lambda e: e.get("cat") == "kernel" and e["args"].get("External id") == gone,
        )
    )
    rows, messages = _calls(lost)
    assert len(rows) == 177 and rows["kernel_correlation_id"].isna().sum() == 1
    row = rows[rows["kernel_correlation_id"].isna()].iloc[0]
    assert (
        row["op_source"] == row["size_source"] == "cpu-record"
        and row["count"] == _truth(0)[1][row["record"]][1]
    )
    assert (
        len(messages) == 1 and "1 of 177 call record(s) have no kernel" in messages[0]
    )
    # cut short: the trace keeps its complete events; every call record is still a row
    text = gzip.decompress(src.read_bytes())
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(text[: int(len(text) * 0.7)]))
    t = KinetoTrace.open(cut)
    rows, messages = _calls(t)
    calls = int(t.comm_records()["coll_name"].ne("wait").sum())
    assert t.truncated and 0 < calls and 0 < len(t.kernels()) < 177
    assert (
        rows["record_utc"].notna().sum() == calls
        and rows["kernel_correlation_id"].isna().any()
    )
    assert any("have no kernel in the trace" in m for m in messages)


def test_kernel_and_cpu_record_disagreeing_keep_the_kernels_and_say_so(traces):
    t = traces["full"][2]
    records = t.comm_records()
    first = records.index[records["coll_name"] == "_allgather_base"][0]
    records.loc[first, "coll_in_nelems"] = 7
    row = (
        _calls(t)
        .records["record_utc"]
        .eq(records.loc[first, "start"] + t.utc_offset_ns)
        .idxmax()
    )
    rows, messages = _calls(t, records)
    want = (
        f"kineto_rank2.json.gz: External id {records.loc[first, 'external_id']}: the kernel "
        f"(correlation {rows.loc[row, 'kernel_correlation_id']}) says AllGather count 1048576, its "
        "CPU record AllGather count 7: the kernel's kept"
    )
    assert messages == [want]
    assert (
        rows.loc[row, "count"] == 1048576
        and rows.loc[row, "size_source"] == "kernel-record"
    )
