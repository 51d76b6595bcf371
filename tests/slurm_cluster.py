"""A real one-node SLURM (22.05, Debian 12) on localhost for system tests, without systemd.

Recipe: the team's Snakemake/SLURM notes (snakemake-slurm.md, section 3; not in this repository).
The cluster has one node ``localhost`` in the partition ``local`` with the machine's CPUs and memory (from
``slurmd -C``) and 4 fake GPUs (character devices 195:N under /run/fakegpu), so ``--gpus=N``
gives real ``CUDA_VISIBLE_DEVICES`` plumbing but no CUDA. No slurmdbd: ``sacct`` does not work,
jobs stay visible in ``squeue --states=all`` / ``scontrol show job`` for an hour (MinJobAge).

Use from a test module::

    from slurm_cluster import local_slurm  # noqa: F401  (session fixture)

    def test_x(local_slurm): ...

``ensure_installed()`` apt-installs slurmctld, slurmd, slurm-client and munge when missing
(needs root and Debian/Ubuntu apt). ``LocalSlurm.start()`` reuses daemons that an earlier
session left running when their configuration is unchanged (``reused`` is then True), else
restarts both with a clean job table (``slurmctld -c``). Without root or Linux the fixture
fails, or skips if NCCLTRACE_ALLOW_SKIP_SLURM=1.

Daemon logs: /var/log/slurm/{slurmctld,slurmd}.log (``LocalSlurm.diagnostics()`` tails them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import pytest

SKIP_ENV = "NCCLTRACE_ALLOW_SKIP_SLURM"
APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
REQUIRED_PROGRAMS = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scontrol", "munged")

ETC = Path("/etc/slurm")
RUN = Path("/run/slurm")
LOG = Path("/var/log/slurm")
SPOOL_CTLD = Path("/var/spool/slurmctld")
SPOOL_D = Path("/var/spool/slurmd")
FAKE_GPU_DIR = Path("/run/fakegpu")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN = Path("/run/munge")
MUNGE_PID = MUNGE_RUN / "munged.pid"

# MinJobAge: finished jobs stay in slurmctld's memory this long. The Snakemake plugin's squeue
# status mode needs it >= 3 x slurm-init-seconds-before-status-checks and far above its 180 s
# maximum poll interval (a job purged from squeue counts as running forever).
MIN_JOB_AGE = 3600


class SlurmSetupError(RuntimeError):
    """Installing or starting the local SLURM failed (message says what to look at)."""


def _env(**extra: str) -> dict[str, str]:
    """os.environ with the sbin directories on PATH (daemons live there; a non-login root shell
    may lack them)."""
    path = os.environ.get("PATH", "").split(os.pathsep)
    path += [d for d in ("/usr/local/sbin", "/usr/sbin", "/sbin") if d not in path]
    return dict(os.environ, PATH=os.pathsep.join(path), **extra)


def _run(cmd, *, check=True, timeout=60, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("env", _env())
    return subprocess.run(cmd, check=check, timeout=timeout, text=True, capture_output=True, **kw)


def _missing_programs() -> list[str]:
    path = _env()["PATH"]
    return [p for p in REQUIRED_PROGRAMS if shutil.which(p, path=path) is None]


def ensure_installed() -> None:
    """Install SLURM and munge from apt if any of their programs is missing (no-op otherwise)."""
    if not _missing_programs():
        return
    env = _env(DEBIAN_FRONTEND="noninteractive")
    commands = [
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES],
    ]
    for cmd in commands:
        try:
            proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmSetupError(f"`{' '.join(cmd)}` could not run: {exc}") from exc
        if proc.returncode != 0:
            raise SlurmSetupError(
                f"`{' '.join(cmd)}` failed with exit code {proc.returncode} (needs root and apt):\n"
                f"{(proc.stdout + proc.stderr)[-3000:]}"
            )
    # Debian's postinst cannot start services without an init system: harmless, we start them.
    missing = _missing_programs()
    if missing:
        raise SlurmSetupError(f"after apt-get install still missing: {', '.join(missing)}")


def _pid_alive(pid_file: Path, name: str) -> int | None:
    """The pid in pid_file if that process is alive and its command name starts with name."""
    try:
        pid = int(pid_file.read_text().split()[0])
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError, IndexError):
        return None
    # /proc/<pid>/stat of a zombie still exists: treat it as dead
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return pid if comm.startswith(name[:15]) and state != "Z" else None


def _kill_and_wait(pid_file: Path, name: str, timeout: float = 20.0) -> None:
    pid = _pid_alive(pid_file, name)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _pid_alive(pid_file, name) != pid:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _pid_alive(pid_file, name) == pid:
        time.sleep(0.1)


def parse_key_values(line: str) -> dict[str, str]:
    """``Key=value Key2=value two ...`` (scontrol -o output) to a dict; values may hold spaces."""
    starts = list(re.finditer(r"(?:^|(?<=\s))([A-Za-z][\w:/.\-]*)=", line))
    out: dict[str, str] = {}
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


def parse_tres(tres: str) -> dict[str, str]:
    """``cpu=1,mem=1000M,node=1,billing=1,gres/gpu=2`` to a dict."""
    return dict(item.split("=", 1) for item in tres.split(",") if "=" in item)


class LocalSlurm:
    """One-node SLURM on localhost; ``with LocalSlurm() as s:`` or ``start()``/``stop()``."""

    cluster_name = "localcluster"
    node = "localhost"
    partition = "local"

    def __init__(self, gpus: int = 4) -> None:
        self.gpus = gpus
        self.gpu_files = [FAKE_GPU_DIR / f"nvidia{i}" for i in range(gpus)]
        self.reused = False  # True when start() found daemons running with this configuration
        self._started_munged = False

    # ----- configuration -------------------------------------------------------------------
    def _hardware(self) -> str:
        first = _run(["slurmd", "-C"]).stdout.splitlines()[0]
        # "NodeName=vm CPUs=2 Boards=1 ... RealMemory=24105": keep everything but NodeName
        return " ".join(w for w in first.split() if not w.startswith("NodeName="))

    def config_files(self) -> dict[Path, str]:
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        slurm_conf = f"""\
# Written by tests/slurm_cluster.py: one-node test cluster, no systemd, no slurmdbd.
ClusterName={self.cluster_name}
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={LOG}/jobcomp.log
MinJobAge={MIN_JOB_AGE}
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
StateSaveLocation={SPOOL_CTLD}
SlurmdSpoolDir={SPOOL_D}
SlurmctldPidFile={RUN}/slurmctld.pid
SlurmdPidFile={RUN}/slurmd.pid
SlurmctldLogFile={LOG}/slurmctld.log
SlurmdLogFile={LOG}/slurmd.log
{"GresTypes=gpu" if self.gpus else ""}
NodeName={self.node} {self._hardware()}{gres} State=UNKNOWN
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        # slurmd 22.05 always loads a cgroup plugin; v1 with automount off touches nothing,
        # while autodetection on a cgroup-v2 host picks v2, which needs systemd/dbus.
        cgroup_conf = "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n"
        # Debian's SLURM has no NVML: every GPU needs File=, else the node goes INVAL.
        gres_conf = "".join(f"NodeName={self.node} Name=gpu File={f}\n" for f in self.gpu_files)
        return {ETC / "slurm.conf": slurm_conf, ETC / "cgroup.conf": cgroup_conf, ETC / "gres.conf": gres_conf}

    def _write_configs(self) -> bool:
        """Write the config files; True if any changed."""
        changed = False
        for path, text in self.config_files().items():
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                changed = True
        return changed

    def _make_fake_gpus(self) -> None:
        FAKE_GPU_DIR.mkdir(parents=True, exist_ok=True)
        for minor, path in enumerate(self.gpu_files):
            if path.exists() and path.is_char_device():
                continue
            path.unlink(missing_ok=True)
            try:
                os.mknod(path, 0o666 | 0o020000, os.makedev(195, minor))  # S_IFCHR, like /dev/nvidiaN
            except OSError as exc:
                raise SlurmSetupError(f"mknod {path} c 195 {minor} failed (needs CAP_MKNOD): {exc}") from exc

    # ----- daemons -------------------------------------------------------------------------
    def _pids(self) -> dict[str, int | None]:
        return {
            "munged": _pid_alive(MUNGE_PID, "munged"),
            "slurmctld": _pid_alive(RUN / "slurmctld.pid", "slurmctld"),
            "slurmd": _pid_alive(RUN / "slurmd.pid", "slurmd"),
        }

    def _daemon(self, cmd: list[str], name: str, pid_file: Path) -> None:
        """Start a self-daemonizing program and wait for its pid file (written after the fork,
        so a moment later); early stderr goes to /var/log/slurm/<name>.start."""
        pid_file.unlink(missing_ok=True)
        out = LOG / f"{name}.start"
        with open(out, "w") as fh:
            proc = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, start_new_session=True, timeout=60, env=_env(),
                check=False,
            )
        if proc.returncode != 0:
            raise SlurmSetupError(f"`{' '.join(cmd)}` exited {proc.returncode}: {out.read_text()[-2000:]}")
        deadline = time.monotonic() + 15
        while _pid_alive(pid_file, name) is None:
            if time.monotonic() > deadline:
                raise SlurmSetupError(f"`{' '.join(cmd)}` wrote no live pid to {pid_file}:\n{self.diagnostics()}")
            time.sleep(0.05)

    def _start_munge(self) -> None:
        dirs = (MUNGE_KEY.parent, MUNGE_RUN, Path("/var/log/munge"), Path("/var/lib/munge"))
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        if not MUNGE_KEY.exists() or MUNGE_KEY.stat().st_size == 0:
            proc = _run(["mungekey", "--create", "--keyfile", str(MUNGE_KEY), "--force"], check=False)
            if proc.returncode != 0:
                raise SlurmSetupError(f"mungekey --create failed: {proc.stderr}")
        for d in dirs:
            _run(["chown", "-R", "munge:munge", str(d)])
        MUNGE_KEY.chmod(0o400)
        if _pid_alive(MUNGE_PID, "munged") is None:
            self._daemon(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], "munged", MUNGE_PID)
            self._started_munged = True
        deadline = time.monotonic() + 10
        while True:
            enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10, env=_env(), check=False)
            dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=10, env=_env(), check=False)
            if enc.returncode == 0 and dec.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise SlurmSetupError(f"munge does not work: {enc.stderr.decode()[-500:]}")
            time.sleep(0.2)

    def running(self) -> bool:
        pids = self._pids()
        return pids["slurmctld"] is not None and pids["slurmd"] is not None

    def start(self, timeout: float = 60.0) -> Self:
        ensure_installed()
        for d in (ETC, RUN, LOG, SPOOL_CTLD, SPOOL_D):
            d.mkdir(parents=True, exist_ok=True)
        self._make_fake_gpus()
        self._start_munge()
        changed = self._write_configs()
        pids = self._pids()
        if changed or not (pids["slurmctld"] and pids["slurmd"]):
            # Restart both: a lone survivor may hold an older configuration.
            self._stop_slurm()
            # -c: forget all earlier jobs. A slurmctld killed hard (-9, container stop) can
            # recover a finished job as RUNNING that holds the node forever; its slurmstepds,
            # if any, are killed when slurmd registers them as unknown jobs.
            self._daemon(["slurmctld", "-c"], "slurmctld", RUN / "slurmctld.pid")
            self._daemon(["slurmd", "-N", self.node], "slurmd", RUN / "slurmd.pid")
            self.reused = False
        else:
            self.reused = True
        self._wait_ready(timeout)
        return self

    def _node_state(self) -> str:
        proc = _run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"], check=False, timeout=15)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            if not self.running():
                raise SlurmSetupError(f"a SLURM daemon died at start:\n{self.diagnostics()}")
            state = self._node_state()
            if state in ("idle", "mixed", "allocated"):
                break
            if state.startswith(("drain", "inval", "down")):
                _run(["scontrol", "update", f"nodename={self.node}", "state=resume"], check=False)
            time.sleep(0.5)
        else:
            raise SlurmSetupError(f"node {self.node} not idle after {timeout:.0f} s (state {state!r}):\n{self.diagnostics()}")
        # A first srun can fail once after a restart with -c: job ids start again at the old
        # ones, and a job id that a surviving batch step of the old run still holds gets
        # "Job credential revoked" (slurmctld then kills that orphan). Retry until the deadline.
        cmd = ["srun", "-n1", "-p", self.partition, "--mem=10", "--time=1", "true"]
        while True:
            try:
                proc = _run(cmd, check=False, timeout=max(10.0, deadline - time.monotonic() + 30), cwd="/tmp")
            except subprocess.TimeoutExpired:
                raise SlurmSetupError(f"`{' '.join(cmd)}` hangs (node busy?):\n{self.diagnostics()}") from None
            if proc.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise SlurmSetupError(f"`{' '.join(cmd)}` failed: {proc.stderr}\n{self.diagnostics()}")
            time.sleep(1)

    def diagnostics(self) -> str:
        parts = []
        for name in ("slurmctld.start", "slurmd.start", "slurmctld.log", "slurmd.log"):
            p = LOG / name
            if p.exists():
                parts.append(f"--- {p} (tail)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:]))
        for cmd in (["scontrol", "show", "node", self.node], ["squeue", "--states=all"]):
            try:
                proc = _run(cmd, check=False, timeout=15)
                parts.append(f"--- {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
            except subprocess.TimeoutExpired:
                parts.append(f"--- {' '.join(cmd)}: timed out")
        return "\n".join(parts)

    def _stop_slurm(self) -> None:
        _kill_and_wait(RUN / "slurmd.pid", "slurmd")
        _kill_and_wait(RUN / "slurmctld.pid", "slurmctld")

    def stop(self) -> None:
        """Stop slurmd and slurmctld (and munged if this object started it); waits for exit."""
        self._stop_slurm()
        if self._started_munged:
            _kill_and_wait(MUNGE_PID, "munged")
            self._started_munged = False

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- queries -------------------------------------------------------------------------
    def job_info(self, job_id: int | str) -> dict[str, str]:
        """``scontrol -d -o show job <id>`` as a dict: JobState, ExitCode, Partition, TimeLimit
        ("01:00:00"), CPUs/Task, MinMemoryNode ("500M"), TRES ("cpu=1,mem=500M,node=1,billing=1",
        see parse_tres), Comment, StdOut... GPUs: TresPerJob ("gres:gpu:2") and JOB_GRES ("gpu:2",
        "(null)" without); TRES never lists gres/gpu here (AccountingStorageTRES=gres/gpu makes
        slurmctld refuse to start without slurmdbd)."""
        out = _run(["scontrol", "-d", "-o", "show", "job", str(job_id)], timeout=15).stdout.strip()
        return parse_key_values(out.splitlines()[0])

    def jobs(self) -> list[dict[str, str]]:
        """All jobs slurmctld still knows (``squeue --states=all``): id, name, state, partition."""
        out = _run(["squeue", "--states=all", "--noheader", "--format=%i|%j|%T|%P"], timeout=15).stdout
        keys = ("id", "name", "state", "partition")
        return [dict(zip(keys, line.split("|", 3))) for line in out.splitlines() if line.strip()]

    def jobs_by_name(self, name: str) -> list[dict[str, str]]:
        """``job_info`` of every job named ``name`` (Snakemake names all jobs of a run by its
        run uuid; its ``Comment`` is ``rule_<rule>[_wildcards_<...>]``), oldest first."""
        ids = sorted(int(j["id"]) for j in self.jobs() if j["name"] == name and j["id"].isdigit())
        return [self.job_info(i) for i in ids]

    def sbatch(self, *args: str, cwd: str | Path = "/tmp") -> int:
        """Submit with ``sbatch --parsable <args>``; returns the job id."""
        proc = _run(["sbatch", "--parsable", "-p", self.partition, *args], cwd=cwd, timeout=30, check=False)
        if proc.returncode != 0:
            raise SlurmSetupError(f"sbatch {' '.join(args)} failed: {proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def wait_job(self, job_id: int | str, timeout: float = 60.0) -> dict[str, str]:
        """Poll until the job leaves PENDING/RUNNING/COMPLETING; returns its final job_info."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            if info.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout} s: {info}")
            time.sleep(0.2)


def _skip_or_fail(reason: str) -> None:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"local SLURM unavailable: {reason} ({SKIP_ENV}=1)")
    pytest.fail(f"local SLURM unavailable: {reason}. Set {SKIP_ENV}=1 to skip these tests instead.", pytrace=False)


@pytest.fixture(scope="session")
def local_slurm():
    """A started one-node SLURM (LocalSlurm), stopped at the end of the session."""
    if not sys.platform.startswith("linux"):
        _skip_or_fail(f"needs Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        _skip_or_fail("needs root (apt-get install, daemons, mknod)")
    if _missing_programs() and shutil.which("apt-get") is None:
        _skip_or_fail("SLURM is not installed and there is no apt-get to install it")
    cluster = LocalSlurm()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
