"""The default aligner: windowed Needleman-Wunsch over launch units and kernels, compiled.

It uses the signals the thesis's alignment ignores (launch order, launch units, kernel family and
element type, stream, log-to-launch delay) and reports a match only where the two extreme
co-optimal alignments agree, because a wrong match corrupts bandwidths while a gap only loses one
sample. The window keeps time linear and memory bounded in the sequence length. Design:
``docs/correlation.md`` section 1.2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numba as nb
import numpy as np
import pandas as pd

from nccltrace.align.sequences import (
    ALGORITHM_CODE,
    NO_TIME,
    PLACEHOLDER,
    KernelSeq,
    LogUnits,
    _runs,
    kernel_algorithm,
)

NEG = -(10**8)  # forbidden pair
GAP_LOG = -4  # a unit without kernel
GAP_KERNEL = -4  # a kernel without unit
BASE = 10  # family compatible
BASE_GENERIC = 3  # kernel name says nothing (ncclDevKernel_Generic)
DTYPE_OK = 4
STREAM_OK = 6
TIME_OK = 6
GRID_OK = 3  # kernel grid (channels) equals the one learned for this message size and stream
GRID_BAD = 8
ODD_GRID = -10  # k_grid at or below this: the kernel's grid was never seen on its stream
FUSE_EXTRA = 2  # each extra unit absorbed by a fused SendRecv kernel
MAX_SCORE = BASE + DTYPE_OK + STREAM_OK + TIME_OK


@dataclass(frozen=True)
class AlignParams:
    """Tuning of the windowed alignment (defaults suit every tested workload)."""

    window: int = 128  # units per window of the guide pass
    slack: int = 128  # extra kernels per window (kernels without log line, dropped lines)
    band: int = 48  # half-width of the global alignment's band around the guide path
    # A match is certain only if every alignment scoring within ``margin`` of the optimum agrees
    # on it: lost kernels without launch records and lost lines on communicators whose opCount
    # does not count make the scoring model's optimum unreliable by about one gap. Log time
    # rules most such alternatives out on its own, so a timed log needs less.
    margin: int = 8
    margin_timed: int = 4


@nb.njit(cache=True, inline="always")
def _pair(i, j, u_fam, u_dt, u_stream, k_fam, k_dt, k_stream, u_grid, k_grid, smap, u_size, k_cap, u_opt, u_key,
          k_key, u_tgrid, u_talgo, k_rawgrid, k_algo):  # fmt: skip
    """Score of matching unit i with kernel j, time aside (NEG = forbidden; ``_score`` adds time).

    Placeholders stand for launches known to exist from the other side's evidence: a kernel
    placeholder (launch call without kernel record, family PLACEHOLDER) and a unit placeholder
    (opCount gap, dtype mask -1). Each scores as well as a real partner agreeing on everything
    it cannot show, so a unit gains nothing by stealing a neighbour's real kernel over its own
    placeholder. Two placeholders match too (a launch whose line and kernel record are both
    lost), which keeps the launches on both sides in step.

    ``u_tgrid``/``u_talgo``: what the unit's own TUNING line says (channels = the kernel's grid,
    the algorithm in its name; -1 unknown or not verified on this run), hard constraints."""
    kf = k_fam[j]
    u_ph = u_dt[i] == -1
    if u_key[i] >= 0 and k_key[j] >= 0 and u_key[i] != k_key[j]:
        return NEG  # the kernel's own record (profiler arguments) names another element count
    if u_size[i] >= 0 and k_cap[j] >= 0 and u_size[i] > k_cap[j] + 1:
        return NEG  # the kernel ran too briefly to have moved the unit's payload
    if u_opt[i] == 1 and smap[u_stream[i]] < 0:
        return NEG  # a lost line at a guessed position takes only kernels of its (mapped) stream
    if kf != PLACEHOLDER:
        if u_tgrid[i] >= 0 and k_rawgrid[j] >= 0 and u_tgrid[i] != k_rawgrid[j]:
            return NEG  # the call's TUNING line names another channel count than the kernel's grid
        if u_talgo[i] >= 0 and k_algo[j] >= 0 and u_talgo[i] != k_algo[j]:
            return NEG  # ... or another algorithm than the kernel's name
    if kf == PLACEHOLDER:
        s = BASE + DTYPE_OK + STREAM_OK + (GRID_OK if u_grid[i] >= 0 else 0)
    else:
        if kf >= 0:
            if (u_fam[i] >> kf) & 1 == 0:
                return NEG
            s = BASE
        else:
            s = BASE_GENERIC
        kd = k_dt[j]
        if u_ph:
            s += DTYPE_OK if kd >= 0 else 0
        elif kd >= 0 and u_dt[i] != 0:
            if (u_dt[i] >> kd) & 1 == 0:
                return NEG
            s += DTYPE_OK
        ms = smap[u_stream[i]]
        if ms >= 0 and k_stream[j] >= 0:
            if ms != k_stream[j]:
                return NEG
            s += STREAM_OK
        kg = k_grid[j]
        if kg <= ODD_GRID:  # a grid no certain launch on this stream had: likely no logged call
            s -= GRID_BAD
        elif u_grid[i] >= 0 and kg >= 0:  # launches of this size on this stream had this grid
            s += GRID_OK if u_grid[i] == kg else -GRID_BAD
    return s


@nb.njit(cache=True, inline="always")
def _score(i, j, ucls, kcls, T, ut, lo, hi, k_time, t_soft):
    """``_pair`` from the precomputed class table plus the per-pair time term.

    The time term is a window on the delay from the unit's log line (``ut``) to the kernel's
    launch: ``[lo, hi]`` (+TIME_OK), widened by ``t_soft`` on each side at -TIME_OK (first pass
    only), forbidden beyond. ``hi < lo`` means no window for the unit. The unit's values are
    passed as scalars so that loops over kernels keep them in registers."""
    s = T[ucls[i], kcls[j]]
    if s <= NEG:
        return NEG
    if hi >= lo and ut != NO_TIME:
        kt = k_time[j]
        if kt != NO_TIME:
            d = kt - ut
            if lo <= d <= hi:
                s += TIME_OK
            elif lo - t_soft <= d <= hi + t_soft:
                s -= TIME_OK
            else:  # the line was written too far from this launch (or after it) to be its call
                return NEG
    return s


@nb.njit(cache=True)
def _fill(H, i0, j0, nw, mw, ucls, u_time, u_run, u_gap, kcls, k_time, T, t_lo, t_hi, t_soft):  # fmt: skip
    H[0, 0] = 0
    for a in range(1, nw + 1):
        H[a, 0] = H[a - 1, 0] + u_gap[i0 + a - 1]
    for b in range(1, mw + 1):
        H[0, b] = H[0, b - 1] + GAP_KERNEL
    for a in range(1, nw + 1):
        i = i0 + a - 1
        run = u_run[i]
        run = min(run, a)
        ut, lo, hi = u_time[i], t_lo[i], t_hi[i]
        for b in range(1, mw + 1):
            j = j0 + b - 1
            best = H[a - 1, b] + u_gap[i]
            v = H[a, b - 1] + GAP_KERNEL
            best = max(best, v)
            p = _score(i, j, ucls, kcls, T, ut, lo, hi, k_time, t_soft)
            if p > NEG:
                v = H[a - 1, b - 1] + p
                best = max(best, v)
                for r in range(2, run + 1):
                    v = H[a - r, b - 1] + p + FUSE_EXTRA * (r - 1)
                    best = max(best, v)
            H[a, b] = best


@nb.njit(cache=True)
def _traceback(H, ea, eb, i0, j0, late, ucls, u_time, u_run, u_gap, kcls, k_time, T, t_lo, t_hi, t_soft, path_a, path_b, path_r):  # fmt: skip
    """Walk back from (ea, eb); ``late`` prefers gaps (so matches sit as late as possible).

    Writes the visited cells (end first) and, per cell, the number of units the step out of it
    matched to its kernel (0 = gap); returns the number of cells."""
    a = ea
    b = eb
    k = 0
    path_a[k] = a
    path_b[k] = b
    path_r[k] = 0
    k += 1
    while a > 0 or b > 0:
        h = H[a, b]
        step_a = -1
        step_b = -1
        step_r = 0
        if a > 0 and b > 0:
            i = i0 + a - 1
            j = j0 + b - 1
            p = _score(i, j, ucls, kcls, T, u_time[i], t_lo[i], t_hi[i], k_time, t_soft)
            diag_ok = p > NEG and H[a - 1, b - 1] + p == h
        else:
            diag_ok = False
            p = NEG
        up_ok = a > 0 and H[a - 1, b] + u_gap[i0 + a - 1] == h
        left_ok = b > 0 and H[a, b - 1] + GAP_KERNEL == h
        if late:
            if up_ok:
                step_a, step_b = a - 1, b
            elif left_ok:
                step_a, step_b = a, b - 1
            elif diag_ok:
                step_a, step_b, step_r = a - 1, b - 1, 1
        else:
            if diag_ok:
                step_a, step_b, step_r = a - 1, b - 1, 1
            elif left_ok:
                step_a, step_b = a, b - 1
            elif up_ok:
                step_a, step_b = a - 1, b
        if step_a < 0 and a > 0 and b > 0 and p > NEG:
            i = i0 + a - 1
            run = u_run[i]
            run = min(run, a)
            for r in range(2, run + 1):
                if H[a - r, b - 1] + p + FUSE_EXTRA * (r - 1) == h:
                    step_a, step_b, step_r = a - r, b - 1, r
                    break
        if step_a < 0:  # cannot happen with exact integer scores; guard against an endless loop
            if a > 0:
                step_a, step_b = a - 1, b
            else:
                step_a, step_b = a, b - 1
        path_r[k - 1] = step_r  # units consumed by the step out of cell k - 1
        a = step_a
        b = step_b
        path_a[k] = a
        path_b[k] = b
        path_r[k] = 0
        k += 1
    return k


@nb.njit(cache=True)
def _align_windows(ucls, u_time, u_run, u_gap, kcls, k_time, T, t_lo, t_hi, t_soft, window,
                   slack):  # fmt: skip
    """Align the whole sequences window by window; returns per-unit kernel (early and late
    extreme alignments; -1 = gap) and per-kernel unit of the early alignment."""
    n = ucls.shape[0]
    m = kcls.shape[0]
    early = np.full(n, -1, np.int64)
    late = np.full(n, -1, np.int64)
    wk = window + slack
    H = np.empty((window + 1, wk + 1), np.int32)
    cap = window + wk + 2
    ea_a = np.empty(cap, np.int64)
    ea_b = np.empty(cap, np.int64)
    ea_r = np.empty(cap, np.int64)
    la_a = np.empty(cap, np.int64)
    la_b = np.empty(cap, np.int64)
    la_r = np.empty(cap, np.int64)
    i0 = 0
    j0 = 0
    while i0 < n and j0 < m:
        nw = min(window, n - i0)
        mw = min(wk, m - j0)
        final = i0 + nw == n and j0 + mw == m
        _fill(H, i0, j0, nw, mw, ucls, u_time, u_run, u_gap, kcls, k_time, T, t_lo, t_hi, t_soft)  # fmt: skip
        # End cell: the true corner for the last window, else the best cell on the far edges
        # (the rest of the sequences is aligned by the next window).
        ea, eb = nw, mw
        if not final:
            # End on the last row near the column the remaining sequences' kernels-per-unit
            # ratio predicts. A free end would let units whose kernels are missing take later
            # kernels (more matches inside the window, paid for only beyond it), and the guide
            # would drift away from the true path window after window.
            expect = int(round(nw * (m - j0) / max(n - i0, 1)))  # noqa: RUF046 - numba
            spread = max(8, int(np.sqrt(nw)))
            b_lo = max(0, min(mw, expect - spread))
            b_hi = max(b_lo, min(mw, expect + spread))
            best = H[nw, b_lo]
            eb = b_lo
            for b in range(b_lo, b_hi + 1):
                if H[nw, b] > best:
                    best = H[nw, b]
                    eb = b
        ne = _traceback(H, ea, eb, i0, j0, False, ucls, u_time, u_run, u_gap, kcls, k_time, T, t_lo, t_hi, t_soft, ea_a, ea_b, ea_r)  # fmt: skip
        nl = _traceback(H, ea, eb, i0, j0, True, ucls, u_time, u_run, u_gap, kcls, k_time, T, t_lo, t_hi, t_soft, la_a, la_b, la_r)  # fmt: skip
        # Commit point: a cell on both paths, the furthest one within the first half of the
        # window (or the end for the last window / when the paths only meet there).
        ca, cb = ea, eb
        if not final:
            fa, fb = -1, -1  # first shared cell after the origin
            ba, bb = -1, -1  # furthest shared cell within the first half of both axes
            x = ne - 1
            y = nl - 1
            # both paths are stored end -> start; walk them from the start, by anti-diagonal
            while x >= 0 and y >= 0:
                pa, pb = ea_a[x], ea_b[x]
                qa, qb = la_a[y], la_b[y]
                if pa == qa and pb == qb:
                    if pa > 0 or pb > 0:
                        if fa < 0:
                            fa, fb = pa, pb
                        if pa <= nw // 2 and pb <= mw // 2:
                            ba, bb = pa, pb
                    x -= 1
                    y -= 1
                elif pa + pb < qa + qb:
                    x -= 1
                elif pa + pb > qa + qb:
                    y -= 1
                else:
                    x -= 1
                    y -= 1
            if ba >= 0:
                ca, cb = ba, bb
            elif fa >= 0:
                ca, cb = fa, fb
        # Record matches on the committed part of each path (cells with a <= ca, b <= cb).
        for x in range(ne - 1):
            r = ea_r[x]
            if r > 0:
                a, b = ea_a[x], ea_b[x]
                if a <= ca and b <= cb:
                    for q in range(r):
                        early[i0 + a - 1 - q] = j0 + b - 1
        for y in range(nl - 1):
            r = la_r[y]
            if r > 0:
                a, b = la_a[y], la_b[y]
                if a <= ca and b <= cb:
                    for q in range(r):
                        late[i0 + a - 1 - q] = j0 + b - 1
        i0 += ca
        j0 += cb
    return early, late


NEG_INF = -(2**30)
MAX_FUSE = 16


@nb.njit(cache=True)
def _forward(ucls, u_time, u_run, u_gap, kcls, k_time, T, t_lo, t_hi, t_soft, lo, hi, off,
             score_first):  # fmt: skip
    """Best score of every band cell (a units and b kernels consumed) from the start: int32 per cell.

    A fused group is scored by its call closest to the launch (the last one in log order), so
    the DP of the reversed sequences scores it by its first unit (``score_first``)."""
    n = ucls.shape[0]
    F = np.full(off[n + 1], NEG_INF, np.int32)
    for b in range(lo[0], hi[0] + 1):
        F[off[0] + b - lo[0]] = b * GAP_KERNEL
    for a in range(1, n + 1):
        la, ha = lo[a], hi[a]
        lp, hp = lo[a - 1], hi[a - 1]
        i = a - 1
        run = min(u_run[i], a)
        ut, lo_i, hi_i = u_time[i], t_lo[i], t_hi[i]
        for b in range(la, ha + 1):
            best = NEG_INF
            if lp <= b <= hp and F[off[a - 1] + b - lp] > NEG_INF:
                best = F[off[a - 1] + b - lp] + u_gap[i]
            if b - 1 >= la and F[off[a] + b - 1 - la] > NEG_INF:
                v = F[off[a] + b - 1 - la] + GAP_KERNEL
                best = max(best, v)
            if b >= 1:
                p = _score(i, b - 1, ucls, kcls, T, ut, lo_i, hi_i, k_time, t_soft)
                if p > NEG:
                    if lp <= b - 1 <= hp and F[off[a - 1] + b - 1 - lp] > NEG_INF:
                        v = F[off[a - 1] + b - 1 - lp] + p
                        best = max(best, v)
                    for r in range(2, run + 1):
                        lr, hr = lo[a - r], hi[a - r]
                        if lr <= b - 1 <= hr and F[off[a - r] + b - 1 - lr] > NEG_INF:
                            pr = p
                            if score_first:
                                q = a - r
                                pr = _score(q, b - 1, ucls, kcls, T, u_time[q], t_lo[q], t_hi[q], k_time, t_soft)
                            if pr > NEG:
                                v = F[off[a - r] + b - 1 - lr] + pr + FUSE_EXTRA * (r - 1)
                                best = max(best, v)
            F[off[a] + b - la] = best
    return F


@nb.njit(cache=True)
def _certain(F, R, lo, hi, off, roff, m, k_stream, k_grid, margin, ucls, u_time, u_run, u_gap, kcls, k_time, T, t_lo, t_hi, t_soft):  # fmt: skip
    """Per unit: the kernel every optimal alignment matches it to (-1 if none), and whether the
    optimal alignments disagree about it (ambiguous).

    ``R`` is the forward DP of the reversed sequences: the best score from cell (a, b) to the end
    is R at (n - a, m - b). An edge lies on an optimal alignment iff prefix + edge + suffix
    equals the optimum; every alignment consumes each unit by exactly one edge."""
    n = ucls.shape[0]
    opt = F[off[n] + m - lo[n]]
    near = opt - margin  # alignments scoring at least this are explanations the model cannot rule out
    kernel = np.full(n, -1, np.int64)
    amb = np.zeros(n, np.bool_)
    cstream = np.full(n, -1, np.int64)  # stream every optimal match of the unit is on (-1: none/differs)
    cgrid = np.full(n, -1, np.int64)  # likewise the kernel grid

    def suffix(a, b):
        ra = n - a
        rb = m - b
        rlo = m - hi[a]
        return R[roff[ra] + rb - rlo]

    for a in range(1, n + 1):
        i = a - 1
        cand = -2
        can_gap = False
        many = False
        st = -2
        gr = -2
        la, ha = lo[a], hi[a]
        lp, hp = lo[a - 1], hi[a - 1]
        ut, lo_i, hi_i = u_time[i], t_lo[i], t_hi[i]
        for b in range(la, ha + 1):
            sfx = suffix(a, b)
            if sfx <= NEG_INF:
                continue
            if lp <= b <= hp:
                f = F[off[a - 1] + b - lp]
                if f > NEG_INF and f + u_gap[i] + sfx >= near:
                    can_gap = True
            if b >= 1 and lp <= b - 1 <= hp:
                f = F[off[a - 1] + b - 1 - lp]
                if f > NEG_INF:
                    p = _score(i, b - 1, ucls, kcls, T, ut, lo_i, hi_i, k_time, t_soft)
                    if p > NEG and f + p + sfx >= near:
                        if cand == -2:
                            cand = b - 1
                        elif cand != b - 1:
                            many = True
                    if p > NEG and f + p + sfx == opt:
                        st = k_stream[b - 1] if st == -2 or st == k_stream[b - 1] else -1
                        gr = k_grid[b - 1] if gr == -2 or gr == k_grid[b - 1] else -1
        # fused edges (a2 - r, b - 1) -> (a2, b) with a2 - r < a <= a2 also consume unit i
        for a2 in range(a, min(n, a + MAX_FUSE - 1) + 1):
            run = min(u_run[a2 - 1], a2)
            if run < a2 - a + 1 or run < 2:
                continue
            for b in range(lo[a2], hi[a2] + 1):
                if b < 1:
                    continue
                sfx = suffix(a2, b)
                if sfx <= NEG_INF:
                    continue
                q = a2 - 1
                p = _score(q, b - 1, ucls, kcls, T, u_time[q], t_lo[q], t_hi[q], k_time, t_soft)
                for r in range(max(2, a2 - a + 1), run + 1):
                    lr, hr = lo[a2 - r], hi[a2 - r]
                    if lr <= b - 1 <= hr:
                        f = F[off[a2 - r] + b - 1 - lr]
                        if p > NEG and f > NEG_INF and f + p + FUSE_EXTRA * (r - 1) + sfx >= near:
                            if cand == -2:
                                cand = b - 1
                            elif cand != b - 1:
                                many = True
                            if f + p + FUSE_EXTRA * (r - 1) + sfx == opt:
                                st = k_stream[b - 1] if st == -2 or st == k_stream[b - 1] else -1
                                gr = k_grid[b - 1] if gr == -2 or gr == k_grid[b - 1] else -1
        # a match pressed against the band's edge may only be optimal because the band cut off
        # the true path (the guide drifted): do not trust it
        edge = cand >= 0 and ((cand + 1 - lo[a] < 2 and lo[a] > 0) or (hi[a] - (cand + 1) < 2 and hi[a] < m))
        if cand >= 0 and not can_gap and not many and not edge:
            kernel[i] = cand
        elif cand >= 0:
            amb[i] = True
        if st >= 0:
            cstream[i] = st
        if gr >= 0:
            cgrid[i] = gr
    return kernel, amb, cstream, cgrid


@nb.njit(cache=True)
def _match_scores(us, js, ucls, kcls, T, u_time, k_time, t_lo, t_hi, t_soft):
    out = np.empty(us.shape[0], np.int64)
    for q in range(us.shape[0]):
        i = us[q]
        out[q] = _score(i, js[q], ucls, kcls, T, u_time[i], t_lo[i], t_hi[i], k_time, t_soft)
    return out


def _band(guide: np.ndarray, m: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    """Band rows around a guide alignment (per-unit kernel or -1), connected and ending at (n, m)."""
    n = len(guide)
    c = np.zeros(n + 1, np.int64)
    consumed = np.where(guide >= 0, guide + 1, 0)
    c[1:] = np.maximum.accumulate(consumed) if n else consumed
    lo = np.clip(c - half, 0, m)
    hi = np.clip(c + half, 0, m)
    lo[0] = 0
    hi[n] = m
    lo, hi = lo.astype(np.int64), hi.astype(np.int64)
    _connect_band(lo, hi)
    return lo, hi


@nb.njit(cache=True)
def _connect_band(lo, hi):
    # each row must reach the next row's first column (diagonal or vertical move)
    for a in range(lo.shape[0] - 1, 0, -1):
        hi[a - 1] = max(hi[a - 1], lo[a])
        lo[a - 1] = min(lo[a - 1], hi[a - 1])


@dataclass
class UnitAlignment:
    """Result per unit: matched kernel index (-1 none), whether ambiguous, confidence, how."""

    kernel: np.ndarray  # int64 per unit
    ambiguous: np.ndarray  # bool per unit
    confidence: np.ndarray  # float64 per unit
    method: np.ndarray  # object per unit: 'alignment', 'opcount', None
    stream_map: dict[int, int]  # log stream pointer -> kernel stream id (learned)
    contradicted: np.ndarray  # object per unit: the check that demoted its match, or None
    checks: list[dict]  # per check: applicable, confirmed, contradicted, not_checkable, detail


def _class_table(units: LogUnits, ks: KernelSeq, ugrid: np.ndarray, kgrid: np.ndarray, smap: np.ndarray,
                 usize: np.ndarray | None = None, kcap: np.ndarray | None = None,
                 tuned: TuningFacts | None = None):  # fmt: skip
    """Units and kernels reduced to classes of everything ``_pair`` reads except time, and the
    score of every (unit class, kernel class): the DPs then cost a table lookup per cell.
    ``tuned``: which facts of the units' TUNING lines this run bears out (None: none used)."""
    u_tgrid, u_talgo = unit_tuning(units, tuned or TuningFacts())
    k_algo = kernel_algorithm_codes(ks) if tuned is not None and tuned.algo_holds else np.full(ks.m, -1, np.int64)
    if usize is None:
        usize = np.full(units.n, -1, np.int64)
    if kcap is None:
        kcap = np.full(ks.m, -1, np.int64)
    # before any stream is mapped (first pass) a guessed placeholder may take any kernel
    strict = units.optional.astype(np.int64) if (smap >= 0).any() else np.zeros(units.n, np.int64)
    uvals, ucls = _classes([units.fam_mask, units.dt_mask, units.stream, ugrid, usize, strict, unit_count_key(units),
                            u_tgrid, u_talgo])  # fmt: skip
    kvals, kcls = _classes([ks.family, ks.dtype_class, ks.stream, kgrid, kcap, kernel_count_key(ks), ks.grid, k_algo])
    T = _table(*(uvals[:, c].copy() for c in range(9)), *(kvals[:, c].copy() for c in range(8)), smap)
    return ucls, kcls, T


