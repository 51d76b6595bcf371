"""PyTorch's process groups joined with NCCL's communicators: every communicator named.

PyTorch creates one NCCL communicator per process group and Megatron names each group
(``group_desc``), so a name is exact evidence of what a communicator is. Names come from a
profiler trace's kernel records (``kernel-records``: the groups the matched kernels name, with
members from ``distributedInfo.pg_config``), PyTorch's own log lines and Flight Recorder dumps;
a communicator no record names gets the one group left with its member set (``elimination``).
Conflicting records name nothing and keep the reason. Rules and measurements:
``docs/correlation.md`` section 2.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["FR_MIN_AGREEMENT", "NAME_COLUMNS", "name_by_flight_recorder", "name_by_pytorch_lines",
           "name_communicators", "pg_config_of_sessions"]

NAME_COLUMNS = ("pg_name", "pg_desc", "name_source")


def _as_list(value: Any) -> list[dict]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                return []
    return [g for g in value if isinstance(g, dict)] if isinstance(value, list) else []


def pg_config_of_sessions(session_paths: Iterable[Path | str]) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """Every process group the kernel sources' ``pg_config`` lists (name -> (global ranks, desc)),
    over all nodes and all sources merged into each node's session."""
    out: dict[str, tuple[tuple[int, ...], str | None]] = {}
    for p in session_paths:
        p = Path(p)
        if not p.exists():
            continue
        session = json.loads(p.read_text())
        configs = [session.get("pg_config")] + [s.get("pg_config") for s in _as_list(session.get("sources"))]
        for cfg in configs:
            for g in _as_list(cfg):
                ranks = g.get("ranks")
                if g.get("name") is None or not isinstance(ranks, list):
                    continue
                out.setdefault(str(g["name"]), (tuple(sorted(int(r) for r in ranks)), g.get("desc")))
    return out


def name_communicators(comms: pd.DataFrame, members: pd.DataFrame, records: Iterable[Mapping[str, Any]],
                       pg_config: Mapping[str, tuple[tuple[int, ...], str | None]],
                       named_before: pd.DataFrame | None = None) -> tuple[pd.DataFrame, list[str]]:  # fmt: skip
    """Per logical communicator (``logical_id``): ``pg_name``, ``pg_desc`` and ``name_source``
    ('kernel-records', one of ``named_before``'s sources, or 'elimination'), for those that
    could be named; and the notes (what was refused, and why). ``records``: the processes'
    alignment-quality records (their ``host``, ``pid`` and ``process_groups``);
    ``named_before``: names from other evidence (:func:`name_by_flight_recorder`), used where
    the kernels name nothing and refused where they name another group."""
    cols = ["logical_id", *NAME_COLUMNS]
    notes: list[str] = []
    lid_of = {(str(h), int(p), int(c)): int(lid) for h, p, c, lid in
              zip(members["host"], members["pid"], members["comm"], members["logical_id"]) if int(lid) >= 0}  # fmt: skip
    votes: dict[int, dict[tuple[str, str | None], int]] = {}
    evidence: dict[int, str] = {}  # what named the group: the kernels' records, or a log-less process's records
    for rec in records:
        host, pid = rec.get("host"), rec.get("pid")
        for entry in rec.get("process_groups") or []:
            lid = lid_of.get((str(host), int(pid) if pid is not None else -1, int(entry["comm"], 16)))
            if lid is None:
                continue
            for g in entry["groups"]:
                key = (str(g["pg_name"]), g.get("pg_desc"))
                votes.setdefault(lid, {})[key] = votes.get(lid, {}).get(key, 0) + int(g["calls"])
                evidence.setdefault(lid, entry.get("name_source") or "kernel-records")
    member_set = {int(lid): tuple(sorted(int(r) for r in m)) for lid, m in zip(comms["logical_id"], comms["members"])}
    named: dict[int, tuple[str, str | None, str]] = {}
    refused: set[int] = set()  # contradicting evidence: not named by elimination either
    for lid, v in sorted(votes.items()):
        if len(v) > 1:
            refused.add(lid)
            said = ", ".join(f"{n} ({d}, {c} calls)" for (n, d), c in sorted(v.items()))
            notes.append(f"communicator {lid}: its matched kernels name {len(v)} process groups ({said}); left unnamed")
            continue
        (name, desc), _ = next(iter(v.items()))
        ranks = pg_config.get(name, (None, None))[0]
        if ranks is not None and ranks != member_set.get(lid):
            notes.append(f"communicator {lid}: its kernels name process group {name} ({desc}) whose members "
                         f"{list(ranks)} are not the communicator's {list(member_set.get(lid, ()))}; left unnamed")
            refused.add(lid)
            continue
        named[lid] = (name, desc, evidence.get(lid, "kernel-records"))
    for lid, name, desc, src in (named_before.itertuples(index=False) if named_before is not None else ()):
        lid = int(lid)
        if lid in refused:
            continue
        if lid in named and named[lid][0] != name:
            notes.append(f"communicator {lid}: the {named[lid][2]} evidence names process group {named[lid][0]}, "
                         f"the {src} evidence {name}; left unnamed")
            refused.add(lid)
            del named[lid]
        elif lid not in named:
            named[lid] = (name, desc, src)
    taken = {n for n, _, _ in named.values()}
    by_set: dict[tuple[int, ...], list[str]] = {}
    for name, (ranks, _) in pg_config.items():
        by_set.setdefault(ranks, []).append(name)
    for lid, ranks in sorted(member_set.items()):
        if lid in named or lid in refused or not pg_config:
            continue
        left = [n for n in by_set.get(ranks, []) if n not in taken]
        unnamed_same = [x for x, r in member_set.items() if r == ranks and x not in named]
        if len(left) == 1 and len(unnamed_same) == 1:
            named[lid] = (left[0], pg_config[left[0]][1], "elimination")
            taken.add(left[0])
        elif len(left) > 1 or len(unnamed_same) > 1:
            notes.append(f"communicator {lid} (members {list(ranks)}): {len(left)} process groups with these members "
                         f"({', '.join(left)}) for {len(unnamed_same)} unnamed communicator(s); left unnamed")
    rows = [(lid, n, d, src) for lid, (n, d, src) in sorted(named.items())]
    return pd.DataFrame(rows, columns=cols), notes


