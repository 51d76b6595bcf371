"""Soundness of call <-> kernel matches on captures as users make them (issue: never a wrong
match; say why when it cannot tell): one-sided log-time windows, windowed captures located by
log time or declared steps (or refused), logs cut short, the cross-rank check, quality records
and the report section, the capture families through the product path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from data_paths import NSYS_SQLITE

from nccltrace.align.correlate import align_process
from nccltrace.align.quality import cross_rank_contradictions
from nccltrace.align.window import log_unlocated, step_lines, window_unlocated
from nccltrace.cli import main
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.validation.alignment import SCENARIO_BASE, score_alignment
from nccltrace.validation.families import FAMILIES, GRAPH_TIME_SHARED, run_family

AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _calls(n: int, times: list[int] | None) -> pd.DataFrame:
    df = pd.DataFrame({
        "file": "nccl_h_1.log", "line": np.arange(1, n + 1), "host": "h", "pid": 1, "tid": 1, "op": "AllReduce",
        "count": 1024, "datatype": 7, "nranks": 2, "root": 0, "bytes": 4096, "redop": 0,
    })  # fmt: skip
    df["op_count"] = pd.array([0] * n, dtype="Int64")  # a single-node communicator of NCCL >= 2.27.3
    df["comm"] = pd.array([10] * n, dtype="UInt64")
    df["stream"] = pd.array([100] * n, dtype="UInt64")
    df["duplicate_of"] = pd.array([pd.NA] * n, dtype="Int64")
    df["wall_time_ns"] = pd.array(times if times is not None else [pd.NA] * n, dtype="Int64")
    return df


def _kernels(launch: list[int]) -> pd.DataFrame:
    n = len(launch)
    return pd.DataFrame({
        "start": np.asarray(launch) + 5_000, "end": np.asarray(launch) + 25_000, "device_id": 0, "context_id": 1,
        "stream_id": 13, "correlation_id": pd.array(np.arange(1, n + 1), dtype="Int64"),
        "global_pid": pd.array([1 << 24] * n, dtype="Int64"), "pid": pd.array([1] * n, dtype="Int64"),
        "name": AR, "short_name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "grid_x": 2, "grid_y": 1, "grid_z": 1,
        "launch_start": pd.array(launch, dtype="Int64"), "launch_end": pd.array(np.asarray(launch) + 2_000,
                                                                                 dtype="Int64"),
        "launch_tid": pd.array([1] * n, dtype="Int64"),
    })  # fmt: skip


def test_a_line_whose_kernel_was_lost_does_not_take_the_kernel_launched_before_it():
    """Ten identical AllReduces 100 us apart, each launched 3 us after its line; the kernel of
    the 6th was lost with its launch record. The 6th line's nearest kernel is the 5th's, 97 us
    *before* it: NCCL never launches before it logs, so the 6th stays unmatched and no other
    line moves."""
    line_t = [1_000_000_000 + 100_000 * i for i in range(10)]
    launch = [t + 3_000 for i, t in enumerate(line_t) if i != 5]
    table = align_process(_calls(10, line_t), _kernels(launch), utc_offset_ns=0, quality=(q := {}))
    calls = table[table["row_kind"] == "call"].sort_values("line")
    got = calls["kernel_correlation_id"].tolist()
    assert got[:5] == [1, 2, 3, 4, 5] and pd.isna(got[5]) and got[6:] == [6, 7, 8, 9]
    log_time = next(c for c in q["checks"] if c["check"] == "log_time")
    assert log_time["applicable"] and log_time["contradicted"] == 0 and log_time["confirmed"] == 9
    # the learned window is one-sided around the 3 us delay, not +-tens of us
    (window,) = [w for w in log_time["detail"] if w["stream"] != "*"]
    assert 0 < window["lo_ns"] <= 3_000 <= window["hi_ns"] < 10_000


def test_lines_written_outside_the_exports_capture_are_outside_capture():
    line_t = [1_000_000_000 + 1_000_037 * i for i in range(40)]  # microsecond timestamps
    launch = [t + 3_000 for t in line_t[10:20]]  # a capture of calls 10..19 only
    table = align_process(_calls(40, line_t), _kernels(launch), utc_offset_ns=0)
    calls = table[table["row_kind"] == "call"].sort_values("line")
    assert (calls["reason"].iloc[:9] == "outside_capture").all() and (calls["reason"].iloc[21:] == "outside_capture").all()
    assert calls["kernel_correlation_id"].iloc[10:20].tolist() == list(range(1, 11))


def test_an_untimed_log_against_a_partial_export_abstains_with_both_remedies():
    table = align_process(_calls(60, None), _kernels([1_000 * i for i in range(20)]), quality=(q := {}))
    calls = table[table["row_kind"] == "call"]
    assert (calls["status"] == "unmatched").all() and (calls["reason"] == "capture_not_located").all()
    msg = next(c for c in q["checks"] if c["check"] == "capture_window")["message"]
    assert "timestamps" in msg and "capture.steps" in msg and "--capture-steps" in msg


def test_coverage_rules_leave_small_differences_to_the_alignment():
    assert not window_unlocated(100, 90) and window_unlocated(100, 60) and not window_unlocated(10, 2)
    assert not log_unlocated(90, 100) and log_unlocated(60, 100)


def test_training_steps_are_found_in_a_periodic_log_and_not_in_a_damaged_one():
    init = [("Broadcast", 1), ("AllReduce", 2)]
    step = [("AllReduce", 3), ("AllGather", 4), ("AllGather", 4), ("ReduceScatter", 4), ("Send", 5), ("Recv", 5),
            ("AllReduce", 6)]  # fmt: skip
    seq = init + step * 6 + [("AllReduce", 7)]
    calls = pd.DataFrame({"op": [o for o, _ in seq], "comm": [c for _, c in seq], "count": 8, "datatype": 7,
                          "root": 0, "nranks": 2})  # fmt: skip
    sl = step_lines(calls)
    assert sl is not None and (sl.period, sl.first, sl.steps) == (7, 2, 6)
    assert sl.step[:2].tolist() == [-1, -1] and sl.step[2:9].tolist() == [0] * 7 and sl.step[-1] == 6
    damaged = calls.drop(index=[12, 20, 30]).reset_index(drop=True)  # lines lost in three steps
    assert step_lines(damaged) is None


def _instance_rows(rows):
    df = pd.DataFrame(rows, columns=["instance", "member", "op", "rank_in_comm", "root", "start_sync", "end_sync"])
    df["clock_domain"] = "n0"
    df["comm"] = df["instance"].str.split(":").str[0]  # the keys here are '<comm>:<opCount>'
    df["op_count"] = df["instance"].str.split(":").str[1].astype(float)
    for c in ("start_sync", "end_sync"):
        df[c] = df[c].astype("Int64")
    return df


def test_cross_rank_check_removes_a_member_shifted_onto_the_next_instance():
    us = 1_000
    rows = []
    for k in range(4):  # 4 ranks, instances 100 us apart, each 20 us long, ends within 0.3 us
        for r in range(4):
            rows.append([f"7:{k}", r, "AllReduce", r, 0, k * 100 * us + r * 3 * us, k * 100 * us + 20 * us + r * 100])
    rows[1 * 4 + 2][5:7] = [2 * 100 * us + 2, 2 * 100 * us + 20 * us]  # rank 2's instance 1 got instance 2's kernel
    df = _instance_rows(rows)
    removed = cross_rank_contradictions(df)
    assert list(zip(removed["instance"], removed["member"])) == [("7:1", 2)]


def test_cross_rank_check_follows_the_instance_order_when_shifted_members_outnumber_the_right_one():
    """Ranks 1 and 2 lost the lines of instances 2 and 3 and the kernel of instance 4, so their
    line of instance 4 took instance 2's kernel. Inside instance 4 the two shifted members
    outvote rank 0, and no neighbouring instance ends with them; along the communicator's order
    they sit on instance 2's end, which rank 0 holds before its instances 3 and 4, so they go
    and rank 0 stays."""
    us = 1_000
    rows = []
    for r, claims in ((0, {k: k for k in range(6)}), (1, {0: 0, 1: 1, 4: 2, 5: 5}), (2, {0: 0, 1: 1, 4: 2, 5: 5})):
        for k, at in claims.items():
            rows.append([f"7:{k}", r, "AllReduce", r, 0, at * 100 * us + r * 3 * us, at * 100 * us + 20 * us + r * 100])
    removed = cross_rank_contradictions(_instance_rows(rows))
    assert sorted(zip(removed["instance"], removed["member"])) == [("7:4", 1), ("7:4", 2)]


def _time_shared(n_inst: int = 24, period_us: int = 4_700, spread_us: int = 4_000) -> pd.DataFrame:
    """Two ranks time-sharing one GPU (the real H200 capture's TP group): each collective's
    kernels overlap, but they end ``spread_us`` apart and which rank ends first alternates."""
    us = 1_000
    rows = []
    for k in range(n_inst):
        t0 = k * period_us * us
        first = k % 2
        for r in range(2):
            late = spread_us * us if r != first else 0
            rows.append([f"9:{k}", r, "AllGather", r, 0, t0 + r * 200 * us, t0 + 8_000 * us + late])
    return _instance_rows(rows)


def test_cross_rank_check_stands_down_where_one_collectives_ends_spread_like_its_neighbours_gaps():
    df = _time_shared()
    removed = cross_rank_contradictions(df)
    assert removed.empty  # every claim is right: none demoted for ending apart
    (finding,) = removed.attrs["stood_down"]
    assert finding["comm"] == "9" and finding["ratio"] > 0.5 and finding["end_spread_ns"] == 4_000_000
    # a claim that breaks a dependency (it ended before its peer started) is still demoted there
    bad = df.copy()
    bad.loc[(bad["instance"] == "9:5") & (bad["member"] == 1), ["start_sync", "end_sync"]] = [
        -50_000_000, -40_000_000]
    assert sorted(cross_rank_contradictions(bad)["instance"]) == ["9:5", "9:5"]


def test_cross_rank_check_keeps_its_tests_where_ends_agree_and_on_other_communicators():
    us = 1_000
    tight = []
    for k in range(12):  # 4 ranks ending within 0.3 us, 100 us apart: one claim shifted
        for r in range(4):
            tight.append([f"7:{k}", r, "AllReduce", r, 0, k * 100 * us + r * 3 * us, k * 100 * us + 20 * us + r * 100])
    tight[1 * 4 + 2][5:7] = [2 * 100 * us + 2, 2 * 100 * us + 20 * us]
    df = pd.concat([_instance_rows(tight), _time_shared()], ignore_index=True)
    removed = cross_rank_contradictions(df)
    assert list(zip(removed["instance"], removed["member"])) == [("7:1", 2)]
    assert [f["comm"] for f in removed.attrs["stood_down"]] == ["9"]


def test_stream_check_demotes_matches_off_their_log_streams_home_and_splits_it_cannot_decide():
    from types import SimpleNamespace

    from nccltrace.align.default import _check_stream

    # log stream 0 mapped to export stream 0; log stream 1 unmapped, 3 matches on export stream
    # 1 and one on stream 0 (log stream 0's); log stream 2: one match on each of streams 2, 3
    ls = np.array([0] * 5 + [1] * 4 + [2] * 2)
    kst = np.array([0] * 5 + [1, 1, 1, 0] + [2, 3])
    units = SimpleNamespace(stream=ls, streams=np.arange(3), placeholder=np.zeros(len(ls), bool))
    ks = SimpleNamespace(stream=kst, streams=np.arange(4), placeholder=np.zeros(len(ls), bool))
    kernel = np.arange(len(ls))
    reason = np.full(len(ls), None, object)
    out = _check_stream(units, ks, kernel, np.array([0, -1, -1]), reason)
    assert kernel.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, -1, -1]
    assert set(reason[kernel < 0]) == {"contradicted_stream"}
    assert (out["confirmed"], out["contradicted"]) == (8, 3)


def test_p2p_check_demotes_a_recv_that_ended_before_its_send_started_and_skips_uneven_channels():
    from nccltrace.align.quality import p2p_contradictions

    us = 1_000
    rows = []
    for k in range(3):  # rank 0 sends to rank 1 three times, 100 us apart
        rows.append({"comm": 5, "rank": 0, "peer": 1, "op": "Send", "seq": k, "clock_domain": "n0",
                     "start_sync": k * 100 * us, "end_sync": k * 100 * us + 20 * us})
        start = k * 100 * us + 5 * us if k != 1 else -60 * us  # recv 1 got a kernel from before send 1
        rows.append({"comm": 5, "rank": 1, "peer": 0, "op": "Recv", "seq": k, "clock_domain": "n0",
                     "start_sync": start, "end_sync": start + 20 * us})
    # a Send may finish before its Recv starts (NCCL's FIFO lets the sender run ahead): fine
    rows.append({"comm": 6, "rank": 2, "peer": 3, "op": "Send", "seq": 0, "clock_domain": "n0",
                 "start_sync": 0, "end_sync": 10 * us})
    rows.append({"comm": 6, "rank": 3, "peer": 2, "op": "Recv", "seq": 0, "clock_domain": "n0",
                 "start_sync": 50 * us, "end_sync": 60 * us})
    # a channel whose sides logged different numbers of calls is not paired
    rows.append({"comm": 7, "rank": 4, "peer": 5, "op": "Send", "seq": 0, "clock_domain": "n0",
                 "start_sync": 900 * us, "end_sync": 910 * us})
    for k in range(2):
        rows.append({"comm": 7, "rank": 5, "peer": 4, "op": "Recv", "seq": k, "clock_domain": "n0",
                     "start_sync": k * us, "end_sync": k * us + 5})
    df = pd.DataFrame(rows)
    removed, checked, stood_down = p2p_contradictions(df)
    assert sorted(removed) == [2, 3]  # send 1 and recv 1 of channel 0 -> 1: which side is wrong is unknown
    assert set(checked) == set(range(8)) and not set(checked) & {8, 9, 10} and stood_down == []


def test_p2p_check_stands_down_on_a_communicator_whose_pairs_it_would_mostly_contradict():
    """Sixty Send/Recv pairs 100 us apart whose Recvs all end 30 us before their Send starts (a
    receiver's clock 50 us behind): the assumption fails, not the matches, so nothing there is
    demoted and the communicator is named with its measured lead; a second communicator's one
    early Recv among sixty is still demoted."""
    from nccltrace.align.quality import p2p_contradictions

    us = 1_000
    rows = []
    for comm, early in ((5, range(60)), (6, [7])):
        for k in range(60):
            rows.append({"comm": comm, "rank": 0, "peer": 1, "op": "Send", "seq": k, "clock_domain": "n0",
                         "start_sync": k * 100 * us, "end_sync": k * 100 * us + 20 * us})
            start = k * 100 * us + (-50 * us if k in early else 5 * us)
            rows.append({"comm": comm, "rank": 1, "peer": 0, "op": "Recv", "seq": k, "clock_domain": "n1",
                         "start_sync": start, "end_sync": start + 20 * us})
    df = pd.DataFrame(rows)
    removed, checked, stood_down = p2p_contradictions(df)
    assert len(checked) == 240 and set(df.loc[removed, "comm"]) == {6} and len(removed) == 2
    (rec,) = stood_down
    assert rec["comm"] == 5 and rec["pairs"] == 60 and rec["contradicted"] == 60
    assert rec["median_lead_ns"] == pytest.approx(30 * us)


def test_cross_rank_check_abstains_on_both_members_of_a_two_rank_instance_it_cannot_split():
    us = 1_000
    df = _instance_rows([["3:0", 0, "AllReduce", 0, 0, 0, 20 * us], ["3:0", 1, "AllReduce", 1, 0, 150 * us, 170 * us]])
    assert sorted(cross_rank_contradictions(df)["member"]) == [0, 1]


def test_cross_rank_check_leaves_consistent_instances_and_a_broadcast_root_that_finished_first():
    us = 1_000
    df = _instance_rows([
        ["5:0", 0, "Broadcast", 0, 0, 0, 30 * us],  # root: may finish before the others start
        ["5:0", 1, "Broadcast", 1, 0, 10 * us, 30 * us + 200], ["5:0", 2, "Broadcast", 2, 0, 12 * us, 30 * us + 300],
        ["5:1", 0, "AllReduce", 0, 0, 40 * us, 60 * us], ["5:1", 1, "AllReduce", 1, 0, 55 * us, 60 * us + 100],
    ])  # fmt: skip
    assert cross_rank_contradictions(df).empty


@pytest.fixture(scope="module")
def untimed_window_run(tmp_path_factory):
    """2-node TP2.PP2.DP2 run, NCCL 2.21.5 (no log timestamps), nsys over steps 2-3 of 4."""
    raw = tmp_path_factory.mktemp("window") / "raw"
    emulate_run({**SCENARIO_BASE, "nodes": 2, "tp": 2, "pp": 2, "iterations": 4, "seed": 3,
                 "imperfections": {"fuse_grouped_p2p": True}, "capture": {"steps": [2, 3]}}, raw)  # fmt: skip
    # the user's run.yaml says nothing of the capture: only the CLI flag can
    import yaml

    doc = yaml.safe_load((raw / "run.yaml").read_text())
    doc["config"].pop("capture")
    (raw / "run.yaml").write_text(yaml.safe_dump(doc))
    return raw


@pytest.fixture(scope="module")
def unmarked_window_run(untimed_window_run, tmp_path_factory):
    """The same run with the exports' step markers (NVTX ``iteration N`` ranges) removed: nothing
    in the trace says which iterations it holds."""
    import shutil
    import sqlite3

    raw = tmp_path_factory.mktemp("unmarked") / "raw"
    shutil.copytree(untimed_window_run, raw)
    for path in (raw / "nsys").glob("*.sqlite"):
        db = sqlite3.connect(path)
        assert db.execute("DELETE FROM NVTX_EVENTS WHERE text LIKE 'iteration %'").rowcount > 0
        db.commit()
        db.close()
    return raw


def test_analyze_refuses_an_untimed_step_window_and_names_both_remedies(unmarked_window_run, tmp_path, capsys):
    assert main(["analyze", str(unmarked_window_run), "-o", str(tmp_path / "o"), "-q"]) == 0
    out, err = capsys.readouterr()
    assert "partial" in out and "capture.steps" in err and "--capture-steps" in err and "timestamps" in err
    ops = read_table(tmp_path / "o" / "ops" / "ops.parquet")
    calls = ops[ops["row_kind"] == "call"]
    assert (calls["status"] != "matched").all()
    assert set(calls["reason"].dropna()) <= {"capture_not_located", "duplicate_line", "single_rank_communicator"}


def _window_record(out: Path) -> dict:
    record = json.loads(next((out / "aligned").glob("*/*/alignment_quality.json")).read_text())
    return next(c for c in record["checks"] if c["check"] == "capture_window")


@pytest.mark.parametrize("declared", [None, "2-3", "3-4"])
def test_analyze_locates_an_untimed_step_window_by_the_traces_step_markers(untimed_window_run, tmp_path, capsys,
                                                                          declared):  # fmt: skip
    extra = ["--capture-steps", declared] if declared else []
    assert main(["analyze", str(untimed_window_run), "-o", str(tmp_path / "o"), "-q", *extra]) == 0
    err = capsys.readouterr().err
    ops = read_table(tmp_path / "o" / "ops" / "ops.parquet")
    s = score_alignment(ops, read_table(untimed_window_run / "ground_truth" / "ops.parquet"))
    assert s["fp"] == 0 and s["recall"] >= 0.99, s
    quality = read_table(tmp_path / "o" / "ops" / "alignment_quality.parquet")
    assert set(quality["check"]) >= {"capture_window", "log_time", "cross_rank", "nvtx_range"}
    window = _window_record(tmp_path / "o")
    # the markers ("iteration 2", "iteration 3": Megatron's 1-based numbers) place it at loop index 1
    assert window["located_by"] == "profiler_steps" and window["first_step"] == 1 and window["outside"] > 0
    assert ("contradict the profiler's step markers" in err) is (declared == "3-4")


@pytest.mark.parametrize("declared", ["2-3", "1-2", "3-4"])
def test_declared_steps_that_nothing_verifies_are_refused_not_guessed(unmarked_window_run, tmp_path, capsys,
                                                                     declared):  # fmt: skip
    """Without markers or timestamps, the captured steps repeat identically in the log: the right
    declaration (2-3) and its neighbours fit alike, so none is used (0 wrong, the reason named)."""
    assert main(["analyze", str(unmarked_window_run), "-o", str(tmp_path / "o"), "-q", "--capture-steps",
                 declared]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "declared_unverified" in err and "starting at iterations 1, 2, 3" in err
    ops = read_table(tmp_path / "o" / "ops" / "ops.parquet")
    assert not (ops["status"] == "matched").any()
    assert _window_record(tmp_path / "o")["located_by"] is None


# One test per family, each in a scheduling group of its own: the families share nothing, and as
# one test they were the longest single piece of the suite on one process.
@pytest.mark.parametrize("fam", [
    pytest.param(f, id=f"{f.name} ({f.nccl})", marks=pytest.mark.xdist_group(f"capture-family-{i}"))
    for i, f in enumerate(FAMILIES)])  # fmt: skip
def test_every_capture_family_has_no_wrong_match(fam, tmp_path):
    """`nccltrace validate`'s capture families: precision >= 0.999 in every family, recall at
    least the family's floor."""
    row = run_family(fam, tmp_path)
    assert row["precision"] >= 0.999 and row["recall"] >= fam.min_recall, row
    if fam.name in ("step window, nothing declared", "step window, declared steps, no markers",
                    "log cut short") and fam.nccl < "2.26":
        assert row["partial"] and row["problems"] > 0, row
    if fam.name == "block of log lines lost":  # named from the opCount gaps it leaves
        assert row["partial"] and row["problems"] == 2, row
    if fam.name == "full":
        assert not row["partial"] and row["problems"] == 0, row
    if fam.name.startswith("lazy process groups"):  # global ranks unknown: said, and partial
        assert row["partial"] and row["problems"] > 0, row
    if fam.name.startswith("kernel ends spread by milliseconds") or fam.name == GRAPH_TIME_SHARED:
        # ranks time-sharing a GPU: the common-end and order tests stand down where one
        # collective's ends lie as far apart as consecutive collectives, and demote nothing
        assert "cross_rank_stood_down" in row["stood_down"] and row["cross_rank_demoted"] == 0, row
        assert row["partial"] is (fam.name == GRAPH_TIME_SHARED), row  # graph replays are flagged
    else:  # nowhere else does a check stand down
        assert row["stood_down"] == "", row


REAL_EXPORTS = NSYS_SQLITE  # tests/data/real/nsys_sqlite


def test_real_exports_link_every_kernel_launched_in_the_window_to_its_four_calls():
    from nccltrace.validation.families import real_export_links

    t = real_export_links(sorted(REAL_EXPORTS.glob("*.sqlite"))).set_index("export")
    before, after = t.loc["nsysai_mfu_2gpu_before.sqlite"], t.loc["nsysai_mfu_2gpu_after.sqlite"]
    assert (before.nccl_kernels, before.kernels_linked, before.launch_in_its_range) == (66, 64, 64)
    assert (after.nccl_kernels, after.kernels_linked, after.launch_in_its_range) == (62, 60, 60)
    assert before.calls_per_linked_kernel == after.calls_per_linked_kernel == "4"  # 2 Send + 2 Recv each
    assert before.payload == "missing" and t.loc["nsysai_h100_2gpu_1s.sqlite"].kernels_linked == 0


@pytest.mark.parametrize("nccl, timestamps", [("2.26.2", True), ("2.25.1", False)])
def test_exact_mode_works_on_a_step_window_export(tmp_path, nccl, timestamps):
    """The windowed export has no communicator-init ranges and holds two of four steps; the
    window is located by log time (2.26.2) or the run's declared steps (2.25.1), then every
    captured call gets its kernel from the NVTX payload ranges."""
    from nccltrace.analyze import analyze_run

    raw = tmp_path / "raw"
    emulate_run({**SCENARIO_BASE, "nodes": 2, "tp": 2, "pp": 2, "iterations": 4, "seed": 3, "nccl_version": nccl,
                 "nccl_timestamps": timestamps, "nvtx_payloads": "json", "imperfections": {"fuse_grouped_p2p": True},
                 "capture": {"steps": [2, 3]}}, raw)  # fmt: skip
    analyze_run(raw, tmp_path / "out", mode="exact", progress=False)
    s = score_alignment(read_table(tmp_path / "out" / "ops" / "ops.parquet"),
                        read_table(raw / "ground_truth" / "ops.parquet"))  # fmt: skip
    assert s["fp"] == 0 and s["recall"] == 1.0, s


def test_a_log_holding_lines_of_two_processes_aligns_the_one_it_is_named_for_and_names_the_other(tmp_path, capsys):
    """Two ranks' logs interleaved line by line in one file (a shared NCCL_DEBUG_FILE): the file's
    own process is aligned, the other's calls are unmatched with a reason, the console names
    the damage and the remedy, and no call of the other process takes a kernel."""
    import random

    raw = tmp_path / "raw"
    emulate_run({**SCENARIO_BASE, "nodes": 1, "tp": 2, "iterations": 2, "seed": 3,
                 "imperfections": {"fuse_grouped_p2p": True}}, raw)  # fmt: skip
    own, other = sorted((raw / "nccl").glob("nccl_*.log"))[:2]
    a, b = own.read_text().splitlines(True), other.read_text().splitlines(True)
    rnd, merged = random.Random(1), []
    while a or b:
        merged.append((a if a and (not b or rnd.random() < 0.5) else b).pop(0))
    own.write_text("".join(merged))
    other.unlink()
    own_pid, other_pid = int(own.stem.rsplit("_", 1)[1]), int(other.stem.rsplit("_", 1)[1])
    assert main(["analyze", str(raw), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "holds call lines of 2 processes" in err and "NCCL_DEBUG_FILE" in err and str(other_pid) in err
    ops = read_table(tmp_path / "out" / "ops" / "ops.parquet")
    calls = ops[(ops["row_kind"] == "call") & (ops["file"] == own.name)]
    theirs = calls[calls["pid"] == other_pid]
    assert len(theirs) > 50 and (theirs["status"] == "unmatched").all()
    assert set(theirs["reason"]) == {"other_process_in_log"}
    mine = calls[calls["pid"] == own_pid]
    assert (mine["status"] == "matched").mean() > 0.9
    assert set(mine["reason"].dropna()) <= {"single_rank_communicator", "duplicate_line"}
    manifest = json.loads((tmp_path / "out" / "ops" / "manifest.json").read_text())
    assert manifest["partial"]


def test_calls_captured_into_cuda_graphs_are_reported_as_captured_and_replays_take_no_line(tmp_path, capsys):
    """TP collectives captured into CUDA graphs after one eager step: each captured call is
    logged once and its launch, made inside cudaStreamBeginCapture..EndCapture, has no kernel
    record; its kernels are the replays. The call says so (not 'kernel record missing'), no
    replayed kernel is matched to a line, and the console names both."""
    raw = tmp_path / "raw"
    emulate_run({**SCENARIO_BASE, "nodes": 2, "tp": 2, "pp": 2, "iterations": 3, "seed": 5,
                 "nccl_version": "2.28.3", "nccl_timestamps": True,
                 "imperfections": {"fuse_grouped_p2p": True, "arrival_skew_ns_max": 50_000},
                 "cuda_graphs": {"parallelism": ["tp"], "warmup_iterations": 1}}, raw)  # fmt: skip
    assert main(["analyze", str(raw), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "captured into CUDA graphs" in err and "graph replays" in err
    ops = read_table(tmp_path / "out" / "ops" / "ops.parquet")
    truth = read_table(raw / "ground_truth" / "ops.parquet")
    captured = truth[truth["graph_captured"].astype(bool)].assign(file=lambda d: d["log_file"].str.split("/").str[-1])
    calls = ops[ops["row_kind"] == "call"].merge(captured[["file", "log_line"]].rename(columns={"log_line": "line"}))
    assert len(calls) == len(captured) > 0 and set(calls["reason"]) == {"graph_captured"}
    replays = ops[(ops["row_kind"] == "kernel") & (ops["reason"] == "graph_replay")]
    assert len(replays) > len(captured) and replays["line"].isna().all()
    assert "kernel_record_missing" not in set(ops["reason"].dropna())


def test_log_time_stands_down_where_the_logs_clock_stepped_and_keeps_the_matches():
    """Sixty identical AllReduces; the log's clock steps back 5 ms after call 35 (NTP), so from
    there every line seems written 5 ms before its launch. Windows learned on the first part
    forbid every later true pair and leave those lines unmatched: time stands down instead
    (named, with what was measured), every line keeps its true kernel, and the run is not made
    partial by it."""
    from nccltrace.align.quality import quality_findings, quality_problems

    line_t = [1_000_000_000 + 100_000 * i - (5_000_000 if i > 35 else 0) for i in range(60)]
    launch = [1_000_000_000 + 100_000 * i + 3_000 for i in range(60)]
    table = align_process(_calls(60, line_t), _kernels(launch), utc_offset_ns=0, quality=(q := {}))
    calls = table[table["row_kind"] == "call"].sort_values("line")
    got = calls["kernel_correlation_id"].tolist()
    assert all(pd.isna(g) or g == i + 1 for i, g in enumerate(got)) and sum(pd.notna(got)) >= 58, got
    log_time = next(c for c in q["checks"] if c["check"] == "log_time")
    assert log_time["contradicted"] == 0 and log_time["stood_down"]["matched_untimed"] >= 58
    assert log_time["stood_down"]["matched_timed"] <= 40
    assert any(c["check"] == "log_time_stood_down" for c in q["checks"])
    assert not quality_problems("h:1", q) and "log time stood down" in quality_findings("h:1", q)[0]
