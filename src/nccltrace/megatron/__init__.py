"""Knowledge of Megatron-LM: the parallel sizes (:mod:`.sizes`), the process groups they give
(:mod:`.groups`, :mod:`.layout`), inferring the sizes from observed communicator member sets
(:mod:`.infer`), and the model's defaults and parameter counts (:mod:`.model`).

Kept free of the emulator: the analysis may use it. Attributes are imported lazily so that
``nccltrace --help`` does not pay for numpy.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LayoutInference", "MegatronLayout", "ParallelSizes", "infer_layout", "megatron_groups",
           "orthogonal_groups"]  # fmt: skip


def __getattr__(name: str) -> Any:
    # Explicit imports (not importlib): provenance.import_closure follows them statically.
    if name in ("LayoutInference", "infer_layout"):
        from nccltrace.megatron import infer

        return getattr(infer, name)
    if name in ("megatron_groups", "orthogonal_groups"):
        from nccltrace.megatron import groups

        return getattr(groups, name)
    if name == "MegatronLayout":
        from nccltrace.megatron import layout

        return layout.MegatronLayout
    if name == "ParallelSizes":
        from nccltrace.megatron import sizes

        return sizes.ParallelSizes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
