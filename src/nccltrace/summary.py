"""Summary tables of a run and of a campaign: what was communicated, how much, and how fast.

Every table is computed from the enriched per-operation table (``ops.parquet``) and counts only
call rows (``row_kind == 'call'``). Duplicate log lines (``duplicate_of`` not null: NCCL printed
the same call twice) are never counted as operations or volume; tables that group calls report
how many were dropped in ``duplicate_lines``.

Volumes are *payload bytes per rank*: ``ops.bytes`` (count x datatype size as the rank passed it:
AllGather = what this rank contributes, ReduceScatter = what it receives, Send/Recv = bytes to or
from the peer). A run total is the sum of these over all ranks, as in the thesis figures; it is not
the number of bytes on the wire. Calls on single-rank communicators move no data and launch no
kernel, so they are kept apart in ``*_single_rank`` columns instead of inflating counts.

Bandwidth statistics come from the per-op metrics table (``metrics/op_metrics.parquet``, keyed
by (file, line)) and validation from ``volume/volume_validation.parquet``; both are optional.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from .tables import atomic_output, read_table_batch, write_table_atomic
from .tables import documented_field as _f

# The ops columns run_tables and nccltrace.plots.run_plots read (the workflow reads only these;
# tests check the result equals the one from every column).
OPS_COLUMNS = ["bytes", "duplicate_of", "file", "global_rank", "host", "kernel_correlation_id", "kernel_end",
               "kernel_end_sync", "kernel_global_pid", "kernel_name", "kernel_start", "kernel_start_sync", "line",
               "logical_id", "message_bytes", "nranks", "op", "parallelism", "reason", "row_kind", "status"]  # fmt: skip
# The op-metrics columns run_tables reads (the report reads only these).
OP_METRICS_COLUMNS = ["file", "line", "duration_ns", "algbw_gbps", "busbw_gbps", "wait_ns", "transfer_ns",
                      "transfer_busbw_gbps", "limit_gbps", "limit_link", "efficiency", "algorithm", "protocol",
                      "arrival_skew_ns"]  # fmt: skip

P2P_OPS = frozenset({"Send", "Recv"})
UNKNOWN = "unknown"
LARGE_MESSAGE_BYTES = 1 << 20  # below this, bandwidth figures are dominated by launch latency

# --------------------------------------------------------------------------- schemas

_PAR = _f("parallelism", pa.string(), "", "parallelism the communicator serves ('unknown' when unresolved)")
_OP = _f("op", pa.string(), "", "NCCL function as logged")
_CALLS = _f("calls", pa.int64(), "calls", "call lines on communicators of more than one rank (duplicates excluded)")
_CALLS1 = _f("calls_single_rank", pa.int64(), "calls", "call lines on single-rank communicators (no data moves, "
             "NCCL launches no kernel); not in calls")
_DUPS = _f("duplicate_lines", pa.int64(), "lines", "duplicate log lines (duplicate_of set) left out of every count")
_BYTES = _f("bytes", pa.int64(), "B", "payload bytes summed over the calls (per-rank payload of each call, summed "
            "over all ranks; not bytes on the wire)")
_BYTES1 = _f("bytes_single_rank", pa.int64(), "B", "payload bytes of calls on single-rank communicators (not in bytes)")
_PER_RANK_MEAN = _f("bytes_per_rank_mean", pa.float64(), "B", "bytes / number of ranks in the run (mean payload "
                    "per rank)")
_PER_RANK_MAX = _f("bytes_per_rank_max", pa.float64(), "B", "largest payload of one rank")
_BUCKET = [
    _f("bucket", pa.int32(), "log2(B)", "power-of-two size bucket k: [2^k, 2^(k+1)) bytes; -1 for 0-byte calls"),
    _f("bucket_lo_bytes", pa.int64(), "B", "smallest size in the bucket (inclusive)"),
    _f("bucket_hi_bytes", pa.int64(), "B", "upper bound of the bucket (exclusive)"),
    _f("bucket_label", pa.string(), "", "readable bucket, e.g. '4 MiB' (binary units, lower bound)"),
]


def _schema(name: str, doc: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields, metadata={"table": name, "doc": doc})


RUN_SCHEMAS: dict[str, pa.Schema] = {
    "overview": _schema("overview", "One row: the run at a glance (counts, volume, alignment, bandwidth).", [
        _f("ranks", pa.int32(), "", "distinct global ranks with call lines"),
        _f("hosts", pa.int32(), "", "distinct hosts"),
        _f("call_lines", pa.int64(), "lines", "all call rows, duplicates included"),
        _CALLS, _CALLS1, _DUPS,
        _f("kernels", pa.int64(), "kernels", "distinct GPU kernels matched to the calls (a fused SendRecv kernel "
           "counts once)"),
        _f("matched_calls", pa.int64(), "calls", "calls (multi-rank, no duplicates) matched to a kernel"),
        _f("matched_share", pa.float64(), "fraction", "matched_calls / calls"),
        _BYTES, _BYTES1, _PER_RANK_MEAN,
        _f("bytes_per_rank_min", pa.float64(), "B", "smallest payload of one rank"),
        _PER_RANK_MAX,
        _f("span_ns", pa.int64(), "ns", "first kernel start to last kernel end (synchronised clock); null without "
           "kernel times"),
        _f("busbw_median_gbps", pa.float64(), "GB/s", "median bus bandwidth over the calls with metrics whose "
           "message size S is at least 1 MiB (smaller ones measure latency); null without such calls"),
    ]),
    "op_counts": _schema("op_counts", "Calls and payload per parallelism and NCCL function.", [
        _PAR, _OP, _CALLS,
        _f("share_calls", pa.float64(), "fraction", "calls / all calls of the run"),
        _BYTES,
        _f("share_bytes", pa.float64(), "fraction", "bytes / all bytes of the run"),
        _f("matched_calls", pa.int64(), "calls", "calls matched to a kernel"),
        _CALLS1, _BYTES1, _DUPS,
    ]),
    "kernel_counts": _schema("kernel_counts", "Distinct GPU kernels per parallelism and kernel type (a fused group "
                             "of Send/Recv calls is one SendRecv kernel); what an Nsight timeline shows.", [
        _PAR,
        _f("kernel_op", pa.string(), "", "kernel type from the kernel name (AllReduce, SendRecv, ...); the call's "
           "function for generic kernels"),
        _f("kernels", pa.int64(), "kernels", "distinct kernels (host, process, correlation id)"),
        _f("share_kernels", pa.float64(), "fraction", "kernels / all kernels of the run"),
        _f("kernel_time_ns", pa.int64(), "ns", "summed kernel durations"),
    ]),
    "volume_by_op": _schema("volume_by_op", "Payload volume per NCCL function.", [
        _OP, _CALLS, _BYTES,
        _f("share_bytes", pa.float64(), "fraction", "bytes / all bytes of the run"),
        _PER_RANK_MEAN, _PER_RANK_MAX,
        _f("bytes_per_call_median", pa.float64(), "B", "median per-rank payload of one call"),
        _CALLS1, _BYTES1,
    ]),
    "volume_by_parallelism": _schema("volume_by_parallelism", "Payload volume per parallelism.", [
        _PAR, _CALLS, _BYTES,
        _f("share_bytes", pa.float64(), "fraction", "bytes / all bytes of the run"),
        _PER_RANK_MEAN, _PER_RANK_MAX, _CALLS1, _BYTES1,
    ]),
    "rank_volume": _schema("rank_volume", "Payload volume per global rank.", [
        _f("global_rank", pa.int32(), "", "global rank (null: process whose rank is unknown)"),
        _f("host", pa.string(), "", "host of the process"),
        _CALLS, _BYTES,
        _f("share_bytes", pa.float64(), "fraction", "bytes / all bytes of the run"),
        _CALLS1, _BYTES1, _DUPS,
    ]),
    "rank_volume_by_op": _schema("rank_volume_by_op", "Payload volume per global rank and NCCL function.", [
        _f("global_rank", pa.int32(), "", "global rank (null: unknown)"),
        _OP, _CALLS, _BYTES,
    ]),
    "message_sizes": _schema("message_sizes", "Distribution of per-rank call payloads (ops.bytes) over power-of-two "
                             "buckets, per NCCL function.", _BUCKET + [_OP, _CALLS, _BYTES, _CALLS1]),
    "bandwidth": _schema("bandwidth", "Bandwidth per communicator, function and size bucket of the nccl-tests "
                         "message size S (ops.message_bytes), over the calls with metrics.", [
        _PAR,
        _f("logical_id", pa.int32(), "", "logical communicator"),
        _f("nranks", pa.int32(), "", "communicator size"),
        _OP, *_BUCKET,
        _f("calls", pa.int64(), "calls", "calls with a bus bandwidth"),
        _f("busbw_p10_gbps", pa.float64(), "GB/s", "10th percentile of busbw (linear interpolation)"),
        _f("busbw_median_gbps", pa.float64(), "GB/s", "median bus bandwidth (nccl-tests convention)"),
        _f("busbw_p90_gbps", pa.float64(), "GB/s", "90th percentile of busbw"),
        _f("algbw_median_gbps", pa.float64(), "GB/s", "median algorithm bandwidth S / duration"),
        _f("transfer_busbw_median_gbps", pa.float64(), "GB/s", "median busbw over the transfer part (without "
           "waiting for the last rank)"),
        _f("duration_median_ns", pa.float64(), "ns", "median kernel duration"),
        _f("wait_share_median", pa.float64(), "fraction", "median of wait_ns / duration_ns"),
        _f("efficiency_median", pa.float64(), "fraction", "median of busbw / theoretical limit"),
        _f("limit_gbps", pa.float64(), "GB/s", "theoretical limit of the bottleneck link (median over calls)"),
        _f("limit_link", pa.string(), "", "bottleneck link type (most frequent)"),
        _f("algorithm", pa.string(), "", "NCCL algorithm (most frequent)"),
        _f("protocol", pa.string(), "", "NCCL protocol (most frequent)"),
    ]),
    "time_lost": _schema("time_lost", "Where is time lost? Per parallelism: communication time on the GPUs, "
                         "the part spent waiting for the last rank to arrive vs transferring, arrival skew, the "
                         "communication share of the ranks' busy span, and the rank that arrives last most costly "
                         "(from metrics/op_metrics and metrics/stragglers; complete, clock-synchronised instances).", [
        _f("parallelism", pa.string(), "", "parallelism the communicators serve"),
        _f("communicators", pa.int32(), "", "logical communicators"),
        _f("calls_timed", pa.int64(), "", "multi-rank calls with a kernel duration"),
        _f("comm_time_s", pa.float64(), "s", "sum over ranks of the kernel durations"),
        _f("wait_s", pa.float64(), "s", "sum over ranks of the time kernels waited for the last rank"),
        _f("transfer_s", pa.float64(), "s", "sum over ranks of duration - wait (complete instances)"),
        _f("wait_share", pa.float64(), "fraction", "wait / (wait + transfer)"),
        _f("median_arrival_skew_us", pa.float64(), "us", "median over calls of last start - first start of the instance"),
        _f("comm_share_of_span", pa.float64(), "fraction", "median over ranks of this parallelism's kernel time / the "
           "rank's span from its first to its last NCCL kernel (an upper bound of the communication share of the "
           "iteration: compute between kernels is in the span)"),
        _f("top_straggler_rank", pa.int32(), "", "global rank whose late arrivals cost the other ranks most wait"),
        _f("straggler_last_share", pa.float64(), "fraction", "share of its instances that rank arrived last"),
        _f("straggler_wait_caused_s", pa.float64(), "s", "the other ranks' wait in those instances"),
    ]),
    "alignment": _schema("alignment", "Alignment quality: rows of the ops table by kind, status and reason "
                         "(duplicate lines included, as reason 'duplicate_line').", [
        _f("row_kind", pa.string(), "", "'call' (log line) or 'kernel' (kernel no call matched)"),
        _f("status", pa.string(), "", "'matched' or 'unmatched'"),
        _f("reason", pa.string(), "", "why unmatched (null when matched)"),
        _f("rows", pa.int64(), "rows", "number of rows"),
        _f("share", pa.float64(), "fraction", "rows / rows of the same row_kind"),
    ]),
}

# Columns of per-run settings shown for every configuration (with Megatron's defaults).
CONFIG_FIELDS: list[pa.Field] = [
    _f("model", pa.string(), "", "model name"),
    _f("hardware", pa.string(), "", "node type / hardware profile"),
    _f("nodes", pa.int32(), "", "nodes"),
    _f("gpus_per_node", pa.int32(), "", "GPUs per node"),
    _f("world_size", pa.int32(), "", "nodes x GPUs per node"),
    _f("tp", pa.int32(), "", "tensor-parallel size"),
    _f("pp", pa.int32(), "", "pipeline-parallel size"),
    _f("vpp", pa.int32(), "", "virtual pipeline stages per rank"),
    _f("ep", pa.int32(), "", "expert-parallel size"),
    _f("cp", pa.int32(), "", "context-parallel size"),
    _f("dp", pa.int32(), "", "data-parallel size: world_size / (tp x pp x cp)"),
    _f("sequence_parallel", pa.bool_(), "", "sequence parallelism enabled"),
    _f("distributed_optimizer", pa.bool_(), "", "distributed optimizer (ZeRO-1) enabled"),
    _f("num_experts", pa.int32(), "", "MoE experts (0: dense)"),
    _f("moe_token_dispatcher", pa.string(), "", "MoE token dispatcher (null for dense models)"),
    _f("moe_router_topk", pa.int32(), "", "experts per token (null for dense models)"),
    _f("iterations", pa.int32(), "", "training iterations traced"),
    _f("micro_batch_size", pa.int32(), "", "micro-batch size"),
    _f("global_batch_size", pa.int32(), "", "global batch size"),
    _f("precision", pa.string(), "", "training precision"),
    _f("nccl_version", pa.string(), "", "NCCL version"),
]
_RUN = _f("run", pa.string(), "", "run id (configuration)")
CAMPAIGN_RUNS_SCHEMA = _schema(
    "runs", "Every configuration of the campaign with its settings and headline numbers (null when the run has no "
    "results).",
    [_RUN, _f("available", pa.bool_(), "", "the run's tables were available")] + CONFIG_FIELDS
    + [f for f in RUN_SCHEMAS["overview"]],
)


def campaign_schema(name: str) -> pa.Schema | None:
    """Schema of a campaign table: the run table's columns after a ``run`` column."""
    if name == "runs":
        return CAMPAIGN_RUNS_SCHEMA
    base = RUN_SCHEMAS.get(name)
    if base is None:
        return None
    return _schema(name, (base.metadata or {}).get(b"doc", b"").decode() + " One block of rows per run.",
                   [_RUN] + list(base))


