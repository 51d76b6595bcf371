"""Fast tests of nccltrace.acquisition.nsys_export with fake ``nsys`` executables (no Nsight
Systems needed). The real CLI is exercised in test_nsys_export_real.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import sys
import time
from pathlib import Path

import pytest
from data_paths import NSYS_REFERENCE

from nccltrace.acquisition.nsys_export import (
    ExportCapabilities,
    NsysExportError,
    detect_export_capabilities,
    export_flags,
    export_report,
    find_qdstrm_importer,
)

SAMPLE = NSYS_REFERENCE / "nsys-2022.4.2.1-nvtx-sample.sqlite"

VERSION_2022_4 = "NVIDIA Nsight Systems version 2022.4.2.1-df9881f\n"

# `nsys export --help` of 2022.4.2.1 exactly as printed (Debian 12 package), option texts shortened.
HELP_2022_4 = """
usage: nsys export [<args>] [nsys-rep-file]

\t-f, --force-overwrite=

\t   Possible values are 'true' or 'false'.
\t   If true, overwrite all existing result files with same output filename
\t   (QDSTRM, nsys-rep, SQLITE, HDF, TEXT, ARROW, JSON).
\t   Default is 'false'.

\t-h, --help=[<tag>]

\t   Print the command's help menu. The switch can take one optional
\t   argument that will be used as a tag.

\t-l, --lazy=

           Possible values are 'true' or 'false'.
           Controls if table creation is lazy or not. Default is 'true'.

\t-o, --output=

           Path to results file.
           Default is name of input file with modified extension.

\t-q, --quiet=

           Possible values are 'true' or 'false'.
           If 'true', don't display progress bar.

\t--separate-strings=

           Possible values are 'true' or 'false'.

\t-t, --type=

           Possible values are: sqlite, hdf, text, arrow, json, info.
           Export format type.
"""

# Synthetic help of a recent release in the same layout, with the switches of the current User
# Guide (reference sqlite-schema.md §7).
HELP_NEW = (
    HELP_2022_4
    + """
\t--include-blobs=

           Possible values are 'true' or 'false'. Include NVTX extended payload binary data.

\t--include-json=

           Possible values are 'true' or 'false'. Include JSON metadata (NCCL trace).

\t--ts-normalize=

           Possible values are 'true' or 'false'. Timestamps as UTC epoch ns.

\t--ts-shift=<ns>

\t--dynamic-tables=

           Possible values are 'none' or 'all'.

