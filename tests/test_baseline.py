"""ctseg.evaluation.baseline: the image above a threshold tuned on the tuning volumes, scored
by the competition's exact metric; and `ctseg baseline`, the step the workflow runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import tifffile

from ctseg.cli import main
from ctseg.evaluation.baseline import QUANTILES, threshold_baseline
from ctseg.evaluation.metrics import score_volume
from ctseg.store import create_volume, open_volume

SHAPE = (24, 32, 32)


def volume(root: Path, record_id: str, seed: int) -> tuple[Path, Path]:
    """A bright sheet in noise, a corner unlabelled: an image store and its label TIFF."""
    rng = np.random.default_rng(seed)
    label = np.zeros(SHAPE, np.uint8)
    label[:, 12 + seed : 18 + seed, :] = 1
    label[:, :, 28:] = 2
    image = rng.integers(0, 90, SHAPE).astype(np.uint8)
    image[label == 1] += 120
    image_path = root / "images" / f"{record_id}.zarr"
    create_volume(image_path, SHAPE, np.uint8, (16, 16, 16))[:] = image
    label_path = root / "labels" / f"{record_id}.tif"
    label_path.parent.mkdir(parents=True, exist_ok=True)
    tifffile.imwrite(label_path, label)
    return image_path, label_path


def test_the_threshold_is_tuned_on_the_tuning_volumes_and_scored_exactly(tmp_path: Path) -> None:
    (ti, tl), (si, sl) = volume(tmp_path, "val1", 0), volume(tmp_path, "test1", 1)
    summary = threshold_baseline([ti], [tl], [si], [sl], tmp_path / "baseline")
    label = np.asarray(tifffile.imread(tl))  # the tuning label, to score each candidate again
    stored = np.asarray(open_volume(ti)[...])
    expected = {
        float(t): score_volume((stored > t).astype(np.uint8), label)["score"]
        for t in np.quantile(stored[::4, ::4, ::4].ravel(), list(QUANTILES))
    }
    assert [c["threshold"] for c in summary["candidates"]] == sorted(expected)
    for candidate in summary["candidates"]:
        assert candidate["mean_score"] == expected[candidate["threshold"]]
    best = max(expected, key=lambda t: (expected[t], -t))
    assert summary["threshold"] == best
    assert summary["tuned_on"] == ["val1"] and summary["scored"] == ["test1"]
    scores = pd.read_csv(tmp_path / "baseline" / "scores.csv")
    mask = (np.asarray(open_volume(si)[...]) > best).astype(np.uint8)
    assert scores["score"].iloc[0] == score_volume(mask, tifffile.imread(sl))["score"]
    assert json.loads((tmp_path / "baseline" / "summary.json").read_text()) == summary


def test_ctseg_baseline_writes_the_files_the_report_reads(tmp_path: Path) -> None:
    (ti, tl), (si, sl) = volume(tmp_path, "val1", 0), volume(tmp_path, "test1", 2)
    out = tmp_path / "results" / "exp" / "baseline"
    args = ["baseline", "--tune-images", str(ti), "--tune-labels", str(tl)]
    args += ["--images", str(si), "--labels", str(sl), "--out", str(out)]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["volumes"] == 1 and 0.0 <= summary["mean_score"] <= 1.0
    assert list(pd.read_csv(out / "scores.csv")["id"]) == ["test1"]


def test_bad_inputs_name_the_problem(tmp_path: Path) -> None:
    (ti, tl) = volume(tmp_path, "val1", 0)
    assert (
        main(
            [
                "baseline",
                "--tune-images",
                str(ti),
                "--tune-labels",
                str(tl),
                "--images",
                str(tmp_path / "missing.zarr"),
                "--labels",
                str(tl),
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
