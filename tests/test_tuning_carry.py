"""A collective's TUNING line, printed on its communicator's rank 0 only, as evidence on every
member (nccltrace.align.tuning_carry): carried where the call is the same one for certain (by
opCount, or by log time with a margin), never by the k-th position alone."""

from __future__ import annotations

import numpy as np
import pandas as pd

from nccltrace.align.correlate import align_process
from nccltrace.align.sequences import attach_tuning
from nccltrace.align.tuning_carry import (
    carry_tuning,
    donor_facts,
    time_pairs,
    tuning_donors,
)

N = 10
LOST_KERNEL, LOST_LINE = 4, 5  # on the member: call 4's kernel record and call 5's line are lost
RANK0_LOST_LINE = 7  # on rank 0: call 7's line is lost (so the k-th call differs after it)
COUNT = [65536 if i % 2 == 0 else 1024 for i in range(N)]  # 256 KiB and 4 KiB float all-reduces
CHANNELS = [4 if c == 65536 else 2 for c in COUNT]  # one channel count per size, as NCCL's tuning gives
PERIOD_NS, SKEW_NS = 100_000, 3_000  # calls 100 us apart; the member logs each 3 us after rank 0


def _calls(calls: list[int], *, file: str, pid: int, comm: int, skew: int = 0, op_count=None) -> pd.DataFrame:
    n = len(calls)
    df = pd.DataFrame({
        "file": file, "line": np.asarray(calls) * 2 + 1, "host": "h", "pid": pid, "tid": pid, "op": "AllReduce",
        "count": [COUNT[i] for i in calls], "datatype": 7, "nranks": 2, "root": 0,
        "bytes": [COUNT[i] * 4 for i in calls], "redop": 0,
    })  # fmt: skip
    df["op_count"] = pd.array(op_count if op_count is not None else [0] * n, dtype="Int64")  # frozen: no order
    df["comm"] = pd.array([comm] * n, dtype="UInt64")
    df["stream"] = pd.array([100] * n, dtype="UInt64")
    df["duplicate_of"] = pd.array([pd.NA] * n, dtype="Int64")
    df["wall_time_ns"] = pd.array(1_760_000_000_000_000_000 + np.asarray(calls) * PERIOD_NS + skew, dtype="Int64")
    return df


def _tuning(calls: list[int], file: str) -> pd.DataFrame:
    """rank 0's TUNING line of each call (the >= 2.24 format), the line after the call's."""
    return pd.DataFrame({
        "file": file, "line": np.asarray(calls) * 2 + 2, "kind": "standard", "format": "op_bytes_named",
        "op": "AllReduce", "algo": "RING", "proto": "SIMPLE", "channel_lo": 0,
        "channel_hi": np.asarray([CHANNELS[i] for i in calls]) - 1, "call_line": np.asarray(calls) * 2 + 1,
        "n_calls": 1,
    })  # fmt: skip


def _kernels(ran: list[int]) -> pd.DataFrame:
    """The member's kernels (grid = the call's channel count), on a clock the log cannot be put
    on (no UTC anchor is given to the alignment), so log time does not order them."""
    n = len(ran)
    launch = np.arange(n) * 100_000 + 1_000_000
    short = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    return pd.DataFrame({
        "start": launch + 5_000, "end": launch + 25_000, "device_id": 0, "context_id": 1, "stream_id": 13,
        "correlation_id": pd.array(np.arange(1, n + 1), dtype="Int64"),
        "global_pid": pd.array([2 << 24] * n, dtype="Int64"), "pid": pd.array([2] * n, dtype="Int64"),
        "name": short + "(ncclDevKernelArgsStorage<4096ul>)", "short_name": short,
        "grid_x": [CHANNELS[i] for i in ran], "grid_y": 1, "grid_z": 1, "launch_start": pd.array(launch, dtype="Int64"),
        "launch_end": pd.array(launch + 2_000, dtype="Int64"), "launch_tid": pd.array([2] * n, dtype="Int64"),
    })  # fmt: skip


