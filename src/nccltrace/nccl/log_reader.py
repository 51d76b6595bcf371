"""Streaming reader for NCCL debug logs (``NCCL_DEBUG=INFO``), all versions 2.4 - 2.30.

Logs are large and come as launchers left them, so the reader works on bytes in constant memory
(records go to :class:`~nccltrace.core.tables.TableSink` writers in bounded batches), finds
records in launcher "prefix soup", rejoins torn lines and drops nothing silently: every line it
cannot take lands in ``unclassified`` with its file, line and reason. By default
(``parse_logs(fast=True)``) the clean call and TUNING lines go through the compiled scanner of
:mod:`nccltrace.nccl.fast_scan`, with the same tables as the line-by-line parser below. Rules,
limits and the fast path's design: ``docs/nccl-log-parsing.md``.
"""

from __future__ import annotations

import calendar
import collections
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa

from nccltrace.core.layout import PARSE_REPORT_FILE
from nccltrace.core.tables import TABLES, TableSink, write_json_atomic
from nccltrace.nccl.enums import (
    ALGORITHMS,
    ALL_OPS,
    DATATYPES,
    PROTOCOLS,
    bus_message_bytes,
    redop_name,
)
from nccltrace.nccl.versions import NcclVersion

# --- patterns -------------------------------------------------------------------------
# host:pid:tid [dev] directly before the level token (hosts: letters, digits, '.', '_', '-').
_PREFIX_TAIL = re.compile(rb"([A-Za-z0-9_.\-]+):(\d+):(\d+) \[(-?\d+)\] $")
_DEV_ONLY_TAIL = re.compile(rb"\[(-?\d+)\] $")
_RECORD_START = re.compile(rb"([A-Za-z0-9_.\-]+):(\d+):(\d+) \[(-?\d+)\] NCCL (?:INFO|WARN) ")
_TS_BRACKET = re.compile(rb"\[(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?\] ")
_TS_EPOCH = re.compile(rb"(?:^|\s)(\d{9,11})\.(\d{1,9}) ")
_WARN_PREFIX = re.compile(rb"([A-Za-z0-9_.\-]+):(\d+):(\d+) \[(-?\d+)\] (.*?) ?$")

_CALL = re.compile(
    rb"(\w+): opCount ([0-9a-fA-F]+) sendbuff (\S+) recvbuff (\S+) count (-?\d+) datatype (-?\d+) "
    rb"op (-?\d+) root (-?\d+) comm (\S+) \[nranks=(\d+)\] stream (\S+)\s*$"
)
_TUNE_NAMED = re.compile(
    rb"(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+) channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\}\s*$"
)
_TUNE_NUMERIC = re.compile(rb"(?:(\w+): )?(\d+) Bytes -> Algo (\d+) proto (\d+) time (-?[\d.]+|nan|inf)\s*$")
_TUNE_SYM = re.compile(
    rb"(\w+) \[Symmetric\]: (\d+) Bytes -> Kernel (\S+) nchannels (\d+) nthreads (\d+)(?: nWorks (\d+))?\s*$"
)
_TUNE_CE = re.compile(rb"(\w+) \[Copy Engine\]: (\d+) Bytes -> cudaMemcpy(\S*)\s*$")
_TUNE_HCE = re.compile(rb"(\w+) \[Hierarchical CE\]: (\d+) Bytes -> RMA proxy \+ CE\s*$")
_INIT = re.compile(
    rb"(?:\[Rank (\d+)\] )?(?:(\w+) )?comm (\S+) rank (\d+) nranks (\d+) cudaDev (\d+)(?: nvmlDev (\d+))? "
    rb"busId ([0-9a-fA-F]+)(?: parent (\S+))?(?: (?:splitCount|childCount) (\d+))?"
    rb"(?: color (-?\d+) key (-?\d+))?(?: commId 0x([0-9a-fA-F]+))? ?- Init (START|COMPLETE)\s*$"
)
_INIT_LEGACY = re.compile(rb"comm (\S+) rank (\d+) nranks (\d+) cudaDev (\d+) nvmlDev (\d+)\s*$")
_DESTROY = re.compile(
    rb"comm (\S+) rank (\d+) n[rR]anks (\d+) cudaDev (\d+) busId ([0-9a-fA-F]+) - (Destroy|Abort|Revoke) "
    rb"(START|COMPLETE)"
)
_COMM_INFO = re.compile(
    rb"comm (\S+) rank (\d+) nRanks (\d+) nNodes (\d+) localRanks (\d+) localRank (\d+) MNNVL (\d+)\s*$"
)
_SYSTEM = re.compile(rb"=== System : maxBw ([\d.]+) totalBw ([\d.]+) ===\s*$")
_TOPO_NODE = re.compile(rb"(CPU|GPU|NIC|NET|NVS|PCI|GIN|RMA|DEV|CXB)/([0-9A-Fa-f\-]+)(?: \((.*)\))?\s*$")
_TOPO_LINK = re.compile(
    rb"( *)\+ (LOC|NVL|PCI|SYS|NET|C2C)\[([\d.]+)\] - ((?:CPU|GPU|NIC|NET|NVS|PCI|GIN|RMA|DEV|CXB)/[0-9A-Fa-f\-]+)"
    rb"(?: \((.*)\))?\s*$"
)
_TOPO_RULE = re.compile(rb"=+\s*$")
_RING = re.compile(rb"Channel (\d+)(?:/(\d+))? :((?: +\d+)*)( ?\.\.\.)?\s*$")
_TREES = re.compile(rb"Trees((?: \[\d+\] -?\d+/-?\d+/-?\d+->-?\d+->-?\d+)+)\s*$")
_TRANSPORT = re.compile(rb"(?:Channel|Ring) \d+(?:/\d+)? : .* via ")

_VERSION = re.compile(rb"NCCL version (\d+)\.(\d+)\.(\d+)(\S*?)\+cuda(\d+)\.(\d+)")
# host:pid:tid [dev] anywhere on a line without a readable level token: a record whose token was damaged.
_RECORD_PREFIX = re.compile(rb"[A-Za-z0-9_.\-]+:\d+:\d+ \[-?\d+\] ")
_OTHER_LEVELS = (b" NCCL TRACE ", b" NCCL CALL ", b" NCCL ABORT ")
_HEX = re.compile(rb"0[xX][0-9a-fA-F]+")
_INFO = b"NCCL INFO "
_WARN = b"NCCL WARN "
_MATRIX_HEAD = b"Enabled NCCL Func/Proto/Algo Matrix:"


_CALL_MARKS = (b" sendbuff ", b" recvbuff ", b" [nranks=", b": opCount ")
_TUNING_MARKS = (b" Bytes -> ", b"-> Algo ", b"channel{Lo..Hi}")


def _damaged_kind(msg: bytes) -> str | None:
    """The record kind an unrecognised INFO message still shows the fields of (a line damaged in its
    keywords, e.g. "AllReduce: opCo#nt 1f sendbuff ..."), or None for other INFO text."""
    if any(k in msg for k in _CALL_MARKS):
        return "call"
    if any(k in msg for k in _TUNING_MARKS):
        return "TUNING"
    if b" cudaDev " in msg and b" busId " in msg:
        return "init/destroy"
    return None


class _Malformed(ValueError):
    """A record that matched its pattern but holds a value the tables cannot take (a malformed
    number, a value out of a column's range, an impossible timestamp): the line is reported in
    ``unclassified`` instead of failing the parse or being written with a wrong value."""


def _ptr(tok: bytes) -> int:
    """Decode a ``%p`` token: ``0x...`` or ``(nil)``."""
    if tok == b"(nil)":
        return 0
    # Not int(tok, 16) alone: it also takes a sign, '_' and whitespace, so "-0x7f" or "0x7f_00"
    # (damaged lines) would decode to a plausible wrong pointer.
    if not _HEX.fullmatch(tok):
        raise _Malformed(f"malformed pointer {_text(tok, 40)!r}")
    return int(tok, 16)


def _float(tok: bytes) -> float:
    try:
        return float(tok)
    except ValueError:  # "24..0": the patterns only ensure digits and dots
        raise _Malformed(f"malformed number {_text(tok, 40)!r}") from None


def _int_bounds(schema: pa.Schema) -> list[tuple[int, int, int, str]]:
    """(index, min, max, column) of every integer column of a table schema."""
    out = []
    for i, f in enumerate(schema):
        if pa.types.is_integer(f.type):
            bits = f.type.bit_width
            lo, hi = (0, (1 << bits) - 1) if pa.types.is_unsigned_integer(f.type) else (-(1 << bits - 1),
                                                                                      (1 << bits - 1) - 1)
            out.append((i, lo, hi, f.name))
    return out


_BOUNDS = {name: _int_bounds(schema) for name, schema in TABLES.items()}


