"""Property-based tests of the NCCL log reader on mutated real logs.

Inputs are the real public log excerpts (``tests/data/fixtures/nccl-logs``) and one small emulated log
with NCCL >= 2.26 timestamps. Hypothesis damages them the way logs get damaged in practice: cut at
any byte (mid-line, mid-UTF-8 sequence), torn by a process sharing stdout (a line cut, another line
spliced in, the tail on a later line), bytes inserted or overwritten (non-UTF-8, NUL, CR, LF), lines
shuffled, files concatenated across NCCL versions, the same file given twice. Properties:

* the reader never fails on such input (FileNotFoundError only when there is no log at all);
* every intact call line (bytes untouched) is recovered at its new line number with the same fields;
* a damaged call line is reported (an ``unclassified`` row or an issue at one of its lines) or is
  recovered with values of a real call, never with a plausible wrong value;
* the compiled fast path and the line-by-line path give identical tables and reports;
* a file given twice is parsed once and flagged, a copy of part of it is flagged by its processes;
  concatenated logs of several NCCL versions are reported as such.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from data_paths import FIXTURE_LOGS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nccltrace.emulator.run import emulate_run
from nccltrace.nccl.log_reader import TABLE_NAMES, parse_logs

FIXTURE_DIR = FIXTURE_LOGS
FIXTURES = sorted(p.name for p in FIXTURE_DIR.glob("*.log"))
EMULATED = "emulated-2.27.3-timestamps.log"
SOURCES = FIXTURES + [EMULATED]
WITH_CALLS = [n for n in FIXTURES if b": opCount " in (FIXTURE_DIR / n).read_bytes()] + [EMULATED]

# Reproducible in CI and nothing written into the repository (no example database).
BASE = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

MESSAGE_FIELDS = ("op", "op_count", "sendbuff", "recvbuff", "count", "datatype", "redop", "root", "comm", "nranks",
                  "stream")
PREFIX_FIELDS = ("pid", "tid", "cuda_dev", "wall_time_ns")
# Bytes that can never complete a number, pointer, op name or separator of a call line, nor be
# stripped as whitespace: a call line damaged with them must not decode into another valid call.
JUNK = [b"\x00", b"\xff", b"\xc3", b"\x80", b"\xe2\x80\xa6", b"#", b"~", b"_"]
# Everything else damage brings: line breaks, CR, a valid multi-byte UTF-8 sequence.
ANY_BYTES = JUNK + [b"\n", b"\r", b"\r\n", b"\xc3\xa9", b" "]
_RECORD_PREFIX = re.compile(rb"[A-Za-z0-9_.\-]+:\d+:\d+ \[-?\d+\] ")


def test_sources_are_there(fixture_logs):
    assert len(FIXTURES) >= 20, f"real NCCL log fixtures missing in {FIXTURE_DIR}"


# --- sources and their pristine parse ---------------------------------------------------------
@functools.cache
def _source(name: str) -> bytes:
    if name != EMULATED:
        return (FIXTURE_DIR / name).read_bytes()
    settings_ = {"model": "tiny", "num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                 "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 2, "iterations": 1, "tp": 2,
                 "nodes": 1, "gpus_per_node": 2, "nccl_version": "2.27.3", "nsys_version": "2024.6", "seed": 5,
                 "precision": "bf16", "nccl_timestamps": True}
    with tempfile.TemporaryDirectory() as d:
        res = emulate_run(settings_, Path(d))
        return res.log_files[0].read_bytes()  # rank 0: calls, TUNING lines, topology, timestamps


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="nccl-props-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _parse(paths: list[Path], out: Path, **kw):
    report = parse_logs(paths, out, **kw)
    tables = {name: pq.read_table(out / f"{name}.parquet") for name in TABLE_NAMES}
    return report, tables


def _by_line(calls) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = collections.defaultdict(list)
    for row in calls.to_pylist():
        out[row["line"]].append(row)
    return out


def _lines(data: bytes) -> list[bytes]:
    """Lines as the reader counts them: split at LF only (a CR alone does not end a line)."""
    out = [line + b"\n" for line in data.split(b"\n")]
    out[-1] = out[-1][:-1]  # what follows the last LF
    return out if out[-1] else out[:-1]


@dataclass(frozen=True)
class Baseline:
    calls: dict[int, list[dict]]  # line -> call rows of the pristine file
    messages: frozenset  # message field tuples of all its calls
    versions: frozenset


@functools.cache
def _baseline(name: str) -> Baseline:
    with _workdir() as d:
        (d / "in.log").write_bytes(_source(name))
        report, tables = _parse([d / "in.log"], d / "out", fast=False)
    calls = _by_line(tables["calls"])
    return Baseline(calls, frozenset(_msg(r) for rows in calls.values() for r in rows),
                    frozenset(report.files[0].versions))


def _msg(row: dict) -> tuple:
    return tuple(row[f] for f in MESSAGE_FIELDS)


# --- a document as segments with provenance ----------------------------------------------------
@dataclass
class Seg:
    data: bytes
    origin: tuple[str, int] | None  # (source, line) while the bytes are an untouched original line
    was: tuple[str, int] | None  # the original line it came from, damaged or not


def _segments(name: str) -> list[Seg]:
    return [Seg(line, (name, i), (name, i)) for i, line in enumerate(_lines(_source(name)), 1)]


def _locate(segs: list[Seg], offset: int) -> tuple[int, int]:
    """(segment index, offset inside it) of a byte offset of the joined document."""
    for i, s in enumerate(segs):
        if offset < len(s.data):
            return i, offset
        offset -= len(s.data)
    return len(segs) - 1, len(segs[-1].data)


def _damage(seg: Seg, data: bytes) -> Seg:
    return Seg(data, None, seg.was)


def _mutate(draw, segs: list[Seg], alphabet: list[bytes], ops: list[str]) -> list[Seg]:
    """Apply 1..5 drawn mutations (``ops``) to the segments."""
    for _ in range(draw(st.integers(1, 5))):
        size = sum(len(s.data) for s in segs)
        if not segs or not size:
            break
        op = draw(st.sampled_from(ops))
        if op == "hit_call":
            # Damage a byte of a call line itself (most bytes of a log are not in one).
            targets = [i for i, s in enumerate(segs) if s.was and s.data and _baseline(s.was[0]).calls.get(s.was[1])]
            if not targets:
                continue
            i = draw(st.sampled_from(targets))
            k = draw(st.integers(0, len(segs[i].data) - 1))
            junk = draw(st.sampled_from(alphabet))
            data = segs[i].data
            segs[i] = _damage(segs[i], data[:k] + junk + data[k + draw(st.integers(0, 1)):])
        elif op == "truncate":
            i, k = _locate(segs, draw(st.integers(0, size - 1)))
            segs = segs[:i] + ([_damage(segs[i], segs[i].data[:k])] if k else [])
        elif op in ("overwrite", "insert"):
            i, k = _locate(segs, draw(st.integers(0, size - 1)))
            junk = draw(st.sampled_from(alphabet))
            data = segs[i].data
            data = data[:k] + junk + data[k + (len(junk) if op == "overwrite" else 0):]
            segs[i] = _damage(segs[i], data)
        elif op == "tear" and len(segs) >= 2:
            # Process A wrote the head of line i, process B its whole line j, A's tail comes later.
            i, j = draw(st.integers(0, len(segs) - 1)), draw(st.integers(0, len(segs) - 1))
            if i == j:
                continue
            head_len = len(segs[i].data.rstrip(b"\n"))
            if head_len < 2:
                continue
            c = draw(st.integers(1, head_len - 1))
            a, b = segs[i], segs[j]
            at = i - (j < i)  # where line i was, once line j is taken out
            segs = [s for k, s in enumerate(segs) if k not in (i, j)]
            segs.insert(at, _damage(a, a.data[:c] + b.data))
            segs.insert(min(at + 1 + draw(st.integers(0, 3)), len(segs)), Seg(a.data[c:], None, a.was))
        elif op == "shuffle" and len(segs) >= 2:
            a = draw(st.integers(0, len(segs) - 2))
            b = draw(st.integers(a + 2, min(a + 40, len(segs))))
            segs = segs[:a] + draw(st.permutations(segs[a:b])) + segs[b:]
    return segs


def _layout(segs: list[Seg]) -> tuple[bytes, list[tuple[Seg, int, int]]]:
    """The document bytes and, per non-empty segment, (segment, first line, last line) in it. A
    segment glued to the unterminated line before it is no longer an intact line."""
    spans, nl, at_line_start = [], 0, True
    for s in segs:
        if not s.data:
            continue
        if not at_line_start and s.origin is not None:
            s = _damage(s, s.data)
        spans.append((s, nl + 1, nl + 1 + s.data[:-1].count(b"\n")))
        nl += s.data.count(b"\n")
        at_line_start = s.data.endswith(b"\n")
    return b"".join(s.data for s in segs), spans


# --- the properties ---------------------------------------------------------------------------
def _check_recovery(segs: list[Seg], report, tables, *, strict: bool) -> None:
    """Intact call lines keep their fields; with ``strict`` (junk-only damage) every damaged call
    line is reported or recovered with the values of a real call."""
    _, spans = _layout(segs)
    calls = _by_line(tables["calls"])
    unclassified = set(tables["unclassified"].column("line").to_pylist())
    issue_lines = {i["line"] for f in report.files for i in f.issues if i["line"] is not None}
    reported = unclassified | issue_lines
    sources = {s.was[0] for s in segs if s.was}
    known_messages = set().union(*(_baseline(n).messages for n in sources)) if sources else set()
    intact_lines = set()
    for seg, first, last in spans:
        if seg.origin is None or not seg.data.endswith(b"\n"):
            continue
        intact_lines.add(first)
        want = _baseline(seg.origin[0]).calls.get(seg.origin[1], [])
        got = calls.get(first, [])
        assert sorted(map(_msg, got)) == sorted(map(_msg, want)), (seg.origin, first, seg.data)
        for g, w in zip(sorted(got, key=_msg), sorted(want, key=_msg)):
            if w["recovery"] not in ("rejoined", "no_prefix"):  # an orphan tail takes a waiting prefix
                assert [g[f] for f in PREFIX_FIELDS] == [w[f] for f in PREFIX_FIELDS], (seg.origin, first)
            if w["recovery"] is None and g["recovery"] is None:
                assert g["host"] == w["host"], (seg.origin, first)
    for line, rows in calls.items():
        if line in intact_lines:
            continue
        for row in rows:
            # No phantom call: a call read from a damaged line is flagged, sits on a reported line,
            # or carries the message of a call that really was logged.
            ok = row["recovery"] is not None or line in reported or _msg(row) in known_messages
            assert ok or not strict, (line, row)
    if not strict:
        return
    for seg, first, last in spans:
        if seg.origin is not None or seg.was is None or not _baseline(seg.was[0]).calls.get(seg.was[1]):
            continue
        lines = range(first, last + 1)
        # A damaged call line leaves a trace: a call, an unclassified row or an issue on its lines
        # (or on the lines of the other pieces of the same original line).
        pieces = [range(f, l + 1) for s, f, l in spans if s.was == seg.was]
        assert any(n in calls or n in reported for r in pieces for n in r), (seg.was, list(lines), seg.data)


def _nan_safe(rows: list[dict]) -> list[dict]:
    return [{k: "NaN" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows]


def _assert_fast_equals_slow(paths: list[Path], d: Path, block_size: int):
    slow = _parse(paths, d / "slow", fast=False)
    fast = _parse(paths, d / "fast", fast=True, block_size=block_size)
    assert fast[0].as_dict() == slow[0].as_dict()
    for name in TABLE_NAMES:
        a, b = slow[1][name], fast[1][name]
        assert a.schema == b.schema, name
        if not a.equals(b):  # NaN-tolerant row comparison
            assert _nan_safe(a.to_pylist()) == _nan_safe(b.to_pylist()), name
    return slow


@settings(BASE, max_examples=45)
@given(st.data())
def test_junk_damage_never_yields_a_wrong_call_and_keeps_intact_lines(data):
    """Truncation, junk bytes (NUL, non-UTF-8, cut UTF-8 sequences, '#') and torn lines: intact call
    lines are recovered unchanged, damaged ones are reported or keep a real call's values."""
    name = data.draw(st.sampled_from(WITH_CALLS if data.draw(st.booleans()) else SOURCES), label="source")
    ops = ["truncate", "overwrite", "insert", "tear", "shuffle", "hit_call", "hit_call"]
    segs = _mutate(data.draw, _segments(name), JUNK, ops)
    doc, _ = _layout(segs)
    with _workdir() as d:
        (d / "damaged.log").write_bytes(doc)
        report, tables = _parse([d / "damaged.log"], d / "out")
    _check_recovery(segs, report, tables, strict=True)


