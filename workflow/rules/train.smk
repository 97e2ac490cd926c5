rule train_trial:
    input:
        unpack(training_data),
        split=f"results/{EXP_NAME}/split.csv",
        previous=previous_trial,
    output:
        summary=f"results/{EXP_NAME}/phases/phase{{phase}}/summary.json",
        steps=f"results/{EXP_NAME}/phases/phase{{phase}}/steps.csv",
    log:
        f"results/logs/train_trial/{EXP_NAME}_phase{{phase}}.log",
    benchmark:
        f"results/benchmarks/train_trial/{EXP_NAME}_phase{{phase}}.tsv"
    conda:
        "../../environment.yml"
    threads: lambda wildcards: phase_threads(int(wildcards.phase))
    resources:
        gpu=lambda wildcards: phase_gpus(int(wildcards.phase)),
        mem_mb=lambda wildcards: phase_mem_mb(int(wildcards.phase)),
    params:
        ctseg=lambda wildcards: launcher(phase_gpus(int(wildcards.phase))),
        experiment=EXP_FILE,
        phases=PHASES_FILE,
        settings=lambda wildcards: settings_used(
            EXP, PHASES[int(wildcards.phase)], "trial"
        ),
        scratch=scratch_args,
        out=lambda wildcards, output: Path(output.summary).parent,
        previous=lambda wildcards, input: (
            f"--previous {input.previous[0]}" if input.previous else ""
        ),
    shell:
        "{params.ctseg} trial --experiment {params.experiment:q} --phases {params.phases:q} "
        "--phase {wildcards.phase} {params.scratch} --split {input.split:q} "
        "--out {params.out:q} {params.previous} > {log} 2>&1"


rule trials:
    input:
        trial_summaries(),


rule train:
    input:
        unpack(training_data),
        split=f"results/{EXP_NAME}/split.csv",
        trials=trial_summaries() if config["phase"] == "auto" else [],
    output:
        weights=f"results/{EXP_NAME}/last.pt",
        steps=f"results/{EXP_NAME}/train/steps.csv",
        epochs=f"results/{EXP_NAME}/train/epochs.csv",
    log:
        f"results/logs/train/{EXP_NAME}.log",
    benchmark:
        f"results/benchmarks/train/{EXP_NAME}.tsv"
    conda:
        "../../environment.yml"
    threads: train_threads()
    resources:
        gpu=train_gpus(),
        mem_mb=train_mem_mb(),
    params:
        ctseg=launcher(train_gpus()),
        experiment=EXP_FILE,
        phases=PHASES_FILE,
        settings=train_settings(),
        phase=config["phase"],
        scratch=scratch_args,
        out=lambda wildcards, output: Path(output.steps).parent,
        # Resumable checkpoints live outside the declared outputs: Snakemake deletes those
        # before a rerun, and a preempted run must resume rather than start over.
        state=f"results/{EXP_NAME}/checkpoints",
    shell:
        "{params.ctseg} train --experiment {params.experiment:q} --phases {params.phases:q} "
        "--phase {params.phase} --trials {input.trials:q} {params.scratch} "
        "--split {input.split:q} --out {params.out:q} "
        "--state-dir {params.state} --weights {output.weights:q} > {log} 2>&1"
