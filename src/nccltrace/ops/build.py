"""The enriched per-operation table of a run: what each op was, when it ran, on which ranks.

Joins, per call line, the correlation table (matched kernel and why/why not), the call's
arguments from the log, the logical communicator with the process's global rank and rank in
it, the parallelism the communicator serves, a cross-rank instance key, and kernel times on
each node's clock and after clock synchronisation (``nccltrace.ops.clock_sync``). Columns are
documented in ``OPS_SCHEMA`` (rendered into ``docs/tables.md``).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from nccltrace.align.quality import CROSS_RANK_REASON, INFORMATIONAL_CHECKS, P2P_REASON
from nccltrace.align.schema import ALIGNMENT_SCHEMA
from nccltrace.communicators.schema import run_world_size
from nccltrace.core.layout import CALL_SOURCES_FILE, CALLS_FILE
from nccltrace.core.settings import RunSettings
from nccltrace.core.spill import PartSpill
from nccltrace.core.tables import (
    atomic_path,
    coerce_to_schema,
    file_schema,
    frame_to_table,
    read_table,
    read_table_batch,
    write_table_atomic,
)
from nccltrace.core.tables import documented_field as _f
from nccltrace.inputs.call_sources import CALL_SOURCE_SCHEMA, PROVENANCE_COLUMNS
from nccltrace.nccl.enums import P2P_OPS

OPS_SCHEMA = pa.schema(
    list(ALIGNMENT_SCHEMA)
    + [
        _f("count", pa.int64(), "elements", "element count as logged"),
        _f("datatype_name", pa.string(), "", "element type"),
        _f("nranks", pa.int32(), "", "communicator size"),
        _f("root", pa.int32(), "", "root (collectives) or peer rank in the communicator (Send/Recv)"),
        _f("bytes", pa.int64(), "B", "per-rank payload of the call (see calls.bytes)"),
        _f("message_bytes", pa.int64(), "B", "nccl-tests message size S (AllGather/ReduceScatter: bytes x nranks)"),
        _f("logical_id", pa.int32(), "", "logical communicator (communicators.parquet); null if unresolved"),
        _f("global_rank", pa.int32(), "", "global rank of the process (rank in the world communicator)"),
        _f("rank_in_comm", pa.int32(), "", "rank of the process in the communicator"),
        _f("parallelism", pa.string(), "", "parallelism the communicator serves (tp, pp, dp, dp-cp, ep, cp, "
           "embedding, world, ...; 'unknown' when unresolved)"),
        _f("parallelism_candidates", pa.string(), "", "every group kind with the same member set (comma list; "
           "'behaviour' labels: under any layout that fits)"),
        _f("label_source", pa.string(), "", "'pg-names' (the PyTorch process group's Megatron name), "
           "'megatron-groups' (declared, inferred or name-derived sizes), 'behaviour' (the layout most likely from "
           "what each communicator does: not certain), 'heuristic' (thesis 4.2.3 fallback) or 'unmatched'"),
        _f("pg_name", pa.string(), "", "PyTorch process group of the call's communicator (parallelism.parquet)"),
        _f("pg_desc", pa.string(), "", "its description as Megatron set it (TENSOR_MODEL_PARALLEL_GROUP, ...)"),
        _f("pg_seq", pa.int64(), "", "the call's sequence number in its PyTorch process group (Flight Recorder's "
           "collective_seq_id; p2p_seq_id for Send/Recv), where the rank's dump recorded the call; null otherwise"),
        _f("instance", pa.string(), "", "cross-rank key of one collective instance: '<logical_id>:<opCount>' where "
           "opCount is informative, else '<logical_id>#<k-th call on the communicator>'; null for P2P, duplicate "
           "lines and single-rank communicators"),
        # where each fact came from: one home, the call sources' columns
        *(CALL_SOURCE_SCHEMA.field(name) for name in (*PROVENANCE_COLUMNS, "torch_op", "enqueue_utc")),
        _f("kernel_start_utc", pa.int64(), "ns", "kernel start read on the node's clock as UTC (nsys + session start)"),
        _f("kernel_end_utc", pa.int64(), "ns", "kernel end on the node's clock as UTC"),
        _f("kernel_start_sync", pa.int64(), "ns", "kernel start on the reference node's clock (clock sync); null "
           "when the node's clock could not be related to the reference"),
        _f("kernel_end_sync", pa.int64(), "ns", "kernel end on the reference node's clock"),
    ]
)
P2P = {"Send", "Recv"}

CLOCK_SYNC_SCHEMA = pa.schema([
    _f("clock_domain", pa.string(), "", "the node (host) whose clock the row describes"),
    _f("offset_ns", pa.float64(), "ns", "the node's clock minus the reference node's at the model's reference time; "
       "null (never zero) when it could not be estimated"),
    _f("drift_ppm", pa.float64(), "ppm", "rate of the node's clock relative to the reference's, minus one"),
    _f("offset_se_ns", pa.float64(), "ns", "standard error of offset_ns"),
    _f("drift_se_ppm", pa.float64(), "ppm", "standard error of drift_ppm (null when drift was not fitted)"),
    _f("residual_rms_ns", pa.float64(), "ns", "RMS of the node's kernel-end residuals after the fit"),
    _f("n_instances", pa.int64(), "", "collective instances shared with other nodes that were used"),
    _f("n_rows", pa.int64(), "", "kernel rows used in the fit"),
    _f("n_rejected", pa.int64(), "", "kernel rows rejected as outliers"),
    _f("drift_fitted", pa.bool_(), "", "whether a drift was fitted (else offset only)"),
    _f("component", pa.int64(), "", "connected component of the shared-instance graph"),
    _f("status", pa.string(), "", "'reference', 'estimated', 'disconnected', 'no_shared_instances' or "
       "'all_rejected'"),
    _f("method", pa.string(), "", "how the estimate was made ('reference', 'wls_end_offset', "
       "'wls_end_offset_drift', ...)"),
    _f("reason", pa.string(), "", "why the estimate is null; null when there is one"),
], metadata={"table": "clock_sync", "doc": "Per run (ops/): each node's clock relative to the reference node, "
             "fitted from collective instances shared across nodes (nccltrace.ops.clock_sync); no rows for a run on "
             "one node (one clock, nothing to synchronise)."})  # fmt: skip


# Above this many clock-sync rows the clock model is fitted on a deterministic sample of whole
# collective instances (by hash of the instance key, so every rank keeps the same instances):
# offset and drift need thousands of shared instances, not millions, and the fit's memory
# would otherwise grow with the run.
CLOCK_ROWS_BUDGET = 2_000_000

# Rows per part of the run-level checks (cross-rank instances, P2P pairing), counted as
# alignment rows: the checks look at one logical communicator at a time (given two run-wide
# scales), so the run's check rows are spilled in parts of whole communicators and checked one
# part at a time. A communicator larger than this makes a larger part.
CHECK_PART_ROWS = 1 << 19

# The spilled check rows (internal to this stage; see _sync_rows and _p2p_rows).
_SYNC_SPILL_SCHEMA = pa.schema([
    ("clock_domain", pa.string()), ("global_rank", pa.int64()), ("instance", pa.string()), ("start_ns", pa.int64()),
    ("end_ns", pa.int64()), ("nranks", pa.int64()), ("op", pa.string()), ("rank_in_comm", pa.int64()),
    ("root", pa.int64()), ("proc", pa.int64()), ("row", pa.int64()), ("logical_id", pa.int64()),
    ("comm", pa.string()), ("op_count", pa.float64()),
])  # fmt: skip
_P2P_SPILL_SCHEMA = pa.schema([
    ("proc", pa.int64()), ("row", pa.int64()), ("comm", pa.int64()), ("rank", pa.int64()),
    ("peer_in_comm", pa.int64()), ("op", pa.string()), ("seq", pa.int64()), ("clock_domain", pa.string()),
    ("start_ns", pa.int64()), ("end_ns", pa.int64()),
])  # fmt: skip


@dataclass
class RunOps:
    """What building a run's ops found besides the ops table (which :func:`stream_run_ops`
    streams to a file): the parallelism labels, the clock model and the counts."""

    labels: pd.DataFrame
    clock: pd.DataFrame
    partial: bool
    problems: list[str]
    notes: list[str] = field(default_factory=list)
    calls: int = 0
    matched: int = 0
    unmatched_by_reason: dict[str, int] = field(default_factory=dict)  # call rows by alignment reason
    quality: pd.DataFrame | None = None  # alignment-quality table (align.quality.QUALITY_SCHEMA)


def _instances(ops: pd.DataFrame) -> pd.Series:
    """Instance key per call row (see OPS_SCHEMA.instance)."""
    key = pd.Series(pd.NA, index=ops.index, dtype="string")
    coll = ops["logical_id"].notna() & ~ops["op"].isin(list(P2P)) & (ops["row_kind"] == "call")
    coll &= ops["duplicate_of"].isna() & (ops["nranks"].astype("Int64").fillna(0) > 1)
    sub = ops[coll]
    if sub.empty:
        return key
    # opCount is informative on a communicator when the process logs more than one value
    informative = sub.groupby(["host", "pid", "comm"])["op_count"].transform("nunique") > 1
    kth = sub.groupby(["host", "pid", "comm"]).cumcount()
    lid = sub["logical_id"].astype("int64").astype(str)
    # (op_count may be null on a communicator whose source numbers no call: then not informative)
    key.loc[sub.index] = np.where(informative, lid + ":" + sub["op_count"].astype("Int64").astype(str),
                                  lid + "#" + kth.astype(str))  # fmt: skip
    return key


def instance_parts(instance: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(logical communicator, opCount) of instance keys (``_instances``); the opCount is NaN for
    a key by the k-th call ('#'), which is not the same collective on every rank once a rank
    lost a line."""
    s = instance.astype("string")
    by_opcount = s.str.contains(":", regex=False).fillna(False).to_numpy(bool)
    parts = s.str.split(r"[:#]", n=1, expand=True, regex=True).reindex(columns=[0, 1])
    opc = np.where(by_opcount, pd.to_numeric(parts[1], errors="coerce").to_numpy(float), np.nan)
    return parts[0].to_numpy(object), opc


