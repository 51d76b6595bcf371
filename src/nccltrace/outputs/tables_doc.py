"""The table documentation (``docs/tables.md``, ``nccltrace tables-doc``): every table's columns
with type, unit and meaning. Apart from :mod:`nccltrace.core.tables` because it imports every stage's
schema; the I/O helpers every stage uses must not."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from nccltrace.core.tables import SCHEMA_VERSION, TABLES

__all__ = ["documented_schema_of", "documented_schemas", "tables_markdown"]


_KERNEL_SOURCE_DOCS = {
    "kernels": "Per node (parsed/nsys/<host>/) and per kernel source (inputs/kernels/<source>/): every NCCL kernel "
               "with its launch; the call-argument columns (coll_*, pg_*, external_id) only from profiler traces, null "
               "from nsys exports (docs/nsys.md, docs/kineto.md).",
    "nvtx": "Per node and kernel source: NVTX ranges and marks, with NCCL's decoded payloads (docs/nsys.md).",
    "processes": "Per node and kernel source: the processes of the capture (docs/nsys.md).",
    "launches_without_kernel": "Per node and kernel source: kernel launches without a kernel record (lost "
                               "records, launches inside a CUDA-graph capture) (docs/nsys.md).",
    "comm_records": "Per profiler trace (inputs/kernels/<source>/) and per node with one: ProcessGroupNCCL's "
                    "record of each call (the record_param_comms CPU ops: collectives, send, recv, wait), in start "
                    "order; empty without CPU activity or when no kernel source is a profiler trace (an nsys "
                    "export's parse writes none) (nccltrace.kineto.reader).",
}


def documented_schemas() -> dict[str, pa.Schema]:
    """Every table the package writes, by documented name: the one registry ``tables-doc``
    renders and :func:`documented_schema_of` looks written files up in."""
    from nccltrace.align.quality import QUALITY_SCHEMA
    from nccltrace.align.schema import ALIGNMENT_SCHEMA
    from nccltrace.communicators.labels import LABEL_SCHEMA
    from nccltrace.communicators.schema import COMMUNICATOR_SCHEMA, MEMBER_SCHEMA
    from nccltrace.metrics.compute import TABLE_SCHEMAS as METRICS_SCHEMAS
    from nccltrace.metrics.schema import VOLUME_SCHEMA
    from nccltrace.nsys.nccl_api import NCCL_API_CALLS_SCHEMA
    from nccltrace.nsys.schema import (
        COMM_RECORD_DOCS,
        KERNEL_SOURCE_TABLES,
        PROFILER_TABLES,
        spec_schema,
    )
    from nccltrace.ops.build import CLOCK_SYNC_SCHEMA, OPS_SCHEMA
    from nccltrace.outputs.summary import (
        CAMPAIGN_RUNS_SCHEMA,
        MATCH_CHECK_SCHEMAS,
        RUN_SCHEMAS,
        written_schema,
    )

    out: dict[str, pa.Schema] = dict(TABLES)
    for name, spec in KERNEL_SOURCE_TABLES.items():
        out[name] = spec_schema(spec).with_metadata({"doc": _KERNEL_SOURCE_DOCS[name]})
    for name, spec in PROFILER_TABLES.items():
        out[name] = spec_schema(spec, COMM_RECORD_DOCS).with_metadata({"doc": _KERNEL_SOURCE_DOCS[name]})
    out["nccl_api_calls"] = NCCL_API_CALLS_SCHEMA
    out["communicators"] = COMMUNICATOR_SCHEMA.with_metadata({"doc": "Logical communicators of a run, from "
                                                                     "init/split lines (nccltrace.communicators.infer)."})
    out["communicator_members"] = MEMBER_SCHEMA.with_metadata({"doc": "Each process's communicator pointer with "
                                                                      "its logical communicator, rank and global "
                                                                      "rank."})
    out["alignment"] = ALIGNMENT_SCHEMA.with_metadata({"doc": "Per process (aligned/<host>/<proc>/): every call "
                                                              "line with its kernel or why none, and every kernel no "
                                                              "call was matched to (nccltrace.align)."})
    from nccltrace.inputs.call_sources import CALL_SOURCE_SCHEMA

    out["call_sources"] = CALL_SOURCE_SCHEMA.with_metadata({"doc": "Per process without an NCCL log "
                                                                   "(parsed/nccl/<host>/<proc>/): per call, the source "
                                                                   "of each fact (nccltrace.inputs.call_records; "
                                                                   "docs/evidence-sources.md)."})  # fmt: skip
    out["alignment_quality"] = QUALITY_SCHEMA.with_metadata({"doc": "Per run (ops/): per process and check, the "
                                                                    "matches the check confirmed, contradicted "
                                                                    "(demoted) and could not test "
                                                                    "(nccltrace.align.quality; docs/correlation.md)."})
    out["parallelism"] = LABEL_SCHEMA.with_metadata({"doc": "Per run (ops/): the parallelism each logical "
                                                            "communicator serves (nccltrace.communicators.labels)."})
    out["ops"] = OPS_SCHEMA.with_metadata({"doc": "Per run (ops/): the enriched per-operation table: alignment + "
                                                  "call arguments + communicator, ranks, parallelism, instance, "
                                                  "clock-synchronised kernel times (nccltrace.ops.build)."})
    out["clock_sync"] = CLOCK_SYNC_SCHEMA
    for name, schema in METRICS_SCHEMAS.items():
        out[name] = schema.with_metadata({"doc": f"Per run (metrics/{name}.parquet; nccltrace.metrics.compute)."})
    out["volume_validation"] = VOLUME_SCHEMA.with_metadata({
        "doc": "Per run (volume/): theoretical vs observed communication volume per rank, thesis table 5.1 style "
               "(nccltrace.metrics.volume; also as CSV)."})  # fmt: skip
    for name in [*RUN_SCHEMAS, *MATCH_CHECK_SCHEMAS, "volume_validation"]:
        schema = written_schema(name)
        out[f"report/tables/{name}"] = schema.with_metadata({
            "doc": f"Per run (report/tables/{name}.parquet and .csv; nccltrace.outputs.summary). "
                   + (schema.metadata or {}).get(b"doc", b"").decode()})  # fmt: skip
    out["campaign/tables/runs"] = CAMPAIGN_RUNS_SCHEMA
    return out


def documented_schema_of(relative: Path | str) -> tuple[str, pa.Schema] | None:
    """The documented name and schema of a Parquet file the package wrote, from its path under a
    run's (or campaign's) directory; None for a file no table documents. A campaign's
    ``campaign/tables/<name>`` stacks the runs' ``report/tables/<name>`` after a ``run`` column."""
    from nccltrace.outputs.summary import campaign_schema

    rel = Path(relative)
    schemas = documented_schemas()
    if rel.parent.name == "tables" and rel.parent.parent.name == "campaign":
        schema = campaign_schema(rel.stem)
        return (f"campaign/tables/{rel.stem}", schema) if schema is not None else None
    name = f"report/tables/{rel.stem}" if rel.parent.name == "tables" and rel.parent.parent.name == "report" \
        else rel.stem
    return (name, schemas[name]) if name in schemas else None


def tables_markdown() -> str:
    """Render the documentation of every table (name, unit, meaning of each column)."""
    out = ["# Tables", "", "Generated by `nccltrace tables-doc`; schema version " + SCHEMA_VERSION + ".", ""]
    for name, schema in documented_schemas().items():
        meta = schema.metadata or {}
        out += [f"## `{name}.parquet`", "", meta.get(b"doc", b"").decode(), "", "| column | type | unit | meaning |",
                "|---|---|---|---|"]
        for field in schema:
            fm = field.metadata or {}
            out.append(
                f"| `{field.name}` | {field.type} | {fm.get(b'unit', b'').decode()} | {fm.get(b'doc', b'').decode()} |"
            )
        out.append("")
    return "\n".join(out)
