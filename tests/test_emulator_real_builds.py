"""Emulator options that make captures look like real builds (docs/emulator.md sections 4.1, 4.2):
CUDA graphs (calls captured once, kernels replayed under cudaGraphLaunch) and the kernel names
of real NCCL builds (collectives in SendRecv kernels, symmetric-memory kernels, per-algorithm
names). Everything is checked through the project's real readers (NsysExport, parse_logs)."""

from __future__ import annotations

import hashlib
import re
import sqlite3
from pathlib import Path

import pandas as pd
import pytest
import yaml
from data_paths import NSYS_SQLITE

from nccltrace.emulator import ConfigError, EmulatorConfig, emulate_run
from nccltrace.emulator.run import symmetric_kernel
from nccltrace.nccl.log_reader import parse_logs
from nccltrace.nsys.reader import NsysExport
from nccltrace.nsys.writer import NsysExportWriter

# 4 GPUs, TP2 x PP2, 2 layers per stage, 4 microbatches (1F1B: two forwards in flight on stage 0),
# sequence parallel (AllGather/ReduceScatter in the layers), 3 iterations.
BASE = {
    "name": "rb", "tp": 2, "pp": 2, "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
    "seq_length": 256, "micro_batch_size": 1, "global_batch_size": 4, "iterations": 3, "vocab_size": 1000,
    "sequence_parallel": True, "nccl_version": "2.28.9", "nsys_version": "2026.4",
}  # fmt: skip
GRAPHS = {"parallelism": ["tp"], "warmup_iterations": 1}
REAL_EXPORT = NSYS_SQLITE / "nsysai_mfu_2gpu_before.sqlite"


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def _exports(res) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """All kernels (NCCL and compute), runtime rows and launches without kernel of every export."""
    ks, rts, lost = [], [], []
    for path in res.nsys_files:
        with NsysExport.open(path) as x:
            ks.append(x.kernels(None))
            rts.append(x.runtime())
            lost.append(x.launches_without_kernel())
    return pd.concat(ks, ignore_index=True), pd.concat(rts, ignore_index=True), pd.concat(lost, ignore_index=True)


def _calls(res, out: Path) -> pd.DataFrame:
    parse_logs(res.log_files, out)
    return pd.read_parquet(out / "calls.parquet")


@pytest.fixture(scope="module")
def graph_run(tmp_path_factory):
    return emulate_run({**BASE, "cuda_graphs": GRAPHS}, tmp_path_factory.mktemp("graphs"))


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    return emulate_run(BASE, tmp_path_factory.mktemp("eager"))


# --------------------------------------------------------------------------- CUDA graphs


def test_replayed_kernels_carry_graph_ids_and_share_the_graph_launch(graph_run):
    kernels, runtime, _ = _exports(graph_run)
    nccl = kernels[kernels.short_name.str.startswith("nccl")]
    graphed = nccl[nccl.graph_id.notna()]
    eager = nccl[nccl.graph_id.isna()]
    assert len(graphed) > 0 and len(eager) > 0
    assert graphed.graph_node_id.notna().all() and eager.graph_node_id.isna().all()
    assert (graphed.launch_api == "cudaGraphLaunch").all()
    assert eager.launch_api.isin(["cuLaunchKernelEx"]).all()
    launches = runtime[runtime.name == "cudaGraphLaunch_v10000"]
    assert (launches.event_class == 0).all()
    # one cudaGraphLaunch per replay; every kernel of a replay has its correlation id, one graph id,
    # distinct node ids, and starts after the launch call
    per_replay = graphed.groupby(["pid", "correlation_id"])
    assert (per_replay.graph_id.nunique() == 1).all()
    assert (per_replay.graph_node_id.nunique() == per_replay.size()).all()
    assert per_replay.ngroups == len(launches) == len(launches.drop_duplicates(["pid", "correlation_id"]))
    start = launches.set_index(["pid", "correlation_id"]).start
    first = per_replay.start.min()
    assert (first > start.loc[first.index]).all()
    # a replay runs the graph's NCCL kernels, always the same node ids
    nodes = graphed.groupby(["pid", "graph_id", "correlation_id"]).graph_node_id.apply(lambda s: tuple(sorted(s)))
    assert (nodes.groupby(level=[0, 1]).nunique() == 1).all()


