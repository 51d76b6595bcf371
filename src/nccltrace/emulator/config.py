"""Configuration of an emulated Megatron-LM training run.

An :class:`EmulatorConfig` describes what a real run would have been launched with plus the
emulator's own knobs (seed, imperfections, timing). It is built from a dict or YAML, validated
with Megatron-LM core_r0.13's own rules (each violation raises :class:`ConfigError` naming the
field and how to fix it), so that no emulated run is one Megatron would refuse, and resolved
into the derived quantities the schedule needs. Fields and rules with their sources:
``docs/emulator.md`` section 1.1.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from nccltrace.core.capture_window import (
    CaptureError,
    CaptureWindow,
    capture_run_id_tag,
)
from nccltrace.core.errors import ConfigError
from nccltrace.megatron.constraints import LaunchShape, first_problem, positive_problem
from nccltrace.megatron.model import MODEL_DEFAULTS as _D
from nccltrace.megatron.model import padded_vocab_size
from nccltrace.nccl.versions import NcclVersion

__all__ = [
    "ConfigError",
    "CudaGraphs",
    "DuplicateLines",
    "Imperfections",
    "KernelNaming",
    "EmulatorConfig",
    "NSYS_SCHEMAS",
    "HARDWARE_PRESETS",
    "HardwarePreset",
]


# nsys release -> SQLite export schema version (see reference/nsys/sqlite-schema.md).
NSYS_SCHEMAS: dict[str, str] = {"2022.4": "3.0.0", "2024.6": "3.16.1", "2026.4": "3.28.1"}
_NSYS_PRODUCT: dict[str, str] = {"2022.4": "2022.4.2.1", "2024.6": "2024.6.2.225", "2026.4": "2026.4.1"}

# Oldest/newest NCCL minor releases whose line formats the project's writer covers.
_NCCL_MIN = (2, 18, 0)
_NCCL_MAX = (2, 30, 99)


@dataclass(frozen=True)
class HardwarePreset:
    """A node type: GPU, interconnect bandwidths (GB/s) and sustained compute rate."""

    gpu_name: str
    nvlink_bw: float | None  # per-GPU NVLink bandwidth as NCCL's topology dump reports it; None = PCIe only
    nvswitch: bool
    pci_bw: float
    sys_bw: float
    net_bw: float  # per NIC
    nics: int
    cpus: int
    intra_busbw: float  # achievable NCCL bus bandwidth inside a node (GB/s)
    tflops: float  # sustained dense fp16/bf16 TFLOP/s of the training kernels


HARDWARE_PRESETS: dict[str, HardwarePreset] = {
    # Thesis 5.1.2: 4x A100-SXM4-40GB full NVLink mesh (NV4, NCCL NVL[80] per peer), 2x HDR200.
    "a100": HardwarePreset("NVIDIA A100-SXM4-40GB", 240.0, False, 24.0, 10.0, 25.0, 2, 2, 200.0, 100.0),
    # Thesis 5.1.1: 4x A40, PCIe only, each GPU on its own NUMA domain (SYS 16 GB/s), 2x HDR100.
    "a40": HardwarePreset("NVIDIA A40", None, False, 24.0, 16.0, 12.5, 2, 2, 11.0, 45.0),
    # A DGX-H100-like node: NVSwitch, 8 NICs.
    "h100": HardwarePreset("NVIDIA H100 80GB HBM3", 480.0, True, 48.0, 20.0, 50.0, 8, 2, 360.0, 350.0),
}


@dataclass
class DuplicateLines:
    """Write a fraction of the COLL call lines of the listed global ranks twice (consecutively),
    as the thesis saw on one rank per TP group (table 4.2, exact 2:1 log:kernel ratios)."""

    ranks: list[int] = field(default_factory=list)
    fraction: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.ranks) and self.fraction > 0.0


@dataclass
class Imperfections:
    """Controllable deviations from an ideal trace. Every knob is OFF by default.

    * ``fuse_grouped_p2p``: ops of one ``ncclGroupStart/End`` launch one kernel (grouped
      Send/Recv -> one ``SendRecv`` kernel, as NCCL does). Off: one kernel per logged op.
    * ``duplicate_log_lines``: some call lines written twice on some ranks.
    * ``drop_log_lines``: fraction of call lines missing from the logs (kernels still run).
    * ``drop_kernels``: fraction of NCCL kernels missing from the nsys export.
    * ``single_rank_comm_ops``: how many of Megatron's ops on communicators with one rank
      (logged, but NCCL launches no kernel) each process emits: 0 = none, -1 = all of them
      (what a real run does), N = the first N.
    * ``kernels_without_log``: extra NCCL kernels (fraction of the NCCL kernel count) with no
      log line.
    * ``clock_offset_ns_max`` / ``clock_drift_ppm_max``: per-node clock offset (uniform in
      +-max) and linear drift applied to that node's nsys timeline and log wall clocks.
    * ``arrival_skew_ns_max``: ranks reach a collective up to this much apart; kernels start
      at arrival and end together (within ~1 us).
    * ``end_spread_ns_max``: each rank's kernel of a collective ends up to this much later than
      the collective (uniform per rank and instance): ranks time-sharing a GPU, or stragglers,
      whose kernels overlap but end milliseconds apart (the real capture's shape:
      ``docs/emulator.md`` section 4).
    * ``torn_lines``: also write a combined stdout log of all processes (as when ranks share
      stdout) in which this fraction of call lines is torn by another process's line.
    * ``first_iteration_extra_calls``: the first training iteration ends with this many extra
      Broadcasts on the world communicator (a job's first steps often differ from the rest:
      initial broadcasts, communicators created on first use; the real H200 capture's first
      iteration has one), so the log's periodic part starts at the second iteration.
    """

    fuse_grouped_p2p: bool = False
    duplicate_log_lines: DuplicateLines = field(default_factory=DuplicateLines)
    drop_log_lines: float = 0.0
    drop_kernels: float = 0.0
    single_rank_comm_ops: int = 0
    kernels_without_log: float = 0.0
    clock_offset_ns_max: int = 0
    clock_drift_ppm_max: float = 0.0
    arrival_skew_ns_max: int = 0
    end_spread_ns_max: int = 0
    torn_lines: float = 0.0
    first_iteration_extra_calls: int = 0

    @classmethod
    def realistic(cls) -> "Imperfections":
        """What a real run looks like: fused groups, single-rank ops, skew, unsynchronised clocks."""
        return cls(
            fuse_grouped_p2p=True,
            single_rank_comm_ops=-1,
            clock_offset_ns_max=2_000_000,
            clock_drift_ppm_max=5.0,
            arrival_skew_ns_max=50_000,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "Imperfections":
        data = dict(data or {})
        _check_keys(data, cls, "imperfections.")
        dup = data.pop("duplicate_log_lines", None)
        out = cls(**data)
        if dup is not None:
            if isinstance(dup, DuplicateLines):
                out.duplicate_log_lines = dup
            elif isinstance(dup, Mapping):
                _check_keys(dup, DuplicateLines, "imperfections.duplicate_log_lines.")
                out.duplicate_log_lines = DuplicateLines(
                    ranks=[int(r) for r in dup.get("ranks", [])], fraction=float(dup.get("fraction", 0.0))
                )
            else:
                raise ConfigError("imperfections.duplicate_log_lines", "must be a mapping {ranks: [...], fraction: f}")
        return out


# Communicator kinds whose transformer-layer collectives CUDA graphs can capture.
CUDA_GRAPH_PARALLELISM = ("tp", "cp")


@dataclass
class CudaGraphs:
    """Megatron-LM CUDA graphs of the transformer layers (``--enable-cuda-graph`` /
    ``--cuda-graph-impl local``, TransformerEngine graphed layers). OFF unless ``parallelism``
    names at least one communicator kind (docs/emulator.md section 4.1).

    * ``parallelism``: kinds (``tp``, ``cp``) whose NCCL calls inside a transformer layer's
      forward or backward pass are captured; the layer's other calls (and MoE dispatch, embedding,
      output layer, recompute, everything outside the layers) stay eager.
    * ``warmup_iterations``: iterations run eagerly before the graphs are captured (Megatron's
      ``cuda_graph_warmup_steps``; at least 1, the recording step). All graphs are captured just
      before the first graphed call of iteration ``warmup_iterations`` (0-based) and replayed
      from then on.
    * ``capture_launch_records``: the kernel launch API calls NCCL makes while the stream is being
      captured appear in the CUDA API trace (with their own correlation ids and no kernel), as
      CUPTI traces every API call; false drops them.
    * ``phases``: schedule phases (``RankProgram`` phase names such as ``step/grad-norm-max`` or
      ``grad-sync/sequence-parallel``) whose calls are captured whatever their communicator: per
      phase one graph holding the phase's calls of one iteration, replayed once per iteration
      (a job that graphs one small piece of its step, e.g. with ``torch.cuda.graphs`` or
      ``torch.compile(mode="reduce-overhead")``, while its other collectives stay eager).
    """

    parallelism: list[str] = field(default_factory=list)
    warmup_iterations: int = 1
    capture_launch_records: bool = True
    phases: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.parallelism or self.phases)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "CudaGraphs" | None) -> "CudaGraphs":
        if isinstance(data, CudaGraphs):
            return data
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError("cuda_graphs", "must be a mapping, e.g. {parallelism: [tp], warmup_iterations: 1}")
        _check_keys(data, cls, "cuda_graphs.")
        par = data.get("parallelism", [])
        if isinstance(par, str):
            par = [par]
        phases = data.get("phases", [])
        if isinstance(phases, str):
            phases = [phases]
        return cls(parallelism=[str(x) for x in par],
                   warmup_iterations=_coerce("cuda_graphs.warmup_iterations", data.get("warmup_iterations", 1), "int"),
                   capture_launch_records=_coerce("cuda_graphs.capture_launch_records",
                                                  data.get("capture_launch_records", True), "bool"),
                   phases=[str(x) for x in phases])  # fmt: skip


# NCCL algorithms per collective and the first NCCL release whose device code runs them
# (src/collectives/device/*.h in 2.18, algos_of_coll in src/device/generate.py from 2.19).
NCCL_ALGORITHMS_OF_COLL: dict[str, dict[str, tuple[int, int, int]]] = {
    "AllReduce": {a: (2, 18, 0) for a in ("TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE")},
    "AllGather": {"RING": (2, 18, 0), "NVLS": (2, 18, 0), "COLLNET_DIRECT": (2, 20, 0), "PAT": (2, 23, 0)},
    "ReduceScatter": {"RING": (2, 18, 0), "NVLS": (2, 18, 0), "COLLNET_DIRECT": (2, 20, 0), "PAT": (2, 23, 0)},
    "Broadcast": {"RING": (2, 18, 0)},
    "Reduce": {"RING": (2, 18, 0)},
}
_SENDRECV_NAMED = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce")
_SYMMETRIC_COLLS = ("AllReduce", "AllGather", "ReduceScatter")


@dataclass
class KernelNaming:
    """Kernel names of real NCCL builds that break the one-collective-one-name rule. OFF (every
    list/mapping empty) by default (docs/emulator.md section 4.2). Precedence: SendRecv, then
    symmetric, then the algorithm.

    * ``collectives_as_sendrecv``: these collectives run in the ``SendRecv`` kernel (builds that
      implement collectives over point-to-point, e.g. Meta's).
    * ``symmetric``: these collectives use symmetric-memory kernels (NCCL >= 2.27, buffers
      registered with ``ncclCommWindowRegister``) whenever NCCL's kernel picker would:
      ``ncclSymDevKernel_*`` (2.27) / ``ncclSymkDevKernel_*`` (2.28+); otherwise the usual kernel.
    * ``algorithms``: collective -> NCCL algorithm (as with ``NCCL_ALGO``): RING, TREE,
      COLLNET_DIRECT, COLLNET_CHAIN, NVLS, NVLS_TREE, PAT. Changes TUNING lines, ground truth and,
      up to NCCL 2.18 (per-algorithm kernels), the kernel name.
    """

    collectives_as_sendrecv: list[str] = field(default_factory=list)
    symmetric: list[str] = field(default_factory=list)
    algorithms: dict[str, str] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.collectives_as_sendrecv or self.symmetric or self.algorithms)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "KernelNaming" | None) -> "KernelNaming":
        if isinstance(data, KernelNaming):
            return data
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError("kernel_naming", "must be a mapping, e.g. {collectives_as_sendrecv: [AllReduce]}")
        _check_keys(data, cls, "kernel_naming.")

        def names(key: str) -> list[str]:
            v = data.get(key) or []
            return [str(x) for x in ([v] if isinstance(v, str) else v)]

        algos = data.get("algorithms") or {}
        if not isinstance(algos, Mapping):
            raise ConfigError("kernel_naming.algorithms", "must map a collective to an algorithm, e.g. {AllReduce: NVLS}")
        return cls(collectives_as_sendrecv=names("collectives_as_sendrecv"), symmetric=names("symmetric"),
                   algorithms={str(k): str(v).upper() for k, v in algos.items()})  # fmt: skip


def _check_keys(data: Mapping[str, Any], cls: type, prefix: str = "") -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    aliases = {"model"} if cls is EmulatorConfig else set()
    for key in data:
        if key not in names and key not in aliases:
            close = difflib.get_close_matches(str(key), sorted(names), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{prefix}{key}", f"unknown option{hint}; options are snake_case, e.g. 'num_layers'")


@dataclass
class EmulatorConfig:
    """A Megatron-LM GPT pretraining run to emulate. Defaults: the thesis "dense" model (16
    layers, hidden 512, 8 heads, seq 1024, global batch 64, micro batch 4, 10 iterations, fp16)
    on one 4-GPU node with pure data parallelism. The Megatron settings' defaults (and what their
    values mean) are :data:`nccltrace.megatron.model.MODEL_DEFAULTS`, shared with the analysis."""

    name: str = "dense"  # model label (run id)
    # model
    num_layers: int = _D["num_layers"]
    hidden_size: int = _D["hidden_size"]
    num_attention_heads: int = _D["num_attention_heads"]
    ffn_hidden_size: int | None = _D["ffn_hidden_size"]
    vocab_size: int = _D["vocab_size"]
    seq_length: int = _D["seq_length"]
    position_embedding_type: str = _D["position_embedding_type"]
    untie_embeddings: bool = _D["untie_embeddings"]
    # batch / run length
    micro_batch_size: int = _D["micro_batch_size"]
    global_batch_size: int = _D["global_batch_size"]
    iterations: int = _D["iterations"]
    # parallelism
    tp: int = _D["tp"]
    pp: int = _D["pp"]
    cp: int = _D["cp"]
    ep: int = _D["ep"]
    etp: int | None = _D["etp"]
    vpp: int = _D["vpp"]
    sequence_parallel: bool = _D["sequence_parallel"]
    distributed_optimizer: bool = _D["distributed_optimizer"]
    recompute: str = _D["recompute"]
    overlap_p2p_comm: bool | None = _D["overlap_p2p_comm"]
    # MoE
    num_experts: int = _D["num_experts"]
    moe_router_topk: int = _D["moe_router_topk"]
    moe_layer_freq: int = _D["moe_layer_freq"]
    moe_token_dispatcher: str = _D["moe_token_dispatcher"]
    moe_alltoall: str = _D["moe_alltoall"]
    # numerics
    precision: str = _D["precision"]
    fp16_overflow_iterations: int | None = None  # None: loss-scaler model (see docs/emulator.md)
    # cluster and software
    nodes: int = 1
    gpus_per_node: int = 4
    hardware: str = "a100"
    gpu_tflops: float | None = None  # override the preset's sustained TFLOP/s
    nccl_version: str = "2.21.5"
    cuda_version: str = "12.4"
    nsys_version: str = "2024.6"
    init_style: str = "plain"  # plain (lazy ncclCommInitRankConfig) | split (eager ncclCommSplit)
    # False: the default (world) process group runs no NCCL collective (its barriers and logging
    # reductions go over gloo), so with init_style 'plain' no communicator spans every rank: what a
    # Megatron-Core job whose groups are created lazily leaves in its logs
    default_group_nccl: bool = True
    nccl_timestamps: bool = False
    nvtx_payloads: str = "none"  # none | blob | dynamic | json
    nsys_per_process: bool = False  # one export per process (nsys/<host>/trace_<rank>.sqlite), not per node
    log_timers_to_tensorboard: bool = True
    compute_kernels: bool = True
    # emulator
    seed: int = 0
    start_time_utc_ns: int = 1_760_000_000_000_000_000
    host_names: list[str] | None = None  # node host names (default node000, node001, ...)
    imperfections: Imperfections = field(default_factory=Imperfections)
    # real-build behaviour (docs/emulator.md sections 4.1, 4.2); written to run.yaml only when set
    cuda_graphs: CudaGraphs = field(default_factory=CudaGraphs)
    kernel_naming: KernelNaming = field(default_factory=KernelNaming)
    # step window / rank subset captured by nsys (nccltrace.core.capture_window); None = the whole run
    capture: dict[str, Any] | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "EmulatorConfig") -> "EmulatorConfig":
        """Build and validate a config from a snake_case mapping (``model`` is an alias of ``name``)."""
        if isinstance(data, EmulatorConfig):
            data.validate()
            return data
        if not isinstance(data, Mapping):
            raise ConfigError("<config>", f"expected a mapping, got {type(data).__name__}")
        data = dict(data)
        _check_keys(data, cls)
        if "model" in data:
            if "name" in data and data["name"] != data["model"]:
                raise ConfigError("model", "give either 'model' or 'name', not both")
            data["name"] = data.pop("model")
        imp = data.pop("imperfections", None)
        graphs = CudaGraphs.from_dict(data.pop("cuda_graphs", None))
        naming = KernelNaming.from_dict(data.pop("kernel_naming", None))
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for key, value in list(data.items()):
            data[key] = _coerce(key, value, types[key])
        cfg = cls(**data)
        cfg.imperfections = imp if isinstance(imp, Imperfections) else Imperfections.from_dict(imp)
        cfg.cuda_graphs, cfg.kernel_naming = graphs, naming
        cfg.validate()
        if cfg.capture is not None:  # explicit steps and ranks from here on (run.yaml)
            cfg.capture = cfg.capture_window.to_setting()  # type: ignore[union-attr]
        return cfg

    @classmethod
    def from_yaml(cls, source: str | Path) -> "EmulatorConfig":
        """Load from a YAML file path or YAML text."""
        text = Path(source).read_text() if isinstance(source, Path) or (
            isinstance(source, str) and "\n" not in source and Path(source).exists()
        ) else str(source)
        data = yaml.safe_load(text) or {}
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "EmulatorConfig":
        """A validated copy with some fields changed."""
        d = self.to_dict()
        d.update(changes)
        return EmulatorConfig.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (round-trips through :meth:`from_dict`). ``capture``, ``cuda_graphs`` and
        ``kernel_naming`` (and ``nsys_per_process``) appear only when set, so a run without them writes
        the run.yaml it always did."""
        d = dataclasses.asdict(self)
        if not self.nsys_per_process:
            del d["nsys_per_process"]
        if not self.imperfections.first_iteration_extra_calls:
            del d["imperfections"]["first_iteration_extra_calls"]
        if d["capture"] is None:
            del d["capture"]
        if not self.cuda_graphs.active:
            del d["cuda_graphs"]
        elif not self.cuda_graphs.phases:
            del d["cuda_graphs"]["phases"]  # the run.yaml of a run graphing layers only, as before
        if not self.kernel_naming.active:
            del d["kernel_naming"]
        return d

    # ------------------------------------------------------------------ derived values

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        """Megatron's data-parallel size: world / (tp * pp * cp) (EP is carved out of DP x CP)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: world / (etp * ep * pp)."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def padded_vocab_size(self) -> int:
        """Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by (128) x tp."""
        return padded_vocab_size(self.vocab_size, self.tp)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp

    @property
    def layers_per_chunk(self) -> int:
        return self.num_layers // (self.pp * self.vpp)

    @property
    def overlap_p2p(self) -> bool:
        """Megatron core_r0.13 turns overlap_p2p_comm on by default and off for non-interleaved
        schedules; with overlap, p2p is issued as individual isend/irecv (not batched)."""
        if self.vpp <= 1:
            return False
        return True if self.overlap_p2p_comm is None else bool(self.overlap_p2p_comm)

    @property
    def nccl(self) -> NcclVersion:
        return NcclVersion.parse(self.nccl_version)

    @property
    def nsys_release(self) -> str:
        return next(k for k in NSYS_SCHEMAS if str(self.nsys_version).startswith(k))

    @property
    def nsys_schema(self) -> str:
        return NSYS_SCHEMAS[self.nsys_release]

    @property
    def nsys_product_version(self) -> str:
        v = str(self.nsys_version)
        return v if v.count(".") >= 2 else _NSYS_PRODUCT[self.nsys_release]

    @property
    def hw(self) -> HardwarePreset:
        return HARDWARE_PRESETS[self.hardware]

    @property
    def tflops(self) -> float:
        return self.gpu_tflops if self.gpu_tflops else self.hw.tflops

    @property
    def overflow_iterations(self) -> int:
        """Iterations whose fp16 gradients overflow (optimizer step skipped).

        Megatron's DynamicGradScaler starts at 2**32 with hysteresis 2 and halves the scale on
        every overflow after the first; we assume gradients overflow until the scale has fallen
        to 2**16, i.e. for 17 iterations. The thesis's fp16 op counts (no grad-norm all-reduce,
        no distributed-optimizer param all-gather in any of its 10 iterations) agree.
        """
        if self.precision != "fp16":
            return 0
        n = 17 if self.fp16_overflow_iterations is None else self.fp16_overflow_iterations
        return min(n, self.iterations)

    @property
    def capture_window(self) -> CaptureWindow | None:
        """The captured step window and ranks (None = the whole run is profiled)."""
        return CaptureWindow.from_setting(self.capture, iterations=self.iterations, world_size=self.world_size)

    @property
    def run_id(self) -> str:
        """``<name>_tp<T>_pp<P>_ep<E>_cp<C>_vpp<V>_sp<0|1>_dp<D>`` plus ``_distopt`` / ``_agdisp``
        when the distributed optimizer / the allgather token dispatcher are on."""
        rid = (
            f"{self.name}_tp{self.tp}_pp{self.pp}_ep{self.ep}_cp{self.cp}_vpp{self.vpp}"
            f"_sp{int(self.sequence_parallel)}_dp{self.dp}"
        )
        if self.distributed_optimizer:
            rid += "_distopt"
        if self.is_moe and self.moe_token_dispatcher == "allgather":
            rid += "_agdisp"
        return rid + capture_run_id_tag(self.capture)

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        """Raise :class:`ConfigError` for the first invalid field: the options' own values, the
        software versions, Megatron's launch rules, then the emulator's imperfections, CUDA
        graphs, kernel naming and capture window."""
        self._check_options()
        nccl = self._check_versions()
        self._check_megatron()
        self._check_imperfections()
        self._check_cuda_graphs()
        self._check_kernel_naming(nccl)
        # capture window (the one definition: nccltrace.core.capture_window)
        try:
            self.capture_window
        except CaptureError as exc:
            raise ConfigError(exc.field, exc.message) from None

    def _check_options(self) -> None:
        """Each option on its own: positive sizes, known choices, host names, hardware."""
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                  "micro_batch_size", "global_batch_size", "iterations", "tp", "pp", "cp", "ep", "vpp",
                  "nodes", "gpus_per_node", "moe_layer_freq")  # fmt: skip
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in "/\\ \t"):
            raise ConfigError("name", "give a model label without spaces or slashes, e.g. 'dense'")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size <= 0:
            raise ConfigError("ffn_hidden_size", "must be positive (or omit it for 4 * hidden_size)")
        if self.etp is not None and self.etp <= 0:
            raise ConfigError("etp", "must be positive (or omit it to use tp)")
        if self.num_experts < 0:
            raise ConfigError("num_experts", "must be >= 0 (0 = dense model)")
        _choice(self, "recompute", ("none", "selective", "full"))
        _choice(self, "moe_token_dispatcher", ("alltoall", "allgather"))
        _choice(self, "moe_alltoall", ("p2p", "native"))
        _choice(self, "precision", ("fp16", "bf16", "fp32"))
        _choice(self, "init_style", ("plain", "split"))
        _choice(self, "nvtx_payloads", ("none", "blob", "dynamic", "json"))
        _choice(self, "position_embedding_type", ("learned_absolute", "rope"))
        if self.host_names is not None:
            if len(self.host_names) != self.nodes or len(set(self.host_names)) != self.nodes:
                raise ConfigError("host_names", f"give {self.nodes} distinct host names, one per node")
            bad = [h for h in self.host_names if not h or not all(c.isalnum() or c in "-." for c in str(h))]
            if bad:
                raise ConfigError("host_names", f"{bad[0]!r} is not a host name (letters, digits, '-', '.')")
        if self.hardware not in HARDWARE_PRESETS:
            raise ConfigError("hardware", f"unknown hardware {self.hardware!r}; choose one of {sorted(HARDWARE_PRESETS)}")
        if self.gpu_tflops is not None and self.gpu_tflops <= 0:
            raise ConfigError("gpu_tflops", "must be positive")
        if self.fp16_overflow_iterations is not None and self.fp16_overflow_iterations < 0:
            raise ConfigError("fp16_overflow_iterations", "must be >= 0 (or omit it for the loss-scaler model)")

    def _check_versions(self) -> NcclVersion:
        """NCCL and Nsight Systems releases the writers cover, and what the options need of them."""
        try:
            v = NcclVersion.parse(self.nccl_version)
        except ValueError:
            raise ConfigError("nccl_version", f"{self.nccl_version!r} is not a version; use e.g. '2.21.5'") from None
        if not (_NCCL_MIN <= v.tuple <= _NCCL_MAX):
            raise ConfigError(
                "nccl_version",
                f"NCCL {v} is not supported; use a release from 2.18.x to 2.30.x (e.g. 2.18.3, 2.21.5, 2.24.3, 2.28.9)",
            )
        if not any(str(self.nsys_version).startswith(k) for k in NSYS_SCHEMAS):
            raise ConfigError(
                "nsys_version",
                f"unknown Nsight Systems release {self.nsys_version!r}; use one of {sorted(NSYS_SCHEMAS)}",
            )
        if self.nvtx_payloads == "blob" and self.nsys_schema == "3.0.0":
            raise ConfigError("nvtx_payloads", "'blob' needs NVTX_EVENTS.binaryData (nsys >= 2024.6); use 'json' or 'none'")
        if self.nvtx_payloads == "dynamic" and self.nsys_schema != "3.28.1":
            raise ConfigError("nvtx_payloads", "'dynamic' payload tables need nsys 2026.4; use 'blob' or 'json'")
        if self.moe_alltoall == "native" and not v.has_native_alltoall:
            raise ConfigError("moe_alltoall", f"ncclAlltoAll exists from NCCL 2.28; NCCL {v} needs 'p2p'")
        if self.precision == "bf16" and not v.has_bf16:
            raise ConfigError("precision", "bf16 needs NCCL >= 2.10")
        return v

    def launch_shape(self) -> LaunchShape:
        """What Megatron's launch rules (:mod:`nccltrace.megatron.constraints`) check of this run."""
        return LaunchShape(world=self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.etp,
                           vpp=self.vpp, num_layers=self.num_layers, hidden_size=self.hidden_size,
                           num_attention_heads=self.num_attention_heads, ffn_hidden_size=self.ffn,
                           padded_vocab_size=self.padded_vocab_size, seq_length=self.seq_length,
                           micro_batch_size=self.micro_batch_size, global_batch_size=self.global_batch_size,
                           num_experts=self.num_experts, moe_router_topk=self.moe_router_topk,
                           precision=self.precision, sequence_parallel=self.sequence_parallel,
                           overlap_p2p=self.overlap_p2p)  # fmt: skip

    def _check_megatron(self) -> None:
        """Megatron's parallel layout and model shape (parallel_state.initialize_model_parallel,
        validate_args): the one set of rules, :mod:`nccltrace.megatron.constraints`."""
        if self.world_size > 1 << 16:
            raise ConfigError("nodes", "at most 65536 ranks are supported")
        problem = first_problem(self.launch_shape())
        if problem is not None:
            raise ConfigError(problem.field, problem.message)

    def _check_imperfections(self) -> None:
        """The emulator's imperfections: fractions, ranks and time spreads in range."""
        world = self.world_size
        imp = self.imperfections
        for name in ("drop_log_lines", "drop_kernels", "kernels_without_log", "torn_lines"):
            x = getattr(imp, name)
            if not (0.0 <= float(x) <= 1.0):
                raise ConfigError(f"imperfections.{name}", "must be a fraction in [0, 1]")
        if not (0.0 <= imp.duplicate_log_lines.fraction <= 1.0):
            raise ConfigError("imperfections.duplicate_log_lines.fraction", "must be a fraction in [0, 1]")
        bad = [r for r in imp.duplicate_log_lines.ranks if not (0 <= int(r) < world)]
        if bad:
            raise ConfigError("imperfections.duplicate_log_lines.ranks", f"ranks {bad} are outside 0..{world - 1}")
        if imp.single_rank_comm_ops < -1:
            raise ConfigError("imperfections.single_rank_comm_ops", "use 0 (none), -1 (all) or a positive count")
        for name in ("clock_offset_ns_max", "arrival_skew_ns_max", "end_spread_ns_max", "first_iteration_extra_calls"):
            if getattr(imp, name) < 0:
                raise ConfigError(f"imperfections.{name}", "must be >= 0")
        if imp.clock_drift_ppm_max < 0 or imp.clock_drift_ppm_max > 1000:
            raise ConfigError("imperfections.clock_drift_ppm_max", "must be in [0, 1000] ppm")

    def _check_cuda_graphs(self) -> None:
        """CUDA graphs capture communicators that exist, after at least one eager iteration."""
        cg = self.cuda_graphs
        bad = [p for p in cg.parallelism if p not in CUDA_GRAPH_PARALLELISM]
        if bad:
            raise ConfigError("cuda_graphs.parallelism", f"{bad[0]!r} cannot be graphed; choose from {list(CUDA_GRAPH_PARALLELISM)}")
        bad = [p for p in cg.phases if not p or "/" not in p]
        if bad:
            raise ConfigError("cuda_graphs.phases", f"{bad[0]!r} is not a schedule phase (e.g. 'step/grad-norm-max')")
        if cg.active:
            for p in cg.parallelism:
                if getattr(self, p) <= 1:
                    raise ConfigError("cuda_graphs.parallelism", f"{p!r} has no collectives with {p} = 1; drop it or set {p} > 1")
            if isinstance(cg.warmup_iterations, bool) or not isinstance(cg.warmup_iterations, int) \
                    or not (1 <= cg.warmup_iterations < self.iterations):
                raise ConfigError("cuda_graphs.warmup_iterations",
                                  f"must be in 1..iterations-1 = {self.iterations - 1} (Megatron records the graphs "
                                  "in an eager step; at least one later iteration replays them)")

    def _check_kernel_naming(self, v: NcclVersion) -> None:
        """Kernel names and algorithms that NCCL release ``v`` (and the hardware) has."""
        kn = self.kernel_naming
        for key, allowed in (("collectives_as_sendrecv", _SENDRECV_NAMED), ("symmetric", _SYMMETRIC_COLLS)):
            bad = [c for c in getattr(kn, key) if c not in allowed]
            if bad:
                raise ConfigError(f"kernel_naming.{key}", f"{bad[0]!r} is not one of {list(allowed)}")
        if kn.symmetric and v.tuple < (2, 27, 0):
            raise ConfigError("kernel_naming.symmetric", f"symmetric-memory kernels exist from NCCL 2.27; NCCL {v} has none")
        for coll, algo in kn.algorithms.items():
            algos = NCCL_ALGORITHMS_OF_COLL.get(coll)
            if algos is None:
                raise ConfigError("kernel_naming.algorithms", f"{coll!r} is not one of {list(NCCL_ALGORITHMS_OF_COLL)}")
            if algo not in algos or v.tuple < algos[algo]:
                ok = [a for a, since in algos.items() if v.tuple >= since]
                raise ConfigError("kernel_naming.algorithms", f"NCCL {v} runs {coll} with {ok}, not {algo!r}")
            if algo.startswith("NVLS") and not self.hw.nvswitch:
                raise ConfigError("kernel_naming.algorithms", f"{algo} needs NVLink SHARP (NVSwitch, sm90): use hardware 'h100'")


def _positive(cfg: EmulatorConfig, *names: str) -> None:
    for n in names:
        why = positive_problem(getattr(cfg, n))
        if why:
            raise ConfigError(n, why)


def _choice(cfg: EmulatorConfig, name: str, options: tuple[str, ...]) -> None:
    v = getattr(cfg, name)
    if v not in options:
        raise ConfigError(name, f"{v!r} is not one of {list(options)}")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Light type coercion for YAML/dict input (e.g. '2.21.5' stays a string, 4.0 -> 4)."""
    ann = str(annotation)
    if value is None:
        return None
    if ann.startswith("int") and not isinstance(value, bool):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(key, f"expected an integer, got {value!r}") from None
        return value
    if ann.startswith("float") and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(key, f"expected a number, got {value!r}") from None
    if ann.startswith("str") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if ann.startswith("bool") and not isinstance(value, bool):
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        if value in (0, 1):
            return bool(value)
        raise ConfigError(key, f"expected true/false, got {value!r}")
    return value
