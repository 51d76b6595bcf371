"""NCCL API call ranges (legacy NCCL NVTX) linked to the kernels that executed them: real nsys
exports from nsys-ai (tests/data/real/nsys_sqlite, its README.md) and synthetic exports written with
the project's nsys writer, read back through the real reader (and once through the CLI)."""

from __future__ import annotations

import json
import sqlite3
import warnings
from pathlib import Path

import pandas as pd
import pytest
from data_paths import NSYS_SQLITE

from nccltrace.cli import main
from nccltrace.core.tables import read_table
from nccltrace.nsys.nccl_api import NCCL_API_CALL_COLUMNS, STATUSES, nccl_range_mask
from nccltrace.nsys.reader import NsysExport, NsysSchemaWarning
from nccltrace.nsys.writer import NsysExportWriter

REALDATA = NSYS_SQLITE
BEFORE = REALDATA / "nsysai_mfu_2gpu_before.sqlite"
AFTER = REALDATA / "nsysai_mfu_2gpu_after.sqlite"
H100 = REALDATA / "nsysai_h100_2gpu_1s.sqlite"
UTC0 = 1_795_255_331_185_646_164
SENDRECV = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _real(path: Path) -> Path:
    assert path.is_file(), f"real nsys export {path.name} missing (expected in {REALDATA})"
    return path


def _open(path: Path) -> NsysExport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NsysSchemaWarning)  # schema 3.25.0 is feature-detected
        return NsysExport.open(path)


def _dtypes(frame: pd.DataFrame) -> list[tuple[str, str]]:
    return [(c, str(t)) for c, t in frame.dtypes.items()]


# --------------------------------------------------------------------------- real exports


@pytest.fixture(scope="module")
def before():
    with _open(_real(BEFORE)) as x:
        yield x, x.nccl_api_calls(), x.kernels()


def _kernel_calls(calls: pd.DataFrame) -> pd.DataFrame:
    """Send/Recv rows grouped by the kernel they were linked to."""
    p2p = calls[calls.op.isin(["Send", "Recv"]) & calls.kernel_correlation_id.notna()]
    return p2p.groupby(["kernel_global_pid", "kernel_correlation_id"]).agg(
        send=("op", lambda s: int((s == "Send").sum())), recv=("op", lambda s: int((s == "Recv").sum())),
        groups=("group_id", "nunique"), launch=("launch_range_start", "first"), pid=("pid", "first"),
        tid=("tid", "first"))  # fmt: skip


def test_before_every_group_kernel_gets_exactly_its_two_sends_and_two_recvs(before):
    x, res, kernels = before
    calls = res.calls
    assert _dtypes(calls) == [(c, k) for c, k in NCCL_API_CALL_COLUMNS]
    assert len(kernels) == 66 and set(kernels.short_name) == {"ncclDevKernel_SendRecv"}
    per_kernel = _kernel_calls(calls)
    assert len(per_kernel) == 64
    assert (per_kernel.send == 2).all() and (per_kernel.recv == 2).all() and (per_kernel.groups == 1).all()
    # The kernel's launch lies inside the ncclGroupEnd its calls name, on the calling thread.
    ends = calls[calls.op == "GroupEnd"].set_index(["pid", "start"])
    k = kernels.set_index(["global_pid", "correlation_id"]).loc[per_kernel.index]
    assert (k.launch_tid.to_numpy() == per_kernel.tid.to_numpy()).all()
    end_of = ends.loc[list(zip(per_kernel.pid, per_kernel.launch))]
    assert (end_of.index.get_level_values("start") <= k.launch_start.to_numpy()).all()
    assert (end_of.end.to_numpy() >= k.launch_end.to_numpy()).all()
    assert (end_of.kernel_correlation_id.to_numpy() == k.index.get_level_values(1)).all()
    # Each call has that one kernel; the group's other four calls are its own 2 Send + 2 Recv.
    p2p = calls[calls.op.isin(["Send", "Recv"])]
    assert len(p2p) == 264 and p2p.status.value_counts().to_dict() == {"matched": 256, "kernel_missing": 8}
    assert (p2p.groupby("group_id").size() == 4).all() and p2p.group_id.nunique() == 66
    # The 2 kernels not linked were launched before the window: no launch record, and they run
    # before the first NCCL range of the export.
    linked = set(per_kernel.index)
    rest = kernels[[(g, c) not in linked for g, c in zip(kernels.global_pid, kernels.correlation_id)]]
    assert len(rest) == 2 and rest.launch_tid.isna().all() and (rest.start < calls.start.min()).all()
    # The 2 groups at the window's end: launch in the export, kernel record not.
    missing = calls[(calls.op == "GroupEnd") & (calls.status == "kernel_missing")]
    assert len(missing) == 2 and (missing.lost_launches_in_launch_range == 1).all()


