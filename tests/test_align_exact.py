"""Exact call <-> kernel correlation through NCCL's NVTX payload ranges, against the emulator's
ground truth (which line belongs to which kernel), with dropped and duplicated log lines,
dropped kernels, fused groups and single-rank communicators."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from nccltrace.align.exact import (
    REASONS,
    ExactCorrelationError,
    _explain,
    compare_alignment,
    exact_correlation,
    has_nccl_payloads,
)
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.nccl.log_reader import parse_logs
from nccltrace.nsys.reader import NsysExport

# tp=2, pp=2 on 2 nodes x 2 GPUs: dp=1, so Megatron's data-parallel calls go to single-rank
# communicators; the pipeline's batched Send/Recv are NCCL groups.
BASE = {"model": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
        "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 8, "iterations": 2, "nodes": 2,
        "gpus_per_node": 2, "tp": 2, "pp": 2, "precision": "bf16", "seed": 11}  # fmt: skip
PP4 = {**BASE, "num_layers": 4, "tp": 1, "pp": 4, "seed": 5}
IMPERFECT = {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1, "drop_log_lines": 0.1,
             "duplicate_log_lines": {"ranks": [0, 1], "fraction": 0.3}, "drop_kernels": 0.1}  # fmt: skip


def _emulate(tmp_path, cfg: dict, *, host_columns: bool = True):
    res = emulate_run(cfg, tmp_path / "raw")
    parse_logs([tmp_path / "raw" / "nccl"], tmp_path / "parsed")
    calls = read_table(tmp_path / "parsed" / "calls.parquet")
    comms = read_table(tmp_path / "parsed" / "comms.parquet")
    kernels, nvtx, lost = [], [], []
    for path in res.nsys_files:
        with NsysExport.open(path) as x:
            k, n = x.kernels(), x.nvtx()
            # Launch calls whose kernel record is missing (reader versions that expose them).
            lost_fn = getattr(x, "launches_without_kernel", None)
            g = lost_fn() if lost_fn is not None else None
            if host_columns:
                k["host"] = n["host"] = x.hostname
                if g is not None:
                    g["host"] = x.hostname
            kernels.append(k)
            nvtx.append(n)
            if g is not None:
                lost.append(g)
    lost_all = pd.concat(lost, ignore_index=True) if lost else None
    return res, calls, comms, pd.concat(kernels, ignore_index=True), pd.concat(nvtx, ignore_index=True), lost_all


def _truth(res, calls: pd.DataFrame) -> pd.DataFrame:
    """Expected kernel and reason per (file, line), with the reader's view of each line."""
    ops = read_table(res.ground_truth["ops"])
    ops["file"] = ops.log_file.str.rsplit("/", n=1).str[-1]
    kernel_ok = ~ops.kernel_dropped.astype(bool)
    rows = []
    orig = ops[ops.log_line.notna()].copy()
    orig["line"] = orig.log_line
    orig["t_gpid"] = orig.kernel_global_pid.where(kernel_ok)
    orig["t_corr"] = orig.kernel_correlation_id.where(kernel_ok)
    orig["t_reason"] = np.where(orig.single_rank_no_kernel.astype(bool), "no_kernel_single_rank",
                                np.where(orig.kernel_dropped.astype(bool), "kernel_missing", None))  # fmt: skip
    rows.append(orig)
    dup = ops[ops.duplicate_line.notna()].copy()
    dup["line"] = dup.duplicate_line
    dup["t_gpid"] = dup["t_corr"] = pd.NA
    dup["t_reason"] = "duplicate_line"
    rows.append(dup)
    t = pd.concat(rows, ignore_index=True)[["file", "line", "t_gpid", "t_corr", "t_reason", "nranks", "grouped",
                                            "kernel_fused"]]  # fmt: skip
    t["t_gpid"] = t.t_gpid.astype("Int64")
    t["t_corr"] = t.t_corr.astype("Int64")
    t = t.merge(calls[["file", "line", "duplicate_of"]], on=["file", "line"], how="left")
    assert len(t) == len(calls)
    return t


