# Parsing: fanned out per process (NCCL logs) and per node (nsys exports), then summarised.


rule parse_nccl:
    input:
        code=code_stamp("parse_nccl"),
        raw=raw_dir,
    output:
        tables=[RUN.parsed_nccl_table("{proc}", table) for table in NCCL_TABLES],
        report=RUN.parse_report("{proc}"),
        manifest=RUN.manifest(RUN.parsed_nccl("{proc}")),
    params:
        code=stage_code_hash("parse_nccl"),
        settings=run_settings,
    resources:
        mem_mb=job_mem("parse_nccl"),
    log:
        RUN.log("parse_nccl", "{proc}"),
    benchmark:
        RUN.benchmark("parse_nccl", "{proc}")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/parse_nccl.py"


rule parse_nsys:
    input:
        code=code_stamp("parse_nsys"),
        raw=raw_dir,
    output:
        tables=[RUN.parsed_nsys_table("{host}", table) for table in NSYS_TABLES],
        session=RUN.session("{host}"),
        manifest=RUN.manifest(RUN.parsed_nsys("{host}")),
    params:
        code=stage_code_hash("parse_nsys"),
        settings=run_settings,
    resources:
        mem_mb=job_mem("parse_nsys", export_bytes),
    log:
        RUN.log("parse_nsys", "{host}"),
    benchmark:
        RUN.benchmark("parse_nsys", "{host}")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/parse_nsys.py"


rule parse_summary:
    input:
        code=code_stamp("parse_summary"),
        reports=per_process(lambda layout, proc: layout.parse_report(proc)),
        # the parse job's manifest says what the parser does not judge (a log cut mid-line)
        manifests=per_process(lambda layout, proc: layout.manifest(layout.parsed_nccl(proc))),
        sessions=per_node(lambda layout, host: layout.session(host)),
        # NCCL kernels of processes without a log
        kernels=per_node(lambda layout, host: layout.parsed_nsys_table(host, "kernels")),
        raw=raw_dir,
    output:
        summary=RUN.parse_summary,
        manifest=RUN.manifest(RUN.parse_summary.parent),
    params:
        code=stage_code_hash("parse_summary"),
        processes=nccl_processes,
        hosts=nsys_hosts,
        expected_processes=lambda wc: RUNS[wc.run].world_size,
        expected_nodes=lambda wc: int(RUNS[wc.run].settings["nodes"]),
        settings=run_settings,
    log:
        RUN.log("parse_summary"),
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/parse_summary.py"


rule communicators:
    input:
        code=code_stamp("communicators"),
        comms=per_process(lambda layout, proc: layout.parsed_nccl_table(proc, "comms")),
    output:
        communicators=RUN.communicators,
        members=RUN.members,
        manifest=RUN.manifest(RUN.communicators_dir),
    params:
        code=stage_code_hash("communicators"),
        processes=nccl_processes,
        settings=run_settings,
    log:
        RUN.log("communicators"),
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/communicators.py"
