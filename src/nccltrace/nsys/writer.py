"""Writer for Nsight Systems SQLite exports (schemas 3.0.0, 3.16.1, 3.28.1).

Produces files that look like ``nsys export --type sqlite`` output so that the reader, and any
third-party tool, can be exercised without a GPU. Tables come from ``ddl/schema-<v>.sql`` and are
created lazily, as nsys exports them; a file appears at its path only once complete; how rows are
batched never changes the file. Schemas, ids, lazy and atomic output, speed: ``docs/nsys.md``,
"Writer".
"""

from __future__ import annotations

import datetime as _dt
import functools
import itertools
import json
import math
import os
import re
import sqlite3
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = [
    "SCHEMA_VERSIONS",
    "DEFAULT_PRODUCT_VERSION",
    "PAYLOAD_MODES",
    "NsysExportWriter",
    "PayloadEntry",
    "PayloadSchema",
    "PayloadEnum",
    "NcclPayloadSchemas",
    "nccl_payload_schemas",
    "encode_global_pid",
    "encode_global_tid",
    "sanitize_column_name",
    "load_ddl",
]

SCHEMA_VERSIONS: tuple[str, ...] = ("3.0.0", "3.16.1", "3.28.1")
DEFAULT_PRODUCT_VERSION: dict[str, str] = {
    "3.0.0": "2022.4.2.1",
    "3.16.1": "2024.6.2.225",
    "3.28.1": "2026.4.1",
}
PAYLOAD_MODES: tuple[str, ...] = ("blob", "dynamic", "json", "none")
# Payload mode used when none is given: what an export of that nsys version can carry.
# 3.0.0 has no place for extended payloads at all, so they are dropped.
_DEFAULT_PAYLOAD_MODE = {"3.0.0": "none", "3.16.1": "blob", "3.28.1": "dynamic"}

_DDL_DIR = Path(__file__).with_name("ddl")

# ENUM_NSYS_EVENT_TYPE ids used for NVTX rows.
NVTX_CATEGORY = 33
NVTX_MARK = 34
NVTX_PUSHPOP_RANGE = 59
NVTX_STARTEND_RANGE = 60
NVTX_DOMAIN_CREATE = 75

# Tables every export has, created first in the order of the real 2022.4 export. ThreadNames,
# the ENUM tables and the metadata table are created on close() (they come last there too).
_EARLY_TABLES = (
    "StringIds",
    "TARGET_INFO_SYSTEM_ENV",
    "TARGET_INFO_SESSION_START_TIME",
    "ANALYSIS_DETAILS",
    "PROCESSES",
)

# TARGET_INFO_SYSTEM_ENV.nameEnum of the Hostname row (as in the 2022.4 sample).
_HOSTNAME_NAME_ENUM = 619

_U64 = 1 << 64
_FLOAT_EXACT = 1 << 53  # largest range in which float64 holds every integer exactly
_I64_MAX = (1 << 63) - 1
_ID24 = (1 << 24) - 1

# NVTX payload entry type ids (nvToolsExtPayload.h NVTX_PAYLOAD_ENTRY_TYPE_*).
NVTX_TYPE_INT = 5
NVTX_TYPE_UINT64 = 18
NVTX_TYPE_SIZE = 22
NVTX_SCHEMA_ID_STATIC_START = 1 << 24
NVTX_SCHEMA_TYPE_STATIC = 1

# struct format, size (= alignment) of the C types NCCL uses in its payload structs.
_CTYPES: dict[str, tuple[str, int, int]] = {
    # ctype: (struct code, size, NVTX entry type; 0 = the redop enum id)
    "int": ("i", 4, NVTX_TYPE_INT),
    "uint64": ("Q", 8, NVTX_TYPE_UINT64),
    "size_t": ("Q", 8, NVTX_TYPE_SIZE),
    "redop": ("i", 4, 0),
}

# ncclRedOp_t names accepted in payload dicts (NVTX enum entry names and nccl.enums spellings).
_REDOP_VALUES = {"sum": 0, "product": 1, "prod": 1, "max": 2, "min": 3, "avg": 4}


# --------------------------------------------------------------------------- ids


def _signed64(value: int) -> int:
    """Two's-complement reinterpretation of an unsigned 64-bit value (SQLite stores int64)."""
    value &= _U64 - 1
    return value - _U64 if value > _I64_MAX else value


def encode_global_pid(pid: int, hw_id: int = 0, vm_id: int = 0) -> int:
    """Serialized nsys globalPid ``<HW:8><VM:8><PID:24><TID:24 = 0>`` as a signed int64."""
    _check_ids(pid, 0, hw_id, vm_id)
    return _signed64((hw_id << 56) | (vm_id << 48) | (pid << 24))


def encode_global_tid(pid: int, tid: int, hw_id: int = 0, vm_id: int = 0) -> int:
    """Serialized nsys globalTid ``<HW:8><VM:8><PID:24><TID:24>`` as a signed int64."""
    _check_ids(pid, tid, hw_id, vm_id)
    return _signed64((hw_id << 56) | (vm_id << 48) | (pid << 24) | tid)


def _check_ids(pid: int, tid: int, hw_id: int, vm_id: int) -> None:
    if not (0 <= hw_id <= 0xFF and 0 <= vm_id <= 0xFF):
        raise ValueError(f"hw_id/vm_id must be in 0..255, got {hw_id}/{vm_id}")
    if not (0 <= pid <= _ID24 and 0 <= tid <= _ID24):
        raise ValueError(f"pid/tid must fit in 24 bits (0..{_ID24}), got {pid}/{tid}")


# --------------------------------------------------------------------------- DDL


@dataclass(frozen=True)
class DDL:
    """Parsed ``ddl/schema-<version>.sql``: CREATE statements and ENUM rows, in file order."""

    version: str
    creates: dict[str, str]
    inserts: dict[str, list[str]]


_CREATE_RE = re.compile(r"^CREATE TABLE (\w+) \(\n.*?\n\)(?=;$)", re.S | re.M)
_INSERT_RE = re.compile(r"^INSERT INTO (\w+) VALUES\(.*\);$", re.M)


def load_ddl(version: str) -> DDL:
    """Load the DDL subset for an export schema version (one of :data:`SCHEMA_VERSIONS`).

    The CREATE text is kept exactly as in the file (without the trailing ``;``) because SQLite
    stores it verbatim in ``sqlite_master.sql``.
    """
    if version not in SCHEMA_VERSIONS:
        raise ValueError(f"unsupported schema version {version!r}; supported: {', '.join(SCHEMA_VERSIONS)}")
    text = (_DDL_DIR / f"schema-{version}.sql").read_text(encoding="utf-8")
    creates = {m.group(1): m.group(0) for m in _CREATE_RE.finditer(text)}
    inserts: dict[str, list[str]] = {}
    for m in _INSERT_RE.finditer(text):
        inserts.setdefault(m.group(1), []).append(m.group(0))
    return DDL(version, creates, inserts)


@functools.cache
def _cached_ddl(version: str) -> DDL:
    """:func:`load_ddl`, parsed once per process (writers only read it)."""
    return load_ddl(version)


# --------------------------------------------------------------------------- NCCL payload schemas


@dataclass(frozen=True)
class PayloadEntry:
    """One NVTX payload schema entry: name, NVTX entry type id and byte offset."""

    name: str
    type: int
    offset: int
    fmt: str  # struct code used to pack/unpack the value (little-endian)


@dataclass(frozen=True)
class PayloadSchema:
    """A static NVTX payload schema as NCCL registers it in its ``NCCL`` domain."""

    api: str  # NVTX_SID_<api> in NCCL, e.g. "AllReduce"; the range text is "nccl" + api
    schema_id: int
    name: str | None  # NCCL < 2.25 registers the api name, later releases no name
    entries: tuple[PayloadEntry, ...]
    size: int

    @property
    def entry_names(self) -> frozenset[str]:
        """Names of all entries (used to match payload dicts to schemas)."""
        return frozenset(e.name for e in self.entries)


@dataclass(frozen=True)
class PayloadEnum:
    """An NVTX payload enum (NCCL's reduction operation)."""

    schema_id: int
    entries: tuple[tuple[str, int], ...]
    size: int


@dataclass(frozen=True)
class NcclPayloadSchemas:
    """All payload schemas and enums NCCL of one version registers."""

    nccl_version: tuple[int, int, int]
    schemas: tuple[PayloadSchema, ...]
    enums: tuple[PayloadEnum, ...]

    def by_api(self) -> dict[str, PayloadSchema]:
        """Schemas keyed by API name (``AllReduce``, ``CommInitRank``, ...)."""
        return {s.api: s for s in self.schemas}


