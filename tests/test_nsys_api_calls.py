"""The NCCL API calls of an nsys export as call records (nsys.api_calls), without NCCL logs: the
three real nsys 2026 exports of tests/data/real/nsys_sqlite (README.md there; figures in
docs/evidence-sources.md, 1.3 and 4.4), read from the export and from its parsed tables, and one
synthetic export with decoded NCCL payloads written with the project's nsys writer."""

from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import pytest
from data_paths import NSYS_SQLITE

from nccltrace.nsys.api_calls import (
    BEFORE_WINDOW,
    EXTRA_COLUMNS,
    UNCLAIMED_KERNEL_COLUMNS,
    api_call_records,
    export_call_records,
    staged_call_records,
)
from nccltrace.nsys.reader import NsysExport, NsysSchemaWarning
from nccltrace.nsys.writer import NsysExportWriter
from nccltrace.pytorch.collectives import RECORD_COLUMNS

BEFORE = NSYS_SQLITE / "nsysai_mfu_2gpu_before.sqlite"
AFTER = NSYS_SQLITE / "nsysai_mfu_2gpu_after.sqlite"
H100 = NSYS_SQLITE / "nsysai_h100_2gpu_1s.sqlite"
REMEDY = "nsys export --type sqlite --include-blobs=true"
SPEC = {**RECORD_COLUMNS, **EXTRA_COLUMNS}


def _open(path: Path) -> NsysExport:
    assert path.is_file(), (
        f"real nsys export {path.name} missing (expected in {NSYS_SQLITE})"
    )
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", NsysSchemaWarning
        )  # schema 3.25.0 is feature-detected
        return NsysExport.open(path)


@pytest.fixture(
    scope="module", params=[BEFORE, AFTER, H100], ids=["before", "after", "h100"]
)
def real(request):
    """(the export, records from it, the linker's result, the export's NCCL kernels)."""
    with _open(request.param) as x:
        nvtx, kernels = x.nvtx(), x.kernels()
        yield (
            request.param,
            export_call_records(x),
            x.nccl_api_calls(nvtx=nvtx, kernels=kernels),
            kernels,
        )


def _kernel_keys(rec: pd.DataFrame) -> pd.DataFrame:
    """Distinct linked kernels: correlation ids are per process (the "after" export reuses 5
    across its two processes), so a kernel is (pid, correlation id)."""
    linked = rec[rec.kernel_correlation_id.notna()]
    return linked[["pid", "kernel_correlation_id"]].drop_duplicates()


def _check_common(got, api) -> None:
    rec = got.records
    assert (
        list(rec.columns) == list(SPEC)
        and {c: str(t) for c, t in rec.dtypes.items()} == SPEC
    )
    assert list(got.unclaimed_kernels.columns) == list(UNCLAIMED_KERNEL_COLUMNS)
    assert set(rec.op) == {"Send", "Recv"} and (rec.op_source == "nvtx-range").all()
    # what nsys does not record without payloads stays null, each with its provenance null
    for col in ("count", "datatype_name", "bytes", "size_source", "comm_id", "comm_source", "rank", "root", "nranks",
                "pg_name", "pg_ranks", "pg_seq"):  # fmt: skip
        assert rec[col].isna().all(), col
    assert (rec.host == "modal").all() and rec.record_utc.notna().all()
    # record: 0-based call order per process
    for _, g in rec.groupby("pid"):
        assert (
            g.record.tolist() == list(range(len(g))) and g.start.is_monotonic_increasing
        )
    # PyTorch's own range around every group names its collective: one name per group
    assert (rec.torch_op == "all_to_all").all()
    assert rec.groupby(["pid", "group_id"]).torch_op.nunique().eq(1).all()
    # calls of one group share their kernel: 2 Send + 2 Recv per kernel
    per_group = rec.groupby(["pid", "group_id"]).kernel_correlation_id.nunique(
        dropna=False
    )
    assert per_group.eq(1).all()
    linked = rec[rec.kernel_correlation_id.notna()]
    four = linked.groupby(["pid", "kernel_correlation_id"]).op.agg(
        lambda s: sorted(s.tolist())
    )
    assert all(ops == ["Recv", "Recv", "Send", "Send"] for ops in four)
    # the kernels launched before the window: their correlation ids, said once
    un = got.unclaimed_kernels
    assert (
        len(un) == api.kernels_outside_launch_ranges == 2
        and (un.reason == BEFORE_WINDOW).all()
    )
    said = [m for m in got.messages if "kernels launched before the export's window: their API ranges are not in it"
            in m]  # fmt: skip
    assert len(said) == 1 and said[0].split(": ", 1)[1].startswith(
        "2 kernels launched before the export's window"
    )
    assert all(str(i) in said[0] for i in un.correlation_id)
    # the re-export remedy: named exactly once, the linker's own text (not restated)
    remedies = [m for m in got.messages if REMEDY in m]
    assert len(remedies) == 1 and api.payload_warning in remedies[0]
    assert sum(m.count("--include-blobs=true") for m in got.messages) == 1
    assert got.payload == "missing"
    assert sum("no rank" in m for m in got.messages) == 1


