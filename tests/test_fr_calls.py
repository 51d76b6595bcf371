"""Flight Recorder dumps as a call source (``pytorch/fr_calls.py``): the rows of the real
H200 capture's dumps against the workload's own record of its calls (``truth/``), the 16-rank
Megatron dumps' groups, the link of the profiler traces' call records to the dumps' entries
(figures of ``docs/evidence-sources.md`` 1.2), and damaged entries. Run with ``-s`` to see
the measured figures."""

from __future__ import annotations

import copy
import gzip
import json
from collections import Counter
from functools import cache

import pandas as pd
import pytest
from data_paths import CAPTURE, FR_MEGATRON16

from nccltrace.pytorch.collectives import (
    RECORD_COLUMNS,
    log_count,
    nccl_datatype,
    nccl_op,
    torch_collective,
)
from nccltrace.pytorch.flight_recorder import FlightRecorderDump, find_dumps, read_dump
from nccltrace.pytorch.fr_calls import (
    dump_call_records,
    link_profiler_records,
    ranks_text,
)

RANKS = range(4)
LAYOUTS = {  # the README's two layouts, per scenario
    "gpu_error_1st": {"tp": 2, "dp": 2, "pp": 4, "ep": 4},
    "lock_gil_2nd": {"tp": 2, "dp": 2, "pp": 4, "ep": 4},
    "gpu_error_2nd": {"tp": 4, "dp": 2, "pp": 2, "ep": 8},
    "lock_gil_1st": {"tp": 4, "dp": 2, "pp": 2, "ep": 8},
}
SCENARIO_ENTRIES = {"gpu_error_1st": (289, 62), "gpu_error_2nd": (278, 60), "lock_gil_1st": (142, 24),
                    "lock_gil_2nd": (216, 48)}  # fmt: skip


def _group_size(desc: str, lay: dict[str, int]) -> int:
    """A Megatron group's size from the parallel sizes (world 16, cp = etp = 1)."""
    tp, dp, pp, ep = lay["tp"], lay["dp"], lay["pp"], lay["ep"]
    return {
        "default_pg": 16, "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": 16, "DATA_PARALLEL_GROUP_WITH_CP": dp,
        "MODEL_PARALLEL_GROUP": tp * pp, "TENSOR_MODEL_PARALLEL_GROUP": tp, "PIPELINE_MODEL_PARALLEL_GROUP": pp,
        "EMBEDDING_GROUP": 2, "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": tp * dp,
        "TENSOR_AND_CONTEXT_PARALLEL_GROUP": tp, "EXPERT_MODEL_PARALLEL_GROUP": ep,
        "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ep, "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ep * pp,
        "EXPERT_DATA_PARALLEL_GROUP": 16 // (ep * pp),
    }[desc]  # fmt: skip


@cache
def _dump(rank: int) -> FlightRecorderDump:
    return read_dump(CAPTURE / "flight_recorder" / f"fr_rank{rank}.pkl")


@cache
def _fr(rank: int) -> tuple[pd.DataFrame, tuple[str, ...]]:
    messages: list[str] = []
    frame = dump_call_records(_dump(rank), f"fr_rank{rank}.pkl", messages)
    return frame, tuple(messages)


def _truth(rank: int) -> list[dict]:
    return json.loads((CAPTURE / "truth" / f"truth_rank{rank}.json").read_text())[
        "calls"
    ]


