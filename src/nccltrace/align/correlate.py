"""One process's correlation table: every call line and every NCCL kernel, matched or not, with why.

Modes: ``default`` (:mod:`.default`), ``thesis`` (:mod:`.thesis`, names only, GPU start order)
and ``exact`` (:mod:`.exact`, NCCL NVTX payload ranges). The table (``ALIGNMENT_SCHEMA``) has
one row per call line (``row_kind = 'call'``) and one per kernel no call was matched to
(``row_kind = 'kernel'``); a kernel that runs a fused group appears on each of its calls.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
import pyarrow as pa

from nccltrace.align.default import AlignParams, align_units
from nccltrace.align.schema import (
    ALIGNMENT_SCHEMA,
    FOREIGN_PROCESS_REASON,
    GRAPH_CAPTURED_REASON,
    MODES,
    NO_EXPORT_REASON,
    NOT_IN_EXPORT_REASON,
    OUTSIDE_CAPTURE_REASON,
)
from nccltrace.align.sequences import (
    FAMILIES,
    GENERIC,
    NO_TIME,
    attach_tuning,
    build_kernel_sequence,
    build_log_units,
    is_nccl_kernel,
)
from nccltrace.align.tuning_carry import carry_tuning
from nccltrace.align.window import (
    locate_by_trace,
    log_unlocated,
    step_lines,
    steps_before_by_lines,
    steps_before_periodic,
    trace_steps,
    unlocated_message,
    window_unlocated,
)
from nccltrace.core.layout import COMMS_FILE, process_key
from nccltrace.core.tables import _NULLABLE_DTYPES, frame_to_table
from nccltrace.nccl.versions import NcclVersion

# Reasons of lines the export's capture cannot hold: no range or kernel is sought for them.
_NOT_CAPTURED = (OUTSIDE_CAPTURE_REASON, "capture_not_located", NOT_IN_EXPORT_REASON)


def _kernel_cols(k: pd.DataFrame, idx: np.ndarray) -> dict[str, object]:
    """Kernel provenance columns for kernel row indices ``idx`` (-1 = none), as nullable arrays
    built from numpy values and a mask (no per-row Python objects)."""
    ok = idx >= 0
    safe = np.where(ok, idx, 0)
    out: dict[str, object] = {}
    for col, src in (("kernel_global_pid", "global_pid"), ("kernel_correlation_id", "correlation_id"),
                     ("kernel_stream_id", "stream_id"), ("kernel_start", "start"), ("kernel_end", "end"),
                     ("launch_start", "launch_start")):  # fmt: skip
        if src not in k or len(k) == 0:
            out[col] = _nulls("Int64", len(idx))
            continue
        series = k[src].astype("Int64")
        vals = series.to_numpy(dtype=np.int64, na_value=0)[safe]
        mask = ~ok | series.isna().to_numpy()[safe]
        out[col] = pd.arrays.IntegerArray(vals, mask)
    if "short_name" in k and len(k):
        codes, uniques = pd.factorize(k["short_name"].astype(object), use_na_sentinel=True)
        out["kernel_name"] = _from_codes(np.where(ok, codes[safe], -1), uniques)
    else:
        out["kernel_name"] = _constant(None, len(idx))
    return out


def _typed(values: np.ndarray, mask: np.ndarray, dtype: str) -> pd.api.extensions.ExtensionArray:
    """A nullable column from numpy values and a null mask (no per-row Python objects)."""
    if dtype == "Float64":
        return pd.arrays.FloatingArray(np.asarray(values, np.float64), mask)
    return pd.arrays.IntegerArray(np.asarray(values, np.int64), mask)


def _from_codes(codes: np.ndarray, uniques) -> pd.api.extensions.ExtensionArray:
    """A nullable string column from dictionary codes (-1 = null): one Python string per
    distinct value, not per row."""
    codes = np.asarray(codes)
    dictionary = pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32(), mask=codes < 0),
                                                pa.array(np.asarray(uniques, object), pa.string()))
    return pd.array(dictionary.cast(pa.string()).to_pandas(types_mapper=pd.ArrowDtype).array, dtype="string")


def _strings(values: np.ndarray, mask: np.ndarray) -> pd.api.extensions.ExtensionArray:
    """A nullable string column from an object array of a few distinct values and a null mask."""
    codes, uniques = pd.factorize(np.where(mask, None, values), use_na_sentinel=True)
    return _from_codes(codes, uniques)


def _constant(value: str | None, n: int) -> pd.api.extensions.ExtensionArray:
    if value is None:
        return pd.array(pa.nulls(n, pa.string()).to_pandas(types_mapper=pd.ArrowDtype).array, dtype="string")
    return pd.array(pa.repeat(pa.scalar(value), n).to_pandas(types_mapper=pd.ArrowDtype).array, dtype="string")


def _nulls(dtype: str, n: int) -> pd.api.extensions.ExtensionArray:
    """An all-null column of a nullable dtype ('string', 'Int64', 'Float64')."""
    return _constant(None, n) if dtype == "string" else _typed(np.zeros(n), np.ones(n, bool), dtype)


def _column(df: pd.DataFrame, name: str, field: pa.Field, n: int) -> pd.api.extensions.ExtensionArray:
    """Column ``name`` of ``df`` in the schema's nullable dtype (all null when absent)."""
    dtype = _NULLABLE_DTYPES[str(field.type)]
    if name not in df:
        return _nulls(dtype, n)
    return df[name].astype(dtype).array


def _frame(cols: dict[str, object], n: int) -> pd.DataFrame:
    """The columns of ALIGNMENT_SCHEMA in order, each already typed; absent ones all null."""
    out = {}
    for field in ALIGNMENT_SCHEMA:
        v = cols.get(field.name)
        if v is None:
            v = _nulls(_NULLABLE_DTYPES[str(field.type)], n)
        out[field.name] = v
    return pd.DataFrame(out, copy=False)


