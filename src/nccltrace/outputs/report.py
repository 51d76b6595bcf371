"""Self-contained HTML reports of a run and of a campaign.

A report is one HTML file with its styles inline and its figures embedded, so it can be mailed,
archived or embedded in a workflow report as is; only links to the trace, the CSV tables and the
per-run reports point outside it. Everything shown is read from the files the earlier stages
wrote, and optional inputs that are absent are named as absent rather than silently left out.
"""

from __future__ import annotations

import base64
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import yaml
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from nccltrace.core.layout import MANIFEST_FILE, RunLayout
from nccltrace.core.provenance import code_version
from nccltrace.core.tables import atomic_output, read_table
from nccltrace.outputs.summary import CONFIG_FIELDS, LARGE_MESSAGE_BYTES

MAX_ROWS = 200
MAX_STATUS_REASONS = 4  # reasons of a partial run in the campaign's status table
RUN_FIGURES = ("op_counts", "volume_by_op", "rank_volume", "message_sizes", "timeline", "bandwidth")
GIB = float(1 << 30)


# --------------------------------------------------------------------------- formatting


def fmt_bytes(v: Any) -> str:
    """Binary units with three significant digits: '5.72 GiB', '4 MiB', '96 B'."""
    if _na(v):
        return "\u2013"
    x = float(v)
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    i = 0
    while abs(x) >= 1024 and i < len(units) - 1:
        x /= 1024
        i += 1
    if i == 0:
        return f"{x:.0f} B"
    return f"{x:.0f} {units[i]}" if abs(x) >= 100 else f"{x:.3g} {units[i]}"


def fmt_ns(v: Any) -> str:
    """A duration with a readable unit: '850 ns', '12.3 µs', '4.56 ms', '1.20 s'."""
    if _na(v):
        return "\u2013"
    x = float(v)
    for scale, unit in ((1e9, "s"), (1e6, "ms"), (1e3, "\u00b5s")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} ns"


def fmt_int(v: Any) -> str:
    return "\u2013" if _na(v) else f"{int(v):,}"


def fmt_float(v: Any, digits: int = 4) -> str:
    return "\u2013" if _na(v) else f"{float(v):.{digits}g}"


def fmt_share(v: Any) -> str:
    return "\u2013" if _na(v) else f"{100 * float(v):.1f} %"


def _na(v: Any) -> bool:
    if v is None or v is pd.NA:
        return True
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


@dataclass
class Column:
    name: str
    unit: str = ""
    doc: str = ""


@dataclass
class TableView:
    """A table prepared for the template: formatted cells, units and meanings of the columns."""

    columns: list[Column]
    rows: list[list[dict[str, Any]]]
    total_rows: int
    csv_href: str | None = None
    note: str = ""
    empty_text: str = "no rows"
    extra: dict[str, Any] = field(default_factory=dict)


def _cell(value: Any, unit: str, name: str) -> dict[str, Any]:
    """Formatted cell: text, exact value as tooltip, and whether it is a number (right-aligned)."""
    if _na(value):
        return {"text": "\u2013", "title": "null", "num": False}
    if isinstance(value, (bool, np.bool_)):
        return {"text": "yes" if value else "no", "title": "", "num": False}
    if isinstance(value, str):
        return {"text": value, "title": "", "num": False, "long": len(value) > 40}
    try:
        x = float(value)
    except (TypeError, ValueError):
        return {"text": str(value), "title": "", "num": False}
    exact = f"{int(x):,}" if float(x).is_integer() and abs(x) < 2**63 else f"{x:.10g}"
    if unit == "B":
        return {"text": fmt_bytes(x), "title": f"{exact} B", "num": True}
    if unit == "fraction":
        return {"text": fmt_share(x), "title": exact, "num": True}
    if unit == "ns":
        return {"text": fmt_ns(x), "title": f"{exact} ns", "num": True}
    if name.startswith("ratio") or name.endswith("_ratio"):
        return {"text": f"{x:.2f}\u00d7", "title": exact, "num": True}
    if float(x).is_integer() and unit not in ("GB/s",):
        return {"text": fmt_int(x), "title": "", "num": True}
    return {"text": fmt_float(x), "title": exact, "num": True}


