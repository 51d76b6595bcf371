"""Import boundaries of the package: the analysis never imports the emulator, the package's
modules import each other without cycles, and Megatron's model defaults have one home.

Static (``ast``), so the result does not depend on what a test happened to import before.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import nccltrace
from nccltrace.campaign.code_stamps import import_closure

PKG = Path(nccltrace.__file__).resolve().parent

# Modules that need the emulator, and why. Everything else is analysis.
EMULATOR_USERS = {
    "cli.py": "the `nccltrace emulate` command",
    "campaign/": "validates emulated runs with the emulator's config",
    "validation/": "scores the analysis against emulated ground truth",
}


def _modules() -> list[str]:
    return sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py"))


def _exempt(module: str) -> bool:
    return module.startswith("emulator/") or any(
        module == k or (k.endswith("/") and module.startswith(k)) for k in EMULATOR_USERS)


def _resolve(dotted: list[str]) -> Path | None:
    base = PKG.joinpath(*dotted)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(body: list[ast.stmt], top_level: bool):
    """Import statements of a module: those that run when it is imported (top level, including
    blocks of if/try/with/class, but not ``if TYPE_CHECKING:``), or all of them."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not top_level:
                yield from _import_nodes(node.body, top_level)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse, top_level)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    yield from _import_nodes([n for n in inner if isinstance(n, ast.AST)], top_level)


def _edges(module: str, top_level: bool) -> set[str]:
    """Package modules ``module`` imports (paths relative to the package). A submodule import
    also runs its packages' ``__init__``; the importer's own packages are already running."""
    path = PKG / module
    here = list(Path(module).with_suffix("").parts[:-1])
    own = {str(Path(*here[:i], "__init__.py")) for i in range(len(here) + 1)}
    targets: list[list[str]] = []
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8")).body, top_level):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                mod = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == PKG.name:
                mod = node.module.split(".")[1:]
            else:
                continue
            targets.append(mod)
            targets += [[*mod, a.name] for a in node.names if _resolve([*mod, a.name])]
        else:
            targets += [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == PKG.name]
    out: set[str] = set()
    for mod in targets:
        for i in range(len(mod) + 1):  # the packages on the way, then the module itself
            p = _resolve(mod[:i])
            if p is not None:
                out.add(str(p.relative_to(PKG)))
    return out - own - {module}


def test_the_analysis_never_imports_the_emulator():
    bad: dict[str, list[str]] = {}
    for module in _modules():
        if _exempt(module):
            continue
        reached = import_closure((module,))
        if any(m.startswith("emulator/") for m in reached):
            # Name the modules of the closure that import the emulator themselves.
            bad[module] = sorted(m for m in reached if not m.startswith("emulator/")
                                 and any(e.startswith("emulator/") for e in _edges(m, top_level=False)))
    assert not bad, "analysis modules whose import closure reaches emulator/ (through): " + "; ".join(
        f"{m} ({', '.join(via)})" for m, via in bad.items())


def test_every_exception_still_needs_the_emulator():
    """Keep :data:`EMULATOR_USERS` as small as true: a module that no longer reaches the
    emulator is analysis and must be checked."""
    for key in EMULATOR_USERS:
        modules = [m for m in _modules() if m == key or (key.endswith("/") and m.startswith(key))]
        assert modules, f"{key} does not exist any more: drop it from EMULATOR_USERS"
        assert any(e.startswith("emulator/") for m in modules for e in import_closure((m,))), (
            f"{key} no longer needs the emulator: drop it from EMULATOR_USERS")


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_cycle_at_module_level():
    graph = {m: _edges(m, top_level=True) for m in _modules()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle at module level: " + " -> ".join(cycle)


def test_find_cycle_names_the_cycle():
    assert _find_cycle({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}}) == ["a.py", "b.py", "c.py", "a.py"]
    assert _find_cycle({"a.py": {"b.py"}, "b.py": set(), "c.py": {"a.py", "b.py"}}) is None


def test_model_defaults_have_one_home():
    """The emulator's config fields take their defaults from Megatron's table, unchanged."""
    from nccltrace.emulator.config import EmulatorConfig
    from nccltrace.megatron.model import MODEL_DEFAULTS

    defaults = {f.name: f.default for f in dataclasses.fields(EmulatorConfig)}
    assert {k: defaults.get(k, "<no such field>") for k in MODEL_DEFAULTS} == dict(MODEL_DEFAULTS)


def test_the_alignment_does_not_know_which_profiler_recorded_the_kernels():
    """One kernel-source interface, two readers: no alignment module imports the PyTorch-profiler
    reader, the nsys export reader or the source merging; what it knows of a kernel's recorded
    call comes from ``kernel_args`` (columns and count conventions, no reader)."""
    readers = {"kineto/__init__.py", "kineto/reader.py", "kineto/scan.py", "kineto/to_nsys.py", "nsys/reader.py",
               "kernel_sources.py"}  # fmt: skip
    bad = {m: sorted(_edges(m, top_level=False) & readers) for m in _modules() if m.startswith("align/")}
    assert not any(bad.values()), bad
    assert not set(import_closure(("kernel_args.py",))) - {"kernel_args.py", "__init__.py"}
