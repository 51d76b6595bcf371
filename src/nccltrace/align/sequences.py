"""Per-process sequences to align: launch units from the NCCL log, NCCL kernels from nsys.

A *launch unit* is what NCCL turns into one kernel launch: a lone call, or the calls of one
``ncclGroupStart/End`` on one communicator. The log tells units apart by ``opCount``, which
counts kernel plans per communicator and is shared by every call of one group, as long as it
is informative (it stays 0 on single-rank communicators and, from 2.27.3, on single-node
ones). Where it is not, every call is its own unit and the aligner may fuse consecutive P2P
units of one communicator into one ``SendRecv`` kernel (a many-to-one match).

Kernel names are decoded into a family (the collective they implement) and, for reduction
kernels, the element type (reference/nccl/log-formats.md section 8): signed integer types run
on the unsigned kernels from 2.19, so types are compared by class (width and kind).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numba as nb
import numpy as np
import pandas as pd
from numba import types
from numba.typed import Dict

# Kernel families (codes index bit masks of units).
FAMILIES: tuple[str, ...] = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "SendRecv", "Other")
FAMILY_CODE = {name: i for i, name in enumerate(FAMILIES)}
GENERIC = -1  # ncclDevKernel_Generic or an unparsable name: says nothing about the collective
PLACEHOLDER = -2  # a launch call whose kernel record is missing

# Logged op -> kernel family that runs it (AlltoAll/Gather/Scatter run as grouped P2P).
OP_FAMILY: dict[str, str] = {
    "AllReduce": "AllReduce", "AllGather": "AllGather", "AllGatherV": "AllGather",
    "ReduceScatter": "ReduceScatter", "Broadcast": "Broadcast", "Reduce": "Reduce",
    "Send": "SendRecv", "Recv": "SendRecv", "AlltoAll": "SendRecv", "Gather": "SendRecv", "Scatter": "SendRecv",
}  # fmt: skip
P2P_OPS = frozenset({"Send", "Recv", "AlltoAll", "Gather", "Scatter"})
REDUCTION_FAMILIES = frozenset({"AllReduce", "ReduceScatter", "Reduce"})

# Element-type classes; ncclDataType_t value -> class, kernel name token -> class.
DTYPE_CLASSES: tuple[str, ...] = ("i8", "i32", "i64", "f16", "f32", "f64", "bf16", "f8e4m3", "f8e5m2")
_DTYPE_CLASS_OF_VALUE = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 4, 8: 5, 9: 6, 10: 7, 11: 8}
_DTYPE_TOKEN_CLASS = {
    "u8": 0, "i8": 0, "int8_t": 0, "uint8_t": 0, "u32": 1, "i32": 1, "int32_t": 1, "uint32_t": 1,
    "u64": 2, "i64": 2, "int64_t": 2, "uint64_t": 2, "f16": 3, "half": 3, "f32": 4, "float": 4,
    "f64": 5, "double": 5, "bf16": 6, "__nv_bfloat16": 6, "f8e4m3": 7, "f8e5m2": 8,
}  # fmt: skip
_KERNEL_RE = re.compile(r"^nccl(?:Sym|Symk)?(?:Dev)?Kernel_([A-Za-z]+)(.*)$")

# Algorithms and protocols as kernel names spell them. Specialised kernels carry ALGO_PROTO in
# their name: ncclDevKernel_AllReduce_Sum_f32_RING_LL (>= 2.19), ncclKernel_AllReduce_RING_LL_Sum_float
# (older); generic and SendRecv kernels do not. The name's protocol is the specialised kernel's,
# not necessarily the call's (2.28 runs SIMPLE calls on RING_LL-named kernels); its algorithm is
# the call's (docs/correlation.md, "A call's own evidence").
ALGORITHMS: tuple[str, ...] = ("NVLS_TREE", "COLLNET_DIRECT", "COLLNET_CHAIN", "TREE", "RING", "NVLS", "PAT")
PROTOCOLS: tuple[str, ...] = ("LL128", "LL", "SIMPLE")
ALGORITHM_CODE = {name: i for i, name in enumerate(ALGORITHMS)}
# TUNING-line spellings of some versions -> the kernel name's
_ALGORITHM_ALIASES = {"COLLNETDIRECT": "COLLNET_DIRECT", "COLLNETCHAIN": "COLLNET_CHAIN", "NVLSTREE": "NVLS_TREE"}
_KERNEL_ALGO_RE = re.compile(r"_(" + "|".join(ALGORITHMS) + r")_(" + "|".join(PROTOCOLS) + r")(?![A-Za-z0-9])")


def kernel_algorithm(name: str | None) -> tuple[str | None, str | None]:
    """(algorithm, protocol) a NCCL kernel name carries, (None, None) when it carries none."""
    m = _KERNEL_ALGO_RE.search(name) if isinstance(name, str) else None
    return (m.group(1), m.group(2)) if m else (None, None)


def normalise_algorithm(names: pd.Series) -> pd.Series:
    """Algorithm names as TUNING lines print them, spelled as kernel names spell them."""
    return names.astype("string").str.upper().replace(_ALGORITHM_ALIASES)


def attach_tuning(calls: pd.DataFrame, tuning: pd.DataFrame | None) -> pd.DataFrame:
    """``calls`` with what each call's own TUNING line says of its launch: ``tuned_channels``
    (channel_hi - channel_lo + 1, the >= 2.24 format) and ``tuned_algo`` (kernel-name spelling);
    null where no TUNING line names the call alone. Only standard lines attached to exactly one
    call count: an aggregate of several calls (2.20-2.23) or a symmetric/copy-engine launch says
    nothing certain about one kernel's grid or name."""
    out = calls.copy()
    out["tuned_channels"] = pd.array([pd.NA] * len(out), dtype="Int64")
    out["tuned_algo"] = pd.array([pd.NA] * len(out), dtype="string")
    if tuning is None or tuning.empty or "call_line" not in tuning or not len(out):
        return out
    t = tuning[tuning["call_line"].notna()]
    if "kind" in t:
        t = t[t["kind"].astype("string").fillna("standard") == "standard"]
    if "n_calls" in t:
        t = t[t["n_calls"].astype("Int64").fillna(1) <= 1]
    t = t.drop_duplicates(["file", "call_line"], keep=False)  # two lines for one call: neither is sure
    if t.empty:
        return out
    lo = t["channel_lo"].astype("Int64") if "channel_lo" in t else pd.Series(pd.NA, index=t.index, dtype="Int64")
    hi = t["channel_hi"].astype("Int64") if "channel_hi" in t else pd.Series(pd.NA, index=t.index, dtype="Int64")
    algo = normalise_algorithm(t["algo"]) if "algo" in t else pd.Series(pd.NA, index=t.index, dtype="string")
    ev = pd.DataFrame({"file": t["file"].astype("string").to_numpy(), "line": t["call_line"].astype("int64").to_numpy(),
                       "_ch": (hi - lo + 1).to_numpy(), "_algo": algo.where(algo.isin(ALGORITHMS)).to_numpy()})
    key = pd.MultiIndex.from_arrays([out["file"].astype("string"), out["line"].astype("int64")])
    pos = pd.MultiIndex.from_arrays([ev["file"], ev["line"]]).get_indexer(key)
    hit = pos >= 0
    out.loc[hit, "tuned_channels"] = pd.array(ev["_ch"].to_numpy()[pos[hit]], dtype="Int64")
    out.loc[hit, "tuned_algo"] = pd.array(ev["_algo"].to_numpy()[pos[hit]], dtype="string")
    return out


