"""Every path of one run's results, built in one place.

The workflow's rules, the stages and ``nccltrace analyze`` all name a run's files through
:class:`RunLayout`, so the layout is written once. Paths are plain joins, so a layout built on a
wildcard pattern (``RunLayout("results/c/{run}")``) gives the rules their output patterns. A
process is named after its log (``nccl_<host>_<pid>``, :func:`process_key`), and per-process
directories are grouped by node because the workflow parses and aligns one node per job. The
tree: ``docs/architecture.md``, Module notes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ALIGNMENT_FILE",
    "ALIGNMENT_QUALITY_FILE",
    "CALLS_FILE",
    "CALL_SOURCES_FILE",
    "COMMS_FILE",
    "KERNELS_FILE",
    "LAUNCHES_FILE",
    "LOG_ORIGIN_FILE",
    "MANIFEST_FILE",
    "METRIC_TABLES",
    "NVTX_FILE",
    "PARSE_REPORT_FILE",
    "RUN_YAML_FILE",
    "SESSION_FILE",
    "SOURCE_RANK_FILE",
    "RunLayout",
    "process_key",
]  # fmt: skip

# The file names of a run's results, spelled once. The format readers write the parsed tables
# under these names, the stages and the command line read them through these names (or RunLayout).
MANIFEST_FILE = "manifest.json"
"""A stage's provenance record, in the directory it writes."""
RUN_YAML_FILE = "run.yaml"
"""A run's settings as acquired, in its raw directory."""
CALLS_FILE = "calls.parquet"
"""A parsed log's call lines (nccl.log_reader)."""
COMMS_FILE = "comms.parquet"
"""A parsed log's communicator init lines (nccl.log_reader)."""
PARSE_REPORT_FILE = "parse_report.json"
"""A parsed log's parse report (nccl.log_reader)."""
KERNELS_FILE = "kernels.parquet"
"""A parsed export's NCCL kernels (nsys.reader, kineto.reader)."""
SESSION_FILE = "session.json"
"""A parsed export's session record: host, time base, availability (nsys.reader, parse_nsys)."""
COMM_RECORDS_FILE = "comm_records.parquet"
"""A parsed kernel source's call records (a profiler trace's record_param_comms ops)."""
NVTX_FILE = "nvtx.parquet"
"""A parsed export's NVTX ranges (NCCL payloads for the exact alignment)."""
LAUNCHES_FILE = "launches_without_kernel.parquet"
"""A parsed export's kernel launches whose kernel is not in the export."""
ALIGNMENT_FILE = "alignment.parquet"
"""A process's alignment table."""

METRIC_TABLES = ("op_metrics", "instances", "stragglers", "limits", "algorithms")
"""The tables of the metrics stage, in the order it writes them."""
ALIGNMENT_QUALITY_FILE = "alignment_quality.json"
"""A process's alignment-quality record, beside its alignment table."""
CALL_SOURCES_FILE = "call_sources.parquet"
"""Beside the parsed tables of a process without an NCCL log: per call, which source gave each
fact (``inputs.call_records.CALL_SOURCE_SCHEMA``)."""
SOURCE_RANK_FILE = "source_rank.json"
"""Beside the parsed tables of a process without an NCCL log: its global rank and what recorded
it (``rank``, ``rank_source``: the profiler's distributedInfo or a Flight Recorder dump)."""
LOG_ORIGIN_FILE = "log_origin.json"
"""Beside a process's parsed tables, when log discovery made its log: ``launcher``, the global
rank its launcher prefix named in a combined stdout (:func:`nccltrace.inputs.logs.launcher_ranks`),
and ``own_file``, the source file holding this process's lines and no other's (whose name may
carry the rank: :class:`nccltrace.inputs.logs.RankNamePattern`). Written by the parse stage,
read by the communicators stage."""


def process_key(log_stem: str) -> tuple[str, int]:
    """(host, pid) of a per-process log named ``nccl_<host>_<pid>`` (``NCCL_DEBUG_FILE=nccl_%h_%p.log``)."""
    body = log_stem.removeprefix("nccl_")
    host, _, pid = body.rpartition("_")
    if not host or not pid.isdigit():
        raise ValueError(f"log name {log_stem!r} is not nccl_<host>_<pid>; name per-process logs with "
                         "NCCL_DEBUG_FILE=<dir>/nccl_%h_%p.log")
    return host, int(pid)


def process_name(host: str, pid: int) -> str:
    """The name of process (``host``, ``pid``) in a run's layout: ``nccl_<host>_<pid>`` (the
    inverse of :func:`process_key`)."""
    return f"nccl_{host}_{int(pid)}"


