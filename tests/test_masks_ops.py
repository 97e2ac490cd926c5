"""The winners' post-processing operations of ctseg.postprocess.masks on hand-built volumes:
closing, per-slice hole plugging, patching of large holes, hysteresis along z; and how binary_mask
and
the settings carry them."""

from __future__ import annotations

import dataclasses
import itertools

import cc3d
import numpy as np
import pytest
from scipy import ndimage

from ctseg.io import CtsegError
from ctseg.postprocess.masks import (
    MaskCache,
    PostprocessSettings,
    binary_mask,
    close,
    hysteresis,
    hysteresis_z,
    patch_holes,
    plug_holes,
    settings_from_mapping,
)

SHAPE = (16, 20, 20)


def sheet(axis: int = 0, at: int = 8, thickness: int = 1, shape=SHAPE) -> np.ndarray:
    """A flat sheet across the whole volume, perpendicular to `axis`."""
    mask = np.zeros(shape, np.uint8)
    index = [slice(None)] * 3
    index[axis] = slice(at, at + thickness)
    mask[tuple(index)] = 1
    return mask


def components(mask: np.ndarray) -> int:
    return int(cc3d.connected_components(mask, connectivity=26).max())


# ----------------------------------------------------------------------------- closing
@pytest.mark.parametrize("thickness", [1, 2])
@pytest.mark.parametrize("gap", [1, 2])
def test_closing_radius_1_closes_a_crack_of_one_or_two_voxels(gap, thickness):
    mask = sheet(thickness=thickness)
    mask[:, :, 9 : 9 + gap] = 0  # a crack through the sheet, across the whole volume
    assert components(mask) == 2
    closed = close(mask, 1)
    np.testing.assert_array_equal(closed, sheet(thickness=thickness))  # exactly the sheet back


def test_a_crack_of_three_voxels_needs_radius_2():
    mask = sheet(thickness=2)
    mask[:, :, 9:12] = 0
    assert components(close(mask, 1)) == 2
    np.testing.assert_array_equal(close(mask, 2), sheet(thickness=2))


def test_closing_keeps_sheets_further_apart_than_its_reach():
    """Two parallel sheets with 3 empty planes between them stay apart at radius 1 (reach 2)
    and join at radius 2 (reach 4): the merge the search has to weigh."""
    mask = sheet(at=4, thickness=2) | sheet(at=9, thickness=2)
    assert components(close(mask, 1)) == 2
    np.testing.assert_array_equal(close(mask, 1), mask)
    assert components(close(mask, 2)) == 1


def test_closing_never_removes_a_voxel_and_does_not_trim_the_faces():
    rng = np.random.default_rng(0)
    mask = (rng.random(SHAPE) < 0.2).astype(np.uint8)
    for radius in (1, 2):
        assert (close(mask, radius) >= mask).all()
    # A thin bridge between two blocks, and a sheet running into the volume's faces, stay as
    # they are (a closing with zeros outside would eat r voxels off every face).
    blocks = np.zeros(SHAPE, np.uint8)
    blocks[2:6, 2:6, 2:6] = blocks[2:6, 2:6, 14:18] = 1
    blocks[4, 4, 6:14] = 1
    np.testing.assert_array_equal(close(blocks, 1), blocks)
    np.testing.assert_array_equal(close(sheet(axis=2), 2), sheet(axis=2))
    np.testing.assert_array_equal(close(mask, 0), mask)


# ----------------------------------------------------------------------------- hole plugging
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_plugging_fills_a_small_tear_in_a_sheet_of_any_orientation(axis):
    full = sheet(axis=axis, thickness=2)
    torn = full.copy()
    tear = [slice(6, 8)] * 3
    tear[axis] = slice(8, 10)
    torn[tuple(tear)] = 0  # a 2x2 hole through both layers of the sheet
    np.testing.assert_array_equal(plug_holes(torn, 4), full)
    np.testing.assert_array_equal(plug_holes(torn, 3), torn)  # bigger than the bound: stays
    np.testing.assert_array_equal(plug_holes(torn, 0), torn)


def test_plugging_leaves_holes_open_to_the_border_and_between_sheets():
    # A tear at the sheet's edge is a notch, not a hole: open to the slice's border.
    notched = sheet(thickness=2)
    notched[8:10, 0:3, 5:8] = 0
    np.testing.assert_array_equal(plug_holes(notched, 100), notched)
    # Two parallel sheets: the background between them reaches the border in every slice.
    pair = sheet(at=4) | sheet(at=9)
    np.testing.assert_array_equal(plug_holes(pair, 10_000), pair)


def test_the_area_bound_keeps_the_inside_of_a_wrapped_sheet():
    """A sheet rolled into a tube along z encloses its inside in every z-slice: plugging fills
    it only if the bound allows its area (here 49 voxels)."""
    tube = np.zeros(SHAPE, np.uint8)
    tube[:, 5:14, 5:14] = 1
    tube[:, 6:13, 6:13] = 0
    np.testing.assert_array_equal(plug_holes(tube, 48), tube)
    filled = plug_holes(tube, 49)
    assert filled[:, 6:13, 6:13].all() and filled.sum() == tube.sum() + 16 * 49


