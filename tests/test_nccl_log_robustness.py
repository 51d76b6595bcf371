"""Bad and torn input never turns into a plausible wrong record (review findings as tests)."""

from __future__ import annotations

import pandas as pd
import pytest

from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.nccl.log_reader import parse_logs

CALL = ("AllReduce: opCount 1f sendbuff 0x7f00 recvbuff 0x7f00 count 64 datatype 7 op 0 root 0 comm 0x55aa00 "
        "[nranks=4] stream 0x99")


@pytest.mark.parametrize("fast", [True, False])
def test_cut_op_name_glued_to_next_host_is_never_a_record(tmp_path, fast):
    text = (
        f"node1:100:100 [0] NCCL INFO {CALL}\n"
        # Writer A was cut after "AllRedu"; writer B's whole record follows on the same line, and A's
        # tail "ce: opCount ..." arrives as an orphan line.
        f"node1:100:100 [0] NCCL INFO AllRedunode2:200:200 [1] NCCL INFO {CALL}\n"
        f"{CALL[7:]}\n"
    )
    (tmp_path / "t.log").write_text(text)
    parse_logs([tmp_path / "t.log"], tmp_path / "o", fast=fast)
    calls = read_table(tmp_path / "o" / "calls.parquet")
    assert set(calls.op) == {"AllReduce"}
    assert list(zip(calls.line, calls.host)) == [(1, "node1"), (2, "node2")]
    unc = read_table(tmp_path / "o" / "unclassified.parquet")
    assert set(unc.line) == {2, 3}  # the cut head fragment and the orphan tail are both reported


def test_warn_lines_keep_host_pid_tid_and_device_in_every_version_form(tmp_path):
    (tmp_path / "w.log").write_text(
        "\nnode7:185303:186751 [1] transport/net_ib.cc:2453 NCCL WARN NET/IB : got completion with error\n"
        "\n[2026-03-03 12:11:38] node7:185303:186751 [1] transport/net_ib.cc:2453 NCCL WARN NET/IB : x\n"
        "\n[2026-03-03 12:11:38] node7:185303:186751 [1] transport/net_ib.cc:2453 (ncclIbTest) NCCL WARN y\n"
    )
    parse_logs([tmp_path / "w.log"], tmp_path / "o")
    w = read_table(tmp_path / "o" / "warnings.parquet")
    assert list(w.host) == ["node7"] * 3 and list(w.pid) == [185303] * 3 and list(w.tid) == [186751] * 3
    assert list(w.cuda_dev) == [1] * 3
    assert w.source.tolist()[:2] == ["transport/net_ib.cc:2453"] * 2 and "(ncclIbTest)" in w.source.iloc[2]
    assert pd.isna(w.wall_time_ns.iloc[0]) and pd.notna(w.wall_time_ns.iloc[1])


def test_a_host_whose_name_ends_like_another_host_keeps_its_name(tmp_path):
    (tmp_path / "h.log").write_text(
        f"worker-1:1:1 [0] NCCL INFO {CALL}\njob-worker-1:2:2 [0] NCCL INFO {CALL}\n"
    )
    parse_logs([tmp_path / "h.log"], tmp_path / "o")
    calls = read_table(tmp_path / "o" / "calls.parquet")
    assert list(calls.host) == ["worker-1", "job-worker-1"] and calls.recovery.isna().all()


@pytest.mark.parametrize("fast", [True, False])
def test_out_of_range_and_malformed_values_are_reported_not_wrapped(tmp_path, fast):
    big = CALL.replace("count 64", "count 18446744073709551615")
    bad_dtype = CALL.replace("datatype 7", "datatype 300")
    bad_ptr = CALL.replace("comm 0x55aa00", "comm 0xZZ")
    (tmp_path / "r.log").write_text(
        "".join(f"n:1:1 [0] NCCL INFO {c}\n" for c in (CALL, big, bad_dtype, bad_ptr, CALL))
    )
    report = parse_logs([tmp_path / "r.log"], tmp_path / "o", fast=fast)
    assert list(read_table(tmp_path / "o" / "calls.parquet").line) == [1, 5]
    unc = read_table(tmp_path / "o" / "unclassified.parquet")
    assert list(unc.line) == [2, 3, 4] and report.counts["malformed_call"] == 3
    assert not list((tmp_path / "o").glob(".*.tmp"))


def test_emulated_torn_stdout_yields_no_phantom_calls(tmp_path):
    """Every call recovered from a torn, interleaved stdout is one the emulated ranks really logged."""
    settings = {"model": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 2, "iterations": 2, "tp": 2,
                "nodes": 1, "gpus_per_node": 4, "nccl_version": "2.21.5", "nsys_version": "2022.4", "seed": 5,
                "precision": "bf16", "imperfections": {"torn_lines": 0.05}}
    result = emulate_run(settings, tmp_path / "raw")
    assert result.stdout_log is not None
    parse_logs([result.stdout_log], tmp_path / "o")
    calls = read_table(tmp_path / "o" / "calls.parquet")
    truth = read_table(result.ground_truth["ops"])
    keys = set(zip(truth.pid, truth.comm, truth.op_count, truth.op, truth["count"]))
    with_host = calls[calls.pid.notna()]
    got = set(zip(with_host.pid, with_host.comm, with_host.op_count, with_host.op, with_host["count"]))
    assert got <= keys
    assert set(calls.op) <= set(truth.op)
    assert len(calls) >= 0.9 * len(truth)


