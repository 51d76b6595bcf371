"""The ``nccltrace`` command line: the same stages the workflow runs, usable on any directory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nccltrace import __version__
from nccltrace.core.layout import COMMS_FILE, MANIFEST_FILE
from nccltrace.stages import STAGES, NodeStageError


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, file=sys.stderr)


def cmd_parse_nccl(args: argparse.Namespace) -> int:
    from nccltrace.nccl.log_reader import find_log_files
    from nccltrace.stages.parse_nccl import run_parse_nccl

    files = find_log_files(Path(p) for p in args.paths)
    if not files:
        raise FileNotFoundError(f"no NCCL log files (*.log, *.txt, *.out, *nccl*) in {', '.join(args.paths)}")
    total = sum(f.stat().st_size for f in files)
    with _progress_bar(total, "parse NCCL logs", not args.quiet) as bar:
        result = run_parse_nccl(files, args.out, progress=bar.update)
    report = result.details["report"]
    totals = report.counts
    print(
        f"{len(report.files)} file(s): {totals['call']} calls ({totals['call_duplicate']} duplicates collapsed), "
        f"{totals['init'] + totals['split']} init/split, {totals['tuning']} tuning, "
        f"{totals['unclassified']} unclassified lines -> {args.out}"
    )
    for f in report.files:
        for issue in f.issues:
            print(f"{issue['severity']}: {f.file}:{issue['line'] or '-'}: {issue['message']}", file=sys.stderr)
    for problem in result.details["cut"]:
        print(f"warning: {problem}", file=sys.stderr)
    return 2 if result.partial and args.strict else 0


def cmd_parse_nsys(args: argparse.Namespace) -> int:
    from nccltrace.core.provenance import write_manifest
    from nccltrace.nsys.nccl_api import format_summary
    from nccltrace.nsys.reader import NsysExport

    for path in args.exports:
        out = Path(args.out) if len(args.exports) == 1 else Path(args.out) / Path(path).stem
        export = NsysExport.open(path)
        written = export.export_tables(out)
        write_manifest(out / MANIFEST_FILE, stage="parse_nsys", inputs=[path], outputs=list(written.values()))
        print(f"{path}: schema {export.schema_version} (nsys {export.product_version}) -> {out}")
        api = export.nccl_api_summary
        print(f"  {format_summary(api)}")
        if api["payload_warning"]:
            print(f"warning: {path}: {api['payload_warning']}", file=sys.stderr)
    return 0


def cmd_parse_kineto(args: argparse.Namespace) -> int:
    import pyarrow.parquet as pq

    from nccltrace.core.provenance import write_manifest
    from nccltrace.kineto.reader import KinetoTrace, iter_kineto_files

    paths = list(iter_kineto_files([Path(p) for p in args.traces]))
    if not paths:
        raise FileNotFoundError(f"no PyTorch-profiler trace (Chrome-trace JSON, .json or .json.gz) in "
                                f"{', '.join(args.traces)}")
    for path in paths:
        name = path.name.removesuffix(".gz").removesuffix(".json")
        out = Path(args.out) if len(paths) == 1 else Path(args.out) / name
        trace = KinetoTrace.open(path)
        written = trace.export_tables(out)
        write_manifest(out / MANIFEST_FILE, stage="parse_kineto", inputs=[path], outputs=list(written.values()),
                       partial=bool(trace.truncated), reasons=[trace.truncated] if trace.truncated else [])
        n = pq.read_metadata(written["kernels"]).num_rows
        rank = "" if trace.rank is None else f", rank {trace.rank} of {trace.world_size}"
        print(f"{path}: PyTorch-profiler trace (pid {', '.join(map(str, trace.pids)) or '?'}{rank}): {n} NCCL kernels "
              f"of {trace.kernel_records} -> {out}")
        if trace.truncated:
            print(f"warning: {path}: cut short ({trace.truncated}); kernels after the cut are missing", file=sys.stderr)
        if not trace.cuda_events:
            print(f"warning: {path}: no CUDA activity (a CPU-only trace): profile with activities CPU and CUDA",
                  file=sys.stderr)
    return 0


def cmd_emulate(args: argparse.Namespace) -> int:
    import yaml

    from nccltrace.emulator.run import emulate_run

    if args.campaign:
        from nccltrace.campaign.matrix import expand_campaign, load_campaign

        runs = {r.run_id: r for r in expand_campaign(load_campaign(args.campaign))}
        if args.config not in runs:
            print(f"error: run '{args.config}' is not in {args.campaign}; runs: {', '.join(runs)}", file=sys.stderr)
            return 2
        settings = runs[args.config].settings
    else:
        settings = yaml.safe_load(Path(args.config).read_text())
    result = emulate_run(settings, Path(args.out), progress=not args.quiet)
    print(
        f"emulated {result.run_id}: {result.n_ranks} ranks, {result.n_ops} logged ops, {result.n_kernels} kernels; "
        f"{len(result.log_files)} NCCL logs, {len(result.nsys_files)} nsys exports, ground truth -> {args.out}"
    )
    return 0


def cmd_communicators(args: argparse.Namespace) -> int:
    from nccltrace.communicators.infer import (
        communicator_problems,
        infer_run_communicators,
    )

    dirs = [Path(p) for p in args.parsed]
    for d in dirs:
        if not (d / COMMS_FILE).exists():
            raise FileNotFoundError(f"{d}: no comms.parquet (pass directories written by `nccltrace parse-nccl`)")
    result = infer_run_communicators(dirs, Path(args.out), _declared_settings(args) or None)
    bad = result.communicators[~result.communicators["complete"].astype(bool)]
    world = "unknown" if result.world_size is None else result.world_size
    print(f"{len(result.communicators)} communicators, world size {world}, {len(bad)} incomplete -> {args.out}")
    for row in bad.itertuples():
        print(f"incomplete communicator {row.logical_id}: {row.problem}", file=sys.stderr)
    for problem in communicator_problems(result):
        print(f"warning: {problem}", file=sys.stderr)
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from nccltrace.campaign.matrix import (
        CampaignError,
        expand_campaign,
        load_campaign,
        validate_runs,
    )

    runs = expand_campaign(load_campaign(args.config))
    try:
        validate_runs(runs)
    except CampaignError as exc:
        print(f"error: {args.config}: {exc}", file=sys.stderr)
        return 2
    for run in runs:
        print(run.run_id if not args.verbose else json.dumps({"run": run.run_id, "backend": run.backend,
                                                              **run.settings}, default=str))
    return 0


def cmd_tables_doc(args: argparse.Namespace) -> int:
    from nccltrace.outputs.tables_doc import tables_markdown

    text = tables_markdown()
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


_SIZE_FLAGS = (("tp", "tensor parallel size"), ("pp", "pipeline parallel size"), ("cp", "context parallel size"),
               ("ep", "expert parallel size"), ("etp", "expert tensor parallel size (default: tp)"),
               ("vpp", "virtual pipeline stages per pipeline rank"), ("dp", "data parallel size"),
               ("nodes", "number of nodes"), ("gpus_per_node", "GPUs (ranks) per node"),
               ("world_size", "number of ranks"))  # fmt: skip


def _declared_settings(args: argparse.Namespace) -> dict:
    """Declared sizes: the --settings file, overridden by the size flags given."""
    import yaml

    settings: dict = {}
    if args.settings:
        data = yaml.safe_load(Path(args.settings).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{args.settings}: expected a mapping of settings (tp: 2, pp: 2, ...)")
        settings.update(data)
    settings.update({name: getattr(args, name) for name, _ in _SIZE_FLAGS if getattr(args, name) is not None})
    if getattr(args, "distributed_optimizer", False):
        settings["distributed_optimizer"] = True
    if getattr(args, "rank_in_log_name", None):
        from nccltrace.communicators.infer import RANK_NAME_SETTING

        settings[RANK_NAME_SETTING] = args.rank_in_log_name
    return settings


def _step_range(text: str) -> tuple[int, int]:
    """``A-B`` (or ``A``) -> (A, B), 1-based logged step numbers."""
    a, _, b = text.partition("-")
    try:
        first, last = int(a), int(b or a)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give the captured steps as FIRST-LAST, e.g. 3-4") from None
    if first < 1 or last < first:
        raise argparse.ArgumentTypeError(f"{text!r}: steps are 1-based and FIRST <= LAST, e.g. 3-4")
    return first, last


def cmd_analyze(args: argparse.Namespace) -> int:
    from nccltrace.analyze import analyze_run

    res = analyze_run(Path(args.raw_dir), Path(args.out), settings=_declared_settings(args) or None, mode=args.mode,
                      progress=not args.quiet, capture_steps=args.capture_steps, until=args.until)
    share = f" ({res['matched'] / res['calls']:.1%})" if res["calls"] else ""
    reasons = ", ".join(f"{k} {v}" for k, v in res["unmatched_by_reason"].items()) or "none"
    print(f"{res['processes']} processes on {len(res['hosts'])} host(s), mode {res['mode']}: {res['calls']} calls, "
          f"{res['matched']} matched{share}; unmatched: {reasons}")
    print(f"parallelism labels: {', '.join(res['label_source']) or '-'}; "
          f"{'partial' if res['partial'] else 'complete'} -> {args.out}")
    if res["outputs"].get("report"):
        print(f"report: {res['outputs']['report']}")
    for note in res["notes"]:
        print(f"note: {note}", file=sys.stderr)
    for problem in res["problems"]:
        print(f"warning: {problem}", file=sys.stderr)
    return 2 if res["partial"] and args.strict else 0


def _table_in(path: str, name: str) -> Path:
    """``path`` itself, or ``path/name`` when ``path`` is a stage's output directory."""
    p = Path(path)
    if p.is_dir():
        p = p / name
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file (pass {name} or the directory holding it)")
    return p


