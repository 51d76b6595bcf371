"""The Snakemake workflow end to end on a small emulated campaign (real Snakemake, local cores)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from parquet_checks import assert_every_table_opens
from snakemake_jobs import scheduled_jobs

from nccltrace.core.layout import RunLayout
from nccltrace.core.tables import read_table

REPO = Path(__file__).resolve().parents[1]

SMALL = {
    "campaign": "small",
    "defaults": {"backend": "emulate", "micro_batch_size": 1, "global_batch_size": 4, "iterations": 2,
                 "nccl_version": "2.24.3", "nsys_version": "2026.4", "seed": 3},
    "models": {"tiny": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128,
                        "vocab_size": 1024, "precision": "bf16"}},
    "hardware": {"T": {"gpu": "T4", "nodes": 2, "gpus_per_node": 2, "preset": "a40"}},
    "matrix": [{"models": ["tiny"], "hardware": ["T"], "parallelism": [{"tp": 2}, {"pp": 2}]}],
}


def _snakemake(workdir: Path, *args: str, snakefile: Path = REPO / "Snakefile") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), "--directory", str(workdir),
           "--configfile", str(workdir / "config.yaml"), "--cores", "2", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)


def _repo_copy(repo: Path) -> Path:
    """A copy of the workflow and the package, for a test that edits the code."""
    import shutil

    repo.mkdir()
    for part in ("Snakefile", "workflow", "src", "config", "envs"):
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, repo / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, repo / part)
    return repo


# one run of 2 nodes x 4 GPUs (TP=4, DP=2): 8 processes, 4 per node
EIGHT = {**SMALL, "campaign": "eight",
         "hardware": {"T": {"gpu": "T4", "nodes": 2, "gpus_per_node": 4, "preset": "a40"}},
         "matrix": [{"models": ["tiny"], "hardware": ["T"], "parallelism": [{"tp": 4}]}]}  # fmt: skip
EIGHT_RUN = "tiny_T4_n2_tp4_pp1_ep1_cp1_vpp1_sp0_dp2"


def _analyze_gives_the_workflows_tables(run_dir: Path, out: Path) -> None:
    """`nccltrace analyze` on the run's raw directory writes the same tables as the workflow:
    one implementation of each stage, two front ends."""
    import pandas as pd

    from nccltrace.cli import main
    from nccltrace.core.layout import METRIC_TABLES, RunLayout

    assert main(["analyze", str(run_dir / "raw"), "-o", str(out), "-q"]) == 0
    wf, cli = RunLayout(run_dir), RunLayout(out)
    pairs = [(wf.ops, cli.ops), (wf.quality, cli.quality), (wf.labels, cli.labels), (wf.volume, cli.volume),
             *((wf.metric(n), cli.metric(n)) for n in METRIC_TABLES),
             *((p, cli.report_tables / p.name) for p in sorted(wf.report_tables.glob("*.parquet")))]
    for a, b in pairs:
        x, y = read_table(a), read_table(b)
        assert list(x.columns) == list(y.columns), a.name
        pd.testing.assert_frame_equal(x.reset_index(drop=True), y.reset_index(drop=True), check_dtype=False,
                                      obj=a.name)
    assert cli.report_html.is_file() and cli.trace.is_file()


@pytest.mark.slow
def test_workflow_emulates_and_parses_every_run_then_has_nothing_to_do(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(SMALL))
    first = _snakemake(tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    entries = sorted(p.name for p in (tmp_path / "results" / "small").iterdir())
    runs = ["tiny_T4_n2_tp1_pp2_ep1_cp1_vpp1_sp0_dp2", "tiny_T4_n2_tp2_pp1_ep1_cp1_vpp1_sp0_dp2"]
    assert entries == ["campaign", *runs]
    campaign_html = (tmp_path / "results" / "small" / "campaign" / "report.html").read_text()
    assert all(run in campaign_html for run in runs)
    for run in runs:
        base = tmp_path / "results" / "small" / run
        # what users look at: metrics, volume validation, trace, tables, plots and report
        for out in ("metrics/op_metrics.parquet", "volume/volume_validation.csv", "trace/trace.json.gz",
                    "report/report.html", "report/tables/op_counts.csv", "report/plots/timeline.png"):
            assert (base / out).is_file(), out
            assert json.loads((base / out.split("/")[0] / "manifest.json").read_text())["outputs"]
        summary = json.loads((base / "parsed" / "parse_summary.json").read_text())
        truth = read_table(base / "raw" / "ground_truth" / "ops.parquet")
        assert summary["processes"] == 4 and summary["nodes"] == 2 and not summary["partial"]
        # Every logged op of the emulated run is recovered by the parser.
        assert summary["totals"]["call"] == len(truth)
        # one parse and one align job per node, each process's manifests inside its node's directory
        layout = RunLayout(base)
        procs = layout.find_processes()
        assert len(procs) == 4 and layout.find_hosts() == ["node000", "node001"]
        for proc in procs:
            manifest = json.loads(layout.manifest(layout.parsed_nccl(proc)).read_text())
            assert manifest["stage"] == "parse_nccl" and manifest["inputs"]
            assert json.loads(layout.manifest(layout.aligned(proc)).read_text())["stage"] == "align"
        assert sorted(p.name for p in (base / "logs" / "parse_node").iterdir()) == ["node000.log", "node001.log"]
        assert sorted(p.name for p in (base / "benchmarks" / "align_node").iterdir()) == ["node000.tsv", "node001.tsv"]
        assert (base / "raw" / "manifest.json").exists()
        comms = read_table(base / "communicators" / "communicators.parquet")
        assert len(comms) > 0 and comms.complete.all()
        assert (base / "logs" / "acquire.log").exists() and (base / "benchmarks" / "acquire.tsv").exists()
    # every table of every run and of the campaign opens as documented (raw inputs: they open)
    assert_every_table_opens(tmp_path / "results" / "small", undocumented=("raw",))
    again = _snakemake(tmp_path, "-n")
    assert again.returncode == 0 and scheduled_jobs(again.stdout + again.stderr) == {}
    _analyze_gives_the_workflows_tables(tmp_path / "results" / "small" / runs[1], tmp_path / "analyzed")
    # A rank's log goes missing: the run's summary says so and is flagged partial.
    base = tmp_path / "results" / "small" / runs[0]
    victim = sorted((base / "raw" / "nccl").glob("nccl_*.log"))[1]
    victim.unlink()
    third = _snakemake(tmp_path)
    assert third.returncode == 0, third.stderr[-4000:]
    summary = json.loads((base / "parsed" / "parse_summary.json").read_text())
    assert summary["partial"] and summary["processes"] == 3 and summary["expected_processes"] == 4
    assert any("1 of 4 rank logs are missing" in i["message"] for i in summary["issues"])
    # the node of the missing log still has that process's kernels: named, with the pid
    victim_pid = victim.stem.rsplit("_", 1)[1]
    assert any(f"pid(s) {victim_pid} have no NCCL log" in i["message"] for i in summary["issues"])
    manifest = json.loads((base / "parsed" / "manifest.json").read_text())
    # 3 parse reports and their manifests, 2 sessions, and the kernels table that showed the orphan pid
    assert manifest["partial"] and manifest["config_hash"] and len(manifest["inputs"]) == 3 * 2 + 2 + 1


def _rule_graph(dot: str) -> dict[str, set[str]]:
    """Rule -> the rules whose jobs read its outputs, from ``snakemake --rulegraph``."""
    names = dict(re.findall(r'^\s*(\d+)\[label = "(\w+)"', dot, re.MULTILINE))
    feeds: dict[str, set[str]] = {name: set() for name in names.values()}
    for a, b in re.findall(r"^\s*(\d+) -> (\d+)", dot, re.MULTILINE):
        feeds[names[a]].add(names[b])
    assert feeds, dot[-2000:]
    return feeds


def _downstream(feeds: dict[str, set[str]], rules: set[str]) -> set[str]:
    seen, todo = set(rules), list(rules)
    while todo:
        for nxt in feeds.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


class FinishedExample:
    """The example campaign, done, in a copy of the workflow and package (the tests edit its code),
    with what its run left kept aside: the code stamps and Snakemake's records of the jobs (copied
    with their times), the rule graph (rule -> the rules reading its outputs) and ``every``: what a
    dry run schedules once every stamp is out of date and the records are lost (every analysis job
    of the campaign; the first run's own table is printed before its checkpoints have said how many
    nodes each run has)."""

    def __init__(self, root: Path) -> None:
        import shutil

        self.repo = _repo_copy(root / "repo")
        self.work = root / "work"
        self.work.mkdir()
        shutil.copy2(REPO / "config" / "config.yaml", self.work / "config.yaml")
        self.saved = root
        self.pkg = self.repo / "src" / "nccltrace"
        self.stamps = self.work / "results" / ".code" / "example"
        self.records = self.work / ".snakemake" / "metadata"
        self._sources: dict[str, str] = {}
        first = self.snakemake()
        assert first.returncode == 0, first.stderr[-4000:]
        graph = self.snakemake("--rulegraph")
        assert graph.returncode == 0, graph.stderr[-3000:]
        self.feeds = _rule_graph(graph.stdout)
        shutil.copytree(self.stamps, root / "stamps")  # copy2: the stamps keep their times
        shutil.copytree(self.records, root / "records")
        for stamp in self.stamps.glob("*.stamp"):
            stamp.write_text("0\n")
        shutil.rmtree(self.records)
        self.every = self.dry_run()
        runs = len(list((self.work / "results" / "example").glob("*/raw")))
        assert "acquire" not in self.every and self.every["ops"] == runs and self.every["parse_node"] >= runs, self.every
        assert self.every["code_stamp"] == len(self.stamped_stages()), self.every

    def snakemake(self, *args: str) -> subprocess.CompletedProcess:
        return _snakemake(self.work, *args, snakefile=self.repo / "Snakefile")

    def dry_run(self, *args: str) -> dict[str, int]:
        dry = self.snakemake("-n", *args)
        assert dry.returncode == 0, dry.stderr[-3000:]
        return scheduled_jobs(dry.stdout + dry.stderr)

    def edit(self, module: str, added: str) -> None:
        """Adds ``added`` to a module of the package copy (``reset`` takes it back)."""
        path = self.pkg / module
        self._sources.setdefault(module, path.read_text())
        path.write_text(self._sources[module] + added)

    def revert(self, module: str) -> None:
        (self.pkg / module).write_text(self._sources[module])

    def reset(self, with_records: bool) -> None:
        """The campaign as its run left it: the package's code, the stamps, and the records or none."""
        import shutil

        for module in self._sources:
            self.revert(module)
        shutil.rmtree(self.stamps)
        shutil.copytree(self.saved / "stamps", self.stamps)
        shutil.rmtree(self.records, ignore_errors=True)
        if with_records:
            shutil.copytree(self.saved / "records", self.records)

    def stamped_stages(self) -> set[str]:
        """The workflow's rules that have a code stamp: the stages of code_stamps.STAGE_ENTRIES that are rules."""
        from nccltrace.campaign.code_stamps import STAGE_ENTRIES

        return {s for s in STAGE_ENTRIES if s in self.feeds}

    def expected(self, module: str) -> dict[str, int]:
        """What a change to ``module`` schedules: the stamps of the stages whose import closure holds
        it, every job of those stages and of every rule downstream of them, for every run."""
        from nccltrace.campaign.code_stamps import STAGE_ENTRIES, import_closure

        stages = {s for s in self.stamped_stages() if module in import_closure(STAGE_ENTRIES[s])}
        assert stages, module
        jobs = {rule: self.every[rule] for rule in _downstream(self.feeds, stages)}
        assert "acquire" not in jobs
        return {"code_stamp": len(stages), **jobs}


