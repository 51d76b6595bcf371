"""The analysis stages, one module per workflow rule: the only implementation of each, called
by the workflow's rule scripts and by ``nccltrace analyze`` alike. A stage takes explicit input
paths (a :class:`~nccltrace.run_layout.RunLayout` and what the rule lists) and settings, writes
its outputs and manifest, and returns a :class:`StageResult`: what "partial" means and the
message of each problem are decided here, once, so the console, the manifest and the report
say the same."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["STAGES", "StageResult"]

STAGES = ("ops", "metrics", "volume", "trace", "report")
"""The stages ``nccltrace analyze`` can stop after (``--until``); parsing through the ops table
always runs."""


@dataclass
class StageResult:
    """What a stage did: its outputs, whether they are partial and why (``problems``, the
    manifest's reasons), what is worth saying without being a gap (``notes``), one line to
    print, and stage-specific values a caller may need (``details``)."""

    stage: str
    outputs: list[Path] = field(default_factory=list)
    partial: bool = False
    problems: list[str] = field(default_factory=list)
    summary: str = ""
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def echo(self) -> None:
        """Print the summary, notes and problems (a rule's log), and the problems once more on
        the real stderr, so Snakemake's console names them too, not only the job's log."""
        print(self.summary)
        for n in self.notes:
            print(f"NOTE: {n}")
        for p in self.problems:
            print(f"PARTIAL: {p}")
            if sys.stderr is not sys.__stderr__:
                print(f"PARTIAL: {p}", file=sys.__stderr__)
