"""The column specs of the tables read from nsys exports and written by every kernel source (nsys
exports, profiler traces, their per-node merge), and their Arrow schemas: the one home the reader,
the NCCL API linking and the other kernel sources import, light (no SQLite, no reader).
"""

from __future__ import annotations

from nccltrace.core.kernel_args import KERNEL_ARG_COLUMNS

__all__ = [
    "COMM_RECORD_COLUMNS",
    "COMM_RECORD_DOCS",
    "GPID_MASK",
    "GPU_COLUMNS",
    "KERNEL_COLUMNS",
    "KERNEL_SOURCE_TABLES",
    "KERNEL_TABLE_COLUMNS",
    "LAUNCH_COLUMNS",
    "NCCL_COLUMN_KINDS",
    "NVTX_COLUMNS",
    "PAYLOAD_SCHEMA_ENTRY_COLUMNS",
    "PROCESS_COLUMNS",
    "PROFILER_TABLES",
    "RUNTIME_COLUMNS",
    "THREAD_COLUMNS",
    "spec_schema",
]

# 0xFFFFFFFFFF000000 as a signed int64: keeps HW, VM and PID bits (globalTid -> globalPid).
GPID_MASK = -16777216
NCCL_COLUMN_KINDS: dict[str, str] = {
    "nccl_message_bytes": "Int64",
    "nccl_comm_id": "UInt64",
    "nccl_root": "Int64",
    "nccl_peer": "Int64",
    "nccl_redop": "Int64",
    "nccl_rank": "Int64",
    "nccl_nranks": "Int64",
    "nccl_cuda_dev": "Int64",
    "nccl_color": "Int64",
    "nccl_key": "Int64",
    "nccl_parent_comm_id": "UInt64",
}