def _joined(ex, truth: pd.DataFrame) -> pd.DataFrame:
    m = ex.call_matches.merge(truth, on=["file", "line"], how="outer", indicator=True)
    assert (m["_merge"] == "both").all() and len(m) == len(truth)
    has = m.kernel_correlation_id.notna().to_numpy(bool)
    m["right"] = has & (m.kernel_correlation_id == m.t_corr).fillna(False).to_numpy(bool) & (
        m.kernel_global_pid == m.t_gpid).fillna(False).to_numpy(bool)
    m["wrong"] = has & ~m.right
    # The reader cannot flag duplicates on single-rank communicators (opCount never advances):
    # such a copy is reported for what it certainly is, a single-rank call.
    m["reason_ok"] = (m.reason == m.t_reason).fillna(False) | (m.reason.isna() & m.t_reason.isna()) | (
        (m.t_reason == "duplicate_line") & (m.reason == "no_kernel_single_rank") & m.duplicate_of.isna()
        & (m.nranks == 1)).fillna(False)  # fmt: skip
    return m


def _check_kernel_ranges(ex, res) -> None:
    """Each kernel's listed NVTX ranges are those of its calls; extra kernels have no range."""
    kt = read_table(res.ground_truth["kernels"])
    kt = kt[~kt.dropped.astype(bool)]
    kr = ex.kernel_ranges
    per = kr.groupby(["kernel_global_pid", "kernel_correlation_id"]).agg(
        status=("status", "first"), complete=("complete", "first"), n=("range_start", "count")).reset_index()
    m = per.merge(kt, left_on=["kernel_global_pid", "kernel_correlation_id"],
                  right_on=["global_pid", "correlation_id"], how="outer", indicator=True)  # fmt: skip
    assert (m["_merge"] == "both").all()
    done = m[(m.status == "matched") & m.complete.astype(bool)]
    assert (done.n == done.n_ops).all()
    assert (m.loc[m.without_log.astype(bool), "status"] == "no_launch_range").all()
    cm = ex.call_matches[ex.call_matches.kernel_correlation_id.notna()]
    j = cm.merge(kr, on=["kernel_global_pid", "kernel_correlation_id"])
    listed = j[j.nvtx_start == j.range_start].drop_duplicates(["file", "line"])
    assert len(listed) == len(cm)


@pytest.mark.parametrize(
    "cfg, imperfections, host_columns",
    [
        # NCCL 2.26.2: NVTX communicator id == logged commId; opCount pins dropped lines.
        ({**BASE, "nsys_version": "2024.6", "nccl_version": "2.26.2", "nvtx_payloads": "json"},
         {**IMPERFECT, "kernels_without_log": 0.1}, True),
        # PP=4: every pipeline exchange is a grouped Send/Recv launched from ncclGroupEnd.
        ({**PP4, "nsys_version": "2026.4", "nccl_version": "2.26.2", "nvtx_payloads": "dynamic"}, IMPERFECT, False),
        # NCCL 2.21.5: payloads without communicator id, nsys 2022.4 JSON.
        ({**BASE, "nsys_version": "2022.4", "nccl_version": "2.21.5", "nvtx_payloads": "json"},
         {k: v for k, v in IMPERFECT.items() if k != "drop_log_lines"}, True),
    ],
    ids=["2.26.2-json-2024.6", "2.26.2-dynamic-2026.4-pp4", "2.21.5-json-2022.4"],
)
def test_exact_correlation_equals_ground_truth(tmp_path, cfg, imperfections, host_columns):
    res, calls, comms, kernels, nvtx, lost = _emulate(tmp_path, {**cfg, "imperfections": imperfections},
                                                host_columns=host_columns)  # fmt: skip
    assert has_nccl_payloads(nvtx)
    ex = exact_correlation(calls, kernels, nvtx, comms=comms, lost_launches=lost)
    m = _joined(ex, _truth(res, calls))
    # Every line whose kernel exists is matched to exactly that kernel, nothing else has one ...
    assert m.right.sum() == m.t_corr.notna().sum() > 0
    assert not m.wrong.any()
    # ... and every other line says why, as the ground truth does.
    assert m.reason_ok.all(), m.loc[~m.reason_ok, ["file", "line", "reason", "t_reason"]].head()
    assert set(ex.call_matches.reason.dropna()) <= set(REASONS)
    for reason in ("kernel_missing", "duplicate_line", "no_kernel_single_rank"):
        assert (m.reason == reason).any()
    assert (m.right & m.kernel_fused.astype(bool)).any()  # fused groups: several lines, one kernel
    _check_kernel_ranges(ex, res)


