"""A run's immutable ``raw/`` directory, the same for every backend.

Layout (what the analysis stages read)::

    nccl/nccl_<host>_<pid>.log   NCCL debug log per process (+ topo_<host>.xml when dumped)
    nsys/<host>.sqlite           nsys SQLite export per node (+ <host>.nsys-rep for real runs)
    launch/                      the launch's own record (launch.json, node scripts and logs)
    run.yaml                     the run's settings (``config``) as launched
    status.json                  {"status": "ok" | "failed", "reason": ...}
    manifest.json                provenance

:func:`assemble_raw` builds it from a SLURM capture and its exports, :func:`import_raw` from a
directory of logs and exports made elsewhere. Files are hard-linked where possible (a raw tree
costs no extra disk next to the capture it came from) and the directory is built under a
``.partial`` name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .. import __version__

# The first record of an NCCL debug line: optional timestamp, then host:pid:tid [dev] NCCL
_NCCL_PREFIX = re.compile(r"^(?:\[[^\]]*\] |\d{9,11}\.\d+ )?([A-Za-z0-9_.\-]+):(\d+):\d+ \[-?\d+\] NCCL (?:INFO|WARN)")
_SCAN_LINES = 200


class RawImportError(ValueError):
    """A directory that cannot be imported; the message names the file and what to do."""


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (copy across file systems)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_status(raw: Path, status: str, reason: str | None = None, **extra: Any) -> None:
    (raw / "status.json").write_text(json.dumps({"status": status, "reason": reason, **extra}, indent=2))


def read_status(raw: Path | str) -> dict[str, Any]:
    """The acquisition status of a raw directory; runs made before status files existed are ok."""
    p = Path(raw) / "status.json"
    if not p.is_file():
        return {"status": "ok", "reason": None}
    return json.loads(p.read_text())


def write_run_yaml(raw: Path, run_id: str, settings: Mapping[str, Any], generator: str) -> None:
    cfg = {k: v for k, v in settings.items() if k not in ("backend", "import_dir", "env", "imperfections")}
    cfg.setdefault("name", settings.get("model"))
    doc = {"nccltrace_version": __version__, "generator": generator, "run_id": run_id, "config": cfg}
    (raw / "run.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


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


def _log_identity(path: Path) -> tuple[str, int] | None:
    """(host, pid) of the first NCCL record in the file's first lines, or None."""
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if i >= _SCAN_LINES:
                break
            m = _NCCL_PREFIX.match(line.decode("utf-8", "replace"))
            if m:
                return m.group(1), int(m.group(2))
    return None


def _export_host(path: Path) -> str | None:
    """The host an export was captured on (``TARGET_INFO_SYSTEM_ENV``), or None when the file
    does not say or cannot be read as an export (the parse stage reports what is wrong)."""
    from ..nsys.reader import NsysExport, NsysFormatError

    try:
        with NsysExport.open(path) as export:
            return export.hostname or None
    except NsysFormatError:
        return None


def import_raw(source: Path | str, raw: Path | str, *, run_id: str, settings: Mapping[str, Any],
               nsys: str = "nsys") -> dict[str, Any]:
    """Bring a run made elsewhere into ``raw``: NCCL logs (any names; each is identified by the
    host:pid of its first NCCL line and renamed ``nccl_<host>_<pid>.log``), nsys exports
    (``*.sqlite``; reports ``*.nsys-rep`` without an export are exported here) and an optional
    ``run.yaml``. Raises :class:`RawImportError` naming what is missing."""
    source, raw = Path(source), Path(raw)
    if not source.is_dir():
        raise RawImportError(f"import_dir {source}: no such directory (run {run_id}); point import_dir at the "
                           "directory holding the run's NCCL logs and nsys exports")
    files = sorted(p for p in source.rglob("*") if p.is_file())
    logs: dict[tuple[str, int], Path] = {}
    ignored: list[str] = []
    for p in files:
        if p.suffix != ".log" and not p.name.startswith("nccl"):
            continue
        ident = _log_identity(p)
        if ident is None:
            ignored.append(str(p.relative_to(source)))
            continue
        if ident in logs:
            raise RawImportError(f"{p} and {logs[ident]} are both the log of process {ident[0]}:{ident[1]}; "
                               "remove the duplicate (one NCCL_DEBUG_FILE per process)")
        logs[ident] = p
    if not logs:
        raise RawImportError(f"import_dir {source}: no NCCL debug log found (a file whose first lines contain "
                           "'host:pid:tid [dev] NCCL INFO'); was the run made with NCCL_DEBUG=INFO and NCCL_DEBUG_FILE?")
    sqlites = [p for p in files if p.suffix == ".sqlite"]
    reports = [p for p in files if p.suffix in (".nsys-rep", ".qdrep", ".qdstrm")]
    exported = {p.stem for p in sqlites}
    partial = _fresh(raw)
    for (host, pid), p in sorted(logs.items()):
        link_or_copy(p, partial / "nccl" / f"nccl_{host}_{pid}.log")
    for p in files:
        if p.suffix == ".xml":
            link_or_copy(p, partial / "nccl" / p.name)
    records = []
    for rep in reports:
        link_or_copy(rep, partial / "nsys" / rep.name)
        if rep.stem not in exported:
            from .nsys_export import export_report

            out = partial / "nsys" / f"{rep.stem}.sqlite"
            records.append(export_report(rep, out, nsys=nsys).to_dict())
            sqlites.append(out)
            exported.add(rep.stem)
    if not sqlites:
        raise RawImportError(f"import_dir {source}: no nsys export (*.sqlite) or report (*.nsys-rep) found; "
                           "profile with nsys profile --trace=cuda,nvtx and copy the reports")
    names: dict[str, Path] = {}
    for p in sqlites:
        host = _export_host(p) or p.stem
        name = host if host not in names else p.stem
        if name in names:
            raise RawImportError(f"{p} and {names[name]} are both exports of host {name}; keep one per node")
        names[name] = p
        dst = partial / "nsys" / f"{name}.sqlite"
        if p.parent != dst.parent or p.name != dst.name:
            if p.is_relative_to(partial):
                os.replace(p, dst)
            else:
                link_or_copy(p, dst)
    hosts_logs = {h for h, _ in logs}
    if not hosts_logs & set(names):
        raise RawImportError(f"import_dir {source}: the exports are of hosts {sorted(names)} but the NCCL logs of "
                           f"{sorted(hosts_logs)}; name each export <host>.sqlite after the host in the log lines")
    if (source / "run.yaml").is_file():
        link_or_copy(source / "run.yaml", partial / "run.yaml")
    else:
        write_run_yaml(partial, run_id, settings, "nccltrace import")
    record = {"run": run_id, "backend": "import", "source": str(source.resolve()), "processes": len(logs),
              "exports": sorted(names), "ignored": ignored, "exported_here": records}  # fmt: skip
    (partial / "launch").mkdir(exist_ok=True)
    (partial / "launch" / "import.json").write_text(json.dumps(record, indent=2))
    write_status(partial, "ok")
    _finish(partial, raw)
    return record