def cmd_align(args: argparse.Namespace) -> int:
    import tempfile

    import pyarrow.parquet as pq

    from nccltrace.core.layout import (
        ALIGNMENT_FILE,
        ALIGNMENT_QUALITY_FILE,
        CALLS_FILE,
        KERNELS_FILE,
        LAUNCHES_FILE,
        MANIFEST_FILE,
        NVTX_FILE,
        SESSION_FILE,
    )
    from nccltrace.stages.align import AlignFiles, align_process_files

    calls = _table_in(args.calls, CALLS_FILE)
    kernels = _table_in(args.kernels, KERNELS_FILE)
    beside = kernels.parent
    session = Path(args.session) if args.session else beside / SESSION_FILE
    if args.session and not session.exists():
        raise FileNotFoundError(f"{session}: no such session file")
    launches = Path(args.launches) if args.launches else beside / LAUNCHES_FILE
    nvtx = None
    if args.mode == "exact":
        nvtx = Path(args.nvtx) if args.nvtx else beside / NVTX_FILE
        if not nvtx.exists():
            raise FileNotFoundError(f"{nvtx}: exact mode needs the export's {NVTX_FILE} (pass --nvtx)")
    out = Path(args.out)
    dest = out if out.suffix == ".parquet" else out / ALIGNMENT_FILE
    pids = pq.read_table(calls, columns=["pid"]).column("pid").unique().drop_null().to_pylist()
    if args.pid is None and len(pids) > 1:
        raise ValueError(f"{calls} holds the calls of {len(pids)} processes (pids {', '.join(map(str, pids[:6]))}"
                         f"{', ...' if len(pids) > 6 else ''}); pass --pid or one process's parse-nccl directory")
    # A named output file gets its own manifest rather than a shared one beside it.
    manifest = dest.parent / (MANIFEST_FILE if out.suffix != ".parquet" else f"{dest.stem}.{MANIFEST_FILE}")
    with tempfile.TemporaryDirectory(prefix="nccltrace-align-") as tmp:
        calls_used = calls
        if args.pid is not None:
            # The calls of one process out of a multi-process parse.
            t = pq.read_table(calls, filters=[("pid", "=", args.pid)])
            if t.num_rows == 0:
                raise ValueError(f"{calls}: no calls of pid {args.pid}")
            calls_used = Path(tmp) / CALLS_FILE
            pq.write_table(t, calls_used)
        files = AlignFiles(calls_used, kernels, session if session.exists() else None,
                           launches if launches.exists() else None, nvtx, dest, dest.parent / ALIGNMENT_QUALITY_FILE,
                           manifest, listed_calls=calls)  # fmt: skip
        result = align_process_files(files, calls.parent.name, beside.name, mode=args.mode, pid=args.pid,
                                     config={"mode": args.mode, "pid": args.pid})  # fmt: skip
    summary = result.details["summary"]
    reasons = ", ".join(f"{k} {v}" for k, v in summary["unmatched_by_reason"].items()) or "none"
    print(f"{summary['calls']} calls, {summary['matched']} matched; unmatched: {reasons}; "
          f"{summary['kernels_without_call']} kernels without a call -> {dest}")
    for problem in result.problems:
        print(f"warning: {problem}", file=sys.stderr)
    if summary["calls"] and not summary["matched"] and not summary["kernels_without_call"]:
        print(f"warning: {kernels} has no NCCL kernel of this process; is it the export of the process's node?",
              file=sys.stderr)
    return 0


