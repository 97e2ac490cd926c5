rule report:
    input:
        trials=trial_summaries(),
        steps=f"results/{EXP_NAME}/train/steps.csv",
        epochs=f"results/{EXP_NAME}/train/epochs.csv",
        scores=f"results/{EXP_NAME}/evaluation/scores.csv",
        summary=f"results/{EXP_NAME}/evaluation/summary.json",
        predictions=[prediction(i) for i in overlay_ids()],
        # The stores the overlays read (the paths overlay_args passes): declared, so that a
        # label store no other rule needs, such as a held-out volume's, is converted first.
        images=[IMAGE_STORE.format(id=i) for i in overlay_ids()],
        labels=[LABEL_STORE.format(id=i) for i in overlay_ids()],
        # The tuned post-processing (infer.postprocess: tuned), nothing when fixed.
        postprocess=postprocess_report_inputs(),
    output:
        report(
            "results/report.html",
            caption="../report/report.rst",
            category="Report",
        ),
    log:
        "results/logs/report.log",
    conda:
        "../../environment.yml"
    params:
        experiment=EXP_NAME,
        train_dir=lambda wildcards, input: Path(input.steps).parent,
        evaluation_dir=lambda wildcards, input: Path(input.summary).parent,
        overlays=overlay_args(),
        # Timings of every job so far; the report lists the files it read.
        benchmarks="results/benchmarks",
        postprocess=lambda wildcards, input: (
            f"--postprocess-dir {Path(input.postprocess[0]).parent}"
            if input.postprocess
            else ""
        ),
    shell:
        "ctseg report --out {output:q} --experiment {params.experiment} "
        "--phases {input.trials:q} --train-dir {params.train_dir:q} "
        "--evaluation-dir {params.evaluation_dir:q} {params.overlays} "
        "--benchmarks-dir {params.benchmarks} {params.postprocess} > {log} 2>&1"