@cache
def _profiler(rank: int) -> pd.DataFrame:
    """The trace's call records (``record_param_comms`` but ``wait``) in RECORD_COLUMNS form:
    a minimal stand-in for the profiler source, enough to link."""
    path = CAPTURE / "kineto" / f"kineto_rank{rank}.json.gz"
    trace = json.loads(gzip.decompress(path.read_bytes()))
    base = int(trace["baseTimeNanoseconds"])
    events = sorted((e for e in trace["traceEvents"] if e.get("name") == "record_param_comms"
                     and e.get("args", {}).get("Collective name") != "wait"), key=lambda e: e["ts"])  # fmt: skip
    rows = []
    for i, e in enumerate(events):
        a = e["args"]
        op, ranks = nccl_op(a["Collective name"]), json.loads(a["Process Group Ranks"])
        peer = a.get("Dst Rank", a.get("Src Rank"))
        rows.append({
            "file": path.name, "record": i, "rank": trace["distributedInfo"]["rank"], "host": None, "pid": e["pid"],
            "tid": e["tid"], "torch_op": torch_collective(a["Collective name"]), "op": op, "op_source": "cpu-record",
            "count": log_count(op, a["In msg nelems"], a["Out msg nelems"], a["Group size"]),
            "datatype_name": nccl_datatype(a["dtype"]), "size_source": "cpu-record", "nranks": a["Group size"],
            "root": ranks.index(peer) if op in ("Send", "Recv") else 0, "pg_name": a["Process Group Name"],
            "pg_desc": a["Process Group Description"], "pg_ranks": ranks_text(ranks), "comm_source": "process-group",
            "pg_seq": None, "seq_source": None, "kernel_correlation_id": None,
            "record_utc": base + round(e["ts"] * 1000), "enqueue_utc": None, "started_utc": None, "ended_utc": None,
        })  # fmt: skip
    return pd.DataFrame(rows, columns=list(RECORD_COLUMNS)).astype(RECORD_COLUMNS)


def _expected(call: dict, nranks: int) -> tuple[str, int, tuple[int, ...]]:
    """(op, count as the log prints it, the group's global ranks) of a truth call; truth's
    ``ranks`` of a send/recv is the (source, destination) pair."""
    op = nccl_op(call["op"])
    count = call["numel"] // nranks if op == "AlltoAll" else call["numel"]
    return op, count, tuple(sorted(call["ranks"]))


def test_dump_rows_are_the_calls_and_agree_with_truth():
    total, figures = 0, []
    for r in RANKS:
        frame, messages = _fr(r)
        assert dict(frame.dtypes.astype(str)) == RECORD_COLUMNS and list(
            frame.columns
        ) == list(RECORD_COLUMNS)
        markers = sum(
            1 for e in _dump(r).entries if e["profiling_name"] == "nccl:coalesced"
        )
        assert (len(_dump(r).entries), markers, len(frame)) == (537, 64, 473)
        assert any("64 nccl:coalesced batch markers folded" in m for m in messages)
        assert (
            frame["record"].tolist() == list(range(473)) and (frame["rank"] == r).all()
        )
        right = Counter()
        for row, call in zip(frame.itertuples(), _truth(r), strict=True):
            op, count, ranks = _expected(call, row.nranks)
            group = tuple(json.loads(row.pg_ranks))
            right["op"] += row.op == op
            right["count"] += row.count == count
            right["dtype"] += row.datatype_name == nccl_datatype(call["dtype"])
            if op in (
                "Send",
                "Recv",
            ):  # the pair (self, peer) lies in the group; root names the peer
                peer = call["ranks"][1] if op == "Send" else call["ranks"][0]
                right["group"] += set(ranks) <= set(group) and group[row.root] == peer
            else:
                right["group"] += group == ranks
        assert right == Counter(op=473, count=473, dtype=473, group=473), (r, right)
        assert (
            frame["op_source"].eq("flight-recorder").all()
            and frame["size_source"].eq("flight-recorder").all()
        )
        assert (
            frame["seq_source"].eq("flight-recorder").all()
            and frame["comm_source"].eq("process-group").all()
        )
        assert (
            frame["started_utc"].isna().all() and frame["tid"].isna().all()
        )  # no timing; thread handle only
        assert frame.loc[frame.op == "Broadcast", "root"].isna().all()
        total += len(frame)
        figures.append(f"rank {r}: {len(frame)} rows, {markers} markers folded, op/count/dtype/group right "
                       f"{right['op']}/{right['count']}/{right['dtype']}/{right['group']} of {len(_truth(r))}")  # fmt: skip
    assert total == 1892
    print("\n".join(["", *figures, f"total {total} rows"]))


