"""PyTorch Flight Recorder dumps: the process groups of each rank and the ops they ran.

A dump (one rank's pickled dict) lists every process group of the rank with the description
Megatron gave it and its member ranks: names and ranks for communicators where no profiler trace
says them. Dumps are found by content, whatever their names, and read with an unpickler that
builds only plain values: a pickle that references any Python object (a class, a function) is
refused with its name, never executed. Dump layout: ``docs/correlation.md``, Module notes.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FlightRecorderDump", "FlightRecorderError", "find_dumps", "group_ops", "layout_input", "load_dump",
           "op_of", "read_dump"]

_MAX_BYTES = 1 << 30  # a dump is a ring buffer of at most a few thousand entries


class FlightRecorderError(ValueError):
    """A file that is not a readable Flight Recorder dump (the message names it and why)."""


class _Refused(pickle.UnpicklingError):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain values only: any global reference (class, function) is refused, so loading a
    hostile or foreign pickle runs nothing."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"it references the Python object {module}.{name}")


def load_dump(path: Path | str) -> dict[str, Any]:
    """The plain dict of a dump; FlightRecorderError (naming the file and what is wrong) for a
    file that is not a pickle, holds more than plain values, or lacks ``pg_config``/``entries``."""
    p = Path(path)
    data = p.read_bytes()
    if len(data) > _MAX_BYTES:
        raise FlightRecorderError(f"{p}: {len(data)} bytes, more than a Flight Recorder dump holds")
    if len(data) < 2 or data[0] != 0x80:
        raise FlightRecorderError(f"{p}: not a pickle (a Flight Recorder dump is a pickled dict)")
    try:
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise FlightRecorderError(f"{p}: refused: {exc} (only plain dicts, lists, strings and numbers are "
                                  "read from a Flight Recorder dump)") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError) as exc:
        raise FlightRecorderError(f"{p}: damaged pickle ({type(exc).__name__}: {exc}); dump it again") from None
    if not isinstance(obj, dict) or "pg_config" not in obj or "entries" not in obj:
        raise FlightRecorderError(f"{p}: a pickle, but not a Flight Recorder dump (no 'pg_config' and 'entries')")
    return obj


@dataclass
class FlightRecorderDump:
    """One rank's dump: its groups (PyTorch name -> (member ranks, desc)) and recorded entries."""

    path: Path
    rank: int | None  # the one rank every group of the dump contains (None: cannot tell)
    version: str | None
    nccl_version: str | None
    groups: dict[str, tuple[tuple[int, ...], str | None]]
    entries: list[dict[str, Any]] = field(default_factory=list)


def _ranks(path: Path, name: str, value: Any) -> tuple[int, ...]:
    ranks = json.loads(value) if isinstance(value, str) else value
    if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise FlightRecorderError(f"{path}: pg_config[{name!r}].ranks is not a list of ranks: {value!r}")
    return tuple(sorted(set(ranks)))


def read_dump(path: Path | str) -> FlightRecorderDump:
    """Read one dump (see :func:`load_dump`) into its groups and entries."""
    p = Path(path)
    raw = load_dump(p)
    cfg = raw["pg_config"]
    if not isinstance(cfg, dict):
        raise FlightRecorderError(f"{p}: pg_config is a {type(cfg).__name__}, not a dict of process groups")
    groups: dict[str, tuple[tuple[int, ...], str | None]] = {}
    for key, pg in cfg.items():
        if not isinstance(pg, dict) or "ranks" not in pg:
            raise FlightRecorderError(f"{p}: pg_config[{key!r}] has no 'ranks'")
        try:
            ranks = _ranks(p, str(key), pg["ranks"])
        except json.JSONDecodeError:
            raise FlightRecorderError(f"{p}: pg_config[{key!r}].ranks is not a JSON list: {pg['ranks']!r}") from None
        desc = pg.get("desc")
        groups[str(pg.get("name", key))] = (ranks, str(desc) if desc is not None else None)
    entries = raw["entries"] if isinstance(raw["entries"], list) else []
    # a rank's pg_config holds only the groups it belongs to: their common member is the rank
    common = set.intersection(*(set(r) for r, _ in groups.values())) if groups else set()
    rank = next(iter(common)) if len(common) == 1 else None
    if rank is None and (m := re.search(r"(\d+)$", p.name)):
        rank = int(m.group(1))
    return FlightRecorderDump(p, rank, _str(raw.get("version")), _str(raw.get("nccl_version")), groups,
                              [e for e in entries if isinstance(e, dict)])