@pytest.mark.parametrize(
    "cfg, imperfections, min_recall",
    [
        # No communicator id: a dropped line in a run of identical calls cannot be placed.
        ({**BASE, "nsys_version": "2022.4", "nccl_version": "2.21.5", "nvtx_payloads": "json"}, IMPERFECT, 0.8),
        # 2.28.3: opCount stays 0 on single-node communicators, so the reader cannot flag the copies
        # and a repeated call cannot be told from a copy.
        ({**BASE, "nsys_version": "2026.4", "nccl_version": "2.28.3", "nvtx_payloads": "dynamic"}, IMPERFECT, 0.5),
        # One kernel per op inside a group (not NCCL's way): a group's kernels cannot be told apart.
        ({**BASE, "nsys_version": "2026.4", "nccl_version": "2.26.2", "nvtx_payloads": "dynamic"},
         {"single_rank_comm_ops": -1, "drop_kernels": 0.1}, 0.8),
    ],
    ids=["2.21.5-drops", "2.28.3-uninformative-opcount", "unfused-groups"],
)
def test_ambiguous_lines_are_refused_not_guessed(tmp_path, cfg, imperfections, min_recall):
    res, calls, comms, kernels, nvtx, lost = _emulate(tmp_path, {**cfg, "imperfections": imperfections})
    ex = exact_correlation(calls, kernels, nvtx, comms=comms, lost_launches=lost)
    m = _joined(ex, _truth(res, calls))
    assert not m.wrong.any()
    amb = m.reason == "ambiguous"
    assert amb.any()
    assert (m.right | amb | m.t_corr.isna()).all()
    assert (m.reason_ok | amb).all()
    assert m.right.sum() >= min_recall * m.t_corr.notna().sum()
    _check_kernel_ranges(ex, res)
    # Without the lost launch records the rule still refuses (a process that showed two kernels
    # of one communicator in one launch range gives no lone kernel to several calls).
    blind = _joined(exact_correlation(calls, kernels, nvtx, comms=comms), _truth(res, calls))
    assert not blind.wrong.any()


