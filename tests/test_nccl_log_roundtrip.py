"""Writer -> reader round trips for every supported NCCL line-format version, and the
reader's behaviour on inputs that are not what they claim."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest

from nccltrace.core.tables import read_table
from nccltrace.nccl.log_reader import parse_logs
from nccltrace.nccl.log_writer import NcclLogWriter, TopoGpu, TopoNic, TopoSystem

VERSIONS = ["2.18.3", "2.21.5", "2.23.4", "2.24.3", "2.28.3", "2.29.2"]


def _write_process_log(version: str, timestamps: bool = False, duplicate_call: bool = False) -> str:
    buf = io.StringIO()
    w = NcclLogWriter(buf, nccl_version=version, host="node003", pid=4242, timestamps=timestamps)
    t0 = 1_760_000_000_000_000_000
    w.version(4242, wall_ns=t0)
    w.topology(4300, TopoSystem(gpus=[TopoGpu(0x1A000, 0, 0), TopoGpu(0x1B000, 1, 1)],
                                nics=[TopoNic(0x1C000, 0, 25.0)]), wall_ns=t0)
    w.init(4300, comm=0x55AA00, rank=0, nranks=2, cuda_dev=0, nvml_dev=0, bus_id=0x1A000, comm_id=0xFEED,
           phase="START", wall_ns=t0)
    w.init(4300, comm=0x55AA00, rank=0, nranks=2, cuda_dev=0, nvml_dev=0, bus_id=0x1A000, comm_id=0xFEED,
           phase="COMPLETE", wall_ns=t0)
    w.split(4301, comm=0x55BB00, rank=0, nranks=2, cuda_dev=0, nvml_dev=0, bus_id=0x1A000, parent=0x55AA00,
            color=7, key=0, comm_id=0xBEEF, phase="COMPLETE", wall_ns=t0)
    w.comm_info(4300, comm=0x55AA00, rank=0, nranks=2, nnodes=1, local_ranks=2, local_rank=0, wall_ns=t0)
    w.ring(4300, 0, 2, [0, 1], wall_ns=t0)
    lines = {}
    lines["ar"] = w.call(4242, op="AllReduce", op_count=0x1F, sendbuff=0x7F00, recvbuff=0x7F00, count=1 << 20,
                         datatype=9, redop=0, root=0, comm=0x55AA00, nranks=2, stream=0x99, wall_ns=t0 + 1_500)
    w.tuning(4242, op="AllReduce", nbytes=2 << 20, algo="RING", proto="SIMPLE", channel_hi=3, nranks=2)
    if duplicate_call:
        w.call(4242, op="AllReduce", op_count=0x1F, sendbuff=0x7F00, recvbuff=0x7F00, count=1 << 20,
               datatype=9, redop=0, root=0, comm=0x55AA00, nranks=2, stream=0x99, wall_ns=t0 + 1_500)
    lines["ag"] = w.call(4242, op="AllGather", op_count=0x20, sendbuff=0x7E00, recvbuff=0x7D00, count=1000,
                         datatype=7, redop=0, root=0, comm=0x55AA00, nranks=2, stream=0x99)
    w.tuning(4242, op="AllGather", nbytes=4000, algo="RING", proto="LL", nranks=2)
    lines["send"] = w.call(4242, op="Send", op_count=0x21, sendbuff=0x7C00, recvbuff=0, count=77, datatype=6,
                           redop=0, root=1, comm=0x55BB00, nranks=2, stream=0x98)
    w.destroy(4300, comm=0x55BB00, rank=0, nranks=2, cuda_dev=0, bus_id=0x1A000)
    return buf.getvalue(), lines


@pytest.mark.parametrize("version", VERSIONS)
def test_writer_output_parses_back_to_the_same_records(tmp_path, version):
    text, lines = _write_process_log(version, timestamps=True)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "nccl_node003_4242.log").write_text(text)
    report = parse_logs([tmp_path / "logs"], tmp_path / "out")
    calls = read_table(tmp_path / "out" / "calls.parquet").set_index("line")
    ar = calls.loc[lines["ar"]]
    assert (ar.host, ar.pid, ar.tid, ar.op, ar.op_count) == ("node003", 4242, 4242, "AllReduce", 0x1F)
    assert ar.datatype_name == "bfloat16" and ar.bytes == 2 << 20 and ar.comm == 0x55AA00 and ar.stream == 0x99
    if version >= "2.26":
        assert ar.wall_time_ns == 1_760_000_000_000_001_000  # microsecond timestamp format
    else:
        assert ar.wall_time_ns is None or str(ar.wall_time_ns) == "<NA>"
    send = calls.loc[lines["send"]]
    assert send.recvbuff == 0x7C00 and send.sendbuff == 0 and send.root == 1 and send.bytes == 154
    comms = read_table(tmp_path / "out" / "comms.parquet")
    init = comms[(comms.event == "init") & (comms.phase == "COMPLETE")].iloc[0]
    assert init["rank"] == 0 and init.nranks == 2 and init.bus_id == 0x1A000 and init.comm_id == 0xFEED
    split = comms[comms.comm == 0x55BB00].iloc[0]
    if version >= "2.21.5":
        assert split.event == "split" and split.parent == 0x55AA00 and split.color == 7
    if version >= "2.23":
        assert str(split.comm_id) == "<NA>"  # split comms print no commId from 2.23
    assert (comms.event == "destroy").sum() == 1
    tuning = read_table(tmp_path / "out" / "tuning.parquet")
    if version < "2.20":
        assert len(tuning) == 0
    else:
        assert list(tuning.call_line) == [lines["ar"], lines["ag"]]
        assert list(tuning.algo) == ["RING", "RING"] and list(tuning.proto) == ["SIMPLE", "LL"]
    links = read_table(tmp_path / "out" / "topology_links.parquet")
    assert set(links.link_type) == {"PCI", "NVL", "NET"} and (links.bw_gbps == 240.0).sum() == 2
    assert report.counts["unclassified"] == 0 and not report.partial


def test_duplicated_call_line_is_detected_and_collapsed(tmp_path):
    text, lines = _write_process_log("2.21.5", duplicate_call=True)
    (tmp_path / "a.log").write_text(text)
    report = parse_logs([tmp_path / "a.log"], tmp_path / "out")
    calls = read_table(tmp_path / "out" / "calls.parquet")
    dup = calls[calls.duplicate_of.notna()]
    assert len(dup) == 1 and int(dup.iloc[0].duplicate_of) == lines["ar"]
    assert report.counts["call_duplicate"] == 1
    # The duplicate line does not steal the TUNING attachment of the real next call.
    tuning = read_table(tmp_path / "out" / "tuning.parquet")
    assert list(tuning.call_line) == [lines["ar"], lines["ag"]]


def test_empty_and_binary_files_are_reported_as_errors(tmp_path):
    (tmp_path / "empty.log").write_bytes(b"")
    (tmp_path / "binary.log").write_bytes(b"SQLite format 3\x00" + bytes(100))
    report = parse_logs([tmp_path], tmp_path / "out")
    issues = {f.file: f.issues for f in report.files}
    assert "empty" in issues["empty.log"][0]["message"] and issues["empty.log"][0]["severity"] == "error"
    assert "not a text NCCL log" in issues["binary.log"][0]["message"]
    assert report.partial
    data = json.loads((tmp_path / "out" / "parse_report.json").read_text())
    assert data["partial"] is True


def test_truncated_last_line_is_reported_with_its_line_number(tmp_path):
    text, _ = _write_process_log("2.24.3")
    cut = text[: text.rindex("AllGather: opCount") + 40]
    (tmp_path / "cut.log").write_text(cut)
    report = parse_logs([tmp_path / "cut.log"], tmp_path / "out")
    unc = read_table(tmp_path / "out" / "unclassified.parquet")
    last = cut.count("\n") + 1
    assert list(unc.line) == [last] and "COLL format" in unc.iloc[0].reason
    assert any("does not end with a newline" in i["message"] for i in report.files[0].issues)


def test_non_utf8_bytes_do_not_stop_parsing(tmp_path):
    text, lines = _write_process_log("2.28.3")
    data = text.encode().replace(b"NCCL INFO Channel 00/02", b"NCCL INFO Ch\xff\xfenel 00/02")
    (tmp_path / "bad.log").write_bytes(data)
    report = parse_logs([tmp_path / "bad.log"], tmp_path / "out")
    assert report.counts["non_utf8"] == 1
    assert len(read_table(tmp_path / "out" / "calls.parquet")) == 3


def test_mixed_versions_in_one_file_are_flagged(tmp_path):
    a, _ = _write_process_log("2.21.5")
    b, _ = _write_process_log("2.24.3")
    (tmp_path / "mixed.log").write_text(a + b.replace("4242", "4343"))
    report = parse_logs([tmp_path / "mixed.log"], tmp_path / "out")
    assert any("several NCCL versions" in i["message"] for i in report.files[0].issues)


def test_missing_input_raises_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no NCCL log files at .*nothing-here"):
        parse_logs([tmp_path / "nothing-here"], tmp_path / "out")


@pytest.mark.parametrize("version, stamped, fn", [("2.21.5", False, False), ("2.26.3", True, False),
                                                 ("2.30.7", True, True)])
def test_warn_lines_in_each_version_form_parse_back(tmp_path, version, stamped, fn):
    buf = io.StringIO()
    w = NcclLogWriter(buf, nccl_version=version, host="node9", pid=77)
    w.warn(78, src_file="transport/net_ib.cc", src_line=2453, message="NET/IB : got completion with error",
           function="ncclIbTest", wall_ns=1_760_000_000_000_000_000)
    text = buf.getvalue()
    assert text.startswith("\n") and ("[2025-" in text) == stamped and ("(ncclIbTest)" in text) == fn
    (tmp_path / "w.log").write_text(text)
    parse_logs([tmp_path / "w.log"], tmp_path / "o")
    warn = read_table(tmp_path / "o" / "warnings.parquet").iloc[0]
    assert (warn.host, warn.pid, warn.tid) == ("node9", 77, 78)
    assert warn.source.startswith("transport/net_ib.cc:2453") and warn.message.startswith("NET/IB")
    assert pd.notna(warn.wall_time_ns) == stamped


def test_output_tables_are_readable_by_group_and_others_like_plain_files(tmp_path):
    import os
    import stat

    text, _ = _write_process_log("2.24.3")
    (tmp_path / "a.log").write_text(text)
    parse_logs([tmp_path / "a.log"], tmp_path / "out")
    old = os.umask(0o022)
    os.umask(old)
    for f in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~old, f.name
