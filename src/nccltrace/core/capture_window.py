"""Step-window and rank-subset captures: the one definition of the ``capture`` run setting.

Users profile a few training steps on a few ranks (Megatron's ``--profile`` arguments around
``nsys profile --capture-range=cudaProfilerApi``) while the NCCL log covers the whole run, so the
config checks, the Megatron arguments, the launch script and the emulator must agree on which
steps and ranks a capture holds. ``steps: [first, last]`` are Megatron's logged (1-based)
iteration numbers, both inclusive. How they map to Megatron's arguments: ``docs/emulator.md``
and the module notes there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CaptureError",
    "CaptureWindow",
    "NSYS_CAPTURE_RANGE_ARGS",
    "PRE_WINDOW_METADATA",
    "capture_problems",
    "capture_run_id_tag",
]

# What `nsys profile` needs to record only between cudaProfilerStart and cudaProfilerStop.
NSYS_CAPTURE_RANGE_ARGS: tuple[str, ...] = ("--capture-range=cudaProfilerApi", "--capture-range-end=stop")
# Emulator: what becomes of NVTX metadata registered before the window (docs/emulator.md §3.1).
PRE_WINDOW_METADATA: tuple[str, ...] = ("kept", "dropped")
_KEYS = ("steps", "ranks", "pre_window_metadata")
_FORM = "give capture: {steps: [first, last], ranks: all | [global ranks]}"


class CaptureError(ValueError):
    """An invalid ``capture`` setting. ``field`` names the key, ``message`` says how to fix it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def capture_problems(value: Any, *, iterations: int, world_size: int) -> list[tuple[str, str]]:
    """Every problem of a ``capture`` setting as ``(field, "what is wrong; what to do")``;
    empty when it is valid (or absent) for a run of ``iterations`` steps on ``world_size`` ranks."""
    if value is None:
        return []
    if isinstance(value, CaptureWindow):
        value = value.to_setting()
    if not isinstance(value, Mapping):
        return [("capture", f"expected a mapping, got {value!r}; {_FORM}")]
    out: list[tuple[str, str]] = []
    for key in value:
        if key not in _KEYS:
            out.append((f"capture.{key}", f"unknown key; use {', '.join(_KEYS)}"))
    steps = value.get("steps")
    if steps is not None:
        if not (isinstance(steps, Sequence) and not isinstance(steps, str) and len(steps) == 2
                and all(_is_int(s) for s in steps)):  # fmt: skip
            out.append(("capture.steps", f"expected [first, last] (two iteration numbers), got {steps!r}"))
        else:
            first, last = steps
            if first < 1:
                out.append(("capture.steps", f"first step {first} is before the first iteration; "
                                             f"iterations are numbered 1..{iterations} as Megatron logs them"))
            elif first > last:
                out.append(("capture.steps", f"first step {first} is after the last {last}; give [first, last] "
                                             "with first <= last"))
            elif last > iterations:
                out.append(("capture.steps", f"last step {last} is beyond the run's {iterations} iterations; "
                                             f"use steps within 1..{iterations} or raise 'iterations'"))
    ranks = value.get("ranks", "all")
    if ranks != "all":
        if not (isinstance(ranks, Sequence) and not isinstance(ranks, str) and ranks
                and all(_is_int(r) for r in ranks)):  # fmt: skip
            out.append(("capture.ranks", f"expected 'all' or a non-empty list of global ranks, got {ranks!r}"))
        else:
            bad = sorted({r for r in ranks if not 0 <= r < world_size})
            if bad:
                out.append(("capture.ranks", f"ranks {bad} are outside the run's {world_size} ranks "
                                             f"(0..{world_size - 1}); drop them or change the hardware profile"))
            if len(set(ranks)) != len(ranks):
                out.append(("capture.ranks", "lists a rank twice; give each rank once"))
    mode = value.get("pre_window_metadata", "kept")
    if mode not in PRE_WINDOW_METADATA:
        out.append(("capture.pre_window_metadata", f"{mode!r} is not one of {list(PRE_WINDOW_METADATA)}"))
    return out


