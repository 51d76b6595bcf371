"""Megatron-LM's process-group layout: generating it (:mod:`.groups`) and inferring the
parallel sizes from observed communicator member sets (:mod:`.infer`).

Kept free of the emulator: the analysis may use it. Attributes are imported lazily so that
``nccltrace --help`` does not pay for numpy.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LayoutInference", "MegatronSizes", "infer_layout", "megatron_groups", "orthogonal_groups"]


def __getattr__(name: str) -> Any:
    if name in ("LayoutInference", "infer_layout"):
        from . import infer

        return getattr(infer, name)
    if name in ("MegatronSizes", "megatron_groups", "orthogonal_groups"):
        from . import groups

        return getattr(groups, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
