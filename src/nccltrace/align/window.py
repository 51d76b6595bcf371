"""Where a windowed capture sits in a whole-run log.

A step-window capture holds a few steps' kernels while the log covers the whole run, and steps
repeat the same calls, so the window must be located in the log before alignment, from evidence
the alignment does not produce: log timestamps or a declared step range. Without either, a
process whose export holds far fewer launches than its log is not aligned and the tool names both
remedies rather than guessing (``docs/correlation.md`` section 1.5).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

__all__ = ["COVERAGE_MIN", "STEP_MARKER_RE", "StepLines", "TraceLocation", "TraceSteps", "locate_by_trace",
           "log_unlocated", "step_lines", "steps_before_by_lines", "steps_before_periodic", "trace_steps",
           "unlocated_message", "window_unlocated"]

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


def steps_before_periodic(calls: pd.DataFrame, sl: StepLines) -> int:
    """How many training steps the log completed before its periodic region starts (row
    ``sl.first``): the calls made exactly once in every periodic step are counted in the rows
    before it (their median). A first iteration that differs from the rest (an extra broadcast,
    communicators created on first use) is not periodic, yet it is a step: without this count,
    step numbers found from the periodic region alone start one iteration late."""
    sig = _signatures(calls)
    p, a = sl.period, sl.first
    body = sig[a:a + sl.steps * p].reshape(sl.steps, p)
    vals, counts = np.unique(body[0], return_counts=True)
    once = [v for v, c in zip(vals, counts, strict=True) if c == 1 and ((body == v).sum(axis=1) == 1).all()]
    if not once:
        return 0
    before = sig[:a]
    return int(np.median([int((before == v).sum()) for v in once]))


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


# --------------------------------------------------------------------------- profiler step markers

STEP_MARKER_RE = re.compile(r"^(?:ProfilerStep#(?P<profiler>\d+)|iteration (?P<megatron>\d+))$")
"""Step ranges in a kernel trace: ``ProfilerStep#N``, which ``torch.profiler`` records around each
``prof.step()`` interval (N = the profiler's step count: the training loop's 0-based iteration
when the profiler starts with the loop, as Megatron's ``--use-pytorch-profiler`` and
``torch.profiler.schedule`` users do), and NVTX ranges ``iteration N`` in Megatron's 1-based
iteration numbering (what ``--capture-steps`` takes; the emulator writes them)."""



@dataclass(frozen=True)
class TraceSteps:
    """Step markers of one process's kernel trace: ``numbers`` (sorted step numbers with a
    marker), and ``step`` per kernel of the kernel sequence (its launch inside that step's range,
    -1 outside every marked step)."""

    numbers: tuple[int, ...]
    step: np.ndarray

    @property
    def first(self) -> int:
        return self.numbers[0]


@dataclass(frozen=True)
class TraceLocation:
    """Where a kernel trace's window lies in the log: ``outside`` per call row (line order), how
    it was decided (``located_by``) and what to say; ``outside`` None when it could not be located
    (``message`` says why)."""

    outside: np.ndarray | None
    located_by: str | None
    message: str | None
    offset: int = -1
    candidates: int = 0
    first_step: int | None = None


def trace_steps(kernels: pd.DataFrame, nvtx: pd.DataFrame | None, pid: int | None) -> TraceSteps | None:
    """The profiler's step markers of process ``pid`` (``nvtx`` ranges named ``ProfilerStep#N``)
    and each kernel's step (``kernels`` in sequence order; by its launch time, else its start);
    None when the trace has no marker of this process."""
    if nvtx is None or not len(nvtx) or "text" not in nvtx or not len(kernels):
        return None
    rows = nvtx
    if pid is not None and "pid" in nvtx:
        rows = nvtx[nvtx["pid"].astype("Int64") == int(pid)]
    text = rows["text"].astype(object)
    parts = text.str.extract(STEP_MARKER_RE)
    # steps completed before each marked step: ProfilerStep#N counts from 0, "iteration N" from 1
    num = parts["profiler"].astype("Int64").fillna(parts["megatron"].astype("Int64") - 1)
    if num.notna().any() and parts["profiler"].notna().any() and parts["megatron"].notna().any():
        num = parts["profiler"].astype("Int64")  # both kinds: the profiler's own count is used
    rows = rows[num.notna().to_numpy(bool)]
    if not len(rows):
        return None
    nums = num.dropna().astype(np.int64).to_numpy()
    start = rows["start"].astype("Int64").to_numpy(np.int64)
    end = rows["end"].astype("Int64").fillna(rows["start"].astype("Int64")).to_numpy(np.int64)
    order = np.argsort(start, kind="stable")
    start, end, nums = start[order], end[order], nums[order]
    t = kernels["launch_start"].astype("Int64") if "launch_start" in kernels else pd.Series(pd.NA, index=kernels.index)
    t = t.fillna(kernels["start"].astype("Int64")).fillna(-1).to_numpy(np.int64)
    i = np.searchsorted(start, t, side="right") - 1
    ok = (i >= 0) & (t >= 0)
    step = np.full(len(t), -1, np.int64)
    step[ok] = np.where(t[ok] <= end[i[ok]], nums[i[ok]], -1)
    return TraceSteps(tuple(int(x) for x in np.unique(nums)), step)


def _kernel_args(ks, name: str) -> np.ndarray:
    k = ks.kernels
    if name not in k:
        return np.full(len(k), -1, np.int64)
    return k[name].astype("Int64").fillna(-1).to_numpy(np.int64)


def _unit_calls(units) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per real unit (log order): its row, first call's op, element count and communicator size."""
    real = np.flatnonzero(~units.placeholder & (units.first_call >= 0))
    rows = units.first_call[real]
    c = units.calls
    op = c["op"].astype(object).to_numpy()[rows]
    count = c["count"].astype("Int64").fillna(-1).to_numpy(np.int64)[rows] if "count" in c else np.full(len(rows), -1)
    nranks = c["nranks"].astype("Int64").fillna(-1).to_numpy(np.int64)[rows]
    return real, op, count, nranks


