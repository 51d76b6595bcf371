"""A run's immutable ``raw/`` directory, the same for every backend.

Every backend (emulator, SLURM capture, import of files made elsewhere) leaves the same tree, so
the analysis stages read one layout. :func:`assemble_raw` builds it from a SLURM capture and its
exports, :func:`import_raw` from a directory of logs and exports made elsewhere. Files are
hard-linked where possible (a raw tree costs no extra disk next to its capture) and the
directory is built under a ``.partial`` name and renamed when complete. The layout:
``docs/architecture.md``, Module notes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nccltrace import __version__
from nccltrace.acquisition.status import CAPTURE_HINT, write_status
from nccltrace.core.layout import RUN_YAML_FILE


class RawImportError(ValueError):
    """A directory that cannot be imported; the message names the file and what to do."""


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (copy across file systems)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_run_yaml(raw: Path, run_id: str, settings: Mapping[str, Any], generator: str) -> None:
    cfg = {k: v for k, v in settings.items() if k not in ("backend", "import_dir", "env", "imperfections")}
    cfg.setdefault("name", settings.get("model"))
    doc = {"nccltrace_version": __version__, "generator": generator, "run_id": run_id, "config": cfg}
    (raw / RUN_YAML_FILE).write_text(yaml.safe_dump(doc, sort_keys=False))


def _fresh(raw: Path) -> Path:
    partial = raw.with_name(raw.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _finish(partial: Path, raw: Path) -> None:
    shutil.rmtree(raw, ignore_errors=True)
    os.replace(partial, raw)


def assemble_raw(capture: Path | str, exports: list[Path | str], raw: Path | str, *, run_id: str,
                 settings: Mapping[str, Any]) -> dict[str, Any]:
    """Build ``raw`` from a training capture (``nccltrace.acquisition.launch``) and the nsys
    SQLite exports of its reports. A failed capture gives a raw directory with its launch record
    and ``status: failed``, so the campaign can say why the run is missing."""
    capture, raw = Path(capture), Path(raw)
    partial = _fresh(raw)
    launch = json.loads((capture / "launch" / "launch.json").read_text())
    for sub in ("launch", "nccl", "nsys"):
        for p in sorted((capture / sub).glob("*")) if (capture / sub).is_dir() else []:
            if p.is_file():
                link_or_copy(p, partial / sub / p.name)
    for e in map(Path, exports):
        link_or_copy(e, partial / "nsys" / e.name)
    write_run_yaml(partial, run_id, settings, "nccltrace slurm launch (Megatron-LM)")
    write_status(partial, launch.get("status", "ok"), launch.get("reason"), attempt=launch.get("attempt"),
                 slurm_job_id=launch.get("slurm_job_id"))  # fmt: skip
    _finish(partial, raw)
    return launch


# Files an interrupted export or copy leaves next to (or instead of) <host>.sqlite.
_LEFTOVER = re.compile(r"\.sqlite(?:-journal|-wal|-shm|\.tmp|\.part|\.partial|\.incomplete|~)$"
                       r"|\.sqlite\.[A-Za-z0-9]{6,}$")  # the last: temp names of copy tools (rsync, tempfile)


def _inspect_export(path: Path) -> tuple[str | None, str | None]:
    """(host the export was captured on or None, why it is unusable or None). A leftover
    ``-journal``/``-wal`` beside it means it was being written when the writer stopped."""
    from nccltrace.nsys.reader import NsysExport, NsysFormatError

    for side in ("-journal", "-wal"):
        leftover = path.with_name(path.name + side)
        if leftover.is_file() and leftover.stat().st_size > 0:
            return None, (f"{path}: a leftover {leftover.name} beside it shows the export (or its copy) was "
                          "interrupted while writing, so its content may be incomplete; re-run `nsys export "
                          "--type sqlite --force-overwrite` on the node's report")
    try:
        with NsysExport.open(path) as export:
            return export.hostname or None, None
    except NsysFormatError as e:
        return None, str(e)


def export_pids(path: Path) -> set[int]:
    """OS pids of the processes that launched kernels (or made CUDA calls) in an export: what
    tells one export per process from the same capture twice."""
    import sqlite3

    from nccltrace.nsys.reader import NsysExport, NsysFormatError

    try:
        with NsysExport.open(path) as export:
            tables = export.table_names()
    except NsysFormatError:
        return set()
    db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    try:
        for table, col in (("CUPTI_ACTIVITY_KIND_KERNEL", "globalPid"), ("CUPTI_ACTIVITY_KIND_RUNTIME", "globalTid")):
            if table in tables:
                rows = db.execute(f"SELECT DISTINCT ({col} >> 24) & 16777215 FROM {table}").fetchall()
                if rows:
                    return {int(r[0]) for r in rows if r[0] is not None}
        return set()
    except sqlite3.DatabaseError:
        return set()
    finally:
        db.close()


def _owner(stem: str, hosts: set[str]) -> str | None:
    """The log host an unreadable export belongs to by its name: <host>.sqlite or <host><sep>...sqlite."""
    if stem in hosts:
        return stem
    prefixed = [h for h in hosts if re.match(re.escape(h) + r"[^A-Za-z0-9]", stem)]
    return max(prefixed, key=len) if prefixed else None


def record_failed_import(raw: Path | str, *, run_id: str, settings: Mapping[str, Any], reason: str) -> None:
    """A raw directory for a run whose import failed: ``status: failed`` with the reason (the
    campaign report lists the run with it) and the run's settings; no logs, no exports."""
    raw = Path(raw)
    partial = _fresh(raw)
    write_run_yaml(partial, run_id, settings, "nccltrace import (failed)")
    (partial / "launch").mkdir(exist_ok=True)
    record = {"run": run_id, "backend": "import", "source": str(settings.get("import_dir")), "status": "failed",
              "reason": reason}  # fmt: skip
    (partial / "launch" / "import.json").write_text(json.dumps(record, indent=2))
    write_status(partial, "failed", reason, stage="import")
    _finish(partial, raw)


