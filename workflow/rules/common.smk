# The workflow's view of the dataset and its runs. The run model is ctseg.runs, built from the
# config by ctseg.planned_runs (both unit-tested without Snakemake); this file hands its answers
# to the rules, a refusal as one line naming the file (`planning`, ctseg.workflow_checks).
import functools
import sys
import time
from pathlib import Path

from ctseg import layout, planned_runs, rule_args
from ctseg.config import check_configured_phase, load_phases, settings_used
from ctseg.network.terms import check_terms
from ctseg.planned_runs import TrainingPlans, dataset_runs, default_runs, load_records
from ctseg.postprocess.commands import configured_rounds
from ctseg.preprocess.demo_data import demo_dataset
from ctseg.preprocess.stage import expand_scratch
from ctseg.report.runs import scored_runs
from ctseg.runs import base_of, cv_base, fold_of
from ctseg.training.restart import restart_line
from ctseg.training.start import start_lines
from ctseg.workflow_checks import configured_scratch

ID_REGEX = "[A-Za-z0-9_.-]+"
DATASET_DIR = Path("resources") / config["dataset"]
IS_DEMO = config["dataset"] == layout.DEMO_DATASET
# The dataset's runs, logs, job timings and report (results/ for the demo, else
# results/<dataset>/) and its preprocessed stores (zarr/images|labels/<id>.zarr, targets/<id>.zarr
# under a root of their own, the layout `ctseg stage` reads from any source): ctseg.layout.
ROOT = layout.results_root(config["dataset"])
STORE = layout.store_root(config["dataset"])
IMAGE_STORE = layout.image_store(STORE, "{id}")
LABEL_STORE = layout.label_store(STORE, "{id}")
TARGET_STORE = layout.target_store(STORE, "{id}")
# EXPERIMENTS_DIR, ENSEMBLES_DIR and PHASES_FILE are ctseg.config's (imported in settings.smk).
STARTED = time.time()
_scratch = configured_scratch(config, workflow.config_settings, expand_scratch)
SCRATCH_ROOT = layout.scratch_root(_scratch, config["dataset"])
DEMO_RECORDS = demo_dataset("resources/demo", config["demo"])
_demo = DEMO_RECORDS if IS_DEMO else None
RECORDS = planning(load_records)(config["dataset"], DATASET_DIR, _demo)
PHASES = planning(load_phases)(PHASES_FILE)
# An unregistered loss term is refused here, at planning, naming the experiment's file.
RUNS = planning(dataset_runs)(RECORDS, config["dataset"], PHASES, check_terms)

# The run model's answers, as the rules and input functions use them.
ids = RUNS.ids
experiment = planning(RUNS.experiment)
experiment_file = RUNS.experiment_file
run_settings = planning(RUNS.settings)
run_kind = planning(RUNS.kind)
members = planning(RUNS.members)
ensemble = planning(RUNS.ensemble)
ensemble_inputs = planning(RUNS.ensemble_inputs)
tuned_ensemble = planning(RUNS.tuned_ensemble)
trained_runs = planning(RUNS.trained_runs)
tune_ids = planning(RUNS.tune_ids)
tune_probability = planning(RUNS.tune_probability)
member_probability = planning(RUNS.member_probability)
eval_ids = planning(RUNS.eval_ids)
infer_ids = planning(RUNS.infer_ids)
provenance = planning(RUNS.provenance)
split_table = planning(RUNS.split_table)
phase_gpus = planning(RUNS.phase_gpus)
init_weights = planning(RUNS.init_weights)
trial_summaries = planning(RUNS.trial_summaries)
run_dir = functools.partial(layout.run_dir, root=ROOT)
prediction = functools.partial(layout.prediction, root=ROOT)
# What the plan does with each trained run's train job, read from its run folder (train.smk),
# and the lines printed before a training this invocation runs (onstart).
TRAINING_PLANS = TrainingPlans(RUNS, config["phase"], run_dir)
training_plan = planning(TRAINING_PLANS.plan)
train_phase = planning(TRAINING_PLANS.phase)
chosen_phases = planning(TRAINING_PLANS.chosen_phases)
train_gpus = planning(TRAINING_PLANS.gpus)
train_settings = planning(TRAINING_PLANS.settings)
trials_record = TRAINING_PLANS.trials_record
state_dir = TRAINING_PLANS.state_dir
training_start = functools.partial(
    TRAINING_PLANS.start_lines, start=start_lines, image_store=IMAGE_STORE
)

