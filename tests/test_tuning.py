"""Post-processing tuned by the competition score: the search, its outputs, and the workflow."""

from __future__ import annotations

import dataclasses
import html
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile
import yaml
import zarr
from conftest import TINY_CONFIG, TINY_EXPERIMENT, copy_workflow, run_snakemake

from ctseg import cli
from ctseg.evaluation.metrics import score_volume
from ctseg.io import CtsegError
from ctseg.postprocess import tuning
from ctseg.postprocess.commands import fixed_postprocess
from ctseg.postprocess.masks import PostprocessSettings, binary_mask, hysteresis
from ctseg.store import create_volume
from ctseg.training.checkpoint import stored_digest

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
    assert summary["candidates"] == len(table) <= tuning.SearchSpace().max_candidates() == 32
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
    # Two thresholds, refine, the fixed hysteresis pair in 3D and along z, a size, 3D fill, two
    # plugging areas, two patching areas, two closing radii.
    assert summary["candidates"] == 2 + 2 + 2 + 1 + 1 + 2 + 2 + 2
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
def shell_args(dry_run: str, command: str):
    """The first `ctseg <command>` of a dry run's printed shell commands, parsed by the CLI."""
    line = next(x for x in dry_run.splitlines() if f"ctseg {command} " in x)
    words = shlex.split(line.split("ctseg ", 1)[1].split(" > ")[0])
    return cli.build_parser().parse_args(words)


FIXED_LATER_STEPS = {
    "hysteresis_high": 0.8,
    "hysteresis_mode": "z",
    "plug_holes_max_area": 64,
    "closing_radius": 1,
}


# The later steps' run is a second snakemake dry run (about 6 s): in the slow tier.
@pytest.mark.parametrize(
    "later",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["four-settings", "later-steps"],
)
def test_fixed_postprocess_bypasses_the_search(tmp_path: Path, later):
    infer = {"postprocess": "fixed", "threshold": 0.35, "min_component_voxels": 8}
    infer.update(fill_holes=True, **(FIXED_LATER_STEPS if later else {}))
    workdir = copy_workflow(tmp_path, dict(TINY_CONFIG, infer=infer))
    proc = run_snakemake(workdir, "-n", "-p", "--config", "experiment=tiny")
    out = proc.stdout + proc.stderr
    assert "tune_postprocess" not in out
    if later:
        options = "--threshold 0.35 --hysteresis-high 0.8 --min-component-voxels 8 --fill-holes "
        options += "--hysteresis-mode z --plug-holes-max-area 64 --closing-radius 1"
        # The settings `ctseg postprocess` makes of the command line (an option not given
        # takes PostprocessSettings' default).
        settings = fixed_postprocess(shell_args(out, "postprocess"))
        assert (settings.hysteresis_mode, settings.plug_holes_max_area) == ("z", 64)
        assert (settings.patch_holes_max_area, settings.closing_radius) == (0, 1)
    else:
        # The later steps off: the command line the rule always had.
        options = "--threshold 0.35 --min-component-voxels 8 --fill-holes >"
    assert options in out
    assert "--settings" not in out
    # Only the test volume is inferred: the val split's probabilities serve only the search.
    assert out.count("rule infer:") == TINY_CONFIG["demo"]["n_test"]