def _check_row(table: str, row: tuple | list) -> None:
    """Raise _Malformed if a value does not fit its column (the Parquet write would fail later,
    without file or line)."""
    for i, lo, hi, col in _BOUNDS[table]:
        v = row[i]
        if v is not None and not lo <= v <= hi:
            raise _Malformed(f"value out of range for {table}.{col} ({v})")


def _text(b: bytes, limit: int = 240) -> str:
    return b[:limit].decode("utf-8", errors="backslashreplace")


_INT64 = (-(1 << 63), (1 << 63) - 1)


def _state_op(values: tuple, pointers: tuple = ()) -> tuple:
    """A deferred call/TUNING line as int64 values for fast_scan.apply_state (pointers, uint64 in
    the tables, as int64 bits). A value that does not fit makes the line's table row unwritable, which
    fails the parse as on the line-by-line path; the state values are then zeros."""
    out = list(values)
    for i in pointers:
        v = out[i]
        if not 0 <= v < 1 << 64:
            return (0,) * len(out)
        if v >= 1 << 63:
            out[i] = v - (1 << 64)
    lo, hi = _INT64
    if all(lo <= v <= hi for v in out):
        return tuple(out)
    return (0,) * len(out)


def _write_table(sink: TableSink, table: pa.Table) -> None:
    """Append a whole Arrow table (schema of ``sink``) to a sink, after its pending rows."""
    sink.write_table(table)


def _rows_table(name: str, rows: list) -> pa.Table:
    schema = TABLES[name]
    cols = list(zip(*rows))
    return pa.Table.from_arrays([pa.array(list(c), type=f.type) for c, f in zip(cols, schema)], schema=schema)


def _strings(names: list, codes: np.ndarray) -> pa.Array:
    """String column ``names[codes]`` (``None`` names give nulls), built by the compiled gather."""
    from nccltrace.nccl.fast_scan import gather_strings

    if len(names) == 1 and names[0] is not None:  # a constant column
        value = names[0].encode()
        n = len(codes)
        offsets = np.arange(0, (n + 1) * len(value), max(len(value), 1), dtype=np.int32)[: n + 1]
        if not value:
            offsets = np.zeros(n + 1, np.int32)
        return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(value * n))
    enc = [b"" if x is None else x.encode() for x in names]
    offsets = np.zeros(len(enc) + 1, np.int64)
    offsets[1:] = np.cumsum([len(e) for e in enc])
    codes = np.ascontiguousarray(codes, np.int64)
    off, data = gather_strings(codes, offsets, np.frombuffer(bytearray(b"".join(enc)), np.uint8))
    validity, nulls = None, 0
    null_codes = [i for i, x in enumerate(names) if x is None]
    if null_codes:
        valid = ~np.isin(codes, null_codes)
        nulls = len(codes) - int(np.count_nonzero(valid))
        if nulls:
            validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.StringArray.from_buffers(len(codes), pa.py_buffer(off), pa.py_buffer(data), validity, nulls)


def _masked(values: np.ndarray, mask: np.ndarray, typ: pa.DataType) -> pa.Array:
    if not mask.any():
        return pa.array(values, type=typ)
    return pa.array(values, type=typ, mask=mask)


@dataclass
class FileReport:
    """What happened to one file."""

    file: str
    bytes: int = 0
    lines: int = 0
    counts: collections.Counter = field(default_factory=collections.Counter)
    versions: set = field(default_factory=set)
    issues: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "file": self.file,
            "bytes": self.bytes,
            "lines": self.lines,
            "counts": dict(sorted(self.counts.items())),
            "nccl_versions": sorted(self.versions),
            "issues": self.issues,
        }


@dataclass
class ParseReport:
    """Parse report of a set of log files (written as ``parse_report.json``)."""

    files: list[FileReport] = field(default_factory=list)
    tables: dict[str, int] = field(default_factory=dict)

    @property
    def counts(self) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for f in self.files:
            total.update(f.counts)
        return total

    @property
    def partial(self) -> bool:
        """True when some input could not be read completely (a result built on it is partial):
        a file-level error, or NCCL records that could not be recovered (``lost_records``)."""
        return any(i.get("severity") == "error" for f in self.files for i in f.issues) or any(
            f.counts.get("lost_records", 0) for f in self.files
        )

    def as_dict(self) -> dict:
        return {
            "files": [f.as_dict() for f in self.files],
            "totals": dict(sorted(self.counts.items())),
            "tables": self.tables,
            "partial": self.partial,
        }


class _RecentCall:
    __slots__ = ("line", "op", "bytes", "nranks", "op_count", "comm", "tuned")

    def __init__(self, line: int, op: str, nbytes: int, nranks: int, op_count: int, comm: int) -> None:
        self.line = line
        self.op = op
        self.bytes = nbytes
        self.nranks = nranks
        self.op_count = op_count
        self.comm = comm
        self.tuned = False


DEFAULT_BLOCK_SIZE = 32 << 20  # bytes read per block by the compiled fast path


class _PrefixGroups:
    """Runs of fast records sharing one resolved line prefix (``start``: index of a run's first
    record), with what the prefix resolves to, one list entry per run."""

    __slots__ = ("dev", "hid", "host", "pid", "pidid", "rec", "start", "tid", "ver")

    def __init__(self) -> None:
        self.start: list[int] = []
        self.host: list = []
        self.pid: list = []
        self.tid: list = []
        self.dev: list = []
        self.rec: list = []  # recovery marker of the prefix
        self.hid: list = []  # host id
        self.pidid: list = []  # pid id
        self.ver: list = []  # row of the datatype-size table (the process's NCCL version)


