"""Documented Parquet tables passed between stages, and atomic streaming writers for them.

Every table has a fixed Arrow schema; each column carries a unit and a one-line meaning
(rendered into ``docs/tables.md`` by ``nccltrace tables-doc``, :mod:`nccltrace.outputs.tables_doc`). Writers stream row
batches into a temporary file and rename it into place on success, so an interrupted
stage never leaves a truncated table where a complete one is expected.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = "1"


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    unit: str
    doc: str


def documented_field(name: str, typ: pa.DataType, unit: str, doc: str) -> pa.Field:
    """An Arrow field carrying its unit and meaning (rendered by ``tables_doc.tables_markdown``)."""
    return pa.field(name, typ, metadata={"unit": unit, "doc": doc})


def _schema(columns: Iterable[Column], table: str, doc: str) -> pa.Schema:
    fields = [documented_field(c.name, c.type, c.unit, c.doc) for c in columns]
    return pa.schema(fields, metadata={"table": table, "doc": doc, "nccltrace_schema_version": SCHEMA_VERSION})


_NULLABLE_DTYPES = {"string": "string", "int64": "Int64", "int32": "Int32", "uint64": "UInt64", "double": "Float64",
                    "bool": "boolean"}


def coerce_to_schema(df, schema: pa.Schema):
    """The columns of ``schema`` in its order, as pandas nullable dtypes (absent columns all null;
    types without a nullable dtype, such as lists, as they are)."""
    import pandas as pd

    types = _nullable_types()
    out = pd.DataFrame(index=df.index)
    for field in schema:
        col = df[field.name] if field.name in df else pd.Series([None] * len(df), index=df.index, dtype=object)
        out[field.name] = col.astype(types[field.type]) if field.type in types else col
    return out


_SRC = [
    Column("file", pa.string(), "", "log file the line came from (name relative to the parsed directory)"),
    Column("line", pa.int64(), "", "1-based line number in that file"),
    Column("host", pa.string(), "", "host name from the line prefix (null if the prefix was trimmed/torn off)"),
    Column("pid", pa.int64(), "", "process id from the line prefix"),
    Column("tid", pa.int64(), "", "thread id from the line prefix (= pid on the main thread)"),
    Column("cuda_dev", pa.int32(), "", "[cudaDev] of the prefix: CUDA device of the logging thread, NOT the rank"),
]
_WALL = [
    Column("wall_time_ns", pa.int64(), "ns", "wall-clock time of the line when it has a timestamp (null otherwise)"),
    Column("wall_clock", pa.string(), "", "'epoch' (UTC epoch) or 'local' (host local time read as if UTC) or null"),
]

TABLES: dict[str, pa.Schema] = {
    "calls": _schema(
        _SRC
        + _WALL
        + [
            Column("op", pa.string(), "", "NCCL function as logged: AllReduce, AllGather, ReduceScatter, Broadcast, "
                   "Reduce, Send, Recv, AlltoAll, Gather, Scatter, ..."),
            Column("op_count", pa.int64(), "", "opCount (hex in the log): kernel plans launched on the comm so far; "
                   "shared by all ops of one group"),
            Column("sendbuff", pa.uint64(), "address", "send buffer (0 = (nil)); Send logs its buffer in recvbuff from 2.12"),
            Column("recvbuff", pa.uint64(), "address", "receive buffer (0 = (nil))"),
            Column("count", pa.int64(), "elements", "element count as passed: AllGather = per-rank send count, "
                   "ReduceScatter = per-rank recv count, AlltoAll = per-peer count"),
            Column("datatype", pa.int8(), "", "ncclDataType_t value"),
            Column("datatype_name", pa.string(), "", "decoded datatype; 'unknown(v)' when the value does not exist "
                   "in the file's NCCL version"),
            Column("redop", pa.int32(), "", "ncclRedOp_t value (0 for non-reductions and P2P)"),
            Column("redop_name", pa.string(), "", "decoded reduction op"),
            Column("root", pa.int32(), "", "root rank for Broadcast/Reduce/Gather/Scatter; PEER rank (in the comm) "
                   "for Send/Recv; 0 otherwise"),
            Column("comm", pa.uint64(), "address", "process-local communicator pointer; join with comms.comm on (host, pid)"),
            Column("nranks", pa.int32(), "", "communicator size"),
            Column("stream", pa.uint64(), "address", "CUDA stream (0 = legacy default stream)"),
            Column("bytes", pa.int64(), "B", "per-rank payload of this call: count x datatype size (AllGather: bytes "
                   "this rank sends; ReduceScatter: bytes it receives; Send/Recv: bytes to/from the peer)"),
            Column("message_bytes", pa.int64(), "B", "nccl-tests message size S for algorithm bandwidth: bytes x nranks "
                   "for AllGather/ReduceScatter/AlltoAll/Gather/Scatter, bytes otherwise"),
            Column("duplicate_of", pa.int64(), "", "line of the identical earlier call this line duplicates (same comm, "
                   "opCount and arguments); null for original lines. Collapsed view: duplicate_of IS NULL"),
            Column("recovery", pa.string(), "", "null for clean lines; how a torn/interleaved line was recovered "
                   "('split', 'rejoined', 'no_prefix', 'host_suffix')"),
        ],
        "calls",
        "One row per NCCL collective/P2P call line (COLL subsystem).",
    ),
    "comms": _schema(
        _SRC
        + _WALL
        + [
            Column("event", pa.string(), "", "'init', 'split', 'destroy', 'abort', 'revoke' or 'legacy_init' (<=2.4)"),
            Column("phase", pa.string(), "", "'START' or 'COMPLETE' (null for legacy lines)"),
            Column("api", pa.string(), "", "API name printed from 2.21.5 (ncclCommInitRank, ncclCommInitRankConfig, "
                   "ncclCommSplit, ...); null when not printed"),
            Column("comm", pa.uint64(), "address", "process-local communicator pointer"),
            Column("rank", pa.int32(), "", "this process's rank in the communicator"),
            Column("nranks", pa.int32(), "", "communicator size"),
            Column("comm_cuda_dev", pa.int32(), "", "cudaDev field of the init line"),
            Column("nvml_dev", pa.int32(), "", "nvmlDev: physical GPU index (null before 2.18.3)"),
            Column("bus_id", pa.int64(), "", "PCI bus id of the GPU (hex in the log)"),
            Column("comm_id", pa.uint64(), "", "commId printed by the init line (shared by all members; equals the NVTX "
                   "communicator id only from 2.26.2; null for split comms from 2.23)"),
            Column("parent", pa.uint64(), "address", "parent communicator pointer of a split comm"),
            Column("color", pa.int64(), "", "split color (members = parent's ranks with the same color)"),
            Column("key", pa.int64(), "", "split key (orders ranks in the child)"),
            Column("split_count", pa.int32(), "", "splitCount (2.24-2.28) / childCount (>=2.29)"),
        ],
        "comms",
        "Communicator lifecycle lines: Init START/COMPLETE (plain and split), Destroy/Abort.",
    ),
    "comm_info": _schema(
        _SRC
        + [
            Column("comm", pa.uint64(), "address", "communicator pointer"),
            Column("rank", pa.int32(), "", "rank in the communicator"),
            Column("nranks", pa.int32(), "", "communicator size"),
            Column("nnodes", pa.int32(), "", "number of nodes spanned"),
            Column("local_ranks", pa.int32(), "", "ranks of this comm on this node"),
            Column("local_rank", pa.int32(), "", "this rank's index among them"),
        ],
        "comm_info",
        "`comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d` lines (>= 2.20).",
    ),
    "tuning": _schema(
        _SRC
        + _WALL
        + [
            Column("kind", pa.string(), "", "'standard', 'symmetric', 'copy_engine' or 'hierarchical_ce'"),
            Column("format", pa.string(), "", "line format: 'bytes_numeric' (2.20-2.22), 'op_bytes_numeric' (2.23), "
                   "'op_bytes_named' (>=2.24), or the kind for special paths"),
            Column("op", pa.string(), "", "collective (null for the 2.20-2.22 format which does not print it)"),
            Column("tuning_bytes", pa.int64(), "B", "bytes as printed: 2.20-2.23 full buffer (x nranks for AllGather/"
                   "ReduceScatter, possibly an aggregate of a group); >=2.24 per-rank task bytes"),
            Column("algo", pa.string(), "", "algorithm name (numeric codes decoded)"),
            Column("proto", pa.string(), "", "protocol name (numeric codes decoded)"),
            Column("time_us", pa.float64(), "us", "model-predicted time printed by 2.20-2.23 (null otherwise)"),
            Column("channel_lo", pa.int32(), "", "first channel (>=2.24)"),
            Column("channel_hi", pa.int32(), "", "last channel (>=2.24)"),
            Column("sym_kernel", pa.string(), "", "symmetric kernel variant ([Symmetric] lines)"),
            Column("nchannels", pa.int32(), "", "channels ([Symmetric] lines)"),
            Column("nthreads", pa.int32(), "", "threads ([Symmetric] lines)"),
            Column("call_line", pa.int64(), "", "line (same file) of the call this line was attached to; null if no "
                   "call matched unambiguously"),
            Column("n_calls", pa.int32(), "", "number of consecutive calls the line covers (aggregates in 2.20-2.23)"),
        ],
        "tuning",
        "Algorithm/protocol (TUNING) lines, attached to their call where the bytes identify it.",
    ),
    "topology_links": _schema(
        _SRC
        + [
            Column("system", pa.int32(), "", "index of the topology dump within the file (0-based)"),
            Column("from_node", pa.string(), "", "node id as printed, e.g. 'CPU/0', 'GPU/0-1a000'"),
            Column("link_type", pa.string(), "", "LOC, NVL, PCI, SYS, NET or C2C"),
            Column("bw_gbps", pa.float64(), "GB/s", "link bandwidth printed in brackets"),
            Column("to_node", pa.string(), "", "remote node id as printed"),
            Column("to_detail", pa.string(), "", "text in parentheses after the remote node (GPU rank, NET guid/port/bw, ...)"),
            Column("depth", pa.int32(), "", "nesting depth below the CPU node"),
        ],
        "topology_links",
        "Every link of every topology dump (`=== System : ...` blocks).",
    ),
    "topology_systems": _schema(
        _SRC
        + [
            Column("system", pa.int32(), "", "index of the dump within the file"),
            Column("max_bw_gbps", pa.float64(), "GB/s", "maxBw of the system header"),
            Column("total_bw_gbps", pa.float64(), "GB/s", "totalBw of the system header"),
        ],
        "topology_systems",
        "Topology dump headers.",
    ),
    "rings": _schema(
        _SRC
        + [
            Column("kind", pa.string(), "", "'ring' (Channel NN/MM : r r r) or 'tree' (Trees [c] d0/d1/d2->r->up)"),
            Column("channel", pa.int32(), "", "channel index (ring lines)"),
            Column("nchannels", pa.int32(), "", "number of channels (ring lines)"),
            Column("ranks", pa.string(), "", "ring order as space-separated ranks, or the tree entries as printed"),
            Column("truncated", pa.bool_(), "", "True when NCCL truncated the line (<=2.22 20-rank cap, >=2.23 127 chars)"),
        ],
        "rings",
        "Ring order and tree lines printed at communicator init.",
    ),
    "versions": _schema(
        _SRC
        + [
            Column("version", pa.string(), "", "NCCL version major.minor.patch"),
            Column("suffix", pa.string(), "", "build suffix (e.g. '.MSCCL.0.7.3')"),
            Column("cuda", pa.string(), "", "CUDA version NCCL was built with"),
        ],
        "versions",
        "`NCCL version X+cudaY` lines (bare or INFO).",
    ),
    "warnings": _schema(
        _SRC
        + _WALL
        + [
            Column("source", pa.string(), "", "source location printed before 'NCCL WARN' (file:line, function)"),
            Column("message", pa.string(), "", "warning text"),
        ],
        "warnings",
        "NCCL WARN lines.",
    ),
    "unclassified": _schema(
        [
            Column("file", pa.string(), "", "log file"),
            Column("line", pa.int64(), "", "1-based line number"),
            Column("reason", pa.string(), "", "why the line was not classified as an NCCL record"),
            Column("text", pa.string(), "", "the line (first 240 characters, undecodable bytes escaped)"),
        ],
        "unclassified",
        "Every line that is not an NCCL record or could not be parsed, with the reason.",
    ),
}


def empty_table(name: str) -> pa.Table:
    """An empty table with the documented schema."""
    return TABLES[name].empty_table()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_path(path: Path) -> Path:
    """A temporary sibling of ``path`` for write-then-rename.

    mkstemp creates files readable by the owner only; give the file the permissions a plain
    ``open()`` would (0666 minus the umask) so results stay readable in shared project directories.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())
    os.close(fd)
    return Path(tmp)