FR_MIN_AGREEMENT = 0.95
"""Share of a group's recorded entries (the dump's tail) that must equal, position by position, the
tail of one communicator's logged calls for the group to name it."""
_SAME_COUNT = {"all_gather": "input", "reduce_scatter": "output", "all_reduce": "input", "broadcast": "input",
               "reduce": "input", "send": "input", "recv": "output"}  # FR tensor whose numel NCCL logs as count


def _numel(sizes: Any) -> int | None:
    if not isinstance(sizes, list) or not sizes or not all(isinstance(s, list) for s in sizes):
        return None
    total = 0
    for shape in sizes:
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    return total


def _entry_seq(entry: Mapping[str, Any]) -> int | None:
    """The entry's sequence number in its process group (``p2p_seq_id`` for point-to-point)."""
    seq = entry.get("p2p_seq_id" if entry.get("is_p2p") else "collective_seq_id")
    return int(seq) if isinstance(seq, int) and not isinstance(seq, bool) else None


def _entry_key(entry: Mapping[str, Any]) -> tuple[str, int | None]:
    from nccltrace.pytorch.flight_recorder import op_of

    op = op_of(str(entry.get("profiling_name", "")))
    side = _SAME_COUNT.get(op)
    count = _numel(entry.get(f"{side}_sizes")) if side else None
    return op, count


def _one_name_each(claims: Mapping[int, set[tuple[str, str | None]]], evidence: str, source: str,
                   notes: list[str]) -> pd.DataFrame:  # fmt: skip
    """The names table (``logical_id``, :data:`NAME_COLUMNS`) of the communicators ``claims``
    names with one group; one naming several is left unnamed and said in ``notes``."""
    rows = []
    for lid, named in sorted(claims.items()):
        if len(named) > 1:
            notes.append(f"communicator {lid}: {evidence} name {len(named)} process groups "
                         f"({', '.join(f'{n} ({d})' for n, d in sorted(named, key=str))}); left unnamed")
            continue
        ((name, desc),) = named
        rows.append((lid, name, desc, source))
    return pd.DataFrame(rows, columns=["logical_id", *NAME_COLUMNS])


def _comm_sequences(calls: pd.DataFrame) -> dict[int, list[tuple[str, int | None]]]:
    """Per communicator pointer of one process: its calls' (op in Flight Recorder's names, count)."""
    from nccltrace.megatron.behaviour import NCCL_OPS

    return {int(comm): [(NCCL_OPS.get(str(o), str(o).lower()), int(c)) for o, c in zip(part["op"], part["count"])]
            for comm, part in calls.groupby("comm", sort=False)}  # fmt: skip


def _group_entries(dump: Any) -> tuple[dict[str, list[tuple[str, int | None]]], dict[str, list[int | None]]]:
    """Per process group of a dump, in record order: its entries' keys (:func:`_entry_key`) and
    sequence numbers."""
    keys: dict[str, list[tuple[str, int | None]]] = {}
    seqs: dict[str, list[int | None]] = {}
    for e in sorted(dump.entries, key=lambda e: e.get("record_id", 0)):
        pg = e.get("process_group")
        name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else None
        if name in dump.groups:
            keys.setdefault(name, []).append(_entry_key(e))
            seqs.setdefault(name, []).append(_entry_seq(e))
    return keys, seqs