def test_ring_lines_drop_a_cut_rank_and_know_when_twenty_ranks_is_a_cut(tmp_path):
    ranks20 = "".join(f" {r:3d}" for r in range(20))
    (tmp_path / "r.log").write_text(
        "a:1:1 [0] NCCL INFO comm 0x10 rank 0 nRanks 24 nNodes 3 localRanks 8 localRank 0 MNNVL 0\n"
        f"a:1:1 [0] NCCL INFO Channel 00/02 : {ranks20}\n"
        "b:2:2 [0] NCCL INFO comm 0x20 rank 0 nRanks 20 nNodes 3 localRanks 8 localRank 0 MNNVL 0\n"
        f"b:2:2 [0] NCCL INFO Channel 00/02 : {ranks20}\n"
        "c:3:3 [0] NCCL INFO Channel 00/02 : 0 1 2 139 140 14...\n"
        "d:4:4 [0] NCCL INFO Channel 00 :    0   1\n"
    )
    parse_logs([tmp_path / "r.log"], tmp_path / "o")
    rings = read_table(tmp_path / "o" / "rings.parquet")
    assert list(rings.truncated) == [True, False, True, False]
    assert rings.ranks.iloc[2] == "0 1 2 139 140" and rings.ranks.iloc[3] == "0 1"
    assert pd.isna(rings.nchannels.iloc[3])


@pytest.mark.parametrize("fast", [True, False])
def test_tuning_lines_attach_only_to_calls_on_comms_where_the_process_is_rank_0(tmp_path, fast):
    p = "h:7:7 [0] NCCL INFO "
    ar = ("AllReduce: opCount {oc:x} sendbuff 0x10 recvbuff 0x10 count {n} datatype 7 op 0 root 0 comm {c} "
          "[nranks=2] stream 0x99")
    lines = [
        "NCCL version 2.21.5+cuda12.4",
        "ncclCommInitRank comm 0xa0 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 1a000 commId 0x1 - Init COMPLETE",
        "ncclCommInitRank comm 0xb0 rank 1 nranks 2 cudaDev 0 nvmlDev 0 busId 1a000 commId 0x2 - Init COMPLETE",
        ar.format(oc=5, n=512, c="0xa0"),  # line 4: grouped pair on A (2 x 2048 B) ...
        ar.format(oc=5, n=512, c="0xa0").replace("0x10", "0x20"),
        ar.format(oc=3, n=1024, c="0xb0"),  # line 6: 4096 B on B, where this process is rank 1
        "4096 Bytes -> Algo 1 proto 2 time 12.5",
        ar.format(oc=1, n=8, c="0xc0").replace("nranks=2", "nranks=1"),  # single-rank comm: no algorithm
        "32 Bytes -> Algo 1 proto 2 time 1.0",
    ]
    (tmp_path / "t.log").write_text("".join(f"{p}{x}\n" for x in lines))
    parse_logs([tmp_path / "t.log"], tmp_path / "o", fast=fast)
    t = read_table(tmp_path / "o" / "tuning.parquet")
    assert int(t.call_line.iloc[0]) == 4 and pd.isna(t.call_line.iloc[1])
    assert int(t.n_calls.iloc[0]) == 2


def test_a_lost_call_line_makes_the_result_partial_but_foreign_text_does_not(tmp_path):
    (tmp_path / "ok.log").write_text(f"n:1:1 [0] NCCL INFO {CALL}\nsome application output\n")
    assert not parse_logs([tmp_path / "ok.log"], tmp_path / "a").partial
    (tmp_path / "cut.log").write_text(f"n:1:1 [0] NCCL INFO {CALL}\nn:1:1 [0] NCCL INFO {CALL[:60]}\n")
    report = parse_logs([tmp_path / "cut.log"], tmp_path / "b")
    assert report.partial and report.counts["lost_records"] == 1


@pytest.mark.parametrize("fast", [True, False])
def test_record_glued_to_a_prefix_cut_inside_its_level_token_keeps_its_host(tmp_path, fast):
    (tmp_path / "g.log").write_text(
        f"node000:1:1 [0] NCCL INFO {CALL}\nnode000:1:1 [0] NCCL INFnode000:2:2 [1] NCCL INFO {CALL}\n"
    )
    parse_logs([tmp_path / "g.log"], tmp_path / "o", fast=fast)
    calls = read_table(tmp_path / "o" / "calls.parquet")
    assert list(zip(calls.host, calls.pid)) == [("node000", 1), ("node000", 2)]
    assert calls.recovery.iloc[1] == "host_suffix"


def test_stdout_tear_ground_truth_points_at_what_was_written(tmp_path):
    settings = {"model": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 2, "iterations": 2, "tp": 2,
                "nodes": 1, "gpus_per_node": 4, "nccl_version": "2.24.3", "seed": 9, "precision": "bf16",
                "imperfections": {"torn_lines": 0.1}}
    res = emulate_run(settings, tmp_path / "raw")
    tears = read_table(res.ground_truth["stdout_tears"])
    assert set(tears.kind) == {"torn", "glued"}
    out = res.stdout_log.read_text().split("\n")
    logs = {int(p.stem.split("_")[-1]): p.read_text().split("\n") for p in res.log_files}
    for row in tears.itertuples():
        original = logs[row.pid][row.log_line - 1]
        written = out[row.stdout_line - 1]
        if row.kind == "torn":  # head + the glued next record on this line, the tail on the next line
            tail = out[row.stdout_line]
            assert written.startswith(original[:10]) and tail and original.endswith(tail)
            assert written[: len(original) - len(tail)] == original[: len(original) - len(tail)]
        else:
            assert written.endswith(original)