@contextlib.contextmanager
def atomic_output(path: Path | str) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; it replaces ``path`` when the block
    succeeds and is removed when it fails, so ``path`` is always either the old file or the
    whole new one (an interrupted run never leaves a torn output)."""
    path = Path(path)
    tmp = atomic_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON via a temporary file and rename."""
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def pandas_metadata(schema: pa.Schema) -> bytes:
    """The ``pandas`` metadata of a Parquet file of ``schema``, derived from its Arrow types alone:
    every column reads back in pandas as the nullable dtype of the one map every reader converts
    with (``nullable_types``; other types as pyarrow converts them). pyarrow's ``from_pandas``
    records the dtypes of the frame it was given instead, so a frame column of another dtype than
    its schema's (an all-null ``Int64`` column stored as ``bool``) made ``pandas.read_parquet``
    fail, and an Arrow-built table without pandas metadata read nullable 64-bit ids as float64."""
    import pandas as pd
    from pyarrow.pandas_compat import get_logical_type

    types = _nullable_types()
    columns = [{"name": f.name, "field_name": f.name, "pandas_type": get_logical_type(f.type),
                "numpy_type": str(types[f.type]) if f.type in types else "object", "metadata": None}
               for f in schema]  # fmt: skip
    return json.dumps({"index_columns": [], "column_indexes": [], "columns": columns, "attributes": {},
                       "creator": {"library": "nccltrace", "version": SCHEMA_VERSION},
                       "pandas_version": pd.__version__}).encode()  # fmt: skip


