# A whole scroll: config scroll.volume (a Zarr array or OME-Zarr group; a path, s3:// or
# https://), read in place by `ctseg predict` with the run scroll.run (default: the first of
# `experiment`; an experiment, a fold, a cross-validation <exp>.cv or an ensemble: every model of
# it in each part), its intensity histogram counted in scroll.parts statistics jobs (no GPU, no
# model: they may run while the run trains) that the first part merges, then split into
# scroll.parts jobs of one GPU each, then post-processed in rounds of scroll.parts z-range jobs
# (and a merge after each component round; no GPU), then finished into one OME-Zarr mask,
# results/<run>/scroll/<name>.zarr (no GPU). The parts keep their tiles in the work folder beside it,
# results/<run>/scroll/.<name>.zarr.predict/, which no rule declares: Snakemake never deletes it,
# so a killed or failed part, run again, goes on from the tiles it finished; the finish removes
# it. Every rule passes --overwrite: the mask lies in results/, which Snakemake replaces when it
# reruns a job; a path ctseg did not write is still refused.
import re
import shlex

SCROLL = config["scroll"]
SCROLL_RUN = SCROLL["run"] or DEFAULT_RUNS[0]
# The mask's name: scroll.name, else the volume's last path element without .zarr.
SCROLL_NAME = SCROLL["name"] or Path(SCROLL["volume"] or "").name.removesuffix(".zarr")
# Every part and the finish get the same options: a part resumed with others is refused.
SCROLL_OPTIONS = " ".join(
    f"--{key.replace('_', '-')} {shlex.quote(str(SCROLL[key]))}"
    for key in ("level", "background", "cache_mb")
    if SCROLL[key] is not None
)
SCROLL_BUDGET = SCROLL["memory_budget_mb"] or config["infer"]["memory_budget_mb"]
SCROLL_MASK = f"{ROOT}/{{exp}}/scroll/{{name}}.zarr"
SCROLL_VOLUME_INPUT = (
    SCROLL["volume"] if SCROLL["volume"] and "://" not in SCROLL["volume"] else []
)
if SCROLL["volume"] and not re.fullmatch(ID_REGEX, SCROLL_NAME):
    refuse(
        f"config scroll.name: the volume's name {SCROLL_NAME!r} is no file name; set "
        "scroll.name (letters, digits, _ . -)"
    )


rule scroll:
    input:
        # One line naming the key for a volume not set; an unknown run is named by run_kind.
        lambda wildcards: (
            SCROLL["volume"]
            or refuse(
                "config scroll.volume: not set: name the Zarr array or OME-Zarr group to "
                "predict, e.g. --config 'scroll={volume: s3://bucket/scroll1.zarr, parts: 4}'"
            )
        )
        and run_kind(SCROLL_RUN)
        and SCROLL_MASK.format(exp=SCROLL_RUN, name=SCROLL_NAME),


rule scroll_statistics:
    input:
        # A local volume (a URL is read where it is).
        volume=SCROLL_VOLUME_INPUT,
    output:
        # The job's figures; its histogram is kept in the work folder for the parts to merge.
        summary=f"{ROOT}/{{exp}}/scroll/{{name}}/statistics-{{k}}-of-{{n}}.json",
    log:
        f"{ROOT}/logs/scroll/{{exp}}_{{name}}_statistics-{{k}}-of-{{n}}.log",
    benchmark:
        bench("{exp}", "scroll/{name}/statistics-{k}-of-{n}")
    wildcard_constraints:
        exp=ANY_RUN,
        name=re.escape(SCROLL_NAME) if SCROLL["volume"] else "(?!)",
        k=r"\d+",
        n=r"\d+",
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        # No GPU and no model: it reads its z-range under the memory budget.
        mem_mb=int(1000 + SCROLL_BUDGET),
    params:
        run=lambda wildcards: run_dir(wildcards.exp),
        volume=SCROLL["volume"],
        mask=lambda wildcards: SCROLL_MASK.format(**wildcards),
        options=SCROLL_OPTIONS,
        budget=SCROLL_BUDGET,
    shell:
        "ctseg predict --run {params.run:q} -i {params.volume:q} -o {params.mask:q} "
        "--parts {wildcards.n} --statistics {wildcards.k} --summary {output.summary:q} "
        "{params.options} --memory-budget-mb {params.budget} --overwrite > {log:q} 2>&1"


