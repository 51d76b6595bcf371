"""Shared by the tests on emulated runs: a small model's settings, and the comparison of the
out-of-core metrics tables with the in-memory ones."""

from __future__ import annotations

from typing import Any

import pandas as pd

from nccltrace.core.tables import read_table
from nccltrace.metrics.compute import TABLE_SCHEMAS

# a 4-layer model whose runs emulate and analyse in seconds
SMALL_MODEL = {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 256, "micro_batch_size": 1,
               "vocab_size": 1000, "iterations": 2, "global_batch_size": 4}  # fmt: skip


def assert_metrics_tables_equal(written: Any, expected: Any) -> None:
    """The tables ``write_run_metrics_out_of_core`` wrote (``written``) equal those of
    ``compute_run_metrics`` (``expected``), column order and problems included."""
    for name, schema in TABLE_SCHEMAS.items():
        got = read_table(written.paths[name])
        want = getattr(expected, name).reset_index(drop=True)
        assert list(got.columns) == schema.names
        pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-12, obj=name)
    assert written.problems == expected.problems
