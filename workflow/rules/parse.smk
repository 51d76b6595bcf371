# Parsing: fanned out per process (NCCL logs) and per node (nsys exports), then summarised.


rule parse_nccl:
    input:
        code=code_stamp("parse_nccl"),
        raw=raw_dir,
    output:
        tables=expand(
            f"{RESULTS}/{{{{run}}}}/parsed/nccl/{{{{proc}}}}/{{table}}.parquet",
            table=NCCL_TABLES,
        ),
        report=f"{RESULTS}/{{run}}/parsed/nccl/{{proc}}/parse_report.json",
        manifest=f"{RESULTS}/{{run}}/parsed/nccl/{{proc}}/manifest.json",
    params:
        code=stage_code_hash("parse_nccl"),
        settings=run_settings,
    log:
        f"{RESULTS}/{{run}}/logs/parse_nccl/{{proc}}.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/parse_nccl/{{proc}}.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/parse_nccl.py"


rule parse_nsys:
    input:
        code=code_stamp("parse_nsys"),
        raw=raw_dir,
    output:
        tables=expand(
            f"{RESULTS}/{{{{run}}}}/parsed/nsys/{{{{host}}}}/{{table}}.parquet",
            table=NSYS_TABLES,
        ),
        session=f"{RESULTS}/{{run}}/parsed/nsys/{{host}}/session.json",
        manifest=f"{RESULTS}/{{run}}/parsed/nsys/{{host}}/manifest.json",
    params:
        code=stage_code_hash("parse_nsys"),
        settings=run_settings,
    log:
        f"{RESULTS}/{{run}}/logs/parse_nsys/{{host}}.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/parse_nsys/{{host}}.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/parse_nsys.py"


rule parse_summary:
    input:
        parsed=parsed_outputs,
        raw=raw_dir,
    output:
        summary=f"{RESULTS}/{{run}}/parsed/parse_summary.json",
        manifest=f"{RESULTS}/{{run}}/parsed/manifest.json",
    params:
        expected_processes=lambda wc: RUNS[wc.run].world_size,
        expected_nodes=lambda wc: int(RUNS[wc.run].settings["nodes"]),
        settings=run_settings,
    log:
        f"{RESULTS}/{{run}}/logs/parse_summary.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/parse_summary.py"


rule communicators:
    input:
        code=code_stamp("communicators"),
        reports=lambda wc: [
            f"{RESULTS}/{wc.run}/parsed/nccl/{proc}/parse_report.json"
            for proc in nccl_processes(wc)
        ],
    output:
        communicators=f"{RESULTS}/{{run}}/communicators/communicators.parquet",
        members=f"{RESULTS}/{{run}}/communicators/communicator_members.parquet",
        manifest=f"{RESULTS}/{{run}}/communicators/manifest.json",
    params:
        code=stage_code_hash("communicators"),
        settings=run_settings,
    log:
        f"{RESULTS}/{{run}}/logs/communicators.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/communicators.py"
