"""EmulatorConfig: construction, derived values and Megatron-LM validation rules."""

from __future__ import annotations

import pytest

from nccltrace.emulator.config import ConfigError, EmulatorConfig, Imperfections


def test_defaults_are_the_thesis_dense_model_on_one_4_gpu_node():
    cfg = EmulatorConfig()
    cfg.validate()
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length) == (16, 512, 8, 1024)
    assert (cfg.global_batch_size, cfg.micro_batch_size, cfg.iterations, cfg.precision) == (64, 4, 10, "fp16")
    assert cfg.world_size == 4 and cfg.dp == 4 and cfg.num_microbatches == 4
    assert cfg.ffn == 2048
    assert cfg.padded_vocab_size == 50304  # 50257 padded to a multiple of 128
    assert cfg.run_id == "dense_tp1_pp1_ep1_cp1_vpp1_sp0_dp1".replace("dp1", "dp4")
    imp = cfg.imperfections
    assert not imp.fuse_grouped_p2p and not imp.duplicate_log_lines.active and imp.drop_log_lines == 0
    assert imp.drop_kernels == 0 and imp.single_rank_comm_ops == 0 and imp.kernels_without_log == 0
    assert imp.clock_offset_ns_max == 0 and imp.clock_drift_ppm_max == 0 and imp.arrival_skew_ns_max == 0
    assert imp.torn_lines == 0


def test_run_id_names_model_and_parallelism():
    cfg = EmulatorConfig.from_dict({"model": "dense", "tp": 4, "sequence_parallel": True})
    assert cfg.run_id == "dense_tp4_pp1_ep1_cp1_vpp1_sp1_dp1"
    moe = EmulatorConfig.from_dict({"name": "dense_moe", "ep": 4, "num_experts": 4, "precision": "bf16",
                                    "moe_token_dispatcher": "allgather"})  # fmt: skip
    assert moe.run_id == "dense_moe_tp1_pp1_ep4_cp1_vpp1_sp0_dp4_agdisp"
    assert moe.expert_dp == 1 and moe.dp == 4


def test_vocab_padding_uses_128_times_tp():
    assert EmulatorConfig.from_dict({"tp": 4, "num_attention_heads": 8}).padded_vocab_size == 50688
    assert EmulatorConfig.from_dict({"tp": 2}).padded_vocab_size == 50432


def test_from_yaml_text_and_nested_imperfections(tmp_path):
    text = """
    model: dense_moe
    num_experts: 4
    ep: 2
    precision: bf16
    nccl_version: 2.28.9
    nsys_version: 2024.6
    imperfections:
      fuse_grouped_p2p: true
      duplicate_log_lines: {ranks: [1], fraction: 1.0}
      arrival_skew_ns_max: 20000
    """
    p = tmp_path / "c.yaml"
    p.write_text(text)
    cfg = EmulatorConfig.from_yaml(p)
    assert cfg.name == "dense_moe" and cfg.nsys_version == "2024.6" and cfg.nsys_schema == "3.16.1"
    assert cfg.imperfections.fuse_grouped_p2p and cfg.imperfections.duplicate_log_lines.ranks == [1]
    assert EmulatorConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"tp": 3}, "tp"),  # 4 % 3
        ({"nodes": 1, "gpus_per_node": 6, "tp": 4}, "tp"),
        ({"ep": 2}, "ep"),  # dense model
        ({"num_experts": 6, "ep": 4, "precision": "bf16"}, "num_experts"),
        ({"num_experts": 4, "ep": 8, "precision": "bf16"}, "ep"),  # world 4 % (etp*ep*pp)
        ({"num_experts": 4, "precision": "fp16"}, "precision"),  # MoE needs bf16
        ({"num_layers": 10, "pp": 4}, "num_layers"),
        ({"pp": 2, "vpp": 3}, "vpp"),  # 16 % 6
        ({"vpp": 2}, "vpp"),  # needs pp > 1
        ({"global_batch_size": 60}, "global_batch_size"),
        ({"sequence_parallel": True}, "sequence_parallel"),
        ({"tp": 4, "num_attention_heads": 6, "hidden_size": 480}, "num_attention_heads"),
        ({"nccl_version": "2.16.2"}, "nccl_version"),
        ({"nccl_version": "banana"}, "nccl_version"),
        ({"nsys_version": "2023.1"}, "nsys_version"),
        ({"nvtx_payloads": "blob", "nsys_version": "2022.4"}, "nvtx_payloads"),
        ({"nvtx_payloads": "dynamic", "nsys_version": "2024.6"}, "nvtx_payloads"),
        ({"precision": "fp8"}, "precision"),
        ({"recompute": "some"}, "recompute"),
        ({"init_style": "eager"}, "init_style"),
        ({"num_experts": 4, "precision": "bf16", "moe_alltoall": "native", "nccl_version": "2.24.3"}, "moe_alltoall"),
        ({"num_experts": 4, "ep": 2, "tp": 2, "precision": "bf16"}, "sequence_parallel"),
        ({"pp": 4, "vpp": 2, "global_batch_size": 24, "micro_batch_size": 4}, "global_batch_size"),  # 6 % 4
        ({"imperfections": {"drop_log_lines": 1.5}}, "imperfections.drop_log_lines"),
        ({"imperfections": {"duplicate_log_lines": {"ranks": [9], "fraction": 1}}}, "imperfections.duplicate_log_lines.ranks"),
        ({"imperfections": {"single_rank_comm_ops": -3}}, "imperfections.single_rank_comm_ops"),
        ({"num_layer": 4}, "num_layer"),  # unknown key
        ({"imperfections": {"drop_lines": 0.1}}, "imperfections.drop_lines"),
        ({"iterations": 0}, "iterations"),
        ({"capture": {"steps": [9, 11]}}, "capture.steps"),  # beyond the 10 iterations
        ({"capture": {"ranks": [4]}}, "capture.ranks"),  # world size 4
        ({"capture": {"pre_window_metadata": "lost"}}, "capture.pre_window_metadata"),
    ],
)
def test_validation_errors_name_the_field(changes, field):
    with pytest.raises(ConfigError) as exc:
        EmulatorConfig.from_dict(changes)
    assert exc.value.field == field
    assert str(exc.value).startswith(f"{field}: ") and len(exc.value.message) > 10


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match="did you mean 'num_layers'"):
        EmulatorConfig.from_dict({"num_layer": 4})


