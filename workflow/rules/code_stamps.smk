# Code stamps (see common.smk): a stage's stamp is written by this job, when it runs, before the
# stage's jobs that read it, and so is newer than every output made before; it runs when the stamp
# does not hold the stage's code hash now (_stamp_out_of_date), and never on reading the workflow.


rule code_stamp:
    localrule: True
    input:
        _stamp_out_of_date,
    output:
        f"{CODE_STAMPS}/{{stage}}.stamp",
    params:
        code=lambda wc: STAMPED_CODE[wc.stage],
    wildcard_constraints:
        stage="[A-Za-z0-9_]+",
    log:
        f"{CODE_STAMPS}/logs/{{stage}}.log",
    conda:
        "../../envs/analysis.yaml"
    shell:
        "printf '%s\\n' {params.code} > {output:q} 2> {log:q}"