# ----------------------------------------------------------------------------- large holes
def test_patching_fills_a_large_tear_inside_a_sheet():
    full = sheet(axis=1, thickness=2)
    torn = full.copy()
    torn[4:10, 8:10, 6:12] = 0  # a 6x6 tear (36 voxels a slice) through a y-sheet
    np.testing.assert_array_equal(plug_holes(torn, 16), torn)  # too large to plug
    np.testing.assert_array_equal(patch_holes(torn, 64), full)
    np.testing.assert_array_equal(patch_holes(torn, 35), torn)  # over the bound


def test_patching_leaves_the_inside_of_a_wrapped_sheet():
    """The tube's inside is a large enclosed hole in every z-slice, but its ring is a one-voxel
    wall with background beyond: not a tear in a sheet along the slice, so it stays."""
    tube = np.zeros(SHAPE, np.uint8)
    tube[:, 5:14, 5:14] = 1
    tube[:, 6:13, 6:13] = 0
    np.testing.assert_array_equal(patch_holes(tube, 10_000), tube)
    # Thick walls (the ring all mask) make it a tear again: the ring test is what decides.
    thick = np.zeros(SHAPE, np.uint8)
    thick[:, 2:18, 2:18] = 1
    thick[:, 6:13, 6:13] = 0
    assert patch_holes(thick, 10_000)[:, 6:13, 6:13].all()


# ----------------------------------------------------------------------------- hysteresis
def test_hysteresis_along_z_needs_the_high_threshold_in_each_slice():
    """Weak surface in slices 3 and 4, confident only in slice 4: 3D hysteresis keeps both
    slices (one 26-connected component), hysteresis along z keeps slice 4 only."""
    probs = np.zeros(SHAPE, np.float32)
    probs[3:5, 5:12, 5:12] = 0.6
    probs[4, 8, 8] = 0.95
    probs[10, 2:6, 2:6] = 0.6  # weak and alone: dropped by both
    probs[12, 2:6, 2:6] = 0.6
    probs[12, 6, 6] = 0.95  # weak, with a confident voxel diagonal to it in its slice: kept
    in_3d, along_z = hysteresis(probs, 0.5, 0.9), hysteresis_z(probs, 0.5, 0.9)
    assert in_3d[3:5, 5:12, 5:12].all() and not in_3d[10].any()
    assert along_z[4, 5:12, 5:12].all() and not along_z[3].any() and not along_z[10].any()
    assert along_z[12, 2:6, 2:6].all() and along_z[12, 6, 6] == 1
    assert along_z.dtype == np.uint8 and set(np.unique(along_z)) <= {0, 1}


def test_hysteresis_along_z_never_keeps_more_than_3d():
    rng = np.random.default_rng(1)
    probs = rng.random(SHAPE).astype(np.float32)
    in_3d, along_z = hysteresis(probs, 0.6, 0.95), hysteresis_z(probs, 0.6, 0.95)
    assert (along_z <= in_3d).all() and along_z.sum() < in_3d.sum()
    assert (along_z <= (probs > 0.6)).all()


# ----------------------------------------------------------------------------- binary_mask
def test_binary_mask_applies_the_new_steps_in_order_and_counts_them():
    probs = sheet(thickness=2).astype(np.float32) * 0.9
    probs[8:10, 6:8, 6:8] = 0.1  # a 2x2 tear: plugged
    probs[8:10, 12:18, 3:9] = 0.1  # a 6x6 tear: patched
    probs[:, :, 15] = 0.1  # a crack across the sheet: closed
    probs[1, 1, 1] = 0.9  # a speck: removed first, so nothing grows around it
    settings = PostprocessSettings(
        min_component_voxels=2, plug_holes_max_area=4, patch_holes_max_area=64, closing_radius=1
    )
    mask, counts = binary_mask(probs, settings)
    np.testing.assert_array_equal(mask, sheet(thickness=2))
    assert counts["removed_voxels"] == 1
    assert counts["plugged_voxels"] == 8 and counts["patched_voxels"] == 72
    assert counts["closed_voxels"] == 2 * 20  # the crack: both layers, every y
    assert counts["foreground_voxels"] == int(mask.sum())


def test_with_the_new_steps_off_the_mask_is_what_it_was():
    rng = np.random.default_rng(2)
    probs = rng.random(SHAPE).astype(np.float32)
    mask, counts = binary_mask(probs, PostprocessSettings(threshold=0.7, min_component_voxels=3))
    expected = (probs > 0.7).astype(np.uint8)
    cc3d.dust(expected, threshold=3, connectivity=26, in_place=True)
    np.testing.assert_array_equal(mask, expected)
    assert counts["plugged_voxels"] == counts["patched_voxels"] == counts["closed_voxels"] == 0


