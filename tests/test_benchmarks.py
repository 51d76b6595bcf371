"""The benchmark command (benchmarks/run_benchmarks.py) runs every section in quick mode and
reports positive numeric figures. No timing thresholds: the figures are only checked to exist."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("parse", "nsys", "align", "clocksync", "ranks", "trace", "scaling", "e2e", "rerun")


@pytest.mark.slow
def test_quick_benchmarks_report_positive_figures_for_every_section(tmp_path):
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "run_benchmarks.py"), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "quick"
    machine = doc["machine"]
    assert machine["logical_cores"] >= 1 and machine["ram_gib"] > 0 and machine["python"] and machine["cpu_model"]
    assert set(SECTIONS) <= set(doc["sections"])
    for name in SECTIONS:
        sec = doc["sections"][name]
        assert sec["error"] is None, (name, sec["error"])
        assert sec["figures"], f"section {name} reported no figures"
        for f in sec["figures"]:
            v = f["value"]
            assert isinstance(v, (int, float)) and not isinstance(v, bool), (name, f)
            assert math.isfinite(v) and v > 0, (name, f)
        assert any(f["show"] for f in sec["figures"]) and f"| {name} " in proc.stdout  # a row in the table
    figures = {(s, f["case"], f["figure"]): f["value"] for s, d in doc["sections"].items() for f in d["figures"]}
    # the figures the brief asks for are present
    assert any(s == "parse" and "grep" in c for s, c, _ in figures)
    assert any(s == "parse" and fig == "lines/s per core" for s, _, fig in figures)
    assert any(s == "nsys" and c.startswith("nvtx()") for s, c, _ in figures)
    assert any(s == "trace" and fig == "gzip size" for s, _, fig in figures)
    assert figures[("e2e", "bench-quick", "jobs")] > 1
    assert any(s == "e2e" and ": rule " in c and fig == "max RSS" for s, c, fig in figures)
    # scale: what each run-level stage costs per op, and the per-rank jobs' start-up share
    assert any(s == "stages" and fig == "metrics peak RSS per op" for s, _, fig in figures)
    assert any(s == "e2e" and fig == "start-up share of its CPU" for s, _, fig in figures)
    # every run-level stage's peak at two rank counts (same shape, same work per rank)
    for stage in ("ops", "metrics", "volume", "trace", "report"):
        assert {c for s, c, fig in figures if s == "scaling" and fig == f"{stage} peak RSS"} == {"4 ranks", "8 ranks"}
    # rerun: on e2e's finished campaign, each quick module changed and dry-run with and without
    # Snakemake's records; the dry runs left results/ as it was; the traced re-run saw who calls what
    assert figures[("rerun", "bench-quick", "modules changed, one at a time")] == 3
    assert figures[("rerun", "bench-quick", "dry runs")] == 2 + 2 * 3
    assert figures[("rerun", "bench-quick", "modules whose change re-runs jobs (no records)")] == 2  # not tables_doc.py
    assert figures[("rerun", "bench-quick", "(module, stage) pairs re-run where the stage calls it")] >= 1
    rerun = doc["sections"]["rerun"]
    assert not any(n.startswith("WARNING") for n in rerun["notes"]), rerun["notes"]
    assert [t["header"][0] for t in rerun["tables"]][:2] == ["module", "module"]
    assert "| core/spill.py " in proc.stdout  # a row of the per-module table
    # the e2e run worked in a scratch directory, not in the repository's results/
    assert not (REPO / "results" / "bench-quick").exists()
    assert "machine:" in proc.stdout and "| section" in proc.stdout


def test_engine_benchmark_compares_every_installed_engine_with_pandas(tmp_path):
    """benchmarks/bench_engines.py on a small analysed run: pandas always runs; DuckDB and Polars
    (not dependencies) either give the same tables or are reported as not run."""
    from emulated_runs import SMALL_MODEL

    from nccltrace.analyze import analyze_run
    from nccltrace.emulator.run import emulate_run

    emulate_run({**SMALL_MODEL, "name": "engines", "tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 2, "seed": 3},
                tmp_path / "raw")  # fmt: skip
    analyze_run(tmp_path / "raw", tmp_path / "out", progress=False, until="ops")
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_engines.py"), str(tmp_path / "out" / "ops" / "ops.parquet")]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| per_")]
    assert len(rows) == 6
    for query, engine, wall, peak, same in rows:
        assert engine == "pandas" or same.startswith("failed") or same.rstrip(" |") == "equal", (query, engine, same)
        if not same.startswith("failed"):
            assert float(wall) > 0 and float(peak.replace(",", "")) > 0