class _FileParser:
    """Parses one file into the shared sinks."""

    TUNE_WINDOW = 256

    def __init__(self, path: Path, name: str, sinks: dict[str, TableSink], known_hosts: set[str], *,
                 fast: bool = False, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.fast = fast
        self.comm_sizes: dict[object, list] = {}  # pid -> [(line, nranks)] of init/comm-info lines
        # (host, pid, comm) -> [(line, rank)] from init lines: only rank 0 of a comm prints TUNING lines.
        self.comm_ranks: dict[tuple, list[tuple[int, int]]] = {}
        self.pending_rings: list[list] = []  # ring rows until their comm size is known (few per comm)
        self._torn_context = False  # True while parsing the pieces of a line torn by concurrent writers
        self.block_size = min(max(int(block_size), 1), 1 << 30)
        self._defer: list | None = None  # fast path: calls/TUNING lines parsed here, state applied per block
        self._version_epoch = 0  # bumped by every version line (fast path: datatype tables per pid)
        self.path = path
        self.name = name
        self.sinks = sinks
        self.report = FileReport(name)
        self.known_hosts = known_hosts
        self.prefix_cache: dict[bytes, tuple] = {}
        self.last_call: dict[tuple, tuple] = {}  # (pid, comm) -> (signature, line)
        self.comm_advances: set[tuple] = set()  # (pid, comm) whose opCount was seen > 0
        self.recent: dict[object, collections.deque] = {}  # pid -> recent calls (for TUNING attachment)
        self.version_by_pid: dict[object, NcclVersion] = {}
        self.file_version: NcclVersion | None = None
        self.system_index = -1
        self.topo_stack: list[tuple[int, str]] = []  # (indent of children, node id)
        self.in_topology = False
        self.in_matrix = False
        self.pending_prefix: list[tuple] = []  # torn prefixes waiting for their message
        self.processes: set[tuple[str, int]] = set()  # (host, pid) of the records (duplicate-file check)

    # --- helpers ---------------------------------------------------------------------
    _FOREIGN_REASONS = ("comment/", "mentions NCCL but", "not an NCCL log record")

    def _unclassified(self, lineno: int, reason: str, raw: bytes) -> None:
        self.report.counts["unclassified"] += 1
        if not reason.startswith(self._FOREIGN_REASONS):
            # An NCCL record (or part of one) that could not be read: tables built from this file
            # are missing it, so the result is partial.
            self.report.counts["lost_records"] += 1
        self.sinks["unclassified"].append((self.name, lineno, reason, _text(raw)))

    def _parse_prefix(self, soup: bytes) -> tuple | None:
        """(host, pid, tid, dev, wall_ns, wall_kind, recovery) from the text before the level token.

        Raises _Malformed for a prefix whose timestamp or ids cannot be right (month 13, a pid that
        does not fit int64, ...): a damaged line, reported rather than decoded into wrong values."""
        cached = self.prefix_cache.get(soup)
        if cached is not None:
            return cached
        wall_ns = None
        wall_kind = None
        m = _TS_BRACKET.search(soup)
        if m:
            y, mo, d, hh, mi, ss = (int(x) for x in m.groups()[:6])
            frac = m.group(7) or b"0"
            ns = int(frac.ljust(9, b"0")[:9])
            try:
                wall_ns = calendar.timegm((y, mo, d, hh, mi, ss)) * 1_000_000_000 + ns
            except (ValueError, OverflowError):  # month 0/13, year 0: datetime rejects the date
                raise _Malformed(f"impossible timestamp {_text(m.group(0).strip(), 40)!r}") from None
            wall_kind = "local"
        else:
            m = _TS_EPOCH.search(soup)
            if m:
                wall_ns = int(m.group(1)) * 1_000_000_000 + int(m.group(2).ljust(9, b"0")[:9])
                wall_kind = "epoch"
        p = _PREFIX_TAIL.search(soup)
        if p:
            pid, tid, dev = int(p.group(2)), int(p.group(3)), int(p.group(4))
        else:
            d = _DEV_ONLY_TAIL.search(soup)
            pid, tid, dev = None, None, int(d.group(1)) if d else None
        # Checked before anything is remembered (known hosts): the columns every table shares are
        # pid, tid (int64), cuda_dev (int32) and wall_time_ns (int64).
        for value, bits, what in ((pid, 63, "pid"), (tid, 63, "tid"), (dev, 31, "[cudaDev]"),
                                  (wall_ns, 63, "timestamp")):
            if value is not None and not -(1 << bits) <= value < 1 << bits:
                raise _Malformed(f"{what} out of range ({value})")
        recovery = None
        if p:
            host = p.group(1).decode("ascii")
            if host not in self.known_hosts:
                # Foreign text glued to the host ("... -1h100node-1:...", or a torn-off message tail
                # "AllRedunode-1:...") : prefer a known host that is a suffix of the candidate. Only
                # then: a host name cannot start with '-', '.' or '_', and inside a torn line (or
                # after another record's cut-off prefix, "... NCCL INFnode000:..." or
                # "node1:1:1 [0] NCnode000:...") the candidate is suspect; otherwise "job-worker-1" is
                # a host of its own.
                suspect = (self._torn_context or not host[:1].isalnum() or b"NCCL" in soup[: p.start()]
                           or _RECORD_PREFIX.search(soup, 0, p.start()) is not None)
                for known in (self.known_hosts if suspect else ()):
                    if host.endswith(known) and host != known:
                        host = known
                        recovery = "host_suffix"
                        break
                else:
                    if suspect:
                        # A cut-off op name or level token glued to an unseen host ("AllRedu" + "node2",
                        # "NC" + "node2"): strip the longest proper prefix of an NCCL op name (>= 4 chars)
                        # or of "NCCL" (>= 2 chars).
                        cut = max((k for op in ALL_OPS for k in range(4, len(op))
                                   if host.startswith(op[:k]) and host[k:k + 1].isalnum()), default=0)
                        cut = cut or max((k for k in (2, 3, 4) if host.startswith("NCCL"[:k])
                                          and host[k:k + 1].isalnum()), default=0)
                        if cut:
                            host = host[cut:]
                            recovery = "host_suffix"
                    else:
                        self.known_hosts.add(host)
            result = (host, pid, tid, dev, wall_ns, wall_kind, recovery)
        else:
            result = (None, None, None, dev, wall_ns, wall_kind, None)
        if wall_ns is None and not self._torn_context and len(self.prefix_cache) < 100_000:
            self.prefix_cache[soup] = result
        return result

    # --- main loop -------------------------------------------------------------------
    def run(self) -> FileReport:
        rep = self.report
        try:
            size = self.path.stat().st_size
        except OSError as exc:
            rep.issues.append({"severity": "error", "line": None, "message": f"cannot read file: {exc}"})
            return rep
        rep.bytes = size
        if size == 0:
            rep.issues.append({"severity": "error", "line": None, "message": "file is empty: no NCCL output was "
                               "written (check NCCL_DEBUG=INFO and NCCL_DEBUG_FILE for this process)"})
            return rep
        lineno = 0
        last_raw = b""
        with open(self.path, "rb") as fh:
            head = fh.read(4096)
            if _looks_binary(head):
                rep.issues.append({"severity": "error", "line": None, "message": "binary data (NUL bytes) at the start: "
                                   "this is not a text NCCL log"})
                return rep
            fh.seek(0)
            if self.fast:
                lineno, last_raw = self._run_fast(fh)
            else:
                for raw in fh:
                    lineno += 1
                    last_raw = raw
                    self._line(lineno, raw)
        rep.lines = lineno
        if last_raw and not last_raw.endswith(b"\n"):
            rep.issues.append({"severity": "warning", "line": lineno, "message": "file does not end with a newline: "
                               "the last line may be truncated (was the job killed while writing?)"})
        for row in self.pending_rings:
            if row[-1] is None:
                sizes = self.comm_sizes.get(row[3], [])
                near = min(sizes, key=lambda e: abs(e[0] - row[1]), default=None)
                row[-1] = near is not None and near[1] > 20
            self.sinks["rings"].append(tuple(row))
        for pending in self.pending_prefix:
            rep.counts["torn_rejected"] += 1
            self._unclassified(pending[0], "torn line: prefix whose message never appeared", pending[-1])
        # rep.versions, not version_by_pid: bare version lines (no host:pid) of concatenated logs share one key.
        if len(rep.versions) > 1:
            rep.issues.append({"severity": "warning", "line": None, "message": "several NCCL versions in one file: "
                               + ", ".join(sorted(rep.versions))})
        return rep

    # --- compiled fast path -----------------------------------------------------------
    # Blocks of whole lines go through fast_scan.scan_block; the lines it does not take go through
    # _line exactly as on the line-by-line path, in line order with the prefix resolution of the fast
    # records (the only state the two share on the Python side: known hosts, prefix cache, versions).
    # Calls and TUNING lines parsed here are deferred (self._defer) and replayed with the fast records
    # by fast_scan.apply_state, which owns the duplicate/TUNING state in fast mode.
    def _mark_untunable(self, M: np.ndarray) -> None:
        """Fast path: the rule of :meth:`_tunable`, vectorised over a block's call records."""
        fs = self._fs
        if not len(M):
            return
        call = M[:, fs.R_KIND] == fs.KIND_CALL
        not_rank0 = np.zeros(len(M), bool)
        for (host, pid, comm), entries in self.comm_ranks.items():
            if host not in self._host_ids or pid not in self._pid_ids:
                continue
            c = comm - (1 << 64) if comm >= 1 << 63 else comm
            key = call & (M[:, fs.R_HID] == self._host_ids[host]) & (M[:, fs.R_PID] == self._pid_ids[pid]) & (
                M[:, fs.R_COMM] == c)
            if not key.any():
                continue
            for line, rank in sorted(entries):  # the latest init line before a call decides
                not_rank0 = np.where(key & (M[:, fs.R_LINE] > line), rank != 0, not_rank0)
        M[call & ((M[:, fs.R_NRANKS] <= 1) | not_rank0), fs.R_KIND] = fs.KIND_CALL_NOTUNE

    def _host_id(self, host: str | None) -> int:
        hid = self._host_ids.get(host)
        if hid is None:
            hid = self._host_ids[host] = len(self._host_ids)
        return hid

    def _pid_id(self, pid: int | None) -> int:
        i = self._pid_ids.get(pid)
        if i is None:
            i = self._pid_ids[pid] = len(self._pid_ids)
        return i

    def _op_code(self, op: str) -> int:
        code = self._op_codes.get(op)
        if code is None:
            code = self._op_codes[op] = len(self._op_codes)
        return code

    def _dsize_row(self, version: NcclVersion | None) -> int:
        """Row of self._dsize (datatype value -> size, 0 = unknown in that version) for a version."""
        row = self._dsize_rows.get(version)
        if row is None:
            sizes = np.zeros((1, self._fs.N_DATATYPES), np.int64)
            for value, (_, size, since) in DATATYPES.items():
                if value < self._fs.N_DATATYPES and (version is None or version.tuple >= since):
                    sizes[0, value] = size
            self._dsize = np.vstack([self._dsize, sizes])
            row = self._dsize_rows[version] = len(self._dsize) - 1
        return row

    def _run_fast(self, fh) -> tuple[int, bytes]:
        from nccltrace.nccl import fast_scan

        fs = self._fs = fast_scan
        self._state = fs.FastState(self.TUNE_WINDOW)
        self._host_ids: dict = {}
        self._pid_ids: dict = {}
        self._op_codes = {name: i for i, name in enumerate(fs.OPS)}
        self._dsize_rows: dict = {}
        self._dsize = np.zeros((0, fs.N_DATATYPES), np.int64)
        self._pending: dict[str, list] = {"calls": [], "tuning": []}
        self._unwritable: dict[str, list] = {"calls": [], "tuning": []}
        self._fast_counts: collections.Counter = collections.Counter()
        n_dt = fs.N_DATATYPES
        self._dt_names = [DATATYPES[v][0] for v in range(n_dt)] + [f"unknown({v})" for v in range(n_dt)]
        full_ops = np.zeros(len(fs.OPS), np.bool_)
        full_ops[[fs.OPS.index(o) for o in fs.FULL_BUFFER_OPS]] = True
        self._full_ops = full_ops
        # Blocks are read into one buffer; the partial line at the end of a block moves to the front.
        lineno = 0
        buf = bytearray(self.block_size + 4096)
        carry = 0
        while True:
            if len(buf) - carry < self.block_size:
                buf = buf[:carry] + bytearray(self.block_size + 4096)  # a line longer than a block
            with memoryview(buf) as mv:
                got = fh.readinto(mv[carry : carry + self.block_size])
            if not got:
                break
            end = carry + got
            cut = buf.rfind(b"\n", carry, end)
            if cut < 0:
                carry = end
                continue
            lineno = self._fast_block(buf, cut + 1, lineno)
            buf[: end - cut - 1] = buf[cut + 1 : end]
            carry = end - cut - 1
        last = bytes(buf[:carry])
        if carry:
            lineno = self._fast_block(last, carry, lineno)
        counts = self.report.counts
        for key, value in zip(("call_duplicate", "call_identical_repeat_kept", "tuning_unattached"),
                              self._state.counts.tolist()):
            if value:
                counts[key] += value
        for key, value in self._fast_counts.items():
            if value:
                counts[key] += value
        for name, rows in self._unwritable.items():
            if rows:
                _rows_table(name, rows)  # raises the error of the line-by-line path
        for name in self._pending:
            self._flush_pending(name, force=True)
        return lineno, (last if carry else b"\n")

    def _flush_pending(self, name: str, force: bool = False) -> None:
        tables = self._pending[name]
        if not tables:
            return
        sink = self.sinks[name]
        if force or sum(t.num_rows for t in tables) >= sink.batch_rows:
            _write_table(sink, pa.concat_tables(tables))
            self._pending[name] = []

    def _fast_block(self, buf: bytes | bytearray, n: int, lineno0: int) -> int:
        """Parse the whole lines in buf[:n] (first line number lineno0 + 1); returns the last line number."""
        fs = self._fs
        n_lines, S, R, T = fs.scan(np.frombuffer(buf, np.uint8), n, lineno0 + 1)
        f_line = np.ascontiguousarray(R[:, fs.R_LINE])
        groups, deferred = self._fast_prefix_groups(memoryview(buf), S, R, f_line)

        # Per-record values from the groups (vectorised).
        mark = np.zeros(len(f_line), np.int64)
        mark[np.asarray(groups.start, np.int64)] = 1
        gid = np.cumsum(mark) - 1
        R[:, fs.R_HID] = np.asarray(groups.hid, np.int64)[gid]
        R[:, fs.R_PID] = np.asarray(groups.pidid, np.int64)[gid]
        R[:, fs.R_TID] = np.asarray(groups.tid, np.int64)[gid]
        kind = R[:, fs.R_KIND]
        is_call = kind == fs.KIND_CALL
        dsize = self._dsize[np.asarray(groups.ver, np.int64)[gid], np.where(is_call, R[:, fs.R_DTYPE], 0)]
        R[:, fs.R_BYTES] = np.where(is_call, R[:, fs.R_COUNT] * dsize, R[:, fs.R_BYTES])

        f_out, slow_rows = self._fast_state(R, deferred)
        self._fast_tables(R, T, f_line, groups, gid, is_call, dsize, f_out, slow_rows)
        return lineno0 + n_lines

    def _fast_prefix_groups(self, data: memoryview, S: np.ndarray, R: np.ndarray,
                            f_line: np.ndarray) -> tuple[_PrefixGroups, list]:  # fmt: skip
        """Resolve the fast records' prefixes and parse the Python-side lines (``S``), in line order.

        A fast record whose prefix differs from the previous record's, or that follows Python-side
        lines which changed what a prefix resolves to, starts a group resolved by _parse_prefix.
        Returns the groups and the Python-side rows deferred for duplicate detection and TUNING
        attachment."""
        fs = self._fs
        s_start, s_end, s_line = S[:, 0].tolist(), S[:, 1].tolist(), S[:, 2].tolist()
        f_ls, f_ip = R[:, fs.R_LS], R[:, fs.R_IP]
        nf = len(f_line)
        g = _PrefixGroups()
        g_start, g_host, g_pid, g_tid, g_dev, g_rec, g_hid, g_pidid, g_ver = (
            g.start, g.host, g.pid, g.tid, g.dev, g.rec, g.hid, g.pidid, g.ver)  # fmt: skip
        epoch = [None]

        def resolve(i: int) -> None:
            if g_start and g_start[-1] == i:
                return
            host, pid, tid, dev, _, _, rec = self._parse_prefix(bytes(data[int(f_ls[i]) : int(f_ip[i])]))
            self.processes.add((host, pid))
            g_start.append(i)
            g_host.append(host)
            g_pid.append(pid)
            g_tid.append(tid)
            g_dev.append(dev)
            g_rec.append(rec)
            g_hid.append(self._host_id(host))
            g_pidid.append(self._pid_id(pid))
            g_ver.append(self._dsize_row(self.version_by_pid.get(pid, self.file_version)))
            epoch[0] = (len(self.known_hosts), self._version_epoch)

        cps = np.flatnonzero(R[:, fs.R_CHANGE]).tolist()
        ci, ncp, forced = 0, len(cps), -1
        self._defer = []
        try:
            for k, L in enumerate(s_line):
                if forced >= 0 and f_line[forced] < L:
                    resolve(forced)
                    forced = -1
                while ci < ncp and f_line[cps[ci]] < L:
                    resolve(cps[ci])
                    ci += 1
                self._line(L, bytes(data[s_start[k] : s_end[k]]))
                if nf and epoch[0] != (len(self.known_hosts), self._version_epoch):
                    j = int(np.searchsorted(f_line, L, "right"))
                    forced = j if j < nf else -1
            if forced >= 0:
                resolve(forced)
            while ci < ncp:
                resolve(cps[ci])
                ci += 1
            deferred = self._defer
        finally:
            self._defer = None
        return g, deferred

    def _fast_state(self, R: np.ndarray, deferred: list) -> tuple[np.ndarray, dict[str, list]]:
        """Duplicate detection and TUNING attachment over the fast records and the deferred
        Python-side rows, in line order. Returns the fast records' results and the deferred rows
        (completed) per table."""
        fs = self._fs
        ops = [_state_op(d[0], (fs.R_COMM, fs.R_SEND, fs.R_RECV, fs.R_STREAM) if d[1] == "calls" else ())
               for d in deferred]
        s_ops = np.asfortranarray(np.array(ops, np.int64).reshape(-1, fs.S_NFIELDS))
        self._state.ensure_pids(len(self._pid_ids))
        kinds = R[:, fs.R_KIND].copy()
        self._mark_untunable(R)
        self._mark_untunable(s_ops)
        f_out, s_out = self._state.run(R, s_ops)
        R[:, fs.R_KIND] = kinds
        slow_rows: dict[str, list] = {"calls": [], "tuning": []}
        for (_, table, row), (a, b) in zip(deferred, s_out.tolist()):
            if table == "calls":
                row[23] = a if a >= 0 else None
            else:
                row[20] = a if a >= 0 else None
                row[21] = b or None
            slow_rows[table].append(row)
        return f_out, slow_rows

    def _fast_tables(self, R: np.ndarray, T: np.ndarray, f_line: np.ndarray, groups: _PrefixGroups, gid: np.ndarray,
                     is_call: np.ndarray, dsize: np.ndarray, f_out: np.ndarray, slow_rows: dict[str, list]) -> None:  # fmt: skip
        """The block's calls and tuning tables (fast records and Python-side rows merged in line
        order), queued for the sinks."""
        fs = self._fs
        fc = self._fast_counts
        for name, sel in (("calls", is_call), ("tuning", ~is_call)):
            idx = np.flatnonzero(sel)
            parts = []
            if len(idx):
                gi = gid[idx]
                wk = R[idx, fs.R_WK]
                common = [
                    _strings([self.name], np.zeros(len(idx), np.int64)), pa.array(f_line[idx]),
                    _strings(groups.host, gi), pa.array(np.asarray(groups.pid, np.int64)[gi]),
                    pa.array(np.asarray(groups.tid, np.int64)[gi]), pa.array(np.asarray(groups.dev, np.int32)[gi]),
                    _masked(R[idx, fs.R_WALL], wk == fs.WALL_NONE, pa.int64()), _strings([None, "local", "epoch"], wk),
                ]  # fmt: skip
                if name == "calls":
                    ds = dsize[idx]
                    parts.append(self._fast_calls_table(R, idx, common, ds, f_out[idx, 0], _strings(groups.rec, gi)))
                    fc["call"] += len(idx)
                    fc["unknown_datatype"] += int(np.count_nonzero(ds == 0))
                else:
                    parts.append(self._fast_tuning_table(R, T, idx, common, f_out[idx, 0], f_out[idx, 1]))
                    fc["tuning"] += len(idx)
            if slow_rows[name]:
                try:
                    parts.append(_rows_table(name, slow_rows[name]))
                except (pa.ArrowException, OverflowError, TypeError, ValueError):
                    # A value the column cannot hold: the line-by-line path fails when it writes the
                    # table, after reading everything; fail the same way at the end of the file.
                    self._unwritable[name].extend(slow_rows[name])
            if not parts:
                continue
            if len(parts) > 1:
                t = pa.concat_tables(parts)
                t = t.take(pa.array(np.argsort(t.column("line").to_numpy(), kind="stable")))
            else:
                t = parts[0]
            self._pending[name].append(t)
            self._flush_pending(name)

    def _fast_calls_table(self, R: np.ndarray, idx: np.ndarray, common: list, dsize: np.ndarray, dup: np.ndarray,
                          recovery: pa.Array) -> pa.Table:
        fs = self._fs
        op = R[idx, fs.R_OP]
        dtype = R[idx, fs.R_DTYPE]
        redop = R[idx, fs.R_REDOP]
        nranks = R[idx, fs.R_NRANKS]
        nbytes = R[idx, fs.R_BYTES]
        lo, hi = int(redop.min()), int(redop.max())
        if hi - lo < 4096:
            redop_names = _strings([redop_name(v) for v in range(lo, hi + 1)], redop - lo)
        else:
            values, inverse = np.unique(redop, return_inverse=True)
            redop_names = _strings([redop_name(int(v)) for v in values], inverse)
        arrays = common + [
            _strings(list(fs.OPS), op), pa.array(R[idx, fs.R_OPC]), pa.array(R[idx, fs.R_SEND].view(np.uint64)),
            pa.array(R[idx, fs.R_RECV].view(np.uint64)), pa.array(R[idx, fs.R_COUNT]),
            pa.array(dtype.astype(np.int8)), _strings(self._dt_names, dtype + np.where(dsize == 0, fs.N_DATATYPES, 0)),
            pa.array(redop.astype(np.int32)), redop_names, pa.array(R[idx, fs.R_ROOT].astype(np.int32)),
            pa.array(R[idx, fs.R_COMM].view(np.uint64)), pa.array(nranks.astype(np.int32)),
            pa.array(R[idx, fs.R_STREAM].view(np.uint64)), pa.array(nbytes),
            pa.array(np.where(self._full_ops[op], nbytes * nranks, nbytes)), _masked(dup, dup < 0, pa.int64()),
            recovery,
        ]
        return pa.Table.from_arrays(arrays, schema=TABLES["calls"])

    def _fast_tuning_table(self, R: np.ndarray, T: np.ndarray, idx: np.ndarray, common: list, call_line: np.ndarray,
                           n_calls: np.ndarray) -> pa.Table:
        fs = self._fs
        n = len(idx)
        kind = R[idx, fs.R_KIND]
        op = R[idx, fs.R_OP]
        named = kind == fs.KIND_TUNE_NAMED
        arrays = common + [
            _strings(["standard"], np.zeros(n, np.int64)),
            _strings(list(fs.TUNING_FORMATS), kind - 1),
            _strings(list(fs.OPS) + [None], np.where(op < 0, len(fs.OPS), op)),
            pa.array(R[idx, fs.R_BYTES]),
            _strings(ALGORITHMS, R[idx, fs.R_ALGO]),
            _strings(PROTOCOLS, R[idx, fs.R_PROTO]),
            _masked(T[idx], named, pa.float64()),
            _masked(R[idx, fs.R_LO].astype(np.int32), ~named, pa.int32()),
            _masked(R[idx, fs.R_HI].astype(np.int32), ~named, pa.int32()),
            pa.nulls(n, pa.string()), pa.nulls(n, pa.int32()), pa.nulls(n, pa.int32()),
            _masked(call_line, call_line < 0, pa.int64()),
            _masked(n_calls.astype(np.int32), n_calls == 0, pa.int32()),
        ]
        return pa.Table.from_arrays(arrays, schema=TABLES["tuning"])

    def _line(self, lineno: int, raw: bytes) -> None:
        line = raw.rstrip(b"\r\n")
        counts = self.report.counts
        if not line.strip():
            counts["blank"] += 1
            self.in_matrix = False
            return
        if not line.isascii():
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                counts["non_utf8"] += 1
                self.report.issues.append({"severity": "warning", "line": lineno,
                                           "message": "line is not valid UTF-8 (bytes escaped in tables)"})
        if b"\x00" in line:
            counts["nul"] += 1
            self.report.issues.append({"severity": "warning", "line": lineno, "message": "line holds NUL bytes: "
                                       "the file was damaged (a crash while writing?)"})
        n_info = line.count(_INFO)
        if n_info == 1 and _WARN not in line:
            idx = line.find(_INFO)
            self._record(lineno, line, line[:idx], line[idx + 10 :], "INFO", None)
            return
        if n_info == 0 and _WARN not in line:
            self._non_record(lineno, line)
            return
        # Several records on one line: concurrent writers tore them together.
        starts = [m.start() for m in _RECORD_START.finditer(line)]
        if not starts or starts[0] != 0 and not line[: starts[0]].strip():
            starts = starts or [0]
        segments = []
        bounds = starts + [len(line)]
        if starts and starts[0] > 0:
            head = line[: starts[0]]
            if _INFO in head or _WARN in head:
                segments.append(head)
            else:
                # Foreign text before the first record is prefix soup for it.
                bounds[0] = 0
        for a, b in zip(bounds[:-1], bounds[1:]):
            segments.append(line[a:b])
        if len(segments) > 1:
            counts["torn_lines"] += 1
        self._torn_context = len(segments) > 1
        try:
            for i, seg in enumerate(segments):
                level = "INFO" if _INFO in seg else "WARN"
                tok = _INFO if level == "INFO" else _WARN
                idx = seg.find(tok)
                if idx < 0:
                    self._unclassified(lineno, "torn line: fragment without level token", seg)
                    continue
                recovery = "split" if len(segments) > 1 else None
                self._record(lineno, seg, seg[:idx], seg[idx + 10 :], level, recovery,
                             last=(i == len(segments) - 1))
        finally:
            self._torn_context = False

    def _non_record(self, lineno: int, line: bytes) -> None:
        counts = self.report.counts
        stripped = line.strip()
        if self.in_matrix and b"|" in line:
            counts["continuation"] += 1
            return
        self.in_matrix = False
        vm = _VERSION.search(line)
        if vm and stripped.endswith(vm.group(0)) or (vm and line.lstrip().startswith(b"NCCL version")):
            self._version(lineno, line, None, vm)
            return
        # An orphan message: the tail of a record whose prefix was torn off.
        m = _CALL.match(stripped)
        if m:
            if m.group(1).decode() not in ALL_OPS:
                counts["torn_rejected"] += 1
                self._unclassified(lineno, "torn line: orphan call tail whose op name was cut off", line)
                return
            pref = self.pending_prefix.pop() if len(self.pending_prefix) == 1 else None
            if pref is not None:
                _, host, pid, tid, dev = pref[:5]
                ok = self._call(lineno, (host, pid, tid, dev, None, None, None), m, "rejoined")
            else:
                ok = self._call(lineno, (None, None, None, None, None, None, None), m, "no_prefix")
            if ok:
                counts["torn_recovered"] += 1
            return
        if stripped.startswith(b"#"):
            self._unclassified(lineno, "comment/application output (starts with '#')", line)
        elif _RECORD_PREFIX.search(line) and not any(tok in line for tok in _OTHER_LEVELS):
            # "host:pid:tid [dev] NC?L INF?" : an NCCL record whose level token was damaged, so a lost
            # record, not foreign text (TRACE/CALL lines are NCCL records this reader does not read).
            counts["malformed_record"] += 1
            self._unclassified(lineno, "NCCL record prefix without a readable 'NCCL INFO'/'NCCL WARN' token "
                               "(damaged line?)", line)
        elif b"NCCL" in line:
            self._unclassified(lineno, "mentions NCCL but has no 'NCCL INFO'/'NCCL WARN' record token", line)
        else:
            self._unclassified(lineno, "not an NCCL log record (application or launcher output)", line)

    def _version(self, lineno: int, line: bytes, prefix: tuple | None, m: re.Match) -> None:
        v = NcclVersion(int(m.group(1)), int(m.group(2)), int(m.group(3)))
        host, pid = (prefix[0], prefix[1]) if prefix else (None, None)
        tid, dev = (prefix[2], prefix[3]) if prefix else (None, None)
        self.report.counts["version"] += 1
        self.report.versions.add(str(v))
        self.version_by_pid[pid] = v
        self.file_version = v
        self._version_epoch += 1
        self.sinks["versions"].append(
            (self.name, lineno, host, pid, tid, dev, str(v), m.group(4).decode(errors="replace"),
             f"{int(m.group(5))}.{int(m.group(6))}")
        )

    # --- records -----------------------------------------------------------------------
    def _record(self, lineno: int, raw: bytes, soup: bytes, msg: bytes, level: str, recovery: str | None,
                last: bool = True) -> None:
        try:
            self._record_fields(lineno, raw, soup, msg, level, recovery, last)
        except _Malformed as exc:
            # Raised before the record changed any state or table (values are checked first).
            self.report.counts["malformed_record"] += 1
            self._unclassified(lineno, f"NCCL record with {exc} (a damaged line?)", raw)

    def _record_fields(self, lineno: int, raw: bytes, soup: bytes, msg: bytes, level: str, recovery: str | None,
                       last: bool) -> None:
        counts = self.report.counts
        prefix = self._parse_prefix(soup)
        if prefix[1] is not None:
            self.processes.add(prefix[:2])
        if prefix[6] and not recovery:
            recovery = prefix[6]
        if level == "WARN":
            self._warn(lineno, soup, msg, prefix)
            return
        if not msg.strip():
            if last:
                counts["torn_prefix_only"] += 1
            # A prefix whose message was torn away: keep it to rejoin with an orphan tail.
            self.pending_prefix.append((lineno, prefix[0], prefix[1], prefix[2], prefix[3], raw))
            if len(self.pending_prefix) > 64:
                old = self.pending_prefix.pop(0)
                counts["torn_rejected"] += 1
                self._unclassified(old[0], "torn line: prefix whose message never appeared", old[-1])
            return
        # Fast path first: call lines dominate real logs.
        if prefix[0] is None and not recovery:
            recovery = "no_prefix"
        if b": opCount " in msg[:40]:
            m = _CALL.match(msg)
            if m and m.group(1).decode() in ALL_OPS:
                self._call(lineno, prefix, m, recovery)
                return
            if m:
                self._unclassified(lineno, "call line with an unknown op name (a torn or cut-off line?)", raw)
                return
            counts["malformed_call"] += 1
            self._unclassified(lineno, "call line does not match the COLL format (truncated or torn?)", raw)
            return
        if b" Bytes -> " in msg:
            if self._tuning(lineno, prefix, msg):
                return
            self._unclassified(lineno, "TUNING line in an unknown format", raw)
            return
        if b"- Init " in msg or b"-Init " in msg:
            m = _INIT.match(msg)
            if m:
                self._init(lineno, prefix, m)
                return
            self._unclassified(lineno, "Init line in an unknown format", raw)
            return
        if msg.startswith(b"comm ") and self._comm_record(lineno, prefix, msg):
            return
        self._other_record(lineno, raw, prefix, msg, last)

    def _comm_record(self, lineno: int, prefix: tuple, msg: bytes) -> bool:
        """A ``comm ...`` line: communicator info, destruction or a legacy init line; False when it
        is none of them."""
        counts = self.report.counts
        m = _COMM_INFO.match(msg)
        if m:
            self._emit("comm_info", (self.name, lineno, *prefix[:4], _ptr(m.group(1)), int(m.group(2)),
                                     int(m.group(3)), int(m.group(4)), int(m.group(5)), int(m.group(6))))
            counts["comm_info"] += 1
            self.comm_sizes.setdefault(prefix[1], []).append((lineno, int(m.group(3))))
            return True
        m = _DESTROY.match(msg)
        if m:
            self._emit("comms", (self.name, lineno, *prefix[:4], prefix[4], prefix[5], m.group(6).decode().lower(),
                                 m.group(7).decode(), None, _ptr(m.group(1)), int(m.group(2)), int(m.group(3)),
                                 int(m.group(4)), None, int(m.group(5), 16), None, None, None, None, None))
            counts["destroy"] += 1
            return True
        m = _INIT_LEGACY.match(msg)
        if m:
            self._emit("comms", (self.name, lineno, *prefix[:4], prefix[4], prefix[5], "legacy_init", None, None,
                                 _ptr(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)),
                                 int(m.group(5)), None, None, None, None, None, None))
            counts["init"] += 1
            self._note_rank(prefix, _ptr(m.group(1)), int(m.group(2)), lineno)
            return True
        return False

    def _other_record(self, lineno: int, raw: bytes, prefix: tuple, msg: bytes, last: bool) -> None:
        """A record that is no call, TUNING, init or ``comm`` line: version, topology, rings and
        trees, or else a torn, damaged or other INFO line."""
        counts = self.report.counts
        c0 = msg[:1]
        vm = _VERSION.match(msg)
        if vm:
            self._version(lineno, raw, prefix, vm)
            return
        if self._topology(lineno, prefix, msg):
            return
        if c0 == b"C" or c0 == b"R":
            m = _RING.match(msg)
            if m:
                ranks = m.group(3).split()
                cut = m.group(4)
                if cut and not cut.startswith(b" ") and ranks:
                    ranks.pop()  # "... 140 14..." : the last number was cut mid-way
                # <= 2.22 print at most 20 ranks; a 20-rank line is cut only if its comm is larger,
                # which the nearest init/comm-info line of the process tells (resolved at end of file).
                row = [self.name, lineno, *prefix[:4], "ring", int(m.group(1)), int(m.group(2)) if m.group(2) else None,
                       b" ".join(ranks).decode(), bool(cut) or (len(ranks) == 20 and None)]
                _check_row("rings", row)
                counts["ring"] += 1
                self.pending_rings.append(row)
                return
            if _TRANSPORT.match(msg):
                counts["transport"] += 1
                return
        if c0 == b"T":
            m = _TREES.match(msg)
            if m:
                counts["tree"] += 1
                self.sinks["rings"].append(
                    (self.name, lineno, *prefix[:4], "tree", None, None, m.group(1).strip().decode(), False)
                )
                return
        if msg.startswith(_MATRIX_HEAD):
            self.in_matrix = True
        if not last:
            # A record cut off by another writer's output: its tail is lost or elsewhere.
            counts["torn_rejected"] += 1
            self._unclassified(lineno, "torn line: record cut off by another process's output", raw)
            return
        kind = _damaged_kind(msg)
        if kind:
            # Not silently "other INFO": the fields of a call/TUNING/init line are there, its keyword is not.
            counts["malformed_record"] += 1
            self._unclassified(lineno, f"{kind} line in an unknown format (a damaged line?)", raw)
            return
        counts["info_other"] += 1

    def _emit(self, table: str, row: tuple) -> None:
        """Append a row of a table other than calls (whose values _call checks itself)."""
        _check_row(table, row)
        self.sinks[table].append(row)

    def _call(self, lineno: int, prefix: tuple, m: re.Match, recovery: str | None) -> bool:
        """Record a call line; False when its values were malformed (reported as unclassified)."""
        counts = self.report.counts
        op = m.group(1).decode()
        try:
            op_count = int(m.group(2), 16)
            sendbuff = _ptr(m.group(3))
            recvbuff = _ptr(m.group(4))
            count = int(m.group(5))
            dtype = int(m.group(6))
            redop = int(m.group(7))
            root = int(m.group(8))
            comm = _ptr(m.group(9))
            nranks = int(m.group(10))
            stream = _ptr(m.group(11))
        except ValueError:
            counts["malformed_call"] += 1
            self._unclassified(lineno, "call line with a malformed number or pointer", m.string)
            return False
        host, pid, tid, dev, wall_ns, wall_kind = prefix[:6]
        entry = DATATYPES.get(dtype)
        version = self.version_by_pid.get(pid, self.file_version)
        known = entry is not None and (version is None or version.tuple >= entry[2])
        dtype_name, dsize = (entry[0], entry[1]) if known else (f"unknown({dtype})", 0)
        nbytes = count * dsize
        message_bytes = bus_message_bytes(op, count, dsize, nranks)
        # Values that do not fit the table's columns (e.g. a size_t -1 printed by %zu) are reported,
        # never wrapped or truncated into a plausible-looking number.
        if not (0 <= op_count < 1 << 63 and -(1 << 63) <= count * 8 < 1 << 63 and -128 <= dtype <= 127
                and -(1 << 31) <= redop < 1 << 31 and -(1 << 31) <= root < 1 << 31 and 0 <= nranks < 1 << 31
                and max(sendbuff, recvbuff, comm, stream) < 1 << 64
                and -(1 << 63) <= message_bytes < 1 << 63):
            counts["malformed_call"] += 1
            self._unclassified(lineno, "call line with a value out of range (count, datatype, op, root, "
                               "nranks or pointer)", m.string)
            return False
        if not known:
            counts["unknown_datatype"] += 1
        if self._defer is not None:
            # Fast path: duplicate detection runs over all calls of the block, in line order.
            counts["call"] += 1
            row = [self.name, lineno, host, pid, tid, dev, wall_ns, wall_kind, op, op_count, sendbuff, recvbuff,
                   count, dtype, dtype_name, redop, redop_name(redop), root, comm, nranks, stream, nbytes,
                   message_bytes, None, recovery]
            self._defer.append(((lineno, 0, self._host_id(host), self._pid_id(pid), comm, self._op_code(op),
                                 op_count, sendbuff, recvbuff, count, dtype, redop, root, nranks, stream,
                                 0 if tid is None else tid, int(tid is None), 0 if wall_ns is None else wall_ns,
                                 int(wall_ns is None), nbytes), "calls", row))
            return True
        key = (host, pid, comm)
        signature = (op, op_count, sendbuff, recvbuff, count, dtype, redop, root, nranks, stream, tid, wall_ns)
        if op_count > 0:
            self.comm_advances.add(key)
        duplicate_of = None
        prev = self.last_call.get(key)
        # Identical consecutive call lines on a comm are duplicates only when opCount is
        # informative there (it advances and the comm has peers); on nranks=1 comms, or while
        # opCount has never advanced, identical calls are legitimate repeats.
        if prev is not None and prev[0] == signature and nranks > 1 and key in self.comm_advances:
            duplicate_of = prev[1]
            counts["call_duplicate"] += 1
        else:
            self.last_call[key] = (signature, lineno)
            if prev is not None and prev[0] == signature:
                counts["call_identical_repeat_kept"] += 1
        counts["call"] += 1
        self.sinks["calls"].append(
            (self.name, lineno, host, pid, tid, dev, wall_ns, wall_kind, op, op_count, sendbuff, recvbuff, count,
             dtype, dtype_name, redop, redop_name(redop), root, comm, nranks, stream, nbytes,
             message_bytes, duplicate_of, recovery)
        )
        if duplicate_of is None and self._tunable(host, pid, comm, nranks, lineno):
            dq = self.recent.get(pid)
            if dq is None:
                dq = self.recent[pid] = collections.deque(maxlen=self.TUNE_WINDOW)
            dq.append(_RecentCall(lineno, op, nbytes, nranks, op_count, comm))
        return True

    def _tunable(self, host: object, pid: object, comm: int, nranks: int, lineno: int) -> bool:
        """Can a TUNING line of this process describe this call? Not on single-rank comms (no
        algorithm is chosen), nor where an earlier init line says this process is not rank 0."""
        if nranks <= 1:
            return False
        rank = None
        for line, r in self.comm_ranks.get((host, pid, comm), ()):
            if line < lineno:
                rank = r
        return rank is None or rank == 0

    def _note_rank(self, prefix: tuple, comm: int, rank: int, lineno: int) -> None:
        self.comm_ranks.setdefault((prefix[0], prefix[1], comm), []).append((lineno, rank))

    def _attach_tuning(self, pid: object, op: str | None, nbytes: int, full_buffer: bool) -> tuple[int | None, int]:
        """Find the call a TUNING line describes: most recent untuned call with matching bytes."""
        dq = self.recent.get(pid)
        if not dq:
            return None, 0
        calls = list(dq)
        for i in range(len(calls) - 1, -1, -1):
            c = calls[i]
            if c.tuned or (op is not None and c.op != op) or c.op in ("Send", "Recv"):
                continue
            expect = c.bytes * c.nranks if full_buffer and c.op in ("AllGather", "ReduceScatter") else c.bytes
            if expect == nbytes:
                c.tuned = True
                return c.line, 1
        if full_buffer:
            # 2.20-2.23 may aggregate consecutive same-op calls of one group into one line.
            for i in range(len(calls) - 1, -1, -1):
                c = calls[i]
                if c.tuned or (op is not None and c.op != op) or c.op in ("Send", "Recv"):
                    continue
                total = 0
                j = i
                group = []
                while j >= 0 and calls[j].op == c.op and calls[j].op_count == c.op_count and not calls[j].tuned:
                    cj = calls[j]
                    total += cj.bytes * cj.nranks if c.op in ("AllGather", "ReduceScatter") else cj.bytes
                    group.append(cj)
                    if total == nbytes and len(group) > 1:
                        for g in group:
                            g.tuned = True
                        return group[-1].line, len(group)
                    j -= 1
                break
        return None, 0

    def _tuning(self, lineno: int, prefix: tuple, msg: bytes) -> bool:
        counts = self.report.counts
        host, pid, tid, dev, wall_ns, wall_kind = prefix[:6]
        op = algo = proto = sym = None
        time_us = None
        lo = hi = nch = nthr = None
        m = _TUNE_NAMED.match(msg)
        if m:
            kind, fmt = "standard", "op_bytes_named"
            op, nbytes, algo, proto = m.group(1).decode(), int(m.group(2)), m.group(3).decode(), m.group(4).decode()
            lo, hi = int(m.group(5)), int(m.group(6))
            full = False
        else:
            m = _TUNE_NUMERIC.match(msg)
            if m:
                kind = "standard"
                fmt = "op_bytes_numeric" if m.group(1) else "bytes_numeric"
                op = m.group(1).decode() if m.group(1) else None
                nbytes = int(m.group(2))
                a, p = int(m.group(3)), int(m.group(4))
                algo = ALGORITHMS[a] if 0 <= a < len(ALGORITHMS) else f"unknown({a})"
                proto = PROTOCOLS[p] if 0 <= p < len(PROTOCOLS) else f"unknown({p})"
                time_us = _float(m.group(5))
                full = True
            else:
                m = _TUNE_SYM.match(msg)
                if m:
                    kind = fmt = "symmetric"
                    op, nbytes, sym = m.group(1).decode(), int(m.group(2)), m.group(3).decode(errors="replace")
                    nch, nthr = int(m.group(4)), int(m.group(5))
                    algo = "SYMMETRIC"
                    full = False
                else:
                    m = _TUNE_CE.match(msg) or _TUNE_HCE.match(msg)
                    if not m:
                        return False
                    kind = fmt = "copy_engine" if b"[Copy Engine]" in msg else "hierarchical_ce"
                    op, nbytes = m.group(1).decode(), int(m.group(2))
                    algo = "CE"
                    full = False
        _check_row("tuning", (self.name, lineno, host, pid, tid, dev, wall_ns, wall_kind, kind, fmt, op, nbytes, algo,
                              proto, time_us, lo, hi, sym, nch, nthr, None, None))
        if self._defer is not None:
            # Fast path: attachment runs over all calls/TUNING lines of the block, in line order.
            counts["tuning"] += 1
            row = [self.name, lineno, host, pid, tid, dev, wall_ns, wall_kind, kind, fmt, op, nbytes, algo, proto,
                   time_us, lo, hi, sym, nch, nthr, None, None]
            self._defer.append(((lineno, 2 if full else 1, 0, self._pid_id(pid), 0,
                                 -1 if op is None else self._op_code(op), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                 nbytes), "tuning", row))
            return True
        call_line, n_calls = self._attach_tuning(pid, op, nbytes, full)
        counts["tuning"] += 1
        if call_line is None:
            counts["tuning_unattached"] += 1
        self.sinks["tuning"].append(
            (self.name, lineno, host, pid, tid, dev, wall_ns, wall_kind, kind, fmt, op, nbytes, algo, proto, time_us,
             lo, hi, sym, nch, nthr, call_line, n_calls or None)
        )
        return True

    def _init(self, lineno: int, prefix: tuple, m: re.Match) -> None:
        api = m.group(2).decode() if m.group(2) else None
        parent = _ptr(m.group(9)) if m.group(9) else None
        is_split = parent is not None or api == "ncclCommSplit"
        event = "split" if is_split else "init"
        self._emit("comms", (self.name, lineno, *prefix[:4], prefix[4], prefix[5], event, m.group(14).decode(), api,
                             _ptr(m.group(3)), int(m.group(4)), int(m.group(5)), int(m.group(6)),
                             int(m.group(7)) if m.group(7) else None, int(m.group(8), 16),
                             int(m.group(13), 16) if m.group(13) else None, parent,
                             int(m.group(11)) if m.group(11) else None, int(m.group(12)) if m.group(12) else None,
                             int(m.group(10)) if m.group(10) else None))
        self.report.counts[event] += 1
        self.comm_sizes.setdefault(prefix[1], []).append((lineno, int(m.group(5))))
        self._note_rank(prefix, _ptr(m.group(3)), int(m.group(4)), lineno)

    def _warn(self, lineno: int, soup: bytes, msg: bytes, prefix: tuple) -> None:
        m = _WARN_PREFIX.search(soup.rstrip(b" ") + b" ")
        source = m.group(5).decode(errors="replace").strip() if m else None
        if m and prefix[0] is None:
            # A WARN prefix ends with "src:line[ (function)] ", so host:pid:tid [dev] sit before it.
            head = self._parse_prefix(soup[: m.start(5)])
            prefix = (*head[:4], prefix[4], prefix[5], head[6])
            if prefix[1] is not None:
                self.processes.add(prefix[:2])
        self._emit("warnings", (self.name, lineno, *prefix[:4], prefix[4], prefix[5], source,
                                msg.decode(errors="replace").strip()))
        self.report.counts["warn"] += 1

    def _topology(self, lineno: int, prefix: tuple, msg: bytes) -> bool:
        counts = self.report.counts
        m = _SYSTEM.match(msg)
        if m:
            row = (self.name, lineno, *prefix[:4], self.system_index + 1, _float(m.group(1)), _float(m.group(2)))
            self._emit("topology_systems", row)
            self.system_index += 1
            self.in_topology = True
            self.topo_stack = []
            counts["topology"] += 1
            return True
        link = _TOPO_LINK.match(msg) if msg.lstrip().startswith(b"+ ") else None
        bandwidth = _float(link.group(3)) if link else None  # before any state changes
        if not self.in_topology:
            # Dumps can start mid-block in excerpts: a link line alone still opens a system.
            if not link:
                return False
            self.system_index += 1
            self.in_topology = True
            self.topo_stack = []
        if _TOPO_RULE.match(msg):
            counts["topology"] += 1
            self.in_topology = False
            return True
        m = link
        if m:
            # Stack of (indent at which a node's children are printed, node id); a remote node's
            # children are indented to the column where its id starts.
            indent = len(m.group(1))
            while self.topo_stack and self.topo_stack[-1][0] > indent:
                self.topo_stack.pop()
            if self.topo_stack and self.topo_stack[-1][0] == indent:
                parent = self.topo_stack[-1][1]
                depth = len(self.topo_stack) - 1
            else:
                parent, depth = None, -1  # excerpt starts inside a block: parent not shown
            to_node = m.group(4).decode()
            self.topo_stack.append((m.start(4), to_node))
            counts["topology"] += 1
            self.sinks["topology_links"].append(
                (self.name, lineno, *prefix[:4], self.system_index, parent, m.group(2).decode(), bandwidth,
                 to_node, m.group(5).decode(errors="replace") if m.group(5) else None, depth)
            )
            return True
        m = _TOPO_NODE.match(msg)
        if m:
            self.topo_stack = [(0, f"{m.group(1).decode()}/{m.group(2).decode()}")]
            counts["topology"] += 1
            return True
        self.in_topology = False
        return False


