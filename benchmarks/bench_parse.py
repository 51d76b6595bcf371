"""NCCL log parser throughput on a large rank-0 process log, against ``grep -c opCount``.

    python benchmarks/bench_parse.py [--size-mb 1100] [--out DIR] [--version 2.28.3] [--slow]

Writes (with :class:`~nccltrace.nccl.log_writer.NcclLogWriter`, in its exact format) the
``NCCL_DEBUG_FILE`` of rank 0 of a Megatron-like run (TP with sequence parallelism, PP, DP with a
distributed optimizer): version, topology and communicator init lines, then iterations of call lines
with a TUNING line after every collective, until the file has ``--size-mb`` MB. Then prints a table:
file size, ``grep -c opCount`` wall time and MB/s, parser wall and CPU time, MB/s per core (CPU time,
with and without the one-off interpreter/numba start-up), peak RSS of the parser process and calls/s.
The parser runs in a fresh subprocess (so RSS is its own); the compiled kernels are warmed up first
so that compilation is not measured. ``--slow`` also times the line-by-line path (``fast=False``).
Prints figures only; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nccltrace.nccl.log_writer import NcclLogWriter, TopoGpu, TopoNic, TopoSystem

HOST, PID = "node000", 81234
TP, PP, DP = 8, 4, 8
LAYERS, MICRO_BATCHES = 4, 8  # layers of this pipeline stage, micro-batches per iteration
COMMS = {  # name: (comm pointer, nranks, stream)
    "world": (0x55D35C3A9EC0, TP * PP * DP, 0x55D35C000000),
    "tp": (0x55D35C8B1230, TP, 0x55D35C000000),
    "pp": (0x55D35D0A4F00, PP, 0x55D35C100000),
    "dp": (0x55D35D7C2A10, DP, 0x55D35C200000),
    "embd": (0x55D35DE11B40, 2, 0x55D35C000000),
}
_OPCOUNT = re.compile(r"opCount ([0-9a-f]+) ")


def _header(w: NcclLogWriter) -> None:
    w.version(PID)
    gpus = [TopoGpu(0x18000 + 0x10000 * i, i, i, cpu=i // 4) for i in range(8)]
    nics = [TopoNic(0x1A000 + 0x40000 * i, i, 50.0, cpu=i // 2) for i in range(4)]
    w.topology(PID + 60, TopoSystem(gpus=gpus, nics=nics, cpus=2, nvlink_bw=370.8))
    for k, (comm, nranks, _) in enumerate(COMMS.values()):
        w.init(PID, comm=comm, rank=0, nranks=nranks, cuda_dev=0, nvml_dev=0, bus_id=0x18000,
               comm_id=0x81DCA7568EFE26D7 + k, api="ncclCommInitRankConfig", phase="START")
        w.init(PID, comm=comm, rank=0, nranks=nranks, cuda_dev=0, nvml_dev=0, bus_id=0x18000,
               comm_id=0x81DCA7568EFE26D7 + k, api="ncclCommInitRankConfig")
        w.comm_info(PID, comm=comm, rank=0, nranks=nranks, nnodes=max(nranks // 8, 1), local_ranks=min(nranks, 8),
                    local_rank=0)
        for ch in range(2):
            w.ring(PID, ch, 2, list(range(min(nranks, 32))))


def _iteration(w: NcclLogWriter, op_counts: dict[str, int]) -> None:
    """One training iteration as logged by rank 0 (first pipeline stage, rank 0 of every comm)."""
    seq, hidden = 4096, 8192
    act = seq * hidden // TP  # elements of one sequence-parallel activation shard (bf16)
    buf = [0x7F0000000000]

    def call(comm: str, op: str, count: int, datatype: int = 9, redop: int = 0, root: int = 0) -> None:
        ptr, nranks, stream = COMMS[comm]
        buf[0] += 0x200000
        w.call(PID, op=op, op_count=op_counts[comm], sendbuff=buf[0], recvbuff=buf[0] + 0x100000, count=count,
               datatype=datatype, redop=redop, root=root, comm=ptr, nranks=nranks, stream=stream)
        if op not in ("Send", "Recv"):
            size = {7: 4, 9: 2}[datatype]
            w.tuning(PID, op=op, nbytes=count * size, algo="RING" if count * size > 65536 else "TREE",
                     proto="SIMPLE" if count * size > 65536 else "LL", channel_lo=0, channel_hi=15,
                     time_us=1.5 + count * size / 1e5, nranks=nranks)
        op_counts[comm] += 1

    for _ in range(MICRO_BATCHES):  # forward
        for _ in range(LAYERS):
            for _ in range(2):  # attention and MLP: all-gather in, reduce-scatter out
                call("tp", "AllGather", act)
                call("tp", "ReduceScatter", act)
        call("pp", "Send", act * TP, root=1)
    for _ in range(MICRO_BATCHES):  # backward
        call("pp", "Recv", act * TP, root=1)
        for _ in range(LAYERS):
            for _ in range(2):
                call("tp", "AllGather", act)
                call("tp", "ReduceScatter", act)
    for bucket in range(6):  # distributed optimizer: gradient reduce-scatter, parameter all-gather
        call("dp", "ReduceScatter", 40_000_000 + bucket, datatype=7)
    call("embd", "AllReduce", 65_536_000, datatype=7)
    call("tp", "AllReduce", 1, datatype=7)  # grad norm
    call("pp", "AllReduce", 1, datatype=7)
    call("dp", "AllReduce", 2, datatype=7)  # loss
    call("world", "AllReduce", 1, datatype=7, redop=2)
    for bucket in range(6):
        call("dp", "AllGather", 40_000_000 + bucket)


def _template() -> tuple[str, list[str]]:
    """One iteration rendered by the writer with marker opCounts, as a str.format template whose
    fields are the opCounts (hex), and the comm each field belongs to."""
    markers = {name: 0xF00000000 * (k + 1) for k, name in enumerate(COMMS)}
    text = io.StringIO()
    _iteration(NcclLogWriter(text, nccl_version=VERSION, host=HOST, pid=PID), dict(markers))
    owner = {}
    for name, base in markers.items():
        for i in range(10_000):
            owner[f"{base + i:x}"] = name
    fields: list[str] = []

    def field(m: re.Match) -> str:
        fields.append(owner[m.group(1)])
        return "opCount {" + str(len(fields) - 1) + "} "

    escaped = text.getvalue().replace("{", "{{").replace("}", "}}")
    return _OPCOUNT.sub(field, escaped), fields


def write_log(path: Path, size_mb: float) -> tuple[int, int]:
    """Write the benchmark log; returns (bytes, call lines)."""
    target = int(size_mb * 1e6)
    op_counts = {name: 0 for name in COMMS}
    with open(path, "w") as fh:
        w = NcclLogWriter(fh, nccl_version=VERSION, host=HOST, pid=PID)
        _header(w)
        template, fields = _template()
        calls_per_iter = len(fields)
        # The template must give exactly what the writer prints: check on the first iterations.
        for _ in range(2):
            direct = io.StringIO()
            expected_counts = dict(op_counts)
            _iteration(NcclLogWriter(direct, nccl_version=VERSION, host=HOST, pid=PID), expected_counts)
            text = _render(template, fields, op_counts)
            if text != direct.getvalue():
                raise SystemExit("benchmark template does not reproduce the writer's output")
            fh.write(text)
        calls = 2 * calls_per_iter
        while fh.tell() < target:
            fh.write(_render(template, fields, op_counts))
            calls += calls_per_iter
        w.destroy(PID, comm=COMMS["tp"][0], rank=0, nranks=TP, cuda_dev=0, bus_id=0x18000)
    return path.stat().st_size, calls


def _render(template: str, fields: list[str], op_counts: dict[str, int]) -> str:
    values = []
    for name in fields:
        values.append(f"{op_counts[name]:x}")
        op_counts[name] += 1
    return template.format(*values)


_CHILD = r"""
import json, resource, sys, time
t0, c0 = time.perf_counter(), time.process_time()
from nccltrace.nccl.log_reader import parse_logs
fast = sys.argv[3] == "fast"
if fast:
    from nccltrace.nccl import fast_scan  # noqa: F401  (numba start-up and cached kernels)
