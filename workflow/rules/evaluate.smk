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
