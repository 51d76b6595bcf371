"""Rule acquire (backend emulate): run the workload emulator into the run's raw/ directory."""

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.emulator.run import emulate_run  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402

raw = Path(snakemake.output.raw)  # noqa: F821
settings = dict(snakemake.params.settings)  # noqa: F821
backend = settings.pop("backend", "emulate")
if backend != "emulate":
    raise SystemExit(f"run {snakemake.wildcards.run}: backend '{backend}' is not available in this workflow yet")  # noqa: F821
# Build in a sibling directory and rename: an interrupted emulation never leaves a raw/ behind.
tmp = raw.with_name(raw.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)
result = emulate_run(settings, tmp)
write_manifest(tmp / "manifest.json", stage="acquire:emulate", inputs=[], outputs=[tmp], config=settings,
               extra={"run": snakemake.wildcards.run})  # noqa: F821
os.replace(tmp, raw)
print(f"emulated {snakemake.wildcards.run}: {result}")  # noqa: F821
