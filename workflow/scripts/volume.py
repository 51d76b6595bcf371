"""Rule volume: theoretical vs observed communication volume per rank of one run (thesis table 5.1 style)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))  # noqa: F821
from _bootstrap import setup  # noqa: E402

setup(snakemake)  # noqa: F821
import yaml  # noqa: E402

from nccltrace.provenance import write_manifest  # noqa: E402
from nccltrace.tables import read_table  # noqa: E402
from nccltrace.volume import OPS_COLUMNS, volume_validation, write_volume_validation  # noqa: E402

inp, out = snakemake.input, snakemake.output  # noqa: F821
# the model as the run used it: the raw run record when the run has one, else the campaign settings
run_yaml = Path(inp.raw) / "run.yaml"
settings = yaml.safe_load(run_yaml.read_text()) if run_yaml.is_file() else dict(snakemake.params.settings)  # noqa: F821
table = volume_validation(settings, read_table(inp.ops, columns=OPS_COLUMNS), run=snakemake.wildcards.run)  # noqa: F821
paths = write_volume_validation(table, Path(out.parquet).parent)
write_manifest(out.manifest, stage="volume", inputs=[inp.ops, *([run_yaml] if run_yaml.is_file() else [])],
               outputs=list(paths.values()), config=settings)
print(table.to_string())
