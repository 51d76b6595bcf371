"""Every imperfection knob has an observable effect on the outputs and is recorded in ground truth."""

from __future__ import annotations

import re
import sqlite3

import pandas as pd
import pytest

from nccltrace.emulator import emulate_run

BASE = {
    "name": "imp", "nodes": 2, "gpus_per_node": 2, "tp": 2, "pp": 2, "num_layers": 4, "hidden_size": 128,
    "num_attention_heads": 4, "seq_length": 256, "micro_batch_size": 1, "global_batch_size": 4, "iterations": 1,
    "vocab_size": 1000,
}  # fmt: skip
CALL = re.compile(r" NCCL INFO \w+: opCount ")


def run(tmp_path, name, **imp):
    return emulate_run({**BASE, "imperfections": imp}, tmp_path / name)


def gt(res, name):
    return pd.read_parquet(res.ground_truth[name])


def call_lines(log):
    return [line for line in log.read_text().splitlines() if CALL.search(line)]


def nsys_nccl_kernels(res) -> pd.DataFrame:
    frames = []
    for f in res.nsys_files:
        con = sqlite3.connect(f)
        frames.append(pd.read_sql(
            "select (k.globalPid >> 24) & 16777215 pid, k.correlationId cid, k.start, k.end, s.value name "
            "from CUPTI_ACTIVITY_KIND_KERNEL k join StringIds s on s.id = k.shortName where s.value like 'nccl%'",
            con))  # fmt: skip
    return pd.concat(frames, ignore_index=True)


