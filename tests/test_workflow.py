"""The real workflow, run with `snakemake` on a private copy and a tiny generated dataset."""

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
from conftest import BIN, REPO, TINY_CONFIG, copy_workflow, run_snakemake

from ctseg.formatting import fmt
from ctseg.postprocess.masks import binary_mask
from ctseg.postprocess.tuning import load_tuned
from ctseg.preprocess.targets import targets_reference


def test_precompute_targets_end_to_end(workflow_dir: Path):
    # No --cores: the default profile must supply it.
    proc = run_snakemake(workflow_dir, "precompute_targets")
    assert "Nothing to be done" not in proc.stderr

    demo = workflow_dir / "resources" / "demo"
    train = pd.read_csv(demo / "train.csv", dtype={"id": str})
    test = pd.read_csv(demo / "test.csv", dtype={"id": str})
    assert len(train) == TINY_CONFIG["demo"]["n_train"]
    assert len(test) == TINY_CONFIG["demo"]["n_test"]

    results = workflow_dir / "results"
    store = results / "preprocessed" / TINY_CONFIG["dataset"]  # one store root per dataset
    target_cfg = TINY_CONFIG["targets"]
    for record_id in train["id"]:
        image_tif = tifffile.imread(demo / "train_images" / f"{record_id}.tif")
        label_tif = tifffile.imread(demo / "train_labels" / f"{record_id}.tif")
        image = zarr.open_array(str(store / "zarr" / "images" / f"{record_id}.zarr"), mode="r")
        label = zarr.open_array(str(store / "zarr" / "labels" / f"{record_id}.zarr"), mode="r")
        np.testing.assert_array_equal(image[:], image_tif)
        np.testing.assert_array_equal(label[:], label_tif)
        assert image.chunks == (16, 16, 16)
        assert len(image.attrs["source_sha256"]) == 64

        targets = zarr.open_group(str(store / "targets" / f"{record_id}.zarr"), mode="r")
        reference = targets_reference(
            label_tif,
            clip_distance=target_cfg["clip_distance"],
            skeleton_method=target_cfg["skeleton_method"],
            tube_dilations=target_cfg["tube_dilations"],
        )
        np.testing.assert_array_equal(targets["foreground"][:], label_tif == 1)
        np.testing.assert_array_equal(targets["ignore"][:], label_tif == 2)
        np.testing.assert_array_equal(
            targets["sdt"][:], reference["sdt"].astype(np.float16), err_msg="sdt"
        )
        np.testing.assert_array_equal(targets["skeleton"][:], reference["skeleton"])
        np.testing.assert_array_equal(targets["tube"][:], reference["tube"])
        locations = targets["fg_locations"][:]
        assert 0 < len(locations) <= target_cfg["max_samples"]
        assert (label_tif[tuple(locations.T)] == 1).all()

    # Test volumes are converted, and the demo keeps their labels for evaluation.
    for record_id in test["id"]:
        assert (store / "zarr" / "images" / f"{record_id}.zarr").is_dir()
        assert (store / "zarr" / "labels" / f"{record_id}.zarr").is_dir()

    # Every rule wrote its log and its benchmark.
    assert (results / "logs" / "demo_data.log").exists()
    for rule in ("convert_image", "convert_label", "targets"):
        assert any((results / "logs" / rule).iterdir()), rule
        assert any((results / "benchmarks" / rule).iterdir()), rule

    # No temporary leftovers beside the outputs.
    leftovers = [p for p in results.rglob(".*tmp-*")]
    assert leftovers == []

    # A second run has nothing to do.
    again = run_snakemake(workflow_dir, "precompute_targets", "-n")
    assert "Nothing to be done" in again.stdout + again.stderr


