"""Out-of-core helpers: route rows into on-disk parts, and merge sorted parts back into order.

A run-level stage that cannot hold the run in memory splits it into parts that are each
computed alone (for the metrics: groups of whole communicators), spills every part's rows to
disk, and writes its outputs back in the run's order. Parts are Parquet files sorted by an
int64 key column with small row groups, so that the ordered merge reads, for each chunk of
keys, only the row groups whose statistics overlap it: memory is one chunk, not the run.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Self

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from nccltrace.core.tables import parquet_writer

__all__ = ["PartSpill", "merge_sorted_parts"]

# rows per row group of a spilled part: small groups let the ordered merge skip most of a part
SPILL_ROW_GROUP = 1 << 15


class PartSpill:
    """Parquet part files in a private temporary directory (removed by ``close``).

    ``append(part, table)`` adds rows to part ``part`` (a writer per part stays open, so a
    table streamed batch by batch is routed without holding it); ``read(part)`` closes the
    part's writer and returns its rows.
    """

    def __init__(self, parent: Path | str | None = None, prefix: str = ".spill-") -> None:
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        self._writers: dict[str, pq.ParquetWriter] = {}

    def path(self, part: str) -> Path:
        """The file of part ``part``."""
        return self.dir / f"{part}.parquet"

    def append(self, part: str, table: pa.Table) -> None:
        """Append ``table``'s rows to part ``part`` (the first append fixes the part's schema)."""
        writer = self._writers.get(part)
        if writer is None:
            writer = self._writers[part] = pq.ParquetWriter(self.path(part), table.schema, compression="lz4")
        writer.write_table(table, row_group_size=SPILL_ROW_GROUP)

    def finish(self, part: str) -> Path | None:
        """Close part ``part``'s writer; its path, or None when nothing was appended to it."""
        writer = self._writers.pop(part, None)
        if writer is not None:
            writer.close()
        return self.path(part) if self.path(part).exists() else None

    def read(self, part: str, columns: list[str] | None = None) -> pa.Table | None:
        """The rows of part ``part`` (None when nothing was appended to it)."""
        path = self.finish(part)
        return pq.read_table(path, columns=columns) if path is not None else None

    def close(self) -> None:
        """Close every writer and remove the directory."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key_ranges(paths: Sequence[Path], files: Sequence[pq.ParquetFile],
                key: str) -> list[list[tuple[int, int, int]]]:  # fmt: skip
    """Per file: (row group, min key, max key) from the footer statistics."""
    out = []
    for path, f in zip(paths, files):
        col = f.schema_arrow.get_field_index(key)
        groups = []
        for i in range(f.metadata.num_row_groups):
            rg = f.metadata.row_group(i)
            st = rg.column(col).statistics
            if rg.num_rows == 0:
                continue
            if st is None or not st.has_min_max:
                raise ValueError(f"{path}: row group {i} of a spilled part has no statistics of {key!r}")
            groups.append((i, int(st.min), int(st.max)))
        out.append(groups)
    return out


def iter_merged(paths: Sequence[Path], key: str, stop: int, chunk_keys: int = 1 << 18) -> Iterator[pa.Table]:
    """Rows of the part files ``paths`` (each sorted by the int64 column ``key``, keys unique
    across parts) in key order, as tables covering consecutive key ranges of ``chunk_keys``
    from 0 to ``stop``; ``key`` stays a column."""
    files = [pq.ParquetFile(p) for p in paths]
    ranges = _key_ranges(paths, files, key)
    for lo in range(0, max(stop, 0), chunk_keys):
        hi = lo + chunk_keys
        pieces = []
        for f, groups in zip(files, ranges):
            wanted = [i for i, a, b in groups if a < hi and b >= lo]
            if not wanted:
                continue
            t = f.read_row_groups(wanted)
            k = t[key]
            pieces.append(t.filter(pc.and_(pc.greater_equal(k, lo), pc.less(k, hi))))
        if pieces:
            t = pa.concat_tables(pieces)
            if t.num_rows:
                yield t.sort_by(key)


def merge_sorted_parts(paths: Sequence[Path], key: str, stop: int, out: Path, schema: pa.Schema,
                       chunk_keys: int = 1 << 18) -> int:  # fmt: skip
    """Write the rows of the part files ``paths`` (see ``iter_merged``) to ``out`` in key order,
    without the key column, as ``schema``; atomically. Returns the rows written."""
    rows = 0
    with parquet_writer(out, schema) as writer:
        for t in iter_merged(paths, key, stop, chunk_keys):
            writer.write_table(t.drop_columns([key]).select(schema.names).cast(schema))
            rows += t.num_rows
        if rows == 0:
            writer.write_table(schema.empty_table())
    return rows