@dataclass
class ExportAssignment:
    """Which export is which node's: ``exports`` node name -> export (the recorded hostname, else
    the file's stem), ``unusable`` node -> why its (kept) export cannot be read, what was set aside."""

    exports: dict[str, Path]
    unusable: dict[str, str]
    ignored: list[str]
    warnings: list[str]
    more: dict[str, list[Path]] = field(default_factory=dict)  # further readable exports of a node (per process)


def assign_exports(sqlites: list[Path], log_hosts: set[str], source: Path | None = None) -> ExportAssignment:
    """Name each export after the host it was captured on (recorded in the export), else its
    file stem. An unreadable export is kept for the node its name points to (the parse stage
    reports the defect and the run is partial) unless a readable export of that node exists:
    then it is a leftover, set aside. Further readable exports of one host (one per process) are
    listed in ``more``."""
    names: dict[str, Path] = {}
    more: dict[str, list[Path]] = {}
    unreadable: list[tuple[Path, str]] = []
    ignored: list[str] = []
    warnings: list[str] = []
    for p in sqlites:
        host, problem = _inspect_export(p)
        if problem is not None:
            unreadable.append((p, problem))
            continue
        host = host or p.stem
        if host not in log_hosts and host.split(".")[0] in log_hosts:
            host = host.split(".")[0]  # logs name the short hostname (gethostname), nsys the full one
        if host in names:
            # one export per process (`nsys profile -o trace_%q{SLURM_PROCID}`): all of them serve the
            # node, each recording other processes; two recording one process are the same capture twice
            mine = export_pids(p)
            for other in [names[host], *more.get(host, [])]:
                shared = mine & export_pids(other)
                if shared:
                    raise RawImportError(
                        f"{p} and {other} are both exports of host {host} and record the same process(es) "
                        f"({', '.join(map(str, sorted(shared)[:5]))}): the same capture twice? Keep one export per "
                        "node, or one per process")
            more.setdefault(host, []).append(p)
            continue
        names[host] = p
    readable = set(names)
    unusable: dict[str, str] = {}
    for p, problem in unreadable:
        owner = _owner(p.stem, log_hosts)
        if owner is None or owner in names:
            why = ("its name matches no host of the NCCL logs" if owner is None
                   else f"node {owner} has the readable export {names[owner].name}" if owner in readable
                   else f"{names[owner].name} is already taken for node {owner}")
            ignored.append(str(p.relative_to(source)) if source is not None and p.is_relative_to(source) else str(p))
            warnings.append(f"ignored unreadable export {p.name} ({why}): {problem}")
            continue
        if owner != p.stem:
            warnings.append(f"{p.name} is unreadable and named after node {owner}; taken as {owner}'s export")
        names[owner] = p
        unusable[owner] = problem
    return ExportAssignment(names, unusable, ignored, warnings, more)


