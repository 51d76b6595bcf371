"""Flight Recorder dumps as a call source: one row per call a dump recorded, in the record
columns every source shares (:data:`~nccltrace.pytorch.collectives.RECORD_COLUMNS`), and the
link of a profiler trace's call records to the dump's entries of the same rank.

What a dump's entry gives (PyTorch's ``FlightRecorder``, format 2.x): the process group
(``process_group`` = (name, desc); the ranks are in the dump's ``pg_config``), the per-group
sequence numbers (``collective_seq_id`` for collectives, ``p2p_seq_id`` for point-to-point; a
batch of ops shares the number of its one launch), ``profiling_name`` (``nccl:<collective>``;
Send/Recv as ``nccl:send a->b`` / ``nccl:recv a<-b`` with ``a`` this rank and ``b`` the peer,
both numbered **in the group**: a rank of the two-rank group [1, 3] writes ``send 0->1``, and
on the 16-rank default group ``recv 0<-8``), the tensors' shapes and dtypes, and
``time_created_ns`` (UTC ns, when ProcessGroupNCCL enqueued the call: a CPU time).

Conventions of the rows:

- ``nccl:coalesced`` entries are not calls: ProcessGroupNCCL records one after the ops of a
  coalesced batch (``batch_isend_irecv``, coalescing managers), with empty sizes and the
  batch's sequence number. They are folded (counted, no row).
- ``count`` is :func:`~nccltrace.pytorch.collectives.log_count` of the numbers of elements of
  the input and output tensors, each the **sum over the entry's tensors** (a list-form
  collective records its per-rank tensors, so the sum is what one NCCL call moves; for a
  ``*_coalesced`` entry of several tensors it is the batch's total, where NCCL's log prints one
  line per tensor). An AlltoAll whose input and output counts differ ran with uneven
  splits (one count per peer, which the dump does not keep): count null.
- ``datatype_name`` from ``input_dtypes`` (else ``output_dtypes``); null when the tensors'
  dtypes differ or are unknown.
- ``root``: the peer's rank in the group for Send/Recv; 0 for collectives without a root;
  null for rooted collectives (Broadcast, Reduce, ...): Flight Recorder does not record it.
- ``tid`` stays null: the dump's ``thread_id`` is the thread's handle (``std::thread::id``),
  not the OS thread id profiler traces record.
- Times: ``enqueue_utc`` = ``time_created_ns``. ``started_utc``/``ended_utc`` only where the
  dump has GPU timing (``TORCH_NCCL_ENABLE_TIMING=1``): ``duration_ms`` is the GPU's elapsed
  time between the call's CUDA start and end events, but the dump holds no GPU start: only
  ``time_discovered_started_ns``, when the watchdog *noticed* the start event had fired (after
  the kernel started, possibly much later). So ``started_utc`` = that discovery time and
  ``ended_utc`` = ``started_utc`` + ``duration_ms``: the span's length is the GPU's, its
  placement an upper bound (said in a message). ``time_discovered_completed_ns`` alone (set
  without timing) is a discovery time too, and is not used.

A damaged entry (missing sizes, an unknown ``profiling_name``, a group the dump's
``pg_config`` lacks) gives a row with the facts it lacks null and a message; never an
exception.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from nccltrace.pytorch.collectives import (
    RECORD_COLUMNS,
    log_count,
    nccl_datatype,
    nccl_op,
    torch_collective,
)
from nccltrace.pytorch.flight_recorder import FlightRecorderDump

__all__ = [
    "FR_SOURCE",
    "LINK_WINDOW_NS",
    "dump_call_records",
    "link_profiler_records",
    "ranks_text",
]

FR_SOURCE = "flight-recorder"
# an entry is created within this long after its CPU record starts (measured: 5.5-108.7 us)
LINK_WINDOW_NS = 1_000_000
_P2P = frozenset({"Send", "Recv"})
_ROOTED = frozenset({"Broadcast", "Reduce", "Gather", "Scatter"})
_PEER = re.compile(
    r"^\s*(?:nccl:)?\s*(?:send|recv)\s+(?P<a>\d+)\s*(?P<dir>->|<-)\s*(?P<b>\d+)\s*$",
    re.IGNORECASE,
)
_SHOWN = 5  # record ids named per message
_MAX_ROW_MESSAGES = 50  # contradiction messages per link, then a count


def _records_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The rows as a frame of RECORD_COLUMNS, built column by column: a column of ints and
    nulls inferred as float would round nanosecond times."""
    data = {}
    for col, dtype in RECORD_COLUMNS.items():
        # facts a dump never records (comm_id, bytes) stay null
        values = [r.get(col) for r in rows]
        data[col] = pd.Series(np.array(values, dtype=object) if dtype == "object" else pd.array(values, dtype=dtype),
                              dtype=dtype)  # fmt: skip
    return pd.DataFrame(data)


