"""SurfaceDice with anisotropic voxels (issue 32): ctseg.evaluation.surface_dice's `spacing`
against DeepMind's surface-distance at the same spacing, and against the isotropic metric on a
copy upsampled along z."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy import ndimage

from ctseg.evaluation import surface_dice as sd


def _reference(pred: np.ndarray, gt: np.ndarray, tolerance: float, spacing) -> float:
    """surface-distance itself at `spacing` (non-empty masks only)."""
    import surface_distance

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # its scipy.ndimage.filters import
        distances = surface_distance.compute_surface_distances(gt, pred, spacing)
    return float(surface_distance.compute_surface_dice_at_tolerance(distances, tolerance))


def _blobs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return ndimage.gaussian_filter(rng.standard_normal(shape), 1.5) > rng.uniform(0.0, 0.4)


def _box(shape, lo, hi) -> np.ndarray:
    mask = np.zeros(shape, bool)
    mask[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))] = True
    return mask


def _pairs():
    """(pred, gt) non-empty pairs: random blobs shifted, noisy, eroded, dilated; sheets on the
    array's faces; axis-aligned boxes."""
    rng = np.random.default_rng(32)
    for i in range(24):
        shape = tuple(int(s) for s in rng.integers(6, 20, size=3))
        gt = _blobs(rng, shape)
        kind = i % 6
        if kind == 0:
            pred = np.roll(gt, int(rng.integers(1, 4)), axis=int(rng.integers(0, 3)))
        elif kind == 1:
            pred = gt ^ (rng.random(shape) < 0.05)
        elif kind == 2:
            pred = ndimage.binary_erosion(gt)
        elif kind == 3:
            pred = ndimage.binary_dilation(gt, iterations=2)
        elif kind == 4:
            gt = np.zeros(shape, bool)
            gt[: 1 + i % 3] = True  # a sheet on the z face
            pred = np.roll(gt, int(rng.integers(0, 3)), axis=0)
        else:
            gt = _box(shape, (1, 2, 1), (shape[0] - 2, shape[1] - 1, shape[2] - 3))
            pred = np.roll(gt, (1, -1, 2), axis=(0, 1, 2))
        if gt.any() and pred.any():
            yield pred, gt


PAIRS = list(_pairs())
SPACINGS = [(2.0, 1.0, 1.0), (1.0, 1.0, 3.0), (0.7, 1.3, 0.9)]


def test_default_spacing_is_the_isotropic_code():
    """Callers that pass no spacing get the isotropic metric bit for bit."""
    table = sd.surfel_area_table()
    from surface_distance import lookup_tables

    expected = lookup_tables.create_table_neighbour_code_to_surface_area((1.0, 1.0, 1.0))
    assert np.array_equal(table, expected)
    assert sd.LabelSurface.of(PAIRS[0][1]).spacing == sd.ISOTROPIC
    for pred, gt in PAIRS[:8]:
        for tolerance in (2.0, 5.0):
            default = sd.surface_dice(pred, gt, tolerance)
            assert sd.surface_dice(pred, gt, tolerance, spacing=(1, 1, 1)) == default


@pytest.mark.parametrize("spacing", SPACINGS)
def test_equals_surface_distance_at_the_same_spacing(spacing):
    # 7.0 lists more than _MAX_LOCAL_OFFSETS offsets at these spacings: scipy's EDT path.
    assert len(sd.ball_offsets(7.0, spacing)) > sd._MAX_LOCAL_OFFSETS
    assert len(sd.ball_offsets(2.0, spacing)) <= sd._MAX_LOCAL_OFFSETS
    differences, values = [], []
    for pred, gt in PAIRS:
        for tolerance in (1.0, 2.0, 7.0):
            ours = sd.surface_dice(pred, gt, tolerance, spacing=spacing)
            differences.append(abs(ours - _reference(pred, gt, tolerance, spacing)))
            values.append(ours)
    assert max(differences) <= 1e-12  # measured: at most 4.4e-16
    assert 0 < min(values) < 0.9 and max(values) == 1  # the cases are not all trivial


def test_spacing_changes_the_value():
    pred, gt = PAIRS[0]
    assert sd.surface_dice(pred, gt, 1.0, spacing=(2.0, 1.0, 1.0)) != sd.surface_dice(pred, gt, 1.0)


def test_label_surface_keeps_its_spacing():
    rng = np.random.default_rng(7)
    gt = _blobs(rng, (14, 20, 18))
    side = sd.LabelSurface.of(gt, spacing=(2.0, 1.0, 1.0))
    for shift in range(3):
        pred = np.roll(gt, shift, axis=0) & (rng.random(gt.shape) < 0.9)
        assert side.surface_dice(pred, 2.0, threads=2) == pytest.approx(
            _reference(pred, gt, 2.0, (2.0, 1.0, 1.0)), abs=1e-12
        )


def test_ball_offsets_with_spacing():
    # (2 o_z)^2 + o_y^2 + o_x^2 <= 4: the 13 in-plane offsets of length <= 2, and (+-1, 0, 0).
    assert len(sd.ball_offsets(2.0, (2.0, 1.0, 1.0))) == 15
    assert len(sd.ball_offsets(1.9, (2.0, 1.0, 1.0))) == 9
    assert len(sd.ball_offsets(2.0, (1, 1, 1))) == 33


