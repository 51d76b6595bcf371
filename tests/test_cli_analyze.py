"""`nccltrace analyze` / `align` / `validate`: every stage on one emulated run without Snakemake,
checked against the emulator's ground truth; missing inputs; the accuracy report."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from nccltrace.analyze import NO_EXPORT_REASON
from nccltrace.cli import main
from nccltrace.core.layout import RunLayout
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run

# TP=2 x PP=2 over 2 nodes of 2 GPUs, one iteration: two exports, grouped P2P, single-rank
# data-parallel communicators (dp = 1) - small, but every stage has something to do.
SMALL = {
    "model": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
    "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 4, "iterations": 1, "nodes": 2,
    "gpus_per_node": 2, "tp": 2, "pp": 2, "precision": "bf16", "seed": 5,
    "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1},
}  # fmt: skip


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("analyze")
    emulate_run(SMALL, base / "raw")
    assert main(["analyze", str(base / "raw"), "-o", str(base / "out"), "-q"]) == 0
    return base / "raw", base / "out"


def _truth_kernels(raw: Path) -> pd.DataFrame:
    t = read_table(raw / "ground_truth" / "ops.parquet")
    t = t[t["log_line"].notna() & t["kernel_correlation_id"].notna()]
    return pd.DataFrame({"file": t["log_file"].astype(str).str.rsplit("/", n=1).str[-1],
                         "line": t["log_line"].astype("int64"),
                         "true_gpid": t["kernel_global_pid"].astype("int64"),
                         "true_corr": t["kernel_correlation_id"].astype("int64")})  # fmt: skip


def test_analyze_writes_the_workflow_layout_with_manifests(analyzed):
    raw, out = analyzed
    procs = sorted(p.stem for p in (raw / "nccl").glob("nccl_*.log"))
    hosts = sorted(p.stem for p in (raw / "nsys").glob("*.sqlite"))
    assert len(procs) == 4 and hosts == ["node000", "node001"]
    layout = RunLayout(out)
    # per-process directories by node: parsed/nccl/<host>/<proc>/, aligned/<host>/<proc>/
    assert layout.parsed_nccl(procs[0]) == out / "parsed" / "nccl" / "node000" / procs[0]
    assert layout.aligned(procs[-1]) == out / "aligned" / "node001" / procs[-1]
    assert layout.find_processes() == procs and layout.find_hosts() == hosts
    stage_dirs = {**{layout.parsed_nccl(p): "parse_nccl" for p in procs},
                  **{layout.parsed_nsys(h): "parse_nsys" for h in hosts},
                  **{layout.aligned(p): "align" for p in procs},
                  out / "parsed": "parse_summary", out / "communicators": "communicators", out / "ops": "ops",
                  out: "analyze"}  # fmt: skip
    for d, stage in stage_dirs.items():
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["stage"] == stage and manifest["outputs"] and not manifest["partial"], d
    for p in procs:
        assert layout.parsed_nccl_table(p, "calls").exists()
        assert layout.alignment(p).exists()
    for h in hosts:
        assert layout.parsed_nsys_table(h, "kernels").exists()
    for name in ("ops", "parallelism", "clock_sync"):
        assert (out / "ops" / f"{name}.parquet").exists()
    summary = json.loads((out / "parsed" / "parse_summary.json").read_text())
    assert summary["processes"] == 4 and summary["nodes"] == 2 and not summary["partial"]
    top = json.loads((out / "manifest.json").read_text())
    assert top["summary"]["calls"] > 0 and top["summary"]["problems"] == []


def test_matched_ops_name_the_kernels_of_the_ground_truth(analyzed):
    raw, out = analyzed
    ops = read_table(out / "ops" / "ops.parquet")
    calls = ops[ops["row_kind"] == "call"]
    matched = calls[calls["status"] == "matched"]
    truth = _truth_kernels(raw)
    # Clean run: every call whose kernel exists is matched; the rest are single-rank calls.
    assert len(matched) == len(truth)
    assert set(calls.loc[calls["status"] != "matched", "reason"]) <= {"single_rank_communicator"}
    sample = matched.sample(n=min(200, len(matched)), random_state=0)
    m = sample.astype({"line": "int64"}).merge(truth, on=["file", "line"], how="left")
    assert m["true_corr"].notna().all()
    assert (m["kernel_correlation_id"].astype("int64") == m["true_corr"]).all()
    assert (m["kernel_global_pid"].astype("int64") == m["true_gpid"]).all()
    # Sizes from the emulator's run.yaml label the communicators; one clock per node.
    assert set(matched["label_source"]) == {"megatron-groups"}
    assert matched["kernel_start_sync"].notna().all()


def test_align_command_reproduces_the_per_process_alignment(analyzed, tmp_path, capsys):
    _, out = analyzed
    layout = RunLayout(out)
    proc = layout.find_processes()[0]
    rc = main(["align", str(layout.parsed_nccl(proc)), str(layout.parsed_nsys(layout.host_of(proc))), "-o",
               str(tmp_path)])  # fmt: skip
    assert rc == 0 and "matched" in capsys.readouterr().out
    mine = read_table(tmp_path / "alignment.parquet")
    pd.testing.assert_frame_equal(mine, read_table(layout.alignment(proc)))
    assert json.loads((tmp_path / "manifest.json").read_text())["stage"] == "align"


def test_host_without_export_is_unmatched_and_partial(analyzed, tmp_path, capsys):
    raw, _ = analyzed
    flat = tmp_path / "flat"
    flat.mkdir()
    for log in (raw / "nccl").glob("nccl_*.log"):
        shutil.copy(log, flat)
    shutil.copy(raw / "nsys" / "node000.sqlite", flat)
    (flat / "slurm-17.log").write_text("not an NCCL log\n")
    out = tmp_path / "out"
    # Flat directory, no run.yaml: sizes from the flags, world size from the init lines.
    assert main(["analyze", str(flat), "-o", str(out), "-q", "--tp", "2", "--pp", "2"]) == 0
    err = capsys.readouterr().err
    assert "node node001: no kernel trace" in err and "no nsys export node001.sqlite" in err and "slurm-17.log" in err
    layout = RunLayout(out)
    assert len(layout.find_processes()) == 4
    for d in (layout.aligned(p) for p in layout.find_processes()):
        table = read_table(d / "alignment.parquet")
        calls = table[table["row_kind"] == "call"]
        manifest = json.loads((d / "manifest.json").read_text())
        if "node001" in d.name:
            assert (calls["status"] == "unmatched").all() and manifest["partial"]
            assert set(calls["reason"]) <= {NO_EXPORT_REASON, "single_rank_communicator", "duplicate_line"}
            assert (calls["reason"] == NO_EXPORT_REASON).any()
        else:
            assert (calls["status"] == "matched").any() and not manifest["partial"]
    assert json.loads((out / "ops" / "manifest.json").read_text())["partial"]
    assert json.loads((out / "manifest.json").read_text())["partial"]
    ops = read_table(out / "ops" / "ops.parquet")
    assert set(ops.loc[ops["row_kind"] == "call", "label_source"]) == {"megatron-groups"}
    assert main(["analyze", str(flat), "-o", str(out), "-q", "--strict"]) == 2


def test_missing_logs_or_exports_are_named_with_what_to_do(analyzed, tmp_path, capsys):
    raw, _ = analyzed
    (tmp_path / "nsys").mkdir()
    shutil.copy(raw / "nsys" / "node000.sqlite", tmp_path / "nsys")
    # an nsys export alone: its NCCL API calls are analysed, the run is partial and names what is missing
    assert main(["analyze", str(tmp_path), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "no NCCL debug log" in err and "nsys export" in err and "no element count" in err
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["partial"] and "Traceback" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["analyze", str(empty), "-o", str(tmp_path / "out0")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no evidence of NCCL calls") and "Flight Recorder" in err and "NCCL_DEBUG_FILE" in err
    only_logs = tmp_path / "only_logs"
    shutil.copytree(raw / "nccl", only_logs / "nccl")
    (only_logs / "nsys").mkdir()
    (only_logs / "nsys" / "node000.nsys-rep").write_bytes(b"")
    # logs alone (the report was never exported): every stage that needs no kernel times runs,
    # the run is partial, and the console names the report and how to export it
    assert main(["analyze", str(only_logs), "-o", str(tmp_path / "out2"), "-q"]) == 0
    err = capsys.readouterr().err
    assert "node000.nsys-rep" in err and "nsys export --type sqlite" in err and "no kernel trace" in err
    assert json.loads((tmp_path / "out2" / "manifest.json").read_text())["partial"]
    ops = read_table(tmp_path / "out2" / "ops" / "ops.parquet")
    calls = ops[ops["row_kind"] == "call"]
    assert len(calls) and (calls["status"] == "unmatched").all()
    assert set(calls["reason"]) <= {NO_EXPORT_REASON, "single_rank_communicator", "duplicate_line"}
    assert (tmp_path / "out2" / "report" / "report.html").is_file()


def test_missing_rank_log_flags_the_run_partial(analyzed, tmp_path, capsys):
    raw, _ = analyzed
    copy = tmp_path / "raw"
    shutil.copytree(raw, copy)
    victim = min((copy / "nccl").glob("nccl_*.log"))
    victim.unlink()
    out = tmp_path / "out"
    assert main(["analyze", str(copy), "-o", str(out), "-q"]) == 0
    err = capsys.readouterr().err
    assert "1 of 4 rank logs are missing" in err and f"pid(s) {victim.stem.rsplit('_', 1)[1]} have no NCCL log" in err
    summary = json.loads((out / "parsed" / "parse_summary.json").read_text())
    assert summary["partial"] and summary["processes"] == 3 and summary["expected_processes"] == 4
    assert json.loads((out / "manifest.json").read_text())["partial"]


def test_declared_sizes_that_cannot_describe_the_run_are_rejected(analyzed, tmp_path, capsys):
    raw, _ = analyzed
    assert main(["analyze", str(raw), "-o", str(tmp_path / "out"), "-q", "--tp", "3"]) == 2
    assert "tp*pp*cp" in capsys.readouterr().err


def test_help_of_the_new_commands_via_the_module():
    for cmd in ("analyze", "align", "validate"):
        res = subprocess.run([sys.executable, "-m", "nccltrace.cli", cmd, "--help"], check=False,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert f"usage: nccltrace {cmd}" in res.stdout


def test_validate_rejects_unknown_sections(capsys):
    assert main(["validate", "--only", "alignment,speed", "-q"]) == 2
    assert "speed" in capsys.readouterr().err


def test_validate_quick_clock_prints_both_methods(capsys):
    assert main(["validate", "--quick", "--only", "clock", "-q"]) == 0
    out = capsys.readouterr().out
    assert "Clock sync" in out and "robust_wls_end" in out and "thesis_start_median" in out


@pytest.mark.slow  # 15 s alone, 40 s on a loaded machine
def test_validate_quick_alignment_prints_table_4_5(capsys, tmp_path):
    assert main(["validate", "--quick", "--only", "alignment", "-q", "--csv", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Easy 1:1" in out and "Both Drop 20%" in out and "paper NW" in out
    assert "dense_moe_A100" in out
    assert len(list(tmp_path.glob("*.csv"))) == 2


def test_trace_and_report_read_only_the_processes_and_nodes_they_are_given(analyzed, tmp_path):
    """A stage reads the paths it was given, never what else lies in the run directory: a
    damaged stray process and node beside the run's own change nothing."""
    from nccltrace.stages.report import run_report
    from nccltrace.stages.trace import run_trace

    raw, _ = analyzed
    until_volume = tmp_path / "run"
    assert main(["analyze", str(raw), "-o", str(until_volume), "-q", "--until", "volume"]) == 0
    layout = RunLayout(until_volume)
    procs, hosts = layout.find_processes(), layout.find_hosts()
    assert len(procs) == 4 and len(hosts) == 2
    for stray in (layout.parsed_nccl("nccl_ghost_1"), layout.parsed_nsys("ghost")):
        stray.mkdir(parents=True)
        for name in ("calls.parquet", "kernels.parquet", "nvtx.parquet", "session.json", "manifest.json"):
            (stray / name).write_bytes(b"not a table")
    trace = run_trace(layout, None, procs, hosts)
    report = run_report(layout, "r", procs, hosts, run_yaml=raw / "run.yaml")
    assert trace.outputs and not report.partial
    manifest = json.loads(layout.manifest(layout.trace_dir).read_text())
    assert not any("ghost" in p for p in manifest["inputs"])
    assert "ghost" not in layout.report_html.read_text()