@dataclass(frozen=True)
class KernelName:
    """What a NCCL kernel name says: family code (GENERIC if nothing) and dtype class (-1 if none)."""

    family: int
    dtype_class: int


def decode_kernel_name(short_name: str | None) -> KernelName:
    """Decode a (short) NCCL kernel name such as ``ncclDevKernel_AllReduce_Sum_f32_RING_LL``."""
    if not short_name:
        return KernelName(GENERIC, -1)
    m = _KERNEL_RE.match(short_name.split("(", 1)[0])
    if not m:
        return KernelName(GENERIC, -1)
    coll, rest = m.group(1), m.group(2)
    if coll == "AllGatherV":
        coll = "AllGather"
    if coll not in FAMILY_CODE or coll == "Other":
        return KernelName(GENERIC, -1)
    dtype = -1
    if coll in REDUCTION_FAMILIES:
        for tok in rest.split("_"):
            if tok in _DTYPE_TOKEN_CLASS:
                dtype = _DTYPE_TOKEN_CLASS[tok]
                break
        # the ≤2.18 names end in the C type, which may contain underscores (__nv_bfloat16)
        if dtype < 0 and rest.endswith("__nv_bfloat16"):
            dtype = _DTYPE_TOKEN_CLASS["__nv_bfloat16"]
    return KernelName(FAMILY_CODE[coll], dtype)


