"""Shared start-up for rule scripts: package import path and log redirection."""

import sys
from pathlib import Path


def setup(snakemake) -> None:
    """Send this job's stdout/stderr to its log file and make the repo's package importable."""
    src = Path(snakemake.scriptdir).resolve().parents[1] / "src"
    if src.is_dir() and str(src) not in sys.path:
        sys.path.insert(0, str(src))
    log = open(snakemake.log[0], "w", buffering=1)
    sys.stdout = sys.stderr = log