def _fits(fam_mask: np.ndarray, dt_mask: np.ndarray, op: np.ndarray, count: np.ndarray, nranks: np.ndarray,
          family: np.ndarray, dtype: np.ndarray, in_n: np.ndarray, out_n: np.ndarray,
          gsize: np.ndarray) -> np.ndarray:  # fmt: skip
    """Element-wise: can log unit (fam_mask, dt_mask, op, count, nranks) be the kernel (family and
    dtype class from its name, profiler arguments)? What a kernel does not say (a generic name,
    no dtype, no arguments) does not rule a unit out."""
    from nccltrace.core.kernel_args import kernel_count_fits

    fam_ok = (family < 0) | (((fam_mask >> np.maximum(family, 0)) & 1) == 1)
    fam_ok &= (dtype < 0) | (dt_mask <= 0) | (((dt_mask >> np.maximum(dtype, 0)) & 1) == 1)
    size_ok = kernel_count_fits(op, count, nranks, in_n, out_n)
    group_ok = (gsize < 0) | (nranks < 0) | (gsize == nranks)
    return fam_ok & size_ok & group_ok


def locate_by_trace(units, ks, steps: TraceSteps | None, declared: tuple[int, int] | None = None,
                    marks: pd.DataFrame | None = None) -> TraceLocation:  # fmt: skip
    """Locate a kernel trace's window in one process's log from the trace's own evidence: the
    sequence of its kernels (family, and the profiler's collective arguments where present)
    must occur in the log's launch units at one offset; where the log repeats it step after
    step, the profiler's step number picks the offset whose preceding log holds that many
    occurrences of the calls made once per step. Refuses (``outside`` None) when the sequence
    does not occur, or when several offsets remain and nothing tells them apart.

    ``declared`` (0-based first and last loop iteration, without step markers): the declared
    window is checked against the places the sequence fits, counting completed steps by the
    kernels made once in every declared step (the first iteration counts even when it differs
    from the rest). It is used only when verified: the sequence fits there and nowhere else.
    Where the captured steps repeat identically, nothing tells the declared iterations from
    their neighbours, and the window is refused with the reason (``declared_unverified``).
    ``marks``: Megatron's iteration lines in this log (:mod:`nccltrace.megatron.training_log`);
    where they bracket a candidate, their count of completed iterations replaces the count by
    the calls made once per step."""
    real, op, count, nranks = _unit_calls(units)
    kreal = np.flatnonzero(~ks.placeholder)
    fam, kdt = ks.family[kreal], ks.dtype_class[kreal]
    in_n, out_n, gsize = (_kernel_args(ks, c)[kreal] for c in ("coll_in_nelems", "coll_out_nelems", "coll_group_size"))
    n, m = len(real), len(kreal)
    fm, dm = units.fam_mask[real], units.dt_mask[real]
    if m == 0 or n < m:
        return TraceLocation(None, None, f"the trace holds {m} NCCL kernels for {n} logged launches")
    offsets = np.arange(n - m + 1)
    # pre-filter offsets on a prefix of the sequence (a few vectorised passes), then check every
    # position of the offsets left, one vectorised pass each
    for i in range(min(m, 16)):
        if not len(offsets):
            break
        j = offsets + i
        offsets = offsets[_fits(fm[j], dm[j], op[j], count[j], nranks[j], np.full(len(j), fam[i]),
                                np.full(len(j), kdt[i]), np.full(len(j), in_n[i]), np.full(len(j), out_n[i]),
                                np.full(len(j), gsize[i]))]
    full = []
    for o in offsets:
        sl = slice(o, o + m)
        if _fits(fm[sl], dm[sl], op[sl], count[sl], nranks[sl], fam, kdt, in_n, out_n, gsize).all():
            full.append(int(o))
    if not full:
        return TraceLocation(None, None, f"the trace's sequence of {m} NCCL kernels (collectives and sizes) occurs "
                                         "nowhere in the log: a trace of another run, or records lost on either side")
    chosen, how, first = None, None, None
    if len(full) == 1:
        chosen, how = full[0], "trace_sequence"
    elif steps is not None and len(steps.numbers):
        first = steps.first
        est = _steps_before(full, steps, fm, dm, op, count, nranks, fam, kdt, in_n, out_n, gsize, kreal)
        hits = [o for o, e in zip(full, est, strict=True) if e is not None and e == first]
        if len(hits) == 1:
            chosen, how = hits[0], "profiler_steps"
        else:
            seen = ", ".join(f"{'?' if e is None else e}" for e in est[:8])
            return TraceLocation(None, None, (
                f"the trace's kernel sequence fits the log at {len(full)} places (its steps repeat) and the "
                f"profiler's step number #{first} matches {'none' if not hits else len(hits)} of them (steps "
                f"completed before each place, by the calls made once per step: {seen}); the profiler's steps may "
                "not count from the log's first iteration"), candidates=len(full), first_step=first)
    elif declared is not None:
        return _check_declared(full, declared, m, fm, dm, op, count, nranks, fam, kdt, in_n, out_n, gsize, kreal,
                               units, real, marks)
    else:
        return TraceLocation(None, None, f"the trace's kernel sequence fits the log at {len(full)} places (its steps "
                                         "repeat) and the trace has no step markers to tell them apart",
                             candidates=len(full))
    said = None
    if declared is not None and steps is None and how == "trace_sequence":
        # one place fits: the declared steps are checked against it (completed steps before it)
        check = _check_declared(full, declared, m, fm, dm, op, count, nranks, fam, kdt, in_n, out_n, gsize, kreal,
                                units, real, marks)
        if check.outside is not None:
            return check
        said = f"{check.message}; the one place where the trace's sequence fits was used"
    # the window: the lines of its launch units, and the lines without a launch between them
    inside = np.isin(units.call_unit, real[chosen:chosen + m])
    rows = np.flatnonzero(inside)
    r = np.arange(len(units.calls))
    outside = (r < rows.min()) | (r > rows.max())
    return TraceLocation(outside, how, said, offset=chosen, candidates=len(full), first_step=first)


