"""Shared start-up for rule scripts: package import path and log redirection."""

import sys
from pathlib import Path


def setup(snakemake) -> None:
    """Send this job's stdout/stderr to its log file and make the repo's package importable."""
    src = Path(snakemake.scriptdir).resolve().parents[1] / "src"
    if src.is_dir():
        # First, even when already listed: Snakemake's script preamble appends the head's
        # sys.path, behind any installed nccltrace, whose code would otherwise run instead of
        # this checkout's (the code the rule's code-hash params describe).
        while str(src) in sys.path:
            sys.path.remove(str(src))
        sys.path.insert(0, str(src))
    log = open(snakemake.log[0], "w", buffering=1)
    sys.stdout = sys.stderr = log
    from nccltrace.core.errors import console_warnings

    console_warnings()
