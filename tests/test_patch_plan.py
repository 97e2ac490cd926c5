"""ctseg.network.patch_plan: a training patch whose physical aspect follows the voxel spacing,
nnU-Net v2 style, within a voxel budget and in multiples of the network's downsampling."""

from __future__ import annotations

import math

import pytest

from ctseg.network.patch_plan import plan_patch

CUBE = (320, 320, 320)


@pytest.mark.parametrize("budget", [96**3, 128**3, 160**3, 192**3])
def test_twice_as_coarse_in_z_gives_half_the_depth(budget):
    z, y, x = plan_patch((2.0, 1.0, 1.0), CUBE, budget)
    # A physical cube: z voxels cover twice the length, so about half as many of them.
    assert 0.4 <= z / y <= 0.6 and 0.4 <= z / x <= 0.6
    assert abs(2 * z - y) <= 2 * 16 and abs(2 * z - x) <= 2 * 16  # within the multiples


def test_isotropic_cubic_images_give_a_near_cubic_patch():
    assert plan_patch((1, 1, 1), CUBE, 128**3) == (128, 128, 128)
    patch = plan_patch((1, 1, 1), CUBE, 2_000_000)
    assert max(patch) - min(patch) <= 16 and math.prod(patch) <= 2_000_000
    # The seeds' 72x136x136 budget (1.33 M voxels) becomes a cube-like patch.
    patch = plan_patch((1, 1, 1), CUBE, 72 * 136 * 136)
    assert max(patch) - min(patch) <= 16


@pytest.mark.parametrize(
    ("spacing", "shape", "budget", "multiple"),
    [
        ((2.0, 1.0, 1.0), CUBE, 160**3, 16),
        ((3.0, 0.8, 0.8), (100, 512, 512), 160**3, 16),
        ((1.0, 1.0, 1.0), CUBE, 1_000_003, 32),
        ((0.5, 1.0, 2.0), (256, 256, 256), 96**3, 8),
        ((1.0, 1.0, 1.0), (40, 50, 300), 128**3, 16),
    ],
)
@pytest.mark.parametrize("shrink", ["physical", "median"])
def test_budget_and_multiples_hold(spacing, shape, budget, multiple, shrink):
    patch = plan_patch(spacing, shape, budget, multiple, shrink=shrink)
    assert math.prod(patch) <= budget
    assert all(p % multiple == 0 and p >= multiple for p in patch)
    # Never more than the median shape padded up to the multiple.
    assert all(p < n + multiple for p, n in zip(patch, shape, strict=True))


def test_small_images_clip_and_leave_the_budget_to_the_other_axes():
    # z and y are clipped to the images (padded to multiples); x takes the budget left over,
    # up to its own median size.
    assert plan_patch((1, 1, 1), (40, 50, 300), 128**3) == (48, 64, 304)
    assert plan_patch((1, 1, 1), (40, 50, 300), 128**3, multiple=1) == (40, 50, 300)
    assert plan_patch((1, 1, 1), (10, 10, 10), 64**3) == (16, 16, 16)
    # A budget larger than the images: the images themselves.
    assert plan_patch((2, 1, 1), CUBE, 10**9) == CUBE


def test_anisotropic_clinical_scan():
    # 3 mm slices of 0.8 mm pixels, about 100 x 512 x 512: the physical cube in voxels.
    z, y, x = plan_patch((3.0, 0.8, 0.8), (100, 512, 512), 160**3)
    assert abs(3.0 * z - 0.8 * y) <= 3.0 * 16 and abs(3.0 * z - 0.8 * x) <= 3.0 * 16


def test_nnunet_median_rule_keeps_the_median_aspect():
    """nnU-Net v2's loop shrinks the axis largest relative to the median shape: on a
    voxel-cubic image with [2, 1, 1] voxels and a tight budget it drifts towards a voxel cube,
    where the physical rule keeps z about half of y and x."""
    physical = plan_patch((2.0, 1.0, 1.0), CUBE, 128**3)
    median = plan_patch((2.0, 1.0, 1.0), CUBE, 128**3, shrink="median")
    assert physical == (80, 160, 160)
    assert median == (96, 144, 144)


@pytest.mark.parametrize(
    ("args", "word"),
    [
        (((0, 1, 1), CUBE, 128**3), "spacing"),
        (((1, 1), CUBE, 128**3), "spacing"),
        (((1, 1, float("nan")), CUBE, 128**3), "spacing"),
        (((1, 1, 1), (0, 5, 5), 128**3), "median_shape"),
        (((1, 1, 1), CUBE, 15**3), "voxels"),
    ],
)
def test_invalid_arguments(args, word):
    with pytest.raises(ValueError, match=word):
        plan_patch(*args)
    with pytest.raises(ValueError, match="shrink"):
        plan_patch((1, 1, 1), CUBE, 128**3, shrink="largest")  # type: ignore[arg-type]
