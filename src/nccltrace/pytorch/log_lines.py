"""PyTorch's own log lines that the analysis reads as evidence (kept free of numpy and pandas:
log discovery uses it on every line of a combined stdout).

With ``TORCH_CPP_LOG_LEVEL=INFO`` PyTorch's ``ProcessGroupNCCL`` logs, in each process, which NCCL
communicator each process group created (:data:`PG_COMM_LINE`); its pointer is the one NCCL prints
in the same process's init line, so the line joins the group's name to the communicator exactly
(:func:`nccltrace.communicators.names.name_by_pytorch_lines`).
"""

from __future__ import annotations

import re

__all__ = ["PG_COMM_LINE", "is_pg_comm_line"]

PG_COMM_LINE = re.compile(r"\[PG (?:ID )?(?P<id>\d+)(?: PG GUID (?P<guid>[^\s(\]]+))?\s*(?:\((?P<desc>[^)]*)\))?"
                          r"\s+Rank \d+\] ProcessGroupNCCL created ncclComm_ (?P<comm>0x[0-9a-fA-F]+)")
"""PyTorch's line (``TORCH_CPP_LOG_LEVEL=INFO``) tying a process group to the NCCL communicator it
created: ``[PG 0 (default_pg) Rank 5] ProcessGroupNCCL created ncclComm_ 0x555b8d27b370 on CUDA
device: 0`` (newer: ``[PG ID 1 PG GUID 1(TENSOR_MODEL_PARALLEL_GROUP) Rank 0] ...``). The pointer
is the one NCCL prints as ``comm 0x...`` in the same process's init line."""
_PG_COMM_BYTES = re.compile(PG_COMM_LINE.pattern.encode())


def is_pg_comm_line(text: bytes) -> bool:
    """Whether a raw line is PyTorch's process-group-to-communicator line (:data:`PG_COMM_LINE`)."""
    return _PG_COMM_BYTES.search(text) is not None
