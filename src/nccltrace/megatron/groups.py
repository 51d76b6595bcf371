"""Megatron-LM's process groups: rank orderings and the member sets of every group kind.

The one home of Megatron's group generation in nccltrace (:mod:`.layout` and the layout
inference both use it), so that the emulator and the analysis agree with Megatron on which ranks
form a group. Re-expressed from NVIDIA/Megatron-LM ``megatron/core/parallel_state.py``
(core_r0.13 and main): ``RankGenerator``, ``generate_masked_orthogonal_rank_groups``,
``initialize_model_parallel``, ``default_embedding_ranks`` /
``default_position_embedding_ranks``. The grids and order strings: ``docs/emulator.md``, Module
notes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from nccltrace.megatron.sizes import ParallelSizes

__all__ = [
    "DECODER_KINDS",
    "DEFAULT_ORDER",
    "EXPERT_KINDS",
    "GROUP_KINDS",
    "KIND_ORDER",
    "MEGATRON_DESC",
    "PAIR_DIMS",
    "TOKENS",
    "complete_order",
    "grid_strides",
    "megatron_groups",
    "order_problem",
    "orthogonal_groups",
]

# kind -> (PyTorch group_desc Megatron passes, what it is used for)
GROUP_KINDS: dict[str, str] = {
    "world": "default process group (torch.distributed.init_process_group)",
    "dp-cp": "DATA_PARALLEL_GROUP_WITH_CP",
    "dp": "DATA_PARALLEL_GROUP",
    "cp": "CONTEXT_PARALLEL_GROUP",
    "mp": "MODEL_PARALLEL_GROUP (tp-pp)",
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
    "embd": "EMBEDDING_GROUP",
    "pos-embd": "POSITION_EMBEDDING_GROUP",
    "tp-dp-cp": "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
    "tp-dp": "TENSOR_AND_DATA_PARALLEL_GROUP",
    "tp-cp": "TENSOR_AND_CONTEXT_PARALLEL_GROUP",
    "ep": "EXPERT_MODEL_PARALLEL_GROUP",
    "etp": "EXPERT_TENSOR_PARALLEL_GROUP",
    "tp-ep": "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
    "tp-ep-pp": "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
    "edp": "EXPERT_DATA_PARALLEL_GROUP",
    "intra-distopt": "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
}

# kind -> the exact ``group_desc`` string a PyTorch process group of that kind carries (what
# Flight Recorder dumps and ``torch.distributed`` report); the world is PyTorch's ``default_pg``.
MEGATRON_DESC: dict[str, str] = {k: v.split(" (")[0] for k, v in GROUP_KINDS.items()}
MEGATRON_DESC["world"] = "default_pg"

KIND_ORDER: tuple[str, ...] = tuple(GROUP_KINDS)  # Megatron's creation order, world first

# Dimensions a two-rank pair communicator can belong to (the groups un-coalesced P2P runs on:
# PyTorch gives each pair of a group that exchanges isend/irecv its own NCCL communicator).
PAIR_DIMS: tuple[str, ...] = ("pp", "cp", "tp", "dp", "ep", "etp", "edp")

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TOKENS: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")

# kind -> the dimensions it spans, in the decoder grid (tp, cp, ep=1, dp, pp) ...
DECODER_KINDS: dict[str, tuple[str, ...]] = {
    "dp-cp": ("dp", "cp"),
    "dp": ("dp",),
    "cp": ("cp",),
    "mp": ("tp", "pp"),
    "tp": ("tp",),
    "pp": ("pp",),
    "tp-dp-cp": ("tp", "dp", "cp"),
    "tp-dp": ("tp", "dp"),
    "tp-cp": ("tp", "cp"),
}
# ... and in the expert grid (etp, cp=1, ep, edp, pp), whose tokens are named like the decoder's.
EXPERT_KINDS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "etp": ("tp",),
    "tp-ep": ("tp", "ep"),
    "tp-ep-pp": ("tp", "ep", "pp"),
    "edp": ("dp",),
}


def orthogonal_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Groups of ranks that vary only along the masked dimensions.

    ``sizes`` lists the parallel sizes fastest-varying first (global rank is the mixed-radix
    number with these digits). Groups are enumerated by the mixed-radix index of the unmasked
    digits, members by the mixed-radix index of the masked digits.
    """
    strides = [1]
    for s in sizes[:-1]:
        strides.append(strides[-1] * s)
    m_sizes = [s for s, m in zip(sizes, mask) if m]
    m_strides = [d for d, m in zip(strides, mask) if m]
    u_sizes = [s for s, m in zip(sizes, mask) if not m]
    u_strides = [d for d, m in zip(strides, mask) if not m]

    def offsets(dim_sizes: list[int], dim_strides: list[int]) -> np.ndarray:
        off = np.zeros(1, dtype=np.int64)
        for s, d in zip(dim_sizes, dim_strides):  # fastest digit first
            off = (off[:, None] + (np.arange(s, dtype=np.int64) * d)[None, :]).reshape(-1, order="F")
        return off

    member_off = offsets(m_sizes, m_strides)
    group_off = offsets(u_sizes, u_strides)
    return (group_off[:, None] + member_off[None, :]).tolist()


