"""Per-rank NCCL operation schedule of a Megatron-LM (core_r0.13) GPT pretraining run.

:class:`RankProgram` replays, for one global rank, every NCCL call the real training script
issues, in program order, as a generator of :class:`Unit` objects (one NCCL *kernel plan*: a
single call, or the calls between one ``ncclGroupStart``/``ncclGroupEnd``), each holding its
:class:`Op` records; memory is one unit at a time. What is modelled, the message-size formulas,
the field conventions (``iteration``, ``root``, ``peer``, ``instance``) and the source files each
op comes from are in ``docs/emulator.md`` section 1.3; the comments below name the
Megatron/PyTorch function each op belongs to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator

import numpy as np

from nccltrace.emulator.config import EmulatorConfig
from nccltrace.emulator.layout import Group, MegatronLayout, PairComm, layout_of
from nccltrace.emulator.params import (
    chunk_layers,
    chunk_params,
    is_moe_layer,
    layer_flops,
)

__all__ = [
    "Op", "Unit", "RankProgram", "DT", "REDOP", "mix64", "hash_ints", "count_kernels", "routing_matrix",
    "P2P_OPS", "kernel_op_of_unit",
]  # fmt: skip

# ncclDataType_t and ncclRedOp_t values (nccl.h).
DT = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
      "float64": 8, "bfloat16": 9}  # fmt: skip
REDOP = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
P2P_OPS = ("Send", "Recv")
_DT_SIZE = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}

_M64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64 finaliser: a fast, well-mixed 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def hash_ints(*parts: int) -> int:
    """A non-negative 63-bit hash of a tuple of integers (stable across runs and platforms):
    :func:`mix64` folded over the parts (inlined here: this runs for every emulated call)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        x = ((h ^ (int(p) & _M64)) + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        h = x ^ (x >> 31)
    return h >> 1


_COLL_PREFIX: dict[int, int] = {}  # communicator uid -> hash state after it (see _collective_instance)
# (uid, k) -> instance id: the members of a communicator on one node are emulated one after the
# other in one process and compute the same ids; bounded (cleared when full).
_COLL_INSTANCES: dict[tuple[int, int], int] = {}
_COLL_INSTANCES_MAX = 200_000


def _collective_instance(uid: int, k: int) -> int:
    """``hash_ints(uid, k, 0)``: the instance id of the k-th collective on a communicator (the
    state after the uid is kept per communicator; the same for every rank)."""
    key = (uid, k)
    inst = _COLL_INSTANCES.get(key)
    if inst is None:
        if len(_COLL_INSTANCES) >= _COLL_INSTANCES_MAX:
            _COLL_INSTANCES.clear()
        inst = _COLL_INSTANCES[key] = _collective_instance_of(uid, k)
    return inst


def _collective_instance_of(uid: int, k: int) -> int:
    h = _COLL_PREFIX.get(uid)
    if h is None:
        x = ((0x243F6A8885A308D3 ^ (uid & _M64)) + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        h = _COLL_PREFIX[uid] = x ^ (x >> 31)
    for p in (k, 0):
        x = ((h ^ (p & _M64)) + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        h = x ^ (x >> 31)
    return h >> 1


@dataclass(slots=True)
class Op:
    """One NCCL API call as a process issues it (one ``NCCL INFO <Op>: opCount ...`` line)."""

    rank: int
    seq: int  # per-rank op index, program order
    unit: int  # per-rank kernel-plan index
    iteration: int
    phase: str
    comm: Group | PairComm
    op: str
    count: int
    dtype: int
    redop: int
    root: int
    peer: int
    grouped: bool
    instance: int
    # derived once here (the communicator's properties are computed on every access)
    nranks: int  # communicator size
    comm_uid: int
    nbytes: int  # count x type size


    @property
    def nccl_group(self) -> int:
        """Per-rank id of the ncclGroupStart/End (kernel plan) the call belongs to."""
        return self.unit

    @property
    def stream_kind(self) -> str:
        """Which CUDA stream the work runs on: PyTorch gives every communicator its own NCCL
        stream; this names its role (tp-comm, dp-comm, p2p, ep-comm, cp-comm, world-comm, ...)."""
        return _STREAM_KIND.get(self.comm.kind, "p2p" if self.comm.kind.startswith("p2p:") else "misc-comm")


_STREAM_KIND = {
    "world": "world-comm", "tp": "tp-comm", "dp": "dp-comm", "dp-cp": "dp-comm", "edp": "dp-comm",
    "intra-distopt": "dp-comm", "pp": "p2p", "embd": "embedding-comm", "pos-embd": "embedding-comm",
    "cp": "cp-comm", "ep": "ep-comm", "etp": "ep-comm", "tp-ep": "ep-comm", "tp-ep-pp": "mp-comm", "mp": "mp-comm",
    "tp-cp": "tp-comm", "tp-dp": "tp-dp-comm", "tp-dp-cp": "tp-dp-comm",
}  # fmt: skip


@dataclass(slots=True)
class Unit:
    """One NCCL kernel plan: a lone call, or the calls of one ncclGroupStart/End."""

    index: int
    iteration: int
    phase: str
    ops: list[Op]
    grouped: bool
    blocking: bool = True  # the compute stream waits for it before going on
    gap_ns: float = 0.0  # GPU compute on this rank since the previous unit
    new_comms: list = field(default_factory=list)  # communicators first used here (lazy init)
    # (layer, runner, "fwd"|"bwd", pass) of the transformer-layer pass the unit belongs to, for
    # CUDA graphs (one graph per Megatron runner and direction); None outside a layer's pass
    # and without cuda_graphs.
    graph_scope: tuple | None = None
    multi: list[Op] = field(default_factory=list)  # the ops on multi-rank communicators (the ones with kernels)

    @property
    def multi_rank(self) -> bool:
        return bool(self.multi)


def kernel_op_of_unit(ops: list[Op]) -> str:
    """Kernel family a fused group launches: SendRecv if it holds P2P work, else the first op."""
    for o in ops:
        if o.op in P2P_OPS or o.op == "AlltoAll":
            return "SendRecv"
    return ops[0].op


@lru_cache(maxsize=256)
def routing_matrix(seed: int, iteration: int, mb: int, layer: int, group: int, ep: int, tokens: int,
                   topk: int) -> np.ndarray:  # fmt: skip
    """Tokens (x topk assignments) each EP rank (row) routes to each EP rank (column).

    Each source rank routes its ``tokens*topk`` assignments over the EP ranks with mildly
    imbalanced probabilities (Dirichlet(50)); deterministic in (seed, iteration, microbatch,
    layer, EP group). Identical on every rank that computes it, so send and receive splits of an
    all-to-all-v agree.
    """
    out = np.zeros((ep, ep), dtype=np.int64)
    for src in range(ep):
        rng = np.random.default_rng(hash_ints(seed, 0x6D6F65, iteration, mb, layer, group, src))
        p = rng.dirichlet(np.full(ep, 50.0))
        out[src] = rng.multinomial(tokens * topk, p)
    out.setflags(write=False)
    return out


# Host-side / non-modelled GPU time constants (ns).
_T_GET_BATCH = 120_000
_T_LOSS = 40_000
_T_OPT_PER_PARAM = 0.03
_T_LOG = 1_500_000
_T_INIT_STEP = 150_000_000
# Host time of capturing all CUDA graphs (cuda_graphs) before the first replaying iteration; the
# GPU idles meanwhile. Real captures take longer (memory pools, TE warm-ups): this only has to
# hold the capture calls (docs/emulator.md section 4.1).
T_GRAPH_CAPTURE = 20_000_000


class RankProgram:
    """The NCCL calls of one global rank, generated in program order."""

    def __init__(self, cfg: EmulatorConfig, layout: MegatronLayout, rank: int) -> None:
        self.cfg = cfg
        self.L = layout
        self.rank = rank
        c = layout.coords(rank)
        self.coords = c
        self.stage = c["pp"]
        self.first_stage = self.stage == 0
        self.last_stage = self.stage == cfg.pp - 1
        self.g = {k: layout.group_of(k, rank) for k in layout.by_kind}
        self._world = self.g["world"]
        self.act_dt = {"fp16": DT["float16"], "bf16": DT["bfloat16"], "fp32": DT["float32"]}[cfg.precision]
        self.grad_dt = DT["float16"] if cfg.precision == "fp16" else DT["float32"]
        self.flops = layer_flops(cfg)
        self.ns_per_flop = 1.0 / (cfg.tflops * 1e3)
        tp_sp = cfg.tp if cfg.sequence_parallel else 1
        self.tok = cfg.micro_batch_size * cfg.seq_length // (cfg.cp * tp_sp)  # tokens entering a layer
        self.full_act = cfg.micro_batch_size * cfg.seq_length * cfg.hidden_size // cfg.cp
        self.sp_act = self.full_act // cfg.tp
        self.p2p_count = self.full_act // tp_sp
        # counters
        self._seq = 0
        self._unit = 0
        self._gap = 0.0
        self._cseq: dict[int, int] = {}  # collectives per communicator
        self._sseq: dict[tuple, int] = {}  # Sends per (comm, sender, receiver)
        self._rseq: dict[tuple, int] = {}  # Recvs per (comm, sender, receiver)
        self._single_budget = cfg.imperfections.single_rank_comm_ops
        self._used: set[int] = set()
        self.iteration = -1
        self.phase = "init"
        # CUDA graph scopes (Megatron's _CudaGraphRunner reuse): per layer the runners' busy flags.
        self._graph_scope: tuple | None = None
        self._graphs = cfg.cuda_graphs.active
        self._graph_passes = 0
        self._runners: dict[int, list[bool]] = {}
        self._runner_of: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------------ unit construction
    def compute(self, ns: float) -> None:
        """GPU compute time on the compute stream before the next NCCL unit."""
        self._gap += ns

    def _flop(self, flops: float) -> None:
        self._gap += flops * self.ns_per_flop

    def _unit_of(self, specs: list[tuple], grouped: bool, blocking: bool = True) -> Unit | None:
        ops: list[Op] = []
        multi: list[Op] = []
        new: list = []
        u = self._unit
        rank = self.rank
        it, phase = self.iteration, self.phase
        for comm, opname, count, dtype, redop, root, peer in specs:
            size = comm.size
            if size == 1:
                if self._single_budget == 0:
                    continue
                if self._single_budget > 0:
                    self._single_budget -= 1
            uid = comm.uid
            if opname == "Send":
                key = (uid, rank, peer)
                k = self._sseq.get(key, 0)
                self._sseq[key] = k + 1
                inst = hash_ints(uid, rank, peer, k, 1)
            elif opname == "Recv":
                key = (uid, peer, rank)
                k = self._rseq.get(key, 0)
                self._rseq[key] = k + 1
                inst = hash_ints(uid, peer, rank, k, 1)
            else:
                k = self._cseq.get(uid, 0)
                self._cseq[uid] = k + 1
                inst = _collective_instance(uid, k)
            if uid not in self._used:
                self._used.add(uid)
                new.append(comm)
            count = int(count)
            o = Op(rank, self._seq, u, it, phase, comm, opname, count, dtype, redop, root, peer, grouped, inst, size,
                   uid, count * _DT_SIZE[dtype])  # fmt: skip
            ops.append(o)
            if size > 1:
                multi.append(o)
            self._seq += 1
        if not ops:
            return None
        self._unit += 1
        unit = Unit(u, it, phase, ops, grouped, blocking, self._gap, new, self._graph_scope, multi)
        self._gap = 0.0
        return unit

    # _c, _ar and _barrier make their unit when called and return it in a tuple (callers
    # ``yield from`` them); a generator per call was a noticeable share of the emulator's time.
    def _c(self, comm, op: str, count: int, dtype: int, redop: int = 0, root: int = 0) -> tuple[Unit, ...]:
        """A lone collective call (:meth:`_unit_of` of one ungrouped collective, written out)."""
        size = comm.size
        if comm is self._world and not self.cfg.default_group_nccl:
            return ()  # the default group's collective runs over gloo: nothing reaches NCCL
        if size == 1:
            if self._single_budget == 0:
                return ()
            if self._single_budget > 0:
                self._single_budget -= 1
        uid = comm.uid
        k = self._cseq.get(uid, 0)
        self._cseq[uid] = k + 1
        new = []
        if uid not in self._used:
            self._used.add(uid)
            new.append(comm)
        u, it, phase = self._unit, self.iteration, self.phase
        count = int(count)
        o = Op(self.rank, self._seq, u, it, phase, comm, op, count, dtype, redop, root, -1, False,
               _collective_instance(uid, k), size, uid, count * _DT_SIZE[dtype])  # fmt: skip
        self._seq += 1
        self._unit = u + 1
        unit = Unit(u, it, phase, [o], False, True, self._gap, new, self._graph_scope, [o] if size > 1 else [])
        self._gap = 0.0
        return (unit,)

    def _ar(self, kind: str, count: int, dtype: int, redop: int = 0) -> tuple[Unit, ...]:
        return self._c(self.g[kind], "AllReduce", count, dtype, redop)

    def _barrier(self) -> tuple[Unit, ...]:
        """torch.distributed.barrier(): an AllReduce of one float on the group."""
        return self._ar("world", 1, DT["float32"])

    # ------------------------------------------------------------------ whole run
    def units(self) -> Iterator[Unit]:
        """Every unit of this rank, in program order."""
        yield from self._init()
        cg = self.cfg.cuda_graphs
        for it in range(self.cfg.iterations):
            self.iteration = it
            if cg.active and it == cg.warmup_iterations:
                self.compute(T_GRAPH_CAPTURE)  # the host captures the graphs; the GPU waits
            yield from self._iteration(it)
        self.iteration = self.cfg.iterations
        self.phase = "shutdown"
        self.compute(_T_LOG)
        yield from self._barrier()  # print_datetime('after training is done')

    def ops(self) -> Iterator[Op]:
        for u in self.units():
            yield from u.ops

    # ------------------------------------------------------------------ initialisation
    def _init(self) -> Iterator[Unit]:
        cfg = self.cfg
        f32 = DT["float32"]
        self.phase = "init/compile"  # initialize._compile_dependencies: rank-0-first barrier + barrier
        self.compute(_T_INIT_STEP)
        yield from self._barrier()
        yield from self._barrier()
        self.phase = "init/start-time"  # training.pretrain: all_reduce(start_time_tensor, MIN), float64
        yield from self._ar("world", 1, DT["float64"], REDOP["min"])
        self.phase = "init/barrier"
        yield from self._barrier()  # print_datetime('after megatron is initialized')
        yield from self._barrier()  # timers('model-and-optimizer-setup').start(barrier=True)
        self.phase = "init/embedding-sync"
        self.compute(_T_INIT_STEP)
        # LanguageModule.setup_embeddings_and_output_layer: tied word embeddings of the first and
        # last stage start equal via an all-reduce in the embedding group (pp > 1 only).
        if cfg.pp > 1 and not cfg.untie_embeddings:
            for chunk in range(cfg.vpp):
                if (self.first_stage and chunk == 0) or (self.last_stage and chunk == cfg.vpp - 1):
                    cp_ = chunk_params(cfg, self.stage, chunk)
                    if self.g["embd"] is not None and self.g["embd"].size > 1:
                        yield from self._ar("embd", cp_.word_embedding, self.act_dt)
        self.phase = "init/barrier"
        yield from self._barrier()  # print_datetime('after model, optimizer, ...')
        yield from self._barrier()  # timers('train/valid/test-data-iterators-setup').start(barrier=True)
        for _ in range(cfg.vpp):  # one data iterator per model chunk with the interleaved schedule
            self.phase = "init/dataset"
            self.compute(_T_INIT_STEP / 3)
            for _split in range(3):  # BlendedMegatronDatasetBuilder.build_generic_dataset: train/valid/test
                yield from self._barrier()
            self.phase = "init/data-flags"  # build_train_valid_test_data_loaders: broadcast(flags, 0)
            yield from self._c(self.g["world"], "Broadcast", 3, DT["int64"], 0, 0)
        self.phase = "init/barrier"
        yield from self._barrier()  # print_datetime('after dataloaders are built')
        self.phase = "init/timers"  # timers.log([...setup timers], barrier=True)
        yield from self._barrier()
        yield from self._c(self.g["world"], "AllGather", 2, f32)
        self.phase = "init/barrier"
        yield from self._barrier()  # timers('interval-time').start(barrier=True)
        yield from self._barrier()  # print_datetime('before the start of training step')

    # ------------------------------------------------------------------ one training step
    def _iteration(self, it: int) -> Iterator[Unit]:
        cfg = self.cfg
        if cfg.pp == 1:
            yield from self._no_pipelining()
        elif cfg.vpp == 1:
            yield from self._one_f_one_b()
        else:
            yield from self._interleaved()
        yield from self._finalize_grads()
        yield from self._optimizer(it)
        yield from self._train_step_tail()
        yield from self._training_log()
        extra = cfg.imperfections.first_iteration_extra_calls
        if it == 0 and extra:
            self.phase = "first-iteration/broadcast"  # a job's first step that differs from the rest
            for _ in range(extra):
                yield from self._c(self.g["world"], "Broadcast", 1 << 18, DT["bfloat16"], 0, 0)

    # ---------------------------------------------------------------- schedules
    def _no_pipelining(self) -> Iterator[Unit]:
        """schedules.forward_backward_no_pipelining: forward then backward per microbatch."""
        for mb in range(self.cfg.num_microbatches):
            yield from self._forward(0, mb)
            yield from self._backward(0, mb)

    def _p2p(self, *, send_next: bool = False, send_prev: bool = False, recv_prev: bool = False,
             recv_next: bool = False, phase: str) -> Iterator[Unit]:  # fmt: skip
        """p2p_communication._communicate: batched (one group on the pp communicator) or, with
        overlap_p2p_comm, individual isend/irecv on two-rank communicators (_p2p_ops order)."""
        if not (send_next or send_prev or recv_prev or recv_next):
            return
        cfg, L = self.cfg, self.L
        pp_g = self.g["pp"]
        nxt = pp_g.ranks[(self.stage + 1) % cfg.pp]
        prv = pp_g.ranks[(self.stage - 1) % cfg.pp]
        cnt, dt = self.p2p_count, self.act_dt
        self.phase = phase
        if not cfg.overlap_p2p:
            specs = []
            for flag, op, peer in (("sp", "Send", prv), ("rp", "Recv", prv), ("sn", "Send", nxt), ("rn", "Recv", nxt)):
                on = {"sp": send_prev, "rp": recv_prev, "sn": send_next, "rn": recv_next}[flag]
                if on:
                    specs.append((pp_g, op, cnt, dt, 0, pp_g.rank_of(peer), peer))
            u = self._unit_of(specs, grouped=True)
            if u is not None:
                yield u
            return
        world = self.g["world"]
        even = self.stage % 2 == 0
        # _p2p_ops: with pp == 2 one of the two directions uses the default (world) group.
        g_a = pp_g
        g_b = world if cfg.pp == 2 else pp_g
        if even:
            order = (("Send", nxt, send_next, g_a), ("Recv", prv, recv_prev, g_b), ("Send", prv, send_prev, g_a),
                     ("Recv", nxt, recv_next, g_b))  # fmt: skip
        else:
            order = (("Recv", prv, recv_prev, g_a), ("Send", nxt, send_next, g_b), ("Recv", nxt, recv_next, g_a),
                     ("Send", prv, send_prev, g_b))  # fmt: skip
        for op, peer, on, parent in order:
            if not on:
                continue
            pc = L.pair(parent, self.rank, peer)
            u = self._unit_of([(pc, op, cnt, dt, 0, pc.rank_of(peer), peer)], grouped=False, blocking=False)
            if u is not None:
                yield u

    def _one_f_one_b(self) -> Iterator[Unit]:
        """schedules.forward_backward_pipelining_without_interleaving (1F1B)."""
        m, pp, s = self.cfg.num_microbatches, self.cfg.pp, self.stage
        first, last = self.first_stage, self.last_stage
        warm = min(pp - s - 1, m)
        rem = m - warm
        for i in range(warm):
            yield from self._p2p(recv_prev=not first, phase="pp/recv-forward")
            yield from self._forward(0, i)
            yield from self._p2p(send_next=not last, phase="pp/send-forward")
        if rem > 0:
            yield from self._p2p(recv_prev=not first, phase="pp/recv-forward")
        for i in range(rem):
            yield from self._forward(0, warm + i)
            yield from self._p2p(send_next=not last, recv_next=not last, phase="pp/send-forward-recv-backward")
            yield from self._backward(0, i)
            if i == rem - 1:
                yield from self._p2p(send_prev=not first, phase="pp/send-backward")
            else:
                yield from self._p2p(send_prev=not first, recv_prev=not first, phase="pp/send-backward-recv-forward")
        for i in range(warm):
            yield from self._p2p(recv_next=not last, phase="pp/recv-backward")
            yield from self._backward(0, rem + i)
            yield from self._p2p(send_prev=not first, phase="pp/send-backward")

    def _interleaved(self) -> Iterator[Unit]:
        """schedules.forward_backward_pipelining_with_interleaving (interleaved 1F1B), with the
        default microbatch group size per virtual stage (= pp) and no warmup/flush overlap."""
        cfg = self.cfg
        pp, m, V, s = cfg.pp, cfg.num_microbatches, cfg.vpp, self.stage
        G = pp
        overlap = cfg.overlap_p2p
        total = m * V
        warm = (pp - s - 1) * 2 + (V - 1) * G
        all_warm = warm >= total
        warm = min(warm, total)
        rem = total - warm
        table: list[tuple[int, int]] = []
        for lo in range(0, m, G):
            hi = m if lo + G >= m else lo + G
            table += [(mb, c) for c in range(V) for mb in range(lo, hi)]
        chunk_of = [c for _, c in table]
        mb_of = [mb for mb, _ in table]
        first, last = self.first_stage, self.last_stage

        def cid(k: int, fwd: bool) -> int:
            c = chunk_of[k % total]
            return c if fwd else V - c - 1

        def recv_from_prev(k: int, fwd: bool) -> bool:
            """Whether this step receives from the previous (fwd) / next (bwd) stage."""
            lead = first if fwd else last
            if not lead:
                return True
            if k < pp - 1:
                return False
            return cid(k - (pp - 1), fwd) != (V - 1 if fwd else 0)

        def vfirst(c: int) -> bool:
            return first and c == 0

        def vlast(c: int) -> bool:
            return last and c == V - 1

        bwd_done = [0] * V

        def bwd(k: int) -> Iterator[Unit]:
            c = cid(k, False)
            mb = bwd_done[c]
            bwd_done[c] += 1
            yield from self._backward(c, mb)

        yield from self._p2p(recv_prev=not vfirst(0), phase="pp/recv-forward")
        for k in range(warm):
            c = cid(k, True)
            rp = recv_from_prev(k, True)
            if k == total - 1:
                rp = False
            yield from self._forward(c, mb_of[k])
            out = not vlast(c)
            if not overlap and k == warm - 1 and not all_warm:
                yield from self._p2p(send_next=out, recv_prev=rp, recv_next=not last, phase="pp/fwd-bwd-exchange")
            else:
                yield from self._p2p(send_next=out, recv_prev=rp, phase="pp/send-forward-recv-forward")
            if overlap and k == warm - 1 and not all_warm:
                yield from self._p2p(recv_next=not last, phase="pp/send-backward-recv-backward")
        for k in range(rem):
            fk = k + warm
            fc = cid(fk, True)
            rp = recv_from_prev(fk, True)
            if k == rem - 1:
                rp = False
            bc = cid(k, False)
            rn = recv_from_prev(k, False)
            if overlap:
                yield from self._forward(fc, mb_of[fk])
                yield from self._p2p(send_next=not vlast(fc), recv_prev=rp, phase="pp/send-forward-recv-forward")
                yield from bwd(k)
                yield from self._p2p(send_prev=not vfirst(bc), recv_next=rn, phase="pp/send-backward-recv-backward")
            else:
                yield from self._forward(fc, mb_of[fk])
                yield from bwd(k)
                yield from self._p2p(send_next=not vlast(fc), send_prev=not vfirst(bc), recv_prev=rp, recv_next=rn,
                                     phase="pp/fwd-bwd-exchange")  # fmt: skip
        if all_warm:
            yield from self._p2p(recv_next=not vlast(V - 1), phase="pp/recv-backward")
        for k in range(rem, total):
            c = cid(k, False)
            rn = recv_from_prev(k, False)
            if k == total - 1:
                rn = False
            yield from bwd(k)
            yield from self._p2p(send_prev=not vfirst(c), recv_next=rn, phase="pp/send-backward-recv-backward")

    # ---------------------------------------------------------------- forward / backward steps
    def _get_batch(self) -> list[Unit]:
        """utils.get_batch_on_this_tp_rank: the TP source rank broadcasts the batch (also when the
        TP group has a single rank)."""
        out: list[Unit] = []
        cfg = self.cfg
        if not (self.first_stage or self.last_stage):
            return out
        b, s = cfg.micro_batch_size, cfg.seq_length
        tok = ("tokens", b * s, DT["int64"])
        lab = ("labels", b * s, DT["int64"])
        msk = ("loss_mask", b * s, DT["float32"])
        att = ("attention_mask", b * s * s, DT["uint8"])  # torch.bool -> ncclUint8
        pos = ("position_ids", b * s, DT["int64"])
        if cfg.pp == 1:
            items = [tok, lab, msk, att, pos]
        elif self.first_stage:
            items = [tok, att, pos]
        else:
            items = [lab, msk, att]
        self.phase = "data/broadcast"
        for _name, count, dt in items:
            out += self._c(self.g["tp"], "Broadcast", count, dt, 0, 0)
        return out

    def _forward(self, chunk: int, mb: int, recompute: bool = False) -> list[Unit]:
        out: list[Unit] = []
        cfg = self.cfg
        if not recompute:
            out += self._get_batch()
            self.compute(_T_GET_BATCH)
        vfirst = self.first_stage and chunk == 0
        vlast = self.last_stage and chunk == cfg.vpp - 1
        tp = cfg.tp > 1
        sp = cfg.sequence_parallel
        if vfirst:
            self.phase = "fwd/embedding"
            self._flop(2 * self.full_act)
            if tp:
                # LanguageModelEmbedding: VocabParallelEmbedding reduces over TP (reduce-scatter when
                # SP without learned position embeddings, else all-reduce and a local scatter).
                if sp and cfg.position_embedding_type != "learned_absolute":
                    out += self._c(self.g["tp"], "ReduceScatter", self.sp_act, self.act_dt)
                else:
                    out += self._ar("tp", self.full_act, self.act_dt)
        for layer in chunk_layers(cfg, self.stage, chunk):
            out += self._layer_forward(layer, mb, "recompute" if recompute else "fwd")
        if vlast and not recompute:
            self.phase = "fwd/output-layer"
            if tp and sp:
                out += self._c(self.g["tp"], "AllGather", self.sp_act, self.act_dt)
            self._flop(self.flops.logits)
            if tp:
                # tensor_parallel.vocab_parallel_cross_entropy: max, predicted logit, sum(exp)
                self.phase = "fwd/cross-entropy"
                n = cfg.micro_batch_size * cfg.seq_length // cfg.cp
                out += self._ar("tp", n, DT["float32"], REDOP["max"])
                out += self._ar("tp", n, DT["float32"])
                out += self._ar("tp", n, DT["float32"])
            self.compute(_T_LOSS)
        return out

    def _attention_forward(self, phase: str) -> list[Unit]:
        out: list[Unit] = []
        cfg = self.cfg
        self.phase = f"{phase}/attention"
        if cfg.tp > 1 and cfg.sequence_parallel:
            out += self._c(self.g["tp"], "AllGather", self.sp_act, self.act_dt)
        if cfg.cp > 1:
            out += self._cp_ring(backward=False)
        self._flop(self.flops.attention)
        if cfg.tp > 1:
            if cfg.sequence_parallel:
                out += self._c(self.g["tp"], "ReduceScatter", self.sp_act, self.act_dt)
            else:
                out += self._ar("tp", self.full_act, self.act_dt)
        return out

    def _graph_runner(self, layer: int, mb: int, direction: str) -> tuple:
        """Scope of a layer pass for CUDA graphs. Megatron's CudaGraphManager gives a layer's
        forward pass the first runner that is ready for a forward (its previous backward done),
        making a new one if none is; the backward uses the runner of its microbatch's forward
        (megatron/core/transformer/cuda_graphs.py, _GraphStatus FWD_READY/BWD_READY). None
        without cuda_graphs (nothing reads the scope then)."""
        if not self._graphs:
            return None
        if direction == "fwd":
            pool = self._runners.setdefault(layer, [])
            i = next((j for j, busy in enumerate(pool) if not busy), len(pool))
            if i == len(pool):
                pool.append(False)
            pool[i] = True
            self._runner_of[(layer, mb)] = i
        else:
            i = self._runner_of.pop((layer, mb), 0)
            if layer in self._runners and i < len(self._runners[layer]):
                self._runners[layer][i] = False
        self._graph_passes += 1
        return (layer, i, direction, self._graph_passes)

    def _layer_forward(self, layer: int, mb: int, phase: str) -> list[Unit]:
        out: list[Unit] = []
        self._graph_scope = self._graph_runner(layer, mb, "fwd") if phase == "fwd" else None
        out += self._layer_forward_body(layer, mb, phase)
        self._graph_scope = None
        return out

    def _layer_forward_body(self, layer: int, mb: int, phase: str) -> list[Unit]:
        out: list[Unit] = []
        cfg = self.cfg
        out += self._attention_forward(phase)
        if is_moe_layer(cfg, layer):
            out += self._moe(layer, mb, backward=False, phase=phase)
        else:
            self.phase = f"{phase}/mlp"
            if cfg.tp > 1 and cfg.sequence_parallel:
                out += self._c(self.g["tp"], "AllGather", self.sp_act, self.act_dt)
            self._flop(self.flops.mlp)
            if cfg.tp > 1:
                if cfg.sequence_parallel:
                    out += self._c(self.g["tp"], "ReduceScatter", self.sp_act, self.act_dt)
                else:
                    out += self._ar("tp", self.full_act, self.act_dt)
        return out

    def _backward(self, chunk: int, mb: int) -> list[Unit]:
        out: list[Unit] = []
        cfg = self.cfg
        vfirst = self.first_stage and chunk == 0
        vlast = self.last_stage and chunk == cfg.vpp - 1
        tp = cfg.tp > 1
        sp = cfg.sequence_parallel
        act = self.act_dt
        if vlast:
            self.phase = "bwd/output-layer"
            self._flop(2 * self.flops.logits)
            if tp:
                if sp:  # column-parallel backward with SP: re-gather the input, reduce-scatter dgrad
                    out += self._c(self.g["tp"], "AllGather", self.sp_act, act)
                    out += self._c(self.g["tp"], "ReduceScatter", self.sp_act, act)
                else:
                    out += self._ar("tp", self.full_act, act)
        for layer in reversed(chunk_layers(cfg, self.stage, chunk)):
            if cfg.recompute == "full":
                out += self._layer_forward(layer, mb, "recompute")
            self._graph_scope = self._graph_runner(layer, mb, "bwd")
            if is_moe_layer(cfg, layer):
                out += self._moe(layer, mb, backward=True, phase="bwd")
            else:
                self.phase = "bwd/mlp"
                if tp and sp:
                    out += self._c(self.g["tp"], "AllGather", self.sp_act, act)  # backward of the fc2 RS
                self._flop(self.flops.mlp)
                out += self._column_parallel_input_grad(self.flops.mlp, act)
            self.phase = "bwd/attention"
            if tp and sp:
                out += self._c(self.g["tp"], "AllGather", self.sp_act, act)  # backward of the proj RS
            self._flop(self.flops.attention)
            if cfg.cp > 1:
                out += self._cp_ring(backward=True)
            out += self._column_parallel_input_grad(self.flops.attention, act)
            self._graph_scope = None
        if vfirst:
            self.phase = "bwd/embedding"
            if tp and sp:
                out += self._c(self.g["tp"], "AllGather", self.sp_act, act)
            self._flop(2 * self.full_act)
        return out

    def _cp_ring(self, backward: bool) -> Iterator[Unit]:
        """Transformer Engine context-parallel attention (cp_comm_type 'p2p'): cp-1 ring steps
        sending K,V to the next and receiving from the previous CP rank; the backward pass also
        carries dK,dV. Batched for cp == 2, individual isend/irecv otherwise."""
        cfg = self.cfg
        cpg = self.g["cp"]
        me = cpg.rank_of(self.rank)
        nxt = cpg.ranks[(me + 1) % cfg.cp]
        prv = cpg.ranks[(me - 1) % cfg.cp]
        kv = 2 * (cfg.seq_length // cfg.cp) * cfg.micro_batch_size * (cfg.hidden_size // cfg.tp)
        if backward:
            kv *= 2
        self.phase = ("bwd" if backward else "fwd") + "/cp-ring"
        for _step in range(cfg.cp - 1):
            self._flop(self.flops.attention * 0.5 / cfg.cp)
            if cfg.cp == 2:
                u = self._unit_of(
                    [(cpg, "Send", kv, self.act_dt, 0, cpg.rank_of(nxt), nxt),
                     (cpg, "Recv", kv, self.act_dt, 0, cpg.rank_of(prv), prv)], grouped=True)  # fmt: skip
                if u is not None:
                    yield u
                continue
            pairs = [("Send", nxt), ("Recv", prv)] if me % 2 == 0 else [("Recv", prv), ("Send", nxt)]
            for op, peer in pairs:
                pc = self.L.pair(cpg, self.rank, peer)
                u = self._unit_of([(pc, op, kv, self.act_dt, 0, pc.rank_of(peer), peer)], grouped=False)
                if u is not None:
                    yield u

    # ---------------------------------------------------------------- MoE
    def _all_to_all(self, group: Group, splits_out: np.ndarray, splits_in: np.ndarray, width: int, dtype: int,
                    matrix: np.ndarray) -> Iterator[Unit]:  # fmt: skip
        """torch.distributed.all_to_all_single with split sizes: one NCCL group of Send/Recv per
        peer with a non-zero count (self included), or ncclAlltoAll (NCCL >= 2.28, equal counts:
        every peer's count padded to the largest split of the exchange)."""
        if self.cfg.moe_alltoall == "native":
            u = self._unit_of([(group, "AlltoAll", int(matrix.max()) * width, dtype, 0, 0, -1)], grouped=False)
            if u is not None:
                yield u
            return
        specs = []
        for p, peer in enumerate(group.ranks):
            if splits_out[p]:
                specs.append((group, "Send", int(splits_out[p]) * width, dtype, 0, p, peer))
            if splits_in[p]:
                specs.append((group, "Recv", int(splits_in[p]) * width, dtype, 0, p, peer))
        u = self._unit_of(specs, grouped=True)
        if u is not None:
            yield u

    def _recv_total(self, q: int, mb: int, layer: int, tok: int) -> int:
        """Tokens (x topk) global rank ``q`` receives in its expert-parallel all-to-all."""
        cfg = self.cfg
        epg = self.L.group_of("ep", q)
        M = routing_matrix(cfg.seed, self.iteration, mb, layer, epg.index, cfg.ep, tok, cfg.moe_router_topk)
        return int(M[:, epg.rank_of(q)].sum())

    def _column_parallel_input_grad(self, flops: float, act: int) -> list[Unit]:
        """Backward of a column-parallel input (fc1 / QKV): with SP the input is re-gathered
        (AllGather) and its gradient reduce-scattered; without SP the gradient is all-reduced
        over TP (tensor_parallel/layers.py); without TP only compute."""
        out: list[Unit] = []
        if self.cfg.tp > 1:
            if self.cfg.sequence_parallel:
                out += self._c(self.g["tp"], "AllGather", self.sp_act, act)
                self._flop(flops)
                out += self._c(self.g["tp"], "ReduceScatter", self.sp_act, act)
            else:
                self._flop(flops)
                out += self._ar("tp", self.full_act, act)
        else:
            self._flop(flops)
        return out

    def _sized_collective(self, group: Group, sizes: list[int], width: int, dtype: int, equal_op: str,
                          fallback_op: str) -> Iterator[Unit]:
        """A list-based torch.distributed collective: ``equal_op`` when all members' sizes agree,
        else PyTorch's fallback, one grouped ``fallback_op`` rooted at every member."""
        me = group.rank_of(self.rank)
        if len(set(sizes)) == 1:
            yield from self._c(group, equal_op, sizes[me] * width, dtype)
            return
        specs = [(group, fallback_op, n * width, dtype, 0, r, -1) for r, n in enumerate(sizes)]
        u = self._unit_of(specs, grouped=True)
        if u is not None:
            yield u

    def _gather_v(self, group: Group, sizes: list[int], width: int, dtype: int) -> Iterator[Unit]:
        """torch.distributed.all_gather into a list of tensors (mappings._gather_along_first_dim
        with output_split_sizes): AllGather, or grouped Broadcasts for unequal sizes."""
        yield from self._sized_collective(group, sizes, width, dtype, "AllGather", "Broadcast")

    def _reduce_scatter_v(self, group: Group, sizes: list[int], width: int, dtype: int) -> Iterator[Unit]:
        """torch.distributed.reduce_scatter from a list (input_split_sizes): ReduceScatter, or
        grouped Reduces for unequal sizes."""
        yield from self._sized_collective(group, sizes, width, dtype, "ReduceScatter", "Reduce")

    def _moe(self, layer: int, mb: int, backward: bool, phase: str) -> Iterator[Unit]:
        """MoE layer: router aux-loss reduction and token dispatch/combine
        (transformer/moe/router.py, token_dispatcher.py)."""
        cfg = self.cfg
        act, f32 = self.act_dt, DT["float32"]
        E, h, k = cfg.num_experts, cfg.hidden_size, cfg.moe_router_topk
        tok = self.tok
        etp = cfg.expert_tp
        self.phase = f"{phase}/moe-router"
        if not backward:
            self._flop(2 * tok * h * E)
            tpcp = self.g["tp-cp"]
            if tpcp.size > 1:  # switch_load_balancing_loss_func: all_reduce(tokens_per_expert)
                yield from self._c(tpcp, "AllReduce", E, DT["int64"])
        moe_flops = self.flops.moe_mlp * (2 if backward else 1)
        if cfg.moe_token_dispatcher == "allgather":
            g = self.g["tp-ep"]
            multi = g.size > 1
            if not backward:
                self.phase = f"{phase}/moe-dispatch"
                if multi:
                    yield from self._c(g, "AllGather", tok * E, DT["uint8"])  # routing map (bool)
                    yield from self._c(g, "AllGather", tok * E, f32)  # probs
                    yield from self._c(g, "AllGather", tok * h, act)  # hidden states
                self._flop(moe_flops)
                self.phase = f"{phase}/moe-combine"
                if multi:
                    yield from self._c(g, "ReduceScatter", tok * h, f32)
            else:
                self.phase = "bwd/moe-combine"
                if multi:
                    yield from self._c(g, "AllGather", tok * h, f32)
                self._flop(moe_flops)
                self.phase = "bwd/moe-dispatch"
                if multi:
                    yield from self._c(g, "ReduceScatter", tok * h, act)
                    yield from self._c(g, "ReduceScatter", tok * E, f32)
            return
        # alltoall dispatcher
        epg = self.g["ep"]
        ep = cfg.ep
        tep = self.g["tp-ep"]
        if ep == 1 and etp == 1:
            self._flop(moe_flops)
            return
        M = routing_matrix(cfg.seed, self.iteration, mb, layer, epg.index, ep, tok, k)
        me = epg.rank_of(self.rank)
        out_splits, in_splits = M[me], M[:, me]
        etpg = self.g["etp"]
        # tokens each expert-TP member received from its all-to-all (output_splits_tp)
        sizes = [self._recv_total(q, mb, layer, tok) for q in etpg.ranks] if etp > 1 else []
        if not backward:
            self.phase = f"{phase}/moe-dispatch"
            if tep.size > 1:  # preprocess: gather tokens-per-expert over tp x ep
                yield from self._c(tep, "AllGather", E, DT["int64"])
            if ep > 1:
                yield from self._all_to_all(epg, out_splits, in_splits, h, act, M)  # tokens
                yield from self._all_to_all(epg, out_splits, in_splits, 1, f32, M)  # probs
            if etp > 1:
                yield from self._gather_v(etpg, sizes, h, act)
                yield from self._gather_v(etpg, sizes, 1, f32)
            self._flop(moe_flops)
            self.phase = f"{phase}/moe-combine"
            if etp > 1:
                yield from self._reduce_scatter_v(etpg, sizes, h, f32)
            if ep > 1:
                yield from self._all_to_all(epg, in_splits, out_splits, h, act, M.T)
        else:
            self.phase = "bwd/moe-combine"
            if ep > 1:
                yield from self._all_to_all(epg, out_splits, in_splits, h, act, M)
            if etp > 1:
                yield from self._gather_v(etpg, sizes, h, f32)
            self._flop(moe_flops)
            self.phase = "bwd/moe-dispatch"
            if etp > 1:
                yield from self._reduce_scatter_v(etpg, sizes, h, act)
                yield from self._reduce_scatter_v(etpg, sizes, 1, f32)
            if ep > 1:
                yield from self._all_to_all(epg, in_splits, out_splits, 1, f32, M.T)  # probs
                yield from self._all_to_all(epg, in_splits, out_splits, h, act, M.T)  # tokens

    # ---------------------------------------------------------------- after forward/backward
    def _buffer_count(self, n: int, group_size: int) -> int:
        """Grad-buffer elements; padded to lcm(dp, 128) with the distributed optimizer."""
        if not self.cfg.distributed_optimizer:
            return n
        d = np.lcm(group_size, 128)
        return int(-(-n // d) * d)

    def _finalize_grads(self) -> Iterator[Unit]:
        """distributed/finalize_model_grads.finalize_model_grads."""
        cfg = self.cfg
        chunks = range(cfg.vpp)
        self.phase = "grad-sync"
        for chunk in chunks:
            p = chunk_params(cfg, self.stage, chunk)
            for kind, n in (("dp-cp", p.dense), ("edp", p.expert)):
                if n == 0:
                    continue
                g = self.g[kind]
                cnt = self._buffer_count(n, g.size)
                # param_and_grad_buffer.start_grad_sync inside torch's _coalescing_manager: one NCCL
                # group per bucket group; overlap_grad_reduce off -> one bucket per buffer.
                if cfg.distributed_optimizer:
                    spec = (g, "ReduceScatter", cnt // g.size, self.grad_dt, 0, 0, -1)
                else:
                    spec = (g, "AllReduce", cnt, self.grad_dt, 0, 0, -1)
                u = self._unit_of([spec], grouped=True)
                if u is not None:
                    yield u
        if cfg.tp > 1 and cfg.sequence_parallel:
            self.phase = "grad-sync/sequence-parallel"  # _allreduce_non_tensor_model_parallel_grads
            n = sum(chunk_params(cfg, self.stage, c).sequence_parallel for c in chunks)
            yield from self._ar("tp", n, self.grad_dt)
        if not cfg.untie_embeddings and self.g["embd"] is not None and self.g["embd"].size > 1:
            self.phase = "grad-sync/embedding"  # _allreduce_word_embedding_grads
            chunk = 0 if self.first_stage else cfg.vpp - 1
            yield from self._ar("embd", chunk_params(cfg, self.stage, chunk).word_embedding, self.grad_dt)

    def _grad_stats_groups(self) -> list[Group]:
        """Gradient-statistics groups of the (chained) optimizer, dense first
        (optimizer/__init__.py: model-parallel group, expert tp-ep-pp group, or the
        distributed-optimizer instance group)."""
        cfg = self.cfg
        if cfg.distributed_optimizer:
            groups = [self.g["intra-distopt"]]
            if cfg.is_moe:
                groups.append(self.g["intra-distopt"])
            return groups
        groups = [self.g["mp"]]
        if cfg.is_moe:
            groups.append(self.g["tp-ep-pp"])
        return groups

    def _optimizer(self, it: int) -> Iterator[Unit]:
        """optimizer.step(): found-inf check (fp16), grad-norm, step, param all-gather (distopt)."""
        cfg = self.cfg
        f32 = DT["float32"]
        groups = self._grad_stats_groups()
        params = sum(chunk_params(cfg, self.stage, c).dense + chunk_params(cfg, self.stage, c).expert
                     for c in range(cfg.vpp))  # fmt: skip
        self.compute(params * _T_OPT_PER_PARAM * 0.2)
        if cfg.precision == "fp16":
            self.phase = "optim/found-inf"  # _unscale_main_grads_and_check_for_nan, per chained optimizer
            for g in groups:
                yield from self._c(g, "AllReduce", 1, f32, REDOP["max"])
            if it < cfg.overflow_iterations:
                return  # inf/nan: step skipped (no grad norm, no update)
        self.phase = "optim/grad-norm"  # clip_grads.get_grad_norm_fp32
        if len(groups) == 1 or groups[0] is groups[1]:
            yield from self._c(groups[0], "AllReduce", 1, f32)
        else:
            for g in groups:
                yield from self._c(g, "AllReduce", 1, f32)
        self.compute(params * _T_OPT_PER_PARAM)
        if cfg.distributed_optimizer:
            self.phase = "optim/param-all-gather"  # start_param_sync per model chunk, coalesced
            for chunk in range(cfg.vpp):
                p = chunk_params(cfg, self.stage, chunk)
                for kind, n in (("dp-cp", p.dense), ("edp", p.expert)):
                    if n == 0:
                        continue
                    g = self.g[kind]
                    cnt = self._buffer_count(n, g.size)
                    u = self._unit_of([(g, "AllGather", cnt // g.size, self.act_dt, 0, 0, -1)], grouped=True)
                    if u is not None:
                        yield u

    def _train_step_tail(self) -> Iterator[Unit]:
        """training.train_step after the optimizer."""
        f32 = DT["float32"]
        self.phase = "step/update-successful"  # logical_and_across_model_parallel_group
        yield from self._ar("mp", 1, DT["int32"], REDOP["min"])
        self.phase = "step/grad-norm-max"  # reduce_max_stat_across_model_parallel_group(grad_norm)
        yield from self._ar("mp", 1, f32, REDOP["max"])
        if self.last_stage:
            self.phase = "loss/reduce"  # average loss and token count over dp x cp
            yield from self._ar("dp-cp", 2, f32)

    def _training_log(self) -> Iterator[Unit]:
        """training.training_log with --log-interval 1 (and the thesis's tensorboard timers)."""
        cfg = self.cfg
        f32 = DT["float32"]
        self.compute(_T_LOG)
        self.phase = "log/learning-rate"
        yield from self._ar("mp", 1, f32, REDOP["max"])
        if cfg.log_timers_to_tensorboard:
            self.phase = "log/timers-write"  # Timers._get_elapsed_time_all_ranks: all_gather of 24 timers
            yield from self._c(self.g["world"], "AllGather", 24, f32)
        if cfg.is_moe:
            self.phase = "log/moe-aux-loss"  # moe_utils.reduce_aux_losses_tracker_across_ranks
            yield from self._c(self.g["pp"], "AllReduce", cfg.num_layers, f32)
            tpcp = self.g["tp-cp"]
            if tpcp.size > 1:
                yield from self._c(tpcp, "AllReduce", cfg.num_layers, f32)
        self.phase = "log/interval-barrier"  # timers('interval-time').elapsed(barrier=True): stop + start
        yield from self._barrier()
        yield from self._barrier()
        self.phase = "log/timers"  # timers.log(timers_to_log)
        yield from self._c(self.g["world"], "AllGather", 24, f32)


def count_kernels(cfg: EmulatorConfig, layout: MegatronLayout | None = None) -> dict[str, dict[str, int]]:
    """Per-op totals over all ranks of one run: ``calls`` (logged call lines, all ops) and
    ``kernels`` as an nsys trace counts them with realistic NCCL behaviour: one kernel per
    NCCL group (grouped P2P as ``SendRecv``), none for single-rank communicators. This is the
    convention of the thesis's chapter-5 operation counts."""
    layout = layout or layout_of(cfg)
    calls: Counter = Counter()
    kernels: Counter = Counter()
    for r in range(cfg.world_size):
        for u in RankProgram(cfg, layout, r).units():
            for o in u.ops:
                calls[o.op] += 1
            multi = u.multi
            if not multi:
                continue
            kind = kernel_op_of_unit(multi)
            kernels[kind] += 1
    return {"calls": dict(calls), "kernels": dict(kernels)}
