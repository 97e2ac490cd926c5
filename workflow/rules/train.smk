rule train_trial:
    input:
        unpack(training_data),
        split=f"{ROOT}/{{exp}}/split.csv",
        previous=previous_trial,
    output:
        summary=f"{ROOT}/{{exp}}/phases/phase{{phase}}/summary.json",
        steps=f"{ROOT}/{{exp}}/phases/phase{{phase}}/steps.csv",
    log:
        f"{ROOT}/logs/train_trial/{{exp}}_phase{{phase}}.log",
    benchmark:
        bench("{exp}", "train_trial/phase{phase}")
    wildcard_constraints:
        exp=BASE_RUN,
    conda:
        "../../environment.yml"
    threads:
        lambda wildcards: rule_args.phase_threads(
            phase_gpus(wildcards.exp, int(wildcards.phase)),
            PHASES[int(wildcards.phase)]["workers"],
        )
    resources:
        gpu=lambda wildcards: phase_gpus(wildcards.exp, int(wildcards.phase)),
        mem_mb=lambda wildcards: rule_args.phase_mem_mb(
            phase_gpus(wildcards.exp, int(wildcards.phase)),
            PHASES[int(wildcards.phase)]["workers"],
        ),
    params:
        ctseg=lambda wildcards: rule_args.launcher(
            phase_gpus(wildcards.exp, int(wildcards.phase))
        ),
        phases=PHASES_FILE,
        settings=lambda wildcards: settings_used(
            experiment(wildcards.exp), PHASES[int(wildcards.phase)], "trial"
        ),
        plan=lambda wildcards: run_plan_file(wildcards.exp),
        planned=lambda wildcards: run_plan(wildcards.exp).digest("dataset", "patch"),
        scratch=scratch_args,
        out=lambda wildcards, output: Path(output.summary).parent,
        previous=lambda wildcards, input: (
            f"--previous '{input.previous[0]}'" if input.previous else ""
        ),
        keep_log=rule_args.KEEP_ATTEMPT_LOG,
    shell:
        "{params.keep_log} {log:q} && "
        "{params.ctseg} trial --plan {params.plan:q} --phases {params.phases:q} "
        "--phase {wildcards.phase} {params.scratch} --split {input.split:q} "
        "--out {params.out:q} {params.previous} > {log:q} 2>&1"


rule trials:
    input:
        sorted(
            {
                summary
                for r in DEFAULT_RUNS
                for t in trained_runs(r)
                for summary in trial_summaries(t)
            }
        ),


