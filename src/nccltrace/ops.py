"""The enriched per-operation table of a run: what each op was, when it ran, on which ranks.

Joins, per call line, the correlation table (matched kernel and why/why not), the call's
arguments from the log, the logical communicator with the process's global rank and rank in
it, the parallelism the communicator serves, a cross-rank instance key, and kernel times on
each node's clock and after clock synchronisation (``nccltrace.clocksync``). Columns are
documented in ``OPS_SCHEMA`` (rendered into ``docs/tables.md``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from .align.correlate import ALIGNMENT_SCHEMA
from .tables import coerce_to_schema, read_table, write_table_atomic
from .tables import documented_field as _f

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
        _f("parallelism_candidates", pa.string(), "", "every group kind with the same member set (comma list)"),
        _f("label_source", pa.string(), "", "'megatron-groups' (declared sizes), 'heuristic' (thesis 4.2.3 fallback) "
           "or 'unmatched'"),
        _f("instance", pa.string(), "", "cross-rank key of one collective instance: '<logical_id>:<opCount>' where "
           "opCount is informative, else '<logical_id>#<k-th call on the communicator>'; null for P2P, duplicate "
           "lines and single-rank communicators"),
        _f("kernel_start_utc", pa.int64(), "ns", "kernel start read on the node's clock as UTC (nsys + session start)"),
        _f("kernel_end_utc", pa.int64(), "ns", "kernel end on the node's clock as UTC"),
        _f("kernel_start_sync", pa.int64(), "ns", "kernel start on the reference node's clock (clock sync); null "
           "when the node's clock could not be related to the reference"),
        _f("kernel_end_sync", pa.int64(), "ns", "kernel end on the reference node's clock"),
    ]
)
P2P = {"Send", "Recv"}


@dataclass
class RunOps:
    """The enriched ops of a run, the parallelism labels and the clock model."""

    ops: pd.DataFrame
    labels: pd.DataFrame
    clock: pd.DataFrame
    partial: bool
    problems: list[str]


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
    key.loc[sub.index] = np.where(informative, lid + ":" + sub["op_count"].astype("int64").astype(str),
                                  lid + "#" + kth.astype(str))  # fmt: skip
    return key


def build_run_ops(
    alignment_paths: Iterable[Path | str],
    calls_dirs: Iterable[Path | str],
    communicators_path: Path | str,
    members_path: Path | str,
    sessions: Mapping[str, Path | str],
    settings: Mapping[str, Any] | None = None,
) -> RunOps:
    """Assemble the enriched ops of one run from the outputs of the earlier stages."""
    from .clocksync import add_sync_columns, estimate_clock_model
    from .parallelism import label_communicators, label_ops

    problems: list[str] = []
    aligned = pd.concat([read_table(p) for p in alignment_paths], ignore_index=True)
    call_cols = ["file", "line", "count", "datatype_name", "nranks", "root", "bytes", "message_bytes"]
    calls = pd.concat([read_table(Path(d) / "calls.parquet", columns=call_cols + ["host", "pid", "op", "comm"])
                       for d in calls_dirs], ignore_index=True)  # fmt: skip
    ops = aligned.merge(calls[call_cols], on=["file", "line"], how="left")
    comms = read_table(communicators_path)
    members = read_table(members_path)
    m = members[["host", "pid", "comm", "logical_id", "rank_in_comm", "global_rank"]]
    ops = ops.merge(m, on=["host", "pid", "comm"], how="left")
    # kernel rows and calls on communicators without an init line: global rank of the process
    proc_rank = members.dropna(subset=["global_rank"]).groupby(["host", "pid"])["global_rank"].first()
    miss = ops["global_rank"].isna()
    if miss.any():
        ops.loc[miss, "global_rank"] = [proc_rank.get((h, p), pd.NA) for h, p in zip(ops.loc[miss, "host"],
                                                                                       ops.loc[miss, "pid"])]  # fmt: skip
    unresolved = int(((ops["row_kind"] == "call") & ops["logical_id"].isna()).sum())
    if unresolved:
        problems.append(f"{unresolved} call lines on communicators without init lines (no logical communicator)")
    try:
        labels = label_communicators(comms, settings or None, members=members, calls=calls)
    except ValueError as e:  # declared sizes that cannot describe this run
        problems.append(f"parallelism sizes: {e}; falling back to the heuristic labels")
        labels = label_communicators(comms, None, members=members, calls=calls)
    ops = label_ops(ops, labels)
    ops["instance"] = _instances(ops)

    utc = {h: int(json.loads(Path(p).read_text()).get("utc_offset_ns") or 0) for h, p in sessions.items()}
    off = ops["host"].map(utc).astype("Int64")
    ops["kernel_start_utc"] = ops["kernel_start"].astype("Int64") + off
    ops["kernel_end_utc"] = ops["kernel_end"].astype("Int64") + off
    clock = pd.DataFrame()
    sync_rows = ops[(ops["status"] == "matched") & ops["instance"].notna()]
    frame = pd.DataFrame({
        "clock_domain": sync_rows["host"].astype(str), "global_rank": sync_rows["global_rank"],
        "instance": sync_rows["instance"].astype(str), "start_ns": sync_rows["kernel_start_utc"],
        "end_ns": sync_rows["kernel_end_utc"], "nranks": sync_rows["nranks"],
    }).dropna()  # fmt: skip
    ops["kernel_start_sync"] = pd.array([pd.NA] * len(ops), dtype="Int64")
    ops["kernel_end_sync"] = pd.array([pd.NA] * len(ops), dtype="Int64")
    if frame["clock_domain"].nunique() > 1:
        model = estimate_clock_model(frame.astype({"start_ns": "int64", "end_ns": "int64", "global_rank": "int64",
                                                   "nranks": "int64"}))  # fmt: skip
        clock = model.domains.reset_index()
        has = ops["kernel_start_utc"].notna()
        tmp = pd.DataFrame({"clock_domain": ops.loc[has, "host"].astype(str),
                            "start_ns": ops.loc[has, "kernel_start_utc"], "end_ns": ops.loc[has, "kernel_end_utc"]})
        synced = add_sync_columns(tmp, model)
        ops.loc[has, "kernel_start_sync"] = synced["start_ns_sync"].to_numpy()
        ops.loc[has, "kernel_end_sync"] = synced["end_ns_sync"].to_numpy()
        bad = clock[clock["status"].isin(["disconnected", "no_shared_instances", "all_rejected"])]
        for row in bad.itertuples():
            problems.append(f"clock of {row[1]}: {row.reason}")
    else:
        # one node: one clock, nothing to synchronise
        ops["kernel_start_sync"] = ops["kernel_start_utc"]
        ops["kernel_end_sync"] = ops["kernel_end_utc"]
    partial = bool(problems) or not bool(comms["complete"].astype(bool).all()) if len(comms) else True
    return RunOps(ops=coerce_to_schema(ops, OPS_SCHEMA), labels=labels, clock=clock, partial=partial, problems=problems)


def write_run_ops(result: RunOps, ops_path: Path | str, labels_path: Path | str, clock_path: Path | str) -> None:
    """Write the ops table, the parallelism labels and the clock model atomically."""
    write_table_atomic(pa.Table.from_pandas(result.ops, schema=OPS_SCHEMA, preserve_index=False), Path(ops_path))
    from .parallelism import LABEL_SCHEMA

    labels = pa.Table.from_pandas(result.labels[LABEL_SCHEMA.names], schema=LABEL_SCHEMA, preserve_index=False)
    write_table_atomic(labels.replace_schema_metadata(LABEL_SCHEMA.metadata), Path(labels_path))
    clock = result.clock if len(result.clock) else pd.DataFrame({"clock_domain": pd.Series([], dtype="string")})
    write_table_atomic(pa.Table.from_pandas(clock, preserve_index=False), Path(clock_path))
