# What users look at: per-run tables, plots and report; the campaign's side-by-side report.


rule report:
    input:
        code=code_stamp("report"),
        ops=RUN.ops,
        quality=RUN.quality,
        labels=RUN.labels,
        communicators=RUN.communicators,
        op_metrics=RUN.metric("op_metrics"),
        stragglers=RUN.metric("stragglers"),
        volume=RUN.volume,
        trace=RUN.trace,
        # the parse summary names gaps in the inputs (missing logs/exports); its manifest's
        # partial flag and reasons reach the report's manifest and the campaign report
        summary=RUN.parse_summary,
        # every stage's provenance and partial reasons, shown in the report: the run-level
        # stages' manifests, and those of each process and export in the per-node directories
        manifests=lambda wc: run_layout(wc).stage_manifests((), ()),
        parsed=per_log_node(lambda layout, host: [layout.parsed_nccl_node(host), layout.aligned_node(host)]),
        exports=per_export_node(lambda layout, host: layout.parsed_nsys(host)),
        raw=raw_dir,
    output:
        tables=directory(RUN.report_tables),
        plots=directory(RUN.report_plots),
        html=report(
            RUN.report_html,
            caption="../report/run.rst",
            category="Runs",
            labels={"run": "{run}"},
        ),
        manifest=RUN.manifest(RUN.report_dir),
    params:
        code=stage_code_hash("report"),
        processes=nccl_processes,
        hosts=nsys_hosts,
    resources:
        mem_mb=job_mem("report", ops_rows),
    log:
        RUN.log("report"),
    benchmark:
        RUN.benchmark("report")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/report.py"


rule campaign_report:
    input:
        code=code_stamp("campaign_report"),
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
        code=stage_code_hash("campaign_report"),
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
