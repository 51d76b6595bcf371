"""Per-process alignment cost and accuracy on synthetic Megatron-like inputs with known truth.

    python benchmarks/bench_align.py [--sizes 1e4,1e5,1e6] [--modes default,thesis]
                                     [--drop-log-lines 0.0] [--drop-kernels 0.0] [--no-timestamps]
                                     [--stages] [--traced] [--clock-rows 1e5,1e6] [--quick]

Builds one process's ``calls`` and ``kernels`` frames directly with numpy, in the column
schemas the aligner reads (the emulator is far too slow for 10^6 ops): a middle pipeline stage
of a TP(+SP)/PP/DP run, iterations of TP AllGather/ReduceScatter, grouped PP Send/Recv (one
opCount, one ``SendRecv`` kernel per group), DP ReduceScatter/AllGather buckets, loss and
grad-norm AllReduces and world barriers, each communicator on its own stream; log lines carry
microsecond timestamps, kernels launch a few microseconds after their last call line and carry
a grid (channel count). Optional random drops of call lines and of kernel records. Since the generator knows which kernel each
line launched, precision, recall and F1 follow (as in ``nccltrace.validation.alignment``: a
positive is a line whose kernel is in the export).

Each (size, mode) runs ``align_process`` once in a fresh subprocess after a warm-up (compiled
kernels loaded, not measured), and reports: build time (everything before the core aligner:
kernel filter, launch units, kernel sequence), align time (``align_units`` or ``align_thesis``),
table time (assembling the correlation table), the process's peak RSS during the call and the
increase over its RSS before it (the peak is reset just before the call via
``/proc/self/clear_refs``). ``--traced`` repeats each run under ``tracemalloc`` for the peak
traced memory (numpy and numba allocations; slower, so in a separate run); ``--stages`` also
reports the wall time and peak RSS of the aligner's internal steps. The thesis mode is
skipped where calls x kernels exceeds its cell limit. Also times ``estimate_clock_model`` on
synthetic collective instances over 8 clock domains (``--clock-rows``). ``--quick`` (sizes
10^3 and 10^4, 10^4 clock rows, all in one interpreter) is sized for CI.

Prints figures only; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

HOST, PID = "node000", 81234
GLOBAL_PID = PID << 24  # nsys globalPid of a process on hardware/VM id 0
UTC_OFFSET_NS = 1_767_225_600_000_000_000  # session start on the UTC clock (2026-01-01)
MICRO_BATCHES, LAYERS = 8, 4

# name: (nranks, log stream pointer, nsys stream id, comm pointer); every comm launches on its own stream
COMMS: dict[str, tuple[int, int, int, int]] = {
    "tp": (8, 0x55D35C000000, 13, 0x55D35C8B1230),
    "pp": (4, 0x55D35C100000, 17, 0x55D35D0A4F00),
    "dp": (8, 0x55D35C200000, 21, 0x55D35D7C2A10),
    "embd": (2, 0x55D35C300000, 25, 0x55D35DE11B40),
    "world": (256, 0x55D35C400000, 7, 0x55D35C3A9EC0),
}
BF16, F32 = 9, 7  # ncclDataType_t values


@dataclass
class Template:
    """One iteration of the schedule: calls (with the launch they belong to) and launches."""

    call_comm: np.ndarray  # index into COMMS
    call_op: np.ndarray  # index into ``ops``
    call_dtype: np.ndarray
    call_count: np.ndarray
    call_launch: np.ndarray  # launch (kernel) within the iteration
    launch_comm: np.ndarray
    launch_name: np.ndarray  # index into ``names``
    launch_dur_us: np.ndarray  # mean kernel duration
    launch_grid: np.ndarray  # blocks = channels NCCL uses
    ops: list[str]
    names: list[str]


def iteration_template() -> Template:
    """A middle pipeline stage's iteration as its log shows it (1F1B-like, simplified)."""
    comm_ids = {name: k for k, name in enumerate(COMMS)}
    ops: list[str] = []
    names: list[str] = []
    calls: list[tuple[int, int, int, int, int]] = []
    launches: list[tuple[int, int, float, int]] = []
    channels = {"tp": 16, "pp": 8, "dp": 32, "embd": 24, "world": 4}

    def code(table: list[str], s: str) -> int:
        if s not in table:
            table.append(s)
        return table.index(s)

    def launch(comm: str, kernel: str, dur_us: float, members: list[tuple[str, int, int]]) -> None:
        """One kernel launch running ``members`` (op, dtype, count): a lone call or a group."""
        for op, dtype, count in members:
            calls.append((comm_ids[comm], code(ops, op), dtype, count, len(launches)))
        grid = 2 if members[0][2] <= 2 else channels[comm]  # NCCL uses fewer channels for tiny messages
        launches.append((comm_ids[comm], code(names, kernel), dur_us, grid))

    act = 4096 * 8192 // 8  # sequence-parallel activation shard, elements

    def tp_layers() -> None:
        for _ in range(LAYERS):
            for _ in range(2):  # attention and MLP: gather the sequence in, reduce-scatter it out
                launch("tp", "ncclDevKernel_AllGather_RING_LL", 120.0, [("AllGather", BF16, act)])
                launch("tp", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 140.0, [("ReduceScatter", BF16, act)])

    for _ in range(MICRO_BATCHES):  # forward: receive activations, compute, send them on + get a gradient
        launch("pp", "ncclDevKernel_SendRecv", 90.0, [("Recv", BF16, act * 8)])
        tp_layers()
        launch("pp", "ncclDevKernel_SendRecv", 180.0, [("Send", BF16, act * 8), ("Recv", BF16, act * 8)])
    for _ in range(MICRO_BATCHES):  # backward: compute, send the gradient back + get the next activation
        tp_layers()
        launch("pp", "ncclDevKernel_SendRecv", 180.0, [("Send", BF16, act * 8), ("Recv", BF16, act * 8)])
    for b in range(6):  # distributed optimizer: gradient buckets
        launch("dp", "ncclDevKernel_ReduceScatter_Sum_f32_RING_SIMPLE", 4000.0, [("ReduceScatter", F32, 5_000_000 + b)])
    launch("embd", "ncclDevKernel_AllReduce_Sum_f32_RING_SIMPLE", 900.0, [("AllReduce", F32, 65_536_000)])
    launch("tp", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 15.0, [("AllReduce", F32, 1)])  # grad norm
    launch("pp", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 15.0, [("AllReduce", F32, 1)])
    launch("dp", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 15.0, [("AllReduce", F32, 2)])  # loss
    for _ in range(2):  # barriers
        launch("world", "ncclDevKernel_AllReduce_Sum_f32_TREE_LL", 40.0, [("AllReduce", F32, 1)])
    for b in range(6):  # updated parameters
        launch("dp", "ncclDevKernel_AllGather_RING_SIMPLE", 3000.0, [("AllGather", BF16, 5_000_000 + b)])
    c = np.array(calls, np.int64)
    k = np.array(launches, np.float64)
    return Template(c[:, 0], c[:, 1], c[:, 2], c[:, 3], c[:, 4], k[:, 0].astype(np.int64),
                    k[:, 1].astype(np.int64), k[:, 2], k[:, 3].astype(np.int64), ops, names)  # fmt: skip


