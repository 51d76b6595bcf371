# Parsing: one job per node (every NCCL log of its processes and its nsys export), then summarised.
# A run without NCCL logs first has its profiler traces read and its processes listed (checkpoint
# sources); each node's job then parses its kernel source and its processes' records
# (nccltrace.stages.sources).


checkpoint sources:
    input:
        code=code_stamp("sources"),
        raw=raw_dir,
    output:
        # each profiler trace's tables, read once (inputs/kernels/<trace>/)
        kernels=directory(RUN.staged_kernels),
        # the processes (one per rank; of nsys exports alone: per recorded host and pid), their sources
        processes=RUN.source_processes,
        manifest=RUN.manifest(RUN.source_processes.parent),
    params:
        code=stage_code_hash("sources"),
    # one trace (or export) at a time; the export parse's cost per byte stands in (not measured here)
    resources:
        mem_mb=job_mem("parse_nsys", largest_source_bytes),
    log:
        RUN.log("sources"),
    benchmark:
        RUN.benchmark("sources")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/sources.py"


rule parse_node:
    input:
        # a run without logs: its processes' listing and staged traces
        unpack(source_inputs),
        code=code_stamp("parse_node"),
        raw=raw_dir,
    output:
        # per-process tables, parse reports and manifests in <proc>/ (parse_nccl's), one per log
        nccl=directory(RUN.parsed_nccl_node("{host}")),
        # the export's tables, session.json and manifest (parse_nsys's); 'no export' tables without one
        nsys=directory(RUN.parsed_nsys("{host}")),
    params:
        code=stage_code_hash("parse_node"),
        processes=node_processes,
        recorded=node_recorded,
        settings=run_settings,
    # one process, then the export, at a time: the larger of the two peaks
    resources:
        mem_mb=node_job_mem(("parse_nccl", None), ("parse_nsys", export_bytes)),
    log:
        RUN.log("parse_node", "{host}"),
    benchmark:
        RUN.benchmark("parse_node", "{host}")
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/parse_node.py"


rule parse_summary:
    input:
        # a run without logs: the sources its listing did not use
        unpack(source_inputs),
        code=code_stamp("parse_summary"),
        # each process's parse report and manifest (which says what the parser does not judge,
        # a log cut mid-line)
        logs=per_log_node(lambda layout, host: layout.parsed_nccl_node(host)),
        # each export's session and kernels (NCCL kernels of processes without a log)
        exports=per_export_node(lambda layout, host: layout.parsed_nsys(host)),
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
        # each process's init lines (comms.parquet)
        parsed=per_log_node(lambda layout, host: layout.parsed_nccl_node(host)),
        # each export's session (a profiler trace names its process's global rank)
        exports=per_export_node(lambda layout, host: layout.parsed_nsys(host)),
    output:
        communicators=RUN.communicators,
        members=RUN.members,
        manifest=RUN.manifest(RUN.communicators_dir),
    params:
        code=stage_code_hash("communicators"),
        processes=nccl_processes,
        hosts=nsys_hosts,
        settings=analysis_settings,
    log:
        RUN.log("communicators"),
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/communicators.py"
