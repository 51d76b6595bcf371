"""emulate_run end to end: the files a real run leaves, consistent with the ground truth."""

from __future__ import annotations

import hashlib
import re
import sqlite3
from pathlib import Path

import pandas as pd
import pytest
import yaml

from nccltrace import __version__
from nccltrace.emulator import EmulatorConfig, emulate_run
from nccltrace.emulator.run import nccl_kernel_name
from nccltrace.nccl.versions import NcclVersion

SMALL = {
    "name": "small", "tp": 2, "pp": 2, "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
    "seq_length": 256, "micro_batch_size": 1, "global_batch_size": 4, "iterations": 2, "vocab_size": 1000,
}  # fmt: skip
CALL_RE = re.compile(r" NCCL INFO (\w+): opCount ([0-9a-f]+) .* count (\d+) datatype (\d+) op (\d+) root (\d+) "
                     r"comm (0x[0-9a-f]+) \[nranks=(\d+)\]")  # fmt: skip


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("small")
    return emulate_run(SMALL, out)


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def test_layout_of_outputs(small_run):
    out = small_run.out_dir
    logs = sorted((out / "nccl").glob("nccl_*.log"))
    assert len(logs) == 4 and logs == sorted(small_run.log_files)
    assert all(re.fullmatch(r"nccl_node000_\d+\.log", p.name) for p in logs)
    assert [p.name for p in (out / "nsys").iterdir()] == ["node000.sqlite"]
    for name in ("ops", "kernels", "communicators", "clock"):
        assert (out / "ground_truth" / f"{name}.parquet").is_file()
    assert not list(out.rglob("*.tmp")) and not (out / "stdout.log").exists()
    meta = yaml.safe_load((out / "run.yaml").read_text())
    assert meta["nccltrace_version"] == __version__ and meta["run_id"] == "small_tp2_pp2_ep1_cp1_vpp1_sp0_dp1"
    assert EmulatorConfig.from_dict(meta["config"]) == EmulatorConfig.from_dict(SMALL)
    assert meta["derived"]["num_microbatches"] == 4 and meta["derived"]["hosts"] == ["node000"]


def test_call_lines_match_ground_truth_rows(small_run):
    ops = pd.read_parquet(small_run.ground_truth["ops"])
    assert len(ops) == small_run.n_ops == small_run.n_call_lines
    for log in small_run.log_files:
        lines = log.read_text().splitlines()
        calls = [(i + 1, m) for i, line in enumerate(lines) if (m := CALL_RE.search(line))]
        rows = ops[ops.log_file == f"nccl/{log.name}"].sort_values("log_line")
        assert len(calls) == len(rows) > 0
        for (lineno, m), row in zip(calls, rows.itertuples()):
            assert lineno == row.log_line
            assert (m[1], int(m[2], 16), int(m[3]), int(m[4]), int(m[5]), int(m[6]), int(m[7], 16), int(m[8])) == (
                row.op, row.op_count, row.count, row.dtype, row.redop, row.root, row.comm, row.nranks)


