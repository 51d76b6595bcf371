"""Stage trace: the run's Chrome Trace Event JSON (gzip), one process per rank, for Perfetto."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nccltrace.core.layout import RunLayout
from nccltrace.core.provenance import write_manifest
from nccltrace.outputs.perfetto import write_run_traces
from nccltrace.stages import StageResult

__all__ = ["run_trace"]


def run_trace(layout: RunLayout, options: Mapping[str, Any] | None, procs: Iterable[str],
              hosts: Iterable[str]) -> StageResult:  # fmt: skip
    """Write the full (capped) trace and its summary trace from the ops table, the metrics and
    the parsed tables of processes ``procs`` (call buffers) and nodes ``hosts`` (kernel
    geometry, NVTX, session clocks)."""
    opts = dict(options or {})
    procs, hosts = list(procs), list(hosts)
    summaries = write_run_traces(layout.root, layout.trace_dir, summary=True,
                                 max_events=opts.get("max_events", 500_000),
                                 summary_max_events=opts.get("summary_max_events", 200_000),
                                 window_nvtx=opts.get("window_nvtx"), min_message_bytes=opts.get("min_message_bytes"),
                                 procs=procs, hosts=hosts)  # fmt: skip
    notes = [n for s in summaries for n in s.notes]
    nsys = [layout.parsed_nsys_table(h, t) for h in hosts for t in ("kernels", "nvtx")]
    write_manifest(layout.manifest(layout.trace_dir), stage="trace",
                   inputs=[layout.ops, layout.metric("op_metrics"), layout.labels, *nsys,
                           *(layout.session(h) for h in hosts), *(layout.parsed_nccl_table(p, "calls") for p in procs)],
                   outputs=[s.path for s in summaries], config=opts,
                   extra={"files": {s.path.name: {"events": s.events, "bytes": s.bytes, "json_bytes": s.json_bytes,
                                                  "truncated": s.truncated} for s in summaries},
                          "events": sum(s.events for s in summaries), "clock": summaries[0].clock if summaries else None,
                          "truncated": any(s.truncated for s in summaries), "notes": notes})  # fmt: skip
    return StageResult("trace", [s.path for s in summaries],
                       summary="; ".join(f"{s.path.name}: {s.events} events, clock {s.clock}" for s in summaries),
                       notes=notes)
