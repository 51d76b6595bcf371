"""Megatron-LM ``pretrain_gpt.py`` arguments for a run, and the checks a run must pass before
anything is queued.

The arguments follow the thesis's launch script (appendix A.3), written for Megatron-Core r0.13
and later (the flags used exist unchanged in both), so that a captured run is the run the thesis
measured: GPT dimensions, Adam with the GPT-3 recipe, fp16 (bf16 for MoE), sequence parallelism
whenever TP > 1 unless the run says otherwise, MoE with aux-loss balancing and grouped GEMM,
``--mock-data`` unless a dataset is configured. A ``capture`` setting adds ``--profile`` and its
step and rank flags (:mod:`nccltrace.core.capture_window`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nccltrace.core.capture_window import CaptureWindow, capture_problems
from nccltrace.megatron.constraints import LaunchShape, problems
from nccltrace.megatron.model import MODEL_DEFAULTS, padded_vocab_size

def _int(s: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """Setting ``key`` as an integer; unset: ``default``, else Megatron's model default."""
    value = s.get(key)
    if value is None:
        return MODEL_DEFAULTS[key] if default is None else default
    return int(value)


def launch_shape(settings: Mapping[str, Any]) -> LaunchShape:
    """What Megatron's launch rules check of a run's settings (unset model settings: their
    defaults; etp is tp, as the launch passes no --expert-tensor-parallel-size)."""
    s = settings
    tp, seq, hidden = _int(s, "tp"), _int(s, "seq_length"), _int(s, "hidden_size")
    overlap = s.get("overlap_p2p_comm")
    return LaunchShape(
        world=_int(s, "nodes", 1) * _int(s, "gpus_per_node", 1), tp=tp, pp=_int(s, "pp"), cp=_int(s, "cp"),
        ep=_int(s, "ep"), vpp=_int(s, "vpp"), num_layers=_int(s, "num_layers"), hidden_size=hidden,
        num_attention_heads=_int(s, "num_attention_heads"),
        ffn_hidden_size=int(s["ffn_hidden_size"]) if s.get("ffn_hidden_size") else 4 * hidden,
        padded_vocab_size=padded_vocab_size(_int(s, "vocab_size"), tp), seq_length=seq,
        micro_batch_size=_int(s, "micro_batch_size"), global_batch_size=_int(s, "global_batch_size"),
        num_experts=_int(s, "num_experts"), moe_router_topk=_int(s, "moe_router_topk"),
        precision=str(s.get("precision") or MODEL_DEFAULTS["precision"]),
        sequence_parallel=bool(s.get("sequence_parallel")),
        overlap_p2p=True if overlap is None else bool(overlap),  # Megatron's default with the interleaved schedule
    )  # fmt: skip


def launch_problems(settings: Mapping[str, Any]) -> list[str]:
    """Everything that would make Megatron-LM refuse (or silently change) this configuration.

    Returns messages of the form ``"<field>: <what is wrong>; <what to do>"``; empty when the
    run can be launched. Megatron's own argument checks (:mod:`nccltrace.megatron.constraints`)
    and the capture window's, so that a bad matrix entry fails at workflow start, not after
    hours in the queue.
    """
    shape = launch_shape(settings)
    found = list(problems(shape))
    out = [str(p) for p in found]
    if any(p.rule == "world_tiles" for p in found):
        return out  # the capture window's ranks need a world Megatron accepts
    out += [f"{field}: {message}" for field, message in
            capture_problems(settings.get("capture"), iterations=_int(settings, "iterations"),
                             world_size=int(shape.world))]  # fmt: skip
    return out


