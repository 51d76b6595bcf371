"""Megatron-LM's GPT model arithmetic: the defaults assumed for model settings a run does not
state, which layers a pipeline chunk holds, and how many parameters each rank's gradient
buffers contain.

The parameter counts follow Megatron-core's GPT with the Transformer-Engine layer spec exactly,
since gradient buffer sizes are what the data-parallel collectives carry. The layout counted:
``docs/emulator.md``, Module notes; the volume model built on it: ``docs/volume.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Protocol

from nccltrace.core.errors import ConfigError
from nccltrace.megatron.constraints import (
    SHARD_RULES,
    LaunchShape,
    first_problem,
    positive_problem,
)

__all__ = [
    "MODEL_DEFAULTS",
    "ChunkParams",
    "LayerPlan",
    "ModelShape",
    "chunk_layers",
    "chunk_params",
    "is_moe_layer",
    "padded_vocab_size",
    "stage_layers",
]

# Settings (snake_case, the emulator's names) -> value assumed when a run does not state it. The
# one table: the emulator's config fields take their defaults from it and the volume model fills
# unstated settings from it. Megatron-LM's own default where it has one (sizes 1, etp = tp, tied
# embeddings, learned absolute positions, top-2 routing, every layer MoE); the thesis's dense
# model (section 5.2: 16 layers, hidden 512, 8 heads, seq 1024, batch 64/4, 10 iterations, fp16,
# alltoall dispatcher) where Megatron has none or the thesis ran another value.
MODEL_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    # model
    "num_layers": 16,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "ffn_hidden_size": None,  # 4 * hidden_size
    "vocab_size": 50257,  # GPT-2 tokenizer; padded Megatron-style (padded_vocab_size)
    "seq_length": 1024,
    "position_embedding_type": "learned_absolute",  # or "rope"
    "untie_embeddings": False,
    # batch / run length
    "micro_batch_size": 4,
    "global_batch_size": 64,
    "iterations": 10,
    # parallelism
    "tp": 1,
    "pp": 1,
    "cp": 1,
    "ep": 1,
    "etp": None,  # expert tensor parallel size: tp
    "vpp": 1,  # virtual pipeline stages per pp rank (1 = no interleaving)
    "sequence_parallel": False,
    "distributed_optimizer": False,
    "recompute": "none",  # none | selective | full
    "overlap_p2p_comm": None,  # Megatron: on with the interleaved schedule
    # MoE
    "num_experts": 0,  # 0 = dense
    "moe_router_topk": 2,
    "moe_layer_freq": 1,
    "moe_token_dispatcher": "alltoall",  # alltoall | allgather
    "moe_alltoall": "p2p",  # p2p (all_to_all_single as grouped Send/Recv) | native (ncclAlltoAll)
    # numerics
    "precision": "fp16",  # fp16 | bf16 | fp32
})  # fmt: skip


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by`` (128) x tp."""
    m = divisible_by * tp
    return int(math.ceil(vocab_size / m) * m)


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions and sizes the per-rank parameter layout depends on.

    ``ffn_hidden_size`` is resolved (4 x hidden when the run does not set it) and
    ``padded_vocab_size`` padded (:func:`padded_vocab_size`). Shapes Megatron refuses, or whose
    shards would not be whole, raise :class:`~nccltrace.core.errors.ConfigError` naming the field.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    padded_vocab_size: int
    seq_length: int
    position_embedding_type: str = "learned_absolute"
    untie_embeddings: bool = False
    num_experts: int = 0
    moe_layer_freq: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "padded_vocab_size", "seq_length",
                     "moe_layer_freq", "tp", "pp", "vpp", "ep", "etp"):  # fmt: skip
            why = positive_problem(getattr(self, name))
            if why:
                raise ConfigError(name, why)
        if self.num_experts < 0:
            raise ConfigError("num_experts", "must be >= 0 (0 = dense model)")
        # the shards of every matrix must be whole (the parameter layout); the other launch rules
        # are the run's, checked where it is described
        shape = LaunchShape(tp=self.tp, pp=self.pp, vpp=self.vpp, ep=self.ep, etp=self.etp, num_layers=self.num_layers,
                            hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
                            padded_vocab_size=self.padded_vocab_size, num_experts=self.num_experts)  # fmt: skip
        problem = first_problem(shape, SHARD_RULES)
        if problem is not None:
            raise ConfigError(problem.field, problem.message)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def layers_per_chunk(self) -> int:
        return self.num_layers // (self.pp * self.vpp)


