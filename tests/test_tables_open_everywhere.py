"""Every Parquet file an analysis writes opens in the readers people use (pandas, pyarrow, DuckDB)
and has exactly the columns and types ``nccltrace tables-doc`` documents, in every alignment mode
and on every shape of input: logs alone, logs with nsys exports (per node and per process), with
profiler traces, a step-window capture, and the real H200 capture.

A file's pandas metadata is written from its Arrow types (``tables.file_schema``): pyarrow's
``from_pandas`` used to record the dtypes of the frame it was given, so an all-null ``Int64`` column
stored as ``bool`` (``steps_verified`` in exact mode) made ``pandas.read_parquet`` raise.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_paths import CAPTURE, REPO
from emulated_runs import SMALL_MODEL
from parquet_checks import assert_every_table_opens

from nccltrace.cli import main
from nccltrace.core.tables import (
    file_schema,
    frame_to_table,
    schema_problems,
    write_table_atomic,
)
from nccltrace.emulator.run import emulate_run
from nccltrace.outputs.tables_doc import (
    documented_schema_of,
    documented_schemas,
    tables_markdown,
)

# An 8-rank TP2·PP2·DP2 run on two nodes, NCCL 2.28 with log timestamps and NVTX payloads, of
# which nsys captured steps 2-3: the shape the exact-mode defect was found on.
WINDOWED = {**SMALL_MODEL, "model": "tiny", "iterations": 4, "tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 4,
            "nccl_version": "2.28.9", "nsys_version": "2026.4", "nccl_timestamps": True, "nvtx_payloads": "dynamic",
            "capture": {"steps": [2, 3]}}  # fmt: skip
PER_PROCESS = {**SMALL_MODEL, "model": "tiny", "tp": 2, "nodes": 1, "gpus_per_node": 4, "nsys_per_process": True,
               "seed": 3}  # fmt: skip


@pytest.fixture(scope="module")
def windowed_raw(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("windowed") / "raw"
    emulate_run(WINDOWED, raw)
    return raw


@pytest.mark.parametrize("mode", ["default", "exact", "thesis"])
def test_every_table_of_a_windowed_run_opens_in_every_mode(windowed_raw, tmp_path, mode):
    out = tmp_path / "out"
    assert main(["analyze", str(windowed_raw), "-o", str(out), "-q", "--mode", mode]) == 0
    n = assert_every_table_opens(out)
    assert n > 100  # per process, per node and per run tables through the report
    # The column the defect was found in reads back as its documented type.
    align = next(out.glob("aligned/*/*/alignment.parquet"))
    assert str(pd.read_parquet(align)["steps_verified"].dtype) == "boolean"


def test_every_table_of_a_run_analysed_from_its_logs_alone_opens(windowed_raw, tmp_path):
    logs = tmp_path / "logs"
    shutil.copytree(windowed_raw / "nccl", logs / "nccl")
    assert main(["analyze", str(logs), "-o", str(tmp_path / "out"), "-q"]) == 0
    assert_every_table_opens(tmp_path / "out")


def test_every_table_of_a_run_with_per_process_exports_opens(tmp_path):
    emulate_run(PER_PROCESS, tmp_path / "raw")
    assert main(["analyze", str(tmp_path / "raw"), "-o", str(tmp_path / "out"), "-q"]) == 0
    assert_every_table_opens(tmp_path / "out")


@pytest.mark.slow
def test_every_table_of_the_real_capture_opens(tmp_path):
    """The real H200 capture: NCCL logs, PyTorch-profiler traces and Flight Recorder dumps."""
    raw = tmp_path / "raw"
    for part in ("nccl", "kineto", "flight_recorder"):
        shutil.copytree(CAPTURE / part, raw / part)
    assert main(["analyze", str(raw), "-o", str(tmp_path / "out"), "-q"]) == 0
    assert_every_table_opens(tmp_path / "out")
    kernels = pd.read_parquet(next((tmp_path / "out").glob("parsed/nsys/*/kernels.parquet")))
    assert kernels["coll_in_nelems"].notna().any()  # the profiler's call arguments, as documented


def test_a_frame_of_other_dtypes_than_its_schema_is_written_as_the_schema_says(tmp_path):
    """The defect's shape: an all-null Int64 column stored as bool. Written the old way
    (``from_pandas`` alone) the file's pandas metadata contradicts it and pandas cannot read it;
    through ``frame_to_table`` it opens, and ``schema_problems`` tells the two apart."""
    schema = pa.schema([("flag", pa.bool_()), ("id", pa.uint64())])
    frame = pd.DataFrame({"flag": pd.array([pd.NA, pd.NA], dtype="Int64"), "id": pd.array([2**63 + 1, None],
                                                                                          dtype="UInt64")})
    old = tmp_path / "old.parquet"
    pq.write_table(pa.Table.from_pandas(frame, schema=schema, preserve_index=False), old)
    with pytest.raises(TypeError):
        pd.read_parquet(old)
    assert any("pandas metadata says Int64" in p for p in schema_problems(pq.read_schema(old), schema))
    new = tmp_path / "new.parquet"
    write_table_atomic(frame_to_table(frame, schema), new)
    back = pd.read_parquet(new)
    assert str(back["flag"].dtype) == "boolean" and back["id"].iloc[0] == 2**63 + 1  # exact, not float64
    assert schema_problems(pq.read_schema(new), schema) == []


def test_a_table_written_from_arrow_alone_reads_its_ids_exactly_in_pandas(tmp_path):
    """Without pandas metadata, pandas reads a nullable 64-bit column as float64 (ids above 2^53
    change); every writer adds the metadata its Arrow types give."""
    schema = pa.schema([("comm", pa.uint64())])
    table = pa.table({"comm": pa.array([2**60 + 3, None], pa.uint64())})
    bare = tmp_path / "bare.parquet"
    pq.write_table(table, bare)
    assert str(pd.read_parquet(bare)["comm"].dtype) == "float64"
    assert any("no pandas metadata" in p for p in schema_problems(pq.read_schema(bare), schema))
    ours = tmp_path / "ours.parquet"
    with pq.ParquetWriter(ours, file_schema(schema)) as writer:
        writer.write_table(table)
    assert pd.read_parquet(ours)["comm"].iloc[0] == 2**60 + 3


def test_a_file_with_an_undocumented_column_or_type_is_reported(tmp_path):
    name, schema = documented_schema_of("ops/parallelism.parquet")
    assert name == "parallelism"
    wrong = pa.schema([f.with_type(pa.int64()) if i == 0 else f for i, f in enumerate(schema)])
    assert any("documented" in p for p in schema_problems(file_schema(wrong), schema))
    extra = file_schema(schema.append(pa.field("extra", pa.int64())))
    assert any("undocumented ['extra']" in p for p in schema_problems(extra, schema))


def test_tables_doc_documents_every_registered_table_and_docs_tables_md_is_current():
    text = tables_markdown()
    for name in documented_schemas():
        assert f"## `{name}.parquet`" in text
    assert (REPO / "docs" / "tables.md").read_text(encoding="utf-8").rstrip("\n") == text.rstrip("\n"), (
        "docs/tables.md is stale: run `nccltrace tables-doc -o docs/tables.md`")
