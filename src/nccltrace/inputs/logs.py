"""Find NCCL debug logs by their content, whatever their names and however they were captured.

Practitioners bring logs as their launcher left them: one file per process, one per rank
(any name, gzipped), or one combined stdout of every rank with launcher prefixes, NCCL lines
among the application's output. A line belongs to the process its NCCL prefix names, whichever
file it is in; application lines that are evidence (Megatron's iteration lines, PyTorch's
process-group lines) go to the process sharing their launcher prefix. :func:`discover_logs`
splits every file into one normalised ``nccl_<host>_<pid>.log`` per process, with a
``sources.json`` saying where each line came from. Formats recognised: ``docs/architecture.md``,
Module notes.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nccltrace.megatron.training_log import is_iteration_line
from nccltrace.pytorch.log_lines import is_pg_comm_line

__all__ = ["DiscoveredLogs", "LAUNCHER_PREFIX", "NCCL_PREFIX", "RankNamePattern", "discover_logs", "is_canonical_log"]

NCCL_PREFIX = re.compile(rb"(?:\[[^\]\n]*\] |\d{9,11}\.\d+ )?(?P<host>[A-Za-z0-9_.\-]+):(?P<pid>\d+):(?P<tid>\d+) "
                         rb"\[(?P<dev>-?\d+)\] NCCL (?:INFO|WARN|TRACE|ABORT)")
"""The prefix NCCL writes on every debug line: ``host:pid:tid [cudaDev] NCCL <level>``, after a
timestamp with NCCL >= 2.26 (``[2025-10-09 08:53:20.148524] `` or ``1760000000.148524 ``)."""
LAUNCHER_PREFIX = re.compile(
    rb"^(?:\s*\d+: "  # srun --label
    rb"|\[(?:default|rank)\d+\]:\s?"  # torchrun --tee / --redirects (older and newer spelling)
    rb"|\[\d+,\d+\]<std(?:out|err)>:\s?)"  # Open MPI --tag-output
)
"""The per-line prefixes launchers add to a combined stdout/stderr."""
NCCL_BODY = re.compile(rb"NCCL (?:INFO|WARN)|^\s*[A-Za-z]+: opCount ")
"""NCCL text on a line whose process prefix is missing (a line torn by another writer, or cut)."""
CANONICAL = re.compile(r"^nccl_(?P<host>.+)_(?P<pid>\d+)$")
_TEXT_SUFFIXES = {".log", ".txt", ".out", ".err", ""}
_SAMPLE = 1 << 16  # bytes read to decide whether a file holds NCCL lines


def is_canonical_log(path: Path) -> bool:
    """A per-process log as ``NCCL_DEBUG_FILE=nccl_%h_%p.log`` names it (used in place)."""
    return path.suffix == ".log" and CANONICAL.match(path.stem) is not None


@dataclass
class DiscoveredLogs:
    """The per-process logs found (stem ``nccl_<host>_<pid>`` -> path) and what was set aside."""

    logs: dict[str, Path] = field(default_factory=dict)
    sources: dict[str, list[str]] = field(default_factory=dict)  # stem -> the files its lines came from
    skipped_lines: dict[str, int] = field(default_factory=dict)  # file -> non-NCCL lines skipped
    unattributed: dict[str, int] = field(default_factory=dict)  # file -> NCCL lines no process prefix names
    launcher_ranks: dict[str, dict[str, object]] = field(default_factory=dict)  # stem -> rank a prefix names
    ignored: list[Path] = field(default_factory=list)  # files without NCCL lines

    def notes(self) -> list[str]:
        """What the console says about the discovery (one line each)."""
        out = []
        split = {s: f for s, f in self.sources.items() if f and not (len(f) == 1 and f[0].endswith(f"{s}.log"))}
        if split:
            files = sorted({f for fs in split.values() for f in fs})
            out.append(f"NCCL lines of {len(split)} process(es) found by content in {len(files)} file(s) "
                       f"({', '.join(Path(f).name for f in files[:4])}{' ...' if len(files) > 4 else ''}); "
                       "normalised to one nccl_<host>_<pid>.log per process (sources.json maps their lines back)")
        skipped = sum(self.skipped_lines.values())
        if skipped:
            out.append(f"{skipped} application line(s) without an NCCL prefix skipped")
        return out

    def problems(self) -> list[str]:
        """What makes the run partial: NCCL lines of a file holding several processes that name
        no process (torn or cut prefixes), so their records are missing from the analysis."""
        return [f"{path}: {n} NCCL line(s) without a process prefix (torn by another writer, or cut) cannot be "
                "given to one of the file's processes and are not analysed; write one log per process "
                "(NCCL_DEBUG_FILE=nccl_%h_%p.log) to keep every record"
                for path, n in sorted(self.unattributed.items())]


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _inner_suffix(path: Path) -> str:
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def _holds_nccl_lines(path: Path) -> bool:
    try:
        with _open(path) as f:
            head = f.read(_SAMPLE)
    except (OSError, EOFError):
        return False
    if b"\x00" in head[:4096]:
        return False  # binary (an export, a report)
    return NCCL_PREFIX.search(head) is not None or NCCL_BODY.search(head) is not None


def _records(line: bytes) -> Iterator[tuple[bytes | None, bytes | None, bytes]]:
    """(host, pid, record) of each NCCL record in a line (a line torn by two writers can hold
    two), launcher prefix removed; nothing for application output; (None, None, text) for NCCL
    text whose process prefix is missing."""
    m = LAUNCHER_PREFIX.match(line)
    body = line[m.end():] if m else line
    first = NCCL_PREFIX.match(body)  # NCCL's prefix begins the line (elsewhere it is quoted text)
    if first is None:
        if NCCL_BODY.search(body):
            yield None, None, body.rstrip(b"\r\n")
        return
    starts = [first, *NCCL_PREFIX.finditer(body, first.end())]
    for i, x in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(body)
        rec = body[x.start():end].rstrip(b"\r\n")
        yield x.group("host"), x.group("pid"), rec


def discover_logs(roots: Iterable[Path], dest: Path, *, exclude: Iterable[Path] = ()) -> DiscoveredLogs:
    """Find every file under ``roots`` that holds NCCL debug lines and give each process one log.

    Canonical per-process logs (``nccl_<host>_<pid>.log``) are used in place; every other file
    (any name, ``.gz`` too) is split by the process in each line's NCCL prefix into
    ``dest/nccl_<host>_<pid>.log``. Raises ``ValueError`` when a process's lines are in a
    canonical log and in another file as well (the same lines twice: remove one)."""
    found = DiscoveredLogs()
    split_files = []
    for p in _candidate_files(roots, exclude):
        if is_canonical_log(p):
            found.logs[p.stem] = p
            found.sources[p.stem] = [str(p)]
        elif _holds_nccl_lines(p):
            split_files.append(p)
        elif _inner_suffix(p) in (".log", ".txt"):
            found.ignored.append(p)
    if not split_files:
        return found
    dest.mkdir(parents=True, exist_ok=True)
    splitter = _Splitter(found, dest)
    try:
        for p in split_files:
            splitter.split_file(p)
    finally:
        splitter.close()
    splitter.keep_single_process_files()
    found.unattributed = splitter.orphans
    found.launcher_ranks = launcher_ranks(splitter.labels_of)
    origin, stems_of = splitter.origin, splitter.stems_of
    own_files = {stem: runs[0][0] for stem, runs in origin.items()
                 if len(runs) == 1 and stems_of.get(runs[0][0]) == {stem}}
    (dest / "sources.json").write_text(json.dumps(
        {"doc": "per normalised log: runs of [source file, first source line, number of lines], in order; "
                "launcher_ranks: the global rank a launcher prefix names (see log_discovery.launcher_ranks); "
                "own_files: the source file that holds this process's lines and no other's (its name may carry "
                "the rank: log_discovery.RankNamePattern)",
         "logs": origin, "launcher_ranks": found.launcher_ranks, "own_files": own_files}, indent=1))  # fmt: skip
    return found


def _candidate_files(roots: Iterable[Path], exclude: Iterable[Path]) -> list[Path]:
    """The files under ``roots`` (in sorted order per root) that may hold NCCL lines: text-like
    names or names starting with ``nccl``, outside ``exclude``."""
    excluded = [Path(e).resolve() for e in exclude]
    files: list[Path] = []
    for root in roots:
        root = Path(root)
        cands = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in cands:
            rp = p.resolve()
            if any(rp == e or e in rp.parents for e in excluded):
                continue
            if _inner_suffix(p) not in _TEXT_SUFFIXES and not p.name.startswith("nccl"):
                continue
            files.append(p)
    return files


class _Splitter:
    """Splits files holding several processes' NCCL lines into one ``nccl_<host>_<pid>.log`` per
    process under ``dest``, recording where each line came from."""

    def __init__(self, found: DiscoveredLogs, dest: Path) -> None:
        self.found = found
        self.dest = dest
        self.handles: dict[str, object] = {}
        self.origin: dict[str, list[list]] = {}  # stem -> [file, first line, count] runs
        self.orphans: dict[str, int] = {}  # file -> NCCL lines without a process prefix
        self.stems_of: dict[str, set[str]] = {}  # file -> processes whose records it holds
        self.labels_of: dict[str, dict[bytes, set[str]]] = {}  # file -> launcher label -> processes

    def put(self, stem: str, rec: bytes, p: Path, n: int) -> None:
        """Write line ``n`` of ``p`` (``rec``) to process ``stem``'s log."""
        self.handles[stem].write(rec + b"\n")
        runs = self.origin[stem]
        if runs and runs[-1][0] == str(p) and runs[-1][1] + runs[-1][2] == n:
            runs[-1][2] += 1
        else:
            runs.append([str(p), n, 1])

    def _open_log(self, stem: str, p: Path, n: int) -> None:
        """Start process ``stem``'s normalised log (its first line is line ``n`` of ``p``)."""
        found = self.found
        if stem in found.logs:
            raise ValueError(
                f"{p}:{n}: lines of process {stem[5:].replace('_', ':', 1)} are also in "
                f"{found.logs[stem]}: the same process's log twice; keep one of them")
        self.handles[stem] = open(self.dest / f"{stem}.log", "wb")
        found.logs[stem] = self.dest / f"{stem}.log"
        found.sources[stem] = []
        self.origin[stem] = []

    def split_file(self, p: Path) -> None:
        """Give each NCCL record of ``p`` to the process its prefix names."""
        found, handles, orphans, put = self.found, self.handles, self.orphans, self.put
        key = str(p)
        skipped = 0
        # Megatron's iteration lines and PyTorch's process-group lines carry no NCCL prefix: they
        # go to the process whose NCCL lines carry the same launcher label (one process per
        # label, else they are skipped)
        label_stems = self.labels_of.setdefault(key, {})  # label -> the processes it has prefixed so far
        waiting: dict[bytes, list[tuple[int, bytes]]] = {}
        with _open(p) as f:
            for n, line in enumerate(f, 1):
                got = False
                launcher = LAUNCHER_PREFIX.match(line)
                label = launcher.group(0).strip() if launcher else None
                for host, pid, rec in _records(line):
                    got = True
                    if host is None:
                        orphans[key] = orphans.get(key, 0) + 1
                        continue
                    stem = f"nccl_{host.decode('utf-8', 'replace')}_{int(pid)}"
                    if stem not in handles:
                        self._open_log(stem, p, n)
                    if label is not None:
                        if label not in label_stems:  # its first process: lines that waited for it
                            for wn, wrec in waiting.pop(label, []):
                                put(stem, wrec, p, wn)
                        label_stems.setdefault(label, set()).add(stem)
                    put(stem, rec, p, n)
                    if key not in found.sources[stem]:
                        found.sources[stem].append(key)
                    self.stems_of.setdefault(key, set()).add(stem)
                if not got:
                    body = line[launcher.end():].rstrip(b"\r\n") if launcher else b""
                    if label is not None and (is_iteration_line(body) or is_pg_comm_line(body)):
                        owners = label_stems.get(label)
                        if owners is None:
                            waiting.setdefault(label, []).append((n, body))
                            continue
                        if len(owners) == 1:  # a label of several processes names none
                            put(next(iter(owners)), body, p, n)
                            continue
                    skipped += 1
        skipped += sum(len(w) for w in waiting.values())
        if skipped:
            found.skipped_lines[key] = skipped

    def close(self) -> None:
        for h in self.handles.values():
            h.close()

    def keep_single_process_files(self) -> None:
        """A file of one process is kept whole (application output included), so the log
        reader's own recoveries (torn lines, records whose prefix was cut) still apply."""
        found, dest = self.found, self.dest
        for path, stems in self.stems_of.items():
            (stem,) = stems if len(stems) == 1 else (None,)
            if stem is not None and found.sources[stem] == [path]:
                n = 0
                with _open(Path(path)) as src, open(dest / f"{stem}.log", "wb") as out:
                    for n, chunk in enumerate(src, 1):
                        out.write(chunk)
                self.origin[stem] = [[path, 1, n]]
                self.orphans.pop(path, None)