def test_every_single_byte_damage_of_every_real_call_line_is_reported_or_harmless():
    """Exhaustive companion of the property above: each byte of each call line of every source,
    overwritten with or preceded by a junk byte, one damaged copy per line in one file. Every
    damaged line is reported (unclassified or an issue on its line) or still reads as the call that
    was logged (a byte of launcher prefix soup); never as a different call. (Damaged lines all go
    through the line-by-line parser; the fast path's agreement is the property below.)"""
    lines, origin = [], []
    for name in SOURCES:
        for no, rows in _baseline(name).calls.items():
            line = _lines(_source(name))[no - 1].rstrip(b"\n")
            for k in range(len(line)):
                for variant in (line[:k] + b"#" + line[k + 1:], line[:k] + b"_" + line[k + 1:],
                                line[:k] + b"_" + line[k:]):
                    lines.append(variant + b"\n")
                    origin.append({_msg(r) for r in rows})
    with _workdir() as d:
        (d / "damaged.log").write_bytes(b"".join(lines))
        report, tables = _parse([d / "damaged.log"], d / "out")
    calls = _by_line(tables["calls"])
    reported = set(tables["unclassified"].column("line").to_pylist()) | {
        i["line"] for i in report.files[0].issues if i["line"] is not None}
    for no, want in enumerate(origin, 1):
        got = calls.get(no, [])
        assert no in reported or (got and {_msg(r) for r in got} <= want), (no, lines[no - 1], got)


