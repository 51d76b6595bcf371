"""Per-operation bandwidth, wait/transfer split, stragglers, theoretical limits and algorithms.

From a run's enriched ops table and the per-process parse outputs (topology, TUNING lines, init
lines with bus ids) it computes five tables: ``op_metrics`` (per call), ``instances`` (per
collective instance across its ranks), ``stragglers``, ``limits`` (bottleneck link per
communicator) and ``algorithms`` (NCCL's choice by message size). Bandwidths in GB/s (1 GB = 1e9
B, as nccl-tests), times in ns. Everything is column-wise; only the small topology and
communicator lists are walked in Python. Definitions and the limit model: ``docs/metrics.md``;
columns: ``docs/tables.md``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from nccltrace.align.schema import OUTSIDE_CAPTURE_REASON
from nccltrace.align.sequences import kernel_algorithm, normalise_algorithm
from nccltrace.core.spill import PartSpill, merge_sorted_parts
from nccltrace.core.tables import (
    SCHEMA_VERSION,
    coerce_to_schema,
    frame_to_table,
    iter_record_batches,
    read_table,
    read_table_batch,
    write_table_atomic,
)
from nccltrace.core.tables import documented_field as _f

# The columns of the ops' call rows the metrics use, and the ops columns they read (the
# workflow reads only these; tests check the result equals the one from every column).
_CALL_COLUMNS = ["file", "line", "host", "pid", "op", "comm", "op_count", "kernel_global_pid", "kernel_correlation_id",
                 "kernel_name", "kernel_start", "kernel_end", "status", "duplicate_of", "nranks", "root", "bytes",
                 "message_bytes", "logical_id", "global_rank", "rank_in_comm", "parallelism", "instance",
                 "kernel_start_sync", "kernel_end_sync", "reason"]  # fmt: skip
OPS_COLUMNS = ["row_kind", *_CALL_COLUMNS]

# The tables of each process's parse (parsed/nccl/<proc>/) that compute_run_metrics reads.
PARSED_TABLES = ("tuning", "topology_links", "topology_systems", "comms")

GB = 1e9  # nccl-tests reports GB/s with 1 GB = 1e9 bytes

# nccl-tests bus-bandwidth factors (doc/PERFORMANCE.md of nccl-tests): the share of the message
# each rank must move over its busiest link, so busbw is comparable to a link's bandwidth.
_FACTOR_2N = frozenset({"AllReduce"})  # 2(n-1)/n
_FACTOR_N = frozenset({"AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter"})  # (n-1)/n
_FACTOR_1 = frozenset({"Broadcast", "Reduce", "Send", "Recv", "SendRecv"})  # 1
_P2P = frozenset({"Send", "Recv"})



def _schema(fields: list[pa.Field], table: str, doc: str) -> pa.Schema:
    return pa.schema(fields, metadata={"table": table, "doc": doc, "nccltrace_schema_version": SCHEMA_VERSION})


_LIMIT_COLS = [
    _f("limit_gbps", pa.float64(), "GB/s", "theoretical bus-bandwidth ceiling: bandwidth of the bottleneck link "
       "among the members (nccl-tests busbw is normalised so that it compares directly with it); null when unknown"),
    _f("limit_link", pa.string(), "", "the bottleneck, e.g. 'NVL 240.0 GB/s: GPU 0-7000 on node000 (3 NVLinks to the "
       "other members)'"),
    _f("limit_source", pa.string(), "", "'topology' (from the parsed topology dumps), 'fallback: <value assumed and "
       "why>' or 'unavailable: <reason>'"),
]

OP_METRICS_SCHEMA = _schema(
    [
        _f("file", pa.string(), "", "log file of the call (key with line)"),
        _f("line", pa.int64(), "", "1-based line of the call in that file"),
        _f("host", pa.string(), "", "host of the process"),
        _f("pid", pa.int64(), "", "process id"),
        _f("global_rank", pa.int32(), "", "global rank of the process"),
        _f("rank_in_comm", pa.int32(), "", "rank of the process in the communicator"),
        _f("logical_id", pa.int32(), "", "logical communicator; null if unresolved"),
        _f("nranks", pa.int32(), "", "communicator size"),
        _f("op", pa.string(), "", "logged NCCL function"),
        _f("parallelism", pa.string(), "", "parallelism the communicator serves"),
        _f("instance", pa.string(), "", "cross-rank collective instance key (ops.instance)"),
        _f("status", pa.string(), "", "alignment status of the call ('matched' or 'unmatched'); every time-derived "
           "figure is null unless 'matched'"),
        _f("instance_status", pa.string(), "", "status of the call's instance (instances.status); null without "
           "instance (P2P, duplicate lines, single-rank communicators)"),
        _f("message_bytes", pa.int64(), "B", "nccl-tests message size S (AllGather/ReduceScatter: per-rank count x "
           "nranks x type size)"),
        _f("duration_ns", pa.int64(), "ns", "kernel duration on the node's clock (end - start)"),
        _f("algbw_gbps", pa.float64(), "GB/s", "algorithm bandwidth S / duration"),
        _f("bus_factor", pa.float64(), "", "nccl-tests bus factor: AllReduce 2(n-1)/n; AllGather, ReduceScatter, "
           "AlltoAll, Gather, Scatter (n-1)/n; Broadcast, Reduce, Send, Recv 1; null for n = 1 (nothing crosses a "
           "link)"),
        _f("busbw_gbps", pa.float64(), "GB/s", "bus bandwidth algbw x bus_factor of this call"),
        _f("kernel_calls", pa.int32(), "", "calls executed by the same kernel launch (fused groups, e.g. grouped "
           "Send/Recv); 1 for a lone call"),
        _f("kernel_busbw_gbps", pa.float64(), "GB/s", "bus bandwidth of the whole kernel: bus bytes of all its calls "
           "(collectives: sum S x factor; P2P: max of bytes sent, bytes received) / duration; = busbw_gbps when "
           "kernel_calls = 1"),
        _f("arrival_offset_ns", pa.int64(), "ns", "own kernel start - first start of the instance (synchronised "
           "clocks); complete instances only"),
        _f("wait_ns", pa.int64(), "ns", "time the rank's kernel waited for the last rank: last start - own start, "
           "clipped to [0, duration]; complete instances only"),
        _f("transfer_ns", pa.int64(), "ns", "duration - wait: own end - last arrival; complete instances only"),
        _f("transfer_busbw_gbps", pa.float64(), "GB/s", "kernel bus bytes / transfer_ns (bandwidth once every rank "
           "is present); null when transfer_ns <= 0"),
        _f("arrival_skew_ns", pa.int64(), "ns", "last start - first start of the call's instance"),
    ]
    + _LIMIT_COLS
    + [
        _f("limit_scope", pa.string(), "", "'communicator' (bottleneck over all members) or 'pair' (P2P kernels "
           "with a single peer: the two GPUs involved)"),
        _f("algbw_limit_gbps", pa.float64(), "GB/s", "algorithm-bandwidth ceiling limit_gbps / bus_factor (the "
           "algorithm-specific factor applied to the link)"),
        _f("efficiency", pa.float64(), "", "kernel_busbw_gbps / limit_gbps (= busbw / limit for lone calls)"),
        _f("transfer_efficiency", pa.float64(), "", "transfer_busbw_gbps / limit_gbps"),
        _f("algorithm", pa.string(), "", "NCCL algorithm (RING, TREE, NVLS, COLLNET_DIRECT, PAT, ...)"),
        _f("protocol", pa.string(), "", "NCCL protocol (LL, LL128, SIMPLE)"),
        _f("algo_source", pa.string(), "", "'tuning' (a TUNING line of this call or of another rank's call of the "
           "same instance) or 'kernel_name' (parsed from the kernel name); null when neither tells"),
    ],
    "op_metrics",
    "Per run (metrics/): bandwidth, wait/transfer, limit, efficiency and algorithm of every call (nccltrace.metrics.compute).",
)

INSTANCE_SCHEMA = _schema(
    [
        _f("instance", pa.string(), "", "instance key (ops.instance)"),
        _f("logical_id", pa.int32(), "", "logical communicator"),
        _f("op", pa.string(), "", "collective"),
        _f("parallelism", pa.string(), "", "parallelism the communicator serves"),
        _f("nranks", pa.int32(), "", "communicator size"),
        _f("message_bytes", pa.int64(), "B", "nccl-tests message size S"),
        _f("rows", pa.int32(), "", "call rows of the instance in ops (all ranks)"),
        _f("ranks_matched", pa.int32(), "", "distinct ranks whose call is matched to a kernel"),
        _f("status", pa.string(), "", "'complete' (every rank matched, clocks synchronised: cross-rank figures "
           "computed), 'incomplete' (ranks missing: excluded from wait/transfer), 'not_synced' (a member's clock "
           "is not related to the reference) or 'not_captured' (every rank's call lies outside the capture window "
           "of a step-window capture: not a gap, the capture chose it)"),
        _f("reason", pa.string(), "", "why the instance is not complete (null when complete)"),
        _f("first_start_ns", pa.int64(), "ns", "first kernel start (synchronised clock)"),
        _f("last_start_ns", pa.int64(), "ns", "last kernel start = arrival of the last rank"),
        _f("last_end_ns", pa.int64(), "ns", "last kernel end"),
        _f("arrival_skew_ns", pa.int64(), "ns", "last start - first start"),
        _f("end_skew_ns", pa.int64(), "ns", "last end - first end (small: a collective ends nearly together)"),
        _f("last_rank", pa.int32(), "", "global rank that arrived last; null when several ranks share the latest "
           "start (no single straggler)"),
        _f("total_wait_ns", pa.int64(), "ns", "sum of the ranks' waits = wait caused by the last rank"),
        _f("transfer_ns", pa.int64(), "ns", "last end - last start: the collective's time once every rank is there"),
        _f("median_busbw_gbps", pa.float64(), "GB/s", "median over ranks of the kernel-duration bus bandwidth"),
        _f("transfer_busbw_gbps", pa.float64(), "GB/s", "S x bus_factor / transfer_ns"),
    ],
    "instances",
    "Per run (metrics/): one row per collective instance across its ranks (nccltrace.metrics.compute).",
)

STRAGGLER_SCHEMA = _schema(
    [
        _f("logical_id", pa.int32(), "", "logical communicator"),
        _f("parallelism", pa.string(), "", "parallelism the communicator serves"),
        _f("nranks", pa.int32(), "", "communicator size"),
        _f("global_rank", pa.int32(), "", "member"),
        _f("instances", pa.int64(), "", "complete instances of the communicator this rank took part in"),
        _f("last_arrivals", pa.int64(), "", "instances in which this rank arrived last"),
        _f("last_share", pa.float64(), "", "last_arrivals / instances"),
        _f("wait_caused_ns", pa.int64(), "ns", "sum of the other ranks' wait in the instances this rank arrived last"),
        _f("own_wait_ns", pa.int64(), "ns", "sum of this rank's own wait"),
        _f("mean_arrival_offset_ns", pa.float64(), "ns", "mean of own start - first start"),
    ],
    "stragglers",
    "Per run (metrics/): who arrives last at the collectives of each communicator, how often, at what cost.",
)

LIMIT_SCHEMA = _schema(
    [
        _f("logical_id", pa.int32(), "", "logical communicator"),
        _f("nranks", pa.int32(), "", "communicator size"),
        _f("parallelism", pa.string(), "", "parallelism the communicator serves"),
        _f("members", pa.string(), "", "global ranks by rank in comm, comma-separated (-1 unknown)"),
        _f("hosts", pa.int32(), "", "distinct hosts of the located members"),
        _f("link_type", pa.string(), "", "type of the bottleneck: NVL, PCI, SYS or NET; null for fallbacks"),
    ]
    + _LIMIT_COLS
    + [
        _f("ops_timed", pa.int64(), "", "matched calls of the communicator with a bandwidth"),
        _f("median_busbw_gbps", pa.float64(), "GB/s", "median kernel bus bandwidth of those calls"),
        _f("median_efficiency", pa.float64(), "", "median efficiency of those calls"),
        _f("median_transfer_efficiency", pa.float64(), "", "median transfer efficiency (complete instances)"),
    ],
    "limits",
    "Per run (metrics/): theoretical limit of each logical communicator from the parsed topology.",
)

ALGORITHM_SCHEMA = _schema(
    [
        _f("logical_id", pa.int32(), "", "logical communicator"),
        _f("parallelism", pa.string(), "", "parallelism the communicator serves"),
        _f("op", pa.string(), "", "collective"),
        _f("min_bytes", pa.int64(), "B", "smallest message size S of the range"),
        _f("max_bytes", pa.int64(), "B", "largest message size S of the range"),
        _f("algorithm", pa.string(), "", "algorithm used throughout the range (per size: the most frequent)"),
        _f("protocol", pa.string(), "", "protocol used throughout the range"),
        _f("source", pa.string(), "", "'tuning', 'kernel_name' or 'tuning+kernel_name' (calls of both kinds)"),
        _f("count", pa.int64(), "", "calls in the range with this algorithm/protocol (all ranks)"),
        _f("other_count", pa.int64(), "", "calls in the range whose size bucket chose differently (minority)"),
    ],
    "algorithms",
    "Per run (metrics/): algorithm/protocol transitions over message size per communicator and op.",
)

TABLE_SCHEMAS: dict[str, pa.Schema] = {
    "op_metrics": OP_METRICS_SCHEMA,
    "instances": INSTANCE_SCHEMA,
    "stragglers": STRAGGLER_SCHEMA,
    "limits": LIMIT_SCHEMA,
    "algorithms": ALGORITHM_SCHEMA,
}


@dataclass
class RunMetrics:
    """The metrics tables of one run (schemas above) and notes on what could not be computed."""

    op_metrics: pd.DataFrame
    instances: pd.DataFrame
    stragglers: pd.DataFrame
    limits: pd.DataFrame
    algorithms: pd.DataFrame
    problems: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# bus factors


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor of ``op`` on a communicator of ``n`` ranks.

    AllReduce 2(n-1)/n; AllGather, ReduceScatter, AlltoAll, Gather, Scatter (n-1)/n; Broadcast,
    Reduce, Send, Recv, SendRecv 1. For ``n == 1`` the result is NaN: a single-rank
    communicator moves nothing over any link (NCCL launches no kernel), so a bus bandwidth
    is undefined rather than 0 (the formula's value) or 1. Unknown ops and ``n < 1`` raise.
    """
    n = int(n)
    if n < 1:
        raise ValueError(f"communicator size must be >= 1, got {n}")
    if op not in _FACTOR_2N | _FACTOR_N | _FACTOR_1:
        raise ValueError(f"no bus factor for op {op!r}")
    if n == 1:
        return math.nan
    if op in _FACTOR_2N:
        return 2.0 * (n - 1) / n
    if op in _FACTOR_N:
        return (n - 1) / n
    return 1.0


