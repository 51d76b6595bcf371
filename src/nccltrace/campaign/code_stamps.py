"""Code stamps: which package code each workflow stage can execute, and its hash.

The workflow's rules carry, per stage, a stamp file holding the hash of the stage's import
closure and data files (``workflow/rules/code_stamps.smk``): a change to a module re-runs exactly
the stages whose closure holds it.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent
"""The package's source directory: module paths here are relative to it."""

# What each workflow stage runs: the package modules its rule scripts import (entry points) and
# the data files it reads. Snakemake does not see modules imported by rule scripts, so rules carry
# a hash of the entry points' import closure as a param: a change to any module a stage can
# execute re-runs exactly the dependent rules, and a module added to the closure later is
# covered without editing this table. (``core/provenance.py`` is left out: it only writes manifests.)
# The rule scripts' own imports beside their stage (workflow/scripts/_bootstrap.py: errors, for
# every rule; align_node.py and parse_summary.py: the run settings, which their stages take only
# as annotations; parse_node.py, align_node.py and parse_summary.py: stages/sources.py, what they
# run for a run without NCCL logs) count too; tests/test_code_stamps.py checks that every package module a rule
# script imports is in its stage's closure.
_RULE_SCRIPT_IMPORTS: dict[str, tuple[str, ...]] = {"align_node": ("core/settings.py", "stages/sources.py"),
                                                    "parse_node": ("stages/sources.py",),
                                                    "parse_summary": ("core/settings.py", "stages/sources.py")}
STAGE_ENTRIES: dict[str, tuple[str, ...]] = {
    "emulate": ("emulator/run.py",),
    # the workflow's rules (parse_node and align_node import the per-process stages they run)
    **{stage: (f"stages/{stage}.py", "core/errors.py", *_RULE_SCRIPT_IMPORTS.get(stage, ())) for stage in (
        "sources", "parse_node", "parse_summary", "communicators", "align_node", "ops", "metrics", "volume", "trace",
        "report", "campaign_report")},
}
STAGE_DATA: dict[str, tuple[str, ...]] = {"emulate": ("nsys/ddl",), "report": ("outputs/templates",),
                                          "campaign_report": ("outputs/templates",)}
_EXCLUDED = {"core/provenance.py"}


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
    from collections import deque

    data = path.read_bytes()
    if path.suffix != ".py":
        return (), hashlib.sha256(data).digest()
    tree = ast.parse(data, filename=str(path))
    imports = []
    todo: deque[ast.AST] = deque([tree])  # breadth first, in the order of ast.walk
    while todo:
        node = todo.popleft()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)  # the body never runs: its imports serve annotations only
            continue
        if isinstance(node, ast.ImportFrom):
            imports.append((node.level, node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Import):
            imports += [(0, a.name, ()) for a in node.names]
        todo.extend(ast.iter_child_nodes(node))
    return tuple(imports), hashlib.sha256(ast.dump(tree).encode()).digest()


def _is_type_checking(test: object) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): a block no stage executes."""
    import ast

    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_graph(entries: tuple[str, ...]) -> dict[Path, tuple[Path | None, str]]:
    """Every package file reachable from ``entries`` (see :func:`import_closure`): file -> (the
    file that first pulls it in, breadth first, and how: the import statement, or "package" for
    the ``__init__.py`` of a package a file is in); ``(None, "entry")`` for the entries."""
    from collections import deque

    pkg = PACKAGE
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
    run them; those under ``if TYPE_CHECKING:`` left out: nothing runs them), plus the
    ``__init__.py`` of every package on the way. Static, so the result does not depend on what
    happens to be imported already."""
    pkg = PACKAGE
    return sorted(str(p.relative_to(pkg)) for p in _import_graph(entries)
                  if str(p.relative_to(pkg)) not in _EXCLUDED)


def import_chain(entries: tuple[str, ...], module: str) -> list[tuple[str, str]]:
    """How ``module`` (a path relative to the package) comes into the import closure of
    ``entries``: the shortest chain of files from an entry point to it, each with how the one
    before pulls it in, ``[(entry, "entry"), (file, "from .x import y"), ..., (module, how)]``
    ("package": the ``__init__.py`` of a package the previous file is in); empty when it is not
    in the closure. What the stage's code hash covers is the whole closure, function-level
    imports included: a module on such a chain is hashed whether or not the stage calls it."""
    pkg = PACKAGE
    graph = _import_graph(entries)
    f: Path | None = pkg / module
    if f not in graph or module in _EXCLUDED:
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
    pkg = PACKAGE
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