@settings(BASE, max_examples=30)
@given(st.data())
def test_any_damage_fast_path_equals_line_by_line_and_keeps_intact_lines(data):
    """Any byte damage (also CR, LF, spaces): both parser paths agree exactly (tables and report),
    whatever the block size, and intact call lines are recovered unchanged."""
    name = data.draw(st.sampled_from(SOURCES), label="source")
    segs = _mutate(data.draw, _segments(name), ANY_BYTES, ["truncate", "overwrite", "insert", "tear", "shuffle"])
    doc, _ = _layout(segs)
    block = data.draw(st.sampled_from([64, 1000, 1 << 16]), label="block_size")
    with _workdir() as d:
        (d / "damaged.log").write_bytes(doc)
        report, tables = _assert_fast_equals_slow([d / "damaged.log"], d, block)
    _check_recovery(segs, report, tables, strict=False)


@settings(BASE, max_examples=12)
@given(st.lists(st.sampled_from(SOURCES), min_size=2, max_size=4, unique=True), st.booleans(), st.data())
def test_concatenated_logs_of_several_versions_are_recovered_and_reported(names, interleave, data):
    """Logs of different NCCL versions concatenated into one file (as `cat` leaves them) or with
    their lines interleaved (as a shared stdout does): every call line is recovered and every
    version is listed, with a warning when there are several."""
    segs = []
    for n in names:
        part = _segments(n)
        if not part[-1].data.endswith(b"\n"):  # a file without a final newline: cat would glue lines
            part[-1] = Seg(part[-1].data + b"\n", part[-1].origin, part[-1].was)
        segs += part
    if interleave:
        segs = _mutate(data.draw, segs, JUNK, ["shuffle"])
    with _workdir() as d:
        (d / "mixed.log").write_bytes(_layout(segs)[0])
        report, tables = _parse([d / "mixed.log"], d / "out")
    _check_recovery(segs, report, tables, strict=True)
    versions = set().union(*(_baseline(n).versions for n in names))
    assert report.files[0].versions == versions
    several = any("several NCCL versions" in i["message"] for i in report.files[0].issues)
    assert several == (len(versions) > 1)