def test_nsys_export_is_readable_and_matches_kernels(small_run):
    kernels = pd.read_parquet(small_run.ground_truth["kernels"])
    ops = pd.read_parquet(small_run.ground_truth["ops"])
    con = sqlite3.connect(small_run.nsys_files[0])
    assert con.execute("select value from META_DATA_EXPORT where name='EXPORT_SCHEMA_VERSION'").fetchone()[0] == "3.16.1"
    assert con.execute("select value from TARGET_INFO_SYSTEM_ENV where name='Hostname'").fetchone()[0] == "node000"
    k = pd.read_sql(
        "select k.correlationId cid, (k.globalPid >> 24) & 16777215 pid, k.start, k.end, s.value name, "
        "r.start api_start, r.end api_end, rn.value api from CUPTI_ACTIVITY_KIND_KERNEL k "
        "join StringIds s on s.id = k.demangledName join CUPTI_ACTIVITY_KIND_RUNTIME r "
        "on r.correlationId = k.correlationId and (r.globalTid & -16777216) = k.globalPid "
        "join StringIds rn on rn.id = r.nameId where s.value like 'nccl%'", con)  # fmt: skip
    assert len(k) == len(kernels) == small_run.n_kernels
    assert set(k.api) == {"cudaLaunchKernelExC_v11060"} and (k.start > k.api_end).all()  # NCCL 2.21 default
    assert set(zip(ops.pid, ops.kernel_correlation_id.astype(int))) == set(zip(k.pid, k.cid))
    merged = kernels.merge(k, left_on=["pid", "correlation_id"], right_on=["pid", "cid"])
    assert (merged.start_x == merged.start_y).all() and (merged.name_x == merged.name_y).all()
    nvtx = pd.read_sql("select e.start, e.end, e.domainId, e.eventType, coalesce(e.text, s.value) text, "
                       "(e.globalTid >> 24) & 16777215 pid from NVTX_EVENTS e left join StringIds s "
                       "on s.id = e.textId", con)  # fmt: skip
    assert (nvtx.text == "NCCL").sum() == 4  # one NCCL domain per process
    iters = nvtx[nvtx.text.str.startswith("iteration ")]
    assert len(iters) == 4 * SMALL["iterations"] and (iters.domainId == 0).all()
    nccl_ranges = nvtx[(nvtx.domainId > 0) & nvtx.text.str.startswith("ncclAllReduce")]
    assert len(nccl_ranges) == (ops.op == "AllReduce").sum()


def test_collective_kernels_end_together_and_p2p_is_fused_or_not(small_run):
    ops = pd.read_parquet(small_run.ground_truth["ops"])
    kernels = pd.read_parquet(small_run.ground_truth["kernels"])
    k = ops.merge(kernels[["pid", "correlation_id", "start_true_ns", "end_true_ns"]],
                  left_on=["pid", "kernel_correlation_id"], right_on=["pid", "correlation_id"])  # fmt: skip
    coll = k[~k.op.isin(["Send", "Recv"])]
    spread = coll.groupby("instance_id").end_true_ns.agg(lambda s: s.max() - s.min())
    assert spread.max() == 0  # no arrival skew configured: identical ends
    # default (fuse off): one kernel per logged op
    assert kernels.n_ops.max() == 1 and len(kernels) == len(ops)
    # kernels on one stream never overlap
    ks = kernels.sort_values(["pid", "stream_id", "start_true_ns"])
    prev_end = ks.groupby(["pid", "stream_id"]).end_true_ns.shift()
    assert not (ks.start_true_ns < prev_end).any()


def test_communicators_match_init_lines(small_run):
    comms = pd.read_parquet(small_run.ground_truth["communicators"])
    for log in small_run.log_files:
        text = log.read_text()
        pid = int(log.stem.split("_")[-1])
        mine = comms[comms.pid == pid]
        assert len(mine) > 0
        for row in mine.itertuples():
            assert f"comm 0x{row.comm:x} rank {row.rank_in_comm} nranks {row.nranks} " in text
            assert f"commId 0x{row.comm_id_logged:x} - Init COMPLETE" in text
            assert len(row.members) == row.nranks
    world = comms[comms.group_kind == "world"]
    assert world.comm_hash.nunique() == 1 and len(world) == 4


def test_determinism_same_seed_identical_bytes(tmp_path):
    cfg = {**SMALL, "iterations": 1, "imperfections": {"arrival_skew_ns_max": 10_000, "fuse_grouped_p2p": True,
                                                       "clock_offset_ns_max": 1000}}  # fmt: skip
    a = _files(emulate_run(cfg, tmp_path / "a").out_dir)
    b = _files(emulate_run(cfg, tmp_path / "b").out_dir)
    assert a == b and len(a) == 10
    c = emulate_run({**cfg, "seed": 7}, tmp_path / "c")
    assert set(_files(c.out_dir)) != set(a)  # other pids -> other log file names


