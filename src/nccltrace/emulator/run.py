"""Write the raw outputs an emulated run leaves, plus ground truth.

An emulated run leaves what a real one would (NCCL logs per process, an nsys export per node,
``run.yaml``) and, beside it, the ground truth the analysis is measured against
(``ground_truth/``: every call, kernel, communicator and clock). Every file is written to a
temporary sibling and renamed into place, and memory is bounded by one rank's output: ranks are
processed node by node, each rank's program generated lazily and streamed to the writers. The
layout, and the ``capture`` window's effect: ``docs/emulator.md`` section 3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import io
import math
import os
import sys
import time as _time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from nccltrace import __version__
from nccltrace.core.capture_window import CaptureWindow
from nccltrace.core.layout import RUN_YAML_FILE
from nccltrace.core.tables import atomic_path, file_schema
from nccltrace.emulator.config import EmulatorConfig
from nccltrace.emulator.layout import Group, MegatronLayout, PairComm, layout_of
from nccltrace.emulator.schedule import (
    _DT_SIZE,
    _STREAM_KIND,
    P2P_OPS,
    Op,
    RankProgram,
    Unit,
    hash_ints,
    kernel_op_of_unit,
)
from nccltrace.emulator.timing import (
    KernelSpec,
    LinkModel,
    RankTimer,
    Skeleton,
    TimingParams,
    UnitTimes,
    u01,
)
from nccltrace.nccl.log_writer import NcclLogWriter, TopoGpu, TopoNic, TopoSystem
from nccltrace.nccl.versions import NcclVersion
from nccltrace.nsys.writer import NsysExportWriter, encode_global_pid

__all__ = ["emulate_run", "EmulationResult", "nccl_kernel_name", "symmetric_kernel", "GROUND_TRUTH_SCHEMAS"]

# --------------------------------------------------------------------------- ground-truth schemas

_U64 = pa.uint64()
GROUND_TRUTH_SCHEMAS: dict[str, pa.Schema] = {
    "ops": pa.schema([
        ("rank", pa.int32()), ("host", pa.string()), ("pid", pa.int64()), ("tid", pa.int64()),
        ("log_file", pa.string()), ("log_line", pa.int64()), ("duplicate_line", pa.int64()),
        ("seq", pa.int64()), ("iteration", pa.int32()), ("phase", pa.string()),
        ("op", pa.string()), ("comm", _U64), ("op_count", pa.int64()), ("count", pa.int64()),
        ("dtype", pa.int8()), ("bytes", pa.int64()), ("redop", pa.int32()), ("root", pa.int32()),
        ("peer_global", pa.int32()), ("nranks", pa.int32()), ("rank_in_comm", pa.int32()),
        ("group_kind", pa.string()), ("group_index", pa.int32()), ("comm_uid", _U64),
        ("nccl_group", pa.int64()), ("grouped", pa.bool_()), ("instance_id", pa.int64()),
        ("stream_kind", pa.string()), ("stream", _U64), ("call_time_true_ns", pa.int64()), ("wall_ns", pa.int64()),
        ("kernel_correlation_id", pa.int64()), ("kernel_global_pid", pa.int64()),
        ("line_dropped", pa.bool_()), ("line_duplicated", pa.bool_()), ("line_torn_in_stdout", pa.bool_()),
        ("kernel_dropped", pa.bool_()), ("single_rank_no_kernel", pa.bool_()), ("kernel_fused", pa.bool_()),
    ]),  # fmt: skip
    "kernels": pa.schema([
        ("rank", pa.int32()), ("host", pa.string()), ("pid", pa.int64()), ("global_pid", pa.int64()),
        ("device_id", pa.int32()), ("stream_id", pa.int32()), ("correlation_id", pa.int64()),
        ("name", pa.string()), ("short_name", pa.string()), ("family", pa.string()),
        ("start", pa.int64()), ("end", pa.int64()), ("start_true_ns", pa.int64()), ("end_true_ns", pa.int64()),
        ("grid_x", pa.int32()), ("block_x", pa.int32()),
        ("iteration", pa.int32()), ("unit", pa.int64()), ("n_ops", pa.int32()), ("first_seq", pa.int64()),
        ("instance_id", pa.int64()), ("comm_uid", _U64), ("algo", pa.string()), ("proto", pa.string()),
        ("dropped", pa.bool_()), ("without_log", pa.bool_()),
    ]),  # fmt: skip
    "communicators": pa.schema([
        ("rank", pa.int32()), ("host", pa.string()), ("pid", pa.int64()), ("comm", _U64), ("comm_uid", _U64),
        ("group_kind", pa.string()), ("group_index", pa.int32()), ("nranks", pa.int32()),
        ("rank_in_comm", pa.int32()), ("members", pa.list_(pa.int32())), ("comm_hash", _U64),
        ("comm_id_logged", _U64), ("init_api", pa.string()), ("parent", _U64), ("color", pa.int64()),
        ("key", pa.int64()), ("split_count", pa.int32()), ("init_line", pa.int64()),
        ("stream", _U64), ("stream_id", pa.int32()), ("created_true_ns", pa.int64()),
    ]),  # fmt: skip
    "clock": pa.schema([
        ("node", pa.int32()), ("host", pa.string()), ("offset_ns", pa.int64()), ("drift_ppm", pa.float64()),
        ("session_start_true_ns", pa.int64()), ("session_start_utc_ns", pa.int64()),
    ]),  # fmt: skip
}


# With a capture window, ops and kernels say whether they lie in it (on a profiled rank): the
# call's NVTX range, launch and kernel are then in the export unless an imperfection dropped them.
_CAPTURE_COLUMN = ("in_capture", pa.bool_())


# With cuda_graphs (docs/emulator.md section 4.1): which calls were captured into which graph,
# and for every graph-replayed kernel which captured call it replays and which replay it is.
_GRAPH_OPS_COLUMNS = [("graph_captured", pa.bool_()), ("graph_id", pa.int64()), ("graph_node_id", pa.int64()),
                      ("capture_launch_correlation_id", pa.int64())]  # fmt: skip
_GRAPH_KERNEL_COLUMNS = [("graph_id", pa.int64()), ("graph_node_id", pa.int64()), ("graph_replay", pa.int64()),
                         ("replay_of_seq", pa.int64()), ("replay_of_log_line", pa.int64())]  # fmt: skip
# With kernel_naming (section 4.2): which naming rule gave the kernel its name.
_NAMING_KERNEL_COLUMNS = [("name_rule", pa.string())]


def ground_truth_schemas(capture: bool, graphs: bool = False, naming: bool = False) -> dict[str, pa.Schema]:
    """Ground-truth schemas of a run; with a capture window ops and kernels gain ``in_capture``,
    with CUDA graphs the graph columns, with kernel naming rules ``kernels.name_rule``. Without
    any of them the schemas are exactly :data:`GROUND_TRUTH_SCHEMAS`."""
    if not (capture or graphs or naming):
        return GROUND_TRUTH_SCHEMAS
    extra: dict[str, list] = {"ops": [], "kernels": []}
    if capture:
        extra["ops"].append(_CAPTURE_COLUMN)
        extra["kernels"].append(_CAPTURE_COLUMN)
    if graphs:
        extra["ops"] += _GRAPH_OPS_COLUMNS
        extra["kernels"] += _GRAPH_KERNEL_COLUMNS
    if naming:
        extra["kernels"] += _NAMING_KERNEL_COLUMNS
    out = {}
    for name, schema in GROUND_TRUTH_SCHEMAS.items():
        for col in extra.get(name, []):
            schema = schema.append(pa.field(*col))
        out[name] = schema
    return out


class _Sink:
    """Stream rows into a Parquet file (temp file renamed on close).

    A row is a tuple of the schema's values in schema order. Rows are converted a batch at a
    time by Arrow (list of tuples -> struct array -> table; a dict per row and
    ``Table.from_pylist`` were a fifth of the emulator's time, a per-column append loop before
    that). ``transforms`` maps a column index to a function applied to the whole column of a
    batch (an int64 array, e.g. true times -> nsys timestamps)."""

    def __init__(self, path: Path, schema: pa.Schema, batch: int = 100_000,
                 transforms: dict[int, Any] | None = None, part: bool = False) -> None:  # fmt: skip
        self.path = path
        self.schema = schema
        self.struct = pa.struct(list(schema))
        self.batch = batch
        self.transforms = transforms or {}
        self.pending: list[tuple] = []
        self.tmp = atomic_path(path)
        # A part file (read back once by _merge_parts, which encodes the published file) is
        # written plain: compressing and dictionary-encoding it twice cost more than its I/O.
        self.writer = (pq.ParquetWriter(self.tmp, schema, compression="none", use_dictionary=False) if part
                       else pq.ParquetWriter(self.tmp, file_schema(schema), compression="zstd"))  # fmt: skip
        self.rows = 0

    def add(self, row: tuple) -> None:
        """Add a row. (Hot paths append to :attr:`pending` directly and call :meth:`flush_full`.)"""
        self.pending.append(row)
        if len(self.pending) >= self.batch:
            self.flush_full()

    def flush_full(self) -> None:
        """Write every complete batch of pending rows (row groups of exactly ``batch`` rows, as
        if each batch had been written when its last row was added)."""
        pending, batch = self.pending, self.batch
        while len(pending) >= batch:
            self._write(pending[:batch])
            del pending[:batch]

    def flush(self) -> None:
        """Write every pending row."""
        self.flush_full()
        if self.pending:
            self._write(self.pending)
            self.pending.clear()

    def _write(self, rows: list[tuple]) -> None:
        self.rows += len(rows)
        width = len(self.schema)
        if min(map(len, rows)) != width or max(map(len, rows)) != width:
            raise RuntimeError(f"{self.path.name}: a row does not have the {width} columns of the schema")
        table = pa.Table.from_struct_array(pa.array(rows, type=self.struct))
        for i, fn in self.transforms.items():
            col = table.column(i)
            if col.null_count:
                raise RuntimeError(f"{self.path.name}: column {self.schema[i].name} has nulls; cannot transform")
            table = table.set_column(i, self.schema[i], pa.array(fn(col.to_numpy()), type=self.schema[i].type))
        self.writer.write_table(table)

    def close(self) -> Path:
        self.flush()
        self.writer.close()
        return _publish(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self.writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------- names

_TY19 = {0: "u8", 1: "u8", 2: "u32", 3: "u32", 4: "u64", 5: "u64", 6: "f16", 7: "f32", 8: "f64", 9: "bf16"}
_TY18 = {0: "int8_t", 1: "uint8_t", 2: "int32_t", 3: "uint32_t", 4: "int64_t", 5: "uint64_t", 6: "half",
         7: "float", 8: "double", 9: "__nv_bfloat16"}  # fmt: skip


def nccl_kernel_name(version: NcclVersion, family: str, dtype: int, redop: int, algo: str) -> tuple[str, str]:
    """(demangled name with parameter list, short name) of the kernel NCCL launches
    (reference/nccl/log-formats.md §8): ``ncclKernel_*`` up to 2.18, ``ncclDevKernel_*`` from
    2.19 (parameter list ``(ncclDevKernelArgsStorage<4096ul>)`` from 2.22); reductions other than
    Sum run in ``ncclDevKernel_Generic``; grouped P2P and AlltoAll run in the SendRecv kernel."""
    v = version.tuple
    if family == "AlltoAll":
        family = "SendRecv"
    if v < (2, 19, 0):
        # One kernel per (function, algorithm, type), named with proto LL and op Sum whatever
        # protocol and op run in it (2.18 src/enqueue.cc ncclKerns: NCCL_FUNC5 maps LL/LL128/SIMPLE
        # of every algorithm to the algorithm's LL kernel).
        params = "(ncclDevComm*, unsigned long, ncclWork*)"
        if family == "SendRecv":
            short = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t"
        elif family in ("AllGather", "Broadcast"):
            short = f"ncclKernel_{family}_{algo}_LL_Sum_int8_t"
        else:
            a = algo if family in ("AllReduce", "ReduceScatter") else "RING"
            short = f"ncclKernel_{family}_{a}_LL_Sum_{_TY18[dtype]}"
        return short + params, short
    params = "(ncclDevComm*, unsigned long, ncclWork*)" if v < (2, 22, 0) else "(ncclDevKernelArgsStorage<4096ul>)"
    if family == "SendRecv":
        short = "ncclDevKernel_SendRecv"
    elif family in ("AllGather", "Broadcast"):
        short = f"ncclDevKernel_{family}_RING_LL"
    else:
        # The specialised kernel depends on function and type only; any reduction op runs in it
        # (src/device/generate.py), so max/min/avg AllReduces still launch the _Sum_ kernel; of the
        # algorithms only TREE has its own kernel (best_kernel: NVLS, CollNet, PAT run in RING_LL).
        a = "TREE" if (algo == "TREE" and family == "AllReduce") else "RING"
        short = f"ncclDevKernel_{family}_Sum_{_TY19[dtype]}_{a}_LL"
    return short + params, short


# Symmetric-memory kernels (NCCL 2.27: src/symmetric.cc, 2.28+: src/sym_kernels.cc; names from
# src/device/symmetric/generate.py kernel_cname), in ncclSymkKernelId order, which breaks ties.
_SYM_KERNELS = ("AllReduce_AGxLL_R", "AllReduce_AGxLLMC_R", "AllReduce_RSxLD_AGxST", "AllReduce_RSxLDMC_AGxSTMC",
                "AllGather_LL", "AllGather_LLMC", "AllGather_ST", "AllGather_STMC",
                "ReduceScatter_LL", "ReduceScatter_LD", "ReduceScatter_LDMC")  # fmt: skip
_SYM_STMC = {"AllGather_LLMC", "AllGather_STMC", "AllReduce_AGxLLMC_R", "AllReduce_RSxLDMC_AGxSTMC", "ReduceScatter_LDMC"}
_SYM_LDMC = {"AllReduce_RSxLDMC_AGxSTMC", "ReduceScatter_LDMC"}
_SYM_LL = {"AllReduce_AGxLL_R", "AllReduce_AGxLLMC_R", "AllGather_LL", "AllGather_LLMC", "ReduceScatter_LL"}
_SYM_TY = {7: "f32", 6: "f16", 9: "bf16"}  # float types the reducing symmetric kernels exist for (no f64)
_GPU_ARCH = {"a100": 800, "a40": 860, "h100": 900}  # __CUDA_ARCH__ of the hardware presets
_SYM_MAX_BLOCKS = 64  # ncclSymkMaxBlocks; also the default config.maxCTAs (MAXCHANNELS = 64)


def _sym_time_us(kid: str, nbytes: int, nranks: int, arch: int) -> tuple[float, int]:
    """NCCL's queryModel(): estimated time (us) and block count of one symmetric kernel."""
    ll_bus = 9.0
    n_max = _SYM_MAX_BLOCKS
    n_max_nvls = -(-(16 if arch < 1000 else 32) // nranks)
    mult = 1.0
    if kid in ("AllReduce_AGxLL_R", "AllGather_LL", "ReduceScatter_LL"):
        bus = nranks * nbytes * ll_bus
    elif kid in ("AllReduce_AGxLLMC_R", "AllGather_LLMC"):
        bus, mult = nranks * nbytes * ll_bus, 1.1
    elif kid == "AllReduce_RSxLD_AGxST":
        bus = 2 * nbytes * (nranks - 1) // nranks
    elif kid == "AllReduce_RSxLDMC_AGxSTMC":
        bus, mult, n_max = nbytes // nranks + nbytes, float(nranks), n_max_nvls
    elif kid in ("AllGather_ST", "ReduceScatter_LD"):
        bus = (nranks - 1) * nbytes
    else:  # AllGather_STMC, ReduceScatter_LDMC
        bus, mult, n_max = (nranks - 1) * nbytes, 0.55 * nranks, n_max_nvls
    is_ll, is_ag, is_ar = kid in _SYM_LL, kid.startswith("AllGather"), kid.startswith("AllReduce")
    gbps = (1 << 30) / 1.0e6
    if arch < 1000:
        base, sm_bw = (4.5 if is_ll else 7.8), (65 if is_ar else 44) * gbps
        peak = (480 if kid == "AllReduce_RSxLDMC_AGxSTMC" else 320) * gbps
    else:
        base, sm_bw = (8.5 if is_ag else 11.0) if is_ll else (19.5 if is_ar else 13.0), 55 * gbps
        peak = (1000 if kid == "AllReduce_RSxLDMC_AGxSTMC" else 600) * gbps

    def model(blocks: int) -> float:
        x = blocks * sm_bw * mult
        bw = peak - sm_bw * math.log1p((math.exp(peak / sm_bw) - 1) * math.exp(-x / sm_bw))  # softmin
        z = bus / bw - 1
        return base + (z if z >= 100 else math.log1p(math.exp(z)))  # softplus

    best_t, best_b = model(n_max), n_max
    for b in range(1, n_max):
        t = model(b)
        if t <= 1.025 * best_t:
            return t, b
    return best_t, best_b


def symmetric_kernel(coll: str, dtype: int, redop: int, nelts_max: int, nbytes_total: int, nranks: int,
                     nnodes: int, nworks: int, arch: int, nvls: bool) -> tuple[str, int] | None:  # fmt: skip
    """The symmetric kernel (``AllReduce_AGxLL_R`` ...) and block count NCCL's
    ``ncclSymkPickKernel`` chooses for a collective on registered symmetric buffers, or None when
    no symmetric kernel applies (other collective, op or type, several nodes): NCCL then runs its
    usual kernel. Transcribed from NCCL 2.28.9 src/sym_kernels.cc (2.27 src/symmetric.cc: same
    rules); the multi-node kernels of 2.29+ are not modelled."""
    if coll not in ("AllReduce", "AllGather", "ReduceScatter") or nnodes > 1 or nranks < 2:
        return None
    if coll != "AllGather" and not (redop == 0 and dtype in _SYM_TY):
        return None
    size = _DT_SIZE[dtype]
    ldmc = nvls and redop == 0 and dtype in (2, 3, 4, 5, 6, 9, 7, 8)
    bus = (1 if coll == "AllReduce" else nranks) * nelts_max * size
    if bus >= 32 * (2 << 30):
        return None
    best: tuple[float, str, int] | None = None
    for kid in _SYM_KERNELS:
        if not kid.startswith(coll + "_") or (kid in _SYM_STMC and not nvls) or (kid in _SYM_LDMC and not ldmc):
            continue
        if kid in _SYM_LL and (bus >= (2 << 30) or nworks > 1):
            continue
        t, b = _sym_time_us(kid, nbytes_total, nranks, arch)
        if best is None or t * (1 + 0.025 * b) < best[0] * (1 + 0.025 * best[2]):
            best = (t, kid, b)
    return None if best is None else (best[1], best[2])


def symmetric_kernel_name(version: NcclVersion, kid: str, dtype: int) -> tuple[str, str]:
    """(demangled name, short name) of a symmetric kernel: ``ncclSymDevKernel_<kid>[_sum_<ty>](ncclSymDevArgs)``
    in 2.27, ``ncclSymkDevKernel_<kid>[_sum_<ty>](ncclSymkDevWorkArgs4K)`` from 2.28
    (src/device/symmetric/generate.py)."""
    old = version.tuple < (2, 28, 0)
    short = ("ncclSymDevKernel_" if old else "ncclSymkDevKernel_") + kid
    if not kid.startswith("AllGather"):
        short += f"_sum_{_SYM_TY[dtype]}"
    return short + ("(ncclSymDevArgs)" if old else "(ncclSymkDevWorkArgs4K)"), short


@dataclass(frozen=True)
class _SymTuning:
    """A ``<Coll> [Symmetric]: ... -> Kernel <kid> ...`` TUNING line waiting for its plan's launch."""

    kid: str
    nblocks: int


class _KernelNamer:
    """Kernel names of real builds (config ``kernel_naming``, docs/emulator.md section 4.2)."""

    def __init__(self, cfg: EmulatorConfig, link: LinkModel) -> None:
        kn = cfg.kernel_naming
        self.version = cfg.nccl
        self.link = link
        self.sendrecv = set(kn.collectives_as_sendrecv)
        self.symmetric = set(kn.symmetric)
        self.algorithms = dict(kn.algorithms)
        self.arch = _GPU_ARCH.get(cfg.hardware, 800)
        self.nvls = cfg.hw.nvswitch and self.arch >= 900  # NVLink SHARP multicast (comm->nvlsSupport)

    def _algo(self, coll: str, spec: KernelSpec) -> KernelSpec:
        a = self.algorithms.get(coll)
        if a is None or a == spec.algo:
            return spec
        # NVLS, NVLS_TREE, CollNet and PAT run the SIMPLE protocol only
        return dataclasses.replace(spec, algo=a, proto=spec.proto if a in ("RING", "TREE") else "SIMPLE")

    def _sym(self, ops: list[Op]) -> tuple[str, int] | None:
        o0 = ops[0]
        if o0.op not in self.symmetric:
            return None
        return symmetric_kernel(o0.op, o0.dtype, o0.redop, max(o.count for o in ops), sum(o.nbytes for o in ops),
                                o0.comm.size, self.link.nnodes(o0.comm), len(ops), self.arch, self.nvls)  # fmt: skip

    def tuning(self, o: Op, spec: KernelSpec) -> KernelSpec | _SymTuning:
        """What rank 0's TUNING line for the call says (SendRecv-named builds: unchanged)."""
        if o.op in self.sendrecv:
            return spec
        sym = self._sym([o])
        if sym is not None:
            return _SymTuning(*sym)
        return self._algo(o.op, spec)

    def kernel(self, ops: list[Op], family: str, spec: KernelSpec) -> tuple[str, str, KernelSpec, str]:
        """(name, short name, kernel spec, rule) of the kernel of a plan. Rules: ``sendrecv``,
        ``symmetric`` (spec algo = the symmetric kernel, blocks and 512 threads from NCCL's model),
        ``algorithm`` (an algorithm override changed algo/proto), ``default``."""
        o0 = ops[0]
        if family in self.sendrecv:
            name, short = nccl_kernel_name(self.version, "SendRecv", o0.dtype, o0.redop, "RING")
            return name, short, spec, "sendrecv"
        if family in self.symmetric:
            sym = self._sym(ops)
            if sym is not None:
                kid, blocks = sym
                name, short = symmetric_kernel_name(self.version, kid, o0.dtype)
                proto = "LL" if kid in _SYM_LL else "SIMPLE"
                return name, short, dataclasses.replace(spec, algo=kid, proto=proto, nchannels=blocks,
                                                        nthreads=512), "symmetric"  # fmt: skip
        spec2 = self._algo(family, spec)
        name, short = nccl_kernel_name(self.version, family, o0.dtype, o0.redop, spec2.algo)
        return name, short, spec2, "default" if spec2 is spec else "algorithm"


_COMPUTE_KERNELS = [
    ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn", "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>, "
     "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::Half>, at::detail::Array<char*, 3>)",
     "vectorized_elementwise_kernel"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_32x6_tn_align8>"
     "(cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_32x6_tn_align8::Params)",
     "cutlass::Kernel2"),
]  # fmt: skip