rule scroll_part:
    input:
        # The volume's intensity histogram in pieces, one job each, merged by the first part.
        statistics=lambda wildcards: [
            f"{ROOT}/{wildcards.exp}/scroll/{wildcards.name}/statistics-{k}-of-{wildcards.n}.json"
            for k in range(int(wildcards.n))
        ],
        # Each model's last.pt or best.pt (config infer.weights), an ensemble's tuned weights.
        weights=lambda wildcards: [
            predicting_weights(r) for r in trained_runs(wildcards.exp)
        ],
        ensemble_weights=lambda wildcards: ensemble_weights_file(wildcards.exp),
        # tuned.json for infer.postprocess: tuned: a part checks the post-processing the
        # finish applies, before its GPU hours.
        settings=lambda wildcards: postprocess_settings_file(wildcards.exp),
        # A local volume (a URL is read where it is).
        volume=SCROLL_VOLUME_INPUT,
    output:
        # The part's figures (tiles computed and resumed, read amplification, seconds).
        summary=f"{ROOT}/{{exp}}/scroll/{{name}}/part-{{k}}-of-{{n}}.json",
    log:
        f"{ROOT}/logs/scroll/{{exp}}_{{name}}_part-{{k}}-of-{{n}}.log",
    benchmark:
        bench("{exp}", "scroll/{name}/part-{k}-of-{n}")
    wildcard_constraints:
        exp=ANY_RUN,
        name=re.escape(SCROLL_NAME) if SCROLL["volume"] else "(?!)",
        k=r"\d+",
        n=r"\d+",
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        gpu=1,
        # The tiles and the chunk cache stay within the budget, beside the loaded model.
        mem_mb=int(2000 + SCROLL_BUDGET),
    params:
        run=lambda wildcards: run_dir(wildcards.exp),
        volume=SCROLL["volume"],
        # The finished mask: the work folder is beside it (ctseg.inference.scroll).
        mask=lambda wildcards: SCROLL_MASK.format(**wildcards),
        options=SCROLL_OPTIONS,
        overlap=config["infer"]["overlap"],
        batch=config["infer"]["batch_size"],
        tta="--tta-flips" if config["infer"]["tta_flips"] else "",
        budget=SCROLL_BUDGET,
        device_budget=config["infer"]["device_budget_mb"],
        settings=lambda wildcards, input: rule_args.postprocess_args(
            config["infer"], input.settings
        ),
        weights=config["infer"]["weights"],
        # Every attempt's log, kept in <log>.attempts/: a killed part is run again.
        keep_log=rule_args.KEEP_ATTEMPT_LOG,
    # exec: a scheduler's signal reaches ctseg, not a shell.
    shell:
        "{params.keep_log} {log:q} && "
        "exec ctseg predict --run {params.run:q} -i {params.volume:q} -o {params.mask:q} "
        "--parts {wildcards.n} --part {wildcards.k} --summary {output.summary:q} "
        "--weights {params.weights} {params.options} --overlap {params.overlap} "
        "--batch-size {params.batch} {params.tta} --memory-budget-mb {params.budget} "
        "--device-budget-mb {params.device_budget} {params.settings} --overwrite > {log:q} 2>&1"


