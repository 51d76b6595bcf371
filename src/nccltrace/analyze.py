"""Analyse one run without Snakemake: the workflow's stages in order, into the workflow's layout.

:func:`analyze_run` finds a run's NCCL logs and kernel traces (nsys exports, PyTorch-profiler
traces) in a directory by content and runs, in one process, the stages of
:mod:`nccltrace.stages` that the workflow's rules run, up to ``until``. The stages are the
workflow's own, so tables, manifests, problems and their messages are the same, and the results
follow :class:`~nccltrace.core.layout.RunLayout` below ``out_dir``. Missing kernel traces make
the run partial rather than failing it: the logs alone are analysed. Inputs, missing inputs and
settings: ``docs/architecture.md``, Module notes.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nccltrace.align.schema import NO_EXPORT_REASON
from nccltrace.core.layout import RunLayout
from nccltrace.core.settings import RunSettings
from nccltrace.stages import STAGES

__all__ = [
    "NO_EXPORT_REASON",
    "RawInputs",
    "analyze_run",
    "find_raw_inputs",
    "resolve_settings",
]


_LOG_HINT = ("write one NCCL debug log per process with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL "
             "NCCL_DEBUG_FILE=<dir>/nccl_%h_%p.log")
_EXPORT_HINT = "export each node's report with `nsys export --type sqlite --output <host>.sqlite <report>.nsys-rep`"


@dataclass
class RawInputs:
    """The files of one run found in a raw directory."""

    raw_dir: Path
    logs: dict[str, Path]  # process name (log file stem) -> log
    exports: dict[str, Path]  # export file stem -> SQLite export
    run_yaml: Path | None
    ignored_logs: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what finding the logs by content did
    problems: list[str] = field(default_factory=list)  # NCCL lines finding them could not attribute
    traces: list[Path] = field(default_factory=list)  # PyTorch-profiler Chrome traces (found by content)
    dumps: list[Path] = field(default_factory=list)  # Flight Recorder dumps (found by content)

    def host_of(self, proc: str) -> str:
        from nccltrace.core.layout import RunLayout

        return RunLayout.host_of(proc)


def find_raw_inputs(raw_dir: Path | str, staging: Path | str | None = None) -> RawInputs:
    """Find the per-process NCCL logs, per-node exports and ``run.yaml`` of a raw directory
    (workflow layout or flat; see the module docstring). With ``staging`` (a directory of the
    output), logs are found by content (:func:`nccltrace.inputs.logs.discover_logs`: any
    name, ``.gz``, one file per rank or a combined stdout of all ranks) and normalised there;
    without, only ``nccl_<host>_<pid>.log`` files are taken. Raises ``FileNotFoundError`` when
    the directory, every log or every export is missing."""
    from nccltrace.core.layout import process_key
    from nccltrace.inputs.logs import discover_logs, is_canonical_log

    raw = Path(raw_dir)
    if not raw.is_dir():
        raise FileNotFoundError(f"{raw}: no such directory (pass the run's raw directory with nccl/ and nsys/)")
    log_dir = raw / "nccl" if (raw / "nccl").is_dir() else raw
    nsys_dir = raw / "nsys" if (raw / "nsys").is_dir() else raw
    logs: dict[str, Path] = {}
    ignored: list[Path] = []
    notes: list[str] = []
    problems: list[str] = []
    traces: list[Path] = []
    if staging is not None:
        from nccltrace.kineto.reader import iter_kineto_files

        staging = Path(staging)
        inside = [staging.resolve(), (raw / "ground_truth").resolve()]
        traces = [p for p in iter_kineto_files([raw])
                  if not any(p.resolve().is_relative_to(d) for d in inside)]  # fmt: skip
        skip = [staging, raw / "ground_truth", nsys_dir] if nsys_dir != raw else [staging, raw / "ground_truth"]
        found = discover_logs([log_dir], staging / "nccl", exclude=[*skip, *traces])
        logs, ignored, notes, problems = dict(sorted(found.logs.items())), found.ignored, found.notes(), found.problems()
    else:
        for p in sorted(log_dir.glob("*.log")):
            # Only the NCCL_DEBUG_FILE naming ties a log to its node (job_7.log would parse as host 'job').
            if is_canonical_log(p):
                logs[p.stem] = p
            else:
                ignored.append(p)
    for stem in logs:
        process_key(stem)  # a host name the stages cannot key on fails here, with the remedy
    # one export per node, or one per process (any name, in subdirectories too); keyed by path
    skip_dirs = [Path(staging).resolve()] if staging is not None else []
    exports = {str(p.relative_to(nsys_dir).with_suffix("")): p for p in sorted(nsys_dir.rglob("*.sqlite"))
               if not any(p.resolve().is_relative_to(d) for d in skip_dirs)}
    if staging is not None:
        exports.update(_export_reports(nsys_dir, exports, Path(staging) / "nsys", notes))
    dumps = _find_dumps(raw, staging, notes) if staging is not None else []
    if not logs and not (traces or dumps or exports):
        found_txt = f" (found {', '.join(p.name for p in ignored[:5])}, without NCCL lines)" if ignored else ""
        raise FileNotFoundError(f"no evidence of NCCL calls in {raw}{found_txt}: looked for NCCL debug logs (one per "
                                f"process, per rank, or one combined stdout of all ranks, in {raw / 'nccl'} or "
                                f"directly in {raw}), PyTorch-profiler traces, Flight Recorder dumps and nsys exports; "
                                f"found none. {_LOG_HINT}; or keep torch.profiler traces, Flight Recorder dumps "
                                "(TORCH_FR_BUFFER_SIZE) or nsys reports of the run")
    if not logs:
        found_txt = ", ".join(f"{n} {what}" for n, what in ((len(traces), "profiler trace(s)"),
                                                             (len(dumps), "Flight Recorder dump(s)"),
                                                             (len(exports), "nsys export(s)")) if n)  # fmt: skip
        notes.append(f"no NCCL debug log in {raw}: the calls come from {found_txt} (each fact's source is in the "
                     "ops table's *_source columns; what none of them records is said once)")
    elif not exports and not traces:
        reports = sorted({*nsys_dir.glob("*.nsys-rep"), *nsys_dir.glob("*.qdrep")})
        names = ", ".join(p.name for p in reports[:5])
        found = f" (found {names}, not exported yet: {_EXPORT_HINT})" if reports else ""
        notes.append(f"no kernel trace in {raw}{found}: the NCCL logs alone are analysed (calls, communicators, "
                     "labels, volumes; no kernel times or bandwidths)")
    run_yaml = raw / "run.yaml"
    return RawInputs(raw, logs, exports, run_yaml if run_yaml.is_file() else None, ignored, notes, problems,
                     traces, dumps)


def _find_dumps(raw: Path, staging: Path | str, notes: list[str]) -> list[Path]:
    """The Flight Recorder dumps below ``raw`` (by content; outside the staging directory)."""
    from nccltrace.pytorch.flight_recorder import (
        FlightRecorderError,
        pickle_files,
        read_dump,
    )

    dumps: list[Path] = []
    for f in pickle_files(raw):
        if f.resolve().is_relative_to(Path(staging).resolve()):
            continue
        try:
            read_dump(f)
            dumps.append(f)
        except FlightRecorderError as e:
            notes.append(f"not used as a Flight Recorder dump: {e}")
    return dumps


def _export_reports(nsys_dir: Path, exports: Mapping[str, Path], dest: Path, notes: list[str]) -> dict[str, Path]:
    """nsys reports (``.nsys-rep``/``.qdrep``) without a ``.sqlite`` beside them, exported into
    ``dest`` with the installed nsys; without nsys, a note says how (the run then lacks them)."""
    import shutil as _shutil

    reports = [p for p in sorted({*nsys_dir.glob("*.nsys-rep"), *nsys_dir.glob("*.qdrep")}) if p.stem not in exports]
    if not reports:
        return {}
    if _shutil.which("nsys") is None:
        notes.append(f"{len(reports)} nsys report(s) without an export ({', '.join(p.name for p in reports[:3])}) and "
                     f"no nsys here to export them: {_EXPORT_HINT}")
        return {}
    from nccltrace.acquisition.nsys_export import NsysExportError, export_report

    out: dict[str, Path] = {}
    for rep in reports:
        target = dest / f"{rep.stem}.sqlite"
        try:
            if not target.is_file():
                export_report(rep, target)
            out[rep.stem] = target
        except NsysExportError as e:
            notes.append(f"{rep.name}: not exported ({e})")
    if out:
        notes.append(f"exported {len(out)} nsys report(s) with the installed nsys into {dest}")
    return out


def resolve_settings(run_yaml: Path | None, settings: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Run settings: ``run.yaml`` overridden key by key by ``settings`` (both may nest
    ``config``/``derived``); None when neither gives any."""
    import yaml

    from nccltrace.megatron.sizes import flatten_settings

    merged: dict[str, Any] = {}
    if run_yaml is not None:
        data = yaml.safe_load(run_yaml.read_text()) or {}
        if not isinstance(data, Mapping):
            raise ValueError(f"{run_yaml}: expected a mapping (run settings), got {type(data).__name__}")
        merged.update(flatten_settings(data))
    merged.update({k: v for k, v in flatten_settings(settings or {}).items() if v is not None})
    return merged or None


