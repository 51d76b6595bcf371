"""Tests for nccltrace.nsys.writer: DDL fidelity against the real 2022.4 export, derived-schema
column lists against the reference documentation, lazy/atomic output, and full round trips
through the reader for every schema version and NCCL payload mode."""

from __future__ import annotations

import re
import sqlite3
import struct
from pathlib import Path

import pandas as pd
import pytest
from data_paths import NSYS_REFERENCE

from nccltrace.nsys.reader import NsysExport
from nccltrace.nsys.writer import NsysExportWriter, load_ddl, nccl_payload_schemas

REF = NSYS_REFERENCE
REAL_DDL = REF / "nsys-2022.4.2.1-schema-3.0.0.sql"
SCHEMA_DOC = REF / "sqlite-schema.md"
UTC0 = 1795255331185646164
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
SENDRECV = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
COMM = 0xF1E2D3C4B5A69788  # > 2**63: exercises unsigned handling


@pytest.fixture(scope="module", autouse=True)
def _reference_files_present() -> None:
    missing = [p for p in (REAL_DDL, SCHEMA_DOC) if not p.is_file()]
    assert not missing, f"reference files missing (expected in tests/data/reference/nsys): {missing}"


def _real_creates() -> dict[str, str]:
    text = REAL_DDL.read_text(encoding="utf-8")
    return {m.group(1): m.group(0)[:-1] for m in re.finditer(r"^CREATE TABLE (\w+) \(.*?^\);", text, re.S | re.M)}


def _table_info(conn: sqlite3.Connection, table: str) -> list[tuple[str, str, bool, bool]]:
    return [(r[1], r[2], bool(r[3]), bool(r[5])) for r in conn.execute(f'PRAGMA table_info("{table}")')]


def _real_table_info(table: str) -> list[tuple[str, str, bool, bool]]:
    conn = sqlite3.connect(":memory:")
    conn.execute(_real_creates()[table])
    return _table_info(conn, table)


# --------------------------------------------------------------------------- fixtures


def _kernels() -> pd.DataFrame:
    # Two processes reuse correlationId 7: the reader must join on the process bits too.
    return pd.DataFrame(
        {
            "start": [1_000, 2_000, 3_000],
            "end": [1_500, 2_600, 3_900],
            "device_id": [0, 1, 0],
            "context_id": [1, 1, 1],
            "stream_id": [13, 14, 13],
            "correlation_id": [7, 7, 9],
            "pid": [4242, 4343, 4242],
            "name": [ALLREDUCE, ALLREDUCE, SENDRECV],
            "short_name": ["ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ncclDevKernel_SendRecv"],
            "grid_x": [2, 2, 4],
            "grid_y": [1, 1, 1],
            "grid_z": [1, 1, 1],
            "block_x": [640, 640, 512],
            "block_y": [1, 1, 1],
            "block_z": [1, 1, 1],
            "registers_per_thread": [96, 96, 80],
            "static_shared_memory": [0, 0, 16],
            "dynamic_shared_memory": [9216, 9216, 0],
        }
    )


def _runtime(api: str, event_class: int) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "start": [900, 1_900, 2_800, 2_950],
            "end": [950, 1_950, 2_900, 2_990],
            "pid": [4242, 4343, 4242, 4242],
            "tid": [4250, 4351, 4251, 4250],
            "correlation_id": [7, 7, 9, 10],
            "name": [api, api, api, "cudaStreamSynchronize_v3020"],
            "event_class": [event_class, event_class, event_class, 0],
            "return_value": [0, 0, 0, 0],
        }
    )


def _payloads() -> list[dict | None]:
    return [
        {"NCCL communicator ID": COMM, "Message size [bytes]": 4096, "Reduction operation": "Sum"},
        {"NCCL communicator ID": COMM, "Message size [bytes]": 8192, "Reduction operation": 2},
        {"NCCL communicator ID": COMM + 1, "Message size [bytes]": 64, "Peer rank": 3},
        None,
    ]