def _bus_factors(op: pd.Series, n: pd.Series) -> np.ndarray:
    """Vectorised :func:`bus_factor` (NaN for unknown ops, unknown or single-rank sizes)."""
    nn = n.astype("Float64").to_numpy(dtype=float, na_value=np.nan)
    ops = op.astype("string").fillna("")
    out = np.full(len(op), np.nan)
    valid = nn >= 2
    with np.errstate(invalid="ignore", divide="ignore"):
        two = (ops.isin(_FACTOR_2N).to_numpy()) & valid
        one_n = (ops.isin(_FACTOR_N).to_numpy()) & valid
        one = (ops.isin(_FACTOR_1).to_numpy()) & valid
        out[two] = 2.0 * (nn[two] - 1) / nn[two]
        out[one_n] = (nn[one_n] - 1) / nn[one_n]
        out[one] = 1.0
    return out


# --------------------------------------------------------------------------------------------
# small helpers


def _i64(s: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """int64 values (0 where null) and the validity mask; nanosecond epochs must stay integers
    (float64 has a 256 ns resolution at 1.7e18)."""
    s = s.astype("Int64")
    return s.to_numpy(dtype="int64", na_value=0), s.notna().to_numpy()


def _f64(s: pd.Series) -> np.ndarray:
    return s.astype("Float64").to_numpy(dtype=float, na_value=np.nan)


def _nullable_int(values: np.ndarray, valid: np.ndarray, dtype: str = "Int64") -> pd.api.extensions.ExtensionArray:
    """Nullable integer array: ``values`` where ``valid``, null elsewhere."""
    arr = pd.array(np.where(valid, values, 0).astype("int64"), dtype=dtype)
    arr[~np.asarray(valid, dtype=bool)] = pd.NA
    return arr


def _read_parsed(dirs: Sequence[Path | str], name: str, columns: list[str] | None = None) -> pd.DataFrame:
    """Concatenate one parse table over the process directories (missing files are skipped)."""
    frames = []
    for d in dirs:
        p = Path(d) / f"{name}.parquet"
        if p.exists():
            frames.append(read_table(p, columns=columns))
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=columns or [])
    return pd.concat(frames, ignore_index=True)


def _fmt_bw(x: float) -> str:
    return f"{x:.1f} GB/s"


# --------------------------------------------------------------------------------------------
# topology model


def _node_key(node: object) -> tuple[str, int] | None:
    """('GPU', 0x7000) from 'GPU/0-7000' or 'GPU/7000' (the local id is the hex after the last '-')."""
    if not isinstance(node, str) or "/" not in node:
        return None
    kind, _, rest = node.partition("/")
    try:
        return kind, int(rest.rsplit("-", 1)[-1], 16)
    except ValueError:
        return None


def _gpu_name(bus: int) -> str:
    return f"GPU 0-{bus:x}"


@dataclass
class _HostTopology:
    """What the topology dumps of one host say, merged over all dumps (sub-communicator dumps
    only list their own GPUs, so the union is the host)."""

    host: str
    gpu_up: dict[int, tuple[float, tuple[str, int] | None]] = field(default_factory=dict)  # bus -> (PCI bw, CPU)
    nvl: dict[int, dict[tuple[str, int], float]] = field(default_factory=dict)  # bus -> {peer node: NVL bw}
    nics: dict[int, tuple[float, float]] = field(default_factory=dict)  # NIC id -> (NET bw, PCI bw to its CPU)
    sys: dict[frozenset, float] = field(default_factory=dict)  # {CPU a, CPU b} -> SYS bw
    total_bw: float | None = None  # largest totalBw header of the host

    def nvs_bw(self, bus: int) -> float:
        return sum(bw for (kind, _), bw in self.nvl.get(bus, {}).items() if kind == "NVS")

    def nvlink(self, a: int, b: int) -> float:
        """Direct NVLink bandwidth a -> b (either direction as printed), 0 if none."""
        return self.nvl.get(a, {}).get(("GPU", b), 0.0) or self.nvl.get(b, {}).get(("GPU", a), 0.0)

    def nic_bw(self, nic: int) -> float:
        net, pci = self.nics[nic]
        return min(net, pci)


def _pci_up(parent: dict, node: tuple[str, int]) -> tuple[float, tuple[str, int] | None]:
    """Slowest PCI link from ``node`` up to its CPU, and that CPU (inf/None when not printed)."""
    bw, cur, seen = math.inf, node, set()
    while cur in parent and cur not in seen:
        seen.add(cur)
        cur, link_bw = parent[cur]
        bw = min(bw, link_bw)
    return bw, (cur if cur[0] == "CPU" else None)


def _build_topology(host: str, rows: Sequence[tuple[str, str, str, float]], total_bw: float | None) -> _HostTopology:
    """A host's topology from link rows ``(from_node, link_type, to_node, bw)``; earlier rows win
    when several dumps print the same link."""
    t = _HostTopology(host, total_bw=total_bw)
    parent: dict[tuple[str, int], tuple[tuple[str, int], float]] = {}
    nets: dict[int, float] = {}
    for frm, typ, to, bw in rows:
        a, b = _node_key(frm), _node_key(to)
        if a is None or b is None:
            continue
        bw = float(bw)
        if typ == "PCI":
            parent.setdefault(b, (a, bw))  # NCCL prints the PCI tree top-down from each CPU
        elif typ == "NVL" and a[0] == "GPU" and b[0] in ("GPU", "NVS"):
            t.nvl.setdefault(a[1], {}).setdefault(b, bw)  # one line per peer, all its links summed
        elif typ == "NET" and a[0] == "NIC":
            nets.setdefault(a[1], bw)
        elif typ == "SYS" and a[0] == "CPU" and b[0] == "CPU":
            t.sys.setdefault(frozenset((a, b)), bw)
    for g in {b[1] for b in parent if b[0] == "GPU"} | set(t.nvl):
        t.gpu_up[g] = _pci_up(parent, ("GPU", g))
    for nic, net in nets.items():
        t.nics[nic] = (net, _pci_up(parent, ("NIC", nic))[0])
    return t


