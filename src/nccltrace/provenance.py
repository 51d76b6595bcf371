"""Provenance manifests: which inputs, config and code version made a derived artifact.

Every stage writes ``manifest.json`` next to its outputs with the code version (package
version, git commit if available, and a hash of the package sources, so a changed
analysis module is visible even without git), tool versions, the config hash, the table
schema version and SHA-256 checksums of every input and output file.

Partial results propagate: a result computed from a partial input is partial. When an input's
stage manifest (the ``manifest.json`` beside the input file, or inside an input directory) says
``partial``, the new manifest is partial too, names those manifests (``partial_inputs``) and
carries their reasons (``partial_reasons``), so the last stage of a run still says what is
missing and where, whichever stage found it.
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

from . import __version__
from .tables import SCHEMA_VERSION, write_json_atomic

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
    pkg = Path(__file__).resolve().parent
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


# What each workflow stage runs: the package modules its rule scripts import (entry points) and
# the data files it reads. Snakemake does not see modules imported by rule scripts, so rules carry
# a hash of the entry points' import closure as a param: a change to any module a stage can
# execute re-runs exactly the dependent rules, and a module added to the closure later is
# covered without editing this table. (This module itself is left out: it only writes manifests.)
# The rule scripts' own imports beside their stage (workflow/scripts/_bootstrap.py: errors, for
# every rule; align_node.py: capture) count too; tests/test_code_stamps.py checks that every package
# module a rule script imports is in its stage's closure.
_RULE_SCRIPT_IMPORTS: dict[str, tuple[str, ...]] = {"align_node": ("capture.py",)}
STAGE_ENTRIES: dict[str, tuple[str, ...]] = {
    "emulate": ("emulator/run.py",),
    # the workflow's rules (parse_node and align_node import the per-process stages they run)
    **{stage: (f"stages/{stage}.py", "errors.py", *_RULE_SCRIPT_IMPORTS.get(stage, ())) for stage in (
        "parse_node", "parse_summary", "communicators", "align_node", "ops", "metrics", "volume", "trace", "report",
        "campaign_report")},
}
STAGE_DATA: dict[str, tuple[str, ...]] = {"emulate": ("nsys/ddl",), "report": ("templates",),
                                          "campaign_report": ("templates",)}
_EXCLUDED = {"provenance.py"}


def _imports(path: Path, mtime_ns: int) -> tuple[tuple[int, str | None, tuple[str, ...]], ...]:
    """Every import statement of a module as (level, module, names): ``import a.b`` is
    (0, "a.b", ()), ``from ..x import y`` (2, "x", ("y",))."""
    return _module_facts(path, mtime_ns)[0]


@functools.lru_cache(maxsize=1024)
def _module_facts(path: Path, mtime_ns: int) -> tuple[tuple, bytes]:
    """A source file's imports (Python) and what it contributes to a stage's code hash (see
    :func:`stage_code_hash`), from one parse; cached per file version, since the workflow
    computes every stage's closure and hash each time it is read."""
    import ast

    data = path.read_bytes()
    if path.suffix != ".py":
        return (), hashlib.sha256(data).digest()
    tree = ast.parse(data, filename=str(path))
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imports.append((node.level, node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Import):
            imports += [(0, a.name, ()) for a in node.names]
    return tuple(imports), hashlib.sha256(ast.dump(tree).encode()).digest()


def _import_graph(entries: tuple[str, ...]) -> dict[Path, tuple[Path | None, str]]:
    """Every package file reachable from ``entries`` (see :func:`import_closure`): file -> (the
    file that first pulls it in, breadth first, and how: the import statement, or "package" for
    the ``__init__.py`` of a package a file is in); ``(None, "entry")`` for the entries."""
    from collections import deque

    pkg = Path(__file__).resolve().parent
    name = pkg.name

    def resolve(dotted: list[str]) -> list[Path]:
        base = pkg.joinpath(*dotted) if dotted else pkg
        if base.with_suffix(".py").is_file():
            return [base.with_suffix(".py")]
        if (base / "__init__.py").is_file():
            return [base / "__init__.py"]
        return []

    seen: dict[Path, tuple[Path | None, str]] = {}
    todo: deque[Path] = deque()

    def reach(f: Path, via: Path | None, how: str) -> None:
        if f not in seen and f.is_file():
            seen[f] = (via, how)
            todo.append(f)

    for e in entries:
        reach(pkg / e, None, "entry")
    while todo:
        f = todo.popleft()
        rel = f.relative_to(pkg).with_suffix("").parts
        here = list(rel[:-1])  # the package a relative import starts from (a package's own for __init__)
        for parent in range(1, len(here) + 1):  # packages on the way
            for g in resolve(here[:parent]):
                reach(g, f, "package")
        for level, module, names in _imports(f, f.stat().st_mtime_ns):
            if level:
                up = here[: len(here) - (level - 1)] if level > 1 else here
                mod = up + (module.split(".") if module else [])
            elif module is not None and module.split(".")[0] == name:
                mod = module.split(".")[1:]
            else:
                continue
            if names:
                stmt = f"from {'.' * level}{module or ''} import {', '.join(names)}"
            else:
                stmt = f"import {module}"
            for g in resolve(mod):
                reach(g, f, stmt)
            for alias in names:  # `from . import x` may name a submodule
                for g in resolve([*mod, alias]):
                    reach(g, f, stmt)
    return seen


def import_closure(entries: tuple[str, ...]) -> list[str]:
    """Package modules (paths relative to the package) reachable from ``entries`` through
    ``import`` statements anywhere in a module (function-level imports included: a stage may
    run them), plus the ``__init__.py`` of every package on the way. Static, so the result
    does not depend on what happens to be imported already."""
    pkg = Path(__file__).resolve().parent
    return sorted(str(p.relative_to(pkg)) for p in _import_graph(entries)
                  if p.name not in _EXCLUDED or p.parent != pkg)


def import_chain(entries: tuple[str, ...], module: str) -> list[tuple[str, str]]:
    """How ``module`` (a path relative to the package) comes into the import closure of
    ``entries``: the shortest chain of files from an entry point to it, each with how the one
    before pulls it in, ``[(entry, "entry"), (file, "from .x import y"), ..., (module, how)]``
    ("package": the ``__init__.py`` of a package the previous file is in); empty when it is not
    in the closure. What the stage's code hash covers is the whole closure, function-level
    imports included: a module on such a chain is hashed whether or not the stage calls it."""
    pkg = Path(__file__).resolve().parent
    graph = _import_graph(entries)
    f: Path | None = pkg / module
    if f not in graph or (f.name in _EXCLUDED and f.parent == pkg):
        return []
    chain = []
    while f is not None:
        via, how = graph[f]
        chain.append((str(f.relative_to(pkg)), how))
        f = via
    return chain[::-1]


def stage_code_hash(stage: str) -> str:
    """SHA-256 (16 hex digits) of the package sources a workflow stage can execute (the import
    closure of its entry points) and the data files it reads (templates, DDL).

    Python modules count by what they do: their syntax tree (``ast.dump``), so a comment, blank
    lines or reformatting leave the hash, and the stage's results, alone; any change to code,
    a literal or a docstring changes it. Data files count byte for byte (a template's
    whitespace is its output)."""
    pkg = Path(__file__).resolve().parent
    h = hashlib.sha256()
    files = [pkg / m for m in import_closure(STAGE_ENTRIES[stage])]
    for entry in STAGE_DATA.get(stage, ()):
        files += sorted(q for q in (pkg / entry).rglob("*") if q.is_file() and q.suffix in (".py", ".sql", ".j2"))
    for f in files:
        h.update(str(f.relative_to(pkg)).encode())
        h.update(_module_facts(f, f.stat().st_mtime_ns)[1])
    return h.hexdigest()[:16]


def code_stamp_path(directory: Path | str, stage: str) -> Path:
    """Where the workflow keeps the code stamp of ``stage``: a file holding the stage's code hash
    (:func:`stage_code_hash`) as of the last run that started the stage's jobs."""
    return Path(directory) / f"{stage}.stamp"


def code_stamp_is_current(path: Path | str, code: str) -> bool:
    """True when the stamp at ``path`` holds ``code``; False when it holds another hash, is
    missing or unreadable. Reads only: the workflow decides from this, as its graph is built,
    whether the stamp's job (which writes it) must run (see ``code_stamp`` in
    workflow/rules/common.smk), so that reading the workflow changes no file."""
    try:
        return Path(path).read_text(encoding="utf-8").strip() == code
    except (OSError, UnicodeDecodeError):
        return False


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
    if p.name == "manifest.json":
        return p
    return p / "manifest.json" if p.is_dir() else p.parent / "manifest.json"


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