rule train_model:
    input:
        unpack(training_data),
        split=f"{ROOT}/{{exp}}/split.csv",
        # Phase auto's trials when it trains; for a finished run, the trials its last training
        # waited on whatever the phase now, so that a phase change is not a changed set of
        # inputs, which Snakemake would retrain it for (common.smk, training_plan).
        trials=train_trials,
        # A fine-tune's starting weights (init_from), trained first.
        init=lambda wildcards: init_weights(wildcards.exp),
    output:
        weights=f"{ROOT}/{{exp}}/last.pt",
        # Written beside --weights: the weights of the best validation (ctseg.training.run_state).
        best=f"{ROOT}/{{exp}}/best.pt",
        steps=f"{ROOT}/{{exp}}/train/steps.csv",
        epochs=f"{ROOT}/{{exp}}/train/epochs.csv",
        settings=f"{ROOT}/{{exp}}/train/settings.json",
    log:
        f"{ROOT}/logs/train/{{exp}}.log",
    benchmark:
        bench("{exp}", "train")
    wildcard_constraints:
        exp=TRAINED_RUN,
    conda:
        "../../environment.yml"
    threads:
        lambda wildcards: max(
            rule_args.phase_threads(phase_gpus(wildcards.exp, p), PHASES[p]["workers"])
            for p in chosen_phases(wildcards.exp)
        )
    resources:
        gpu=lambda wildcards: train_gpus(wildcards.exp),
        mem_mb=lambda wildcards: max(
            rule_args.phase_mem_mb(phase_gpus(wildcards.exp, p), PHASES[p]["workers"])
            for p in chosen_phases(wildcards.exp)
        ),
    params:
        ctseg=lambda wildcards: rule_args.launcher(train_gpus(wildcards.exp)),
        phases=PHASES_FILE,
        settings=lambda wildcards: train_settings(wildcards.exp),
        plan=lambda wildcards: run_plan_file(wildcards.exp),
        planned=lambda wildcards: run_plan(wildcards.exp).digest("dataset", "patch"),
        # Not compared between runs: a phase changes how a run trains, not its result, so a
        # last.pt trained under another phase is kept (common.smk prints a line saying so).
        phase=lambda wildcards: rule_args.Untracked(train_phase(wildcards.exp)),
        # Which trials this job waits on, beside the last.pt it writes, for the next plan.
        record_trials=rule_args.RECORD_TRIALS,
        trials_record=lambda wildcards: trials_record(wildcards.exp),
        scratch=scratch_args,
        out=lambda wildcards, output: Path(output.steps).parent,
        # Resumable checkpoints live outside the declared outputs: Snakemake deletes those
        # before a rerun, and a preempted run must resume rather than start over.
        state=lambda wildcards: state_dir(wildcards.exp),
        init=lambda wildcards, input: rule_args.init_arg(input.init),
        # Every attempt's log, kept in <log>.attempts/: a stopped job is resubmitted.
        keep_log=rule_args.KEEP_ATTEMPT_LOG,
    # exec: ctseg replaces the shell, so a scheduler's SIGTERM reaches it and not a bash that
    # would die at once; it finishes the step, checkpoints and exits 75 (docs/cluster.md).
    shell:
        "{params.keep_log} {log:q} && "
        "{params.record_trials} {params.trials_record:q} {input.trials:q} && "
        "exec {params.ctseg} train --plan {params.plan:q} "
        "--phases {params.phases:q} --phase {params.phase} --trials {input.trials:q} "
        "{params.scratch} --split {input.split:q} --out {params.out:q} "
        "--state-dir {params.state:q} --weights {output.weights:q} {params.init} > {log:q} 2>&1"


rule train:
    input:
        sorted({f"{run_dir(t)}/last.pt" for r in DEFAULT_RUNS for t in trained_runs(r)}),
        sorted(
            {
                summary
                for r in DEFAULT_RUNS
                for t in trained_runs(r)
                for summary in [dataset_summary_file(t)]
                if summary
            }
        ),


# A run's volumes, from its dataset's converted stores: printed on the console as soon as they
# are converted (its priority puts it before staging and training) and kept for the report. Not
# an input of train_model: a new input would retrain every trained run.
rule dataset_summary:
    input:
        split=f"{ROOT}/{{exp}}/split.csv",
        images=lambda wildcards: expand(
            IMAGE_STORE, id=split_table(wildcards.exp)["id"]
        ),
        labels=lambda wildcards: expand(
            LABEL_STORE, id=split_table(wildcards.exp)["id"]
        ),
    output:
        f"{ROOT}/{{exp}}/dataset_summary.json",
    log:
        f"{ROOT}/logs/dataset_summary/{{exp}}.log",
    wildcard_constraints:
        exp=BASE_RUN,
    priority: 50
    # Reads a few attributes: a cluster job would cost more than the work.
    localrule: True
    conda:
        "../../environment.yml"
    params:
        store=STORE,
        patch=lambda wildcards: " ".join(map(str, run_plan(wildcards.exp).patch.size)),
        dataset_plan=DATASET_PLAN,
        dataset=lambda wildcards: dataset_plan().digest(),
    shell:
        "python -m ctseg.dataset_summary --run {wildcards.exp} --split {input.split:q} "
        "--store {params.store:q} --patch {params.patch} --dataset-plan {params.dataset_plan:q} "
        "--out {output:q} 2>&1 | tee {log:q}"


# Before any job runs (not in a dry run): the plans the steps read (plan.smk), then for each
# training this invocation runs, the line of a last.pt retrained under another phase (its
# finished checkpoints set aside), its estimated time on this machine, and the volumes smaller
# than its patch.
onstart:
    write_plans()
    for _run in trainings_to_run():
        for _line in training_start(_run, settings=run_plan(_run).experiment):
            print(f"ctseg: {_line}", file=sys.stderr)
