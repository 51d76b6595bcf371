"""Split a Chrome-trace JSON document into runs of whole events, streaming, in bounded memory.

A long capture's PyTorch-profiler trace is several GB of JSON, too much to decode whole as Python
objects. A compiled scanner keeps only the JSON nesting state across blocks and reports where
each element of the events array closes; each run of whole events goes to the caller (which
decodes it, typed, with msgspec) and is dropped; the header outside the events array is kept as
bytes and decoded once at the end. Both Chrome-trace layouts are accepted, and a truncated
document yields its complete events and says so in ``truncated``. See ``docs/kineto.md``.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np

__all__ = ["BLOCK_BYTES", "ScanResult", "iter_event_runs", "open_trace_bytes", "sniff_trace"]

BLOCK_BYTES = 8 << 20
"""Decompressed bytes scanned per step (a run of events handed over is at most about this large)."""

_GZIP_MAGIC = b"\x1f\x8b"

# Record kinds written by the scanner.
_STR_START, _STR_END, _OPEN_1, _CLOSE_1, _ELEM_CLOSE, _TOP_OPEN, _TOP_CLOSE = 1, 2, 3, 4, 5, 6, 7


@numba.njit(cache=True, nogil=True)
def _scan(buf, state, pos, kind):  # pragma: no cover - compiled
    """Walk ``buf`` from the nesting ``state`` (depth, in_string, escaped), recording: strings
    at depth 1 (the top-level object's keys), values opening to and closing from depth 2,
    containers closing back to depth 2 (an element of a depth-2 array), and the top-level
    value's open and close. Returns the number of records."""
    depth, in_str, esc = state[0], state[1], state[2]
    n = 0
    for i in range(len(buf)):
        c = buf[i]
        if in_str:
            if esc:
                esc = 0
            elif c == 92:  # backslash
                esc = 1
            elif c == 34:  # closing quote
                in_str = 0
                if depth == 1:
                    pos[n] = i
                    kind[n] = 2
                    n += 1
            continue
        if c == 34:
            in_str = 1
            if depth == 1:
                pos[n] = i
                kind[n] = 1
                n += 1
        elif c == 123 or c == 91:  # { [
            depth += 1
            if depth == 1:
                pos[n] = i
                kind[n] = 6
                n += 1
            elif depth == 2:
                pos[n] = i
                kind[n] = 3
                n += 1
        elif c == 125 or c == 93:  # } ]
            depth -= 1
            if depth == 2:
                pos[n] = i
                kind[n] = 5
                n += 1
            elif depth == 1:
                pos[n] = i
                kind[n] = 4
                n += 1
            elif depth == 0:
                pos[n] = i
                kind[n] = 7
                n += 1
    state[0], state[1], state[2] = depth, in_str, esc
    return n


@dataclass
class ScanResult:
    """What scanning one trace found besides its events: ``header`` (the top-level object with
    an empty events array, decodable on its own), ``layout`` (``object`` or ``array``), why the
    document stopped early (``truncated``, None when complete) and the bytes read."""

    header: bytes = b""
    layout: str = "object"
    truncated: str | None = None
    bytes_read: int = 0
    events_found: bool = False


def open_trace_bytes(path: Path | str) -> io.BufferedIOBase:
    """The trace's bytes, decompressed when the file is gzip (by its magic, not its name)."""
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == _GZIP_MAGIC:
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def sniff_trace(path: Path | str, probe: int = 1 << 16) -> bool:
    """Whether ``path`` looks like a Chrome-trace JSON document (a PyTorch-profiler trace): a
    JSON object with a ``traceEvents`` member, or a JSON array of events with ``"ph"``. Reads at
    most ``probe`` decompressed bytes; never raises for an unreadable file (it is not a trace)."""
    head = b""
    try:
        with open_trace_bytes(path) as fh:
            while len(head) < probe:  # in pieces: a cut gzip stream still gives its beginning
                piece = fh.read(4096)
                if not piece:
                    break
                head += piece
    except (EOFError, zlib.error):
        pass  # judged on what could be read (a truncated .json.gz is still a trace)
    except OSError:
        if not head:
            return False
    text = head.lstrip()
    if text.startswith(b"{"):
        return b'"traceEvents"' in head
    return text.startswith(b"[") and b'"ph"' in head


def iter_event_runs(path: Path | str, result: ScanResult, block_bytes: int = BLOCK_BYTES) -> Iterator[bytearray]:
    """Yield JSON arrays (``b"[...]"``, a ``bytearray`` the caller must not keep) of whole trace
    events in file order, reading ``path``
    ``block_bytes`` at a time; ``result`` is filled as the scan goes (``header`` once done).
    Raises ``ValueError`` when the file holds no JSON object or array."""
    state = np.zeros(3, np.int64)
    header = bytearray()
    pending = bytearray()  # events-array bytes after the last element handed over
    phase = "start"  # start -> top (object members) | events -> top -> done
    key_start, last_key = -1, b""
    elem_kind = _ELEM_CLOSE  # what closes an element of the events array (set by the layout)
    with open_trace_bytes(path) as fh:
        while phase != "done":
            try:
                block = fh.read(block_bytes)
            except (EOFError, zlib.error, OSError) as e:
                result.truncated = f"the compressed stream ends early or is damaged ({e})"
                break
            if not block:
                break
            result.bytes_read += len(block)
            buf = np.frombuffer(block, np.uint8)
            pos = np.empty(len(buf) + 1, np.int64)
            kind = np.empty(len(buf) + 1, np.int8)
            n = _scan(buf, state, pos, kind)
            pos, kind = pos[:n], kind[:n]
            if phase == "start":
                first = block.lstrip()[:1]
                if first == b"[":
                    elem_kind = _CLOSE_1
            # element closes are many (one per event): the loop below visits only the few records
            # that change the phase, and takes element closes from this array
            elems = pos[kind == elem_kind]
            cursor = 0  # first byte of this block not yet given to the header or the events
            for r in np.flatnonzero(kind != elem_kind):
                k, p = int(kind[r]), int(pos[r])
                if phase == "start":
                    if k == _TOP_OPEN:
                        if block[p:p + 1] == b"[":  # JSON Array Format: the top-level array holds the events
                            result.layout, phase = "array", "events"
                            result.events_found = True
                            header += b"{}"
                            cursor = p + 1
                        else:
                            phase = "top"
                    continue
                if phase == "top":
                    if k == _STR_START:
                        key_start = p
                    elif k == _STR_END:
                        last_key = block[key_start + 1:p] if 0 <= key_start < p else b""
                        key_start = -1
                    elif k == _OPEN_1 and last_key == b"traceEvents" and block[p:p + 1] == b"[":
                        header += block[cursor:p + 1]
                        cursor = p + 1
                        phase = "events"
                        result.events_found = True
                    elif k == _TOP_CLOSE:
                        header += block[cursor:p + 1]
                        cursor = p + 1
                        phase = "done"
                    continue
                if phase == "events" and ((k == _CLOSE_1 and elem_kind == _ELEM_CLOSE) or
                                          (k == _TOP_CLOSE and elem_kind == _CLOSE_1)):
                    # the events array ends here: hand over what is left, back to the header
                    pending += block[cursor:p]
                    run = _as_array(pending)
                    if run is not None:
                        yield run
                    pending = bytearray()
                    cursor = p
                    phase, last_key = ("done" if elem_kind == _CLOSE_1 else "top"), b""
            if phase == "events":
                inside = elems[elems >= cursor]
                if len(inside):
                    last_close = int(inside[-1])
                    pending += block[cursor:last_close + 1]
                    run = _as_array(pending)
                    if run is not None:
                        yield run
                    pending = bytearray(block[last_close + 1:])
                else:
                    pending += block[cursor:]
            elif phase in ("top", "start"):
                header += block[cursor:]
            del buf, pos, kind
    if phase == "start":
        raise ValueError("the file holds no JSON object or array")
    if phase == "events":
        result.truncated = result.truncated or "the events array is not closed (the file ends inside it)"
        if result.layout == "object":
            header += b"]}"
    elif phase == "top":
        if result.truncated is None:
            result.truncated = "the file ends before the trace's closing brace"
        header += b"}" if state[0] >= 1 else b""
    result.header = bytes(header)


def _as_array(run: bytearray) -> bytearray | None:
    """A run of comma-separated elements as one JSON array (None when it holds none), built in
    place: the run's leading separators become the opening bracket."""
    start = 0
    while start < len(run) and run[start] in b" \t\r\n,":
        start += 1
    if start == len(run):
        return None
    del run[:start]
    run[0:0] = b"["
    run += b"]"
    return run
