"""Summary tables of a run and of a campaign: what was communicated, how much, and how fast.

Every table is computed from the enriched per-operation table (``ops.parquet``), counting call
rows only and never duplicate log lines; volumes are payload bytes per rank, as in the thesis
figures (not bytes on the wire), and calls on single-rank communicators are kept apart rather
than inflating counts. :class:`RunTablesBuilder` takes the ops table in batches (the report
stage's way, :func:`iter_run_batches`), :func:`run_tables` a table in memory. Conventions and
inputs: ``docs/architecture.md``, Module notes; columns: ``docs/tables.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from nccltrace.core.batch_stats import (
    FirstSeen,
    GroupValues,
    KeyIds,
    PartialSums,
    median_of_counts,
)
from nccltrace.core.settings import flatten_settings
from nccltrace.core.tables import (
    atomic_output,
    coerce_to_schema,
    frame_to_table,
    iter_record_batches,
    read_table_batch,
    write_table_atomic,
)
from nccltrace.core.tables import documented_field as _f
from nccltrace.megatron.model import MODEL_DEFAULTS

# The ops columns run_tables and nccltrace.outputs.plots.run_plots read (the workflow reads only these;
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


MATCH_CHECK_SCHEMAS: dict[str, pa.Schema] = {
    "match_checks": _schema("match_checks", "\"Can I trust these matches?\": per check of the alignment, over the "
                            "run's processes, the matches it confirmed, contradicted (demoted) and could not test.", [
        _f("check", pa.string(), "", "the check (alignment_quality.check)"),
        _f("processes", pa.int64(), "processes", "processes with a row for the check"),
        _f("applicable_in", pa.int64(), "processes", "processes the check applied to"),
        _f("confirmed", pa.int64(), "matches", "matches the check confirmed"),
        _f("contradicted", pa.int64(), "matches", "matches it contradicted (demoted to unmatched)"),
        _f("not_checkable", pa.int64(), "matches", "matches it could not test"),
    ]),
    "match_check_findings": _schema("match_check_findings", "Every process a match check has something to say "
                                    "about: a contradiction or a message.", [
        _f("process", pa.string(), "", "the process (aligned/<host>/<process>)"),
        _f("check", pa.string(), "", "the check"),
        _f("confirmed", pa.int64(), "matches", "matches it confirmed on the process"),
        _f("contradicted", pa.int64(), "matches", "matches it contradicted (demoted)"),
        _f("message", pa.string(), "", "what the check says, and what to do"),
    ]),
}  # fmt: skip


def written_schema(name: str) -> pa.Schema | None:
    """The documented schema of a run's summary table ``name``: :data:`RUN_SCHEMAS`, the match
    checks' and the volume validation's (nccltrace.metrics.schema), None for any other name."""
    if name == "volume_validation":
        from nccltrace.metrics.schema import VOLUME_SCHEMA

        return VOLUME_SCHEMA
    return RUN_SCHEMAS.get(name) or MATCH_CHECK_SCHEMAS.get(name)


def campaign_schema(name: str) -> pa.Schema | None:
    """Schema of a campaign table: the run table's columns after a ``run`` column (the volume
    validation has its own)."""
    if name == "runs":
        return CAMPAIGN_RUNS_SCHEMA
    base = written_schema(name)
    if base is None or base.names[0] == "run":
        return base
    return _schema(name, (base.metadata or {}).get(b"doc", b"").decode() + " One block of rows per run.",
                   [_RUN] + list(base))


# --------------------------------------------------------------------------- helpers

def _frame(rows: pd.DataFrame | dict[str, Any], schema: pa.Schema) -> pd.DataFrame:
    """The columns of ``schema`` in order with nullable dtypes; absent columns are all null."""
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    return coerce_to_schema(df.reset_index(drop=True), schema)


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
    # a run has few distinct kernel names: parse each once
    codes, uniques = pd.factorize(names.astype("string"))
    fam = pd.Series(uniques, dtype="string").str.extract(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")[0]
    fam = pd.Series(fam.where(fam != "Generic").array.take(codes, allow_fill=True), index=names.index)
    return fam.fillna(ops.astype("string")).astype("string")


def _share(x: pd.Series) -> pd.Series:
    total = float(x.sum())
    return x / total if total > 0 else pd.Series([float("nan")] * len(x), index=x.index)


def _mode(counts: pd.Series) -> Any:
    """The most frequent value of {value: count} (NA without values); ties broken alphabetically
    so the table does not depend on row order."""
    if counts.empty:
        return pd.NA
    return min(counts.index[counts == counts.max()])


def _f64(frame: pd.DataFrame, column: str) -> np.ndarray:
    """A column as a float64 array (NaN for missing values, all NaN when the column is absent)."""
    if column not in frame:
        return np.full(len(frame), np.nan)
    return pd.to_numeric(frame[column], errors="coerce").astype("Float64").to_numpy(dtype=np.float64, na_value=np.nan)


# --------------------------------------------------------------------------- run tables
#
# One implementation whether the ops table is in memory or read in batches: RunTablesBuilder
# takes the table a batch at a time and keeps per-group partial aggregates (sums, value counts,
# the values a median needs), never the rows; run_tables feeds it the whole table as one batch.

_COUNTS = ["calls", "bytes", "calls_single_rank", "bytes_single_rank", "duplicate_lines", "matched_calls"]
# the finest grouping of the counts: every count table is a sum over some of these keys
_FINE = ["parallelism", "op", "global_rank", "bucket"]
# the op-metrics columns joined to the calls (file, line are the key)
_METRIC_VALUES = [c for c in OP_METRICS_COLUMNS if c not in ("file", "line")]
_BW_KEYS = ["parallelism", "logical_id", "nranks", "op", "bucket"]
# bandwidth table column: the per-call value whose median it is
_BW_MEDIANS = {"algbw_median_gbps": "algbw_gbps", "transfer_busbw_median_gbps": "transfer_busbw_gbps",
               "duration_median_ns": "duration_ns", "wait_share_median": "wait_share",
               "efficiency_median": "efficiency"}  # fmt: skip
_BW_MODES = ["limit_link", "algorithm", "protocol"]
_LARGE_BUCKET = LARGE_MESSAGE_BYTES.bit_length() - 1  # message_bytes >= LARGE_MESSAGE_BYTES <=> bucket >= this


def _prepare(ops: pd.DataFrame, metrics: pd.DataFrame | None = None) -> pd.DataFrame:
    """The call rows of ``ops`` (the columns the tables read) with helper columns: ``bytes`` as
    int64 (0 when missing), ``bucket`` (its size bucket), ``dup`` (a duplicate log line: never
    counted), ``single`` (on a single-rank communicator), ``multi`` (countable: neither),
    ``matched``; and the op-metrics columns of ``metrics``, the call rows' metrics in their order."""
    is_call = (ops["row_kind"].astype("string") == "call").fillna(False).to_numpy(dtype=bool)
    calls = ops.loc[is_call, [c for c in OPS_COLUMNS if c in ops]].reset_index(drop=True)
    calls["parallelism"] = calls["parallelism"].astype("string").fillna(UNKNOWN)
    calls["op"] = calls["op"].astype("string").fillna(UNKNOWN)
    calls["bytes"] = pd.to_numeric(calls["bytes"], errors="coerce").fillna(0).astype("int64")
    calls["bucket"] = size_bucket(calls["bytes"])
    calls["dup"] = calls["duplicate_of"].notna().to_numpy(dtype=bool)
    # nranks null (unresolved call) counts as multi-rank: only a logged size of 1 proves no data moved
    calls["single"] = (pd.to_numeric(calls["nranks"], errors="coerce") == 1).fillna(False).astype(bool)
    calls["multi"] = ~calls["dup"] & ~calls["single"]
    calls["matched"] = (calls["status"].astype("string") == "matched").fillna(False).astype(bool)
    if metrics is not None:
        if len(metrics) != len(calls):
            raise ValueError(f"{len(metrics)} op-metrics rows for {len(calls)} call rows")
        for c in _METRIC_VALUES:
            if c in metrics:
                calls[c] = metrics[c].array
    return calls


