"""Rule parse_nsys: read one node's nsys SQLite export (nccltrace.stages.parse_nsys)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.acquisition.raw import read_status  # noqa: E402
from nccltrace.run_layout import RunLayout  # noqa: E402
from nccltrace.stages.parse_nsys import run_parse_nsys  # noqa: E402

sm = snakemake  # noqa: F821
host = sm.wildcards.host
# judged at import, where the file's surroundings (a leftover journal) were visible
unusable = (read_status(sm.input.raw).get("unusable_exports") or {}).get(host)
run_parse_nsys(RunLayout.of_raw(sm.input.raw).raw_export(host), Path(sm.output.session).parent, host,
               dict(sm.params.settings), unusable=unusable).echo()