@pytest.mark.parametrize("version", ["2.18.3", "2.18.5", "2.21.5", "2.24.3", "2.28.9", "2.28", "2.30.7"])
def test_supported_nccl_versions(version):
    assert EmulatorConfig.from_dict({"nccl_version": version}).nccl.major == 2


@pytest.mark.parametrize("nsys, schema", [("2022.4", "3.0.0"), ("2024.6", "3.16.1"), ("2026.4", "3.28.1"),
                                          ("2024.6.2.225", "3.16.1")])  # fmt: skip
def test_nsys_versions_map_to_export_schemas(nsys, schema):
    assert EmulatorConfig.from_dict({"nsys_version": nsys}).nsys_schema == schema


def test_megatron_expert_rule_is_world_divisible_by_etp_ep_pp():
    # EP is carved out of DP x CP: tp=2, dp=2, ep=2 with etp=tp=2 needs world % (2*2*1) == 0.
    cfg = EmulatorConfig.from_dict({"tp": 2, "ep": 2, "num_experts": 4, "precision": "bf16",
                                    "sequence_parallel": True})  # fmt: skip
    assert cfg.dp == 2 and cfg.expert_dp == 1
    cfg = EmulatorConfig.from_dict({"tp": 2, "ep": 4, "etp": 1, "num_experts": 4, "precision": "bf16",
                                    "sequence_parallel": True})  # fmt: skip
    assert cfg.expert_dp == 1 and cfg.expert_tp == 1


def test_fp16_overflow_model_and_realistic_imperfections():
    assert EmulatorConfig().overflow_iterations == 10  # min(17, iterations)
    assert EmulatorConfig.from_dict({"iterations": 30}).overflow_iterations == 17
    assert EmulatorConfig.from_dict({"fp16_overflow_iterations": 0}).overflow_iterations == 0
    assert EmulatorConfig.from_dict({"num_experts": 4, "precision": "bf16"}).overflow_iterations == 0
    imp = Imperfections.realistic()
    assert imp.fuse_grouped_p2p and imp.single_rank_comm_ops == -1 and imp.arrival_skew_ns_max > 0


def test_capture_is_normalised_and_tags_the_run_id_but_is_absent_from_a_plain_config():
    cfg = EmulatorConfig.from_dict({"capture": {"ranks": [2, 0]}})
    assert cfg.capture == {"steps": [1, 10], "ranks": [0, 2], "pre_window_metadata": "kept"}
    assert cfg.run_id.endswith("_dp4_cap1-10_rk0.2") and cfg.capture_window.profiles(2)
    assert EmulatorConfig.from_dict(cfg.to_dict()) == cfg
    assert "capture" not in EmulatorConfig().to_dict() and EmulatorConfig().capture_window is None


def test_a_single_gpu_job_emulates_to_empty_logs_without_failing(tmp_path):
    # one GPU: no communicator, nothing for NCCL to log; the job's end is its start
    from nccltrace.emulator.run import emulate_run

    cfg = {"model": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
           "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 2, "iterations": 2, "nodes": 1,
           "gpus_per_node": 1, "precision": "bf16"}  # fmt: skip
    res = emulate_run(cfg, tmp_path / "raw")
    assert res.n_ranks == 1 and res.n_ops == 0 and res.duration_ns == 0
    assert [p.stat().st_size for p in res.log_files] == [0]
