"""Sequence-based communicator inference for logs without init lines (thesis 4.2.3): the
thesis's identical-sequence rule and the improved inference, against emulator ground truth,
clean and with lost/duplicated lines."""

from __future__ import annotations

import pandas as pd
import pytest

from nccltrace.communicators.from_calls import (
    global_ranks,
    infer_communicators_from_calls,
)
from nccltrace.communicators.infer import COMMUNICATOR_SCHEMA, MEMBER_SCHEMA
from nccltrace.communicators.labels import label_communicators
from nccltrace.validation.communicators import (
    LOST_LINES,
    emulate_config,
    fallback_accuracy,
    fallback_scores,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fallback")


def _lost(name, workdir):
    return emulate_config(name, workdir, imperfections=LOST_LINES, overrides={"iterations": 2})


def test_global_rank_is_node_index_times_gpus_plus_cuda_dev():
    calls = pd.DataFrame({"host": ["node10", "node2", "node2", "node10"], "pid": [1, 2, 3, 4],
                          "cuda_dev": [0, 1, 0, 1]})
    thesis, _ = global_ranks(calls)  # alphabetical: node10 is node 0
    assert thesis == {("node10", 1): 0, ("node10", 4): 1, ("node2", 3): 2, ("node2", 2): 3}
    natural, _ = global_ranks(calls, natural_sort=True)
    assert natural[("node2", 3)] == 0 and natural[("node10", 4)] == 3
    # One visible GPU per process: every cudaDev is 0; the rank is then taken from pid order, flagged.
    shared = calls.assign(cuda_dev=0)
    ranks, problems = global_ranks(shared, natural_sort=True, fix_shared_devices=True)
    assert sorted(ranks.values()) == [0, 1, 2, 3] and len(problems) == 4
    _, flagged = global_ranks(shared)
    assert all("not unique" in p for p in flagged.values())


def test_thesis_rule_merges_equally_busy_groups_and_splits_p2p_ends(workdir):
    run = emulate_config("tp2_pp2_dp2_2nodes", workdir)
    res = infer_communicators_from_calls(run.calls, method="thesis")
    comms = res.communicators
    assert list(comms.columns) == COMMUNICATOR_SCHEMA.names and list(res.members.columns) == MEMBER_SCHEMA.names
    assert set(comms["kind"]) == {"sequence"} and not comms["complete"].astype(bool).any()
    sizes = res.members.groupby("logical_id").size()
    # The four TP groups of a stage run identical calls: merged into one "communicator".
    assert (sizes > comms.set_index("logical_id")["nranks"]).any()
    assert (res.members["rank_in_comm"] == -1).all()
    assert comms["problem"].str.contains("pointers grouped but calls print nranks").any()
    s = fallback_scores(run, "thesis")
    assert s["pair_precision"] < 0.5 and s["global_rank_accuracy"] == 1.0


def test_improved_groups_have_the_printed_size_and_distinct_processes(workdir):
    run = emulate_config("tp2_pp2_cp2_ep2_dp2_4nodes", workdir)
    res = infer_communicators_from_calls(run.calls, sizes=run.sizes)
    m = res.members
    for lid, g in m.groupby("logical_id"):
        n = int(res.communicators.set_index("logical_id").loc[lid, "nranks"])
        assert len(g) == n and g[["host", "pid"]].drop_duplicates().shape[0] == n
    # Communicators whose membership the calls could not decide say so.
    guessed = res.communicators[res.communicators["problem"].fillna("").str.contains("membership not determined")]
    assert len(guessed) and not guessed["complete"].astype(bool).any()
    # Point-to-point communicators get their ranks from the traffic, and those are right.
    s = fallback_scores(run, "improved", sizes=run.sizes)
    assert s["rank_in_comm_determined"] > 0.2 and s["rank_in_comm_accuracy"] == 1.0
    assert s["pointers_grouped_correctly"] > 0.6 and s["global_rank_accuracy"] == 1.0


@pytest.mark.parametrize("name", ["pp4_vpp2", "moe_ep4_alltoall"])
def test_improved_is_exact_where_the_calls_decide_even_with_lost_lines(workdir, name):
    for run in (emulate_config(name, workdir), _lost(name, workdir)):
        s = fallback_scores(run, "improved")
        assert s["pointers_grouped_correctly"] == 1.0 and s["pair_precision"] == 1.0 and s["pair_recall"] == 1.0
        assert s["rank_in_comm_accuracy"] == 1.0
    assert fallback_scores(_lost(name, workdir), "thesis")["pointers_grouped_correctly"] < 0.5


def test_pair_ranks_come_from_send_recv_peers(workdir):
    run = emulate_config("pp4_vpp2", workdir)
    res = infer_communicators_from_calls(run.calls)
    truth = run.truth_comms[run.truth_comms.group_kind == "p2p:pp"][["host", "pid", "comm", "rank_in_comm"]]
    m = res.members.merge(truth, on=["host", "pid", "comm"], suffixes=("", "_true"))
    assert len(m) == 8 and (m.rank_in_comm == m.rank_in_comm_true).all()
    pytorch = infer_communicators_from_calls(run.calls, rank_order="pytorch")
    assert (pytorch.members.rank_in_comm >= 0).all()
    assert pytorch.communicators.problem.fillna("").str.contains("PyTorch convention").any()
    # The fallback's tables feed the labelling: pairs of adjacent stages are pipeline traffic.
    lab = label_communicators(res.communicators, run.sizes, members=res.members, calls=run.calls)
    pairs = lab[lab.nranks == 2].merge(m[["logical_id"]].drop_duplicates(), on="logical_id")
    assert set(pairs.parallelism) == {"pp"}


def test_improved_beats_the_thesis_on_every_configuration(workdir):
    names = ["tp2_pp2_dp2_2nodes", "tp2_cp2", "moe_ep4_alltoall"]
    df = fallback_accuracy(names, workdir).set_index(["config", "logs", "method"])
    for name in names:
        for logs in ("clean", "lost-lines"):
            thesis = df.loc[(name, logs, "thesis")]
            improved = df.loc[(name, logs, "improved+sizes")]
            assert improved.pointers_grouped_correctly >= thesis.pointers_grouped_correctly
            assert improved.communicators_inferred == improved.communicators_true
    assert df.loc[("tp2_pp2_dp2_2nodes", "lost-lines", "thesis")].pointers_grouped_correctly < 0.2


def test_bad_arguments():
    with pytest.raises(ValueError, match="method"):
        infer_communicators_from_calls(pd.DataFrame(), method="magic")
    with pytest.raises(ValueError, match="rank_order"):
        infer_communicators_from_calls(pd.DataFrame(), rank_order="random")
    empty = infer_communicators_from_calls(pd.DataFrame())
    assert empty.communicators.empty and list(empty.members.columns) == MEMBER_SCHEMA.names
