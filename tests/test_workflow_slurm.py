"""The workflow through a real SLURM: `snakemake --profile slurm` on a one-node slurmctld+slurmd.

Only the GPU-bound commands are test doubles (tests/doubles/fake_torchrun.py, fake_nsys.py):
they write emulated NCCL logs and nsys data exactly where Megatron-LM and nsys would. Everything
else is real: sbatch/srun/squeue, the SLURM executor plugin, the node script, the export rule,
the analysis. One campaign (a good run and a run whose training crashes) goes through the
scenarios in order, because each SLURM round trip costs seconds:

1. the first invocation is SIGKILLed mid-run, its jobs are cancelled, the lock is cleared, and
   the same command finishes the campaign without redoing finished work;
2. the failed configuration is retried as configured, recorded, and reported while the other
   run is analysed completely;
3. jobs went through sbatch with the resources of the hardware profile;
4. a second invocation has nothing to do;
5. an analysis code change re-runs exactly the stages downstream of it.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from slurm_cluster import local_slurm  # noqa: F401  (session fixture)
from snakemake_jobs import scheduled_jobs

REPO = Path(__file__).resolve().parents[1]
DOUBLES = REPO / "tests" / "doubles"
GOOD = "tiny_FAKE_tp2_pp1_ep1_cp1_vpp1_sp1_dp2"
BROKEN = "tiny_crash_FAKE_tp1_pp1_ep1_cp1_vpp1_sp0_dp4"

pytestmark = [pytest.mark.system, pytest.mark.slow]


def _doubles_on_disk(bindir: Path) -> dict[str, str]:
    """Executables named like the real tools that run the doubles with this interpreter."""
    bindir.mkdir(parents=True, exist_ok=True)
    out = {}
    for tool, script in (("torchrun", "fake_torchrun.py"), ("nsys", "fake_nsys.py")):
        exe = bindir / tool
        exe.write_text(f'#!/bin/sh\n# test double, see {DOUBLES / script}\nexec "{sys.executable}" "{DOUBLES / script}" "$@"\n')
        exe.chmod(0o755)
        out[tool] = str(exe)
    return out


def _campaign(tools: dict[str, str]) -> dict:
    py = sys.executable
    tiny = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128, "vocab_size": 1024,
            "precision": "bf16"}
    return {
        "campaign": "slurmtest",
        "defaults": {"backend": "slurm", "micro_batch_size": 1, "global_batch_size": 4, "iterations": 2},
        "models": {
            "tiny": tiny,
            # crashes in training (the torchrun double exits 7): must be retried, recorded, reported
            "tiny_crash": {**tiny, "env": {"FAKE_TORCHRUN_EXIT_CODE": "7"}},
        },
        "hardware": {
            "FAKE": {"gpu": "FAKE", "nodes": 1, "gpus_per_node": 4, "partition": "local", "cpus_per_task": 1,
                     "mem_mb": 900, "runtime": 20},
        },
        "matrix": [
            {"models": ["tiny"], "hardware": ["FAKE"], "parallelism": [{"tp": 2, "sequence_parallel": True}]},
            {"models": ["tiny_crash"], "hardware": ["FAKE"], "parallelism": [{}]},
        ],
        "training": {
            "torchrun": tools["torchrun"],
            "nsys": tools["nsys"],
            "python": py,
            "retries": 1,
            "time_margin_minutes": 1,
            "env": {"NCCLTRACE_FAKE_SETTINGS": json.dumps(
                {"nccl_version": "2.21.5", "nsys_version": "2024.6", "hardware": "a100", "seed": 2,
                 "init_style": "split"})},
        },
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A copy of the workflow (so the code-change scenario can edit it) with the test campaign."""
    wd = tmp_path_factory.mktemp("slurm_workflow")
    for name in ("Snakefile", "workflow", "envs", "slurm", "src"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, wd / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, wd / name)
    shutil.copytree(REPO / "tests" / "slurm", wd / "tests" / "slurm")
    (wd / "config").mkdir()
    tools = _doubles_on_disk(wd / "doubles")
    (wd / "config" / "config.yaml").write_text(yaml.safe_dump(_campaign(tools), sort_keys=False))
    return wd


