"""SurfaceDice (ctseg.evaluation.surface_dice) against its oracle, DeepMind's surface-distance,
which the
competition's scorer calls: the same surfels, areas and distances, so the same values."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from ctseg.evaluation import surface_dice as sd
from ctseg.evaluation.metrics import prepare_masks, surface_dice_reference


def _blobs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return ndimage.gaussian_filter(rng.standard_normal(shape), 1.5) > rng.uniform(0.0, 0.4)


def _pairs():
    """64 (name, pred, label 0/1/2) cases: random, shifted, eroded, dilated, sheets touching
    the array's border, empty and all-ignored."""
    rng = np.random.default_rng(2026)
    for i in range(64):
        shape = tuple(int(s) for s in rng.integers(6, 22, size=3))
        gt = _blobs(rng, shape)
        kind = ("random", "shifted", "eroded", "dilated", "noisy", "sheet", "empty", "ignored")[
            i % 8
        ]
        if kind == "random":
            pred = rng.random(shape) < rng.uniform(0.05, 0.5)
        elif kind == "shifted":
            pred = np.roll(gt, int(rng.integers(1, 5)), axis=int(rng.integers(0, 3)))
        elif kind == "eroded":
            pred = ndimage.binary_erosion(gt, iterations=int(rng.integers(1, 3)))
        elif kind == "dilated":
            pred = ndimage.binary_dilation(gt, iterations=int(rng.integers(1, 4)))
        elif kind == "noisy":
            pred = gt ^ (rng.random(shape) < 0.05)
        elif kind == "sheet":  # foreground on the array's faces: surfels at both ends
            gt = np.zeros(shape, bool)
            gt[:, :, : 1 + i % 3] = True
            pred = np.roll(gt, int(rng.integers(0, 3)), axis=2)
        elif kind == "empty":
            pred = np.zeros(shape, bool) if i % 16 < 8 else gt.copy()
            gt = gt if i % 16 < 8 else np.zeros(shape, bool)
        else:
            pred = gt.copy()
        label = gt.astype(np.uint8)
        if kind == "ignored":
            label[...] = 2  # everything ignored: both masks empty after the ignore step
        elif i % 3 == 0:
            label[: shape[0] // 3] = np.where(label[: shape[0] // 3] == 1, 1, 2)
        yield kind, pred.astype(np.uint8), label


CASES = list(_pairs())


def test_there_are_enough_cases_of_every_kind():
    kinds = [kind for kind, _, _ in CASES]
    assert len(kinds) >= 50 and len(set(kinds)) == 8


@pytest.mark.parametrize("tolerance", [2.0, 1.0, 5.0])  # 5: the EDT path, not the local search
def test_equals_surface_distance(tolerance):
    differences = []
    for _kind, pred, label in CASES:
        p, g = prepare_masks(pred, label)
        ours = sd.surface_dice(p, g, tolerance)
        reference = surface_dice_reference(p, g, tolerance)
        differences.append(abs(ours - reference))
    assert max(differences) <= 1e-12
    values = [sd.surface_dice(*prepare_masks(p, g), tolerance) for _, p, g in CASES]
    assert 0 < np.mean(values) < 1 and min(values) == 0 and max(values) == 1


def test_label_side_reused_for_many_predictions():
    """One LabelSurface on the whole volume serves every prediction: the same values as a
    fresh computation cropped to each pair's box."""
    rng = np.random.default_rng(5)
    gt = _blobs(rng, (20, 24, 18))
    side = sd.LabelSurface.of(gt)
    for shift in range(4):
        pred = np.roll(gt, shift, axis=1) & (rng.random(gt.shape) < 0.9)
        assert side.surface_dice(pred, threads=2) == pytest.approx(
            surface_dice_reference(pred, gt), abs=1e-12
        )


def test_neighbour_codes_are_the_reference_correlation():
    rng = np.random.default_rng(0)
    mask = rng.random((5, 6, 7)) < 0.4
    padded = np.zeros((6, 7, 8), np.uint8)
    padded[:-1, :-1, :-1] = mask  # the reference's crop: one zero voxel after the end
    expected = ndimage.correlate(padded, sd._BITS, mode="constant", cval=0)
    np.testing.assert_array_equal(sd.neighbour_codes(mask), expected)


def test_ball_offsets():
    assert len(sd.ball_offsets(2.0)) == 33  # |o|^2 in {0, 1, 2, 3, 4}
    assert len(sd.ball_offsets(1.0)) == 7
    assert len(sd.ball_offsets(0.5)) == 1
