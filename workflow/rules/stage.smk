rule split:
    input:
        DATASET_DIR / "train.csv",
    output:
        f"{ROOT}/{{exp}}/split.csv",
    log:
        f"{ROOT}/logs/split/{{exp}}.log",
    wildcard_constraints:
        exp=TRAINED_RUN,
    conda:
        "../../environment.yml"
    params:
        dataset=lambda wildcards, input: Path(input[0]).parent,
        experiment=lambda wildcards: experiment_file(wildcards.exp),
        fold=lambda wildcards: rule_args.fold_arg(fold_of(wildcards.exp)),
        # Rerun when the selection changes, not on other edits of the experiment file.
        settings=lambda wildcards: settings_used(
            run_settings(wildcards.exp), None, "split"
        ),
    shell:
        "ctseg split {params.dataset:q} {output:q} --experiment {params.experiment:q} "
        "{params.fold} > {log:q} 2>&1"


# Only the manifest is declared: Snakemake deletes declared outputs before a rerun, and the
# staged arrays must survive so that `ctseg stage` can skip what is already there and verified.
# One copy per experiment: its folds train on the same non-test records.
rule stage_records:
    input:
        split=f"{ROOT}/{{exp}}/split.csv",
        # A remote source is already preprocessed; a local one is built by this workflow.
        images=lambda wildcards: local_store_inputs(wildcards.exp, IMAGE_STORE),
        targets=lambda wildcards: local_store_inputs(wildcards.exp, TARGET_STORE),
    output:
        manifest=f"{SCRATCH_ROOT}/{{exp}}/manifest.json",
    log:
        f"{ROOT}/logs/stage/{{exp}}.log",
    benchmark:
        bench("{exp}", "stage")
    wildcard_constraints:
        exp=BASE_RUN,
    conda:
        "../../environment.yml"
    threads: 4
    params:
        source=stage_source,
        dest=lambda wildcards, output: Path(output.manifest).parent,
        fmt=lambda wildcards: experiment(wildcards.exp)["scratch_format"],
    shell:
        "ctseg stage {params.source:q} {input.split:q} {params.dest:q} "
        "--format {params.fmt} --workers {threads} > {log:q} 2>&1"


rule stage:
    input:
        [
            f"{scratch_dir(run)}/manifest.json"
            for run in sorted(
                {base_of(t) for r in DEFAULT_RUNS for t in trained_runs(r)}
            )
        ],
