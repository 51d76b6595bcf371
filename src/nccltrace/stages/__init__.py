"""The analysis stages, one module per workflow rule: the only implementation of each, called
by the workflow's rule scripts and by ``nccltrace analyze`` alike.

A stage takes explicit input paths (a :class:`~nccltrace.core.layout.RunLayout` and what the rule
lists) and settings, writes its outputs and manifest, and returns a :class:`StageResult`: what
"partial" means and each problem's message are decided here, once, so the console, the manifest
and the report say the same. The per-process stages run in per-node jobs (:func:`each_process`).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["STAGES", "NodeStageError", "StageResult", "each_process"]

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


class NodeStageError(RuntimeError):
    """A per-node job's stage raised for some of the node's processes (``failures``: unit ->
    exception). The others were done; the message names every unit that failed."""

    def __init__(self, stage: str, host: str, failures: dict[str, BaseException], done: int) -> None:
        self.stage, self.host, self.failures = stage, host, failures
        units = len(failures) + done
        what = "; ".join(f"{u}: {type(e).__name__}: {e}" for u, e in failures.items())
        super().__init__(f"{stage} of node {host}: {len(failures)} of {units} failed ({what}). The other "
                         f"{done} were done, but the node's results are incomplete: the workflow removes the "
                         "outputs of a failed job; fix the cause and run again")

    @property
    def bad_input(self) -> bool:
        """Every failure is an input the stage refused (``ValueError``/``FileNotFoundError``)."""
        return all(isinstance(e, (ValueError, FileNotFoundError)) for e in self.failures.values())


def each_process(stage: str, host: str, units: Iterable[str], run_one: Callable[[str], StageResult],
                 done: Callable[[str], None] | None = None) -> StageResult:  # fmt: skip
    """Run ``run_one(unit)`` for each of node ``host``'s units (its processes, and its export),
    one after another in this interpreter, and combine their results into one of ``stage``.
    A damaged input is partial, as the unit's stage decides; a unit whose stage raises does not
    stop the others: its traceback goes to the job's log and, once every unit has run,
    :class:`NodeStageError` names each failed unit (the first exception as its cause).
    ``done(unit)`` is called after each unit (progress)."""
    import gc

    results: dict[str, StageResult] = {}
    failures: dict[str, BaseException] = {}
    for unit in units:
        try:
            results[unit] = run_one(unit)
        except Exception as exc:  # noqa: BLE001 - collected, named and raised below
            failures[unit] = exc
            print(f"FAILED: {stage} of node {host}: {unit}: {type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stdout)
            if sys.stderr is not sys.__stderr__:
                print(f"FAILED: {stage} of node {host}: {unit}: {type(exc).__name__}: {exc}", file=sys.__stderr__)
        # one unit's memory is returned before the next starts: the job's peak is its largest unit's
        gc.collect()
        _release_memory()
        if done is not None:
            done(unit)
    combined = StageResult(stage)
    for unit, r in results.items():
        combined.outputs += r.outputs
        combined.partial |= r.partial
        combined.problems += [p for p in r.problems if p not in combined.problems]
        combined.notes += [n for n in r.notes if n not in combined.notes]
        combined.details[unit] = r
    combined.summary = "\n".join(f"{unit}: {r.summary}" for unit, r in results.items()) or f"node {host}: nothing to do"
    if failures:
        combined.echo()  # what was done, before the error says what was not
        raise NodeStageError(stage, host, failures, len(results)) from next(iter(failures.values()))
    return combined


def _release_memory() -> None:
    """Return freed memory to the system: Arrow's pool (its allocator keeps freed pages for
    reuse) and the C heap (glibc keeps it for the next allocation). Without this, each of a
    node's processes left more resident than the last (measured: ``docs/benchmarks.md``,
    "Memory per job")."""
    pa = sys.modules.get("pyarrow")
    if pa is not None:
        pa.default_memory_pool().release_unused()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
