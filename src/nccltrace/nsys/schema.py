"""The column specs of the tables read from nsys exports and written by every kernel source (nsys
exports, profiler traces, their per-node merge), and their Arrow schemas: the one home the reader,
the NCCL API linking and the other kernel sources import, light (no SQLite, no reader).
"""

from __future__ import annotations

from nccltrace.core.kernel_args import KERNEL_ARG_COLUMNS

__all__ = [
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


def spec_schema(spec: list[tuple[str, str]]):
    """The Arrow schema of a reader column spec ((name, pandas kind) pairs): how its tables are written."""
    import pyarrow as pa

    types = {
        "int64": pa.int64(),
        "Int64": pa.int64(),
        "UInt64": pa.uint64(),
        "float64": pa.float64(),
        "object": pa.string(),
    }
    return pa.schema([(name, types[kind]) for name, kind in spec])