def is_nccl_kernel(short_name: pd.Series) -> pd.Series:
    """Boolean mask of NCCL kernels (``ncclKernel_*``, ``ncclDevKernel_*``, symmetric kernels)."""
    return short_name.fillna("").str.match(r"^nccl(?:Sym|Symk)?(?:Dev)?Kernel_")


@dataclass
class LogUnits:
    """Launch units of one process, in log order, plus per-call bookkeeping.

    ``call_unit[c]`` is the unit of collapsed call ``c`` (-1 for calls that launch nothing);
    ``call_reason[c]`` says why a call is outside every unit.
    """

    calls: pd.DataFrame  # the process's calls in line order (all rows, duplicates included)
    call_unit: np.ndarray  # int64 per call row
    call_reason: np.ndarray  # object per call row: None, 'duplicate_line', 'single_rank_communicator'
    fam_mask: np.ndarray  # int64 per unit: bit f = family f can run this unit
    dt_mask: np.ndarray  # int64 per unit: bit d = dtype class d appears in the unit (0 = unknown, -1 = placeholder)
    stream: np.ndarray  # int64 per unit: index into ``streams``
    comm: np.ndarray  # int64 per unit: index into ``comms``
    op_count: np.ndarray  # int64 per unit (-1 when the comm's opCount is not informative)
    time: np.ndarray  # int64 per unit: wall-clock ns of its last call (NO_TIME when absent)
    fuse_run: np.ndarray  # int64 per unit: consecutive fusable P2P units ending here (>= 1)
    first_call: np.ndarray  # int64 per unit: row of its first call in ``calls`` (-1 for placeholders)
    streams: np.ndarray  # uint64 stream pointers
    comms: np.ndarray  # uint64 comm pointers
    informative_comm: np.ndarray  # bool per comm: opCount separates launches
    placeholder: np.ndarray  # bool per unit: a launch whose call line is missing (opCount gap)
    bytes: np.ndarray  # int64 per unit: summed payload bytes of its calls (-1 for placeholders)
    p2p: np.ndarray  # bool per unit: its calls are Send/Recv
    optional: np.ndarray  # bool per unit: a placeholder whose log position is a guess (may go unmatched freely)
    max_fuse: int = 16

    @property
    def n(self) -> int:
        return len(self.fam_mask)

    def permuted(self, perm: np.ndarray) -> LogUnits:
        """The units in the order ``perm`` (new position -> old index); calls follow their units
        and fusable runs are recomputed for the new neighbours. A placeholder may appear more
        than once (copies at several candidate positions)."""
        inv = np.zeros(self.n, np.int64)
        inv[perm] = np.arange(len(perm))
        per_unit = {name: getattr(self, name)[perm] for name in (
            "fam_mask", "dt_mask", "stream", "comm", "op_count", "time", "first_call", "placeholder", "bytes", "p2p",
            "optional")}
        return LogUnits(
            calls=self.calls,
            call_unit=(np.where(self.call_unit >= 0, inv[np.maximum(self.call_unit, 0)], -1) if len(inv)
                       else np.full_like(self.call_unit, -1)),
            call_reason=self.call_reason,
            fuse_run=fuse_runs(per_unit["p2p"], per_unit["comm"], per_unit["stream"], self.informative_comm,
                               self.max_fuse),
            streams=self.streams,
            comms=self.comms,
            informative_comm=self.informative_comm,
            max_fuse=self.max_fuse,
            **per_unit,
        )

    def with_optional(self, optional: np.ndarray) -> LogUnits:
        """The same units with other optional placeholders."""
        return replace(self, optional=np.asarray(optional, bool))