TABLE_NAMES = ("calls", "comms", "comm_info", "tuning", "topology_links", "topology_systems", "rings", "versions",
               "warnings", "unclassified")


# Bytes of text: printable ASCII, whitespace, ESC (terminal colours) and every byte >= 0x80 (UTF-8).
_TEXT_BYTES = bytes([9, 10, 11, 12, 13, 27]) + bytes(range(32, 127)) + bytes(range(128, 256))


def _looks_binary(head: bytes) -> bool:
    """Is a file whose first bytes are ``head`` binary (an export, a compressed or a core file)?

    A NUL byte alone does not make it so: a log written by a process that crashed, or damaged on
    disk, can hold NULs and its other lines are worth reading (they are reported line by line). Binary
    means NULs, no NCCL record token and more than 5% control bytes (random or compressed data has
    about 10%, an SQLite page mostly NULs)."""
    if b"\x00" not in head or any(tok in head for tok in (_INFO, _WARN, b"NCCL version")):
        return False
    return len(head.translate(None, _TEXT_BYTES)) * 20 > len(head)


def _looks_like_log(path: Path) -> bool:
    # *.log/*.txt/*.out, and NCCL_DEBUG_FILE names such as "nccl.node1.1234" (any suffix).
    return path.suffix in (".log", ".txt", ".out") or "nccl" in path.name.lower()


