"""The blockwise mask (ctseg.postprocess.blockwise) is `binary_mask`'s, bit for bit, with its
counts: on noise and on structures that only join across block faces, edges and corners or in a
far block, holes and patch rings cut by block borders, for block shapes that divide the volume,
that do not, one voxel thin, and one block larger than the volume, with every step alone and
together; `post_block` picks blocks that fit the budget and refuses in one line when one chunk
does not."""

from __future__ import annotations

import math
from pathlib import Path

import cc3d
import numpy as np
import pytest
from scipy import ndimage

from ctseg.io import CtsegError
from ctseg.postprocess import blockwise
from ctseg.postprocess.blockwise import blockwise_mask, patch_halo, plug_halo, post_block
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
    "plug": PostprocessSettings(threshold=0.5, plug_holes_max_area=6),
    "patch": PostprocessSettings(threshold=0.5, patch_holes_max_area=16),
    "plug_patch_close": PostprocessSettings(
        threshold=0.5, plug_holes_max_area=3, patch_holes_max_area=24, closing_radius=1
    ),
    "everything": PostprocessSettings(
        threshold=0.4,
        hysteresis_high=0.8,
        min_component_voxels=12,
        fill_holes=True,
        plug_holes_max_area=4,
        patch_holes_max_area=30,
        closing_radius=2,
    ),
}
# The settings with a step that reads the mask with an in-plane halo: fewer blocks, for time.
HALO_SETTINGS = ("plug", "patch", "plug_patch_close", "everything")
HALO_BLOCKS = [(4, 4, 4), (5, 7, 3), (18, 1, 13), (6, 6, 20)]


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


def check(
    probs: np.ndarray,
    settings: PostprocessSettings,
    block: tuple[int, ...],
    ranges: tuple[int, ...] = (1, 3),
) -> None:
    """The blockwise mask and counts are `binary_mask`'s, with its jobs over each number of
    z-ranges."""
    expected, expected_counts = binary_mask(probs, settings)
    for n in ranges:
        out = np.full(probs.shape, 7, np.uint8)  # every voxel must be written
        counts = blockwise_mask(probs, out, settings, block=block, ranges=n)
        where = (settings.label(), block, n)
        assert np.array_equal(out, expected), (*where, int((out != expected).sum()))
        assert counts == expected_counts, where


@pytest.mark.parametrize("name", SETTINGS)
def test_identical_to_the_whole_volume(name: str) -> None:
    settings = SETTINGS[name]
    for probs in (noise(SHAPE, 0), structures()):
        for k, block in enumerate(HALO_BLOCKS if name in HALO_SETTINGS else BLOCKS):
            check(probs, settings, block, ranges=((1, 3), (2,), (4,))[k % 3])


def test_the_noise_has_holes_to_plug_and_patch() -> None:
    """The halo settings are a real test on the noise: each of their steps changes it."""
    for name in HALO_SETTINGS:
        settings = SETTINGS[name]
        counts = binary_mask(noise(SHAPE, 0), settings)[1]
        if settings.plug_holes_max_area:
            assert counts["plugged_voxels"] > 0, (name, counts)
        if settings.patch_holes_max_area:
            assert counts["patched_voxels"] > 0, (name, counts)


