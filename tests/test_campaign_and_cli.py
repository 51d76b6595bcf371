"""Campaign expansion, config validation, CLI behaviour and workflow hygiene."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snakemake_jobs import scheduled_jobs

from nccltrace.campaign.matrix import CampaignError, expand_campaign, load_campaign
from nccltrace.cli import build_parser, main
from nccltrace.core.tables import TABLES
from nccltrace.outputs.tables_doc import tables_markdown

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "config.yaml"


def test_example_campaign_expands_to_the_thesis_configurations():
    runs = {r.run_id: r for r in expand_campaign(load_campaign(EXAMPLE))}
    assert set(runs) == {
        "dense_A100_tp1_pp1_ep1_cp1_vpp1_sp0_dp4",
        "dense_A100_tp1_pp1_ep1_cp1_vpp1_sp0_dp4_distopt",
        "dense_A100_tp1_pp4_ep1_cp1_vpp1_sp0_dp1",
        "dense_A100_tp1_pp4_ep1_cp1_vpp2_sp0_dp1",
        "dense_reduced_A100_tp4_pp1_ep1_cp1_vpp1_sp1_dp1",
        "dense_reduced_A100_tp4_pp1_ep1_cp1_vpp1_sp0_dp1",
        "dense_moe_A100_tp1_pp1_ep4_cp1_vpp1_sp0_dp4_a2a",
        "dense_moe_A100_tp1_pp1_ep4_cp1_vpp1_sp0_dp4_ag",
        # how real users capture: a step window, and a rank subset (tests/test_capture_window.py)
        "dense_A100_tp1_pp2_ep1_cp1_vpp1_sp0_dp2_cap3-4",
        "dense_A100_tp1_pp2_ep1_cp1_vpp1_sp0_dp2_cap1-10_rk0.3",
    }
    moe = runs["dense_moe_A100_tp1_pp1_ep4_cp1_vpp1_sp0_dp4_ag"].settings
    assert moe["moe_router_topk"] == 2 and moe["precision"] == "bf16" and moe["moe_token_dispatcher"] == "allgather"
    assert runs["dense_A100_tp1_pp4_ep1_cp1_vpp2_sp0_dp1"].world_size == 4


def test_run_ids_are_stable_across_expansions_and_hashes_differ_per_run():
    a = expand_campaign(load_campaign(EXAMPLE))
    b = expand_campaign(load_campaign(EXAMPLE))
    assert [r.run_id for r in a] == [r.run_id for r in b]
    assert [r.config_hash() for r in a] == [r.config_hash() for r in b]
    assert len({r.config_hash() for r in a}) == len(a)


def test_unknown_setting_is_rejected_with_its_location(tmp_path):
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["matrix"][0]["parallelism"][2]["tensor_parallel"] = 4  # typo for tp
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    with pytest.raises(CampaignError, match=r"matrix/0/parallelism/2.*tensor_parallel"):
        load_campaign(p)


def test_inconsistent_dp_and_undefined_model_are_rejected():
    cfg = yaml.safe_load(EXAMPLE.read_text())
    bad = copy.deepcopy(cfg)
    bad["matrix"][0]["parallelism"] = [{"tp": 2, "dp": 4}]
    with pytest.raises(CampaignError, match="dp=4 does not match world size 4"):
        expand_campaign(bad)
    bad = copy.deepcopy(cfg)
    bad["matrix"][0]["models"] = ["gpt3"]
    with pytest.raises(CampaignError, match="'gpt3' is not defined under 'models:'"):
        expand_campaign(bad)


def test_exclude_removes_matching_entries():
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["exclude"] = [{"model": "dense_reduced", "tp": 4}]
    ids = [r.run_id for r in expand_campaign(cfg)]
    assert len(ids) == 8 and not any("_tp4_" in i for i in ids)


def test_every_cli_subcommand_has_help(capsys):
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    assert {"parse-nccl", "parse-nsys", "emulate", "communicators", "runs", "tables-doc"} <= set(subcommands)
    for name in subcommands:
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([name, "--help"])
        assert exc.value.code == 0
        assert "usage: nccltrace " + name in capsys.readouterr().out


def test_cli_parse_nccl_writes_tables_report_and_manifest(tmp_path, fixture_logs, capsys):
    rc = main(["parse-nccl", str(fixture_logs / "NVIDIA_nccl_203.log"), "-o", str(tmp_path), "-q"])
    assert rc == 0
    assert "7 calls" in capsys.readouterr().out
    for name in ("calls", "comms", "tuning", "unclassified"):
        assert (tmp_path / f"{name}.parquet").exists()
    import json

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["stage"] == "parse_nccl" and len(manifest["inputs"]) == 1
    assert manifest["code"]["source_sha256"] and "pyarrow" in manifest["tools"]


def test_cli_reports_missing_input_without_traceback(tmp_path, capsys):
    rc = main(["parse-nccl", str(tmp_path / "missing"), "-o", str(tmp_path / "o"), "-q"])
    assert rc == 2 and "error: no NCCL log files at" in capsys.readouterr().err


def test_tables_doc_covers_every_column():
    text = tables_markdown()
    for name, schema in TABLES.items():
        assert f"## `{name}.parquet`" in text
        for field in schema:
            assert field.metadata and field.metadata.get(b"doc"), f"{name}.{field.name} lacks a doc"


def test_snakemake_lint_is_clean_and_dry_run_shows_the_dag(tmp_path):
    lint = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    # A fresh working directory, so results of an earlier run in the checkout do not matter.
    dry = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--quiet", "rules", "--snakefile",
                          str(REPO / "Snakefile"), "--directory", str(tmp_path), "--configfile", str(EXAMPLE)],
                         cwd=REPO, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    # every run's acquisition is scheduled at once (not one run after another's); the campaign
    # report's code stamp is made before it (the stages' stamps once their runs are acquired)
    runs = len(expand_campaign(load_campaign(EXAMPLE)))
    assert scheduled_jobs(dry.stdout + dry.stderr) == {"acquire": runs, "code_stamp": 1, "campaign_report": 1,
                                                       "all": 1}
    assert not (tmp_path / "results").exists()  # a dry run writes nothing, the code stamps included


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    block = readme.split("## Quick start", 1)[1].split("```", 2)[1]
    commands = [line for line in block.splitlines() if line and not line.startswith("#") and "bash" not in line]
    assert len(commands) == 2, commands
    assert commands[1] in ci.splitlines()


def test_emulated_hardware_needs_a_known_node_model():
    from nccltrace.campaign.matrix import EMULATOR_PRESETS
    from nccltrace.emulator.config import HARDWARE_PRESETS

    assert set(EMULATOR_PRESETS) == set(HARDWARE_PRESETS)
    cfg = yaml.safe_load(EXAMPLE.read_text())
    runs = expand_campaign(cfg)
    assert {r.settings["hardware"] for r in runs} == {"a100"}
    cfg["hardware"]["A100"].pop("preset")
    cfg["hardware"]["A100"]["gpu"] = "B200"
    with pytest.raises(CampaignError, match="no node model for gpu 'B200'; set 'preset'"):
        expand_campaign(cfg)


def test_cli_emulates_a_campaign_run_and_parses_its_export(tmp_path, capsys):
    rc = main(["emulate", "dense_A100_tp1_pp1_ep1_cp1_vpp1_sp0_dp4", "--campaign", str(EXAMPLE), "-o",
               str(tmp_path / "raw"), "-q"])
    assert rc == 0 and "4 ranks, 1268 logged ops, 308 kernels" in capsys.readouterr().out  # thesis: 308
    assert main(["parse-nsys", str(tmp_path / "raw" / "nsys" / "node000.sqlite"), "-o", str(tmp_path / "n")]) == 0
    assert (tmp_path / "n" / "kernels.parquet").exists() and (tmp_path / "n" / "manifest.json").exists()
    assert main(["parse-nccl", str(tmp_path / "raw" / "nccl"), "-o", str(tmp_path / "p"), "-q"]) == 0
    assert main(["communicators", str(tmp_path / "p"), "-o", str(tmp_path / "c")]) == 0
    assert "world size 4, 0 incomplete" in capsys.readouterr().out
    assert main(["emulate", "no_such_run", "--campaign", str(EXAMPLE), "-o", str(tmp_path / "x")]) == 2
    assert "run 'no_such_run' is not in" in capsys.readouterr().err