# Entry lists as (name, ctype) in struct order. Names are NCCL's exact strings (log-formats §9).
_COMM = ("NCCL communicator ID", "uint64")
_SIZE = ("Message size [bytes]", "size_t")
_REDOP = ("Reduction operation", "redop")
_LEGACY_ENTRIES: dict[str, tuple[tuple[str, str], ...]] = {
    "CommInitRank": (("Rank", "int"), ("No. of ranks", "int"), ("CUDA device", "int")),
    "CommInitAll": (("No. of devices", "int"),),
    "AllGather": (_SIZE,),
    "AllReduce": (_SIZE, _REDOP),
    "Broadcast": (("Bytes", "size_t"), ("Root", "int")),
    "ReduceScatter": (_SIZE, _REDOP),
    "Reduce": (_SIZE, ("Root", "int"), _REDOP),
    "Send": (("Bytes", "size_t"), ("Peer rank", "int")),
    "CommSplit": (("Rank", "int"), ("No. of ranks", "int"), ("CUDA device", "int"), ("color", "int"), ("key", "int")),
}
_INIT_RANK_NEW = (_COMM, ("No. of ranks", "int"), ("Rank", "int"), ("CUDA device", "int"))
_NEW_ENTRIES: dict[str, tuple[tuple[str, str], ...]] = {
    "CommInitRank": _INIT_RANK_NEW,
    "CommInitAll": (_COMM, ("No. of devices", "int")),
    "AllGather": (_COMM, _SIZE),
    "AllReduce": (_COMM, _SIZE, _REDOP),
    "Broadcast": (_COMM, _SIZE, ("Root", "int")),
    "ReduceScatter": (_COMM, _SIZE, _REDOP),
    "Reduce": (_COMM, _SIZE, ("Root", "int"), _REDOP),
    "Send": (_COMM, _SIZE, ("Peer rank", "int")),
    "CommSplit": (
        _COMM,
        ("Parent NCCL communicator ID", "uint64"),
        ("No. of ranks", "int"),
        ("Rank", "int"),
        ("CUDA device", "int"),
        ("Color", "int"),
        ("Key", "int"),
    ),
    "CommFinalize": (_COMM,),
    "CommShrink": _INIT_RANK_NEW + (("num_exclude", "int"),),
    "AlltoAll": (_COMM, _SIZE),
    "Gather": (_COMM, _SIZE, ("Root", "int")),
    "CommGrow": (
        _COMM,
        ("Parent NCCL communicator ID", "uint64"),
        ("No. of ranks", "int"),
        ("Rank", "int"),
        ("CUDA device", "int"),
    ),
    "PutSignal": (_COMM, _SIZE, ("Peer rank", "int"), ("Context ID", "int")),
    "Signal": (_COMM, ("Peer rank", "int"), ("Context ID", "int")),
    "WaitSignal": (_COMM, ("Number of peers", "int"), ("Context ID", "int")),
}
# APIs sharing another API's entries (NCCL reuses the struct but registers a separate schema id).
_SAME_ENTRIES = {
    "CommDestroy": "CommInitRank",
    "CommAbort": "CommInitRank",
    "CommInitRankConfig": "CommInitRank",
    "CommInitRankScalable": "CommInitRank",
    "CommRevoke": "CommInitRank",
    "Recv": "Send",
    "Scatter": "Gather",
}
# Static schema id offsets (NVTX_SID_*), stable across releases; the redop enum id is not.
_SIDS = [
    "CommInitRank", "CommInitAll", "CommDestroy", "CommAbort", "AllGather", "AllReduce", "Broadcast",
    "ReduceScatter", "Reduce", "Send", "Recv", "CommInitRankConfig", "CommInitRankScalable", "CommSplit",
    "CommFinalize", "CommShrink", "AlltoAll", "Gather", "Scatter", "CommRevoke", "CommGrow", "PutSignal",
    "Signal", "WaitSignal",
]  # fmt: skip


def _nccl_sid_count_and_enum(v: tuple[int, int, int]) -> tuple[int, int]:
    """(number of NVTX_SID_* ids defined, redop enum offset) for an NCCL version."""
    if v < (2, 23, 0):
        return 11, 11
    if v < (2, 25, 0):
        return 14, 14
    if v < (2, 26, 0):
        return 15, 14  # CommFinalize and the enum share offset 14 in 2.25
    if v < (2, 27, 0):
        return 15, 15
    if v < (2, 28, 0):
        return 16, 16
    if v < (2, 28, 7):
        return 19, 19
    if v < (2, 29, 0):
        return 20, 20
    return 24, 24


def _layout(entries: Sequence[tuple[str, str]], redop_id: int) -> tuple[tuple[PayloadEntry, ...], int]:
    """C struct layout (natural alignment, LP64) of an NCCL payload struct."""
    out = []
    offset = 0
    max_align = 1
    for name, ctype in entries:
        fmt, size, nvtx_type = _CTYPES[ctype]
        offset = (offset + size - 1) // size * size
        out.append(PayloadEntry(name, nvtx_type or redop_id, offset, fmt))
        offset += size
        max_align = max(max_align, size)
    return tuple(out), (offset + max_align - 1) // max_align * max_align


def nccl_payload_schemas(nccl_version: Sequence[int]) -> NcclPayloadSchemas:
    """NVTX payload schemas that NCCL ``nccl_version`` (major, minor, patch) registers.

    Empty before 2.16.2 (no payloads). Entry names, types and struct offsets follow NCCL's
    ``nvtx.h`` / ``nvtx_payload_schemas.h`` of the matching release; schema ids are
    ``(1 << 24) + NVTX_SID_<api>``.
    """
    v = tuple(int(x) for x in nccl_version) + (0, 0, 0)
    v3: tuple[int, int, int] = (v[0], v[1], v[2])
    if v3 < (2, 16, 2):
        return NcclPayloadSchemas(v3, (), ())
    n_sids, enum_off = _nccl_sid_count_and_enum(v3)
    redop_id = NVTX_SCHEMA_ID_STATIC_START + enum_off
    legacy = v3 < (2, 25, 0)
    table = _LEGACY_ENTRIES if legacy else _NEW_ENTRIES
    schemas = []
    for idx, api in enumerate(_SIDS[:n_sids]):
        base = _SAME_ENTRIES.get(api, api)
        entries, size = _layout(table[base], redop_id)
        schemas.append(
            PayloadSchema(api, NVTX_SCHEMA_ID_STATIC_START + idx, api if legacy else None, entries, size)
        )
    redop = PayloadEnum(redop_id, (("Sum", 0), ("Product", 1), ("Max", 2), ("Min", 3), ("Avg", 4)), 4)
    return NcclPayloadSchemas(v3, tuple(schemas), (redop,))


def sanitize_column_name(name: str) -> str:
    """Column name used for a payload entry in dynamic payload tables (recorded in
    NVTX_EXPORT_TRANSLATION): every character outside ``[0-9A-Za-z_]`` becomes ``_``."""
    out = re.sub(r"[^0-9A-Za-z_]", "_", name)
    return out if out and not out[0].isdigit() else "_" + out


# --------------------------------------------------------------------------- column helpers


def _is_missing(v: Any) -> bool:
    if v is None or v is pd.NA:
        return True
    return isinstance(v, float) and math.isnan(v)


class _Const:
    """A column with one value for every row; inlined as an SQL literal so executemany binds
    fewer parameters (binding dominates insert time for wide tables such as the kernel table)."""

    __slots__ = ("value",)

    def __init__(self, value: int | str | None) -> None:
        self.value = value

    def sql(self) -> str:
        v = self.value
        if v is None:
            return "NULL"
        if isinstance(v, str):
            return "'" + v.replace("'", "''") + "'"
        return str(int(v))


