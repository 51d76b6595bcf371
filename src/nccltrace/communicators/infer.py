"""Logical communicators and global ranks, exactly, from NCCL init and split lines.

Every process logs one init line per communicator it joins; the lines of one communicator are
grouped by what NCCL prints alike on every member for that version (``commId``; parent, color
and ``splitCount`` of a split; the k-th occurrence where nothing else tells repeated splits
apart). A process's global rank is its rank in the world communicator. A communicator whose
members do not cover ranks 0..nranks-1 exactly once is kept but marked incomplete with the
reason, never silently completed. Version rules: ``docs/correlation.md``, Module notes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from nccltrace.communicators.schema import (
    COMMUNICATOR_SCHEMA,
    MEMBER_SCHEMA,
    CommunicatorTables,
    run_world_size,
)
from nccltrace.core.layout import CALLS_FILE, COMMS_FILE
from nccltrace.core.settings import RunSettings
from nccltrace.core.tables import frame_to_table, write_table_atomic


def _init_lines(comms: pd.DataFrame) -> pd.DataFrame:
    """One line per (host, pid, comm): COMPLETE if logged, else START (or legacy)."""
    df = comms[comms["event"].isin(["init", "split", "legacy_init"])].copy()
    df["_prio"] = df["phase"].map({"COMPLETE": 0, "START": 1}).fillna(2)
    df = df.sort_values(["host", "pid", "comm", "_prio", "line"], na_position="first")
    df = df.drop_duplicates(["host", "pid", "comm"], keep="first")
    return df.sort_values(["host", "pid", "line"]).reset_index(drop=True)


RANK_SOURCE_WORLD = "world communicator"
RANK_SOURCE_PROFILER = "profiler trace"


def profiler_ranks(session_paths: Iterable[Path | str]) -> dict[tuple[str, int], tuple[int, int | None]]:
    """(host, pid) -> (global rank, world size) from the parsed exports' ``session.json``: a
    PyTorch-profiler trace records its process's rank and the world size (``distributedInfo``);
    a session merged from several traces lists each under ``sources``."""
    import json

    out: dict[tuple[str, int], tuple[int, int | None]] = {}
    for path in session_paths:
        path = Path(path)
        if not path.is_file():
            continue
        doc = json.loads(path.read_text())
        host = doc.get("hostname")
        for src in doc.get("sources") if isinstance(doc.get("sources"), list) else [doc]:
            rank, pids = src.get("rank"), src.get("pids") or []
            if not isinstance(rank, int) or rank < 0 or len(pids) != 1:
                continue  # a trace of several processes does not say which one has the rank
            world = src.get("world_size")
            out[(str(src.get("hostname") or host), int(pids[0]))] = (rank, int(world) if isinstance(world, int)
                                                                      else None)
    return out


RANK_SOURCE_LAUNCHER = "launcher prefix"


def _log_origins(parsed_dirs: Iterable[Path | str]) -> dict[tuple[str, int], dict[str, Any]]:
    """(host, pid) -> the parse stage's ``log_origin.json`` (where log discovery found its lines)."""
    import json

    from nccltrace.core.layout import LOG_ORIGIN_FILE, process_key

    out = {}
    for d in parsed_dirs:
        f = Path(d) / LOG_ORIGIN_FILE
        if f.is_file():  # parsed/nccl/<host>/nccl_<host>_<pid>/
            out[process_key(Path(d).name)] = json.loads(f.read_text())
    return out


def launcher_ranks(parsed_dirs: Iterable[Path | str]) -> dict[tuple[str, int], tuple[int, int | None]]:
    """(host, pid) -> (global rank, None) that a launcher's line prefix named in a combined
    stdout (torchrun ``[rankN]:``, or ``srun --label`` / Open MPI task ranks where every task is
    one process), as the parse stage recorded it."""
    return {k: (int(o["launcher"]["rank"]), None) for k, o in _log_origins(parsed_dirs).items() if o.get("launcher")}


RANK_SOURCE_RECORDS = "call records"


def record_ranks(parsed_dirs: Iterable[Path | str]) -> dict[tuple[str, int], tuple[int, int | None]]:
    """(host, pid) -> (global rank, None) of processes parsed from records without a log
    (``source_rank.json``: the profiler's distributedInfo or a Flight Recorder dump)."""
    import json

    from nccltrace.core.layout import SOURCE_RANK_FILE, process_key

    out = {}
    for d in parsed_dirs:
        f = Path(d) / SOURCE_RANK_FILE
        if f.is_file() and isinstance(rank := json.loads(f.read_text()).get("rank"), int):
            out[process_key(Path(d).name)] = (rank, None)
    return out


