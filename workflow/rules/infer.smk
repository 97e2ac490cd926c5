rule infer:
    input:
        weights=f"{ROOT}/{{exp}}/last.pt",
        image=IMAGE_STORE,
    output:
        # The model's output only: the mask comes from rule postprocess, whose settings may be
        # tuned on these probabilities (for the val split) without running the model again.
        probabilities=directory(f"{ROOT}/{{exp}}/probabilities/{{id}}.zarr"),
    log:
        f"{ROOT}/logs/infer/{{exp}}_{{id}}.log",
    benchmark:
        bench("{exp}", "infer/{id}")
    wildcard_constraints:
        exp=TRAINED_RUN,
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        gpu=1,
        # Streamed: twice the slab budget; resident on a CPU: the device budget is host memory.
        mem_mb=lambda wildcards: 2000
        + max(
            2 * config["infer"]["memory_budget_mb"],
            config["infer"]["device_budget_mb"],
        ),
    params:
        overlap=config["infer"]["overlap"],
        batch=config["infer"]["batch_size"],
        tta="--tta-flips" if config["infer"]["tta_flips"] else "",
        budget=config["infer"]["memory_budget_mb"],
        device_budget=config["infer"]["device_budget_mb"],
    shell:
        "ctseg infer {input.weights:q} {input.image:q} "
        "--probabilities {output.probabilities:q} --overlap {params.overlap} "
        "--batch-size {params.batch} {params.tta} "
        "--memory-budget-mb {params.budget} --device-budget-mb {params.device_budget} "
        "> {log:q} 2>&1"


rule postprocess:
    input:
        probabilities=f"{ROOT}/{{exp}}/probabilities/{{id}}.zarr",
        # tuned.json for infer.postprocess: tuned; nothing for fixed.
        settings=lambda wildcards: postprocess_settings_file(wildcards.exp),
    output:
        mask=f"{ROOT}/{{exp}}/predictions/{{id}}.tif",
    log:
        f"{ROOT}/logs/postprocess/{{exp}}_{{id}}.log",
    benchmark:
        bench("{exp}", "postprocess/{id}")
    wildcard_constraints:
        exp=ANY_RUN,
    conda:
        "../../environment.yml"
    params:
        settings=lambda wildcards, input: rule_args.postprocess_args(
            config["infer"], input.settings
        ),
    shell:
        "ctseg postprocess {input.probabilities:q} {output.mask:q} {params.settings} "
        "> {log:q} 2>&1"


rule predict:
    input:
        sorted({prediction(r, i) for r in DEFAULT_RUNS for i in infer_ids(r)}),