def _int_col(df: pd.DataFrame, col: str, *, default: int | None = None, nullable: bool = False) -> list | _Const:
    """Integer column as a list of Python ints (None where missing when ``nullable``), or a
    :class:`_Const` when absent (default) or when every row has the same value."""
    if col not in df.columns:
        if default is None and not nullable:
            raise ValueError(f"missing required column {col!r}")
        return _Const(default)
    s = df[col]
    if s.dtype.kind == "f" and len(s) and float(s.abs().max()) > _FLOAT_EXACT:
        # pandas turns int columns with None into float64, which silently rounds large values
        # (e.g. epoch-ns timestamps); refuse instead of writing wrong numbers.
        raise ValueError(f"column {col!r} is float64 with values beyond 2**53; pass it as Int64 (nullable int) instead")
    if s.isna().any():
        if nullable:
            return [None if _is_missing(v) else int(v) for v in s.tolist()]
        if default is None:
            raise ValueError(f"column {col!r} has missing values but is required")
        s = s.fillna(default)
    if s.dtype == object or s.dtype.kind == "u":
        # Python ints: unsigned 64-bit values (e.g. uint64 payloads) may not fit in int64.
        vals = [int(v) for v in s.tolist()]
        return _Const(vals[0]) if vals and all(v == vals[0] for v in vals) else vals
    arr = s.to_numpy(dtype=np.int64)
    if len(arr) and (arr == arr[0]).all():
        return _Const(int(arr[0]))
    return arr.tolist()


def _int_list(df: pd.DataFrame, col: str, *, default: int | None = None, nullable: bool = False) -> Iterable:
    """Like :func:`_int_col` but always iterable per row (for row-wise assembly)."""
    c = _int_col(df, col, default=default, nullable=nullable)
    return itertools.repeat(c.value) if isinstance(c, _Const) else c


def _float_list(df: pd.DataFrame, col: str) -> Iterable:
    if col not in df.columns:
        return itertools.repeat(None)
    return [None if _is_missing(v) else float(v) for v in df[col].tolist()]


