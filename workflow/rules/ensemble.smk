# Combined runs: <exp>.cv (an experiment's folds) and config/ensembles/<name>.yaml. Their
# probabilities are the weighted mean of their members' (ctseg.inference.ensemble); post-processing,
# evaluation and the report then treat them exactly like an experiment.


rule tune_ensemble:
    input:
        probabilities=lambda wildcards: ensemble_tuning_inputs(wildcards.exp),
        labels=lambda wildcards: [label_file(i) for i in tune_ids(wildcards.exp)],
    output:
        weights=f"{ROOT}/{{exp}}/ensemble/weights.json",
    log:
        f"{ROOT}/logs/tune_ensemble/{{exp}}.log",
    benchmark:
        bench("{exp}", "tune_ensemble")
    wildcard_constraints:
        exp=COMBINED_RUN,
    conda:
        "../../environment.yml"
    # Volumes are scored in parallel, one process per thread, as in evaluate.
    threads: 8
    params:
        members=lambda wildcards: rule_args.ensemble_member_args(
            {
                m: [member_probability(m, i) for i in tune_ids(wildcards.exp)]
                for m in members(wildcards.exp)
            }
        ),
        step=lambda wildcards: ensemble(wildcards.exp).tune_step,
    shell:
        "ctseg tune-ensemble {params.members} --labels {input.labels:q} "
        "--step {params.step} --out {output.weights:q} --workers {threads} > {log:q} 2>&1"


rule ensemble:
    input:
        members=lambda wildcards: [
            path for path, _ in ensemble_inputs(wildcards.exp, wildcards.id)
        ],
        weights=lambda wildcards: ensemble_weights_file(wildcards.exp),
    output:
        probabilities=directory(f"{ROOT}/{{exp}}/probabilities/{{id}}.zarr"),
    log:
        f"{ROOT}/logs/ensemble/{{exp}}_{{id}}.log",
    benchmark:
        bench("{exp}", "ensemble/{id}")
    wildcard_constraints:
        exp=COMBINED_RUN,
    conda:
        "../../environment.yml"
    params:
        weights=lambda wildcards, input: rule_args.ensemble_weight_args(
            tuned_ensemble(wildcards.exp),
            input.weights,
            members(wildcards.exp),
            [w for _, w in ensemble_inputs(wildcards.exp, wildcards.id)],
        ),
        budget=config["infer"]["memory_budget_mb"],
    shell:
        "ctseg ensemble --members {input.members:q} {params.weights} "
        "--out {output.probabilities:q} --memory-budget-mb {params.budget} > {log:q} 2>&1"
