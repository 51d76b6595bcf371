"""The workflow's code stamps (provenance.code_stamp_is_current, read as the workflow's graph is
built; rule code_stamp writes them) and what counts as a code change (the stage hash reads Python
modules by their syntax tree). The workflow-level acceptance, jobs counted from Snakemake's table
on the example campaign, and that reading the workflow (dry runs, --summary, ...) changes no file,
are in test_workflow.py."""

from __future__ import annotations

import os

from nccltrace import provenance


def _digest(path, text: str) -> bytes:
    path.write_text(text)
    return provenance._module_facts(path, path.stat().st_mtime_ns + len(text))[1]


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
    stamp = provenance.code_stamp_path(stamps, "ops")
    assert stamp == stamps / "ops.stamp"
    assert not provenance.code_stamp_is_current(stamp, "aaaaaaaaaaaaaaaa")  # none yet: out of date
    assert not stamps.exists()  # and none made
    stamps.mkdir()
    stamp.write_text("aaaaaaaaaaaaaaaa\n")  # as rule code_stamp writes it
    os.utime(stamp, ns=(1_000_000_000, 1_000_000_000))
    assert provenance.code_stamp_is_current(stamp, "aaaaaaaaaaaaaaaa")
    assert not provenance.code_stamp_is_current(stamp, "bbbbbbbbbbbbbbbb")
    stamp.write_bytes(b"\xff\xfe")
    os.utime(stamp, ns=(1_000_000_000, 1_000_000_000))
    assert not provenance.code_stamp_is_current(stamp, "aaaaaaaaaaaaaaaa")  # unreadable: out of date
    assert stamp.read_bytes() == b"\xff\xfe" and stamp.stat().st_mtime_ns == 1_000_000_000
    assert [p.name for p in stamps.iterdir()] == ["ops.stamp"]