_CALL_COLS = ["file", "line", "count", "datatype_name", "nranks", "root", "bytes", "message_bytes"]


def _process_ops(aligned_path: Path | str, calls_dir: Path | str, members: pd.DataFrame, proc_rank: pd.Series,
                 labels: pd.DataFrame, utc: Mapping[str, int], pg_seqs: pd.DataFrame | None = None) -> pd.DataFrame:  # fmt: skip
    """One process's enriched rows, everything but the clock-synchronised times. Every column
    derived here depends only on this process's rows and run-wide tables, which is what lets
    the run's ops be built one process at a time. ``pg_seqs``: the PyTorch sequence numbers
    Flight Recorder dumps give calls (:func:`.process_groups.name_by_flight_recorder`)."""
    from nccltrace.communicators.labels import label_ops

    aligned = read_table(aligned_path)
    calls = read_table(Path(calls_dir) / CALLS_FILE, columns=_CALL_COLS)
    ops = aligned.merge(calls, on=["file", "line"], how="left")
    m = members[["host", "pid", "comm", "logical_id", "rank_in_comm", "global_rank"]]
    ops = ops.merge(m, on=["host", "pid", "comm"], how="left")
    # kernel rows and calls on communicators without an init line: global rank of the process
    miss = ops["global_rank"].isna()
    if miss.any():
        ops.loc[miss, "global_rank"] = [proc_rank.get((h, p), pd.NA) for h, p in zip(ops.loc[miss, "host"],
                                                                                       ops.loc[miss, "pid"])]  # fmt: skip
    ops = label_ops(ops, labels)
    ops["pg_seq"] = _pg_seq(ops, pg_seqs)
    ops = _provenance(ops, Path(calls_dir) / CALL_SOURCES_FILE)
    ops["instance"] = _instances(ops)
    off = ops["host"].map(utc).astype("Int64")
    ops["kernel_start_utc"] = ops["kernel_start"].astype("Int64") + off
    ops["kernel_end_utc"] = ops["kernel_end"].astype("Int64") + off
    return ops


_SOURCE_COLUMNS = [*PROVENANCE_COLUMNS, "torch_op", "enqueue_utc"]


def _provenance(ops: pd.DataFrame, call_sources: Path) -> pd.DataFrame:
    """Where each row's facts came from: a process without a log has its call sources' record
    (``CALL_SOURCES_FILE``: its sequence numbers too); a logged one's call facts are the log's."""
    if call_sources.exists():
        src = read_table(call_sources, columns=["file", "line", *_SOURCE_COLUMNS, "pg_seq"])
        src = src.rename(columns={"pg_seq": "_pg_seq"})
        ops = ops.merge(src, on=["file", "line"], how="left")
        ops["pg_seq"] = ops["pg_seq"].astype("Int64").fillna(ops.pop("_pg_seq").astype("Int64"))
        kernel = ops["row_kind"] == "kernel"
        ops.loc[kernel, "source"] = "profiler" if ops["source"].eq("profiler").any() else ops.loc[kernel, "source"]
        ops.loc[kernel & ops["kernel_start"].notna(), "time_source"] = "kernel"
        return ops
    call = (ops["row_kind"] == "call").to_numpy()
    ops["source"] = "nccl-log"
    ops["op_source"] = np.where(call, "nccl-log", None)
    ops["size_source"] = np.where(call & ops["count"].notna().to_numpy(), "nccl-log", None)
    ops["comm_source"] = np.where(ops["logical_id"].notna(), "nccl-init", None)
    ops["rank_source"] = np.where(ops["global_rank"].notna(), "communicators", None)
    ops["time_source"] = np.where(ops["kernel_start"].notna(), "kernel", None)
    ops["seq_source"] = np.where(ops["pg_seq"].notna(), "flight-recorder", None)
    ops["torch_op"] = None
    ops["enqueue_utc"] = pd.array([pd.NA] * len(ops), dtype="Int64")
    return ops


def _pg_seq(ops: pd.DataFrame, pg_seqs: pd.DataFrame | None) -> pd.arrays.IntegerArray:
    """Per row: the call's PyTorch sequence number from ``pg_seqs`` (keyed by the call's position
    from the end of its communicator's calls, duplicate lines not counted), else null."""
    out = pd.array([pd.NA] * len(ops), dtype="Int64")
    if pg_seqs is None or not len(pg_seqs) or not len(ops):
        return out
    calls = (ops["row_kind"] == "call") & ops["duplicate_of"].isna() & ops["comm"].notna()
    rows = ops[calls].sort_values("line", kind="stable")
    from_end = rows.groupby("comm", sort=False).cumcount(ascending=False) + 1
    key = pd.DataFrame({"host": rows["host"].astype(str), "pid": rows["pid"].astype("int64"),
                        "comm": rows["comm"].astype("int64"), "from_end": from_end.astype("int64"),
                        "at": rows.index})  # fmt: skip
    got = key.merge(pg_seqs.astype({"host": str, "pid": "int64", "comm": "int64", "from_end": "int64"}),
                    on=["host", "pid", "comm", "from_end"], how="inner")
    pos = ops.index.get_indexer(got["at"])
    out[pos] = got["pg_seq"].astype("int64").to_numpy()
    return out


_SYNC_FIT_COLUMNS = ["clock_domain", "global_rank", "instance", "start_ns", "end_ns", "nranks"]


