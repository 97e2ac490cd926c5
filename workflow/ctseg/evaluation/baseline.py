"""A reference score: the image's intensity above a tuned threshold, scored like a model.

What a model adds is its score less what a trivial rule gets on the same volumes. The rule here
is the simplest: a voxel is surface where the image is brighter than a threshold. The
candidate thresholds are a few quantiles of the tuning volumes' intensities (`QUANTILES`, of a
strided sample of their voxels); each candidate's masks of the tuning volumes are scored with
the competition's exact metric (`ctseg.evaluation.metrics.score_volume`), the best mean score
picks the threshold, and that threshold's masks of the scored volumes are scored the same way.
The tuning volumes are those a run tunes its post-processing on (its val split, or its
out-of-fold volumes); the scored volumes are those its evaluation scores, so the baseline sits
next to the run's own score on the same volumes and was fitted on the same ones.

`threshold_baseline` writes ``scores.csv`` (a row per scored volume, the columns of
``evaluation/scores.csv``) and ``summary.json`` (the threshold, every candidate's mean score on
the tuning volumes, the volumes of each role, the means), read by the report.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ctseg.io import CtsegError, atomic_path, strict_json
from ctseg.store import open_volume

QUANTILES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
SAMPLE_STRIDE = 4  # every 4th voxel along each axis: 1/64 of a volume sets the quantiles
METHOD = "image intensity > threshold (a quantile of the tuning volumes, by the mean score)"


def _image(path: Path) -> np.ndarray:
    try:
        return np.asarray(open_volume(path)[...])
    except Exception as exc:  # noqa: BLE001 - any unreadable store is the same user problem
        raise CtsegError(f"{path}: cannot read the image store for the baseline ({exc})") from exc


def _record_id(path: Path) -> str:
    name = Path(path).name
    return name[: -len(".zarr")] if name.endswith(".zarr") else Path(name).stem


def _score(image: np.ndarray, label: np.ndarray, threshold: float, threads: int) -> dict[str, Any]:
    from ctseg.evaluation.metrics import score_volume

    if image.shape != label.shape:
        raise CtsegError(f"image {image.shape} and label {label.shape} differ in shape")
    return score_volume((image > threshold).astype(np.uint8), label, threads=threads)


def threshold_baseline(
    tune_images: Sequence[Path],
    tune_labels: Sequence[Path],
    images: Sequence[Path],
    labels: Sequence[Path],
    out_dir: Path,
    *,
    quantiles: Sequence[float] = QUANTILES,
    threads: int = 1,
) -> dict[str, Any]:
    """Tune the threshold on (tune_images, tune_labels), score it on (images, labels); write
    ``out_dir/scores.csv`` and ``out_dir/summary.json``; return the summary."""
    import pandas as pd

    from ctseg.evaluation.metrics import read_label

    if len(tune_images) != len(tune_labels) or len(images) != len(labels):
        raise CtsegError("baseline: every image needs its label, in the same order")
    if not tune_images or not images:
        raise CtsegError("baseline: no tuning volume or no volume to score")
    tune = [
        (_image(Path(i)), read_label(Path(lab)))
        for i, lab in zip(tune_images, tune_labels, strict=True)
    ]
    step = (slice(None, None, SAMPLE_STRIDE),) * 3
    sample = np.concatenate([image[step].ravel() for image, _ in tune])
    thresholds = sorted({float(t) for t in np.quantile(sample, list(quantiles))})
    candidates = []
    for threshold in thresholds:
        scores = [_score(image, label, threshold, threads)["score"] for image, label in tune]
        candidates.append({"threshold": threshold, "mean_score": float(np.mean(scores))})
    best = max(candidates, key=lambda c: (c["mean_score"], -c["threshold"]))
    rows = []
    for image_path, label_path in zip(images, labels, strict=True):
        row = _score(
            _image(Path(image_path)), read_label(Path(label_path)), best["threshold"], threads
        )
        rows.append({"id": _record_id(Path(image_path)), **row})
    frame = pd.DataFrame(rows)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "scores.csv") as tmp:
        frame.to_csv(tmp, index=False)
    numeric = frame.select_dtypes("number")
    summary = {
        "method": METHOD,
        "threshold": best["threshold"],
        "candidates": candidates,
        "tuned_on": [_record_id(Path(p)) for p in tune_images],
        "scored": [str(r["id"]) for r in rows],
        "volumes": len(rows),
        **{f"mean_{c}": float(numeric[c].mean()) for c in numeric.columns},
    }
    text = strict_json(summary, indent=1)  # null, not NaN, for a term the volume lacks
    with atomic_path(out_dir / "summary.json") as tmp:
        tmp.write_text(text + "\n")
    return json.loads(text)
