rule report:
    input:
        runs=[path for run in DEFAULT_RUNS for path in report_inputs(run)],
        # The stores the overlays read (the paths overlay_args passes): declared, so that a
        # label store no other rule needs, such as a held-out volume's, is converted first.
        images=[IMAGE_STORE.format(id=i) for i in overlay_ids()],
        labels=[LABEL_STORE.format(id=i) for i in overlay_ids()],
    output:
        report(
            f"{ROOT}/report.html",
            caption="../report/report.rst",
            category="Report",
        ),
    log:
        f"{ROOT}/logs/report.log",
    conda:
        "../../environment.yml"
    params:
        # This invocation's runs and those of earlier ones (report_runs): a change in the list
        # reruns the report.
        runs=" ".join(f"--run '{run_dir(run)}'" for run in report_runs()),
        overlays=rule_args.overlay_args(overlay_ids(), IMAGE_STORE, LABEL_STORE),
        # Timings of every job so far; the report lists the files it read.
        benchmarks=f"{ROOT}/benchmarks",
        dataset_plan=DATASET_PLAN,
        labels=dataset_plan().digest("labels"),
    shell:
        "ctseg report --out {output:q} {params.runs} {params.overlays} "
        "--benchmarks-dir {params.benchmarks:q} --dataset-plan {params.dataset_plan:q} "
        "> {log:q} 2>&1"
