"""Provenance manifests: which inputs, config and code version made a derived artifact.

Every stage writes ``manifest.json`` next to its outputs, so any result can say what made it (code
version and source hash, tool versions, config hash, schema version, checksums of every input and
output) and whether it is complete: a result computed from a partial input is partial, and its
manifest names those inputs and carries their reasons, so the last stage of a run still says
what is missing and where. Fields: ``docs/architecture.md``, Module notes.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nccltrace import __version__
from nccltrace.core.layout import MANIFEST_FILE
from nccltrace.core.tables import SCHEMA_VERSION, write_json_atomic

_TOOLS = ("numpy", "pandas", "pyarrow", "numba", "msgspec", "snakemake", "jinja2", "pyyaml")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """SHA-256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _expand(paths: Iterable[Path | str]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out.extend(sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith(".")))
        elif p.exists():
            out.append(p)
    return out


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """Package version, source hash and (when run from a git checkout) the commit."""
    pkg = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*")):
        if f.is_file() and f.suffix in (".py", ".sql", ".yaml", ".json", ".j2"):
            h.update(str(f.relative_to(pkg)).encode())
            h.update(f.read_bytes())
    info: dict[str, Any] = {"nccltrace": __version__, "source_sha256": h.hexdigest()}
    try:
        commit = subprocess.run(["git", "-C", str(pkg), "rev-parse", "HEAD"], check=False, capture_output=True,
                                text=True, timeout=5)
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
            dirty = subprocess.run(["git", "-C", str(pkg), "status", "--porcelain", "--", str(pkg)],
                                   check=False, capture_output=True, text=True, timeout=5)
            info["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info




def tool_versions() -> dict[str, str]:
    """Versions of the libraries the analysis depends on."""
    out = {"python": platform.python_version()}
    for name in _TOOLS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def config_hash(config: Any) -> str:
    """Stable hash of a JSON-serialisable config."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


MAX_REASONS = 20


def _input_manifest(p: Path) -> Path:
    """The stage manifest describing an input: the input itself, the manifest inside an input
    directory, or the manifest beside an input file."""
    if p.name == MANIFEST_FILE:
        return p
    return p / MANIFEST_FILE if p.is_dir() else p.parent / MANIFEST_FILE


def manifest_reasons(manifest: dict[str, Any], where: str) -> list[str]:
    """Why a manifest is partial: its ``partial_reasons``, else its ``problems``, else a generic line."""
    reasons = [str(r) for r in manifest.get("partial_reasons") or []]
    reasons = reasons or [str(r) for r in manifest.get("problems") or []]
    return reasons or [f"stage {manifest.get('stage', '?')} ({where}) marked its results partial"]


def upstream_partial(inputs: Iterable[Path | str], own: Path | str | None = None) -> dict[str, list[str]]:
    """Stage manifests of ``inputs`` that are partial: manifest path -> its reasons. ``own`` (the
    manifest being written) is skipped."""
    own_path = Path(own).resolve() if own is not None else None
    out: dict[str, list[str]] = {}
    for p in map(Path, inputs):
        m = _input_manifest(p)
        key = str(m)
        if key in out or not m.is_file() or (own_path is not None and m.resolve() == own_path):
            continue
        try:
            data = json.loads(m.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("partial"):
            out[key] = manifest_reasons(data, str(m.parent))
    return out


def _dedup(items: Iterable[str], limit: int = MAX_REASONS) -> list[str]:
    seen = list(dict.fromkeys(items))
    return seen if len(seen) <= limit else [*seen[:limit], f"... and {len(seen) - limit} more"]


def write_manifest(
    path: Path | str,
    *,
    stage: str,
    inputs: Iterable[Path | str],
    outputs: Iterable[Path | str],
    config: Any = None,
    partial: bool = False,
    reasons: Iterable[str] = (),
    propagate: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write a provenance manifest (atomically) and return it.

    ``partial`` with ``reasons`` (what is missing and what to do; ``extra['problems']`` count as
    reasons when none are given) marks this stage's own gaps. With ``propagate`` the manifest is
    also partial when an input's stage manifest is (see the module docstring)."""
    path = Path(path)
    base = path.parent
    inputs = list(inputs)

    def rel(p: Path) -> str:
        try:
            return str(p.resolve().relative_to(base.resolve()))
        except ValueError:
            return str(p)

    own = [str(r) for r in reasons] or [str(p) for p in (extra or {}).get("problems") or []]
    upstream = upstream_partial(inputs, path) if propagate else {}
    if partial and not own and not upstream:
        own = [f"stage {stage} marked its results partial"]  # no cause known: say at least where
    manifest = {
        "stage": stage,
        "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "code": code_version(),
        "tools": tool_versions(),
        "table_schema_version": SCHEMA_VERSION,
        "config_hash": config_hash(config) if config is not None else None,
        "config": config,
        "partial": bool(partial or upstream),
        # causes found upstream first: the root cause of a gap leads the list
        "partial_reasons": _dedup([*(r for rs in upstream.values() for r in rs), *(own if partial else [])]),
        "partial_inputs": sorted(os.path.relpath(Path(m).resolve(), base.resolve()) for m in upstream),
        "inputs": {rel(p): file_sha256(p) for p in _expand(inputs)},
        "outputs": {rel(p): file_sha256(p) for p in _expand(outputs) if p.resolve() != path.resolve()},
    }
    if extra:
        manifest.update(extra)
    write_json_atomic(path, manifest)
    return manifest
