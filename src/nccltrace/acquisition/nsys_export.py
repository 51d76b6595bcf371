"""Export Nsight Systems reports to SQLite with the installed ``nsys``, checked and atomic.

``nsys export --type sqlite`` is where a capture becomes something :class:`nccltrace.nsys.reader.NsysExport`
can read, and a plain call is unreliable in a pipeline: flags differ between releases
(:func:`detect_export_capabilities` reads ``nsys export --help``), a failed export can leave a
file behind (:func:`export_report` checks the result before renaming it into place), and a
capture may stop at ``.qdstrm`` (the importer is found along nsys's symlink chain and run
first). Details and typical use: ``docs/nsys.md``, Module notes.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "INSTALL_HINT",
    "OPTIONAL_FLAGS",
    "ExportCapabilities",
    "ExportRecord",
    "NsysExportError",
    "detect_export_capabilities",
    "export_flags",
    "export_report",
    "find_qdstrm_importer",
]

INSTALL_HINT = (
    "install Nsight Systems: on Debian 12 enable the 'non-free' component in the apt sources and run "
    "`apt-get install nsight-systems`; it also ships with the CUDA toolkit (<cuda>/bin/nsys) and as "
    "/opt/nvidia/nsight-systems/<version>/bin/nsys; on a cluster try `module load nsight-systems` (or "
    "the CUDA module). Then put nsys on PATH or pass its full path"
)

# Optional `nsys export` flags whose support is detected from the help text.
OPTIONAL_FLAGS: tuple[str, ...] = (
    "--include-blobs",
    "--include-json",
    "--lazy",
    "--ts-normalize",
    "--force-overwrite",
    "--dynamic-tables",
)

_SQLITE_MAGIC = b"SQLite format 3\x00"
_META_TABLES = ("META_DATA_EXPORT", "EXPORT_META_DATA")  # 3.16+ / 3.0.0 name of the metadata table
_TAIL_LINES = 20
_LONG_FLAG_RE = re.compile(r"(?<![\w-])(--[A-Za-z][A-Za-z0-9-]*)")
_PROGRESS_RE = re.compile(r"^\s*[\w .]*:?\s*\[[=\s]*\d+%[=\s]*\]\s*$")  # "Exporting 689 events: [==12%  ]"
_VERSION_RE = re.compile(r"\b(20\d\d\.\d+(?:\.\d+){0,3})")


class NsysExportError(RuntimeError):
    """nsys could not be found or run, or an export failed. The message names the report, the
    command, the exit code and the end of nsys's output, and says what to do.

    Attributes (None when not applicable): ``report``, ``command``, ``returncode``, ``output_tail``.
    """

    def __init__(
        self,
        message: str,
        *,
        report: Path | None = None,
        command: list[str] | None = None,
        returncode: int | None = None,
        output_tail: str = "",
    ) -> None:
        super().__init__(message)
        self.report = report
        self.command = command
        self.returncode = returncode
        self.output_tail = output_tail


@dataclass(frozen=True)
class ExportCapabilities:
    """What the installed ``nsys export`` supports (from ``nsys --version`` and ``nsys export --help``).

    Attributes:
        nsys: Path of the nsys executable as found (not symlink-resolved).
        version: Product version such as ``"2022.4.2.1"`` (``"unknown"`` if not printed).
        version_text: First line of ``nsys --version``.
        flags: Every long option the export help mentions.
        include_blobs / include_json / lazy / ts_normalize / force_overwrite / dynamic_tables:
            Whether that optional flag is supported.
    """

    nsys: str
    version: str
    version_text: str
    flags: frozenset[str]
    include_blobs: bool
    include_json: bool
    lazy: bool
    ts_normalize: bool
    force_overwrite: bool
    dynamic_tables: bool

    def supports(self, flag: str) -> bool:
        """True if ``nsys export --help`` mentions ``flag`` (e.g. ``"--include-blobs"``)."""
        return flag in self.flags

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["flags"] = sorted(self.flags)
        return d


@dataclass(frozen=True)
class ExportRecord:
    """What one :func:`export_report` call did; ``to_dict()`` is meant for JSON manifests."""

    report: Path
    output: Path
    nsys: str
    nsys_version: str
    schema_version: str  # EXPORT_SCHEMA_VERSION of the written file
    flags: tuple[str, ...]
    command: tuple[str, ...]  # the export command (temporary output path included)
    duration_s: float  # wall time of import (if any) + export + verification
    size_bytes: int
    sha256: str
    imported_from_qdstrm: bool

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(report=str(self.report), output=str(self.output), flags=list(self.flags), command=list(self.command))
        return d


# --------------------------------------------------------------------------- running nsys


@dataclass(frozen=True)
class _Result:
    returncode: int
    stdout: str
    stderr: str


def _tail(text: str, n: int = _TAIL_LINES) -> str:
    # splitlines() also splits on \r, so a progress bar redrawn in place counts as many lines;
    # drop those redraws, they hide the error message.
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not _PROGRESS_RE.match(ln)]
    return "\n".join(lines[-n:])


def _indent(text: str) -> str:
    return "\n".join("    " + ln for ln in text.splitlines()) if text else "    (no output)"


def _run(cmd: list[str], timeout_s: float, *, report: Path | None = None, limit_s: float | None = None) -> _Result:
    """Run ``cmd`` in its own process group; on timeout or interrupt kill the whole group, so no
    nsys helper keeps writing into a directory we are about to delete."""
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
    except OSError as e:
        raise NsysExportError(
            f"cannot run `{shlex.join(cmd)}`: {e}; check that {cmd[0]} is an executable nsys ({INSTALL_HINT})",
            report=report,
            command=cmd,
        ) from e
    try:
        out, err = proc.communicate(timeout=max(timeout_s, 0.001))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        tail = _tail(err.decode("utf-8", "replace")) or _tail(out.decode("utf-8", "replace"))
        raise NsysExportError(
            f"{f'{report}: ' if report else ''}{Path(cmd[0]).name} {cmd[1] if len(cmd) > 1 else ''} did not "
            f"finish within {limit_s if limit_s is not None else timeout_s:g} s and was killed\n"
            f"command: {shlex.join(cmd)}\nlast lines of its output:\n{_indent(tail)}\n"
            "No output was written. What to do: raise timeout_s (large reports take minutes per GB to "
            "export) or run it on a node with more memory and a faster local disk.",
            report=report,
            command=cmd,
            output_tail=tail,
        ) from None
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return _Result(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _resolve_nsys(nsys: str) -> str:
    """Absolute path of the nsys executable: ``nsys`` is looked up on PATH unless it has a '/'."""
    if os.sep in nsys or (os.altsep and os.altsep in nsys):
        p = Path(nsys).expanduser().absolute()
        if not p.is_file():
            raise NsysExportError(f"nsys executable {p} does not exist; {INSTALL_HINT}")
        if not os.access(p, os.X_OK):
            raise NsysExportError(f"{p} is not executable (check its permissions); {INSTALL_HINT}")
        return str(p)
    found = shutil.which(nsys)
    if found is None:
        raise NsysExportError(f"`{nsys}` (Nsight Systems CLI) was not found on PATH; {INSTALL_HINT}")
    return str(Path(found).absolute())


def detect_export_capabilities(nsys: str = "nsys", *, timeout_s: float = 120) -> ExportCapabilities:
    """Run ``nsys --version`` and ``nsys export --help`` and record the installed version and
    which optional export flags (:data:`OPTIONAL_FLAGS`) it supports.

    Support is read from the help text, never inferred from the version number. Raises
    :class:`NsysExportError` if nsys is not found, cannot run, or its help does not describe an
    export command that can write SQLite.
    """
    path = _resolve_nsys(nsys)
    ver = _run([path, "--version"], timeout_s)
    ver_text = (ver.stdout + "\n" + ver.stderr).strip()
    m = _VERSION_RE.search(ver_text)
    if ver.returncode != 0 or (m is None and "nsight systems" not in ver_text.lower()):
        raise NsysExportError(
            f"`{path} --version` exited with code {ver.returncode} and printed:\n{_indent(_tail(ver_text))}\n"
            f"This does not look like a working Nsight Systems CLI; {INSTALL_HINT}",
            command=[path, "--version"],
            returncode=ver.returncode,
            output_tail=_tail(ver_text),
        )
    cmd = [path, "export", "--help"]
    helped = _run(cmd, timeout_s)
    # Some releases print help on stderr or exit non-zero after --help: judge by the text.
    help_text = helped.stdout + "\n" + helped.stderr
    flags = frozenset(_LONG_FLAG_RE.findall(help_text))
    if "--type" not in flags or "--output" not in flags or "sqlite" not in help_text.lower():
        raise NsysExportError(
            f"`{shlex.join(cmd)}` (exit code {helped.returncode}) did not describe an export command with "
            f"--type sqlite and --output; its output ended with:\n{_indent(_tail(help_text))}\n"
            "What to do: use Nsight Systems 2021.1 or later (check `nsys --version`), or repair the install; "
            + INSTALL_HINT,
            command=cmd,
            returncode=helped.returncode,
            output_tail=_tail(help_text),
        )
    first_line = next((ln.strip() for ln in ver_text.splitlines() if ln.strip()), "")
    return ExportCapabilities(
        nsys=path,
        version=m.group(1) if m else "unknown",
        version_text=first_line,
        flags=flags,
        include_blobs="--include-blobs" in flags,
        include_json="--include-json" in flags,
        lazy="--lazy" in flags,
        ts_normalize="--ts-normalize" in flags,
        force_overwrite="--force-overwrite" in flags,
        dynamic_tables="--dynamic-tables" in flags,
    )


def export_flags(caps: ExportCapabilities) -> list[str]:
    """The ``nsys export`` flags nccltrace uses with this nsys (without ``--output`` and the report).

    * ``--type sqlite``: the format :class:`nccltrace.nsys.reader.NsysExport` reads.
    * ``--lazy`` is left at its default (true): tables without rows are not created. The reader
      treats a missing table as empty, and ``--lazy=false`` only adds ~130 empty tables.
    * ``--include-blobs=true`` when supported: NCCL's extended NVTX payloads (message size,
      communicator id, root/peer, reduction op) land in ``NVTX_EVENTS.binaryData``; the default
      (false) drops them.
    * ``--include-json=true`` when supported: advanced NCCL tracing (nsys 2025.6.1+) metadata as JSON.
    * ``--quiet=true`` when supported: no progress bar (errors are still printed).
    * ``--force-overwrite=true`` when supported: we export into a fresh temporary path, so this
      only keeps nsys from refusing to write should such a file exist; the rename into place
      replaces any previous export.

    Not used: ``--ts-normalize`` (the reader rebases with ``utcEpochNs`` itself, so exports of
    old and new nsys keep the same time base) and ``--dynamic-tables=all`` (one table per payload
    schema and process; the blobs already carry the same values).
    """
    flags = ["--type", "sqlite"]
    if caps.supports("--quiet"):
        flags.append("--quiet=true")  # no progress bar: it floods the captured output, errors still print
    if caps.force_overwrite:
        flags.append("--force-overwrite=true")
    if caps.include_blobs:
        flags.append("--include-blobs=true")
    if caps.include_json:
        flags.append("--include-json=true")
    return flags


# --------------------------------------------------------------------------- .qdstrm import


def find_qdstrm_importer(nsys: str = "nsys") -> Path | None:
    """``QdstrmImporter`` of the nsys installation, or None.

    ``nsys`` is usually a chain of symlinks (Debian: ``/usr/bin/nsys`` →
    ``/usr/lib/nsight-systems/bin/nsys`` → ``…/target-linux-x64/nsys``) and the importer sits in a
    ``host-linux-*`` directory next to one of the links' directories, so each link in the chain is
    searched, then PATH.
    """
    try:
        start = Path(_resolve_nsys(nsys))
    except NsysExportError:
        return None
    chain = [start]
    p = start
    for _ in range(40):  # symlink loops
        if not p.is_symlink():
            break
        target = Path(os.readlink(p))
        p = target if target.is_absolute() else p.parent / target
        chain.append(p)
    chain.append(Path(os.path.realpath(start)))
    for link in chain:
        for base in (link.parent, link.parent.parent):
            for cand in sorted(base.glob("host-*/QdstrmImporter")):
                if cand.is_file() and os.access(cand, os.X_OK):
                    return cand
    found = shutil.which("QdstrmImporter")
    return Path(found) if found else None


def _import_qdstrm(qdstrm: Path, work: Path, nsys: str, timeout_s: float) -> Path:
    """Import ``qdstrm`` into ``work`` and return the ``.nsys-rep`` written there."""
    importer = find_qdstrm_importer(nsys)
    if importer is None:
        raise NsysExportError(
            f"{qdstrm}: this is an unimported capture (.qdstrm), and no QdstrmImporter was found next to "
            f"{nsys} (searched host-linux-*/ along its symlink chain) or on PATH. What to do: import it with "
            "the QdstrmImporter of the nsys that captured it (`QdstrmImporter --input-file "
            f"{qdstrm.name}` writes {qdstrm.stem}.nsys-rep), then export that .nsys-rep",
            report=qdstrm,
        )
    # Without --output-file the importer writes beside the capture (resolving symlinks, so a
    # link in `work` does not help); the imported report is only an intermediate here.
    rep = work / (qdstrm.stem + ".nsys-rep")
    cmd = [str(importer), "--input-file", str(qdstrm.absolute()), "--output-file", str(rep)]
    res = _run(cmd, timeout_s, report=qdstrm, limit_s=timeout_s)
    if res.returncode != 0 or not rep.is_file() or rep.stat().st_size == 0:
        tail = _tail(res.stderr) or _tail(res.stdout)
        raise NsysExportError(
            f"{qdstrm}: importing the .qdstrm failed (exit code {res.returncode}"
            f"{'' if rep.is_file() else ', no .nsys-rep written'})\ncommand: {shlex.join(cmd)}\n"
            f"last lines of its output:\n{_indent(tail)}\n"
            "What to do: the capture is probably incomplete (the profiled job was killed before nsys "
            "finished); if the importer lacks a library (e.g. libssh.so), install it or import on a machine "
            "with a complete Nsight Systems, then export the .nsys-rep",
            report=qdstrm,
            command=cmd,
            returncode=res.returncode,
            output_tail=tail,
        )
    return rep


# --------------------------------------------------------------------------- export


def _check_report(report: Path) -> None:
    if not report.exists():
        raise NsysExportError(
            f"{report}: report does not exist; pass the .nsys-rep written by `nsys profile -o ...` (check "
            "the path, and that the profiled job finished: nsys writes the report when the program exits)",
            report=report,
        )
    if not report.is_file():
        raise NsysExportError(f"{report}: not a regular file; pass the .nsys-rep report", report=report)
    if report.stat().st_size == 0:
        raise NsysExportError(
            f"{report}: report is empty (0 bytes); the capture was interrupted before nsys wrote it - "
            "re-run the capture",
            report=report,
        )
    with open(report, "rb") as fh:
        if fh.read(len(_SQLITE_MAGIC)) == _SQLITE_MAGIC:
            raise NsysExportError(
                f"{report}: this is already an SQLite export, not an nsys report; read it directly",
                report=report,
            )


def _verify_export(path: Path, fail: Callable[[str], NoReturn], *, integrity_check: bool) -> str:
    """Check that ``path`` is a complete nsys SQLite export; return its schema version.

    ``fail(problem)`` raises the error. Done before the rename so that a bad file never
    appears under the output name.
    """
    if not path.is_file():
        found = sorted(p.name for p in path.parent.iterdir())
        fail(f"nsys exited with code 0 but wrote no {path.name} (the temporary directory held: {found or 'nothing'})")
    size = path.stat().st_size
    if size == 0:
        fail("nsys exited with code 0 but the export is empty (0 bytes)")
    with open(path, "rb") as fh:
        header = fh.read(100)
    if not header.startswith(_SQLITE_MAGIC) or len(header) < 100:
        fail(f"nsys exited with code 0 but wrote a file that is not SQLite ({size} bytes, header {header[:16]!r})")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # The header's page count is only valid when "version-valid-for" equals the change counter.
    if pages and header[92:96] == header[24:28] and size < page_size * pages:
        fail(f"the export is truncated (SQLite header says {page_size * pages} bytes, file has {size})")
    try:
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as e:
        fail(f"the export cannot be opened as SQLite ({e})")
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        meta = next((t for t in _META_TABLES if t in tables), None)
        # Every nsys export has the metadata table and StringIds (the reader needs both).
        missing = [t for t in ("StringIds",) if t not in tables] + ([] if meta else ["/".join(_META_TABLES)])
        if missing:
            fail(f"the SQLite file lacks table(s) {', '.join(missing)} that every nsys export has")
        rows = dict(conn.execute(f"SELECT name, value FROM {meta}").fetchall())
        conn.execute("SELECT COUNT(*) FROM StringIds").fetchone()
        if integrity_check:
            bad = [r[0] for r in conn.execute("PRAGMA quick_check")]
            if bad != ["ok"]:
                fail(f"SQLite integrity check failed: {'; '.join(bad[:3])}")
    except sqlite3.DatabaseError as e:
        fail(f"the export cannot be read as SQLite ({e})")
    finally:
        conn.close()
    version = rows.get("EXPORT_SCHEMA_VERSION")
    if not version and rows.get("EXPORT_SCHEMA_VERSION_MAJOR") is not None:
        version = ".".join(str(rows.get(f"EXPORT_SCHEMA_VERSION_{k}") or 0) for k in ("MAJOR", "MINOR", "MICRO"))
    return str(version or "")


def _sync_and_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb+") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
        os.fsync(fh.fileno())  # the rename must not become visible before the data
    return h.hexdigest()


def export_report(
    report: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    nsys: str = "nsys",
    timeout_s: float = 3600,
    caps: ExportCapabilities | None = None,
    integrity_check: bool = True,
) -> ExportRecord:
    """Export ``report`` (``.nsys-rep``/``.qdrep``, or an unimported ``.qdstrm``) to the SQLite
    file ``output`` and return what was done.

    The export is written into a temporary directory beside ``output``, checked (SQLite header,
    opens read-only, has the metadata table and ``StringIds``, and with ``integrity_check``
    ``PRAGMA quick_check`` passes), fsynced and renamed onto ``output``, replacing any previous
    file. On any failure no new file appears at ``output`` (a previous one is left untouched), the
    temporary directory is removed, and :class:`NsysExportError` says what happened and what to
    do. Nothing is written beside the report (a ``.qdstrm`` is imported in the temporary directory).

    Args:
        report: The nsys report.
        output: Destination ``.sqlite`` (its directory is created).
        nsys: nsys executable (name on PATH or path); ignored when ``caps`` is given.
        timeout_s: Limit for import + export together; nsys is killed when it is exceeded.
        caps: From :func:`detect_export_capabilities` (detected now if None; pass it to export
            many reports without re-running ``nsys export --help`` each time).
        integrity_check: Run ``PRAGMA quick_check`` (reads every page; a few seconds per GB).
    """
    report = Path(report)
    output = Path(output)
    _check_report(report)
    if output.absolute() == report.absolute() or (output.exists() and output.samefile(report)):
        raise NsysExportError(f"{output}: output must differ from the report", report=report)
    caps = caps or detect_export_capabilities(nsys)
    flags = export_flags(caps)
    output.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # A directory (not a file) because nsys refuses to write over an existing file unless
    # --force-overwrite is supported; same directory as output so the rename is atomic.
    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    try:
        imported = report.suffix == ".qdstrm"
        source = _import_qdstrm(report, work, caps.nsys, timeout_s) if imported else report.absolute()
        tmp_out = work / "export.sqlite"  # .sqlite suffix: some releases append it otherwise
        cmd = [caps.nsys, "export", *flags, "--output", str(tmp_out), str(source)]
        res = _run(cmd, timeout_s - (time.monotonic() - t0), report=report, limit_s=timeout_s)
        tail = _tail(res.stderr) or _tail(res.stdout)

        def fail(problem: str) -> NoReturn:
            raise NsysExportError(
                f"nsys export of {report} failed: {problem}\n"
                f"command: {shlex.join(cmd)}\nexit code: {res.returncode}\n"
                f"last lines of nsys output:\n{_indent(tail)}\n"
                f"No output was written to {output}. What to do: check that the report is complete (the "
                "profiled job ended normally and the file was fully copied), that there is free space in "
                f"{output.parent}, and that this nsys ({caps.version}) is not older than the one that made the "
                "capture; re-run the command above by hand to see all of nsys's output.",
                report=report,
                command=cmd,
                returncode=res.returncode,
                output_tail=tail,
            )

        if res.returncode != 0:
            fail(f"nsys exited with code {res.returncode}")
        schema_version = _verify_export(tmp_out, fail, integrity_check=integrity_check)
        digest = _sync_and_hash(tmp_out)
        size = tmp_out.stat().st_size
        os.replace(tmp_out, output)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ExportRecord(
        report=report,
        output=output,
        nsys=caps.nsys,
        nsys_version=caps.version,
        schema_version=schema_version,
        flags=tuple(flags),
        command=tuple(cmd),
        duration_s=round(time.monotonic() - t0, 3),
        size_bytes=size,
        sha256=digest,
        imported_from_qdstrm=imported,
    )