def _assemble(calls: pd.DataFrame, call_kernel: np.ndarray, call_unit: np.ndarray, reason: np.ndarray,
              conf: np.ndarray, method: np.ndarray, kernels: pd.DataFrame, mode: str, *,
              lost: np.ndarray | None = None, placeholder: np.ndarray | None = None) -> pd.DataFrame:  # fmt: skip
    """Call rows (matched or not) and rows for kernels no call was matched to. ``lost`` marks
    calls whose launch was found but whose kernel record is missing (not a match).

    Columns are built in their final nullable dtypes straight from numpy values and masks: at
    10^6 lines, object columns and a schema coercion afterwards cost more memory than the
    alignment itself."""
    n = len(calls)
    matched = call_kernel >= 0
    if lost is not None:
        matched &= ~lost
    fields = {f.name: f for f in ALIGNMENT_SCHEMA}
    rows: dict[str, object] = {
        name: _column(calls, name, fields[name], n)
        for name in ("file", "line", "host", "pid", "op", "comm", "op_count", "duplicate_of")
    }
    reason = np.asarray(reason, object)
    method = np.asarray(method, object)
    rows.update({
        "row_kind": _constant("call", n),
        "unit": _typed(np.maximum(call_unit, 0), call_unit < 0, "Int64"),
        "status": _strings(np.where(matched, "matched", "unmatched").astype(object), np.zeros(n, bool)),
        "reason": _strings(reason, pd.isna(reason)),
        "confidence": _typed(np.where(matched, conf, 0.0), ~matched, "Float64"),
        "method": _strings(method, ~matched | pd.isna(method)),
        **_kernel_cols(kernels, call_kernel),
    })  # fmt: skip
    call_rows = _frame(rows, n)
    used = np.zeros(len(kernels), bool)
    used[call_kernel[call_kernel >= 0]] = True
    if placeholder is not None:
        used |= placeholder  # lost launches are not kernels (and may be compute kernels)
    free = np.flatnonzero(~used)
    nk = len(free)
    host = calls["host"].dropna().iloc[0] if n and calls["host"].notna().any() else None
    pids = (kernels["pid"].astype("Int64").to_numpy(np.int64, na_value=0)[free] if len(kernels) and "pid" in kernels
            else np.zeros(nk, np.int64))  # fmt: skip
    pid_null = (kernels["pid"].isna().to_numpy()[free] if len(kernels) and "pid" in kernels
                else np.ones(nk, bool))  # fmt: skip
    krows = {
        "row_kind": _constant("kernel", nk),
        "host": _constant(host, nk),
        "pid": _typed(pids, pid_null, "Int64"),
        "status": _constant("unmatched", nk),
        "reason": _constant("no_log_line", nk),
        **_kernel_cols(kernels, free),
    }
    if nk == 0:
        return call_rows
    return pd.concat([call_rows, _frame(krows, nk)], ignore_index=True)


def align_process(
    calls: pd.DataFrame,
    kernels: pd.DataFrame,
    *,
    mode: str = "default",
    utc_offset_ns: int | None = None,
    nvtx: pd.DataFrame | None = None,
    launches_without_kernel: pd.DataFrame | None = None,
    nccl_version: str | None = None,
    params: AlignParams | None = None,
    quality: dict | None = None,
    capture_steps: tuple[int, int] | None = None,
    comms: pd.DataFrame | None = None,
    tuning: pd.DataFrame | None = None,
    iteration_marks: pd.DataFrame | None = None,
    carried_tuning: Mapping[int, pd.DataFrame] | None = None,
) -> pd.DataFrame:
    """Correlate one process's call lines (``calls`` table) with its kernels (nsys ``kernels`` rows of
    the same pid). ``utc_offset_ns`` (the export's session UTC start) enables the time signal
    when the log has timestamps; ``nccl_version`` ("2.21.5") tells whether opCount separates
    launches on every communicator. ``quality`` (a dict, filled in place): the checks run on the
    matches, what each confirmed and contradicted. ``capture_steps``: 0-based first and last
    training step of a step-window capture (used when the log has no timestamps to locate the
    window; see :mod:`.window`). ``comms``: the log's ``comms`` table; its logged ``commId``s
    link communicators to NCCL's NVTX communicator ids (NCCL >= 2.26.2) where the export has no
    init ranges (a windowed capture). ``tuning``: the log's ``tuning`` table; a call's own TUNING
    line (channels, algorithm) constrains its kernel where the run bears those facts out
    (:class:`~.default.TuningFacts`). ``iteration_marks``: Megatron's iteration lines in this
    log (:func:`~nccltrace.megatron.training_log.iteration_lines`); they number the log's training
    steps for ``capture_steps``. ``carried_tuning``: what rank 0's TUNING lines say of this
    process's calls on the communicators it is not rank 0 of (communicator pointer ->
    :func:`~.tuning_carry.donor_facts`), used as the process's own where the call is the same
    one for certain (:mod:`.tuning_carry`). Returns a table with ``ALIGNMENT_SCHEMA``."""
    if mode not in MODES:
        raise ValueError(f"unknown alignment mode {mode!r}; use one of {', '.join(MODES)}")
    kernels = kernels[is_nccl_kernel(kernels["short_name"].astype(object))]
    carried = None
    if tuning is not None or carried_tuning is not None:
        calls = attach_tuning(calls, tuning)
    if carried_tuning is not None:
        calls, carried = carry_tuning(calls, carried_tuning)
    if mode == "default":
        table = _align_default(calls, kernels, utc_offset_ns, params or AlignParams(), launches_without_kernel,
                               _version_tuple(nccl_version), quality, capture_steps, nvtx, comms, iteration_marks)
        for check in (quality or {}).get("checks", []):
            if check.get("check") == "tuning":
                check["carried_from_rank0"] = carried  # calls whose TUNING facts came from rank 0's lines
        return table
    if mode == "thesis":
        return _align_thesis(calls, kernels)
    return _align_exact(calls, kernels, nvtx, utc_offset_ns, _version_tuple(nccl_version), capture_steps, quality,
                        comms, iteration_marks)


def _version_tuple(v: str | None) -> tuple[int, int, int] | None:
    try:
        return NcclVersion.parse(v).tuple if v else None
    except ValueError:
        return None


