"""Stage parse_sources: one process without an NCCL log, from the records its other sources
left (a PyTorch-profiler trace, a Flight Recorder dump, or both), into the tables the log path
writes: ``parsed/nccl/<host>/<proc>/`` (calls, comms, call sources) and, since each record
names its own kernel, its alignment ``aligned/<host>/<proc>/``. Later stages then run as for a
logged process. Where a trace and a dump both describe the process, the dump's entries are
linked to the trace's calls (sequence numbers, sizes the trace lacks) and every disagreement is
named (quality check ``sources_agree``). Facts no source gives stay null (``details['no_size']``
counts the calls without a size; the run says it once, with the remedy)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from nccltrace.align.quality import quality_problems, write_quality
from nccltrace.align.records import record_alignment
from nccltrace.core.layout import (
    COMM_RECORDS_FILE,
    KERNELS_FILE,
    MANIFEST_FILE,
    PARSE_REPORT_FILE,
    SESSION_FILE,
    SOURCE_RANK_FILE,
    RunLayout,
)
from nccltrace.core.provenance import write_manifest
from nccltrace.core.tables import read_table, write_json_atomic, write_table_atomic
from nccltrace.inputs.call_records import records_tables, write_record_tables
from nccltrace.stages import StageResult

if TYPE_CHECKING:  # annotations only
    from nccltrace.pytorch.flight_recorder import FlightRecorderDump

__all__ = ["run_parse_sources"]

_METHOD = {"kernel-record": "kernel-record", "cpu-record": "cpu-record", "nvtx-range": "nvtx-launch",
           "flight-recorder": "fr-batch"}  # fmt: skip
# how a call's record names its kernel, by the source of its op (a dump's entry names a kernel
# only where a record-less batched Send/Recv kernel claimed it: inputs.batched_p2p)


@dataclass(frozen=True)
class _Trace:
    """A staged profiler trace, read once: its session record, kernels and call records."""

    session: dict
    kernels: pd.DataFrame
    comm_records: pd.DataFrame | None

    @classmethod
    def read(cls, tables: Path) -> _Trace:
        records = tables / COMM_RECORDS_FILE
        return cls(json.loads((tables / SESSION_FILE).read_text()), read_table(tables / KERNELS_FILE),
                   read_table(records) if records.exists() else None)  # fmt: skip


def _nsys_records(parsed_nsys: Path, pid: int) -> tuple[pd.DataFrame, list[str]]:
    """The NCCL API calls of process ``pid`` in its node's parsed export (``nsys.api_calls``)."""
    from nccltrace.nsys.api_calls import staged_call_records

    got = staged_call_records(parsed_nsys)
    rows = got.records[got.records["pid"].astype("Int64") == int(pid)].reset_index(drop=True)
    # (the export's parse already said what its payloads lack and how to re-export: said once)
    messages = [m for m in got.messages if "--include-blobs" not in m]
    return rows.assign(source="nsys-nvtx"), messages


def _records(trace: _Trace | None, trace_file: str, dump: FlightRecorderDump | None
             ) -> tuple[pd.DataFrame, list[str], dict]:  # fmt: skip
    """The process's call records from its sources: the trace's (linked to the dump's entries
    when both exist), else the dump's; messages; link statistics."""
    from nccltrace.kineto.comm_calls import profiler_call_records
    from nccltrace.pytorch.fr_calls import dump_call_records, link_profiler_records

    fr = dump_call_records(dump, dump.path.name) if dump is not None else None
    if trace is None:
        return fr.assign(source="flight-recorder"), [], {}
    got = profiler_call_records(trace.kernels, trace.comm_records, trace.session, trace_file)
    rows, messages = got.records.assign(source="profiler"), list(got.messages)
    if fr is None:
        return rows, messages, {}
    linked, link_messages, stats = link_profiler_records(_launch_times(rows, trace), fr)
    linked["record_utc"] = rows["record_utc"].to_numpy()  # (the stand-in times were for the link only)
    blind = int((linked["op"].isna() & linked["kernel_correlation_id"].notna()).sum())
    linked, filled = _batched_p2p(linked, fr, trace)
    stats["batched_p2p_kernels_filled"] = filled
    if filled:  # the rows the link could not key (no op, no group) were then given their calls
        link_messages = [m for m in link_messages if "name no process group" not in m
                         and "linked to no Flight Recorder entry" not in m]  # fmt: skip
        link_messages.append(f"{filled} of {blind} batched Send/Recv kernels without a record of their calls given "
                             "them from the dump (the point-to-point entries enqueued after the thread's previous "
                             "NCCL launch and before the kernel's)")  # fmt: skip
    return linked.assign(source="profiler"), messages + list(link_messages), dict(stats)


