"""Correlation accuracy per capture family: the shapes real captures take, through the product path.

Each family (``FAMILIES``) is an emulated 8-rank Megatron run captured or damaged the way users'
captures are (step windows, rank subsets, lost lines and kernels, stripped NVTX, CUDA graphs,
time-shared GPUs, ...), analysed exactly as ``nccltrace analyze`` does and scored against ground
truth. The target is precision >= 0.999 in every family; recall says what abstaining cost. The
families and their figures: ``docs/correlation.md`` section 1.5.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from nccltrace.core.layout import RUN_YAML_FILE
from nccltrace.core.tables import read_table
from nccltrace.emulator.run import emulate_run
from nccltrace.validation.alignment import SCENARIO_BASE, score_alignment

__all__ = ["FAMILIES", "Family", "capture_families", "check_counts", "real_export_links", "run_family"]

UNTIMED, TIMED = "2.21.5", "2.28.3"  # NCCL versions: no per-line timestamps / microsecond timestamps

_BASE = {**SCENARIO_BASE, "nodes": 2, "tp": 2, "pp": 2, "iterations": 4, "seed": 7,
         "imperfections": {"fuse_grouped_p2p": True, "clock_offset_ns_max": 2_000_000, "arrival_skew_ns_max": 50_000}}  # fmt: skip


def _cut_logs(raw: Path, share: float = 0.6, n: int = 2) -> None:
    """Two ranks' logs copied while the job ran: cut at ``share`` of their bytes, mid-line."""
    for log in sorted((raw / "nccl").glob("nccl_*.log"))[:n]:
        data = log.read_bytes()
        log.write_bytes(data[: int(len(data) * share)])


def _blank_block(raw: Path, lo: float = 0.4, hi: float = 0.45, n: int = 2) -> None:
    """Two ranks' logs lose a block of lines (blanked, so line numbers keep their ground truth)."""
    for log in sorted((raw / "nccl").glob("nccl_*.log"))[:n]:
        lines = log.read_bytes().split(b"\n")
        a, b = int(len(lines) * lo), int(len(lines) * hi)
        log.write_bytes(b"\n".join(lines[:a] + [b""] * (b - a) + lines[b:]))


def _strip_nvtx(raw: Path) -> None:
    """An export without NCCL's NVTX ranges (NVTX not traced, or NCCL_NVTX_DISABLE=1)."""
    for db in (raw / "nsys").glob("*.sqlite"):
        with sqlite3.connect(db) as c:
            c.execute("DELETE FROM NVTX_EVENTS WHERE domainId IS NOT NULL AND domainId <> 0")


def _strip_launches_and_nvtx(raw: Path) -> None:
    """Lost kernels take their launch records with them, and the export has no NCCL NVTX ranges
    (a capture without NVTX tracing, or NCCL_NVTX_DISABLE=1): only the alignment decides."""
    for db in (raw / "nsys").glob("*.sqlite"):
        with sqlite3.connect(db) as c:
            c.execute("""DELETE FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE correlationId NOT IN
                         (SELECT correlationId FROM CUPTI_ACTIVITY_KIND_KERNEL) AND nameId IN
                         (SELECT id FROM StringIds WHERE value LIKE 'cudaLaunchKernel%'
                          OR value LIKE 'cuLaunchKernel%' OR value LIKE 'cudaLaunchKernelExC%')""")
    _strip_nvtx(raw)


def _delay_launches(raw: Path, share: float = 0.03, lo_ns: int = 100_000, hi_ns: int = 2_000_000) -> None:
    """Ranks descheduled between a call's log line and its kernel launch (a host shared by more
    ranks than it has cores): a ``share`` of the timestamped call lines were written 0.1-2 ms
    earlier than the launch usually follows them (never before the previous line of their log)."""
    import datetime as dt
    import random
    import re

    rng = random.Random(0x1A7E)
    stamp = re.compile(rb"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})\]")
    fmt = "%Y-%m-%d %H:%M:%S.%f"
    for log in sorted((raw / "nccl").glob("nccl_*.log")):
        lines = log.read_bytes().split(b"\n")
        prev = None
        for i, line in enumerate(lines):
            m = stamp.match(line)
            if m is None:
                continue
            t = dt.datetime.strptime(m.group(1).decode(), fmt)
            if b" opCount " in line and prev is not None and rng.random() < share:
                room = (t - prev) - dt.timedelta(microseconds=1)
                early = min(dt.timedelta(microseconds=rng.uniform(lo_ns, hi_ns) / 1000), room)
                if early > dt.timedelta(0):
                    lines[i] = b"[" + (t - early).strftime(fmt).encode() + b"]" + line[m.end():]
                    t = t - early
            prev = t
        log.write_bytes(b"\n".join(lines))


