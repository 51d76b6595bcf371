"""Typed run settings (nccltrace.core.settings): validation, round trip, one nesting precedence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nccltrace.analyze import RawInputs, _check_sizes, _run_settings
from nccltrace.campaign.matrix import RunSpec
from nccltrace.core.capture_window import CaptureError
from nccltrace.core.errors import ConfigError
from nccltrace.core.settings import RunSettings, flatten_settings
from nccltrace.outputs.summary import config_row

CAMPAIGN_RUN = {"model": "dense", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 256,
                "vocab_size": 1000, "micro_batch_size": 2, "global_batch_size": 16, "iterations": 4, "nodes": 2,
                "gpus_per_node": 4, "tp": 2, "pp": 2, "precision": "bf16", "sequence_parallel": True,
                "capture": {"steps": [2, 3], "ranks": "all", "pre_window_metadata": "kept"}, "hardware": "a100"}


def test_typed_fields_of_a_campaign_run():
    s = RunSettings.from_mapping(CAMPAIGN_RUN)
    assert (s.tp, s.pp, s.cp, s.ep, s.vpp, s.etp, s.dp) == (2, 2, 1, 1, 1, None, None)
    assert (s.nodes, s.gpus_per_node, s.world_size) == (2, 4, 8)
    assert s.sequence_parallel and not s.distributed_optimizer and s.num_experts == 0
    assert (s.num_layers, s.hidden_size, s.precision, s.model, s.iterations) == (4, 256, "bf16", "dense", 4)
    assert s.capture is not None and s.capture.loop_indices == (1, 2)
    assert s.declares_sizes and s.declares_world


def test_round_trip_keeps_the_recorded_bytes():
    s = RunSettings.from_mapping(CAMPAIGN_RUN)
    assert json.dumps(s.to_mapping()) == json.dumps(CAMPAIGN_RUN)  # same keys, same order, same values
    assert RunSettings.from_mapping(s.to_mapping()).to_mapping() == CAMPAIGN_RUN
    assert dict(s) == CAMPAIGN_RUN and s.get("hardware") == "a100" and s == CAMPAIGN_RUN
    assert RunSettings.of(s) is s and RunSettings.of(None) is None
    # Megatron's own argument names are read too, and kept as given
    meg = RunSettings.from_mapping({"tensor_model_parallel_size": "4", "data_parallel_size": 2.0})
    assert (meg.tp, meg.dp) == (4, 2) and meg.to_mapping() == {"tensor_model_parallel_size": "4",
                                                             "data_parallel_size": 2.0}


def test_world_size_from_the_init_lines_is_recorded_at_the_end():
    s = RunSettings.from_mapping({"tp": 2, "run_id": "r"})
    assert not s.declares_world and s.world_size is None
    filled = s.with_world_size(8)
    assert filled.world_size == 8 and list(filled.to_mapping()) == ["tp", "run_id", "world_size"]
    assert s.to_mapping() == {"tp": 2, "run_id": "r"}  # frozen: the original is unchanged
    assert _check_sizes(s, 8, "given settings").to_mapping() == {"tp": 2, "run_id": "r", "world_size": 8}
    with pytest.raises(ValueError, match=r"declared parallel sizes \(given settings\): .*not divisible"):
        _check_sizes(RunSettings.from_mapping({"tp": 3}), 8, "given settings")


@pytest.mark.parametrize(("settings", "field", "says"), [
    ({"tp": "abc"}, "tp", "expected a positive integer, got 'abc'"),
    ({"pp": 0}, "pp", "expected a positive integer, got 0"),
    ({"tensor_model_parallel_size": 1.5}, "tensor_model_parallel_size", "got 1.5"),
    ({"nodes": True}, "nodes", "got True"),
    ({"num_experts": -1}, "num_experts", "expected a non-negative integer, got -1"),
    ({"world_size": 6, "nodes": 2, "gpus_per_node": 4}, "world_size", "world_size=6 but nodes*gpus_per_node"),
    ({"precision": "fp8"}, "precision", "expected one of fp16, bf16, fp32, got 'fp8'"),
    ({"sequence_parallel": "maybe"}, "sequence_parallel", "expected true or false, got 'maybe'"),
    ({"config": {"hidden_size": [256]}}, "hidden_size", "got [256]"),
])  # fmt: skip
def test_bad_values_name_the_setting_the_value_and_what_is_expected(settings, field, says):
    with pytest.raises(ConfigError) as err:
        RunSettings.from_mapping(settings)
    assert err.value.field == field and says in str(err.value)


def test_a_bad_capture_fails_when_the_settings_are_read():
    with pytest.raises(CaptureError, match="capture.steps"):
        RunSettings.from_mapping({"nodes": 1, "gpus_per_node": 2, "iterations": 4, "capture": {"steps": [3, 9]}})


def test_analyze_reads_the_settings_once_and_names_their_source(tmp_path: Path):
    inputs = RawInputs(tmp_path, {}, {}, None)
    with pytest.raises(ValueError, match=r"run settings \(given settings\): tp: expected a positive integer"):
        _run_settings(inputs, {"tp": "two"})
    assert _run_settings(inputs, None) == (None, "")
    (tmp_path / "run.yaml").write_text("run_id: r7\nconfig: {tp: 2, nodes: 1, gpus_per_node: 4}\n")
    settings, source = _run_settings(RawInputs(tmp_path, {}, {}, tmp_path / "run.yaml"), {"pp": 2})
    assert source == "run.yaml + given settings"
    assert (settings.tp, settings.pp, settings.world_size, settings.run_id) == (2, 2, 4, "r7")


def test_campaign_run_gives_typed_settings():
    spec = RunSpec("r", "emulate", dict(CAMPAIGN_RUN))
    assert spec.run_settings.tp == 2 and spec.run_settings.to_mapping() == spec.analysis_settings
    with pytest.raises(ConfigError, match="precision"):
        RunSpec("r", "import", {**CAMPAIGN_RUN, "precision": "fp8"}).run_settings  # noqa: B018


def test_config_row_and_flatten_settings_agree_on_nested_and_flat_settings():
    # A run.yaml-like record with a top-level override and a null the derived section fills. Before,
    # config_row read only the config section (tp 2, the top level ignored) while flatten_settings
    # put the top level first (tp 4); with the derived section alone (no config) config_row ignored
    # it (sequence_parallel False) where flatten_settings read it (True).
    nested = {"tp": 4, "config": {"tp": 2, "nodes": 1, "gpus_per_node": 8, "dp": None, "name": "m"},
              "derived": {"dp": 2, "num_microbatches": 4}}
    flat_and_derived = {"tp": 4, "nodes": 1, "gpus_per_node": 8, "derived": {"dp": 2, "sequence_parallel": True}}
    for settings in (nested, flat_and_derived):
        flat = flatten_settings(settings, skip_none=True)
        row = config_row(settings)
        typed = RunSettings.from_mapping(settings)
        assert row["tp"] == flat["tp"] == typed.tp == 4
        assert row["dp"] == flat["dp"] == typed.dp == 2
        assert row["world_size"] == typed.world_size == 8
    assert config_row(flat_and_derived)["sequence_parallel"] is RunSettings.from_mapping(flat_and_derived).sequence_parallel
    assert config_row(nested)["model"] == RunSettings.from_mapping(nested).model == "m"
    # flat settings (a campaign's) read as before
    assert config_row(CAMPAIGN_RUN)["tp"] == 2 and config_row(CAMPAIGN_RUN)["dp"] == 2
