"""The ops stage's run-level checks (cross-rank instances, P2P pairing) and the clock fit run
on parts of whole logical communicators spilled to disk (issue 15: the ops job held every
instance row of the run). Checked one part at a time, with the run-wide scales taken from
every part first, they must give exactly the tables of the whole run in one part, including
the matches they demote."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import yaml
from emulated_runs import SMALL_MODEL

from nccltrace.align.correlate import ALIGNMENT_SCHEMA
from nccltrace.align.quality import (
    CROSS_RANK_REASON,
    P2P_REASON,
    QUALITY_FILE,
    cross_rank_contradictions,
    cross_rank_scales,
    end_deviations,
)
from nccltrace.analyze import analyze_run
from nccltrace.core.layout import RunLayout
from nccltrace.core.tables import read_table, write_table_atomic
from nccltrace.emulator.run import emulate_run
from nccltrace.ops.build import stream_run_ops

_SMALL = {**SMALL_MODEL, "compute_kernels": False}
RUNS = {
    # lost kernels and duplicated lines, unsynchronised and drifting clocks, fused grouped P2P, NCCL 2.18
    # (no lost lines: the P2P check leaves the channels of a process that lost lines unpaired)
    "knobs": {**_SMALL, "tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 2, "nccl_version": "2.18.3", "seed": 5,
              "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1,
                                "duplicate_log_lines": {"ranks": [1], "fraction": 0.2},
                                "drop_kernels": 0.03, "clock_offset_ns_max": 2_000_000, "clock_drift_ppm_max": 5.0,
                                "arrival_skew_ns_max": 50_000}},
    # MoE with expert parallelism and VPP on four nodes
    "moe": {**_SMALL, "tp": 2, "pp": 2, "vpp": 2, "nodes": 4, "gpus_per_node": 2, "ep": 2, "num_experts": 4,
            "moe_layer_freq": 2, "moe_router_topk": 2, "sequence_parallel": True, "global_batch_size": 8,
            "precision": "bf16",
            "nccl_version": "2.26.2", "nccl_timestamps": True, "seed": 7,
            "imperfections": {"clock_offset_ns_max": 1_000_000}},
}  # fmt: skip

_KERNEL = ["kernel_start", "kernel_end", "launch_start"]


def damage_alignment(aligned: pd.DataFrame) -> pd.DataFrame:
    """Wrong matches a faulty aligner could make, for the checks to find: every 7th matched
    collective call takes the kernel of the next matched call on its communicator (a claim
    shifted onto the next instance), every 3rd matched Recv a kernel 10 ms earlier than its own
    (it would end before its Send started)."""
    out = aligned.copy()
    matched = out[(out["row_kind"] == "call") & (out["status"] == "matched")]
    coll = matched[~matched["op"].isin(["Send", "Recv"])]
    for _, rows in coll.groupby("comm", sort=False):
        idx = rows.index.to_numpy()
        for a, b in zip(idx[:-1:7], idx[1::7]):
            out.loc[a, _KERNEL] = out.loc[b, _KERNEL].to_numpy()
    recv = matched.index[matched["op"] == "Recv"][::3]
    for c in _KERNEL:
        out.loc[recv, c] = out.loc[recv, c] - 10_000_000
    return out


@pytest.fixture(scope="module", params=sorted(RUNS))
def damaged(request, tmp_path_factory) -> tuple:
    """An analysed run whose alignment tables were damaged (``damage_alignment``): the inputs
    of ``stream_run_ops``."""
    base = tmp_path_factory.mktemp(f"checks-{request.param}")
    emulate_run({**RUNS[request.param], "name": request.param}, base / "raw")
    analyze_run(base / "raw", base / "out", progress=False)
    layout = RunLayout(base / "out")
    alignments, qualities = [], []
    for proc in layout.find_processes():
        dest = base / "damaged" / proc
        dest.mkdir(parents=True)
        table = pa.Table.from_pandas(damage_alignment(read_table(layout.alignment(proc))), schema=ALIGNMENT_SCHEMA,
                                     preserve_index=False)  # fmt: skip
        write_table_atomic(table, dest / "alignment.parquet")
        shutil.copy(layout.aligned(proc) / QUALITY_FILE, dest / QUALITY_FILE)
        alignments.append(dest / "alignment.parquet")
        qualities.append(dest / QUALITY_FILE)
    settings = yaml.safe_load((base / "raw" / "run.yaml").read_text())["config"]
    sessions = {h: layout.parsed_nsys(h) / "session.json" for h in layout.find_hosts()}
    args = (alignments, [layout.parsed_nccl(p) for p in layout.find_processes()], layout.communicators,
            layout.members, sessions, settings)  # fmt: skip
    return args, qualities


def _ops(damaged, path: Path, **kw):
    args, qualities = damaged
    res = stream_run_ops(*args, path, quality_paths=qualities, **kw)
    return res, read_table(path)


def test_checks_in_parts_of_communicators_give_the_tables_of_the_whole_run(damaged, tmp_path):
    whole, ops_whole = _ops(damaged, tmp_path / "whole.parquet", check_part_rows=1 << 40)
    parts, ops_parts = _ops(damaged, tmp_path / "parts.parquet", check_part_rows=40)
    reasons = ops_whole["reason"].value_counts()
    # the damage is found by both checks, so the comparison covers what they demote
    assert reasons.get(CROSS_RANK_REASON, 0) > 0 and reasons.get(P2P_REASON, 0) > 0, reasons
    pd.testing.assert_frame_equal(ops_parts, ops_whole)
    pd.testing.assert_frame_equal(parts.quality, whole.quality)
    pd.testing.assert_frame_equal(parts.clock, whole.clock)
    assert (parts.calls, parts.matched, parts.unmatched_by_reason, parts.problems, parts.partial) == (
        whole.calls, whole.matched, whole.unmatched_by_reason, whole.problems, whole.partial)  # fmt: skip
    assert whole.partial and any("contradicted" in p for p in whole.problems)
    assert not list(tmp_path.glob(".ops-parts-*"))  # the spill is removed


def test_clock_fit_on_a_sample_is_the_same_in_parts(damaged, tmp_path):
    """The sample of whole instances does not depend on how the rows were spilled."""
    whole, ops_whole = _ops(damaged, tmp_path / "whole.parquet", check_part_rows=1 << 40, clock_rows_budget=200)
    parts, ops_parts = _ops(damaged, tmp_path / "parts.parquet", check_part_rows=40, clock_rows_budget=200)
    assert whole.notes == parts.notes and any("clock sync fitted on" in n for n in whole.notes)
    pd.testing.assert_frame_equal(parts.clock, whole.clock)
    pd.testing.assert_frame_equal(ops_parts, ops_whole)


def _instances(comm: str, n: int, members: int, period_us: int, end_jitter_ns: int) -> list[list]:
    us = 1_000
    rows = []
    for k in range(n):
        for r in range(members):
            end = k * period_us * us + 20 * us + (r * end_jitter_ns) % (3 * end_jitter_ns + 1)
            rows.append([f"{comm}:{k}", f"{comm}/{r}", "AllReduce", r, 0, k * period_us * us + r * us, end])
    return rows


def test_scales_of_the_whole_run_decide_a_part_the_way_the_whole_run_does():
    """Communicator 1 ends its collectives within 2 us, communicator 2 within 40 ns; one member
    of communicator 2 ends 5 us off. The run's robust end spread (mostly communicator 1's)
    keeps it, and so must the part holding communicator 2 alone when given the run's scales;
    with its own scales that part would demote it."""
    rows = _instances("1", 40, 4, 100, 2_000) + _instances("2", 10, 4, 100, 40)
    rows[-1][6] += 5_000
    df = pd.DataFrame(rows, columns=["instance", "member", "op", "rank_in_comm", "root", "start_sync", "end_sync"])
    df["clock_domain"] = "n0"
    df["comm"] = df["instance"].str.split(":").str[0]
    df["op_count"] = df["instance"].str.split(":").str[1].astype(float)
    for c in ("start_sync", "end_sync"):
        df[c] = df[c].astype("Int64")
    whole = cross_rank_contradictions(df)
    part = df[df["comm"] == "2"]
    (d1, b1, w1), (d2, b2, w2) = (end_deviations(df[df["comm"] == c]) for c in ("1", "2"))
    scales = cross_rank_scales(np.concatenate([d1, d2]), np.concatenate([b1, b2]), max(w1, w2))
    assert scales == cross_rank_scales(*end_deviations(df))
    assert cross_rank_contradictions(part, scales=scales).index.equals(whole.index[whole.index.isin(part.index)])
    assert not len(cross_rank_contradictions(part, scales=scales))
    assert len(cross_rank_contradictions(part)) == 1  # its own, narrower scales: the off member goes


def test_the_ops_stage_checks_each_part_with_the_scales_of_the_whole_run(tmp_path):
    """The scenario above through the ops stage's spilled parts: communicators 1 and 2 in parts
    of their own decide as the whole run in one part does."""
    from nccltrace.ops.build import _CheckRows, _run_checks, instance_parts

    rows = _instances("1", 40, 4, 100, 2_000) + _instances("2", 10, 4, 100, 40)
    rows[-1][6] += 5_000
    df = pd.DataFrame(rows, columns=["instance", "member", "op", "rank_in_comm", "root", "start_ns", "end_ns"])
    lid = df["instance"].str.split(":").str[0].astype(int)
    rank = lid * 10 + df["rank_in_comm"]
    sync = pd.DataFrame({
        "clock_domain": "n0", "global_rank": rank, "instance": df["instance"], "start_ns": df["start_ns"],
        "end_ns": df["end_ns"], "nranks": 4, "op": df["op"], "rank_in_comm": df["rank_in_comm"], "root": 0,
        "proc": rank, "row": np.arange(len(df)), "logical_id": lid,
    })  # fmt: skip
    sync["comm"], sync["op_count"] = instance_parts(sync["instance"])  # as _sync_rows gives them
    processes = [f"p{i}" for i in range(30)]
    results = []
    for n_parts in (1, 2):
        checks = _CheckRows(tmp_path, n_parts)
        for proc, rows_of_proc in sync.groupby("proc"):
            checks.add(rows_of_proc, pd.DataFrame(columns=["comm", "rank", "peer_in_comm"]), False)
        assert sum(1 for _ in checks.parts("sync")) == n_parts
        demote, cross, _, _ = _run_checks(checks, None, processes, pd.DataFrame())
        checks.spill.close()
        results.append((demote, cross))
    (whole, whole_summary), (parts, parts_summary) = results
    assert whole == {} and parts == {}  # the member 5 us off stays: the run's spread is wide
    pd.testing.assert_frame_equal(parts_summary, whole_summary)
    assert int(whole_summary["confirmed"].sum()) == len(sync)


def test_a_part_without_any_timed_instance_gives_neutral_scales():
    dev, big, widest = end_deviations(pd.DataFrame({
        "instance": ["1:0"], "member": [0], "clock_domain": ["n0"], "op": ["AllReduce"], "rank_in_comm": [0],
        "root": [0], "start_sync": pd.array([pd.NA], dtype="Int64"), "end_sync": pd.array([pd.NA], dtype="Int64"),
        "comm": ["1"], "op_count": [0.0]}))  # fmt: skip
    assert len(dev) == len(big) == 0 and widest == float("-inf")
    assert cross_rank_scales(dev, big, widest) == (0.0, 0.0)


def test_the_ops_manifest_of_a_damaged_run_names_the_contradicted_matches(damaged, tmp_path):
    res, _ = _ops(damaged, tmp_path / "ops.parquet", check_part_rows=40)
    q = res.quality
    assert q.loc[q["check"] == "cross_rank", "contradicted"].sum() > 0
    assert q.loc[q["check"] == "p2p_pairing", "contradicted"].sum() > 0
    json.dumps(res.problems)  # the problems are plain strings for the manifest
