# Metrics, volume validation and the trace, per run (after the ops table).


rule metrics:
    input:
        code=code_stamp("metrics"),
        ops=f"{RESULTS}/{{run}}/ops/ops.parquet",
        communicators=f"{RESULTS}/{{run}}/communicators/communicators.parquet",
        reports=lambda wc: [
            f"{RESULTS}/{wc.run}/parsed/nccl/{proc}/parse_report.json" for proc in nccl_processes(wc)
        ],
    output:
        op_metrics=f"{RESULTS}/{{run}}/metrics/op_metrics.parquet",
        instances=f"{RESULTS}/{{run}}/metrics/instances.parquet",
        stragglers=f"{RESULTS}/{{run}}/metrics/stragglers.parquet",
        limits=f"{RESULTS}/{{run}}/metrics/limits.parquet",
        algorithms=f"{RESULTS}/{{run}}/metrics/algorithms.parquet",
        manifest=f"{RESULTS}/{{run}}/metrics/manifest.json",
    params:
        code=stage_code_hash("metrics"),
    # Metrics hold the run's ops (cross-rank instances): measured 4.9 GB for a 145 MB ops.parquet
    # (2.45M ops); requested from the cluster in proportion, with headroom.
    resources:
        mem_mb=lambda wc, input: max(4000, int(45 * input.size_mb)),
    log:
        f"{RESULTS}/{{run}}/logs/metrics.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/metrics.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/metrics.py"


rule volume:
    input:
        code=code_stamp("volume"),
        ops=f"{RESULTS}/{{run}}/ops/ops.parquet",
        raw=raw_dir,
    output:
        parquet=f"{RESULTS}/{{run}}/volume/volume_validation.parquet",
        csv=f"{RESULTS}/{{run}}/volume/volume_validation.csv",
        manifest=f"{RESULTS}/{{run}}/volume/manifest.json",
    params:
        code=stage_code_hash("volume"),
        settings=run_settings,
    resources:
        mem_mb=lambda wc, input: max(2000, int(12 * input.size_mb)),
    log:
        f"{RESULTS}/{{run}}/logs/volume.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/volume.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/volume.py"


rule trace:
    input:
        code=code_stamp("trace"),
        ops=f"{RESULTS}/{{run}}/ops/ops.parquet",
        labels=f"{RESULTS}/{{run}}/ops/parallelism.parquet",
        op_metrics=f"{RESULTS}/{{run}}/metrics/op_metrics.parquet",
        nvtx=lambda wc: [f"{RESULTS}/{wc.run}/parsed/nsys/{host}/nvtx.parquet" for host in nsys_hosts(wc)],
        sessions=lambda wc: [
            f"{RESULTS}/{wc.run}/parsed/nsys/{host}/session.json" for host in nsys_hosts(wc)
        ],
    output:
        trace=f"{RESULTS}/{{run}}/trace/trace.json.gz",
        summary=f"{RESULTS}/{{run}}/trace/trace.summary.json.gz",
        manifest=f"{RESULTS}/{{run}}/trace/manifest.json",
    params:
        code=stage_code_hash("trace"),
        options=config.get("analysis", {}).get("trace", {}),
    # bounded by the trace's event cap and one process at a time, not by the run
    resources:
        mem_mb=4000,
    log:
        f"{RESULTS}/{{run}}/logs/trace.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/trace.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/trace.py"
