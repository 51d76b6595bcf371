"""All nccltrace benchmarks behind one command; prints one table of figures.

    python benchmarks/run_benchmarks.py [--quick] [--only SECTION,...] [--json FILE]
                                        [--cores N] [--workdir DIR]

Sections (``--only`` takes a comma list of these names):

parse      NCCL log parser throughput on one large rank-0 log (``bench_parse.write_log``: the
           exact format of ``NcclLogWriter``, TP8/PP4/DP8 Megatron-like, TUNING after every
           collective), beside ``grep -c opCount`` on the same file: MB/s per core (process CPU
           time), lines/s and calls/s, peak RSS; the parser runs in a fresh interpreter after a
           warm-up that loads the compiled kernels. Full 1000 MB, quick 20 MB.
kineto     PyTorch-profiler trace JSON: ``KinetoTrace.open`` (streaming, typed, exact times) against
           ``json.load`` and msgspec's whole-document decode on one large trace (the real capture's
           rank-0 events tiled), each in a fresh interpreter: MB/s per core, peak RSS. Full 1000 MB,
           quick 20 MB.
sources    Evidence sources without NCCL logs: a profiler trace of the real capture's four ranks
           (their events tiled, times and ids shifted per copy) read by ``KinetoTrace.open`` with
           ProcessGroupNCCL's ``record_param_comms`` records kept (MB/s per core), then the call
           rows made from it (``kineto.comm_calls.profiler_call_records``, rows/s per core), each
           in a fresh interpreter. Full 100 MB, quick 20 MB.
nsys       Nsight Systems export reading on a synthetic export written with ``NsysExportWriter``
           (schema 3.16.1 = nsys 2024.6, 8 processes of one node, per process NCCL kernels and as
           many compute kernels, a runtime launch row per kernel, an NCCL-domain NVTX range with
           a binary payload per NCCL kernel): ``NsysExport.kernels``, ``iter_kernels``,
           ``nvtx`` and ``export_tables`` (what the parse_nsys rule runs), each in a fresh
           interpreter. Full 10^6 NCCL kernels (2*10^6 kernel rows), quick 5*10^4.
align      Per-process alignment time and peak RSS (``bench_align``'s synthetic process with known
           truth; default mode, and thesis mode where under its cell limit). Full 10^4, 10^5,
           10^6 ops per process, each in a fresh interpreter; quick 10^3, 10^4 in this one.
clocksync  ``estimate_clock_model`` on synthetic collective instances (``bench_align``'s clock
           frame). Full 10^5 rows/8 nodes, 10^6/16, 10^7/64; quick 10^4/8, 10^5/8.
trace      Chrome trace export through ``write_run_traces`` (what the workflow's trace rule
           calls) on a run directory whose tables are an emulated, analysed 8-rank run (TP2 PP2
           DP2) repeated in time to the target op count. Full 10^5 and 10^6 ops, quick 10^4.
stages     The run-level stages (metrics, volume, trace, report: ``nccltrace.stages``, as their
           rules call them), each in a fresh interpreter, on the same tiled run: time, peak RSS
           and peak RSS per op (what sets the rules' mem_mb). Full 10^6 and 4*10^6 ops, quick 10^5.
scaling    Peak RSS and time of each run-level stage against the number of ranks, at a constant
           amount of work per rank: the scale-1024 campaign's run shape (TP8/SP, PP8, VPP2, 10
           iterations, 8 micro-batches per pipeline, NCCL 2.28) on 8, 32 and 128 nodes = 64, 256
           and 1024 ranks (quick: TP2 PP2 VPP2 on 1 and 2 four-GPU nodes), emulated and analysed
           through the ops table in this process, then each stage in a fresh interpreter. With
           ``--baseline REV`` the same stages of git revision REV run on the same run first
           ("today vs new, same machine, same run").
e2e        The Snakemake workflow end to end (``snakemake --cores N``, ``--directory`` a scratch
           directory so nothing lands in the repository's results/): wall time, jobs, peak memory
           (Snakemake's benchmark TSVs, the head process and the whole process tree) and per-rule
           time and RSS. Full: config/config.yaml, benchmarks/campaigns/scale-64.yaml,
           scale-256.yaml and scale-1024.yaml (missing files are skipped); quick: a 2-node x 4-GPU TP4 PP2,
           3-iteration campaign derived from scale-64.yaml.
rerun      What a code change re-runs: on a finished campaign (full: the example campaign; quick:
           e2e's bench-quick, or run here), each module of src/nccltrace in turn (quick: three)
           gets a one-line change of its syntax tree (a new constant), a dry run counts the jobs
           Snakemake schedules, per rule, with its records of the jobs (.snakemake/metadata)
           and without, and the change is reverted; nothing else is restored between modules
           (dry runs write nothing: checked on every file under results/ at the end). Beside
           it, the analysis re-run under a call tracer says which of the rules a module's
           change re-runs ever call its code, with the import chain that puts it in the
           stage's code hash (code_stamps.import_chain).

Full mode takes a long time and is run by hand; ``--quick`` is for CI. Prints figures only and
asserts nothing about speed; exits non-zero only when a benchmark itself fails (the other
sections still run). ``--json FILE`` also writes every figure (with the machine description)
as JSON. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import math
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import bench_align
import bench_parse

SECTIONS = ("parse", "nsys", "kineto", "sources", "align", "clocksync", "ranks", "trace", "stages", "scaling", "e2e",
            "rerun")  # fmt: skip

# --------------------------------------------------------------------------- figures


@dataclass
class Figure:
    section: str
    case: str
    figure: str
    value: float
    unit: str
    show: bool = True  # printed in the table (all figures go to the JSON)


@dataclass
class Section:
    name: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0
    tables: list[dict[str, Any]] = field(default_factory=list)  # printed after the figures (title, header, rows)

    def table(self, title: str, header: list[str], rows: list[list[str]]) -> None:
        self.tables.append({"title": title, "header": header, "rows": rows})

    def add(self, case: str, figure: str, value: float, unit: str = "", *, show: bool = True) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            self.notes.append(f"{case}: {figure} is not a finite number ({value}); left out")
            return
        self.figures.append(Figure(self.name, case, figure, value, unit, show))


@dataclass
class Context:
    quick: bool
    work: Path
    cores: int
    keep: bool = False  # keep e2e results (--workdir)
    campaigns: set[str] | None = None  # e2e full mode: only these (--campaigns)
    baseline: str | None = None  # scaling: git revision measured beside this checkout (--baseline)
    sections: tuple[str, ...] = ()  # the sections this invocation runs
    finished: dict[str, Path] = field(default_factory=dict)  # campaign -> its finished directory (e2e, for rerun)


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _fmt(v: float, unit: str = "-") -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if unit == "":  # a share or score in 0..1
        return f"{v:.4f}"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    if a == 0:
        return "0"
    return f"{v:.3g}"


def _mb(n_bytes: float) -> float:
    return n_bytes / 1e6


def _sizes_label(n: int) -> str:
    """10000 -> '1e4'; 50000 -> '5e4'."""
    e = math.floor(math.log10(n)) if n > 0 else 0
    m = n / 10**e
    return f"1e{e}" if m == 1 else f"{m:g}e{e}"


# --------------------------------------------------------------------------- children


def _child_cmd(kind: str, cfg: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(cfg)]


def run_child(kind: str, cfg: dict[str, Any], timeout: float | None = None,
              env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """One measurement in a fresh interpreter (its peak RSS is its own); returns its JSON figures.
    ``env``: variables added to the child's environment (PYTHONPATH of a baseline's sources)."""
    proc = subprocess.run(_child_cmd(kind, cfg), capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **env} if env else None)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {kind} {cfg} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure(fn: Callable[[], Any]) -> tuple[Any, float, float, float]:
    """(result, wall s, RSS before MB, peak RSS MB during the call) in this process."""
    import gc

    gc.collect()
    before = bench_align.rss_mb()
    bench_align.reset_peak_rss()
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    return out, wall, before, max(bench_align.peak_rss_mb(), before)


def child_nsys(cfg: dict[str, Any]) -> dict[str, Any]:
    """One reader call on an export: kernels, iter_kernels, nvtx or export_tables."""
    from nccltrace.nsys.reader import NsysExport

    op, path = cfg["op"], Path(cfg["path"])
    t0 = time.perf_counter()
    exp = NsysExport.open(path)
    open_s = time.perf_counter() - t0
    if op == "kernels":
        fn = lambda: len(exp.kernels())
    elif op == "iter_kernels":
        fn = lambda: sum(len(f) for f in exp.iter_kernels())
    elif op == "nvtx":
        fn = lambda: len(exp.nvtx())
    elif op == "export_tables":

        def fn() -> int:
            paths = exp.export_tables(Path(cfg["out"]))
            import pyarrow.parquet as pq

            return pq.read_metadata(paths["kernels"]).num_rows + pq.read_metadata(paths["nvtx"]).num_rows
    else:
        raise ValueError(op)
    rows, wall, before, peak = _measure(fn)
    exp.close()
    return {"rows": rows, "wall_s": wall, "open_s": open_s, "rss_before_mb": before, "peak_rss_mb": peak}


def _gunzipped_size(path: Path) -> int:
    n = 0
    with gzip.open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            n += len(chunk)
    return n


def child_trace(cfg: dict[str, Any]) -> dict[str, Any]:
    """``write_run_traces`` on a run directory: every op uncapped (``workflow: false``), or as
    workflow/scripts/trace.py calls it with the default config (capped trace + summary)."""
    from nccltrace.outputs.perfetto import write_run_traces

    run_dir = Path(cfg["run_dir"])
    kw = {"max_events": 500_000, "summary": True, "summary_max_events": 200_000} if cfg.get("workflow") else {}
    res, wall, before, peak = _measure(lambda: write_run_traces(run_dir, run_dir / "trace", **kw))
    summaries = list(res) if isinstance(res, (list, tuple)) else [res]
    files = [Path(s.path) for s in summaries]
    gz = sum(p.stat().st_size for p in files)
    raw = 0
    for s, p in zip(summaries, files):
        raw += getattr(s, "json_bytes", 0) or _gunzipped_size(p)
    return {"files": len(files), "events": int(sum(s.events for s in summaries)), "gz_bytes": gz, "json_bytes": raw,
            "write_s": float(sum(getattr(s, "seconds", 0.0) or 0.0 for s in summaries)), "wall_s": wall,
            "rss_before_mb": before, "peak_rss_mb": peak, "truncated": any(s.truncated for s in summaries),
            "notes": [n for s in summaries for n in s.notes][:5]}  # fmt: skip


def child_stage(cfg: dict[str, Any]) -> dict[str, Any]:
    """One run-level stage of ``nccltrace.stages`` (what its rule runs) on a run directory."""
    import yaml

    from nccltrace.core.layout import RunLayout
    from nccltrace.stages.metrics import run_metrics
    from nccltrace.stages.ops import run_ops
    from nccltrace.stages.report import run_report
    from nccltrace.stages.trace import run_trace
    from nccltrace.stages.volume import run_volume

    layout = RunLayout(cfg["run_dir"])
    if hasattr(layout, "find_processes"):
        procs, hosts = layout.find_processes(), layout.find_hosts()
    else:  # a --baseline revision from before the per-node layout (parsed/nccl/<proc>/)
        procs = sorted(p.name for p in (layout.root / "parsed" / "nccl").iterdir() if p.is_dir())
        hosts = sorted(p.name for p in (layout.root / "parsed" / "nsys").iterdir() if p.is_dir())
    run_yaml = Path(cfg["run_yaml"])
    calls = {
        "ops": lambda: run_ops(layout, procs, hosts, yaml.safe_load(run_yaml.read_text())["config"]),
        "metrics": lambda: run_metrics(layout, [layout.parsed_nccl(p) for p in procs]),
        "volume": lambda: run_volume(layout, "bench", None, run_yaml=run_yaml),
        "trace": lambda: run_trace(layout, None, procs, hosts),
        "report": lambda: run_report(layout, "bench", procs, hosts, run_yaml=run_yaml),
    }
    _res, wall, before, peak = _measure(calls[cfg["stage"]])
    return {"wall_s": wall, "cpu_s": time.process_time(), "rss_before_mb": before, "peak_rss_mb": peak}


def child_kineto(cfg: dict[str, Any]) -> dict[str, Any]:
    """One profiler-trace reader (``bench_kineto.run_reader``) on a trace file."""
    import bench_kineto

    return bench_kineto.run_reader(Path(cfg["path"]), cfg["how"])


def child_sources(cfg: dict[str, Any]) -> dict[str, Any]:
    """One step of the log-less sources (``bench_sources.run``: read or calls) on a trace file."""
    import bench_sources

    return bench_sources.run(Path(cfg["path"]), cfg["what"])


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"nsys": child_nsys, "trace": child_trace,
                                                                   "stage": child_stage, "kineto": child_kineto,
                                                                   "sources": child_sources}  # fmt: skip


# --------------------------------------------------------------------------- parse


def section_parse(sec: Section, ctx: Context) -> None:
    size_mb = 20.0 if ctx.quick else 1000.0
    d = ctx.work / "parse"
    d.mkdir(parents=True, exist_ok=True)
    log = d / f"nccl_{bench_parse.HOST}_{bench_parse.PID}.log"
    _log(f"parse: writing a {size_mb:.0f} MB log")
    t = time.perf_counter()
    size, _ = bench_parse.write_log(log, size_mb)
    gen_s = time.perf_counter() - t
    lines = 0
    with open(log, "rb") as fh:
        while chunk := fh.read(1 << 24):
            lines += chunk.count(b"\n")
    mb = _mb(size)
    label = f"{mb:,.0f} MB log"
    sec.notes.append(f"log written in {gen_s:.1f} s (NCCL {bench_parse.VERSION} format, TP8 PP4 DP8 rank 0)")

    # Warm-up: compile (or load) the kernels once, outside the measurement.
    warm = d / "warmup.log"
    with open(log, "rb") as fh:
        warm.write_bytes(fh.read(1 << 20).rsplit(b"\n", 1)[0] + b"\n")
    bench_parse.run_parser(warm, d / "tables-warmup", "fast")

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    grep = subprocess.run(["grep", "-c", "opCount", str(log)], check=True, capture_output=True, text=True)
    grep_wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    grep_cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    grep_count = int(grep.stdout.strip())

    _log("parse: parser run")
    r = bench_parse.run_parser(log, d / "tables", "fast")
    cpu = r["cpu"]
    case = f"log file ({label})"
    sec.add(case, "size", mb, "MB")
    sec.add(case, "lines", lines, "lines")
    sec.add(case, "call lines", r["calls"], "calls")
    case = f"grep -c opCount ({label})"
    sec.add(case, "wall time", grep_wall, "s")
    sec.add(case, "throughput (wall)", mb / grep_wall, "MB/s")
    if grep_cpu > 0:
        sec.add(case, "throughput per core (CPU time)", mb / grep_cpu, "MB/s")
    case = f"parser ({label})"
    sec.add(case, "wall time (excl. start-up)", r["wall"], "s")
    sec.add(case, "CPU time (excl. start-up)", cpu, "s")
    sec.add(case, "start-up CPU time (imports, cached kernels)", r["start_cpu"], "s", show=False)
    sec.add(case, "throughput per core (CPU time)", mb / cpu, "MB/s")
    sec.add(case, "throughput per core incl. start-up", mb / (cpu + r["start_cpu"]), "MB/s")
    sec.add(case, "throughput (wall)", mb / r["wall"], "MB/s")
    sec.add(case, "lines/s per core", lines / cpu, "lines/s")
    sec.add(case, "calls/s per core", r["calls"] / cpu, "calls/s")
    # grep's per-core speed over the parser's: how many times faster the plain scan is
    grep_speed = mb / (grep_cpu if grep_cpu > 0 else grep_wall)
    sec.add(case, "grep speed / parser speed (per core)", grep_speed / (mb / cpu), "x")
    sec.add(case, "peak RSS", r["maxrss_kb"] / 1024, "MiB")
    if r["calls"] != grep_count:
        sec.notes.append(f"parser found {r['calls']} call lines, grep counts {grep_count} opCount lines")
    shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- nsys

_NCCL_KERNELS = [  # short name, API, stream, grid (channels), share of the NCCL kernels, message bytes
    ("ncclDevKernel_AllGather_RING_LL", "AllGather", 13, 16, 0.40, 8 << 20),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "ReduceScatter", 13, 16, 0.40, 8 << 20),
    ("ncclDevKernel_SendRecv", "Send", 17, 8, 0.12, 64 << 20),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_SIMPLE", "ReduceScatter", 21, 32, 0.03, 160 << 20),
    ("ncclDevKernel_AllGather_RING_SIMPLE", "AllGather", 21, 32, 0.03, 80 << 20),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "AllReduce", 25, 2, 0.02, 8),
]
_NCCL_SIG = "(ncclDevComm*, unsigned long, ncclWork*)"
_GEMM = "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8"
_COMPUTE = (f"void cutlass::Kernel2<{_GEMM}>({_GEMM}::Params)", "cutlass::Kernel2")


def write_nsys_export(
    path: Path, n_nccl: int, *, procs: int = 8, batch: int = 200_000, seed: int = 0
) -> dict[str, int]:
    """A one-node export: ``n_nccl`` NCCL kernels over ``procs`` processes, a compute kernel
    launched before each, a runtime launch row per kernel and an NCCL NVTX range (NCCL 2.21.5
    binary payload) around each NCCL launch. Returns the row counts."""
    import numpy as np
    import pandas as pd

    from nccltrace.nsys.writer import NsysExportWriter

    rng = np.random.default_rng(seed)
    share = np.array([k[4] for k in _NCCL_KERNELS])
    share /= share.sum()
    short_names = np.array([k[0] for k in _NCCL_KERNELS], dtype=object)
    apis = np.array([k[1] for k in _NCCL_KERNELS], dtype=object)
    streams = np.array([k[2] for k in _NCCL_KERNELS])
    grids = np.array([k[3] for k in _NCCL_KERNELS])
    sizes = np.array([k[5] for k in _NCCL_KERNELS])
    per = -(-n_nccl // procs)
    counts = {"nccl_kernels": 0, "kernels": 0, "runtime": 0, "nvtx": 0}
    with NsysExportWriter(path, "3.16.1", hostname="node000", session_start_utc_ns=1_767_225_600_000_000_000,
                          payload_mode="blob") as w:  # fmt: skip
        for p in range(procs):
            pid = 20_000 + 13 * p
            w.add_process(pid, "python3")
            w.add_thread(pid, pid, "python3")
            w.add_gpu(p, name="NVIDIA A100-SXM4-80GB", bus_location=f"0000:{0x07 + 0x10 * p:02x}:00.0",
                      uuid=f"GPU-{p:08x}-0000-0000-0000-000000000000", pid=pid, cuda_id=p)  # fmt: skip
            dom = w.add_nvtx_domain(pid, pid, "NCCL", 1_000)
            w.add_nccl_payload_schemas(pid, dom, (2, 21, 5))
            done, t, corr = 0, 2_000_000, 100
            while done < per:
                n = min(batch, per - done)
                kind = rng.choice(len(_NCCL_KERNELS), n, p=share)
                launch = t + np.cumsum(rng.integers(20_000, 300_000, n))
                t = int(launch[-1]) + 1
                kstart = launch + 5_000 + rng.integers(0, 50_000, n)
                kdur = rng.integers(10_000, 200_000, n)
                ccorr = corr + 2 * np.arange(n)  # the compute kernel's launch, then the NCCL one
                ncorr = ccorr + 1
                corr = int(ncorr[-1]) + 1
                short = short_names[kind]
                common = {"device_id": p, "context_id": 1, "pid": pid, "grid_y": 1, "grid_z": 1, "block_y": 1,
                          "block_z": 1, "static_shared_memory": 0}  # fmt: skip
                nccl = pd.DataFrame({"start": kstart, "end": kstart + kdur, "stream_id": streams[kind],
                                     "correlation_id": ncorr, "name": pd.Series(short) + _NCCL_SIG, "short_name": short,
                                     "grid_x": grids[kind], "block_x": 512, "registers_per_thread": 96,
                                     "dynamic_shared_memory": 8704, **common})  # fmt: skip
                comp = pd.DataFrame({"start": launch - 15_000, "end": launch - 2_000, "stream_id": 7,
                                     "correlation_id": ccorr, "name": _COMPUTE[0], "short_name": _COMPUTE[1],
                                     "grid_x": 216, "block_x": 256, "registers_per_thread": 128,
                                     "dynamic_shared_memory": 49152, **common})  # fmt: skip
                w.add_kernels(pd.concat([comp, nccl], ignore_index=True).sort_values("start", kind="stable"))
                rt = pd.DataFrame({"start": np.concatenate([launch - 19_000, launch]),
                                   "end": np.concatenate([launch - 16_000, launch + 4_000]), "pid": pid, "tid": pid,
                                   "correlation_id": np.concatenate([ccorr, ncorr]),
                                   "name": ["cudaLaunchKernel_v7000"] * n + ["cuLaunchKernelEx"] * n,
                                   "event_class": 0})  # fmt: skip
                w.add_runtime(rt.sort_values("start", kind="stable"))
                api = apis[kind]
                payload = [{("Bytes" if a == "Send" else "Message size [bytes]"): int(b),
                            **({"Reduction operation": "sum"} if a in ("AllReduce", "ReduceScatter") else {}),
                            **({"Peer rank": 1} if a == "Send" else {})}
                           for a, b in zip(api, sizes[kind])]  # fmt: skip
                w.add_nvtx_ranges(pd.DataFrame({"start": launch - 3_000, "end": launch + 6_000, "pid": pid, "tid": pid,
                                                "text": "nccl" + pd.Series(api), "registered": True, "domain_id": dom,
                                                "event_type": 59, "nccl_payload": payload}))  # fmt: skip
                done += n
                counts["nccl_kernels"] += n
                counts["kernels"] += 2 * n
                counts["runtime"] += 2 * n
                counts["nvtx"] += n
    return counts


def section_nsys(sec: Section, ctx: Context) -> None:
    n = 50_000 if ctx.quick else 1_000_000
    d = ctx.work / "nsys"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "node000.sqlite"
    _log(f"nsys: writing an export with {n:,} NCCL kernels")
    t = time.perf_counter()
    counts = write_nsys_export(path, n)
    write_s = time.perf_counter() - t
    size = path.stat().st_size
    n_label = f"{_sizes_label(counts['nccl_kernels'])} NCCL kernels"
    rows_written = counts["kernels"] + counts["runtime"] + counts["nvtx"]
    case = f"export ({n_label})"
    sec.add(case, "size", _mb(size), "MB")
    sec.add(case, "kernel rows (NCCL + compute)", counts["kernels"], "rows")
    sec.add(case, "rows written/s (kernels + runtime + NVTX)", rows_written / write_s, "rows/s")
    what = {"kernels": "kernels()", "iter_kernels": "iter_kernels()", "nvtx": "nvtx()",
            "export_tables": "export_tables()"}  # fmt: skip
    for op, label in what.items():
        _log(f"nsys: {op}")
        r = run_child("nsys", {"op": op, "path": str(path), "out": str(d / "tables")})
        case = f"{label} ({n_label})"
        if op == "export_tables":
            sec.add(case, "time", r["wall_s"], "s")
            sec.add(case, "throughput (export file)", _mb(size) / r["wall_s"], "MB/s")
            sec.add(case, "rows/s (kernel + NVTX rows)", r["rows"] / r["wall_s"], "rows/s")
        else:
            sec.add(case, "rows", r["rows"], "rows")
            sec.add(case, "time", r["wall_s"], "s")
            sec.add(case, "rows/s", r["rows"] / r["wall_s"], "rows/s")
        sec.add(case, "peak RSS", r["peak_rss_mb"], "MiB")
    sec.notes.append(f"export written in {write_s:.1f} s; kernels() returns the NCCL kernels with their "
                     "launch rows; iter_kernels() streams 500k-row batches; nvtx() decodes the NCCL payloads; "
                     "export_tables() is what the parse_nsys rule runs (kernels, NVTX, processes, launches "
                     "without kernel, session)")  # fmt: skip
    shutil.rmtree(d, ignore_errors=True)


def section_kineto(sec: Section, ctx: Context) -> None:
    """PyTorch-profiler trace JSON: the streaming reader against ``json.load`` and msgspec's
    whole-document decode, each in a fresh interpreter (MB/s per core of CPU time, peak RSS)."""
    import bench_kineto

    mb = 20.0 if ctx.quick else 1000.0
    d = ctx.work / "kineto"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "trace.json"
    _log(f"kineto: writing a {mb:.0f} MB trace")
    info = bench_kineto.write_trace(path, mb)
    size = _mb(info["bytes"])
    label = f"{size:,.0f} MB trace"
    sec.notes.append(f"trace: {info['copies']} copies of the {'real H200 capture' if info['real_seed'] else 'synthetic'}"
                     " rank-0 trace's events")
    readers = ["nccltrace", "msgspec-whole", "json"]
    for how in readers:
        _log(f"kineto: {how}")
        r = run_child("kineto", {"path": str(path), "how": how})
        case = f"{how} ({label})"
        sec.add(case, "time", r["wall_s"], "s")
        sec.add(case, "throughput per core (CPU time)", size / max(r["cpu_s"], 1e-9), "MB/s")
        sec.add(case, "peak RSS", r["peak_rss_mb"], "MiB")
        sec.add(case, "NCCL kernels", r["kernels"], "kernels", show=False)
    sec.notes.append("nccltrace = KinetoTrace.open (streamed in 8 MB blocks, typed msgspec decode, exact "
                     "decimal times, the tables' rows); msgspec-whole and json decode the whole document into "
                     "Python objects and only count the NCCL kernels")
    shutil.rmtree(d, ignore_errors=True)


def section_sources(sec: Section, ctx: Context) -> None:
    """Evidence sources without NCCL logs: the profiler trace read with ProcessGroupNCCL's call
    records kept (MB/s per core of CPU time), and the call rows made from it (rows/s per core),
    each in a fresh interpreter."""
    import bench_sources

    mb = 20.0 if ctx.quick else 100.0
    d = ctx.work / "sources"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "trace.json"
    _log(f"sources: writing a {mb:.0f} MB profiler trace")
    info = bench_sources.write_trace(path, mb)
    size = _mb(info["bytes"])
    case = f"profiler trace ({size:,.0f} MB)"
    _log("sources: read")
    r = run_child("sources", {"path": str(path), "what": "read"})
    sec.add(case, "read time", r["wall_s"], "s")
    sec.add(case, "read throughput per core (CPU time)", size / max(r["cpu_s"], 1e-9), "MB/s")
    sec.add(case, "read peak RSS", r["peak_rss_mb"], "MiB")
    sec.add(case, "NCCL kernels", r["kernels"], "kernels", show=False)
    sec.add(case, "record_param_comms records", r["comm_records"], "records", show=False)
    _log("sources: call rows")
    c = run_child("sources", {"path": str(path), "what": "calls"})
    sec.add(case, "call rows time", c["wall_s"], "s")
    sec.add(case, "call rows per core (CPU time)", c["rows"] / max(c["cpu_s"], 1e-9), "rows/s")
    sec.add(case, "call rows", c["rows"], "rows", show=False)
    sec.add(case, "call rows with their kernel", c["linked"], "rows", show=False)
    sec.notes.append(f"trace: {info['copies']} copies of the real H200 capture's {info['ranks']} rank traces' events "
                     "in one file (each copy 10 s later, with fresh correlation and External ids)")
    sec.notes.append("read = KinetoTrace.open (streamed, typed msgspec decode, exact decimal times; NCCL kernels, "
                     "launches, ranges and record_param_comms kept); call rows = profiler_call_records per process "
                     f"(after the read); {c['messages']} message(s)")
    shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- align and clock sync


def section_align(sec: Section, ctx: Context) -> None:
    from nccltrace.align.thesis import ThesisParams

    sizes = [1_000, 10_000] if ctx.quick else [10_000, 100_000, 1_000_000]
    limit = ThesisParams().cell_limit
    for size in sizes:
        for mode in ("default", "thesis"):
            cfg = {"mode": mode, "size": size, "drop_log_lines": 0.0, "drop_kernels": 0.0, "timestamps": True,
                   "seed": 1, "traced": False, "stages": False}  # fmt: skip
            if mode == "thesis":
                probe = bench_align.make_instance(size, seed=1)
                cells = len(probe.calls) * len(probe.kernels)
                if cells > limit:
                    sec.notes.append(f"thesis {size:,} ops skipped: {cells:.2g} cells > ThesisParams.cell_limit "
                                     f"{limit:.2g}")  # fmt: skip
                    continue
            _log(f"align: {mode} {size:,}")
            r = bench_align.run_child("align", cfg, in_process=ctx.quick)
            case = f"{mode}, {_sizes_label(size)} ops/process"
            sec.add(case, "kernels", r["kernels"], "kernels", show=False)
            sec.add(case, "total time (build + align + table)", r["total_s"], "s")
            sec.add(case, "core alignment time", r["align_s"], "s", show=False)
            sec.add(case, "throughput", r["calls"] / r["total_s"], "ops/s")
            sec.add(case, "RSS before", r["rss_before_mb"], "MiB", show=False)
            sec.add(case, "peak RSS", r["peak_rss_mb"], "MiB")
            sec.add(case, "F1 against the truth", r["f1"], "")
    sec.notes.append("measured in this interpreter (quick mode: RSS includes earlier cases)" if ctx.quick
                     else "one fresh interpreter per case")  # fmt: skip


def section_clocksync(sec: Section, ctx: Context) -> None:
    cases = [(10_000, 8), (100_000, 8)] if ctx.quick else [(100_000, 8), (1_000_000, 16), (10_000_000, 64)]
    for rows, domains in cases:
        _log(f"clocksync: {rows:,} rows, {domains} nodes")
        r = bench_align.run_child("clock", {"rows": rows, "domains": domains}, in_process=ctx.quick)
        case = f"{_sizes_label(rows)} instance rows, {r.get('domains', domains)} nodes"
        sec.add(case, "estimate_clock_model time", r["wall_s"], "s")
        sec.add(case, "throughput", r["rows"] / r["wall_s"], "rows/s")
        sec.add(case, "peak RSS", r["peak_rss_mb"], "MiB")
        sec.add(case, "max offset error", r["max_offset_err_ns"], "ns")
        sec.notes.append(f"{case}: solver {r['solver']}")


def section_ranks(sec: Section, ctx: Context) -> None:
    """Global ranks from the communicators' structure (no world communicator): a lazily created
    job's tp/pp/dp communicators, processes in random order, solved with the sizes declared and
    without them."""
    import random

    from nccltrace.megatron.groups import megatron_groups
    from nccltrace.megatron.rank_structure import ORDER_SETTING, solve_global_ranks
    from nccltrace.megatron.sizes import ParallelSizes

    cases = [(64, 8, 1), (512, 8, 4)] if ctx.quick else [(512, 8, 4), (4096, 8, 1), (4096, 8, 8)]
    for world, tp, pp in cases:
        sizes = ParallelSizes(tp=tp, pp=pp, world_size=world)
        groups = megatron_groups(sizes)
        names = random.Random(world).sample(range(1 << 22), world)
        comms = [[names[r] for r in g] for k in ("tp", "pp", "dp") for g in groups[k] if len(g) > 1]
        truth = {names[r]: r for r in range(world)}
        case = f"{world} ranks tp{tp}·pp{pp}·dp{sizes.dp}, {len(comms)} communicators"
        for how, settings in (("declared", {"tp": tp, "pp": pp, ORDER_SETTING: False}), ("free", None)):
            _log(f"ranks: {case}, {how}")
            t0 = time.perf_counter()
            sol = solve_global_ranks(sorted(names), comms, settings)
            sec.add(case, f"solve time, sizes {how}", time.perf_counter() - t0, "s")
            sec.add(case, f"layouts tried, sizes {how}", max(sol.tried, 1), "", show=False)
            verdict = ("right" if sol.ranks == truth else "WRONG") if sol.ranks else (
                "undecided (budget)" if sol.exhausted else f"{sol.fits}+ fit")
            sec.notes.append(f"{case}, sizes {how}: {verdict}")


# --------------------------------------------------------------------------- trace


def _seed_run(d: Path) -> Path:
    """An emulated 8-rank run (2 nodes x 4 GPUs, TP2 PP2 DP2, distributed optimizer), analysed
    like the workflow does (parse, align, communicators, ops, metrics); returns its run dir."""
    from nccltrace.analyze import analyze_run
    from nccltrace.core.layout import RunLayout
    from nccltrace.core.tables import read_table
    from nccltrace.emulator.run import emulate_run
    from nccltrace.metrics.compute import compute_run_metrics, write_run_metrics

    cfg = {"model": "bench", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 512,
           "micro_batch_size": 1, "global_batch_size": 8, "iterations": 2, "nodes": 2, "gpus_per_node": 4, "tp": 2,
           "pp": 2, "sequence_parallel": True, "distributed_optimizer": True, "precision": "bf16", "seed": 5,
           "nccl_version": "2.21.5", "nsys_version": "2024.6",
           "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1}}  # fmt: skip
    emulate_run(cfg, d / "raw")
    run = d / "run"
    analyze_run(d / "raw", run, progress=False)
    layout = RunLayout(run)
    result = compute_run_metrics(read_table(layout.ops), [layout.parsed_nccl(p) for p in layout.find_processes()],
                                 read_table(run / "communicators" / "communicators.parquet"))  # fmt: skip
    write_run_metrics(result, run / "metrics")
    return run


def _max_of(paths: list[Path], column: str) -> int:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    best = 0
    for p in paths:
        if column in pq.read_schema(p).names:
            v = pc.max(pq.read_table(p, columns=[column])[column]).as_py()
            if v is not None:
                best = max(best, int(v))
    return best


def _tile_table(src: Path, dst: Path, copies: int, shifts: dict[str, int], *, group: list[str] | None = None,
                instance_step: int = 0) -> int:  # fmt: skip
    """Write ``copies`` repetitions of a Parquet table; copy k adds k * shift to each column in
    ``shifts``. With ``group``, rows stay contiguous per run of equal ``group`` values (one
    process's rows together, copies in order). ``instance_step`` renumbers instance keys
    ('<lid>:<n>' / '<lid>#<n>') by k * step. Returns the rows written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    t = pq.read_table(src)
    n = t.num_rows
    inst_prefix = inst_num = None
    if instance_step and "instance" in t.column_names:
        s = t["instance"].to_pandas()
        parts = s.str.extract(r"^(.*[:#])(\d+)$")
        inst_prefix = pa.array(parts[0], type=pa.string(), from_pandas=True)
        inst_num = pa.array(parts[1].astype("float64"), from_pandas=True).cast(pa.int64())
    pieces = []
    for k in range(copies):
        cols = {}
        for name in t.column_names:
            c = t[name]
            if k and name in shifts and shifts[name]:
                c = pc.add(c, pa.scalar(k * shifts[name], c.type))
            elif k and name == "instance" and inst_prefix is not None:
                c = pc.binary_join_element_wise(inst_prefix, pc.cast(pc.add(inst_num, k * instance_step), pa.string()),
                                                "")  # fmt: skip
            cols[name] = c
        pieces.append(pa.table(cols, schema=t.schema) if k else t)
    big = pa.concat_tables(pieces)
    if group and n:
        keys = t.select(group).to_pandas().astype(str).agg("\x1f".join, axis=1).to_numpy()
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        bounds = np.r_[starts, n]
        order = np.concatenate([np.arange(a, b) + k * n for a, b in itertools.pairwise(bounds) for k in range(copies)])
        big = big.take(pa.array(order))
    dst.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(big, dst)
    return big.num_rows


def tile_run(seed: Path, dest: Path, n_ops: int) -> int:
    """A run directory with the seed run's trace inputs repeated in time until it has at least
    ``n_ops`` call rows; lines, opCounts, launch units, correlation ids and instance keys stay
    unique. Returns the number of call rows."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from nccltrace.core.layout import RunLayout

    ops_t = pq.read_table(seed / "ops" / "ops.parquet")
    n_call = int(pc.sum(pc.equal(ops_t["row_kind"], "call")).as_py())
    copies = max(1, math.ceil(n_ops / n_call))
    t0 = int(pc.min(ops_t["kernel_start_utc"]).as_py())
    t1 = int(pc.max(ops_t["kernel_end_utc"]).as_py())
    span = (t1 - t0) + 1_000_000_000  # the next copy starts 1 s after the previous one ends
    kernels = sorted((seed / "parsed" / "nsys").glob("*/kernels.parquet"))
    calls = [RunLayout(seed).parsed_nccl_table(p, "calls") for p in RunLayout(seed).find_processes()]
    L = max(_max_of([seed / "ops" / "ops.parquet", *calls], "line"), 0) + 1
    C = max(_max_of(kernels, "correlation_id"), _max_of([seed / "ops" / "ops.parquet"], "kernel_correlation_id")) + 1
    OC = max(_max_of([seed / "ops" / "ops.parquet", *calls], "op_count"), 0) + 1
    U = _max_of([seed / "ops" / "ops.parquet"], "unit") + 1
    inst = pc.extract_regex(pc.drop_null(ops_t["instance"]), r"^.*[:#](?P<n>\d+)$")
    inst_step = max((int(x["n"]) for x in inst.to_pylist() if x), default=0) + 1
    times = ["kernel_start", "kernel_end", "launch_start", "kernel_start_utc", "kernel_end_utc", "kernel_start_sync",
             "kernel_end_sync"]  # fmt: skip
    shifts = {c: span for c in times} | {"line": L, "duplicate_of": L, "op_count": OC, "unit": U,
                                         "kernel_correlation_id": C}  # fmt: skip
    _tile_table(seed / "ops" / "ops.parquet", dest / "ops" / "ops.parquet", copies, shifts, group=["host", "pid"],
                instance_step=inst_step)  # fmt: skip
    shutil.copy2(seed / "ops" / "parallelism.parquet", dest / "ops" / "parallelism.parquet")
    _tile_table(seed / "metrics" / "op_metrics.parquet", dest / "metrics" / "op_metrics.parquet", copies,
                {"line": L}, group=["file"])  # fmt: skip
    for k in kernels:
        out = dest / k.relative_to(seed)
        _tile_table(k, out, copies, {"start": span, "end": span, "launch_start": span, "launch_end": span,
                                     "correlation_id": C})  # fmt: skip
        nv = k.with_name("nvtx.parquet")
        if nv.is_file():
            _tile_table(nv, out.with_name("nvtx.parquet"), copies, {"start": span, "end": span})
        for extra in ("session.json", "processes.parquet"):
            if k.with_name(extra).is_file():
                shutil.copy2(k.with_name(extra), out.with_name(extra))
    for c in calls:
        _tile_table(c, dest / c.relative_to(seed), copies, {"line": L, "op_count": OC})
    return copies * n_call


def section_trace(sec: Section, ctx: Context) -> None:
    sizes = [10_000] if ctx.quick else [100_000, 1_000_000]
    d = ctx.work / "trace"
    d.mkdir(parents=True, exist_ok=True)
    _log("trace: emulating and analysing the seed run")
    t = time.perf_counter()
    seed = _seed_run(d / "seed")
    sec.notes.append(
        f"seed run (8 ranks TP2 PP2 DP2, 2 iterations) emulated and analysed in {time.perf_counter() - t:.0f} s"
    )
    for size in sizes:
        run = d / f"run-{size}"
        _log(f"trace: {size:,} ops")
        n_calls = tile_run(seed, run, size)
        for workflow in (False, True):
            _trace_case(sec, run, n_calls, workflow, f"{_sizes_label(size)} ops (8 ranks)"
                        + (", workflow: capped 5e5 + summary" if workflow else ", every op"))
        shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(d, ignore_errors=True)


def _trace_case(sec: Section, run: Path, n_calls: int, workflow: bool, case: str) -> None:
    shutil.rmtree(run / "trace", ignore_errors=True)
    r = run_child("trace", {"run_dir": str(run), "workflow": workflow})
    sec.add(case, "ops (call rows)", n_calls, "ops")
    sec.add(case, "events", r["events"], "events")
    sec.add(case, "files", r["files"], "files", show=False)
    sec.add(case, "gzip size", _mb(r["gz_bytes"]), "MB")
    sec.add(case, "uncompressed JSON size", _mb(r["json_bytes"]), "MB")
    sec.add(case, "gzip bytes per op", r["gz_bytes"] / n_calls, "B/op")
    sec.add(case, "compression ratio", r["json_bytes"] / r["gz_bytes"], "x", show=False)
    sec.add(case, "write_run_traces time (load + prepare + write)", r["wall_s"], "s")
    if r["write_s"] > 0:
        sec.add(case, "of which writing", r["write_s"], "s", show=False)
    sec.add(case, "throughput", n_calls / r["wall_s"], "ops/s")
    sec.add(case, "peak RSS", r["peak_rss_mb"], "MiB")
    if r["truncated"]:
        sec.notes.append(f"{case}: trace truncated by the exporter's limits")
    sec.notes += [f"{case}: {n}" for n in r["notes"]]


RUN_STAGES = ("metrics", "volume", "trace", "report")
# the ops stage needs each process's alignment, which the tiled runs of section_stages lack
SCALING_STAGES = ("ops", *RUN_STAGES)


def section_stages(sec: Section, ctx: Context) -> None:
    """Time and peak RSS of each run-level stage, each in a fresh interpreter, on the seed run
    repeated in time to the target op count: the per-row memory cost that sets a rule's
    ``mem_mb`` and decides what a large run needs."""
    sizes = [100_000] if ctx.quick else [1_000_000, 4_000_000]
    d = ctx.work / "stages"
    d.mkdir(parents=True, exist_ok=True)
    _log("stages: emulating and analysing the seed run")
    seed = _seed_run(d / "seed")
    for size in sizes:
        run = d / f"run-{size}"
        _log(f"stages: {size:,} ops")
        n_calls = tile_run(seed, run, size)
        for src in sorted(p for p in seed.rglob("*") if p.is_file()):
            dst = run / src.relative_to(seed)
            if not dst.exists() and "metrics" not in src.parts and "trace" not in src.parts:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        (run / "metrics" / "op_metrics.parquet").unlink(missing_ok=True)
        case = f"{_sizes_label(size)} ops (8 ranks)"
        sec.add(case, "ops (call rows)", n_calls, "ops")
        for stage in RUN_STAGES:
            r = run_child("stage", {"run_dir": str(run), "stage": stage, "run_yaml": str(seed.parent / "raw" / "run.yaml")})
            sec.add(case, f"{stage} time", r["wall_s"], "s")
            sec.add(case, f"{stage} peak RSS", r["peak_rss_mb"], "MiB")
            # above the interpreter's start (imports): what the op count costs
            growth = (r["peak_rss_mb"] - r["rss_before_mb"]) * 2**20 / n_calls
            if growth > 0:
                sec.add(case, f"{stage} peak RSS per op", growth, "B/op")
            else:
                sec.notes.append(f"{case}: {stage} peak RSS did not grow above the imports")
        shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(d, ignore_errors=True)


def _scaling_run(d: Path, nodes: int, quick: bool) -> Path:
    """Emulate and analyse (through the ops table) one run of the scaling shape; its run dir."""
    from nccltrace.analyze import analyze_run
    from nccltrace.emulator.run import emulate_run

    if quick:
        shape = {"tp": 2, "pp": 2, "vpp": 2, "gpus_per_node": 4, "num_layers": 4, "hidden_size": 256,
                 "num_attention_heads": 8, "seq_length": 512, "iterations": 2}  # fmt: skip
    else:
        shape = {"tp": 8, "pp": 8, "vpp": 2, "gpus_per_node": 8, "num_layers": 16, "hidden_size": 2048,
                 "num_attention_heads": 16, "seq_length": 2048, "iterations": 10, "hardware": "h100"}
    ranks = nodes * shape["gpus_per_node"]
    dp = ranks // (shape["tp"] * shape["pp"])
    cfg = {**shape, "name": f"scaling-{ranks}", "nodes": nodes, "sequence_parallel": True,
           "micro_batch_size": 1, "global_batch_size": 8 * dp, "precision": "bf16", "nccl_version": "2.28.3",
           "nsys_version": "2024.6", "init_style": "split", "seed": 1,
           "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1}}  # fmt: skip
    emulate_run(cfg, d / "raw")
    analyze_run(d / "raw", d / "run", progress=False, until="ops")
    return d / "run"


def _baseline_src(rev: str, dest: Path) -> Path:
    """The package sources of git revision ``rev`` (for the baseline's children's PYTHONPATH)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", rev, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "src"


def _per_process_view(run: Path, dest: Path) -> Path:
    """``run`` (per-node layout: parsed/nccl/<host>/<proc>/, aligned/<host>/<proc>/) seen in the
    per-process layout of revisions before it, through symbolic links; the run-level stages'
    output directories are the view's own. For a --baseline revision's stages."""
    from nccltrace.core.layout import RunLayout

    layout = RunLayout(run)
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "parsed" / "nccl").mkdir(parents=True)
    (dest / "aligned").mkdir()
    for name in ("raw", "communicators"):
        if (run / name).exists():
            (dest / name).symlink_to((run / name).resolve())
    # the view's ops stage replaces these links with its own tables, never the run's
    (dest / "ops").mkdir()
    for f in (run / "ops").iterdir():
        (dest / "ops" / f.name).symlink_to(f.resolve())
    (dest / "parsed" / "nsys").symlink_to((run / "parsed" / "nsys").resolve())
    for f in (run / "parsed").iterdir():
        if f.is_file():
            (dest / "parsed" / f.name).symlink_to(f.resolve())
    for proc in layout.find_processes():
        (dest / "parsed" / "nccl" / proc).symlink_to(layout.parsed_nccl(proc).resolve())
        if layout.aligned(proc).is_dir():
            (dest / "aligned" / proc).symlink_to(layout.aligned(proc).resolve())
    return dest


