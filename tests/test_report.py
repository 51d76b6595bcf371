"""HTML reports of an emulated run and of a campaign: self-contained, flags partial runs and
missing inputs prominently, lists missing configurations with the reason, and renders in a real
headless browser (screenshot non-blank at the requested size, expected headings in the DOM)."""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from nccltrace.cli import main
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.outputs.plots import campaign_plots, iteration_window, run_plots
from nccltrace.outputs.report import render_campaign_report, render_run_report
from nccltrace.outputs.summary import campaign_tables, run_tables, write_tables

# PP=2 x DP=2 over two nodes, 4 iterations: P2P, collectives, single-rank communicators, a clock
# per node and a few kernels missing from the export, so every report section has something.
RUN = {
    "model": "tiny", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
    "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 8, "iterations": 4, "nodes": 2,
    "gpus_per_node": 2, "tp": 1, "pp": 2, "precision": "bf16", "seed": 7,
    "imperfections": {"fuse_grouped_p2p": True, "single_rank_comm_ops": -1, "drop_kernels": 0.02},
}  # fmt: skip
RUN_HEADINGS = ["At a glance", "Configuration", "Alignment quality", "Operation counts", "Communication volume",
                "Per-rank volume", "Message sizes", "Timeline and trace", "Bandwidth", "Volume validation",
                "Definitions and units", "Provenance"]  # fmt: skip
SHOT = (1280, 2400)


class _Page(HTMLParser):
    """Headings, images, links and external resources of an HTML document."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: dict[str, list[str]] = {"h1": [], "h2": [], "h3": []}
        self.images: list[str] = []
        self.links: list[str] = []
        self.external: list[str] = []
        self._open: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in self.headings:
            self._open, self._text = tag, []
        if tag == "img":
            self.images.append(a.get("src", ""))
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag in ("script", "iframe", "link", "video", "audio", "source", "embed", "object"):
            self.external.append(f"<{tag} {a}>")

    def handle_data(self, data):
        if self._open:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == self._open:
            self.headings[tag].append(" ".join("".join(self._text).split()))
            self._open = None


def parse(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    return page


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def chromium() -> str:
    """A headless-capable Chromium; installed with apt-get when missing (CI runs as root).

    Fails (never skips) when it cannot be provided: the screenshot test must run."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe:
        return exe
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.fail("chromium is not installed and cannot be installed here (needs apt-get as root); "
                    "install the Debian package 'chromium' to run the report screenshot test")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=1800)
        if r.returncode != 0:
            pytest.fail(f"installing chromium failed at {' '.join(cmd)}:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("apt-get installed 'chromium' but no chromium executable is on PATH")
    return exe


def _browser(exe: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp / "profile"
    profile.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--no-default-browser-check", "--disable-extensions", "--disable-background-networking", "--disable-sync",
           f"--user-data-dir={profile}", *args]  # fmt: skip
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"chromium failed ({r.returncode}): {r.stderr[-2000:]}"
    return r


def _fake_metrics(ops: pd.DataFrame) -> pd.DataFrame:
    """Per-op metrics in the metrics table's layout (key file, line), with plausible values."""
    calls = ops[(ops["row_kind"] == "call") & (ops["status"] == "matched")].reset_index(drop=True)
    dur = (calls["kernel_end"] - calls["kernel_start"]).astype("float64").clip(lower=1.0)
    algbw = calls["message_bytes"].astype("float64") / dur
    return pd.DataFrame({
        "file": calls["file"], "line": calls["line"], "duration_ns": dur, "algbw_gbps": algbw, "busbw_gbps": algbw,
        "wait_ns": dur * 0.1, "transfer_ns": dur * 0.9, "transfer_busbw_gbps": algbw / 0.9, "limit_gbps": 80.0,
        "limit_link": "NVL 80.0 GB/s between two GPUs", "efficiency": algbw / 80.0, "algorithm": "RING",
        "protocol": "LL",
    })  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """An emulated, analysed run with summary tables, figures, a trace file and its report."""
    base = tmp_path_factory.mktemp("campaign") / "run_pp2"
    emulate_run(RUN, base / "raw")
    assert main(["analyze", str(base / "raw"), "-o", str(base), "-q", "--until", "ops"]) == 0
    ops = read_table(base / "ops" / "ops.parquet")
    metrics = _fake_metrics(ops)
    (base / "metrics").mkdir()
    metrics.to_parquet(base / "metrics" / "op_metrics.parquet")
    volume = pd.DataFrame({"parallelism": ["pp", "pp"], "role": ["first", "last"], "definition": ["payload"] * 2,
                           "theory_bytes": [1.0e6, 1.0e6], "observed_bytes": [1.2e6, 0.9e6], "ratio": [1.2, 0.9],
                           "dominant_discrepancy": ["embedding AllReduce on the first and last stage", "none"]})
    (base / "trace").mkdir()
    with gzip.open(base / "trace" / "trace.json.gz", "wt") as fh:
        json.dump({"traceEvents": []}, fh)
    tables = run_tables(ops, metrics, volume)
    write_tables(tables, base / "tables")
    run_plots(ops, tables, base / "plots", title=base.name)
    render_run_report(base, base / "report" / "report.html", tables_dir=base / "tables", plots_dir=base / "plots")
    return base


@pytest.fixture(scope="module")
def run_html(run_dir) -> str:
    return (run_dir / "report" / "report.html").read_text()


# --------------------------------------------------------------------------- run report


def test_run_report_is_one_self_contained_file(run_dir, run_html):
    page = parse(run_html)
    assert not page.external, f"external resources: {page.external}"
    assert len(page.images) == 6  # every run figure, metrics included
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r"url\(\s*['\"]?(?!data:)", run_html), "stylesheet loads an external resource"
    # links out of the file are relative and resolve from the report's directory
    out_links = [h for h in page.links if not h.startswith(("#", "https://"))]
    assert "../trace/trace.json.gz" in out_links
    for href in out_links:
        assert not href.startswith("/") and (run_dir / "report" / href).exists(), href