RANK_SOURCE_FILE_NAME = "log file name"
RANK_NAME_SETTING = "rank_in_log_name"
"""The run setting (and ``analyze --rank-in-log-name``) naming where log file names carry the rank."""


def file_name_ranks(parsed_dirs: Iterable[Path | str], pattern: str | None, notes: list[str]
                    ) -> dict[tuple[str, int], tuple[int, int | None]]:  # fmt: skip
    """(host, pid) -> (global rank, None) from the name of the file that holds the process's
    lines and no other's, where it matches the user's ``pattern``
    (:class:`~nccltrace.inputs.logs.RankNamePattern`); what could not be used goes to ``notes``."""
    if not pattern:
        return {}
    from nccltrace.inputs.logs import RankNamePattern

    try:
        names = RankNamePattern(pattern)
    except ValueError as e:
        notes.append(f"global ranks not taken from the log file names: {e}")
        return {}
    parsed_dirs = list(parsed_dirs)
    origins = _log_origins(parsed_dirs)
    out, misses = {}, []
    for key in sorted(origins):
        own = origins[key].get("own_file")
        rank = names.rank_of(own, *key) if own else None
        if rank is None:
            misses.append(Path(own).name if own else f"{key[0]}:{key[1]} (its lines share a file with others)")
        else:
            out[key] = (rank, None)
    unnamed = len(parsed_dirs) - len(origins)  # logs used in place (nccl_<host>_<pid>.log): no rank in the name
    if misses or unnamed:
        notes.append(f"log name pattern {pattern!r} named the global rank of {len(out)} of {len(parsed_dirs)} "
                     f"processes; it does not match {', '.join(misses[:3]) or 'the nccl_<host>_<pid>.log files'}"
                     f"{' ...' if len(misses) > 3 else ''}")
    return out


def infer_communicators(comms: pd.DataFrame,
                        known_ranks: Mapping[str, Mapping[tuple[str, int], tuple[int, int | None]]] | None = None
                        ) -> CommunicatorTables:  # fmt: skip
    """Group the init/split lines of all processes of a run into logical communicators.

    A process's global rank is its rank in the world communicator (the parent of splits, or a
    plain init spanning every process). Jobs whose process groups are created lazily may never
    initialise one; ``known_ranks`` (per source, in order of preference: (host, pid) -> (rank,
    world size or None), e.g. :func:`profiler_ranks`, :func:`launcher_ranks`) then names the
    ranks; sources that disagree are reported. Where none does, the rank stays unknown (null),
    and so does the world size: the largest communicator is not the world."""
    lines = _init_lines(comms)
    if lines.empty:
        return CommunicatorTables(
            COMMUNICATOR_SCHEMA.empty_table().to_pandas(), MEMBER_SCHEMA.empty_table().to_pandas(), None
        )
    proc = list(zip(lines["host"], lines["pid"]))
    ptr_key = list(zip(lines["host"], lines["pid"], lines["comm"]))
    is_split = (lines["event"] == "split").to_numpy()
    logical, keys = _logical_ids(lines, proc, ptr_key, is_split)
    lines["logical_id"] = [logical.get(k, -1) for k in ptr_key]
    world_rank, world_lids = _world_ranks(lines, proc, is_split, logical)
    sources = {RANK_SOURCE_WORLD: len(world_rank)} if world_rank else {}
    conflicts: list[str] = []
    # the world communicator is the largest; without one, the largest is not the world
    world_size = int(lines["nranks"].max()) if world_rank else None
    world_size = _add_known_ranks(world_rank, sorted(set(proc)), known_ranks, world_size, sources, conflicts)
    unranked = sorted(f"{h}:{p}" for h, p in set(proc) if (h, p) not in world_rank)
    comm_rows, member_rows = _communicator_rows(lines, keys, world_rank, world_lids)
    comm_frame, member_frame = _rows_frame(comm_rows, COMMUNICATOR_SCHEMA), _rows_frame(member_rows, MEMBER_SCHEMA)
    if world_size is None:
        world_size = run_world_size(comm_frame, member_frame)
    return CommunicatorTables(comm_frame, member_frame, world_size, sources, unranked, conflicts)


