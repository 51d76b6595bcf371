"""The NCCL log reader on the real public log excerpts: zero lost call/init/tuning records,
and field values checked on chosen lines of every kind and version."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from nccltrace.core.tables import read_table
from nccltrace.nccl.log_reader import parse_logs


@pytest.fixture(scope="module")
def parsed(tmp_path_factory, fixture_logs):
    out = tmp_path_factory.mktemp("fixtures_parsed")
    report = parse_logs([fixture_logs], out)
    tables = {p.stem: read_table(p) for p in out.glob("*.parquet")}
    return report, tables, out


def _non_comment_lines(fixture_logs: Path, pattern: str) -> list[tuple[str, int]]:
    rx = re.compile(pattern)
    hits = []
    for f in sorted(fixture_logs.glob("*.log")):
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if not line.startswith("#") and rx.search(line):
                hits.append((f.name, i))
    return hits


def test_every_call_line_in_every_fixture_is_recovered(parsed, fixture_logs):
    _, t, _ = parsed
    expected = set(_non_comment_lines(fixture_logs, r": opCount [0-9a-f]+ sendbuff"))
    got = set(zip(t["calls"].file, t["calls"].line))
    assert expected and got == expected


def test_every_init_and_split_line_is_recovered(parsed, fixture_logs):
    _, t, _ = parsed
    expected = set(_non_comment_lines(fixture_logs, r"- ?Init (START|COMPLETE)"))
    c = t["comms"]
    got = set(zip(c[c.event.isin(["init", "split"])].file, c[c.event.isin(["init", "split"])].line))
    assert expected and got == expected


def test_every_tuning_line_is_recovered(parsed, fixture_logs):
    _, t, _ = parsed
    expected = set(_non_comment_lines(fixture_logs, r"\d+ Bytes -> "))
    assert set(zip(t["tuning"].file, t["tuning"].line)) == expected


def test_call_line_fields_are_decoded(parsed):
    _, t, _ = parsed
    c = t["calls"].set_index(["file", "line"])
    row = c.loc[("NVIDIA_nccl_203.log", 3)]  # 2.4-era AllReduce, hex opCount 1a
    assert (row.host, row.pid, row.tid, row.cuda_dev) == ("gpu1", 13135, 13922, 0)
    assert row.op == "AllReduce" and row.op_count == 0x1A
    assert row.sendbuff == 0x10048F82700 and row.recvbuff == 0x10048F82800
    assert row["count"] == 64 and row.datatype_name == "float32" and row.bytes == 256
    assert row.comm == 0x7F0C741162F0 and row.nranks == 2 and row.stream == 0x7F0C74002F00
    assert row.redop_name == "sum" and pd.isna(row.duplicate_of)


def test_send_logged_with_buffer_in_recv_slot_and_trimmed_prefix(parsed):
    _, t, _ = parsed
    row = t["calls"].set_index(["file", "line"]).loc[("NVIDIA_nccl_734.log", 4)]
    assert row.op == "Send" and row.sendbuff == 0 and row.recvbuff == 0x7FF818EFB800
    assert row.root == 1  # peer rank
    assert pd.isna(row.host) and pd.isna(row.pid)  # the poster trimmed host:pid:tid [dev]


def test_srun_label_prefix_is_skipped_and_allgather_message_size_is_full_buffer(parsed):
    _, t, _ = parsed
    c = t["calls"]
    rows = c[(c.file.str.startswith("findstring_11774129463")) & (c.op == "AllGather")]
    assert set(rows.host) == {"node-0", "node-1", "node-2", "node-3"} - {"node-0"}
    r = rows.iloc[0]
    assert r["count"] == 2359808 and r.bytes == 2359808 * 4 and r.message_bytes == 2359808 * 4 * 4
    assert r.op_count == 0x1606
    bcast = c[(c.file.str.startswith("findstring_11774129463")) & (c.op == "Broadcast") & (c.op_count == 0x1609)]
    assert bcast.iloc[0].datatype_name == "uint8" and bcast.iloc[0].bytes == 3145


def test_torn_lines_are_split_and_orphan_tail_rejoins_its_prefix(parsed):
    _, t, _ = parsed
    c = t["calls"].set_index(["file", "line"])
    torn = c.loc[("NVIDIA_nccl_147.log", 4)]
    assert torn.pid == 32629 and torn.cuda_dev == 7 and torn.recovery == "split"
    orphan = c.loc[("NVIDIA_nccl_147.log", 9)]
    # The prefix-only fragment of pid 32619 on line 4 is the only candidate for the orphan tail.
    assert orphan.recovery == "rejoined" and orphan.pid == 32619 and orphan.op_count == 1
    assert orphan.comm == 0x7F584405A260


def test_identical_calls_on_single_rank_comm_are_not_collapsed(parsed):
    report, t, _ = parsed
    c = t["calls"]
    rows = c[c.file == "NVIDIA_nccl_1238.log"]
    assert len(rows) == 4 and rows.duplicate_of.isna().all()  # nranks=1: opCount never advances
    assert report.counts["call_identical_repeat_kept"] >= 3


def test_init_lines_of_each_version_form(parsed):
    _, t, _ = parsed
    c = t["comms"].set_index(["file", "line"])
    old = c.loc[("NVIDIA_nccl_429.log", 7)]  # ~2.8: no nvmlDev, no commId
    assert old.event == "init" and old["rank"] == 14 and old.nranks == 16 and old.bus_id == 0xB1000
    assert pd.isna(old.nvml_dev) and pd.isna(old.comm_id)
    mid = c.loc[("NVIDIA_nccl-tests_188.log", 6)]  # 2.17-2.18.1: commId, no nvmlDev
    assert mid.comm_id == 0x86D61C6D254B547E and mid["rank"] == 11
    split21 = c.loc[("NVIDIA_nccl_1605.log", 4)]  # 2.21/2.22 split with commId
    assert split21.event == "split" and split21.api == "ncclCommSplit" and split21.parent == 0x5951213C0F90
    assert split21.color == 1684518034 and split21.key == 0 and split21.comm_id == 0x5A16C3838CE6F1F8
    assert split21.phase == "START"
    f = "findstring_24205023786_aws_g6e12x_2.27.3.log"
    starts = t["comms"][(t["comms"].file == f) & (t["comms"].event == "split")]
    s = starts[starts.phase == "START"].iloc[0]  # 2.27 split: splitCount, no commId, no space before '-'
    assert s.split_count == 1 and s.color == 1734919490 and pd.isna(s.comm_id) and s.nranks == 16
    cfg = t["comms"][(t["comms"].file == f) & (t["comms"].api == "ncclCommInitRankConfig")]
    assert set(cfg.comm_id) == {0x81DCA7568EFE26D7} and set(cfg.nvml_dev) == {0, 1, 2, 3}


def test_destroy_and_legacy_init_lines(parsed):
    _, t, _ = parsed
    c = t["comms"]
    d = c[(c.file == "Azure_aks-rdma-infiniband_30.log") & (c.event == "destroy")]
    assert len(d) == 7 and set(d["rank"]) == {15, 1, 13, 14, 6, 5, 7} and d.iloc[0].bus_id == 0xE00000
    legacy = c[(c.file == "NVIDIA_nccl_203.log") & (c.event == "legacy_init")]
    assert set(zip(legacy["rank"], legacy.comm_cuda_dev)) == {(0, 1), (1, 0)}


def test_tuning_lines_of_each_format(parsed):
    _, t, _ = parsed
    tu = t["tuning"].set_index(["file", "line"])
    numeric = tu.loc[("NVIDIA_nccl_1453.log", 4)]
    assert numeric.format == "bytes_numeric" and pd.isna(numeric.op)
    assert numeric.tuning_bytes == 262144 and numeric.algo == "TREE" and numeric.proto == "LL128"
    assert numeric.time_us == pytest.approx(54.707825)
    nvls = tu.loc[("NVIDIA_nccl_1453.log", 24)]
    assert nvls.algo == "NVLS_TREE" and nvls.proto == "SIMPLE"
    op_num = tu.loc[("findstring_11774129463_ai-on-eks_slinky_2.23.log", 4)]
    assert op_num.format == "op_bytes_numeric" and op_num.op == "AllGather" and op_num.algo == "RING"


def test_tuning_line_after_foreign_text_on_the_same_line(parsed):
    _, t, _ = parsed
    tu = t["tuning"].set_index(["file", "line"])
    row = tu.loc[("NVIDIA_nccl_1453.log", 26)]
    assert row.host == "h100clust-worker-1" and row.tuning_bytes == 2097152


def test_topology_block_links_and_nesting(parsed):
    _, t, _ = parsed
    links = t["topology_links"]
    h20 = links[(links.file == "NVIDIA_nccl_1189.log") & (links.pid == 1789224)]
    gpu = h20[h20.to_node == "GPU/18000"].iloc[0]
    assert gpu.from_node == "PCI/16000" and gpu.link_type == "PCI" and gpu.bw_gbps == 48.0 and gpu.to_detail == "0"
    nvl = h20[h20.link_type == "NVL"].iloc[0]
    assert nvl.from_node == "GPU/18000" and nvl.to_node == "NVS/0" and nvl.bw_gbps == pytest.approx(370.8)
    net = h20[h20.to_node == "NET/3"].iloc[0]
    assert net.from_node == "NIC/19000" and net.bw_gbps == 50.0
    sysl = t["topology_systems"]
    s = sysl[sysl.file == "NVIDIA_nccl_1189.log"].iloc[0]
    assert (s.max_bw_gbps, s.total_bw_gbps) == (48.0, pytest.approx(370.8))
    new = links[links.file == "NVIDIA_nccl_1591.log"]
    assert "GPU/0-19000" in set(new.to_node) and set(new[new.to_node == "GPU/0-19000"].from_node) == {"PCI/0-17000"}
    pcie_only = links[(links.file == "NVIDIA_nccl_1358.log") & (links.link_type == "PCI")]
    assert pcie_only.bw_gbps.min() == pytest.approx(0.2)


def test_rings_trees_versions_and_warnings(parsed):
    _, t, _ = parsed
    r = t["rings"]
    ring = r[(r.file == "NVIDIA_nccl_1453.log") & (r.kind == "ring")].iloc[0]
    assert ring.channel == 5 and ring.nchannels == 16 and ring.truncated  # <=2.22 20-rank cap
    assert ring.ranks.split()[:3] == ["0", "7", "6"]
    v = t["versions"]
    assert set(v.version) >= {"2.18.3", "2.21.5", "2.25.1", "2.27.3", "2.4.2", "2.5.6", "2.13.4", "2.12.12"}
    assert v[v.version == "2.12.12"].iloc[0].suffix == ".MSCCL.0.7.3"
    w = t["warnings"]
    ofi = w[w.file.str.contains("g6e_2.27.3")].iloc[0]
    assert "nccl_net_ofi_create_plugin" in ofi.source and ofi.message.startswith("NET/OFI")
    assert pd.notna(ofi.wall_time_ns) and ofi.wall_clock == "local"
    assert (ofi.host, ofi.pid, ofi.tid, ofi.cuda_dev) == ("llama-3-8b-node-0-0", 152, 386, 0)
    old = w[w.file == "NVIDIA_nccl_1482.log"].iloc[0]
    assert old.source == "init.cc:1969" and "already been destroyed" in old.message
    assert (old.host, old.pid, old.cuda_dev) == ("e53955024127", 2088762, 1)


def test_every_unclassified_line_has_file_line_and_reason(parsed):
    report, t, out = parsed
    u = t["unclassified"]
    assert (u.reason.str.len() > 0).all() and (u.line > 0).all()
    assert ("NVIDIA_nccl_203.log", 10) in set(zip(u.file, u.line))  # interleaved TensorFlow line
    data = json.loads((out / "parse_report.json").read_text())
    assert data["totals"]["call"] == len(t["calls"]) and data["tables"]["calls"] == len(t["calls"])
