"""Per-node jobs: the stages parse_node and align_node run the per-process stages for every
process of one node in one interpreter, into per-node directories of the run layout. A damaged
input stays a partial result; a stage that raises for one process does not stop the others, and
the node then fails naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nccltrace.core.layout import RunLayout, process_key
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.stages import NodeStageError, StageResult
from nccltrace.stages import align_node as align_node_mod
from nccltrace.stages import parse_node as parse_node_mod
from nccltrace.stages.align_node import run_align_node
from nccltrace.stages.parse_node import run_parse_node

# 2 nodes x 2 GPUs, TP=2, one iteration: two processes per node
CFG = {"model": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
       "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 2, "iterations": 1, "nodes": 2,
       "gpus_per_node": 2, "tp": 2, "precision": "bf16", "seed": 4}  # fmt: skip


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("node_stages") / "raw"
    emulate_run(CFG, out)
    return out


def _logs(raw: Path, host: str) -> dict[str, Path]:
    return {p.stem: p for p in sorted((raw / "nccl").glob(f"nccl_{host}_*.log"))}


def test_the_layout_groups_each_process_under_its_node(tmp_path):
    layout = RunLayout(tmp_path / "run")
    proc = "nccl_node-a.cluster_42"
    assert process_key(proc) == ("node-a.cluster", 42) and layout.host_of(proc) == "node-a.cluster"
    assert layout.parsed_nccl(proc) == layout.parsed_nccl_node("node-a.cluster") / proc
    assert layout.parsed_nccl_table(proc, "calls") == tmp_path / "run/parsed/nccl/node-a.cluster" / proc / "calls.parquet"
    assert layout.parse_report(proc).parent == layout.parsed_nccl(proc)
    assert layout.alignment(proc) == tmp_path / "run/aligned/node-a.cluster" / proc / "alignment.parquet"
    assert layout.alignment_quality(proc).parent == layout.aligned(proc) == layout.aligned_node("node-a.cluster") / proc
    with pytest.raises(ValueError, match="nccl_<host>_<pid>"):
        layout.parsed_nccl("rank0")
    # what a run directory holds, found without the process list (a reader given only the directory)
    for p in (proc, "nccl_b_7"):
        layout.parsed_nccl(p).mkdir(parents=True)
    (layout.parsed_nccl_node("b") / "notes").mkdir()  # not a process directory
    (layout.parsed_nccl_node("b") / "nccl_c_9").mkdir()  # a process of another node: not this node's
    layout.parsed_nsys("b").mkdir(parents=True)
    assert layout.find_processes() == ["nccl_b_7", proc] and layout.find_hosts() == ["b"]
    assert RunLayout(tmp_path / "empty").find_processes() == [] and RunLayout(tmp_path / "empty").find_hosts() == []
    # the report's manifests: per process and node inside the node directories, then the run's stages
    manifests = layout.stage_manifests([proc], ["b"])
    assert manifests[0] == layout.manifest(layout.parsed_nccl(proc)) and layout.manifest(layout.aligned(proc)) in manifests
    assert layout.stage_manifests((), ()) == [m for m in manifests if "node-a" not in str(m) and "/nsys/" not in str(m)]


def test_parse_node_parses_every_process_of_the_node_and_its_export(raw, tmp_path):
    layout = RunLayout(tmp_path / "run")
    logs = _logs(raw, "node001")
    done: list[str] = []
    result = run_parse_node(layout, "node001", logs, raw / "nsys" / "node001.sqlite", {"x": 1}, done=done.append)
    assert result.stage == "parse_node" and not result.partial and result.details["hostname"] == "node001"
    assert done == ["export node001.sqlite", *sorted(logs)]  # the export first: the larger peak
    for proc, log in logs.items():
        manifest = json.loads(layout.manifest(layout.parsed_nccl(proc)).read_text())
        assert manifest["stage"] == "parse_nccl" and manifest["config"] == {"x": 1} and log.name in str(manifest["inputs"])
        assert len(read_table(layout.parsed_nccl_table(proc, "calls"))) > 0
        assert f"{proc}: {{" in result.summary  # one line per process in the job's log
    assert json.loads(layout.manifest(layout.parsed_nsys("node001")).read_text())["stage"] == "parse_nsys"
    assert sorted(p.name for p in layout.parsed_nccl_node("node001").iterdir()) == sorted(logs)
    with pytest.raises(ValueError, match="belong to other nodes"):
        run_parse_node(layout, "node000", logs, None)


def test_a_node_without_export_gets_no_export_tables_and_one_without_logs_its_export(raw, tmp_path):
    layout = RunLayout(tmp_path / "run")
    lonely = run_parse_node(layout, "node000", _logs(raw, "node000"), raw / "nsys" / "missing.sqlite")
    assert lonely.partial and any("no nsys export" in p for p in lonely.problems), lonely.problems
    assert json.loads(layout.session("node000").read_text())["available"] is False
    unused = run_parse_node(layout, "node001", {}, raw / "nsys" / "node001.sqlite")
    assert not unused.partial and list(layout.parsed_nccl_node("node001").iterdir()) == []
    assert len(read_table(layout.parsed_nsys_table("node001", "kernels"))) > 0


def test_a_process_whose_stage_raises_fails_the_node_by_name_after_the_others(raw, tmp_path, monkeypatch, capsys):
    layout = RunLayout(tmp_path / "run")
    logs = _logs(raw, "node000")
    victim = min(logs)
    real = parse_node_mod.run_parse_nccl

    def flaky(log_file, out_dir, settings=None) -> StageResult:
        if Path(log_file).stem == victim:
            raise KeyError("boom")
        return real(log_file, out_dir, settings)

    monkeypatch.setattr(parse_node_mod, "run_parse_nccl", flaky)
    with pytest.raises(NodeStageError) as err:
        run_parse_node(layout, "node000", logs, raw / "nsys" / "node000.sqlite")
    e = err.value
    assert list(e.failures) == [victim] and isinstance(e.__cause__, KeyError) and not e.bad_input
    assert str(e).startswith(f"parse_node of node node000: 1 of 3 failed ({victim}: KeyError: 'boom')")
    assert "workflow removes the outputs of a failed job" in str(e)
    # the others were done (and said so in the log) before the node failed
    out = capsys.readouterr().out
    assert f"FAILED: parse_node of node node000: {victim}: KeyError: 'boom'" in out and "Traceback" in out
    other = sorted(logs)[1]
    assert layout.parse_report(other).is_file() and layout.session("node000").is_file()
    assert f"{other}: {{" in out and not layout.parse_report(victim).exists()

    # a refused input is bad input (the CLI prints it without a traceback)
    def refuse(log_file, out_dir, settings=None) -> StageResult:
        raise ValueError(f"{Path(log_file).name}: not a log")

    monkeypatch.setattr(parse_node_mod, "run_parse_nccl", refuse)
    with pytest.raises(NodeStageError, match="2 of 3 failed") as err:
        run_parse_node(layout, "node000", logs, raw / "nsys" / "node000.sqlite")
    assert err.value.bad_input and set(err.value.failures) == set(logs)


def test_align_node_aligns_each_process_of_the_node(raw, tmp_path, monkeypatch):
    layout = RunLayout(tmp_path / "run")
    for host in ("node000", "node001"):
        run_parse_node(layout, host, _logs(raw, host), raw / "nsys" / f"{host}.sqlite")
    procs = sorted(_logs(raw, "node001"))
    result = run_align_node(layout, "node001", procs)
    assert result.stage == "align_node" and not result.partial
    for proc in procs:
        manifest = json.loads(layout.manifest(layout.aligned(proc)).read_text())
        assert manifest["stage"] == "align" and manifest["summary"]["matched"] > 0
        assert layout.alignment_quality(proc).is_file()
    assert sorted(p.name for p in layout.aligned_node("node001").iterdir()) == procs
    with pytest.raises(ValueError, match="belong to other nodes"):
        run_align_node(layout, "node000", procs)
    monkeypatch.setattr(align_node_mod, "run_align",
                        lambda layout, proc, host, **kw: (_ for _ in ()).throw(RuntimeError(f"{proc} bug")))  # fmt: skip
    with pytest.raises(NodeStageError, match=rf"align_node of node node001: 2 of 2 failed \({procs[0]}: RuntimeError"):
        run_align_node(layout, "node001", procs)


def test_analyze_into_an_earlier_output_drops_what_this_run_does_not_have(raw, tmp_path):
    """Directories of an earlier analysis (another run, or the layout before per-node
    directories) are removed; this run's are rewritten."""
    from nccltrace.analyze import analyze_run

    out = tmp_path / "out"
    layout = RunLayout(out)
    old_layout = out / "parsed" / "nccl" / "nccl_node000_1"  # per-process directory of the earlier layout
    ghost_node = layout.parsed_nccl_node("ghost") / "nccl_ghost_2"
    ghost_proc = layout.parsed_nccl("nccl_node000_3")  # a process this run's node000 does not have
    old_aligned = out / "aligned" / "nccl_node000_1"
    for d in (old_layout, ghost_node, ghost_proc, old_aligned, layout.parsed_nsys("ghost")):
        d.mkdir(parents=True)
        (d / "manifest.json").write_text("{}")
    keep = out / "parsed" / "nccl" / "mine"  # not written by nccltrace: left alone
    keep.mkdir()
    copy = tmp_path / "raw"
    shutil.copytree(raw, copy)
    summary = analyze_run(copy, out, progress=False)
    assert not summary["partial"], summary["problems"]
    for d in (old_layout, ghost_node.parent, ghost_proc, old_aligned, layout.parsed_nsys("ghost")):
        assert not d.exists(), d
    assert keep.is_dir()
    procs = sorted(p.stem for p in (raw / "nccl").glob("nccl_*.log"))
    assert layout.find_processes() == procs and layout.find_hosts() == ["node000", "node001"]