def section_scaling(sec: Section, ctx: Context) -> None:
    """Peak RSS of each run-level stage at 64, 256 and 1024 ranks (constant work per rank)."""
    from nccltrace.core.layout import RunLayout

    nodes = [1, 2] if ctx.quick else [8, 32, 128]
    d = ctx.work / "scaling"
    baseline = _baseline_src(ctx.baseline, d / "baseline") if ctx.baseline else None
    for n in nodes:
        _log(f"scaling: emulating and analysing {n} nodes")
        run = _scaling_run(d / f"n{n}", n, ctx.quick)
        import pyarrow.parquet as pq

        ops = pq.read_metadata(run / "ops" / "ops.parquet").num_rows
        ranks = len(RunLayout(run).find_processes())
        case = f"{ranks} ranks"
        sec.add(case, "ops rows", ops, "rows")
        cfg = {"run_dir": str(run), "run_yaml": str(run.parent / "raw" / "run.yaml")}
        view = _per_process_view(run, d / f"n{n}" / "baseline-view") if baseline is not None else None
        for stage in SCALING_STAGES:
            if baseline is not None:
                try:
                    r = run_child("stage", {**cfg, "run_dir": str(view), "stage": stage},
                                  env={"PYTHONPATH": str(baseline)})  # fmt: skip
                    sec.add(case, f"{stage} peak RSS, {ctx.baseline}", r["peak_rss_mb"], "MiB")
                except RuntimeError as e:
                    sec.notes.append(f"{case}: {stage} of {ctx.baseline} failed: {str(e).splitlines()[0]}")
            r = run_child("stage", {**cfg, "stage": stage})
            sec.add(case, f"{stage} peak RSS", r["peak_rss_mb"], "MiB")
            sec.add(case, f"{stage} time", r["wall_s"], "s")
        if not ctx.keep:
            shutil.rmtree(d / f"n{n}", ignore_errors=True)


