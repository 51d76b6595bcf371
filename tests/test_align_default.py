"""The default aligner against emulator ground truth: thesis table 4.5 scenarios, imperfect runs,
and the unit rules (launch units, placeholders, ambiguity instead of guesses)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from nccltrace.align.correlate import ALIGNMENT_SCHEMA, align_process, process_key
from nccltrace.align.default import align_units
from nccltrace.align.sequences import (
    FAMILY_CODE,
    GENERIC,
    build_kernel_sequence,
    build_log_units,
    decode_kernel_name,
)
from nccltrace.emulator.run import emulate_run
from nccltrace.validation.alignment import (
    ALL_KNOBS,
    SCENARIO_BASE,
    align_run,
    load_emulated,
    score_alignment,
    table_4_5,
)


def _scenario(tmp_path, **knobs):
    cfg = {**SCENARIO_BASE, "seed": 3, "imperfections": {"fuse_grouped_p2p": True, **knobs.pop("imp", {})}, **knobs}
    emulate_run(cfg, tmp_path / "raw")
    return load_emulated(tmp_path / "raw", tmp_path / "parsed")


@pytest.mark.parametrize(
    "name,knobs",
    [
        ("easy", {}),
        ("nsys drops 20%", {"drop_kernels": 0.2}),
        ("nccl drops 20%", {"drop_log_lines": 0.2}),
        ("both drop 20%", {"drop_kernels": 0.2, "drop_log_lines": 0.2}),
    ],
)
def test_default_mode_meets_the_targets_in_every_table_4_5_scenario(tmp_path, name, knobs):
    inputs = _scenario(tmp_path, imp=knobs)
    s = score_alignment(align_run(inputs, "default", max_calls=200), inputs.truth)
    assert s["precision"] >= 0.999, s
    assert s["f1"] >= 0.99, s


def test_log_timestamps_resolve_what_names_cannot(tmp_path):
    """NCCL 2.28 stops counting opCount on single-node communicators; per-line timestamps
    (NCCL_DEBUG_TIMESTAMP_FORMAT with microseconds) make both-side drops exact again."""
    knobs = {"drop_kernels": 0.2, "drop_log_lines": 0.2}
    inputs = _scenario(tmp_path, nccl_version="2.28.3", nccl_timestamps=True, imp=knobs)
    s = score_alignment(align_run(inputs, "default"), inputs.truth)
    assert s["fp"] == 0 and s["recall"] >= 0.995, s


def test_default_mode_beats_thesis_mode_and_sliding_window_on_table_4_5(tmp_path):
    t = table_4_5(workdir=tmp_path).set_index("scenario")
    assert (t["default_f1"] >= t["thesis_f1"]).all()
    assert t.loc["Average", "default_f1"] > t.loc["Average", "thesis_nw"] > t.loc["Average", "sliding_window_f1"]
    # sliding window collapses when log lines are missing (the thesis's observation)
    assert t.loc["NCCL Drops 20%", "sliding_window_f1"] < 0.5 < t.loc["NCCL Drops 20%", "thesis_f1"]


@pytest.mark.parametrize(
    "settings",
    [
        {"tp": 4, "sequence_parallel": True, "num_layers": 4},
        {"dp": 4},
        {"num_experts": 4, "ep": 4, "moe_layer_freq": 2, "moe_router_topk": 2, "moe_token_dispatcher": "allgather"},
        # runs of identical P2P launches: lost lines are placed by the kernels, short unlogged
        # kernels are told from large launches by the payload they could have carried
        {"pp": 4},
        # a dense stretch of lost lines and lost kernel records in a run of interleaved-schedule
        # P2P launches: the scoring model's optimum is shifted by a few kernels there (precision
        # 0.96 before certainty looked beyond the optimum); now those units are ambiguous
        {"pp": 4, "vpp": 2, "num_layers": 8},
        {"num_experts": 4, "ep": 4, "moe_layer_freq": 2, "moe_router_topk": 2, "moe_token_dispatcher": "alltoall"},
    ],
    ids=["tp4-sp", "dp4", "moe-ep4-allgather", "pp4", "pp4-vpp2", "moe-ep4-alltoall"],
)
def test_no_wrong_matches_with_every_imperfection_knob_on(tmp_path, settings):
    cfg = {**SCENARIO_BASE, "tp": 1, "pp": 1, "sequence_parallel": False, "iterations": 2, "seed": 5,
           "imperfections": ALL_KNOBS}  # fmt: skip
    cfg.update(settings)
    cfg.pop("dp", None)
    emulate_run(cfg, tmp_path / "raw")
    inputs = load_emulated(tmp_path / "raw", tmp_path / "parsed")
    table = align_run(inputs, "default")
    s = score_alignment(table, inputs.truth)
    # a wrong match is a defect; where evidence cannot decide, abstaining costs recall only
    min_recall = 0.9 if settings.get("vpp") else 0.98
    assert s["precision"] >= 0.999 and s["recall"] >= min_recall, s
    calls = table[table["row_kind"] == "call"]
    assert set(calls["reason"].dropna()) <= {"duplicate_line", "single_rank_communicator", "no_kernel", "ambiguous",
                                             "kernel_record_missing"}  # fmt: skip
    # every kernel of the export appears: matched to calls or as its own row
    n_kernels = sum(len(k) for k in inputs.kernels.values())
    matched = calls.dropna(subset=["kernel_correlation_id"])
    matched = matched[matched["status"] == "matched"]
    listed = set(zip(matched["kernel_global_pid"], matched["kernel_correlation_id"]))
    listed |= set(zip(table.loc[table["row_kind"] == "kernel", "kernel_global_pid"],
                      table.loc[table["row_kind"] == "kernel", "kernel_correlation_id"]))  # fmt: skip
    assert len(listed) == n_kernels


def _calls(rows):
    base = {"file": "nccl_h_1.log", "host": "h", "pid": 1, "tid": 1, "count": 1, "datatype": 7, "nranks": 2,
            "root": 0, "bytes": 4, "duplicate_of": pd.NA, "wall_time_ns": pd.NA}  # fmt: skip
    out = [{**base, "line": i + 1, **r} for i, r in enumerate(rows)]
    df = pd.DataFrame(out)
    for c in ("op_count", "comm", "stream", "duplicate_of", "wall_time_ns"):
        df[c] = df[c].astype("Int64") if c != "comm" and c != "stream" else df[c].astype("UInt64")
    return df


def _kernels(names, streams):
    return pd.DataFrame({
        "short_name": names, "correlation_id": np.arange(1, len(names) + 1) * 2, "start": np.arange(len(names)) * 100,
        "end": np.arange(len(names)) * 100 + 50, "launch_start": np.arange(len(names)) * 100 - 20,
        "stream_id": streams, "pid": 1, "global_pid": 7, "grid_x": 2,
    })  # fmt: skip


AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
SR = "ncclDevKernel_SendRecv"


def test_a_group_of_send_recv_calls_is_one_launch_unit_matched_to_one_kernel():
    calls = _calls([
        {"op": "AllReduce", "op_count": 0, "comm": 10, "stream": 100},
        {"op": "Send", "op_count": 0, "comm": 20, "stream": 200},
        {"op": "Recv", "op_count": 0, "comm": 20, "stream": 200},
        {"op": "AllReduce", "op_count": 1, "comm": 10, "stream": 100},
    ])  # fmt: skip
    table = align_process(calls, _kernels([AR, SR, AR], [13, 14, 13]), nccl_version="2.21.5")
    rows = table[table["row_kind"] == "call"].set_index("line")
    assert rows.loc[[2, 3], "kernel_correlation_id"].tolist() == [4, 4]
    assert rows.loc[2, "unit"] == rows.loc[3, "unit"]
    assert (rows["status"] == "matched").all() and (table["row_kind"] == "call").all()


def test_single_rank_and_duplicate_lines_launch_nothing():
    calls = _calls([
        {"op": "AllReduce", "op_count": 0, "comm": 10, "stream": 100},
        {"op": "AllReduce", "op_count": 0, "comm": 10, "stream": 100, "duplicate_of": 1},
        {"op": "Broadcast", "op_count": 0, "comm": 30, "stream": 300, "nranks": 1},
        {"op": "AllReduce", "op_count": 1, "comm": 10, "stream": 100},
    ])  # fmt: skip
    table = align_process(calls, _kernels([AR, AR], [13, 13])).set_index("line")
    assert table.loc[2, "reason"] == "duplicate_line" and table.loc[3, "reason"] == "single_rank_communicator"
    assert table.loc[[1, 4], "kernel_correlation_id"].tolist() == [2, 4]


def test_identical_launches_with_one_kernel_missing_are_ambiguous_not_guessed():
    """Three identical AllReduces, two kernels, nothing to tell which launch lost its kernel:
    leave them unmatched as 'ambiguous' rather than pick an alignment."""
    calls = _calls([{"op": "AllReduce", "op_count": pd.NA, "comm": 10, "stream": 100}] * 3)
    calls["op_count"] = pd.array([0, 0, 0], dtype="Int64")  # opCount that does not count (2.27.3+)
    table = align_process(calls, _kernels([AR, AR], [13, 13]))
    calls_out = table[table["row_kind"] == "call"]
    assert (calls_out["status"] == "unmatched").all() and (calls_out["reason"] == "ambiguous").all()
    assert (table["row_kind"] == "kernel").sum() == 2


def test_a_gap_in_opcount_holds_the_place_of_the_lost_line():
    """opCount 1 is missing from the log: its kernel must not be given to opCount 2's line."""
    calls = _calls([
        {"op": "AllReduce", "op_count": 0, "comm": 10, "stream": 100},
        {"op": "AllReduce", "op_count": 2, "comm": 10, "stream": 100},
    ])  # fmt: skip
    units = build_log_units(calls)
    assert units.n == 3 and units.placeholder.tolist() == [False, True, False]
    res = align_units(units, build_kernel_sequence(_kernels([AR, AR, AR], [13, 13, 13])))
    assert res.kernel.tolist()[0] == 0 and res.kernel.tolist()[2] == 2


