"""Launch one Megatron-LM training run under Nsight Systems with NCCL logging (backend ``slurm``).

The workflow's ``train`` rule runs :func:`run_training` inside the run's SLURM allocation: it
renders the per-node script (``templates/launch_node.sh.j2``, the thesis's launch settings),
starts it once per node with ``srun`` and leaves a *capture directory*. A failed training run is
retried, and after the last attempt the failure itself is recorded, so that the other
configurations and the campaign report go on; everything is written under a ``.partial`` name
first, so a killed job never leaves a capture that looks finished. The capture directory's
layout: ``docs/architecture.md``, Module notes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nccltrace import __version__
from nccltrace.acquisition.megatron import launch_problems, megatron_arguments
from nccltrace.core.capture_window import NSYS_CAPTURE_RANGE_ARGS, CaptureWindow

MIN_TRAINING_BUDGET_S = 60.0  # never give a training run less, whatever the margin
DEFAULT_NCCL_SUBSYS = "INIT,COLL,P2P,TUNING,GRAPH,ENV"
# Environment variables worth recording (never secrets: only these prefixes are kept).
_RECORDED_ENV = ("NCCL_", "CUDA_", "SLURM_JOB", "SLURM_NNODES", "SLURM_NODELIST", "SLURM_GPUS", "TORCH_",
                 "OMP_NUM_THREADS", "NVTE_")  # fmt: skip


class LaunchError(RuntimeError):
    """A run that cannot be launched (configuration, environment, missing tools)."""


@dataclass
class TrainingSetup:
    """The campaign's ``training:`` section: where Megatron-LM and the tools are, and how the
    training environment is entered (conda env, container, or setup lines such as ``module load``)."""

    megatron_path: str | None = None  # checkout; its commit is recorded (and checked when pinned)
    megatron_commit: str | None = None
    pretrain_script: str | None = None
    conda: str | None = None
    container: dict[str, Any] | None = None
    setup: list[str] = field(default_factory=list)
    python: str = "python"
    torchrun: str = "torchrun"
    nsys: str = "nsys"
    srun: str = "srun"
    master_port: int = 29500
    nccl_debug_subsys: str = DEFAULT_NCCL_SUBSYS
    nsys_profile_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    dataset: dict[str, Any] = field(default_factory=dict)
    time_margin_minutes: float = 5.0
    retries: int = 1  # extra attempts of a failed training, in the same job

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> TrainingSetup:
        s = dict(section or {})
        meg = dict(s.pop("megatron", {}) or {})
        environment = dict(s.pop("environment", {}) or {})
        out = cls(
            megatron_path=meg.get("path"), megatron_commit=meg.get("commit"), pretrain_script=meg.get("pretrain_script"),
            conda=environment.get("conda"), container=environment.get("container"),
            setup=list(environment.get("setup", [])),
        )  # fmt: skip
        for key, value in s.items():
            if not hasattr(out, key):
                raise LaunchError(f"training.{key}: unknown option")
            setattr(out, key, value)
        out.env = {str(k): str(v) for k, v in (out.env or {}).items()}
        return out

    @property
    def script(self) -> str:
        if self.pretrain_script:
            return self.pretrain_script
        if self.megatron_path:
            return str(Path(self.megatron_path) / "pretrain_gpt.py")
        return "pretrain_gpt.py"


def _q(value: Any) -> str:
    return shlex.quote(str(value))


def _dq(value: Any) -> str:
    """Double-quoted for bash, so that $VARIABLES expand (e.g. $CONDA_PREFIX); quotes, backslashes
    and backticks are escaped."""
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")
    return f'"{text}"'


def _cmd(command: str) -> str:
    """A configured command (may carry arguments, e.g. 'python /opt/x/torchrun.py'), shell-quoted."""
    return " ".join(_q(a) for a in shlex.split(command))


def render_node_script(run_id: str, settings: Mapping[str, Any], setup: TrainingSetup, capture: Path) -> str:
    """The bash script every node of the run executes (see the module docstring)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("nccltrace.acquisition", "templates"), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)  # fmt: skip
    env.filters["q"] = _q
    env.filters["dq"] = _dq
    run_env = {**setup.env, **{str(k): str(v) for k, v in (settings.get("env") or {}).items()}}
    capture_args: list[str] = []
    if CaptureWindow.of_settings(settings) is not None:
        own = [a for a in setup.nsys_profile_args if a.startswith(("--capture-range", "-c"))]
        if own:
            raise LaunchError(f"training.nsys_profile_args: {own} conflicts with the run's capture setting, which "
                              f"adds {' '.join(NSYS_CAPTURE_RANGE_ARGS)}; remove them")
        capture_args = list(NSYS_CAPTURE_RANGE_ARGS)
    return env.get_template("launch_node.sh.j2").render(
        run_id=run_id, version=__version__, capture=str(capture), nodes=int(settings["nodes"]),
        gpus_per_node=int(settings["gpus_per_node"]), master_port=int(setup.master_port),
        setup=setup.setup, conda=setup.conda, python=_cmd(setup.python), nsys=_cmd(setup.nsys),
        torchrun=_cmd(setup.torchrun),
        megatron_path=setup.megatron_path, megatron_commit=setup.megatron_commit, pretrain_script=setup.script,
        nccl_debug_subsys=setup.nccl_debug_subsys, env=run_env,
        nsys_profile_args=capture_args + list(setup.nsys_profile_args),
        megatron_args=megatron_arguments(settings, dataset=setup.dataset),
    )  # fmt: skip


