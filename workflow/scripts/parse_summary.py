"""Rule parse_summary: one run's parse results in one file (nccltrace.stages.parse_summary)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.acquisition.status import read_status  # noqa: E402
from nccltrace.core.layout import RunLayout  # noqa: E402
from nccltrace.core.settings import RunSettings  # noqa: E402
from nccltrace.stages.parse_summary import run_parse_summary  # noqa: E402
from nccltrace.stages.sources import source_problems  # noqa: E402

sm = snakemake  # noqa: F821
status = read_status(sm.input.raw)
layout = RunLayout(Path(sm.output.summary).parents[1])
# a run without logs: the sources not used, and what its sources do not record
problems = [*(status.get("problems") or []), *source_problems(layout)]
run_parse_summary(layout, sm.params.processes, sm.params.hosts, run_id=sm.wildcards.run,
                  expected_processes=int(sm.params.expected_processes), expected_nodes=int(sm.params.expected_nodes),
                  settings=RunSettings.from_mapping(sm.params.settings), warnings=status.get("warnings") or [],
                  input_problems=problems).echo()