def test_run_report_states_config_alignment_and_counts(run_dir, run_html):
    page = parse(run_html)
    assert page.headings["h1"] == [f"NCCL communication report: {run_dir.name}"]
    assert [h for h in page.headings["h2"] if h in RUN_HEADINGS] == RUN_HEADINGS
    assert "Complete" in page.headings["h2"]
    ov = read_table(run_dir / "tables" / "overview.parquet").iloc[0]
    assert f">{int(ov['calls']):,}<" in run_html and f">{int(ov['kernels']):,}<" in run_html
    # alignment reasons and the configuration the run used
    for reason in ("single_rank_communicator", "kernel_record_missing"):
        assert reason in run_html
    assert re.search(r"<th>pp</th><td>2</td>", run_html) and re.search(r"<th>iterations</th><td>4</td>", run_html)
    assert "ui.perfetto.dev" in run_html and "Open trace file" in run_html
    assert "embedding AllReduce on the first and last stage" in run_html  # volume validation rendered
    assert "1.20\u00d7" in run_html  # its ratio, formatted
    assert "duplicate log lines" in run_html and "single-rank communicators" in run_html
    manifest = json.loads((run_dir / "ops" / "manifest.json").read_text())
    assert manifest["config_hash"] in run_html and manifest["code"]["source_sha256"][:16] in run_html


def test_partial_run_is_flagged_before_any_number(run_dir, tmp_path):
    partial = tmp_path / "run"
    shutil.copytree(run_dir / "raw", partial / "raw", ignore=shutil.ignore_patterns("*.sqlite", "*.log"))
    (partial / "ops").mkdir()
    manifest = json.loads((run_dir / "ops" / "manifest.json").read_text())
    manifest.update(partial=True, problems=["clock of node001: no shared instances"])
    (partial / "ops" / "manifest.json").write_text(json.dumps(manifest))
    html = render_run_report(partial, tmp_path / "r.html", tables_dir=run_dir / "tables",
                             plots_dir=run_dir / "plots").read_text()  # fmt: skip
    assert "PARTIAL RESULTS" in html and "clock of node001: no shared instances" in html
    assert html.index("PARTIAL RESULTS") < html.index('id="glance"')
    assert "Complete</h2>" not in html