def _member_keys(ops: pd.DataFrame, proc: int) -> pd.Series:
    """Per row, the key the run-level checks and the clock fit tell members apart by: the
    process's global rank, or, where nothing named it, ``-(proc + 1)`` (``proc``: the process's
    position). They need to know which rows are one member's, not its rank, so a lazily
    initialised job whose ranks are unknown is still checked and synchronised. Never written out."""
    return ops["global_rank"].astype("Int64").fillna(-(proc + 1))


def _sync_rows(ops: pd.DataFrame, proc: int = 0) -> pd.DataFrame:
    """The rows the clock model is fitted on, matched calls of cross-rank instances, with what
    the cross-rank check needs (``comm``, ``op_count``: ``instance_parts``) and to find them
    again (``proc``: the process's position, ``row``: the row's position in its ops frame)."""
    sel = ((ops["status"] == "matched") & ops["instance"].notna()).to_numpy()
    rows = ops[sel]
    out = pd.DataFrame({
        "clock_domain": rows["host"].astype(str), "global_rank": _member_keys(rows, proc),
        "instance": rows["instance"].astype(str), "start_ns": rows["kernel_start_utc"],
        "end_ns": rows["kernel_end_utc"], "nranks": rows["nranks"], "op": rows["op"].astype(str),
        "rank_in_comm": rows["rank_in_comm"], "root": rows["root"], "proc": np.int64(proc),
        "row": np.flatnonzero(sel), "logical_id": rows["logical_id"],
    }).dropna(subset=_SYNC_FIT_COLUMNS)  # fmt: skip
    out["comm"], out["op_count"] = instance_parts(out["instance"])
    return out


def _p2p_rows(ops: pd.DataFrame, proc: int) -> pd.DataFrame:
    """Send/Recv call rows (duplicates aside) with what the P2P pairing check needs (``row``: the
    row's position in its ops frame; ``peer_in_comm``: NCCL logs the peer as ``root``)."""
    sel = ((ops["row_kind"] == "call") & ops["duplicate_of"].isna() & ops["op"].isin(P2P_OPS)).to_numpy(bool)
    r = ops[sel]
    matched = (r["status"] == "matched").to_numpy(bool)
    return pd.DataFrame({
        "proc": np.int64(proc), "row": np.flatnonzero(sel), "comm": r["logical_id"].to_numpy(),
        "rank": _member_keys(r, proc).to_numpy(), "peer_in_comm": r["root"].to_numpy(), "op": r["op"].astype(str).to_numpy(),
        "seq": r["line"].to_numpy(), "clock_domain": r["host"].astype(str).to_numpy(),
        "start_ns": r["kernel_start_utc"].where(matched).to_numpy(), "end_ns": r["kernel_end_utc"].where(matched).to_numpy(),
    })  # fmt: skip


def _p2p_check(p2p: pd.DataFrame, ranks: pd.DataFrame, model: Any, processes: list[str],
               lossy: set[int], stood_down: dict[str, list[dict]] | None = None,
               ) -> tuple[dict[int, np.ndarray], pd.DataFrame]:  # fmt: skip
    """Run the P2P pairing check on Send/Recv rows (``_p2p_rows``) whose communicator, rank and
    peer are known (``_CheckRows`` keeps only those), indexed 0..n-1: per process position the
    ops rows to demote, and the per-process summary (confirmed, contradicted, not checkable).
    ``lossy``: global ranks of the processes whose logs lost lines; their channels are not
    paired (a lost line shifts the k-th Send against the k-th Recv even when both sides logged
    as many calls). ``stood_down`` (filled): per process, the communicators where the check
    stood down (``contradicts_most``), each a record of ``p2p_contradictions``."""
    from nccltrace.align.quality import cross_rank_summary, p2p_contradictions
    from nccltrace.ops.clock_sync import add_sync_columns

    if p2p.empty:
        return {}, pd.DataFrame(columns=["process", "confirmed", "contradicted", "not_checkable"])
    peer = ranks.drop_duplicates(["comm", "rank_in_comm"]).set_index(["comm", "rank_in_comm"])["global_rank"]
    p2p["peer"] = peer.reindex(pd.MultiIndex.from_arrays([p2p["comm"], p2p["peer_in_comm"]])).to_numpy()
    p2p.loc[p2p["rank"].isin(lossy) | p2p["peer"].isin(lossy), "peer"] = np.nan  # not paired
    has = p2p["start_ns"].notna() & p2p["end_ns"].notna()
    p2p["start_sync"], p2p["end_sync"] = np.nan, np.nan
    slack: dict[str, float] = {}
    if has.any():
        t = p2p.loc[has, ["clock_domain", "start_ns", "end_ns"]].astype({"start_ns": "int64", "end_ns": "int64"})
        if model is not None:
            t = add_sync_columns(t, model).rename(columns={"start_ns_sync": "s", "end_ns_sync": "e"})
            slack = _sync_slack(model)
        else:
            t = t.assign(s=t["start_ns"], e=t["end_ns"])
        p2p.loc[has, "start_sync"] = t["s"].astype("float64").to_numpy()
        p2p.loc[has, "end_sync"] = t["e"].astype("float64").to_numpy()
    removed, checked, stood = p2p_contradictions(p2p.dropna(subset=["peer"]), slack)
    if stood_down is not None:
        for rec in stood:
            for i in sorted({int(p2p.at[r, "proc"]) for r in rec["rows"]}):
                stood_down.setdefault(processes[i], []).append({k: v for k, v in rec.items() if k != "rows"})
    rows = p2p[has].assign(process=[processes[i] for i in p2p.loc[has, "proc"]],
                           testable=p2p.index[has].isin(checked))
    summary = cross_rank_summary(rows, removed)
    demote: dict[int, list[int]] = collections.defaultdict(list)
    for i in removed:
        demote[int(p2p.at[i, "proc"])].append(int(p2p.at[i, "row"]))
    return {k: np.asarray(v, np.int64) for k, v in demote.items()}, summary


# Kernel columns a demoted match loses (it keeps what the log says).
_KERNEL_COLUMNS = ("kernel_global_pid", "kernel_correlation_id", "kernel_name", "kernel_stream_id", "kernel_start",
                   "kernel_end", "launch_start", "confidence", "method", "kernel_start_utc", "kernel_end_utc",
                   "kernel_start_sync", "kernel_end_sync")  # fmt: skip


def _demote(ops: pd.DataFrame, rows: np.ndarray, reason: str) -> None:
    """Turn matches into unmatched rows with ``reason`` (in place)."""
    if len(rows) == 0:
        return
    idx = ops.index[rows]
    ops.loc[idx, "status"] = "unmatched"
    ops.loc[idx, "reason"] = reason
    for c in _KERNEL_COLUMNS:
        if c in ops:
            ops.loc[idx, c] = pd.NA


def _sync_slack(model: Any) -> dict[str, float]:
    """Extra tolerance per clock domain for checks on synchronised time: five times the clock
    model's residual."""
    rms = model.domains["residual_rms_ns"].astype("Float64").fillna(0.0)
    return {str(d): 5.0 * float(v) for d, v in rms.items()}


