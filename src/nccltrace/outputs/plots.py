"""Figures of a run and of a campaign (in the spirit of the thesis figures 5.4-5.31).

Run figures show calls, kernels and volumes by function, parallelism and rank, message sizes, a
timeline excerpt and bandwidth per message size; the campaign figure puts all configurations side
by side. They are drawn on the Agg canvas without pyplot (no global state, no display needed),
with fixed styling and no timestamps in the files, so the same inputs give byte-identical PNGs.
Volumes are in binary units (GiB = 2^30 B), which the thesis labels "GB".
"""

from __future__ import annotations

import re
import textwrap
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from nccltrace.core.batch_stats import FirstSeen
from nccltrace.outputs.summary import LARGE_MESSAGE_BYTES, format_bytes_binary

GIB = float(1 << 30)
LARGE_BUCKET = LARGE_MESSAGE_BYTES.bit_length() - 1  # size bucket of the smallest "large" message
DPI = 100
_STYLE = {
    "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8.5,
    "xtick.labelsize": 9, "ytick.labelsize": 9, "axes.spines.top": False, "axes.spines.right": False,
    "axes.grid": True, "axes.axisbelow": True, "grid.alpha": 0.3, "svg.hashsalt": "nccltrace",
    "svg.fonttype": "none", "figure.dpi": DPI, "savefig.dpi": DPI,
}  # fmt: skip

# Fixed colours so a parallelism or function looks the same in every figure of every run.
_PAR_COLORS = {
    "dp": "#1f77b4", "dp-cp": "#4c9be8", "tp": "#d62728", "pp": "#2ca02c", "ep": "#9467bd", "cp": "#8c564b",
    "edp": "#17becf", "tp-ep": "#e377c2", "tp-ep-pp": "#f7b6d2", "mp": "#ff7f0e", "embd": "#bcbd22",
    "embedding": "#bcbd22", "pos-embd": "#dbdb8d", "world": "#7f7f7f", "intra-distopt": "#aec7e8",
    "tp-pp": "#ff9896", "tp-cp": "#c49c94", "collective": "#c7c7c7", "unknown": "#3b3b3b",
}  # fmt: skip
_OP_COLORS = {
    "AllReduce": "#e45756", "AllGather": "#4c78a8", "ReduceScatter": "#72b7b2", "Broadcast": "#f58518",
    "Reduce": "#b279a2", "Send": "#54a24b", "Recv": "#88d27a", "SendRecv": "#54a24b", "AlltoAll": "#9d755d",
    "Gather": "#bab0ac", "Scatter": "#eeca3b",
}  # fmt: skip
_FALLBACK = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39", "#ad494a",
             "#a55194", "#6b6ecf", "#b5cf6b", "#e7ba52", "#d6616b", "#ce6dbd"]  # fmt: skip


# Series colours (tab20 order: strong then light of each hue), for figures whose series are
# combinations (function x parallelism) rather than one fixed name.
_FALLBACK_SERIES = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                    "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
                    "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"]  # fmt: skip


def _color(name: str, table: Mapping[str, str]) -> str:
    # crc32 rather than hash(): stable across processes, so unknown names keep their colour too
    return table.get(name) or _FALLBACK[zlib.crc32(str(name).encode()) % len(_FALLBACK)]


def par_color(name: str) -> str:
    """Colour of a parallelism label."""
    return _color(name, _PAR_COLORS)


def op_color(name: str) -> str:
    """Colour of an NCCL function / kernel type."""
    return _color(name, _OP_COLORS)


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, out_dir: Path, name: str, formats: Sequence[str]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for fmt in formats:
        path = out_dir / f"{name}.{fmt}"
        tmp = path.with_name(f".{path.name}.tmp")
        # no software/date metadata: identical inputs give identical files
        meta = {"Software": None} if fmt == "png" else {"Date": None, "Creator": None}
        fig.savefig(tmp, format=fmt, metadata=meta)
        if fmt == "svg":
            _stable_svg_ids(tmp)
        tmp.replace(path)
        out[path.name] = path
    return out


def _stable_svg_ids(path: Path) -> None:
    """Number the SVG's element ids in order of appearance: the writer derives some clip-path ids
    from object representations that differ between processes, which made files differ."""
    text = path.read_text()
    ids: dict[str, str] = {}
    for m in re.finditer(r'id="([^"]+)"', text):
        ids.setdefault(m.group(1), f"e{len(ids)}")
    if ids:
        text = re.sub(r'(id="|url\(#|xlink:href="#|href="#)([^")]+)',
                      lambda m: m.group(1) + ids.get(m.group(2), m.group(2)), text)
    path.write_text(text)


def _note(fig: Figure, text: str) -> None:
    """A footnote under the axes; the layout keeps a strip free for it so it never hits labels."""
    lines = textwrap.wrap(text, width=int(fig.get_figwidth() * 14))  # ~14 characters per inch at 8 pt
    h = fig.get_figheight()
    strip = min((0.1 + 0.16 * len(lines)) / h, 0.3)
    fig.get_layout_engine().set(rect=(0, strip, 1, 1 - strip))
    fig.text(0.005, 0.04 / h, "\n".join(lines), fontsize=8, color="#555555", ha="left", va="bottom")