def test_missing_optional_inputs_are_named(run_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(run_dir / "ops", bare / "ops")
    tables = {k: v for k, v in run_tables(read_table(bare / "ops" / "ops.parquet")).items()}
    write_tables(tables, bare / "tables")
    html = render_run_report(bare, bare / "report.html", tables_dir=bare / "tables",
                             plots_dir=bare / "no-plots").read_text()  # fmt: skip
    assert "No per-op metrics" in html and "No volume validation" in html and "No trace file" in html
    assert "raw/run.yaml) was not found" in html
    assert "Figure not available (op_counts)" in html


def test_timeline_window_is_one_iteration_of_the_emulated_run(run_dir):
    a, b, how = iteration_window(read_table(run_dir / "ops" / "ops.parquet"))
    truth = read_table(run_dir / "raw" / "ground_truth" / "kernels.parquet")
    # steady state: iteration 0 carries the warm-up, so the period is taken between iterations 1..n-1
    steady = truth[(truth["rank"] == 0) & truth["iteration"].between(1, RUN["iterations"] - 1)]
    period = float(steady.groupby("iteration")["start"].min().sort_index().diff().median())
    assert "iteration" in how and (b - a) == pytest.approx(period, rel=0.1)


# --------------------------------------------------------------------------- campaign report


@pytest.fixture(scope="module")
def campaign_html(run_dir) -> tuple[Path, str]:
    root = run_dir.parent
    other = root / "run_pp2_copy"  # a second configuration: the same run under another id
    shutil.copytree(run_dir / "ops", other / "ops")
    per_run = {
        run_dir.name: {p.stem: read_table(p) for p in (run_dir / "tables").glob("*.parquet")},  # as written
        other.name: run_tables(read_table(other / "ops" / "ops.parquet")),
    }
    settings = {run_dir.name: RUN, other.name: RUN, "run_failed": dict(RUN, pp=1),
                "run_never_ran": dict(RUN, tp=2, pp=1)}  # fmt: skip
    camp = campaign_tables(per_run, settings)
    cdir = root / "campaign"
    write_tables(camp, cdir / "tables")
    campaign_plots(camp, cdir / "plots")
    out = render_campaign_report(cdir, cdir / "report.html", runs={run_dir.name: run_dir, other.name: other},
                                 missing={"run_failed": "acquisition failed: the job hit its time limit"},
                                 tables_dir=cdir / "tables", plots_dir=cdir / "plots")  # fmt: skip
    return out, out.read_text()


def test_campaign_report_lists_every_configuration_and_why_runs_are_missing(run_dir, campaign_html):
    out, html = campaign_html
    page = parse(html)
    assert not page.external
    assert page.headings["h1"] == [f"NCCL communication campaign report: {run_dir.parent.name}"]
    assert "2 configuration(s) missing, failed or partial" in page.headings["h2"]
    status = html[html.index('id="status-table"'):]
    status = status[:status.index("</table>")]
    for run in (run_dir.name, "run_pp2_copy", "run_failed", "run_never_ran"):
        assert f"<td>{run}</td>" in status
    assert "acquisition failed: the job hit its time limit" in status
    assert "no summary tables for this run" in status  # run_never_ran: no reason given, still listed
    report_links = [h for h in page.links if h.endswith("report.html")]
    assert report_links == ["../run_pp2/report/report.html"] and (out.parent / report_links[0]).exists()
    assert len(page.images) == 1 and page.images[0].startswith("data:image/png;base64,")
    # side by side: the settings that differ are columns, the common ones stated once
    assert "Settings that differ between configurations" in page.headings["h3"]
    assert "<code>hidden_size" not in html and "<code>iterations=4</code>" in html


# --------------------------------------------------------------------------- in a real browser


def test_run_report_renders_in_a_headless_browser(chromium, run_dir, tmp_path):
    html = run_dir / "report" / "report.html"
    shot = tmp_path / "shot.png"
    _browser(chromium, tmp_path, f"--screenshot={shot}", f"--window-size={SHOT[0]},{SHOT[1]}", html.as_uri())
    img = Image.open(shot)
    assert img.size == SHOT
    px = np.asarray(img.convert("RGB"), dtype=np.int32)
    grey = px.mean(axis=2)
    assert grey.std() > 20, "screenshot is (nearly) uniform"
    assert (grey < 200).mean() > 0.03, "screenshot has almost no dark pixels: text or figures missing"
    colours = len(np.unique(px.reshape(-1, 3) // 8, axis=0))
    assert colours > 100, f"only {colours} colours: the figures did not render"
    # the green 'Complete' banner near the top (background #e8f5ec)
    top = px[:400]
    assert (np.abs(top - np.array([0xE8, 0xF5, 0xEC])).sum(axis=2) < 12).mean() > 0.01
    dom = _browser(chromium, tmp_path, "--dump-dom", html.as_uri()).stdout
    page = parse(dom)
    assert page.headings["h1"] == [f"NCCL communication report: {run_dir.name}"]
    assert [h for h in page.headings["h2"] if h in RUN_HEADINGS] == RUN_HEADINGS
    assert len(page.images) == 6


def test_campaign_report_renders_in_a_headless_browser(chromium, campaign_html, tmp_path):
    out, _ = campaign_html
    shot = tmp_path / "campaign.png"
    _browser(chromium, tmp_path, f"--screenshot={shot}", "--window-size=1280,1600", out.as_uri())
    img = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert img.shape == (1600, 1280) and img.std() > 20
    page = parse(_browser(chromium, tmp_path, "--dump-dom", out.as_uri()).stdout)
    for heading in ("Configurations", "Comparison", "Headline numbers", "Operation counts", "Communication volume",
                    "Bandwidth", "Volume validation", "Provenance"):
        assert heading in page.headings["h2"]