def _run_settings(inputs: RawInputs, settings: RunSettings | Mapping[str, Any] | None) -> tuple[RunSettings | None, str]:
    """The run's settings, read and validated once (``run.yaml`` overridden key by key by
    ``settings``), and where they came from; raises ``ValueError`` naming the setting."""
    given = settings.to_mapping() if isinstance(settings, RunSettings) else settings
    source = " + ".join(s for s, v in (("run.yaml", inputs.run_yaml), ("given settings", given)) if v)
    merged = resolve_settings(inputs.run_yaml, given)
    try:
        return (RunSettings.from_mapping(merged) if merged is not None else None), source
    except ValueError as exc:
        raise ValueError(f"run settings ({source}): {exc}") from None


def _check_sizes(settings: RunSettings | None, world_size: int | None, source: str) -> RunSettings | None:
    """Settings with a world size filled in from the init lines when none is declared; raises
    ``ValueError`` naming the field when the declared sizes cannot describe the run."""
    from nccltrace.communicators.labels import ParallelSizes

    if settings is None:
        return None
    has_world = settings.declares_world
    if not has_world and world_size:
        settings = settings.with_world_size(int(world_size))
    elif not has_world and not settings.declares_sizes:
        return settings  # settings that declare no size (e.g. only where the log names carry the ranks)
    try:
        ParallelSizes.from_settings(settings)
    except ValueError as exc:
        raise ValueError(f"declared parallel sizes ({source}): {exc}") from None
    return settings


