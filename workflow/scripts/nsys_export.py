"""Rule nsys_export: `nsys export --type sqlite` of one report, flags detected from the installed nsys."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.acquisition.nsys_export import export_report  # noqa: E402

sm = snakemake  # noqa: F821
record = export_report(Path(sm.input.report), Path(sm.output.export), nsys=sm.params.nsys)
Path(sm.output.record).write_text(json.dumps(record.to_dict(), indent=2, default=str))
print(json.dumps(record.to_dict(), indent=2, default=str))
