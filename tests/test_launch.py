"""Launch path of backend slurm without SLURM: Megatron arguments, configuration checks, the
node script, and a one-node training run through the torchrun/nsys test doubles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nccltrace.acquisition.launch import (
    TrainingSetup,
    parse_minutes,
    render_node_script,
    run_training,
)
from nccltrace.acquisition.megatron import (
    launch_problems,
    megatron_arguments,
    parse_megatron_arguments,
)
from nccltrace.acquisition.raw import (
    RawImportError,
    assemble_raw,
    import_raw,
)
from nccltrace.acquisition.status import read_status
from nccltrace.analyze import find_raw_inputs
from nccltrace.campaign.matrix import CampaignError, expand_campaign, validate_runs

REPO = Path(__file__).resolve().parents[1]
DOUBLES = REPO / "tests" / "doubles"
TINY = dict(model="dense", num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=256,
            micro_batch_size=2, global_batch_size=8, iterations=2, nodes=1, gpus_per_node=4, precision="fp16")


def _setup(**extra) -> TrainingSetup:
    py = sys.executable
    cfg = {"torchrun": f"{py} {DOUBLES / 'fake_torchrun.py'}", "nsys": f"{py} {DOUBLES / 'fake_nsys.py'}",
           "env": {"NCCLTRACE_FAKE_SETTINGS": json.dumps({"nsys_version": "2022.4", "hardware": "a100"})}}
    cfg.update(extra)
    return TrainingSetup.from_config(cfg)


@pytest.mark.parametrize("settings", [
    {**TINY, "tp": 2, "sequence_parallel": True},
    {**TINY, "pp": 2, "vpp": 2},
    {**TINY, "precision": "bf16", "num_experts": 4, "ep": 4, "moe_layer_freq": 2, "moe_token_dispatcher": "allgather"},
    {**TINY, "distributed_optimizer": True, "recompute": "selective"},
])
def test_megatron_arguments_carry_every_setting_that_shapes_communication(settings):
    args = megatron_arguments(settings)
    back = parse_megatron_arguments(args)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "global_batch_size", "precision"):
        assert back[key] == settings[key]
    for key in ("tp", "pp", "ep", "vpp", "num_experts", "moe_layer_freq", "moe_token_dispatcher",
                "sequence_parallel", "distributed_optimizer", "recompute"):
        if key in settings and settings[key] not in (1, False, "none"):
            assert back[key] == settings[key], key
    assert "--mock-data" in args and args[args.index("--vocab-size") + 1] == "50257"


def test_a_configured_dataset_replaces_mock_data():
    args = megatron_arguments(TINY, dataset={"data_path": "/d/fineweb_text_document", "vocab_file": "v.json",
                                             "merge_file": "m.txt"})
    assert "--mock-data" not in args
    assert args[args.index("--data-path") + 1] == "/d/fineweb_text_document"
    assert args[args.index("--tokenizer-type") + 1] == "GPT2BPETokenizer"


@pytest.mark.parametrize("change, field", [
    ({"tp": 3}, "tp"),
    ({"precision": "bf16", "num_experts": 6, "ep": 4}, "num_experts"),
    ({"num_experts": 4, "ep": 4}, "precision"),
    ({"pp": 2, "vpp": 3}, "vpp"),
    ({"global_batch_size": 10}, "global_batch_size"),
    ({"sequence_parallel": True}, "sequence_parallel"),
    ({"ep": 2}, "ep"),
    ({"num_attention_heads": 6, "tp": 4, "hidden_size": 120}, "num_attention_heads"),
])
def test_configurations_that_cannot_work_are_named_with_their_field(change, field):
    problems = launch_problems({**TINY, **change})
    assert problems and any(p.startswith(f"{field}:") for p in problems), problems


def test_a_campaign_with_a_bad_entry_is_rejected_before_anything_runs():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["matrix"][0]["parallelism"] += [{"tp": 3}, {"pp": 4, "vpp": 3}]
    with pytest.raises(CampaignError) as err:
        validate_runs(expand_campaign(config))
    text = str(err.value)
    assert "2 problem(s)" in text and "nothing was started" in text
    assert "dense_A100_tp3" in text and "vpp: 16 layers" in text


def test_node_script_sets_the_thesis_launch_environment(tmp_path):
    script = render_node_script("r", {**TINY, "tp": 2, "sequence_parallel": True, "env": {"NCCL_ALGO": "Ring"}},
                                _setup(setup=["module load cuda/12.8"], conda="megatron"), tmp_path / "capture")
    for needle in ("export NCCL_DEBUG=INFO", "NCCL_DEBUG_SUBSYS=INIT,COLL,P2P,TUNING,GRAPH,ENV",
                   'NCCL_DEBUG_FILE="$CAPTURE/nccl/nccl_%h_%p.log"', "NCCL_TOPO_DUMP_FILE",
                   "NCCL_DEBUG_TIMESTAMP_LEVELS=WARN,INFO", "CUDA_DEVICE_MAX_CONNECTIONS=1", "--trace=cuda,nvtx",
                   "--rdzv_backend=c10d", "--sequence-parallel", "module load cuda/12.8", "conda activate megatron",
                   'export NCCL_ALGO="Ring"', "scontrol show hostnames"):
        assert needle in script, needle
    assert script.index("--output") < script.index("--nnodes=1")  # nsys wraps torchrun


def test_time_limits_in_every_slurm_spelling():
    assert [parse_minutes(v) for v in (90, "90", "2h", "30m", "1:30:00", "1-00:00:00")] == [90, 90, 120, 30, 90, 1440]


def test_one_node_run_through_the_doubles_leaves_a_complete_capture_and_raw_dir(tmp_path):
    rec = run_training("r", {**TINY, "tp": 2, "sequence_parallel": True}, _setup(), tmp_path / "capture",
                       runtime_minutes=30)
    assert rec["status"] == "ok" and rec["exit_code"] == 0
    cap = tmp_path / "capture"
    assert len(list((cap / "nccl").glob("nccl_*.log"))) == 4
    (report,) = (cap / "nsys").glob("*.nsys-rep")
    assert json.loads((cap / "launch" / "launch.json").read_text())["megatron_arguments"][:2] == ["--num-layers", "4"]
    export = tmp_path / "export" / f"{report.stem}.sqlite"
    export.parent.mkdir()
    assert subprocess.run([sys.executable, str(DOUBLES / "fake_nsys.py"), "export", "--type", "sqlite", "-o",
                           str(export), str(report)], check=False).returncode == 0
    assemble_raw(cap, [export], tmp_path / "raw", run_id="r", settings=TINY)
    raw = find_raw_inputs(tmp_path / "raw")
    assert len(raw.logs) == 4 and list(raw.exports) == [report.stem] and raw.run_yaml is not None
    assert read_status(tmp_path / "raw")["status"] == "ok"
    # hard links: the raw tree costs no extra disk
    log = next((cap / "nccl").glob("*.log"))
    assert os.stat(log).st_ino == os.stat(tmp_path / "raw" / "nccl" / log.name).st_ino


def test_a_failed_training_is_retried_in_the_job_then_recorded_not_raised(tmp_path):
    settings = {**TINY, "env": {"FAKE_TORCHRUN_EXIT_CODE": "3"}}
    rec = run_training("r", settings, _setup(retries=1), tmp_path / "capture", runtime_minutes=30)
    assert rec["status"] == "failed" and "exited with code 3" in rec["reason"]
    assert rec["attempt"] == rec["attempts"] == 2 and [h["exit_code"] for h in rec["history"]] == [3, 3]
    assert "out of memory" in rec["log_tail"]
    assert not (tmp_path / "capture.partial").exists()
    assemble_raw(tmp_path / "capture", [], tmp_path / "raw", run_id="r", settings=TINY)
    assert read_status(tmp_path / "raw")["status"] == "failed"


def test_a_hung_training_is_stopped_before_the_job_limit_and_recorded(tmp_path, monkeypatch):
    from nccltrace.acquisition import launch

    monkeypatch.setattr(launch, "MIN_TRAINING_BUDGET_S", 3.0)
    settings = {**TINY, "env": {"FAKE_TORCHRUN_SLEEP": "600"}}
    rec = run_training("r", settings, _setup(time_margin_minutes=0.0, retries=0), tmp_path / "capture",
                       runtime_minutes=0.05)
    assert rec["status"] == "failed" and rec["reason"].startswith("time limit")
    assert rec["wall_s"] < 60


def test_import_renames_logs_by_their_process_and_rejects_unusable_directories(tmp_path):
    run_training("r", TINY, _setup(), tmp_path / "capture", runtime_minutes=30)
    src = tmp_path / "elsewhere"
    src.mkdir()
    for i, log in enumerate(sorted((tmp_path / "capture" / "nccl").glob("*.log"))):
        shutil.copyfile(log, src / f"rank{i}.out.log")  # names that say nothing
    (report,) = (tmp_path / "capture" / "nsys").glob("*.nsys-rep")
    subprocess.run([sys.executable, str(DOUBLES / "fake_nsys.py"), "export", "--type", "sqlite", "-o",
                    str(src / "profile_node0.sqlite"), str(report)], check=True)
    rec = import_raw(src, tmp_path / "raw", run_id="r", settings=TINY)
    raw = find_raw_inputs(tmp_path / "raw")
    assert sorted(raw.logs) == sorted(p.stem for p in (tmp_path / "capture" / "nccl").glob("*.log"))
    assert list(raw.exports) == [report.stem]  # named after the host inside the export
    assert rec["processes"] == 4
    assert rec["sources"] == ["nccl-log", "nsys-export"]
    (src / "profile_node0.sqlite").unlink()  # logs alone: imported, with how to get kernel times
    rec = import_raw(src, tmp_path / "raw2", run_id="r", settings=TINY)
    assert rec["sources"] == ["nccl-log"] and any("no kernel trace" in w for w in rec["warnings"])
    for log in src.glob("*.log"):
        log.unlink()
    with pytest.raises(RawImportError, match="none of the run's evidence sources found"):
        import_raw(src, tmp_path / "raw4", run_id="r", settings=TINY)
    with pytest.raises(RawImportError, match="no such directory"):
        import_raw(tmp_path / "nope", tmp_path / "raw3", run_id="r", settings=TINY)


def test_the_doubles_say_they_are_doubles():
    for name in ("fake_torchrun.py", "fake_nsys.py"):
        assert (DOUBLES / name).read_text().startswith('"""TEST DOUBLE')