def _profiler_like_delayed(raw: Path) -> None:
    """What a PyTorch-profiler trace holds (no NCCL NVTX ranges, no launch without a kernel),
    from a host whose ranks were descheduled between some call lines and their launches."""
    _strip_launches_and_nvtx(raw)
    _delay_launches(raw)


def _strip_step_markers(raw: Path) -> None:
    """An export without step markers (no NVTX ``iteration N`` ranges: a job that emits none)."""
    for db in (raw / "nsys").glob("*.sqlite"):
        with sqlite3.connect(db) as c:
            c.execute("DELETE FROM NVTX_EVENTS WHERE text LIKE 'iteration %'")


def _forget_capture_and_markers(raw: Path) -> None:
    """Nothing says which steps were captured: no declaration, no step markers in the export."""
    _forget_capture(raw)
    _strip_step_markers(raw)


def _forget_capture(raw: Path) -> None:
    """The user does not say which steps were captured (run.yaml without ``capture``)."""
    p = raw / RUN_YAML_FILE
    doc = yaml.safe_load(p.read_text()) or {}
    for section in (doc, doc.get("config") or {}):
        section.pop("capture", None)
    p.write_text(yaml.safe_dump(doc, sort_keys=False))


@dataclass(frozen=True)
class Family:
    """One capture family: emulator settings, damage done to the files, what is expected."""

    name: str
    nccl: str
    settings: dict[str, Any] = field(default_factory=dict)
    damage: Callable[[Path], None] | None = None
    min_recall: float = 0.0  # recall the family must keep (0: abstaining is the right answer)


# a build that runs these collectives through SendRecv kernels (e.g. Meta's)
_SENDRECV_BUILD = {"kernel_naming": {"collectives_as_sendrecv": ["AllReduce", "AllGather", "ReduceScatter"]}}
# TP collectives captured into CUDA graphs after one eager warm-up step, replayed every step
_GRAPHS = {"cuda_graphs": {"parallelism": ["tp"], "warmup_iterations": 1}}
# issue 32's real run: 8 ranks time-sharing GPUs (kernel ends of one collective milliseconds
# apart; each rank its own NCCL host, as with NCCL_HOSTID per rank, so every communicator's
# opCount counts), one all-reduce of a communicator with eager collectives captured into a CUDA
# graph and replayed every step (its replays advance the opCount with no line), a 3-step window
# after the capture located by log time
_GRAPH_TIME_SHARED = {"nodes": 8, "gpus_per_node": 1, "iterations": 6, "capture": {"steps": [3, 5]},
                      "cuda_graphs": {"phases": ["step/grad-norm-max"], "warmup_iterations": 1},
                      "imperfections": {"end_spread_ns_max": 4_000_000}}
GRAPH_TIME_SHARED = "CUDA graph all-reduce among eager ones, ranks time-sharing GPUs, profiler-like trace"