def file_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` as it is written to a file: its own metadata plus the ``pandas`` metadata its
    Arrow types give (:func:`pandas_metadata`). Every Parquet writer of the package writes this."""
    meta = {k: v for k, v in (schema.metadata or {}).items() if k != b"pandas"}
    return schema.with_metadata({**meta, b"pandas": pandas_metadata(schema)})


def frame_to_table(frame, schema: pa.Schema) -> pa.Table:
    """A pandas frame as an Arrow table of ``schema`` (its columns in the schema's order, each
    converted to the schema's type: a value the type cannot hold raises), with the file metadata
    of :func:`file_schema`, whatever dtypes the frame had."""
    table = pa.Table.from_pandas(frame[schema.names], schema=schema, preserve_index=False)
    return table.replace_schema_metadata(file_schema(schema).metadata)


def schema_problems(actual: pa.Schema, documented: pa.Schema) -> list[str]:
    """How a written file's schema differs from its documented one: missing, extra or reordered
    columns, other types, and pandas metadata that names another dtype than the Arrow type gives
    (empty when the file is as documented)."""
    problems = []
    if actual.names != documented.names:
        missing = [n for n in documented.names if n not in actual.names]
        extra = [n for n in actual.names if n not in documented.names]
        problems.append(f"columns differ: missing {missing}, undocumented {extra}" if missing or extra
                        else "columns in another order than documented")  # fmt: skip
    for field in documented:
        if field.name in actual.names and actual.field(field.name).type != field.type:
            problems.append(f"column {field.name!r}: {actual.field(field.name).type}, documented {field.type}")
    stored = json.loads((actual.metadata or {}).get(b"pandas", b"null"))
    if stored is None:
        problems.append("no pandas metadata (pandas would read nullable integers as float64)")
    else:
        want = {c["name"]: c["numpy_type"] for c in json.loads(pandas_metadata(actual))["columns"]}
        problems += [f"column {c['name']!r}: pandas metadata says {c['numpy_type']}, its Arrow type reads as "
                     f"{want.get(c['name'])}" for c in stored["columns"] if want.get(c["name"]) != c["numpy_type"]]
    return problems


def write_table_atomic(table: pa.Table, path: Path) -> None:
    """Write a whole table to Parquet atomically, with the pandas metadata its Arrow types give
    (:func:`file_schema`), so the file opens the same in pandas, pyarrow, DuckDB and Polars."""
    table = table.replace_schema_metadata(file_schema(table.schema).metadata)
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


@contextlib.contextmanager
def parquet_writer(path: Path | str, schema: pa.Schema, **options: Any) -> Iterator[pq.ParquetWriter]:
    """A streaming Parquet writer of ``schema`` (with :func:`file_schema`'s metadata) to a
    temporary sibling of ``path``, renamed into place when the block succeeds (``options``: those
    of ``pyarrow.parquet.ParquetWriter``; zstd unless given)."""
    options.setdefault("compression", "zstd")
    with atomic_output(path) as tmp, pq.ParquetWriter(tmp, file_schema(schema), **options) as writer:
        yield writer


class TableSink:
    """Stream rows of one documented table into a Parquet file in bounded batches.

    Rows are appended column-wise (``append(row_tuple)`` in schema order) and flushed
    every ``batch_rows`` rows as a row group; ``close()`` renames the file into place.
    """

    def __init__(self, name: str, path: Path, batch_rows: int = 200_000) -> None:
        self.name = name
        self.schema = TABLES[name]
        self.path = Path(path)
        self.batch_rows = batch_rows
        self._columns: list[list[Any]] = [[] for _ in self.schema.names]
        self._tmp = atomic_path(self.path)
        # Dictionary-encode only strings: trying it on all-unique int64 columns (lines, pointers)
        # costs ~40% of write time for no size gain.
        strings = [f.name for f in self.schema if pa.types.is_string(f.type)]
        self._writer = pq.ParquetWriter(self._tmp, file_schema(self.schema), compression="zstd",
                                        use_dictionary=strings)
        self.rows = 0

    def append(self, row: tuple) -> None:
        for col, value in zip(self._columns, row):
            col.append(value)
        self.rows += 1
        if len(self._columns[0]) >= self.batch_rows:
            self.flush()

    def write_table(self, table: pa.Table) -> None:
        """Append a whole Arrow table with this sink's schema (after any pending rows)."""
        self.flush()
        self._writer.write_table(table, row_group_size=self.batch_rows)
        self.rows += table.num_rows

    def flush(self) -> None:
        if not self._columns[0]:
            return
        arrays = [pa.array(col, type=field.type) for col, field in zip(self._columns, self.schema)]
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=self.schema))
        self._columns = [[] for _ in self.schema.names]

    def close(self) -> Path:
        self.flush()
        self._writer.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Discard the partial file (on error); safe to call after close()."""
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - the file is being thrown away
            pass
        finally:
            self._tmp.unlink(missing_ok=True)


def nullable_types(only: Iterable[pa.DataType] | None = None) -> dict:
    """Arrow type -> nullable pandas dtype, the one map every reader converts with (``only``:
    just these Arrow types; others keep pyarrow's default conversion)."""
    types = _nullable_types()
    return types if only is None else {t: types[t] for t in only}


def _nullable_types() -> dict:
    import pandas as pd

    return {
        pa.int8(): pd.Int8Dtype(), pa.int16(): pd.Int16Dtype(), pa.int32(): pd.Int32Dtype(),
        pa.int64(): pd.Int64Dtype(), pa.uint8(): pd.UInt8Dtype(), pa.uint16(): pd.UInt16Dtype(),
        pa.uint32(): pd.UInt32Dtype(), pa.uint64(): pd.UInt64Dtype(), pa.bool_(): pd.BooleanDtype(),
        pa.float32(): pd.Float32Dtype(), pa.float64(): pd.Float64Dtype(), pa.string(): pd.StringDtype(),
    }


def read_table_batch(batch: pa.RecordBatch | pa.Table):
    """A record batch (e.g. from ``ParquetFile.iter_batches``) as pandas, converted like ``read_table``."""
    return batch.to_pandas(types_mapper=_nullable_types().get)


def iter_record_batches(path: Path | str, columns: list[str] | None = None,
                        batch_rows: int = 1 << 16) -> Iterator[pa.RecordBatch]:  # fmt: skip
    """A Parquet table in record batches of about ``batch_rows`` rows (fewer at the end, up to
    twice as many where small row groups are joined), with those of ``columns`` the file has (all
    when None). Read one row group at a time: one ``iter_batches`` over a whole file kept buffers
    of every row group read so far (pyarrow 26: +30 MiB per row group of 2^20 ops rows). Batches of
    small row groups (the ops table has one per process) are joined: thousands of batches of a few
    thousand rows made the report 7 times slower."""
    pf = pq.ParquetFile(path)
    cols = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
    pending: list[pa.RecordBatch] = []
    for group in range(pf.metadata.num_row_groups):
        for batch in pf.iter_batches(batch_size=batch_rows, columns=cols, row_groups=[group]):
            pending.append(batch)
            if sum(b.num_rows for b in pending) >= batch_rows:
                yield pending[0] if len(pending) == 1 else pa.concat_batches(pending)
                pending = []
    if pending:
        yield pending[0] if len(pending) == 1 else pa.concat_batches(pending)


def iter_table_batches(path: Path | str, columns: list[str] | None = None,
                       batch_rows: int = 1 << 16) -> Iterator:  # fmt: skip
    """:func:`iter_record_batches` as pandas frames, converted like ``read_table``: memory holds
    about one row group of the file and one batch."""
    for batch in iter_record_batches(path, columns, batch_rows):
        yield read_table_batch(batch)


def read_table(path: Path | str, columns: list[str] | None = None, filters: Any = None):
    """Read a table into pandas with nullable integer dtypes (``filters``: a pyarrow expression
    or DNF list, applied while reading, so rows it excludes never reach memory).

    The default pandas conversion turns nullable 64-bit columns into float64, which
    silently corrupts communicator ids and pointers above 2^53; always read through here.
    """
    # List columns (e.g. communicator members) stay Python lists.
    return pq.read_table(path, columns=columns, filters=filters).to_pandas(types_mapper=_nullable_types().get)
