"""Post-processing tuned by the competition score: the search, its outputs, and the workflow."""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile
import yaml
import zarr
from conftest import TINY_CONFIG, TINY_EXPERIMENT, copy_workflow, run_snakemake

from ctseg import cli, tuning
from ctseg.io import CtsegError
from ctseg.masks import PostprocessSettings, binary_mask, hysteresis
from ctseg.metrics import score_volume
from ctseg.store import create_volume

NOISE_BLOBS = [(12, 5, 5), (12, 20, 10), (26, 10, 20), (2, 15, 15)]


def surface_case(directory: Path, name: str, seed: int) -> tuning.Volume:
    """Two sheets whose probabilities are compressed to [0.32, 0.45] over a background in
    [0, 0.25], plus two-voxel blobs at 0.42: 0.5 finds nothing, and no threshold alone removes
    the blobs (hysteresis cannot either: they reach as high as the sheets)."""
    rng = np.random.default_rng(seed)
    label = np.zeros((32, 32, 32), np.uint8)
    label[6:8, 2:30, 2:30] = 1
    label[18:20, 2:30, 2:30] = 1
    label[:, :, 29:] = 2  # ignored: what is predicted there does not count
    probs = rng.uniform(0.0, 0.25, label.shape)
    surface = label == 1
    probs[surface] = rng.uniform(0.32, 0.45, int(surface.sum()))
    for z, y, x in NOISE_BLOBS:
        probs[z, y, x : x + 2] = 0.42
    store = directory / f"{name}.zarr"
    create_volume(store, probs.shape, np.float16, (16, 16, 16))[...] = probs.astype(np.float16)
    tifffile.imwrite(directory / f"{name}.tif", label)
    return tuning.Volume(name, store, directory / f"{name}.tif")


def test_competition_score_is_score_volumes_score():
    rng = np.random.default_rng(1)
    gt = rng.choice([0, 1, 2], size=(20, 18, 16), p=[0.6, 0.2, 0.2]).astype(np.uint8)
    pred = (rng.random(gt.shape) < 0.25).astype(np.uint8)
    ours = tuning.competition_score(pred, gt)
    reference = score_volume(pred, gt)
    for term in tuning.SCORE_TERMS:
        assert ours[term] == reference[term], term
    assert 0 < ours["score"] < 1


def test_hysteresis_keeps_weak_voxels_connected_to_strong_ones():
    probs = np.zeros((6, 6, 12), np.float32)
    probs[2, 2, 0:5] = [0.9, 0.4, 0.4, 0.4, 0.4]  # a weak tail on a strong voxel: kept
    probs[2, 2, 7:10] = 0.4  # weak on its own: dropped
    probs[3, 3, 5] = 0.4  # touches the tail at a corner only (26-connected): kept
    mask = hysteresis(probs, 0.3, 0.8)
    assert mask[2, 2, 0:5].all() and mask[3, 3, 5] == 1
    assert not mask[2, 2, 7:10].any() and mask.sum() == 6


def test_search_picks_the_best_candidate_where_0_5_is_wrong(tmp_path: Path):
    volumes = [surface_case(tmp_path, "a", 0), surface_case(tmp_path, "b", 1)]
    summary = tuning.tune_postprocess(volumes, tmp_path / "out")

    table = pd.read_csv(tmp_path / "out" / "candidates.csv")
    chosen = table[table["chosen"]]
    assert len(chosen) == 1
    assert summary["candidates"] == len(table) <= tuning.SearchSpace().max_candidates() == 20
    # The choice is the best candidate scored, and the first of equals (the simplest).
    assert chosen["score"].iloc[0] == table["score"].max()
    assert chosen.index[0] == table.index[table["score"] == table["score"].max()][0]
    # The default threshold 0.5 predicts nothing here; the tuned settings recover the sheets.
    default = table[(table["threshold"] == 0.5) & (table["stage"] == "threshold")]
    assert summary["default"]["score"] == pytest.approx(default["score"].iloc[0])
    assert summary["score"] == pytest.approx(1.0)
    assert summary["gain_over_default"] > 0.3
    settings = PostprocessSettings(**summary["settings"])
    assert 0.25 <= settings.threshold < 0.32
    assert settings.min_component_voxels > 2  # the blobs survive every threshold and hysteresis
    # What tuned.json says is what the chosen settings score, recomputed from scratch.
    for volume in volumes:
        probs = zarr.open_array(str(volume.probabilities), mode="r")[:]
        mask, _ = binary_mask(probs, settings)
        recomputed = tuning.competition_score(mask, tifffile.imread(volume.label))
        assert recomputed["score"] == pytest.approx(chosen[f"score_{volume.id}"].iloc[0])
    on_disk = json.loads((tmp_path / "out" / "tuned.json").read_text())
    assert on_disk["settings"] == summary["settings"]
    assert tuning.load_tuned(tmp_path / "out" / "tuned.json") == settings


