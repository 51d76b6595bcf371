"""Global ranks of an emulated Megatron job whose process groups are created lazily and whose
default group runs no NCCL collective (emulator: init_style 'plain', default_group_nccl false):
no communicator spans every rank. Without another record the ranks are unknown and said so;
with the launcher's prefixes on a combined stdout they are known, and the labels, instances and
metrics follow as on an eager run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from nccltrace.cli import main
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run

LAZY = {
    "model": "tiny", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
    "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 8, "iterations": 2, "nodes": 2,
    "gpus_per_node": 4, "tp": 2, "pp": 2, "precision": "bf16", "seed": 3, "init_style": "plain",
    "default_group_nccl": False, "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1},
}  # fmt: skip


@pytest.fixture(scope="module")
def lazy_raw(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("lazy") / "raw"
    emulate_run(LAZY, raw)
    return raw


def _analysed_as_an_eager_run(out: Path) -> None:
    """What ranks make possible on a lazy job, as on an eager one: labels matched to the declared
    sizes' groups, the second node's clock fitted to the first by the cross-node instances, and
    every communicator's bandwidth limit."""
    labels = read_table(out / "ops" / "parallelism.parquet")
    assert (labels["label_source"].astype(str) == "megatron-groups").all()
    clock = read_table(out / "ops" / "clock_sync.parquet").set_index("clock_domain")
    assert clock.loc["node001", "status"] == "estimated" and clock.loc["node001", "n_instances"] > 0
    limits = read_table(out / "metrics" / "limits.parquet")
    assert len(limits) and limits["limit_gbps"].notna().all()


def _true_ranks(raw: Path) -> dict[int, int]:
    truth = read_table(raw / "ground_truth" / "ops.parquet")
    return dict(zip(truth["pid"].astype("int64"), truth["rank"].astype("int64")))


def test_the_emulated_lazy_job_initialises_no_communicator_of_every_rank(lazy_raw):
    sizes = set()
    for log in (lazy_raw / "nccl").glob("nccl_*.log"):
        sizes |= {int(x.split(" nranks ")[1].split()[0]) for x in log.read_text().splitlines()
                  if "ncclCommInitRank" in x and "Init COMPLETE" in x}
    assert sizes and max(sizes) < 8 and not any("ncclCommSplit" in log.read_text()
                                                 for log in (lazy_raw / "nccl").glob("nccl_*.log"))


@pytest.mark.slow
def test_without_a_record_of_the_ranks_they_are_unknown_said_once_and_the_run_partial(lazy_raw, tmp_path, capsys):
    assert main(["analyze", str(lazy_raw), "-o", str(tmp_path / "out"), "-q", "--until", "ops"]) == 0
    err = capsys.readouterr().err
    assert err.count("global ranks unknown for 8 of 8 processes") == 1 and "world size 2" not in err
    assert "at least 2 different assignments fit the declared sizes" in err  # tp, pp and dp pairs interchange
    assert read_table(tmp_path / "out" / "communicators" / "communicator_members.parquet")["global_rank"].isna().all()
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["partial"]
    # no rank is guessed, but what needs only to tell the processes apart still runs: the second
    # node's clock fitted by the cross-node instances, the cross-rank and P2P checks
    assert pd.read_parquet(tmp_path / "out" / "ops" / "ops.parquet")["global_rank"].isna().all()
    clock = read_table(tmp_path / "out" / "ops" / "clock_sync.parquet").set_index("clock_domain")
    assert clock.loc["node001", "status"] == "estimated" and clock.loc["node001", "n_instances"] > 0
    quality = read_table(tmp_path / "out" / "ops" / "alignment_quality.parquet")
    checked = quality.groupby("check")[["confirmed", "contradicted"]].sum()
    assert checked.loc["cross_rank", "confirmed"] > 0 and checked.loc["p2p_pairing", "confirmed"] > 0
    assert checked.loc[["cross_rank", "p2p_pairing"], "contradicted"].sum() == 0


@pytest.mark.slow
def test_with_the_launchers_prefixes_the_lazy_job_is_analysed_as_an_eager_one(lazy_raw, tmp_path):
    """One `srun --label` stdout of the eight logs: every rank right, the labels those of the
    declared sizes matched by member set, every collective's instances complete, the clock fit
    and the bandwidth limits as on an eager run."""
    run = tmp_path / "run"
    (run / "nsys").mkdir(parents=True)
    for export in (lazy_raw / "nsys").glob("*.sqlite"):
        (run / "nsys" / export.name).symlink_to(export)
    (run / "run.yaml").symlink_to(lazy_raw / "run.yaml")
    ranks = _true_ranks(lazy_raw)
    texts = {ranks[int(p.stem.rsplit("_", 1)[1])]: p.read_text().splitlines()
             for p in (lazy_raw / "nccl").glob("nccl_*.log")}
    lines = [f"{r}: {t[i]}" for i in range(max(map(len, texts.values()))) for r, t in sorted(texts.items())
             if i < len(t)]
    (run / "stdout.txt").write_text("\n".join(lines) + "\n")
    assert main(["analyze", str(run), "-o", str(tmp_path / "out"), "-q", "--until", "metrics"]) == 0
    members = read_table(tmp_path / "out" / "communicators" / "communicator_members.parquet")
    assert dict(zip(members["pid"].astype("int64"), members["global_rank"].astype("int64"))) == ranks
    _analysed_as_an_eager_run(tmp_path / "out")
    ops = pd.read_parquet(tmp_path / "out" / "ops" / "ops.parquet")
    calls = ops[(ops["row_kind"] == "call") & (ops["nranks"] > 1)]
    collectives = calls[~calls["op"].isin(["Send", "Recv"])]  # point-to-point calls pair, not instance
    assert len(collectives) and collectives["instance"].notna().all() and calls["global_rank"].notna().all()


