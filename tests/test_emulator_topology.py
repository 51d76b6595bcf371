"""Emulated topology dumps follow NCCL: one per communicator init, trimmed to its GPUs, comm ranks."""

from __future__ import annotations

from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.nccl.log_reader import parse_logs


def test_each_comm_init_dumps_its_own_gpus_with_their_rank_in_that_comm(tmp_path):
    res = emulate_run({"model": "t", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                       "seq_length": 64, "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 4,
                       "iterations": 1, "nodes": 2, "gpus_per_node": 2, "pp": 2, "precision": "bf16",
                       "nccl_version": "2.24.3", "init_style": "split", "seed": 4}, tmp_path / "raw")
    parse_logs([tmp_path / "raw" / "nccl"], tmp_path / "p")
    links = read_table(tmp_path / "p" / "topology_links.parquet")
    systems = read_table(tmp_path / "p" / "topology_systems.parquet")
    comms = read_table(tmp_path / "p" / "comms.parquet")
    truth = read_table(res.ground_truth["communicators"])
    for f, inits in comms[comms.phase == "START"].groupby("file"):
        # one dump per communicator this process initialised
        assert (systems.file == f).sum() == len(inits)
    # node001 holds world ranks 2 and 3: its world-communicator dump shows GPUs "(2)" and "(3)".
    host1 = truth[(truth.host == "node001") & (truth.group_kind == "world")]
    f1 = f"nccl_node001_{int(host1.pid.iloc[0])}.log"
    first = links[(links.file == f1) & (links.system == 0) & (links.link_type == "PCI") & links.to_node.str.startswith("GPU/").fillna(False).astype(bool)]
    assert sorted(first.to_detail) == ["2", "3"]
    # a 2-rank pipeline communicator spanning both nodes shows only this node's member, as its rank
    pp = truth[(truth.group_kind == "pp") & (truth.pid == host1.pid.iloc[0])].iloc[0]
    k = list(truth[(truth.pid == host1.pid.iloc[0])].sort_values("init_line").comm).index(pp.comm)
    dump = links[(links.file == f1) & (links.system == k) & (links.link_type == "PCI") & links.to_node.str.startswith("GPU/").fillna(False).astype(bool)]
    assert list(dump.to_detail) == [str(int(pp.rank_in_comm))]
