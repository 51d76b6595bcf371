"""The parallel sizes of a Megatron-LM job: the one sizes class of nccltrace.

:class:`ParallelSizes` is what a run declares (or what the layout inference finds): it is read
from run settings of any origin, validated with Megatron's divisibility rules, and gives the
rank grids :mod:`.groups` generates the process groups from and the :mod:`.layout` of a run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nccltrace.core.errors import ConfigError
from nccltrace.core.settings import declares_sizes, declares_world, flatten_settings
from nccltrace.megatron.constraints import LaunchShape, first_problem, positive_problem

# declares_sizes, declares_world and flatten_settings live in core.settings (the one reading of
# run settings); they are re-exported here for the readers of the sizes.
__all__ = ["ParallelSizes", "declares_sizes", "declares_world", "flatten_settings"]


def _int(settings: Mapping[str, Any], *names: str) -> int | None:
    """The first of ``names`` set in ``settings`` as an integer (None if none is set)."""
    for n in names:
        v = settings.get(n)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ConfigError(n, f"expected an integer, got {v!r}")
        try:
            f = float(v)
        except ValueError:
            raise ConfigError(n, f"expected an integer, got {v!r}") from None
        if not f.is_integer():
            raise ConfigError(n, f"expected an integer, got {v!r}")
        return int(f)
    return None


def _bool(settings: Mapping[str, Any], *names: str) -> bool:
    """The first of ``names`` set in ``settings`` as a flag (strings like 'true'/'1' count)."""
    for n in names:
        v = settings.get(n)
        if v is None:
            continue
        if isinstance(v, str):
            return v.strip().lower() in ("1", "true", "yes", "on")
        return bool(v)
    return False


@dataclass(frozen=True)
class ParallelSizes:
    """Parallel sizes of a Megatron-LM run.

    ``world_size`` or ``dp`` must be given (the other is derived: dp = world / (tp·pp·cp)).
    ``etp`` defaults to ``tp`` (Megatron's default); expert dp = world / (etp·ep·pp). Invalid
    combinations raise :class:`~nccltrace.core.errors.ConfigError` (a ``ValueError``) naming the
    field. ``gpus_per_node`` only places ranks on nodes (None: unknown).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    dp: int | None = None
    world_size: int | None = None
    distributed_optimizer: bool = False
    gpus_per_node: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "vpp", "etp", "dp", "world_size", "gpus_per_node"):
            why = positive_problem(getattr(self, name), optional=name in ("etp", "dp", "world_size", "gpus_per_node"))
            if why:
                raise ConfigError(name, why)
        world, dp = self.world_size, self.dp
        if world is None and dp is None:
            raise ConfigError("world_size", "give the world size (or nodes and gpus_per_node) or dp")
        if world is None:
            world = dp * self.tp * self.pp * self.cp
        problem = first_problem(LaunchShape(world=world, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.etp,
                                            vpp=self.vpp, dp=dp))  # fmt: skip
        if problem is not None:
            raise ConfigError(problem.field, problem.message)
        mp = self.tp * self.pp * self.cp
        # Both are set from here on: readers may take world_size and dp as ints.
        object.__setattr__(self, "world_size", world)
        object.__setattr__(self, "dp", world // mp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: world / (etp * ep * pp)."""
        return int(self.world_size) // (self.expert_tp * self.ep * self.pp)

    def decoder_grid(self) -> dict[str, int]:
        """Token -> size of the decoder rank grid (tp, cp, ep = 1, dp, pp)."""
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": int(self.dp), "pp": self.pp}

    def expert_grid(self) -> dict[str, int]:
        """Token -> size of the expert rank grid (etp, cp = 1, ep, edp, pp)."""
        return {"tp": self.expert_tp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> ParallelSizes:
        """Sizes from run settings: an emulator config dict, a campaign run's settings, a
        ``run.yaml`` mapping (``config`` + ``derived``), or Megatron argument names
        (``tensor_model_parallel_size``, ...). Unrelated keys are ignored."""
        s = flatten_settings(settings)
        world = _int(s, "world_size", "world")
        nodes, gpn = _int(s, "nodes", "num_nodes"), _int(s, "gpus_per_node", "nproc_per_node")
        if nodes is not None and gpn is not None:
            if world is not None and world != nodes * gpn:
                raise ConfigError("world_size", f"world_size={world} but nodes*gpus_per_node = {nodes}*{gpn}")
            world = nodes * gpn
        return cls(
            tp=_int(s, "tp", "tensor_model_parallel_size") or 1,
            pp=_int(s, "pp", "pipeline_model_parallel_size") or 1,
            cp=_int(s, "cp", "context_parallel_size") or 1,
            ep=_int(s, "ep", "expert_model_parallel_size") or 1,
            etp=_int(s, "etp", "expert_tp", "expert_tensor_parallel_size"),
            vpp=_int(s, "vpp", "virtual_pipeline_model_parallel_size") or 1,
            dp=_int(s, "dp", "data_parallel_size"),
            world_size=world,
            distributed_optimizer=_bool(s, "distributed_optimizer", "use_distributed_optimizer"),
            gpus_per_node=gpn,
        )
