"""PyTorch-profiler (Kineto) Chrome traces as a kernel source: the same tables as an nsys export.

:meth:`KinetoTrace.export_tables` writes what :meth:`nccltrace.nsys.reader.NsysExport.export_tables`
writes, so every later stage reads one kernel table whichever profiler recorded it; what the
profiler adds per kernel (PyTorch's collective, sizes, dtype, process group) goes to
``KERNEL_ARG_COLUMNS``. ProcessGroupNCCL's own record of each call (the ``record_param_comms``
CPU ops) is kept in the same pass (:meth:`KinetoTrace.comm_records`, ``comm_records.parquet``).
The format and its times: ``docs/kineto.md``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd

from nccltrace.core.layout import SESSION_FILE
from nccltrace.kineto.scan import ScanResult, iter_event_runs, sniff_trace
from nccltrace.nsys import reader as nsys_reader
from nccltrace.nsys import schema as nsys_schema
from nccltrace.nsys.nccl_api import NCCL_API_CALLS_SCHEMA

__all__ = ["KINETO_DOMAIN", "KinetoFormatError", "KinetoTrace", "is_kineto_trace", "iter_kineto_files"]

KINETO_DOMAIN = "pytorch_profiler"
"""The ``domain`` of the CPU ranges (``user_annotation``) written to the ``nvtx`` table."""

_PUSH_POP = 59  # NVTX push/pop range event type, as nsys stores it
_LAUNCH_APIS = ("LaunchKernel", "GraphLaunch", "LaunchCooperativeKernel")


class KinetoFormatError(ValueError):
    """The file is not a usable PyTorch-profiler trace; the message names the file, what is
    wrong and what to do."""


class _CallArgs(msgspec.Struct, omit_defaults=True):
    """What ProcessGroupNCCL records of a call, on its kernel and on its ``record_param_comms``."""

    external_id: int | None = msgspec.field(default=None, name="External id")
    coll: str | None = msgspec.field(default=None, name="Collective name")
    in_nelems: int | None = msgspec.field(default=None, name="In msg nelems")
    out_nelems: int | None = msgspec.field(default=None, name="Out msg nelems")
    group_size: int | None = msgspec.field(default=None, name="Group size")
    dtype: str | None = None
    pg_name: str | None = msgspec.field(default=None, name="Process Group Name")
    pg_desc: str | None = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: str | None = msgspec.field(default=None, name="Process Group Ranks")


class _KernelArgs(_CallArgs, omit_defaults=True):
    device: int | None = None
    context: int | None = None
    stream: int | None = None
    correlation: int | None = None
    grid: list[int] | None = None
    block: list[int] | None = None
    registers: int | None = msgspec.field(default=None, name="registers per thread")
    shared: int | None = msgspec.field(default=None, name="shared memory")
    graph_id: int | None = msgspec.field(default=None, name="graph id")
    graph_node_id: int | None = msgspec.field(default=None, name="graph node id")


class _CommArgs(_CallArgs, omit_defaults=True):
    rank: int | None = msgspec.field(default=None, name="Rank")  # send/recv: the peer's rank in the group
    dst_rank: int | None = msgspec.field(default=None, name="Dst Rank")  # global
    src_rank: int | None = msgspec.field(default=None, name="Src Rank")


class _Event(msgspec.Struct):
    ph: str | None = None
    cat: str | None = None
    name: str | None = None
    pid: int | str | None = None
    tid: int | str | None = None
    # times stay raw text until an event is kept: decimal text to integer ns, exactly (_ns)
    ts: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b""))
    dur: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b""))
    args: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b""))


class _ProcGroup(msgspec.Struct):
    pg_name: str | None = None
    pg_desc: str | None = None
    pg_size: int | None = None
    ranks: list[int] | None = None


class _DistInfo(msgspec.Struct):
    backend: str | None = None
    rank: int | None = None
    world_size: int | None = None
    pg_config: list[_ProcGroup] | dict[str, Any] | None = None
    nccl_version: str | None = None


class _Header(msgspec.Struct):
    schemaVersion: int | None = None
    baseTimeNanoseconds: int | None = None
    distributedInfo: _DistInfo | None = None
    traceName: str | None = None
    displayTimeUnit: str | None = None


_EVENTS = msgspec.json.Decoder(list[_Event])
_KARGS = msgspec.json.Decoder(_KernelArgs)
_CARGS = msgspec.json.Decoder(_CommArgs)
_LAUNCH_ARGS = msgspec.json.Decoder(dict[str, Any])
_HEADER = msgspec.json.Decoder(_Header)


def is_kineto_trace(path: Path | str) -> bool:
    """Whether ``path`` holds a Chrome-trace JSON document (by content; any name, gzip or not)."""
    return sniff_trace(path)


def _ns(raw: msgspec.Raw | bytes | Decimal | None) -> int | None:
    """Microseconds as written (JSON number text, e.g. ``4989466584739.998``) to integer
    nanoseconds, exactly (no double in between); None when absent. Text with more than three
    decimals or an exponent goes through :class:`~decimal.Decimal` (rounded half-even to 1 ns)."""
    if raw is None:
        return None
    if isinstance(raw, Decimal):
        return int((raw * 1000).to_integral_value())
    b = bytes(raw)
    if b[-4:-3] == b".":  # the usual text, three decimals: the digits are the nanoseconds
        try:
            return int(b[:-4] + b[-3:])
        except ValueError:  # an exponent ("1.5e3"): below
            pass
    if not b or b == b"null":
        return None
    whole, _, frac = b.partition(b".")
    if len(frac) <= 3 and (not frac or frac.isdigit()) and whole.lstrip(b"-").isdigit():
        ns = int(whole) * 1000
        f = int(frac.ljust(3, b"0")) if frac else 0
        return ns - f if whole.startswith(b"-") else ns + f
    try:
        return int((Decimal(b.decode()) * 1000).to_integral_value())
    except (ArithmeticError, ValueError):
        raise ValueError(f"time {b.decode(errors='replace')!r} is not a number of microseconds") from None


@dataclass
class _Collected:
    kernels: list[dict[str, Any]] = field(default_factory=list)
    comms: list[tuple[Any, ...]] = field(default_factory=list)  # record_param_comms, COMM_RECORD_COLUMNS order
    launches: dict[tuple[int, int], tuple[int, int, int, int, str]] = field(default_factory=dict)
    ranges: list[tuple[int, int, int, int, str]] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    process_names: dict[int, str] = field(default_factory=dict)
    kernel_records: int = 0
    cuda_events: int = 0
    events: int = 0
    duplicate_correlations: int = 0


class KinetoTrace:
    """One PyTorch-profiler trace file, read in a single streaming pass on construction
    (:meth:`open`). Attributes after reading: ``rank``, ``world_size``, ``pg_config`` (list of
    dicts: name, desc, size, ranks), ``nccl_version``, ``base_time_ns`` (``utc_offset_ns``),
    ``pids`` (OS pids that launched kernels or own CPU events), ``truncated`` (why the file
    stops early, or None), ``kernel_records`` (all GPU kernels), ``bytes_read``."""

    source_kind = "pytorch_profiler"

    def __init__(self, path: Path, collected: _Collected, header: _Header, scan: ScanResult) -> None:
        self.path = path
        self._c = collected
        dist = header.distributedInfo
        self.rank = dist.rank if dist else None
        self.world_size = dist.world_size if dist else None
        self.nccl_version = dist.nccl_version if dist else None
        self.pg_config: list[dict[str, Any]] = []
        if dist and isinstance(dist.pg_config, list):
            self.pg_config = [{"name": g.pg_name, "desc": g.pg_desc, "size": g.pg_size, "ranks": g.ranks}
                              for g in dist.pg_config]
        elif dist and isinstance(dist.pg_config, dict):  # older PyTorch: {name: {desc, ranks, ...}}
            self.pg_config = [{"name": k, "desc": (v or {}).get("desc"), "size": (v or {}).get("size"),
                               "ranks": (v or {}).get("ranks")} for k, v in dist.pg_config.items()]
        self.base_time_ns = header.baseTimeNanoseconds
        self.schema_version = header.schemaVersion
        self.truncated = scan.truncated
        self.bytes_read = scan.bytes_read
        self.kernel_records = collected.kernel_records
        self.cuda_events = collected.cuda_events
        self.pids = sorted(collected.pids)
        self.hostname: str | None = None  # a trace records no host; the logs of its pids name it

    # ------------------------------------------------------------------ reading

    @classmethod
    def open(cls, path: Path | str, *, block_bytes: int | None = None) -> KinetoTrace:
        """Read ``path`` (``.json``, ``.json.gz``, any name). Raises :class:`KinetoFormatError`
        for a file that is not a Chrome trace or whose header is unreadable; a trace cut short
        is read up to its last complete event (``truncated`` says why)."""
        from nccltrace.kineto.scan import BLOCK_BYTES

        p = Path(path)
        if not p.is_file():
            raise KinetoFormatError(f"{p}: no such file; pass a PyTorch-profiler trace (.json or .json.gz)")
        if not sniff_trace(p):
            raise KinetoFormatError(f"{p}: not a Chrome-trace JSON document (no traceEvents): pass the trace "
                                    "torch.profiler wrote (tensorboard_trace_handler or prof.export_chrome_trace)")
        scan = ScanResult()
        c = _Collected()
        try:
            for run in iter_event_runs(p, scan, block_bytes or BLOCK_BYTES):
                try:
                    _collect(_EVENTS.decode(run), c)
                except (msgspec.DecodeError, ValueError) as e:
                    raise KinetoFormatError(f"{p}: damaged trace event near byte {scan.bytes_read:,} ({e}); the file "
                                            "was modified or is corrupt - write the trace again") from None
        except ValueError as e:
            if isinstance(e, KinetoFormatError):
                raise
            raise KinetoFormatError(f"{p}: {e}; not a PyTorch-profiler trace") from None
        try:
            header = _HEADER.decode(scan.header) if scan.header else _Header()
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            if scan.truncated is None:
                raise KinetoFormatError(f"{p}: the trace's header is not readable ({e})") from None
            header = _Header()
        _attach_launches(c)
        return cls(p, c, header, scan)

    # ------------------------------------------------------------------ tables

    @property
    def utc_offset_ns(self) -> int | None:
        """Add to a stored time to get UTC epoch ns (``baseTimeNanoseconds``), None without it."""
        return self.base_time_ns

    def kernels(self) -> pd.DataFrame:
        """NCCL kernels with their launch call, in nsys's kernel columns plus
        :data:`KERNEL_ARG_COLUMNS`, ordered by start."""
        spec = nsys_schema.KERNEL_TABLE_COLUMNS
        rows = self._c.kernels
        cols: dict[str, list[Any]] = {name: [r.get(name) for r in rows] for name, _ in spec}
        frame = nsys_reader._frame(cols, spec)
        return frame.sort_values(["start", "correlation_id"], kind="stable").reset_index(drop=True)

    def nvtx(self) -> pd.DataFrame:
        """CPU ranges (``user_annotation``: step markers, record_function names) as NVTX
        push/pop ranges of domain :data:`KINETO_DOMAIN`."""
        r = self._c.ranges
        cols = {"start": [x[0] for x in r], "end": [x[1] for x in r], "event_type": [_PUSH_POP] * len(r),
                "text": [x[4] for x in r], "domain": [KINETO_DOMAIN] * len(r), "pid": [x[2] for x in r],
                "tid": [x[3] for x in r], "global_tid": [_gtid(x[2], x[3]) for x in r],
                "payload_source": [None] * len(r)}  # fmt: skip
        return nsys_reader._frame(cols, nsys_schema.NVTX_COLUMNS)

    def comm_records(self) -> pd.DataFrame:
        """ProcessGroupNCCL's record of each call (the ``record_param_comms`` CPU ops: collectives,
        send, recv, ``wait``) in :data:`~nccltrace.nsys.schema.COMM_RECORD_COLUMNS`, ordered by
        start; empty when the trace kept no CPU activity."""
        spec = nsys_schema.COMM_RECORD_COLUMNS
        rows = self._c.comms
        cols = {name: [r[i] for r in rows] for i, (name, _) in enumerate(spec)}
        frame = nsys_reader._frame(cols, spec)
        return frame.sort_values("start", kind="stable").reset_index(drop=True)

    def processes(self) -> pd.DataFrame:
        """The OS processes of the trace (pid, name)."""
        pids = self.pids
        cols = {"global_pid": [p << 24 for p in pids], "pid": pids,
                "name": [self._c.process_names.get(p) for p in pids]}
        return nsys_reader._frame(cols, nsys_schema.PROCESS_COLUMNS)

    def session_info(self) -> dict[str, Any]:
        """Session metadata as written to ``session.json`` (the keys of an nsys export's, plus
        the profiler's rank, world size, process groups and NCCL version)."""
        from nccltrace.core.provenance import file_sha256

        return {
            "source_file": self.path.name,
            "source_sha256": file_sha256(self.path),
            "source_kind": self.source_kind,
            "schema_version": None if self.schema_version is None else str(self.schema_version),
            "product_version": "torch.profiler (Kineto)",
            "hostname": self.hostname,
            "session_start_utc_ns": self.base_time_ns,
            "time_normalized": False,
            "time_shift_ns": None,
            "utc_offset_ns": self.utc_offset_ns,
            "undecoded_payload_blobs": 0,
            "kernel_table": self.cuda_events > 0,
            "kernel_records": self.kernel_records,
            "skipped_kernel_rows": 0,
            "nccl_api_calls": None,
            "pids": self.pids,
            "rank": self.rank,
            "world_size": self.world_size,
            "pg_config": self.pg_config,
            "nccl_version": self.nccl_version,
            "truncated": self.truncated,
            "trace_bytes": self.bytes_read,
            "duplicate_correlation_ids": self._c.duplicate_correlations,
        }

    def export_tables(self, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
        """Write the tables an nsys export's :meth:`~nccltrace.nsys.reader.NsysExport.export_tables`
        writes, with the same names and columns (``kernels`` fills :data:`KERNEL_ARG_COLUMNS`;
        ``launches_without_kernel`` and ``nccl_api_calls`` are empty: a profiler trace records
        neither lost launches nor NCCL's own API ranges), plus ``comm_records``
        (:meth:`comm_records`, a table only a profiler trace has). Each file appears atomically."""
        from nccltrace.core.tables import (
            atomic_output,
            frame_to_table,
            write_table_atomic,
        )

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {name: out / f"{name}.parquet" for name in
                 ("kernels", "nvtx", "processes", "launches_without_kernel", "comm_records", "nccl_api_calls")}
        paths["session"] = out / SESSION_FILE
        specs = {**nsys_schema.KERNEL_SOURCE_TABLES, **nsys_schema.PROFILER_TABLES}
        frames = {"kernels": self.kernels(), "nvtx": self.nvtx(), "processes": self.processes(),
                  "launches_without_kernel": nsys_reader._frame({}, specs["launches_without_kernel"]),
                  "comm_records": self.comm_records()}
        for key, frame in frames.items():
            write_table_atomic(frame_to_table(frame, nsys_schema.spec_schema(specs[key])), paths[key])
        write_table_atomic(NCCL_API_CALLS_SCHEMA.empty_table(), paths["nccl_api_calls"])
        with atomic_output(paths["session"]) as tmp:
            tmp.write_text(json.dumps(self.session_info(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return paths


def _gtid(pid: int | None, tid: int | None) -> int | None:
    if pid is None or tid is None:
        return None
    return (int(pid) << 24) | (int(tid) & 0xFFFFFF)


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


_IS_LAUNCH: dict[str, bool] = {}


def _is_launch(name: str) -> bool:
    hit = _IS_LAUNCH.get(name)
    if hit is None:
        hit = _IS_LAUNCH[name] = any(s in name for s in _LAUNCH_APIS)
    return hit


def _collect(events: list[_Event], c: _Collected) -> None:
    """Keep what the tables need from one run of events: NCCL kernels (with their arguments),
    kernel launch calls, ProcessGroupNCCL's call records (``record_param_comms``), CPU ranges,
    process names."""
    c.events += len(events)
    pids = c.pids
    for e in events:
        cat = e.cat
        if cat == "cuda_runtime" or cat == "cuda_driver":
            c.cuda_events += 1
            pid = e.pid
            if type(pid) is not int:
                continue
            pids.add(pid)
            if not e.args or not _is_launch(e.name or ""):
                continue
            corr = _LAUNCH_ARGS.decode(e.args).get("correlation")
            if not isinstance(corr, int):
                continue
            start = _ns(e.ts)
            key = (pid, corr)
            if key in c.launches:
                c.duplicate_correlations += 1
                continue
            c.launches[key] = (start, start + (_ns(e.dur) or 0), pid, _int(e.tid) or -1, e.name or "")
        elif cat == "kernel":
            _keep_kernel(e, c)
        elif cat == "cpu_op":
            if e.name == "record_param_comms":
                _keep_comm(e, c)
        elif cat == "user_annotation" and e.ph == "X":
            pid, tid = _int(e.pid), _int(e.tid)
            start = _ns(e.ts)
            if pid is None or start is None:
                continue
            c.pids.add(pid)
            c.ranges.append((start, start + (_ns(e.dur) or 0), pid, tid, e.name or ""))
        elif e.ph == "M" and e.name == "process_name" and _int(e.pid) is not None and e.args:
            label = _LAUNCH_ARGS.decode(e.args).get("name")
            if isinstance(label, str):
                c.process_names.setdefault(int(e.pid), label)  # type: ignore[arg-type]


def _keep_kernel(e: _Event, c: _Collected) -> None:
    """Count a GPU kernel; keep it with its arguments when it is NCCL's."""
    c.kernel_records += 1
    c.cuda_events += 1
    name = e.name or ""
    short = name.split("(", 1)[0].strip().removeprefix("void ")
    if not short.startswith("nccl"):
        return
    a = _KARGS.decode(e.args) if e.args else _KernelArgs()
    start = _ns(e.ts)
    dur = _ns(e.dur) or 0
    grid = (a.grid or [None, None, None]) + [None, None, None]
    block = (a.block or [None, None, None]) + [None, None, None]
    c.kernels.append({
        "start": start, "end": None if start is None else start + dur, "device_id": a.device,
        "context_id": a.context, "stream_id": a.stream if a.stream is not None else _int(e.tid),
        "correlation_id": a.correlation, "name": name, "short_name": short,
        "grid_x": grid[0], "grid_y": grid[1], "grid_z": grid[2],
        "block_x": block[0], "block_y": block[1], "block_z": block[2],
        "registers_per_thread": a.registers, "static_shared_memory": 0, "dynamic_shared_memory": a.shared,
        "graph_id": a.graph_id, "graph_node_id": a.graph_node_id,
        "coll_name": a.coll, "coll_in_nelems": a.in_nelems, "coll_out_nelems": a.out_nelems,
        "coll_dtype": a.dtype, "coll_group_size": a.group_size, "pg_name": a.pg_name,
        "pg_desc": a.pg_desc, "pg_ranks": a.pg_ranks, "external_id": a.external_id,
    })  # fmt: skip


def _keep_comm(e: _Event, c: _Collected) -> None:
    """Keep one ``record_param_comms`` CPU op: its times, thread and the call's arguments (a row
    of ``COMM_RECORD_COLUMNS``); one without a start is dropped."""
    start = _ns(e.ts)
    if start is None:
        return
    pid, tid = _int(e.pid), _int(e.tid)
    if pid is not None:
        c.pids.add(pid)
    a = _CARGS.decode(e.args) if e.args else _CommArgs()
    c.comms.append((start, start + (_ns(e.dur) or 0), pid, tid, a.external_id, a.coll, a.in_nelems, a.out_nelems,
                    a.dtype, a.group_size, a.pg_name, a.pg_desc, a.pg_ranks, a.rank, a.dst_rank, a.src_rank))


def _attach_launches(c: _Collected) -> None:
    """Give each NCCL kernel its launch call (pid, thread, API, times) by correlation id."""
    by_corr: dict[int, list[tuple[int, int]]] = {}
    for pid, corr in c.launches:
        by_corr.setdefault(corr, []).append((pid, corr))
    for k in c.kernels:
        corr = k.get("correlation_id")
        keys = by_corr.get(corr, []) if corr is not None else []
        if len(keys) != 1:
            # no launch (outside the trace's CPU activity) or ambiguous (several processes in one
            # file reuse correlation ids): the kernel keeps no launch, and no process
            continue
        start, end, pid, tid, api = c.launches[keys[0]]
        k.update(launch_start=start, launch_end=end, launch_tid=tid, launch_global_tid=_gtid(pid, tid),
                 launch_api=api, pid=pid, global_pid=pid << 24)


def iter_kineto_files(paths: list[Path]) -> Iterator[Path]:
    """The files among ``paths`` (directories searched recursively) that are Chrome traces."""
    for p in paths:
        if p.is_dir():
            for q in sorted(x for x in p.rglob("*") if x.is_file()):
                if q.suffix in (".json", ".gz") and is_kineto_trace(q):
                    yield q
        elif p.is_file() and is_kineto_trace(p):
            yield p
