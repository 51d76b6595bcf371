"""Property-based tests of the nsys SQLite reader on mutated real-schema exports.

The exports are written by the emulator (the project's nsys writer, real DDL of schemas 3.0.0 and
3.28.1, with NCCL and compute kernels, their launch calls and NVTX ranges). Hypothesis damages copies
the way exports get damaged: cut at any byte (interrupted copy), bytes overwritten anywhere (bad
disk or transfer), tables or columns missing, NULLs or values of the wrong type in required
columns, rows present twice, dangling name ids, no kernels at all, a file that is not SQLite.

Properties: the reader either succeeds and the kernels it returns are exactly the intact ones
(damaged rows left out, each skip said in a :class:`NsysDataWarning` and ``skipped_kernel_rows``),
or it raises :class:`NsysFormatError` whose message names the file, what is wrong and what to do.
Never a raw ``sqlite3``/``KeyError``/``ValueError``, never an empty result that cannot be told apart
from "no kernels" (``kernel_records``, ``session.json``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import sqlite3
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nccltrace.emulator.run import emulate_run
from nccltrace.nsys.reader import (
    KERNEL_COLUMNS,
    NsysDataWarning,
    NsysExport,
    NsysFormatError,
    NsysSchemaWarning,
)

K = "CUPTI_ACTIVITY_KIND_KERNEL"
RT = "CUPTI_ACTIVITY_KIND_RUNTIME"
# Reproducible in CI and nothing written into the repository (no example database).
BASE = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow])
BASES = {"3.28.1": ("2026.4", "2.28.3", "dynamic"), "3.0.0": ("2022.4", "2.18.3", "none")}
# Kernel columns every row must have (NOT NULL in the nsys DDL and read by the reader) ...
REQUIRED = ["start", "end", "deviceId", "contextId", "streamId", "demangledName", "registersPerThread", "gridX",
            "gridY", "gridZ", "blockX", "blockY", "blockZ", "staticSharedMemory", "dynamicSharedMemory"]
# ... and columns it reads that may be NULL (the row stays, the value is NA).
OPTIONAL = {"correlationId": ["correlation_id", "launch_start", "launch_end", "launch_global_tid", "launch_tid",
                              "launch_api", "launch_event_class"],
            "globalPid": ["global_pid", "pid", "launch_start", "launch_end", "launch_global_tid", "launch_tid",
                          "launch_api", "launch_event_class"],
            "shortName": ["short_name"]}
# What-to-do parts of the reader's messages (one must be there).
HINTS = ("nsys export", "re-export", "copy it again", "copy the file again", "pass the", "check the path",
         "check permissions")


@functools.cache
def _base(schema: str) -> bytes:
    nsys, nccl, payloads = BASES[schema]
    cfg = {"model": "tiny", "num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
           "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 2, "iterations": 1, "tp": 2, "nodes": 1,
           "gpus_per_node": 2, "nccl_version": nccl, "nsys_version": nsys, "nvtx_payloads": payloads, "seed": 3,
           "precision": "bf16"}
    with tempfile.TemporaryDirectory() as d:
        res = emulate_run(cfg, Path(d))
        (path,) = res.nsys_files
        return path.read_bytes()


@dataclass(frozen=True)
class Pristine:
    kernels: pd.DataFrame  # kernels(None)
    nccl: pd.DataFrame  # kernels() (NCCL only)
    rowids: list[int]  # kernel rowids in the order kernels(None) returns them
    pages: dict[int, str]  # page number -> table owning it (dbstat), for locating damage


@functools.cache
def _pristine(schema: str) -> Pristine:
    with _copy(schema) as p:
        with NsysExport.open(p) as x, warnings.catch_warnings():
            warnings.simplefilter("error")  # the pristine export reads without a single warning
            kernels, nccl = x.kernels(None), x.kernels()
        conn = sqlite3.connect(p)
        rowids = [r for (r,) in conn.execute(f"SELECT rowid FROM {K} ORDER BY start, rowid")]
        owner = dict(conn.execute("SELECT name, tbl_name FROM sqlite_master WHERE type IN ('table', 'index')"))
        try:
            pages = {n: owner.get(t, t) for t, n in conn.execute("SELECT name, pageno FROM dbstat")}
        except sqlite3.OperationalError:  # SQLite built without the dbstat table
            pages = {}
        conn.close()
    assert len(nccl) > 0 and len(kernels) > len(nccl)
    return Pristine(kernels, nccl, rowids, pages)


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="nsys-props-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _copy(schema: str, data: bytes | None = None) -> Iterator[Path]:
    with _workdir() as d:
        p = d / "node007.sqlite"
        p.write_bytes(_base(schema) if data is None else data)
        yield p


@dataclass
class Outcome:
    error: NsysFormatError | None = None
    kernels: pd.DataFrame | None = None  # kernels(None)
    nccl: pd.DataFrame | None = None  # kernels()
    warnings: list[str] = field(default_factory=list)
    kernel_records: int | None = None
    session: dict | None = None


def _read(path: Path, full: bool = True) -> Outcome:
    """What a pipeline reads from an export (``full``: every table and ``export_tables``, else the
    kernels and the session record); only NsysFormatError may escape the reader."""
    out = Outcome()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with NsysExport.open(path) as x:
                out.kernels = x.kernels(None)
                out.nccl = pd.concat(list(x.iter_kernels(batch_rows=7)) or [x.kernels().iloc[:0]],
                                     ignore_index=True)
                out.kernel_records = x.kernel_records
                if full:
                    x.nvtx(), x.runtime(), x.processes(), x.threads(), x.gpus(), x.launches_without_kernel()
                    x.export_tables(path.parent / "parsed")
                    out.session = json.loads((path.parent / "parsed" / "session.json").read_text())
                else:
                    out.session = x.session_info()
        except NsysFormatError as e:
            out.error = e
    for w in caught:
        assert issubclass(w.category, (NsysDataWarning, NsysSchemaWarning)), w
        out.warnings.append(str(w.message))
    if out.error is not None:
        msg = str(out.error)
        assert path.name in msg and any(h in msg for h in HINTS), msg
    else:
        for frame in (out.kernels, out.nccl):
            assert [(c, str(t)) for c, t in frame.dtypes.items()] == [(c, k) for c, k in KERNEL_COLUMNS]
    return out


def _same_kernels(got: pd.DataFrame, want: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(got.reset_index(drop=True), want.reset_index(drop=True))


# --- cut and overwritten files ------------------------------------------------------------------
@settings(BASE, max_examples=25)
@given(st.sampled_from(sorted(BASES)), st.data())
def test_a_file_cut_anywhere_is_a_format_error_naming_the_cut(schema, data):
    size = len(_base(schema))
    cut = data.draw(st.one_of(st.integers(0, 120), st.integers(0, size - 1)), label="bytes kept")
    with _copy(schema, _base(schema)[:cut]) as p:
        out = _read(p)
    assert out.error is not None
    assert ("empty" if cut == 0 else "truncated") in str(out.error)


@settings(BASE, max_examples=45)
@given(st.sampled_from(sorted(BASES)), st.data())
def test_overwritten_bytes_give_a_format_error_or_intact_kernels(schema, data):
    """Bytes overwritten anywhere (header, schema, data pages): no raw error. Damage in pages the
    kernel read does not touch leaves the kernels exactly as they were."""
    base = bytearray(_base(schema))
    ref = _pristine(schema)
    page_size = int.from_bytes(base[16:18], "big")
    n = data.draw(st.one_of(st.integers(1, 3), st.integers(1, 24)), label="bytes overwritten")
    # A page then a byte in it: integers alone would mostly hit the first (schema) pages.
    where = st.tuples(st.sampled_from(range(len(base) // page_size)), st.integers(0, page_size - 1))
    offsets = [pg * page_size + k for pg, k in data.draw(st.lists(where, min_size=n, max_size=n), label="offsets")]
    for off in offsets:
        base[off] = data.draw(st.integers(0, 255))
    kernel_path = {K, RT, "StringIds", "META_DATA_EXPORT", "EXPORT_META_DATA", "TARGET_INFO_SESSION_START_TIME",
                   "TARGET_INFO_SYSTEM_ENV", "sqlite_schema", "sqlite_master"}
    touched = {ref.pages.get(off // page_size + 1) for off in offsets}
    elsewhere = bool(ref.pages) and not touched & kernel_path
    with _copy(schema, bytes(base)) as p:
        out = _read(p)
        if elsewhere:
            # Damage in other tables or free pages: NVTX may fail, the kernels may not change.
            with NsysExport.open(p) as x, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _same_kernels(x.kernels(None), ref.kernels)
    if out.error is None and len(out.kernels) < len(ref.kernels):
        # Fewer kernels than written: said in a warning or by the kernel count, never silently.
        assert out.warnings or out.kernel_records < len(ref.kernels), out
    event("format error" if out.error else "read" + (" with warnings" if out.warnings else ""))
    event("damage outside the kernel read" if elsewhere else "damage in the kernel read")


# --- structural damage --------------------------------------------------------------------------
def _sql(p: Path, *statements: str) -> None:
    conn = sqlite3.connect(p)
    for s in statements:
        conn.execute(s)
    conn.commit()
    conn.close()


def _unconstrained(table: str) -> list[str]:
    """Statements that rebuild a table without NOT NULL/PRIMARY KEY (same rows, rowids and order),
    so that damage the constraints would refuse can be written."""
    return [f'CREATE TABLE "_tmp" AS SELECT rowid AS "_rid", * FROM "{table}" ORDER BY rowid',
            f'DROP TABLE "{table}"', f'CREATE TABLE "{table}" AS SELECT * FROM "_tmp" ORDER BY "_rid"',
            f'ALTER TABLE "{table}" DROP COLUMN "_rid"', 'DROP TABLE "_tmp"']


@settings(BASE, max_examples=16)
@given(st.sampled_from(sorted(BASES)), st.sampled_from(REQUIRED), st.data())
def test_null_or_non_integer_required_values_skip_exactly_those_rows(schema, column, data):
    ref = _pristine(schema)
    rows = data.draw(st.lists(st.sampled_from(ref.rowids), min_size=1, max_size=6, unique=True), label="rows")
    value = data.draw(st.sampled_from(["NULL", "'x'", "1.5", "X'00FF'", "'12abc'"]), label="value")
    if column == "demangledName" and value == "1.5":
        value = "987654321"  # a name id StringIds does not have
    with _copy(schema) as p:
        _sql(p, *_unconstrained(K), f'UPDATE {K} SET "{column}" = {value} WHERE rowid IN ({",".join(map(str, rows))})')
        out = _read(p, full=False)
    assert out.error is None, out.error
    keep = [i for i, r in enumerate(ref.rowids) if r not in rows]
    _same_kernels(out.kernels, ref.kernels.iloc[keep])
    assert out.kernel_records == len(ref.rowids)
    assert any(f"{len(rows)} kernel row(s) skipped" in w for w in out.warnings), out.warnings
    assert out.session["skipped_kernel_rows"]["damaged"] >= 0  # the NCCL-only read: the rows it selected


@settings(BASE, max_examples=8)
@given(st.sampled_from(sorted(BASES)), st.sampled_from(sorted(OPTIONAL)), st.data())
def test_null_optional_values_keep_the_row_with_na(schema, column, data):
    ref = _pristine(schema)
    rows = data.draw(st.lists(st.sampled_from(ref.rowids), min_size=1, max_size=6, unique=True), label="rows")
    with _copy(schema) as p:
        _sql(p, *_unconstrained(K), f'UPDATE {K} SET "{column}" = NULL WHERE rowid IN ({",".join(map(str, rows))})')
        out = _read(p, full=False)
    assert out.error is None, out.error
    hit = [i for i, r in enumerate(ref.rowids) if r in rows]
    want = ref.kernels.copy()
    for col in OPTIONAL[column]:
        want[col] = want[col].astype(object)
        want.loc[hit, col] = None
        want[col] = want[col].astype(ref.kernels[col].dtype)
    _same_kernels(out.kernels, want)


@settings(BASE, max_examples=8)
@given(st.sampled_from(sorted(BASES)), st.data())
def test_duplicate_kernel_rows_are_skipped_and_reported(schema, data):
    ref = _pristine(schema)
    rows = data.draw(st.lists(st.sampled_from(ref.rowids), min_size=1, max_size=12), label="rows copied")
    batch = data.draw(st.sampled_from([2, 7, 500_000]), label="batch rows")
    with _copy(schema) as p:
        _sql(p, *[f"INSERT INTO {K} SELECT * FROM {K} WHERE rowid = {r}" for r in rows])
        out = _read(p, full=False)
        with NsysExport.open(p) as x, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            batched = pd.concat(list(x.iter_kernels(None, batch_rows=batch)), ignore_index=True)
            assert x.skipped_kernel_rows == {"damaged": 0, "duplicate": len(rows)}
    assert out.error is None, out.error
    _same_kernels(out.kernels, ref.kernels)
    _same_kernels(batched, ref.kernels)
    assert any(f"{len(rows)} duplicate kernel row(s)" in w for w in out.warnings), out.warnings


OTHER_TABLES = ["NVTX_EVENTS", "TARGET_INFO_SESSION_START_TIME", "TARGET_INFO_SYSTEM_ENV", "PROCESSES", "ThreadNames",
                "TARGET_INFO_GPU", "ANALYSIS_DETAILS", "ENUM_NSYS_EVENT_TYPE"]


@pytest.mark.parametrize("schema", sorted(BASES))
@pytest.mark.parametrize("table", [K, RT, "StringIds", "META_DATA_EXPORT", *OTHER_TABLES])
def test_a_missing_table(schema, table):
    """Each table dropped in turn: the kernels survive what they do not depend on; a missing kernel
    table reads as a zero-kernel export that says so; a missing StringIds or metadata table is a
    format error."""
    ref = _pristine(schema)
    with _copy(schema) as p:
        if table == "META_DATA_EXPORT" and schema == "3.0.0":
            table = "EXPORT_META_DATA"
        conn = sqlite3.connect(p)
        present = {r for (r,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        conn.close()
        if table not in present:
            pytest.skip(f"{table} is not in a {schema} export")
        _sql(p, f'DROP TABLE "{table}"')
        out = _read(p)
    if table in ("StringIds", "META_DATA_EXPORT", "EXPORT_META_DATA"):
        assert out.error is not None and table in str(out.error)
        return
    assert out.error is None, out.error
    if table == K:
        assert out.kernels.empty and out.kernel_records == 0
        assert out.session["kernel_table"] is False and out.session["kernel_records"] == 0
        assert any("no CUDA kernel records" in w for w in out.warnings)
        return
    want = ref.kernels
    if table == RT:
        want = want.copy()
        for col in OPTIONAL["correlationId"][1:]:
            want[col] = pd.Series([None] * len(want), dtype=ref.kernels[col].dtype)
    _same_kernels(out.kernels, want)
    _same_kernels(out.nccl, ref.nccl if table != RT else want[want["name"].str.startswith("nccl")])


@settings(BASE, max_examples=20)
@given(st.sampled_from(sorted(BASES)), st.sampled_from(["kernel", "runtime", "strings"]), st.data())
def test_a_missing_column_is_a_format_error_naming_it_or_harmless(schema, table, data):
    name = {"kernel": K, "runtime": RT, "strings": "StringIds"}[table]
    with _copy(schema) as p:
        conn = sqlite3.connect(p)
        columns = [r[1] for r in conn.execute(f'PRAGMA table_info("{name}")')]
        conn.close()
        column = data.draw(st.sampled_from([c for c in columns if c != "id"]), label="column")
        _sql(p, *_unconstrained(name), f'ALTER TABLE "{name}" DROP COLUMN "{column}"')
        out = _read(p)
    needed = {K: set(REQUIRED) | {"globalPid", "shortName", "correlationId"},
              RT: {"correlationId", "globalTid", "start", "end", "nameId"}, "StringIds": {"value"}}[name]
    if column in needed:
        assert out.error is not None and column in str(out.error), out.error
        return
    # A column the reader does not need, or one it reads as optional (its output column all NA).
    assert out.error is None, out.error
    want = _pristine(schema).kernels.copy()
    for col in {"eventClass": ["launch_event_class"], "greenContextId": ["green_context_id"]}.get(column, []):
        want[col] = pd.Series([None] * len(want), dtype=want[col].dtype)
    _same_kernels(out.kernels, want)


@pytest.mark.parametrize("schema", sorted(BASES))
def test_names_missing_from_string_ids_are_skipped_not_filtered_out_silently(schema):
    """A kernel whose name id has no string (NULL value or no row) cannot be told NCCL or not: the
    NCCL-filtered read reports it instead of leaving it out unseen."""
    ref = _pristine(schema)
    nccl_name = ref.nccl["name"].iloc[0]
    with _copy(schema) as p:
        _sql(p, *_unconstrained("StringIds"), f"UPDATE StringIds SET value = NULL WHERE value = '{nccl_name}'")
        out = _read(p)
    lost = int((ref.kernels["name"] == nccl_name).sum())
    assert out.error is None and len(out.nccl) == len(ref.nccl) - lost
    assert out.session["skipped_kernel_rows"] == {"damaged": lost, "duplicate": 0}
    assert any(f"{lost} kernel row(s) skipped" in w and "StringIds" in w for w in out.warnings)


@pytest.mark.parametrize("schema", sorted(BASES))
def test_a_zero_kernel_export_reads_as_zero_kernels_and_says_so(schema):
    with _copy(schema) as p:
        _sql(p, f"DELETE FROM {K}")
        out = _read(p)
    assert out.error is None and out.kernels.empty and out.nccl.empty
    assert out.kernel_records == 0 and out.session["kernel_records"] == 0 and out.session["kernel_table"] is True
    assert any("kernels.parquet is empty" in w and "no CUDA kernel records" in w for w in out.warnings)


def test_the_pristine_export_has_no_warning_and_full_session_record():
    for schema in sorted(BASES):
        ref = _pristine(schema)
        with _copy(schema) as p:
            out = _read(p)
        assert out.error is None and not out.warnings
        _same_kernels(out.kernels, ref.kernels)
        _same_kernels(out.nccl, ref.nccl)
        assert out.session["kernel_records"] == len(ref.kernels) and out.session["kernel_table"] is True
        assert out.session["skipped_kernel_rows"] == {"damaged": 0, "duplicate": 0}


@settings(BASE, max_examples=15)
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                 st.binary(min_size=1, max_size=300).map(lambda b: b"SQLite format 3\x00" + b)))
def test_files_that_are_not_an_export(data):
    """Empty files, text, random bytes, an SQLite header followed by garbage."""
    with _workdir() as d:
        p = d / "node007.sqlite"
        p.write_bytes(data)
        out = _read(p)
    assert out.error is not None
    msg = str(out.error)
    if not data:
        assert "empty" in msg
    elif not data.startswith(b"SQLite format 3\x00"[: len(data)]):
        assert "not an SQLite database" in msg


def test_a_corrupt_schema_page_with_non_utf8_bytes_is_a_format_error():
    """Regression: sqlite3 raised a raw UnicodeDecodeError decoding SQLite's error message about a
    corrupt schema (a table name holding non-UTF-8 bytes)."""
    data = bytearray(_base("3.28.1"))
    at = data.find(b"DYNAMIC_NVTXPAYLOAD_DATATYPE_")
    assert at > 0
    data[at + 35] = 0xB2
    with _copy("3.28.1", bytes(data)) as p:
        out = _read(p)
    assert out.error is not None
