# Correlation: the alignment of call lines with kernels, one job per node, then per run.


rule align_node:
    input:
        # a run without logs: the listing that names the node's processes (params)
        unpack(source_inputs),
        code=code_stamp("align_node"),
        # each process's calls, init lines (their logged commIds name communicators in NCCL's
        # NVTX payloads) and versions
        parsed=RUN.parsed_nccl_node("{host}"),
        # the node's kernels, session, NVTX ranges and launches without a kernel
        export=RUN.parsed_nsys("{host}"),
        # the run's communicator members and every node's parsed logs: a collective's TUNING
        # line, printed on its communicator's rank 0 only, is evidence on every member
        members=RUN.members,
        rank0=per_log_node(lambda layout, host: layout.parsed_nccl_node(host)),
        # the acquired run, whose logs name the node's processes (params): a job running
        # remotely (SLURM) resolves checkpoint-dependent params only from a declared input
        raw=raw_dir,
    output:
        # per process: alignment.parquet, alignment_quality.json and manifest in <proc>/
        aligned=directory(RUN.aligned_node("{host}")),
    params:
        code=stage_code_hash("align_node"),
        processes=node_processes,
        # processes without an NCCL log: their alignment, from their records at parse, installed
        recorded=node_recorded,
        mode=config.get("analysis", {}).get("alignment", "default"),
        nccl_version=lambda wc: RUNS[wc.run].settings.get("nccl_version"),
        settings=run_settings,
    # one process at a time: the largest process's calls
    resources:
        mem_mb=job_mem("align", node_calls),
    log:
        RUN.log("align_node", "{host}"),
    benchmark:
        RUN.benchmark("align_node", "{host}")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/align_node.py"


rule ops:
    input:
        code=code_stamp("ops"),
        # each process's alignment and its quality record
        aligned=per_log_node(lambda layout, host: layout.aligned_node(host)),
        # each process's parsed call lines (arguments the alignment table does not carry)
        parsed=per_log_node(lambda layout, host: layout.parsed_nccl_node(host)),
        # each export's session (clocks)
        exports=per_export_node(lambda layout, host: layout.parsed_nsys(host)),
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
        settings=analysis_settings,
    # one process at a time, then the run-level checks one part of whole communicators at a time
    resources:
        mem_mb=job_mem("ops", alignment_rows),
    log:
        RUN.log("ops"),
    benchmark:
        RUN.benchmark("ops")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/ops.py"