t1, c1 = time.perf_counter(), time.process_time()
report = parse_logs([sys.argv[1]], sys.argv[2], fast=fast)
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"start_wall": t1 - t0, "start_cpu": c1 - c0, "wall": t2 - t1, "cpu": c2 - c1,
                  "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "calls": report.counts["call"], "tuning": report.counts["tuning"]}))
"""


def run_parser(log: Path, out: Path, mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(log), str(out), mode], check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    global VERSION
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=1100.0, help="log size in MB (default 1100: >= 1 GB)")
    ap.add_argument("--out", help="directory for the log and tables (default: a temporary directory, removed)")
    ap.add_argument("--version", default="2.28.3", help="NCCL version of the log format (default 2.28.3)")
    ap.add_argument("--slow", action="store_true", help="also time the line-by-line parser (fast=False)")
    args = ap.parse_args()
    VERSION = args.version
    tmp = None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="nccltrace-bench-")
        out = Path(tmp.name)
    log = out / f"nccl_{HOST}_{PID}.log"
    try:
        t = time.perf_counter()
        size, calls = write_log(log, args.size_mb)
        gen = time.perf_counter() - t
        mb = size / 1e6
        print(f"wrote {log} ({mb:.0f} MB, {calls} call lines, NCCL {VERSION}) in {gen:.1f} s", flush=True)

        # Warm-up: compile (or load) the kernels once, outside the measurement.
        warm = out / "warmup.log"
        warm.write_bytes(log.open("rb").read(1 << 20).rsplit(b"\n", 1)[0] + b"\n")
        run_parser(warm, out / "tables-warmup", "fast")

        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        grep = subprocess.run(["grep", "-c", "opCount", str(log)], check=True, capture_output=True, text=True)
        grep_wall = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        grep_cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        grep_count = int(grep.stdout.strip())

        results = {"fast": run_parser(log, out / "tables", "fast")}
        if args.slow:
            results["slow"] = run_parser(log, out / "tables-slow", "slow")

        rows = [("file size", f"{mb:,.0f} MB", ""),
                ("grep -c opCount", f"{grep_wall:.2f} s wall, {grep_cpu:.2f} s CPU",
                 f"{mb / grep_wall:,.0f} MB/s ({grep_count} lines)")]
        for mode, r in results.items():
            name = "parser" if mode == "fast" else "parser fast=False"
            cpu_all = r["cpu"] + r["start_cpu"]
            rows += [
                (f"{name} wall", f"{r['wall']:.2f} s (+{r['start_wall']:.2f} s start-up)",
                 f"{mb / r['wall']:,.0f} MB/s, {r['wall'] / grep_wall:.1f}x grep"),
                (f"{name} CPU", f"{r['cpu']:.2f} s (+{r['start_cpu']:.2f} s start-up)",
                 f"{mb / r['cpu']:,.0f} MB/s per core ({mb / cpu_all:,.0f} with start-up)"),
                (f"{name} peak RSS", f"{r['maxrss_kb'] / 1024:,.0f} MB", ""),
                (f"{name} calls/s", f"{r['calls'] / r['wall']:,.0f}", f"{r['calls']} calls, {r['tuning']} TUNING"),
            ]
            if r["calls"] != grep_count:
                rows.append((f"{name} WARNING", f"{r['calls']} calls parsed, grep counts {grep_count}", ""))
        width = max(len(r[0]) for r in rows)
        vwidth = max(len(r[1]) for r in rows)
        print()
        for label, value, extra in rows:
            print(f"{label:<{width}}  {value:<{vwidth}}  {extra}")
    finally:
        if tmp is not None:
            tmp.cleanup()


VERSION = "2.28.3"

if __name__ == "__main__":
    main()
