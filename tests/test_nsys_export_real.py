"""System test: the real Nsight Systems CLI captures a small NVTX-emitting program (CPU only, no
GPU needed), :func:`export_report` exports it, and the repository's reader finds the ranges.

When ``nsys`` is not on PATH the module fixture installs it from Debian's *non-free* component
(``nsight-systems`` 2022.4.2.1 on Debian 12; needs root and apt; ~1 GB installed). The test fails
when that is impossible, unless ``NCCLTRACE_ALLOW_SKIP_NSYS=1``.

The profiled program is Python with the ``nvtx`` package from PyPI (installed with ``pip
--target`` into a temporary directory, not into the environment); without network it falls back
to a C program built with gcc against the NVTX v3 headers shipped with nsys. Set
``NCCLTRACE_NVTX_PROGRAM=c`` (or ``python``) to force one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from nccltrace.acquisition.nsys_export import (
    NsysExportError,
    detect_export_capabilities,
    export_flags,
    export_report,
    find_qdstrm_importer,
)
from nccltrace.nsys.reader import NsysExport

pytestmark = [pytest.mark.system, pytest.mark.slow]

SKIP_ENV = "NCCLTRACE_ALLOW_SKIP_NSYS"
PROGRAM_ENV = "NCCLTRACE_NVTX_PROGRAM"
# Pinned: 0.2.11 is the newest release whose ranges nsys 2022.4 records; with 0.2.12, 0.2.13,
# 0.2.14 and 0.2.17 the capture holds only the domain create/destroy rows. cp311 wheel: no compiler.
NVTX_PYPI = "nvtx==0.2.11"
# `nsys export --help` of 2022.4.2.1 (verified on Debian 12's package and in the reference notes).
FLAGS_2022_4 = {"--force-overwrite", "--help", "--lazy", "--output", "--quiet", "--separate-strings", "--type"}
PAYLOAD = 1048576


class NsysInstallError(RuntimeError):
    """Installing Nsight Systems from apt failed (message says what to look at)."""


@dataclass(frozen=True)
class NsysInstall:
    path: str
    installed_now: bool
    install_s: float


def _fail_or_skip(message: str) -> None:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{message} ({SKIP_ENV}=1)")
    pytest.fail(f"{message}\n(set {SKIP_ENV}=1 to skip instead)", pytrace=False)


def _run(cmd: list[str], *, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, check=False, text=True, capture_output=True, timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NsysInstallError(f"`{' '.join(cmd)}` could not run: {e}") from e


def _apt(*args: str) -> None:
    # Other test sessions may run apt at the same time: wait for dpkg's lock, and retry when the
    # package-list lock (not covered by DPkg::Lock::Timeout in every apt) is busy.
    cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=600", *args]
    for attempt in range(30):
        proc = _run(cmd, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        if proc.returncode == 0:
            return
        if "Could not get lock" not in proc.stderr:
            break
        time.sleep(min(2 * (attempt + 1), 20))
    raise NsysInstallError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def _apt_candidate(package: str) -> str | None:
    out = _run(["apt-cache", "policy", package]).stdout
    m = re.search(r"Candidate:\s*(\S+)", out)
    return m.group(1) if m and m.group(1) != "(none)" else None


def _os_release() -> dict[str, str]:
    pairs = (ln.split("=", 1) for ln in Path("/etc/os-release").read_text().splitlines() if "=" in ln)
    return {k: v.strip().strip('"') for k, v in pairs}


def _deb822_stanzas(text: str) -> list[dict[str, str]]:
    stanzas = []
    for block in re.split(r"\n\s*\n", text):
        # lines starting with whitespace continue a field (e.g. an inline key): not needed here
        lines = (ln for ln in block.splitlines() if ln[:1] not in ("", "#", " ", "\t"))
        fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
        if fields:
            stanzas.append(fields)
    return stanzas


def _enable_non_free() -> Path:
    """Add Debian's *contrib* and *non-free* components in a file of our own (the machine's sources
    are left untouched), for every suite and mirror its main Debian entries use (security included).

    Both are needed: nsight-systems and libcuda1 are in non-free, but libcuda1 needs nvidia-support
    (and friends), which are in contrib.
    """
    osr = _os_release()
    codename = osr.get("VERSION_CODENAME", "")
    if osr.get("ID") != "debian" or not codename:
        raise NsysInstallError(f"not Debian ({osr.get('PRETTY_NAME')}): add the repository that has nsight-systems")
    deb822 = Path("/etc/apt/sources.list.d/debian.sources")  # Debian 12 images use this format
    legacy = Path("/etc/apt/sources.list")
    if deb822.is_file():
        stanzas = []
        for st in _deb822_stanzas(deb822.read_text()):
            if "deb" in st.get("Types", "").split() and "main" in st.get("Components", "").split():
                key = st.get("Signed-By", "")
                signed = f"Signed-By: {key}\n" if key.startswith("/") and Path(key).is_file() else ""
                stanzas.append(
                    f"Types: deb\nURIs: {st['URIs']}\nSuites: {st['Suites']}\nComponents: contrib non-free\n{signed}"
                )
        stanzas = stanzas or [
            (
                f"Types: deb\nURIs: http://deb.debian.org/debian\nSuites: {codename} {codename}-updates\n"
                "Components: contrib non-free\n"
            )
        ]
        target = Path("/etc/apt/sources.list.d/nccltrace-non-free.sources")
        target.write_text("\n".join(stanzas))
    else:  # one-line format (/etc/apt/sources.list)
        pattern = r"^deb\s+((?:\[[^]]*\]\s+)?\S+)\s+(\S+)\s.*\bmain\b"
        lines = re.findall(pattern, legacy.read_text(), re.MULTILINE) if legacy.is_file() else []
        default = "http://deb.debian.org/debian"
        lines = lines or [(default, codename), (default, f"{codename}-updates")]
        target = Path("/etc/apt/sources.list.d/nccltrace-non-free.list")
        target.write_text("".join(f"deb {uri} {suite} contrib non-free\n" for uri, suite in lines))
    return target


def _install_nsight_systems() -> None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise NsysInstallError("nsys is not on PATH and cannot be installed here (needs root and apt-get)")
    _apt("update", "-q")
    if _apt_candidate("nsight-systems") is None:
        added = _enable_non_free()
        _apt("update", "-q")
        if _apt_candidate("nsight-systems") is None:
            raise NsysInstallError(f"no nsight-systems package even after adding {added}")
    # nsight-systems depends on nsight-systems-target (nsys itself, the NVTX headers) and, through
    # it, on libcuda1 from the NVIDIA driver packages (user-space library only; no kernel module
    # with --no-install-recommends).
    _apt("install", "-y", "-q", "--no-install-recommends", "nsight-systems")


@pytest.fixture(scope="module")
def nsys() -> NsysInstall:
    """Path of the real nsys, installed from apt when missing."""
    found = shutil.which("nsys")
    if found:
        return NsysInstall(found, False, 0.0)
    t0 = time.monotonic()
    try:
        _install_nsight_systems()
    except NsysInstallError as e:
        _fail_or_skip(f"Nsight Systems is needed for this test and could not be installed: {e}")
    install_s = time.monotonic() - t0
    found = shutil.which("nsys")
    if not found:
        _fail_or_skip("apt-get installed nsight-systems but `nsys` is still not on PATH")
    print(f"\n[nsys] installed nsight-systems in {install_s:.1f} s -> {found}", file=sys.stderr)
    return NsysInstall(found, True, install_s)


# --------------------------------------------------------------------------- the profiled program

PY_PROGRAM = f"""
import time
import nvtx