_KEYED_OPS = ("AllGather", "ReduceScatter", "AllReduce", "Broadcast", "Reduce", "AlltoAll")


def _single_call_units(units: LogUnits) -> tuple[np.ndarray, np.ndarray]:
    """Units of exactly one logged call, and that call's row in ``units.calls``: what one call
    line says of its launch holds for the unit's kernel only when the unit is that call alone."""
    real = np.flatnonzero(units.first_call >= 0)
    calls_per_unit = np.bincount(units.call_unit[units.call_unit >= 0], minlength=units.n)
    one = real[calls_per_unit[real] == 1]
    return one, units.first_call[one]


def unit_count_key(units: LogUnits) -> np.ndarray:
    """Per unit: the element count its one call logged (NCCL's convention), -1 for a unit of
    several calls (a group) or an op whose kernel arguments are not compared."""
    key = np.full(units.n, -1, np.int64)
    if "count" not in units.calls or not units.n:
        return key
    one, rows = _single_call_units(units)
    op = units.calls["op"].astype(object).to_numpy()[rows]
    count = units.calls["count"].astype("Int64").fillna(-1).to_numpy(np.int64)[rows]
    ok = np.isin(op, _KEYED_OPS)
    key[one[ok]] = count[ok]
    return key


TUNING_MIN_AGREE = 3
TUNING_TOLERANCE = 0.05
"""A fact stands down when more than max(1, 5 %) of the certain first-pass matches it could test
disagree with it: one disagreement is what a stray wrong first-pass match (the kind this
evidence then corrects) explains; more is a build where the fact does not hold."""