def test_before_recognises_nccl_domain_without_creation_row_and_not_pytorch_ranges(before):
    x, res, _ = before
    calls = res.calls
    # What makes this export hard: domain 1 has no eventType 75 row and registered-string names.
    with sqlite3.connect(f"{BEFORE.resolve().as_uri()}?mode=ro", uri=True) as db:
        assert db.execute("SELECT count(*) FROM NVTX_EVENTS WHERE eventType = 75").fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM NVTX_EVENTS WHERE domainId = 1 AND text IS NULL "
                          "AND textId IS NOT NULL").fetchone() == (462,)  # fmt: skip
    assert res.domains[["pid", "domain_id", "ranges", "recognised_by"]].values.tolist() == [
        [144, 1, 224, "range_names+payload_schemas"], [145, 1, 238, "range_names+payload_schemas"]]
    assert res.domains.domain.isna().all()
    assert calls.op.value_counts().to_dict() == {"Send": 132, "Recv": 132, "GroupStart": 66, "GroupEnd": 66,
                                                 "CommCount": 66}  # fmt: skip
    assert (calls.status[calls.op.isin(["GroupStart", "CommCount"])] == "not_a_launch").all()
    nvtx = x.nvtx()
    torch = nvtx.text.astype("string").str.startswith("nccl:all_to_all").fillna(False)
    assert int(torch.sum()) == 66 and (nvtx.domain_id[torch] == 0).all()
    assert not nccl_range_mask(nvtx)[torch.to_numpy(bool)].any()


def test_before_reports_missing_payload_blobs_and_the_reexport_fix(before):
    x, res, _ = before
    s = res.summary()
    assert (s["api_calls"], s["matched"], s["calls_kernel_missing"], s["groups"]) == (264, 256, 8, 66)
    assert (s["nccl_kernels"], s["kernels_linked"], s["kernels_outside_launch_ranges"]) == (66, 64, 2)
    assert res.payload == s["payload"] == "missing"
    assert "--include-blobs=true" in s["payload_warning"] and "--include-json=true" in s["payload_warning"]
    assert res.calls.nccl_message_bytes.isna().all() and res.calls.nccl_comm_id.isna().all()
    assert x.undecoded_payload_blobs == 0


def test_after_links_sixty_groups():
    with _open(_real(AFTER)) as x:
        res = x.nccl_api_calls()
        kernels = x.kernels()
    calls = res.calls
    assert len(kernels) == 62
    assert calls.op.value_counts()[["Send", "Recv", "GroupEnd"]].tolist() == [120, 120, 60]
    per_kernel = _kernel_calls(calls)
    assert len(per_kernel) == 60 and (per_kernel.send == 2).all() and (per_kernel.recv == 2).all()
    s = res.summary()
    assert (s["api_calls"], s["matched"], s["groups"], s["kernels_linked"], s["kernels_outside_launch_ranges"]) == (
        240, 240, 60, 60, 2)
    assert res.payload == "missing"


def test_h100_negative_control_gives_an_empty_table():
    with _open(_real(H100)) as x:
        res = x.nccl_api_calls()
        schemas = x.payload_schema_entries()
    assert len(res.calls) == 0 and _dtypes(res.calls) == [(c, k) for c, k in NCCL_API_CALL_COLUMNS]
    assert (schemas.name == "NCCL communicator ID").sum() > 0  # NCCL registered its schemas, called nothing
    s = res.summary()
    assert (s["ranges"], s["nccl_kernels"], s["payload"], s["payload_warning"]) == (0, 0, "no_ranges", None)


