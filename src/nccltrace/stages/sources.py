"""Stage sources: the processes of a run that left no NCCL log, and the per-node work on them.

A run without logs has its processes in its other sources (``inputs.evidence``): a
PyTorch-profiler trace names its process's pid and global rank, a Flight Recorder dump the rank;
a run that left only nsys exports has the processes whose NCCL API ranges or kernels they record
(host and pid, no rank). Which processes there are is known only once the sources are read, so
the workflow reads them in one job per run (the checkpoint ``sources``: :func:`run_sources`),
which stages each trace once into ``inputs/kernels/<trace>/`` (the tables every later stage
reads, as ``nccltrace analyze`` stages them) and lists the processes with their sources in
``inputs/processes.json`` (:func:`read_source_processes`). The workflow's per-node jobs then
take the node's processes from that list: parse_node parses the node's kernel source (its
trace or export: :func:`kernel_sources_of`) and each process from its records
(:func:`run_parse_sources_node`, stage ``parse_sources``), align_node installs the alignment
those records gave (:func:`run_install_alignments`: nothing is aligned, each record names its
own kernel). What the sources do not record is said once for the run (:func:`logless_gaps`),
with the remedy. ``nccltrace analyze`` does the same steps in one process.

Snakemake removes a job's output directories before it runs, so the alignment that
``parse_sources`` writes into ``aligned/<host>/<proc>/`` during parse_node would be lost when the
node's align_node job starts: with ``carry``, parse_node moves it into its own output
(:meth:`~nccltrace.core.layout.RunLayout.record_alignment`) and align_node copies it back.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nccltrace.acquisition.status import WORKFLOW_REMEDY, Remedy
from nccltrace.core.layout import ALIGNMENT_FILE, ALIGNMENT_QUALITY_FILE, MANIFEST_FILE, RunLayout
from nccltrace.core.provenance import write_manifest
from nccltrace.core.settings import RunSettings
from nccltrace.core.tables import write_json_atomic
from nccltrace.inputs.evidence import SourceProcess
from nccltrace.inputs.kernel_sources import StagedTrace
from nccltrace.stages import StageResult, each_process

__all__ = [
    "has_logs",
    "kernel_sources_of",
    "logless_gaps",
    "logless_processes",
    "raw_sources",
    "read_source_processes",
    "run_install_alignments",
    "run_parse_sources_node",
    "run_sources",
    "source_problems",
]

_LOG_HINT = ("write one NCCL debug log per process with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL "
             "NCCL_DEBUG_FILE=<dir>/nccl_%h_%p.log")
_SIZE_REMEDY = ("keep CPU activity in torch.profiler (activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]: its "
                "record_param_comms ops hold every call's size, batched Send/Recv too), or keep Flight Recorder dumps "
                "(TORCH_FR_BUFFER_SIZE=<entries>, dumped at the end), or log with NCCL_DEBUG=INFO "
                "NCCL_DEBUG_SUBSYS=COLL")
_SIZE_REMEDY_WITH_DUMPS = ("keep CPU activity in torch.profiler (its record_param_comms ops hold every call's size and "
                           "split sizes), or log with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL (Flight Recorder keeps "
                           "tensor shapes only: an all-to-all with uneven splits has no per-peer count there)")
_SIZE_REMEDY_NSYS = ("add the run's profiler traces or Flight Recorder dumps, or log with NCCL_DEBUG=INFO (NCCL's NVTX "
                     "payloads give bytes at most, not element counts)")
_TIME_REMEDY = ("profile the ranks with torch.profiler (activities CPU and CUDA) or nsys, or set "
                "TORCH_NCCL_ENABLE_TIMING=1 so that Flight Recorder times each call")
_RECORD_FILES = (ALIGNMENT_FILE, ALIGNMENT_QUALITY_FILE, MANIFEST_FILE)


def has_logs(raw: Path | str) -> bool:
    """Whether an acquired raw directory holds NCCL logs (``nccl/nccl_<host>_<pid>.log``); a run
    without them is analysed from its other sources (this module)."""
    nccl = Path(raw) / "nccl"
    return nccl.is_dir() and any(nccl.glob("nccl_*.log"))


def raw_sources(raw: Path | str) -> tuple[list[Path], list[Path], list[Path]]:
    """The PyTorch-profiler traces (``kineto/``, by content), Flight Recorder dumps
    (``flight_recorder/``, the pickles there) and nsys exports (``nsys/``, ``*.sqlite`` in
    subdirectories too) of an acquired raw directory, as the import put them."""
    from nccltrace.acquisition.raw import TRACES_DIR
    from nccltrace.kineto.reader import iter_kineto_files
    from nccltrace.pytorch.flight_recorder import pickle_files

    raw = Path(raw)
    traces = list(iter_kineto_files([raw / TRACES_DIR])) if (raw / TRACES_DIR).is_dir() else []
    dumps = pickle_files(raw / "flight_recorder") if (raw / "flight_recorder").is_dir() else []
    exports = sorted((raw / "nsys").rglob("*.sqlite")) if (raw / "nsys").is_dir() else []
    return traces, dumps, exports


def logless_processes(traces: Sequence[Path], dumps: Sequence[Path], staging: Path | str, *,
                      exports: Sequence[Path] = (), notes: list[str] | None = None, where: Path | str = "",
                      progress: Callable[[Path], None] | None = None,
                      ) -> tuple[list[SourceProcess], list[str]]:  # fmt: skip
    """The processes of a run without NCCL logs: its profiler ``traces`` read once into
    ``staging/<trace>/`` (``inputs.kernel_sources.stage_traces``) and its Flight Recorder
    ``dumps``, one process per rank (``inputs.evidence.source_processes``), in rank order; where
    neither gives one, those of its nsys ``exports`` (``inputs.evidence.export_processes``, each
    export named after the host it recorded; ``notes`` gets what an export without NCCL says).
    Returns them and one problem per source not used; raises ``ValueError`` naming ``where`` (the
    run) when no source is usable. ``progress(trace)`` after each trace read."""
    from nccltrace.inputs.evidence import export_processes, source_processes
    from nccltrace.inputs.kernel_sources import stage_traces

    problems: list[str] = []
    staged = stage_traces(list(traces), Path(staging), progress=progress) if traces else []
    problems += [f"profiler trace {t.path.name} not used: {t.problem}" for t in staged if t.problem]
    procs = source_processes(staged, list(dumps), problems)
    if not procs and exports:  # nsys exports alone: their NCCL API ranges are the calls
        from nccltrace.acquisition.raw import RawImportError, assign_exports

        try:
            assigned = assign_exports(list(exports), set())
        except RawImportError as e:
            raise ValueError(str(e)) from None
        # one export per node, or one per process (the node's are merged by its parse, as with logs)
        named = [*assigned.exports.items(), *((h, p) for h, more in assigned.more.items() for p in more)]
        procs = export_processes(named, notes if notes is not None else [])
    elif not procs:
        raise ValueError(f"{where}: no usable source of NCCL calls: " + ("; ".join(problems) or
                         "no NCCL log, profiler trace, Flight Recorder dump or nsys export"))  # fmt: skip
    elif exports:
        problems.append(f"{len(exports)} nsys export(s) not used: without NCCL logs, the processes come from the "
                        "profiler traces and Flight Recorder dumps, and an export's processes are not yet joined to "
                        "them")  # fmt: skip
    return procs, problems


def kernel_sources_of(procs: Sequence[SourceProcess]) -> dict[str, Path | list[Path]]:
    """Each node's kernel sources in a run without NCCL logs: its processes' staged traces and
    nsys exports (one source as is, several as a list, as ``stages.parse_node`` takes them);
    nodes whose processes left only Flight Recorder dumps have none."""
    sources: dict[str, list[Path]] = {}
    for p in procs:
        if p.trace is not None and p.trace.tables is not None:
            sources.setdefault(p.host, []).append(p.trace.tables)
    for p in sorted(procs, key=lambda p: str(p.export)):
        if p.export is not None and p.export not in sources.setdefault(p.host, []):
            sources[p.host].append(p.export)
    return {h: (v[0] if len(v) == 1 and not v[0].is_dir() else v) for h, v in sources.items() if v}


def _rel(path: Path | None, root: Path) -> str | None:
    """``path`` relative to the run's directory where it lies inside it (the listing moves with the run)."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(Path(path).resolve())


