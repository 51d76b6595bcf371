"""The check every written Parquet file must pass: it opens in pandas, pyarrow and DuckDB, and its
columns and types are the ones ``nccltrace tables-doc`` documents for its path."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.parquet as pq

from nccltrace.core.tables import schema_problems
from nccltrace.outputs.tables_doc import documented_schema_of


def problems_of_file(path: Path, root: Path, *, documented: bool = True) -> list[str]:
    """What keeps ``path`` (under the run or campaign directory ``root``) from opening in every
    reader as documented; empty when nothing. ``documented=False``: only that it opens (the
    emulator's raw inputs and ground truth are not tables of the analysis)."""
    problems = []
    for reader, read in (("pandas", pd.read_parquet), ("pyarrow", pq.read_table),
                         ("duckdb", lambda p: duckdb.sql(f"SELECT * FROM read_parquet('{p}')").arrow())):
        try:
            read(path)
        except Exception as exc:  # noqa: BLE001 - every failure is reported with the reader's words
            problems.append(f"{reader}: {type(exc).__name__}: {exc}")
    if not documented:
        return problems
    found = documented_schema_of(path.relative_to(root))
    if found is None:
        problems.append("no documented table (nccltrace tables-doc) for this file")
    else:
        problems += [f"as {found[0]}: {p}" for p in schema_problems(pq.read_schema(path), found[1])]
    return problems


def assert_every_table_opens(root: Path, *, undocumented: tuple[str, ...] = ()) -> int:
    """Every Parquet file under ``root`` passes :func:`problems_of_file` (files under the
    directories ``undocumented``, relative to their run, need only open); returns how many."""
    files = sorted(root.rglob("*.parquet"))
    assert files, f"no Parquet file under {root}"
    bad = {}
    for f in files:
        rel = f.relative_to(root)
        raw = any(part in undocumented for part in rel.parts)
        if p := problems_of_file(f, root, documented=not raw):
            bad[str(rel)] = p
    assert not bad, json.dumps(bad, indent=1)[:4000]
    return len(files)