def ranks_text(ranks: Iterable[int]) -> str:
    """A group's global ranks as the record columns spell them: ``"[0, 1]"``."""
    return "[" + ", ".join(str(int(r)) for r in ranks) + "]"


@dataclass
class _Problems:
    """Per-dump problems, gathered per kind so a thousand entries with one fault say it once."""

    file: str
    seen: dict[str, list[Any]] = field(default_factory=dict)

    def add(self, what: str, record_id: Any) -> None:
        self.seen.setdefault(what, []).append(record_id)

    def messages(self) -> list[str]:
        out = []
        for what, ids in self.seen.items():
            shown = ", ".join(str(i) for i in ids[:_SHOWN]) + (
                ", ..." if len(ids) > _SHOWN else ""
            )
            noun = "entry" if len(ids) == 1 else "entries"
            out.append(f"{self.file}: {len(ids)} {noun} (record_id {shown}): {what}")
        return out


def _int(x: Any) -> int | None:
    return (
        int(x) if isinstance(x, (int, np.integer)) and not isinstance(x, bool) else None
    )


def _numel(sizes: Any) -> tuple[int | None, bool]:
    """(total elements over the tensors' shapes, whether the value was readable). An empty
    list is readable but gives None: no tensor recorded on that side."""
    if not isinstance(sizes, (list, tuple)):
        return None, False
    total = 0
    for shape in sizes:
        if not isinstance(shape, (list, tuple)) or any(
            _int(d) is None or d < 0 for d in shape
        ):
            return None, False
        total += math.prod(int(d) for d in shape)
    return (total if sizes else None), True


def _datatype(entry: dict[str, Any], problems: _Problems, rid: Any) -> str | None:
    dtypes = entry.get("input_dtypes") or entry.get("output_dtypes")
    if not isinstance(dtypes, (list, tuple)) or not dtypes:
        return None
    names = {str(d) for d in dtypes}
    if len(names) > 1:
        problems.add(
            f"tensors of several dtypes {sorted(names)}: datatype left null", rid
        )
        return None
    name = nccl_datatype(names.pop())
    if name is None:
        problems.add(
            f"dtype {dtypes[0]!r} has no NCCL datatype known here: datatype left null",
            rid,
        )
    return name


def _peer(
    name: str,
    ranks: tuple[int, ...] | None,
    rank: int | None,
    problems: _Problems,
    rid: Any,
) -> int | None:
    """The peer's rank in the group from ``nccl:send a->b`` / ``nccl:recv a<-b`` (``a`` is this
    rank's own rank in the group; checked where the group's ranks are known)."""
    m = _PEER.match(name)
    if not m:
        problems.add(f"no peer in profiling_name {name!r}: root left null", rid)
        return None
    own, peer = int(m.group("a")), int(m.group("b"))
    if ranks is None or rank is None or rank not in ranks:
        return peer
    if own == ranks.index(rank) and peer < len(ranks):
        return peer
    if own == rank and peer in ranks:
        # numbered in global ranks: seen in no dump so far
        problems.add(
            f"peer in profiling_name {name!r} numbered in global ranks, not group ranks",
            rid,
        )
        return ranks.index(peer)
    problems.add(
        f"profiling_name {name!r} does not fit rank {rank} in group {ranks_text(ranks)}: root left null",
        rid,
    )
    return None


