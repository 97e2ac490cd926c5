import functools
import re
from pathlib import Path

import pandas as pd

from ctseg.config import (
    FOLD_RUN,
    RUN_NAME,
    check_trial_phases,
    load_experiment,
    load_phases,
    settings_used,
    with_fold,
)
from ctseg import layout
from ctseg.demo_data import demo_records
from ctseg.io import CtsegError
from ctseg.records import assign_folds, folds_by_scroll, read_records, select_records
from ctseg.stage import expand_scratch

ID_REGEX = "[A-Za-z0-9_.-]+"
DATASET_DIR = Path("resources") / config["dataset"]
IS_DEMO = config["dataset"] == "demo"
# Each dataset's preprocessed stores under a root of their own, so that two datasets with a
# common id never overwrite each other's. Below the root is the layout `ctseg stage` reads from
# any source, local or remote: zarr/images/<id>.zarr, zarr/labels/<id>.zarr, targets/<id>.zarr.
STORE = layout.store_root(config["dataset"])
IMAGE_STORE = layout.image_store(STORE, "{id}")
LABEL_STORE = layout.label_store(STORE, "{id}")
TARGET_STORE = layout.target_store(STORE, "{id}")


def load_demo_records():
    """The demo's records follow from its config alone, so its outputs are known before it runs."""
    rows = demo_records(
        config["demo"]["n_train"],
        config["demo"]["n_test"],
        config["demo"]["scroll_ids"],
    )
    for row in rows:
        split = row["split"]
        row["image"] = f"resources/demo/{split}_images/{row['id']}.tif"
        row["label"] = f"resources/demo/{split}_labels/{row['id']}.tif"
    return {row["id"]: row for row in rows}


DEMO_RECORDS = load_demo_records()


def load_records():
    if IS_DEMO:
        return DEMO_RECORDS
    try:
        table = read_records(DATASET_DIR)
    except CtsegError as exc:
        raise WorkflowError(f"dataset {config['dataset']!r}: {exc}") from exc
    return {row["id"]: row for row in table.to_dict("records")}


RECORDS = load_records()


def ids(split=None, labelled=None):
    return [
        record_id
        for record_id, row in RECORDS.items()
        if (split is None or row["split"] == split)
        and (labelled is None or bool(row["label"]) == labelled)
    ]


def image_source(wildcards):
    return RECORDS[wildcards.id]["image"]


def label_source(wildcards):
    label = RECORDS[wildcards.id]["label"]
    if not label:
        raise WorkflowError(f"record {wildcards.id!r} has no label volume")
    return label


def label_file(record_id):
    return RECORDS[record_id]["label"]


def shape_arg(values):
    return ",".join(str(v) for v in values)


def preprocessed_outputs():
    return (
        expand(IMAGE_STORE, id=ids())
        + expand(LABEL_STORE, id=ids(labelled=True))
        + expand(TARGET_STORE, id=ids(split="train"))
    )


def convert_shards_arg():
    shards = config["convert"]["shards"]
    return f"--shards {shape_arg(shards)}" if shards else ""


def codec_arg():
    """The codec as `ctseg convert --codec` takes it: NAME,KEY=VALUE,..."""
    codec = dict(config["convert"]["codec"])
    name = codec.pop("name")
    return ",".join([name, *(f"{k}={v}" for k, v in sorted(codec.items()))])


# ----------------------------------------------------------------------------- runs
# A run is what has a results/<run>/ directory, named by its path:
# - an experiment, config/experiments/<exp>.yaml (`extends` resolved by ctseg.config);
# - a fold of an experiment with split.folds: <exp>.fold<i> (fold i held out as val);
# - the cross-validation of such an experiment: <exp>.cv (its folds' mean on held-out
#   volumes; post-processing tuned on the out-of-fold probabilities);
# - an ensemble, config/ensembles/<name>.yaml (ctseg.ensemble).
# The experiment and phases are loaded and checked by ctseg.config, the same code every
# `ctseg` command uses; the rules hand the commands these paths, never the settings.
EXPERIMENTS_DIR = Path("config/experiments")
ENSEMBLES_DIR = Path("config/ensembles")
PHASES_FILE = "config/phases.yaml"
# Directories of results/ that are not runs.
RESERVED = {"preprocessed", "scratch", "logs", "benchmarks", "bench", "report"}


