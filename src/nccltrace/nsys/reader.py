"""Reader for Nsight Systems SQLite exports (``nsys export --type sqlite``), schema major 3.

It turns an export of any nsys release into the frames the analysis needs: CUDA kernels joined to
the API call that launched them, CUDA runtime/driver calls, NVTX ranges (NCCL's extended payloads
decoded), processes, threads, GPUs and the session's UTC anchor. Columns are feature-detected
(``PRAGMA table_info``) rather than inferred from the version number, and a missing table means
"no such events" (lazy export). Frame conventions (times, nullable integers, PID/TID decoding):
``docs/nsys.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sqlite3
import struct
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from nccltrace.core.kernel_args import KERNEL_ARG_COLUMNS
from nccltrace.core.layout import KERNELS_FILE, LAUNCHES_FILE, NVTX_FILE, SESSION_FILE
from nccltrace.core.tables import (
    atomic_output,
    frame_to_table,
    parquet_writer,
    write_table_atomic,
)
from nccltrace.nsys.schema import (
    GPID_MASK,
    GPU_COLUMNS,
    KERNEL_COLUMNS,
    KERNEL_TABLE_COLUMNS,
    LAUNCH_COLUMNS,
    NCCL_COLUMN_KINDS,
    NVTX_COLUMNS,
    PAYLOAD_SCHEMA_ENTRY_COLUMNS,
    PROCESS_COLUMNS,
    RUNTIME_COLUMNS,
    THREAD_COLUMNS,
    spec_schema,
)

__all__ = [
    "KERNEL_COLUMNS",
    "KNOWN_SCHEMA_VERSIONS",
    "NCCL_ENTRY_COLUMNS",
    "NVTX_COLUMNS",
    "NsysDataWarning",
    "NsysExport",
    "NsysFormatError",
    "NsysSchemaWarning",
    "decode_pid",
    "decode_tid",
    "strip_api_version",
]

KNOWN_SCHEMA_VERSIONS: tuple[str, ...] = ("3.0.0", "3.16.1", "3.25.0", "3.28.1")
SUPPORTED_MAJOR = 3

_ID24 = 0xFFFFFF
_U64 = 1 << 64
_SQLITE_MAGIC = b"SQLite format 3\x00"

# NCCL payload schema entry name -> output column. Matching by name (not schema id) keeps this
# valid across NCCL releases, whose schema and enum ids shift (log-formats.md §9).
NCCL_ENTRY_COLUMNS: dict[str, str] = {
    "Message size [bytes]": "nccl_message_bytes",
    "Bytes": "nccl_message_bytes",
    "NCCL communicator ID": "nccl_comm_id",
    "Root": "nccl_root",
    "Peer rank": "nccl_peer",
    "Reduction operation": "nccl_redop",
    "Rank": "nccl_rank",
    "No. of ranks": "nccl_nranks",
    "CUDA device": "nccl_cuda_dev",
    "Color": "nccl_color",
    "color": "nccl_color",
    "Key": "nccl_key",
    "key": "nccl_key",
    "Parent NCCL communicator ID": "nccl_parent_comm_id",
}
# ncclRedOp_t values of NVTX enum entry names (JSON payloads may carry names).
_REDOP_VALUES = {"sum": 0, "product": 1, "prod": 1, "max": 2, "min": 3, "avg": 4}

# NVTX payload entry type id -> little-endian struct code (nvToolsExtPayload.h, LP64).
_NVTX_TYPE_FMT: dict[int, str] = {
    1: "b", 2: "B", 3: "h", 4: "H", 5: "i", 6: "I", 7: "q", 8: "Q", 9: "q", 10: "Q",
    11: "b", 12: "B", 13: "h", 14: "H", 15: "i", 16: "I", 17: "q", 18: "Q",
    19: "f", 20: "d", 22: "Q", 23: "Q", 43: "f", 44: "d",
    68: "I", 69: "I", 70: "Q", 73: "I", 74: "Q",
}  # fmt: skip
_ENUM_SIZE_FMT = {1: "b", 2: "h", 4: "i", 8: "q"}

# NVTX eventType values returned by nvtx() by default: marks and ranges (not domain/category
# definitions or thread names, which are metadata rows).
NVTX_RANGE_EVENT_TYPES: tuple[int, ...] = (34, 59, 60, 70, 71)

_ENUM_ALIASES = {
    "ENUM_CUDA_KERNEL_LAUNCH_TYPE": ("ENUM_CUDA_KERNEL_LAUNCH_TYPE", "ENUM_CUDA_KRENEL_LAUNCH_TYPE"),
    "ENUM_CUDA_KRENEL_LAUNCH_TYPE": ("ENUM_CUDA_KRENEL_LAUNCH_TYPE", "ENUM_CUDA_KERNEL_LAUNCH_TYPE"),
}

_DYNAMIC_RE = re.compile(r"^DYNAMIC_NVTXPAYLOAD_DATATYPE_(-?\d+)_(\d+)_(\d+)$")
_API_VERSION_RE = re.compile(r"_v\d+$")



class NsysFormatError(ValueError):
    """The file is not a usable nsys SQLite export. The message names the file, what is wrong
    and what to do about it."""


class NsysSchemaWarning(UserWarning):
    """The export's schema version is not one nccltrace was tested with (features are detected)."""


class NsysDataWarning(UserWarning):
    """Rows of an otherwise readable export were left out (damaged or duplicated kernel rows), or the
    export has no kernels at all. The message names the file, what was skipped and what to do."""


class _KernelScan:
    """State of one kernel read carried across batches: the last row id (launch-join repeats), the
    keys of the last start time's rows (exact duplicates), and what was skipped."""

    def __init__(self) -> None:
        self.prev_rowid: int | None = None
        self.carry_start: int | None = None
        self.carry: set[tuple[int, ...]] = set()
        self.damaged: Counter[str] = Counter()
        self.duplicates = 0

    def first_of_duplicates(self, m: np.ndarray, start_col: int) -> np.ndarray:
        """Mask of rows of ``m`` (rowid first, ordered by start) that are not an exact copy of an
        earlier row. Copies share a start time, so only rows whose start repeats are compared."""
        n = len(m)
        keep = np.ones(n, dtype=bool)
        if not n:
            return keep
        start = m[:, start_col]
        cand = np.zeros(n, dtype=bool)
        eq = start[1:] == start[:-1]
        cand[1:] |= eq
        cand[:-1] |= eq
        cand |= start == start[-1]  # carried into the next batch
        if self.carry_start is not None:
            cand |= start == self.carry_start
        seen = set(self.carry)
        for i in np.flatnonzero(cand).tolist():
            key = tuple(m[i, 1:].tolist())  # every column but the rowid
            if key in seen:
                keep[i] = False
            else:
                seen.add(key)
        last = int(start[-1])
        self.carry = {k for k in seen if k[start_col - 1] == last}
        self.carry_start = last
        return keep


# --------------------------------------------------------------------------- helpers