def _group(dump: FlightRecorderDump, entry: dict[str, Any], problems: _Problems, rid: Any,
           ) -> tuple[str | None, str | None, tuple[int, ...] | None]:  # fmt: skip
    pg = entry.get("process_group")
    name = (
        str(pg[0])
        if isinstance(pg, (list, tuple)) and pg and pg[0] is not None
        else None
    )
    desc = (
        str(pg[1])
        if isinstance(pg, (list, tuple)) and len(pg) > 1 and pg[1] is not None
        else None
    )
    if name is None:
        problems.add("no process_group: group left null", rid)
        return None, desc, None
    if name not in dump.groups:
        problems.add(
            f"group {name!r} is not in the dump's pg_config: its ranks and size left null",
            rid,
        )
        return name, desc, None
    ranks, cfg_desc = dump.groups[name]
    return name, desc if desc is not None else cfg_desc, ranks


def _times(entry: dict[str, Any]) -> tuple[int | None, int | None]:
    started, duration = (
        _int(entry.get("time_discovered_started_ns")),
        entry.get("duration_ms"),
    )
    if (
        started is None
        or not isinstance(duration, (int, float))
        or isinstance(duration, bool)
    ):
        return None, None
    if not math.isfinite(duration) or duration < 0:
        return None, None
    return started, started + round(float(duration) * 1e6)


def _entry_row(
    dump: FlightRecorderDump, entry: dict[str, Any], file: str, problems: _Problems
) -> dict[str, Any]:
    rid = entry.get("record_id")
    name = entry.get("profiling_name")
    name = name if isinstance(name, str) else None
    op = nccl_op(name)
    if name is None:
        problems.add("no profiling_name: op left null", rid)
    elif op is None:
        problems.add(
            f"profiling_name {name!r} is no collective ProcessGroupNCCL issues: op left null",
            rid,
        )
    pg_name, pg_desc, ranks = _group(dump, entry, problems, rid)
    nranks = len(ranks) if ranks is not None else None
    in_n, in_ok = _numel(entry.get("input_sizes"))
    out_n, out_ok = _numel(entry.get("output_sizes"))
    if not (in_ok and out_ok):
        problems.add(
            "input_sizes/output_sizes missing or not lists of shapes: sizes read as unknown",
            rid,
        )
    count = log_count(op, in_n, out_n, nranks) if op is not None else None
    if op == "AlltoAll" and in_n is not None and out_n is not None and in_n != out_n:
        # uneven splits (MoE token dispatch): one count per peer, which the dump does not keep
        count = None
        problems.add("AlltoAll with uneven splits (input and output element counts differ; the dump keeps no "
                     "split sizes): count left null", rid)  # fmt: skip
    elif op is not None and count is None:
        problems.add(
            f"{op}: no element count from the recorded sizes: count left null", rid
        )
    is_p2p = entry.get("is_p2p")
    p2p = bool(is_p2p) if isinstance(is_p2p, bool) else op in _P2P
    seq = _int(entry.get("p2p_seq_id" if p2p else "collective_seq_id"))
    if op in _P2P:
        root = _peer(name or "", ranks, dump.rank, problems, rid)
    else:
        root = None if op is None or op in _ROOTED else 0
    started, ended = _times(entry)
    return {
        "file": file, "rank": dump.rank, "host": None, "pid": None, "tid": None,
        "torch_op": torch_collective(name), "op": op, "op_source": FR_SOURCE if op else None,
        "count": count, "datatype_name": _datatype(entry, problems, rid),
        "size_source": FR_SOURCE if count is not None else None,
        "nranks": nranks, "root": root, "pg_name": pg_name, "pg_desc": pg_desc,
        "pg_ranks": ranks_text(ranks) if ranks is not None else None,
        "comm_source": "process-group" if pg_name is not None else None,
        "pg_seq": seq, "seq_source": FR_SOURCE if seq is not None else None,
        "kernel_correlation_id": None, "record_utc": None,
        "enqueue_utc": _int(entry.get("time_created_ns")), "started_utc": started, "ended_utc": ended,
    }  # fmt: skip