def file_names(folder):
    return sorted(p.stem for p in Path(folder).glob("*.yaml"))


EXPERIMENT_NAMES = file_names(EXPERIMENTS_DIR)
ENSEMBLE_NAMES = file_names(ENSEMBLES_DIR)


def check_names():
    for name in EXPERIMENT_NAMES + ENSEMBLE_NAMES:
        if not RUN_NAME.fullmatch(name) or name in RESERVED:
            raise WorkflowError(
                f"{name}.yaml: a run's name may hold only letters, digits, _ and -, and not be "
                f"one of {sorted(RESERVED)}; rename the file"
            )
    clash = sorted(set(EXPERIMENT_NAMES) & set(ENSEMBLE_NAMES))
    if clash:
        raise WorkflowError(
            f"{ENSEMBLES_DIR}: ensemble(s) {clash} have the name of an experiment in "
            f"{EXPERIMENTS_DIR}; both would write results/<name>/: rename one"
        )


check_names()


def load_phases_file():
    try:
        return load_phases(PHASES_FILE)
    except CtsegError as exc:
        raise WorkflowError(str(exc)) from exc


PHASES = load_phases_file()


@functools.cache
def experiment(name):
    """The effective settings of experiment `name` (no fold), checked."""
    path = EXPERIMENTS_DIR / f"{name}.yaml"
    if name not in EXPERIMENT_NAMES:
        raise WorkflowError(
            f"{path}: no such experiment (config/experiments/ has {EXPERIMENT_NAMES})"
        )
    try:
        exp = load_experiment(path)
        check_trial_phases(exp, PHASES, str(path))
    except CtsegError as exc:
        raise WorkflowError(str(exc)) from exc
    return exp


def folds_of(name):
    return experiment(name)["split"]["folds"] or 0


def base_of(run):
    """The experiment a trained run (an experiment or one of its folds) comes from."""
    found = FOLD_RUN.fullmatch(run)
    return found["experiment"] if found else run


def fold_of_run(run):
    found = FOLD_RUN.fullmatch(run)
    return int(found["fold"]) if found else None


def run_settings(run):
    """The experiment as a trained run uses it: with its fold, if it is one."""
    exp = experiment(base_of(run))
    fold = fold_of_run(run)
    if fold is None:
        return exp
    try:
        return with_fold(exp, fold, str(EXPERIMENTS_DIR / f"{base_of(run)}.yaml"))
    except CtsegError as exc:
        raise WorkflowError(f"run {run!r}: {exc}") from exc


def experiment_file(run):
    return str(EXPERIMENTS_DIR / f"{base_of(run)}.yaml")


def fold_arg(run):
    fold = fold_of_run(run)
    return f"--fold {fold}" if fold is not None else ""


def cv_base(run):
    return run[: -len(".cv")] if run.endswith(".cv") else None


def run_kind(run):
    """trained (an experiment or a fold), cv or ensemble; a clear error for anything else."""
    if run in ENSEMBLE_NAMES:
        return "ensemble"
    base = cv_base(run)
    if base is not None and base in EXPERIMENT_NAMES:
        if not folds_of(base):
            raise WorkflowError(
                f"run {run!r}: experiment {base!r} declares no split.folds "
                f"({experiment_file(base)}), so it has no cross-validation"
            )
        return "cv"
    if base_of(run) in EXPERIMENT_NAMES:
        run_settings(run)  # a fold out of range fails here, naming the file
        return "trained"
    raise WorkflowError(
        f"run {run!r}: not an experiment of {EXPERIMENTS_DIR}/ ({EXPERIMENT_NAMES}), a fold "
        f"<experiment>.fold<i>, a cross-validation <experiment>.cv, or an ensemble of "
        f"{ENSEMBLES_DIR}/ ({ENSEMBLE_NAMES})"
    )


