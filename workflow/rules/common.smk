# Shared helpers: campaign expansion (validated above), paths, input functions.
import json
import sys
from pathlib import Path

from snakemake.exceptions import IncompleteCheckpointException

from nccltrace.campaign.matrix import expand_campaign, validate_runs
from nccltrace.campaign.job_resources import mem_mb, parquet_rows
from nccltrace.metrics.compute import part_calls
from nccltrace.campaign.code_stamps import code_stamp_is_current, code_stamp_path, stage_code_hash
from nccltrace.core.layout import METRIC_TABLES, RunLayout
from nccltrace.stages.sources import has_logs, kernel_sources_of, raw_sources, read_source_processes

RUNS = {run.run_id: run for run in expand_campaign(config)}
# Every run is checked before anything is queued (divisibility, experts, VPP, batch sizes, ...).
validate_runs(list(RUNS.values()))
RUN_IDS = sorted(RUNS)
RESULTS = f"results/{config['campaign']}"
CODE_STAMPS = f"results/.code/{config['campaign']}"
# Every path of a run's results comes from RunLayout: RUN (built on the {run} wildcard) gives
# the rules' output patterns, run_layout(wc) one run's paths in input functions.
RUN = RunLayout(f"{RESULTS}/{{run}}")


def run_layout(wildcards):
    return RunLayout(f"{RESULTS}/{wildcards.run}")


wildcard_constraints:
    run="[A-Za-z0-9_.-]+",
    host="[A-Za-z0-9_.-]+",


def run_settings(wildcards):
    """Resolved settings of a run (emulator/launch parameters)."""
    return RUNS[wildcards.run].settings


def analysis_settings(wildcards):
    """A run's settings with the parallel sizes the campaign launches it with made explicit (for
    the stages that label communicators by them)."""
    return RUNS[wildcards.run].analysis_settings


def hardware_of(wildcards):
    return RUNS[wildcards.run].hardware


def _hw(key, default=""):
    return lambda wc: hardware_of(wc).get(key) or default


def _gres(wc):
    hw = hardware_of(wc)
    kind = f"{hw['gpu_gres_type']}:" if hw.get("gpu_gres_type") else ""
    return f"gpu:{kind}{int(hw['gpus_per_node'])}"


def _sbatch_extra(wc):
    hw = hardware_of(wc)
    extra = ["--ntasks-per-node=1"]  # one torchrun per node
    if hw.get("qos"):
        extra.append(f"--qos={hw['qos']}")
    if hw.get("constraint"):
        extra.append(f"--constraint={hw['constraint']}")
    if hw.get("slurm_extra"):
        extra.append(hw["slurm_extra"])
    return " ".join(extra)


def train_resources():
    """The training job's SLURM resources, from the run's hardware profile. One task per node
    (torchrun starts the per-GPU ranks), GPUs as per-node GRES. The 'mpi' key makes the job
    step run the rule body in the batch step, which starts the nodes itself with srun; a
    one-node job must not declare mpi (the plugin rejects tasks=1 for MPI jobs), but the
    empty value still keeps the key present."""
    nodes = lambda wc: int(hardware_of(wc).get("nodes", 1))  # noqa: E731
    return {
        "slurm_partition": _hw("partition"),
        "slurm_account": _hw("account"),
        "runtime": _hw("runtime", 60),
        "mem_mb": _hw("mem_mb", 16000),
        "cpus_per_task": _hw("cpus_per_task", 8),
        "nodes": nodes,
        "tasks": nodes,
        "tasks_per_gpu": 0,
        "gres": _gres,
        "mpi": lambda wc: "srun" if nodes(wc) > 1 else "",
        "slurm_extra": _sbatch_extra,
    }


def acquire_inputs(wildcards):
    """Backend slurm: the training capture and one export per nsys report (known once the
    training checkpoint has run). Other backends need nothing upstream."""
    if RUNS[wildcards.run].backend != "slurm":
        # raw data, emulated too, is the run's capture: no code change re-makes it (-R acquire does)
        return {}
    capture = Path(checkpoints.train.get(run=wildcards.run).output.capture)
    hosts = sorted({p.stem for p in (capture / "nsys").iterdir() if p.suffix in REPORT_SUFFIXES})
    return {
        "capture": str(capture),
        "exports": [f"{RESULTS}/{wildcards.run}/export/{h}.sqlite" for h in hosts],
    }