def _cross_rank_rows(frame: pd.DataFrame, model: Any) -> tuple[pd.DataFrame, dict[str, float]]:
    """The cross-rank check's rows (``cross_rank_contradictions``) of instance rows
    (``_sync_rows``), and the extra tolerance per clock domain."""
    from nccltrace.ops.clock_sync import add_sync_columns

    if model is None:  # one clock: nothing to convert
        start, end = frame["start_ns"], frame["end_ns"]
        slack: dict[str, float] = {}
    else:
        synced = add_sync_columns(frame[["clock_domain", "start_ns", "end_ns"]], model)
        start, end = synced["start_ns_sync"], synced["end_ns_sync"]
        slack = _sync_slack(model)
    opc = frame["op_count"].to_numpy(np.float64)
    rows = pd.DataFrame({
        "instance": frame["instance"].to_numpy(), "member": frame["global_rank"].to_numpy(),
        "clock_domain": frame["clock_domain"].to_numpy(), "op": frame["op"].to_numpy(),
        "rank_in_comm": frame["rank_in_comm"].to_numpy(), "root": frame["root"].to_numpy(),
        "start_sync": pd.array(start, dtype="Int64"), "end_sync": pd.array(end, dtype="Int64"),
        "comm": frame["comm"].to_numpy(object), "op_count": opc,
    })  # fmt: skip
    # Only instances keyed by opCount are certain to be one collective on every rank: a key by
    # the k-th call on the communicator shifts on a rank that lost a line, and the check would
    # then contradict correct matches.
    rows.loc[np.isnan(opc), ["start_sync", "end_sync"]] = pd.NA
    return rows, slack


def _cross_rank(frame: pd.DataFrame, model: Any, processes: list[str], scales: tuple[float, float],
                stood_down: dict[str, list[dict]]) -> tuple[dict[int, np.ndarray], pd.DataFrame]:  # fmt: skip
    """Run the cross-rank check on instance rows of whole communicators with the run's
    ``scales`` (``cross_rank_scales``): per process position the ops rows to demote, and the
    per-process summary (confirmed, contradicted, not checkable). ``stood_down`` (filled): per
    process, the communicators where the common-end and order tests stood down
    (``align.quality.end_spread_by_comm``)."""
    from nccltrace.align.quality import cross_rank_contradictions, cross_rank_summary

    rows, slack = _cross_rank_rows(frame, model)
    removed = cross_rank_contradictions(rows, slack, scales)
    # communicators whose collectives' kernels end too far apart for the common-end and order
    # tests: per process, what to say
    procs_of = rows.assign(proc=frame["proc"].to_numpy()).groupby("comm")["proc"].unique()
    for rec in removed.attrs.get("stood_down", []):
        for i in procs_of.get(rec["comm"], []):
            stood_down.setdefault(processes[int(i)], []).append(rec)
    timed = rows["start_sync"].notna() & rows["end_sync"].notna()
    members = rows[timed].groupby("instance")["member"].transform("size")
    testable = pd.Series(False, index=rows.index)
    testable.loc[members.index] = members >= 2
    checked = rows.assign(process=[processes[i] for i in frame["proc"].to_numpy()], testable=testable.to_numpy())
    summary = cross_rank_summary(checked, removed.index)
    demote: dict[int, list[int]] = collections.defaultdict(list)
    procs, prow = frame["proc"].to_numpy(), frame["row"].to_numpy()
    for i in removed.index:
        demote[int(procs[i])].append(int(prow[i]))
    return {k: np.asarray(v, np.int64) for k, v in demote.items()}, summary


_Demotions = dict[int, np.ndarray]  # ops rows to demote per process position


class _CheckRows:
    """The run's rows for the run-level checks, spilled in parts of whole logical
    communicators: instance rows (``_sync_rows``: clock fit, cross-rank check) and Send/Recv
    rows (``_p2p_rows``: P2P pairing). Memory holds one part at a time, not the run."""

    def __init__(self, parent: Path, n_parts: int) -> None:
        self.spill = PartSpill(parent, prefix=".checks-")
        self.n_parts = max(1, n_parts)
        self.sync_rows = 0
        self.domains: set[str] = set()
        self.lossy: set[int] = set()  # global ranks of processes whose logs lost lines

    def add(self, sync: pd.DataFrame, p2p: pd.DataFrame, lost_lines: bool) -> None:
        """Route one process's rows to their parts. Send/Recv rows without communicator, rank or
        peer cannot be paired and are left out here."""
        p2p = p2p.dropna(subset=["comm", "rank", "peer_in_comm"])
        if lost_lines:
            self.lossy.update(int(r) for r in p2p["rank"])
        self.sync_rows += len(sync)
        self.domains.update(sync["clock_domain"].unique())
        self._route("sync", sync, "logical_id", _SYNC_SPILL_SCHEMA)
        self._route("p2p", p2p, "comm", _P2P_SPILL_SCHEMA)

    def _route(self, kind: str, frame: pd.DataFrame, key: str, schema: pa.Schema) -> None:
        if frame.empty:
            return
        table = pa.Table.from_pandas(frame[schema.names], schema=schema, preserve_index=False)
        part = frame[key].to_numpy(np.int64) % self.n_parts
        for k in np.unique(part):
            self.spill.append(f"{kind}-{k}", table.filter(pa.array(part == k)))

    def parts(self, kind: str, columns: list[str] | None = None) -> Iterator[pd.DataFrame]:
        """Each non-empty part of ``kind`` ('sync' or 'p2p'), rows in (process, row) order,
        with the dtypes of the rows added (strings as Python objects, positions as int64,
        floats as NumPy with NaN)."""
        for k in range(self.n_parts):
            table = self.spill.read(f"{kind}-{k}", columns)
            if table is None:
                continue
            frame = read_table_batch(table)
            for name, typ in zip(table.column_names, table.schema.types):
                if typ == pa.string():
                    frame[name] = frame[name].astype(object)
                elif name in ("proc", "row"):
                    frame[name] = frame[name].to_numpy(np.int64)
                elif pa.types.is_floating(typ):
                    frame[name] = frame[name].to_numpy(np.float64, na_value=np.nan)
            yield frame


