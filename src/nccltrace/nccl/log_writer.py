"""Render NCCL debug-log lines exactly as a given NCCL release prints them.

Used by the workload emulator and by tests. Each method writes one (or, for the
topology block, several) complete INFO lines in the chosen version's format; the
format rules are in :mod:`nccltrace.nccl.versions` and ``docs/nccl-log-formats.md``.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import TextIO

from nccltrace.nccl.enums import ALGORITHMS, PROTOCOLS
from nccltrace.nccl.versions import NcclVersion


def fmt_ptr(value: int | None) -> str:
    """``%p`` as glibc prints it: ``0x...`` in lower-case hex, ``(nil)`` for NULL."""
    return "(nil)" if not value else f"0x{value:x}"


@dataclass
class TopoGpu:
    """A GPU in the topology dump: PCI bus id (e.g. 0x1a000), rank, NVML index."""

    bus_id: int
    rank: int
    nvml_dev: int
    cpu: int = 0


@dataclass
class TopoNic:
    """A NIC below a CPU with one network port."""

    bus_id: int
    net_dev: int
    bw: float
    guid: int = 0x1000_0000_0000
    cpu: int = 0


@dataclass
class TopoSystem:
    """One node's topology as NCCL's GRAPH subsystem dumps it.

    ``nvlink_bw`` is the per-GPU NVLink bandwidth (GB/s); with ``nvswitch`` the GPUs link to
    an ``NVS`` node, otherwise to each other pairwise. ``None`` = PCIe-only node.
    """

    gpus: list[TopoGpu]
    nvlink_bw: float | None = 240.0
    nvswitch: bool = True
    pci_bw: float = 24.0
    sys_bw: float = 10.0
    cpus: int = 1
    nics: list[TopoNic] = field(default_factory=list)

    @property
    def max_bw(self) -> float:
        return self.nvlink_bw if self.nvlink_bw else self.pci_bw

    @property
    def total_bw(self) -> float:
        return self.nvlink_bw if self.nvlink_bw else self.pci_bw


class NcclLogWriter:
    """Write one process's NCCL debug log (the ``NCCL_DEBUG_FILE`` of that process).

    ``lines_written`` counts physical lines so callers can record 1-based line numbers
    for ground truth right after a call.
    """

    def __init__(
        self,
        fh: TextIO,
        *,
        nccl_version: str,
        host: str,
        pid: int,
        cuda_version: str = "12.4",
        timestamps: bool = False,
        cuda_dev: int = 0,
    ) -> None:
        self.fh = fh
        self.nccl = NcclVersion.parse(nccl_version)
        self.host = host
        self.pid = pid
        self.cuda_version = cuda_version
        self.cuda_dev = cuda_dev
        # Timestamped INFO lines need NCCL_DEBUG_TIMESTAMP_LEVELS, which exists from 2.26.
        self.timestamps = bool(timestamps) and self.nccl.supports_timestamps
        self.lines_written = 0
        self._last_wall: int | None = None  # for WARN lines written without an explicit time

    # --- low level -----------------------------------------------------------------
    def _stamp(self, wall_ns: int | None) -> str:
        if not self.timestamps or wall_ns is None:
            return ""
        secs, ns = divmod(int(wall_ns), 1_000_000_000)
        t = _dt.datetime.fromtimestamp(secs, tz=_dt.timezone.utc)
        # The format users set: NCCL_DEBUG_TIMESTAMP_FORMAT="[%F %T.%6f] " (hosts in UTC here).
        return f"[{t:%Y-%m-%d %H:%M:%S}.{ns // 1000:06d}] "

    def _line(self, tid: int, message: str, wall_ns: int | None = None) -> None:
        if wall_ns is not None:
            self._last_wall = wall_ns
        self.fh.write(
            f"{self._stamp(wall_ns)}{self.host}:{self.pid}:{tid} [{self.cuda_dev}] NCCL INFO {message}\n"
        )
        self.lines_written += 1

    def info(self, tid: int, message: str, *, wall_ns: int | None = None) -> None:
        """Write an arbitrary INFO message."""
        self._line(tid, message, wall_ns)

    def warn(self, tid: int, *, src_file: str, src_line: int, message: str, function: str | None = None,
             wall_ns: int | None = None) -> None:
        """WARN lines start with an empty line; from 2.26 they carry a timestamp by default.

        The default WARN stamp is ``[%F %T] ``; a job that set NCCL_DEBUG_TIMESTAMP_FORMAT for INFO
        (``timestamps=True`` here) gets that format on WARN too. 2.30.7 adds ``(function)``.
        """
        wall_ns = self._last_wall if wall_ns is None else wall_ns
        stamp = ""
        if self.nccl.supports_timestamps and wall_ns is not None:
            if self.timestamps:
                stamp = self._stamp(wall_ns)
            else:
                secs = int(wall_ns) // 1_000_000_000
                stamp = f"[{_dt.datetime.fromtimestamp(secs, tz=_dt.timezone.utc):%Y-%m-%d %H:%M:%S}] "
        where = f"{src_file}:{src_line}"
        if function and self.nccl.tuple >= (2, 30, 7):
            where += f" ({function})"
        self.fh.write(f"\n{stamp}{self.host}:{self.pid}:{tid} [{self.cuda_dev}] {where} NCCL WARN {message}\n")
        self.lines_written += 2

    # --- lifecycle -----------------------------------------------------------------
    def version(self, tid: int, *, wall_ns: int | None = None) -> None:
        """The version line. Before 2.22 the bare line goes to stdout and the INFO copy to the file."""
        self._line(tid, f"NCCL version {self.nccl}+cuda{self.cuda_version}", wall_ns)

    version_line = version

    def init(
        self,
        tid: int,
        *,
        comm: int,
        rank: int,
        nranks: int,
        cuda_dev: int,
        nvml_dev: int,
        bus_id: int,
        comm_id: int,
        api: str = "ncclCommInitRank",
        phase: str = "COMPLETE",
        wall_ns: int | None = None,
    ) -> bool:
        """Init START/COMPLETE line of a non-split communicator. Returns False if not printed."""
        style = self.nccl.init_style
        if phase == "START" and style.startswith("complete_only"):
            return False
        if style == "complete_only_no_commid":
            body = f"comm {fmt_ptr(comm)} rank {rank} nranks {nranks} cudaDev {cuda_dev} busId {bus_id:x}"
        elif style == "complete_only_no_nvml":
            body = (
                f"comm {fmt_ptr(comm)} rank {rank} nranks {nranks} cudaDev {cuda_dev} busId {bus_id:x} "
                f"commId 0x{comm_id:x}"
            )
        else:
            body = (
                f"comm {fmt_ptr(comm)} rank {rank} nranks {nranks} cudaDev {cuda_dev} nvmlDev {nvml_dev} "
                f"busId {bus_id:x} commId 0x{comm_id:x}"
            )
            if style == "literal_api":
                body = f"ncclCommInitRank {body}"
            elif style != "base":
                body = f"{api} {body}"
            if style == "api_child_count" and phase == "START":
                body = f"[Rank {rank}] {body}"
        self._line(tid, f"{body} - Init {phase}", wall_ns)
        return True

    def split(
        self,
        tid: int,
        *,
        comm: int,
        rank: int,
        nranks: int,
        cuda_dev: int,
        nvml_dev: int,
        bus_id: int,
        parent: int,
        color: int,
        key: int,
        split_count: int = 1,
        comm_id: int = 0,
        phase: str = "COMPLETE",
        wall_ns: int | None = None,
    ) -> bool:
        """Init line of a communicator made by ``ncclCommSplit``.

        Before 2.21.5 split communicators print the plain init form (with a commId mixed
        from the parent hash and color); from 2.23 no commId is printed.
        """
        style = self.nccl.init_style
        if style in ("complete_only_no_commid", "complete_only_no_nvml", "base"):
            return self.init(
                tid, comm=comm, rank=rank, nranks=nranks, cuda_dev=cuda_dev, nvml_dev=nvml_dev,
                bus_id=bus_id, comm_id=comm_id, phase=phase, wall_ns=wall_ns,
            )
        head = (
            f"ncclCommSplit comm {fmt_ptr(comm)} rank {rank} nranks {nranks} cudaDev {cuda_dev} "
            f"nvmlDev {nvml_dev} busId {bus_id:x} parent {fmt_ptr(parent)} "
        )
        if style == "literal_api":
            body = f"{head}color {color} key {key} commId 0x{comm_id:x} - Init {phase}"
        else:
            count = ""
            if style == "api_split_count":
                count = f"splitCount {split_count} "
            elif style == "api_child_count":
                count = f"childCount {split_count} "
            # The START form has no space before '-' (a quirk of the format string).
            sep = "" if phase == "START" else " "
            body = f"{head}{count}color {color} key {key}{sep}- Init {phase}"
        self._line(tid, body, wall_ns)
        return True

    def comm_info(
        self, tid: int, *, comm: int, rank: int, nranks: int, nnodes: int, local_ranks: int, local_rank: int,
        wall_ns: int | None = None,
    ) -> bool:
        """``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d`` (>= 2.20)."""
        if not self.nccl.has_comm_info_line:
            return False
        self._line(
            tid,
            f"comm {fmt_ptr(comm)} rank {rank} nRanks {nranks} nNodes {nnodes} localRanks {local_ranks} "
            f"localRank {local_rank} MNNVL 0",
            wall_ns,
        )
        return True

    def ring(self, tid: int, channel: int, nchannels: int, ranks: list[int], *, wall_ns: int | None = None) -> None:
        """Ring order line printed by rank 0 of a communicator."""
        if self.nccl.ring_line_style == "fixed3":
            body = f"Channel {channel:02d}/{nchannels:02d} : " + "".join(f" {r:3d}" for r in ranks[:20])
        else:
            width = len(str(max(len(ranks) - 1, 0)))
            body = f"Channel {channel:02d}/{nchannels:02d} :" + "".join(f" {r:{width}d}" for r in ranks)
            if len(body) > 127:
                body = body[:124] + "..."
        self._line(tid, body, wall_ns)

    def destroy(
        self, tid: int, *, comm: int, rank: int, nranks: int, cuda_dev: int, bus_id: int, wall_ns: int | None = None
    ) -> None:
        """Destroy COMPLETE line (moved to the non-default DESTROY subsystem in 2.30.3)."""
        self._line(
            tid,
            f"comm {fmt_ptr(comm)} rank {rank} nranks {nranks} cudaDev {cuda_dev} busId {bus_id:x} - Destroy COMPLETE",
            wall_ns,
        )

    # --- operations ----------------------------------------------------------------
    def call(
        self,
        tid: int,
        *,
        op: str,
        op_count: int,
        sendbuff: int,
        recvbuff: int,
        count: int,
        datatype: int,
        redop: int,
        root: int,
        comm: int,
        nranks: int,
        stream: int,
        wall_ns: int | None = None,
    ) -> int:
        """The per-call COLL line. Returns its 1-based line number in this file."""
        if op == "Send" and self.nccl.send_buffer_in_recv_slot:
            # From 2.12 Send stores its buffer in the recv slot and logs sendbuff (nil).
            sendbuff, recvbuff = 0, sendbuff or recvbuff
        self._line(
            tid,
            f"{op}: opCount {op_count:x} sendbuff {fmt_ptr(sendbuff)} recvbuff {fmt_ptr(recvbuff)} "
            f"count {count} datatype {datatype} op {redop} root {root} comm {fmt_ptr(comm)} "
            f"[nranks={nranks}] stream {fmt_ptr(stream)}",
            wall_ns,
        )
        return self.lines_written

    def tuning(
        self,
        tid: int,
        *,
        op: str,
        nbytes: int,
        algo: str,
        proto: str,
        channel_lo: int = 0,
        channel_hi: int = 0,
        time_us: float = 0.0,
        nranks: int = 1,
        wall_ns: int | None = None,
    ) -> bool:
        """Algorithm/protocol line (rank 0 of the communicator only; caller decides who prints).

        ``nbytes`` is the per-rank payload (count x type size); versions 2.20-2.23 print the
        full buffer for AllGather/ReduceScatter. Returns False if the version prints no
        INFO TUNING line (< 2.20) or for Send/Recv (never tuned).
        """
        fmt = self.nccl.tuning_format
        if fmt is None or op in ("Send", "Recv"):
            return False
        if self.nccl.tuning_bytes_include_nranks and op in ("AllGather", "ReduceScatter"):
            nbytes *= nranks
        if fmt == "op_bytes_named":
            body = (
                f"{op}: {nbytes} Bytes -> Algo {algo} proto {proto} channel{{Lo..Hi}}={{{channel_lo}..{channel_hi}}}"
            )
        else:
            body = f"{nbytes} Bytes -> Algo {ALGORITHMS.index(algo)} proto {PROTOCOLS.index(proto)} time {time_us:f}"
            if fmt == "op_bytes_numeric":
                body = f"{op}: {body}"
        self._line(tid, body, wall_ns)
        return True

    # --- topology ------------------------------------------------------------------
    def _node_id(self, kind: str, local_id: int, through_pci: bool) -> str:
        style = self.nccl.topo_node_style
        if style == "hex" or (style == "mixed" and not through_pci):
            return f"{kind}/{local_id:X}"
        return f"{kind}/0-{local_id:x}"

    def topology(self, tid: int, topo: TopoSystem, *, wall_ns: int | None = None) -> None:
        """The GRAPH topology dump: system header, one line per node/link, closing rule."""
        self._line(tid, f"=== System : maxBw {topo.max_bw:2.1f} totalBw {topo.total_bw:2.1f} ===", wall_ns)
        for cpu in range(topo.cpus):
            self._line(tid, f"{self._node_id('CPU', cpu, False)} (1/1/2)", wall_ns)
            for gpu in (g for g in topo.gpus if g.cpu == cpu):
                link = f"+ PCI[{topo.pci_bw:2.1f}] - "
                self._line(tid, f"{link}{self._node_id('GPU', gpu.bus_id, True)} ({gpu.rank})", wall_ns)
                indent = " " * len(link)
                if topo.nvlink_bw:
                    if topo.nvswitch:
                        self._line(
                            tid, f"{indent}+ NVL[{topo.nvlink_bw:2.1f}] - {self._node_id('NVS', 0, False)}", wall_ns
                        )
                    else:
                        per_peer = topo.nvlink_bw / max(len(topo.gpus) - 1, 1)
                        for peer in topo.gpus:
                            if peer is not gpu:
                                self._line(
                                    tid,
                                    f"{indent}+ NVL[{per_peer:2.1f}] - {self._node_id('GPU', peer.bus_id, False)}",
                                    wall_ns,
                                )
            for nic in (n for n in topo.nics if n.cpu == cpu):
                link = f"+ PCI[{topo.pci_bw:2.1f}] - "
                self._line(tid, f"{link}{self._node_id('NIC', nic.bus_id, True)}", wall_ns)
                indent = " " * len(link)
                if self.nccl.tuple >= (2, 24, 0):
                    leaf = f"(1/{nic.guid:x}/1/{nic.bw:f})"
                else:
                    leaf = f"({nic.guid:x}/1/{nic.bw:f})"
                net_id = f"NET/{nic.net_dev}" if self.nccl.tuple < (2, 23, 0) else f"NET/0-{nic.net_dev:x}"
                self._line(tid, f"{indent}+ NET[{nic.bw:2.1f}] - {net_id} {leaf}", wall_ns)
            for other in range(topo.cpus):
                if other != cpu:
                    self._line(tid, f"+ SYS[{topo.sys_bw:2.1f}] - {self._node_id('CPU', other, False)}", wall_ns)
        self._line(tid, "=" * 42, wall_ns)
