# Correlation: per-process alignment of call lines with kernels (fanned out), then per run.


rule align:
    input:
        code=code_stamp("align"),
        calls=f"{RESULTS}/{{run}}/parsed/nccl/{{proc}}/calls.parquet",
        # init lines: their logged commIds name communicators in NCCL's NVTX payloads
        comms=f"{RESULTS}/{{run}}/parsed/nccl/{{proc}}/comms.parquet",
        kernels=lambda wc: f"{RESULTS}/{wc.run}/parsed/nsys/{proc_host(wc)}/kernels.parquet",
        session=lambda wc: f"{RESULTS}/{wc.run}/parsed/nsys/{proc_host(wc)}/session.json",
        nvtx=lambda wc: f"{RESULTS}/{wc.run}/parsed/nsys/{proc_host(wc)}/nvtx.parquet",
        launches=lambda wc: f"{RESULTS}/{wc.run}/parsed/nsys/{proc_host(wc)}/launches_without_kernel.parquet",
    output:
        alignment=f"{RESULTS}/{{run}}/aligned/{{proc}}/alignment.parquet",
        quality=f"{RESULTS}/{{run}}/aligned/{{proc}}/alignment_quality.json",
        manifest=f"{RESULTS}/{{run}}/aligned/{{proc}}/manifest.json",
    params:
        code=stage_code_hash("align"),
        mode=config.get("analysis", {}).get("alignment", "default"),
        nccl_version=lambda wc: RUNS[wc.run].settings.get("nccl_version"),
        settings=run_settings,
    log:
        f"{RESULTS}/{{run}}/logs/align/{{proc}}.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/align/{{proc}}.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/align.py"


rule ops:
    input:
        code=code_stamp("ops"),
        alignments=lambda wc: [
            f"{RESULTS}/{wc.run}/aligned/{proc}/alignment.parquet" for proc in nccl_processes(wc)
        ],
        qualities=lambda wc: [
            f"{RESULTS}/{wc.run}/aligned/{proc}/alignment_quality.json" for proc in nccl_processes(wc)
        ],
        reports=lambda wc: [
            f"{RESULTS}/{wc.run}/parsed/nccl/{proc}/parse_report.json" for proc in nccl_processes(wc)
        ],
        sessions=lambda wc: [
            f"{RESULTS}/{wc.run}/parsed/nsys/{host}/session.json" for host in nsys_hosts(wc)
        ],
        communicators=f"{RESULTS}/{{run}}/communicators/communicators.parquet",
        members=f"{RESULTS}/{{run}}/communicators/communicator_members.parquet",
    output:
        ops=f"{RESULTS}/{{run}}/ops/ops.parquet",
        labels=f"{RESULTS}/{{run}}/ops/parallelism.parquet",
        clock=f"{RESULTS}/{{run}}/ops/clock_sync.parquet",
        quality=f"{RESULTS}/{{run}}/ops/alignment_quality.parquet",
        manifest=f"{RESULTS}/{{run}}/ops/manifest.json",
    params:
        code=stage_code_hash("ops"),
        settings=run_settings,
    log:
        f"{RESULTS}/{{run}}/logs/ops.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/ops.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/ops.py"
