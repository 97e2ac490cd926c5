# The plans (ctseg.plan), built once when the workflow loads and written where the steps read
# them, in results/.../plans/: the dataset's (labels and spacing), dataset.json, and each
# trained run's, <run>.json.
# A plan is written when its content changes only, and the rules take it as ancient() input
# with the digests of the sections their step reads as params: Snakemake reruns exactly the
# jobs whose sections changed.
from ctseg.io import CtsegError
from ctseg.plan import write_dataset_plan, write_plan
from ctseg.planning.build import dataset_plan as build_dataset_plan
from ctseg.planning.build import image_shapes_of
from ctseg.planning.build import run_plan as build_run_plan

PLANS = f"{ROOT}/plans"
DATASET_PLAN = f"{PLANS}/dataset.json"


@functools.cache
def dataset_plan():
    first = next((RECORDS[i]["image"] for i in sorted(RECORDS)), None)
    return planning(build_dataset_plan)(DATASET_DIR, first)


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


def write_plans():
    """The dataset's plan, and the plan of every trained run whose experiment loads (a broken
    one was warned about, and a target that needs it is refused by `run_plan_file`), written
    before the DAG is built: Snakemake sees them as inputs that exist."""
    planning(write_dataset_plan)(DATASET_PLAN, dataset_plan())
    for run in RUNS.experiment_names:
        try:
            runs = [run, *RUNS.fold_runs(run)]
            plans = [(r, build_run_plan_of(r)) for r in runs]
        except CtsegError:
            continue
        for r, plan in plans:
            planning(write_plan)(f"{PLANS}/{r}.json", plan)


def dataset_plan_file(wildcards):
    return DATASET_PLAN


def run_plan_file(wildcards):
    run_plan(wildcards.exp)  # a run whose plan could not be written is refused here
    return f"{PLANS}/{wildcards.exp}.json"