def test_the_communicators_command_says_the_world_size_and_ranks_are_unknown(lazy_raw, tmp_path, capsys):
    """`nccltrace communicators` on the lazy job's parsed logs: not the size of its largest
    communicator (4: the model-parallel group) as the world size, but unknown, with the reason."""
    dirs = []
    for log in sorted((lazy_raw / "nccl").glob("nccl_*.log")):
        assert main(["parse-nccl", str(log), "-o", str(tmp_path / log.stem)]) == 0
        dirs.append(str(tmp_path / log.stem))
    capsys.readouterr()
    assert main(["communicators", *dirs, "-o", str(tmp_path / "comms")]) == 0
    out = capsys.readouterr()
    assert "world size unknown" in out.out and "global ranks unknown for 8 of 8 processes" in out.err
    assert not re.search(r"world size \d", out.out + out.err)


def _lazy_logs_by_rank(lazy_raw: Path, dest: Path, name: str) -> dict[int, int]:
    """The lazy job's logs under names that carry each process's global rank (``name`` with
    {rank}), its exports beside them; returns pid -> true rank."""
    ranks = _true_ranks(lazy_raw)
    for log in (lazy_raw / "nccl").glob("nccl_*.log"):
        target = dest / name.format(rank=ranks[int(log.stem.rsplit("_", 1)[1])])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(log.read_bytes())
    (dest / "nsys").mkdir()
    for export in (lazy_raw / "nsys").glob("*.sqlite"):
        (dest / "nsys" / export.name).symlink_to(export)
    return ranks


@pytest.mark.parametrize("pattern", ["rank{rank}/nccl.log", "rank*/nccl.log"])
def test_an_import_whose_log_names_carry_the_rank_names_every_rank_and_the_world_size(lazy_raw, tmp_path, pattern):
    """The workflow's path for a campaign entry `backend: import` with `rank_in_log_name`: the
    import keeps which file each process's lines came from, the parse stage records it, and the
    communicators stage reads the rank from the name: world size 8 and every rank right. A
    pattern without {rank} is refused with the reason, and the ranks stay unknown."""
    from nccltrace.acquisition.raw import import_raw
    from nccltrace.communicators.infer import (
        RANK_NAME_SETTING,
        communicator_problems,
        infer_run_communicators,
    )
    from nccltrace.stages.parse_nccl import run_parse_nccl

    ranks = _lazy_logs_by_rank(lazy_raw, tmp_path / "elsewhere", "rank{rank}/nccl.log")
    settings = {RANK_NAME_SETTING: pattern}
    import_raw(tmp_path / "elsewhere", tmp_path / "raw", run_id="lazy", settings=settings)
    dirs = []
    for log in sorted((tmp_path / "raw" / "nccl").glob("nccl_*.log")):
        run_parse_nccl(log, tmp_path / "parsed" / log.stem, settings)
        dirs.append(tmp_path / "parsed" / log.stem)
    result = infer_run_communicators(dirs, tmp_path / "comms", settings)
    members = read_table(tmp_path / "comms" / "communicator_members.parquet")
    if "{rank}" in pattern:
        assert dict(zip(members["pid"].astype("int64"), members["global_rank"].astype("int64"))) == ranks
        assert result.world_size == 8 and not communicator_problems(result)
        assert result.rank_sources == {"log file name": 8}
    else:
        assert result.world_size is None and members["global_rank"].isna().all()
        assert any("needs exactly one {rank}" in p for p in communicator_problems(result))


@pytest.mark.slow
def test_a_lazy_job_whose_structure_decides_is_analysed_with_the_true_ranks_from_it_alone(tmp_path, capsys):
    """TP4·DP2 on two nodes, lazy groups, no default-group NCCL, nothing else beside the logs:
    the four-rank tensor groups and the data-parallel pairs fit one assignment under the
    declared sizes (run.yaml). Every rank right, the world size 8, the labels those of the
    declared sizes, the note names the source and its assumption, and the clock fit and the
    bandwidth limits work as on an eager run."""
    raw = tmp_path / "raw"
    emulate_run({**LAZY, "tp": 4, "pp": 1}, raw)
    assert main(["analyze", str(raw), "-o", str(tmp_path / "out"), "-q", "--until", "metrics"]) == 0
    err = capsys.readouterr().err
    members = read_table(tmp_path / "out" / "communicators" / "communicator_members.parquet")
    assert dict(zip(members["pid"].astype("int64"), members["global_rank"].astype("int64"))) == _true_ranks(raw)
    assert "global ranks of 8 process(es) from the communicators' structure: one assignment fits" in err
    assert "assumes a Megatron-LM job" in err and "global ranks unknown" not in err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["config"]["world_size"] == 8 and not manifest["partial"]
    _analysed_as_an_eager_run(tmp_path / "out")