SOURCE_KINDS: dict[str, str] = {
    "nccl-log": "NCCL debug logs",
    "nsys-export": "nsys exports",
    "profiler-trace": "PyTorch-profiler traces",
    "flight-recorder": "Flight Recorder dumps",
}
"""The evidence sources an import looks for (keys as ``import.json``'s ``sources`` lists them)."""
TRACES_DIR = "kineto"
"""Where an import puts a run's PyTorch-profiler traces in its raw directory (found by content there)."""
_LOOKED_FOR = (
    "no NCCL debug log found (a file whose lines contain 'host:pid:tid [dev] NCCL INFO'; run with NCCL_DEBUG=INFO "
    "and NCCL_DEBUG_FILE), no nsys export (*.sqlite) or report (*.nsys-rep; nsys profile --trace=cuda,nvtx), no "
    "PyTorch-profiler trace (a Chrome-trace JSON, .json or .json.gz, of torch.profiler with CPU and CUDA "
    "activities) and no Flight Recorder dump (a pickle PyTorch writes with TORCH_FR_BUFFER_SIZE set)"
)


def import_raw(source: Path | str, raw: Path | str, *, run_id: str, settings: Mapping[str, Any],
               nsys: str = "nsys") -> dict[str, Any]:  # fmt: skip
    """Bring a run made elsewhere into ``raw``: whichever of its evidence sources it left
    (:data:`SOURCE_KINDS`), each found by content: NCCL logs (any names; each is identified by
    the host:pid of its first NCCL line and renamed ``nccl_<host>_<pid>.log``), nsys exports
    (``*.sqlite``; reports ``*.nsys-rep`` without an export are exported here), PyTorch-profiler
    traces (into ``kineto/``), Flight Recorder dumps (into ``flight_recorder/``), and an optional
    ``run.yaml``. ``import.json`` and ``status.json`` list the sources found (``sources``, and
    ``source_counts`` per kind). Raises :class:`RawImportError` when the directory holds none of
    them, naming what was looked for and what was found, or when logs and exports disagree."""
    source, raw = Path(source), Path(raw)
    if not source.is_dir():
        raise RawImportError(f"import_dir {source}: no such directory (run {run_id}); point import_dir at the "
                             "directory holding the run's NCCL logs, nsys exports, profiler traces or Flight "
                             "Recorder dumps")  # fmt: skip
    files = sorted(p for p in source.rglob("*") if p.is_file())
    partial = _fresh(raw)
    warnings: list[str] = []
    traces = _import_traces(source, partial)
    dumps = _import_flight_recorder(source, partial, warnings)
    found, logs = _discover_import_logs(source, partial, exclude=[*traces, *dumps])
    ignored: list[str] = [str(q.relative_to(source)) for q in found.ignored if q.is_relative_to(source)]
    sqlites = [p for p in files if p.suffix == ".sqlite"]
    warnings[:0] = [f"import: {n}" for n in found.notes()]
    for p in files:
        if _LEFTOVER.search(p.name):
            ignored.append(str(p.relative_to(source)))
            warnings.append(f"import: ignored {p.relative_to(source)} (left over by an interrupted export or copy; "
                            "not an export)")  # fmt: skip
    reports = [p for p in files if p.suffix in (".nsys-rep", ".qdrep", ".qdstrm")]
    for (host, pid), p in sorted(logs.items()):
        if p.parent != partial / "nccl":  # logs split by discovery are written there already
            link_or_copy(p, partial / "nccl" / f"nccl_{host}_{pid}.log")
    for p in files:
        if p.suffix == ".xml":
            link_or_copy(p, partial / "nccl" / p.name)
    records = _import_reports(reports, partial, sqlites, nsys)
    hosts_logs = {h for h, _ in logs}
    assigned = assign_exports(sqlites, hosts_logs, source)
    names, unusable = assigned.exports, assigned.unusable
    ignored += assigned.ignored
    warnings += assigned.warnings
    counts = {"nccl-log": len(logs), "nsys-export": len(names) + sum(map(len, assigned.more.values())),
              "profiler-trace": len(traces), "flight-recorder": len(dumps)}  # fmt: skip
    if not any(counts.values()):
        raise RawImportError(_nothing_found(source, files, warnings))
    _place_exports(assigned, partial)
    if logs and names and not hosts_logs & set(names):
        raise RawImportError(f"import_dir {source}: the exports are of hosts {sorted(names)} but the NCCL logs of "
                             f"{sorted(hosts_logs)}; name each export <host>.sqlite after the host in the log "
                             "lines")  # fmt: skip
    warnings += _source_notes(counts)
    if (source / RUN_YAML_FILE).is_file():
        link_or_copy(source / RUN_YAML_FILE, partial / RUN_YAML_FILE)
    else:
        write_run_yaml(partial, run_id, settings, "nccltrace import")
    sources = [k for k in SOURCE_KINDS if counts[k]]
    record = {"run": run_id, "backend": "import", "source": str(source.resolve()), "processes": len(logs),
              "exports": sorted(names), "sources": sources, "source_counts": counts, "ignored": ignored,
              "exported_here": records, "warnings": warnings, "unusable_exports": unusable}  # fmt: skip
    (partial / "launch").mkdir(exist_ok=True)
    (partial / "launch" / "import.json").write_text(json.dumps(record, indent=2))
    # NCCL lines discovery could not give to a process: missing records, so the run is partial
    write_status(partial, "ok", warnings=warnings, problems=found.problems(), unusable_exports=unusable,
                 sources=sources, source_counts=counts)  # fmt: skip
    _finish(partial, raw)
    return record


