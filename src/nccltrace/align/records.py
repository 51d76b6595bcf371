"""The alignment of a process whose calls come from source records: each record names its
kernel itself (the profiler's correlation id, nsys's launch inside the API range), so nothing is
inferred; the rows are written in :data:`~nccltrace.align.schema.ALIGNMENT_SCHEMA` so that the
ops stage reads them as it reads an aligned log.

A call whose source names a kernel the kernel table lacks is unmatched (``no_kernel``); a call
of a process without any kernel source is unmatched ``no_export`` (Flight Recorder alone);
kernels no record claims are kernel rows with reason ``no_call_record``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from nccltrace.align.schema import (
    ALIGNMENT_SCHEMA,
    NO_CALL_RECORD_REASON,
    NO_EXPORT_REASON,
)

__all__ = ["record_alignment"]

_KERNEL_COLS = {"kernel_global_pid": "global_pid", "kernel_correlation_id": "correlation_id",
                "kernel_name": "short_name", "kernel_stream_id": "stream_id", "kernel_start": "start",
                "kernel_end": "end", "launch_start": "launch_start"}  # fmt: skip


def record_alignment(calls: pd.DataFrame, links: pd.Series, kernels: pd.DataFrame | None, method: pd.Series,
                     host: str, pid: int, kernel_pids: set[int] | None = None,
                     lost: pd.Series | None = None) -> pd.DataFrame:  # fmt: skip
    """Alignment rows of one process: one per call of ``calls`` (the process's calls table) and
    one per kernel of ``kernels`` (its kernel source's kernel table, None: no kernel source) that
    no call claims. ``links``: per call, the kernel's correlation id its record names (null:
    none); ``method``: per call, how the record names it ('kernel-record', 'cpu-record',
    'nvtx-launch'). ``kernel_pids``: the OS pids of the process in the kernel table (None: all).
    ``lost``: per call, whether its source saw the launch but the kernel record is not in the
    table (reason ``kernel_record_missing`` rather than ``no_kernel``)."""
    mine = _own_kernels(kernels, kernel_pids)
    link = links.astype("Int64").reset_index(drop=True)
    rows = pd.DataFrame({"row_kind": "call", "file": calls["file"].to_numpy(), "line": calls["line"].to_numpy(),
                         "host": host, "pid": int(pid), "op": calls["op"].to_numpy(), "comm": calls["comm"].to_numpy(),
                         "op_count": calls["op_count"].to_numpy()})  # fmt: skip
    found = pd.Series(False, index=rows.index)
    if mine is not None:
        table = mine.drop_duplicates("correlation_id")[list(_KERNEL_COLS.values())]
        table = table.rename(columns={v: k for k, v in _KERNEL_COLS.items()})
        joined = pd.DataFrame({"kernel_correlation_id": link}).merge(
            table.astype({"kernel_correlation_id": "Int64"}), on="kernel_correlation_id", how="left")
        found = joined["kernel_start"].notna() & link.notna()
        for col in _KERNEL_COLS:
            rows[col] = joined[col].where(found).to_numpy()
    else:
        for col in _KERNEL_COLS:
            rows[col] = None
    # calls that share a kernel (one grouped launch) share a launch unit, numbered in call order
    key = np.where(found, link.fillna(0).astype("int64"), -1 - np.arange(len(rows)))
    rows["unit"] = pd.factorize(key)[0]
    rows["status"] = np.where(found, "matched", "unmatched")
    missing = np.where(lost.fillna(False).to_numpy(bool), "kernel_record_missing", "no_kernel") \
        if lost is not None else "no_kernel"
    rows["reason"] = np.where(found, None, NO_EXPORT_REASON if mine is None else missing)
    rows["confidence"] = np.where(found, 1.0, np.nan)
    rows["method"] = method.reset_index(drop=True).where(found, None)
    extra = _unclaimed(mine, set(link[found].astype("int64")), host, pid) if mine is not None else None
    out = pd.concat([rows, extra], ignore_index=True) if extra is not None and len(extra) else rows
    for field in ALIGNMENT_SCHEMA:
        if field.name not in out:
            out[field.name] = None
    return out[ALIGNMENT_SCHEMA.names]


def _own_kernels(kernels: pd.DataFrame | None, pids: set[int] | None) -> pd.DataFrame | None:
    if kernels is None:
        return None
    if pids is not None and "pid" in kernels:
        kernels = kernels[kernels["pid"].isin(pids) | kernels["pid"].isna()]
    return kernels[kernels["correlation_id"].notna()]


def _unclaimed(kernels: pd.DataFrame, claimed: set[int], host: str, pid: int) -> pd.DataFrame:
    """Kernel rows of the kernels no call record claims, in time order."""
    rest = kernels[~kernels["correlation_id"].astype("int64").isin(claimed)].sort_values("start", kind="stable")
    out = pd.DataFrame({"row_kind": "kernel", "host": host, "pid": int(pid), "status": "unmatched",
                        "reason": NO_CALL_RECORD_REASON}, index=range(len(rest)))  # fmt: skip
    for col, src in _KERNEL_COLS.items():
        out[col] = rest[src].to_numpy()
    return out