def _host_or_none(name: str) -> str | None:
    try:
        return process_key(name)[0]
    except ValueError:
        return None


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

    def raw_exports(self, host: str) -> list[Path]:
        """Every nsys export of a node as acquired: its node export (``nsys/<host>.sqlite``) and
        its per-process exports (``nsys/<host>/*.sqlite``, e.g. ``trace_%q{SLURM_PROCID}``)."""
        node = self.raw_export(host)
        return ([node] if node.is_file() else []) + sorted(self._p("raw", "nsys", host).glob("*.sqlite"))

    def raw_export_hosts(self) -> list[str]:
        """Nodes with at least one nsys export in ``raw/nsys/``."""
        nsys = self._p("raw", "nsys")
        return sorted({p.stem for p in nsys.glob("*.sqlite")} |
                      {d.name for d in nsys.iterdir() if d.is_dir() and any(d.glob("*.sqlite"))}
                      if nsys.is_dir() else set())

    @property
    def run_yaml(self) -> Path:
        return self._p("raw", RUN_YAML_FILE)

    @staticmethod
    def host_of(proc: str) -> str:
        """The node of process ``proc`` (``nccl_<host>_<pid>``)."""
        return process_key(proc)[0]

    def parsed_nccl_table(self, proc: str, table: str) -> Path:
        return self.parsed_nccl(proc) / f"{table}.parquet"

    def parsed_nsys_table(self, host: str, table: str) -> Path:
        return self._p("parsed", "nsys", host, f"{table}.parquet")

    def parse_report(self, proc: str) -> Path:
        return self.parsed_nccl(proc) / PARSE_REPORT_FILE

    def session(self, host: str) -> Path:
        return self._p("parsed", "nsys", host, SESSION_FILE)

    def alignment(self, proc: str) -> Path:
        return self.aligned(proc) / ALIGNMENT_FILE

    def alignment_quality(self, proc: str) -> Path:
        return self.aligned(proc) / ALIGNMENT_QUALITY_FILE

    def log(self, stage: str, unit: str | None = None) -> Path:
        """A workflow job's log: ``logs/<stage>.log`` or, per node, ``logs/<stage>/<unit>.log``."""
        return self._p("logs", stage, f"{unit}.log") if unit else self._p("logs", f"{stage}.log")

    def benchmark(self, stage: str, unit: str | None = None) -> Path:
        """A workflow job's benchmark record (same naming as :meth:`log`)."""
        return self._p("benchmarks", stage, f"{unit}.tsv") if unit else self._p("benchmarks", f"{stage}.tsv")

    def parsed_nccl_node(self, host: str) -> Path:
        """The parsed logs of node ``host``'s processes (one directory each): the output of its parse job."""
        return self._p("parsed", "nccl", host)

    def parsed_nccl(self, proc: str) -> Path:
        """Process ``proc``'s parsed log tables, parse report and manifest."""
        return self.parsed_nccl_node(self.host_of(proc)) / proc

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

    def aligned_node(self, host: str) -> Path:
        """The alignments of node ``host``'s processes (one directory each): the output of its align job."""
        return self._p("aligned", host)

    def aligned(self, proc: str) -> Path:
        return self.aligned_node(self.host_of(proc)) / proc

    def find_processes(self) -> list[str]:
        """The processes whose parsed logs are on disk, sorted: for readers given a run directory
        without its list of processes (the workflow and ``analyze`` pass theirs)."""
        base = self._p("parsed", "nccl")
        found = (d for d in base.glob("*/nccl_*") if d.is_dir()) if base.is_dir() else ()
        return sorted(d.name for d in found if _host_or_none(d.name) == d.parent.name)

    def find_hosts(self) -> list[str]:
        """The nodes whose parsed exports are on disk, sorted (see :meth:`find_processes`)."""
        base = self._p("parsed", "nsys")
        return sorted(d.name for d in base.iterdir() if d.is_dir()) if base.is_dir() else []

    @property
    def raw_flight_recorder(self) -> Path:
        """Flight Recorder dumps a workflow import put in the raw directory."""
        return self._p("raw", "flight_recorder")

    @property
    def staged_flight_recorder(self) -> Path:
        """Flight Recorder dumps ``nccltrace analyze`` found by content in its input directory."""
        return self._p("inputs", "flight_recorder")

    @property
    def staged_kernels(self) -> Path:
        """Profiler traces read once into their tables (``inputs/kernels/<trace>/``), for every stage."""
        return self._p("inputs", "kernels")

    @property
    def source_processes(self) -> Path:
        """The processes of a run without NCCL logs and their sources (``stages.sources``)."""
        return self._p("inputs", "processes.json")

    def record_alignment(self, proc: str) -> Path:
        """A log-less process's alignment as its records gave it, kept in its parse output until
        the workflow's align_node job installs it in :meth:`aligned` (``stages.sources``)."""
        return self.parsed_nccl(proc) / "record_alignment"

    @property
    def flight_recorder(self) -> Path:
        """The dumps the ops stage names process groups from: the raw directory's, else the staged."""
        return self.raw_flight_recorder if self.raw_flight_recorder.is_dir() else self.staged_flight_recorder

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
        return Path(stage_dir) / MANIFEST_FILE

    def stage_manifests(self, procs: Iterable[str], hosts: Iterable[str]) -> list[Path]:
        """The manifest of every stage up to the trace, for processes ``procs`` and nodes
        ``hosts``: what a run's report shows (each stage's provenance and partial reasons).
        With neither, the run-level stages' manifests only."""
        procs, hosts = list(procs), list(hosts)
        dirs = [*(self.parsed_nccl(p) for p in procs), *(self.parsed_nsys(h) for h in hosts),
                self.parse_summary.parent, self.communicators_dir, *(self.aligned(p) for p in procs),
                self.ops_dir, self.metrics_dir, self.volume_dir, self.trace_dir]  # fmt: skip
        return [self.manifest(d) for d in dirs]