def _clock_fit_rows(checks: _CheckRows, budget: int, notes: list[str]) -> pd.DataFrame:
    """The rows the clock model is fitted on, in run order: every instance row, or above
    ``budget`` rows the instances whose key hashes to 0 modulo the ratio, on all their ranks."""
    k = -(-checks.sync_rows // budget) if checks.sync_rows > budget else 1
    pieces = []
    for part in checks.parts("sync", [*_SYNC_FIT_COLUMNS, "proc", "row"]):
        if k > 1:
            h = pd.util.hash_array(part["instance"].to_numpy(dtype=object))
            part = part[h % np.uint64(k) == 0]
        pieces.append(part)
    fit = pd.concat(pieces).sort_values(["proc", "row"], kind="stable").reset_index(drop=True)
    if k > 1:
        notes.append(f"clock sync fitted on {len(fit):,} of {checks.sync_rows:,} instance rows "
                     f"(every instance whose key hashes to 0 mod {k}, on all its ranks)")  # fmt: skip
    return fit[_SYNC_FIT_COLUMNS]


def _summed(summaries: list[pd.DataFrame], processes: list[str]) -> pd.DataFrame:
    """Per-process check summaries of several parts added up, in process order."""
    cols = ["confirmed", "contradicted", "not_checkable"]
    summaries = [t for t in summaries if len(t)]
    if not summaries:
        return pd.DataFrame(columns=["process", *cols])
    total = pd.concat(summaries).groupby("process", sort=False)[cols].sum()
    return total.reindex([p for p in processes if p in total.index]).rename_axis("process").reset_index()


def _merged(demotes: list[_Demotions]) -> _Demotions:
    """Rows to demote per process position, of several parts."""
    out: dict[int, list[np.ndarray]] = collections.defaultdict(list)
    for d in demotes:
        for proc, rows in d.items():
            out[proc].append(rows)
    return {proc: np.concatenate(rows) for proc, rows in out.items()}


def _run_checks(checks: _CheckRows, model: Any, processes: list[str], ranks: pd.DataFrame,
                stood_down: dict[str, list[dict]] | None = None,
                p2p_stood_down: dict[str, list[dict]] | None = None,
                ) -> tuple[_Demotions, pd.DataFrame, _Demotions, pd.DataFrame]:  # fmt: skip
    """The cross-rank and P2P checks, one part of whole communicators at a time: per process
    position the rows each demotes, and each one's per-process summary. The cross-rank check's
    two run-wide scales are taken from every part first (its deviations: 9 bytes per row).
    ``stood_down``/``p2p_stood_down`` (filled): per process, where each check stood down."""
    from nccltrace.align.quality import cross_rank_scales, end_deviations

    devs, bigs, widest = [np.zeros(0)], [np.zeros(0, bool)], float("-inf")
    for part in checks.parts("sync"):
        dev, big, tol = end_deviations(*_cross_rank_rows(part, model))
        devs.append(dev)
        bigs.append(big)
        widest = max(widest, tol)
    scales = cross_rank_scales(np.concatenate(devs), np.concatenate(bigs), widest)
    del devs, bigs
    stood_down = {} if stood_down is None else stood_down
    cross = [_cross_rank(part, model, processes, scales, stood_down) for part in checks.parts("sync")]
    pairing = [_p2p_check(part, ranks, model, processes, checks.lossy, p2p_stood_down) for part in checks.parts("p2p")]
    return (_merged([d for d, _ in cross]), _summed([t for _, t in cross], processes),
            _merged([d for d, _ in pairing]), _summed([t for _, t in pairing], processes))  # fmt: skip


@dataclass
class _RunInputs:
    """What every process's pass reads: the run's communicators, members and labels, and each
    node's UTC offset."""

    processes: list[str]
    records: list[Mapping[str, Any]]  # each process's alignment-quality record
    comms: pd.DataFrame
    members: pd.DataFrame
    proc_rank: pd.Series  # global rank per (host, pid)
    labels: pd.DataFrame
    pg_seqs: pd.DataFrame | None
    utc: dict[str, int]  # UTC offset (ns) per host


@dataclass
class _FirstPass:
    """Pass 1's results: one ops part per process on disk, the spilled rows of the run-level
    checks, every process's (communicator, rank in it, global rank) and the call counts."""

    parts: list[Path]
    checks: _CheckRows
    ranks: pd.DataFrame
    unresolved: int = 0
    calls: int = 0
    matched: int = 0
    by_reason: collections.Counter = field(default_factory=collections.Counter)


def stream_run_ops(
    alignment_paths: Iterable[Path | str],
    calls_dirs: Iterable[Path | str],
    communicators_path: Path | str,
    members_path: Path | str,
    sessions: Mapping[str, Path | str],
    settings: RunSettings | Mapping[str, Any] | None,
    ops_path: Path | str,
    *,
    clock_rows_budget: int = CLOCK_ROWS_BUDGET,
    check_part_rows: int = CHECK_PART_ROWS,
    progress: Any = None,
    quality_paths: Iterable[Path | str] | None = None,
    flight_recorder: Path | str | None = None,
) -> RunOps:
    """Build the enriched ops of one run and write them to ``ops_path`` (atomically), one
    process at a time: memory holds one process's rows plus the clock-sync rows (at most
    ``clock_rows_budget``), whatever the number of ranks. Row order and values are those of
    the whole-run join (processes in the order given). ``progress``: optional callable run
    after each pass over a process. ``quality_paths``: each process's alignment-quality record
    (``alignment_quality.json``, same order), merged with the cross-rank check into
    ``RunOps.quality``; a process whose matches a check contradicted makes the run partial.
    The run-level checks hold one part of about ``check_part_rows`` alignment rows (whole
    logical communicators) at a time. ``flight_recorder``: a directory of the run's Flight
    Recorder dumps, which name process groups (:func:`.process_groups.name_by_flight_recorder`)."""
    alignment_paths = [Path(p) for p in alignment_paths]
    calls_dirs = [Path(d) for d in calls_dirs]
    problems: list[str] = []
    notes: list[str] = []
    run = _run_inputs(alignment_paths, calls_dirs, communicators_path, members_path, sessions, settings,
                      quality_paths, flight_recorder, notes, problems)  # fmt: skip
    ops_path = Path(ops_path)
    parts_dir = Path(tempfile.mkdtemp(prefix=".ops-parts-", dir=ops_path.parent))
    try:
        first = _first_pass(alignment_paths, calls_dirs, run, parts_dir, check_part_rows, progress)
        if first.unresolved:
            problems.append(f"{first.unresolved} call lines on communicators without init lines "
                            "(no logical communicator)")  # fmt: skip
        clock, model = _run_clock(first.checks, clock_rows_budget, notes, problems)
        # Cross-rank check: kernels of one instance must overlap in synchronised time. P2P
        # pairing: the k-th Recv on a channel cannot end before its k-th Send started.
        stood_down: dict[str, list[dict]] = {}
        p2p_stood_down: dict[str, list[dict]] = {}
        demote, cross, demote_p2p, p2p_summary = _run_checks(first.checks, model, run.processes, first.ranks,
                                                             stood_down, p2p_stood_down)  # fmt: skip
        first.ranks = pd.DataFrame()
        first.checks.spill.close()
        _second_pass(first.parts, model, demote, demote_p2p, ops_path, progress)
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)
    quality = _quality_table(run.processes, run.records, cross, p2p_summary, stood_down, p2p_stood_down)
    matched_n = _report_quality(quality, notes, problems, first.matched, first.by_reason)
    # (communicators inferred from call sequences carry their own message: communicator_problems)
    comms = run.comms
    exact = comms[comms["kind"].astype(str) != "sequence"] if len(comms) else comms
    if len(exact) and not bool(exact["complete"].astype(bool).all()):
        n_bad = int((~exact["complete"].astype(bool)).sum())
        problems.append(f"{n_bad} of {len(comms)} communicators incomplete (ranks without a log)")
    partial = bool(problems) or not len(comms)
    return RunOps(labels=run.labels, clock=clock, partial=partial, problems=problems, notes=notes, calls=first.calls,
                  matched=matched_n, unmatched_by_reason=dict(first.by_reason), quality=quality)  # fmt: skip


def _run_inputs(alignment_paths: list[Path], calls_dirs: list[Path], communicators_path: Path | str,
                members_path: Path | str, sessions: Mapping[str, Path | str],
                settings: RunSettings | Mapping[str, Any] | None, quality_paths: Iterable[Path | str] | None,
                flight_recorder: Path | str | None, notes: list[str], problems: list[str]) -> _RunInputs:  # fmt: skip
    """Read the run-wide inputs of :func:`stream_run_ops` and label its communicators."""
    from nccltrace.align.quality import read_quality

    # each process's own quality record, read once (lost lines gate the P2P check; all go in the table)
    records = [read_quality(q) for q in quality_paths] if quality_paths is not None else [{"checks": []}] * len(
        alignment_paths)
    processes = [p.parent.name for p in alignment_paths]  # aligned/<process>/alignment.parquet
    if len(alignment_paths) != len(calls_dirs):
        raise ValueError(f"{len(alignment_paths)} alignment tables but {len(calls_dirs)} parsed call directories")
    comms = read_table(communicators_path)
    members = read_table(members_path)
    proc_rank = members.dropna(subset=["global_rank"]).groupby(["host", "pid"])["global_rank"].first()
    # Labels need which ops each communicator carries and, without sizes, how often (behaviour):
    # per (host, pid, comm, op) the number of calls and of distinct Send/Recv peers.
    call_kinds = pd.concat([call_counts(d / CALLS_FILE) for d in calls_dirs], ignore_index=True)
    labels = run_labels(comms, members, call_kinds, settings, notes, problems)
    seq_parts: list[pd.DataFrame] = []
    labels = _named(labels, comms, members, records, sessions, settings, call_kinds, notes, flight_recorder,
                    calls_dirs, seq_parts)
    pg_seqs = seq_parts[0] if seq_parts else None
    del call_kinds
    utc = {h: int(json.loads(Path(p).read_text()).get("utc_offset_ns") or 0) for h, p in sessions.items()}
    return _RunInputs(processes, records, comms, members, proc_rank, labels, pg_seqs, utc)