def table_view(
    df: pd.DataFrame | None,
    units: Mapping[str, str] | None = None,
    docs: Mapping[str, str] | None = None,
    *,
    max_rows: int = MAX_ROWS,
    csv_href: str | None = None,
    note: str = "",
    empty_text: str = "no rows",
) -> TableView:
    """Format a DataFrame for the report (at most ``max_rows`` rows; the rest is in the CSV)."""
    units, docs = dict(units or {}), dict(docs or {})
    if df is None:
        return TableView([], [], 0, csv_href, note, empty_text)
    cols = [Column(str(c), units.get(str(c), _guess_unit(str(c))), docs.get(str(c), "")) for c in df.columns]
    rows = [[{"long": False, **_cell(v, c.unit, c.name)} for v, c in zip(rec, cols)]
            for rec in df.head(max_rows).itertuples(index=False, name=None)]  # fmt: skip
    return TableView(cols, rows, len(df), csv_href, note, empty_text)


def _guess_unit(name: str) -> str:
    """Unit of a column of a table without a documented schema, from its name."""
    if name.endswith("_bytes") or name == "bytes":
        return "B"
    if name.endswith("_ns"):
        return "ns"
    if name.endswith("_gbps"):
        return "GB/s"
    if name.startswith("share") or name.endswith("_share"):
        return "fraction"
    return ""


def schema_docs(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(unit per column, meaning per column) from a Parquet file's field metadata."""
    units: dict[str, str] = {}
    docs: dict[str, str] = {}
    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError):
        return units, docs
    for f in schema:
        meta = f.metadata or {}
        if b"unit" in meta:
            units[f.name] = meta[b"unit"].decode()
        if b"doc" in meta:
            docs[f.name] = meta[b"doc"].decode()
    return units, docs


# --------------------------------------------------------------------------- inputs


@dataclass
class Tables:
    """The tables of one directory with their units, meanings and CSV links."""

    frames: dict[str, pd.DataFrame]
    units: dict[str, dict[str, str]]
    docs: dict[str, dict[str, str]]
    csv: dict[str, str]

    def get(self, name: str) -> pd.DataFrame | None:
        return self.frames.get(name)

    def view(self, name: str, df: pd.DataFrame | None = None, **kw: Any) -> TableView:
        frame = self.frames.get(name) if df is None else df
        return table_view(frame, self.units.get(name), self.docs.get(name), csv_href=self.csv.get(name), **kw)


def _rel(target: Path, base_dir: Path) -> str:
    """Relative link from the report's directory (POSIX separators, as URLs want)."""
    return Path(os.path.relpath(Path(target).resolve(), Path(base_dir).resolve())).as_posix()


def load_tables(tables_dir: Path | str, out_dir: Path) -> Tables:
    tables_dir = Path(tables_dir)
    frames, units, docs, csv = {}, {}, {}, {}
    for p in sorted(tables_dir.glob("*.parquet")):
        name = p.stem
        frames[name] = read_table(p)
        units[name], docs[name] = schema_docs(p)
        if (tables_dir / f"{name}.csv").exists():
            csv[name] = _rel(tables_dir / f"{name}.csv", out_dir)
    return Tables(frames, units, docs, csv)


