"""A call's own TUNING line as evidence for its kernel (issue: never silently wrong): the kernel's
grid is the line's channel count and its name carries the line's algorithm (NCCL 2.28.9, every
window call of the real capture), used only where the run's certain matches bear it out."""

from __future__ import annotations

import numpy as np
import pandas as pd

from nccltrace.align.correlate import align_process
from nccltrace.align.sequences import (
    attach_tuning,
    kernel_algorithm,
    normalise_algorithm,
)

N = 10
LOST_KERNEL, LOST_LINE = 4, 5  # call 4's kernel record and call 5's line are lost
GRIDS = [8 if i % 2 == 0 else 2 for i in range(N)]


def _calls(lines: list[int]) -> pd.DataFrame:
    n = len(lines)
    df = pd.DataFrame({
        "file": "nccl_h_1.log", "line": np.asarray(lines) * 2 + 1, "host": "h", "pid": 1, "tid": 1, "op": "AllReduce",
        "count": 1024, "datatype": 7, "nranks": 2, "root": 0, "bytes": 4096, "redop": 0,
    })  # fmt: skip
    df["op_count"] = pd.array([0] * n, dtype="Int64")  # a single-node communicator of NCCL >= 2.27.3: no count
    df["comm"] = pd.array([10] * n, dtype="UInt64")
    df["stream"] = pd.array([100] * n, dtype="UInt64")
    df["duplicate_of"] = pd.array([pd.NA] * n, dtype="Int64")
    df["wall_time_ns"] = pd.array([pd.NA] * n, dtype="Int64")
    return df


def _tuning(lines: list[int], channels: list[int], algo: str = "RING") -> pd.DataFrame:
    """rank 0's TUNING line of each call, as the >= 2.24 format prints it (the line after the call's)."""
    return pd.DataFrame({
        "file": "nccl_h_1.log", "line": np.asarray(lines) * 2 + 2, "kind": "standard", "format": "op_bytes_named",
        "op": "AllReduce", "algo": algo, "proto": "SIMPLE", "channel_lo": 0, "channel_hi": np.asarray(channels) - 1,
        "call_line": np.asarray(lines) * 2 + 1, "n_calls": 1,
    })  # fmt: skip


def _kernels(grids: list[int], names: list[str] | None = None) -> pd.DataFrame:
    n = len(grids)
    short = names or ["ncclDevKernel_AllReduce_Sum_f32_RING_LL"] * n
    launch = np.arange(n) * 100_000 + 1_000_000
    return pd.DataFrame({
        "start": launch + 5_000, "end": launch + 25_000, "device_id": 0, "context_id": 1, "stream_id": 13,
        "correlation_id": pd.array(np.arange(1, n + 1), dtype="Int64"),
        "global_pid": pd.array([1 << 24] * n, dtype="Int64"), "pid": pd.array([1] * n, dtype="Int64"),
        "name": [s + "(ncclDevKernelArgsStorage<4096ul>)" for s in short], "short_name": short,
        "grid_x": grids, "grid_y": 1, "grid_z": 1, "launch_start": pd.array(launch, dtype="Int64"),
        "launch_end": pd.array(launch + 2_000, dtype="Int64"), "launch_tid": pd.array([1] * n, dtype="Int64"),
    })  # fmt: skip


def _lossy() -> tuple[list[int], list[int]]:
    """Logged calls and the calls whose kernel record is in the export."""
    return [i for i in range(N) if i != LOST_LINE], [i for i in range(N) if i != LOST_KERNEL]


