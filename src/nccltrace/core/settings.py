"""Typed run settings: the one reading of a run's settings, built and validated once.

A run's settings come from a campaign (the matrix's expanded run), from ``run.yaml`` (``config``
and ``derived`` sections) or from ``nccltrace analyze``'s options. :class:`RunSettings` reads
them once: the parallel sizes, the cluster shape, the model facts and the capture window become
typed, validated fields, and a bad value fails here, naming the field, the value and what is
expected, instead of deep in a stage. The stages receive a :class:`RunSettings` and pass it on.

It is also a read-only mapping of the settings as given (flat), so the manifests record them
byte for byte as before (:meth:`RunSettings.to_mapping`) and readers of Megatron's own argument
names (``tensor_model_parallel_size``, ...) or of settings no field covers still find them.

Nesting has one precedence (:func:`flatten_settings`): top level over ``config`` over
``derived``; whether a null hides a lower level's value is the reader's choice (``skip_none``):
the recorded settings keep it, the model facts do not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from nccltrace.core.capture_window import CaptureWindow
from nccltrace.core.errors import ConfigError

__all__ = [
    "NESTED_SECTIONS",
    "RunSettings",
    "declares_sizes",
    "declares_world",
    "flatten_settings",
]

# run.yaml's sections, lowest precedence last: the declared configuration, then what was derived.
NESTED_SECTIONS = ("config", "derived")

# Keys that say something about the parallel sizes / give the world size (Megatron names too).
SIZE_KEYS = ("tp", "pp", "cp", "ep", "etp", "dp", "tensor_model_parallel_size", "pipeline_model_parallel_size",
             "context_parallel_size", "expert_model_parallel_size")
WORLD_KEYS = ("world_size", "world", "dp", "data_parallel_size")


def flatten_settings(settings: Mapping[str, Any], *, skip_none: bool = False) -> dict[str, Any]:
    """A flat or run.yaml-like mapping (``config`` and ``derived`` nested) as one flat mapping:
    top level over config over derived. ``skip_none``: a null never hides a value from a lower
    level. The one reading of run settings' nesting; a flat mapping comes back as it is (same
    keys, same order)."""
    flat: dict[str, Any] = {}
    for part in (settings.get("derived"), settings.get("config"), settings):
        if isinstance(part, Mapping):
            flat.update({k: v for k, v in part.items()
                         if k not in NESTED_SECTIONS and not (skip_none and v is None)})  # fmt: skip
    return flat


def declares_world(settings: Mapping[str, Any]) -> bool:
    """Whether flat run settings give the world size (directly, through dp, or as nodes times
    GPUs per node): what the parallel sizes need besides tp, pp, cp."""
    return any(settings.get(k) is not None for k in WORLD_KEYS) or (
        settings.get("nodes") is not None and settings.get("gpus_per_node") is not None)


def declares_sizes(settings: Mapping[str, Any] | None) -> bool:
    """Whether run settings say anything about the parallel sizes (top level, or nested under
    ``config``/``derived`` as in run.yaml)."""
    if not settings:
        return False
    parts = [settings, *(settings.get(k) for k in NESTED_SECTIONS if isinstance(settings.get(k), Mapping))]
    return any(k in part for part in parts for k in SIZE_KEYS)


# Typed field -> the setting names it is read from, first set wins (Megatron's argument names after ours).
_INT_FIELDS: dict[str, tuple[str, ...]] = {
    "tp": ("tp", "tensor_model_parallel_size"),
    "pp": ("pp", "pipeline_model_parallel_size"),
    "cp": ("cp", "context_parallel_size"),
    "ep": ("ep", "expert_model_parallel_size"),
    "etp": ("etp", "expert_tp", "expert_tensor_parallel_size"),
    "vpp": ("vpp", "virtual_pipeline_model_parallel_size"),
    "dp": ("dp", "data_parallel_size"),
    "world_size": ("world_size", "world"),
    "nodes": ("nodes", "num_nodes"),
    "gpus_per_node": ("gpus_per_node", "nproc_per_node"),
    "num_layers": ("num_layers",),
    "hidden_size": ("hidden_size",),
    "num_attention_heads": ("num_attention_heads",),
    "seq_length": ("seq_length",),
    "vocab_size": ("vocab_size",),
    "micro_batch_size": ("micro_batch_size",),
    "global_batch_size": ("global_batch_size",),
    "iterations": ("iterations",),
    "num_experts": ("num_experts",),
}
_ZERO_ALLOWED = ("num_experts",)  # a dense model has 0 experts
_BOOL_FIELDS: dict[str, tuple[str, ...]] = {
    "sequence_parallel": ("sequence_parallel",),
    "distributed_optimizer": ("distributed_optimizer", "use_distributed_optimizer"),
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _int_setting(flat: Mapping[str, Any], name: str, keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` set in ``flat`` as an integer (None if none is set)."""
    for key in keys:
        v = flat.get(key)
        if v is None:
            continue
        least = 0 if name in _ZERO_ALLOWED else 1
        what = "a non-negative integer" if least == 0 else "a positive integer"
        try:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)) or not float(v).is_integer():
                raise ValueError
            n = int(float(v))
        except ValueError:
            raise ConfigError(key, f"expected {what}, got {v!r}") from None
        if n < least:
            raise ConfigError(key, f"expected {what}, got {v!r}")
        return n
    return None


