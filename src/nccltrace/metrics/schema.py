"""The volume validation table's schema: the report reads and documents the table without the
volume computation (and the Megatron model arithmetic it needs), so a change there re-runs
the volume stage, not the report."""

from __future__ import annotations

import pyarrow as pa

from nccltrace.core.tables import documented_field as _f

__all__ = ["VOLUME_SCHEMA"]

VOLUME_SCHEMA = pa.schema(
    [
        _f("run", pa.string(), "", "run (configuration) the row belongs to; null for a single run without run_id"),
        _f("parallelism", pa.string(), "", "comparison kind: dp, tp, pp, ep, cp (theory from the equations), "
           "'other' (communicators no equation covers: world, mp, embd, ...) or 'total' (all of a rank)"),
        _f("role", pa.string(), "", "ranks compared: 'all' (pp = 1) or pipeline stage 'first', 'middle', 'last' "
           "(the thesis's 'edge' = first and last)"),
        _f("definition", pa.string(), "", "'payload' (call bytes, Send and Recv both counted) or 'wire' (egress "
           "bytes per rank, ring conventions); see docs/volume.md"),
        _f("ranks", pa.int32(), "ranks", "number of ranks with this role"),
        _f("iterations", pa.int32(), "", "training iterations of the run"),
        _f("theory_bytes", pa.float64(), "B", "theoretical volume per rank over the run (mean over the role's ranks)"),
        _f("theory_bytes_per_iteration", pa.float64(), "B", "theory_bytes / iterations"),
        _f("observed_bytes", pa.float64(), "B", "observed volume per rank over the run, all logged calls of this "
           "kind (init and shutdown included), duplicates excluded, mean over the role's ranks"),
        _f("observed_bytes_per_iteration", pa.float64(), "B", "observed_bytes / iterations"),
        _f("observed_min_bytes", pa.float64(), "B", "smallest per-rank observed volume among the role's ranks"),
        _f("observed_max_bytes", pa.float64(), "B", "largest per-rank observed volume among the role's ranks"),
        _f("ratio", pa.float64(), "", "observed_bytes / theory_bytes (null when the theory is 0)"),
        _f("dominant_discrepancy", pa.string(), "", "the operation group contributing most to observed - theory, "
           "in words (count per rank over the run, op, size per call, communicator, purpose)"),
        _f("dominant_discrepancy_bytes", pa.float64(), "B", "its signed contribution to observed - theory per rank"),
        _f("source", pa.string(), "", "equations the theory comes from (e.g. 'thesis eq. 5.3; OSU eq. 2')"),
        _f("assumptions", pa.string(), "", "'run' (inputs as the run was launched) or 'thesis-table-5.1' (the "
           "thesis text's inputs)"),
        _f("notes", pa.string(), "", "input mismatches (e.g. top-k of the text vs the run), approximations, gaps"),
    ],
    metadata={"table": "volume_validation", "doc": "Theoretical vs observed communication volume per rank, per "
              "parallelism kind, rank role and definition (nccltrace.metrics.volume)."},
)