def fuse_runs(p2p: np.ndarray, comm: np.ndarray, stream: np.ndarray, informative: np.ndarray,
              max_fuse: int) -> np.ndarray:  # fmt: skip
    """Per unit: consecutive fusable units ending there (>= 1). Consecutive P2P units of one comm
    whose opCount does not separate launches may be one kernel."""
    nu = len(p2p)
    adjacent = np.zeros(nu, bool)
    if nu > 1:
        adjacent[1:] = (p2p[1:] & p2p[:-1] & (comm[1:] == comm[:-1]) & ~informative[comm[1:]]
                        & (stream[1:] == stream[:-1]))  # fmt: skip
    return _runs(adjacent, max_fuse)


NO_TIME = np.iinfo(np.int64).min
_RECENT_UNITS = 64  # a group's calls on one comm are logged close together


@dataclass(frozen=True)
class _CallColumns:
    """The columns of a process's calls (in line order) that grouping reads, as NumPy arrays."""

    op: np.ndarray  # object
    comm: np.ndarray  # uint64 pointer (0 when absent)
    nranks: np.ndarray  # int64 (-1 when absent)
    op_count: np.ndarray  # int64 (-1 when absent)
    dtype: np.ndarray  # int64 ncclDataType_t (-1 when absent)
    stream: np.ndarray  # uint64 pointer (0 when absent)
    nbytes: np.ndarray  # int64
    dup: np.ndarray  # bool: a duplicate line
    wall: np.ndarray  # int64 wall-clock ns (NO_TIME when absent)

    @classmethod
    def of(cls, calls: pd.DataFrame) -> _CallColumns:
        n = len(calls)
        return cls(
            op=calls["op"].astype(object).to_numpy(),
            comm=calls["comm"].astype("UInt64").fillna(0).to_numpy(dtype=np.uint64),
            nranks=calls["nranks"].astype("Int64").fillna(-1).to_numpy(dtype=np.int64),
            op_count=calls["op_count"].astype("Int64").fillna(-1).to_numpy(dtype=np.int64),
            dtype=calls["datatype"].astype("Int64").fillna(-1).to_numpy(dtype=np.int64),
            stream=calls["stream"].astype("UInt64").fillna(0).to_numpy(dtype=np.uint64),
            nbytes=(calls["bytes"].astype("Int64").fillna(0).to_numpy(dtype=np.int64) if "bytes" in calls
                    else np.zeros(n, np.int64)),
            dup=calls["duplicate_of"].notna().to_numpy() if "duplicate_of" in calls else np.zeros(n, bool),
            wall=(calls["wall_time_ns"].astype("Int64").fillna(NO_TIME).to_numpy(dtype=np.int64)
                  if "wall_time_ns" in calls else np.full(n, NO_TIME, np.int64)),
        )