def _nothing_found(source: Path, files: list[Path], warnings: list[str]) -> str:
    """The refusal of a directory with none of the sources: what was looked for, what was there."""
    names = [str(p.relative_to(source)) for p in files]
    seen = (f"{len(names)} file(s): {', '.join(names[:8])}" + (f" and {len(names) - 8} more" if len(names) > 8
            else "")) if names else "no file"  # fmt: skip
    aside = "; ".join(w.removeprefix("import: ") for w in warnings)
    aside = f"; set aside: {aside}" if aside else ""
    return f"import_dir {source}: none of the run's evidence sources found: {_LOOKED_FOR}; found {seen}{aside}"


def _source_notes(counts: Mapping[str, int]) -> list[str]:
    """What a run without logs, or without kernel traces, is imported with (warnings, not problems)."""
    have = ", ".join(f"{n} {SOURCE_KINDS[k]}" for k, n in counts.items() if n)
    if not counts["nccl-log"]:
        return [(f"import: no NCCL debug log found (NCCL_DEBUG=INFO and NCCL_DEBUG_FILE give one per process): "
                 f"imported with {have} only")]  # fmt: skip
    if not counts["nsys-export"] and not counts["profiler-trace"]:
        return [(f"import: no kernel trace (no nsys export, no PyTorch-profiler trace): imported with {have}, so "
                 f"the calls have no kernel times; to get them, {CAPTURE_HINT}")]  # fmt: skip
    return []