@dataclass(frozen=True)
class TuningFacts:
    """How often this run's certain matches bear out what a call's TUNING line says of its
    kernel: the kernel's grid is the line's channel count, its name carries the line's
    algorithm. Each fact is verified per run (so per NCCL build) before it is used as a hard
    constraint: it holds when at least ``TUNING_MIN_AGREE`` certain first-pass matches agree and
    no more than ``contradicted`` allows disagree; otherwise it is not used (unverified, or stood
    down when contradicted)."""

    grid_agree: int = 0
    grid_disagree: int = 0
    algo_agree: int = 0
    algo_disagree: int = 0

    @staticmethod
    def contradicted(agree: int, disagree: int) -> bool:
        return disagree > max(1.0, TUNING_TOLERANCE * (agree + disagree))

    @classmethod
    def _holds(cls, agree: int, disagree: int) -> bool:
        return agree >= TUNING_MIN_AGREE and not cls.contradicted(agree, disagree)

    @property
    def grid_holds(self) -> bool:
        return self._holds(self.grid_agree, self.grid_disagree)

    @property
    def algo_holds(self) -> bool:
        return self._holds(self.algo_agree, self.algo_disagree)

    @property
    def used(self) -> bool:
        return self.grid_holds or self.algo_holds

    @property
    def stood_down(self) -> list[str]:
        """The facts the run contradicts (not merely too few matches to verify)."""
        return [name for name, agree, dis in (("channels = grid", self.grid_agree, self.grid_disagree),
                                              ("algorithm = kernel name", self.algo_agree, self.algo_disagree))
                if self.contradicted(agree, dis)]  # fmt: skip