def _tail_agrees(entries: list[tuple[str, int | None]], calls: list[tuple[str, int | None]]) -> tuple[int, bool]:
    """(how many of a group's last entries line up with a communicator's last calls, whether
    every one of them equals its call): the count is 0 unless at least :data:`FR_MIN_AGREEMENT`
    of the entries equal their calls position by position from the end."""
    n = min(len(entries), len(calls))
    same = sum(a[0] == b[0] and (a[1] is None or a[1] == b[1]) for a, b in zip(entries[-n:], calls[-n:])) if n else 0
    return (n, same == n) if n and same >= FR_MIN_AGREEMENT * len(entries) else (0, False)


def flight_recorder_ranks(members: pd.DataFrame, dumps: Iterable[Any], calls_of: Any
                          ) -> tuple[dict[tuple[str, int], tuple[int, int | None]], list[str]]:  # fmt: skip
    """(host, pid) -> (global rank, world size) from Flight Recorder dumps, which carry a rank but
    no process id: a dump is its rank's process when that process alone has, for most of the
    dump's groups with entries, a communicator of the group's size, with the rank's position in
    the group as its rank, whose last calls are the group's last entries (``calls_of(host, pid)``
    as for :func:`name_by_flight_recorder`). The world size is the dump's default group's size.
    Dumps that fit no process or several, and processes two dumps fit, are named in the notes."""
    notes: list[str] = []
    procs = sorted({(str(h), int(p)) for h, p in zip(members["host"], members["pid"])})
    comms_of: dict[tuple[str, int], dict[int, tuple[int, int]]] = {}
    for h, p, c, rk, lid in zip(members["host"], members["pid"], members["comm"], members["rank_in_comm"],
                                members["logical_id"]):  # fmt: skip
        comms_of.setdefault((str(h), int(p)), {})[int(c)] = (int(rk), int(lid))
    nranks = members[members["logical_id"] >= 0].groupby("logical_id").size().to_dict()
    seqs = {proc: _comm_sequences(calls_of(*proc)) for proc in procs}
    got: dict[tuple[str, int], list[tuple[int, int | None, str]]] = {}
    for dump in dumps:
        if dump.rank is None:
            continue
        by_group, _ = _group_entries(dump)
        scores = {}
        for proc in procs:
            fitting = 0
            for name, entries in by_group.items():
                ranks = dump.groups[name][0]
                want = (len(ranks), ranks.index(dump.rank)) if dump.rank in ranks else None
                fitting += any(want == (nranks.get(lid, -1), rk) and _tail_agrees(entries, seqs[proc].get(comm, []))[0]
                               for comm, (rk, lid) in comms_of.get(proc, {}).items())
            scores[proc] = fitting
        best = max(scores.values(), default=0)
        winners = [p for p, v in scores.items() if v == best]
        if best * 2 < max(1, len(by_group)) or len(winners) != 1:
            notes.append(f"{dump.path.name}: the Flight Recorder dump of rank {dump.rank} fits "
                         f"{'no process' if best == 0 else f'{len(winners)} processes'} by its recorded calls; "
                         "its rank is not used")
            continue
        world = max((len(r) for r, _ in dump.groups.values()), default=None)
        got.setdefault(winners[0], []).append((dump.rank, world, dump.path.name))
    out: dict[tuple[str, int], tuple[int, int | None]] = {}
    for proc, claims in got.items():
        if len({r for r, _, _ in claims}) > 1:
            notes.append(f"{proc[0]}:{proc[1]}: Flight Recorder dumps of ranks {sorted({r for r, _, _ in claims})} "
                         f"({', '.join(n for _, _, n in claims)}) all fit it; its rank is not used")
            continue
        out[proc] = claims[0][:2]
    return out, notes