def test_a_megatron_checkout_at_another_commit_than_pinned_fails_with_the_fix(tmp_path):
    meg = tmp_path / "Megatron-LM"
    meg.mkdir()
    git = ["git", "-C", str(meg), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    setup = _setup(megatron={"path": str(meg), "commit": "73a28a1078a8da8e6062199f7f1079a52173ab77"})
    rec = run_training("r", TINY, setup, tmp_path / "capture", runtime_minutes=30)
    assert rec["status"] == "failed" and "code 78" in rec["reason"]
    assert "pins 73a28a1" in rec["log_tail"] and "checkout" in rec["log_tail"]


def test_the_thesis_chapter5_campaign_is_sixteen_valid_slurm_runs():
    from nccltrace.campaign.matrix import load_campaign

    runs = expand_campaign(load_campaign(REPO / "config" / "thesis-chapter5.yaml"))
    validate_runs(runs)
    assert len(runs) == 16 and {r.backend for r in runs} == {"slurm"}
    assert {r.hardware["gpu"] for r in runs} == {"A40", "A100"}
    assert "dense_moe_A100_tp1_pp1_ep4_cp1_vpp1_sp0_dp4_a2a_rcselective" in {r.run_id for r in runs}


def test_a_capture_expects_reports_only_from_nodes_with_a_profiled_rank(tmp_path):
    from nccltrace.acquisition.launch import check_capture

    settings = {**TINY, "nodes": 2, "capture": {"steps": [1, 2], "ranks": [1, 2]}}  # both on node 0
    (tmp_path / "nccl").mkdir()
    (tmp_path / "nsys").mkdir()
    for i in range(8):
        (tmp_path / "nccl" / f"nccl_h_{i}.log").write_text("x")
    (tmp_path / "nsys" / "h0.nsys-rep").write_text("x")
    assert check_capture(tmp_path, settings) == []
    assert check_capture(tmp_path, {**settings, "capture": {"steps": [1, 2], "ranks": [1, 6]}}) == [
        f"1 nsys reports for 2 nodes with a profiled rank in {tmp_path / 'nsys'}"]
    assert "for 2 nodes in" in check_capture(tmp_path, {**TINY, "nodes": 2})[0]
