"""PyTorch Flight Recorder dumps as input: read safely, found by content, and ``infer-layout``
on them with and without the groups' names (the four real 16-rank Megatron-Core jobs of
``tests/data/real/flight_recorder_megatron16``, its README.md says where they come from)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections import Counter

import pytest
from data_paths import CAPTURE, FR_MEGATRON16

from nccltrace.cli import main
from nccltrace.megatron.behaviour import most_likely
from nccltrace.megatron.infer import SIZE_NAMES, infer_layout
from nccltrace.pytorch.flight_recorder import (
    FlightRecorderError,
    find_dumps,
    group_ops,
    layout_input,
    load_dump,
    op_of,
)

FR = FR_MEGATRON16
CAPTURE_FR = CAPTURE / "flight_recorder"
# the jobs' own group names (test_infer_layout.py reads them off pg_config)
TP2 = {"tp": 2, "cp": 1, "dp": 2, "pp": 4, "ep": 4, "etp": 1}
TP4 = {"tp": 4, "cp": 1, "dp": 2, "pp": 2, "ep": 8, "etp": 1}
TRUTH = {"gpu_error_1st": TP2, "gpu_error_2nd": TP4, "lock_gil_1st": TP4, "lock_gil_2nd": TP2}


def _dump(pg_config: dict, entries: list | None = None) -> dict:
    return {"version": "2.9", "nccl_version": "2.27.3", "pg_config": pg_config, "entries": entries or []}


class _Hostile:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_pickle_referencing_any_python_object_is_refused_by_name_and_never_run(tmp_path):
    bad = tmp_path / "_dump_0"
    bad.write_bytes(pickle.dumps(_dump({"0": {"name": "0", "desc": "default_pg", "ranks": "[0]"}}) | {"x": _Hostile()}))
    with pytest.raises(FlightRecorderError, match=r"refused: it references the Python object (posix|os)\.system"):
        load_dump(bad)


@pytest.mark.parametrize("content, what", [
    (b"\x80\x04\x95garbage", "damaged pickle"),
    (pickle.dumps({"entries": []}), "not a Flight Recorder dump"),
    (pickle.dumps([1, 2, 3]), "not a Flight Recorder dump"),
    (b"rank 0 iter 1 done\n", "not a pickle"),
])
def test_damaged_or_foreign_files_are_named_with_what_is_wrong(tmp_path, content, what):
    f = tmp_path / "dump"
    f.write_bytes(content)
    with pytest.raises(FlightRecorderError, match=what):
        load_dump(f)


def test_dumps_are_found_by_content_whatever_their_names_and_ranked_by_their_groups(tmp_path):
    """A rank's pg_config holds only the groups it belongs to: their one common member is the
    rank, whatever the file is called; other files beside them are not dumps."""
    for rank, name in ((1, "trace_b"), (0, "zzz.pkl")):
        (tmp_path / name).write_bytes(pickle.dumps(_dump({
            "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
            str(rank + 1): {"name": str(rank + 1), "desc": "PIPELINE_MODEL_PARALLEL_GROUP", "ranks": f"[{rank}]"}},
            [{"process_group": ("0", "default_pg"), "profiling_name": "nccl:all_reduce"}])))
    (tmp_path / "README.md").write_text("not a dump")
    dumps = find_dumps(tmp_path)
    assert [d.rank for d in dumps] == [0, 1] and dumps[0].path.name == "zzz.pkl"
    assert group_ops(dumps) == {(0, 1): Counter({"all_reduce": 2})}
    world, groups, descs = layout_input(dumps)
    assert world == 2 and sorted(map(tuple, groups)) == [(0,), (0, 1), (1,)]
    assert layout_input(dumps, names=False)[2] is None


def test_profiling_names_of_every_spelling_decode_to_their_collective():
    assert [op_of(n) for n in ("nccl:_all_gather_base", "nccl:_reduce_scatter_base", "nccl:all_to_all",
                               "nccl:send 0->3", "nccl:recv 3<-0", "nccl:allgather_into_tensor_coalesced",
                               "nccl:reduce_scatter_tensor_coalesced", "nccl:all_reduce_coalesced")] == [
        "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "all_gather", "reduce_scatter", "all_reduce"]


@pytest.mark.parametrize("scenario", sorted(TRUTH))
def test_infer_layout_on_real_dumps_is_exact_with_names_and_most_likely_right_without(tmp_path, capsys, scenario):
    """With Megatron's group names every size is exact; without them member sets leave 20-59
    layouts, none certain wrongly, and the one behaviour ranks first is the job's."""
    assert main(["infer-layout", str(FR / scenario)]) == 0
    named = json.loads(capsys.readouterr().out)
    assert named["sizes"] == TRUTH[scenario]
    assert main(["infer-layout", str(FR / scenario), "--no-names"]) == 0
    out = capsys.readouterr()
    blind = json.loads(out.out)
    assert all(v is None or v == TRUTH[scenario][k] for k, v in blind["sizes"].items())  # nothing certain is wrong
    assert len(blind["candidates"]) >= 20
    assert {k: blind["most_likely"][k] for k in SIZE_NAMES} == TRUTH[scenario]
    assert "busiest group" in blind["most_likely"]["evidence"][0] and "runner_up" in blind["most_likely"]
    assert "most likely" in out.err and "names ignored" in out.err


def test_without_behaviour_the_ranking_rests_on_the_defaults_and_says_it_is_tied():
    """Member sets of a 16-rank job and no recorded ops: only cp = 1 and etp = 1 rank, so several
    candidates tie, and the result says so instead of pretending one is more likely."""
    dumps = find_dumps(FR / "gpu_error_2nd")
    world, groups, _ = layout_input(dumps, names=False)
    res = infer_layout(world, groups)
    ml = most_likely(world, res.candidates, None)
    assert ml["cp"] == 1 and ml["etp"] == 1 and ml["tied"] >= 1
    # behaviour separates them
    assert "tied" not in most_likely(world, res.candidates, group_ops(dumps))