# --------------------------------------------------------------------------- e2e


def quick_campaign() -> dict[str, Any]:
    """scale-64.yaml reduced to 2 nodes x 4 GPUs, TP4 (SP) PP2, 3 iterations, 8 micro-batches."""
    import yaml

    c = yaml.safe_load((HERE / "campaigns" / "scale-64.yaml").read_text())
    model = next(iter(c["models"]))
    hw = dict(next(iter(c["hardware"].values())))
    hw.update(nodes=2, gpus_per_node=4)
    c["campaign"] = "bench-quick"
    c["description"] = "scale-64.yaml reduced for run_benchmarks.py --quick: 8 ranks TP4/SP PP2, 3 iterations"
    c["defaults"].update(iterations=3, global_batch_size=8)
    c["hardware"] = {"quick": hw}
    c["matrix"] = [
        {"models": [model], "hardware": ["quick"], "parallelism": [{"tp": 4, "sequence_parallel": True, "pp": 2}]}
    ]
    c["exclude"] = []
    return c


class TreeMonitor:
    """Polls a process and its descendants (psutil): peak RSS of the head alone and peak of the
    summed RSS of the whole tree at one instant."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        import psutil

        self._psutil = psutil
        self.head = psutil.Process(pid)
        self.interval = interval
        self.head_peak = 0
        self.tree_peak = 0
        self.processes = 0
        self._seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ps = self._psutil
        while not self._stop.is_set():
            try:
                head = self.head.memory_info().rss
                procs = self.head.children(recursive=True)
            except (ps.NoSuchProcess, ps.ZombieProcess, ps.AccessDenied):
                break
            total = head
            for p in procs:
                try:
                    total += p.memory_info().rss
                    self._seen.add(p.pid)
                except (ps.NoSuchProcess, ps.ZombieProcess, ps.AccessDenied):
                    pass
            self.head_peak = max(self.head_peak, head)
            self.tree_peak = max(self.tree_peak, total)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.processes = len(self._seen)


def _read_benchmarks(results: Path) -> list[dict[str, Any]]:
    """One record per Snakemake benchmark TSV under results/<campaign>/: rule (the path below
    benchmarks/), wall s, max RSS MB, CPU s."""
    import pandas as pd

    out = []
    for p in sorted(results.rglob("benchmarks/**/*.tsv")):
        rel = p.relative_to(next(a for a in p.parents if a.name == "benchmarks"))
        rule = rel.parts[0].removesuffix(".tsv")
        df = pd.read_csv(p, sep="\t")
        for _, row in df.iterrows():
            out.append({"rule": rule, "file": str(p.relative_to(results)),
                        "s": float(pd.to_numeric(row.get("s"), errors="coerce")),
                        "max_rss": float(pd.to_numeric(row.get("max_rss"), errors="coerce")),
                        "cpu_time": float(pd.to_numeric(row.get("cpu_time"), errors="coerce"))})  # fmt: skip
    return out


def run_campaign(config: dict[str, Any], d: Path, cores: int, snakefile: Path = REPO / "Snakefile") -> dict[str, Any]:
    """``snakemake --cores N`` on ``config`` with ``--directory d``; wall time, exit status,
    peaks: head (polled), tree sum (polled), largest single process (wait4 of the head: the
    maximum over it and every descendant it reaped)."""
    import yaml

    d.mkdir(parents=True, exist_ok=True)
    cfg_path = d / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), "--directory", str(d),
           "--configfile", str(cfg_path), "--cores", str(cores)]  # fmt: skip
    with open(d / "snakemake.stdout", "w") as out, open(d / "snakemake.stderr", "w") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=d)
        mon = TreeMonitor(proc.pid)
        _, status, ru = os.wait4(proc.pid, 0)  # blocks; rusage of the head and all it reaped
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        mon.stop()
    stderr = (d / "snakemake.stderr").read_text(errors="replace")
    finished = re.findall(r"Finished jobid: \d+ \(Rule: ([^)]+)\)", stderr)
    steps = re.findall(r"(\d+) of (\d+) steps", stderr)
    return {"returncode": proc.returncode, "wall_s": wall, "max_process_rss_mb": ru.ru_maxrss / 1024,
            "cpu_s": ru.ru_utime + ru.ru_stime, "head_peak_mb": mon.head_peak / 2**20,
            "tree_peak_mb": mon.tree_peak / 2**20, "processes": mon.processes, "jobs_finished": len(finished),
            "steps": int(steps[-1][1]) if steps else 0, "stderr_tail": stderr[-3000:],
            "benchmarks": _read_benchmarks(d / "results" / str(config["campaign"]))}  # fmt: skip


PER_NODE_RULES = ("parse_node", "align_node")


def startup_cpu_s(rule: str) -> float:
    """CPU seconds a rule script spends before its work: a fresh interpreter importing
    Snakemake's script support and the rule's stage module (median of 3)."""
    code = f"import snakemake.script, nccltrace.stages.{rule}"
    runs = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", code], check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        runs.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return sorted(runs)[1]


def section_e2e(sec: Section, ctx: Context) -> None:
    import yaml

    if ctx.quick:
        cases = [("bench-quick", quick_campaign())]
    else:
        cases = []
        for label, path in (("example", REPO / "config" / "config.yaml"),
                            ("scale-64", HERE / "campaigns" / "scale-64.yaml"),
                            ("scale-256", HERE / "campaigns" / "scale-256.yaml"),
                            ("scale-1024", HERE / "campaigns" / "scale-1024.yaml")):  # fmt: skip
            if ctx.campaigns is not None and label not in ctx.campaigns:
                continue
            if not path.is_file():
                sec.notes.append(f"{label}: {path.relative_to(REPO)} not found; skipped")
                continue
            cases.append((label, yaml.safe_load(path.read_text())))
    failures = []
    for label, config in cases:
        d = ctx.work / "e2e" / str(config["campaign"])
        _log(f"e2e: {label} (snakemake --cores {ctx.cores} in {d})")
        r = run_campaign(config, d, ctx.cores)
        if r["returncode"] != 0:
            failures.append(f"{label}: snakemake exited {r['returncode']}:\n{r['stderr_tail']}")
            continue
        import pandas as pd

        b = pd.DataFrame(r["benchmarks"])
        case = label
        sec.add(case, "wall time", r["wall_s"], "s")
        sec.add(case, "jobs", r["jobs_finished"] or len(b), "jobs")
        sec.add(case, "CPU time (head + all jobs)", r["cpu_s"], "s")
        if len(b):
            sec.add(case, "summed job time (benchmark TSVs)", float(b["s"].sum()), "s")
            sec.add(case, "peak job RSS (benchmark max_rss)", float(b["max_rss"].max()), "MiB")
        sec.add(case, "Snakemake head peak RSS (polled)", r["head_peak_mb"], "MiB")
        sec.add(case, "largest single process RSS (wait4)", r["max_process_rss_mb"], "MiB")
        sec.add(case, "peak summed RSS of the process tree (polled)", r["tree_peak_mb"], "MiB")
        if len(b):
            per = b.groupby("rule").agg(jobs=("s", "size"), s=("s", "sum"), max_rss=("max_rss", "max"),
                                        cpu=("cpu_time", "sum")).sort_values("s", ascending=False)  # fmt: skip
            for i, (rule, row) in enumerate(per.iterrows()):
                show = i < 5
                rc = f"{case}: rule {rule}"
                sec.add(rc, "jobs", int(row["jobs"]), "jobs", show=show)
                sec.add(rc, "summed time", float(row["s"]), "s", show=show)
                sec.add(rc, "max RSS", float(row["max_rss"]), "MiB", show=show)
                if row["cpu"] > 0:
                    sec.add(rc, "summed CPU time", float(row["cpu"]), "s", show=False)
            # per-node jobs: how much of their CPU is starting the interpreter and importing
            for rule in PER_NODE_RULES:
                if rule in per.index and per.at[rule, "cpu"] > 0:
                    start = startup_cpu_s(rule)
                    share = min(1.0, start * per.at[rule, "jobs"] / per.at[rule, "cpu"])
                    sec.add(f"{case}: rule {rule}", "CPU per job", per.at[rule, "cpu"] / per.at[rule, "jobs"], "s")
                    sec.add(f"{case}: rule {rule}", "of which interpreter start + imports", start, "s")
                    sec.add(f"{case}: rule {rule}", "start-up share of its CPU", share, "")
        if "rerun" in ctx.sections and label == rerun_campaign(ctx.quick)[0]:
            ctx.finished[label] = d  # the rerun section starts from it (and removes it)
        elif not ctx.keep:
            shutil.rmtree(d, ignore_errors=True)
    sec.notes.append("peaks: 'polled' samples the head and its descendants every 0.2 s (psutil); 'wait4' is "
                     "the kernel's maximum RSS over the head and every process it reaped; benchmark max_rss "
                     "is Snakemake's per-job figure; per-rule rows show the 5 rules with most summed time "
                     "(all rules in --json)")  # fmt: skip
    if failures:
        raise RuntimeError("\n\n".join(failures))


# --------------------------------------------------------------------------- rerun

# a one-line change of a module's syntax tree (a comment would not count: modules are hashed by it)
RERUN_CHANGE = "\n\n_NCCLTRACE_BENCH_RERUN = 1  # benchmarks/run_benchmarks.py rerun: a new constant\n"
# quick mode: a module in two stages' code (one of them only imports it), one in one stage's (which
# calls it), one in none: the traced re-run is then of the metrics, ops and trace jobs only
QUICK_RERUN_MODULES = ("core/spill.py", "outputs/perfetto.py", "outputs/tables_doc.py")


def rerun_campaign(quick: bool) -> tuple[str, dict[str, Any]]:
    """The finished campaign the rerun section starts from: (its e2e label, its config)."""
    import yaml

    if quick:
        return "bench-quick", quick_campaign()
    return "example", yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def _workflow_copy(dest: Path) -> Path:
    """A copy of the workflow and the package (with their caches: compiled modules, numba's): the
    section edits the copy's modules, never the checkout's."""
    dest.mkdir(parents=True)
    for part in ("Snakefile", "workflow", "src", "config", "envs"):
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("*.egg-info"))
        elif src.is_file():
            shutil.copy2(src, dest / part)
    return dest


def job_table(output: str) -> dict[str, int]:
    """Rule -> jobs from the first "Job stats" table Snakemake printed; {} when it said there was
    nothing to be done. Raises on neither (an error, or output this no longer reads)."""
    block = output.split("Job stats:", 1)
    if len(block) < 2:
        if "Nothing to be done" in output:
            return {}
        raise RuntimeError(f"no job table and no 'Nothing to be done' in Snakemake's output:\n{output[-3000:]}")
    stats: dict[str, int] = {}
    for line in block[1].splitlines()[1:]:
        m = re.match(r"^(\w+)\s+(\d+)\s*$", line.strip())
        if not m:
            if stats:
                break
            continue
        if m.group(1) != "total":
            stats[m.group(1)] = int(m.group(2))
    return stats


def _tree_state(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file and folder under ``root``: (modification time ns, size, SHA-256 of a file's bytes)."""
    import hashlib

    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        out[str(p.relative_to(root))] = (st.st_mtime_ns, st.st_size if p.is_file() else 0, digest)
    return out


def _snakemake_cmd(snakefile: Path, d: Path, cores: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), "--directory", str(d),
            "--configfile", str(d / "config.yaml"), "--cores", str(cores), *args]  # fmt: skip