@pytest.fixture(scope="module")
def finished_example(tmp_path_factory) -> FinishedExample:
    return FinishedExample(tmp_path_factory.mktemp("example"))


@pytest.mark.slow
@pytest.mark.xdist_group("test_workflow.finished_example")  # the two tests of the finished campaign, apart
def test_a_code_change_schedules_exactly_its_stages_and_their_dependents_with_or_without_snakemakes_records(
        finished_example):
    """The example campaign, done. Then, from that state each time, with Snakemake's records of
    the jobs intact and removed (as a head killed before recording them, or results copied from
    another machine, leave them): no change and a comment schedule nothing; a change to
    nccl/versions.py schedules the stamps of the stages whose import closure holds it and every
    job of those stages and of every rule downstream of them, for every run, and no acquisition;
    a change to outputs/perfetto.py the same for its stages. Counted from Snakemake's job table; the expected
    rules come from the stages' import closures and the workflow's own rule graph."""
    example = finished_example
    for with_records in (True, False):
        example.reset(with_records)
        assert example.dry_run() == {}, with_records
        if not with_records:  # with them, the code hash (a rule parameter) would say the same
            example.edit("nccl/versions.py", "\n# a comment changes nothing a module does\n")
            assert example.dry_run() == {}
        for module in ("nccl/versions.py", "outputs/perfetto.py"):
            example.reset(with_records)
            example.edit(module, "\n_TOUCHED = 1\n")
            assert example.dry_run() == example.expected(module), (module, with_records)


