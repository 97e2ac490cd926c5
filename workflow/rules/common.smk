import json
from pathlib import Path

from snakemake.utils import validate

from ctseg.demo_data import demo_records
from ctseg.io import CtsegError
from ctseg.records import read_records

validate(config, schema="../schemas/config.schema.yaml")

ID_REGEX = "[A-Za-z0-9_.-]+"
DATASET_DIR = Path("resources") / config["dataset"]
IS_DEMO = config["dataset"] == "demo"


wildcard_constraints:
    id=ID_REGEX,


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
        expand("results/zarr/images/{id}.zarr", id=ids())
        + expand("results/zarr/labels/{id}.zarr", id=ids(labelled=True))
        + expand("results/targets/{id}.zarr", id=ids(split="train"))
    )


def convert_shards_arg():
    shards = config["convert"]["shards"]
    return f"--shards {shape_arg(shards)}" if shards else ""
