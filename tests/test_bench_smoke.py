"""The pieces of bench/gpu_check.py and bench/quality.py that can be checked in seconds: the
step runner's error, the arguments it builds for `ctseg`, and the threshold baseline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import tifffile
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import pipeline  # noqa: E402
import quality  # noqa: E402


def test_failed_step_names_the_step_and_shows_its_log(tmp_path: Path) -> None:
    runner = pipeline.Runner(tmp_path)
    missing = tmp_path / "nowhere.tif"
    with pytest.raises(pipeline.StepFailed) as info:
        runner.run("convert_image", ["convert", str(missing), str(tmp_path / "x.zarr")], "r1")
    message = str(info.value)
    assert message.startswith("step convert_image r1 failed with exit status 2")
    # The tail of the log carries ctseg's own one-line error, which names the file.
    assert f"ctseg convert: error: {missing}" in message
    assert info.value.log == tmp_path / "logs/convert_image_r1.log"
    assert not (tmp_path / "x.zarr").exists()


def test_experiment_args_carry_the_modified_experiment(tmp_path: Path) -> None:
    exp = pipeline.load_experiment("exp001")
    pipeline.set_training_budget(exp, steps=40, val_batches=3)
    phases = pipeline.load_phases()
    args = pipeline.experiment_args("train", exp, phases, tmp_path)
    assert args[0] == "--experiment" and args[2] == "--phases"
    passed = yaml.safe_load(Path(args[1]).read_text())
    passed_phases = yaml.safe_load(Path(args[3]).read_text())["phases"]
    assert Path(args[1]).stem == "exp001"  # ctseg checks the name against the file name
    assert passed["train"]["steps_per_epoch"] == 40 and passed["train"]["epochs"] == 1
    assert passed["train"]["warmup_steps"] == 4 and passed["train"]["val_batches"] == 3
    assert {int(k) for k in passed_phases} == set(phases)
    # ctseg's own loaders accept both files (the schema, the name and every phase).
    from ctseg.config import load_experiment, load_phases

    assert load_experiment(args[1]).name == "exp001"
    assert set(load_phases(args[3])) == set(phases)
    assert pipeline.experiment_args("split", exp, None, tmp_path) == ["--experiment", args[1]]


def test_codec_arg_matches_what_convert_accepts() -> None:
    codec = {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "shuffle"}
    assert pipeline.codec_arg(codec) == "blosc,clevel=5,cname=lz4,shuffle=shuffle"


def test_threshold_masks_keep_the_brightest_voxels(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(20, 24, 28), dtype=np.uint8)
    tifffile.imwrite(tmp_path / "a.tif", image)
    (mask_path,) = quality.threshold_masks({"a": tmp_path / "a.tif"}, 90.0, tmp_path / "m", "_p90")
    mask = tifffile.imread(mask_path)
    assert mask_path.name == "a_p90.tif" and mask.dtype == np.uint8
    assert set(np.unique(mask)) <= {0, 1}
    # About the top 10% of the voxels (ties at the threshold go to background).
    assert 0.07 < mask.mean() <= 0.10
    assert image[mask == 1].min() > image[mask == 0].max()


def test_gpu_check_cpu_smoke_runs_the_pipeline_end_to_end(tmp_path: Path) -> None:
    """bench/gpu_check.py --cpu-smoke at its smallest (one phase, 2+1 volumes of 32^3): every
    step through the real `ctseg` CLI, so a change of the CLI's arguments shows up here (about
    30 s on 2 cores)."""
    import subprocess

    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench/gpu_check.py"),
            "--cpu-smoke",
            "--phases",
            "0",
            "--records",
            "2",
            "--size",
            "32",
            "--train-steps",
            "4",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT gpu_check auto_phase=0 "), proc.stdout[-2000:]
    record = json.loads(out.read_text())
    assert record["auto_phase"] == 0 and record["phases"]["0"]["status"] == "ok"
    assert record["phases"]["0"]["samples_per_s"] > 0
    assert record["evaluation"]["volumes"] == 1 and 0 <= record["evaluation"]["mean_score"] <= 1
    assert (tmp_path / "work/results/report.html").stat().st_size > 0
    for step in ("demo_data", "convert_image", "targets", "split", "stage", "train_trial"):
        assert step in record["step_seconds"]