@dataclass
class Instance:
    """One process's synthetic inputs and the truth: per call row, the kernel's correlation id."""

    calls: pd.DataFrame
    kernels: pd.DataFrame
    truth_line: np.ndarray  # line of each kept call row
    truth_corr: np.ndarray  # its kernel's correlation id, -1 when that kernel record is dropped


def make_instance(n_ops: int, *, drop_log_lines: float = 0.0, drop_kernels: float = 0.0, timestamps: bool = True,
                  seed: int = 1) -> Instance:  # fmt: skip
    """``n_ops`` call lines of one process (before drops) and their kernels, built with numpy only."""
    rng = np.random.default_rng(seed)
    t = iteration_template()
    per_iter, launches_per_iter = len(t.call_comm), len(t.launch_comm)
    n_iter = math.ceil(n_ops / per_iter)
    it = np.repeat(np.arange(n_iter), per_iter)[:n_ops]
    slot = np.tile(np.arange(per_iter), n_iter)[:n_ops]
    call_launch = it * launches_per_iter + t.call_launch[slot]
    m = int(call_launch[-1]) + 1  # launches whose calls were cut off at the end do not exist
    kslot = np.arange(m) % launches_per_iter
    k_comm = t.launch_comm[kslot]
    call_comm = t.call_comm[slot]

    # opCount: launches so far on the comm (one value per group)
    k_opc = np.empty(m, np.int64)
    for c in range(len(COMMS)):
        idx = np.flatnonzero(k_comm == c)
        k_opc[idx] = np.arange(len(idx))

    # CPU timeline: a gap before each call line (framework work, compute kernel launches); a
    # launch follows the last line of its group by a few microseconds and the next line waits
    # for it. GPU: each stream runs its kernels in launch order, >= 5 us after the launch. The
    # loss is read at the end of each iteration, so the next one starts once the GPU is idle
    # (plus the optimizer step); within an iteration the streams overlap and drift apart.
    last = np.ones(n_ops, bool)
    last[:-1] = call_launch[1:] != call_launch[:-1]
    launch_delay = (2_000 + rng.exponential(3_000, n_ops)).astype(np.int64) * last
    gap = (20_000 + rng.exponential(250_000, n_ops)).astype(np.int64)
    in_group = np.zeros(n_ops, bool)
    in_group[1:] = call_launch[1:] == call_launch[:-1]
    gap[in_group] = rng.integers(1_000, 8_000, int(in_group.sum()))  # ncclGroupStart/End: lines back to back
    gap[1:] += launch_delay[:-1]
    dur = (t.launch_dur_us[kslot] * rng.uniform(0.7, 1.5, m) * 1000).astype(np.int64)
    t_log = np.empty(n_ops, np.int64)
    k_launch = np.empty(m, np.int64)
    k_end = np.empty(m, np.int64)
    per_comm = [np.flatnonzero(t.launch_comm == c) for c in range(len(COMMS))]
    t0 = 0
    for i in range(n_iter):
        cs = slice(i * per_iter, min((i + 1) * per_iter, n_ops))
        t_log[cs] = t0 + np.cumsum(gap[cs])
        lst = np.flatnonzero(last[cs]) + cs.start
        k_launch[call_launch[lst]] = t_log[lst] + launch_delay[lst]
        for c, tidx in enumerate(per_comm):
            idx = i * launches_per_iter + tidx
            idx = idx[idx < m]
            if len(idx) == 0:
                continue
            d = np.cumsum(dur[idx])
            ready = k_launch[idx] + 5_000
            ready[0] = max(ready[0], t0)
            # end_k = max(ready_k, end_{k-1}) + dur_k, unrolled: D_k + max_{j<=k}(ready_j - D_{j-1})
            k_end[idx] = d + np.maximum.accumulate(ready - (d - dur[idx]))
        ks = slice(i * launches_per_iter, min((i + 1) * launches_per_iter, m))
        t0 = max(int(k_end[ks].max()), int(t_log[cs][-1])) + 2_000_000 + int(rng.integers(0, 1_000_000))
    k_start = k_end - dur
    corr = 1_000 + np.cumsum(rng.integers(1, 30, m))  # other CUDA API calls take ids in between

    keep_k = rng.random(m) >= drop_kernels
    keep_c = rng.random(n_ops) >= drop_log_lines
    line = 200 + 2 * np.arange(n_ops)  # TUNING and other lines sit between call lines
    nranks, log_stream, kstream, comm_ptr = (np.array([v[i] for v in COMMS.values()]) for i in range(4))
    ops = np.array(t.ops, dtype=object)
    wall = UTC_OFFSET_NS + t_log
    if timestamps:
        wall = wall // 1_000 * 1_000  # log timestamps with microsecond resolution
    ci = np.flatnonzero(keep_c)
    cc = call_comm[ci]
    calls = pd.DataFrame({
        "file": pd.array(np.full(len(ci), f"nccl_{HOST}_{PID}.log", dtype=object), dtype="string"),
        "line": pd.array(line[ci], dtype="Int64"),
        "host": pd.array(np.full(len(ci), HOST, dtype=object), dtype="string"),
        "pid": pd.array(np.full(len(ci), PID), dtype="Int64"),
        "op": pd.array(ops[t.call_op[slot[ci]]], dtype="string"),
        "op_count": pd.array(k_opc[call_launch[ci]], dtype="Int64"),
        "count": pd.array(t.call_count[slot[ci]], dtype="Int64"),
        "datatype": pd.array(t.call_dtype[slot[ci]], dtype="Int8"),
        "nranks": pd.array(nranks[cc], dtype="Int32"),
        "comm": pd.array(comm_ptr[cc].astype(np.uint64), dtype="UInt64"),
        "stream": pd.array(log_stream[cc].astype(np.uint64), dtype="UInt64"),
        "duplicate_of": pd.arrays.IntegerArray(np.zeros(len(ci), np.int64), np.ones(len(ci), bool)),
        "wall_time_ns": pd.arrays.IntegerArray(wall[ci], np.full(len(ci), not timestamps)),
    })  # fmt: skip
    ki = np.flatnonzero(keep_k)
    names = np.array(t.names, dtype=object)
    kernels = pd.DataFrame({
        "short_name": names[t.launch_name[kslot[ki]]],
        "correlation_id": pd.array(corr[ki], dtype="Int64"),
        "start": k_start[ki],
        "end": k_end[ki],
        "launch_start": pd.array(k_launch[ki], dtype="Int64"),
        "stream_id": kstream[k_comm[ki]],
        "grid_x": t.launch_grid[kslot[ki]],
        "grid_y": np.ones(len(ki), np.int64),
        "grid_z": np.ones(len(ki), np.int64),
        "pid": pd.array(np.full(len(ki), PID), dtype="Int64"),
        "global_pid": pd.array(np.full(len(ki), GLOBAL_PID), dtype="Int64"),
    }).sort_values("start", kind="stable").reset_index(drop=True)  # the nsys reader orders kernels by start
    truth = np.where(keep_k[call_launch[ci]], corr[call_launch[ci]], -1)
    return Instance(calls, kernels, line[ci], truth)


