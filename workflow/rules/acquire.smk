# Acquisition: produce a run's immutable raw/ directory (NCCL logs, nsys exports, launch
# record). Backend 'emulate' runs the workload emulator; the SLURM launch path (backend
# 'slurm') and imports are added by the acquisition stage.


checkpoint acquire:
    output:
        raw=directory(f"{RESULTS}/{{run}}/raw"),
    params:
        settings=run_settings,
        code=stage_code_hash("emulate"),
    log:
        f"{RESULTS}/{{run}}/logs/acquire.log",
    benchmark:
        f"{RESULTS}/{{run}}/benchmarks/acquire.tsv"
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/emulate.py"
