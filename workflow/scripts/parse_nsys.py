"""Rule parse_nsys: read one node's nsys SQLite export."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
from nccltrace.nsys.reader import NsysExport  # noqa: E402
from nccltrace.provenance import write_manifest  # noqa: E402

export_file = Path(snakemake.input.raw) / "nsys" / f"{snakemake.wildcards.host}.sqlite"  # noqa: F821
out = Path(snakemake.output.session).parent  # noqa: F821
export = NsysExport.open(export_file)
written = export.export_tables(out)
write_manifest(snakemake.output.manifest, stage="parse_nsys", inputs=[export_file],  # noqa: F821
               outputs=list(written.values()), config=dict(snakemake.params.settings))  # noqa: F821
print(f"schema {export.schema_version}, product {export.product_version}: {sorted(written)}")