def run_sources(layout: RunLayout) -> StageResult:
    """Checkpoint ``sources`` of a run without NCCL logs: its raw directory's traces staged into
    ``layout.staged_kernels`` and its processes with their sources listed in
    ``layout.source_processes`` (read back by :func:`read_source_processes`), with the problems
    of the sources not used and the notes. Raises ``ValueError`` when no source is usable."""
    traces, dumps, exports = raw_sources(layout.raw)
    layout.staged_kernels.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    procs, problems = logless_processes(traces, dumps, layout.staged_kernels, exports=exports, notes=notes,
                                        where=layout.raw)  # fmt: skip
    root = layout.root
    listing = {"processes": [
        {"name": p.name, "host": p.host, "pid": int(p.pid), "rank": p.rank, "rank_source": p.rank_source,
         "trace": None if p.trace is None else {"path": _rel(p.trace.path, root), "tables": _rel(p.trace.tables, root),
                                                 "pids": [int(x) for x in p.trace.pids], "rank": p.trace.rank},
         "dump": _rel(p.dump, root), "export": _rel(p.export, root), "sources": p.sources} for p in procs],
        "problems": problems, "notes": notes}  # fmt: skip
    write_json_atomic(layout.source_processes, listing)
    write_manifest(layout.manifest(layout.source_processes.parent), stage="sources", inputs=[*traces, *dumps, *exports],
                   outputs=[layout.source_processes], partial=bool(problems), reasons=problems,
                   extra={"summary": {"processes": len(procs), "traces": len(traces), "dumps": len(dumps),
                                      "exports": len(exports)}})  # fmt: skip
    kinds = sorted({s for p in procs for s in p.sources})
    return StageResult("sources", [layout.source_processes], bool(problems), problems,
                       f"{len(procs)} processes without an NCCL log, from {', '.join(kinds) or 'no source'} "
                       f"({len(traces)} trace(s), {len(dumps)} dump(s), {len(exports)} export(s))", notes,
                       details={"processes": procs})  # fmt: skip