def node_command(settings: Mapping[str, Any], setup: TrainingSetup, script: Path, *, in_slurm: bool) -> list[str]:
    """How the node script is started: one task per node with srun inside an allocation (SLURM
    sets SLURM_NODEID and the node list again inside each task), directly for a single node
    outside SLURM; wrapped in the container runtime when one is configured."""
    nodes = int(settings["nodes"])
    body = ["bash", str(script)]
    c = dict(setup.container or {})
    mounts = [str(p) for p in c.get("mounts", [])] + [str(script.parent.parent.parent)]
    if c.get("runtime") == "apptainer":
        body = ["apptainer", "exec", "--nv", *[a for m in mounts for a in ("--bind", m)], str(c["image"]), *body]
    if not in_slurm:
        if nodes > 1:
            raise LaunchError(f"a {nodes}-node run needs a SLURM allocation; run the workflow with --profile slurm")
        if c.get("runtime") == "pyxis":
            raise LaunchError("container runtime 'pyxis' needs SLURM (srun --container-image)")
        return body
    cmd = [setup.srun, f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if c.get("runtime") == "pyxis":
        cmd += [f"--container-image={c['image']}", f"--container-mounts={','.join(mounts)}"]
    return cmd + body


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _slurm_job(job_id: str | None) -> dict[str, str]:
    """``scontrol show job -o`` as key/value pairs (nodes, partition, TRES, time limit)."""
    if not job_id or not shutil.which("scontrol"):
        return {}
    try:
        text = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                              timeout=30, check=True).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return {}
    out = {}
    for tok in text.split():
        key, sep, value = tok.partition("=")
        if sep:
            out[key] = value
    return out


def check_capture(capture: Path, settings: Mapping[str, Any]) -> list[str]:
    """What is missing from a finished capture: one NCCL log per rank, one nsys report per node
    (with a rank subset: per node with a profiled rank; nsys writes none for the others)."""
    problems = []
    gpn = int(settings["gpus_per_node"])
    world = int(settings["nodes"]) * gpn
    logs = sorted((capture / "nccl").glob("nccl_*.log"))
    if len(logs) < world:
        problems.append(f"{len(logs)} NCCL logs for {world} ranks in {capture / 'nccl'} (NCCL_DEBUG_FILE)")
    reports = sorted(p for p in (capture / "nsys").glob("*") if p.suffix in (".nsys-rep", ".qdrep", ".qdstrm"))
    window = CaptureWindow.of_settings(settings)
    nodes = int(settings["nodes"]) if window is None else len(window.profiled_nodes(world, gpn))
    if len(reports) < nodes:
        what = "nodes" if window is None else "nodes with a profiled rank"
        problems.append(f"{len(reports)} nsys reports for {nodes} {what} in {capture / 'nsys'}")
    empty = [p.name for p in [*logs, *reports] if p.stat().st_size == 0]
    if empty:
        problems.append(f"empty files: {', '.join(empty[:5])}")
    return problems


def _attempt(cmd: list[str], console: Path, budget_s: float) -> tuple[str, str | None, int | None]:
    """One training attempt: (status, reason, exit code). A run past its budget is stopped."""
    with open(console, "w") as out:
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            raise LaunchError(f"cannot start {cmd[0]!r}: {exc}") from None
        try:
            code = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            # Stop the whole process group (srun forwards the signal to every node's tasks).
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return "failed", f"time limit: training ran longer than {budget_s / 60:.1f} min and was stopped", proc.returncode
    if code != 0:
        return "failed", f"training exited with code {code}", code
    return "ok", None, code


