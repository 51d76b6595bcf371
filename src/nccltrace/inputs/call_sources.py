"""The per-call provenance table of a process without an NCCL log (``call_sources.parquet``)
and the provenance columns the ops table carries: light (a schema, no code), so that the ops
stage and ``tables-doc`` need not carry the record writers (``inputs.call_records``) into their
code stamps."""

from __future__ import annotations

import pyarrow as pa

from nccltrace.core.tables import documented_field

__all__ = ["CALL_SOURCE_SCHEMA", "PROVENANCE_COLUMNS"]

PROVENANCE_COLUMNS = ("source", "op_source", "size_source", "comm_source", "rank_source", "time_source",
                      "seq_source")  # fmt: skip

_f = documented_field
CALL_SOURCE_SCHEMA = pa.schema([
    _f("file", pa.string(), "", "the call's source file (as calls.file)"),
    _f("line", pa.int64(), "", "1-based position of the call's record in that file (as calls.line)"),
    _f("source", pa.string(), "", "what the row was made from: 'nccl-log' (a log line; in ops, kernel rows of "
       "logged runs too), 'profiler' (a PyTorch-profiler trace's records), 'flight-recorder' (a Flight Recorder "
       "entry), 'nsys-nvtx' (an NCCL API range of an nsys export)"),
    _f("op_source", pa.string(), "", "which record named op: 'nccl-log', 'kernel-record' (the profiler's kernel "
       "arguments), 'cpu-record' (the profiler's record_param_comms op), 'flight-recorder', 'nvtx-range'; null: no "
       "source named it"),
    _f("size_source", pa.string(), "", "which record gave count and datatype (as op_source, or 'nvtx-payload'); null: "
       "no present source records the size (the run's problems say what to capture)"),
    _f("comm_source", pa.string(), "", "what the communicator is known from: 'nccl-init' (init lines), "
       "'process-group' (PyTorch's process group: name and global ranks), 'nvtx-comm-id'; null: unknown"),
    _f("rank_source", pa.string(), "", "what names the process's global rank: 'communicators' (logged processes: "
       "the communicators stage, from the world communicator or the run's other rank records), "
       "'profiler-distributed-info' (the trace's distributedInfo), 'flight-recorder' (the dump's groups), "
       "'file-name' (a dump whose groups do not name it: its file name, said as a problem); null: unknown"),
    _f("time_source", pa.string(), "", "what gives the kernel times: 'kernel' (a kernel record of the source), "
       "'fr-timing' (Flight Recorder with TORCH_NCCL_ENABLE_TIMING=1); null: no kernel time"),
    _f("seq_source", pa.string(), "", "what gives pg_seq: 'flight-recorder' (PyTorch's collective_seq_id / "
       "p2p_seq_id); null: no sequence number (instances then by the call's position in its group)"),
    _f("torch_op", pa.string(), "", "PyTorch's collective as recorded (all_gather, reduce_scatter, send, ...)"),
    _f("pg_name", pa.string(), "", "PyTorch process group name of the call"),
    _f("pg_desc", pa.string(), "", "process group description (Megatron's group name)"),
    _f("pg_seq", pa.int64(), "", "PyTorch's sequence number of the call in its group (seq_source)"),
    _f("record_utc", pa.int64(), "ns", "start of the profiler's CPU record of the call (UTC)"),
    _f("enqueue_utc", pa.int64(), "ns", "Flight Recorder's enqueue time of the call (UTC, CPU clock; not a kernel "
       "time)"),
    _f("fr_started_utc", pa.int64(), "ns", "GPU start Flight Recorder timed (TORCH_NCCL_ENABLE_TIMING=1; UTC)"),
    _f("fr_ended_utc", pa.int64(), "ns", "GPU end Flight Recorder timed (UTC)"),
])  # fmt: skip
CALL_SOURCE_SCHEMA = CALL_SOURCE_SCHEMA.with_metadata({b"doc": b"Per call of a process: the source of each fact."})
