"""Exact Betti matching (ctseg.evaluation.betti_matching): matched counts known by construction, the
reference's own answers on seeded volumes, and properties every matching must have."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from ctseg.evaluation.betti_matching import _dim0_matched, dim0_bound, matched_counts
from ctseg.evaluation.metrics import tile_feature_counts, topo_counts


def _sheets(shape=(12, 20, 20), planes=(2, 6, 10)) -> np.ndarray:
    """Flat sheets normal to axis 0, one voxel thick, separated by empty planes."""
    vol = np.zeros(shape, bool)
    for p in planes:
        vol[p, 2:-2, 2:-2] = True
    return vol


def _fragment(vol: np.ndarray, plane: int, pieces: int) -> np.ndarray:
    """Cut the sheet at `plane` into `pieces` pieces by clearing columns along axis 2."""
    out = vol.copy()
    cols = np.flatnonzero(out[plane].any(axis=0))
    for cut in np.array_split(cols, pieces)[1:]:
        out[plane, :, cut[0]] = False
    return out


def _ring(shape=(12, 12, 12), plane: int = 3) -> np.ndarray:
    """A square loop, one voxel wide, in the plane normal to axis 0 at `plane`."""
    vol = np.zeros(shape, bool)
    vol[plane, 3:9, 3:9] = True
    vol[plane, 4:8, 4:8] = False
    return vol


def _counts(pred: np.ndarray, gt: np.ndarray) -> list[tuple[int, int, int]]:
    """(m_k, p_k, g_k) per dimension for one tile."""
    m = matched_counts(pred, gt)
    p, g = tile_feature_counts(pred), tile_feature_counts(gt)
    return [(m[k], p[k], g[k]) for k in range(3)]


# --- known by construction --------------------------------------------------------------------


@pytest.mark.parametrize("pieces", [2, 5])
def test_fragments_match_only_the_sheets_they_cover(pieces):
    """Label: three sheets (2 finite components). A prediction inside the label matches one
    dimension-0 interval per label sheet it touches beyond the first, however fragmented."""
    gt = _sheets()
    one = _fragment(gt & (np.arange(12) == 2)[:, None, None], 2, pieces)
    assert _counts(one, gt)[0] == (0, pieces - 1, 2)  # the count bound would say 2
    two = _fragment(_fragment(gt & (np.arange(12) < 8)[:, None, None], 2, pieces), 6, pieces)
    assert _counts(two, gt)[0] == (1, 2 * pieces - 1, 2)


def test_ring_shifted_beyond_its_width_is_not_matched():
    gt = _ring(plane=3)
    assert _counts(gt, gt)[1] == (1, 1, 1)
    # Touching (shift 1): both loops lie in one 6-connected band, so they are one class.
    assert _counts(_ring(plane=4), gt)[1] == (1, 1, 1)
    # Shift 3: the label's loop dies before the two loops become homologous.
    assert _counts(_ring(plane=6), gt)[1] == (0, 1, 1)
    assert _counts(gt, _ring(plane=6))[1] == (0, 1, 1)


def _block_with_voids(voids) -> np.ndarray:
    vol = np.zeros((14, 14, 14), bool)
    vol[1:13, 1:13, 1:13] = True
    for z, y, x in voids:
        vol[z : z + 2, y : y + 2, x : x + 2] = False
    return vol


def test_one_void_against_two_voids():
    one = _block_with_voids([(3, 3, 3)])
    two = _block_with_voids([(3, 3, 3), (8, 8, 8)])
    assert _counts(two, one)[2] == (1, 2, 1)
    assert _counts(one, two)[2] == (1, 1, 2)
    # A void somewhere else is filled in the union, so nothing matches it.
    elsewhere = _block_with_voids([(8, 3, 8)])
    assert _counts(elsewhere, one)[2] == (0, 1, 1)


def test_empty_tiles():
    empty = np.zeros((6, 7, 8), bool)
    assert matched_counts(empty, empty) == (0, 0, 0)
    rich = _block_with_voids([(3, 3, 3)]) | _sheets((14, 14, 14), (0,))
    empty = np.zeros_like(rich)
    assert tile_feature_counts(rich) != (0, 0, 0)
    assert matched_counts(rich, empty) == matched_counts(empty, rich) == (0, 0, 0)
    # Degenerate tiles (an axis of length 1) have no cubes: dimension 2 is skipped.
    flat = np.ones((1, 5, 5), bool)
    flat[0, 2, 2] = False
    assert matched_counts(flat, flat) == (0, 1, 0)


# --- the reference's answers -----------------------------------------------------------------

# (m_0, m_1, m_2) from Betti-Matching-3D (C++, commit 50d7379, built from source) on the
# inverted masks of these seeded volumes. In dimension 1 of the rolled cases 8, 10 and 12 the
# count bound min(p_k, g_k) would say 48, 89 and 73.
REFERENCE = {
    0: (0, 14, 0),
    3: (0, 18, 0),
    4: (1, 5, 0),
    6: (2, 5, 0),
    8: (0, 1, 1),
    9: (0, 34, 0),
    10: (0, 0, 0),
    11: (0, 44, 1),
    12: (0, 1, 0),
    13: (0, 33, 1),
    14: (78, 3, 0),
    15: (91, 1, 0),
}


def _reference_case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if seed < 4:
        shape = (9 + seed, 12, 11 - seed % 3)
        return rng.random(shape) < 0.5, rng.random(shape) < 0.5
    if seed < 8:
        shape = (9 + seed, 12, 11 - seed % 3)
        a = ndimage.gaussian_filter(rng.standard_normal(shape), 1.2) > 0
        return a, a ^ (rng.random(shape) < 0.15)
    shape = (12, 13, 14)
    a = rng.random(shape) < (0.85 if seed < 14 else 0.3)
    if seed < 14 and seed % 2 == 0:
        return a, np.roll(a, 1, axis=seed % 3)
    return a, a ^ (rng.random(shape) < 0.1)


@pytest.mark.parametrize("seed", sorted(REFERENCE))
def test_matches_betti_matching_3d(seed):
    pred, gt = _reference_case(seed)
    assert matched_counts(pred, gt) == REFERENCE[seed]


# --- properties --------------------------------------------------------------------------------


def _random_pairs():
    rng = np.random.default_rng(123)
    for _ in range(6):
        shape = tuple(int(s) for s in rng.integers(4, 13, size=3))
        a = rng.random(shape) < rng.uniform(0.3, 0.85)
        yield a, a ^ (rng.random(shape) < 0.15)
        yield a, rng.random(shape) < rng.uniform(0.3, 0.85)


def test_properties_of_the_matching():
    for pred, gt in _random_pairs():
        rows = _counts(pred, gt)
        assert all(m <= min(p, g) for m, p, g in rows)
        # Swapping prediction and label swaps p and g and keeps m.
        assert [(m, g, p) for m, p, g in rows] == _counts(gt, pred)
        # Identical inputs match every finite interval.
        assert matched_counts(pred, pred) == tile_feature_counts(pred)


def test_topo_counts_methods_differ_only_in_m():
    rng = np.random.default_rng(7)
    gt = ndimage.gaussian_filter(rng.standard_normal((20, 20, 20)), 1.0) > 0.3
    pred = np.roll(gt, 1, axis=0)
    exact, used = topo_counts(pred, gt, "betti_matching")
    bound, used_bound = topo_counts(pred, gt, "betti_counts")
    assert (used, used_bound) == ("betti_matching", "betti_counts")
    assert (exact[:, 1:] == bound[:, 1:]).all()
    assert (exact[:, 0] <= bound[:, 0]).all() and (exact[:, 0] < bound[:, 0]).any()


def test_skipped_dimensions_leave_the_others_unchanged():
    """A dimension with nothing to match on one side can be skipped (m_k <= min(p_k, g_k) = 0)
    without changing the other dimensions' counts: dimension 1 still gets its clearing."""
    for seed in (9, 11, 13, 14):
        pred, gt = _reference_case(seed)
        full = REFERENCE[seed]
        for dims in ((True, True, False), (False, True, False), (True, False, False)):
            expected = tuple(m if keep else 0 for m, keep in zip(full, dims, strict=True))
            assert matched_counts(pred, gt, dims) == expected, (seed, dims)
    # topo_counts skips only dimensions where p_k or g_k is 0: the same counts as every one.
    for pred, gt in _random_pairs():
        exact, _ = topo_counts(pred, gt, every_dim=True)
        fast, _ = topo_counts(pred, gt, threads=2)
        np.testing.assert_array_equal(fast, exact)