@pytest.mark.slow
def test_the_rule_searches_the_default_space_of_32(tmp_path: Path):
    """The schema's infer.tune defaults reach `ctseg tune-postprocess` as the default space."""
    workdir = copy_workflow(tmp_path, TINY_CONFIG)
    out = run_snakemake(workdir, "-n", "-p", "--config", "experiment=tiny").stdout
    args = shell_args(out, "tune-postprocess")
    assert args.hysteresis_pairs == [(0.5, 0.9)] and args.hysteresis_modes == ["3d", "z"]
    assert (args.plug_holes_max_area, args.patch_holes_max_area) == ([16, 64], [256, 1024])
    assert args.closing_radii == [1, 2]
    space = tuning.SearchSpace(
        **{
            k: tuple(getattr(args, k))
            for k in tuning.SearchSpace.__dataclass_fields__
            if k not in ("refine_step", "fill_holes")
        },
        refine_step=args.refine_step,
        fill_holes=not args.no_fill_holes,
    )
    assert space == tuning.SearchSpace() and space.max_candidates() == 32


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
    # Which weights it was tuned for: what ctseg predict checks it against.
    assert tuned["made_with"] == {
        "weights_sha256": [stored_digest(results / "last.pt")],
        "ensemble_weights": None,
    }
    candidates = pd.read_csv(results / "postprocess" / "candidates.csv")
    # Two thresholds, refine, (2 offset pairs + the fixed pair) x 2 modes, a size, fill, and the
    # default plugging, patching and closing.
    assert tuned["search"]["max_candidates"] == 2 + 2 + 6 + 1 + 1 + 2 + 2 + 2
    assert len(candidates) == tuned["candidates"] <= tuned["search"]["max_candidates"]
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
    # The stages of plugging, patching and closing off: every candidate here is scored twice
    # over, and their exact scores are checked in test_search_chooses_plugging_...
    space = tuning.SearchSpace(
        thresholds=(0.3, 0.4, 0.5),
        hysteresis_offsets=(0.1,),
        plug_holes_max_area=(),
        patch_holes_max_area=(),
        closing_radii=(),
    )
    best, candidates = tuning.search(volumes, space)
    assert {c.settings.hysteresis_mode for c in candidates if c.stage == "hysteresis"} == {
        "3d",
        "z",
    }
    reference = {}
    for c in candidates:
        scores = []
        for volume in volumes:
            probs = zarr.open_array(str(volume.probabilities), mode="r")[:]
            mask, _ = binary_mask(probs, c.settings)
            label = tifffile.imread(volume.label)
            ref = score_volume(mask, label, implementation="reference")
            # Every candidate's bound is at least its exact score, volume by volume.
            assert c.bounds[volume.id]["score"] >= ref["score"] - 1e-12
            if not c.pruned:
                assert c.scores[volume.id]["score"] == pytest.approx(ref["score"], abs=1e-12)
            scores.append(ref["score"])
        reference[c.settings] = float(np.mean(scores))
    assert best.settings.label() == "t>0.3 min 16"
    assert reference[best.settings] == max(reference.values())
    # Pruned candidates (never scored exactly) score below the chosen one.
    pruned = [c for c in candidates if c.pruned]
    assert all(reference[c.settings] < reference[best.settings] for c in pruned)


def test_pruning_chooses_what_scoring_every_candidate_chooses(tmp_path: Path, monkeypatch):
    """A candidate whose bound (TopoScore with m_k = min(p_k, g_k)) is below a score already
    found is not scored exactly; the search still picks the candidate, and the mean, that
    scoring every candidate picks."""
    volumes = [surface_case(tmp_path, "a", 6), surface_case(tmp_path, "b", 7)]
    space = tuning.SearchSpace(**tuning.WINNERS_STAGES_OFF)
    best, candidates = tuning.search(volumes, space)
    monkeypatch.setattr(tuning, "PRUNE_MARGIN", math.inf)  # nothing is pruned
    full_best, full = tuning.search(volumes, space)
    assert not any(c.pruned for c in full)
    # The low thresholds' masks are noise: their many loops and cavities sink the bound.
    pruned = [c for c in candidates if c.pruned]
    assert {c.settings.threshold for c in pruned} >= {0.1, 0.2}
    assert best.settings == full_best.settings and best.mean() == full_best.mean()
    exact = {c.settings: c.mean() for c in full}
    assert set(exact) == {c.settings for c in candidates}
    for c in candidates:
        assert c.bound() >= exact[c.settings]
        if c.pruned:
            assert exact[c.settings] < best.mean() and math.isnan(c.mean())
        else:
            assert c.mean() == exact[c.settings]
    default = next(c for c in candidates if c.settings == tuning.DEFAULT_SETTINGS)
    assert not default.pruned  # tuned.json's gain over the default needs its exact score


