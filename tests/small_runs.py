"""Emulator settings shared by the tests that need a small run: a 4-layer model whose runs
emulate and analyse in seconds."""

SMALL_MODEL = {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 256, "micro_batch_size": 1,
               "vocab_size": 1000, "iterations": 2, "global_batch_size": 4}  # fmt: skip