def test_real_exports_give_one_row_per_call_range_with_its_kernel(real):
    path, got, api, kernels = real
    rec = got.records
    assert (rec.file == path.name).all()
    if path == BEFORE:
        assert len(rec) == 264 and rec.status.value_counts().to_dict() == {
            "matched": 256,
            "kernel_missing": 8,
        }
        assert (
            rec.kernel_correlation_id.notna().sum() == 256
            and len(_kernel_keys(rec)) == 64
        )
        missing = rec[rec.status == "kernel_missing"]
        assert (
            missing.kernel_correlation_id.isna().all()
            and missing.groupby(["pid", "group_id"]).ngroups == 2
        )
        assert rec.groupby(["pid", "group_id"]).ngroups == 66
        assert any(
            "8 NCCL call(s) in 2 group(s) with status 'kernel_missing'" in m
            for m in got.messages
        )
        _check_common(got, api)
    elif path == AFTER:
        assert (
            len(rec) == 240
            and (rec.status == "matched").all()
            and rec.kernel_correlation_id.notna().all()
        )
        assert (
            len(_kernel_keys(rec)) == 60 and rec.kernel_correlation_id.nunique() == 55
        )  # ids per process
        assert rec.groupby(["pid", "group_id"]).ngroups == 60
        _check_common(got, api)
    else:  # the negative control: no NCCL range or kernel, not an error
        assert len(rec) == 0 and len(kernels) == 0
        assert (
            list(rec.columns) == list(SPEC)
            and {c: str(t) for c, t in rec.dtypes.items()} == SPEC
        )
        assert len(got.unclaimed_kernels) == 0 and got.payload == "no_ranges"
        assert got.messages == [(f"{H100.name}: no NCCL call or kernel in the export's window (2 process(es) "
                                "recorded): no call rows from this export")]  # fmt: skip
    # the kernels the records claim are the linker's, on the export's kernel rows
    keys = set(zip(rec.kernel_global_pid.dropna(), rec.kernel_correlation_id.dropna()))
    assert keys <= set(zip(kernels.global_pid, kernels.correlation_id))
    assert len(keys) + len(got.unclaimed_kernels) == len(kernels)


def test_the_parsed_tables_give_the_same_records(real, tmp_path):
    path, got, _, _ = real
    with _open(path) as x, warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # the negative control's empty kernels.parquet is warned about
        x.export_tables(tmp_path)
    staged = staged_call_records(tmp_path)
    pd.testing.assert_frame_equal(staged.records, got.records)
    pd.testing.assert_frame_equal(staged.unclaimed_kernels, got.unclaimed_kernels)
    assert staged.messages == got.messages and staged.payload == got.payload


def test_a_bare_calls_table_still_gives_rows_and_says_what_it_cannot_know():
    with _open(BEFORE) as x:
        api = x.nccl_api_calls()
    got = api_call_records(api.calls)  # no NVTX, no kernels, no session
    assert (
        len(got.records) == 264
        and got.records.torch_op.isna().all()
        and got.records.file.isna().all()
    )
    assert len(got.unclaimed_kernels) == 0 and got.payload is None
    assert any("payload state unknown" in m for m in got.messages)
    records, messages = api_call_records(
        api, session={"source_file": "x.sqlite"}
    )  # unpacks; summary from api
    assert len(records) == 264 and sum(REMEDY in m for m in messages) == 1
    assert any("2 kernels launched outside every NCCL API range" in m for m in messages)
    assert all(m.startswith("x.sqlite: ") for m in messages)


# --------------------------------------------------------------------------- synthetic, with payloads