def _window(units, real: np.ndarray, offset: int, m: int) -> np.ndarray:
    """``outside`` per call row for the window of ``m`` launch units from ``offset``."""
    rows = np.flatnonzero(np.isin(units.call_unit, real[offset:offset + m]))
    r = np.arange(len(units.calls))
    return (r < rows.min()) | (r > rows.max())


def _check_declared(full: list[int], declared: tuple[int, int], m: int, fm, dm, op, count, nranks, fam, kdt, in_n,
                    out_n, gsize, kreal, units, real, marks: pd.DataFrame | None = None) -> TraceLocation:  # fmt: skip
    """Declared steps (0-based loop iterations ``declared``) checked against the places ``full``
    where the trace's sequence fits (see :func:`locate_by_trace`)."""
    lo, hi = declared
    n_steps = hi - lo + 1
    said = f"the declared capture steps (Megatron iterations {lo + 1}-{hi + 1})"
    if n_steps <= 0 or m % n_steps:
        return TraceLocation(None, None, f"{said} do not fit the trace: its {m} NCCL kernels are not {n_steps} equal "
                                         "steps", candidates=len(full))
    per = m // n_steps
    pseudo = TraceSteps(tuple(range(lo, hi + 1)), np.repeat(np.arange(lo, hi + 1), per))
    est = _steps_before(full, pseudo, fm, dm, op, count, nranks, fam, kdt, in_n, out_n, gsize, np.arange(m))
    if marks is not None and len(marks):
        est = _steps_before_by_lines(full, units, real, marks, est)
    at = [o for o, e in zip(full, est, strict=True) if e == lo]
    fits = ", ".join(str(e + 1) if e is not None else "?" for e in est[:8])
    if len(at) == 1 and len(full) == 1:
        return TraceLocation(_window(units, real, at[0], m), "declared_steps", None, offset=at[0], candidates=1,
                             first_step=lo)
    if len(at) == 1:
        return TraceLocation(None, None, (
            f"{said} fit the trace, but the captured steps repeat identically in the log: the trace's kernel sequence "
            f"fits at {len(full)} places (starting at iterations {fits}), so nothing verifies that the capture holds "
            "these iterations rather than their neighbours (declared_unverified). Remedy: keep the profiler's step "
            "markers (ProfilerStep#N) or NVTX iteration ranges in the trace, or log timestamps (NCCL >= 2.26)"),
            candidates=len(full))  # fmt: skip
    return TraceLocation(None, None, (
        f"{said} contradict the trace: its kernel sequence fits the log only where iterations {fits} start, not "
        f"at iteration {lo + 1}; check the declared steps (Megatron's 1-based iteration numbers)"),
        candidates=len(full))