def test_cli_parse_nsys_writes_the_table_and_prints_summary_and_warning(tmp_path, capsys):
    _real(BEFORE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NsysSchemaWarning)
        assert main(["parse-nsys", str(BEFORE), "-o", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "NCCL API ranges: 462 (264 collective/P2P calls, 256 matched to a kernel)" in out
    assert "NCCL kernels linked: 64 of 66" in out
    assert "--include-blobs=true" in err
    table = read_table(tmp_path / "out" / "nccl_api_calls.parquet")
    assert len(table) == 462 and table.columns.tolist() == [c for c, _ in NCCL_API_CALL_COLUMNS]
    assert int((table.status == "matched").sum()) == 256 + 64  # calls + their ncclGroupEnd
    session = json.loads((tmp_path / "out" / "session.json").read_text())
    assert session["nccl_api_calls"]["kernels_linked"] == 64 and session["nccl_api_calls"]["payload"] == "missing"
    assert "nccl_api_calls.parquet" in (tmp_path / "out" / "manifest.json").read_text()


# --------------------------------------------------------------------------- synthetic exports


class _Export:
    """Ranges, kernels and launches of a synthetic export; ``write`` builds it with the writer."""

    def __init__(self) -> None:
        self.ranges: list[dict] = []
        self.kernels: list[dict] = []
        self.runtime: list[dict] = []
        self.corr = 0

    def range(self, text: str, start: int, end: int, *, pid: int = 100, tid: int = 100, domain: str = "NCCL",
              payload: dict | None = None) -> None:  # fmt: skip
        self.ranges.append({"start": start, "end": end, "pid": pid, "tid": tid, "text": text, "domain": domain,
                            "registered": True, "nccl_payload": payload})  # fmt: skip

    def launch(self, at: int, *, pid: int = 100, tid: int = 100, stream: int = 7, record: bool = True,
               name: str = ALLREDUCE) -> int:  # fmt: skip
        """A kernel launched at ``at`` (its launch call lasts 10 ns); ``record=False``: the launch
        is in the export but the kernel record is not."""
        self.corr += 1
        self.runtime.append({"start": at, "end": at + 10, "pid": pid, "tid": tid, "correlation_id": self.corr,
                             "name": "cuLaunchKernelEx", "event_class": 1, "return_value": 0})  # fmt: skip
        if record:
            self.kernels.append({
                "start": at + 5_000, "end": at + 9_000, "device_id": 0, "context_id": 1, "stream_id": stream,
                "correlation_id": self.corr, "pid": pid, "name": name, "short_name": name.split("(")[0],
                "grid_x": 1, "grid_y": 1, "grid_z": 1, "block_x": 256, "block_y": 1, "block_z": 1,
                "registers_per_thread": 32, "static_shared_memory": 0, "dynamic_shared_memory": 0})  # fmt: skip
        return self.corr

    def write(self, path: Path, *, domain_row: bool = True, payload_mode: str = "dynamic",
              schemas: tuple | None = (2, 27, 3)) -> Path:  # fmt: skip
        ranges = pd.DataFrame(self.ranges)
        with NsysExportWriter(path, "3.28.1", hostname="node0", session_start_utc_ns=UTC0,
                              payload_mode=payload_mode) as w:  # fmt: skip
            ids: dict[tuple[int, str], int] = {}
            for pid in sorted(ranges.pid.unique()):
                w.add_process(int(pid), "python")
                # Other libraries' domains are created first: NCCL gets id 2 in every process.
                ids[(pid, "MyLib")] = w.add_nvtx_domain(int(pid), int(pid), "MyLib", start=1)
                if domain_row:
                    ids[(pid, "NCCL")] = w.add_nvtx_domain(int(pid), int(pid), "NCCL", start=2)
                else:
                    ids[(pid, "NCCL")] = 2  # a cut capture lost the creation row
                ids[(pid, "default")] = 0
                ids[(pid, "unnamed")] = 3  # no creation row, not NCCL's names
                if schemas is not None:
                    w.add_nccl_payload_schemas(int(pid), ids[(pid, "NCCL")], schemas)
            for (pid, tid) in sorted(set(zip(ranges.pid, ranges.tid))):
                w.add_thread(int(pid), int(tid))
            ranges["domain_id"] = [ids[(p, d)] for p, d in zip(ranges.pid, ranges.domain)]
            w.add_nvtx_ranges(ranges.drop(columns="domain"))
            w.add_kernels(pd.DataFrame(self.kernels))
            w.add_runtime(pd.DataFrame(self.runtime))
        return path


def _no_payload_export() -> tuple[_Export, dict[str, int]]:
    """Thread 100: ungrouped call, nested group, a group with two kernels, a call whose kernel
    record is lost, one without any launch, management calls; thread 101 overlaps thread 100;
    thread 102 starts inside a group and ends inside another. Plus look-alikes in other domains
    and a kernel launched outside every range."""
    e = _Export()
    kid = {}
    e.range("ncclCommInitRank", 100, 900)
    e.range("ncclAllReduce", 1_000, 1_100)  # ungrouped
    kid["ungrouped"] = e.launch(1_020)
    e.range("ncclAllReduce", 1_000, 1_100, tid=101)  # same time, other thread
    kid["thread101"] = e.launch(1_050, tid=101)
    # nested group: only the outer ncclGroupEnd launches
    e.range("ncclGroupStart", 2_000, 2_010)
    e.range("ncclGroupStart", 2_020, 2_030)
    e.range("ncclAllReduce", 2_040, 2_060)
    e.range("ncclGroupEnd", 2_070, 2_080)
    e.range("ncclSend", 2_090, 2_100)
    e.range("ncclRecv", 2_110, 2_120)
    e.range("ncclGroupEnd", 2_130, 2_300)
    kid["nested"] = e.launch(2_200)
    # two communicators, two kernels, no communicator ids: must not guess
    e.range("ncclCommCount", 2_900, 2_950)
    e.range("ncclGroupStart", 3_000, 3_010)
    e.range("ncclAllReduce", 3_020, 3_030)
    e.range("ncclAllReduce", 3_040, 3_050)
    e.range("ncclGroupEnd", 3_060, 3_300)
    e.launch(3_100, stream=13)
    e.launch(3_200, stream=14)
    e.range("ncclAllGather", 4_000, 4_100)  # launch recorded, kernel record lost
    e.launch(4_020, record=False)
    e.range("ncclBroadcast", 5_000, 5_100)  # neither launch nor kernel in the export
    kid["outside"] = e.launch(6_000)  # launched outside every NCCL range
    # look-alikes: PyTorch's range in the default domain, a named user domain, an unnamed mixed one
    e.range("nccl:all_reduce", 7_000, 7_500, domain="default")
    e.range("ncclAllReduce", 7_010, 7_490, domain="MyLib")
    kid["mylib"] = e.launch(7_100)
    e.range("ncclAllReduce", 7_600, 7_700, domain="unnamed")
    e.range("forward", 7_710, 7_800, domain="unnamed")
    # thread 102: capture began inside a group; capture ends inside another group
    e.range("ncclSend", 1_000, 1_010, tid=102)
    e.range("ncclRecv", 1_020, 1_030, tid=102)
    e.range("ncclGroupEnd", 1_040, 1_200, tid=102)
    kid["orphan_end"] = e.launch(1_100, tid=102, name=SENDRECV)
    e.range("ncclGroupStart", 8_000, 8_010, tid=102)
    e.range("ncclAllReduce", 8_020, 8_030, tid=102)
    return e, kid


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """The no-payload export twice: with and without the NCCL domain's creation row."""
    out = {}
    for row in (True, False):
        e, kid = _no_payload_export()
        path = e.write(tmp_path_factory.mktemp("nsys") / f"row{int(row)}.sqlite", domain_row=row,
                       payload_mode="none")  # fmt: skip
        with NsysExport.open(path) as x:
            out[row] = (x.nccl_api_calls(), kid)
    return out


def _rows(calls: pd.DataFrame, tid: int, op: str) -> pd.DataFrame:
    return calls[(calls.tid == tid) & (calls.op == op)]


@pytest.mark.parametrize("domain_row", [True, False], ids=["domain-row", "no-domain-row"])
def test_synthetic_links_each_case_exactly(synthetic, domain_row):
    res, kid = synthetic[domain_row]
    c = res.calls
    assert _dtypes(c) == [(col, k) for col, k in NCCL_API_CALL_COLUMNS]
    assert set(c.status) <= set(STATUSES)
    # only NCCL's ranges: not PyTorch's, not the named user domain's, not the unnamed mixed domain's
    assert len(c) == 22 and (c.domain_id == 2).all()
    assert res.domains.recognised_by.tolist() == ["domain_name" if domain_row else "range_names+payload_schemas"]
    t100 = c[c.tid == 100].reset_index(drop=True)
    assert t100.op.tolist() == ["CommInitRank", "AllReduce", "GroupStart", "GroupStart", "AllReduce", "GroupEnd",
                                "Send", "Recv", "GroupEnd", "CommCount", "GroupStart", "AllReduce", "AllReduce",
                                "GroupEnd", "AllGather", "Broadcast"]  # fmt: skip
    assert t100.status.tolist() == ["not_a_launch", "matched", "not_a_launch", "not_a_launch", "matched",
                                    "not_a_launch", "matched", "matched", "matched", "not_a_launch",
                                    "not_a_launch", "ambiguous_kernel", "ambiguous_kernel", "several_kernels",
                                    "kernel_missing", "no_kernel"]  # fmt: skip
    corr = t100.kernel_correlation_id.tolist()
    assert corr[1] == kid["ungrouped"] and corr[4] == corr[6] == corr[7] == corr[8] == kid["nested"]
    assert pd.isna(corr[11]) and pd.isna(corr[12]) and pd.isna(corr[13])  # two kernels: no guess
    assert t100.kernels_in_launch_range.tolist()[11:16] == [2, 2, 2, 0, 0]
    assert t100.lost_launches_in_launch_range.tolist()[14:16] == [1, 0]
    # groups: ids, depths, launch range = the outer ncclGroupEnd
    assert t100.group_id.isna().tolist() == [True, True] + [False] * 7 + [True] + [False] * 4 + [True, True]
    assert t100.group_id[2:9].nunique() == 1 and t100.group_id[2] != t100.group_id[10]
    assert t100.group_depth.tolist()[2:9] == [0, 1, 2, 1, 1, 1, 0]
    assert t100.launch_range_start[[4, 6, 7, 8]].tolist() == [2_130] * 4 and pd.isna(t100.launch_range_start[5])
    assert t100.launch_range_start[1] == 1_000
    # second thread: its own call, its own kernel, although thread 100's call overlaps it
    t101 = c[c.tid == 101]
    assert t101.kernel_correlation_id.tolist() == [kid["thread101"]] and t101.status.tolist() == ["matched"]
    # thread 102: the calls before a ncclGroupEnd without start belong to it; an unterminated group
    t102 = c[c.tid == 102].reset_index(drop=True)
    assert t102.op.tolist() == ["Send", "Recv", "GroupEnd", "GroupStart", "AllReduce"]
    assert t102.status.tolist() == ["matched"] * 3 + ["not_a_launch", "no_launch_range"]
    assert t102.kernel_correlation_id.tolist()[:3] == [kid["orphan_end"]] * 3
    assert t102.group_id[0] == t102.group_id[2] != t102.group_id[4]
    s = res.summary()
    assert (s["nccl_kernels"], s["kernels_linked"], s["kernels_outside_launch_ranges"]) == (8, 4, 2)
    assert (s["api_calls"], s["matched"], s["calls_ambiguous_kernel"], s["calls_no_launch_range"]) == (12, 7, 2, 1)
    # schemas registered, payloads not exported
    assert res.payload == "missing" and "--include-blobs=true" in res.payload_warning


def test_synthetic_payloads_are_decoded_and_assign_kernels_by_communicator(tmp_path):
    e = _Export()
    a, b = 0xA000_0000_0000_0001, 0xB000_0000_0000_0002  # communicator ids above 2^63
    ar = lambda comm, nbytes: {"NCCL communicator ID": comm, "Message size [bytes]": nbytes,  # noqa: E731
                               "Reduction operation": "max"}
    e.range("ncclCommInitRank", 100, 900, payload={"NCCL communicator ID": a, "No. of ranks": 8, "Rank": 3,
                                                   "CUDA device": 1})  # fmt: skip
    e.range("ncclAllReduce", 1_000, 1_100, payload=ar(a, 1024))  # teaches: stream 13 serves a
    ka = e.launch(1_020, stream=13)
    e.range("ncclAllReduce", 1_200, 1_300, payload=ar(b, 4096))  # teaches: stream 14 serves b
    kb = e.launch(1_220, stream=14)
    e.range("ncclGroupStart", 2_000, 2_010)
    e.range("ncclAllReduce", 2_020, 2_030, payload=ar(a, 1024))
    e.range("ncclSend", 2_040, 2_050, payload={"NCCL communicator ID": b, "Message size [bytes]": 64,
                                               "Peer rank": 5})  # fmt: skip
    e.range("ncclGroupEnd", 2_060, 2_300)
    kb2 = e.launch(2_100, stream=14)  # b's kernel first: assignment is by stream, not by order
    ka2 = e.launch(2_200, stream=13)
    e.range("ncclGroupStart", 3_000, 3_010)  # one communicator split into two plans: no guess
    e.range("ncclAllReduce", 3_020, 3_030, payload=ar(a, 1 << 30))
    e.range("ncclAllReduce", 3_040, 3_050, payload=ar(a, 1 << 30))
    e.range("ncclGroupEnd", 3_060, 3_300)
    e.launch(3_100, stream=13)
    e.launch(3_200, stream=13)
    with NsysExport.open(e.write(tmp_path / "payload.sqlite")) as x:
        res = x.nccl_api_calls()
    c = res.calls
    assert res.payload == "decoded" and res.payload_warning is None
    assert c.op.tolist() == ["CommInitRank", "AllReduce", "AllReduce", "GroupStart", "AllReduce", "Send", "GroupEnd",
                             "GroupStart", "AllReduce", "AllReduce", "GroupEnd"]  # fmt: skip
    assert c.status.tolist() == ["not_a_launch", "matched", "matched", "not_a_launch", "matched", "matched",
                                 "several_kernels", "not_a_launch", "ambiguous_kernel", "ambiguous_kernel",
                                 "several_kernels"]  # fmt: skip
    assert c.kernel_correlation_id.tolist()[1:3] == [ka, kb]
    assert c.kernel_correlation_id.tolist()[4:6] == [ka2, kb2]
    assert c.payload_source.tolist() == ["dynamic"] * 3 + [None] + ["dynamic"] * 2 + [None] * 2 + ["dynamic"] * 2 \
        + [None]  # fmt: skip
    assert c.nccl_comm_id.tolist()[:3] == [a, a, b] and c.nccl_message_bytes.tolist()[1:3] == [1024, 4096]
    assert c.nccl_redop[1] == 2 and c.nccl_peer[5] == 5 and (c.nccl_nranks[0], c.nccl_rank[0]) == (8, 3)
    assert c.nccl_comm_id[5] == b and c.nccl_message_bytes[8] == 1 << 30


def test_export_tables_writes_an_empty_table_with_full_schema_without_nccl_ranges(tmp_path):
    e = _Export()
    e.range("train_step", 0, 10_000, domain="default")
    e.launch(500)
    with NsysExport.open(e.write(tmp_path / "none.sqlite", schemas=None, payload_mode="none")) as x:
        paths = x.export_tables(tmp_path / "out")
    table = read_table(paths["nccl_api_calls"])
    assert len(table) == 0 and table.columns.tolist() == [c for c, _ in NCCL_API_CALL_COLUMNS]
    session = json.loads(paths["session"].read_text())
    assert session["nccl_api_calls"]["payload"] == "no_ranges" and session["nccl_api_calls"]["nccl_kernels"] == 1
    assert session["nccl_api_calls"]["kernels_outside_launch_ranges"] == 1