def _matches(table: pd.DataFrame, ran: list[int]) -> dict[int, int | None]:
    """member call -> call whose kernel it was matched to (None: unmatched)."""
    calls = table[table["row_kind"] == "call"]
    return {(int(line) - 1) // 2: None if pd.isna(corr) else ran[int(corr) - 1]
            for line, corr in zip(calls["line"], calls["kernel_correlation_id"], strict=True)}  # fmt: skip


def _rank0_facts(op_count=None) -> pd.DataFrame:
    logged0 = [i for i in range(N) if i != RANK0_LOST_LINE]
    calls0 = _calls(logged0, file="nccl_h_1.log", pid=1, comm=10, op_count=op_count)
    return donor_facts(calls0, _tuning(logged0, "nccl_h_1.log"))


def test_rank0s_tuning_lines_carried_by_log_time_rule_out_the_members_wrong_match():
    """The issue's shape on a member (rank 1) of a 2-rank communicator: identical-looking calls
    (opCount frozen), the member lost call 4's kernel and call 5's line, so the gap-free
    alignment gives call 4 call 5's kernel, whose grid is 2 where rank 0's TUNING line for call 4
    says 4 channels. Rank 0 lost another line (7), so the k-th call is not the same call after it;
    the logs' times pair them anyway, and with rank 0's facts the wrong match is gone."""
    logged = [i for i in range(N) if i != LOST_LINE]
    ran = [i for i in range(N) if i != LOST_KERNEL]
    member = _calls(logged, file="nccl_h_2.log", pid=2, comm=20, skew=SKEW_NS)
    without = _matches(align_process(member, _kernels(ran)), ran)
    assert without[LOST_KERNEL] == LOST_LINE  # the wrong match this evidence exists for
    table = align_process(member, _kernels(ran), carried_tuning={20: _rank0_facts()}, quality=(q := {}))
    got = _matches(table, ran)
    assert all(got[c] in (c, None) for c in logged), got
    assert got[LOST_KERNEL] is None and sum(v is not None for v in got.values()) >= 6, got
    check = next(c for c in q["checks"] if c["check"] == "tuning")
    # every member call but call 7 (whose rank-0 line is lost) got rank 0's facts, by log time
    assert check["carried_from_rank0"] == {"by_opcount": 0, "by_log_time": len(logged) - 1}
    assert check["facts"]["grid_used"] and not check["stood_down"]


def test_a_line_whose_partner_was_lost_is_paired_with_no_neighbour():
    """Times of two ranks' lines of one communicator: each line pairs with its own partner, a
    line whose partner is lost with none (its nearest line is a neighbour's, 100 us away), and
    lines too close to their neighbours for the skew (a burst) pair with none."""
    t0 = np.arange(10) * PERIOD_NS
    rank0 = np.delete(t0, 6)
    member = np.delete(t0, 3) + SKEW_NS
    j = time_pairs(member, rank0)
    partner = {int(m): (None if k < 0 else int(rank0[k])) for m, k in zip(member - SKEW_NS, j, strict=True)}
    assert partner[6 * PERIOD_NS] is None
    assert all(partner[t] == t for t in partner if t != 6 * PERIOD_NS)
    burst = np.array([0, 10_000, 20_000, 30_000])
    assert (time_pairs(burst + 6_000, burst) == -1).all()  # 6 us skew, 10 us apart: not certain


def test_a_member_one_call_behind_or_on_another_hosts_clock_gets_nothing_by_time():
    """A member that logs each call when rank 0 logs the next pairs every line with the wrong one
    at a margin times cannot see; the pairs join calls of different sizes, so nothing is carried
    on that communicator. Logs of another host are on a clock nothing relates: nothing either."""
    logged = list(range(N))
    facts = donor_facts(_calls(logged, file="nccl_h_1.log", pid=1, comm=10), _tuning(logged, "nccl_h_1.log"))
    behind = attach_tuning(_calls(logged, file="nccl_h_2.log", pid=2, comm=20, skew=PERIOD_NS + SKEW_NS), None)
    assert carry_tuning(behind, {20: facts})[1]["by_log_time"] == 0
    # sizes A A B A A B ...: one call behind, some pairs join two A calls, the others A and B
    pattern = [65536 if i % 3 < 2 else 1024 for i in logged]
    facts_aab = facts.assign(count=pattern, tuned_channels=pd.array([4 if c == 65536 else 2 for c in pattern],
                                                                    dtype="Int64"))  # fmt: skip
    behind_aab = behind.assign(count=pattern)
    assert carry_tuning(behind_aab, {20: facts_aab})[1]["by_log_time"] == 0
    in_step = attach_tuning(_calls(logged, file="nccl_h_2.log", pid=2, comm=20, skew=SKEW_NS), None)
    assert carry_tuning(in_step, {20: facts})[1]["by_log_time"] == N
    far = donor_facts(_calls(logged, file="nccl_g_1.log", pid=1, comm=10), _tuning(logged, "nccl_g_1.log"),
                      same_clock=False)  # fmt: skip
    assert carry_tuning(in_step, {20: far})[1]["by_log_time"] == 0