@settings(BASE, max_examples=12)
@given(st.sampled_from(SOURCES), st.sampled_from(["same path", "copy"]), st.booleans())
def test_a_file_given_twice_is_parsed_once_and_flagged(name, how, fast):
    """The same file named twice, or a byte-identical copy, is not parsed a second time: the tables
    are those of one file and the second report says why."""
    with _workdir() as d:
        (d / "a.log").write_bytes(_source(name))
        single, single_tables = _parse([d / "a.log"], d / "one", fast=fast)
        second = d / "a.log"
        if how == "copy":
            second = d / "copy" / "b.log"
            second.parent.mkdir()
            shutil.copy(d / "a.log", second)
        report, tables = _parse([d / "a.log", second], d / "two", fast=fast)
    assert [t.num_rows for t in tables.values()] == [t.num_rows for t in single_tables.values()]
    first, dup = report.files
    assert first.as_dict() == single.files[0].as_dict()
    assert dup.counts == {"duplicate_file": 1} and dup.lines == 0
    (issue,) = dup.issues
    assert issue["severity"] == "warning" and "a.log" in issue["message"]
    assert ("same file" if how == "same path" else "byte-identical copy") in issue["message"]


@settings(BASE, max_examples=15)
@given(st.sampled_from(SOURCES), st.data())
def test_a_partial_copy_of_a_log_is_flagged_by_its_processes(name, data):
    """A copy of part of a log (a truncated or re-captured copy) is not byte-identical, so it is
    parsed; the processes (host:pid) it shares with the first file are reported on it (and none
    when it holds no record of a process)."""
    lines = _lines(_source(name))
    cut = data.draw(st.integers(1, len(lines)), label="lines copied")
    with _workdir() as d:
        (d / "a.log").write_bytes(b"".join(lines))
        (d / "b.log").write_bytes(b"".join(lines[:cut]))
        report, _ = _parse([d / "a.log", d / "b.log"], d / "out")
        copied = _processes(d / "b.log", d / "alone")
    first, second = report.files
    assert "duplicate_processes" not in first.counts
    if cut == len(lines):
        assert second.counts == {"duplicate_file": 1}
        return
    flagged = second.counts.get("duplicate_processes", 0)
    assert flagged >= len(copied)  # every process with a table row (other INFO lines count too)
    if not any(_RECORD_PREFIX.search(line) for line in lines[:cut]):
        assert flagged == 0
    assert any("also logged in a.log" in i["message"] for i in second.issues) == bool(flagged)


