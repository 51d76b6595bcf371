# nccltrace workflow: acquire (SLURM) or emulate each run of the campaign matrix, then
# analyse it. Rules are thin; all logic lives in the `nccltrace` package.
#   snakemake --cores all                 # embedded example campaign (emulated)
#   snakemake --profile slurm             # on a SLURM cluster (see README)
import sys
from pathlib import Path

from snakemake.utils import min_version, validate

# Use this checkout's package (as the rule scripts do), so the code hashes that trigger re-runs
# describe the code the jobs actually run, whatever nccltrace is installed.
sys.path.insert(0, str(Path(workflow.basedir) / "src"))

min_version("9.0")


configfile: "config/config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/code_stamps.smk"
include: "workflow/rules/acquire.smk"
include: "workflow/rules/parse.smk"
include: "workflow/rules/correlate.smk"
include: "workflow/rules/metrics.smk"
include: "workflow/rules/report.smk"


rule all:
    localrule: True
    input:
        analysis_targets,
        f"{RESULTS}/campaign/report.html",
    default_target: True
