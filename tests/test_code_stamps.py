"""The workflow's code stamps (provenance.refresh_code_stamp) and what counts as a code change
(the stage hash reads Python modules by their syntax tree). The workflow-level acceptance, jobs
counted from Snakemake's table on the example campaign, is in test_workflow.py."""

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


def test_a_stamp_is_rewritten_only_when_the_code_it_holds_is_not_the_codes(tmp_path, monkeypatch):
    code = {"ops": "aaaaaaaaaaaaaaaa"}
    monkeypatch.setattr(provenance, "stage_code_hash", lambda stage: code[stage])
    stamp = provenance.refresh_code_stamp(tmp_path / "stamps", "ops")
    assert stamp.read_text().strip() == "aaaaaaaaaaaaaaaa"
    os.utime(stamp, ns=(1_000_000_000, 1_000_000_000))  # made long ago
    provenance.refresh_code_stamp(tmp_path / "stamps", "ops")
    assert stamp.stat().st_mtime_ns == 1_000_000_000  # same code: untouched, older than the outputs
    code["ops"] = "bbbbbbbbbbbbbbbb"
    provenance.refresh_code_stamp(tmp_path / "stamps", "ops")
    assert stamp.read_text().strip() == "bbbbbbbbbbbbbbbb" and stamp.stat().st_mtime_ns > 1_000_000_000
    assert [p.name for p in stamp.parent.iterdir()] == ["ops.stamp"]  # written atomically, nothing left over
