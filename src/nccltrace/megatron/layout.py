"""Megatron-LM rank layout: every process group Megatron creates, in creation order, and where
each rank sits (coordinates, pipeline stage, node).

Member sets come from :mod:`.groups`; the order of creation (``initialize_model_parallel`` of
core_r0.13) matters because eager splits happen in it, and a rank's NCCL rank in a communicator
is its position in the sorted member list (PyTorch sorts ``new_group``'s ranks). The creation
order, the node mapping and what is not modelled: ``docs/emulator.md`` section 1.2.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from nccltrace.megatron.groups import GROUP_KINDS, KIND_ORDER, megatron_groups
from nccltrace.megatron.sizes import ParallelSizes

__all__ = ["Group", "MegatronLayout", "PairComm", "megatron_layout"]


@dataclass(frozen=True)
class Group:
    """A Megatron/PyTorch process group. ``ranks`` are sorted global ranks (NCCL rank = index)."""

    kind: str
    index: int  # index among groups of this kind, in creation order
    order: int  # creation order among all groups (0 = world); also the communicator uid
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def uid(self) -> int:
        return self.order

    @property
    def desc(self) -> str:
        return GROUP_KINDS[self.kind]

    def rank_of(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


@dataclass(frozen=True)
class PairComm:
    """The two-rank NCCL communicator PyTorch creates for an un-coalesced isend/irecv between
    two ranks of a process group (``ProcessGroupNCCL::pointToPoint``: key = "low:high")."""

    parent: Group
    low: int  # global ranks
    high: int

    @property
    def kind(self) -> str:
        return f"p2p:{self.parent.kind}"

    @property
    def ranks(self) -> tuple[int, int]:
        return (self.low, self.high)

    @property
    def size(self) -> int:
        return 2

    @property
    def uid(self) -> int:
        return (1 << 62) | (self.parent.order << 32) | (self.low << 16) | self.high

    @property
    def index(self) -> int:
        return self.parent.index

    def rank_of(self, global_rank: int) -> int:
        return 0 if global_rank == self.low else 1


class MegatronLayout:
    """All process groups of a run (for :class:`~.sizes.ParallelSizes`) and per-rank coordinates."""

    def __init__(self, sizes: ParallelSizes) -> None:
        self.sizes = sizes
        self.world = int(sizes.world_size)
        self.tp, self.cp, self.dp, self.pp = sizes.tp, sizes.cp, int(sizes.dp), sizes.pp
        self.etp, self.ep, self.edp = sizes.expert_tp, sizes.ep, sizes.expert_dp
        # Without a node shape that fits the world (unknown, or declared inconsistently) all ranks
        # are taken to share one node: only node-level questions depend on it, never the groups.
        gpn = sizes.gpus_per_node
        self.gpus_per_node = gpn if gpn and self.world % gpn == 0 else self.world

    # ------------------------------------------------------------------ groups
    @cached_property
    def groups(self) -> list[Group]:
        """Every group, in the order the ranks create them (world first).

        Member sets and kind order come from :func:`.groups.megatron_groups`; Megatron creates a
        pipeline group's embedding and position-embedding groups right after it, so they are
        interleaved here. ``order`` counts in this sequence (the emulator writes it as the
        communicator uid, so it must not change)."""
        gen = megatron_groups(self.sizes)
        out: list[Group] = []
        counters: dict[str, int] = {}

        def add(kind: str, ranks: list[int]) -> None:
            idx = counters.get(kind, 0)
            counters[kind] = idx + 1
            out.append(Group(kind, idx, len(out), tuple(ranks)))

        for kind in KIND_ORDER:
            if kind in ("embd", "pos-embd"):
                continue  # created with their pipeline group
            for i, ranks in enumerate(gen[kind]):
                add(kind, ranks)
                if kind == "pp":
                    add("embd", gen["embd"][i])
                    add("pos-embd", gen["pos-embd"][i])
        return out

    @cached_property
    def by_kind(self) -> dict[str, list[Group]]:
        d: dict[str, list[Group]] = {}
        for g in self.groups:
            d.setdefault(g.kind, []).append(g)
        return d

    @cached_property
    def _member_index(self) -> dict[str, np.ndarray]:
        """kind -> array[world] of the group index containing each rank (-1 if none)."""
        out = {}
        for kind, gs in self.by_kind.items():
            arr = np.full(self.world, -1, dtype=np.int64)
            for g in gs:
                arr[list(g.ranks)] = g.index
            out[kind] = arr
        return out

    def group_of(self, kind: str, rank: int) -> Group | None:
        """The group of ``kind`` that ``rank`` belongs to (None if it is in none, e.g. embd)."""
        idx = int(self._member_index[kind][rank])
        return None if idx < 0 else self.by_kind[kind][idx]

    def groups_of(self, rank: int) -> Iterator[Group]:
        """Groups containing ``rank``, in creation order."""
        for g in self.groups:
            if rank in g.ranks:
                yield g

    def pair(self, parent: Group, a: int, b: int) -> PairComm:
        lo, hi = (a, b) if a <= b else (b, a)
        return PairComm(parent, lo, hi)

    @cached_property
    def comm_by_uid(self) -> dict[int, Group]:
        return {g.uid: g for g in self.groups}

    # ------------------------------------------------------------------ coordinates
    def coords(self, rank: int) -> dict[str, int]:
        """Decoder and expert coordinates of a global rank."""
        r = rank
        tp_r = r % self.tp
        r //= self.tp
        cp_r = r % self.cp
        r //= self.cp
        dp_r = r % self.dp
        pp_r = r // self.dp
        e = rank
        etp_r = e % self.etp
        e //= self.etp
        ep_r = e % self.ep
        e //= self.ep
        edp_r = e % self.edp
        return {"tp": tp_r, "cp": cp_r, "dp": dp_r, "pp": pp_r, "etp": etp_r, "ep": ep_r, "edp": edp_r}

    def pp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.cp * self.dp)

    def stage_representative(self, stage: int) -> int:
        """The rank with tp = cp = dp = 0 in pipeline stage ``stage`` (all stage reps share the
        same pp, world, mp and embedding groups)."""
        return stage * self.tp * self.cp * self.dp

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def nodes_of(self, ranks) -> int:
        """Number of distinct nodes the ranks live on."""
        return len({r // self.gpus_per_node for r in ranks})

    def stages_of(self, ranks) -> tuple[int, ...]:
        return tuple(sorted({self.pp_rank(r) for r in ranks}))


@lru_cache(maxsize=32)
def megatron_layout(sizes: ParallelSizes) -> MegatronLayout:
    """Megatron's groups for ``sizes``, built once per sizes: labelling asks for the layout of
    the same sizes once per communicator. A function here, not a method of the sizes, so that
    the sizes need not import the layout built on them."""
    return MegatronLayout(sizes)