def _bar(total: int, desc: str, unit: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, leave=False)


def _remove_stale(stage_dir: Path, keep: Mapping[str, set[str] | None]) -> None:
    """Drop per-node directories (and, in a kept node's, per-process ones: ``keep[node]``) of an
    earlier analysis into the same output that this run does not have, so ``out_dir`` describes
    one run. Only directories holding a manifest, or directories of them (written by nccltrace),
    are removed."""
    if not stage_dir.is_dir():
        return
    for d in stage_dir.iterdir():
        if not d.is_dir():
            continue
        ours = (d / "manifest.json").exists() or any((c / "manifest.json").exists() for c in d.iterdir() if c.is_dir())
        if d.name not in keep and ours:
            shutil.rmtree(d)
        elif d.name in keep and keep[d.name] is not None:
            _remove_stale(d, dict.fromkeys(keep[d.name] or (), None))


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _say(result: Any, problems: list[str], notes: list[str]) -> None:
    """Collect a stage's problems and notes once each (several stages may name one gap)."""
    problems += [p for p in result.problems if p not in problems]
    notes += [n for n in result.notes if n not in notes and n not in problems]


@dataclass
class _Analysis:
    """One analysis in progress: where it writes, what it found, what it has to say so far."""

    layout: RunLayout
    inputs: RawInputs
    settings: RunSettings | None
    source: str  # where the settings came from, for their errors
    procs: list[str]
    log_hosts: list[str]
    problems: list[str] = field(default_factory=list)  # anything that makes the result partial
    notes: list[str] = field(default_factory=list)  # worth saying, not a gap in the result
    # Set by _place_kernel_traces: each node's kernel sources and which nodes have none.
    assigned: Any = None
    sources: dict[str, Path | list[Path]] = field(default_factory=dict)
    source_problems: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)  # nodes with a kernel trace
    no_export: list[str] = field(default_factory=list)  # log hosts without one
    procs_of: dict[str, list[str]] = field(default_factory=dict)
    # processes without an NCCL log, from their other sources (inputs.evidence): name -> process
    logless: dict[str, Any] = field(default_factory=dict)

    @property
    def nodes(self) -> list[str]:
        return sorted({*self.hosts, *self.no_export})


