"""Timing model of the emulated run: integer ns on the true job timeline (0 = job start).

Three layers: :class:`LinkModel` (one kernel plan's duration from bus bytes and the placement's
bandwidth), :class:`Skeleton` (a discrete-event simulation of one representative rank per
pipeline stage, since every rank of a stage issues the same plans) and :class:`RankTimer` (each
rank's arrival offset, jitter, end spread, host lead and launch queueing). Per-node clock offset
and drift are applied by the writer (``run.py``). The model: ``docs/emulator.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

from nccltrace.emulator.config import EmulatorConfig
from nccltrace.emulator.layout import MegatronLayout, PairComm
from nccltrace.emulator.schedule import P2P_OPS, Op, RankProgram, Unit, hash_ints

__all__ = ["TimingParams", "KernelSpec", "LinkModel", "Skeleton", "RankTimer", "UnitTimes", "u01"]


def u01(*parts: int) -> float:
    """Deterministic uniform number in [0, 1) from integers."""
    return (hash_ints(*parts) >> 11) / float(1 << 52)


@dataclass(frozen=True)
class TimingParams:
    """Host-side constants (ns)."""

    host_lead_ns: int = 30_000  # CPU issues a call this long before the GPU can run it
    api_call_ns: int = 2_500  # one NCCL API call (incl. the log line)
    group_call_ns: int = 800  # ncclGroupStart / ncclGroupEnd bookkeeping
    launch_ns: int = 4_000  # cuLaunchKernelEx / cudaLaunchKernel
    queue_min_ns: int = 2_000  # launch return -> earliest kernel start
    issue_ns: int = 1_500  # non-blocking P2P issue overhead on the compute timeline
    comm_init_ns: int = 60_000_000  # ncclCommInitRankConfig, plus per doubling of nranks:
    comm_init_per_log2_ns: int = 8_000_000
    split_ns: int = 20_000_000  # one ncclCommSplit
    single_rank_ns: int = 3_000  # local copy on a single-rank communicator (no kernel)
    end_jitter_ns: int = 800  # spread of the kernel ends of one collective (when skew is on)
    min_kernel_ns: int = 2_500


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel plan looks like on the GPU."""

    duration_ns: int
    algo: str
    proto: str
    nchannels: int
    nthreads: int


_LL_LIMIT = 64 << 10
_LL128_LIMIT = 4 << 20


