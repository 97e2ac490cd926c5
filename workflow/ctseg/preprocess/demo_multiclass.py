"""The `multiclass` demo preset: synthetic micro-CT of a material with three classes and an
unlabelled slab, in the Kaggle layout plus a ``dataset.yaml`` that declares its labels.

Each volume holds, on a mid-grey background:

* **sheet** (bright): 2 to 4 thin curved sheets, 2 or 3 voxels thick, stacked along a random axis
  (like the papyrus surfaces of the binary demo);
* **fibre** (medium grey): thin straight tubes, radius 1.5 to 2.5 voxels, along random directions,
  crossing the sheets (a fibre wins where both are);
* **pore** (dark): small round voids, radius 2 to 4 voxels, cut out of everything else.

The image is each class at its own intensity (`INTENSITY`, with a small per-object spread),
blurred, with a slow drift and Gaussian noise (`NOISE_SIGMA`), so a small U-Net separates the
classes by brightness and shape. One slab at a face of the volume, 15-30% of it along an axis
other than the sheets', is unlabelled (the ignore value) though its image shows the same
structures. Every sheet crosses the slab's axis whole and every fibre and pore is centred
outside it, so each class is labelled in every volume.

The label values are the dataset's own, not 0..K-1 (`SPEC`: background 0, sheet 10, fibre 20,
pore 30, ignore 255), so a pipeline that trains on it must map them through the spec.

Ids and scroll ids are the binary demo's (`demo_data.demo_records`, a function of the counts);
voxel content depends on the seed and the record id only. Sizes default to the binary demo's
(config/config.yaml's `demo`: 4 train + 2 test volumes of 96^3), so training takes the demo's
time. Measured on a 2-core machine, that default set takes about 0.7 s to write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from scipy import ndimage

from ctseg.io import CtsegError, atomic_path
from ctseg.labels import DATASET_FILE, DatasetSpec, LabelSpec
from ctseg.preprocess.demo_data import MIN_SIDE, _write_csv, _write_tif, demo_records
from ctseg.preprocess.demo_volume import smooth_basis
from ctseg.progress import Progress

SPEC = LabelSpec(labels={"background": 0, "sheet": 10, "fibre": 20, "pore": 30}, ignore=255)
# The defaults: the binary demo's (config/config.yaml `demo`).
N_TRAIN = 4
N_TEST = 2
SHAPE = (96, 96, 96)
SCROLL_IDS = (34117, 35360)

# Mean intensity of each class before blur, drift and noise (uint8 grey values); each object
# draws its own level within +-OBJECT_SPREAD of its class's.
INTENSITY = {"background": 95.0, "sheet": 205.0, "fibre": 150.0, "pore": 25.0}
OBJECT_SPREAD = 10.0
NOISE_SIGMA = 10.0
BLUR_SIGMA = (0.5, 0.8)
DRIFT = 10.0  # the largest intensity change of the slow drift, end to end

SHEET_PITCH = 32  # voxels between sheet centres on average
SHEET_THICKNESS = (2, 3)
SHEET_BEND = 0.06  # bend amplitude, as a fraction of the stack's depth
FIBRE_RADIUS = (1.5, 2.5)
FIBRES_PER_VOXEL = 14 / 96**3
PORE_RADIUS = (2.0, 4.0)
PORES_PER_VOXEL = 60 / 96**3
IGNORE_FRACTION = (0.15, 0.30)  # of the volume along the slab's axis
MARGIN = 4  # object centres keep this far from the faces and from the ignore slab


@dataclass(frozen=True)
class MulticlassVolume:
    image: np.ndarray  # uint8
    label: np.ndarray  # uint8 in SPEC.valid_values
    sheet_axis: int  # the axis the sheets are stacked along
    ignore_axis: int  # the axis the unlabelled slab is cut across
    ignore_slab: slice  # its extent along ignore_axis


def _smooth(rng: np.random.Generator, plane: tuple[int, int], n_ctrl: int) -> np.ndarray:
    """A smooth random field in [-1, 1] over a plane, from Gaussian bumps on an n_ctrl grid."""
    coef = rng.standard_normal((n_ctrl, n_ctrl))
    field = smooth_basis(plane[0], n_ctrl) @ coef @ smooth_basis(plane[1], n_ctrl).T
    return field / max(float(np.abs(field).max()), 1e-6)


def _sheets(rng: np.random.Generator, shape: tuple[int, int, int], axis: int) -> list[np.ndarray]:
    """One bool mask per sheet: a curved surface of 2 or 3 voxels normal to `axis`."""
    depth = shape[axis]
    plane = tuple(s for a, s in enumerate(shape) if a != axis)
    n = int(np.clip(round(depth / SHEET_PITCH), 2, 4))
    pitch = (depth - 2 * MARGIN) / n
    depths = np.arange(depth, dtype=np.float32).reshape(-1, 1, 1)
    masks = []
    for k in range(n):
        centre = MARGIN + pitch * (k + 0.5) + rng.uniform(-0.15, 0.15) * pitch
        # A bend smaller than half the pitch, so neighbouring sheets never meet.
        bend = min(SHEET_BEND * depth, 0.3 * pitch) * _smooth(rng, plane, 3)
        thickness = int(rng.integers(SHEET_THICKNESS[0], SHEET_THICKNESS[1] + 1))
        inside = np.abs(depths - (centre + bend)[None]) < thickness / 2
        masks.append(np.moveaxis(inside, 0, axis))
    return masks


def _inside_point(
    rng: np.random.Generator, shape: tuple[int, int, int], axis: int, labelled: slice
) -> np.ndarray:
    """A random point MARGIN voxels inside the volume and inside the labelled part of `axis`."""
    low = np.full(3, MARGIN, np.float64)
    high = np.array(shape, np.float64) - 1 - MARGIN
    low[axis] = max(low[axis], labelled.start + MARGIN)
    high[axis] = min(high[axis], labelled.stop - 1 - MARGIN)
    return rng.uniform(low, high)


def _fibre(
    grid: list[np.ndarray], point: np.ndarray, radius: float, rng: np.random.Generator
) -> np.ndarray:
    """A straight tube of `radius` through `point` along a random direction."""
    direction = rng.standard_normal(3)
    direction /= np.linalg.norm(direction)
    rel = [g - p for g, p in zip(grid, point, strict=True)]
    along = sum(r * d for r, d in zip(rel, direction, strict=True))
    squared = sum(r * r for r in rel) - along * along
    return squared < radius * radius


def _pore(
    shape: tuple[int, int, int], point: np.ndarray, radius: float
) -> tuple[tuple, np.ndarray]:
    """A ball: the box around it and its mask within the box."""
    lo = np.maximum(np.floor(point - radius).astype(int), 0)
    hi = np.minimum(np.ceil(point + radius).astype(int) + 1, shape)
    box = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi, strict=True))
    grid = np.ogrid[box]
    squared = sum((g - p) ** 2 for g, p in zip(grid, point, strict=True))
    return box, squared <= radius * radius


def synthesize_multiclass(
    shape: tuple[int, int, int], rng: np.random.Generator
) -> MulticlassVolume:
    """One image/label pair of the multiclass preset (see the module docstring)."""
    shape = tuple(int(s) for s in shape)  # type: ignore[assignment]
    values = SPEC.labels
    sheet_axis = int(rng.integers(3))
    ignore_axis = int(rng.choice([a for a in range(3) if a != sheet_axis]))
    side = shape[ignore_axis]
    width = int(round(rng.uniform(*IGNORE_FRACTION) * side))
    at_start = bool(rng.integers(2))
    ignore_slab = slice(0, width) if at_start else slice(side - width, side)
    labelled = slice(width, side) if at_start else slice(0, side - width)

    label = np.full(shape, values["background"], np.uint8)
    image = np.full(shape, INTENSITY["background"], np.float32)

    def paint(name: str, where: np.ndarray | tuple, mask: np.ndarray | None = None) -> None:
        level = INTENSITY[name] + rng.uniform(-OBJECT_SPREAD, OBJECT_SPREAD)
        if mask is None:
            label[where] = values[name]
            image[where] = level
        else:
            label[where][mask] = values[name]
            image[where][mask] = level

    for mask in _sheets(rng, shape, sheet_axis):
        paint("sheet", mask)
    grid = np.ogrid[: shape[0], : shape[1], : shape[2]]
    n_fibres = max(2, int(rng.poisson(np.prod(shape) * FIBRES_PER_VOXEL)))
    for _ in range(n_fibres):
        point = _inside_point(rng, shape, ignore_axis, labelled)
        paint("fibre", _fibre(grid, point, rng.uniform(*FIBRE_RADIUS), rng))
    n_pores = max(3, int(rng.poisson(np.prod(shape) * PORES_PER_VOXEL)))
    for _ in range(n_pores):
        point = _inside_point(rng, shape, ignore_axis, labelled)
        box, ball = _pore(shape, point, rng.uniform(*PORE_RADIUS))
        paint("pore", box, ball)

    index = [slice(None)] * 3
    index[ignore_axis] = ignore_slab
    label[tuple(index)] = SPEC.ignore

    ndimage.gaussian_filter(image, sigma=rng.uniform(*BLUR_SIGMA), output=image)
    direction = rng.standard_normal(3)
    direction *= DRIFT / np.linalg.norm(direction)
    for a, size in enumerate(shape):
        ramp = np.linspace(-0.5, 0.5, size, dtype=np.float32) * np.float32(direction[a])
        image += ramp.reshape([-1 if b == a else 1 for b in range(3)])
    image += NOISE_SIGMA * rng.standard_normal(shape, dtype=np.float32)
    np.clip(image, 0, 255, out=image)
    np.rint(image, out=image)
    return MulticlassVolume(image.astype(np.uint8), label, sheet_axis, ignore_axis, ignore_slab)


def write_dataset_yaml(out: Path) -> Path:
    """`out`/dataset.yaml declaring `SPEC` (labels and ignore); load_dataset_spec reads it back."""
    path = Path(out) / DATASET_FILE
    text = yaml.safe_dump({"labels": dict(SPEC.labels), "ignore": SPEC.ignore}, sort_keys=False)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def write_multiclass_demo(
    out: Path,
    *,
    n_train: int = N_TRAIN,
    n_test: int = N_TEST,
    shape: Sequence[int] = SHAPE,
    scroll_ids: Sequence[int] = SCROLL_IDS,
    seed: int = 0,
) -> DatasetSpec:
    """Write the multiclass demo to `out`: dataset.yaml, {train,test}_{images,labels}/<id>.tif
    and {train,test}.csv, as `demo_data.generate_demo` writes the binary one (test labels
    included, so predictions can be scored). Returns the spec dataset.yaml declares."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or min(shape) < MIN_SIDE:
        raise CtsegError(f"shape must be 3 sides of >= {MIN_SIDE} voxels, got {shape}")
    if seed < 0:
        raise CtsegError(f"seed must be >= 0, got {seed}")
    records = demo_records(n_train, n_test, scroll_ids)
    out = Path(out)
    write_dataset_yaml(out)
    for record in Progress(records, desc="demo-data", unit="volume"):
        rng = np.random.default_rng([seed, int(record["id"])])
        volume = synthesize_multiclass(shape, rng)  # type: ignore[arg-type]
        split, name = record["split"], f"{record['id']}.tif"
        _write_tif(out / f"{split}_images" / name, volume.image)
        _write_tif(out / f"{split}_labels" / name, volume.label)
        del volume
    # The tables come last, so a listed id always has its files.
    for split in ("train", "test"):
        _write_csv(out / f"{split}.csv", [r for r in records if r["split"] == split])
    return DatasetSpec(SPEC, None)