def alternatives(names):
    return "|".join(re.escape(n) for n in names) or "(?!)"


# Wildcard constraints: which runs each kind of rule can make (so that two rules never
# claim the same results/<run>/... path).
BASE_RUN = alternatives(EXPERIMENT_NAMES)
TRAINED_RUN = rf"(?:{BASE_RUN})(?:\.fold[0-9]+)?"
COMBINED_RUN = alternatives([f"{n}.cv" for n in EXPERIMENT_NAMES] + ENSEMBLE_NAMES)
ANY_RUN = rf"{TRAINED_RUN}|{COMBINED_RUN}"


wildcard_constraints:
    id=ID_REGEX,
    phase=r"\d+",


def default_runs():
    runs = config["experiment"]
    runs = [runs] if isinstance(runs, str) else list(runs)
    for run in runs:
        run_kind(run)
    return runs


DEFAULT_RUNS = default_runs()


# ----------------------------------------------------------------------------- splits
def training_records():
    """The labelled training records an experiment may draw from."""
    return pd.DataFrame(
        [
            {"id": i, "scroll_id": RECORDS[i]["scroll_id"]}
            for i in ids(split="train", labelled=True)
        ],
        columns=["id", "scroll_id"],
    )


@functools.cache
def split_table(run):
    """The train/val/test table of a trained run (what rule split writes)."""
    exp = run_settings(run)
    try:
        return select_records(training_records(), exp["subset"], exp["split"])
    except CtsegError as exc:
        raise WorkflowError(f"{experiment_file(run)}: run {run!r}: {exc}") from exc


def split_ids(run, part):
    table = split_table(run)
    return list(table.loc[table["split"] == part, "id"])


@functools.cache
def out_of_fold(base):
    """{record: the fold that holds it out}, for every non-test record of `base`."""
    exp = experiment(base)
    table = split_table(base)
    rest = table[table["split"] != "test"].reset_index(drop=True)
    try:
        return assign_folds(
            rest, exp["split"], folds_by_scroll(exp["subset"], exp["split"])
        )
    except CtsegError as exc:
        raise WorkflowError(f"{experiment_file(base)}: {exc}") from exc


def fold_runs(base):
    return [f"{base}.fold{i}" for i in range(folds_of(base))]


# ----------------------------------------------------------------------------- ensembles
@functools.cache
def ensemble(name):
    """config/ensembles/<name>.yaml, checked against the runs that exist (ctseg.ensemble)."""
    from ctseg.ensemble import load_ensemble

    known = {n: folds_of(n) for n in EXPERIMENT_NAMES}
    try:
        return load_ensemble(ENSEMBLES_DIR / f"{name}.yaml", known)
    except CtsegError as exc:
        raise WorkflowError(str(exc)) from exc


def members(run):
    """The runs a combined run averages."""
    kind = run_kind(run)
    if kind == "cv":
        return fold_runs(cv_base(run))
    if kind == "ensemble":
        return ensemble(run).member_names
    return []


def ensemble_inputs(run, record_id):
    """(probabilities, weight) of each member for one volume. A cross-validation's
    out-of-fold volume comes from the one fold that held it out; elsewhere its folds weigh
    the same. An ensemble's weights are its file's, or 1 each when tuned (the weights then
    come from weights.json)."""
    if run_kind(run) == "cv":
        base = cv_base(run)
        oof = out_of_fold(base)
        if record_id in oof:
            return [(probability(f"{base}.fold{oof[record_id]}", record_id), 1.0)]
        return [(probability(m, record_id), 1.0) for m in members(run)]
    spec = ensemble(run)
    weights = spec.weights or [1.0] * len(spec.members)
    held_out = record_id in tune_ids(run)
    return [
        (member_probability(m, record_id) if held_out else probability(m, record_id), w)
        for m, w in zip(spec.member_names, weights)
    ]


