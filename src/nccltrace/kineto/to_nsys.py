"""Write a PyTorch-profiler trace's kernels as an nsys SQLite export in the real time base.

A test instrument and a conversion for users whose tools read only nsys exports: the NCCL kernels
with their launch calls and the profiler's CPU ranges as NVTX ranges, stored as nsys >= 2025
stores them, so that reading the result back gives the trace's UTC times exactly. What is
written: ``docs/kineto.md``, Module notes.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from nccltrace.kineto.reader import KinetoTrace

__all__ = ["SESSION_LEAD_NS", "write_nsys_export"]

SESSION_LEAD_NS = 5_000_000_000
"""How long before the trace's first event the written session starts (a profiler session starts
before its first record)."""


def write_nsys_export(traces: list[Path | str] | Path | str, out: Path | str, *, hostname: str,
                      schema_version: str = "3.28.1") -> Path:  # fmt: skip
    """Write the NCCL kernels, their launches and the CPU ranges of ``traces`` (one or several
    profiler traces of one host) into one nsys export ``out`` of node ``hostname``. Times stay
    on the host's monotonic clock; the session starts :data:`SESSION_LEAD_NS` before the first
    record."""
    from nccltrace.nsys.writer import NsysExportWriter

    paths = [Path(traces)] if isinstance(traces, (str, Path)) else [Path(p) for p in traces]
    opened = [KinetoTrace.open(p) for p in paths]
    bases = {t.base_time_ns for t in opened}
    if None in bases or len(bases) != 1:
        raise ValueError(f"traces {', '.join(p.name for p in paths)} have {'no' if None in bases else 'different'} "
                         "baseTimeNanoseconds: one export holds one host's clock")
    base = bases.pop()
    kernels = [t.kernels() for t in opened]
    ranges = [t.nvtx() for t in opened]
    starts = [int(f["start"].min()) for f in kernels + ranges if len(f)]
    if not starts:
        raise ValueError(f"{', '.join(p.name for p in paths)}: no NCCL kernel or CPU range to write")
    clock0 = min(starts) - SESSION_LEAD_NS
    w = NsysExportWriter(out, schema_version, hostname=hostname, session_start_utc_ns=base + clock0,
                         session_clock_ns=clock0)  # fmt: skip
    try:
        for t, k, r in zip(opened, kernels, ranges, strict=True):
            for pid in t.pids:
                w.add_process(pid, t._c.process_names.get(pid) or "python3")
            k = k[k["pid"].notna()]
            if len(k):
                for tid in k["launch_tid"].dropna().unique():
                    w.add_thread(int(k["pid"].iloc[0]), int(tid) & 0xFFFFFF)
                kk = k.assign(pid=k["pid"].astype("int64"), device_id=k["device_id"].fillna(0).astype("int64"),
                              context_id=k["context_id"].fillna(1).astype("int64"),
                              registers_per_thread=k["registers_per_thread"].fillna(0).astype("int64"),
                              dynamic_shared_memory=k["dynamic_shared_memory"].fillna(0).astype("int64"))
                for c in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"):
                    kk[c] = kk[c].fillna(1).astype("int64")
                w.add_kernels(kk.drop(columns=["graph_id", "graph_node_id", "green_context_id"]))
                launches = pd.DataFrame({
                    "start": k["launch_start"].astype("int64"), "end": k["launch_end"].astype("int64"),
                    "pid": k["pid"].astype("int64"), "tid": k["launch_tid"].astype("int64") & 0xFFFFFF,
                    "correlation_id": k["correlation_id"].astype("int64"), "name": k["launch_api"].astype(object),
                    "event_class": k["launch_api"].astype(str).str.startswith("cu").astype("int64"),
                })  # fmt: skip
                w.add_runtime(launches[k["launch_start"].notna().to_numpy()])
            if len(r):
                w.add_nvtx_ranges(pd.DataFrame({
                    "start": r["start"].astype("int64"), "end": r["end"].astype("int64"),
                    "pid": r["pid"].astype("int64"), "tid": r["tid"].astype("int64") & 0xFFFFFF,
                    "text": r["text"].astype(object), "registered": False, "domain_id": 0, "category": 0,
                    "color": None, "event_type": 59,
                }))  # fmt: skip
    finally:
        w.close()
    return Path(out)
