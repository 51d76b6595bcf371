# What users look at: per-run tables, plots and report; the campaign's side-by-side report.


rule report:
    input:
        code=code_stamp("report"),
        ops=f"{RESULTS}/{{run}}/ops/ops.parquet",
        quality=f"{RESULTS}/{{run}}/ops/alignment_quality.parquet",
        op_metrics=f"{RESULTS}/{{run}}/metrics/op_metrics.parquet",
        volume=f"{RESULTS}/{{run}}/volume/volume_validation.parquet",
        trace=f"{RESULTS}/{{run}}/trace/trace.json.gz",
        # the parse summary names gaps in the inputs (missing logs/exports); its manifest's
        # partial flag and reasons reach the report's manifest and the campaign report
        summary=f"{RESULTS}/{{run}}/parsed/parse_summary.json",
    output:
        tables=directory(f"{RESULTS}/{{run}}/report/tables"),
        plots=directory(f"{RESULTS}/{{run}}/report/plots"),
        html=report(
            f"{RESULTS}/{{run}}/report/report.html",
            caption="../report/run.rst",
            category="Runs",
            labels={"run": "{run}"},
        ),
        manifest=f"{RESULTS}/{{run}}/report/manifest.json",
    params:
        code=stage_code_hash("report"),
    log:
        f"{RESULTS}/{{run}}/logs/report.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/report.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/report.py"


rule campaign_report:
    input:
        code=code_stamp("report"),
        reports=run_report_manifests,
    output:
        tables=directory(f"{RESULTS}/campaign/tables"),
        plots=directory(f"{RESULTS}/campaign/plots"),
        html=report(
            f"{RESULTS}/campaign/report.html",
            caption="../report/campaign.rst",
            category="Campaign",
        ),
        manifest=f"{RESULTS}/campaign/manifest.json",
    params:
        code=stage_code_hash("report"),
        settings={run: RUNS[run].settings for run in RUN_IDS},
        failed=failed_runs,
    log:
        f"{RESULTS}/campaign/logs/campaign_report.log",
    benchmark:
        f"{RESULTS}/campaign/benchmarks/campaign_report.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/campaign_report.py"
