"""The nsys reader on emulated exports of every supported schema version, against ground truth."""

from __future__ import annotations

import pytest

from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.nsys.reader import NsysExport

BASE = {"model": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
        "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 4, "iterations": 2, "nodes": 2,
        "gpus_per_node": 2, "pp": 2, "precision": "bf16", "seed": 11}


@pytest.mark.parametrize(
    "nsys_version, schema, nccl_version, payloads",
    [
        ("2022.4", "3.0.0", "2.18.3", "none"),
        ("2024.6", "3.16.1", "2.21.5", "blob"),
        ("2026.4", "3.28.1", "2.28.3", "dynamic"),
        ("2024.6", "3.16.1", "2.24.3", "json"),
    ],
)
def test_emulated_export_reads_back_kernels_launches_and_nccl_ranges(tmp_path, nsys_version, schema, nccl_version,
                                                                     payloads):
    res = emulate_run({**BASE, "nsys_version": nsys_version, "nccl_version": nccl_version,
                       "nvtx_payloads": payloads}, tmp_path)
    truth_k = read_table(res.ground_truth["kernels"])
    truth_ops = read_table(res.ground_truth["ops"])
    for path in res.nsys_files:
        host = path.stem
        with NsysExport.open(path) as x:
            assert x.schema_version == schema and x.hostname == host
            k = x.kernels()
            tk = truth_k[(truth_k.host == host) & ~truth_k.dropped.astype(bool)]
            assert len(k) == len(tk) > 0
            got = set(zip(k.pid, k.correlation_id, k.start, k.end, k.name))
            assert got == set(zip(tk.pid, tk.correlation_id, tk.start, tk.end, tk.name))
            if host == "node001":  # HW byte >= 0x80: ids are stored negative, as on some real captures
                assert (k.global_pid < 0).all()
            # Every kernel has its launch, on a thread of its own process, before it starts.
            assert k.launch_tid.notna().all() and (k.launch_end <= k.start).all()
            nvtx = x.nvtx()
            sends = nvtx[(nvtx.domain == "NCCL") & (nvtx.text == "ncclSend")]
            ops = truth_ops[(truth_ops.host == host) & (truth_ops.op == "Send")]
            assert len(sends) == len(ops) > 0
            if payloads == "none":
                assert sends.nccl_message_bytes.isna().all()
            else:
                assert sorted(sends.nccl_message_bytes.astype(int)) == sorted(ops["bytes"].astype(int))
                assert set(sends.payload_source) == {payloads}


def test_launches_whose_kernel_record_is_missing_are_listed(tmp_path):
    """A dropped kernel record leaves its launch call: the reader lists exactly those launches."""
    from nccltrace.core.tables import read_table
    from nccltrace.emulator.run import emulate_run
    from nccltrace.nsys.reader import NsysExport

    res = emulate_run({"model": "t", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                       "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 4, "iterations": 1,
                       "gpus_per_node": 2, "tp": 2, "seed": 4, "imperfections": {"drop_kernels": 0.3}}, tmp_path)
    truth = read_table(res.ground_truth["kernels"])
    with NsysExport.open(next((tmp_path / "nsys").glob("*.sqlite"))) as ex:
        lost = ex.launches_without_kernel()
        kept = ex.kernels()
    dropped = truth[truth["dropped"].astype(bool)]
    assert len(dropped) > 0
    assert sorted(zip(lost["pid"], lost["correlation_id"])) == sorted(zip(dropped["pid"], dropped["correlation_id"]))
    assert not set(zip(kept["pid"], kept["correlation_id"])) & set(zip(lost["pid"], lost["correlation_id"]))
