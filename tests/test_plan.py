"""The run plan (ctseg.plan) and its builder (ctseg.planning.build): typed, versioned, round
trips to the same frozen objects, a digest per section, and an anisotropic dataset's patch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import tifffile

from ctseg.config import load_experiment, load_phases
from ctseg.io import CtsegError
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.plan import (
    ISOTROPIC,
    PLAN_VERSION,
    DatasetPlan,
    RunPlan,
    read_dataset_plan,
    read_plan,
    write_dataset_plan,
    write_plan,
)
from ctseg.planning.build import dataset_plan, image_shapes_of, median_shape, run_plan

REPO = Path(__file__).resolve().parents[1]
PHASES = load_phases(REPO / "config" / "phases.yaml")
EXP001 = load_experiment(REPO / "config" / "experiments" / "exp001.yaml")


def plan_of(exp=EXP001, dataset=None, phase=0, shapes=((64, 96, 96),)) -> RunPlan:
    dataset = dataset or DatasetPlan(KAGGLE, ISOTROPIC, "isotropic")
    return run_plan(
        "exp001",
        exp,
        dataset,
        phase=phase,
        phases=PHASES,
        image_shapes=lambda: list(shapes),
        where="exp001.yaml",
    )


def test_a_plan_round_trips_to_the_same_frozen_objects(tmp_path) -> None:
    spec = LabelSpec({"background": 0, "papyrus": 10}, ignore=255)
    plan = plan_of(dataset=DatasetPlan(spec, (2.0, 1.0, 1.0), "dataset.yaml"), phase=6)
    path = tmp_path / "plan.json"
    assert write_plan(path, plan)
    back = read_plan(path)
    assert back == plan
    assert back.dataset.labels == spec and back.phase.settings == PHASES[6]
    assert back.phase.id == 6 and back.experiment == plan.experiment
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.run = "other"  # type: ignore[misc]
    # The same plan again leaves the file as it is; a changed one is written.
    stamp = path.stat().st_mtime_ns
    assert not write_plan(path, plan)
    assert path.stat().st_mtime_ns == stamp
    assert write_plan(path, plan_of(phase="auto"))
    assert read_plan(path).phase.configured == "auto" and read_plan(path).phase.settings is None


def test_a_section_digest_changes_with_its_section_only() -> None:
    base = plan_of(phase=0)
    other_phase = plan_of(phase=3)
    assert base.digest("experiment") == other_phase.digest("experiment")
    assert base.digest("dataset") == other_phase.digest("dataset")
    assert base.digest("phase") != other_phase.digest("phase")
    anisotropic = plan_of(dataset=DatasetPlan(KAGGLE, (2.0, 1.0, 1.0), "dataset.yaml"))
    assert anisotropic.digest("dataset") != base.digest("dataset")
    with pytest.raises(CtsegError, match="no section 'labels'"):
        base.digest("labels")


def test_damaged_missing_and_other_version_plans_are_one_line_each(tmp_path) -> None:
    path = tmp_path / "plan.json"
    with pytest.raises(CtsegError, match=r"plan.json: cannot read the run plan .*rerun snakemake"):
        read_plan(path)
    path.write_text("{not json")
    with pytest.raises(CtsegError, match=r"not valid JSON \(line 1\); delete it"):
        read_plan(path)
    data = plan_of().to_dict()
    path.write_text(json.dumps({**data, "version": PLAN_VERSION + 1}))
    with pytest.raises(CtsegError, match=rf"plan version {PLAN_VERSION + 1}, this ctseg reads"):
        read_plan(path)
    dataset = tmp_path / "dataset_plan.json"
    assert write_dataset_plan(dataset, DatasetPlan(KAGGLE, ISOTROPIC, "isotropic"))
    assert read_dataset_plan(dataset).labels == KAGGLE
    dataset.write_text(json.dumps({"version": PLAN_VERSION}))
    with pytest.raises(CtsegError, match="not a dataset plan"):
        read_dataset_plan(dataset)


def test_the_dataset_spacing_comes_from_dataset_yaml_then_tiff_tags_then_isotropic(
    tmp_path,
) -> None:
    tif = tmp_path / "images" / "1.tif"
    tif.parent.mkdir()
    tifffile.imwrite(
        tif,
        np.zeros((4, 8, 8), np.uint8),
        imagej=True,
        resolution=(1 / 0.5, 1 / 0.5),
        metadata={"spacing": 2.0, "unit": "um"},
    )
    assert dataset_plan(tmp_path, tif).spacing == (2.0, 0.5, 0.5)
    assert dataset_plan(tmp_path, tif).relative_spacing == (4.0, 1.0, 1.0)
    assert dataset_plan(tmp_path, None).spacing == ISOTROPIC  # the demo before its data job
    assert dataset_plan(tmp_path, tmp_path / "not_yet.tif").spacing == ISOTROPIC
    (tmp_path / "dataset.yaml").write_text(
        "labels: {background: 0, surface: 3}\nignore: 7\nspacing: [3, 1, 1]\n"
    )
    plan = dataset_plan(tmp_path, tif)
    assert plan.spacing == (3.0, 1.0, 1.0) and plan.spacing_source.endswith("dataset.yaml")
    assert plan.labels.foreground_values == (3,) and plan.labels.ignore == 7


def test_patch_auto_is_planned_from_the_spacing_and_the_median_shape() -> None:
    auto = load_experiment(REPO / "config" / "experiments" / "exp001.yaml")
    data = {**dict(auto["data"]), "patch_size": "auto", "patch_voxels": 64 * 64 * 64}
    from ctseg.config import experiment_from, thaw

    exp = experiment_from({**thaw(auto), "data": thaw(data)}, "auto.yaml")
    anisotropic = DatasetPlan(KAGGLE, (2.0, 1.0, 1.0), "dataset.yaml")
    shapes = [(160, 320, 320), (150, 300, 300), (170, 330, 330)]
    plan = plan_of(exp=exp, dataset=anisotropic, shapes=shapes)
    z, y, x = plan.patch.size
    assert plan.patch.planned and z * y * x <= 64**3
    assert z < y and z < x and abs(2 * z - y) <= 16  # physically about a cube: z half of y
    assert plan.patch.computed == plan.patch.size  # planned in multiples of the network's
    assert list(plan.experiment["data"]["patch_size"]) == [z, y, x]
    # The augmentation only swaps axes of equal spacing: the plan gives it the spacing.
    assert list(plan.experiment["data"]["augment"]["spacing"]) == [2.0, 1.0, 1.0]
    # An isotropic dataset leaves the experiment's augmentation as written (null: isotropic).
    iso = plan_of(exp=exp, shapes=shapes)
    assert iso.experiment["data"]["augment"]["spacing"] is None
    assert median_shape(shapes) == (160, 320, 320)


def test_an_experiment_may_not_set_the_datasets_spacing() -> None:
    from ctseg.config import experiment_from, thaw

    data = thaw(EXP001["data"])
    data["augment"]["spacing"] = [2, 1, 1]
    exp = experiment_from({**thaw(EXP001), "data": data}, "exp001.yaml")
    with pytest.raises(CtsegError, match=r"exp001.yaml: data.augment.spacing is the dataset's"):
        plan_of(exp=exp)


def test_image_shapes_come_from_the_tiff_headers(tmp_path) -> None:
    volume = tmp_path / "v.tif"
    tifffile.imwrite(volume, np.zeros((5, 6, 7), np.uint8))
    slices = tmp_path / "slices"
    slices.mkdir()
    for z in range(3):
        tifffile.imwrite(slices / f"{z:03d}.tif", np.zeros((6, 7), np.uint8))
    assert image_shapes_of([volume, slices]) == [(5, 6, 7), (3, 6, 7)]
    (tmp_path / "bad.tif").write_bytes(b"not a tiff")
    with pytest.raises(CtsegError, match=r"bad.tif: cannot read the TIFF header"):
        image_shapes_of([tmp_path / "bad.tif"])


def test_a_multi_class_plan_sets_the_output_channels_and_refuses_binary_terms() -> None:
    from ctseg.config import experiment_from, thaw

    spec = LabelSpec({"background": 0, "sheet": 10, "fibre": 20, "pore": 30}, ignore=255)
    dataset = DatasetPlan(spec, ISOTROPIC, "dataset.yaml")
    with pytest.raises(CtsegError, match=r"exp001.yaml: loss term 'bce' is for one foreground"):
        plan_of(dataset=dataset)  # exp001 trains bce, cldice, skel_recall and boundary
    weights = {"bce": 0.0, "cldice": 0.0, "skel_recall": 0.0, "boundary": 0.0, "ce": 1.0}
    exp = experiment_from(
        {**thaw(EXP001), "loss": {**thaw(EXP001["loss"]), "weights": weights}}, "mc.yaml"
    )
    plan = plan_of(exp=exp, dataset=dataset)
    assert plan.experiment["model"]["out_channels"] == 4  # background and three classes
    assert plan_of().experiment["model"]["out_channels"] == 1  # binary


def test_a_step_refuses_a_missing_plan_and_plan_with_experiment_in_one_line(
    tmp_path, capsys
) -> None:
    from ctseg.cli import main

    missing = tmp_path / "plans" / "exp001.json"
    assert main(["train", "--plan", str(missing)]) == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        f"ctseg train: error: {missing}: cannot read the run plan (No such file or directory); "
        "the workflow writes it: rerun snakemake"
    )
    write_plan(missing, plan_of())
    both = ["--plan", str(missing), "--experiment", str(REPO / "config/experiments/exp001.yaml")]
    rest = ["--phases", str(REPO / "config/phases.yaml"), "--phase", "0", "--scratch", "s"]
    rest += ["--split", "s.csv", "--out", "o"]
    assert main(["trial", *both, *rest]) == 2
    assert capsys.readouterr().err.strip() == (
        "ctseg trial: error: give --plan or --experiment (with --fold), not both"
    )
    assert main(["trial", *rest]) == 2
    assert "give --experiment (config/experiments/<name>.yaml) or --plan" in capsys.readouterr().err


def test_regions_are_refused_at_planning_not_ignored(tmp_path) -> None:
    (tmp_path / "dataset.yaml").write_text(
        "labels: {background: 0, a: 1, b: 2}\nregions: {ab: [a, b]}\n"
    )
    with pytest.raises(CtsegError, match=r"dataset.yaml: regions: region-based training .* is "):
        dataset_plan(tmp_path, None)
