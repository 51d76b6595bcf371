"""Model arithmetic for the emulated GPT: which layers a pipeline chunk holds, how many
parameters each rank's gradient buffers contain, and FLOPs per layer.

Parameter layout follows Megatron-core's GPT with the Transformer-Engine layer spec
(``megatron/core/models/gpt/gpt_layer_specs.py``): per layer a fused layernorm+QKV column-parallel
linear, a row-parallel projection, a fused layernorm+fc1 and a row-parallel fc2 (LayerNorm has
weight and bias; row-parallel biases are replicated over TP). MoE layers replace the MLP by a
separate pre-MLP layernorm, a router (``num_experts x hidden``) and ``num_experts/ep`` local
experts whose fc1/fc2 are split over the expert-TP group; MoE runs use no linear biases
(``--disable-bias-linear``, thesis A.3). Word embeddings are split over TP; learned absolute
position embeddings live on the first stage; with tied embeddings and pp > 1 the last stage
holds a copy of the word embeddings as its output layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .config import EmulatorConfig

__all__ = ["chunk_layers", "is_moe_layer", "ChunkParams", "chunk_params", "layer_flops", "Flops"]


def chunk_layers(cfg: EmulatorConfig, stage: int, chunk: int) -> range:
    """Global (0-based) layer indices held by pipeline ``stage``, virtual chunk ``chunk``.

    Interleaved assignment (``--num-layers-per-virtual-pipeline-stage``): chunk v of stage p
    holds layers ``[(v*pp + p)*L_c, (v*pp + p + 1)*L_c)`` with ``L_c = layers / (pp*vpp)``.
    """
    lc = cfg.layers_per_chunk
    first = (chunk * cfg.pp + stage) * lc
    return range(first, first + lc)


def is_moe_layer(cfg: EmulatorConfig, layer: int) -> bool:
    """``--moe-layer-freq N``: layer i is an MoE layer iff i % N == 0 (Megatron's pattern)."""
    return cfg.is_moe and layer % cfg.moe_layer_freq == 0


@dataclass(frozen=True)
class ChunkParams:
    """Per-rank parameter counts of one model chunk (elements)."""

    dense: int  # in the dense grad buffer (reduced over the dp-cp group)
    expert: int  # in the expert grad buffer (reduced over the expert-dp group)
    sequence_parallel: int  # params all-reduced over TP after backward when SP is on
    word_embedding: int  # size of the (tied) word-embedding weight on this rank, 0 if none here


@lru_cache(maxsize=4096)
def _chunk_params(cfg_key: tuple, stage: int, chunk: int) -> ChunkParams:
    cfg = _CFG_CACHE[cfg_key]
    h, tp, ffn = cfg.hidden_size, cfg.tp, cfg.ffn
    etp, ep = cfg.expert_tp, cfg.ep
    bias = not cfg.is_moe
    dense = expert = sp = 0
    for layer in chunk_layers(cfg, stage, chunk):
        ln = 2 * h
        qkv = 3 * h * h // tp + (3 * h // tp if bias else 0)
        proj = h * h // tp + (h if bias else 0)
        dense += ln + qkv + proj
        sp += ln + (h if bias else 0)
        if is_moe_layer(cfg, layer):
            dense += 2 * h + cfg.num_experts * h  # pre-MLP layernorm + router
            sp += 2 * h + cfg.num_experts * h
            expert += (cfg.num_experts // ep) * (2 * h * ffn // etp)
        else:
            dense += ln + h * ffn // tp + (ffn // tp if bias else 0) + ffn * h // tp + (h if bias else 0)
            sp += ln + (h if bias else 0)
    word = 0
    vocab_shard = cfg.padded_vocab_size // tp * h
    first = stage == 0 and chunk == 0
    last = stage == cfg.pp - 1 and chunk == cfg.vpp - 1
    if first:
        dense += vocab_shard
        word = vocab_shard
        if cfg.position_embedding_type == "learned_absolute":
            dense += cfg.seq_length * h
    if last:
        dense += 2 * h  # final layernorm
        sp += 2 * h
        if cfg.untie_embeddings or not first:
            dense += vocab_shard  # output layer (a tied copy when pp > 1)
            if not cfg.untie_embeddings:
                word = vocab_shard
    return ChunkParams(dense, expert, sp, word)


_CFG_CACHE: dict[tuple, EmulatorConfig] = {}


def _key(cfg: EmulatorConfig) -> tuple:
    k = (
        cfg.num_layers, cfg.hidden_size, cfg.ffn, cfg.tp, cfg.pp, cfg.vpp, cfg.expert_tp, cfg.ep,
        cfg.num_experts, cfg.moe_layer_freq, cfg.padded_vocab_size, cfg.seq_length,
        cfg.position_embedding_type, cfg.untie_embeddings,
    )  # fmt: skip
    _CFG_CACHE.setdefault(k, cfg)
    return k


def chunk_params(cfg: EmulatorConfig, stage: int, chunk: int) -> ChunkParams:
    """Parameter counts of a rank in ``stage`` for virtual chunk ``chunk``."""
    return _chunk_params(_key(cfg), stage, chunk)


@dataclass(frozen=True)
class Flops:
    """Forward FLOPs per rank for one microbatch."""

    attention: float  # QKV, core attention, projection of one layer
    mlp: float  # dense MLP of one layer
    moe_mlp: float  # expert MLP work of one MoE layer on one rank
    logits: float  # output layer (+ cross entropy, negligible)


def layer_flops(cfg: EmulatorConfig) -> Flops:
    """Standard transformer FLOP counts (2 FLOPs per multiply-add), split over TP and CP.

    attention: 2*t*(4h^2) matmuls + 4*b*s^2*h for scores and weighted sum (t = b*s tokens);
    MLP: 2*t*(2*h*ffn); MoE: each rank processes topk x its tokens on average; logits: 2*t*h*V.
    Backward costs 2x forward; full recompute adds one forward.
    """
    b, s, h = cfg.micro_batch_size, cfg.seq_length, cfg.hidden_size
    t = b * s / cfg.cp
    attn = (2 * t * 4 * h * h + 4 * b * s * s * h / cfg.cp) / cfg.tp
    mlp = 2 * t * 2 * h * cfg.ffn / cfg.tp
    moe = 2 * t * cfg.moe_router_topk * 2 * h * cfg.ffn / cfg.expert_tp if cfg.is_moe else 0.0
    logits = 2 * t * h * cfg.padded_vocab_size / cfg.tp
    return Flops(attn, mlp, moe, logits)