def _align_default(calls, kernels, utc_offset_ns, params, launches_without_kernel=None,
                   version=None, quality: dict | None = None,
                   capture_steps: tuple[int, int] | None = None, nvtx: pd.DataFrame | None = None,
                   comms: pd.DataFrame | None = None, marks: pd.DataFrame | None = None) -> pd.DataFrame:  # fmt: skip
    graph = graph_replayed(kernels)
    replayed, kernels = kernels[graph], kernels[~graph]
    ks = build_kernel_sequence(kernels, utc_offset_ns=utc_offset_ns, launches_without_kernel=launches_without_kernel)
    units, window = locate_capture(calls, ks, version, capture_steps, nvtx, marks)
    family_note = _borrowed_families(units, ks)
    res = align_units(units, ks, params)
    graph_gaps = 0
    if len(replayed) and units.placeholder.any():
        keep = _not_graph_gaps(units, res.stream_map, replayed)
        if not keep.all():  # opCount gaps of graph replays: no lost line, and no kernel left to take
            graph_gaps = int((~keep).sum())
            units = units.permuted(np.flatnonzero(keep))
            res = align_units(units, ks, params)
    cu = units.call_unit
    has_unit = cu >= 0
    call_kernel = np.full(len(cu), -1, np.int64)
    call_kernel[has_unit] = res.kernel[cu[has_unit]]
    reason = units.call_reason.copy()
    amb = np.zeros(len(cu), bool)
    amb[has_unit] = res.ambiguous[cu[has_unit]]
    reason[has_unit & (call_kernel < 0)] = "no_kernel"
    reason[amb] = "ambiguous"
    demoted = np.full(len(cu), None, object)
    demoted[has_unit] = res.contradicted[cu[has_unit]]
    reason[pd.notna(demoted)] = demoted[pd.notna(demoted)]
    conf = np.zeros(len(cu))
    conf[has_unit] = res.confidence[cu[has_unit]]
    method = np.full(len(cu), None, object)
    method[has_unit] = res.method[cu[has_unit]]
    nvtx_check = _apply_nvtx(units, ks, kernels, nvtx, launches_without_kernel, call_kernel, reason, conf, method,
                             utc_offset_ns, window, comms)
    lost = np.zeros(len(cu), bool)
    lost[call_kernel >= 0] = ks.placeholder[call_kernel[call_kernel >= 0]]
    reason[lost] = "kernel_record_missing"
    captured = np.zeros(len(cu), bool)
    if "capture_span" in ks.kernels:
        in_capture = ks.kernels["capture_span"].notna().to_numpy(bool)
        captured[call_kernel >= 0] = in_capture[call_kernel[call_kernel >= 0]]
        captured &= lost
        reason[captured] = GRAPH_CAPTURED_REASON
    if quality is not None:
        window["confirmed"] = int((res.kernel >= 0).sum())
        checks = [window, *(f for c in res.checks for f in _with_findings(c, calls, version)), nvtx_check,
                  _log_gaps(units, _process_name(calls)),
                  _kernel_args_check(units, ks, call_kernel, cu)]
        if len(replayed) or captured.any():
            n_cap = int(captured.sum())  # duplicate lines have no launch unit, so none is counted twice
            checks.append({"check": "cuda_graph", "applicable": True, "confirmed": 0, "contradicted": 0,
                           "not_checkable": len(replayed), "message": (
                f"{_process_name(calls)}: {n_cap} call(s) were captured into CUDA graphs (their launches lie "
                f"inside cudaStreamBeginCapture..EndCapture: reason '{GRAPH_CAPTURED_REASON}') and "
                f"{len(replayed)} NCCL kernels were launched by graph replays (cudaGraphLaunch: kernel rows with "
                "reason 'graph_replay'); a captured call is logged once and runs on every replay, so no line is "
                "matched to a replayed kernel and the graphed collectives have no times or bandwidths in the ops "
                "table" + (f"; {graph_gaps} gap(s) in the opCounts of communicators whose kernels graph replays run "
                           "are those replays (NCCL counts each replay of a plan with network work), not lost lines"
                           if graph_gaps else ""))})  # fmt: skip
        quality.update(mode="default", stream_map={f"0x{k:x}": v for k, v in res.stream_map.items()},
                       checks=checks, kernel_families=family_note,
                       process_groups=_process_groups(units.calls, call_kernel, ks))
    table = _assemble(units.calls, call_kernel, cu, reason, conf, method, ks.kernels, "default", lost=lost,
                      placeholder=ks.placeholder)
    table["steps_verified"] = _steps_verified(window, table)
    if len(replayed):
        extra = _assemble(units.calls.iloc[0:0], np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, object),
                          np.zeros(0), np.zeros(0, object), replayed.reset_index(drop=True), "default")
        extra["reason"] = "graph_replay"
        extra["host"] = table["host"].dropna().iloc[0] if table["host"].notna().any() else None
        table = pd.concat([table, extra], ignore_index=True)
    return table


def _with_findings(check: dict, calls: pd.DataFrame, version: tuple[int, int, int] | None) -> list[dict]:
    """A check's record, with the finding to print where it stood down: the TUNING evidence's
    message, or a ``log_time_stood_down`` record after the log-time check's."""
    if not check.get("stood_down"):
        return [check]
    if check.get("check") == "log_time":
        sd, proc = check["stood_down"], _process_name(calls)
        what = (f"aligned with the log's timestamps only {sd['matched_timed']} of {sd['lines']} launch units matched, "
                f"without them {sd['matched_untimed']}, so time was not used to match or demote")
        return [check, {"check": "log_time_stood_down", "applicable": True, "message": (
            f"{proc}: log time stood down: {what}. Likely causes: the host clock stepped or drifted during the run "
            "(NTP), or the log and the export were written on different hosts' clocks")}]  # fmt: skip
    if check.get("check") != "tuning":
        return [check]
    f = check["facts"]
    counts = {"channels = grid": (f["grid_disagree"], f["grid_agree"] + f["grid_disagree"]),
              "algorithm = kernel name": (f["algo_disagree"], f["algo_agree"] + f["algo_disagree"])}
    what = "; ".join(f"{name}: {counts[name][0]} of {counts[name][1]} certain matches disagree"
                     for name in check["stood_down"])
    build = "NCCL " + ".".join(map(str, version)) if version else "this NCCL build"
    return [{**check, "message": (
        f"{_process_name(calls)}: what TUNING lines say of a call's kernel does not hold on this run ({what}; "
        f"{build}), so it was not used as evidence (no match depends on it). Verified on NCCL 2.28.9; if this build "
        "prints TUNING lines differently, report it with the log")}]  # fmt: skip


def _steps_verified(window: dict, table: pd.DataFrame) -> pd.arrays.BooleanArray:
    """The ``steps_verified`` column: set on the call rows of a partial capture located in the log."""
    out = pd.array([pd.NA] * len(table), dtype="boolean")
    if window.get("located_by") is None or not window.get("outside"):
        return out
    verified = window["located_by"] != "declared_steps" or bool(window.get("iterations_verified", True))
    out[(table["row_kind"] == "call").to_numpy(bool)] = verified
    return out


def _process_groups(calls: pd.DataFrame, call_kernel: np.ndarray, ks) -> list[dict]:
    """Per communicator of the process: the PyTorch process groups its matched calls' kernels
    name (a profiler trace records each NCCL kernel's ``pg_name``/``pg_desc``) with how many
    calls name each; the run joins them into communicator names (:mod:`nccltrace.communicators.names`)."""
    k = ks.kernels
    if "pg_name" not in k or not len(calls):
        return []
    hit = call_kernel >= 0
    hit[hit] = ~ks.placeholder[call_kernel[hit]]
    if not hit.any():
        return []
    j = call_kernel[hit]
    t = pd.DataFrame({"comm": calls["comm"].astype("UInt64").to_numpy()[hit],
                      "pg_name": k["pg_name"].astype(object).to_numpy()[j],
                      "pg_desc": k["pg_desc"].astype(object).to_numpy()[j] if "pg_desc" in k else None})
    t = t[t["pg_name"].notna() & t["comm"].notna()]
    out = []
    for comm, g in t.groupby("comm", sort=True):
        counts = g.groupby(["pg_name", "pg_desc"], dropna=False).size()
        out.append({"comm": f"0x{int(comm):x}", "groups": [
            {"pg_name": str(n), "pg_desc": None if pd.isna(d) else str(d), "calls": int(c)}
            for (n, d), c in counts.items()]})  # fmt: skip
    return out