def test_random_volumes_settings_and_blocks() -> None:
    """Random shapes, noise, settings and blocks (one voxel thin, not dividing, whole axes)."""
    rng = np.random.default_rng(11)
    for case in range(6):
        shape = tuple(int(n) for n in rng.integers(5, 14, size=3))
        probs = noise(shape, 100 + case)
        settings = PostprocessSettings(
            threshold=float(rng.choice([0.4, 0.5, 0.6])),
            min_component_voxels=int(rng.choice([0, 6])),
            fill_holes=bool(rng.integers(2)),
            plug_holes_max_area=int(rng.choice([0, 2, 5, 9])),
            patch_holes_max_area=int(rng.choice([0, 12, 40])),
            closing_radius=int(rng.choice([0, 1, 2])),
        )
        block = tuple(int(rng.choice([1, int(rng.integers(2, 7)), n])) for n in shape)
        check(probs, settings, block, ranges=(int(rng.integers(1, 5)),))


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
        # One range per layer of blocks: the helix crosses every range's planes; more ranges
        # than layers: some ranges hold no block.
        check(p, settings, block, ranges=(1, 2, 5, 24 // block[0], 30))


def test_array_likes_and_the_scratch_folder(tmp_path: Path) -> None:
    """A memmap input and output, and a caller's scratch folder: made, and left empty (each
    intermediate mask removed once read)."""
    probs = np.lib.format.open_memmap(
        tmp_path / "probs.npy", mode="w+", dtype=np.float32, shape=(10, 9, 8)
    )
    probs[:] = noise((10, 9, 8), 5)
    out = np.lib.format.open_memmap(
        tmp_path / "out.npy", mode="w+", dtype=np.uint8, shape=(10, 9, 8)
    )
    settings = SETTINGS["everything"]
    scratch = tmp_path / "work" / "scratch"
    blockwise_mask(probs, out, settings, block=(4, 4, 4), scratch_dir=scratch)
    assert np.array_equal(out, binary_mask(np.asarray(probs), settings)[0])
    assert scratch.is_dir() and not any(scratch.iterdir())


def sheet_with_holes(shape: tuple[int, int, int]) -> np.ndarray:
    """A confident sheet filling the z-slice z = 1 (the slices across y and x see a line):
    - a 3 x 3 hole (9 pixels), a 2 x 6 one (12) and a 4 x 4 one (16), cut by block borders;
    - a hole open to the volume's face (x = 0), never enclosed;
    - two 2 x 2 holes three pixels apart, whose patch rings overlap: the right one has the larger
      label, so the pixels between them count for it; beside the left one, five background pixels
      of slits from the face (x = 0), large and open, so not holes. Alone, the left hole's ring
      is 55 / 60 mask and it is patched; beside the right one it keeps 31 / 36 and stays open."""
    p = np.full(shape, 0.1, np.float32)
    p[1] = 0.9
    p[1, 2:5, 13:16] = 0.1
    p[1, 14:16, 12:18] = 0.1
    p[1, 13:17, 20:24] = 0.1
    p[1, 17:19, 0:3] = 0.1
    p[1, 8:10, 4:6] = 0.1  # the left patch hole
    p[1, 8:10, 9:11] = 0.1  # the right one
    p[1, 6, 0:3] = p[1, 10, 0:3] = p[1, 12, 0:2] = 0.1  # the slits
    return p


def test_holes_cut_by_block_borders() -> None:
    p = sheet_with_holes((3, 20, 26))
    plug = PostprocessSettings(threshold=0.5, plug_holes_max_area=12)
    mask, counts = binary_mask(p, plug)
    assert mask[1, 3, 14] and mask[1, 15, 15]  # 9 and 12 pixels: plugged
    assert not mask[1, 14, 21] and not mask[1, 18, 1]  # 16 pixels; open to the face
    assert counts["plugged_voxels"] == 9 + 12 + 4 + 4
    for settings in (
        plug,
        PostprocessSettings(threshold=0.5, patch_holes_max_area=16),
        PostprocessSettings(
            threshold=0.5, plug_holes_max_area=9, patch_holes_max_area=16, closing_radius=1
        ),
    ):
        for block in ((3, 4, 14), (1, 6, 7), (3, 20, 1), (2, 5, 4)):
            check(p, settings, block)


def test_patch_rings_overlapping_across_a_block_border() -> None:
    p = sheet_with_holes((3, 20, 26))
    settings = PostprocessSettings(threshold=0.5, patch_holes_max_area=4)
    mask = binary_mask(p, settings)[0]
    assert mask[1, 8, 9] and not mask[1, 8, 4]  # the right hole patched, the left one not
    alone = p.copy()
    alone[1, 8:10, 9:11] = 0.9
    assert binary_mask(alone, settings)[0][1, 8, 4]  # without the right one, the left is patched
    # Borders between the two holes (x = 7, 8), through them, one voxel thin across each axis.
    for block in ((3, 20, 7), (3, 20, 8), (1, 9, 10), (3, 9, 5), (3, 1, 26), (2, 20, 1)):
        check(p, settings, block)


def tight_halos() -> np.ndarray:
    """The worst cases of the halos, for a block ending at x = 8, in a sheet filling z = 1:
    - row 14: a line hole of 4 pixels from x = 7, the block's last column, to x = 10, A - 1 past
      it (A = 4);
    - row 6: a line hole H of 4 pixels from x = 7 to 10 and a thief of 4 from x = 16 to 19,
      2P + 2R - 2 past the block (P = 4, R = 3): the thief has the larger label, and the ring
      pixels at x = 13, within R of both, count for it. Three slits from the face y = 0 put six
      background pixels in H's ring: alone, 60 / 66 of it is mask and H is patched; robbed of the
      seven pixels at x = 13, 53 / 59 is, and H stays open."""
    p = np.full((3, 18, 24), 0.1, np.float32)
    p[1] = 0.9
    p[1, 14, 7:11] = 0.1
    p[1, 6, 7:11] = 0.1
    p[1, 6, 16:20] = 0.1
    p[1, 0:5, [5, 7, 9]] = 0.1
    return p


def check_one_voxel_less_of_halo_is_wrong(
    settings: PostprocessSettings,
    halo: str,
    pixel: tuple[int, int, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tight_halos` blockwise is exact with the halo `halo` names, wrong at `pixel` with one
    voxel less: the bound is the least that works."""
    p, block = tight_halos(), (3, 18, 8)
    expected = binary_mask(p, settings)[0]
    check(p, settings, block)
    exact = getattr(blockwise, halo)
    monkeypatch.setattr(blockwise, halo, lambda area: exact(area) - 1)
    out = np.zeros(p.shape, np.uint8)
    blockwise_mask(p, out, settings, block=block)
    assert out[pixel] != expected[pixel]


def test_the_plug_halo_is_tight(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = PostprocessSettings(threshold=0.5, plug_holes_max_area=4)
    assert binary_mask(tight_halos(), settings)[0][1, 14, 7]  # plugged
    check_one_voxel_less_of_halo_is_wrong(settings, "plug_halo", (1, 14, 7), monkeypatch)


def test_the_patch_halo_is_tight(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = PostprocessSettings(threshold=0.5, patch_holes_max_area=4)
    p = tight_halos()
    assert not binary_mask(p, settings)[0][1, 6, 7]  # robbed by the thief: open
    p[1, 6, 16:20] = 0.9
    assert binary_mask(p, settings)[0][1, 6, 7]  # without the thief: patched
    check_one_voxel_less_of_halo_is_wrong(settings, "patch_halo", (1, 6, 7), monkeypatch)


def test_labels_keep_their_order_in_a_crop() -> None:
    """What the patching's halo relies on: cc3d numbers the components of a crop of a slice in
    the same relative order as those of the whole slice, for the components lying whole in the
    crop away from its sides."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        plane = ndimage.gaussian_filter(rng.random((40, 36)), 1.0) > 0.5
        full = cc3d.connected_components(plane, connectivity=4)
        y0, x0 = rng.integers(0, 15, size=2)
        y1, x1 = y0 + rng.integers(10, 25), x0 + rng.integers(10, 21)
        crop = cc3d.connected_components(np.ascontiguousarray(plane[y0:y1, x0:x1]), connectivity=4)
        edge = np.unique(np.concatenate([crop[0], crop[-1], crop[:, 0], crop[:, -1]]))
        inner = [c for c in np.unique(crop) if c and c not in edge]
        whole = [int(full[y0:y1, x0:x1][crop == c][0]) for c in inner]
        assert whole == sorted(whole)


def test_halos() -> None:
    assert plug_halo(64) == 64 and plug_halo(0) == 0
    assert patch_halo(1024) == 2 * 1024 + 2 * 3 - 1 and patch_halo(0) == 0


def test_post_block_fits_the_budget_in_whole_chunks() -> None:
    shape, chunks = (500, 700, 900), (64, 64, 64)
    for settings in (
        PostprocessSettings(),
        PostprocessSettings(plug_holes_max_area=64, closing_radius=2),
        PostprocessSettings(patch_holes_max_area=256),
    ):
        small = post_block(chunks, shape, settings, 2**30)
        large = post_block(chunks, shape, settings, 16 * 2**30)
        for block in (small, large):
            assert all(b % c == 0 or b == n for b, c, n in zip(block, chunks, shape, strict=True))
        assert math.prod(large) > math.prod(small) >= math.prod(chunks)
    # A chunk larger than the volume: the block is the chunk, whatever the halo.
    assert post_block((64, 64, 64), (10, 20, 30), SETTINGS["everything"], 2**20) == (64, 64, 64)


def test_post_block_refuses_in_one_line_when_one_chunk_does_not_fit() -> None:
    settings = PostprocessSettings(patch_holes_max_area=1024, closing_radius=1)
    with pytest.raises(CtsegError) as info:
        post_block((128, 128, 128), (2000, 8000, 8000), settings, 512 * 2**20)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("post-processing t>0.5 patch 1024 close 1 needs ")
    assert "one chunk (128, 128, 128) read with a halo of 2053 voxels (patch 1024)" in message
    assert "more than 25% of --memory-budget-mb 512" in message
    at_least = float(message.rsplit(" ", 1)[1])
    assert at_least > 512
    post_block((128, 128, 128), (2000, 8000, 8000), settings, int(at_least * 2**20))  # it fits


def test_bad_blocks() -> None:
    probs, out = np.zeros((4, 4, 4), np.float32), np.zeros((4, 4, 4), np.uint8)
    with pytest.raises(CtsegError, match=r"block=\(0, 2, 2\): expected three integers >= 1"):
        blockwise_mask(probs, out, PostprocessSettings(), block=(0, 2, 2))
    with pytest.raises(CtsegError, match=r"output shape \(4, 4, 3\) != input \(4, 4, 4\)"):
        blockwise_mask(probs, out[..., :3], PostprocessSettings(), block=(2, 2, 2))


def run_as_jobs(probs, out, settings, block, folder, ranges, order=reversed) -> dict[str, int]:
    """Every job of `BlockwiseJobs` in a fresh object of its own (as separate processes see
    the folder), the ranges of each round in `order`."""
    plan = blockwise.BlockwiseJobs(probs, out, settings, block, folder, ranges)
    for name, kind in plan.rounds:
        for k in order(range(ranges)):
            blockwise.BlockwiseJobs(probs, out, settings, block, folder, ranges).run_range(name, k)
        if kind == blockwise.COMPONENTS:
            blockwise.BlockwiseJobs(probs, out, settings, block, folder, ranges).merge(name)
    return plan.counts()


def test_jobs_in_separate_processes_any_order_and_resumed(tmp_path: Path, monkeypatch) -> None:
    """Jobs over 4 z-ranges, each with its own state and in reverse order, give the mask; a
    job killed part way (its result not written), a range job or a merge, runs again to the
    same bits; a job run twice does nothing the second time."""
    probs, settings, block = structures(), SETTINGS["everything"], (4, 5, 6)
    expected, expected_counts = binary_mask(probs, settings)
    out = np.zeros(SHAPE, np.uint8)
    assert run_as_jobs(probs, out, settings, block, tmp_path / "a", 4) == expected_counts
    assert np.array_equal(out, expected)

    # Killed: the fill round's first range stops after one block, its faces half written.
    folder, out = tmp_path / "b", np.zeros(SHAPE, np.uint8)
    calls = {"n": 0}
    real = blockwise._border

    def dies(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(blockwise, "_border", dies)
    plan = blockwise.BlockwiseJobs(probs, out, settings, block, folder, 4)
    with pytest.raises(KeyboardInterrupt):
        plan.run()
    assert not plan.done("fill", 0) and not (folder / "fill" / "merge.npz").exists()
    monkeypatch.setattr(blockwise, "_border", real)
    plan = blockwise.BlockwiseJobs(probs, out, settings, block, folder, 4)
    plan.run()
    assert np.array_equal(out, expected) and plan.counts() == expected_counts
    stamps = {p: p.stat().st_mtime_ns for p in folder.rglob("range-*")}
    plan.run()  # every job is done: nothing is written again
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("range-*")} == stamps

    # Killed: a merge, in its union-find; it leaves no result, and its rerun gives the mask.
    folder, out = tmp_path / "c", np.zeros(SHAPE, np.uint8)
    real_merged = blockwise._merged

    def dies_in_the_merge(nodes, pairs):
        if len(pairs):
            raise KeyboardInterrupt
        return real_merged(nodes, pairs)

    plan = blockwise.BlockwiseJobs(probs, out, settings, block, folder, 4)
    for k in range(4):
        plan.run_range("binarise", k)
    monkeypatch.setattr(blockwise, "_merged", dies_in_the_merge)
    with pytest.raises(KeyboardInterrupt):
        plan.merge("binarise")
    assert not plan.done("binarise")
    monkeypatch.setattr(blockwise, "_merged", real_merged)
    blockwise.BlockwiseJobs(probs, out, settings, block, folder, 4).run()
    assert np.array_equal(out, expected)


def test_jobs_refuse_out_of_order_and_another_plan(tmp_path: Path) -> None:
    probs, settings = structures(), SETTINGS["all_3d"]
    out = np.zeros(SHAPE, np.uint8)
    plan = blockwise.BlockwiseJobs(probs, out, settings, (4, 4, 4), tmp_path, 3)
    assert [name for name, _ in plan.rounds] == ["binarise", "fill", "filled", "closed"]
    with pytest.raises(CtsegError, match="'binarise' is not merged yet") as info:
        plan.run_range("fill", 0)
    assert "\n" not in str(info.value)
    plan.run_range("binarise", 0)
    with pytest.raises(CtsegError, match=r"ranges \[1, 2\] are not done"):
        plan.merge("binarise")
    with pytest.raises(CtsegError, match="range 3: expected 0 <= range < 3"):
        plan.run_range("binarise", 3)
    # A halo round reads the round before across ranges: every range of it must be written.
    for name in ("binarise", "fill"):
        for k in range(3):
            plan.run_range(name, k)
        plan.merge(name)
    plan.run_range("filled", 0)
    with pytest.raises(CtsegError, match=r"round 'filled' has ranges \[1, 2\] not done"):
        plan.run_range("closed", 0)
    with pytest.raises(CtsegError, match="holds the post-processing of another plan"):
        blockwise.BlockwiseJobs(probs, out, settings, (4, 4, 4), tmp_path, 2)


def _make_jobs(folder: Path, start) -> None:
    start.wait()
    blockwise.BlockwiseJobs(structures(), np.zeros(SHAPE, np.uint8), SETTINGS["fill"],
                            (4, 4, 4), folder, 3)  # fmt: skip


def test_jobs_started_at_once_share_the_folder(tmp_path: Path, monkeypatch) -> None:
    """Eight processes open the jobs of one folder at the same moment (a round's range jobs
    on a cluster), on a slow disk (each file written takes 50 ms more): each finds the plan
    whole, none fails."""
    import multiprocessing
    import time

    write_text = Path.write_text

    def slowly(self, *args, **kwargs):
        written = write_text(self, *args, **kwargs)
        time.sleep(0.05)
        return written

    monkeypatch.setattr(Path, "write_text", slowly)  # the forked processes inherit it
    context = multiprocessing.get_context("fork")
    for attempt in range(4):
        start = context.Barrier(8)
        folder = tmp_path / str(attempt)
        processes = [context.Process(target=_make_jobs, args=(folder, start)) for _ in range(8)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(60)
        assert [process.exitcode for process in processes] == [0] * 8
        assert sorted(p.name for p in folder.iterdir()) == ["plan.json"]
