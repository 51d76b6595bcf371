# Metrics, volume validation and the trace, per run (after the ops table).


rule metrics:
    input:
        code=code_stamp("metrics"),
        ops=RUN.ops,
        communicators=RUN.communicators,
        # each process's TUNING lines, topology dumps and init lines (links, bus ids)
        parsed=per_log_node(lambda layout, host: layout.parsed_nccl_node(host)),
    output:
        **{name: RUN.metric(name) for name in METRIC_TABLES},
        manifest=RUN.manifest(RUN.metrics_dir),
    params:
        code=stage_code_hash("metrics"),
        processes=nccl_processes,
    # measured per call of its largest part and of the run (nccltrace.campaign.job_resources)
    resources:
        mem_mb=job_mem("metrics", metrics_part_calls),
    log:
        RUN.log("metrics"),
    benchmark:
        RUN.benchmark("metrics")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/metrics.py"


rule volume:
    input:
        code=code_stamp("volume"),
        ops=RUN.ops,
        raw=raw_dir,
    output:
        parquet=RUN.volume,
        csv=RUN.volume_csv,
        manifest=RUN.manifest(RUN.volume_dir),
    params:
        code=stage_code_hash("volume"),
        settings=analysis_settings,
    resources:
        mem_mb=job_mem("volume", ops_rows),
    log:
        RUN.log("volume"),
    benchmark:
        RUN.benchmark("volume")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/volume.py"


rule trace:
    input:
        code=code_stamp("trace"),
        ops=RUN.ops,
        labels=RUN.labels,
        op_metrics=RUN.metric("op_metrics"),
        # kernel geometry, NVTX ranges and session clocks of each node; call buffers of each process
        exports=per_export_node(lambda layout, host: layout.parsed_nsys(host)),
        parsed=per_log_node(lambda layout, host: layout.parsed_nccl_node(host)),
    output:
        trace=RUN.trace,
        summary=RUN.trace_summary,
        manifest=RUN.manifest(RUN.trace_dir),
    params:
        code=stage_code_hash("trace"),
        processes=nccl_processes,
        hosts=nsys_hosts,
        options=config.get("analysis", {}).get("trace", {}),
    # bounded by the trace's event cap and one process at a time, not by the run
    resources:
        mem_mb=job_mem("trace"),
    log:
        RUN.log("trace"),
    benchmark:
        RUN.benchmark("trace")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/trace.py"