def _fmt_count(n: float) -> str:
    return f"{int(n):,}".replace(",", "\u2009")


def _stacked_bars(ax, pivot: pd.DataFrame, colors: Mapping[str, str], *, scale: float = 1.0,
                  horizontal: bool = False) -> None:
    """Bars for the index of ``pivot``, stacked over its columns."""
    pos = np.arange(len(pivot.index))
    bottom = np.zeros(len(pos))
    for col in pivot.columns:
        vals = pivot[col].to_numpy(dtype=float) / scale
        if not vals.any():
            continue
        if horizontal:
            ax.barh(pos, vals, left=bottom, color=colors[col], label=str(col), height=0.7)
        else:
            ax.bar(pos, vals, bottom=bottom, color=colors[col], label=str(col), width=0.7)
        bottom += vals


def _annotate_totals(ax, totals: np.ndarray, labels: Sequence[str]) -> None:
    top = float(totals.max()) if len(totals) else 0.0
    for x, (v, lab) in enumerate(zip(totals, labels)):
        ax.annotate(lab, (x, v), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=8.5)
    if top > 0:
        ax.set_ylim(0, top * 1.15)


# --------------------------------------------------------------------------- run figures


def _plot_op_counts(tables: Mapping[str, pd.DataFrame], title: str) -> Figure | None:
    counts = tables.get("op_counts")
    kernels = tables.get("kernel_counts")
    if counts is None or counts["calls"].sum() == 0:
        return None
    fig = _figure(12, 4.6)
    axes = fig.subplots(1, 2)
    panels = [(counts, "op", "calls", "Calls per NCCL function", "calls (sum over ranks)")]
    if kernels is not None and len(kernels):
        panels.append((kernels, "kernel_op", "kernels", "GPU kernels per kernel type (fused P2P = one SendRecv)",
                       "kernels (sum over ranks)"))
    else:
        axes[1].set_visible(False)
    for ax, (df, key, value, head, ylabel) in zip(axes, panels):
        pivot = df.pivot_table(index=key, columns="parallelism", values=value, aggfunc="sum", fill_value=0)
        pivot = pivot.loc[pivot.sum(axis=1).sort_values(ascending=False, kind="stable").index]
        pivot = pivot[sorted(pivot.columns)]
        _stacked_bars(ax, pivot, {c: par_color(c) for c in pivot.columns})
        totals = pivot.sum(axis=1).to_numpy(dtype=float)
        share = totals / totals.sum() if totals.sum() else totals
        _annotate_totals(ax, totals, [f"{_fmt_count(t)}\n{s:.1%}" for t, s in zip(totals, share)])
        ax.set_xticks(np.arange(len(pivot.index)), [str(i) for i in pivot.index], rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(head)
        ax.legend(title="parallelism", loc="upper right", frameon=False)
    fig.suptitle(f"{title} - operation counts".strip(" -"))
    single = int(counts["calls_single_rank"].sum())
    dups = int(counts["duplicate_lines"].sum())
    _note(fig, f"Not counted: {_fmt_count(single)} calls on single-rank communicators (no data moved, no kernel) "
               f"and {_fmt_count(dups)} duplicate log lines.")
    return fig


def _plot_volume_by_op(tables: Mapping[str, pd.DataFrame], title: str) -> Figure | None:
    counts = tables.get("op_counts")
    if counts is None or counts["bytes"].sum() == 0:
        return None
    pivot = counts.pivot_table(index="op", columns="parallelism", values="bytes", aggfunc="sum", fill_value=0)
    pivot = pivot.loc[pivot.sum(axis=1).sort_values(ascending=False, kind="stable").index]
    pivot = pivot[sorted(pivot.columns)]
    fig = _figure(8, 4.8)
    ax = fig.subplots()
    _stacked_bars(ax, pivot, {c: par_color(c) for c in pivot.columns}, scale=GIB)
    totals = pivot.sum(axis=1).to_numpy(dtype=float)
    share = totals / totals.sum()
    _annotate_totals(ax, totals / GIB, [f"{t / GIB:.2f} GiB\n{s:.1%}" for t, s in zip(totals, share)])
    ax.set_xticks(np.arange(len(pivot.index)), [str(i) for i in pivot.index], rotation=20, ha="right")
    ax.set_ylabel("payload volume [GiB] (sum over ranks)")
    ax.set_title(f"Volume per NCCL function (total {totals.sum() / GIB:.2f} GiB)")
    ax.legend(title="parallelism", loc="upper right", frameon=False)
    fig.suptitle(f"{title} - volume per collective type".strip(" -"))
    single = float(counts["bytes_single_rank"].sum())
    _note(fig, "Per-rank payload (count x datatype size) summed over ranks; Send and Recv both counted. "
               f"Calls on single-rank communicators ({single / GIB:.2f} GiB) move no data and are not included.")
    return fig


def _plot_rank_volume(tables: Mapping[str, pd.DataFrame], title: str) -> Figure | None:
    by_op = tables.get("rank_volume_by_op")
    if by_op is None or by_op["bytes"].sum() == 0:
        return None
    df = by_op.assign(global_rank=by_op["global_rank"].astype("Int64").fillna(-1))
    pivot = df.pivot_table(index="global_rank", columns="op", values="bytes", aggfunc="sum", fill_value=0)
    pivot = pivot.sort_index()[sorted(pivot.columns)]
    n = len(pivot)
    fig = _figure(min(max(7.0, 0.35 * n + 3), 18), 4.6)
    ax = fig.subplots()
    _stacked_bars(ax, pivot, {c: op_color(c) for c in pivot.columns}, scale=GIB)
    totals = pivot.sum(axis=1).to_numpy(dtype=float) / GIB
    mean = float(totals.mean())
    ax.axhline(mean, color="#333333", linestyle="--", linewidth=1, label=f"mean {mean:.2f} GiB")
    step = max(1, n // 32)
    ticks = np.arange(0, n, step)
    ax.set_xticks(ticks, [("?" if r < 0 else str(r)) for r in pivot.index[ticks]])
    ax.set_xlabel("global rank")
    ax.set_ylabel("payload volume per rank [GiB]")
    ax.set_title(f"Per-rank volume: mean {mean:.2f} GiB, min {totals.min():.2f}, max {totals.max():.2f}")
    ax.legend(title="function", loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.suptitle(f"{title} - per-rank volume".strip(" -"))
    _note(fig, "Payload bytes of the rank's calls (Send and Recv both counted); single-rank communicators "
               "and duplicate lines excluded.")
    return fig


def _plot_message_sizes(tables: Mapping[str, pd.DataFrame], title: str) -> Figure | None:
    ms = tables.get("message_sizes")
    if ms is None or ms["calls"].sum() == 0:
        return None
    ms = ms[ms["calls"] > 0]
    lo, hi = int(ms["bucket"].min()), int(ms["bucket"].max())
    buckets = list(range(lo, hi + 1))  # empty buckets too: the gaps are part of the shape
    fig = _figure(max(8.0, 0.42 * len(buckets) + 3), 6.4)
    ax_n, ax_b = fig.subplots(2, 1, sharex=True)
    for ax, value, scale, ylabel in ((ax_n, "calls", 1.0, "calls (sum over ranks)"),
                                     (ax_b, "bytes", GIB, "payload volume [GiB]")):
        pivot = ms.pivot_table(index="bucket", columns="op", values=value, aggfunc="sum", fill_value=0)
        pivot = pivot.reindex(buckets, fill_value=0)[sorted(pivot.columns)]
        _stacked_bars(ax, pivot, {c: op_color(c) for c in pivot.columns}, scale=scale)
        ax.set_ylabel(ylabel)
        if value == "calls":  # small buckets are invisible next to the peak: print every count
            totals = pivot.sum(axis=1).to_numpy(dtype=float)
            _annotate_totals(ax, totals, [_fmt_count(t) if t else "" for t in totals])
    labels = ["0 B" if b < 0 else format_bytes_binary(1 << b) for b in buckets]
    ax_b.set_xticks(np.arange(len(buckets)), labels, rotation=45, ha="right")
    ax_b.set_xlabel("per-rank payload of one call (power-of-two bucket, lower bound)")
    ax_n.set_title(f"Message-size distribution ({_fmt_count(ms['calls'].sum())} calls)")
    ax_n.legend(title="function", loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.suptitle(f"{title} - message sizes".strip(" -"))
    _note(fig, "Bucket k holds calls of 2^k to 2^(k+1) - 1 bytes; single-rank communicators and duplicate "
               "lines excluded.")
    return fig


# Columns of the ops table the timeline reads: every row once (TimelineBuilder.add), then the
# rows near the window again (TimelineBuilder.collect).
TIMELINE_COLUMNS = ["row_kind", "duplicate_of", "nranks", "kernel_start_sync", "kernel_end_sync", "global_rank", "host",
                    "kernel_global_pid", "kernel_correlation_id", "op", "logical_id", "parallelism"]  # fmt: skip
WINDOW_COLUMNS = ["row_kind", "duplicate_of", "nranks", "kernel_start_sync", "kernel_end_sync", "global_rank",
                  "parallelism"]  # fmt: skip


def _timeline_rows(ops: pd.DataFrame) -> np.ndarray:
    """Positions of the rows whose kernels the timeline shows: multi-rank, non-duplicate calls with
    synchronised kernel times and a global rank."""
    keep = (ops["row_kind"].astype("string") == "call").fillna(False) & ops["duplicate_of"].isna()
    keep &= (pd.to_numeric(ops["nranks"], errors="coerce") != 1).fillna(True)
    keep &= ops["kernel_start_sync"].notna() & ops["kernel_end_sync"].notna() & ops["global_rank"].notna()
    return np.flatnonzero(keep.to_numpy(dtype=bool))


def sequence_period(keys: np.ndarray, max_period: int = 20000, tolerance: float = 0.005) -> tuple[int, float]:
    """Smallest period p at which the op sequence repeats best: (p, share of equal positions).

    Training iterations issue the same operations in the same order, so the share of positions with
    ``keys[i] == keys[i + p]`` peaks at the iteration length and its multiples. Only the middle of the
    sequence is compared (the first and last iterations carry set-up and tear-down operations); a
    period within ``tolerance`` of the best score is preferred when shorter. Returns (0, 0.0) when
    the sequence is too short to tell."""
    n = len(keys)
    if n < 16:
        return 0, 0.0
    codes = pd.factorize(pd.Series(keys))[0].astype(np.int32)
    lo, hi = n // 4, n - n // 4
    hi = min(hi, lo + 3 * max_period)  # bounded work on long runs: three of the longest periods suffice
    max_p = min(max_period, (hi - lo) // 2)
    if max_p < 2:
        return 0, 0.0
    seg = codes[lo:hi]
    scores = np.array([np.mean(seg[:-p] == seg[p:]) for p in range(1, max_p + 1)])
    best = float(scores.max())
    p = int(np.argmax(scores >= best - tolerance)) + 1
    return p, float(scores[p - 1])


def _busy_union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of the closed intervals [start, end] as sorted disjoint (start, end) arrays: the
    times some rank runs a communication kernel. The union of unions is the union of all, so the
    intervals of batches merge into the run's."""
    order = np.argsort(start, kind="stable")
    st, en = start[order], end[order]
    reach = np.maximum.accumulate(en)
    new = np.r_[True, st[1:] > reach[:-1]]  # an interval starting after all before it ended
    last = np.r_[np.flatnonzero(new)[1:] - 1, len(st) - 1]
    return st[new], reach[last]


def _boundary_near(gs: np.ndarray, ge: np.ndarray, lo: float, hi: float) -> int | None:
    """Middle of the longest idle gap overlapping [lo, hi] (None if there is none)."""
    sel = (ge > lo) & (gs < hi)
    if not sel.any():
        return None
    i = int(np.argmax(np.where(sel, ge - gs, -1)))
    return int((gs[i] + ge[i]) // 2)


@dataclass
class Timeline:
    """What the timeline figure draws: ``kernels`` (rank, start, end, parallelism) inside the
    window on the ranks shown, sorted by rank and time; ``ranks`` (one row each); the host of
    each rank's earliest kernel; the window (start_ns, end_ns) and how it was chosen."""

    kernels: pd.DataFrame
    ranks: list[int]
    hosts: dict[int, str]
    window: tuple[int, int]
    how: str


class TimelineBuilder:
    """The timeline figure's data from the ops table in batches, in two passes over it and in
    memory that does not hold the rows: ``add`` each batch (:data:`TIMELINE_COLUMNS`), then
    ``collect`` the kernels inside the window from the same batches read again
    (:data:`WINDOW_COLUMNS` suffice).

    The first pass keeps what the window needs: the lowest rank's kernel sequence (its period
    is the iteration), the union of all kernels' intervals (its gaps are the idle phases), the
    ranks with the host of their earliest kernel; and which rows repeat a kernel an earlier row
    already showed (a fused group's later calls), so the second pass draws each kernel once.
    ``kernels``: a kernel-key set to share with a :class:`~nccltrace.outputs.summary.RunTablesBuilder`
    fed the same rows (the timeline asks its own question of it)."""

    def __init__(self, max_ranks: int = 64, kernels: FirstSeen | None = None) -> None:
        self.max_ranks = max_ranks
        self._seen = kernels if kernels is not None else FirstSeen()
        self._repeats: list[np.ndarray] = []  # row numbers of calls whose kernel an earlier row showed
        self._rows = 0  # rows added so far
        self._first: dict[int, tuple[int, int, str]] = {}  # rank -> (start, end, host) of its earliest kernel
        self._busy = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))  # union of the kernels' intervals
        self._busy_new: list[tuple[np.ndarray, np.ndarray]] = []  # batches' unions not merged into it yet
        self._low_rank: int | None = None
        self._low: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (start, end, key id) of the lowest rank
        self._keys: dict[str, int] = {}  # 'op@logical_id' -> id

    def add(self, ops: pd.DataFrame) -> None:
        """First pass: the next rows of the ops table."""
        rows = _timeline_rows(ops)
        c = ops.iloc[rows, [ops.columns.get_loc(col) for col in TIMELINE_COLUMNS]]
        first = self._seen.first(c["host"], c["kernel_global_pid"], c["kernel_correlation_id"], tag=1)
        if not first.all():
            self._repeats.append(self._rows + rows[~first])
        self._rows += len(ops)
        c = c[first]
        if c.empty:
            return
        rank = c["global_rank"].astype("int64").to_numpy()
        start = c["kernel_start_sync"].astype("int64").to_numpy()
        end = c["kernel_end_sync"].astype("int64").to_numpy()
        host = c["host"].astype("string").fillna("?").to_numpy()
        order = np.lexsort((end, start, rank))  # stable: ties keep the rows' order
        firsts = order[np.r_[True, rank[order][1:] != rank[order][:-1]]]
        for i in firsts:  # an earlier batch wins a tie, as the earlier row does within one
            r, t = int(rank[i]), (int(start[i]), int(end[i]))
            if r not in self._first or t < self._first[r][:2]:
                self._first[r] = (*t, str(host[i]))
        self._busy_new.append(_busy_union(start, end))
        if sum(len(b[0]) for b in self._busy_new) > max(len(self._busy[0]) // 4, 1 << 16):
            self._merge_busy()  # now and then: merging every batch would copy the whole union each time
        low = int(rank.min())
        if self._low_rank is None or low < self._low_rank:
            self._low_rank, self._low = low, []
        if low == self._low_rank:
            sel = rank == low
            lo = c[sel]
            key = lo["op"].astype("string").fillna("?") + "@" + lo["logical_id"].astype("string").fillna("?")
            codes, uniques = pd.factorize(key)
            ids = np.array([self._keys.setdefault(k, len(self._keys)) for k in uniques], dtype=np.int64)[codes]
            self._low.append((start[sel], end[sel], ids))

    def _merge_busy(self) -> None:
        parts = [self._busy, *self._busy_new]
        self._busy = _busy_union(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        self._busy_new = []

    def window(self) -> tuple[int, int, str] | None:
        """(start_ns, end_ns, how) of about one training iteration in the middle of the run (see
        :func:`iteration_window`); None without kernel times."""
        return None if self._low_rank is None else self._window()

    def _window(self) -> tuple[int, int, str]:
        if self._busy_new:
            self._merge_busy()
        start, end, keys = (np.concatenate(parts) for parts in zip(*self._low))
        order = np.lexsort((end, start))
        starts, keys = start[order], keys[order]
        p, score = sequence_period(keys)
        n = len(starts)
        if p >= 2 and score >= 0.8 and n > 2 * p:
            mid = slice(n // 4, n - n // 4 - p)
            period = float(np.median(starts[p:][mid] - starts[:-p][mid])) if n - n // 4 - p > n // 4 else 0.0
            if period > 0:
                gs, ge = self._busy[1][:-1], self._busy[0][1:]  # idle gaps: between the busy intervals
                t_mid = float(starts[n // 2])
                a = _boundary_near(gs, ge, t_mid - period / 2, t_mid + period / 2)
                a = int(t_mid - period / 2) if a is None else a
                b = _boundary_near(gs, ge, a + 0.9 * period, a + 1.1 * period)
                b = int(a + period) if b is None else b
                return a, b, f"about one iteration ({p} kernels on rank {self._low_rank}, period match {score:.0%})"
        t0, t1 = int(self._busy[0][0]), int(self._busy[1][-1])
        centre, half = (t0 + t1) // 2, max((t1 - t0) // 20, 1)
        return centre - half, centre + half, "middle tenth of the run (no repeating iteration found)"

    def collect(self, batches: Iterable[pd.DataFrame], window: tuple[int, int] | None = None) -> Timeline | None:
        """Second pass: the kernels inside ``window`` (default: :meth:`window`) on up to
        ``max_ranks`` evenly spaced ranks, from the batches of the same table in the same order;
        None without kernel times."""
        if self._low_rank is None:  # no kernel times
            return None
        a, b, how = self._window() if window is None else (*window, "requested window")
        ranks = sorted(self._first)
        if len(ranks) > self.max_ranks:  # evenly spaced subset keeps the figure readable
            ranks = [ranks[i] for i in np.linspace(0, len(ranks) - 1, self.max_ranks).round().astype(int)]
        repeats = np.sort(np.concatenate(self._repeats)) if self._repeats else np.zeros(0, dtype=np.int64)
        parts, seen = [], 0
        for ops in batches:
            rows = _timeline_rows(ops)
            c = ops.iloc[rows, [ops.columns.get_loc(col) for col in WINDOW_COLUMNS]]
            start, end = c["kernel_start_sync"].astype("int64"), c["kernel_end_sync"].astype("int64")
            keep = ((end >= a) & (start <= b) & c["global_rank"].isin(ranks)).to_numpy(dtype=bool)
            keep &= ~np.isin(seen + rows, repeats)
            seen += len(ops)
            parts.append(pd.DataFrame({
                "rank": c["global_rank"].astype("int64").to_numpy()[keep], "start": start.to_numpy()[keep],
                "end": end.to_numpy()[keep], "parallelism": c["parallelism"].astype("string").fillna("unknown")
                .to_numpy()[keep]}))  # fmt: skip
        if seen != self._rows:
            raise ValueError(f"the timeline's second pass read {seen} rows, its first {self._rows}: not the same table")
        k = pd.concat(parts, ignore_index=True).sort_values(["rank", "start", "end"], kind="stable")
        k["parallelism"] = k["parallelism"].astype("str")  # whatever dtype empty batches gave the column
        hosts = {r: self._first[r][2] for r in ranks}
        return Timeline(k.reset_index(drop=True), ranks, hosts, (a, b), how)


def timeline_of(ops: pd.DataFrame, window: tuple[int, int] | None = None, max_ranks: int = 64) -> Timeline | None:
    """The timeline figure's data of an ops table in memory (one batch of :class:`TimelineBuilder`)."""
    builder = TimelineBuilder(max_ranks)
    builder.add(ops)
    return builder.collect([ops], window)


def iteration_window(ops: pd.DataFrame) -> tuple[int, int, str] | None:
    """(start_ns, end_ns, how) of about one training iteration in the middle of the run, on the
    synchronised clock; None without kernel times.

    The lowest rank's op sequence gives the iteration length in ops (``sequence_period``) and, from
    the time that many ops take, its duration. Iterations are separated by compute phases, so the
    window starts in the longest interval in which no rank communicates within one iteration of the
    middle of the run, and ends in the longest such interval about one iteration later. Without a
    clear period, the middle tenth of the run is shown."""
    builder = TimelineBuilder()
    builder.add(ops)
    return builder.window()


def _plot_timeline(timeline: Timeline | pd.DataFrame | None, title: str, window: tuple[int, int] | None = None,
                   max_ranks: int = 64) -> Figure | None:  # fmt: skip
    """The timeline excerpt of a :class:`Timeline`, or of an ops table in memory (``window``,
    ``max_ranks``: see :meth:`TimelineBuilder.collect`)."""
    if isinstance(timeline, pd.DataFrame):
        timeline = timeline_of(timeline, window, max_ranks)
    if timeline is None:
        return None
    k, ranks, hosts, (a, b) = timeline.kernels, timeline.ranks, timeline.hosts, timeline.window
    fig = _figure(14, max(3.0, 0.42 * len(ranks) + 1.8))
    ax = fig.subplots()
    span_ms = (b - a) / 1e6
    min_w = span_ms / 1500  # sub-pixel kernels would vanish; give them a visible width
    row = {r: i for i, r in enumerate(ranks)}
    pars = sorted(k["parallelism"].unique())
    for par in pars:
        sub = k[k["parallelism"] == par]
        for r, g in sub.groupby("rank"):
            x = (g["start"].to_numpy() - a) / 1e6
            w = np.maximum((g["end"].to_numpy() - g["start"].to_numpy()) / 1e6, min_w)
            ax.broken_barh(list(zip(x, w)), (row[r] - 0.38, 0.76), facecolors=par_color(par), linewidth=0)
    ax.set_yticks(range(len(ranks)), [f"rank {r} ({hosts.get(r, '?')})" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time since window start [ms] (synchronised clock)")
    ax.grid(axis="y", visible=False)
    ax.legend(handles=[Patch(color=par_color(p), label=p) for p in pars], title="parallelism", loc="upper left",
              bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(f"Communication kernels over {span_ms:.1f} ms: {timeline.how}")
    fig.suptitle(f"{title} - timeline excerpt".strip(" -"))
    _note(fig, f"{len(k):,} kernels of multi-rank calls; a fused group of P2P calls is one bar. Open the full "
               "trace in Perfetto for every event.")
    return fig


def _plot_bandwidth(tables: Mapping[str, pd.DataFrame], title: str) -> Figure | None:
    bw = tables.get("bandwidth")
    if bw is None or bw.empty or bw["busbw_median_gbps"].notna().sum() == 0:
        return None
    bw = bw[bw["busbw_median_gbps"].notna()]
    fig = _figure(10, 5)
    ax = fig.subplots()
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    pars = sorted(bw["parallelism"].astype(str).unique())
    series = list(bw.groupby([bw["op"].astype(str), bw["parallelism"].astype(str)], sort=True))
    # one distinct colour per series (several parallelisms of one function must not share one)
    palette = _FALLBACK_SERIES if len(series) > 10 else _FALLBACK_SERIES[:10]
    for k, ((op, par), g) in enumerate(series):
        # aggregate communicators of one kind: calls-weighted mean of the per-communicator medians
        agg = g.groupby("bucket").apply(lambda d: pd.Series({
            "med": float(np.average(d["busbw_median_gbps"].astype(float), weights=d["calls"].astype(float))),
            "p10": float(d["busbw_p10_gbps"].astype(float).min()),
            "p90": float(d["busbw_p90_gbps"].astype(float).max())}), include_groups=False).sort_index()
        # a line joins neighbouring size buckets only: a gap (no calls of a size in between)
        # breaks it, so no line suggests a bandwidth measured at sizes that never ran
        agg = agg.reindex(np.arange(int(agg.index.min()), int(agg.index.max()) + 1))
        x = np.exp2(agg.index.to_numpy(dtype=float))
        m = markers[pars.index(par) % len(markers)]
        # clip: a weighted mean of equal medians can exceed their p90 by a rounding error
        yerr = [(agg["med"] - agg["p10"]).clip(lower=0).fillna(0), (agg["p90"] - agg["med"]).clip(lower=0).fillna(0)]
        ax.errorbar(x, agg["med"], yerr=yerr, marker=m,
                    color=palette[k % len(palette)], label=f"{op} / {par}", capsize=2, linewidth=1)
    lim = bw.dropna(subset=["limit_gbps"])
    # one line per distinct limit, named by the link type (first word of the bottleneck description)
    kinds = lim["limit_link"].astype("string").fillna("link").str.split().str[0]
    for value, names in lim.groupby(lim["limit_gbps"].astype(float))[[]].apply(
            lambda g: sorted(set(kinds[g.index]))).items():  # fmt: skip
        ax.axhline(float(value), color="#555555", linestyle=":", linewidth=1)
        ax.annotate(f"limit {'/'.join(names)} {float(value):.0f} GB/s", (0.01, float(value)),
                    xycoords=("axes fraction", "data"), fontsize=8, va="bottom", color="#555555")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda v, _pos: format_bytes_binary(int(v)) if v >= 1 else "")
    ax.set_xlabel("message size S (nccl-tests convention; bucket lower bound)")
    ax.set_ylabel("bus bandwidth [GB/s] (10^9 B/s)")
    ax.set_title("Bus bandwidth per message size: median, whiskers p10-p90")
    ax.legend(title="function / parallelism", loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.suptitle(f"{title} - bandwidth".strip(" -"))
    return fig


def run_plots(
    ops: pd.DataFrame | None,
    tables: Mapping[str, pd.DataFrame],
    out_dir: Path | str,
    title: str = "",
    *,
    formats: Sequence[str] = ("png",),
    window: tuple[int, int] | None = None,
    timeline: Timeline | None = None,
) -> dict[str, Path]:
    """Draw the run figures into ``out_dir``; returns {file name: path} of what was drawn.

    Names: op_counts, volume_by_op, rank_volume, message_sizes, timeline, bandwidth (each
    ``<name>.<format>``); a figure without data (no calls, no kernel times, no metrics) is skipped.
    The timeline comes from ``ops`` in memory, with ``window`` (start_ns, end_ns on the
    synchronised clock) overriding the detected iteration; or, when the run's ops table is read in
    batches (``ops`` None), from ``timeline`` (:meth:`TimelineBuilder.collect`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    with rc_context(_STYLE):
        figures = {
            "op_counts": _plot_op_counts(tables, title),
            "volume_by_op": _plot_volume_by_op(tables, title),
            "rank_volume": _plot_rank_volume(tables, title),
            "message_sizes": _plot_message_sizes(tables, title),
            "timeline": _plot_timeline(timeline if ops is None else ops, title, window),
            "bandwidth": _plot_bandwidth(tables, title),
        }
        for name, fig in figures.items():
            if fig is not None:
                written.update(_save(fig, out_dir, name, formats))
    return written


# --------------------------------------------------------------------------- campaign figure


def campaign_plots(
    campaign: Mapping[str, pd.DataFrame], out_dir: Path | str, *, formats: Sequence[str] = ("png",)
) -> dict[str, Path]:
    """Draw ``campaign_comparison`` (every configuration side by side: op mix, volume per rank by
    parallelism, per-rank spread and, with metrics, median bus bandwidth) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = campaign.get("runs")
    if runs is None or runs.empty:
        return {}
    order = list(runs["run"].astype(str))
    avail = dict(zip(order, runs["available"].fillna(False).astype(bool)))
    bw = campaign.get("bandwidth")
    has_bw = bw is not None and not bw.empty and (bw["busbw_median_gbps"].notna() & (bw["bucket"] >= LARGE_BUCKET)).any()
    with rc_context(_STYLE):
        # a 2 x 2 grid that fits a page: panels side by side in one row made a 23-inch-wide strip
        row_h = 1.2 + 0.32 * len(order)
        fig = _figure(13, 2 * row_h + 0.8)
        grid = fig.subplots(2, 2, sharey=True)
        axes = [grid[0, 0], grid[0, 1], grid[1, 0], grid[1, 1]]
        pos = np.arange(len(order))
        _campaign_op_mix(axes[0], campaign.get("op_counts"), runs, order)
        _campaign_volume(axes[1], campaign.get("volume_by_parallelism"), runs, order)
        _campaign_rank_spread(axes[2], campaign.get("rank_volume"), order)
        if has_bw:
            _campaign_bandwidth(axes[3], bw, order)
        else:
            axes[3].set_axis_off()
        for ax in (axes[0], axes[2]):
            ax.set_yticks(pos, order)
            ax.tick_params(axis="y", labelsize=8)
        axes[0].set_ylim(len(order) - 0.5, -0.5)
        for ax in (axes[0], axes[2]):
            for i, run in enumerate(order):
                if not avail[run]:
                    ax.annotate("no results", (0.01, i), xycoords=("axes fraction", "data"), va="center",
                                color="#b00020", fontsize=9)
        fig.suptitle("Campaign: configurations side by side")
        _note(fig, "Calls and payload volume exclude single-rank communicators and duplicate log lines; GiB = 2^30 B.")
        return _save(fig, out_dir, "campaign_comparison", formats)


def _campaign_op_mix(ax, counts: pd.DataFrame | None, runs: pd.DataFrame, order: list[str]) -> None:
    ax.set_title("Op mix (share of calls per function)")
    ax.set_xlabel("share of calls")
    if counts is None or counts.empty:
        return
    pivot = counts.pivot_table(index="run", columns="op", values="calls", aggfunc="sum", fill_value=0)
    pivot = pivot.reindex(order, fill_value=0)[sorted(pivot.columns)]
    totals = pivot.sum(axis=1)
    share = pivot.div(totals.where(totals > 0, 1), axis=0)
    _stacked_bars(ax, share, {c: op_color(c) for c in share.columns}, horizontal=True)
    kernels = dict(zip(runs["run"].astype(str), runs["kernels"]))
    for i, run in enumerate(order):
        if totals[run] > 0:
            ax.annotate(f"{_fmt_count(totals[run])} calls / {_fmt_count(kernels.get(run) or 0)} kernels", (1.01, i),
                        xycoords=("axes fraction", "data"), va="center", fontsize=8)
    ax.set_xlim(0, 1)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=6, frameon=False, fontsize=8)


def _campaign_volume(ax, vol: pd.DataFrame | None, runs: pd.DataFrame, order: list[str]) -> None:
    ax.set_title("Mean payload volume per rank by parallelism")
    ax.set_xlabel("GiB per rank")
    if vol is None or vol.empty:
        return
    pivot = vol.pivot_table(index="run", columns="parallelism", values="bytes_per_rank_mean", aggfunc="sum",
                            fill_value=0)
    pivot = pivot.reindex(order, fill_value=0)
    pivot = pivot[[c for c in sorted(pivot.columns) if pivot[c].sum() > 0]]
    _stacked_bars(ax, pivot, {c: par_color(c) for c in pivot.columns}, scale=GIB, horizontal=True)
    ax.set_xlim(left=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), ncol=1, frameon=False, fontsize=8)


def _campaign_rank_spread(ax, rv: pd.DataFrame | None, order: list[str]) -> None:
    ax.set_title("Per-rank volume: min - max, mean (dot)")
    ax.set_xlabel("GiB per rank")
    if rv is None or rv.empty:
        return
    g = rv.groupby("run")["bytes"]
    stats = pd.DataFrame({"min": g.min(), "max": g.max(), "mean": g.mean()}).astype(float) / GIB
    for i, run in enumerate(order):
        if run in stats.index:
            s = stats.loc[run]
            ax.plot([s["min"], s["max"]], [i, i], color="#555555", linewidth=2, solid_capstyle="butt")
            ax.plot([s["mean"]], [i], "o", color="#1f77b4")
            label = f"{s['min']:.2f}" if np.isclose(s["min"], s["max"]) else f"{s['min']:.2f}-{s['max']:.2f}"
            ax.annotate(label, (s["max"], i), xytext=(4, 0), textcoords="offset points",
                        va="center", fontsize=8)
    ax.set_xlim(left=0)


def _campaign_bandwidth(ax, bw: pd.DataFrame, order: list[str]) -> None:
    ax.set_title("Bus bandwidth per function, messages \u2265 1 MiB")
    ax.set_xlabel("busbw [GB/s], calls-weighted mean of medians")
    # small messages measure launch latency, not bandwidth; they would pull every run towards zero
    bw = bw[bw["busbw_median_gbps"].notna() & (bw["bucket"] >= LARGE_BUCKET)]
    ops = sorted(bw["op"].astype(str).unique())
    offsets = np.linspace(-0.3, 0.3, len(ops)) if len(ops) > 1 else [0.0]
    for off, op in zip(offsets, ops):
        g = bw[bw["op"].astype(str) == op]
        med = g.groupby("run").apply(lambda d: float(np.average(d["busbw_median_gbps"].astype(float),
                                                                 weights=d["calls"].astype(float))),
                                     include_groups=False)  # fmt: skip
        ys = [i + off for i, r in enumerate(order) if r in med.index]
        xs = [med[r] for r in order if r in med.index]
        ax.plot(xs, ys, "o", color=op_color(op), label=op)
    ax.set_xlim(left=0)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.04), ncol=3, frameon=False, fontsize=8)