# Wildcard constraints: which runs each kind of rule can make (so that two rules never
# claim the same results/<run>/... path).
RUN_PATTERNS = RUNS.constraints()
BASE_RUN = RUN_PATTERNS["base"]
TRAINED_RUN = RUN_PATTERNS["trained"]
COMBINED_RUN = RUN_PATTERNS["combined"]
ANY_RUN = RUN_PATTERNS["any"]


wildcard_constraints:
    id=ID_REGEX,
    phase=r"\d+",


# Checked when the workflow loads, whatever the target (ctseg.planned_runs): the configured
# phase, the default runs and every run file (what the plan does with each default training is
# said once the run plans are known, in plan.smk).
planning(check_configured_phase)(config["phase"], PHASES)
DEFAULT_RUNS = planning(default_runs)(config["experiment"], RUNS)
planning(planned_runs.check_default_runs)(RUNS, DEFAULT_RUNS)


# ----------------------------------------------------------------------------- input functions
def image_source(wildcards):
    return RECORDS[wildcards.id]["image"]


def label_source(wildcards):
    label = RECORDS[wildcards.id]["label"]
    if not label:
        refuse(f"{DATASET_DIR}: record {wildcards.id!r} has no label volume")
    return label


def label_file(record_id):
    return RECORDS[record_id]["label"]


def bench(run, name):
    """A job's timings, under its run: the report sums them per run."""
    return f"{run_dir(run)}/benchmarks/{name}.tsv"


def train_trials(wildcards):
    """The trials the train job waits on: phase auto's when it trains, or those the job that
    wrote its last.pt waited on (training_plan)."""
    return trial_summaries(wildcards.exp) if training_plan(wildcards.exp).trials else []


def previous_trial(wildcards):
    return planning(RUNS.previous_trial)(wildcards.exp, int(wildcards.phase))


def local_store_inputs(exp_name, pattern):
    """The experiment's non-test records in this workflow's store (none for a remote source)."""
    if experiment(exp_name)["source"] is not None:
        return []
    table = split_table(exp_name)
    return expand(pattern, id=table.loc[table["split"] != "test", "id"])


def stage_source(wildcards):
    """Where stage reads the preprocessed store: the experiment's source, or results/."""
    return experiment(base_of(wildcards.exp))["source"] or STORE


def scratch_dir(run):
    """A run's staged copy: its experiment's (folds draw on the same non-test records)."""
    return f"{SCRATCH_ROOT}/{base_of(run)}"


def preprocessed_outputs():
    return (
        expand(IMAGE_STORE, id=ids())
        + expand(LABEL_STORE, id=ids(labelled=True))
        + expand(TARGET_STORE, id=ids(split="train"))
    )


def scratch_args(wildcards, input):
    """The training rules' --scratch (and --stage-from for stage: per_job)."""
    base = base_of(wildcards.exp)
    return rule_args.scratch_args(
        config["stage"],
        manifest_dir=(
            None if config["stage"] == "per_job" else Path(input.manifest).parent
        ),
        node_scratch=layout.scratch_root(config["node_scratch"], config["dataset"]),
        experiment=base,
        source=experiment(base)["source"] or STORE,
    )


def training_data(wildcards):
    """What a training job reads: the staged scratch copy, or (per_job) the store it stages."""
    base = base_of(wildcards.exp)
    if config["stage"] == "per_job":
        return {
            "images": local_store_inputs(base, IMAGE_STORE),
            "targets": local_store_inputs(base, TARGET_STORE),
        }
    return {"manifest": f"{scratch_dir(wildcards.exp)}/manifest.json"}