def _in_record_order(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries by ``record_id`` (a dump lists them so already); one without a readable id
    keeps its place after the entry before it."""
    keys, last = [], -1
    for e in entries:
        rid = _int(e.get("record_id"))
        last = rid if rid is not None else last
        keys.append(last)
    order = sorted(range(len(entries)), key=lambda i: keys[i])
    return [entries[i] for i in order]


def _is_marker(entry: dict[str, Any]) -> bool:
    name = entry.get("profiling_name")
    return isinstance(name, str) and torch_collective(name) == "coalesced"


def _state_messages(
    file: str, calls: list[dict[str, Any]], entries: list[dict[str, Any]]
) -> list[str]:
    """One line per entry state other than 'completed': how many calls the watchdog had not
    seen complete when the dump was written, and how many of those belong to a coalesced
    batch whose marker (which carries the batch's state) is 'completed'."""
    done_batches = {(str(e.get("process_group")), e.get("p2p_seq_id"), e.get("collective_seq_id"))
                    for e in entries if _is_marker(e) and e.get("state") == "completed"}  # fmt: skip
    out = []
    states = Counter(str(e.get("state")) for e in calls)
    for state, n in sorted(states.items()):
        if state == "completed":
            continue
        batched = sum(
            1
            for e in calls
            if str(e.get("state")) == state
            and (
                str(e.get("process_group")),
                e.get("p2p_seq_id"),
                e.get("collective_seq_id"),
            )
            in done_batches
        )
        tail = (
            f"; {batched} of them in a coalesced batch whose marker is 'completed'"
            if batched
            else ""
        )
        out.append(
            f"{file}: {n} of {len(calls)} calls in state {state!r} when dumped{tail}"
        )
    return out


def dump_call_records(
    dump: FlightRecorderDump, file: str, messages: list[str] | None = None
) -> pd.DataFrame:
    """One row per call ``dump`` recorded (every entry but the ``nccl:coalesced`` batch
    markers), in record order, with exactly the :data:`RECORD_COLUMNS` (``record`` = 0-based
    position among the rows, ``file`` = ``file``). What a row lacks is null; each problem,
    the states other than 'completed', the folded markers and the meaning of timing fields
    are appended to ``messages`` when given (one line per kind, per dump)."""
    problems = _Problems(file)
    entries = _in_record_order(dump.entries)
    calls = [e for e in entries if not _is_marker(e)]
    rows = [_entry_row(dump, e, file, problems) for e in calls]
    for i, row in enumerate(rows):
        row["record"] = i
    if messages is not None:
        if dump.rank is None:
            messages.append(
                f"{file}: the dump's rank is unknown (no one rank common to its groups): rank left null"
            )
        messages += problems.messages()
        if len(entries) > len(calls):
            messages.append(f"{file}: {len(entries) - len(calls)} nccl:coalesced batch markers folded "
                            "(no call of their own)")  # fmt: skip
        messages += _state_messages(file, calls, entries)
        timed = sum(1 for r in rows if r["started_utc"] is not None)
        if timed:
            messages.append(f"{file}: {timed} calls with TORCH_NCCL_ENABLE_TIMING times: duration_ms is the GPU's, "
                            "started_utc is when the watchdog noticed the start (after the kernel began, possibly "
                            "late), ended_utc = started_utc + duration_ms")  # fmt: skip
    return _records_frame(rows)


# ---- linking a profiler trace's records to a dump's entries (one rank) ----


def _ranks_of(text: Any) -> tuple[int, ...] | None:
    if text is None or (isinstance(text, float) and math.isnan(text)) or text is pd.NA:
        return None
    try:
        ranks = json.loads(str(text))
    except json.JSONDecodeError:
        return None
    if not isinstance(ranks, list) or not all(_int(r) is not None for r in ranks):
        return None
    return tuple(sorted(int(r) for r in ranks))


def _value(x: Any) -> Any:
    return (
        None
        if x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))
        else x
    )


