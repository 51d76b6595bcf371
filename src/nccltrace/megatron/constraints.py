"""Megatron-LM's launch constraints: the one home of the rules a run's sizes and model shape
must obey (each rule once, with its message).

Megatron refuses a configuration (or silently changes it) when one of these fails; the rules
follow core_r0.13 (the thesis's version): ``parallel_state.initialize_model_parallel``,
``training/arguments.validate_args`` and the interleaved schedule's checks. They are checked
where a run is described: before a campaign queues anything
(:func:`nccltrace.acquisition.megatron.launch_problems`), by the emulator's config, by
:class:`~nccltrace.megatron.sizes.ParallelSizes` and by :class:`~nccltrace.megatron.model.ModelShape`.

Each caller describes what it knows as a :class:`LaunchShape`; a rule whose inputs are unknown
(None) is skipped, so the sizes alone are checked by the size rules and a full run by all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

__all__ = ["RULES", "SHARD_RULES", "LaunchShape", "Problem", "first_problem", "positive_problem", "problems"]


@dataclass(frozen=True)
class LaunchShape:
    """What a caller knows of a run: parallel sizes, model dimensions, batch sizes (None:
    unknown, the rules that need it are skipped). ``etp`` None means tp (Megatron's default);
    ``ffn_hidden_size`` is resolved (4 x hidden when the run does not set it);
    ``overlap_p2p`` is Megatron's resolved ``overlap_p2p_comm``."""

    world: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    dp: int | None = None  # declared data-parallel size (checked against the world size)
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    ffn_hidden_size: int | None = None
    padded_vocab_size: int | None = None
    seq_length: int | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    num_experts: int | None = None
    moe_router_topk: int | None = None
    precision: str | None = None
    sequence_parallel: bool | None = None
    overlap_p2p: bool | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def mp(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def data_parallel(self) -> int:
        """Megatron's dp (world / (tp*pp*cp)); only read by rules after the world rule held."""
        return int(self.world) // self.mp  # type: ignore[arg-type]


@dataclass(frozen=True)
class Problem:
    """One broken rule: the setting to change (``field``) and what is wrong and what to do."""

    rule: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class _Rule:
    name: str
    field: str
    needs: tuple[str, ...]  # LaunchShape fields that must be known
    check: Callable[[LaunchShape], str | None]  # the message when the rule is broken
    after: tuple[str, ...] = ()  # skipped when one of these rules is broken (same cause, or its input)
    fatal: bool = False  # nothing after it is checked when it is broken (the rest needs dp)


def _world_tiles(s: LaunchShape) -> str | None:
    if s.world % s.mp:  # type: ignore[operator]
        return (f"world size {s.world} is not divisible by tp*pp*cp = {s.tp}*{s.pp}*{s.cp} = {s.mp}; Megatron "
                "needs a whole dp = world / (tp*pp*cp): change the parallel sizes or the number of GPUs")
    return None


def _dp_matches(s: LaunchShape) -> str | None:
    if s.dp != s.data_parallel:
        return f"dp={s.dp} does not match world size {s.world} / (tp*pp*cp = {s.mp}) = {s.data_parallel}"
    return None


def _expert_grid(s: LaunchShape) -> str | None:
    emp = s.expert_tp * s.ep * s.pp
    if s.world % emp:  # type: ignore[operator]
        return (f"world size {s.world} is not divisible by etp*ep*pp = {s.expert_tp}*{s.ep}*{s.pp} = {emp} "
                "(Megatron's expert grid: expert parallelism is carved out of dp*cp*tp); change ep or the number "
                "of GPUs")
    return None


def _ep_needs_moe(s: LaunchShape) -> str | None:
    if s.ep > 1 and not s.moe:
        return "expert parallelism needs a MoE model: set num_experts > 0 or ep = 1"
    return None


def _experts_by_ep(s: LaunchShape) -> str | None:
    if s.moe and s.num_experts % s.ep:  # type: ignore[operator]
        return f"num_experts ({s.num_experts}) must be divisible by ep ({s.ep}); use an ep that divides them"
    return None


def _moe_bf16(s: LaunchShape) -> str | None:
    if s.moe and s.precision != "bf16":
        return f"MoE with grouped GEMM needs bf16 (got {s.precision}; thesis 5.2.1); set precision: bf16"
    return None


def _router_topk(s: LaunchShape) -> str | None:
    if s.moe and not 1 <= s.moe_router_topk <= s.num_experts:  # type: ignore[operator]
        return f"must be in 1..num_experts ({s.num_experts})"
    return None


def _ep_tp_needs_sp(s: LaunchShape) -> str | None:
    if s.moe and (s.tp > 1 or s.expert_tp > 1) and s.ep > 1 and not s.sequence_parallel:
        return "Megatron needs sequence parallelism when combining expert and tensor parallelism"
    return None


def _sp_needs_tp(s: LaunchShape) -> str | None:
    if s.sequence_parallel and s.tp == 1:
        return "sequence parallelism needs tp > 1 (Megatron would silently turn it off); set sequence_parallel: false"
    return None


def _vpp_needs_pp(s: LaunchShape) -> str | None:
    if s.vpp > 1 and s.pp == 1:
        return "virtual pipeline stages (the interleaved schedule, vpp > 1) need pp > 1"
    return None


def _vpp_without_overlap(s: LaunchShape) -> str | None:
    if s.vpp > 1 and s.overlap_p2p is False and s.pp <= 2:
        return "without p2p overlap the interleaved schedule needs pp > 2"
    return None


def _heads_by_tp(s: LaunchShape) -> str | None:
    if s.num_attention_heads % s.tp:  # type: ignore[operator]
        return f"{s.num_attention_heads} heads are not divisible by tp={s.tp}"
    return None


def _hidden_by_heads(s: LaunchShape) -> str | None:
    if s.hidden_size % s.num_attention_heads:  # type: ignore[operator]
        return f"{s.hidden_size} is not divisible by num_attention_heads={s.num_attention_heads}"
    return None


def _split_over_tp(name: str) -> Callable[[LaunchShape], str | None]:
    def check(s: LaunchShape) -> str | None:
        value = getattr(s, name)
        return f"{value} is not divisible by tp={s.tp} (split over tensor parallelism)" if value % s.tp else None

    return check


def _ffn_by_etp(s: LaunchShape) -> str | None:
    if s.moe and s.ffn_hidden_size % s.expert_tp:  # type: ignore[operator]
        return f"ffn hidden size {s.ffn_hidden_size} is not divisible by etp={s.expert_tp}"
    return None


def _layers_by_pp(s: LaunchShape) -> str | None:
    if s.num_layers % s.pp:  # type: ignore[operator]
        return f"{s.num_layers} layers are not divisible by pp={s.pp}"
    return None


def _layers_by_chunks(s: LaunchShape) -> str | None:
    if s.num_layers % (s.pp * s.vpp):  # type: ignore[operator]
        return (f"{s.num_layers} layers cannot be split into pp*vpp = {s.pp}*{s.vpp} = {s.pp * s.vpp} equal model "
                "chunks (--num-layers-per-virtual-pipeline-stage must be a whole number)")
    return None


def _seq_by_cp(s: LaunchShape) -> str | None:
    if s.cp > 1 and s.seq_length % (2 * s.cp):  # type: ignore[operator]
        return f"context parallelism needs seq_length divisible by 2*cp = {2 * s.cp}"
    return None


def _seq_by_sp(s: LaunchShape) -> str | None:
    if s.sequence_parallel and (s.seq_length // s.cp) % s.tp:  # type: ignore[operator]
        return "with sequence parallelism seq_length/cp must be divisible by tp"
    return None


def _batch_by_dp(s: LaunchShape) -> str | None:
    if s.global_batch_size % (s.micro_batch_size * s.data_parallel):  # type: ignore[operator]
        return (f"{s.global_batch_size} is not divisible by micro_batch_size*dp = "
                f"{s.micro_batch_size}*{s.data_parallel}")
    return None


def _interleaved_microbatches(s: LaunchShape) -> str | None:
    m = s.global_batch_size // (s.micro_batch_size * s.data_parallel)  # type: ignore[operator]
    if s.vpp > 1 and (m < s.pp or m % s.pp):
        return f"the interleaved schedule needs the number of microbatches ({m}) to be a multiple of pp ({s.pp})"
    return None


_MODEL = ("num_experts",)
_BATCH = ("world", "micro_batch_size", "global_batch_size")

RULES: tuple[_Rule, ...] = (
    _Rule("world_tiles", "tp", ("world",), _world_tiles, fatal=True),
    _Rule("dp_matches", "dp", ("world", "dp"), _dp_matches),
    _Rule("expert_grid", "ep", ("world",), _expert_grid),
    _Rule("ep_needs_moe", "ep", _MODEL, _ep_needs_moe),
    _Rule("experts_by_ep", "num_experts", _MODEL, _experts_by_ep),
    _Rule("moe_bf16", "precision", ("num_experts", "precision"), _moe_bf16),
    _Rule("router_topk", "moe_router_topk", ("num_experts", "moe_router_topk"), _router_topk),
    _Rule("ep_tp_needs_sp", "sequence_parallel", ("num_experts", "sequence_parallel"), _ep_tp_needs_sp),
    _Rule("sp_needs_tp", "sequence_parallel", ("sequence_parallel",), _sp_needs_tp),
    _Rule("vpp_needs_pp", "vpp", (), _vpp_needs_pp),
    _Rule("vpp_without_overlap", "overlap_p2p_comm", ("overlap_p2p",), _vpp_without_overlap, after=("vpp_needs_pp",)),
    _Rule("heads_by_tp", "num_attention_heads", ("num_attention_heads",), _heads_by_tp),
    _Rule("hidden_by_heads", "hidden_size", ("hidden_size", "num_attention_heads"), _hidden_by_heads),
    _Rule("hidden_by_tp", "hidden_size", ("hidden_size",), _split_over_tp("hidden_size"),
          after=("heads_by_tp", "hidden_by_heads")),
    _Rule("ffn_by_tp", "ffn_hidden_size", ("ffn_hidden_size",), _split_over_tp("ffn_hidden_size")),
    _Rule("vocab_by_tp", "padded_vocab_size", ("padded_vocab_size",), _split_over_tp("padded_vocab_size")),
    _Rule("ffn_by_etp", "etp", ("ffn_hidden_size", "num_experts"), _ffn_by_etp),
    _Rule("layers_by_pp", "num_layers", ("num_layers",), _layers_by_pp),
    _Rule("layers_by_chunks", "vpp", ("num_layers",), _layers_by_chunks, after=("layers_by_pp", "vpp_needs_pp")),
    _Rule("seq_by_cp", "seq_length", ("seq_length",), _seq_by_cp),
    _Rule("seq_by_sp", "seq_length", ("seq_length", "sequence_parallel"), _seq_by_sp, after=("sp_needs_tp",)),
    _Rule("batch_by_dp", "global_batch_size", _BATCH, _batch_by_dp),
    _Rule("interleaved_microbatches", "global_batch_size", _BATCH, _interleaved_microbatches,
          after=("batch_by_dp", "vpp_needs_pp")),
)
"""Every rule, in the order they are checked (the first broken one is what a caller raises)."""

SHARD_RULES = ("hidden_by_tp", "ffn_by_tp", "vocab_by_tp", "experts_by_ep", "ffn_by_etp", "layers_by_pp",
               "layers_by_chunks")  # fmt: skip
"""The rules that make a model's per-rank shards whole (what the parameter layout needs)."""


def problems(shape: LaunchShape, rules: Iterable[str] | None = None) -> Iterator[Problem]:
    """The rules ``shape`` breaks, in :data:`RULES` order (``rules``: only these, by name).

    A rule whose inputs are unknown is skipped, as is one whose cause an earlier broken rule
    already names (``after``); nothing is checked after a broken world rule (the rest needs dp).
    """
    chosen = None if rules is None else frozenset(rules)
    broken: set[str] = set()
    for rule in RULES:
        if chosen is not None and rule.name not in chosen:
            continue
        if broken.intersection(rule.after) or any(getattr(shape, n) is None for n in rule.needs):
            continue
        message = rule.check(shape)
        if message is None:
            continue
        broken.add(rule.name)
        yield Problem(rule.name, rule.field, message)
        if rule.fatal:
            return


def first_problem(shape: LaunchShape, rules: Iterable[str] | None = None) -> Problem | None:
    """The first rule ``shape`` breaks (None: Megatron accepts it)."""
    return next(problems(shape, rules), None)


def positive_problem(value: object, *, optional: bool = False) -> str | None:
    """Why ``value`` is not a positive integer (a size, a dimension), or None when it is
    (``optional``: None is allowed too). Booleans are not integers here."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"must be a positive integer{' (or omitted)' if optional else ''}, got {value!r}"
    return None