FAMILIES: tuple[Family, ...] = (
    Family("full", UNTIMED, min_recall=0.99),
    Family("full", TIMED, min_recall=0.99),
    Family("step window, log time", TIMED, {"capture": {"steps": [2, 3]}}, min_recall=0.99),
    Family("step window, step markers", UNTIMED, {"capture": {"steps": [2, 3]}}, _forget_capture, min_recall=0.99),
    Family("step window, declared steps", UNTIMED, {"capture": {"steps": [2, 3]}}, min_recall=0.9),
    # identical steps, no marker: nothing verifies the declared iterations, so they are not used
    Family("step window, declared steps, no markers", UNTIMED, {"capture": {"steps": [2, 3]}}, _strip_step_markers),
    Family("step window, nothing declared", UNTIMED, {"capture": {"steps": [2, 3]}}, _forget_capture_and_markers),
    # a first iteration with extra calls: the log's periodic part starts at the second one
    Family("step window, step markers, irregular first iteration", UNTIMED,
           {"capture": {"steps": [2, 3]}, "imperfections": {"first_iteration_extra_calls": 1}}, _forget_capture,
           min_recall=0.99),
    # ... and lost kernel records without markers: declared steps found from the log's structure
    Family("step window, declared steps, irregular first iteration, kernels lost", UNTIMED,
           {"capture": {"steps": [2, 3]}, "imperfections": {"first_iteration_extra_calls": 1, "drop_kernels": 0.03}},
           _strip_step_markers, min_recall=0.9),
    Family("rank subset", TIMED, {"capture": {"ranks": [0, 5]}}, min_recall=0.99),
    # ranks time-sharing a GPU: one collective's kernels end milliseconds apart (the real H200
    # capture's shape); the cross-rank check must stand down, not demote correct matches
    Family("kernel ends spread by milliseconds, no NVTX", UNTIMED,
           {"imperfections": {"end_spread_ns_max": 4_000_000, "drop_kernels": 0.02}}, _strip_launches_and_nvtx,
           min_recall=0.99),
    # Megatron-Core with process groups created lazily: no communicator of every rank, so the
    # global ranks are unknown unless the structure decides (said, partial); the alignment, the
    # run-level checks and the clock fit need none of them
    Family("lazy process groups, no default-group NCCL", UNTIMED,
           {"init_style": "plain", "default_group_nccl": False}, min_recall=0.99),
    Family("log cut short", UNTIMED, damage=_cut_logs),
    Family("log cut short", TIMED, damage=_cut_logs, min_recall=0.99),
    Family("block of log lines lost", UNTIMED, damage=_blank_block, min_recall=0.9),
    Family("lines+kernels lost, no NVTX", UNTIMED, {"imperfections": {"drop_kernels": 0.2, "drop_log_lines": 0.2}},
           _strip_launches_and_nvtx),
    Family("collectives on SendRecv kernels, no NVTX", UNTIMED, _SENDRECV_BUILD, _strip_nvtx, min_recall=0.9),
    Family("collectives on SendRecv kernels, no NVTX", TIMED, _SENDRECV_BUILD, _strip_nvtx, min_recall=0.99),
    Family("symmetric-memory kernels", TIMED, {"kernel_naming": {"symmetric": ["AllReduce", "AllGather",
                                                                               "ReduceScatter"]}}, min_recall=0.99),
    Family("CUDA graphs (TP collectives)", UNTIMED, _GRAPHS, min_recall=0.99),
    Family("CUDA graphs (TP collectives)", TIMED, _GRAPHS, min_recall=0.99),
    Family("lines+kernels lost, no NVTX", TIMED, {"imperfections": {"drop_kernels": 0.2, "drop_log_lines": 0.2}},
           _strip_launches_and_nvtx, min_recall=0.99),
    Family(GRAPH_TIME_SHARED, "2.28.9", _GRAPH_TIME_SHARED, _profiler_like_delayed, min_recall=0.99),
)


def _settings(family: Family, seed: int, iterations: int) -> dict[str, Any]:
    cfg = {**_BASE, "seed": seed, "iterations": iterations, "nccl_version": family.nccl,
           "nccl_timestamps": family.nccl >= "2.26"}  # fmt: skip
    extra = dict(family.settings)
    knobs = {**_BASE["imperfections"], **extra.pop("imperfections", {})}
    return {**cfg, **extra, "imperfections": knobs}


def run_family(family: Family, work: Path, *, seed: int = 7, iterations: int = 4) -> dict[str, Any]:
    """Emulate, damage, analyse and score one family; one row of the family table."""
    from nccltrace.analyze import analyze_run

    name = f"{family.name}-{family.nccl}".replace(" ", "_").replace(",", "").replace("+", "_")
    raw, out = work / name / "raw", work / name / "out"
    shutil.rmtree(work / name, ignore_errors=True)
    emulate_run(_settings(family, seed, iterations), raw)
    if family.damage is not None:
        family.damage(raw)
    res = analyze_run(raw, out, progress=False)
    s = score_alignment(read_table(out / "ops" / "ops.parquet"), read_table(raw / "ground_truth" / "ops.parquet"))
    quality = read_table(out / "ops" / "alignment_quality.parquet")
    return {"family": family.name, "nccl": family.nccl, "timestamps": family.nccl >= "2.26",
            "positives": s["tp"] + s["fn"], "matched": s["tp"] + s["fp"], "wrong": s["fp"],
            "precision": s["precision"], "recall": s["recall"], "min_recall": family.min_recall,
            "partial": bool(res["partial"]), "problems": len(res["problems"]), **check_counts(quality)}  # fmt: skip


