"""A multi-class, anisotropic dataset through the real workflow, to the report: its plan gives
the network a channel per class and a patch shaped for its spacing, it trains softmax
cross-entropy and Dice, its masks are label maps in the dataset's own values, and it is scored
per class with SurfaceDice in its spacing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile
import torch
import yaml
import zarr
from conftest import BIN, TINY_EXPERIMENT, copy_workflow, run_snakemake

pytestmark = pytest.mark.slow

DATASET = "demo_mc"
VALUES = {"background": 0, "sheet": 10, "fibre": 20, "pore": 30}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    workdir = copy_workflow(
        tmp_path_factory.mktemp("multiclass"),
        {"dataset": DATASET, "experiment": "mc_tiny", "phase": 0},
    )
    subprocess.run(
        [str(BIN / "ctseg"), "demo-data", "--preset", "multiclass", "--out",
         f"resources/{DATASET}", "--n-train", "4", "--n-test", "1", "--shape", "32,48,48"],
        cwd=workdir, check=True, capture_output=True,
    )  # fmt: skip
    description = workdir / "resources" / DATASET / "dataset.yaml"
    spec = yaml.safe_load(description.read_text())
    assert spec["labels"] == VALUES and spec["ignore"] == 255
    description.write_text(yaml.safe_dump({**spec, "spacing": [2.0, 1.0, 1.0]}))
    experiment = {
        **TINY_EXPERIMENT,
        "name": "mc_tiny",
        "data": {**TINY_EXPERIMENT["data"], "patch_size": "auto", "patch_voxels": 16 * 32 * 32},
        "loss": {"weights": {"ce": 1.0, "dice": 1.0}},
    }
    (workdir / "config" / "experiments" / "mc_tiny.yaml").write_text(yaml.safe_dump(experiment))
    proc = run_snakemake(workdir)
    (workdir / "console.txt").write_text(proc.stdout)
    return workdir


def test_the_plan_is_the_datasets_labels_spacing_and_a_patch_shaped_for_it(finished) -> None:
    root = finished / "results" / DATASET
    plan = json.loads((root / "plans" / "mc_tiny.json").read_text())
    assert plan["dataset"]["spacing"] == [2.0, 1.0, 1.0]
    assert plan["dataset"]["labels"]["labels"] == VALUES
    z, y, x = plan["patch"]["size"]
    assert plan["patch"]["planned"] and z < y == x  # half as deep as wide, in voxels
    assert plan["experiment"]["model"]["out_channels"] == 4
    assert plan["experiment"]["data"]["augment"]["spacing"] == [2.0, 1.0, 1.0]


def test_it_trains_a_channel_per_class_and_records_the_labels(finished) -> None:
    root = finished / "results" / DATASET / "mc_tiny"
    state = torch.load(root / "last.pt", map_location="cpu", weights_only=False)
    assert state["labels"]["labels"] == VALUES
    head = [v for k, v in state["model"].items() if k.startswith("heads.0.") and v.ndim == 5]
    assert head[0].shape[0] == 4
    steps = pd.read_csv(root / "train" / "steps.csv")
    assert {"ce", "dice"} <= set(steps.columns) and np.isfinite(steps["loss"]).all()


def test_masks_are_label_maps_in_the_datasets_values(finished) -> None:
    predictions = sorted((finished / "results" / DATASET / "mc_tiny" / "predictions").glob("*.tif"))
    assert predictions
    for path in predictions:
        values = set(np.unique(tifffile.imread(path)).tolist())
        assert values <= set(VALUES.values()), (path, values)


def test_each_class_is_tuned_on_its_own_and_the_masks_apply_the_choice(finished) -> None:
    """infer.postprocess: tuned (the default) searches every class from its argmax, and the
    masks are the label maps under the classes' choices."""
    from ctseg.labels import LabelSpec
    from ctseg.postprocess.classes import ClassSettings, class_label_map
    from ctseg.postprocess.tuning import load_tuned

    run = finished / "results" / DATASET / "mc_tiny"
    tuned = json.loads((run / "postprocess" / "tuned.json").read_text())
    assert list(tuned["classes"]) == ["sheet", "fibre", "pore"]
    for summary in tuned["classes"].values():
        assert summary["default"]["label"] == "t>0" and summary["candidates"] > 0
    settings = load_tuned(run / "postprocess" / "tuned.json")
    assert isinstance(settings, ClassSettings) and tuned["label"] == settings.label()
    spec = LabelSpec(labels=VALUES, ignore=255)
    predictions = sorted((run / "predictions").glob("*.tif"))
    for path in predictions:
        probs = np.asarray(zarr.open_array(run / "probabilities" / f"{path.stem}.zarr")[...])
        expected = spec.from_stored(class_label_map(probs, settings)[0])
        np.testing.assert_array_equal(tifffile.imread(path), expected)
    page = (finished / "results" / DATASET / "report.html").read_text()
    assert "Class fibre" in page and "Post-processing candidates of class pore" in page
    assert "Not tuned in this run" not in page


def test_it_is_scored_per_class_and_the_report_shows_the_table(finished) -> None:
    root = finished / "results" / DATASET
    per_class = pd.read_csv(root / "mc_tiny" / "evaluation" / "per_class.csv", dtype={"id": str})
    assert set(per_class["class"]) == {"sheet", "fibre", "pore", "mean"}
    assert per_class["dice"].between(0, 1).all() and per_class["surface_dice"].between(0, 1).all()
    summary = json.loads((root / "mc_tiny" / "evaluation" / "summary.json").read_text())
    assert summary["classes"] == ["sheet", "fibre", "pore"]
    page = (root / "report.html").read_text()
    assert "Per-class scores" in page and "its mean Dice over the classes" in page
    for name in ("sheet", "fibre", "pore"):
        assert name in page


def test_the_console_says_what_the_score_means(finished) -> None:
    ending = (finished / "console.txt").read_text().splitlines()[-1]
    assert ending.startswith("ctseg: mc_tiny: score 0.") or ending.startswith(
        "ctseg: mc_tiny: score 1."
    )
    assert ending.endswith("the mean Dice over the 3 classes is 1.0 for a perfect mask")


def test_a_changed_plan_section_reruns_exactly_the_jobs_that_read_it(finished) -> None:
    """A new spacing changes the dataset plan's spacing (and so the planned patch): the jobs
    that read them rerun; convert, which reads the labels only, does not. Put back, nothing
    is left to do."""
    import re

    description = finished / "resources" / DATASET / "dataset.yaml"
    original = description.read_text()
    try:
        description.write_text(yaml.safe_dump({**yaml.safe_load(original), "spacing": [3, 1, 1]}))
        log = run_snakemake(finished, "-n").stdout
        rules = set(re.findall(r"^(?:local)?rule (\w+):", log, re.M))
        assert {"targets", "train_trial", "train_model", "evaluate_run", "report"} <= rules
        assert not rules & {"convert_image", "convert_label", "split"}, rules
    finally:
        description.write_text(original)
    proc = run_snakemake(finished, "-n")
    assert "Nothing to be done" in proc.stdout + proc.stderr
