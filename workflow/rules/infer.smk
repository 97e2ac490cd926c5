from ctseg.inference.inputs import input_volumes, predict_outputs
from ctseg.runs import alternatives


rule infer:
    input:
        # last.pt or best.pt (config infer.weights).
        weights=lambda wildcards: predicting_weights(wildcards.exp),
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
        # In tiles: twice the memory budget; one tile on a CPU: the device budget is host memory.
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


# New volumes: config predict.input (a folder of TIFF volumes or slice folders) predicted by
# the run predict.run (default: the first of `experiment`) with `ctseg predict`, its masks in
# <run>/predict/<folder name>/<id>.tif. The run's models, ensemble weights and tuned.json are
# inputs, so the workflow makes them first. --overwrite: the masks lie in results/, which
# Snakemake replaces when it reruns a job; a file ctseg did not write is still refused.
PREDICT_RUN = config["predict"]["run"] or DEFAULT_RUNS[0]
PREDICT_FOLDER = alternatives(
    [Path(config["predict"]["input"]).name] if config["predict"]["input"] else []
)


rule predict_folder:
    input:
        # The run is checked first: an unknown one is one line naming it.
        lambda wildcards: run_kind(PREDICT_RUN)
        and planning(predict_outputs)(config["predict"]["input"], run_dir(PREDICT_RUN)),


rule predict_volume:
    input:
        volume=lambda wildcards: planning(input_volumes)(config["predict"]["input"])[
            wildcards.id
        ],
        weights=lambda wildcards: [
            predicting_weights(r) for r in trained_runs(wildcards.exp)
        ],
        ensemble_weights=lambda wildcards: ensemble_weights_file(wildcards.exp),
        settings=lambda wildcards: postprocess_settings_file(wildcards.exp),
    output:
        mask=f"{ROOT}/{{exp}}/predict/{{folder}}/{{id}}.tif",
    log:
        f"{ROOT}/logs/predict/{{exp}}_{{folder}}_{{id}}.log",
    benchmark:
        bench("{exp}", "predict/{folder}/{id}")
    wildcard_constraints:
        exp=ANY_RUN,
        folder=PREDICT_FOLDER,
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        gpu=1,
        mem_mb=2000
        + max(
            2 * config["infer"]["memory_budget_mb"],
            config["infer"]["device_budget_mb"],
        ),
    params:
        run=lambda wildcards: run_dir(wildcards.exp),
        folder=config["predict"]["input"],
        out=lambda wildcards, output: Path(output.mask).parent,
        overlap=config["infer"]["overlap"],
        batch=config["infer"]["batch_size"],
        tta="--tta-flips" if config["infer"]["tta_flips"] else "",
        budget=config["infer"]["memory_budget_mb"],
        device_budget=config["infer"]["device_budget_mb"],
        settings=lambda wildcards, input: rule_args.postprocess_args(
            config["infer"], input.settings
        ),
        weights=config["infer"]["weights"],
    shell:
        "ctseg predict --run {params.run:q} -i {params.folder:q} --only {wildcards.id} "
        "--weights {params.weights} "
        "-o {params.out:q} --overlap {params.overlap} --batch-size {params.batch} {params.tta} "
        "--memory-budget-mb {params.budget} --device-budget-mb {params.device_budget} "
        "{params.settings} --overwrite > {log:q} 2>&1"