# --------------------------------------------------------------------------- helpers

_NULLABLE = {"string": "string", "int64": "Int64", "int32": "Int32", "double": "Float64", "bool": "boolean"}


def _frame(rows: pd.DataFrame | dict[str, Any], schema: pa.Schema) -> pd.DataFrame:
    """The columns of ``schema`` in order with nullable dtypes; absent columns are all null."""
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    out = pd.DataFrame(index=range(len(df)))
    df = df.reset_index(drop=True)
    for field in schema:
        col = df[field.name] if field.name in df else pd.Series([pd.NA] * len(df))
        out[field.name] = col.astype(_NULLABLE[str(field.type)])
    return out


def size_bucket(nbytes: pd.Series) -> pd.Series:
    """Power-of-two bucket k of each size: 2^k <= bytes < 2^(k+1); -1 for zero or missing sizes."""
    b = pd.Series(nbytes).astype("Int64").fillna(0).to_numpy(dtype=np.int64)
    k = np.full(len(b), -1, dtype=np.int64)
    pos = b > 0
    k[pos] = np.floor(np.log2(b[pos].astype(np.float64))).astype(np.int64)
    # float log2 can land one off next to a power of two above 2^53; correct with exact shifts
    kp, bp = k[pos], b[pos]
    one = np.int64(1)
    kp = kp - ((kp > 62) | (np.left_shift(one, np.minimum(kp, 62)) > bp))
    kp = kp + ((kp < 62) & (np.left_shift(one, np.minimum(kp + 1, 62)) <= bp))
    k[pos] = kp
    return pd.Series(k, index=nbytes.index)