def _dry_runs(snakefile: Path, dirs: list[Path], cores: int) -> list[tuple[dict[str, int], float]]:
    """A dry run in each directory, side by side when there are cores for it: (job table, wall s)."""
    results: list[tuple[dict[str, int], float]] = []
    batch = max(1, min(len(dirs), cores))
    for i in range(0, len(dirs), batch):
        running = []
        for d in dirs[i:i + batch]:
            out = tempfile.TemporaryFile(mode="w+")
            running.append((subprocess.Popen(_snakemake_cmd(snakefile, d, 1, "-n"), stdout=out,
                                             stderr=subprocess.STDOUT, text=True), out, time.perf_counter()))
        for proc, out, t0 in running:
            proc.wait(timeout=900)
            wall = time.perf_counter() - t0
            out.seek(0)
            text = out.read()
            out.close()
            if proc.returncode != 0:
                raise RuntimeError(f"snakemake -n exited {proc.returncode}:\n{text[-3000:]}")
            results.append((job_table(text), wall))
    return results


# sitecustomize.py of the traced re-run: in each rule script's process (a Snakemake script job runs
# .snakemake/scripts/tmp*.<script>.py), which package files had a function called outside imports
# (module and class bodies run as modules are imported; an import in progress is tracked through
# importlib's _find_and_load), and which package modules were imported. numba-compiled functions
# run without a Python call: a module is seen through its Python functions.
CALL_TRACER = r'''
import os
import sys


def _start(out, pkg):
    import atexit
    import json
    import threading

    called = set()
    depth = [0]
    boot = "<frozen importlib._bootstrap>"
    n = len(pkg)

    def in_import(frame, event, arg):
        if event == "return":
            depth[0] -= 1
        return in_import

    def tracer(frame, event, arg):
        code = frame.f_code
        name = code.co_filename
        if name == boot:
            if code.co_name == "_find_and_load":
                depth[0] += 1
                return in_import
        elif not depth[0] and code.co_flags & 3 == 3 and name.startswith(pkg):
            called.add(name[n:])
        return None

    def dump():
        sys.settrace(None)
        sm = getattr(sys.modules.get("__main__"), "snakemake", None)
        rule = getattr(sm, "rule", None)
        if rule is None:
            return
        files = (getattr(m, "__file__", None) or "" for m in list(sys.modules.values()))
        imported = sorted({f[n:] for f in files if f.startswith(pkg)})
        with open(os.path.join(out, f"{rule}.{os.getpid()}.json"), "w") as fh:
            json.dump({"rule": rule, "called": sorted(called), "imported": imported}, fh)

    atexit.register(dump)
    threading.settrace(tracer)
    sys.settrace(tracer)


_out, _pkg = os.environ.get("NCCLTRACE_BENCH_CALLS"), os.environ.get("NCCLTRACE_BENCH_PKG")
if _out and _pkg and sys.argv and "/.snakemake/scripts/" in os.path.abspath(sys.argv[0]):
    _start(_out, os.path.join(_pkg, ""))
'''