def _format_column(col) -> list[str]:
    """Cells of one column: floats with 4 decimals unless the column holds whole numbers beyond
    0/1 (sizes, microsecond settings; a column of scores that are all 1 keeps its decimals),
    missing values as '-'."""
    import pandas as pd

    values = col.astype(object).tolist()
    floats = [v for v in values if isinstance(v, float) and not pd.isna(v)]
    integral = all(v.is_integer() and abs(v) < 1e15 for v in floats) and any(abs(v) >= 2 for v in floats)
    cells = []
    for v in values:
        if pd.api.types.is_scalar(v) and pd.isna(v):
            cells.append("-")
        elif isinstance(v, float):
            cells.append(str(int(v)) if integral else f"{v:.4f}")
        else:
            cells.append(str(v))
    return cells


def _print_table(title: str, df, file=None) -> None:
    """A titled, underlined table with an optional note (``df.attrs['note']``) under the title."""
    import pandas as pd

    out = file or sys.stdout
    print(f"\n{title}\n{'=' * len(title)}", file=out)
    if df.attrs.get("note"):
        print(df.attrs["note"], file=out)
    shown = pd.DataFrame({c: _format_column(df[c]) for c in df.columns})
    print(shown.to_string(index=False) if len(df) else "(no rows)", file=out)


