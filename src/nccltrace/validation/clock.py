"""Accuracy of clock synchronisation against emulator ground truth.

An emulated multi-node run gives each node a clock with a known offset and drift and records
every kernel's true start and end. The input of the estimators is built exactly as from real
exports (nsys timestamps plus each node's session UTC start, instances from the emulator's
matching), both estimators are run, and the corrected timestamps are compared with the truth.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from nccltrace.core.layout import KERNELS_FILE
from nccltrace.ops.clock_sync import (
    ClockModel,
    apply_clock_correction,
    estimate_clock_model,
    thesis_start_median,
)

__all__ = ["clock_frame_from_run", "clock_sync_grid", "emulator_config", "evaluate_clock_sync", "timestamp_errors"]

P2P_FAMILIES = ("SendRecv", "Send", "Recv")


def emulator_config(
    nodes: int, gpus_per_node: int, offset_max_ns: int, drift_ppm_max: float, skew_max_ns: int, seed: int,
    *, iterations: int = 2,
) -> dict[str, Any]:
    """A small dense-model configuration spanning ``nodes`` nodes (TP 2 inside a node, PP 2, rest DP)."""
    world = nodes * gpus_per_node
    tp = 2 if gpus_per_node % 2 == 0 else 1
    pp = 2 if world // tp >= 2 and (world // tp) % 2 == 0 else 1
    dp = world // (tp * pp)
    return {
        "name": "clocksync", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 128,
        "micro_batch_size": 1, "global_batch_size": 4 * dp, "iterations": iterations, "nodes": nodes,
        "gpus_per_node": gpus_per_node, "hardware": "a100", "tp": tp, "pp": pp, "seed": seed,
        "imperfections": {"clock_offset_ns_max": int(offset_max_ns), "clock_drift_ppm_max": float(drift_ppm_max),
                          "arrival_skew_ns_max": int(skew_max_ns), "fuse_grouped_p2p": True},
    }  # fmt: skip


def clock_frame_from_run(run_dir: Path | str, *, include_p2p: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(estimator input, ground-truth kernels) of an emulated run.

    The input has one row per non-dropped NCCL kernel with an instance: ``clock_domain`` = host,
    ``global_rank``, ``instance`` = the emulator's instance id, ``start_ns``/``end_ns`` = nsys
    timestamp + that node's session UTC start. P2P kernels are left out unless
    ``include_p2p`` (a fused SendRecv kernel carries only its first op's instance).
    """
    from nccltrace.core.tables import read_table

    gt = Path(run_dir) / "ground_truth"
    kernels = read_table(gt / KERNELS_FILE)
    clock = read_table(gt / "clock.parquet")
    kernels = kernels[~kernels["dropped"].fillna(False).astype(bool)].reset_index(drop=True)
    session = clock.set_index("host")["session_start_utc_ns"].astype("int64")
    base = kernels["host"].map(session).astype("int64")
    kernels["start_utc_ns"] = kernels["start"].astype("int64") + base
    kernels["end_utc_ns"] = kernels["end"].astype("int64") + base
    sel = kernels["instance_id"].notna()
    if not include_p2p:
        sel &= ~kernels["family"].isin(P2P_FAMILIES)
    k = kernels[sel]
    frame = pd.DataFrame({
        "clock_domain": k["host"].astype(str).to_numpy(),
        "global_rank": k["rank"].astype("int64").to_numpy(),
        "instance": k["instance_id"].astype("int64").to_numpy(),
        "start_ns": k["start_utc_ns"].to_numpy(dtype=np.int64),
        "end_ns": k["end_utc_ns"].to_numpy(dtype=np.int64),
    })  # fmt: skip
    return frame, kernels