def _logical_ids(lines: pd.DataFrame, proc: list[tuple], ptr_key: list[tuple],
                 is_split: np.ndarray) -> tuple[dict[tuple, int], list[tuple]]:  # fmt: skip
    """(host, pid, comm) -> logical id, and the grouping key of each logical id: what NCCL prints
    alike on every member, and the k-th occurrence of that in the process."""
    logical: dict[tuple, int] = {}  # (host, pid, comm) -> logical id
    keys: list[tuple] = []
    key_index: dict[tuple, int] = {}
    seen: dict[tuple, int] = {}  # (process, base key) -> occurrences so far (k-th rule)

    def resolve(i: int) -> tuple:
        row = lines.iloc[i]
        if is_split[i]:
            parent = logical.get((row["host"], row["pid"], row["parent"]))
            split_count = None if pd.isna(row["split_count"]) else int(row["split_count"])
            # Without the parent's init line (an excerpt), the printed commId (2.21-2.22) still
            # identifies the communicator; otherwise color/splitCount/nranks under an unknown parent.
            comm_id = None if parent is not None or pd.isna(row["comm_id"]) else int(row["comm_id"])
            base = ("split", parent, int(row["color"]) if not pd.isna(row["color"]) else None, split_count,
                    comm_id, int(row["nranks"]))
        elif not pd.isna(row["comm_id"]):
            base = ("init", int(row["comm_id"]), int(row["nranks"]))
        else:
            base = ("anon", int(row["nranks"]))  # pre-2.16: no commId; the k-th rule alone
        k = seen.get((proc[i], base), 0)
        seen[(proc[i], base)] = k + 1
        return (*base, k)

    # Parents are initialised before their children in every process, so resolving in line
    # order per process sees each parent's logical id first.
    order = sorted(range(len(lines)), key=lambda i: (lines.at[i, "line"], proc[i]))
    pending = list(order)
    for attempt in range(4):  # a split whose parent line came later in another file order: retry
        retry = []
        last = attempt == 3  # parents that never appear (excerpts): resolve without them
        for i in pending:
            if (not last and is_split[i]
                    and (lines.at[i, "host"], lines.at[i, "pid"], lines.at[i, "parent"]) not in logical):
                retry.append(i)
                continue
            key = resolve(i)
            lid = key_index.setdefault(key, len(keys))
            if lid == len(keys):
                keys.append(key)
            logical[ptr_key[i]] = lid
        pending = retry
        if not pending:
            break
    return logical, keys


def _world_ranks(lines: pd.DataFrame, proc: list[tuple], is_split: np.ndarray,
                 logical: dict[tuple, int]) -> tuple[dict[tuple, int], set[int]]:  # fmt: skip
    """Each process's rank in the world communicator (the parent of splits, else the first
    communicator spanning all processes), and the logical ids those ranks came from."""
    n_proc = len(set(proc))
    world_rank: dict[tuple, int] = {}
    world_lids: set[int] = set()  # the logical communicator each process's global rank came from
    parents = lines[is_split]["parent"]
    for (host, pid), g in lines.groupby(["host", "pid"], sort=False):
        world = g[g["comm"].isin(set(parents[(lines[is_split]["host"] == host) & (lines[is_split]["pid"] == pid)]))]
        if world.empty:
            # A split communicator is never the world (its parent is); without any plain init
            # spanning all processes the global rank stays unknown (-1).
            plain = g[g["event"] != "split"]
            world = plain[plain["nranks"] >= max(n_proc, int(g["nranks"].max()))]
        if not world.empty:
            world_rank[(host, pid)] = int(world.iloc[0]["rank"])
            world_lids.add(logical.get((host, pid, world.iloc[0]["comm"]), -1))
    return world_rank, world_lids


