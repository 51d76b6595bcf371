"""nccltrace: per-operation NCCL communication analysis for distributed LLM training.

Stages live in one module each: ``nccl.log_reader`` / ``nsys.reader`` (raw data),
``nccl.log_writer`` / ``nsys.writer`` (real-format writers), ``emulator`` (Megatron-LM
workload emulator). Tables passed between stages are documented in ``nccltrace.core.tables``.
"""

__version__ = "0.1.0"