def format_bytes_binary(n: int) -> str:
    """'512 B', '4 KiB', '16 MiB' for a power of two (or any size; one decimal when not integral)."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    v = float(n)
    i = 0
    while v >= 1024 and i < len(units) - 1:
        v /= 1024
        i += 1
    return f"{v:.0f} {units[i]}" if v == int(v) else f"{v:.1f} {units[i]}"


def _bucket_columns(k: pd.Series) -> dict[str, pd.Series]:
    lo = k.map(lambda x: 0 if x < 0 else 1 << int(x))
    hi = k.map(lambda x: 1 if x < 0 else 1 << (int(x) + 1))
    label = k.map(lambda x: "0 B" if x < 0 else format_bytes_binary(1 << int(x)))
    return {"bucket_lo_bytes": lo, "bucket_hi_bytes": hi, "bucket_label": label}


def _kernel_op(names: pd.Series, ops: pd.Series) -> pd.Series:
    """Kernel type from NCCL kernel names (ncclKernel_X_..., ncclDevKernel_X_...); generic kernels
    and unknown names fall back to the call's function."""
    fam = names.astype("string").str.extract(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")[0]
    fam = fam.where(fam != "Generic")
    return fam.fillna(ops.astype("string")).astype("string")


def _prepare(ops: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(countable calls, duplicate lines): call rows split by duplicate_of, with helper columns."""
    calls = ops[ops["row_kind"].astype("string") == "call"].copy()
    calls["parallelism"] = calls["parallelism"].astype("string").fillna(UNKNOWN)
    calls["op"] = calls["op"].astype("string").fillna(UNKNOWN)
    calls["bytes"] = pd.to_numeric(calls["bytes"], errors="coerce").fillna(0).astype("int64")
    # nranks null (unresolved call) counts as multi-rank: only a logged size of 1 proves no data moved
    calls["single"] = (pd.to_numeric(calls["nranks"], errors="coerce") == 1).fillna(False).astype(bool)
    dup = calls["duplicate_of"].notna()
    return calls[~dup], calls[dup]


def _n_ranks(calls: pd.DataFrame) -> int:
    return max(int(calls["global_rank"].nunique(dropna=True)), 1)


def _grouped(base: pd.DataFrame, dups: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """calls/bytes (multi-rank), single-rank calls/bytes and duplicate lines per group."""
    multi, single = base[~base["single"]], base[base["single"]]
    parts = [
        multi.groupby(keys, dropna=False).agg(calls=("op", "size"), bytes=("bytes", "sum")),
        single.groupby(keys, dropna=False).agg(calls_single_rank=("op", "size"), bytes_single_rank=("bytes", "sum")),
        dups.groupby(keys, dropna=False).agg(duplicate_lines=("op", "size")),
    ]
    out = pd.concat(parts, axis=1).fillna(0).astype("int64").reset_index()
    return out.sort_values(keys, na_position="last", kind="stable").reset_index(drop=True)


def _share(x: pd.Series) -> pd.Series:
    total = float(x.sum())
    return x / total if total > 0 else pd.Series([float("nan")] * len(x), index=x.index)


def _mode(s: pd.Series) -> Any:
    s = s.dropna()
    if s.empty:
        return pd.NA
    counts = s.astype(str).value_counts()
    # ties broken alphabetically so the table does not depend on row order
    best = counts[counts == counts.max()].index
    return min(best)


# --------------------------------------------------------------------------- run tables


def _op_counts(base: pd.DataFrame, dups: pd.DataFrame) -> pd.DataFrame:
    t = _grouped(base, dups, ["parallelism", "op"])
    matched = base[~base["single"] & (base["status"].astype("string") == "matched")]
    m = matched.groupby(["parallelism", "op"]).size().rename("matched_calls")
    t = t.merge(m, left_on=["parallelism", "op"], right_index=True, how="left")
    t["matched_calls"] = t["matched_calls"].fillna(0)
    t["share_calls"] = _share(t["calls"])
    t["share_bytes"] = _share(t["bytes"])
    return _frame(t, RUN_SCHEMAS["op_counts"])


def _kernels(base: pd.DataFrame) -> pd.DataFrame:
    """One row per distinct kernel matched to countable multi-rank calls (first call of a fused group)."""
    # only the columns the kernel tables use: a copy of every column per kernel was the report's peak
    cols = ["host", "kernel_global_pid", "kernel_correlation_id", "kernel_name", "op", "parallelism", "kernel_start",
            "kernel_end"]  # fmt: skip
    mask = ((base["status"].astype("string") == "matched") & base["kernel_correlation_id"].notna()).to_numpy(bool)
    mask &= ~base["single"].to_numpy(bool)  # countable (multi-rank) calls only
    k = base.loc[mask, [c for c in cols if c in base]]
    k = k[~k.duplicated(["host", "kernel_global_pid", "kernel_correlation_id"]).to_numpy()]
    k = k.assign(kernel_op=_kernel_op(k["kernel_name"], k["op"]),
                 dur=(pd.to_numeric(k["kernel_end"]) - pd.to_numeric(k["kernel_start"])).fillna(0).astype("int64"))
    return k


def _kernel_counts(kernels: pd.DataFrame) -> pd.DataFrame:
    t = kernels.groupby(["parallelism", "kernel_op"]).agg(kernels=("op", "size"), kernel_time_ns=("dur", "sum"))
    t = t.reset_index().sort_values(["parallelism", "kernel_op"], kind="stable")
    t["share_kernels"] = _share(t["kernels"])
    return _frame(t, RUN_SCHEMAS["kernel_counts"])


def _volume_by(base: pd.DataFrame, dups: pd.DataFrame, key: str, nranks: int) -> pd.DataFrame:
    t = _grouped(base, dups, [key])
    multi = base[~base["single"]]
    per_rank = multi.groupby([key, "global_rank"], dropna=False)["bytes"].sum().groupby(level=0).max()
    t["bytes_per_rank_max"] = t[key].map(per_rank).astype("Float64").fillna(0.0)
    t["bytes_per_rank_mean"] = t["bytes"] / nranks
    t["bytes_per_call_median"] = t[key].map(multi.groupby(key)["bytes"].median()).astype("Float64")
    t["share_bytes"] = _share(t["bytes"])
    return _frame(t, RUN_SCHEMAS["volume_by_op" if key == "op" else "volume_by_parallelism"])


def _rank_volume(base: pd.DataFrame, dups: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    t = _grouped(base, dups, ["global_rank"])
    hosts = pd.concat([base, dups]).groupby("global_rank", dropna=False)["host"].agg(
        lambda s: ",".join(sorted(set(s.dropna().astype(str)))))
    t["host"] = t["global_rank"].map(hosts)
    t["share_bytes"] = _share(t["bytes"])
    by_op = _grouped(base, dups, ["global_rank", "op"])
    by_op = by_op[(by_op["calls"] > 0) | (by_op["calls_single_rank"] > 0)]
    return _frame(t, RUN_SCHEMAS["rank_volume"]), _frame(by_op, RUN_SCHEMAS["rank_volume_by_op"])


def _message_sizes(base: pd.DataFrame, dups: pd.DataFrame) -> pd.DataFrame:
    b = base.assign(bucket=size_bucket(base["bytes"]))
    d = dups.assign(bucket=size_bucket(dups["bytes"]))
    t = _grouped(b, d, ["bucket", "op"])
    t = t[(t["calls"] > 0) | (t["calls_single_rank"] > 0)].reset_index(drop=True)
    t = t.assign(**_bucket_columns(t["bucket"]))
    return _frame(t, RUN_SCHEMAS["message_sizes"])


def _bandwidth(base: pd.DataFrame, op_metrics: pd.DataFrame | None) -> pd.DataFrame:
    schema = RUN_SCHEMAS["bandwidth"]
    if op_metrics is None or op_metrics.empty or "busbw_gbps" not in op_metrics:
        return _frame(pd.DataFrame(), schema)
    keep = [c for c in ("file", "line", "duration_ns", "algbw_gbps", "busbw_gbps", "wait_ns", "transfer_ns",
                        "transfer_busbw_gbps", "limit_gbps", "limit_link", "efficiency", "algorithm", "protocol")
            if c in op_metrics]  # fmt: skip
    m = op_metrics[keep].drop_duplicates(["file", "line"])
    multi = base[~base["single"]][["file", "line", "parallelism", "logical_id", "nranks", "op", "message_bytes"]]
    j = multi.merge(m, on=["file", "line"], how="inner")
    j = j[pd.to_numeric(j["busbw_gbps"], errors="coerce").notna()].copy()
    if j.empty:
        return _frame(pd.DataFrame(), schema)
    for c in ("busbw_gbps", "algbw_gbps", "transfer_busbw_gbps", "efficiency", "limit_gbps", "duration_ns", "wait_ns"):
        j[c] = pd.to_numeric(j[c], errors="coerce").astype("float64") if c in j else np.nan
    dur = j["duration_ns"].where(j["duration_ns"] > 0)
    j["wait_share"] = j["wait_ns"] / dur
    j["bucket"] = size_bucket(j["message_bytes"])
    j["logical_id"] = j["logical_id"].astype("Int64").fillna(-1)
    j["nranks"] = j["nranks"].astype("Int64").fillna(-1)
    keys = ["parallelism", "logical_id", "nranks", "op", "bucket"]
    rows = []
    for key, g in j.groupby(keys, sort=True):
        bw = g["busbw_gbps"]
        rows.append(dict(zip(keys, key), calls=len(g), busbw_p10_gbps=bw.quantile(0.1),
                         busbw_median_gbps=bw.median(), busbw_p90_gbps=bw.quantile(0.9),
                         algbw_median_gbps=g["algbw_gbps"].median(),
                         transfer_busbw_median_gbps=g["transfer_busbw_gbps"].median(),
                         duration_median_ns=g["duration_ns"].median(), wait_share_median=g["wait_share"].median(),
                         efficiency_median=g["efficiency"].median(), limit_gbps=g["limit_gbps"].median(),
                         limit_link=_mode(g["limit_link"]) if "limit_link" in g else pd.NA,
                         algorithm=_mode(g["algorithm"]) if "algorithm" in g else pd.NA,
                         protocol=_mode(g["protocol"]) if "protocol" in g else pd.NA))  # fmt: skip
    t = pd.DataFrame(rows)
    t = t.assign(**_bucket_columns(t["bucket"]))
    for c in ("logical_id", "nranks"):  # -1 was only a groupby placeholder for unknown
        t[c] = t[c].astype("Int64").where(t[c] >= 0)
    return _frame(t, schema)


def _alignment(ops: pd.DataFrame) -> pd.DataFrame:
    kind = ops["row_kind"].astype("string")
    status = ops["status"].astype("string")
    reason = ops["reason"].astype("string")
    # a duplicate line may carry another reason in older tables; name it by what makes it uncounted
    dup = (kind == "call") & ops["duplicate_of"].notna()
    reason = reason.mask(dup, "duplicate_line")
    status = status.mask(dup, "unmatched")
    t = pd.DataFrame({"row_kind": kind, "status": status, "reason": reason})
    t = t.groupby(["row_kind", "status", "reason"], dropna=False).size().rename("rows").reset_index()
    t["share"] = t["rows"] / t.groupby("row_kind", dropna=False)["rows"].transform("sum")
    t = t.sort_values(["row_kind", "status", "rows"], ascending=[True, True, False], kind="stable")
    return _frame(t, RUN_SCHEMAS["alignment"])


def _overview(ops: pd.DataFrame, base: pd.DataFrame, dups: pd.DataFrame, kernels: pd.DataFrame,
              bandwidth_calls: pd.Series | None) -> pd.DataFrame:
    multi = base[~base["single"]]
    per_rank = multi.groupby("global_rank")["bytes"].sum()
    ranks = _n_ranks(pd.concat([base, dups]))
    # ranks whose calls were all single-rank still count, with zero volume
    per_rank = per_rank.reindex(sorted(set(base["global_rank"].dropna().astype(int))), fill_value=0)
    start = pd.to_numeric(multi["kernel_start_sync"], errors="coerce")
    end = pd.to_numeric(multi["kernel_end_sync"], errors="coerce")
    span = int(end.max() - start.min()) if start.notna().any() and end.notna().any() else pd.NA
    matched = int((multi["status"].astype("string") == "matched").sum())
    row = {
        "ranks": ranks, "hosts": int(pd.concat([base, dups])["host"].nunique()),
        "call_lines": int((ops["row_kind"].astype("string") == "call").sum()),
        "calls": len(multi), "calls_single_rank": int(base["single"].sum()), "duplicate_lines": len(dups),
        "kernels": len(kernels), "matched_calls": matched,
        "matched_share": matched / len(multi) if len(multi) else pd.NA,
        "bytes": int(multi["bytes"].sum()), "bytes_single_rank": int(base.loc[base["single"], "bytes"].sum()),
        "bytes_per_rank_mean": float(multi["bytes"].sum()) / ranks,
        "bytes_per_rank_min": float(per_rank.min()) if len(per_rank) else pd.NA,
        "bytes_per_rank_max": float(per_rank.max()) if len(per_rank) else pd.NA,
        "span_ns": span,
        "busbw_median_gbps": float(bandwidth_calls.median()) if bandwidth_calls is not None
        and bandwidth_calls.notna().any() else pd.NA,
    }  # fmt: skip
    return _frame(pd.DataFrame([row]), RUN_SCHEMAS["overview"])


def _time_lost(base: pd.DataFrame, op_metrics: pd.DataFrame | None, stragglers: pd.DataFrame | None) -> pd.DataFrame:
    """The ``time_lost`` table (see its schema)."""
    schema = RUN_SCHEMAS["time_lost"]
    if op_metrics is None or op_metrics.empty or "duration_ns" not in op_metrics:
        return _frame(pd.DataFrame(), schema)
    cols = [c for c in ("file", "line", "duration_ns", "wait_ns", "transfer_ns", "arrival_skew_ns") if c in op_metrics]
    multi = base[~base["single"]][["file", "line", "parallelism", "logical_id", "global_rank", "kernel_start_sync",
                                   "kernel_end_sync"]]  # fmt: skip
    j = multi.merge(op_metrics[cols].drop_duplicates(["file", "line"]), on=["file", "line"], how="inner")
    for c in ("duration_ns", "wait_ns", "transfer_ns", "arrival_skew_ns", "kernel_start_sync", "kernel_end_sync"):
        j[c] = pd.to_numeric(j[c], errors="coerce").astype("float64") if c in j else np.nan
    j = j[j["duration_ns"].notna()]
    if j.empty:
        return _frame(pd.DataFrame(), schema)
    span = j.groupby("global_rank").agg(lo=("kernel_start_sync", "min"), hi=("kernel_end_sync", "max"))
    span = (span["hi"] - span["lo"]).where(lambda v: v > 0)
    rows = []
    for par, g in j.groupby("parallelism", sort=True):
        wait, transfer = float(g["wait_ns"].sum()), float(g["transfer_ns"].sum())
        per_rank = g.groupby("global_rank")["duration_ns"].sum() / span.reindex(g["global_rank"].unique()).to_numpy()
        row = {"parallelism": par, "communicators": int(g["logical_id"].nunique()), "calls_timed": len(g),
               "comm_time_s": float(g["duration_ns"].sum()) / 1e9, "wait_s": wait / 1e9, "transfer_s": transfer / 1e9,
               "wait_share": wait / (wait + transfer) if wait + transfer > 0 else np.nan,
               "median_arrival_skew_us": float(g["arrival_skew_ns"].median()) / 1e3,
               "comm_share_of_span": float(per_rank.median()) if per_rank.notna().any() else np.nan}  # fmt: skip
        if stragglers is not None and not stragglers.empty:
            st = stragglers[(stragglers["parallelism"].astype("string") == par).fillna(False)]
            caused = pd.to_numeric(st["wait_caused_ns"], errors="coerce").astype("float64").fillna(0.0)
            if (caused > 0).any():
                top = st.loc[caused.idxmax()]
                share = pd.to_numeric(pd.Series([top["last_share"]]), errors="coerce").astype("float64").iloc[0]
                row.update(top_straggler_rank=int(top["global_rank"]), straggler_last_share=share,
                           straggler_wait_caused_s=float(caused.max()) / 1e9)
        rows.append(row)
    out = pd.DataFrame(rows).sort_values("comm_time_s", ascending=False, kind="stable")
    return _frame(out, schema)


def run_tables(
    ops: pd.DataFrame, op_metrics: pd.DataFrame | None = None, volume: pd.DataFrame | None = None,
    quality: pd.DataFrame | None = None, stragglers: pd.DataFrame | None = None,
) -> dict[str, pd.DataFrame]:
    """Summary tables of one run from its ops table (and, when given, its op metrics, volume
    validation, alignment-quality table and the metrics' stragglers). Keys: the names in
    ``RUN_SCHEMAS`` plus ``volume_validation``, ``match_checks`` and ``match_check_findings``
    when given."""
    base, dups = _prepare(ops)
    kernels = _kernels(base)
    bw_calls = None
    if op_metrics is not None and "busbw_gbps" in op_metrics and not op_metrics.empty:
        multi = base[~base["single"]]
        large = multi[pd.to_numeric(multi["message_bytes"], errors="coerce").fillna(0) >= LARGE_MESSAGE_BYTES]
        keyed = large[["file", "line"]].merge(
            op_metrics[["file", "line", "busbw_gbps"]].drop_duplicates(["file", "line"]), on=["file", "line"])
        bw_calls = pd.to_numeric(keyed["busbw_gbps"], errors="coerce")
    rank_volume, rank_volume_by_op = _rank_volume(base, dups)
    # ranks of countable calls and duplicate lines together (without concatenating the frames)
    nranks = max(int(pd.concat([base["global_rank"], dups["global_rank"]]).nunique(dropna=True)), 1)
    tables = {
        "overview": _overview(ops, base, dups, kernels, bw_calls),
        "op_counts": _op_counts(base, dups),
        "kernel_counts": _kernel_counts(kernels),
        "volume_by_op": _volume_by(base, dups, "op", nranks),
        "volume_by_parallelism": _volume_by(base, dups, "parallelism", nranks),
        "rank_volume": rank_volume,
        "rank_volume_by_op": rank_volume_by_op,
        "message_sizes": _message_sizes(base, dups),
        "bandwidth": _bandwidth(base, op_metrics),
        "time_lost": _time_lost(base, op_metrics, stragglers),
        "alignment": _alignment(ops),
    }
    if volume is not None:
        # produced by the volume model; its columns are rendered as they come
        tables["volume_validation"] = volume.reset_index(drop=True).copy()
    if quality is not None:
        tables.update(match_check_tables(quality))
    return tables


def match_check_tables(quality: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """"Can I trust these matches?": per check, over the run's processes, how many matches it
    confirmed, contradicted (demoted) and could not test (``match_checks``); and every process
    a check has something to say about (``match_check_findings``)."""
    q = quality.copy()
    q["applicable"] = q["applicable"].astype("boolean").fillna(False)
    checks = q.groupby("check", sort=False).agg(
        processes=("process", "nunique"), applicable_in=("applicable", "sum"), confirmed=("confirmed", "sum"),
        contradicted=("contradicted", "sum"), not_checkable=("not_checkable", "sum")).reset_index()
    findings = q[(q["contradicted"].fillna(0) > 0) | q["message"].notna()]
    return {"match_checks": checks.astype({"applicable_in": "int64"}),
            "match_check_findings": findings[["process", "check", "confirmed", "contradicted", "message"]]
            .reset_index(drop=True)}


# --------------------------------------------------------------------------- campaign tables

_DEFAULTS = {"tp": 1, "pp": 1, "vpp": 1, "ep": 1, "cp": 1, "num_experts": 0, "sequence_parallel": False,
             "distributed_optimizer": False}  # fmt: skip


def config_row(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The configuration columns (``CONFIG_FIELDS``) of one run from its settings. Accepts a flat
    settings mapping or a run.yaml-like one with ``config`` (and ``derived``) sections."""
    s: dict[str, Any] = {}
    if isinstance(settings.get("config"), Mapping):
        s.update(settings["config"])
        if isinstance(settings.get("derived"), Mapping):
            s.update({k: v for k, v in settings["derived"].items() if s.get(k) is None})
    else:
        s.update(settings)
    for k, v in _DEFAULTS.items():
        if s.get(k) is None:
            s[k] = v
    if s.get("model") is None and s.get("name") is not None:
        s["model"] = s["name"]
    row = {f.name: s.get(f.name) for f in CONFIG_FIELDS}
    try:
        world = int(s["nodes"]) * int(s["gpus_per_node"])
        row["world_size"] = world
        if row.get("dp") is None:
            row["dp"] = world // max(int(s["tp"]) * int(s["pp"]) * int(s["cp"]), 1)
    except (KeyError, TypeError, ValueError):
        pass
    if not s.get("num_experts"):
        row["moe_token_dispatcher"] = None  # dispatcher/top-k defaults mean nothing for a dense model
        row["moe_router_topk"] = None
    return row


def campaign_tables(
    per_run: Mapping[str, Mapping[str, pd.DataFrame]], settings: Mapping[str, Mapping[str, Any]]
) -> dict[str, pd.DataFrame]:
    """Campaign tables: ``runs`` (one row per configuration: settings + overview) and every run
    table stacked with a leading ``run`` column. Runs with settings but no tables appear in ``runs``
    with ``available`` False, so a failed configuration is visible rather than absent."""
    order = list(settings) + sorted(r for r in per_run if r not in settings)
    rows = []
    for run in order:
        row: dict[str, Any] = {"run": run, "available": run in per_run}
        row.update(config_row(settings.get(run, {})))
        ov = per_run.get(run, {}).get("overview")
        if ov is not None and len(ov):
            row.update({k: v for k, v in ov.iloc[0].items()})
        rows.append(row)
    out = {"runs": _frame(pd.DataFrame(rows), CAMPAIGN_RUNS_SCHEMA)}
    names = sorted({n for t in per_run.values() for n in t} - {"overview"})
    for name in names:
        parts = [per_run[r][name].assign(run=r) for r in order if r in per_run and name in per_run[r]]
        parts = [p for p in parts if len(p)] or parts[:1]
        df = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame({"run": []})
        df = df[["run"] + [c for c in df.columns if c != "run"]]
        schema = campaign_schema(name)
        out[name] = _frame(df, schema) if schema is not None else df.reset_index(drop=True)
    return out


# --------------------------------------------------------------------------- writing


def table_schema(name: str, df: pd.DataFrame) -> pa.Schema | None:
    """Documented schema for a table written under ``name`` (run or campaign flavour), or None
    for tables whose columns come from elsewhere (volume_validation)."""
    if name in RUN_SCHEMAS or name == "runs":
        return campaign_schema(name) if "run" in df.columns else RUN_SCHEMAS.get(name)
    return None


def _upstream_table(name: str, df: pd.DataFrame) -> pa.Table:
    """Arrow table of a table produced by another module, keeping the units and meanings of its
    documented columns when that module's schema is importable (columns as they come otherwise)."""
    table = pa.Table.from_pandas(df.reset_index(drop=True), preserve_index=False)
    documented: dict[str, pa.Field] = {}
    if name == "volume_validation":
        try:
            from .volume import VOLUME_SCHEMA

            documented = {f.name: f for f in VOLUME_SCHEMA}
        except ImportError:  # the volume model is optional for summaries
            documented = {}
    fields = []
    for f in table.schema:
        doc = documented.get(f.name)
        fields.append(f.with_metadata(doc.metadata) if doc is not None and doc.metadata else f)
    schema = pa.schema(fields, metadata={"table": name, "doc": "columns as produced upstream"})
    return table.cast(schema)


def write_tables(tables: Mapping[str, pd.DataFrame], out_dir: Path | str) -> dict[str, Path]:
    """Write each table as ``<name>.parquet`` (documented schema) and ``<name>.csv``, both
    atomically. Returns {"<name>.parquet": path, "<name>.csv": path, ...}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, df in tables.items():
        schema = table_schema(name, df)
        if schema is not None:
            table = pa.Table.from_pandas(_frame(df, schema), schema=schema, preserve_index=False)
        else:
            table = _upstream_table(name, df)
        pq_path = out_dir / f"{name}.parquet"
        write_table_atomic(table, pq_path)
        # nullable dtypes (one map, tables.read_table's): integer columns with nulls stay integers in the CSV
        frame = read_table_batch(table)
        csv_path = out_dir / f"{name}.csv"
        with atomic_output(csv_path) as tmp:
            frame.to_csv(tmp, index=False, float_format=_float_format)
        written[f"{name}.parquet"] = pq_path
        written[f"{name}.csv"] = csv_path
    return written


def _float_format(x: float) -> str:
    # 10 significant digits: exact enough for shares and GB/s, stable across platforms
    return "" if math.isnan(x) else f"{x:.10g}"