# nsys profile leaves .nsys-rep (older: .qdrep); Debian's packaged nsys can only leave the raw
# .qdstrm stream (its importer is not where it looks), which the export imports first.
REPORT_SUFFIXES = (".nsys-rep", ".qdrep", ".qdstrm")


def nsys_report(wildcards):
    """The node's report in the training capture, whichever form nsys left."""
    nsys_dir = Path(f"{RESULTS}/{wildcards.run}/capture/nsys")
    for suffix in REPORT_SUFFIXES:
        if (nsys_dir / f"{wildcards.host}{suffix}").exists():
            return str(nsys_dir / f"{wildcards.host}{suffix}")
    return str(nsys_dir / f"{wildcards.host}.nsys-rep")


# Code stamps. Each analysis rule has its stage's stamp as an input, results/.code/<campaign>/<stage>.stamp,
# holding the stage's code hash (its import closure and data files: nccltrace.campaign.code_stamps.stage_code_hash):
# the same hash is a rule parameter, but Snakemake compares parameters only with its records of the
# jobs (.snakemake/metadata), and the stamp makes a code change re-run the stage also where those were
# lost. The stamp is the output of a job of its own (code_stamps.smk), the only writer, when it runs;
# reading the workflow writes nothing, so a dry run, --summary, --list-changes, --lint, --dag, --rulegraph
# change no file and say what a run would do.
STAMPED_CODE = {}  # stage -> its code hash now, for the stages that have a stamp (filled by code_stamp)


def code_stamp(stage):
    """The stage's code stamp, an input of each of its jobs (made by rule code_stamp)."""
    STAMPED_CODE.setdefault(stage, stage_code_hash(stage))
    return str(code_stamp_path(CODE_STAMPS, stage))


_FORCED_STAMPS = set()


def _stamp_out_of_date(wildcards):
    """The code_stamp job's input function (it has no input). When the stamp does not hold the
    stage's code hash now (another code's, or none: missing), its job is marked to run (what
    ``--forcerun`` does for a file), and so, by Snakemake's own rules, every job that reads it and
    everything downstream. Snakemake cannot see this by itself where its records of the jobs were
    lost: the stamp exists, and a job whose outputs exist is checked against its inputs' times only
    (the graph is built from the outputs asked for: a missing or out-of-date input that no job needs
    is never made). Nothing is written until the job runs; jobs that Snakemake itself starts for one
    job (--mode subprocess or remote) run what the main process scheduled and change nothing."""
    stamp = str(code_stamp_path(CODE_STAMPS, wildcards.stage))
    dag = workflow.dag
    if dag is None or not workflow.is_main_process:
        return []
    if not code_stamp_is_current(stamp, STAMPED_CODE[wildcards.stage]):
        if stamp not in dag.forcefiles:
            _FORCED_STAMPS.add(stamp)
        dag.forcefiles.add(stamp)
    elif stamp in _FORCED_STAMPS:  # written since (this run's job; the graph is updated after checkpoints)
        dag.forcefiles.discard(stamp)
        _FORCED_STAMPS.discard(stamp)
    return []


def _emulated_by_other_code():
    """Emulated runs whose raw data an emulator other than this checkout's made. Raw data stands
    for the run's capture and no code change re-makes it; this says which runs differ and how to
    re-make them, once, when the workflow is read."""
    emulator = stage_code_hash("emulate")
    older = []
    for run_id in RUN_IDS:
        layout = RunLayout(f"{RESULTS}/{run_id}")
        manifest = layout.manifest(layout.raw)
        if RUNS[run_id].backend == "emulate" and manifest.is_file():
            made_by = json.loads(manifest.read_text()).get("emulator_code")
            if made_by != emulator:
                older.append(run_id)
    if older:
        print(f"nccltrace: {len(older)} emulated run(s) were made by another emulator version (the emulator changed "
              f"since; raw data is kept as captured): {', '.join(older[:4])}{' ...' if len(older) > 4 else ''}. "
              "To emulate them again: snakemake -R acquire", file=sys.stderr)


_emulated_by_other_code()


def acquired(run):
    """True when the run's acquisition succeeded (a failed training run is recorded, not raised)."""
    from nccltrace.acquisition.status import read_status

    return read_status(checkpoints.acquire.get(run=run).output.raw)["status"] == "ok"


