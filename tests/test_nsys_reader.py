"""Tests for nccltrace.nsys.reader: the real nsys 2022.4.2.1 sample export, malformed inputs,
signed globalTid decoding, batched kernel iteration and table export."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import warnings
from pathlib import Path

import pandas as pd
import pytest
from data_paths import NSYS_REFERENCE
from hypothesis import given
from hypothesis import strategies as st

from nccltrace.nsys.reader import (
    NsysExport,
    NsysFormatError,
    NsysSchemaWarning,
    decode_pid,
    decode_tid,
)
from nccltrace.nsys.schema import KERNEL_COLUMNS, KERNEL_TABLE_COLUMNS
from nccltrace.nsys.writer import NsysExportWriter, encode_global_tid

REF = NSYS_REFERENCE
SAMPLE = REF / "nsys-2022.4.2.1-nvtx-sample.sqlite"
UTC0 = 1795255331185646164
NCCL_KERNEL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


@pytest.fixture(scope="module")
def sample() -> NsysExport:
    assert SAMPLE.is_file(), f"reference sample export missing (expected in tests/data/reference/nsys): {SAMPLE}"
    with NsysExport.open(SAMPLE) as x:
        yield x


def _kernel_frame(n: int, pid: int, start0: int = 0) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "start": [start0 + 1000 * i for i in range(n)],
            "end": [start0 + 1000 * i + 500 for i in range(n)],
            "device_id": 0, "context_id": 1, "stream_id": 7,
            "correlation_id": list(range(1, n + 1)),
            "pid": pid,
            "name": [NCCL_KERNEL if i % 2 == 0 else "sgemm_kernel(float*)" for i in range(n)],
            "short_name": ["ncclDevKernel_AllReduce_Sum_f32_RING_LL" if i % 2 == 0 else "sgemm_kernel" for i in range(n)],
            "grid_x": 1, "grid_y": 1, "grid_z": 1, "block_x": 256, "block_y": 1, "block_z": 1,
            "registers_per_thread": 32, "static_shared_memory": 0, "dynamic_shared_memory": 0,
        }
    )  # fmt: skip


def _runtime_frame(n: int, pid: int, tid: int, start0: int = 0) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "start": [start0 + 1000 * i - 100 for i in range(n)],
            "end": [start0 + 1000 * i - 50 for i in range(n)],
            "pid": pid, "tid": tid, "correlation_id": list(range(1, n + 1)),
            "name": "cudaLaunchKernel_v7000", "event_class": 0, "return_value": 0,
        }
    )  # fmt: skip


def _small_export(path: Path, n: int = 2000, **kw) -> Path:
    with NsysExportWriter(path, "3.0.0", hostname="h", session_start_utc_ns=UTC0, **kw) as w:
        w.add_process(77, "python")
        w.add_kernels(_kernel_frame(n, 77, start0=10_000))
        w.add_runtime(_runtime_frame(n, 77, 78, start0=10_000))
    return path


# --------------------------------------------------------------------------- real sample


def test_sample_versions_host_and_session_anchor(sample: NsysExport) -> None:
    assert sample.schema_version == "3.0.0"
    assert sample.product_version == "2022.4.2.1"
    assert sample.hostname == "sample-host"
    assert sample.session_start_utc_ns == UTC0
    assert sample.time_normalized is False and sample.utc_offset_ns == UTC0


def test_sample_registered_nccl_range_with_uint64_payload_and_category(sample: NsysExport) -> None:
    nccl = sample.nvtx(domain="NCCL")
    row = nccl[nccl["text"] == "ncclAllReduce"].iloc[0]
    assert row["event_type"] == 59 and row["domain"] == "NCCL" and row["domain_id"] == 1
    assert row["uint64_value"] == 1048576
    assert row["category"] == 7 and row["category_name"] == "MyNcclCategory"
    assert row["color"] == 0xFF00FF00
    assert (row["pid"], row["tid"]) == (11250, 11250)


def test_sample_ascii_range_with_double_payload(sample: NsysExport) -> None:
    nccl = sample.nvtx(domain="NCCL")
    row = nccl[nccl["text"] == "ncclGroupEnd"].iloc[0]
    assert row["double_value"] == 3.5 and pd.isna(row["uint64_value"]) and pd.isna(row["category"])
    assert nccl["text"].tolist() == ["ncclAllReduce", "ncclGroupEnd"]


def test_sample_default_domain_range(sample: NsysExport) -> None:
    n = sample.nvtx()
    row = n[n["text"] == "train_step"].iloc[0]
    assert row["domain_id"] == 0 and row["domain"] is None and row["end"] == 35701639


def test_sample_start_end_range_ended_on_other_thread(sample: NsysExport) -> None:
    n = sample.nvtx()
    row = n[n["text"] == "cross_thread_startend"].iloc[0]
    assert row["event_type"] == 60 and row["range_id"] == 1
    assert row["end_global_tid"] != row["global_tid"]
    assert decode_tid(int(row["end_global_tid"])) == 11263 and row["tid"] == 11250


def test_sample_nvtx_defaults_to_marks_and_ranges_only(sample: NsysExport) -> None:
    assert set(sample.nvtx()["event_type"]) == {34, 59, 60}
    assert len(sample.nvtx(event_types=None)) == 11
    assert sample.nvtx()["start"].is_monotonic_increasing


def test_sample_has_no_kernels_but_typed_empty_frame(sample: NsysExport) -> None:
    k = sample.kernels()
    assert k.empty
    assert [(c, str(t)) for c, t in k.dtypes.items()] == [(c, kind) for c, kind in KERNEL_COLUMNS]
    assert list(sample.iter_kernels()) == []
    assert "CUPTI_ACTIVITY_KIND_KERNEL" not in sample.table_names()


def test_sample_processes_threads_and_enum_typo(sample: NsysExport) -> None:
    assert sample.processes()[["pid", "name"]].values.tolist() == [[11250, "./t"]]
    assert "t" in sample.threads()["name"].tolist()
    # 3.0.0 spells ENUM_CUDA_KRENEL_LAUNCH_TYPE; the corrected name must still resolve.
    assert sample.enum_table("ENUM_CUDA_KERNEL_LAUNCH_TYPE")["label"].tolist()[1] == "Regular"


def test_export_tables_writes_parquet_and_session_json(sample: NsysExport, tmp_path: Path) -> None:
    paths = sample.export_tables(tmp_path / "out")
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"kernels.parquet", "nvtx.parquet", "processes.parquet",
                                                          "launches_without_kernel.parquet", "nccl_api_calls.parquet",
                                                          "session.json"}
    session = json.loads(paths["session"].read_text())
    assert session["source_sha256"] == hashlib.sha256(SAMPLE.read_bytes()).hexdigest()
    assert (session["schema_version"], session["hostname"], session["session_start_utc_ns"]) == ("3.0.0", "sample-host", UTC0)
    assert session["time_normalized"] is False
    nvtx = pd.read_parquet(paths["nvtx"])
    assert "ncclAllReduce" in nvtx["text"].tolist()
    assert pd.read_parquet(paths["kernels"]).columns.tolist() == [c for c, _ in KERNEL_TABLE_COLUMNS]


# --------------------------------------------------------------------------- bad inputs


def _assert_format_error(path: Path, reason: str) -> None:
    with pytest.raises(NsysFormatError) as info:
        NsysExport.open(path)
    msg = str(info.value)
    assert path.name in msg and reason in msg, msg


def test_missing_file(tmp_path: Path) -> None:
    _assert_format_error(tmp_path / "nope.sqlite", "does not exist")


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.sqlite"
    p.touch()
    _assert_format_error(p, "empty")


def test_truncated_sqlite(tmp_path: Path) -> None:
    full = _small_export(tmp_path / "full.sqlite")
    data = full.read_bytes()
    cut = tmp_path / "cut.sqlite"
    cut.write_bytes(data[: len(data) // 2])
    _assert_format_error(cut, "truncated")


def test_text_file_renamed_sqlite(tmp_path: Path) -> None:
    p = tmp_path / "report.sqlite"
    p.write_text("** CUDA GPU Kernel Summary (cuda_gpu_kern_sum):\n Time (%) ...\n")
    _assert_format_error(p, "not an SQLite database")


def test_sqlite_without_metadata_table(tmp_path: Path) -> None:
    p = tmp_path / "other.sqlite"
    with sqlite3.connect(p) as conn:
        conn.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    _assert_format_error(p, "not an nsys export")


def _fake_export(path: Path, version: str, with_strings: bool = True) -> Path:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT)")
        conn.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_SCHEMA_VERSION', ?)", (version,))
        if with_strings:
            conn.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    conn.close()
    return path


def test_unknown_schema_major(tmp_path: Path) -> None:
    _assert_format_error(_fake_export(tmp_path / "future.sqlite", "4.0.0"), "major version 4")


def test_missing_string_ids(tmp_path: Path) -> None:
    _assert_format_error(_fake_export(tmp_path / "nostrings.sqlite", "3.0.0", with_strings=False), "StringIds")


def test_unknown_minor_version_warns_and_reads(tmp_path: Path) -> None:
    p = _fake_export(tmp_path / "minor.sqlite", "3.99.0")
    with pytest.warns(NsysSchemaWarning, match="3.99.0"):
        x = NsysExport.open(p)
    assert x.kernels().empty and x.nvtx().empty and x.processes().empty


def test_known_versions_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NsysExport.open(SAMPLE).close()


def test_corrupt_page_is_reported_as_format_error(tmp_path: Path) -> None:
    # Same size as before (header check passes) but a data page overwritten with garbage.
    p = _small_export(tmp_path / "corrupt.sqlite")
    data = bytearray(p.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page * 2 : page * 6] = b"\xff" * (page * 4)
    p.write_bytes(bytes(data))
    with pytest.raises(NsysFormatError) as info:
        x = NsysExport.open(p, integrity_check=True)
        x.kernels(None)
    assert p.name in str(info.value)


# --------------------------------------------------------------------------- ids, joins, batches


@pytest.mark.parametrize("hw_id", [0x80, 0xFE])
def test_negative_hw_byte_decodes_pid_and_tid(tmp_path: Path, hw_id: int) -> None:
    path = tmp_path / "neg.sqlite"
    with NsysExportWriter(path, "3.16.1", hostname="h", session_start_utc_ns=UTC0, hw_id=hw_id, vm_id=3) as w:
        gpid = w.add_process(0xABCDE, "python")
        w.add_thread(0xABCDE, 0xFFFFFE, "main")
        w.add_kernels(_kernel_frame(2, 0xABCDE))
        w.add_runtime(_runtime_frame(2, 0xABCDE, 0xFFFFFE))
        w.add_nvtx_ranges(pd.DataFrame({"start": [1], "end": [2], "pid": [0xABCDE], "tid": [0xFFFFFE], "text": ["r"]}))
    assert gpid < 0, "HW byte >= 0x80 must give a negative stored globalPid"
    x = NsysExport.open(path)
    k = x.kernels(None)
    assert k["pid"].tolist() == [0xABCDE] * 2 and k["launch_tid"].tolist() == [0xFFFFFE] * 2
    n = x.nvtx()
    assert (n["pid"].iloc[0], n["tid"].iloc[0]) == (0xABCDE, 0xFFFFFE)
    assert x.threads()[["pid", "tid"]].values.tolist() == [[0xABCDE, 0xFFFFFE]]
    assert x.processes()["pid"].tolist() == [0xABCDE]
    stored, naive_pid = sqlite3.connect(path).execute("SELECT globalTid, globalTid / 0x1000000 % 0x1000000 FROM NVTX_EVENTS").fetchone()
    assert stored < 0 and naive_pid != 0xABCDE  # SQLite's truncating '/ %' form is wrong here


@given(
    hw=st.integers(0, 255), vm=st.integers(0, 255),
    pid=st.integers(0, 0xFFFFFF), tid=st.integers(0, 0xFFFFFF),
)  # fmt: skip
def test_global_tid_encoding_round_trips(hw: int, vm: int, pid: int, tid: int) -> None:
    gtid = encode_global_tid(pid, tid, hw, vm)
    assert -(2**63) <= gtid < 2**63
    assert (decode_pid(gtid), decode_tid(gtid)) == (pid, tid)


def test_iter_kernels_batches_equal_kernels(tmp_path: Path) -> None:
    x = NsysExport.open(_small_export(tmp_path / "b.sqlite", n=2001))
    whole = x.kernels()
    batches = list(x.iter_kernels(batch_rows=300))
    assert len(whole) == 1001 and max(len(b) for b in batches) <= 300
    pd.testing.assert_frame_equal(pd.concat(batches, ignore_index=True), whole)
    assert whole["name"].str.startswith("ncclDevKernel").all()
    assert len(x.kernels(None)) == 2001


def test_duplicate_launch_rows_keep_one_row_per_kernel(tmp_path: Path) -> None:
    path = tmp_path / "dup.sqlite"
    with NsysExportWriter(path, "3.0.0", hostname="h", session_start_utc_ns=0) as w:
        w.add_kernels(_kernel_frame(3, 5))
        rt = _runtime_frame(3, 5, 6)
        w.add_runtime(pd.concat([rt, rt.assign(start=rt["start"] - 7, tid=9)], ignore_index=True))
    x = NsysExport.open(path)
    k = x.kernels(None)
    assert len(k) == 3 and k["launch_tid"].tolist() == [9, 9, 9]  # earliest launch wins
    assert pd.concat(list(x.iter_kernels(None, batch_rows=1)))["start"].tolist() == k["start"].tolist()


def test_kernels_without_runtime_table_have_null_launch_columns(tmp_path: Path) -> None:
    path = tmp_path / "nort.sqlite"
    with NsysExportWriter(path, "3.28.1", hostname="h", session_start_utc_ns=0) as w:
        w.add_kernels(_kernel_frame(2, 5).assign(green_context_id=[None, 4]))
    k = NsysExport.open(path).kernels(None)
    assert k["launch_tid"].isna().all() and k["launch_api"].isna().all()
    assert k["green_context_id"].isna().tolist() == [True, False] and k["green_context_id"].iloc[1] == 4


def test_rows_are_ordered_by_start_even_if_stored_unordered(tmp_path: Path) -> None:
    path = tmp_path / "order.sqlite"
    with NsysExportWriter(path, "3.0.0", hostname="h", session_start_utc_ns=0) as w:
        w.add_kernels(_kernel_frame(4, 5).iloc[::-1])
    assert NsysExport.open(path).kernels(None)["start"].is_monotonic_increasing


def test_reader_does_not_modify_the_file(tmp_path: Path) -> None:
    copy = tmp_path / SAMPLE.name
    shutil.copy(SAMPLE, copy)
    before = copy.read_bytes()
    with NsysExport.open(copy) as x:
        x.kernels()
        x.nvtx()
    assert copy.read_bytes() == before


def test_export_time_shift_is_removed_when_converting_to_utc(tmp_path: Path) -> None:
    import shutil
    import sqlite3

    shifted = tmp_path / "shifted.sqlite"
    shutil.copy(SAMPLE, shifted)
    shift = 5_000_000_000
    con = sqlite3.connect(shifted)
    con.execute("UPDATE NVTX_EVENTS SET start = start + ?, end = end + ?", (shift, shift))
    con.execute("INSERT INTO EXPORT_META_DATA (name, value) VALUES ('EXPORT_PARAM_TIME_SHIFT', ?)", (str(shift),))
    con.commit()
    con.close()
    with NsysExport.open(SAMPLE) as ref, NsysExport.open(shifted) as x:
        a = ref.nvtx()
        b = x.nvtx()
        assert x.time_shift_ns == shift
        assert list(a.start + ref.utc_offset_ns) == list(b.start + x.utc_offset_ns)
