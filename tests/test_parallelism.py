"""Parallelism labels of logical communicators: declared sizes, exact matching against
Megatron's groups, ambiguity reporting, the thesis heuristic, and 100% correctness against
emulator ground truth (plain and eager-split init, single- and multi-node, dense, MoE, CP)."""

from __future__ import annotations

import pandas as pd
import pytest

from nccltrace.communicators.infer import COMMUNICATOR_SCHEMA, MEMBER_SCHEMA
from nccltrace.communicators.labels import (
    LABEL_SCHEMA,
    ParallelSizes,
    label_communicators,
    label_ops,
    pair_kinds,
    truth_label,
)
from nccltrace.megatron.layout import megatron_layout
from nccltrace.validation.communicators import (
    emulate_config,
    label_accuracy,
    label_details,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("labels")


def _comms(rows: list[tuple[int, int, list[int]]], kind: str = "init") -> pd.DataFrame:
    """A communicators table from (logical_id, nranks, members)."""
    cols = {f.name: [] for f in COMMUNICATOR_SCHEMA}
    for lid, n, members in rows:
        for k, v in (("logical_id", lid), ("kind", kind), ("nranks", n), ("comm_id", None),
                     ("parent_logical_id", None), ("color", None), ("split_count", None), ("members", members),
                     ("complete", -1 not in members), ("problem", None), ("world", False)):
            cols[k].append(v)
    return pd.DataFrame(cols)


def _members(comms: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for lid, members in zip(comms.logical_id, comms.members):
        for r, g in enumerate(members):
            rows.append((lid, "node000", 100 + g, 0x1000 * (lid + 1) + g, r, g, "f.log", 10 * lid + 1))
    return pd.DataFrame(rows, columns=[f.name for f in MEMBER_SCHEMA])


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("kw, field", [
    ({"tp": 3, "world_size": 8}, "tp"),  # world % (tp*pp*cp)
    ({"tp": 2, "pp": 2, "world_size": 8, "dp": 4}, "dp"),
    ({"tp": 2, "ep": 4, "world_size": 4}, "ep"),
    ({"vpp": 2, "world_size": 4}, "vpp"),
    ({"tp": 2}, "world_size"),
    ({"tp": 0, "world_size": 4}, "tp"),
])  # fmt: skip
def test_invalid_sizes_name_the_field(kw, field):
    with pytest.raises(ValueError) as err:
        ParallelSizes(**kw)
    assert err.value.field == field and field in str(err.value)


def test_sizes_from_settings_of_every_origin():
    emu = ParallelSizes.from_settings({"tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 4, "etp": None, "model": "x"})
    assert (emu.world_size, emu.dp, emu.expert_tp, emu.expert_dp) == (8, 2, 2, 2)
    run_yaml = {"config": {"tp": 2, "pp": 1, "cp": 2, "nodes": 1, "gpus_per_node": 8, "distributed_optimizer": True},
                "derived": {"world_size": 8, "dp": 2}}
    s = ParallelSizes.from_settings(run_yaml)
    assert (s.tp, s.cp, s.dp, s.distributed_optimizer) == (2, 2, 2, True)
    meg = ParallelSizes.from_settings({"tensor_model_parallel_size": 4, "data_parallel_size": 2,
                                       "expert_model_parallel_size": 2, "use_distributed_optimizer": "true"})
    assert (meg.world_size, meg.ep, meg.distributed_optimizer) == (8, 2, True)
    with pytest.raises(ValueError, match="world_size"):
        ParallelSizes.from_settings({"world_size": 6, "nodes": 2, "gpus_per_node": 4})
    # The layout is Megatron's: tp groups are consecutive ranks, dp groups strided by tp.
    groups = {g.kind: g.ranks for g in megatron_layout(emu).groups if g.index == 0}
    assert groups["tp"] == (0, 1) and groups["dp"] == (0, 2) and groups["pp"] == (0, 4)


# --------------------------------------------------------------------------- matching


def test_identical_member_sets_are_reported_as_candidates():
    # dp4 (tp = pp = cp = 1): the world, dp and dp-cp groups all hold ranks 0..3.
    comms = _comms([(0, 4, [0, 1, 2, 3])])
    lab = label_communicators(comms, ParallelSizes(world_size=4), members=_members(comms))
    row = lab.iloc[0]
    cands = row.parallelism_candidates.split(",")
    assert row.parallelism == "dp" and cands[0] == "dp" and {"dp-cp", "world"} <= set(cands)
    assert row.label_source == "megatron-groups" and row.resolution == "ambiguous"
    assert [f.name for f in LABEL_SCHEMA] == list(lab.columns)
    assert all(f.metadata and b"doc" in f.metadata for f in LABEL_SCHEMA)


def test_unique_member_set_and_unmatched_and_partial():
    sizes = ParallelSizes(tp=2, pp=2, world_size=8)
    comms = _comms([(0, 4, [0, 1, 4, 5]), (1, 3, [0, 3, 6]), (2, 2, [2, -1])])
    lab = label_communicators(comms, sizes).set_index("logical_id")
    assert lab.loc[0, "parallelism"] == "mp" and "tp-ep-pp" in lab.loc[0, "parallelism_candidates"]
    assert lab.loc[1, "label_source"] == "unmatched" and lab.loc[1, "parallelism"] == "unknown"
    # Rank 2 first of two ranks, the other unknown: tp [2, 3] or pp [2, 6] (or ...), not decided;
    # dp [0, 2] has rank 2 second and is excluded.
    cands = set(lab.loc[2, "parallelism_candidates"].split(","))
    assert lab.loc[2, "resolution"] == "partial" and {"tp", "pp"} <= cands and "dp" not in cands


def test_pair_communicators_take_the_kind_of_their_group():
    sizes = ParallelSizes(pp=4, world_size=4)
    layout = megatron_layout(sizes)
    assert [k for k, _ in pair_kinds(layout, 1, 2)] == ["pp"]
    comms = _comms([(0, 2, [1, 2])])
    lab = label_communicators(comms, sizes).iloc[0]
    assert lab.parallelism == "pp" and lab.resolution == "pair" and lab.expected_group_index == 0
    # A two-rank communicator that carries collectives is never a pair communicator.
    calls = pd.DataFrame({"host": ["node000"] * 2, "pid": [101, 102], "comm": [0x1001, 0x1002],
                          "op": ["AllReduce", "AllReduce"]})
    lab = label_communicators(comms, sizes, members=_members(comms), calls=calls).iloc[0]
    assert lab.label_source == "unmatched"
    # pp = 2: Megatron sends one direction over the world group, which is therefore a candidate.
    assert [k for k, _ in pair_kinds(megatron_layout(ParallelSizes(pp=2, world_size=2)), 0, 1)] == ["pp", "world"]
    assert truth_label("p2p:pp") == "pp" and truth_label("tp") == "tp"


def test_heuristic_without_sizes_is_reported_as_heuristic():
    comms = _comms([(0, 8, list(range(8))), (1, 2, [0, 4]), (2, 2, [0, 1]), (3, 2, [2, 3])])
    members = _members(comms)
    calls = pd.DataFrame({
        "host": ["node000"] * 4, "pid": [100, 104, 100, 101],
        "comm": [0x1000, 0x2000 + 4, 0x3000, 0x3001], "op": ["AllReduce", "Send", "AllReduce", "AllReduce"],
        "logical_id": [0, 1, 2, 2],
    })  # fmt: skip
    lab = label_communicators(comms, None, members=members, calls=calls).set_index("logical_id")
    assert set(lab["label_source"]) == {"heuristic"}
    assert list(lab["parallelism"]) == ["dp", "pp", "collective", "unknown"]
    assert list(lab["resolution"]) == ["largest", "p2p-only", "other", "no-calls"]
    ops = label_ops(calls.assign(op=["AllReduce", "Send", "Send", "AllReduce"]), lab.reset_index())
    # Thesis: every point-to-point operation is PP, whatever its communicator.
    assert list(ops["parallelism"]) == ["dp", "pp", "pp", "collective"]
    assert list(ops["label_source"]) == ["heuristic"] * 4
    unknown = label_ops(calls.assign(logical_id=[7, 7, 7, 7]), lab.reset_index())
    assert set(unknown["parallelism"]) == {"unknown"} and set(unknown["label_source"]) == {"unmatched"}


# --------------------------------------------------------------------------- ground truth

PLAIN = ["dp4", "tp2_pp2_dp2_2nodes", "pp4_vpp2", "moe_ep4_alltoall", "moe_ep4_allgather", "tp2_cp2",
         "tp2_pp2_cp2_ep2_dp2_4nodes"]  # fmt: skip


def test_labels_are_all_correct_with_lazy_init(workdir):
    summary, details = label_accuracy(PLAIN, workdir, styles=(("plain", "2.21.5"),))
    bad = details[~details.verdict.isin(["exact", "ambiguous"])]
    assert bad.empty, bad.to_string()
    assert (summary.correct == 1.0).all() and (summary.ops_correct == 1.0).all() and (summary.ops_wrong == 0).all()
    # Lazy init leaves identical member sets ambiguous, e.g. dp-cp = dp when cp = 1 ...
    dp4 = details[details.config == "dp4"].set_index("true_kind")
    assert dp4.loc["dp-cp", "verdict"] == "ambiguous" and dp4.loc["dp-cp", "parallelism"] == "dp"
    # ... and the 4D multi-node run has every kind it uses matched or listed as a candidate.
    mixed = details[details.config == "tp2_pp2_cp2_ep2_dp2_4nodes"]
    assert {"tp", "cp", "ep", "pp", "dp-cp", "tp-ep", "edp"} <= set(mixed.true_label)
    assert summary.set_index("config").loc["tp2_pp2_cp2_ep2_dp2_4nodes", "world_size"] == 16


@pytest.mark.parametrize("name, version", [
    ("tp2_pp2_dp2_2nodes", "2.24.3"),  # splitCount printed
    ("tp2_pp2_cp2_ep2_dp2_4nodes", "2.22.3"),  # split lines without splitCount
    ("tp2_pp2_dp2_2nodes", "2.18.3"),  # splits printed as plain inits (repeated commIds)
    ("pp2_vpp2_dp2_2nodes", "2.24.3"),  # un-coalesced P2P: pair communicators
])  # fmt: skip
def test_eager_split_creation_order_resolves_identical_member_sets(workdir, name, version):
    run = emulate_config(name, workdir, init_style="split", nccl_version=version)
    details = label_details(run)
    assert details.verdict.isin(["exact", "ambiguous"]).all(), details[details.verdict != "exact"].to_string()
    amb = details[details.verdict == "ambiguous"]
    # Only the pairs Megatron sends over the world group when pp = 2 stay ambiguous ('pp' vs 'world').
    assert set(amb.true_kind) <= {"p2p:world"}
    assert set(amb.parallelism) <= {"pp"}
    assert (details[details.verdict == "exact"].resolution != "ambiguous").all()


def test_the_check_fails_with_wrong_sizes(workdir):
    run = emulate_config("tp2_pp2_dp2_2nodes", workdir)
    details = label_details(run, ParallelSizes(tp=4, world_size=8))
    assert (details.verdict.isin(["wrong", "unmatched"])).any()
