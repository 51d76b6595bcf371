"""Which processes a run without NCCL logs had, and which source describes each.

A profiler trace records its process's OS pid and global rank (``distributedInfo``) but no
host; a Flight Recorder dump records only the rank (the member its groups share). Sources of one
rank are one process. A process's host is recorded by none of them, so it is named
``rank<R>`` (one clock domain per rank: the clock-sync stage then measures whether they share a
clock rather than assuming it), and a process known from a dump alone takes its rank as its pid.
Two traces (or dumps) of one rank are refused by name: they are two jobs, or one rank twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nccltrace.core.layout import process_name
from nccltrace.inputs.kernel_sources import StagedTrace

__all__ = ["SourceProcess", "export_processes", "source_processes"]


@dataclass(frozen=True)
class SourceProcess:
    """One process of a log-less run: its name in the layout, host and pid (as named, see the
    module docstring), global rank and where the rank came from, and its sources."""

    name: str
    host: str
    pid: int
    rank: int | None
    rank_source: str | None
    trace: StagedTrace | None = None
    dump: Path | None = None
    export: Path | None = None  # the nsys export whose NCCL API ranges describe the process

    @property
    def sources(self) -> list[str]:
        """The sources of the process, in words."""
        return [s for s, v in (("profiler trace", self.trace), ("Flight Recorder dump", self.dump),
                               ("nsys export", self.export)) if v is not None]  # fmt: skip


def source_processes(traces: Sequence[StagedTrace], dumps: Sequence[Path],
                     problems: list[str]) -> list[SourceProcess]:  # fmt: skip
    """The processes of usable profiler traces and Flight Recorder dumps, one per rank (a trace
    and a dump of the same rank are one process), in rank order; ``problems`` gets one message
    per source not used (unreadable, no rank, or a rank another source of its kind has)."""
    from nccltrace.pytorch.flight_recorder import FlightRecorderError, read_dump

    by_rank: dict[int, dict[str, object]] = {}
    rankless: list[StagedTrace] = []
    for t in traces:
        if t.tables is None or t.problem:
            continue  # named by the caller (staging)
        if t.rank is None or len(t.pids) != 1:
            rankless.append(t)
            continue
        _claim(by_rank, t.rank, "trace", t, t.path.name, problems)
    by_name: set[int] = set()  # ranks only a dump's file name gives (its groups share no single member)
    for f in dumps:
        try:
            dump = read_dump(f)
        except FlightRecorderError as e:
            problems.append(f"Flight Recorder dump not used: {e}")
            continue
        rank = dump.rank
        common = set.intersection(*(set(r) for r, _ in dump.groups.values())) if dump.groups else set()
        if rank is not None and common != {rank}:
            by_name.add(rank)
            problems.append(f"{f.name}: Flight Recorder dump whose groups share no single rank: its rank {rank} is "
                            "read from the file name only (rank_source 'file-name'); name each dump after its rank, "
                            "or keep its default group in the dump")  # fmt: skip
        if rank is None:
            problems.append(f"{f.name}: Flight Recorder dump whose groups share no single rank: its rank is unknown; "
                            "not used")  # fmt: skip
            continue
        _claim(by_rank, rank, "dump", f, f.name, problems)
    for t in rankless:
        problems.append(f"{t.path.name}: profiler trace without a rank (distributedInfo) or with "
                        f"{len(t.pids)} processes: its calls cannot be placed in the job; profile with torch.distributed "
                        "initialised (the profiler then records distributedInfo)")  # fmt: skip
    out = []
    for rank, got in sorted(by_rank.items()):
        trace, dump = got.get("trace"), got.get("dump")
        pid = trace.pids[0] if isinstance(trace, StagedTrace) else rank
        host = f"rank{rank}"
        source = ("profiler-distributed-info" if trace is not None else
                  "file-name" if rank in by_name else "flight-recorder")  # fmt: skip
        out.append(SourceProcess(process_name(host, pid), host, pid, rank, source, trace, dump))  # type: ignore[arg-type]
    return out


def _claim(by_rank: dict[int, dict[str, object]], rank: int, kind: str, value: object, name: str,
           problems: list[str]) -> None:  # fmt: skip
    """Give ``rank`` its ``kind`` source, unless another source of that kind has it."""
    have = by_rank.setdefault(rank, {})
    if kind in have:
        other = have[kind]
        other_name = other.path.name if isinstance(other, StagedTrace) else Path(str(other)).name
        problems.append(f"{name}: a second {kind} of rank {rank} (besides {other_name}): two jobs, or one rank "
                        "twice; not used. Analyse one job's files at a time")  # fmt: skip
        return
    have[kind] = value


def export_processes(exports: Sequence[tuple[str, Path]], notes: list[str]) -> list[SourceProcess]:
    """The processes of nsys exports (``exports``: (host, export), the host as named from what
    each records) that made NCCL calls or ran NCCL kernels: (host, pid) as recorded, rank unknown
    (nsys records none). ``notes`` gets what an export without any says (a negative control:
    no NCCL range or kernel in its window)."""
    from nccltrace.nsys.api_calls import export_call_records
    from nccltrace.nsys.reader import NsysExport

    out = []
    for host, path in exports:
        with NsysExport.open(path) as export:
            got = export_call_records(export)
        pids = sorted({int(p) for p in got.records["pid"].dropna()} |
                      {int(p) for p in got.unclaimed_kernels["pid"].dropna()})  # fmt: skip
        if not pids:
            notes += got.messages
        out += [SourceProcess(process_name(host, pid), host, pid, None, None, export=path) for pid in pids]
    return out