def _matches(table: pd.DataFrame, kernel_calls: list[int]) -> dict[int, int | None]:
    """call -> call whose kernel it was matched to (None: unmatched)."""
    calls = table[table["row_kind"] == "call"]
    out = {}
    for line, corr in zip(calls["line"], calls["kernel_correlation_id"], strict=True):
        out[(int(line) - 1) // 2] = None if pd.isna(corr) else kernel_calls[int(corr) - 1]
    return out


def test_a_line_whose_kernel_was_lost_does_not_take_a_lost_lines_kernel_its_tuning_line_rules_out():
    """Identical calls whose lines carry no order (opCount frozen) and no time: call 4's kernel
    and call 5's line are lost, so the log and the kernels both count nine and the gap-free
    alignment pairs call 4 with call 5's kernel. Call 4's TUNING line says 8 channels, that
    kernel's grid is 2: the pair is ruled out and nothing is wrong. Calls 3 and 6 could each
    have either neighbouring kernel of their grid (nothing orders them), so they abstain too."""
    logged, ran = _lossy()
    kernels = _kernels([GRIDS[i] for i in ran])
    without = _matches(align_process(_calls(logged), kernels), ran)
    assert without[LOST_KERNEL] == LOST_LINE  # the shape this evidence exists for: a wrong match
    table = align_process(_calls(logged), kernels, tuning=_tuning(logged, [GRIDS[i] for i in logged]),
                          quality=(q := {}))  # fmt: skip
    got = _matches(table, ran)
    assert all(got[c] in (c, None) for c in logged), got
    assert got[LOST_KERNEL] is None and all(got[c] == c for c in (0, 1, 2, 7, 8, 9)), got
    check = next(c for c in q["checks"] if c["check"] == "tuning")
    assert check["facts"]["grid_used"] and check["facts"]["algo_used"] and not check["stood_down"]
    assert check["confirmed"] == sum(v is not None for v in got.values()) and not check.get("message")


def test_tuning_lines_the_run_contradicts_stand_down_and_are_named():
    """A build whose kernels' grids are not the TUNING line's channel count (every kernel runs 4
    blocks): the channel fact stands down (the alignment is the one without it), the algorithm
    fact still holds, and the quality record names what was contradicted, as a finding."""
    logged, ran = _lossy()
    kernels = _kernels([4] * len(ran))
    plain = _matches(align_process(_calls(logged), kernels), ran)
    table = align_process(_calls(logged), kernels, tuning=_tuning(logged, [GRIDS[i] for i in logged]),
                          quality=(q := {}), nccl_version="2.29.1")  # fmt: skip
    assert _matches(table, ran) == plain
    check = next(c for c in q["checks"] if c["check"] == "tuning")
    assert check["stood_down"] == ["channels = grid"] and not check["facts"]["grid_used"]
    assert check["facts"]["algo_used"]
    assert "channels = grid" in check["message"] and "NCCL 2.29.1" in check["message"]


def test_an_algorithm_the_kernel_name_does_not_carry_rules_the_pair_out():
    """Call 4's TUNING line says TREE; call 5's kernel is a RING kernel, every other call's kernel
    carries its line's algorithm: call 4 is left unmatched rather than given the RING kernel."""
    logged, ran = _lossy()
    algos = {i: ("TREE" if i == LOST_KERNEL else "RING") for i in range(N)}
    names = [f"ncclDevKernel_AllReduce_Sum_f32_{algos[i]}_LL" for i in ran]
    tuning = pd.concat([_tuning([c], [2], algos[c]) for c in logged], ignore_index=True)
    table = align_process(_calls(logged), _kernels([2] * len(ran), names), tuning=tuning)
    got = _matches(table, ran)
    assert got[LOST_KERNEL] is None and all(got[c] in (c, None) for c in logged), got


def test_evidence_the_run_cannot_verify_is_not_used():
    """Two certain matches are too few to bear out a fact (TUNING_MIN_AGREE): nothing is
    constrained by it and the record says so (neither fact used, nothing stood down)."""
    table = align_process(_calls([0, 1]), _kernels([8, 2]), tuning=_tuning([0, 1], [8, 2]), quality=(q := {}))
    assert table["kernel_correlation_id"].notna().sum() == 2
    check = next(c for c in q["checks"] if c["check"] == "tuning")
    assert not check["facts"]["grid_used"] and not check["stood_down"] and check["confirmed"] == 0


def test_only_a_tuning_line_naming_one_call_alone_is_attached():
    """Aggregates of several calls (2.20-2.23 ``n_calls``), symmetric launches and two lines
    claiming one call say nothing certain about one kernel; algorithm spellings of older formats
    are read as the kernel names spell them."""
    calls = _calls([0, 1, 2, 3])
    t = _tuning([0, 1, 2, 3], [8, 8, 8, 8], "COLLNETDIRECT")
    t.loc[1, "n_calls"] = 2
    t.loc[2, "kind"] = "symmetric"
    t = pd.concat([t, t.iloc[[3]]], ignore_index=True)
    got = attach_tuning(calls, t)
    assert got["tuned_channels"].tolist()[0] == 8 and got["tuned_channels"].isna().tolist()[1:] == [True] * 3
    assert got["tuned_algo"].tolist()[0] == "COLLNET_DIRECT"
    assert normalise_algorithm(pd.Series(["nvlstree", "Ring"])).tolist() == ["NVLS_TREE", "RING"]
    assert kernel_algorithm("ncclDevKernel_AllGather_RING_LL") == ("RING", "LL")
    assert kernel_algorithm("ncclKernel_AllReduce_TREE_LL128_Sum_float") == ("TREE", "LL128")
    assert kernel_algorithm("ncclDevKernel_SendRecv") == (None, None)