def _files(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file and folder under ``root``: (modification time ns, size, SHA-256 of a file's bytes)."""
    import hashlib

    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        out[str(p.relative_to(root))] = (st.st_mtime_ns, st.st_size if p.is_file() else 0, digest)
    return out


def _changed(before: dict, after: dict) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


@pytest.mark.slow
@pytest.mark.xdist_group("test_workflow.finished_example")
def test_a_dry_run_changes_nothing_and_a_reverted_change_re_runs_nothing(finished_example):
    """As a user would, on the finished example campaign, nothing restored between the steps:
    nccl/versions.py changed, --summary, --list-changes code/input/params, --lint and --dag
    (Snakemake's records at hand), then, the records lost, a dry run: what the change re-runs;
    the change reverted, a dry run: nothing; outputs/perfetto.py changed, a dry run: trace's stamp and the
    jobs of trace and of what follows it, nothing else. None of it changes a file of the
    campaign's results or its code stamps, byte or time (the stamps used to be rewritten as the
    workflow was read: the revert then left them out of date and everything was scheduled)."""
    import shutil

    example = finished_example
    example.reset(with_records=True)
    results = example.work / "results"
    before = _files(results)
    assert any(k.startswith(".code/example/") for k in before)
    example.edit("nccl/versions.py", "\n_TOUCHED = 1\n")
    for args in (["--summary"], ["--list-changes", "code"], ["--list-changes", "input"],
                 ["--list-changes", "params"], ["--lint"], ["--dag"]):  # fmt: skip
        done = example.snakemake(*args)
        assert done.returncode == 0, (args, done.stderr[-3000:])
        assert _changed(before, _files(results)) == [], args
    shutil.rmtree(example.records)
    assert example.dry_run() == example.expected("nccl/versions.py")
    example.revert("nccl/versions.py")
    assert example.dry_run() == {}
    example.edit("outputs/perfetto.py", "\n_TOUCHED = 1\n")
    assert example.dry_run() == example.expected("outputs/perfetto.py")
    assert set(example.expected("outputs/perfetto.py")) == {"code_stamp", "trace", "report", "campaign_report", "all"}
    assert _changed(before, _files(results)) == []


@pytest.mark.slow
def test_a_run_is_parsed_and_aligned_in_one_job_per_node_not_per_process(tmp_path):
    """The per-run job graph grows with the nodes: once the run is acquired, a dry run of 8
    processes on 2 nodes shows one parse and one align job per node and one job of each
    run-level stage, never a job per process."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(EIGHT))
    raw = tmp_path / "results" / "eight" / EIGHT_RUN / "raw"
    acquired = _snakemake(tmp_path, str(raw.relative_to(tmp_path)))
    assert acquired.returncode == 0, acquired.stderr[-4000:]
    assert len(list((raw / "nccl").glob("nccl_*.log"))) == 8 and len(list((raw / "nsys").glob("*.sqlite"))) == 2
    dry = _snakemake(tmp_path, "-n")
    assert dry.returncode == 0, dry.stderr[-4000:]
    stats = scheduled_jobs(dry.stdout + dry.stderr)
    assert stats.get("parse_node") == 2 and stats.get("align_node") == 2, stats
    assert not {"parse_nccl", "parse_nsys", "align"} & set(stats), stats
    per_run = {rule: n for rule, n in stats.items() if rule not in ("parse_node", "align_node", "code_stamp")}
    assert per_run and set(per_run.values()) == {1}, stats  # parse_summary, communicators, ops, ..., all
    # a node job runs its processes one after another: it asks for the larger peak, not the sum
    from nccltrace.campaign.job_resources import mem_mb

    asked = dict(re.findall(r"rule parse_node:.*?host=(\w+).*?mem_mb=(\d+)", dry.stdout + dry.stderr, re.DOTALL))
    assert sorted(asked) == ["node000", "node001"], (dry.stdout + dry.stderr)[-3000:]
    for host, mb in asked.items():
        assert int(mb) == max(mem_mb("parse_nccl"), mem_mb("parse_nsys", (raw / "nsys" / f"{host}.sqlite").stat().st_size))


@pytest.mark.slow
def test_a_process_whose_stage_raises_fails_its_node_job_by_name_after_the_others(tmp_path):
    """A stage that raises for one process (a bug, not a damaged log: those are partial) fails
    the node's job with a message naming the process, after the node's other processes were
    done; Snakemake removes the node job's output directory, and the other node completes."""
    repo = _repo_copy(tmp_path / "repo")
    (tmp_path / "work").mkdir()
    work = tmp_path / "work"
    (work / "config.yaml").write_text(yaml.safe_dump(EIGHT))
    raw = work / "results" / "eight" / EIGHT_RUN / "raw"
    assert _snakemake(work, str(raw.relative_to(work)), snakefile=repo / "Snakefile").returncode == 0
    victim = sorted(p.stem for p in (raw / "nccl").glob("nccl_node001_*.log"))[1]
    stage = repo / "src" / "nccltrace" / "stages" / "parse_nccl.py"
    stage.write_text(stage.read_text() + f"""

_run_parse_nccl = run_parse_nccl


def run_parse_nccl(log_file, out_dir, settings=None):  # a bug that strikes one process
    if Path(log_file).stem == {victim!r}:
        raise KeyError("injected")
    return _run_parse_nccl(log_file, out_dir, settings)
""")
    layout = RunLayout(raw.parent)
    target = layout.parse_summary.relative_to(work)
    failed = _snakemake(work, "--keep-going", str(target), snakefile=repo / "Snakefile")
    assert failed.returncode != 0
    # said on the console and in the node job's log, with the process's name
    assert f"FAILED: parse_node of node node001: {victim}: KeyError: 'injected'" in failed.stderr
    log = (raw.parent / "logs" / "parse_node" / "node001.log").read_text()
    assert f"parse_node of node node001: 1 of 5 failed ({victim}: KeyError: 'injected')" in log
    assert "Traceback" in log and "The other 4 were done" in log
    # the node's other processes were parsed before the job failed (their lines are in its log) ...
    others = [p for p in sorted(p.stem for p in (raw / "nccl").glob("nccl_node001_*.log")) if p != victim]
    assert all(f"{p}: {{" in log for p in others), log[-3000:]
    # ... but a failed job's outputs are removed: nothing half-done stays behind; the other node is complete
    assert not layout.parsed_nccl_node("node001").exists() and not layout.parsed_nsys("node001").exists()
    assert len([p for p in layout.find_processes() if layout.host_of(p) == "node000"]) == 4
    assert (layout.parsed_nsys("node000") / "manifest.json").is_file()
