rule split:
    input:
        DATASET_DIR / "train.csv",
    output:
        f"results/{EXP_NAME}/split.csv",
    log:
        f"results/logs/split/{EXP_NAME}.log",
    conda:
        "../../environment.yml"
    params:
        dataset=lambda wildcards, input: Path(input[0]).parent,
        experiment=EXP_FILE,
        # Rerun when the selection changes, not on other edits of the experiment file.
        settings=settings_used(EXP, None, "split"),
    shell:
        "ctseg split {params.dataset:q} {output:q} --experiment {params.experiment:q} "
        "> {log} 2>&1"


# Only the manifest is declared: Snakemake deletes declared outputs before a rerun, and the
# staged arrays must survive so that `ctseg stage` can skip what is already there and verified.
rule stage:
    input:
        split=f"results/{EXP_NAME}/split.csv",
        # A remote source is already preprocessed; a local one is built by this workflow.
        images=local_store_inputs(IMAGE_STORE),
        targets=local_store_inputs(TARGET_STORE),
    output:
        manifest=f"{SCRATCH}/manifest.json",
    log:
        f"results/logs/stage/{EXP_NAME}.log",
    benchmark:
        f"results/benchmarks/stage/{EXP_NAME}.tsv"
    conda:
        "../../environment.yml"
    threads: 4
    params:
        source=stage_source,
        dest=lambda wildcards, output: Path(output.manifest).parent,
        fmt=EXP["scratch_format"],
    shell:
        "ctseg stage {params.source:q} {input.split:q} {params.dest:q} "
        "--format {params.fmt} --workers {threads} > {log} 2>&1"
