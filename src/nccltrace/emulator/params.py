"""Model arithmetic for the emulated GPT: the layer assignment and parameter layout of
:mod:`nccltrace.megatron.model` for an :class:`~.config.EmulatorConfig` (which the layer functions
take as it is), and FLOPs per layer (the emulator's timing model)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nccltrace.emulator.config import EmulatorConfig
from nccltrace.megatron import model
from nccltrace.megatron.model import ChunkParams, ModelShape, chunk_layers, is_moe_layer

__all__ = ["ChunkParams", "Flops", "chunk_layers", "chunk_params", "is_moe_layer", "layer_flops", "model_shape"]


def model_shape(cfg: EmulatorConfig) -> ModelShape:
    """The dimensions and sizes of the emulated model that its parameter layout depends on."""
    # Asked for per chunk and microbatch while the schedule is generated: a tuple key is cheaper
    # than building (and validating) a shape each time.
    return _shape((
        cfg.num_layers, cfg.hidden_size, cfg.ffn, cfg.padded_vocab_size, cfg.seq_length, cfg.position_embedding_type,
        cfg.untie_embeddings, cfg.num_experts, cfg.moe_layer_freq, cfg.tp, cfg.pp, cfg.vpp, cfg.ep, cfg.expert_tp,
    ))  # fmt: skip


@lru_cache(maxsize=256)
def _shape(key: tuple) -> ModelShape:
    return ModelShape(*key)  # ModelShape's field order


def chunk_params(cfg: EmulatorConfig, stage: int, chunk: int) -> ChunkParams:
    """Parameter counts of a rank in ``stage`` for virtual chunk ``chunk``."""
    return model.chunk_params(model_shape(cfg), stage, chunk)


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