def test_a_launch_without_kernel_record_holds_its_place(tmp_path):
    calls = _calls([
        {"op": "AllReduce", "op_count": i, "comm": 10, "stream": 100} for i in range(3)
    ])  # fmt: skip
    calls["op_count"] = pd.array([0, 0, 0], dtype="Int64")
    kernels = _kernels([AR, AR, AR], [13, 13, 13])
    lost = pd.DataFrame({"start": [kernels["launch_start"][0]], "end": [kernels["launch_start"][0] + 5],
                         "correlation_id": [kernels["correlation_id"][0]], "tid": [1], "pid": [1],
                         "api": ["cudaLaunchKernel"], "global_tid": [7 * (1 << 24) + 1]})  # fmt: skip
    table = align_process(calls, kernels.iloc[1:], launches_without_kernel=lost).set_index("line")
    assert table.loc[1, "reason"] == "kernel_record_missing" and table.loc[1, "status"] == "unmatched"
    assert table.loc[[2, 3], "kernel_correlation_id"].tolist() == [4, 6]


def test_kernel_names_are_decoded_by_family_and_element_type():
    assert decode_kernel_name("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == decode_kernel_name(
        "ncclKernel_AllReduce_RING_LL_Sum___nv_bfloat16")
    k = decode_kernel_name("ncclDevKernel_ReduceScatter_Sum_u32_RING_LL")
    assert k.family == FAMILY_CODE["ReduceScatter"] and k.dtype_class == 1
    assert decode_kernel_name("ncclDevKernel_Generic").family == GENERIC
    assert decode_kernel_name("ncclSymkDevKernel_AllGather_LL").family == FAMILY_CODE["AllGather"]
    assert decode_kernel_name("ncclDevKernel_AllGather_RING_LL").dtype_class == -1  # names carry no type


def test_process_key_reads_host_and_pid_and_rejects_other_names():
    assert process_key("nccl_node-a.cluster_42") == ("node-a.cluster", 42)
    with pytest.raises(ValueError, match="nccl_%h_%p"):
        process_key("rank0")


def test_the_correlation_table_has_the_documented_columns(tmp_path):
    calls = _calls([{"op": "AllReduce", "op_count": 0, "comm": 10, "stream": 100}])
    table = align_process(calls, _kernels([AR], [13]))
    assert list(table.columns) == ALIGNMENT_SCHEMA.names
    assert all((f.metadata or {}).get(b"doc") for f in ALIGNMENT_SCHEMA)
