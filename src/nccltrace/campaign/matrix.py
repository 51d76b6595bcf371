"""Experiment campaigns: a matrix of run configurations expanded into stable, readable runs.

A campaign config (``config/config.yaml``, schema ``workflow/schemas/config.schema.yaml``)
names models and hardware profiles and lists matrix blocks; each block is the product
``models x hardware x parallelism x options``. Entries matching an ``exclude`` pattern are
dropped. Every run gets a readable id that depends only on its settings, e.g.
``dense_A100_tp4_pp1_ep1_cp1_vpp1_sp1_dp1`` (plus option tags such as ``_distopt``, and
``_cap3-4``/``_rk0-3`` for a step-window/rank-subset ``capture``, see :mod:`nccltrace.core.capture_window`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nccltrace.core.capture_window import (
    CaptureError,
    CaptureWindow,
    capture_run_id_tag,
)
from nccltrace.core.settings import RunSettings

PARALLEL_KEYS = ("tp", "pp", "ep", "cp", "vpp")
EMULATOR_PRESETS = ("a100", "a40", "h100")  # nccltrace.emulator.config.HARDWARE_PRESETS


class CampaignError(ValueError):
    """A campaign config that cannot be expanded; the message names the entry and field."""


@dataclass
class RunSpec:
    """One configuration of the matrix, fully resolved."""

    run_id: str
    backend: str  # 'emulate' | 'slurm' | 'import'
    settings: dict[str, Any]
    hardware: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return int(self.settings["nodes"]) * int(self.settings["gpus_per_node"])

    @property
    def hosts(self) -> list[str]:
        """Host names the emulator uses for this run (node000, node001, ...)."""
        return [f"node{i:03d}" for i in range(int(self.settings["nodes"]))]

    @property
    def analysis_settings(self) -> dict[str, Any]:
        """The settings the analysis reads, with the parallel sizes made explicit where the
        campaign launches the run (emulated or trained): a size the matrix leaves out is
        Megatron's default (1), a declaration as good as any, so labels are matched to the
        run's groups instead of guessed, and so is its rank order. An imported run declares only
        what its entry says."""
        if self.backend == "import":
            return dict(self.settings)
        from nccltrace.megatron.rank_structure import ORDER_SETTING

        # likewise the rank order: Megatron's default unless the run passes --use-tp-pp-dp-mapping
        mapping = "--use-tp-pp-dp-mapping" in (self.settings.get("megatron_args") or [])
        return {**{k: 1 for k in ("tp", "pp", "cp", "ep")}, ORDER_SETTING: mapping, **self.settings}

    @property
    def run_settings(self) -> RunSettings:
        """The typed settings the analysis of this run reads (:attr:`analysis_settings`, validated:
        raises :class:`~nccltrace.core.errors.ConfigError` naming the setting)."""
        return RunSettings.from_mapping(self.analysis_settings)

    def config_hash(self) -> str:
        blob = json.dumps({"settings": self.settings, "hardware": self.hardware, "backend": self.backend},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _option_tags(s: dict[str, Any]) -> str:
    tags = []
    if s.get("distributed_optimizer"):
        tags.append("distopt")
    if s.get("num_experts"):
        tags.append({"alltoall": "a2a", "allgather": "ag"}.get(s.get("moe_token_dispatcher", "alltoall"), "a2a"))
    if s.get("recompute", "none") not in ("none", None, False):
        tags.append(f"rc{s['recompute']}")
    return "".join(f"_{t}" for t in tags) + capture_run_id_tag(s.get("capture"))


def run_id_for(model: str, gpu: str, s: dict[str, Any]) -> str:
    """Readable, stable run id from the settings that define a configuration."""
    world = int(s["nodes"]) * int(s["gpus_per_node"])
    tp, pp, cp = int(s.get("tp", 1)), int(s.get("pp", 1)), int(s.get("cp", 1))
    dp = world // max(tp * pp * cp, 1)
    sp = 1 if s.get("sequence_parallel") else 0
    nodes = int(s["nodes"])
    node_tag = f"_n{nodes}" if nodes > 1 else ""
    return (
        f"{model}_{gpu}{node_tag}_tp{tp}_pp{pp}_ep{int(s.get('ep', 1))}_cp{cp}_vpp{int(s.get('vpp', 1))}"
        f"_sp{sp}_dp{dp}{_option_tags(s)}"
    )


def _matches(pattern: dict[str, Any], entry: dict[str, Any]) -> bool:
    return all(entry.get(k) == v for k, v in pattern.items())


def _normalise_capture(settings: dict[str, Any]) -> None:
    """Explicit steps and ranks in a valid ``capture`` (what run.yaml records and later stages
    read); an invalid one is left for :func:`run_problems` to report with the others."""
    if settings.get("capture") is None:
        settings.pop("capture", None)
        return
    try:
        window = CaptureWindow.of_settings(settings)
    except CaptureError:
        return
    if window is not None:
        settings["capture"] = window.to_setting()


def expand_campaign(config: dict[str, Any]) -> list[RunSpec]:
    """Expand the matrix blocks of a (schema-validated) campaign config into runs."""
    models = config.get("models", {})
    hardware = config.get("hardware", {})
    defaults = dict(config.get("defaults", {}))
    runs: dict[str, RunSpec] = {}
    for b, block in enumerate(config.get("matrix", [])):
        for key, table in (("models", models), ("hardware", hardware)):
            for name in block.get(key, []):
                if name not in table:
                    raise CampaignError(
                        f"matrix[{b}].{key}: '{name}' is not defined under '{key}:' (defined: {sorted(table)})"
                    )
        combos = itertools.product(
            block["models"], block["hardware"], block.get("parallelism", [{}]), block.get("options", [{}])
        )
        for model, hw_name, par, opt in combos:
            hw = dict(hardware[hw_name])
            settings = {**defaults, **models[model], **par, **opt}
            # Like backend: the entry's own capture, then the matrix block's, then the defaults'.
            if "capture" in block and not any("capture" in d for d in (opt, par, models[model])):
                settings["capture"] = block["capture"]
            settings["model"] = model
            settings.setdefault("nodes", hw.get("nodes", 1))
            settings.setdefault("gpus_per_node", hw.get("gpus_per_node", 1))
            settings["nodes"] = hw.get("nodes", settings["nodes"])
            settings["gpus_per_node"] = hw.get("gpus_per_node", settings["gpus_per_node"])
            if "dp" in settings:
                # dp is implied by world size and tp*pp*cp; an explicit value must agree.
                world = settings["nodes"] * settings["gpus_per_node"]
                mp = settings.get("tp", 1) * settings.get("pp", 1) * settings.get("cp", 1)
                if world % mp or world // mp != settings["dp"]:
                    raise CampaignError(
                        f"matrix[{b}] {model}/{hw_name} {par}: dp={settings['dp']} does not match world size {world} "
                        f"/ (tp*pp*cp={mp}); drop 'dp' or fix the sizes"
                    )
                settings.pop("dp")
            _normalise_capture(settings)
            entry = {"model": model, "hardware": hw_name, **settings}
            if any(_matches(p, entry) for p in config.get("exclude", [])):
                continue
            rid = run_id_for(model, hw.get("gpu", hw_name), settings)
            # Precedence: the entry's own settings, then the matrix block, then the defaults.
            explicit = next((d["backend"] for d in (opt, par, models[model]) if "backend" in d), None)
            backend = explicit or block.get("backend") or settings.get("backend") or "emulate"
            settings.pop("backend", None)
            if backend == "emulate":
                preset = hw.get("preset") or str(hw.get("gpu", "")).lower()
                if preset not in EMULATOR_PRESETS:
                    raise CampaignError(
                        f"hardware '{hw_name}': the emulator has no node model for gpu '{hw.get('gpu')}'; "
                        f"set 'preset' to one of {', '.join(EMULATOR_PRESETS)}"
                    )
                settings["hardware"] = preset
            if rid in runs:
                raise CampaignError(f"matrix[{b}]: run id '{rid}' produced twice; two entries describe the same run")
            runs[rid] = RunSpec(rid, backend, settings, {"name": hw_name, **hw})
    if not runs:
        raise CampaignError("the campaign matrix expands to no runs (check 'matrix' and 'exclude')")
    return list(runs.values())


def run_problems(spec: RunSpec) -> list[str]:
    """Why a run cannot work, checked before anything is queued: Megatron-LM's own constraints
    (divisibility of world size, experts, layers per virtual stage, batch sizes; SP without TP;
    MoE without bf16) for every backend, and the emulator's full validation for emulated runs."""
    from nccltrace.acquisition.megatron import launch_problems

    problems = launch_problems(spec.settings)
    if not problems:  # what Megatron's rules leave: a value the analysis cannot read, named before any job
        try:
            spec.run_settings  # noqa: B018
        except ValueError as exc:
            problems.append(str(exc))
    if spec.backend == "emulate" and not problems:
        from nccltrace.emulator.config import ConfigError, EmulatorConfig

        try:
            EmulatorConfig.from_dict({k: v for k, v in spec.settings.items() if k not in ("env", "megatron_args")})
        except ConfigError as exc:
            problems.append(str(exc))
    if spec.backend == "import" and not spec.settings.get("import_dir"):
        problems.append("import_dir: backend 'import' needs import_dir (the directory with the run's logs and exports)")
    return problems


def validate_runs(runs: list[RunSpec]) -> None:
    """Raise :class:`CampaignError` listing every run that cannot work (all of them, not the first)."""
    lines = [f"{spec.run_id}: {problem}" for spec in runs for problem in run_problems(spec)]
    if lines:
        raise CampaignError(f"{len(lines)} problem(s) in the campaign; nothing was started:\n  " + "\n  ".join(lines))


def load_campaign(path: Path | str) -> dict[str, Any]:
    """Read a campaign YAML file and validate it against the workflow's JSON schema."""
    import jsonschema

    path = Path(path)
    config = yaml.safe_load(path.read_text())
    schema_path = Path(__file__).resolve().parent / "config.schema.yaml"
    schema = yaml.safe_load(schema_path.read_text())
    try:
        jsonschema.validate(config, schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "<top level>"
        raise CampaignError(f"{path}: field '{where}': {exc.message}") from None
    return config
