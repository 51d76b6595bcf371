"""Smoke tests of the local one-node SLURM (tests/slurm_cluster.py) and of the Snakemake profile
pair ``slurm`` + ``tests/slurm`` on it: real sbatch, real fake-GPU GRES, real plugin polling."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import LocalSlurm, local_slurm  # noqa: F401  (session fixture)

REPO = Path(__file__).resolve().parents[1]
PROFILES = ["--profile", str(REPO / "slurm"), "--profile", str(REPO / "tests" / "slurm")]

pytestmark = [pytest.mark.system, pytest.mark.slow]


def run_snakemake(workdir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run Snakemake with both profiles on workdir (slurm-logdir logs/slurm lands under
    --directory, whatever the cwd). On timeout, SIGINT first: only SIGINT makes the plugin
    scancel its jobs."""
    cmd = [sys.executable, "-m", "snakemake", *PROFILES, "--directory", str(workdir), *args]
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"snakemake did not finish in {timeout} s:\n{out[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_jobs(cluster: LocalSlurm, output: str) -> dict[str, dict[str, str]]:
    """job_info of every SLURM job of the Snakemake run that printed output, keyed by rule
    (the plugin's --comment is rule_<rule>); a rule submitted twice keeps its last job."""
    run_id = re.search(r"SLURM run ID: (\S+)", output).group(1)
    return {info["Comment"].removeprefix("rule_"): info for info in cluster.jobs_by_name(run_id)}


def test_start_is_idempotent(local_slurm):  # noqa: F811
    again = LocalSlurm(gpus=local_slurm.gpus).start()
    assert again.reused, "a second start() with the same configuration must reuse the daemons"
    assert again.running()


def test_sbatch_gpus_get_cuda_visible_devices(local_slurm, tmp_path):  # noqa: F811
    out = tmp_path / "job.out"
    job_id = local_slurm.sbatch(
        "--gpus=2", "--mem=100", "--time=2", f"--output={out}",
        "--wrap", "echo CVD=$CUDA_VISIBLE_DEVICES; echo JOB_GPUS=$SLURM_JOB_GPUS",
        cwd=tmp_path,
    )
    info = local_slurm.wait_job(job_id, timeout=60)
    assert info["JobState"] == "COMPLETED", info
    lines = out.read_text().split()
    assert "CVD=0,1" in lines and "JOB_GPUS=0,1" in lines, lines
    assert info["Partition"] == local_slurm.partition
    # Without slurmdbd, TRES= cannot list gres/gpu (AccountingStorageTRES=gres/gpu makes
    # slurmctld refuse to start); the GPU request shows in TresPerJob and JOB_GRES (-d).
    assert info["TresPerJob"] in ("gres:gpu:2", "gres/gpu:2"), info["TresPerJob"]
    assert info["JOB_GRES"] == "gpu:2"
    assert info["TimeLimit"] == "00:02:00"
    assert info["MinMemoryNode"] == "100M"


WORKFLOW = """\
rule all:
    input: "gpu.txt", "cpu.txt"

rule gpu:
    output: "gpu.txt"
    resources: gpu=2, cpus_per_task=1, mem_mb=500
    shell: "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES SLURM_JOB_ID=$SLURM_JOB_ID > {output}"

rule cpu:
    output: "cpu.txt"
    shell: "echo ok > {output}"
"""


def test_workflow_through_sbatch(local_slurm, tmp_path):  # noqa: F811
    (tmp_path / "Snakefile").write_text(WORKFLOW)
    t0 = time.monotonic()
    res = run_snakemake(tmp_path)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, res.stdout[-5000:]
    print(f"two-job workflow under SLURM: {elapsed:.1f} s")

    jobs = run_jobs(local_slurm, res.stdout)
    assert set(jobs) == {"gpu", "cpu"}, jobs.keys()  # `all` has no shell: runs in the head
    gpu, cpu = jobs["gpu"], jobs["cpu"]
    assert (tmp_path / "gpu.txt").read_text().split() == [
        "CUDA_VISIBLE_DEVICES=0,1", f"SLURM_JOB_ID={gpu['JobId']}"
    ]
    for info in jobs.values():
        assert info["JobState"] == "COMPLETED"
        assert info["Partition"] == "local"  # tests/slurm default-resources
        assert info["TimeLimit"] == "01:00:00"  # runtime: 60
        assert info["CPUs/Task"] == "1"
        # one SLURM log per job, under the workdir (slurm-logdir: logs/slurm), kept on success
        log = tmp_path / "logs" / "slurm" / f"rule_{info['Comment'][5:]}" / f"{info['JobId']}.log"
        assert log.is_file(), log
    assert gpu["JOB_GRES"] == "gpu:2" and gpu["TresPerJob"] in ("gres:gpu:2", "gres/gpu:2")
    assert gpu["MinMemoryNode"] == "500M"  # rule's mem_mb beats the default
    assert cpu["MinMemoryNode"] == "1000M"  # tests/slurm default mem_mb
    assert cpu["JOB_GRES"] == "(null)"


FAILING = """\
rule all:
    input: "good.txt", "bad.txt"

rule good:
    output: "good.txt"
    shell: "echo ok > {output}"

rule bad:
    output: "bad.txt"
    shell: "echo failing on purpose >&2; exit 3"
"""


def test_failing_rule_keep_going(local_slurm, tmp_path):  # noqa: F811
    (tmp_path / "Snakefile").write_text(FAILING)
    t0 = time.monotonic()
    res = run_snakemake(tmp_path, "--keep-going")
    elapsed = time.monotonic() - t0
    print(f"failing workflow under SLURM: {elapsed:.1f} s")
    assert res.returncode != 0, res.stdout[-5000:]
    assert (tmp_path / "good.txt").read_text() == "ok\n"
    assert not (tmp_path / "bad.txt").exists()
    jobs = run_jobs(local_slurm, res.stdout)
    assert jobs["good"]["JobState"] == "COMPLETED"
    assert jobs["bad"]["JobState"] == "FAILED"
    assert "SLURM status is: 'FAILED'" in res.stdout
    # show-failed-logs prints the SLURM log, which holds the rule's stderr
    bad_log = tmp_path / "logs" / "slurm" / "rule_bad" / f"{jobs['bad']['JobId']}.log"
    assert "failing on purpose" in bad_log.read_text()
