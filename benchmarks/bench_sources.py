"""Evidence sources without NCCL logs: a large profiler trace read with ProcessGroupNCCL's call
records kept, and the call rows made from it.

``write_trace(path, mb)`` tiles the events of the real capture's four traces (in the
repository's ``tests/data/real``) to ``mb`` MB of JSON: one file holding the four ranks'
processes, every copy shifted in time and given fresh correlation and External ids, so kernels,
launches and ``record_param_comms`` records stay linked as in the capture. ``run(path, what)``
measures in this interpreter: ``read`` (``KinetoTrace.open``: every event decoded, NCCL kernels,
launches, ranges and the ``record_param_comms`` records kept) or ``calls``
(``profiler_call_records`` per process on the read trace). Each is meant to run in a fresh
interpreter (``run_benchmarks.py`` does)."""

from __future__ import annotations

import gzip
import re
import resource
import time
from pathlib import Path
from typing import Any

import msgspec

KINETO = (
    Path(__file__).resolve().parents[1]
    / "tests"
    / "data"
    / "real"
    / "torch_nccl228_h200_tp2pp2"
    / "kineto"
)
_TS = re.compile(rb'("ts": )(-?\d+)')
_IDS = re.compile(rb'("(?:External id|correlation)": )(\d+)')


def _seeds() -> tuple[bytes, list[bytes]]:
    """(the rank-0 trace with a placeholder for its events, each rank's events as JSON text)."""
    head = b""
    bodies = []
    for r in range(4):
        doc = msgspec.json.decode(gzip.decompress((KINETO / f"kineto_rank{r}.json.gz").read_bytes()),
                                  type=dict[str, msgspec.Raw])  # fmt: skip
        events = msgspec.json.decode(doc["traceEvents"], type=list[msgspec.Raw])
        bodies.append(b",\n".join(bytes(e) for e in events))
        if r == 0:
            head = msgspec.json.encode(
                {**doc, "traceEvents": msgspec.Raw(b"[@EVENTS@]")}
            )
    return head, bodies


def _shifted(body: bytes, us: int, ids: int) -> bytes:
    """``body`` with every time ``us`` microseconds later and every correlation and External id
    ``ids`` higher (the decimal text of the times kept)."""
    if not us and not ids:
        return body
    body = _TS.sub(lambda m: m.group(1) + str(int(m.group(2)) + us).encode(), body)
    return _IDS.sub(lambda m: m.group(1) + str(int(m.group(2)) + ids).encode(), body)


def write_trace(path: Path, mb: float) -> dict[str, Any]:
    """Write a trace of about ``mb`` MB (copies of the four ranks' events, one after another in
    time); returns its size and the number of copies."""
    head, bodies = _seeds()
    per_copy = sum(len(b) for b in bodies)
    copies = max(1, round(mb * 1e6 / per_copy))
    pre, _, post = head.partition(b"@EVENTS@")
    with open(path, "wb") as fh:
        fh.write(pre)
        for i in range(copies):
            for r, body in enumerate(bodies):
                if i or r:
                    fh.write(b",\n")
                # a copy lies 10 s after the one before (the window is < 1 s); ids stay unique
                fh.write(_shifted(body, i * 10_000_000, (i * 4 + r) * 1_000_000))
        fh.write(post)
    return {"bytes": path.stat().st_size, "copies": copies, "ranks": len(bodies)}


def _calls(trace) -> tuple[int, int, int]:
    """(rows, rows with a kernel, messages) of ``profiler_call_records`` over the trace's processes."""
    from nccltrace.kineto.comm_calls import profiler_call_records

    kernels, records, session = (
        trace.kernels(),
        trace.comm_records(),
        trace.session_info(),
    )
    rows = linked = messages = 0
    for pid in trace.pids:
        out = profiler_call_records(kernels[kernels["pid"] == pid], records[records["pid"] == pid], session,
                                    trace.path.name)  # fmt: skip
        rows += len(out.records)
        linked += int(out.records["kernel_correlation_id"].notna().sum())
        messages += len(out.messages)
    return rows, linked, messages


def run(path: Path, what: str) -> dict[str, Any]:
    """``read`` or ``calls`` on ``path``: wall and CPU seconds of the step alone (after imports,
    a warm-up read that loads the compiled scanner and, for ``calls``, the read), peak RSS
    (MiB) and what it found."""
    import tempfile

    from nccltrace.kineto.reader import KinetoTrace

    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm.json"
        warm.write_text(
            '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 1.5}]}'
        )
        KinetoTrace.open(warm)
    if what == "read":
        t0, c0 = time.perf_counter(), time.process_time()
        trace = KinetoTrace.open(path)
        out: dict[str, Any] = {
            "kernels": len(trace.kernels()),
            "comm_records": len(trace.comm_records()),
        }
    elif what == "calls":
        trace = KinetoTrace.open(path)
        t0, c0 = time.perf_counter(), time.process_time()
        rows, linked, messages = _calls(trace)
        out = {"rows": rows, "linked": linked, "messages": messages}
    else:
        raise ValueError(what)
    return {**out, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # fmt: skip