def _kernel_args_check(units, ks, call_kernel: np.ndarray, cu: np.ndarray) -> dict:
    """The kernel's own record of its call (a profiler trace's collective element counts) against
    each match: the alignment never pairs a unit with a kernel whose record names another count,
    so this counts the matches that record confirms and those it cannot test (no record: a
    batched Send/Recv, an nsys export)."""
    from nccltrace.align.default import kernel_count_key, unit_count_key

    kkey = kernel_count_key(ks)
    out = {"check": "kernel_args", "applicable": bool((kkey >= 0).any()), "confirmed": 0, "contradicted": 0,
           "not_checkable": 0}
    if not out["applicable"]:
        return out
    ukey = unit_count_key(units)
    matched = np.flatnonzero((call_kernel >= 0) & (cu >= 0))
    uk, kk = ukey[cu[matched]], kkey[call_kernel[matched]]
    both = (uk >= 0) & (kk >= 0)
    out.update(confirmed=int((both & (uk == kk)).sum()), contradicted=int((both & (uk != kk)).sum()),
               not_checkable=int((~both).sum()))
    return out


def _not_graph_gaps(units, stream_map: dict[int, int], replayed: pd.DataFrame) -> np.ndarray:
    """Units to keep: all but the opCount-gap placeholders that CUDA graph replays explain. A
    replay of a captured plan with network work advances its communicator's opCount with no line
    (src/enqueue.cc ``hostStreamPlanTask``), so the log shows a gap where the replay ran; its
    kernel is a replay's (taken out of the alignment), so the placeholder has nothing to take but a
    neighbour's kernel. A communicator's placeholders are the replays' when its calls' stream
    (learned by the alignment) carries at least as many replayed kernels as it has gaps; else
    all stay (lines may be lost there too)."""
    keep = np.ones(units.n, bool)
    ph = np.flatnonzero(units.placeholder)
    per_stream = replayed["stream_id"].dropna().astype("int64").value_counts().to_dict()
    for comm in np.unique(units.comm[ph]):
        mine = ph[units.comm[ph] == comm]
        stream = stream_map.get(int(units.streams[units.stream[mine[0]]]))
        if stream is not None and len(mine) <= per_stream.get(int(stream), 0):
            keep[mine] = False
    return keep


def _log_gaps(units, process: str) -> dict:
    """Call lines missing from the log, known from gaps in a communicator's opCounts (the
    aligner holds a placeholder for each): the calls are not in the ops table, so counts and
    volumes miss them. Named in the console, and the run is partial."""
    ph = np.flatnonzero(units.placeholder)
    out = {"check": "log_gaps", "applicable": bool(units.informative_comm.any()), "confirmed": 0,
           "contradicted": 0, "not_checkable": len(ph)}
    if not len(ph):
        return out
    real = np.flatnonzero(~units.placeholder)
    before = real[np.searchsorted(real, ph) - 1] if len(real) else np.zeros(0, np.int64)
    lines = [int(units.calls["line"].iat[int(units.first_call[u])]) for u in before[before >= 0]
             if units.first_call[u] >= 0] if len(real) else []
    comms = len(np.unique(units.comm[ph]))
    where = f", first after line {min(lines)}" if lines else ""
    out["message"] = (f"{process}: {len(ph)} call line(s) missing from the log (gaps in the opCounts of {comms} "
                      f"communicator(s){where}): the log lost lines (copied while the job ran, a dropped block, a "
                      "full disk); those calls are not in the ops table, so counts and volumes miss them, and their "
                      "kernels are rows without a log line. What to do: analyse the complete log")
    return out


def graph_replayed(kernels: pd.DataFrame) -> np.ndarray:
    """Kernels a CUDA graph replay launched (``cudaGraphLaunch``, or a graph node id): their
    calls were logged once, when the graph was captured, so no log line stands for them."""
    mask = np.zeros(len(kernels), bool)
    if "launch_api" in kernels:
        mask |= kernels["launch_api"].astype("string").str.contains("GraphLaunch", regex=False).fillna(False)\
            .to_numpy(bool)
    if "graph_node_id" in kernels:
        mask |= (kernels["graph_node_id"].astype("Int64").fillna(0) > 0).to_numpy(bool)
    return mask


_BORROWABLE = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce")
_MIN_BORROW_UNITS = 8


def _borrowed_families(units, ks) -> list[dict]:
    """Kernel family as evidence, not a wall, where a build breaks the naming rule: some builds
    run AllReduce/AllGather/ReduceScatter through ``SendRecv`` kernels. When the log has at
    least ``_MIN_BORROW_UNITS`` launches of a collective, the export has no kernel of its
    family at all, and there are more SendRecv kernels than P2P launches to explain, those
    launches may match SendRecv kernels (in place, on the units' family masks). The stream,
    time and size evidence then decide; the finding is recorded in the quality record."""
    from nccltrace.align.sequences import FAMILY_CODE

    sr = FAMILY_CODE["SendRecv"]
    real = ~units.placeholder
    n_sr_kernels = int((ks.family == sr).sum())
    n_p2p = int((units.p2p & real).sum())
    notes = []
    for fam in _BORROWABLE:
        bit = 1 << FAMILY_CODE[fam]
        sel = real & (units.fam_mask == bit)
        if sel.sum() < _MIN_BORROW_UNITS or (ks.family == FAMILY_CODE[fam]).any() or n_sr_kernels <= n_p2p:
            continue
        units.fam_mask[sel] |= 1 << sr
        notes.append({"op": fam, "runs_on": "SendRecv", "launches": int(sel.sum()),
                      "sendrecv_kernels": n_sr_kernels, "p2p_launches": n_p2p})
    return notes