@dataclass(frozen=True)
class CaptureWindow:
    """A resolved ``capture`` setting (see the module docstring for the step semantics).

    ``first``/``last``: Megatron's logged, 1-based iteration numbers, both captured. ``ranks``:
    the profiled global ranks, or None for all. ``pre_window_metadata``: emulator option.
    """

    first: int
    last: int
    ranks: tuple[int, ...] | None = None
    pre_window_metadata: str = "kept"

    @classmethod
    def from_setting(cls, value: Any, *, iterations: int, world_size: int) -> CaptureWindow | None:
        """The window a ``capture`` setting describes (None when absent); raises
        :class:`CaptureError` for the first problem :func:`capture_problems` finds."""
        if value is None:
            return None
        if isinstance(value, CaptureWindow):
            value = value.to_setting()
        problems = capture_problems(value, iterations=iterations, world_size=world_size)
        if problems:
            raise CaptureError(*problems[0])
        first, last = value.get("steps") or (1, iterations)
        ranks = value.get("ranks", "all")
        return cls(int(first), int(last), None if ranks == "all" else tuple(sorted(int(r) for r in ranks)),
                   value.get("pre_window_metadata", "kept"))  # fmt: skip

    @classmethod
    def of_settings(cls, settings: Mapping[str, Any]) -> CaptureWindow | None:
        """The window of a run's settings (flat or run.yaml ``config``); None = whole run profiled."""
        value = settings.get("capture")
        if value is None:
            return None
        world = int(settings.get("nodes", 1)) * int(settings.get("gpus_per_node", 1))
        return cls.from_setting(value, iterations=int(settings.get("iterations", 10)), world_size=world)

    def to_setting(self) -> dict[str, Any]:
        """The normalised run setting (explicit steps and ranks), as written to run.yaml."""
        return {"steps": [self.first, self.last], "ranks": "all" if self.ranks is None else list(self.ranks),
                "pre_window_metadata": self.pre_window_metadata}  # fmt: skip

    @property
    def steps(self) -> range:
        """The captured logged (1-based) iteration numbers."""
        return range(self.first, self.last + 1)

    def contains_step(self, step: int) -> bool:
        """Whether the step Megatron logs as ``iteration <step>`` (1-based) is captured."""
        return self.first <= step <= self.last

    def contains_iteration(self, index: int) -> bool:
        """Whether the step with 0-based loop index ``index`` (Megatron's ``iteration`` before the
        step; the emulator's ``iteration`` column: -1 = initialisation, N = shutdown) is captured."""
        return self.first - 1 <= index <= self.last - 1

    @property
    def loop_indices(self) -> tuple[int, int]:
        """First and last captured step as 0-based loop indices (both inclusive): the step
        numbering of a log's periodic step structure (``align.window``)."""
        return self.first - 1, self.last - 1

    def profiles(self, rank: int) -> bool:
        """Whether global rank ``rank`` calls cudaProfilerStart (is in ``--profile-ranks``)."""
        return self.ranks is None or rank in self.ranks

    def profiled_ranks(self, world_size: int) -> list[int]:
        """The profiled global ranks of a run with ``world_size`` ranks."""
        return list(range(world_size)) if self.ranks is None else [r for r in self.ranks if r < world_size]

    def profiled_nodes(self, world_size: int, gpus_per_node: int) -> list[int]:
        """Nodes with at least one profiled rank (torchrun: global rank = node * gpus + local).
        Only they leave an nsys report: a process that never calls cudaProfilerStart records nothing."""
        return sorted({r // gpus_per_node for r in self.profiled_ranks(world_size)})

    def megatron_arguments(self, world_size: int) -> list[str]:
        """``pretrain_gpt.py`` arguments that make Megatron-LM start and stop the profiler."""
        return ["--profile", "--profile-step-start", str(self.first - 1), "--profile-step-end", str(self.last),
                "--profile-ranks", *[str(r) for r in self.profiled_ranks(world_size)]]  # fmt: skip

    @staticmethod
    def setting_from_megatron(start: int, end: int, ranks: Sequence[int]) -> dict[str, Any]:
        """The ``capture`` setting that ``--profile-step-start start --profile-step-end end
        --profile-ranks ranks`` describes (inverse of :meth:`megatron_arguments`)."""
        return {"steps": [int(start) + 1, int(end)], "ranks": sorted(int(r) for r in ranks)}


def _compact(ranks: Sequence[int]) -> str:
    """0,1,2,3,8 -> '0-3.8' (ranges of consecutive ranks)."""
    parts: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ".".join(parts)


def capture_run_id_tag(value: Any) -> str:
    """Run-id suffix of a ``capture`` setting: ``_cap<first>-<last>``, ``_rk<ranks>`` for a rank
    subset, ``_pwdrop`` for dropped pre-window metadata; '' when absent. Tolerates invalid values
    (they are reported by :func:`capture_problems`)."""
    if not isinstance(value, Mapping):
        return "" if value is None else "_cap"
    tag = "_cap"
    steps = value.get("steps")
    if isinstance(steps, Sequence) and len(steps) == 2:
        tag += f"{steps[0]}-{steps[1]}"
    ranks = value.get("ranks", "all")
    if ranks != "all" and isinstance(ranks, Sequence) and all(_is_int(r) for r in ranks):
        tag += f"_rk{_compact(ranks)}"
    if value.get("pre_window_metadata") == "dropped":
        tag += "_pwdrop"
    return tag