def test_nodes_emulated_in_parallel_processes_give_the_serial_output(tmp_path):
    cfg = {**SMALL, "nodes": 2, "gpus_per_node": 2, "iterations": 1,
           "imperfections": {"fuse_grouped_p2p": True, "clock_offset_ns_max": 1000, "torn_lines": 0.05}}  # fmt: skip
    serial = emulate_run(cfg, tmp_path / "serial")
    parallel = emulate_run(cfg, tmp_path / "parallel", workers=2)
    a, b = _files(serial.out_dir), _files(parallel.out_dir)
    assert set(a) == set(b) and not any(".parts" in k for k in b)
    for name in a:
        if name.endswith(".parquet"):  # row groups may differ; the rows may not
            assert pd.read_parquet(serial.out_dir / name).equals(pd.read_parquet(parallel.out_dir / name)), name
        else:
            assert a[name] == b[name], name
    assert (parallel.n_ops, parallel.n_kernels, parallel.op_counts) == (serial.n_ops, serial.n_kernels,
                                                                        serial.op_counts)  # fmt: skip


def test_split_init_and_new_versions(tmp_path):
    res = emulate_run({**SMALL, "iterations": 1, "nodes": 2, "gpus_per_node": 2, "init_style": "split",
                       "nccl_version": "2.28.9", "nsys_version": "2026.4", "nvtx_payloads": "dynamic",
                       "nccl_timestamps": True}, tmp_path)  # fmt: skip
    assert sorted(p.name for p in res.nsys_files) == ["node000.sqlite", "node001.sqlite"]
    text = res.log_files[0].read_text()
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] node000:\d+:\d+ \[0\] NCCL INFO NCCL version 2\.28\.9",
                     text, re.M)  # fmt: skip
    assert "ncclCommSplit comm 0x" in text and "splitCount 1 color" in text
    assert "ncclDevKernel" not in text
    comms = pd.read_parquet(res.ground_truth["communicators"])
    split = comms[comms.init_api == "ncclCommSplit"]
    assert len(split) > 0 and split.comm_id_logged.isna().all()
    for (_kind, _idx), g in split.groupby(["group_kind", "group_index"]):
        assert g.color.nunique() == 1  # members of one communicator share the split color
    con = sqlite3.connect(res.nsys_files[0])
    tables = {r[0] for r in con.execute("select name from sqlite_master")}
    assert any(t.startswith("DYNAMIC_NVTXPAYLOAD_DATATYPE_") for t in tables)