def _write(path: Path, version: str, mode: str, **kw) -> dict[str, int]:
    api, cls = ("cudaLaunchKernel_v7000", 0) if version == "3.0.0" else ("cuLaunchKernelEx", 1)
    with NsysExportWriter(path, version, hostname="node-a", session_start_utc_ns=UTC0, payload_mode=mode, **kw) as w:
        ids = {"gp1": w.add_process(4242, "python"), "gp2": w.add_process(4343, "python")}
        ids["gt_main"] = w.add_thread(4242, 4250, "pt_main_thread")
        w.add_thread(4242, 4251, "pt_autograd_0")
        w.add_thread(4343, 4351, "pt_main_thread")
        w.add_gpu(0, name="NVIDIA H100 80GB HBM3", bus_location="0000:18:00.0", uuid="GPU-1111", pid=4242, cuda_id=0)
        w.add_gpu(1, name="NVIDIA H100 80GB HBM3", bus_location="0000:2a:00.0", uuid="GPU-2222", pid=4343, cuda_id=0)
        w.add_kernels(_kernels())
        w.add_runtime(_runtime(api, cls))
        d1 = w.add_nvtx_domain(4242, 4250, "NCCL", 100)
        d2 = w.add_nvtx_domain(4343, 4351, "NCCL", 110)
        w.add_nccl_payload_schemas(4242, d1, (2, 27, 3))
        w.add_nccl_payload_schemas(4343, d2, (2, 27, 3))
        w.add_nvtx_ranges(
            pd.DataFrame(
                {
                    "start": [800, 1_800, 2_700, 50],
                    "end": [1_000, 2_000, 2_950, 5_000],
                    "pid": [4242, 4343, 4242, 4242],
                    "tid": [4250, 4351, 4251, 4250],
                    "end_tid": [4250, 4351, 4251, 4251],
                    "text": ["ncclAllReduce", "ncclAllReduce", "ncclSend", "train_step"],
                    "registered": [True, True, True, False],
                    "domain_id": [d1, d2, d1, 0],
                    "category": [None, None, None, 3],
                    "color": [None, None, None, 0xFF00FF00],
                    "event_type": [59, 59, 59, 60],
                    "uint64_value": pd.array([None, None, None, 2**64 - 5], dtype="UInt64"),
                    "int64_value": [None, None, None, -7],
                    "double_value": [None, None, None, 2.5],
                    "nccl_payload": _payloads(),
                }
            )
        )
    return ids | {"d1": d1, "d2": d2}


ROUND_TRIPS = [
    ("3.0.0", "json"),
    ("3.0.0", "none"),
    ("3.16.1", "blob"),
    ("3.16.1", "json"),
    ("3.28.1", "dynamic"),
    ("3.28.1", "blob"),
    ("3.28.1", "json"),
]


# --------------------------------------------------------------------------- DDL


def test_ddl_300_statements_are_verbatim_from_real_export() -> None:
    real = _real_creates()
    ours = load_ddl("3.0.0").creates
    assert ours, "no CREATE statements parsed"
    for table, sql in ours.items():
        assert sql == real[table], table


