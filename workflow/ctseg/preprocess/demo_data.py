"""Synthetic CT volumes in the Kaggle "Vesuvius Challenge - Surface Detection" layout.

Each volume holds a stack of curved papyrus-like sheets, 2 to 4 voxels thick (label 1), some of
them pressed into contact and some torn by gaps. The image is the sheets rendered brighter than
the background, blurred, with a slow intensity drift and Gaussian noise. About half of every
label volume is the ignore label 2, in a few large smooth regions, as in the real data.

This is the `simple` preset, the default: easy enough that a model separates the sheets almost
perfectly. The `realistic` preset (`ctseg.preprocess.demo_realistic`) adds what makes real scroll CT
hard: sheets pressed together over long stretches, varying thickness, low and drifting contrast,
partial-volume blur, holes, ring and streak artefacts, bright inclusions, and more ignore.

Ids and scroll ids depend only on the counts (`demo_records`), so the Snakefile can name every
output before anything runs; voxel content depends on the seed and the record id only.

Measured on a 2-core machine: the default set (4 train + 2 test volumes of 96^3) takes about
0.7 s (0.9 s for the whole `ctseg demo-data` command); one 320^3 volume, the real size, takes
about 2.5 s and peaks at about 330 MB resident for the whole process.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tifffile
from scipy import ndimage

from ctseg.io import CtsegError, atomic_path, check_id
from ctseg.preprocess.demo_realistic import synthesize_realistic
from ctseg.preprocess.demo_volume import DemoVolume, smooth_basis
from ctseg.progress import Progress

MIN_SIDE = 16
PRESETS = ("simple", "realistic")
IGNORE_FRACTION = 0.55  # real volumes: ~58% label 2
SHEET_PITCH = 18  # voxels between sheet centres on average
MARGIN = 3  # keeps the thickest sheet (4 voxels) off the volume faces
BACKGROUND = 60.0
NOISE_SIGMA = 12.0

# Ids are a bijective scramble of the record index, so they look like Kaggle's random numeric
# ids yet can never collide: train takes the even indices, test the odd ones.
_ID_BASE = 1_000_000_000
_ID_PRIME = 899_999_963
_ID_MULTIPLIER = 387_420_489  # 3**18, coprime to the prime


def _check_counts(n_train: int, n_test: int, scroll_ids: Sequence[int]) -> None:
    if n_train < 1:
        raise CtsegError(f"n_train must be >= 1, got {n_train}")
    if n_test < 0:
        raise CtsegError(f"n_test must be >= 0, got {n_test}")
    if not scroll_ids:
        raise CtsegError("scroll_ids must name at least one scroll id")
    if len(set(scroll_ids)) != len(scroll_ids):
        raise CtsegError(f"scroll_ids has duplicates: {list(scroll_ids)}")


def _record_id(index: int) -> str:
    return str(_ID_BASE + ((index + 1) * _ID_MULTIPLIER) % _ID_PRIME)


def demo_records(n_train: int, n_test: int, scroll_ids: Sequence[int]) -> list[dict]:
    """Records {id, scroll_id, split} for the demo set; a function of the counts alone."""
    _check_counts(n_train, n_test, scroll_ids)
    records = []
    for split, count, parity in (("train", n_train, 0), ("test", n_test, 1)):
        for i in range(count):
            record_id = check_id(_record_id(2 * i + parity), "demo-data")
            scroll_id = int(scroll_ids[i % len(scroll_ids)])
            records.append({"id": record_id, "scroll_id": scroll_id, "split": split})
    return records


def demo_dataset(out: str, demo: dict) -> dict[str, dict]:
    """The demo's records as the workflow plans them, by id: `demo_records` of config `demo`,
    with the image and label files `generate_demo` writes under `out`."""
    rows = demo_records(demo["n_train"], demo["n_test"], demo["scroll_ids"])
    for row in rows:
        row["image"] = f"{out}/{row['split']}_images/{row['id']}.tif"
        row["label"] = f"{out}/{row['split']}_labels/{row['id']}.tif"
    return {row["id"]: row for row in rows}


def _smooth_field(rng: np.random.Generator, shape: Sequence[int], n_ctrl: int) -> np.ndarray:
    """Random smooth field in [-1, 1]: Gaussian bumps on an n_ctrl grid with random weights.

    The bumps are separable, so the field is built one axis at a time and costs a few matrix
    products even at 320^3, instead of a full-volume Gaussian filter.
    """
    field = rng.standard_normal((n_ctrl,) * len(shape)).astype(np.float32)
    for size in shape:
        field = np.tensordot(field, smooth_basis(size, n_ctrl), axes=([0], [1]))
    # max(max, -min) rather than abs().max(): no full-size temporary at 320^3.
    field /= max(float(field.max()), -float(field.min()), 1e-6)
    return field


def _paint(
    volume: np.ndarray,
    axis: int,
    start: np.ndarray,
    thickness: np.ndarray,
    keep: np.ndarray,
    value: float | np.ndarray,
) -> None:
    """Write `value` into each kept column, from `start` for `thickness` voxels along `axis`."""
    u, v = np.nonzero(keep)
    start, thickness = start[u, v], thickness[u, v]
    values = value[u, v] if isinstance(value, np.ndarray) else value
    plane_axes = [a for a in range(3) if a != axis]
    for offset in range(int(thickness.max(initial=0))):
        sel = thickness > offset
        index: list[np.ndarray] = [np.empty(0, np.intp)] * 3
        index[axis] = start[sel] + offset
        index[plane_axes[0]], index[plane_axes[1]] = u[sel], v[sel]
        volume[tuple(index)] = values[sel] if isinstance(values, np.ndarray) else values


def _holes(
    rng: np.random.Generator, plane: tuple[int, int], count: int, avoid: list[tuple[float, ...]]
) -> np.ndarray:
    """Irregular gaps well inside the plane (so they are holes, not bites out of the edge)."""
    mask = np.zeros(plane, bool)
    side = min(plane)
    uu, vv = np.ogrid[: plane[0], : plane[1]]
    for _ in range(count):
        radii = rng.uniform(max(2.0, 0.05 * side), max(3.0, 0.12 * side), size=2)
        reach = 1.25 * radii + 2  # the ragged edge reaches at most sqrt(1.5) * radius
        for _attempt in range(50):
            centre = rng.uniform(reach, np.array(plane) - 1 - reach)
            # A gap on the contact patch would undo the touch the patch is there to make.
            if all(np.hypot(*(centre - c[:2])) > 2 * c[2] + reach.max() for c in avoid):
                break
        else:
            continue
        ragged = 1 + 0.5 * _smooth_field(rng, plane, max(6, side // 6))
        mask |= ((uu - centre[0]) / radii[0]) ** 2 + ((vv - centre[1]) / radii[1]) ** 2 < ragged
    return mask


def _sheets(
    rng: np.random.Generator, shape: tuple[int, int, int], axis: int
) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray]], tuple, tuple]:
    """Per sheet: (start, thickness, keep) over the plane normal to `axis`."""
    depth = shape[axis]
    plane = tuple(s for a, s in enumerate(shape) if a != axis)
    n = int(np.clip(round(depth / SHEET_PITCH), 2, 250))
    span = depth - 2 * MARGIN

    # Positive smooth gap weights, normalised so the stack always spans the volume exactly:
    # sheets stay ordered and inside, with gaps that widen and narrow like real wraps.
    weights = np.stack([1 + 0.25 * _smooth_field(rng, plane, 3) for _ in range(n + 1)])
    centres = MARGIN + span * np.cumsum(weights, axis=0)[:n] / weights.sum(axis=0)
    # A common bend; it vanishes at both margins and is too weak to make sheets cross.
    bend = rng.uniform(0.05, 0.09) * span * _smooth_field(rng, plane, 3)
    centres += bend * np.sin(np.pi * (centres - MARGIN) / span)

    thickness = []
    for _ in range(n):
        f = _smooth_field(rng, plane, 4)
        q50, q85 = np.quantile(f, [0.5, 0.85])  # median thickness 2, as in the real data
        thickness.append(2 + (f > q50).astype(np.int64) + (f > q85))

    uu, vv = np.ogrid[: plane[0], : plane[1]]
    n_touch = max(1, (n - 1) // 3)
    touching = tuple(
        (int(k), int(k) + 1) for k in np.sort(rng.choice(n - 1, n_touch, replace=False))
    )
    patches: dict[int, list[tuple[float, ...]]] = {k: [] for k in range(n)}
    for k, _ in touching:
        cu, cv = rng.uniform(0.25, 0.75, size=2) * np.array(plane)
        sigma = rng.uniform(0.08, 0.14) * min(plane)
        # A flat-topped bump, so the contact is a patch and not a single point.
        bump = np.minimum(1.0, 1.5 * np.exp(-((uu - cu) ** 2 + (vv - cv) ** 2) / (2 * sigma**2)))
        # Centre distance at which the two rounded voxel runs abut or share one voxel.
        contact = (thickness[k] + thickness[k + 1]) / 2 - 0.5
        shift = bump * np.maximum(centres[k + 1] - centres[k] - contact, 0) / 2
        centres[k] += shift
        centres[k + 1] -= shift
        patches[k].append((cu, cv, sigma))
        patches[k + 1].append((cu, cv, sigma))

    hole_counts = rng.integers(0, 3, size=n)
    if hole_counts.sum() == 0:
        hole_counts[rng.integers(n)] = 1
    sheets = []
    for k in range(n):
        start = np.floor(centres[k] - thickness[k] / 2 + 0.5).astype(np.int64)
        start = np.clip(start, 0, depth - thickness[k])
        keep = ~_holes(rng, plane, int(hole_counts[k]), patches[k])
        sheets.append((start, thickness[k], keep))
    return sheets, touching, tuple(int(c) for c in hole_counts)


def synthesize_volume(shape: tuple[int, int, int], rng: np.random.Generator) -> DemoVolume:
    """One image/label pair; the sheets are stacked along a random axis."""
    axis = int(rng.integers(3))
    sheets, touching, holes = _sheets(rng, shape, axis)
    plane = tuple(s for a, s in enumerate(shape) if a != axis)

    sheet_ids = np.zeros(shape, np.uint8)
    for k, (start, thickness, keep) in enumerate(sheets):
        _paint(sheet_ids, axis, start, thickness, keep, k + 1)
    # Labels before the image, so the float32 ignore field and the float32 image (130 MB each
    # at 320^3) are never alive at the same time.
    ignore_field = _smooth_field(rng, shape, 4)
    threshold = np.quantile(ignore_field[::4, ::4, ::4], IGNORE_FRACTION)
    label = (sheet_ids > 0).astype(np.uint8)
    label[ignore_field < threshold] = 2
    del ignore_field

    image = np.full(shape, BACKGROUND, np.float32)
    for start, thickness, keep in sheets:
        density = rng.uniform(150, 200) * (1 + 0.1 * _smooth_field(rng, plane, 5))
        _paint(image, axis, start, thickness, keep, density)
    # In place throughout: at 320^3 each float32 copy of the image costs 130 MB.
    ndimage.gaussian_filter(image, sigma=rng.uniform(0.7, 1.2), output=image)
    direction = rng.standard_normal(3)
    direction *= rng.uniform(40, 70) / np.linalg.norm(direction)
    for a, size in enumerate(shape):
        ramp = np.linspace(-0.5, 0.5, size, dtype=np.float32) * np.float32(direction[a])
        image += ramp.reshape([-1 if b == a else 1 for b in range(3)])
    for z in range(0, shape[0], 16):
        slab = image[z : z + 16]
        slab += NOISE_SIGMA * rng.standard_normal(slab.shape, dtype=np.float32)
    np.clip(image, 0, 255, out=image)
    np.rint(image, out=image)
    return DemoVolume(image.astype(np.uint8), label, sheet_ids, axis, touching, holes)


def synthesize(shape: tuple[int, int, int], rng: np.random.Generator, preset: str) -> DemoVolume:
    """One image/label pair of the named preset."""
    if preset == "simple":
        return synthesize_volume(shape, rng)
    if preset == "realistic":
        return synthesize_realistic(shape, rng)
    raise CtsegError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")


def _write_tif(path: Path, volume: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        # One page per z slice; no datetime tag is written, so equal data gives equal bytes.
        tifffile.imwrite(tmp, volume, photometric="minisblack")


def _write_csv(path: Path, records: list[dict]) -> None:
    lines = ["id,scroll_id"] + [f"{r['id']},{r['scroll_id']}" for r in records]
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")


def generate_demo(
    out: Path,
    *,
    n_train: int,
    n_test: int,
    shape: tuple[int, int, int],
    scroll_ids: Sequence[int],
    seed: int,
    preset: str = "simple",
) -> None:
    """Write the demo dataset to `out`: {train,test}_{images,labels}/<id>.tif and {train,test}.csv.

    test_labels is not part of the Kaggle layout; it is kept so predictions can be scored.
    `preset` is "simple" (the default) or "realistic" (see the module docstring).
    """
    shape = tuple(int(s) for s in shape)  # type: ignore[assignment]
    if len(shape) != 3 or min(shape) < MIN_SIDE:
        raise CtsegError(f"shape must be 3 sides of >= {MIN_SIDE} voxels, got {shape}")
    if seed < 0:
        raise CtsegError(f"seed must be >= 0, got {seed}")
    if preset not in PRESETS:
        raise CtsegError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    records = demo_records(n_train, n_test, scroll_ids)
    out = Path(out)
    for record in Progress(records, desc="demo-data", unit="volume"):
        rng = np.random.default_rng([seed, int(record["id"])])
        volume = synthesize(shape, rng, preset)
        split, name = record["split"], f"{record['id']}.tif"
        _write_tif(out / f"{split}_images" / name, volume.image)
        _write_tif(out / f"{split}_labels" / name, volume.label)
        del volume  # else it stays alive while the next one is built: +100 MB at 320^3
    # The tables come last, so a listed id always has its files.
    for split in ("train", "test"):
        _write_csv(out / f"{split}.csv", [r for r in records if r["split"] == split])
