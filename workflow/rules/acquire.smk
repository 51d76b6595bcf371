# Acquisition: every run gets an immutable raw/ directory (NCCL logs, nsys exports, launch
# record, run.yaml, status.json), whatever its backend:
#   slurm   train (sbatch'ed: Megatron-LM under nsys with NCCL logging) -> nsys_export per
#           report -> acquire (assembles raw/ from hard links)
#   emulate acquire runs the workload emulator
#   import  acquire brings in logs and exports of a run made elsewhere (import_dir)
# The training capture and the exports are protected: analysis code, plots or templates
# changing never re-runs them.


checkpoint train:
    output:
        capture=protected(directory(f"{RESULTS}/{{run}}/capture")),
    params:
        settings=run_settings,
        training=config.get("training", {}),
        runtime=lambda wc: hardware_of(wc).get("runtime", 60),
    resources:
        **train_resources(),
    log:
        f"{RESULTS}/{{run}}/logs/train.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/train.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/train.py"


rule nsys_export:
    input:
        report=nsys_report,
    output:
        export=protected(f"{RESULTS}/{{run}}/export/{{host}}.sqlite"),
        record=f"{RESULTS}/{{run}}/export/{{host}}.json",
    params:
        nsys=config.get("training", {}).get("nsys", "nsys"),
    resources:
        # large reports need memory; a retry after an out-of-memory kill asks for more
        mem_mb=lambda wc, attempt: 8000 * attempt,
        runtime=60,
    log:
        f"{RESULTS}/{{run}}/logs/nsys_export/{{host}}.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/nsys_export/{{host}}.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/nsys_export.py"


checkpoint acquire:
    input:
        unpack(acquire_inputs),
    output:
        raw=directory(f"{RESULTS}/{{run}}/raw"),
    params:
        settings=run_settings,
        backend=lambda wc: RUNS[wc.run].backend,
        nsys=config.get("training", {}).get("nsys", "nsys"),
    # The emulator emulates nodes in parallel processes (Snakemake caps this at --cores).
    threads: lambda wc: int(RUNS[wc.run].settings.get("nodes", 1)) if RUNS[wc.run].backend == "emulate" else 1
    log:
        f"{RESULTS}/{{run}}/logs/acquire.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/acquire.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/acquire.py"