def acquisition_state():
    """(runs whose acquisition succeeded, checkpoint targets of the runs not acquired yet).

    Every pending acquisition is returned at once, so that the workflow schedules them
    together: a checkpoint's get() raises for the first one missing, and an input function that
    lets it raise makes Snakemake learn of the runs one at a time (each run's training job would
    wait for the previous run's). The targets keep Snakemake's checkpoint flag, so the input
    functions are evaluated again as each acquisition finishes."""
    done, pending = [], []
    for run in RUN_IDS:
        try:
            if acquired(run):
                done.append(run)
        except IncompleteCheckpointException as pending_run:
            pending.append(pending_run.targetfile)
    return done, pending


def raw_dir(wildcards):
    return checkpoints.acquire.get(run=wildcards.run).output.raw


def processes_of(run):
    """The processes of a run: one per NCCL log, known once acquisition has finished (checkpoint);
    in a run without logs, those its profiler traces and Flight Recorder dumps (else its nsys
    exports) name, known once checkpoint sources has read them (recorded_processes)."""
    raw = Path(checkpoints.acquire.get(run=run).output.raw)
    logs = sorted(p.stem for p in (raw / "nccl").glob("nccl_*.log"))
    return logs or sorted(recorded_processes(run))


def logless(run):
    """Whether the acquired run left no NCCL log (its processes come from its other sources)."""
    return not has_logs(checkpoints.acquire.get(run=run).output.raw)


_LISTINGS = {}  # listing path -> (its mtime, the processes it lists): read once per version


def recorded_processes(run):
    """Process name -> SourceProcess (nccltrace.inputs.evidence) of a run without NCCL logs, as
    checkpoint sources listed them; {} for a run with logs."""
    if not logless(run):
        return {}
    listing = Path(checkpoints.sources.get(run=run).output.processes)
    mtime = listing.stat().st_mtime_ns
    if _LISTINGS.get(listing, (None,))[0] != mtime:
        _LISTINGS[listing] = (mtime, read_source_processes(RunLayout(f"{RESULTS}/{run}"))[0])
    return _LISTINGS[listing][1]


def source_inputs(wildcards):
    """The listing and staged traces of checkpoint sources for a run without NCCL logs (a job's
    checkpoint-dependent params resolve remotely from declared inputs only); nothing for a run
    with logs."""
    if not logless(wildcards.run):
        return {}
    out = checkpoints.sources.get(run=wildcards.run).output
    return {"sources": out.processes, "staged": out.kernels}


def largest_source_bytes(wc, input):
    """Size of the largest profiler trace or nsys export of a run without NCCL logs (checkpoint
    sources reads one at a time)."""
    traces, _, exports = raw_sources(input.raw)
    return max((p.stat().st_size for p in (*traces, *exports)), default=0)


def nccl_processes(wildcards):
    return processes_of(wildcards.run)


def _each(path_of, layout, keys):
    out = []
    for key in keys:
        paths = path_of(layout, key)
        out += list(paths) if isinstance(paths, (list, tuple)) else [paths]
    return out


# Per-process work runs in per-node jobs (parse_node, align_node), whose outputs are per-node
# directories: a job's outputs cannot depend on the processes a checkpoint finds. Rules after
# them take those directories as inputs (the files in them have no rule of their own).


def log_hosts(run):
    """Nodes with NCCL logs (the hosts of the run's processes)."""
    return sorted({RunLayout.host_of(proc) for proc in processes_of(run)})


def node_hosts(run):
    """Every node with something to parse: NCCL logs, an nsys export, or both."""
    return sorted({*log_hosts(run), *export_hosts(run)})


def per_log_node(path_of):
    """Input function: ``path_of(layout, host)`` (a path or a list) for every node with NCCL logs."""
    return lambda wc: _each(path_of, run_layout(wc), log_hosts(wc.run))


def per_export_node(path_of):
    """Input function: ``path_of(layout, host)`` (a path or a list) for every node with an nsys export."""
    return lambda wc: _each(path_of, run_layout(wc), nsys_hosts(wc))


def per_node(path_of):
    """Input function: ``path_of(layout, host)`` (a path or a list) for every node (logs or export)."""
    return lambda wc: _each(path_of, run_layout(wc), node_hosts(wc.run))


