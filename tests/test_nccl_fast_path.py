"""The compiled fast path of the NCCL log reader (``parse_logs(fast=True)``) against the line-by-line
path (``fast=False``): identical tables (all columns, all rows, in order) and identical reports, on
the real fixtures, on writer output of every line-format generation, on torn/duplicated/foreign
lines, with block boundaries falling anywhere, and on randomly damaged logs."""

from __future__ import annotations

import datetime as dt
import io
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from data_paths import FIXTURE_LOGS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nccltrace.nccl import fast_scan
from nccltrace.nccl.log_reader import TABLE_NAMES, parse_logs
from nccltrace.nccl.log_writer import NcclLogWriter, TopoGpu, TopoNic, TopoSystem

VERSIONS = ["2.18.3", "2.21.5", "2.23.4", "2.24.3", "2.28.3"]
T0 = 1_760_000_000_000_000_000


def _parse(paths, out: Path, **kw):
    """(report dict, {table: pyarrow table}) or ('raised', exception type)."""
    shutil.rmtree(out, ignore_errors=True)
    try:
        report = parse_logs(paths, out, **kw)
    except Exception as exc:  # noqa: BLE001 - the two paths must fail alike
        return ("raised", type(exc).__name__), None
    return report.as_dict(), {name: pq.read_table(out / f"{name}.parquet") for name in TABLE_NAMES}


def assert_fast_equals_slow(paths, tmp_path: Path, block_sizes=(None, 97)) -> dict:
    slow_report, slow_tables = _parse(paths, tmp_path / "slow", fast=False)
    for block in block_sizes:
        kw = {} if block is None else {"block_size": block}
        fast_report, fast_tables = _parse(paths, tmp_path / "fast", fast=True, **kw)
        assert fast_report == slow_report, f"block_size={block}"
        if slow_tables is None:
            continue
        for name in TABLE_NAMES:
            a, b = slow_tables[name], fast_tables[name]
            assert a.schema == b.schema, name
            if not a.equals(b):  # (also when both hold a NaN: compare rows with NaN == NaN)
                rows_a, rows_b = a.to_pylist(), b.to_pylist()
                assert len(rows_a) == len(rows_b), (name, block)
                for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
                    assert _nan_safe(ra) == _nan_safe(rb), (name, block, i)
    return slow_report


def _nan_safe(row: dict) -> dict:
    return {k: "NaN" if isinstance(v, float) and v != v else v for k, v in row.items()}


