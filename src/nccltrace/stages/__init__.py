"""The analysis stages after the ops table, one module each: the only implementation of each,
called by the workflow's rule scripts and by ``nccltrace analyze`` alike. A stage takes its
input paths (a :class:`~nccltrace.run_layout.RunLayout` and what the rule lists), writes its
outputs and manifest, and returns a :class:`StageResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["STAGES", "StageResult"]

STAGES = ("ops", "metrics", "volume", "trace", "report")
"""The stages ``nccltrace analyze`` can stop after (``--until``); parsing through the ops table
always runs."""


@dataclass
class StageResult:
    """What a stage did: its outputs, whether they are partial and why, one line to print."""

    stage: str
    outputs: list[Path] = field(default_factory=list)
    partial: bool = False
    problems: list[str] = field(default_factory=list)
    summary: str = ""