def test_written_300_file_stores_real_create_statements(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    _write(path, "3.0.0", "json")
    real = _real_creates()
    conn = sqlite3.connect(path)
    stored = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"))
    assert {"CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS", "TARGET_INFO_GPU"} <= set(stored)
    for table, sql in stored.items():
        assert table in real, f"writer created {table}, which the real 3.0.0 schema does not have"
        assert sql == real[table], table


def _doc_row(section: str, first_cell: str) -> str:
    text = SCHEMA_DOC.read_text(encoding="utf-8")
    body = text.split(f"### {section}", 1)[1].split("\n### ", 1)[0]
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == first_cell:
            return line
    raise AssertionError(f"row {first_cell!r} not found in section {section}")


def _doc_names(fragment: str) -> list[tuple[str, bool]]:
    """(name, nullable) from backticked, comma-separated column names ('*' = nullable)."""
    out = []
    for group in re.findall(r"`([^`]*)`", fragment):
        for token in group.split(","):
            token = re.sub(r"\(.*?\)", "", token).strip()
            if token:
                out.append((token.rstrip("*"), token.endswith("*")))
    return out


# Column types the documentation states in prose; any other new column is INTEGER (documented
# assumption of the derived DDL files).
DOC_TYPES = {"binaryData": "TEXT", "tensorSizeMinusOneElements": "TEXT", "eventId": "INTEGER"}
DOC_PK = {"eventId"}


def _added(names: list[tuple[str, bool]]) -> list[tuple[str, str, bool, bool]]:
    return [(n, DOC_TYPES.get(n, "INTEGER"), not nullable, n in DOC_PK) for n, nullable in names]


def _expected_columns() -> dict[tuple[str, str], list[tuple[str, str, bool, bool]]]:
    kernel = _real_table_info("CUPTI_ACTIVITY_KIND_KERNEL")
    row = _doc_row("2.2", "3.16.1").split("|")[2]
    added, anchor = row.split("(between")
    new = _added(_doc_names(added))
    after = _doc_names(anchor)[0][0]
    i = [c[0] for c in kernel].index(after) + 1
    kernel_3161 = kernel[:i] + new + kernel[i:]
    kernel_3281 = kernel_3161 + _added(_doc_names(_doc_row("2.2", "3.28.1").split("|")[2].split("(")[0]))
    nvtx = _real_table_info("NVTX_EVENTS")
    nvtx_3161 = nvtx + _added(_doc_names(_doc_row("2.4", "3.16.1").split("|")[2]))
    nvtx_3281 = nvtx_3161 + _added(_doc_names(_doc_row("2.4", "3.28.1").split("|")[2]))
    runtime = _real_table_info("CUPTI_ACTIVITY_KIND_RUNTIME")
    session = _real_table_info("TARGET_INFO_SESSION_START_TIME")
    session_row = _doc_row("2.5", "`TARGET_INFO_SESSION_START_TIME`").split("|")
    assert session_row[3].strip() == "=", "3.16.1 session table documented as unchanged"
    session_3281 = session + _added(_doc_names(session_row[4]))
    device = _doc_row("2.5", "`TARGET_INFO_CUDA_DEVICE`").split("|")[4].split("—")[0]
    device_cols = [(n, "TEXT" if n == "uuid" else "INTEGER", not nullable, False) for n, nullable in _doc_names(device)]
    return {
        ("3.16.1", "CUPTI_ACTIVITY_KIND_KERNEL"): kernel_3161,
        ("3.28.1", "CUPTI_ACTIVITY_KIND_KERNEL"): kernel_3281,
        ("3.16.1", "NVTX_EVENTS"): nvtx_3161,
        ("3.28.1", "NVTX_EVENTS"): nvtx_3281,
        ("3.16.1", "CUPTI_ACTIVITY_KIND_RUNTIME"): runtime,
        ("3.28.1", "CUPTI_ACTIVITY_KIND_RUNTIME"): runtime,
        ("3.16.1", "TARGET_INFO_SESSION_START_TIME"): session,
        ("3.28.1", "TARGET_INFO_SESSION_START_TIME"): session_3281,
        ("3.28.1", "TARGET_INFO_CUDA_DEVICE"): device_cols,
    }


def test_reference_doc_300_column_lists_match_real_ddl() -> None:
    # Guards the doc parser used below: the 3.0.0 rows must reproduce the real DDL.
    for section, table in (("2.2", "CUPTI_ACTIVITY_KIND_KERNEL"), ("2.4", "NVTX_EVENTS")):
        doc = _doc_names(_doc_row(section, "3.0.0").split("|")[2])
        real = [(n, not notnull) for n, _, notnull, _ in _real_table_info(table)]
        assert doc == real, table
    doc_rt = _doc_names(_doc_row("2.3", "3.0.0 = 3.16.1 = 3.28.1").split("|")[2])
    assert doc_rt == [(n, not nn) for n, _, nn, _ in _real_table_info("CUPTI_ACTIVITY_KIND_RUNTIME")]


@pytest.mark.parametrize("version", ["3.16.1", "3.28.1"])
def test_derived_schema_columns_match_documented_lists(tmp_path: Path, version: str) -> None:
    path = tmp_path / f"r{version}.sqlite"
    _write(path, version, "json")
    conn = sqlite3.connect(path)
    checked = 0
    for (v, table), expected in _expected_columns().items():
        if v != version:
            continue
        assert _table_info(conn, table) == expected, table
        checked += 1
    assert checked >= 4


def test_derived_ddl_files_say_what_is_verbatim_and_what_is_derived() -> None:
    for version in ("3.16.1", "3.28.1"):
        ddl_file = Path(__file__).resolve().parents[1] / "src" / "nccltrace" / "nsys" / "ddl" / f"schema-{version}.sql"
        header = "\n".join(line for line in ddl_file.read_text(encoding="utf-8").splitlines() if line.startswith("--"))
        assert "DERIVED" in header and "verbatim" in header and "documentation" in header


def test_renamed_tables_in_newer_schemas(tmp_path: Path) -> None:
    names = {}
    for version in ("3.0.0", "3.16.1", "3.28.1"):
        path = tmp_path / f"{version}.sqlite"
        _write(path, version, "json")
        names[version] = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master")}
    assert {"EXPORT_META_DATA", "ENUM_CUDA_KRENEL_LAUNCH_TYPE"} <= names["3.0.0"]
    assert not {"META_DATA_EXPORT", "NVTX_PAYLOAD_SCHEMAS"} & names["3.0.0"]
    for version in ("3.16.1", "3.28.1"):
        assert {"META_DATA_EXPORT", "ENUM_CUDA_KERNEL_LAUNCH_TYPE", "NVTX_PAYLOAD_SCHEMAS"} <= names[version]
        assert "EXPORT_META_DATA" not in names[version]
    assert "TARGET_INFO_CUDA_DEVICE" in names["3.28.1"] and "TARGET_INFO_CUDA_DEVICE" not in names["3.16.1"]


# --------------------------------------------------------------------------- lazy / atomic / metadata


def test_lazy_export_creates_only_tables_with_rows(tmp_path: Path) -> None:
    path = tmp_path / "lazy.sqlite"
    with NsysExportWriter(path, "3.0.0", hostname="h", session_start_utc_ns=UTC0) as w:
        w.add_process(1, "p")
    tables = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"StringIds", "ThreadNames", "PROCESSES", "ANALYSIS_DETAILS", "TARGET_INFO_SYSTEM_ENV",
            "TARGET_INFO_SESSION_START_TIME", "EXPORT_META_DATA", "ENUM_NSYS_EVENT_TYPE"} <= tables  # fmt: skip
    assert not {"CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS", "TARGET_INFO_GPU"} & tables
    x = NsysExport.open(path)
    assert x.kernels().empty and x.nvtx().empty and x.runtime().empty


