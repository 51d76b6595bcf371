"""Functions that fit on a screen: no function or method of the package is longer than
``MAX_LINES`` lines, from its ``def`` line to its last line (decorators left out, nested
functions counted with the function that holds them).

numba-compiled kernels (decorated with ``njit`` or ``jit``, called or not, through any module
name) are exempt: splitting one costs a call across the compiled boundary or a second kernel,
and they are measured by the benchmarks rather than read often.

Static (``ast``), so nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import nccltrace

PKG = Path(nccltrace.__file__).resolve().parent
MAX_LINES = 100
_COMPILERS = {"njit", "jit"}


def _is_compiled(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with numba's ``njit``/``jit``: ``@njit``, ``@njit(...)``, ``@numba.njit(...)``."""
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name in _COMPILERS:
            return True
    return False


def _functions(path: Path) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def long_functions(root: Path = PKG, limit: int = MAX_LINES) -> list[tuple[str, int, str, int]]:
    """(file relative to the package's parent, line, name, length) of each function longer than
    ``limit`` lines that is not a compiled kernel, in file and line order."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for fn in _functions(path):
            length = fn.end_lineno - fn.lineno + 1
            if length > limit and not _is_compiled(fn):
                out.append((str(path.relative_to(root.parent)), fn.lineno, fn.name, length))
    return sorted(out)


def test_no_function_is_longer_than_a_screen() -> None:
    offenders = long_functions()
    assert not offenders, f"{len(offenders)} function(s) over {MAX_LINES} lines (split them):\n" + "\n".join(
        f"  {file}:{line} {name}: {length} lines" for file, line, name, length in offenders)


def test_the_check_sees_long_functions_and_exempts_compiled_kernels(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import numba\nfrom numba import njit\n\n"
        f"def long():\n{body}\n"
        f"def short():\n    return 1\n\n"
        f"@njit(cache=True)\ndef kernel():\n{body}\n"
        f"@numba.jit\ndef kernel2():\n{body}\n"
        f"class C:\n    def method(self):\n{body.replace('    ', '        ')}")
    found = long_functions(tmp_path / "pkg")
    assert [(file, name, length) for file, _, name, length in found] == [
        ("pkg/m.py", "long", MAX_LINES + 1), ("pkg/m.py", "method", MAX_LINES + 1)]
    assert found[0][1] == 4