# --- logs -------------------------------------------------------------------------------------
def _process_log(buf, version: str, timestamps: bool, *, host: str, pid: int, seed: int, n_iter: int = 40) -> None:
    """A rank-0 process log: version, topology, inits, a training-like mix of calls (groups sharing
    an opCount, P2P, repeated and duplicated calls, all datatypes) with TUNING lines."""
    rng = random.Random(seed)
    w = NcclLogWriter(buf, nccl_version=version, host=host, pid=pid, timestamps=timestamps)
    t = [T0 + seed * 1_000_000_007]

    def now() -> int:
        t[0] += rng.choice([1, 999, 1_000, 123_456, 10**9 + 7])
        return t[0]

    w.version(pid, wall_ns=now())
    w.topology(pid + 1, TopoSystem(gpus=[TopoGpu(0x1A000, 0, 0), TopoGpu(0x1B000, 1, 1)],
                                   nics=[TopoNic(0x1C000, 0, 25.0)]), wall_ns=now())
    comms = [0x55AA00 + 0x100 * i for i in range(3)]
    for i, comm in enumerate(comms):
        w.init(pid + 1, comm=comm, rank=0, nranks=4 if i else 1, cuda_dev=0, nvml_dev=0, bus_id=0x1A000,
               comm_id=0xFEED + i, phase="START", wall_ns=now())
        w.init(pid + 1, comm=comm, rank=0, nranks=4 if i else 1, cuda_dev=0, nvml_dev=0, bus_id=0x1A000,
               comm_id=0xFEED + i, wall_ns=now())
    w.comm_info(pid + 1, comm=comms[1], rank=0, nranks=4, nnodes=1, local_ranks=4, local_rank=0, wall_ns=now())
    w.ring(pid + 1, 0, 2, [0, 1, 2, 3], wall_ns=now())
    op_count = {c: 0 for c in comms}
    ops = ["AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "Send", "Recv"]
    if version >= "2.28":
        ops.append("AlltoAll")
    for it in range(n_iter):
        comm = rng.choice(comms)
        nranks = 1 if comm == comms[0] else 4
        group = rng.choice([1, 1, 1, 2, 3])  # calls of one group share the opCount
        dtype = rng.choice([0, 1, 2, 4, 6, 7, 7, 7, 8, 9, 10, 11])
        tid = rng.choice([pid, pid, pid, pid + 7])
        for _ in range(group):
            op = rng.choice(ops)
            count = rng.choice([0, 1, 77, 1024, 1 << 20, rng.randrange(1, 1 << 28)])
            args = dict(op=op, op_count=op_count[comm], sendbuff=0x7F0000000000 + 256 * it,
                        recvbuff=0x7F1000000000 + 256 * it, count=count, datatype=dtype,
                        redop=rng.choice([0, 0, 1, 2, 3, 4, 5, 7]) if op in ("AllReduce", "ReduceScatter", "Reduce")
                        else 0, root=rng.randrange(4), comm=comm, nranks=nranks, stream=rng.choice([0, 0x99, 0x98]),
                        wall_ns=now())
            w.call(tid, **args)
            if rng.random() < 0.1:
                w.call(tid, **args)  # duplicated line (same wall time: a real duplicate)
            if rng.random() < 0.05:
                w.call(tid, **{**args, "wall_ns": now()})  # identical call, later
            if op not in ("Send", "Recv", "AlltoAll") and rng.random() < 0.9:
                size = {0: 1, 1: 1, 2: 4, 4: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}[dtype]
                w.tuning(pid, op=op, nbytes=count * size * (group if rng.random() < 0.3 else 1),
                         algo=rng.choice(["RING", "TREE", "NVLS"]), proto=rng.choice(["LL", "LL128", "SIMPLE"]),
                         channel_lo=0, channel_hi=rng.randrange(32), time_us=rng.random() * 1000, nranks=nranks,
                         wall_ns=now())
        if rng.random() < 0.8:
            op_count[comm] += 1
        if rng.random() < 0.05:
            w.warn(tid, src_file="transport/net_ib.cc", src_line=2453, message="NET/IB : oops", wall_ns=now())
    w.destroy(pid + 1, comm=comms[2], rank=0, nranks=4, cuda_dev=0, bus_id=0x1A000)


def _writer_log(version: str, timestamps: bool, seed: int = 0, n_iter: int = 40) -> str:
    buf = io.StringIO()
    _process_log(buf, version, timestamps, host="node003", pid=4242, seed=seed, n_iter=n_iter)
    return buf.getvalue()


def _merged_log(version: str, seed: int) -> str:
    """Several processes of several hosts in one stream (shared stdout), with launcher prefixes."""
    rng = random.Random(seed)
    streams = []
    for k, (host, pid) in enumerate([("node1", 100), ("node1", 101), ("gpu-node-12", 7), ("xnode1", 55)]):
        buf = io.StringIO()
        _process_log(buf, version, rng.random() < 0.5, host=host, pid=pid, seed=seed * 10 + k, n_iter=25)
        lines = buf.getvalue().splitlines(keepends=True)
        soup = rng.choice(["", f"[1,{k}]<stdout>:", f"{k}: ", f"[default{k}]:", "[0] ",
                           f"{1712345678 + k}.{123456 + k} ", f"2: {1712345678 + k}.5 ", "-1"])
        streams.append([soup + line if line.strip() else line for line in lines])
    out = []
    while any(streams):
        s = rng.choice([s for s in streams if s])
        out.append(s.pop(0))
    return "".join(out)


def _torn_log() -> str:
    """Torn and foreign lines: two records on one line, prefix-only fragments and orphan tails, lines
    without prefix, foreign text glued to the host, duplicates, blank lines, an unterminated end."""
    text = _writer_log("2.21.5", False, seed=3, n_iter=30)
    lines = text.splitlines(keepends=True)
    calls = [i for i, line in enumerate(lines) if ": opCount " in line]
    a, b, c = lines[calls[3]], lines[calls[5]], lines[calls[8]]
    head, tail = b.split("NCCL INFO ", 1)
    extra = [
        a.rstrip("\n") + " " + b,  # two records on one line
        head + "NCCL INFO \n",  # prefix whose message is torn away ...
        "junk from the app\n",
        tail,  # ... and its orphan tail
        tail,  # an orphan without a candidate prefix
        "tf-log 123 -1" + c,  # foreign text glued before the host
        c.replace("node003", "-1node003"),
        "\n", "   \n",
        c, c,  # duplicated line
        "# a comment with NCCL in it\n",
        c.replace("NCCL INFO", "NCCL INFO NCCL INFO"),
        c.replace("count ", "count -"),
        c.replace("datatype 7", "datatype 12"),
        c.replace("0x55aa", "0X55aa"),
        c.replace("node003:4242:4242 [0]", "[0]"),
        c.replace("node003:4242:4242 [0]", "node003:4242:4242 [-3]"),
        c.replace(" stream ", " stream  ").replace("\n", " \t\r\n"),
        c.replace("node003", "nöde003"),
        c[: len(c) // 2] + "\n",
    ]
    for i, e in enumerate(extra):
        lines.insert(calls[10] + 2 * i, e)
    return "".join(lines) + c.rstrip("\n")  # no newline at the end


# --- tests ------------------------------------------------------------------------------------
def test_real_fixtures(tmp_path):
    assert FIXTURE_LOGS.is_dir(), f"real NCCL log fixtures missing at {FIXTURE_LOGS}"
    report = assert_fast_equals_slow([FIXTURE_LOGS], tmp_path, block_sizes=(None, 61, 4096))
    assert report["totals"]["call"] > 0 and report["totals"]["tuning"] > 0


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("timestamps", [False, True])
def test_writer_output(tmp_path, version, timestamps):
    path = tmp_path / "nccl_node003_4242.log"
    path.write_text(_writer_log(version, timestamps, seed=VERSIONS.index(version) * 2 + timestamps, n_iter=120))
    report = assert_fast_equals_slow([path], tmp_path, block_sizes=(None, 1, 333))
    assert report["totals"]["call"] >= 120
    if version >= "2.21":
        assert report["totals"]["tuning"] > 0


@pytest.mark.parametrize("version", ["2.21.5", "2.28.3"])
def test_merged_multi_process_log_with_launcher_prefixes(tmp_path, version):
    path = tmp_path / "stdout.log"
    path.write_text(_merged_log(version, seed=5))
    report = assert_fast_equals_slow([path], tmp_path, block_sizes=(None, 50, 1000))
    assert report["totals"]["call"] > 50


def test_torn_duplicated_and_foreign_lines_across_tiny_blocks(tmp_path):
    path = tmp_path / "torn.log"
    path.write_text(_torn_log())
    report = assert_fast_equals_slow([path], tmp_path, block_sizes=(None, 1, 7, 64, 150, 151))
    totals = report["totals"]
    assert totals["torn_recovered"] >= 1 and totals["call_duplicate"] >= 1 and totals["unclassified"] >= 1
    assert any("newline" in i["message"] for i in report["files"][0]["issues"])


def test_several_files_share_known_hosts(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "a.log").write_text(_merged_log("2.24.3", seed=1))
    (tmp_path / "logs" / "b.log").write_text(_torn_log())
    (tmp_path / "logs" / "c.log").write_text(_writer_log("2.18.3", False, seed=9))
    assert_fast_equals_slow([tmp_path / "logs"], tmp_path, block_sizes=(None, 200))


def test_epoch_and_bracket_timestamps_before_and_after_launcher_soup(tmp_path):
    base = _writer_log("2.24.3", False, seed=11, n_iter=30).splitlines(keepends=True)
    rng = random.Random(2)
    forms = ["", "1712345678.123456 ", "[2026-03-12 13:57:49.123456] ", "[2026-03-12T13:57:49] ",
             "[1,2]<stdout>:[2026-03-12 13:57:49.1] ", "2: 1712345678.5 ", "1712345678.1234567890 ",
             "[2026-13-12 13:57:49] ", "[2262-01-01 00:00:00] ", "[1650-01-01 00:00:00] ", "99999999999.1 ",
             "x1712345678.5 ", "[2026-03-12 13:57:49.] ", "\t1712345678.000001 "]
    lines = [rng.choice(forms) + line if line.strip() else line for line in base]
    path = tmp_path / "ts.log"
    path.write_text("".join(lines))
    assert_fast_equals_slow([path], tmp_path, block_sizes=(None, 100))


def test_version_lines_between_calls_change_datatype_decoding(tmp_path):
    """Datatype names depend on the version printed so far for the pid (bf16 from 2.10, fp8 from
    2.24.3): version lines in the middle of a block split the fast records' prefix groups."""
    buf = io.StringIO()
    for version in ("2.9.6", "2.18.3", "2.24.3", "2.23.4"):
        w = NcclLogWriter(buf, nccl_version=version, host="n1", pid=7)
        for dtype in (7, 9, 10, 11):
            w.call(7, op="AllReduce", op_count=1, sendbuff=dtype, recvbuff=0, count=3, datatype=dtype, redop=0,
                   root=0, comm=0x10, nranks=2, stream=0)
        w.version(7)
        other = NcclLogWriter(buf, nccl_version="2.27.3", host="n2", pid=8)
        other.call(8, op="AllGather", op_count=0, sendbuff=1, recvbuff=2, count=3, datatype=10, redop=0, root=0,
                   comm=0x20, nranks=2, stream=0)
    path = tmp_path / "versions.log"
    path.write_text(buf.getvalue())
    report = assert_fast_equals_slow([path], tmp_path, block_sizes=(None, 300))
    assert report["totals"]["unknown_datatype"] >= 4


def test_tuning_window_hash_growth_and_many_pids(tmp_path):
    """More comms than the initial hash table, more calls than the TUNING window, many pids."""
    buf = io.StringIO()
    for p in range(12):
        w = NcclLogWriter(buf, nccl_version="2.23.4", host=f"h{p % 3}", pid=1000 + p)
        w.version(1000 + p)
        w.call(1000 + p, op="AllGather", op_count=0, sendbuff=0x10, recvbuff=0x20, count=999, datatype=7, redop=0,
               root=0, comm=0x1000, nranks=4, stream=0)  # pushed out of the window by the next 300 calls
        for i in range(300):
            comm = 0x1000 + 0x10 * (i % 40)
            w.call(1000 + p, op="AllGather", op_count=i // 3, sendbuff=0x10, recvbuff=0x20, count=100 + i % 7,
                   datatype=7, redop=0, root=0, comm=comm, nranks=4, stream=0)
        for i in range(0, 300, 17):
            w.tuning(1000 + p, op="AllGather", nbytes=(100 + i % 7) * 4, algo="RING", proto="LL", nranks=4)
        w.tuning(1000 + p, op="AllGather", nbytes=999 * 4, algo="RING", proto="LL", nranks=4)
    path = tmp_path / "many.log"
    path.write_text(buf.getvalue())
    report = assert_fast_equals_slow([path], tmp_path, block_sizes=(None, 4000))
    assert report["totals"]["tuning_unattached"] >= 1


def test_tuning_aggregate_beyond_int64_is_decided_exactly(tmp_path):
    """2.20-2.23 aggregates: partial sums that leave int64 are handled with Python integers."""
    buf = io.StringIO()
    w = NcclLogWriter(buf, nccl_version="2.21.5", host="n", pid=1)
    w.version(1)
    w.call(1, op="AllReduce", op_count=4, sendbuff=1, recvbuff=2, count=3, datatype=8, redop=0, root=0,
           comm=0x10, nranks=2, stream=0)
    # float64 counts: bytes -(2^63 - 8), 2^62, 2^62; newest first the sums are 2^62, 2^63 (!), 8
    for k, count in enumerate((-(1 << 60) + 1, 1 << 59, 1 << 59)):
        w.call(1, op="AllReduce", op_count=5, sendbuff=16 * k, recvbuff=16 * k, count=count, datatype=8, redop=0,
               root=0, comm=0x10, nranks=2, stream=0)
    buf.write("n:1:1 [0] NCCL INFO 8 Bytes -> Algo 1 proto 2 time 1.000000\n")
    buf.write("n:1:1 [0] NCCL INFO 24 Bytes -> Algo 1 proto 2 time 1.000000\n")
    path = tmp_path / "huge.log"
    path.write_text(buf.getvalue())
    assert_fast_equals_slow([path], tmp_path, block_sizes=(None,))
    tuning = pq.read_table(tmp_path / "fast" / "tuning.parquet").to_pydict()
    assert tuning["call_line"] == [3, 2] and tuning["n_calls"] == [3, 1]
    state = fast_scan.FastState()
    state.ensure_pids(1)
    state.r_line[0, :3] = [2, 3, 4]
    state.r_op[0, :3] = fast_scan.OPS.index("AllReduce")
    state.r_bytes[0, :3] = [-(1 << 63) + 8, 1 << 62, 1 << 62]
    state.r_nranks[0, :3] = 2
    state.r_opc[0, :3] = 5
    state.r_head[0], state.r_len[0] = 3, 3
    assert state.attach_exact(0, -1, 8, True) == (2, 3)


@given(st.dates(min_value=dt.date(1700, 1, 1), max_value=dt.date(2261, 12, 31)))
def test_days_from_civil_matches_the_calendar(day):
    assert fast_scan.days_from_civil(day.year, day.month, day.day) == (day - dt.date(1970, 1, 1)).days


# --- randomly damaged logs --------------------------------------------------------------------
_SEEDS = {v: _writer_log(v, v >= "2.26", seed=21, n_iter=25) for v in ("2.21.5", "2.23.4", "2.28.3")}
_SEEDS["merged"] = "".join(_merged_log("2.23.4", seed=3).splitlines(keepends=True)[:300])
_FLIP_BYTES = b"0123456789abcdefx :[]()-.\n\r\t#Nx\xff\xc3"


@st.composite
def _damaged_logs(draw):
    version = draw(st.sampled_from(sorted(_SEEDS)))
    lines = _SEEDS[version].encode().splitlines(keepends=True)
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["shuffle", "truncate", "flip", "duplicate", "delete", "join", "insert"]))
        i = draw(st.integers(0, len(lines) - 1))
        line = lines[i]
        if op == "shuffle":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "truncate":
            lines[i] = line[: draw(st.integers(0, len(line)))] + b"\n"
        elif op == "flip":
            for _ in range(draw(st.integers(1, 3))):
                k = draw(st.integers(0, max(len(line) - 1, 0)))
                line = line[:k] + bytes([draw(st.sampled_from(_FLIP_BYTES))]) + line[k + 1 :]
            lines[i] = line
        elif op == "duplicate":
            lines.insert(i, line)
        elif op == "delete" and len(lines) > 1:
            del lines[i]
        elif op == "join":
            k = draw(st.integers(0, len(line)))
            lines[i] = line[:k] + lines[(i + 1) % len(lines)]
        elif op == "insert":
            lines.insert(i, draw(st.sampled_from([b"\n", b"garbage\n", b"NCCL INFO \n", line[len(line) // 2 :]])))
    data = b"".join(lines)
    if draw(st.booleans()):
        data = data.rstrip(b"\n")
    return data, draw(st.sampled_from([None, 1, 13, 160, 700]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(_damaged_logs())
def test_damaged_logs_fast_equals_slow(tmp_path, case):
    data, block = case
    path = tmp_path / "damaged.log"
    path.write_bytes(data)
    assert_fast_equals_slow([path], tmp_path, block_sizes=(block,))


def test_scan_block_takes_clean_lines_and_leaves_the_rest(tmp_path):
    text = (
        "node1:1:2 [0] NCCL INFO AllReduce: opCount 1a sendbuff 0x7f00 recvbuff (nil) count 5 datatype 7 op 0 "
        "root 0 comm 0x55 [nranks=2] stream 0x9\n"
        "node1:1:2 [0] NCCL INFO Init COMPLETE\n"
        "[2026-03-12 13:57:49.5] node1:1:2 [0] NCCL INFO AllGather: 4096 Bytes -> Algo RING proto SIMPLE "
        "channel{Lo..Hi}={0..3}\n"
        "[2026-03-12 13:57:50] node1:1:2 [0] NCCL INFO Reduce: 8 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..0}\n"
        "1712345678.25 node1:1:2 [0] NCCL INFO 4096 Bytes -> Algo 1 proto 2 time 54.707825\n"
        "node1:1:2 [0] NCCL WARN oops\n"
    )
    buf = np.frombuffer(text.encode(), np.uint8)
    lines, S, R, T = fast_scan.scan(buf, len(buf), 1)
    assert lines == 6 and list(S[:, 2]) == [2, 6] and list(R[:, fast_scan.R_LINE]) == [1, 3, 4, 5]
    assert list(R[:, fast_scan.R_KIND]) == [fast_scan.KIND_CALL, fast_scan.KIND_TUNE_NAMED,
                                            fast_scan.KIND_TUNE_NAMED, fast_scan.KIND_TUNE_NUMERIC]
    call = R[0]
    assert call[fast_scan.R_OPC] == 0x1A and call[fast_scan.R_SEND] == 0x7F00 and call[fast_scan.R_RECV] == 0
    assert call[fast_scan.R_OP] == fast_scan.OPS.index("AllReduce") and call[fast_scan.R_COUNT] == 5
    assert list(R[:, fast_scan.R_CHANGE]) == [1, 1, 0, 1]  # the prefix of line 4 is line 3's, timestamp aside
    wall = int(dt.datetime(2026, 3, 12, 13, 57, 49, tzinfo=dt.timezone.utc).timestamp())
    assert R[1, fast_scan.R_WALL] == wall * 10**9 + 500_000_000 and R[1, fast_scan.R_WK] == fast_scan.WALL_LOCAL
    assert R[2, fast_scan.R_WALL] == (wall + 1) * 10**9 and R[0, fast_scan.R_WALLNULL] == 1
    assert R[3, fast_scan.R_WALL] == 1712345678_250_000_000 and R[3, fast_scan.R_WK] == fast_scan.WALL_EPOCH
    assert T[3] == 54.707825 and R[3, fast_scan.R_OP] == -1 and R[3, fast_scan.R_BYTES] == 4096
    assert (R[1, fast_scan.R_LO], R[1, fast_scan.R_HI]) == (0, 3)
    s_start, s_end = S[0, 0], S[0, 1]
    assert text.encode()[s_start:s_end] == b"node1:1:2 [0] NCCL INFO Init COMPLETE\n"