@pytest.mark.parametrize("spacing", [(0, 1, 1), (1, -2, 1), (1, 1, float("nan")), (1, 1)])
def test_invalid_spacing(spacing):
    with pytest.raises(ValueError, match="spacing"):
        sd.surface_dice(PAIRS[0][0], PAIRS[0][1], spacing=spacing)


# --- Checked against the metric on an upsampled copy -------------------------------------------
#
# A volume with spacing [2, 1, 1] and its copy upsampled 2x along z (np.repeat), scored
# isotropically at the same physical tolerance, describe the same object, but their surfels are
# not the same: the copy has side-face surfels at the in-between z planes, and an edge cell's
# area scales with the spacing unlike the two half-height cells that replace it (an edge of a
# face along z: sqrt(5)/2 per unit length at [2, 1, 1] against 1/2 + sqrt(2)/2 upsampled). So
# the two agree exactly only where the near/far split does not depend on those cells; otherwise
# they differ on a band about one coarse voxel tall along every rim and near/far transition,
# whose share of the area falls as 1 / size.


def _upsampled_pair(pred, gt, tolerance):
    coarse = sd.surface_dice(pred, gt, tolerance, spacing=(2.0, 1.0, 1.0))
    fine = sd.surface_dice(np.repeat(pred, 2, axis=0), np.repeat(gt, 2, axis=0), tolerance)
    return coarse, fine


def test_upsampled_copy_exact_cases():
    shape = (16, 32, 32)
    gt = _box(shape, (4, 8, 8), (12, 24, 24))
    # Every surfel within the tolerance of the other surface: 1 on both grids.
    for shift, tolerance in [((1, 0, 0), 2.0), ((0, 0, 2), 2.0), ((1, 0, 3), 4.0)]:
        pred = np.roll(gt, shift, axis=(0, 1, 2))
        assert _upsampled_pair(pred, gt, tolerance) == (1.0, 1.0)
    # The prediction is the label plus a congruent box farther than the tolerance (8 physical
    # along z, 7 along x, between surfel corners): the label's surfels and their copy in the
    # prediction are all near, the extra box's all far, so SurfaceDice = 2A / 3A whatever the
    # surfel area A of the box on either grid: 2/3 on both, to the last bit of the division.
    small = _box(shape, (1, 8, 4), (5, 20, 12))
    for offset in ((8, 0, 0), (0, 0, 15)):
        pred = small | np.roll(small, offset, axis=(0, 1, 2))
        coarse, fine = _upsampled_pair(pred, small, 3.0)
        assert coarse == pytest.approx(2 / 3, abs=2e-16)
        assert fine == pytest.approx(2 / 3, abs=2e-16)


@pytest.mark.parametrize("scale", [1, 2, 4])
def test_upsampled_copy_boxes_converge(scale):
    """A box and its copy shifted by `scale` coarse voxels along z, at tolerances of 1, 1.5
    and 3 x `scale`: the whole picture scaled. Measured |coarse - fine| 0.0398, 0.0230, 0.0115
    at scales 1, 2, 4 (0 at 3 x scale, all near): the rim band's share halves as the box
    doubles, so the bound is 0.05 / scale."""
    s = scale
    shape = (8 * s, 16 * s, 16 * s)
    gt = _box(shape, (2 * s, 4 * s, 4 * s), (6 * s, 12 * s, 12 * s))
    pred = np.roll(gt, s, axis=0)
    for factor in (1.0, 1.5, 3.0):
        coarse, fine = _upsampled_pair(pred, gt, factor * s)
        assert abs(coarse - fine) <= 0.05 / s
        assert 0.5 < coarse <= 1.0


def _sheet(shape, phase: float, half_thickness: float) -> np.ndarray:
    """A wavy sheet like papyrus in a scroll: physical z within `half_thickness` of a sine
    surface over y, with the coarse z voxel i centred at 2 i + 0.5 (its fine copies at 2 i and
    2 i + 1)."""
    z, y, _x = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij")
    surface = shape[0] + 6 * np.sin(y / 9 + phase)
    return np.abs(2 * z + 0.5 - surface) <= half_thickness


def test_upsampled_copy_sheets():
    """Papyrus-like sheets, the label and a shifted, thicker or thinner prediction, at the
    competition's tolerance 2 and at 4: measured |coarse - fine| at most 0.018 (0.0096 and
    0.0178 at tolerance 2, 0.0028 at 4); the bound 0.025 is that with a margin."""
    shape = (24, 48, 48)
    gt = _sheet(shape, 0.0, 2.0)
    worst = 0.0
    for phase, half in [(0.15, 2.0), (0.4, 2.5), (0.8, 1.5)]:
        pred = _sheet(shape, phase, half)
        for tolerance in (2.0, 4.0):
            coarse, fine = _upsampled_pair(pred, gt, tolerance)
            worst = max(worst, abs(coarse - fine))
    assert worst <= 0.025