def _add_known_ranks(world_rank: dict[tuple, int], procs: list[tuple],
                     known_ranks: Mapping[str, Mapping[tuple[str, int], tuple[int, int | None]]] | None,
                     world_size: int | None, sources: dict[str, int], conflicts: list[str]) -> int | None:  # fmt: skip
    """Name the ranks the world communicator did not from ``known_ranks`` (``world_rank``,
    ``sources`` and ``conflicts`` updated); a rank named for several processes by a source other
    than the world communicator is dropped from all of them. Returns the world size."""
    claimed: dict[tuple, tuple[int, str]] = {k: (r, RANK_SOURCE_WORLD) for k, r in world_rank.items()}
    for source, ranks in (known_ranks or {}).items():
        used = 0
        for key in procs:
            got = ranks.get((str(key[0]), int(key[1])))
            if got is None:
                continue
            if key in claimed:
                if claimed[key][0] != got[0]:
                    conflicts.append(f"{key[0]}:{key[1]}: rank {claimed[key][0]} from the {claimed[key][1]}, "
                                     f"{got[0]} from the {source}")
                continue
            claimed[key] = (got[0], source)
            world_rank[key] = got[0]
            used += 1
        if used:
            sources[source] = used
        stated = {w for _, w in ranks.values() if w}
        if world_size is None and stated:
            world_size = max(stated)
    by_rank: dict[int, list[tuple]] = {}
    for key, r in world_rank.items():
        by_rank.setdefault(r, []).append(key)
    for r, holders in sorted(by_rank.items()):
        if len(holders) > 1 and any(claimed[k][1] != RANK_SOURCE_WORLD for k in holders):
            conflicts.append(f"global rank {r} named for {len(holders)} processes ("
                             + ", ".join(f"{k[0]}:{k[1]} by the {claimed[k][1]}" for k in sorted(holders)) + ")")
            for k in holders:
                if claimed[k][1] != RANK_SOURCE_WORLD:
                    world_rank.pop(k)
    return world_size


def _communicator_rows(lines: pd.DataFrame, keys: list[tuple], world_rank: dict[tuple, int],
                       world_lids: set[int]) -> tuple[list[tuple], list[tuple]]:  # fmt: skip
    """Rows of the communicators table (members by rank in comm, completeness and its reasons)
    and of the members table (lines of no logical communicator with logical id -1)."""
    comm_rows, member_rows = [], []
    for lid, g in lines[lines["logical_id"] >= 0].groupby("logical_id", sort=True):
        nranks = int(g["nranks"].iloc[0])
        members = [-1] * nranks
        present = [False] * nranks
        problems = []
        for row in g.itertuples(index=False):
            gr = world_rank.get((row.host, row.pid))
            r = int(row.rank)
            if not 0 <= r < nranks:
                problems.append(f"rank {r} outside 0..{nranks - 1} ({row.file}:{row.line})")
            elif present[r]:
                problems.append(f"rank {r} claimed twice ({row.file}:{row.line})")
            else:
                members[r] = -1 if gr is None else gr
                present[r] = True
            member_rows.append((lid, row.host, row.pid, row.comm, r, gr, row.file, row.line))
        missing = [r for r, p in enumerate(present) if not p]
        if missing:
            problems.append(f"no init line for rank(s) {missing[:8]}{'...' if len(missing) > 8 else ''} "
                            "(missing or truncated rank logs?)")
        key = keys[lid]
        first = g.iloc[0]
        comm_rows.append((
            lid, "split" if key[0] == "split" else "init", nranks,
            None if pd.isna(first["comm_id"]) else int(first["comm_id"]),
            key[1] if key[0] == "split" else None,
            None if pd.isna(first["color"]) else int(first["color"]),
            None if pd.isna(first["split_count"]) else int(first["split_count"]),
            members, not problems, "; ".join(problems) or None, lid in world_lids,
        ))
    for row in lines[lines["logical_id"] < 0].itertuples(index=False):
        member_rows.append((-1, row.host, row.pid, row.comm, int(row.rank), world_rank.get((row.host, row.pid)),
                            row.file, row.line))
    return comm_rows, member_rows


def _rows_frame(rows: list[tuple], schema: pa.Schema) -> pd.DataFrame:
    """A table of ``schema`` from row tuples, as pandas with Arrow dtypes."""
    cols = list(zip(*rows)) if rows else [[] for _ in schema]
    return pa.Table.from_arrays([pa.array(list(c), type=f.type) for c, f in zip(cols, schema)],
                                schema=schema).to_pandas(types_mapper=pd.ArrowDtype)


RANK_SOURCE_FLIGHT_RECORDER = "Flight Recorder dump"