def _bits(global_id: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(global_id, pd.Series):
        # Nullable Int64: shift the int64 payload, keep the NA mask.
        mask = global_id.isna().to_numpy()
        vals = global_id.to_numpy(dtype=np.int64, na_value=0)
        out = pd.arrays.IntegerArray(fn(vals).astype(np.int64), mask)
        return pd.Series(out, index=global_id.index, name=global_id.name)
    return fn(global_id)


def decode_pid(global_id: Any) -> Any:
    """PID bits of a serialized globalTid/globalPid: ``(id >> 24) & 0xFFFFFF``.

    Accepts an int, a numpy int64 array or a pandas (nullable) integer Series. Arithmetic shift
    plus mask stays correct when a HW byte >= 0x80 makes the stored int64 negative (unlike the
    ``id / 0x1000000 % 0x1000000`` form)."""
    return _bits(global_id, lambda v: (v >> 24) & _ID24)


def decode_tid(global_tid: Any) -> Any:
    """TID bits of a serialized globalTid: ``id & 0xFFFFFF`` (int, numpy array or Series)."""
    return _bits(global_tid, lambda v: v & _ID24)


def strip_api_version(name: str | None) -> str | None:
    """``cudaLaunchKernel_v7000`` -> ``cudaLaunchKernel`` (nsys appends the API version)."""
    return None if name is None else _API_VERSION_RE.sub("", name)


def _unsigned(v: int | None) -> int | None:
    return None if v is None else v % _U64


def _sanitize(name: str) -> str:
    # Same rule as the writer's sanitize_column_name (kept local so the reader stands alone).
    out = re.sub(r"[^0-9A-Za-z_]", "_", name)
    return out if out and not out[0].isdigit() else "_" + out


def _as_int(v: Any) -> int | None:
    """An SQLite INTEGER value, or None for NULL and for any other storage class (a damaged value:
    text, a blob or a real where the schema has an integer)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _as_text(v: Any) -> str | None:
    """An SQLite TEXT value; a damaged value of another storage class as text (bytes decoded)."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).decode("utf-8", "replace")
    return str(v)


def _column(values: Sequence[Any], kind: str, name: str) -> Any:
    # Fast conversions first; a value of the wrong storage class (damaged file) reads as NULL/NaN,
    # or as text for text columns, instead of failing the whole read.
    if kind == "int64":
        arr = np.asarray(values)
        if arr.dtype.kind == "i" or not len(arr):  # not dtype=int64 directly: it would truncate a real
            return arr.astype(np.int64)
        # NULL in a column that the schema declares NOT NULL: keep the rows, allow NA.
        return pd.array([_as_int(v) for v in values], dtype="Int64")
    if kind == "Int64":
        try:
            return pd.array(list(values), dtype="Int64")
        except (TypeError, ValueError, OverflowError):
            return pd.array([_as_int(v) for v in values], dtype="Int64")
    if kind == "UInt64":
        return pd.array([_unsigned(_as_int(v)) for v in values], dtype="UInt64")
    if kind == "float64":
        try:
            return np.array(values, dtype=np.float64)
        except (TypeError, ValueError):
            return np.array([v if isinstance(v, (int, float)) else None for v in values], dtype=np.float64)
    # Explicit object dtype: pandas >= 3 would otherwise infer its NaN-based "str" dtype.
    arr = np.empty(len(values), dtype=object)
    arr[:] = [v if v is None or isinstance(v, str) else _as_text(v) for v in values]
    return pd.Series(arr, dtype=object, copy=False)


def _frame(columns: dict[str, Sequence[Any]], spec: list[tuple[str, str]]) -> pd.DataFrame:
    """DataFrame with exactly ``spec``'s columns and dtypes (missing columns are all-NULL)."""
    n = len(next(iter(columns.values()))) if columns else 0
    data = {}
    for name, kind in spec:
        vals = columns.get(name)
        col = _column(vals if vals is not None else [None] * n, kind, name)
        data[name] = col if isinstance(col, pd.Series) else pd.Series(col, copy=False)
    return pd.DataFrame(data, index=pd.RangeIndex(n), copy=False)


def _rows_to_columns(rows: list[tuple], names: Sequence[str]) -> dict[str, Sequence[Any]]:
    if not rows:
        return {n: [] for n in names}
    return dict(zip(names, zip(*rows)))


def _null_columns(spec: list[tuple[str, str]], n: int) -> dict[str, Any]:
    """All-null columns of ``spec`` for a frame of ``n`` rows."""
    return {name: pd.array([None] * n, dtype=kind if kind != "object" else object) for name, kind in spec}


# --------------------------------------------------------------------------- reader


class NsysExport:
    """An opened nsys SQLite export (read-only). Create with :meth:`open`.

    Attributes:
        path: The file.
        schema_version: ``EXPORT_SCHEMA_VERSION`` (e.g. ``"3.0.0"``).
        product_version: ``EXPORT_PRODUCT_VERSION`` (e.g. ``"2022.4.2.1"``), ``""`` if absent.
        hostname: ``TARGET_INFO_SYSTEM_ENV`` ``Hostname`` value, or None.
        session_start_utc_ns: ``TARGET_INFO_SESSION_START_TIME.utcEpochNs``, or None.
        time_normalized: True if exported with ``--ts-normalize=true`` (timestamps already UTC ns).
        time_shift_ns: ``--ts-shift`` offset recorded in the metadata, or None.
        metadata: All rows of the metadata table (name -> value).
    """

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        # Use NsysExport.open(); this only sets up state.
        self.path = path
        self._conn = conn
        self._table_cols: dict[str, list[str]] = {}
        self._payload_schema_cache: dict[tuple[int, int], list[tuple[str, str, int]]] | None = None
        self._payload_size_cache: dict[tuple[int, int], int] = {}
        self.metadata: dict[str, str | None] = {}
        self.schema_version = ""
        self.product_version = ""
        self.hostname: str | None = None
        self.session_start_utc_ns: int | None = None
        # The target clock's reading at the session's start (systemClockNs, nsys >= 2025 exports, whose
        # stored times are on the host's monotonic clock); None for session-relative exports.
        self.session_start_clock_ns: int | None = None
        self.analysis_start_ns: int | None = None
        self.time_base_note: str | None = None
        self.time_normalized = False
        self.time_shift_ns: int | None = None
        self.undecoded_payload_blobs: int | None = None  # set by nvtx(): blobs present but not decodable
        # Set by each kernels()/iter_kernels() read: kernel rows left out {"damaged": n, "duplicate": n}.
        self.skipped_kernel_rows: dict[str, int] | None = None
        self._kernel_records: int | None = None
        # Set by export_tables(): NcclApiCalls.summary() of the nccl_api_calls table it wrote.
        self.nccl_api_summary: dict[str, Any] | None = None
        self._tables: set[str] = set()

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, integrity_check: bool = False) -> NsysExport:
        """Open and validate an export.

        Checks, each failing with :class:`NsysFormatError`: the file exists and is non-empty, has
        the SQLite header, is not shorter than its header says (truncated copy), can be read
        (``integrity_check=True`` additionally runs ``PRAGMA quick_check``, which reads every
        page), has ``META_DATA_EXPORT``/``EXPORT_META_DATA`` with a schema version of major 3,
        and has ``StringIds``. Unknown minor/micro versions only warn (:class:`NsysSchemaWarning`).
        """
        p = Path(path)
        _check_file(p)
        try:
            # immutable=1: no file locking, which is unreliable on the network/parallel file
            # systems exports usually live on; an export is never modified after it is written.
            conn = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
        except sqlite3.Error as e:
            raise NsysFormatError(f"{p}: cannot open as SQLite ({e}); check permissions and that it is a file") from e
        # Invalid UTF-8 in a text column (e.g. a user NVTX string) must not abort reading.
        conn.text_factory = lambda raw: raw.decode("utf-8", "replace")
        self = cls(p, conn)
        try:
            self._load(integrity_check)
        except BaseException:
            conn.close()
            raise
        return self

    def _load(self, integrity_check: bool) -> None:
        p = self.path
        with self._errors("the table list"):
            rows = self._conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")
            self._tables = {r[0] for r in rows}
            if integrity_check:
                bad = [r[0] for r in self._conn.execute("PRAGMA quick_check")]
                if bad != ["ok"]:
                    raise NsysFormatError(
                        f"{p}: SQLite integrity check failed ({'; '.join(bad[:3])}); the file is corrupt or "
                        "truncated - copy it again or re-run `nsys export --type sqlite`"
                    )
        meta_table = next((t for t in ("META_DATA_EXPORT", "EXPORT_META_DATA") if t in self._tables), None)
        if meta_table is None:
            raise NsysFormatError(
                f"{p}: no META_DATA_EXPORT or EXPORT_META_DATA table, so this SQLite file is not an nsys "
                "export (or a very old one); create it with `nsys export --type sqlite <report>.nsys-rep`"
            )
        with self._errors(meta_table):
            for name, value in self._conn.execute(f"SELECT name, value FROM {meta_table}"):
                self.metadata.setdefault(_as_text(name), _as_text(value))
        version = self.metadata.get("EXPORT_SCHEMA_VERSION")
        if not version and self.metadata.get("EXPORT_SCHEMA_VERSION_MAJOR") is not None:
            parts = (self.metadata.get(f"EXPORT_SCHEMA_VERSION_{k}") or 0 for k in ("MAJOR", "MINOR", "MICRO"))
            version = ".".join(str(x) for x in parts)
        m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", (version or "").strip())
        if m is None:
            raise NsysFormatError(
                f"{p}: {meta_table} has no valid EXPORT_SCHEMA_VERSION (got {version!r}); the export is "
                "incomplete - re-run `nsys export --type sqlite`"
            )
        if int(m.group(1)) != SUPPORTED_MAJOR:
            raise NsysFormatError(
                f"{p}: nsys export schema {version} has major version {m.group(1)}, but only major "
                f"{SUPPORTED_MAJOR} (e.g. {', '.join(KNOWN_SCHEMA_VERSIONS)}) is supported; re-export with an nsys "
                "release that writes schema 3.x or update nccltrace"
            )
        self.schema_version = version.strip()
        if self.schema_version not in KNOWN_SCHEMA_VERSIONS:
            warnings.warn(
                NsysSchemaWarning(
                    f"{p}: nsys export schema {self.schema_version} was not tested (known: "
                    f"{', '.join(KNOWN_SCHEMA_VERSIONS)}); tables and columns are feature-detected"
                ),
                stacklevel=3,
            )
        self.product_version = self.metadata.get("EXPORT_PRODUCT_VERSION") or ""
        if "StringIds" not in self._tables:
            raise NsysFormatError(
                f"{p}: the StringIds table is missing, so kernel/API/NVTX names cannot be resolved; the "
                "export is incomplete or was made with --separate-strings - re-run `nsys export --type sqlite`"
            )
        self.time_normalized = str(self.metadata.get("EXPORT_PARAM_TIME_NORMALIZE", "")).strip().lower() == "true"
        # Only the export-time --ts-shift moved the stored timestamps; EXPORT_CONFIG_TIME_SHIFT is a
        # capture setting and is not applied to the rows again here.
        shift = self.metadata.get("EXPORT_PARAM_TIME_SHIFT")
        with contextlib.suppress(TypeError, ValueError):
            self.time_shift_ns = int(shift) if shift not in (None, "") else None
        if "TARGET_INFO_SYSTEM_ENV" in self._tables:
            with self._errors("TARGET_INFO_SYSTEM_ENV"):
                sql = "SELECT value FROM TARGET_INFO_SYSTEM_ENV WHERE name = 'Hostname' LIMIT 1"
                row = self._conn.execute(sql).fetchone()
            self.hostname = _as_text(row[0]) if row else None
        if "TARGET_INFO_SESSION_START_TIME" in self._tables:
            clock = "systemClockNs" if "systemClockNs" in self.columns("TARGET_INFO_SESSION_START_TIME") else "NULL"
            with self._errors("TARGET_INFO_SESSION_START_TIME"):
                row = self._conn.execute(
                    f"SELECT utcEpochNs, {clock} FROM TARGET_INFO_SESSION_START_TIME LIMIT 1").fetchone()
            for value, name in zip(row or (), ("utcEpochNs", "systemClockNs"), strict=False):
                if value is not None and _as_int(value) is None:
                    raise NsysFormatError(
                        f"{p}: TARGET_INFO_SESSION_START_TIME.{name} is {value!r}, not an integer, so stored times "
                        "cannot be put on the UTC clock; the export is corrupt - re-run `nsys export --type sqlite`"
                    )
            self.session_start_utc_ns = _as_int(row[0]) if row else None
            self.session_start_clock_ns = _as_int(row[1]) if row and row[1] is not None else None
        self._check_time_base()

    def _check_time_base(self) -> None:
        """Cross-check the two anchors of the session's start on the target's clock: nsys >= 2025
        stores times on the host's monotonic clock and records the session's start there twice
        (``TARGET_INFO_SESSION_START_TIME.systemClockNs`` and ``ANALYSIS_DETAILS.startTime``);
        a disagreement is named in :attr:`time_base_note` (``systemClockNs`` is used)."""
        self.analysis_start_ns = None
        if "ANALYSIS_DETAILS" in self._tables and "startTime" in self.columns("ANALYSIS_DETAILS"):
            with self._errors("ANALYSIS_DETAILS"):
                row = self._conn.execute("SELECT startTime FROM ANALYSIS_DETAILS LIMIT 1").fetchone()
            self.analysis_start_ns = _as_int(row[0]) if row else None
        clock, start = self.session_start_clock_ns, self.analysis_start_ns
        if clock is not None and start is not None and clock != start:
            self.time_base_note = (
                f"{self.path.name}: the session's start on the target clock is recorded twice and the records "
                f"disagree (systemClockNs {clock} ns, ANALYSIS_DETAILS.startTime {start} ns, "
                f"{abs(clock - start) / 1e9:.3f} s apart): systemClockNs is used as the time base; a capture started with a delay (nsys --delay) starts "
                "its trace later than its session")

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Turn SQLite errors (corrupt/truncated pages are only hit when read) into NsysFormatError."""
        try:
            yield
        except sqlite3.DatabaseError as e:
            if re.match(r"no such (column|table)", str(e)):
                raise NsysFormatError(
                    f"{self.path}: {what} is not laid out as an nsys export ({e}); the file was modified or made "
                    "by an unsupported tool - re-run `nsys export --type sqlite` on the report"
                ) from e
            raise NsysFormatError(
                f"{self.path}: SQLite error while reading {what} ({e}); the file is probably truncated or "
                "corrupt - copy it again or re-run `nsys export --type sqlite`"
            ) from e
        except UnicodeDecodeError as e:
            # sqlite3 decodes SQLite's error message as UTF-8; a corrupt schema page puts raw bytes in it.
            detail = e.object.decode("utf-8", "replace") if isinstance(e.object, bytes) else str(e)
            raise NsysFormatError(
                f"{self.path}: SQLite error while reading {what} ({detail}); the file is corrupt - copy it again "
                "or re-run `nsys export --type sqlite`"
            ) from e

    # ------------------------------------------------------------------ basics

    def close(self) -> None:
        """Close the underlying SQLite connection."""
        self._conn.close()

    def __enter__(self) -> NsysExport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NsysExport({str(self.path)!r}, schema={self.schema_version}, product={self.product_version})"

    @property
    def utc_offset_ns(self) -> int | None:
        """Add to a stored timestamp to get UTC epoch ns.

        Stored times are ``session time + shift`` (``--ts-shift``), or ``UTC + shift`` for
        time-normalized exports; the shift is removed here. Exports that record the session's
        start on the target clock (``systemClockNs``, nsys >= 2025) store times on that clock:
        UTC(t) = ``utcEpochNs`` + t - ``systemClockNs``. None without a session anchor.
        """
        shift = self.time_shift_ns or 0
        if self.time_normalized:
            return -shift
        if self.session_start_utc_ns is None:
            return None
        # stored on the host's monotonic clock (systemClockNs recorded): the session starts there
        return self.session_start_utc_ns - (self.session_start_clock_ns or 0) - shift

    def table_names(self) -> set[str]:
        """Names of all tables (and views) in the file."""
        return set(self._tables)

    def columns(self, table: str) -> list[str]:
        """Column names of ``table`` (empty if the table does not exist)."""
        cols = self._table_cols.get(table)
        if cols is None:
            cols = []
            if table in self._tables:
                with self._errors(table):
                    cols = [r[1] for r in self._conn.execute(f'PRAGMA table_info("{table}")')]
            self._table_cols[table] = cols
        return cols

    def _col(self, table: str, alias: str, name: str) -> str:
        return f"{alias}.{name}" if name in self.columns(table) else "NULL"

    def _query(self, sql: str, params: Sequence[Any] = (), what: str = "") -> list[tuple]:
        with self._errors(what or "the export"):
            return self._conn.execute(sql, params).fetchall()

    def enum_table(self, name: str) -> pd.DataFrame:
        """Rows (id, name, label) of an ``ENUM_*`` table; accepts both spellings of names that
        nsys fixed later (``ENUM_CUDA_KRENEL_LAUNCH_TYPE`` in 3.0.0). Empty if absent."""
        spec = [("id", "int64"), ("name", "object"), ("label", "object")]
        rows: list[tuple] = []
        for candidate in _ENUM_ALIASES.get(name, (name,)):
            if candidate in self._tables:
                rows = self._query(f'SELECT id, name, label FROM "{candidate}" ORDER BY id', what=candidate)
                break
        return _frame(_rows_to_columns(rows, ["id", "name", "label"]), spec)

    # ------------------------------------------------------------------ kernels

    # Raw kernel columns, all integers: names stay StringIds ids and PID/TID bits are decoded in
    # numpy afterwards. Each row is fetched as ONE printf()-formatted text line and parsed with
    # numpy, which is several times faster and lighter than materialising ~25 Python ints per row.
    _KERNEL_RAW = ["_rowid", "start", "end", "device_id", "context_id", "stream_id", "correlation_id", "global_pid",
                   "_name_id", "_short_id", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
                   "registers_per_thread", "static_shared_memory", "dynamic_shared_memory", "green_context_id",
                   "launch_start", "launch_end", "launch_global_tid", "_api_id", "launch_event_class",
                   "graph_id", "graph_node_id"]  # fmt: skip
    # Stand-in for NULL in the text rows (INT64_MIN: HW byte 0x80 with VM/PID/TID 0, never a real id).
    _NULL = -(1 << 63)
    # Columns every kernel row has (NOT NULL in the nsys schemas; int64 in KERNEL_COLUMNS) plus its name.
    # A row where one is NULL or not an integer (a damaged or edited export) is skipped and counted,
    # never returned with a wrong or missing value.
    _KERNEL_REQUIRED = (*[name for name, kind in KERNEL_COLUMNS if kind == "int64"], "_name_id")
    _LAUNCH_COLUMNS = ("correlationId", "globalTid", "start", "end", "nameId")

    def _kernel_sql(self, name_like: str | None) -> tuple[str, list[Any]]:
        k = "CUPTI_ACTIVITY_KIND_KERNEL"
        needed = ["start", "end", "deviceId", "contextId", "streamId", "globalPid", "demangledName", "shortName",
                  "gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ", "registersPerThread",
                  "staticSharedMemory", "dynamicSharedMemory"]  # fmt: skip
        missing = [c for c in needed if c not in self.columns(k)]
        if missing:
            raise NsysFormatError(f"{self.path}: {k} lacks column(s) {missing}; this export layout is not supported - "
                                  "re-export the report with `nsys export --type sqlite`")
        corr = self._col(k, "k", "correlationId")
        rt = "CUPTI_ACTIVITY_KIND_RUNTIME"
        if rt in self._tables and corr != "NULL":
            missing = [c for c in self._LAUNCH_COLUMNS if c not in self.columns(rt)]
            if missing:
                raise NsysFormatError(f"{self.path}: {rt} lacks column(s) {missing}, so kernels cannot be joined to "
                                      "their launch calls; re-export the report with `nsys export --type sqlite`")
            # correlationId is unique per process only, so join on it AND the process bits
            # (SQLite builds an automatic index on the runtime table for this join).
            launch = f"""LEFT JOIN {rt} r
                   ON r.correlationId = k.correlationId
                  AND (r.globalTid & {GPID_MASK}) = (k.globalPid & {GPID_MASK})"""
            event_class = self._col(rt, "r", "eventClass")
            launch_cols = ["r.start", "r.end", "r.globalTid", "r.nameId", event_class]
            order = "ORDER BY k.start, k.rowid, r.start"
        else:
            launch, launch_cols, order = "", ["NULL"] * 5, "ORDER BY k.start, k.rowid"
        where, params = "", []
        if name_like is not None:
            # Rows whose name cannot be resolved are selected too, to be counted as damaged rather
            # than silently left out by the name filter.
            where = """WHERE k.demangledName IN (SELECT id FROM StringIds WHERE value LIKE ?)
                          OR k.shortName IN (SELECT id FROM StringIds WHERE value LIKE ?)
                          OR k.demangledName IS NULL
                          OR k.demangledName NOT IN (SELECT id FROM StringIds WHERE value IS NOT NULL)"""
            params = [name_like, name_like]
        exprs = ["k.rowid", "k.start", "k.end", "k.deviceId", "k.contextId", "k.streamId", corr, "k.globalPid",
                 "k.demangledName", "k.shortName", "k.gridX", "k.gridY", "k.gridZ", "k.blockX", "k.blockY", "k.blockZ",
                 "k.registersPerThread", "k.staticSharedMemory", "k.dynamicSharedMemory",
                 self._col(k, "k", "greenContextId"), *launch_cols,
                 self._col(k, "k", "graphId"), self._col(k, "k", "graphNodeId")]  # fmt: skip
        fmt = ",".join(["%lld"] * len(exprs))
        # Only INTEGER values are values here: CAST would turn text or a blob into 0 and a real into
        # a clamped integer, i.e. a plausible wrong value; anything else reads as NULL.
        args = ", ".join(f"CASE WHEN typeof({e}) = 'integer' THEN {e} ELSE {self._NULL} END" for e in exprs)
        sql = f"""
        SELECT printf('{fmt}', {args})
        FROM {k} k
        {launch}
        {where}
        {order}"""
        return sql, params

    def _parse_int_rows(self, rows: list[tuple], ncols: int) -> np.ndarray:
        if not rows:
            return np.empty((0, ncols), dtype=np.int64)
        flat = np.fromstring(",".join([r[0] for r in rows]), dtype=np.int64, sep=",")
        if flat.size != len(rows) * ncols:
            raise NsysFormatError(f"{self.path}: unexpected non-integer values in the kernel/runtime tables; the "
                                  "export is corrupt - re-run `nsys export --type sqlite`")
        return flat.reshape(len(rows), ncols)

    def _strings(self, ids: np.ndarray) -> dict[int, str]:
        """StringIds values for the given ids (queried in chunks to respect SQLite's variable limit)."""
        out: dict[int, str] = {}
        uniq = [int(i) for i in np.unique(ids)]
        for i in range(0, len(uniq), 500):
            chunk = uniq[i : i + 500]
            marks = ", ".join("?" * len(chunk))
            rows = self._query(f"SELECT id, value FROM StringIds WHERE id IN ({marks})", chunk, "StringIds")
            out.update((i, _as_text(v)) for i, v in rows)
        return out

    def _resolve_strings(self, ids: np.ndarray, transform: Callable[[str], str | None] | None = None) -> pd.Series:
        """Map StringIds ids (``_NULL`` = missing) to an object Series of strings."""
        if not len(ids):
            return pd.Series([], dtype=object)
        uniq, inverse = np.unique(ids, return_inverse=True)
        lut = self._strings(uniq[uniq != self._NULL])
        values = np.empty(len(uniq), dtype=object)
        for j, sid in enumerate(uniq.tolist()):
            v = lut.get(sid)
            values[j] = transform(v) if (transform is not None and v is not None) else v
        return pd.Series(values[inverse], dtype=object)

    def _kernel_frame(self, rows: list[tuple], scan: _KernelScan | None = None) -> pd.DataFrame:
        scan = scan if scan is not None else _KernelScan()
        m = self._parse_int_rows(rows, len(self._KERNEL_RAW))
        col = {name: j for j, name in enumerate(self._KERNEL_RAW)}
        rowid = m[:, 0]
        # A kernel matching several runtime rows (not expected: correlationId is unique per
        # process) would repeat; rows are ordered by (start, rowid, launch start), keep the first.
        keep = np.ones(len(rowid), dtype=bool)
        if len(rowid):
            keep[1:] = rowid[1:] != rowid[:-1]
            if scan.prev_rowid is not None:
                keep[0] = rowid[0] != scan.prev_rowid
            scan.prev_rowid = int(rowid[-1])
        m = m[keep]
        names = self._resolve_strings(m[:, col["_name_id"]])
        damaged = names.isna().to_numpy().copy()
        scan.damaged["name (not in StringIds)"] += int(damaged.sum())
        for name in self._KERNEL_REQUIRED[:-1]:
            bad = (m[:, col[name]] == self._NULL) & ~damaged
            scan.damaged[name] += int(bad.sum())
            damaged |= bad
        keep = ~damaged & scan.first_of_duplicates(m, col["start"])
        scan.duplicates += int((~damaged).sum() - keep.sum())
        m, names = m[keep], names[keep].reset_index(drop=True)
        data: dict[str, Any] = {}
        for name, kind in KERNEL_COLUMNS:
            if name in col:
                v = m[:, col[name]]
                null = v == self._NULL
                if name in ("graph_id", "graph_node_id"):
                    null = null | (v == 0)  # CUPTI: 0 = not launched through a graph launch API
                if null.any() or kind != "int64":
                    data[name] = pd.arrays.IntegerArray(np.where(null, 0, v), null)
                else:
                    data[name] = v
        data["pid"] = decode_pid(pd.Series(data["global_pid"])).array
        data["launch_tid"] = decode_tid(pd.Series(data["launch_global_tid"])).array
        data["name"] = names
        data["short_name"] = self._resolve_strings(m[:, col["_short_id"]])
        data["launch_api"] = self._resolve_strings(m[:, col["_api_id"]], strip_api_version)
        columns = {name: pd.Series(data[name], copy=False).reset_index(drop=True) for name, _ in KERNEL_COLUMNS}
        return pd.DataFrame(columns, index=pd.RangeIndex(len(m)), copy=False)

    def _report_skipped(self, scan: _KernelScan) -> None:
        """Record (``skipped_kernel_rows``) and warn about kernel rows a read left out."""
        damaged = {k: v for k, v in scan.damaged.items() if v}
        self.skipped_kernel_rows = {"damaged": sum(damaged.values()), "duplicate": scan.duplicates}
        if damaged:
            what = ", ".join(f"{k}: {v}" for k, v in sorted(damaged.items()))
            warnings.warn(NsysDataWarning(
                f"{self.path}: {sum(damaged.values())} kernel row(s) skipped because a required value is NULL, not "
                f"an integer or not in StringIds ({what}); the export is damaged - the other kernels are intact, "
                "re-run `nsys export --type sqlite` to recover these"), stacklevel=3)
        if scan.duplicates:
            warnings.warn(NsysDataWarning(
                f"{self.path}: {scan.duplicates} duplicate kernel row(s) (identical in every column to another row) "
                "skipped; the export holds some rows twice (merged or imported twice?) - re-export it"), stacklevel=3)

    @property
    def kernel_records(self) -> int:
        """Rows in ``CUPTI_ACTIVITY_KIND_KERNEL`` (all kernels, damaged rows included); 0 when the table is
        missing. A zero-kernel export (nsys run without CUDA tracing, or a process that launched no kernel)
        reads as empty kernel frames; this tells it apart from a filter that matched nothing."""
        if self._kernel_records is None:
            k = "CUPTI_ACTIVITY_KIND_KERNEL"
            n = self._query(f"SELECT count(*) FROM {k}", what=k)[0][0] if k in self._tables else 0
            self._kernel_records = int(n)
        return self._kernel_records

    def kernels(self, name_like: str | None = "nccl%") -> pd.DataFrame:
        """One row per CUDA kernel, with the API call that launched it (see :data:`KERNEL_COLUMNS`).

        ``name_like`` is an SQL LIKE pattern (case-insensitive for ASCII) matched against the
        demangled or short kernel name; None returns all kernels. Rows are ordered by start.
        Launch columns are NA when no runtime row has the kernel's correlationId in the same
        process. Empty (with all columns) when the export has no kernel table (see :attr:`kernel_records`).
        Damaged rows (a required value NULL or not an integer, a name missing from StringIds) and exact
        duplicate rows are skipped with a :class:`NsysDataWarning` and counted in ``skipped_kernel_rows``.
        """
        if "CUPTI_ACTIVITY_KIND_KERNEL" not in self._tables:
            return self._kernel_frame([])
        sql, params = self._kernel_sql(name_like)
        scan = _KernelScan()
        frame = self._kernel_frame(self._query(sql, params, "CUPTI_ACTIVITY_KIND_KERNEL"), scan)
        self._report_skipped(scan)
        return frame

    def iter_kernels(self, name_like: str | None = "nccl%", batch_rows: int = 500_000) -> Iterator[pd.DataFrame]:
        """Like :meth:`kernels` but yields frames of at most ``batch_rows`` rows, so memory stays
        bounded for exports with millions of kernels. Yields nothing when there are no kernels."""
        if batch_rows <= 0:
            raise ValueError("batch_rows must be positive")
        if "CUPTI_ACTIVITY_KIND_KERNEL" not in self._tables:
            return
        sql, params = self._kernel_sql(name_like)
        scan = _KernelScan()
        with self._errors("CUPTI_ACTIVITY_KIND_KERNEL"):
            cur = self._conn.execute(sql, params)
            try:
                while rows := cur.fetchmany(batch_rows):
                    frame = self._kernel_frame(rows, scan)
                    if len(frame):
                        yield frame
            finally:
                cur.close()
        self._report_skipped(scan)

    # ------------------------------------------------------------------ runtime

    def runtime(self) -> pd.DataFrame:
        """CUDA runtime and driver API calls (``CUPTI_ACTIVITY_KIND_RUNTIME``), ordered by start.
        ``api`` is ``name`` without the ``_vNNNN`` version suffix."""
        t = "CUPTI_ACTIVITY_KIND_RUNTIME"
        names = [c for c, _ in RUNTIME_COLUMNS]
        if t not in self._tables:
            return _frame(_rows_to_columns([], names), RUNTIME_COLUMNS)
        rows = self._query(
            f"""SELECT r.start, r.end, {self._col(t, 'r', 'eventClass')}, r.globalTid, (r.globalTid >> 24) & 16777215,
                       r.globalTid & 16777215, r.correlationId, s.value, NULL, {self._col(t, 'r', 'returnValue')}
                FROM {t} r LEFT JOIN StringIds s ON s.id = r.nameId ORDER BY r.start, r.rowid""",
            what=t,
        )
        cols = _rows_to_columns(rows, names)
        cols["api"] = [strip_api_version(_as_text(v)) for v in cols["name"]]
        return _frame(cols, RUNTIME_COLUMNS)

    def launches_without_kernel(self) -> pd.DataFrame:
        """Kernel launch API calls whose kernel record is missing from the export (lost CUPTI
        activity records). Their position in the launch order is evidence for alignment: the
        launch happened, only the kernel's timing is unknown. Columns as :meth:`runtime`."""
        t = "CUPTI_ACTIVITY_KIND_RUNTIME"
        names = [c for c, _ in RUNTIME_COLUMNS]
        if t not in self._tables:
            return _frame(_rows_to_columns([], names), LAUNCH_COLUMNS)
        exists = ""
        k = "CUPTI_ACTIVITY_KIND_KERNEL"
        if k in self._tables:
            missing = [c for c in ("correlationId", "globalPid") if c not in self.columns(k)]
            if missing:
                raise NsysFormatError(f"{self.path}: {k} lacks column(s) {missing}, so launches cannot be matched to "
                                      "kernel records; re-export the report with `nsys export --type sqlite`")
            # non-correlated anti-join: SQLite builds the key set once (a correlated NOT EXISTS
            # scans the unindexed kernel table per launch)
            exists = f"""AND (r.correlationId, r.globalTid & {GPID_MASK}) NOT IN
                              (SELECT k.correlationId, k.globalPid & {GPID_MASK} FROM CUPTI_ACTIVITY_KIND_KERNEL k)"""
        rows = self._query(
            f"""SELECT r.start, r.end, {self._col(t, 'r', 'eventClass')}, r.globalTid, (r.globalTid >> 24) & 16777215,
                       r.globalTid & 16777215, r.correlationId, s.value, NULL, {self._col(t, 'r', 'returnValue')}
                FROM {t} r JOIN StringIds s ON s.id = r.nameId
                WHERE (s.value LIKE 'cudaLaunch%Kernel%' OR s.value LIKE 'cuLaunch%Kernel%') {exists}
                ORDER BY r.start, r.rowid""",
            what=t,
        )
        cols = _rows_to_columns(rows, names)
        cols["api"] = [strip_api_version(_as_text(v)) for v in cols["name"]]
        frame = _frame(cols, LAUNCH_COLUMNS)
        frame["capture_span"] = self._capture_spans(frame)
        return frame

    def _capture_spans(self, launches: pd.DataFrame) -> pd.Series:
        """Per launch, the stream capture it was made in (see :data:`LAUNCH_COLUMNS`)."""
        out = pd.Series(pd.NA, index=launches.index, dtype="Int64")
        if not len(launches):
            return out
        rows = self._query(
            """SELECT r.start, r.end, r.globalTid, s.value FROM CUPTI_ACTIVITY_KIND_RUNTIME r
               JOIN StringIds s ON s.id = r.nameId
               WHERE s.value LIKE 'cudaStreamBeginCapture%' OR s.value LIKE 'cuStreamBeginCapture%'
                  OR s.value LIKE 'cudaStreamEndCapture%' OR s.value LIKE 'cuStreamEndCapture%'
               ORDER BY r.start, r.rowid""",
            what="CUPTI_ACTIVITY_KIND_RUNTIME",
        )
        spans = []  # (global_tid, begin, end): a begin closed by the thread's next end
        open_at: dict[int, int] = {}
        for start, end, gtid, name in rows:
            if "BeginCapture" in _as_text(name):
                open_at[int(gtid)] = int(start)
            elif int(gtid) in open_at:
                spans.append((int(gtid), open_at.pop(int(gtid)), int(end)))
        if not spans:
            return out
        sp = pd.DataFrame(spans, columns=["global_tid", "begin", "end"]).sort_values("begin", kind="stable")
        sp["span"] = sp.groupby(sp["global_tid"].to_numpy(np.int64) >> 24).cumcount()  # per process, in time order
        gt = launches["global_tid"].astype("Int64")
        for tid, g in sp.groupby("global_tid"):
            on = (gt == tid).fillna(False).to_numpy(bool)
            if not on.any():
                continue
            st = launches.loc[on, "start"].to_numpy(np.int64)
            i = np.searchsorted(g["begin"].to_numpy(np.int64), st, side="right") - 1
            inside = (i >= 0) & (st <= g["end"].to_numpy(np.int64)[np.maximum(i, 0)])
            vals = np.where(inside, g["span"].to_numpy(np.int64)[np.maximum(i, 0)], -1)
            out.loc[launches.index[on]] = pd.array(np.where(vals >= 0, vals, 0), dtype="Int64")
            out.loc[launches.index[on][~inside]] = pd.NA
        return out

    # ------------------------------------------------------------------ NVTX

    def nvtx(
        self, domain: str | None = None, *, event_types: Sequence[int] | None = NVTX_RANGE_EVENT_TYPES
    ) -> pd.DataFrame:
        """NVTX marks and ranges (see :data:`NVTX_COLUMNS`), ordered by start.

        ``text`` is ``COALESCE(text, StringIds(textId))`` (ASCII vs registered strings). ``domain``
        is the domain name resolved per process from the ``eventType = 75`` row (None for the
        default domain); passing ``domain`` keeps only that domain. ``event_types`` selects
        eventType values (None = all rows, including domain/category definitions).

        NCCL extended payloads are decoded into the ``nccl_*`` columns from, in order of
        preference, dynamic payload tables, ``binaryData`` blobs and JSON text; schema entries are
        matched by name. ``payload_source`` says which one was used.
        """
        t = "NVTX_EVENTS"
        spec_names = [c for c, _ in NVTX_COLUMNS]
        if t not in self._tables:
            return _frame(_rows_to_columns([], spec_names), NVTX_COLUMNS)
        c = lambda name: self._col(t, "e", name)
        json_expr = c("jsonText")
        json_join = ""
        if "jsonTextId" in self.columns(t):
            json_expr = f"COALESCE({c('jsonText')}, js.value)"
            json_join = "LEFT JOIN StringIds js ON js.id = e.jsonTextId"
        # binaryData is declared TEXT; CAST keeps Python from decoding bytes stored as TEXT as UTF-8.
        blob_expr = "CAST(e.binaryData AS BLOB)" if "binaryData" in self.columns(t) else "NULL"
        text_expr = f"COALESCE({c('text')}, s.value)" if "textId" in self.columns(t) else c("text")
        text_join = "LEFT JOIN StringIds s ON s.id = e.textId" if "textId" in self.columns(t) else ""
        name_expr = "COALESCE(d.text, ds.value)" if "textId" in self.columns(t) else "d.text"
        name_join = "LEFT JOIN StringIds ds ON ds.id = d.textId" if "textId" in self.columns(t) else ""
        where, params = [], []
        if event_types is not None:
            where.append(f"e.eventType IN ({', '.join('?' * len(event_types))})")
            params.extend(int(x) for x in event_types)
        if domain is not None:
            where.append("dom.name = ?")
            params.append(domain)
        if "domainId" in self.columns(t) and "category" in self.columns(t):
            # Domain and category ids are per process: resolve names on (process bits, id).
            name_joins = f"""
            LEFT JOIN (SELECT d.globalTid & {GPID_MASK} AS gp, d.domainId AS did, {name_expr} AS name, MIN(d.start)
                       FROM {t} d {name_join} WHERE d.eventType = 75 GROUP BY gp, did) dom
                   ON dom.gp = (e.globalTid & {GPID_MASK}) AND dom.did = e.domainId
            LEFT JOIN (SELECT d.globalTid & {GPID_MASK} AS gp, d.domainId AS did, d.category AS cid,
                              {name_expr} AS name, MIN(d.start)
                       FROM {t} d {name_join} WHERE d.eventType = 33 GROUP BY gp, did, cid) cat
                   ON cat.gp = (e.globalTid & {GPID_MASK}) AND cat.did = e.domainId AND cat.cid = e.category"""
        else:  # very old layouts: nothing to resolve
            name_joins = "LEFT JOIN (SELECT NULL AS name) dom ON 0 LEFT JOIN (SELECT NULL AS name) cat ON 0"
        sql = f"""
        SELECT e.start, e.end, e.eventType, {text_expr}, dom.name, {c('domainId')}, {c('category')}, cat.name,
               {c('color')}, e.globalTid, (e.globalTid >> 24) & 16777215, e.globalTid & 16777215,
               {c('endGlobalTid')}, {c('rangeId')}, {c('eventId')},
               {c('uint64Value')}, {c('int64Value')}, {c('doubleValue')}, {json_expr}, {blob_expr}
        FROM {t} e
        {text_join}
        {json_join}
        {name_joins}
        {('WHERE ' + ' AND '.join(where)) if where else ''}
        ORDER BY e.start, e.rowid"""
        rows = self._query(sql, params, t)
        names = ["start", "end", "event_type", "text", "domain", "domain_id", "category", "category_name", "color",
                 "global_tid", "pid", "tid", "end_global_tid", "range_id", "event_id", "uint64_value",
                 "int64_value", "double_value", "json_text", "_blob"]  # fmt: skip
        cols = _rows_to_columns(rows, names)
        cols.update(self._decode_payloads(cols))
        return _frame(cols, NVTX_COLUMNS)

    def payload_schema_entries(self) -> pd.DataFrame:
        """Rows of ``NVTX_PAYLOAD_SCHEMA_ENTRIES`` (:data:`PAYLOAD_SCHEMA_ENTRY_COLUMNS`): the
        extended-payload schemas registered per NVTX domain id (the table has no process column).
        Empty when the export has no such table."""
        t = "NVTX_PAYLOAD_SCHEMA_ENTRIES"
        names = [c for c, _ in PAYLOAD_SCHEMA_ENTRY_COLUMNS]
        rows: list[tuple] = []
        if t in self._tables:
            cols = ", ".join(self._col(t, "s", c) for c in ("domainId", "schemaId", "idx", "type", "name"))
            off = 's."offset"' if "offset" in self.columns(t) else "NULL"
            rows = self._query(f"SELECT {cols}, {off} FROM {t} s ORDER BY 1, 2, 3", what=t)
        return _frame(_rows_to_columns(rows, names), PAYLOAD_SCHEMA_ENTRY_COLUMNS)

    def nccl_api_calls(self, *, nvtx: pd.DataFrame | None = None, kernels: pd.DataFrame | None = None,
                       lost_launches: pd.DataFrame | None = None) -> Any:  # fmt: skip
        """NCCL API call ranges linked to their kernels (:func:`nccltrace.nsys.nccl_api.nccl_api_calls`),
        reading whichever of ``nvtx()``, ``kernels()`` and ``launches_without_kernel()`` is not given.
        Returns an :class:`~nccltrace.nsys.nccl_api.NcclApiCalls`."""
        from nccltrace.nsys.nccl_api import nccl_api_calls

        nvtx = self.nvtx() if nvtx is None else nvtx  # nvtx() also sets undecoded_payload_blobs
        return nccl_api_calls(nvtx, self.kernels() if kernels is None else kernels,
                              lost_launches=self.launches_without_kernel() if lost_launches is None else lost_launches,
                              payload_schemas=self.payload_schema_entries(),
                              undecoded_payload_blobs=self.undecoded_payload_blobs)  # fmt: skip

    # ---- NCCL extended payloads

    def _payload_schemas(self) -> dict[tuple[int, int], list[tuple[str, str, int]]]:
        """(domainId, schemaId) -> [(entry name, struct code, offset)] from the payload tables."""
        if self._payload_schema_cache is not None:
            return self._payload_schema_cache
        out: dict[tuple[int, int], list[tuple[str, str, int]]] = {}
        if "NVTX_PAYLOAD_SCHEMA_ENTRIES" in self._tables:
            enum_fmt: dict[tuple[int, int], str] = {}
            if "NVTX_PAYLOAD_ENUMS" in self._tables:
                sql = "SELECT domainId, schemaId, size FROM NVTX_PAYLOAD_ENUMS"
                for dom, sid, size in self._query(sql, what="NVTX_PAYLOAD_ENUMS"):
                    enum_fmt[(dom, sid)] = _ENUM_SIZE_FMT.get(size or 4, "i")
            rows = self._query(
                'SELECT domainId, schemaId, idx, type, name, "offset" FROM NVTX_PAYLOAD_SCHEMA_ENTRIES '
                "ORDER BY domainId, schemaId, idx",
                what="NVTX_PAYLOAD_SCHEMA_ENTRIES",
            )
            for dom, sid, _idx, typ, name, offset in rows:
                fmt = _NVTX_TYPE_FMT.get(typ) or enum_fmt.get((dom, typ))
                if fmt is not None and name is not None and _as_int(offset) is not None:
                    out.setdefault((dom, sid), []).append((_as_text(name), fmt, offset))
        sizes: dict[tuple[int, int], int] = {}
        if "NVTX_PAYLOAD_SCHEMAS" in self._tables:
            sql = "SELECT domainId, schemaId, payloadSize FROM NVTX_PAYLOAD_SCHEMAS"
            for dom, sid, size in self._query(sql, what="NVTX_PAYLOAD_SCHEMAS"):
                if _as_int(size) is not None:
                    sizes[(dom, sid)] = size
        self._payload_schema_cache = out
        self._payload_size_cache = sizes
        return out

    def _dynamic_payloads(self) -> dict[int, dict[str, int]]:
        """eventId -> {nccl column: value} from DYNAMIC_NVTXPAYLOAD_DATATYPE_* tables."""
        tables = [t for t in self._tables if _DYNAMIC_RE.match(t)]
        if not tables:
            return {}
        translation: dict[str, str] = {}
        if "NVTX_EXPORT_TRANSLATION" in self._tables:
            sql = "SELECT originalName, sanitizedName FROM NVTX_EXPORT_TRANSLATION"
            for orig, san in self._query(sql, what="NVTX_EXPORT_TRANSLATION"):
                translation.setdefault(san, orig)
        # Fallback when a translation row is missing: sanitized form of every known entry name.
        for name in NCCL_ENTRY_COLUMNS:
            translation.setdefault(_sanitize(name), name)
        out: dict[int, dict[str, int]] = {}
        for table in sorted(tables):
            cols = self.columns(table)
            if "eventId" not in cols:
                continue
            picked = [(c, NCCL_ENTRY_COLUMNS.get(translation.get(c, c))) for c in cols if c != "eventId"]
            picked = [(c, target) for c, target in picked if target is not None]
            if not picked:
                continue
            sel = ", ".join(f'"{c}"' for c, _ in picked)
            for row in self._query(f'SELECT eventId, {sel} FROM "{table}"', what=table):
                vals = out.setdefault(row[0], {})
                for (_, target), v in zip(picked, row[1:]):
                    v = _as_int(v)  # a damaged (non-integer) value is left out like a NULL
                    if v is not None:
                        vals[target] = _unsigned(v) if NCCL_COLUMN_KINDS[target] == "UInt64" else v
        return out

    def _decode_blob(self, domain_id: int | None, blob: Any) -> dict[str, int] | None:
        """Decode nccltrace's binaryData layout: uint64 LE schema id, then the payload struct."""
        if not isinstance(blob, (bytes, bytearray, memoryview)) or len(blob) < 8 or domain_id is None:
            return None
        blob = bytes(blob)
        (sid,) = struct.unpack_from("<Q", blob, 0)
        entries = self._payload_schemas().get((domain_id, sid))
        # Exact size check: blobs with another header layout (real nsys' layout is undocumented)
        # are skipped instead of being decoded at wrong offsets.
        if entries is None or len(blob) != 8 + self._payload_size_cache.get((domain_id, sid), -1):
            return None
        out: dict[str, int] = {}
        for name, fmt, offset in entries:
            target = NCCL_ENTRY_COLUMNS.get(name)
            if target is None or 8 + offset + struct.calcsize(fmt) > len(blob):
                continue
            (v,) = struct.unpack_from("<" + fmt, blob, 8 + offset)
            out[target] = _unsigned(int(v)) if NCCL_COLUMN_KINDS[target] == "UInt64" else int(v)
        return out or None

    @staticmethod
    def _decode_json(text: Any) -> dict[str, int] | None:
        """Decode a JSON object keyed by NCCL payload entry names."""
        if not isinstance(text, str) or not text.lstrip().startswith("{"):
            return None
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        out: dict[str, int] = {}
        for key, v in obj.items() if isinstance(obj, dict) else ():
            target = NCCL_ENTRY_COLUMNS.get(key)
            if target is None or v is None:
                continue
            try:
                if isinstance(v, str) and target == "nccl_redop":
                    iv = _REDOP_VALUES[v.lower()]
                else:
                    iv = int(v)
            except (KeyError, TypeError, ValueError):
                continue
            out[target] = _unsigned(iv) if NCCL_COLUMN_KINDS[target] == "UInt64" else iv
        return out or None

    def _decode_payloads(self, cols: dict[str, Sequence[Any]]) -> dict[str, list[Any]]:
        n = len(cols["start"])
        out: dict[str, list[Any]] = {name: [None] * n for name in NCCL_COLUMN_KINDS}
        source: list[str | None] = [None] * n
        blobs = cols.pop("_blob")

        def fill(i: int, vals: dict[str, int] | None, src: str) -> None:
            if vals:
                for k, v in vals.items():
                    out[k][i] = v
                source[i] = src

        dyn = self._dynamic_payloads()
        if dyn:
            for i, eid in enumerate(cols["event_id"]):
                if eid is not None and eid in dyn:
                    fill(i, dyn[eid], "dynamic")
        decoders: list[tuple[Sequence[Any], Callable[[int, Any], dict[str, int] | None], str]] = [
            (blobs, lambda i, b: self._decode_blob(cols["domain_id"][i], b), "blob"),
            (cols["json_text"], lambda i, j: self._decode_json(j), "json"),
        ]
        for values, decode, src in decoders:
            for i, v in enumerate(values):
                if v is not None and source[i] is None:
                    fill(i, decode(i, v), src)
        undecoded = sum(1 for i, b in enumerate(blobs) if b is not None and source[i] is None)
        self.undecoded_payload_blobs = undecoded
        if undecoded:
            # Say so instead of leaving the payload columns silently empty.
            warnings.warn(
                NsysSchemaWarning(
                    f"{self.path}: {undecoded} NVTX extended-payload blob(s) could not be decoded (unknown byte "
                    "layout); their nccl_* columns are empty - re-export with --dynamic-tables=all or "
                    "--include-json=true if your nsys supports it"
                ),
                stacklevel=3,
            )
        out["payload_source"] = source
        return out

    # ------------------------------------------------------------------ processes, threads, GPUs

    def processes(self) -> pd.DataFrame:
        """Processes that own rows in CUDA runtime, kernel or NVTX tables (``PROCESSES`` lists
        every process on the machine), with their name from ``PROCESSES`` when known."""
        parts = []
        if "CUPTI_ACTIVITY_KIND_RUNTIME" in self._tables:
            parts.append(f"SELECT DISTINCT globalTid & {GPID_MASK} AS gp FROM CUPTI_ACTIVITY_KIND_RUNTIME")
        if "CUPTI_ACTIVITY_KIND_KERNEL" in self._tables:
            parts.append(f"SELECT DISTINCT globalPid & {GPID_MASK} AS gp FROM CUPTI_ACTIVITY_KIND_KERNEL")
        if "NVTX_EVENTS" in self._tables:
            parts.append(f"SELECT DISTINCT globalTid & {GPID_MASK} AS gp FROM NVTX_EVENTS")
        names = [c for c, _ in PROCESS_COLUMNS]
        if not parts:
            return _frame(_rows_to_columns([], names), PROCESS_COLUMNS)
        proc = "(SELECT NULL AS globalPid, NULL AS name)"
        if "PROCESSES" in self._tables:
            proc = "(SELECT globalPid, MIN(name) AS name FROM PROCESSES GROUP BY globalPid)"
        rows = self._query(
            f"""WITH owners(gp) AS ({' UNION '.join(parts)})
                SELECT o.gp, (o.gp >> 24) & 16777215 AS pid, p.name FROM owners o
                LEFT JOIN {proc} p ON p.globalPid = o.gp WHERE o.gp IS NOT NULL ORDER BY pid, o.gp""",
            what="PROCESSES",
        )
        return _frame(_rows_to_columns(rows, names), PROCESS_COLUMNS)

    def threads(self) -> pd.DataFrame:
        """Named threads from ``ThreadNames`` (global_tid, pid, tid, name, priority)."""
        names = [c for c, _ in THREAD_COLUMNS]
        if "ThreadNames" not in self._tables:
            return _frame(_rows_to_columns([], names), THREAD_COLUMNS)
        rows = self._query(
            """SELECT t.globalTid, (t.globalTid >> 24) & 16777215 AS pid, t.globalTid & 16777215 AS tid,
                      s.value, t.priority
               FROM ThreadNames t LEFT JOIN StringIds s ON s.id = t.nameId ORDER BY pid, tid""",
            what="ThreadNames",
        )
        return _frame(_rows_to_columns(rows, names), THREAD_COLUMNS)

    def gpus(self) -> pd.DataFrame:
        """GPUs from ``TARGET_INFO_GPU``; when ``TARGET_INFO_CUDA_DEVICE`` exists (3.28.1), one row
        per (GPU, process) mapping with the process-local CUDA ordinal ``cuda_id``."""
        names = [c for c, _ in GPU_COLUMNS]
        has_gpu = "TARGET_INFO_GPU" in self._tables
        has_map = "TARGET_INFO_CUDA_DEVICE" in self._tables
        rows: list[tuple] = []
        if has_gpu:
            g = "TARGET_INFO_GPU"
            cu = self._col(g, "g", "cuDevice")
            if has_map:
                rows = self._query(
                    f"""SELECT g.id, g.name, g.busLocation, g.uuid, {cu}, m.pid, m.cudaId FROM {g} g
                        LEFT JOIN TARGET_INFO_CUDA_DEVICE m ON m.gpuId = g.id
                        UNION ALL
                        SELECT m.gpuId, NULL, NULL, m.uuid, NULL, m.pid, m.cudaId FROM TARGET_INFO_CUDA_DEVICE m
                        WHERE m.gpuId IS NULL OR m.gpuId NOT IN (SELECT id FROM {g})
                        ORDER BY 1, 6, 7""",
                    what=g,
                )
            else:
                sql = f"SELECT g.id, g.name, g.busLocation, g.uuid, {cu}, NULL, NULL FROM {g} g ORDER BY g.id"
                rows = self._query(sql, what=g)
        elif has_map:
            rows = self._query(
                "SELECT gpuId, NULL, NULL, uuid, NULL, pid, cudaId FROM TARGET_INFO_CUDA_DEVICE ORDER BY 1, 6, 7",
                what="TARGET_INFO_CUDA_DEVICE",
            )
        return _frame(_rows_to_columns(rows, names), GPU_COLUMNS)

    # ------------------------------------------------------------------ export

    def session_info(self) -> dict[str, Any]:
        """Session metadata as written to ``session.json`` by :meth:`export_tables`."""
        digest = hashlib.sha256()
        with open(self.path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        return {
            "source_file": self.path.name,
            "source_sha256": digest.hexdigest(),
            "schema_version": self.schema_version,
            "product_version": self.product_version,
            "hostname": self.hostname,
            "session_start_utc_ns": self.session_start_utc_ns,
            "session_start_clock_ns": self.session_start_clock_ns,
            "time_base_note": self.time_base_note,
            "time_normalized": self.time_normalized,
            "time_shift_ns": self.time_shift_ns,
            "utc_offset_ns": self.utc_offset_ns,
            "undecoded_payload_blobs": self.undecoded_payload_blobs,
            # A zero-kernel export is readable but cannot be aligned: say so in the session record.
            "kernel_table": "CUPTI_ACTIVITY_KIND_KERNEL" in self._tables,
            "kernel_records": self.kernel_records,
            "skipped_kernel_rows": self.skipped_kernel_rows,
            # Counts of nccl_api_calls.parquet and the payload warning (None before export_tables).
            "nccl_api_calls": self.nccl_api_summary,
        }

    def export_tables(
        self, out_dir: str | os.PathLike[str], *, kernel_name_like: str | None = "nccl%"
    ) -> dict[str, Path]:
        """Write ``kernels.parquet`` (streamed), ``nvtx.parquet``, ``processes.parquet``,
        ``launches_without_kernel.parquet``, ``nccl_api_calls.parquet`` (NCCL API call ranges
        linked to their kernels, see :mod:`nccltrace.nsys.nccl_api`) and ``session.json`` into
        ``out_dir``; each file appears atomically (temp file + rename). Returns table name -> path.
        The summary of the NCCL API table is kept in :attr:`nccl_api_summary` and ``session.json``."""
        from nccltrace.nsys.nccl_api import (
            NCCL_API_CALLS_SCHEMA,
            nccl_api_calls,
            nccl_kernels,
        )

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {
            "kernels": out / KERNELS_FILE,
            "nvtx": out / NVTX_FILE,
            "processes": out / "processes.parquet",
            "launches_without_kernel": out / LAUNCHES_FILE,
            "nccl_api_calls": out / "nccl_api_calls.parquet",
            "session": out / SESSION_FILE,
        }
        schema = spec_schema(KERNEL_TABLE_COLUMNS)
        written = 0
        # The few columns linking NCCL kernels to their calls, kept while kernels stream to disk.
        link_cols = ["global_pid", "pid", "correlation_id", "stream_id", "launch_tid", "launch_start", "launch_end",
                     "short_name", "name"]  # fmt: skip
        links: list[pd.DataFrame] = []
        with parquet_writer(paths["kernels"], schema) as pw:
            for batch in self.iter_kernels(kernel_name_like):
                pw.write_table(frame_to_table(batch.assign(**_null_columns(KERNEL_ARG_COLUMNS, len(batch))), schema))
                written += len(batch)
                links.append(nccl_kernels(batch[link_cols]))
        if not written:
            # Empty kernels.parquet: say why, so an empty result is never taken for "no NCCL traffic".
            if self.kernel_records == 0:
                why = ("the export has no CUDA kernel records (CUPTI_ACTIVITY_KIND_KERNEL is missing or empty): was "
                       "`nsys profile` run with --trace=cuda and did the process launch kernels?")
            else:
                why = (f"none of its {self.kernel_records} kernel record(s) matches {kernel_name_like!r} (a process "
                       "without NCCL kernels, or every NCCL kernel row damaged)")
            warnings.warn(NsysDataWarning(f"{self.path}: kernels.parquet is empty: {why}; NCCL calls of this node "
                                          "cannot be matched to kernels"), stacklevel=2)
        nvtx, lost = self.nvtx(), self.launches_without_kernel()
        for key, frame, spec in (("nvtx", nvtx, NVTX_COLUMNS), ("processes", self.processes(), PROCESS_COLUMNS),
                                 ("launches_without_kernel", lost, LAUNCH_COLUMNS)):
            write_table_atomic(frame_to_table(frame, spec_schema(spec)), paths[key])
        kernels = pd.concat(links, ignore_index=True) if links else self._kernel_frame([])[link_cols]
        api = nccl_api_calls(nvtx, kernels, lost_launches=lost, payload_schemas=self.payload_schema_entries(),
                             undecoded_payload_blobs=self.undecoded_payload_blobs)
        self.nccl_api_summary = api.summary()
        write_table_atomic(frame_to_table(api.calls, NCCL_API_CALLS_SCHEMA), paths["nccl_api_calls"])
        with atomic_output(paths["session"]) as tmp:
            tmp.write_text(json.dumps(self.session_info(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return paths


def _check_file(p: Path) -> None:
    """Cheap checks before SQLite touches the file: existence, size, magic, truncation."""
    if not p.exists():
        raise NsysFormatError(
            f"{p}: file does not exist; check the path (expected an `nsys export --type sqlite` file)"
        )
    if not p.is_file():
        raise NsysFormatError(f"{p}: not a regular file; pass the .sqlite file produced by `nsys export --type sqlite`")
    size = p.stat().st_size
    if size == 0:
        raise NsysFormatError(
            f"{p}: file is empty (0 bytes); the export was interrupted or failed - re-run `nsys export --type sqlite`"
        )
    with open(p, "rb") as fh:
        header = fh.read(100)
    if len(header) < len(_SQLITE_MAGIC) and _SQLITE_MAGIC.startswith(header):
        raise NsysFormatError(f"{p}: truncated SQLite header ({size} bytes); copy the file again or re-export it")
    if not header.startswith(_SQLITE_MAGIC):
        raise NsysFormatError(
            f"{p}: not an SQLite database (no 'SQLite format 3' header); pass the .sqlite produced by "
            "`nsys export --type sqlite`, not the .nsys-rep/.qdrep report or a text export"
        )
    if len(header) < 100:
        raise NsysFormatError(f"{p}: truncated SQLite header ({size} bytes); copy the file again or re-export it")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    page_count = int.from_bytes(header[28:32], "big")
    # The in-header page count is valid only when "version-valid-for" equals the change counter.
    if page_count and header[92:96] == header[24:28] and size < page_size * page_count:
        raise NsysFormatError(
            f"{p}: truncated: the SQLite header says {page_size * page_count} bytes but the file has {size}; "
            "copy it again (incomplete transfer?) or re-run `nsys export --type sqlite`"
        )
