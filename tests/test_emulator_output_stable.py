"""The emulator's output is pinned: digests of every file a few small emulations write.

Speed work on the emulator (docs/emulator.md section 3.2) must not change what it writes for a
given seed. Each digest covers one output file: NCCL logs and stdout.log byte for byte; nsys
exports as a canonical dump (every table's CREATE statement and rows in rowid order), since the
file bytes also hold the SQLite library version; ground-truth Parquet files as schema and values
(the file records the writing pyarrow version); run.yaml without the nccltrace version.

If a change to the emulator is meant to change its output, document it in docs/emulator.md and
update the digests here (``python tests/test_emulator_output_stable.py`` prints them).
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from emulated_runs import SMALL_MODEL

from nccltrace.emulator.run import emulate_run

_SMALL = SMALL_MODEL
CONFIGS = {
    # the common path: TP x PP on two nodes, no imperfections
    "plain": {**_SMALL, "name": "plain", "tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 2, "sequence_parallel": True,
              "nccl_version": "2.21.5", "nsys_version": "2024.6"},
    # every imperfection knob (torn stdout, dropped/duplicated lines, dropped kernels, clocks, skew), old versions
    "knobs": {**_SMALL, "name": "knobs", "tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 2, "precision": "fp16",
              "nccl_version": "2.18.3", "nsys_version": "2022.4",
              "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1,
                                "duplicate_log_lines": {"ranks": [0], "fraction": 0.3}, "drop_log_lines": 0.05,
                                "drop_kernels": 0.05, "kernels_without_log": 0.02, "clock_offset_ns_max": 2_000_000,
                                "clock_drift_ppm_max": 5.0, "arrival_skew_ns_max": 50_000, "torn_lines": 0.05}},
    # MoE with expert parallelism, eager split init, timestamps, JSON payloads, VPP with p2p overlap
    "moe": {**_SMALL, "name": "moe", "tp": 2, "pp": 2, "vpp": 2, "nodes": 2, "gpus_per_node": 4, "ep": 2,
            "num_experts": 4, "moe_layer_freq": 2, "moe_router_topk": 2, "precision": "bf16",
            "sequence_parallel": True, "global_batch_size": 8, "init_style": "split", "nccl_version": "2.26.2",
            "nsys_version": "2024.6", "nvtx_payloads": "json", "nccl_timestamps": True, "distributed_optimizer": True},
    # real-build options: CUDA graphs, a step-window capture, dynamic payloads, symmetric kernels
    "graphs_capture": {**_SMALL, "name": "gc", "tp": 2, "pp": 2, "nodes": 1, "gpus_per_node": 4, "iterations": 3,
                       "sequence_parallel": True, "nccl_version": "2.28.9", "nsys_version": "2026.4",
                       "nvtx_payloads": "dynamic", "cuda_graphs": {"parallelism": ["tp"], "warmup_iterations": 1},
                       "capture": {"steps": [2, 3], "ranks": [0, 3], "pre_window_metadata": "dropped"},
                       "kernel_naming": {"symmetric": ["AllGather"]}, "imperfections": {"drop_kernels": 0.1}},
}

EXPECTED: dict[str, dict[str, str]] = {
    'graphs_capture': {
        'ground_truth/clock.parquet': 'f17ecea592f4ec655608edeeda2216455cfb6476f16c67d6cc0848e1622187eb',
        'ground_truth/communicators.parquet': '581be95bdd5c1c5fba99fe1fa4b2134a8d9c94376dd5946dfb70bfde47655a50',
        'ground_truth/kernels.parquet': 'a79a6b5438b8f5881fdd97875dcf77d7f3990c314e4b80712eb141c282278766',
        'ground_truth/ops.parquet': '22bef27e13952168966b76469efdcba6bfd724fbf8b74eba23bab8b6e577a5d7',
        'nccl/nccl_node000_85167.log': '7d0d83a255bbcc249732c30eba2d11f0afa97bdf640823ef6676791909881480',
        'nccl/nccl_node000_85180.log': '785c485c8dd55bb36270120ae9224b1bee40daa06a430bb2b11c2506c8501ab2',
        'nccl/nccl_node000_85193.log': 'da901b2030f98554acde01a73eaa45ac05471af48a6774a5a5ee282dad82bcd4',
        'nccl/nccl_node000_85206.log': '522704ba11a9e9f3d1f7483a5a22e546aae42d8e805c2b69f80f84b2d0972992',
        'nsys/node000.sqlite': '94a97a616506ea1ed4c4b3f2a57740769ad06af7d29805a13cdbb85a666b4951',
        'run.yaml': '5b7290ccd6bc3106094e9642bf1336a7f62353447c96ed803e3cf6a8d9fd3d45',
    },
    'knobs': {
        'ground_truth/clock.parquet': 'a66cd439fa4539db4c1bc527fb29772a1ddaa405bb7bdb20ae987ac16c16e0f0',
        'ground_truth/communicators.parquet': '10bf303bd139159872b2eaf577b513c686617a01eaee4d933b2a08af5877b93a',
        'ground_truth/kernels.parquet': '34d1baecc3aaf8598a6c246bb985e36c50f36832d4ba07f40e296f8dde810e20',
        'ground_truth/ops.parquet': '18df9799ac6fb2fdb74c67c712badf80a4935a9629442364ba3cadeb951866b4',
        'ground_truth/stdout_tears.parquet': '33ed79e708a529b2e2bf30ff29340fbe3d196f7e3c446c90bd4e2e961e44af0c',
        'nccl/nccl_node000_85167.log': '98372f539e5a4d2145747a059f292a200eb57a55ff0ece9d71323012a367147e',
        'nccl/nccl_node000_85180.log': '1dd9efa18d67abe5f6ad27a090bf75c02988244a55ce32dcb40e2a46ea78ce80',
        'nccl/nccl_node001_85685.log': '7bc4b97c219f57fdd5bcb196c04b18729ce21c1dab68ca265f663bb18b0194b5',
        'nccl/nccl_node001_85698.log': '7fee70d6790f0dbfb99cb4b9913e245f97a266c290d08f43cfe8163bed91e076',
        'nsys/node000.sqlite': 'a23b52e0676ff0e77aad8fb2be57627578119119f0ff702d34964482ca17a35c',
        'nsys/node001.sqlite': 'ea562d0ae65b782b7986fe0b247000c0226821dc2a1aae052ba5c842458b67ee',
        'run.yaml': '5a8c1eafd89638323fa3c692ab4bc32c56f2d915104b1cb7d9cb6db9b1008e79',
        'stdout.log': 'a6368d020ccba3c7484f62f5e42550cde8c6b28b8824152561d57514426fb104',
    },
    'moe': {
        'ground_truth/clock.parquet': '119ee97c988abd7a564c619c4717e521f3a761cc7ff412e73df31b80f22b2ead',
        'ground_truth/communicators.parquet': '85d6112a68c1a70f51268804975ee74d32afddfe9020813f8266947c551aace5',
        'ground_truth/kernels.parquet': '4952af42c4c2ae68d9ceab160e1b939100cf1f6428edb1d499e27e9353368036',
        'ground_truth/ops.parquet': 'fe0c4e746aca5470085bce612bdbbe7e10e77243c7837205f14bb3e5435fe7ad',
        'nccl/nccl_node000_85167.log': 'a0733b86e46bcf3b5ee47c30f7fcd33f2efd05618910d47b32022f956ae46ad9',
        'nccl/nccl_node000_85180.log': 'd4381fffb0e18e4636f20651a8033abb73f66a00fdb33d540595d5c88ad402a7',
        'nccl/nccl_node000_85193.log': 'b1eec6f2ef09a4956dd4afc497f0cc12ef753e130d5817e82b8c82661db913c8',
        'nccl/nccl_node000_85206.log': 'af722a2160c4827eb4a9f00df4d6d8da197e921a95a03d2db08ef30b27f72239',
        'nccl/nccl_node001_85685.log': '09a84c7e17e614c125cb6377c5cd9b52feb2f91bb62c60fddc53dbd5d5b5cdd6',
        'nccl/nccl_node001_85698.log': '2387a5630930a87488bf42c5cd32fb6046ab10f897fcac1fd2f6ee5617333d30',
        'nccl/nccl_node001_85711.log': '274ee54e0d7f6955fd4862cfa6c09c62874a0b6781f58b3cc368d3d60033d8ca',
        'nccl/nccl_node001_85724.log': '95e4ab2bae3c6d7553928f18fbd5b5de1f0cf6ab59a36c562b8e91b786693f98',
        'nsys/node000.sqlite': '83f69dd0c98871f8225b4ac1eb007881b45a0224186629f3711b70a7aeabc2fe',
        'nsys/node001.sqlite': '61bf1d7e15aab46832f93759417f1a024dc4a4cd4e7bb3a9583b6f93150aeb33',
        'run.yaml': 'a020cff8473d32669c402c1297878d75ea5f5c466133b54368f9745534b0fc7f',
    },
    'plain': {
        'ground_truth/clock.parquet': '119ee97c988abd7a564c619c4717e521f3a761cc7ff412e73df31b80f22b2ead',
        'ground_truth/communicators.parquet': '77ff66d2f51928b8c66f3090290549c9affefd5dcd376ef7f4ac9c1f4917a15c',
        'ground_truth/kernels.parquet': 'd10d1acf816a24fb28dc81a216d4f633ebb5fea1b29fa27508007700d32b0800',
        'ground_truth/ops.parquet': '989307d5a31d6e5cc01070345cb2d1b61533b3998f4ea7b3fd09a79676e1f6cf',
        'nccl/nccl_node000_85167.log': '3cf04abf57e984996b1cefc67f8fc165377487abb2e5832b53b37a7581ad20f2',
        'nccl/nccl_node000_85180.log': '3ea44caee19069843cc8fd3760e95a9f66879db2a8ea9ed62f6a3f8370584970',
        'nccl/nccl_node001_85685.log': '2ec90f99f7698a71d7387c323f8d9a0aa83d2eb7e2dd3d5ba0efbd77938fd688',
        'nccl/nccl_node001_85698.log': '5fe9fd4814600d40e4d3583450b749b7b81f6a8b93799e19161c32358a8d5830',
        'nsys/node000.sqlite': '124f111740bbd4261e732fa1117f712a5e4a521733d678e7a33732e554293b81',
        'nsys/node001.sqlite': '10a134f6c0b495a9e6c9e98c8fb17e491cd8055f47cc1b37e037d004c2a61c6d',
        'run.yaml': 'e3d83cee284ee97f04c726e97abbbd534849486c0cc244ad71976dd33e028e67',
    },
}  # fmt: skip


def _sqlite_digest(path: Path) -> str:
    h = hashlib.sha256()
    con = sqlite3.connect(path)
    try:
        for name, sql in con.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' ORDER BY name"):
            h.update(f"T {name} {sql}\n".encode())
            for row in con.execute(f'SELECT * FROM "{name}" ORDER BY rowid'):
                h.update((repr(row) + "\n").encode())
    finally:
        con.close()
    return h.hexdigest()


def _parquet_digest(path: Path) -> str:
    t = pq.read_table(path)
    schema = [(f.name, str(f.type)) for f in t.schema]
    return hashlib.sha256((repr(schema) + repr(t.to_pydict())).encode()).hexdigest()


def output_digests(out: Path) -> dict[str, str]:
    """Digest of every file under ``out`` (see the module docstring)."""
    digests = {}
    for p in sorted(out.rglob("*")):
        if not p.is_file():
            continue
        rel = str(p.relative_to(out))
        if p.suffix == ".sqlite":
            digests[rel] = _sqlite_digest(p)
        elif p.suffix == ".parquet":
            digests[rel] = _parquet_digest(p)
        elif p.name == "run.yaml":
            data = yaml.safe_load(p.read_text())
            data.pop("nccltrace_version", None)
            digests[rel] = hashlib.sha256(repr(data).encode()).hexdigest()
        else:
            digests[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return digests


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_emulator_output_is_unchanged(name, tmp_path):
    res = emulate_run(CONFIGS[name], tmp_path / name)
    assert output_digests(res.out_dir) == EXPECTED[name]


def test_bounded_caches_do_not_change_the_output(tmp_path, monkeypatch):
    """The emulator's caches hold pure functions of their keys: emptying them often (tiny bounds)
    gives the same output."""
    import nccltrace.emulator.run as run_mod
    import nccltrace.emulator.schedule as schedule_mod

    monkeypatch.setattr(run_mod, "_CACHE_MAX", 3)
    monkeypatch.setattr(schedule_mod, "_COLL_INSTANCES_MAX", 5)
    schedule_mod._COLL_INSTANCES.clear()
    for name in ("moe", "knobs"):
        res = emulate_run(CONFIGS[name], tmp_path / name)
        assert output_digests(res.out_dir) == EXPECTED[name]


if __name__ == "__main__":  # print the digests of the current emulator (to update EXPECTED)
    import pprint
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        pprint.pprint({n: output_digests(emulate_run(c, Path(d) / n).out_dir) for n, c in CONFIGS.items()},
                      width=120, sort_dicts=True)