# (column, kind) specs. Kinds: int64 (never NULL), Int64/UInt64 (nullable), float64, object.
KERNEL_COLUMNS: list[tuple[str, str]] = [
    ("start", "int64"), ("end", "int64"), ("device_id", "int64"), ("context_id", "int64"),
    ("stream_id", "int64"), ("correlation_id", "Int64"), ("global_pid", "Int64"), ("pid", "Int64"),
    ("name", "object"), ("short_name", "object"),
    ("grid_x", "int64"), ("grid_y", "int64"), ("grid_z", "int64"),
    ("block_x", "int64"), ("block_y", "int64"), ("block_z", "int64"),
    ("registers_per_thread", "int64"), ("static_shared_memory", "int64"), ("dynamic_shared_memory", "int64"),
    ("green_context_id", "Int64"),
    ("launch_start", "Int64"), ("launch_end", "Int64"), ("launch_global_tid", "Int64"), ("launch_tid", "Int64"),
    ("launch_api", "object"), ("launch_event_class", "Int64"),
    ("graph_id", "Int64"), ("graph_node_id", "Int64"),
]  # fmt: skip
NVTX_COLUMNS: list[tuple[str, str]] = [
    ("start", "int64"), ("end", "Int64"), ("event_type", "int64"), ("text", "object"),
    ("domain", "object"), ("domain_id", "Int64"), ("category", "Int64"), ("category_name", "object"),
    ("color", "Int64"), ("global_tid", "Int64"), ("pid", "Int64"), ("tid", "Int64"),
    ("end_global_tid", "Int64"), ("range_id", "Int64"), ("event_id", "Int64"),
    ("uint64_value", "UInt64"), ("int64_value", "Int64"), ("double_value", "float64"), ("json_text", "object"),
    *NCCL_COLUMN_KINDS.items(),
    ("payload_source", "object"),
]  # fmt: skip
RUNTIME_COLUMNS: list[tuple[str, str]] = [
    ("start", "int64"), ("end", "int64"), ("event_class", "int64"), ("global_tid", "Int64"),
    ("pid", "Int64"), ("tid", "Int64"), ("correlation_id", "Int64"), ("name", "object"), ("api", "object"),
    ("return_value", "Int64"),
]  # fmt: skip
LAUNCH_COLUMNS: list[tuple[str, str]] = [*RUNTIME_COLUMNS, ("capture_span", "Int64")]
"""Columns of :meth:`NsysExport.launches_without_kernel`: the runtime columns plus
``capture_span``, the 0-based stream capture (``cudaStreamBeginCapture`` .. ``EndCapture`` on the
launching thread, numbered per process in time order) the launch was made in, null outside
captures. A launch during capture makes a graph node, not a kernel: it has no kernel record
by design, and its kernel runs in the graph's replays."""
PROCESS_COLUMNS: list[tuple[str, str]] = [("global_pid", "int64"), ("pid", "int64"), ("name", "object")]
KERNEL_TABLE_COLUMNS: list[tuple[str, str]] = [*KERNEL_COLUMNS, *KERNEL_ARG_COLUMNS]
"""Columns of every written ``kernels.parquet``, whatever the source: an nsys export records no
call arguments, so its kernels have them null (one schema per table, whoever writes it)."""
KERNEL_SOURCE_TABLES: dict[str, list[tuple[str, str]]] = {
    "kernels": KERNEL_TABLE_COLUMNS, "nvtx": NVTX_COLUMNS, "processes": PROCESS_COLUMNS,
    "launches_without_kernel": LAUNCH_COLUMNS,
}  # fmt: skip
"""The column specs of the tables a kernel source's parse writes beside ``nccl_api_calls``
(nsys exports, profiler traces, their per-node merge): the one home of their schemas."""
COMM_RECORD_COLUMNS: list[tuple[str, str]] = [
    ("start", "int64"), ("end", "Int64"), ("pid", "Int64"), ("tid", "Int64"), ("external_id", "Int64"),
    ("coll_name", "object"), ("coll_in_nelems", "Int64"), ("coll_out_nelems", "Int64"), ("coll_dtype", "object"),
    ("coll_group_size", "Int64"), ("pg_name", "object"), ("pg_desc", "object"), ("pg_ranks", "object"),
    ("coll_rank", "Int64"), ("dst_rank", "Int64"), ("src_rank", "Int64"),
]  # fmt: skip
"""Columns of ``comm_records.parquet``: a profiler trace's ``record_param_comms`` CPU ops, the
record ProcessGroupNCCL makes of each call on the calling thread (one per collective, send, recv
and ``wait``), in start order. Meanings and units: :data:`COMM_RECORD_DOCS`."""
COMM_RECORD_DOCS: dict[str, tuple[str, str]] = {
    "start": ("ns", "the record's start, on the trace's stored clock (the kernels' clock: + utc_offset_ns = UTC)"),
    "end": ("ns", "the record's end, same clock"),
    "pid": ("", "OS pid of the calling process"),
    "tid": ("", "OS thread id of the calling thread (the thread that launches the call's kernel)"),
    "external_id": ("", ("the profiler's External id of the record: a kernel with the same external_id is its "
                         "kernel (none for the kernel of a batched Send/Recv)")),
    "coll_name": ("", "PyTorch's collective ('Collective name': _allgather_base, send, recv, wait, ...)"),
    "coll_in_nelems": ("elements", "input tensor elements ('In msg nelems')"),
    "coll_out_nelems": ("elements", "output tensor elements ('Out msg nelems')"),
    "coll_dtype": ("", "torch dtype as recorded ('dtype': BFloat16, Float, ...)"),
    "coll_group_size": ("ranks", "members of the process group ('Group size')"),
    "pg_name": ("", "process group name ('Process Group Name')"),
    "pg_desc": ("", "process group description ('Process Group Description', e.g. Megatron's group name)"),
    "pg_ranks": ("", "the group's global ranks as text \"[0, 1]\" ('Process Group Ranks')"),
    "coll_rank": ("", ("'Rank': for send/recv the peer's rank in the group, for broadcast/reduce the root's, "
                       "otherwise the caller's own rank in the group")),
    "dst_rank": ("", "send: the peer's global rank ('Dst Rank'; null elsewhere or in older PyTorch)"),
    "src_rank": ("", "recv: the peer's global rank ('Src Rank'; null elsewhere or in older PyTorch)"),
}  # fmt: skip
"""Unit and meaning of each :data:`COMM_RECORD_COLUMNS` column (rendered by ``tables-doc``)."""
PROFILER_TABLES: dict[str, list[tuple[str, str]]] = {"comm_records": COMM_RECORD_COLUMNS}
"""The tables only a profiler trace records, written beside :data:`KERNEL_SOURCE_TABLES` by a
trace's parse and by the per-node merge of kernel sources (empty there when no source is a
trace). An nsys export's parse does not write them: a reader takes a missing file as empty."""
THREAD_COLUMNS: list[tuple[str, str]] = [
    ("global_tid", "Int64"), ("pid", "Int64"), ("tid", "Int64"), ("name", "object"), ("priority", "Int64"),
]
PAYLOAD_SCHEMA_ENTRY_COLUMNS: list[tuple[str, str]] = [
    ("domain_id", "Int64"), ("schema_id", "Int64"), ("idx", "Int64"), ("type", "Int64"), ("name", "object"),
    ("offset", "Int64"),
]  # fmt: skip
GPU_COLUMNS: list[tuple[str, str]] = [
    ("device_id", "Int64"), ("name", "object"), ("bus_location", "object"), ("uuid", "object"),
    ("cu_device", "Int64"), ("pid", "Int64"), ("cuda_id", "Int64"),
]  # fmt: skip


def spec_schema(spec: list[tuple[str, str]], docs: dict[str, tuple[str, str]] | None = None):
    """The Arrow schema of a reader column spec ((name, pandas kind) pairs): how its tables are
    written. ``docs`` (column -> (unit, meaning)): the fields carry them, as documented tables do."""
    import pyarrow as pa

    types = {
        "int64": pa.int64(),
        "Int64": pa.int64(),
        "UInt64": pa.uint64(),
        "float64": pa.float64(),
        "object": pa.string(),
    }
    if docs is None:
        return pa.schema([(name, types[kind]) for name, kind in spec])
    return pa.schema([pa.field(name, types[kind], metadata=dict(zip(("unit", "doc"), docs[name], strict=True)))
                      for name, kind in spec])
