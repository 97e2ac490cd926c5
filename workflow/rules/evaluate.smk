rule tune_postprocess:
    input:
        probabilities=[probability(i) for i in tune_ids()],
        labels=[RECORDS[i]["label"] for i in tune_ids()],
    output:
        settings=report(
            f"{TUNED_DIR}/tuned.json",
            caption="../report/tuned.rst",
            category="Evaluation",
        ),
        candidates=f"{TUNED_DIR}/candidates.csv",
    log:
        f"results/logs/tune_postprocess/{EXP_NAME}.log",
    benchmark:
        f"results/benchmarks/tune_postprocess/{EXP_NAME}.tsv"
    conda:
        "../../environment.yml"
    # Candidates are scored in parallel like evaluate's volumes, one process per thread.
    threads: 8
    params:
        out=lambda wildcards, output: Path(output.settings).parent,
        search=tune_args(),
    shell:
        "ctseg tune-postprocess --probabilities {input.probabilities:q} "
        "--labels {input.labels:q} --out {params.out:q} {params.search} "
        "--workers {threads} > {log} 2>&1"


rule evaluate:
    input:
        predictions=[prediction(i) for i in eval_ids()],
        labels=[RECORDS[i]["label"] for i in eval_ids()],
    output:
        scores=report(
            f"results/{EXP_NAME}/evaluation/scores.csv",
            caption="../report/scores.rst",
            category="Evaluation",
        ),
        summary=report(
            f"results/{EXP_NAME}/evaluation/summary.json",
            caption="../report/summary.rst",
            category="Evaluation",
        ),
    log:
        f"results/logs/evaluate/{EXP_NAME}.log",
    benchmark:
        f"results/benchmarks/evaluate/{EXP_NAME}.tsv"
    conda:
        "../../environment.yml"
    # Volumes are scored in parallel, one process per thread (Snakemake caps it at --cores);
    # a 320^3 volume needs about 1 GB per process.
    threads: 8
    params:
        out=lambda wildcards, output: Path(output.summary).parent,
    shell:
        "ctseg evaluate --predictions {input.predictions:q} --labels {input.labels:q} "
        "--out {params.out:q} --workers {threads} > {log} 2>&1"