def _steps_before_by_lines(offsets: list[int], units, real: np.ndarray, marks: pd.DataFrame,
                           est: list[int | None]) -> list[int | None]:  # fmt: skip
    """``est`` with each candidate's count replaced by Megatron's iteration lines where they tell
    it: the lines printed before the candidate's first call (one per completed iteration)."""
    from nccltrace.megatron.training_log import completed_before

    units_of_rows, first_row = np.unique(units.call_unit, return_index=True)
    first = first_row[np.searchsorted(units_of_rows, real[np.asarray(offsets, np.int64)])]
    done = completed_before(marks, units.calls["line"].to_numpy(np.int64)[first])
    return [int(d) if d >= 0 else e for d, e in zip(done, est, strict=True)]


def steps_before_by_lines(lines: np.ndarray, sl: StepLines, marks: pd.DataFrame) -> tuple[int | None, str | None]:
    """Training steps completed before the log's periodic region (row ``sl.first`` of ``lines``,
    the log line of each call row :func:`step_lines` saw), counted by Megatron's iteration lines
    at every step boundary they bracket: ``(count, None)`` when all boundaries agree, ``(None,
    why)`` when they contradict the step structure (evaluation or skipped iterations, a restart
    from a checkpoint), ``(None, None)`` when the lines bracket none."""
    from nccltrace.megatron.training_log import completed_before

    bounds = sl.first + sl.period * np.arange(sl.steps + 1)
    bounds = bounds[bounds < len(lines)]
    done = completed_before(marks, np.asarray(lines, np.int64)[bounds])
    ok = done >= 0
    if not ok.any():
        return None, None
    before = np.unique(done[ok] - np.flatnonzero(ok))
    if len(before) == 1:
        return int(before[0]), None
    return None, (f"Megatron's iteration lines contradict the log's step structure ({sl.period} calls per step): "
                  f"counted at its step boundaries they put {', '.join(map(str, before[:6]))} iterations before its "
                  "periodic part (evaluation or skipped iterations, a restart, or lines printed out of order)")


def _steps_before(offsets: list[int], steps: TraceSteps, fm, dm, op, count, nranks, fam, kdt, in_n, out_n, gsize,
                  kreal) -> list[int | None]:  # fmt: skip
    """For each candidate offset: how many training steps the log completed before it, counted
    by the kernels made exactly once in every marked step of the trace (what identifies them:
    family, dtype class and the profiler's arguments where present): the median over those of
    their compatible log launches before the offset. None without such kernels."""
    st = steps.step[kreal]
    marked = st >= 0
    if not marked.any():
        return [None] * len(offsets)
    keys = pd.DataFrame({"fam": fam, "dt": kdt, "in": in_n, "out": out_n, "g": gsize, "step": st})[marked]
    keys = keys[keys["fam"] >= 0]
    if not len(keys):
        return [None] * len(offsets)
    per_step = keys.groupby(["fam", "dt", "in", "out", "g", "step"]).size().unstack("step", fill_value=0)
    nsteps = len(np.unique(st[marked]))
    once = per_step[(per_step == 1).all(axis=1)] if per_step.shape[1] == nsteps else per_step.iloc[0:0]
    if not len(once):
        return [None] * len(offsets)
    counts = []
    k = len(fm)
    for (f, d, i_n, o_n, g) in once.index:
        hit = _fits(fm, dm, op, count, nranks, np.full(k, f), np.full(k, d), np.full(k, i_n), np.full(k, o_n),
                    np.full(k, g))
        counts.append(np.concatenate([[0], np.cumsum(hit)]))
    return [int(np.median([c[o] for c in counts])) for o in offsets]
