"""The workflow's code stamps (code_stamps.code_stamp_is_current, read as the workflow's graph is
built; rule code_stamp writes them) and what counts as a code change (the stage hash reads Python
modules by their syntax tree). The workflow-level acceptance, jobs counted from Snakemake's table
on the example campaign, and that reading the workflow (dry runs, --summary, ...) changes no file,
are in test_workflow.py."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from nccltrace.campaign import code_stamps


def _digest(path, text: str) -> bytes:
    path.write_text(text)
    return code_stamps._module_facts(path, path.stat().st_mtime_ns + len(text))[1]


def test_a_comment_or_reformatting_leaves_a_modules_hash_and_a_code_change_does_not(tmp_path):
    module = tmp_path / "m.py"
    base = _digest(module, "def f(x):\n    return x + 1\n")
    assert _digest(module, "# why\ndef f(x):\n\n    return (x + 1)  # one more\n") == base
    assert _digest(module, "def f(x):\n    return x + 2\n") != base
    assert _digest(module, 'def f(x):\n    """Adds one."""\n    return x + 1\n') != base  # docstrings count


def test_a_templates_whitespace_counts(tmp_path):
    template = tmp_path / "t.j2"
    assert _digest(template, "<p>{{ x }}</p>\n") != _digest(template, "<p>{{ x }} </p>\n")


def test_whether_a_stamp_is_current_is_read_without_writing_anything(tmp_path):
    stamps = tmp_path / "stamps"
    stamp = code_stamps.code_stamp_path(stamps, "ops")
    assert stamp == stamps / "ops.stamp"
    assert not code_stamps.code_stamp_is_current(stamp, "aaaaaaaaaaaaaaaa")  # none yet: out of date
    assert not stamps.exists()  # and none made
    stamps.mkdir()
    stamp.write_text("aaaaaaaaaaaaaaaa\n")  # as rule code_stamp writes it
    os.utime(stamp, ns=(1_000_000_000, 1_000_000_000))
    assert code_stamps.code_stamp_is_current(stamp, "aaaaaaaaaaaaaaaa")
    assert not code_stamps.code_stamp_is_current(stamp, "bbbbbbbbbbbbbbbb")
    stamp.write_bytes(b"\xff\xfe")
    os.utime(stamp, ns=(1_000_000_000, 1_000_000_000))
    assert not code_stamps.code_stamp_is_current(stamp, "aaaaaaaaaaaaaaaa")  # unreadable: out of date
    assert stamp.read_bytes() == b"\xff\xfe" and stamp.stat().st_mtime_ns == 1_000_000_000
    assert [p.name for p in stamps.iterdir()] == ["ops.stamp"]


def test_an_import_chain_says_how_a_module_comes_into_a_stages_code_hash():
    entries = code_stamps.STAGE_ENTRIES["ops"]
    closure = code_stamps.import_closure(entries)
    chain = code_stamps.import_chain(entries, "megatron/groups.py")
    assert chain[0][0] in entries and chain[0][1] == "entry" and chain[-1][0] == "megatron/groups.py"
    assert len(chain) > 2
    for (before, _), (module, how) in zip(chain, chain[1:]):
        assert module in closure or module == "code_stamps.py"  # the closure leaves provenance out, not its imports
        assert how == "package" or how.startswith(("from ", "import ")), how
        assert how == "package" or before.endswith(".py")
    assert code_stamps.import_chain(entries, "outputs/tables_doc.py") == []  # in no stage's code
    assert all(code_stamps.import_chain(entries, m) for m in closure)  # every module of the closure has one


def test_every_package_module_a_rule_script_imports_is_in_its_stages_code_hash():
    """A rule script (workflow/scripts/<stage>.py, and _bootstrap.py, which every one runs) may
    import a package module beside its stage's: it runs it, so a change to it must re-run the
    stage (align_node's script reads the capture window, every script sets up errors'
    warnings). code_stamps.py is left out of every stage's code by design."""
    scripts = Path(__file__).resolve().parents[1] / "workflow" / "scripts"
    bootstrap = scripts / "_bootstrap.py"

    def imports(path: Path) -> set[str]:
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            out.update(n for n in names if n.split(".")[0] == "nccltrace")
        return out

    checked = 0
    for stage, entries in code_stamps.STAGE_ENTRIES.items():
        script = scripts / f"{stage}.py"
        if not script.is_file():
            continue
        closure = set(code_stamps.import_closure(entries))
        for module in sorted(imports(script) | imports(bootstrap)):
            rel = "/".join(module.split(".")[1:])
            if rel == "provenance":
                continue
            assert f"{rel}.py" in closure or f"{rel}/__init__.py" in closure, (stage, module)
            checked += 1
    assert checked >= 20