@dataclass
class _Link:
    """The FR rows of one group (positions into the FR frame, in record order) and the
    profiler rows of the same group, linked position by position."""

    fr: list[int]
    prof: list[int]
    # k-th profiler row of the group -> its entry's position in the FR frame
    to_fr: dict[int, int] = field(default_factory=dict)
    by_time: int = 0


def _time_links(
    link: _Link, p_op: list, p_t: list, f_op: list, f_t: list
) -> list[tuple[int, int]]:
    """(k-th profiler row, j-th entry of the group): each row in order to the first entry
    after the last one claimed with the same op, created at or after the row's record and
    within LINK_WINDOW_NS."""
    times = sorted((f_t[f], j) for j, f in enumerate(link.fr) if f_t[f] is not None)
    keys = [t for t, _ in times]
    pairs, last = [], -1
    for k, p in enumerate(link.prof):
        t = p_t[p]
        if t is None:
            continue
        lo, hi = (
            bisect.bisect_left(keys, t),
            bisect.bisect_right(keys, t + LINK_WINDOW_NS),
        )
        cands = [j for _, j in times[lo:hi] if j > last and f_op[link.fr[j]] == p_op[p]]
        if cands:
            last = min(cands)
            pairs.append((k, last))
    return pairs


def _link_group(link: _Link, p_op: list, p_t: list, f_op: list, f_t: list) -> int:
    """Link the group's rows: by time where an entry fits, the others by position from the
    nearest time link before (else after) them. Returns how many offset changes the time
    links show (0: the window is contiguous in the dump)."""
    pairs = _time_links(link, p_op, p_t, f_op, f_t)
    if not pairs:
        return 0
    offsets = {k: j - k for k, j in pairs}
    known = sorted(offsets)
    claimed = {j for _, j in pairs}
    link.to_fr = {k: link.fr[j] for k, j in pairs}
    link.by_time = len(pairs)
    for k in range(len(link.prof)):
        if k in offsets:
            continue
        i = bisect.bisect_left(known, k)
        j = k + offsets[known[i - 1] if i > 0 else known[0]]
        if 0 <= j < len(link.fr) and j not in claimed:
            claimed.add(j)
            link.to_fr[k] = link.fr[j]
    return sum(1 for a, b in itertools.pairwise(known) if offsets[a] != offsets[b])


_COMPARED = ("op", "count", "datatype_name", "root", "pg_ranks")


def _disagreements(prof: pd.Series, fr: pd.Series) -> list[str]:
    out = []
    for col in _COMPARED:
        a, b = _value(prof[col]), _value(fr[col])
        if col == "pg_ranks":
            a, b = _ranks_of(a), _ranks_of(b)
        if a is not None and b is not None and a != b:
            out.append(f"{col} {a if col != 'pg_ranks' else ranks_text(a)} (profiler) vs "
                       f"{b if col != 'pg_ranks' else ranks_text(b)} (Flight Recorder)")  # fmt: skip
    t, e = _value(prof["record_utc"]), _value(fr["enqueue_utc"])
    if t is not None and e is not None and e < t:
        out.append(
            f"entry created {(t - e) / 1e3:.1f} us before the profiler record started"
        )
    return out


