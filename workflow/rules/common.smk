# The workflow's view of the dataset and its runs. The run model is ctseg.runs (unit-tested
# without Snakemake); this file builds it from the config and hands its answers to the rules,
# a refusal as one line naming the file (`refuse`, settings.smk).
import functools
import sys
import time
from pathlib import Path

from ctseg import layout, rule_args
from ctseg.config import check_configured_phase, load_phases, settings_used
from ctseg.io import CtsegError
from ctseg.network.losses import check_terms
from ctseg.preprocess.demo_data import demo_dataset
from ctseg.records import read_records, read_recorded_split
from ctseg.report.runs import scored_runs
from ctseg.run_settings import SETTINGS_JSON, read_run_settings
from ctseg.runs import Runs, base_of, cv_base, fold_of, forced_on_command_line
from ctseg.summaries import TrialSummary
from ctseg.training.restart import restart_line
from ctseg.training.start import start_lines

ID_REGEX = "[A-Za-z0-9_.-]+"
DATASET_DIR = Path("resources") / config["dataset"]
IS_DEMO = config["dataset"] == layout.DEMO_DATASET
# The dataset's runs, logs, job timings and report: results/ for the demo, results/<dataset>/
# for any other (ctseg.layout.results_root), so datasets never share a run folder.
ROOT = layout.results_root(config["dataset"])
# Each dataset's preprocessed stores under a root of their own, so that two datasets with a
# common id never overwrite each other's. Below the root is the layout `ctseg stage` reads from
# any source, local or remote: zarr/images/<id>.zarr, zarr/labels/<id>.zarr, targets/<id>.zarr.
STORE = layout.store_root(config["dataset"])
IMAGE_STORE = layout.image_store(STORE, "{id}")
LABEL_STORE = layout.label_store(STORE, "{id}")
TARGET_STORE = layout.target_store(STORE, "{id}")
# EXPERIMENTS_DIR, ENSEMBLES_DIR and PHASES_FILE are ctseg.config's (imported in settings.smk).
STARTED = time.time()
SCRATCH_ROOT = layout.scratch_root(configured_scratch(), config["dataset"])


