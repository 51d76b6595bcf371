"""Step-window and rank-subset captures (``capture`` run setting, nccltrace.core.capture_window): config
checks, the Megatron/nsys arguments, and the emulator's capture-range exports against ground
truth (docs/emulator.md §3.1)."""

from __future__ import annotations

import copy
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from nccltrace.acquisition.launch import LaunchError, render_node_script, run_training
from nccltrace.acquisition.megatron import (
    launch_problems,
    megatron_arguments,
    parse_megatron_arguments,
)
from nccltrace.campaign.matrix import (
    CampaignError,
    expand_campaign,
    load_campaign,
    validate_runs,
)
from nccltrace.core.capture_window import (
    NSYS_CAPTURE_RANGE_ARGS,
    CaptureError,
    CaptureWindow,
    capture_problems,
)
from nccltrace.emulator import emulate_run
from nccltrace.emulator.config import ConfigError, EmulatorConfig

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "config.yaml"
DOUBLES = REPO / "tests" / "doubles"
# 2 nodes x 4 GPUs, TP2 PP2 DP2, 5 iterations; split init (all communicators before the window),
# NCCL 2.28 (timestamps, new payloads), payload tables of nsys 2026.4, some kernels dropped.
RUN = {
    "name": "small", "tp": 2, "pp": 2, "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
    "seq_length": 256, "micro_batch_size": 1, "global_batch_size": 8, "iterations": 5, "vocab_size": 1000,
    "nodes": 2, "gpus_per_node": 4, "init_style": "split", "nccl_version": "2.28.9", "nsys_version": "2026.4",
    "nvtx_payloads": "dynamic", "nccl_timestamps": True,
    "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1, "drop_kernels": 0.05,
                      "clock_offset_ns_max": 2_000_000},
}  # fmt: skip
WINDOW = {"steps": [3, 4]}
NCCL_INIT_RANGES = ("ncclCommInitRankConfig", "ncclCommSplit", "ncclCommInitRank")


# --------------------------------------------------------------------------- the one definition


def _megatron_loop(train_iters: int, start: int, end: int) -> list[int]:
    """The logged (1-based) iterations Megatron-LM's training loop captures, transcribed from
    megatron/training/training.py (core_r0.13 and main): cudaProfilerStart at the loop top when
    ``iteration == profile_step_start``, cudaProfilerStop after ``iteration += 1`` when
    ``iteration == profile_step_end``."""
    captured, on, iteration = [], False, 0
    while iteration < train_iters:
        if iteration == start:
            on = True
        step = iteration + 1  # train_step runs; Megatron logs it as 'iteration <step>'
        if on:
            captured.append(step)
        iteration += 1
        if iteration == end:
            on = False
    return captured


@pytest.mark.parametrize("steps", [(1, 1), (3, 4), (2, 10), (10, 10)])
def test_steps_map_to_the_megatron_arguments_that_capture_exactly_them(steps):
    window = CaptureWindow.from_setting({"steps": list(steps)}, iterations=10, world_size=8)
    args = window.megatron_arguments(8)
    start = int(args[args.index("--profile-step-start") + 1])
    end = int(args[args.index("--profile-step-end") + 1])
    assert _megatron_loop(10, start, end) == list(window.steps) == list(range(steps[0], steps[1] + 1))
    # the emulator's iteration index (0-based loop index; -1 = initialisation, 10 = shutdown)
    assert [i for i in range(-1, 11) if window.contains_iteration(i)] == [s - 1 for s in window.steps]
    assert args[args.index("--profile-ranks") + 1:] == [str(r) for r in range(8)]  # explicit: r0.13's default is [0]


