"""Labels without declared sizes against the labels with them, on an analysed run.

A run analysed with its sizes declared has exact labels; :func:`behaviour_vs_declared` labels the
same communicators again as if nothing had been declared (:func:`nccltrace.ops.build.run_labels`)
and counts, per run, how many labels agree, which evidence they rest on and how many that are
presented as certain are wrong (the number that must be 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from nccltrace.core.layout import CALLS_FILE, RunLayout
from nccltrace.core.tables import read_table
from nccltrace.ops.build import call_counts, run_labels

__all__ = ["CERTAIN", "behaviour_vs_declared"]

CERTAIN = {("megatron-groups", "member-set"), ("megatron-groups", "creation-order"),
           ("megatron-groups", "split-parent"), ("behaviour", "all-layouts")}
"""(label_source, resolution) pairs a label is presented as certain with."""


def behaviour_vs_declared(run_dir: Path | str) -> dict[str, Any]:
    """For one analysed run: ``communicators``, ``same`` (canonical label equal to the declared
    one), ``true_among_candidates`` (the declared label is among the undeclared candidates),
    ``certain_wrong``, ``sources`` (label_source -> count) and ``note`` (how the sizes were
    found: the console's note)."""
    layout = RunLayout(run_dir)
    declared = read_table(layout.labels).set_index("logical_id")
    comms, members = read_table(layout.communicators), read_table(layout.members)
    counts = pd.concat([call_counts(layout.parsed_nccl(p) / CALLS_FILE) for p in layout.find_processes()],
                       ignore_index=True)  # fmt: skip
    notes: list[str] = []
    guessed = run_labels(comms, members, counts, None, notes, []).set_index("logical_id")
    both = declared.merge(guessed, left_index=True, right_index=True, suffixes=("_declared", "_guessed"))
    same = both["parallelism_declared"].astype(str) == both["parallelism_guessed"].astype(str)
    among = [str(t) in str(c).split(",") for t, c in zip(both["parallelism_declared"],
                                                         both["parallelism_candidates_guessed"])]  # fmt: skip
    certain = [(str(s), str(r)) in CERTAIN for s, r in zip(both["label_source_guessed"], both["resolution_guessed"])]
    return {"run": Path(run_dir).name, "communicators": len(both), "same": int(same.sum()),
            "true_among_candidates": int(sum(among)),
            "certain_wrong": int(sum(c and not s for c, s in zip(certain, same))),
            "sources": both["label_source_guessed"].astype(str).value_counts().to_dict(),
            "note": notes[0] if notes else None}
