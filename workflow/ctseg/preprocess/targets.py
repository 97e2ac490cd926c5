"""Offline training targets from a label store, computed blockwise with halos.

`compute_targets` turns a label store (Zarr v3, uint8; values as a `ctseg.labels.LabelSpec` says,
Kaggle's 0 background / 1 surface / 2 ignore by default) into the targets group of `ctseg.store`:

- ``ignore`` = spec.ignored(label) and ``foreground`` = spec.foreground(label), uint8; for a
  multi-class spec (K >= 2 classes) ``foreground`` also carries each voxel's stored class 1..K in
  bits 4-7 (1 + 16 * class), the loader's mask byte (`ctseg.store.CLASS_SHIFT`). Every target
  below is of the union of the classes;
- ``skeleton``: the medial surface of the foreground. ``distance_ridge`` (the default) is the
  ridge of the squared Euclidean distance to the nearest non-foreground voxel, saturated at
  ``RIDGE_CAP`` (255, just under 16^2): a foreground voxel whose depth is >= both of its
  neighbours' along z, y or x and > the smaller of the two. It is defined by integer comparisons
  over the six face neighbours, a set the 48 flips and axis permutations of the cube map to
  itself, so it is exactly equivariant by construction; 3-voxel sheets keep their middle plane
  and 2-voxel sheets both planes (any exactly flip-equivariant rule must keep both: the flip
  across the sheet maps one plane onto the other). Measured on the demo volume it has about as
  many voxels as ``medial_surface`` and 99.9% of either's voxels lie within one voxel of the
  other (bench/preprocess.py prints the figures). ``medial_surface`` is the union of the 2D
  skeletons (`skimage.morphology.skeletonize`, Zhang) of every slice along z, y and x, as the
  official Vesuvius training code does, each slice thinned in all 8 orientations of the square
  so that the result is exactly equivariant under the 48 flips and axis permutations of the cube
  (training augmentation then keeps it exact); ``medial_surface_fast`` thins each slice once,
  exactly as the official code does, 8 times less thinning but a flipped patch's skeleton is
  then only within a voxel or two of its own; ``lee3d`` is skimage's 3D Lee thinning, which
  collapses sheets to curves and is not equivariant either;
- ``tube``: the skeleton dilated ``tube_dilations`` times with the 6-connected structure (the
  Skeleton Recall target);
- ``sdt``: edt(background) - edt(foreground), clipped to [-d, d], float16: positive outside the
  foreground, negative inside, +-d far from any surface (also where `edt` says inf);
- ``fg_locations``: a uniform random sample of at most ``max_samples`` foreground voxels.

Blocks and halos
----------------
The volume is cut into blocks aligned to the label's chunk grid. Each block reads its own region
plus a halo, computes, and writes only its interior, which is a whole number of output chunks,
so no two blocks (or worker processes) ever write the same chunk. Memory is bounded by
``workers`` x (block + halo), never by the volume.

- Distance: a halo of ceil(d) is exact. A voxel whose clipped distance is below d has its nearest
  opposite voxel within Euclidean distance d, hence within ceil(d) along every axis, so inside
  the halo; a voxel whose true distance is >= d sees no opposite voxel closer than d in the
  halo either (the crop can only lose candidates), and both clip to d. A smaller halo (for
  example d/2) is wrong, and the tests show it.
- Tube: a 6-connected dilation by k steps reaches L1 distance k, so the tube of the block needs
  the skeleton on the block grown by k, and nothing else.
- Skeleton, ``distance_ridge``: exact everywhere. The ridge reads the depth of the grown block
  and one voxel around it; a depth there that is below 16^2 has its nearest background voxel
  within 16 voxels along every axis, so inside a halo of ``SKELETON_HALO`` beyond that ring, and
  a deeper one saturates at ``RIDGE_CAP`` in the crop as in the whole volume. The read halo is
  k + 1 + 16, and one multi-label `edt` pass over the whole crop gives both the depth and the
  distance (the distance only needs ceil(d) of it).
- Skeleton, thinning methods: 2D thinning is not local. Zhang thinning peels one layer per pass, and
  a cut at a crop edge moves inward by at most one pixel per sub-pass, so the skeleton of a slice is
  decided by context about as wide as half the widest cross-section of the foreground in that slice.
  Each slice therefore gets ``SKELETON_HALO`` (16) voxels of in-plane context around the grown
  block. **Limit:** the blockwise skeleton and tube equal the whole-volume ones wherever every 2D
  cross-section is at most ``2 * SKELETON_HALO`` = 32 voxels wide, i.e. every 8-connected component
  of every z, y and x slice has in-slice depth (distance to the nearest background pixel in that
  slice) <= 16. For a flat-ish sheet of thickness t that means tilted at least asin(t / 32) from
  every slicing plane: 3.6 degrees for t = 2, 7.2 degrees for t = 4; for a cylindrical wrap of
  radius R, whose tangent slices are about 2 * sqrt(2 R t) wide, R <= 64 at t = 2. Wider cross-
  sections (a sheet lying in a slicing plane, a solid blob) have a 2D skeleton that depends on all
  of the cross-section, which no bounded halo provides: there, and only there (plus the k-voxel tube
  around it), the result can differ. Measured with blocks of 32: planar sheets 2-4 thick at tilts of
  3-45 degrees, spiral sheets, 24 random volumes of curved sheets, and the test volume's solid cube:
  no difference outside such components, exact wherever none exist (depth 12-16 included), and where
  they exist a few dozen voxels out of thousands. ``lee3d`` gets the same halo in 3D, with the same
  caveat.

Cost
----
``distance_ridge``, measured on the same 256^3 volume and machine (bench/preprocess.py, best of two,
lightly loaded): 0.85-1.05 s for the whole step in one process, against 2.4-3.2 s for
``medial_surface`` and 1.2-1.9 s for ``medial_surface_fast``. Its critical path is now zarr writing
the five arrays on the write-behind thread (0.7 s beside the compute), then the multi-label `edt`
over the crops (0.3 s).

For the thinning methods, per block: one label read, one multi-label `edt` pass (in a background
thread: it releases the GIL, 2D thinning does not), per-slice thinning on foreground bounding boxes,
and five writes that overlap the next block. Measured on a 256^3 volume of sheets (5% foreground,
half ignore, 128^3 blocks, a shared 2-core machine) against whole-volume scipy EDT twice plus
skimage 3D skeletonize (16-20 s, 1.03 GB peak RSS): ``workers=1`` 2.2-2.8 s at 0.17 GB;
``workers=2`` 1.8-2.2 s with an 87 MB parent and two 140 MB workers (summed PSS about 0.25 GB).
About 3 s of CPU in all: edt 40%, zarr writes 25%, thinning 23%.

Sampling
--------
Every voxel gets a key from a counter-based hash (splitmix64) of (seed, linear index); the
sample is the ``max_samples`` foreground voxels with the smallest keys, i.e. a uniform random
sample without replacement. Keys do not depend on how the volume is cut, so the sample is the
same for every block shape and worker count; blocks hand back their own smallest keys and the
merge keeps O(max_samples) memory.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import (
    FIRST_COMPLETED,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import edt
import numpy as np
import zarr
from scipy import ndimage
from skimage.morphology import skeletonize

from ctseg.io import CtsegError, fresh_output
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.machine import available_cpus
from ctseg.progress import Progress
from ctseg.store import (
    CLASS_SHIFT,
    MAX_CLASSES,
    TARGET_VOLUMES,
    create_in_group,
    open_volume,
)

SkeletonMethod = Literal["distance_ridge", "medial_surface", "medial_surface_fast", "lee3d"]
SKELETON_METHODS: tuple[str, ...] = (
    "distance_ridge",
    "medial_surface",
    "medial_surface_fast",
    "lee3d",
)
# Context around each block for the skeleton: in-plane context for 2D thinning, and the depth
# up to which `distance_ridge` sees exact distances. See the module docstring.
SKELETON_HALO = 16
# `distance_ridge` saturates squared depths here: 255 < SKELETON_HALO**2, so a crop with a halo
# of SKELETON_HALO gives every voxel the same saturated depth as the whole volume; uint8 too.
RIDGE_CAP = 255

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
Region = tuple[slice, slice, slice]
Spacing = tuple[float, float, float]  # z, y, x voxel size


# ----------------------------------------------------------------------------- the maths


def _check_label_values(label: np.ndarray, where: str, labels: LabelSpec = KAGGLE) -> None:
    """Raise unless every value is one of the spec's (0, 1 or 2 for Kaggle's); cheaply for
    unsigned ints whose valid values are 0..n, the normal case."""
    if label.size == 0:
        return
    valid = labels.valid_values
    if label.dtype.kind == "u" and valid == tuple(range(len(valid))):
        bad = int(label.max()) > valid[-1]
    else:
        bad = not bool(np.isin(label, valid).all())
    if bad:
        values = np.unique(label)
        shown = ", ".join(str(v) for v in values[:10]) + (", ..." if values.size > 10 else "")
        allowed = ", ".join(str(v) for v in valid[:-1]) + f" or {valid[-1]}"
        raise CtsegError(f"{where}: label values must be {allowed}; found {shown}")


def _thin_symmetric(box: np.ndarray) -> np.ndarray:
    """Union of the Zhang skeletons of `box` in all 8 orientations of the square.

    skimage's thinning peels in a fixed order, so the skeleton of a flipped or transposed slice
    is not the flipped skeleton (measured: no orientation but the identity agrees). The union
    over all 8 is equivariant by construction, which keeps the precomputed skeleton exact under
    the flips and axis permutations that training augmentation applies; it costs 8 thinnings.
    """
    out = np.zeros(box.shape, dtype=bool)
    for quarter_turns in range(4):
        turned = np.rot90(box, quarter_turns)
        out |= np.rot90(skeletonize(turned), -quarter_turns)
        out |= np.rot90(skeletonize(np.ascontiguousarray(turned.T)).T, -quarter_turns)
    return out


def _thin_slices(
    fg: np.ndarray, axis: int, keep: slice = slice(None), symmetric: bool = True
) -> np.ndarray:
    """2D Zhang skeleton of every slice of `fg` along `axis` (only slices in `keep`).

    Returns a bool array shaped like ``fg`` with `axis` cut to `keep`. Each slice is thinned on
    its foreground's bounding box only, and empty slices are skipped: skimage pads with zeros,
    so cropping away an all-zero border changes nothing, and the cost scales with the area.
    """
    stack = np.ascontiguousarray(np.moveaxis(fg, axis, 0)[keep], dtype=bool)
    out = np.zeros(stack.shape, dtype=bool)
    rows, cols = stack.any(axis=2), stack.any(axis=1)
    for i in np.flatnonzero(rows.any(axis=1)):
        r, c = np.flatnonzero(rows[i]), np.flatnonzero(cols[i])
        box = (i, slice(r[0], r[-1] + 1), slice(c[0], c[-1] + 1))
        out[box] = _thin_symmetric(stack[box]) if symmetric else skeletonize(stack[box])
    return np.moveaxis(out, 0, axis)


def _medial_surface(
    fg: np.ndarray, keep: Region | None = None, symmetric: bool = True
) -> np.ndarray:
    """Union of per-slice 2D skeletons along z, y and x, evaluated on the sub-region `keep`.

    Slices along each axis are thinned with all of `fg` as in-plane context, then cut to `keep`.
    """
    keep = keep or (slice(None),) * 3
    out: np.ndarray | None = None
    for axis in range(3):
        part = _thin_slices(fg, axis, keep[axis], symmetric)
        inplane = tuple(slice(None) if a == axis else keep[a] for a in range(3))
        part = part[inplane]
        out = part if out is None else (out | part)
    assert out is not None
    return out


def _ridge_depth(sq: np.ndarray, fg: np.ndarray) -> np.ndarray:
    """uint8 squared depth: min(squared distance to the nearest non-foreground voxel, RIDGE_CAP)
    inside the foreground (0 or 1 per voxel), 0 outside. `sq` may be inf (edt's answer where
    there is no background at all): that saturates too. Clips `sq` in place: no float copy."""
    depth = np.minimum(sq, RIDGE_CAP, out=sq).astype(np.uint8)
    depth *= fg
    return depth


def _distance_ridge(depth: np.ndarray, keep: Region | None = None) -> np.ndarray:
    """The voxels of `keep` whose depth is a ridge along z, y or x.

    A voxel is on the skeleton when, along at least one axis, its depth is >= both neighbours'
    and > the smaller one: the middle layer of an odd-thickness sheet, both middle layers of an
    even one. The rule reads only the six face neighbours and compares integers, and the set
    of axes maps to itself under every flip and axis permutation, so the skeleton of a flipped
    or permuted volume is exactly the flipped or permuted skeleton. At the volume's faces the
    missing neighbour counts as equal (edge padding, itself symmetric): a sheet cut by a face
    keeps the layer on the face where that is the deepest one. Background (depth 0) never
    qualifies; neither does a plateau, e.g. the saturated core of a region over 16 voxels deep.
    """
    # Edge padding only matters at the volume's faces: everywhere else `keep` lies at least one
    # voxel inside `depth` (the caller's halo), so the padding is never read.
    padded = np.pad(depth, 1, mode="edge")
    bounds = [
        k.indices(n)[:2] for k, n in zip(keep or (slice(None),) * 3, depth.shape, strict=True)
    ]

    def shifted(axis: int, step: int) -> np.ndarray:
        return padded[
            tuple(
                slice(lo + 1 + step * (i == axis), hi + 1 + step * (i == axis))
                for i, (lo, hi) in enumerate(bounds)
            )
        ]

    centre = shifted(0, 0)
    out = np.zeros(centre.shape, dtype=bool)
    for axis in range(3):
        before, after = shifted(axis, -1), shifted(axis, 1)
        out |= (centre >= np.maximum(before, after)) & (centre > np.minimum(before, after))
    return out


def _skeleton(fg: np.ndarray, method: str, keep: Region | None = None) -> np.ndarray:
    if method == "distance_ridge":
        sq = edt.edtsq(fg.astype(np.uint8), black_border=False)
        return _distance_ridge(_ridge_depth(sq, fg), keep)
    if method in ("medial_surface", "medial_surface_fast"):
        return _medial_surface(fg, keep, symmetric=method == "medial_surface")
    sk = skeletonize(fg.astype(bool))
    return sk if keep is None else sk[keep]


def _dilate6(mask: np.ndarray, steps: int) -> np.ndarray:
    """Binary dilation by the 6-connected cross, `steps` times, zeros beyond the edges.

    Same result as ``ndimage.binary_dilation(mask, cross, iterations=steps)`` (the tests check),
    but shift-and-OR is ~10x faster on these sizes, and the tube is computed for every block.
    """
    out = mask.astype(bool, copy=True)
    for _ in range(steps):
        prev = out.copy()
        for axis in range(3):
            n = prev.shape[axis]
            lo = [slice(None)] * 3
            hi = [slice(None)] * 3
            lo[axis], hi[axis] = slice(0, n - 1), slice(1, n)
            out[tuple(lo)] |= prev[tuple(hi)]
            out[tuple(hi)] |= prev[tuple(lo)]
    return out


def _distance_lut(clip: float) -> tuple[np.ndarray, int]:
    """float16 values of -clip(sqrt(s)) and +clip(sqrt(s)) for squared distances s <= cap.

    Squared distances are integers, so sqrt, clip and the float16 cast can be one table look-up
    per voxel, computed exactly as the reference does (float32 sqrt, clip, cast).
    """
    cap = math.floor(clip * clip) + 1  # every s >= cap clips to the same value
    d = np.float32(clip)
    dist = np.minimum(np.sqrt(np.arange(cap + 1, dtype=np.float32)), d)
    dist[cap] = d
    return np.concatenate([dist, -dist]).astype(np.float16), cap


def _signed_distance(
    fg: np.ndarray,
    clip: float,
    inner: Region | None = None,
    threads: int = 1,
    spacing: Spacing | None = None,
) -> np.ndarray:
    """Clipped signed distance (positive outside) as float16, on the sub-region `inner` of `fg`.

    One multi-label `edtsq` pass (labels 1 = background, 2 = foreground) gives each voxel the
    squared distance to the nearest voxel of the other class: edt(background)^2 outside and
    edt(foreground)^2 inside, at the cost of a single binary pass. Uniform crops skip `edt`
    (which would return inf there anyway). `spacing` (z, y, x) measures the distance in those
    units (edt's anisotropy); None is 1 voxel along every axis.
    """
    inner = inner or (slice(None),) * 3
    shape = fg[inner].shape
    if not fg.any():
        return np.full(shape, clip, dtype=np.float16)
    if fg.all():
        return np.full(shape, -clip, dtype=np.float16)
    sq = edt.edtsq(fg + np.uint8(1), black_border=False, parallel=threads, **_anisotropy(spacing))
    if spacing is not None:  # squares that are not integers: the look-up table does not apply
        return _sdt_from_distances(np.sqrt(sq[inner]), fg[inner], clip)
    return _sdt_from_squares(sq[inner], fg[inner], clip)


def _sdt_from_distances(dist: np.ndarray, fg: np.ndarray, clip: float) -> np.ndarray:
    """float16 clipped signed distance from unsigned float distances (as targets_reference)."""
    d = np.float32(clip)
    np.minimum(dist, d, out=dist)
    return np.where(fg.astype(bool), -dist, dist).astype(np.float16)


def _anisotropy(spacing: Spacing | None) -> dict[str, Spacing]:
    """edt's keyword for `spacing`, none at all for None (edt's default, 1 along every axis)."""
    return {} if spacing is None else {"anisotropy": tuple(float(s) for s in spacing)}


def _sdt_from_squares(sq: np.ndarray, fg: np.ndarray, clip: float) -> np.ndarray:
    """float16 clipped signed distance from the multi-label squared distances of `fg`."""
    lut, cap = _distance_lut(clip)
    kind = np.uint8 if lut.size <= 256 else np.uint32  # uint8 up to d = 11: less memory
    index = np.minimum(sq, cap).astype(kind)
    index += fg.astype(kind) * kind(cap + 1)  # second half of the table: negative inside
    return lut.take(index)


def targets_reference(
    label: np.ndarray,
    *,
    clip_distance: float = 8.0,
    skeleton_method: str = "distance_ridge",
    tube_dilations: int = 2,
    spacing: Spacing | None = None,
    labels: LabelSpec = KAGGLE,
) -> dict[str, np.ndarray]:
    """The same maths on the whole volume in memory: the ground truth the blockwise path must equal.

    Written from the definitions (two binary `edt` calls, scipy's dilation) so that it checks the
    blockwise shortcuts (one multi-label pass, a look-up table, shift-and-OR dilation) rather than
    sharing them. Only the per-slice thinning helper is shared; a test checks it against plain
    `skeletonize` calls. `spacing` (z, y, x) measures sdt in those units; the skeleton and tube
    stay on the voxel grid (a medial surface is a topological target).
    """
    label = np.asarray(label)
    if label.ndim != 3:
        raise CtsegError(f"label array: expected 3D, got shape {label.shape}")
    _check_label_values(label, "label array", labels)
    _check_params(clip_distance, skeleton_method, tube_dilations)
    _check_classes(labels)
    foreground = labels.foreground(label)
    fg = foreground.astype(np.uint8)
    bg = (~foreground).astype(np.uint8)
    skel = _skeleton(fg, skeleton_method)
    if tube_dilations > 0:
        cross = ndimage.generate_binary_structure(3, 1)
        tube = ndimage.binary_dilation(skel, structure=cross, iterations=tube_dilations)
    else:
        tube = skel.copy()  # scipy's iterations=0 would mean "until nothing changes"
    d = np.float32(clip_distance)
    scale = _anisotropy(spacing)
    sdt = edt.edt(bg, black_border=False, **scale) - edt.edt(fg, black_border=False, **scale)
    sdt = np.clip(sdt, -d, d).astype(np.float16)
    return {
        "ignore": labels.ignored(label).astype(np.uint8),
        "foreground": _foreground_byte(labels, label, fg),
        "skeleton": skel.astype(np.uint8),
        "tube": tube.astype(np.uint8),
        "sdt": sdt,
    }


def _foreground_byte(labels: LabelSpec, label: np.ndarray, fg: np.ndarray) -> np.ndarray:
    """The ``foreground`` target: `fg` (0/1) for a binary spec; for a multi-class one also the
    stored class (1..K) in bits 4-7, the mask byte's layout (`ctseg.store.CLASS_SHIFT`)."""
    if labels.is_binary:
        return np.ascontiguousarray(fg)
    classes = labels.to_stored(label) * fg
    return np.ascontiguousarray(fg | (classes << np.uint8(CLASS_SHIFT)))


def _check_classes(labels: LabelSpec) -> None:
    if labels.n_classes > MAX_CLASSES:
        raise CtsegError(
            f"{labels.source}: {labels.n_classes} foreground labels; the targets hold at most "
            f"{MAX_CLASSES} classes: merge labels into regions or drop some"
        )


# ----------------------------------------------------------------------------- sampling keys


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijection on uint64 with good avalanche (uint64 arrays wrap)."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _seed_mix(seed: int) -> np.uint64:
    return _splitmix64(np.array([seed & _MASK64], dtype=_U64))[0]


def _sample_keys(linear: np.ndarray, seed: int) -> np.ndarray:
    """A key per linear index; XOR with a seed constant keeps it a bijection, so no ties."""
    return _splitmix64(linear.astype(_U64) ^ _seed_mix(seed))


def _smallest(keys: np.ndarray, linear: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    if keys.size <= k:
        return keys, linear
    pick = np.argpartition(keys, k - 1)[:k] if k > 0 else np.empty(0, dtype=np.intp)
    return keys[pick], linear[pick]


# ----------------------------------------------------------------------------- blockwise plan


@dataclass(frozen=True)
class _Plan:
    label_path: str
    dest_path: str
    shape: tuple[int, ...]
    block: tuple[int, ...]
    clip_distance: float
    skeleton_method: str
    tube_dilations: int
    sdt_halo: int
    skeleton_halo: int
    max_samples: int
    seed: int
    edt_threads: int
    spacing: Spacing | None = None
    labels: LabelSpec = KAGGLE

    @property
    def read_halo(self) -> int:
        # distance_ridge reads one neighbour beyond the grown block, whose depths need the halo.
        ridge = 1 if self.skeleton_method == "distance_ridge" else 0
        return max(self.sdt_halo, self.tube_dilations + ridge + self.skeleton_halo)

    def origins(self) -> Iterator[tuple[int, ...]]:
        zs, ys, xs = (range(0, s, b) for s, b in zip(self.shape, self.block, strict=True))
        for z in zs:
            for y in ys:
                for x in xs:
                    yield (z, y, x)


@dataclass
class _BlockResult:
    counts: dict[str, int]
    keys: np.ndarray = field(repr=False)
    linear: np.ndarray = field(repr=False)
    pending: Future[None] | None = None  # write-behind, only in-process (not picklable)


def _grow(start: int, stop: int, margin: int, size: int) -> tuple[int, int]:
    return max(0, start - margin), min(size, stop + margin)


def _local(lo: tuple[int, ...], start: tuple[int, ...], stop: tuple[int, ...]) -> Region:
    """Slices of the global box [start, stop) inside a crop whose corner is `lo`."""
    z, y, x = (slice(a - o, b - o) for a, b, o in zip(start, stop, lo, strict=True))
    return z, y, x


_ARRAYS: dict[tuple[int, str], zarr.Array] = {}
_THREADS: dict[int, ThreadPoolExecutor] = {}


def _opened(path: str, mode: str = "r") -> zarr.Array:
    """Open an array once per process and run (forked workers must not reuse parent handles)."""
    key = (os.getpid(), path)
    if key not in _ARRAYS:
        # The label is read with each chunk's bytes checked; the outputs are being written.
        _ARRAYS[key] = open_volume(path) if mode == "r" else zarr.open_array(path, mode=mode)
    return _ARRAYS[key]


def _threads() -> ThreadPoolExecutor:
    """One background thread per process (threads do not survive a fork, so keyed by pid)."""
    pid = os.getpid()
    if pid not in _THREADS:
        _THREADS[pid] = ThreadPoolExecutor(1, thread_name_prefix="ctseg-targets")
    return _THREADS[pid]


def _process_block(
    plan: _Plan, origin: tuple[int, ...], write_behind: bool = False
) -> _BlockResult:
    """Read block + halo, compute every target, write the block interior, return counts/sample.

    With `write_behind` the writes are left running on the background thread (the caller waits
    for ``result.pending``); otherwise they are done when this returns.
    """
    stop = tuple(min(o + b, s) for o, b, s in zip(origin, plan.block, plan.shape, strict=True))
    box = [_grow(o, e, plan.read_halo, s) for o, e, s in zip(origin, stop, plan.shape, strict=True)]
    lo = tuple(a for a, _ in box)
    label = _opened(plan.label_path)[tuple(slice(a, b) for a, b in box)]
    inner = _local(lo, origin, stop)
    _check_label_values(label[inner], f"{plan.label_path} (block at z,y,x={origin})", plan.labels)

    fg = plan.labels.foreground(label).view(np.uint8)
    if plan.skeleton_method == "distance_ridge":
        sdt, skel, tube = _block_ridge(plan, fg, lo, origin, stop)
        if plan.spacing is not None:  # the ridge's shared pass is in voxels: sdt in `spacing`
            sdt = _block_sdt(plan, fg, lo, origin, stop)
    else:
        # `edt` releases the GIL and 2D thinning does not: run them side by side.
        sdt_future = _threads().submit(_block_sdt, plan, fg, lo, origin, stop)
        skel, tube = _block_skeleton_tube(plan, fg, lo, origin, stop)
        sdt = sdt_future.result()
    out = {
        "ignore": plan.labels.ignored(label[inner]).view(np.uint8),
        "foreground": _foreground_byte(plan.labels, label[inner], fg[inner]),
        "skeleton": skel.view(np.uint8),
        "tube": tube.view(np.uint8),
        "sdt": sdt,
    }
    where = tuple(slice(o, e) for o, e in zip(origin, stop, strict=True))
    # Writing is mostly waiting on zarr's IO thread: overlap it with the next block's compute.
    pending = _threads().submit(_write_block, plan, where, out)
    keys, linear = _block_sample(plan, out["foreground"], origin)
    counts = {name: int(np.count_nonzero(out[name])) for name in TARGET_VOLUMES if name != "sdt"}
    if not write_behind:
        pending.result()
        pending = None
    return _BlockResult(counts=counts, keys=keys, linear=linear, pending=pending)


def _write_block(plan: _Plan, where: Region, out: dict[str, np.ndarray]) -> None:
    for name, values in out.items():
        if name == "sdt":
            # sdt is never 0 (its fill value), so zarr's per-chunk "is it all fill?" test, slow
            # for float16, can only ever say no: skip it.
            array = _opened(f"{plan.dest_path}/{name}", "r+")
            array.with_config({"write_empty_chunks": True})[where] = values
        elif values.any():  # the masks are new and filled with 0: all-zero blocks need no write
            _opened(f"{plan.dest_path}/{name}", "r+")[where] = values


def _block_sdt(
    plan: _Plan, fg: np.ndarray, lo: tuple[int, ...], origin: tuple[int, ...], stop: tuple[int, ...]
) -> np.ndarray:
    box = [_grow(o, e, plan.sdt_halo, s) for o, e, s in zip(origin, stop, plan.shape, strict=True)]
    ctx = np.ascontiguousarray(fg[_local(lo, *zip(*box, strict=True))])
    inner = _local(tuple(a for a, _ in box), origin, stop)
    return _signed_distance(ctx, plan.clip_distance, inner, plan.edt_threads, plan.spacing)


def _block_ridge(
    plan: _Plan, fg: np.ndarray, lo: tuple[int, ...], origin: tuple[int, ...], stop: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """sdt, skeleton and tube of the block from one multi-label `edt` pass over the whole crop.

    The crop reaches ``read_halo`` >= both halos beyond the block, so its squared distances are
    exact wherever either target reads them below its clip (see the module docstring).
    """
    k, shape = plan.tube_dilations, plan.shape
    inner = _local(lo, origin, stop)
    block_shape = tuple(e - o for o, e in zip(origin, stop, strict=True))
    if not fg.any():
        empty = np.zeros(block_shape, dtype=bool)
        return np.full(block_shape, plan.clip_distance, dtype=np.float16), empty, empty
    if fg.all():  # edt would say inf: the whole crop saturates, a plateau with no ridge
        empty = np.zeros(block_shape, dtype=bool)
        return np.full(block_shape, -plan.clip_distance, dtype=np.float16), empty, empty
    sq = edt.edtsq(fg + np.uint8(1), black_border=False, parallel=plan.edt_threads)
    sdt = _sdt_from_squares(sq[inner], fg[inner], plan.clip_distance)  # before sq is clipped
    grown = [_grow(o, e, k, s) for o, e, s in zip(origin, stop, shape, strict=True)]
    skel = _distance_ridge(_ridge_depth(sq, fg), _local(lo, *zip(*grown, strict=True)))
    tube = _dilate6(skel, k) if k > 0 else skel
    grown_inner = _local(tuple(a for a, _ in grown), origin, stop)
    return sdt, np.ascontiguousarray(skel[grown_inner]), np.ascontiguousarray(tube[grown_inner])


def _block_skeleton_tube(
    plan: _Plan, fg: np.ndarray, lo: tuple[int, ...], origin: tuple[int, ...], stop: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Skeleton on the block grown by k (with in-plane context), dilated k times, cut to block."""
    k, shape = plan.tube_dilations, plan.shape
    ctx_box = [
        _grow(o, e, k + plan.skeleton_halo, s) for o, e, s in zip(origin, stop, shape, strict=True)
    ]
    grown = [_grow(o, e, k, s) for o, e, s in zip(origin, stop, shape, strict=True)]
    ctx = fg[_local(lo, *zip(*ctx_box, strict=True))]
    ctx_lo = tuple(a for a, _ in ctx_box)
    keep = _local(ctx_lo, *zip(*grown, strict=True))
    if not ctx.any():
        empty = np.zeros(tuple(e - o for o, e in zip(origin, stop, strict=True)), dtype=bool)
        return empty, empty
    skel = _skeleton(ctx, plan.skeleton_method, keep)
    tube = _dilate6(skel, k) if k > 0 else skel
    inner = _local(tuple(a for a, _ in grown), origin, stop)
    return np.ascontiguousarray(skel[inner]), np.ascontiguousarray(tube[inner])


def _block_sample(
    plan: _Plan, fg_inner: np.ndarray, origin: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    if plan.max_samples == 0:
        return np.empty(0, dtype=_U64), np.empty(0, dtype=np.int64)
    flat = np.flatnonzero(fg_inner)  # block-local linear index -> global linear index
    _, by, bx = fg_inner.shape
    z, rest = np.divmod(flat, by * bx)
    y, x = np.divmod(rest, bx)
    _, sy, sx = plan.shape
    linear = ((z + origin[0]) * sy + (y + origin[1])) * sx + (x + origin[2])
    return _smallest(_sample_keys(linear, plan.seed), linear, plan.max_samples)


# ----------------------------------------------------------------------------- driver


def _distance_halo(clip_distance: float, spacing: Spacing | None) -> int:
    """Voxels of context the clipped distance needs: ceil(d) on the voxel grid, ceil(d / the
    smallest spacing) with `spacing`."""
    if spacing is None:
        return math.ceil(clip_distance)
    if len(spacing) != 3 or not all(math.isfinite(s) and s > 0 for s in spacing):
        raise CtsegError(f"spacing must be 3 positive numbers (z, y, x), got {spacing!r}")
    return math.ceil(clip_distance / min(spacing))


def _check_params(clip_distance: float, skeleton_method: str, tube_dilations: int) -> None:
    if not (math.isfinite(clip_distance) and clip_distance > 0):
        raise CtsegError(f"clip_distance must be a positive number, got {clip_distance!r}")
    if skeleton_method not in SKELETON_METHODS:
        raise CtsegError(
            f"skeleton_method must be one of {', '.join(SKELETON_METHODS)}, got {skeleton_method!r}"
        )
    if int(tube_dilations) != tube_dilations or tube_dilations < 0:
        raise CtsegError(f"tube_dilations must be a non-negative integer, got {tube_dilations!r}")


def _open_label(label_store: Path) -> zarr.Array:
    try:
        label = open_volume(label_store)
    except CtsegError:
        raise  # a store that lacks a chunk: the message names it
    except Exception as exc:  # zarr raises several types for "not an array here"
        raise CtsegError(f"{label_store}: cannot open as a Zarr array ({exc})") from exc
    if label.ndim != 3:
        raise CtsegError(f"{label_store}: expected a 3D label array, got shape {label.shape}")
    if label.dtype.kind not in "uib":
        raise CtsegError(f"{label_store}: expected an integer label array, got {label.dtype}")
    return label


def _run_in_process(
    origins: Iterator[tuple[int, ...]], plan: _Plan, progress: Progress
) -> Iterator[_BlockResult]:
    """One block at a time, with at most one block's writes still running behind."""
    pending: Future[None] | None = None
    try:
        for origin in origins:
            result = _process_block(plan, origin, write_behind=True)
            if pending is not None:
                pending.result()
            pending = result.pending
            yield result
            progress.update()
        if pending is not None:
            pending.result()
            pending = None
    finally:
        if pending is not None:  # an error: let the write finish before the store is deleted
            wait([pending])


def _run_blocks(plan: _Plan, workers: int, progress: Progress) -> Iterator[_BlockResult]:
    """Yield block results, in any order; with workers > 1 at most 2 x workers in flight."""
    origins = plan.origins()
    if workers == 1:
        yield from _run_in_process(origins, plan, progress)
        return
    # fork: workers start in milliseconds, and zarr resets its IO loop in forked children.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method))
    pending: set[Future[_BlockResult]] = set()
    try:
        for origin in origins:
            pending.add(pool.submit(_process_block, plan, origin))
            if len(pending) >= 2 * workers:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield fut.result()
                    progress.update()
        for fut in pending:
            yield fut.result()
            progress.update()
    finally:
        # On an error nothing may still be writing when atomic_path deletes the temp store.
        pool.shutdown(wait=True, cancel_futures=True)


def compute_targets(
    label_store: Path,
    dest: Path,
    *,
    clip_distance: float = 8.0,
    skeleton_method: SkeletonMethod = "distance_ridge",
    tube_dilations: int = 2,
    block_shape: tuple[int, int, int] = (128, 128, 128),
    max_samples: int = 20000,
    seed: int = 0,
    codec: Mapping[str, Any] | None = None,
    workers: int = 1,
    spacing: Spacing | None = None,
    labels: LabelSpec = KAGGLE,
    _sdt_halo: int | None = None,
    _skeleton_halo: int = SKELETON_HALO,
) -> dict[str, Any]:
    """Write the targets group for `label_store` to `dest` (atomically) and return a summary.

    Blocks are `block_shape` rounded up to whole label chunks; `workers` processes each handle
    whole blocks, so peak memory is about workers x (block + 2 x halo)^3 x ~10 bytes. The
    distance is exact everywhere; the skeleton and tube are exact wherever every 2D
    cross-section of the foreground is at most 32 voxels wide (see the module docstring).
    `spacing` (z, y, x voxel size, dataset.yaml's) measures sdt in those units, its halo then
    ceil(d / the smallest spacing) voxels (a distance below d lies within d / s_i voxels along
    axis i); skeleton and tube stay on the voxel grid. `labels` is the spec of the store's
    values: a converted store's are `spec.stored()` (`ctseg.labels`). `_sdt_halo` and
    `_skeleton_halo` exist for tests that show smaller halos are wrong.
    """
    started = time.perf_counter()
    label_store, dest = Path(label_store), Path(dest)
    _check_params(clip_distance, skeleton_method, tube_dilations)
    _check_classes(labels)
    if workers < 1 or max_samples < 0 or len(block_shape) != 3 or min(block_shape) < 1:
        raise CtsegError(
            f"need workers >= 1, max_samples >= 0 and a positive 3D block_shape; got "
            f"workers={workers}, max_samples={max_samples}, block_shape={block_shape}"
        )
    label = _open_label(label_store)
    chunks = tuple(int(c) for c in label.chunks)
    # Whole chunks per block, so no two blocks (or worker processes) ever write the same chunk.
    block = tuple(-(-int(b) // c) * c for b, c in zip(block_shape, chunks, strict=True))
    plan = _Plan(
        label_path=str(label_store),
        dest_path="",  # the temporary sibling, once atomic_path has made one
        shape=tuple(int(s) for s in label.shape),
        block=block,
        clip_distance=float(clip_distance),
        skeleton_method=skeleton_method,
        tube_dilations=int(tube_dilations),
        sdt_halo=_distance_halo(clip_distance, spacing) if _sdt_halo is None else int(_sdt_halo),
        skeleton_halo=int(_skeleton_halo),
        max_samples=int(max_samples),
        seed=int(seed),
        edt_threads=max(1, available_cpus() // workers),
        spacing=None if spacing is None else tuple(float(s) for s in spacing),
        labels=labels,
    )
    n_blocks = math.prod(-(-s // b) for s, b in zip(plan.shape, plan.block, strict=True))
    _ARRAYS.clear()  # a store rewritten since an earlier call must be opened afresh
    try:
        summary = _compute(plan, dest, chunks, codec, workers, n_blocks)
    finally:
        _ARRAYS.clear()
    summary["seconds"] = round(time.perf_counter() - started, 3)
    return summary


def _compute(
    plan: _Plan,
    dest: Path,
    chunks: tuple[int, ...],
    codec: Mapping[str, Any] | None,
    workers: int,
    n_blocks: int,
) -> dict[str, Any]:
    label_store = Path(plan.label_path)
    # Uncompressed: four uint8 masks and the float16 distance per voxel, plus the locations.
    needed = math.prod(plan.shape) * 6 + plan.max_samples * 12
    with fresh_output(dest, needed, f"write the targets of {label_store.name}") as tmp:
        plan = replace(plan, dest_path=str(tmp))
        group = _create_group(plan, chunks, codec)
        counts = dict.fromkeys(("foreground", "ignore", "skeleton", "tube"), 0)
        keys, linear = np.empty(0, dtype=_U64), np.empty(0, dtype=np.int64)
        desc = f"targets {label_store.name}"
        with Progress(total=n_blocks, desc=desc, unit="block", file=sys.stderr) as progress:
            for result in _run_blocks(plan, workers, progress):
                for name, value in result.counts.items():
                    counts[name] += value
                keys, linear = _smallest(
                    np.concatenate([keys, result.keys]),
                    np.concatenate([linear, result.linear]),
                    plan.max_samples,
                )
        locations = _write_locations(group, plan, linear, codec)
        counts["fg_locations"] = int(locations.shape[0])
        summary = _summary(plan, label_store, counts, n_blocks)
        group.attrs.update(summary)
    summary["dest"] = str(dest)
    return summary


def _create_group(plan: _Plan, chunks: tuple[int, ...], codec: Mapping[str, Any] | None) -> Any:
    group = zarr.open_group(plan.dest_path, mode="w", zarr_format=3)
    for name in ("ignore", "foreground", "skeleton", "tube"):
        create_in_group(group, name, plan.shape, np.uint8, chunks, codec)
    create_in_group(group, "sdt", plan.shape, np.float16, chunks, codec)
    return group


def _write_locations(
    group: Any, plan: _Plan, linear: np.ndarray, codec: Mapping[str, Any] | None
) -> np.ndarray:
    """Sorted by linear index, so the array does not depend on the order blocks finished."""
    linear = np.sort(linear)
    locations = np.stack(np.unravel_index(linear, plan.shape), axis=1).astype(np.int32)
    locations = locations.reshape(-1, 3)
    rows = min(max(locations.shape[0], 1), 1 << 16)
    arr = create_in_group(group, "fg_locations", locations.shape, np.int32, (rows, 3), codec)
    if locations.size:
        arr[...] = locations
    return locations


def _summary(
    plan: _Plan, label_store: Path, counts: dict[str, int], n_blocks: int
) -> dict[str, Any]:
    return {
        "source": str(label_store),
        "shape": list(plan.shape),
        "clip_distance": plan.clip_distance,
        "skeleton_method": plan.skeleton_method,
        "tube_dilations": plan.tube_dilations,
        "halo": plan.read_halo,
        "sdt_halo": plan.sdt_halo,
        "skeleton_halo": plan.skeleton_halo,
        "block_shape": list(plan.block),
        "blocks": n_blocks,
        "max_samples": plan.max_samples,
        "seed": plan.seed,
        "counts": counts,
    }