def _first_pass(alignment_paths: list[Path], calls_dirs: list[Path], run: _RunInputs, parts_dir: Path,
                check_part_rows: int, progress: Any) -> _FirstPass:  # fmt: skip
    """Pass 1: per process, everything but the synchronised times (kept on disk under
    ``parts_dir``), and the rows of the run-level checks (spilled in parts of whole communicators)."""
    import pyarrow.parquet as pq

    n_rows = sum(pq.ParquetFile(a).metadata.num_rows for a in alignment_paths)
    out = _FirstPass([], _CheckRows(parts_dir, -(-n_rows // max(1, check_part_rows))), pd.DataFrame())
    gapped = _lost_lines(run.records)
    ranks: list[pd.DataFrame] = []
    for i, (a, d) in enumerate(zip(alignment_paths, calls_dirs)):
        ops = _process_ops(a, d, run.members, run.proc_rank, run.labels, run.utc, run.pg_seqs)
        is_call = ops["row_kind"] == "call"
        out.unresolved += int((is_call & ops["logical_id"].isna()).sum())
        out.calls += int(is_call.sum())
        out.matched += int((is_call & (ops["status"] == "matched")).sum())
        out.by_reason.update({str(k): int(v) for k, v in ops.loc[is_call, "reason"].value_counts().items()})
        out.checks.add(_sync_rows(ops, i), _p2p_rows(ops, i), i in gapped)
        ranks.append(ops.loc[is_call, ["logical_id", "rank_in_comm"]].assign(global_rank=_member_keys(ops, i))
                     .dropna().drop_duplicates().rename(columns={"logical_id": "comm"}))  # fmt: skip
        part = parts_dir / f"{i:06d}.parquet"
        pq.write_table(frame_to_table(coerce_to_schema(ops, OPS_SCHEMA), OPS_SCHEMA), part)
        out.parts.append(part)
        del ops
        if progress is not None:
            progress()
    out.ranks = pd.concat(ranks, ignore_index=True) if ranks else pd.DataFrame()
    return out


def _run_clock(checks: _CheckRows, budget: int, notes: list[str], problems: list[str]) -> tuple[pd.DataFrame, Any]:
    """The clock model of a run of several clock domains (None and an empty table for one), and
    a problem for each domain it could not place."""
    from nccltrace.ops.clock_sync import estimate_clock_model

    if len(checks.domains) <= 1:
        return pd.DataFrame(), None
    fit = _clock_fit_rows(checks, budget, notes)
    model = estimate_clock_model(fit.astype({"start_ns": "int64", "end_ns": "int64", "global_rank": "int64",
                                             "nranks": "int64"}))  # fmt: skip
    del fit
    clock = model.domains.reset_index()
    bad = clock[clock["status"].isin(["disconnected", "no_shared_instances", "all_rejected"])]
    for row in bad.itertuples():
        problems.append(f"clock of {row[1]}: {row.reason}")
    return clock, model


def _second_pass(parts: list[Path], model: Any, demote: _Demotions, demote_p2p: _Demotions, ops_path: Path,
                 progress: Any) -> None:  # fmt: skip
    """Pass 2: synchronised times and the checks' demotions, appended process by process to the
    one output file (written atomically); each part is removed once copied."""
    import pyarrow.parquet as pq

    from nccltrace.ops.clock_sync import add_sync_columns

    tmp = atomic_path(ops_path)
    try:
        with pq.ParquetWriter(tmp, file_schema(OPS_SCHEMA), compression="zstd") as writer:
            for i, part in enumerate(parts):
                ops = read_table(part)
                if model is None:
                    # one node: one clock, nothing to synchronise
                    ops["kernel_start_sync"] = ops["kernel_start_utc"]
                    ops["kernel_end_sync"] = ops["kernel_end_utc"]
                else:
                    has = ops["kernel_start_utc"].notna()
                    tmpf = pd.DataFrame({"clock_domain": ops.loc[has, "host"].astype(str),
                                         "start_ns": ops.loc[has, "kernel_start_utc"],
                                         "end_ns": ops.loc[has, "kernel_end_utc"]})  # fmt: skip
                    synced = add_sync_columns(tmpf, model)
                    ops.loc[has, "kernel_start_sync"] = synced["start_ns_sync"].to_numpy()
                    ops.loc[has, "kernel_end_sync"] = synced["end_ns_sync"].to_numpy()
                _demote(ops, demote.get(i, np.zeros(0, np.int64)), CROSS_RANK_REASON)
                _demote(ops, demote_p2p.get(i, np.zeros(0, np.int64)), P2P_REASON)
                writer.write_table(frame_to_table(coerce_to_schema(ops, OPS_SCHEMA), OPS_SCHEMA))
                part.unlink()
                if progress is not None:
                    progress()
        os.replace(tmp, ops_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _report_quality(quality: pd.DataFrame, notes: list[str], problems: list[str], matched: int,
                    by_reason: collections.Counter) -> int:  # fmt: skip
    """Add the quality table's messages to the notes or problems and count the checks' demoted
    matches under their reasons (``by_reason``, updated); returns the matched calls left."""
    for check, msg in zip(quality["check"], quality["message"], strict=True):
        if pd.isna(msg):
            continue
        # a check that stood down is a finding about the run, not a gap in the result
        target = notes if check in INFORMATIONAL_CHECKS else problems
        if msg not in target:
            target.append(str(msg))
    for check, reason in (("cross_rank", CROSS_RANK_REASON), ("p2p_pairing", P2P_REASON)):
        n_demoted = int(quality.loc[quality["check"] == check, "contradicted"].sum())
        if n_demoted:
            matched -= n_demoted
            by_reason[reason] = by_reason.get(reason, 0) + n_demoted
    return matched


def _flight_recorder_names(comms: pd.DataFrame, members: pd.DataFrame, dumps_dir: Path | None,
                           calls_dirs: list[Path], notes: list[str]
                           ) -> tuple[pd.DataFrame | None, dict, pd.DataFrame | None]:  # fmt: skip
    """Names from the Flight Recorder dumps in ``dumps_dir`` (:func:`.process_groups.name_by_flight_recorder`),
    their groups (name -> (ranks, desc)) and the calls' sequence numbers; (None, {}, None)
    without dumps."""
    from nccltrace.communicators.names import name_by_flight_recorder
    from nccltrace.core.layout import process_key
    from nccltrace.pytorch.flight_recorder import FlightRecorderError, find_dumps

    if dumps_dir is None or not Path(dumps_dir).is_dir() or not any(Path(dumps_dir).iterdir()):
        return None, {}, None
    try:
        dumps = find_dumps(dumps_dir)
    except FlightRecorderError as e:
        notes.append(f"Flight Recorder dumps not used: {e}")
        return None, {}, None
    dirs = {process_key(d.name): d for d in calls_dirs}

    def calls_of(host: str, pid: int) -> pd.DataFrame:
        d = dirs.get((host, pid))
        if d is None:
            return pd.DataFrame({"comm": [], "op": [], "count": []})
        calls = read_table(d / CALLS_FILE, columns=["comm", "op", "count", "line", "duplicate_of"])
        return calls[calls["duplicate_of"].isna()].sort_values("line")

    names, said, seqs = name_by_flight_recorder(comms, members, dumps, calls_of)
    notes += said
    groups = {n: g for d in dumps for n, g in d.groups.items()}
    return names, groups, seqs


def _pytorch_log_names(members: pd.DataFrame, calls_dirs: list[Path], notes: list[str]) -> pd.DataFrame:
    """Names from PyTorch's own process-group lines among each process's application lines (its
    ``unclassified`` table; :func:`.process_groups.name_by_pytorch_lines`)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from nccltrace.communicators.names import name_by_pytorch_lines
    from nccltrace.core.layout import process_key

    dirs = {process_key(d.name): d for d in calls_dirs}

    def lines_of(host: str, pid: int) -> list[str]:
        path = dirs[(host, pid)] / "unclassified.parquet" if (host, pid) in dirs else None
        if path is None or not path.exists():
            return []
        table = pq.read_table(path, columns=["text"])
        return table.filter(pc.match_substring(table["text"], "ProcessGroupNCCL created ncclComm_"))["text"].to_pylist()

    names, said = name_by_pytorch_lines(members, lines_of)
    notes += said
    return names


def _named(labels: pd.DataFrame, comms: pd.DataFrame, members: pd.DataFrame, records: list[Mapping[str, Any]],
           sessions: Mapping[str, Path | str], settings: RunSettings | Mapping[str, Any] | None,
           call_kinds: pd.DataFrame, notes: list[str], dumps_dir: Path | None = None, calls_dirs: list[Path] = (),
           pg_seqs: list | None = None) -> pd.DataFrame:  # fmt: skip
    """Labels with the communicators' PyTorch process-group names (:mod:`.process_groups`: from
    the kernels' records, and from Flight Recorder dumps in ``dumps_dir`` joined by the calls
    both saw); when no sizes were declared and the names determine them, the unnamed
    communicators are labelled from those sizes (the guesses' note is replaced). The calls'
    sequence numbers the dumps give are appended to ``pg_seqs``."""
    from nccltrace.communicators.labels import (
        apply_names,
        declares_sizes,
        label_communicators,
    )
    from nccltrace.communicators.names import name_communicators, pg_config_of_sessions
    from nccltrace.megatron.infer import infer_layout

    fr_names, fr_groups, seqs = _flight_recorder_names(comms, members, dumps_dir, list(calls_dirs), notes)
    if seqs is not None and pg_seqs is not None:
        pg_seqs.append(seqs)
    pg_config = {**fr_groups, **pg_config_of_sessions(sessions.values())}
    # PyTorch's own lines first (an exact join by pointer), then the dumps' (by the calls both saw)
    parts = [x for x in (_pytorch_log_names(members, list(calls_dirs), notes), fr_names) if x is not None and len(x)]
    before = pd.concat(parts, ignore_index=True) if parts else None
    names, said = name_communicators(comms, members, records, pg_config, before)
    notes += said
    if names.empty:
        return labels
    world = run_world_size(comms, members) or 0
    if not declares_sizes(settings) and world > 1:
        lists = [list(m) for m in comms.set_index("logical_id").loc[names["logical_id"], "members"]]
        res = infer_layout(world, lists, descs=names["pg_desc"].tolist())
        if res.layout is not None and res.consistent:
            sizes = {k: int(res.layout[k]) for k in ("tp", "pp", "cp", "ep", "etp")} | {"world_size": world}
            labels = label_communicators(comms, sizes, members=members, calls=call_kinds)
            notes[:] = [n for n in notes if not n.startswith("parallelism labels are guesses")]
            notes.append("parallel sizes from the PyTorch process groups' names: "
                         + ", ".join(f"{k}={v}" for k, v in sizes.items()))
    named = apply_names(labels, names)
    by_name = int((named["label_source"].astype(str) == "pg-names").sum())
    if by_name == len(named):  # every label rests on the groups' own names: none is a guess
        notes[:] = [n for n in notes if not n.startswith("parallelism labels are guesses")]
    notes.append(f"{len(names)} of {len(comms)} communicators named by their PyTorch process group "
                 f"({int((names['name_source'] == 'kernel-records').sum())} from the kernels' records, "
                 f"{int((names['name_source'] == 'flight-recorder').sum())} from Flight Recorder dumps, "
                 f"{int((names['name_source'] == 'pytorch-log').sum())} from PyTorch's log lines, "
                 f"{int((names['name_source'] == 'elimination').sum())} as the only group with their members left"
                 + "".join(f", {n} from {src.removesuffix('-records')} records of processes without a log"
                           for src, n in names["name_source"].value_counts().items()
                           if src.endswith("-records") and src != "kernel-records") + ")")  # fmt: skip
    return named


def run_labels(comms: pd.DataFrame, members: pd.DataFrame, call_kinds: pd.DataFrame,
               settings: RunSettings | Mapping[str, Any] | None, notes: list[str], problems: list[str]
               ) -> pd.DataFrame:  # fmt: skip
    """Every communicator's parallelism label (:data:`~nccltrace.communicators.labels.LABEL_SCHEMA`) from
    the declared sizes; without them from the sizes the member sets determine, else from the
    layout what each communicator did makes most likely (marked 'behaviour'), else the
    heuristic. ``call_kinds``: :func:`call_counts` of every process. What the user should know
    is appended to ``notes``, declared sizes that cannot describe the run to ``problems``."""
    from nccltrace.communicators.labels import (
        declares_sizes,
        label_by_behaviour,
        label_communicators,
    )

    sizes = settings or None
    layouts = None  # without declared sizes: the consistent layouts, when behaviour ranked one first
    if not declares_sizes(settings):
        sizes, note, layouts = _inferred_sizes(comms, members, call_kinds)
        notes.append(note)
    try:
        labels = label_communicators(comms, sizes, members=members, calls=call_kinds)
    except ValueError as e:  # declared sizes that cannot describe this run
        problems.append(f"parallelism sizes: {e}; falling back to the heuristic labels")
        labels = label_communicators(comms, None, members=members, calls=call_kinds)
        sizes = layouts = None
    if layouts is not None:
        labels = label_by_behaviour(labels, layouts)
    if sizes is None:
        labels = _world_is_not_dp(labels, comms, members)
    return labels


def call_counts(calls_path: Path) -> pd.DataFrame:
    """Per call signature (host, pid, comm, op, count, datatype) of one process's calls: ``calls``
    and ``peers`` (distinct roots: the peer of a Send/Recv)."""
    calls = read_table(calls_path, columns=["host", "pid", "op", "comm", "count", "datatype", "root"])
    g = calls.groupby(["host", "pid", "comm", "op", "count", "datatype"], dropna=False, sort=False, observed=True)
    return pd.concat([g.size().rename("calls"), g["root"].nunique().rename("peers")], axis=1).reset_index()


def _inferred_sizes(comms: pd.DataFrame, members: pd.DataFrame | None = None, call_counts: pd.DataFrame | None = None
                    ) -> tuple[dict[str, int] | None, str, list[dict] | None]:  # fmt: skip
    """Sizes from the member sets of the communicators seen, when they determine them
    (:func:`nccltrace.megatron.infer.infer_layout`); else, when what the communicators did ranks
    one consistent layout first (:func:`nccltrace.megatron.behaviour.most_likely`), that layout's
    sizes with every consistent layout's groups (the labels are then marked 'behaviour', with
    the kinds the others allow); and what to tell the user."""
    from nccltrace.communicators.labels import communicator_behaviour
    from nccltrace.megatron.behaviour import kinds_by_member_set
    from nccltrace.megatron.infer import infer_layout

    remedy = "declare them (run.yaml, or --tp/--pp/--cp/--ep of nccltrace analyze) for exact labels"
    full = comms[comms["complete"].astype(bool)] if len(comms) else comms
    groups = [sorted(int(r) for r in m) for m, n in zip(full.get("members", []), full.get("nranks", []))
              if int(n) > 1 and all(int(r) >= 0 for r in m)]  # fmt: skip
    world = run_world_size(comms, members) or 0
    if world < 2 or not groups:
        return None, (f"parallelism labels are guesses (no sizes declared, no communicator to infer them from); "
                      f"{remedy}"), None
    behaviour = (communicator_behaviour(call_counts, members) if call_counts is not None and members is not None
                 else None)  # fmt: skip
    res = infer_layout(world, groups, ops=behaviour)
    if res.layout is not None and res.consistent:
        sizes = {k: int(res.layout[k]) for k in ("tp", "pp", "cp", "ep", "etp")}
        txt = ", ".join(f"{k}={v}" for k, v in sizes.items())
        return {**sizes, "world_size": world}, (f"parallel sizes inferred from the communicators' member sets: {txt} "
                                               f"(world {world}); {remedy} to check them"), None
    known = ", ".join(f"{k}={v}" for k, v in res.sizes.items() if v is not None) or "none"
    likely = res.most_likely
    if likely is not None and likely.get("by_behaviour") and not likely.get("tied"):
        sizes = {k: int(likely[k]) for k in ("tp", "pp", "cp", "ep", "etp")}
        runner = likely.get("runner_up")
        return {**sizes, "world_size": world}, (
            "parallelism labels are guesses ranked by what each communicator does (label_source 'behaviour'): "
            f"{len(res.candidates)} layouts fit the member sets (certain: {known}); the most likely is "
            + ", ".join(f"{k}={v}" for k, v in sizes.items()) + f" ({'; '.join(likely['evidence'])})"
            + (", the runner-up " + ", ".join(f"{k}={runner[k]}" for k in ("tp", "pp", "cp", "ep", "etp"))
               if runner else "") + f"; {remedy}"), [kinds_by_member_set(c, world) for c in res.candidates]
    return None, (f"parallelism labels are guesses: the communicators seen do not determine Megatron's sizes "
                  f"(determined: {known}; {len(res.candidates)} layouts fit); {remedy}"), None


def _world_is_not_dp(labels: pd.DataFrame, comms: pd.DataFrame, members: pd.DataFrame) -> pd.DataFrame:
    """Without sizes, a communicator of every rank is the world, not data parallelism: dp is
    a claim only the layout can make."""
    world = run_world_size(comms, members) or 0
    spans = (labels["nranks"].astype("Int64") == world) & (labels["parallelism"].astype(str) == "dp")
    if world > 1 and spans.any():
        labels = labels.copy()
        for c in ("parallelism", "parallelism_candidates"):
            if c in labels:
                labels.loc[spans, c] = "world"
    return labels


def _lost_lines(records: list[Mapping[str, Any]]) -> set[int]:
    """Positions of the processes whose alignment found lines missing from the log (the
    ``log_gaps`` check of their quality record)."""
    return {i for i, q in enumerate(records)
            if any(c.get("check") == "log_gaps" and int(c.get("not_checkable") or 0) > 0 for c in q.get("checks", []))}


def _quality_table(processes: list[str], records: list[Mapping[str, Any]], cross: pd.DataFrame,
                   p2p: pd.DataFrame | None = None,
                   stood_down: Mapping[str, list[dict]] | None = None,
                   p2p_stood_down: Mapping[str, list[dict]] | None = None) -> pd.DataFrame:  # fmt: skip
    """The run's alignment-quality table (``QUALITY_SCHEMA``): each process's own checks
    (``records``, one per process) and the run-level ones (cross-rank instances, P2P pairing,
    and where the cross-rank check stood down: ``stood_down`` per process)."""
    from nccltrace.align.quality import QUALITY_SCHEMA, quality_rows

    run_checks = [(name, t.set_index("process") if t is not None and len(t) else None)
                  for name, t in (("cross_rank", cross), ("p2p_pairing", p2p))]
    rows: list[dict] = []
    for proc, q in zip(processes, records):
        host, pid = q.get("host"), q.get("pid")
        checks = list(q.get("checks", []))
        for name, t in run_checks:
            if t is not None and proc in t.index:
                c = t.loc[proc]
                checks.append({"check": name, "applicable": True, "confirmed": int(c["confirmed"]),
                               "contradicted": int(c["contradicted"]), "not_checkable": int(c["not_checkable"])})
            else:
                checks.append({"check": name, "applicable": False})
        if stood_down and stood_down.get(proc):
            checks.append(_stand_down_record(proc, stood_down[proc]))
        if p2p_stood_down and p2p_stood_down.get(proc):
            checks.append(_p2p_stand_down_record(proc, p2p_stood_down[proc]))
        rows += quality_rows(proc, host, pid, {"checks": checks})
    frame = pd.DataFrame(rows, columns=QUALITY_SCHEMA.names)
    return coerce_to_schema(frame, QUALITY_SCHEMA)


def _finding(check: str, message: str) -> dict[str, Any]:
    """A quality record that is a finding (a check that stood down): no match confirmed or demoted."""
    return {"check": check, "applicable": True, "confirmed": 0, "contradicted": 0, "not_checkable": 0,
            "message": message}


def _logical_ids(recs: list[dict]) -> str:
    """'<n> communicator(s) (logical id a, b)' of stand-down records."""
    comms = sorted({int(r["comm"]) for r in recs if pd.notna(r["comm"])})
    return f"{len(comms)} communicator(s) (logical id {', '.join(map(str, comms))})"


def _stand_down_record(proc: str, recs: list[dict]) -> dict[str, Any]:
    """The quality record of a process whose communicators the cross-rank check stood down on."""
    spread = float(np.median([r["end_spread_ns"] for r in recs]))
    gap = float(np.median([r["gap_ns"] for r in recs]))
    return _finding("cross_rank_stood_down", (
        f"{proc}: the cross-rank check's common-end and order tests stood down on {_logical_ids(recs)}: the kernels "
        f"of one collective end {spread / 1e6:.2f} ms apart on its ranks (median) for {gap / 1e6:.2f} ms between "
        "consecutive collectives, so ending together cannot tell a collective from its neighbour there; only the "
        "dependency test ran (no match demoted for ending apart). Likely causes: ranks time-sharing a GPU, "
        "unsynchronised clocks, a capture from several sessions or millisecond stragglers"))


def _p2p_stand_down_record(proc: str, recs: list[dict]) -> dict[str, Any]:
    """The quality record of a process on communicators where the P2P pairing check stood down."""
    bad, pairs = sum(int(r["contradicted"]) for r in recs), sum(int(r["pairs"]) for r in recs)
    lead = float(np.median([r["median_lead_ns"] for r in recs]))
    return _finding("p2p_pairing_stood_down", (
        f"{proc}: the P2P pairing check stood down on {_logical_ids(recs)}: {bad} of {pairs} Send/Recv pairs would "
        f"have a Recv ending before its Send started, by {lead / 1e3:.1f} us (median), more than a few lost records "
        "explain, so no match was demoted for it. Likely causes: unsynchronised clocks (exports of several sessions "
        "or processes, a clock fit without shared collectives), ranks time-sharing a GPU"))


def write_run_ops(result: RunOps, labels_path: Path | str, clock_path: Path | str,
                  quality_path: Path | str | None = None) -> None:  # fmt: skip
    """Write the parallelism labels, the clock model and (``quality_path``) the alignment-quality
    table atomically (the ops table itself is written by :func:`stream_run_ops`)."""
    if quality_path is not None and result.quality is not None:
        from nccltrace.align.quality import QUALITY_SCHEMA

        write_table_atomic(frame_to_table(result.quality, QUALITY_SCHEMA), Path(quality_path))
    from nccltrace.communicators.labels import LABEL_SCHEMA

    write_table_atomic(frame_to_table(result.labels, LABEL_SCHEMA), Path(labels_path))
    write_table_atomic(frame_to_table(coerce_to_schema(result.clock, CLOCK_SYNC_SCHEMA), CLOCK_SYNC_SCHEMA),
                       Path(clock_path))
