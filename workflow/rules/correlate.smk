# Correlation: per-process alignment of call lines with kernels (fanned out), then per run.


rule align:
    input:
        code=code_stamp("align"),
        calls=RUN.parsed_nccl_table("{proc}", "calls"),
        # init lines: their logged commIds name communicators in NCCL's NVTX payloads
        comms=RUN.parsed_nccl_table("{proc}", "comms"),
        versions=RUN.parsed_nccl_table("{proc}", "versions"),
        kernels=of_proc_host(lambda layout, host: layout.parsed_nsys_table(host, "kernels")),
        session=of_proc_host(lambda layout, host: layout.session(host)),
        nvtx=of_proc_host(lambda layout, host: layout.parsed_nsys_table(host, "nvtx")),
        launches=of_proc_host(lambda layout, host: layout.parsed_nsys_table(host, "launches_without_kernel")),
    output:
        alignment=RUN.alignment("{proc}"),
        quality=RUN.alignment_quality("{proc}"),
        manifest=RUN.manifest(RUN.aligned("{proc}")),
    params:
        code=stage_code_hash("align"),
        host=proc_host,
        mode=config.get("analysis", {}).get("alignment", "default"),
        nccl_version=lambda wc: RUNS[wc.run].settings.get("nccl_version"),
        settings=run_settings,
    resources:
        mem_mb=job_mem("align", lambda wc, input: parquet_rows(input.calls)),
    log:
        RUN.log("align", "{proc}"),
    benchmark:
        RUN.benchmark("align", "{proc}")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/align.py"


rule ops:
    input:
        code=code_stamp("ops"),
        alignments=per_process(lambda layout, proc: layout.alignment(proc)),
        qualities=per_process(lambda layout, proc: layout.alignment_quality(proc)),
        # each process's parsed call lines (arguments the alignment table does not carry)
        calls=per_process(lambda layout, proc: layout.parsed_nccl_table(proc, "calls")),
        sessions=per_node(lambda layout, host: layout.session(host)),
        communicators=RUN.communicators,
        members=RUN.members,
    output:
        ops=RUN.ops,
        labels=RUN.labels,
        clock=RUN.clock,
        quality=RUN.quality,
        manifest=RUN.manifest(RUN.ops_dir),
    params:
        code=stage_code_hash("ops"),
        processes=nccl_processes,
        hosts=nsys_hosts,
        settings=run_settings,
    # one process at a time plus the clock fit (at most 2 million rows)
    resources:
        mem_mb=job_mem("ops", lambda wc, input: sum(parquet_rows(p) for p in input.alignments)),
    log:
        RUN.log("ops"),
    benchmark:
        RUN.benchmark("ops")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/ops.py"