class LinkModel:
    """Alpha-beta kernel duration by op, size and placement (see module docstring)."""

    def __init__(self, cfg: EmulatorConfig, layout: MegatronLayout) -> None:
        self.cfg = cfg
        self.layout = layout
        hw = cfg.hw
        self.nvlink = hw.nvlink_bw is not None
        self.intra = hw.intra_busbw  # GB/s == bytes/ns
        if self.nvlink:
            self.p2p_intra = hw.intra_busbw * (0.5 if hw.nvswitch else 0.4)
        else:
            self.p2p_intra = hw.pci_bw * 0.45
        nic_share = max(1.0, hw.nics / max(cfg.gpus_per_node, 1))
        self.inter = min(self.intra, hw.net_bw * nic_share * 0.9)
        self.max_channels = (32 if hw.nvswitch else 16) if self.nvlink else 4
        self._nodes_cache: dict[int, int] = {}
        # specs are pure functions of their arguments and immutable: memoised
        self._coll_cache: dict[tuple, KernelSpec] = {}
        self._p2p_cache: dict[tuple, KernelSpec] = {}

    def nnodes(self, comm) -> int:
        n = self._nodes_cache.get(comm.uid)
        if n is None:
            n = self.layout.nodes_of(comm.ranks)
            self._nodes_cache[comm.uid] = n
        return n

    def _proto(self, nbytes: int) -> str:
        if nbytes < _LL_LIMIT:
            return "LL"
        if nbytes < _LL128_LIMIT and self.nvlink:
            return "LL128"
        return "SIMPLE"

    def collective(self, op: str, nbytes: int, nranks: int, nnodes: int) -> KernelSpec:
        """One collective (or AlltoAll) of ``nbytes`` per-rank payload (count x type size)."""
        key = (op, nbytes, nranks, nnodes)
        spec = self._coll_cache.get(key)
        if spec is None:
            spec = self._coll_cache[key] = self._collective(op, nbytes, nranks, nnodes)
        return spec

    def _collective(self, op: str, nbytes: int, nranks: int, nnodes: int) -> KernelSpec:
        n = max(nranks, 1)
        if op == "AllReduce":
            bus = 2.0 * (n - 1) / n * nbytes
        elif op in ("AllGather", "ReduceScatter", "AlltoAll"):
            bus = float(n - 1) * nbytes
        else:  # Broadcast, Reduce
            bus = float(nbytes)
        proto = self._proto(nbytes)
        algo = "TREE" if (op == "AllReduce" and nnodes > 1 and nbytes < (4 << 20)) else "RING"
        bw = self.inter if nnodes > 1 else self.intra
        bw *= {"LL": 0.3, "LL128": 0.85, "SIMPLE": 1.0}[proto]
        alpha = (3_000 if proto == "LL" else 6_000) + 700 * math.ceil(math.log2(n)) + (8_000 if nnodes > 1 else 0)
        nch = min(self.max_channels, max(2, int(nbytes // (512 << 10)) or 2))
        nthreads = 640 if proto == "LL128" else 512
        return KernelSpec(int(alpha + bus / bw), algo, proto, nch, nthreads)

    def p2p(self, nbytes_out: int, nbytes_in: int, cross_node: bool, npeers: int) -> KernelSpec:
        """A SendRecv kernel moving ``nbytes_out`` out and ``nbytes_in`` in (concurrently)."""
        key = (nbytes_out, nbytes_in, cross_node, npeers)
        spec = self._p2p_cache.get(key)
        if spec is None:
            spec = self._p2p_cache[key] = self._p2p(nbytes_out, nbytes_in, cross_node, npeers)
        return spec

    def _p2p(self, nbytes_out: int, nbytes_in: int, cross_node: bool, npeers: int) -> KernelSpec:
        bw = self.inter if cross_node else self.p2p_intra
        alpha = 5_000 + 1_000 * max(npeers - 1, 0) + (8_000 if cross_node else 0)
        nch = min(self.max_channels, max(1, int(max(nbytes_out, nbytes_in) // (1 << 20)) or 1))
        return KernelSpec(int(alpha + max(nbytes_out, nbytes_in) / bw), "RING", "SIMPLE", nch, 512)

    def unit(self, ops: list[Op]) -> KernelSpec:
        """Spec of the (fused) kernel of a unit's multi-rank ops."""
        multi = [o for o in ops if o.nranks > 1]
        if not multi:
            return KernelSpec(0, "RING", "LL", 1, 512)
        if any(o.op in P2P_OPS for o in multi):
            out = sum(o.nbytes for o in multi if o.op == "Send" and o.peer != o.rank)
            inn = sum(o.nbytes for o in multi if o.op == "Recv" and o.peer != o.rank)
            gpn = self.layout.gpus_per_node
            cross = any(o.peer // gpn != o.rank // gpn for o in multi)
            peers = len({o.peer for o in multi})
            return self.p2p(out, inn, cross, peers)
        specs = [self.collective(o.op, o.nbytes, o.nranks, self.nnodes(o.comm)) for o in multi]
        if len(specs) == 1:
            return specs[0]
        s0 = specs[0]
        return KernelSpec(sum(s.duration_ns for s in specs), s0.algo, s0.proto, max(s.nchannels for s in specs),
                          s0.nthreads)  # fmt: skip

    def op_kernel(self, o: Op) -> KernelSpec:
        """Spec of an op's own kernel (used when grouped ops are not fused)."""
        if o.op in P2P_OPS:
            gpn = self.layout.gpus_per_node
            cross = o.peer // gpn != o.rank // gpn
            b = o.nbytes if o.peer != o.rank else 0
            return self.p2p(b if o.op == "Send" else 0, b if o.op == "Recv" else 0, cross, 1)
        return self.collective(o.op, o.nbytes, o.nranks, self.nnodes(o.comm))


# --------------------------------------------------------------------------- skeleton


def init_cost(cfg: EmulatorConfig, tp: TimingParams, unit: Unit, n_split_groups: int = 0) -> int:
    """Communicator creation time charged before a unit (lazy init at first use; with
    init_style 'split' every Megatron group is split eagerly before the first unit)."""
    ns = 0
    for c in unit.new_comms:
        if cfg.init_style == "plain" or isinstance(c, PairComm):
            ns += tp.comm_init_ns + tp.comm_init_per_log2_ns * int(math.ceil(math.log2(max(c.size, 1))))
    if cfg.init_style == "split" and unit.index == 0:
        world = cfg.world_size
        ns += tp.comm_init_ns + tp.comm_init_per_log2_ns * int(math.ceil(math.log2(max(world, 1))))
        ns += n_split_groups * tp.split_ns
    return ns


@dataclass
class _Info:
    kind: str  # none | intra | coll | p2p
    dur: int
    skew: int
    key: int  # coll instance
    stages: tuple[int, ...]
    p2p: list  # (instance, side, peer_stage, dur, skew)
    comm_uid: int
    init: int
    launches: int = 0  # kernel launches the host makes for the unit


class HostIssue(NamedTuple):
    """The host side of one unit: when its calls, launches and group calls run (ns)."""

    init_start: int
    group_start: int
    calls: list[int]
    group_end_start: int
    launches: list[tuple[int, int]]
    cpu_end: int  # the CPU is free for the next unit
    kernel_ready: int  # earliest kernel start the host allows (launch returned + queue)


def host_issue(tp: TimingParams, cpu: int, arrive: int, eff: int, init: int, n_calls: int, grouped: bool,
               n_launches: int) -> HostIssue:  # fmt: skip
    """Issue one unit from a CPU free at ``cpu``: the calls start ``host_lead_ns`` (plus their
    own cost) before the GPU is to run them at ``arrive``, or as soon as the CPU is free when it
    is behind. One home for the host model: the stage skeleton uses it so that a CPU-bound
    stretch of small collectives delays the stage (and so every member of a collective) instead
    of one rank's kernels alone."""
    api = tp.api_call_ns
    if n_calls == 1 and not grouped and not init and n_launches == 1:
        # the common unit (one call, one launch), with the general steps below folded
        cpu0 = arrive - tp.host_lead_ns - api
        if cpu + api // 2 > cpu0:
            cpu0 = cpu + api // 2
        t = cpu0 + api
        end = t + tp.launch_ns
        return HostIssue(cpu0, cpu0, [cpu0], t, [(t, end)], end, end + tp.queue_min_ns)
    group_ns = tp.group_call_ns if grouped else 0
    # (comparisons instead of max(): this runs for every unit of every rank)
    cpu0 = arrive - tp.host_lead_ns - n_calls * api - 2 * group_ns
    free = cpu + api // 2
    if free > cpu0:
        cpu0 = free
    init_start = cpu0
    if init:
        init_start = eff - init - tp.host_lead_ns
        if cpu + 1_000 > init_start:
            init_start = cpu + 1_000
        if init_start + init > cpu0:
            cpu0 = init_start + init
    t = cpu0 + group_ns
    group_start = cpu0
    calls = [t] if n_calls == 1 else [t + i * api for i in range(n_calls)]
    t += n_calls * api
    group_end_start = t
    launches: list[tuple[int, int]] = []
    if n_launches:
        t += group_ns // 2
        ln = tp.launch_ns
        for _ in range(n_launches):
            launches.append((t, t + ln))
            t += ln
    ready = t + tp.queue_min_ns
    t += group_ns // 2
    return HostIssue(init_start, group_start, calls, group_end_start, launches, t, ready)


class _StageState:
    __slots__ = ("gen", "unit", "info", "idx", "clock", "cpu", "arrived", "eff", "pending", "comm_free", "done")

    def __init__(self, gen: Iterator[Unit]) -> None:
        self.gen = gen
        self.unit: Unit | None = None
        self.info: _Info | None = None
        self.idx = 0
        self.clock = 0
        self.cpu = 0  # the stage's host: every rank of a stage issues the same calls
        self.arrived = False
        self.eff = 0
        self.pending: list = []
        self.comm_free: dict[int, int] = {}
        self.done = False


class Skeleton:
    """Stage-level timeline: ``start[s][u]``, ``end[s][u]``, ``skew[s][u]``, ``init[s][u]`` for
    unit ``u`` of pipeline stage ``s`` (see module docstring)."""

    def __init__(self, cfg: EmulatorConfig, layout: MegatronLayout, link: LinkModel,
                 params: TimingParams | None = None) -> None:  # fmt: skip
        self.cfg = cfg
        self.layout = layout
        self.link = link
        self.tp = params or TimingParams()
        self.skew_max = int(cfg.imperfections.arrival_skew_ns_max)
        # with end_spread_ns_max the members of a unit end up to that much after its end
        # (RankTimer.times); the stage goes on, and the communicator's next unit starts, only after
        # the latest could have: a time-shared GPU slows the whole run, and every member of a
        # collective (both sides of a transfer) still starts before any of them ends, as its data
        # flow requires (without this a late end pushed that rank's next kernel past its peers' ends)
        spread = int(cfg.imperfections.end_spread_ns_max)
        self.settle = spread + self.tp.end_jitter_ns + 200 if spread else 0
        pp = cfg.pp
        self.start: list[np.ndarray] = []
        self.end: list[np.ndarray] = []
        self.skew: list[np.ndarray] = []
        self.init: list[np.ndarray] = []
        self.n_units = [0] * pp
        self.first_unit: list[dict[int, int]] = [{} for _ in range(pp)]  # per stage: iteration -> first unit
        self._run()

    def split_groups(self, rank: int) -> int:
        """Megatron groups containing ``rank`` (each a ncclCommSplit with init_style 'split')."""
        return sum(1 for g in self.layout.groups_of(rank) if g.kind != "world")

    def _classify(self, s: int, u: Unit) -> _Info:
        L = self.layout
        multi = u.multi
        rep = L.stage_representative(s)
        n_split = self.split_groups(rep) if (self.cfg.init_style == "split" and u.index == 0) else 0
        init = init_cost(self.cfg, self.tp, u, n_split)
        uid = u.ops[0].comm_uid
        if not multi:
            return _Info("none", self.tp.single_rank_ns, 0, 0, (s,), [], uid, init)
        spec = self.link.unit(multi)
        skew = int(self.skew_max * u01(multi[0].instance, 0x5EED)) if self.skew_max else 0
        p2p = []
        stages: tuple[int, ...] = (s,)
        key = 0
        for o in multi:
            if o.op in P2P_OPS:
                ps = L.pp_rank(o.peer)
                if ps != s:
                    k = self.link.op_kernel(o)
                    sk = int(self.skew_max * u01(o.instance, 0x5EED)) if self.skew_max else 0
                    p2p.append((o.instance, o.op == "Send", ps, k.duration_ns, sk))
            else:
                st = L.stages_of(o.comm.ranks) if o.comm.uid not in self._stage_cache else self._stage_cache[o.comm.uid]
                self._stage_cache[o.comm.uid] = st
                if len(st) > 1:
                    stages = st
                    key = o.instance
        n_k = 1 if (self.cfg.imperfections.fuse_grouped_p2p or len(multi) == 1) else len(multi)
        if p2p:
            return _Info("p2p", spec.duration_ns, skew, 0, (s,), p2p, uid, init, n_k)
        if key:
            return _Info("coll", spec.duration_ns, skew, key, stages, [], uid, init, n_k)
        return _Info("intra", spec.duration_ns, skew, 0, (s,), [], uid, init, n_k)

    def _run(self) -> None:
        """Walk the stages' programs side by side: each stage advances until it waits for another
        (a collective spanning stages, a blocking P2P whose peer has not arrived), until every
        program is done; then store the per-stage arrays."""
        cfg, L = self.cfg, self.layout
        pp = cfg.pp
        self._stage_cache: dict[int, tuple[int, ...]] = {}
        states = [_StageState(RankProgram(cfg, L, L.stage_representative(s)).units()) for s in range(pp)]
        walk = _SkeletonWalk(self)
        remaining = pp
        while remaining:
            progress = False
            for s, st in enumerate(states):
                if not st.done and walk.advance(s, st):
                    progress = True
                    if st.done:
                        remaining -= 1
            if not progress:
                where = [(s, st.unit.phase if st.unit else None, len(walk.ends[s])) for s, st in enumerate(states)]
                raise RuntimeError(f"timing skeleton deadlocked (stage, phase, unit): {where}")
        for s in range(pp):
            self.start.append(np.asarray(walk.starts[s], dtype=np.int64))
            self.end.append(np.asarray(walk.ends[s], dtype=np.int64))
            self.skew.append(np.asarray(walk.skews[s], dtype=np.int64))
            self.init.append(np.asarray(walk.inits[s], dtype=np.int64))
            self.n_units[s] = len(walk.starts[s])

    def window_start_ns(self, stage: int, iteration: int) -> int:
        """A lower bound on the true time of the first activity of ``stage``'s ranks from
        ``iteration`` (0-based) on: every call, launch and kernel of its units comes after the
        previous unit's CPU calls, which begin at most ``host_lead_ns`` before that unit's
        stage time (``RankTimer.times``). Where a capture window starts, for the session anchor."""
        firsts = self.first_unit[stage]
        k = min((i for it, i in firsts.items() if it >= iteration), default=self.n_units[stage])
        if k == 0:  # nothing runs before the job starts (true time 0)
            return min(0, int(self.start[stage][0] - self.init[stage][0]) - self.tp.host_lead_ns)
        return int(self.start[stage][k - 1]) - self.tp.host_lead_ns

    @property
    def job_end_ns(self) -> int:
        # a job without a single NCCL unit (one GPU, nothing to communicate) ends at its start
        return int(max((int(e.max()) for e in self.end if len(e)), default=0))


class _SkeletonWalk:
    """The state :meth:`Skeleton._run` shares between the stages while it walks their programs:
    per stage the unit times found so far, and the arrivals at collectives spanning stages and
    at P2P transfers whose other side has not been timed yet."""

    def __init__(self, skel: Skeleton) -> None:
        pp = skel.cfg.pp
        self.skel = skel
        self.settle = skel.settle
        self.issue_ns = skel.tp.issue_ns
        self.starts: list[list[int]] = [[] for _ in range(pp)]
        self.ends: list[list[int]] = [[] for _ in range(pp)]
        self.skews: list[list[int]] = [[] for _ in range(pp)]
        self.inits: list[list[int]] = [[] for _ in range(pp)]
        self.coll: dict[int, dict[int, int]] = {}  # collective key -> stage -> arrival
        self.coll_left: dict[int, int] = {}  # collective key -> stages yet to time it
        self.p2p_arr: dict[tuple[int, bool], int] = {}  # (instance, is send) -> arrival

    def p2p_end(self, eff: int, info: _Info) -> int | None:
        """End of a P2P unit arriving at ``eff``, or None while a peer has not arrived."""
        end = eff + info.dur
        p2p_arr = self.p2p_arr
        for inst, is_send, _ps, dur, sk in info.p2p:
            other = p2p_arr.get((inst, not is_send))
            if other is None:
                return None
            end = max(end, max(eff, other) + sk + dur)
        return end

    def resolve_pending(self, st: _StageState, s: int) -> bool:
        """Time the stage's non-blocking P2P units whose peers have arrived since; False while
        some are still waiting."""
        ok = True
        keep = []
        settle = self.settle
        ends = self.ends[s]
        for idx, info, eff in st.pending:
            e = self.p2p_end(eff, info)
            if e is None:
                ok = False
                keep.append((idx, info, eff))
                continue
            ends[idx] = e
            st.clock = max(st.clock, e + settle)
            st.comm_free[info.comm_uid] = max(st.comm_free.get(info.comm_uid, 0), e + settle)
        st.pending = keep
        return ok

    def advance(self, s: int, st: _StageState) -> bool:
        """Time stage ``s``'s units until it waits for another stage or its program ends.
        Returns whether it made progress (timed a unit, or finished)."""
        progress = False
        settle = self.settle
        while not st.done:
            if st.unit is None and not self._next_unit(s, st):
                if st.pending and not self.resolve_pending(st, s):
                    break
                st.done = True
                return True
            u, info = st.unit, st.info
            assert u is not None and info is not None
            blocking = u.blocking or info.kind != "p2p"
            if not st.arrived and not self._arrive(s, st, u, info, blocking):
                break
            eff = st.eff
            kind = info.kind
            if kind == "none" or kind == "intra":
                end = eff + info.skew + info.dur
            elif kind == "coll":
                arr = self.coll[info.key]
                if len(arr) < len(info.stages):
                    break  # wait for the other stages
                end = max(arr.values()) + info.skew + info.dur
                self.coll_left[info.key] -= 1
                if self.coll_left[info.key] == 0:
                    del self.coll[info.key], self.coll_left[info.key]
            else:
                p2p = self.p2p_end(eff, info)
                if p2p is None:
                    if blocking:
                        break
                    # a non-blocking transfer: the stage goes on, the end is found later
                    self._record(s, eff, -1, info)
                    st.pending.append((len(self.ends[s]) - 1, info, eff))
                    st.clock = eff + self.issue_ns
                    st.unit = None
                    progress = True
                    continue
                end = p2p
            self._record(s, eff, end, info)
            done = end
            if kind != "none":
                done = end + settle
                st.comm_free[info.comm_uid] = done
            st.clock = done if blocking else eff + self.issue_ns
            st.unit = None
            progress = True
        return progress

    def _next_unit(self, s: int, st: _StageState) -> bool:
        """Take the stage's next unit and classify it; False when its program has ended."""
        nxt = next(st.gen, None)
        if nxt is None:
            return False
        st.unit = nxt
        # units are appended in program order: this one gets the next index
        self.skel.first_unit[s].setdefault(nxt.iteration, len(self.starts[s]))
        st.info = self.skel._classify(s, nxt)
        st.arrived = False
        return True

    def _arrive(self, s: int, st: _StageState, u: Unit, info: _Info, blocking: bool) -> bool:
        """The stage arrives at unit ``u``: its effective start (after the compute gap, the
        communicator's previous unit and a host that is behind), recorded for the collective's
        or transfer's other stages. False when it must first wait for its pending transfers."""
        same_comm = any(p[1].comm_uid == info.comm_uid for p in st.pending)
        if st.pending and (blocking or u.gap_ns > 0 or same_comm):
            if not self.resolve_pending(st, s):
                return False
        arrival = st.clock + int(u.gap_ns) + info.init
        eff = max(arrival, st.comm_free.get(info.comm_uid, 0))
        # a host that is behind (a CPU-bound run of small calls) delays the
        # stage's kernels: the other members then wait for them
        h = host_issue(self.skel.tp, st.cpu, eff, eff, info.init, len(u.ops), u.grouped, info.launches)
        eff = max(eff, h.kernel_ready) if info.launches else eff
        st.cpu = h.cpu_end
        st.eff = eff
        st.arrived = True
        if info.kind == "coll":
            self.coll.setdefault(info.key, {})[s] = eff
            self.coll_left.setdefault(info.key, len(info.stages))
        elif info.kind == "p2p":
            for inst, is_send, _ps, _d, _sk in info.p2p:
                self.p2p_arr[(inst, is_send)] = eff
        return True

    def _record(self, s: int, eff: int, end: int, info: _Info) -> None:
        """Append one unit's start, end (-1: found later), skew and init cost to stage ``s``."""
        self.starts[s].append(eff)
        self.ends[s].append(end)
        self.skews[s].append(info.skew)
        self.inits[s].append(info.init)


# --------------------------------------------------------------------------- per-rank realisation


class UnitTimes(NamedTuple):
    """Realised times of one unit on one rank (true ns)."""

    init_start: int  # CPU: communicator creation begins (== call_start when none)
    call_start: list[int]  # CPU: each NCCL API call (log line time)
    group_start: int  # CPU: ncclGroupStart (grouped units) or the first call
    launches: list[tuple[int, int]]  # CPU: kernel launch API calls (one per kernel)
    group_end_start: int  # CPU: ncclGroupEnd begins (grouped units)
    call_end: int  # CPU: end of the last API call (ncclGroupEnd / the call)
    kernels: list[tuple[int, int]]  # GPU: (start, end) of each kernel (fused: one)
    gpu_free: int  # GPU time this unit's work is done (end of last kernel or arrival)


class RankTimer:
    """Realise the skeleton's stage times for one rank (see module docstring)."""

    def __init__(self, skel: Skeleton, rank: int) -> None:
        self.skel = skel
        self.cfg = skel.cfg
        self.tp = skel.tp
        self.rank = rank
        self.stage = skel.layout.pp_rank(rank)
        self.cpu = 0
        self.prev_gpu_end = 0
        self.fuse = self.cfg.imperfections.fuse_grouped_p2p
        self.link = skel.link
        self.comm_end: dict[int, int] = {}  # last kernel end per communicator (its NCCL stream)
        # this stage's skeleton as Python ints (indexing numpy arrays per unit is slow)
        st = self.stage
        self._start = skel.start[st].tolist()
        self._end = skel.end[st].tolist()
        self._skew = skel.skew[st].tolist()
        self._init = skel.init[st].tolist()
        self._n = skel.n_units[st]
        self.end_spread = int(self.cfg.imperfections.end_spread_ns_max)

    def _member_offset(self, o: Op, skew: int) -> int:
        if not skew:
            return 0
        ranks = o.comm.ranks
        straggler = ranks[hash_ints(o.instance, 0x57A6) % len(ranks)]
        if straggler == self.rank:
            return skew
        return int(skew * u01(o.instance, self.rank, 0xA11))

    def times(self, u: Unit) -> UnitTimes:
        i = u.index
        if i >= self._n:
            raise RuntimeError(f"rank {self.rank} has more units than its stage representative ({i})")
        tp = self.tp
        eff = self._start[i]
        end = self._end[i]
        skew = self._skew[i]
        multi = u.multi
        if multi:
            m0 = multi[0]
            arrive = eff + self._member_offset(m0, skew) if skew else eff
            n_k = 1 if (self.fuse or len(multi) == 1) else len(multi)
        else:
            arrive = eff
            n_k = 0
        init_start, group_start, calls, group_end_start, launches, cpu_end, ready = host_issue(
            tp, self.cpu, arrive, eff, self._init[i], len(u.ops), u.grouped, n_k)
        if multi:
            uid = m0.comm_uid
            kstart = self.comm_end.get(uid, 0) + 200
            if arrive > kstart:
                kstart = arrive
            if ready > kstart:
                kstart = ready
            jitter = int(tp.end_jitter_ns * u01(m0.instance, self.rank, 0x1E)) if skew else 0
            kend = end + jitter
            if self.end_spread:  # this rank's GPU finishes its part late (time-shared, straggling)
                kend += int(self.end_spread * u01(m0.instance, self.rank, 0xE5D))
            if kstart + tp.min_kernel_ns > kend:
                kend = kstart + tp.min_kernel_ns
            if n_k == 1:
                kernels = [(kstart, kend)]
            else:
                kernels = []
                weights = [max(self.link.op_kernel(o).duration_ns, 1) for o in multi]
                total = float(sum(weights))
                span = kend - kstart
                a = kstart
                for i, w in enumerate(weights):
                    b = kend if i == len(weights) - 1 else a + max(int(span * w / total), 1)
                    kernels.append((a, b))
                    a = b
            gpu_free = kend
            self.comm_end[uid] = kend
        else:
            kernels = []
            gpu_free = max(arrive, self.prev_gpu_end) + tp.single_rank_ns
        self.cpu = cpu_end
        self.prev_gpu_end = gpu_free
        return UnitTimes(init_start, calls, group_start, launches, group_end_start, cpu_end, kernels,
                         gpu_free)
