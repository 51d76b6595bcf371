"""Naming communicators by their PyTorch process groups (nccltrace.communicators.names): exact from
the kernels' records, by elimination among groups of the same members, refused with the reason
otherwise."""

from __future__ import annotations

import json

import pandas as pd

from nccltrace.communicators.labels import apply_names
from nccltrace.communicators.names import name_communicators, pg_config_of_sessions

PG = {"0": ((0, 1, 2, 3), "default_pg"), "1": ((0, 1), "TENSOR_MODEL_PARALLEL_GROUP"),
      "3": ((0, 2), "PIPELINE_MODEL_PARALLEL_GROUP"), "5": ((0, 2), "EMBEDDING_GROUP")}


def _tables(*sets):
    comms = pd.DataFrame({"logical_id": range(len(sets)), "nranks": [len(s) for s in sets], "members": list(sets)})
    members = pd.DataFrame({"logical_id": range(len(sets)), "host": "h", "pid": 1, "comm": [16 + i for i in range(len(sets))]})
    return comms, members


def _record(*groups):
    return {"host": "h", "pid": 1, "process_groups": [
        {"comm": f"0x{16 + lid:x}", "groups": [{"pg_name": n, "pg_desc": d, "calls": c} for n, d, c in g]}
        for lid, g in groups]}


def test_kernel_records_name_a_communicator_and_elimination_names_its_twin():
    comms, members = _tables((0, 1), (0, 2), (0, 2), (0, 1, 2, 3))
    rec = _record((0, [("1", "TENSOR_MODEL_PARALLEL_GROUP", 40)]), (2, [("5", "EMBEDDING_GROUP", 3)]))
    names, notes = name_communicators(comms, members, [rec], PG)
    got = {int(r.logical_id): (r.pg_desc, r.name_source) for r in names.itertuples()}
    assert got == {0: ("TENSOR_MODEL_PARALLEL_GROUP", "kernel-records"), 2: ("EMBEDDING_GROUP", "kernel-records"),
                   1: ("PIPELINE_MODEL_PARALLEL_GROUP", "elimination"), 3: ("default_pg", "elimination")}
    assert notes == []
    labels = pd.DataFrame({"logical_id": range(4), "parallelism": "collective", "parallelism_candidates": "",
                           "label_source": "heuristic", "resolution": "other"})
    named = apply_names(labels, names)
    assert named["parallelism"].tolist() == ["tp", "pp", "embd", "world"]
    assert (named["label_source"] == "pg-names").all()


def test_conflicting_records_or_members_name_nothing_and_say_why():
    comms, members = _tables((0, 1), (0, 2))
    rec = _record((0, [("1", "TENSOR_MODEL_PARALLEL_GROUP", 40), ("3", "PIPELINE_MODEL_PARALLEL_GROUP", 2)]),
                  (1, [("1", "TENSOR_MODEL_PARALLEL_GROUP", 5)]))  # group 1's members are (0, 1), not (0, 2)
    names, notes = name_communicators(comms, members, [rec], PG)
    assert 0 not in set(names["logical_id"]) and 1 not in set(names["logical_id"])
    assert any("name 2 process groups" in n for n in notes) and any("are not the communicator's" in n for n in notes)


def test_two_unnamed_communicators_with_the_same_members_are_not_guessed():
    comms, members = _tables((0, 2), (0, 2))
    names, notes = name_communicators(comms, members, [], PG)
    assert names.empty and any("2 process groups with these members" in n for n in notes)


def test_pg_config_is_read_from_every_source_of_a_nodes_session(tmp_path):
    session = {"pg_config": "[{'name': '0', 'desc': 'default_pg', 'ranks': [0, 1]}]",
               "sources": [{"pg_config": [{"name": "1", "desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [1, 0]}]}]}
    (tmp_path / "session.json").write_text(json.dumps(session))
    assert pg_config_of_sessions([tmp_path / "session.json", tmp_path / "missing.json"]) == {
        "0": ((0, 1), "default_pg"), "1": ((0, 1), "TENSOR_MODEL_PARALLEL_GROUP")}


def test_pytorchs_process_group_line_is_read_in_its_old_and_new_spellings():
    from nccltrace.pytorch.log_lines import PG_COMM_LINE, is_pg_comm_line

    old = ("I0527 15:16:57.738664 58629 ProcessGroupNCCL.cpp:2183] [PG 0 (default_pg) Rank 5] ProcessGroupNCCL "
           "created ncclComm_ 0x555b8d27b370 on CUDA device: ")
    new = ("I1128 06:14:45.000000 498 ProcessGroupNCCL.cpp:2183] [PG ID 1 PG GUID 1(TENSOR_MODEL_PARALLEL_GROUP) "
           "Rank 0] ProcessGroupNCCL created ncclComm_ 0x3ce2aa60 on CUDA device: 0")
    a, b = PG_COMM_LINE.search(old), PG_COMM_LINE.search(new)
    assert (a["id"], a["guid"], a["desc"], a["comm"]) == ("0", None, "default_pg", "0x555b8d27b370")
    assert (b["id"], b["guid"], b["desc"], b["comm"]) == ("1", "1", "TENSOR_MODEL_PARALLEL_GROUP", "0x3ce2aa60")
    assert is_pg_comm_line(new.encode()) and not is_pg_comm_line(b"ProcessGroupNCCL broadcast unique ID took 4 ms")
