"""The competition metric for one volume, plus Dice and hard clDice for diagnostics.

This follows the competition's reference scorer (`topometrics`) as described in docs/metric.md,
"The score of one volume":

    score = clip(0.30 * TopoScore + 0.35 * SurfaceDice + 0.35 * VOI_score, 0, 1)

The weights are divided by their sum and the result clipped to [0, 1], as the competition does
(docs/metric.md, step 5): their sum is 0.9999999999999999 in floats, so a perfect
prediction scores exactly 1.0 only after the division.

Conventions chosen here (the reference leaves them open or they are ours):

* A dropped topology dimension (p_k + g_k == 0) reports ``topo_f1_k = NaN``, as the reference's
  TopoReport does, so every value in the result dict is a plain number. Tests and callers must
  use ``math.isnan`` rather than ``== None``.
* Octant tiling uses ``np.array_split`` semantics: along an axis of odd length the *first* half
  gets the extra voxel (length 5 -> 3 + 2), which is what the reference's cut function does.
  An axis of length 1 is not cut.
* TopoScore's matched counts m_k come from ``ctseg.evaluation.betti_matching``, an exact
re-implementation
  of Betti-Matching-3D's matching for binary masks (``topo_method="betti_matching"``, the
  default; its docstring has the reasoning, tests/test_betti_matching.py the checks). The
  feature counts p_k and g_k come from Betti numbers. ``topo_method="betti_counts"`` replaces
  m_k by the upper bound min(p_k, g_k) per tile: faster, never too low, but it overstates
  TopoScore on noisy predictions (by 0.09 on average and up to 0.43 on the pairs compared with
  Betti-Matching-3D when the exact method was written).
  ``topo_method`` in the result says which ran.
* ``cldice`` is the hard clDice *score* (higher is better, not the loss 1 - score), computed on
  the ignored-and-binarised masks with the project's medial-surface skeleton: the union of 2D
  skeletons of every slice along z, y and x (as the official Vesuvius training code does; a 3D
  Lee skeleton collapses a sheet to curves, see `ctseg.preprocess.targets`). Both masks empty gives
  1, exactly one empty gives 0.
* ``dice`` is binary Dice after the ignore step; both empty gives 1.

Cost (issue 18, BENCHMARKS.md "Evaluation"): SurfaceDice comes from `ctseg.evaluation.surface_dice`
(surface-distance's method and values without its scipy EDT); `LabelSide` holds everything
about a label that the score needs, computed once per label so that `ctseg.postprocess.tuning`
reuses it for every candidate; the 8 tiles of TopoScore run in `threads` threads, and a tile's Betti
matching skips the dimensions where one side has no feature. `implementation="reference"`
keeps the previous path (surface-distance, every dimension of every tile, one at a time) as the
oracle of the tests and the baseline of bench/metrics.py.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import cc3d
import numpy as np
from numba import njit
from skimage.metrics import variation_of_information

from ctseg.evaluation import surface_dice as _surface
from ctseg.evaluation.betti_matching import dim0_bound, matched_counts
from ctseg.evaluation.thinning import slices_skeleton
from ctseg.io import CtsegError, strict_json
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.machine import available_cpus

ISOTROPIC = _surface.ISOTROPIC

TopoMethod = Literal["betti_matching", "betti_counts"]
TOPO_METHODS = ("betti_matching", "betti_counts")
# The post-processing search's bound of the exact score (`topo_counts`, not a method users
# choose): betti_counts' min(p_k, g_k), with m_0 also bounded by the union's components
# (`ctseg.evaluation.betti_matching.dim0_bound`).
UNION_BOUND = "union_bound"

WEIGHT_TOPO, WEIGHT_SURFACE_DICE, WEIGHT_VOI = 0.30, 0.35, 0.35
TOPO_DIM_WEIGHTS = (0.34, 0.33, 0.33)
TOPO_DIMS = (0, 1, 2)


# ---------------------------------------------------------------------------------------------
# Input preparation


def _binarise(x: np.ndarray) -> np.ndarray:
    """`x != 0` with NaN counting as 0 (NaN != 0 is True, so it needs its own test)."""
    if np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.complexfloating):
        return (x != 0) & ~np.isnan(x)
    return x != 0


def prepare_masks(
    pred: np.ndarray, gt: np.ndarray, labels: LabelSpec = KAGGLE
) -> tuple[np.ndarray, np.ndarray]:
    """Apply the ignore label and binarise: returns (pred_bin, gt_bin) as bool arrays.

    Where gt is the spec's ignored value (2 for Kaggle's) both are set to background;
    everything else is `!= 0` with NaN as 0.
    """
    pred = np.asarray(pred)
    gt = np.asarray(gt)
    if pred.shape != gt.shape:
        raise ValueError(
            f"prediction and ground truth shapes differ: pred {pred.shape} vs gt {gt.shape}"
        )
    if pred.ndim != 3:
        raise ValueError(f"expected 3D volumes, got pred/gt with shape {pred.shape}")
    keep = ~labels.ignored(gt)
    return _binarise(pred) & keep, _binarise(gt) & keep


# ---------------------------------------------------------------------------------------------
# SurfaceDice


def surface_dice(
    pred: np.ndarray,
    gt: np.ndarray,
    tolerance: float = 2.0,
    *,
    threads: int = 1,
    spacing: Sequence[float] = ISOTROPIC,
) -> float:
    """Surfel-based surface Dice at `tolerance` (in units of `spacing`; the competition's is
    (1, 1, 1), voxels): surface-distance's method and values, computed by
    `ctseg.evaluation.surface_dice` (its docstring has the steps)."""
    return _surface.surface_dice(pred, gt, tolerance, threads=threads, spacing=spacing)


def surface_dice_reference(
    pred: np.ndarray,
    gt: np.ndarray,
    tolerance: float = 2.0,
    spacing: Sequence[float] = ISOTROPIC,
) -> float:
    """The same number through surface-distance itself (scipy's EDT): the oracle of the tests
    and the baseline of bench/metrics.py, about 30 s at 320^3.

    The empty cases are handled here because surface-distance's own empty branch uses np.Inf,
    which NumPy 2 removed.
    """
    pred_any, gt_any = bool(pred.any()), bool(gt.any())
    if not pred_any and not gt_any:
        return 1.0
    if pred_any != gt_any:
        return 0.0
    import surface_distance  # imported late: only the reference path needs its metrics module

    with warnings.catch_warnings():
        # surface-distance 0.1 uses the deprecated scipy.ndimage.filters/morphology namespaces.
        warnings.simplefilter("ignore", DeprecationWarning)
        distances = surface_distance.compute_surface_distances(gt, pred, tuple(spacing))
    return float(surface_distance.compute_surface_dice_at_tolerance(distances, tolerance))


# ---------------------------------------------------------------------------------------------
# VOI


def voi(
    pred: np.ndarray, gt: np.ndarray, gt_labels: np.ndarray | None = None
) -> tuple[float, float]:
    """(split, merge) variation of information of 26-connected components on the union.

    split = H(pred | gt) (one GT piece broken into several), merge = H(gt | pred).
    `gt_labels`, the label's components when already computed (`LabelSide`), saves labelling
    them again.
    """
    union = pred | gt
    if not union.any():
        return 0.0, 0.0
    pred_labels = cc3d.connected_components(pred, connectivity=26)
    if gt_labels is None:
        gt_labels = cc3d.connected_components(gt, connectivity=26)
    split, merge = variation_of_information(gt_labels[union], pred_labels[union])
    return float(split), float(merge)


def voi_score_from_total(total: float, alpha: float = 0.3) -> float:
    return 1.0 / (1.0 + alpha * total)


# ---------------------------------------------------------------------------------------------
# Topology


def axis_cuts(n: int, parts: int = 2) -> list[tuple[int, int]]:
    """Contiguous [start, stop) pieces of [0, n), sizes differing by at most 1, larger first.

    Same sizes as np.array_split; fewer pieces when n < parts so no piece is empty.
    """
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    cuts, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        cuts.append((start, stop))
        start = stop
    return cuts


def octant_slices(shape: tuple[int, ...]) -> Iterator[tuple[slice, slice, slice]]:
    """The 2x2x2 tiles of the reference, in z, y, x order."""
    for z0, z1 in axis_cuts(shape[0]):
        for y0, y1 in axis_cuts(shape[1]):
            for x0, x1 in axis_cuts(shape[2]):
                yield slice(z0, z1), slice(y0, y1), slice(x0, x1)


def _enclosed_background_count(mask: np.ndarray) -> int:
    """26-connected background components that do not touch the array border (cavities)."""
    background = ~mask
    if not background.any():
        return 0
    labels, n = cc3d.connected_components(background, connectivity=26, return_N=True)
    faces = (labels[0], labels[-1], labels[:, 0], labels[:, -1], labels[:, :, 0], labels[:, :, -1])
    touching = np.unique(np.concatenate([f.ravel() for f in faces]))
    return int(n - np.count_nonzero(touching))


@njit(cache=True, nogil=True)
def _euler_kernel(m: np.ndarray) -> int:
    nz, ny, nx = m.shape
    chi = 0
    for z in range(nz):
        for y in range(ny):
            for x in range(nx):
                if not m[z, y, x]:
                    continue
                # The cells whose lowest corner is this voxel, with every corner foreground.
                chi += 1
                bz, by, bx = (
                    z + 1 < nz and m[z + 1, y, x],
                    y + 1 < ny and m[z, y + 1, x],
                    (x + 1 < nx and m[z, y, x + 1]),
                )
                chi -= int(bz) + int(by) + int(bx)
                syx = by and bx and m[z, y + 1, x + 1]
                szx = bz and bx and m[z + 1, y, x + 1]
                szy = bz and by and m[z + 1, y + 1, x]
                chi += int(syx) + int(szx) + int(szy)
                if syx and szx and szy and m[z + 1, y + 1, x + 1]:
                    chi -= 1
    return chi


def euler_characteristic(mask: np.ndarray) -> int:
    """Euler characteristic V - E + F - C of the cubical complex of a mask's voxels with
    6-connected foreground (skimage's `euler_number(mask, connectivity=1)`, in one pass)."""
    return int(_euler_kernel(np.ascontiguousarray(mask, dtype=np.bool_)))


def betti_numbers(mask: np.ndarray) -> tuple[int, int, int]:
    """(b0, b1, b2) of a binary mask: 6-connected foreground, 26-connected background.

    b0 = components, b2 = enclosed cavities, b1 = b0 + b2 - chi (Euler-Poincare), with chi the
    6-connectivity Euler characteristic. This is the complex the reference's Betti matching
    builds on the *inverted* mask: after inversion the segmentation foreground has value 0 and
    enters the sublevel filtration first, so its topology is what is counted.
    """
    mask = np.asarray(mask, dtype=bool)
    if not mask.any():
        return 0, 0, 0
    _, b0 = cc3d.connected_components(mask, connectivity=6, return_N=True)
    b2 = _enclosed_background_count(mask)
    chi = euler_characteristic(mask)
    return int(b0), int(b0 + b2 - chi), int(b2)


def tile_feature_counts(mask: np.ndarray) -> tuple[int, int, int]:
    """Finite persistence intervals per dimension for one tile, as Betti matching counts them.

    One component per tile lives forever (it becomes the whole tile at value 1), so dim 0 is
    b0 - 1; an empty tile has only that essential component, hence 0.
    """
    b0, b1, b2 = betti_numbers(mask)
    return max(b0 - 1, 0), b1, b2


def _count_tile(
    pred_tile: np.ndarray,
    gt_tile: np.ndarray,
    method: str,
    g: tuple[int, int, int] | None = None,
    every_dim: bool = False,
    p: tuple[int, int, int] | None = None,
) -> np.ndarray:
    """(3, 3) array: rows are dims 0..2, columns m_k, p_k, g_k. `g`: the label tile's feature
    counts when already known (`LabelTiles`). A dimension where p_k or g_k is 0 has m_k = 0
    (m_k <= min(p_k, g_k)), so its matching is not run unless `every_dim` (the previous path,
    kept as the baseline of bench/metrics.py: it also runs dimension 1 without its shortcuts,
    `matched_counts(plain=True)`). `p`: the prediction tile's feature counts when known."""
    if p is None:
        p = tile_feature_counts(pred_tile)
    if g is None:
        g = tile_feature_counts(gt_tile)
    if method == "betti_matching":
        dims = tuple(every_dim or min(pk, gk) > 0 for pk, gk in zip(p, g, strict=True))
        m = matched_counts(pred_tile, gt_tile, dims, every_dim) if any(dims) else (0, 0, 0)
    else:  # betti_counts: the upper bound min(p_k, g_k)
        m = tuple(min(pk, gk) for pk, gk in zip(p, g, strict=True))
        if method == UNION_BOUND and m[0] > 0:
            m = (min(m[0], dim0_bound(pred_tile, gt_tile)[0]), *m[1:])
    return np.array([[mk, pk, gk] for mk, pk, gk in zip(m, p, g, strict=True)], dtype=np.int64)


@dataclass(frozen=True)
class LabelTiles:
    """The label's side of TopoScore: its octant tiles and each tile's feature counts g_k,
    computed once per label and reused for every prediction scored against it."""

    shape: tuple[int, ...]
    tiles: tuple[tuple[slice, slice, slice], ...]
    counts: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, gt: np.ndarray, threads: int = 1) -> LabelTiles:
        tiles = tuple(octant_slices(gt.shape))
        counts = _map_threads(lambda t: tile_feature_counts(gt[t]), tiles, threads)
        return cls(tuple(gt.shape), tiles, tuple(counts))


def _digest(mask: np.ndarray) -> bytes:
    """A 32-byte digest of a bool mask's voxels (bit-packed first: 8 times fewer bytes)."""
    import hashlib

    return hashlib.blake2b(np.packbits(mask).tobytes(), digest_size=32).digest()


def _map_threads(fn: Any, items: Any, threads: int) -> list:
    """fn over items, in order; in `threads` threads when more than one (the Betti matching
    kernels and cc3d release the GIL, so tiles run side by side)."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


def topo_f1(m: int, p: int, g: int) -> float:
    """F1 of one dimension; NaN means the dimension is dropped (no features on either side)."""
    if p + g == 0:
        return math.nan
    if g > 0:
        return 2.0 * m / (p + g)
    # No GT features: a pseudo-count so predicting k spurious ones scores 0.5 / (k + 0.5).
    return 0.5 / (p + 0.5)


def topo_score_from_counts(counts: np.ndarray) -> tuple[float, list[float]]:
    """TopoScore and per-dimension F1 from summed (m_k, p_k, g_k) rows."""
    f1 = [topo_f1(*(int(v) for v in counts[k])) for k in TOPO_DIMS]
    active = [k for k in TOPO_DIMS if not math.isnan(f1[k])]
    if not active:
        return 1.0, f1
    total_weight = sum(TOPO_DIM_WEIGHTS[k] for k in active)
    score = sum(TOPO_DIM_WEIGHTS[k] * f1[k] for k in active) / total_weight
    return float(score), f1


def topo_counts(
    pred: np.ndarray,
    gt: np.ndarray,
    method: TopoMethod = "betti_matching",
    *,
    label_tiles: LabelTiles | None = None,
    threads: int = 1,
    every_dim: bool = False,
    tile_cache: dict | None = None,
) -> tuple[np.ndarray, str]:
    """(m_k, p_k, g_k) summed over the 8 octant tiles, and the method used. `label_tiles`: the
    label's side when already computed; `threads`: tiles scored side by side; `every_dim`: run
    the matching in every dimension and without its shortcuts (the previous path; the counts
    are the same);
    `tile_cache`: a dict kept by a caller that scores many predictions against one label
    (tuning): a tile whose prediction is bit for bit one already counted is not counted again
    (post-processing candidates often differ in a few tiles only)."""
    if method not in (*TOPO_METHODS, UNION_BOUND):
        raise ValueError(f"unknown topo_method {method!r}; expected one of {TOPO_METHODS}")
    if label_tiles is None or label_tiles.shape != tuple(gt.shape):
        label_tiles = LabelTiles.of(gt, threads)
    jobs = list(zip(label_tiles.tiles, label_tiles.counts, strict=True))

    def count(job: tuple[tuple[slice, slice, slice], tuple[int, int, int]]) -> np.ndarray:
        tile, g = job
        if tile_cache is None:
            return _count_tile(pred[tile], gt[tile], method, g, every_dim)
        where = (tuple((t.start, t.stop) for t in tile), _digest(pred[tile]))
        key = (method, *where)
        if key not in tile_cache:
            # The prediction tile's feature counts are the same for every method: a tile counted
            # by the bound ("betti_counts") first is matched without counting them again.
            features = ("features", *where)
            if features not in tile_cache:
                tile_cache[features] = tile_feature_counts(pred[tile])
            p = tile_cache[features]
            tile_cache[key] = _count_tile(pred[tile], gt[tile], method, g, every_dim, p)
        return tile_cache[key]

    rows = _map_threads(count, jobs, threads)
    return np.sum(rows, axis=0, dtype=np.int64), method


def combined_score(topo: float, surface_dice_value: float, voi_score_value: float) -> float:
    """The competition's score: weights divided by their sum, result clipped to [0, 1]."""
    total = WEIGHT_TOPO + WEIGHT_SURFACE_DICE + WEIGHT_VOI  # 0.9999999999999999
    raw = (
        WEIGHT_TOPO / total * topo
        + WEIGHT_SURFACE_DICE / total * surface_dice_value
        + WEIGHT_VOI / total * voi_score_value
    )
    return min(1.0, max(0.0, raw))


# ---------------------------------------------------------------------------------------------
# Dice and clDice (diagnostics, not part of the competition score)


def dice(pred: np.ndarray, gt: np.ndarray) -> float:
    denominator = int(pred.sum()) + int(gt.sum())
    if denominator == 0:
        return 1.0
    return 2.0 * int(np.count_nonzero(pred & gt)) / denominator


def medial_surface(mask: np.ndarray, threads: int = 1) -> np.ndarray:
    """Union of per-slice 2D skeletons along z, y and x (the project's sheet skeleton)."""
    mask = np.asarray(mask, dtype=bool)
    per_axis = [_axis_skeleton(mask, axis, threads) for axis in range(3)]
    return per_axis[0] | per_axis[1] | per_axis[2]


def _axis_skeleton(mask: np.ndarray, axis: int, threads: int = 1) -> np.ndarray:
    # The 2D skeleton of every slice across `axis`, bit for bit skimage's skeletonize
    # (ctseg.evaluation.thinning, tests/test_thinning.py): numba kernels that release the GIL and
    # thin each slice within its bounding box (thinning is local and treats outside the image as
    # background), slices shared among `threads` threads (passed on: numba's own thread
    # setting is per calling thread, and clDice may run in a thread of its own).
    return slices_skeleton(mask, axis, threads)


def cldice(pred: np.ndarray, gt: np.ndarray, threads: int = 1) -> float:
    """Hard clDice score 2 Tprec Tsens / (Tprec + Tsens) with medial-surface skeletons."""
    pred_any, gt_any = bool(pred.any()), bool(gt.any())
    if not pred_any and not gt_any:
        return 1.0
    if pred_any != gt_any:
        return 0.0
    pred_skel, gt_skel = medial_surface(pred, threads), medial_surface(gt, threads)
    t_prec = _fraction_inside(pred_skel, gt)
    t_sens = _fraction_inside(gt_skel, pred)
    if t_prec + t_sens == 0:
        return 0.0
    return 2.0 * t_prec * t_sens / (t_prec + t_sens)


def _fraction_inside(skeleton: np.ndarray, mask: np.ndarray) -> float:
    n = int(skeleton.sum())
    return int(np.count_nonzero(skeleton & mask)) / n if n else 0.0


# ---------------------------------------------------------------------------------------------
# Public entry points


@dataclass
class LabelSide:
    """Everything about one label that the competition score needs, computed once and reused
    for every prediction scored against it (ctseg.postprocess.tuning scores up to 32 candidates per
    val volume): the binarised label and where it is ignored, its surfel borders (SurfaceDice), its
    26-connected components (VOI) and its tiles' feature counts (TopoScore)."""

    keep: np.ndarray  # bool: voxels not ignored (not the spec's ignored value, 2 for Kaggle)
    gt: np.ndarray  # bool: the label's foreground after the ignore step
    surface: _surface.LabelSurface
    components: np.ndarray
    tiles: LabelTiles

    @classmethod
    def of(
        cls,
        label: np.ndarray,
        threads: int = 1,
        labels: LabelSpec = KAGGLE,
        spacing: Sequence[float] = ISOTROPIC,
    ) -> LabelSide:
        label = np.asarray(label)
        if label.ndim != 3:
            raise ValueError(f"expected a 3D label volume, got shape {label.shape}")
        keep = ~labels.ignored(label)
        gt = _binarise(label) & keep
        return cls(
            keep,
            gt,
            _surface.LabelSurface.of(gt, spacing=spacing),
            cc3d.connected_components(gt, connectivity=26),
            LabelTiles.of(gt, threads),
        )

    def prepare(self, pred: np.ndarray) -> np.ndarray:
        """The prediction binarised with this label's ignore step (as `prepare_masks`)."""
        pred = np.asarray(pred)
        if pred.shape != self.gt.shape:
            raise ValueError(
                "prediction and ground truth shapes differ: "
                f"pred {pred.shape} vs gt {self.gt.shape}"
            )
        return _binarise(pred) & self.keep


def competition_terms(
    pred_bin: np.ndarray,
    label: LabelSide,
    *,
    tolerance: float = 2.0,
    voi_alpha: float = 0.3,
    topo_method: TopoMethod = "betti_matching",
    threads: int = 1,
    tile_cache: dict | None = None,
) -> dict[str, Any]:
    """The competition score of a prepared prediction against a label's side, with its terms
    and their parts (no Dice or clDice: those are diagnostics). `tile_cache`: see
    topo_counts."""
    overlap = overlap_terms(pred_bin, label, tolerance, voi_alpha, threads)
    counts, used = topo_counts(
        pred_bin,
        label.gt,
        topo_method,
        label_tiles=label.tiles,
        threads=threads,
        tile_cache=tile_cache,
    )
    return with_topology(overlap, counts, used)


def overlap_terms(
    pred_bin: np.ndarray,
    label: LabelSide,
    tolerance: float = 2.0,
    voi_alpha: float = 0.3,
    threads: int = 1,
) -> dict[str, float]:
    """The score's terms that compare voxels and components, SurfaceDice and VOI: everything
    but TopoScore (tuning computes these once per candidate and TopoScore's bound and exact
    value on top, `with_topology`)."""
    sd = label.surface.surface_dice(pred_bin, tolerance, threads=threads)
    split, merge = voi(pred_bin, label.gt, label.components)
    voi_total = split + merge
    return {
        "surface_dice": sd,
        "voi_score": voi_score_from_total(voi_total, voi_alpha),
        "voi_split": split,
        "voi_merge": merge,
        "voi_total": voi_total,
    }


def with_topology(overlap: dict[str, float], counts: np.ndarray, used: str) -> dict[str, Any]:
    """The whole result of `competition_terms` from `overlap_terms` and summed Betti counts.
    The score rises with every m_k (F1_k does, and the score is a positive combination), so
    counts with m_k = min(p_k, g_k) (method "betti_counts") give an upper bound of the exact
    score, computed by the same arithmetic."""
    topo, f1 = topo_score_from_counts(counts)
    result: dict[str, Any] = {
        "score": combined_score(topo, overlap["surface_dice"], overlap["voi_score"]),
        **overlap,
        "topo_score": topo,
        "topo_method": used,
    }
    for k in TOPO_DIMS:
        result[f"topo_f1_{k}"] = f1[k]
    for k in TOPO_DIMS:
        m, p, g = (int(v) for v in counts[k])
        result.update({f"topo_m{k}": m, f"topo_p{k}": p, f"topo_g{k}": g})
    return result


Implementation = Literal["ctseg", "reference"]


def score_volume(
    pred: np.ndarray,
    gt: np.ndarray,
    *,
    tolerance: float = 2.0,
    voi_alpha: float = 0.3,
    topo_method: TopoMethod = "betti_matching",
    threads: int | None = None,
    implementation: Implementation = "ctseg",
    labels: LabelSpec = KAGGLE,
    spacing: Sequence[float] = ISOTROPIC,
) -> dict[str, Any]:
    """Score one predicted volume against its label volume (0 / 1 / 2 = ignore).

    Returns a flat dict: score, surface_dice, voi_score, voi_split, voi_merge, voi_total,
    topo_score, topo_f1_{0,1,2} (NaN when dropped), topo_method, topo_{m,p,g}{0,1,2} (summed
    over the 8 tiles), dice, cldice. Raises ValueError when the shapes differ.

    `threads`: the cores one score may use (default: every usable one). `implementation`
    "reference" is the previous path, kept as the baseline and oracle: SurfaceDice through
    surface-distance and the Betti matching run in every dimension of every tile, one by one;
    it gives the same values, at about 60 s instead of a few at 320^3.

    `labels`: the label's values (the Kaggle spec by default); `spacing`: the voxel spacing
    SurfaceDice measures its tolerance in (a dataset's relative to its finest axis; the
    competition's is isotropic).
    """
    threads = available_cpus() if threads is None else max(1, int(threads))
    if implementation == "reference":
        pred_bin, gt_bin = prepare_masks(pred, gt, labels)
        sd = surface_dice_reference(pred_bin, gt_bin, tolerance, spacing)
        split, merge = voi(pred_bin, gt_bin)
        voi_s = voi_score_from_total(split + merge, voi_alpha)
        counts, used = topo_counts(pred_bin, gt_bin, topo_method, every_dim=True)
        overlap = {
            "surface_dice": sd,
            "voi_score": voi_s,
            "voi_split": split,
            "voi_merge": merge,
            "voi_total": split + merge,
        }
        result = with_topology(overlap, counts, used)
        result["dice"] = dice(pred_bin, gt_bin)
        result["cldice"] = cldice(pred_bin, gt_bin)
    elif implementation == "ctseg":
        pred_bin, gt_bin = prepare_masks(pred, gt, labels)  # its checks and messages
        # clDice (a diagnostic) on one thread beside the score's terms: its kernels and the
        # Betti matching's release the GIL, and the matching's tiles leave a core idle at
        # their end (five dear tiles of eight at 320^3), which clDice's 1.8 s then fills.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            cldice_value = pool.submit(cldice, pred_bin, gt_bin, 1)
            label = LabelSide.of(np.asarray(gt), threads, labels, spacing)
            result = competition_terms(
                pred_bin,
                label,
                tolerance=tolerance,
                voi_alpha=voi_alpha,
                topo_method=topo_method,
                threads=threads,
            )
            result["dice"] = dice(pred_bin, gt_bin)
            result["cldice"] = cldice_value.result()
    else:
        raise ValueError(f"unknown implementation {implementation!r}")
    return result


def read_volume(path: Path) -> np.ndarray:
    """A 3D multi-page TIFF (prediction or label), with a one-line error naming the file."""
    import tifffile

    try:
        volume = tifffile.imread(path)
    except Exception as exc:  # tifffile raises many types for missing or damaged files
        raise CtsegError(f"{path}: cannot read TIFF volume ({exc})") from exc
    if volume.ndim != 3:
        raise CtsegError(f"{path}: expected a 3D volume, got shape {volume.shape}")
    return volume


def _distinct_values(volume: np.ndarray) -> np.ndarray:
    if volume.dtype == np.uint8:  # the usual case: a histogram, far cheaper than sorting
        return np.flatnonzero(np.bincount(volume.ravel(), minlength=256))
    return np.unique(volume)


def _shown(values: np.ndarray, limit: int = 6) -> str:
    shown = ", ".join(f"{v:g}" for v in values[:limit].tolist())
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def read_label(path: Path, labels: LabelSpec = KAGGLE) -> np.ndarray:
    """A label TIFF whose values are the spec's only (0 background, 1 surface and 2 unlabelled
    for Kaggle's): any other value would silently count as surface, so it is a one-line error
    naming the file."""
    volume = read_volume(Path(path))
    labels.check_values(
        _distinct_values(volume),
        path,
        fix="fix or re-export the label (ctseg convert --kind label refuses it too)",
    )
    return volume


def read_prediction(path: Path) -> np.ndarray:
    """A predicted mask TIFF: 0/1 (what ctseg postprocess writes) or 0/255. Anything else
    (probabilities, other labels) would count as surface wherever it is not 0, so it is a
    one-line error naming the file."""
    volume = read_volume(Path(path))
    values = _distinct_values(volume)
    binary = np.isin(values, (0, 1)).all() or np.isin(values, (0, 255)).all()
    if not binary:
        bad = values[~np.isin(values, (0, 1, 255))] if values.size else values
        raise CtsegError(
            f"{path}: prediction values {_shown(bad if bad.size else values)} are not a binary "
            "mask (0/1, or 0/255); write masks with ctseg postprocess, or threshold them first"
        )
    return volume


def _check_pair(
    pred_tif: Path, gt_tif: Path, labels: LabelSpec = KAGGLE
) -> tuple[np.ndarray, np.ndarray]:
    pred = read_prediction(pred_tif)
    gt = read_label(gt_tif, labels)
    if pred.shape != gt.shape:
        raise CtsegError(
            f"shape mismatch: prediction {pred_tif} has shape {pred.shape}, "
            f"ground truth {gt_tif} has shape {gt.shape}"
        )
    return pred, gt


def score_files(pred_tif: Path, gt_tif: Path, **kwargs: Any) -> dict[str, Any]:
    """`ctseg score PRED.tif GT.tif`: score_volume on two multi-page TIFFs.

    Raises CtsegError (the CLI's one-line error) naming the file on unreadable input, values
    that are not a mask (prediction) or not 0/1/2 (label), or mismatched shapes. Keyword
    arguments go to score_volume.
    """
    labels = kwargs.get("labels", KAGGLE)
    pred, gt = _check_pair(Path(pred_tif), Path(gt_tif), labels)
    return score_volume(pred, gt, **kwargs)


SUMMARY_COLUMNS = (
    "score",
    "surface_dice",
    "voi_score",
    "voi_total",
    "topo_score",
    "dice",
    "cldice",
)


# Peak memory of one scoring process on a 320^3 pair (measured, bench/metrics.py): the volumes,
# the label's side, one tile's Betti matching per thread and the skeletons of clDice: 1.5 to
# 1.7 GB for a model-like mask, 2.6 GB for the bench's process after the pruned search (its own
# arrays included; the rules add 1 GB of margin). Noise costs more: the exact TopoScore of a
# 320^3 mask of weak probabilities thresholded at 0.1 took 5.2 GB (and 315 s), which the
# search prunes by its bound but evaluate would pay for predictions that noisy.
WORKER_MEMORY_GB = 2.0


def _score_pair(pair: tuple[Path, Path, str, int, LabelSpec, tuple[float, ...]]) -> dict[str, Any]:
    """One evaluate row (a module-level function so that a process pool can pickle it)."""
    pred, label, topo_method, threads, labels, spacing = pair
    scores = score_files(
        Path(pred),
        Path(label),
        topo_method=topo_method,
        threads=threads,
        labels=labels,
        spacing=spacing,
    )
    return {"id": Path(pred).stem, **scores}


def plan_workers(cores: int, volumes: int) -> tuple[int, int]:
    """(processes, threads per process) for `cores` cores and `volumes` volumes: a process per
    volume while there are volumes, and the cores left over as threads inside each (tiles and
    the distance kernels use them), so every core given is used either way."""
    processes = max(1, min(cores, volumes))
    return processes, max(1, cores // processes)


def evaluate_pairs(
    predictions: list[Path],
    labels: list[Path],
    out_dir: Path,
    *,
    workers: int = 1,
    topo_method: TopoMethod = "betti_matching",
    provenance: dict[str, str] | None = None,
    label_spec: LabelSpec = KAGGLE,
    spacing: Sequence[float] = ISOTROPIC,
) -> dict[str, Any]:
    """Score each prediction against its label (values as `label_spec` says; SurfaceDice's
    tolerance in units of `spacing`); write scores.csv (one row per volume) and
    summary.json (the means, the number of volumes, the topology method used, and
    `provenance`: key/value pairs the caller records verbatim, e.g. which split was scored).

    `workers` is the number of cores to use: one process per volume up to that many, and the
    cores left over as threads inside each (`plan_workers`); a process needs about
    WORKER_MEMORY_GB at 320^3. Every volume is scored by the same deterministic code either
    way, and rows keep the input order, so the outputs are identical to a serial run.
    """
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    import pandas as pd

    from ctseg.io import atomic_path
    from ctseg.progress import Progress

    if len(predictions) != len(labels):
        raise CtsegError(f"{len(predictions)} predictions but {len(labels)} label volumes")
    if not predictions:
        raise CtsegError("nothing to evaluate: no held-out volume has a label")
    if workers < 1:
        raise CtsegError(f"workers must be at least 1, got {workers}")
    if topo_method not in TOPO_METHODS:
        raise CtsegError(f"unknown topo_method {topo_method!r}; use one of {TOPO_METHODS}")
    # Every file is checked (readable, values, shapes) before any volume is scored, so a bad
    # one fails in seconds, not after the volumes before it.
    for pred_path, label_path in zip(predictions, labels, strict=True):
        _check_pair(Path(pred_path), Path(label_path), label_spec)
    processes, threads = plan_workers(workers, len(predictions))
    jobs = [
        (Path(p), Path(g), topo_method, threads, label_spec, tuple(spacing))
        for p, g in zip(predictions, labels, strict=True)
    ]
    workers = processes
    if workers == 1:
        rows = [_score_pair(job) for job in Progress(jobs, desc="evaluate")]
    else:
        # spawn: a fresh interpreter per worker, safe whatever threads the parent started.
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            rows = list(Progress(pool.map(_score_pair, jobs), total=len(jobs), desc="evaluate"))
    table = pd.DataFrame(rows)
    methods = sorted(set(table["topo_method"]))
    summary = {
        "volumes": len(table),
        "topo_method": methods[0] if len(methods) == 1 else methods,
        **{f"mean_{name}": float(table[name].mean()) for name in SUMMARY_COLUMNS},
    }
    if provenance:
        summary["provenance"] = {str(k): str(v) for k, v in provenance.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "scores.csv") as tmp:
        table.to_csv(tmp, index=False)
    with atomic_path(out_dir / "summary.json") as tmp:
        tmp.write_text(strict_json(summary, indent=1))
    return summary