def _bool_setting(flat: Mapping[str, Any], keys: tuple[str, ...]) -> bool:
    """The first of ``keys`` set in ``flat`` as a flag (strings like 'true'/'1' count)."""
    for key in keys:
        v = flat.get(key)
        if v is None:
            continue
        if isinstance(v, str):
            if v.strip().lower() not in (*_TRUE, *_FALSE):
                raise ConfigError(key, f"expected true or false, got {v!r}")
            return v.strip().lower() in _TRUE
        if not isinstance(v, (bool, int)):
            raise ConfigError(key, f"expected true or false, got {v!r}")
        return bool(v)
    return False


def _str_setting(flat: Mapping[str, Any], key: str) -> str | None:
    v = flat.get(key)
    if v is None:
        return None
    if not isinstance(v, (str, int)) or isinstance(v, bool):
        raise ConfigError(key, f"expected a name, got {v!r}")
    return str(v)


@dataclass(frozen=True, eq=False)
class RunSettings(Mapping[str, Any]):
    """A run's settings, read and validated once (see the module docstring).

    Typed fields: the declared parallel sizes (None or Megatron's default where not declared),
    the cluster shape, the model facts the volume stage needs, the capture window. As a mapping
    it is the flat settings as given. Build it with :meth:`from_mapping` (or :meth:`of`); the
    Megatron rules that relate the sizes (divisibility, dp = world / tp·pp·cp) are checked where
    the sizes are used, by ``nccltrace.megatron``.
    """

    values: Mapping[str, Any] = field(default_factory=dict, repr=False)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    dp: int | None = None
    world_size: int | None = None  # declared (world_size, or nodes * gpus_per_node); None: not declared
    nodes: int | None = None
    gpus_per_node: int | None = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    seq_length: int | None = None
    vocab_size: int | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    iterations: int | None = None
    num_experts: int = 0
    precision: str | None = None
    model: str | None = None
    run_id: str | None = None
    capture: CaptureWindow | None = None

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any] | None) -> RunSettings:
        """Settings from a flat or run.yaml-like mapping (``config``/``derived`` nested: read with
        :func:`flatten_settings`). Raises :class:`~nccltrace.core.errors.ConfigError` (a
        ``ValueError``) naming the setting, its value and what is expected."""
        flat = flatten_settings(settings or {})  # recorded as given, nulls included
        known = flatten_settings(settings or {}, skip_none=True)  # a null hides no lower level's value
        ints = {name: _int_setting(known, name, keys) for name, keys in _INT_FIELDS.items()}
        world, nodes, gpn = ints["world_size"], ints["nodes"], ints["gpus_per_node"]
        if nodes is not None and gpn is not None:
            if world is not None and world != nodes * gpn:
                raise ConfigError("world_size", f"world_size={world} but nodes*gpus_per_node = {nodes}*{gpn}; "
                                                "give one of them, or make them agree")
            ints["world_size"] = nodes * gpn
        for name in ("tp", "pp", "cp", "ep", "vpp"):
            ints[name] = ints[name] or 1
        ints["num_experts"] = ints["num_experts"] or 0
        precision = _str_setting(known, "precision")
        if precision is not None and precision not in ("fp16", "bf16", "fp32"):
            raise ConfigError("precision", f"expected one of fp16, bf16, fp32, got {precision!r}")
        # The capture window as every stage reads it (same defaults as the campaign's check).
        capture = CaptureWindow.of_settings(known) if known.get("capture") else None
        return cls(MappingProxyType(flat), **ints,
                   **{name: _bool_setting(known, keys) for name, keys in _BOOL_FIELDS.items()},
                   precision=precision, model=_str_setting(known, "model") or _str_setting(known, "name"),
                   run_id=_str_setting(known, "run_id"), capture=capture)  # fmt: skip

    @classmethod
    def of(cls, settings: RunSettings | Mapping[str, Any] | None) -> RunSettings | None:
        """``settings`` as :class:`RunSettings` (built when given as a mapping; None stays None):
        for the entry points that take settings from a caller outside the analysis."""
        if settings is None or isinstance(settings, RunSettings):
            return settings
        return cls.from_mapping(settings)

    def to_mapping(self) -> dict[str, Any]:
        """The flat settings as given (what manifests and the analysis summary record)."""
        return dict(self.values)

    def with_world_size(self, world_size: int) -> RunSettings:
        """These settings with ``world_size`` set (the world communicator's size, when the
        settings declare none); the recorded mapping gets it too."""
        values = dict(self.values)
        values["world_size"] = int(world_size)
        return replace(self, values=MappingProxyType(values), world_size=int(world_size))

    @property
    def declares_world(self) -> bool:
        """Whether the settings give the world size (directly, through dp, or as nodes times GPUs per node)."""
        return declares_world(self.values)

    @property
    def declares_sizes(self) -> bool:
        """Whether the settings say anything about the parallel sizes."""
        return declares_sizes(self.values)

    # The mapping of the settings as given.
    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return f"RunSettings({dict(self.values)!r})"