def test_captured_calls_are_logged_once(graph_run, eager_run, tmp_path):
    gt_g = pd.read_parquet(graph_run.ground_truth["ops"])
    gt_k = pd.read_parquet(graph_run.ground_truth["kernels"])
    calls_g = _calls(graph_run, tmp_path / "g")
    calls_e = _calls(eager_run, tmp_path / "e")
    assert len(calls_g) == len(gt_g) == graph_run.n_call_lines
    replayed = gt_k.graph_id.notna()
    captured = gt_g.graph_captured
    assert captured.sum() > 0
    # the eager run logs every graphed call every iteration; with graphs each captured call has
    # one line and its replays none (TP calls are one per kernel here)
    assert len(calls_e) - len(calls_g) == replayed.sum() - captured.sum() > 0
    # captured lines are written once: no line after the capture for a layer pass on the TP comm
    w = GRAPHS["warmup_iterations"]
    later = gt_g[(gt_g.iteration > w) & gt_g.phase.str.match(r"^fwd/(attention|mlp)$|^bwd/(attention|mlp)$")]
    assert later.empty
    cap = gt_g[captured]
    assert (cap.iteration == w).all() and cap.kernel_correlation_id.isna().all()
    assert (cap.groupby(["rank", "graph_id"]).graph_node_id.nunique() == cap.groupby(["rank", "graph_id"]).size()).all()
    # each captured line is a call line of that op in the real log
    by_line = calls_g.set_index(["file", "line"])
    for row in cap.itertuples():
        hit = by_line.loc[(row.log_file.split("/")[-1], row.log_line)]
        assert hit.op == row.op and hit["count"] == row.count


def test_ground_truth_replays_point_to_captured_calls(graph_run):
    ops = pd.read_parquet(graph_run.ground_truth["ops"])
    k = pd.read_parquet(graph_run.ground_truth["kernels"])
    rep = k[k.graph_id.notna()]
    cap = ops[ops.graph_captured].set_index(["rank", "seq"])
    # every replayed kernel points to a captured call of its rank, in the same graph and node
    target = cap.loc[list(zip(rep["rank"], rep.replay_of_seq))]
    assert (target.graph_id.to_numpy() == rep.graph_id.to_numpy()).all()
    assert (target.graph_node_id.to_numpy() == rep.graph_node_id.to_numpy()).all()
    assert (target.log_line.to_numpy() == rep.replay_of_log_line.to_numpy()).all()
    assert (target.op.to_numpy() == rep.family.to_numpy()).all()
    assert (rep.first_seq == rep.replay_of_seq).all()
    # replays are numbered 0.. per graph and share one correlation id each
    for (_rank, _gid), g in rep.groupby(["rank", "graph_id"]):
        assert sorted(g.graph_replay.unique()) == list(range(g.graph_replay.nunique()))
        assert (g.groupby("graph_replay").correlation_id.nunique() == 1).all()
        assert g.groupby("correlation_id").graph_replay.nunique().eq(1).all()
    # the capture iteration replays too; warm-up iterations run eagerly (no graph kernels)
    assert set(rep.iteration) == set(range(GRAPHS["warmup_iterations"], BASE["iterations"]))
    warm = k[k.iteration < GRAPHS["warmup_iterations"]]
    assert warm.graph_id.isna().all() and len(warm) > 0
    warm_ops = ops[(ops.iteration < GRAPHS["warmup_iterations"]) & ops.phase.str.startswith("fwd/attention")]
    assert len(warm_ops) > 0 and warm_ops.log_line.notna().all() and not warm_ops.graph_captured.any()
    # stage 0 keeps two forwards in flight (1F1B warm-up): two runners per layer, each replayed
    # twice per iteration; stage 1 has one runner per layer replayed four times
    fwd = rep[rep["rank"] == 0].merge(ops[ops["rank"] == 0][["seq", "phase"]], left_on="replay_of_seq",
                                      right_on="seq")  # fmt: skip
    n_fwd_graphs = fwd[fwd.phase.str.startswith("fwd/")].graph_id.nunique()
    assert n_fwd_graphs == 4


