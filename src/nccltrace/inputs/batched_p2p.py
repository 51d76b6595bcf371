"""Batched Send/Recv kernels a profiler trace describes by nothing but their kernel, given
their calls from the Flight Recorder dump of the same rank.

``batch_isend_irecv`` launches one ``ncclDevKernel_SendRecv`` kernel for a batch of sends and
receives; the kernel carries no record of its calls, and a trace without CPU activity keeps no
``record_param_comms`` op either, so the trace alone says neither op, size nor peer. The dump
records each send and receive (its ``enqueue_utc``: when ProcessGroupNCCL enqueued it). A
batch is enqueued after the previous NCCL launch of the thread and before its own kernel's
launch, so a record-less SendRecv kernel claims the dump's point-to-point calls that no trace
record claimed and that were enqueued in that span. A kernel with no such entry keeps its
facts null; an entry enqueued outside every span (before the trace's window) is not a row.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["claim_batched_p2p"]

_P2P = ("Send", "Recv")
_FIRST_SPAN_NS = 1_000_000  # enqueue -> launch of a batch first in the window: measured 47-153 us


def _unclaimed_p2p(rows: pd.DataFrame, fr: pd.DataFrame) -> pd.DataFrame:
    """The dump's point-to-point calls that no trace row stands for (by group and sequence)."""
    seen = rows.dropna(subset=["pg_name", "pg_seq"])
    taken = set(zip(seen["pg_name"].astype(str), seen["pg_seq"].astype("int64"), seen["op"].astype(str)))
    p2p = fr[fr["op"].isin(_P2P) & fr["enqueue_utc"].notna()]
    keep = [(str(n), int(s), str(o)) not in taken for n, s, o in zip(p2p["pg_name"], p2p["pg_seq"].fillna(-1),
                                                                     p2p["op"])]  # fmt: skip
    return p2p[keep].sort_values("enqueue_utc", kind="stable")


def claim_batched_p2p(rows: pd.DataFrame, fr: pd.DataFrame, kernels: pd.DataFrame,
                      utc_offset_ns: int | None) -> tuple[pd.DataFrame, int]:  # fmt: skip
    """``rows`` (a trace's call records linked to the dump) with each record-less SendRecv
    kernel's row replaced by the dump's calls it launched (see the module docstring); returns
    the rows and how many kernels were given their calls. ``kernels``: the trace's kernel table
    (launch times on the trace's clock, ``utc_offset_ns`` to UTC)."""
    if utc_offset_ns is None or not len(fr) or not len(rows):
        return rows, 0
    blind = rows["op"].isna() & rows["kernel_correlation_id"].notna()
    if not blind.any():
        return rows, 0
    k = kernels.dropna(subset=["correlation_id", "launch_start"])
    launch = dict(zip(k["correlation_id"].astype("int64"), k["launch_start"].astype("int64") + int(utc_offset_ns)))
    name = dict(zip(k["correlation_id"].astype("int64"), k["short_name"].astype(str)))
    tid = dict(zip(k["correlation_id"].astype("int64"), k["launch_tid"]))
    free = _unclaimed_p2p(rows, fr)
    order = sorted(launch.items(), key=lambda kv: kv[1])
    parts, claimed, n_kernels = [], set(), 0
    for i, row in rows.iterrows():
        corr = int(row["kernel_correlation_id"]) if blind.at[i] else None
        if corr is None or "SendRecv" not in name.get(corr, "") or corr not in launch:
            parts.append(row.to_frame().T)
            continue
        # the batch was enqueued after the thread's previous NCCL launch (or, first in the window, just before)
        lo = max((t for c, t in order if t < launch[corr] and tid.get(c) == tid.get(corr)),
                 default=launch[corr] - _FIRST_SPAN_NS)  # fmt: skip
        span = free[(free["enqueue_utc"] > lo) & (free["enqueue_utc"] <= launch[corr]) & ~free.index.isin(claimed)]
        if span.empty:
            parts.append(row.to_frame().T)
            continue
        claimed.update(span.index)
        n_kernels += 1
        batch = span.copy()
        batch["file"], batch["rank"], batch["pid"], batch["tid"] = row["file"], row["rank"], row["pid"], row["tid"]
        batch["kernel_correlation_id"] = corr
        batch["record_utc"] = row["record_utc"]
        parts.append(batch[rows.columns])
    out = pd.concat(parts, ignore_index=True).astype(rows.dtypes.to_dict())
    out["record"] = np.arange(len(out), dtype="int64")
    return out, n_kernels