def _processes(path: Path, out: Path) -> set:
    _, tables = _parse([path], out, fast=False)
    return {(r["host"], r["pid"]) for t in ("calls", "comms", "tuning", "warnings", "versions", "comm_info", "rings",
                                            "topology_links") for r in tables[t].select(["host", "pid"]).to_pylist()
            if r["pid"] is not None}


def test_no_log_at_all_is_the_documented_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no NCCL log files"):
        parse_logs([tmp_path / "missing.log"], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no NCCL log files found"):
        parse_logs([tmp_path / "empty"], tmp_path / "out")


@pytest.mark.parametrize("data, reason", [
    (b"node1:1:1 [0] NCCL INFO comm 0x55zz rank 0 nranks 2 cudaDev 0 busId 1a000 - Init COMPLETE\n", "pointer"),
    (b"node1:1:1 [0] NCCL INFO comm 0x55 rank 99999999999 nranks 2 cudaDev 0 busId 1a000 - Init COMPLETE\n",
     "comms.rank"),
    (b"[2026-13-01 10:00:00] node1:1:1 [0] NCCL INFO NCCL version 2.27.3+cuda12.4\n", "timestamp"),
    (b"node1:123456789012345678901:1 [0] NCCL INFO NCCL version 2.27.3+cuda12.4\n", "pid out of range"),
    (b"node1:1:1 [0] NCCL INFO === System : maxBw 24..0 totalBw 24.0 ===\n", "malformed number"),
    (b"node1:1:1 [0] NCCL INFO 4096 Bytes -> Algo 1 proto 2 time 54.7.07\n", "malformed number"),
    ((b"node1:1:1 [0] NCCL INFO AllReduce: opCo#nt 1 sendbuff 0x1 recvbuff 0x1 count 1 datatype 7 op 0 root 0 "
      b"comm 0x5 [nranks=2] stream 0x9\n"), "call line in an unknown format"),
    ((b"node1:1:1 [0] NC\xffL INFO AllReduce: opCount 1 sendbuff 0x1 recvbuff 0x1 count 1 datatype 7 op 0 root 0 "
      b"comm 0x5 [nranks=2] stream 0x9\n"), "without a readable"),
])
@pytest.mark.parametrize("fast", [True, False])
def test_values_a_table_cannot_hold_are_reported_with_their_line(tmp_path, data, reason, fast):
    """Regressions found by the properties: these lines used to raise ValueError/OverflowError/
    ArrowInvalid from the parse, or were counted as foreign text."""
    (tmp_path / "bad.log").write_bytes(b"node1:1:1 [0] NCCL INFO NCCL version 2.27.3+cuda12.4\n" + data)
    report = parse_logs([tmp_path / "bad.log"], tmp_path / "out", fast=fast)
    unc = pq.read_table(tmp_path / "out" / "unclassified.parquet").to_pylist()
    assert [(u["line"], reason in u["reason"]) for u in unc] == [(2, True)], unc
    assert report.partial and report.counts["lost_records"] == 1


def test_nul_bytes_inside_a_text_log_are_reported_and_do_not_hide_the_file(tmp_path):
    """Regression: any NUL in the first 4 KiB made the whole file 'binary data' (nothing read)."""
    lines = (b"node1:1:1 [0] NCCL INFO NCCL version 2.21.5+cuda12.4\n"
             b"node1:1:1 [0] NCCL INFO AllReduce: opCount 1 sendbuff 0x1 recvbuff 0x1 count 1 datatype 7 op 0 "
             b"root 0 comm 0x5 [nranks=2] stream 0x9\n")
    (tmp_path / "nul.log").write_bytes(lines + b"\x00" * 300 + b"\n" + lines)
    for fast in (True, False):
        report = parse_logs([tmp_path / "nul.log"], tmp_path / f"out{fast}", fast=fast)
        assert report.counts["call"] == 2 and report.counts["nul"] == 1
        assert [i["line"] for i in report.files[0].issues] == [3]
    # a prefix-trimmed log ("NCCL INFO ..." at the line start) whose first byte was zeroed
    data = _source("NVIDIA_nccl_734.log")
    (tmp_path / "trimmed.log").write_bytes(b"\x00" + data[1:])
    report = parse_logs([tmp_path / "trimmed.log"], tmp_path / "trimmed")
    assert report.counts["call"] == 1 and report.counts["nul"] == 1 and not report.partial
    # a binary file is still one
    (tmp_path / "core.log").write_bytes(b"SQLite format 3\x00" + bytes(4000) + b"NCCL")
    report = parse_logs([tmp_path / "core.log"], tmp_path / "core")
    assert report.partial and "binary data" in report.files[0].issues[0]["message"]
