# The plans (ctseg.plan) in results/.../plans/: the dataset's labels and spacing
# (dataset.json) and each trained run's experiment, patch and phase (<run>.json), built as the
# workflow loads and written before any job runs (onstart; not in a dry run), when their
# content changed only. A rule passes a plan's path and, as params, the digests of the
# sections its step reads, so Snakemake reruns exactly the jobs whose sections changed.
from ctseg.io import CtsegError
from ctseg.plan import write_dataset_plan, write_plan
from ctseg.planning.build import dataset_plan as build_dataset_plan
from ctseg.planning.build import image_shapes_of
from ctseg.planning.build import run_plan as build_run_plan

PLANS = f"{ROOT}/plans"
DATASET_PLAN = f"{PLANS}/dataset.json"


@functools.cache
def dataset_plan():
    first_image = RECORDS[min(RECORDS)]["image"]
    return planning(build_dataset_plan)(DATASET_DIR, first_image)


@functools.cache
def build_run_plan_of(run):
    images = [RECORDS[i]["image"] for i in sorted(RECORDS) if RECORDS[i]["label"]]
    return build_run_plan(
        run,
        RUNS.settings(run),
        dataset_plan(),
        phase=config["phase"],
        phases=PHASES,
        image_shapes=lambda: image_shapes_of(images),
        where=RUNS.experiment_file(run),
    )


def run_plan(run):
    return planning(build_run_plan_of)(run)


# A train job trains its plan's experiment: what its last.pt is compared with, before the plan
# says what it does with each default training.
RUNS.trained_settings = lambda run: run_plan(run).experiment
planning(TRAINING_PLANS.notices)(DEFAULT_RUNS, sys.argv, restart_line)


def run_plan_file(run):
    return f"{PLANS}/{run}.json"


def write_plans():
    """The dataset's plan and the plan of every trained run whose experiment plans (a broken
    one was warned about; a target that needs it was refused while the DAG was built).
    """
    write_dataset_plan(DATASET_PLAN, dataset_plan())
    for name in RUNS.experiment_names:
        try:
            plans = {r: build_run_plan_of(r) for r in [name, *RUNS.fold_runs(name)]}
        except CtsegError:
            continue
        for run, plan in plans.items():
            write_plan(run_plan_file(run), plan)


def tune_labels(run):
    """The labels the post-processing is tuned on, as evaluate reads them (evaluation_labels)."""
    if dataset_plan().labels.is_binary:
        return [label_file(i) for i in tune_ids(run)]
    return [LABEL_STORE.format(id=i) for i in tune_ids(run)]


def evaluation_labels(run):
    """The held-out volumes' labels as evaluate reads them: a binary dataset's label TIFFs; a
    multi-class dataset's label stores (stored values, scored per class)."""
    if dataset_plan().labels.is_binary:
        return [label_file(i) for i in eval_ids(run)]
    return [LABEL_STORE.format(id=i) for i in eval_ids(run)]
