"""Volume validation: theoretical vs observed communication volume per rank.

Theory comes from the analytical models of the seeds (the thesis and the OSU paper); observation
from every logged NCCL call of a run, duplicate lines excluded. Both sides use the same two
definitions, ``payload`` (the bytes a rank passed) and ``wire`` (the bytes it puts on links), and
every theoretical component is written as the NCCL calls its equation implies, so that the
comparison can name which operation explains a difference. Definitions, equations and the
reproduction of thesis table 5.1: ``docs/volume.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from nccltrace.core.errors import ConfigError
from nccltrace.core.tables import (
    atomic_output,
    coerce_to_schema,
    frame_to_table,
    iter_record_batches,
    write_table_atomic,
)
from nccltrace.megatron.model import (
    MODEL_DEFAULTS,
    ModelShape,
    chunk_params,
    is_moe_layer,
    padded_vocab_size,
    stage_layers,
)
from nccltrace.megatron.sizes import ParallelSizes, flatten_settings
from nccltrace.metrics.schema import VOLUME_SCHEMA

# The ops columns volume_validation reads: stages read only these, so a run's ops table is never
# loaded whole (tests check the result equals the one from every column).
OPS_COLUMNS = ["bytes", "duplicate_of", "global_rank", "message_bytes", "nranks", "op", "parallelism",
               "parallelism_candidates", "rank_in_comm", "root", "row_kind"]  # fmt: skip

__all__ = [
    "ASSUMPTIONS",
    "DEFINITIONS",
    "KINDS",
    "LABEL_KIND",
    "THESIS_TEXT",
    "VOLUME_SCHEMA",
    "call_volumes",
    "campaign_volume_validation",
    "observed_volume",
    "theoretical_volume",
    "thesis_observed_bytes",
    "volume_validation",
    "volume_validation_of_file",
    "write_volume_validation",
]

ASSUMPTIONS = ("run", "thesis-table-5.1")
DEFINITIONS = ("payload", "wire")
# Comparison rows: the parallelism kinds with an equation, 'other' for communicators no equation
# covers (world, model-parallel, embedding, ...), and 'total' for everything of a rank.
KINDS = ("dp", "tp", "pp", "ep", "cp", "other")

# Communicator label (parallelism.py group kinds) -> comparison kind.
LABEL_KIND: dict[str, str] = {
    "dp": "dp", "dp-cp": "dp", "edp": "dp", "intra-distopt": "dp", "tp-dp": "dp", "tp-dp-cp": "dp",
    "tp": "tp", "etp": "tp", "tp-cp": "tp",
    "pp": "pp",
    "ep": "ep", "tp-ep": "ep",
    "cp": "cp",
}  # fmt: skip

# What the thesis text states (5.2.1, 5.3.5) where it differs from what its runs were launched
# with (appendix A.3); used only by assumptions='thesis-table-5.1'.
THESIS_TEXT: dict[str, Any] = {
    "bytes_per_element": 2,  # 5.3.5: "mixed precision with beta = 2 bytes per element" (also for bf16 grads)
    "moe_router_topk": 1,  # 5.2.1 "Top-1 gating", eq. 5.6 inputs; the launch script passes --moe-router-topk 2
    "moe_layers": 4,  # 5.2.1 "layers 1, 3, 5, 7"; --moe-layer-freq 2 on 16 layers gives 8
    # 5.3.5 TP: "4 microbatches per iteration"; Megatron runs B/(b*dp) = 16 with dp = 1. Reproduced
    # by counting every GPU as a data-parallel replica: B / (b * world size).
    "tp_microbatches_rule": "global_batch / (micro_batch * world_size)",
}

_TEXT_SOURCE = "thesis"
_OSU = "OSU"

# --------------------------------------------------------------------------- schema

_THEORY_COLUMNS = ["assumptions", "parallelism", "role", "component", "definition", "op", "communicator", "ranks",
                   "iterations", "calls_per_iteration", "bytes_per_call", "per_iteration_bytes", "per_run_bytes",
                   "source", "notes"]  # fmt: skip
_OBSERVED_COLUMNS = ["parallelism", "role", "component", "definition", "op", "communicator", "ranks", "iterations",
                     "calls_per_iteration", "bytes_per_call", "per_iteration_bytes", "per_run_bytes",
                     "min_rank_bytes", "max_rank_bytes", "source", "notes"]  # fmt: skip

# --------------------------------------------------------------------------- conventions

_RING1 = ("AllGather", "ReduceScatter", "AlltoAll")  # (n-1)/n x S with S = per-rank bytes x n
_CHAIN = ("Broadcast", "Reduce", "Gather", "Scatter")  # (n-1)/n x S, mean over the chain


def call_volumes(ops: pd.DataFrame) -> pd.DataFrame:
    """Payload and wire bytes of each call row (vectorised).

    Needs ``op``, ``nranks`` and ``bytes``; uses ``message_bytes`` when present (else bytes x n
    for the gathered collectives) and ``root`` / ``rank_in_comm`` to recognise a Send to oneself.
    Single-rank communicators give 0 for both. Unknown ops count their bytes once on the wire.
    """
    op = ops["op"].astype(str).to_numpy()
    n = pd.to_numeric(ops["nranks"], errors="coerce").fillna(0).to_numpy(dtype="float64")
    b = pd.to_numeric(ops["bytes"], errors="coerce").fillna(0).to_numpy(dtype="float64")
    if "message_bytes" in ops:
        msg = pd.to_numeric(ops["message_bytes"], errors="coerce").to_numpy(dtype="float64")
    else:
        msg = np.full(len(ops), np.nan)
    gathered = np.isin(op, _RING1)
    s = np.where(gathered, np.where(np.isnan(msg), b * n, msg), b)
    share = np.where(n > 0, (n - 1) / np.maximum(n, 1), 0.0)
    self_send = np.zeros(len(ops), dtype=bool)
    if "root" in ops and "rank_in_comm" in ops:
        root = pd.to_numeric(ops["root"], errors="coerce").to_numpy(dtype="float64")
        me = pd.to_numeric(ops["rank_in_comm"], errors="coerce").to_numpy(dtype="float64")
        self_send = (op == "Send") & (root == me)
    wire = np.select(
        [op == "AllReduce", gathered, np.isin(op, _CHAIN), op == "Send", op == "Recv"],
        [2 * share * s, share * s, share * s, np.where(self_send, 0.0, b), 0.0],
        default=b,
    )
    multi = n > 1
    return pd.DataFrame({"payload": np.where(multi, b, 0.0), "wire": np.where(multi, wire, 0.0),
                         "self_send": self_send, "single_rank": ~multi}, index=ops.index)  # fmt: skip


# --------------------------------------------------------------------------- run inputs


def _flag(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


@dataclass
class _Run:
    """Resolved model/parallel inputs of one run (names follow the equations)."""

    L: int
    h: int
    ffn: int
    V: int  # vocabulary as configured (unpadded)
    V_pad: int  # padded as Megatron does (multiple of make_vocab_size_divisible_by x tp)
    s: int
    learned_pos: bool
    untie: bool
    b: int
    B: int
    iterations: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    vpp: int
    sp: bool
    distopt: bool
    zero_stage: int
    recompute: str
    E: int
    k: int
    moe_freq: int
    dispatcher: str
    alltoall: str
    precision: str
    world: int
    beta_act: int
    beta_grad: int
    optimizer_steps: int | None  # iterations with an optimizer step, when the settings say
    run_id: str | None

    @property
    def dp(self) -> int:
        return max(self.world // (self.tp * self.pp * self.cp), 1)

    @property
    def edp(self) -> int:
        return max(self.world // (self.etp * self.ep * self.pp), 1)

    @property
    def m(self) -> int:
        """Microbatches per iteration per pipeline: B / (b * dp)."""
        return max(self.B // (self.b * self.dp), 1)

    # Megatron's layer plan (megatron.model's, the one home): which layers a stage holds, which are MoE
    @property
    def layers_per_chunk(self) -> int:
        return self.L // (self.pp * self.vpp)

    @property
    def is_moe(self) -> bool:
        return self.E > 0

    @property
    def moe_layer_freq(self) -> int:
        return max(self.moe_freq, 1)

    def stage_layers(self, stage: int) -> list[int]:
        """Layers on a pipeline stage (all its virtual chunks)."""
        return stage_layers(self, stage)

    def moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` is an MoE layer (``--moe-layer-freq``)."""
        return is_moe_layer(self, layer)

    def boundaries(self, stage: int) -> int:
        """Pipeline boundaries a physical stage touches: virtual chunks v = stage + j*pp have a
        predecessor (v > 0) and a successor (v < pp*vpp - 1)."""
        last = self.pp * self.vpp - 1
        return sum(int(v > 0) + int(v < last) for v in (stage + j * self.pp for j in range(self.vpp)))