def test_sequence_numbers_are_per_group_positions_and_the_peers_group_ranks():
    for r in RANKS:
        frame, _ = _fr(r)
        seqs = {desc: g["pg_seq"].tolist() for desc, g in frame.groupby("pg_desc")}
        assert seqs["TENSOR_MODEL_PARALLEL_GROUP"] == list(range(1, 393))
        assert seqs["PIPELINE_MODEL_PARALLEL_GROUP"] == list(
            range(1, 65)
        )  # p2p_seq_id, one per send/recv
        assert (
            seqs["EMBEDDING_GROUP"] == seqs["MODEL_PARALLEL_GROUP"] == list(range(1, 9))
        )
        assert seqs["default_pg"] == [1]
        p2p = frame[frame.op.isin(["Send", "Recv"])]
        own = [json.loads(t).index(r) for t in p2p["pg_ranks"]]
        assert (
            p2p["root"] == [1 - o for o in own]
        ).all()  # two-rank groups: the other member


def test_megatron16_rows_have_their_group_named_and_sized():
    for scenario, lay in LAYOUTS.items():
        dumps, rows, p2p, nulls = find_dumps(FR_MEGATRON16 / scenario), 0, 0, 0
        for d in dumps:
            messages: list[str] = []
            frame = dump_call_records(d, d.path.name, messages)
            assert len(frame) == len(d.entries)
            assert all(
                "in state 'scheduled'" in m or "AlltoAll with uneven splits" in m
                for m in messages
            ), messages
            uneven = [e["profiling_name"] == "nccl:all_to_all" and e["input_sizes"] != e["output_sizes"]
                      for e in d.entries]  # fmt: skip
            assert frame["pg_desc"].notna().all() and frame["op"].notna().all()
            assert (
                frame["count"].isna() == uneven
            ).all()  # MoE dispatch: splits not recorded
            nulls += sum(uneven)
            assert (
                frame["nranks"] == [len(d.groups[n][0]) for n in frame["pg_name"]]
            ).all()
            assert (
                frame["nranks"] == [_group_size(desc, lay) for desc in frame["pg_desc"]]
            ).all()
            sr = frame[frame.op.isin(["Send", "Recv"])]
            assert sr["root"].notna().all() and (sr["root"] < sr["nranks"]).all()
            rows, p2p = rows + len(frame), p2p + len(sr)
        assert (rows, p2p) == SCENARIO_ENTRIES[scenario]
        print(
            f"\n{scenario}: {rows} rows ({p2p} send/recv), pg_desc on every row, nranks right for every row, "
            f"{nulls} AlltoAll of uneven splits without count"
        )


@cache
def _linked(rank: int) -> tuple[pd.DataFrame, tuple[str, ...], dict]:
    out, messages, stats = link_profiler_records(_profiler(rank), _fr(rank)[0])
    return out, tuple(messages), stats


def test_profiler_records_link_to_their_entries():
    for r in RANKS:
        out, messages, stats = _linked(r)
        assert len(out) == 177 and not messages, messages
        assert {
            k: stats[k]
            for k in (
                "linked",
                "linked_by_time",
                "unlinked",
                "contradicted",
                "fr_outside_window",
            )
        } == {
            "linked": 177,
            "linked_by_time": 177,
            "unlinked": 0,
            "contradicted": 0,
            "fr_outside_window": 296,
        }
        assert (
            out["seq_source"].eq("flight-recorder").all()
            and out["enqueue_utc"].notna().all()
        )
        assert out["size_source"].eq("cpu-record").all()  # nothing was missing
        seqs = {
            desc: (g["pg_seq"].min(), g["pg_seq"].max(), len(g))
            for desc, g in out.groupby("pg_desc")
        }
        assert seqs == {"TENSOR_MODEL_PARALLEL_GROUP": (148, 294, 147), "PIPELINE_MODEL_PARALLEL_GROUP": (25, 48, 24),
                        "EMBEDDING_GROUP": (4, 6, 3), "MODEL_PARALLEL_GROUP": (4, 6, 3)}  # fmt: skip
        lo, med, hi = stats["enqueue_after_record_ns"]
        delay = (
            out["enqueue_utc"] - out["record_utc"]
        )  # the filled times are the entries', to the ns
        assert (delay.min(), delay.max()) == (lo, hi)
        assert 5_000 <= lo and hi <= 110_000
        print(f"\nrank {r}: {stats['linked']}/177 linked, {stats['fr_outside_window']} entries outside the window, "
              f"seq {({k: tuple(map(int, v)) for k, v in seqs.items()})}, time_created {lo / 1e3:.1f}-{hi / 1e3:.1f} us after the record "
              f"(median {med / 1e3:.1f})")  # fmt: skip
    delays = [_linked(r)[2]["enqueue_after_record_ns"] for r in RANKS]
    assert (
        round(min(d[0] for d in delays) / 100) == 55
        and round(max(d[2] for d in delays) / 100) == 1087
    )