rule scroll_post:
    input:
        # The round before (its merge, or its every range), or every part before the first.
        waits_on=scroll_post_waits_on,
        weights=lambda wildcards: [
            predicting_weights(r) for r in trained_runs(wildcards.exp)
        ],
        ensemble_weights=lambda wildcards: ensemble_weights_file(wildcards.exp),
        settings=lambda wildcards: postprocess_settings_file(wildcards.exp),
    output:
        # The job's figures; its results are in the work folder.
        summary=f"{ROOT}/{{exp}}/scroll/{{name}}/post-{{round}}-{{which}}-of-{{n}}.json",
    log:
        f"{ROOT}/logs/scroll/{{exp}}_{{name}}_post-{{round}}-{{which}}-of-{{n}}.log",
    benchmark:
        bench("{exp}", "scroll/{name}/post-{round}-{which}-of-{n}")
    wildcard_constraints:
        exp=ANY_RUN,
        name=re.escape(SCROLL_NAME) if SCROLL["volume"] else "(?!)",
        round=r"[a-z]+",
        which=r"\d+|merge",
        n=r"\d+",
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        # No GPU: the post-processing of one z-range (or a merge of small tables).
        mem_mb=int(2000 + SCROLL_BUDGET),
    params:
        run=lambda wildcards: run_dir(wildcards.exp),
        volume=SCROLL["volume"],
        mask=lambda wildcards: SCROLL_MASK.format(**wildcards),
        # A range job names its range; a merge none.
        part=lambda wildcards: (
            "" if wildcards.which == "merge" else f"--part {wildcards.which}"
        ),
        options=SCROLL_OPTIONS,
        overlap=config["infer"]["overlap"],
        batch=config["infer"]["batch_size"],
        tta="--tta-flips" if config["infer"]["tta_flips"] else "",
        budget=SCROLL_BUDGET,
        device_budget=config["infer"]["device_budget_mb"],
        settings=lambda wildcards, input: rule_args.postprocess_args(
            config["infer"], input.settings
        ),
        weights=config["infer"]["weights"],
    shell:
        "ctseg predict --run {params.run:q} -i {params.volume:q} -o {params.mask:q} "
        "--parts {wildcards.n} --post {wildcards.round} {params.part} "
        "--summary {output.summary:q} --weights {params.weights} {params.options} "
        "--overlap {params.overlap} --batch-size {params.batch} {params.tta} "
        "--memory-budget-mb {params.budget} --device-budget-mb {params.device_budget} "
        "{params.settings} --overwrite > {log:q} 2>&1"


rule scroll_finish:
    input:
        # The last post-processing round's every range (or every part, for a label map).
        waits_on=scroll_post_waits_on,
        weights=lambda wildcards: [
            predicting_weights(r) for r in trained_runs(wildcards.exp)
        ],
        ensemble_weights=lambda wildcards: ensemble_weights_file(wildcards.exp),
        settings=lambda wildcards: postprocess_settings_file(wildcards.exp),
    output:
        # An OME-Zarr image with a pyramid (ctseg.ome_zarr).
        mask=directory(SCROLL_MASK),
        summary=f"{ROOT}/{{exp}}/scroll/{{name}}/summary.json",
    log:
        f"{ROOT}/logs/scroll/{{exp}}_{{name}}_finish.log",
    benchmark:
        bench("{exp}", "scroll/{name}/finish")
    wildcard_constraints:
        exp=ANY_RUN,
        name=re.escape(SCROLL_NAME) if SCROLL["volume"] else "(?!)",
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        # No GPU: it computes no tile (the work folder records the parts' device).
        mem_mb=int(2000 + SCROLL_BUDGET),
    params:
        run=lambda wildcards: run_dir(wildcards.exp),
        volume=SCROLL["volume"],
        parts=SCROLL["parts"],
        options=SCROLL_OPTIONS,
        overlap=config["infer"]["overlap"],
        batch=config["infer"]["batch_size"],
        tta="--tta-flips" if config["infer"]["tta_flips"] else "",
        budget=SCROLL_BUDGET,
        device_budget=config["infer"]["device_budget_mb"],
        settings=lambda wildcards, input: rule_args.postprocess_args(
            config["infer"], input.settings
        ),
        weights=config["infer"]["weights"],
    shell:
        "ctseg predict --run {params.run:q} -i {params.volume:q} -o {output.mask:q} "
        "--parts {params.parts} --finish --summary {output.summary:q} "
        "--weights {params.weights} {params.options} --overlap {params.overlap} "
        "--batch-size {params.batch} {params.tta} --memory-budget-mb {params.budget} "
        "--device-budget-mb {params.device_budget} {params.settings} --overwrite > {log:q} 2>&1"
