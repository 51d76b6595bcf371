"""What a kernel source may record about each NCCL kernel's call, and how it relates to the log.

A PyTorch-profiler trace records, per NCCL kernel launched through ProcessGroupNCCL, PyTorch's
collective, its input/output element counts, dtype and process group (``KERNEL_ARG_COLUMNS`` of
the ``kernels`` table; null where a source records none, e.g. batched Send/Recv, or an nsys
export). The alignment compares them with the logged calls (``kernel_count_fits``) without
knowing which profiler wrote them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KERNEL_ARG_COLUMNS", "kernel_count_fits"]

KERNEL_ARG_COLUMNS: list[tuple[str, str]] = [
    ("coll_name", "object"), ("coll_in_nelems", "Int64"), ("coll_out_nelems", "Int64"),
    ("coll_dtype", "object"), ("coll_group_size", "Int64"), ("pg_name", "object"), ("pg_desc", "object"),
    ("pg_ranks", "object"), ("external_id", "Int64"),
]  # fmt: skip
"""Per-kernel communication arguments a PyTorch-profiler trace records for NCCL kernels launched
through ProcessGroupNCCL (null where the trace has none, e.g. batched Send/Recv, or for nsys):
PyTorch's collective name, input/output element counts, dtype, group size, the process group
(name, description, member ranks as text "[0, 1]"), and the profiler's ``External id``, the id
of the CPU op that launched the kernel (its ``record_param_comms`` record carries the same one:
the ``comm_records`` table's ``external_id``)."""


def kernel_count_fits(op: np.ndarray, count: np.ndarray, nranks: np.ndarray, in_nelems: np.ndarray,
                      out_nelems: np.ndarray) -> np.ndarray:  # fmt: skip
    """Whether a logged call (NCCL op, element count, communicator size) can be the kernel whose
    profiler arguments say ``in_nelems``/``out_nelems`` (-1 where unknown: fits). NCCL logs
    AllGather's send count, ReduceScatter's receive count, AlltoAll's count per peer; PyTorch
    records the whole input and output tensors."""
    op = np.asarray(op, object)
    known = (in_nelems >= 0) | (out_nelems >= 0)
    fits = np.ones(len(op), bool)
    ag = op == "AllGather"
    rs = op == "ReduceScatter"
    a2a = op == "AlltoAll"
    plain = np.isin(op, ["AllReduce", "Broadcast", "Reduce"])
    fits[ag] = in_nelems[ag] == count[ag]
    fits[rs] = out_nelems[rs] == count[rs]
    fits[a2a] = in_nelems[a2a] == count[a2a] * nranks[a2a]
    fits[plain] = in_nelems[plain] == count[plain]
    return np.where(known, fits, True)