class _Topologies:
    """The topology dumps of a run, by host and by the communicator whose init printed them.

    NCCL prints a dump at every communicator init, holding only that communicator's GPUs on
    the host, with the link bandwidths it uses for it. A communicator's own dump is therefore
    preferred; the host view (largest dump first, others only filling gaps) serves the rest.
    Dumps are not merged by taking maxima: dumps of different communicators may print
    different bandwidths for the same pair of GPUs.
    """

    def __init__(self, links: pd.DataFrame, systems: pd.DataFrame, comms: pd.DataFrame,
                 comm_lid: dict[tuple[str, int, int], int]) -> None:  # fmt: skip
        self._rows: dict[tuple[str, int], list[tuple[str, str, str, float]]] = {}
        self._host: dict[tuple[str, int], str] = {}
        self._total: dict[tuple[str, int], float] = {}
        self.comm_dump: dict[tuple[int, str], tuple[str, int]] = {}
        self._cache: dict[object, _HostTopology] = {}
        if len(links):
            links = links.assign(host=links.groupby("file")["host"].transform(lambda x: x.ffill().bfill()))
            links = links.dropna(subset=["host", "system", "from_node", "to_node", "link_type", "bw_gbps"])
            for (f, sysno, host), g in links.groupby(["file", "system", "host"], sort=False):
                key = (str(f), int(sysno))
                self._rows[key] = list(zip(g["from_node"], g["link_type"], g["to_node"], g["bw_gbps"].astype(float)))
                self._host[key] = str(host)
        if len(systems):
            for f, sysno, bw in systems.dropna(subset=["system", "total_bw_gbps"])[
                    ["file", "system", "total_bw_gbps"]].itertuples(index=False):  # fmt: skip
                self._total[(str(f), int(sysno))] = float(bw)
        self.hosts: dict[str, list[tuple[str, int]]] = {}
        for key in sorted(self._rows, key=lambda k: -len(self._rows[k])):
            self.hosts.setdefault(self._host[key], []).append(key)
        self._assign_to_comms(systems, comms, comm_lid)

    def _assign_to_comms(self, systems: pd.DataFrame, comms: pd.DataFrame,
                         comm_lid: dict[tuple[str, int, int], int]) -> None:  # fmt: skip
        """A dump belongs to the communicator whose Init START precedes it (or, for versions
        without START lines, whose Init COMPLETE follows it) in the same file."""
        if systems.empty or comms.empty:
            return
        d = systems.dropna(subset=["file", "line", "system"])[["file", "line", "system"]].copy()
        c = comms.dropna(subset=["file", "line", "comm", "host", "pid"])
        c = c[c["event"].isin(["init", "split", "legacy_init"])][["file", "line", "phase", "comm", "host", "pid"]]
        if d.empty or c.empty:
            return
        d["line"] = d["line"].astype("int64")
        d["file"] = d["file"].astype(str)
        c = c.assign(line=c["line"].astype("int64"), file=c["file"].astype(str))
        d = d.sort_values("line")
        start = c[c["phase"] == "START"].sort_values("line")
        done = c[(c["phase"] != "START") | c["phase"].isna()].sort_values("line")
        cols = ["line", "file", "comm", "host", "pid"]
        back = pd.merge_asof(d, start[cols], on="line", by="file", direction="backward")
        fwd = pd.merge_asof(d, done[cols], on="line", by="file", direction="forward")
        use_back = back["comm"].notna().to_numpy()
        for i in range(len(d)):  # one iteration per topology dump
            src = back if use_back[i] else fwd
            comm, host, pid = src["comm"].iat[i], src["host"].iat[i], src["pid"].iat[i]
            if pd.isna(comm) or pd.isna(host) or pd.isna(pid):
                continue
            lid = comm_lid.get((str(host), int(pid), int(comm)))
            key = (str(d["file"].iat[i]), int(d["system"].iat[i]))
            if lid is not None and key in self._rows:
                self.comm_dump.setdefault((lid, self._host[key]), key)

    def _make(self, host: str, keys: list[tuple[str, int]]) -> _HostTopology:
        rows = [r for k in keys for r in self._rows[k]]
        totals = [self._total[k] for k in keys if k in self._total]
        return _build_topology(host, rows, max(totals) if totals else None)

    def host_view(self, host: str) -> _HostTopology | None:
        if host not in self.hosts:
            return None
        if ("host", host) not in self._cache:
            self._cache[("host", host)] = self._make(host, self.hosts[host])
        return self._cache[("host", host)]

    def comm_view(self, lid: int | None, host: str) -> _HostTopology | None:
        key = self.comm_dump.get((lid, host)) if lid is not None else None
        if key is None:
            return None
        if key not in self._cache:
            self._cache[key] = self._make(host, [key])
        return self._cache[key]


@dataclass
class _Limit:
    limit_gbps: float | None
    link_type: str | None
    limit_link: str | None
    limit_source: str


def _intra_host_limit(t: _HostTopology, gpus: list[int]) -> tuple[float, str, str]:
    """Bottleneck among the member GPUs of one host: their NVLink bandwidth toward each other
    when every pair is NVLink-connected, else the slowest PCIe/SYS path of a pair without NVLink."""
    no_nvl = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1:]
              if not t.nvlink(a, b) and not (t.nvs_bw(a) and t.nvs_bw(b))]  # fmt: skip
    if not no_nvl:
        # Rings/trees use every NVLink of a GPU at once (one channel per link), so a GPU's
        # usable bandwidth is the sum of its links to the other members (or its NVSwitch ports).
        best: tuple[float, str, str] | None = None
        for g in gpus:
            nvs = t.nvs_bw(g)
            peers = [(p, t.nvlink(g, p)) for p in gpus if p != g and t.nvlink(g, p)]
            bw = nvs if nvs else sum(b for _, b in peers)
            if best is not None and bw >= best[0]:
                continue
            if nvs:
                text = f"NVL {_fmt_bw(bw)}: {_gpu_name(g)} on {t.host} to the NVSwitch"
            elif len(peers) == 1:
                text = f"NVL {_fmt_bw(bw)} between {_gpu_name(g)} and {_gpu_name(peers[0][0])} on {t.host}"
            else:
                each = " + ".join(f"{b:.1f}" for _, b in peers)
                text = f"NVL {_fmt_bw(bw)}: {_gpu_name(g)} on {t.host} (NVLinks to {len(peers)} members: {each})"
            best = (bw, "NVL", text)
        assert best is not None
        return best
    worst: tuple[float, str, str] | None = None
    for a, b in no_nvl:
        (pa_bw, cpu_a), (pb_bw, cpu_b) = t.gpu_up[a], t.gpu_up[b]
        bw, typ = min(pa_bw, pb_bw), "PCI"
        if cpu_a != cpu_b:
            typ = "SYS"
            sys_bw = t.sys.get(frozenset((cpu_a, cpu_b))) if cpu_a and cpu_b else None
            bw = min(bw, sys_bw) if sys_bw else bw
        if worst is None or bw < worst[0]:
            worst = (bw, typ, f"{typ} {_fmt_bw(bw)} between {_gpu_name(a)} and {_gpu_name(b)} on {t.host}")
    assert worst is not None
    return worst


def _only_missing_topology(source: str) -> bool:
    """Whether a limit's reason is only missing topology dumps (or ranks without a process)."""
    reasons = source.removeprefix("unavailable: ").split("; ")
    return source.startswith("unavailable: ") and all(
        r.startswith("no topology dump for ") or r.endswith("has no process in the logs") for r in reasons)


def _locate_limit(located: list[tuple[str, int | None]], missing: list[str], topologies: _Topologies,
                  lid: int | None) -> _Limit:  # fmt: skip
    """Limit of the member GPUs ``(host, bus id)`` of communicator ``lid``; ``missing`` lists
    members that could not be located at all. See docs/metrics.md for the model."""
    by_host: dict[str, list[int | None]] = {}
    for host, bus in located:
        if bus not in by_host.setdefault(host, []):
            by_host[host].append(bus)
    multi = len(by_host) > 1
    problems = list(missing)
    views: dict[str, _HostTopology] = {}
    own_everywhere = True
    for host, buses in by_host.items():
        known = [b for b in buses if b is not None]
        t = topologies.comm_view(lid, host)
        if t is None or any(b not in t.gpu_up for b in known) or (multi and not t.nics):
            t, own_everywhere = topologies.host_view(host), False
        if t is None or not t.gpu_up:
            problems.append(f"no topology dump for {host}")
            continue
        views[host] = t
        if len(known) < len(buses):
            problems.append(f"GPU bus id of a process on {host} unknown")
        problems += [f"{_gpu_name(b)} not in the topology dumps of {host}" for b in known if b not in t.gpu_up]
    if problems:
        reason = "; ".join(sorted(set(problems)))
        # A single-host communicator can still use NCCL's own per-GPU total bandwidth of that
        # host (the totalBw header), an upper bound of what its GPUs can move.
        if not missing and len(by_host) == 1:
            host = next(iter(by_host))
            t = topologies.comm_view(lid, host) or topologies.host_view(host)
            if t is not None and t.total_bw:
                return _Limit(t.total_bw, None, f"totalBw {_fmt_bw(t.total_bw)} of {host}",
                              f"fallback: totalBw {_fmt_bw(t.total_bw)} of the topology header of {host} ({reason})")
        return _Limit(None, None, None, f"unavailable: {reason}")
    candidates: list[tuple[float, str, str]] = []
    for host, gpus in by_host.items():
        if len(gpus) > 1:
            candidates.append(_intra_host_limit(views[host], gpus))  # type: ignore[arg-type]
    if multi:
        for host, gpus in by_host.items():
            t = views[host]
            if not t.nics:
                return _Limit(None, None, None, f"unavailable: no NET link in the topology dumps of {host}")
            # Each member GPU drives at most one NIC (rail-style); a ring crossing hosts carries
            # every channel through some NIC, so the host's usable NICs bound the bus bandwidth,
            # and so does the PCIe of the member GPUs the traffic leaves through.
            nic_bws = sorted((t.nic_bw(n) for n in t.nics), reverse=True)[: len(gpus)]
            net = sum(nic_bws)
            gpu_pci = sum(t.gpu_up[g][0] for g in gpus)  # type: ignore[index]
            bw = min(net, gpu_pci)
            what = f"{len(nic_bws)} NIC(s) of {host} for {len(gpus)} member GPU(s)"
            if gpu_pci < net:
                what += f", limited by the GPUs' PCI {_fmt_bw(gpu_pci)}"
            candidates.append((bw, "NET", f"NET {_fmt_bw(bw)}: {what}"))
    if not candidates:
        return _Limit(None, None, None, "unavailable: fewer than two member GPUs")
    bw, typ, text = min(candidates, key=lambda c: c[0])
    return _Limit(bw, typ, text, "topology" if own_everywhere else "topology: host view")


# --------------------------------------------------------------------------------------------
# algorithms


def _kernel_algorithms(names: pd.Series) -> tuple[pd.Series, pd.Series]:
    """Algorithm and protocol parsed from kernel names (per distinct name)."""
    uniq = pd.Series(names.dropna().unique())
    parsed = {n: kernel_algorithm(str(n)) for n in uniq}
    algo = {n: a for n, (a, _) in parsed.items() if a}
    proto = {n: p for n, (_, p) in parsed.items() if p}
    return names.map(algo).astype("string"), names.map(proto).astype("string")