def _traced_rerun(snakefile: Path, d: Path, pkg: Path, stages: list[str], cores: int) -> tuple[dict, float, int]:
    """Every job of ``stages`` re-run (``--forcerun``) in ``d`` under the call tracer: (rule ->
    {"called": files, "imported": files} over its jobs, wall s, jobs traced)."""
    tracer, calls = d.parent / "tracer", d.parent / "calls"
    tracer.mkdir(exist_ok=True)
    calls.mkdir(exist_ok=True)
    (tracer / "sitecustomize.py").write_text(CALL_TRACER)
    env = {**os.environ, "NCCLTRACE_BENCH_CALLS": str(calls), "NCCLTRACE_BENCH_PKG": str(pkg.resolve()),
           "PYTHONPATH": os.pathsep.join(p for p in (str(tracer), os.environ.get("PYTHONPATH", "")) if p)}
    t0 = time.perf_counter()
    # only the stages' jobs (what follows them would re-run too, and is not measured here)
    cmd = _snakemake_cmd(snakefile, d, cores, "--allowed-rules", *stages, "--forcerun", *stages)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the traced re-run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    per_rule: dict[str, dict[str, set[str]]] = {}
    jobs = 0
    for f in sorted(calls.glob("*.json")):
        rec = json.loads(f.read_text())
        seen = per_rule.setdefault(rec["rule"], {"called": set(), "imported": set()})
        seen["called"].update(rec["called"])
        seen["imported"].update(rec["imported"])
        jobs += 1
    return per_rule, wall, jobs