@pytest.mark.parametrize(
    "version, family, dtype, redop, expected",
    [
        ("2.18.3", "AllReduce", 6, 0, "ncclKernel_AllReduce_RING_LL_Sum_half(ncclDevComm*, unsigned long, ncclWork*)"),
        ("2.18.3", "SendRecv", 6, 0, "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"),
        ("2.21.5", "ReduceScatter", 9, 0, "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"),
        ("2.24.3", "AllGather", 6, 0, "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"),
        ("2.24.3", "AllReduce", 7, 2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"),
        ("2.28.9", "AlltoAll", 9, 0, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"),
    ],
)
def test_kernel_names_by_nccl_version(version, family, dtype, redop, expected):
    name, short = nccl_kernel_name(NcclVersion.parse(version), family, dtype, redop, "RING")
    assert name == expected and name.startswith(short)


def test_64_rank_run(tmp_path):
    res = emulate_run({
        "name": "tiny", "nodes": 8, "gpus_per_node": 8, "tp": 2, "pp": 4, "num_layers": 4, "hidden_size": 64,
        "num_attention_heads": 8, "seq_length": 128, "micro_batch_size": 1, "global_batch_size": 16,
        "iterations": 1, "sequence_parallel": True, "vocab_size": 1000, "compute_kernels": False,
    }, tmp_path)  # fmt: skip
    assert len(res.log_files) == 64 and len(res.nsys_files) == 8
    ops = pd.read_parquet(res.ground_truth["ops"], columns=["rank", "log_line"])
    assert ops["rank"].nunique() == 64 and ops.log_line.notna().all()
    con = sqlite3.connect(res.nsys_files[3])
    assert con.execute("select count(distinct globalPid) from CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0] == 8


@pytest.mark.parametrize("version, cuda, api, event_class", [("2.18.3", "12.1", "cudaLaunchKernelExC_v11060", 0),
                                                             ("2.21.5", "11.8", "cudaLaunchKernelExC_v11060", 0),
                                                             ("2.21.5", "11.7", "cudaLaunchKernel_v7000", 0),
                                                             ("2.24.3", "12.4", "cuLaunchKernelEx", 1),
                                                             ("2.24.3", "11.7", "cuLaunchKernel", 1)])  # fmt: skip
def test_launch_api_by_stack(tmp_path, version, cuda, api, event_class):
    res = emulate_run({"iterations": 1, "num_layers": 2, "nccl_version": version, "cuda_version": cuda,
                       "compute_kernels": False}, tmp_path)  # fmt: skip
    con = sqlite3.connect(res.nsys_files[0])
    rows = set(con.execute("select s.value, r.eventClass from CUPTI_ACTIVITY_KIND_RUNTIME r "
                           "join StringIds s on s.id = r.nameId"))  # fmt: skip
    assert rows == {(api, event_class)}
    assert f"+cuda{cuda}" in res.log_files[0].read_text()


def test_rerun_into_the_same_directory_leaves_one_run(tmp_path):
    a = emulate_run({"iterations": 1, "num_layers": 2, "imperfections": {"torn_lines": 0.1}}, tmp_path)
    b = emulate_run({"iterations": 1, "num_layers": 2, "nodes": 1, "gpus_per_node": 2, "seed": 3}, tmp_path)
    assert sorted((tmp_path / "nccl").glob("*.log")) == sorted(b.log_files) and len(b.log_files) == 2
    assert a.stdout_log is not None and not (tmp_path / "stdout.log").exists()


def test_split_lines_agree_across_the_members_of_each_communicator(tmp_path):
    res = emulate_run({**SMALL, "iterations": 1, "nodes": 2, "gpus_per_node": 2, "pp": 2, "init_style": "split",
                       "nccl_version": "2.24.3"}, tmp_path)  # fmt: skip
    comms = pd.read_parquet(res.ground_truth["communicators"])
    split = comms[comms.init_api == "ncclCommSplit"]
    for _, g in split.groupby("comm_uid"):
        assert g.split_count.nunique() == 1 and g.color.nunique() == 1
        assert sorted(g.key) == sorted(g.rank_in_comm) == list(range(len(g)))


def test_opcount_from_2_27_3_counts_only_plans_with_network_work(tmp_path):
    cfg = {**SMALL, "tp": 1, "pp": 4, "iterations": 1, "nodes": 2, "gpus_per_node": 2, "global_batch_size": 8,
           "nccl_version": "2.27.3"}
    ops = pd.read_parquet(emulate_run(cfg, tmp_path / "a").ground_truth["ops"])
    p2p = ops[ops.op.isin(["Send", "Recv"])]
    intra = p2p[(p2p.peer_global // 2) == (p2p["rank"] // 2)]
    inter = p2p[(p2p.peer_global // 2) != (p2p["rank"] // 2)]
    assert len(intra) and len(inter)
    # rank 0's pipeline peer (rank 1) is on its own node: its P2P plans never advance opCount
    r0 = p2p[(p2p["rank"] == 0)]
    assert (r0.peer_global // 2 == 0).all() and set(r0.op_count) == {0}
    assert inter.op_count.max() > 0
    old = pd.read_parquet(emulate_run({**cfg, "nccl_version": "2.26.2"}, tmp_path / "b").ground_truth["ops"])
    assert old[(old["rank"] == 0) & old.op.isin(["Send", "Recv"])].op_count.max() > 0