def test_trusting_the_readers_duplicate_flags_resolves_identical_repeats(tmp_path):
    cfg = {**BASE, "nsys_version": "2026.4", "nccl_version": "2.28.3", "nvtx_payloads": "dynamic",
           "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1, "drop_kernels": 0.1}}  # fmt: skip
    res, calls, comms, kernels, nvtx, lost = _emulate(tmp_path, cfg)
    truth = _truth(res, calls)
    cautious = _joined(exact_correlation(calls, kernels, nvtx, comms=comms, lost_launches=lost), truth)
    assert not cautious.wrong.any() and (cautious.reason == "ambiguous").any()
    trusting = _joined(exact_correlation(calls, kernels, nvtx, comms=comms, lost_launches=lost, duplicates="flagged"),
                       truth)
    assert trusting.right.sum() == trusting.t_corr.notna().sum() and trusting.reason_ok.all()


def test_export_without_nccl_payloads_is_detected_and_refused(tmp_path):
    cfg = {**BASE, "nsys_version": "2022.4", "nccl_version": "2.18.3", "nvtx_payloads": "none"}
    _, calls, comms, kernels, nvtx, _ = _emulate(tmp_path, cfg)
    assert (nvtx.domain == "NCCL").any()  # the ranges are there, their arguments are not
    assert not has_nccl_payloads(nvtx)
    assert not has_nccl_payloads(nvtx.iloc[:0])
    with pytest.raises(ExactCorrelationError, match="no NCCL payloads"):
        exact_correlation(calls, kernels, nvtx, comms=comms)


def _synthetic_group_run():
    """One process, two communicators (A: 2 ranks, stream 13; B: 4 ranks, stream 14): ungrouped
    calls on each, then groups spanning both, one nested, one whose B kernel is missing."""
    comm = {"A": (0xA0, 1001, 2, 13, 1024), "B": (0xB0, 1002, 4, 14, 4096)}
    calls, ranges, kernels = [], [], []
    t = 1_000
    corr = 0

    def call(c: str) -> None:
        nonlocal t
        ptr, cid, nranks, _, nbytes = comm[c]
        calls.append({"file": "r.log", "line": len(calls) + 1, "pid": 100, "tid": 100, "op": "AllReduce",
                      "op_count": 0, "comm": ptr, "nranks": nranks, "bytes": nbytes, "root": 0, "redop": 0,
                      "duplicate_of": None})  # fmt: skip
        ranges.append(("ncclAllReduce", t, t + 100, cid, nbytes))

    def launch(c: str, at: int) -> None:
        nonlocal corr
        corr += 1
        kernels.append({"global_pid": 7, "pid": 100, "correlation_id": corr, "stream_id": comm[c][3],
                        "launch_tid": 100, "launch_start": at, "launch_end": at + 10,
                        "short_name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL"})  # fmt: skip

    def mark(text: str, span: int = 50) -> int:
        nonlocal t
        ranges.append((text, t, t + span, None, None))
        start = t
        t += span + 10
        return start

    for c in "AB":  # ungrouped: the launch is inside the call's own range
        call(c)
        launch(c, t + 20)
        t += 200
    for kernels_of in (("B", "A"), ("A",)):  # groups: launches inside ncclGroupEnd
        mark("ncclGroupStart")
        for c in "AB":
            call(c)
            t += 200
        end = mark("ncclGroupEnd", 300)
        for j, c in enumerate(kernels_of):
            launch(c, end + 20 + 50 * j)
    mark("ncclGroupStart")  # nested: only the outer ncclGroupEnd launches
    mark("ncclGroupStart")
    call("A")
    t += 200
    mark("ncclGroupEnd")
    call("B")
    t += 200
    end = mark("ncclGroupEnd", 300)
    launch("A", end + 20)
    launch("B", end + 120)
    nvtx = pd.DataFrame([{"start": a, "end": b, "event_type": 59, "text": x, "domain": "NCCL", "pid": 100, "tid": 100,
                          "nccl_comm_id": cid, "nccl_message_bytes": nb} for x, a, b, cid, nb in ranges])  # fmt: skip
    nvtx["nccl_comm_id"] = nvtx.nccl_comm_id.astype("UInt64")
    nvtx["nccl_message_bytes"] = nvtx.nccl_message_bytes.astype("Int64")
    return pd.DataFrame(calls), pd.DataFrame(kernels), nvtx


@pytest.mark.parametrize("with_ids", [True, False], ids=["nvtx-comm-ids", "line-comm-pointers"])
def test_group_over_two_communicators_splits_kernels_by_stream(with_ids):
    calls, kernels, nvtx = _synthetic_group_run()
    if not with_ids:
        nvtx["nccl_comm_id"] = pd.array([None] * len(nvtx), dtype="UInt64")
    ex = exact_correlation(calls, kernels, nvtx)
    got = ex.call_matches.set_index("line")
    # lines: 1 A, 2 B (ungrouped); 3 A, 4 B (kernels B then A); 5 A, 6 B (B's kernel missing);
    # 7 A, 8 B (nested group).
    assert list(got.kernel_correlation_id.fillna(0)) == [1, 2, 4, 3, 5, 0, 6, 7]
    assert got.loc[6, "reason"] == "kernel_missing" and got.reason.drop(6).isna().all()
    kr = ex.kernel_ranges
    assert (kr.status == "matched").all() and len(kr) == len(kernels)
    assert (kr.launch_text == ["ncclAllReduce"] * 2 + ["ncclGroupEnd"] * 5).all()


def test_the_matching_rule_refuses_what_is_not_unique():
    X, Y, Z = 1, 2, 3
    no = np.zeros(3, bool)
    # A line between two identical ranges: either one; the next line is pinned.
    pos, why, failed = _explain(np.array([X, Y]), no[:2], np.array([X, X, Y]))
    assert list(pos) == [-1, 2] and list(why) == ["ambiguous", None] and not failed
    # A copy of the previous line next to a single range is a duplicate, and said so.
    pos, why, _ = _explain(np.array([X, X]), np.array([False, True]), np.array([X, Y]))
    assert list(pos) == [0, -1] and why[1] == "duplicate_line"
    # Two identical lines, two ranges: two calls, or a call, its copy and a dropped line.
    pos, why, _ = _explain(np.array([X, X]), np.array([False, True]), np.array([X, X]))
    assert list(why) == ["ambiguous", "ambiguous"]
    pos, _, _ = _explain(np.array([X, X]), np.array([False, False]), np.array([X, X]))
    assert list(pos) == [0, 1]
    # A key no range has; more lines than ranges.
    pos, why, _ = _explain(np.array([Z, X]), no[:2], np.array([X]))
    assert list(pos) == [-1, 0] and why[0] == "no_nvtx_range"
    pos, why, failed = _explain(np.array([X, X]), no[:2], np.array([X]))
    assert list(pos) == [-1, -1] and list(why) == ["ambiguous", "ambiguous"]
    # ... unless leaving out a line at an edge (a capture window's) explains the rest uniquely
    pos, why, failed = _explain(np.array([Y, Y, Z]), no, np.array([Y, Z]))
    assert list(pos) == [-1, 0, 1] and why[0] == "ambiguous" and not failed
    pos, why, failed = _explain(np.array([Y, Y, Y, Y, Y]), np.zeros(5, bool), np.array([Y]))  # beyond 3 trims
    assert failed and (pos == -1).all()
    # Long identical stretches are matched in blocks; a drop shifts the rest by one.
    b = np.tile(np.array([X, Y, Z]), 1000)
    a = np.delete(b, 1500)  # drops a Y between unique neighbours: everything stays pinned
    pos, why, _ = _explain(a, np.zeros(len(a), bool), b)
    assert (pos == np.delete(np.arange(len(b)), 1500)).all()


def test_compare_alignment_scores_against_the_exact_matches():
    exact = pd.DataFrame({
        "file": ["f"] * 5, "line": [1, 2, 3, 4, 5],
        "kernel_global_pid": pd.array([7, 7, 7, None, None], dtype="Int64"),
        "kernel_correlation_id": pd.array([10, 11, 12, None, None], dtype="Int64"),
        "reason": pd.array([None, None, None, "no_kernel_single_rank", "ambiguous"], dtype="string"),
    })  # fmt: skip
    assert compare_alignment(exact, exact)["f1"] == 1.0
    other = pd.DataFrame({
        "file": ["f"] * 5, "line": [1, 2, 3, 4, 5],
        "kernel_global_pid": pd.array([7, 7, None, 7, 7], dtype="Int64"),
        "kernel_correlation_id": pd.array([10, 99, None, 13, 14], dtype="Int64"),
    })  # fmt: skip
    s = compare_alignment(exact, other)
    # line 1 right; line 2 another kernel (FP and FN); line 3 missed (FN); line 4 a kernel for
    # a single-rank call (FP); line 5 undecided by the exact correlation (not scored).
    assert (s["tp"], s["fp"], s["fn"], s["positives"], s["unscored"]) == (1, 2, 2, 3, 1)
    assert s["precision"] == pytest.approx(1 / 3) and s["recall"] == pytest.approx(1 / 3)
    assert s["wrong_kernel"] == 1 and s["kernel_for_kernelless_line"] == 1
