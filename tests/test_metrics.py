"""Metrics stage: bus factors, bandwidths, wait/transfer split, stragglers, topology limits,
algorithm transition tables; on hand-built frames with known answers and on an emulated run
checked against the emulator's ground truth."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from nccltrace.core.layout import RunLayout
from nccltrace.core.tables import (
    TABLES,
    coerce_to_schema,
    read_table,
    write_table_atomic,
)
from nccltrace.metrics.compute import (
    ALGORITHM_SCHEMA,
    INSTANCE_SCHEMA,
    LIMIT_SCHEMA,
    OP_METRICS_SCHEMA,
    STRAGGLER_SCHEMA,
    bus_factor,
    compute_run_metrics,
    write_run_metrics,
)
from nccltrace.ops.build import OPS_SCHEMA

T0 = 1_760_000_000_000_000_000  # an epoch in ns: arithmetic must stay exact at this magnitude


# --------------------------------------------------------------------------------------------
# builders


def _ops(rows: list[dict]) -> pd.DataFrame:
    """An ops table (OPS_SCHEMA types) from partial rows; one process per global rank on 'node000'
    unless given. Kernel times default to the synchronised ones (one clock)."""
    out = []
    for i, r in enumerate(rows):
        rank = r.get("global_rank", 0)
        row = {"row_kind": "call", "file": f"nccl_{rank}.log", "line": 100 + i, "host": "node000",
               "pid": 1000 + rank, "comm": 0xC0 + r.get("logical_id", 0), "op_count": i, "unit": i,
               "status": "matched", "kernel_global_pid": 1000 + rank, "kernel_correlation_id": i,
               "nranks": 4, "root": 0, "logical_id": 0, "global_rank": rank, "rank_in_comm": rank,
               "parallelism": "dp", **r}  # fmt: skip
        row.setdefault("bytes", row.get("message_bytes"))
        if row["status"] != "matched":
            for k in ("kernel_start", "kernel_end", "kernel_start_sync", "kernel_end_sync", "kernel_global_pid",
                      "kernel_correlation_id"):  # fmt: skip
                row[k] = None
        else:
            row.setdefault("kernel_start", row.get("kernel_start_sync"))
            row.setdefault("kernel_end", row.get("kernel_end_sync"))
        out.append(row)
    # object columns: a None must not turn epoch-ns integers into (rounded) floats
    return coerce_to_schema(pd.DataFrame(out, dtype=object), OPS_SCHEMA)


def _instance(key: str, starts: list[int], ends: list[int], *, op: str = "AllReduce", size: int = 8_000_000,
              lid: int = 0, ranks: list[int] | None = None) -> list[dict]:  # fmt: skip
    """The rows of one collective instance; times in ns after T0."""
    ranks = ranks if ranks is not None else list(range(len(starts)))
    return [{"op": op, "message_bytes": size, "instance": key, "logical_id": lid, "global_rank": r,
             "rank_in_comm": i, "nranks": len(ranks), "kernel_start_sync": T0 + s, "kernel_end_sync": T0 + e}
            for i, (r, s, e) in enumerate(zip(ranks, starts, ends))]  # fmt: skip


def _write(dir_: Path, name: str, rows: list[dict]) -> None:
    schema = TABLES[name]
    df = coerce_to_schema(pd.DataFrame(rows, columns=schema.names), schema)
    write_table_atomic(pa.Table.from_pandas(df, schema=schema, preserve_index=False), dir_ / f"{name}.parquet")


def _dump(file: str, host: str, pid: int, system: int, line: int, links: list[tuple], total_bw: float = 240.0):
    """Rows of topology_links and topology_systems for one dump: links = (from, type, bw, to)."""
    src = {"file": file, "host": host, "pid": pid, "tid": pid, "cuda_dev": 0}
    lk = [{**src, "line": line + 1 + j, "system": system, "from_node": f, "link_type": t, "bw_gbps": bw,
           "to_node": to, "depth": 0 if f.startswith("CPU") else 1} for j, (f, t, bw, to) in enumerate(links)]
    return lk, [{**src, "line": line, "system": system, "max_bw_gbps": total_bw, "total_bw_gbps": total_bw}]


def _proc_dir(tmp: Path, host: str, pid: int, bus: int, dumps: list[tuple[int, list[tuple]]],
              comms: list[tuple[int, int]] = (), total_bw: float = 240.0) -> Path:  # fmt: skip
    """A parsed directory of one process: topology dumps ``(first line, links)`` and init lines
    ``(line, comm pointer)`` (START before each dump's line, COMPLETE after it)."""
    d = tmp / f"nccl_{host}_{pid}"
    d.mkdir(parents=True, exist_ok=True)
    file = f"nccl_{host}_{pid}.log"
    links, systems, cm = [], [], []
    for k, (line, lks) in enumerate(dumps):
        lk, sy = _dump(file, host, pid, k, line, lks, total_bw)
        links += lk
        systems += sy
    for line, comm in comms:
        base = {"file": file, "host": host, "pid": pid, "tid": pid, "cuda_dev": 0, "event": "init", "comm": comm,
                "rank": 0, "nranks": 2, "bus_id": bus}  # fmt: skip
        cm += [{**base, "line": line, "phase": "START"}, {**base, "line": line + 50, "phase": "COMPLETE"}]
    if not cm:
        cm = [{"file": file, "line": 1, "host": host, "pid": pid, "tid": pid, "cuda_dev": 0, "event": "init",
               "phase": "COMPLETE", "comm": 0xAA, "rank": 0, "nranks": 1, "bus_id": bus}]  # fmt: skip
    _write(d, "topology_links", links)
    _write(d, "topology_systems", systems)
    _write(d, "comms", cm)
    return d


def _mesh(buses: list[int], per_peer: float, cpu_of=lambda b: 0, nics: list[tuple[int, float, int]] = (),
          pci: float = 24.0, sys_bw: float = 10.0) -> list[tuple]:  # fmt: skip
    """Link rows of a node as NCCL prints them: GPUs below their CPU with NVLinks to every peer
    (per_peer = 0: PCIe only), NICs (bus, NET bw, cpu), SYS between the CPUs."""
    rows, cpus = [], sorted({cpu_of(b) for b in buses} | {c for _, _, c in nics})
    for c in cpus:
        for b in (x for x in buses if cpu_of(x) == c):
            rows.append((f"CPU/{c}", "PCI", pci, f"GPU/0-{b:x}"))
            rows += [(f"GPU/0-{b:x}", "NVL", per_peer, f"GPU/{p:X}") for p in buses if p != b and per_peer]
        for nb, bw, nc in nics:
            if nc == c:
                rows += [(f"CPU/{c}", "PCI", pci, f"NIC/0-{nb:x}"), (f"NIC/0-{nb:x}", "NET", bw, f"NET/{nb}")]
        rows += [(f"CPU/{c}", "SYS", sys_bw, f"CPU/{o}") for o in cpus if o != c]
    return rows


def _comm_ops(members: list[tuple[str, int, int]], lid: int = 0) -> pd.DataFrame:
    """One timed AllReduce instance on a communicator of (host, pid, global rank) members."""
    n = len(members)
    rows = [{"op": "AllReduce", "message_bytes": 1 << 20, "logical_id": lid, "nranks": n, "host": h, "pid": p,
             "global_rank": g, "rank_in_comm": i, "comm": 0xC0 + lid, "instance": f"{lid}:0",
             "file": f"nccl_{h}_{p}.log", "kernel_start_sync": T0, "kernel_end_sync": T0 + 100_000}
            for i, (h, p, g) in enumerate(members)]  # fmt: skip
    return _ops(rows)


# --------------------------------------------------------------------------------------------
# bus factors


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
@pytest.mark.parametrize(
    "op,formula",
    [
        ("AllReduce", lambda n: 2 * (n - 1) / n),
        ("AllGather", lambda n: (n - 1) / n),
        ("ReduceScatter", lambda n: (n - 1) / n),
        ("AlltoAll", lambda n: (n - 1) / n),
        ("Broadcast", lambda n: 1.0),
        ("Reduce", lambda n: 1.0),
        ("Send", lambda n: 1.0),
        ("Recv", lambda n: 1.0),
        ("SendRecv", lambda n: 1.0),
    ],
)
def test_bus_factor_follows_the_nccl_tests_formulas(op, formula, n):
    assert bus_factor(op, n) == pytest.approx(formula(n), rel=1e-12)


def test_bus_factor_of_a_single_rank_communicator_is_undefined_and_bad_input_raises():
    # nothing crosses a link on one rank: NaN (a null in the tables), never 0 or 1
    for op in ("AllReduce", "AllGather", "Broadcast", "Send"):
        assert math.isnan(bus_factor(op, 1))
    assert bus_factor("AllReduce", 4) == 1.5 and bus_factor("AllGather", 8) == 0.875
    with pytest.raises(ValueError):
        bus_factor("AllReduce", 0)
    with pytest.raises(ValueError):
        bus_factor("PutSignal", 4)


# --------------------------------------------------------------------------------------------
# bandwidth of single ops


def test_algbw_and_busbw_from_known_durations():
    ops = _ops([
        # 8 MB in 100 us: 80 GB/s; AllReduce on 4 ranks: x 1.5
        {"op": "AllReduce", "message_bytes": 8_000_000, "kernel_start_sync": T0, "kernel_end_sync": T0 + 100_000},
        # AllGather on 8 ranks, S = per-rank 1 MB x 8 (as ops computes it): 8 MB in 50 us = 160 GB/s, x 7/8
        {"op": "AllGather", "message_bytes": 8_000_000, "bytes": 1_000_000, "nranks": 8, "logical_id": 1,
         "kernel_start_sync": T0, "kernel_end_sync": T0 + 50_000},
        # Send on 2 ranks: factor 1
        {"op": "Send", "message_bytes": 3_000_000, "nranks": 2, "logical_id": 2, "root": 1,
         "kernel_start_sync": T0, "kernel_end_sync": T0 + 1_000_000},
    ])  # fmt: skip
    om = compute_run_metrics(ops, []).op_metrics
    assert list(om["duration_ns"]) == [100_000, 50_000, 1_000_000]
    assert om["algbw_gbps"].tolist() == pytest.approx([80.0, 160.0, 3.0])
    assert om["bus_factor"].tolist() == pytest.approx([1.5, 0.875, 1.0])
    assert om["busbw_gbps"].tolist() == pytest.approx([120.0, 140.0, 3.0])
    assert om["kernel_busbw_gbps"].tolist() == pytest.approx([120.0, 140.0, 3.0])
    assert list(om["kernel_calls"]) == [1, 1, 1]


def test_a_fused_send_recv_kernel_gets_the_bandwidth_of_the_whole_kernel():
    # one SendRecv kernel runs 2 Sends (1 MB each) and 2 Recvs (2 MB each) in 100 us
    rows = [{"op": op, "message_bytes": b, "nranks": 4, "root": peer, "kernel_correlation_id": 7,
             "kernel_start_sync": T0, "kernel_end_sync": T0 + 100_000}
            for op, b, peer in [("Send", 1_000_000, 1), ("Send", 1_000_000, 2), ("Recv", 2_000_000, 1),
                                ("Recv", 2_000_000, 2)]]  # fmt: skip
    om = compute_run_metrics(_ops(rows), []).op_metrics
    assert list(om["kernel_calls"]) == [4] * 4
    assert om["busbw_gbps"].tolist() == pytest.approx([10.0, 10.0, 20.0, 20.0])  # the call's own share
    # bus bytes of the kernel: max(2 MB sent, 4 MB received) = 4 MB in 100 us
    assert om["kernel_busbw_gbps"].tolist() == pytest.approx([40.0] * 4)
    assert set(om["limit_scope"]) == {"communicator"}  # several peers: not a pair


def test_unmatched_ops_get_null_time_figures_never_invented_ones():
    rows = _instance("0:0", [0, 0, 0, 0], [100_000] * 4)
    rows[1]["status"] = "unmatched"
    rows.append({"op": "AllReduce", "message_bytes": 64, "status": "unmatched", "nranks": 1, "logical_id": 5,
                 "instance": None})  # fmt: skip
    om = compute_run_metrics(_ops(rows), []).op_metrics
    un = om[om["status"] == "unmatched"]
    for col in ("duration_ns", "algbw_gbps", "busbw_gbps", "kernel_busbw_gbps", "wait_ns", "transfer_ns",
                "transfer_busbw_gbps", "arrival_skew_ns", "efficiency", "transfer_efficiency", "algorithm"):
        assert un[col].isna().all(), col
    assert list(un["message_bytes"]) == [8_000_000, 64]  # what the log says is kept
    assert om.loc[om["status"] == "matched", "busbw_gbps"].notna().all()
    assert om["bus_factor"].isna().tolist() == [False] * 4 + [True]  # single-rank communicator


# --------------------------------------------------------------------------------------------
# wait, transfer, skew, stragglers


def test_wait_transfer_and_skew_of_a_four_rank_instance():
    # ranks arrive at 0, 10, 30, 50 us and finish together at 100 us: the last arrival is at 50
    starts, ends = [0, 10_000, 30_000, 50_000], [100_000, 100_100, 99_900, 100_000]
    m = compute_run_metrics(_ops(_instance("0:0", starts, ends)), [])
    om = m.op_metrics
    assert list(om["wait_ns"]) == [50_000, 40_000, 20_000, 0]
    assert list(om["transfer_ns"]) == [50_000, 50_100, 49_900, 50_000]
    assert list(om["arrival_offset_ns"]) == starts
    assert set(om["arrival_skew_ns"]) == {50_000}
    assert (om["wait_ns"] + om["transfer_ns"] == om["duration_ns"]).all()
    # 8 MB x 1.5 over the transfer time, beside the naive kernel-duration value
    assert om["transfer_busbw_gbps"].tolist() == pytest.approx([12e6 / t for t in om["transfer_ns"]])
    assert om["busbw_gbps"].tolist() == pytest.approx([12e6 / d for d in om["duration_ns"]])
    inst = m.instances.iloc[0]
    assert inst["status"] == "complete" and pd.isna(inst["reason"])
    assert inst["first_start_ns"] == T0 and inst["last_start_ns"] == T0 + 50_000  # exact at epoch magnitude
    assert inst["arrival_skew_ns"] == 50_000 and inst["end_skew_ns"] == 200
    assert inst["last_rank"] == 3 and inst["total_wait_ns"] == 110_000
    assert inst["transfer_ns"] == 50_100
    assert inst["transfer_busbw_gbps"] == pytest.approx(12e6 / 50_100)


def test_wait_is_clipped_to_the_kernel_duration():
    # rank 0's kernel ends (clock error or not) before rank 3 starts: wait = its whole duration
    m = compute_run_metrics(_ops(_instance("0:0", [0, 0, 0, 50_000], [40_000, 90_000, 90_000, 90_000])), [])
    om = m.op_metrics
    assert om["wait_ns"].tolist() == [40_000, 50_000, 50_000, 0]
    assert om["transfer_ns"].tolist() == [0, 40_000, 40_000, 40_000]
    assert pd.isna(om["transfer_busbw_gbps"].iloc[0])  # no transfer time: no bandwidth, not infinity
    assert any("ended before the last rank started" in p for p in m.problems)


def test_straggler_attribution_counts_last_arrivals_and_the_wait_they_cause():
    rows = (_instance("0:0", [0, 5, 9, 2], [20] * 4)  # rank 2 last: others wait 9 + 4 + 7 = 20
            + _instance("0:1", [100, 100, 140, 110], [200] * 4)  # rank 2 last: 40 + 40 + 30 = 110
            + _instance("0:2", [300, 330, 300, 300], [400] * 4)  # rank 1 last: 30 x 3 = 90
            + _instance("0:3", [500, 520, 520, 500], [600] * 4))  # ranks 1 and 2 tie: nobody  # fmt: skip
    m = compute_run_metrics(_ops(rows), [])
    assert m.instances["last_rank"].tolist()[:3] == [2, 2, 1] and pd.isna(m.instances["last_rank"].iloc[3])
    s = m.stragglers.set_index("global_rank")
    assert s["instances"].tolist() == [4, 4, 4, 4]
    assert s["last_arrivals"].tolist() == [0, 1, 2, 0]
    assert s["last_share"].tolist() == pytest.approx([0, 0.25, 0.5, 0])
    assert s["wait_caused_ns"].tolist() == [0, 90, 130, 0]
    assert s.loc[0, "own_wait_ns"] == 9 + 40 + 30 + 20
    assert s.loc[2, "mean_arrival_offset_ns"] == pytest.approx((9 + 40 + 0 + 20) / 4)
    assert set(s["parallelism"]) == {"dp"} and set(s["nranks"]) == {4}


def test_instances_a_step_window_capture_left_out_are_not_captured_not_incomplete():
    outside = _instance("0:0", [0, 10, 20, 30], [100] * 4)
    for r in outside:
        r.update(status="unmatched", reason="outside_capture")
    # one rank's call outside the window while the others were captured: a real gap
    straddling = _instance("0:1", [0, 10, 20, 30], [100] * 4)
    straddling[3].update(status="unmatched", reason="outside_capture")
    good = _instance("0:2", [0, 10, 20, 30], [100] * 4)
    m = compute_run_metrics(_ops(outside + straddling + good), [])
    inst = m.instances.set_index("instance")
    assert inst["status"].to_dict() == {"0:0": "not_captured", "0:1": "incomplete", "0:2": "complete"}
    assert inst.loc["0:0", "reason"] == "outside the capture window"
    # only the real gap is a problem
    assert [p for p in m.problems if "instances" in p] == [
        "1 of 3 collective instances incomplete: no wait/transfer figures for them (see instances.reason)"]


def test_incomplete_and_unsynchronised_instances_are_excluded_with_a_reason():
    missing = _instance("0:0", [0, 10, 20], [100] * 3, ranks=[0, 1, 2])
    for r in missing:
        r["nranks"] = 4  # one member's call is absent
    unmatched = _instance("0:1", [0, 10, 20, 30], [100] * 4)
    unmatched[3]["status"] = "unmatched"
    unsynced = _instance("0:2", [0, 10, 20, 30], [100] * 4)
    unsynced[2].update(host="node001", kernel_start_sync=None, kernel_end_sync=None, kernel_start=5, kernel_end=90)
    good = _instance("0:3", [0, 10, 20, 30], [100] * 4)
    m = compute_run_metrics(_ops(missing + unmatched + unsynced + good), [])
    inst = m.instances.set_index("instance")
    assert inst["status"].to_dict() == {"0:0": "incomplete", "0:1": "incomplete", "0:2": "not_synced",
                                        "0:3": "complete"}  # fmt: skip
    assert inst.loc["0:0", "reason"] == "3 of 4 ranks matched to a kernel"
    assert inst.loc["0:1", "reason"] == "3 of 4 ranks matched to a kernel"
    assert "node001" in inst.loc["0:2", "reason"]
    for key in ("0:0", "0:1", "0:2"):
        assert pd.isna(inst.loc[key, "arrival_skew_ns"]) and pd.isna(inst.loc[key, "last_rank"])
    om = m.op_metrics
    bad = om["instance"] != "0:3"
    assert om.loc[bad, "wait_ns"].isna().all() and om.loc[bad, "transfer_ns"].isna().all()
    assert om.loc[~bad, "wait_ns"].notna().all()
    # the unsynchronised row still has its own (single-clock) bandwidth
    assert om.loc[bad & (om["host"] == "node001"), "busbw_gbps"].notna().all()
    assert om.loc[bad, "instance_status"].tolist() == ["incomplete"] * 7 + ["not_synced"] * 4
    assert m.stragglers["instances"].tolist() == [1, 1, 1, 1]  # only the complete instance counts
    assert any("incomplete" in p for p in m.problems) and any("not synced" in p for p in m.problems)


# --------------------------------------------------------------------------------------------
# theoretical limits from the topology


def _limit_of(tmp_path: Path, ops: pd.DataFrame, dirs: list[Path]) -> pd.Series:
    m = compute_run_metrics(ops, dirs)
    return m.limits.set_index("logical_id").iloc[0]


def test_limit_of_an_nvlink_mesh_is_the_gpus_links_to_the_other_members(tmp_path):
    buses = [0x7000, 0xB000, 0x48000, 0x4C000]
    links = _mesh(buses, 80.0, cpu_of=lambda b: 0 if b < 0x40000 else 1)
    dirs = [_proc_dir(tmp_path, "node000", 10 + i, b, [(2, links)]) for i, b in enumerate(buses)]
    lim = _limit_of(tmp_path, _comm_ops([("node000", 10 + i, i) for i in range(4)]), dirs)
    assert lim["link_type"] == "NVL" and lim["limit_gbps"] == 240.0 and lim["limit_source"] == "topology: host view"
    assert lim["limit_link"] == "NVL 240.0 GB/s: GPU 0-7000 on node000 (NVLinks to 3 members: 80.0 + 80.0 + 80.0)"
    # a two-GPU communicator of the same node gets one link
    lim2 = _limit_of(tmp_path, _comm_ops([("node000", 10, 0), ("node000", 12, 2)]), dirs)
    assert lim2["limit_gbps"] == 80.0
    assert lim2["limit_link"] == "NVL 80.0 GB/s between GPU 0-7000 and GPU 0-48000 on node000"


def test_limit_without_nvlink_is_the_slowest_pcie_or_inter_socket_path(tmp_path):
    buses = [0x1000, 0x25000, 0xC1000, 0xE1000]
    links = _mesh(buses, 0.0, cpu_of=lambda b: 0 if b < 0x80000 else 1, pci=24.0, sys_bw=16.0)
    dirs = [_proc_dir(tmp_path, "a40", 10 + i, b, [(2, links)]) for i, b in enumerate(buses)]
    same_socket = _limit_of(tmp_path, _comm_ops([("a40", 10, 0), ("a40", 11, 1)]), dirs)
    assert same_socket["link_type"] == "PCI" and same_socket["limit_gbps"] == 24.0
    world = _limit_of(tmp_path, _comm_ops([("a40", 10 + i, i) for i in range(4)]), dirs)
    assert world["link_type"] == "SYS" and world["limit_gbps"] == 16.0
    assert world["limit_link"].startswith("SYS 16.0 GB/s between GPU 0-")


def test_limit_through_an_nvswitch(tmp_path):
    buses = [0x7000, 0xB000]
    links = [row for b in buses for row in (("CPU/0", "PCI", 24.0, f"GPU/0-{b:x}"), (f"GPU/0-{b:x}", "NVL", 240.0,
                                                                                       "NVS/0"))]  # fmt: skip
    dirs = [_proc_dir(tmp_path, "dgx", 10 + i, b, [(2, links)]) for i, b in enumerate(buses)]
    lim = _limit_of(tmp_path, _comm_ops([("dgx", 10, 0), ("dgx", 11, 1)]), dirs)
    assert lim["limit_gbps"] == 240.0 and lim["limit_link"] == "NVL 240.0 GB/s: GPU 0-7000 on dgx to the NVSwitch"


def test_limit_across_nodes_is_the_nics_the_members_can_drive(tmp_path):
    buses = [0x7000, 0xB000]
    nics = [(0x1C000, 25.0, 0), (0x5C000, 25.0, 1)]  # NET 25 behind PCI 24: 24 GB/s each
    dirs = []
    for h in ("n0", "n1"):
        links = _mesh(buses, 240.0, cpu_of=lambda b: 0 if b == 0x7000 else 1, nics=nics)
        dirs += [_proc_dir(tmp_path, h, 10 + i, b, [(2, links)]) for i, b in enumerate(buses)]
    members = [("n0", 10, 0), ("n0", 11, 1), ("n1", 10, 2), ("n1", 11, 3)]
    lim = _limit_of(tmp_path, _comm_ops(members), dirs)
    assert lim["link_type"] == "NET" and lim["limit_gbps"] == 48.0 and lim["hosts"] == 2
    assert lim["limit_link"] == "NET 48.0 GB/s: 2 NIC(s) of n0 for 2 member GPU(s)"
    one_per_node = _limit_of(tmp_path, _comm_ops([("n0", 10, 0), ("n1", 10, 2)]), dirs)
    assert one_per_node["limit_gbps"] == 24.0


def test_the_communicators_own_topology_dump_is_preferred(tmp_path):
    # the world init prints 80 GB/s per pair, the pair communicator's init 240: NCCL used 240 for it
    buses = [0x7000, 0xB000, 0x48000, 0x4C000]
    world, pair = _mesh(buses, 80.0), _mesh(buses[:2], 240.0)
    dirs = [_proc_dir(tmp_path, "node000", 10 + i, b, [(2, world)] + ([(202, pair)] if i < 2 else []),
                      comms=[(1, 0xC0)] + ([(201, 0xC1)] if i < 2 else []))
            for i, b in enumerate(buses)]  # fmt: skip
    ops = pd.concat([_comm_ops([("node000", 10 + i, i) for i in range(4)], lid=0),
                     _comm_ops([("node000", 10, 0), ("node000", 11, 1)], lid=1)], ignore_index=True)  # fmt: skip
    lim = compute_run_metrics(ops, dirs).limits.set_index("logical_id")
    assert lim.loc[0, "limit_gbps"] == 240.0 and lim.loc[0, "limit_source"] == "topology"  # 3 x 80
    assert lim.loc[1, "limit_gbps"] == 240.0 and lim.loc[1, "limit_source"] == "topology"  # its own dump
    # merging the dumps by maximum would have claimed 240 per pair, i.e. 720 for the world


def test_missing_topology_gives_a_marked_fallback_or_no_limit(tmp_path):
    links = _mesh([0x7000, 0xB000], 80.0)
    dirs = [_proc_dir(tmp_path, "node000", 10, 0x7000, [(2, links)], total_bw=160.0),
            _proc_dir(tmp_path, "node000", 11, 0xD000, [(2, links)], total_bw=160.0)]  # GPU not in the dump
    m = compute_run_metrics(_comm_ops([("node000", 10, 0), ("node000", 11, 1)]), dirs)
    lim = m.limits.iloc[0]
    assert lim["limit_gbps"] == 160.0 and pd.isna(lim["link_type"])
    assert lim["limit_source"].startswith("fallback: totalBw 160.0 GB/s of the topology header of node000")
    assert "GPU 0-d000 not in the topology dumps of node000" in lim["limit_source"]
    assert any("fallback" in p for p in m.problems)
    # a second host without any dump: no value is assumed across nodes
    m2 = compute_run_metrics(_comm_ops([("node000", 10, 0), ("node009", 11, 1)]), dirs[:1])
    lim2 = m2.limits.iloc[0]
    assert pd.isna(lim2["limit_gbps"]) and lim2["limit_source"] == "unavailable: no topology dump for node009"
    om = m2.op_metrics
    assert om["efficiency"].isna().all() and om["busbw_gbps"].notna().all()


def test_efficiency_is_bus_bandwidth_over_the_limit(tmp_path):
    buses = [0x7000, 0xB000, 0x48000, 0x4C000]
    dirs = [_proc_dir(tmp_path, "node000", 10 + i, b, [(2, _mesh(buses, 80.0))]) for i, b in enumerate(buses)]
    ops = _comm_ops([("node000", 10 + i, i) for i in range(4)])  # 1 MiB x 1.5 in 100 us = 15.7 GB/s
    om = compute_run_metrics(ops, dirs).op_metrics
    busbw = (1 << 20) * 1.5 / 100_000
    assert om["busbw_gbps"].tolist() == pytest.approx([busbw] * 4)
    assert om["limit_gbps"].tolist() == [240.0] * 4
    assert om["algbw_limit_gbps"].tolist() == pytest.approx([160.0] * 4)  # 240 / 1.5
    assert om["efficiency"].tolist() == pytest.approx([busbw / 240.0] * 4)
    assert om["transfer_efficiency"].tolist() == pytest.approx([busbw / 240.0] * 4)  # no skew here


# --------------------------------------------------------------------------------------------
# algorithms


def test_transition_table_from_kernel_names():
    sizes = [(1024, "LL"), (65536, "LL"), (1 << 20, "LL128"), (4 << 20, "SIMPLE"), (16 << 20, "SIMPLE")]
    rows = [{"op": "AllReduce", "message_bytes": b, "instance": None, "global_rank": r,
             "kernel_name": f"ncclDevKernel_AllReduce_Sum_f32_RING_{p}", "kernel_start_sync": T0,
             "kernel_end_sync": T0 + 10_000} for b, p in sizes for r in range(2)]  # fmt: skip
    rows += [{"op": "AllGather", "message_bytes": 4096, "logical_id": 1,
              "kernel_name": "ncclKernel_AllGather_RING_LL128_Sum_int8"},  # pre-2.19 spelling
             {"op": "AllReduce", "message_bytes": 512, "logical_id": 2, "kernel_name": "ncclDevKernel_Generic"},
             {"op": "Send", "message_bytes": 512, "logical_id": 3, "kernel_name": "ncclDevKernel_SendRecv"}]
    m = compute_run_metrics(_ops(rows), [])
    t = m.algorithms
    assert t[["logical_id", "op", "min_bytes", "max_bytes", "algorithm", "protocol", "source", "count"]].values.tolist() == [
        [0, "AllReduce", 1024, 65536, "RING", "LL", "kernel_name", 4],
        [0, "AllReduce", 1 << 20, 1 << 20, "RING", "LL128", "kernel_name", 2],
        [0, "AllReduce", 4 << 20, 16 << 20, "RING", "SIMPLE", "kernel_name", 4],
        [1, "AllGather", 4096, 4096, "RING", "LL128", "kernel_name", 1],
    ]  # fmt: skip
    assert set(t["other_count"]) == {0}
    om = m.op_metrics
    assert om["algorithm"].isna().tolist()[-2:] == [True, True]  # generic / SendRecv kernels do not tell
    assert om["algo_source"].iloc[0] == "kernel_name"


def test_transition_table_prefers_tuning_lines_and_spreads_them_over_the_instance(tmp_path):
    # rank 0 logs TUNING lines; its peers only have kernel names (which here disagree on purpose)
    rows = []
    for k, (b, kp) in enumerate([(4096, "LL"), (8192, "LL"), (1 << 22, "SIMPLE")]):
        rows += [{"op": "AllReduce", "message_bytes": b, "nranks": 2, "instance": f"0:{k}", "global_rank": r,
                  "rank_in_comm": r, "line": 10 + 2 * k, "op_count": k,
                  "kernel_name": f"ncclDevKernel_AllReduce_Sum_f32_RING_{kp}",
                  "kernel_start_sync": T0 + 100_000 * k, "kernel_end_sync": T0 + 100_000 * k + 50_000}
                 for r in range(2)]  # fmt: skip
    # two grouped calls covered by one 2.20-2.23 aggregate TUNING line (n_calls = 2)
    rows += [{"op": "AllReduce", "message_bytes": 256, "nranks": 2, "instance": f"0:{3 + j}", "global_rank": 0,
              "line": 20 + j, "op_count": 3, "status": "unmatched"} for j in range(2)]  # fmt: skip
    d = tmp_path / "nccl_0"
    d.mkdir()
    base = {"file": "nccl_0.log", "host": "node000", "pid": 1000, "tid": 1000, "cuda_dev": 0, "kind": "standard",
            "format": "bytes_numeric"}  # fmt: skip
    _write(d, "tuning", [
        {**base, "line": 11, "algo": "TREE", "proto": "LL", "call_line": 10, "n_calls": 1},
        {**base, "line": 13, "algo": "TREE", "proto": "LL", "call_line": 12, "n_calls": 1},
        {**base, "line": 15, "algo": "RING", "proto": "Simple", "call_line": 14, "n_calls": 1},
        {**base, "line": 22, "algo": "RING", "proto": "LL", "call_line": 20, "n_calls": 2},
    ])  # fmt: skip
    m = compute_run_metrics(_ops(rows), [d])
    om = m.op_metrics
    assert om["algorithm"].tolist() == ["TREE"] * 4 + ["RING"] * 4
    assert om["protocol"].tolist() == ["LL"] * 4 + ["SIMPLE"] * 2 + ["LL"] * 2
    assert set(om["algo_source"]) == {"tuning"}
    t = m.algorithms
    assert t[["min_bytes", "max_bytes", "algorithm", "protocol", "source", "count"]].values.tolist() == [
        [256, 256, "RING", "LL", "tuning", 2],
        [4096, 8192, "TREE", "LL", "tuning", 4],
        [1 << 22, 1 << 22, "RING", "SIMPLE", "tuning", 2],
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# writing


def test_write_run_metrics_writes_every_table_with_its_schema(tmp_path):
    m = compute_run_metrics(_ops(_instance("0:0", [0, 10, 20, 30], [100] * 4)), [])
    paths = write_run_metrics(m, tmp_path / "metrics")
    schemas = {"op_metrics": OP_METRICS_SCHEMA, "instances": INSTANCE_SCHEMA, "stragglers": STRAGGLER_SCHEMA,
               "limits": LIMIT_SCHEMA, "algorithms": ALGORITHM_SCHEMA}  # fmt: skip
    assert set(paths) == set(schemas)
    for name, schema in schemas.items():
        assert paths[name] == tmp_path / "metrics" / f"{name}.parquet"
        back = read_table(paths[name])
        assert list(back.columns) == schema.names
        assert len(back) == len(getattr(m, name))
        for f in schema:
            assert f.metadata[b"doc"], (name, f.name)
    assert sorted(p.name for p in (tmp_path / "metrics").iterdir()) == sorted(f"{n}.parquet" for n in schemas)
    back = read_table(paths["instances"])
    assert back["first_start_ns"].iloc[0] == T0  # integers survive the round trip exactly


def test_op_metrics_has_the_columns_the_workflow_uses():
    required = ["file", "line", "host", "pid", "global_rank", "logical_id", "op", "parallelism", "instance",
                "message_bytes", "duration_ns", "algbw_gbps", "busbw_gbps", "bus_factor", "wait_ns", "transfer_ns",
                "transfer_busbw_gbps", "arrival_skew_ns", "limit_gbps", "limit_link", "limit_source", "efficiency",
                "transfer_efficiency", "algorithm", "protocol", "algo_source"]  # fmt: skip
    assert not set(required) - set(OP_METRICS_SCHEMA.names)


# --------------------------------------------------------------------------------------------
# an emulated two-node run, against the emulator's ground truth

SKEWED = {
    "model": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
    "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 4, "iterations": 1, "nodes": 2,
    "gpus_per_node": 2, "tp": 2, "pp": 2, "precision": "bf16", "seed": 5,
    "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1, "arrival_skew_ns_max": 50_000,
                      "clock_offset_ns_max": 2_000_000},
}  # fmt: skip


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    from nccltrace.cli import main
    from nccltrace.emulator.run import emulate_run

    base = tmp_path_factory.mktemp("metrics_run")
    emulate_run(SKEWED, base / "raw")
    assert main(["analyze", str(base / "raw"), "-o", str(base / "out"), "-q"]) == 0
    out = base / "out"
    ops = read_table(out / "ops" / "ops.parquet")
    comms = read_table(out / "communicators" / "communicators.parquet")
    layout = RunLayout(out)
    dirs = [layout.parsed_nccl(p) for p in layout.find_processes()]
    return base / "raw", ops, compute_run_metrics(ops, dirs, comms)


def _truth_times(raw: Path) -> pd.DataFrame:
    ops = read_table(raw / "ground_truth" / "ops.parquet")
    k = read_table(raw / "ground_truth" / "kernels.parquet")
    ops = ops[ops["kernel_correlation_id"].notna() & ops["log_line"].notna()]
    t = ops.merge(k[["pid", "correlation_id", "start_true_ns", "end_true_ns"]],
                  left_on=["pid", "kernel_correlation_id"], right_on=["pid", "correlation_id"])  # fmt: skip
    return pd.DataFrame({"file": t["log_file"].astype(str).str.rsplit("/", n=1).str[-1],
                         "line": t["log_line"].astype("int64"), "rank": t["rank"].astype("int64"),
                         "start": t["start_true_ns"].astype("int64"), "end": t["end_true_ns"].astype("int64")})


def test_emulated_run_stragglers_and_waits_match_the_ground_truth(emulated):
    raw, _ops_table, m = emulated
    assert m.problems == []
    assert (m.instances["status"] == "complete").all() and len(m.instances) > 50
    om = m.op_metrics.merge(_truth_times(raw), on=["file", "line"])
    om = om[om["wait_ns"].notna()].copy()
    # the true straggler: latest true start of each instance (the emulator makes one rank last)
    last = om.sort_values("start").groupby("instance").tail(1).set_index("instance")["rank"]
    inst = m.instances.set_index("instance")
    assert (inst["last_rank"].reindex(last.index) == last).mean() >= 0.95
    true_last = om.groupby("instance")["start"].transform("max")
    true_wait = np.minimum(true_last - om["start"], om["end"] - om["start"])
    # clock offsets of +-2 ms are estimated from the collective ends: waits within 1 us
    assert (om["wait_ns"].astype("int64") - true_wait).abs().max() < 1_000
    s = m.stragglers
    assert (s.groupby("logical_id")["last_arrivals"].sum()
            == inst.groupby("logical_id")["last_rank"].count()).all()  # fmt: skip


def test_emulated_run_limits_name_nvlink_inside_and_the_network_across_nodes(emulated):
    _, _ops_table, m = emulated
    lim = m.limits.set_index("logical_id")
    par = lim["parallelism"]
    tp = lim[par == "tp"]
    assert len(tp) and (tp["link_type"] == "NVL").all() and (tp["hosts"] == 1).all()
    cross = lim[(lim["hosts"] == 2)]
    assert len(cross) and (cross["link_type"] == "NET").all()
    assert (lim.loc[lim["nranks"] == 1, "limit_source"].str.startswith("unavailable: single-rank")).all()
    om = m.op_metrics
    timed = om[om["kernel_busbw_gbps"].notna() & om["limit_gbps"].notna()]
    assert len(timed) and (timed["efficiency"] > 0).all()
    assert set(om.loc[om["op"].isin(["Send", "Recv"]), "limit_scope"]) == {"pair"}
    # TUNING lines (rank 0 of each communicator) reach every rank of the instance
    assert (m.algorithms["source"] == "tuning").any()
    assert om.loc[om["instance"].notna() & (om["status"] == "matched"), "algorithm"].notna().all()


def test_emulated_run_has_one_metrics_row_per_call_and_topology_limits_for_every_communicator(emulated):
    _, ops, m = emulated
    calls = ops[ops["row_kind"] == "call"]
    assert len(m.op_metrics) == len(calls)
    assert m.op_metrics[["file", "line"]].duplicated().sum() == 0
    multi = m.limits[m.limits["nranks"] > 1]
    assert multi["limit_gbps"].notna().all() and multi["limit_source"].str.startswith("topology").all()
    om = m.op_metrics
    assert (om.loc[om["status"] != "matched", "busbw_gbps"].isna()).all()
    assert om.loc[om["status"] == "matched", "busbw_gbps"].notna().all()
