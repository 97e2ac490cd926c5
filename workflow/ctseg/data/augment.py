"""Augmentation for training patches: exact geometry in the worker, intensity on the device.

Geometry (applied in the data worker, identically to the image and every target):
- random flips per axis and axis permutations, symmetries of the voxel grid (the 48 symmetries
  of the cube). Label, ignore, foreground and the clipped signed distance of a flipped/permuted
  label are exactly the flipped/permuted precomputed ones (the tests check this bit for bit).
  The skeleton and tube move with the label and remain a medial surface of it, but they are
  not bit-identical to re-skeletonising the moved label: skimage's thinning removes pixels in
  a fixed directional order, so a flipped 2-voxel sheet keeps the other layer (measured: within
  2 voxels for ``medial_surface``; ``lee3d`` differs far more). Computing targets per sample
  before augmenting, as `runtime_targets` does, gives the same samples as precomputing.
  Permutations are only drawn among axes whose patch sizes are equal and whose voxel spacings
  (``augment.spacing``, default isotropic) are equal; swapping axes of different spacing would
  make the distances wrong, and of different size would change the patch shape.
  `check_permutation` refuses such a permutation.
- elastic deformation and isotropic scaling, both off by default. When switched on they warp
  the image with linear interpolation and every target with nearest neighbour
  (`scipy.ndimage.map_coordinates`, order 0). That only *approximates* the targets: a warped
  skeleton is not the skeleton of the warped label, and a warped distance map is not the
  distance map of the warped label (scaling also scales distances). Voxels sampled from outside
  the patch get the padding values (image 0, label 2 = ignore, sdt +clip distance).

Intensity (scale, shift, gamma, noise) touches the image only. Its parameters are drawn in the
worker (so the stream stays a function of the seed and the sample index) and travel as a small
float32 vector `aug` beside the uint8 image; `apply_intensity` applies them on the device after
the uint8 -> float conversion, so batches cross the bus as uint8.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ctseg.io import CtsegError

# Layout of the per-sample `aug` vector. Unapplied samples carry the identity values so the
# device code needs no branches.
AUG_FIELDS = ("apply", "scale", "shift", "gamma", "noise_std", "noise_seed")
AUG_IDENTITY = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 0.0], np.float32)
# noise_seed travels as float32; below 2**24 every integer is exact.
_NOISE_SEED_LIMIT = 1 << 24

DEFAULT_ELASTIC = {"magnitude": 3.0, "grid": 4}
DEFAULT_SCALE = (0.85, 1.15)


@dataclass(frozen=True)
class Geometry:
    """A cube symmetry (permutation then flips) and an optional warp, drawn once per sample."""

    perm: tuple[int, ...]
    flips: tuple[bool, ...]
    warp: np.ndarray | None = None  # (3, Z, Y, X) float32 sample coordinates, or None


def check_augment(augment: Mapping[str, Any]) -> None:
    """Raise CtsegError naming the key of a bad ``data.augment`` value."""
    known = {"flip", "permute", "intensity", "elastic", "scale", "spacing"}
    unknown = sorted(set(augment) - known)
    if unknown:
        raise CtsegError(f"augment: unknown keys {unknown}; expected some of {sorted(known)}")

    def pair(key: str, value: Any, positive: bool = False) -> None:
        ok = isinstance(value, Sequence) and len(value) == 2 and float(value[0]) <= float(value[1])
        if not ok or (positive and float(value[0]) <= 0):
            need = "positive " if positive else ""
            raise CtsegError(
                f"augment.{key}: expected [low, high] with {need}low <= high, got {value!r}"
            )

    intensity = augment.get("intensity") or {}
    if not isinstance(intensity, Mapping):
        raise CtsegError(f"augment.intensity: expected a mapping, got {intensity!r}")
    if not 0.0 <= float(intensity.get("prob", 0.0)) <= 1.0:
        raise CtsegError(f"augment.intensity.prob must be in [0, 1], got {intensity['prob']!r}")
    for key in ("scale", "shift", "gamma"):
        if intensity.get(key) is not None:
            pair(f"intensity.{key}", intensity[key], positive=key != "shift")
    if float(intensity.get("noise_std") or 0.0) < 0:
        raise CtsegError(f"augment.intensity.noise_std must be >= 0, got {intensity['noise_std']}")
    scale = augment.get("scale", False)
    if scale not in (True, False, None):
        pair("scale", scale, positive=True)
    elastic = augment.get("elastic", False)
    if isinstance(elastic, Mapping):
        spec = dict(DEFAULT_ELASTIC, **elastic)
        if int(spec["grid"]) < 2 or float(spec["magnitude"]) < 0:
            raise CtsegError(f"augment.elastic: need grid >= 2 and magnitude >= 0, got {spec}")
    spacing_of(augment)


def spacing_of(augment: Mapping[str, Any]) -> tuple[float, ...]:
    """Voxel spacing z, y, x from ``augment.spacing`` (default isotropic)."""
    spacing = augment.get("spacing") or (1.0, 1.0, 1.0)
    if len(spacing) != 3:
        raise CtsegError(f"augment.spacing: expected 3 values, got {spacing!r}")
    return tuple(float(s) for s in spacing)


def permutable_groups(
    patch_size: Sequence[int], spacing: Sequence[float] = (1.0, 1.0, 1.0)
) -> list[list[int]]:
    """Axes that may be exchanged: equal patch size and equal voxel spacing."""
    groups: dict[tuple[int, float], list[int]] = {}
    for axis, key in enumerate(zip(patch_size, spacing, strict=True)):
        groups.setdefault((int(key[0]), float(key[1])), []).append(axis)
    return list(groups.values())


def check_permutation(
    perm: Sequence[int], shape: Sequence[int], spacing: Sequence[float] = (1.0, 1.0, 1.0)
) -> None:
    """Raise CtsegError unless `perm` only exchanges axes of equal size and spacing."""
    if sorted(perm) != list(range(len(shape))):
        raise CtsegError(f"axis permutation {tuple(perm)} is not a permutation of {len(shape)}")
    for out_axis, in_axis in enumerate(perm):
        if shape[out_axis] != shape[in_axis] or spacing[out_axis] != spacing[in_axis]:
            raise CtsegError(
                f"axis permutation {tuple(perm)} exchanges axes {in_axis} and {out_axis} of "
                f"sizes {shape[in_axis]} and {shape[out_axis]} (spacing {spacing[in_axis]} and "
                f"{spacing[out_axis]}); only axes of equal size and spacing may be permuted"
            )


def draw_geometry(
    rng: np.random.Generator, patch_size: Sequence[int], augment: Mapping[str, Any]
) -> Geometry:
    """Draw flips, an allowed permutation and (if enabled) a warp, in a fixed order."""
    ndim = len(patch_size)
    perm = list(range(ndim))
    if augment.get("permute", False):
        for group in permutable_groups(patch_size, spacing_of(augment)):
            if len(group) > 1:
                shuffled = rng.permutation(group)
                for axis, source in zip(group, shuffled, strict=True):
                    perm[axis] = int(source)
    flips = (
        tuple(bool(f) for f in rng.random(ndim) < 0.5)
        if augment.get("flip", False)
        else (False,) * ndim
    )
    warp = _draw_warp(rng, patch_size, augment)
    return Geometry(tuple(perm), flips, warp)


def _draw_warp(
    rng: np.random.Generator, patch_size: Sequence[int], augment: Mapping[str, Any]
) -> np.ndarray | None:
    elastic = augment.get("elastic", False)
    scale = augment.get("scale", False)
    if not elastic and not scale:
        return None
    shape = tuple(int(s) for s in patch_size)
    centre = (np.array(shape, np.float32) - 1) / 2
    coords = np.indices(shape, dtype=np.float32)
    if scale:
        low, high = DEFAULT_SCALE if scale is True else scale
        # Sampling at centre + (x - centre) / s magnifies the content by s.
        factor = np.float32(np.exp(rng.uniform(np.log(low), np.log(high))))
        coords = centre[:, None, None, None] + (coords - centre[:, None, None, None]) / factor
    if elastic:
        spec = dict(DEFAULT_ELASTIC, **(elastic if isinstance(elastic, Mapping) else {}))
        from scipy import ndimage  # warps are off by default; spare workers the import

        grid = int(spec["grid"])
        coarse = rng.normal(0.0, float(spec["magnitude"]), (len(shape), grid, grid, grid))
        for axis in range(len(shape)):
            zoom = [s / grid for s in shape]
            coords[axis] += ndimage.zoom(coarse[axis].astype(np.float32), zoom, order=1)[
                tuple(slice(0, s) for s in shape)
            ]
    return coords


def apply_geometric(
    array: np.ndarray,
    geometry: Geometry,
    *,
    order: int = 0,
    cval: float = 0.0,
    spacing: Sequence[float] = (1.0, 1.0, 1.0),
) -> np.ndarray:
    """Apply `geometry` to one patch; returns a view where possible (no copy for flips/perms).

    `order` and `cval` only matter for a warp: order 1 for the image, 0 for every target, with
    `cval` the array's padding value.
    """
    check_permutation(geometry.perm, array.shape, spacing)
    out = array
    if geometry.warp is not None:
        from scipy import ndimage

        # scipy has no float16 kernels; the detour is exact for order 0 (values are copied).
        work = out.astype(np.float32) if out.dtype == np.float16 else out
        out = ndimage.map_coordinates(
            work, geometry.warp, order=order, mode="constant", cval=cval, prefilter=False
        ).astype(array.dtype, copy=False)
    if geometry.perm != tuple(range(array.ndim)):
        out = out.transpose(geometry.perm)
    flip_axes = tuple(axis for axis, flip in enumerate(geometry.flips) if flip)
    if flip_axes:
        out = np.flip(out, flip_axes)
    return out


def source_view(
    out: np.ndarray, geometry: Geometry, spacing: Sequence[float] = (1.0, 1.0, 1.0)
) -> np.ndarray:
    """A view of `out` in patch coordinates: writing patch P into it leaves `out` equal to
    ``apply_geometric(P, geometry)`` (flips and permutation only; warps need a real resample).

    This lets the reader write straight from the memmap into the augmented layout.
    """
    if geometry.warp is not None:
        raise ValueError("source_view cannot express a warp")
    check_permutation(geometry.perm, out.shape, spacing)
    flip_axes = tuple(axis for axis, flip in enumerate(geometry.flips) if flip)
    view = np.flip(out, flip_axes) if flip_axes else out
    return view.transpose(np.argsort(geometry.perm))


def draw_intensity(rng: np.random.Generator, intensity: Mapping[str, Any] | None) -> np.ndarray:
    """The per-sample `aug` vector (see AUG_FIELDS); identity values when not applied."""
    params = AUG_IDENTITY.copy()
    if not intensity:
        return params
    # Always draw the same number of values, so switching one part off does not shift the
    # stream of the others.
    u = rng.random(6)
    if u[0] >= float(intensity.get("prob", 0.0)):
        return params
    scale = intensity.get("scale") or (1.0, 1.0)
    shift = intensity.get("shift") or (0.0, 0.0)
    gamma = intensity.get("gamma") or (1.0, 1.0)
    noise = float(intensity.get("noise_std") or 0.0)
    params[0] = 1.0
    params[1] = scale[0] + u[1] * (scale[1] - scale[0])
    params[2] = shift[0] + u[2] * (shift[1] - shift[0])
    # Log-uniform, so gamma and 1/gamma are equally likely.
    params[3] = np.exp(np.log(gamma[0]) + u[3] * (np.log(gamma[1]) - np.log(gamma[0])))
    params[4] = u[4] * noise
    params[5] = np.floor(u[5] * _NOISE_SEED_LIMIT)
    return params


def apply_intensity(image: torch.Tensor, aug: torch.Tensor) -> torch.Tensor:
    """Gamma, scale and shift (then clip to [0, 1]), then Gaussian noise, per sample.

    `image` is float in [0, 1], shape (B, C, Z, Y, X), on any device; `aug` is (B, 6) as drawn
    by `draw_intensity` and may stay on the host (it is read there to decide which samples get
    noise, which avoids a device sync). The noise of each sample comes from its own generator
    seeded with `noise_seed`, so it does not depend on the batch composition. Without noise the
    result stays in [0, 1]; noise is added after the clip and is not clipped.
    """
    aug_host = aug.detach().to("cpu", torch.float32)
    if not bool((aug_host[:, 0] > 0).any()):
        return image
    view = (-1,) + (1,) * (image.ndim - 1)
    params = aug_host.to(image.device, non_blocking=True)
    gamma = params[:, 3].reshape(view)
    scale = params[:, 1].reshape(view)
    shift = params[:, 2].reshape(view)
    out = torch.clamp(image.pow(gamma) * scale + shift, 0.0, 1.0)
    for i in torch.nonzero(aug_host[:, 4] > 0).flatten().tolist():
        generator = torch.Generator(device=image.device)
        generator.manual_seed(int(aug_host[i, 5]))
        noise = torch.randn(
            out.shape[1:], generator=generator, device=image.device, dtype=out.dtype
        )
        out[i].add_(noise, alpha=float(aug_host[i, 4]))
    return out