_ENQUEUE_LEAD_NS = 1_000_000  # a call is enqueued at most this long before its kernel's launch (measured: 47-153 us)


def _launch_times(rows: pd.DataFrame, trace: _Trace) -> pd.DataFrame:
    """``rows`` where a call has no CPU record (a trace without CPU activity) but a kernel: its
    ``record_utc`` stands in as the launch minus the longest enqueue-to-launch lead, so that
    the dump's entry enqueued just before the launch is the first after it (the link's rule).
    Disagreeing links are still named by the link; the stand-in is not written."""
    missing = rows["record_utc"].isna() & rows["kernel_correlation_id"].notna()
    offset = trace.session.get("utc_offset_ns")
    if not missing.any() or offset is None:
        return rows
    k = trace.kernels[["correlation_id", "launch_start"]].dropna()
    launch = dict(zip(k["correlation_id"].astype("int64"), k["launch_start"].astype("int64")))
    utc = [launch.get(int(c)) for c in rows.loc[missing, "kernel_correlation_id"]]
    out = rows.copy()
    out.loc[missing, "record_utc"] = pd.array([None if t is None else t + int(offset) - _ENQUEUE_LEAD_NS
                                               for t in utc], dtype="Int64")  # fmt: skip
    return out


def _batched_p2p(rows: pd.DataFrame, fr: pd.DataFrame, trace: _Trace) -> tuple[pd.DataFrame, int]:
    """Record-less batched Send/Recv kernels of the trace given their calls from the dump."""
    from nccltrace.inputs.batched_p2p import claim_batched_p2p

    kernels = trace.kernels[["correlation_id", "launch_start", "launch_tid", "short_name"]]
    return claim_batched_p2p(rows, fr, kernels, trace.session.get("utc_offset_ns"))


def _groups(trace: _Trace | None, dump: FlightRecorderDump | None) -> list[tuple[str, str | None, list[int]]]:
    """(name, description, global ranks in group order) of every group the process's sources
    list: the profiler's ``distributedInfo.pg_config`` (in PyTorch's order), then the dump's."""
    out: list[tuple[str, str | None, list[int]]] = []
    if trace is not None:
        cfg = trace.session.get("pg_config") or []
        out += [(str(g.get("name", g.get("pg_name"))), g.get("desc", g.get("pg_desc")), list(g["ranks"]))
                for g in cfg if isinstance(g, dict) and isinstance(g.get("ranks"), list)]  # fmt: skip
    if dump is not None:
        out += [(name, desc, list(ranks)) for name, (ranks, desc) in dump.groups.items()]
    return out


def _process_groups(calls: pd.DataFrame, sources: pd.DataFrame, comms: pd.DataFrame, source: str) -> list[dict]:
    """Per communicator of the process, the process group its records name (as the alignment
    records the groups a profiler's kernels name), so the run names its communicators; a group
    the sources list without calls is named by its own entry (0 calls)."""
    t = pd.DataFrame({"comm": calls["comm"], "pg_name": sources["pg_name"], "pg_desc": sources["pg_desc"]})
    t = t.dropna(subset=["comm", "pg_name"])
    listed = comms[~comms["comm"].isin(set(t["comm"]))].dropna(subset=["pg_name"])
    out = []
    for comm, g in t.groupby("comm", sort=True):
        counts = g.groupby(["pg_name", "pg_desc"], dropna=False).size()
        out.append({"comm": f"0x{int(comm):x}", "name_source": f"{source}-records", "groups": [
            {"pg_name": str(n), "pg_desc": None if pd.isna(d) else str(d), "calls": int(c)}
            for (n, d), c in counts.items()]})  # fmt: skip
    out += [{"comm": f"0x{int(c):x}", "name_source": f"{source}-records",
             "groups": [{"pg_name": str(n), "pg_desc": None if pd.isna(d) else str(d), "calls": 0}]}
            for c, n, d in zip(listed["comm"], listed["pg_name"], listed["pg_desc"])]  # fmt: skip
    return out