def _str(x: Any) -> str | None:
    return None if x is None else str(x)


def pickle_files(root: Path | str) -> list[Path]:
    """The files under ``root`` (a file or a directory, searched recursively) that are pickles,
    the form Flight Recorder dumps take: logs, traces and READMEs are not read further."""
    root = Path(root)
    files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
    out = []
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(2)
        if len(head) == 2 and head[0] == 0x80:  # pickle protocol 2+
            out.append(f)
    return out


def find_dumps(root: Path | str) -> list[FlightRecorderDump]:
    """Every Flight Recorder dump under ``root`` (a file or a directory, searched recursively),
    recognised by content, in rank order. FlightRecorderError when none is there, or when a
    pickle there is refused (the message names it)."""
    dumps = [read_dump(f) for f in pickle_files(root)]
    if not dumps:
        raise FlightRecorderError(f"{root}: no Flight Recorder dump (a pickled dict with 'pg_config' and 'entries')")
    return sorted(dumps, key=lambda d: (d.rank is None, d.rank if d.rank is not None else 0, str(d.path)))


_OP = re.compile(r"^(?:nccl:)?_?(?P<op>[a-z_]+?)(?:_base|_into_tensor|_tensor)?(?:_coalesced)?(?:\s.*)?$")
_OP_NAMES = {"allgather": "all_gather", "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all",
             "all_to_all_single": "all_to_all", "alltoall_base": "all_to_all", "allreduce": "all_reduce",
             "isend": "send", "irecv": "recv"}  # fmt: skip


def op_of(profiling_name: str) -> str:
    """The collective of an entry's ``profiling_name`` (``nccl:_all_gather_base`` -> all_gather,
    ``nccl:send 0->3`` -> send), or the name itself when it follows no known spelling."""
    m = _OP.match(profiling_name.strip())
    op = m.group("op") if m else profiling_name
    return _OP_NAMES.get(op, op)


def group_ops(dumps: Iterable[FlightRecorderDump]) -> dict[tuple[int, ...], Counter]:
    """Per member set: how many recorded entries of each collective its groups ran (over every
    rank's dump), the behaviour that tells groups with the same kind of members apart."""
    out: dict[tuple[int, ...], Counter] = {}
    for d in dumps:
        for e in d.entries:
            pg = e.get("process_group")
            name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else None
            if name not in d.groups or not isinstance(e.get("profiling_name"), str):
                continue
            out.setdefault(d.groups[name][0], Counter())[op_of(e["profiling_name"])] += 1
    return out


def layout_input(dumps: list[FlightRecorderDump], *, names: bool = True,
                 ) -> tuple[int, list[list[int]], list[str | None] | None]:  # fmt: skip
    """``infer-layout``'s input from dumps: the world size (the largest group, or the highest rank
    + 1), every distinct (member set, desc) group of every rank, and the descs (None when
    ``names`` is False or no group has one: member sets and behaviour alone then decide)."""
    seen: dict[tuple[tuple[int, ...], str | None], None] = {}
    for d in dumps:
        for ranks, desc in d.groups.values():
            seen[(ranks, desc if names else None)] = None
    world = max((max(r) + 1 for r, _ in seen if r), default=0)
    world = max([world, *(len(r) for r, _ in seen)])
    groups = [list(r) for r, _ in seen]
    descs = [d for _, d in seen]
    return world, groups, (descs if names and any(d is not None for d in descs) else None)
