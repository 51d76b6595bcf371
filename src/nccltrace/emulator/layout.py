"""The emulated run's Megatron-LM layout: :mod:`nccltrace.megatron.layout` for an
:class:`~.config.EmulatorConfig` (the groups and their creation order live there)."""

from __future__ import annotations

from nccltrace.emulator.config import EmulatorConfig
from nccltrace.megatron.groups import GROUP_KINDS, orthogonal_groups
from nccltrace.megatron.layout import Group, MegatronLayout, PairComm
from nccltrace.megatron.sizes import ParallelSizes

__all__ = ["GROUP_KINDS", "Group", "MegatronLayout", "PairComm", "layout_of", "orthogonal_groups", "sizes_of"]


def sizes_of(cfg: EmulatorConfig) -> ParallelSizes:
    """The parallel sizes (and node shape) of an emulator configuration."""
    return ParallelSizes(tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, etp=cfg.etp, vpp=cfg.vpp,
                         world_size=cfg.world_size, distributed_optimizer=cfg.distributed_optimizer,
                         gpus_per_node=cfg.gpus_per_node)  # fmt: skip


def layout_of(cfg: EmulatorConfig) -> MegatronLayout:
    """Every process group the emulated run creates, in creation order."""
    return MegatronLayout(sizes_of(cfg))