def _require(df: pd.DataFrame, cols: Iterable[str], what: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{what}: missing required column(s) {missing}; got {list(df.columns)}")


def _check_id_range(values: np.ndarray, what: str) -> None:
    if len(values) and (values.min() < 0 or values.max() > _ID24):
        raise ValueError(f"{what} must fit in 24 bits (0..{_ID24})")


class _Cols:
    """The rows given to an ``add_*`` method: a DataFrame, or (the fast path, no pandas) a mapping
    of column name -> list / tuple / 1-d numpy array (one value per row) or a scalar (the same
    value on every row). Integer columns come back as a list of Python ints (None where missing
    when nullable) or a :class:`_Const`; the same values either way."""

    __slots__ = ("df", "map", "n")

    def __init__(self, data: pd.DataFrame | Mapping[str, Any]) -> None:
        if isinstance(data, pd.DataFrame):
            self.df, self.map, self.n = data, None, len(data)
            return
        self.df, self.map = None, data
        n = None
        for k, v in data.items():
            if _is_seq(v):
                if n is None:
                    n = len(v)
                elif len(v) != n:
                    raise ValueError(f"column {k!r} has {len(v)} values, another column {n}")
        if n is None:
            raise ValueError("a mapping of columns needs at least one sequence column")
        self.n = n

    def has(self, col: str) -> bool:
        return col in (self.df.columns if self.df is not None else self.map)

    def require(self, cols: Iterable[str], what: str) -> None:
        if self.df is not None:
            _require(self.df, cols, what)
            return
        missing = [c for c in cols if c not in self.map]
        if missing:
            raise ValueError(f"{what}: missing required column(s) {missing}; got {list(self.map)}")

    def ints(self, col: str, *, default: int | None = None, nullable: bool = False) -> list | _Const:
        """Like :func:`_int_col`."""
        if self.df is not None:
            return _int_col(self.df, col, default=default, nullable=nullable)
        if col not in self.map:
            if default is None and not nullable:
                raise ValueError(f"missing required column {col!r}")
            return _Const(default)
        v = self.map[col]
        if not _is_seq(v):
            if _is_missing(v):
                if nullable:
                    return _Const(None)
                if default is None:
                    raise ValueError(f"column {col!r} has missing values but is required")
                return _Const(default)
            return _Const(int(v))
        if isinstance(v, np.ndarray) and v.dtype.kind in "iub":
            arr = v
        else:
            vals = list(v)
            types = set(map(type, vals))
            if types == _PLAIN_INTS or (nullable and types <= _PLAIN_INTS_OR_NONE and vals):
                # Python ints (and NULLs) as they are: the usual case, no conversion needed
                return _Const(vals[0]) if vals.count(vals[0]) == len(vals) else vals
            if None in vals:
                if nullable:
                    vals = [None if x is None else int(x) for x in vals]
                    return _Const(vals[0]) if vals.count(vals[0]) == len(vals) else vals
                if default is None:
                    raise ValueError(f"column {col!r} has missing values but is required")
                vals = [default if x is None else x for x in vals]
            if not vals:
                return []
            arr = np.asarray(vals)
            if arr.dtype.kind not in "iub":
                if arr.dtype.kind != "O":
                    raise ValueError(f"column {col!r} must hold integers, not {arr.dtype}")
                ints = [int(x) for x in vals]  # unsigned 64-bit values beyond int64
                return _Const(ints[0]) if ints.count(ints[0]) == len(ints) else ints
        if arr.dtype.kind == "u" and len(arr) and int(arr.max()) > _I64_MAX:
            ints = [int(x) for x in arr.tolist()]
            return _Const(ints[0]) if ints.count(ints[0]) == len(ints) else ints
        arr = arr.astype(np.int64, copy=False)
        if len(arr) and (arr == arr[0]).all():
            return _Const(int(arr[0]))
        return arr.tolist()

    def int_array(self, col: str) -> np.ndarray:
        """A required integer column as an int64 array (scalars repeated)."""
        if self.df is not None:
            return self.df[col].to_numpy(dtype=np.int64)
        v = self.map[col]
        if not _is_seq(v):
            return np.full(self.n, int(v), dtype=np.int64)
        return np.asarray(v, dtype=np.int64)

    def objects(self, col: str, default: Any = None) -> list:
        """A column as a list of Python objects (``default`` on every row when absent)."""
        if self.df is not None:
            return self.df[col].tolist() if col in self.df.columns else [default] * self.n
        v = self.map.get(col, default)
        if not _is_seq(v):
            return [v] * self.n
        return v.tolist() if isinstance(v, np.ndarray) else list(v)

    def time_span(self) -> tuple[int, int]:
        """(min start, max of start and the non-missing ends)."""
        if self.df is not None:
            starts = self.df["start"].to_numpy(dtype=np.int64)
            lo, hi = int(starts.min()), int(starts.max())
            if "end" in self.df.columns:
                ends = pd.to_numeric(self.df["end"], errors="coerce").dropna()
                if len(ends):
                    hi = max(hi, int(ends.max()))
            return lo, hi
        starts = self.int_array("start")
        lo, hi = int(starts.min()), int(starts.max())
        if "end" in self.map:
            e = self.map["end"]
            if isinstance(e, np.ndarray) and e.dtype.kind in "iu":
                hi = max(hi, int(e.max()))
            elif _is_seq(e):
                ends = [x for x in e if not _is_missing(x)]
                if ends:
                    hi = max(hi, int(max(ends)))
            elif not _is_missing(e):
                hi = max(hi, int(e))
        return lo, hi


_PLAIN_INTS = {int}
_PLAIN_INTS_OR_NONE = {int, type(None)}


def _is_seq(v: Any) -> bool:
    return isinstance(v, (list, tuple, np.ndarray, pd.Series))


def _null_sentinel(values: list) -> Any:
    """A value of the column's type that does not occur in ``values`` (for ``NULLIF(?, s)``), or
    None when the column mixes types. SQLite's ``=`` never equates values of different storage
    classes, so a sentinel absent by Python equality never matches a stored value."""
    first = next((v for v in values if v is not None), None)
    if isinstance(first, bool) or first is None:
        return None
    if isinstance(first, int):
        s = -1
        while s in values:
            s -= 1
        return s
    if isinstance(first, str):
        s = "\x1f"
        while s in values:
            s += "\x1f"
        return s
    if isinstance(first, bytes):
        s = b""
        while s in values:
            s += b"\x00"
        return s
    return None


def _sql_literal(v: Any) -> str:
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    if isinstance(v, bytes):
        return "X'" + v.hex() + "'"
    return str(int(v))


# Rows per multi-row INSERT (_insert_columns), and the bound parameters allowed in one statement
# (SQLITE_MAX_VARIABLE_NUMBER is 999 before SQLite 3.32).
_ROWS_PER_INSERT = 32
_MAX_PARAMS = 999 if sqlite3.sqlite_version_info < (3, 32, 0) else 32766

_PAYLOAD_STRUCTS: dict[int, tuple[PayloadSchema, struct.Struct]] = {}  # id(schema) -> (schema, layout)


def _payload_struct(schema: PayloadSchema) -> struct.Struct:
    """The binaryData layout of a schema: the uint64 schema id, then the payload struct (entries
    at their offsets, zero padding, ``schema.size`` bytes)."""
    hit = _PAYLOAD_STRUCTS.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    fmt, pos = "<Q", 0
    for en in schema.entries:  # in offset order (_layout)
        if en.offset < pos:
            raise ValueError(f"payload schema {schema.api}: entry {en.name!r} overlaps the previous one")
        fmt += "x" * (en.offset - pos) + en.fmt
        pos = en.offset + struct.calcsize("<" + en.fmt)
    fmt += "x" * (schema.size - pos)
    st = struct.Struct(fmt)
    if len(_PAYLOAD_STRUCTS) > 1000:
        _PAYLOAD_STRUCTS.clear()
    _PAYLOAD_STRUCTS[id(schema)] = (schema, st)
    return st


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _utc_string(ns: int) -> str:
    return _dt.datetime.fromtimestamp(ns // 1_000_000_000, tz=_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


# --------------------------------------------------------------------------- writer


class NsysExportWriter:
    """Write an nsys-style SQLite export.

    Args:
        path: Output file. Written atomically on :meth:`close`.
        schema_version: ``"3.0.0"``, ``"3.16.1"`` or ``"3.28.1"``.
        hostname: Stored as the ``Hostname`` row of ``TARGET_INFO_SYSTEM_ENV``.
        session_start_utc_ns: ``TARGET_INFO_SESSION_START_TIME.utcEpochNs`` (timeline zero in UTC).
        product_version: ``EXPORT_PRODUCT_VERSION``; defaults per schema (2022.4.2.1, 2024.6.2.225,
            2026.4.1).
        hw_id, vm_id: HW and VM bytes of every globalPid/globalTid.
        payload_mode: How NCCL extended payloads (``nccl_payload`` column) are stored: ``"blob"``
            (``binaryData``, 3.16.1+), ``"dynamic"`` (``DYNAMIC_NVTXPAYLOAD_DATATYPE_*`` tables,
            3.28.1), ``"json"`` (``jsonText``, any version) or ``"none"`` (dropped). Default: what
            the nsys version can export (none / blob / dynamic).
        time_normalized: Record ``EXPORT_PARAM_TIME_NORMALIZE = 'true'`` (timestamps passed in are
            then UTC epoch ns). Not available for 3.0.0 (nsys 2022.4 had no ``--ts-normalize``).
        fsync: Flush the finished file to disk before renaming it into place (default). The
            workload emulator passes False: its other outputs are renamed without a flush too.
        session_clock_ns: The target's monotonic clock at the session's start, as nsys >= 2025
            records it (``systemClockNs``; schema 3.28.1 here): times passed in are then on that
            clock, as a real export of those versions stores them, and ``ANALYSIS_DETAILS``
            starts there. None (default): times are session-relative (older nsys).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        schema_version: str = "3.0.0",
        *,
        hostname: str,
        session_start_utc_ns: int,
        product_version: str | None = None,
        hw_id: int = 0,
        vm_id: int = 0,
        payload_mode: str | None = None,
        time_normalized: bool = False,
        fsync: bool = True,
        session_clock_ns: int | None = None,
    ) -> None:
        self._ddl = _cached_ddl(schema_version)
        self._fsync = fsync
        self.path = Path(path)
        self.schema_version = schema_version
        self.product_version = product_version or DEFAULT_PRODUCT_VERSION[schema_version]
        self.hostname = hostname
        self.session_start_utc_ns = int(session_start_utc_ns)
        if session_clock_ns is not None and "systemClockNs" not in self._ddl.creates["TARGET_INFO_SESSION_START_TIME"]:
            raise ValueError(f"session_clock_ns needs TARGET_INFO_SESSION_START_TIME.systemClockNs (schema 3.28.1), "
                             f"not {schema_version}")
        self.session_clock_ns = None if session_clock_ns is None else int(session_clock_ns)
        _check_ids(0, 0, hw_id, vm_id)
        self.hw_id, self.vm_id = hw_id, vm_id
        self.payload_mode = payload_mode or _DEFAULT_PAYLOAD_MODE[schema_version]
        if self.payload_mode not in PAYLOAD_MODES:
            raise ValueError(f"payload_mode must be one of {PAYLOAD_MODES}, got {self.payload_mode!r}")
        has_blob = "binaryData" in self._ddl.creates["NVTX_EVENTS"]
        has_event_id = "eventId" in self._ddl.creates["NVTX_EVENTS"]
        if self.payload_mode == "blob" and not has_blob:
            raise ValueError(
                f"payload_mode='blob' needs NVTX_EVENTS.binaryData (schema >= 3.16.1), not {schema_version}"
            )
        if self.payload_mode == "dynamic" and not has_event_id:
            raise ValueError(f"payload_mode='dynamic' needs NVTX_EVENTS.eventId (schema 3.28.1), not {schema_version}")
        if time_normalized and schema_version == "3.0.0":
            raise ValueError("time_normalized: nsys 2022.4 (schema 3.0.0) had no --ts-normalize")
        self.time_normalized = time_normalized
        self._has_event_id = has_event_id
        self._has_blob = has_blob
        self._meta_table = "EXPORT_META_DATA" if "EXPORT_META_DATA" in self._ddl.creates else "META_DATA_EXPORT"
        self._global_vid = _signed64((hw_id << 56) | (vm_id << 48))

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        self._tmp = Path(tmp)
        self._conn: sqlite3.Connection | None = sqlite3.connect(self._tmp)
        # The temp file is renamed only after a successful close, so durability pragmas can be off.
        self._conn.execute("PRAGMA journal_mode=OFF")
        self._conn.execute("PRAGMA synchronous=OFF")
        self._conn.execute("PRAGMA locking_mode=EXCLUSIVE")  # one writer; avoids per-statement locks
        self._created: dict[str, list[str]] = {}
        self._strings: dict[str, int] = {}
        self._pending_strings: list[tuple[int, str]] = []
        self._processes: dict[int, str] = {}
        self._thread_names: list[tuple[int, int, int]] = []
        self._threads: set[tuple[int, int]] = set()
        self._gpus: dict[int, tuple] = {}
        self._cuda_devices: set[tuple[int, int]] = set()
        self._domains: dict[int, dict[int, str]] = {}  # pid -> domainId -> name
        self._schemas: dict[tuple[int, int], NcclPayloadSchemas] = {}  # (pid, domainId)
        self._schema_cache: dict[tuple, PayloadSchema] = {}  # (pid, domainId, range text, payload keys)
        self._schema_rows: dict[tuple[int, int], tuple] = {}  # (domainId, schemaId) -> signature
        self._enum_rows: dict[tuple[int, int], tuple] = {}
        self._translations: set[str] = set()
        self._next_event_id = 1
        self._next_range_id = 1
        self._next_grid_id = 1
        self._t_min: int | None = None
        self._t_max: int | None = None
        for table in _EARLY_TABLES:
            self._create(table)
        self._write_session_tables()

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> "NsysExportWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # ------------------------------------------------------------------ internals

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"writer for {self.path} is closed")
        return self._conn

    def _create(self, table: str) -> list[str]:
        """Create a table from the DDL on first use (lazy export); return its column names."""
        cols = self._created.get(table)
        if cols is None:
            self._db.execute(self._ddl.creates[table])
            for stmt in self._ddl.inserts.get(table, ()):
                self._db.execute(stmt)
            cols = [r[1] for r in self._db.execute(f'PRAGMA table_info("{table}")')]
            self._created[table] = cols
        return cols

    def _intern(self, s: str) -> int:
        sid = self._strings.get(s)
        if sid is None:
            sid = len(self._strings) + 1
            self._strings[s] = sid
            self._pending_strings.append((sid, s))
        return sid

    def _intern_series(self, s: pd.Series) -> list[int]:
        """StringIds ids of a string column; interns each distinct value once."""
        codes, uniques = pd.factorize(s, use_na_sentinel=True)
        if (codes < 0).any():
            raise ValueError(f"column {s.name!r} has missing strings")
        ids = np.fromiter((self._intern(str(u)) for u in uniques), dtype=np.int64, count=len(uniques))
        return ids[codes].tolist()

    def _flush_strings(self) -> None:
        if self._pending_strings:
            self._db.executemany("INSERT INTO StringIds (id, value) VALUES (?, ?)", self._pending_strings)
            self._pending_strings = []

    def _insert(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """Insert row tuples (flushing new StringIds first so ids always resolve)."""
        self._create(table)
        self._flush_strings()
        cols = ", ".join(f'"{c}"' for c in columns)
        marks = ", ".join("?" * len(columns))
        self._db.executemany(f'INSERT INTO "{table}" ({cols}) VALUES ({marks})', rows)

    def _insert_columns(self, table: str, columns: Mapping[str, list | _Const], n: int) -> None:
        """Insert ``n`` rows given column-wise; constant columns become SQL literals."""
        self._create(table)
        self._flush_strings()
        names = ", ".join(f'"{c}"' for c in columns)
        exprs, lists = [], []
        for v in columns.values():
            if isinstance(v, _Const):
                exprs.append(v.sql())
                continue
            if None in v:
                # Binding None is slow in the sqlite3 module (adapter lookup per value): a column of
                # NULLs becomes the literal, a partly-NULL one binds a sentinel that NULLIF turns
                # into NULL. Stored values (and so the file) are the same as with bound NULLs.
                if v.count(None) == len(v):
                    exprs.append("NULL")
                    continue
                s = _null_sentinel(v)
                if s is not None:
                    exprs.append(f"NULLIF(?, {_sql_literal(s)})")
                    lists.append([s if x is None else x for x in v])
                    continue
            exprs.append("?")
            lists.append(v)
        one = "(" + ", ".join(exprs) + ")"
        head = f'INSERT INTO "{table}" ({names}) VALUES '
        k = len(lists)
        per = max(1, min(_ROWS_PER_INSERT, _MAX_PARAMS // max(k, 1)))
        if n < 2 * per:
            rows = zip(*lists) if lists else itertools.repeat((), n)
            self._db.executemany(head + one, rows)
            return
        # Several rows per INSERT statement: the same rows in the same order (so the same file),
        # with a fraction of the per-statement work of one row at a time.
        flat = list(itertools.chain.from_iterable(zip(*lists))) if lists else []
        full, rest = divmod(n, per)
        step = per * k
        self._db.executemany(head + ", ".join([one] * per), (flat[i:i + step] for i in range(0, full * step, step)))
        if rest:
            self._db.execute(head + ", ".join([one] * rest), flat[full * step:])

    def _track_frame_time(self, df: pd.DataFrame) -> None:
        """Extend the session span (ANALYSIS_DETAILS) by the frame's start/end columns."""
        starts = df["start"].to_numpy(dtype=np.int64)
        lo, hi = int(starts.min()), int(starts.max())
        if "end" in df.columns:
            ends = pd.to_numeric(df["end"], errors="coerce").dropna()
            if len(ends):
                hi = max(hi, int(ends.max()))
        self._track_time([lo], [hi])

    def _track_span(self, c: _Cols) -> None:
        """Extend the session span (ANALYSIS_DETAILS) by the rows' start/end columns."""
        lo, hi = c.time_span()
        self._track_time([lo], [hi])

    def _track_time(self, starts: Sequence[int], ends: Sequence[int | None]) -> None:
        lo = min(starts, default=None)
        hi = max((v for v in itertools.chain(starts, ends) if v is not None), default=None)
        if lo is not None:
            self._t_min = lo if self._t_min is None else min(self._t_min, lo)
        if hi is not None:
            self._t_max = hi if self._t_max is None else max(self._t_max, hi)

    def _gpid_array(self, pids: pd.Series) -> np.ndarray:
        p = pids.to_numpy(dtype=np.int64)
        _check_id_range(p, "pid")
        # Bits do not overlap, so int64 addition equals OR even when the HW byte makes it negative.
        return np.int64(self._global_vid) + (p << 24)

    def _gtid_array(self, pids: pd.Series, tids: pd.Series) -> np.ndarray:
        t = tids.to_numpy(dtype=np.int64)
        _check_id_range(t, "tid")
        return self._gpid_array(pids) + t

    def _gpid_col(self, c: _Cols) -> list | _Const:
        """globalPid of each row of ``c`` (from its pid column)."""
        if c.df is None and not _is_seq(c.map["pid"]):
            pid = int(c.map["pid"])
            _check_id_range(np.asarray([pid]), "pid")
            return _Const(int(np.int64(self._global_vid) + (np.int64(pid) << 24)))
        return self._gpid_array_of(c.int_array("pid")).tolist()

    def _gtid_col(self, c: _Cols, tid_col: str = "tid") -> list | _Const:
        """globalTid of each row of ``c`` (from its pid and ``tid_col`` columns)."""
        if c.df is None and not _is_seq(c.map["pid"]) and not _is_seq(c.map[tid_col]):
            pid, tid = int(c.map["pid"]), int(c.map[tid_col])
            _check_id_range(np.asarray([pid]), "pid")
            _check_id_range(np.asarray([tid]), "tid")
            return _Const(int(np.int64(self._global_vid) + (np.int64(pid) << 24) + tid))
        t = c.int_array(tid_col)
        _check_id_range(t, "tid")
        return (self._gpid_array_of(c.int_array("pid")) + t).tolist()

    def _gpid_array_of(self, p: np.ndarray) -> np.ndarray:
        _check_id_range(p, "pid")
        # Bits do not overlap, so int64 addition equals OR even when the HW byte makes it negative.
        return np.int64(self._global_vid) + (p << 24)

    def _intern_list(self, values: list, what: str) -> list[int]:
        """StringIds ids of a list of strings, interned in order of first appearance (as
        :meth:`_intern_series`)."""
        ids = {}
        for v in dict.fromkeys(values):  # distinct values, in order of first appearance
            if _is_missing(v):
                raise ValueError(f"column {what!r} has missing strings")
            ids[v] = self._intern(str(v))
        return list(map(ids.__getitem__, values))

    def _write_session_tables(self) -> None:
        cols = self._created["TARGET_INFO_SESSION_START_TIME"]
        t = _utc_string(self.session_start_utc_ns)
        row = {"utcEpochNs": self.session_start_utc_ns, "utcTime": t, "localTime": t}
        if self.session_clock_ns is not None:
            row["systemClockNs"] = self.session_clock_ns
        self._insert("TARGET_INFO_SESSION_START_TIME", list(row), [tuple(row.values())])
        assert set(row) <= set(cols)
        self._insert(
            "TARGET_INFO_SYSTEM_ENV",
            ["globalVid", "devStateName", "name", "nameEnum", "value"],
            [(self._global_vid, "Local (CLI)", "Hostname", _HOSTNAME_NAME_ENUM, self.hostname)],
        )

    # ------------------------------------------------------------------ public API

    def add_process(self, pid: int, name: str) -> int:
        """Add a ``PROCESSES`` row; returns the process's globalPid."""
        gpid = encode_global_pid(pid, self.hw_id, self.vm_id)
        if pid in self._processes:
            if self._processes[pid] != name:
                raise ValueError(f"process {pid} already added as {self._processes[pid]!r}")
            return gpid
        self._processes[pid] = name
        self._insert("PROCESSES", ["globalPid", "pid", "name"], [(gpid, pid, name)])
        return gpid

    def add_thread(self, pid: int, tid: int, name: str | None = None) -> int:
        """Register a thread; a name adds a ``ThreadNames`` row. Returns the globalTid."""
        gtid = encode_global_tid(pid, tid, self.hw_id, self.vm_id)
        if name is not None and (pid, tid) not in self._threads:
            self._thread_names.append((self._intern(name), 0, gtid))
        self._threads.add((pid, tid))
        return gtid

    def add_gpu(
        self,
        device_id: int,
        *,
        name: str,
        bus_location: str,
        uuid: str,
        pid: int | None = None,
        cuda_id: int | None = None,
    ) -> None:
        """Add a ``TARGET_INFO_GPU`` row (once per device_id) and, on 3.28.1 when ``pid`` and
        ``cuda_id`` are given, a ``TARGET_INFO_CUDA_DEVICE`` row mapping (pid, cuda_id) to it."""
        info = (name, bus_location, uuid)
        if device_id in self._gpus:
            if self._gpus[device_id] != info:
                raise ValueError(f"GPU {device_id} already added with different properties")
        else:
            self._gpus[device_id] = info
            self._insert(
                "TARGET_INFO_GPU",
                ["vmId", "id", "name", "busLocation", "isDiscrete", "uuid", "cuDevice"],
                [(self._global_vid, device_id, name, bus_location, 1, uuid, device_id)],
            )
        if pid is not None and cuda_id is not None and "TARGET_INFO_CUDA_DEVICE" in self._ddl.creates:
            if (pid, cuda_id) not in self._cuda_devices:
                self._cuda_devices.add((pid, cuda_id))
                self._insert(
                    "TARGET_INFO_CUDA_DEVICE",
                    ["gpuId", "cudaId", "pid", "uuid"],
                    [(device_id, cuda_id, pid, uuid)],
                )

    def add_kernels(self, df: pd.DataFrame | Mapping[str, Any]) -> None:
        """Append rows to ``CUPTI_ACTIVITY_KIND_KERNEL``.

        ``df``: a DataFrame, or a mapping of column -> sequence or scalar (same value on every
        row; the fast path, no pandas). Required columns: start, end, device_id, context_id,
        stream_id, correlation_id, pid, name (demangled, with parameter list), short_name,
        grid_x/y/z, block_x/y/z, registers_per_thread, static_shared_memory,
        dynamic_shared_memory. Optional: green_context_id (3.16.1+), mangled_name, launch_type,
        cache_config, grid_id, local_memory_per_thread, local_memory_total, graph_node_id and
        graph_id (CUDA-graph kernels; NULL = not launched by a graph). ``graph_id`` is stored only
        where the schema has ``graphId`` (3.28.1 here; the 3.0.0/3.16.1 DDL has ``graphNodeId``
        only) and dropped otherwise, as such an export has no place for it. A graph kernel's
        ``correlation_id`` is the one of the ``cudaGraphLaunch`` runtime row that launched the graph.
        """
        required = [
            "start", "end", "device_id", "context_id", "stream_id", "correlation_id", "pid", "name",
            "short_name", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
            "registers_per_thread", "static_shared_memory", "dynamic_shared_memory",
        ]  # fmt: skip
        c = _Cols(df)
        c.require(required, "add_kernels")
        n = c.n
        if n == 0:
            return
        table = "CUPTI_ACTIVITY_KIND_KERNEL"
        table_cols = set(self._create(table))
        if c.has("grid_id"):
            grid_id: list | _Const = c.ints("grid_id")
        else:
            grid_id = list(range(self._next_grid_id, self._next_grid_id + n))
            self._next_grid_id += n
        cols: dict[str, list | _Const] = {
            "start": c.ints("start"),
            "end": c.ints("end"),
            "deviceId": c.ints("device_id"),
            "contextId": c.ints("context_id"),
            "streamId": c.ints("stream_id"),
            "correlationId": c.ints("correlation_id", nullable=True),
            "globalPid": self._gpid_col(c),
            "demangledName": self._intern_list(c.objects("name"), "name"),
            "shortName": self._intern_list(c.objects("short_name"), "short_name"),
            "mangledName": (self._intern_list(c.objects("mangled_name"), "mangled_name") if c.has("mangled_name")
                            else _Const(None)),
            "launchType": c.ints("launch_type", default=0),
            "cacheConfig": c.ints("cache_config", default=0),
            "registersPerThread": c.ints("registers_per_thread"),
            "gridX": c.ints("grid_x"),
            "gridY": c.ints("grid_y"),
            "gridZ": c.ints("grid_z"),
            "blockX": c.ints("block_x"),
            "blockY": c.ints("block_y"),
            "blockZ": c.ints("block_z"),
            "staticSharedMemory": c.ints("static_shared_memory"),
            "dynamicSharedMemory": c.ints("dynamic_shared_memory"),
            "localMemoryPerThread": c.ints("local_memory_per_thread", default=0),
            "localMemoryTotal": c.ints("local_memory_total", default=0),
            "gridId": grid_id,
            "sharedMemoryLimitConfig": _Const(0),
        }  # fmt: skip
        if "greenContextId" in table_cols:
            cols["greenContextId"] = c.ints("green_context_id", nullable=True)
        elif c.has("green_context_id") and not all(_is_missing(v) for v in c.objects("green_context_id")):
            raise ValueError(f"green_context_id needs schema >= 3.16.1, not {self.schema_version}")
        if "tensorSizeMinusOneElements" in table_cols:
            cols["tensorSizeMinusOneElements"] = _Const("")  # NOT NULL; NCCL kernels use no tensor maps
        if c.has("graph_node_id"):
            cols["graphNodeId"] = c.ints("graph_node_id", nullable=True)
        if c.has("graph_id") and "graphId" in table_cols:
            cols["graphId"] = c.ints("graph_id", nullable=True)
        self._track_span(c)
        self._insert_columns(table, cols, n)

    def add_runtime(self, df: pd.DataFrame | Mapping[str, Any]) -> None:
        """Append CUDA runtime/driver API calls to ``CUPTI_ACTIVITY_KIND_RUNTIME``.

        Columns (a DataFrame, or a mapping of column -> sequence or scalar): start, end, pid, tid,
        correlation_id, name (e.g. ``cudaLaunchKernel_v7000``, ``cuLaunchKernelEx``), event_class
        (0 runtime, 1 driver), return_value.
        """
        c = _Cols(df)
        c.require(["start", "end", "pid", "tid", "correlation_id", "name", "event_class"], "add_runtime")
        if c.n == 0:
            return
        cols: dict[str, list | _Const] = {
            "start": c.ints("start"),
            "end": c.ints("end"),
            "eventClass": c.ints("event_class"),
            "globalTid": self._gtid_col(c),
            "correlationId": c.ints("correlation_id", nullable=True),
            "nameId": self._intern_list(c.objects("name"), "name"),
            "returnValue": c.ints("return_value", default=0),
        }
        self._track_span(c)
        self._insert_columns("CUPTI_ACTIVITY_KIND_RUNTIME", cols, c.n)

    def add_nvtx_domain(self, pid: int, tid: int, name: str, start: int, *, record: bool = True) -> int:
        """Create an NVTX domain in process ``pid`` (an ``eventType = 75`` row); returns its
        domainId. Ids are per process and start at 1 (0 is the default domain). ``record=False``
        allocates the id without a row: a capture-range export whose nsys missed the creation
        (created before the capture) still numbers the domain's ranges."""
        domains = self._domains.setdefault(pid, {})
        domain_id = len(domains) + 1
        domains[domain_id] = name
        if not record:
            return domain_id
        gtid = encode_global_tid(pid, tid, self.hw_id, self.vm_id)
        row = {
            "start": int(start),
            "eventType": NVTX_DOMAIN_CREATE,
            "text": name,
            "globalTid": gtid,
            "domainId": domain_id,
        }
        if self._has_event_id:
            row["eventId"] = self._next_event_id
            self._next_event_id += 1
        # A domain kept from before a capture range has a negative time; the analysed span of a
        # real capture-range export still starts at the collection start (measured, 2022.4).
        self._track_time([max(int(start), 0)], [])
        self._insert("NVTX_EVENTS", list(row), [tuple(row.values())])
        return domain_id

    def add_nccl_payload_schemas(self, pid: int, domain_id: int, nccl_version: tuple) -> None:
        """Register NCCL ``nccl_version``'s payload schemas for (pid, domain_id).

        Writes ``NVTX_PAYLOAD_SCHEMAS`` / ``_SCHEMA_ENTRIES`` / ``_ENUMS`` / ``_ENUM_ENTRIES`` rows
        when the schema version has those tables (not 3.0.0). Those tables carry no globalPid, so
        rows are shared by all processes using the same domainId; registering a different NCCL
        layout under an already used (domainId, schemaId) raises ``ValueError``.
        """
        sset = nccl_payload_schemas(nccl_version)
        self._schemas[(pid, domain_id)] = sset
        self._schema_cache.clear()
        if "NVTX_PAYLOAD_SCHEMAS" not in self._ddl.creates or not sset.schemas:
            return
        schema_rows, entry_rows, enum_rows, enum_entry_rows = [], [], [], []
        for s in sset.schemas:
            sig = (s.name, s.size, s.entries)
            old = self._schema_rows.get((domain_id, s.schema_id))
            if old is not None:
                if old != sig:
                    raise ValueError(f"domain {domain_id} schema {s.schema_id} already registered with another layout")
                continue
            self._schema_rows[(domain_id, s.schema_id)] = sig
            schema_rows.append((domain_id, s.schema_id, s.name, NVTX_SCHEMA_TYPE_STATIC, 0, len(s.entries), s.size, 0))
            for i, e in enumerate(s.entries):
                entry_rows.append((domain_id, s.schema_id, i, 0, e.type, e.name, None, 0, e.offset))
        for en in sset.enums:
            sig = (en.entries, en.size)
            old = self._enum_rows.get((domain_id, en.schema_id))
            if old is not None:
                if old != sig:
                    raise ValueError(f"domain {domain_id} enum {en.schema_id} already registered differently")
                continue
            self._enum_rows[(domain_id, en.schema_id)] = sig
            enum_rows.append((domain_id, en.schema_id, None, len(en.entries), en.size))
            for i, (name, value) in enumerate(en.entries):
                enum_entry_rows.append((domain_id, en.schema_id, i, name, value, 0))
        schema_cols = ["domainId", "schemaId", "name", "type", "flags", "numEntries", "payloadSize", "alignTo"]
        entry_cols = ["domainId", "schemaId", "idx", "flags", "type", "name", "description", "arrayOrUnionDetail",
                      "offset"]  # fmt: skip
        if schema_rows:
            self._insert("NVTX_PAYLOAD_SCHEMAS", schema_cols, schema_rows)
            self._insert("NVTX_PAYLOAD_SCHEMA_ENTRIES", entry_cols, entry_rows)
        if enum_rows:
            self._insert("NVTX_PAYLOAD_ENUMS", ["domainId", "schemaId", "name", "numEntries", "size"], enum_rows)
            enum_entry_cols = ["domainId", "schemaId", "idx", "name", "value", "isFlag"]
            self._insert("NVTX_PAYLOAD_ENUM_ENTRIES", enum_entry_cols, enum_entry_rows)

    def _schema_for(self, pid: int, domain_id: int, text: str, payload: Mapping[str, Any]) -> PayloadSchema:
        key = (pid, domain_id, text, tuple(payload))
        schema = self._schema_cache.get(key)
        if schema is None:
            schema = self._schema_cache[key] = self._find_schema(pid, domain_id, text, payload)
        return schema

    def _find_schema(self, pid: int, domain_id: int, text: str, payload: Mapping[str, Any]) -> PayloadSchema:
        sset = self._schemas.get((pid, domain_id))
        if sset is None or not sset.schemas:
            raise ValueError(
                f"NCCL payload on range {text!r} (pid {pid}, domain {domain_id}) but no payload schemas registered "
                "for that domain: call add_nccl_payload_schemas() first (NCCL >= 2.16.2)"
            )
        keys = frozenset(payload)
        by_api = sset.by_api()
        api = text[4:] if text.startswith("nccl") else text
        schema = by_api.get(api)
        if schema is None:
            schema = next((s for s in sset.schemas if s.entry_names == keys), None)
        if schema is None or schema.entry_names != keys:
            want = sorted(schema.entry_names) if schema else "a registered schema"
            raise ValueError(
                f"NCCL payload keys {sorted(keys)} on range {text!r} do not match NCCL "
                f"{'.'.join(map(str, sset.nccl_version))} schema entries {want}"
            )
        return schema

    @staticmethod
    def _entry_value(entry: PayloadEntry, value: Any) -> int:
        if isinstance(value, str):
            try:
                return _REDOP_VALUES[value.lower()]
            except KeyError:
                raise ValueError(f"payload entry {entry.name!r}: unknown enum value {value!r}") from None
        return int(value)

    def add_nvtx_ranges(self, df: pd.DataFrame | Mapping[str, Any]) -> None:
        """Append NVTX ranges (or marks) to ``NVTX_EVENTS``.

        Columns (a DataFrame, or a mapping of column -> sequence or scalar): start, end, pid, tid,
        text, registered (True: registered string -> textId, else ASCII text), domain_id (0 =
        default), category, color (nullable), event_type (59 push/pop default, 60 start/end, 34
        mark). Optional: end_tid (thread that ended a start/end range; default the starting
        thread), range_id, uint64_value, int64_value, double_value, json_text, nccl_payload (dict
        of NCCL payload entry name -> value, stored per ``payload_mode``).
        """
        c = _Cols(df)
        c.require(["start", "pid", "tid", "text"], "add_nvtx_ranges")
        n = c.n
        if n == 0:
            return
        has_blob, has_eid = self._has_blob, self._has_event_id
        gtid_col = self._gtid_col(c)
        end_gtid_list = self._nvtx_end_gtids(c) if c.has("end_tid") else None
        etypes = c.ints("event_type", default=NVTX_PUSHPOP_RANGE)
        range_ids = c.ints("range_id", nullable=True)
        texts = c.objects("text")
        registered = c.objects("registered", False)
        if not set(map(type, registered)) <= {bool}:
            registered = [False if _is_missing(r) else bool(r) for r in registered]
        domains = c.ints("domain_id", default=0)
        u64 = c.ints("uint64_value", nullable=True)
        if isinstance(u64, _Const):
            u64 = _Const(None if u64.value is None else _signed64(u64.value))
        else:
            u64 = [None if v is None else _signed64(v) for v in u64]
        json_texts = [None if _is_missing(v) else v for v in c.objects("json_text")] if c.has("json_text") else None
        payloads = c.objects("nccl_payload") if c.has("nccl_payload") and self.payload_mode != "none" else None

        # per-row columns
        text_col, text_id = self._nvtx_text_columns(texts, registered, n)
        if has_eid:
            event_ids: list | None = list(range(self._next_event_id, self._next_event_id + n))
            self._next_event_id += n
        else:
            event_ids = None
        range_col, end_gt = self._nvtx_range_ids(etypes, range_ids, gtid_col, end_gtid_list, n)
        blobs: list | None = [None] * n if has_blob else None
        dynamic: dict[tuple[int, int, int], tuple[PayloadSchema, list]] = {}
        links: list[tuple] = []
        if payloads is not None:
            if json_texts is None:
                json_texts = [None] * n
            self._nvtx_payloads(c, payloads, texts, domains, gtid_col, event_ids, json_texts, blobs, dynamic, links)
        cols: dict[str, list | _Const] = {
            "start": c.ints("start"),
            "end": c.ints("end", nullable=True) if c.has("end") else _Const(None),
            "eventType": etypes,
            "rangeId": range_col,
            "category": c.ints("category", nullable=True),
            "color": c.ints("color", nullable=True),
            "text": text_col,
            "globalTid": gtid_col,
            "endGlobalTid": end_gt,
            "textId": text_id,
            "domainId": domains,
            "uint64Value": u64,
            "int64Value": c.ints("int64_value", nullable=True),
            "doubleValue": _Const(None) if not c.has("double_value") else
            [None if _is_missing(v) else float(v) for v in c.objects("double_value")],
            "jsonText": _Const(None) if json_texts is None else json_texts,
        }  # fmt: skip
        if has_blob:
            cols["binaryData"] = blobs if blobs is not None else _Const(None)
        if has_eid:
            cols["eventId"] = event_ids if event_ids is not None else _Const(None)
        self._track_span(c)
        self._insert_columns("NVTX_EVENTS", cols, n)
        for (gpid, dom, sid), (schema, drows) in dynamic.items():
            self._write_dynamic(gpid, dom, schema, drows)
        if links:
            self._insert("NVTX_EVENTS_PAYLOAD_SCHEMAS", ["eventId", "globalPid", "domainId", "payloadSchemaID"], links)

    def _nvtx_end_gtids(self, c: _Cols) -> list:
        """Per row, the globalTid of the thread that ended the range (``end_tid``, else ``tid``)."""
        n = c.n
        if c.df is not None:
            return self._gtid_array(c.df["pid"], c.df["end_tid"].fillna(c.df["tid"])).tolist()
        et_ = c.objects("end_tid")
        t_ = c.objects("tid")
        tmp = _Cols({"pid": c.map["pid"], "tid": [t if _is_missing(e) else e for e, t in zip(et_, t_)]})
        end_gtid_col = self._gtid_col(tmp)
        return [end_gtid_col.value] * n if isinstance(end_gtid_col, _Const) else end_gtid_col

    def _nvtx_text_columns(self, texts: list, registered: list, n: int) -> tuple[list | _Const, list | _Const]:
        """The ``text`` and ``textId`` columns: registered strings are interned (in order of first
        appearance) and go to ``textId``, the others stay as ASCII text."""
        intern = self._intern
        if False not in registered:  # registered strings only
            ids = {t: intern(t) for t in dict.fromkeys(texts)}
            return _Const(None), list(map(ids.__getitem__, texts))
        if True not in registered:
            return texts, _Const(None)
        mask = np.fromiter(registered, dtype=bool, count=n)
        reg_texts = list(itertools.compress(texts, registered))
        ids = {t: intern(t) for t in dict.fromkeys(reg_texts)}
        tc = np.array(texts + [None], dtype=object)[:-1]  # (the None keeps tuples as objects)
        tc[mask] = None
        ti = np.full(n, None, dtype=object)
        ti[mask] = list(map(ids.__getitem__, reg_texts))
        return tc.tolist(), ti.tolist()

    def _nvtx_range_ids(self, etypes: list | _Const, range_ids: list | _Const, gtid_col: list | _Const,
                        end_gtid_list: list | None, n: int) -> tuple[list | _Const, list | _Const]:  # fmt: skip
        """The ``rangeId`` and ``endGlobalTid`` columns: start/end ranges get a range id (when none
        is given) and their ending thread; other events neither."""
        et_list = [etypes.value] * n if isinstance(etypes, _Const) else etypes
        if NVTX_STARTEND_RANGE not in et_list:
            return range_ids, _Const(None)
        rids = [range_ids.value] * n if isinstance(range_ids, _Const) else list(range_ids)
        gt_list = [gtid_col.value] * n if isinstance(gtid_col, _Const) else gtid_col
        egts = end_gtid_list if end_gtid_list is not None else gt_list
        end_gt: list = []
        for i, et in enumerate(et_list):
            if et == NVTX_STARTEND_RANGE:
                if rids[i] is None:
                    rids[i] = self._next_range_id
                    self._next_range_id += 1
                end_gt.append(egts[i])
            else:
                end_gt.append(None)
        return rids, end_gt

    def _nvtx_payloads(self, c: _Cols, payloads: list, texts: list, domains: list | _Const, gtid_col: list | _Const,
                       event_ids: list | None, json_texts: list, blobs: list | None,
                       dynamic: dict[tuple[int, int, int], tuple[PayloadSchema, list]], links: list) -> None:  # fmt: skip
        """Store each row's NCCL payload as ``payload_mode`` says: JSON text (into ``json_texts``),
        a binary blob (into ``blobs``), or dynamic-payload rows (into ``dynamic``, per table, with
        the event's schema link in ``links``)."""
        mode = self.payload_mode
        n = c.n
        pids = c.int_array("pid").tolist()
        dom_list = [domains.value] * n if isinstance(domains, _Const) else domains
        gt_list = [gtid_col.value] * n if isinstance(gtid_col, _Const) else gtid_col
        for i, pl in enumerate(payloads):
            if not (isinstance(pl, Mapping) and pl):
                continue
            if mode == "json":
                if json_texts[i] is not None:
                    raise ValueError(f"range {texts[i]!r} has both json_text and nccl_payload")
                json_texts[i] = json.dumps(dict(pl))
                continue
            schema = self._schema_for(pids[i], dom_list[i], str(texts[i]), pl)
            values = [self._entry_value(en, pl[en.name]) for en in schema.entries]
            if mode == "blob":
                if blobs is not None:
                    blobs[i] = _payload_struct(schema).pack(schema.schema_id, *values)
            else:
                event_id = event_ids[i] if event_ids is not None else None
                gpid = gt_list[i] & ~_ID24
                key = (gpid, dom_list[i], schema.schema_id)
                dynamic.setdefault(key, (schema, []))[1].append(
                    (event_id, *[_signed64(v) if en.fmt == "Q" else v for en, v in zip(schema.entries, values)])
                )
                links.append((event_id, gpid, dom_list[i], schema.schema_id))

    def _write_dynamic(self, gpid: int, domain_id: int, schema: PayloadSchema, rows: list) -> None:
        table = f"DYNAMIC_NVTXPAYLOAD_DATATYPE_{gpid}_{domain_id}_{schema.schema_id}"
        names = [sanitize_column_name(e.name) for e in schema.entries]
        if table not in self._created:
            # Unsigned and float32 fields are widened to int64/REAL, as nsys documents.
            decl = ", ".join(f'"{n}" {"REAL" if e.fmt in "fd" else "INTEGER"}' for n, e in zip(names, schema.entries))
            self._db.execute(f'CREATE TABLE "{table}" (eventId INTEGER NOT NULL, {decl})')
            self._created[table] = ["eventId", *names]
            new = [(e.name, n) for e, n in zip(schema.entries, names) if e.name not in self._translations]
            if new:
                self._translations.update(e for e, _ in new)
                self._insert("NVTX_EXPORT_TRANSLATION", ["originalName", "sanitizedName"], new)
        self._insert(table, ["eventId", *names], rows)

    # ------------------------------------------------------------------ finish

    def _metadata_rows(self) -> list[tuple[str, str]]:
        """Metadata rows: the 17 keys of the real 2022.4 export for 3.0.0; for newer schemas only
        the keys documented as seen in newer exports (plus the time-normalisation flag)."""
        export_ns = self.session_start_utc_ns + max(self._t_max or 0, 0) + 1_000_000_000
        export_time = _utc_string(export_ns)
        if self.schema_version != "3.0.0":
            return [
                ("EXPORT_PRODUCT_NAME", "NVIDIA Nsight Systems"),
                ("EXPORT_PRODUCT_VERSION", self.product_version),
                ("EXPORT_SCHEMA_VERSION", self.schema_version),
                ("EXPORT_PLATFORM", "linux-desktop"),
                ("EXPORT_ARCH", "x64"),
                ("EXPORT_TIME_UTC", export_time),
                ("EXPORT_PARAM_TIME_NORMALIZE", "true" if self.time_normalized else "false"),
            ]
        major, minor, micro = self.schema_version.split(".")
        return [
            ("EXPORT_PRODUCT_NAME", "NVIDIA Nsight Systems"),
            ("EXPORT_PRODUCT_VERSION", self.product_version),
            ("EXPORT_PRODUCT_DATE", ".".join(self.product_version.split(".")[:2])),
            ("EXPORT_SCHEMA_VERSION", self.schema_version),
            ("EXPORT_SCHEMA_VERSION_MAJOR", major),
            ("EXPORT_SCHEMA_VERSION_MINOR", minor),
            ("EXPORT_SCHEMA_VERSION_MICRO", micro),
            # Checksum of the full 3.0.0 schema as printed by nsys 2022.4.2.1.
            ("EXPORT_SCHEMA_VERSION_CKSUM", "4042420554 115894"),
            ("EXPORT_PLATFORM", "linux-desktop"),
            ("EXPORT_ARCH", "x64"),
            ("EXPORT_TIME", "0.01"),
            ("EXPORT_TIME_UTC", export_time),
            ("EXPORT_TIME_LOCAL", export_time),
            ("EXPORT_INPUT_FILE", self.path.with_suffix(".nsys-rep").name),
            ("EXPORT_OUTUPT_FILE", self.path.name),  # (sic) key spelling of nsys 2022.4
            ("EXPORT_OVERWRITE", "true"),
            ("EXPORT_LAZY", "true"),
        ]

    def close(self) -> None:
        """Finish the export: write always-present tables and metadata, then atomically rename
        the temporary file to ``path``. Calling it again is a no-op."""
        if self._conn is None:
            return
        try:
            t0 = self._t_min if self._t_min is not None else 0
            t1 = self._t_max if self._t_max is not None else t0
            if self.session_clock_ns is not None:  # real 2025+ exports: the analysis starts with the session
                t0 = self.session_clock_ns
                t1 = max(t1, t0)
            self._insert(
                "ANALYSIS_DETAILS",
                ["globalVid", "duration", "startTime", "stopTime"],
                [(self._global_vid, t1 - t0, t0, t1)],
            )
            self._create("ThreadNames")
            self._insert("ThreadNames", ["nameId", "priority", "globalTid"], self._thread_names)
            for table in self._ddl.creates:
                if table.startswith("ENUM_"):
                    self._create(table)
            self._create(self._meta_table)
            self._insert(self._meta_table, ["name", "value"], self._metadata_rows())
            self._flush_strings()
            self._conn.commit()
            self._conn.close()
            self._conn = None
            if self._fsync:
                with open(self._tmp, "rb+") as fh:
                    os.fsync(fh.fileno())
            os.chmod(self._tmp, 0o666 & ~_umask())  # mkstemp creates 0600; use normal permissions
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Discard the export: close the connection and delete the temporary file."""
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None
        try:
            self._tmp.unlink()
        except FileNotFoundError:
            pass

    def __del__(self) -> None:  # pragma: no cover - safety net for writers never closed
        try:
            if getattr(self, "_conn", None) is not None:
                self.abort()
        except Exception:
            pass
