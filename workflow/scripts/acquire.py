"""Rule acquire: a run's immutable raw/ directory, by backend (emulate, import, slurm)."""

import os
import shutil
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.acquisition.raw import (  # noqa: E402
    RawImportError,
    assemble_raw,
    import_raw,
    record_failed_import,
)
from nccltrace.acquisition.status import read_status, write_status  # noqa: E402
from nccltrace.campaign.code_stamps import stage_code_hash  # noqa: E402
from nccltrace.core.provenance import write_manifest  # noqa: E402

sm = snakemake  # noqa: F821
run = sm.wildcards.run
raw = Path(sm.output.raw)
settings = dict(sm.params.settings)
backend = sm.params.backend
inputs: list = []
if backend == "emulate":
    from nccltrace.emulator.run import emulate_run

    # Built in a sibling directory and renamed: an interrupted emulation never leaves a raw/ behind.
    tmp = raw.with_name(raw.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    result = emulate_run({k: v for k, v in settings.items() if k not in ("env", "megatron_args")}, tmp,
                         progress=True, workers=sm.threads)
    # the run's id is the campaign's (as the other backends record it), so that `nccltrace
    # analyze` on this raw directory names the run as the workflow does
    record = yaml.safe_load((tmp / "run.yaml").read_text())
    record["emulator_run_id"], record["run_id"] = record.get("run_id"), run
    (tmp / "run.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    write_status(tmp, "ok")
    # the emulator's own code hash: raw data is never re-made by a code change, so the workflow
    # names the runs an older emulator made (common.smk)
    write_manifest(tmp / "manifest.json", stage="acquire:emulate", inputs=[], outputs=[tmp], config=settings,
                   extra={"run": run, "emulator_code": stage_code_hash("emulate")})
    os.replace(tmp, raw)
    print(f"emulated {run}: {result.n_ranks} ranks, {result.n_ops:,} ops, {result.n_kernels:,} kernels, "
          f"{len(result.nsys_files)} node exports")
elif backend == "import":
    inputs = [settings["import_dir"]]
    try:
        record = import_raw(settings["import_dir"], raw, run_id=run, settings=settings, nsys=sm.params.nsys)
    except RawImportError as e:
        # Recorded like a failed training: the other runs go on and the campaign report lists
        # this one with the reason. raw/ exists now, so a fixed import_dir needs it deleted.
        reason = f"{e} (then delete {raw} and re-run snakemake)"
        record_failed_import(raw, run_id=run, settings=settings, reason=reason)
        print(f"FAILED: run {run}: import failed: {reason}", file=sys.__stderr__)
        print(f"import failed: {reason}")
    else:
        print(f"imported {run}: {record['processes']} processes, exports of {record['exports']}")
        for w in record["warnings"]:
            print(f"WARNING: run {run}: {w}", file=sys.__stderr__)
            print(w)
elif backend == "slurm":
    inputs = [sm.input.capture, *sm.input.exports]
    launch = assemble_raw(sm.input.capture, list(sm.input.exports), raw, run_id=run, settings=settings)
    print(f"assembled {run}: training {launch['status']}" + (f" ({launch['reason']})" if launch.get("reason") else ""))
else:
    raise SystemExit(f"run {run}: unknown backend {backend!r} (emulate, slurm or import)")
if backend != "emulate":
    status = read_status(raw)
    write_manifest(raw / "manifest.json", stage=f"acquire:{backend}", inputs=inputs, outputs=[raw], config=settings,
                   partial=status["status"] != "ok", reasons=[str(status["reason"])] if status.get("reason") else [],
                   extra={"run": run, "status": status})
