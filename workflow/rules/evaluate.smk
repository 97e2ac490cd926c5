# A checkpoint: a scroll's post-processing jobs are the rounds tuned.json's settings need.
checkpoint tune_postprocess:
    input:
        probabilities=lambda wildcards: [
            tune_probability(wildcards.exp, i) for i in tune_ids(wildcards.exp)
        ],
        labels=lambda wildcards: tune_labels(wildcards.exp),
    output:
        settings=report(
            f"{ROOT}/{{exp}}/postprocess/tuned.json",
            caption="../report/tuned.rst",
            category="Evaluation",
            subcategory="{exp}",
        ),
        candidates=f"{ROOT}/{{exp}}/postprocess/candidates.csv",
    log:
        f"{ROOT}/logs/tune_postprocess/{{exp}}.log",
    benchmark:
        bench("{exp}", "tune_postprocess")
    wildcard_constraints:
        exp=ANY_RUN,
    conda:
        "../../environment.yml"
    # Volumes are scored in parallel as in evaluate, each candidate's masks in turn.
    threads: 8
    resources:
        mem_mb=lambda wildcards, threads: rule_args.scoring_mem_mb(
            threads, len(tune_ids(wildcards.exp))
        ),
    params:
        out=lambda wildcards, output: Path(output.settings).parent,
        search=rule_args.tune_args(config["infer"]["tune"]),
    shell:
        "ctseg tune-postprocess --probabilities {input.probabilities:q} "
        "--labels {input.labels:q} --out {params.out:q} {params.search} "
        "--workers {threads} > {log:q} 2>&1"


rule evaluate_run:
    input:
        predictions=lambda wildcards: [
            prediction(wildcards.exp, i) for i in eval_ids(wildcards.exp)
        ],
        labels=lambda wildcards: evaluation_labels(wildcards.exp),
    output:
        scores=report(
            f"{ROOT}/{{exp}}/evaluation/scores.csv",
            caption="../report/scores.rst",
            category="Evaluation",
            subcategory="{exp}",
        ),
        summary=report(
            f"{ROOT}/{{exp}}/evaluation/summary.json",
            caption="../report/summary.rst",
            category="Evaluation",
            subcategory="{exp}",
        ),
    log:
        f"{ROOT}/logs/evaluate/{{exp}}.log",
    benchmark:
        bench("{exp}", "evaluate")
    wildcard_constraints:
        exp=ANY_RUN,
    conda:
        "../../environment.yml"
    # Volumes are scored in parallel, one process per volume up to the threads (Snakemake caps
    # them at --cores), the cores left over as threads inside each; a 320^3 volume needs about
    # 2 GB per process (ctseg.evaluation.metrics.WORKER_MEMORY_GB).
    threads: 8
    resources:
        mem_mb=lambda wildcards, threads: rule_args.scoring_mem_mb(
            threads, len(eval_ids(wildcards.exp))
        ),
    params:
        out=lambda wildcards, output: Path(output.summary).parent,
        provenance=lambda wildcards: rule_args.provenance_args(
            provenance(wildcards.exp, config["infer"]["postprocess"])
        ),
        dataset_plan=DATASET_PLAN,
        dataset=lambda wildcards: dataset_plan().digest(),
    shell:
        "ctseg evaluate --predictions {input.predictions:q} --labels {input.labels:q} "
        "--out {params.out:q} --workers {threads} {params.provenance} "
        "--dataset-plan {params.dataset_plan:q} > {log:q} 2>&1"


# A reference score beside each run's (ctseg.evaluation.baseline): the image above a threshold
# tuned on the run's tuning volumes, scored on its scored volumes by the same metric.
rule baseline:
    input:
        tune_images=lambda wildcards: [
            IMAGE_STORE.format(id=i) for i in tune_ids(wildcards.exp)
        ],
        tune_labels=lambda wildcards: [label_file(i) for i in tune_ids(wildcards.exp)],
        images=lambda wildcards: [
            IMAGE_STORE.format(id=i) for i in eval_ids(wildcards.exp)
        ],
        labels=lambda wildcards: [label_file(i) for i in eval_ids(wildcards.exp)],
    output:
        scores=f"{ROOT}/{{exp}}/baseline/scores.csv",
        summary=f"{ROOT}/{{exp}}/baseline/summary.json",
    log:
        f"{ROOT}/logs/baseline/{{exp}}.log",
    benchmark:
        bench("{exp}", "baseline")
    wildcard_constraints:
        exp=ANY_RUN,
    conda:
        "../../environment.yml"
    threads: 2
    params:
        out=lambda wildcards, output: Path(output.summary).parent,
    shell:
        "ctseg baseline --tune-images {input.tune_images:q} --tune-labels {input.tune_labels:q} "
        "--images {input.images:q} --labels {input.labels:q} --out {params.out:q} "
        "--threads {threads} > {log:q} 2>&1"


rule evaluate:
    input:
        [f"{run_dir(run)}/evaluation/summary.json" for run in DEFAULT_RUNS],
