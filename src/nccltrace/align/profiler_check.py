"""Where a process has both an NCCL log and a profiler trace, the trace's own record of each
call (the kernel's arguments, or ProcessGroupNCCL's ``record_param_comms`` op for a batched
Send/Recv kernel that has none) against the logged call the alignment matched to that kernel.

The alignment never reads these records as evidence of a call's op (it reads kernel element
counts only to exclude misfits), so their agreement measures the log-based alignment on real
data: check ``profiler_records`` of the quality record, confirmed where op and element count
agree, contradicted (named with both values, never silently resolved: the log's facts stay in
the row) where they do not, not checkable where the trace records nothing of the kernel's call.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

__all__ = ["PROFILER_RECORDS_CHECK", "profiler_records_check"]

PROFILER_RECORDS_CHECK = "profiler_records"
_SHOWN = 3


def _records(kernels: pd.DataFrame, comm_records: pd.DataFrame | None, pid: int) -> pd.DataFrame:
    """The trace's call records of process ``pid`` that name op and count, with their kernel."""
    from nccltrace.kineto.comm_calls import profiler_call_records

    k = kernels[kernels["pid"].astype("Int64") == int(pid)] if "pid" in kernels else kernels
    c = comm_records[comm_records["pid"].astype("Int64") == int(pid)] if comm_records is not None else None
    rec = profiler_call_records(k.reset_index(drop=True), None if c is None else c.reset_index(drop=True),
                                {"rank": None}, "trace").records  # fmt: skip
    return rec.dropna(subset=["kernel_correlation_id", "op", "count"])


def profiler_records_check(alignment: pd.DataFrame, calls: pd.DataFrame, kernels: pd.DataFrame,
                           comm_records: pd.DataFrame | None, pid: int) -> dict[str, Any] | None:  # fmt: skip
    """The ``profiler_records`` quality record of one process (see the module docstring), or
    None when its kernel source records no call (an nsys export, a trace without arguments)."""
    has_args = "coll_name" in kernels and kernels["coll_name"].notna().any()
    if not has_args and (comm_records is None or not len(comm_records)):
        return None
    rec = _records(kernels, comm_records, pid)
    m = alignment[(alignment["row_kind"] == "call") & (alignment["status"] == "matched")]
    m = m.merge(calls[["file", "line", "count"]], on=["file", "line"], how="left").sort_values("line")
    m = m.assign(k=m.groupby("kernel_correlation_id").cumcount())
    rec = rec.assign(k=rec.groupby("kernel_correlation_id").cumcount())
    j = m.merge(rec[["kernel_correlation_id", "k", "op", "count"]].astype({"kernel_correlation_id": "Int64"}),
                on=["kernel_correlation_id", "k"], how="left", suffixes=("", "_rec"))  # fmt: skip
    checkable = j["op_rec"].notna()
    agree = checkable & (j["op"].astype(str) == j["op_rec"].astype(str)) & \
        (j["count"].astype("Int64") == j["count_rec"].astype("Int64")).fillna(False)
    bad = j[checkable & ~agree]
    message = None
    if len(bad):
        shown = "; ".join(f"line {int(r.line)}: log {r.op} count {r.count}, profiler {r.op_rec} count {r.count_rec}"
                          for r in bad.head(_SHOWN).itertuples())  # fmt: skip
        message = (f"{len(bad)} matched call(s) disagree with the profiler's own record of their kernel's call "
                   f"({shown}{' ...' if len(bad) > _SHOWN else ''}): the log's facts are kept; check that the "
                   "trace and the log come from the same process and run")  # fmt: skip
    return {"check": PROFILER_RECORDS_CHECK, "applicable": True, "confirmed": int(agree.sum()),
            "contradicted": len(bad), "not_checkable": int((~checkable).sum()), "message": message}