@pytest.fixture(scope="module")
def ideal(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ideal"), "ideal")


def test_ideal_run_has_no_imperfections(ideal):
    ops, kernels = gt(ideal, "ops"), gt(ideal, "kernels")
    flags = ["line_dropped", "line_duplicated", "line_torn_in_stdout", "kernel_dropped", "single_rank_no_kernel"]
    assert not ops[flags].any().any() and not kernels[["dropped", "without_log"]].any().any()
    assert (ops.nranks > 1).all() and ops.kernel_correlation_id.notna().all()
    assert len(kernels) == len(ops) == len(nsys_nccl_kernels(ideal))
    assert (gt(ideal, "clock")[["offset_ns", "drift_ppm"]] == 0).all().all()
    assert ideal.stdout_log is None


def test_fuse_grouped_p2p(tmp_path, ideal):
    res = run(tmp_path, "fuse", fuse_grouped_p2p=True)
    ops, kernels = gt(res, "ops"), gt(res, "kernels")
    grouped_p2p = ops[ops.grouped & ops.op.isin(["Send", "Recv"])]
    assert len(grouped_p2p) > 0
    assert len(kernels) < len(gt(ideal, "kernels")) and len(ops) == len(gt(ideal, "ops"))
    multi = kernels[kernels.n_ops > 1]
    assert len(multi) > 0 and set(multi.short_name) == {"ncclDevKernel_SendRecv"}
    fused = ops[ops.kernel_fused]
    assert fused.groupby(["pid", "kernel_correlation_id"]).size().min() == 2
    assert set(nsys_nccl_kernels(ideal).name) >= {"ncclDevKernel_SendRecv"}


def test_duplicate_log_lines(tmp_path, ideal):
    res = run(tmp_path, "dup", duplicate_log_lines={"ranks": [1], "fraction": 1.0})
    ops = gt(res, "ops")
    pid1 = ops[ops["rank"] == 1].pid.iloc[0]
    for log in res.log_files:
        lines = call_lines(log)
        n = (ops.log_file == f"nccl/{log.name}").sum()
        if log.name.endswith(f"_{pid1}.log"):
            assert len(lines) == 2 * n
            text = log.read_text().splitlines()
            r = ops[ops["rank"] == 1].iloc[5]
            line, dup = int(r.log_line), int(r.duplicate_line)
            assert text[line - 1] == text[dup - 1] and dup == line + 1
        else:
            assert len(lines) == n
    assert ops[ops["rank"] == 1].line_duplicated.all() and not ops[ops["rank"] != 1].line_duplicated.any()
    assert len(gt(res, "kernels")) == len(gt(ideal, "kernels"))


def test_drop_log_lines(tmp_path):
    res = run(tmp_path, "droplines", drop_log_lines=0.3)
    ops = gt(res, "ops")
    dropped = ops[ops.line_dropped]
    assert 0.2 * len(ops) < len(dropped) < 0.4 * len(ops)
    assert dropped.log_line.isna().all() and dropped.kernel_correlation_id.notna().all()
    assert sum(len(call_lines(p)) for p in res.log_files) == len(ops) - len(dropped)
    assert len(nsys_nccl_kernels(res)) == len(ops)  # kernels still ran


def test_drop_kernels(tmp_path):
    res = run(tmp_path, "dropk", drop_kernels=0.25)
    ops, kernels = gt(res, "ops"), gt(res, "kernels")
    in_nsys = nsys_nccl_kernels(res)
    assert kernels.dropped.sum() > 0 and len(in_nsys) == (~kernels.dropped).sum()
    gone = kernels[kernels.dropped]
    present = set(zip(in_nsys.pid, in_nsys.cid))
    assert not any((p, c) in present for p, c in zip(gone.pid, gone.correlation_id))
    assert ops.kernel_dropped.sum() == gone.n_ops.sum()
    # the launch call is still recorded for a dropped kernel
    con = sqlite3.connect(res.nsys_files[0])
    row = gone[gone.host == "node000"].iloc[0]
    n = con.execute("select count(*) from CUPTI_ACTIVITY_KIND_RUNTIME where correlationId = ? and "
                    "(globalTid >> 24) & 16777215 = ?", (int(row.correlation_id), int(row.pid))).fetchone()[0]  # fmt: skip
    assert n == 1


def test_single_rank_comm_ops(tmp_path):
    res = run(tmp_path, "single", single_rank_comm_ops=-1)
    ops = gt(res, "ops")
    single = ops[ops.nranks == 1]
    assert len(single) > 0 and single.single_rank_no_kernel.all() and single.kernel_correlation_id.isna().all()
    assert set(single.group_kind) == {"dp-cp"}  # grad all-reduce and loss reduction with dp = 1
    assert (single.op_count == 0).all()
    text = res.log_files[0].read_text()
    assert "[nranks=1]" in text and re.search(r"rank 0 nranks 1 cudaDev \d+ nvmlDev \d+ .* Init COMPLETE", text)
    assert len(gt(res, "kernels")) == (ops.nranks > 1).sum()
    res3 = run(tmp_path, "single3", single_rank_comm_ops=1)
    available = single.groupby("rank").size()
    got = gt(res3, "ops").groupby("rank").single_rank_no_kernel.sum()
    assert (got == available.clip(upper=1)).all() and available.max() > 1


def test_kernels_without_log(tmp_path):
    res = run(tmp_path, "nolog", kernels_without_log=0.5)
    ops, kernels = gt(res, "ops"), gt(res, "kernels")
    extra = kernels[kernels.without_log]
    assert len(extra) > 5 and (extra.n_ops == 0).all()
    in_nsys = nsys_nccl_kernels(res)
    keys = set(zip(in_nsys.pid, in_nsys.cid))
    assert all((p, c) in keys for p, c in zip(extra.pid, extra.correlation_id))
    assert not set(zip(extra.pid, extra.correlation_id)) & set(zip(ops.pid, ops.kernel_correlation_id))
    assert len(in_nsys) == len(ops) + len(extra)


def test_clock_offset_and_drift(tmp_path):
    res = run(tmp_path, "clock", clock_offset_ns_max=5_000_000, clock_drift_ppm_max=20.0)
    clock = gt(res, "clock")
    assert len(clock) == 2 and clock.offset_ns.abs().max() > 0 and clock.drift_ppm.abs().max() > 0
    ops, kernels = gt(res, "ops"), gt(res, "kernels")
    k = ops.merge(kernels[["pid", "correlation_id", "end", "end_true_ns", "host"]],
                  left_on=["pid", "kernel_correlation_id"], right_on=["pid", "correlation_id"])  # fmt: skip
    sess = dict(zip(clock.host, clock.session_start_utc_ns))
    k["end_utc"] = k.end + k.host_y.map(sess)
    world = k[k.group_kind == "world"]
    inst = world.groupby("instance_id")
    # true ends agree; the clocks the files show differ by the nodes' offset (+ drift)
    assert (inst.end_true_ns.agg(lambda s: s.max() - s.min()) == 0).all()
    d_off = abs(clock.offset_ns.iloc[1] - clock.offset_ns.iloc[0])
    spread = inst.end_utc.agg(lambda s: s.max() - s.min())
    assert (spread - d_off).abs().max() < 200_000  # offset difference plus < 0.2 ms drift over the run
    wall = ops.groupby("host").apply(lambda g: (g.wall_ns - g.call_time_true_ns).median(), include_groups=False)
    assert abs((wall.iloc[1] - wall.iloc[0]) - (clock.offset_ns.iloc[1] - clock.offset_ns.iloc[0])) < 200_000


def test_arrival_skew(tmp_path, ideal):
    res = run(tmp_path, "skew", arrival_skew_ns_max=40_000)
    ops, kernels = gt(res, "ops"), gt(res, "kernels")
    k = ops.merge(kernels[["pid", "correlation_id", "start_true_ns", "end_true_ns"]],
                  left_on=["pid", "kernel_correlation_id"], right_on=["pid", "correlation_id"])  # fmt: skip
    coll = k[~k.op.isin(["Send", "Recv"])].groupby("instance_id")
    start_spread = coll.start_true_ns.agg(lambda s: s.max() - s.min())
    end_spread = coll.end_true_ns.agg(lambda s: s.max() - s.min())
    assert start_spread.max() > 5_000 and start_spread.median() > 1_000
    assert end_spread.max() <= 1_000  # ends together within ~1 us


def test_torn_lines_in_combined_stdout(tmp_path, ideal):
    res = run(tmp_path, "torn", torn_lines=0.2)
    assert res.stdout_log is not None and res.stdout_log.is_file()
    ops = gt(res, "ops")
    torn = ops[ops.line_torn_in_stdout]
    assert 0.1 * len(ops) < len(torn) < 0.3 * len(ops)
    stdout = res.stdout_log.read_text().splitlines()
    per_process = sum(len(p.read_text().splitlines()) for p in res.log_files)
    assert len(stdout) == per_process  # every line is there, torn ones in two pieces
    intact = set(stdout)
    logs = {f"nccl/{p.name}": p.read_text().splitlines() for p in res.log_files}
    for row in torn.head(20).itertuples():
        line = logs[row.log_file][row.log_line - 1]
        assert line not in intact
        assert any(s.endswith(line[-15:]) for s in stdout) and any(line[:10] in s for s in stdout)
    # per-process files are unaffected (unbuffered NCCL_DEBUG_FILE)
    assert sum(len(call_lines(p)) for p in res.log_files) == len(ops)