def _image(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def load_figures(plots_dir: Path | str, order: Sequence[str]) -> dict[str, str]:
    """{name: data URI} of the PNG figures in ``plots_dir``: known names first, then the rest."""
    plots_dir = Path(plots_dir)
    found = {p.stem: p for p in sorted(plots_dir.glob("*.png"))} if plots_dir.is_dir() else {}
    names = [n for n in order if n in found] + [n for n in found if n not in order]
    return {n: _image(found[n]) for n in names}


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _manifest_view(path: Path, base: Path) -> dict[str, Any]:
    m = _json(path) or {}
    code = m.get("code") or {}
    commit = code.get("git_commit")
    version = (f"{code.get('nccltrace', '?')}" + (f", commit {commit[:12]}" if commit else "")
               + (" (uncommitted changes)" if code.get("git_dirty") else ""))  # fmt: skip
    problems = [str(p) for p in (m.get("problems") or [])]
    if isinstance(m.get("summary"), Mapping):
        problems += [str(p) for p in (m["summary"].get("problems") or [])]
    return {
        "where": _rel(path.parent, base) if path.parent != base else ".",
        "stage": m.get("stage", "?"), "created": m.get("created_utc", "?"), "version": version,
        "source_sha256": (code.get("source_sha256") or "")[:16], "config_hash": m.get("config_hash"),
        "partial": bool(m.get("partial")), "problems": problems,
        # why the stage is partial (own and upstream causes, see provenance.write_manifest)
        "reasons": [str(r) for r in (m.get("partial_reasons") or [])] if m.get("partial") else [],
        "warnings": [str(w) for w in (m.get("warnings") or [])],
        "inputs": sorted((m.get("inputs") or {}).items()), "outputs": sorted((m.get("outputs") or {}).items()),
        "tools": ", ".join(f"{k} {v}" for k, v in sorted((m.get("tools") or {}).items())),
    }  # fmt: skip


# Pipeline order of the stages: a run report lists the causes of gaps where they arose first.
_STAGE_ORDER = ("acquire", "parse_nccl", "parse_nsys", "parse_summary", "communicators", "align", "ops", "metrics",
                "volume", "trace", "report")


def _stage_rank(stage: str) -> int:
    name = stage.split(":", 1)[0]
    return _STAGE_ORDER.index(name) if name in _STAGE_ORDER else len(_STAGE_ORDER)


def report_partial(manifest_path: Path | str) -> bool:
    """True when the manifest at ``manifest_path`` exists and says its results are partial."""
    return bool((_json(Path(manifest_path)) or {}).get("partial"))


def partial_flags(manifests: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """(what is missing or wrong, the stages marked partial) over a run's manifests: the reasons
    of every partial stage and the problems and warnings of every stage, each once, in pipeline
    order; the stages as 'stage (directory)', aligned processes counted instead of listed."""
    ordered = sorted(manifests, key=lambda m: (_stage_rank(m["stage"]), m["where"]))
    flags = list(dict.fromkeys(x for m in ordered for x in (*m["reasons"], *m["problems"], *m.get("warnings", []))))
    stages: dict[str, list[str]] = {}
    for m in ordered:
        if m["partial"]:
            stages.setdefault(m["stage"], []).append(m["where"])
    marked = [f"{st} ({len(w)} of {sum(m['stage'] == st for m in manifests)} processes)" if st == "align"
              else f"{st} ({', '.join(w)})" for st, w in stages.items()]
    return flags, marked


def run_manifests(run_dir: Path, exclude: Path | None = None, paths: Iterable[Path] | None = None
                  ) -> list[dict[str, Any]]:  # fmt: skip
    """The stage manifests of a run, ops first: ``paths`` when given (what the report stage was
    given), else every manifest of the run directory one and two levels down; ``exclude``: a
    directory whose manifest is not read (the report's own, being rewritten)."""
    if paths is not None:
        paths = sorted({Path(p) for p in paths if Path(p).is_file()})
    else:
        paths = sorted(set(run_dir.glob("*/manifest.json")) | set(run_dir.glob("*/*/manifest.json")))
    if exclude is not None:
        paths = [p for p in paths if p.parent.resolve() != Path(exclude).resolve()]
    paths.sort(key=lambda p: (p.parent.name != "ops", len(p.relative_to(run_dir).parts), str(p)))
    return [_manifest_view(p, run_dir) for p in paths]


def _flatten(d: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out += _flatten(v, key + ".")
        else:
            out.append((key, json.dumps(v) if isinstance(v, (list, dict)) else str(v)))
    return out


def _run_config(path: Path | None) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(run.yaml content, flattened key/value rows); empty without one."""
    if path is None:
        return {}, []
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}, []
    return data, _flatten(data)


# --------------------------------------------------------------------------- rendering


@functools.lru_cache(maxsize=1)
def _env() -> Environment:
    env = Environment(loader=PackageLoader("nccltrace.outputs", "templates"), autoescape=select_autoescape(["html", "j2"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(bytes=fmt_bytes, ns=fmt_ns, thousands=fmt_int, share=fmt_share, num=fmt_float)
    return env


def _write_html(out_html: Path, text: str) -> Path:
    with atomic_output(out_html) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return out_html


def _renderer() -> str:
    code = code_version()
    commit = code.get("git_commit")
    return f"nccltrace {code.get('nccltrace', '?')}" + (f" (commit {commit[:12]})" if commit else "")


def _pivot(df: pd.DataFrame | None, index: str | list[str], columns: str, values: str,
           order: Sequence[str] | None = None) -> pd.DataFrame | None:
    """Wide view (index x columns) of a long table; rows in ``order`` when given."""
    if df is None or df.empty or values not in df:
        return None
    p = df.pivot_table(index=index, columns=columns, values=values, aggfunc="sum", fill_value=0, observed=True)
    if order is not None:
        p = p.reindex([o for o in order if o in p.index])
    p = p[sorted(p.columns, key=str)]
    p.columns = [str(c) for c in p.columns]
    return p.reset_index()


_VV_NEEDED = ("parallelism", "role", "definition", "theory_bytes", "observed_bytes", "ratio")


def validation_compact(vv: pd.DataFrame | None, order: Sequence[str] | None = None) -> pd.DataFrame | None:
    """Table-5.1-like view of a volume validation table: one row per (run,) parallelism and role,
    theory / observed / ratio side by side for each definition, and the dominant discrepancy.
    None when the table lacks the columns this view needs (the full table is shown anyway)."""
    if vv is None or vv.empty or not all(c in vv for c in _VV_NEEDED):
        return None
    keys = [c for c in ("run", "assumptions") if c in vv and vv[c].nunique(dropna=False) > 1] + ["parallelism", "role"]
    keys = (["run"] if "run" in vv and "run" not in keys and order is not None else []) + keys
    df = vv.copy()
    for k in keys:
        df[k] = df[k].astype("string").fillna("\u2013")
    wide = df.pivot_table(index=keys, columns="definition", values=["theory_bytes", "observed_bytes", "ratio"],
                          aggfunc="first", observed=True, sort=False)  # fmt: skip
    cols = []
    for d in sorted(df["definition"].astype(str).unique(), key=lambda x: (x != "payload", x)):
        for v, short in (("theory_bytes", "theory"), ("observed_bytes", "observed"), ("ratio", "ratio")):
            if (v, d) in wide.columns:
                cols.append(((v, d), f"{short} ({d})"))
    out = pd.DataFrame({name: wide[c] for c, name in cols}).reset_index()
    if "dominant_discrepancy" in df:
        first = df.sort_values("definition", key=lambda s: s.astype(str) != "payload", kind="stable")
        dom = first.groupby(keys, sort=False, observed=True)["dominant_discrepancy"].first().rename(
            "dominant discrepancy")
        out = out.merge(dom.reset_index(), on=keys, how="left")
    if order is not None and "run" in out:
        rank = {r: i for i, r in enumerate(order)}
        out = out.sort_values("run", key=lambda s: s.map(rank).fillna(len(rank)), kind="stable")
    return out.reset_index(drop=True)


def _overview(tables: Tables) -> dict[str, Any]:
    ov = tables.get("overview")
    # None for nulls: templates test "is not none" (pd.NA has no truth value)
    return {} if ov is None or ov.empty else {k: (None if _na(v) else v) for k, v in ov.iloc[0].items()}


def _inferred_vs_declared(run_dir: Path, ops_manifest: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """What the run's labels and communicators rest on: declared sizes, sizes inferred from the
    communicators, or guesses; communicators from init lines or from call sequences."""
    import pyarrow.parquet as pq

    rows: list[tuple[str, str]] = []
    labels = RunLayout(run_dir).labels
    if labels.is_file():
        src = pq.read_table(labels, columns=["label_source"]).column(0).to_pylist()
        counts = {k: src.count(k) for k in sorted(set(map(str, src)))}
        rows.append(("parallelism labels", ", ".join(f"{k}: {v} communicator(s)" for k, v in counts.items())
                     + (" (pg-names: the PyTorch process group's own name; megatron-groups: matched to the groups "
                        "of the run's sizes; behaviour: the layout most likely from what each communicator does, "
                        "not certain; heuristic: guesses)"
                        if len(counts) > 1 or counts.keys() & {"heuristic", "behaviour"} else "")))  # fmt: skip
    notes = [str(n) for n in (ops_manifest or {}).get("notes") or []]
    named = [n for n in notes if "named by their PyTorch process group" in n]
    if named:
        rows.append(("communicator names", named[0]))
    sizes = [n for n in notes if n.startswith(("parallel sizes inferred", "parallelism labels are guesses",
                                               "parallel sizes from the PyTorch"))]
    if sizes:
        rows.append(("parallel sizes", sizes[0]))
    elif not named:
        rows.append(("parallel sizes", "declared (run.yaml or the command line)"))
    comms = RunLayout(run_dir).communicators
    if comms.is_file():
        kinds = pq.read_table(comms, columns=["kind"]).column(0).to_pylist()
        inferred = sum(1 for k in kinds if k == "sequence")
        rows.append(("communicators", f"{len(kinds) - inferred} from init/split lines, {inferred} inferred from "
                     "call sequences (no init lines)" if inferred else f"{len(kinds)} from init/split lines"))
    return rows


def render_run_report(
    run_dir: Path | str,
    out_html: Path | str,
    *,
    tables_dir: Path | str,
    plots_dir: Path | str,
    run_id: str | None = None,
    manifests: Iterable[Path] | None = None,
    run_yaml: Path | str | None = None,
) -> Path:
    """Render the report of one run into ``out_html`` (written atomically) and return its path.
    ``manifests``: the stage manifests to show (default: every one in ``run_dir``);
    ``run_yaml``: the run's settings record (default: ``run_dir/raw/run.yaml``)."""
    run_dir, out_html = Path(run_dir), Path(out_html)
    layout = RunLayout(run_dir)
    out_dir = out_html.parent
    tables = load_tables(tables_dir, out_dir)
    figures = load_figures(plots_dir, RUN_FIGURES)
    config, config_rows = _run_config(Path(run_yaml) if run_yaml is not None else layout.run_yaml)
    ops_manifest = _json(layout.manifest(layout.ops_dir))
    manifests = run_manifests(run_dir, exclude=out_dir, paths=manifests)
    run_id = run_id or run_dir.name

    flags: list[str] = []
    if ops_manifest is None:
        flags.append("The ops stage manifest (ops/manifest.json) is missing: completeness cannot be confirmed.")
    causes, marked = partial_flags(manifests)
    flags += causes
    if marked:
        flags.append(f"Marked PARTIAL by: {'; '.join(marked)}.")
    ov = _overview(tables)
    trace = layout.trace
    settings = config.get("config", config) if isinstance(config, Mapping) else {}
    key_settings = [(f.name, settings.get(f.name)) for f in CONFIG_FIELDS if settings.get(f.name) is not None]
    derived = config.get("derived", {}) if isinstance(config, Mapping) else {}
    if isinstance(derived, Mapping):
        key_settings += [(f"{k} (derived)", derived[k]) for k in ("world_size", "dp", "num_microbatches")
                         if derived.get(k) is not None]  # fmt: skip

    msg = tables.get("message_sizes")
    msg_pivot = None
    if msg is not None and not msg.empty:
        m2 = msg[msg["calls"] > 0]
        msg_pivot = _pivot(m2, ["bucket", "bucket_label"], "op", "calls")
        if msg_pivot is not None:
            msg_pivot = msg_pivot.drop(columns=["bucket"]).rename(columns={"bucket_label": "size bucket"})
    bw = tables.get("bandwidth")
    vv = tables.get("volume_validation")
    provenance_of_labels = _inferred_vs_declared(run_dir, ops_manifest)
    context = {
        "title": f"NCCL communication report: {run_id}",
        "run_id": run_id,
        "flags": flags,
        "partial": bool(ops_manifest and ops_manifest.get("partial")) or any(m["partial"] for m in manifests),
        "overview": ov,
        "key_settings": key_settings,
        "config_rows": config_rows,
        "figures": figures,
        "alignment": tables.view("alignment"),
        "match_checks": tables.view("match_checks") if tables.get("match_checks") is not None else None,
        "match_check_findings": (tables.view("match_check_findings")
                                 if tables.get("match_check_findings") is not None
                                 and not tables.get("match_check_findings").empty else None),
        "op_counts": tables.view("op_counts"),
        "kernel_counts": tables.view("kernel_counts"),
        "volume_by_op": tables.view("volume_by_op"),
        "volume_by_parallelism": tables.view("volume_by_parallelism"),
        "rank_volume": tables.view("rank_volume"),
        "message_sizes": table_view(msg_pivot, csv_href=tables.csv.get("message_sizes"),
                                    note="calls per bucket (rows) and NCCL function (columns)"),
        "inferred": provenance_of_labels,
        "time_lost": tables.view("time_lost") if tables.get("time_lost") is not None
        and not tables.get("time_lost").empty else None,
        "bandwidth": tables.view("bandwidth", bw.drop(columns=["bucket", "bucket_lo_bytes", "bucket_hi_bytes"],
                                                      errors="ignore"))
        if bw is not None and not bw.empty else None,
        "volume_validation": tables.view("volume_validation") if vv is not None else None,
        "volume_validation_compact": _compact_view(tables, vv, None),
        "trace_href": _rel(trace, out_dir) if trace.exists() else None,
        "trace_size": fmt_bytes(trace.stat().st_size) if trace.exists() else None,
        "has_metrics": layout.metric("op_metrics").exists(),
        "manifests": manifests,
        "renderer": _renderer(),
    }  # fmt: skip
    html = _env().get_template("run_report.html.j2").render(**context)
    return _write_html(out_html, html)


# --------------------------------------------------------------------------- campaign


def _campaign_name(campaign_dir: Path) -> str:
    return campaign_dir.parent.name if campaign_dir.name == "campaign" else campaign_dir.name


def _run_status(run: str, run_dir: Path | None, available: bool, missing: Mapping[str, str]) -> dict[str, Any]:
    """Status of one configuration: 'missing' (with the reason given), 'partial', 'no results' or 'ok'."""
    if run in missing:
        return {"status": "missing", "reason": str(missing[run]), "problems": []}
    manifest = None
    if run_dir is not None:
        # the run report's manifest carries every stage's causes (partial propagates); older
        # runs without one are judged by their ops stage
        layout = RunLayout(run_dir)
        manifest = _json(layout.manifest(layout.report_dir)) or _json(layout.manifest(layout.ops_dir))
    problems = [str(p) for p in (manifest or {}).get("problems") or []]
    if manifest and manifest.get("partial"):
        problems = list(dict.fromkeys([*(str(r) for r in manifest.get("partial_reasons") or []), *problems]))
    if not available:
        return {"status": "no results", "reason": "no summary tables for this run (reason not recorded)",
                "problems": problems}
    if manifest is None:
        return {"status": "unverified", "reason": "ops/manifest.json missing", "problems": problems}
    if manifest.get("partial") or problems:
        shown = problems[:MAX_STATUS_REASONS]
        more = f" (and {len(problems) - len(shown)} more in the run report)" if len(problems) > len(shown) else ""
        return {"status": "partial", "reason": "; ".join(shown) + more or "marked partial", "problems": problems}
    return {"status": "ok", "reason": "", "problems": []}


def render_campaign_report(
    campaign_dir: Path | str,
    out_html: Path | str,
    *,
    runs: Mapping[str, Path | str],
    missing: Mapping[str, str] | None = None,
    tables_dir: Path | str,
    plots_dir: Path | str,
) -> Path:
    """Render the campaign report (every configuration side by side; missing and failed runs with
    the reason) into ``out_html`` and return its path. ``runs`` maps run id -> run directory,
    ``missing`` run id -> why it has no results."""
    campaign_dir, out_html = Path(campaign_dir), Path(out_html)
    out_dir = out_html.parent
    missing = dict(missing or {})
    tables = load_tables(tables_dir, out_dir)
    figures = load_figures(plots_dir, ("campaign_comparison",))
    runs_tbl = tables.get("runs")
    run_dirs = {r: Path(p) for r, p in runs.items()}
    order: list[str] = list(runs_tbl["run"].astype(str)) if runs_tbl is not None else []
    order += [r for r in list(run_dirs) + list(missing) if r not in order]
    available = dict(zip(order, [False] * len(order)))
    if runs_tbl is not None:
        available.update(zip(runs_tbl["run"].astype(str), runs_tbl["available"].fillna(False).astype(bool)))

    status_rows = []
    for r in order:
        st = _run_status(r, run_dirs.get(r), available.get(r, False), missing)
        rep = run_dirs[r] / "report" / "report.html" if r in run_dirs else None
        st.update(run=r, report_href=_rel(rep, out_dir) if rep is not None and rep.exists() else None)
        status_rows.append(st)
    problems = [s for s in status_rows if s["status"] != "ok"]

    # configuration: columns that differ between runs in the table, the others stated once
    config_view, common = None, []
    if runs_tbl is not None and not runs_tbl.empty:
        cfg_cols = [f.name for f in CONFIG_FIELDS if f.name in runs_tbl]
        varying = [c for c in cfg_cols if runs_tbl[c].astype("string").fillna("\u2013").nunique() > 1]
        common = [(c, runs_tbl[c].iloc[0]) for c in cfg_cols if c not in varying and not _na(runs_tbl[c].iloc[0])]
        config_view = tables.view("runs", runs_tbl[["run"] + varying], max_rows=10_000)
        headline_cols = ["run", "calls", "kernels", "calls_single_rank", "duplicate_lines", "bytes",
                         "bytes_per_rank_mean", "bytes_per_rank_min", "bytes_per_rank_max", "matched_share",
                         "span_ns", "busbw_median_gbps"]  # fmt: skip
        headline = tables.view("runs", runs_tbl[[c for c in headline_cols if c in runs_tbl]], max_rows=10_000)
    else:
        headline = table_view(None, empty_text="no campaign tables")

    def pivot_view(name: str, index: str, columns: str, values: str, unit: str, note: str) -> TableView:
        p = _pivot(tables.get(name), index, columns, values, order)
        units = {c: unit for c in (p.columns if p is not None else []) if c != index}
        return table_view(p, units, max_rows=10_000, csv_href=tables.csv.get(name), note=note)

    bw = tables.get("bandwidth")
    bw_view = None
    large = (bw["busbw_median_gbps"].notna() & (bw["bucket_lo_bytes"] >= LARGE_MESSAGE_BYTES)) if bw is not None \
        else None
    if bw is not None and not bw.empty and large.any():
        b = bw[large].copy()
        b["w"] = b["busbw_median_gbps"].astype(float) * b["calls"].astype(float)
        g = b.groupby(["run", "op"], observed=True)[["w", "calls"]].sum()
        b2 = (g["w"] / g["calls"]).rename("busbw").reset_index()
        bw_view = pivot_view_from(b2, order, "GB/s", tables.csv.get("bandwidth"),
                                  "bus bandwidth [GB/s] of messages of 1 MiB or more: calls-weighted mean of the "
                                  "medians per communicator and size bucket (smaller messages measure latency)")
    vv = tables.get("volume_validation")
    context = {
        "title": f"NCCL communication campaign report: {_campaign_name(campaign_dir)}",
        "campaign": _campaign_name(campaign_dir),
        "n_runs": len(order),
        "n_ok": sum(s["status"] == "ok" for s in status_rows),
        "status_rows": status_rows,
        "problems": problems,
        "figures": figures,
        "config": config_view,
        "common": common,
        "headline": headline,
        "calls": pivot_view("op_counts", "run", "op", "calls", "", "calls per NCCL function (multi-rank "
                            "communicators, duplicates excluded)"),
        "kernels": pivot_view("kernel_counts", "run", "kernel_op", "kernels", "", "GPU kernels per kernel type "
                              "(fused P2P groups = one SendRecv kernel)"),
        "volume_op": pivot_view("volume_by_op", "run", "op", "bytes", "B", "payload bytes per NCCL function, "
                                "summed over ranks"),
        "volume_par": pivot_view("volume_by_parallelism", "run", "parallelism", "bytes_per_rank_mean", "B",
                                 "mean payload bytes per rank, per parallelism"),
        "bandwidth": bw_view,
        "volume_validation": tables.view("volume_validation", max_rows=500) if vv is not None else None,
        "volume_validation_compact": _compact_view(tables, vv, order),
        "renderer": _renderer(),
        "provenance": [dict(run=r, **_manifest_view(run_dirs[r] / "ops" / MANIFEST_FILE, run_dirs[r]))
                       for r in order if r in run_dirs and (run_dirs[r] / "ops" / MANIFEST_FILE).exists()],
    }  # fmt: skip
    html = _env().get_template("campaign_report.html.j2").render(**context)
    return _write_html(out_html, html)


def _compact_view(tables: Tables, vv: pd.DataFrame | None, order: Sequence[str] | None) -> TableView | None:
    compact = validation_compact(vv, order)
    if compact is None:
        return None
    units = {c: ("" if c.startswith("ratio") else "B") for c in compact.columns if "(" in c}
    return table_view(compact, units, max_rows=1000, note="theory and observed volume per rank over the run; "
                      "ratio = observed / theory", empty_text="no rows")  # fmt: skip


def pivot_view_from(df: pd.DataFrame, order: Sequence[str], unit: str, csv_href: str | None, note: str) -> TableView:
    """run x op table of a (run, op, busbw) frame."""
    p = df.pivot_table(index="run", columns="op", values="busbw", aggfunc="first", observed=True)
    p = p.reindex([o for o in order if o in p.index])
    p = p[sorted(p.columns, key=str)].reset_index()
    p.columns = [str(c) for c in p.columns]
    return table_view(p, {c: unit for c in p.columns if c != "run"}, max_rows=10_000, csv_href=csv_href, note=note)
