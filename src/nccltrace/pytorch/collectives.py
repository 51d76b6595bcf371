"""PyTorch's collectives in NCCL's terms: one home for how a PyTorch record (a profiler kernel's
or CPU op's ``Collective name``, a Flight Recorder ``profiling_name``) names the NCCL call it
made, how its tensor sizes give the element count NCCL's debug log prints, and how its dtype
names NCCL's datatype. Every source without an NCCL log uses these, so a call has the same
op, count and datatype whichever source described it.
"""

from __future__ import annotations

import re

__all__ = [
    "RECORD_COLUMNS",
    "log_count",
    "nccl_datatype",
    "nccl_op",
    "torch_collective",
]

# PyTorch collective (normalised: lower case, no leading '_', no '_base'/'_coalesced'/'_into_tensor'
# suffix) -> the NCCL function ProcessGroupNCCL calls for it. barrier runs an AllReduce of one
# element; all_to_all runs grouped Send/Recv before NCCL 2.28 and ncclAlltoAll from it: the log
# and the kernel name say which, the record cannot (named AlltoAll, as 2.28's log does).
_TO_NCCL = {
    "allgather": "AllGather", "all_gather": "AllGather", "all_gather_into_tensor": "AllGather",
    "reduce_scatter": "ReduceScatter", "reduce_scatter_tensor": "ReduceScatter",
    "allreduce": "AllReduce", "all_reduce": "AllReduce", "barrier": "AllReduce",
    "broadcast": "Broadcast", "reduce": "Reduce",
    "all_to_all": "AlltoAll", "all_to_allv": "AlltoAll", "alltoall": "AlltoAll", "alltoall_base": "AlltoAll",
    "all_to_all_single": "AlltoAll",
    "send": "Send", "isend": "Send", "recv": "Recv", "irecv": "Recv", "recv_any_source": "Recv",
    "gather": "Gather", "scatter": "Scatter",
}  # fmt: skip
_NAME = re.compile(r"^(?:nccl:)?_*(?P<op>[A-Za-z_]+?)(?:_base|_coalesced|_into_tensor)*(?:\s.*)?$")

# torch dtype as the profiler (``BFloat16``) or Flight Recorder (``BFloat16``, ``torch.bfloat16``)
# spells it -> NCCL datatype name (nccl.enums)
_DTYPES = {
    "bfloat16": "bfloat16", "float": "float32", "float32": "float32", "half": "float16", "float16": "float16",
    "double": "float64", "float64": "float64", "char": "int8", "int8": "int8", "byte": "uint8", "uint8": "uint8",
    "int": "int32", "int32": "int32", "long": "int64", "int64": "int64", "bool": "uint8",
    "float8_e4m3fn": "float8e4m3", "float8_e5m2": "float8e5m2",
}  # fmt: skip

RECORD_COLUMNS: dict[str, str] = {
    "file": "object", "record": "int64", "rank": "Int64", "host": "object", "pid": "Int64", "tid": "Int64",
    "torch_op": "object", "op": "object", "op_source": "object", "count": "Int64", "datatype_name": "object",
    "bytes": "Int64", "size_source": "object", "nranks": "Int64", "root": "Int64", "pg_name": "object",
    "pg_desc": "object", "pg_ranks": "object", "comm_id": "UInt64", "comm_source": "object", "pg_seq": "Int64",
    "seq_source": "object",
    "kernel_correlation_id": "Int64", "record_utc": "Int64", "enqueue_utc": "Int64", "started_utc": "Int64",
    "ended_utc": "Int64",
}  # fmt: skip
"""The columns every call source's records share (a profiler trace's, a Flight Recorder
dump's, an nsys export's): one row per call as that source saw it, in the order of the
process's calls (``record``: 0-based position in ``file``). ``op``/``count``/``datatype_name``
/``root``/``nranks`` follow the NCCL log's conventions (``nccl_op``, ``log_count``); ``*_source``
say which record gave each fact (null with the fact); ``bytes`` the message size where a source
records bytes but no count and datatype (nsys's NVTX payload: NCCL's count x datatype size as the
call passed it; null elsewhere, count and datatype give it); ``pg_ranks`` is the group's global
ranks as text "[0, 1]"; ``comm_id`` NCCL's communicator id (commHash, as the log's init lines
print it) where a source records it (nsys's NVTX payload), else null; ``pg_seq`` PyTorch's
per-group sequence number; ``record_utc`` the
CPU record's start, ``enqueue_utc`` Flight Recorder's enqueue time (UTC ns, CPU clocks),
``started_utc``/``ended_utc`` the GPU start/end Flight Recorder times with
``TORCH_NCCL_ENABLE_TIMING=1`` (null without). ``kernel_correlation_id`` ties the call to its
kernel in the same source (profiler: the kernel's correlation id; null when none)."""


def torch_collective(name: str | None) -> str | None:
    """PyTorch's collective of a record name, normalised (``nccl:_all_gather_base`` ->
    ``all_gather``, ``_allgather_base`` -> ``allgather``, ``nccl:send 0->2`` -> ``send``);
    None for no name."""
    if not name:
        return None
    m = _NAME.match(name.strip())
    return (m.group("op") if m else name.strip()).lower()


def nccl_op(name: str | None) -> str | None:
    """The NCCL function a PyTorch collective record made (``_allgather_base`` -> AllGather,
    ``nccl:recv 2<-0`` -> Recv), None when the name is not one ProcessGroupNCCL issues (e.g.
    ``nccl:coalesced``, a batch marker, or ``wait``)."""
    return _TO_NCCL.get(torch_collective(name) or "")


def log_count(op: str | None, in_nelems: int | None, out_nelems: int | None, group_size: int | None) -> int | None:
    """The element count NCCL's log prints for a call PyTorch recorded with these tensor sizes:
    AllGather its per-rank input, ReduceScatter its per-rank output, AlltoAll the count per peer
    (input / group size), the others the input (Recv: the output when no input is recorded).
    None where the needed size is unknown (never guessed)."""
    if op == "AllGather":
        return in_nelems
    if op == "ReduceScatter":
        return out_nelems
    if op == "AlltoAll":
        if in_nelems is None or not group_size or in_nelems % group_size:
            return None
        return in_nelems // group_size
    if op == "Recv" and not in_nelems:
        return out_nelems
    return in_nelems


def nccl_datatype(dtype: str | None) -> str | None:
    """The NCCL datatype name (as ``nccl.enums.DATATYPES`` spells it: ``bfloat16``, ``float32``)
    of a torch dtype as recorded (``BFloat16``, ``torch.float32``); None when unknown."""
    if not dtype:
        return None
    return _DTYPES.get(dtype.strip().lower().removeprefix("torch.").replace(" ", ""))