def _parsed_lazy_job(tmp_path: Path, tp: int) -> tuple[Path, list[str]]:
    """A one-iteration lazy job of tensor size ``tp`` (pp 1) and its logs parsed one by one."""
    raw = tmp_path / "raw"
    emulate_run({**LAZY, "tp": tp, "pp": 1, "iterations": 1}, raw)
    dirs = []
    for log in sorted((raw / "nccl").glob("nccl_*.log")):
        assert main(["parse-nccl", str(log), "-o", str(tmp_path / log.stem)]) == 0
        dirs.append(str(tmp_path / log.stem))
    return raw, dirs


def test_the_communicators_command_solves_the_structure_against_the_sizes_it_is_given(tmp_path, capsys):
    """`nccltrace communicators --tp 4` on a lazy TP4·DP2 job's parsed logs: the structure
    decides, so the world size is 8; without the sizes both tp4·dp2 and tp2·dp4 fit and it is
    unknown."""
    raw, dirs = _parsed_lazy_job(tmp_path, tp=4)
    capsys.readouterr()
    assert main(["communicators", *dirs, "-o", str(tmp_path / "with"), "--tp", "4"]) == 0
    assert "world size 8" in capsys.readouterr().out
    members = read_table(tmp_path / "with" / "communicator_members.parquet")
    assert dict(zip(members["pid"].astype("int64"), members["global_rank"].astype("int64"))) == _true_ranks(raw)
    assert main(["communicators", *dirs, "-o", str(tmp_path / "without")]) == 0
    out = capsys.readouterr()
    assert "world size unknown" in out.out and "at least 2 different assignments fit every Megatron layout" in out.err


def test_wrong_declared_sizes_that_the_structure_fits_name_no_rank(tmp_path, capsys):
    """A lazy TP2·DP4 job declared as TP4: its data-parallel quads and tensor pairs also fit
    tp4·dp2, under one assignment, a wrong one. It gives each node ranks that are not
    consecutive (as no block placement does), so nothing is named, and the note says to check
    the sizes. Declared right (--tp 2), the same logs give the true ranks."""
    raw, dirs = _parsed_lazy_job(tmp_path, tp=2)
    capsys.readouterr()
    assert main(["communicators", *dirs, "-o", str(tmp_path / "wrong"), "--tp", "4"]) == 0
    out = capsys.readouterr()
    assert "world size unknown" in out.out and "ranks that are not consecutive" in out.err
    assert read_table(tmp_path / "wrong" / "communicator_members.parquet")["global_rank"].isna().all()
    assert main(["communicators", *dirs, "-o", str(tmp_path / "right"), "--tp", "2"]) == 0
    assert "world size 8" in capsys.readouterr().out
    members = read_table(tmp_path / "right" / "communicator_members.parquet")
    assert dict(zip(members["pid"].astype("int64"), members["global_rank"].astype("int64"))) == _true_ranks(raw)


def test_a_pattern_that_matches_local_ranks_names_each_rank_twice_and_is_reported_not_used(lazy_raw, tmp_path):
    """torchrun's per-node log directories carry the local rank: with `rank{rank}/nccl.log`
    given as if it were global, every number is claimed by one process on each node. Every such
    claim is dropped and reported; the ranks stay unknown."""
    from nccltrace.acquisition.raw import import_raw
    from nccltrace.communicators.infer import (
        RANK_NAME_SETTING,
        communicator_problems,
        infer_run_communicators,
    )
    from nccltrace.stages.parse_nccl import run_parse_nccl

    ranks = _true_ranks(lazy_raw)
    src = tmp_path / "elsewhere"
    for log in (lazy_raw / "nccl").glob("nccl_*.log"):
        r = ranks[int(log.stem.rsplit("_", 1)[1])]
        target = src / f"node{r // 4}" / f"rank{r % 4}" / "nccl.log"
        target.parent.mkdir(parents=True)
        target.write_bytes(log.read_bytes())
    (src / "nsys").mkdir()
    for export in (lazy_raw / "nsys").glob("*.sqlite"):
        (src / "nsys" / export.name).symlink_to(export)
    settings = {RANK_NAME_SETTING: "rank{rank}/nccl.log"}
    import_raw(src, tmp_path / "raw", run_id="lazy", settings=settings)
    dirs = []
    for log in sorted((tmp_path / "raw" / "nccl").glob("nccl_*.log")):
        run_parse_nccl(log, tmp_path / "parsed" / log.stem, settings)
        dirs.append(tmp_path / "parsed" / log.stem)
    result = infer_run_communicators(dirs, tmp_path / "comms", settings)
    problems = communicator_problems(result)
    assert sum("named for 2 processes" in p for p in problems) == 4
    assert "global ranks unknown for 8 of 8 processes" in problems[0] and result.world_size is None
