"""Where a windowed capture sits in a whole-run log.

A step-window capture (nsys ``--capture-range=cudaProfilerApi`` around a few training steps)
holds the kernels of those steps only, while ``NCCL_DEBUG_FILE`` logged the whole run. Aligning
the whole log against the window's kernels is unsound: training steps repeat the same calls,
so the window's kernels fit every step equally well, and a band-limited alignment would pick
one with confidence. The window has to be located in the log *before* alignment, from
evidence that does not come from the alignment:

* **log timestamps** (NCCL >= 2.26): a line can only have its kernel in the export if it was
  written shortly before a captured launch (``correlate.capture_span``);
* **a declared step range** (``capture.steps``; ``--capture-steps``): the log's call sequence
  is periodic over training steps; its period and the first step's first line are found from
  the log alone (:func:`step_lines`), and the lines of the declared steps are kept.

Without either, a process whose export holds far fewer launches than its log is not aligned
(:func:`window_unlocated`): the tool says so and names both remedies, rather than guessing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

__all__ = ["COVERAGE_MIN", "StepLines", "log_unlocated", "step_lines", "unlocated_message", "window_unlocated"]

COVERAGE_MIN = 0.75
"""Below this ratio of export launches (kernels and launch records) to logged launch units, the
export is taken to cover part of the log only (a window or a cut), not lost records."""

_MIN_MISSING = 16  # launches missing from the export before it is taken for a window
_MIN_COVER = 0.5  # share of the log the periodic region must cover


@dataclass(frozen=True)
class StepLines:
    """Training-step structure of one process's call lines (``calls`` sorted by file, line).

    ``step`` per line: 0-based step index, -1 before the first step, ``steps`` after the last
    one (initialisation and shutdown calls); ``period``: calls per step; ``first``: row of the
    first step's first call."""

    step: np.ndarray
    period: int
    first: int
    steps: int


def _signatures(calls: pd.DataFrame) -> np.ndarray:
    """One integer per call: what makes the same call of two steps equal (op, communicator,
    element count and type, root/peer), not what differs (opCount, time, buffers)."""
    cols = [c for c in ("op", "comm", "count", "datatype", "root", "nranks") if c in calls]
    return pd.util.hash_pandas_object(calls[cols], index=False).to_numpy()  # one hash per row, all columns


def step_lines(calls: pd.DataFrame) -> StepLines | None:
    """Find the training steps of one process's log (``calls`` in line order, duplicate lines
    excluded by the caller), or None when the log is not cleanly periodic (damaged log, an
    irregular schedule, evaluation steps): the caller must then not locate a window by steps.

    The period is the distance between consecutive occurrences of the rarest call that recurs
    (a call made once per step), confirmed by the whole sequence repeating at that distance;
    the smallest such distance is the step (a pipeline's microbatches repeat within a step,
    but the step's own calls — gradient reduction, optimizer — do not)."""
    s = _signatures(calls)
    n = len(s)
    if n < 8:
        return None
    vals, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    # Candidate periods: distances from an occurrence of a rare recurring call to its later
    # occurrences (a call made k times per step recurs at the step's length after k of them).
    candidates: set[int] = set()
    recurring = np.flatnonzero(counts >= 3)
    for v in recurring[np.argsort(counts[recurring], kind="stable")][:4]:
        pos = np.flatnonzero(inv == v)
        mid = pos[len(pos) // 2 :]
        candidates.update(int(d) for d in (mid[1:65] - mid[0]))
    best: tuple[int, int, int] | None = None
    for p in sorted(candidates):
        if p <= 0 or p > n // 2 or (best is not None and p >= best[0]):
            continue
        same = s[: n - p] == s[p:]
        # the periodic region: the longest run of positions repeating at distance p; it must
        # hold at least two steps and most of the log (a short repeat is a run of like calls)
        edges = np.flatnonzero(np.diff(np.r_[0, same.astype(np.int8), 0]))
        starts, ends = edges[::2], edges[1::2]
        if len(starts) == 0:
            continue
        k = int(np.argmax(ends - starts))
        a, b = int(starts[k]), int(ends[k]) + p  # rows a .. b-1 are periodic
        if b - a < max(2 * p, _MIN_COVER * n):
            continue
        best = (p, a, b)
    if best is None:
        return None
    p, a, b = best
    steps = (b - a) // p
    if steps < 2:
        return None
    step = np.full(n, -1, np.int64)
    rows = np.arange(n)
    inside = (rows >= a) & (rows < a + steps * p)
    step[inside] = (rows[inside] - a) // p
    step[rows >= a + steps * p] = steps
    return StepLines(step=step, period=p, first=a, steps=steps)


def window_unlocated(n_units: int, n_launches: int) -> bool:
    """Whether the export covers too little of the log to be its whole run (see COVERAGE_MIN;
    a handful of missing launches is left to the alignment, which abstains where it cannot tell)."""
    return n_units - n_launches >= _MIN_MISSING and n_launches < COVERAGE_MIN * n_units


def log_unlocated(n_units: int, n_launches: int) -> bool:
    """Whether the log covers too little of the export to be the whole of it: a log cut short
    (copied while the job ran) or with a large block of lines missing."""
    return n_launches - n_units >= _MIN_MISSING and n_units < COVERAGE_MIN * n_launches


def unlocated_message(process: str, n_units: int, n_launches: int) -> str:
    """The one message for a log and an export that cover different parts of the run, when
    nothing locates one in the other."""
    if n_units < n_launches:
        return (f"{process}: the log holds {n_units:,} NCCL launches for {n_launches:,} in the export - a log cut "
                "short or missing lines, whose place in the export cannot be located; its calls are left unmatched. "
                "Remedies: the complete log, or log timestamps (NCCL >= 2.26 with NCCL_DEBUG_TIMESTAMP_FORMAT, "
                "which nccltrace's launch sets)")
    return (f"{process}: the export holds {n_launches:,} NCCL launches for {n_units:,} logged launches - a step-window "
            "or partial capture whose place in the log cannot be located; its calls are left unmatched. Remedies: "
            "log timestamps (NCCL >= 2.26 with NCCL_DEBUG_TIMESTAMP_FORMAT, which nccltrace's launch sets), or "
            "declare the captured steps (run setting capture.steps, or --capture-steps FIRST-LAST)")