def _tuning_per_call(calls: pd.DataFrame, tuning: pd.DataFrame) -> pd.DataFrame:
    """(file, line, algo, proto) of every call a TUNING line was attached to. Lines of the
    2.20-2.23 format may cover a group of consecutive same-op calls (``n_calls``); the attached
    call is the first of them."""
    if tuning.empty or "call_line" not in tuning:
        return pd.DataFrame(columns=["file", "line", "t_algo", "t_proto"])
    t = tuning.dropna(subset=["call_line", "algo"])
    t = pd.DataFrame({"file": t["file"].astype("string"), "line": t["call_line"].astype("int64"),
                      "n": t["n_calls"].astype("Int64").fillna(1).astype("int64"),
                      "t_algo": normalise_algorithm(t["algo"]), "t_proto": t["proto"].astype("string").str.upper()})  # fmt: skip
    single = t[t["n"] <= 1][["file", "line", "t_algo", "t_proto"]]
    multi = t[t["n"] > 1]
    if multi.empty:
        return single.drop_duplicates(["file", "line"])
    calls = pd.DataFrame({"file": calls["file"].astype("string"), "line": calls["line"].astype("Int64"),
                          "comm": calls["comm"].astype("Int64").fillna(-1).astype("int64"),
                          "op_count": calls["op_count"].astype("Int64").fillna(-1).astype("int64")})  # fmt: skip
    calls = calls.sort_values(["file", "comm", "line"]).reset_index(drop=True)
    calls["pos"] = np.arange(len(calls))
    start = multi.merge(calls, on=["file", "line"], how="inner")
    rep = start.loc[start.index.repeat(start["n"])].copy()
    rep["pos"] = rep["pos"] + rep.groupby(level=0).cumcount().to_numpy()
    rep = rep[rep["pos"] < len(calls)]
    cover = calls.iloc[rep["pos"].to_numpy()].reset_index(drop=True)
    # the covered calls are the group's: same file, communicator and opCount as the first
    same = ((cover["file"].to_numpy(dtype=object) == rep["file"].to_numpy(dtype=object))
            & (cover["comm"].to_numpy() == rep["comm"].to_numpy())
            & (cover["op_count"].to_numpy() == rep["op_count"].to_numpy()))  # fmt: skip
    grouped = pd.DataFrame({"file": cover["file"], "line": cover["line"], "t_algo": rep["t_algo"].to_numpy(),
                            "t_proto": rep["t_proto"].to_numpy()})[same]  # fmt: skip
    return pd.concat([single, grouped], ignore_index=True).drop_duplicates(["file", "line"])


def _transition_table(om: pd.DataFrame, keep: np.ndarray) -> pd.DataFrame:
    """Runs of consecutive message sizes with the same algorithm/protocol per communicator/op."""
    d = om.loc[keep & om["algorithm"].notna().to_numpy() & om["logical_id"].notna().to_numpy()
               & om["message_bytes"].notna().to_numpy(),
               ["logical_id", "parallelism", "op", "message_bytes", "algorithm", "protocol", "algo_source"]]  # fmt: skip
    if d.empty:
        return coerce_to_schema(pd.DataFrame(), ALGORITHM_SCHEMA)
    d = d.fillna({"protocol": ""})
    key = ["logical_id", "op", "message_bytes"]
    c = d.groupby(key + ["algorithm", "protocol"], dropna=False).agg(
        n=("algo_source", "size"), n_tuning=("algo_source", lambda s: int((s == "tuning").sum())),
        parallelism=("parallelism", "first")).reset_index()  # fmt: skip
    c["bucket_total"] = c.groupby(key)["n"].transform("sum")
    # the dominant choice per size bucket (ties: alphabetical, so the table is deterministic)
    c = c.sort_values(key + ["n", "algorithm", "protocol"], ascending=[True, True, True, False, True, True])
    b = c.drop_duplicates(key).sort_values(key).reset_index(drop=True)
    change = np.zeros(len(b), dtype=bool)
    change[0] = True
    for col in ("logical_id", "op", "algorithm", "protocol"):
        v = b[col].astype(str).to_numpy()
        change[1:] |= v[1:] != v[:-1]
    b["run"] = np.cumsum(change)
    r = b.groupby("run").agg(logical_id=("logical_id", "first"), parallelism=("parallelism", "first"),
                             op=("op", "first"), min_bytes=("message_bytes", "min"),
                             max_bytes=("message_bytes", "max"), algorithm=("algorithm", "first"),
                             protocol=("protocol", "first"), count=("n", "sum"), n_tuning=("n_tuning", "sum"),
                             total=("bucket_total", "sum"))  # fmt: skip
    r["other_count"] = r["total"] - r["count"]
    r["source"] = np.where(r["n_tuning"] == r["count"], "tuning",
                           np.where(r["n_tuning"] == 0, "kernel_name", "tuning+kernel_name"))  # fmt: skip
    r["protocol"] = r["protocol"].replace("", pd.NA)
    return coerce_to_schema(r.reset_index(drop=True), ALGORITHM_SCHEMA)


# --------------------------------------------------------------------------------------------
# main entry
#
# Everything but a few small run-wide facts lives within one logical communicator: instances,
# stragglers, algorithm transitions, a communicator's limit and medians, and the calls of one
# kernel launch (NCCL launches a kernel per communicator; the out-of-core entry checks it and
# keeps communicators sharing a kernel together). A run is therefore computed in parts of whole
# communicators: the in-memory entry computes one part, the out-of-core entry routes the call
# rows into parts on disk and computes them one at a time.

_TUNING_COLUMNS = ["file", "line", "algo", "proto", "call_line", "n_calls"]


def _call_rows(ops: pd.DataFrame) -> pd.DataFrame:
    """The call rows of ``ops`` with the columns metrics use (absent ones all null)."""
    # only the columns used here: row selections on wide frames with string columns are costly
    cols = [c for c in _CALL_COLUMNS if c in ops.columns]
    calls = ops.loc[(ops["row_kind"] == "call").fillna(False).to_numpy(), cols].reset_index(drop=True)
    for c in _CALL_COLUMNS:
        if c not in calls:
            calls[c] = pd.NA
    return calls


@dataclass
class _RunFacts:
    """What the parts of a run share, taken from its call rows; small (per process, rank or
    communicator). ``of`` reads one batch of rows, ``combine`` merges batches given in row order
    (every "first" is the first in the run's row order, as with the whole table at once)."""

    comm_lid: pd.DataFrame  # host, pid, comm -> logical_id (first row of each process communicator)
    proc: pd.DataFrame  # global_rank -> host, pid (first row of each rank)
    lid_nranks: pd.Series  # logical_id -> largest nranks logged
    lid_parallelism: pd.Series  # logical_id -> first parallelism label
    seen: pd.DataFrame  # logical_id, rank_in_comm -> global_rank (first row of each)

    @classmethod
    def of(cls, calls: pd.DataFrame) -> _RunFacts:
        cl = calls[["host", "pid", "comm", "logical_id"]].dropna().drop_duplicates(["host", "pid", "comm"])
        proc = calls[["global_rank", "host", "pid"]].dropna().drop_duplicates("global_rank")
        lc = calls.loc[calls["logical_id"].notna().to_numpy(), ["logical_id", "nranks", "parallelism", "rank_in_comm",
                                                                 "global_rank"]]  # fmt: skip
        lid = lc["logical_id"].astype("int64")
        seen = lc.dropna(subset=["rank_in_comm", "global_rank"])
        seen = pd.DataFrame({"logical_id": seen["logical_id"].astype("int64"),
                             "rank_in_comm": seen["rank_in_comm"].astype("int64"),
                             "global_rank": seen["global_rank"]}).drop_duplicates(["logical_id", "rank_in_comm"])
        return cls(cl, proc, lc.groupby(lid)["nranks"].max(), lc.groupby(lid)["parallelism"].first(), seen)

    @classmethod
    def combine(cls, batches: Sequence[_RunFacts]) -> _RunFacts:
        if len(batches) == 1:
            return batches[0]
        if not batches:
            return cls.of(_call_rows(pd.DataFrame({"row_kind": pd.Series([], dtype="string")})))
        return cls(pd.concat([b.comm_lid for b in batches]).drop_duplicates(["host", "pid", "comm"]),
                   pd.concat([b.proc for b in batches]).drop_duplicates("global_rank"),
                   pd.concat([b.lid_nranks for b in batches]).groupby(level=0).max(),
                   pd.concat([b.lid_parallelism for b in batches]).groupby(level=0).first(),
                   pd.concat([b.seen for b in batches]).drop_duplicates(["logical_id", "rank_in_comm"]))  # fmt: skip