def _flight_recorder_ranks(parsed_dirs: list[Path], members: pd.DataFrame, dumps_dir: Path | None,
                           notes: list[str]) -> dict[tuple[str, int], tuple[int, int | None]]:  # fmt: skip
    """Ranks from the dumps in ``dumps_dir`` (:func:`nccltrace.communicators.names.flight_recorder_ranks`),
    for a run whose communicators leave some unknown; empty without dumps."""
    if dumps_dir is None or not Path(dumps_dir).is_dir():
        return {}
    from nccltrace.communicators.names import flight_recorder_ranks
    from nccltrace.core.layout import process_key
    from nccltrace.core.tables import read_table
    from nccltrace.pytorch.flight_recorder import FlightRecorderError, find_dumps

    try:
        dumps = find_dumps(dumps_dir)
    except FlightRecorderError as e:
        notes.append(f"Flight Recorder dumps not used for the global ranks: {e}")
        return {}
    dirs = {process_key(d.name): d for d in parsed_dirs}

    def calls_of(host: str, pid: int) -> pd.DataFrame:
        calls = read_table(dirs[(host, pid)] / CALLS_FILE, columns=["comm", "op", "count", "line", "duplicate_of"])
        return calls[calls["duplicate_of"].isna()].sort_values("line")

    # the members (pointers, ranks in communicators) the dumps are fitted to
    ranks, said = flight_recorder_ranks(members[members["logical_id"] >= 0], dumps, calls_of)
    notes += said
    return ranks


RANK_SOURCE_STRUCTURE = "communicator structure"


def communicator_structure(result: CommunicatorTables) -> tuple[list[tuple[str, int]], list[list[tuple[str, int]]],
                                                                 dict[tuple[str, int], int]]:
    """What the logs say about the job's shape: its processes (host, pid), each logical
    communicator's members by rank in it, and the global ranks already known."""
    members = result.members[result.members["logical_id"] >= 0]
    procs = sorted(set(zip(members["host"].astype(str), members["pid"].astype(int))))
    lists = [[(str(h), int(p)) for h, p in zip(g["host"], g["pid"])]
             for _, g in members.sort_values(["logical_id", "rank_in_comm"]).groupby("logical_id", sort=True)]
    known = {(str(h), int(p)): int(r) for h, p, r in zip(members["host"], members["pid"], members["global_rank"])
             if not pd.isna(r)}
    return procs, lists, known


def _hosts_off_consecutive_ranks(ranks: Mapping[tuple[str, int], int]) -> list[str]:
    """Hosts whose processes' ranks are not one run of consecutive numbers."""
    by_host: dict[str, list[int]] = {}
    for (host, _), r in ranks.items():
        by_host.setdefault(host, []).append(r)
    return sorted(h for h, rs in by_host.items() if max(rs) - min(rs) + 1 != len(rs))


def _structure_ranks(result: CommunicatorTables, settings: RunSettings | Mapping[str, Any] | None, notes: list[str]
                     ) -> dict[tuple[str, int], tuple[int, int | None]]:  # fmt: skip
    """Ranks from the communicators' member lists solved against Megatron's layouts
    (:func:`nccltrace.megatron.rank_structure.solve_global_ranks`), only where exactly one
    assignment fits (keeping the ranks other sources named); why not goes to ``notes``."""
    from nccltrace.megatron.rank_structure import solve_global_ranks

    comms = result.communicators
    if not len(comms) or not comms["complete"].astype(bool).all():
        notes.append("the communicators' structure was not solved for the global ranks: a communicator lacks a "
                     "member (its log is missing), so the processes are not the whole job")
        return {}
    procs, lists, known = communicator_structure(result)
    solution = solve_global_ranks(procs, lists, settings, known=known)
    if solution.ranks is None:
        notes.append(f"the communicators' structure does not name the global ranks: {solution.reason}")
        return {}
    scattered = _hosts_off_consecutive_ranks(solution.ranks)
    if scattered:
        # torchrun and srun's default block distribution give each node consecutive ranks; an
        # assignment that does not is as likely the sign of wrong declared sizes as of an unusual
        # placement, and the structure alone cannot tell which
        notes.append("the communicators' structure does not name the global ranks: the one assignment that fits "
                     f"({solution.reason}) gives host(s) {', '.join(scattered[:3])} ranks that are not consecutive, "
                     "as no block placement does; check the declared sizes, or name the ranks another way")
        return {}
    named = {k: (r, None) for k, r in solution.ranks.items() if k not in known}
    notes.append(f"global ranks of {len(named)} process(es) from the communicators' structure: {solution.reason}; "
                 "this assumes a Megatron-LM job (its group layouts) in which every rank left a log")
    return named