def build_log_units(calls: pd.DataFrame, *, nccl_version: tuple[int, int, int] | None = None,
                    max_fuse: int = 16, capture_ns: tuple[int, int] | None = None,
                    outside: np.ndarray | None = None) -> LogUnits:  # fmt: skip
    """Group one process's call lines into launch units (see module docstring). ``nccl_version``
    says whether opCount counts launches on every communicator (before 2.27.3).

    ``capture_ns`` (wall-clock ns, as the log's timestamps): the span in which the export can
    hold a line's kernel; timed lines outside it get reason ``outside_capture`` and no unit.
    ``outside`` (bool per call in line order): lines known to be outside the capture by other
    evidence (a declared step range). An opCount gap is then counted from the communicator's
    last line before the capture, not from zero."""
    calls = calls.sort_values(["file", "line"], kind="stable").reset_index(drop=True)
    n = len(calls)
    col = _CallColumns.of(calls)
    comms, comm_idx = np.unique(col.comm, return_inverse=True)
    streams, stream_idx = np.unique(col.stream, return_inverse=True)
    out = np.zeros(n, bool) if outside is None else np.asarray(outside, bool).copy()
    if capture_ns is not None:
        out |= (col.wall != NO_TIME) & ((col.wall < capture_ns[0]) | (col.wall > capture_ns[1]))
    multi = ~col.dup & (col.nranks != 1)
    live = multi & ~out
    informative = _informative_comms(live, comm_idx, col.op_count, len(comms), nccl_version)
    reason = np.full(n, None, dtype=object)
    reason[out] = "outside_capture"
    reason[col.dup] = "duplicate_line"
    reason[~col.dup & (col.nranks == 1)] = "single_rank_communicator"
    before = _count_before_capture(out & multi & (col.op_count >= 0), live, comm_idx, col.op_count, len(comms))
    call_fam, call_dt = _call_codes(col.op, col.dtype)
    grouped = _group_units(live, comm_idx.astype(np.int64), col.op_count, call_fam, call_dt,
                           stream_idx.astype(np.int64), col.wall, col.nbytes, informative, _RECENT_UNITS)  # fmt: skip
    call_unit, u = _with_placeholders(grouped, informative, before)

    nu = len(u["fam_mask"])
    call_is_p2p = pd.Series(col.op, dtype=object).isin(P2P_OPS).to_numpy() if n else np.zeros(0, bool)
    is_p2p_unit = (u["first"] >= 0) & call_is_p2p[np.maximum(u["first"], 0)] if nu else np.zeros(0, bool)
    fuse_run = fuse_runs(is_p2p_unit, np.asarray(u["comm"], np.int64), np.asarray(u["stream"], np.int64),
                         informative, max_fuse)  # fmt: skip
    return LogUnits(
        calls=calls,
        call_unit=call_unit,
        call_reason=reason,
        fam_mask=np.asarray(u["fam_mask"], np.int64),
        dt_mask=np.asarray(u["dt_mask"], np.int64),
        stream=np.asarray(u["stream"], np.int64),
        comm=np.asarray(u["comm"], np.int64),
        op_count=np.asarray(u["opc"], np.int64),
        time=np.asarray(u["time"], np.int64),
        fuse_run=fuse_run,
        first_call=np.asarray(u["first"], np.int64),
        streams=streams,
        comms=comms,
        informative_comm=informative,
        placeholder=u["placeholder"],
        bytes=u["bytes"],
        p2p=np.asarray(is_p2p_unit, bool),
        optional=u["optional"],
        max_fuse=max_fuse,
    )


def _informative_comms(live: np.ndarray, comm_idx: np.ndarray, op_count: np.ndarray, n_comms: int,
                       nccl_version: tuple[int, int, int] | None) -> np.ndarray:  # fmt: skip
    """Per communicator: its opCount separates launches."""
    # opCount counts launches on every multi-rank comm before NCCL 2.27.3; from then on it stays
    # 0 on single-node comms. Without the version, a comm whose opCount takes one value over
    # several calls cannot be told from a frozen one and is treated as not informative.
    informative = np.zeros(n_comms, bool)
    counts_always = nccl_version is not None and tuple(nccl_version) < (2, 27, 3)
    for c in range(n_comms):
        vals = op_count[live & (comm_idx == c)]
        informative[c] = counts_always or len(vals) <= 1 or len(np.unique(vals)) > 1
    return informative


def _count_before_capture(pre: np.ndarray, live: np.ndarray, comm_idx: np.ndarray, op_count: np.ndarray,
                          n_comms: int) -> np.ndarray:  # fmt: skip
    """Per communicator, the opCount of its last counted line (``pre``: counted lines outside the
    capture) before its first live line, -1 for none: where the comm's count stood when the
    capture began."""
    before = np.full(n_comms, -1, np.int64)
    if pre.any():
        first_in = np.full(n_comms, len(live), np.int64)
        live_idx = np.flatnonzero(live)
        np.minimum.at(first_in, comm_idx[live_idx], live_idx)
        sel = np.flatnonzero(pre)
        sel = sel[sel < first_in[comm_idx[sel]]]
        np.maximum.at(before, comm_idx[sel], op_count[sel])
    return before


