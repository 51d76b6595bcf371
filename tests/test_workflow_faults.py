"""Damaged and missing inputs through the real workflow (backend ``import``, real Snakemake).

One campaign holds one run per fault; each fault's import directory is an emulated run with that
defect. The per-node export faults (missing, garbage, truncated) share one four-node run, one
node each, as a cluster would break; the run with leftovers of an interrupted export beside good
ones is the complete control. Snakemake runs once (module fixture, about 4 minutes on 2 cores)
and every run must end either as a recorded failure with the reason (a run that cannot be
analysed at all) or as a result marked partial from the parse summary to the campaign report,
with messages that name the file, what is wrong and what to do; the other runs complete. The
import-level rules have fast tests of their own at the end.
"""

from __future__ import annotations

import html as htmllib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml
from snakemake_jobs import scheduled_jobs

from nccltrace.acquisition.raw import RawImportError, import_raw
from nccltrace.acquisition.status import read_status
from nccltrace.campaign.matrix import expand_campaign
from nccltrace.core.layout import RunLayout
from nccltrace.core.provenance import write_manifest
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run

REPO = Path(__file__).resolve().parents[1]
TINY = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128, "vocab_size": 1024,
        "precision": "bf16"}
DEFAULTS = {"micro_batch_size": 1, "global_batch_size": 4, "iterations": 2, "nccl_version": "2.24.3",
            "nsys_version": "2026.4", "seed": 3}
# one node of two GPUs (run-level faults), four nodes of one GPU (per-node export faults)
HARDWARE = {"one": {"gpu": "T4", "nodes": 1, "gpus_per_node": 2, "preset": "a40"},
            "four": {"gpu": "T4", "nodes": 4, "gpus_per_node": 1, "preset": "a40"}}
# stages downstream of both the logs and the exports (communicators depend on the logs only)
STAGES = ("parsed", "ops", "metrics", "volume", "trace", "report")


# --------------------------------------------------------------------------- fault injection


def _drop_rank_log(d: Path) -> None:
    sorted((d / "nccl").glob("nccl_*.log"))[1].unlink()


def _cut_rank_log(d: Path) -> None:
    """The job was killed while a rank wrote its log: it ends early, mid-line."""
    log = sorted((d / "nccl").glob("nccl_*.log"))[1]
    data = log.read_bytes()
    cut = data.rindex(b"\n", 0, int(len(data) * 0.7)) + 40
    log.write_bytes(data[:cut])