def planning(function):
    """`function` as the rules call it: a CtsegError stops planning with its one line."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except CtsegError as exc:
            refuse(exc)

    return call


DEMO_RECORDS = demo_dataset("resources/demo", config["demo"])


@planning
def load_records():
    if IS_DEMO:
        return DEMO_RECORDS
    try:
        table = read_records(DATASET_DIR)
    except CtsegError as exc:
        raise CtsegError(f"dataset {config['dataset']!r}: {exc}") from exc
    return {row["id"]: row for row in table.to_dict("records")}


RECORDS = load_records()
PHASES = planning(load_phases)(PHASES_FILE)
RUNS = planning(Runs)(
    RECORDS,
    dataset=config["dataset"],
    experiments_dir=EXPERIMENTS_DIR,
    ensembles_dir=ENSEMBLES_DIR,
    phases=PHASES,
    demo=IS_DEMO,
    other_datasets=layout.other_datasets("resources", config["dataset"]),
    recorded_split=read_recorded_split,
    # An unregistered loss term is refused here, at planning, naming the experiment's file.
    check_experiment=lambda exp: check_terms(exp["loss"]["weights"]),
)

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


# The configured phase, checked when the workflow loads, whatever the target.
planning(check_configured_phase)(config["phase"], PHASES)


@planning
def default_runs():
    runs = config["experiment"]
    runs = [runs] if isinstance(runs, str) else list(runs)
    for run in runs:
        RUNS.kind(run)
    return runs


DEFAULT_RUNS = default_runs()


@planning
def check_run_files():
    """Every experiment and ensemble file, checked when the workflow loads: a bad one that the
    default runs read stops planning, naming its file; any other is a warning line."""
    for line in RUNS.check_all(DEFAULT_RUNS):
        print(f"ctseg: {line}", file=sys.stderr)


check_run_files()


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


def trials_record(run):
    """train/trials.txt: the trials the job that wrote the run's last.pt waited on, one a line;
    absent when it waited on none (rule_args.RECORD_TRIALS writes it)."""
    return f"{run_dir(run)}/train/trials.txt"


def trials_written(run):
    """Its experiment's trial summaries as they are now; None while any is not written. One
    that does not read is left out (the train job refuses it, naming it)."""
    paths = [Path(p) for p in trial_summaries(run)]
    if not all(p.exists() for p in paths):
        return None
    found = []
    for path in paths:
        try:
            found.append(TrialSummary.read(path))
        except CtsegError:
            pass
    return found


@functools.cache
def training_plan(run):
    """What the plan does with a trained run's train job (ctseg.runs.Runs.training_plan): which
    phase it is given, whether it waits on the trials, and the line printed about it.

    It reads the run's results as planning starts (last.pt, train/settings.json and
    train/trials.txt exist; what settings.json holds; the trial summaries), so the train rule's
    input functions are not functions of the config alone. That is the point: Snakemake reruns
    a job whose set of inputs differs from the one its last run recorded, so whether a finished
    run's job declares the trials must follow what its last training declared, not the phase
    configured now, or a phase change would retrain it."""
    folder = Path(run_dir(run))
    last_pt = (folder / "last.pt").exists()
    settings = folder / "train" / SETTINGS_JSON
    after_trials = last_pt and Path(trials_record(run)).exists()
    return planning(RUNS.training_plan)(
        run,
        config["phase"],
        last_pt=last_pt,
        trained=read_run_settings(settings) if last_pt and settings.exists() else None,
        after_trials=after_trials,
        trials=(
            trials_written(run) if config["phase"] == "auto" or after_trials else None
        ),
    )


def train_trials(wildcards):
    """The trials the train job waits on: phase auto's when it trains, or those the job that
    wrote its last.pt waited on (training_plan)."""
    return trial_summaries(wildcards.exp) if training_plan(wildcards.exp).trials else []


def train_phase(run):
    """The train job's --phase: the configured one, or for auto, the phase a run trained
    without trials stays on (training_plan)."""
    return training_plan(run).phase


def chosen_phases(run):
    """The phases the train job may use: its phase, or any trialled one for auto."""
    return planning(RUNS.chosen_phases)(run, train_phase(run))


def train_gpus(run):
    return planning(RUNS.train_gpus)(run, train_phase(run))


def train_settings(run):
    return planning(RUNS.train_settings)(run, train_phase(run))


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
    """tuned.json when infer.postprocess is tuned (a mask then waits for the search), else
    nothing: the fixed values in config infer are passed as arguments."""
    if config["infer"]["postprocess"] != "tuned":
        return []
    planning(RUNS.check_tunable)(run)
    return f"{tuned_dir(run)}/tuned.json"


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
    if tune_ids(run):  # the reference row: a threshold tuned on these volumes
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


for _run in DEFAULT_RUNS:
    planning(RUNS.check_record_counts)(_run)


@planning
def training_notices():
    """A line for each default trained run whose last.pt the plan keeps under another phase or
    retrains for changed settings, before any job runs (ctseg.runs.Runs.training_plan).
    """
    for run in sorted({t for r in DEFAULT_RUNS for t in RUNS.trained_runs(r)}):
        plan = training_plan(run)
        notice = plan.notice
        if plan.restart_from is not None and forced_training(run):
            notice = restart_line(run, plan.restart_from, plan.phase)
        if notice:
            print(f"ctseg: {notice}", file=sys.stderr)


def forced_training(run):
    """Whether the command line forces the run's train job (--forcerun/-R train_model or its
    last.pt or best.pt, --forceall): the plan then says it retrains, not that it keeps its
    last.pt.
    """
    forceall, forced = forced_on_command_line(sys.argv)
    outputs = {f"{run_dir(run)}/last.pt", f"{run_dir(run)}/best.pt"}
    return forceall or bool({"train_model", *outputs} & forced)


training_notices()


def state_dir(run):
    """A trained run's resumable checkpoints: outside the declared outputs, which Snakemake
    deletes before a rerun, so that a preempted run resumes rather than starts over."""
    return f"{run_dir(run)}/checkpoints"


def trainings_to_run():
    """The trained runs whose train_model job this invocation runs, forced reruns included:
    Snakemake's DAG as it stands when the workflow starts (onstart, train.smk)."""
    return sorted(
        {
            job.wildcards["exp"]
            for job in workflow.dag.needrun_jobs()
            if job.rule.name == "train_model"
        }
    )


def training_start(run):
    """The lines printed before any job runs for a training this invocation runs
    (ctseg.training.start: its checkpoints set aside for a retraining under another phase, its
    estimated time, its volumes smaller than the patch)."""
    plan = training_plan(run)
    return start_lines(
        run,
        restart_from=plan.restart_from,
        phase=plan.phase,
        settings=run_settings(run),
        phases=PHASES,
        trials=trials_written(run) or [],
        image_stores={
            i: Path(IMAGE_STORE.format(id=i)) for i in split_table(run)["id"]
        },
        state_dir=Path(state_dir(run)),
    )


def dataset_summary_file(run):
    """The summary of a trained run's volumes, made from its experiment's local stores before it
    trains (rule dataset_summary); none for an experiment staged from a remote source.
    """
    base = base_of(run)
    if experiment(base)["source"] is not None:
        return []
    return f"{run_dir(base)}/dataset_summary.json"
