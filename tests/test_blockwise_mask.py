"""The blockwise mask (ctseg.postprocess.blockwise) is `binary_mask`'s, bit for bit, with its
counts: on noise and on structures that only join across block faces, edges and corners or in a
far block, for block shapes that divide the volume, that do not, one voxel thin, and one block
larger than the volume; plugging and patching are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from ctseg.io import CtsegError
from ctseg.postprocess.blockwise import blockwise_mask
from ctseg.postprocess.masks import PostprocessSettings, binary_mask

SHAPE = (18, 15, 13)
BLOCKS = [(4, 4, 4), (5, 7, 3), (1, 15, 13), (18, 1, 13), (18, 15, 1), (6, 6, 20)]

SETTINGS = {
    "threshold": PostprocessSettings(threshold=0.5),
    "hysteresis": PostprocessSettings(threshold=0.4, hysteresis_high=0.8),
    "hysteresis_z": PostprocessSettings(threshold=0.4, hysteresis_high=0.8, hysteresis_mode="z"),
    "min_component": PostprocessSettings(threshold=0.4, min_component_voxels=12),
    "fill": PostprocessSettings(threshold=0.5, fill_holes=True),
    "close_1": PostprocessSettings(threshold=0.5, closing_radius=1),
    "close_2": PostprocessSettings(threshold=0.5, closing_radius=2),
    "hysteresis_min": PostprocessSettings(
        threshold=0.4, hysteresis_high=0.8, min_component_voxels=12
    ),
    "hysteresis_z_min_fill_close": PostprocessSettings(
        threshold=0.4,
        hysteresis_high=0.8,
        hysteresis_mode="z",
        min_component_voxels=12,
        fill_holes=True,
        closing_radius=1,
    ),
    "all_3d": PostprocessSettings(
        threshold=0.4,
        hysteresis_high=0.8,
        min_component_voxels=12,
        fill_holes=True,
        closing_radius=2,
    ),  # fmt: skip
}


def noise(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    smooth = ndimage.gaussian_filter(rng.random(shape), 1.0)
    return ((smooth - smooth.min()) / (smooth.max() - smooth.min())).astype(np.float32)


def structures(shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """Weak (0.6) and confident (0.9) surface on a 0.1 background:
    - a U: two weak bars down z joined only at the far end, one bar seeded at its top;
    - a diagonal chain of weak voxels touching only at corners, seeded at one end;
    - a closed hollow box (a cavity) and a box open to the volume's face;
    - a sheet along the x = 0 face with a one-voxel crack, an unseeded weak blob and a small
      confident one."""
    p = np.full(shape, 0.1, np.float32)
    p[1:16, 2, 2] = 0.6
    p[1:16, 2, 7] = 0.6
    p[15, 2, 2:8] = 0.6
    p[1, 2, 7] = 0.9
    for k in range(7):
        p[k, 14 - k, 2 + k] = 0.6
    p[0, 14, 2] = 0.9
    p[8:14, 6:12, 4:10] = 0.9
    p[9:13, 7:11, 5:9] = 0.1
    p[0:4, 11:15, 8:12] = 0.6
    p[1:4, 12:14, 9:11] = 0.1
    p[:, :, 0] = 0.9
    p[5, 4:8, 0] = 0.1
    p[4:6, 13:15, 3:5] = 0.6
    p[15:17, 10:12, 11] = 0.9
    return p


def check(probs: np.ndarray, settings: PostprocessSettings, block: tuple[int, ...]) -> None:
    expected, expected_counts = binary_mask(probs, settings)
    out = np.full(probs.shape, 7, np.uint8)  # every voxel must be written
    counts = blockwise_mask(probs, out, settings, block=block)
    assert np.array_equal(out, expected), (settings.label(), block, int((out != expected).sum()))
    assert counts == expected_counts


@pytest.mark.parametrize("name", SETTINGS)
def test_identical_to_the_whole_volume(name: str) -> None:
    settings = SETTINGS[name]
    for probs in (noise(SHAPE, 0), structures()):
        for block in BLOCKS:
            check(probs, settings, block)


def test_the_structures_need_the_merge() -> None:
    """The structured volume is a real test: each step changes it, and what it keeps or drops
    is decided only by voxels in other blocks (a block-local mask would differ)."""
    p = structures()
    counts = binary_mask(p, SETTINGS["all_3d"])[1]
    for key in ("hysteresis_dropped_voxels", "removed_voxels", "filled_voxels", "closed_voxels"):
        assert counts[key] > 0, (key, counts)
    hysteresis = binary_mask(p, SETTINGS["hysteresis"])[0]
    assert hysteresis[10, 2, 2] and hysteresis[6, 8, 8]  # U, chain: kept
    assert not hysteresis[4, 13, 3]  # the unseeded blob: dropped
    assert hysteresis[15, 10, 11] and not binary_mask(p, SETTINGS["hysteresis_min"])[0][15, 10, 11]
    filled = binary_mask(p, SETTINGS["fill"])[0]
    assert filled[10, 8, 6] and not filled[2, 12, 9]  # the cavity filled, the open box not
    # A block-local hysteresis (each block its own volume) loses the U's unseeded bar.
    local = np.zeros_like(hysteresis)
    for z in range(0, SHAPE[0], 4):
        sl = np.s_[z : z + 4]
        local[sl] = binary_mask(p[sl], SETTINGS["hysteresis"])[0]
    assert not local[10, 2, 2]


def test_one_voxel_blocks_and_corner_contacts() -> None:
    """Blocks of one voxel: every contact is across a face, an edge or a corner."""
    p = np.full((6, 5, 7), 0.1, np.float32)
    for k in range(5):
        p[k, k, k] = 0.6  # corners only
    p[0, 0, 0] = 0.9
    p[5, 0:5, 6] = 0.6  # unseeded: dropped
    p[2:5, 3, 0:3] = 0.6
    p[3, 3, 1] = 0.1
    for name in ("hysteresis", "hysteresis_z", "min_component", "all_3d", "close_1"):
        check(p, SETTINGS[name], (1, 1, 1))
    check(noise((6, 5, 7), 3), SETTINGS["all_3d"], (1, 1, 1))


def test_a_component_across_many_blocks() -> None:
    """A helix through every block of a 2-voxel grid joins only far from its seed."""
    shape = (24, 12, 12)
    p = np.full(shape, 0.1, np.float32)
    z = np.arange(shape[0])
    y = (6 + 4 * np.sin(z / 3)).astype(int)
    x = (6 + 4 * np.cos(z / 3)).astype(int)
    for k in range(shape[0]):
        p[k, y[k] - 1 : y[k] + 1, x[k] - 1 : x[k] + 1] = 0.6
    p[0, y[0] - 1, x[0] - 1] = 0.9
    settings = PostprocessSettings(threshold=0.4, hysteresis_high=0.8, min_component_voxels=50)
    assert binary_mask(p, settings)[1]["foreground_voxels"] >= 50
    for block in ((2, 2, 2), (3, 5, 4)):
        check(p, settings, block)


def test_array_likes_and_the_scratch() -> None:
    """A memmap input and output, and a caller's scratch for the closing."""
    probs = noise((10, 9, 8), 5)
    settings = SETTINGS["all_3d"]
    expected = binary_mask(probs, settings)[0]
    out = np.zeros(probs.shape, np.uint8)
    scratch = np.zeros(probs.shape, np.uint8)
    blockwise_mask(probs, out, settings, block=(4, 4, 4), scratch=scratch)
    assert np.array_equal(out, expected)
    assert scratch.any()  # it held the mask before the closing


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            PostprocessSettings(plug_holes_max_area=64),
            "plug_holes_max_area=64 works per whole slice along z, y and x (a hole is a 2D "
            "component of a whole plane): not available blockwise",
        ),
        (
            PostprocessSettings(patch_holes_max_area=1024, closing_radius=1),
            "patch_holes_max_area=1024 works per whole slice along z, y and x (a hole is a 2D "
            "component of a whole plane): not available blockwise",
        ),
    ],
)
def test_refused_steps(settings: PostprocessSettings, message: str) -> None:
    out = np.zeros((4, 4, 4), np.uint8)
    with pytest.raises(CtsegError) as info:
        blockwise_mask(np.zeros((4, 4, 4), np.float32), out, settings, block=(2, 2, 2))
    assert str(info.value) == message and "\n" not in message
    assert not out.any()  # refused before writing anything


def test_bad_blocks() -> None:
    probs, out = np.zeros((4, 4, 4), np.float32), np.zeros((4, 4, 4), np.uint8)
    with pytest.raises(CtsegError, match=r"block=\(0, 2, 2\): expected three integers >= 1"):
        blockwise_mask(probs, out, PostprocessSettings(), block=(0, 2, 2))
    with pytest.raises(CtsegError, match=r"output shape \(4, 4, 3\) != input \(4, 4, 4\)"):
        blockwise_mask(probs, out[..., :3], PostprocessSettings(), block=(2, 2, 2))