def test_default_target_runs_the_whole_demo_with_phase_auto(workflow_dir: Path):
    """`snakemake` from nothing: demo TIFFs, targets, stage, trials, train, infer, evaluate,
    report; then `snakemake --report` over the same run."""
    proc = run_snakemake(workflow_dir, "--config", "experiment=tiny", "phase=auto")
    results = workflow_dir / "results"
    # It ends by saying where the report is and what the run scored.
    ending = proc.stdout.splitlines()[-2:]
    assert ending[0] == "ctseg: report: results/report.html"
    assert ending[1].startswith("ctseg: tiny: score 0.") and "(demo_test_volumes)" in ending[1]
    split = pd.read_csv(results / "tiny" / "split.csv", dtype={"id": str})
    assert set(split["split"]) == {"train", "val"}

    manifest = json.loads((results / "scratch" / "tiny" / "manifest.json").read_text())
    assert sorted(manifest["ids"]) == sorted(split["id"])

    summaries = {
        phase: json.loads(
            (results / "tiny" / "phases" / f"phase{phase}" / "summary.json").read_text()
        )
        for phase in (0, 1)
    }
    for phase, summary in summaries.items():
        assert summary["status"] == "ok", summary
        assert summary["phase"] == phase
        assert summary["samples_per_s"] > 0 and summary["feed_efficiency"] > 0
    assert summaries[1]["checks"]["previous_phase"] == 0

    steps = pd.read_csv(results / "tiny" / "train" / "steps.csv")
    epochs = pd.read_csv(results / "tiny" / "train" / "epochs.csv")
    assert list(steps["step"]) == list(range(1, 7))
    assert list(epochs["epoch"]) == [0, 1]
    assert epochs["val_dice"].between(0, 1).all()
    log = (results / "logs" / "train" / "tiny.log").read_text()
    fastest = max(summaries.values(), key=lambda s: s["samples_per_s"])["phase"]
    assert f"phase auto: chose phase {fastest}" in log

    weights = torch.load(results / "tiny" / "last.pt", weights_only=True)
    assert weights["step"] == 6 and weights["model_config"]["filters"] == [4, 8]
    # Resumable state lives outside the declared outputs.
    assert (results / "tiny" / "checkpoints" / "resume.pt").exists()

    # Inference on the held-out volumes, in the submission layout.
    test_ids = pd.read_csv(workflow_dir / "resources/demo/test.csv", dtype={"id": str})["id"]
    for record_id in test_ids:
        mask = tifffile.imread(results / "tiny" / "predictions" / f"{record_id}.tif")
        label = tifffile.imread(workflow_dir / "resources/demo/test_labels" / f"{record_id}.tif")
        assert mask.dtype == np.uint8 and mask.shape == label.shape
        assert set(np.unique(mask)) <= {0, 1}
        probabilities = zarr.open_array(
            str(results / "tiny" / "probabilities" / f"{record_id}.zarr"), mode="r"
        )
        assert probabilities.dtype == np.float16
        # infer.postprocess: tuned (the default): the settings chosen on the val split.
        tuned = load_tuned(results / "tiny" / "postprocess" / "tuned.json")
        np.testing.assert_array_equal(mask, binary_mask(probabilities[:], tuned)[0])

    scores = pd.read_csv(results / "tiny" / "evaluation" / "scores.csv", dtype={"id": str})
    assert sorted(scores["id"]) == sorted(test_ids)
    assert scores["score"].between(0, 1).all()
    summary = json.loads((results / "tiny" / "evaluation" / "summary.json").read_text())
    assert summary["mean_score"] == pytest.approx(scores["score"].mean())

    page = (results / "report.html").read_text()
    for source in (
        "results/tiny/phases/phase0/summary.json",
        "results/tiny/train/steps.csv",
        "results/tiny/evaluation/scores.csv",
    ):
        assert source in page, source
    assert fmt(summary["mean_score"], 4) in page

    run_snakemake(
        workflow_dir,
        "--config",
        "experiment=tiny",
        "phase=auto",
        "--report",
        "results/snakemake_report.html",
    )
    snakemake_report = (results / "snakemake_report.html").read_text()
    assert "scores.csv" in snakemake_report and "report.html" in snakemake_report


def test_per_job_staging_copies_into_node_scratch(workflow_dir: Path, tmp_path: Path):
    """stage: per_job: no stage job; the train job stages into $TMPDIR on its own node."""
    node_tmp = tmp_path / "node-local"
    node_tmp.mkdir()
    proc = run_snakemake(
        workflow_dir,
        "train",
        "--config",
        "experiment=tiny",
        "phase=0",
        "stage=per_job",
        env={"TMPDIR": str(node_tmp)},
    )
    assert "rule stage:" not in proc.stdout + proc.stderr
    staged = node_tmp / "ctseg" / "tiny"
    manifest = json.loads((staged / "manifest.json").read_text())
    split = pd.read_csv(workflow_dir / "results" / "tiny" / "split.csv", dtype={"id": str})
    assert sorted(manifest["ids"]) == sorted(split["id"])
    assert not (workflow_dir / "results" / "scratch").exists()
    assert (workflow_dir / "results" / "tiny" / "last.pt").exists()


@pytest.mark.parametrize(
    "target",
    [
        "all",
        "demo_data",
        "precompute_targets",
        "stage",
        "trials",
        "train",
        "predict",
        "evaluate",
        "report",
    ],
)
def test_named_targets_dry_run(workflow_dir: Path, target: str):
    proc = run_snakemake(workflow_dir, "-n", target, "--config", "experiment=tiny")
    assert "Job stats" in proc.stdout + proc.stderr


def test_bad_config_rejected_by_schema(workflow_dir: Path):
    unknown = run_snakemake(workflow_dir, "-n", "--config", "bogus_key=1", check=False)
    assert unknown.returncode != 0
    assert "bogus_key" in unknown.stdout + unknown.stderr

    wrong_type = run_snakemake(
        workflow_dir, "-n", "--config", "targets={clip_distance: far}", check=False
    )
    assert wrong_type.returncode != 0
    assert "far" in wrong_type.stdout + wrong_type.stderr


def test_user_dataset_with_bad_id_fails_before_running(tmp_path: Path):
    workdir = copy_workflow(tmp_path, dict(TINY_CONFIG, dataset="mine"))
    root = workdir / "resources" / "mine"
    (root / "train_images").mkdir(parents=True)
    (root / "train.csv").write_text("id,scroll_id\n../escape,1\n")
    proc = run_snakemake(workdir, "-n", check=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "train.csv" in output and "bad id" in output


def test_lint_and_format_are_clean(tmp_path: Path):
    lint = subprocess.run(
        [str(BIN / "snakemake"), "--lint"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        [str(BIN / "snakefmt"), "--check", "workflow/Snakefile", "workflow/rules"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_every_config_key_is_documented():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    readme = (REPO / "config" / "README.md").read_text()
    keys = []
    for key, value in config.items():
        if isinstance(value, dict) and key != "codec":
            keys += [f"{key}.{sub}" for sub in value]
        else:
            keys.append(key)
    undocumented = [key for key in keys if f"`{key}`" not in readme]
    assert undocumented == []
