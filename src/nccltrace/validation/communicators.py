"""Accuracy of communicator inference and parallelism labels against emulator ground truth.

:func:`label_accuracy` emulates small Megatron-LM runs (:data:`CONFIGS`), infers the exact
communicators from their logs, labels them from the declared sizes and grades each label
``exact``, ``ambiguous`` (the data cannot separate the true kind from the others) or ``wrong``.
:func:`fallback_accuracy` drops the init lines and measures the call-sequence fallback
(:mod:`nccltrace.communicators.from_calls`, both methods) on clean and damaged logs. Both return
DataFrames (:func:`validate` bundles them for the CLI); the measures: ``docs/correlation.md``,
Module notes.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from nccltrace.communicators.from_calls import infer_communicators_from_calls
from nccltrace.communicators.infer import infer_communicators
from nccltrace.communicators.labels import (
    ParallelSizes,
    label_communicators,
    label_ops,
    truth_label,
    with_logical_ids,
)
from nccltrace.core.layout import CALLS_FILE, COMMS_FILE
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.nccl.log_reader import parse_logs

__all__ = [
    "CONFIGS",
    "LOST_LINES",
    "EmulatedRun",
    "emulate_config",
    "fallback_accuracy",
    "label_accuracy",
    "label_details",
    "validate",
]

# A small GPT (4 layers, hidden 64) for one iteration: every group of the layout is exercised
# in seconds.
_SMALL: dict[str, Any] = {
    "model": "tiny", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
    "vocab_size": 512, "micro_batch_size": 1, "global_batch_size": 8, "iterations": 1, "precision": "bf16",
    "seed": 1,
}  # fmt: skip

CONFIGS: dict[str, dict[str, Any]] = {
    "dp4": {"nodes": 1, "gpus_per_node": 4},
    "tp2_pp2": {"nodes": 1, "gpus_per_node": 4, "tp": 2, "pp": 2},
    "tp2_pp2_dp2_2nodes": {"nodes": 2, "gpus_per_node": 4, "tp": 2, "pp": 2},
    "pp4_vpp2": {"nodes": 1, "gpus_per_node": 4, "pp": 4, "vpp": 2, "num_layers": 8},
    "pp2_vpp2_dp2_2nodes": {"nodes": 2, "gpus_per_node": 2, "pp": 2, "vpp": 2, "num_layers": 8},
    "moe_ep4_alltoall": {"nodes": 1, "gpus_per_node": 4, "ep": 4, "num_experts": 4},
    "moe_ep4_allgather": {"nodes": 1, "gpus_per_node": 4, "ep": 4, "num_experts": 4,
                          "moe_token_dispatcher": "allgather"},
    "tp2_cp2": {"nodes": 1, "gpus_per_node": 4, "tp": 2, "cp": 2},
    "tp2_pp2_cp2_ep2_dp2_4nodes": {"nodes": 4, "gpus_per_node": 4, "tp": 2, "pp": 2, "cp": 2, "ep": 2,
                                   "num_experts": 4, "sequence_parallel": True, "distributed_optimizer": True},
    "tp4_dp2_2nodes": {"nodes": 2, "gpus_per_node": 4, "tp": 4},
    "tp2_dp4_2nodes": {"nodes": 2, "gpus_per_node": 4, "tp": 2},
    "tp4_pp2_dp2_4nodes": {"nodes": 4, "gpus_per_node": 4, "tp": 4, "pp": 2},
}  # fmt: skip

# Lost (2%) and duplicated (half of ranks 0 and 3's) call lines.
LOST_LINES: dict[str, Any] = {"drop_log_lines": 0.02, "duplicate_log_lines": {"ranks": [0, 3], "fraction": 0.5}}


@dataclass
class EmulatedRun:
    """An emulated run, its parsed tables and its ground truth."""

    name: str
    init_style: str
    nccl_version: str
    settings: dict[str, Any]
    calls: pd.DataFrame
    comms: pd.DataFrame
    comm_info: pd.DataFrame
    truth_comms: pd.DataFrame
    truth_ops: pd.DataFrame

    @property
    def sizes(self) -> ParallelSizes:
        return ParallelSizes.from_settings(self.settings)


_CACHE: dict[str, EmulatedRun] = {}


def emulate_config(name: str, workdir: Path | str | None = None, *, init_style: str = "plain",
                   nccl_version: str = "2.21.5", imperfections: dict[str, Any] | None = None,
                   overrides: dict[str, Any] | None = None) -> EmulatedRun:
    """Emulate :data:`CONFIGS` ``[name]`` (plus ``overrides``), parse its logs and load the
    tables. Results are cached per process (the emulator is deterministic)."""
    settings = {**_SMALL, **CONFIGS[name], **(overrides or {}), "init_style": init_style, "nccl_version": nccl_version}
    if imperfections:
        settings["imperfections"] = imperfections
    key = json.dumps(settings, sort_keys=True)
    if key in _CACHE:
        return _CACHE[key]
    base = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="nccltrace-comm-validation-"))
    out = base / f"{name}_{init_style}_{nccl_version}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    res = emulate_run(settings, out / "raw")
    parse_logs([out / "raw" / "nccl"], out / "parsed")
    run = EmulatedRun(
        name, init_style, nccl_version, settings,
        read_table(out / "parsed" / CALLS_FILE), read_table(out / "parsed" / COMMS_FILE),
        read_table(out / "parsed" / "comm_info.parquet"),
        read_table(res.ground_truth["communicators"]), read_table(res.ground_truth["ops"]),
    )  # fmt: skip
    _CACHE[key] = run
    return run


# --------------------------------------------------------------------------- labels


def _verdict(label: str, candidates: str, truth: str, members: frozenset[int], truth_members: frozenset[int],
             pair: bool) -> str:
    if label == truth:
        return "exact"
    # Only a documented ambiguity counts: identical member sets, or a pair communicator whose
    # owning group the logs cannot show.
    if truth in candidates.split(",") and (members == truth_members or pair):
        return "ambiguous"
    return "wrong"


def _labelled(run: EmulatedRun, sizes: ParallelSizes | None = None):
    tables = infer_communicators(run.comms)
    labels = label_communicators(tables.communicators, sizes or run.sizes, members=tables.members, calls=run.calls)
    return tables, labels


def label_details(run: EmulatedRun, sizes: ParallelSizes | None = None, *, _done=None) -> pd.DataFrame:
    """One row per logical communicator: label, candidates, true kind and verdict."""
    tables, labels = _done or _labelled(run, sizes)
    truth = run.truth_comms[["host", "pid", "comm", "comm_uid", "group_kind", "members"]]
    m = tables.members.astype({"comm": "uint64", "pid": "int64"}).merge(
        truth.astype({"comm": "uint64", "pid": "int64"}), on=["host", "pid", "comm"], how="left")
    rows = []
    lab = labels.set_index("logical_id")
    for lid, g in m.groupby("logical_id"):
        row = lab.loc[lid]
        kinds = sorted(set(g["group_kind"].dropna()))
        uids = set(g["comm_uid"].dropna())
        true_kind = kinds[0] if len(kinds) == 1 and len(uids) == 1 else ("|".join(kinds) or "unknown")
        tl = truth_label(true_kind)
        members = frozenset(int(r) for r in g["global_rank"] if r >= 0)
        tm = frozenset(int(r) for r in g["members"].iloc[0]) if g["members"].notna().any() else frozenset()
        if row["label_source"] == "unmatched":
            verdict = "unmatched"
        else:
            verdict = _verdict(row["parallelism"], row["parallelism_candidates"], tl, members, tm,
                               true_kind.startswith("p2p:"))
        rows.append({
            "config": run.name, "init_style": run.init_style, "nccl_version": run.nccl_version, "logical_id": int(lid),
            "nranks": int(row["nranks"]), "members": sorted(members), "true_kind": true_kind, "true_label": tl,
            "parallelism": row["parallelism"], "parallelism_candidates": row["parallelism_candidates"],
            "resolution": row["resolution"], "label_source": row["label_source"], "verdict": verdict,
        })  # fmt: skip
    return pd.DataFrame(rows)


def _op_verdicts(run: EmulatedRun, tables, labels: pd.DataFrame) -> Counter:
    calls = run.calls[run.calls["duplicate_of"].isna()]
    ops = label_ops(with_logical_ids(calls, tables.members), labels)
    truth = run.truth_ops[["host", "pid", "log_line", "group_kind"]].dropna(subset=["log_line"])
    truth = truth.astype({"pid": "int64", "log_line": "int64"}).rename(columns={"log_line": "line"})
    m = ops.astype({"pid": "int64", "line": "int64"}).merge(truth, on=["host", "pid", "line"], how="left")
    out: Counter = Counter()
    for lab, cands, kind in zip(m["parallelism"], m["parallelism_candidates"], m["group_kind"]):
        if pd.isna(kind):
            out["no_truth"] += 1
            continue
        t = truth_label(str(kind))
        out["exact" if lab == t else ("ambiguous" if t in str(cands).split(",") else "wrong")] += 1
    return out


def label_accuracy(names: list[str] | None = None, workdir: Path | str | None = None, *,
                   styles: tuple[tuple[str, str], ...] = (("plain", "2.21.5"), ("split", "2.24.3"),
                                                          ("split", "2.18.3")),
                   ) -> tuple[pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """Label accuracy per configuration and init style (init style, NCCL version): a summary
    DataFrame (one row per run) and the per-communicator details."""
    summary, details = [], []
    for name in names or list(CONFIGS):
        for style, version in styles:
            run = emulate_config(name, workdir, init_style=style, nccl_version=version)
            tables, labels = _labelled(run)
            d = label_details(run, _done=(tables, labels))
            details.append(d)
            ops = _op_verdicts(run, tables, labels)
            v = Counter(d["verdict"])
            amb = d[d["verdict"] == "ambiguous"]
            pairs = sorted({f"{t}~{c}" for t, c in zip(amb["true_label"], amb["parallelism"])})
            n_ops = ops["exact"] + ops["ambiguous"] + ops["wrong"]
            summary.append({
                "config": name, "init_style": style, "nccl_version": version, "world_size": run.sizes.world_size,
                "communicators": len(d), "exact": v["exact"], "ambiguous": v["ambiguous"], "wrong": v["wrong"],
                "unmatched": v["unmatched"], "correct": (v["exact"] + v["ambiguous"]) / max(len(d), 1),
                "ops": n_ops, "ops_exact": ops["exact"], "ops_ambiguous": ops["ambiguous"], "ops_wrong": ops["wrong"],
                "ops_correct": (ops["exact"] + ops["ambiguous"]) / max(n_ops, 1),
                "ambiguous_as": ", ".join(pairs),
            })  # fmt: skip
    return pd.DataFrame(summary), pd.concat(details, ignore_index=True) if details else pd.DataFrame()


# --------------------------------------------------------------------------- fallback


def _pairs(groups: Counter) -> int:
    return sum(c * (c - 1) // 2 for c in groups.values())


def fallback_scores(run: EmulatedRun, method: str, *, sizes: ParallelSizes | None = None,
                    rank_order: str = "evidence") -> dict[str, Any]:
    """Scores of the sequence fallback on one run (init lines ignored)."""
    res = infer_communicators_from_calls(run.calls, method=method, sizes=sizes, rank_order=rank_order)
    truth = run.truth_comms[["host", "pid", "comm", "comm_uid", "rank", "rank_in_comm"]]
    m = res.members.astype({"comm": "uint64", "pid": "int64"}).merge(
        truth.astype({"comm": "uint64", "pid": "int64"}), on=["host", "pid", "comm"], how="inner", suffixes=("", "_true"))
    key = list(zip(m["host"], m["pid"], m["comm"]))
    inferred: dict[int, frozenset] = {}
    true: dict[int, frozenset] = {}
    for k, lid, uid in zip(key, m["logical_id"], m["comm_uid"]):
        inferred.setdefault(int(lid), set()).add(k)  # type: ignore[arg-type]
        true.setdefault(int(uid), set()).add(k)  # type: ignore[arg-type]
    ok = [inferred[int(lid)] == true[int(uid)] for lid, uid in zip(m["logical_id"], m["comm_uid"])]
    both = Counter(zip(m["logical_id"], m["comm_uid"]))
    same_inf, same_true, same_both = _pairs(Counter(m["logical_id"])), _pairs(Counter(m["comm_uid"])), _pairs(both)
    det = m[m["rank_in_comm"] >= 0]
    return {
        "pointers": len(m), "communicators_true": len(true), "communicators_inferred": len(inferred),
        "pointers_grouped_correctly": sum(ok) / max(len(m), 1),
        "pair_precision": same_both / same_inf if same_inf else 1.0,
        "pair_recall": same_both / same_true if same_true else 1.0,
        "global_rank_accuracy": float((m["global_rank"] == m["rank"]).mean()) if len(m) else 1.0,
        "rank_in_comm_determined": len(det) / max(len(m), 1),
        "rank_in_comm_accuracy": float((det["rank_in_comm"] == det["rank_in_comm_true"]).mean()) if len(det) else None,
        "complete": float(res.communicators["complete"].astype(bool).mean()) if len(res.communicators) else 0.0,
    }


def fallback_accuracy(names: list[str] | None = None, workdir: Path | str | None = None, *,
                      variants: tuple[str, ...] = ("clean", "lost-lines")) -> pd.DataFrame:
    """Fallback accuracy per configuration, log variant ('clean', 'lost-lines') and method
    ('thesis', 'improved', 'improved+sizes')."""
    rows = []
    for name in names or list(CONFIGS):
        for variant in variants:
            imp = LOST_LINES if variant == "lost-lines" else None
            run = emulate_config(name, workdir, imperfections=imp, overrides={"iterations": 2} if imp else None)
            for method, sizes in (("thesis", None), ("improved", None), ("improved+sizes", run.sizes)):
                s = fallback_scores(run, method.split("+")[0], sizes=sizes)
                rows.append({"config": name, "logs": variant, "method": method, **s})
    return pd.DataFrame(rows)


def structure_accuracy(names: list[str] | None = None, workdir: Path | str | None = None) -> pd.DataFrame:
    """What the communicators' structure alone decides about the global ranks
    (:func:`nccltrace.megatron.rank_structure.solve_global_ranks`) on emulated jobs whose process
    groups are created lazily and whose default group runs no NCCL collective, with the declared
    sizes and without: per config, ``certain`` (one assignment, right), ``wrong`` (one
    assignment, not the true one: must never happen) or how many assignments fit."""
    import time

    from nccltrace.communicators.infer import communicator_structure
    from nccltrace.megatron.rank_structure import ORDER_SETTING, solve_global_ranks

    rows = []
    for name in names or list(CONFIGS):
        run = emulate_config(name, workdir, overrides={"default_group_nccl": False})
        tables = infer_communicators(run.comms)
        truth = {(str(h), int(p)): int(r) for h, p, r in
                 run.truth_ops[["host", "pid", "rank"]].drop_duplicates().itertuples(index=False)}
        procs, lists, _ = communicator_structure(tables)
        row: dict[str, Any] = {"config": name, "world_size": run.sizes.world_size,
                               "world_communicator": not tables.unranked, "communicators": len(lists)}
        # the emulator lays ranks out in Megatron's default order, as a campaign run declares it
        for label, settings in (("declared sizes", {**run.settings, ORDER_SETTING: False}), ("no sizes", None)):
            t0 = time.perf_counter()
            sol = solve_global_ranks(procs, lists, settings)
            row[f"{label}: ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            row[label] = (("certain" if sol.ranks == truth else "WRONG") if sol.ranks is not None
                          else "undecided (budget)" if sol.exhausted else f"{sol.fits}+ fit" if sol.fits else "none fit")
            row[f"{label}: layouts tried"] = sol.tried
        rows.append(row)
    return pd.DataFrame(rows)


def validate(names: list[str] | None = None, workdir: Path | str | None = None) -> dict[str, pd.DataFrame]:
    """Everything, for a CLI: ``labels`` (summary), ``label_details``, ``fallback``."""
    summary, details = label_accuracy(names, workdir)
    return {"labels": summary, "label_details": details, "fallback": fallback_accuracy(names, workdir)}
