"""What the analysis stages need to know of acquisition without its code: a raw directory's
acquisition status (``status.json``), and how the front end in use tells a user to supply a
missing input. Light (no readers, no import or export code), so that the parse, summary and
campaign-report stages do not carry acquisition into their code stamps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ANALYZE_REMEDY",
    "CAPTURE_HINT",
    "REDO_HINT",
    "WORKFLOW_REMEDY",
    "Remedy",
    "export_hint",
    "missing_export_problem",
    "read_status",
    "write_status",
]


def write_status(raw: Path, status: str, reason: str | None = None, **extra: Any) -> None:
    """Record how a raw directory's acquisition ended (``ok`` or ``failed``, why, what else the
    backend found) in its ``status.json``: later stages decide from it what to analyse."""
    (raw / "status.json").write_text(json.dumps({"status": status, "reason": reason, **extra}, indent=2))


def read_status(raw: Path | str) -> dict[str, Any]:
    """The acquisition status of a raw directory; runs made before status files existed are ok."""
    p = Path(raw) / "status.json"
    if not p.is_file():
        return {"status": "ok", "reason": None}
    return json.loads(p.read_text())


CAPTURE_HINT = ("profile the ranks with nsys (`nsys profile --trace=cuda,nvtx`, one report per node or per process, "
                "exported with `nsys export --type sqlite`) or with torch.profiler (activities CPU and CUDA; one "
                "Chrome trace per rank, e.g. tensorboard_trace_handler or Megatron --use-pytorch-profiler) and put "
                "the files beside the logs")
"""How to capture kernel times, said wherever a run has none."""

REDO_HINT = "then delete this run's raw/ directory and re-run snakemake"


@dataclass(frozen=True)
class Remedy:
    """How the front end in use tells a user to supply a missing input and redo the analysis:
    the workflow re-imports a run's raw/ directory, ``nccltrace analyze`` reads a directory."""

    inputs_dir: str
    redo: str


WORKFLOW_REMEDY = Remedy("the run's import_dir (or raw/nsys/)", REDO_HINT)
ANALYZE_REMEDY = Remedy("the input directory beside the logs", "then run `nccltrace analyze` again")


def export_hint(host: str, remedy: Remedy = WORKFLOW_REMEDY) -> str:
    """What to do about a node whose export is missing or unusable."""
    return (f"re-create it with `nsys export --type sqlite --output {host}.sqlite {host}.nsys-rep` (profile with "
            f"`nsys profile --trace=cuda,nvtx`), put it in {remedy.inputs_dir}, {remedy.redo}")


def missing_export_problem(host: str, remedy: Remedy = WORKFLOW_REMEDY) -> str:
    """The message of a node that has NCCL logs but no export (one text wherever said). ``nccltrace
    analyze`` also reads PyTorch-profiler traces, so its message names both kinds of kernel trace."""
    if remedy == ANALYZE_REMEDY:
        return (f"node {host}: no kernel trace for its rank log(s) (no nsys export {host}.sqlite, no PyTorch-profiler "
                f"trace of its processes): the calls of its ranks have no kernel times (reason 'no_export'); to get "
                f"them, {CAPTURE_HINT}, then run `nccltrace analyze` again")
    return (f"node {host}: no nsys export ({host}.sqlite) for its rank log(s): the calls of its ranks have no "
            f"kernel times (reason 'no_export'); {export_hint(host, remedy)}")