def find_log_files(paths: Iterable[Path]) -> list[Path]:
    """Expand directories into their NCCL log files, sorted.

    A directory contributes ``*.log``, ``*.txt``, ``*.out`` and any file whose name contains
    ``nccl``; files named explicitly are always taken.
    """
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"no NCCL log files at {p}: the path does not exist")
        if p.is_dir():
            out.extend(sorted(q for q in p.rglob("*") if q.is_file() and _looks_like_log(q)))
        else:
            out.append(p)
    return out


class _SeenFiles:
    """Files already parsed in one parse_logs call: the same file given twice (or a byte-identical
    copy) is not parsed again, and a process whose records are in two files is reported; either would
    otherwise count its calls twice."""

    def __init__(self) -> None:
        self.paths: dict[Path, str] = {}  # resolved path -> name
        self.sizes: dict[int, list[Path]] = {}  # size -> resolved paths of that size
        self.digests: dict[Path, bytes] = {}
        self.processes: dict[tuple[str, int], str] = {}  # (host, pid) -> first file name

    def _digest(self, path: Path) -> bytes:
        if path not in self.digests:
            h = hashlib.blake2b(digest_size=32)
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            self.digests[path] = h.digest()
        return self.digests[path]

    def duplicate_of(self, f: Path, name: str) -> FileReport | None:
        """A report for ``f`` if it repeats a parsed file, else None (and ``f`` is remembered)."""
        path = f.resolve()
        try:
            size = path.stat().st_size
        except OSError:
            return None  # the parser reports the unreadable file
        first = self.paths.get(path)
        how = "the same file"
        if first is None and size:
            # Contents are compared only between files of equal size (rare), so this costs no read
            # in the usual case.
            try:
                first = next((self.paths[q] for q in self.sizes.get(size, ())
                              if self._digest(q) == self._digest(path)), None)
            except OSError:
                first = None
            how = "a byte-identical copy of"
        if first is None:
            self.paths[path] = name
            self.sizes.setdefault(size, []).append(path)
            return None
        rep = FileReport(name, bytes=size)
        rep.counts["duplicate_file"] += 1
        rep.issues.append({"severity": "warning", "line": None, "message": f"{how} {first} (given again): not "
                           "parsed a second time, its records would be counted twice"})
        return rep

    def check_processes(self, parser: _FileParser) -> None:
        """Report processes (host:pid) whose records were also in an earlier file."""
        shared = sorted(p for p in parser.processes if p in self.processes)
        for p in parser.processes:
            self.processes.setdefault(p, parser.name)
        if not shared:
            return
        others = sorted({self.processes[p] for p in shared})
        parser.report.counts["duplicate_processes"] += len(shared)
        examples = ", ".join(f"{h}:{pid}" for h, pid in shared[:3]) + (", ..." if len(shared) > 3 else "")
        parser.report.issues.append({
            "severity": "warning", "line": None,
            "message": f"{len(shared)} process(es) ({examples}) also logged in {', '.join(others[:3])}: the same "
                       "process in two files is a copied, merged or concatenated log (its calls are in both and "
                       "counted twice) or a reused pid; parse one of them"})