def test_enum_rows_copied_from_real_export(tmp_path: Path) -> None:
    path = tmp_path / "e.sqlite"
    with NsysExportWriter(path, "3.0.0", hostname="h", session_start_utc_ns=UTC0):
        pass
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM ENUM_NSYS_EVENT_TYPE").fetchone()[0] == 134
    assert conn.execute("SELECT name FROM ENUM_NSYS_EVENT_TYPE WHERE id = 59").fetchone()[0] == "NvtxPushPopRange"
    assert conn.execute("SELECT label FROM ENUM_NSYS_EVENT_CLASS WHERE id = 1").fetchone()[0] == "CUDA driver"


def test_session_and_metadata_rows_look_like_real_export(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite"
    with NsysExportWriter(path, "3.0.0", hostname="node-a", session_start_utc_ns=UTC0):
        pass
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT * FROM TARGET_INFO_SESSION_START_TIME").fetchall() == [(UTC0, "2026-11-21T10:02:11", "2026-11-21T10:02:11")]
    meta = dict(conn.execute("SELECT name, value FROM EXPORT_META_DATA"))
    sample = sqlite3.connect(f"file:{REF / 'nsys-2022.4.2.1-nvtx-sample.sqlite'}?mode=ro", uri=True)
    sample_meta = dict(sample.execute("SELECT name, value FROM EXPORT_META_DATA"))
    assert list(meta) == list(sample_meta)
    for key in ("EXPORT_PRODUCT_NAME", "EXPORT_PRODUCT_VERSION", "EXPORT_SCHEMA_VERSION", "EXPORT_SCHEMA_VERSION_CKSUM"):
        assert meta[key] == sample_meta[key]
    assert conn.execute("SELECT devStateName, name, nameEnum, value FROM TARGET_INFO_SYSTEM_ENV").fetchall() == [
        ("Local (CLI)", "Hostname", 619, "node-a")
    ]


def test_default_product_versions(tmp_path: Path) -> None:
    for version, product in (("3.0.0", "2022.4.2.1"), ("3.16.1", "2024.6.2.225"), ("3.28.1", "2026.4.1")):
        path = tmp_path / f"{version}.sqlite"
        with NsysExportWriter(path, version, hostname="h", session_start_utc_ns=UTC0):
            pass
        x = NsysExport.open(path)
        assert (x.schema_version, x.product_version) == (version, product)


def test_failed_write_leaves_no_file_at_target(tmp_path: Path) -> None:
    path = tmp_path / "out.sqlite"
    with pytest.raises(RuntimeError):
        with NsysExportWriter(path, "3.0.0", hostname="h", session_start_utc_ns=UTC0) as w:
            w.add_process(1, "p")
            assert not path.exists(), "target must not appear before close()"
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_invalid_payload_modes_for_version_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="binaryData"):
        NsysExportWriter(tmp_path / "a.sqlite", "3.0.0", hostname="h", session_start_utc_ns=0, payload_mode="blob")
    with pytest.raises(ValueError, match="eventId"):
        NsysExportWriter(tmp_path / "b.sqlite", "3.16.1", hostname="h", session_start_utc_ns=0, payload_mode="dynamic")
    assert list(tmp_path.iterdir()) == []