def megatron_arguments(settings: Mapping[str, Any], *, dataset: Mapping[str, Any] | None = None) -> list[str]:
    """The ``pretrain_gpt.py`` command-line arguments for a run (list of strings, no shell quoting)."""
    s = settings
    tp, pp, cp, ep, vpp = (_int(s, k) for k in ("tp", "pp", "cp", "ep", "vpp"))
    layers, seq = _int(s, "num_layers"), _int(s, "seq_length")
    args = [
        "--num-layers", str(layers),
        "--hidden-size", str(_int(s, "hidden_size")),
        "--num-attention-heads", str(_int(s, "num_attention_heads")),
        "--seq-length", str(seq),
        "--max-position-embeddings", str(seq),
    ]  # fmt: skip
    if s.get("ffn_hidden_size"):
        args += ["--ffn-hidden-size", str(int(s["ffn_hidden_size"]))]
    if s.get("position_embedding_type") == "rope":
        args += ["--position-embedding-type", "rope"]
    if s.get("untie_embeddings"):
        args += ["--untie-embeddings-and-output-weights"]
    args += [
        "--micro-batch-size", str(_int(s, "micro_batch_size")),
        "--global-batch-size", str(_int(s, "global_batch_size")),
        "--train-iters", str(_int(s, "iterations")),
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0",
        "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
        "--seed", str(_int(s, "seed", 42)),
    ]  # fmt: skip
    precision = s.get("precision", MODEL_DEFAULTS["precision"])
    if precision in ("fp16", "bf16"):
        args.append(f"--{precision}")
    args += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if cp > 1:
        args += ["--context-parallel-size", str(cp)]
    if vpp > 1:
        args += ["--num-layers-per-virtual-pipeline-stage", str(layers // (pp * vpp))]
    if s.get("sequence_parallel") and tp > 1:
        args.append("--sequence-parallel")
    if s.get("distributed_optimizer"):
        args.append("--use-distributed-optimizer")
    recompute = s.get("recompute", MODEL_DEFAULTS["recompute"])
    if recompute == "selective":
        args.append("--recompute-activations")
    elif recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    experts = _int(s, "num_experts")
    if experts:
        args += [
            "--num-experts", str(experts),
            "--expert-model-parallel-size", str(ep),
            "--moe-router-topk", str(_int(s, "moe_router_topk")),
            "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", "0.01",
            "--moe-grouped-gemm",
            "--moe-token-dispatcher-type", str(s.get("moe_token_dispatcher", MODEL_DEFAULTS["moe_token_dispatcher"])),
            "--disable-bias-linear",
        ]  # fmt: skip
        if _int(s, "moe_layer_freq") > 1:
            args += ["--moe-layer-freq", str(int(s["moe_layer_freq"]))]
    ds = dict(dataset or {})
    if ds.get("data_path"):
        args += ["--data-path", str(ds["data_path"]), "--split", str(ds.get("split", "949,50,1")),
                 "--tokenizer-type", str(ds.get("tokenizer_type", "GPT2BPETokenizer"))]  # fmt: skip
        if ds.get("vocab_file"):
            args += ["--vocab-file", str(ds["vocab_file"])]
        if ds.get("merge_file"):
            args += ["--merge-file", str(ds["merge_file"])]
    else:
        # No corpus download: synthetic tokens with the run's vocabulary size.
        args += ["--mock-data", "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", str(_int(s, "vocab_size"))]  # fmt: skip
    # Per-iteration timers (the NVTX/timeline context the analysis uses); no evaluation, no checkpoints.
    args += ["--log-interval", "1", "--eval-interval", "1000000", "--eval-iters", "0", "--log-timers-to-tensorboard"]
    window = CaptureWindow.of_settings(s)
    if window is not None:  # the ranks call cudaProfilerStart/Stop around the window (nsys: capture range)
        args += window.megatron_arguments(_int(s, "nodes", 1) * _int(s, "gpus_per_node", 1))
    args += [str(a) for a in s.get("megatron_args", [])]
    return args


def parse_megatron_arguments(argv: list[str]) -> dict[str, Any]:
    """Read run settings back from ``pretrain_gpt.py`` arguments (the inverse of
    :func:`megatron_arguments` for the settings that shape communication). Used by the test
    double of ``torchrun`` and to check an imported run's recorded command line."""
    flags = {"--sequence-parallel": "sequence_parallel", "--use-distributed-optimizer": "distributed_optimizer",
             "--untie-embeddings-and-output-weights": "untie_embeddings"}  # fmt: skip
    ints = {"--num-layers": "num_layers", "--hidden-size": "hidden_size", "--num-attention-heads": "num_attention_heads",
            "--seq-length": "seq_length", "--ffn-hidden-size": "ffn_hidden_size", "--vocab-size": "vocab_size",
            "--micro-batch-size": "micro_batch_size", "--global-batch-size": "global_batch_size",
            "--train-iters": "iterations", "--tensor-model-parallel-size": "tp",
            "--pipeline-model-parallel-size": "pp", "--context-parallel-size": "cp",
            "--expert-model-parallel-size": "ep", "--num-experts": "num_experts", "--moe-router-topk": "moe_router_topk",
            "--moe-layer-freq": "moe_layer_freq", "--seed": "seed"}  # fmt: skip
    out: dict[str, Any] = {}
    profile: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in flags:
            out[flags[a]] = True
        elif a in ints and i + 1 < len(argv):
            out[ints[a]] = int(argv[i + 1])
            i += 1
        elif a in ("--fp16", "--bf16"):
            out["precision"] = a[2:]
        elif a == "--moe-token-dispatcher-type" and i + 1 < len(argv):
            out["moe_token_dispatcher"] = argv[i + 1]
            i += 1
        elif a == "--num-layers-per-virtual-pipeline-stage" and i + 1 < len(argv):
            out["_layers_per_virtual_stage"] = int(argv[i + 1])
            i += 1
        elif a == "--recompute-activations":
            out["recompute"] = "selective"
        elif a == "--recompute-granularity" and i + 1 < len(argv):
            out["recompute"] = argv[i + 1]
            i += 1
        elif a == "--position-embedding-type" and i + 1 < len(argv):
            out["position_embedding_type"] = argv[i + 1]
            i += 1
        elif a == "--profile":
            profile["on"] = True
        elif a in ("--profile-step-start", "--profile-step-end") and i + 1 < len(argv):
            profile[a[10:]] = int(argv[i + 1])
            i += 1
        elif a == "--profile-ranks":  # nargs='+'
            while i + 1 < len(argv) and argv[i + 1].lstrip("-").isdigit():
                profile.setdefault("ranks", []).append(int(argv[i + 1]))
                i += 1
        i += 1
    per_stage = out.pop("_layers_per_virtual_stage", None)
    if per_stage:
        out["vpp"] = out.get("num_layers", 0) // (out.get("pp", 1) * per_stage)
    out.setdefault("precision", "fp32")
    if profile.get("on"):
        # Megatron core_r0.13's defaults: steps 10..12 (0-based start, end), ranks [0]
        out["capture"] = CaptureWindow.setting_from_megatron(profile.get("step-start", 10), profile.get("step-end", 12),
                                                             profile.get("ranks", [0]))  # fmt: skip
    return out
