"""Stage volume: theoretical vs observed communication volume per rank (thesis table 5.1 style)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from nccltrace.core.layout import RunLayout
from nccltrace.core.provenance import write_manifest
from nccltrace.metrics.volume import volume_validation_of_file, write_volume_validation
from nccltrace.stages import StageResult

if TYPE_CHECKING:  # annotations only: the settings code is not in this stage's code stamp
    from nccltrace.core.settings import RunSettings


def run_volume(layout: RunLayout, run_id: str, settings: RunSettings | Mapping[str, Any] | None,
               run_yaml: Path | None = None) -> StageResult:  # fmt: skip
    """Write the volume validation. The model is the run's own record (``run_yaml``) when it
    has one, else ``settings``. The record is read nested (its ``derived`` facts fill the
    configuration's nulls, as :func:`~nccltrace.core.settings.flatten_settings` with ``skip_none``
    does), so it is passed as recorded."""
    has_record = run_yaml is not None and run_yaml.is_file()
    model = yaml.safe_load(run_yaml.read_text()) if has_record else dict(settings or {})
    # the ops table is read in batches: memory holds one batch and the sums, not the run
    table = volume_validation_of_file(model, layout.ops, run=run_id)
    paths = write_volume_validation(table, layout.volume_dir)
    write_manifest(layout.manifest(layout.volume_dir), stage="volume",
                   inputs=[layout.ops, *([run_yaml] if has_record else [])], outputs=list(paths.values()),
                   config=model)  # fmt: skip
    return StageResult("volume", list(paths.values()), summary=f"{len(table)} rows")