class LayerPlan(Protocol):
    """What the layer assignment needs (a :class:`ModelShape`; the emulator's config has it too)."""

    @property
    def pp(self) -> int: ...

    @property
    def vpp(self) -> int: ...

    @property
    def layers_per_chunk(self) -> int: ...

    @property
    def is_moe(self) -> bool: ...

    @property
    def moe_layer_freq(self) -> int: ...


def chunk_layers(shape: LayerPlan, stage: int, chunk: int) -> range:
    """Global (0-based) layer indices held by pipeline ``stage``, virtual chunk ``chunk``.

    Interleaved assignment (``--num-layers-per-virtual-pipeline-stage``): chunk v of stage p
    holds layers ``[(v*pp + p)*L_c, (v*pp + p + 1)*L_c)`` with ``L_c = layers / (pp*vpp)``.
    """
    lc = shape.layers_per_chunk
    first = (chunk * shape.pp + stage) * lc
    return range(first, first + lc)


def stage_layers(shape: LayerPlan, stage: int) -> list[int]:
    """Global layer indices held by pipeline ``stage``: those of its virtual chunks, in chunk order."""
    return [layer for chunk in range(shape.vpp) for layer in chunk_layers(shape, stage, chunk)]


def is_moe_layer(shape: LayerPlan, layer: int) -> bool:
    """``--moe-layer-freq N``: layer i is an MoE layer iff i % N == 0 (Megatron's pattern)."""
    return shape.is_moe and layer % shape.moe_layer_freq == 0


@dataclass(frozen=True)
class ChunkParams:
    """Per-rank parameter counts of one model chunk (elements)."""

    dense: int  # in the dense grad buffer (reduced over the dp-cp group)
    expert: int  # in the expert grad buffer (reduced over the expert-dp group)
    sequence_parallel: int  # params all-reduced over TP after backward when SP is on
    word_embedding: int  # size of the (tied) word-embedding weight on this rank, 0 if none here


@lru_cache(maxsize=4096)
def chunk_params(shape: ModelShape, stage: int, chunk: int) -> ChunkParams:
    """Parameter counts of a rank in ``stage`` for virtual chunk ``chunk``."""
    h, tp, ffn = shape.hidden_size, shape.tp, shape.ffn_hidden_size
    etp, ep = shape.etp, shape.ep
    bias = not shape.is_moe
    dense = expert = sp = 0
    for layer in chunk_layers(shape, stage, chunk):
        ln = 2 * h
        qkv = 3 * h * h // tp + (3 * h // tp if bias else 0)
        proj = h * h // tp + (h if bias else 0)
        dense += ln + qkv + proj
        sp += ln + (h if bias else 0)
        if is_moe_layer(shape, layer):
            dense += 2 * h + shape.num_experts * h  # pre-MLP layernorm + router
            sp += 2 * h + shape.num_experts * h
            expert += (shape.num_experts // ep) * (2 * h * ffn // etp)
        else:
            dense += ln + h * ffn // tp + (ffn // tp if bias else 0) + ffn * h // tp + (h if bias else 0)
            sp += ln + (h if bias else 0)
    word = 0
    vocab_shard = shape.padded_vocab_size // tp * h
    first = stage == 0 and chunk == 0
    last = stage == shape.pp - 1 and chunk == shape.vpp - 1
    if first:
        dense += vocab_shard
        word = vocab_shard
        if shape.position_embedding_type == "learned_absolute":
            dense += shape.seq_length * h
    if last:
        dense += 2 * h  # final layernorm
        sp += 2 * h
        if shape.untie_embeddings or not first:
            dense += vocab_shard  # output layer (a tied copy when pp > 1)
            if not shape.untie_embeddings:
                word = vocab_shard
    return ChunkParams(dense, expert, sp, word)
