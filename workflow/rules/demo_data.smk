rule demo_data:
    output:
        train_csv="resources/demo/train.csv",
        test_csv="resources/demo/test.csv",
        images=[row["image"] for row in DEMO_RECORDS.values()],
        labels=[row["label"] for row in DEMO_RECORDS.values()],
    log:
        f"{ROOT}/logs/demo_data.log",
    conda:
        "../../environment.yml"
    params:
        shape=rule_args.shape_arg(config["demo"]["shape"]),
        scroll_ids=" ".join(str(s) for s in config["demo"]["scroll_ids"]),
        n_train=config["demo"]["n_train"],
        n_test=config["demo"]["n_test"],
        seed=config["demo"]["seed"],
        preset=config["demo"]["preset"],
    shell:
        "ctseg demo-data --out resources/demo --n-train {params.n_train} "
        "--n-test {params.n_test} --shape {params.shape} "
        "--scroll-ids {params.scroll_ids} --seed {params.seed} --preset {params.preset} "
        "> {log} 2>&1"
