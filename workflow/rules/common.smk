from pathlib import Path

import pandas as pd

from snakemake.utils import validate

from ctseg.config import (
    check_trial_phases,
    load_experiment,
    load_phases,
    settings_used,
)
from ctseg import layout
from ctseg.demo_data import demo_records
from ctseg.io import CtsegError
from ctseg.records import read_records
from ctseg.records import select_records
from ctseg.stage import expand_scratch

validate(config, schema="../schemas/config.schema.yaml")

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


wildcard_constraints:
    id=ID_REGEX,
    phase=r"\d+",


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


# The experiment and the phases are loaded and checked by ctseg.config, the same code every
# `ctseg` command uses; the rules hand the commands these paths, never the settings.
EXP_FILE = f"config/experiments/{config['experiment']}.yaml"
PHASES_FILE = "config/phases.yaml"


def load_settings():
    try:
        experiment = load_experiment(EXP_FILE)
        phases = load_phases(PHASES_FILE)
        check_trial_phases(experiment, phases, EXP_FILE)
    except CtsegError as exc:
        raise WorkflowError(
            f"config 'experiment' {config['experiment']!r}: {exc}"
        ) from exc
    return experiment, phases


EXP, PHASES = load_settings()
EXP_NAME = EXP["name"]
SCRATCH = str(expand_scratch(config["scratch"]) / EXP_NAME)


def training_records():
    """The labelled training records the experiment may draw from."""
    return pd.DataFrame(
        [
            {"id": i, "scroll_id": RECORDS[i]["scroll_id"]}
            for i in ids(split="train", labelled=True)
        ],
        columns=["id", "scroll_id"],
    )


def experiment_split():
    try:
        return select_records(training_records(), EXP["subset"], EXP["split"])
    except CtsegError as exc:
        raise WorkflowError(f"experiment {EXP_NAME!r}: {exc}") from exc


SPLIT = experiment_split()


def local_store_inputs(pattern):
    return expand(pattern, id=SPLIT["id"]) if EXP["source"] is None else []


# Host memory a training job asks the scheduler for: the main process plus each loader
# worker (a worker holds its prefetched batches and the memmapped patches it touches).
MAIN_PROCESS_MB = 4000
WORKER_MB = 1500


def phase_gpus(phase):
    """GPUs a phase trains on, one torchrun process each: the phase's own `gpus`, else the
    experiment's train.gpus (ctseg.train.configured_gpus decides the same way)."""
    return int(PHASES[phase].get("gpus") or EXP["train"].get("gpus") or 1)


def phase_threads(phase):
    return phase_gpus(phase) * (max(1, PHASES[phase]["workers"]) + 1)


def phase_mem_mb(phase):
    return phase_gpus(phase) * (MAIN_PROCESS_MB + WORKER_MB * PHASES[phase]["workers"])


def launcher(gpus):
    """How a training job starts ctseg: as one process, or as `gpus` DDP processes."""
    if gpus == 1:
        return "ctseg"
    return f"torchrun --standalone --nproc_per_node {gpus} -m ctseg.cli"


def chosen_phases():
    """The phase the train job may use: the configured one, or any trialled one for auto."""
    if config["phase"] == "auto":
        return EXP["trial"]["phases"]
    if config["phase"] not in PHASES:
        raise WorkflowError(
            f"config 'phase': {config['phase']} is not in config/phases.yaml"
        )
    return [config["phase"]]


def train_gpus():
    """GPUs of the train job. torchrun's process count is fixed before `auto` chooses the
    phase, so the trialled phases must agree on it."""
    counts = {phase_gpus(p) for p in chosen_phases()}
    if len(counts) > 1:
        raise WorkflowError(
            f"phase auto: the trialled phases {chosen_phases()} ask for different gpus "
            f"({sorted(counts)}); trial phases with one GPU count, or choose a phase"
        )
    return counts.pop()


def train_settings():
    """What the train job's weights depend on among the settings: the experiment's training
    sections and every phase it may train with (one for a number, the trialled ones for auto).
    """
    return {p: settings_used(EXP, PHASES[p], "train") for p in chosen_phases()}


def train_threads():
    return max(phase_threads(p) for p in chosen_phases())


def train_mem_mb():
    return max(phase_mem_mb(p) for p in chosen_phases())


def trial_summaries():
    return [
        f"results/{EXP_NAME}/phases/phase{p}/summary.json"
        for p in EXP["trial"]["phases"]
    ]


def previous_trial(wildcards):
    """Trials run in order, each compared with the one before (and one GPU runs one at a time)."""
    order = EXP["trial"]["phases"]
    phase = int(wildcards.phase)
    if phase in order and order.index(phase) > 0:
        before = order[order.index(phase) - 1]
        return [f"results/{EXP_NAME}/phases/phase{before}/summary.json"]
    return []