_FILLED = {  # column -> its provenance column (set where the FR value fills a null)
    "op": "op_source", "torch_op": None, "count": "size_source", "datatype_name": None, "nranks": None,
    "root": None, "pg_desc": None, "pg_ranks": None, "pg_seq": "seq_source", "enqueue_utc": None,
    "started_utc": None, "ended_utc": None,
}  # fmt: skip


def _fill(out: pd.DataFrame, fr: pd.DataFrame, pairs: dict[int, int]) -> None:
    """Fill the profiler rows' nulls from their FR entries (positional indices)."""
    if not pairs:
        return
    p_idx = np.fromiter(pairs.keys(), dtype=np.int64)
    f_idx = np.fromiter(pairs.values(), dtype=np.int64)
    for col, source in _FILLED.items():
        mine = out[col].iloc[p_idx]
        theirs = fr[col].iloc[f_idx].to_numpy()
        take = (mine.isna().to_numpy()) & ~pd.isna(theirs)
        if not take.any():
            continue
        rows = p_idx[take]
        out.iloc[rows, out.columns.get_loc(col)] = theirs[take]
        if source is not None:
            out.iloc[rows, out.columns.get_loc(source)] = FR_SOURCE


def _groups(
    profiler: pd.DataFrame, fr: pd.DataFrame, messages: list[str]
) -> list[_Link]:
    """The profiler rows and FR rows of each group, keyed by the group's name (unique within
    a rank); a profiler row without a name goes to the one FR group of the same ranks and
    desc, when there is exactly one."""
    fr_groups: dict[str, list[int]] = {}
    for i, name in enumerate(fr["pg_name"].tolist()):
        if _value(name) is not None:
            fr_groups.setdefault(str(name), []).append(i)
    by_members: dict[tuple, list[str]] = {}
    for name, rows in fr_groups.items():
        key = (
            _ranks_of(fr["pg_ranks"].iloc[rows[0]]),
            _value(fr["pg_desc"].iloc[rows[0]]),
        )
        by_members.setdefault(key, []).append(name)
    prof_groups: dict[str, list[int]] = {}
    unplaced = 0
    for i, (name, ranks, desc) in enumerate(
        zip(profiler["pg_name"], profiler["pg_ranks"], profiler["pg_desc"])
    ):
        if _value(name) is None:
            names = by_members.get((_ranks_of(ranks), _value(desc)), [])
            name = names[0] if len(names) == 1 else None
        if name is None:
            unplaced += 1
            continue
        prof_groups.setdefault(str(name), []).append(i)
    if unplaced:
        messages.append(
            f"{unplaced} profiler records name no process group the dump tells apart: not linked"
        )
    for name in sorted(set(prof_groups) - set(fr_groups)):
        messages.append(
            f"group {name!r}: {len(prof_groups[name])} profiler records, no entry of it in the dump"
        )
    return [_Link(fr_groups[n], prof_groups[n]) for n in prof_groups if n in fr_groups]