def infer_run_communicators(parsed_dirs: Iterable[Path], out_dir: Path,
                            settings: RunSettings | Mapping[str, Any] | None = None,
                            sessions: Iterable[Path | str] = (), dumps_dir: Path | None = None
                            ) -> CommunicatorTables:  # fmt: skip
    """Read the ``comms.parquet`` of each parsed process and write ``communicators.parquet`` and
    ``communicator_members.parquet`` to ``out_dir``. Logs without any init line (written with
    ``NCCL_DEBUG_SUBSYS=COLL``) get communicators inferred from their call sequences
    (:mod:`nccltrace.communicators.from_calls`, ``kind = 'sequence'``; ``settings``' declared sizes
    choose among partitions the calls cannot tell apart); :func:`communicator_problems` says so.
    ``sessions``: the parsed exports' ``session.json``, whose profiler records name global ranks
    where no communicator spans every rank (:func:`profiler_ranks`); so do the launchers'
    prefixes (:func:`launcher_ranks`), the log file names ``settings`` describe
    (:func:`file_name_ranks`) and, for ranks still unknown, the Flight Recorder dumps in
    ``dumps_dir`` and last the communicators' structure (:func:`_structure_ranks`)."""
    from nccltrace.core.tables import read_table

    parsed_dirs = [Path(d) for d in parsed_dirs]
    frames = [read_table(d / COMMS_FILE) for d in parsed_dirs]
    comms = pd.concat([f for f in frames if len(f)], ignore_index=True) if any(len(f) for f in frames) else None
    if comms is not None:
        _refuse_mixed_jobs(comms)
        notes: list[str] = []  # what each rank source could not use, in the order they were tried
        known = {RANK_SOURCE_RECORDS: record_ranks(parsed_dirs), RANK_SOURCE_PROFILER: profiler_ranks(sessions),
                 RANK_SOURCE_LAUNCHER: launcher_ranks(parsed_dirs),
                 RANK_SOURCE_FILE_NAME: file_name_ranks(parsed_dirs, (settings or {}).get(RANK_NAME_SETTING), notes)}
        result = infer_communicators(comms, known)
        # the last two sources fit what the others named, so each runs only while ranks are unknown
        if result.unranked:
            known[RANK_SOURCE_FLIGHT_RECORDER] = _flight_recorder_ranks(parsed_dirs, result.members, dumps_dir, notes)
            result = infer_communicators(comms, known) if known[RANK_SOURCE_FLIGHT_RECORDER] else result
        if result.unranked:
            known[RANK_SOURCE_STRUCTURE] = _structure_ranks(result, settings, notes)
            result = infer_communicators(comms, known) if known[RANK_SOURCE_STRUCTURE] else result
        result.rank_notes = notes
    else:
        result = _from_call_sequences(parsed_dirs, settings)
    out_dir = Path(out_dir)
    for frame, schema, name in ((result.communicators, COMMUNICATOR_SCHEMA, "communicators"),
                                (result.members, MEMBER_SCHEMA, "communicator_members")):
        write_table_atomic(frame_to_table(frame, schema), out_dir / f"{name}.parquet")
    return result


def job_components(comms: pd.DataFrame) -> list[list[tuple[str, int]]]:
    """Processes grouped by the jobs they belong to: two processes are in one job when they
    share a communicator of two or more ranks (an init line's ``commId``). Processes without
    such an init line are left out."""
    multi = comms[pd.to_numeric(comms["nranks"], errors="coerce").fillna(0) > 1]  # a 1-rank comm links nobody
    rows = multi.dropna(subset=["comm_id"])[["host", "pid", "comm_id"]].drop_duplicates()
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for host, pid, cid in rows.itertuples(index=False):
        a, b = find(("p", str(host), int(pid))), find(("c", int(cid)))
        if a != b:
            parent[a] = b
    jobs: dict[Any, list[tuple[str, int]]] = {}
    for host, pid in rows[["host", "pid"]].drop_duplicates().itertuples(index=False):
        jobs.setdefault(find(("p", str(host), int(pid))), []).append((str(host), int(pid)))
    return sorted((sorted(v) for v in jobs.values()), key=lambda v: v[0])


def _refuse_mixed_jobs(comms: pd.DataFrame) -> None:
    """Logs of several jobs in one run would be merged into one wrong result: refuse, naming
    the jobs found and how to separate them."""
    jobs = job_components(comms)
    if len(jobs) <= 1:
        return
    desc = []
    for i, procs in enumerate(jobs, 1):
        hosts = sorted({h for h, _ in procs})
        desc.append(f"job {i}: {len(procs)} process(es) on {', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''} "
                    f"(e.g. {procs[0][0]}:{procs[0][1]})")
    raise ValueError(f"the NCCL logs hold {len(jobs)} jobs that share no communicator ({'; '.join(desc)}): put "
                     "each job's logs and nsys exports in a directory of its own and analyse them one by one")


