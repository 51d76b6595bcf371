# Code stamps: one empty file per (stage, code hash); see code_stamp() in common.smk.

rule code_stamp:
    output:
        f"{CODE_STAMPS}/{{stage}}-{{hash}}.stamp",
    log:
        f"{CODE_STAMPS}/{{stage}}-{{hash}}.log",
    wildcard_constraints:
        stage="[a-z_]+",
        hash="[0-9a-f]{16}",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    shell:
        "touch {output} 2> {log}"