DT_F32 = 7
# Entries a per-process cache (_Process: call signatures, kernels, payloads, TUNING lines) holds at
# most: counts of MoE all-to-alls change every microbatch, so signatures need not repeat.
_CACHE_MAX = 20_000


def _cache_put(cache: dict, key: Any, value: Any) -> Any:
    """``cache[key] = value`` (emptying a full cache first); returns value."""
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = value
    return value

# opCount rendered into a call line to cut it into the text before and after it (_call_info)
_OPCOUNT_MARK = 0x5A17C0DE9E3779B9
_OPCOUNT_MARK_HEX = f"{_OPCOUNT_MARK:x}"
_REDOP_NAME = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
_BUS_IDS = [0x07000, 0x0B000, 0x48000, 0x4C000, 0x88000, 0x8B000, 0xC8000, 0xCB000]


def _bus_id(local: int) -> int:
    return _BUS_IDS[local] if local < len(_BUS_IDS) else 0x100000 + 0x1000 * local


# --------------------------------------------------------------------------- result


@dataclass
class EmulationResult:
    """What :func:`emulate_run` wrote and a few totals."""

    out_dir: Path
    run_id: str
    config: EmulatorConfig
    log_files: list[Path] = field(default_factory=list)
    nsys_files: list[Path] = field(default_factory=list)
    ground_truth: dict[str, Path] = field(default_factory=dict)
    run_yaml: Path | None = None
    stdout_log: Path | None = None
    n_ranks: int = 0
    n_ops: int = 0
    n_call_lines: int = 0
    n_kernels: int = 0
    duration_ns: int = 0
    op_counts: dict[str, int] = field(default_factory=dict)
    kernel_counts: dict[str, int] = field(default_factory=dict)


def _capture_ids(node: int) -> tuple[int, int]:
    """HW and VM bytes of a node's globalPid/globalTid values. They differ between captures (the
    real 2022.4 sample has VM 1); from node 1 on the HW byte is >= 0x80, so the stored ids are
    negative int64 and readers must decode them with masks, as on real exports."""
    return (0x7F + node) & 0xFF, 1


# --------------------------------------------------------------------------- clocks


class _NodeClock:
    """A node's clock: ``local(t) = t + offset + drift_ppm * 1e-6 * t`` (t = true job time, ns)."""

    def __init__(self, node: int, offset_ns: int, drift_ppm: float, session_true_ns: int,
                 session_clock_ns: int = 0) -> None:  # fmt: skip
        self.node = node
        self.offset_ns = offset_ns
        self.drift_ppm = drift_ppm
        self.session_true_ns = session_true_ns
        self._k = drift_ppm * 1e-6
        self.session_local = self.local(session_true_ns)
        # the host's monotonic clock at the session's start: nsys >= 2025 stores times on that
        # clock (0: the export's times are session-relative, as older nsys stores them)
        self.session_clock_ns = int(session_clock_ns)

    def local(self, t: int) -> int:
        """Node-local clock reading at true job time t (both ns)."""
        return int(t + self.offset_ns + round(self._k * t))

    def nsys(self, t: int) -> int:
        """nsys timeline value of true time t: ns since the node's session start, plus the
        host's monotonic clock at that start where the export stores times on it."""
        return int(t + self.offset_ns + round(self._k * t)) - self.session_local + self.session_clock_ns

    def local_many(self, ts: Any) -> np.ndarray:
        """:meth:`local` of a sequence of true times (int64 array; same values: float64 holds
        these products exactly as Python does, and ``rint`` rounds half to even like ``round``)."""
        a = np.asarray(ts, dtype=np.int64)
        if self._k == 0.0:
            return a + self.offset_ns
        return a + self.offset_ns + np.rint(self._k * a).astype(np.int64)

    def nsys_many(self, ts: Any) -> np.ndarray:
        """:meth:`nsys` of a sequence of true times (None stays None: an object array then)."""
        if not isinstance(ts, np.ndarray) and None in ts:
            return np.array([None if t is None else self.nsys(t) for t in ts], dtype=object)
        return self.local_many(ts) - self.session_local + self.session_clock_ns

    def wall_many(self, ts: Any, start_utc: int) -> np.ndarray:
        """UTC wall clock (``start_utc + local``) of a sequence of true times."""
        return self.local_many(ts) + start_utc


