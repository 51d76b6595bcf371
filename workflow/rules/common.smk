# Shared helpers: campaign expansion (validated above), paths, input functions.
import json
from pathlib import Path

from nccltrace.campaign import expand_campaign
from nccltrace.nccl.log_reader import TABLE_NAMES as NCCL_TABLES
from nccltrace.provenance import stage_code_hash

RUNS = {run.run_id: run for run in expand_campaign(config)}
RUN_IDS = sorted(RUNS)
RESULTS = f"results/{config['campaign']}"
NSYS_TABLES = ["kernels", "nvtx", "processes", "launches_without_kernel"]


wildcard_constraints:
    run="[A-Za-z0-9_.-]+",
    proc="nccl_[A-Za-z0-9_.-]+",
    host="[A-Za-z0-9_.-]+",


def run_settings(wildcards):
    """Resolved settings of a run (emulator/launch parameters)."""
    return RUNS[wildcards.run].settings


def raw_dir(wildcards):
    return checkpoints.acquire.get(run=wildcards.run).output.raw


def processes_of(run):
    """Per-process NCCL logs of a run; known once acquisition has finished (checkpoint)."""
    raw = Path(checkpoints.acquire.get(run=run).output.raw)
    return sorted(p.stem for p in (raw / "nccl").glob("nccl_*.log"))


def nccl_processes(wildcards):
    return processes_of(wildcards.run)


def aligned_outputs(wildcards):
    """Alignment tables of every process of every run (rule all)."""
    return [f"{RESULTS}/{run}/aligned/{proc}/alignment.parquet" for run in RUN_IDS for proc in processes_of(run)]


def nsys_hosts_of(run):
    raw = Path(checkpoints.acquire.get(run=run).output.raw)
    return sorted(p.stem for p in (raw / "nsys").glob("*.sqlite"))


def nsys_hosts(wildcards):
    raw = Path(raw_dir(wildcards))
    return sorted(p.stem for p in (raw / "nsys").glob("*.sqlite"))


def parsed_outputs(wildcards):
    """Everything the per-process and per-node parse jobs produce for one run."""
    out = [
        f"{RESULTS}/{wildcards.run}/parsed/nccl/{proc}/parse_report.json"
        for proc in nccl_processes(wildcards)
    ]
    out += [
        f"{RESULTS}/{wildcards.run}/parsed/nsys/{host}/session.json"
        for host in nsys_hosts(wildcards)
    ]
    return out


def proc_host(wildcards):
    """Host of a per-process log named nccl_<host>_<pid>."""
    from nccltrace.align.correlate import process_key

    return process_key(wildcards.proc)[0]