def tuned_ensemble(run):
    return run_kind(run) == "ensemble" and ensemble(run).tuned


def ensemble_weights_file(run):
    return f"{run_dir(run)}/ensemble/weights.json" if tuned_ensemble(run) else []


def ensemble_weight_args(wildcards, input):
    if tuned_ensemble(wildcards.exp):
        names = " ".join(members(wildcards.exp))
        return f"--weights-file '{input.weights}' --names {names}"
    weights = [w for _, w in ensemble_inputs(wildcards.exp, wildcards.id)]
    return "--weights " + " ".join(str(w) for w in weights)


def ensemble_tuning_inputs(run):
    """Each member's held-out probabilities, member by member, in tune_ids order."""
    return [member_probability(m, i) for m in members(run) for i in tune_ids(run)]


def ensemble_member_args(run):
    """`--member NAME ZARR...` per member, as ctseg tune-ensemble takes them."""
    return " ".join(
        f"--member {m} "
        + " ".join(f"'{member_probability(m, i)}'" for i in tune_ids(run))
        for m in members(run)
    )


def trained_runs(run):
    """Every trained run a run needs, itself included for a trained one."""
    if run_kind(run) == "trained":
        return [run]
    return [t for m in members(run) for t in trained_runs(m)]


# ----------------------------------------------------------------------------- held-out ids
def tune_ids(run):
    """Labelled volumes whose probabilities the post-processing (and ensemble weights) are
    fitted on: a trained run's val split; out-of-fold for a cross-validation; the members'
    common ones for an ensemble. Never a test split."""
    kind = run_kind(run)
    if kind == "trained":
        return split_ids(run, "val")
    if kind == "cv":
        return sorted(out_of_fold(cv_base(run)))
    common = None
    for member in members(run):
        these = set(member_held_out(member))
        common = these if common is None else common & these
    return sorted(common or [])


def member_held_out(member):
    """The held-out volumes an ensemble member offers: its val split, or, for a fold, its
    experiment's out-of-fold volumes (each predicted by the fold that held it out)."""
    if fold_of_run(member) is not None:
        return sorted(out_of_fold(base_of(member)))
    return tune_ids(member)


def member_probability(member, record_id):
    """A member's held-out probabilities of a volume (see member_held_out)."""
    if fold_of_run(member) is not None:
        base = base_of(member)
        return probability(f"{base}.fold{out_of_fold(base)[record_id]}", record_id)
    return tune_probability(member, record_id)


def test_split_ids(run):
    """The labelled test split of a run's experiment(s), that nothing trains or tunes on."""
    kind = run_kind(run)
    if kind == "trained":
        return split_ids(run, "test")
    if kind == "cv":
        return split_ids(cv_base(run), "test")
    common = None
    for member in members(run):
        these = set(test_split_ids(member))
        common = these if common is None else common & these
    return sorted(common or [])


def eval_ids(run):
    """Labelled volumes the run is scored on: its test split; else the demo's test volumes;
    else (real data without a test split) the tuning volumes, an optimistic score that the
    evaluation's provenance and the report say is fitted on them."""
    test = test_split_ids(run)
    if test:
        return test
    if IS_DEMO:
        return ids(split="test", labelled=True)
    return tune_ids(run)


def provenance_args(run):
    """What evaluation/summary.json records of where its volumes come from."""
    test = test_split_ids(run)
    if test:
        scored = "test_split"
    elif IS_DEMO:
        scored = "demo_test_volumes"
    else:
        scored = "oof" if run_kind(run) == "cv" else "val"
    tuned = config["infer"]["postprocess"] == "tuned"
    fitted_on_scored = tuned and scored in ("val", "oof")
    pairs = {
        "run": run,
        "kind": run_kind(run),
        "scored_on": scored,
        "postprocess": config["infer"]["postprocess"],
        "fitted_on_scored": "yes" if fitted_on_scored else "no",
    }
    return " ".join(f"--provenance {k}={v}" for k, v in pairs.items())