def test_parallel_search_equals_serial(tmp_path: Path):
    volumes = [surface_case(tmp_path, "a", 0), surface_case(tmp_path, "b", 3)]
    space = tuning.SearchSpace(thresholds=(0.3, 0.6), min_component_voxels=(16,))
    serial = tuning.tune_postprocess(volumes, tmp_path / "serial", space)
    parallel = tuning.tune_postprocess(volumes, tmp_path / "parallel", space, workers=2)
    assert parallel["settings"] == serial["settings"]
    pd.testing.assert_frame_equal(
        pd.read_csv(tmp_path / "parallel" / "candidates.csv"),
        pd.read_csv(tmp_path / "serial" / "candidates.csv"),
    )


def test_outputs_are_written_atomically(tmp_path: Path, monkeypatch):
    volumes = [surface_case(tmp_path, "a", 0)]
    out = tmp_path / "out"
    space = tuning.SearchSpace(thresholds=(0.3,), hysteresis_offsets=(), min_component_voxels=())
    tuning.tune_postprocess(volumes, out, space)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["candidates.csv", "tuned.json"]

    # A search that fails half way (a label of the wrong shape) leaves the old outputs exactly
    # as they were and no temporary file beside them.
    tifffile.imwrite(tmp_path / "bad.tif", np.zeros((8, 8, 8), np.uint8))
    bad = tuning.Volume("bad", volumes[0].probabilities, tmp_path / "bad.tif")
    with pytest.raises(CtsegError, match="shape mismatch"):
        tuning.tune_postprocess([volumes[0], bad], out, space)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    # A failure while writing: neither file changes (both go to temporaries first).
    def failing_dumps(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tuning.json, "dumps", failing_dumps)
    with pytest.raises(OSError, match="disk full"):
        tuning.tune_postprocess(volumes, out, tuning.SearchSpace(thresholds=(0.4,)))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_postprocess_command_applies_the_tuned_settings(tmp_path: Path, capsys):
    volume = surface_case(tmp_path, "a", 0)
    tuned = tmp_path / "tuned"
    assert (
        cli.main(
            [
                "tune-postprocess",
                "--probabilities",
                str(volume.probabilities),
                "--labels",
                str(volume.label),
                "--out",
                str(tuned),
                "--thresholds",
                "0.3",
                "0.5",
                "--hysteresis-offsets",
                "--min-component-voxels",
                "16",
            ]
        )
        == 0
    )
    summary = json.loads((tuned / "tuned.json").read_text())
    assert summary["candidates"] == 2 + 2 + 1 + 1  # two thresholds, refine, size, fill
    mask_path = tmp_path / "a.tif"
    assert (
        cli.main(
            [
                "postprocess",
                str(volume.probabilities),
                str(mask_path),
                "--settings",
                str(tuned / "tuned.json"),
            ]
        )
        == 0
    )
    probs = zarr.open_array(str(volume.probabilities), mode="r")[:]
    expected, _ = binary_mask(probs, PostprocessSettings(**summary["settings"]))
    np.testing.assert_array_equal(tifffile.imread(mask_path), expected)
    assert not np.array_equal(expected, (probs > 0.5).astype(np.uint8))

    # A broken settings file is a one-line error naming it.
    (tmp_path / "broken.json").write_text('{"settings": {"threshold": 0.3}}')
    capsys.readouterr()
    assert (
        cli.main(
            [
                "postprocess",
                str(volume.probabilities),
                str(tmp_path / "b.tif"),
                "--settings",
                str(tmp_path / "broken.json"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "broken.json" in err and "missing" in err and "\n" not in err
    assert not (tmp_path / "b.tif").exists()


def test_bad_search_space_is_refused():
    with pytest.raises(CtsegError, match="thresholds"):
        tuning.SearchSpace(thresholds=(0.5, 1.0))
    with pytest.raises(CtsegError, match="min_component_voxels"):
        tuning.SearchSpace(min_component_voxels=(0,))
    with pytest.raises(CtsegError, match="hysteresis_high"):
        PostprocessSettings(threshold=0.5, hysteresis_high=0.4)


# ----------------------------------------------------------------------------- the workflow
def test_fixed_postprocess_bypasses_the_search(tmp_path: Path):
    config = dict(
        TINY_CONFIG,
        infer={
            "postprocess": "fixed",
            "threshold": 0.35,
            "min_component_voxels": 8,
            "fill_holes": True,
        },
    )
    workdir = copy_workflow(tmp_path, config)
    proc = run_snakemake(workdir, "-n", "-p", "--config", "experiment=tiny")
    out = proc.stdout + proc.stderr
    assert "tune_postprocess" not in out
    assert "--threshold 0.35 --min-component-voxels 8 --fill-holes" in out
    assert "--settings" not in out
    # Only the test volume is inferred: the val split's probabilities serve only the search.
    assert out.count("rule infer:") == TINY_CONFIG["demo"]["n_test"]


@pytest.mark.slow
def test_workflow_tunes_on_val_and_applies_it_to_test_volumes(tmp_path: Path):
    """A real run of the tiny workflow to the report: the val record's probabilities are
    searched, the test volume's mask uses the choice, and the report shows it."""
    experiment = dict(TINY_EXPERIMENT, trial=dict(TINY_EXPERIMENT["trial"], phases=[0]))
    config = dict(
        TINY_CONFIG,
        infer={
            "tune": {
                "thresholds": [0.3, 0.5],
                "hysteresis_offsets": [0.1],
                "min_component_voxels": [16],
            }
        },
    )
    workdir = copy_workflow(tmp_path, config)
    (workdir / "config" / "experiments" / "tiny.yaml").write_text(yaml.safe_dump(experiment))
    run_snakemake(workdir, "--config", "experiment=tiny", "phase=0")

    results = workdir / "results" / "tiny"
    split = pd.read_csv(results / "split.csv", dtype={"id": str})
    val_ids = list(split.loc[split["split"] == "val", "id"])
    tuned = json.loads((results / "postprocess" / "tuned.json").read_text())
    assert tuned["volumes"] == val_ids and tuned["topo_method"] == "betti_matching"
    candidates = pd.read_csv(results / "postprocess" / "candidates.csv")
    assert len(candidates) == tuned["candidates"] <= 2 + 2 + 2 + 1 + 1
    assert candidates.loc[candidates["chosen"], "score"].iloc[0] == candidates["score"].max()

    settings = PostprocessSettings(**tuned["settings"])
    test_ids = pd.read_csv(workdir / "resources/demo/test.csv", dtype={"id": str})["id"]
    for record_id in test_ids:
        probs = zarr.open_array(str(results / "probabilities" / f"{record_id}.zarr"), mode="r")
        expected, _ = binary_mask(probs[:], settings)
        mask = tifffile.imread(results / "predictions" / f"{record_id}.tif")
        np.testing.assert_array_equal(mask, expected)
    # The val record is predicted only as probabilities, for the search.
    assert all((results / "probabilities" / f"{i}.zarr").is_dir() for i in val_ids)
    assert not any((results / "predictions" / f"{i}.tif").exists() for i in val_ids)

    page = (workdir / "results" / "report.html").read_text()
    assert "results/tiny/postprocess/tuned.json" in page
    assert html.escape(settings.label()) in page  # "t>0.3 ..." is escaped in the page
    assert "Gain over the default" in page
    assert sorted(p.name for p in (results / "postprocess").iterdir()) == [
        "candidates.csv",
        "tuned.json",
    ]


# ----------------------------------------------------------------------------- no foreground
@pytest.mark.parametrize("foreground", [0, 40])
def test_val_split_without_enough_foreground_keeps_the_defaults(tmp_path: Path, foreground):
    """Issue 19: with no (or too little) labelled surface the search would fit noise; it is not
    run, and tuned.json, the log and the report say why."""
    from ctseg.report import postprocess as report_postprocess
    from ctseg.report.markup import Sources

    volumes = []
    for name, seed in (("a", 0), ("b", 1)):
        volume = surface_case(tmp_path, name, seed)
        label = tifffile.imread(volume.label)
        label[label == 1] = 0
        if name == "a":
            label[10, 10, 10 : 10 + foreground] = 1
        tifffile.imwrite(volume.label, label)
        volumes.append(volume)
    summary = tuning.tune_postprocess(volumes, tmp_path / "out")
    assert summary["tuned"] is False and summary["candidates"] == 0
    assert summary["settings"] == tuning.DEFAULT_SETTINGS.as_dict()
    assert str(tuning.MIN_FOREGROUND_VOXELS) in summary["reason"] or foreground == 0
    assert ("no labelled foreground" in summary["reason"]) == (foreground == 0)
    on_disk = json.loads((tmp_path / "out" / "tuned.json").read_text())
    assert on_disk["reason"] == summary["reason"]
    assert tuning.load_tuned(tmp_path / "out" / "tuned.json") == tuning.DEFAULT_SETTINGS
    assert pd.read_csv(tmp_path / "out" / "candidates.csv").empty

    page = report_postprocess.postprocess_section(tmp_path / "out", Sources(tmp_path))
    assert "Not tuned" in page and html.escape(summary["reason"]) in page


def test_cli_logs_why_it_did_not_tune(tmp_path: Path, capsys):
    volume = surface_case(tmp_path, "a", 0)
    label = tifffile.imread(volume.label)
    tifffile.imwrite(volume.label, np.where(label == 1, 0, label))
    argv = ["tune-postprocess", "--probabilities", str(volume.probabilities)]
    assert cli.main([*argv, "--labels", str(volume.label), "--out", str(tmp_path / "o")]) == 0
    assert "not tuned, default settings kept: no labelled foreground" in capsys.readouterr().err


# ----------------------------------------------------------------------------- same choice
def test_search_chooses_as_the_previous_scorer(tmp_path: Path):
    """Tuning reuses the label's side and shares tiles and masks between candidates; every
    candidate still scores exactly what the previous path (score_volume's reference
    implementation, a fresh score per candidate) gives, so the same candidate is chosen."""
    volumes = [surface_case(tmp_path, "a", 4), surface_case(tmp_path, "b", 5)]
    space = tuning.SearchSpace(thresholds=(0.3, 0.4, 0.5), hysteresis_offsets=(0.1,))
    best, candidates = tuning.search(volumes, space)
    reference = {}
    for c in candidates:
        scores = []
        for volume in volumes:
            probs = zarr.open_array(str(volume.probabilities), mode="r")[:]
            mask, _ = binary_mask(probs, c.settings)
            label = tifffile.imread(volume.label)
            ref = score_volume(mask, label, implementation="reference")
            assert c.scores[volume.id]["score"] == pytest.approx(ref["score"], abs=1e-12)
            scores.append(ref["score"])
        reference[c.settings] = float(np.mean(scores))
    assert best.settings.label() == "t>0.3 min 16"
    assert reference[best.settings] == max(reference.values())