def locate_capture(calls: pd.DataFrame, ks, version, capture_steps: tuple[int, int] | None,
                   nvtx: pd.DataFrame | None = None, marks: pd.DataFrame | None = None):
    """Where the export's capture sits in this process's log, before any alignment: the launch
    units of the lines that can have their kernel in the export and the ``capture_window``
    quality record (with the capture's wall-clock span when log time located it). Lines outside get
    ``outside_capture``; when nothing locates a partial capture (or a partial log), every line
    gets ``capture_not_located``; a process with nothing in its export, ``not_in_export``.
    ``marks``: Megatron's iteration lines in the log, which number its steps for declared ones."""
    span = capture_span(ks)
    units = build_log_units(calls, nccl_version=version, capture_ns=span)
    has_time = calls["wall_time_ns"].notna().to_numpy(bool) if "wall_time_ns" in calls else np.zeros(len(calls), bool)
    timed = span is not None and len(calls) > 0 and has_time.mean() > 0.5
    window = {"check": "capture_window", "applicable": True, "confirmed": 0, "contradicted": 0, "not_checkable": 0,
              "located_by": "log_time" if timed else None, "outside": 0, "message": None}
    if timed and ks.m > 0 and not (~units.placeholder).any():
        # every timed line lies outside the export's span: the two clocks cannot both be right
        wall = calls["wall_time_ns"].astype("Int64").dropna() if "wall_time_ns" in calls else pd.Series([], "Int64")
        lo, hi = (int(wall.min()), int(wall.max())) if len(wall) else (NO_TIME, NO_TIME)
        window.update(located_by=None, message=(
            f"{_process_name(calls)}: none of the log's timed call lines ({_utc(lo)} .. {_utc(hi)}) falls in the "
            f"kernel trace's UTC span ({_utc(span[0])} .. {_utc(span[1])}; {abs(span[0] - lo) / 1e9:,.1f} s apart): "
            "the log and the trace cannot both be on UTC. Likely causes: a trace of another run, a trace whose time "
            "base was misread (nsys >= 2025 stores times on the host's monotonic clock, anchored by systemClockNs), "
            "or a host clock that far off; its calls are left unmatched"))
        from dataclasses import replace as _replace

        # not known to lie outside the capture: their place in it cannot be told
        cr = units.call_reason.copy()
        cr[cr == OUTSIDE_CAPTURE_REASON] = "capture_not_located"
        return _abstain(_replace(units, call_reason=cr), "capture_not_located"), window
    if ks.m == 0:
        # no NCCL kernel or launch of this process in its export: not profiled (a rank subset)
        # or nothing captured; its calls are analysed from the log alone
        window.update(applicable=False, located_by=None, message=(
            f"{_process_name(calls)}: its node's export holds no NCCL kernel or launch of this process (a rank "
            "the capture did not profile, or nothing was captured): analysed from its log alone (counts, volumes, "
            "communicators), no times or bandwidths"))
        units = _abstain(units, NOT_IN_EXPORT_REASON)
    elif not timed:
        real = int((~units.placeholder).sum())
        steps = trace_steps(ks.kernels, nvtx, _process_pid(calls))
        partial_capture = window_unlocated(real, ks.m) or log_unlocated(real, ks.m)
        # a trace that covers the whole log needs no locating (its step markers included)
        found = (locate_by_trace(units, ks, steps, None if steps is not None else capture_steps, marks)
                 if (partial_capture or capture_steps is not None) else None)  # fmt: skip
        if found is not None and found.outside is not None:
            units = build_log_units(units.calls, nccl_version=version, outside=found.outside)
            said = f"{_process_name(calls)}: {found.message}" if found.message else None
            window.update(located_by=found.located_by, trace_offset=found.offset, trace_candidates=found.candidates,
                          first_step=found.first_step,
                          message=said or _declared_vs_trace(calls, capture_steps, found))
        elif capture_steps is not None and found is not None and steps is None and found.candidates:
            # the trace's sequence fits the log, but not so that the declared steps are verified
            window.update(located_by=None, message=f"{_process_name(calls)}: {found.message}; its calls are left "
                                                   "unmatched")
            units = _abstain(units, "capture_not_located")
        elif capture_steps is not None:
            units, window = _locate_steps(units, calls, version, capture_steps, window, marks)
            if found is not None and steps is not None:
                window["message"] = "; ".join(x for x in (window.get("message"), (
                    f"{_process_name(calls)}: the kernel trace's own evidence did not locate its window ("
                    f"{found.message}); the declared steps were used")) if x)
        elif partial_capture:
            msg = unlocated_message(_process_name(calls), real, ks.m)
            if found is not None and found.message:
                msg += f" (the trace's own evidence: {found.message})"
            window.update(located_by=None, message=msg)
            units = _abstain(units, "capture_not_located")
        else:
            window.update(applicable=False)
    window["outside"] = int((units.call_reason == "outside_capture").sum())
    if window["located_by"] == "log_time":
        window["span_utc_ns"] = list(span)
    if window["located_by"] is not None and window["outside"]:
        # where the window lies in the log, to show: its first and last line
        inside = units.calls.loc[units.call_reason != "outside_capture", "line"]
        if len(inside):
            window["lines"] = [int(inside.min()), int(inside.max())]
    return units, window


def _nvtx_window(calls: pd.DataFrame, located: np.ndarray, nvtx: pd.DataFrame, utc_offset_ns: int | None,
                 window: dict) -> np.ndarray:  # fmt: skip
    """Reasons per call with the capture narrowed to the span of the export's NCCL call ranges
    when the log has timestamps: the range matcher explains lines by ranges one for one, so
    its window must be exact, and NCCL writes a call's line during the call, inside its range."""
    from nccltrace.nsys.nccl_api import nccl_range_mask

    located = located.copy()
    if window.get("located_by") != "log_time" or utc_offset_ns is None or "wall_time_ns" not in calls:
        return located
    rng = nvtx[nccl_range_mask(nvtx)]
    if not len(rng):
        return located
    wall = calls["wall_time_ns"].astype("Int64")
    lo = int(rng["start"].min()) + int(utc_offset_ns) - EXACT_WINDOW_SLACK_NS
    hi = int(rng["end"].dropna().max()) + int(utc_offset_ns) + EXACT_WINDOW_SLACK_NS
    # every line outside, whatever else it is (a single-rank call, a duplicate): the matcher
    # would otherwise have to explain it by a range the capture does not hold
    out = (wall.notna() & ((wall < lo) | (wall > hi))).to_numpy(bool)
    located[out] = "outside_capture"
    return located