def analyze_run(raw_dir: Path | str, out_dir: Path | str, *,
                settings: RunSettings | Mapping[str, Any] | None = None, mode: str = "default",
                progress: bool = True, capture_steps: tuple[int, int] | None = None, until: str = "ops",
                trace_options: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run the analysis stages (:mod:`nccltrace.stages`, the workflow's own) on one run, in order,
    through ``until`` (see the module docstring for inputs, outputs and how missing inputs are
    handled). ``mode``: alignment mode (``default``, ``thesis``, ``exact``). Returns a summary:
    processes, hosts, calls, matched, partial, problems, notes, ignored logs, the resolved
    settings and the output paths. ``capture_steps``: the captured steps of a step-window
    capture (logged, 1-based, inclusive; overrides the settings' ``capture.steps``)."""
    from nccltrace.align.schema import MODES
    from nccltrace.core.capture_window import CaptureWindow

    if mode not in MODES:
        raise ValueError(f"unknown alignment mode {mode!r}; use one of {', '.join(MODES)}")
    if until not in STAGES:
        raise ValueError(f"unknown stage {until!r} to stop after; use one of {', '.join(STAGES)}")
    run = _start(raw_dir, out_dir, settings, progress)
    if capture_steps is not None:
        steps: tuple[int, int] | None = CaptureWindow(*capture_steps).loop_indices
    else:
        window = run.settings.capture if run.settings is not None else None
        steps = window.loop_indices if window is not None else None
    if run.inputs.ignored_logs:
        run.notes.append(f"ignored {len(run.inputs.ignored_logs)} text file(s) without NCCL lines: "
                         f"{', '.join(p.name for p in run.inputs.ignored_logs[:5])}")
    if not run.procs:  # sources without any NCCL call or kernel (a negative control): empty tables, said
        return _empty_run(run, mode)
    _place_kernel_traces(run, progress)
    _parse(run, progress)
    run_id = _communicators_and_summary(run)
    _align(run, mode, steps, progress)
    result, ops_outputs, stage_outputs = _ops_to(run, run_id, until, trace_options, progress)
    return _finish(run, mode, result, ops_outputs, stage_outputs)


def _start(raw_dir: Path | str, out_dir: Path | str, settings: RunSettings | Mapping[str, Any] | None,
           progress: bool = False) -> _Analysis:
    """Find the run's inputs (staged below ``out_dir/inputs``) and read its settings once."""
    out = Path(out_dir)
    inputs = find_raw_inputs(raw_dir, staging=out / "inputs")
    procs = sorted(inputs.logs)
    run_settings, source = _run_settings(inputs, settings)
    notes = list(inputs.notes)
    logless, problems = ({}, []) if procs else _logless_processes(inputs, out, progress, notes)
    procs = procs or sorted(logless)
    return _Analysis(RunLayout(out), inputs, run_settings, source, procs,
                     log_hosts=sorted({inputs.host_of(p) for p in procs}), notes=notes, problems=problems,
                     logless=logless)  # fmt: skip


def _logless_processes(inputs: RawInputs, out: Path, progress: bool,
                       notes: list[str]) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """The processes of a run without NCCL logs (``stages.sources.logless_processes``: from its
    profiler traces, read once into ``out/inputs/kernels/``, and Flight Recorder dumps, else its
    nsys exports); and the problems of sources not used."""
    from nccltrace.stages.sources import logless_processes

    with _bar(len(inputs.traces), "read profiler traces", "file", progress and bool(inputs.traces)) as bar:
        procs, problems = logless_processes(inputs.traces, inputs.dumps, out / "inputs" / "kernels",
                                            exports=list(inputs.exports.values()), notes=notes,
                                            where=inputs.raw_dir, progress=lambda _: bar.update(1))  # fmt: skip
    return {p.name: p for p in procs}, problems


def _place_kernel_traces(run: _Analysis, progress: bool) -> None:
    """Each log host's kernel traces; drop an earlier analysis's nodes and processes this run lacks.
    Exports are named after the host they were captured on, as the workflow's import names them;
    profiler traces (which record no host) after the node of the log whose pid made them."""
    from nccltrace.acquisition.raw import RawImportError, assign_exports

    inputs, out = run.inputs, run.layout.root
    try:
        exports = [] if run.logless else list(inputs.exports.values())
        run.assigned = assigned = assign_exports(exports, set(run.log_hosts))
    except RawImportError as e:
        raise ValueError(str(e)) from None
    n_before = len(run.problems)
    if run.logless:
        from nccltrace.stages.sources import kernel_sources_of

        run.sources = kernel_sources_of(list(run.logless.values()))
    else:
        run.sources = _kernel_sources(inputs, assigned, run.procs, out, progress, run.problems, run.notes)
    run.source_problems = run.problems[n_before:]  # traces not used, no kernel trace: the report names them too
    if run.logless:  # (sources not used when finding a log-less run's processes: as the workflow's summary)
        run.source_problems[:0] = run.problems[:n_before]
    run.hosts = sorted(run.sources)
    if (inputs.exports or inputs.traces) and not run.logless and not set(run.hosts) & set(run.log_hosts):
        # kernel traces of other hosts or jobs: named, and the logs alone are analysed
        run.source_problems.append(
            f"no kernel trace belongs to a host of the NCCL logs (log hosts: {', '.join(run.log_hosts)}; nsys "
            f"exports: {', '.join(f'{p.name} (host {h})' for h, p in sorted(assigned.exports.items())) or 'none'}; "
            f"profiler traces: {len(inputs.traces)}, none from a pid of the logs): traces of another job or host; the "
            f"logs alone are analysed. Each trace must be captured on a host of the logs; {_EXPORT_HINT}")
        run.problems.append(run.source_problems[-1])
    run.no_export = [h for h in run.log_hosts if h not in run.sources]
    nodes = run.nodes
    run.procs_of = {h: [p for p in run.procs if inputs.host_of(p) == h] for h in nodes}
    for stage_dir, keep in ((out / "parsed" / "nccl", {h: set(run.procs_of[h]) for h in nodes}),
                            (out / "parsed" / "nsys", dict.fromkeys(nodes, None)),
                            (out / "aligned", {h: set(run.procs_of[h]) for h in run.log_hosts})):
        _remove_stale(stage_dir, keep)


def _parse(run: _Analysis, progress: bool) -> None:
    """Stages 1-2, one node at a time as the workflow's parse_node jobs: the NCCL log of each of
    its processes, then its kernel trace; a log host without one gets the workflow's empty 'no
    export' tables, so its calls are aligned as 'no_export'. Flight Recorder dumps found beside
    the logs are staged for the ops stage (which names process groups from them)."""
    from nccltrace.acquisition.status import ANALYZE_REMEDY
    from nccltrace.stages.parse_node import run_parse_node
    from nccltrace.stages.sources import logless_gaps, run_parse_sources_node

    layout, inputs = run.layout, run.inputs
    with _bar(len(run.procs) + len(run.nodes), "parse NCCL logs and nsys exports", "file", progress) as bar:
        for host in run.nodes:
            logless = [run.logless[p] for p in run.procs_of[host] if p in run.logless]
            if logless:  # the workflow's parse_node of a node without logs (stages.sources)
                res = run_parse_sources_node(layout, host, logless, run.settings, remedy=ANALYZE_REMEDY,
                                             done=lambda _: bar.update(1))  # fmt: skip
            else:
                res = run_parse_node(layout, host, {p: inputs.logs[p] for p in run.procs_of[host]},
                                     run.sources.get(host), run.settings, unusable=run.assigned.unusable.get(host),
                                     remedy=ANALYZE_REMEDY, done=lambda _: bar.update(1))  # fmt: skip
            _say(res, run.problems, run.notes)
    if run.logless:  # what the sources do not record, once for the run
        gaps = logless_gaps(layout, run.logless)
        run.problems += [g for g in gaps if g not in run.problems]
        run.source_problems += gaps
    shutil.rmtree(layout.staged_flight_recorder, ignore_errors=True)
    if inputs.dumps and not run.logless:  # (a log-less run's dumps are its processes' call records)
        layout.staged_flight_recorder.mkdir(parents=True)
        for i, dump in enumerate(inputs.dumps):
            shutil.copyfile(dump, layout.staged_flight_recorder / f"{i:05d}_{dump.name}")


def _communicators_and_summary(run: _Analysis) -> str:
    """Stage 3, the communicators (exact, from init/split lines), whose world size completes the
    settings; then the parse summary. Returns the run id."""
    from nccltrace.acquisition.status import ANALYZE_REMEDY
    from nccltrace.communicators.labels import ParallelSizes
    from nccltrace.stages.communicators import run_communicators
    from nccltrace.stages.parse_summary import run_parse_summary

    comm = run_communicators(run.layout, run.procs, run.settings, run.nodes)
    tables = comm.details["tables"]
    if len(tables.communicators) == 0 and not run.inputs.logs:
        run.problems.append(("no communicator: the sources present record no process group or communicator id "
                             "(nsys exports without payloads), so calls have no communicator, ranks or labels. To "
                             "get them, add the run's profiler traces or Flight Recorder dumps, keep the exports' NCCL "
                             "payloads (NCCL >= 2.26 names the communicator there; see the export's note), or log "
                             "with NCCL_DEBUG=INFO") if run.procs else
                            "no NCCL call or kernel in any source's window: the tables are empty")  # fmt: skip
    elif len(tables.communicators) == 0:
        raise ValueError(f"no communicator init or call lines in the NCCL logs of {run.inputs.raw_dir}: the "
                         f"analysis needs them to relate processes; {_LOG_HINT}")
    # (its notes list every incomplete communicator: the problems say it in one line each)
    run.problems += [p for p in comm.problems if p not in run.problems]
    if not tables.unranked:  # how the ranks were named where no world communicator did (else a problem)
        run.notes += [n for n in tables.rank_notes if n not in run.notes]
    run.settings = settings = _check_sizes(run.settings, tables.world_size, run.source)
    expected_procs = _int_or_none(tables.world_size)
    expected_nodes = None
    if settings is not None and (settings.declares_sizes or expected_procs is not None):
        expected_procs = ParallelSizes.from_settings(settings).world_size
        expected_nodes = settings.nodes
    run_id = (settings.run_id if settings is not None else None) or Path(run.inputs.raw_dir).resolve().name
    summary = run_parse_summary(run.layout, run.procs, run.hosts, run_id=run_id, expected_processes=expected_procs,
                                expected_nodes=expected_nodes, settings=settings, warnings=run.assigned.warnings,
                                input_problems=[*run.inputs.problems, *run.source_problems],
                                remedy=ANALYZE_REMEDY)  # fmt: skip
    _say(summary, run.problems, run.notes)
    return run_id


def _align(run: _Analysis, mode: str, steps: tuple[int, int] | None, progress: bool) -> None:
    """Stage 4, the alignment, one node at a time (as the workflow's align_node jobs), one process
    after another."""
    from nccltrace.stages.align_node import run_align_node

    if mode == "exact":
        _require_payloads(run.layout, [h for h in run.hosts if h in run.log_hosts])
    with _bar(len(run.procs), f"align ({mode})", "proc", progress) as bar:
        for host in run.log_hosts:
            logged = [p for p in run.procs_of[host] if p not in run.logless]  # (log-less: aligned by their records)
            if logged:
                _say(run_align_node(run.layout, host, logged, mode=mode, capture_steps=steps,
                                    done=lambda _: bar.update(1)), run.problems, run.notes)  # fmt: skip


def _ops_to(run: _Analysis, run_id: str, until: str, trace_options: Mapping[str, Any] | None,
            progress: bool) -> tuple[Any, list[Path], dict[str, str]]:
    """Stage 5, the run's enriched ops (labels, instances, clock sync), then metrics through
    ``until``. Returns the ops result, the ops stage's outputs and each later stage's output."""
    from nccltrace.stages.metrics import run_metrics
    from nccltrace.stages.ops import run_ops
    from nccltrace.stages.report import run_report
    from nccltrace.stages.trace import run_trace
    from nccltrace.stages.volume import run_volume

    layout, procs, hosts, run_yaml = run.layout, run.procs, run.hosts, run.inputs.run_yaml
    ops = run_ops(layout, procs, hosts, run.settings)
    _say(ops, run.problems, run.notes)
    stage_outputs: dict[str, str] = {}
    downstream = STAGES[1:STAGES.index(until) + 1]
    stage_runs = {
        "metrics": lambda: run_metrics(layout, [layout.parsed_nccl(p) for p in procs]),
        "volume": lambda: run_volume(layout, run_id, run.settings, run_yaml=run_yaml),
        "trace": lambda: run_trace(layout, trace_options, procs, hosts),
        "report": lambda: run_report(layout, run_id, procs, hosts, run_yaml=run_yaml),
    }
    with _bar(len(downstream), "metrics to report", "stage", progress) as bar:
        for stage in downstream:
            res = stage_runs[stage]()
            stage_outputs[stage] = str(layout.report_html if stage == "report" else res.outputs[0]) if res.outputs else ""
            if stage != "report":  # the report repeats its inputs' reasons
                _say(res, run.problems, run.notes)
            bar.update(1)
    return ops.details["run_ops"], ops.outputs, stage_outputs


def _empty_run(run: _Analysis, mode: str) -> dict[str, Any]:
    """A run whose sources hold no NCCL call or kernel: an empty ops table (its documented
    columns) and the manifest, saying why; not an error."""
    from nccltrace.core.provenance import write_manifest
    from nccltrace.core.tables import write_table_atomic
    from nccltrace.ops.build import OPS_SCHEMA

    layout = run.layout
    layout.ops.parent.mkdir(parents=True, exist_ok=True)
    write_table_atomic(OPS_SCHEMA.empty_table(), layout.ops)
    why = "no NCCL call or kernel in any source's window (no NCCL API range, kernel, call record or dump entry): " \
          "the tables are empty"
    run.notes.append(why)
    inputs = run.inputs
    raw_files = [*inputs.exports.values(), *inputs.traces, *inputs.dumps]
    write_manifest(layout.root / "manifest.json", stage="analyze", inputs=raw_files, outputs=[layout.ops],
                   partial=False, reasons=[], extra={"summary": {"processes": 0, "calls": 0, "notes": run.notes}})
    return {"raw_dir": str(inputs.raw_dir), "out_dir": str(layout.root), "mode": mode, "processes": 0, "hosts": [],
            "exports": {}, "hosts_without_export": [], "ignored_logs": [], "calls": 0, "matched": 0,
            "unmatched_by_reason": {}, "partial": False, "problems": run.problems, "notes": run.notes,
            "settings": None, "label_source": [], "outputs": {"ops": str(layout.ops)}}  # fmt: skip


def _finish(run: _Analysis, mode: str, result: Any, ops_outputs: list[Path],
            stage_outputs: dict[str, str]) -> dict[str, Any]:
    """The analysis's summary, also recorded in ``manifest.json`` of stage ``analyze``."""
    from nccltrace.core.provenance import write_manifest

    layout, inputs, problems = run.layout, run.inputs, run.problems
    partial = bool(problems)
    recorded = run.settings.to_mapping() if run.settings is not None else None
    out_summary: dict[str, Any] = {
        "raw_dir": str(inputs.raw_dir), "out_dir": str(layout.root), "mode": mode,
        "processes": len(run.procs), "hosts": run.log_hosts,
        "exports": {h: (p.name if isinstance(p, Path) else [Path(x).name for x in p])
                    for h, p in sorted(run.sources.items())},
        "hosts_without_export": run.no_export, "ignored_logs": [str(p) for p in inputs.ignored_logs],
        "calls": result.calls, "matched": result.matched, "unmatched_by_reason": result.unmatched_by_reason,
        "partial": partial, "problems": problems, "notes": run.notes, "settings": recorded,
        "label_source": sorted(set(result.labels["label_source"].astype(str))) if len(result.labels) else [],
        "outputs": {"ops": str(layout.ops), "parallelism": str(layout.labels), "clock_sync": str(layout.clock),
                    "alignment_quality": str(layout.quality), "communicators": str(layout.communicators),
                    "parse_summary": str(layout.parse_summary), **stage_outputs},
    }  # fmt: skip
    raw_files = [*inputs.logs.values(), *inputs.exports.values(), *inputs.traces, *inputs.dumps,
                 *([inputs.run_yaml] if inputs.run_yaml else [])]
    write_manifest(layout.root / "manifest.json", stage="analyze", inputs=raw_files,
                   outputs=ops_outputs + [layout.parse_summary], config=recorded, partial=partial, reasons=problems,
                   extra={"summary": {k: v for k, v in out_summary.items() if k not in ("settings", "outputs")}})
    return out_summary


def _kernel_sources(inputs: RawInputs, assigned: Any, procs: list[str], out: Path, progress: bool,
                    problems: list[str], notes: list[str]) -> dict[str, Path | list[Path]]:
    """Each node's kernel sources: its nsys export(s) (one per node, or one per process) and the
    profiler traces of its processes (read once into ``out/inputs/kernels/``). A single export
    is passed as is (the workflow's parse); several sources are merged by the parse stage."""
    from nccltrace.acquisition.status import CAPTURE_HINT
    from nccltrace.core.layout import process_key
    from nccltrace.inputs.kernel_sources import (
        stage_traces,
        traces_of_hosts,
    )

    sources: dict[str, list[Path]] = {h: [p, *assigned.more.get(h, [])] for h, p in assigned.exports.items()}
    if inputs.traces:
        with _bar(len(inputs.traces), "read profiler traces", "file", progress) as bar:
            staged = stage_traces(inputs.traces, out / "inputs" / "kernels", progress=lambda _: bar.update(1))
        for t in staged:
            if t.problem:
                problems.append(f"profiler trace {t.path.name} not used: {t.problem}")
        by_host, unplaced = traces_of_hosts(staged, {p: process_key(p) for p in procs})
        problems += unplaced
        for host, traces in by_host.items():
            sources.setdefault(host, []).extend(t.tables for t in traces if t.tables is not None)
        used = sum(len(v) for v in by_host.values())
        notes.append(f"kernel times from {used} PyTorch-profiler trace(s)"
                     + (f" and {len(assigned.exports)} nsys export node(s)" if assigned.exports else ""))
    if not sources:
        problems.append(f"no kernel trace: the NCCL logs alone were analysed (calls, communicators, labels, volumes); "
                        f"no kernel times, bandwidths or timelines. To get them, {CAPTURE_HINT}")
    return {h: (v[0] if len(v) == 1 and not v[0].is_dir() else v) for h, v in sources.items()}


def _require_payloads(layout: Any, hosts: list[str]) -> None:
    """Exact mode needs NCCL NVTX payloads in every export used; say which one lacks them."""
    from nccltrace.align.exact import has_nccl_payloads
    from nccltrace.core.tables import read_table

    lacking = [h for h in hosts if not has_nccl_payloads(read_table(layout.parsed_nsys_table(h, "nvtx")))]
    if lacking:
        raise ValueError(
            f"exact mode: the export(s) of {', '.join(lacking)} carry no NCCL NVTX payloads (needs NCCL >= 2.16.2 "
            "and `nsys export --type sqlite` with payloads kept, e.g. --include-blobs=true); use --mode default")