def stage_source(wildcards):
    """Where stage reads the preprocessed store: the experiment's source, or results/."""
    return EXP["source"] or STORE


def infer_ids():
    """Held-out volumes to predict: the test set, plus the val split when it is scored."""
    held_out = ids(split="test")
    return (
        held_out
        if IS_DEMO
        else held_out + list(SPLIT.loc[SPLIT["split"] == "val", "id"])
    )


def eval_ids():
    """Held-out volumes with labels: the demo's test set, or the val split for real data."""
    if IS_DEMO:
        return ids(split="test", labelled=True)
    return list(SPLIT.loc[SPLIT["split"] == "val", "id"])


def check_record_counts():
    """Training needs a record to train on and evaluation one to score: say so before any job
    runs, not as a usage error of `ctseg evaluate` after training."""
    if not eval_ids():
        if IS_DEMO:
            why = "demo.n_test is 0; set it to 1 or more"
        else:
            n = len(SPLIT)
            why = (
                f"the val split of its {n} selected labelled record(s) is empty "
                f"(split: {EXP['split']}); "
                + (
                    "label at least 2 records in train.csv/train_labels"
                    if n < 2
                    else "set split.val_fraction above 0 or list split.val_ids"
                )
            )
        raise WorkflowError(
            f"dataset {config['dataset']!r}, experiment {EXP_NAME!r}: no record to "
            f"evaluate: {why}"
        )


check_record_counts()


def prediction(record_id):
    return layout.prediction(EXP_NAME, record_id)


def probability(record_id):
    """The model's float16 probabilities of a record (rule infer); masks come from them."""
    return layout.probabilities(EXP_NAME, record_id)


# Where rule tune_postprocess writes tuned.json (the chosen settings) and candidates.csv.
TUNED_DIR = f"results/{EXP_NAME}/postprocess"


def tune_ids():
    """Labelled volumes the post-processing is tuned on: the experiment's val split, held out
    of training. (With real data evaluate scores the same split, so its score is optimistic
    by what the tuning fitted; the demo scores its separate test volumes.)"""
    return list(SPLIT.loc[SPLIT["split"] == "val", "id"])


def postprocess_settings_file():
    """tuned.json when infer.postprocess is tuned (a mask then waits for the search), else
    nothing: the fixed values in config infer are passed as arguments."""
    if config["infer"]["postprocess"] != "tuned":
        return []
    if not tune_ids():
        raise WorkflowError(
            f"infer.postprocess: tuned needs a val split to tune on, and experiment "
            f"{EXP_NAME!r} has none: set split.val_fraction above 0 or list split.val_ids, "
            "or set infer.postprocess: fixed"
        )
    return f"{TUNED_DIR}/tuned.json"


def postprocess_report_inputs():
    """tuned.json and candidates.csv for the report, when the masks are tuned."""
    if not postprocess_settings_file():
        return []
    return [f"{TUNED_DIR}/tuned.json", f"{TUNED_DIR}/candidates.csv"]


def postprocess_args(wildcards):
    """`ctseg postprocess` options: the tuned file, or the fixed values of config infer."""
    if config["infer"]["postprocess"] == "tuned":
        return f"--settings {postprocess_settings_file()}"
    infer = config["infer"]
    high = infer["hysteresis_high"]
    options = [
        f"--threshold {infer['threshold']}",
        f"--hysteresis-high {high}" if high is not None else "",
        f"--min-component-voxels {infer['min_component_voxels']}",
        "--fill-holes" if infer["fill_holes"] else "",
    ]
    return " ".join(o for o in options if o)


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
    ]
    return " ".join(o for o in options if o)


def overlay_ids(count=3):
    return eval_ids()[:count]


def overlay_args():
    """--overlay ID IMAGE LABEL PRED for the first few scored volumes."""
    return " ".join(
        f"--overlay {i} {IMAGE_STORE.format(id=i)} {LABEL_STORE.format(id=i)} "
        f"{prediction(i)}"
        for i in overlay_ids()
    )


def training_data(wildcards):
    """What a training job reads: the staged scratch copy, or (per_job) the store it stages."""
    if config["stage"] == "per_job":
        return {
            "images": local_store_inputs(IMAGE_STORE),
            "targets": local_store_inputs(TARGET_STORE),
        }
    return {"manifest": f"{SCRATCH}/manifest.json"}


def scratch_args(wildcards, input):
    """--scratch, plus --stage-from when the job stages its own copy (kept unexpanded: $TMPDIR
    must be the one on the node that runs the job)."""
    if config["stage"] == "per_job":
        node = f"{config['node_scratch']}/{EXP_NAME}"
        return f"--scratch '{node}' --stage-from {stage_source(wildcards)}"
    return f"--scratch {Path(input.manifest).parent}"
