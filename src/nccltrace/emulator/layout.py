"""Megatron-LM rank layout: every process group Megatron creates, in creation order.

Source: NVIDIA/Megatron-LM core_r0.13 (commit 73a28a1) ``megatron/core/parallel_state.py``,
``initialize_model_parallel`` with the default order ``tp-cp-ep-dp-pp``:

* Two rank generators: the *decoder* generator has sizes (tp, cp, ep=1, dp, pp) and the
  *expert* generator (etp, cp=1, ep, edp, pp), with dp = world/(tp*cp*pp) and
  edp = world/(etp*ep*pp). Dimension order lists the fastest-varying index first, so
  ``rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank))``.
* A group of type ``a-b`` holds the ranks that differ only in the ``a`` and ``b`` coordinates
  (``RankGenerator.get_ranks`` / ``generate_masked_orthogonal_rank_groups``).
* Creation order (the order every rank calls ``torch.distributed.new_group``): dp-cp, dp, cp,
  tp-pp (the "model parallel" group), tp, then for each pp group: pp, embedding,
  position-embedding; tp-dp-cp, tp-dp, tp-cp; expert ep, expert tp, expert tp-ep, expert
  tp-ep-pp, expert dp; the intra-distributed-optimizer-instance group. PyTorch's default
  (world) group exists before all of them (``init_process_group``).
* Embedding group of a pipeline: its first and last rank (one rank when pp = 1); position
  embedding group: its first rank (``default_embedding_ranks``/``default_position_embedding_ranks``).

PyTorch sorts the ranks passed to ``new_group``, so a rank's NCCL rank in a communicator is its
position in the sorted member list. Global rank -> node is ``rank // gpus_per_node`` (torchrun
fills nodes with consecutive ranks).

Not modelled: encoder pipelines, hierarchical CP groups, multiple distributed-optimizer instances,
gloo groups (they create no NCCL communicators).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

import numpy as np

from ..megatron.groups import GROUP_KINDS, orthogonal_groups
from .config import EmulatorConfig

__all__ = ["Group", "PairComm", "MegatronLayout", "orthogonal_groups", "GROUP_KINDS"]

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
    """All process groups of a run and per-rank coordinates."""

    def __init__(self, cfg: EmulatorConfig) -> None:
        self.cfg = cfg
        self.world = cfg.world_size
        self.tp, self.cp, self.dp, self.pp = cfg.tp, cfg.cp, cfg.dp, cfg.pp
        self.etp, self.ep, self.edp = cfg.expert_tp, cfg.ep, cfg.expert_dp
        self.gpus_per_node = cfg.gpus_per_node
        self._dec_sizes = [self.tp, self.cp, 1, self.dp, self.pp]
        self._exp_sizes = [self.etp, 1, self.ep, self.edp, self.pp]
        self._tokens = ["tp", "cp", "ep", "dp", "pp"]

    # ------------------------------------------------------------------ groups
    def _gen(self, token: str, expert: bool = False) -> list[list[int]]:
        want = set(token.split("-"))
        mask = [t in want for t in self._tokens]
        return orthogonal_groups(self._exp_sizes if expert else self._dec_sizes, mask)

    @cached_property
    def groups(self) -> list[Group]:
        """Every group, in the order the ranks create them (world first)."""
        out: list[Group] = []
        counters: dict[str, int] = {}

        def add(kind: str, ranks) -> None:
            idx = counters.get(kind, 0)
            counters[kind] = idx + 1
            out.append(Group(kind, idx, len(out), tuple(sorted(int(r) for r in ranks))))

        add("world", range(self.world))
        for r in self._gen("dp-cp"):
            add("dp-cp", r)
        for r in self._gen("dp"):
            add("dp", r)
        for r in self._gen("cp"):
            add("cp", r)
        for r in self._gen("tp-pp"):
            add("mp", r)
        for r in self._gen("tp"):
            add("tp", r)
        for r in self._gen("pp"):
            add("pp", r)
            add("embd", [r[0]] if len(r) == 1 else [r[0], r[-1]])
            add("pos-embd", [r[0]])
        for r in self._gen("tp-dp-cp"):
            add("tp-dp-cp", r)
        for r in self._gen("tp-dp"):
            add("tp-dp", r)
        for r in self._gen("tp-cp"):
            add("tp-cp", r)
        for r in self._gen("ep", True):
            add("ep", r)
        for r in self._gen("tp", True):
            add("etp", r)
        for r in self._gen("tp-ep", True):
            add("tp-ep", r)
        tep = self._gen("tp-ep-pp", True)
        for r in tep:
            add("tp-ep-pp", r)
        for r in self._gen("dp", True):
            add("edp", r)
        # One distributed-optimizer instance: the concatenation of every edp-th tp-ep-pp group.
        per = self.edp
        for i in range(0, len(tep), per):
            add("intra-distopt", [x for g in tep[i : i + per] for x in g])
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
