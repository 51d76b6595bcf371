"""PyTorch's process groups joined with NCCL's communicators: every communicator named.

PyTorch creates one NCCL communicator per process group (and device); Megatron names each group
(``group_desc``: ``TENSOR_MODEL_PARALLEL_GROUP``, ``EMBEDDING_GROUP``, ...). Two views of the
same run meet here:

* a profiler trace records, for each NCCL kernel, the process group that launched it
  (``pg_name``, ``pg_desc``); the alignment matched kernels to call lines, so each process's
  communicators (pointers in its log) collect the groups their matched calls' kernels name
  (``process_groups`` of the alignment-quality record);
* the trace's ``distributedInfo.pg_config`` lists every group of the rank with its global
  member ranks.

A logical communicator is named when its processes' matched kernels name one group whose members
are the communicator's (``kernel-records``); conflicting records name nothing (the reason is
kept). A communicator no kernel names (batched Send/Recv kernels carry no group) is named when
exactly one group with its member set is left once every other communicator with that member
set is named (``elimination``): the pipeline and embedding groups of a two-stage pipeline have
the same members and stay two communicators. Anything else stays unnamed, with the reason.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["NAME_COLUMNS", "name_communicators", "pg_config_of_sessions"]

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
                       ) -> tuple[pd.DataFrame, list[str]]:  # fmt: skip
    """Per logical communicator (``logical_id``): ``pg_name``, ``pg_desc`` and ``name_source``
    ('kernel-records' or 'elimination'), for those that could be named; and the notes (what
    was refused, and why). ``records``: the processes' alignment-quality records (their
    ``host``, ``pid`` and ``process_groups``)."""
    cols = ["logical_id", *NAME_COLUMNS]
    notes: list[str] = []
    lid_of = {(str(h), int(p), int(c)): int(lid) for h, p, c, lid in
              zip(members["host"], members["pid"], members["comm"], members["logical_id"]) if int(lid) >= 0}  # fmt: skip
    votes: dict[int, dict[tuple[str, str | None], int]] = {}
    for rec in records:
        host, pid = rec.get("host"), rec.get("pid")
        for entry in rec.get("process_groups") or []:
            lid = lid_of.get((str(host), int(pid) if pid is not None else -1, int(entry["comm"], 16)))
            if lid is None:
                continue
            for g in entry["groups"]:
                key = (str(g["pg_name"]), g.get("pg_desc"))
                votes.setdefault(lid, {})[key] = votes.get(lid, {}).get(key, 0) + int(g["calls"])
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
        named[lid] = (name, desc, "kernel-records")
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