def test_the_real_captures_dumps_name_tp_and_pp_and_keep_pp_and_embedding_apart(tmp_path, capsys):
    """The 4-rank H200 capture's dumps (any file name): tp = 2 and pp = 2 exact from the names;
    the pipeline and embedding groups share their members and stay two groups."""
    d = tmp_path / "dumps"
    shutil.copytree(CAPTURE_FR, d)
    for f in d.iterdir():
        f.rename(d / f"rank-dump-{f.stem[-1]}.bin")
    assert main(["infer-layout", str(d)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {k: res["sizes"][k] for k in ("tp", "cp", "dp", "pp")} == {"tp": 2, "cp": 1, "dp": 1, "pp": 2}
    descs = [g.get("desc") for g in res["groups"] if g["ranks"] == [0, 2]]
    assert sorted(descs) == ["EMBEDDING_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP"]


def test_a_directory_without_dumps_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("nothing here")
    assert main(["infer-layout", str(tmp_path)]) == 2
    assert "no Flight Recorder dump" in capsys.readouterr().err


def test_a_dump_names_the_one_communicator_whose_calls_end_as_its_entries_and_nothing_it_cannot_place(tmp_path):
    """Rank 0's dump: group "1" (members 0, 1) recorded three all-gathers of 8 elements. Of the
    process's two communicators with those members only one logged them last; a dump of rank 5,
    which no process has, names nothing and says so."""
    import pandas as pd

    from nccltrace.communicators.names import name_by_flight_recorder
    from nccltrace.pytorch.flight_recorder import FlightRecorderDump

    comms = pd.DataFrame({"logical_id": [0, 1], "members": [[0, 1], [0, 1]]})
    members = pd.DataFrame({"logical_id": [0, 1, 0, 1], "host": "h", "pid": [10, 10, 11, 11],
                            "comm": [0xA, 0xB, 0xC, 0xD], "global_rank": [0, 0, 1, 1]})
    entries = [{"record_id": i, "process_group": ("1", "TENSOR_MODEL_PARALLEL_GROUP"),
                "profiling_name": "nccl:_all_gather_base", "input_sizes": [[2, 4]], "output_sizes": [[4, 4]]}
               for i in range(3)]
    dump = FlightRecorderDump(tmp_path / "d0", 0, "2.10", None, {"1": ((0, 1), "TENSOR_MODEL_PARALLEL_GROUP")},
                              entries)
    stray = FlightRecorderDump(tmp_path / "d5", 5, "2.10", None, {}, [])
    calls = pd.DataFrame({"comm": [0xB, 0xA, 0xA, 0xA, 0xB], "op": ["AllReduce"] + ["AllGather"] * 3 + ["AllReduce"],
                          "count": [8, 8, 8, 8, 8]})
    for i, e in enumerate(entries):
        e["collective_seq_id"] = 40 + i
    names, notes, seqs = name_by_flight_recorder(comms, members, [dump, stray], lambda h, p: calls)
    assert names[["logical_id", "pg_desc"]].values.tolist() == [[0, "TENSOR_MODEL_PARALLEL_GROUP"]]
    # the communicator's last three calls carry the group's sequence numbers 42, 41, 40 from the end
    assert seqs[["comm", "from_end", "pg_seq"]].values.tolist() == [[0xA, 1, 42], [0xA, 2, 41], [0xA, 3, 40]]
    assert any("rank 5" in n and "not used" in n for n in notes)


def test_a_group_that_agrees_with_its_communicator_but_for_one_call_names_it_yet_numbers_no_call(tmp_path):
    """19 of 20 entries equal the communicator's last calls: enough to name it, but the one that
    differs could be a call one side lacks, which would shift the numbers of the calls before it,
    so no call gets a sequence number."""
    import pandas as pd

    from nccltrace.communicators.names import name_by_flight_recorder
    from nccltrace.pytorch.flight_recorder import FlightRecorderDump

    comms = pd.DataFrame({"logical_id": [0], "members": [[0, 1]]})
    members = pd.DataFrame({"logical_id": [0, 0], "host": "h", "pid": [10, 11], "comm": [0xA, 0xC],
                            "global_rank": [0, 1]})
    entries = [{"record_id": i, "process_group": ("1", "TENSOR_MODEL_PARALLEL_GROUP"), "collective_seq_id": i + 1,
                "profiling_name": "nccl:_all_gather_base", "input_sizes": [[2, 4]], "output_sizes": [[4, 4]]}
               for i in range(20)]
    dump = FlightRecorderDump(tmp_path / "d0", 0, "2.10", None, {"1": ((0, 1), "TENSOR_MODEL_PARALLEL_GROUP")},
                              entries)
    counts = [8] * 20
    calls = pd.DataFrame({"comm": [0xA] * 20, "op": ["AllGather"] * 20, "count": counts})
    names, _, seqs = name_by_flight_recorder(comms, members, [dump], lambda h, p: calls)
    assert len(names) == 1 and len(seqs) == 20  # all equal: named and numbered
    counts[9] = 9
    calls = pd.DataFrame({"comm": [0xA] * 20, "op": ["AllGather"] * 20, "count": counts})
    names, _, seqs = name_by_flight_recorder(comms, members, [dump], lambda h, p: calls)
    assert names["pg_desc"].tolist() == ["TENSOR_MODEL_PARALLEL_GROUP"] and seqs.empty