def infer_ids(run):
    """Volumes a run makes masks of: the dataset's test volumes (the submission) and the
    volumes it is scored on. (Its tuning volumes' probabilities are made as tuning inputs.)
    """
    return sorted(set(ids(split="test")) | set(eval_ids(run)))


def check_record_counts(run):
    """Training needs a record to train on and evaluation one to score: say so before any job
    runs, not as a usage error of `ctseg evaluate` after training."""
    if eval_ids(run):
        return
    if IS_DEMO:
        why = "demo.n_test is 0 and it has no split.test_fraction; set either"
    elif run_kind(run) == "trained" and len(split_table(run)) < 2:
        why = (
            f"it selects {len(split_table(run))} labelled record(s), so its val split is "
            "empty: label at least 2 records in train.csv/train_labels"
        )
    else:
        why = (
            "it has no labelled test split and no val split: set split.test_fraction, "
            "split.val_fraction above 0, or list split.test_ids / split.val_ids"
        )
    raise WorkflowError(
        f"dataset {config['dataset']!r}, run {run!r}: no record to evaluate: {why}"
    )


# ----------------------------------------------------------------------------- paths
def prediction(run, record_id):
    return layout.prediction(run, record_id)


def probability(run, record_id):
    """A run's float16 probabilities of a record (rule infer, or rule ensemble)."""
    return layout.probabilities(run, record_id)


def tune_probability(run, record_id):
    """The held-out probabilities a run is tuned on: a cross-validation's come from the fold
    that held the record out."""
    if run_kind(run) == "cv":
        return probability(
            f"{cv_base(run)}.fold{out_of_fold(cv_base(run))[record_id]}", record_id
        )
    return probability(run, record_id)


def run_dir(run):
    return layout.run_dir(run)


def bench(run, name):
    """A job's timings, under its run: the report sums them per run."""
    return f"{run_dir(run)}/benchmarks/{name}.tsv"


# ----------------------------------------------------------------------------- training
SCRATCH_ROOT = str(expand_scratch(config["scratch"]))

# Host memory a training job asks the scheduler for: the main process plus each loader
# worker (a worker holds its prefetched batches and the memmapped patches it touches).
MAIN_PROCESS_MB = 4000
WORKER_MB = 1500


def phase_gpus(run, phase):
    """GPUs a phase trains on, one torchrun process each: the phase's own `gpus`, else the
    experiment's train.gpus (ctseg.train.configured_gpus decides the same way)."""
    exp = experiment(base_of(run))
    return int(PHASES[phase].get("gpus") or exp["train"].get("gpus") or 1)


def phase_threads(run, phase):
    return phase_gpus(run, phase) * (max(1, PHASES[phase]["workers"]) + 1)


def phase_mem_mb(run, phase):
    return phase_gpus(run, phase) * (
        MAIN_PROCESS_MB + WORKER_MB * PHASES[phase]["workers"]
    )


def launcher(gpus):
    """How a training job starts ctseg: as one process, or as `gpus` DDP processes."""
    if gpus == 1:
        return "ctseg"
    return f"torchrun --standalone --nproc_per_node {gpus} -m ctseg.cli"


def chosen_phases(run):
    """The phase the train job may use: the configured one, or any trialled one for auto."""
    if config["phase"] == "auto":
        return experiment(base_of(run))["trial"]["phases"]
    if config["phase"] not in PHASES:
        raise WorkflowError(
            f"config 'phase': {config['phase']} is not in config/phases.yaml"
        )
    return [config["phase"]]