def read_source_processes(layout: RunLayout) -> tuple[dict[str, SourceProcess], list[str]]:
    """The processes :func:`run_sources` listed (name -> process, in rank order) and the problems
    of the sources it did not use."""
    listing = json.loads(layout.source_processes.read_text())
    root = layout.root

    def path(p: str | None) -> Path | None:
        return None if p is None else root / p

    out = {}
    for p in listing["processes"]:
        t = p["trace"]
        trace = None if t is None else StagedTrace(path(t["path"]), path(t["tables"]), list(t["pids"]), t["rank"])
        out[p["name"]] = SourceProcess(p["name"], p["host"], int(p["pid"]), p["rank"], p["rank_source"], trace,
                                       path(p["dump"]), path(p.get("export")))  # fmt: skip
    return out, list(listing["problems"])


def run_parse_sources_node(layout: RunLayout, host: str, procs: Sequence[SourceProcess],
                           settings: RunSettings | Mapping[str, Any] | None = None, *,
                           remedy: Remedy = WORKFLOW_REMEDY, carry: bool = False,
                           done: Callable[[str], None] | None = None) -> StageResult:  # fmt: skip
    """parse_node of node ``host`` whose processes ``procs`` left no NCCL log: their kernel
    sources (:func:`kernel_sources_of`: profiler traces, nsys exports) parsed as the node's
    (``stages.parse_node``, into ``layout.parsed_nsys(host)``; a node with dumps alone gets an
    empty directory there: no kernel source), then each process from its records
    (``stages.parse_sources``: its parsed tables and, linked to the node's kernels, its
    alignment). ``carry``: each alignment is moved into the process's parse output
    (:meth:`~nccltrace.core.layout.RunLayout.record_alignment`) for :func:`run_install_alignments`
    (the workflow's align_node job). ``done(unit)`` after the kernel source and each process."""
    from nccltrace.stages.parse_node import run_parse_node
    from nccltrace.stages.parse_sources import run_parse_sources

    procs = sorted(procs, key=lambda p: p.name)
    strangers = [p.name for p in procs if p.host != host]
    if strangers:
        raise ValueError(f"parse_node of node {host}: {', '.join(strangers)} belong to other nodes")
    sources = kernel_sources_of(procs).get(host)
    layout.parsed_nccl_node(host).mkdir(parents=True, exist_ok=True)
    if sources is not None:
        kernels = run_parse_node(layout, host, {}, sources, settings, remedy=remedy, done=done)
    else:
        layout.parsed_nsys(host).mkdir(parents=True, exist_ok=True)
        kernels = StageResult("parse_node", summary=f"node {host}: no kernel trace (Flight Recorder dumps alone)")
    by_name = {p.name: p for p in procs}

    def run_one(name: str) -> StageResult:
        p = by_name[name]
        t = p.trace
        res = run_parse_sources(layout, p.name, p.host, p.pid, rank=p.rank, rank_source=p.rank_source,
                                trace_tables=t.tables if t is not None else None,
                                trace_file=t.path.name if t is not None else None, dump=p.dump,
                                kernels=sources is not None, nsys=p.export is not None)  # fmt: skip
        if carry:
            _carry(layout, name)
        return res

    result = each_process("parse_node", host, list(by_name), run_one, done)
    result.outputs[:0] = kernels.outputs
    result.partial |= kernels.partial
    result.problems[:0] = [p for p in kernels.problems if p not in result.problems]
    result.notes[:0] = [n for n in kernels.notes if n not in result.notes]
    result.summary = f"{kernels.summary}\n{result.summary}"
    return result