def cmd_validate(args: argparse.Namespace) -> int:
    from nccltrace.validation.tables import VALIDATION_SECTIONS, validation_tables

    only = tuple(s.strip() for s in args.only.split(",") if s.strip()) if args.only else VALIDATION_SECTIONS
    tables = validation_tables(only, quick=args.quick, workdir=args.workdir, campaign=args.campaign,
                               progress=not args.quiet, real_exports=args.real_exports)
    for title, df in tables.items():
        _print_table(title, df)
    if args.csv:
        import re

        out = Path(args.csv)
        out.mkdir(parents=True, exist_ok=True)
        for title, df in tables.items():
            slug = re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")[:60]
            df.to_csv(out / f"{slug}.csv", index=False)
    return 0


def _rank_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    out: list[int] = []
    for part in filter(None, (t.strip() for t in text.split(","))):
        a, _, b = part.partition("-")
        try:
            out += list(range(int(a), int(b) + 1)) if b else [int(a)]
        except ValueError:
            raise ValueError(f"--ranks: {part!r} is not a rank or a range like 0-7") from None
    return out


def cmd_trace(args: argparse.Namespace) -> int:
    """Chrome traces of one analysed run."""
    from nccltrace.outputs.perfetto import write_run_traces

    summaries = write_run_traces(
        args.run_dir, args.out, name=args.name, split_per_rank=args.split_per_rank,
        window_ns=tuple(args.window_ns) if args.window_ns else None, window_nvtx=args.window_nvtx,
        ranks=_rank_list(args.ranks) if args.ranks else None, max_events=args.max_events,
        min_message_bytes=args.min_message_bytes, summary=args.summary, summary_max_events=args.summary_max_events,
    )  # fmt: skip
    for s in summaries:
        flag = " (truncated)" if s.truncated else ""
        print(f"{s.path}: {s.events:,} events, {s.bytes / 1e6:.1f} MB gz, {s.json_bytes / 1e6:.1f} MB JSON{flag}")
    return 0


def _add_size_flags(s: argparse.ArgumentParser) -> None:
    """The declared-size flags (--tp N, ...) of the commands that take run settings."""
    for name, what in _SIZE_FLAGS:
        s.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, metavar="N", help=what)


