"""Clock synchronisation of per-node (or per-process) timelines from matched collective instances.

Every node stamps its kernels with its own clock. A collective instance is a natural
synchronisation point, but only its *end* is: starts are spread by however long the early ranks
wait for the straggler, while all members finish within a fraction of a microsecond of each
other. So clocks (an offset and a drift per domain against a reference) are fitted to kernel
ends by robust weighted least squares. The model and estimator: ``docs/correlation.md`` section 3
and its module notes.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd
from numba import njit

__all__ = [
    "ClockModel",
    "add_sync_columns",
    "apply_clock_correction",
    "estimate_clock_model",
    "thesis_start_median",
]

DOMAIN_COLUMNS = [
    "offset_ns", "drift_ppm", "offset_se_ns", "drift_se_ppm", "residual_rms_ns", "n_instances", "n_rows",
    "n_rejected", "drift_fitted", "component", "status", "method", "reason",
]  # fmt: skip


@dataclass(frozen=True)
class ClockModel:
    """Fitted clocks of a set of domains relative to one reference domain.

    ``domains`` is indexed by domain (``domain_key`` says what a domain is: ``clock_domain``
    or ``global_rank``) with columns ``offset_ns`` (domain minus reference at ``t_ref_ns``),
    ``drift_ppm`` (rate of the domain's clock relative to the reference, minus one, in ppm),
    ``offset_se_ns``/``drift_se_ppm`` (standard errors), ``residual_rms_ns`` (RMS of the
    domain's end residuals), ``n_instances`` (instances shared with other domains that were
    used), ``n_rows`` (rows used), ``n_rejected`` (rows rejected as outliers), ``drift_fitted``,
    ``component`` (connected component of the instance graph), ``status`` (``reference``,
    ``estimated``, ``disconnected``, ``no_shared_instances``, ``all_rejected``), ``method`` and
    ``reason`` (why an estimate is null). Null offsets are ``<NA>``, never zero.
    """

    method: str
    domain_key: str
    reference: Hashable | None
    t_ref_ns: int
    domains: pd.DataFrame
    info: dict[str, Any] = field(default_factory=dict)

    def params(self, domain: Hashable) -> tuple[float, float]:
        """(offset_ns, drift_ppm) of ``domain``; raises ``KeyError`` with the reason if unknown."""
        if domain not in self.domains.index:
            raise KeyError(f"clock domain {domain!r} is not in the model")
        row = self.domains.loc[domain]
        if pd.isna(row["offset_ns"]):
            raise KeyError(f"clock domain {domain!r} has no estimate: {row['reason']}")
        return float(row["offset_ns"]), float(row["drift_ppm"])


# --------------------------------------------------------------------------- helpers


def _int64(values: Any, name: str) -> np.ndarray:
    s = pd.Series(values)
    if s.isna().any():
        raise ValueError(f"{name} contains nulls")
    return s.to_numpy(dtype=np.int64)


def _components(edge_u: np.ndarray, edge_v: np.ndarray, n: int) -> np.ndarray:
    """Connected-component label (smallest member index) of each of ``n`` nodes."""
    label = np.arange(n, dtype=np.int64)
    if len(edge_u) == 0:
        return label
    while True:
        m = np.minimum(label[edge_u], label[edge_v])
        new = label.copy()
        np.minimum.at(new, edge_u, m)
        np.minimum.at(new, edge_v, m)
        # Pointer jumping makes long chains (e.g. pipeline-only links) converge in log steps.
        while True:
            jumped = new[new]
            if np.array_equal(jumped, new):
                break
            new = jumped
        if np.array_equal(new, label):
            return label
        label = new


def _int_median(values: np.ndarray) -> int:
    """Exact median element of an int64 array (a float median would round UTC nanoseconds)."""
    if len(values) == 0:
        return 0
    return int(np.partition(values, len(values) // 2)[len(values) // 2])


def _group_median(keys: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Median of ``values`` per integer key (groups without rows get NaN)."""
    order = np.lexsort((values, keys))
    k = keys[order]
    v = values[order]
    counts = np.bincount(k, minlength=n_groups)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    out = np.full(n_groups, np.nan)
    has = counts > 0
    lo = starts[has] + (counts[has] - 1) // 2
    hi = starts[has] + counts[has] // 2
    out[has] = 0.5 * (v[lo] + v[hi])
    return out


@njit(cache=True)
def _normal_matrix(inst_start, cell_dom, w, u, q, col_c, col_k, p):  # pragma: no cover - compiled
    """Reduced normal matrix of the instance-demeaned problem (cells sorted by instance)."""
    n = np.zeros((p, p))
    for i in range(len(inst_start) - 1):
        a = inst_start[i]
        b = inst_start[i + 1]
        wi = 0.0
        for c in range(a, b):
            wi += w[c]
        for c in range(a, b):
            ic = col_c[cell_dom[c]]
            if ic < 0:
                continue
            ik = col_k[cell_dom[c]]
            n[ic, ic] += w[c]
            if ik >= 0:
                n[ic, ik] += u[c]
                n[ik, ic] += u[c]
                n[ik, ik] += q[c]
            for c2 in range(a, b):
                jc = col_c[cell_dom[c2]]
                if jc < 0:
                    continue
                jk = col_k[cell_dom[c2]]
                n[ic, jc] -= w[c] * w[c2] / wi
                if jk >= 0:
                    n[ic, jk] -= w[c] * u[c2] / wi
                if ik >= 0:
                    n[ik, jc] -= u[c] * w[c2] / wi
                    if jk >= 0:
                        n[ik, jk] -= u[c] * u[c2] / wi
    return n


@dataclass
class _Cells:
    """Per (instance, domain) sums of the active rows, sorted by instance."""

    inst: np.ndarray  # compact instance index of each cell
    dom: np.ndarray
    w: np.ndarray  # sum of weights
    u: np.ndarray  # sum of w * u (u = scaled time)
    q: np.ndarray  # sum of w * u^2
    ybar: np.ndarray  # weighted mean of y in the cell
    yu_dev: np.ndarray  # sum of w * u * (y - ybar)
    inst_start: np.ndarray  # cell offsets of each compact instance
    row_cell: np.ndarray  # cell of each active row


def _cell_index(inst: np.ndarray, dom: np.ndarray, n_dom: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cell (= instance x domain) of every row; cells are numbered in (instance, domain) order."""
    key = inst * n_dom + dom
    order = np.argsort(key, kind="stable")
    ks = key[order]
    new = np.empty(len(ks), dtype=bool)
    new[:1] = True
    new[1:] = ks[1:] != ks[:-1]
    row_cell = np.empty(len(ks), dtype=np.int64)
    row_cell[order] = np.cumsum(new) - 1
    uk = ks[new]
    return row_cell, uk // n_dom, uk % n_dom


def _compact(ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Renumber the ids that occur (order kept); returns (new ids, which old ids occur)."""
    present = np.bincount(ids, minlength=n) > 0
    return (np.cumsum(present) - 1)[ids], present


def _cells(row_cell_g: np.ndarray, cell_inst_g: np.ndarray, cell_dom_g: np.ndarray, w: np.ndarray, u: np.ndarray,
           y: np.ndarray) -> _Cells:
    row_cell, present = _compact(row_cell_g, len(cell_inst_g))
    c_inst, _ = _compact(cell_inst_g[present], int(cell_inst_g[-1]) + 1 if len(cell_inst_g) else 0)
    c_dom = cell_dom_g[present]
    n_cells = len(c_dom)
    cw = np.bincount(row_cell, w, n_cells)
    cu = np.bincount(row_cell, w * u, n_cells)
    cq = np.bincount(row_cell, w * u * u, n_cells)
    ybar = np.bincount(row_cell, w * y, n_cells) / cw
    yu_dev = np.bincount(row_cell, w * u * (y - ybar[row_cell]), n_cells)
    counts = np.bincount(c_inst)
    inst_start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    return _Cells(c_inst, c_dom, cw, cu, cq, ybar, yu_dev, inst_start, row_cell)


def _rhs(cells: _Cells, col_c: np.ndarray, col_k: np.ndarray, p: int) -> np.ndarray:
    wi = np.bincount(cells.inst, cells.w)
    yi = np.bincount(cells.inst, cells.w * cells.ybar) / wi
    dy = cells.ybar - yi[cells.inst]  # differences before summing: no cancellation of large times
    cc = col_c[cells.dom]
    ck = col_k[cells.dom]
    h = np.bincount(np.where(cc >= 0, cc, p), cells.w * dy, p + 1)
    h += np.bincount(np.where(ck >= 0, ck, p), cells.yu_dev + cells.u * dy, p + 1)
    return h[:p]


def _matvec(cells: _Cells, col_c: np.ndarray, col_k: np.ndarray, p: int, theta: np.ndarray) -> np.ndarray:
    th = np.append(theta, 0.0)
    cc = np.where(col_c[cells.dom] >= 0, col_c[cells.dom], p)
    ck = np.where(col_k[cells.dom] >= 0, col_k[cells.dom], p)
    tc = th[cc]
    tk = th[ck]
    wi = np.bincount(cells.inst, cells.w)
    g = np.bincount(cells.inst, cells.w * tc + cells.u * tk) / wi
    out_c = cells.w * tc + cells.u * tk - cells.w * g[cells.inst]
    out_k = cells.u * tc + cells.q * tk - cells.u * g[cells.inst]
    res = np.bincount(cc, out_c, p + 1) + np.bincount(ck, out_k, p + 1)
    return res[:p]


def _diag_blocks(cells: _Cells, col_c: np.ndarray, col_k: np.ndarray, n_dom: int) -> np.ndarray:
    """Per-domain 2x2 diagonal blocks of the reduced normal matrix (cells are unique per domain
    and instance, so only a cell's pairing with itself lands on its domain's block)."""
    wi = np.bincount(cells.inst, cells.w)[cells.inst]
    blk = np.zeros((n_dom, 2, 2))
    blk[:, 0, 0] = np.bincount(cells.dom, cells.w - cells.w * cells.w / wi, n_dom)
    blk[:, 0, 1] = blk[:, 1, 0] = np.bincount(cells.dom, cells.u - cells.w * cells.u / wi, n_dom)
    blk[:, 1, 1] = np.bincount(cells.dom, cells.q - cells.u * cells.u / wi, n_dom)
    return blk


def _pcg(cells: _Cells, col_c, col_k, p: int, h: np.ndarray, n_dom: int, tol: float, maxiter: int):
    """Block-Jacobi preconditioned conjugate gradients on the reduced normal equations."""
    blk = _diag_blocks(cells, col_c, col_k, n_dom)
    # Invert each domain's block once; offset-only domains use the (0, 0) entry alone.
    doms = np.flatnonzero(col_c >= 0)
    two = col_k[doms] >= 0
    ic, ik = col_c[doms], np.where(two, col_k[doms], col_c[doms])
    b = blk[doms].copy()
    b[~two, 0, 1] = b[~two, 1, 0] = 0.0
    b[~two, 1, 1] = 1.0
    inv = np.linalg.inv(b)

    def precond(r: np.ndarray) -> np.ndarray:
        z = np.empty_like(r)
        rc, rk = r[ic], np.where(two, r[ik], 0.0)
        z[ic] = inv[:, 0, 0] * rc + inv[:, 0, 1] * rk
        z[ik[two]] = (inv[:, 1, 0] * rc + inv[:, 1, 1] * rk)[two]
        return z

    x = np.zeros(p)
    r = h.copy()
    z = precond(r)
    d = z.copy()
    rz = r @ z
    h_norm = np.linalg.norm(h) or 1.0
    it = 0
    converged = False
    for it in range(1, maxiter + 1):
        ad = _matvec(cells, col_c, col_k, p, d)
        alpha = rz / (d @ ad)
        x += alpha * d
        r -= alpha * ad
        if np.linalg.norm(r) <= tol * h_norm:
            converged = True
            break
        z = precond(r)
        rz_new = r @ z
        d = z + (rz_new / rz) * d
        rz = rz_new
    return x, blk, it, converged


# --------------------------------------------------------------------------- main estimator


@dataclass(frozen=True)
class _FitSettings:
    """The options of :func:`estimate_clock_model` that the fitting steps read."""

    drift: bool | Literal["auto"]
    min_drift_span_ns: int
    min_drift_instances: int
    reject_k: float
    min_scale_ns: float
    max_iter: int
    solver: Literal["auto", "direct", "cg"]
    direct_budget: int


@dataclass(frozen=True)
class _ClockRows:
    """The clock frame's rows as integer codes, with the (instance, domain) cell of each row."""

    dom_codes: np.ndarray
    dom_names: pd.Index
    inst_codes: np.ndarray
    n_inst: int
    ts: np.ndarray
    weight: np.ndarray
    row_cell: np.ndarray
    cell_inst: np.ndarray
    cell_dom: np.ndarray

    @property
    def n_dom(self) -> int:
        return len(self.dom_names)

    @property
    def n_rows(self) -> int:
        return len(self.ts)

    def spanning_mask(self, mask: np.ndarray) -> np.ndarray:
        """``mask`` less the rows of instances whose masked rows lie in fewer than two domains."""
        has = np.bincount(self.row_cell[mask], minlength=len(self.cell_inst)) > 0
        n_d = np.bincount(self.cell_inst[has], minlength=self.n_inst)
        return mask & (n_d[self.inst_codes] >= 2)


@dataclass(frozen=True)
class _Anchor:
    """The reference domain, the candidate rows linked to it, and their times relative to ``t_ref``."""

    ref: int
    rows: np.ndarray
    t_ref: int
    y: np.ndarray
    u: np.ndarray
    scale_t: float


def estimate_clock_model(
    frame: pd.DataFrame,
    *,
    reference: Hashable | None = None,
    timestamp: Literal["end", "start", "mid"] = "end",
    drift: bool | Literal["auto"] = "auto",
    min_drift_span_ns: int = 10_000_000,
    min_drift_instances: int = 4,
    reject_k: float = 5.0,
    min_scale_ns: float = 100.0,
    max_iter: int = 8,
    solver: Literal["auto", "direct", "cg"] = "auto",
    direct_budget: int = 30_000_000,
) -> ClockModel:
    """Fit per-domain clock offset and drift from collective instances shared between domains.

    ``frame`` needs ``clock_domain`` (host name, or ``host:pid`` when processes cannot be
    grouped by host), ``global_rank``, ``instance`` (any hashable key shared by the rows of one
    collective instance), ``start_ns`` and ``end_ns`` (int64, the domain's UTC reading);
    optional ``nranks`` (instances with more rows than ``nranks`` or a rank twice are dropped
    as ambiguous matches) and ``weight`` (default 1 per row).

    ``reference``: the domain the others are expressed against; default the domain taking part
    in the most shared instances (ties: lowest name). ``timestamp`` selects what is assumed
    simultaneous: ``end`` (default and correct for NCCL kernels), ``start`` or ``mid`` (only
    for comparison -- both are biased by arrival skew). ``drift``: ``"auto"`` fits a drift for a
    domain whose shared instances span >= ``min_drift_span_ns`` and number >=
    ``min_drift_instances``, else offset only; True/False force it. Rows whose residual
    against their instance's median exceeds ``reject_k`` robust scales (MAD, at least
    ``min_scale_ns``) are rejected and the fit repeated (at most ``max_iter`` times).
    ``solver``: ``direct`` builds the reduced normal matrix (exact standard errors; cost grows
    with the square of domains per instance), ``cg`` uses conjugate gradients (O(rows) per
    iteration; standard errors are conditional on the other domains, i.e. lower bounds),
    ``auto`` picks ``direct`` while that cost is below ``direct_budget``.
    """
    settings = _FitSettings(drift, min_drift_span_ns, min_drift_instances, reject_k, min_scale_ns, max_iter, solver,
                            direct_budget)  # fmt: skip
    df, data = _clock_rows(frame, timestamp)
    n_dom, dom_names = data.n_dom, data.dom_names
    bad_inst = _ambiguous_instances(df, data)
    ok = ~bad_inst[data.inst_codes] & (data.weight > 0)

    # Instances spanning >= 2 domains; the static candidate set for the fit.
    cand = data.spanning_mask(ok)
    cand_cells = np.bincount(data.row_cell[cand], minlength=len(data.cell_inst)) > 0
    comp = _components(*_star_edges(data.cell_inst[cand_cells], data.cell_dom[cand_cells]), n_dom)
    inst_per_dom = np.bincount(data.cell_dom[cand_cells], minlength=n_dom)
    ref = _reference_domain(reference, dom_names, inst_per_dom)
    in_comp = comp == comp[ref]
    anchor = _anchor(data, cand & in_comp[data.dom_codes], ref)

    info: dict[str, Any] = {"n_rows": data.n_rows, "n_ambiguous_instances": int(bad_inst.sum()),
                            "n_candidate_rows": int(anchor.rows.sum()), "time_scale_ns": anchor.scale_t}
    no_drift = np.zeros(n_dom, dtype=bool)
    fit, rejected = _robust_fit(data, anchor, settings, no_drift, info)
    # A drift no host clock has, or one the instances cannot tell from none, is the fit modelling
    # something else (kernel ends that do not agree: ranks time-sharing a GPU end one collective
    # milliseconds apart over a capture of a few hundred ms): those domains get an offset only.
    implausible = _implausible_drift(fit, anchor.scale_t) if drift == "auto" else no_drift
    if implausible.any():
        info["drift_dropped"] = {str(dom_names[d]): _drift_ppm(fit, anchor.scale_t, d)
                                 for d in np.flatnonzero(implausible)}  # fmt: skip
        fit, rejected = _robust_fit(data, anchor, settings, implausible, info)
    info.update({k: fit[k] for k in ("solver", "cg_iterations", "sigma_ns", "dof")})
    info["singular"] = bool(fit.get("singular", False))
    info["cg_converged"] = fit.get("cg_converged")
    info["n_rejected_rows"] = int(rejected.sum())
    info["reference_component_domains"] = int(in_comp.sum())

    domains = _domain_table(dom_names, ref, comp, in_comp, fit, rejected, data.dom_codes, inst_per_dom,
                            anchor.scale_t, timestamp)  # fmt: skip
    _explain_dropped_drifts(domains, info.get("drift_dropped", {}))
    return ClockModel(
        method=f"robust_wls_{timestamp}", domain_key="clock_domain", reference=dom_names[ref], t_ref_ns=anchor.t_ref,
        domains=domains, info=info,
    )


def _clock_rows(frame: pd.DataFrame, timestamp: str) -> tuple[pd.DataFrame, _ClockRows]:
    """The frame's rows that have a domain, an instance and the chosen timestamp, as codes."""
    need = ["clock_domain", "global_rank", "instance", "start_ns", "end_ns"]
    missing = [c for c in need if c not in frame.columns]
    if missing:
        raise ValueError(f"clock frame lacks columns {missing}")
    if timestamp not in ("end", "start", "mid"):
        raise ValueError("timestamp must be 'end', 'start' or 'mid'")
    df = frame.dropna(subset=["clock_domain", "instance", "start_ns" if timestamp == "start" else "end_ns"])
    if timestamp == "mid":
        df = df.dropna(subset=["start_ns"])
    dom_codes, dom_names = pd.factorize(df["clock_domain"], sort=True)
    inst_codes, _ = pd.factorize(df["instance"])
    dom_codes = dom_codes.astype(np.int64)
    inst_codes = inst_codes.astype(np.int64)
    if timestamp == "end":
        ts = _int64(df["end_ns"], "end_ns")
    elif timestamp == "start":
        ts = _int64(df["start_ns"], "start_ns")
    else:
        s = _int64(df["start_ns"], "start_ns")
        ts = s + (_int64(df["end_ns"], "end_ns") - s) // 2
    weight = np.ones(len(df)) if "weight" not in df.columns else df["weight"].to_numpy(dtype=float)
    n_inst = int(inst_codes.max()) + 1 if len(inst_codes) else 0
    row_cell, cell_inst, cell_dom = _cell_index(inst_codes, dom_codes, len(dom_names))
    return df, _ClockRows(dom_codes, dom_names, inst_codes, n_inst, ts, weight, row_cell, cell_inst, cell_dom)


def _ambiguous_instances(df: pd.DataFrame, data: _ClockRows) -> np.ndarray:
    """Per instance: ambiguous (a rank twice, or more rows than the communicator has ranks)."""
    inst_codes, n_inst = data.inst_codes, data.n_inst
    ranks = _int64(df["global_rank"], "global_rank")
    rank_codes, rank_names = pd.factorize(ranks)
    rank_cell = _cell_index(inst_codes, rank_codes.astype(np.int64), max(len(rank_names), 1))[0]
    dup = np.bincount(rank_cell)[rank_cell] > 1
    bad_inst = np.zeros(n_inst, dtype=bool)
    bad_inst[inst_codes[dup]] = True
    if "nranks" in df.columns:
        nr = pd.to_numeric(df["nranks"]).to_numpy(dtype=float, na_value=np.nan)
        rows_per_inst = np.bincount(inst_codes, minlength=n_inst)
        over = np.isfinite(nr) & (rows_per_inst[inst_codes] > nr)
        bad_inst[inst_codes[over]] = True
    return bad_inst


def _reference_domain(reference: Hashable | None, dom_names: pd.Index, inst_per_dom: np.ndarray) -> int:
    """Code of the reference domain: the one asked for, else the one in the most shared instances."""
    if reference is None:
        if len(dom_names) == 0:
            raise ValueError("clock frame has no rows")
        return int(np.argmax(inst_per_dom))  # first maximum = lowest name among ties
    hits = np.flatnonzero(np.asarray(dom_names) == reference)
    if len(hits) == 0:
        raise ValueError(f"reference domain {reference!r} does not occur in the frame")
    return int(hits[0])


def _anchor(data: _ClockRows, rows: np.ndarray, ref: int) -> _Anchor:
    """Times of ``rows`` relative to the median of the reference's, and scaled to [-1, 1] for the fit."""
    ts = data.ts
    ref_rows = ts[rows & (data.dom_codes == ref)]
    t_ref = _int_median(ref_rows if len(ref_rows) else ts)
    y = (ts - t_ref).astype(np.float64)
    scale_t = float(np.max(np.abs(y[rows]))) if rows.any() else 1.0
    scale_t = scale_t or 1.0
    return _Anchor(ref, rows, t_ref, y, y / scale_t, scale_t)


def _fit_active(data: _ClockRows, anchor: _Anchor, settings: _FitSettings, active: np.ndarray,
                no_drift: np.ndarray) -> dict[str, Any]:
    """:func:`_fit` on the ``active`` rows."""
    return _fit(data.row_cell[active], data.cell_inst, data.cell_dom, data.dom_codes[active], data.n_dom, anchor.ref,
                data.weight[active], anchor.u[active], anchor.y[active], settings.drift,
                settings.min_drift_span_ns / anchor.scale_t, settings.min_drift_instances, settings.solver,
                settings.direct_budget, no_drift)  # fmt: skip


def _robust_fit(data: _ClockRows, anchor: _Anchor, settings: _FitSettings, no_drift: np.ndarray,
                info: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray]:
    """The fit with iterated outlier rejection, and the rejected rows; ``no_drift``: domains fitted with
    an offset only. Records ``iterations`` and ``converged`` in ``info``."""
    rows, y, u = anchor.rows, anchor.y, anchor.u
    dom_codes, inst_codes = data.dom_codes, data.inst_codes
    rejected = np.zeros(data.n_rows, dtype=bool)
    fit: dict[str, Any] = {}
    converged = False
    for it in range(max(1, settings.max_iter)):
        fit = _fit_active(data, anchor, settings, data.spanning_mask(rows & ~rejected), no_drift)
        theta_c, theta_k = fit["theta_c"], fit["theta_k"]
        # Residuals against the per-instance median of the corrected times of all candidates:
        # robust even when an instance holds a gross outlier, and lets rows come back.
        z = y - theta_c[dom_codes] - theta_k[dom_codes] * u
        zc = z[rows]
        med = _group_median(inst_codes[rows], zc, data.n_inst)
        res = zc - med[inst_codes[rows]]
        keep = np.abs(res) <= settings.reject_k * max(settings.min_scale_ns,
                                                      1.4826 * float(np.median(np.abs(res))) if len(res) else 0)
        new_rej = np.zeros(data.n_rows, dtype=bool)
        new_rej[np.flatnonzero(rows)[~keep]] = True
        info["iterations"] = it + 1
        if np.array_equal(new_rej, rejected):
            converged = True
            break
        rejected = new_rej
    info["converged"] = converged
    if not converged:  # the last rejection step changed the active set: fit it once more
        fit = _fit_active(data, anchor, settings, data.spanning_mask(rows & ~rejected), no_drift)
    return fit, rejected


def _explain_dropped_drifts(domains: pd.DataFrame, dropped: dict[str, tuple[float, float]]) -> None:
    """Say in ``reason`` why estimated domains whose drift was implausible got an offset only."""
    for name, (ppm, se) in dropped.items():
        if domains.at[name, "status"] == "estimated":
            domains.at[name, "reason"] = (f"offset only: a drift fit gave {ppm:.0f} ppm (standard error {se:.0f}), "
                                          f"beyond what a host clock does ({MAX_DRIFT_PPM:.0f} ppm) or what the "
                                          "instances determine; their kernel ends do not agree closely enough")


def _star_edges(c_inst: np.ndarray, c_dom: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edges from each instance's first domain to each of its domains (cells sorted by instance)."""
    if len(c_inst) == 0:
        return c_dom, c_dom
    new = np.empty(len(c_inst), dtype=bool)
    new[:1] = True
    new[1:] = c_inst[1:] != c_inst[:-1]
    first = c_dom[np.flatnonzero(new)[np.cumsum(new) - 1]]
    return first, c_dom


MAX_DRIFT_PPM = 1000.0
"""The largest clock drift a fitted model may have (ppm). Host clocks run within about 100 ppm of
each other (quartz), NTP slews at most 500 ppm; a fit beyond this is following kernel ends that
do not agree, not a clock."""
MAX_DRIFT_SE_PPM = 100.0
"""A drift whose standard error exceeds this (ppm) is not determined by the instances: offset only."""


def _drift_ppm(fit: dict[str, Any], scale_t: float, d: int) -> tuple[float, float]:
    """(drift, its standard error) in ppm of domain ``d`` of a fit (forward form, as reported)."""
    k = float(fit["theta_k"][d]) / scale_t
    return k / (1.0 - k) * 1e6, float(fit["se_k"][d]) / scale_t / (1.0 - k) ** 2 * 1e6


def _implausible_drift(fit: dict[str, Any], scale_t: float) -> np.ndarray:
    """Domains whose fitted drift exceeds :data:`MAX_DRIFT_PPM` or whose standard error exceeds
    :data:`MAX_DRIFT_SE_PPM`."""
    flags = np.zeros(len(fit["theta_k"]), dtype=bool)
    for d in np.flatnonzero(fit["drift_fitted"]):
        ppm, se = _drift_ppm(fit, scale_t, int(d))
        flags[d] = not (abs(ppm) <= MAX_DRIFT_PPM and se <= MAX_DRIFT_SE_PPM)  # NaN: not determined either
    return flags


def _fit(rc, cell_inst, cell_dom, dom, n_dom, ref, w, u, y, drift, min_span_u, min_drift_inst, solver,
         budget, no_drift: np.ndarray | None = None) -> dict[str, Any]:
    """One weighted least-squares fit on the active rows (all in spanning instances); domains in
    ``no_drift`` get an offset only."""
    out: dict[str, Any] = {"theta_c": np.zeros(n_dom), "theta_k": np.zeros(n_dom), "se_c": np.full(n_dom, np.nan),
                           "se_k": np.full(n_dom, np.nan), "solver": None, "cg_iterations": 0, "sigma_ns": np.nan,
                           "dof": 0, "drift_fitted": np.zeros(n_dom, dtype=bool), "usable": np.zeros(n_dom, dtype=bool),
                           "resid": np.zeros(0), "n_inst_dom": np.zeros(n_dom, dtype=np.int64)}  # fmt: skip
    if len(rc) == 0:
        return out
    # Keep only domains linked to the reference by the active rows, and instances that still span
    # two of them: anything else carries no information and would make the system singular.
    while True:
        cells = _cells(rc, cell_inst, cell_dom, w, u, y)
        comp = _components(*_star_edges(cells.inst, cells.dom), n_dom)
        usable = (np.bincount(cells.dom, minlength=n_dom) > 0) & (comp == comp[ref])
        keep_cell = usable[cells.dom]
        span = np.bincount(cells.inst, keep_cell, len(cells.inst_start) - 1)
        keep_cell &= span[cells.inst] >= 2
        if keep_cell.all():
            break
        keep = keep_cell[cells.row_cell]
        rc, dom, w, u, y = rc[keep], dom[keep], w[keep], u[keep], y[keep]
        if len(rc) == 0:
            return out
    n_inst_dom = np.bincount(cells.dom, minlength=n_dom)
    out["usable"] = usable
    out["n_inst_dom"] = n_inst_dom
    umin = np.full(n_dom, np.inf)
    umax = np.full(n_dom, -np.inf)
    np.minimum.at(umin, dom, u)
    np.maximum.at(umax, dom, u)
    if drift == "auto":
        want_k = ((umax - umin) >= min_span_u) & (n_inst_dom >= min_drift_inst)
    else:  # even when forced, a drift needs two instances at different times
        want_k = bool(drift) & ((umax - umin) > 0) & (n_inst_dom >= 2)
    if no_drift is not None:
        want_k = want_k & ~no_drift
    col_c = np.full(n_dom, -1, dtype=np.int64)
    col_k = np.full(n_dom, -1, dtype=np.int64)
    p = 0
    for d in range(n_dom):
        if d == ref or not usable[d]:
            continue
        col_c[d] = p
        p += 1
        if want_k[d]:
            col_k[d] = p
            p += 1
    out["drift_fitted"] = col_k >= 0
    if p == 0:
        out["solver"] = "none"
        theta = np.zeros(0)
    else:
        h = _rhs(cells, col_c, col_k, p)
        m = np.diff(cells.inst_start)
        cost = int(np.sum(m.astype(np.int64) ** 2)) * 4
        use_direct = solver == "direct" or (solver == "auto" and cost <= budget and p <= 4000)
        if use_direct:
            nmat = _normal_matrix(cells.inst_start, cells.dom, cells.w, cells.u, cells.q, col_c, col_k, p)
            try:
                cov = np.linalg.inv(nmat)
            except np.linalg.LinAlgError:  # cannot happen for a connected set; flagged if it does
                cov = np.linalg.pinv(nmat)
                out["singular"] = True
            theta = cov @ h
            out["solver"] = "direct"
        else:
            theta, blk, its, conv = _pcg(cells, col_c, col_k, p, h, n_dom, 1e-12, min(max(100, 2 * p), 5000))
            out["cg_converged"] = conv
            cov = np.zeros((p, p))
            for d in range(n_dom):
                if col_c[d] < 0:
                    continue
                if col_k[d] >= 0:
                    bi = np.linalg.inv(blk[d])
                    cov[col_c[d], col_c[d]] = bi[0, 0]
                    cov[col_k[d], col_k[d]] = bi[1, 1]
                else:
                    cov[col_c[d], col_c[d]] = 1.0 / blk[d, 0, 0]
            out["solver"] = "cg"
            out["cg_iterations"] = its
    th = np.append(theta, 0.0)
    tc = th[np.where(col_c >= 0, col_c, p)]
    tk = th[np.where(col_k >= 0, col_k, p)]
    z = y - tc[dom] - tk[dom] * u
    wi = np.bincount(cells.inst, cells.w)
    ei = np.bincount(cells.inst[cells.row_cell], w * z) / wi
    resid = z - ei[cells.inst[cells.row_cell]]
    dof = len(y) - len(wi) - p
    sigma2 = float(np.sum(w * resid * resid) / dof) if dof > 0 else np.nan
    out.update(theta_c=tc, theta_k=tk, resid=resid, dof=int(dof), sigma_ns=float(np.sqrt(sigma2)))
    if p:
        var = np.diag(cov) * sigma2
        se = np.sqrt(np.maximum(np.append(var, np.nan), 0.0))
        out["se_c"] = np.where(col_c >= 0, se[np.where(col_c >= 0, col_c, p)], np.nan)
        out["se_k"] = np.where(col_k >= 0, se[np.where(col_k >= 0, col_k, p)], np.nan)
    out["dom_rows"] = dom
    return out


def _domain_table(dom_names, ref, comp, in_comp, fit, rejected, dom_codes, inst_per_dom, scale_t,
                  timestamp) -> pd.DataFrame:
    n_dom = len(dom_names)
    ref_name = dom_names[ref]
    k = fit["theta_k"] / scale_t
    # Correction form (y_ref = y - c - k (y - t_ref)) to forward offset/drift, exactly.
    offset = fit["theta_c"] / (1.0 - k)
    drift = k / (1.0 - k) * 1e6
    off_se = fit["se_c"] / np.abs(1.0 - k)
    drift_se = fit["se_k"] / scale_t / (1.0 - k) ** 2 * 1e6
    n_rej = np.bincount(dom_codes[rejected], minlength=n_dom)
    n_rows = np.zeros(n_dom, dtype=np.int64)
    rms = np.full(n_dom, np.nan)
    if len(fit["resid"]):
        ss = np.bincount(fit["dom_rows"], fit["resid"] ** 2, n_dom)
        n_rows = np.bincount(fit["dom_rows"], minlength=n_dom)
        rms = np.where(n_rows > 0, np.sqrt(ss / np.maximum(n_rows, 1)), np.nan)
    comp_ids, comp_idx = np.unique(comp, return_inverse=True)
    status, reason, method = [], [], []
    for d in range(n_dom):
        if d == ref:
            status.append("reference")
            reason.append(None)
            method.append("reference")
        elif inst_per_dom[d] == 0:
            status.append("no_shared_instances")
            reason.append("no usable instance shares this domain with another domain")
            method.append(None)
        elif not in_comp[d]:
            status.append("disconnected")
            reason.append(f"no chain of shared instances links it to reference {ref_name!r} "
                          f"(component {int(comp_idx[d])} of {len(comp_ids)})")
            method.append(None)
        elif not fit["usable"][d]:
            status.append("all_rejected")
            reason.append("all its shared-instance rows were rejected as outliers or it lost its link to the reference")
            method.append(None)
        else:
            status.append("estimated")
            reason.append(None)
            method.append(f"wls_{timestamp}_offset_drift" if fit["drift_fitted"][d] else f"wls_{timestamp}_offset")
    est = np.array([s in ("estimated", "reference") for s in status])
    isref = np.arange(n_dom) == ref

    def nullable(values: np.ndarray, ref_value: float) -> pd.arrays.FloatingArray:
        v = np.where(isref, ref_value, values)
        return pd.array([x if e and np.isfinite(x) else pd.NA for x, e in zip(v, est)], dtype="Float64")

    drift_fitted = np.asarray(fit["drift_fitted"]) & est
    table = pd.DataFrame(
        {
            "offset_ns": nullable(offset, 0.0),
            "drift_ppm": nullable(np.where(fit["drift_fitted"], drift, 0.0), 0.0),
            "offset_se_ns": nullable(off_se, 0.0),
            "drift_se_ppm": nullable(np.where(fit["drift_fitted"], drift_se, np.nan), 0.0),
            "residual_rms_ns": nullable(rms, rms[ref] if np.isfinite(rms[ref]) else np.nan),
            # Instances used for estimated domains, instances shared at all for the others.
            "n_instances": np.where(est, fit["n_inst_dom"], inst_per_dom).astype(np.int64),
            "n_rows": n_rows.astype(np.int64),
            "n_rejected": n_rej.astype(np.int64),
            "drift_fitted": drift_fitted,
            "component": comp_idx.astype(np.int64),
            "status": status,
            "method": method,
            "reason": reason,
        },
        index=pd.Index(dom_names, name="clock_domain"),
    )
    return table[DOMAIN_COLUMNS]


# --------------------------------------------------------------------------- thesis baseline


def thesis_start_median(
    frame: pd.DataFrame, *, reference_rank: int | None = None, spanning_only: bool = False,
) -> ClockModel:
    """The baseline of the thesis (section 4.2.4): constant per-rank offsets from kernel starts.

    For every instance with >= 2 ranks: the median start over its ranks, each rank's offset
    ``delta = median - start``; per rank the median of its deltas over all instances; minus the
    reference rank's (rank 0 unless given; the lowest rank present if rank 0 is absent). The
    thesis corrects with ``t + delta``; the returned model stores ``offset_ns = -delta`` in the
    convention of :class:`ClockModel` (domain = global rank, drift 0), so
    :func:`apply_clock_correction` applies it. Ranks whose instances never connect to the
    reference rank get null offsets (the thesis would print a meaningless number). No outlier
    handling, no drift: this is kept faithful for comparison.

    Faithfully, every instance with two ranks counts, also ones inside one node; when most
    instances are intra-node (TP, intra-node DP) the per-rank median is then ~0 and the node
    offset is not corrected at all. ``spanning_only=True`` (needs ``clock_domain``) keeps only
    instances spanning >= 2 clock domains -- a charitable reading of the thesis that isolates the
    method's sensitivity to arrival skew and drift; its method name gets ``_spanning``.
    """
    need = ["global_rank", "instance", "start_ns"]
    missing = [c for c in need if c not in frame.columns]
    if missing:
        raise ValueError(f"clock frame lacks columns {missing}")
    df = frame.dropna(subset=need)
    if spanning_only:
        if "clock_domain" not in df.columns:
            raise ValueError("spanning_only needs a clock_domain column")
        df = df[df.groupby("instance", sort=False)["clock_domain"].transform("nunique") >= 2]
    rank = _int64(df["global_rank"], "global_rank")
    inst, _ = pd.factorize(df["instance"])
    inst = inst.astype(np.int64)
    start = _int64(df["start_ns"], "start_ns")
    origin = int(start.min()) if len(start) else 0
    s = (start - origin).astype(np.float64)  # small numbers: float64 is exact to the ns
    n_inst = int(inst.max()) + 1 if len(inst) else 0
    rank_codes, rank_names = pd.factorize(rank, sort=True)
    rank_codes = rank_codes.astype(np.int64)
    n_r = len(rank_names)
    dom_of_rank = None
    if "clock_domain" in df.columns:
        dom_of_rank = pd.Series(df["clock_domain"].to_numpy()).groupby(rank_codes).first()
    _, cell_inst, cell_rank = _cell_index(inst, rank_codes, max(n_r, 1))
    ranks_per_inst = np.bincount(cell_inst, minlength=n_inst)
    valid = ranks_per_inst[inst] >= 2
    inst, rank, rank_codes, s = inst[valid], rank[valid], rank_codes[valid], s[valid]
    med = _group_median(inst, s, n_inst)
    delta = med[inst] - s
    d_rank = _group_median(rank_codes, delta, n_r)
    n_inst_rank = np.bincount(rank_codes, minlength=n_r)
    keep_cells = ranks_per_inst[cell_inst] >= 2
    comp = _components(*_star_edges(cell_inst[keep_cells], cell_rank[keep_cells]), n_r)
    present = [int(r) for r, n in zip(rank_names, n_inst_rank) if n > 0]
    if not present:
        raise ValueError("no instance spans two ranks")
    if reference_rank is None:
        reference_rank = 0 if 0 in present else min(present)
    if reference_rank not in present:
        raise ValueError(f"reference rank {reference_rank} has no valid instance")
    ref = list(rank_names).index(reference_rank)
    method = "thesis_start_median_spanning" if spanning_only else "thesis_start_median"
    final = d_rank - d_rank[ref] + 0.0  # + 0.0: no negative zero for the reference
    connected = (comp == comp[ref]) & (n_inst_rank > 0)
    status = ["reference" if i == ref else "estimated" if c else "disconnected" if n else "no_shared_instances"
              for i, (c, n) in enumerate(zip(connected, n_inst_rank))]
    reason = [None if c else f"no instance chain links it to reference rank {reference_rank}" if n
              else "no instance shares this rank with another rank" for c, n in zip(connected, n_inst_rank)]
    offset = pd.array([0.0 - x if c else pd.NA for x, c in zip(final, connected)], dtype="Float64")
    table = pd.DataFrame(
        {
            "offset_ns": offset,
            "drift_ppm": pd.array([0.0 if c else pd.NA for c in connected], dtype="Float64"),
            "offset_se_ns": pd.array([pd.NA] * n_r, dtype="Float64"),
            "drift_se_ppm": pd.array([pd.NA] * n_r, dtype="Float64"),
            "residual_rms_ns": pd.array([pd.NA] * n_r, dtype="Float64"),
            "n_instances": n_inst_rank.astype(np.int64),
            "n_rows": n_inst_rank.astype(np.int64),
            "n_rejected": np.zeros(n_r, dtype=np.int64),
            "drift_fitted": np.zeros(n_r, dtype=bool),
            "component": np.unique(comp, return_inverse=True)[1].astype(np.int64),
            "status": status,
            "method": [method if c else None for c in connected],
            "reason": reason,
        },
        index=pd.Index(np.asarray(rank_names, dtype=np.int64), name="global_rank"),
    )
    if dom_of_rank is not None:
        table.insert(0, "clock_domain", dom_of_rank.reindex(np.arange(n_r)).to_numpy())
    t_ref = origin + int(np.median(s[rank == reference_rank])) if np.any(rank == reference_rank) else origin
    return ClockModel(method=method, domain_key="global_rank", reference=reference_rank,
                      t_ref_ns=t_ref, domains=table, info={"n_valid_instances": int(np.sum(ranks_per_inst >= 2))})


# --------------------------------------------------------------------------- application


def apply_clock_correction(ts_ns: Any, domain: Hashable, model: ClockModel) -> np.ndarray:
    """Timestamps of ``domain`` mapped onto the reference domain's clock (int64 ns).

    Exact inverse of the model: ``t_ref + round((x - t_ref - offset) / (1 + drift))``, computed
    on differences so that UTC-sized int64 values keep ns precision. The input is not modified;
    callers keep the originals and add ``*_sync`` columns. Raises ``KeyError`` (with the
    reason) for a domain without an estimate rather than passing timestamps through unchanged.
    """
    offset, drift_ppm = model.params(domain)
    x = np.asarray(ts_ns, dtype=np.int64)
    rel = (x - np.int64(model.t_ref_ns)).astype(np.float64)
    corr = np.rint((rel - offset) / (1.0 + drift_ppm * 1e-6)).astype(np.int64)
    return corr + np.int64(model.t_ref_ns)


def add_sync_columns(
    frame: pd.DataFrame, model: ClockModel, columns: tuple[str, ...] = ("start_ns", "end_ns"),
    domain_column: str | None = None,
) -> pd.DataFrame:
    """Copy of ``frame`` with ``<column>_sync`` (nullable Int64) for each timestamp column.

    Domains are taken from ``domain_column`` (default: the model's ``domain_key``). Rows of
    domains without an estimate get ``<NA>``, never their uncorrected value.
    """
    key = domain_column or model.domain_key
    out = frame.copy()
    codes, uniq = pd.factorize(out[key])
    known = []
    for c, d in enumerate(uniq):
        try:
            model.params(d)
        except KeyError:
            continue
        known.append((d, np.flatnonzero(codes == c)))
    for col in columns:
        vals = out[col]
        res = np.zeros(len(out), dtype=np.int64)
        valid = np.zeros(len(out), dtype=bool)
        notna = vals.notna().to_numpy()
        for d, pos in known:
            pos = pos[notna[pos]]
            res[pos] = apply_clock_correction(vals.iloc[pos].to_numpy(dtype=np.int64), d, model)
            valid[pos] = True
        out[f"{col}_sync"] = pd.arrays.IntegerArray(res, ~valid)
    return out