def _chain_text(chain: list[tuple[str, str]]) -> str:
    """stages/x.py -> a.py (from .a import f) -> m.py (package)"""
    return " -> ".join(f if how == "entry" else f"{f} ({how})" for f, how in chain)


def _rules_text(jobs: dict[str, int]) -> str:
    return ", ".join(f"{rule} {n}" for rule, n in jobs.items()) or "-"


def section_rerun(sec: Section, ctx: Context) -> None:
    from nccltrace.campaign.code_stamps import (
        STAGE_ENTRIES,
        import_chain,
        import_closure,
    )

    label, config = rerun_campaign(ctx.quick)
    d = ctx.work / "rerun"
    shutil.rmtree(d, ignore_errors=True)
    repo = _workflow_copy(d / "repo")
    snakefile, pkg = repo / "Snakefile", repo / "src" / "nccltrace"
    with_records, without, traced = d / "with-records", d / "without-records", d / "traced"
    finished = ctx.finished.pop(label, None)
    if finished is not None:
        shutil.move(str(finished), with_records)
        sec.notes.append(f"campaign {label}: the one the e2e section finished (run with the checkout's Snakefile)")
    else:
        _log(f"rerun: {label} (snakemake --cores {ctx.cores} in {with_records})")
        r = run_campaign(config, with_records, ctx.cores, snakefile)
        if r["returncode"] != 0:
            raise RuntimeError(f"{label}: snakemake exited {r['returncode']}:\n{r['stderr_tail']}")
        sec.add(label, "campaign run wall time", r["wall_s"], "s")
    shutil.copytree(with_records, without, symlinks=True)
    shutil.rmtree(without / ".snakemake" / "metadata", ignore_errors=True)
    shutil.copytree(with_records, traced, symlinks=True)
    stamps = with_records / "results" / ".code" / str(config["campaign"])
    stages = sorted(p.stem for p in stamps.glob("*.stamp") if p.stem in STAGE_ENTRIES)  # the stages with a stamp
    closures = {s: set(import_closure(STAGE_ENTRIES[s])) for s in stages}
    modules = list(QUICK_RERUN_MODULES) if ctx.quick else sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py"))
    before = {k: _tree_state(k / "results") for k in (with_records, without)}
    walls: list[float] = []

    (base_with, t1), (base_without, t2) = _dry_runs(snakefile, [with_records, without], ctx.cores)
    walls += [t1, t2]
    if base_with or base_without:
        sec.notes.append(f"WARNING: with no change the dry runs schedule {_rules_text(base_with)} (records) and "
                         f"{_rules_text(base_without)} (none); the counts below include them")  # fmt: skip
    _log(f"rerun: {len(modules)} modules, 2 dry runs each, in {with_records.parent}")
    measured: dict[str, dict[str, Any]] = {}
    for i, module in enumerate(modules):
        if i and i % 10 == 0:
            _log(f"rerun: {i} of {len(modules)} modules")
        path = pkg / module
        text = path.read_text()
        path.write_text(text + RERUN_CHANGE)
        try:
            (jw, tw), (jn, tn) = _dry_runs(snakefile, [with_records, without], ctx.cores)
        finally:
            path.write_text(text)
        walls += [tw, tn]
        measured[module] = {"records": jw, "none": jn, "stages": [s for s in stages if module in closures[s]]}
        for how, jobs in (("records", jw), ("no records", jn)):
            if sum(jobs.values()):
                sec.add(module, f"jobs scheduled ({how})", sum(jobs.values()), "jobs", show=False)
    after = {k: _tree_state(k / "results") for k in (with_records, without)}
    changed = sorted(f"{k.name}/results/{f}" for k in before for f in before[k].keys() | after[k].keys()
                     if before[k].get(f) != after[k].get(f))  # fmt: skip
    compared = sum(len(v) for v in before.values())
    sec.add(label, "dry runs", len(walls), "runs")
    sec.add(label, "dry run wall time (median)", sorted(walls)[len(walls) // 2], "s")
    sec.add(label, "modules changed, one at a time", len(modules), "modules")
    for how, key in (("records", "records"), ("no records", "none")):
        n = sum(1 for m in measured.values() if m[key])
        if n:
            sec.add(label, f"modules whose change re-runs jobs ({how})", n, "modules")
        most = max((sum(m[key].values()) for m in measured.values()), default=0)
        if most:
            sec.add(label, f"most jobs one module's change re-runs ({how})", most, "jobs")
    sec.add(label, "files and folders under results/ compared before and after the dry runs", compared, "entries")
    if changed:
        sec.notes.append(f"WARNING: the dry runs changed {len(changed)} file(s) or folder(s) under results/: "
                         + ", ".join(changed[:10]) + (" ..." if len(changed) > 10 else ""))
    else:
        sec.notes.append(f"the {len(walls)} dry runs changed no file under results/ (stamps included): {compared} "
                         "entries, times, sizes and bytes, compared; nothing was restored between modules")
    rows = []
    for module, m in measured.items():
        rules = _rules_text(m["none"])
        if set(m["records"]) != set(m["none"]) or m["records"] != m["none"]:
            rules += f" (with records: {_rules_text(m['records'])})"
        rows.append([module, str(sum(m["records"].values())), str(sum(m["none"].values())),
                     ", ".join(m["stages"]) or "-", rules])  # fmt: skip
    sec.table(f"what a one-line change of each module re-runs on {label} (dry runs; stages: those whose code hash "
              "holds the module)", ["module", "jobs (records)", "jobs (no records)", "stages", "rules (no records)"],
              rows)  # fmt: skip

    # which of the stages a module's change re-runs ever call its code
    rerun_stages = sorted({s for m in measured.values() for s in m["stages"]}) if ctx.quick else stages
    _log(f"rerun: every job of {len(rerun_stages)} stages again, under the call tracer, in {traced}")
    per_rule, wall, traced_jobs = _traced_rerun(snakefile, traced, pkg, rerun_stages, ctx.cores)
    sec.add(label, "traced re-run of the stages' jobs: wall time", wall, "s")
    sec.add(label, "traced re-run: jobs traced", traced_jobs, "jobs")
    missing = [s for s in rerun_stages if s not in per_rule]
    if missing:
        sec.notes.append(f"no trace from the jobs of {', '.join(missing)}")
    status_rows, counts = [], {"calls it": 0, "imports it only": 0, "never imports it": 0}
    for module, m in measured.items():
        for stage in m["stages"]:
            seen = per_rule.get(stage)
            if seen is None:
                continue
            if module in seen["called"]:
                counts["calls it"] += 1
                continue
            status = "imports it only" if module in seen["imported"] else "never imports it"
            counts[status] += 1
            status_rows.append([module, stage, status, _chain_text(import_chain(STAGE_ENTRIES[stage], module))])
    for status, n in counts.items():
        if n:
            sec.add(label, f"(module, stage) pairs re-run where the stage {status}", n, "pairs")
    sec.table("modules whose change re-runs a stage whose jobs never call them: the import chain that puts the "
              "module in the stage's code hash ('imports it only': imported, none of its functions called; a "
              "package's __init__ or a module of constants and classes read by others is used that way)",
              ["module", "stage", "the stage's jobs", "import chain"], status_rows)  # fmt: skip
    outside = []
    for stage in rerun_stages:
        for f in sorted(per_rule.get(stage, {}).get("called", ())):
            if f.endswith(".py") and f not in closures[stage] and f != "provenance.py":  # templates: data files
                outside.append([f, stage])
    if outside:
        sec.table("package modules a stage's jobs call that are not in its code hash (a change to them re-runs "
                  "nothing there; provenance.py is left out by design)", ["module", "stage"], outside)
        sec.add(label, "(module, stage) pairs called but outside the stage's code hash", len(outside), "pairs")
    if not ctx.keep:
        shutil.rmtree(d, ignore_errors=True)


RUNNERS: dict[str, Callable[[Section, Context], None]] = {
    "parse": section_parse, "nsys": section_nsys, "kineto": section_kineto, "sources": section_sources,
    "align": section_align, "clocksync": section_clocksync,
    "ranks": section_ranks, "trace": section_trace, "stages": section_stages, "scaling": section_scaling, "e2e": section_e2e,
    "rerun": section_rerun,
}  # fmt: skip


# --------------------------------------------------------------------------- machine and output


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or ""
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.lower().startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemTotal:"):
                mem_gb = int(ln.split()[1]) / 2**20
    except OSError:
        pass
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", "src", "workflow", "Snakefile"))
    versions = {}
    for pkg in ("nccltrace", "numpy", "pandas", "pyarrow", "numba", "snakemake"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu_model": cpu, "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": mem_gb, "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(), "packages": versions, "nccltrace_commit": commit,
        "nccltrace_local_changes": dirty, "load_average_start": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip


def print_report(machine: dict[str, Any], sections: list[Section], mode: str, wall: float) -> None:
    m = machine
    pk = m["packages"]
    print(
        f"machine: {m['cpu_model']}, {m['logical_cores']} logical cores ({m['usable_cores']} usable), "
        f"{m['ram_gib']:.1f} GiB RAM, {m['os']}"
    )
    print(f"python {m['python']}; " + ", ".join(f"{k} {v}" for k, v in pk.items() if k != "nccltrace"))
    print(
        f"nccltrace {pk.get('nccltrace')} at {m['nccltrace_commit'][:12] or '?'}"
        + (" (+ uncommitted changes in src/ or workflow/)" if m["nccltrace_local_changes"] else "")
    )
    la0, la1 = m["load_average_start"], m.get("load_average_end", (float("nan"),) * 3)
    print(
        f"load average (1 min) at start {la0[0]:.2f}, at end {la1[0]:.2f}; mode {mode}; "
        f"{m['date_utc']}; total {wall:.0f} s"
    )
    print()
    rows = []
    for s in sections:
        for f in s.figures:
            if f.show:
                rows.append([s.name, f.case, f.figure, _fmt(f.value, f.unit), f.unit])
        if s.error:
            rows.append([s.name, "-", "ERROR (see above)", "-", ""])
    header = ["section", "case", "figure", "value", "unit"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]

    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            + " |"
        )

    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    for s in sections:
        for t in s.tables:
            print()
            print(f"{s.name}: {t['title']}")
            tw = [max(len(str(r[i])) for r in [t["header"], *t["rows"]]) for i in range(len(t["header"]))]
            print("| " + " | ".join(str(c).ljust(w) for c, w in zip(t["header"], tw)) + " |")
            print("|" + "|".join("-" * (w + 2) for w in tw) + "|")
            for r in t["rows"]:
                print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, tw)) + " |")
    notes = [(s.name, n) for s in sections for n in s.notes]
    if notes:
        print()
        for name, n in notes:
            print(f"{name}: {n}")
    print()
    print("section wall times: " + ", ".join(f"{s.name} {s.wall_s:.0f} s" for s in sections))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI-sized inputs (a few minutes in all)")
    ap.add_argument("--only", metavar="SECTION,...", help=f"run only these sections ({', '.join(SECTIONS)})")
    ap.add_argument("--json", metavar="FILE", help="also write all figures and the machine description as JSON")
    ap.add_argument("--campaigns", metavar="NAME,...", help="e2e full mode: only these of example, scale-64, "
                    "scale-256, scale-1024 (default: all)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="snakemake --cores for e2e (default: all)")
    ap.add_argument("--workdir", metavar="DIR", help="generated inputs and e2e results go here and are kept "
                    "(default: a temporary directory, removed)")  # fmt: skip
    ap.add_argument("--baseline", metavar="REV", help="scaling: also measure the stages of this git revision "
                    "on the same runs (e.g. the commit before a memory change)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](json.loads(args.child[1]))))
        return 0
    names = list(SECTIONS)
    if args.only:
        names = [s.strip() for s in args.only.split(",") if s.strip()]
        bad = [s for s in names if s not in SECTIONS]
        if bad:
            ap.error(f"unknown section(s) {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    machine = machine_info()
    tmp = None
    if args.workdir:
        work = Path(args.workdir).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="nccltrace-bench-")
        work = Path(tmp.name)
    ctx = Context(quick=args.quick, work=work, cores=max(1, args.cores), keep=bool(args.workdir),
                  campaigns=set(args.campaigns.split(",")) if args.campaigns else None, baseline=args.baseline,
                  sections=tuple(names))
    sections: list[Section] = []
    t_start = time.perf_counter()
    try:
        for name in names:
            sec = Section(name)
            sections.append(sec)
            t = time.perf_counter()
            try:
                RUNNERS[name](sec, ctx)
            except Exception as e:  # noqa: BLE001  (a failing benchmark must not hide the others' figures)
                sec.error = f"{type(e).__name__}: {e}"
                print(f"\nsection {name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            sec.wall_s = time.perf_counter() - t
            _log(f"{name} done in {sec.wall_s:.0f} s")
    finally:
        if tmp is not None:
            tmp.cleanup()
    wall = time.perf_counter() - t_start
    machine["load_average_end"] = os.getloadavg()
    print_report(machine, sections, "quick" if args.quick else "full", wall)
    if args.json:
        doc = {"mode": "quick" if args.quick else "full", "wall_s": wall, "machine": machine,
               "sections": {s.name: {"wall_s": s.wall_s, "error": s.error, "notes": s.notes, "tables": s.tables,
                                     "figures": [{k: v for k, v in asdict(f).items() if k != "section"}
                                                 for f in s.figures]} for s in sections}}  # fmt: skip
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