\t--tables=<patterns>  --times=<ranges>
"""
)

# The fake: logs its argv (one JSON list a line), answers --version / export --help from its
# config, and for `export` behaves as config["mode"] says.
FAKE_NSYS = r'''#!{python}
import json, os, shutil, sys, time
CFG = json.loads({cfg!r})
args = sys.argv[1:]
with open(CFG["log"], "a") as f:
    f.write(json.dumps(args) + "\n")
if args == ["--version"]:
    sys.stdout.write(CFG["version"])
    sys.exit(CFG["version_rc"])
if args[:2] == ["export", "--help"]:
    sys.stdout.write(CFG["help"])
    sys.exit(CFG["help_rc"])
if args[:1] != ["export"]:
    sys.exit(99)
out, report = args[args.index("--output") + 1], args[-1]
mode = CFG["mode"]
if not os.path.isfile(report):
    sys.stderr.write("Exportation error: input not found\n")
    sys.exit(1)
if mode == "copy":
    shutil.copyfile(CFG["sample"], out)
elif mode == "fail":
    for i in range(1, 5):
        sys.stdout.write("Exporting 689 events: [==%d%%   ]\r" % (25 * i))
    sys.stderr.write("Exportation error: Version tag is not found in the stream.\n")
    with open(out, "wb") as f:
        f.write(open(CFG["sample"], "rb").read()[:4096])  # partial output, then failure
    sys.exit(3)
elif mode == "garbage":
    open(out, "wb").write(b"this is not sqlite\n" * 100)
elif mode == "empty":
    open(out, "wb").close()
elif mode == "truncated":
    open(out, "wb").write(open(CFG["sample"], "rb").read()[:40960])
elif mode == "not-nsys":
    import sqlite3
    c = sqlite3.connect(out); c.execute("CREATE TABLE t (x)"); c.commit(); c.close()
elif mode == "sleep":
    open(CFG["log"] + ".pid", "w").write(str(os.getpid()))
    time.sleep(60)
elif mode == "nothing":
    pass
sys.exit(0)
'''

FAKE_IMPORTER = r'''#!{python}
import sys
args = sys.argv[1:]
src, dst = args[args.index("--input-file") + 1], args[args.index("--output-file") + 1]
data = open(src, "rb").read()
if not data.startswith(b"QDSTRM"):
    print("Qdstrm file is incomplete or invalid. Please ensure that the CLI ran to completion.")
    sys.exit(2)
open(dst, "wb").write(b"NSYSREP" + data)
print('Saved report file to "%s"' % dst)
'''


def _write_exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def make_fake_nsys(
    where: Path,
    *,
    mode: str = "copy",
    help: str = HELP_2022_4,
    version: str = VERSION_2022_4,
    version_rc: int = 0,
    help_rc: int = 0,
) -> Path:
    cfg = {"log": str(where / "calls.log"), "sample": str(SAMPLE), "mode": mode, "help": help,
           "version": version, "version_rc": version_rc, "help_rc": help_rc}  # fmt: skip
    return _write_exe(where / "nsys", FAKE_NSYS.format(python=sys.executable, cfg=json.dumps(cfg)))


def calls(fake: Path) -> list[list[str]]:
    log = fake.parent / "calls.log"
    return [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def report(tmp_path: Path) -> Path:
    p = tmp_path / "captures" / "rank0.nsys-rep"
    p.parent.mkdir()
    p.write_bytes(b"NSYSREP fake report body")
    return p


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# --------------------------------------------------------------------------- capabilities


def test_sample_exists() -> None:
    assert SAMPLE.is_file(), f"reference sample missing: {SAMPLE}"


def test_2022_4_help_has_no_payload_flags(tmp_path: Path) -> None:
    fake = make_fake_nsys(tmp_path)
    caps = detect_export_capabilities(str(fake))
    assert caps.version == "2022.4.2.1"
    assert caps.version_text == "NVIDIA Nsight Systems version 2022.4.2.1-df9881f"
    assert caps.flags == {"--force-overwrite", "--help", "--lazy", "--output", "--quiet", "--separate-strings", "--type"}
    assert (caps.lazy, caps.force_overwrite) == (True, True)
    assert not (caps.include_blobs or caps.include_json or caps.ts_normalize or caps.dynamic_tables)
    assert export_flags(caps) == ["--type", "sqlite", "--quiet=true", "--force-overwrite=true"]
    assert calls(fake) == [["--version"], ["export", "--help"]]
    assert json.loads(json.dumps(caps.to_dict()))["flags"][0] == "--force-overwrite"


def test_newer_help_adds_blobs_and_json(tmp_path: Path) -> None:
    caps = detect_export_capabilities(str(make_fake_nsys(tmp_path, help=HELP_NEW, version="2025.6.1.190\n")))
    assert caps.version == "2025.6.1.190"
    assert caps.include_blobs and caps.include_json and caps.ts_normalize and caps.dynamic_tables
    flags = export_flags(caps)
    assert flags == ["--type", "sqlite", "--quiet=true", "--force-overwrite=true", "--include-blobs=true",
                     "--include-json=true"]  # fmt: skip
    assert not any(f.startswith(("--ts-normalize", "--dynamic-tables", "--lazy")) for f in flags)


def test_flags_come_from_help_not_version(tmp_path: Path) -> None:
    # A new version number with an old help text: trust the help.
    caps = detect_export_capabilities(str(make_fake_nsys(tmp_path, version="NVIDIA Nsight Systems version 2026.4.1.9\n")))
    assert caps.version == "2026.4.1.9" and not caps.include_blobs


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("NVIDIA Nsight Systems version 2024.6.2.225-246235244400v0\n", "2024.6.2.225"),
        ("NVIDIA Nsight Systems version 2023.2.3.1004-33186433v0\n", "2023.2.3.1004"),
        ("2022.4.2.1\n", "2022.4.2.1"),
        ("NVIDIA Nsight Systems (build without number)\n", "unknown"),
    ],
)
def test_version_parsing(tmp_path: Path, text: str, version: str) -> None:
    assert detect_export_capabilities(str(make_fake_nsys(tmp_path, version=text))).version == version


def test_nsys_not_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NsysExportError) as ei:
        detect_export_capabilities()
    msg = str(ei.value)
    assert "not found on PATH" in msg and "non-free" in msg and "nsight-systems" in msg and "CUDA toolkit" in msg


def test_nsys_found_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_fake_nsys(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert detect_export_capabilities().nsys == str(fake)


def test_nsys_path_missing_or_not_executable(tmp_path: Path) -> None:
    with pytest.raises(NsysExportError, match="does not exist"):
        detect_export_capabilities(str(tmp_path / "no" / "nsys"))
    plain = tmp_path / "nsys"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(NsysExportError, match="not executable"):
        detect_export_capabilities(str(plain))


def test_not_an_executable_format(tmp_path: Path) -> None:
    bad = _write_exe(tmp_path / "nsys", "no shebang, not ELF")
    with pytest.raises(NsysExportError, match="cannot run"):
        detect_export_capabilities(str(bad))


def test_help_cannot_run(tmp_path: Path) -> None:
    fake = make_fake_nsys(tmp_path, help="nsys: unknown command 'export'\n", help_rc=1)
    with pytest.raises(NsysExportError) as ei:
        detect_export_capabilities(str(fake))
    msg = str(ei.value)
    assert "export --help" in msg and "exit code 1" in msg and "unknown command 'export'" in msg
    assert ei.value.returncode == 1


def test_version_fails(tmp_path: Path) -> None:
    fake = make_fake_nsys(tmp_path, version="error while loading shared libraries: libssh.so.4\n", version_rc=127)
    with pytest.raises(NsysExportError, match=r"exited with code 127[\s\S]*libssh"):
        detect_export_capabilities(str(fake))


def test_help_without_sqlite_type(tmp_path: Path) -> None:
    fake = make_fake_nsys(tmp_path, help=HELP_2022_4.replace("sqlite, ", "").replace("SQLITE, ", ""))
    with pytest.raises(NsysExportError, match="--type sqlite"):
        detect_export_capabilities(str(fake))


# --------------------------------------------------------------------------- export


def test_export_success(tmp_path: Path, report: Path) -> None:
    fake = make_fake_nsys(tmp_path)
    out = tmp_path / "exports" / "rank0.sqlite"
    rec = export_report(report, out, nsys=str(fake))
    assert out.read_bytes() == SAMPLE.read_bytes()
    assert rec.output == out and rec.report == report
    assert rec.size_bytes == SAMPLE.stat().st_size
    assert rec.sha256 == hashlib.sha256(SAMPLE.read_bytes()).hexdigest()
    assert rec.nsys == str(fake) and rec.nsys_version == "2022.4.2.1" and rec.schema_version == "3.0.0"
    assert rec.flags == ("--type", "sqlite", "--quiet=true", "--force-overwrite=true")
    assert not rec.imported_from_qdstrm and rec.duration_s >= 0
    export_call = calls(fake)[-1]
    assert list(rec.command[1:]) == export_call
    assert export_call[:5] == ["export", "--type", "sqlite", "--quiet=true", "--force-overwrite=true"]
    assert export_call[-1] == str(report.absolute())
    tmp_out = Path(export_call[export_call.index("--output") + 1])
    assert tmp_out.parent.parent == out.parent and tmp_out.suffix == ".sqlite"
    assert leftovers(out.parent) == [] and sorted(os.listdir(out.parent)) == ["rank0.sqlite"]
    assert sorted(os.listdir(report.parent)) == ["rank0.nsys-rep"]
    d = json.loads(json.dumps(rec.to_dict()))
    assert d["output"] == str(out) and d["flags"][0] == "--type" and d["sha256"] == rec.sha256
    # the result opens with the repository's reader
    from nccltrace.nsys.reader import NsysExport

    with NsysExport.open(out) as ex:
        assert ex.schema_version == "3.0.0"


def test_export_replaces_previous_output(tmp_path: Path, report: Path) -> None:
    out = tmp_path / "rank0.sqlite"
    out.write_bytes(b"old")
    export_report(report, out, nsys=str(make_fake_nsys(tmp_path / "bin")))
    assert out.read_bytes() == SAMPLE.read_bytes()


def test_caps_given_skips_detection(tmp_path: Path, report: Path) -> None:
    fake = make_fake_nsys(tmp_path)
    caps = detect_export_capabilities(str(fake))
    for i in range(2):
        export_report(report, tmp_path / f"r{i}.sqlite", caps=caps, nsys="ignored-when-caps-given")
    assert [c[0] for c in calls(fake)] == ["--version", "export", "export", "export"]
    assert [c[1] for c in calls(fake)[2:]] == ["--type", "--type"]


def test_newer_nsys_export_uses_payload_flags(tmp_path: Path, report: Path) -> None:
    fake = make_fake_nsys(tmp_path, help=HELP_NEW, version="2025.6.1.190\n")
    rec = export_report(report, tmp_path / "r.sqlite", nsys=str(fake))
    assert "--include-blobs=true" in calls(fake)[-1] and "--include-json=true" in rec.command


def _assert_failed_cleanly(ei: pytest.ExceptionInfo, report: Path, out: Path) -> str:
    msg = str(ei.value)
    assert str(report) in msg and "command:" in msg and "What to do" in msg
    assert ei.value.report == report and ei.value.command[1] == "export"
    assert not out.exists()
    assert leftovers(out.parent) == []
    return msg


def test_export_nonzero_exit(tmp_path: Path, report: Path) -> None:
    out = tmp_path / "out" / "rank0.sqlite"
    with pytest.raises(NsysExportError) as ei:
        export_report(report, out, nsys=str(make_fake_nsys(tmp_path, mode="fail")))
    msg = _assert_failed_cleanly(ei, report, out)
    assert "exit code: 3" in msg and ei.value.returncode == 3
    assert "Exportation error: Version tag is not found in the stream." in msg
    assert "Exporting 689 events" not in ei.value.output_tail  # progress bar redraws dropped
    assert os.listdir(out.parent) == []


def test_failed_export_keeps_previous_output(tmp_path: Path, report: Path) -> None:
    out = tmp_path / "rank0.sqlite"
    out.write_bytes(b"previous complete export")
    with pytest.raises(NsysExportError):
        export_report(report, out, nsys=str(make_fake_nsys(tmp_path / "bin", mode="fail")))
    assert out.read_bytes() == b"previous complete export"  # atomic: old file untouched


@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        ("garbage", "not SQLite"),
        ("empty", "empty (0 bytes)"),
        ("truncated", "truncated"),
        ("not-nsys", "lacks table(s) StringIds"),
        ("nothing", "wrote no export.sqlite"),
    ],
)
def test_export_bad_output_with_exit_0(tmp_path: Path, report: Path, mode: str, problem: str) -> None:
    out = tmp_path / "out" / "rank0.sqlite"
    with pytest.raises(NsysExportError) as ei:
        export_report(report, out, nsys=str(make_fake_nsys(tmp_path, mode=mode)))
    msg = _assert_failed_cleanly(ei, report, out)
    assert problem in msg and "exit code: 0" in msg


def test_export_timeout_kills_nsys(tmp_path: Path, report: Path) -> None:
    fake = make_fake_nsys(tmp_path, mode="sleep")
    caps = detect_export_capabilities(str(fake))
    out = tmp_path / "out" / "rank0.sqlite"
    t0 = time.monotonic()
    timed_out = r"rank0\.nsys-rep: nsys export did not finish within 1 s and was killed\ncommand: "
    with pytest.raises(NsysExportError, match=timed_out) as ei:
        export_report(report, out, caps=caps, timeout_s=1)
    assert time.monotonic() - t0 < 20
    assert str(report) in str(ei.value) and "timeout_s" in str(ei.value)
    pid = int((tmp_path / "calls.log.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    assert not out.exists() and leftovers(out.parent) == []


def test_missing_report(tmp_path: Path) -> None:
    fake = make_fake_nsys(tmp_path)
    with pytest.raises(NsysExportError, match=r"nope\.nsys-rep: report does not exist"):
        export_report(tmp_path / "nope.nsys-rep", tmp_path / "x.sqlite", nsys=str(fake))
    assert calls(fake) == []  # checked before nsys runs
    assert not (tmp_path / "x.sqlite").exists()


def test_empty_report(tmp_path: Path) -> None:
    rep = tmp_path / "r.nsys-rep"
    rep.touch()
    with pytest.raises(NsysExportError, match="report is empty"):
        export_report(rep, tmp_path / "x.sqlite", nsys=str(make_fake_nsys(tmp_path)))


def test_report_that_is_already_sqlite(tmp_path: Path) -> None:
    rep = tmp_path / "r.nsys-rep"
    shutil.copyfile(SAMPLE, rep)
    with pytest.raises(NsysExportError, match="already an SQLite export"):
        export_report(rep, tmp_path / "x.sqlite", nsys=str(make_fake_nsys(tmp_path)))


def test_output_same_as_report(tmp_path: Path, report: Path) -> None:
    with pytest.raises(NsysExportError, match="must differ"):
        export_report(report, report, nsys=str(make_fake_nsys(tmp_path)))


def test_nsys_missing_at_export(tmp_path: Path, report: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NsysExportError, match="non-free"):
        export_report(report, tmp_path / "x.sqlite")


# --------------------------------------------------------------------------- .qdstrm


def _nsys_install(tmp_path: Path, *, importer: bool = True) -> tuple[Path, Path | None]:
    """A fake install laid out like Debian's: /usr/bin/nsys -> ../lib/nsight-systems/bin/nsys ->
    ../target-linux-x64/nsys (-> real dir elsewhere), importer in lib/nsight-systems/host-linux-x64."""
    real = make_fake_nsys(tmp_path / "usr/lib/x86_64-linux-gnu/nsight-systems/target-linux-x64")
    lib = tmp_path / "usr/lib/nsight-systems"
    (lib / "bin").mkdir(parents=True)
    (lib / "target-linux-x64").symlink_to(real.parent)
    (lib / "bin" / "nsys").symlink_to("../target-linux-x64/nsys")
    (tmp_path / "usr/bin").mkdir()
    (tmp_path / "usr/bin/nsys").symlink_to("../lib/nsight-systems/bin/nsys")
    imp = None
    if importer:
        imp = _write_exe(lib / "host-linux-x64" / "QdstrmImporter", FAKE_IMPORTER.format(python=sys.executable))
    return tmp_path / "usr/bin/nsys", imp


def test_find_qdstrm_importer_along_symlinks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nsys, imp = _nsys_install(tmp_path)
    # found via the middle link (lib/nsight-systems/bin/nsys), not the fully resolved path
    found = find_qdstrm_importer(str(nsys))
    assert found is not None and found.resolve() == imp.resolve()
    assert not (tmp_path / "usr/lib/x86_64-linux-gnu/nsight-systems/host-linux-x64").exists()
    monkeypatch.setenv("PATH", str(nsys.parent))
    assert find_qdstrm_importer("nsys").resolve() == imp.resolve()
    assert find_qdstrm_importer(str(tmp_path / "missing")) is None


def test_export_qdstrm_imports_first(tmp_path: Path) -> None:
    nsys, _ = _nsys_install(tmp_path)
    cap = tmp_path / "cap" / "r1.qdstrm"
    cap.parent.mkdir()
    cap.write_bytes(b"QDSTRM raw stream")
    out = tmp_path / "out" / "r1.sqlite"
    rec = export_report(cap, out, nsys=str(nsys))
    assert rec.imported_from_qdstrm and out.read_bytes() == SAMPLE.read_bytes()
    exported = Path(rec.command[-1])
    assert exported.name == "r1.nsys-rep" and exported.parent.parent == out.parent  # imported in the temp dir
    assert os.listdir(cap.parent) == ["r1.qdstrm"]  # nothing written beside the capture
    assert leftovers(out.parent) == []


def test_export_qdstrm_import_fails(tmp_path: Path) -> None:
    nsys, _ = _nsys_install(tmp_path)
    cap = tmp_path / "r1.qdstrm"
    cap.write_bytes(b"truncated garbage")
    out = tmp_path / "out" / "r1.sqlite"
    with pytest.raises(NsysExportError) as ei:
        export_report(cap, out, nsys=str(nsys))
    msg = str(ei.value)
    assert str(cap) in msg and "importing the .qdstrm failed (exit code 2" in msg and "incomplete or invalid" in msg
    assert "QdstrmImporter" in msg and "--output-file" in msg
    assert not out.exists() and leftovers(out.parent) == []


def test_export_qdstrm_without_importer(tmp_path: Path) -> None:
    nsys, _ = _nsys_install(tmp_path, importer=False)
    cap = tmp_path / "r1.qdstrm"
    cap.write_bytes(b"QDSTRM raw stream")
    with pytest.raises(NsysExportError, match=r"unimported capture \(\.qdstrm\), and no QdstrmImporter was found"):
        export_report(cap, tmp_path / "r1.sqlite", nsys=str(nsys))
    assert not (tmp_path / "r1.sqlite").exists()


def test_capabilities_dataclass_is_frozen() -> None:
    caps = ExportCapabilities("nsys", "2022.4.2.1", "", frozenset({"--type"}), *([False] * 6))
    with pytest.raises(AttributeError):
        caps.version = "x"  # type: ignore[misc]
    assert caps.supports("--type") and not caps.supports("--lazy")


def test_sample_is_readable_sqlite() -> None:
    # guards the success fixtures above: the sample must be a real nsys export
    conn = sqlite3.connect(f"{SAMPLE.as_uri()}?mode=ro", uri=True)
    try:
        assert conn.execute("SELECT value FROM EXPORT_META_DATA WHERE name='EXPORT_SCHEMA_VERSION'").fetchone() == (
            "3.0.0",
        )
    finally:
        conn.close()