def unit_tuning(units: LogUnits, facts: TuningFacts | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per unit: the channel count and algorithm code (``ALGORITHM_CODE``) its one call's TUNING
    line names; -1 where it names none (no line, a group of calls, a placeholder) or where
    ``facts`` says the run does not bear that fact out (None: both, unchecked)."""
    grid = np.full(units.n, -1, np.int64)
    algo = np.full(units.n, -1, np.int64)
    if "tuned_channels" not in units.calls or not units.n:
        return grid, algo
    one, rows = _single_call_units(units)
    if facts is None or facts.grid_holds:
        grid[one] = units.calls["tuned_channels"].astype("Int64").fillna(-1).to_numpy(np.int64)[rows]
    if facts is None or facts.algo_holds:
        names = units.calls["tuned_algo"].astype(object).to_numpy()[rows]
        algo[one] = [ALGORITHM_CODE.get(a, -1) if isinstance(a, str) else -1 for a in names]
    return grid, algo


def kernel_algorithm_codes(ks: KernelSeq) -> np.ndarray:
    """Per kernel: the code (``ALGORITHM_CODE``) of the algorithm its name carries, -1 if none."""
    if not ks.m or "short_name" not in ks.kernels:
        return np.full(ks.m, -1, np.int64)
    codes, names = pd.factorize(ks.kernels["short_name"].astype(object))
    lut = np.array([ALGORITHM_CODE.get(kernel_algorithm(str(n))[0] or "", -1) for n in names] + [-1], np.int64)
    return np.where(ks.placeholder, -1, lut[codes])  # code -1 (no name) reads the trailing -1


def verify_tuning(units: LogUnits, ks: KernelSeq, kernel: np.ndarray, amb: np.ndarray) -> TuningFacts:
    """Count, over the certain matches (a real line, a real kernel record), how often the unit's
    TUNING line agrees with its kernel's grid and with the algorithm in its name."""
    sure = (kernel >= 0) & ~amb & ~units.placeholder
    sure[sure] = ~ks.placeholder[kernel[sure]]
    grid, algo = unit_tuning(units)
    idx = np.flatnonzero(sure)
    kg, ka = ks.grid[kernel[idx]], kernel_algorithm_codes(ks)[kernel[idx]]
    g_sel = (grid[idx] >= 0) & (kg >= 0)
    a_sel = (algo[idx] >= 0) & (ka >= 0)
    g_ok = grid[idx][g_sel] == kg[g_sel]
    a_ok = algo[idx][a_sel] == ka[a_sel]
    return TuningFacts(int(g_ok.sum()), int((~g_ok).sum()), int(a_ok.sum()), int((~a_ok).sum()))


def kernel_count_key(ks: KernelSeq) -> np.ndarray:
    """Per kernel: the element count its call logged, from the profiler's record of the kernel
    (``coll_*`` columns; -1 without one): AllGather's input, ReduceScatter's output, an
    all-reduce/broadcast/reduce's input, an all-to-all's input per peer (NCCL logs the count
    per peer)."""
    from nccltrace.align.sequences import FAMILY_CODE

    k = ks.kernels
    key = np.full(ks.m, -1, np.int64)
    if "coll_in_nelems" not in k or not ks.m:
        return key
    i = k["coll_in_nelems"].astype("Int64").fillna(-1).to_numpy(np.int64)
    o = k["coll_out_nelems"].astype("Int64").fillna(-1).to_numpy(np.int64)
    g = k["coll_group_size"].astype("Int64").fillna(-1).to_numpy(np.int64) if "coll_group_size" in k else -np.ones(ks.m)
    name = k["coll_name"].astype(object).fillna("").astype(str).to_numpy() if "coll_name" in k else np.full(ks.m, "")
    f = ks.family
    for fam, src in (("AllGather", i), ("ReduceScatter", o), ("AllReduce", i), ("Broadcast", i), ("Reduce", i)):
        sel = f == FAMILY_CODE[fam]
        key[sel] = src[sel]
    a2a = (f == FAMILY_CODE["SendRecv"]) & np.char.startswith(name.astype(str), "all_to_all") & (g > 0) & (i >= 0)
    key[a2a] = i[a2a] // g[a2a].astype(np.int64)
    return np.where(ks.placeholder, -1, key)


def _classes(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of the given columns (values, one row per class) and each row's class,
    by hashing one combined integer code per row (a row-wise unique sort is far slower)."""
    n = len(columns[0])
    if n == 0:
        return np.zeros((0, len(columns)), np.int64), np.zeros(0, np.int64)
    code = np.zeros(n, np.int64)
    for col in columns:
        codes, uniques = pd.factorize(col)
        code = code * len(uniques) + codes
    cls, first = pd.factorize(code)
    rows = np.empty(len(first), np.int64)
    rows[cls] = np.arange(n)  # any representative row of each class
    vals = np.stack([np.asarray(c, np.int64)[rows] for c in columns], axis=1)
    return vals, cls.astype(np.int64)


@nb.njit(cache=True)
def _table(u_fam, u_dt, u_stream, u_grid, u_size, u_opt, u_key, u_tgrid, u_talgo, k_fam, k_dt, k_stream, k_grid,
           k_cap, k_key, k_rawgrid, k_algo, smap):  # fmt: skip
    nu, nk = u_fam.shape[0], k_fam.shape[0]
    T = np.empty((nu, nk), np.int32)
    for a in range(nu):
        for b in range(nk):
            T[a, b] = _pair(a, b, u_fam, u_dt, u_stream, k_fam, k_dt, k_stream, u_grid, k_grid, smap, u_size, k_cap,
                            u_opt, u_key, k_key, u_tgrid, u_talgo, k_rawgrid, k_algo)  # fmt: skip
    return T


def _kernel_durations(ks: KernelSeq) -> np.ndarray:
    """Kernel durations in ns (-1 for lost records and unknown times)."""
    k = ks.kernels
    if "start" not in k or "end" not in k or ks.m == 0:
        return np.full(ks.m, -1, np.int64)
    d = (k["end"].astype("Int64") - k["start"].astype("Int64")).fillna(-1).to_numpy(np.int64)
    return np.where(ks.placeholder | (d <= 0), -1, d)


_BANDWIDTH_REGIME = 1 << 20  # bytes
_MAX_COPIES = 16  # optional copies of a lost line's placeholder within one piece


def _learn_rate(units: LogUnits, ks: KernelSeq, kernel: np.ndarray, min_obs: int = 10,
                margin: float = 2.0) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Payload size classes of units and the largest class each kernel could have carried.

    A kernel cannot move its payload faster than the links allow, however long it waited for
    its peers: with the fastest payload rate on its stream (bytes per ns of kernel time; 90th
    percentile of the first pass's certain matches of at least 1 MiB), times ``margin``, as
    the bound, a kernel of duration d carries at
    most ``d * bound`` bytes. Classes are powers of two; a pair is ruled out only when the
    unit's class exceeds the kernel's by more than one (so the bound errs on the lenient
    side by a further factor of up to four). This separates a short kernel without a log line
    from the large launches of a run of identical P2P units, which nothing else tells apart.
    Kernels on streams with fewer than ``min_obs`` such matches are not constrained."""
    none = np.full(units.n, -1, np.int64), np.full(ks.m, -1, np.int64)
    dur = _kernel_durations(ks)
    sure = np.flatnonzero((kernel >= 0) & ~units.placeholder)
    if len(sure) == 0:
        return none
    js = kernel[sure]
    # only launches in the bandwidth regime say how fast the links are (small ones are latency);
    # per kernel stream, as each communicator's members share links of one kind
    ok = (units.bytes[sure] >= _BANDWIDTH_REGIME) & (dur[js] > 0)
    rate = units.bytes[sure][ok] / dur[js][ok]
    stream_of = ks.stream[js][ok]
    bound = np.full(len(ks.streams), np.nan)
    for st in np.unique(stream_of):
        r = rate[stream_of == st]
        if len(r) >= min_obs:
            # a high quantile, not the maximum: a wrong first-pass match to a short kernel
            # (e.g. one without a log line) is an outlier
            bound[st] = margin * float(np.quantile(r, 0.9))
    if np.isnan(bound).all():
        return none
    kb = np.where(ks.stream >= 0, bound[np.maximum(ks.stream, 0)], np.nan)
    dur = np.where(np.isnan(kb), -1, dur)
    kb = np.nan_to_num(kb, nan=0.0)
    usize = np.where(units.bytes > 0, np.ceil(np.log2(np.maximum(units.bytes, 1))), -1).astype(np.int64)
    kcap = np.where(dur > 0, np.floor(np.log2(np.maximum(dur * kb, 1.0))), -1).astype(np.int64)
    top = int(usize.max()) if (usize >= 0).any() else 0
    kcap = np.where(kcap >= 0, np.minimum(kcap, top), -1)  # larger capacities all mean "anything fits"
    # a kernel whose own record (profiler arguments) names its payload needs no guess of what it
    # could carry: kernels that waited for peers make the learned rate far too low for it. The
    # bound is for what nothing else separates, a run of identical P2P units and a short SendRecv
    # kernel without a line; a collective's kernels are kept apart by opCount, order and the
    # cross-rank check, and bounding them wrongly refused fast ones (on ranks time-sharing a GPU,
    # 5 AllGathers of 142 us among ones of 8.2 ms on the real H200 capture)
    from nccltrace.align.sequences import FAMILY_CODE

    kcap = np.where((kernel_count_key(ks) >= 0) | (ks.family != FAMILY_CODE["SendRecv"]), -1, kcap)
    return usize, kcap


def _run(units: LogUnits, ks: KernelSeq, smap: np.ndarray, tw: TimeWindows, p: AlignParams,
         ugrid: np.ndarray | None = None, kgrid: np.ndarray | None = None,
         guide: np.ndarray | None = None, usize: np.ndarray | None = None,
         kcap: np.ndarray | None = None, tuned: TuningFacts | None = None):  # fmt: skip
    """Windowed pass for a guide path, then the exact set of certain matches within a band
    around it (forward DP and the forward DP of the reversed sequences)."""
    if ugrid is None:
        ugrid = np.full(units.n, -1, np.int64)
    if kgrid is None:
        kgrid = ks.grid
    ucls, kcls, T = _class_table(units, ks, ugrid, kgrid, smap, usize, kcap, tuned)
    # a placeholder whose log position is a guess may go unmatched at no cost
    u_gap = np.where(units.optional, 0, GAP_LOG).astype(np.int64)
    t_lo, t_hi = tw.per_unit(units)
    args = (ucls, units.time, units.fuse_run, u_gap, kcls, ks.time, T, t_lo, t_hi, np.int64(tw.soft))
    if guide is None:
        guide, _ = _align_windows(*args, p.window, p.slack)
    lo, hi = _band(guide, ks.m, p.band)
    n, m = units.n, ks.m
    off = np.zeros(n + 2, np.int64)
    off[1:] = np.cumsum(hi - lo + 1)
    F = _forward(*args, lo, hi, off, False)
    # reversed problem: unit n-1-i, kernel m-1-j, mirrored band
    adjacent = units.fuse_run > 1
    rev_adjacent = np.zeros(n, bool)
    rev_adjacent[1:] = adjacent[1:][::-1]
    rlo = (m - hi)[::-1].copy()
    rhi = (m - lo)[::-1].copy()
    roff = np.zeros(n + 2, np.int64)
    roff[1:] = np.cumsum(rhi - rlo + 1)
    rargs = (ucls[::-1].copy(), units.time[::-1].copy(), _runs(rev_adjacent, MAX_FUSE), u_gap[::-1].copy(),
             kcls[::-1].copy(),
             ks.time[::-1].copy(), T, t_lo[::-1].copy(), t_hi[::-1].copy(), np.int64(tw.soft))  # fmt: skip
    R = _forward(*rargs, rlo, rhi, roff, True)
    margin = p.margin_timed if tw.active else p.margin
    kernel, amb, cstream, cgrid = _certain(F, R, lo, hi, off, roff, m, ks.stream, kgrid, np.int64(margin), *args)
    del F, R
    return kernel, amb, cstream, cgrid, guide


def _timestamp_resolution(t: np.ndarray) -> int:
    """Largest power of ten (<= 1 s) dividing every timestamp: the log's time resolution."""
    res = 1
    for r in (10**9, 10**6, 10**3, 1):
        if np.all(t % r == 0):
            res = r
            break
    return res


@dataclass(frozen=True)
class TimeWindows:
    """Where a unit's kernel may be launched, relative to its log line's time (ns of delay).

    NCCL writes a call's line before it launches the call's kernel (a group's kernel at its
    ``ncclGroupEnd``, after every line of the group), so the window is one-sided: a launch
    *before* the line is never its kernel, whatever the scores say. Windows are kept per
    (log stream, call kind) because grouped P2P launches wait for the group's end.
    ``soft`` widens every window at a penalty (first pass only, when the delay is a guess)."""

    default: tuple[int, int] | None = None  # (lo, hi) for units without a window of their own
    by_key: dict[tuple[int, bool], tuple[int, int]] = field(default_factory=dict)  # (stream idx, p2p) -> (lo, hi)
    soft: int = 0

    @property
    def active(self) -> bool:
        return self.default is not None or bool(self.by_key)

    def per_unit(self, units: LogUnits) -> tuple[np.ndarray, np.ndarray]:
        """Per-unit window bounds (``hi < lo``: no window)."""
        lo = np.ones(units.n, np.int64)
        hi = np.zeros(units.n, np.int64)
        if self.default is not None:
            lo[:], hi[:] = self.default
        for (st, p2p), (a, b) in self.by_key.items():
            sel = (units.stream == st) & (units.p2p == p2p)
            lo[sel], hi[sel] = a, b
        return lo, hi

    def describe(self, streams: np.ndarray) -> list[dict]:
        """The learned windows, for the alignment's quality record."""
        out = [{"stream": f"0x{int(streams[st]):x}", "p2p": bool(p2p), "lo_ns": a, "hi_ns": b}
               for (st, p2p), (a, b) in sorted(self.by_key.items())]
        if self.default is not None:
            out.append({"stream": "*", "p2p": None, "lo_ns": self.default[0], "hi_ns": self.default[1]})
        return out


_MIN_DELAYS = 8  # certain matches per (stream, kind) before its window is its own


def _prior_delay(units: LogUnits, ks: KernelSeq) -> TimeWindows:
    """Log-line -> launch delay before any alignment, a wide window for the first pass.

    NCCL writes a call's line just before launching it, so for most lines the next launch of
    the process is its own: the median distance to the next launch estimates the delay, and
    a tolerance of twice its 75th percentile (at least 50 us) keeps the first pass from drifting
    over long repetitive stretches without excluding grouped launches. Fewer than 8 timed lines
    give a window from the few there are rather than none."""
    has = (units.time != NO_TIME) & ~units.placeholder
    kt = ks.time[ks.time != NO_TIME]
    if has.sum() == 0 or len(kt) == 0:
        return TimeWindows()
    kt = np.sort(kt)
    ut = units.time[has]
    pos = np.searchsorted(kt, ut)
    ok = pos < len(kt)
    if ok.sum() == 0:
        return TimeWindows()
    d = kt[pos[ok]] - ut[ok]
    res = _timestamp_resolution(ut)
    # the 75th percentile: lines just before a capture starts (whose own launch is not in the
    # export) have a far "next launch" and must not widen the window for every line
    off, tol = int(np.median(d)), int(max(2 * np.percentile(d, 75), 50_000, 2 * res))
    return TimeWindows(default=(off - tol, off + tol), soft=2 * tol)


def _learn(units: LogUnits, ks: KernelSeq, early: np.ndarray, cstream: np.ndarray,
           prior: TimeWindows) -> tuple[np.ndarray, TimeWindows]:  # fmt: skip
    """Stream map (from units whose every optimal match is on one stream) and the one-sided
    log-to-launch windows (from certain matches) of the first pass."""
    sure = (early >= 0) & ~units.placeholder
    sure[sure] &= ~ks.placeholder[early[sure]]
    vote = (cstream >= 0) & ~units.placeholder
    smap = np.full(len(units.streams), -1, np.int64)
    for s in range(len(units.streams)):
        sel = vote & (units.stream == s)
        if sel.sum() == 0:
            continue
        vals, counts = np.unique(cstream[sel], return_counts=True)
        top = counts.argmax()
        # unanimous evidence of at least two launches (one first-pass match may be a neighbour's
        # kernel taken through a lost line's placeholder), or a large majority of three or more
        if (len(vals) == 1 and sel.sum() >= 2) or (sel.sum() >= 3 and counts[top] >= 0.95 * sel.sum()):
            smap[s] = vals[top]
    return smap, _learn_windows(units, ks, sure, early, prior)


def _learn_windows(units: LogUnits, ks: KernelSeq, sure: np.ndarray, kernel: np.ndarray,
                   prior: TimeWindows) -> TimeWindows:  # fmt: skip
    """One-sided delay windows from certain matches: per (log stream, P2P or not) with at
    least ``_MIN_DELAYS`` of them, else per kind over the process, else over everything.

    The delays of the matches within six robust deviations (MAD) of their median form the
    window's core (a wrong first-pass match is an outlier, and must not widen the window it is
    judged by). The low edge is the core's smallest delay less twice the timestamps'
    resolution: the edge is physical, a kernel is never launched before its line. The high
    edge is the core's largest delay plus a quarter of the core's spread (launches can be held
    up by the CPU). With fewer than ``_MIN_DELAYS`` delays the window spans what was observed
    and the prior's high edge."""
    has_t = sure & (units.time != NO_TIME)
    has_t[has_t] &= ks.time[kernel[has_t]] != NO_TIME
    if not has_t.any():
        return TimeWindows(default=prior.default)
    d_all = ks.time[kernel[has_t]] - units.time[has_t]
    res = _timestamp_resolution(units.time[has_t])
    pad = max(2 * res, 1_000)

    def window(d: np.ndarray) -> tuple[int, int]:
        med = np.median(d)
        mad = max(float(np.median(np.abs(d - med))) * 1.4826, res)
        core = d[np.abs(d - med) <= 6 * mad]
        lo, hi = int(core.min()), int(core.max())
        return lo - pad, hi + max(pad, (hi - lo) // 4)

    if len(d_all) < _MIN_DELAYS:
        lo, hi = int(d_all.min()) - pad, int(d_all.max()) + pad
        if prior.default is not None:
            hi = max(hi, prior.default[1])
        return TimeWindows(default=(lo, hi))
    by_key: dict[tuple[int, bool], tuple[int, int]] = {}
    st, p2p = units.stream[has_t], units.p2p[has_t]
    kind_default: dict[bool, tuple[int, int]] = {}
    for kind in (False, True):
        sel = p2p == kind
        if sel.sum() >= _MIN_DELAYS:
            kind_default[kind] = window(d_all[sel])
    for s_idx in np.unique(units.stream):
        for kind in (False, True):
            sel = (st == s_idx) & (p2p == kind)
            if sel.sum() >= _MIN_DELAYS:
                by_key[(int(s_idx), kind)] = window(d_all[sel])
            elif kind in kind_default:
                by_key[(int(s_idx), kind)] = kind_default[kind]
    return TimeWindows(default=window(d_all), by_key=by_key)


def _learn_grid(units: LogUnits, ks: KernelSeq, kernel: np.ndarray, cgrid: np.ndarray) -> np.ndarray:
    """Expected kernel grid per unit: NCCL picks the channel count from the message size on a
    communicator, so units whose every optimal match had one grid, on one stream and in one
    power-of-two size class, predict it for every unit of that class (>= 2 observations, no
    disagreement)."""
    ugrid = np.full(units.n, -1, np.int64)
    sure = (cgrid >= 0) & ~units.placeholder
    if sure.sum() < 2:
        return ugrid
    # NCCL's channel count follows size thresholds, so key by size class (power of two)
    size_class = np.where(units.bytes > 0, np.floor(np.log2(np.maximum(units.bytes, 1))), -1).astype(np.int64)
    obs = pd.DataFrame({"stream": units.stream[sure], "bytes": size_class[sure], "grid": cgrid[sure]})
    obs = obs[obs["grid"] >= 0]
    stats = obs.groupby(["stream", "bytes"])["grid"].agg(["nunique", "size", "first"])
    stats = stats[(stats["nunique"] == 1) & (stats["size"] >= 2)]
    if stats.empty:
        return ugrid
    keys = pd.MultiIndex.from_arrays([units.stream, size_class])
    pos = stats.index.get_indexer(keys)
    ok = (pos >= 0) & ~units.placeholder
    ugrid[ok] = stats["first"].to_numpy()[pos[ok]]
    return ugrid


def _odd_grids(ks: KernelSeq, cstream: np.ndarray, cgrid: np.ndarray, min_votes: int = 5) -> np.ndarray:
    """Kernel grids with kernels whose grid no unit matched on that stream had marked ODD_GRID.

    NCCL sizes a launch's grid by its channel count; a kernel on a communicator's stream with a
    grid none of that stream's (at least ``min_votes``) certain launches had is probably not a
    logged call (e.g. an internal or foreign launch), so matching a unit to it is penalised."""
    out = ks.grid.copy()
    vote = (cstream >= 0) & (cgrid >= 0)
    if not vote.any():
        return out
    obs = pd.DataFrame({"stream": cstream[vote], "grid": cgrid[vote]})
    counts = obs.groupby("stream").size()
    seen = set(zip(obs["stream"], obs["grid"]))
    for s in counts[counts >= min_votes].index:
        idx = np.flatnonzero((ks.stream == s) & (ks.grid >= 0))
        odd = np.array([(int(s), int(g)) not in seen for g in ks.grid[idx]], dtype=bool)
        out[idx[odd]] = ODD_GRID
    return out


def _relocate_placeholders(units: LogUnits, ks: KernelSeq, kernel: np.ndarray, amb: np.ndarray,
                           smap: np.ndarray, kgrid: np.ndarray, max_span: int = 256
                           ) -> tuple[np.ndarray | None, np.ndarray]:  # fmt: skip
    """New unit order (position -> unit index, a placeholder possibly repeated as optional
    copies; None when nothing moves) that puts opCount-gap placeholders where their kernels
    are, and which placeholders now sit at a position the kernels confirm.

    A lost line is known to sit between its communicator's neighbours p and q, but not where
    among the other communicators' lines in between; ``build_log_units`` puts its placeholder
    right after p. The kernel side shows where it was: cut the stretch around the gap at the
    other comms' units the first pass matched with certainty; in each piece, compare the
    comm's known launches (logged units and the placeholders of other gaps) with the kernels
    that could be its launches (on its stream, or lost records of unknown stream; not kernels
    with a grid never seen on that stream). The piece with the surplus kernel holds the lost
    line. The move is made only when the surpluses account for exactly the gap's lost lines
    (an unexplained extra kernel nearby leaves the placeholder where it was)."""
    n = units.n
    ph = np.flatnonzero(units.placeholder & units.optional & (units.op_count >= 0))  # not yet placed
    if len(ph) == 0:
        return None, np.zeros(n, bool)
    mapped = smap[smap >= 0]
    shared = {int(v) for v, c in zip(*np.unique(mapped, return_counts=True)) if c > 1}
    sure = (kernel >= 0) & ~amb
    taken_by = np.full(ks.m, -1, np.int64)  # unit certainly matched to each kernel
    taken_by[kernel[sure]] = np.flatnonzero(sure)
    other_sure = sure & ~units.placeholder
    key = np.arange(n, dtype=np.float64)
    placed = np.zeros(n, bool)  # placeholders whose position the kernels fixed
    copies: list[tuple[int, float]] = []  # (placeholder, position) of optional copies
    per_comm: dict[int, tuple] = {}
    done = np.zeros(n, bool)
    for u in ph:
        if done[u]:
            continue
        c, s = int(units.comm[u]), int(smap[units.stream[u]])
        if s < 0 or s in shared:
            continue
        if c not in per_comm:
            mine = units.comm == c
            own = ((ks.stream == s) | ks.placeholder) & ((taken_by < 0) | (units.comm[np.maximum(taken_by, 0)] == c))
            own &= kgrid > ODD_GRID
            per_comm[c] = (np.flatnonzero(mine & ~units.placeholder), np.flatnonzero(mine & units.placeholder),
                           np.r_[0, np.cumsum(mine)], np.r_[0, np.cumsum(own)])  # fmt: skip
        real, phs, unit_before, own_before = per_comm[c]
        k = np.searchsorted(real, u)
        if k == 0 or k >= len(real):
            continue
        p, q = int(real[k - 1]), int(real[k])
        group = phs[(phs > p) & (phs < q) & units.optional[phs]]
        done[group] = True
        if q - p - 1 == len(group) or q - p > max_span:
            continue  # nothing else in between (the position is exact), or too long to reason about
        # cuts: certain units of other comms inside the span, and the nearest one on each side
        lo_w, hi_w = max(0, p - max_span), min(n, q + 1 + max_span)
        window = np.flatnonzero(other_sure[lo_w:hi_w] & (units.comm[lo_w:hi_w] != c)) + lo_w
        inner = window[(window > p) & (window < q)]
        before, after = window[window < p], window[window > q]
        cuts = np.r_[before[-1:] if len(before) else [-1], inner, after[:1] if len(after) else [n]].astype(np.int64)
        kcut = np.where(cuts < 0, -1, np.where(cuts >= n, ks.m, kernel[np.clip(cuts, 0, n - 1)]))
        if np.any(np.diff(kcut) <= 0):
            continue  # certain matches out of order: no reliable frame
        k_count = own_before[kcut[1:]] - own_before[kcut[:-1] + 1]
        u_count = unit_before[cuts[1:]] - unit_before[cuts[:-1] + 1]
        # the gap's own placeholders are what is being placed: not counted where they sit now
        u_count -= np.bincount(np.searchsorted(cuts, group) - 1, minlength=len(u_count))[:len(u_count)]
        surplus = k_count - u_count
        if np.any(surplus < 0) or surplus.sum() != len(group):
            continue
        # piece i lies between cuts[i] and cuts[i + 1]; within the span, its lost lines go right
        # after max(cuts[i], p). That is their exact place when no other unit shares the piece's
        # part of the span; otherwise an optional copy goes to every boundary in that part: the
        # piece's kernels leave room for exactly its surplus, so only that many copies can match.
        slots: list[tuple[list[float], bool]] = []
        for i in np.flatnonzero(surplus):
            lo_u, hi_u = max(int(cuts[i]), p), min(int(cuts[i + 1]), q)
            between = np.arange(lo_u + 1, hi_u)
            between = between[~np.isin(between, group)]
            spots = [lo_u + 0.5] + [b + 0.5 for b in between[:_MAX_COPIES]]
            slots += [(spots, len(between) == 0)] * int(surplus[i])
        for r, (g, (spots, exact)) in enumerate(zip(group, slots)):
            key[g] = spots[0] + r * 1e-3  # keep the lost lines' opCount order
            placed[g] = exact
            copies += [(int(g), spot + r * 1e-3) for spot in spots[1:]]
    src = np.r_[np.arange(n), np.asarray([c[0] for c in copies], np.int64)]
    take = src[np.argsort(np.r_[key, [c[1] for c in copies]], kind="stable")]
    return None if np.array_equal(take, np.arange(n)) else take, placed


def _opcount_fix(units: LogUnits, ks: KernelSeq, kernel: np.ndarray, amb: np.ndarray, method: np.ndarray,
                 smap: np.ndarray, allowed: Callable[[int, int], bool] | None = None) -> None:  # fmt: skip
    """Resolve ambiguous units, and units every alignment left without a kernel, by opCount
    arithmetic between confident neighbours.

    On a communicator whose opCount is informative and whose kernels all run on one stream
    that carries nothing else, the k-th launch after a confident anchor is the k-th kernel
    after the anchor's kernel, provided the opCount and kernel-index differences between two
    confident anchors agree (no kernel missing and none extra in between). A unit left without
    a kernel takes that kernel only where ``allowed(unit, kernel)`` (everything the alignment
    weighs but time: family, dtype, stream, grid, TUNING line, profiler arguments) admits the
    pair: the alignment left it unmatched because the learned log-line -> launch window excluded
    its kernel (a launch delayed far beyond the process's usual delay: a descheduled rank), which
    the arithmetic does not need (the log-time check still requires the launch after the line)."""
    kstream_pos = np.full(ks.m, -1, np.int64)
    for s in range(len(ks.streams)):
        idx = np.flatnonzero(ks.stream == s)
        kstream_pos[idx] = np.arange(len(idx))
    # a kernel stream used by several log streams cannot be reasoned about per communicator
    mapped = smap[smap >= 0]
    shared = {int(v) for v, c in zip(*np.unique(mapped, return_counts=True)) if c > 1}
    taken = np.zeros(ks.m, bool)
    taken[kernel[kernel >= 0]] = True
    lost_before = np.cumsum(ks.placeholder)
    for c in np.flatnonzero(units.informative_comm):
        us = np.flatnonzero(units.comm == c)
        if len(us) == 0:
            continue
        streams_c = np.unique(units.stream[us])
        if len(streams_c) != 1 or smap[streams_c[0]] < 0 or int(smap[streams_c[0]]) in shared:
            continue
        kstream = smap[streams_c[0]]
        stream_kernels = np.flatnonzero(ks.stream == kstream)
        anchors = us[(kernel[us] >= 0) & ~amb[us]]
        anchors = anchors[~ks.placeholder[kernel[anchors]] & ~units.placeholder[anchors]]
        if len(anchors) < 2:
            continue
        a_opc = units.op_count[anchors]
        a_pos = kstream_pos[kernel[anchors]]
        gap = (kernel[us] < 0) & ~amb[us] & (allowed is not None)  # left unmatched by every alignment
        for u in us[(amb[us] | gap) & ~units.placeholder[us]]:
            o = units.op_count[u]
            k = np.searchsorted(a_opc, o)
            if k == 0 or k >= len(anchors):
                continue
            lo, hi = k - 1, k
            if a_opc[hi] - a_opc[lo] != a_pos[hi] - a_pos[lo]:
                continue
            # a lost kernel record in between may have been on this stream: the counts could
            # agree only because it and an extra kernel cancel out
            if lost_before[kernel[anchors[hi]]] != lost_before[kernel[anchors[lo]]]:
                continue
            pos = a_pos[lo] + (o - a_opc[lo])
            j = stream_kernels[pos]
            if taken[j]:
                continue
            kf = ks.family[j]
            if kf >= 0 and (units.fam_mask[u] >> kf) & 1 == 0:
                continue
            if not amb[u] and (ks.placeholder[j] or not allowed(u, j)):
                continue
            kernel[u] = j
            amb[u] = False
            method[u] = "opcount"
            taken[j] = True


def align_units(units: LogUnits, ks: KernelSeq, params: AlignParams = AlignParams()) -> UnitAlignment:
    """Align launch units with kernels (two passes: plain, then with learned stream map and delay).

    Log time forbids pairs outside its windows. Where, with it, most of the process's lines stay
    unmatched (``contradicts_most``) and aligning without it matches most of those with
    certainty, its assumption failed (a log clock that stepped or drifted against the export's
    mid-run), not the matches: the alignment without time is kept and the check record says so
    (``stood_down`` of the ``log_time`` record)."""
    from nccltrace.align.quality import contradicts_most

    res = _align_units(units, ks, params)
    if not (units.time != NO_TIME).any() or not (ks.time != NO_TIME).any():
        return res
    real = ~units.placeholder
    n_timed = int(((res.kernel >= 0) & ~res.ambiguous & real).sum())
    if not contradicts_most(int(real.sum()) - n_timed, int(real.sum())):
        return res
    plain = _align_units(replace(units, time=np.full(units.n, NO_TIME, np.int64)), ks, params)
    n_plain = int(((plain.kernel >= 0) & ~plain.ambiguous & real).sum())
    if not contradicts_most(n_plain - n_timed, int(real.sum())):
        return res
    for c in plain.checks:
        if c["check"] == "log_time":
            c.update(applicable=True, stood_down={"lines": int(real.sum()), "matched_timed": n_timed,
                                                  "matched_untimed": n_plain})  # fmt: skip
    return plain


def _align_units(units: LogUnits, ks: KernelSeq, params: AlignParams) -> UnitAlignment:
    n = units.n
    if n == 0 or ks.m == 0:
        return UnitAlignment(np.full(n, -1, np.int64), np.zeros(n, bool), np.zeros(n), np.full(n, None, object),
                             {}, np.full(n, None, object), [])  # fmt: skip
    smap = np.full(len(units.streams), -1, np.int64)
    prior = _prior_delay(units, ks)
    kernel, amb, cstream, cgrid, guide = _run(units, ks, smap, prior, params)
    # Stream and grid evidence also comes from ambiguous units whose optimal candidates all
    # agree on it: an extra kernel makes a run of identical launches ambiguous, yet every
    # optimal alignment still puts each communicator's launches on one stream.
    smap, tw = _learn(units, ks, kernel, cstream, prior)
    ugrid = _learn_grid(units, ks, kernel, cgrid)
    # a call's own TUNING line, where this run bears it out, says more than the size class
    tuned = verify_tuning(units, ks, kernel, amb)
    tgrid = unit_tuning(units, tuned)[0]
    ugrid = np.where(tgrid >= 0, tgrid, ugrid)
    kgrid = _odd_grids(ks, cstream, cgrid)
    usize, kcap = _learn_rate(units, ks, np.where(amb, -1, kernel))
    perm: np.ndarray | None = None  # current unit order (position -> original index)
    units, perm, moved = _place(units, ks, kernel, amb, smap, kgrid, perm)
    if moved is not None:
        ugrid, guide, usize = ugrid[moved], guide[moved], usize[moved]
    if ((smap >= 0).any() or tw.active or (ugrid >= 0).any() or (kgrid <= ODD_GRID).any()
            or (kcap >= 0).any() or tuned.used):  # fmt: skip
        # the first pass's guide path serves again (the band around it held the first pass)
        kernel, amb, _, _, _ = _run(units, ks, smap, tw, params, ugrid, kgrid, guide=guide, usize=usize,
                                    kcap=kcap, tuned=tuned)  # fmt: skip
        # with the stream map, far more matches are certain: place the remaining lost lines
        # from them, and align once more if any moved
        units, perm, moved = _place(units, ks, kernel, amb, smap, kgrid, perm)
        if moved is not None:
            ugrid, guide, usize = ugrid[moved], guide[moved], usize[moved]
            kernel, amb, _, _, _ = _run(units, ks, smap, tw, params, ugrid, kgrid, guide=guide,
                                        usize=usize, kcap=kcap, tuned=tuned)  # fmt: skip
    else:
        ugrid = np.full(units.n, -1, np.int64)
        kgrid = ks.grid
    method = np.where(kernel >= 0, "alignment", None).astype(object)
    ucls, kcls, T = _class_table(units, ks, ugrid, kgrid, smap, usize, kcap, tuned)
    _opcount_fix(units, ks, kernel, amb, method, smap, lambda u, j: T[ucls[u], kcls[j]] > NEG)
    contradicted = np.full(units.n, None, object)
    checks = [_check_log_time(units, ks, kernel, tw, contradicted, method),
              _check_stream(units, ks, kernel, smap, contradicted),
              _tuning_check(units, ks, kernel, tuned)]
    # Confidence: the share of the evidence available for the pair that confirmed it.
    conf = np.zeros(units.n)
    us = np.flatnonzero(kernel >= 0)
    if len(us):
        js = kernel[us]
        t_lo, t_hi = tw.per_unit(units)
        got = _match_scores(us, js, ucls, kcls, T, units.time, ks.time, t_lo, t_hi, np.int64(0))
        avail = np.full(len(us), BASE, np.int64)
        avail += np.where((ks.dtype_class[js] >= 0) & (units.dt_mask[us] != 0), DTYPE_OK, 0)
        avail += np.where(smap[units.stream[us]] >= 0, STREAM_OK, 0)
        if tw.active:
            avail += np.where((units.time[us] != NO_TIME) & (ks.time[js] != NO_TIME) & (t_hi[us] >= t_lo[us]),
                              TIME_OK, 0)
        avail += np.where((ugrid[us] >= 0) & (ks.grid[js] >= 0), GRID_OK, 0)
        conf[us] = np.clip(np.maximum(got, 0) / avail, 0.0, 1.0)
    stream_map = {int(units.streams[s]): int(ks.streams[smap[s]]) for s in range(len(smap)) if smap[s] >= 0}
    if perm is not None:  # back to the caller's unit order
        kernel, amb, conf, method, contradicted = (_unpermute(x, perm) for x in (kernel, amb, conf, method,
                                                                                 contradicted))
    return UnitAlignment(kernel, amb, conf, method, stream_map, contradicted, checks)


def _tuning_check(units: LogUnits, ks: KernelSeq, kernel: np.ndarray, tuned: TuningFacts) -> dict:
    """Quality record of the TUNING-line evidence: the final matches it constrained (every one
    agrees: a disagreeing pair is never formed), those it could not test, and each fact's count
    on the first pass's certain matches; ``stood_down`` names a fact the run contradicts."""
    grid, algo = unit_tuning(units, tuned)
    matched = kernel >= 0
    matched[matched] = ~ks.placeholder[kernel[matched]]
    has = (grid >= 0) | (algo >= 0)
    raw_grid, raw_algo = unit_tuning(units)
    return {"check": "tuning", "applicable": bool(((raw_grid >= 0) | (raw_algo >= 0)).any()),
            "confirmed": int((matched & has).sum()), "contradicted": 0,
            "not_checkable": int((matched & ~has).sum()),
            "facts": {"grid_agree": tuned.grid_agree, "grid_disagree": tuned.grid_disagree,
                      "grid_used": tuned.grid_holds, "algo_agree": tuned.algo_agree,
                      "algo_disagree": tuned.algo_disagree, "algo_used": tuned.algo_holds},
            "stood_down": tuned.stood_down}  # fmt: skip


def _check_log_time(units: LogUnits, ks: KernelSeq, kernel: np.ndarray, tw: TimeWindows,
                    contradicted: np.ndarray, method: np.ndarray | None = None) -> dict:  # fmt: skip
    """Check every match against the learned log-line -> launch windows; a match outside its
    window is demoted in place (``kernel`` -1, ``contradicted`` names the check). A match made
    by opCount arithmetic (``method`` 'opcount'), which is exact where it applies, is held to
    what the window stands on, not to its learned width: its launch must not precede the line
    (less twice the timestamps' resolution). Where the windows fail for most of a process,
    :func:`align_units` has already set time aside."""
    matched = (kernel >= 0) & ~units.placeholder
    out = {"check": "log_time", "applicable": bool(tw.active), "confirmed": 0, "contradicted": 0,
           "not_checkable": int(matched.sum()), "detail": tw.describe(units.streams)}
    if not tw.active or not matched.any():
        return out
    t_lo, t_hi = tw.per_unit(units)
    us = np.flatnonzero(matched)
    js = kernel[us]
    timed = (units.time[us] != NO_TIME) & (ks.time[js] != NO_TIME) & (t_hi[us] >= t_lo[us]) & ~ks.placeholder[js]
    d = ks.time[js] - units.time[us]
    bad = timed & ((d < t_lo[us]) | (d > t_hi[us]))
    if method is not None:
        arith = method[us] == "opcount"
        has_t = (units.time != NO_TIME) & ~units.placeholder
        res = _timestamp_resolution(units.time[has_t]) if has_t.any() else 0
        bad = np.where(arith, timed & (d < -2 * res), bad)
    kernel[us[bad]] = -1
    contradicted[us[bad]] = "contradicted_log_time"
    out.update(confirmed=int((timed & ~bad).sum()), contradicted=int(bad.sum()), not_checkable=int((~timed).sum()))
    return out


def _check_stream(units: LogUnits, ks: KernelSeq, kernel: np.ndarray, smap: np.ndarray,
                  contradicted: np.ndarray) -> dict:  # fmt: skip
    """Check every match against the streams. A log line names the cudaStream_t of its launch,
    and one cudaStream_t is one stream of the export, so the matches of one log stream lie on
    one export stream and no two log streams share one. Each export stream belongs to the log
    stream with the most matches on it (none on a tie); a log stream's home is its learned
    stream map entry, else the export stream it has most matches on if it owns it. A match off
    its line's home stream is demoted in place (``contradicted``); a log stream with no home
    (its matches split evenly, or on a stream another log stream holds) loses all its matches.
    The alignment itself leaves unmapped streams free: forbidding pairs there removes
    alternatives that keep a region the evidence cannot decide ambiguous."""
    matched = (kernel >= 0) & ~units.placeholder
    us = np.flatnonzero(matched)
    js = kernel[us]
    known = (ks.stream[js] >= 0) & ~ks.placeholder[js]
    out = {"check": "stream", "applicable": bool(known.any()), "confirmed": 0, "contradicted": 0,
           "not_checkable": int((~known).sum())}
    if not known.any():
        return out
    us, ls, kst = us[known], units.stream[us[known]], ks.stream[js[known]]
    count = np.zeros((len(units.streams), len(ks.streams)), np.int64)
    np.add.at(count, (ls, kst), 1)
    top = count.max(axis=0)
    owner = np.where((count == top).sum(axis=0) == 1, count.argmax(axis=0), -1)
    owner[top == 0] = -1
    best = count.max(axis=1)
    guess = np.where((count == best[:, None]).sum(axis=1) == 1, count.argmax(axis=1), -1)
    guess = np.where((guess >= 0) & (owner[np.maximum(guess, 0)] == np.arange(len(guess))), guess, -1)
    home = np.where(smap >= 0, smap, guess)
    ok = home[ls] == kst
    kernel[us[~ok]] = -1
    contradicted[us[~ok]] = "contradicted_stream"
    out.update(confirmed=int(ok.sum()), contradicted=int((~ok).sum()))
    return out


def _place(units: LogUnits, ks: KernelSeq, kernel: np.ndarray, amb: np.ndarray, smap: np.ndarray,
           kgrid: np.ndarray, perm: np.ndarray | None) -> tuple[LogUnits, np.ndarray | None, np.ndarray | None]:
    """Relocate placeholders by the kernels (``_relocate_placeholders``): the units in their new
    order, the composed order (position -> caller's index, -1 for added copies) and this step's
    own order (None when nothing moved; per-unit arrays of the old order are indexed by it)."""
    step, placed = _relocate_placeholders(units, ks, kernel, amb, smap, kgrid)
    if placed.any():
        units = units.with_optional(units.optional & ~placed)
    if step is None:
        return units, perm, None
    # a copy (second and later occurrence of a unit) has no position in the caller's order
    first = np.zeros(len(step), bool)
    first[np.unique(step, return_index=True)[1]] = True
    base = np.arange(units.n) if perm is None else perm
    composed = np.where(first, base[step], -1)
    return units.permuted(step), composed, step


def _unpermute(x: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Per-unit results back in the caller's order (copies, marked -1, are dropped)."""
    keep = perm >= 0
    out = np.empty(int(keep.sum()), dtype=x.dtype)
    out[perm[keep]] = x[keep]
    return out
