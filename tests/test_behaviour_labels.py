"""Labels without declared sizes, from what each communicator does (megatron.behaviour,
parallelism.communicator_behaviour/label_by_behaviour, ops.run_labels), on synthetic behaviour
and on an emulated run analysed with its sizes declared (validation.labels)."""

from __future__ import annotations

from collections import Counter

import pandas as pd
import pytest

from nccltrace.cli import main
from nccltrace.communicators.labels import communicator_behaviour
from nccltrace.emulator.run import emulate_run
from nccltrace.megatron.behaviour import GroupDid, most_likely
from nccltrace.megatron.infer import infer_layout
from nccltrace.validation.labels import behaviour_vs_declared


def _members(rows: list[tuple[int, int, int, int]]) -> pd.DataFrame:
    """(logical_id, pid, comm, global_rank) -> a members table on host h."""
    return pd.DataFrame({"logical_id": [r[0] for r in rows], "host": "h", "pid": [r[1] for r in rows],
                         "comm": [r[2] for r in rows], "global_rank": [r[3] for r in rows]})


def test_send_recv_to_every_other_member_is_all_to_all_and_to_one_neighbour_point_to_point():
    # logical 0: four ranks, each sends to and receives from all three others (PyTorch's all_to_all)
    # logical 1: two ranks exchanging with each other (a pipeline pair)
    members = _members([(0, r, 10 + r, r) for r in range(4)] + [(1, 0, 20, 0), (1, 1, 21, 1)])
    rows = [("h", r, 10 + r, op, 64, 7, 5, 3) for r in range(4) for op in ("Send", "Recv")]
    rows += [("h", r, 20 + r, op, 64, 7, 5, 1) for r in range(2) for op in ("Send", "Recv")]
    counts = pd.DataFrame(rows, columns=["host", "pid", "comm", "op", "count", "datatype", "calls", "peers"])
    got = {g.members: g.ops for g in communicator_behaviour(counts, members)}
    assert got[(0, 1, 2, 3)] == Counter({"all_to_all": 40}) and got[(0, 1)] == Counter({"send": 10, "recv": 10})


def _candidates(world: int, groups: list[list[int]]) -> list[dict]:
    return infer_layout(world, groups).candidates


def test_a_busy_group_that_repeats_no_call_three_times_a_step_is_data_not_tensor_parallel():
    # pp 2 x (tp or dp) 2 on 4 ranks: {0,1},{2,3} busiest, but each call once a step (gradient buckets)
    sets = [[0, 1], [2, 3], [0, 2], [1, 3]]
    groups = [GroupDid((0, 1), Counter(all_reduce=40), 0.5), GroupDid((2, 3), Counter(all_reduce=40), 0.5),
              GroupDid((0, 2), Counter(send=80, recv=80), 1.0), GroupDid((1, 3), Counter(send=80, recv=80), 1.0)]
    best = most_likely(4, _candidates(4, sets), groups)
    assert (best["tp"], best["dp"], best["pp"]) == (1, 2, 2) and best["by_behaviour"] and "tied" not in best
    # the same traffic repeated per layer and micro-batch (16 times a step) is tensor parallelism
    busy = [g._replace(repeats_per_step=16.0) if g.members in ((0, 1), (2, 3)) else g for g in groups]
    best = most_likely(4, _candidates(4, sets), busy)
    assert (best["tp"], best["dp"], best["pp"]) == (2, 1, 2)


@pytest.fixture(scope="module")
def declared_run(tmp_path_factory):
    """TP 2 x PP 2 x DP 2 on two nodes of four GPUs, analysed with its sizes declared (run.yaml)."""
    base = tmp_path_factory.mktemp("behaviour")
    emulate_run({"model": "tiny", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                 "seq_length": 64, "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 8,
                 "iterations": 3, "nodes": 2, "gpus_per_node": 4, "tp": 2, "pp": 2, "precision": "bf16",
                 "seed": 7, "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1}},
                base / "raw")  # fmt: skip
    assert main(["analyze", str(base / "raw"), "-o", str(base / "out"), "-q", "--until", "ops"]) == 0
    return base / "out"


@pytest.mark.slow
def test_without_its_sizes_an_emulated_run_gets_its_declared_labels_from_behaviour_none_said_certain_wrongly(
        declared_run):
    got = behaviour_vs_declared(declared_run)
    assert got["certain_wrong"] == 0, got
    assert got["sources"].get("behaviour", 0) + got["sources"].get("megatron-groups", 0) == got["communicators"]
    assert got["same"] == got["communicators"], got