def _call_codes(op: np.ndarray, dtype: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per call, the code of the kernel family that runs its op and its element-type class (-1 unknown)."""
    fam_codes = {name: FAMILY_CODE[OP_FAMILY.get(name, "Other")] for name in pd.unique(op) if isinstance(name, str)}
    call_fam = (pd.Series(op, dtype=object).map(fam_codes).fillna(FAMILY_CODE["Other"]).to_numpy(np.int64)
                if len(op) else np.zeros(0, np.int64))  # fmt: skip
    dt_lut = np.full(256, -1, np.int64)
    for value, cls in _DTYPE_CLASS_OF_VALUE.items():
        dt_lut[value] = cls
    call_dt = np.where((dtype >= 0) & (dtype < 256), dt_lut[np.clip(dtype, 0, 255)], -1)
    return call_fam, call_dt


def _missing_launches(u_comm: np.ndarray, u_opc: np.ndarray, informative: np.ndarray,
                      before: np.ndarray) -> tuple[list[int], list[int], list[float], list[bool]]:  # fmt: skip
    """The launches whose lines are missing (gaps in an informative comm's opCounts): per
    placeholder the unit it follows (or precedes), its opCount, its offset from that unit in
    the unit order, and whether its position is a guess."""
    # opCount starts at 0 on every communicator, so a later first value means lost first lines.
    real = np.flatnonzero(informative[u_comm])
    order = real[np.lexsort((u_opc[real], u_comm[real]))]
    ph_after, ph_opc, ph_rank, ph_opt = [], [], [], []
    if len(order):
        comm_o, opc_o = u_comm[order], u_opc[order]
        starts = np.r_[True, comm_o[1:] != comm_o[:-1]]
        prev_opc = np.where(starts, before[comm_o], np.r_[-1, opc_o[:-1]])
        missing = np.minimum(opc_o - prev_opc - 1, 64)
        for k in np.flatnonzero(missing > 0):
            for q in range(int(missing[k])):
                if starts[k]:  # before the comm's first unit
                    ph_after.append(order[k])
                    ph_opc.append(int(opc_o[k]) - 1 - q)
                    ph_rank.append(-(q + 1) / 128.0)
                    ph_opt.append(True)  # how long before the comm's first line is unknown
                else:  # after the previous unit of the comm
                    ph_after.append(order[k - 1])
                    ph_opc.append(int(prev_opc[k]) + 1 + q)
                    ph_rank.append((q + 1) / 128.0)
                    # exact when nothing else was logged between the comm's neighbours
                    ph_opt.append(bool(order[k] - order[k - 1] > 1))
    return ph_after, ph_opc, ph_rank, ph_opt


def _with_placeholders(grouped: tuple[np.ndarray, ...], informative: np.ndarray,
                       before: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:  # fmt: skip
    """The units of :func:`_group_units` with a placeholder unit (any family, the comm's stream)
    for each missing launch, right after the comm's previous unit, so that launch's kernel is
    not free for a neighbouring unit whose own kernel is missing. Returns the unit of each call
    and the per-unit arrays, in the new order."""
    (call_unit, fam_mask, dt_mask, u_stream, u_comm, u_opc, u_time, u_first, u_bytes) = grouped
    ph_after, ph_opc, ph_rank, ph_opt = _missing_launches(u_comm, u_opc, informative, before)
    n_ph = len(ph_after)
    like = np.asarray(ph_after, np.int64)
    order_key = np.r_[u_first.astype(np.float64), u_first[like].astype(np.float64) + np.asarray(ph_rank)]
    perm = np.argsort(order_key, kind="stable")
    inv = np.empty(len(perm), np.int64)
    inv[perm] = np.arange(len(perm))
    # no unit at all (every line outside the capture): nothing to index
    call_unit = np.where(call_unit >= 0, inv[np.maximum(call_unit, 0)], -1) if len(inv) else np.full_like(call_unit, -1)
    all_fams = (1 << len(FAMILIES)) - 1

    def _p(x: np.ndarray, extra) -> np.ndarray:
        return np.r_[x, extra][perm]

    n_real = len(u_first)
    return call_unit, {
        "fam_mask": _p(fam_mask, np.full(n_ph, all_fams, np.int64)),
        "dt_mask": _p(dt_mask, np.full(n_ph, -1, np.int64)),  # -1 marks a placeholder for the scorer
        "stream": _p(u_stream, u_stream[like]),
        "comm": _p(u_comm, u_comm[like]),
        "opc": _p(u_opc, np.asarray(ph_opc, np.int64)),
        "time": _p(u_time, np.full(n_ph, NO_TIME, np.int64)),
        "first": _p(u_first, np.full(n_ph, -1, np.int64)),
        "bytes": _p(u_bytes, np.full(n_ph, -1, np.int64)),
        "placeholder": _p(np.zeros(n_real, bool), np.ones(n_ph, bool)),
        "optional": _p(np.zeros(n_real, bool), np.asarray(ph_opt, bool)),
    }


@nb.njit(cache=True)
def _group_units(live, comm, op_count, fam, dt, stream, wall, nbytes, informative, recent):
    """Compiled core of build_log_units: calls -> launch units (same comm and opCount, recent)."""
    n = live.shape[0]
    call_unit = np.full(n, -1, np.int64)
    fam_mask = np.zeros(n, np.int64)
    dt_mask = np.zeros(n, np.int64)
    u_stream = np.zeros(n, np.int64)
    u_comm = np.zeros(n, np.int64)
    u_opc = np.zeros(n, np.int64)
    u_time = np.zeros(n, np.int64)
    u_first = np.zeros(n, np.int64)
    u_bytes = np.zeros(n, np.int64)
    open_units = Dict.empty(key_type=types.int64, value_type=types.int64)  # (comm << 40) + opCount
    nu = 0
    for r in range(n):
        if not live[r]:
            continue
        c = comm[r]
        u = -1
        if informative[c]:
            key = (c << 40) + op_count[r]
            if key in open_units:
                prev = open_units[key]
                if prev >= nu - recent:
                    u = prev
        if u < 0:
            u = nu
            nu += 1
            u_stream[u] = stream[r]
            u_comm[u] = c
            u_opc[u] = op_count[r] if informative[c] else -1
            u_time[u] = wall[r]
            u_first[u] = r
            if informative[c]:
                open_units[(c << 40) + op_count[r]] = u
        fam_mask[u] |= np.int64(1) << fam[r]
        if dt[r] >= 0:
            dt_mask[u] |= np.int64(1) << dt[r]
        call_unit[r] = u
        u_bytes[u] += nbytes[r]
        if wall[r] != NO_TIME and wall[r] > u_time[u]:  # a unit is timed by its last call (launch follows)
            u_time[u] = wall[r]
    return (call_unit, fam_mask[:nu], dt_mask[:nu], u_stream[:nu], u_comm[:nu], u_opc[:nu], u_time[:nu],
            u_first[:nu], u_bytes[:nu])  # fmt: skip


@nb.njit(cache=True)
def _runs(adjacent, cap):
    run = np.ones(adjacent.shape[0], np.int64)
    for i in range(1, adjacent.shape[0]):
        if adjacent[i]:
            run[i] = min(run[i - 1] + 1, cap)
    return run


@dataclass
class KernelSeq:
    """NCCL kernels of one process in launch order."""

    kernels: pd.DataFrame  # rows in launch order
    family: np.ndarray  # int64 family code or GENERIC
    dtype_class: np.ndarray  # int64 (-1 when the name carries none)
    stream: np.ndarray  # int64 index into ``streams``
    time: np.ndarray  # int64 launch time in UTC ns (NO_TIME when unknown)
    streams: np.ndarray  # stream ids
    placeholder: np.ndarray  # bool: a launch whose kernel record is missing from the export
    grid: np.ndarray  # int64 grid size (gridX*gridY*gridZ, NCCL's channel count); -1 unknown

    @property
    def m(self) -> int:
        return len(self.family)


def build_kernel_sequence(kernels: pd.DataFrame, *, utc_offset_ns: int | None = None,
                          launches_without_kernel: pd.DataFrame | None = None) -> KernelSeq:  # fmt: skip
    """NCCL kernels of one process ordered by launch (CUPTI correlation ids follow API call order).

    Launch calls whose kernel record is missing (``launches_without_kernel``) are kept as
    placeholders in launch order: a unit matched to one launched a kernel whose record is lost,
    and no unit has to slide onto a neighbour's kernel to fill the hole."""
    k = kernels[is_nccl_kernel(kernels["short_name"].astype(object))].copy()
    k["_placeholder"] = False
    if launches_without_kernel is not None and len(launches_without_kernel):
        lw = launches_without_kernel
        ph = pd.DataFrame({
            "correlation_id": lw["correlation_id"].astype("Int64"), "launch_start": lw["start"].astype("Int64"),
            "launch_end": lw["end"].astype("Int64"), "launch_tid": lw["tid"].astype("Int64"),
            "launch_api": lw["api"], "pid": lw["pid"].astype("Int64"), "_placeholder": True,
        })  # fmt: skip
        if "global_tid" in lw:
            ph["global_pid"] = (lw["global_tid"].astype("Int64") // (1 << 24)) * (1 << 24)
        if "capture_span" in lw:  # made during a stream capture: a graph node, not a lost record
            ph["capture_span"] = lw["capture_span"].astype("Int64").to_numpy()
        k = pd.concat([k, ph], ignore_index=True)
    launch = k["launch_start"].astype("Int64") if "launch_start" in k else pd.Series(pd.NA, index=k.index)
    k["_launch"] = launch.fillna(k["start"].astype("Int64") if "start" in k else pd.NA)
    order = ["correlation_id", "_launch"] if k["correlation_id"].notna().all() else ["_launch"]
    k = k.sort_values(order, kind="stable").reset_index(drop=True)
    names = k["short_name"].astype(object).to_numpy()
    cache: dict[str, KernelName] = {}
    fam = np.empty(len(k), np.int64)
    dt = np.empty(len(k), np.int64)
    for i, nm in enumerate(names):
        if not isinstance(nm, str):
            fam[i], dt[i] = (PLACEHOLDER if k["_placeholder"].iat[i] else GENERIC), -1
            continue
        d = cache.get(nm)
        if d is None:
            d = cache[nm] = decode_kernel_name(nm)
        fam[i], dt[i] = d.family, d.dtype_class
    sid = k["stream_id"].astype("Int64").fillna(-1).to_numpy(np.int64) if len(k) else np.zeros(0, np.int64)
    streams = np.unique(sid[sid >= 0])
    sidx = np.where(sid >= 0, np.searchsorted(streams, sid), -1).astype(np.int64)
    t = np.full(len(k), NO_TIME, np.int64)
    if utc_offset_ns is not None:
        launch_ns = k["_launch"].astype("Int64")
        known = launch_ns.notna().to_numpy()
        t[known] = launch_ns[known].to_numpy(np.int64) + np.int64(utc_offset_ns)
    placeholder = k["_placeholder"].to_numpy(bool)
    grid = np.full(len(k), -1, np.int64)
    if "grid_x" in k:
        g = k["grid_x"].astype("Int64")
        for extra in ("grid_y", "grid_z"):
            if extra in k:
                g = g * k[extra].astype("Int64").fillna(1)
        grid = g.fillna(-1).to_numpy(np.int64)
    return KernelSeq(kernels=k.drop(columns=["_launch", "_placeholder"]), family=fam, dtype_class=dt, stream=sidx,
                     time=t, streams=streams, placeholder=placeholder, grid=grid)  # fmt: skip
