"""Rule acquire: a run's immutable raw/ directory, by backend (emulate, import, slurm)."""

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.acquisition.raw import assemble_raw, import_raw, read_status, write_status  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402

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
    write_status(tmp, "ok")
    write_manifest(tmp / "manifest.json", stage="acquire:emulate", inputs=[], outputs=[tmp], config=settings,
                   extra={"run": run})
    os.replace(tmp, raw)
    print(f"emulated {run}: {result}")
elif backend == "import":
    record = import_raw(settings["import_dir"], raw, run_id=run, settings=settings, nsys=sm.params.nsys)
    inputs = [settings["import_dir"]]
    print(f"imported {run}: {record['processes']} processes, exports of {record['exports']}")
elif backend == "slurm":
    inputs = [sm.input.capture, *sm.input.exports]
    launch = assemble_raw(sm.input.capture, list(sm.input.exports), raw, run_id=run, settings=settings)
    print(f"assembled {run}: training {launch['status']}" + (f" ({launch['reason']})" if launch.get("reason") else ""))
else:
    raise SystemExit(f"run {run}: unknown backend {backend!r} (emulate, slurm or import)")
if backend != "emulate":
    status = read_status(raw)
    write_manifest(raw / "manifest.json", stage=f"acquire:{backend}", inputs=inputs, outputs=[raw], config=settings,
                   partial=status["status"] != "ok", extra={"run": run, "status": status})
