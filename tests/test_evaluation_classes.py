"""Per-class Dice and SurfaceDice (ctseg.evaluation.classes): hand-computed values on small
synthetic volumes, agreement with `surface_dice` on each class's masks, the ignored voxels left
out, empty classes, the spacing passed through, and the file-level reader, checks and CSV."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import tifffile

from ctseg.evaluation.classes import (
    PER_CLASS_COLUMNS,
    evaluate_classes,
    relative_spacing,
    score_class_files,
    score_classes,
)
from ctseg.evaluation.metrics import dice, prepare_masks
from ctseg.evaluation.surface_dice import surface_dice
from ctseg.io import CtsegError
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.store import create_volume

# Dataset values 3, 7 and 11, ignore 9: stored as 1, 2, 3 and ignore 4.
SPEC = LabelSpec(labels={"background": 0, "bone": 3, "vessel": 7, "air": 11}, ignore=9)
SHAPE = (8, 10, 10)


def by_class(rows: list[dict]) -> dict[str, dict]:
    return {row["class"]: row for row in rows}


def volumes() -> tuple[np.ndarray, np.ndarray]:
    """Stored values. bone: label z 0..1 (200 voxels), prediction z 0 (100 voxels); vessel:
    label slab z 3, prediction slab z 7 (their surfaces' corners on z 3..4 and 7..8: 3 apart,
    nothing within 2); air: nowhere."""
    gt = np.zeros(SHAPE, np.uint8)
    pred = np.zeros(SHAPE, np.uint8)
    gt[0:2] = 1
    pred[0:1] = 1
    gt[3] = 2
    pred[7] = 2
    return pred, gt


def test_hand_computed_dice_surface_dice_and_counts():
    pred, gt = volumes()
    rows = by_class(score_classes(pred, gt, SPEC))
    assert list(rows) == ["bone", "vessel", "air", "mean"]
    bone, vessel, air = rows["bone"], rows["vessel"], rows["air"]
    assert (bone["value"], vessel["value"], air["value"]) == (3, 7, 11)
    assert (bone["gt_voxels"], bone["pred_voxels"]) == (200, 100)
    assert bone["dice"] == pytest.approx(2 * 100 / 300)
    assert (vessel["dice"], vessel["surface_dice"]) == (0.0, 0.0)  # 3 apart > 2
    assert not bone["empty"] and not vessel["empty"]
    # air is in neither volume: 1.0 for both, and marked empty.
    assert (air["dice"], air["surface_dice"], air["empty"]) == (1.0, 1.0, True)
    mean = rows["mean"]
    assert mean["dice"] == pytest.approx((2 / 3 + 0.0 + 1.0) / 3)
    assert mean["surface_dice"] == pytest.approx((bone["surface_dice"] + 0.0 + 1.0) / 3)
    assert (mean["gt_voxels"], mean["pred_voxels"]) == (300, 200)


def test_surface_dice_is_that_of_each_class_masks():
    rng = np.random.default_rng(3)
    values, p = np.arange(4, dtype=np.uint8), [0.91, 0.03, 0.03, 0.03]
    gt = rng.choice(values, SHAPE, p=p)  # sparse classes 1..3, and ignore (4) below
    gt[:, :, 8:] = 4
    pred = rng.choice(values, SHAPE, p=p)
    rows = by_class(score_classes(pred, gt, SPEC))
    keep = gt != SPEC.stored().ignore
    for stored_value, name in enumerate(SPEC.classes, start=1):
        p, g = (pred == stored_value) & keep, (gt == stored_value) & keep
        assert rows[name]["surface_dice"] == surface_dice(p, g, 2.0)
        assert rows[name]["dice"] == dice(p, g)
        assert 0.0 < rows[name]["surface_dice"] < 1.0


def test_ignored_voxels_count_in_neither_mask():
    pred, gt = volumes()
    rows = by_class(score_classes(pred, gt, SPEC))
    # Predict bone over an ignored region: no change to any number of bone.
    gt_ignored, pred_more = gt.copy(), pred.copy()
    gt_ignored[:, :, 9] = SPEC.stored().ignore
    pred_more[:, :, 9] = 1
    masked = by_class(score_classes(pred_more, gt_ignored, SPEC))
    # Bone's label voxels under the ignored column are gone (200 - 20), prediction's too.
    assert (masked["bone"]["gt_voxels"], masked["bone"]["pred_voxels"]) == (180, 90)
    assert masked["bone"]["dice"] == pytest.approx(2 * 90 / 270)
    # Without the ignore the extra prediction would count against bone.
    unmasked = by_class(score_classes(pred_more, gt, SPEC))
    assert unmasked["bone"]["pred_voxels"] == 100 + 7 * 10  # column 9 of z 1..7
    assert unmasked["bone"]["dice"] < rows["bone"]["dice"]


def test_a_class_in_one_volume_only_scores_zero():
    gt = np.zeros(SHAPE, np.uint8)
    gt[2:4, 2:5, 2:5] = 3  # air in the label only
    rows = by_class(score_classes(np.zeros(SHAPE, np.uint8), gt, SPEC))
    assert (rows["air"]["dice"], rows["air"]["surface_dice"], rows["air"]["empty"]) == (
        0.0,
        0.0,
        False,
    )


def test_spacing_is_relative_to_the_finest_axis_and_passed_through():
    gt = np.zeros(SHAPE, np.uint8)
    pred = np.zeros(SHAPE, np.uint8)
    gt[2, 2:8, 2:8] = 1
    pred[4, 2:8, 2:8] = 1  # 2 voxels along z: within 2 at (1,1,1), beyond at z spacing 2
    iso = by_class(score_classes(pred, gt, SPEC))["bone"]["surface_dice"]
    coarse = by_class(score_classes(pred, gt, SPEC, spacing=(2.0, 1.0, 1.0)))["bone"]
    scaled = by_class(score_classes(pred, gt, SPEC, spacing=(0.8, 0.4, 0.4)))["bone"]
    assert relative_spacing((0.8, 0.4, 0.4)) == (2.0, 1.0, 1.0)
    assert iso == 1.0
    assert coarse["surface_dice"] == surface_dice(pred == 1, gt == 1, 2.0, spacing=(2, 1, 1))
    assert coarse["surface_dice"] < 1.0
    assert scaled["surface_dice"] == coarse["surface_dice"]


def test_binary_spec_matches_the_competition_preparation():
    rng = np.random.default_rng(5)
    gt = rng.choice(np.array([0, 1, 2], np.uint8), SHAPE, p=[0.5, 0.3, 0.2])
    pred = rng.choice(np.array([0, 1], np.uint8), SHAPE)
    rows = score_classes(pred, gt, KAGGLE)
    p, g = prepare_masks(pred, gt, KAGGLE)
    assert [r["class"] for r in rows] == ["surface", "mean"]
    assert rows[0]["dice"] == dice(p, g)
    assert rows[0]["surface_dice"] == surface_dice(p, g, 2.0)


# ------------------------------------------------------------------------------------- files
def write_pair(tmp_path, pred_dataset: np.ndarray, gt_stored: np.ndarray, name: str = "v1"):
    pred_path = tmp_path / "predictions" / f"{name}.tif"
    pred_path.parent.mkdir(parents=True, exist_ok=True)
    tifffile.imwrite(pred_path, pred_dataset, photometric="minisblack")
    label_path = tmp_path / "labels" / f"{name}.zarr"
    create_volume(label_path, gt_stored.shape, np.uint8, (8, 8, 8))[:] = gt_stored
    return pred_path, label_path


def test_files_map_the_prediction_to_stored_values_and_write_the_csv(tmp_path):
    pred, gt = volumes()
    pred_dataset = SPEC.from_stored(pred)  # the prediction holds the dataset's values
    assert set(np.unique(pred_dataset)) == {0, 3, 7}
    p1, l1 = write_pair(tmp_path, pred_dataset, gt, "v1")
    p2, l2 = write_pair(tmp_path, SPEC.from_stored(gt), gt, "v2")  # a perfect prediction
    rows = evaluate_classes([p1, p2], [l1, l2], tmp_path / "evaluation", SPEC)
    assert [r for r in rows if r["id"] == "v1"] == [
        {"id": "v1", **r} for r in score_classes(pred, gt, SPEC)
    ]
    table = pd.read_csv(tmp_path / "evaluation" / "per_class.csv", dtype={"id": str})
    assert tuple(table.columns) == PER_CLASS_COLUMNS
    assert list(table["class"]) == ["bone", "vessel", "air", "mean"] * 2
    v2 = table[table["id"] == "v2"]
    assert (v2["dice"] == 1.0).all() and (v2["surface_dice"] == 1.0).all()
    v1 = table[(table["id"] == "v1") & (table["class"] == "bone")].iloc[0]
    assert (v1["value"], v1["gt_voxels"], v1["pred_voxels"]) == (3, 200, 100)
    assert math.isclose(v1["dice"], 2 / 3)
    assert table["value"].isna().tolist() == [False, False, False, True] * 2


def test_bad_files_are_one_line_errors_naming_them(tmp_path):
    pred, gt = volumes()
    # A prediction holding the ignored value (9) or an unknown one (5).
    for bad in (9, 5):
        wrong = SPEC.from_stored(pred)
        wrong[0, 0, 0] = bad
        p, lab = write_pair(tmp_path, wrong, gt, f"bad{bad}")
        with pytest.raises(CtsegError, match=rf"bad{bad}\.tif: prediction values \[{bad}\]"):
            score_class_files(p, lab, SPEC)
    # A label store in the dataset's values, not the stored ones (11 is no stored value).
    p, lab = write_pair(tmp_path, SPEC.from_stored(pred), SPEC.from_stored(gt), "unstored")
    with pytest.raises(CtsegError, match=r"unstored\.zarr: .*ctseg convert --kind label") as err:
        score_class_files(p, lab, SPEC)
    assert "\n" not in str(err.value)
    # Shapes that differ.
    p, _ = write_pair(tmp_path, SPEC.from_stored(pred), gt, "small")
    _, lab = write_pair(tmp_path, SPEC.from_stored(pred), np.zeros((8, 10, 12), np.uint8), "wide")
    with pytest.raises(CtsegError, match=r"shape mismatch: prediction .*small\.tif.*wide\.zarr"):
        score_class_files(p, lab, SPEC)
    with pytest.raises(CtsegError, match=r"missing\.zarr: "):
        score_class_files(p, tmp_path / "missing.zarr", SPEC)


def test_a_binary_mask_of_0_and_255_counts_as_foreground(tmp_path):
    pred, gt = np.zeros(SHAPE, np.uint8), np.zeros(SHAPE, np.uint8)
    gt[1:3] = 1
    pred[1:3] = 255
    p, lab = write_pair(tmp_path, pred, gt)
    rows = score_class_files(p, lab, KAGGLE)
    assert (rows[0]["dice"], rows[0]["pred_voxels"]) == (1.0, 200)


def test_evaluate_of_a_multi_class_dataset_writes_per_class_scores_and_summary(tmp_path):
    """`ctseg evaluate --dataset-plan` of a multi-class dataset: per_class.csv, and scores.csv
    and summary.json whose score is each volume's mean Dice over its classes."""
    import json

    from ctseg.cli import main
    from ctseg.plan import DatasetPlan, write_dataset_plan

    pred, gt = volumes()
    p1, l1 = write_pair(tmp_path, SPEC.from_stored(pred), gt, "v1")
    p2, l2 = write_pair(tmp_path, SPEC.from_stored(gt), gt, "v2")
    plan = tmp_path / "plans" / "dataset.json"
    write_dataset_plan(plan, DatasetPlan(SPEC, (1.0, 1.0, 1.0), "dataset.yaml"))
    out = tmp_path / "evaluation"
    argv = ["evaluate", "--predictions", str(p1), str(p2), "--labels", str(l1), str(l2)]
    assert main([*argv, "--out", str(out), "--dataset-plan", str(plan)]) == 0
    scores = pd.read_csv(out / "scores.csv", dtype={"id": str}).set_index("id")
    per_class = pd.read_csv(out / "per_class.csv", dtype={"id": str})
    means = per_class[per_class["class"] == "mean"].set_index("id")
    assert scores.loc["v2", "score"] == 1.0
    assert scores.loc["v1", "score"] == pytest.approx(means.loc["v1", "dice"])
    assert scores.loc["v1", "score"] < 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["classes"] == ["bone", "vessel", "air"] and summary["volumes"] == 2
    assert summary["mean_score"] == pytest.approx(scores["score"].mean())