def test_pruned_candidates_are_listed_with_their_bound(tmp_path: Path):
    """candidates.csv keeps a pruned candidate: its bound, no score; tuned.json and the log
    count them, and the report says what pruning means."""
    from ctseg.report import postprocess as report_postprocess
    from ctseg.report.markup import Sources

    volumes = [surface_case(tmp_path, "a", 6)]
    space = tuning.SearchSpace(
        thresholds=(0.1, 0.2, 0.3), hysteresis_offsets=(), min_component_voxels=(16,)
    )
    summary = tuning.tune_postprocess(volumes, tmp_path / "out", space)
    table = pd.read_csv(tmp_path / "out" / "candidates.csv")
    pruned = table[table["pruned"]]
    assert summary["pruned"] == len(pruned) >= 1
    assert pruned["score"].isna().all() and pruned["score_a"].isna().all()
    assert (pruned["score_bound"] < table["score"].max()).all()
    scored = table[~table["pruned"]]
    assert (scored["score_bound"] >= scored["score"]).all() and scored["score"].notna().all()
    page = report_postprocess.postprocess_section(tmp_path / "out", Sources(tmp_path))
    assert f"{len(pruned)} of {len(table)} candidates were pruned" in page


# ----------------------------------------------------------------------------- the winners' steps
def sheet_case(directory: Path, name: str, probs: np.ndarray, label: np.ndarray) -> tuning.Volume:
    """A hand-built volume: these probabilities (float16, as infer stores them) and label."""
    store = directory / f"{name}.zarr"
    create_volume(store, probs.shape, np.float16, (16, 16, 16))[...] = probs.astype(np.float16)
    tifffile.imwrite(directory / f"{name}.tif", label.astype(np.uint8))
    return tuning.Volume(name, store, directory / f"{name}.tif")


def flat_sheet(shape=(32, 32, 32)) -> tuple[np.ndarray, np.ndarray]:
    """A label with a sheet two voxels thick across z 10-11, and probabilities 0.95 on it over a
    background of 0.02: any threshold recovers the sheet, and nothing else. Its edges are 4
    voxels from the volume's faces: `masks.close` extends a mask within r of a face to the
    face (its erosion counts the outside as mask)."""
    label = np.zeros(shape, np.uint8)
    label[10:12, 4:28, 4:28] = 1
    return np.where(label == 1, 0.95, 0.02), label


def only_new_stage(stage: str) -> tuning.SearchSpace:
    """The default search with every other new stage off (each test shows its own stage)."""
    off = tuning.WINNERS_STAGES_OFF
    default = tuning.SearchSpace()
    on = {
        "hysteresis": ("hysteresis_pairs", "hysteresis_modes"),
        "plug_holes": ("plug_holes_max_area",),
        "patch_holes": ("patch_holes_max_area",),
        "closing": ("closing_radii",),
    }[stage]
    return tuning.SearchSpace(**{**off, **{k: getattr(default, k) for k in on}})