def _apply_nvtx(units, ks, kernels, nvtx, launches, call_kernel, reason, conf, method, utc_offset_ns=None,
                window=None, comms=None) -> dict:  # fmt: skip
    """NCCL's own NVTX call ranges as evidence (in place on the per-call arrays): a kernel's
    launch lies inside the range of the call that issued it, so where the export has those
    ranges, lines are matched to ranges per thread in call order (``exact.exact_correlation``,
    with or without payloads) and a line matched there gets that kernel exactly. Alignment
    matches it confirms stay; ones it contradicts are replaced by its answer and counted;
    lines it leaves undecided keep the alignment's answer."""
    out = {"check": "nvtx_range", "applicable": False, "confirmed": 0, "contradicted": 0, "not_checkable": 0}
    from nccltrace.align.exact import ExactCorrelationError, exact_correlation
    from nccltrace.nsys.nccl_api import nccl_range_mask

    if nvtx is None or len(nvtx) == 0 or not nccl_range_mask(nvtx).any() or ks.m == 0:
        out["not_checkable"] = int((call_kernel >= 0).sum())
        return out
    calls = units.calls
    located = _nvtx_window(calls, units.call_reason, nvtx, utc_offset_ns, window or {})
    eligible = ~pd.Series(located).isin(_NOT_CAPTURED).to_numpy()
    try:
        ex = exact_correlation(calls[eligible], kernels, nvtx, comms=comms, lost_launches=launches,
                               require_payloads=False)
    except (ExactCorrelationError, ValueError, KeyError) as e:  # ranges it cannot use: say so, decide nothing
        out.update(message=f"NCCL NVTX ranges present but not usable: {e}")
        out["not_checkable"] = int((call_kernel >= 0).sum())
        return out
    m = ex.call_matches
    got = m[m["reason"].isna() & m["kernel_correlation_id"].notna()]
    # the matched lines' rows and their kernels' positions in the kernel sequence (real kernels
    # only: a lost launch's placeholder shares its correlation id)
    rows = pd.MultiIndex.from_arrays([calls["file"], calls["line"]]).get_indexer(
        pd.MultiIndex.from_arrays([got["file"], got["line"]]))
    gpid = ks.kernels["global_pid"].astype("Int64").fillna(-1).to_numpy(np.int64)
    corr = ks.kernels["correlation_id"].astype("Int64").fillna(-1).to_numpy(np.int64)
    kidx = pd.MultiIndex.from_arrays([gpid, corr])
    # keys no line may take (placeholders, a repeated key) become unique negatives
    corr = np.where(ks.placeholder | kidx.duplicated(keep=False), -2 - np.arange(len(corr)), corr)
    kidx = pd.MultiIndex.from_arrays([gpid, corr])
    js = kidx.get_indexer(pd.MultiIndex.from_arrays([got["kernel_global_pid"].astype("int64").to_numpy(),
                                                     got["kernel_correlation_id"].astype("int64").to_numpy()]))
    nv = np.full(len(calls), -1, np.int64)
    ok = (rows >= 0) & (js >= 0)
    nv[rows[ok]] = js[ok]
    decided = nv >= 0
    dp = call_kernel.copy()
    agree = decided & (dp == nv)
    differ = decided & (dp >= 0) & (dp != nv)
    call_kernel[decided] = nv[decided]
    reason[decided] = None
    conf[decided] = 1.0
    method[decided & ~agree] = "nvtx"
    out.update(applicable=True, confirmed=int(agree.sum()), contradicted=int(differ.sum()),
               not_checkable=int(((dp >= 0) & ~decided).sum()), nvtx_decided=int(decided.sum()),
               filled=int((decided & (dp < 0)).sum()))  # fmt: skip
    if differ.any():
        out["message"] = (f"{int(differ.sum())} alignment match(es) disagreed with NCCL's NVTX call ranges and were "
                          f"replaced by the ranges' exact answer; {out['not_checkable']} match(es) the ranges could "
                          "not decide rest on the alignment alone")
    return out


# How long before the first captured launch a line may have been written and still be its
# call (a group's lines precede its ncclGroupEnd), and how far the log's clock may be from the
# export's UTC after conversion.
CAPTURE_LEAD_NS = 2_000_000
CAPTURE_CLOCK_SLACK_NS = 1_000_000
# Exact mode: a line is written inside its call's NVTX range; this much clock disagreement
# between the log's clock and the export's UTC (two microsecond ticks) is allowed at the window's edges.
EXACT_WINDOW_SLACK_NS = 2_000


def capture_span(ks) -> tuple[int, int] | None:
    """Wall-clock span (UTC ns) in which a call line can have its kernel in this export: from
    a little before the first launch to the last (NCCL launches after it logs). None when the
    kernels have no UTC time (no session anchor)."""
    t = ks.time[ks.time != NO_TIME]
    if len(t) == 0:
        return None
    return int(t.min()) - CAPTURE_LEAD_NS, int(t.max()) + CAPTURE_CLOCK_SLACK_NS


def _process_name(calls: pd.DataFrame) -> str:
    host = calls["host"].dropna().iloc[0] if "host" in calls and calls["host"].notna().any() else "?"
    pid = calls["pid"].dropna().iloc[0] if "pid" in calls and calls["pid"].notna().any() else "?"
    return f"{host}:{pid}"


