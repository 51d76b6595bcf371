"""Import boundaries of the package: every import runs down the layer table, only the modules
that emulate runs import the emulator, no two modules import each other (at any depth, through
function-local imports too), and a few facts keep their one home.

Static (``ast``), so the result does not depend on what a test happened to import before.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

import nccltrace
from nccltrace.campaign.code_stamps import import_chain, import_closure

PKG = Path(nccltrace.__file__).resolve().parent
ARCHITECTURE = PKG.parents[1] / "docs" / "architecture.md"

# The layer table, top to bottom: a module may import its own package and any package on a
# lower row, never one on its row or above. Its one home is here, beside the check that enforces
# it, not in the package: no package code reads it, and a table the test does not read would
# drift. docs/architecture.md shows the same rows to readers, and
# test_the_architecture_shows_the_layer_table holds the two equal. A top-level module
# (cli.py, analyze.py) is its own package; the package's __init__.py sits with core.
# validation sits above campaign, not beside it: its tables are scored on the campaign's runs
# (it expands the campaign config), and campaign never needs validation.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("validation",),
    ("campaign",),
    ("analyze",),
    ("stages",),
    ("outputs",),
    ("metrics",),
    ("ops",),
    ("communicators",),
    ("align",),
    ("acquisition",),
    ("inputs",),
    ("emulator",),
    ("megatron",),
    ("kineto",),
    ("nsys",),
    ("nccl", "pytorch"),
    ("core",),
)
_ROW = {package: row for row, packages in enumerate(LAYERS) for package in packages}

# The modules that run the emulator, and why: everything else is analysis and never imports it,
# though the emulator sits below the analysis packages (it writes the formats they read).
EMULATOR_USERS = {
    "cli.py": "the `nccltrace emulate` command",
    "campaign/": "validates emulated runs with the emulator's config",
    "validation/": "scores the analysis against emulated ground truth",
    "stages/acquire.py": "the acquire stage's emulate backend",
}


@dataclasses.dataclass(frozen=True)
class Import:
    """One import of a package module: where (module, line), what (the statement) and which
    package module it reaches."""

    module: str
    line: int
    statement: str
    target: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.statement}  (-> {self.target})"


def _modules() -> list[str]:
    return sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py"))


def _package(module: str) -> str:
    parts = Path(module).parts
    if len(parts) == 1:
        return "core" if module == "__init__.py" else Path(module).stem
    return parts[0]


def _resolve(dotted: list[str], root: Path = PKG) -> str | None:
    base = root.joinpath(*dotted)
    if base.with_suffix(".py").is_file():
        return str(base.with_suffix(".py").relative_to(root))
    if (base / "__init__.py").is_file():
        return str((base / "__init__.py").relative_to(root))
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(body: list[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth (functions, classes, try/with/if blocks),
    but not those under ``if TYPE_CHECKING:``, which never run."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse)
        else:
            yield from _import_nodes(list(ast.iter_child_nodes(node)))  # except handlers and match cases too


def imports_of(module: str, root: Path = PKG) -> list[Import]:
    """The package modules ``module`` (a path relative to the package ``root``) imports, one
    :class:`Import` per module reached: ``from x import y`` reaches the submodule ``x/y.py``
    where there is one, else ``x``."""
    here = list(Path(module).with_suffix("").parts[:-1])
    out: list[Import] = []
    for node in _import_nodes(ast.parse((root / module).read_text(encoding="utf-8")).body):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                mod = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == root.name:
                mod = node.module.split(".")[1:]
            else:
                continue
            subs = [t for a in node.names if (t := _resolve([*mod, a.name], root))]
            targets = subs if len(subs) == len(node.names) else [*subs, _resolve(mod, root)]
        else:
            targets = [_resolve(a.name.split(".")[1:], root) for a in node.names if a.name.split(".")[0] == root.name]
        out += [Import(module, node.lineno, ast.unparse(node), t) for t in dict.fromkeys(targets) if t]
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, with the ``__init__.py`` of every package on
    the way to them (Python runs those too), less the importer's own packages (already running)."""
    graph: dict[str, set[str]] = {}
    for module in _modules():
        parts = Path(module).parts
        own = {str(Path(*parts[:i], "__init__.py")) for i in range(len(parts))}
        edges: set[str] = set()
        for imp in imports_of(module):
            tparts = Path(imp.target).parts
            edges |= {str(Path(*tparts[:i], "__init__.py")) for i in range(1, len(tparts))}
            edges.add(imp.target)
        graph[module] = edges - own - {module}
    return graph


def _is_emulator_user(module: str) -> bool:
    return module.startswith("emulator/") or any(
        module == k or (k.endswith("/") and module.startswith(k)) for k in EMULATOR_USERS)


def layer_violations(imports: list[Import]) -> list[str]:
    """What is wrong with ``imports``: one line per import that runs up the layer table or along
    a row, or reaches the emulator from a module that is not an emulator user."""
    bad = []
    for imp in imports:
        src, dst = _package(imp.module), _package(imp.target)
        if src == dst or imp.target == "__init__.py":
            continue
        if dst == "emulator" and not _is_emulator_user(imp.module):
            bad.append(f"{imp}: only {', '.join(EMULATOR_USERS)} import the emulator")
        elif _ROW[dst] < _ROW[src]:
            bad.append(f"{imp}: {src} imports {dst}, a layer above it")
        elif _ROW[dst] == _ROW[src]:
            bad.append(f"{imp}: {src} imports {dst}, on its own row")
    return bad


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()}
    assert not packages - set(_ROW), f"packages missing from LAYERS: {sorted(packages - set(_ROW))}"
    assert not set(_ROW) - packages, f"LAYERS names packages that do not exist: {sorted(set(_ROW) - packages)}"


