"""PyTorch-profiler (Kineto) Chrome traces: a second kernel source beside nsys exports."""

from nccltrace.core.kernel_args import KERNEL_ARG_COLUMNS, kernel_count_fits
from nccltrace.kineto.reader import (
    KINETO_DOMAIN,
    KinetoFormatError,
    KinetoTrace,
    is_kineto_trace,
    iter_kineto_files,
)

__all__ = [
    "KERNEL_ARG_COLUMNS",
    "KINETO_DOMAIN",
    "KinetoFormatError",
    "KinetoTrace",
    "is_kineto_trace",
    "iter_kineto_files",
    "kernel_count_fits",
]