def _utc(ns: int) -> str:
    import datetime as _dt

    if ns == NO_TIME:
        return "?"
    t = _dt.datetime.fromtimestamp(ns // 1_000_000_000, tz=_dt.timezone.utc)
    return f"{t:%Y-%m-%d %H:%M:%S}.{ns % 1_000_000_000:09d} UTC"


def _process_pid(calls: pd.DataFrame) -> int | None:
    return int(calls["pid"].dropna().iloc[0]) if "pid" in calls and calls["pid"].notna().any() else None


def _declared_vs_trace(calls: pd.DataFrame, declared: tuple[int, int] | None, found) -> str | None:
    """What to say when a window located from the trace's evidence meets declared steps: the
    declared ones are checked against the profiler's step markers, and a contradiction named."""
    if declared is None or found.first_step is None or declared[0] == found.first_step:
        return None
    lo, hi = declared
    return (f"{_process_name(calls)}: the declared capture steps (loop iterations {lo}-{hi}, 0-based) contradict the "
            f"profiler's step markers, which put the trace's first step at iteration {found.first_step}; the "
            "window was located by the trace's own evidence, not by the declared steps")


def _abstain(units, reason: str):
    """The same calls with no launch unit: every call that needed a kernel gets ``reason``."""
    from dataclasses import replace

    cr = units.call_reason.copy()
    cr[(units.call_unit >= 0)] = reason
    keep = np.zeros(units.n, bool)
    return replace(units.permuted(np.flatnonzero(keep)), call_reason=cr,
                   call_unit=np.full(len(units.call_unit), -1, np.int64))


def _locate_steps(units, calls, version, steps: tuple[int, int], window: dict, marks: pd.DataFrame | None = None):
    """Keep the lines of the declared steps (0-based, inclusive), found from the log's periodic
    structure and numbered by Megatron's iteration lines where the log has them (``marks``), else
    by the calls made once per step; abstain (reason ``capture_not_located``) when the log has no
    step structure."""
    sorted_calls = units.calls
    live = sorted_calls["duplicate_of"].isna().to_numpy() if "duplicate_of" in sorted_calls else np.ones(
        len(sorted_calls), bool)
    sl = step_lines(sorted_calls[live])
    lo, hi = steps
    # steps completed before the periodic region: an irregular first iteration still counts
    offset = steps_before_periodic(sorted_calls[live], sl) if sl is not None else 0
    numbered, disagree, by = f"{offset} irregular first step(s)", None, "step_structure"
    if sl is not None and marks is not None and len(marks):
        by_lines, disagree = steps_before_by_lines(sorted_calls.loc[live, "line"].to_numpy(np.int64), sl, marks)
        if by_lines is not None:
            numbered = (f"numbered by Megatron's iteration lines in the log ({by_lines} iteration(s) before its "
                        "periodic part" + ("" if by_lines == offset else
                                           f"; the calls made once per step alone counted {offset}") + ")")
            offset, by = by_lines, "megatron_iterations"
    if sl is None or hi >= sl.steps + offset or lo < offset:
        why = ("its calls do not repeat step after step (a damaged log, an irregular schedule or evaluation steps)"
               if sl is None else
               f"the log's first {offset} step(s) differ from the rest and cannot be delimited" if lo < offset else
               f"the log holds {sl.steps + offset} training steps, the declared range ends at step {hi + 1}")
        window.update(located_by=None, message=f"{_process_name(calls)}: the declared capture steps cannot be found "
                      f"in the log: {why}; its calls are left unmatched. Remedy: log timestamps (NCCL >= 2.26 with "
                      "NCCL_DEBUG_TIMESTAMP_FORMAT)")
        return _abstain(units, "capture_not_located"), window
    step = np.full(len(sorted_calls), -1, np.int64)
    step[np.flatnonzero(live)] = np.where(sl.step >= 0, sl.step + offset, -1)
    # a duplicate line belongs to the step of the line it repeats (the previous live line)
    idx = np.maximum.accumulate(np.where(live, np.arange(len(live)), 0))
    step = step[idx]
    outside = (step < lo) | (step > hi)
    units = build_log_units(sorted_calls, nccl_version=version, outside=outside)
    window.update(located_by="declared_steps", period=sl.period, log_steps=sl.steps + offset, first_step=lo,
                  iterations_verified=False, steps_numbered_by=by, message="; ".join(x for x in (
        f"{_process_name(calls)}: the declared capture steps (Megatron iterations {lo + 1}-{hi + 1}) were located from "
        f"the log's step structure ({sl.period} calls per step, {numbered}): the trace's kernel sequence could not be "
        "placed in the log to confirm them, so the iteration numbers are unverified. Remedy: profiler step markers or "
        "log timestamps", disagree and f"{_process_name(calls)}: {disagree}; the step structure's count was used")
        if x))  # fmt: skip
    return units, window


def _align_thesis(calls, kernels) -> pd.DataFrame:
    from nccltrace.align.thesis import align_thesis

    calls = calls.sort_values(["file", "line"], kind="stable").reset_index(drop=True)
    k = kernels.sort_values(["start", "correlation_id"], kind="stable").reset_index(drop=True)  # GPU start order
    fam = k["short_name"].astype(object).str.extract(r"nccl(?:Dev)?Kernel_([a-zA-Z0-9]+)[_(]?", expand=False)
    k_ops = fam.fillna("unknown").tolist()
    res = align_thesis(k_ops, calls["op"].astype(object).fillna("unknown").tolist())
    call_kernel = np.full(len(calls), -1, np.int64)
    for kj, li in res.matched_pairs():
        call_kernel[li] = kj
    reason = np.where(call_kernel >= 0, None, "no_kernel").astype(object)
    conf = np.ones(len(calls))
    method = np.full(len(calls), "thesis-nw", object)
    return _assemble(calls, call_kernel, np.full(len(calls), -1, np.int64), reason, conf, method, k, "thesis")


def _align_exact(calls, kernels, nvtx, utc_offset_ns=None, version=None, capture_steps=None,
                 quality: dict | None = None, comms: pd.DataFrame | None = None,
                 marks: pd.DataFrame | None = None) -> pd.DataFrame:  # fmt: skip
    """Exact mode: NVTX payload ranges, on the lines the capture can hold (``locate_capture``:
    a windowed export explains only its window's lines)."""
    from nccltrace.align.exact import exact_correlation

    if nvtx is None:
        raise ValueError("exact mode needs the export's NVTX ranges with NCCL payloads (nvtx table)")
    k = kernels.reset_index(drop=True)
    units, window = locate_capture(calls, build_kernel_sequence(k, utc_offset_ns=utc_offset_ns), version,
                                   capture_steps, nvtx, marks)  # fmt: skip
    calls = units.calls  # sorted by file, line
    located = _nvtx_window(calls, units.call_reason, nvtx, utc_offset_ns, window)
    window["outside"] = int((located == "outside_capture").sum())
    eligible = ~pd.Series(located).isin(_NOT_CAPTURED).to_numpy()
    ex = exact_correlation(calls[eligible], k, nvtx, comms=comms)
    m = ex.call_matches
    key = dict(zip(zip(k["global_pid"].astype("Int64"), k["correlation_id"].astype("Int64")), range(len(k))))
    lookup = m.set_index(["file", "line"])
    call_kernel = np.full(len(calls), -1, np.int64)
    reason = np.full(len(calls), None, object)
    for r, (f, ln) in enumerate(zip(calls["file"], calls["line"])):
        if not eligible[r]:
            reason[r] = located[r]
            continue
        if (f, ln) not in lookup.index:
            reason[r] = "no_nvtx_range"
            continue
        row = lookup.loc[(f, ln)]
        if isinstance(row, pd.DataFrame):
            row = row.iloc[0]
        if pd.notna(row["kernel_correlation_id"]):
            call_kernel[r] = key.get((row["kernel_global_pid"], row["kernel_correlation_id"]), -1)
        reason[r] = None if call_kernel[r] >= 0 else row["reason"]
    if quality is not None:
        window["confirmed"] = int((call_kernel >= 0).sum())
        quality.update(mode="exact", checks=[window])
    conf = np.ones(len(calls))
    method = np.full(len(calls), "nvtx", object)
    return _assemble(calls, call_kernel, np.full(len(calls), -1, np.int64), reason, conf, method, k, "exact")


def family_name(code: int) -> str:
    """Name of a kernel family code."""
    return "Generic" if code == GENERIC else FAMILIES[code]


def _own_process(calls: pd.DataFrame, process: str) -> tuple[int, pd.DataFrame]:
    """The process a log stands for and the calls of other processes in it. A log written by
    ``NCCL_DEBUG_FILE`` holds one process; lines of several (a shared file, or stdout of all
    ranks) cannot be aligned against one process's kernels. The process the file is named
    for (``nccl_<host>_<pid>``), else the one with most calls, is aligned; the others' calls
    are returned to be reported, never matched."""
    counts = calls["pid"].dropna().astype("int64").value_counts()
    if counts.empty:
        raise ValueError(f"{process}: no call line carries a process id")
    try:
        named = process_key(process)[1]
    except ValueError:
        named = None
    pid = int(named) if named in counts.index else int(counts.index[0])
    return pid, calls[calls["pid"].notna() & (calls["pid"] != pid)]


def _foreign_rows(foreign: pd.DataFrame, nccl_version: str | None) -> pd.DataFrame:
    """Correlation rows for the calls of other processes in a log: unmatched, with the reason."""
    rows = align_process(foreign, pd.DataFrame(columns=["short_name", "correlation_id", "start", "pid"]),
                         mode="default", nccl_version=nccl_version)  # fmt: skip
    rows = rows[rows["row_kind"] == "call"].copy()
    rows["status"], rows["reason"] = "unmatched", FOREIGN_PROCESS_REASON
    return rows


def _foreign_check(foreign: pd.DataFrame, process: str, pid: int) -> dict:
    pids = sorted(int(p) for p in foreign["pid"].unique())
    lines = foreign["line"].astype("int64")
    return {"check": "one_process_per_log", "applicable": True, "confirmed": 0, "contradicted": 0,
            "not_checkable": len(foreign), "message": (
                f"{process}: the log holds call lines of {len(pids) + 1} processes (pid {pid} and "
                f"{', '.join(map(str, pids[:5]))}{' ...' if len(pids) > 5 else ''}; first foreign "
                f"call line {int(lines.min())}); pid {pid}'s calls were aligned, the "
                f"{len(foreign)} call(s) of the others are unmatched ('{FOREIGN_PROCESS_REASON}'). What to do: give "
                "each process its own log (NCCL_DEBUG_FILE=nccl_%h_%p.log) or split this file by the pid of each "
                "line's 'host:pid:tid' prefix")}  # fmt: skip


def align_files(calls_path, kernels_path, session_path, out_path, *, mode: str = "default",
                nvtx_path=None, launches_path=None, pid: int | None = None,
                nccl_version: str | None = None, export_available: bool = True,
                quality_path=None, capture_steps: tuple[int, int] | None = None,
                carried_tuning: Mapping[int, pd.DataFrame] | None = None) -> pd.DataFrame:  # fmt: skip
    """Stage entry point: align one process's parsed calls with its node's parsed kernels and
    write the correlation table atomically. ``pid`` defaults to the pid of the calls; the NCCL
    version defaults to the process's version line (``versions.parquet`` beside the calls).
    ``export_available=False`` (the node's export is missing or unreadable; ``kernels_path`` is
    then an empty table): every call that needed a kernel is unmatched with reason
    ``'no_export'``, the others keep reasons that need no export (duplicates, single-rank).
    ``quality_path``: where to write the process's alignment-quality record (default
    ``alignment_quality.json`` beside ``out_path``); ``capture_steps``, ``carried_tuning``: see
    :func:`align_process`."""
    import json
    from pathlib import Path

    import pyarrow.parquet as pq

    from nccltrace.core.tables import nullable_types, read_table, write_table_atomic
    from nccltrace.megatron.training_log import read_iteration_lines

    calls = read_table(calls_path)
    foreign = calls.iloc[0:0]
    if pid is None:
        pid, foreign = _own_process(calls, Path(calls_path).parent.name)
        calls = calls[calls["pid"] == pid] if len(foreign) else calls
    # 64-bit ids stay exact (nullable integers); strings and floats keep numpy dtypes for the kernels
    kernels = pq.read_table(kernels_path, filters=[("pid", "=", pid)]).to_pandas(
        types_mapper=nullable_types(only=(pa.int64(), pa.uint64())).get
    )
    utc = None
    if session_path is not None and Path(session_path).exists():
        utc = json.loads(Path(session_path).read_text()).get("utc_offset_ns")
    nvtx = None
    if nvtx_path is not None:
        nvtx = pq.read_table(nvtx_path, filters=[("pid", "=", pid)]).to_pandas()
    launches = None
    if launches_path is not None and Path(launches_path).exists():
        launches = read_table(launches_path)
        launches = launches[launches["pid"] == pid]
    if nccl_version is None:
        vfile = Path(calls_path).parent / "versions.parquet"
        if vfile.exists():
            v = read_table(vfile)
            nccl_version = str(v["version"].dropna().iloc[0]) if v["version"].notna().any() else None
    comms_path = Path(calls_path).parent / COMMS_FILE  # the log's init lines (same parse output)
    comms = read_table(comms_path) if comms_path.exists() else None
    tuning_path = Path(calls_path).parent / "tuning.parquet"
    tuning = read_table(tuning_path) if tuning_path.exists() else None
    # Megatron's iteration lines, filed by the log reader with the application output
    marks = read_iteration_lines(Path(calls_path).parent / "unclassified.parquet") if capture_steps else None
    quality: dict = {"host": str(calls["host"].dropna().iloc[0]) if calls["host"].notna().any() else None,
                     "pid": int(pid), "checks": []}
    if not export_available:
        # Default mode on no kernels keeps the reasons that hold without an export; every other
        # call lacks its kernel only because nothing was exported.
        table = align_process(calls, kernels.iloc[0:0], mode="default", nccl_version=nccl_version)
        table.loc[(table["row_kind"] == "call") & table["reason"].isin(["no_kernel", NOT_IN_EXPORT_REASON]),
                  "reason"] = NO_EXPORT_REASON
    else:
        table = align_process(calls, kernels, mode=mode, utc_offset_ns=utc, nvtx=nvtx,
                              launches_without_kernel=launches, nccl_version=nccl_version, quality=quality,
                              capture_steps=capture_steps, comms=comms, tuning=tuning,
                              carried_tuning=carried_tuning,
                              iteration_marks=marks)  # fmt: skip
    if len(foreign):
        table = pd.concat([table, _foreign_rows(foreign, nccl_version)], ignore_index=True)
        quality["checks"].append(_foreign_check(foreign, Path(calls_path).parent.name, pid))
    from nccltrace.align.quality import QUALITY_FILE, write_quality

    out_path = Path(out_path)
    write_table_atomic(frame_to_table(table, ALIGNMENT_SCHEMA), out_path)
    write_quality(quality_path or out_path.parent / QUALITY_FILE, out_path.parent.name, quality)
    return table
