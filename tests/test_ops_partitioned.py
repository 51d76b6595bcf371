"""The run's ops table is partitioned by process: each row group holds one process's rows, so
its footer statistics let a reader of one rank or host skip every other process's data."""

from __future__ import annotations

import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from nccltrace.cli import main
from nccltrace.core.layout import RunLayout
from nccltrace.emulator.run import emulate_run

CFG = {"model": "tiny", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
       "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 8, "iterations": 2, "nodes": 2,
       "gpus_per_node": 4, "tp": 2, "pp": 2, "precision": "bf16", "seed": 11, "compute_kernels": False}  # fmt: skip


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> RunLayout:
    base = tmp_path_factory.mktemp("ops_partitioned")
    emulate_run(CFG, base / "raw")
    assert main(["analyze", str(base / "raw"), "-o", str(base / "out"), "-q", "--until", "ops"]) == 0
    return RunLayout(base / "out")


def test_every_row_group_of_the_ops_table_holds_one_process_with_statistics(layout):
    meta = pq.ParquetFile(layout.ops).metadata
    names = meta.schema.to_arrow_schema().names
    ranks_seen = []
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        for col in ("host", "pid", "global_rank"):
            st = rg.column(names.index(col)).statistics
            assert st is not None and st.has_min_max and st.min == st.max, (i, col)
        ranks_seen.append(rg.column(names.index("global_rank")).statistics.min)
    assert sorted(set(ranks_seen)) == list(range(8))


def test_a_reader_of_one_rank_reads_only_that_ranks_row_groups(layout):
    dataset = ds.dataset(layout.ops, format="parquet")
    fragment = next(iter(dataset.get_fragments()))
    wanted = fragment.subset(ds.field("global_rank") == 5)
    kept = [rg.id for rg in wanted.row_groups]
    all_groups = pq.ParquetFile(layout.ops).metadata.num_row_groups
    assert 0 < len(kept) < all_groups  # pruned by the footer statistics, before any data is read
    table = wanted.to_table(filter=ds.field("global_rank") == 5)
    whole = pq.read_table(layout.ops)
    assert table.num_rows == pc.sum(pc.equal(whole["global_rank"], 5)).as_py()