def _add_parse_commands(sub: argparse._SubParsersAction) -> None:
    """parse-nccl, parse-nsys, parse-kineto: one input format into its tables."""
    s = sub.add_parser("parse-nccl", help="parse NCCL debug logs into Parquet tables + parse report",
                       description="Parse NCCL_DEBUG=INFO logs (files or directories) into the documented tables "
                                   "(calls, comms, tuning, topology, ...) and parse_report.json.")
    s.add_argument("paths", nargs="+", help="log files or directories of *.log/*.txt/*.out")
    s.add_argument("-o", "--out", required=True, help="output directory")
    s.add_argument("--strict", action="store_true", help="exit with status 2 when the result is partial")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_parse_nccl)

    s = sub.add_parser("parse-nsys", help="read nsys SQLite exports into Parquet tables",
                       description="Read `nsys export --type sqlite` files (schema 3.x): NCCL kernels with their "
                                   "launches, NVTX ranges and NCCL payloads, NCCL API calls linked to their kernels "
                                   "(nccl_api_calls.parquet), processes, session anchor.")
    s.add_argument("exports", nargs="+", help="SQLite export files")
    s.add_argument("-o", "--out", required=True, help="output directory (one subdirectory per export if several)")
    s.set_defaults(func=cmd_parse_nsys)

    s = sub.add_parser("parse-kineto", help="read PyTorch-profiler (Kineto) traces into the tables of parse-nsys",
                       description="Read torch.profiler Chrome traces (.json or .json.gz, any name; files or "
                                   "directories, found by content) in one streaming pass: NCCL kernels with their "
                                   "launch calls and the profiler's collective arguments, CPU ranges (ProfilerStep#N) "
                                   "as NVTX ranges, processes, session anchor (baseTimeNanoseconds), rank and "
                                   "process groups. The tables are those of parse-nsys, so every later stage reads "
                                   "either.")
    s.add_argument("traces", nargs="+", help="trace files or directories")
    s.add_argument("-o", "--out", required=True, help="output directory (one subdirectory per trace if several)")
    s.set_defaults(func=cmd_parse_kineto)


def _add_emulate_command(sub: argparse._SubParsersAction) -> None:
    """emulate: the raw outputs of a run, from the emulator."""
    s = sub.add_parser("emulate", help="emulate a Megatron-LM run: NCCL logs, nsys exports, ground truth",
                       description="Produce the raw outputs a real run would leave, from a run config YAML or "
                                   "from a run id of a campaign (--campaign).")
    s.add_argument("config", help="run config YAML, or a run id with --campaign")
    s.add_argument("-o", "--out", required=True, help="output directory (the run's raw/ directory)")
    s.add_argument("--campaign", help="campaign config YAML; CONFIG is then a run id of it")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_emulate)