def _clocks(clock: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Ground-truth clock per host as Python scalars (a pandas row would cast the UTC
    nanoseconds to float and lose them to rounding)."""
    return {
        str(h): {"sess_true": int(st), "sess_utc": int(su), "k": float(d) * 1e-6}
        for h, st, su, d in zip(clock["host"], clock["session_start_true_ns"], clock["session_start_utc_ns"],
                                clock["drift_ppm"])
    }


def _reference_reading(true_ns: np.ndarray, clk: dict[str, Any]) -> np.ndarray:
    """What a node's clock (as UTC) reads at true job times (int64 ns)."""
    rel = true_ns - np.int64(clk["sess_true"])
    return np.int64(clk["sess_utc"]) + rel + np.rint(clk["k"] * rel.astype(np.float64)).astype(np.int64)


def timestamp_errors(model: ClockModel, kernels: pd.DataFrame, clock: pd.DataFrame) -> dict[str, Any]:
    """Errors of corrected kernel timestamps (see :func:`evaluate_clock_sync` for the metric)."""
    key = "host" if model.domain_key == "clock_domain" else "rank"
    ref_host = model.reference if key == "host" else kernels.loc[kernels["rank"] == model.reference, "host"].iloc[0]
    ref_clock = _clocks(clock)[str(ref_host)]
    err: dict[str, list[np.ndarray]] = {"end": [], "start": []}
    n_uncorrected = 0
    for dom, g in kernels.groupby(key, sort=False):
        dom = int(dom) if key == "rank" else dom
        try:
            model.params(dom)
        except KeyError:
            n_uncorrected += len(g)
            continue
        for what in ("end", "start"):
            corrected = apply_clock_correction(g[f"{what}_utc_ns"].to_numpy(dtype=np.int64), dom, model)
            expected = _reference_reading(g[f"{what}_true_ns"].to_numpy(dtype=np.int64), ref_clock)
            err[what].append(corrected - expected)
    out: dict[str, Any] = {"n_kernels": len(kernels) - n_uncorrected, "n_uncorrected": n_uncorrected}
    ends = np.concatenate(err["end"]) if err["end"] else np.zeros(0, dtype=np.int64)
    const = float(np.median(ends)) if len(ends) else 0.0
    out["global_constant_ns"] = const
    for what in ("end", "start"):
        e = np.abs(np.concatenate(err[what]) - const) if err[what] else np.zeros(0)
        out[f"{what}_err_median_ns"] = float(np.median(e)) if len(e) else np.nan
        out[f"{what}_err_p95_ns"] = float(np.percentile(e, 95)) if len(e) else np.nan
        out[f"{what}_err_max_ns"] = float(np.max(e)) if len(e) else np.nan
    return out


def _parameter_errors(model: ClockModel, clock: pd.DataFrame) -> dict[str, float]:
    """Max |error| of offset (at the model's t_ref) and drift over the estimated nodes."""
    c = _clocks(clock)
    ref = c[str(model.reference)]
    # True job time at which the reference clock reads t_ref, then every node's reading then.
    t_star = (model.t_ref_ns - ref["sess_utc"]) / (1 + ref["k"]) + ref["sess_true"]
    off_err, drift_err = [], []
    for host, off, drift in zip(model.domains.index, model.domains["offset_ns"], model.domains["drift_ppm"]):
        if pd.isna(off):
            continue
        node = c[str(host)]
        true_off = (node["sess_utc"] - model.t_ref_ns) + (t_star - node["sess_true"]) * (1 + node["k"])
        off_err.append(float(off) - true_off)
        drift_err.append(float(drift) - ((1 + node["k"]) / (1 + ref["k"]) - 1) * 1e6)
    return {"offset_err_max_ns": float(np.max(np.abs(off_err))) if off_err else np.nan,
            "drift_err_max_ppm": float(np.max(np.abs(drift_err))) if drift_err else np.nan}


def evaluate_clock_sync(
    nodes: int, gpus_per_node: int, offset_max_ns: int, drift_ppm_max: float, skew_max_ns: int, seed: int,
    workdir: Path | str, *, iterations: int = 2, include_p2p: bool = False,
) -> dict[str, Any]:
    """Emulate a run with the given clock errors and arrival skew and score both estimators.

    Returns ``{"scenario": {...}, "truth": clock table, "models": {method: ClockModel},
    "results": DataFrame}`` with one ``results`` row per method: ``robust_wls_end``
    (:func:`~nccltrace.ops.clock_sync.estimate_clock_model`), ``thesis_start_median`` (the thesis's
    method as described) and ``thesis_start_median_spanning`` (the same on node-spanning
    instances only).

    Metric: every non-dropped NCCL kernel of the run (also ones not used for fitting) is
    corrected onto the method's reference clock; the expected value is what the reference
    node's clock read at the kernel's true start/end (from the ground-truth clock table), so
    the reference clock's own offset and rate -- which no method can or needs to know -- drop
    out. One global constant (the median end error) is then subtracted, which only matters
    if a method's correction leaves a constant shift. Reported: median, 95th percentile and
    maximum of |error| in ns, for ends and for starts (the clock map is the same; starts are a
    check that it holds at other times of the run). For the node-level estimator also the
    largest offset error at ``t_ref`` and drift error against the true relative clocks.
    """
    from nccltrace.core.tables import read_table
    from nccltrace.emulator import emulate_run

    cfg = emulator_config(nodes, gpus_per_node, offset_max_ns, drift_ppm_max, skew_max_ns, seed,
                          iterations=iterations)
    out_dir = Path(workdir) / f"clock_n{nodes}_g{gpus_per_node}_o{offset_max_ns}_d{drift_ppm_max:g}_s{skew_max_ns}_{seed}"
    t0 = time.perf_counter()
    emulate_run(cfg, out_dir)
    t_emulate = time.perf_counter() - t0
    frame, kernels = clock_frame_from_run(out_dir, include_p2p=include_p2p)
    clock = read_table(out_dir / "ground_truth" / "clock.parquet")
    n_spanning = int((frame.groupby("instance")["clock_domain"].nunique() >= 2).sum())
    scenario = {"nodes": nodes, "gpus_per_node": gpus_per_node, "offset_max_ns": int(offset_max_ns),
                "drift_ppm_max": float(drift_ppm_max), "skew_max_ns": int(skew_max_ns), "seed": seed,
                "n_kernels": len(kernels), "n_rows": len(frame), "n_spanning_instances": n_spanning,
                "emulate_s": round(t_emulate, 3)}  # fmt: skip
    rows, models = [], {}
    methods = (
        ("robust_wls_end", estimate_clock_model),
        ("thesis_start_median", thesis_start_median),
        ("thesis_start_median_spanning", partial(thesis_start_median, spanning_only=True)),
    )
    for name, fit in methods:
        t0 = time.perf_counter()
        model = fit(frame)
        dt = time.perf_counter() - t0
        models[name] = model
        row = {**scenario, "method": name, "fit_s": round(dt, 3),
               "n_domains_estimated": int(model.domains["offset_ns"].notna().sum())}
        row.update(timestamp_errors(model, kernels, clock))
        if model.domain_key == "clock_domain":
            row.update(_parameter_errors(model, clock))
            row["n_rejected_rows"] = int(model.domains["n_rejected"].sum())
        rows.append(row)
    return {"scenario": scenario, "truth": clock, "models": models, "results": pd.DataFrame(rows)}


DEFAULT_GRID: tuple[tuple[int, int, float, int], ...] = (
    # (nodes, offset_max_ns, drift_ppm_max, skew_max_ns)
    *((n, 100_000_000, d, s) for n in (2, 4, 8) for d in (0.0, 50.0) for s in (0, 5_000_000)),
)


def clock_sync_grid(
    workdir: Path | str, *, grid: tuple[tuple[int, int, float, int], ...] = DEFAULT_GRID, gpus_per_node: int = 4,
    seed: int = 7, iterations: int = 2,
) -> pd.DataFrame:
    """Error figures of both methods over a grid of scenarios, one row per scenario and method.

    Default grid: 2, 4 and 8 nodes of ``gpus_per_node`` GPUs; offsets up to +-100 ms; drift 0 or
    up to +-50 ppm; arrival skew 0 or up to 5 ms. Each scenario is a 2-layer, 128-hidden model
    for ``iterations`` iterations (about a second to emulate). Columns: the scenario, ``method``,
    ``end_err_median_ns``/``_p95_ns``/``_max_ns`` and the same for starts (see
    :func:`evaluate_clock_sync`), ``offset_err_max_ns``/``drift_err_max_ppm`` (node-level method),
    timings.
    """
    frames = []
    for nodes, off, drift, skew in grid:
        res = evaluate_clock_sync(nodes, gpus_per_node, off, drift, skew, seed, workdir, iterations=iterations)
        frames.append(res["results"])
    return pd.concat(frames, ignore_index=True)
