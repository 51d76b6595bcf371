"""One nsys export per process (``srun nsys profile -o trace_%q{SLURM_PROCID}``), the most common
way to profile a Megatron job under SLURM: every export of a node is read, each process's
kernels come from the export that recorded it, and the result equals a per-node capture of the
same run, through ``nccltrace analyze`` and through the workflow."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from data_paths import CAPTURE
from emulated_runs import SMALL_MODEL

from nccltrace.cli import main
from nccltrace.core.layout import RunLayout
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run

REPO = Path(__file__).resolve().parents[1]
RUN = {**SMALL_MODEL, "name": "pp", "tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 2, "iterations": 2,
       "nccl_version": "2.21.5", "nsys_version": "2026.4", "seed": 5,
       "imperfections": {"clock_offset_ns_max": 3_000_000, "drop_kernels": 0.02}}  # fmt: skip
_MATCH = ["file", "line", "status", "reason", "kernel_correlation_id", "kernel_global_pid", "kernel_start"]


def _matches(out: Path) -> pd.DataFrame:
    ops = read_table(out / "ops" / "ops.parquet")
    calls = ops[ops["row_kind"] == "call"]
    return calls[_MATCH].sort_values(["file", "line"]).reset_index(drop=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("per_process")
    node = emulate_run(RUN, base / "node" / "raw").out_dir
    per = emulate_run({**RUN, "nsys_per_process": True}, base / "proc" / "raw").out_dir
    return base, node, per


def test_the_emulator_writes_one_export_per_process_in_a_directory_per_node(runs):
    _, node, per = runs
    assert sorted(p.name for p in (node / "nsys").glob("*.sqlite")) == ["node000.sqlite", "node001.sqlite"]
    assert not list((per / "nsys").glob("*.sqlite"))
    assert sorted(p.name for p in (per / "nsys" / "node000").glob("*.sqlite")) == ["trace_0.sqlite", "trace_1.sqlite"]
    layout = RunLayout.of_raw(per)
    assert layout.raw_export_hosts() == ["node000", "node001"] and len(layout.raw_exports("node001")) == 2


def test_analyze_reads_every_export_of_a_node_and_gets_the_per_node_result(runs):
    base, node, per = runs
    for raw, out in ((node, base / "out_node"), (per, base / "out_proc")):
        assert main(["analyze", str(raw), "-o", str(out), "-q", "--until", "ops"]) == 0
    a, b = _matches(base / "out_node"), _matches(base / "out_proc")
    assert (a["status"] == "matched").mean() > 0.9
    pd.testing.assert_frame_equal(a, b)
    kernels = read_table(base / "out_proc" / "parsed" / "nsys" / "node001" / "kernels.parquet")
    assert kernels["pid"].nunique() == 2
    for host in ("node000", "node001"):  # no export set aside: each node's two are both read
        session = json.loads((base / "out_proc" / "parsed" / "nsys" / host / "session.json").read_text())
        assert sorted(s["source_file"] for s in session["sources"]) == sorted(
            p.name for p in (per / "nsys" / host).glob("*.sqlite"))
        assert session["source_kind"] == "nsys"


def test_per_node_and_per_process_exports_of_one_run_may_be_mixed(runs, tmp_path):
    _, node, per = runs
    mixed = tmp_path / "mixed"
    shutil.copytree(node / "nccl", mixed / "nccl")
    (mixed / "nsys").mkdir()
    shutil.copy(node / "nsys" / "node000.sqlite", mixed / "nsys")
    shutil.copytree(per / "nsys" / "node001", mixed / "nsys" / "node001")
    assert main(["analyze", str(mixed), "-o", str(tmp_path / "out"), "-q", "--until", "ops"]) == 0
    got = _matches(tmp_path / "out")
    assert (got["status"] == "matched").mean() > 0.9
    hosts = read_table(tmp_path / "out" / "ops" / "ops.parquet")
    assert set(hosts.loc[hosts["status"] == "matched", "host"]) == {"node000", "node001"}


@pytest.mark.slow
def test_the_workflow_parses_per_process_exports_and_matches_analyze(tmp_path):
    campaign = {
        "campaign": "pp",
        "defaults": {"backend": "emulate", "micro_batch_size": 1, "global_batch_size": 4, "iterations": 2,
                     "nccl_version": "2.24.3", "nsys_version": "2026.4", "seed": 3, "nsys_per_process": True},
        "models": {"tiny": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128,
                            "vocab_size": 1024, "precision": "bf16"}},
        "hardware": {"T": {"gpu": "T4", "nodes": 2, "gpus_per_node": 2, "preset": "a40"}},
        "matrix": [{"models": ["tiny"], "hardware": ["T"], "parallelism": [{"tp": 2}]}],
    }  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(campaign))
    run = "tiny_T4_n2_tp2_pp1_ep1_cp1_vpp1_sp0_dp2"
    target = f"results/pp/{run}/ops/ops.parquet"
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
           "--configfile", str(tmp_path / "config.yaml"), "--cores", "2", target]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    base = tmp_path / "results" / "pp" / run
    assert len(list((base / "raw" / "nsys" / "node000").glob("*.sqlite"))) == 2
    wf = _matches(base)
    assert (wf["status"] == "matched").mean() > 0.9
    assert main(["analyze", str(base / "raw"), "-o", str(tmp_path / "cli"), "-q", "--until", "ops"]) == 0
    pd.testing.assert_frame_equal(wf, _matches(tmp_path / "cli"))


def test_the_import_keeps_every_export_of_a_node(runs, tmp_path):
    from nccltrace.acquisition.raw import import_raw

    _, _, per = runs
    src = tmp_path / "job"
    shutil.copytree(per / "nccl", src / "logs")
    for p in sorted((per / "nsys").rglob("*.sqlite")):  # as users leave them: one flat directory
        shutil.copy(p, src / f"{p.parent.name}_{p.name}")
    raw = tmp_path / "run" / "raw"
    record = import_raw(src, raw, run_id="job", settings={"tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 2})
    assert record["exports"] == ["node000", "node001"]
    layout = RunLayout.of_raw(raw)
    assert layout.raw_export_hosts() == ["node000", "node001"]
    assert [len(layout.raw_exports(h)) for h in ("node000", "node001")] == [2, 2]


def test_the_import_keeps_the_flight_recorder_dumps_it_finds_and_names_a_damaged_one(runs, tmp_path):
    """Dumps are found by content, whatever their names; a pickle that is not a dump is named
    in the import's warnings, not copied."""
    from nccltrace.acquisition.raw import import_raw

    real = CAPTURE / "flight_recorder"
    _, _, per = runs
    src = tmp_path / "job"
    shutil.copytree(per / "nccl", src / "logs")
    for p in sorted((per / "nsys").rglob("*.sqlite")):
        shutil.copy(p, src / f"{p.parent.name}_{p.name}")
    for i, dump in enumerate(sorted(real.glob("*.pkl"))):
        shutil.copy(dump, src / f"trace_dump_{i}")  # TORCH_FR_DUMP_TEMP_FILE names
    import pickle

    (src / "other.bin").write_bytes(pickle.dumps({"not": "a dump"}, protocol=4))
    raw = tmp_path / "run" / "raw"
    record = import_raw(src, raw, run_id="job", settings={"tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 2})
    layout = RunLayout.of_raw(raw)
    assert layout.flight_recorder == layout.raw_flight_recorder
    assert len(list(layout.raw_flight_recorder.iterdir())) == 4
    assert any("other.bin" in w and "not a Flight Recorder dump" in w for w in record.get("warnings", []))
