"""Exact statistics over a table read in batches, in memory that grows by bytes, not rows.

The run report reads a run's ops table one record batch at a time (:mod:`nccltrace.stages.report`).
Counts and sums add up across batches; what does not (first sightings of a kernel key, values
for medians and quantiles, per-group partial sums, integer ids of key tuples, the median of a
histogram) is kept here in compact form, so the results equal those of the whole table wherever
the batch edges fall.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["FirstSeen", "GroupValues", "KeyIds", "PartialSums", "group_codes", "median_of_counts"]


def _scalar(v: Any) -> Hashable:
    """A key component as a plain Python value (None for any missing value), so equal keys from
    different batches (numpy or Python integers, pd.NA or NaN) hash alike."""
    if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)):
        return None
    return v.item() if isinstance(v, np.generic) else v


def group_codes(frame: pd.DataFrame) -> tuple[np.ndarray, list[tuple]]:
    """(code per row, key tuple per code): rows with equal values in every column of ``frame``
    share a code 0..k-1; missing values are equal to each other, as in ``drop_duplicates``."""
    if frame.empty:
        return np.zeros(0, dtype=np.int64), []
    # one integer per row from each column's factor codes (cheaper than grouping by the columns)
    combined, radix = np.zeros(len(frame), dtype=np.int64), 1
    for name in frame.columns:
        codes, uniques = pd.factorize(frame[name], use_na_sentinel=False)
        radix *= max(len(uniques), 1)
        if radix >= 1 << 62:  # too many combinations for one int64: let pandas number the groups
            combined = frame.groupby(list(frame.columns), dropna=False, sort=False).ngroup().to_numpy(dtype=np.int64)
            break
        combined = combined * max(len(uniques), 1) + codes
    _, first, local = np.unique(combined, return_index=True, return_inverse=True)
    # the first row of each group names its key
    keys = [tuple(_scalar(v) for v in row) for row in frame.iloc[first].itertuples(index=False, name=None)]
    return local.astype(np.int64, copy=False), keys


class KeyIds:
    """A stable integer id per key tuple, across batches (``keys[id]`` is the tuple)."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.keys: list[tuple] = []

    def codes(self, frame: pd.DataFrame) -> np.ndarray:
        """The id of each row's key (the values of all columns of ``frame``), new keys numbered on."""
        local, keys = group_codes(frame)
        for k in keys:
            if k not in self.ids:
                self.ids[k] = len(self.keys)
                self.keys.append(k)
        lut = np.array([self.ids[k] for k in keys], dtype=np.int64)
        return lut[local] if len(local) else local


class PartialSums:
    """Per-group aggregates of batches folded into one frame: each batch adds its rows (the key
    columns and the value columns), aggregated at once per group; ``total`` aggregates the
    batches' groups again (``how``: 'sum', 'min' or 'max' per value column; missing keys form
    groups of their own)."""

    _FOLD = 16  # batches' aggregates held before they are folded into one

    def __init__(self, keys: Sequence[str], how: Mapping[str, str]) -> None:
        self.keys = list(keys)
        self.how = dict(how)
        self._parts: list[pd.DataFrame] = []

    def _aggregate(self, rows: pd.DataFrame) -> pd.DataFrame:
        return rows.groupby(self.keys, dropna=False, sort=False, as_index=False).agg(self.how)

    def add(self, rows: pd.DataFrame) -> None:
        """Add rows (or partial aggregates) of ``keys`` and the value columns."""
        if len(rows):
            self._parts.append(self._aggregate(rows[self.keys + list(self.how)]))
            if len(self._parts) >= self._FOLD:
                self._parts = [self.total()]

    def total(self) -> pd.DataFrame:
        """One row per group over every batch added (empty, with the columns, when none was)."""
        if not self._parts:
            return pd.DataFrame(columns=self.keys + list(self.how))
        if len(self._parts) == 1:
            return self._parts[0]
        return self._aggregate(pd.concat(self._parts, ignore_index=True))


