"""Megatron-LM workload emulator: the raw outputs a real training run would leave.

Given an :class:`EmulatorConfig` (model, parallelism, precision, NCCL / Nsight Systems versions,
cluster shape, imperfections), :func:`emulate_run` writes per-process NCCL debug logs, per-node
nsys SQLite exports and ground-truth tables. See ``docs/emulator.md``.
"""

from nccltrace.emulator.config import (
    ConfigError,
    CudaGraphs,
    DuplicateLines,
    EmulatorConfig,
    Imperfections,
    KernelNaming,
)
from nccltrace.emulator.layout import Group, MegatronLayout, PairComm, layout_of
from nccltrace.emulator.run import EmulationResult, emulate_run
from nccltrace.emulator.schedule import Op, RankProgram, Unit, count_kernels

__all__ = [
    "ConfigError",
    "CudaGraphs",
    "DuplicateLines",
    "EmulatorConfig",
    "Imperfections",
    "KernelNaming",
    "Group",
    "MegatronLayout",
    "PairComm",
    "layout_of",
    "EmulationResult",
    "emulate_run",
    "Op",
    "RankProgram",
    "Unit",
    "count_kernels",
]
