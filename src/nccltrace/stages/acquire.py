"""Stage acquire: a run's immutable ``raw/`` directory, by backend.

``emulate`` runs the workload emulator, ``import`` brings in the logs and exports of a run made
elsewhere (``import_dir``), ``slurm`` assembles the directory from a training capture and its
exports. Every backend leaves the same tree (:mod:`nccltrace.acquisition.raw`) with a
``status.json`` and a manifest. A failed import is recorded, not raised: the campaign's other
runs go on and its report names this one with the reason. The only stage that imports the
emulator (its ``emulate`` backend).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nccltrace.acquisition.status import read_status
from nccltrace.core.provenance import write_manifest
from nccltrace.stages import StageResult

__all__ = ["BACKENDS", "run_acquire"]

BACKENDS = ("emulate", "slurm", "import")


def _emulate(raw: Path, run_id: str, settings: Mapping[str, Any], workers: int, emulator_code: str | None) -> str:
    """Emulate the run into ``raw``; returns the line the rule's log gets."""
    import os
    import shutil

    import yaml

    from nccltrace.acquisition.status import write_status
    from nccltrace.emulator.run import emulate_run

    # Built in a sibling directory and renamed: an interrupted emulation never leaves a raw/ behind.
    tmp = raw.with_name(raw.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    result = emulate_run({k: v for k, v in settings.items() if k not in ("env", "megatron_args")}, tmp,
                         progress=True, workers=workers)
    # the run's id is the campaign's (as the other backends record it), so that `nccltrace
    # analyze` on this raw directory names the run as the workflow does
    record = yaml.safe_load((tmp / "run.yaml").read_text())
    record["emulator_run_id"], record["run_id"] = record.get("run_id"), run_id
    (tmp / "run.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    write_status(tmp, "ok")
    # the emulator's own code hash: raw data is never re-made by a code change, so the workflow
    # names the runs an older emulator made (common.smk)
    write_manifest(tmp / "manifest.json", stage="acquire:emulate", inputs=[], outputs=[tmp], config=dict(settings),
                   extra={"run": run_id, "emulator_code": emulator_code})
    os.replace(tmp, raw)
    return (f"emulated {run_id}: {result.n_ranks} ranks, {result.n_ops:,} ops, {result.n_kernels:,} kernels, "
            f"{len(result.nsys_files)} node exports")


def _import(raw: Path, run_id: str, settings: Mapping[str, Any], nsys: str) -> None:
    """Import ``settings['import_dir']`` into ``raw``, or record why it cannot be imported."""
    from nccltrace.acquisition.raw import (
        RawImportError,
        import_raw,
        record_failed_import,
    )

    try:
        record = import_raw(settings["import_dir"], raw, run_id=run_id, settings=settings, nsys=nsys)
    except RawImportError as e:
        # Recorded like a failed training: the other runs go on and the campaign report lists
        # this one with the reason. raw/ exists now, so a fixed import_dir needs it deleted.
        reason = f"{e} (then delete {raw} and re-run snakemake)"
        record_failed_import(raw, run_id=run_id, settings=settings, reason=reason)
        print(f"FAILED: run {run_id}: import failed: {reason}", file=sys.__stderr__)
        print(f"import failed: {reason}")
    else:
        print(f"imported {run_id}: {record['processes']} processes, exports of {record['exports']}")
        for w in record["warnings"]:
            print(f"WARNING: run {run_id}: {w}", file=sys.__stderr__)
            print(w)


def _slurm(raw: Path, run_id: str, settings: Mapping[str, Any], capture: Path | str, exports: Sequence[Path | str]
           ) -> None:  # fmt: skip
    """Assemble ``raw`` from a SLURM training capture and its nsys exports."""
    from nccltrace.acquisition.raw import assemble_raw

    launch = assemble_raw(capture, list(exports), raw, run_id=run_id, settings=settings)
    print(f"assembled {run_id}: training {launch['status']}" + (f" ({launch['reason']})" if launch.get("reason")
                                                                 else ""))  # fmt: skip


def run_acquire(raw: Path | str, run_id: str, backend: str, settings: Mapping[str, Any], *, nsys: str = "nsys",
                capture: Path | str | None = None, exports: Sequence[Path | str] = (), workers: int = 1,
                emulator_code: str | None = None) -> StageResult:  # fmt: skip
    """Make run ``run_id``'s ``raw`` directory with ``backend`` (one of :data:`BACKENDS`):
    ``emulate`` (``workers`` processes), ``import`` (``settings['import_dir']``, exports made
    with ``nsys`` where only reports are given) or ``slurm`` (``capture`` and its ``exports``).
    ``emulator_code``: the emulator's code stamp, recorded in an emulated run's manifest (the
    workflow's code stamps sit above the stages: the caller computes it).
    Prints what it did (the rule's log; failures and warnings on the console too) and returns
    the run's acquisition status as the result (partial when the status is not ``ok``)."""
    raw, settings = Path(raw), dict(settings)
    inputs: list[Path | str] = []
    summary = ""
    if backend == "emulate":
        summary = _emulate(raw, run_id, settings, workers, emulator_code)
        print(summary)
    elif backend == "import":
        inputs = [settings["import_dir"]]
        _import(raw, run_id, settings, nsys)
    elif backend == "slurm":
        if capture is None:
            raise ValueError(f"run {run_id}: the slurm backend needs the training capture")
        inputs = [capture, *exports]
        _slurm(raw, run_id, settings, capture, exports)
    else:
        raise SystemExit(f"run {run_id}: unknown backend {backend!r} (emulate, slurm or import)")
    status = read_status(raw)
    reasons = [str(status["reason"])] if status.get("reason") else []
    if backend != "emulate":  # the emulate backend wrote its manifest before the rename
        write_manifest(raw / "manifest.json", stage=f"acquire:{backend}", inputs=inputs, outputs=[raw],
                       config=settings, partial=status["status"] != "ok", reasons=reasons,
                       extra={"run": run_id, "status": status})
    return StageResult("acquire", [raw], status["status"] != "ok", reasons, summary, details={"status": status})