# nvtx is a no-op unless nsys set NVTX_INJECTION64_PATH: fail loudly rather than capture nothing.
assert nvtx.enabled(), "nvtx is disabled: not running under nsys?"
nvtx.push_range("train_step")
nvtx.push_range("ncclAllReduce", domain="NCCL", payload={PAYLOAD})
time.sleep(0.01)
nvtx.pop_range(domain="NCCL")
nvtx.mark("step_mark")
r = nvtx.start_range("data_loading")
time.sleep(0.005)
nvtx.end_range(r)
nvtx.pop_range()
"""

C_PROGRAM = f"""
#include <nvtx3/nvToolsExt.h>
#include <unistd.h>
int main(void) {{
    nvtxDomainHandle_t nccl = nvtxDomainCreateA("NCCL");
    nvtxEventAttributes_t a = {{0}};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;   /* as NCCL does */
    a.message.registered = nvtxDomainRegisterStringA(nccl, "ncclAllReduce");
    a.payloadType = NVTX_PAYLOAD_TYPE_UNSIGNED_INT64;
    a.payload.ullValue = {PAYLOAD}ULL;
    nvtxRangePushA("train_step");
    nvtxDomainRangePushEx(nccl, &a);
    usleep(10000);
    nvtxDomainRangePop(nccl);
    nvtxMarkA("step_mark");
    nvtxRangeId_t r = nvtxRangeStartA("data_loading");
    usleep(5000);
    nvtxRangeEnd(r);
    nvtxRangePop();
    nvtxDomainDestroy(nccl);
    return 0;
}}
"""


def _python_program(work: Path) -> tuple[list[str], dict[str, str]]:
    site = work / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(site), NVTX_PYPI],
        check=False, text=True, capture_output=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"pip install {NVTX_PYPI} failed: {proc.stderr[-1500:]}")
    prog = work / "nvtx_prog.py"
    prog.write_text(PY_PROGRAM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return [sys.executable, str(prog)], env


def _nvtx_include(nsys_path: str) -> Path:
    """``nvtx/include`` of the nsys install (Debian: under target-linux-x64, found via the symlinks)."""
    real = Path(os.path.realpath(nsys_path))
    for base in (real.parent, real.parent.parent):
        hits = sorted(base.glob("**/nvtx3/nvToolsExt.h"))
        if hits:
            return hits[0].parent.parent
    raise RuntimeError(f"no nvtx3/nvToolsExt.h under the nsys install {real.parent}")


def _c_program(work: Path, nsys_path: str) -> tuple[list[str], dict[str, str]]:
    if shutil.which("gcc") is None:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            _apt("install", "-y", "-q", "--no-install-recommends", "gcc", "libc6-dev")
        else:
            raise RuntimeError("gcc is not installed")
    src = work / "nvtx_prog.c"
    src.write_text(C_PROGRAM)
    exe = work / "nvtx_prog"
    cmd = ["gcc", "-O1", "-o", str(exe), str(src), "-I", str(_nvtx_include(nsys_path)), "-ldl", "-lpthread"]
    proc = subprocess.run(cmd, check=False, text=True, capture_output=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
    return [str(exe)], dict(os.environ)


@dataclass(frozen=True)
class Capture:
    nsys_rep: Path
    qdstrm: Path | None  # the raw capture, when nsys profile did not import it itself
    program: str  # "python" or "c"
    profile_s: float


@pytest.fixture(scope="module")
def capture(nsys: NsysInstall, tmp_path_factory: pytest.TempPathFactory) -> Capture:
    """A CPU-only capture (NVTX + OS runtime, no sampling) of the NVTX program, as .nsys-rep and,
    when nsys profile left one, as .qdstrm."""
    work = tmp_path_factory.mktemp("nsys_capture")
    wanted = os.environ.get(PROGRAM_ENV, "")
    errors = []
    program = None
    for kind in [wanted] if wanted else ["python", "c"]:
        try:
            cmd, env = _python_program(work) if kind == "python" else _c_program(work, nsys.path)
            program = kind
            break
        except (RuntimeError, NsysInstallError, OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"{kind}: {e}")
    if program is None:
        pytest.fail("could not build an NVTX-emitting program:\n" + "\n".join(errors), pytrace=False)
    out = work / "r1"
    profile = [nsys.path, "profile", "-t", "nvtx,osrt", "-s", "none", "--cpuctxsw=none", "-o", str(out), *cmd]
    t0 = time.monotonic()
    proc = subprocess.run(profile, check=False, text=True, capture_output=True, timeout=600, env=env, cwd=work)
    profile_s = time.monotonic() - t0
    log = f"`{' '.join(profile)}` exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, log
    print(f"\n[nsys] profile ({program} program) took {profile_s:.1f} s; {log}", file=sys.stderr)
    rep, qdstrm = out.with_suffix(".nsys-rep"), out.with_suffix(".qdstrm")
    # Debian 12's nsys looks for QdstrmImporter beside its resolved path, where the package does
    # not put it: profile exits 0 but leaves only r1.qdstrm ("The importer binary and its
    # dependencies were not found"). Import it here for the .nsys-rep case.
    if not rep.is_file():
        assert qdstrm.is_file(), f"nsys profile wrote no report in {work}: {sorted(os.listdir(work))}\n{log}"
        importer = find_qdstrm_importer(nsys.path)
        assert importer is not None, "nsys left a .qdstrm and no QdstrmImporter was found"
        imp = subprocess.run(
            [str(importer), "-i", str(qdstrm), "-o", str(rep)], check=False, capture_output=True, timeout=600
        )
        assert imp.returncode == 0 and rep.is_file(), imp
    return Capture(rep, qdstrm if qdstrm.is_file() else None, program, profile_s)


# --------------------------------------------------------------------------- tests


def test_real_nsys_capabilities(nsys: NsysInstall) -> None:
    caps = detect_export_capabilities(nsys.path)
    print(f"\n[nsys] {caps.nsys}: {caps.version_text!r}; export flags {sorted(caps.flags)}", file=sys.stderr)
    assert re.fullmatch(r"20\d\d\.\d+(\.\d+)*", caps.version), caps
    if _os_release().get("VERSION_CODENAME") == "bookworm" and nsys.path == "/usr/bin/nsys":
        assert caps.version.startswith("2022.4."), caps.version  # Debian 12's package
    if caps.version.startswith("2022.4."):
        assert caps.flags == FLAGS_2022_4
        assert not (caps.include_blobs or caps.include_json or caps.ts_normalize or caps.dynamic_tables)
        assert caps.lazy and caps.force_overwrite
        assert export_flags(caps) == ["--type", "sqlite", "--quiet=true", "--force-overwrite=true"]
    importer = find_qdstrm_importer(nsys.path)
    assert importer is not None and importer.name == "QdstrmImporter" and os.access(importer, os.X_OK), importer


@pytest.mark.parametrize("kind", ["nsys-rep", "qdstrm"])
def test_real_export_and_read(nsys: NsysInstall, capture: Capture, tmp_path: Path, kind: str) -> None:
    report = capture.nsys_rep if kind == "nsys-rep" else capture.qdstrm
    if report is None:
        pytest.skip("this nsys imported the capture itself: no .qdstrm to export")
    caps = detect_export_capabilities(nsys.path)
    output = tmp_path / "exports" / "r1.sqlite"
    before = sorted(os.listdir(report.parent))
    record = export_report(report, output, caps=caps, timeout_s=600)
    assert sorted(os.listdir(report.parent)) == before  # nothing written beside the capture
    print(f"\n[nsys] export took {record.duration_s:.2f} s, {record.size_bytes} bytes", file=sys.stderr)

    assert output.is_file() and sorted(p.name for p in output.parent.iterdir()) == ["r1.sqlite"]
    assert record.size_bytes == output.stat().st_size
    assert record.sha256 == hashlib.sha256(output.read_bytes()).hexdigest()
    assert record.nsys_version == caps.version and record.nsys == caps.nsys
    assert record.flags == tuple(export_flags(caps)) and record.command[1] == "export"
    assert record.imported_from_qdstrm == (kind == "qdstrm")
    if caps.version.startswith("2022.4."):
        assert record.schema_version == "3.0.0"
    assert record.to_dict()["output"] == str(output)

    with NsysExport.open(output, integrity_check=True) as ex:
        assert ex.product_version == caps.version
        nvtx = ex.nvtx()
        names = set(nvtx.text.dropna())
        assert {"train_step", "ncclAllReduce", "step_mark", "data_loading"} <= names, names
        coll = nvtx[nvtx.text == "ncclAllReduce"].iloc[0]
        assert coll.domain == "NCCL" and coll.event_type == 59  # push/pop range in domain NCCL
        # Python's nvtx sends an int64 payload, the C program a uint64 one
        payloads = [int(v) for v in (coll.uint64_value, coll.int64_value) if not pd.isna(v)]
        assert payloads == [PAYLOAD], coll
        step = nvtx[nvtx.text == "train_step"].iloc[0]
        assert step.event_type == 59 and step.start <= coll.start and coll.end <= step.end
        assert nvtx[nvtx.text == "step_mark"].iloc[0].event_type == 34  # mark
        assert nvtx[nvtx.text == "data_loading"].iloc[0].event_type == 60  # start/end range
        assert coll.end - coll.start >= 9_000_000  # slept 10 ms inside
        assert ex.session_start_utc_ns is not None
        # CPU-only capture: no CUDA tables at all; the reader reports that as empty frames.
        kernels = ex.kernels(None)
        assert kernels.empty and "start" in kernels.columns
        assert ex.runtime().empty


def test_real_export_of_broken_reports(nsys: NsysInstall, capture: Capture, tmp_path: Path) -> None:
    """What the real nsys does with a corrupt and a truncated report: our error, no output file."""
    caps = detect_export_capabilities(nsys.path)
    garbage = tmp_path / "garbage.nsys-rep"
    garbage.write_bytes(os.urandom(64 * 1024))
    data = capture.nsys_rep.read_bytes()
    truncated = tmp_path / "truncated.nsys-rep"
    truncated.write_bytes(data[: len(data) // 2])
    for bad in (garbage, truncated):
        output = tmp_path / f"{bad.stem}.sqlite"
        with pytest.raises(NsysExportError) as ei:
            export_report(bad, output, caps=caps, timeout_s=300)
        msg = str(ei.value)
        print(f"\n[nsys] {bad.name}: {msg}", file=sys.stderr)
        assert str(bad) in msg and "command:" in msg and "What to do" in msg
        assert ei.value.command is not None and ei.value.command[:2] == [caps.nsys, "export"]
        assert ei.value.returncode != 0 and "error" in ei.value.output_tail.lower()  # nsys's own message
        assert not output.exists()
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # temp dir removed


def test_the_workflow_export_rule_exports_a_real_capture(nsys: NsysInstall, capture: Capture, tmp_path: Path) -> None:
    """The nsys_export rule itself (real Snakemake, real nsys) on a capture laid out as the
    training rule leaves it; with Debian's nsys that is the raw .qdstrm."""
    import yaml

    repo = Path(__file__).resolve().parents[1]
    config = {
        "campaign": "real_nsys",
        "defaults": {"backend": "slurm", "micro_batch_size": 1, "global_batch_size": 4, "iterations": 1},
        "models": {"tiny": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128}},
        "hardware": {"CPU": {"gpu": "CPU", "nodes": 1, "gpus_per_node": 1}},
        "matrix": [{"models": ["tiny"], "hardware": ["CPU"]}],
        "training": {"nsys": nsys.path},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    run = "tiny_CPU_tp1_pp1_ep1_cp1_vpp1_sp0_dp1"
    report = capture.qdstrm or capture.nsys_rep
    nsys_dir = tmp_path / "results" / "real_nsys" / run / "capture" / "nsys"
    nsys_dir.mkdir(parents=True)
    shutil.copy2(report, nsys_dir / f"host1{report.suffix}")
    target = f"results/real_nsys/{run}/export/host1.sqlite"
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(repo / "Snakefile"), "--directory", str(tmp_path),
           "--configfile", str(tmp_path / "config.yaml"), "--cores", "1", target]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    export = tmp_path / target
    record = json.loads(export.with_suffix(".json").read_text())
    assert record["nsys_version"].startswith("20") and record["imported_from_qdstrm"] == (report.suffix == ".qdstrm")
    assert not export.stat().st_mode & 0o222  # protected: raw data is never rewritten
    with NsysExport.open(export) as ex:
        assert "ncclAllReduce" in set(ex.nvtx().text.dropna())