def test_payload_keys_must_match_the_nccl_schema(tmp_path: Path) -> None:
    with NsysExportWriter(tmp_path / "k.sqlite", "3.16.1", hostname="h", session_start_utc_ns=0, payload_mode="blob") as w:
        d = w.add_nvtx_domain(1, 1, "NCCL", 0)
        w.add_nccl_payload_schemas(1, d, (2, 18, 3))
        bad = pd.DataFrame({"start": [1], "end": [2], "pid": [1], "tid": [1], "text": ["ncclAllReduce"], "registered": [True],
                            "domain_id": [d], "nccl_payload": [{"NCCL communicator ID": 1, "Message size [bytes]": 8}]})  # fmt: skip
        with pytest.raises(ValueError, match="do not match NCCL 2.18.3"):
            w.add_nvtx_ranges(bad)


def test_float_columns_that_lost_integer_precision_are_rejected(tmp_path: Path) -> None:
    # [None, 1.8e18] becomes float64 in pandas and cannot hold epoch-ns values exactly.
    ranges = pd.DataFrame({"start": [1, 2], "end": [None, UTC0], "pid": [1, 1], "tid": [1, 1], "text": ["a", "b"]})
    with NsysExportWriter(tmp_path / "f.sqlite", "3.16.1", hostname="h", session_start_utc_ns=0) as w:
        with pytest.raises(ValueError, match="Int64"):
            w.add_nvtx_ranges(ranges)
        w.add_nvtx_ranges(ranges.assign(end=pd.array([None, UTC0], dtype="Int64")))
    assert NsysExport.open(tmp_path / "f.sqlite").nvtx()["end"].tolist()[1] == UTC0


def test_conflicting_nccl_versions_on_same_domain_id_are_rejected(tmp_path: Path) -> None:
    with NsysExportWriter(tmp_path / "c.sqlite", "3.28.1", hostname="h", session_start_utc_ns=0) as w:
        w.add_nccl_payload_schemas(1, 1, (2, 21, 5))
        w.add_nccl_payload_schemas(2, 1, (2, 21, 5))  # same layout: shared rows, fine
        with pytest.raises(ValueError, match="another layout"):
            w.add_nccl_payload_schemas(3, 1, (2, 27, 3))


# --------------------------------------------------------------------------- NCCL schemas / blob layout


def test_nccl_payload_schema_entry_names_follow_nccl_releases() -> None:
    assert nccl_payload_schemas((2, 16, 1)).schemas == ()
    old = nccl_payload_schemas((2, 18, 3)).by_api()
    assert [e.name for e in old["AllReduce"].entries] == ["Message size [bytes]", "Reduction operation"]
    assert [e.name for e in old["Broadcast"].entries] == ["Bytes", "Root"]
    assert [e.name for e in old["Recv"].entries] == ["Bytes", "Peer rank"]
    assert [e.name for e in old["CommInitRank"].entries] == ["Rank", "No. of ranks", "CUDA device"]
    assert "CommSplit" not in old
    assert [e.name for e in nccl_payload_schemas((2, 23, 4)).by_api()["CommSplit"].entries][-2:] == ["color", "key"]
    new = nccl_payload_schemas((2, 27, 3)).by_api()
    assert all(s.entries[0].name == "NCCL communicator ID" for s in new.values())
    assert [e.name for e in new["Send"].entries] == ["NCCL communicator ID", "Message size [bytes]", "Peer rank"]
    assert [e.name for e in new["CommSplit"].entries][-2:] == ["Color", "Key"]
    assert [e.name for e in new["CommShrink"].entries][-1] == "num_exclude"
    assert "AlltoAll" not in new and "AlltoAll" in nccl_payload_schemas((2, 28, 3)).by_api()
    assert "CommRevoke" in nccl_payload_schemas((2, 28, 7)).by_api()
    assert "WaitSignal" in nccl_payload_schemas((2, 29, 2)).by_api()
    assert new["AllReduce"].schema_id == (1 << 24) + 5 and new["AllReduce"].name is None
    assert old["AllReduce"].name == "AllReduce"