def _carry(layout: RunLayout, proc: str) -> None:
    """Move the alignment parse_sources wrote for ``proc`` into its parse output."""
    src, dest = layout.aligned(proc), layout.record_alignment(proc)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in _RECORD_FILES:
        shutil.move(src / name, dest / name)
    shutil.rmtree(src)


def run_install_alignments(layout: RunLayout, host: str, procs: Sequence[str]) -> StageResult:
    """align_node of node ``host`` whose processes ``procs`` left no NCCL log: nothing to align
    (each call's record named its kernel when parse_node parsed it); each process's alignment,
    quality record and manifest, carried in its parse output, are copied to
    ``layout.aligned(proc)``, as the align stage leaves them."""
    procs = sorted(procs)
    strangers = [p for p in procs if layout.host_of(p) != host]
    if strangers:
        raise ValueError(f"align_node of node {host}: {', '.join(strangers)} belong to other nodes")
    layout.aligned_node(host).mkdir(parents=True, exist_ok=True)

    def install(proc: str) -> StageResult:
        src, dest = layout.record_alignment(proc), layout.aligned(proc)
        missing = [n for n in _RECORD_FILES if not (src / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{src}: no {', '.join(missing)} (written by parse_node from the process's "
                                    "records): run its parse_node job again")  # fmt: skip
        dest.mkdir(parents=True, exist_ok=True)
        for name in _RECORD_FILES:
            shutil.copyfile(src / name, dest / name)
        manifest = json.loads((dest / MANIFEST_FILE).read_text())
        summary = (manifest.get("summary") or {})
        reasons = list(manifest.get("partial_reasons") or [])
        return StageResult("align", [layout.alignment(proc)], bool(manifest.get("partial")), reasons,
                           f"{summary.get('calls', 0)} calls, {summary.get('matched', 0)} matched by their records "
                           "(not aligned: each record names its kernel)")  # fmt: skip

    return each_process("align_node", host, procs, install)


def logless_gaps(layout: RunLayout, procs: Mapping[str, SourceProcess]) -> list[str]:
    """What the sources of a run without NCCL logs do not record, said once for the run with the
    remedy: element counts (e.g. batched Send/Recv in a trace without CPU records, every call of
    an nsys export), from each process's parse manifest (``summary.no_size``), and kernel times
    (processes with Flight Recorder dumps alone)."""
    out = []
    no_size = {}
    for name in procs:
        manifest = layout.manifest(layout.parsed_nccl(name))
        summary = (json.loads(manifest.read_text()).get("summary") or {}) if manifest.is_file() else {}
        no_size[name] = (int(summary.get("no_size") or 0), int(summary.get("calls") or 0))
    lacking = {p: n for p, (n, _) in no_size.items() if n}
    if lacking:
        total = sum(c for _, c in no_size.values())
        nsys_only = all(procs[p].export is not None for p in lacking)
        dumps = any(procs[p].dump is not None for p in lacking)
        remedy = (_SIZE_REMEDY if not dumps else _SIZE_REMEDY_WITH_DUMPS) if not nsys_only else _SIZE_REMEDY_NSYS
        out.append(f"{sum(lacking.values())} of {total} calls have no element count (on {len(lacking)} of "
                   f"{len(no_size)} processes): no source present records it. To get it, {remedy}")  # fmt: skip
    untimed = [p for p, sp in procs.items() if sp.trace is None and sp.export is None]
    if untimed:
        out.append(f"{len(untimed)} of {len(procs)} processes have no kernel trace (Flight Recorder dumps "
                   f"alone): their calls have no kernel times (reason 'no_export'), so no bandwidths or timeline. "
                   f"To get them, {_TIME_REMEDY}")  # fmt: skip
    return out


def source_problems(layout: RunLayout) -> list[str]:
    """The run-level problems of a run without NCCL logs (none for a run with them): the sources
    :func:`run_sources` did not use, then :func:`logless_gaps`."""
    if has_logs(layout.raw) or not layout.source_processes.is_file():
        return []
    procs, problems = read_source_processes(layout)
    return [*problems, *logless_gaps(layout, procs)]
