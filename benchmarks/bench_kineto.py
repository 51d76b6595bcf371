"""PyTorch-profiler trace parsing: a large trace, and the readers compared on it.

``write_trace(path, mb)`` tiles the events of the real capture's rank-0 trace (in the repository's
``tests/data/real``; a synthetic trace of the same event mix if it is absent) to
``mb`` MB of JSON, shifting each copy's times; ``run_reader(path, how)`` parses it in this
interpreter with one of: ``json`` (``json.load`` of the whole document), ``msgspec-whole``
(untyped decode of the whole document), ``nccltrace`` (``KinetoTrace.open``: streaming, typed,
exact times). Each is meant to run in a fresh interpreter (``run_benchmarks.py`` does)."""

from __future__ import annotations

import gzip
import json
import resource
import time
from pathlib import Path
from typing import Any

REAL_TRACE = (Path(__file__).resolve().parents[1] / "tests" / "data" / "real" / "torch_nccl228_h200_tp2pp2" / "kineto"
              / "kineto_rank0.json.gz")


def _seed() -> tuple[bytes, bytes, bytes]:
    """(header up to the events array, the events' text, the rest) of the seed trace."""
    if REAL_TRACE.is_file():
        doc = gzip.decompress(REAL_TRACE.read_bytes())
    else:
        events = []
        for i in range(2000):
            ts = 4989466584739.998 + i * 50
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernelEx", "pid": 498, "tid": 498,
                           "ts": ts, "dur": 5.5, "args": {"correlation": i, "cbid": 652}})
            events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL(x)", "pid": 0,
                           "tid": 7, "ts": ts + 10, "dur": 20.25, "args": {"correlation": i, "stream": 7,
                           "grid": [2, 1, 1], "block": [288, 1, 1], "In msg nelems": 1024}})
        doc = json.dumps({"baseTimeNanoseconds": 1, "traceEvents": events}).encode()
    head, _, rest = doc.partition(b'"traceEvents": [')
    body, _, tail = rest.rpartition(b"]")
    return head + b'"traceEvents": [', body.strip().rstrip(b","), b"]" + tail


def write_trace(path: Path, mb: float) -> dict[str, Any]:
    """Write a trace of about ``mb`` MB (tiles of the seed's events); returns its size."""
    head, body, tail = _seed()
    copies = max(1, int(mb * 1e6 / max(len(body), 1)))
    with open(path, "wb") as fh:
        fh.write(head)
        for i in range(copies):
            if i:
                fh.write(b",\n")
            fh.write(body)
        fh.write(tail)
    return {"bytes": path.stat().st_size, "copies": copies, "real_seed": REAL_TRACE.is_file()}


def run_reader(path: Path, how: str) -> dict[str, Any]:
    """Parse ``path`` with reader ``how``; wall and CPU seconds (after imports and a warm-up that
    loads the compiled scanner), peak RSS (MiB), NCCL kernels."""
    if how == "nccltrace":
        import tempfile

        from nccltrace.kineto.reader import KinetoTrace

        with tempfile.TemporaryDirectory() as tmp:
            warm = Path(tmp) / "warm.json"
            warm.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "x", "ts": 1.5}]}')
            KinetoTrace.open(warm)
    elif how == "msgspec-whole":
        import msgspec  # noqa: F401
    t0, c0 = time.perf_counter(), time.process_time()
    kernels = -1
    if how == "json":
        with open(path, "rb") as fh:
            doc = json.load(fh)
        kernels = sum(1 for e in doc["traceEvents"] if e.get("cat") == "kernel" and e["name"].startswith("nccl"))
    elif how == "msgspec-whole":
        import msgspec

        doc = msgspec.json.decode(path.read_bytes())
        kernels = sum(1 for e in doc["traceEvents"] if e.get("cat") == "kernel" and e["name"].startswith("nccl"))
    elif how == "nccltrace":
        from nccltrace.kineto.reader import KinetoTrace

        kernels = len(KinetoTrace.open(path).kernels())
    else:
        raise ValueError(how)
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "kernels": kernels,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