def _dim0_pairs():
    """Random pairs of every density, smooth pairs with a shifted or flipped copy, and the
    reference's own cases: union components of every kind (full, prediction-only, label-only)."""
    rng = np.random.default_rng(99)
    for i in range(400):
        shape = tuple(int(s) for s in rng.integers(2, 10, size=3))
        a = rng.random(shape) < rng.uniform(0.05, 0.7)
        if i % 3 == 0:
            yield a, a ^ (rng.random(shape) < 0.1)
        elif i % 3 == 1:
            yield a, rng.random(shape) < rng.uniform(0.05, 0.7)
        else:
            smooth = ndimage.gaussian_filter(rng.standard_normal(shape), 1.0) > 0.4
            yield smooth, np.roll(smooth, 1, axis=i % 3)
    for seed in REFERENCE:
        yield _reference_case(seed)


def test_dim0_bound_is_an_upper_bound_and_exact_where_it_says():
    """m_0 = F + C - 1 (`dim0_bound`): the union's components bound m_0 from above, tighter
    than min(p_0, g_0), and give it exactly when no component holds only one side's voxels."""
    exact_cases = tighter = 0
    for pred, gt in _dim0_pairs():
        bound, exact = dim0_bound(pred, gt)
        both = pred.any() and gt.any()
        m0 = _dim0_matched(pred.astype(np.uint8), gt.astype(np.uint8)) if both else 0
        assert bound >= m0, (pred.shape, bound, m0)
        if exact:
            assert bound == m0
            exact_cases += 1
        p0, g0 = tile_feature_counts(pred)[0], tile_feature_counts(gt)[0]
        assert bound <= min(p0, g0)
        tighter += bound < min(p0, g0)
    # Both branches are exercised: most pairs are decided without the union-find, and the
    # bound is strictly below min(p_0, g_0) on many.
    assert exact_cases > 100 and tighter > 50
    # The shortcut leaves matched_counts' answers as the replayed union-find gives them.
    for seed in REFERENCE:
        pred, gt = _reference_case(seed)
        assert matched_counts(pred, gt) == matched_counts(pred, gt, plain=True) == REFERENCE[seed]