def test_send_recv_sizes_come_from_the_dump_where_the_profiler_lacks_them():
    prof = _profiler(0).copy()
    sr = prof.op.isin(["Send", "Recv"])
    prof.loc[sr, ["count", "datatype_name", "size_source"]] = None
    out, messages, stats = link_profiler_records(prof, _fr(0)[0])
    assert stats["linked"] == 177 and stats["contradicted"] == 0 and not messages
    assert (
        sr.sum() == 24
        and (out.loc[sr, "count"] == 1048576).all()
        and (out.loc[sr, "datatype_name"] == "bfloat16").all()
    )
    assert (
        out.loc[sr, "size_source"].eq("flight-recorder").all()
        and out.loc[~sr, "size_source"].eq("cpu-record").all()
    )


def test_rows_without_a_time_fit_are_linked_by_position_and_disagreements_are_named():
    prof = _profiler(1).copy()
    tp = prof.index[prof.pg_desc == "TENSOR_MODEL_PARALLEL_GROUP"]
    prof.loc[tp[:5], "record_utc"] = (
        None  # the first five TP records: no time to link by
    )
    prof.loc[tp[10], "count"] = 7  # a disagreement
    out, messages, stats = link_profiler_records(prof, _fr(1)[0])
    assert (stats["linked"], stats["linked_by_position"], stats["contradicted"]) == (
        177,
        5,
        1,
    )
    assert out.loc[tp[:5], "pg_seq"].tolist() == [148, 149, 150, 151, 152]
    row = prof.loc[tp[10], "record"]
    fr = _fr(1)[0]
    entry = fr.loc[(fr.pg_name == "1") & (fr.pg_seq == 158), "record"].item()
    said = (
        f"kineto_rank1.json.gz record {row} (Flight Recorder fr_rank1.pkl row {entry}): "
        "count 7 (profiler) vs 524288 (Flight Recorder)"
    )
    assert messages == [said]


def test_records_of_another_rank_or_clock_are_not_linked():
    _, messages, stats = link_profiler_records(_profiler(0), _fr(1)[0])
    assert (
        stats["linked"] == 0
        and stats["unlinked"] == 177
        and "nothing linked" in messages[0]
    )
    late = _profiler(0).copy()
    late["record_utc"] += 10**9  # a clock a second off: no entry fits any record
    _, messages, stats = link_profiler_records(late, _fr(0)[0])
    assert (
        stats["linked"] == 0
        and sum("do the clocks differ?" in m for m in messages) == 4
    )


def _entry(**kw) -> dict:
    e = {"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1, "p2p_seq_id": 0,
         "op_id": 1, "profiling_name": "nccl:all_reduce", "time_created_ns": 10**18, "input_sizes": [[4, 2]],
         "input_dtypes": ["Float"], "output_sizes": [[4, 2]], "output_dtypes": ["Float"], "state": "completed",
         "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": True,
         "timeout_ms": 600000, "is_p2p": False}  # fmt: skip
    return e | kw


def _synthetic(entries: list[dict]) -> FlightRecorderDump:
    groups = {
        "0": ((0, 1), "default_pg"),
        "3": ((1, 3), "PIPELINE_MODEL_PARALLEL_GROUP"),
    }
    return FlightRecorderDump(CAPTURE / "x", 1, "2.10", None, groups, entries)