def test_capture_time_launch_records(graph_run, tmp_path):
    ops = pd.read_parquet(graph_run.ground_truth["ops"])
    _, runtime, lost = _exports(graph_run)
    cap = ops[ops.graph_captured]
    # NCCL's launch call on the capturing stream is traced: a launch without kernel per captured kernel
    assert cap.capture_launch_correlation_id.notna().all()
    keys = set(zip(lost.pid, lost.correlation_id))
    assert len(lost) == len(keys) == len(cap) > 0  # one op per captured TP kernel here
    assert set(zip(cap.pid, cap.capture_launch_correlation_id.astype(int))) == keys
    assert {"cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiateWithFlags"} <= set(runtime.api)
    off = emulate_run({**BASE, "cuda_graphs": {**GRAPHS, "capture_launch_records": False}}, tmp_path / "off")
    ops_off = pd.read_parquet(off.ground_truth["ops"])
    assert ops_off.capture_launch_correlation_id.isna().all() and ops_off.graph_captured.sum() == len(cap)
    assert _exports(off)[2].empty


@pytest.mark.filterwarnings("ignore::nccltrace.nsys.reader.NsysSchemaWarning")  # the real export is schema 3.25.0
def test_graphs_on_older_schema_and_real_export(tmp_path):
    res = emulate_run({**BASE, "nsys_version": "2024.6", "nccl_version": "2.21.5", "cuda_graphs": GRAPHS}, tmp_path)
    kernels, _, _ = _exports(res)
    graphed = kernels[kernels.launch_api == "cudaGraphLaunch"]
    assert len(graphed) > 0 and graphed.graph_node_id.notna().all()
    assert kernels.graph_id.isna().all()  # export schema 3.16.1 has no graphId column
    assert str(kernels.graph_id.dtype) == "Int64" and str(kernels.graph_node_id.dtype) == "Int64"
    # a real nsys 2026.2 export without CUDA graphs: columns present, all NULL
    with NsysExport.open(REAL_EXPORT) as x:
        real = x.kernels(None)
    assert len(real) > 0 and real.graph_id.isna().all() and real.graph_node_id.isna().all()


def test_reader_graph_columns_from_written_export(tmp_path):
    path = tmp_path / "x.sqlite"
    base = dict(device_id=0, context_id=1, stream_id=7, pid=100, name="ncclDevKernel_SendRecv(x)",
                short_name="ncclDevKernel_SendRecv", grid_x=1, grid_y=1, grid_z=1, block_x=512, block_y=1, block_z=1,
                registers_per_thread=96, static_shared_memory=0, dynamic_shared_memory=0)  # fmt: skip
    with NsysExportWriter(path, "3.28.1", hostname="h", session_start_utc_ns=0) as w:
        w.add_process(100, "python3")
        w.add_runtime(pd.DataFrame([{"start": 1, "end": 5, "pid": 100, "tid": 100, "correlation_id": 9,
                                     "name": "cudaGraphLaunch_v10000", "event_class": 0}]))  # fmt: skip
        w.add_kernels(pd.DataFrame([
            {**base, "start": 10, "end": 20, "correlation_id": 9, "graph_id": 3, "graph_node_id": 7},
            {**base, "start": 30, "end": 40, "correlation_id": 9, "graph_id": 3, "graph_node_id": 8},
            {**base, "start": 50, "end": 60, "correlation_id": 11, "graph_id": 0, "graph_node_id": 0},
            {**base, "start": 70, "end": 80, "correlation_id": 12, "graph_id": None, "graph_node_id": None},
        ]))  # fmt: skip
    con = sqlite3.connect(path)
    assert con.execute("select graphId, graphNodeId from CUPTI_ACTIVITY_KIND_KERNEL order by start").fetchall() == [
        (3, 7), (3, 8), (0, 0), (None, None)]
    con.close()
    with NsysExport.open(path) as x:
        k = x.kernels()
    assert k.graph_id.tolist()[:2] == [3, 3] and k.graph_node_id.tolist()[:2] == [7, 8]
    assert k.graph_id.iloc[2:].isna().all() and k.graph_node_id.iloc[2:].isna().all()  # 0 = not in a graph (CUPTI)
    assert k.launch_api.tolist()[:2] == ["cudaGraphLaunch"] * 2 and k.launch_api.iloc[2:].isna().all()


