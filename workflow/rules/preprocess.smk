rule convert_image:
    input:
        image_source,
    output:
        directory(IMAGE_STORE),
    log:
        f"{ROOT}/logs/convert_image/{{id}}.log",
    benchmark:
        f"{ROOT}/benchmarks/convert_image/{{id}}.tsv"
    conda:
        "../../environment.yml"
    params:
        chunks=rule_args.shape_arg(config["convert"]["chunks"]),
        shards=rule_args.shards_arg(config["convert"]["shards"]),
        codec=rule_args.codec_arg(config["convert"]["codec"]),
        budget=config["convert"]["memory_budget_mb"],
    shell:
        "ctseg convert {input:q} {output:q} --kind image --chunks {params.chunks} "
        "{params.shards} --codec {params.codec:q} --memory-budget-mb {params.budget} "
        "> {log} 2>&1"


rule convert_label:
    input:
        label=label_source,
        image=IMAGE_STORE,
    output:
        directory(LABEL_STORE),
    log:
        f"{ROOT}/logs/convert_label/{{id}}.log",
    benchmark:
        f"{ROOT}/benchmarks/convert_label/{{id}}.tsv"
    conda:
        "../../environment.yml"
    params:
        chunks=rule_args.shape_arg(config["convert"]["chunks"]),
        shards=rule_args.shards_arg(config["convert"]["shards"]),
        codec=rule_args.codec_arg(config["convert"]["codec"]),
        budget=config["convert"]["memory_budget_mb"],
        dataset_plan=DATASET_PLAN,
        labels=lambda wildcards: dataset_plan().digest("labels"),
    shell:
        "ctseg convert {input.label:q} {output:q} --kind label --like {input.image:q} "
        "--chunks {params.chunks} {params.shards} --codec {params.codec:q} "
        "--memory-budget-mb {params.budget} --dataset-plan {params.dataset_plan:q} "
        "> {log} 2>&1"


rule targets:
    input:
        label=LABEL_STORE,
    output:
        directory(TARGET_STORE),
    log:
        f"{ROOT}/logs/targets/{{id}}.log",
    benchmark:
        f"{ROOT}/benchmarks/targets/{{id}}.tsv"
    conda:
        "../../environment.yml"
    threads: config["targets"]["workers"]
    params:
        clip=config["targets"]["clip_distance"],
        method=config["targets"]["skeleton_method"],
        tube=config["targets"]["tube_dilations"],
        block=rule_args.shape_arg(config["targets"]["block"]),
        max_samples=config["targets"]["max_samples"],
        seed=config["targets"]["seed"],
        codec=rule_args.codec_arg(config["convert"]["codec"]),
        dataset_plan=DATASET_PLAN,
        dataset=lambda wildcards: dataset_plan().digest(),
    shell:
        "ctseg targets {input.label:q} {output:q} --clip-distance {params.clip} "
        "--skeleton-method {params.method} --tube-dilations {params.tube} "
        "--block {params.block} --max-samples {params.max_samples} --seed {params.seed} "
        "--codec {params.codec:q} --workers {threads} --dataset-plan {params.dataset_plan:q} "
        "> {log} 2>&1"


rule precompute_targets:
    input:
        preprocessed_outputs(),