def _in_order(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.reset_index(drop=True)
    missing = [c for c in RECORD_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(
            f"records lack the columns {missing} (RECORD_COLUMNS expected)"
        )
    return frame[list(RECORD_COLUMNS)].astype(RECORD_COLUMNS)


def link_profiler_records(
    profiler: pd.DataFrame, fr: pd.DataFrame
) -> tuple[pd.DataFrame, list[str], dict[str, Any]]:
    """Link one rank's profiler call records to its Flight Recorder rows (both in
    :data:`RECORD_COLUMNS` form, e.g. :func:`dump_call_records`): per process group (same
    ``pg_name``), each record to the first unclaimed entry of the same op created at or after
    the record's start (``record_utc``) and within :data:`LINK_WINDOW_NS`, entries claimed in
    record order; the records no entry fits that way by position in the group from the
    nearest time link (a profiler window is a contiguous run of each group's calls).

    Returns the profiler rows, in their order, with the entry's nulls filled: ``pg_seq``
    (``seq_source`` 'flight-recorder'), ``count`` (``size_source`` 'flight-recorder'),
    ``datatype_name``, ``op`` (``op_source``), ``root``, ``nranks``, the group's desc/ranks,
    ``enqueue_utc`` and the FR timing; a message per linked row whose values disagree (op,
    count, datatype, root, group ranks, or an entry created before the record), naming both
    values and the row; and stats: ``linked`` (``linked_by_time`` + ``linked_by_position``),
    ``unlinked``, ``contradicted`` (linked rows with a disagreement), ``fr_outside_window``
    (entries no record claimed), ``enqueue_after_record_ns`` (min, median, max over the
    linked rows, None without)."""
    out, fr = _in_order(profiler), _in_order(fr)
    messages: list[str] = []
    p_ranks = {int(r) for r in out["rank"].dropna()}
    f_ranks = {int(r) for r in fr["rank"].dropna()}
    links: list[_Link] = []
    if (
        len(p_ranks) > 1
        or len(f_ranks) > 1
        or (p_ranks and f_ranks and p_ranks != f_ranks)
    ):
        messages.append(f"profiler records of ranks {sorted(p_ranks)}, Flight Recorder rows of ranks "
                        f"{sorted(f_ranks)}: one and the same rank is linked, nothing linked")  # fmt: skip
    else:
        links = _groups(out, fr, messages)
    p_op, p_t = [_value(x) for x in out["op"]], [_value(x) for x in out["record_utc"]]
    f_op, f_t = [_value(x) for x in fr["op"]], [_value(x) for x in fr["enqueue_utc"]]
    pairs: dict[int, int] = {}
    by_time = 0
    for link in links:
        breaks = _link_group(link, p_op, p_t, f_op, f_t)
        name = fr["pg_name"].iloc[link.fr[0]]
        if not link.to_fr:
            messages.append(f"group {name!r}: no entry created within {LINK_WINDOW_NS / 1e6:g} ms after any of its "
                            f"{len(link.prof)} profiler records (do the clocks differ?): not linked")  # fmt: skip
        elif breaks:
            messages.append(
                f"group {name!r}: the dump's entries for the window are not contiguous ({breaks} gaps)"
            )
        pairs.update({link.prof[k]: f for k, f in link.to_fr.items()})
        by_time += link.by_time
    contradicted, row_messages = 0, []
    for p, f in sorted(pairs.items()):
        bad = _disagreements(out.iloc[p], fr.iloc[f])
        if bad:
            contradicted += 1
            row_messages.append(f"{out['file'].iloc[p]} record {out['record'].iloc[p]} (Flight Recorder "
                                f"{fr['file'].iloc[f]} row {fr['record'].iloc[f]}): " + "; ".join(bad))  # fmt: skip
    messages += row_messages[:_MAX_ROW_MESSAGES]
    if len(row_messages) > _MAX_ROW_MESSAGES:
        messages.append(
            f"... and {len(row_messages) - _MAX_ROW_MESSAGES} more rows whose sources disagree"
        )
    delays = [
        f_t[f] - p_t[p]
        for p, f in pairs.items()
        if f_t[f] is not None and p_t[p] is not None
    ]
    _fill(out, fr, pairs)
    stats = {
        "linked": len(pairs), "linked_by_time": by_time, "linked_by_position": len(pairs) - by_time,
        "unlinked": len(out) - len(pairs), "contradicted": contradicted,
        "fr_outside_window": len(fr) - len(pairs),
        "enqueue_after_record_ns": (min(delays), int(np.median(delays)), max(delays)) if delays else None,
    }  # fmt: skip
    if stats["unlinked"]:
        messages.append(
            f"{stats['unlinked']} of {len(out)} profiler records linked to no Flight Recorder entry"
        )
    return out, messages, stats