@pytest.mark.parametrize(
    ("version", "offset"),
    [((2, 18, 3), 11), ((2, 23, 4), 14), ((2, 25, 1), 14), ((2, 26, 2), 15), ((2, 27, 3), 16),
     ((2, 28, 3), 19), ((2, 28, 7), 20), ((2, 29, 2), 24)],
)  # fmt: skip
def test_reduction_enum_id_moves_between_nccl_releases(version: tuple, offset: int) -> None:
    sset = nccl_payload_schemas(version)
    (enum,) = sset.enums
    assert enum.schema_id == (1 << 24) + offset
    assert [n for n, _ in enum.entries] == ["Sum", "Product", "Max", "Min", "Avg"]
    assert sset.by_api()["AllReduce"].entries[-1].type == enum.schema_id


def test_blob_layout_is_schema_id_then_packed_struct(tmp_path: Path) -> None:
    path = tmp_path / "b.sqlite"
    _write(path, "3.16.1", "blob")
    blob = sqlite3.connect(path).execute("SELECT binaryData FROM NVTX_EVENTS WHERE binaryData IS NOT NULL ORDER BY start").fetchone()[0]
    # NCCL 2.27 AllReduce struct: uint64 comm @0, size_t bytes @8, int op @16, padded to 24 bytes.
    assert blob == struct.pack("<QQQi4x", (1 << 24) + 5, COMM, 4096, 0)


