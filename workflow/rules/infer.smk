rule infer:
    input:
        weights=f"results/{EXP_NAME}/last.pt",
        image=IMAGE_STORE,
    output:
        # The model's output only: the mask comes from rule postprocess, whose settings may be
        # tuned on these probabilities (for the val split) without running the model again.
        probabilities=directory(probability("{id}")),
    log:
        f"results/logs/infer/{EXP_NAME}_{{id}}.log",
    benchmark:
        f"results/benchmarks/infer/{EXP_NAME}_{{id}}.tsv"
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
        "> {log} 2>&1"


rule postprocess:
    input:
        probabilities=probability("{id}"),
        # tuned.json for infer.postprocess: tuned; nothing for fixed.
        settings=postprocess_settings_file(),
    output:
        mask=prediction("{id}"),
    log:
        f"results/logs/postprocess/{EXP_NAME}_{{id}}.log",
    benchmark:
        f"results/benchmarks/postprocess/{EXP_NAME}_{{id}}.tsv"
    conda:
        "../../environment.yml"
    params:
        settings=postprocess_args,
    shell:
        "ctseg postprocess {input.probabilities:q} {output.mask:q} {params.settings} "
        "> {log} 2>&1"


rule predict:
    input:
        [prediction(i) for i in infer_ids()],