def _add_layout_commands(sub: argparse._SubParsersAction) -> None:
    """communicators, infer-layout: who talks to whom, and Megatron's layout from it."""
    s = sub.add_parser("communicators", help="logical communicators and global ranks from init/split lines",
                       description="Group the init/split lines of parsed NCCL logs (one directory per process, or "
                                   "one for all) into logical communicators with member global ranks.")
    s.add_argument("parsed", nargs="+", help="directories written by `nccltrace parse-nccl`")
    s.add_argument("-o", "--out", required=True, help="output directory")
    s.add_argument("--settings", help="YAML with run settings / declared sizes: where no communicator spans every "
                   "rank, the global ranks are solved from the communicators' structure against these sizes")
    _add_size_flags(s)
    s.set_defaults(func=cmd_communicators)

    # A light module: numpy loads only when the subcommand runs.
    from nccltrace.megatron import command as infer_layout

    s = sub.add_parser("infer-layout", help=infer_layout.HELP, description=infer_layout.DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    infer_layout.add_arguments(s)
    s.set_defaults(func=infer_layout.cmd_infer_layout)


def _add_analyze_command(sub: argparse._SubParsersAction) -> None:
    """analyze: every stage on one run's raw directory."""
    s = sub.add_parser("analyze", help="run every stage on one run's raw directory (no Snakemake)",
                       description="Run every stage the workflow runs for one run, through the report: parse "
                                   "the NCCL logs and nsys exports, infer communicators, align calls with kernels "
                                   "per process, build the enriched ops table, then metrics, volume validation, "
                                   "trace and report, in the workflow's output layout (parsed/, communicators/, "
                                   "aligned/, ops/, metrics/, volume/, trace/, report/) with manifests. Logs are "
                                   "found by content under RAW_DIR (or RAW_DIR/nccl): any name, .txt or .gz, one "
                                   "per process or rank, or one combined stdout of all ranks (srun --label, "
                                   "torchrun --tee, mpirun --tag-output); kernel traces are the nsys exports "
                                   "(*.sqlite under RAW_DIR or RAW_DIR/nsys, one per node or per process, matched "
                                   "to nodes by their recorded host name) and PyTorch-profiler Chrome traces (.json, "
                                   ".json.gz, found by content, placed by the pid of their kernels' launches); "
                                   "without any, the logs alone are analysed. "
                                   "Declared sizes come from RAW_DIR/run.yaml if present, overridden by --settings "
                                   "and the size flags.")
    s.add_argument("raw_dir", metavar="RAW_DIR", help="directory of the run's NCCL logs and nsys exports")
    s.add_argument("-o", "--out", required=True, help="output directory")
    s.add_argument("--mode", choices=("default", "thesis", "exact"), default="default",
                   help="alignment mode (exact needs NCCL NVTX payloads in the exports; default: %(default)s)")
    s.add_argument("--settings", help="YAML with run settings / declared sizes (tp, pp, ...; a run.yaml works)")
    _add_size_flags(s)
    s.add_argument("--distributed-optimizer", action="store_true", help="the run used Megatron's distributed "
                   "optimizer")
    s.add_argument("--rank-in-log-name", metavar="PATTERN",
                   help="where the log files' names carry the global rank, with {rank} for it, %%h/%%p for NCCL's "
                        "host/pid and * as wildcard: e.g. 'nccl.{rank}.%%h.%%p' for "
                        "NCCL_DEBUG_FILE=nccl.${SLURM_PROCID}.%%h.%%p, or 'rank{rank}/*.log' (names the ranks when "
                        "no communicator spans every rank; the number must be the global rank, not a local one)")
    s.add_argument("--capture-steps", type=_step_range, metavar="FIRST-LAST",
                   help="the training steps the nsys capture covers (Megatron's logged iteration numbers, both "
                        "included; e.g. 3-4 for --profile-step-start 2 --profile-step-end 4): locates a step-window "
                        "capture in logs without timestamps (overrides capture.steps of the run settings)")
    s.add_argument("--until", choices=STAGES, default="report",
                   help="last stage to run (default: report, every stage the workflow runs for a run)")
    s.add_argument("--strict", action="store_true", help="exit with status 2 when the result is partial")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_analyze)


def _add_align_command(sub: argparse._SubParsersAction) -> None:
    """align: one process's calls with its node's kernels."""
    s = sub.add_parser("align", help="correlate one process's call lines with its node's kernels",
                       description="Align one process's parsed NCCL calls (calls.parquet from parse-nccl) with the "
                                   "NCCL kernels of its node's export (kernels.parquet from parse-nsys); session, "
                                   "launch and NVTX tables are taken from beside KERNELS unless given.")
    s.add_argument("calls", metavar="CALLS", help="calls.parquet of one process, or its parse-nccl directory")
    s.add_argument("kernels", metavar="KERNELS", help="kernels.parquet of the node, or its parse-nsys directory")
    s.add_argument("-o", "--out", required=True, help="output directory (alignment.parquet + manifest.json) or "
                   "a .parquet file")
    s.add_argument("--session", help="session.json of the export (enables the time signal; default: beside "
                   "KERNELS)")
    s.add_argument("--mode", choices=("default", "thesis", "exact"), default="default",
                   help="alignment mode (default: %(default)s)")
    s.add_argument("--nvtx", help="nvtx.parquet for --mode exact (default: beside KERNELS)")
    s.add_argument("--launches", help="launches_without_kernel.parquet (default: beside KERNELS)")
    s.add_argument("--pid", type=int, help="the process to align when CALLS holds several")
    s.set_defaults(func=cmd_align)