def run_training(
    run_id: str,
    settings: Mapping[str, Any],
    setup: TrainingSetup,
    capture: Path | str,
    *,
    runtime_minutes: float,
) -> dict[str, Any]:
    """Run one training configuration and leave its capture directory (module docstring).

    A failed or hung training is retried ``setup.retries`` times inside the same job while
    time is left; every attempt is in the record's ``history``. After the last attempt a
    failure is recorded (``status: failed``, reason, log tail) and returned, not raised, so
    the other configurations and the campaign report go on. ``runtime_minutes`` is the job's
    time limit: training stops ``setup.time_margin_minutes`` before it, so a hang is recorded
    by us rather than killed by SLURM without a trace. (Failures of the job itself, such as a
    node failure, are Snakemake's to retry: ``retries`` in the profile.) Raises
    :class:`LaunchError` only for a configuration that cannot be launched.
    """
    problems = launch_problems(settings)
    if problems:
        raise LaunchError(f"run {run_id} cannot be launched:\n  " + "\n  ".join(problems))
    capture = Path(capture)
    partial = capture.with_name(capture.name + ".partial")
    job_id = os.environ.get("SLURM_JOB_ID")
    deadline = time.monotonic() + (float(runtime_minutes) - float(setup.time_margin_minutes)) * 60.0
    attempts = 1 + max(0, int(setup.retries))
    history: list[dict[str, Any]] = []
    t0 = time.time()
    for attempt in range(1, attempts + 1):
        budget_s = max(MIN_TRAINING_BUDGET_S, deadline - time.monotonic())
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "launch").mkdir(parents=True)
        script = partial / "launch" / "launch_node.sh"
        # NCCL and nsys write straight into the partial tree, which is renamed as a whole.
        script.write_text(render_node_script(run_id, settings, setup, partial))
        script.chmod(0o755)
        cmd = node_command(settings, setup, script, in_slurm=bool(job_id))
        console = partial / "launch" / "launcher.log"
        t_attempt = time.time()
        status, reason, exit_code = _attempt(cmd, console, budget_s)
        if status == "ok":
            missing = check_capture(partial, settings)
            if missing:
                status, reason = "failed", "incomplete capture: " + "; ".join(missing)
        history.append({"attempt": attempt, "status": status, "reason": reason, "exit_code": exit_code,
                        "wall_s": round(time.time() - t_attempt, 3), "log_tail": _tail(console, 10)})  # fmt: skip
        if status == "ok" or deadline - time.monotonic() < MIN_TRAINING_BUDGET_S:
            break
        print(f"[nccltrace] {run_id} attempt {attempt}/{attempts}: {reason}; retrying", flush=True)
    record: dict[str, Any] = {
        "run": run_id, "backend": "slurm", "nccltrace_version": __version__, "status": status, "reason": reason,
        "exit_code": exit_code, "attempt": len(history), "attempts": attempts, "history": history,
        "command": cmd, "node_script": "launch/launch_node.sh",
        "megatron_arguments": megatron_arguments(settings, dataset=setup.dataset),
        "submit_host": socket.gethostname(), "slurm_job_id": job_id, "slurm_job": _slurm_job(job_id),
        "environment": {k: v for k, v in os.environ.items() if k.startswith(_RECORDED_ENV)},
        "time_budget_s": round(budget_s, 1), "wall_s": round(time.time() - t0, 3), "settings": dict(settings),
        "versions": {p.stem.removeprefix("versions_"): _read_env_file(p)
                     for p in sorted((partial / "launch").glob("versions_*.env"))},
        "log_tail": _tail(console) if status != "ok" else None,
    }  # fmt: skip
    (partial / "launch" / "launch.json").write_text(json.dumps(record, indent=2, default=str))
    shutil.rmtree(capture, ignore_errors=True)
    os.replace(partial, capture)
    return record


def parse_minutes(value: Any) -> float:
    """A SLURM-style time limit in minutes: 90, "90", "2h", "30m", "1:30:00", "1-00:00:00"."""
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip().lower()
    if text.endswith("h"):
        return float(text[:-1]) * 60
    if text.endswith("m"):
        return float(text[:-1])
    days = 0.0
    if "-" in text:
        d, text = text.split("-", 1)
        days = float(d)
    parts = [float(p) for p in text.split(":")]
    if len(parts) == 1:
        minutes = parts[0]
    elif len(parts) == 2:  # minutes:seconds, as SLURM reads it
        minutes = parts[0] + parts[1] / 60
    else:
        minutes = parts[0] * 60 + parts[1] + parts[2] / 60
    return days * 1440 + minutes
