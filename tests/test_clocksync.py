"""Clock synchronisation: synthetic frames with known clocks, and an emulated 2-node run end to end."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest

from nccltrace.ops.clock_sync import (
    ClockModel,
    add_sync_columns,
    apply_clock_correction,
    estimate_clock_model,
    thesis_start_median,
)
from nccltrace.validation.clock import evaluate_clock_sync

UTC0 = 1_760_000_000_000_000_000


def synth(
    n_nodes: int = 4, rpn: int = 4, n_inst: int = 3000, off_max: float = 1e8, drift_max: float = 50.0,
    skew: float = 5e6, late_node: int | None = None, late_ns: float = 0.0, span: float = 2e9, seed: int = 0,
    sizes: tuple[int, ...] = (2, 4, 8, 16), groups: list[list[int]] | None = None,
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """Collective instances over random rank groups (or over the given ``groups``); clocks per
    node; ends within 800 ns, starts up to ``skew`` early (plus ``late_ns`` systematically
    later on ``late_node``)."""
    rng = np.random.default_rng(seed)
    world = n_nodes * rpn
    off = rng.uniform(-off_max, off_max, n_nodes)
    drift = rng.uniform(-drift_max, drift_max, n_nodes)
    if groups is None:
        m = np.minimum(rng.choice(sizes, n_inst), world)
        inst = np.repeat(np.arange(n_inst), m)
        pos = np.arange(len(inst)) - np.repeat(np.cumsum(m) - m, m)
        first = rng.integers(0, world, n_inst)
        stride = np.maximum(world // m, 1)
        rank = (first[inst] + pos * stride[inst]) % world
    else:
        pick = rng.integers(0, len(groups), n_inst)
        members = [groups[g] for g in pick]
        inst = np.repeat(np.arange(n_inst), [len(g) for g in members])
        rank = np.concatenate(members)
    node = rank // rpn
    t_end = np.sort(rng.uniform(1e8, span, n_inst))[inst] + rng.uniform(0, 800, len(inst))
    t_start = t_end - 30_000 - rng.uniform(0, 1, len(inst)) * rng.uniform(0, skew, n_inst)[inst]
    if late_node is not None:
        t_start = np.where(node == late_node, t_end - 30_000 - late_ns * rng.uniform(0.8, 1.0, len(inst)), t_start)

    def read(t: np.ndarray) -> np.ndarray:
        return UTC0 + np.rint(t + off[node] + drift[node] * 1e-6 * t).astype(np.int64)

    frame = pd.DataFrame({
        "clock_domain": np.array([f"node{i:03d}" for i in range(n_nodes)])[node], "global_rank": rank,
        "instance": inst, "start_ns": read(t_start), "end_ns": read(t_end),
        "t_start": t_start, "t_end": t_end,
    })  # fmt: skip
    return frame, off, drift


def truth(model: ClockModel, off: np.ndarray, drift: np.ndarray) -> pd.DataFrame:
    """True offset (at the model's t_ref) and drift of every node relative to the model's reference."""
    r = int(str(model.reference)[4:])
    k = drift * 1e-6
    t_star = (model.t_ref_ns - UTC0 - off[r]) / (1 + k[r])
    names = [f"node{i:03d}" for i in range(len(off))]
    return pd.DataFrame({"offset_ns": (off - off[r]) + (k - k[r]) * t_star,
                         "drift_ppm": ((1 + k) / (1 + k[r]) - 1) * 1e6}, index=names)


def corrected_errors(frame: pd.DataFrame, model: ClockModel, off, drift, what: str = "end") -> np.ndarray:
    """Corrected timestamps minus what the reference clock read at the true times."""
    key = model.domain_key
    r = int(str(model.reference)[4:]) if key == "clock_domain" else int(model.reference) // 4
    errs = []
    for dom, g in frame.groupby(key):
        corr = apply_clock_correction(g[f"{what}_ns"].to_numpy(), dom, model)
        t = g[f"t_{what}"].to_numpy()
        expect = UTC0 + np.rint(t + off[r] + drift[r] * 1e-6 * t).astype(np.int64)
        errs.append(corr - expect)
    return np.concatenate(errs)


# --------------------------------------------------------------------------- synthetic


@pytest.fixture(scope="module")
def skewed():
    return synth(late_node=2, late_ns=3e6)


def test_recovers_offsets_and_drift_within_1us_despite_skew(skewed):
    frame, off, drift = skewed
    model = estimate_clock_model(frame)
    est = model.domains
    assert (est["status"].isin(["reference", "estimated"])).all()
    assert est["drift_fitted"].sum() == 3 and model.info["solver"] == "direct"
    true = truth(model, off, drift)
    off_err = (est["offset_ns"].astype(float) - true["offset_ns"]).abs()
    assert off_err.max() < 1_000, off_err
    assert (est["drift_ppm"].astype(float) - true["drift_ppm"]).abs().max() < 0.05
    # the reported standard errors are honest (errors within a few of them)
    se = est["offset_se_ns"].astype(float)
    assert (off_err[se > 0] < 6 * se[se > 0] + 5).all()
    assert est["residual_rms_ns"].astype(float).between(150, 350).all()  # end jitter is uniform over 800 ns
    for what in ("end", "start"):
        assert np.abs(corrected_errors(frame, model, off, drift, what)).max() < 1_000


def test_thesis_method_and_start_timestamps_are_biased_by_skew(skewed):
    """A node that habitually arrives late (3 ms) shifts every start-based estimate, not the end-based one."""
    frame, off, drift = skewed
    thesis = thesis_start_median(frame)
    err = np.abs(corrected_errors(frame, thesis, off, drift))
    assert np.median(err) > 100_000 and err.max() > 1_000_000
    by_start = estimate_clock_model(frame, timestamp="start")
    assert np.abs(corrected_errors(frame, by_start, off, drift)).max() > 1_000_000
    assert np.abs(corrected_errors(frame, estimate_clock_model(frame), off, drift)).max() < 1_000


def test_thesis_claim_on_its_own_synthetic_setting():
    """Thesis 4.3: per-rank offsets (0, +50 ms, -30 ms, ...), all ranks in every collective, no
    skew, no drift -> offsets within 200 ns."""
    rng = np.random.default_rng(3)
    offsets = np.array([0, 50_000_000, -30_000_000, 12_345_678])
    n_inst = 60
    t = np.sort(rng.uniform(0, 5e9, n_inst))
    rows = []
    for i in range(n_inst):
        for r in range(4):
            s = UTC0 + int(t[i] + rng.uniform(-100, 100)) + offsets[r]
            rows.append((f"rank{r}", r, i, s, s + 50_000))
    frame = pd.DataFrame(rows, columns=["clock_domain", "global_rank", "instance", "start_ns", "end_ns"])
    model = thesis_start_median(frame)
    assert model.reference == 0 and model.domains.loc[0, "offset_ns"] == 0
    assert np.abs(model.domains["offset_ns"].astype(float).to_numpy() - offsets).max() < 200
    # and it is simply exact without jitter
    frame2 = frame.assign(start_ns=UTC0 + np.repeat(t.astype(np.int64), 4) + np.tile(offsets, n_inst))
    assert np.abs(thesis_start_median(frame2).domains["offset_ns"].astype(float).to_numpy() - offsets).max() == 0


def test_disconnected_and_unshared_domains_are_reported_not_zeroed():
    # nodes 0-1 share instances, nodes 2-3 share only among themselves, node 4 only has
    # instances of its own two ranks (rank r is on node r // 2)
    groups = [[0, 2], [1, 3], [0, 1, 2, 3], [0, 1], [4, 6], [5, 7], [4, 5], [8, 9]]
    frame, _, _ = synth(n_nodes=5, rpn=2, n_inst=800, seed=4, groups=groups)
    model = estimate_clock_model(frame)
    d = model.domains
    assert model.reference in ("node000", "node001")
    other = "node001" if model.reference == "node000" else "node000"
    assert d.loc[other, "status"] == "estimated" and pd.notna(d.loc[other, "offset_ns"])
    for n in ("node002", "node003"):
        assert d.loc[n, "status"] == "disconnected"
        assert pd.isna(d.loc[n, "offset_ns"]) and pd.isna(d.loc[n, "drift_ppm"])
        assert "no chain of shared instances" in d.loc[n, "reason"]
    assert d.loc["node002", "component"] == d.loc["node003", "component"] != d.loc[other, "component"]
    assert d.loc["node004", "status"] == "no_shared_instances" and pd.isna(d.loc["node004", "offset_ns"])
    with pytest.raises(KeyError, match="no chain"):
        apply_clock_correction([UTC0], "node002", model)
    synced = add_sync_columns(frame, model)
    assert synced.loc[synced.clock_domain == "node003", "end_ns_sync"].isna().all()
    assert synced.loc[synced.clock_domain == other, "end_ns_sync"].notna().all()
    assert (synced["end_ns"] == frame["end_ns"]).all()  # originals kept


def test_outliers_are_rejected():
    frame, off, drift = synth(n_nodes=3, n_inst=2000, seed=5)
    rng = np.random.default_rng(9)
    bad = rng.choice(len(frame), size=len(frame) // 50, replace=False)
    end = frame["end_ns"].to_numpy().copy()
    end[bad] += rng.choice([-1, 1], len(bad)) * rng.integers(20_000, 5_000_000, len(bad))
    noisy = frame.assign(end_ns=end)
    robust = estimate_clock_model(noisy)
    plain = estimate_clock_model(noisy, reject_k=np.inf)
    n_rej = int(robust.domains["n_rejected"].sum())
    assert len(bad) <= n_rej < 3 * len(bad)
    clean = frame.drop(index=frame.index[bad])
    assert np.abs(corrected_errors(clean, robust, off, drift)).max() < 1_000
    assert np.abs(corrected_errors(clean, plain, off, drift)).max() > 10_000  # without rejection it fails


def test_ambiguous_instances_dropped_and_solvers_agree():
    frame, off, drift = synth(n_nodes=6, rpn=2, n_inst=1500, seed=6)
    dup = frame.iloc[:5].assign(end_ns=frame["end_ns"].iloc[:5] + 10_000_000)  # a rank twice in an instance
    model = estimate_clock_model(pd.concat([frame, dup], ignore_index=True))
    assert model.info["n_ambiguous_instances"] >= 1
    cg = estimate_clock_model(frame, solver="cg")
    direct = estimate_clock_model(frame, solver="direct")
    assert cg.info["solver"] == "cg" and direct.info["solver"] == "direct"
    a = cg.domains["offset_ns"].astype(float)
    b = direct.domains["offset_ns"].astype(float)
    assert (a - b).abs().max() < 1.0
    assert (cg.domains["drift_ppm"].astype(float) - direct.domains["drift_ppm"].astype(float)).abs().max() < 1e-3
    # CG standard errors are conditional (never larger than the exact ones)
    assert (cg.domains["offset_se_ns"].astype(float) <= direct.domains["offset_se_ns"].astype(float) + 1e-9).all()
    assert np.abs(corrected_errors(frame, model, off, drift)).max() < 1_000


def test_per_process_domains_and_reference_override():
    frame, _, _ = synth(n_nodes=2, rpn=4, n_inst=1500, seed=8)
    per_proc = frame.assign(clock_domain="h:" + frame["global_rank"].astype(str))
    model = estimate_clock_model(per_proc, reference="h:0")
    assert model.reference == "h:0" and len(model.domains) == 8
    d = model.domains
    # processes on one node share a clock: their estimates agree to well under a microsecond
    node1 = d.loc[[f"h:{r}" for r in range(4, 8)], "offset_ns"].astype(float)
    assert node1.max() - node1.min() < 500
    default = estimate_clock_model(frame)
    assert default.reference == default.domains["n_instances"].idxmax()
    with pytest.raises(ValueError, match="reference domain"):
        estimate_clock_model(frame, reference="nope")


def test_correction_is_exact_inverse_at_utc_scale():
    domains = pd.DataFrame({"offset_ns": pd.array([0.0, 123_456_789.25], dtype="Float64"),
                            "drift_ppm": pd.array([0.0, -37.5], dtype="Float64"),
                            "reason": [None, None]}, index=["a", "b"])
    t_ref = UTC0 + 5_000_000_000
    model = ClockModel("test", "clock_domain", "a", t_ref, domains)
    ref_times = t_ref + np.array([-3_000_000_000, -1, 0, 7, 2_000_000_001], dtype=np.int64)
    rel = (ref_times - t_ref).astype(float)
    readings = t_ref + np.rint(rel + 123_456_789.25 - 37.5e-6 * rel).astype(np.int64)
    back = apply_clock_correction(readings, "b", model)
    assert back.dtype == np.int64 and np.abs(back - ref_times).max() <= 1
    assert (apply_clock_correction(ref_times, "a", model) == ref_times).all()


def test_million_rows_in_seconds():
    rng = np.random.default_rng(1)
    n_nodes, rpn = 32, 8
    world = n_nodes * rpn
    m = rng.choice([2, 8, 32, 256], 14_000)
    inst = np.repeat(np.arange(len(m)), m)
    pos = np.arange(len(inst)) - np.repeat(np.cumsum(m) - m, m)
    rank = (rng.integers(0, world, len(m))[inst] + pos * (world // m)[inst]) % world
    node = rank // rpn
    off = rng.uniform(-1e8, 1e8, n_nodes)
    t = np.sort(rng.uniform(0, 6e10, len(m)))[inst] + rng.uniform(0, 800, len(inst))
    end = UTC0 + np.rint(t + off[node]).astype(np.int64)
    frame = pd.DataFrame({"clock_domain": node, "global_rank": rank, "instance": inst, "start_ns": end - 5000,
                          "end_ns": end})
    assert len(frame) > 1_000_000
    estimate_clock_model(frame.iloc[:1000])  # compile outside the timing
    t0 = time.perf_counter()
    model = estimate_clock_model(frame)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, elapsed
    est = model.domains["offset_ns"].astype(float).to_numpy()
    assert np.abs(est - (off - off[int(model.reference)])).max() < 100


# --------------------------------------------------------------------------- emulated end to end


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    work = tmp_path_factory.mktemp("clock")
    return {
        "skewed": evaluate_clock_sync(2, 4, 100_000_000, 50.0, 5_000_000, 11, work),
        "clean": evaluate_clock_sync(2, 4, 100_000_000, 0.0, 0, 11, work),
    }


def test_emulated_two_nodes_recovered_within_1us(emulated):
    res = emulated["skewed"]
    truth_clock = res["truth"]
    assert truth_clock["offset_ns"].abs().max() > 10_000_000 and truth_clock["drift_ppm"].abs().max() > 5
    assert res["scenario"]["n_spanning_instances"] >= 20
    row = res["results"].set_index("method").loc["robust_wls_end"]
    assert row["n_domains_estimated"] == 2 and row["n_uncorrected"] == 0
    assert row["end_err_max_ns"] < 1_000 and row["start_err_max_ns"] < 1_000
    assert row["offset_err_max_ns"] < 1_000 and row["drift_err_max_ppm"] < 0.05
    # the thesis method, even on node-spanning instances only, is off by the arrival skew
    assert res["results"].set_index("method").loc["thesis_start_median_spanning", "end_err_max_ns"] > 10_000


def test_emulated_thesis_method_without_skew_and_drift(emulated):
    res = emulated["clean"].get("results").set_index("method")
    assert res.loc["thesis_start_median_spanning", "end_err_max_ns"] <= 200
    assert res.loc["robust_wls_end", "end_err_max_ns"] <= 200
    # As described (every instance with two ranks), most instances are intra-node and the
    # per-rank median ignores the node offset: the second node is left uncorrected.
    assert res.loc["thesis_start_median", "end_err_max_ns"] > 1_000_000