def train_gpus(run):
    """GPUs of the train job. torchrun's process count is fixed before `auto` chooses the
    phase, so the trialled phases must agree on it."""
    counts = {phase_gpus(run, p) for p in chosen_phases(run)}
    if len(counts) > 1:
        raise WorkflowError(
            f"phase auto: the trialled phases {chosen_phases(run)} ask for different gpus "
            f"({sorted(counts)}); trial phases with one GPU count, or choose a phase"
        )
    return counts.pop()


def train_settings(run):
    """What the train job's weights depend on among the settings: the experiment's training
    sections and every phase it may train with (one for a number, the trialled ones for auto).
    """
    exp = run_settings(run)
    return {p: settings_used(exp, PHASES[p], "train") for p in chosen_phases(run)}


def init_weights(run):
    """The weights a fine-tune starts from (`init_from: <run>`): the DAG builds them first."""
    source = experiment(base_of(run)).get("init_from")
    if not source:
        return []
    if run_kind(source) != "trained":
        raise WorkflowError(
            f"{experiment_file(run)}: init_from: {source!r} is not a trained run (an "
            "experiment or a fold): it has no last.pt to start from"
        )
    return [f"{run_dir(source)}/last.pt"]


def init_arg(wildcards, input):
    return f"--init-from '{input.init[0]}'" if input.init else ""


def trial_summaries(run):
    """The phase trials of a trained run's experiment (folds share their experiment's)."""
    base = base_of(run)
    return [layout.trial_summary(base, p) for p in experiment(base)["trial"]["phases"]]


def previous_trial(wildcards):
    """Trials run in order, each compared with the one before (and one GPU runs one at a time)."""
    order = experiment(wildcards.exp)["trial"]["phases"]
    phase = int(wildcards.phase)
    if phase in order and order.index(phase) > 0:
        before = order[order.index(phase) - 1]
        return [layout.trial_summary(wildcards.exp, before)]
    return []


def stage_source(wildcards):
    """Where stage reads the preprocessed store: the experiment's source, or results/."""
    return experiment(wildcards.exp)["source"] or STORE


def local_store_inputs(exp_name, pattern):
    """The experiment's non-test records in this workflow's store (none for a remote source)."""
    if experiment(exp_name)["source"] is not None:
        return []
    table = split_table(exp_name)
    return expand(pattern, id=table.loc[table["split"] != "test", "id"])


def scratch_dir(run):
    """A run's staged copy: its experiment's (folds draw on the same non-test records)."""
    return f"{SCRATCH_ROOT}/{base_of(run)}"


def training_data(wildcards):
    """What a training job reads: the staged scratch copy, or (per_job) the store it stages."""
    base = base_of(wildcards.exp)
    if config["stage"] == "per_job":
        return {
            "images": local_store_inputs(base, IMAGE_STORE),
            "targets": local_store_inputs(base, TARGET_STORE),
        }
    return {"manifest": f"{scratch_dir(wildcards.exp)}/manifest.json"}


def scratch_args(wildcards, input):
    """--scratch, plus --stage-from when the job stages its own copy (kept unexpanded: $TMPDIR
    must be the one on the node that runs the job)."""
    base = base_of(wildcards.exp)
    if config["stage"] == "per_job":
        node = f"{config['node_scratch']}/{base}"
        return (
            f"--scratch '{node}' --stage-from '{experiment(base)['source'] or STORE}'"
        )
    return f"--scratch '{Path(input.manifest).parent}'"


# ----------------------------------------------------------------------------- post-processing
def tuned_dir(run):
    """Where rule tune_postprocess writes tuned.json (the chosen settings) and candidates.csv."""
    return f"{run_dir(run)}/postprocess"


def postprocess_settings_file(run):
    """tuned.json when infer.postprocess is tuned (a mask then waits for the search), else
    nothing: the fixed values in config infer are passed as arguments."""
    if config["infer"]["postprocess"] != "tuned":
        return []
    if not tune_ids(run):
        raise WorkflowError(
            f"infer.postprocess: tuned needs held-out volumes to tune on, and run {run!r} has "
            "none: set split.val_fraction above 0 or list split.val_ids (an ensemble's members "
            "need val volumes in common), or set infer.postprocess: fixed"
        )
    return f"{tuned_dir(run)}/tuned.json"


