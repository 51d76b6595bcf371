"""The thesis's alignment of kernel and log operation sequences (``thesis`` mode).

Global Needleman-Wunsch over operation names only, with the thesis's scoring (sections 2.5,
4.2.2, eq. 4.2), kept as the baseline the other modes are measured against. Scoring, the
discrepancies with the thesis text and how they were resolved: ``docs/correlation.md`` section 1.1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numba import njit

__all__ = [
    "DEFAULT_WEIGHTS",
    "OP_CODES",
    "ThesisAlignment",
    "ThesisParams",
    "align_sliding_window",
    "align_thesis",
    "encode_ops",
    "score_pairs",
]

# Kernel family names; further names get codes from len(OP_CODES) upward, per alignment.
OP_CODES: Mapping[str, int] = {
    "AllReduce": 0,
    "AllGather": 1,
    "ReduceScatter": 2,
    "Broadcast": 3,
    "Reduce": 4,
    "SendRecv": 5,
    "Send": 6,
    "Recv": 7,
    "AlltoAll": 8,
}
_MAX_CODES = 128  # codes are int8

# Eq. 4.1: rarer operations weigh more; point-to-point less.
DEFAULT_WEIGHTS: Mapping[str, float] = {
    "AllReduce": 1.0,
    "ReduceScatter": 2.0,
    "AllGather": 2.0,
    "Broadcast": 2.0,
    "Send": 0.5,
    "Recv": 0.5,
    "SendRecv": 0.5,
}

# Traceback directions: kernel and log entry paired / kernel unmatched / log entry unmatched.
_DIAG, _KERNEL_GAP, _LOG_GAP = 0, 1, 2

# Score components are rounded to this quantum so that float64 sums are exact: alternatives that
# score the same then tie exactly, whatever the order of addition, and tie-breaking is predictable.
_QUANTUM = 2.0**-16


def _quantize(x: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(x, np.float64) / _QUANTUM) * _QUANTUM


@dataclass(frozen=True)
class ThesisParams:
    """Scoring of the thesis alignment (section 4.2.2); defaults are the thesis's values.

    ``gap_growth``: ``"linear"`` is eq. 4.2, ``gap * (1 + r * (gap_run_multiplier - 1))``;
    ``"geometric"`` is ``gap * gap_run_multiplier**r``; ``r`` = gaps already in the run.
    ``cell_limit`` bounds ``len(kernel_ops) * len(log_ops)`` (the traceback takes a byte per cell).
    """

    match: float = 5.0
    mismatch: float = -15.0
    gap: float = -5.0
    gap_run_multiplier: float = 1.3
    gap_growth: Literal["linear", "geometric"] = "linear"
    sequence_bonus: float = 1.0
    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    default_weight: float = 1.0
    cell_limit: int = 400_000_000

    def gap_penalty(self, run: np.ndarray | int) -> np.ndarray:
        """Penalty of a gap preceded by ``run`` gaps in the same run (quantized)."""
        r = np.asarray(run, np.float64)
        if self.gap_growth == "linear":
            g = self.gap * (1.0 + r * (self.gap_run_multiplier - 1.0))
        elif self.gap_growth == "geometric":
            with np.errstate(over="ignore"):
                g = self.gap * np.power(self.gap_run_multiplier, r)
        else:
            raise ValueError(f"gap_growth must be 'linear' or 'geometric', not {self.gap_growth!r}")
        return _quantize(g)


@dataclass(frozen=True, eq=False)
class ThesisAlignment:
    """An alignment of a kernel (Nsys) sequence with a log (NCCL) sequence.

    ``pairs`` has shape (k, 2): (kernel index, log index) per column in alignment order, -1 on
    the side that has a gap. ``kernel_codes``/``log_codes`` are the encoded operation names.
    """

    pairs: np.ndarray
    score: float
    kernel_codes: np.ndarray = field(repr=False)
    log_codes: np.ndarray = field(repr=False)

    def _aligned(self) -> tuple[np.ndarray, np.ndarray]:
        both = (self.pairs[:, 0] >= 0) & (self.pairs[:, 1] >= 0)
        p = self.pairs[both]
        return p, self.kernel_codes[p[:, 0]] == self.log_codes[p[:, 1]]

    def matched_pairs(self) -> np.ndarray:
        """(kernel, log) index pairs with the same operation name: those that get log metadata."""
        p, same = self._aligned()
        return p[same]

    def mismatched_pairs(self) -> np.ndarray:
        """(kernel, log) index pairs aligned to each other despite different operation names."""
        p, same = self._aligned()
        return p[~same]

    @property
    def n_matches(self) -> int:
        return int(self._aligned()[1].sum())

    @property
    def n_mismatches(self) -> int:
        return int((~self._aligned()[1]).sum())

    @property
    def n_kernel_gaps(self) -> int:
        """Kernels left without a log entry."""
        return int((self.pairs[:, 1] < 0).sum())

    @property
    def n_log_gaps(self) -> int:
        """Log entries left without a kernel (skipped)."""
        return int((self.pairs[:, 0] < 0).sum())

    @property
    def n_gaps(self) -> int:
        return self.n_kernel_gaps + self.n_log_gaps

    @property
    def max_gap_run(self) -> int:
        """Longest run of consecutive gap columns, either side (the run the gap penalty grows on)."""
        gap = np.concatenate(([False], (self.pairs[:, 0] < 0) | (self.pairs[:, 1] < 0), [False]))
        edges = np.flatnonzero(np.diff(gap.astype(np.int8)))
        return int((edges[1::2] - edges[0::2]).max()) if edges.size else 0

    @property
    def skip_percentage(self) -> float:
        """Percentage of log entries skipped (aligned to no kernel)."""
        n = self.log_codes.size
        return 100.0 * self.n_log_gaps / n if n else 0.0

    @property
    def kernel_match_fraction(self) -> float:
        """Fraction of kernels paired with a log entry of the same name."""
        n = self.kernel_codes.size
        return self.n_matches / n if n else 1.0


def encode_ops(names: Sequence[str], extra: dict[str, int] | None = None) -> np.ndarray:
    """Encode operation names as int8 codes (:data:`OP_CODES`).

    Names not in :data:`OP_CODES` get new codes, recorded in ``extra`` (updated in place); pass
    the same dict for both sequences of an alignment so that their unknown names agree.
    """
    extra = {} if extra is None else extra
    out = np.empty(len(names), np.int8)
    for k, name in enumerate(names):
        code = OP_CODES.get(name)
        if code is None:
            code = extra.get(name)
            if code is None:
                code = len(OP_CODES) + len(extra)
                if code >= _MAX_CODES:
                    raise ValueError(f"more than {_MAX_CODES} distinct operation names")
                extra[name] = code
        out[k] = code
    return out


def _tables(params: ThesisParams, extra: Mapping[str, int]) -> np.ndarray:
    """Substitution matrix over all codes in use (eq. 4.3), quantized."""
    names = {**{c: n for n, c in OP_CODES.items()}, **{c: n for n, c in extra.items()}}
    w = np.full(len(names), params.default_weight, np.float64)
    for c, name in names.items():
        w[c] = params.weights.get(name, params.default_weight)
    sub = params.mismatch * (w[:, None] + w[None, :]) / 2.0
    np.fill_diagonal(sub, params.match * w)
    return _quantize(sub)


@njit(cache=True)
def _fill(a, b, sub, gap_table, bonus):  # pragma: no cover - compiled
    n, m = a.size, b.size
    tb = np.empty((n + 1, m + 1), np.int8)
    prev = np.empty(m + 1, np.float64)
    cur = np.empty(m + 1, np.float64)
    prun = np.empty(m + 1, np.int64)
    crun = np.empty(m + 1, np.int64)
    tb[0, 0] = _DIAG
    prev[0] = 0.0
    prun[0] = 0
    for j in range(1, m + 1):
        prev[j] = prev[j - 1] + gap_table[j - 1]
        prun[j] = j
        tb[0, j] = _LOG_GAP
    for i in range(1, n + 1):
        ai = a[i - 1]
        cur[0] = prev[0] + gap_table[i - 1]
        crun[0] = i
        tb[i, 0] = _KERNEL_GAP
        for j in range(1, m + 1):
            bj = b[j - 1]
            best = prev[j - 1] + sub[ai, bj]
            # Bonus only if the best path into the diagonal predecessor ended in a match of this op.
            if ai == bj and i > 1 and j > 1 and tb[i - 1, j - 1] == _DIAG and a[i - 2] == ai and b[j - 2] == ai:
                best += bonus
            t = _DIAG
            run = 0
            up = prev[j] + gap_table[prun[j]]
            if up > best:
                best, t, run = up, _KERNEL_GAP, prun[j] + 1
            left = cur[j - 1] + gap_table[crun[j - 1]]
            if left > best:
                best, t, run = left, _LOG_GAP, crun[j - 1] + 1
            cur[j] = best
            crun[j] = run
            tb[i, j] = t
        prev, cur = cur, prev
        prun, crun = crun, prun
    return tb, prev[m]


@njit(cache=True)
def _traceback(tb):  # pragma: no cover - compiled
    i, j = tb.shape[0] - 1, tb.shape[1] - 1
    out = np.empty((i + j, 2), np.int64)
    k = 0
    while i > 0 or j > 0:
        t = tb[i, j]
        if t == _DIAG:
            i -= 1
            j -= 1
            out[k, 0], out[k, 1] = i, j
        elif t == _KERNEL_GAP:
            i -= 1
            out[k, 0], out[k, 1] = i, -1
        else:
            j -= 1
            out[k, 0], out[k, 1] = -1, j
        k += 1
    return out[:k][::-1].copy()


@njit(cache=True)
def _score_path(pairs, a, b, sub, gap_table, bonus):  # pragma: no cover - compiled
    s = 0.0
    run = 0
    prev_match = -1  # code of the previous column if it was a match, else -1
    for k in range(pairs.shape[0]):
        i, j = pairs[k, 0], pairs[k, 1]
        if i >= 0 and j >= 0:
            s += sub[a[i], b[j]]
            if a[i] == b[j]:
                if prev_match == a[i]:
                    s += bonus
                prev_match = a[i]
            else:
                prev_match = -1
            run = 0
        else:
            s += gap_table[run]
            run += 1
            prev_match = -1
    return s


@njit(cache=True)
def _sliding(a, b, window):  # pragma: no cover - compiled
    n, m = a.size, b.size
    out = np.empty((n + m, 2), np.int64)
    k = 0
    p = 0  # first log entry after the last matched one
    for i in range(n):
        q = -1
        for j in range(p, min(p + window, m)):
            if b[j] == a[i]:
                q = j
                break
        if q < 0:
            out[k, 0], out[k, 1] = i, -1
            k += 1
            continue
        for j in range(p, q):  # entries jumped over are skipped for good
            out[k, 0], out[k, 1] = -1, j
            k += 1
        out[k, 0], out[k, 1] = i, q
        k += 1
        p = q + 1
    for j in range(p, m):
        out[k, 0], out[k, 1] = -1, j
        k += 1
    return out[:k].copy()


def _prepare(kernel_ops: Sequence[str], log_ops: Sequence[str], params: ThesisParams):
    extra: dict[str, int] = {}
    a = encode_ops(kernel_ops, extra)
    b = encode_ops(log_ops, extra)
    sub = _tables(params, extra)
    gap_table = params.gap_penalty(np.arange(a.size + b.size + 1))
    return a, b, sub, gap_table, float(_quantize(params.sequence_bonus))


def align_thesis(
    kernel_ops: Sequence[str], log_ops: Sequence[str], params: ThesisParams = ThesisParams()
) -> ThesisAlignment:
    """Align a process's kernel operation names (Nsys, first) with its log operation names (NCCL).

    Needleman-Wunsch with the thesis's scoring (see the module docstring). Raises ``ValueError``
    if ``len(kernel_ops) * len(log_ops)`` exceeds ``params.cell_limit``.
    """
    cells = len(kernel_ops) * len(log_ops)
    if cells > params.cell_limit:
        raise ValueError(
            f"thesis alignment of {len(kernel_ops)} kernels x {len(log_ops)} log entries needs {cells:.3g} "
            f"matrix cells, above the limit of {params.cell_limit:.3g} (ThesisParams.cell_limit); "
            "the thesis mode keeps the full O(n*m) matrix: use the default alignment mode for inputs this large"
        )
    a, b, sub, gap_table, bonus = _prepare(kernel_ops, log_ops, params)
    tb, score = _fill(a, b, sub, gap_table, bonus)
    return ThesisAlignment(pairs=_traceback(tb), score=float(score), kernel_codes=a, log_codes=b)


def align_sliding_window(kernel_ops: Sequence[str], log_ops: Sequence[str], window: int = 5) -> ThesisAlignment:
    """The thesis's baseline (section 4.3.2): first same-name log entry within a search window.

    For each kernel in order, the ``window`` log entries following the last matched one are
    searched for the first with the same name; it is matched, and entries jumped over are
    skipped for good. Without one, the kernel stays unmatched and the position does not move.
    The score is that of the resulting alignment under the default :class:`ThesisParams`.
    """
    if window < 1:
        raise ValueError("window must be at least 1")
    a, b, sub, gap_table, bonus = _prepare(kernel_ops, log_ops, ThesisParams())
    pairs = _sliding(a, b, window)
    score = _score_path(pairs, a, b, sub, gap_table, bonus)
    return ThesisAlignment(pairs=pairs, score=float(score), kernel_codes=a, log_codes=b)


def score_pairs(
    pairs: np.ndarray, kernel_ops: Sequence[str], log_ops: Sequence[str], params: ThesisParams = ThesisParams()
) -> float:
    """Thesis score of a given alignment (``pairs`` as in :class:`ThesisAlignment`)."""
    a, b, sub, gap_table, bonus = _prepare(kernel_ops, log_ops, params)
    p = np.asarray(pairs, np.int64).reshape(-1, 2)
    return float(_score_path(p, a, b, sub, gap_table, bonus))