def name_by_flight_recorder(comms: pd.DataFrame, members: pd.DataFrame, dumps: Iterable[Any],
                            calls_of: Any) -> tuple[pd.DataFrame, list[str], pd.DataFrame]:  # fmt: skip
    """Per logical communicator: the process group a Flight Recorder dump names for it, joined by
    the calls both saw. A dump is a rank's (its ``rank``); the process with that global rank
    (``members``) logged its calls (``calls_of(host, pid)``: columns ``comm``, ``op``, ``count``,
    in line order). Each group of the dump with recorded entries is compared with every
    communicator of that process with the group's members: the dump's entries (op, and the
    element count where NCCL logs the same one) against the tail of the communicator's calls,
    position by position from the end (the dump keeps the last entries). A group names the one
    communicator that agrees on at least :data:`FR_MIN_AGREEMENT` of them; none or several, and
    ranks whose dumps name one communicator differently, name nothing (the notes say why).
    ``name_source`` is 'flight-recorder'. The third result gives, for the calls a dump's entries
    were placed on, the PyTorch sequence number of each (``host``, ``pid``, ``comm``,
    ``from_end``: 1 for the communicator's last call, ``pg_seq``), only where every entry of the
    tail equals its call (a call one side lacks would shift the numbers before it); ``calls_of`` must leave out
    duplicate lines, as the ops stage counts positions without them."""

    notes: list[str] = []
    rank_proc = {int(r): (str(h), int(p)) for h, p, r in zip(members["host"], members["pid"], members["global_rank"])
                 if not pd.isna(r)}  # fmt: skip
    lid_of = {(str(h), int(p), int(c)): int(lid) for h, p, c, lid in
              zip(members["host"], members["pid"], members["comm"], members["logical_id"]) if int(lid) >= 0}  # fmt: skip
    member_set = {int(lid): tuple(sorted(int(r) for r in m)) for lid, m in zip(comms["logical_id"], comms["members"])}
    claims: dict[int, set[tuple[str, str | None]]] = {}
    seq_rows: list[tuple[str, int, int, int, int]] = []
    for dump in dumps:
        proc = rank_proc.get(dump.rank) if dump.rank is not None else None
        if proc is None:
            notes.append(f"{dump.path.name}: Flight Recorder dump of rank {dump.rank}, which no process with a log has "
                         "(or whose global rank is unknown); not used")
            continue
        seqs = _comm_sequences(calls_of(*proc))
        by_group, seq_of = _group_entries(dump)
        for name, entries in sorted(by_group.items()):
            ranks, desc = dump.groups[name]
            fits = []
            for comm, seq in seqs.items():
                lid = lid_of.get((proc[0], proc[1], comm))
                if lid is None or member_set.get(lid) != ranks:
                    continue
                n, exact = _tail_agrees(entries, seq)
                if n:
                    fits.append((lid, comm, n, exact))
            if len(fits) == 1:
                lid, comm, n, exact = fits[0]
                claims.setdefault(lid, set()).add((name, desc))
                if exact:  # a mismatch may be a call one side lacks: the positions before it could be shifted
                    seq_rows += [(proc[0], proc[1], comm, k, s) for k, s in enumerate(reversed(seq_of[name][-n:]), 1)
                                 if s is not None]
            elif len(fits) > 1:
                notes.append(f"rank {dump.rank}: process group {name} ({desc}) fits {len(fits)} communicators "
                             f"({', '.join(str(f[0]) for f in fits)}) by its recorded calls; left unnamed")
    seq_table = pd.DataFrame(seq_rows, columns=["host", "pid", "comm", "from_end", "pg_seq"])
    return _one_name_each(claims, "the ranks' Flight Recorder dumps", "flight-recorder", notes), notes, seq_table


def name_by_pytorch_lines(members: pd.DataFrame, lines_of: Any) -> tuple[pd.DataFrame, list[str]]:
    """Per logical communicator: the process group PyTorch's own log line names for it
    (:data:`PG_COMM_LINE`; ``lines_of(host, pid)``: the texts of that process's application
    lines). The line gives the communicator pointer, so the join is exact; processes whose lines
    name one communicator with different groups name nothing (the notes say why).
    ``name_source`` is 'pytorch-log'."""
    from nccltrace.pytorch.log_lines import PG_COMM_LINE

    notes: list[str] = []
    claims: dict[int, set[tuple[str, str | None]]] = {}
    procs = sorted({(str(h), int(p)) for h, p in zip(members["host"], members["pid"])})
    lid_of = {(str(h), int(p), int(c)): int(lid) for h, p, c, lid in
              zip(members["host"], members["pid"], members["comm"], members["logical_id"]) if int(lid) >= 0}  # fmt: skip
    for host, pid in procs:
        for text in lines_of(host, pid):
            m = PG_COMM_LINE.search(str(text))
            if m is None:
                continue
            lid = lid_of.get((host, pid, int(m.group("comm"), 16)))
            if lid is None:
                notes.append(f"{host}:{pid}: PyTorch names communicator {m.group('comm')} (process group "
                             f"{m.group('guid') or m.group('id')}), which has no init line in its NCCL log; not used")
                continue
            claims.setdefault(lid, set()).add((m.group("guid") or m.group("id"), m.group("desc") or None))
    return _one_name_each(claims, "PyTorch's log lines", "pytorch-log", notes), notes
