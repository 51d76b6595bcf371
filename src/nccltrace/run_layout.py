"""Every path of one run's results, built in one place.

The workflow's rules, the stages and ``nccltrace analyze`` all name a run's files through
:class:`RunLayout`, so the layout is written once. Paths are plain joins, so a layout built on a
wildcard pattern (``RunLayout("results/c/{run}")``) gives the rules their output patterns::

    <run>/raw/                                  acquired inputs (nccl/<proc>.log, nsys/<host>.sqlite, run.yaml)
    <run>/parsed/nccl/<proc>/                   per-process log tables
    <run>/parsed/nsys/<host>/                   per-node export tables
    <run>/communicators/                        communicators.parquet, communicator_members.parquet
    <run>/aligned/<proc>/                       alignment.parquet, alignment_quality.json
    <run>/ops/                                  ops, parallelism, clock_sync, alignment_quality
    <run>/metrics/                              op_metrics, instances, stragglers, limits, algorithms
    <run>/volume/                               volume_validation (.parquet, .csv)
    <run>/trace/                                trace.json.gz, trace.summary.json.gz
    <run>/report/                               tables/, plots/, report.html
    <run>/logs/, <run>/benchmarks/              the workflow's job logs and benchmark records
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ALIGNMENT_QUALITY_FILE", "METRIC_TABLES", "RunLayout"]

METRIC_TABLES = ("op_metrics", "instances", "stragglers", "limits", "algorithms")
"""The tables of the metrics stage, in the order it writes them."""
ALIGNMENT_QUALITY_FILE = "alignment_quality.json"
"""A process's alignment-quality record, beside its alignment table."""


@dataclass(frozen=True)
class RunLayout:
    """The result paths of one run below ``root`` (see the module docstring)."""

    root: Path

    def __init__(self, root: Path | str) -> None:
        object.__setattr__(self, "root", Path(root))

    def _p(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    @classmethod
    def of_raw(cls, raw: Path | str) -> RunLayout:
        """The layout of the run whose raw directory is ``raw``."""
        return cls(Path(raw).parent)

    # inputs and per-process / per-node stages
    @property
    def raw(self) -> Path:
        return self._p("raw")

    def raw_log(self, proc: str) -> Path:
        """A process's NCCL log as acquired (``NCCL_DEBUG_FILE=nccl_%h_%p.log``)."""
        return self._p("raw", "nccl", f"{proc}.log")

    def raw_export(self, host: str) -> Path:
        """A node's nsys SQLite export as acquired."""
        return self._p("raw", "nsys", f"{host}.sqlite")

    @property
    def run_yaml(self) -> Path:
        return self._p("raw", "run.yaml")

    def parsed_nccl_table(self, proc: str, table: str) -> Path:
        return self._p("parsed", "nccl", proc, f"{table}.parquet")

    def parsed_nsys_table(self, host: str, table: str) -> Path:
        return self._p("parsed", "nsys", host, f"{table}.parquet")

    def parse_report(self, proc: str) -> Path:
        return self._p("parsed", "nccl", proc, "parse_report.json")

    def session(self, host: str) -> Path:
        return self._p("parsed", "nsys", host, "session.json")

    def alignment(self, proc: str) -> Path:
        return self._p("aligned", proc, "alignment.parquet")

    def alignment_quality(self, proc: str) -> Path:
        return self._p("aligned", proc, ALIGNMENT_QUALITY_FILE)

    def log(self, stage: str, unit: str | None = None) -> Path:
        """A workflow job's log: ``logs/<stage>.log`` or, per process/node, ``logs/<stage>/<unit>.log``."""
        return self._p("logs", stage, f"{unit}.log") if unit else self._p("logs", f"{stage}.log")

    def benchmark(self, stage: str, unit: str | None = None) -> Path:
        """A workflow job's benchmark record (same naming as :meth:`log`)."""
        return self._p("benchmarks", stage, f"{unit}.tsv") if unit else self._p("benchmarks", f"{stage}.tsv")

    def parsed_nccl(self, proc: str) -> Path:
        return self._p("parsed", "nccl", proc)

    def parsed_nsys(self, host: str) -> Path:
        return self._p("parsed", "nsys", host)

    @property
    def parse_summary(self) -> Path:
        return self._p("parsed", "parse_summary.json")

    @property
    def communicators_dir(self) -> Path:
        return self._p("communicators")

    @property
    def communicators(self) -> Path:
        return self._p("communicators", "communicators.parquet")

    @property
    def members(self) -> Path:
        return self._p("communicators", "communicator_members.parquet")

    def aligned(self, proc: str) -> Path:
        return self._p("aligned", proc)

    # run-level stages
    @property
    def ops_dir(self) -> Path:
        return self._p("ops")

    @property
    def ops(self) -> Path:
        return self._p("ops", "ops.parquet")

    @property
    def labels(self) -> Path:
        return self._p("ops", "parallelism.parquet")

    @property
    def clock(self) -> Path:
        return self._p("ops", "clock_sync.parquet")

    @property
    def quality(self) -> Path:
        return self._p("ops", "alignment_quality.parquet")

    @property
    def metrics_dir(self) -> Path:
        return self._p("metrics")

    def metric(self, name: str) -> Path:
        """One metrics table (``METRIC_TABLES``)."""
        if name not in METRIC_TABLES:
            raise KeyError(f"no metrics table {name!r}; one of {', '.join(METRIC_TABLES)}")
        return self._p("metrics", f"{name}.parquet")

    @property
    def volume_dir(self) -> Path:
        return self._p("volume")

    @property
    def volume(self) -> Path:
        return self._p("volume", "volume_validation.parquet")

    @property
    def volume_csv(self) -> Path:
        return self._p("volume", "volume_validation.csv")

    @property
    def trace_dir(self) -> Path:
        return self._p("trace")

    @property
    def trace(self) -> Path:
        return self._p("trace", "trace.json.gz")

    @property
    def trace_summary(self) -> Path:
        return self._p("trace", "trace.summary.json.gz")

    @property
    def report_dir(self) -> Path:
        return self._p("report")

    @property
    def report_tables(self) -> Path:
        return self._p("report", "tables")

    @property
    def report_plots(self) -> Path:
        return self._p("report", "plots")

    @property
    def report_html(self) -> Path:
        return self._p("report", "report.html")

    def manifest(self, stage_dir: Path) -> Path:
        """The manifest of the stage writing ``stage_dir``."""
        return Path(stage_dir) / "manifest.json"

    def stage_manifests(self, procs: Iterable[str], hosts: Iterable[str]) -> list[Path]:
        """The manifest of every stage up to the trace, for processes ``procs`` and nodes
        ``hosts``: what a run's report shows (each stage's provenance and partial reasons)."""
        procs, hosts = list(procs), list(hosts)
        dirs = [*(self.parsed_nccl(p) for p in procs), *(self.parsed_nsys(h) for h in hosts),
                self.parse_summary.parent, self.communicators_dir, *(self.aligned(p) for p in procs),
                self.ops_dir, self.metrics_dir, self.volume_dir, self.trace_dir]  # fmt: skip
        return [self.manifest(d) for d in dirs]