def _clocks(cfg: EmulatorConfig, anchors: dict[int, int] | None = None) -> list[_NodeClock]:
    """Per-node clocks. ``anchors``: true session start of nodes whose nsys session starts at a
    capture window (default: nsys starts 1.5-1.9 s before the job)."""
    imp = cfg.imperfections
    out = []
    for n in range(cfg.nodes):
        off = int(round((2 * u01(cfg.seed, n, 0xC10C) - 1) * imp.clock_offset_ns_max))
        drift = (2 * u01(cfg.seed, n, 0xD41F) - 1) * imp.clock_drift_ppm_max
        sess = -(1_500_000_000 + int(400_000_000 * u01(cfg.seed, n, 0x5E55)))
        if anchors and n in anchors:
            sess = anchors[n]
        # nsys >= 2025 (schema with systemClockNs) stores times on the host's monotonic clock:
        # every node booted at its own time, 1 to 60 days before the session
        uptime = 0
        if session_clock_recorded(cfg.nsys_schema):
            uptime = 86_400_000_000_000 + int(59 * 86_400_000_000_000 * u01(cfg.seed, n, 0xB007))
        out.append(_NodeClock(n, off, float(drift), sess, uptime))
    return out


def session_clock_recorded(schema_version: str) -> bool:
    """Whether exports of this schema record the session's start on the host's monotonic clock
    (``systemClockNs``), and so store times on that clock (nsys >= 2025)."""
    from nccltrace.nsys.writer import _cached_ddl

    return "systemClockNs" in _cached_ddl(schema_version).creates["TARGET_INFO_SESSION_START_TIME"]


def _capture_anchors(cfg: EmulatorConfig, cap: CaptureWindow, layout: MegatronLayout,
                     skel: Skeleton) -> dict[int, int]:  # fmt: skip
    """True time at which each node's nsys collection starts: its first profiled rank's window.

    Measured with nsys 2022.4 (docs/emulator.md §3.1): a capture-range export's timeline zero and
    TARGET_INFO_SESSION_START_TIME are the start of collection, not the start of nsys; metadata
    kept from before it has negative timestamps. The bound comes from the timing skeleton, so it
    is known before any row is written (one pass)."""
    out: dict[int, int] = {}
    for r in cap.profiled_ranks(cfg.world_size):
        node = r // cfg.gpus_per_node
        t = skel.window_start_ns(layout.pp_rank(r), cap.first - 1) - 1_000  # collection starts just before
        out[node] = min(out.get(node, t), t)
    return out


# --------------------------------------------------------------------------- timed text file


class _TimedFile:
    """A text file that also records, per physical line, the true time it was written.

    Without recording, written texts are collected and written out in chunks (:meth:`drain`,
    called by the process now and then, and :meth:`close`): one file write per line was a
    noticeable share of the emulator's time."""

    def __init__(self, path: Path, record: bool) -> None:
        self.fh: TextIO = open(path, "w", encoding="utf-8", newline="\n", buffering=1 << 20)
        self.now = 0
        self.times = array("q") if record else None
        self.parts: list[str] = []
        if not record:
            self.write = self.parts.append  # type: ignore[method-assign,assignment]

    def write(self, s: str) -> int:
        if self.times is not None:
            for _ in range(s.count("\n")):
                self.times.append(self.now)
        return self.fh.write(s)

    def drain(self) -> None:
        if self.parts:
            self.fh.write("".join(self.parts))
            self.parts.clear()

    def close(self) -> None:
        self.drain()
        self.fh.close()


# --------------------------------------------------------------------------- per-process emission


@dataclass(slots=True)
class _CommState:
    comm: Group | PairComm
    ptr: int
    stream_ptr: int
    stream_id: int
    comm_hash: int
    rank_in_comm: int
    op_count: int = 0
    # facts of ``comm`` read for every call (its properties are computed on each access)
    uid: int = 0
    size: int = 0
    kind: str = ""
    index: int = 0
    stream_kind: str = ""


# Layer-pass phases whose calls CUDA graphs capture (MoE dispatch/combine, embedding, output
# layer and recompute stay eager).
_GRAPH_PHASES = ("attention", "mlp", "cp-ring")


@dataclass
class _Graph:
    """One captured CUDA graph of a process (a Megatron runner's forward or backward pass)."""

    gid: int
    key: tuple
    units: list[Unit]  # the units of its captured pass
    nodes: list[list[int]] = field(default_factory=list)  # per unit: node id of each NCCL kernel
    compute_nodes: list[int] = field(default_factory=list)  # per unit: node id of the compute kernel before it
    seqs: list[list[int]] = field(default_factory=list)  # per unit: seq of each kernel's first captured call
    lines: dict[int, int | None] = field(default_factory=dict)  # captured call seq -> its log line
    replays: int = 0
    pass_id: int | None = None
    pos: int = 0
    corr: int = 0  # correlation id of the current replay's cudaGraphLaunch


def _unit_signature(u: Unit) -> tuple:
    return (u.grouped, tuple((o.op, o.comm.uid, o.count, o.dtype, o.redop, o.root, o.peer) for o in u.ops))


