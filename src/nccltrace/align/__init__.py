"""Correlation of logged NCCL calls with their CUDA kernels, per process.

Modes: ``thesis`` (the thesis's Needleman-Wunsch over operation names, section 4.2.2),
``default`` (compiled, windowed alignment using every signal the thesis ignores) and
``exact`` (NCCL NVTX payload ranges containing the kernel launch).
"""