def test_blob_with_unknown_header_layout_is_not_decoded(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    _write(path, "3.16.1", "blob")
    with sqlite3.connect(path) as conn:  # simulate a 32-byte header instead of nccltrace's 8 bytes
        conn.execute("UPDATE NVTX_EVENTS SET binaryData = zeroblob(24) || binaryData WHERE binaryData IS NOT NULL")
    conn.close()
    x = NsysExport.open(path)
    with pytest.warns(UserWarning, match=r"h\.sqlite: \d+ NVTX extended-payload blob\(s\) could not be decoded"):
        n = x.nvtx()
    assert n["payload_source"].isna().all() and n["nccl_comm_id"].isna().all()
    assert x.undecoded_payload_blobs > 0 and x.session_info()["undecoded_payload_blobs"] == x.undecoded_payload_blobs


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(("version", "mode"), ROUND_TRIPS)
def test_round_trip_every_field(tmp_path: Path, version: str, mode: str) -> None:
    path = tmp_path / f"rt-{version}-{mode}.sqlite"
    ids = _write(path, version, mode)
    x = NsysExport.open(path)
    assert (x.schema_version, x.hostname, x.session_start_utc_ns, x.time_normalized) == (version, "node-a", UTC0, False)

    k = x.kernels()
    src = _kernels()
    for col in ["start", "end", "device_id", "context_id", "stream_id", "correlation_id", "pid", "name", "short_name",
                "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "registers_per_thread",
                "static_shared_memory", "dynamic_shared_memory"]:  # fmt: skip
        assert k[col].tolist() == src[col].tolist(), col
    assert k["global_pid"].tolist() == [ids["gp1"], ids["gp2"], ids["gp1"]]
    # Colliding correlationId 7 resolves per process: launch thread 4250 in 4242, 4351 in 4343.
    assert k["launch_tid"].tolist() == [4250, 4351, 4251]
    assert k["launch_start"].tolist() == [900, 1_900, 2_800]
    assert k["launch_end"].tolist() == [950, 1_950, 2_900]
    assert k["launch_global_tid"].tolist()[0] == ids["gt_main"]
    api = "cudaLaunchKernel" if version == "3.0.0" else "cuLaunchKernelEx"
    assert k["launch_api"].tolist() == [api] * 3
    assert k["launch_event_class"].tolist() == [0 if version == "3.0.0" else 1] * 3
    assert k["green_context_id"].isna().all()
    assert len(x.kernels("%SendRecv%")) == 1 and len(x.kernels("sgemm%")) == 0

    rt = x.runtime()
    assert rt["api"].tolist()[-1] == "cudaStreamSynchronize" and rt["correlation_id"].tolist() == [7, 7, 9, 10]

    n = x.nvtx()
    assert n["text"].tolist() == ["train_step", "ncclAllReduce", "ncclAllReduce", "ncclSend"]
    assert n["domain"].tolist() == [None, "NCCL", "NCCL", "NCCL"]
    assert n["domain_id"].tolist() == [0, ids["d1"], ids["d2"], ids["d1"]]
    assert n["pid"].tolist() == [4242, 4242, 4343, 4242] and n["tid"].tolist() == [4250, 4250, 4351, 4251]
    assert n["event_type"].tolist() == [60, 59, 59, 59]
    step = n.iloc[0]
    assert (step["end"], step["category"], step["color"], step["range_id"]) == (5_000, 3, 0xFF00FF00, 1)
    assert step["end_global_tid"] & 0xFFFFFF == 4251 and pd.isna(n["end_global_tid"].iloc[1])
    assert (step["uint64_value"], step["int64_value"], step["double_value"]) == (2**64 - 5, -7, 2.5)
    assert x.nvtx(domain="NCCL")["text"].tolist() == ["ncclAllReduce", "ncclAllReduce", "ncclSend"]

    ranges = n.iloc[[1, 2, 3]]
    if mode == "none":
        assert n["payload_source"].isna().all() and n["nccl_comm_id"].isna().all()
    else:
        assert ranges["payload_source"].tolist() == [mode] * 3 and pd.isna(step["payload_source"])
        assert ranges["nccl_comm_id"].tolist() == [COMM, COMM, COMM + 1]
        assert ranges["nccl_message_bytes"].tolist() == [4096, 8192, 64]
        assert ranges["nccl_redop"].tolist()[:2] == [0, 2] and pd.isna(ranges["nccl_redop"].iloc[2])
        assert ranges["nccl_peer"].tolist()[2] == 3 and ranges["nccl_peer"].isna().tolist()[:2] == [True, True]

    p = x.processes()
    assert p[["pid", "name"]].values.tolist() == [[4242, "python"], [4343, "python"]]
    t = x.threads()
    assert t[["pid", "tid", "name"]].values.tolist() == [
        [4242, 4250, "pt_main_thread"], [4242, 4251, "pt_autograd_0"], [4343, 4351, "pt_main_thread"]]  # fmt: skip
    g = x.gpus()
    assert g["uuid"].tolist() == ["GPU-1111", "GPU-2222"] and g["bus_location"].tolist()[1] == "0000:2a:00.0"
    if version == "3.28.1":
        assert g["pid"].tolist() == [4242, 4343] and g["cuda_id"].tolist() == [0, 0]
    else:
        assert g["pid"].isna().all()


def test_dynamic_tables_are_named_per_process_domain_and_schema(tmp_path: Path) -> None:
    path = tmp_path / "d.sqlite"
    ids = _write(path, "3.28.1", "dynamic")
    conn = sqlite3.connect(path)
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'DYNAMIC_NVTXPAYLOAD_DATATYPE_%'")}
    assert names == {
        f"DYNAMIC_NVTXPAYLOAD_DATATYPE_{ids['gp1']}_{ids['d1']}_{(1 << 24) + 5}",
        f"DYNAMIC_NVTXPAYLOAD_DATATYPE_{ids['gp2']}_{ids['d2']}_{(1 << 24) + 5}",
        f"DYNAMIC_NVTXPAYLOAD_DATATYPE_{ids['gp1']}_{ids['d1']}_{(1 << 24) + 9}",
    }
    trans = dict(conn.execute("SELECT originalName, sanitizedName FROM NVTX_EXPORT_TRANSLATION"))
    assert trans["Message size [bytes]"] == "Message_size__bytes_"
    assert conn.execute("SELECT count(*) FROM NVTX_EVENTS_PAYLOAD_SCHEMAS").fetchone()[0] == 3


def test_time_normalized_flag_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "n.sqlite"
    with NsysExportWriter(path, "3.16.1", hostname="h", session_start_utc_ns=UTC0, time_normalized=True):
        pass
    x = NsysExport.open(path)
    assert x.time_normalized and x.utc_offset_ns == 0
    with pytest.raises(ValueError, match="ts-normalize"):
        NsysExportWriter(tmp_path / "o.sqlite", "3.0.0", hostname="h", session_start_utc_ns=0, time_normalized=True)