def test_imports_run_down_the_layer_table():
    bad = [line for m in _modules() for line in layer_violations(imports_of(m))]
    assert not bad, "imports against the layer table:\n" + "\n".join(bad)


def test_the_layer_check_names_module_line_and_import():
    """Broken on purpose: an upward, a sideways and an emulator import are each named."""
    bad = layer_violations([Import("nccl/log_reader.py", 7, "from nccltrace.stages import x", "stages/x.py"),
                            Import("pytorch/fr_calls.py", 9, "import nccltrace.nccl.enums", "nccl/enums.py"),
                            Import("metrics/volume.py", 3, "from nccltrace.emulator import run", "emulator/run.py"),
                            Import("metrics/volume.py", 4, "from nccltrace.core import tables", "core/tables.py")])
    assert bad == [
        "nccl/log_reader.py:7: from nccltrace.stages import x  (-> stages/x.py): nccl imports stages, a layer above it",
        "pytorch/fr_calls.py:9: import nccltrace.nccl.enums  (-> nccl/enums.py): pytorch imports nccl, on its own row",
        ("metrics/volume.py:3: from nccltrace.emulator import run  (-> emulator/run.py): only cli.py, campaign/, "
         "validation/, stages/acquire.py import the emulator"),
    ]  # fmt: skip


def test_imports_of_reads_function_local_imports_but_not_type_checking_ones(tmp_path):
    root = tmp_path / "x"
    (root / "core").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "b.py"):
        (root / "core" / name).write_text("")
    (root / "m.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x.core import a\n"
                               "def f():\n    try:\n        from x.core import b\n    except ImportError:\n"
                               "        import x.core\n")  # fmt: skip
    assert [(i.line, i.target) for i in imports_of("m.py", root)] == [(6, "core/b.py"), (8, "core/__init__.py")]


def test_every_emulator_user_still_needs_the_emulator():
    """Keep :data:`EMULATOR_USERS` as small as true: a module that no longer reaches the
    emulator is analysis and must be checked."""
    for key in EMULATOR_USERS:
        modules = [m for m in _modules() if m == key or (key.endswith("/") and m.startswith(key))]
        assert modules, f"{key} does not exist any more: drop it from EMULATOR_USERS"
        assert any(e.startswith("emulator/") for m in modules for e in import_closure((m,))), (
            f"{key} no longer needs the emulator: drop it from EMULATOR_USERS")


def test_the_analysis_never_reaches_the_emulator():
    """Not even through a module that may import it: an analysis module's closure (what its
    code stamp hashes) holds no emulator module."""
    bad = []
    for m in _modules():
        reached = [x for x in import_closure((m,)) if x.startswith("emulator/")]
        if reached and not _is_emulator_user(m):
            chain = import_chain((m,), reached[0])
            bad.append(f"{m}: " + " -> ".join(f"{mod} ({how})" for mod, how in chain[1:]))
    assert not bad, "analysis modules whose code stamp reaches the emulator:\n" + "\n".join(bad)


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


def test_no_import_cycle():
    """No circle between modules, function-local imports included: the layer table keeps
    packages apart, this keeps the modules of one package apart."""
    graph = _graph()
    cycle = _find_cycle(graph)
    if cycle:
        lines = [next(str(i) for i in imports_of(a) if i.target == b or (
            b.endswith("__init__.py") and i.target.startswith(str(Path(b).parent) + "/"))) for a, b in pairwise(cycle)]
        pytest.fail("import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(lines))


def test_find_cycle_names_the_cycle():
    assert _find_cycle({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}}) == ["a.py", "b.py", "c.py", "a.py"]
    assert _find_cycle({"a.py": {"b.py"}, "b.py": set(), "c.py": {"a.py", "b.py"}}) is None


def test_the_architecture_shows_the_layer_table():
    """docs/architecture.md's layer table lists the rows of :data:`LAYERS`, in order: a table
    with a ``layer`` column whose cells name the packages (in backticks) of each row."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    head = re.search(r"^\| *layer *\|.*\n\|[-| ]+\|\n((?:\|.*\n)+)", text, flags=re.MULTILINE)
    assert head, f"{ARCHITECTURE.name} has no table with a 'layer' column"
    rows = [tuple(re.findall(r"`([\w.]+?)(?:/|\.py)?`", line.split("|")[2])) for line in head.group(1).splitlines()]
    assert rows == list(LAYERS)


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
               "inputs/kernel_sources.py"}  # fmt: skip
    bad = {m: sorted(i.target for i in imports_of(m) if i.target in readers) for m in _modules()
           if m.startswith("align/")}
    assert not any(bad.values()), bad
    assert import_closure(("core/kernel_args.py",)) == ["core/__init__.py", "core/kernel_args.py"]