def _break_exports(d: Path) -> None:
    """node001's export is missing, node002's garbage, node003's cut half-way (an interrupted
    export or copy); node000's is good."""
    (d / "nsys" / "node001.sqlite").unlink()
    (d / "nsys" / "node002.sqlite").write_bytes(os.urandom(40_000))
    p = d / "nsys" / "node003.sqlite"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _leftovers(d: Path) -> None:
    """A good export, plus what interrupted attempts left beside it."""
    good = (d / "nsys" / "node000.sqlite").read_bytes()
    (d / "nsys" / "node000.sqlite.tmp").write_bytes(good[: len(good) // 3])
    (d / "nsys" / "node000-partial.sqlite").write_bytes(good[: len(good) // 3])


def _no_cuda_trace(d: Path) -> None:
    """nsys ran without --trace=cuda: no kernel or CUDA API table."""
    for p in (d / "nsys").glob("*.sqlite"):
        with sqlite3.connect(p) as c:
            c.execute("DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL")
            c.execute("DROP TABLE CUPTI_ACTIVITY_KIND_RUNTIME")
        with sqlite3.connect(p) as c:
            c.execute("VACUUM")


def _no_logs(d: Path) -> None:
    # no source at all: a run without logs but with its exports is imported (issue 34)
    shutil.rmtree(d / "nccl")
    shutil.rmtree(d / "nsys")


# model name (= run id prefix) -> (hardware, fault)
CASES = {
    "leftover": ("one", _leftovers),
    "norank": ("one", _drop_rank_log),
    "cutlog": ("one", _cut_rank_log),
    "nokernels": ("one", _no_cuda_trace),
    "nologs": ("one", _no_logs),
    "exports": ("four", _break_exports),
}
EXPORT_DEFECTS = {  # node -> what its parse job must say
    "node001": "no nsys export (node001.sqlite)",
    "node002": "not an SQLite database",
    "node003": "truncated: the SQLite header says",
}


def _emulated(hardware: dict, out: Path) -> Path:
    """An emulated run's raw data (logs, exports, run.yaml) as the acquire rule would make it."""
    cfg = {"campaign": "gen", "defaults": {"backend": "emulate", **DEFAULTS}, "models": {"tiny": TINY},
           "hardware": {"hw": hardware}, "matrix": [{"models": ["tiny"], "hardware": ["hw"]}]}
    (run,) = expand_campaign(cfg)
    emulate_run({k: v for k, v in run.settings.items() if k not in ("env", "megatron_args")}, out)
    shutil.rmtree(out / "ground_truth")
    return out


def _snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(workdir / "config.yaml"), "--cores", "2", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("faults")
    sources = {hw: _emulated(spec, work / "sources" / hw) for hw, spec in HARDWARE.items()}
    for name, (hw, fault) in CASES.items():
        shutil.copytree(sources[hw], work / "imports" / name)
        fault(work / "imports" / name)
    config = {
        "campaign": "faults",
        "defaults": {"backend": "import", **DEFAULTS},
        "models": {name: {**TINY, "import_dir": str(work / "imports" / name)} for name in CASES},
        "hardware": HARDWARE,
        "matrix": [{"models": [n for n, (h, _) in CASES.items() if h == hw], "hardware": [hw]} for hw in HARDWARE],
    }
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    runs = {r.settings["model"]: r.run_id for r in expand_campaign(config)}
    proc = _snakemake(work, "--keep-going")
    return {"work": work, "proc": proc, "runs": runs, "results": work / "results" / "faults"}


# --------------------------------------------------------------------------- helpers


def _run_dir(campaign: dict, case: str) -> Path:
    assert campaign["proc"].returncode == 0, campaign["proc"].stderr[-6000:]
    return campaign["results"] / campaign["runs"][case]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _banner(base: Path) -> str:
    """The status banner of a run report, as text."""
    page = (base / "report" / "report.html").read_text()
    m = re.search(r'<section class="banner[^"]*" id="status">(.*?)</section>', page, re.DOTALL)
    assert m, "run report has no status banner"
    return htmllib.unescape(re.sub(r"<[^>]+>", " ", m.group(1)))


def _campaign_row(campaign: dict, case: str) -> str:
    page = (campaign["results"] / "campaign" / "report.html").read_text()
    table = page[page.index('id="status-table"'):]
    row = re.search(rf"<tr><td>{re.escape(campaign['runs'][case])}</td>(.*?)</tr>", table, re.DOTALL)
    assert row, f"{case} is not in the campaign's status table"
    return htmllib.unescape(re.sub(r"<[^>]+>", " ", row.group(1)))


def _assert_partial_all_the_way(campaign: dict, case: str, cause: str) -> None:
    """Partial with ``cause`` among the reasons from the parse summary to the campaign report."""
    base = _run_dir(campaign, case)
    summary = _json(base / "parsed" / "parse_summary.json")
    assert summary["partial"], summary["issues"]
    assert any(cause in i["message"] for i in summary["issues"]), summary["issues"]
    for stage in STAGES:
        manifest = _json(base / stage / "manifest.json")
        assert manifest["partial"], f"{case}: {stage} manifest not marked partial"
        assert manifest["partial_reasons"], f"{case}: {stage} manifest partial without a reason"
    # the last stage still names the cause found at the first
    assert any(cause in r for r in _json(base / "report" / "manifest.json")["partial_reasons"])
    banner = _banner(base)
    assert "PARTIAL RESULTS" in banner and cause in banner, banner
    row = _campaign_row(campaign, case)
    assert " partial " in row, row


def _calls(base: Path, proc_glob: str):
    """Call rows of the alignments of the processes matching ``proc_glob``."""
    layout = RunLayout(base)
    tables = [read_table(layout.alignment(p)) for p in layout.find_processes() if fnmatch(p, proc_glob)]
    assert tables, proc_glob
    return [t[t["row_kind"] == "call"] for t in tables]


def _no_zero_bandwidth(base: Path, host: str | None = None) -> None:
    """Ranks without kernels have null durations and bandwidths, never 0."""
    m = read_table(base / "metrics" / "op_metrics.parquet")
    rows = m if host is None else m[m["host"] == host]
    assert len(rows)
    for col in ("duration_ns", "algbw_gbps", "busbw_gbps"):
        assert rows[col].isna().all(), f"{col} of ranks without kernels is not null"
    assert not (m["busbw_gbps"].dropna() == 0).any()


# --------------------------------------------------------------------------- the campaign


@pytest.mark.slow
def test_every_fault_ends_recorded_and_the_campaign_completes(campaign):
    proc = campaign["proc"]
    assert proc.returncode == 0, proc.stderr[-6000:]
    html = (campaign["results"] / "campaign" / "report.html").read_text()
    assert all(run in html for run in campaign["runs"].values())
    manifest = _json(campaign["results"] / "campaign" / "manifest.json")
    partial = {c for c, r in campaign["runs"].items() if r in manifest["partial_runs"]}
    assert partial == {"norank", "cutlog", "nokernels", "exports"}
    assert set(manifest["missing_runs"]) == {campaign["runs"]["nologs"]} and manifest["partial"]
    # said on the console too, not only in files
    for case in partial:
        assert f"PARTIAL: run {campaign['runs'][case]}" in proc.stderr, case
    assert f"FAILED: run {campaign['runs']['nologs']}: import failed" in proc.stderr
    # partial and failed runs are final: a second invocation has nothing to do
    again = _snakemake(campaign["work"], "-n")
    assert again.returncode == 0 and scheduled_jobs(again.stdout + again.stderr) == {}, again.stdout[-3000:]


@pytest.mark.slow
def test_leftovers_of_an_interrupted_export_are_set_aside_and_the_run_is_complete(campaign):
    base = _run_dir(campaign, "leftover")
    assert sorted(p.name for p in (base / "raw" / "nsys").iterdir()) == ["node000.sqlite"]
    summary = _json(base / "parsed" / "parse_summary.json")
    assert not summary["partial"]  # the good export was used: complete, and not silently so
    notes = " ".join(i["message"] for i in summary["issues"] if i["severity"] == "warning")
    assert "ignored nsys/node000.sqlite.tmp" in notes and "ignored unreadable export node000-partial.sqlite" in notes
    for stage in STAGES:
        manifest = _json(base / stage / "manifest.json")
        assert not manifest["partial"] and manifest["partial_reasons"] == [], stage
    for calls in _calls(base, "nccl_*"):
        assert (calls["status"] == "matched").all()
    banner = _banner(base)
    assert "Problems reported" in banner and "PARTIAL" not in banner and "node000-partial.sqlite" in banner
    assert _campaign_row(campaign, "leftover").split()[0] == "ok"


@pytest.mark.slow
def test_missing_rank_log_is_partial_and_names_the_node_and_rank(campaign):
    base = _run_dir(campaign, "norank")
    _assert_partial_all_the_way(campaign, "norank", "1 of 2 rank logs are missing (node node000 has 1 of 2")
    summary = _json(base / "parsed" / "parse_summary.json")
    assert summary["processes"] == 1 and summary["expected_processes"] == 2
    communicators = _json(base / "communicators" / "manifest.json")
    assert communicators["partial"]
    assert any("global rank(s) 1 of world size 2 left no NCCL log" in r for r in communicators["partial_reasons"])
    assert "NCCL_DEBUG_FILE" in _banner(base)  # what to do


@pytest.mark.slow
def test_rank_log_cut_mid_line_is_partial_and_names_the_file(campaign):
    base = _run_dir(campaign, "cutlog")
    victim = sorted((base / "raw" / "nccl").glob("nccl_*.log"))[1].name
    _assert_partial_all_the_way(campaign, "cutlog", f"{victim}: ends mid-line")
    assert "the process was killed while writing" in _banner(base)
    # the other rank's log is whole and its calls are all matched
    other, cut = _calls(base, "nccl_*")
    assert (other["status"] == "matched").all() and len(cut) < len(other)


@pytest.mark.slow
@pytest.mark.parametrize("host", sorted(EXPORT_DEFECTS))
def test_unusable_node_export_leaves_that_nodes_ranks_without_times(campaign, host):
    defect = EXPORT_DEFECTS[host]
    base = _run_dir(campaign, "exports")
    _assert_partial_all_the_way(campaign, "exports", defect)
    summary = _json(base / "parsed" / "parse_summary.json")
    errors = [i["message"] for i in summary["issues"] if i["severity"] == "error" and defect in i["message"]]
    assert errors and all(host in e and "nsys export --type sqlite" in e for e in errors), errors  # where, what to do
    session = _json(base / "parsed" / "nsys" / host / "session.json")
    assert session["available"] is False and defect in session["problem"]
    (good,) = _calls(base, "nccl_node000_*")
    (lost,) = _calls(base, f"nccl_{host}_*")
    assert (good["status"] == "matched").all()
    assert (lost["status"] == "unmatched").all() and set(lost["reason"]) == {"no_export"}
    ops = read_table(base / "ops" / "ops.parquet")
    assert ops.loc[ops["host"] == host, "kernel_start_sync"].isna().all()
    _no_zero_bandwidth(base, host)


@pytest.mark.slow
def test_zero_nccl_kernels_is_all_unmatched_and_flagged_not_zero_bandwidth(campaign):
    base = _run_dir(campaign, "nokernels")
    _assert_partial_all_the_way(campaign, "nokernels", "contains no NCCL kernels")
    assert "nsys did not trace CUDA" in _banner(base) and "--trace=cuda" in _banner(base)
    for calls in _calls(base, "nccl_*"):
        assert (calls["status"] == "unmatched").all()
    _no_zero_bandwidth(base)
    overview = read_table(base / "report" / "tables" / "overview.parquet").iloc[0]
    assert overview["matched_calls"] == 0 and overview["calls"] > 0  # the logs' counts stay valid


@pytest.mark.slow
def test_a_run_that_cannot_be_imported_is_recorded_failed_with_the_reason(campaign):
    base = _run_dir(campaign, "nologs")
    status = read_status(base / "raw")
    assert status["status"] == "failed" and status["stage"] == "import"
    assert "no NCCL debug log found" in status["reason"] and "delete" in status["reason"]
    assert not (base / "parsed").exists() and not (base / "report").exists()
    row = _campaign_row(campaign, "nologs")
    assert "missing" in row and "import failed: import_dir" in row and "NCCL_DEBUG=INFO" in row


# --------------------------------------------------------------------------- fast: import and provenance


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Path:
    hardware = {"gpu": "T4", "nodes": 2, "gpus_per_node": 1, "preset": "a40"}
    return _emulated(hardware, tmp_path_factory.mktemp("src") / "raw")


def _import(src: Path, tmp_path: Path) -> dict:
    settings = {"model": "tiny", **DEFAULTS, "import_dir": str(src)}
    return import_raw(src, tmp_path / "raw", run_id="r", settings=settings)


def test_import_keeps_an_unreadable_export_for_its_node_and_sets_leftovers_aside(two_nodes, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(two_nodes, src)
    good = (src / "nsys" / "node001.sqlite").read_bytes()
    (src / "nsys" / "node000.sqlite").write_bytes(b"garbage" * 1000)
    (src / "nsys" / "node001.sqlite-journal").write_bytes(b"")  # empty journal: a clean close
    (src / "nsys" / "node001.sqlite.a1b2c3d4").write_bytes(good[:5000])  # a copy tool's temp file
    (src / "nsys" / "node001 (copy).sqlite").write_bytes(good[:5000])
    record = _import(src, tmp_path)
    assert record["exports"] == ["node000", "node001"]
    raw = tmp_path / "raw"
    assert (raw / "nsys" / "node000.sqlite").read_bytes().startswith(b"garbage")  # kept: parse says why
    assert (raw / "nsys" / "node001.sqlite").read_bytes() == good
    notes = " ".join(read_status(raw)["warnings"])
    assert "node001.sqlite.a1b2c3d4" in notes and "node001.sqlite-journal" in notes
    assert "ignored unreadable export node001 (copy).sqlite (node node001 has the readable export" in notes


def test_import_treats_an_export_with_a_hot_journal_as_interrupted(two_nodes, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(two_nodes, src)
    (src / "nsys" / "node001.sqlite-journal").write_bytes(b"\xd9\xd5\x05\xf9\x20\xa1\x63\xd7" + bytes(500))
    record = _import(src, tmp_path)
    status = read_status(tmp_path / "raw")
    # no other export of node001: kept for the node and reported by its parse job, which sees no journal
    assert record["exports"] == ["node000", "node001"] and (tmp_path / "raw" / "nsys" / "node001.sqlite").is_file()
    assert "interrupted while writing" in status["unusable_exports"]["node001"]
    assert "ignored nsys/node001.sqlite-journal" in " ".join(status["warnings"])


def test_import_still_refuses_two_readable_exports_of_one_node(two_nodes, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(two_nodes, src)
    shutil.copy(src / "nsys" / "node001.sqlite", src / "nsys" / "node001-again.sqlite")
    with pytest.raises(RawImportError, match="both exports of host node001"):
        _import(src, tmp_path)


def test_partial_propagates_through_manifests_with_its_reasons(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "t.parquet").write_bytes(b"x")
    write_manifest(tmp_path / "a" / "manifest.json", stage="parse_nsys", inputs=[],
                   outputs=[tmp_path / "a" / "t.parquet"], partial=True, reasons=["node001.sqlite is truncated"])
    (tmp_path / "b" / "u.parquet").write_bytes(b"y")
    b = write_manifest(tmp_path / "b" / "manifest.json", stage="ops", inputs=[tmp_path / "a" / "t.parquet"],
                       outputs=[tmp_path / "b" / "u.parquet"], extra={"problems": ["clock of node001: x"]})
    assert b["partial"] and b["partial_reasons"] == ["node001.sqlite is truncated"]
    assert b["partial_inputs"] == ["../a/manifest.json"]
    c = write_manifest(tmp_path / "c.json", stage="report", inputs=[tmp_path / "b" / "u.parquet"], outputs=[],
                       partial=True, reasons=["own gap"])
    assert c["partial_reasons"] == ["node001.sqlite is truncated", "own gap"]  # the root cause first
    d = write_manifest(tmp_path / "d.json", stage="x", inputs=[tmp_path / "b" / "u.parquet"], outputs=[],
                       propagate=False)
    assert not d["partial"] and d["partial_reasons"] == []


def test_import_splits_one_combined_stdout_of_all_ranks_into_per_process_logs(two_nodes, tmp_path):
    # What `srun --label` leaves: every rank's lines in one file, prefixed, with application output between.
    src = tmp_path / "src"
    shutil.copytree(two_nodes, src)
    originals = {p.name: p.read_bytes().splitlines() for p in sorted((src / "nccl").glob("nccl_*.log"))}
    combined = []
    for rank, lines in enumerate(originals.values()):
        combined += [f"{rank}: ".encode() + line for line in lines] + [f"{rank}: iteration 1 loss 2.3".encode()]
    for p in (src / "nccl").glob("nccl_*.log"):
        p.unlink()
    (src / "nccl" / "slurm-4242.out").write_bytes(b"\n".join(combined) + b"\n")
    record = _import(src, tmp_path)
    raw = tmp_path / "raw"
    assert record["processes"] == len(originals)
    for name, lines in originals.items():
        got = (raw / "nccl" / name).read_bytes().splitlines()
        assert [g.split(b"NCCL", 1)[1] for g in got] == [x.split(b"NCCL", 1)[1] for x in lines if b"NCCL" in x], name
    status = read_status(raw)
    assert not status.get("problems") and any("found by content" in w for w in status["warnings"])