class FirstSeen:
    """Rows whose key (host, kernel_global_pid, kernel_correlation_id) appears for the first time
    over all batches fed so far, in feeding order: ``drop_duplicates`` of the three columns over
    the whole table, one batch at a time. ``tag`` (0 or 1) names one of two independent
    questions over the same keys (kernels of the summary tables and of the timeline), so the
    two share one set.

    Each key is packed exactly into one int64: an id of (host, process, high bits of the
    correlation id) in the top 21 bits, the low 40 bits of the correlation id, and one bit per
    tag that has seen the key. The keys are kept as one sorted array: 8 bytes per distinct key
    (and up to a quarter more of headroom)."""

    _TAGS = 2
    _LOW = 40
    _MASK = (1 << _LOW) - 1
    _MAX_IDS = 1 << (63 - _LOW - _TAGS)

    def __init__(self) -> None:
        self._ids = KeyIds()
        # sorted (key << _TAGS) | bits of the tags that saw it, in the first _n slots of a buffer
        # with headroom: growing it by a batch at a time would copy it whole for every batch
        self._buf = np.zeros(1 << 16, dtype=np.int64)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _insert(self, keys: np.ndarray) -> None:
        """Add sorted keys not yet present."""
        n = self._n + len(keys)
        if n > len(self._buf):
            buf = np.empty(max(n, len(self._buf) * 5 // 4), dtype=np.int64)
            buf[: self._n] = self._buf[: self._n]
            self._buf = buf
        self._buf[self._n : n] = keys
        # two sorted runs: timsort merges them in place with a buffer of the shorter one
        self._buf[:n].sort(kind="stable")
        self._n = n

    def _packed(self, host: pd.Series, gpid: pd.Series, corr: pd.Series) -> np.ndarray:
        c = pd.array(corr, dtype="Int64")
        value = c.to_numpy(dtype=np.int64, na_value=0)
        high = pd.array(value >> self._LOW, dtype="Int64")
        high[c.isna()] = pd.NA  # a missing correlation id is its own value, not 0
        ids = self._ids.codes(pd.DataFrame({"h": pd.array(host, dtype="string"), "g": pd.array(gpid, dtype="Int64"),
                                            "c": high}))  # fmt: skip
        if len(self._ids.ids) > self._MAX_IDS:
            raise ValueError(f"more than {self._MAX_IDS} (host, process) pairs: kernel keys no longer fit in 64 bits")
        return ((ids << self._LOW) | (value & self._MASK)) << self._TAGS

    def first(self, host: pd.Series, gpid: pd.Series, corr: pd.Series, tag: int = 0) -> np.ndarray:
        """Boolean mask over the rows: True where the row's key was not seen under ``tag`` in an
        earlier row (of this batch or of an earlier one); records the keys."""
        bit = 1 << tag
        keys = self._packed(host, gpid, corr)
        out = np.zeros(len(keys), dtype=bool)
        if not len(keys):
            return out
        uniq, first_row = np.unique(keys, return_index=True)  # first occurrence within the batch
        seen = self._buf[: self._n]
        # a key's entry is the smallest value >= key << _TAGS, if it has one
        pos = np.searchsorted(seen, uniq)
        known = pos < len(seen)
        known[known] = (seen[pos[known]] >> self._TAGS) == (uniq[known] >> self._TAGS)
        fresh = ~known
        fresh[known] = (seen[pos[known]] & bit) == 0
        out[first_row[fresh]] = True
        seen[pos[known & fresh]] |= bit  # the tag bits are below the key: the order holds
        if (~known).any():
            self._insert(uniq[~known] | bit)
        return out


class GroupValues:
    """The non-missing values of some float columns per group id, as float64 arrays: what a
    median or quantile needs, without the rows' other columns."""

    _CHUNK = 1 << 16  # values per joined chunk: small pieces are joined, joined chunks stay as they are

    def __init__(self, columns: Sequence[str]) -> None:
        self.columns = list(columns)
        # per (group, column): joined chunks, then the pieces added since
        self._chunks: dict[tuple[int, str], list[np.ndarray]] = {}
        self._pieces: dict[tuple[int, str], list[np.ndarray]] = {}

    def add(self, group: np.ndarray, values: Mapping[str, np.ndarray]) -> None:
        """Append each row's values to its group (``group``: an id per row)."""
        if not len(group):
            return
        order = np.argsort(group, kind="stable")  # rows keep their order within a group
        ids = group[order]
        bounds = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1], True])
        for name in self.columns:
            col = np.asarray(values[name], dtype=np.float64)[order]
            for lo, hi in itertools.pairwise(bounds):
                part = col[lo:hi]
                part = part[~np.isnan(part)]
                if len(part):
                    key = (int(ids[lo]), name)
                    pieces = self._pieces.setdefault(key, [])
                    pieces.append(part)
                    if len(pieces) >= 64 or sum(len(x) for x in pieces) >= self._CHUNK:
                        self._chunks.setdefault(key, []).append(np.concatenate(pieces))
                        pieces.clear()

    def get(self, group: int, column: str) -> np.ndarray:
        """The values of ``column`` in ``group`` (missing values left out), as a new float64 array."""
        chunks = self._chunks.get((group, column), []) + self._pieces.get((group, column), [])
        return np.concatenate(chunks) if chunks else np.zeros(0)

    def median(self, group: int, column: str) -> float:
        """``Series.median`` of the values (NaN without): numpy's median, which pandas calls on
        the values without missing ones, taken in place on the new array instead of a copy."""
        values = self.get(group, column)
        return float(np.median(values, overwrite_input=True)) if len(values) else float("nan")

    def nbytes(self) -> int:
        """Bytes of the values held."""
        return sum(a.nbytes for d in (self._chunks, self._pieces) for arrays in d.values() for a in arrays)


def median_of_counts(values: np.ndarray, counts: np.ndarray) -> float:
    """Median of the multiset in which ``values[i]`` occurs ``counts[i]`` times: the value
    ``Series.median`` gives on the expanded values (mean of the two middle ones when even)."""
    order = np.argsort(values, kind="stable")
    v = np.asarray(values, dtype=np.float64)[order]
    cum = np.cumsum(np.asarray(counts, dtype=np.int64)[order])
    n = int(cum[-1]) if len(cum) else 0
    if n == 0:
        return float("nan")
    lo, hi = np.searchsorted(cum, [(n - 1) // 2, n // 2], side="right")
    return float(np.median(v[[lo, hi]]))
