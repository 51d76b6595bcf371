"""Columnar engines on one run's ops table: pandas (the whole frame), DuckDB and Polars' streaming
engine, each in a fresh interpreter, on the two kinds of aggregation the run-level stages do.

* ``per_rank`` (what volume and the report's tables do): per (global rank, op) the matched
  calls, their bytes and their kernel time; sums that add up over batches.
* ``per_instance`` (what metrics does): per collective instance its members, the median and
  the latest kernel end and the earliest and latest kernel start; the median is holistic (it
  needs every value of a group at once), and the output has one row per instance.

The figures are what the README's dependency list weighs against the stages' own (metrics in
parts of whole communicators, volume and report in record batches) measured on the same table.
DuckDB and Polars are not dependencies of nccltrace: install them to run this
(``pip install duckdb polars``); a missing engine is reported and skipped. The three engines'
outputs are compared row for row.

    python benchmarks/bench_engines.py OPS_PARQUET [--memory-limit-gb 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUERIES = ("per_rank", "per_instance")
ENGINES = ("pandas", "duckdb", "polars")
KEYS = {"per_rank": ["global_rank", "op"], "per_instance": ["instance"]}


def _pandas(query: str, ops: Path, out: Path, memory_gb: float, threads: int) -> None:
    import pandas as pd

    cols = ["row_kind", "status", "global_rank", "op", "bytes", "instance", "kernel_start_sync", "kernel_end_sync"]
    df = pd.read_parquet(ops, columns=cols, dtype_backend="numpy_nullable")  # int64 with nulls stays exact
    df = df[(df["row_kind"] == "call") & (df["status"] == "matched")]
    if query == "per_rank":
        df = df.assign(busy=df["kernel_end_sync"] - df["kernel_start_sync"])
        res = df.groupby(["global_rank", "op"]).agg(calls=("bytes", "size"), bytes=("bytes", "sum"),
                                                    busy_ns=("busy", "sum")).reset_index()  # fmt: skip
    else:
        df = df[df["instance"].notna()]
        res = df.groupby("instance").agg(members=("global_rank", "size"), end_median=("kernel_end_sync", "median"),
                                         end_max=("kernel_end_sync", "max"), start_min=("kernel_start_sync", "min"),
                                         start_max=("kernel_start_sync", "max")).reset_index()  # fmt: skip
    res.to_parquet(out, index=False)


def _duckdb(query: str, ops: Path, out: Path, memory_gb: float, threads: int) -> None:
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET memory_limit = '{memory_gb}GB'")
    con.execute(f"SET threads = {threads}")
    con.execute(f"SET temp_directory = '{out.parent / 'duckdb.tmp'}'")
    src = f"read_parquet('{ops}') WHERE row_kind = 'call' AND status = 'matched'"
    if query == "per_rank":
        sql = (f"SELECT global_rank, op, count(*) AS calls, sum(bytes) AS bytes, "
               f"sum(kernel_end_sync - kernel_start_sync) AS busy_ns FROM {src} GROUP BY global_rank, op")  # fmt: skip
    else:
        sql = (f"SELECT instance, count(*) AS members, median(kernel_end_sync) AS end_median, "
               f"max(kernel_end_sync) AS end_max, min(kernel_start_sync) AS start_min, "
               f"max(kernel_start_sync) AS start_max FROM {src} AND instance IS NOT NULL GROUP BY instance")  # fmt: skip
    con.execute(f"COPY ({sql}) TO '{out}' (FORMAT parquet)")


def _polars(query: str, ops: Path, out: Path, memory_gb: float, threads: int) -> None:
    import polars as pl

    lf = pl.scan_parquet(ops).filter((pl.col("row_kind") == "call") & (pl.col("status") == "matched"))
    if query == "per_rank":
        lf = lf.group_by("global_rank", "op").agg(
            pl.len().alias("calls"), pl.col("bytes").sum(),
            (pl.col("kernel_end_sync") - pl.col("kernel_start_sync")).sum().alias("busy_ns"))  # fmt: skip
    else:
        lf = lf.filter(pl.col("instance").is_not_null()).group_by("instance").agg(
            pl.len().alias("members"), pl.col("kernel_end_sync").median().alias("end_median"),
            pl.col("kernel_end_sync").max().alias("end_max"), pl.col("kernel_start_sync").min().alias("start_min"),
            pl.col("kernel_start_sync").max().alias("start_max"))  # fmt: skip
    lf.sink_parquet(out, engine="streaming")


RUNNERS = {"pandas": _pandas, "duckdb": _duckdb, "polars": _polars}


def child(engine: str, query: str, ops: str, out: str, memory_gb: float, threads: int) -> dict:
    """Run one engine on one query in this interpreter: wall time and peak RSS."""
    t = time.perf_counter()
    RUNNERS[engine](query, Path(ops), Path(out), memory_gb, threads)
    return {"wall_s": time.perf_counter() - t, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _same(a: Path, b: Path, keys: list[str]) -> str:
    """'equal', or what differs between two engines' outputs."""
    import pandas as pd

    x = pd.read_parquet(a, dtype_backend="numpy_nullable").sort_values(keys).reset_index(drop=True)
    y = pd.read_parquet(b, dtype_backend="numpy_nullable").sort_values(keys).reset_index(drop=True)[list(x.columns)]
    if len(x) != len(y):
        return f"{len(x)} against {len(y)} rows"
    for c in x.columns:
        # integers compared as integers (timestamps in ns exceed float64's exact range)
        exact = c in keys or (pd.api.types.is_integer_dtype(x[c]) and pd.api.types.is_integer_dtype(y[c]))
        u, v = (x[c], y[c]) if exact else (x[c].astype("Float64"), y[c].astype("Float64"))
        if not u.astype(object).equals(v.astype(object)):
            return f"column {c} differs"
    return "equal"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ops", nargs="?", help="an ops.parquet of an analysed run")
    ap.add_argument("--memory-limit-gb", type=float, default=3.0, help="DuckDB's memory_limit (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="DuckDB's threads (default 2)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        engine, query, out = args.child
        print(json.dumps(child(engine, query, args.ops, out, args.memory_limit_gb, args.threads)))
        return 0
    if not args.ops:
        ap.error("give an ops.parquet")
    import pyarrow.parquet as pq

    rows = pq.read_metadata(args.ops).num_rows
    print(f"{args.ops}: {rows:,} rows; DuckDB memory_limit {args.memory_limit_gb} GB, {args.threads} threads")
    print("| query | engine | wall (s) | peak RSS (MiB) | output against pandas |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        for query in QUERIES:
            outs: dict[str, Path] = {}
            for engine in ENGINES:
                out = Path(tmp) / f"{query}-{engine}.parquet"
                cmd = [sys.executable, __file__, args.ops, "--memory-limit-gb", str(args.memory_limit_gb),
                       "--threads", str(args.threads), "--child", engine, query, str(out)]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
                    print(f"| {query} | {engine} | – | – | failed: {last} |")
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                outs[engine] = out
                same = _same(outs["pandas"], out, KEYS[query]) if "pandas" in outs and engine != "pandas" else "–"
                print(f"| {query} | {engine} | {r['wall_s']:.1f} | {r['peak_rss_mib']:,.0f} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