def test_graph_runs_are_deterministic(graph_run, tmp_path):
    again = emulate_run({**BASE, "cuda_graphs": GRAPHS}, tmp_path)
    assert _files(again.out_dir) == _files(graph_run.out_dir)


@pytest.mark.parametrize("cfg", [
    {"cp": 2, "tp": 1, "sequence_parallel": False, "cuda_graphs": {"parallelism": ["cp"]}},
    {"cp": 2, "pp": 1, "cuda_graphs": {"parallelism": ["tp", "cp"], "warmup_iterations": 2}},
    {"vpp": 2, "num_layers": 8, "cuda_graphs": {"parallelism": ["tp"]}, "imperfections": {"fuse_grouped_p2p": True}},
    {"pp": 1, "ep": 2, "num_experts": 4, "precision": "bf16", "cuda_graphs": {"parallelism": ["tp"]}},
    {"recompute": "full", "cuda_graphs": {"parallelism": ["tp"]}, "capture": {"steps": [3, 3]},
     "imperfections": {"drop_kernels": 0.1, "drop_log_lines": 0.1, "kernels_without_log": 0.2}},
])  # fmt: skip
def test_graphs_in_other_layouts(cfg, tmp_path):
    res = emulate_run({**BASE, **cfg}, tmp_path)
    ops = pd.read_parquet(res.ground_truth["ops"])
    k = pd.read_parquet(res.ground_truth["kernels"])
    rep = k[k.graph_id.notna()]
    assert ops.graph_captured.sum() > 0 and len(rep) > 0
    cap = ops[ops.graph_captured].set_index(["rank", "seq"])
    assert set(zip(rep["rank"], rep.replay_of_seq)) <= set(cap.index)
    # MoE dispatch/combine and the embedding/output layers stay eager
    assert not ops[ops.graph_captured].phase.str.contains("moe|embedding|output|cross-entropy|recompute").any()
    for path in res.nsys_files:
        with NsysExport.open(path) as x:
            kk = x.kernels()
        g = kk[kk.graph_node_id.notna()]
        assert (g.launch_api == "cudaGraphLaunch").all()


# --------------------------------------------------------------------------- kernel names


def _kernel_names(res) -> pd.DataFrame:
    """Ground-truth kernels joined to the kernel names in the nsys exports (by pid and correlation id)."""
    gt = pd.read_parquet(res.ground_truth["kernels"])
    kernels, _, _ = _exports(res)
    m = gt[~gt.dropped].merge(kernels[["pid", "correlation_id", "start", "name", "short_name"]],
                              on=["pid", "correlation_id", "start"], suffixes=("_gt", ""))  # fmt: skip
    assert len(m) == (~gt.dropped).sum()
    return m