def ensemble_weights_file(run):
    return f"{run_dir(run)}/ensemble/weights.json" if tuned_ensemble(run) else []


def ensemble_tuning_inputs(run):
    """Each member's held-out probabilities, member by member, in tune_ids order."""
    return [member_probability(m, i) for m in members(run) for i in tune_ids(run)]


def tuned_dir(run):
    """Where rule tune_postprocess writes tuned.json (the chosen settings) and candidates.csv."""
    return f"{run_dir(run)}/postprocess"


def predicting_weights(run):
    """The weights file of a trained run that its predictions come from (config infer.weights):
    last.pt, the end of its training, or best.pt, its best validation: train_model writes
    both."""
    return f"{run_dir(run)}/{config['infer']['weights']}.pt"


def postprocess_settings_file(run):
    """tuned.json when infer.postprocess is tuned (a mask then waits for the search; a
    multi-class dataset's holds each class's settings), else nothing: the fixed values in
    config infer are passed as arguments."""
    if config["infer"]["postprocess"] != "tuned":
        return []
    planning(RUNS.check_tunable)(run)
    return f"{tuned_dir(run)}/tuned.json"


def scroll_post_waits_on(wildcards):
    """What a scroll_post job, or the finish, waits on (rounds: a checkpoint's tuned.json)."""
    binary, exp, infer = dataset_plan().labels.is_binary, wildcards.exp, config["infer"]
    tuned = binary and infer["postprocess"] == "tuned"
    got = checkpoints.tune_postprocess.get(exp=exp).output.settings if tuned else None
    scroll = f"{ROOT}/{exp}/scroll/{wildcards.name}"
    rounds = configured_rounds(infer, got, binary)
    return rule_args.post_waits_on(scroll, rounds, SCROLL["parts"], wildcards)


def overlay_ids(count=3):
    """The first few scored volumes of the first default run: every run shows the same ones."""
    return eval_ids(DEFAULT_RUNS[0])[:count]


def report_inputs(run):
    """Everything the report reads of one run."""
    inputs = [
        f"{run_dir(run)}/evaluation/scores.csv",
        f"{run_dir(run)}/evaluation/summary.json",
        *[prediction(run, i) for i in overlay_ids()],
    ]
    if postprocess_settings_file(run):
        inputs += [f"{tuned_dir(run)}/tuned.json", f"{tuned_dir(run)}/candidates.csv"]
    if tune_ids(run) and dataset_plan().labels.is_binary:  # a threshold tuned on these
        inputs += [
            f"{run_dir(run)}/baseline/scores.csv",
            f"{run_dir(run)}/baseline/summary.json",
        ]
    if run_kind(run) == "trained":
        inputs += [
            f"{run_dir(run)}/train/steps.csv",
            f"{run_dir(run)}/train/epochs.csv",
            f"{run_dir(run)}/train/settings.json",
            *trial_summaries(run),
            *[summary for summary in [dataset_summary_file(run)] if summary],
        ]
    return inputs


def report_runs():
    """The runs the dataset's report shows: this invocation's, then every other run of the
    dataset already scored in ROOT (ctseg.report.runs.scored_runs), so that a new experiment's
    report keeps the earlier ones. Only the first are inputs: a run on disk is shown as it is,
    never rebuilt for the report."""
    return DEFAULT_RUNS + [r for r in scored_runs(ROOT) if r not in DEFAULT_RUNS]


def trainings_to_run():
    """The trained runs whose train_model job this invocation runs, forced reruns included:
    Snakemake's DAG as it stands when the workflow starts (onstart, train.smk)."""
    return planned_runs.trainings_to_run(workflow.dag.needrun_jobs())


def dataset_summary_file(run):
    """The summary of a trained run's volumes, made from its experiment's local stores before it
    trains (rule dataset_summary); none for an experiment staged from a remote source.
    """
    base = base_of(run)
    if experiment(base)["source"] is not None:
        return []
    return f"{run_dir(base)}/dataset_summary.json"
