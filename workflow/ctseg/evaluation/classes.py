"""Per-class Dice and SurfaceDice of a predicted label map against a stored label volume.

A multi-class dataset (a `LabelSpec` with K >= 2 foreground classes) is scored class by class:
for each class c of 1..K (stored values, `LabelSpec.stored`), the prediction's voxels of c and
the label's voxels of c are two binary masks, and

* the label's ignored voxels (stored value K+1) are background in both masks, as the
  competition's preparation does for its binary masks (`ctseg.evaluation.metrics.prepare_masks`);
* **Dice** = 2 |P & G| / (|P| + |G|);
* **SurfaceDice** at `tolerance` (2.0) comes from `ctseg.evaluation.surface_dice.surface_dice`,
  with the dataset's voxel spacing divided by its smallest value, so the tolerance is in voxels
  of the finest axis (isotropic data: the competition's spacing (1, 1, 1));
* a class absent from both masks scores Dice 1.0 and SurfaceDice 1.0 (the competition's
  convention for an empty pair) and its row says ``empty: True``;
* the row ``class: mean`` holds the unweighted mean of Dice and SurfaceDice over the K classes
  (empty ones included) and the voxel counts summed over them.

`score_classes` scores two arrays of stored values; `score_class_files` reads a predicted label
map TIFF (in the dataset's own values, mapped with `LabelSpec.to_stored`) and a label Zarr store
(stored values, as `ctseg convert --kind label` writes it); `evaluate_classes` scores every
pair and writes ``per_class.csv`` (`PER_CLASS_COLUMNS`, one row per volume and class, then the
volume's mean row) with `write_per_class`. The binary competition score is unchanged by all of
this: `ctseg.evaluation.metrics` computes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ctseg.evaluation.surface_dice import as_spacing, surface_dice
from ctseg.io import CtsegError, atomic_path, strict_json
from ctseg.labels import LabelSpec

PER_CLASS_FILE = "per_class.csv"
PER_CLASS_COLUMNS = ("id", "class", "value", "dice", "surface_dice", "gt_voxels", "pred_voxels")
MEAN_ROW = "mean"
# A binary mask written as 0/255 (what `ctseg score` accepts) counts as 0/foreground.
MASK_HIGH = 255


def relative_spacing(spacing: Sequence[float]) -> tuple[float, float, float]:
    """`spacing` [z, y, x] divided by its smallest value: the finest axis is 1 voxel."""
    values = as_spacing(spacing)
    finest = min(values)
    return (values[0] / finest, values[1] / finest, values[2] / finest)


def _dice(pred: np.ndarray, truth: np.ndarray, pred_voxels: int, gt_voxels: int) -> float:
    if pred_voxels + gt_voxels == 0:
        return 1.0
    return 2.0 * int(np.count_nonzero(pred & truth)) / (pred_voxels + gt_voxels)


def score_classes(
    pred: np.ndarray,
    gt: np.ndarray,
    spec: LabelSpec,
    spacing: Sequence[float] = (1.0, 1.0, 1.0),
    tolerance: float = 2.0,
    *,
    threads: int = 1,
) -> list[dict[str, Any]]:
    """Dice and SurfaceDice of each class of `spec` (the module docstring has the rules).

    `pred` is a predicted label map and `gt` a label volume, both in stored values
    (`spec.stored()`: 0 background, 1..K the classes, K+1 ignored); `spec` may be the dataset's
    spec or its stored spec. Returns one dict per class (class, value: the class's value in
    `spec`, dice, surface_dice, gt_voxels, pred_voxels, empty), then the mean row."""
    pred = np.asarray(pred)
    gt = np.asarray(gt)
    if pred.shape != gt.shape or pred.ndim != 3:
        raise ValueError(f"expected two 3D volumes of one shape, got {pred.shape} and {gt.shape}")
    stored = spec.stored()
    relative = relative_spacing(spacing)
    keep = ~stored.ignored(gt)
    rows: list[dict[str, Any]] = []
    for name in spec.classes:
        value = stored.labels[name]
        pred_mask = (pred == value) & keep
        gt_mask = (gt == value) & keep
        pred_voxels, gt_voxels = int(np.count_nonzero(pred_mask)), int(np.count_nonzero(gt_mask))
        empty = not (pred_voxels or gt_voxels)
        rows.append(
            {
                "class": name,
                "value": spec.labels[name],
                "dice": _dice(pred_mask, gt_mask, pred_voxels, gt_voxels),
                "surface_dice": surface_dice(
                    pred_mask, gt_mask, tolerance, threads=threads, spacing=relative
                ),
                "gt_voxels": gt_voxels,
                "pred_voxels": pred_voxels,
                "empty": empty,
            }
        )
    rows.append(
        {
            "class": MEAN_ROW,
            "value": None,
            "dice": float(np.mean([r["dice"] for r in rows])),
            "surface_dice": float(np.mean([r["surface_dice"] for r in rows])),
            "gt_voxels": sum(r["gt_voxels"] for r in rows),
            "pred_voxels": sum(r["pred_voxels"] for r in rows),
            "empty": all(r["empty"] for r in rows),
        }
    )
    return rows


# ---------------------------------------------------------------------------------------------
# Files


def _distinct(volume: np.ndarray) -> np.ndarray:
    if volume.dtype == np.uint8:  # a histogram: far cheaper than sorting
        return np.flatnonzero(np.bincount(volume.ravel(), minlength=MASK_HIGH + 1))
    return np.unique(volume)


def read_prediction_map(path: Path, spec: LabelSpec) -> np.ndarray:
    """A predicted label map TIFF in the dataset's values (`spec`), as stored values 0..K; a
    binary spec's 0/255 mask counts as 0/foreground. A value the spec lacks, or its ignored
    value, is a one-line error naming the file."""
    from ctseg.evaluation.metrics import read_volume

    volume = read_volume(Path(path))
    values = _distinct(volume)
    if spec.is_binary and values.size and set(values.tolist()) <= {0, MASK_HIGH}:
        volume = np.where(volume != 0, spec.foreground_value, spec.background).astype(np.uint8)
        values = _distinct(volume)
    allowed = np.asarray(list(spec.labels.values()))
    bad = values[~np.isin(values, allowed)]
    if bad.size:
        shown = ", ".join(f"{v:g}" for v in bad[:6].tolist()) + (", ..." if bad.size > 6 else "")
        raise CtsegError(
            f"{path}: prediction values [{shown}] are not labels of the dataset "
            f"({spec.describe()}); a predicted label map holds background and class values "
            "only: write it with ctseg postprocess"
        )
    return spec.to_stored(volume, path)


def read_label_store(path: Path, spec: LabelSpec) -> np.ndarray:
    """A label Zarr store (stored values, as `ctseg convert --kind label` writes them), whole,
    with one-line errors naming the store."""
    from ctseg.store import open_volume

    try:
        volume = np.asarray(open_volume(path)[...])
    except CtsegError:
        raise
    except Exception as exc:  # zarr raises several types for a missing or broken store
        raise CtsegError(f"{path}: cannot read the label store ({exc})") from exc
    if volume.ndim != 3:
        raise CtsegError(f"{path}: expected a 3D label volume, got shape {volume.shape}")
    spec.stored().check_values(
        _distinct(volume),
        path,
        fix=f"the store holds stored values (0, classes 1..{spec.n_classes}, ignore "
        f"{spec.n_classes + 1}); re-convert it with ctseg convert --kind label",
    )
    return volume


def score_class_files(
    pred_tif: Path,
    label_zarr: Path,
    spec: LabelSpec,
    spacing: Sequence[float] | None = None,
    tolerance: float = 2.0,
    *,
    threads: int = 1,
) -> list[dict[str, Any]]:
    """`score_classes` of a predicted label map TIFF against a label Zarr store; each row gets
    ``id``, the TIFF's stem. `spacing`: the dataset's [z, y, x] (None: isotropic)."""
    pred = read_prediction_map(Path(pred_tif), spec)
    gt = read_label_store(Path(label_zarr), spec)
    if pred.shape != gt.shape:
        raise CtsegError(
            f"shape mismatch: prediction {pred_tif} has shape {pred.shape}, "
            f"label store {label_zarr} has shape {gt.shape}"
        )
    rows = score_classes(pred, gt, spec, spacing or (1.0, 1.0, 1.0), tolerance, threads=threads)
    record_id = Path(pred_tif).stem
    return [{"id": record_id, **row} for row in rows]


def write_per_class(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """`rows` (`score_class_files`' rows) as a CSV of `PER_CLASS_COLUMNS`, written atomically;
    the mean rows have an empty value."""
    import pandas as pd

    table = pd.DataFrame([{c: row.get(c) for c in PER_CLASS_COLUMNS} for row in rows])
    table = table.reindex(columns=list(PER_CLASS_COLUMNS))
    table["value"] = table["value"].astype("Int64")
    path = Path(path)
    with atomic_path(path) as tmp:
        table.to_csv(tmp, index=False)
    return path


def evaluate_classes(
    predictions: Sequence[Path],
    labels: Sequence[Path],
    out_dir: Path,
    spec: LabelSpec,
    spacing: Sequence[float] | None = None,
    tolerance: float = 2.0,
    *,
    threads: int = 1,
) -> list[dict[str, Any]]:
    """Score each predicted label map against its label store and write
    ``out_dir/per_class.csv``; returns the rows. The pairs are scored in order, one volume in
    memory at a time."""
    if len(predictions) != len(labels):
        raise CtsegError(f"{len(predictions)} predictions but {len(labels)} label stores")
    if not predictions:
        raise CtsegError("nothing to evaluate per class: no held-out volume has a label")
    rows: list[dict[str, Any]] = []
    for pred, label in zip(predictions, labels, strict=True):
        rows += score_class_files(
            Path(pred), Path(label), spec, spacing, tolerance, threads=threads
        )
    write_per_class(rows, Path(out_dir) / PER_CLASS_FILE)
    return rows


def evaluate_multiclass(
    predictions: Sequence[Path],
    labels: Sequence[Path],
    out_dir: Path,
    spec: LabelSpec,
    spacing: Sequence[float] | None = None,
    *,
    threads: int = 1,
    provenance: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`ctseg evaluate` for a multi-class dataset: ``per_class.csv`` (`evaluate_classes`), and
    the files every run has, ``scores.csv`` (one row a volume: the mean over its classes of
    Dice and SurfaceDice; ``score`` is the mean Dice, nnU-Net's headline figure, since the
    competition's score is for one class) and ``summary.json`` (their means)."""
    import pandas as pd

    rows = evaluate_classes(predictions, labels, out_dir, spec, spacing, threads=threads)
    means = [row for row in rows if row["class"] == MEAN_ROW]
    table = pd.DataFrame(
        {
            "id": [row["id"] for row in means],
            "score": [row["dice"] for row in means],
            "dice": [row["dice"] for row in means],
            "surface_dice": [row["surface_dice"] for row in means],
        }
    )
    summary: dict[str, Any] = {
        "volumes": len(table),
        "classes": list(spec.classes),
        "score_is": f"the mean Dice over the {len(spec.classes)} classes",
        **{f"mean_{name}": float(table[name].mean()) for name in ("score", "dice", "surface_dice")},
    }
    if provenance:
        summary["provenance"] = {str(k): str(v) for k, v in provenance.items()}
    with atomic_path(Path(out_dir) / "scores.csv") as tmp:
        table.to_csv(tmp, index=False)
    with atomic_path(Path(out_dir) / "summary.json") as tmp:
        tmp.write_text(strict_json(summary, indent=1))
    return summary