def _resolve(settings: Mapping[str, Any], world_hint: int | None = None) -> _Run:
    """Inputs from the settings; ``world_hint`` (ranks seen in the ops) when they give no world size."""
    # Unstated model settings take the one table of defaults; the cluster shape is not in it (a
    # wrong world size would silently scale every mean).
    s = {**MODEL_DEFAULTS, **flatten_settings(settings, skip_none=True)}

    def i(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if s.get(k) is not None:
                return int(s[k])
        return default

    # The parallel sizes as every stage reads them (Megatron argument names too: a default tp = 1
    # must not hide tensor_model_parallel_size). Without a world size: the ranks seen, else dp = 1.
    flat = flatten_settings(settings, skip_none=True)
    try:
        sizes = ParallelSizes.from_settings(flat)
    except ConfigError:
        if not any(flat.get(k) is not None for k in ("world_size", "world", "dp", "data_parallel_size", "nodes")):
            sizes = ParallelSizes.from_settings({**flat, **({"world_size": world_hint} if world_hint else {"dp": 1})})
        else:
            raise
    tp, pp, cp, world = sizes.tp, sizes.pp, sizes.cp, int(sizes.world_size)
    V = i("vocab_size")
    div = i("make_vocab_size_divisible_by")
    h = i("hidden_size")
    precision = str(s["precision"])
    beta_act = 4 if precision == "fp32" else 2
    # Megatron reduces bf16 gradients in fp32 (it forces accumulate_allreduce_grads_in_fp32 for
    # bf16); fp16 gradients are reduced in fp16 unless asked otherwise.
    fp32_grads = precision in ("bf16", "fp32") or _flag(s.get("grad_reduce_in_fp32")) or _flag(
        s.get("accumulate_allreduce_grads_in_fp32"))
    steps = i("optimizer_steps")
    if steps is None and precision == "fp16" and s.get("fp16_overflow_iterations") is not None:
        steps = max(i("iterations") - int(s["fp16_overflow_iterations"]), 0)
    return _Run(
        L=i("num_layers"), h=h, ffn=i("ffn_hidden_size", default=4 * h), V=V,
        V_pad=i("padded_vocab_size", default=padded_vocab_size(V, tp, div) if div else padded_vocab_size(V, tp)),
        s=i("seq_length"), learned_pos=str(s["position_embedding_type"]) == "learned_absolute",
        untie=_flag(s.get("untie_embeddings")), b=i("micro_batch_size"), B=i("global_batch_size"),
        iterations=i("iterations", "train_iters"), tp=tp, pp=pp, cp=cp, ep=sizes.ep,
        etp=sizes.expert_tp, vpp=sizes.vpp, sp=_flag(s.get("sequence_parallel")),
        distopt=_flag(s.get("distributed_optimizer")), zero_stage=i("zero_stage", default=0),
        recompute=str(s["recompute"]), E=i("num_experts"), k=i("moe_router_topk"), moe_freq=i("moe_layer_freq"),
        dispatcher=str(s["moe_token_dispatcher"]), alltoall=str(s["moe_alltoall"]), precision=precision, world=world,
        beta_act=beta_act, beta_grad=4 if fp32_grads else 2, optimizer_steps=steps, run_id=s.get("run_id"),
    )  # fmt: skip


# --------------------------------------------------------------------------- theory


@dataclass
class _Item:
    """Calls one equation term implies on one rank per iteration (bytes = payload per call)."""

    op: str
    labels: tuple[str, ...]  # communicator labels the calls run on (first = the canonical one)
    nranks: int
    calls: float
    nbytes: float
    self_send: bool = False
    variable: bool = False  # per-call size varies in practice (routing, buffers): match by total


@dataclass
class _Component:
    parallelism: str
    stage: int
    component: str
    items: list[_Item]
    source: dict[str, str]  # definition -> equation(s)
    notes: list[str] = field(default_factory=list)
    active_iterations: int | None = None  # iterations in which the calls happen (None = all)
    hint: str = ""  # likely reason when the calls are missing from the log


def _role(stage: int, pp: int) -> str:
    if pp == 1:
        return "all"
    return "first" if stage == 0 else "last" if stage == pp - 1 else "middle"


def _thesis_params(r: _Run) -> float:
    """Thesis eq. 2.4 / 5.2 exactly as printed: P = 12 L h^2 (1 + 1/(12h) + (V+s)/(12 L h^2)).

    The usual form (Narayanan et al. 2021) is 12 L h^2 (1 + 13/(12h) + (V+s)/(12 L h)): as printed
    the embedding term lacks a factor h and 13 reads 1, giving 50.39 M for the thesis's dense model,
    which has 76.7 M parameters."""
    L, h = r.L, r.h
    return 12 * L * h * h * (1 + 1 / (12 * h) + (r.V + r.s) / (12 * L * h * h))


def _stage_params(r: _Run, stage: int) -> tuple[float, float]:
    """Per-rank parameters of a stage by the terms of OSU eq. 1 (2Vh + sh + L(12h^2 + 8h) + 2h),
    generalised: ffn != 4h (attention 4h^2 + MLP 2 h ffn), tied embeddings (one V h, plus the
    copy Megatron keeps on the last stage when pp > 1), matrices split over TP, vectors
    replicated; an MoE layer keeps attention, 8h and a router (E h) in the dense buffer and
    moves E/ep experts of 2 h ffn / etp each to the expert buffer. Returns (dense, expert)."""
    h, tp = r.h, r.tp
    dense = expert = 0.0
    for layer in r.stage_layers(stage):
        dense += 4 * h * h / tp + 8 * h
        if r.moe_layer(layer):
            dense += r.E * h
            expert += (r.E // max(r.ep, 1)) * 2 * h * r.ffn / r.etp
        else:
            dense += 2 * h * r.ffn / tp
    if stage == 0:
        dense += r.V_pad * h / tp + (r.s * h if r.learned_pos else 0)
    if stage == r.pp - 1:
        dense += 2 * h
        if r.untie or r.pp > 1:
            dense += r.V_pad * h / tp
    return dense, expert


def _megatron_params(r: _Run, stage: int) -> int | None:
    """Dense grad-buffer elements of a stage in Megatron-core's layout, for the notes (None when
    Megatron would refuse the model's shape)."""
    try:
        shape = ModelShape(num_layers=r.L, hidden_size=r.h, ffn_hidden_size=r.ffn, padded_vocab_size=r.V_pad,
                           seq_length=r.s, position_embedding_type="learned_absolute" if r.learned_pos else "rope",
                           untie_embeddings=r.untie, num_experts=r.E, moe_layer_freq=r.moe_freq, tp=r.tp, pp=r.pp,
                           vpp=r.vpp, ep=r.ep, etp=r.etp)  # fmt: skip
    except (ValueError, TypeError):
        return None
    return sum(chunk_params(shape, stage, c).dense for c in range(r.vpp))


def _dp_components(r: _Run, stage: int, thesis: bool) -> list[_Component]:
    out: list[_Component] = []
    d = r.dp * r.cp  # Megatron reduces dense gradients over the dp x cp group
    if thesis:
        beta = THESIS_TEXT["bytes_per_element"]
        P = _thesis_params(r) / (r.tp * r.pp)
        note = [(f"P = {_thesis_params(r):,.0f} from thesis eq. 2.4/5.2 as printed (V = {r.V:,} unpadded), split "
                f"evenly over tp x pp; beta = {beta}")]
        if r.E:
            frac = (r.L - THESIS_TEXT["moe_layers"]) / r.L
            P *= frac
            note.append(f"non-expert share {r.L - THESIS_TEXT['moe_layers']}/{r.L} of eq. 5.3 as in the text (it counts "
                        f"{THESIS_TEXT['moe_layers']} MoE layers; the run has {_n_moe(r)}); the run reduces "
                        f"{'fp32' if r.beta_grad == 4 else 'fp16'} gradients (beta = {r.beta_grad})")
        if d > 1:
            out.append(_Component("dp", stage, "gradient all-reduce", [_Item("AllReduce", ("dp-cp", "dp"), d, 1, P * beta,
                                  variable=True)], {"wire": "thesis eq. 5.3", "payload": "thesis eq. 5.3 (one "
                                  "all-reduce of P/(tp pp) x beta)"}, note))  # fmt: skip
        return out
    dense, expert = _stage_params(r, stage)
    notes = [(f"P per rank = {dense:,.0f} from OSU eq. 1 terms (thesis eq. 2.4 as printed gives "
             f"{_thesis_params(r) / (r.tp * r.pp):,.0f}: its embedding term lacks a factor h)")]
    mega = _megatron_params(r, stage)
    if mega is not None and mega != round(dense):
        notes.append(f"Megatron-core layout: {mega:,} ({(dense / mega - 1) * 100:+.2f}% by the equation)")
    notes.append(f"gradients reduced in {'fp32' if r.beta_grad == 4 else 'fp16'} (beta = {r.beta_grad})")
    groups = [("dense", dense, d, ("dp-cp", "dp")), ("expert", expert, r.edp, ("edp",))]
    for what, P, n, labels in groups:
        if n <= 1 or P == 0:
            continue
        name = "" if what == "dense" else "expert "
        if r.distopt or r.zero_stage in (1, 2, 3):
            out.append(_Component("dp", stage, f"{name}gradient reduce-scatter", [_Item(
                "ReduceScatter", labels, n, r.vpp, P / n / r.vpp * r.beta_grad, variable=True)],
                {"wire": "OSU eq. 2 (ZeRO-1/2 = DP volume; reduce-scatter half)", "payload": "OSU eq. 2"}, notes))
            steps = r.optimizer_steps
            ag_notes = list(notes)
            if r.precision == "fp16":
                ag_notes.append("fp16: Megatron skips the optimizer step, and this all-gather, on loss-scale "
                                "overflow iterations (its scaler starts at 2^32); "
                                + (f"{steps} of {r.iterations} iterations step (settings)" if steps is not None
                                   else "assumed every iteration steps: give fp16_overflow_iterations to model it"))
            out.append(_Component("dp", stage, f"{name}parameter all-gather", [_Item(
                "AllGather", labels, n, r.vpp, P / n / r.vpp * r.beta_act, variable=True)],
                {"wire": "OSU eq. 2 (ZeRO-1/2 = DP volume; all-gather half)", "payload": "OSU eq. 2"}, ag_notes,
                active_iterations=steps,
                hint="fp16 runs skip it on loss-scale overflow iterations" if r.precision == "fp16" else ""))
            if r.zero_stage == 3:
                out.append(_Component("dp", stage, f"{name}ZeRO-3 parameter all-gather (forward)", [_Item(
                    "AllGather", labels, n, r.vpp, P / n / r.vpp * r.beta_act, variable=True)],
                    {"wire": "OSU eq. 3 (1.5x DP volume)", "payload": "OSU eq. 3"}, notes))
        else:
            out.append(_Component("dp", stage, f"{name}gradient all-reduce", [_Item(
                "AllReduce", labels, n, r.vpp, P / r.vpp * r.beta_grad, variable=True)],
                {"wire": "thesis eq. 5.3 = OSU eq. 2", "payload": "thesis eq. 5.3 (P/(tp pp) x beta per all-reduce)"},
                notes))
    return out


def _n_moe(r: _Run, layers: list[int] | None = None) -> int:
    return sum(r.moe_layer(i) for i in (range(r.L) if layers is None else layers))


def _tp_components(r: _Run, stage: int, thesis: bool) -> list[_Component]:
    t = r.tp
    if t <= 1:
        return []
    layers = r.stage_layers(stage)
    n_moe = _n_moe(r, layers)
    beta = THESIS_TEXT["bytes_per_element"] if thesis else r.beta_act
    act = r.b * (r.s // r.cp) * r.h * beta  # b s h beta: one full activation
    if thesis:
        m = max(r.B // (r.b * r.world), 1)
        notes = [(f"{m} microbatches per iteration as in the text ({THESIS_TEXT['tp_microbatches_rule']}); Megatron "
                 f"runs {r.m} (B/(b dp))")]
    else:
        m = r.m
        notes = [f"{m} microbatches per iteration (B/(b dp))"]
    # all-reduce equivalents per microbatch: 4 per dense layer (2 forward, 2 backward), 2 per MoE
    # layer (attention only: the expert MLP communicates through the token dispatcher)
    ar = 4 * (len(layers) - n_moe) + 2 * n_moe
    if n_moe:
        notes.append(f"{n_moe} MoE layer(s) count their attention all-reduces only")
    out = [_Component("tp", stage, "layer activations (forward + backward)", _tp_items(r, ar * m, act),
                      {"wire": "thesis eq. 5.5 = OSU eq. 5 (8L term)", "payload": "thesis eq. 5.5 (4 all-reduces of "
                       "b s h beta per layer)"}, notes + _sp_note(r))]  # fmt: skip
    if thesis:
        return out
    if r.recompute == "full":
        out.append(_Component("tp", stage, "activation recomputation", _tp_items(r, ar // 2 * m, act),
                              {"wire": "OSU eq. 5 (4L term)", "payload": "OSU eq. 5"}, notes + _sp_note(r)))
    elif r.recompute == "selective":
        notes = notes + [("selective recomputation replays core attention only: no extra collectives (OSU eq. 5's "
                         "recomputation term applies to full recomputation)")]
        out[0].notes = notes + _sp_note(r)
    if stage == 0:
        out.append(_Component("tp", stage, "embedding", _tp_items(r, 1 * m, act),
                              {"wire": "OSU eq. 5 (+2 term)", "payload": "OSU eq. 5"}, notes + _sp_note(r)))
    return out


def _sp_note(r: _Run) -> list[str]:
    if not r.sp:
        return []
    return [("sequence parallelism: each all-reduce is an all-gather plus a reduce-scatter of the sequence shard "
            "(same wire volume)")]


def _tp_items(r: _Run, ar_calls: float, act: float) -> list[_Item]:
    if r.sp:
        return [_Item("AllGather", ("tp",), r.tp, ar_calls, act / r.tp),
                _Item("ReduceScatter", ("tp",), r.tp, ar_calls, act / r.tp)]
    return [_Item("AllReduce", ("tp",), r.tp, ar_calls, act)]


def _pp_components(r: _Run, stage: int, thesis: bool) -> list[_Component]:
    if r.pp <= 1:
        return []
    beta = THESIS_TEXT["bytes_per_element"] if thesis else r.beta_act
    # eq. 2.9/2.13 (h/n_TP per rank) where the implementation shards the tensor: Megatron-core
    # sends the sequence shard with SP and the full tensor on every TP rank without it
    shard = r.tp if (r.sp or thesis) else 1
    v = r.b * (r.s // r.cp) * r.h * beta / shard
    nb = r.boundaries(stage)
    eq = "thesis eq. 5.4" if shard == 1 else "thesis eq. 2.9/2.13"
    notes = [f"{nb} boundar{'y' if nb == 1 else 'ies'} x {r.m} microbatches per iteration, {v:,.0f} B per transfer"]
    if r.vpp > 1:
        notes.append(f"interleaved schedule: {eq} applied per virtual-stage boundary ({r.pp * r.vpp - 1} for "
                     f"pp x vpp = {r.pp * r.vpp} chunks); the seeds give no VPP formula")
    if r.tp > 1 and shard == 1:
        notes.append("eq. 2.9's h/n_TP sharding applies only with sequence parallelism in Megatron-core r0.13; "
                     "without it every TP rank sends the full b s h tensor (eq. 2.8)")
    calls = nb * r.m
    labels = ("pp", "world")
    src = {"wire": f"{eq} (one direction per boundary); OSU eq. 4 in aggregate",
           "payload": f"{eq} (both directions per boundary, as in thesis table 5.1)"}
    return [_Component("pp", stage, "send (activations forward, gradients backward)",
                       [_Item("Send", labels, 2, calls, v)], src, notes),
            _Component("pp", stage, "recv", [_Item("Recv", labels, 2, calls, v)], src, notes)]


def _ep_components(r: _Run, stage: int, thesis: bool) -> list[_Component]:
    if not r.E:
        return []
    if thesis:
        n_moe = THESIS_TEXT["moe_layers"] if stage == 0 else 0  # the text's count (pp = 1 in the thesis)
        k, beta = THESIS_TEXT["moe_router_topk"], THESIS_TEXT["bytes_per_element"]
        notes = [(f"top-k = {k} and {n_moe} MoE layers as in the thesis text; the run settings say top-k = {r.k} "
                 f"(launch script) and {_n_moe(r, r.stage_layers(stage))} MoE layers: the run moves "
                 f"{r.k * _n_moe(r, r.stage_layers(stage)) / max(k * n_moe, 1):g}x this")]
    else:
        n_moe = _n_moe(r, r.stage_layers(stage))
        k, beta = r.k, r.beta_act
        notes = [(f"top-k = {k}, {n_moe} MoE layer(s) on this stage (moe_layer_freq {r.moe_freq}) from the run "
                 "settings")]
        if k != THESIS_TEXT["moe_router_topk"]:
            notes.append(f"the thesis text assumes top-{THESIS_TEXT['moe_router_topk']} (its launch script passes "
                         f"2): with top-{THESIS_TEXT['moe_router_topk']} the all-to-all volume would be {1 / k:g}x this")
    if n_moe == 0:
        return []
    tok = r.b * r.s // (r.cp * (r.tp if r.sp else 1))  # tokens entering a layer on one rank
    per_mb = n_moe * r.m
    if r.dispatcher == "allgather":
        n = r.tp * r.ep  # the tp x ep group
        if n <= 1:
            return []
        # dispatch all-gather + combine reduce-scatter forward, their mirrors backward: 4 x n tok h
        items = [_Item(op, ("tp-ep", "ep"), n, 2 * per_mb, tok * r.h * beta) for op in ("AllGather", "ReduceScatter")]
        notes.append("no printed equation for the AllGather dispatcher (thesis 2.4.5 describes it): 4 collectives of "
                     "the gathered tokens (n tok h) per MoE layer and microbatch, top-k independent")
        return [_Component("ep", stage, "allgather token dispatch/combine", items,
                           {"wire": "thesis 2.4.5 AllGather dispatcher (derived, no equation)",
                            "payload": "thesis 2.4.5 (derived)"}, notes)]
    n = r.ep
    if n <= 1:
        return []
    # eq. 2.11 per rank: 4 events (dispatch, combine; forward and backward), tok k h beta each,
    # (1 - 1/n) of it to remote ranks
    block = tok * k * r.h * beta / n  # one peer's block under uniform routing
    src = {"wire": "thesis eq. 2.11/5.6 (per rank)", "payload": "thesis eq. 2.11/5.6 (per rank)"}
    if r.alltoall == "native":
        items = [_Item("AlltoAll", ("ep",), n, 4 * per_mb, block, variable=True)]
        return [_Component("ep", stage, "token all-to-all", items, src, notes)]
    notes = notes + [("PyTorch's all_to_all_single is logged as grouped Send/Recv, one per peer including the rank "
                     "itself (payload counts the self-copy, the wire does not)")]
    sends = [_Item("Send", ("ep",), n, 4 * per_mb * (n - 1), block, variable=True),
             _Item("Send", ("ep",), n, 4 * per_mb, block, self_send=True, variable=True)]
    recvs = [_Item("Recv", ("ep",), n, 4 * per_mb * n, block, variable=True)]
    return [_Component("ep", stage, "token all-to-all (Send)", sends, src, notes),
            _Component("ep", stage, "token all-to-all (Recv)", recvs, src, notes)]


def _components(r: _Run, thesis: bool) -> list[_Component]:
    out: list[_Component] = []
    for stage in range(r.pp):
        for build in (_dp_components, _tp_components, _pp_components, _ep_components):
            out.extend(build(r, stage, thesis))
    return out


def _item_frame(r: _Run, comps: list[_Component]) -> pd.DataFrame:
    """One row per (component, item) and stage with per-rank calls, payload and wire per run."""
    rows = []
    for c in comps:
        active = r.iterations if c.active_iterations is None else c.active_iterations
        for it in c.items:
            rows.append({"parallelism": c.parallelism, "stage": c.stage, "component": c.component, "op": it.op,
                         "communicator": it.labels[0], "labels": "|".join(it.labels), "nranks": it.nranks,
                         "calls": it.calls * active, "bytes_per_call": float(it.nbytes), "self_send": it.self_send,
                         "variable": it.variable, "source_payload": c.source["payload"],
                         "source_wire": c.source["wire"], "notes": "; ".join(dict.fromkeys(c.notes)),
                         "hint": c.hint})  # fmt: skip
    cols = ["parallelism", "stage", "component", "op", "communicator", "labels", "nranks", "calls", "bytes_per_call",
            "self_send", "variable", "source_payload", "source_wire", "notes", "hint"]  # fmt: skip
    f = pd.DataFrame(rows, columns=cols)
    if f.empty:
        return f.assign(payload=pd.Series(dtype="float64"), wire=pd.Series(dtype="float64"))
    # the same conventions as the observation: one synthetic call per item, scaled by its calls
    per_call = call_volumes(pd.DataFrame({"op": f["op"], "nranks": f["nranks"], "bytes": f["bytes_per_call"],
                                          "root": np.where(f["self_send"], 0, 1), "rank_in_comm": 0}))  # fmt: skip
    f["payload"] = per_call["payload"].to_numpy() * f["calls"].to_numpy()
    f["wire"] = per_call["wire"].to_numpy() * f["calls"].to_numpy()
    f["role"] = [_role(s, r.pp) for s in f["stage"]]
    return f


def _role_ranks(r: _Run) -> dict[str, int]:
    per_stage = r.world // r.pp
    out: dict[str, int] = {}
    for stage in range(r.pp):
        role = _role(stage, r.pp)
        out[role] = out.get(role, 0) + per_stage
    return out


def _role_stages(r: _Run) -> dict[str, int]:
    out: dict[str, int] = {}
    for stage in range(r.pp):
        out[_role(stage, r.pp)] = out.get(_role(stage, r.pp), 0) + 1
    return out


def _world_hint(ops: pd.DataFrame) -> int | None:
    if "global_rank" not in ops or ops["global_rank"].isna().all():
        return None
    return int(pd.to_numeric(ops["global_rank"], errors="coerce").max()) + 1


def _theory(settings: Mapping[str, Any], assumptions: str, world_hint: int | None = None) -> tuple[_Run, pd.DataFrame]:
    if assumptions not in ASSUMPTIONS:
        raise ValueError(f"unknown assumptions {assumptions!r}; use one of {', '.join(ASSUMPTIONS)}")
    r = _resolve(settings, world_hint)
    items = _item_frame(r, _components(r, assumptions != "run"))
    if not items.empty:
        # per-rank means over the stages of a role
        items["calls"] = items["calls"] / items["role"].map(_role_stages(r))
        for d in DEFINITIONS:
            items[d] = items[d] / items["role"].map(_role_stages(r))
    return r, items


def theoretical_volume(settings: Mapping[str, Any], assumptions: str = "run") -> pd.DataFrame:
    """Theoretical communication volume per rank of a run, from the seeds' equations.

    One row per (parallelism, role, component, definition): calls and bytes per call the
    equation implies, bytes per iteration and per run per rank (mean over the role's ranks),
    the equation (``source``) and ``notes`` (inputs, approximations, mismatches between the
    thesis text and the run settings such as top-k).

    ``assumptions='run'`` takes every input from the settings as the run was launched (padded
    vocabulary, top-k, MoE layer pattern, gradient dtype, microbatches B/(b dp)) and uses the
    seeds' equations, the parameter count by OSU eq. 1 (thesis eq. 2.4 as printed drops a factor
    h). ``'thesis-table-5.1'`` applies the thesis text's inputs (:data:`THESIS_TEXT`, eq. 2.4 as
    printed) and its equations only; it reproduces table 5.1 from the thesis's configurations.
    """
    r, items = _theory(settings, assumptions)
    if items.empty:
        return pd.DataFrame(columns=_THEORY_COLUMNS)
    ranks = _role_ranks(r)
    key = ["parallelism", "role", "component"]
    g = items.groupby(key, sort=False)
    base = g.agg(op=("op", lambda x: "+".join(dict.fromkeys(x))), communicator=("communicator", "first"),
                 calls=("calls", "sum"), payload=("payload", "sum"), wire=("wire", "sum"),
                 src_payload=("source_payload", "first"), src_wire=("source_wire", "first"),
                 notes=("notes", "first")).reset_index()  # fmt: skip
    pay_calls = items.assign(pb=items["bytes_per_call"] * items["calls"]).groupby(key, sort=False)["pb"].sum()
    base["bytes_per_call"] = (pay_calls.to_numpy() / base["calls"].where(base["calls"] > 0)).astype("float64")
    parts = []
    for d in DEFINITIONS:
        parts.append(pd.DataFrame({
            "assumptions": assumptions, "parallelism": base["parallelism"], "role": base["role"],
            "component": base["component"], "definition": d, "op": base["op"], "communicator": base["communicator"],
            "ranks": base["role"].map(ranks), "iterations": r.iterations,
            "calls_per_iteration": base["calls"] / r.iterations, "bytes_per_call": base["bytes_per_call"],
            "per_iteration_bytes": base[d] / r.iterations, "per_run_bytes": base[d],
            "source": base["src_" + d], "notes": base["notes"],
        }))  # fmt: skip
    out = pd.concat(parts, ignore_index=True)
    order = {k: i for i, k in enumerate(KINDS)}
    out = out.sort_values(["parallelism", "role", "definition"], key=lambda s: s.map(order) if s.name ==
                          "parallelism" else s, kind="stable")  # fmt: skip
    return out[_THEORY_COLUMNS].reset_index(drop=True)


# --------------------------------------------------------------------------- observation


def _calls(ops: pd.DataFrame, r: _Run) -> pd.DataFrame:
    """Call rows that count (duplicates excluded) with kind, role, payload and wire."""
    c = ops
    if "row_kind" in c:
        c = c[c["row_kind"].astype("string").fillna("call") == "call"]
    if "duplicate_of" in c:
        c = c[c["duplicate_of"].isna()]
    c = c.copy()
    vol = call_volumes(c)
    label = c["parallelism"].astype("string").fillna("unknown") if "parallelism" in c else pd.Series(
        "unknown", index=c.index, dtype="string")
    if "parallelism_candidates" in c:
        # pp = 2: the pipeline and embedding groups have the same ranks; collectives there are the
        # embedding sync (the pipeline group carries only Send/Recv, and MoE aux-loss logging)
        cand = c["parallelism_candidates"].astype("string").fillna("")
        emb = (label == "pp") & ~c["op"].isin(["Send", "Recv"]) & cand.str.contains(r"(?:^|,)embd(?:,|$)")
        label = label.mask(emb, "embd")
    gr = pd.to_numeric(c["global_rank"], errors="coerce") if "global_rank" in c else pd.Series(np.nan, index=c.index)
    per_stage = max(r.world // r.pp, 1)
    stage = (gr // per_stage).clip(upper=r.pp - 1)
    roles = np.array([_role(s, r.pp) for s in range(r.pp)], dtype=object)
    role = np.where(gr.notna(), roles[stage.fillna(0).astype("int64").to_numpy()], None)
    if r.pp == 1:
        role = np.full(len(c), "all", dtype=object)
    kind = label.map(LABEL_KIND).fillna("other").astype(str)
    # the pipeline kind is its point-to-point traffic; collectives on the pp group are logging
    kind = kind.mask((kind == "pp") & ~c["op"].isin(["Send", "Recv"]), "other")
    return pd.DataFrame({
        "op": c["op"].astype(str), "label": label.astype(str), "kind": kind,
        "rank": gr, "role": role, "bytes": pd.to_numeric(c["bytes"], errors="coerce").fillna(0).astype("float64"),
        "payload": vol["payload"], "wire": vol["wire"], "single_rank": vol["single_rank"], "self_send": vol["self_send"],
    }, index=c.index)  # fmt: skip


def observed_volume(ops: pd.DataFrame, settings: Mapping[str, Any]) -> pd.DataFrame:
    """Observed communication volume per rank from the logged calls of a run.

    Every call row counts (kernel matched or not), duplicate log lines excluded. One row per
    (parallelism, role, component = '<op> on <communicator>', definition) with per-rank means
    over the role's ranks (ranks without such calls count as 0), the smallest and largest
    per-rank total, calls and median bytes per call. Calls on single-rank communicators form
    their own components with 0 bytes; ``notes`` gives the payload they logged.
    """
    r = _resolve(settings, _world_hint(ops))
    c = _calls(ops, r)
    ranks = _role_ranks(r)
    cols = _OBSERVED_COLUMNS
    if c.empty:
        return pd.DataFrame(columns=cols)
    unranked = int(c["role"].isna().sum())
    c = c[c["role"].notna()]
    c = c.assign(component=c["op"] + " on " + c["label"] + np.where(c["single_rank"], " (single-rank)", ""))
    key = ["kind", "role", "component"]
    g = c.groupby(key, sort=True)
    agg = g.agg(op=("op", "first"), communicator=("label", "first"), calls=("op", "size"),
                bytes_per_call=("bytes", "median"), logged=("bytes", "sum"), single=("single_rank", "first"),
                payload=("payload", "sum"), wire=("wire", "sum")).reset_index()  # fmt: skip
    per_rank = c.groupby(key + ["rank"])[list(DEFINITIONS)].sum()
    n = agg["role"].map(ranks).astype("float64")
    parts = []
    for d in DEFINITIONS:
        pr = per_rank[d].groupby(level=key)
        mn, mx, seen = pr.min(), pr.max(), pr.size()
        idx = pd.MultiIndex.from_frame(agg[key])
        mn = mn.reindex(idx).to_numpy()
        mx = mx.reindex(idx).to_numpy()
        # a rank of the role without such calls has 0
        mn = np.where(seen.reindex(idx).to_numpy() < n.to_numpy(), 0.0, mn)
        note = np.where(agg["single"], "no traffic: " + agg["calls"].astype(str) + " calls logging "
                        + agg["logged"].map("{:,.0f}".format) + " B in total (NCCL launches no kernel)", "")
        if unranked:
            note = np.where(note == "", f"{unranked} calls without a global rank left out", note)
        parts.append(pd.DataFrame({
            "parallelism": agg["kind"], "role": agg["role"], "component": agg["component"], "definition": d,
            "op": agg["op"], "communicator": agg["communicator"], "ranks": agg["role"].map(ranks),
            "iterations": r.iterations, "calls_per_iteration": agg["calls"] / n / r.iterations,
            "bytes_per_call": agg["bytes_per_call"].astype("float64"),
            "per_iteration_bytes": agg[d] / n / r.iterations, "per_run_bytes": agg[d] / n,
            "min_rank_bytes": mn, "max_rank_bytes": mx, "source": "NCCL call lines (duplicates excluded)",
            "notes": note,
        }))  # fmt: skip
    out = pd.concat(parts, ignore_index=True)
    return out[cols].reset_index(drop=True)


# --------------------------------------------------------------------------- comparison

_PURPOSE: dict[tuple[str, str], str] = {
    ("world", "AllReduce"): "barriers, timers, start time",
    ("world", "AllGather"): "timer statistics",
    ("world", "Broadcast"): "data-loader flags",
    ("mp", "AllReduce"): "loss scaling found-inf, update check, grad-norm, learning rate",
    ("intra-distopt", "AllReduce"): "distributed-optimizer found-inf",
    ("embd", "AllReduce"): "tied word-embedding sync between first and last stage",
    ("pos-embd", "AllReduce"): "position-embedding sync",
    ("tp", "Broadcast"): "batch broadcast to the TP group (get_batch)",
    ("tp", "AllReduce"): "activation all-reduce (embedding, output layer, sublayers) or SP parameter grads",
    ("tp", "AllGather"): "sequence-parallel all-gathers (incl. the backward input re-gather)",
    ("tp", "ReduceScatter"): "sequence-parallel reduce-scatters",
    ("dp-cp", "AllReduce"): "gradient all-reduce / loss averaging",
    ("dp", "AllReduce"): "gradient all-reduce / loss averaging",
    ("dp-cp", "ReduceScatter"): "gradient reduce-scatter (distributed optimizer)",
    ("dp-cp", "AllGather"): "parameter all-gather (distributed optimizer)",
    ("edp", "AllReduce"): "expert gradient all-reduce",
    ("ep", "Send"): "token all-to-all", ("ep", "Recv"): "token all-to-all", ("ep", "AlltoAll"): "token all-to-all",
    ("tp-ep", "AllGather"): "tokens-per-expert counts / allgather dispatcher",
    ("tp-ep", "ReduceScatter"): "allgather dispatcher combine",
    ("tp-ep-pp", "AllReduce"): "expert grad-norm / found-inf",
    ("pp", "AllReduce"): "MoE aux-loss logging (pp = 2: or the embedding sync)",
    ("pp", "Send"): "pipeline activations/gradients", ("pp", "Recv"): "pipeline activations/gradients",
    ("cp", "Send"): "context-parallel ring attention", ("cp", "Recv"): "context-parallel ring attention",
    ("tp-cp", "AllReduce"): "MoE router tokens-per-expert",
}  # fmt: skip


def _size(x: float, digits: int = 3) -> str:
    """Bytes in binary units, ``digits`` significant digits ('4 MiB', '146 MiB', '24 B')."""
    x = float(x)
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= f:
            return f"{x / f:.{digits}g} {unit}"
    return f"{x:.{digits}g} B"


def _sizes(a: float, b: float) -> tuple[str, str]:
    """Two sizes with just enough digits to tell them apart."""
    for digits in range(3, 10):
        sa, sb = _size(a, digits), _size(b, digits)
        if sa != sb:
            break
    return sa, sb


def _count(x: float) -> str:
    return f"{x:.4g}" if abs(x - round(x)) > 1e-6 else f"{round(x)}"


def _purpose(label: str, op: str, sizes: np.ndarray) -> str:
    text = _PURPOSE.get((label, op), "no equation covers it")
    if len(sizes) and float(np.max(sizes)) <= 64:
        text = "scalars: " + text
    return text


def _describe_obs(op: str, label: str, calls: float, sizes: np.ndarray, weights: np.ndarray) -> str:
    uniq = np.unique(sizes)
    if len(uniq) == 1:
        size = f"of {_size(uniq[0])} "
    else:
        top = sizes[np.argmax(weights)]
        size = f"of {_size(uniq.min())}-{_size(uniq.max())} "
        if len(uniq) <= 8:
            size += f"(largest share {_size(top)}) "
    return f"+{_count(calls)} {op} {size}on {label} ({_purpose(label, op, sizes)})"


def _dominant(items: pd.DataFrame, obs: pd.DataFrame, d: str) -> tuple[str | None, float]:
    """The operation group contributing most to observed - theory (definition ``d``).

    Theory items are matched to observed groups of the same op on one of their communicator
    labels: fixed-size items to the calls within a factor 2 of their size (nearest first, up to
    the predicted count), variable-size items (gradient buffers, routed tokens) to all of them.
    Left-over observed calls are grouped by (op, communicator); unmatched items are volume the
    equation predicts but the log does not show.
    """
    residuals: list[tuple[float, str]] = []
    if obs.empty:
        rem = pd.DataFrame(columns=["op", "label", "bytes", "self_send", "calls", "payload", "wire"])
    else:
        rem = obs.copy()
    rem = rem.reset_index(drop=True)
    left = rem["calls"].to_numpy(dtype="float64").copy()
    for it in items.sort_values(d, ascending=False).itertuples(index=False):
        labels = it.labels.split("|")
        cand = np.flatnonzero((rem["op"].to_numpy() == it.op) & rem["label"].isin(labels).to_numpy() & (left > 0)
                              & (rem["self_send"].to_numpy() == it.self_send))
        # sizes that can belong to the term: within 2x (fixed) or 10x (variable: buffers per model
        # chunk, routed token blocks) of the predicted size per call; nearest first
        lo, hi = (0.1, 10.0) if it.variable else (0.5, 2.0)
        ratio = rem["bytes"].to_numpy()[cand] / max(it.bytes_per_call, 1.0)
        keep = (ratio >= lo) & (ratio <= hi)
        cand = cand[keep][np.argsort(np.abs(np.log(np.maximum(ratio[keep], 1e-12))), kind="stable")]
        got_calls = got = got_payload = 0.0
        need = float(it.calls)
        sizes: list[float] = []
        for j in cand:
            take = left[j] if it.variable else min(left[j], need - got_calls)
            if take <= 0:
                continue
            sizes.append(float(rem.at[j, "bytes"]))
            frac = take / rem.at[j, "calls"]
            got += frac * rem.at[j, d]
            got_payload += frac * rem.at[j, "payload"]
            got_calls += take
            left[j] -= take
        expected = float(getattr(it, d))
        src = getattr(it, "source_" + d)
        if got_calls == 0:
            why = f"; {it.hint}" if it.hint else ""
            text = f"-{_count(it.calls)} {it.op} of {_size(it.bytes_per_call)} on {it.communicator} ({it.component}: in {src}, not logged{why})"
        elif abs(got_calls - it.calls) > 0.005 * max(it.calls, 1):
            text = f"{it.op} on {it.communicator}: {_count(got_calls)} calls vs {_count(it.calls)} in {src} ({it.component})"
        else:
            per_call = _sizes(got_payload / got_calls, it.bytes_per_call)
            if not it.variable and len(set(sizes)) > 1:  # e.g. the same collective in two dtypes
                per_call = (f"{_size(min(sizes))}-{_size(max(sizes))}", _size(it.bytes_per_call))
            sign, word = ("+", "over") if got >= expected else ("-", "under")
            text = (f"{it.op} on {it.communicator}: {sign}{_size(abs(got - expected))} {word} {src} ({it.component}; "
                    f"{per_call[0]} vs {per_call[1]} payload per call)")
        residuals.append((got - expected, text))
    rem = rem.assign(calls=left, value=rem[d].to_numpy() * np.divide(left, rem["calls"].to_numpy(dtype="float64"),
                     out=np.zeros_like(left), where=rem["calls"].to_numpy() > 0))  # fmt: skip
    rem = rem[rem["calls"] > 0]
    for (op, label), grp in rem.groupby(["op", "label"], sort=True):
        residuals.append((float(grp["value"].sum()), _describe_obs(op, label, float(grp["calls"].sum()),
                                                                    grp["bytes"].to_numpy(), grp["value"].to_numpy())))
    residuals = [x for x in residuals if abs(x[0]) > 0]
    if not residuals:
        return None, 0.0
    diff, text = max(residuals, key=lambda x: abs(x[0]))
    return text, float(diff)


_NO_THEORY = {
    "cp": "no seed equation for context parallelism (thesis 2.4.4 is qualitative)",
    "other": "no equation: world/model-parallel barriers, timers, loss scaling, embedding sync, expert grad-norm",
}


@dataclass
class _Observed:
    """The observed side of a run's volume validation, as sums that add up over parts of the
    ops table: per (kind, role, op, label, bytes, self_send) the calls and volumes summed over
    ranks, per (kind, role, rank) and per (role, rank) the volumes, and the calls without rank."""

    groups: pd.DataFrame
    per_rank: pd.DataFrame
    per_rank_total: pd.DataFrame
    unranked: int = 0

    _GROUP = ("kind", "role", "op", "label", "bytes", "self_send")

    @classmethod
    def of(cls, ops: pd.DataFrame, r: _Run) -> _Observed:
        c = _calls(ops, r)
        unranked = int(c["role"].isna().sum())
        c = c[c["role"].notna()]
        obs = c[~c["single_rank"]]
        groups = obs.groupby(list(cls._GROUP), sort=True).agg(calls=("op", "size"), payload=("payload", "sum"),
                                                         wire=("wire", "sum"))  # fmt: skip
        return cls(groups, obs.groupby(["kind", "role", "rank"])[list(DEFINITIONS)].sum(),
                   obs.groupby(["role", "rank"])[list(DEFINITIONS)].sum(), unranked)

    @classmethod
    def combine(cls, parts: list[_Observed]) -> _Observed:
        """The sums of several parts (each rank's calls may lie in several parts)."""

        def add(frames: list[pd.DataFrame]) -> pd.DataFrame:
            frames = [f for f in frames if len(f)] or frames[:1]
            return pd.concat(frames).groupby(level=list(range(frames[0].index.nlevels)), sort=True).sum()

        return cls(add([p.groups for p in parts]), add([p.per_rank for p in parts]),
                   add([p.per_rank_total for p in parts]), sum(p.unranked for p in parts))


def volume_validation(
    settings: Mapping[str, Any], ops: pd.DataFrame, *, assumptions: str = "run", run: str | None = None
) -> pd.DataFrame:
    """Table-5.1-style comparison of one run (:data:`VOLUME_SCHEMA`).

    Per parallelism kind (dp, tp, pp, ep, cp, other and the rank's total), rank role and
    definition: theory and observed volume per rank over the run, their ratio and the
    operation group that contributes most to the difference, in words.
    """
    r, items = _theory(settings, assumptions, _world_hint(ops))
    return _validation_table(r, items, _Observed.of(ops, r), assumptions, run)


def volume_validation_of_file(settings: Mapping[str, Any], ops_path: Path | str, *, assumptions: str = "run",
                              run: str | None = None, batch_rows: int = 1 << 18) -> pd.DataFrame:  # fmt: skip
    """:func:`volume_validation` of an ops table on disk, read ``batch_rows`` rows at a time:
    memory holds one batch and the sums, whatever the run's size. Equal to the in-memory
    result up to the order of floating-point additions."""
    import pyarrow.parquet as pq

    from nccltrace.core.tables import read_table_batch

    pf = pq.ParquetFile(ops_path)
    cols = [c for c in OPS_COLUMNS if c in pf.schema_arrow.names]
    world_hint = None
    if "global_rank" in cols:
        top = _column_max(pf, "global_rank")
        world_hint = int(top) + 1 if top is not None else None
    r, items = _theory(settings, assumptions, world_hint)
    # one row group at a time (tables.iter_record_batches): buffers do not pile up over the file
    parts = [_Observed.of(read_table_batch(b), r) for b in iter_record_batches(ops_path, cols, batch_rows)]
    observed = _Observed.combine(parts) if parts else _Observed.of(read_table_batch(pf.schema_arrow.empty_table()), r)
    return _validation_table(r, items, observed, assumptions, run)


def _column_max(pf: Any, column: str) -> Any:
    """Largest value of a Parquet column from the row groups' statistics (no data read), or from
    the column itself when a row group has no statistics."""
    import pyarrow.compute as pc

    i = pf.schema_arrow.get_field_index(column)
    best = None
    for g in range(pf.metadata.num_row_groups):
        group = pf.metadata.row_group(g)
        st = group.column(i).statistics
        if st is not None and st.has_min_max:
            best = st.max if best is None else max(best, st.max)
        elif st is None or st.null_count != group.num_rows:  # not all null, yet no min/max: read it
            return pc.max(pf.read(columns=[column])[column]).as_py()
    return best


def _validation_table(r: _Run, items: pd.DataFrame, observed: _Observed, assumptions: str,
                      run: str | None) -> pd.DataFrame:  # fmt: skip
    unranked = observed.unranked
    ranks = _role_ranks(r)
    run = run if run is not None else r.run_id
    # observed groups per (kind, role, op, label, bytes per call), per-rank means
    grp = observed.groups.reset_index()
    n = grp["role"].map(ranks).astype("float64")
    for col in ("calls", "payload", "wire"):
        grp[col] = grp[col] / n
    per_rank, per_rank_total = observed.per_rank, observed.per_rank_total
    kinds = [k for k in KINDS if k in set(items.get("parallelism", [])) | set(grp["kind"])]
    rows = []
    for role in ranks:
        for kind in kinds + ["total"]:
            it = items[items["role"] == role] if not items.empty else items
            ob = grp[grp["role"] == role]
            if kind != "total":
                it = it[it["parallelism"] == kind] if not it.empty else it
                ob = ob[ob["kind"] == kind]
            if (it.empty or it["calls"].sum() == 0) and ob.empty:
                continue
            for d in DEFINITIONS:
                theory = float(it[d].sum()) if not it.empty else 0.0
                observed = float(ob[d].sum())
                if kind == "total":
                    pr = per_rank_total[d].xs(role, level="role") if role in per_rank_total.index.get_level_values(
                        "role") else pd.Series(dtype="float64")
                else:
                    try:
                        pr = per_rank[d].xs((kind, role), level=("kind", "role"))
                    except KeyError:
                        pr = pd.Series(dtype="float64")
                lo = float(pr.min()) if len(pr) == ranks[role] else 0.0
                hi = float(pr.max()) if len(pr) else 0.0
                text, dbytes = _dominant(it, ob[["op", "label", "bytes", "self_send", "calls", "payload", "wire"]], d)
                sources = list(dict.fromkeys(it["source_" + d])) if not it.empty and theory > 0 else []
                notes = list(dict.fromkeys(n for x in (it["notes"] if not it.empty else []) for n in x.split("; ")))
                if kind in _NO_THEORY and theory == 0:
                    notes.append(_NO_THEORY[kind])
                if unranked:
                    notes.append(f"{unranked} calls without a global rank left out")
                rows.append({
                    "run": run, "parallelism": kind, "role": role, "definition": d, "ranks": ranks[role],
                    "iterations": r.iterations, "theory_bytes": theory, "theory_bytes_per_iteration":
                    theory / r.iterations, "observed_bytes": observed, "observed_bytes_per_iteration":
                    observed / r.iterations, "observed_min_bytes": lo, "observed_max_bytes": hi,
                    "ratio": observed / theory if theory > 0 else np.nan, "dominant_discrepancy": text,
                    "dominant_discrepancy_bytes": dbytes if text else np.nan, "source": "; ".join(sources) or None,
                    "assumptions": assumptions, "notes": "; ".join(x for x in notes if x) or None,
                })  # fmt: skip
    table = pd.DataFrame(rows, columns=VOLUME_SCHEMA.names)
    return coerce_to_schema(table, VOLUME_SCHEMA).reset_index(drop=True)


def thesis_observed_bytes(ops: pd.DataFrame) -> pd.Series:
    """Per global rank, the volume as the thesis's "observed" column counts it (table 5.1, figures
    5.27-5.31): the ``bytes`` of every call line except Recv, single-rank calls included,
    duplicates excluded. Divided by 2^30 it reproduces the thesis's GB figures on the emulated
    thesis runs (DP 1.59, PP edge 2.50, TP 22.15, EP 13.03); it is neither payload (no Recv) nor
    wire (single-rank calls move nothing), which is why those ratios are not comparable."""
    c = ops
    if "row_kind" in c:
        c = c[c["row_kind"].astype("string").fillna("call") == "call"]
    if "duplicate_of" in c:
        c = c[c["duplicate_of"].isna()]
    c = c[c["op"].astype(str) != "Recv"]
    b = pd.to_numeric(c["bytes"], errors="coerce").fillna(0).astype("float64")
    return b.groupby(pd.to_numeric(c["global_rank"], errors="coerce")).sum().rename("bytes")


def campaign_volume_validation(per_run: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """The comparison tables of several runs stacked, ``run`` set to each mapping key."""
    parts = [coerce_to_schema(t, VOLUME_SCHEMA).assign(run=name) for name, t in per_run.items()]
    parts = [p for p in parts if len(p)]
    if not parts:
        return coerce_to_schema(pd.DataFrame(columns=VOLUME_SCHEMA.names), VOLUME_SCHEMA)
    return coerce_to_schema(pd.concat(parts, ignore_index=True), VOLUME_SCHEMA).reset_index(drop=True)


def write_volume_validation(table: pd.DataFrame, out_dir: Path | str) -> dict[str, Path]:
    """Write ``volume_validation.parquet`` (VOLUME_SCHEMA) and ``volume_validation.csv``, both via
    a temporary file renamed into place. Returns {'parquet': path, 'csv': path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = coerce_to_schema(table, VOLUME_SCHEMA)
    pq_path, csv_path = out / "volume_validation.parquet", out / "volume_validation.csv"
    write_table_atomic(frame_to_table(frame, VOLUME_SCHEMA), pq_path)
    with atomic_output(csv_path) as tmp:
        frame.to_csv(tmp, index=False)
    return {"parquet": pq_path, "csv": csv_path}
