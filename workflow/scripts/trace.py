"""Rule trace: the run's Chrome Trace Event JSON (gzip), one process per rank, for Perfetto."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.provenance import write_manifest  # noqa: E402
from nccltrace.trace import write_run_traces  # noqa: E402

inp, out = snakemake.input, snakemake.output  # noqa: F821
run_dir = Path(inp.ops).parents[1]
opts = dict(snakemake.params.options)  # noqa: F821
summaries = write_run_traces(run_dir, Path(out.trace).parent, summary=True,
                             max_events=opts.get("max_events", 500_000),
                             summary_max_events=opts.get("summary_max_events", 200_000),
                             window_nvtx=opts.get("window_nvtx"), min_message_bytes=opts.get("min_message_bytes"))
notes = [n for s in summaries for n in s.notes]
write_manifest(out.manifest, stage="trace", inputs=[inp.ops, inp.op_metrics, inp.labels, *inp.nvtx, *inp.sessions],
               outputs=[s.path for s in summaries], config=opts,
               extra={"files": {s.path.name: {"events": s.events, "bytes": s.bytes, "json_bytes": s.json_bytes,
                                              "truncated": s.truncated} for s in summaries},
                      "events": sum(s.events for s in summaries), "clock": summaries[0].clock if summaries else None,
                      "truncated": any(s.truncated for s in summaries), "notes": notes})
for s in summaries:
    print(f"{s.path}: {s.events} events, {s.bytes} bytes, clock {s.clock}")