_RANK_LABEL = re.compile(rb"^\[rank(\d+)\]:?$")  # torchrun: the global rank
_TASK_LABEL = re.compile(rb"^(\d+):$|^\[\d+,(\d+)\]<std(?:out|err)>:?$")  # srun --label task; Open MPI rank


def launcher_ranks(labels_of: dict[str, dict[bytes, set[str]]]) -> dict[str, dict[str, object]]:
    """Per process (normalised log stem): the global rank its launcher prefix names, where it
    names one. torchrun's ``[rankN]:`` is the global rank. ``srun --label``'s ``N:`` and Open
    MPI's ``[J,N]<stdout>:`` are the task's rank, the global rank only when every task is one
    process: taken only where, in its file, every such label belongs to one process and no process
    has two. torchrun's ``[defaultN]:`` is a local rank (every node has one): never taken."""
    out: dict[str, dict[str, object]] = {}
    for path, labels in labels_of.items():
        per_stem: dict[str, list[bytes]] = {}
        for label, stems in labels.items():
            for stem in stems:
                per_stem.setdefault(stem, []).append(label)
        one_to_one = all(len(stems) == 1 for stems in labels.values()) and all(
            len(ls) == 1 for ls in per_stem.values())
        for stem, ls in per_stem.items():
            if len(ls) != 1 or stem in out:
                continue
            m = _RANK_LABEL.match(ls[0])
            t = _TASK_LABEL.match(ls[0]) if m is None and one_to_one else None
            rank = int(m.group(1)) if m else int(t.group(1) or t.group(2)) if t else None
            if rank is not None:
                out[stem] = {"rank": rank, "prefix": ls[0].decode("utf-8", "replace"), "file": path}
    return out