def test_default_search_is_32_candidates_a_volume_and_says_so(tmp_path: Path, capsys):
    space = tuning.SearchSpace()
    assert space.stage_bounds() == {
        "threshold": 9,
        "refine": 2,
        "hysteresis": 10,
        "min_component": 4,
        "fill_holes": 1,
        "plug_holes": 2,
        "patch_holes": 2,
        "closing": 2,
    }
    assert space.max_candidates() == 32
    # `ctseg tune-postprocess --help` says the default bound, stage by stage.
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["tune-postprocess", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "at most 32 candidates per volume" in help_text
    assert "(threshold 9 + refine 2 + hysteresis 10 + min_component 4 + fill_holes 1 + " in (
        help_text
    )
    assert space.describe().split("(")[1] in help_text
    # The new stages off: the search before them, 20.
    assert only_new_stage("plug_holes").max_candidates() == 22
    old = tuning.SearchSpace(**tuning.WINNERS_STAGES_OFF)
    assert old.max_candidates() == 20

    # A run's bound is in its log, tuned.json and candidates.csv, and the run stays within it.
    probs, label = flat_sheet()
    probs[10:12, 12:17, 12:17] = 0.02  # a 5 x 5 hole (plugging fills it)
    volume = sheet_case(tmp_path, "a", probs, label)
    argv = ["tune-postprocess", "--probabilities", str(volume.probabilities)]
    argv += ["--labels", str(volume.label), "--out", str(tmp_path / "o")]
    argv += ["--topo-method", "betti_counts", "--thresholds", "0.5", "--closing-radii", "1"]
    capsys.readouterr()
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    bound = "at most 23 candidates per volume (threshold 1 + refine 2 + hysteresis 10 + "
    assert bound in err
    assert "closing 1)" in err and "candidates scored of at most 23" in err
    summary = json.loads((tmp_path / "o" / "tuned.json").read_text())
    assert summary["search"]["max_candidates"] == 23
    assert summary["search"]["stage_bounds"]["closing"] == 1
    assert summary["search"]["closing_radii"] == [1]
    table = pd.read_csv(tmp_path / "o" / "candidates.csv")
    assert (table["max_candidates"] == 23).all()
    assert len(table) == summary["candidates"] <= 23
    for stage, bound in summary["search"]["stage_bounds"].items():
        assert (table["stage"] == stage).sum() <= bound, stage


def test_search_chooses_plugging_for_a_hole_the_label_fills(tmp_path: Path):
    """A sheet predicted with a 5 x 5 hole that the label has filled: no threshold, hysteresis,
    component removal, 3D fill (the hole is open on both sides of the sheet) can fill it; per-
    slice plugging does, and the score is the exact one of that mask."""
    probs, label = flat_sheet()
    probs[10:12, 12:17, 12:17] = 0.02
    volume = sheet_case(tmp_path, "a", probs, label)
    summary = tuning.tune_postprocess([volume], tmp_path / "out", only_new_stage("plug_holes"))
    chosen = tuning.load_tuned(tmp_path / "out" / "tuned.json")
    assert chosen.plug_holes_max_area == 64  # 16 is too small for the 25-voxel hole
    assert (chosen.closing_radius, chosen.patch_holes_max_area, chosen.fill_holes) == (0, 0, False)
    table = pd.read_csv(tmp_path / "out" / "candidates.csv")
    before = table.loc[table["stage"] != "plug_holes", "score"].max()
    assert before < 1 and summary["score"] == 1.0
    mask, counts = binary_mask(probs.astype(np.float16), chosen)
    assert counts["plugged_voxels"] == 2 * 25
    exact = tuning.competition_score(mask, label)  # Betti matching, from scratch
    assert summary["score"] == exact["score"]
    assert summary["terms"] == {t: exact[t] for t in tuning.SCORE_TERMS[1:]}


def test_search_chooses_patching_for_a_large_hole_inside_a_sheet(tmp_path: Path):
    probs, label = flat_sheet()
    probs[10:12, 10:22, 10:22] = 0.02  # 144 voxels a slice: more than plugging's 64
    volume = sheet_case(tmp_path, "a", probs, label)
    space = dataclasses.replace(only_new_stage("patch_holes"), plug_holes_max_area=(16, 64))
    best, candidates = tuning.search([volume], space, topo_method="betti_counts")
    assert best.settings.label() == "t>0.1 patch 256"
    assert best.mean() == 1.0
    assert max(c.mean() for c in candidates if c.stage != "patch_holes") < 1
    # Plugging was tried (and did nothing), so patching started from "no plugging".
    assert {c.settings.plug_holes_max_area for c in candidates if c.stage == "plug_holes"} == {
        16,
        64,
    }


@pytest.mark.parametrize("width, radius", [(2, 1), (3, 2)])
def test_search_chooses_the_closing_that_closes_a_crack(tmp_path: Path, width, radius):
    """A crack across the whole sheet (open at both ends: no plugging fills it) of `width`
    voxels: a closing of radius r closes cracks of up to 2r voxels."""
    probs, label = flat_sheet()
    probs[10:12, 4:28, 14 : 14 + width] = 0.02
    volume = sheet_case(tmp_path, "a", probs, label)
    space = dataclasses.replace(only_new_stage("closing"), plug_holes_max_area=(64,))
    best, candidates = tuning.search([volume], space, topo_method="betti_counts")
    assert best.settings.closing_radius == radius and best.stage == "closing"
    assert best.mean() == 1.0
    assert max(c.mean() for c in candidates if c.stage != "closing") < 1


def test_search_chooses_hysteresis_along_z(tmp_path: Path):
    """A sheet crossing the z-slices (x 15-16), confident on half of each slice's line and weak
    (0.65) on the other half, and a weak flap that is no surface above it (z 22-25), touching it
    only through the slice below: 3D hysteresis keeps the flap (it touches confident surface),
    any threshold that drops the flap drops the weak surface; hysteresis along z keeps the weak
    half (confident in its own slice) and drops the flap (nothing confident in its slices)."""
    label = np.zeros((32, 32, 32), np.uint8)
    label[2:22, 2:30, 15:17] = 1
    probs = np.full(label.shape, 0.02)
    probs[2:22, 2:16, 15:17] = 0.95
    probs[2:22, 16:30, 15:17] = 0.65
    probs[22:26, 2:30, 15:17] = 0.65
    volume = sheet_case(tmp_path, "a", probs, label)
    space = only_new_stage("hysteresis")
    summary = tuning.tune_postprocess([volume], tmp_path / "out", space, topo_method="betti_counts")
    chosen = tuning.load_tuned(tmp_path / "out" / "tuned.json")
    assert (chosen.threshold, chosen.hysteresis_high, chosen.hysteresis_mode) == (0.5, 0.9, "z")
    assert chosen.label() == "t>0.5 hyst-z 0.9"
    assert summary["score"] == 1.0
    table = pd.read_csv(tmp_path / "out" / "candidates.csv")
    three_d = table[(table["stage"] == "hysteresis") & (table["hysteresis_mode"] == "3d")]
    # From t 0.1 (the first of the equal thresholds): (0.1, 0.2), (0.1, 0.3) and (0.5, 0.9).
    assert len(three_d) == 3 and three_d["score"].max() < 1
    # The same pair in 3D was scored, and is worse.
    pair_3d = three_d[(three_d["threshold"] == 0.5) & (three_d["hysteresis_high"] == 0.9)]
    assert len(pair_3d) == 1 and pair_3d["score"].iloc[0] < 1


def test_later_stages_keep_what_earlier_stages_chose(tmp_path: Path):
    """Each stage starts from the whole best so far (dataclasses.replace): a z-mode hysteresis
    and a plugging area chosen early are kept by every later candidate."""
    best = PostprocessSettings(0.3, 0.9, 16, True, "z", 64, 0, 0)
    space = tuning.SearchSpace()
    for stage in tuning.STAGES[1:]:
        for s in tuning._stage_candidates(stage, best, space):
            changed = {k for k, v in s.as_dict().items() if v != best.as_dict()[k]}
            allowed = {
                "refine": {"threshold"},
                "hysteresis": {"threshold", "hysteresis_high", "hysteresis_mode"},
                "min_component": {"min_component_voxels"},
                "fill_holes": {"fill_holes"},
                "plug_holes": {"plug_holes_max_area"},
                "patch_holes": {"patch_holes_max_area"},
                "closing": {"closing_radius"},
            }[stage]
            assert changed <= allowed, (stage, s)
    # Patching only above the plugging area chosen (up to it every hole is already filled).
    patch = tuning._stage_candidates(
        "patch_holes", dataclasses.replace(best, plug_holes_max_area=256), space
    )
    assert [s.patch_holes_max_area for s in patch] == [1024]


def test_with_the_new_stages_off_the_search_is_the_previous_one(tmp_path: Path):
    """On the fixed volumes of the earlier tests (where 0.5 is wrong, a threshold and a size
    recover the sheets), the new stages change nothing: with them off, the same candidates in
    the same order as the 20-candidate search; with them on, these first, with the same
    scores, and the same choice (none of the new candidates scores higher)."""
    volumes = [surface_case(tmp_path, "a", 6), surface_case(tmp_path, "b", 7)]
    off = tuning.SearchSpace(**tuning.WINNERS_STAGES_OFF)
    best_off, off_candidates = tuning.search(volumes, off, topo_method="betti_counts")
    best_on, on_candidates = tuning.search(volumes, topo_method="betti_counts")
    assert [c.stage for c in off_candidates] == [
        *["threshold"] * 9,
        *["refine"] * 2,
        *["hysteresis"] * 4,
        *["min_component"] * 4,
        "fill_holes",
    ]
    assert best_off.settings.label() == "t>0.3 min 16"
    assert best_on.settings == best_off.settings
    on = {c.settings: c for c in on_candidates}
    for c in off_candidates:
        assert on[c.settings].scores == c.scores
    new = [c for c in on_candidates if c.settings not in {o.settings for o in off_candidates}]
    assert {c.stage for c in new} == {"hysteresis", "plug_holes", "patch_holes", "closing"}
    assert all(c.mean() <= best_on.mean() for c in new)
    assert len(on_candidates) <= 32


def test_new_settings_round_trip_through_tuned_json(tmp_path: Path):
    """tuned.json keeps the new fields: load_tuned gives the settings the search chose, and
    `ctseg postprocess --settings` applies them (and the same as fixed options)."""
    probs, label = flat_sheet()
    probs[10:12, 12:17, 12:17] = 0.02
    volume = sheet_case(tmp_path, "a", probs, label)
    space = tuning.SearchSpace(thresholds=(0.5,), refine_step=0, hysteresis_offsets=())
    tuning.tune_postprocess([volume], tmp_path / "out", space, topo_method="betti_counts")
    on_disk = json.loads((tmp_path / "out" / "tuned.json").read_text())
    chosen = tuning.load_tuned(tmp_path / "out" / "tuned.json")
    assert on_disk["settings"] == chosen.as_dict()
    assert set(on_disk["settings"]) == set(PostprocessSettings().as_dict())
    assert chosen.plug_holes_max_area == 64
    a, b = tmp_path / "a.tif", tmp_path / "b.tif"
    argv = ["postprocess", str(volume.probabilities)]
    assert cli.main([*argv, str(a), "--settings", str(tmp_path / "out" / "tuned.json")]) == 0
    assert cli.main([*argv, str(b), "--plug-holes-max-area", "64"]) == 0
    np.testing.assert_array_equal(tifffile.imread(a), label)
    np.testing.assert_array_equal(tifffile.imread(b), label)
    # The report's section shows the new setting, the new stages and the bound.
    from ctseg.report import postprocess as report_postprocess
    from ctseg.report.markup import Sources

    page = report_postprocess.postprocess_section(tmp_path / "out", Sources(tmp_path))
    assert "plug_holes_max_area" in page and html.escape("t>0.5 plug 64") in page
    assert f"at most {space.max_candidates()}" in page and "closing" in page


def test_bad_new_search_values_are_refused():
    for kwargs, match in [
        ({"hysteresis_modes": ("2d",)}, "hysteresis_modes"),
        ({"hysteresis_modes": ()}, "hysteresis_modes"),
        ({"hysteresis_pairs": ((0.9, 0.5),)}, "hysteresis_pairs"),
        ({"plug_holes_max_area": (0,)}, "plug_holes_max_area"),
        ({"patch_holes_max_area": (1.5,)}, "patch_holes_max_area"),
        ({"closing_radii": (3,)}, "closing_radii"),
    ]:
        with pytest.raises(CtsegError, match=match):
            tuning.SearchSpace(**kwargs)


def test_search_cost_benchmark_prints_its_result_line():
    """bench/postprocess_search.py at its smallest: both searches run within their bounds."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(repo / "bench/postprocess_search.py"), "--size", "40"]
        + ["--workers", "1", "--topo-method", "betti_counts"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = [x for x in proc.stdout.splitlines() if x.startswith("RESULT postprocess_search ")]
    assert len(result) == 1
    fields = dict(item.split("=") for item in result[0].split()[2:])
    old, new = int(fields["old_candidates"]), int(fields["new_candidates"])
    assert old <= 20 and old < new <= 32
    assert float(fields["new_s"]) > 0 and float(fields["ratio"]) > 0


# ----------------------------------------------------------------------------- nothing to go on
def test_candidates_that_cannot_be_told_apart_keep_the_defaults(tmp_path: Path, capsys):
    """Issue 27: on an all-zero probability volume every candidate's mask is empty and every
    candidate ties, so the first (threshold 0.1) was applied as tuned. The defaults are kept,
    and tuned.json, candidates.csv, the log and the report say why."""
    from ctseg.report import postprocess as report_postprocess
    from ctseg.report.markup import Sources

    _, label = flat_sheet()
    volume = sheet_case(tmp_path, "a", np.zeros(label.shape), label)
    summary = tuning.tune_postprocess([volume], tmp_path / "out")
    assert summary["tuned"] is False
    assert summary["settings"] == tuning.DEFAULT_SETTINGS.as_dict()
    assert "cannot be told apart" in summary["reason"]
    assert summary["best_candidate"]["label"] == "t>0.1"  # what the search alone would apply
    assert summary["gain_over_default"] == summary["best_candidate"]["gain_over_default"] == 0
    assert summary["candidates"] > 1
    assert tuning.load_tuned(tmp_path / "out" / "tuned.json") == tuning.DEFAULT_SETTINGS
    table = pd.read_csv(tmp_path / "out" / "candidates.csv")
    assert table.loc[table["chosen"], "label"].tolist() == ["t>0.5"]
    assert table["score"].nunique() == 1
    err = capsys.readouterr().err
    assert f"not tuned, default settings kept: {summary['reason']}" in err
    page = report_postprocess.postprocess_section(tmp_path / "out", Sources(tmp_path))
    assert "Not tuned" in page and html.escape(summary["reason"]) in page
    assert "the defaults, kept" in page and "Gain over the default" not in page


def margin_case(directory: Path) -> tuning.Volume:
    """A sheet recovered by every threshold, and one voxel on its face at 0.55: threshold 0.6
    drops that voxel and gains 0.0002 over the default 0.5."""
    label = np.zeros((24, 64, 64), np.uint8)
    label[10:12, 4:60, 4:60] = 1
    probs = np.where(label == 1, 0.95, 0.02)
    probs[12, 30, 30] = 0.55
    return sheet_case(directory, "a", probs, label)


THRESHOLDS_ONLY = {
    "refine_step": 0,
    "hysteresis_offsets": (),
    "hysteresis_pairs": (),
    "min_component_voxels": (),
    "fill_holes": False,
    "plug_holes_max_area": (),
    "patch_holes_max_area": (),
    "closing_radii": (),
}


def test_a_gain_within_the_margin_keeps_the_defaults(tmp_path: Path, capsys, monkeypatch):
    """The best candidate replaces the defaults only when it beats them by more than
    `MIN_GAIN`; tuned.json keeps the best it passed over, the log and tuned.json say why."""
    volume = margin_case(tmp_path)
    space = tuning.SearchSpace(thresholds=(0.5, 0.6), **THRESHOLDS_ONLY)
    summary = tuning.tune_postprocess([volume], tmp_path / "kept", space)
    gain = summary["best_candidate"]["gain_over_default"]
    assert 0 < gain <= tuning.MIN_GAIN
    assert summary["tuned"] is False and summary["label"] == "t>0.5"
    assert summary["score"] == summary["default"]["score"] and summary["gain_over_default"] == 0
    assert summary["best_candidate"]["label"] == "t>0.6" and summary["min_gain"] == 0.001
    assert f"by {gain:.4f}, not by more than the {tuning.MIN_GAIN}" in summary["reason"]
    assert tuning.load_tuned(tmp_path / "kept" / "tuned.json") == tuning.DEFAULT_SETTINGS
    assert f"default settings kept: {summary['reason']}" in capsys.readouterr().err
    # The same gain above the margin is applied: the margin, nothing else, kept the defaults.
    monkeypatch.setattr(tuning, "MIN_GAIN", gain / 2)
    summary = tuning.tune_postprocess([volume], tmp_path / "tuned", space)
    assert summary["tuned"] is True and summary["reason"] is None
    assert summary["label"] == "t>0.6" and summary["gain_over_default"] == gain
    assert "default settings kept" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- one definition
def test_the_config_and_its_docs_state_searchspace():
    """SearchSpace is the search grid's one definition: config/config.yaml's infer.tune, the
    config schema's defaults and config/README.md's rows state its default space and bound, and
    `ctseg tune-postprocess --help` reads them from it."""
    repo = Path(__file__).resolve().parents[1]
    space = tuning.SearchSpace()
    expected = space.config()
    config = yaml.safe_load((repo / "config/config.yaml").read_text())
    assert config["infer"]["tune"] == expected
    schema = yaml.safe_load((repo / "workflow/schemas/config.schema.yaml").read_text())
    properties = schema["properties"]["infer"]["properties"]["tune"]["properties"]
    assert {k: v["default"] for k, v in properties.items()} == expected
    readme = (repo / "config/README.md").read_text()
    rows = {}
    for line in readme.splitlines():
        if line.startswith("| `infer.tune."):
            name, default = (cell.strip().strip("`") for cell in line.split("|")[1:3])
            rows[name.removeprefix("infer.tune.")] = yaml.safe_load(default)
    assert rows == expected
    bound = space.bound_sum()
    assert bound == "9 + 2 + 10 + 4 + 1 + 2 + 2 + 2 = 32"
    assert f"at most {bound} candidates" in readme
    assert f"at most {bound}\n  # candidates" in (repo / "config/config.yaml").read_text()


def test_the_cli_help_shows_searchspaces_defaults(capsys):
    """Each search option's help shows SearchSpace's default, and the description its bound."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tune-postprocess", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    space = tuning.SearchSpace()
    assert space.describe() in help_text
    for name in space.config():
        option = "--no-fill-holes" if name == "fill_holes" else "--" + name.replace("_", "-")
        shown = help_text.split(f" {option} ", 1)[1].split(" --", 1)[0]
        assert space.option_text(name) in shown, (name, shown)
    assert "{}" not in help_text


def test_the_search_builds_each_stages_base_once(tmp_path: Path, monkeypatch):
    """Each stage's candidates are the best so far with one step changed: through
    `masks.MaskCache` the search builds every step's result once per volume (a closing
    candidate costs a closing), and chooses exactly what it chose building every mask whole."""
    from ctseg.postprocess import masks

    volume = surface_case(tmp_path, "a", 4)
    built: list[tuple[int, PostprocessSettings]] = []
    apply_step = masks._apply_step

    def counted(step, settings, probs, mask):
        built.append((step, masks.step_prefix(settings, step)))
        return apply_step(step, settings, probs, mask)

    monkeypatch.setattr(masks, "_apply_step", counted)
    best, candidates = tuning.search([volume], topo_method="betti_counts")
    steps = range(len(masks.MASK_STEPS))
    needed = [
        (step, masks.step_prefix(c.settings, step))
        for c in candidates
        for step in steps
        if masks._is_on(c.settings, step)
    ]
    # Every step of every candidate's mask built, none twice: far fewer than building each
    # candidate's mask whole.
    assert len(built) == len(set(built)) and set(built) == set(needed)
    assert len(built) < len(needed) - 10
    # The same choice and scores as masks built whole, one candidate at a time.
    monkeypatch.setattr(masks, "_apply_step", apply_step)
    monkeypatch.setattr(tuning.MaskCache, "mask", lambda self, s: binary_mask(self.probs, s)[0])
    whole_best, whole = tuning.search([volume], topo_method="betti_counts")
    assert whole_best.settings == best.settings
    assert [(c.settings, c.scores) for c in whole] == [(c.settings, c.scores) for c in candidates]


def test_tuned_json_says_which_weights_made_the_probabilities(tmp_path: Path):
    """`made_with`: the weights files (and ensemble weights) the val probabilities were made
    with, from their stores; stores of different ensembles are an error, not a search over two;
    stores that do not say give None (nothing to check later)."""
    a, b = surface_case(tmp_path, "a", 4), surface_case(tmp_path, "b", 5)
    assert tuning.made_with([a, b]) is None
    for volume, digest in ((a, "d1"), (b, "d1")):
        store = zarr.open_array(str(volume.probabilities), mode="r+")
        store.attrs["weights_sha256"] = [digest]
    assert tuning.made_with([a, b]) == {"weights_sha256": ["d1"], "ensemble_weights": None}
    # Out-of-fold volumes of a cross-validation: one fold each.
    zarr.open_array(str(b.probabilities), mode="r+").attrs["weights_sha256"] = ["d2"]
    assert tuning.made_with([a, b]) == {"weights_sha256": ["d1", "d2"], "ensemble_weights": None}
    for volume, mix in ((a, [0.5, 0.5]), (b, [0.25, 0.75])):
        zarr.open_array(str(volume.probabilities), mode="r+").attrs["ensemble"] = {"weights": mix}
    with pytest.raises(CtsegError, match=r"b.zarr: made with other ensemble weights than .*a.zarr"):
        tuning.made_with([a, b])