def complete_order(order: str, sizes: Mapping[str, int]) -> list[str]:
    """Megatron's full order: the tokens of ``order``, then every token it leaves out.

    ``RankGenerator`` accepts a missing token only when its size is 1 (ValueError otherwise,
    as Megatron raises); an unknown or repeated token is a ValueError as well.
    """
    tokens = [t for t in order.lower().split("-") if t]
    bad = [t for t in tokens if t not in TOKENS]
    if bad or len(set(tokens)) != len(tokens) or not tokens:
        raise ValueError(f"order {order!r}: expected distinct tokens out of {'-'.join(TOKENS)}, e.g. {DEFAULT_ORDER}")
    for t in TOKENS:
        if t not in tokens:
            if sizes.get(t, 1) != 1:
                raise ValueError(f"order {order!r} leaves out {t}, whose size is {sizes[t]} (Megatron requires 1)")
            tokens.append(t)
    return tokens


def grid_strides(tokens: Sequence[str], grid: Mapping[str, int]) -> dict[str, int]:
    """Token -> stride (rank distance between neighbours along it) in a grid of ``tokens`` order."""
    out, acc = {}, 1
    for t in tokens:
        out[t] = acc
        acc *= grid[t]
    return out


def order_problem(sizes: ParallelSizes, order: str) -> str | None:
    """Why Megatron would refuse ``sizes`` under ``order`` (None when it accepts them).

    Checks what ``initialize_model_parallel`` asserts: each grid's order is complete (left-out
    dimensions have size 1), the order ends with pp or pp = 1 or edp = dp, and both grids have
    the same pipeline groups (same pp stride).
    """
    try:
        dec = complete_order(order, sizes.decoder_grid())
        exp = complete_order(order, sizes.expert_grid())
    except ValueError as exc:
        return str(exc)
    if not (order.lower().endswith("pp") or sizes.pp == 1 or sizes.expert_dp == sizes.dp):
        return f"order {order!r} does not end with pp, so edp ({sizes.expert_dp}) must equal dp ({sizes.dp})"
    if grid_strides(dec, sizes.decoder_grid())["pp"] != grid_strides(exp, sizes.expert_grid())["pp"]:
        return f"order {order!r}: decoder and expert grids would have different pipeline groups"
    return None


def megatron_groups(sizes: ParallelSizes, order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """Member sets (sorted global ranks) of every group kind Megatron creates for ``sizes``.

    Keys are the kinds of :data:`GROUP_KINDS`; one distributed-optimizer instance is assumed
    (its group is the world). ValueError when Megatron would refuse the sizes under ``order``.
    """
    problem = order_problem(sizes, order)
    if problem:
        raise ValueError(problem)
    world = int(sizes.world_size)
    out: dict[str, list[list[int]]] = {"world": [list(range(world))]}
    for grid, kinds in ((sizes.decoder_grid(), DECODER_KINDS), (sizes.expert_grid(), EXPERT_KINDS)):
        tokens = complete_order(order, grid)
        dims = [grid[t] for t in tokens]
        for kind, span in kinds.items():
            groups = orthogonal_groups(dims, [t in span for t in tokens])
            out[kind] = [sorted(g) for g in groups]
    pp_groups = out["pp"]
    out["embd"] = [[g[0]] if len(g) == 1 else [g[0], g[-1]] for g in pp_groups]
    out["pos-embd"] = [[g[0]] for g in pp_groups]
    out["intra-distopt"] = [list(range(world))]
    return {k: out[k] for k in KIND_ORDER}
