"""The export writer's column input (the emulator's path, no pandas) writes the same file as a
DataFrame: same values, same NULLs, same order, same bytes. Covers what that path does
differently: constant and all-NULL columns as SQL literals, partly-NULL columns through a
``NULLIF`` sentinel (also when the obvious sentinel is a real value), several rows per INSERT
(batch sizes around the statement size), unsigned 64-bit values, and the payload modes."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from nccltrace.nsys.writer import NsysExportWriter

UTC0 = 1_760_000_000_000_000_000
COMM = 0xF1E2D3C4B5A69788  # > 2**63


def _kernels(n: int) -> dict:
    r = np.arange(n)
    return {
        "start": (1_000 * r).tolist(), "end": (1_000 * r + 500).tolist(), "device_id": 0, "context_id": 1,
        "stream_id": (13 + r % 3).tolist(), "correlation_id": (r + 1).tolist(), "pid": 4242,
        "name": [f"kernel{i % 4}(args)" for i in r], "short_name": [f"kernel{i % 4}" for i in r],
        "grid_x": (1 + r % 5).tolist(), "grid_y": 1, "grid_z": 1, "block_x": 512, "block_y": 1, "block_z": 1,
        "registers_per_thread": 96, "static_shared_memory": 0, "dynamic_shared_memory": (8704 * (r % 2)).tolist(),
        # partly NULL, with -1 (the first sentinel tried) as a real value
        "graph_node_id": [None if i % 3 else int(i) - 1 for i in r],
        "graph_id": [None] * n,
    }  # fmt: skip


def _runtime(n: int) -> dict:
    r = np.arange(n)
    return {"start": (1_000 * r - 300).tolist(), "end": (1_000 * r - 200).tolist(), "pid": 4242,
            "tid": [4242 + i % 2 for i in r], "correlation_id": (r + 1).tolist(),
            "name": ["cuLaunchKernelEx" if i % 4 else "cudaLaunchKernel_v7000" for i in r],
            "event_class": [1 if i % 4 else 0 for i in r], "return_value": 0}  # fmt: skip


def _nvtx(n: int, domain: int, payloads: bool) -> dict:
    r = np.arange(n)
    texts = ["ncclAllReduce" if i % 5 else "iteration 1" for i in r]
    d = {
        "start": (1_000 * r - 400).tolist(), "end": [None if i == 7 else int(1_000 * i) for i in r], "pid": 4242,
        "tid": 4242, "text": texts, "registered": [bool(i % 5) for i in r],
        "domain_id": [domain if i % 5 else 0 for i in r], "event_type": [60 if i % 11 == 0 else 59 for i in r],
        "uint64_value": [2**64 - 5 if i % 7 == 0 else None for i in r],
        "int64_value": [None if i % 2 else -int(i) for i in r],
    }  # fmt: skip
    if payloads:
        d["nccl_payload"] = [
            {"NCCL communicator ID": COMM, "Message size [bytes]": int(4096 * i), "Reduction operation": "sum"}
            if i % 5 else None for i in r
        ]  # fmt: skip
    return d


def _write(path: Path, version: str, mode: str, n: int, frame: bool) -> None:
    conv = pd.DataFrame if frame else (lambda d: d)

    def df(d: dict) -> dict:
        if not frame:
            return d
        out = {k: (v if isinstance(v, list) else [v] * n) for k, v in d.items()}
        if "uint64_value" in out:
            out["uint64_value"] = pd.array(out["uint64_value"], dtype="UInt64")
        for k in ("graph_node_id", "graph_id", "end", "int64_value"):
            if k in out:
                out[k] = pd.array(out[k], dtype="Int64")
        return out

    with NsysExportWriter(path, version, hostname="node-a", session_start_utc_ns=UTC0, payload_mode=mode,
                          hw_id=0x81, vm_id=1) as w:  # fmt: skip
        w.add_process(4242, "python3")
        w.add_thread(4242, 4242, "python3")
        dom = w.add_nvtx_domain(4242, 4242, "NCCL", -5)
        if mode != "none":
            w.add_nccl_payload_schemas(4242, dom, (2, 27, 3))
        for _ in range(2):  # two batches: ids and strings continue
            w.add_runtime(conv(df(_runtime(n))))
            w.add_kernels(conv(df(_kernels(n))))
            w.add_nvtx_ranges(conv(df(_nvtx(n, dom, mode != "none"))))


def _dump(path: Path) -> list:
    con = sqlite3.connect(path)
    try:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return [(t, con.execute(f'SELECT * FROM "{t}" ORDER BY rowid').fetchall()) for t in names]
    finally:
        con.close()


@pytest.mark.parametrize("n", [1, 31, 64, 65, 200])
@pytest.mark.parametrize(("version", "mode"), [("3.0.0", "none"), ("3.16.1", "blob"), ("3.16.1", "json"),
                                               ("3.28.1", "dynamic")])  # fmt: skip
def test_column_input_writes_the_file_a_dataframe_writes(tmp_path, version, mode, n):
    a, b = tmp_path / "frame" / "x.sqlite", tmp_path / "columns" / "x.sqlite"  # (the name is in the metadata)
    _write(a, version, mode, n, frame=True)
    _write(b, version, mode, n, frame=False)
    assert _dump(a) == _dump(b)
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    # the NULLs are NULLs and the sentinel value -1 survived
    con = sqlite3.connect(b)
    nodes = [r[0] for r in con.execute("SELECT graphNodeId FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY rowid")]
    con.close()
    assert nodes[: min(n, 4)] == [-1, None, None, 2][: min(n, 4)]


def test_column_input_rejects_what_a_frame_rejects(tmp_path):
    with NsysExportWriter(tmp_path / "x.sqlite", "3.16.1", hostname="h", session_start_utc_ns=UTC0) as w:
        bad = _kernels(3)
        bad["start"] = [1, None, 3]
        with pytest.raises(ValueError, match="missing values"):
            w.add_kernels(bad)
        bad = _kernels(3)
        bad["end"] = [1, 2]
        with pytest.raises(ValueError, match="values"):
            w.add_kernels(bad)
        bad = _kernels(3)
        del bad["name"]
        with pytest.raises(ValueError, match="missing required"):
            w.add_kernels(bad)