def test_settings_carry_the_new_steps():
    s = PostprocessSettings(
        hysteresis_high=0.9,
        hysteresis_mode="z",
        plug_holes_max_area=64,
        patch_holes_max_area=1024,
        closing_radius=1,
    )
    assert s.label() == "t>0.5 hyst-z 0.9 plug 64 patch 1024 close 1"
    assert settings_from_mapping(s.as_dict(), "tuned.json") == s
    for key in ("plug_holes_max_area", "patch_holes_max_area", "closing_radius"):
        assert PostprocessSettings(**{key: 1}).whole_volume
    # A file written before these keys existed still loads, with them off.
    old = {"threshold": 0.4, "hysteresis_high": None, "min_component_voxels": 0, "fill_holes": True}
    assert settings_from_mapping(old, "old.json") == PostprocessSettings(0.4, fill_holes=True)
    with pytest.raises(CtsegError, match="old.json.*unknown \\['closing'\\]"):
        settings_from_mapping({**old, "closing": 1}, "old.json")


@pytest.mark.parametrize(
    "kw",
    [
        {"hysteresis_mode": "z"},  # no hysteresis_high: the mode would do nothing
        {"hysteresis_high": 0.9, "hysteresis_mode": "2d"},
        {"plug_holes_max_area": -1},
        {"patch_holes_max_area": 2.5},
        {"plug_holes_max_area": True},
        {"closing_radius": 3},
        {"closing_radius": True},
    ],
    ids=str,
)
def test_bad_new_settings_are_refused(kw):
    with pytest.raises(CtsegError, match="|".join(kw)):
        PostprocessSettings(**kw)


def test_close_does_not_stretch_a_mask_that_stops_short_of_a_face() -> None:
    # A 2-voxel sheet ending 2 voxels from the faces y=0 and x=0 (the strips between it and
    # those faces are no crack): closing adds nothing there, and keeps every voxel.
    mask = np.zeros((12, 16, 16), np.uint8)
    mask[5:7, 2:, 2:] = 1
    for radius in (1, 2):
        closed = close(mask, radius)
        assert (closed >= mask).all()
        np.testing.assert_array_equal(closed, mask)


# ----------------------------------------------------------------------------- MaskCache
def smooth_probabilities(shape=(24, 28, 32), seed: int = 3) -> np.ndarray:
    """Blobs of every size with holes and cracks between them, and specks: every step does
    something."""
    rng = np.random.default_rng(seed)
    probs = ndimage.gaussian_filter(rng.random(shape), 1.5)
    probs = (probs - probs.min()) / np.ptp(probs)
    probs[rng.random(shape) < 0.003] = 0.9
    return probs.astype(np.float16)


def test_the_mask_cache_builds_each_step_once_and_gives_binary_masks_masks():
    """A search's candidates: the best so far with one later step changed. Through the cache
    each shares the steps before its own (a closing candidate costs a closing), and every mask
    equals `binary_mask`'s bit for bit."""
    probs = smooth_probabilities()
    cache = MaskCache(probs)
    base = PostprocessSettings(
        threshold=0.45, hysteresis_high=0.55, hysteresis_mode="z", min_component_voxels=4
    )
    base = dataclasses.replace(base, fill_holes=True)
    plugged = dataclasses.replace(base, plug_holes_max_area=16)
    patched = dataclasses.replace(plugged, patch_holes_max_area=256)
    candidates = [
        base,
        plugged,
        dataclasses.replace(base, plug_holes_max_area=64),
        patched,
        dataclasses.replace(plugged, patch_holes_max_area=1024),
        dataclasses.replace(patched, closing_radius=1),
        dataclasses.replace(patched, closing_radius=2),
    ]
    for settings in candidates:
        got = cache.mask(settings)
        expected, _ = binary_mask(probs, settings)
        assert got.dtype == np.uint8 and got.shape == probs.shape
        np.testing.assert_array_equal(got, expected)
    # hysteresis, components, fill; then one step for each later candidate
    assert cache.steps_run == 3 + 6
    np.testing.assert_array_equal(cache.mask(candidates[-1]), binary_mask(probs, candidates[-1])[0])
    assert cache.steps_run == 9  # a repeat is read from the cache, not built


def test_the_mask_cache_equals_binary_mask_for_any_order_of_settings():
    """Settings in any order, sharing any prefix of steps, or none."""
    probs = smooth_probabilities(seed=4)
    cache = MaskCache(probs)
    grid = itertools.product(
        [(0.4, None, "3d"), (0.4, 0.6, "3d"), (0.4, 0.6, "z"), (0.5, None, "3d")],
        [0, 8],
        [False, True],
        [0, 16],
        [0, 256],
        [0, 1, 2],
    )
    settings = [
        PostprocessSettings(t, high, n, fill, mode, plug, patch, r)
        for (t, high, mode), n, fill, plug, patch, r in grid
    ]
    order = np.random.default_rng(0).permutation(len(settings))[:120]
    for i in order:
        np.testing.assert_array_equal(cache.mask(settings[i]), binary_mask(probs, settings[i])[0])