def test_by_opcount_the_facts_are_carried_only_where_opcount_names_the_call():
    """An informative opCount names the same collective on every member; it does not where the
    communicator also carries Send/Recv lines (they advance only their ranks' counts), nor for
    an opCount shared by a group of calls."""
    counts = list(range(N))
    logged = [i for i in range(N) if i != LOST_LINE]
    facts = _rank0_facts(op_count=[c for c in counts if c != RANK0_LOST_LINE])
    member = attach_tuning(_calls(logged, file="nccl_h_2.log", pid=2, comm=20,
                                  op_count=[c for c in counts if c != LOST_LINE]), None)  # fmt: skip
    member["wall_time_ns"] = pd.array([pd.NA] * len(member), dtype="Int64")  # no time: opCount alone
    got, n = carry_tuning(member, {20: facts})
    assert n == {"by_opcount": len(logged) - 1, "by_log_time": 0}
    right = got["tuned_channels"].notna()
    assert (got.loc[right, "tuned_channels"].to_numpy() == [CHANNELS[(line - 1) // 2] for line in
                                                            got.loc[right, "line"]]).all()  # fmt: skip
    with_p2p = pd.concat([member, member.iloc[[0]].assign(op="Send", line=999)], ignore_index=True)
    assert carry_tuning(with_p2p, {20: facts})[1]["by_opcount"] == 0
    grouped = member.copy()
    grouped.loc[1, "op_count"] = 0  # calls 0 and 1 in one group: one opCount
    assert carry_tuning(grouped, {20: facts})[1]["by_opcount"] == len(logged) - 3  # the group's two are not


def test_by_log_time_facts_rank0_does_not_give_uniformly_for_a_size_are_not_carried():
    """If rank 0's TUNING lines of one op and size say different things (a tuner that changes
    its choice), a pairing by time could carry the wrong one: those calls get nothing."""
    logged0 = list(range(N))
    tuning = _tuning(logged0, "nccl_h_1.log")
    tuning.loc[tuning["call_line"] == 2 * 2 + 1, "channel_hi"] = 7  # call 2 (256 KiB) says 8, the others 4
    facts = donor_facts(_calls(logged0, file="nccl_h_1.log", pid=1, comm=10), tuning)
    member = attach_tuning(_calls(logged0, file="nccl_h_2.log", pid=2, comm=20, skew=SKEW_NS), None)
    got, n = carry_tuning(member, {20: facts})
    assert n["by_log_time"] == sum(1 for c in COUNT if c == 1024)  # only the 4 KiB calls
    assert got.loc[got["count"] == 65536, "tuned_channels"].isna().all()


def test_rank0_is_found_per_logical_communicator_and_a_reused_pointer_gives_none():
    members = pd.DataFrame({
        "logical_id": [0, 0, 1, 1, 2, 2, 2], "host": ["a", "b", "a", "b", "b", "b", "a"],
        "pid": [1, 2, 1, 2, 2, 2, 1], "comm": [10, 20, 11, 21, 22, 22, 12], "rank_in_comm": [0, 1, 1, 0, 1, 1, 0],
    })  # fmt: skip
    assert tuning_donors(members, "b", 2) == {20: ("a", 1, 10)}  # comm 22 names two ranks of b:2: none
    assert tuning_donors(members, "a", 1) == {11: ("b", 2, 21)}
