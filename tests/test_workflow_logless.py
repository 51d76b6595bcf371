"""The Snakemake workflow on a campaign that mixes runs captured with and without NCCL logs
(issue 34; real Snakemake, local cores, backend ``import``): the real H200 capture's
PyTorch-profiler traces alone, its Flight Recorder dumps alone, a real nsys export alone, and
one emulated run with logs.
The log-less runs' processes come from their sources (checkpoint ``sources``), each node's
parse_node job parses its process from its records and its align_node job installs the
alignment those records gave; the tables equal ``nccltrace analyze``'s on the same directory.
The campaign runs once (module fixture, about 2-4 minutes on 2 cores); the last test runs the
node stages of a run with traces and dumps without Snakemake (seconds)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from data_paths import CAPTURE, NSYS_SQLITE
from snakemake_jobs import scheduled_jobs

from nccltrace.analyze import analyze_run
from nccltrace.core.layout import METRIC_TABLES, RunLayout
from nccltrace.core.tables import read_table

REPO = Path(__file__).resolve().parents[1]
MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128, "vocab_size": 1024,
         "precision": "bf16"}
# the real capture: 4 ranks on one H200, TP 2 x PP 2; the emulated run: one node of 2 GPUs, TP 2
CAMPAIGN = {
    "campaign": "mixed",
    "defaults": {"micro_batch_size": 1, "global_batch_size": 4, "iterations": 2, "nccl_version": "2.28.9",
                 "nsys_version": "2026.4", "seed": 3},
    "hardware": {"H": {"gpu": "H200", "nodes": 1, "gpus_per_node": 4, "preset": "a40"},
                 "T": {"gpu": "T4", "nodes": 1, "gpus_per_node": 2, "preset": "a40"}},
    "matrix": [{"models": ["traces", "dumps"], "hardware": ["H"], "parallelism": [{"tp": 2, "pp": 2}]},
               {"models": ["logged", "exports"], "hardware": ["T"], "parallelism": [{"tp": 2}]}],
}
RUNS = {"traces": "traces_H200_tp2_pp2_ep1_cp1_vpp1_sp0_dp1", "dumps": "dumps_H200_tp2_pp2_ep1_cp1_vpp1_sp0_dp1",
        "logged": "logged_T4_tp2_pp1_ep1_cp1_vpp1_sp0_dp1", "exports": "exports_T4_tp2_pp1_ep1_cp1_vpp1_sp0_dp1"}
KEY = ["op", "count", "global_rank", "pg_name", "parallelism"]


def _snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(workdir / "config.yaml"), "--cores", "2", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("mixed")
    imports = {kind: work / "imports" / kind for kind in ("traces", "dumps", "exports")}
    shutil.copytree(CAPTURE / "kineto", imports["traces"] / "kineto")
    shutil.copytree(CAPTURE / "flight_recorder", imports["dumps"] / "flight_recorder")
    imports["exports"].mkdir()
    shutil.copy(NSYS_SQLITE / "nsysai_mfu_2gpu_after.sqlite", imports["exports"])
    config = {**CAMPAIGN, "models": {
        "traces": {**MODEL, "backend": "import", "import_dir": str(imports["traces"])},
        "dumps": {**MODEL, "backend": "import", "import_dir": str(imports["dumps"])},
        "exports": {**MODEL, "backend": "import", "import_dir": str(imports["exports"])},
        "logged": {**MODEL, "backend": "emulate"}}}  # fmt: skip
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    proc = _snakemake(work)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {"work": work, "imports": imports, "results": work / "results" / "mixed", "proc": proc}


def _calls(layout: RunLayout) -> pd.DataFrame:
    ops = read_table(layout.ops)
    return ops[ops["row_kind"] == "call"]


@pytest.mark.slow
def test_a_run_without_logs_is_analysed_per_node_from_its_sources(campaign):
    results = campaign["results"]
    traces, dumps = RunLayout(results / RUNS["traces"]), RunLayout(results / RUNS["dumps"])
    # traces alone: 177 calls per rank, each linked to its kernel by its record
    calls = _calls(traces)
    assert len(calls) == 708 and calls.groupby("global_rank").size().to_dict() == {0: 177, 1: 177, 2: 177, 3: 177}
    assert (calls["status"] == "matched").all() and set(calls["source"]) == {"profiler"}
    # dumps alone: 473 calls per rank, no kernel times
    calls = _calls(dumps)
    assert len(calls) == 1892 and calls.groupby("global_rank").size().to_dict() == {r: 473 for r in range(4)}
    assert (calls["status"] == "unmatched").all() and set(calls["reason"]) == {"no_export"}
    assert set(calls["source"]) == {"flight-recorder"}
    for layout, pids in ((traces, [498, 499, 500, 501]), (dumps, [0, 1, 2, 3])):
        # the processes the checkpoint listed: one per rank, host rank<R>, pid the trace's (else the rank)
        listed = json.loads(layout.source_processes.read_text())["processes"]
        assert [p["name"] for p in listed] == [f"nccl_rank{r}_{pid}" for r, pid in enumerate(pids)]
        hosts = [f"rank{r}" for r in range(4)]
        assert layout.find_processes() == [p["name"] for p in listed] and layout.find_hosts() == hosts
        # one parse_node and one align_node job per node; the aligner ran on none of them
        assert sorted(p.stem for p in (layout.root / "logs" / "parse_node").iterdir()) == hosts
        assert sorted(p.stem for p in (layout.root / "logs" / "align_node").iterdir()) == hosts
        for p in listed:
            assert json.loads(layout.manifest(layout.parsed_nccl(p["name"])).read_text())["stage"] == "parse_sources"
            assert layout.alignment(p["name"]).is_file()
            assert "not aligned" in (layout.root / "logs" / "align_node" / f"{p['host']}.log").read_text()
    # what the dumps do not record is said once, in the run's parse summary
    issues = [i["message"] for i in json.loads(dumps.parse_summary.read_text())["issues"]]
    assert sum("have no kernel trace (Flight Recorder dumps alone)" in m for m in issues) == 1
    # an nsys export alone: its 240 NCCL API calls, each linked to its kernel, no size or rank
    calls = _calls(RunLayout(results / RUNS["exports"]))
    assert len(calls) == 240 and (calls["status"] == "matched").all() and set(calls["source"]) == {"nsys-nvtx"}
    assert calls["count"].isna().all() and calls["global_rank"].isna().all()
    # the run with logs in the same campaign: no sources job, its calls aligned as before
    logged = RunLayout(results / RUNS["logged"])
    assert not (logged.root / "logs" / "sources.log").exists() and not logged.source_processes.exists()
    truth = read_table(logged.raw / "ground_truth" / "ops.parquet")
    assert len(_calls(logged)) == len(truth) and (_calls(logged)["status"] == "matched").all()
    html = (results / "campaign" / "report.html").read_text()
    assert all(run in html for run in RUNS.values())
    # done: a dry run has nothing to do
    again = _snakemake(campaign["work"], "-n")
    assert again.returncode == 0 and scheduled_jobs(again.stdout + again.stderr) == {}, again.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["traces", "dumps", "exports"])
def test_the_workflow_gives_the_tables_analyze_gives(campaign, kind, tmp_path):
    """`nccltrace analyze` on the run's raw directory writes the workflow's tables; on the
    imported directory itself, the same rows (the dumps' file names aside: the import numbers them)."""
    wf = RunLayout(campaign["results"] / RUNS[kind])
    analyze_run(wf.raw, tmp_path / "raw", progress=False, until="report")
    cli = RunLayout(tmp_path / "raw")
    pairs = [(wf.ops, cli.ops), (wf.quality, cli.quality), (wf.labels, cli.labels), (wf.volume, cli.volume),
             (wf.communicators, cli.communicators), (wf.members, cli.members),
             *((wf.metric(n), cli.metric(n)) for n in METRIC_TABLES),
             *((p, cli.report_tables / p.name) for p in sorted(wf.report_tables.glob("*.parquet")))]
    for a, b in pairs:
        x, y = read_table(a), read_table(b)
        assert list(x.columns) == list(y.columns), a.name
        pd.testing.assert_frame_equal(x.reset_index(drop=True), y.reset_index(drop=True), check_dtype=False,
                                      obj=a.name)
    analyze_run(campaign["imports"][kind], tmp_path / "import", progress=False)
    mine, theirs = (read_table(p)[KEY] for p in (wf.ops, RunLayout(tmp_path / "import").ops))
    assert len(mine) == {"traces": 708, "dumps": 1892, "exports": 242}[kind]
    pd.testing.assert_frame_equal(mine, theirs)


def test_the_node_stages_of_a_run_without_logs_write_what_analyze_writes(tmp_path):
    """Without Snakemake: the real capture's traces and dumps imported, checkpoint sources'
    stage lists one process per rank (trace and dump of a rank joined), each node's parse
    (alignment carried in its parse output) and align jobs' stages leave the alignments
    `nccltrace analyze` writes."""
    from nccltrace.acquisition.raw import import_raw
    from nccltrace.stages.sources import (
        read_source_processes,
        run_install_alignments,
        run_parse_sources_node,
        run_sources,
        source_problems,
    )

    src = tmp_path / "src"
    for part in ("kineto", "flight_recorder"):
        shutil.copytree(CAPTURE / part, src / part)
    layout = RunLayout(tmp_path / "run")
    import_raw(src, layout.raw, run_id="r", settings={"model": "m", "import_dir": str(src)})
    listed = run_sources(layout).details["processes"]
    procs, problems = read_source_processes(layout)
    assert list(procs) == [p.name for p in listed] == [f"nccl_rank{r}_{498 + r}" for r in range(4)] and not problems
    assert all(p.trace is not None and p.dump is not None and p.rank == int(p.host[4:]) for p in procs.values())
    # the listing names files inside the run's directory by relative path (the run moves as a whole)
    doc = json.loads(layout.source_processes.read_text())["processes"][0]
    assert doc["trace"]["tables"] == "inputs/kernels/kineto_rank0" and doc["dump"].startswith("raw/flight_recorder/")
    for host in sorted({p.host for p in procs.values()}):
        mine = [p for p in procs.values() if p.host == host]
        run_parse_sources_node(layout, host, mine, carry=True)
        assert not any(layout.aligned(p.name).exists() for p in mine)  # carried: align_node's output is its own
        assert all((layout.record_alignment(p.name) / "alignment.parquet").is_file() for p in mine)
        run_install_alignments(layout, host, [p.name for p in mine])
    assert source_problems(layout) == []  # traces with CPU records and dumps: sizes and times recorded
    analyze_run(layout.raw, tmp_path / "analyzed", progress=False)
    theirs = RunLayout(tmp_path / "analyzed")
    for name in procs:
        pd.testing.assert_frame_equal(read_table(layout.alignment(name)), read_table(theirs.alignment(name)))
        assert json.loads(layout.alignment_quality(name).read_text()) == json.loads(
            theirs.alignment_quality(name).read_text())
        calls = [read_table(lay.parsed_nccl_table(name, "calls")) for lay in (layout, theirs)]
        pd.testing.assert_frame_equal(*calls)
    assert sum(len(read_table(layout.alignment(n))) for n in procs) == 708