def score(table: pd.DataFrame, inst: Instance) -> dict[str, float]:
    """Precision, recall, F1 over call lines and the number of ambiguous ones."""
    rows = table[table["row_kind"] == "call"]
    line = rows["line"].to_numpy(np.int64)
    pos = np.searchsorted(inst.truth_line, line)  # truth lines are sorted and unique
    true_corr = inst.truth_corr[pos]
    pred = (rows["status"] == "matched").to_numpy(bool)
    got = rows["kernel_correlation_id"].fillna(-1).to_numpy(np.int64)
    correct = pred & (true_corr >= 0) & (got == true_corr)
    tp = int(correct.sum())
    fp = int((pred & ~correct).sum())
    fn = int(((true_corr >= 0) & ~correct).sum())
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1,
            "ambiguous": int((rows["reason"] == "ambiguous").sum())}  # fmt: skip


# --------------------------------------------------------------------------- memory


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for ln in fh:
                if ln.startswith(key + ":"):
                    return int(ln.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Set the process's RSS high-water mark to its current RSS (Linux >= 4.0); False if impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def rss_mb() -> float:
    """Current resident set size of this process."""
    kb = _status_kb("VmRSS")
    return (kb or 0) / 1024


def peak_rss_mb() -> float:
    """Peak resident set size since start or the last :func:`reset_peak_rss`."""
    kb = _status_kb("VmHWM")
    return (kb if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


# --------------------------------------------------------------------------- children


class PeakTracker:
    """Peak RSS per step: the high-water mark is read and reset around each tracked step, and
    the overall peak is kept here (resets would otherwise lose it)."""

    def __init__(self) -> None:
        self.overall = peak_rss_mb()

    def mark(self) -> float:
        """Peak since the last mark; starts a new interval."""
        peak = peak_rss_mb()
        self.overall = max(self.overall, peak)
        reset_peak_rss()
        return peak


def _wrap(module: Any, name: str, spans: list[tuple[float, float, float]],
          peaks: PeakTracker | None = None) -> Callable[[], None]:  # fmt: skip
    """Record (start, end, peak RSS MB or nan) of every call of ``module.name``: splits one
    ``align_process`` call into steps without running anything twice. Returns the undo."""
    inner: Callable = getattr(module, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        if peaks is not None:
            peaks.mark()
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            spans.append((t0, t1, peaks.mark() if peaks is not None else float("nan")))

    setattr(module, name, timed)
    return lambda: setattr(module, name, inner)


def child_align(cfg: dict[str, Any]) -> dict[str, Any]:
    """One measured ``align_process`` call (in its own interpreter unless ``--in-process``)."""
    from nccltrace.align import correlate, thesis

    mode = cfg["mode"]
    # warm-up: load (or compile) the kernels, outside the measurement
    w = make_instance(600, drop_log_lines=0.02, drop_kernels=0.02, seed=99)
    correlate.align_process(w.calls, w.kernels, mode=mode, utc_offset_ns=UTC_OFFSET_NS)
    inst = make_instance(cfg["size"], drop_log_lines=cfg["drop_log_lines"], drop_kernels=cfg["drop_kernels"],
                         timestamps=cfg["timestamps"], seed=cfg["seed"])  # fmt: skip
    spans: list[tuple[float, float, float]] = []
    undo: list[Callable[[], None]] = []
    try:
        if mode == "default":
            undo.append(_wrap(correlate, "align_units", spans))
        else:
            undo.append(_wrap(thesis, "align_thesis", spans))  # imported at call time by the thesis path
        return _measure(cfg, inst, spans, undo)
    finally:
        for u in reversed(undo):  # matters when several measurements share one interpreter
            u()


def _measure(cfg: dict[str, Any], inst: Instance, spans: list[tuple[float, float, float]],
             undo: list[Callable[[], None]]) -> dict[str, Any]:  # fmt: skip
    """The measured part of :func:`child_align`."""
    from nccltrace.align import correlate, thesis

    mode = cfg["mode"]
    stage_spans: dict[str, list[tuple[float, float, float]]] = {}
    peaks = None
    if cfg.get("stages"):
        from nccltrace.align import default

        peaks = PeakTracker()

        # internal steps, looked up as module globals at call time (absent ones are skipped)
        targets = {"default": [(correlate, "build_log_units"), (correlate, "build_kernel_sequence"),
                               (default, "_align_windows"), (default, "_band"), (default, "_forward"),
                               (default, "_certain"), (default, "_learn"), (default, "_opcount_fix"),
                               (correlate, "_assemble")],
                   "thesis": [(thesis, "_prepare"), (thesis, "_fill"), (thesis, "_traceback"),
                              (correlate, "_assemble")]}  # fmt: skip
        for module, name in targets.get(mode, []):
            if hasattr(module, name):
                undo.append(_wrap(module, name, stage_spans.setdefault(name, []), peaks))
    gc.collect()
    before = rss_mb()
    resettable = reset_peak_rss()
    if peaks is not None:
        peaks.overall = before
    if cfg["traced"]:
        tracemalloc.start()
    t0 = time.perf_counter()
    table = correlate.align_process(inst.calls, inst.kernels, mode=mode, utc_offset_ns=UTC_OFFSET_NS)
    t1 = time.perf_counter()
    traced = tracemalloc.get_traced_memory()[1] / 2**20 if cfg["traced"] else None
    tracemalloc.stop()
    peak = peak_rss_mb() if peaks is None else max(peaks.overall, peak_rss_mb())
    (a0, a1, _), = spans
    return {"calls": len(inst.calls), "kernels": len(inst.kernels), "build_s": a0 - t0, "align_s": a1 - a0,
            "table_s": t1 - a1, "total_s": t1 - t0, "rss_before_mb": before, "peak_rss_mb": peak,
            "peak_reset": resettable, "traced_mb": traced, **score(table, inst),
            "stages": {k: [len(v), sum(b - a for a, b, _ in v), max(p for _, _, p in v)]
                       for k, v in stage_spans.items()}}  # fmt: skip


def make_clock_frame(n_rows: int, *, n_domains: int = 8, gpus: int = 8,
                     seed: int = 2) -> tuple[pd.DataFrame, Callable[[int], np.ndarray]]:  # fmt: skip
    """Collective instances over ``n_domains`` nodes of ``gpus`` ranks with known clock offsets
    and drifts: node-local TP instances (no information), DP instances across all nodes and a
    few world ones; 0.1 % gross outliers. Returns the frame and the true offsets (ns) of every
    node relative to node000, as a function of node000's time."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(3, size=n_rows // min(gpus, n_domains) + 1, p=[0.45, 0.5, 0.05])  # tp, dp, world
    size = np.where(kinds == 0, gpus, np.where(kinds == 1, n_domains, n_domains * gpus))
    rows_inst = np.repeat(np.arange(len(kinds)), size)[:n_rows]
    first = np.concatenate(([0], np.cumsum(size)[:-1]))
    pos = np.arange(len(rows_inst)) - first[rows_inst]  # member index within the instance
    k = kinds[rows_inst]
    home = rng.integers(0, max(n_domains, gpus), len(kinds))[rows_inst]
    rank = np.where(k == 0, (home % n_domains) * gpus + pos,  # tp: the ranks of one node
                    np.where(k == 1, pos * gpus + home % gpus, pos))  # dp: one per node; world: all
    dom = rank // gpus
    t_end = 1_000_000_000 + np.arange(len(kinds)) * 300_000  # true ends, 300 us apart
    end_true = t_end[rows_inst] + rng.normal(0, 200, len(rows_inst)).astype(np.int64)
    offset = rng.uniform(-5e6, 5e6, n_domains).astype(np.int64)
    offset[0] = 0
    drift = rng.uniform(-5, 5, n_domains) * 1e-6
    drift[0] = 0.0  # node000 is the true clock
    read = end_true + offset[dom] + (drift[dom] * (end_true - t_end[0])).astype(np.int64)
    bad = rng.random(len(read)) < 0.001
    read[bad] += rng.integers(100_000, 10_000_000, int(bad.sum()))
    skew = rng.exponential(20_000, len(read)).astype(np.int64)
    frame = pd.DataFrame({
        "clock_domain": np.array([f"node{i:03d}" for i in range(n_domains)], dtype=object)[dom],
        "global_rank": rank, "instance": rows_inst, "start_ns": read - 50_000 - skew, "end_ns": read,
        "nranks": size[rows_inst],
    })  # fmt: skip
    return frame, lambda t_ns: offset + drift * (t_ns - t_end[0])


def child_clock(cfg: dict[str, Any]) -> dict[str, Any]:
    """One measured ``estimate_clock_model`` call (in its own interpreter unless ``--in-process``).
    ``cfg``: rows, and optionally domains (clock domains = nodes, default 8) and gpus (ranks per node, 8)."""
    from nccltrace.ops.clock_sync import estimate_clock_model

    w, _ = make_clock_frame(5_000, seed=9)
    estimate_clock_model(w)  # warm-up (compiled kernels)
    frame, true_offset = make_clock_frame(cfg["rows"], n_domains=cfg.get("domains", 8), gpus=cfg.get("gpus", 8))
    gc.collect()
    before = rss_mb()
    reset_peak_rss()
    t0 = time.perf_counter()
    model = estimate_clock_model(frame, reference="node000")
    wall = time.perf_counter() - t0
    est = model.domains["offset_ns"].astype(float).to_numpy()
    err = np.abs(est - true_offset(model.t_ref_ns))  # offsets are stated at the model's reference time
    return {"rows": len(frame), "domains": int(frame["clock_domain"].nunique()), "wall_s": wall,
            "rss_before_mb": before, "peak_rss_mb": peak_rss_mb(), "solver": model.info.get("solver"),
            "max_offset_err_ns": float(np.nanmax(err))}  # fmt: skip


def run_child(kind: str, cfg: dict[str, Any], in_process: bool = False) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter (its peak RSS is its own), or here; returns its figures."""
    if in_process:
        return child_align(cfg) if kind == "align" else child_clock(cfg)
    proc = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(cfg)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed ({kind} {cfg}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- driver


def _sizes(text: str) -> list[int]:
    """'1e4,1e5' -> [10000, 100000]."""
    return [int(float(s)) for s in text.split(",") if s.strip()]


def _table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, columns padded so that it also reads as plain text."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e4,1e5,1e6", help="call lines per process, comma-separated")
    ap.add_argument("--modes", default="default,thesis", help="alignment modes, comma-separated")
    ap.add_argument("--drop-log-lines", type=float, default=0.0, help="fraction of call lines dropped at random")
    ap.add_argument("--drop-kernels", type=float, default=0.0, help="fraction of kernel records dropped at random")
    ap.add_argument("--no-timestamps", action="store_true", help="log lines without timestamps (no time signal)")
    ap.add_argument("--traced", action="store_true", help="also measure peak traced memory (tracemalloc, a 2nd run)")
    ap.add_argument("--clock-rows", default="1e5,1e6", help="rows for estimate_clock_model ('' to skip)")
    ap.add_argument("--stages", action="store_true", help="also time the aligner's internal steps")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--in-process", action="store_true",
                    help="measure in this interpreter (one start-up and compile; RSS figures then include "
                         "earlier runs' leftovers)")
    ap.add_argument("--quick", action="store_true",
                    help="CI-sized: sizes 1e3,1e4, 1e4 clock rows, --in-process")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, cfg = args.child[0], json.loads(args.child[1])
        print(json.dumps(child_align(cfg) if kind == "align" else child_clock(cfg)))
        return
    if args.quick:
        args.sizes, args.clock_rows, args.in_process = "1e3,1e4", "1e4", True

    from nccltrace.align.thesis import ThesisParams

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    t_start = time.perf_counter()
    print(f"synthetic Megatron-like process; drops: {args.drop_log_lines:g} of call lines, "
          f"{args.drop_kernels:g} of kernel records; timestamps: {not args.no_timestamps}", flush=True)
    header = ["mode", "ops", "calls", "kernels", "build s", "align s", "table s", "total s", "RSS before",
              "peak RSS", "traced peak", "precision", "recall", "F1", "ambiguous"]  # fmt: skip
    rows: list[list[str]] = []
    stage_lines: list[str] = []
    notes: list[str] = []
    limit = ThesisParams().cell_limit
    for size in _sizes(args.sizes):
        for mode in modes:
            cfg = {"mode": mode, "size": size, "drop_log_lines": args.drop_log_lines, "drop_kernels": args.drop_kernels,
                   "timestamps": not args.no_timestamps, "seed": args.seed, "traced": False,
                   "stages": args.stages}  # fmt: skip
            if mode == "thesis":
                probe = make_instance(size, drop_log_lines=args.drop_log_lines, drop_kernels=args.drop_kernels,
                                      seed=args.seed)  # fmt: skip
                cells = len(probe.calls) * len(probe.kernels)
                if cells > limit:
                    rows.append([mode, f"{size:,}", f"{len(probe.calls):,}", f"{len(probe.kernels):,}"]
                                + ["skipped¹"] + ["-"] * 10)  # fmt: skip
                    notes.append(f"¹ thesis {size:,}: {cells:.2g} n·m cells > ThesisParams.cell_limit {limit:.2g}")
                    print(f"{mode} {size:,}: skipped (cell limit)", flush=True)
                    continue
            r = run_child("align", cfg, args.in_process)
            traced = "-"
            if args.traced:
                traced = f"{run_child('align', {**cfg, 'traced': True}, args.in_process)['traced_mb']:,.0f} MB"
            rows.append([mode, f"{size:,}", f"{r['calls']:,}", f"{r['kernels']:,}", f"{r['build_s']:.2f}",
                         f"{r['align_s']:.2f}", f"{r['table_s']:.2f}", f"{r['total_s']:.2f}",
                         f"{r['rss_before_mb']:,.0f} MB", f"{r['peak_rss_mb']:,.0f} MB", traced,
                         f"{r['precision']:.4f}", f"{r['recall']:.4f}", f"{r['f1']:.4f}", f"{r['ambiguous']:,}"])  # fmt: skip
            print(f"{mode} {size:,}: {r['total_s']:.1f} s, peak RSS {r['peak_rss_mb']:,.0f} MB", flush=True)
            if r["stages"]:
                stage_lines.append(f"{mode} {size:,}: " + ", ".join(
                    f"{name} {t:.2f} s" + (f" ({n} calls)" if n > 1 else "") + f" [peak {p:,.0f} MB]"
                    for name, (n, t, p) in r["stages"].items()))
    print()
    print(_table(header, rows))
    if notes:
        print("\n".join(notes))
    if stage_lines:
        print("\nsteps (wall time inside the call, [process peak RSS during the step]):\n" + "\n".join(stage_lines))
    clock = _sizes(args.clock_rows)
    if clock:
        crow = []
        for n in clock:
            r = run_child("clock", {"rows": n}, args.in_process)
            crow.append([f"{r['rows']:,}", f"{r['wall_s']:.2f}", f"{r['rss_before_mb']:,.0f} MB",
                         f"{r['peak_rss_mb']:,.0f} MB", str(r["solver"]), f"{r['max_offset_err_ns']:.0f}"])  # fmt: skip
        print()
        print(_table(["clock rows (8 domains)", "estimate s", "RSS before", "peak RSS", "solver",
                      "max offset error ns"], crow))  # fmt: skip
    print(f"\nbenchmark wall time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