def _metrics_of_calls(ops: pd.DataFrame, op_metrics: pd.DataFrame) -> pd.DataFrame:
    """The op-metrics row of each call row of ``ops`` by (file, line), in the calls' order (all
    null where the metrics have none)."""
    is_call = (ops["row_kind"].astype("string") == "call").fillna(False).to_numpy(dtype=bool)
    keyed = op_metrics[[c for c in OP_METRICS_COLUMNS if c in op_metrics]].drop_duplicates(["file", "line"])
    return ops.loc[is_call, ["file", "line"]].merge(keyed, on=["file", "line"], how="left")


def _alignment_rows(ops: pd.DataFrame) -> pd.DataFrame:
    """(row_kind, status, reason) of every row of ``ops``, with ``rows`` 1 to count them."""
    kind = ops["row_kind"].astype("string")
    # a duplicate line may carry another reason in older tables; name it by what makes it uncounted
    dup = (kind == "call") & ops["duplicate_of"].notna()
    return pd.DataFrame({"row_kind": kind, "status": ops["status"].astype("string").mask(dup, "unmatched"),
                         "reason": ops["reason"].astype("string").mask(dup, "duplicate_line"), "rows": 1})  # fmt: skip


def _fine_rows(calls: pd.DataFrame) -> pd.DataFrame:
    """Each call's contribution to the counts, keyed by (parallelism, op, global rank, size bucket)."""
    multi, dup = calls["multi"], calls["dup"]
    single = calls["single"] & ~dup
    return calls[_FINE].assign(
        calls=multi.astype("int64"), bytes=calls["bytes"].where(multi, 0),
        calls_single_rank=single.astype("int64"), bytes_single_rank=calls["bytes"].where(single, 0),
        duplicate_lines=dup.astype("int64"), matched_calls=(multi & calls["matched"]).astype("int64"))  # fmt: skip