def _discover_import_logs(source: Path, partial: Path,
                          exclude: list[Path]) -> tuple[Any, dict[tuple[str, int], Path]]:  # fmt: skip
    """The NCCL logs of ``source`` by content, as ``nccltrace analyze`` finds them: any name, .gz,
    one per process or one combined stdout of all ranks (split per process into the raw
    directory), none of ``exclude`` (the traces and dumps found). Returns the discovery and its
    logs by (host, pid), none when the run left no log."""
    from nccltrace.inputs.logs import discover_logs

    try:
        found = discover_logs([source], partial / "nccl", exclude=exclude)
    except ValueError as e:
        raise RawImportError(f"import_dir {source}: {e}") from None
    logs = {}
    for stem, q in found.logs.items():
        host, _, pid = stem[len("nccl_"):].rpartition("_")
        logs[(host, int(pid))] = q
    return found, logs


def _import_traces(source: Path, partial: Path) -> list[Path]:
    """PyTorch-profiler traces (Chrome-trace JSON, any name, gzipped or not, found by content)
    into raw/kineto; a name taken twice gets its index in front. Returns the traces found."""
    from nccltrace.kineto.reader import iter_kineto_files

    traces = list(iter_kineto_files([source]))
    taken: set[str] = set()
    for i, p in enumerate(traces):
        name = p.name if p.name not in taken else f"{i:05d}_{p.name}"
        taken.add(name)
        link_or_copy(p, partial / TRACES_DIR / name)
    return traces


def _import_flight_recorder(
    source: Path, partial: Path, warnings: list[str]
) -> list[Path]:
    """Flight Recorder dumps (any name, found by content) into raw/flight_recorder: the ops stage
    names process groups from them. A file that does not read as a dump is a warning. Returns
    the dumps imported."""
    from nccltrace.pytorch.flight_recorder import (
        FlightRecorderError,
        pickle_files,
        read_dump,
    )

    dumps = []
    for i, p in enumerate(pickle_files(source)):
        try:
            read_dump(p)
        except FlightRecorderError as e:
            warnings.append(f"import: not used as a Flight Recorder dump: {e}")
            continue
        (partial / "flight_recorder").mkdir(exist_ok=True)
        link_or_copy(p, partial / "flight_recorder" / f"{i:05d}_{p.name}")
        dumps.append(p)
    return dumps


def _import_reports(reports: list[Path], partial: Path, sqlites: list[Path], nsys: str) -> list[dict]:
    """Copy the nsys reports; export each that has no export beside it (appended to
    ``sqlites``). Returns the export records."""
    exported = {p.stem for p in sqlites}
    records = []
    for rep in reports:
        link_or_copy(rep, partial / "nsys" / rep.name)
        if rep.stem not in exported:
            from nccltrace.acquisition.nsys_export import export_report

            out = partial / "nsys" / f"{rep.stem}.sqlite"
            records.append(export_report(rep, out, nsys=nsys).to_dict())
            sqlites.append(out)
            exported.add(rep.stem)
    return records


def _place_exports(assigned: ExportAssignment, partial: Path) -> None:
    """Each node's export as nsys/<host>.sqlite; a node with one export per process keeps them
    all, in nsys/<host>/ (RunLayout.raw_exports)."""
    for name, p in assigned.exports.items():
        extra = assigned.more.get(name, [])
        for i, src in enumerate([p, *extra]):
            dst = (partial / "nsys" / name / f"{i:03d}_{src.name}") if extra else (partial / "nsys" / f"{name}.sqlite")
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.parent != dst.parent or src.name != dst.name:
                if src.is_relative_to(partial):
                    os.replace(src, dst)
                else:
                    link_or_copy(src, dst)