def run_parse_sources(layout: RunLayout, proc: str, host: str, pid: int, *, rank: int | None,
                      rank_source: str | None, trace_tables: Path | None = None, trace_file: str | None = None,
                      dump: Path | None = None, kernels: bool = False, nsys: bool = False) -> StageResult:  # fmt: skip
    """Parse process ``proc`` (``host``, ``pid``, global ``rank`` recorded by ``rank_source``)
    from its staged profiler trace (``trace_tables``, read from ``trace_file``) and/or Flight
    Recorder ``dump``; ``kernels``: the node's parsed kernel source exists (the trace's), so its
    calls are linked to kernels there. ``nsys``: the calls are the process's NCCL API ranges in
    that parsed export (linked to the process's own kernels: correlation ids are per process)."""
    from nccltrace.pytorch.flight_recorder import read_dump

    out, aligned = layout.parsed_nccl(proc), layout.aligned(proc)
    trace = _Trace.read(trace_tables) if trace_tables is not None else None
    fr_dump = read_dump(dump) if dump is not None else None
    if nsys:
        (records, messages), stats = _nsys_records(layout.parsed_nsys(host), pid), {}
    else:
        records, messages, stats = _records(trace, trace_file or (trace_tables.name if trace_tables else ""), fr_dump)
    calls, comms, sources = records_tables(records, host, pid, rank, rank_source, _groups(trace, fr_dump))
    source = "nsys-nvtx" if nsys else "profiler" if trace_tables is not None else "flight-recorder"
    written = write_record_tables(out, calls, comms, sources)
    write_json_atomic(out / SOURCE_RANK_FILE, {"rank": rank, "rank_source": rank_source})
    files = sorted(set(calls["file"]))
    write_json_atomic(out / PARSE_REPORT_FILE, {  # the parse summary's per-process record, as a log's
        "partial": False, "totals": {"call": len(calls), "init": len(comms)},
        "files": [{"file": f, "lines": int((calls["file"] == f).sum()), "issues": [], "counts": {}} for f in files]})
    written.append(out / PARSE_REPORT_FILE)
    inputs = [p for p in (dump, *(sorted(trace_tables.iterdir()) if trace_tables else [])) if p is not None]
    no_size = int(calls["count"].isna().sum())
    summary = {"calls": len(calls), "no_size": no_size, "sources": sorted(set(sources["source"].dropna())),
               **{f"link_{k}": v for k, v in stats.items()}}  # fmt: skip
    write_manifest(out / MANIFEST_FILE, stage="parse_sources", inputs=inputs, outputs=[*written, out / SOURCE_RANK_FILE],
                   partial=False, reasons=[], extra={"summary": summary})  # fmt: skip
    kernel_table = read_table(layout.parsed_nsys_table(host, "kernels")) if kernels else None
    method = records["op_source"].map(_METHOD)
    table = record_alignment(calls, records["kernel_correlation_id"], kernel_table, method, host, pid,
                             kernel_pids={int(pid)} if nsys else None,
                             lost=records["status"].eq("kernel_missing") if nsys else None)  # fmt: skip
    aligned.mkdir(parents=True, exist_ok=True)
    from nccltrace.align.schema import ALIGNMENT_SCHEMA
    from nccltrace.core.tables import coerce_to_schema, frame_to_table

    write_table_atomic(frame_to_table(coerce_to_schema(table, ALIGNMENT_SCHEMA), ALIGNMENT_SCHEMA), layout.alignment(proc))
    contradicted = int(stats.get("contradicted", 0) or 0)
    check = {"check": "sources_agree", "applicable": bool(stats), "confirmed": int(stats.get("linked", 0) or 0) -
             contradicted, "contradicted": contradicted, "not_checkable": int(stats.get("unlinked", 0) or 0),
             "message": "; ".join(messages[:5]) if contradicted else None}  # fmt: skip
    write_quality(layout.alignment_quality(proc), proc, {"host": host, "pid": int(pid), "checks": [check] if stats else [],
                                                         "process_groups": _process_groups(calls, sources, comms, source)})
    problems = quality_problems(proc, {"checks": [check]})
    matched = int((table["status"] == "matched").sum())
    write_manifest(layout.manifest(aligned), stage="align", inputs=[out / "calls.parquet"],
                   outputs=[layout.alignment(proc), layout.alignment_quality(proc)], partial=bool(problems),
                   reasons=problems, extra={"summary": {"calls": len(calls), "matched": matched}})  # fmt: skip
    notes = [m for m in messages if m not in problems]
    return StageResult("parse_sources", [*written, layout.alignment(proc)], bool(problems), problems,
                       str(summary), notes, details={"summary": summary, "no_size": no_size, "stats": stats})
