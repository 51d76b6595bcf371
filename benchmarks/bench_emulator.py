"""Emulator output rate: ops and bytes of raw output written per second, per wall second and per
CPU second.

    python benchmarks/bench_emulator.py [--ranks 64] [--iterations 10] [--workers 1] [--out DIR]

Emulates a TP/PP/DP Megatron-LM run (default: 64 ranks on 8 nodes, TP=4 with SP, PP=4,
DP=4) and prints a table: ranks, logged ops, kernels, bytes of NCCL logs and nsys exports,
wall time, CPU time (this process and its worker processes), ops/s per wall second and per
CPU second (= per core), MB/s, peak RSS (largest of this process and any worker). Prints figures
only; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

from nccltrace.emulator.run import emulate_run


def _cpu_seconds() -> float:
    """User + system CPU time of this process and of its waited-for children (fork workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=64, choices=[16, 64, 256, 1024])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--workers", type=int, default=1, help="forked node workers (emulate_run(workers=...))")
    ap.add_argument("--out", help="output directory (default: a temporary directory, removed afterwards)")
    args = ap.parse_args()
    shapes = {16: (2, 8, 2, 2, 1), 64: (8, 8, 4, 4, 1), 256: (32, 8, 8, 4, 2), 1024: (128, 8, 8, 4, 2)}  # nodes, gpn, tp, pp, vpp
    nodes, gpn, tp, pp, vpp = shapes[args.ranks]
    dp = args.ranks // (tp * pp)
    gbs = max(32, 2 * pp * dp)  # enough microbatches per DP rank for the (interleaved) 1F1B schedule
    settings = {
        "model": "bench", "num_layers": 16, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 2048,
        "micro_batch_size": 1, "global_batch_size": gbs, "iterations": args.iterations, "tp": tp, "pp": pp,
        "vpp": vpp, "sequence_parallel": True, "precision": "bf16", "nodes": nodes, "gpus_per_node": gpn,
        "nccl_version": "2.24.3", "nsys_version": "2024.6", "seed": 1,
    }
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="nccltrace-bench-"))
    t0 = time.perf_counter()
    c0 = _cpu_seconds()
    result = emulate_run(settings, out / "raw", workers=args.workers)
    wall = time.perf_counter() - t0
    cpu = _cpu_seconds() - c0
    log_bytes = sum(p.stat().st_size for p in result.log_files)
    nsys_bytes = sum(p.stat().st_size for p in result.nsys_files)
    rss_mb = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
    rows = [
        ("ranks", f"{result.n_ranks}"),
        ("iterations", f"{args.iterations}"),
        ("workers", f"{args.workers}"),
        ("logged ops (all ranks)", f"{result.n_ops:,}"),
        ("kernels", f"{result.n_kernels:,}"),
        ("NCCL log bytes", f"{log_bytes / 1e6:.1f} MB"),
        ("nsys export bytes", f"{nsys_bytes / 1e6:.1f} MB"),
        ("wall time", f"{wall:.1f} s"),
        ("CPU time (all processes)", f"{cpu:.1f} s"),
        ("ops/s (wall)", f"{result.n_ops / wall:,.0f}"),
        ("ops/s per core (CPU)", f"{result.n_ops / cpu:,.0f}"),
        ("output MB/s (wall)", f"{(log_bytes + nsys_bytes) / 1e6 / wall:.1f}"),
        ("peak RSS (largest process)", f"{rss_mb:.0f} MB"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