class _RunContext:
    """Run-wide inputs of every part: topologies, where each rank runs and on which GPU, the
    members and limit of every communicator, and the problems those raise (once per run)."""

    def __init__(self, facts: _RunFacts, parsed_nccl_dirs: Sequence[Path | str],
                 communicators: pd.DataFrame | None) -> None:  # fmt: skip
        links = _read_parsed(parsed_nccl_dirs, "topology_links", ["file", "host", "system", "from_node", "link_type",
                                                                  "bw_gbps", "to_node"])  # fmt: skip
        systems = _read_parsed(parsed_nccl_dirs, "topology_systems", ["file", "line", "system", "total_bw_gbps"])
        comms = _read_parsed(parsed_nccl_dirs, "comms", ["file", "line", "host", "pid", "event", "phase", "comm",
                                                         "bus_id"])  # fmt: skip
        comm_lid = {(str(h), int(p), int(c)): int(k) for h, p, c, k in facts.comm_lid[["host", "pid", "comm",
                    "logical_id"]].itertuples(index=False)}  # fmt: skip
        self.topologies = _Topologies(links, systems, comms, comm_lid)
        self.any_topology = bool(len(links))
        # where each global rank runs, and on which GPU (bus id of its init lines)
        proc = facts.proc
        self.proc = pd.DataFrame({"host": proc["host"].to_numpy(), "pid": proc["pid"].to_numpy()},
                                 index=proc["global_rank"].astype("int64").to_numpy()).sort_index()  # fmt: skip
        self.bus_of: dict[tuple[str, int], int] = {}
        if len(comms):
            c = comms.dropna(subset=["host", "pid", "bus_id"])
            for (h, p), b in c.groupby(["host", "pid"])["bus_id"].agg(lambda x: x.mode().iloc[0]).items():
                self.bus_of[(str(h), int(p))] = int(b)
        self.members = self._members(facts, communicators)
        self.member_table = pd.DataFrame([(k, r, g) for k, mem in self.members.items() for r, g in enumerate(mem)],
                                         columns=["logical_id", "peer", "peer_global"]).astype("Int64")  # fmt: skip
        self.limits, self.comm_limit, self.problems = self._comm_limits(facts)

    @staticmethod
    def _members(facts: _RunFacts, communicators: pd.DataFrame | None) -> dict[int, list[int]]:
        """Members by rank in comm: the communicators table first, then what the ops show."""
        members: dict[int, list[int]] = {}
        if communicators is not None and len(communicators):
            for lid, mem, nr in zip(communicators["logical_id"], communicators["members"], communicators["nranks"]):
                if pd.isna(lid):
                    continue
                listed = [int(x) for x in mem] if isinstance(mem, (list, tuple, np.ndarray)) else []
                members[int(lid)] = listed or [-1] * (0 if pd.isna(nr) else int(nr))
        sizes = facts.lid_nranks
        seen = facts.seen.sort_values(["logical_id", "rank_in_comm"])
        for lid, rk, gr in seen.itertuples(index=False):
            size = sizes.get(lid)
            lst = members.setdefault(int(lid), [-1] * (int(size) if not pd.isna(size) else int(rk) + 1))
            if rk >= len(lst):
                lst.extend([-1] * (int(rk) + 1 - len(lst)))
            if lst[rk] < 0:
                lst[rk] = int(gr)
        return members

    def locate(self, ranks: list[int], lid: int | None) -> _Limit:
        """Limit of the GPUs of global ranks ``ranks`` (communicator ``lid``)."""
        located, missing = [], []
        for r in ranks:
            if r < 0 or r not in self.proc.index:
                missing.append(f"rank {r} has no process in the logs" if r >= 0
                               else "a member's global rank is unknown (its log is missing, or no record of the run "
                                    "names the ranks)")
                continue
            h, p = str(self.proc.at[r, "host"]), int(self.proc.at[r, "pid"])
            located.append((h, self.bus_of.get((h, p))))
        return _locate_limit(located, missing, self.topologies, lid)

    def _comm_limits(self, facts: _RunFacts) -> tuple[pd.DataFrame, dict[int, _Limit], list[str]]:
        """Limit per logical communicator (table rows, by id) and the problems they raise."""
        rows, comm_limit = [], {}
        for lid in sorted(self.members):
            mem = self.members[lid]
            lim = (self.locate(mem, lid) if len(mem) > 1 else
                   _Limit(None, None, None, "unavailable: single-rank communicator (nothing crosses a link)"))  # fmt: skip
            comm_limit[lid] = lim
            located_hosts = {str(self.proc.at[r, "host"]) for r in mem if r >= 0 and r in self.proc.index}
            rows.append({"logical_id": lid, "nranks": len(mem), "parallelism": facts.lid_parallelism.get(lid),
                         "members": ",".join(str(m) for m in mem), "hosts": len(located_hosts),
                         "limit_gbps": lim.limit_gbps, "link_type": lim.link_type, "limit_link": lim.limit_link,
                         "limit_source": lim.limit_source})  # fmt: skip
        problems: list[str] = []
        by_source: dict[str, list[int]] = {}
        for r in rows:
            if r["nranks"] > 1 and not r["limit_source"].startswith("topology"):
                by_source.setdefault(r["limit_source"], []).append(r["logical_id"])
        # where no host left a topology dump at all, one line says so (not one per communicator)
        untopo = {src: lids for src, lids in by_source.items() if _only_missing_topology(src)}
        if untopo and not self.any_topology:
            n = sum(len(v) for v in untopo.values())
            problems.append(f"limit of {n} communicator(s) unavailable: no host left an NCCL topology dump (NCCL "
                            "prints it at init with NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS including GRAPH), so no "
                            "bandwidth limit to compare with")  # fmt: skip
            by_source = {k: v for k, v in by_source.items() if k not in untopo}
        for src, lids in by_source.items():
            head = ", ".join(str(x) for x in lids[:8]) + (" ..." if len(lids) > 8 else "")
            problems.append(f"limit of communicator(s) {head}: {src}")
        return pd.DataFrame(rows), comm_limit, problems

    def row_limits(self, calls: pd.DataFrame, single_peer: np.ndarray) -> pd.DataFrame:
        """Limit per call row: its communicator's, except P2P kernels with one peer: the pair's."""
        lid = calls["logical_id"].astype("Int64")
        cols = ["limit_gbps", "limit_link", "limit_source"]
        tab = pd.DataFrame([[k, v.limit_gbps, v.limit_link, v.limit_source] for k, v in self.comm_limit.items()],
                           columns=["logical_id"] + cols).astype({"logical_id": "Int64", "limit_gbps": "Float64"})
        out = pd.DataFrame({"logical_id": lid}).merge(tab, on="logical_id", how="left")
        out["limit_scope"] = pd.Series(np.where(lid.notna().to_numpy(), "communicator", None), dtype="string")
        me, peer = calls["global_rank"].astype("Int64"), calls["root"].astype("Int64")
        is_pair = calls["op"].isin(list(_P2P)).fillna(False).to_numpy() & single_peer
        is_pair &= (lid.notna() & me.notna() & peer.notna()).to_numpy()
        if is_pair.any():
            sub = pd.DataFrame({"logical_id": lid[is_pair].to_numpy(), "peer": peer[is_pair].to_numpy(),
                                "me": me[is_pair].to_numpy()}).astype("Int64")  # fmt: skip
            sub = sub.merge(self.member_table, on=["logical_id", "peer"], how="left")
            pg = sub["peer_global"].fillna(-1).astype("int64").to_numpy()
            mine = sub["me"].astype("int64").to_numpy()
            sub["a"] = np.where(pg < 0, pg, np.minimum(mine, pg))  # unknown peer (-1): locate() says so
            sub["b"] = np.where(pg < 0, mine, np.maximum(mine, pg))
            uniq = sub[["logical_id", "a", "b"]].drop_duplicates()
            found = []
            for k, x, y in uniq.itertuples(index=False):  # one iteration per distinct GPU pair
                lim = (self.locate([int(x), int(y)], int(k)) if x != y else
                       _Limit(None, None, None, "unavailable: send to self (no link)"))  # fmt: skip
                found.append((k, x, y, lim.limit_gbps, lim.limit_link, lim.limit_source))
            tab = pd.DataFrame(found, columns=["logical_id", "a", "b"] + cols).astype({"limit_gbps": "Float64"})
            res = sub.merge(tab, on=["logical_id", "a", "b"], how="left")
            idx = np.flatnonzero(is_pair)
            for col in cols:
                out.loc[idx, col] = res[col].to_numpy()
            out.loc[idx, "limit_scope"] = "pair"
        return out


@dataclass
class _Part:
    """The metrics of one part of a run (whole communicators): ``op_metrics`` in the part's
    row order, ``instance_rows`` the part row of each instance's first call, the per-communicator
    medians of the limits table and the counts behind the run's problem messages."""

    op_metrics: pd.DataFrame
    instances: pd.DataFrame
    instance_rows: np.ndarray
    stragglers: pd.DataFrame
    algorithms: pd.DataFrame
    medians: pd.DataFrame
    counts: dict[str, int]


def _part_metrics(calls: pd.DataFrame, ctx: _RunContext, tuning: pd.DataFrame) -> _Part:
    """Every per-call and per-communicator figure of ``calls`` (the call rows of whole
    communicators, ``_call_rows``) with the run-wide ``ctx`` and the TUNING lines ``tuning``
    (at least those attached to these calls)."""
    counts: dict[str, int] = {}
    n = len(calls)
    om = pd.DataFrame({c: calls[c] for c in ("file", "line", "host", "pid", "global_rank", "rank_in_comm",
                                              "logical_id", "nranks", "op", "parallelism", "instance", "status",
                                              "message_bytes")})  # fmt: skip
    matched = (calls["status"] == "matched").fillna(False).to_numpy(dtype=bool)

    # -- bandwidth from the kernel duration (node clock; only matched calls have a kernel)
    k_start, ks_ok = _i64(calls["kernel_start"])
    k_end, ke_ok = _i64(calls["kernel_end"])
    timed = matched & ks_ok & ke_ok
    dur = k_end - k_start
    timed &= dur > 0
    counts["zero_duration"] = int((matched & ks_ok & ke_ok & (dur <= 0)).sum())
    durf = np.where(timed, dur, np.nan).astype(float)
    msg = _f64(calls["message_bytes"])
    factor = _bus_factors(calls["op"], calls["nranks"])
    with np.errstate(invalid="ignore", divide="ignore"):
        algbw = msg / durf
    busbw = algbw * factor
    om["duration_ns"] = _nullable_int(dur, timed)
    om["algbw_gbps"] = pd.array(algbw, dtype="Float64")
    om["bus_factor"] = pd.array(factor, dtype="Float64")
    om["busbw_gbps"] = pd.array(busbw, dtype="Float64")

    # -- calls sharing one kernel launch (fused groups): bus bytes of the whole kernel
    op_s = calls["op"].astype("string").fillna("")
    is_send = (op_s == "Send").to_numpy()
    is_recv = (op_s == "Recv").to_numpy()
    by = np.nan_to_num(_f64(calls["bytes"]))
    kernel = pd.DataFrame({
        "gpid": calls["kernel_global_pid"], "corr": calls["kernel_correlation_id"],
        "coll": np.where(is_send | is_recv, 0.0, msg * factor), "send": np.where(is_send, by, 0.0),
        "recv": np.where(is_recv, by, 0.0), "peer": calls["root"].astype("Int64"),
    })  # fmt: skip
    kernel_calls = np.ones(n, dtype="int64")
    kernel_bus = np.where(is_send | is_recv, by, msg * factor)
    single_peer = np.ones(n, dtype=bool)
    has_kernel = matched & kernel["gpid"].notna().to_numpy() & kernel["corr"].notna().to_numpy()
    if has_kernel.any():
        g = kernel[has_kernel].groupby(["gpid", "corr"])
        kernel_calls[has_kernel] = g["coll"].transform("size").to_numpy()
        sums = g[["coll", "send", "recv"]].transform("sum")
        kernel_bus[has_kernel] = (sums["coll"] + np.maximum(sums["send"], sums["recv"])).to_numpy()
        single_peer[has_kernel] = (g["peer"].transform("nunique") <= 1).to_numpy()
    om["kernel_calls"] = pd.array(np.where(matched, kernel_calls, 1), dtype="Int32")
    with np.errstate(invalid="ignore", divide="ignore"):
        kbusbw = kernel_bus / durf
    # P2P on single-rank communicators (self-sends) have no bus traffic either
    kbusbw = np.where(np.isnan(factor), np.nan, kbusbw)
    om["kernel_busbw_gbps"] = pd.array(kbusbw, dtype="Float64")

    # -- cross-rank: wait and transfer per collective instance
    instances, per_row, first_rows = _instance_metrics(calls, timed, dur, kernel_bus, counts)
    for col in ("arrival_offset_ns", "wait_ns", "transfer_ns", "arrival_skew_ns"):
        om[col] = per_row[col]
    om["transfer_busbw_gbps"] = per_row["transfer_busbw_gbps"]
    om["instance_status"] = per_row["instance_status"]
    stragglers = _straggler_table(per_row, instances, om)

    # -- theoretical limits
    op_limits = ctx.row_limits(calls, single_peer)
    for col in ("limit_gbps", "limit_link", "limit_source", "limit_scope"):
        om[col] = op_limits[col]
    lim = _f64(om["limit_gbps"])
    with np.errstate(invalid="ignore", divide="ignore"):
        om["algbw_limit_gbps"] = pd.array(lim / factor, dtype="Float64")
        om["efficiency"] = pd.array(kbusbw / lim, dtype="Float64")
        om["transfer_efficiency"] = pd.array(_f64(om["transfer_busbw_gbps"]) / lim, dtype="Float64")

    # -- algorithm / protocol
    per_call = _tuning_per_call(calls, tuning)
    t = calls[["file", "line"]].merge(per_call, on=["file", "line"], how="left")
    t_algo, t_proto = t["t_algo"].astype("string"), t["t_proto"].astype("string")
    inst = calls["instance"].astype("string")
    if inst.notna().any() and t_algo.notna().any():
        # every rank of an instance runs what NCCL chose; TUNING lines may be printed by one rank only
        frame = pd.DataFrame({"i": inst, "a": t_algo, "p": t_proto})
        fill = frame[inst.notna().to_numpy()].groupby("i")[["a", "p"]].first()
        miss = t_algo.isna() & inst.notna()
        t_algo = t_algo.where(~miss, inst.map(fill["a"]))
        t_proto = t_proto.where(~miss, inst.map(fill["p"]))
    k_algo, k_proto = _kernel_algorithms(calls["kernel_name"].where(pd.Series(matched)))
    from_tuning = t_algo.notna()
    om["algorithm"] = t_algo.where(from_tuning, k_algo)
    om["protocol"] = t_proto.where(from_tuning, k_proto)
    om["algo_source"] = pd.Series(np.where(from_tuning, "tuning", np.where(k_algo.notna(), "kernel_name", None)),
                                  dtype="string")  # fmt: skip
    dup = calls["duplicate_of"].notna().to_numpy()
    algorithms = _transition_table(om, ~dup)
    om = coerce_to_schema(om, OP_METRICS_SCHEMA)
    return _Part(om, instances, first_rows, stragglers, algorithms, _communicator_medians(om), counts)