def _grouped(fine: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The counts per group of ``keys`` (sorted, missing keys last), summed from the finest grouping."""
    t = fine.groupby(keys, dropna=False, sort=False, as_index=False)[_COUNTS].sum()
    t[_COUNTS] = t[_COUNTS].astype("int64")
    return t.sort_values(keys, na_position="last", kind="stable").reset_index(drop=True)


def _op_counts(fine: pd.DataFrame) -> pd.DataFrame:
    t = _grouped(fine, ["parallelism", "op"])
    t["share_calls"] = _share(t["calls"])
    t["share_bytes"] = _share(t["bytes"])
    return _frame(t, RUN_SCHEMAS["op_counts"])


def _kernel_counts(kernels: pd.DataFrame) -> pd.DataFrame:
    t = kernels.sort_values(["parallelism", "kernel_op"], kind="stable").reset_index(drop=True)
    t["share_kernels"] = _share(t["kernels"])
    return _frame(t, RUN_SCHEMAS["kernel_counts"])


def _volume_by(fine: pd.DataFrame, sizes: pd.DataFrame, key: str, nranks: int) -> pd.DataFrame:
    """Volume per ``key`` ('op' or 'parallelism'); ``sizes``: multi-rank calls per (parallelism, op, bytes)."""
    t = _grouped(fine, [key])
    # sum per (key, rank) of the ranks with multi-rank calls first, then the largest
    per_rank = fine.groupby([key, "global_rank"], dropna=False)[["calls", "bytes"]].sum()
    per_rank = per_rank.loc[per_rank["calls"] > 0, "bytes"].groupby(level=0).max()
    t["bytes_per_rank_max"] = t[key].map(per_rank).astype("Float64").fillna(0.0)
    t["bytes_per_rank_mean"] = t["bytes"] / nranks
    hist = sizes.groupby([key, "bytes"], as_index=False)["n"].sum()
    median = {k: median_of_counts(h["bytes"].to_numpy(), h["n"].to_numpy()) for k, h in hist.groupby(key)}
    t["bytes_per_call_median"] = t[key].map(pd.Series(median, dtype="float64")).astype("Float64")
    t["share_bytes"] = _share(t["bytes"])
    return _frame(t, RUN_SCHEMAS["volume_by_op" if key == "op" else "volume_by_parallelism"])


def _rank_volume(fine: pd.DataFrame, rank_hosts: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    t = _grouped(fine, ["global_rank"])
    hosts = rank_hosts.groupby("global_rank", dropna=False)["host"].agg(
        lambda s: ",".join(sorted(set(s.dropna().astype(str)))))
    t["host"] = t["global_rank"].map(hosts)
    t["share_bytes"] = _share(t["bytes"])
    by_op = _grouped(fine, ["global_rank", "op"])
    by_op = by_op[(by_op["calls"] > 0) | (by_op["calls_single_rank"] > 0)]
    return _frame(t, RUN_SCHEMAS["rank_volume"]), _frame(by_op, RUN_SCHEMAS["rank_volume_by_op"])


def _message_sizes(fine: pd.DataFrame) -> pd.DataFrame:
    t = _grouped(fine, ["bucket", "op"])
    t = t[(t["calls"] > 0) | (t["calls_single_rank"] > 0)].reset_index(drop=True)
    t = t.assign(**_bucket_columns(t["bucket"]))
    return _frame(t, RUN_SCHEMAS["message_sizes"])


def _alignment(counts: pd.DataFrame) -> pd.DataFrame:
    keys = ["row_kind", "status", "reason"]
    t = counts.sort_values(keys, na_position="last", kind="stable")
    t["rows"] = t["rows"].astype("int64")
    t["share"] = t["rows"] / t.groupby("row_kind", dropna=False)["rows"].transform("sum")
    t = t.sort_values(["row_kind", "status", "rows"], ascending=[True, True, False], kind="stable")
    return _frame(t, RUN_SCHEMAS["alignment"])


class _Bandwidth:
    """Partial aggregates of the bandwidth table: per group of :data:`_BW_KEYS`, the calls with a
    bus bandwidth, their values for the medians and quantiles, and counts of the values taken
    by limits, link types, algorithms and protocols (they repeat; their median or mode is taken)."""

    def __init__(self) -> None:
        self.groups = KeyIds()
        self.calls = PartialSums(["g"], {"calls": "sum"})
        self.values = GroupValues(["busbw_gbps", *_BW_MEDIANS.values()])
        self.limits = PartialSums(["g", "value"], {"n": "sum"})
        self.modes = PartialSums(["g", "column", "value"], {"n": "sum"})

    def add(self, multi: pd.DataFrame) -> None:
        """Add one batch's multi-rank calls (with their op-metrics columns)."""
        j = multi[~np.isnan(_f64(multi, "busbw_gbps"))]
        if j.empty:
            return
        g = self.groups.codes(pd.DataFrame({  # -1: a groupby placeholder for unknown, null again in the table
            "parallelism": j["parallelism"], "logical_id": j["logical_id"].astype("Int64").fillna(-1),
            "nranks": j["nranks"].astype("Int64").fillna(-1), "op": j["op"], "bucket": size_bucket(j["message_bytes"])}))
        ids, n = np.unique(g, return_counts=True)
        self.calls.add(pd.DataFrame({"g": ids, "calls": n}))
        values = {c: _f64(j, c) for c in ("busbw_gbps", "algbw_gbps", "transfer_busbw_gbps", "duration_ns",
                                          "efficiency")}  # fmt: skip
        dur = values["duration_ns"]
        with np.errstate(invalid="ignore", divide="ignore"):
            values["wait_share"] = _f64(j, "wait_ns") / np.where(dur > 0, dur, np.nan)
        self.values.add(g, values)
        limit = _f64(j, "limit_gbps")
        self.limits.add(pd.DataFrame({"g": g, "value": limit, "n": 1})[~np.isnan(limit)])
        for c in _BW_MODES:
            if c in j:
                # counted per (group, value code), named by the few distinct values
                codes, uniques = pd.factorize(j[c])
                has = codes >= 0
                key, n = np.unique(g[has] * len(uniques) + codes[has], return_counts=True)
                names = np.array([str(v) for v in uniques], dtype=object)
                self.modes.add(pd.DataFrame({"g": key // max(len(uniques), 1), "column": c,
                                             "value": names[key % max(len(uniques), 1)], "n": n}))  # fmt: skip

    def table(self) -> pd.DataFrame:
        """The ``bandwidth`` table, one row per group in key order."""
        calls = self.calls.total().set_index("g")["calls"]
        if calls.empty:
            return _frame(pd.DataFrame(), RUN_SCHEMAS["bandwidth"])
        limits = {g: (t["value"].to_numpy(), t["n"].to_numpy()) for g, t in self.limits.total().groupby("g")}
        modes = {k: t.set_index("value")["n"] for k, t in self.modes.total().groupby(["g", "column"])}
        rows = []
        for g in sorted(calls.index, key=lambda i: self.groups.keys[i]):
            bw = pd.Series(self.values.get(g, "busbw_gbps"), dtype="float64")
            row = dict(zip(_BW_KEYS, self.groups.keys[g]), calls=int(calls[g]), busbw_p10_gbps=bw.quantile(0.1),
                       busbw_median_gbps=bw.median(), busbw_p90_gbps=bw.quantile(0.9),
                       limit_gbps=median_of_counts(*limits[g]) if g in limits else np.nan)  # fmt: skip
            row.update({name: self.values.median(g, c) for name, c in _BW_MEDIANS.items()})
            row.update({c: _mode(modes.get((g, c), pd.Series(dtype="int64"))) for c in _BW_MODES})
            rows.append(row)
        t = pd.DataFrame(rows)
        t = t.assign(**_bucket_columns(t["bucket"]))
        for c in ("logical_id", "nranks"):
            t[c] = t[c].astype("Int64").where(t[c] >= 0)
        return _frame(t, RUN_SCHEMAS["bandwidth"])

    def busbw_median_large(self) -> Any:
        """Median bus bandwidth of the calls whose message size S is at least 1 MiB (NA without)."""
        groups = [int(g) for g in self.calls.total()["g"] if self.groups.keys[int(g)][-1] >= _LARGE_BUCKET]
        values = np.concatenate([self.values.get(g, "busbw_gbps") for g in groups] or [np.zeros(0)])
        # no missing values are kept: numpy's median in place is Series.median without a copy
        return float(np.median(values, overwrite_input=True)) if len(values) else pd.NA


class _TimeLost:
    """Partial aggregates of the ``time_lost`` table over the multi-rank calls with a kernel
    duration: sums per parallelism and per (parallelism, rank), each rank's first kernel start
    and last kernel end, the communicators seen, and the arrival skews for their median."""

    def __init__(self) -> None:
        self.pars = KeyIds()
        self.sums = PartialSums(["parallelism"], dict.fromkeys(["calls_timed", "duration_ns", "wait_ns", "transfer_ns"],
                                                               "sum"))  # fmt: skip
        self.rank_time = PartialSums(["parallelism", "global_rank"], {"duration_ns": "sum"})
        self.span = PartialSums(["global_rank"], {"lo": "min", "hi": "max"})
        self.comms = PartialSums(["parallelism", "logical_id"], {"n": "sum"})
        self.skew = GroupValues(["arrival_skew_ns"])

    def add(self, multi: pd.DataFrame) -> None:
        """Add one batch's multi-rank calls (with their op-metrics columns)."""
        dur = _f64(multi, "duration_ns")
        j = multi[~np.isnan(dur)]
        if j.empty:
            return
        f = pd.DataFrame({"parallelism": j["parallelism"].array, "logical_id": j["logical_id"].array,
                          "global_rank": j["global_rank"].array, "calls_timed": 1, "duration_ns": dur[~np.isnan(dur)],
                          "wait_ns": _f64(j, "wait_ns"), "transfer_ns": _f64(j, "transfer_ns"),
                          "lo": _f64(j, "kernel_start_sync"), "hi": _f64(j, "kernel_end_sync"), "n": 1})  # fmt: skip
        self.sums.add(f)
        ranked = f[f["global_rank"].notna()]  # a rank's span and time: calls of a known rank
        self.rank_time.add(ranked)
        self.span.add(ranked)
        self.comms.add(f[f["logical_id"].notna()])
        self.skew.add(self.pars.codes(f[["parallelism"]]), {"arrival_skew_ns": _f64(j, "arrival_skew_ns")})

    def table(self, stragglers: pd.DataFrame | None) -> pd.DataFrame:
        """The ``time_lost`` table (see its schema), largest communication time first."""
        sums = self.sums.total().set_index("parallelism").sort_index()
        if sums.empty:
            return _frame(pd.DataFrame(), RUN_SCHEMAS["time_lost"])
        span = self.span.total().set_index("global_rank")
        span = (span["hi"] - span["lo"]).where(lambda v: v > 0)
        rank_time = self.rank_time.total()
        comms = self.comms.total().groupby("parallelism")["logical_id"].nunique()
        rows = []
        for par, s in sums.iterrows():
            wait, transfer = float(s["wait_ns"]), float(s["transfer_ns"])
            per_rank = rank_time[rank_time["parallelism"] == par].set_index("global_rank")["duration_ns"]
            per_rank = per_rank / span.reindex(per_rank.index)  # each rank's kernel time over its own span
            row = {"parallelism": par, "communicators": int(comms.get(par, 0)), "calls_timed": int(s["calls_timed"]),
                   "comm_time_s": float(s["duration_ns"]) / 1e9, "wait_s": wait / 1e9, "transfer_s": transfer / 1e9,
                   "wait_share": wait / (wait + transfer) if wait + transfer > 0 else np.nan,
                   "median_arrival_skew_us": self.skew.median(self.pars.ids[(par,)], "arrival_skew_ns") / 1e3,
                   "comm_share_of_span": float(per_rank.median()) if per_rank.notna().any() else np.nan}  # fmt: skip
            row.update(_top_straggler(stragglers, par))
            rows.append(row)
        out = pd.DataFrame(rows).sort_values("comm_time_s", ascending=False, kind="stable")
        return _frame(out, RUN_SCHEMAS["time_lost"])


def _top_straggler(stragglers: pd.DataFrame | None, par: str) -> dict[str, Any]:
    """The straggler columns of ``time_lost`` for one parallelism (empty without stragglers)."""
    if stragglers is None or stragglers.empty:
        return {}
    st = stragglers[(stragglers["parallelism"].astype("string") == par).fillna(False)]
    caused = pd.to_numeric(st["wait_caused_ns"], errors="coerce").astype("float64").fillna(0.0)
    if not (caused > 0).any():
        return {}
    top = st.loc[caused.idxmax()]
    share = pd.to_numeric(pd.Series([top["last_share"]]), errors="coerce").astype("float64").iloc[0]
    return {"top_straggler_rank": int(top["global_rank"]), "straggler_last_share": share,
            "straggler_wait_caused_s": float(caused.max()) / 1e9}


def _extreme(pick: Any, a: Any, b: Any) -> Any:
    """``pick`` (min or max) of two values that may be missing (NA when both are)."""
    present = [v for v in (a, b) if not pd.isna(v)]
    return pick(present) if present else pd.NA


class RunTablesBuilder:
    """The summary tables of one run (:data:`RUN_SCHEMAS`) from its ops table fed in batches of
    consecutive rows, in table order, in memory that does not hold the rows.

    Counts and sums are kept per group and added up; distinct kernels are found with one int64
    per kernel key (:class:`~nccltrace.core.batch_stats.FirstSeen`); medians and quantiles keep only the
    float values they are taken over. ``metric_columns``: the op-metrics columns each batch
    brings (None: the run has no op metrics; bandwidth and time_lost stay empty). ``kernels``:
    a kernel-key set to share with a :class:`~nccltrace.outputs.plots.TimelineBuilder` fed the same rows."""

    def __init__(self, metric_columns: Iterable[str] | None = None, kernels: FirstSeen | None = None) -> None:
        cols = set(metric_columns) if metric_columns is not None else None
        self.with_metrics = cols is not None
        self._bandwidth = _Bandwidth() if cols is not None and "busbw_gbps" in cols else None
        self._time_lost = _TimeLost() if cols is not None and "duration_ns" in cols else None
        self._alignment = PartialSums(["row_kind", "status", "reason"], {"rows": "sum"})
        self._fine = PartialSums(_FINE, dict.fromkeys(_COUNTS, "sum"))
        self._sizes = PartialSums(["parallelism", "op", "bytes"], {"n": "sum"})  # multi-rank calls per size
        self._rank_hosts = PartialSums(["global_rank", "host"], {"n": "sum"})
        self._kernels = PartialSums(["parallelism", "kernel_op"], {"kernels": "sum", "kernel_time_ns": "sum"})
        self._kernel_seen = kernels if kernels is not None else FirstSeen()
        self._span: tuple[Any, Any] = (pd.NA, pd.NA)  # first kernel start, last kernel end of multi-rank calls

    def add(self, ops: pd.DataFrame, metrics: pd.DataFrame | None = None) -> None:
        """Add consecutive rows of the ops table; ``metrics``: the op-metrics rows of its call
        rows, one per call row in the same order (required when the builder has metric columns)."""
        if self.with_metrics and metrics is None:
            raise ValueError("this run's tables use op metrics: pass the batch's op-metrics rows")
        self._alignment.add(_alignment_rows(ops))
        calls = _prepare(ops, metrics if self.with_metrics else None)
        if calls.empty:
            return
        self._fine.add(_fine_rows(calls))
        self._rank_hosts.add(calls[["global_rank", "host"]].assign(n=1))
        multi = calls[calls["multi"].to_numpy(dtype=bool)]
        self._sizes.add(multi[["parallelism", "op", "bytes"]].assign(n=1))
        self._add_kernels(multi)
        self._span = (_extreme(min, self._span[0], pd.to_numeric(multi["kernel_start_sync"], errors="coerce").min()),
                      _extreme(max, self._span[1], pd.to_numeric(multi["kernel_end_sync"], errors="coerce").max()))
        if self._bandwidth is not None:
            self._bandwidth.add(multi)
        if self._time_lost is not None:
            self._time_lost.add(multi)

    def _add_kernels(self, multi: pd.DataFrame) -> None:
        """Kernels matched to countable calls, counted once at their first call (a fused group's
        calls share one kernel)."""
        k = multi[(multi["matched"] & multi["kernel_correlation_id"].notna()).to_numpy(dtype=bool)]
        k = k[self._kernel_seen.first(k["host"], k["kernel_global_pid"], k["kernel_correlation_id"], tag=0)]
        if k.empty:
            return
        dur = (pd.to_numeric(k["kernel_end"]) - pd.to_numeric(k["kernel_start"])).fillna(0).astype("int64")
        part = pd.DataFrame({"parallelism": k["parallelism"], "kernel_op": _kernel_op(k["kernel_name"], k["op"]),
                             "kernels": 1, "kernel_time_ns": dur})  # fmt: skip
        self._kernels.add(part)

    def tables(self, volume: pd.DataFrame | None = None, quality: pd.DataFrame | None = None,
               stragglers: pd.DataFrame | None = None) -> dict[str, pd.DataFrame]:  # fmt: skip
        """The tables of everything added (see :func:`run_tables`)."""
        fine = self._fine.total()
        for c in _COUNTS:
            fine[c] = fine[c].astype("int64")
        sizes = self._sizes.total()
        kernels = self._kernels.total()
        rank_volume, rank_volume_by_op = _rank_volume(fine, self._rank_hosts.total())
        # ranks of countable calls and duplicate lines together
        nranks = max(int(rank_volume["global_rank"].notna().sum()), 1)
        tables = {
            "overview": self._overview(fine, rank_volume, int(kernels["kernels"].sum()), nranks),
            "op_counts": _op_counts(fine),
            "kernel_counts": _kernel_counts(kernels),
            "volume_by_op": _volume_by(fine, sizes, "op", nranks),
            "volume_by_parallelism": _volume_by(fine, sizes, "parallelism", nranks),
            "rank_volume": rank_volume,
            "rank_volume_by_op": rank_volume_by_op,
            "message_sizes": _message_sizes(fine),
            "bandwidth": self._bandwidth.table() if self._bandwidth else _frame(pd.DataFrame(), RUN_SCHEMAS["bandwidth"]),
            "time_lost": self._time_lost.table(stragglers) if self._time_lost
            else _frame(pd.DataFrame(), RUN_SCHEMAS["time_lost"]),
            "alignment": _alignment(self._alignment.total()),
        }  # fmt: skip
        if volume is not None:
            # produced by the volume model; its columns are rendered as they come
            tables["volume_validation"] = volume.reset_index(drop=True).copy()
        if quality is not None:
            tables.update(match_check_tables(quality))
        return tables

    def _overview(self, fine: pd.DataFrame, rank_volume: pd.DataFrame, kernels: int, ranks: int) -> pd.DataFrame:
        sums = {c: int(fine[c].sum()) for c in _COUNTS}
        # ranks whose calls were all single-rank still count, with zero volume
        with_calls = rank_volume[rank_volume["global_rank"].notna()
                                 & ((rank_volume["calls"] > 0) | (rank_volume["calls_single_rank"] > 0))]
        per_rank = with_calls["bytes"].astype("float64")
        start, end = self._span
        calls = sums["calls"]
        row = {
            "ranks": ranks, "hosts": int(self._rank_hosts.total()["host"].nunique()),
            "call_lines": calls + sums["calls_single_rank"] + sums["duplicate_lines"],
            "calls": calls, "calls_single_rank": sums["calls_single_rank"], "duplicate_lines": sums["duplicate_lines"],
            "kernels": kernels, "matched_calls": sums["matched_calls"],
            "matched_share": sums["matched_calls"] / calls if calls else pd.NA,
            "bytes": sums["bytes"], "bytes_single_rank": sums["bytes_single_rank"],
            "bytes_per_rank_mean": float(sums["bytes"]) / ranks,
            "bytes_per_rank_min": float(per_rank.min()) if len(per_rank) else pd.NA,
            "bytes_per_rank_max": float(per_rank.max()) if len(per_rank) else pd.NA,
            "span_ns": int(end - start) if not pd.isna(start) and not pd.isna(end) else pd.NA,
            "busbw_median_gbps": self._bandwidth.busbw_median_large() if self._bandwidth else pd.NA,
        }  # fmt: skip
        return _frame(pd.DataFrame([row]), RUN_SCHEMAS["overview"])


def run_tables(
    ops: pd.DataFrame, op_metrics: pd.DataFrame | None = None, volume: pd.DataFrame | None = None,
    quality: pd.DataFrame | None = None, stragglers: pd.DataFrame | None = None,
) -> dict[str, pd.DataFrame]:
    """Summary tables of one run from its ops table (and, when given, its op metrics, volume
    validation, alignment-quality table and the metrics' stragglers). Keys: the names in
    ``RUN_SCHEMAS`` plus ``volume_validation``, ``match_checks`` and ``match_check_findings``
    when given. The in-memory form of :class:`RunTablesBuilder` (one batch: the whole table);
    op metrics are joined to the calls by (file, line)."""
    has_metrics = op_metrics is not None and not op_metrics.empty
    builder = RunTablesBuilder(list(op_metrics.columns) if has_metrics else None)
    builder.add(ops, _metrics_of_calls(ops, op_metrics) if has_metrics else None)
    return builder.tables(volume, quality, stragglers)


def iter_run_batches(ops_path: Path | str, op_metrics_path: Path | str | None = None, *,
                     batch_rows: int = 1 << 16) -> Iterator[tuple[pd.DataFrame, pd.DataFrame | None]]:  # fmt: skip
    """The run's ops table (:data:`OPS_COLUMNS`) in batches of at most ``batch_rows`` rows, each
    with the op-metrics rows (:data:`OP_METRICS_COLUMNS`) of its call rows (None without
    ``op_metrics_path``).

    The metrics stage writes one op-metrics row per call row, in the ops table's order; this is
    checked batch by batch on (file, line), and a table that does not follow the other raises
    ValueError naming both files. Memory holds about one row group and one batch of each."""
    import pyarrow.compute as pc

    metrics = _AlignedMetrics(Path(ops_path), Path(op_metrics_path), batch_rows) if op_metrics_path else None
    for batch in iter_record_batches(ops_path, OPS_COLUMNS, batch_rows):
        m = None
        if metrics is not None:
            m = read_table_batch(metrics.take(batch.filter(pc.equal(batch.column("row_kind"), "call"))))
        yield read_table_batch(batch), m
    if metrics is not None:
        metrics.finish()


class _AlignedMetrics:
    """The op-metrics table read alongside the ops table: ``take`` returns the next rows, one per
    call row given, after checking that they name the same (file, line)."""

    def __init__(self, ops_path: Path, path: Path, batch_rows: int) -> None:
        import pyarrow.parquet as pq

        self.ops_path, self.path = ops_path, path
        schema = pq.read_schema(path)
        self._batches = iter_record_batches(path, OP_METRICS_COLUMNS, batch_rows)
        self._buffer = pa.schema([schema.field(c) for c in OP_METRICS_COLUMNS if c in schema.names]).empty_table()
        self._taken = 0  # rows handed out so far

    def _error(self, what: str) -> ValueError:
        return ValueError(f"{self.path} does not follow the call rows of {self.ops_path} (one op-metrics row per "
                          f"call row, in the same order): {what}; run the metrics stage again on this ops table")

    def take(self, calls: pa.RecordBatch) -> pa.Table:
        """The op-metrics rows of ``calls``, the next call rows of the ops table."""
        n = calls.num_rows
        parts = [self._buffer]
        while sum(p.num_rows for p in parts) < n:
            batch = next(self._batches, None)
            if batch is None:
                raise self._error(f"it ends after {self._taken + sum(p.num_rows for p in parts)} rows, before the "
                                  f"ops table's call rows do")
            parts.append(pa.Table.from_batches([batch]))
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        out, self._buffer = table.slice(0, n), table.slice(n)
        for key in ("file", "line"):
            ours, theirs = calls.column(key), out.column(key).combine_chunks()
            if not ours.equals(theirs.cast(ours.type)):
                i = next(i for i, (a, b) in enumerate(zip(ours.to_pylist(), theirs.to_pylist())) if a != b)
                raise self._error(f"call row {self._taken + i} is ({calls.column('file')[i]}, {calls.column('line')[i]}), "
                                  f"op-metrics row {self._taken + i} is ({out.column('file')[i]}, {out.column('line')[i]})")
        self._taken += n
        return out

    def finish(self) -> None:
        """Check that no op-metrics row is left over."""
        rest = self._buffer.num_rows + sum(b.num_rows for b in self._batches)
        if rest:
            raise self._error(f"{rest} rows are left after the ops table's {self._taken} call rows")


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

# The configuration columns a run that does not state them shows with Megatron's default.
_DEFAULTS = {k: MODEL_DEFAULTS[k] for k in ("tp", "pp", "vpp", "ep", "cp", "num_experts", "sequence_parallel",
                                            "distributed_optimizer")}  # fmt: skip


def config_row(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The configuration columns (``CONFIG_FIELDS``) of one run from its settings. Accepts a flat
    settings mapping, a run.yaml-like one with ``config`` (and ``derived``) sections, or
    :class:`~nccltrace.core.settings.RunSettings`; nesting is read as everywhere else
    (:func:`~nccltrace.core.settings.flatten_settings`: top level over config over derived, and
    a null here shows the lower level's value)."""
    s = flatten_settings(settings, skip_none=True)
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


def table_schema(name: str, df: pd.DataFrame) -> pa.Schema:
    """Documented schema for a table written under ``name`` (run or campaign flavour); a table
    without one is a defect of the caller (every written table is documented)."""
    schema = campaign_schema(name) if "run" in df.columns or name == "runs" else written_schema(name)
    if schema is None:
        raise ValueError(f"summary table {name!r} has no documented schema (nccltrace.outputs.summary.written_schema)")
    return schema


def write_tables(tables: Mapping[str, pd.DataFrame], out_dir: Path | str) -> dict[str, Path]:
    """Write each table as ``<name>.parquet`` (documented schema) and ``<name>.csv``, both
    atomically. Returns {"<name>.parquet": path, "<name>.csv": path, ...}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, df in tables.items():
        schema = table_schema(name, df)
        table = frame_to_table(_frame(df, schema), schema)
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
