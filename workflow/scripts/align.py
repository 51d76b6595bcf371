"""Rule align: correlate one process's NCCL call lines with its kernels (nccltrace.stages.align)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.capture import CaptureWindow  # noqa: E402
from nccltrace.run_layout import RunLayout  # noqa: E402
from nccltrace.stages.align import run_align  # noqa: E402

sm = snakemake  # noqa: F821
window = CaptureWindow.of_settings(dict(sm.params.settings))
run_align(RunLayout(Path(sm.output.alignment).parents[2]), sm.wildcards.proc, sm.params.host, mode=sm.params.mode,
          nccl_version=sm.params.nccl_version, capture_steps=window.loop_indices if window else None).echo()