def test_collectives_in_sendrecv_kernels(tmp_path):
    res = emulate_run({**BASE, "kernel_naming": {"collectives_as_sendrecv": ["AllReduce", "AllGather",
                                                                             "ReduceScatter"]}}, tmp_path)  # fmt: skip
    m = _kernel_names(res)
    coll = m[m.family.isin(["AllReduce", "AllGather", "ReduceScatter"])]
    assert len(coll) > 0
    assert (coll.name == "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)").all()
    assert (coll.short_name == "ncclDevKernel_SendRecv").all() and (coll.name_rule == "sendrecv").all()
    bc = m[m.family == "Broadcast"]
    assert len(bc) > 0 and (bc.short_name == "ncclDevKernel_Broadcast_RING_LL").all() and (bc.name_rule == "default").all()


_SYMK = re.compile(r"^ncclSymkDevKernel_(AllGather_(LL|LLMC|ST|STMC)|(AllReduce_(AGxLL_R|AGxLLMC_R|RSxLD_AGxST|"
                   r"RSxLDMC_AGxSTMC)|ReduceScatter_(LL|LD|LDMC))_sum_(f32|f16|bf16))$")  # fmt: skip


def test_symmetric_kernels(tmp_path):
    res = emulate_run({**BASE, "hardware": "h100", "precision": "bf16",
                       "kernel_naming": {"symmetric": ["AllReduce", "AllGather", "ReduceScatter"]}}, tmp_path / "a")
    m = _kernel_names(res)
    sym = m[m.name_rule == "symmetric"]
    assert set(sym.family) == {"AllReduce", "AllGather", "ReduceScatter"}
    assert sym.short_name.str.match(_SYMK).all()
    assert (sym.name == sym.short_name + "(ncclSymkDevWorkArgs4K)").all()
    assert (sym.block_x == 512).all()
    assert sym.short_name.str.contains("MC").any()  # NVLS multicast variants on NVSwitch hardware
    # all-reduces of float64/integers or with another op than sum have no symmetric kernel: NCCL's usual one
    ops = pd.read_parquet(res.ground_truth["ops"])
    other = m[(m.family == "AllReduce") & (m.name_rule == "default")].merge(
        ops[["rank", "seq", "dtype", "redop"]], left_on=["rank", "first_seq"], right_on=["rank", "seq"])
    assert len(other) > 0 and other.short_name.str.match(r"^ncclDevKernel_AllReduce_Sum_\w+_RING_LL$").all()
    assert (~other.dtype.isin([6, 7, 9]) | (other.redop != 0)).all()
    sym_ar = sym[sym.family == "AllReduce"].merge(ops[["rank", "seq", "dtype", "redop"]],
                                                  left_on=["rank", "first_seq"], right_on=["rank", "seq"])
    assert (sym_ar.dtype.isin([6, 7, 9]) & (sym_ar.redop == 0)).all()
    # rank 0 of each communicator prints NCCL's [Symmetric] TUNING line; the log reader parses it
    parse_logs(res.log_files, tmp_path / "p")
    tun = pd.read_parquet(tmp_path / "p" / "tuning.parquet")
    st = tun[tun.sym_kernel.notna()]
    assert len(st) > 0 and (st.nthreads == 512).all()
    # NCCL 2.27 names them ncclSymDevKernel_*(ncclSymDevArgs); no multicast kernels without NVLS (A100)
    old = emulate_run({**BASE, "nccl_version": "2.27.7", "precision": "bf16",
                       "kernel_naming": {"symmetric": ["AllGather"]}}, tmp_path / "b")
    m27 = _kernel_names(old)
    ag = m27[m27.family == "AllGather"]
    assert ag.short_name.str.match(r"^ncclSymDevKernel_AllGather_(LL|ST)$").all()
    assert (ag.name == ag.short_name + "(ncclSymDevArgs)").all()
    assert (m27[m27.family == "ReduceScatter"].name_rule == "default").all()


