"""NCCL enumerations as printed in debug logs (``src/nccl.h.in``), with version ranges.

The numeric values are stable across releases; what changes is which values exist
(bf16 from 2.10 in CUDA>=11 builds, fp8 from 2.24.3) and how TUNING lines spell
algorithms/protocols (numeric up to 2.23, names from 2.24).
"""

from __future__ import annotations

# ncclDataType_t: value -> (name, size in bytes, first NCCL version (major, minor, patch))
DATATYPES: dict[int, tuple[str, int, tuple[int, int, int]]] = {
    0: ("int8", 1, (2, 0, 0)),
    1: ("uint8", 1, (2, 0, 0)),
    2: ("int32", 4, (2, 0, 0)),
    3: ("uint32", 4, (2, 0, 0)),
    4: ("int64", 8, (2, 0, 0)),
    5: ("uint64", 8, (2, 0, 0)),
    6: ("float16", 2, (2, 0, 0)),
    7: ("float32", 4, (2, 0, 0)),
    8: ("float64", 8, (2, 0, 0)),
    9: ("bfloat16", 2, (2, 10, 0)),
    10: ("float8e4m3", 1, (2, 24, 3)),
    11: ("float8e5m2", 1, (2, 24, 3)),
}
DATATYPE_BY_NAME: dict[str, int] = {name: value for value, (name, _, _) in DATATYPES.items()}

# ncclRedOp_t; values >= 5 are user-created PreMulSum ops (ncclRedOpCreatePreMulSum, >= 2.11).
REDOPS: dict[int, str] = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}

# TUNING lines 2.20-2.23 print numeric codes; >= 2.24 print these names.
ALGORITHMS: list[str] = ["TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT"]
PROTOCOLS: list[str] = ["LL", "LL128", "SIMPLE"]

COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce")
P2P_OPS = ("Send", "Recv")
# Native AlltoAll/Gather/Scatter exist from 2.28; PutSignal/Signal/WaitSignal from 2.29.
NEW_OPS_228 = ("AlltoAll", "Gather", "Scatter")
NEW_OPS_229 = ("PutSignal", "Signal", "WaitSignal")
ALL_OPS = COLLECTIVES + P2P_OPS + NEW_OPS_228 + NEW_OPS_229


def datatype_name(value: int) -> str:
    """Name of an ``ncclDataType_t`` value, or ``unknown(<v>)``."""
    entry = DATATYPES.get(value)
    return entry[0] if entry else f"unknown({value})"


def datatype_size(value: int) -> int:
    """Size in bytes of an ``ncclDataType_t`` value; 0 when unknown."""
    entry = DATATYPES.get(value)
    return entry[1] if entry else 0


def redop_name(value: int) -> str:
    """Name of an ``ncclRedOp_t`` value (``premulsum(<v>)`` for user-created ops)."""
    if value in REDOPS:
        return REDOPS[value]
    return f"premulsum({value})" if value >= 5 else f"unknown({value})"


def payload_bytes(op: str, count: int, dtype_size: int, nranks: int) -> int:
    """Bytes this rank contributes or receives per the call, as logged (per-rank payload).

    AllGather logs the per-rank send count and ReduceScatter the per-rank receive count,
    so this is ``count * dtype_size`` for every op. See :func:`bus_message_bytes` for the
    nccl-tests "message size" S used for algorithm bandwidth.
    """
    return count * dtype_size


def bus_message_bytes(op: str, count: int, dtype_size: int, nranks: int) -> int:
    """Message size S in the nccl-tests convention (full buffer for AllGather/ReduceScatter)."""
    size = count * dtype_size
    if op in ("AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter"):
        return size * nranks
    return size