class _Context:
    """Run-wide state shared by all processes."""

    def __init__(self, cfg: EmulatorConfig, out_dir: Path) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.layout = layout_of(cfg)
        self.link = LinkModel(cfg, self.layout)
        self.tparams = TimingParams()
        self.skel = Skeleton(cfg, self.layout, self.link, self.tparams)
        self.nccl = cfg.nccl
        self.capture = cfg.capture_window
        self.exported_nodes = (set(range(cfg.nodes)) if self.capture is None
                               else set(self.capture.profiled_nodes(cfg.world_size, cfg.gpus_per_node)))
        anchors = None if self.capture is None else _capture_anchors(cfg, self.capture, self.layout, self.skel)
        self.clocks = _clocks(cfg, anchors)
        self.hosts = list(cfg.host_names) if cfg.host_names else [f"node{n:03d}" for n in range(cfg.nodes)]
        self.pids = {}
        for r in range(cfg.world_size):
            n, lr = divmod(r, cfg.gpus_per_node)
            self.pids[r] = 3000 + int(hash_ints(cfg.seed, n, 0x9D) % 200_000) + 13 * lr
        self.imp = cfg.imperfections
        self.dup_ranks = set(self.imp.duplicate_log_lines.ranks) if self.imp.duplicate_log_lines.active else set()
        self.kernel_params = "(ncclDevComm*" if self.nccl.tuple < (2, 22, 0) else "(ncclDevKernelArgs"
        # How NCCL launches its kernels (src/enqueue.cc): from CUDA 11.8, 2.18.3-2.21 call the
        # runtime's cudaLaunchKernelExC and >= 2.22.3 the driver's cuLaunchKernelEx; older CUDA
        # gets cudaLaunchKernel / cuLaunchKernel. nsys names runtime calls with a _vNNNNN suffix.
        cuda = tuple(int(x) for x in str(cfg.cuda_version).split(".")[:2])
        driver = self.nccl.tuple >= (2, 22, 0)
        if cuda >= (11, 8):
            self.launch_api = ("cuLaunchKernelEx", 1) if driver else ("cudaLaunchKernelExC_v11060", 0)
        else:
            self.launch_api = ("cuLaunchKernel", 1) if driver else ("cudaLaunchKernel_v7000", 0)
        self.opcount_needs_proxy = self.nccl.tuple >= (2, 27, 3)
        # real-build options (None when off: the code paths of a plain run are unchanged)
        self.namer = _KernelNamer(cfg, self.link) if cfg.kernel_naming.active else None
        self.graphs = cfg.cuda_graphs if cfg.cuda_graphs.active else None
        self.payloads = cfg.nvtx_payloads != "none" and self.nccl.tuple >= (2, 16, 2)
        self.new_payloads = self.nccl.tuple >= (2, 25, 0)
        hw = cfg.hw
        self.topo = TopoSystem(
            gpus=[TopoGpu(_bus_id(i), i, i, cpu=i * hw.cpus // cfg.gpus_per_node) for i in range(cfg.gpus_per_node)],
            nvlink_bw=hw.nvlink_bw, nvswitch=hw.nvswitch, pci_bw=hw.pci_bw, sys_bw=hw.sys_bw, cpus=hw.cpus,
            nics=[TopoNic(0x1C000 + 0x40000 * j, j, hw.net_bw, guid=0x1070FD03000A0000 + j, cpu=j * hw.cpus // hw.nics)
                  for j in range(hw.nics)],
        )  # fmt: skip

        self._kernel_names: dict[tuple, tuple[str, str]] = {}
        self.nvtx_text = {op: f"nccl{op}" for op in ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce",
                                                     "Send", "Recv", "AlltoAll")}  # fmt: skip

    def kernel_name(self, family: str, dtype: int, redop: int, algo: str) -> tuple[str, str]:
        """:func:`nccl_kernel_name` of this run's NCCL version (memoised)."""
        key = (family, dtype, redop, algo)
        hit = self._kernel_names.get(key)
        if hit is None:
            hit = self._kernel_names[key] = nccl_kernel_name(self.nccl, family, dtype, redop, algo)
        return hit

    def comm_hash(self, comm) -> int:
        return hash_ints(self.cfg.seed, comm.uid, 0xC0) | 1

    def printed_comm_id(self, comm) -> int:
        """commId of plain init lines: commHash from 2.26.2, a separate hash of the unique id before."""
        if self.nccl.tuple >= (2, 26, 2):
            return self.comm_hash(comm)
        return hash_ints(self.cfg.seed, comm.uid, 0x1D) | 1


class _Process:
    """Emit everything one rank leaves: its log file, its share of the node's nsys export and
    its ground-truth rows."""

    def __init__(self, ctx: _Context, rank: int, nsys: NsysExportWriter, sinks: dict[str, _Sink],
                 record_line_times: bool) -> None:  # fmt: skip
        cfg = ctx.cfg
        self.ctx = ctx
        self.cfg = cfg
        self.rank = rank
        self.node, self.local = divmod(rank, cfg.gpus_per_node)
        self.host = ctx.hosts[self.node]
        self.pid = ctx.pids[rank]
        self.tid = self.pid
        self.clock = ctx.clocks[self.node]
        self.nsys = nsys
        self.sinks = sinks
        self.gpid = encode_global_pid(self.pid, *_capture_ids(self.node))
        self.log_name = f"nccl_{self.host}_{self.pid}.log"
        self.log_path = ctx.out_dir / "nccl" / self.log_name
        self.tmp_path = atomic_path(self.log_path)
        self.fh = _TimedFile(self.tmp_path, record_line_times)
        self.w = NcclLogWriter(self.fh, nccl_version=cfg.nccl_version, host=self.host, pid=self.pid,
                               cuda_version=cfg.cuda_version, timestamps=cfg.nccl_timestamps, cuda_dev=self.local)  # fmt: skip
        self.rng = np.random.default_rng(hash_ints(cfg.seed, rank, 0x57))
        self.ptr_base = 0x550000000000 + (int(self.rng.integers(0x100000, 0xFFFFFF)) << 16)
        self.stream_base = self.ptr_base + 0x4000000
        self.comms: dict[int, _CommState] = {}
        self.version_done = False
        self._tuning_buf: list = []  # (op, link spec) of the current plan, printed at launch
        self.corr = 0
        self.domain_id: int | None = None
        # nsys rows waiting for flush(), as tuples with true times (converted to the node's nsys
        # timeline a batch at a time): see _launch, _compute_kernel/_emit_kernel, _nvtx
        self.kernel_rows: list[tuple] = []
        self.runtime_rows: list[tuple] = []
        self.nvtx_rows: list[tuple] = []
        self.log_file = f"nccl/{self.log_name}"
        self._stamped = self.w.timestamps  # the log writer prints wall clocks only with timestamps
        self._bufs: dict[tuple[int, int], int] = {}  # (count, len(phase)) -> logged buffer address
        self._call_infos: dict[tuple, tuple] = {}  # call signature -> _call_info
        self._dup = rank in ctx.dup_ranks
        self._tuning_lines: dict[tuple, tuple[str, int]] = {}  # TUNING arguments -> rendered line
        self._topologies: dict[tuple, tuple[str, int]] = {}  # trimmed topology -> rendered dump
        self._payloads: dict[tuple, dict] = {}
        self.stream_last_end: dict[int, int] = {}
        self.compute_i = 0
        self.n_ops = 0
        self.n_call_lines = 0
        self.n_kernels = 0
        self.op_counts: dict[str, int] = {}
        self.kernel_counts: dict[str, int] = {}
        self.split_count = 0
        self.world_ptr = 0
        self._prev_gpu_end = 0
        self._prev_cpu = 0
        # Capture window: rows are written only while ``capturing`` (always without a window).
        # Only profiled ranks ever capture; a rank that never calls cudaProfilerStart leaves no
        # events or NVTX metadata, only its process and thread names (measured, docs §3.1).
        cap = ctx.capture
        self.cap = cap
        self.profiled = cap is None or cap.profiles(rank)
        self.capturing = cap is None
        # pre_window_metadata 'dropped': what was registered before the window is unknown to
        # nsys: the domain's name row, the payload schemas (so no payloads decode), and the
        # registered strings (ranges using them lose their text).
        self.drop_meta = cap is not None and self.profiled and cap.pre_window_metadata == "dropped"
        self.meta_lost = False
        self._strings_seen: set[str] = set()
        self._strings_lost: set[str] = set()
        # CUDA graphs (cuda_graphs): graph (layer, runner, direction) -> captured graph; ids are per process
        self.graphs: dict[tuple, _Graph] = {}
        self.graphs_captured = False
        self.next_graph_id = 1
        self.next_node_id = 1
        # extra ground-truth columns of this run's schemas (capture window, CUDA graphs, naming)
        self._ops_graph_ext = (False, None, None, None) if ctx.graphs is not None else ()
        self._kernels_ext = ctx.capture is not None or ctx.graphs is not None or ctx.namer is not None
        # units of one call with one kernel take the inlined path (_unit_one) unless a feature
        # with its own steps is on
        self._plain = ctx.graphs is None and not ctx.imp.kernels_without_log and not self.drop_meta
        self._split_init = cfg.init_style == "split"
        self._launch_name, self._launch_class = ctx.launch_api
        self._ops_pending = sinks["ops"].pending
        self._kernels_pending = sinks["kernels"].pending
        self._kernel_info: dict[tuple, tuple] = {}  # (op, bytes, dtype, redop, comm, peer) -> _kernel_of

    # ---------------------------------------------------------------- helpers
    def wall(self, t: int) -> int:
        return self.cfg.start_time_utc_ns + self.clock.local(t)

    def ts(self, t: int) -> int:
        return self.clock.nsys(t)

    def _at(self, t: int) -> int | None:
        """Make ``t`` the time of the next log lines; their wall clock if the log prints one."""
        self.fh.now = t
        return self.wall(t) if self._stamped else None

    def _nvtx(self, start: int, end: int | None, text: str, *, domain: int = 0, payload: dict | None = None,
              registered: bool = True) -> None:  # fmt: skip
        if self.drop_meta and registered and text not in self._strings_seen:
            # NCCL registers each function's name at its first call (nvtx3 registered_string)
            self._strings_seen.add(text)
            if not self.capturing:
                self._strings_lost.add(text)
        if not self.capturing:
            return
        if self.drop_meta:
            if registered and text in self._strings_lost:
                text, registered = None, False  # type: ignore[assignment]
            if self.meta_lost and domain:
                payload = None
        self.nvtx_rows.append((start, end, text, registered, domain, payload if self.ctx.payloads else None))

    def _ensure_domain(self, t: int) -> int:
        if self.domain_id is None:
            # Created before the window: kept by nsys (default, measured) unless the emulator is
            # told 'dropped'; never for a rank that does not profile.
            record = self.capturing or (self.profiled and not self.drop_meta)
            self.meta_lost = not record
            self.domain_id = self.nsys.add_nvtx_domain(self.pid, self.tid, "NCCL", self.ts(t), record=record)
            if self.ctx.payloads and record:
                self.nsys.add_nccl_payload_schemas(self.pid, self.domain_id, self.ctx.nccl.tuple)
        return self.domain_id

    def _version(self, t: int, as_rank0: bool) -> None:
        if self.version_done:
            return
        if self.ctx.nccl.info_version_line or as_rank0:
            self.w.version(self.tid, wall_ns=self._at(t))
            self.version_done = True

    def _new_comm_state(self, comm) -> _CommState:
        k = len(self.comms)
        ptr = self.ptr_base + k * 0x1A6800 + 0x40 * int(self.rng.integers(0, 64))
        stream_ptr = self.stream_base + k * 0x2A0
        kind = comm.kind
        st = _CommState(comm, ptr, stream_ptr, 13 + k, self.ctx.comm_hash(comm), comm.rank_of(self.rank), 0,
                        comm.uid, comm.size, kind, comm.index,
                        _STREAM_KIND.get(kind, "p2p" if kind.startswith("p2p:") else "misc-comm"))  # fmt: skip
        self.comms[comm.uid] = st
        return st

    def _payload_init(self, st: _CommState) -> dict:
        comm = st.comm
        p = {"Rank": st.rank_in_comm, "No. of ranks": comm.size, "CUDA device": self.local}
        if self.ctx.new_payloads:
            p["NCCL communicator ID"] = st.comm_hash
        return p

    def _init_lines(self, st: _CommState, t0: int, t1: int, *, split: bool) -> int:
        """Init START ... COMPLETE of one communicator between true times t0 and t1."""
        ctx, w, comm = self.ctx, self.w, st.comm
        # <= 2.21 only ncclCommInitRank* shows the version (as rank 0); ncclCommSplit never does.
        self._version(t0, st.rank_in_comm == 0 and not split)
        dom = self._ensure_domain(t0)
        common = dict(comm=st.ptr, rank=st.rank_in_comm, nranks=comm.size, cuda_dev=self.local, nvml_dev=self.local,
                      bus_id=_bus_id(self.local))  # fmt: skip
        color = key = None
        comm_id_logged: int | None
        if split:
            # NCCL counts every ncclCommSplit on the parent, and PyTorch's new_group makes every
            # rank call it (NOCOLOR for non-members): all members print the group's creation index.
            self.split_count = comm.order if hasattr(comm, "order") else self.split_count + 1
            color = int(hash_ints(*comm.ranks) & 0x7FFFFFFF)
            key = st.rank_in_comm  # PyTorch passes the rank within the new group as the split key
            comm_id_logged = (hash_ints(self.ctx.comm_hash(self.layout_world), color) | 1
                              if ctx.nccl.init_style in ("literal_api", "base", "complete_only_no_nvml") else None)  # fmt: skip
            w.split(self.tid, parent=self.world_ptr, color=color, key=key, split_count=self.split_count,
                    comm_id=comm_id_logged or 0, phase="START", wall_ns=self._at(t0), **common)  # fmt: skip
            api = "ncclCommSplit"
        else:
            comm_id_logged = ctx.printed_comm_id(comm)
            api = "ncclCommInitRankConfig"
            w.init(self.tid, comm_id=comm_id_logged, api=api, phase="START", wall_ns=self._at(t0), **common)
        tm = t0 + (t1 - t0) // 2
        members_here = [r for r in comm.ranks if r // self.cfg.gpus_per_node == self.node]
        # NCCL dumps the topology in every communicator's init, after trimming it to the GPUs of
        # that communicator on this node; a GPU's number in parentheses is its rank in the comm.
        gpn, topo = self.cfg.gpus_per_node, ctx.topo
        trimmed = TopoSystem(
            gpus=[TopoGpu(_bus_id(r % gpn), comm.rank_of(r), r % gpn, cpu=topo.gpus[r % gpn].cpu)
                  for r in members_here],
            nvlink_bw=topo.nvlink_bw, nvswitch=topo.nvswitch, pci_bw=topo.pci_bw, sys_bw=topo.sys_bw,
            cpus=topo.cpus, nics=topo.nics,
        )  # fmt: skip
        wall = self._at(t0 + (tm - t0) // 2)
        if self._stamped:
            w.topology(self.tid, trimmed, wall_ns=wall)
        else:  # the same dump for the same GPUs (and their ranks in the communicator): rendered once
            tkey = tuple((g.bus_id, g.rank, g.nvml_dev, g.cpu) for g in trimmed.gpus)
            hit = self._topologies.get(tkey)
            if hit is None:
                hit = _cache_put(self._topologies, tkey, self._render(w.topology, self.tid, trimmed))
            self._write_rendered(*hit)
        w.comm_info(self.tid, comm=st.ptr, rank=st.rank_in_comm, nranks=comm.size,
                    nnodes=ctx.layout.nodes_of(comm.ranks), local_ranks=len(members_here),
                    local_rank=members_here.index(self.rank), wall_ns=self._at(tm))  # fmt: skip
        if st.rank_in_comm == 0 and comm.size > 1:
            nch = 2
            for ch in range(nch):
                w.ring(self.tid, ch, nch, list(range(comm.size)), wall_ns=self._at(tm + 1000 * (ch + 1)))
        if split:
            w.split(self.tid, parent=self.world_ptr, color=color, key=key, split_count=self.split_count,
                    comm_id=comm_id_logged or 0, phase="COMPLETE", wall_ns=self._at(t1), **common)  # fmt: skip
        else:
            w.init(self.tid, comm_id=comm_id_logged, api=api, phase="COMPLETE", wall_ns=self._at(t1), **common)
        init_line = self.w.lines_written
        # NVTX range of the init API call
        if split:
            payload = None
            if ctx.nccl.tuple >= (2, 23, 0):
                if ctx.new_payloads:
                    payload = {"NCCL communicator ID": st.comm_hash,
                               "Parent NCCL communicator ID": self.ctx.comm_hash(self.layout_world),
                               "No. of ranks": comm.size, "Rank": st.rank_in_comm, "CUDA device": self.local,
                               "Color": color, "Key": key}  # fmt: skip
                else:
                    payload = {"Rank": st.rank_in_comm, "No. of ranks": comm.size, "CUDA device": self.local,
                               "color": color, "key": key}  # fmt: skip
            self._nvtx(t0, t1, "ncclCommSplit", domain=dom, payload=payload)
        else:
            # NCCL attaches the InitRank schema to ncclCommInitRankConfig only from 2.23.4
            # (a plain function range before); splits carry their own schema from 2.23.4.
            payload = self._payload_init(st) if ctx.nccl.tuple >= (2, 23, 4) or api == "ncclCommInitRank" else None
            self._nvtx(t0, t1, api, domain=dom, payload=payload)
        self.sinks["communicators"].add((
            self.rank, self.host, self.pid, st.ptr, comm.uid, comm.kind, comm.index, comm.size, st.rank_in_comm,
            list(comm.ranks), st.comm_hash, comm_id_logged, api, self.world_ptr if split else None, color, key,
            self.split_count if split else None, init_line, st.stream_ptr, st.stream_id, t1,
        ))  # fmt: skip
        return init_line

    # ---------------------------------------------------------------- main loop
    def run(self) -> None:
        """Emit this rank; on failure the partial log file is removed."""
        try:
            self._run()
        except BaseException:
            self.fh.close()
            self.tmp_path.unlink(missing_ok=True)
            raise

    def _run(self) -> None:
        ctx, cfg = self.ctx, self.cfg
        self.layout_world = ctx.layout.by_kind["world"][0]
        self.nsys.add_process(self.pid, "python3")
        self.nsys.add_thread(self.pid, self.tid, "python3")
        hw = cfg.hw
        uuid = f"GPU-{hash_ints(cfg.seed, self.rank, 0x6) & ((1 << 64) - 1):016x}-{self.node:04x}-{self.local:04x}"
        self.nsys.add_gpu(self.local, name=hw.gpu_name, bus_location=f"0000:{(_bus_id(self.local) >> 12):02x}:00.0",
                          uuid=uuid, pid=self.pid, cuda_id=self.local)  # fmt: skip
        timer = RankTimer(ctx.skel, self.rank)
        prog = RankProgram(cfg, ctx.layout, self.rank)
        it_start: dict[int, int] = {}
        it_end: dict[int, int] = {}
        last_units = 0
        cap = self.cap
        times, unit = timer.times, self._unit
        nvtx_rows, kernel_rows = self.nvtx_rows, self.kernel_rows
        it = None
        for u in prog.units():
            if u.iteration != it:  # the first unit of an iteration (units come in iteration order)
                it = u.iteration
                if cap is not None:
                    self.capturing = self.profiled and cap.contains_iteration(it)
                tm = times(u)
                if it not in it_start:
                    it_start[it] = tm.init_start if u.new_comms else tm.group_start
            else:
                tm = times(u)
            it_end[it] = tm.call_end
            unit(u, tm)
            last_units = u.index + 1
            if len(nvtx_rows) + len(kernel_rows) > 200_000:
                self.flush()
                nvtx_rows, kernel_rows = self.nvtx_rows, self.kernel_rows
            if not u.index & 1023:  # bound the buffered log text and ground-truth rows
                self.fh.drain()
                self.sinks["ops"].flush_full()
                self.sinks["kernels"].flush_full()
        if last_units != ctx.skel.n_units[ctx.layout.pp_rank(self.rank)]:
            raise RuntimeError(f"rank {self.rank}: {last_units} units, its stage has {ctx.skel.n_units}")
        for key, g in self.graphs.items():
            if g.pos != len(g.units):
                raise RuntimeError(f"rank {self.rank}: CUDA graph {key} ended after {g.pos}/{len(g.units)} units")
        for it in range(cfg.iterations):
            if cap is not None:
                self.capturing = self.profiled and cap.contains_iteration(it)
            if it in it_start:
                self._nvtx(it_start[it], it_end[it], f"iteration {it + 1}", domain=0, registered=False)
        self.flush()
        self.fh.close()
        _publish(self.tmp_path, self.log_path)

    def flush(self) -> None:
        """Write the buffered nsys rows (column-wise; times converted to the node's timeline)."""
        nsys_ts = self.clock.nsys_many
        if self.runtime_rows:
            start, end, corr, name, event_class = zip(*self.runtime_rows)
            self.nsys.add_runtime({"start": nsys_ts(start), "end": nsys_ts(end), "pid": self.pid, "tid": self.tid,
                                   "correlation_id": corr, "name": name, "event_class": event_class,
                                   "return_value": 0})  # fmt: skip
            self.runtime_rows = []
        if self.kernel_rows:
            c = list(zip(*self.kernel_rows))
            cols = {
                "start": nsys_ts(c[0]), "end": nsys_ts(c[1]), "device_id": self.local, "context_id": 1,
                "stream_id": c[2], "correlation_id": c[3], "pid": self.pid, "name": c[4], "short_name": c[5],
                "grid_x": c[6], "grid_y": 1, "grid_z": 1, "block_x": c[7], "block_y": 1, "block_z": 1,
                "registers_per_thread": c[8], "static_shared_memory": 0, "dynamic_shared_memory": c[9],
            }  # fmt: skip
            if c[10].count(None) != len(c[10]):  # graph kernels in the batch
                cols["graph_id"], cols["graph_node_id"] = c[10], c[11]
            self.nsys.add_kernels(cols)
            self.kernel_rows = []
        if self.nvtx_rows:
            start, end, text, registered, domain, payload = zip(*self.nvtx_rows)
            cols = {"start": nsys_ts(start), "end": nsys_ts(end), "pid": self.pid, "tid": self.tid, "text": text,
                    "registered": registered, "domain_id": domain, "event_type": 59}  # fmt: skip
            if payload.count(None) != len(payload):
                cols["nccl_payload"] = payload
            self.nsys.add_nvtx_ranges(cols)
            self.nvtx_rows = []

    def _launch(self, t0: int, t1: int, name: str, event_class: int) -> int:
        # Correlation ids count every launch, captured or not, so that a capture changes no id
        # (and no imperfection draw keyed by it) relative to the whole run.
        self.corr += 1
        if self.capturing:
            self.runtime_rows.append((t0, t1, self.corr, name, event_class))
        return self.corr

    def _compute_kernel(self, start: int, end: int, cpu_free: int, cpu_busy: int,
                        graph: tuple[int, int, int] | None = None) -> None:  # fmt: skip
        """A compute kernel on the default stream, launched (cudaLaunchKernel) by the main thread
        while it is idle between ``cpu_free`` and ``cpu_busy``. With ``graph`` = (correlation id of
        the graph launch, graph id, node id) it is a node of a replayed CUDA graph: no launch call."""
        if not self.cfg.compute_kernels or end - start < 5_000:
            return
        if graph is None:
            t_launch = max(cpu_free + 200, min(start - 6_000, cpu_busy - 3_500))
            if t_launch + 3_000 > cpu_busy or t_launch + 3_000 > start:
                return
        name, short = _COMPUTE_KERNELS[self.compute_i % len(_COMPUTE_KERNELS)]
        self.compute_i += 1
        if graph is None:
            corr = self._launch(t_launch, t_launch + 3_000, "cudaLaunchKernel_v7000", 0)
        else:
            corr = graph[0]
        if not self.capturing:
            return
        # (start, end, stream, correlation id, name, short name, grid x, block x, registers,
        # dynamic shared memory, graph id, graph node id): see flush()
        self.kernel_rows.append((start, end, 7, corr, name, short, 216, 256, 128, 49152,
                                 None if graph is None else graph[1], None if graph is None else graph[2]))  # fmt: skip

    # ---------------------------------------------------------------- CUDA graphs
    def _kernel_groups(self, u: Unit) -> list[list[Op]]:
        """The ops of each kernel the unit launches: one per unit (fused) or per multi-rank op."""
        return self._kernel_groups_of(u.multi)

    def _kernel_groups_of(self, multi: list[Op]) -> list[list[Op]]:
        if not multi:
            return []
        if self.ctx.imp.fuse_grouped_p2p or len(multi) == 1:
            return [multi]
        return [[o] for o in multi]

    def _graph_key(self, u: Unit) -> tuple | None:
        """(layer, runner, direction) of the CUDA graph that runs this unit, or None when it runs
        eagerly: before the graphs exist, outside a layer's forward/backward pass, MoE
        dispatch/combine, or on a communicator kind not in ``cuda_graphs.parallelism``."""
        cg = self.ctx.graphs
        if cg is None or u.iteration < cg.warmup_iterations:
            return None
        if cg.phases and u.phase in cg.phases:  # a graph of one phase's calls (cuda_graphs.phases)
            return ("phase", u.phase) if all(o.comm.size >= 2 for o in u.ops) else None
        if u.graph_scope is None or u.phase.rsplit("/", 1)[-1] not in _GRAPH_PHASES:
            return None
        kinds = cg.parallelism
        for o in u.ops:
            kind = o.comm.kind[4:] if o.comm.kind.startswith("p2p:") else o.comm.kind
            if o.comm.size < 2 or kind not in kinds:
                return None
        return u.graph_scope[:3]

    @staticmethod
    def _graph_pass(u: Unit, key: tuple) -> int:
        """The pass of ``u``'s graph it belongs to (one replay per pass): the layer runner's pass,
        or for a graph of a phase (``cuda_graphs.phases``) the iteration."""
        return u.iteration if key[0] == "phase" else u.graph_scope[3]  # type: ignore[index]

    def _plan_graphs(self) -> dict[tuple, list[Unit]]:
        """The units each graph captures: a graph's first pass in the capture iteration (from a
        second, identical generation of this rank's program up to that iteration). Ordered by
        first pass, i.e. the order Megatron records and creates them in."""
        cg = self.ctx.graphs
        assert cg is not None
        plan: dict[tuple, list[Unit]] = {}
        first: dict[tuple, int] = {}
        for pu in RankProgram(self.cfg, self.ctx.layout, self.rank).units():
            if pu.iteration < cg.warmup_iterations:
                continue
            if pu.iteration > cg.warmup_iterations:
                break
            key = self._graph_key(pu)
            if key is not None and first.setdefault(key, self._graph_pass(pu, key)) == self._graph_pass(pu, key):
                plan.setdefault(key, []).append(pu)
        return plan

    def _capture_graphs(self, lo: int, hi: int) -> int:
        """Capture every graph (stream capture of its calls) in one burst ending at ``hi`` (the
        first replay's cudaGraphLaunch), starting no earlier than ``lo`` (compressed to fit).

        Per graph: cudaStreamBeginCapture, the NCCL calls (log lines, NVTX ranges, TUNING lines;
        the launch API call NCCL makes on the capturing stream is traced with no kernel unless
        ``capture_launch_records`` is false), cudaStreamEndCapture, cudaGraphInstantiateWithFlags.
        No kernel runs and no opCount advances (the plans are persistent). Returns the burst start."""
        ctx, tpar = self.ctx, self.ctx.tparams
        cg = ctx.graphs
        assert cg is not None
        plan = self._plan_graphs()
        # nominal durations of the burst's steps, then scaled into [lo, hi]
        steps: list[tuple] = []
        for key, units in plan.items():
            steps.append(("rt", "cudaStreamBeginCapture_v10000", 2_000))
            for j, u in enumerate(units):
                if u.grouped:
                    steps.append(("gs", j, tpar.group_call_ns))
                for i, o in enumerate(u.ops):
                    steps.append(("call", (j, i), tpar.api_call_ns))
                for g in range(len(self._kernel_groups(u))):
                    steps.append(("launch", (j, g), tpar.launch_ns))
                steps.append(("unit_end", (key, j), 0))
            steps.append(("rt", "cudaStreamEndCapture_v10000", 3_000))
            steps.append(("rt", "cudaGraphInstantiateWithFlags_v11040", 40_000))
        total = sum(d for *_, d in steps)
        scale = min(1.0, max(hi - lo, 0) / total) if total else 1.0
        start = hi - int(total * scale)
        t = float(start)
        times = []
        for *_, d in steps:
            a = int(t)
            t += d * scale
            times.append((a, int(t)))
        # emit
        dom = self._ensure_domain(start)
        it = iter(zip(steps, times))
        for key, units in plan.items():
            gid = self.next_graph_id
            self.next_graph_id += 1
            graph = _Graph(gid, key, units)
            self.graphs[key] = graph
            (_, name, _), (a, b) = next(it)
            self._launch(a, b, name, 0)  # cudaStreamBeginCapture
            for j, u in enumerate(units):
                groups = self._kernel_groups(u)
                multi = u.multi
                if j > 0:
                    graph.compute_nodes.append(self._new_node())
                else:
                    graph.compute_nodes.append(0)
                nodes = [self._new_node() for _ in groups]
                graph.nodes.append(nodes)
                graph.seqs.append([ops[0].seq for ops in groups])
                node_of = {o.seq: nodes[g] for g, ops in enumerate(groups) for o in ops}
                group_of = {o.seq: g for g, ops in enumerate(groups) for o in ops}
                rows: list[dict] = []
                call_t: list[tuple[int, int]] = []
                launch_corr: list[int | None] = []
                gs_t = None
                while True:
                    (kind, ref, _), (a, b) = next(it)
                    if kind == "gs":
                        gs_t = (a, b)
                    elif kind == "call":
                        o = u.ops[ref[1]]
                        st = self.comms[o.comm.uid]
                        rows.append(self._call(o, st, a, u))
                        call_t.append((a, b))
                    elif kind == "launch":
                        corr = self._launch(a, b, *ctx.launch_api) if cg.capture_launch_records else None
                        launch_corr.append(corr)
                        call_t.append((a, b))
                    elif kind == "unit_end":
                        break
                unit_end = call_t[-1][1] if call_t else a
                for i, o in enumerate(u.ops):
                    st = self.comms[o.comm.uid]
                    c0, c1 = call_t[i]
                    end = unit_end if not u.grouped else c1
                    self._nvtx(c0, end, ctx.nvtx_text[o.op], domain=dom, payload=self._payload(o, st))
                if u.grouped and gs_t is not None:
                    self._nvtx(gs_t[0], gs_t[1], "ncclGroupStart", domain=dom)
                    self._nvtx(call_t[len(u.ops) - 1][1], unit_end, "ncclGroupEnd", domain=dom)
                self._flush_tuning(self._at(unit_end))
                for o, rec in zip(u.ops, rows):
                    g = group_of.get(o.seq)
                    graph.lines[o.seq] = rec[1]  # log_line
                    ext = ((self.capturing,) if self.cap is not None else ()) + (
                        True, gid, node_of.get(o.seq), launch_corr[g] if g is not None else None)
                    self.sinks["ops"].add(self._ops_row(
                        o, u, rec, None, None, False, g is not None and len(groups) == 1 and len(multi) > 1, ext))
            for _ in range(2):  # cudaStreamEndCapture, cudaGraphInstantiateWithFlags
                (_, name, _), (a, b) = next(it)
                self._launch(a, b, name, 0)
        self.graphs_captured = True
        return start

    def _new_node(self) -> int:
        n = self.next_node_id
        self.next_node_id += 1
        return n

    def _graph_step(self, u: Unit, key: tuple, t_launch: int) -> tuple["_Graph", int]:
        """Advance the graph that runs ``u``: a new pass of its runner starts a replay (one
        cudaGraphLaunch at ``t_launch``). Returns the graph and the unit's position in it."""
        g = self.graphs.get(key)
        if g is None:
            raise RuntimeError(f"rank {self.rank}: CUDA graph {key} replayed but never captured")
        p = self._graph_pass(u, key)
        if g.pass_id != p:
            if g.pass_id is not None and g.pos != len(g.units):
                raise RuntimeError(f"rank {self.rank}: CUDA graph {key} pass ended after {g.pos}/{len(g.units)} units")
            g.pass_id, g.pos = p, 0
            g.replays += 1
            g.corr = self._launch(t_launch, t_launch + self.ctx.tparams.launch_ns, "cudaGraphLaunch_v10000", 0)
        pos = g.pos
        if pos >= len(g.units) or _unit_signature(g.units[pos]) != _unit_signature(u):
            raise RuntimeError(f"rank {self.rank}: unit {u.index} (iteration {u.iteration}, {u.phase}) differs from "
                               f"what CUDA graph {key} captured; its calls are not static")
        g.pos += 1
        return g, pos

    def _unit(self, u: Unit, tm: UnitTimes) -> None:
        """Emit one unit: communicator creation, CUDA-graph capture or replay, the calls (log lines,
        NVTX ranges), the kernels, a compute kernel in the gap before it, opCounts and ground truth.
        The common unit (one call, one kernel, nothing else) takes :meth:`_unit_one`."""
        if self._plain and not u.grouped and not u.new_comms and len(u.ops) == 1 and len(u.multi) == 1 and (
                u.index or not self._split_init):  # fmt: skip
            self._unit_one(u, tm)
            return
        self._unit_comm_init(u, tm)
        graph, gpos, cpu_busy, burst = self._unit_graph(u, tm)
        dom = self.domain_id if self.domain_id is not None else self._ensure_domain(tm.group_start)
        multi = u.multi
        # --- one kernel per unit (fused) or per multi-rank op
        kern_groups = self._kernel_groups_of(multi)
        if multi and self.ctx.imp.kernels_without_log and not burst:
            self._unit_stray_kernel(u, tm)
        # --- calls: log lines and NVTX ranges (a replayed graph makes no calls)
        op_rows = self._unit_calls(u, tm, dom) if graph is None else []
        kern_of_op = self._unit_kernels(u, tm, kern_groups, graph, gpos)
        # --- a compute kernel filling the compute gap before this unit (a graph node inside a replay)
        if multi and u.gap_ns > 10_000 and not burst:  # (during the capture burst the GPU idles)
            ks = tm.kernels[0][0]
            gs = max(self._prev_gpu_end, ks - int(u.gap_ns))
            gnode = (graph.corr, graph.gid, graph.compute_nodes[gpos]) if graph is not None and gpos > 0 else None
            self._compute_kernel(gs + 500, ks - 500, self._prev_cpu, cpu_busy, gnode)
        self._prev_gpu_end = tm.gpu_free
        if graph is None:
            self._prev_cpu = tm.call_end
        elif gpos == 0:
            self._prev_cpu = tm.group_start + self.ctx.tparams.launch_ns
        if multi:
            self._unit_op_counts(multi, graph is not None)
        # --- ground truth
        if op_rows:
            fused = len(kern_groups) == 1 and len(multi) > 1
            ext = self._ops_ext()
            add = self._ops_pending.append  # (complete batches are written by _run)
            gpid = self.gpid
            row = self._ops_row
            for o, rec in zip(u.ops, op_rows):
                k = kern_of_op.get(o.seq)
                if k is not None:
                    add(row(o, u, rec, k[0], gpid, bool(k[1]), fused, ext))
                else:
                    add(row(o, u, rec, None, None, False, False, ext))

    def _unit_comm_init(self, u: Unit, tm: UnitTimes) -> None:
        """Communicator creation: the eager splits before the first unit (``init_style: split``),
        or the communicators this unit creates lazily at first use."""
        cfg, tpar = self.cfg, self.ctx.tparams
        if u.index == 0 and cfg.init_style == "split":
            t = tm.init_start
            wst = self._new_comm_state(self.layout_world)
            self.world_ptr = wst.ptr
            t1 = t + tpar.comm_init_ns + tpar.comm_init_per_log2_ns * int(np.ceil(np.log2(max(cfg.world_size, 1))))
            self._init_lines(wst, t, t1, split=False)
            t = t1
            for g in self.ctx.layout.groups_of(self.rank):
                if g.kind == "world":
                    continue
                st = self._new_comm_state(g)
                self._init_lines(st, t, t + tpar.split_ns, split=True)
                t += tpar.split_ns
        if u.new_comms:
            t = tm.init_start
            for c in u.new_comms:
                if c.uid in self.comms:
                    continue
                st = self._new_comm_state(c)
                dur = tpar.comm_init_ns + tpar.comm_init_per_log2_ns * int(np.ceil(np.log2(max(c.size, 1))))
                if c.kind == "world":
                    self.world_ptr = st.ptr
                self._init_lines(st, t, t + dur, split=False)
                t += dur

    def _unit_graph(self, u: Unit, tm: UnitTimes) -> tuple[_Graph | None, int, int, bool]:
        """CUDA graphs: all are captured at the start of the first replaying iteration (in the
        host time the program reserves there, schedule.T_GRAPH_CAPTURE); a graphed unit is
        replayed. Returns (the graph replaying ``u`` or None, its position in the graph, the time
        the host is next busy, whether the capture burst ran just now)."""
        graph: _Graph | None = None
        gpos = 0
        cpu_busy = tm.init_start if u.new_comms else tm.group_start
        burst = False
        graphs = self.ctx.graphs
        if graphs is not None:
            if not self.graphs_captured and u.iteration >= graphs.warmup_iterations:
                cpu_busy = self._capture_graphs(self._prev_cpu + 1_000, cpu_busy - 1_000)
                burst = True
            gkey = self._graph_key(u)
            if gkey is not None:
                graph, gpos = self._graph_step(u, gkey, tm.group_start)
            if gpos == 0:
                cpu_busy = min(cpu_busy, tm.group_start)
        return graph, gpos, cpu_busy, burst

    def _unit_stray_kernel(self, u: Unit, tm: UnitTimes) -> None:
        """Imperfection: with probability ``kernels_without_log``, an extra NCCL kernel without a
        log line in idle time before this unit (where the stream and the host have room for it)."""
        cfg, ctx = self.cfg, self.ctx
        if u01(cfg.seed, self.rank, u.index, 0xE4) >= ctx.imp.kernels_without_log:
            return
        st0 = self.comms[u.multi[0].comm_uid]
        prev_end = self.stream_last_end.get(st0.stream_id, 0)
        ks = tm.kernels[0][0]
        if ks - prev_end > 30_000 and tm.group_start - self._prev_cpu > 15_000:
            a = ks - 15_000
            b = a + 4_000 + int(4_000 * u01(cfg.seed, self.rank, u.index, 0xE5))
            lt = tm.group_start - 10_000
            corr = self._launch(lt, lt + ctx.tparams.launch_ns, *ctx.launch_api)
            name, short = ctx.kernel_name("SendRecv", DT_F32, 0, "RING")
            self._emit_kernel([], (a, b), name, short, corr, st0, "SendRecv", "RING", "SIMPLE", 1, 512, u,
                              False, True, None, None)  # fmt: skip

    def _unit_calls(self, u: Unit, tm: UnitTimes, dom: int) -> list:
        """The unit's NCCL calls (eager, not a graph replay): their log lines (returned, one
        record per op, for the ground truth) and NVTX ranges, the group's ranges around them,
        and the TUNING lines they leave."""
        ctx, tpar = self.ctx, self.ctx.tparams
        comms = self.comms
        capturing = self.capturing
        op_rows = []
        nvtx = self._nvtx if self.drop_meta else None  # None: append the rows here (the usual case)
        nv_rows = self.nvtx_rows
        if u.grouped:
            self._nvtx(tm.group_start, tm.group_start + tpar.group_call_ns, "ncclGroupStart", domain=dom)
        call_end = tm.call_end if not u.grouped and tm.launches else None
        api_ns = tpar.api_call_ns
        texts = ctx.nvtx_text
        payloads = ctx.payloads
        call = self._call
        for o, t_call in zip(u.ops, tm.call_start):
            st = comms[o.comm_uid]
            op_rows.append(call(o, st, t_call, u))
            end = call_end if call_end is not None else t_call + api_ns
            payload = self._payload(o, st) if payloads else None
            if nvtx is not None:
                nvtx(t_call, end, texts[o.op], domain=dom, payload=payload)
            elif capturing:
                nv_rows.append((t_call, end, texts[o.op], True, dom, payload))
        if self._tuning_buf:
            self._flush_tuning(self._at(tm.call_end))
        else:
            self.fh.now = tm.call_end
        if u.grouped:
            self._nvtx(tm.group_end_start, tm.call_end, "ncclGroupEnd", domain=dom)
        return op_rows

    def _unit_kernels(self, u: Unit, tm: UnitTimes, kern_groups: list[list[Op]], graph: _Graph | None,
                      gpos: int) -> dict[int, tuple[int, bool]]:  # fmt: skip
        """The unit's NCCL kernels, launched eagerly or as nodes of a graph replay. Returns, per op
        (its seq), the kernel's correlation id and whether the kernel was dropped."""
        ctx, cfg = self.ctx, self.cfg
        comms = self.comms
        capturing = self.capturing
        kern_of_op: dict[int, tuple[int, bool]] = {}
        drop_kernels = ctx.imp.drop_kernels
        launch_name, launch_class = ctx.launch_api
        for j, kops in enumerate(kern_groups):
            o0 = kops[0]
            st = comms[o0.comm_uid]
            if graph is None:
                lt0, lt1 = tm.launches[j]
                self.corr += 1
                corr = self.corr
                if capturing:
                    self.runtime_rows.append((lt0, lt1, corr, launch_name, launch_class))
                dropped = bool(drop_kernels) and u01(cfg.seed, self.rank, corr, 0xD0) < drop_kernels
                gextra = None
            else:
                corr = graph.corr
                node = graph.nodes[gpos][j]
                dropped = bool(drop_kernels) and u01(cfg.seed, self.rank, corr, node, 0xD0) < drop_kernels
                seq = graph.seqs[gpos][j]
                gextra = {"graph_id": graph.gid, "graph_node_id": node, "graph_replay": graph.replays - 1,
                          "replay_of_seq": seq, "replay_of_log_line": graph.lines.get(seq)}  # fmt: skip
            if len(kops) == 1:
                kkey = (o0.op, o0.nbytes, o0.dtype, o0.redop, o0.comm_uid, o0.peer)
                kinfo = self._kernel_info.get(kkey)
                if kinfo is None:
                    kinfo = _cache_put(self._kernel_info, kkey, self._kernel_of(kops))
            else:
                kinfo = self._kernel_of(kops)
            family, name, short, spec, rule = kinfo
            self._emit_kernel(kops, tm.kernels[j], name, short, corr, st, family, spec.algo, spec.proto,
                              spec.nchannels, spec.nthreads, u, dropped, False, gextra, rule)  # fmt: skip
            for o in kops:
                kern_of_op[o.seq] = (corr, dropped)
        return kern_of_op

    def _unit_op_counts(self, multi: list[Op], replayed: bool) -> None:
        """opCount: plans launched per communicator (>= 2.27.3: only plans with network work).
        A replayed (persistent) plan posts its proxy work from a host node at each replay, which
        advances opCount only for plans with network work (src/enqueue.cc hostStreamPlanTask)."""
        ctx, comms = self.ctx, self.comms
        if len(multi) == 1:
            uids: Any = (multi[0].comm_uid,)
        else:
            uids = {o.comm_uid for o in multi}
        for uid in uids:
            st = comms[uid]
            if ctx.opcount_needs_proxy or replayed:
                # 2.27.3+: only plans with proxy (network) work for this rank count: P2P with a peer
                # on another node; collectives on a communicator spanning nodes.
                gpn = self.cfg.gpus_per_node
                proxy = any(o.peer >= 0 and o.peer // gpn != self.node if o.op in P2P_OPS
                            else ctx.link.nnodes(st.comm) > 1 for o in multi if o.comm_uid == uid)  # fmt: skip
                if not proxy:
                    continue
            st.op_count += 1

    def _unit_one(self, u: Unit, tm: UnitTimes) -> None:
        """:meth:`_unit` for the common unit (one call with one kernel, no group, no communicator
        creation, no CUDA graphs, no kernels without log lines, NVTX metadata kept): the same
        rows in the same order, with the general path's steps inlined."""
        o = u.ops[0]
        st = self.comms[o.comm_uid]
        capturing = self.capturing
        t_call = tm.call_start[0]
        call_end = tm.call_end
        ctx = self.ctx
        # call: log line, NVTX range
        rec = self._call(o, st, t_call, u)
        if capturing:
            self.nvtx_rows.append((t_call, call_end, ctx.nvtx_text[o.op], True, self.domain_id,
                                   self._payload(o, st) if ctx.payloads else None))  # fmt: skip
        if self._tuning_buf:
            self._flush_tuning(self._at(call_end))
        else:
            self.fh.now = call_end
        # kernel and its launch
        lt0, lt1 = tm.launches[0]
        self.corr += 1
        corr = self.corr
        if capturing:
            self.runtime_rows.append((lt0, lt1, corr, self._launch_name, self._launch_class))
        drop_kernels = ctx.imp.drop_kernels
        dropped = bool(drop_kernels) and u01(self.cfg.seed, self.rank, corr, 0xD0) < drop_kernels
        kkey = (o.op, o.nbytes, o.dtype, o.redop, o.comm_uid, o.peer)
        kinfo = self._kernel_info.get(kkey)
        if kinfo is None:
            kinfo = _cache_put(self._kernel_info, kkey, self._kernel_of([o]))
        family, name, short, spec, rule = kinfo
        ks, ke = tm.kernels[0]
        self.stream_last_end[st.stream_id] = ke
        if not dropped and capturing:
            self.kernel_rows.append((ks, ke, st.stream_id, corr, name, short, spec.nchannels, spec.nthreads, 96, 8704,
                                     None, None))  # fmt: skip
            self.n_kernels += 1
            kc = self.kernel_counts
            kc[family] = kc.get(family, 0) + 1
        # (the columns of _emit_kernel's row)
        row = (self.rank, self.host, self.pid, self.gpid, self.local, st.stream_id, corr, name, short, family, ks, ke,
               ks, ke, spec.nchannels, spec.nthreads, u.iteration, u.index, 1, o.seq, o.instance, st.uid, spec.algo,
               spec.proto, dropped, False)  # fmt: skip
        if self._kernels_ext:
            row += self._kernel_ext(capturing, None, rule)
        self._kernels_pending.append(row)
        # compute kernel filling the gap before this unit
        if u.gap_ns > 10_000:
            gs = max(self._prev_gpu_end, ks - int(u.gap_ns))
            self._compute_kernel(gs + 500, ks - 500, self._prev_cpu, tm.group_start, None)
        self._prev_gpu_end = tm.gpu_free
        self._prev_cpu = call_end
        # opCount
        if ctx.opcount_needs_proxy:
            gpn = self.cfg.gpus_per_node
            if (o.peer >= 0 and o.peer // gpn != self.node if o.op in P2P_OPS else ctx.link.nnodes(st.comm) > 1):
                st.op_count += 1
        else:
            st.op_count += 1
        # ground truth
        ext = self._ops_graph_ext if self.cap is None else self._ops_ext()
        self._ops_pending.append(self._ops_row(o, u, rec, corr, self.gpid, dropped, False, ext))

    def _kernel_ext(self, capturing: bool, graph: dict | None, rule: str | None) -> tuple:
        """The extra ground-truth columns of a kernel (capture window, CUDA graphs, naming rule)."""
        row: tuple = ()
        if self.cap is not None:
            row += (capturing,)
        if self.ctx.graphs is not None:
            if graph is not None:
                row += (graph["graph_id"], graph["graph_node_id"], graph["graph_replay"], graph["replay_of_seq"],
                        graph["replay_of_log_line"])  # fmt: skip
            else:
                row += (None, None, None, None, None)
        if self.ctx.namer is not None:
            row += (rule or "default",)
        return row

    def _ops_ext(self) -> tuple:
        """The extra ground-truth columns of an eager call (capture window, CUDA graphs)."""
        return ((self.capturing,) if self.cap is not None else ()) + self._ops_graph_ext

    def _kernel_of(self, kops: list[Op]) -> tuple[str, str, str, KernelSpec, str | None]:
        """(family, name, short name, spec, naming rule) of the kernel that runs ``kops``."""
        ctx = self.ctx
        o0 = kops[0]
        if len(kops) > 1:
            family = kernel_op_of_unit(kops)
            spec = ctx.link.unit(kops)
        else:
            family = "SendRecv" if o0.op in P2P_OPS or o0.op == "AlltoAll" else o0.op
            spec = ctx.link.op_kernel(o0)
        if ctx.namer is None:
            name, short = ctx.kernel_name(family, o0.dtype, o0.redop, spec.algo)
            return family, name, short, spec, None
        name, short, spec, rule = ctx.namer.kernel(kops, family, spec)
        return family, name, short, spec, rule

    def _emit_kernel(self, ops: list[Op], times: tuple[int, int], name: str, short: str, corr: int, st: _CommState,
                     family: str, algo: str, proto: str, nch: int, nthreads: int, u: Unit, dropped: bool = False,
                     without_log: bool = False, graph: dict | None = None,
                     rule: str | None = None) -> None:  # fmt: skip
        ks, ke = times
        self.stream_last_end[st.stream_id] = ke
        capturing = self.capturing
        if not dropped and capturing:
            # (start, end, stream, correlation id, name, short name, grid x, block x, registers,
            # dynamic shared memory, graph id, graph node id): see flush()
            if graph is None:
                self.kernel_rows.append((ks, ke, st.stream_id, corr, name, short, nch, nthreads, 96, 8704, None, None))
            else:
                self.kernel_rows.append((ks, ke, st.stream_id, corr, name, short, nch, nthreads, 96, 8704,
                                         graph["graph_id"], graph["graph_node_id"]))  # fmt: skip
            self.n_kernels += 1
            kc = self.kernel_counts
            kc[family] = kc.get(family, 0) + 1
        if ops:
            first = ops[0]
            first_seq, instance = first.seq, first.instance
        else:
            first_seq = instance = None
        if graph is not None:
            first_seq = graph["replay_of_seq"]  # the call this kernel replays (no call of its own)
        # start/end (columns 10, 11) are true times here, made nsys timestamps by the sink
        row = (self.rank, self.host, self.pid, self.gpid, self.local, st.stream_id, corr, name, short, family, ks, ke,
               ks, ke, nch, nthreads, u.iteration, u.index, len(ops), first_seq, instance, st.uid, algo, proto,
               dropped, without_log)  # fmt: skip
        if self._kernels_ext:
            row += self._kernel_ext(capturing, graph, rule)
        self._kernels_pending.append(row)  # (complete batches are written by _run)

    def _flush_tuning(self, wall_ns: int | None) -> None:
        """TUNING lines of one launched plan, in the order and aggregation of the NCCL version.

        2.20-2.21 sum consecutive same (function, op, type) tasks; 2.22-2.23 sort a group's tasks by
        size and sum same-type tasks within 4x of each other; >= 2.24 print one line per task, tasks
        binned by (function, op, type) and sorted by size, largest first.
        """
        buf, self._tuning_buf = self._tuning_buf, []
        if not buf:
            return
        if len(buf) == 1 and not isinstance(buf[0][1], _SymTuning):  # one task: one line, every version
            self._tuning_lines_of([(buf[0], buf[0][0].nbytes, buf[0][1])], wall_ns)
            return
        v = self.ctx.nccl.tuple
        if any(isinstance(e[1], _SymTuning) for e in buf):
            # symmetric kernels: one line per task (2.27 src/enqueue.cc; 2.28+ symmetric_sched.cc adds nWorks)
            for o, sym in buf:
                if isinstance(sym, _SymTuning):
                    tail = "" if v < (2, 28, 0) else " nWorks 1"
                    self.w.info(self.tid, f"{o.op} [Symmetric]: {o.nbytes} Bytes -> Kernel {sym.kid} nchannels "
                                          f"{sym.nblocks} nthreads 512{tail}", wall_ns=wall_ns)  # fmt: skip
            buf = [e for e in buf if not isinstance(e[1], _SymTuning)]
            if not buf:
                return
        key = lambda e: (e[0].op, e[0].redop, e[0].dtype, e[0].comm.uid)  # noqa: E731
        lines: list[tuple] = []  # (op entry, total per-rank bytes, spec)
        if v < (2, 22, 0):
            for e in buf:
                if lines and key(lines[-1][0]) == key(e):
                    lines[-1] = (lines[-1][0], lines[-1][1] + e[0].nbytes, lines[-1][2])
                else:
                    lines.append((e, e[0].nbytes, e[1]))
        else:
            bins: dict[tuple, list] = {}
            for e in buf:
                bins.setdefault(key(e), []).append(e)
            for entries in bins.values():
                entries.sort(key=lambda e: -e[0].nbytes)
                for e in entries:
                    if (v < (2, 24, 0) and lines and key(lines[-1][0]) == key(e)
                            and e[0].nbytes * 4 >= lines[-1][0][0].nbytes):  # fmt: skip
                        lines[-1] = (lines[-1][0], lines[-1][1] + e[0].nbytes, lines[-1][2])
                    else:
                        lines.append((e, e[0].nbytes, e[1]))
        self._tuning_lines_of(lines, wall_ns)

    def _tuning_lines_of(self, lines: list[tuple], wall_ns: int | None) -> None:
        """Write TUNING lines: ((op, spec) entry, per-rank bytes, spec) each."""
        for (o, _), nbytes, spec in lines:
            args = {"op": o.op, "nbytes": nbytes, "algo": spec.algo, "proto": spec.proto, "channel_lo": 0,
                    "channel_hi": spec.nchannels - 1, "time_us": spec.duration_ns / 1000.0, "nranks": o.nranks}
            if self._stamped:
                self.w.tuning(self.tid, wall_ns=wall_ns, **args)
                continue
            key = tuple(args.values())
            hit = self._tuning_lines.get(key)
            if hit is None:
                hit = _cache_put(self._tuning_lines, key, self._render(self.w.tuning, self.tid, **args))
            self._write_rendered(*hit)

    def _payload(self, o: Op, st: _CommState) -> dict | None:
        """The NCCL payload of a call's NVTX range (memoised: rows share equal payload dicts)."""
        if not self.ctx.payloads:
            return None
        key = (o.op, st.comm_hash, o.nbytes, o.redop, o.root)
        p = self._payloads.get(key)
        if p is None:
            p = _cache_put(self._payloads, key, self._make_payload(o, st))
        return p

    def _make_payload(self, o: Op, st: _CommState) -> dict:
        size = o.nbytes
        new = self.ctx.new_payloads
        p: dict[str, Any] = {}
        if new:
            p["NCCL communicator ID"] = st.comm_hash
        if o.op in ("AllReduce", "ReduceScatter"):
            p["Message size [bytes]"] = size
            p["Reduction operation"] = _REDOP_NAME.get(o.redop, "sum")
        elif o.op == "AllGather" or o.op == "AlltoAll":
            p["Message size [bytes]"] = size
        elif o.op == "Broadcast":
            p["Message size [bytes]" if new else "Bytes"] = size
            p["Root"] = o.root
        elif o.op == "Reduce":
            p["Message size [bytes]"] = size
            p["Root"] = o.root
            p["Reduction operation"] = _REDOP_NAME.get(o.redop, "sum")
        elif o.op in P2P_OPS:
            p["Message size [bytes]" if new else "Bytes"] = size
            p["Peer rank"] = o.root
        return p

    def _render(self, method: Any, *args: Any, **kw: Any) -> tuple[str, int]:
        """What a log-writer method writes (text, physical lines), without writing it: the text
        is cached and written later by :meth:`_write_rendered` (same bytes, no reformatting)."""
        w = self.w
        fh, n = w.fh, w.lines_written
        buf = io.StringIO()
        w.fh = buf
        try:
            method(*args, **kw)
        finally:
            w.fh = fh
            lines, w.lines_written = w.lines_written - n, n
        return buf.getvalue(), lines

    def _write_rendered(self, text: str, lines: int) -> int:
        """Write a rendered log text; returns the number of the last line written."""
        if lines:
            self.fh.write(text)
            self.w.lines_written += lines
        return self.w.lines_written

    def _call_info(self, o: Op, st: _CommState) -> tuple:
        """What every call with this signature logs and records (see :meth:`_call`): the call
        line as text before and after its opCount (None with timestamps: rendered per line),
        the writer arguments, the TUNING spec (rank 0 of a multi-rank communicator), and the
        ground-truth values that depend on the signature only."""
        ctx = self.ctx
        op, count = o.op, o.count
        bkey = (count, len(o.phase))
        buf = self._bufs.get(bkey)
        if buf is None:
            buf = 0x7F0000000000 + ((hash_ints(self.rank, count, bkey[1]) & 0xFFFFFFF) << 9)
            _cache_put(self._bufs, bkey, buf)
        if op == "AllReduce" or op == "Broadcast":
            send = recv = buf
        elif op == "Send":
            send, recv = buf, 0
        elif op == "Recv":
            send, recv = 0, buf
        else:
            send, recv = buf, buf + 0x10000000
        kw = {"op": op, "sendbuff": send, "recvbuff": recv, "count": count, "datatype": o.dtype, "redop": o.redop,
              "root": o.root, "comm": st.ptr, "nranks": st.size, "stream": st.stream_ptr}
        pre = post = None
        if not self._stamped:
            # The line differs between calls of a signature only in its opCount: render it once
            # with a marker opCount (NcclLogWriter stays the one place the format is defined).
            text, lines = self._render(self.w.call, self.tid, op_count=_OPCOUNT_MARK, **kw)
            parts = text.split(_OPCOUNT_MARK_HEX)
            if lines == 1 and len(parts) == 2:
                pre, post = parts
        tuning = None
        if st.rank_in_comm == 0 and st.size > 1 and op not in P2P_OPS and op != "AlltoAll":
            link = ctx.link
            spec = link.collective(op, o.nbytes, st.size, link.nnodes(st.comm))
            tuning = spec if ctx.namer is None else ctx.namer.tuning(o, spec)
        peer = o.peer
        head = (self.rank, self.host, self.pid, self.tid, self.log_file)
        mid = (count, o.dtype, o.nbytes, o.redop, o.root, peer if peer >= 0 else None, st.size, st.rank_in_comm,
               st.kind, st.index, st.uid)  # fmt: skip
        tail = (st.stream_kind, st.stream_ptr)
        return kw, pre, post, tuning, head, st.ptr, mid, tail

    def _call(self, o: Op, st: _CommState, t: int, u: Unit) -> tuple:
        """Log one NCCL call at true time ``t`` (its line, a duplicate, TUNING work for rank 0).
        Returns what its ground-truth row needs (:meth:`_ops_row`): (signature info, log line,
        duplicate line, opCount, line dropped, line torn, t)."""
        imp = self.ctx.imp
        sig = (o.op, o.count, o.dtype, o.redop, o.root, o.peer, o.comm_uid, len(o.phase))
        info = self._call_infos.get(sig)
        if info is None:
            info = _cache_put(self._call_infos, sig, self._call_info(o, st))
        op_count = st.op_count
        fh = self.fh
        fh.now = t
        seq = o.seq
        dropped = bool(imp.drop_log_lines) and u01(self.cfg.seed, self.rank, seq, 0xD1) < imp.drop_log_lines
        line = dup_line = None
        torn = False
        if not dropped:
            dup = self._dup and u01(self.cfg.seed, self.rank, seq, 0xD2) < imp.duplicate_log_lines.fraction
            w = self.w
            pre = info[1]
            if pre is not None:
                text = f"{pre}{op_count:x}{info[2]}"
                fh.write(text)
                w.lines_written += 1
                line = w.lines_written
                if dup:
                    fh.write(text)
                    w.lines_written += 1
                    dup_line = line + 1
            else:
                kw = info[0]
                wall = self.wall(t) if self._stamped else None
                line = w.call(self.tid, op_count=op_count, wall_ns=wall, **kw)
                if dup:
                    dup_line = w.call(self.tid, op_count=op_count, wall_ns=wall, **kw)
            self.n_call_lines += 2 if dup else 1
            torn = bool(imp.torn_lines) and u01(self.cfg.seed, self.pid, line, 0x7E) < imp.torn_lines
            if info[3] is not None:
                # Printed when the plan is launched (ncclGroupEnd), after all calls of the group.
                self._tuning_buf.append((o, info[3]))
        self.n_ops += 1
        self.op_counts[o.op] = self.op_counts.get(o.op, 0) + 1
        return info, line, dup_line, op_count, dropped, torn, t

    def _ops_row(self, o: Op, u: Unit, rec: tuple, kernel_corr: int | None, kernel_gpid: int | None,
                 kernel_dropped: bool, fused: bool, ext: tuple) -> tuple:  # fmt: skip
        """The ground-truth row of a call (:data:`GROUND_TRUTH_SCHEMAS` ``ops`` + ``ext``;
        ``wall_ns`` is the call's true time here, made the wall clock by the sink)."""
        info, line, dup_line, op_count, dropped, torn, t = rec
        return (*info[4], line, dup_line, o.seq, o.iteration, o.phase, o.op, info[5], op_count, *info[6], u.index,
                u.grouped, o.instance, *info[7], t, t, kernel_corr, kernel_gpid, dropped, dup_line is not None, torn,
                kernel_dropped, o.nranks == 1, fused, *ext)  # fmt: skip


# --------------------------------------------------------------------------- combined stdout


STDOUT_TEARS_SCHEMA = pa.schema([("pid", pa.int64()), ("log_line", pa.int64()), ("stdout_line", pa.int64()),
                                 ("kind", pa.string())])


def _write_combined_stdout(out: Path, logs: list[tuple[Path, Path, int]], cfg: EmulatorConfig,
                           tears_path: Path) -> None:
    """Interleave all processes' lines by time into one stdout log and tear the chosen call lines
    (first part of the line, then the next line of another process, then the orphan tail).

    What actually happened to each damaged line is written to ``tears_path`` (ground truth):
    ``torn`` = head on one physical line, tail on the next; ``glued`` = an intact record written
    right after a torn head, on the same physical line. A line chosen for tearing that arrives
    while a tail is pending is written whole (glued), and recorded as such.
    """
    tears: list[tuple[int, int, int, str]] = []
    stdout_line = 1
    frac = cfg.imperfections.torn_lines
    tmp = atomic_path(out)
    files = []
    heap = []
    for i, (log, times, pid) in enumerate(logs):
        fh = open(log, "r", encoding="utf-8")
        ts = np.fromfile(times, dtype=np.int64)
        files.append((fh, ts, pid))
        line = fh.readline()
        if line:
            heap.append((int(ts[0]) if len(ts) else 0, pid, 1, i, line))
    heapq.heapify(heap)
    pending_tail: str | None = None
    with open(tmp, "w", encoding="utf-8", newline="\n") as outf:
        while heap:
            t, pid, lineno, i, line = heapq.heappop(heap)
            fh, ts, _pid = files[i]
            nxt = fh.readline()
            if nxt:
                heapq.heappush(heap, (int(ts[lineno]) if lineno < len(ts) else t, pid, lineno + 1, i, nxt))
            text = line.rstrip("\n")
            if pending_tail is not None:
                outf.write(text + "\n" + pending_tail + "\n")
                tears.append((pid, lineno, stdout_line, "glued"))
                stdout_line += 2
                pending_tail = None
                continue
            if ": opCount " in text and u01(cfg.seed, pid, lineno, 0x7E) < frac and heap:
                cut = 10 + int((len(text) - 20) * u01(cfg.seed, pid, lineno, 0x7F))
                outf.write(text[:cut])
                tears.append((pid, lineno, stdout_line, "torn"))
                pending_tail = text[cut:]
                continue
            outf.write(text + "\n")
            stdout_line += 1
        if pending_tail is not None:
            outf.write("\n" + pending_tail + "\n")
    for fh, _ts, _pid in files:
        fh.close()
    _publish(tmp, out)
    cols = list(zip(*tears)) if tears else [[], [], [], []]
    tt = atomic_path(tears_path)
    pq.write_table(pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(cols, STDOUT_TEARS_SCHEMA)],
                                        schema=file_schema(STDOUT_TEARS_SCHEMA)), tt)
    _publish(tt, tears_path)


# --------------------------------------------------------------------------- entry point


def _publish(tmp: Path, path: Path) -> Path:
    """Rename a finished temporary file into place with ordinary (umask) permissions."""
    os.chmod(tmp, 0o666 & ~_UMASK)
    os.replace(tmp, path)
    return path


_UMASK = os.umask(0)
os.umask(_UMASK)


def _yaml_atomic(path: Path, data: Any) -> None:
    tmp = atomic_path(path)
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    _publish(tmp, path)


@dataclass
class _NodeOutput:
    """What emulating one node wrote (returned from a worker process)."""

    node: int
    nsys_paths: list[Path]  # empty: no profiled rank on the node, so nsys left no report
    log_files: list[Path]
    parts: dict[str, Path]
    line_time_files: list[tuple[Path, Path, int]]
    n_ops: int = 0
    n_call_lines: int = 0
    n_kernels: int = 0
    op_counts: dict[str, int] = field(default_factory=dict)
    kernel_counts: dict[str, int] = field(default_factory=dict)


_PART_NAMES = ("ops", "kernels", "communicators")


def _add_counts(dst: Any, src: Any) -> None:
    """Add the op, call-line and kernel totals of ``src`` (a process or a node) into ``dst``."""
    dst.n_ops += src.n_ops
    dst.n_call_lines += src.n_call_lines
    dst.n_kernels += src.n_kernels
    for k, v in src.op_counts.items():
        dst.op_counts[k] = dst.op_counts.get(k, 0) + v
    for k, v in src.kernel_counts.items():
        dst.kernel_counts[k] = dst.kernel_counts.get(k, 0) + v
_WORKER_CTX: _Context | None = None  # set before forking workers; children inherit it


def _emulate_node(node: int, ctx: _Context | None = None, sinks: dict[str, _Sink] | None = None) -> _NodeOutput:
    """Emit one node: its ranks' logs, its nsys export and its ground-truth part files, or, given
    ``sinks`` (a serial run), its ground-truth rows into those (flushed at the node's end, so row
    groups are the ones a part file would have had)."""
    ctx = ctx if ctx is not None else _WORKER_CTX
    assert ctx is not None
    cfg, out_dir = ctx.cfg, ctx.out_dir
    host = ctx.hosts[node]
    clk = ctx.clocks[node]
    parts_dir = out_dir / "ground_truth" / ".parts"
    schemas = ground_truth_schemas(ctx.capture is not None, ctx.graphs is not None, ctx.namer is not None)
    # Rows hold true times where ground truth wants the node's nsys timestamps or wall clock: whole
    # columns are converted at once (kernels start/end, ops wall_ns).
    transforms = {
        "ops": {30: lambda c: clk.wall_many(c, cfg.start_time_utc_ns)},
        "kernels": {10: clk.nsys_many, 11: clk.nsys_many},
    }
    own_sinks = sinks is None
    if sinks is None:
        sinks = {name: _Sink(parts_dir / f"{name}.{node:06d}.parquet", schemas[name], transforms=transforms.get(name),
                             part=True) for name in _PART_NAMES}  # fmt: skip
    else:
        for name, sink in sinks.items():
            sink.transforms = transforms.get(name) or {}
    ranks = [node * cfg.gpus_per_node + lr for lr in range(cfg.gpus_per_node)]
    # one export per node (`nsys profile` around the node's launcher), or one per process
    # (`srun nsys profile -o <dir>/trace_%q{SLURM_PROCID}`: nsys/<host>/trace_<rank>.sqlite)
    if cfg.nsys_per_process:
        (out_dir / "nsys" / host).mkdir(parents=True, exist_ok=True)
        nsys_paths = {r: out_dir / "nsys" / host / f"trace_{r}.sqlite" for r in ranks}
    else:
        nsys_paths = dict.fromkeys(ranks, out_dir / "nsys" / f"{host}.sqlite")
    exported = node in ctx.exported_nodes
    out = _NodeOutput(node, sorted(set(nsys_paths.values())) if exported else [], [], {}, [])
    record_times = cfg.imperfections.torn_lines > 0
    payload_mode = cfg.nvtx_payloads if cfg.nvtx_payloads != "none" else "none"
    hw_id, vm_id = _capture_ids(node)
    try:
        with contextlib.ExitStack() as stack:
            writers: dict[Path, NsysExportWriter] = {}
            for path in dict.fromkeys(nsys_paths.values()):
                writers[path] = stack.enter_context(NsysExportWriter(
                    path, cfg.nsys_schema, hostname=host,
                    session_start_utc_ns=cfg.start_time_utc_ns + clk.session_local, product_version=cfg.nsys_product_version, payload_mode=payload_mode, hw_id=hw_id, vm_id=vm_id,
                    fsync=False, session_clock_ns=clk.session_clock_ns or None))  # fmt: skip
            for rank in ranks:
                proc = _Process(ctx, rank, writers[nsys_paths[rank]], sinks, record_times)
                proc.run()
                out.log_files.append(proc.log_path)
                _add_counts(out, proc)
                if record_times and proc.fh.times is not None:
                    tpath = atomic_path(out_dir / "nccl" / f".{proc.log_name}.times")
                    np.asarray(proc.fh.times, dtype=np.int64).tofile(tpath)
                    out.line_time_files.append((proc.log_path, tpath, proc.pid))
            if not exported:
                for nw in writers.values():
                    nw.abort()  # its processes never started a capture: nsys generates no report
        if own_sinks:
            out.parts = {name: sink.close() for name, sink in sinks.items()}
        else:
            for sink in sinks.values():
                sink.flush()  # a batch never spans nodes (their clocks differ)
    except BaseException:
        if own_sinks:
            for sink in sinks.values():
                sink.abort()
        for _log, tpath, _pid in out.line_time_files:
            tpath.unlink(missing_ok=True)
        raise
    return out


def _merge_parts(parts: list[Path], path: Path, schema: pa.Schema) -> Path:
    """Concatenate per-node part files in node order into one Parquet file, a row group at a
    time (memory stays at one row group), then delete the parts."""
    tmp = atomic_path(path)
    try:
        with pq.ParquetWriter(tmp, file_schema(schema), compression="zstd") as writer:
            for part in parts:
                pf = pq.ParquetFile(part)
                for i in range(pf.num_row_groups):
                    writer.write_table(pf.read_row_group(i))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for part in parts:
        part.unlink(missing_ok=True)
    return _publish(tmp, path)


@contextlib.contextmanager
def _few_gc_passes():
    """Collect the young generation every 100k allocations instead of every 700 while emulating:
    the emulator allocates millions of short-lived row tuples and creates no reference cycles in
    its loops, and the collector's passes over them were about a tenth of its time."""
    old = gc.get_threshold()
    gc.set_threshold(100_000, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def emulate_run(config: EmulatorConfig | dict, out_dir: Path, *, progress: bool = False,
                workers: int = 1) -> EmulationResult:  # fmt: skip
    """Emulate a Megatron-LM run and write its raw outputs and ground truth into ``out_dir``.

    Nodes are independent given the run-wide context, so with ``workers > 1`` they are emulated
    in that many forked processes; the outputs are byte-identical to a serial emulation
    (ground truth is merged in node order)."""
    with _few_gc_passes():
        return _emulate_run(config, out_dir, progress=progress, workers=workers)


def _emulate_run(config: EmulatorConfig | dict, out_dir: Path, *, progress: bool, workers: int) -> EmulationResult:
    cfg = EmulatorConfig.from_dict(config) if not isinstance(config, EmulatorConfig) else config
    cfg.validate()
    out_dir = Path(out_dir)
    for d in ("nccl", "nsys", "ground_truth", "ground_truth/.parts"):
        (out_dir / d).mkdir(parents=True, exist_ok=True)
    t_wall = _time.time()
    ctx = _Context(cfg, out_dir)
    gt = out_dir / "ground_truth"
    res = EmulationResult(out_dir=out_dir, run_id=cfg.run_id, config=cfg, n_ranks=cfg.world_size)
    record_times = cfg.imperfections.torn_lines > 0
    workers = max(1, min(int(workers), cfg.nodes))
    outputs = _emulate_nodes(ctx, res, gt, workers=workers, progress=progress, t_wall=t_wall)
    line_time_files = [t for o in outputs for t in o.line_time_files]
    _write_clock_truth(ctx, res, gt)
    if record_times:
        res.stdout_log = out_dir / "stdout.log"
        try:
            res.ground_truth["stdout_tears"] = gt / "stdout_tears.parquet"
            _write_combined_stdout(res.stdout_log, line_time_files, cfg, res.ground_truth["stdout_tears"])
        finally:
            for _log, tpath, _pid in line_time_files:
                tpath.unlink(missing_ok=True)
    res.duration_ns = ctx.skel.job_end_ns
    res.run_yaml = out_dir / RUN_YAML_FILE
    _yaml_atomic(res.run_yaml, _run_yaml(ctx, res))
    _remove_stale(res)
    return res


def _emulate_nodes(ctx: _Context, res: EmulationResult, gt: Path, *, workers: int, progress: bool,
                   t_wall: float) -> list[_NodeOutput]:  # fmt: skip
    """Emulate every node (serially, or in ``workers`` forked processes) and collect their
    outputs into ``res`` in node order: log and export files, counts, and the ground-truth
    tables (merged from per-node part files when forked). On failure nothing partial is left
    in ``gt``. Returns the node outputs, sorted by node."""
    global _WORKER_CTX
    cfg = ctx.cfg
    schemas = ground_truth_schemas(ctx.capture is not None, ctx.graphs is not None, ctx.namer is not None)
    outputs: list[_NodeOutput] = []

    def done(o: _NodeOutput) -> None:
        outputs.append(o)
        if progress:
            print(f"[emulator] {cfg.run_id}: node {o.node + 1} done, {len(outputs)}/{cfg.nodes} "
                  f"({_time.time() - t_wall:.1f}s)", file=sys.stderr, flush=True)  # fmt: skip

    sinks: dict[str, _Sink] = {}
    try:
        if workers == 1:
            # Serial: ground truth goes straight into the published files (no part files to merge)
            sinks = {name: _Sink(gt / f"{name}.parquet", schemas[name]) for name in _PART_NAMES}
            for node in range(cfg.nodes):
                done(_emulate_node(node, ctx, sinks))
            for name in _PART_NAMES:
                res.ground_truth[name] = sinks.pop(name).close()
        else:
            import multiprocessing

            _WORKER_CTX = ctx
            try:
                with multiprocessing.get_context("fork").Pool(workers) as pool:
                    for o in pool.imap_unordered(_emulate_node, range(cfg.nodes)):
                        done(o)
            finally:
                _WORKER_CTX = None
        outputs.sort(key=lambda o: o.node)
        for o in outputs:
            res.log_files += o.log_files
            res.nsys_files += o.nsys_paths
            _add_counts(res, o)
        if workers > 1:
            for name in _PART_NAMES:
                res.ground_truth[name] = _merge_parts([o.parts[name] for o in outputs], gt / f"{name}.parquet",
                                                      schemas[name])  # fmt: skip
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        for o in outputs:
            for part in o.parts.values():
                part.unlink(missing_ok=True)
            for _log, tpath, _pid in o.line_time_files:
                tpath.unlink(missing_ok=True)
        raise
    finally:
        for part in (gt / ".parts").glob("*.parquet"):
            part.unlink(missing_ok=True)
        if (gt / ".parts").is_dir() and not any((gt / ".parts").iterdir()):
            (gt / ".parts").rmdir()
    return outputs


def _write_clock_truth(ctx: _Context, res: EmulationResult, gt: Path) -> None:
    """The clock ground truth: per node its clock's offset and drift and the session start."""
    cfg = ctx.cfg
    clock_rows = [{"node": c.node, "host": ctx.hosts[c.node], "offset_ns": c.offset_ns, "drift_ppm": c.drift_ppm,
                   "session_start_true_ns": c.session_true_ns,
                   "session_start_utc_ns": cfg.start_time_utc_ns + c.session_local} for c in ctx.clocks]  # fmt: skip
    cs = _Sink(gt / "clock.parquet", GROUND_TRUTH_SCHEMAS["clock"])
    for r in clock_rows:
        cs.add(tuple(r[f.name] for f in GROUND_TRUTH_SCHEMAS["clock"]))
    res.ground_truth["clock"] = cs.close()


def _run_yaml(ctx: _Context, res: EmulationResult) -> dict:
    """The content of run.yaml: the run's settings and what the emulation derived from them."""
    cfg = ctx.cfg
    run_yaml = {
        "nccltrace_version": __version__,
        "generator": "nccltrace.emulator",
        "run_id": cfg.run_id,
        "config": cfg.to_dict(),
        "derived": {
            "world_size": cfg.world_size, "dp": cfg.dp, "expert_tp": cfg.expert_tp, "expert_dp": cfg.expert_dp,
            "num_microbatches": cfg.num_microbatches, "padded_vocab_size": cfg.padded_vocab_size,
            "ffn_hidden_size": cfg.ffn, "fp16_overflow_iterations": cfg.overflow_iterations,
            "overlap_p2p_comm": cfg.overlap_p2p, "nsys_schema": cfg.nsys_schema,
            "nsys_product_version": cfg.nsys_product_version, "megatron": "core_r0.13 (73a28a1)",
            "hosts": ctx.hosts, "pids": {int(r): int(p) for r, p in ctx.pids.items()},
            "job_duration_ns": int(res.duration_ns),
        },
    }  # fmt: skip
    if ctx.capture is not None:
        run_yaml["derived"]["captured"] = {  # not "capture": that key is the run setting
            "profiled_ranks": ctx.capture.profiled_ranks(cfg.world_size),
            "exported_hosts": [ctx.hosts[n] for n in sorted(ctx.exported_nodes)],
        }
    return run_yaml


def _remove_stale(res: EmulationResult) -> None:
    """Delete outputs of an earlier emulation into the same directory that this run did not
    write (other pids/hosts), so the directory always describes exactly one run."""
    keep = {p.resolve() for p in res.log_files + res.nsys_files}
    for pattern in ("nccl/nccl_*.log", "nsys/*.sqlite"):
        for p in res.out_dir.glob(pattern):
            if p.resolve() not in keep:
                p.unlink()
    if res.stdout_log is None:
        (res.out_dir / "stdout.log").unlink(missing_ok=True)
        (res.out_dir / "ground_truth" / "stdout_tears.parquet").unlink(missing_ok=True)