@pytest.mark.parametrize("value, field, text", [
    ({"steps": [4, 3]}, "capture.steps", "first <= last"),
    ({"steps": [0, 2]}, "capture.steps", "numbered 1..5"),
    ({"steps": [3, 6]}, "capture.steps", "beyond the run's 5 iterations"),
    ({"steps": [3]}, "capture.steps", "[first, last]"),
    ({"ranks": [0, 8]}, "capture.ranks", "outside the run's 8 ranks"),
    ({"ranks": [1, 1]}, "capture.ranks", "twice"),
    ({"ranks": []}, "capture.ranks", "non-empty list"),
    ({"ranks": "some"}, "capture.ranks", "'all' or"),
    ({"pre_window_metadata": "maybe"}, "capture.pre_window_metadata", "kept"),
    ({"step": [1, 2]}, "capture.step", "unknown key"),
    ([3, 4], "capture", "{steps: [first, last]"),
])  # fmt: skip
def test_invalid_capture_settings_name_the_field_and_the_fix(value, field, text):
    problems = capture_problems(value, iterations=5, world_size=8)
    assert problems and problems[0][0] == field and text in problems[0][1], problems
    with pytest.raises(CaptureError) as err:
        CaptureWindow.from_setting(value, iterations=5, world_size=8)
    assert err.value.field == field
    with pytest.raises(ConfigError) as err2:  # the emulator's check is the same one
        EmulatorConfig.from_dict({**RUN, "capture": value})
    assert err2.value.field == field and str(err2.value).startswith(f"{field}: ")
    assert any(p.startswith(f"{field}: ") for p in launch_problems({**RUN, "capture": value}))


def test_a_campaign_with_bad_captures_is_rejected_listing_each_problem():
    config = yaml.safe_load(EXAMPLE.read_text())
    config["matrix"][0]["parallelism"] += [{"pp": 2, "capture": {"steps": [9, 12]}},
                                           {"tp": 2, "capture": {"ranks": [0, 4]}}]  # fmt: skip
    with pytest.raises(CampaignError) as err:
        validate_runs(expand_campaign(config))
    text = str(err.value)
    assert "2 problem(s)" in text
    assert "_cap9-12: capture.steps: last step 12 is beyond the run's 10 iterations" in text
    assert "_rk0.4: capture.ranks: ranks [4] are outside the run's 4 ranks" in text