def test_damaged_entries_give_null_facts_and_a_message_never_an_exception():
    entries = [
        _entry(record_id=0),
        _entry(record_id=1, input_sizes=None, output_sizes="?"),  # sizes missing
        _entry(record_id=2, profiling_name="nccl:frobnicate", collective_seq_id="x"),  # unknown collective
        _entry(record_id=3, process_group=("9", "LAZY_GROUP"), profiling_name="nccl:all_to_all"),  # not in pg_config
        _entry(record_id=4, profiling_name=None, process_group=None, input_dtypes=["Float", "Half"]),
        _entry(record_id=5, profiling_name="nccl:send 0->1", process_group=("3", "PIPELINE_MODEL_PARALLEL_GROUP"),
               is_p2p=True, p2p_seq_id=3, collective_seq_id="x"),
        _entry(record_id=6, profiling_name="nccl:recv 1<-0", process_group=("3", "PIPELINE_MODEL_PARALLEL_GROUP"),
               is_p2p=True, p2p_seq_id=4, state="scheduled"),  # 1 is not rank 1's own rank in [1, 3]
        _entry(record_id=7, profiling_name="nccl:coalesced", input_sizes=[], output_sizes=[], p2p_seq_id=4),
    ]  # fmt: skip
    messages: list[str] = []
    frame = dump_call_records(_synthetic(entries), "bad.pkl", messages)
    assert dict(frame.dtypes.astype(str)) == RECORD_COLUMNS and len(frame) == 7
    f = frame.set_index("record")
    assert f.loc[0, ["op", "count", "datatype_name", "root", "pg_ranks"]].tolist() == ["AllReduce", 8, "float32", 0,
                                                                                       "[0, 1]"]  # fmt: skip
    assert (
        pd.isna(f.loc[1, "count"])
        and pd.isna(f.loc[1, "size_source"])
        and f.loc[1, "op"] == "AllReduce"
    )
    assert (
        pd.isna(f.loc[2, "op"])
        and f.loc[2, "torch_op"] == "frobnicate"
        and pd.isna(f.loc[2, "count"])
    )
    assert (
        f.loc[3, "pg_desc"] == "LAZY_GROUP"
        and pd.isna(f.loc[3, "pg_ranks"])
        and pd.isna(f.loc[3, "nranks"])
    )
    assert f.loc[3, "op"] == "AlltoAll" and pd.isna(
        f.loc[3, "count"]
    )  # the count per peer needs the group size
    assert (
        pd.isna(f.loc[4, "op"])
        and pd.isna(f.loc[4, "pg_name"])
        and pd.isna(f.loc[4, "datatype_name"])
    )
    assert f.loc[5, ["op", "root", "pg_seq", "nranks"]].tolist() == ["Send", 1, 3, 2]
    assert (
        f.loc[6, "op"] == "Recv"
        and pd.isna(f.loc[6, "root"])
        and pd.isna(f.loc[2, "pg_seq"])
    )
    text = "\n".join(messages)
    for said in ["(record_id 1): input_sizes/output_sizes missing", "'nccl:frobnicate' is no collective",
                 "group '9' is not in the dump's pg_config", "AlltoAll: no element count", "no profiling_name",
                 "no process_group", "several dtypes", "does not fit rank 1 in group [1, 3]",
                 "1 nccl:coalesced batch markers folded", "1 of 7 calls in state 'scheduled' when dumped"]:  # fmt: skip
        assert said in text, said
    print("\n" + text)


def test_gpu_timing_when_the_dump_has_it():
    timed = _entry(record_id=0, time_discovered_started_ns=2 * 10**18, duration_ms=1.25)
    messages: list[str] = []
    frame = dump_call_records(
        _synthetic([timed, _entry(record_id=1, duration_ms=3.0)]), "t.pkl", messages
    )
    assert frame[["started_utc", "ended_utc"]].iloc[0].tolist() == [
        2 * 10**18,
        2 * 10**18 + 1_250_000,
    ]
    assert (
        frame[["started_utc", "ended_utc"]].iloc[1].isna().all()
    )  # a duration without a start: no times
    assert any("1 calls with TORCH_NCCL_ENABLE_TIMING times" in m for m in messages)


def test_entries_are_rows_in_record_order():
    entries = [_entry(record_id=i, collective_seq_id=i + 1) for i in (2, 0, 1)]
    frame = dump_call_records(_synthetic(copy.deepcopy(entries)), "o.pkl")
    assert frame["pg_seq"].tolist() == [1, 2, 3] and frame["record"].tolist() == [
        0,
        1,
        2,
    ]


@pytest.mark.parametrize("rank", RANKS)
def test_the_dump_rank_is_the_rows_rank(rank):
    assert _dump(rank).rank == rank and set(_fr(rank)[0]["rank"]) == {rank}
