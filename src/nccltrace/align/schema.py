"""What the alignment writes that later stages read: the alignment table's schema, the reasons
of its unmatched rows that they test for, and the alignment modes. Light (no alignment code), so
that the ops, metrics and parse-summary stages need not carry the aligners into their code stamps.
"""

from __future__ import annotations

import pyarrow as pa

from nccltrace.core.tables import documented_field as _f

__all__ = [
    "ALIGNMENT_SCHEMA",
    "FOREIGN_PROCESS_REASON",
    "GRAPH_CAPTURED_REASON",
    "MODES",
    "NOT_IN_EXPORT_REASON",
    "NO_CALL_RECORD_REASON",
    "NO_EXPORT_REASON",
    "OUTSIDE_CAPTURE_REASON",
]

MODES = ("default", "thesis", "exact")
NO_EXPORT_REASON = "no_export"
"""Reason of call lines whose node has no usable nsys export (missing, unreadable)."""
NOT_IN_EXPORT_REASON = "not_in_export"
"""Reason of call lines of a process with no NCCL kernel or launch in its node's export (a rank
the capture did not profile)."""
FOREIGN_PROCESS_REASON = "other_process_in_log"
"""Reason of call lines of another process in a log (a shared file): never aligned."""
GRAPH_CAPTURED_REASON = "graph_captured"
"""Reason of call lines captured into a CUDA graph: logged once, their kernels are the replays."""
NO_CALL_RECORD_REASON = "no_call_record"
"""Reason of kernel rows of a log-less process whose kernel no call record of its sources claims
(an nsys kernel launched before the export's window, a profiler kernel without its record)."""
OUTSIDE_CAPTURE_REASON = "outside_capture"
"""Reason of call lines written outside the span the capture covers (a step-window capture)."""


ALIGNMENT_SCHEMA = pa.schema(
    [
        _f("row_kind", pa.string(), "", "'call' (a call line of the log) or 'kernel' (a kernel no call matched)"),
        _f("file", pa.string(), "", "log file of the call (null for kernel rows)"),
        _f("line", pa.int64(), "", "1-based line of the call in that file"),
        _f("host", pa.string(), "", "host of the process"),
        _f("pid", pa.int64(), "", "process id"),
        _f("op", pa.string(), "", "logged NCCL function"),
        _f("comm", pa.uint64(), "address", "process-local communicator pointer of the call"),
        _f("op_count", pa.int64(), "", "opCount of the call"),
        _f("unit", pa.int64(), "", "launch unit (calls of one kernel launch share it; per process, 0-based)"),
        _f("kernel_global_pid", pa.int64(), "", "nsys globalPid of the kernel's process (provenance)"),
        _f("kernel_correlation_id", pa.int64(), "", "CUPTI correlationId of the kernel (with globalPid: unique)"),
        _f("kernel_name", pa.string(), "", "short kernel name"),
        _f("kernel_stream_id", pa.int64(), "", "CUDA stream id the kernel ran on"),
        _f("kernel_start", pa.int64(), "ns", "kernel start on the node's nsys timeline"),
        _f("kernel_end", pa.int64(), "ns", "kernel end on the node's nsys timeline"),
        _f("launch_start", pa.int64(), "ns", "start of the API call that launched the kernel (nsys timeline)"),
        _f("status", pa.string(), "", "'matched' or 'unmatched'"),
        _f("reason", pa.string(), "", "why unmatched: 'duplicate_line', 'single_rank_communicator' (NCCL launches "
           "no kernel), 'no_kernel' (gap: kernel missing from the export or line order), 'ambiguous' (several "
           "equally good alignments disagree; left unmatched rather than guessed), 'kernel_record_missing' (the launch "
           "call is in the export, its kernel record is not; kernel columns name the launch), 'no_export' (the "
           "process's node has no nsys export), 'graph_replay' (kernel rows: launched by a CUDA graph replay; "
           "its call was logged once at capture), 'not_in_export' (the export has no NCCL kernel or launch of the "
           "process: a rank the capture did not profile), 'outside_capture' (the line was written outside the span of the "
           "export's capture, located by log time or declared steps), 'capture_not_located' (the export covers "
           "part of the log, or the log part of the export, and nothing locates one in the other: no log "
           "timestamps, no declared steps), 'contradicted_log_time' (the aligned kernel was launched outside "
           "the log-line -> launch window learned from the process's certain matches: demoted, see "
           "alignment_quality.json), 'graph_captured' (the call was captured into a CUDA graph: its launch lies "
           "inside a stream capture and its kernels run in the graph's replays, kernel rows 'graph_replay'), "
           "'contradicted_stream' (the aligned kernel ran on the export stream of "
           "another log stream: demoted), 'contradicted_cross_rank' (ops table: the kernel disagrees with its "
           "instance's other ranks or its communicator's instance order: demoted), 'no_log_line' (kernel rows), "
           "'unparsed' (thesis mode: not an op it aligns), 'no_call_record' (kernel rows of a process without a log: no "
           "call record of its sources claims the kernel); null when matched"),
        _f("confidence", pa.float64(), "", "0..1: share of the available evidence (family, dtype, stream, time) "
           "that confirms the match; 1.0 for exact matches; null when unmatched"),
        _f("method", pa.string(), "", "'alignment', 'opcount' (fixed by opCount arithmetic), 'thesis-nw', "
           "'nvtx' (exact); without a log, the link the call's own record makes: 'kernel-record' (the profiler's "
           "kernel carries the call's id), 'cpu-record' (a batched P2P kernel, without a record of its own, launched after its send/recv records on their thread), "
           "'nvtx-launch' (nsys: the launch inside the API call's range), 'fr-batch' (a batched Send/Recv kernel without "
           "a record of its calls, given them from the Flight Recorder entries enqueued just before its launch)"),
        _f("duplicate_of", pa.int64(), "", "for duplicate lines: the line they repeat"),
        _f("steps_verified", pa.bool_(), "", "calls of a partial capture located in the log: true when the evidence "
           "that located it also fixes which training iterations were captured (log timestamps, the profiler's step "
           "markers, the trace's kernel sequence placed in the log), false when declared steps were found from the "
           "log's step structure alone (identical steps: a shift by whole steps cannot be told, the iteration numbers "
           "are unverified); null for a whole capture or one not located"),
    ]
)