def _add_trace_command(sub: argparse._SubParsersAction) -> None:
    """trace: Chrome traces of an analysed run."""
    s = sub.add_parser("trace", help="write Chrome traces of one analysed run (windows, per rank, summary)",
                       description="Write Chrome Trace Event files (open in ui.perfetto.dev) from a run directory "
                                   "the workflow or `nccltrace analyze` produced (ops/, parsed/, optional "
                                   "metrics/). For large runs: a window (--window-nvtx 'iteration 3' or "
                                   "--window-ns), a subset of ranks, one file per rank, an event cap, and a "
                                   "summary trace whose size does not grow with the number of ops.")
    s.add_argument("run_dir", metavar="RUN_DIR", help="the run's result directory (with ops/ops.parquet)")
    s.add_argument("-o", "--out", required=True, help="output directory")
    s.add_argument("--name", default="trace", help="file name stem (default: %(default)s)")
    s.add_argument("--window-nvtx", metavar="TEXT", help="only the extent of the NVTX ranges with this text")
    s.add_argument("--window-ns", nargs=2, type=int, metavar=("START", "END"),
                   help="only this window, ns since the run's first event")
    s.add_argument("--ranks", metavar="LIST", help="global ranks to include, e.g. 0-7,16")
    s.add_argument("--split-per-rank", action="store_true", help="also one file per rank")
    s.add_argument("--max-events", type=int, help="cap on events per file (the trace is cut at one time)")
    s.add_argument("--min-message-bytes", type=int, help="leave out calls below this message size")
    s.add_argument("--summary", action="store_true", help="also <name>.summary.json.gz (bursts per rank and "
                   "parallelism)")
    s.add_argument("--summary-max-events", type=int, default=200_000, help="event budget of the summary "
                   "(default: %(default)s)")
    s.set_defaults(func=cmd_trace)


def _add_campaign_commands(sub: argparse._SubParsersAction) -> None:
    """validate, runs, tables-doc: accuracy, campaign runs, table documentation."""
    s = sub.add_parser("validate", help="print the accuracy figures against emulator ground truth",
                       description="Emulate scenarios and score the analysis against their ground truth: "
                                   "alignment (thesis table 4.5 beside ours; default mode on the example "
                                   "campaign with every imperfection on), parallelism labels and communicator "
                                   "fallback, clock sync errors of both methods, exact vs default alignment.")
    s.add_argument("--quick", action="store_true", help="fewer, smaller scenarios (CI)")
    s.add_argument("--only", metavar="SECTIONS", help="comma list of alignment,capture,communicators,labels,clock,exact "
                   "(default: all)")
    s.add_argument("--campaign", help="campaign config for the default-mode runs (default: config/config.yaml of "
                   "the checkout)")
    s.add_argument("--workdir", help="keep the emulated runs here (default: a temporary directory)")
    s.add_argument("--real-exports", metavar="DIR", help="a directory of real nsys exports (*.sqlite): the capture "
                   "section also links their NCCL API calls to kernels")
    s.add_argument("--csv", metavar="DIR", help="also write every table as CSV into DIR")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser("runs", help="list the run ids a campaign config expands to",
                       description="Validate a campaign config against the schema and list its runs.")
    s.add_argument("config", help="campaign config YAML (e.g. config/config.yaml)")
    s.add_argument("-v", "--verbose", action="store_true", help="print every run's resolved settings as JSON")
    s.set_defaults(func=cmd_runs)

    s = sub.add_parser("tables-doc", help="print the documentation of every output table",
                       description="Render name, type, unit and meaning of every column of every table.")
    s.add_argument("-o", "--out", help="write to this file instead of stdout")
    s.set_defaults(func=cmd_tables_doc)


def build_parser() -> argparse.ArgumentParser:
    """The ``nccltrace`` argument parser: one subcommand per stage or tool, in --help order."""
    p = argparse.ArgumentParser(
        prog="nccltrace",
        description="Per-operation NCCL communication analysis: NCCL debug logs fused with Nsight Systems traces.",
    )
    p.add_argument("--version", action="version", version=f"nccltrace {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for add in (_add_parse_commands, _add_emulate_command, _add_layout_commands, _add_analyze_command,
                _add_align_command, _add_trace_command, _add_campaign_commands):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``nccltrace`` command."""
    from nccltrace.core.errors import console_warnings

    console_warnings()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except NodeStageError as exc:
        # some processes of a node failed (each one's traceback is printed as it failed)
        if not exc.bad_input:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        # Bad input: a clear one-line message, no traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