def _cmd(wd: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--profile", str(wd / "slurm"), "--profile", str(wd / "tests" / "slurm"),
            "--directory", str(wd), "--snakefile", str(wd / "Snakefile"), *extra]


def _run(wd: Path, *extra: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(wd, *extra), check=False, capture_output=True, text=True, timeout=timeout, cwd=wd)


def _cancel_all(cluster) -> None:
    subprocess.run(["scancel", "--user", "root"], check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not [j for j in cluster.jobs() if j["state"] in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING")]:
            return
        time.sleep(0.5)


@pytest.fixture(scope="module")
def first_run(workdir, local_slurm):  # noqa: F811
    """Scenario 1: SIGKILL the head once the good run's raw data exists and is parsed, then resume."""
    results = workdir / "results" / "slurmtest"
    head = subprocess.Popen(_cmd(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir)
    started = time.monotonic()
    deadline = started + 900
    marker = results / GOOD / "raw" / "status.json"
    while time.monotonic() < deadline and head.poll() is None:
        # the good run's node is parsed: its align job has started, so its parse job (one per
        # node, several processes) has finished and its outputs are recorded complete
        parsed = list((results / GOOD / "parsed").glob("nccl/*/*/parse_report.json"))
        if marker.exists() and parsed and list((results / GOOD / "aligned").glob("*")):
            break
        time.sleep(0.5)
    assert head.poll() is None, f"the head finished before it could be interrupted:\n{head.stdout.read()[-4000:]}"
    head.send_signal(signal.SIGKILL)
    head.wait()
    killed_after = time.monotonic() - started
    _cancel_all(local_slurm)  # orphaned jobs are not re-attached; cancel them before resuming
    finished_before = {p: p.stat().st_mtime_ns for p in (results / GOOD).rglob("*")
                       if p.is_file() and ("capture" in p.parts or "export" in p.parts)}
    parsed_before = {p: p.stat().st_mtime_ns for p in (results / GOOD / "parsed").rglob("parse_report.json")}
    unlock = _run(workdir, "--unlock")
    assert unlock.returncode == 0, unlock.stderr[-3000:]
    t0 = time.monotonic()
    resumed = _run(workdir)
    return {"resumed": resumed, "finished_before": finished_before, "parsed_before": parsed_before,
            "killed_after_s": killed_after, "resume_s": time.monotonic() - t0}


def test_a_killed_run_resumes_without_redoing_finished_work(first_run, workdir):
    resumed = first_run["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-6000:] + resumed.stderr[-6000:]
    assert first_run["finished_before"], "nothing had finished when the head was killed"
    for path, mtime in {**first_run["finished_before"], **first_run["parsed_before"]}.items():
        assert path.stat().st_mtime_ns == mtime, f"{path} was recomputed after the resume"
    stats = scheduled_jobs(resumed.stdout + resumed.stderr)
    assert stats.get("train", 0) <= 1  # at most the crashing run's, never the finished capture again
    assert "parse_node" not in stats, stats  # the good run's one node was parsed before the kill
    assert (workdir / "results" / "slurmtest" / "campaign" / "report.html").is_file()


def test_the_good_run_is_analysed_completely_with_provenance(first_run, workdir):
    run = workdir / "results" / "slurmtest" / GOOD
    launch = json.loads((run / "raw" / "launch" / "launch.json").read_text())
    assert launch["status"] == "ok" and launch["slurm_job_id"]
    assert "--sequence-parallel" in launch["megatron_arguments"]
    assert len(list((run / "raw" / "nccl").glob("nccl_*.log"))) == 4
    (export,) = (run / "raw" / "nsys").glob("*.sqlite")
    assert (run / "raw" / "nsys" / f"{export.stem}.nsys-rep").is_file()
    record = json.loads((run / "export" / f"{export.stem}.json").read_text())
    assert record["nsys_version"] == "2022.4.2.1" and record["nsys"].endswith("doubles/nsys")
    # raw data is protected: the capture and the exports are read-only
    assert not (run / "export" / export.name).stat().st_mode & 0o222
    for stage in ("ops", "metrics", "volume", "trace", "report"):
        manifest = json.loads((run / stage / "manifest.json").read_text())
        assert manifest["code"] and manifest["inputs"], stage
    assert (run / "report" / "report.html").is_file()
    acquire_manifest = json.loads((run / "raw" / "manifest.json").read_text())
    assert acquire_manifest["stage"] == "acquire:slurm" and not acquire_manifest["partial"]


def test_a_failing_configuration_is_retried_recorded_and_reported(first_run, workdir, local_slurm):  # noqa: F811
    results = workdir / "results" / "slurmtest"
    launch = json.loads((results / BROKEN / "raw" / "launch" / "launch.json").read_text())
    assert launch["status"] == "failed" and launch["attempt"] == 2 and launch["attempts"] == 2
    assert [h["exit_code"] for h in launch["history"]] == [7, 7]  # retried in the job, as configured
    assert "exited with code 7" in launch["reason"] and "out of memory" in launch["log_tail"]
    assert not (results / BROKEN / "report").exists()
    html = (results / "campaign" / "report.html").read_text()
    assert BROKEN in html and "exited with code 7" in html and GOOD in html


def test_training_jobs_went_through_sbatch_with_the_hardware_profile(first_run, local_slurm):  # noqa: F811
    trains = [j for j in (local_slurm.job_info(x["id"]) for x in local_slurm.jobs() if x["id"].isdigit())
              if j.get("Comment", "").startswith("rule_train")]
    assert len(trains) >= 2  # one job per run (the crashing run retries inside its job)
    for info in trains:
        assert info["Partition"] == "local"
        assert info["TimeLimit"] == "00:20:00"
        # without slurmdbd GPU requests are not in TRES; scontrol -d shows them as TresPerNode/JOB_GRES
        gres = info.get("TresPerNode", "") + " " + info.get("JOB_GRES", "")
        assert "gpu:4" in gres, info
        assert info["MinMemoryNode"] == "900M" and info["NumNodes"].startswith("1"), info
    others = [j for j in (local_slurm.job_info(x["id"]) for x in local_slurm.jobs() if x["id"].isdigit())
              if "rule_parse_node" in j.get("Comment", "")]
    assert others and all("gpu" not in j.get("TresPerNode", "") for j in others)  # analysis jobs get no GPU


def test_a_second_invocation_has_nothing_to_do(first_run, workdir):
    again = _run(workdir, "--dry-run")
    assert again.returncode == 0, again.stderr[-3000:]
    assert scheduled_jobs(again.stdout + again.stderr) == {}


def test_an_analysis_code_change_reruns_exactly_the_downstream_stages(first_run, workdir):
    metrics = workdir / "src" / "nccltrace" / "metrics" / "compute.py"
    metrics.write_text(metrics.read_text() + "\n\n_REANALYSIS_MARKER = 1  # changed by the test\n")
    capture = {p: p.stat().st_mtime_ns for p in (workdir / "results" / "slurmtest" / GOOD / "raw").rglob("*")
               if p.is_file()}
    rerun = _run(workdir)
    assert rerun.returncode == 0, rerun.stdout[-6000:] + rerun.stderr[-6000:]
    stats = scheduled_jobs(rerun.stdout + rerun.stderr)
    assert stats.get("metrics") == 1, stats
    assert not {"train", "nsys_export", "acquire", "parse_node", "align_node", "ops"} & set(stats), stats
    assert {"report", "campaign_report"} <= set(stats), stats
    for path, mtime in capture.items():
        assert path.stat().st_mtime_ns == mtime, f"{path} changed on re-analysis"
