rule infer:
    input:
        weights=f"results/{EXP_NAME}/last.pt",
        image=IMAGE_STORE,
    output:
        mask=f"results/{EXP_NAME}/predictions/{{id}}.tif",
        probabilities=directory(f"results/{EXP_NAME}/probabilities/{{id}}.zarr"),
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
        threshold=config["infer"]["threshold"],
        min_size=config["infer"]["min_component_voxels"],
        fill="--fill-holes" if config["infer"]["fill_holes"] else "",
        budget=config["infer"]["memory_budget_mb"],
        device_budget=config["infer"]["device_budget_mb"],
    shell:
        "ctseg infer {input.weights:q} {input.image:q} --mask {output.mask:q} "
        "--probabilities {output.probabilities:q} --overlap {params.overlap} "
        "--batch-size {params.batch} {params.tta} --threshold {params.threshold} "
        "--min-component-voxels {params.min_size} {params.fill} "
        "--memory-budget-mb {params.budget} --device-budget-mb {params.device_budget} "
        "> {log} 2>&1"


rule predict:
    input:
        [prediction(i) for i in infer_ids()],
