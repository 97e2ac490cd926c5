"""ctseg.evaluation.thinning gives skimage's 2D skeletonize bit for bit, slice by slice along any
axis."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from scipy import ndimage as ndi
from skimage.morphology import skeletonize

from ctseg.evaluation.thinning import deletable_table, skeletonize_2d, slices_skeleton


def _noise(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    images = []
    for t in range(n):
        h, w = (int(v) for v in rng.integers(1, 48, 2))
        density = (0.1, 0.3, 0.5, 0.7, 0.9)[t % 5]
        images.append(rng.random((h, w)) < density)
    return images


def _blobs(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    images = []
    for t in range(n):
        h, w = (int(v) for v in rng.integers(4, 64, 2))
        sigma = (1.0, 2.0, 3.5)[t % 3]
        field = ndi.gaussian_filter(rng.random((h, w)), sigma)
        images.append(field > np.quantile(field, rng.uniform(0.2, 0.8)))
    return images


def _shapes(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    images = []
    for t in range(n):
        h, w = (int(v) for v in rng.integers(8, 60, 2))
        yy, xx = np.mgrid[:h, :w]
        kind = t % 4
        if kind == 0:  # a thick line at a random angle (touches the border)
            angle, width = rng.uniform(0, np.pi), rng.uniform(1.0, 6.0)
            dist = (yy - h / 2) * np.cos(angle) - (xx - w / 2) * np.sin(angle)
            image = np.abs(dist) < width
        elif kind == 1:  # a ring
            r0 = rng.uniform(2, min(h, w) / 2)
            r = np.hypot(yy - rng.uniform(0, h), xx - rng.uniform(0, w))
            image = (r > r0) & (r < r0 + rng.uniform(1, 6))
        elif kind == 2:  # filled rectangles, some at the border
            image = np.zeros((h, w), bool)
            for _ in range(int(rng.integers(1, 4))):
                r0, c0 = int(rng.integers(0, h)), int(rng.integers(0, w))
                image[r0 : r0 + int(rng.integers(1, h)), c0 : c0 + int(rng.integers(1, w))] = True
        else:  # a sheet seen edge-on with holes: a thick band plus noise
            image = (np.abs(yy - h / 2) < rng.uniform(2, 8)) & (rng.random((h, w)) < 0.9)
        images.append(image)
    return images


def _fixed() -> list[np.ndarray]:
    images = [np.zeros((0, 0), bool), np.zeros((0, 5), bool)]
    for shape in [(1, 1), (1, 2), (2, 1), (1, 9), (9, 1), (2, 2), (2, 3), (3, 2), (3, 3), (4, 4)]:
        images += [np.zeros(shape, bool), np.ones(shape, bool)]
    images += [np.ones((17, 31), bool), np.ones((40, 7), bool)]
    single = np.zeros((7, 7), bool)
    single[3, 3] = True
    corner = np.zeros((7, 7), bool)
    corner[0, 0] = True
    images += [single, corner]
    return images


def _all_images() -> list[np.ndarray]:
    rng = np.random.default_rng(2026)
    return _fixed() + _noise(rng, 120) + _blobs(rng, 90) + _shapes(rng, 100)


IMAGES = _all_images()


def test_enough_images() -> None:
    assert len(IMAGES) >= 300


def test_equals_skimage_on_generated_images() -> None:
    bad = [
        i for i, im in enumerate(IMAGES) if not np.array_equal(skeletonize_2d(im), skeletonize(im))
    ]
    assert bad == []


def test_equals_skimage_on_views_and_non_bool() -> None:
    rng = np.random.default_rng(7)
    for im in _blobs(rng, 20):
        for view in (im.T, im[::-1], im[:, ::2], np.asfortranarray(im)):
            assert np.array_equal(skeletonize_2d(view), skeletonize(view))
        as_int = im.astype(np.uint8) * 3
        assert np.array_equal(skeletonize_2d(as_int), skeletonize(as_int))


def test_every_table_entry_is_exercised_by_the_images() -> None:
    # Replays the thinning in Python on the images to record which (subiteration, code)
    # verdicts are looked up: each of the 512 is, so every one is checked against skimage.
    table = deletable_table()
    seen = np.zeros((2, 256), bool)
    weights = np.array([[8, 4, 2], [16, 0, 1], [32, 64, 128]])
    for im in IMAGES[:200]:
        a = np.pad(im, 1).astype(np.uint8)
        changed = True
        while changed:
            changed = False
            for k in range(2):
                codes = ndi.correlate(a, weights, mode="constant")
                on = a == 1
                seen[k, codes[on]] = True
                remove = on & (table[k][codes] == 1)
                if remove.any():
                    a[remove] = 0
                    changed = True
    assert seen.all()


def _skimage_slices(mask: np.ndarray, axis: int) -> np.ndarray:
    moved = np.moveaxis(mask, axis, 0)
    return np.moveaxis(np.stack([skeletonize(s) for s in moved]), 0, axis)


def _volumes() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    blobs = ndi.gaussian_filter(rng.random((24, 30, 36)), 2.0) > 0.5
    sheet = np.zeros((20, 28, 33), bool)
    zz, yy, xx = np.mgrid[:20, :28, :33]
    sheet[np.abs(zz - 10 - 0.2 * yy + 0.1 * xx) < 3] = True
    noise = rng.random((9, 17, 11)) < 0.6
    return [blobs, sheet, noise, np.zeros((4, 5, 6), bool), np.ones((3, 4, 5), bool)]


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_slices_skeleton_equals_skimage_per_slice(axis: int) -> None:
    for volume in _volumes():
        expected = _skimage_slices(volume, axis)
        for threads in (1, 3):
            got = slices_skeleton(volume, axis, threads)
            assert got.dtype == bool and got.shape == volume.shape
            assert np.array_equal(got, expected)
        assert np.array_equal(slices_skeleton(np.asfortranarray(volume), axis), expected)


def test_axis_skeleton_equals_the_skimage_path() -> None:
    from ctseg.evaluation import metrics

    volume = _volumes()[0]
    for axis in range(3):
        assert np.array_equal(metrics._axis_skeleton(volume, axis), _skimage_slices(volume, axis))


def test_default_threads_follow_numba_setting() -> None:
    volume = _volumes()[1]
    saved = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert np.array_equal(slices_skeleton(volume, 0), _skimage_slices(volume, 0))
    finally:
        numba.set_num_threads(saved)


def test_rejects_wrong_dimensions() -> None:
    with pytest.raises(ValueError):
        skeletonize_2d(np.zeros((2, 2, 2), bool))
    with pytest.raises(ValueError):
        slices_skeleton(np.zeros((2, 2), bool), 0)
