"""Exact communicator and global-rank inference from init/split lines, against emulator ground
truth across NCCL line-format versions and init styles, and on a real log excerpt."""

from __future__ import annotations

import pytest

from nccltrace.communicators.infer import infer_communicators, infer_run_communicators
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.nccl.log_reader import parse_logs

BASE = {"model": "t", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
        "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 8, "iterations": 1, "nodes": 2,
        "gpus_per_node": 4, "tp": 2, "pp": 2, "precision": "bf16", "seed": 6}


def _run(tmp_path, **kw):
    res = emulate_run({**BASE, **kw}, tmp_path / "raw")
    procs = []
    for log in res.log_files:
        out = tmp_path / "parsed" / log.stem
        parse_logs([log], out)
        procs.append(out)
    return res, infer_run_communicators(procs, tmp_path / "comm")


@pytest.mark.parametrize("version", ["2.18.3", "2.21.5", "2.23.4", "2.24.3", "2.29.2"])
@pytest.mark.parametrize("style", ["plain", "split"])
def test_logical_communicators_equal_ground_truth(tmp_path, version, style):
    res, result = _run(tmp_path, nccl_version=version, init_style=style)
    truth = read_table(res.ground_truth["communicators"])
    members = result.members
    assert (members.logical_id >= 0).all() and result.complete
    got = members.merge(truth, on=["host", "pid", "comm"], how="outer", indicator=True)
    assert (got["_merge"] == "both").all()
    # The same partition of (process, comm pointer) into communicators as the ground truth ...
    assert got.groupby("logical_id").comm_uid.nunique().max() == 1
    assert got.groupby("comm_uid").logical_id.nunique().max() == 1
    # ... with the right rank of each member and its global rank.
    assert (got.rank_in_comm_x == got.rank_in_comm_y).all() and (got.global_rank == got["rank"]).all()
    comms = result.communicators.set_index("logical_id")
    for uid, g in got.groupby("comm_uid"):
        assert list(comms.loc[int(g.logical_id.iloc[0]), "members"]) == list(g.members.iloc[0])
    assert result.world_size == 8


def test_a_missing_rank_log_marks_its_communicators_incomplete(tmp_path):
    res = emulate_run({**BASE, "nccl_version": "2.24.3", "init_style": "split"}, tmp_path / "raw")
    victim = sorted(res.log_files)[3]
    victim.unlink()
    parse_logs([tmp_path / "raw" / "nccl"], tmp_path / "p")
    result = infer_communicators(read_table(tmp_path / "p" / "comms.parquet"))
    bad = result.communicators[~result.communicators.complete.astype(bool)]
    assert len(bad) > 0 and bad.problem.str.contains("no init line for rank").all()
    assert not result.complete


def test_real_split_lines_of_one_communicator_are_grouped(fixture_logs, tmp_path):
    parse_logs([fixture_logs / "deepspeedai_DeepSpeed_7128.log"], tmp_path / "p")
    result = infer_communicators(read_table(tmp_path / "p" / "comms.parquet"))
    # Two processes' ncclCommSplit lines (same commId, color) form one 2-rank communicator; their
    # parents' init lines are not in the excerpt, so global ranks are unknown (-1), not guessed.
    assert len(result.communicators) == 1
    row = result.communicators.iloc[0]
    assert row.nranks == 2 and row.complete and list(row.members) == [-1, -1]