def test_symmetric_kernel_picker():
    # (coll, dtype, redop, nelts_max, nbytes_total, nranks, nnodes, nworks, arch, nvls)
    small = symmetric_kernel("AllReduce", 9, 0, 512, 1024, 8, 1, 1, 900, True)
    big = symmetric_kernel("AllReduce", 9, 0, 1 << 26, 1 << 27, 8, 1, 1, 900, True)
    assert small is not None and small[0].endswith("LLMC_R") and big is not None and big[0] == "AllReduce_RSxLDMC_AGxSTMC"
    no_nvls = symmetric_kernel("AllReduce", 9, 0, 1 << 26, 1 << 27, 8, 1, 1, 800, False)
    assert no_nvls is not None and "MC" not in no_nvls[0]
    assert symmetric_kernel("AllReduce", 9, 0, 512, 1024, 8, 1, 2, 800, False)[0] == "AllReduce_RSxLD_AGxST"  # grouped: no LL
    assert symmetric_kernel("AllReduce", 8, 0, 512, 4096, 8, 1, 1, 900, True) is None  # float64
    assert symmetric_kernel("AllReduce", 9, 2, 512, 1024, 8, 1, 1, 900, True) is None  # max
    assert symmetric_kernel("AllGather", 9, 0, 512, 1024, 8, 2, 1, 900, True) is None  # two nodes
    assert symmetric_kernel("Broadcast", 9, 0, 512, 1024, 8, 1, 1, 900, True) is None


def test_algorithm_names_by_nccl_version(tmp_path):
    # up to 2.18 each algorithm has its own kernel: the name carries it
    r18 = emulate_run({**BASE, "nccl_version": "2.18.3", "hardware": "h100", "nsys_version": "2024.6",
                       "kernel_naming": {"algorithms": {"AllReduce": "NVLS_TREE", "AllGather": "NVLS"}}},
                      tmp_path / "a")  # fmt: skip
    m = _kernel_names(r18)
    ar, ag = m[m.family == "AllReduce"], m[m.family == "AllGather"]
    assert ar.short_name.str.match(r"^ncclKernel_AllReduce_NVLS_TREE_LL_Sum_(half|float|double|int32_t)$").all()
    assert (ag.short_name == "ncclKernel_AllGather_NVLS_LL_Sum_int8_t").all() and len(ag) > 0
    assert (ar.name_rule == "algorithm").all() and (ar.proto == "SIMPLE").all()
    # from 2.19 NVLS runs in the RING_LL kernel; only the TUNING lines say NVLS
    r24 = emulate_run({**BASE, "nccl_version": "2.24.3", "hardware": "h100",
                       "kernel_naming": {"algorithms": {"AllReduce": "NVLS"}}}, tmp_path / "b")  # fmt: skip
    m = _kernel_names(r24)
    ar = m[m.family == "AllReduce"]
    assert ar.short_name.str.match(r"^ncclDevKernel_AllReduce_Sum_\w+_RING_LL$").all() and (ar.algo == "NVLS").all()
    parse_logs(r24.log_files, tmp_path / "p")
    tun = pd.read_parquet(tmp_path / "p" / "tuning.parquet")
    assert set(tun[tun.op == "AllReduce"].algo) == {"NVLS"} and set(tun[tun.op == "AllReduce"].proto) == {"SIMPLE"}
    assert set(tun[tun.op == "ReduceScatter"].algo) == {"RING"}


@pytest.mark.parametrize("version, short", [("2.18.3", "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t"),
                                            ("2.24.3", "ncclDevKernel_SendRecv")])
def test_ungrouped_send_and_recv_each_run_a_sendrecv_kernel(version, short, tmp_path):
    res = emulate_run({**BASE, "nccl_version": version, "nsys_version": "2024.6"}, tmp_path)  # fuse_grouped_p2p off
    ops = pd.read_parquet(res.ground_truth["ops"])
    p2p = ops[ops.op.isin(["Send", "Recv"])]
    assert set(p2p.op) == {"Send", "Recv"} and p2p.grouped.any()
    m = _kernel_names(res)
    k = m[m.family == "SendRecv"]
    assert (k.n_ops == 1).all() and (k.short_name == short).all()
    assert set(zip(k["rank"], k.correlation_id)) == set(zip(p2p["rank"], p2p.kernel_correlation_id.astype(int)))


