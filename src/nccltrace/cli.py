"""The ``nccltrace`` command line: the same stages the workflow runs, usable on any directory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import __version__


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, file=sys.stderr)


def cmd_parse_nccl(args: argparse.Namespace) -> int:
    from .nccl.log_reader import find_log_files, parse_logs
    from .provenance import write_manifest

    files = find_log_files(Path(p) for p in args.paths)
    if not files:
        raise FileNotFoundError(f"no NCCL log files (*.log, *.txt, *.out, *nccl*) in {', '.join(args.paths)}")
    total = sum(f.stat().st_size for f in files)
    with _progress_bar(total, "parse NCCL logs", not args.quiet) as bar:
        report = parse_logs(files, args.out, progress=bar.update)
    write_manifest(Path(args.out) / "manifest.json", stage="parse_nccl", inputs=files,
                   outputs=[Path(args.out)], partial=report.partial)
    totals = report.counts
    print(
        f"{len(report.files)} file(s): {totals['call']} calls ({totals['call_duplicate']} duplicates collapsed), "
        f"{totals['init'] + totals['split']} init/split, {totals['tuning']} tuning, "
        f"{totals['unclassified']} unclassified lines -> {args.out}"
    )
    for f in report.files:
        for issue in f.issues:
            print(f"{issue['severity']}: {f.file}:{issue['line'] or '-'}: {issue['message']}", file=sys.stderr)
    return 2 if report.partial and args.strict else 0


def cmd_parse_nsys(args: argparse.Namespace) -> int:
    from .nsys.reader import NsysExport
    from .provenance import write_manifest

    for path in args.exports:
        out = Path(args.out) if len(args.exports) == 1 else Path(args.out) / Path(path).stem
        export = NsysExport.open(path)
        written = export.export_tables(out)
        write_manifest(out / "manifest.json", stage="parse_nsys", inputs=[path], outputs=list(written.values()))
        print(f"{path}: schema {export.schema_version} (nsys {export.product_version}) -> {out}")
    return 0


def cmd_emulate(args: argparse.Namespace) -> int:
    import yaml

    from .emulator.run import emulate_run

    if args.campaign:
        from .campaign import expand_campaign, load_campaign

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
    from .communicators import infer_run_communicators

    dirs = [Path(p) for p in args.parsed]
    for d in dirs:
        if not (d / "comms.parquet").exists():
            raise FileNotFoundError(f"{d}: no comms.parquet (pass directories written by `nccltrace parse-nccl`)")
    result = infer_run_communicators(dirs, Path(args.out))
    bad = result.communicators[~result.communicators["complete"].astype(bool)]
    print(f"{len(result.communicators)} communicators, world size {result.world_size}, {len(bad)} incomplete "
          f"-> {args.out}")
    for row in bad.itertuples():
        print(f"incomplete communicator {row.logical_id}: {row.problem}", file=sys.stderr)
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from .campaign import expand_campaign, load_campaign

    for run in expand_campaign(load_campaign(args.config)):
        print(run.run_id if not args.verbose else json.dumps({"run": run.run_id, "backend": run.backend,
                                                              **run.settings}, default=str))
    return 0


def cmd_tables_doc(args: argparse.Namespace) -> int:
    from .tables import tables_markdown

    text = tables_markdown()
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nccltrace",
        description="Per-operation NCCL communication analysis: NCCL debug logs fused with Nsight Systems traces.",
    )
    p.add_argument("--version", action="version", version=f"nccltrace {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
                                   "launches, NVTX ranges and NCCL payloads, processes, session anchor.")
    s.add_argument("exports", nargs="+", help="SQLite export files")
    s.add_argument("-o", "--out", required=True, help="output directory (one subdirectory per export if several)")
    s.set_defaults(func=cmd_parse_nsys)

    s = sub.add_parser("emulate", help="emulate a Megatron-LM run: NCCL logs, nsys exports, ground truth",
                       description="Produce the raw outputs a real run would leave, from a run config YAML or "
                                   "from a run id of a campaign (--campaign).")
    s.add_argument("config", help="run config YAML, or a run id with --campaign")
    s.add_argument("-o", "--out", required=True, help="output directory (the run's raw/ directory)")
    s.add_argument("--campaign", help="campaign config YAML; CONFIG is then a run id of it")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_emulate)

    s = sub.add_parser("communicators", help="logical communicators and global ranks from init/split lines",
                       description="Group the init/split lines of parsed NCCL logs (one directory per process, or "
                                   "one for all) into logical communicators with member global ranks.")
    s.add_argument("parsed", nargs="+", help="directories written by `nccltrace parse-nccl`")
    s.add_argument("-o", "--out", required=True, help="output directory")
    s.set_defaults(func=cmd_communicators)

    s = sub.add_parser("runs", help="list the run ids a campaign config expands to",
                       description="Validate a campaign config against the schema and list its runs.")
    s.add_argument("config", help="campaign config YAML (e.g. config/config.yaml)")
    s.add_argument("-v", "--verbose", action="store_true", help="print every run's resolved settings as JSON")
    s.set_defaults(func=cmd_runs)

    s = sub.add_parser("tables-doc", help="print the documentation of every output table",
                       description="Render name, type, unit and meaning of every column of every table.")
    s.add_argument("-o", "--out", help="write to this file instead of stdout")
    s.set_defaults(func=cmd_tables_doc)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``nccltrace`` command."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError) as exc:
        # Bad input: a clear one-line message, no traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