# --- shortcuts against the unoptimised path ----------------------------------------------------


def _shortcut_pairs():
    """Random, smooth, shifted and thresholded pairs, including the noisy masks a low
    threshold of a weak model's probabilities gives (tuning scores those)."""
    rng = np.random.default_rng(2024)
    for i in range(45):
        # Mostly small tiles; the last five are larger, where long reductions happen.
        shape = tuple(int(s) for s in rng.integers(3, 16, size=3) + (16 if i >= 40 else 0))
        kind = i % 5
        if kind == 0:
            a = rng.random(shape) < rng.uniform(0.2, 0.9)
            yield a, rng.random(shape) < rng.uniform(0.2, 0.9)
        elif kind == 1:
            a = rng.random(shape) < rng.uniform(0.3, 0.9)
            yield a, a ^ (rng.random(shape) < 0.1)
        elif kind == 2:
            a = ndimage.gaussian_filter(rng.standard_normal(shape), 1.0) > rng.uniform(-0.3, 0.3)
            yield a, np.roll(a, 1 + i % 2, axis=i % 3)
        else:
            # A smooth "label" and a noisy probability map thresholded low (kind 3) or at the
            # label's own level with speckle (kind 4).
            smooth = ndimage.gaussian_filter(rng.standard_normal(shape), 1.5)
            gt = smooth > 0.1
            probs = smooth + 0.4 * rng.standard_normal(shape)
            yield (probs > (-0.4 if kind == 3 else 0.1)), gt


def test_reordered_value0_block_gives_the_reference_order_counts():
    """Reducing the comparison's value-0 squares in another order (each input's own squares
    first, the others in descending key order) and claiming a free pivot without building the
    column (the shortcuts) give the same dimension-1 flags and count as the reference's column
    order with every column built."""
    from ctseg.evaluation import betti_matching as bm

    total = 0
    for pred, gt in _shortcut_pairs():
        p = np.ascontiguousarray(pred, dtype=np.uint8)
        g = np.ascontiguousarray(gt, dtype=np.uint8)
        union = p | g
        order = bm._square_order(union)
        _, positive = bm._dim2_matched_and_clearing(p, g, union, order, False)
        plain = bm._dim1_matched(p, g, union, order, positive, reorder=False, fast=False)
        assert bm._dim1_matched(p, g, union, order, positive) == plain, pred.shape
        # The flags of each input's reduction, not only their conjunction, agree.
        keep = positive[order] == 0
        columns = order[keep]
        first = int(np.count_nonzero(keep[: bm._count_value0(union, order)]))
        head, tail = columns[:first], columns[first:]
        for fg in (p, g):
            plain_flags = bm._image_fg_pivots(fg, head, tail, fast=False)
            np.testing.assert_array_equal(bm._image_fg_pivots(fg, head, tail), plain_flags)
            np.testing.assert_array_equal(
                bm._image_fg_pivots(fg, bm._value0_order(fg, head), tail), plain_flags
            )
        total += plain
    assert total > 50  # the pairs have loops to match, so the comparison means something