# --------------------------------------------------------------------------- config and "off"


@pytest.mark.parametrize("change, field", [
    ({"cuda_graphs": {"parallelism": ["dp"]}}, "cuda_graphs.parallelism"),
    ({"cuda_graphs": {"parallelism": ["cp"]}}, "cuda_graphs.parallelism"),  # cp = 1
    ({"cuda_graphs": {"parallelism": ["tp"], "warmup_iterations": 3}}, "cuda_graphs.warmup_iterations"),
    ({"cuda_graphs": {"parallelism": ["tp"], "warmup_iterations": 0}}, "cuda_graphs.warmup_iterations"),
    ({"cuda_graphs": {"parallelism": ["tp"], "warmups": 1}}, "cuda_graphs.warmups"),
    ({"kernel_naming": {"symmetric": ["AllReduce"]}, "nccl_version": "2.24.3"}, "kernel_naming.symmetric"),
    ({"kernel_naming": {"symmetric": ["Broadcast"]}}, "kernel_naming.symmetric"),
    ({"kernel_naming": {"collectives_as_sendrecv": ["Send"]}}, "kernel_naming.collectives_as_sendrecv"),
    ({"kernel_naming": {"algorithms": {"AllReduce": "NVLS"}}}, "kernel_naming.algorithms"),  # a100: no NVSwitch
    ({"kernel_naming": {"algorithms": {"AllGather": "PAT"}}, "nccl_version": "2.21.5"}, "kernel_naming.algorithms"),
    ({"kernel_naming": {"algorithms": {"Broadcast": "TREE"}}}, "kernel_naming.algorithms"),
])  # fmt: skip
def test_config_errors(change, field):
    with pytest.raises(ConfigError) as e:
        EmulatorConfig.from_dict({**BASE, **change})
    assert e.value.field == field


def test_config_round_trip_and_run_yaml(graph_run):
    cfg = EmulatorConfig.from_dict({**BASE, "cuda_graphs": GRAPHS,
                                    "kernel_naming": {"algorithms": {"allreduce": "ring"}}} | {"kernel_naming": {
                                        "algorithms": {"AllReduce": "tree"}}})  # fmt: skip
    assert cfg.kernel_naming.algorithms == {"AllReduce": "TREE"} and cfg.cuda_graphs.parallelism == ["tp"]
    assert EmulatorConfig.from_dict(cfg.to_dict()) == cfg
    meta = yaml.safe_load((graph_run.out_dir / "run.yaml").read_text())
    assert meta["config"]["cuda_graphs"] == {"parallelism": ["tp"], "warmup_iterations": 1,
                                             "capture_launch_records": True}  # fmt: skip
    assert "kernel_naming" not in meta["config"]
    assert "cuda_graphs" not in EmulatorConfig.from_dict(BASE).to_dict()


def test_options_off_are_byte_identical(eager_run, tmp_path):
    off = {**BASE, "cuda_graphs": {"parallelism": [], "warmup_iterations": 2},
           "kernel_naming": {"collectives_as_sendrecv": [], "symmetric": [], "algorithms": {}}}  # fmt: skip
    res = emulate_run(off, tmp_path)
    assert _files(res.out_dir) == _files(eager_run.out_dir)
    gt = pd.read_parquet(res.ground_truth["kernels"])
    assert "graph_id" not in gt.columns and "name_rule" not in gt.columns
    assert "graph_captured" not in pd.read_parquet(res.ground_truth["ops"]).columns
    on = emulate_run({**BASE, "kernel_naming": {"algorithms": {"AllReduce": "RING"}}}, tmp_path / "on")
    assert _files(on.out_dir) != _files(eager_run.out_dir)  # an active option does change the output