def postprocess_report_inputs(run):
    """tuned.json and candidates.csv for the report, when the masks are tuned."""
    if not postprocess_settings_file(run):
        return []
    return [f"{tuned_dir(run)}/tuned.json", f"{tuned_dir(run)}/candidates.csv"]


def postprocess_args(wildcards, input):
    """`ctseg postprocess` options: the tuned file, or the fixed values of config infer."""
    if config["infer"]["postprocess"] == "tuned":
        return f"--settings '{input.settings}'"
    infer = config["infer"]
    high = infer["hysteresis_high"]
    options = [
        f"--threshold {infer['threshold']}",
        f"--hysteresis-high {high}" if high is not None else "",
        f"--min-component-voxels {infer['min_component_voxels']}",
        "--fill-holes" if infer["fill_holes"] else "",
        # The later steps only when on: an unchanged config gives the unchanged command line.
        (
            f"--hysteresis-mode {infer['hysteresis_mode']}"
            if infer["hysteresis_mode"] != "3d"
            else ""
        ),
        *[
            f"--{key.replace('_', '-')} {infer[key]}"
            for key in ("plug_holes_max_area", "patch_holes_max_area", "closing_radius")
            if infer[key]
        ],
    ]
    return " ".join(o for o in options if o)


def scoring_mem_mb(threads, volumes):
    """Host memory of a scoring job: one process per volume, up to its threads, 2 GB each at
    320^3 (ctseg.metrics.WORKER_MEMORY_GB), and a margin."""
    return 1000 + 2000 * max(1, min(threads, volumes))


def tune_args():
    """The search space of `ctseg tune-postprocess`, from config infer.tune."""
    tune = config["infer"]["tune"]

    def values(option, items):
        return " ".join([option, *(str(v) for v in items)])

    options = [
        values("--thresholds", tune["thresholds"]),
        f"--refine-step {tune['refine_step']}",
        values("--hysteresis-offsets", tune["hysteresis_offsets"]),
        values("--min-component-voxels", tune["min_component_voxels"]),
        "" if tune["fill_holes"] else "--no-fill-holes",
        values(
            "--hysteresis-pairs", [f"{lo},{hi}" for lo, hi in tune["hysteresis_pairs"]]
        ),
        values("--hysteresis-modes", tune["hysteresis_modes"]),
        values("--plug-holes-max-area", tune["plug_holes_max_area"]),
        values("--patch-holes-max-area", tune["patch_holes_max_area"]),
        values("--closing-radii", tune["closing_radii"]),
    ]
    return " ".join(o for o in options if o)


# ----------------------------------------------------------------------------- report
def overlay_ids(count=3):
    """The first few scored volumes of the first default run: every run shows the same ones."""
    return eval_ids(DEFAULT_RUNS[0])[:count]


def overlay_args():
    """--overlay ID IMAGE LABEL for the first few scored volumes (each run's prediction is
    results/<run>/predictions/<id>.tif)."""
    return " ".join(
        f"--overlay {i} '{IMAGE_STORE.format(id=i)}' '{LABEL_STORE.format(id=i)}'"
        for i in overlay_ids()
    )


def report_inputs(run):
    """Everything the report reads of one run."""
    inputs = [
        f"{run_dir(run)}/evaluation/scores.csv",
        f"{run_dir(run)}/evaluation/summary.json",
        *[prediction(run, i) for i in overlay_ids()],
        *postprocess_report_inputs(run),
    ]
    if run_kind(run) == "trained":
        inputs += [
            f"{run_dir(run)}/train/steps.csv",
            f"{run_dir(run)}/train/epochs.csv",
            f"{run_dir(run)}/train/settings.json",
            *trial_summaries(run),
        ]
    return inputs


for _run in DEFAULT_RUNS:
    check_record_counts(_run)
