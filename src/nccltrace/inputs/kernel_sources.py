"""Kernel sources: where a run's kernel times come from, whichever profiler recorded them.

An nsys SQLite export (one per node or per process) and a PyTorch-profiler Chrome trace (one per
rank, or several ranks per file) are read into one set of tables (``docs/nsys.md``), so the
alignment never learns which profiler made them. A node with several sources gets their union on
one clock base (:func:`merge_sources`, each source's own UTC anchor), with the sources recorded
in ``session.json``. Sources are found by content (:func:`source_kind`), never by name.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from nccltrace.core.layout import COMM_RECORDS_FILE

__all__ = [
    "StagedTrace",
    "merge_sources",
    "source_kind",
    "stage_traces",
    "traces_of_hosts",
]

_TIME_COLUMNS = {"kernels": ("start", "end", "launch_start", "launch_end"), "nvtx": ("start", "end"),
                 "launches_without_kernel": ("start", "end"), "comm_records": ("start", "end")}  # fmt: skip


def source_kind(path: Path | str) -> str | None:
    """``'nsys'`` (an SQLite file), ``'pytorch_profiler'`` (a Chrome-trace JSON, gzip or not)
    or None, by the file's content."""
    from nccltrace.kineto.reader import is_kineto_trace
    from nccltrace.nsys.reader import _SQLITE_MAGIC

    p = Path(path)
    try:
        with open(p, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return None
    if head == _SQLITE_MAGIC:
        return "nsys"
    return "pytorch_profiler" if is_kineto_trace(p) else None


@dataclass
class StagedTrace:
    """A profiler trace read once into its tables (``tables``): its OS pids, rank, and the
    problem that made it unusable (None when read)."""

    path: Path
    tables: Path | None
    pids: list[int] = field(default_factory=list)
    rank: int | None = None
    problem: str | None = None


def stage_traces(paths: Sequence[Path], staging: Path, progress=None) -> list[StagedTrace]:
    """Read each profiler trace once into ``staging/<name>/`` (the tables every stage reads).
    A trace that cannot be read is kept with its problem (the caller names it); one read
    before (same size and modification time recorded) is not read again."""
    from nccltrace.kineto.reader import KinetoFormatError, KinetoTrace

    out: list[StagedTrace] = []
    used: set[str] = set()
    for p in paths:
        name = p.name.removesuffix(".gz").removesuffix(".json")
        while name in used:
            name += "_"
        used.add(name)
        dest = staging / name
        stamp = {"size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns, "path": str(p.resolve())}
        session = dest / "session.json"
        # tables staged by a version without comm_records are staged again
        if session.is_file() and (dest / "staged.json").is_file() and (dest / COMM_RECORDS_FILE).is_file() \
                and json.loads((dest / "staged.json").read_text()) == stamp:
            s = json.loads(session.read_text())
        else:
            try:
                trace = KinetoTrace.open(p)
                trace.export_tables(dest)
            except (KinetoFormatError, OSError) as e:
                out.append(StagedTrace(p, None, problem=str(e)))
                if progress:
                    progress(p)
                continue
            (dest / "staged.json").write_text(json.dumps(stamp))
            s = json.loads(session.read_text())
        # a cut-short trace is used (its session says so; the parse names it): only unusable ones carry a problem
        st = StagedTrace(p, dest, list(s.get("pids") or []), s.get("rank"))
        if not s.get("kernel_table"):
            st.problem = (f"{p.name}: a PyTorch-profiler trace without CUDA activity (a CPU-only trace: no kernels "
                          "or launches); profile with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]")
        out.append(st)
        if progress:
            progress(p)
    return out


def traces_of_hosts(staged: Sequence[StagedTrace], procs: dict[str, tuple[str, int]]
                    ) -> tuple[dict[str, list[StagedTrace]], list[str]]:  # fmt: skip
    """Which node each usable trace belongs to: the node of the log whose pid launched its
    kernels (a trace records no host name). ``procs``: process name -> (host, pid). Returns
    node -> traces and one message per trace that fits no log (another job's trace, or a
    rank without a log) or several (the same pid on two nodes)."""
    by_pid: dict[int, set[str]] = {}
    for host, pid in procs.values():
        by_pid.setdefault(pid, set()).add(host)
    out: dict[str, list[StagedTrace]] = {}
    problems: list[str] = []
    for t in staged:
        if t.tables is None or t.problem:
            continue
        hosts = {h for pid in t.pids for h in by_pid.get(pid, ())}
        if not hosts:
            pids = ", ".join(map(str, t.pids)) or "none"
            rank = "" if t.rank is None else f", rank {t.rank}"
            problems.append(f"{t.path.name}: its process(es) (pid {pids}{rank}) left no NCCL log here: a trace of "
                            "another job, or of a rank whose log is missing; not used")
            continue
        if len(hosts) > 1:
            problems.append(f"{t.path.name}: pid {', '.join(map(str, t.pids))} has logs on several nodes "
                            f"({', '.join(sorted(hosts))}); not used (name the trace after its host)")
            continue
        out.setdefault(hosts.pop(), []).append(t)
    return out, problems


def _read(part: Path, name: str) -> pd.DataFrame:
    """A source's table; a table the source does not write (``comm_records`` of an nsys export,
    or of tables staged before it existed) reads as empty."""
    import pyarrow.parquet as pq

    path = part / f"{name}.parquet"
    return pq.read_table(path).to_pandas() if path.is_file() else pd.DataFrame()


def _nulls_as_none(col: pd.Series) -> list:
    obj = col.astype(object)
    return obj.where(col.notna(), None).tolist()


def merge_sources(parts: Sequence[Path], out: Path, host: str) -> dict[str, Path]:
    """One node's tables from several parsed sources (directories of tables, each with its
    ``session.json``): rows concatenated, every source's stored times moved onto the first
    anchored source's clock (``t + own utc offset - base utc offset``), so one ``utc_offset_ns``
    serves them all. ``comm_records`` (profiler traces only) is written too, empty when no source
    has one. ``session.json`` lists the sources; a source without a UTC anchor among anchored
    ones is kept on its own clock and named in ``problems``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nccltrace.core.tables import atomic_output, frame_to_table, write_table_atomic
    from nccltrace.nsys import reader as nsys_reader
    from nccltrace.nsys import schema as nsys_schema
    from nccltrace.nsys.nccl_api import NCCL_API_CALLS_SCHEMA

    sessions = [json.loads((p / "session.json").read_text()) for p in parts]
    offsets = [s.get("utc_offset_ns") for s in sessions]
    base = next((o for o in offsets if o is not None), None)
    problems: list[str] = []
    for s, o in zip(sessions, offsets, strict=True):
        if o is None and base is not None:
            problems.append(f"{s.get('source_file')}: no UTC anchor in the source, so its times cannot be put on the "
                            "clock of the node's other sources; its kernels keep their own clock")
    specs = {**nsys_schema.KERNEL_SOURCE_TABLES, **nsys_schema.PROFILER_TABLES}
    paths: dict[str, Path] = {}
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in specs.items():
        frames = []
        for p, o in zip(parts, offsets, strict=True):
            f = _read(p, name)
            delta = (o - base) if (o is not None and base is not None) else 0
            for c in _TIME_COLUMNS.get(name, ()):
                if delta and c in f:
                    f[c] = f[c].astype("Int64") + delta
            frames.append(f)
        # missing values stay None (a NaN handed on would be written as the string "nan")
        cols = {c: _nulls_as_none(pd.concat([f[c] if c in f else pd.Series([None] * len(f), dtype=object)
                                             for f in frames], ignore_index=True)) for c, _ in spec}
        frame = nsys_reader._frame(cols, spec)
        if name == "kernels":
            frame = frame.sort_values(["start", "correlation_id"], kind="stable").reset_index(drop=True)
        elif name == "processes":
            frame = frame.drop_duplicates("global_pid").reset_index(drop=True)
        paths[name] = out / f"{name}.parquet"
        write_table_atomic(frame_to_table(frame, nsys_schema.spec_schema(spec)), paths[name])
    api = [pq.read_table(p / "nccl_api_calls.parquet") for p in parts]
    paths["nccl_api_calls"] = out / "nccl_api_calls.parquet"
    write_table_atomic(pa.concat_tables([t.cast(NCCL_API_CALLS_SCHEMA) for t in api]) if api
                       else NCCL_API_CALLS_SCHEMA.empty_table(), paths["nccl_api_calls"])
    kinds = sorted({s.get("source_kind", "nsys") for s in sessions})
    session: dict[str, Any] = {
        **sessions[0],
        "source_file": ", ".join(str(s.get("source_file")) for s in sessions),
        "source_kind": kinds[0] if len(kinds) == 1 else "mixed",
        "hostname": host,
        "utc_offset_ns": base,
        "session_start_utc_ns": base,
        "time_normalized": False,
        "time_shift_ns": None,
        "kernel_records": sum(int(s.get("kernel_records") or 0) for s in sessions),
        "kernel_table": any(s.get("kernel_table") for s in sessions),
        "sources": sessions,
        "problems": [*(sessions[0].get("problems") or []), *problems],
    }
    paths["session"] = out / "session.json"
    with atomic_output(paths["session"]) as tmp:
        tmp.write_text(json.dumps(session, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    return paths