def check_counts(quality: pd.DataFrame) -> dict[str, Any]:
    """What the run's checks did (its ``alignment_quality`` table): matches confirmed and demoted
    per check (``<check>_confirmed``, ``<check>_demoted``), and where a check stood down
    (``stood_down``: the findings' check names, comma-separated)."""
    from nccltrace.align.quality import INFORMATIONAL_CHECKS

    out: dict[str, Any] = {}
    for check in ("log_time", "stream", "kernel_args", "tuning", "p2p_pairing", "cross_rank"):
        rows = quality[quality["check"] == check]
        out[f"{check}_confirmed"] = int(rows["confirmed"].sum())
        out[f"{check}_demoted"] = int(rows["contradicted"].sum())
    found = quality[quality["check"].isin(INFORMATIONAL_CHECKS) & quality["message"].notna()]
    out["stood_down"] = ",".join(sorted(set(found["check"].astype(str))))
    return out


def capture_families(work: Path, *, seed: int = 7, progress: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Precision and recall of every family (each family takes seconds: there is no quick set)."""
    rows = []
    for fam in FAMILIES:
        if progress is not None:
            progress(f"family {fam.name} (NCCL {fam.nccl})")
        rows.append(run_family(fam, work, seed=seed))
    return pd.DataFrame(rows)


def real_export_links(exports: list[Path]) -> pd.DataFrame:
    """Real nsys exports (no NCCL log beside them): NCCL's API call ranges linked to kernels
    from NVTX alone (``parse-nsys``'s ``nccl_api_calls``). Per export: NCCL kernels, kernels
    linked, how many calls each linked kernel got and whether each of them lies in the range
    that launched it on the launching thread (the published ground truth's own definition:
    runtime correlation id -> launching thread -> smallest enclosing NCCL range)."""
    from nccltrace.nsys.nccl_api import CALL_OPS
    from nccltrace.nsys.reader import NsysExport

    rows = []
    for path in exports:
        with NsysExport.open(path) as ex:
            api = ex.nccl_api_calls()
            kernels = ex.kernels()
        calls = api.calls
        # the collective/P2P calls (not the GroupEnd that launched them)
        linked = calls[calls["kernel_correlation_id"].notna() & calls["op"].isin(set(CALL_OPS.values()))]
        per_kernel = linked.groupby(["kernel_global_pid", "kernel_correlation_id"]).size()
        k = kernels.set_index(["global_pid", "correlation_id"])
        launch = k.reindex(per_kernel.index)[["launch_start", "launch_tid"]]
        ranges = linked.drop_duplicates(["kernel_global_pid", "kernel_correlation_id"]).set_index(
            ["kernel_global_pid", "kernel_correlation_id"])  # fmt: skip
        # the kernel's launch inside its launch range, on the thread of the calls
        end = calls.set_index(["tid", "start"])["end"]
        lr_end = end.reindex(pd.MultiIndex.from_arrays([ranges["tid"], ranges["launch_range_start"]])).to_numpy()
        inside = ((launch["launch_start"].to_numpy(float) >= ranges["launch_range_start"].to_numpy(float))
                  & (launch["launch_start"].to_numpy(float) <= lr_end.astype(float))
                  & (launch["launch_tid"].to_numpy(float) == ranges["tid"].to_numpy(float)))  # fmt: skip
        rows.append({"export": Path(path).name, "nccl_kernels": int(api.summary()["nccl_kernels"]),
                     "kernels_linked": len(per_kernel), "calls_per_linked_kernel": ",".join(
                         str(v) for v in sorted(set(per_kernel.tolist()))) or "-",
                     "launch_in_its_range": int(inside.sum()), "payload": api.summary()["payload"]})  # fmt: skip
    return pd.DataFrame(rows)