def parse_logs(
    paths: Iterable[Path | str],
    out_dir: Path | str,
    *,
    batch_rows: int = 200_000,
    progress: Callable[[int], None] | None = None,
    base: Path | None = None,
    fast: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> ParseReport:
    """Parse NCCL log files (or directories of them) into Parquet tables in ``out_dir``.

    Writes one file per table in :data:`TABLE_NAMES` (always, possibly empty) and
    ``parse_report.json``. Files are named relative to ``base`` (default: the common
    parent) in the ``file`` column. ``progress`` is called with bytes consumed per file.

    ``fast`` (default) decodes clean call/TUNING lines with the compiled scanner
    (:mod:`nccltrace.nccl.fast_scan`), reading ``block_size`` bytes at a time; every other line,
    and everything with ``fast=False``, goes through the line-by-line parser. Both give the same
    tables and report.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [Path(p) for p in paths]
    files = find_log_files(paths)
    if not files:
        raise FileNotFoundError(f"no NCCL log files found in {', '.join(str(p) for p in paths) or '(nothing given)'}")
    if base is None:
        base = Path(os.path.commonpath([str(f.parent.resolve()) for f in files]))
    sinks = {name: TableSink(name, out_dir / f"{name}.parquet", batch_rows) for name in TABLE_NAMES}
    report = ParseReport()
    known_hosts: set[str] = set()
    seen = _SeenFiles()
    try:
        for f in files:
            try:
                name = str(f.resolve().relative_to(base))
            except ValueError:
                name = f.name
            duplicate = seen.duplicate_of(f, name)
            if duplicate is not None:
                report.files.append(duplicate)
            else:
                parser = _FileParser(f, name, sinks, known_hosts, fast=fast, block_size=block_size)
                report.files.append(parser.run())
                seen.check_processes(parser)
            if progress:
                progress(report.files[-1].bytes)
    except BaseException:
        for s in sinks.values():
            s.abort()
        raise
    try:
        for name, s in sinks.items():
            s.close()
            report.tables[name] = s.rows
    except BaseException:
        for s in sinks.values():
            s.abort()
        raise
    write_json_atomic(out_dir / PARSE_REPORT_FILE, report.as_dict())
    return report