def node_processes(wildcards):
    """The processes of the job's node with an NCCL log, sorted (those its jobs parse and align)."""
    if logless(wildcards.run):
        return []
    return [proc for proc in processes_of(wildcards.run) if RunLayout.host_of(proc) == wildcards.host]


def node_recorded(wildcards):
    """The processes of the job's node without an NCCL log (parsed from their records, not
    aligned), sorted; none in a run with logs."""
    return [name for name, p in recorded_processes(wildcards.run).items() if p.host == wildcards.host]


def analysis_targets(wildcards):
    """Every per-run output of every run whose acquisition succeeded (rule all). Runs whose
    training failed are listed, with the reason, in the campaign report instead."""
    done, out = acquisition_state()
    for run in done:
        layout = RunLayout(f"{RESULTS}/{run}")
        try:
            hosts = log_hosts(run)
        except IncompleteCheckpointException as pending_run:  # the run's sources, not read yet: all at once
            out.append(pending_run.targetfile)
            continue
        out += [layout.aligned_node(host) for host in hosts]
        out += [layout.parse_summary, layout.communicators, layout.ops, layout.metric("op_metrics"),
                layout.volume, layout.trace, layout.report_html]  # fmt: skip
    return out


def run_report_manifests(wildcards):
    """Reports the campaign report combines: those of the runs that were acquired."""
    done, pending = acquisition_state()
    layouts = [RunLayout(f"{RESULTS}/{run}") for run in done]
    return pending + [layout.manifest(layout.report_dir) for layout in layouts]


def failed_runs(wildcards):
    """Run id -> why it has no results (its recorded acquisition failure)."""
    from nccltrace.acquisition.status import read_status

    out = {}
    for run in RUN_IDS:
        status = read_status(checkpoints.acquire.get(run=run).output.raw)
        if status["status"] != "ok":
            out[run] = status.get("reason") or "acquisition failed"
    return out


def export_hosts(run):
    """Nodes with a kernel source: an nsys export; in a run without NCCL logs, the nodes whose
    processes left a profiler trace or, in a run of exports alone, an export (kernel_sources_of)."""
    raw = Path(checkpoints.acquire.get(run=run).output.raw)
    if not has_logs(raw):
        return sorted(kernel_sources_of(list(recorded_processes(run).values())))
    return RunLayout.of_raw(raw).raw_export_hosts()


def nsys_hosts(wildcards):
    return export_hosts(wildcards.run)


def job_mem(stage, rows=None):
    """Resource function: the stage's measured memory (nccltrace.campaign.job_resources) for the rows that
    drive its peak, ``rows(wildcards, input)``: a count, or (rows, run rows)."""

    def mem(wc, input):
        try:
            n = rows(wc, input) if rows else 0
        except IncompleteCheckpointException:
            # rows known after a checkpoint that is to run again (a run's sources): Snakemake would
            # take the exception's 0 for the resource itself; the job is sized once it has run
            n = 0
        return mem_mb(stage, *n) if isinstance(n, tuple) else mem_mb(stage, n)

    return mem


def node_job_mem(*stages):
    """Resource function of a per-node job, which runs ``stages`` (``(stage, rows)`` as job_mem
    takes them) one process after another: its peak is the largest of theirs, not their sum."""
    return lambda wc, input: max(job_mem(stage, rows)(wc, input) for stage, rows in stages)


def node_calls(wc, input):
    """Calls of the node's largest process (its parsed calls table; none yet in a dry run)."""
    layout = run_layout(wc)
    procs = node_processes(wc) + node_recorded(wc)
    return max((parquet_rows(layout.parsed_nccl_table(proc, "calls")) for proc in procs), default=0)


def alignment_rows(wc, input):
    """Rows of the run's alignment tables (none yet in a dry run)."""
    layout = run_layout(wc)
    return sum(parquet_rows(layout.alignment(proc)) for proc in nccl_processes(wc))


def ops_rows(wc, input):
    return parquet_rows(input.ops)


def metrics_part_calls(wc, input):
    """(calls of the largest part, calls of the run) of the out-of-core metrics; none yet in a dry run."""
    return part_calls(input.ops) if Path(input.ops).is_file() else (0, 0)


def export_bytes(wc, input):
    """Size of the node's nsys export(s) (0 for a node without one)."""
    return sum(p.stat().st_size for p in RunLayout.of_raw(input.raw).raw_exports(wc.host))