def _from_call_sequences(parsed_dirs: list[Path], settings: RunSettings | Mapping[str, Any] | None
                         ) -> CommunicatorTables:  # fmt: skip
    """Communicators of logs without init lines, from the processes' call sequences."""
    from nccltrace.communicators.from_calls import infer_communicators_from_calls
    from nccltrace.communicators.labels import declares_sizes
    from nccltrace.core.tables import read_table

    calls = [read_table(d / CALLS_FILE) for d in parsed_dirs if (d / CALLS_FILE).exists()]
    info = [read_table(d / "comm_info.parquet") for d in parsed_dirs if (d / "comm_info.parquet").exists()]
    calls_df = pd.concat([c for c in calls if len(c)], ignore_index=True) if any(len(c) for c in calls) else None
    info_df = pd.concat([c for c in info if len(c)], ignore_index=True) if any(len(c) for c in info) else None
    sizes = settings if declares_sizes(settings) else None
    return infer_communicators_from_calls(calls_df, sizes=sizes, comm_info=info_df)


INFERRED_NOTE = ("communicators inferred from call sequences: the logs have no init lines (NCCL_DEBUG_SUBSYS "
                 "without INIT); set NCCL_DEBUG_SUBSYS=INIT,COLL (or ALL) for exact communicators and ranks")


def communicator_problems(result: CommunicatorTables) -> list[str]:
    """Why a run's communicators make its results partial (empty: they do not). One home for
    these messages: the workflow's rule and ``nccltrace analyze`` print the same text."""
    comms = result.communicators
    if not len(comms):
        return ["no communicator init or call lines in the NCCL logs (NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS "
                "including INIT and COLL is needed); nothing can be attributed to communicators"]
    out: list[str] = []
    if result.unranked:
        n = len(result.unranked)
        out.append(f"global ranks unknown for {n} of {len(set(zip(result.members['host'], result.members['pid'])))} "
                   f"processes ({', '.join(result.unranked[:4])}{' ...' if n > 4 else ''}): no communicator spans "
                   "every rank (a job whose process groups are created lazily initialises only the communicators that "
                   f"run collectives){' and no other record names them' if not result.rank_sources else ''}, so the "
                   f"world size is {'unknown' if result.world_size is None else result.world_size}; nothing that needs "
                   "a global rank (per-rank figures, parallelism labels by member set, bandwidth limits) is computed "
                   "for them. Remedies: keep the PyTorch-profiler traces (their distributedInfo names each rank) "
                   "or the Flight Recorder dumps beside the logs; set NCCL_DEBUG_FILE in each process to a name with "
                   "its global rank (nccl.<RANK>.%h.%p, in a per-rank wrapper or before init_process_group) and say "
                   "so (--rank-in-log-name 'nccl.{rank}.%h.%p', setting rank_in_log_name); declare the parallel "
                   "sizes, against which the communicators' structure may decide; or run one collective on the default process group (e.g. a barrier) "
                   "after init_process_group so that NCCL logs a communicator of every rank")
    out += [f"global rank sources disagree: {c}" for c in result.rank_conflicts]
    if result.unranked:
        out += result.rank_notes
    inferred = bool((comms["kind"].astype(str) == "sequence").any())
    incomplete = comms[~comms["complete"].astype(bool)]
    if inferred:
        out.append(f"{INFERRED_NOTE} ({len(incomplete)} of {len(comms)} not determined by the calls)")
    elif len(incomplete):
        present = set(result.members["global_rank"].dropna().astype(int)) if len(result.members) else set()
        world = int(result.world_size) if result.world_size else None
        absent = sorted(set(range(world)) - present) if world else []
        ids = ", ".join(str(int(i)) for i in incomplete["logical_id"])
        who = (f"global rank(s) {', '.join(map(str, absent))} of world size {world} left no NCCL log" if absent
               else "some member ranks left no init line (missing or truncated rank logs)")
        out.append(f"{who}: {len(incomplete)} of {len(comms)} communicators are incomplete ({ids}); their ops "
                   "lack those ranks' calls")
    return out