def _decoded_export(path: Path) -> Path:
    """One process: PyTorch's all_reduce range around an ungrouped AllReduce, PyTorch's
    batch marker around a group of Send/Recv (payloads with communicator, size and peer), a
    kernel launched outside every NCCL range, and a look-alike range of another domain."""
    a, b = 0xA000_0000_0000_0001, 0xB000_0000_0000_0002
    ranges = [
        ("nccl:all_reduce, op_id = 7, sizes = [[1024]]", 900, 1_200, 0, None),
        ("ncclAllReduce", 1_000, 1_100, 2,
         {"NCCL communicator ID": a, "Message size [bytes]": 4096, "Reduction operation": "sum"}),
        ("nccl:coalesced", 1_900, 2_500, 0, None),
        ("nccl:send 0->1, op_id = 8", 1_950, 2_450, 0, None),
        ("ncclGroupStart", 2_000, 2_010, 2, None),
        ("ncclSend", 2_020, 2_030, 2, {"NCCL communicator ID": b, "Message size [bytes]": 64, "Peer rank": 1}),
        ("ncclRecv", 2_040, 2_050, 2, {"NCCL communicator ID": b, "Message size [bytes]": 64, "Peer rank": 1}),
        ("ncclGroupEnd", 2_060, 2_300, 2, None),
        ("ncclAllGather", 3_000, 3_100, 2, {"NCCL communicator ID": a, "Message size [bytes]": 128}),
        ("ncclAllReduce", 4_000, 4_100, 1, None),  # another library's domain: not NCCL's
    ]  # fmt: skip
    kernels, runtime = [], []
    for corr, at in enumerate((1_020, 2_100, 3_020, 5_000, 4_020), start=1):
        runtime.append({"start": at, "end": at + 10, "pid": 100, "tid": 100, "correlation_id": corr,
                        "name": "cuLaunchKernelEx", "event_class": 1, "return_value": 0})  # fmt: skip
        kernels.append({"start": at + 5_000, "end": at + 9_000, "device_id": 0, "context_id": 1, "stream_id": 7,
                        "correlation_id": corr, "pid": 100, "name": "ncclDevKernel_Generic(int)",
                        "short_name": "ncclDevKernel_Generic", "grid_x": 1, "grid_y": 1, "grid_z": 1, "block_x": 64,
                        "block_y": 1, "block_z": 1, "registers_per_thread": 32, "static_shared_memory": 0,
                        "dynamic_shared_memory": 0})  # fmt: skip
    with NsysExportWriter(
        path, "3.28.1", hostname="node0", session_start_utc_ns=10**18
    ) as w:
        w.add_process(100, "python")
        other = w.add_nvtx_domain(100, 100, "MyLib", start=1)
        nccl = w.add_nvtx_domain(100, 100, "NCCL", start=2)
        w.add_nccl_payload_schemas(100, nccl, (2, 27, 3))
        w.add_thread(100, 100)
        w.add_nvtx_ranges(pd.DataFrame([
            {"start": s, "end": e, "pid": 100, "tid": 100, "text": t, "registered": True,
             "domain_id": {0: 0, 1: other, 2: nccl}[d], "nccl_payload": p} for t, s, e, d, p in ranges]))  # fmt: skip
        w.add_kernels(pd.DataFrame(kernels))
        w.add_runtime(pd.DataFrame(runtime))
    return path


def test_decoded_payloads_give_size_peer_and_communicator_with_their_sources(tmp_path):
    with NsysExport.open(_decoded_export(tmp_path / "decoded.sqlite")) as x:
        got = export_call_records(x)
    rec = got.records
    assert rec.op.tolist() == [
        "AllReduce",
        "Send",
        "Recv",
        "AllGather",
    ] and rec.record.tolist() == [0, 1, 2, 3]
    assert (
        rec["bytes"].tolist() == [4096, 64, 64, 128]
        and (rec.size_source == "nvtx-payload").all()
    )
    assert rec.comm_id.tolist() == [0xA000_0000_0000_0001, 0xB000_0000_0000_0002, 0xB000_0000_0000_0002,
                                    0xA000_0000_0000_0001]  # fmt: skip
    assert (rec.comm_source == "nvtx-comm-id").all() and str(
        rec.comm_id.dtype
    ) == "UInt64"
    assert rec.root.tolist() == [
        0,
        1,
        1,
        0,
    ]  # the log's convention: the peer for Send/Recv, 0 for AllReduce
    assert (
        rec["count"].isna().all() and rec.datatype_name.isna().all()
    )  # NCCL's payloads carry bytes only
    # the innermost PyTorch range that names a collective: "send" inside the batch marker; none around AllGather
    assert rec.torch_op.tolist()[:3] == ["all_reduce", "send", "send"] and pd.isna(
        rec.torch_op[3]
    )
    assert (
        rec.kernel_correlation_id.tolist() == [1, 2, 2, 3]
        and (rec.host == "node0").all()
    )
    assert got.payload == "decoded" and not any(
        "--include-blobs" in m or "no size" in m for m in got.messages
    )
    # kernel 4 was launched outside every range, kernel 5 inside another library's range: claimed by none
    un = got.unclaimed_kernels
    assert (
        sorted(un.correlation_id) == [4, 5] and not (un.reason == BEFORE_WINDOW).any()
    )
    assert any(m.endswith("2 kernel(s) launched inside the window but claimed by no call (several kernels or "
                          "communicators in one launch range, or launched outside every NCCL API range)")
               for m in got.messages)  # fmt: skip