def test_the_schema_rejects_a_malformed_capture_with_its_location(tmp_path):
    config = yaml.safe_load(EXAMPLE.read_text())
    config["matrix"][0]["parallelism"][0] = {"capture": {"steps": [1, 2, 3]}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(CampaignError, match=r"matrix/0/parallelism/0/capture/steps"):
        load_campaign(path)
    config["matrix"][0]["parallelism"][0] = {"capture": {"ranks": "half"}}
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(CampaignError, match=r"capture/ranks"):
        load_campaign(path)


def test_capture_in_defaults_blocks_and_entries_with_entry_over_block_over_defaults():
    config = yaml.safe_load(EXAMPLE.read_text())
    config["defaults"]["capture"] = {"steps": [2, 2]}
    config["matrix"] = [{"models": ["dense"], "hardware": ["A100"], "capture": {"ranks": [0]},
                         "parallelism": [{}, {"pp": 2, "capture": {"steps": [5, 6]}}]},
                        {"models": ["dense"], "hardware": ["A100"], "parallelism": [{"pp": 4}]}]  # fmt: skip
    runs = {r.run_id: r.settings["capture"] for r in expand_campaign(config)}
    assert runs == {
        # normalised: explicit steps and ranks, as run.yaml records them
        "dense_A100_tp1_pp1_ep1_cp1_vpp1_sp0_dp4_cap1-10_rk0":
            {"steps": [1, 10], "ranks": [0], "pre_window_metadata": "kept"},
        "dense_A100_tp1_pp2_ep1_cp1_vpp1_sp0_dp2_cap5-6": {"steps": [5, 6], "ranks": "all", "pre_window_metadata": "kept"},
        "dense_A100_tp1_pp4_ep1_cp1_vpp1_sp0_dp1_cap2-2": {"steps": [2, 2], "ranks": "all", "pre_window_metadata": "kept"},
    }  # fmt: skip


def test_the_example_campaign_has_a_step_window_and_a_rank_subset_run():
    runs = {r.run_id: r for r in expand_campaign(load_campaign(EXAMPLE))}
    window = runs["dense_A100_tp1_pp2_ep1_cp1_vpp1_sp0_dp2_cap3-4"].settings
    assert window["capture"]["steps"] == [3, 4] and window["nccl_timestamps"]
    assert EmulatorConfig.from_dict({**window, "capture": window["capture"]}).nccl.tuple >= (2, 26, 0)
    subset = runs["dense_A100_tp1_pp2_ep1_cp1_vpp1_sp0_dp2_cap1-10_rk0.3"].settings
    assert subset["capture"] == {"steps": [1, 10], "ranks": [0, 3], "pre_window_metadata": "kept"}
    validate_runs(list(runs.values()))


# --------------------------------------------------------------------------- acquisition


# the launch tests' training setup: the torchrun and nsys test doubles
from test_launch import _setup  # noqa: E402

TINY = dict(model="dense", num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=256,
            micro_batch_size=2, global_batch_size=8, iterations=3, nodes=1, gpus_per_node=4, precision="fp16")


def test_megatron_arguments_profile_the_window_on_the_chosen_ranks_and_read_back():
    settings = {**TINY, "tp": 2, "capture": {"steps": [2, 3], "ranks": [3, 0]}}
    args = megatron_arguments(settings)
    i = args.index("--profile")
    assert args[i:i + 8] == ["--profile", "--profile-step-start", "1", "--profile-step-end", "3",
                             "--profile-ranks", "0", "3"]  # fmt: skip
    assert parse_megatron_arguments(args)["capture"] == {"steps": [2, 3], "ranks": [0, 3]}
    assert "--profile" not in megatron_arguments(TINY) and "capture" not in parse_megatron_arguments(
        megatron_arguments(TINY))


def test_node_script_records_only_the_capture_range_when_a_window_is_set(tmp_path):
    script = render_node_script("r", {**TINY, "capture": {"steps": [2, 2]}}, _setup(), tmp_path / "capture")
    nsys_block = script.split("NSYS=(", 1)[1].split(")", 1)[0]
    for flag in NSYS_CAPTURE_RANGE_ARGS:
        assert flag in nsys_block
    assert "--profile-step-start" in script.split("TORCHRUN=(", 1)[1]
    plain = render_node_script("r", TINY, _setup(), tmp_path / "capture")
    assert "--capture-range" not in plain and "--profile" not in plain
    with pytest.raises(LaunchError, match="training.nsys_profile_args"):
        render_node_script("r", {**TINY, "capture": {"steps": [2, 2]}},
                           _setup(nsys_profile_args=["--capture-range=nvtx"]), tmp_path / "capture")


def test_a_rank_subset_run_through_the_doubles_records_only_the_profiled_rank(tmp_path):
    settings = {**TINY, "capture": {"steps": [2, 3], "ranks": [1]}}
    rec = run_training("r", settings, _setup(), tmp_path / "capture", runtime_minutes=30)
    assert rec["status"] == "ok", rec["reason"]
    cap = tmp_path / "capture"
    assert len(list((cap / "nccl").glob("nccl_*.log"))) == 4  # logs: every rank, whole run
    (report,) = (cap / "nsys").glob("*.nsys-rep")
    export = tmp_path / "node.sqlite"
    subprocess.run([sys.executable, str(DOUBLES / "fake_nsys.py"), "export", "--type", "sqlite", "-o", str(export),
                    str(report)], check=True)  # fmt: skip
    db = sqlite3.connect(export)
    pids = {p for (p,) in db.execute("SELECT DISTINCT (globalPid >> 24) & 16777215 FROM CUPTI_ACTIVITY_KIND_KERNEL")}
    assert len(pids) == 1  # rank 1 only (the double emulated what the Megatron arguments say)
    texts = {t for (t,) in db.execute("SELECT text FROM NVTX_EVENTS WHERE text LIKE 'iteration %'")}
    assert texts == {"iteration 2", "iteration 3"}


# --------------------------------------------------------------------------- emulator


def _export(path: Path) -> dict[str, pd.DataFrame]:
    db = sqlite3.connect(path)
    q = lambda sql: pd.read_sql_query(sql, db)  # noqa: E731
    out = {
        "kernels": q("SELECT globalPid AS gpid, (globalPid >> 24) & 16777215 AS pid, correlationId AS cid, "
                     "s.value AS name, start FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.shortName"),
        "runtime": q("SELECT (globalTid >> 24) & 16777215 AS pid, correlationId AS cid, start "
                     "FROM CUPTI_ACTIVITY_KIND_RUNTIME"),
        "nvtx": q("SELECT (e.globalTid >> 24) & 16777215 AS pid, e.eventType, e.domainId, e.start, "
                  "COALESCE(e.text, s.value) AS text, e.textId FROM NVTX_EVENTS e LEFT JOIN StringIds s "
                  "ON s.id = e.textId"),
        "session": q("SELECT * FROM TARGET_INFO_SESSION_START_TIME"),
        "processes": q("SELECT pid FROM PROCESSES"),
        "tables": q("SELECT name FROM sqlite_master WHERE type = 'table'"),
    }  # fmt: skip
    db.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("capture")
    out = {"full": emulate_run(RUN, base / "full")}
    for name, cap in (("kept", WINDOW), ("dropped", {**WINDOW, "pre_window_metadata": "dropped"}),
                      ("subset", {**WINDOW, "ranks": [0, 5]}), ("node0", {"ranks": [0, 1, 2, 3]})):
        out[name] = emulate_run({**RUN, "capture": cap}, base / name)
    return out


def _truth(res, name: str = "ops") -> pd.DataFrame:
    return pd.read_parquet(res.ground_truth[name])


def test_the_export_holds_exactly_the_windows_kernels(runs):
    res = runs["kept"]
    ops, kt = _truth(res), _truth(res, "kernels")
    assert set(ops.loc[ops.in_capture, "iteration"]) == {2, 3}  # logged iterations 3 and 4
    exported = pd.concat([_export(p)["kernels"] for p in res.nsys_files])
    nccl = exported[exported.name.str.startswith("nccl")]
    # every NCCL kernel in the export is one ground truth puts in the window
    truth_k = kt.set_index(["global_pid", "correlation_id"])
    keys = list(zip(nccl.gpid, nccl.cid))
    assert len(keys) == len(set(keys)) > 0
    assert truth_k.loc[keys, "in_capture"].all() and not truth_k.loc[keys, "dropped"].any()
    # ... and every in-window call with a kernel has it, unless drop_kernels removed it
    want = ops[ops.in_capture & ops.kernel_correlation_id.notna()]
    assert want.kernel_dropped.sum() > 0  # the knob did act in the window
    have = set(keys)
    for row in want.itertuples():
        assert ((int(row.kernel_global_pid), int(row.kernel_correlation_id)) in have) != row.kernel_dropped
    # kernels without a call (knob off here) and compute kernels: only in the window as well
    assert len(nccl) == int((kt.in_capture & ~kt.dropped).sum())


def test_runtime_calls_and_nvtx_ranges_are_those_of_the_window(runs):
    res, full = runs["kept"], runs["full"]
    for path, full_path in zip(res.nsys_files, full.nsys_files):
        ex, fx = _export(path), _export(full_path)
        # launches: exactly the full run's launches of the window (same correlation ids)
        assert set(ex["runtime"].cid) < set(fx["runtime"].cid)
        assert set(ex["kernels"].cid) <= set(ex["runtime"].cid)
        iters = ex["nvtx"][ex["nvtx"].text.str.startswith("iteration", na=False)]
        assert sorted(set(iters.text)) == ["iteration 3", "iteration 4"] and len(iters) == 8  # 4 ranks x 2
        ranges = ex["nvtx"][ex["nvtx"].eventType == 59]
        assert (ranges.start >= _session_clock(ex)).all()  # nothing before the collection started
        assert not ranges.text.isin(NCCL_INIT_RANGES).any()  # split inits ran before the window
        assert ranges.text.notna().all()
    assert full.nsys_files and _export(full.nsys_files[0])["nvtx"].text.isin(NCCL_INIT_RANGES).any()


def _session_clock(ex: dict) -> int:
    """Where the session starts on the export's stored clock: systemClockNs where recorded."""
    session = ex["session"]
    return int(session.systemClockNs[0]) if "systemClockNs" in session and session.systemClockNs.notna().all() else 0


def test_pre_window_metadata_is_kept_by_default_and_the_session_starts_at_the_window(runs):
    res = runs["kept"]
    clock = _truth(res, "clock").set_index("host")
    for path in res.nsys_files:
        ex = _export(path)
        domains = ex["nvtx"][ex["nvtx"].eventType == 75]
        assert list(domains.text.unique()) == ["NCCL"] and len(domains) == 4
        zero = _session_clock(ex)  # the session's start on the stored clock (monotonic for nsys 2026.4)
        assert zero > 86_400 * 10**9  # nsys 2026.4 stores the host's monotonic clock (a day or more of uptime)
        assert (domains.start < zero).all()  # created before the collection started (as nsys 2022.4 keeps it)
        assert {"NVTX_PAYLOAD_SCHEMAS", "NVTX_EVENTS_PAYLOAD_SCHEMAS"} <= set(ex["tables"].name)
        # the UTC anchor is the collection start, which ground truth records
        assert int(ex["session"].utcEpochNs[0]) == int(clock.loc[path.stem, "session_start_utc_ns"])
        first = ex["nvtx"].loc[ex["nvtx"].eventType == 59, "start"].min()
        assert 0 <= first - zero < 1_000_000_000  # the window starts right after the session's start


def test_dropped_pre_window_metadata_leaves_no_domain_rows_strings_or_payloads(runs):
    res = runs["dropped"]
    for path in res.nsys_files:
        ex = _export(path)
        nv = ex["nvtx"]
        assert not (nv.eventType == 75).any()
        nccl = nv[nv.domainId == 1]
        assert len(nccl) > 0 and nccl.text.isna().all() and nccl.textId.isna().all()
        assert not any(t.startswith(("NVTX_PAYLOAD", "DYNAMIC_NVTXPAYLOAD")) for t in ex["tables"].name)
        assert not nv.text.isin(NCCL_INIT_RANGES).any()
    # the same rows otherwise: identical kernels and iteration ranges to the 'kept' export
    kept = _export(runs["kept"].nsys_files[0])
    drop = _export(res.nsys_files[0])
    assert kept["kernels"].equals(drop["kernels"])
    assert len(kept["nvtx"][kept["nvtx"].eventType == 59]) == len(drop["nvtx"][drop["nvtx"].eventType == 59])


def test_rank_subset_the_other_ranks_leave_no_rows_but_complete_logs(runs):
    res, full = runs["subset"], runs["full"]
    ops = _truth(res)
    pid_of = ops.groupby("rank").pid.first()
    profiled = {int(pid_of[0]), int(pid_of[5])}
    for path in res.nsys_files:
        ex = _export(path)
        node_pids = set(ops.loc[ops.host == path.stem, "pid"])
        for table in ("kernels", "runtime", "nvtx"):
            assert set(ex[table].pid) == profiled & node_pids, (path.stem, table)
        assert set(ex["processes"].pid) == node_pids  # nsys still lists every process
    assert set(ops.loc[ops.in_capture, "rank"]) == {0, 5}
    # logs are the whole run's, byte for byte, for every rank
    assert [p.read_bytes() for p in res.log_files] == [p.read_bytes() for p in full.log_files]
    truth_full = _truth(full)
    assert ops.drop(columns="in_capture").equals(truth_full)


def test_a_node_without_profiled_ranks_leaves_no_export(runs):
    res = runs["node0"]
    assert [p.name for p in res.nsys_files] == ["node000.sqlite"]
    assert not (res.out_dir / "nsys" / "node001.sqlite").exists()
    assert len(res.log_files) == 8
    meta = yaml.safe_load((res.out_dir / "run.yaml").read_text())
    assert meta["config"]["capture"] == {"steps": [1, 5], "ranks": [0, 1, 2, 3], "pre_window_metadata": "kept"}
    assert meta["derived"]["captured"] == {"profiled_ranks": [0, 1, 2, 3], "exported_hosts": ["node000"]}
    # every step, but not the initialisation: no communicator init ranges even here
    assert not _export(res.nsys_files[0])["nvtx"].text.isin(NCCL_INIT_RANGES).any()


def test_lazy_inits_inside_the_window_are_captured(tmp_path):
    cfg = {**RUN, "nodes": 1, "init_style": "plain", "nvtx_payloads": "none", "imperfections": {}}
    res = emulate_run({**cfg, "capture": {"steps": [1, 1]}}, tmp_path)
    texts = set(_export(res.nsys_files[0])["nvtx"].text.dropna())
    assert "ncclCommInitRankConfig" in texts and "iteration 1" in texts and "iteration 2" not in texts


def test_without_capture_nothing_of_it_reaches_the_outputs(runs, tmp_path):
    # the same config with an explicit `capture: None` writes the same bytes as the full run
    again = emulate_run({**copy.deepcopy(RUN), "capture": None}, tmp_path / "again")
    for a, b in zip(sorted(runs["full"].out_dir.rglob("*")), sorted(again.out_dir.rglob("*"))):
        if a.is_file() and a.suffix != ".parquet":
            assert a.read_bytes() == b.read_bytes(), a.name
    assert "in_capture" not in _truth(runs["full"]).columns
    assert "capture" not in yaml.safe_load((runs["full"].out_dir / "run.yaml").read_text())["config"]