class RankNamePattern:
    """A log file name that carries the global rank, as the user's launch wrote it, e.g.
    ``NCCL_DEBUG_FILE=logs/nccl.${SLURM_PROCID}.%h.%p`` gives the pattern ``nccl.{rank}.%h.%p``.

    ``{rank}`` is the global rank (``RANK``, ``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``: the user
    says which number it is; a local rank would be wrong, so nothing here guesses); ``%h`` and
    ``%p`` are NCCL's host and pid, checked against the process's own; ``*`` and ``?`` are shell
    wildcards within one path component. A pattern with ``/`` matches the last components of the
    path (``rank{rank}/nccl.log``); a ``.gz`` after the match is allowed (a compressed copy)."""

    def __init__(self, pattern: str) -> None:
        pattern = str(pattern).strip()
        if pattern.count("{rank}") != 1:
            raise ValueError(f"log name pattern {pattern!r}: needs exactly one {{rank}} where the name carries the "
                             "global rank, e.g. 'nccl.{rank}.%h.%p' for NCCL_DEBUG_FILE=nccl.${SLURM_PROCID}.%h.%p")
        self.pattern = pattern
        self.components = pattern.count("/") + 1
        parts = re.split(r"(\{rank\}|%h|%p|\*|\?)", pattern)
        regex = {"{rank}": r"(?P<rank>\d+)", "%h": r"(?P<host>[^/]+?)", "%p": r"(?P<pid>\d+)", "*": r"[^/]*",
                 "?": r"[^/]"}
        self._regex = re.compile("".join(regex.get(x, re.escape(x)) for x in parts) + r"(?:\.gz)?")

    def rank_of(self, path: str | Path, host: str, pid: int) -> int | None:
        """The global rank ``path``'s name carries for process ``host:pid``; None when the name
        does not match, or its ``%h``/``%p`` name another process."""
        tail = "/".join(Path(path).parts[-self.components:])
        m = self._regex.fullmatch(tail)
        if m is None:
            return None
        got = m.groupdict()
        if got.get("pid") is not None and int(got["pid"]) != int(pid):
            return None
        if got.get("host") is not None and got["host"] != host and got["host"].split(".")[0] != host.split(".")[0]:
            return None
        return int(got["rank"])