def _problems(counts: dict[str, int], ctx: _RunContext) -> list[str]:
    """The run's problem messages from the counts of its parts and the run-wide ones."""
    problems = []
    if counts.get("zero_duration"):
        problems.append(f"{counts['zero_duration']} matched calls have a kernel of zero or negative duration: "
                        "no bandwidth")  # fmt: skip
    if counts.get("bad_transfer"):
        problems.append(f"{counts['bad_transfer']} ranks of complete instances ended before the last rank started "
                        "(clock-sync error larger than the transfer): transfer bandwidth left null")  # fmt: skip
    for status in ("incomplete", "not_synced"):
        if counts.get(status):
            problems.append(f"{counts[status]} of {counts['instances']} collective instances "
                            f"{status.replace('_', ' ')}: no wait/transfer figures for them (see instances.reason)")
    return problems + ctx.problems


def _add_counts(total: dict[str, int], part: dict[str, int]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


def _limit_table(ctx: _RunContext, medians: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The limits table: each communicator's limit with the medians of its timed calls."""
    if ctx.limits.empty:
        return coerce_to_schema(ctx.limits, LIMIT_SCHEMA)
    out = ctx.limits.join(pd.concat(medians) if medians else _communicator_medians(None), on="logical_id")
    out["ops_timed"] = out["ops_timed"].fillna(0)
    return coerce_to_schema(out, LIMIT_SCHEMA)


def _sorted_concat(frames: Sequence[pd.DataFrame], schema: pa.Schema, by: list[str]) -> pd.DataFrame:
    """Per-part tables as the run's: concatenated and in the order the whole run gives them."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return coerce_to_schema(pd.DataFrame(), schema)
    out = pd.concat(frames, ignore_index=True).sort_values(by, kind="stable").reset_index(drop=True)
    return coerce_to_schema(out, schema)


def compute_run_metrics(
    ops: pd.DataFrame,
    parsed_nccl_dirs: Sequence[Path | str],
    communicators: pd.DataFrame | None = None,
) -> RunMetrics:
    """Compute every metrics table of a run in memory.

    ``ops`` is the run's ops table (``nccltrace.ops.build.OPS_SCHEMA``), ``parsed_nccl_dirs`` the
    per-process parse directories (for topology dumps, TUNING lines and the GPU bus ids of the
    init lines), ``communicators`` the logical communicators (members by rank in comm); without
    it, membership is taken from the ranks seen in ``ops``. ``write_run_metrics_out_of_core``
    computes the same tables from an ops file in bounded memory.
    """
    calls = _call_rows(ops)
    ctx = _RunContext(_RunFacts.of(calls), parsed_nccl_dirs, communicators)
    part = _part_metrics(calls, ctx, _read_parsed(parsed_nccl_dirs, "tuning", _TUNING_COLUMNS))
    return RunMetrics(op_metrics=part.op_metrics, instances=part.instances, stragglers=part.stragglers,
                      limits=_limit_table(ctx, [part.medians]), algorithms=part.algorithms,
                      problems=_problems(part.counts, ctx))  # fmt: skip


@dataclass(frozen=True)
class _InstanceRows:
    """Per call row: its instance code (-1 for none) and the times the instance figures use."""

    codes: np.ndarray  # instance code per row, numbered in order of each instance's first row
    keys: pd.Index  # instance key per code
    has: np.ndarray  # bool: the row belongs to an instance
    first_rows: np.ndarray  # the row of each instance's first call
    s_start: np.ndarray  # int64 synchronised kernel start
    s_end: np.ndarray  # int64 synchronised kernel end
    matched: np.ndarray  # bool
    synced: np.ndarray  # bool: matched with both synchronised times
    dur: np.ndarray  # int64 kernel duration (>= 0)
    rank: np.ndarray  # int64 global rank
    rank_ok: np.ndarray  # bool: the global rank is known

    @classmethod
    def of(cls, calls: pd.DataFrame, timed: np.ndarray, dur: np.ndarray) -> _InstanceRows:
        codes, keys = pd.factorize(calls["instance"].astype("string"), use_na_sentinel=True)
        has = codes >= 0
        # codes number instances in order of their first row, the order of the instances table
        first_rows = np.unique(codes[has], return_index=True)[1]
        first_rows = np.flatnonzero(has)[first_rows]
        s_start, ss_ok = _i64(calls["kernel_start_sync"])
        s_end, se_ok = _i64(calls["kernel_end_sync"])
        matched = (calls["status"] == "matched").fillna(False).to_numpy(dtype=bool)
        # the node-clock duration; the synchronised one where the node clock lacks it
        dur = np.maximum(np.where(timed, dur, s_end - s_start), 0)
        rank, rank_ok = _i64(calls["global_rank"])
        return cls(codes, keys, has, first_rows, s_start, s_end, matched, matched & ss_ok & se_ok, dur, rank, rank_ok)


@dataclass(frozen=True)
class _CrossRank:
    """The cross-rank figures of the rows of complete instances (``sel``), in row order."""

    sel: np.ndarray  # bool per call row: in a complete instance
    start: np.ndarray  # synchronised start of each selected row
    first_start: np.ndarray  # its instance's first start
    last_start: np.ndarray  # its instance's last start
    wait: np.ndarray  # its wait for the last rank (ns)
    transfer: np.ndarray  # its duration after the last rank arrived (ns)
    stats: pd.DataFrame  # per instance code: first/last start and end, the straggler, the total wait


def _instance_metrics(calls: pd.DataFrame, timed: np.ndarray, dur: np.ndarray, kernel_bus: np.ndarray,
                      counts: dict[str, int]) -> tuple[pd.DataFrame, pd.DataFrame, np.ndarray]:  # fmt: skip
    """Instances table, the per-row cross-rank columns and the row of each instance's first call
    (``timed``/``dur``: calls with a kernel of positive duration on the node clock;
    ``kernel_bus``: bus bytes of each call's kernel; ``counts``: receives the problem counts)."""
    r = _InstanceRows.of(calls, timed, dur)
    inst = _instance_table(calls, r)
    complete = _classify_instances(inst)
    cross = _cross_rank(r, inst.index[complete.to_numpy()].to_numpy())
    counts["bad_transfer"] = int((cross.transfer <= 0).sum())
    per_row = _per_row_figures(calls, r, cross, inst["status"], kernel_bus)
    inst = _instance_figures(inst.join(cross.stats), r, cross.sel, timed, kernel_bus)
    status_counts = inst["status"].value_counts()
    counts["instances"] = len(inst)
    for status in ("incomplete", "not_synced"):
        counts[status] = int(status_counts.get(status, 0))
    return coerce_to_schema(inst, INSTANCE_SCHEMA), per_row, r.first_rows


def _instance_table(calls: pd.DataFrame, r: _InstanceRows) -> pd.DataFrame:
    """Per instance code: its row counts (matched, synchronised, outside the capture), matched
    ranks, unsynchronised hosts, and what its first call says (communicator, op, size)."""
    has = r.has
    # calls a step-window capture left out by design (their kernels were never recorded)
    outside = (calls["reason"] == OUTSIDE_CAPTURE_REASON).fillna(False).to_numpy(dtype=bool)
    rows = pd.DataFrame({"code": r.codes[has], "matched": r.matched[has], "synced": r.synced[has],
                         "outside": outside[has], "rank": np.where(r.matched & r.rank_ok, r.rank, -1)[has],
                         "host": calls["host"].astype("string")[has].to_numpy()})  # fmt: skip
    rows["unsynced_host"] = rows["host"].where(rows["matched"] & ~rows["synced"])
    rows["rank"] = rows["rank"].where(rows["rank"] >= 0)
    g = rows.groupby("code")
    inst = pd.DataFrame({
        "rows": g.size(), "matched_rows": g["matched"].sum(), "ranks_matched": g["rank"].nunique(),
        "synced_rows": g["synced"].sum(), "unsynced_host": g["unsynced_host"].first(),
        "unsynced_hosts": g["unsynced_host"].nunique(), "outside_rows": g["outside"].sum(),
    })  # fmt: skip
    first = pd.DataFrame({"code": r.codes[has], "logical_id": calls["logical_id"][has].to_numpy(),
                          "op": calls["op"][has].to_numpy(), "parallelism": calls["parallelism"][has].to_numpy(),
                          "nranks": calls["nranks"][has].to_numpy(),
                          "message_bytes": calls["message_bytes"][has].to_numpy()}).groupby("code").first()  # fmt: skip
    inst = inst.join(first)
    inst["instance"] = pd.Series(np.asarray(r.keys, dtype=object)[inst.index.to_numpy()], index=inst.index)
    return inst


def _classify_instances(inst: pd.DataFrame) -> pd.Series:
    """Set each instance's ``status`` and ``reason``; returns which are complete (every rank
    matched once and synchronised)."""
    nr = inst["nranks"].astype("Int64").fillna(0).astype("int64")
    complete = ((nr >= 2) & (inst["ranks_matched"] == nr) & (inst["matched_rows"] == nr)
                & (inst["synced_rows"] == nr))  # fmt: skip
    incomplete = ~complete & ((inst["ranks_matched"] < nr) | (inst["matched_rows"] != nr) | (nr < 2))
    not_captured = (inst["outside_rows"] == inst["rows"]).to_numpy()
    inst["status"] = np.where(complete, "complete", np.where(not_captured, "not_captured",
                                                             np.where(incomplete, "incomplete", "not_synced")))
    extra = np.where(inst["matched_rows"] > inst["ranks_matched"], " (several rows of one rank)", "")
    reason_inc = (inst["ranks_matched"].astype(str) + " of " + nr.astype(str) + " ranks matched to a kernel" + extra)
    others = np.where(inst["unsynced_hosts"] > 1, " and others", "")
    reason_ns = "no synchronised clock for " + inst["unsynced_host"].astype(str) + others
    inst["reason"] = np.where(complete, None, np.where(not_captured, "outside the capture window",
                                                       np.where(incomplete, reason_inc, reason_ns)))
    return complete


def _cross_rank(r: _InstanceRows, comp_codes: np.ndarray) -> _CrossRank:
    """Arrival, wait and transfer of the rows of the complete instances ``comp_codes`` (every
    row matched and synced), and each instance's extremes, straggler and total wait."""
    in_comp = np.zeros(len(r.codes), dtype=bool)
    in_comp[r.has] = np.isin(r.codes[r.has], comp_codes)
    sel = in_comp & r.synced
    t = pd.DataFrame({"code": r.codes[sel], "start": r.s_start[sel], "end": r.s_end[sel], "dur": r.dur[sel],
                      "rank": r.rank[sel], "row": np.flatnonzero(sel)})  # fmt: skip
    gt = t.groupby("code")
    stats = pd.DataFrame({"first_start": gt["start"].min(), "last_start": gt["start"].max(),
                          "first_end": gt["end"].min(), "last_end": gt["end"].max()})  # fmt: skip
    ls = stats["last_start"].reindex(t["code"]).to_numpy()
    # the straggler is the rank with the strictly latest start; a shared latest start names nobody
    at_last = t[t["start"].to_numpy() == ls]
    n_last = at_last.groupby("code").size()
    stats["last_rank"] = at_last.drop_duplicates("code").set_index("code")["rank"].where(n_last == 1)
    fs = stats["first_start"].reindex(t["code"]).to_numpy()
    wait = np.clip(ls - t["start"].to_numpy(), 0, t["dur"].to_numpy())
    transfer = t["dur"].to_numpy() - wait
    t["wait"] = wait
    stats["total_wait"] = t.groupby("code")["wait"].sum()
    stats = stats.astype("Int64")  # stays integer (epoch ns) when joined to the non-complete instances
    return _CrossRank(sel, t["start"].to_numpy(), fs, ls, wait, transfer, stats)


def _per_row_figures(calls: pd.DataFrame, r: _InstanceRows, cross: _CrossRank, status: pd.Series,
                     kernel_bus: np.ndarray) -> pd.DataFrame:  # fmt: skip
    """Per call row: its cross-rank figures (null outside complete instances), its instance's
    status, and the keys the straggler table groups by."""
    n, sel = len(r.codes), cross.sel
    per_row = pd.DataFrame(index=range(n))
    for name, vals in (("arrival_offset_ns", cross.start - cross.first_start), ("wait_ns", cross.wait),
                       ("transfer_ns", cross.transfer)):  # fmt: skip
        full = np.zeros(n, dtype="int64")
        full[sel] = vals
        per_row[name] = _nullable_int(full, sel)
    skew = np.zeros(n, dtype="int64")
    skew[sel] = cross.last_start - cross.first_start
    per_row["arrival_skew_ns"] = _nullable_int(skew, sel)
    tb = np.full(n, np.nan)
    transfer = cross.transfer
    with np.errstate(invalid="ignore", divide="ignore"):
        tb[sel] = np.where(transfer > 0, kernel_bus[sel] / np.where(transfer > 0, transfer, 1), np.nan)
    per_row["transfer_busbw_gbps"] = pd.array(tb, dtype="Float64")
    per_row["instance_status"] = pd.Series(pd.NA, index=range(n), dtype="string")
    per_row.loc[r.has, "instance_status"] = status.reindex(r.codes[r.has]).to_numpy()
    per_row["logical_id"] = calls["logical_id"].to_numpy()
    per_row["global_rank"] = calls["global_rank"].to_numpy()
    per_row["code"] = r.codes
    per_row["sel"] = sel
    return per_row


def _instance_figures(inst: pd.DataFrame, r: _InstanceRows, sel: np.ndarray, timed: np.ndarray,
                      kernel_bus: np.ndarray) -> pd.DataFrame:  # fmt: skip
    """The instance-level skews, transfer time and bus bandwidths, columns named as the table's,
    instances in table order."""
    ok = inst["first_start"].notna().to_numpy()
    inst["arrival_skew_ns"] = inst["last_start"] - inst["first_start"]
    inst["end_skew_ns"] = inst["last_end"] - inst["first_end"]
    inst["transfer_ns"] = inst["last_end"] - inst["last_start"]
    bus_row = pd.Series(np.where(timed, kernel_bus / np.where(timed, r.dur, 1), np.nan))
    inst["median_busbw_gbps"] = bus_row[sel].groupby(r.codes[sel]).median()
    fac = _bus_factors(inst["op"], inst["nranks"])
    tr = _f64(inst["transfer_ns"])
    with np.errstate(invalid="ignore", divide="ignore"):
        inst["transfer_busbw_gbps"] = np.where(ok & (tr > 0), _f64(inst["message_bytes"]) * fac / tr, np.nan)
    inst = inst.rename(columns={"first_start": "first_start_ns", "last_start": "last_start_ns",
                                "last_end": "last_end_ns", "total_wait": "total_wait_ns"})  # fmt: skip
    return inst.sort_index().reset_index(drop=True)


def _straggler_table(per_row: pd.DataFrame, instances: pd.DataFrame, om: pd.DataFrame) -> pd.DataFrame:
    """Per (communicator, rank): last arrivals, their share and the wait they caused."""
    sel = per_row["sel"].to_numpy()
    if not sel.any():
        return coerce_to_schema(pd.DataFrame(), STRAGGLER_SCHEMA)
    r = pd.DataFrame({"logical_id": per_row["logical_id"][sel].to_numpy(),
                      "global_rank": per_row["global_rank"][sel].to_numpy(),
                      "instance": om["instance"][sel].to_numpy(),
                      "wait": per_row["wait_ns"][sel].astype("int64").to_numpy(),
                      "offset": per_row["arrival_offset_ns"][sel].astype("int64").to_numpy()})  # fmt: skip
    inst = instances.set_index("instance")
    last_rank = inst["last_rank"].reindex(r["instance"]).astype("Int64").fillna(-1).astype("int64").to_numpy()
    r["is_last"] = r["global_rank"].astype("int64").to_numpy() == last_rank
    total_wait = inst["total_wait_ns"].reindex(r["instance"]).astype("int64").to_numpy()
    r["caused"] = np.where(r["is_last"], total_wait, 0)  # the last rank's own wait is 0
    g = r.groupby(["logical_id", "global_rank"])
    s = pd.DataFrame({"instances": g.size(), "last_arrivals": g["is_last"].sum(), "wait_caused_ns": g["caused"].sum(),
                      "own_wait_ns": g["wait"].sum(), "mean_arrival_offset_ns": g["offset"].mean()}).reset_index()
    s["last_share"] = s["last_arrivals"] / s["instances"]
    meta = instances.groupby("logical_id")[["parallelism", "nranks"]].first()
    s = s.join(meta, on="logical_id")
    return coerce_to_schema(s.sort_values(["logical_id", "global_rank"]).reset_index(drop=True), STRAGGLER_SCHEMA)


def _communicator_medians(om: pd.DataFrame | None) -> pd.DataFrame:
    """Per logical communicator: timed calls and the medians of their bandwidth and efficiencies."""
    cols = ["logical_id", "kernel_busbw_gbps", "efficiency", "transfer_efficiency"]
    if om is None:
        om = pd.DataFrame({c: pd.Series(dtype="Float64") for c in cols})
    t = om.loc[(om["kernel_busbw_gbps"].notna() & om["logical_id"].notna()).to_numpy(), cols]
    g = t.groupby(t["logical_id"].astype("int64"))
    return pd.DataFrame({"ops_timed": g.size(), "median_busbw_gbps": g["kernel_busbw_gbps"].median(),
                         "median_efficiency": g["efficiency"].median(),
                         "median_transfer_efficiency": g["transfer_efficiency"].median()})  # fmt: skip


def write_run_metrics(result: RunMetrics, out_dir: Path | str) -> dict[str, Path]:
    """Write the five metrics tables atomically into ``out_dir``; returns name -> path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, schema in TABLE_SCHEMAS.items():
        paths[name] = _write_frame(getattr(result, name), schema, out_dir / f"{name}.parquet")
    return paths


def _write_frame(df: pd.DataFrame, schema: pa.Schema, path: Path) -> Path:
    write_table_atomic(frame_to_table(coerce_to_schema(df, schema), schema), path)
    return path


# --------------------------------------------------------------------------------------------
# out of core

PART_ROWS = 1 << 18
"""Call rows per part of the out-of-core metrics (a communicator is never split, so a part
holds more when one communicator does): a part's frames take about 2 KB per call. Smaller
parts cost time (per-part overhead) and save little: the run-wide facts dominate below."""

def part_calls(ops_path: Path | str, part_rows: int = PART_ROWS) -> tuple[int, int]:
    """(call rows of the largest part, call rows of the run) the out-of-core metrics of the ops
    file will compute with: what their memory depends on. Reads two columns; a kernel shared by
    communicators (which joins their parts) is not looked for."""
    rows: dict[int, int] = {}
    for batch in iter_record_batches(ops_path, ["row_kind", "logical_id"], 1 << 20):
        t = batch.filter(pc.fill_null(pc.equal(batch["row_kind"], "call"), False))
        _count_keys(rows, _lid_keys_of(t))
    calls = sum(rows.values())
    return min(calls, max([part_rows, *rows.values()])), calls


_NO_LID = np.iinfo(np.int64).min  # part key of calls without a logical communicator
_LINE_BITS = 40  # call key = file code << 40 | line (a log of 2^40 lines is not a log)


@dataclass
class WrittenMetrics:
    """What ``write_run_metrics_out_of_core`` wrote: table paths, the run's problems, the op
    rows and instances written and the parts the run was computed in."""

    paths: dict[str, Path]
    problems: list[str]
    op_rows: int
    instances: int
    parts: int


class _Scan:
    """First pass over the ops file: the run facts, the call rows of each communicator, the
    communicators each kernel launch holds calls of, and (when TUNING lines exist) each call's
    key, so that TUNING lines can be routed to the part of the call they are attached to."""

    def __init__(self, ops_path: Path, batch_rows: int, with_keys: bool) -> None:
        wanted = ["row_kind", "file", "line", "host", "pid", "comm", "logical_id", "global_rank", "rank_in_comm",
                  "nranks", "parallelism", "status", "kernel_global_pid", "kernel_correlation_id"]  # fmt: skip
        facts: list[_RunFacts] = []
        rows: dict[int, int] = {}
        kernels, keys, key_lids = [], [], []
        self.files: dict[str, int] = {}
        self.calls = 0
        for batch in iter_record_batches(ops_path, wanted, batch_rows):
            calls = _call_rows(read_table_batch(batch))
            if calls.empty:
                continue
            self.calls += len(calls)
            facts.append(_RunFacts.of(calls))
            lid = _lid_keys(calls)
            _count_keys(rows, lid)
            has = ((calls["status"] == "matched").fillna(False).to_numpy(bool)
                   & calls["kernel_global_pid"].notna().to_numpy() & calls["kernel_correlation_id"].notna().to_numpy())
            if has.any():
                kernels.append(pd.DataFrame({"gpid": calls["kernel_global_pid"][has].astype("int64").to_numpy(),
                                             "corr": calls["kernel_correlation_id"][has].astype("int64").to_numpy(),
                                             "lid": lid[has]}).drop_duplicates())  # fmt: skip
            if with_keys:
                keys.append(self.call_keys(calls["file"], calls["line"], add=True))
                key_lids.append(lid)
        self.facts = _RunFacts.combine(facts)
        self.lid_rows = rows
        self.kernels = pd.concat(kernels, ignore_index=True) if kernels else pd.DataFrame(columns=["gpid", "corr", "lid"])
        order = np.argsort(np.concatenate(keys), kind="stable") if keys else np.zeros(0, dtype=np.int64)
        self.keys = np.concatenate(keys)[order] if keys else np.zeros(0, dtype=np.int64)
        self.key_lids = np.concatenate(key_lids)[order] if keys else np.zeros(0, dtype=np.int64)

    def call_keys(self, file: pd.Series, line: pd.Series, add: bool = False) -> np.ndarray:
        """Keys of (file, line) pairs; -1 for a file no call row has (unless ``add``) or no line."""
        f = file.astype("string")
        if add:
            for name in f.dropna().unique():
                self.files.setdefault(str(name), len(self.files))
        code = f.map(self.files).astype("Int64").fillna(-1).to_numpy("int64")
        ln = pd.to_numeric(line, errors="coerce").astype("Int64").fillna(-1).to_numpy("int64")
        ok = (code >= 0) & (ln >= 0) & (ln < (1 << _LINE_BITS))
        return np.where(ok, (code << _LINE_BITS) | np.where(ok, ln, 0), -1)

    def parts_of_keys(self, keys: np.ndarray, part_of: dict[int, int]) -> np.ndarray:
        """The part of the call each key names (``part_of``: part per communicator key); -1 when
        no call row has the key (such TUNING lines are attached to no call and change nothing)."""
        if not len(self.keys):
            return np.full(len(keys), -1, dtype=np.int64)
        idx = np.clip(np.searchsorted(self.keys, keys), 0, len(self.keys) - 1)
        found = (keys >= 0) & (self.keys[idx] == keys)
        return np.where(found, _parts_of(self.key_lids[idx], part_of), -1)

    def parts(self, part_rows: int) -> dict[int, int]:
        """Part of each communicator key: communicators whose calls share a kernel launch are
        kept together (union-find), then packed in id order into parts of ``part_rows`` calls."""
        parent = {k: k for k in self.lid_rows}

        def root(k: int) -> int:
            while parent[k] != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k

        k = self.kernels.drop_duplicates()
        shared = k[k.duplicated(["gpid", "corr"], keep=False)]
        for _, g in shared.groupby(["gpid", "corr"]):
            lids = [int(x) for x in g["lid"]]
            for other in lids[1:]:
                a, b = root(lids[0]), root(other)
                if a != b:
                    parent[max(a, b)] = min(a, b)
        groups: dict[int, list[int]] = {}
        for lid in sorted(self.lid_rows):
            groups.setdefault(root(lid), []).append(lid)
        part_of: dict[int, int] = {}
        part, filled = 0, 0
        for members in groups.values():
            size = sum(self.lid_rows[m] for m in members)
            if filled and filled + size > part_rows:
                part, filled = part + 1, 0
            filled += size
            part_of.update(dict.fromkeys(members, part))
        return part_of


def _present(path: Path, columns: list[str]) -> list[str]:
    names = pq.read_schema(path).names
    return [c for c in columns if c in names]


def _lid_keys(calls: pd.DataFrame) -> np.ndarray:
    """The part key of each call row: its logical communicator, _NO_LID when it has none."""
    return calls["logical_id"].astype("Int64").fillna(_NO_LID).to_numpy("int64")


def _lid_keys_of(table: pa.Table | pa.RecordBatch) -> np.ndarray:
    """``_lid_keys`` of Arrow call rows (all _NO_LID when the table has no logical_id column)."""
    if "logical_id" not in table.schema.names:
        return np.full(table.num_rows, _NO_LID, dtype=np.int64)
    return _lid_keys(read_table_batch(table.select(["logical_id"])))


def _count_keys(counts: dict[int, int], keys: np.ndarray) -> None:
    """Add the occurrences of each key in ``keys`` to ``counts``."""
    for k, c in zip(*np.unique(keys, return_counts=True)):
        counts[int(k)] = counts.get(int(k), 0) + int(c)


def _parts_of(lids: np.ndarray, part_of: dict[int, int]) -> np.ndarray:
    return pd.Series(lids).map(part_of).fillna(-1).to_numpy("int64")


def _spill_by_part(spill: PartSpill, prefix: str, table: pa.Table, parts: np.ndarray) -> None:
    """Append each row of ``table`` to the part ``parts`` names (rows of part -1 are dropped)."""
    if not len(parts):
        return
    order = np.argsort(parts, kind="stable")
    sorted_parts = parts[order]
    table = table.take(pa.array(order))
    bounds = np.flatnonzero(np.r_[True, sorted_parts[1:] != sorted_parts[:-1], True])
    for a, b in itertools.pairwise(bounds):
        if sorted_parts[a] >= 0:
            spill.append(f"{prefix}-{sorted_parts[a]}", table.slice(a, b - a))


def write_run_metrics_out_of_core(ops_path: Path | str, parsed_nccl_dirs: Sequence[Path | str],
                                  communicators: pd.DataFrame | None, out_dir: Path | str, *,
                                  part_rows: int = PART_ROWS, batch_rows: int = 1 << 18) -> WrittenMetrics:  # fmt: skip
    """Compute and write the metrics tables of the ops file ``ops_path`` in bounded memory;
    the tables equal ``write_run_metrics(compute_run_metrics(...))``.

    A file of at most ``part_rows`` rows is one part, computed in memory. Otherwise, two passes
    over the ops file in batches of ``batch_rows``: the first gathers the run-wide
    facts and sizes the communicators; the second routes the call rows into parts of whole
    communicators (about ``part_rows`` calls each) spilled to a private directory in ``out_dir``.
    Each part is computed alone; op_metrics and instances are merged back into run order from
    the spilled results. Peak memory: one part plus the run-wide facts (and 12 bytes per call
    for the call keys when the logs have TUNING lines).
    """
    ops_path, out_dir = Path(ops_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dirs = [Path(d) for d in parsed_nccl_dirs]
    if pq.read_metadata(ops_path).num_rows <= part_rows:
        # the run is one part: computed in memory, without the passes and the spill
        result = compute_run_metrics(read_table(ops_path, columns=_present(ops_path, OPS_COLUMNS)), dirs,
                                     communicators)  # fmt: skip
        return WrittenMetrics(write_run_metrics(result, out_dir), result.problems, len(result.op_metrics),
                              len(result.instances), int(len(result.op_metrics) > 0))  # fmt: skip
    tuning_files = [d / "tuning.parquet" for d in dirs if (d / "tuning.parquet").is_file()]
    with_tuning = any(pq.read_metadata(f).num_rows for f in tuning_files)
    scan = _Scan(ops_path, batch_rows, with_tuning)
    ctx = _RunContext(scan.facts, dirs, communicators)
    part_of = scan.parts(part_rows)
    n_parts = max(part_of.values(), default=-1) + 1
    with PartSpill(out_dir) as spill:
        if with_tuning:
            for f in tuning_files:
                t = pq.read_table(f, columns=_TUNING_COLUMNS)
                keys = scan.call_keys(t["file"].to_pandas(), t["call_line"].to_pandas())
                _spill_by_part(spill, "tuning", t, scan.parts_of_keys(keys, part_of))
        start = 0
        for batch in iter_record_batches(ops_path, OPS_COLUMNS, batch_rows):
            t = pa.Table.from_batches([batch])
            t = t.filter(pc.fill_null(pc.equal(t["row_kind"], "call"), False))
            if not t.num_rows:
                continue
            t = t.append_column("_row", pa.array(np.arange(start, start + t.num_rows, dtype=np.int64)))
            start += t.num_rows
            parts = _parts_of(_lid_keys_of(t), part_of)
            if (parts < 0).any():
                raise RuntimeError(f"{ops_path}: communicators the first pass did not see (the file changed while "
                                   "metrics read it)")  # fmt: skip
            _spill_by_part(spill, "calls", t, parts)
        if start != scan.calls:
            raise RuntimeError(f"{ops_path}: {scan.calls} call rows in the first pass, {start} in the second "
                               "(the file changed while metrics read it)")  # fmt: skip
        counts: dict[str, int] = {}
        stragglers, algorithms, medians, instances = [], [], [], 0
        for p in range(n_parts):
            table = spill.read(f"calls-{p}")
            if table is None:
                continue
            frame = read_table_batch(table)
            rows = frame["_row"].to_numpy("int64")
            tun = spill.read(f"tuning-{p}")
            part = _part_metrics(_call_rows(frame), ctx,
                                 read_table_batch(tun) if tun is not None else pd.DataFrame(columns=_TUNING_COLUMNS))
            del frame, table
            spill.append(f"om-{p}", pa.Table.from_pandas(part.op_metrics, schema=OP_METRICS_SCHEMA,
                                                         preserve_index=False).append_column("_row", pa.array(rows)))
            spill.append(f"inst-{p}", pa.Table.from_pandas(part.instances, schema=INSTANCE_SCHEMA, preserve_index=False)
                         .append_column("_row", pa.array(rows[part.instance_rows], type=pa.int64())))
            instances += len(part.instances)
            stragglers.append(part.stragglers)
            algorithms.append(part.algorithms)
            medians.append(part.medians)
            _add_counts(counts, part.counts)
        parts_written = [spill.finish(f"om-{p}") for p in range(n_parts)]
        inst_written = [spill.finish(f"inst-{p}") for p in range(n_parts)]
        paths = {"op_metrics": out_dir / "op_metrics.parquet", "instances": out_dir / "instances.parquet"}
        op_rows = merge_sorted_parts([x for x in parts_written if x], "_row", scan.calls, paths["op_metrics"],
                                     OP_METRICS_SCHEMA)  # fmt: skip
        merge_sorted_parts([x for x in inst_written if x], "_row", scan.calls, paths["instances"], INSTANCE_SCHEMA)
    paths["stragglers"] = _write_frame(_sorted_concat(stragglers, STRAGGLER_SCHEMA, ["logical_id", "global_rank"]),
                                       STRAGGLER_SCHEMA, out_dir / "stragglers.parquet")  # fmt: skip
    paths["limits"] = _write_frame(_limit_table(ctx, medians), LIMIT_SCHEMA, out_dir / "limits.parquet")
    paths["algorithms"] = _write_frame(_sorted_concat(algorithms, ALGORITHM_SCHEMA, ["logical_id", "op", "min_bytes"]),
                                       ALGORITHM_SCHEMA, out_dir / "algorithms.parquet")  # fmt: skip
    return WrittenMetrics({name: paths[name] for name in TABLE_SCHEMAS}, _problems(counts, ctx), op_rows, instances,
                          n_parts)  # fmt: skip
