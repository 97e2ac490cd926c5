"""A training patch shaped for the voxel spacing, in the manner of nnU-Net v2's experiment planner
(issue 32).

`plan_patch(spacing, median_shape, voxels, multiple)`:

1. **A physical cube.** Start from the patch of `voxels` voxels whose physical extent is the
   same along every axis: size_i ∝ 1 / spacing_i, scaled so that the product is `voxels`
   (nnU-Net starts the same way, from 256³ voxels' worth).
2. **Clipped to the images.** Each axis is at most the median image shape (`median_shape`, in
   voxels), as nnU-Net clips it: a patch larger than the typical image only pads. The budget a
   clipped axis leaves goes to the others, still in physical proportion (so a thin image gets
   a wide patch; nnU-Net gets the same effect by starting from a cube larger than its budget).
3. **Multiples.** Each axis is rounded, then padded up to a multiple of `multiple`, the
   network's downsampling factor: the size `ctseg.network.sizes.computed_patch` would compute
   it at anyway, so the planned patch is one the network computes without padding. (A median
   shape that is not a multiple is padded up by less than `multiple`.)
4. **The budget.** While the patch holds more than `voxels` voxels, one axis loses `multiple`:
   by default (`shrink="physical"`) the axis whose physical extent (size x spacing) is the
   largest, which keeps the patch as close to a physical cube as the multiples allow. nnU-Net
   v2's own loop (`ExperimentPlanner.get_plans_for_configuration`) shrinks instead the axis
   whose size is the largest fraction of the median shape; `shrink="median"` does that. The
   two agree while the clipped start is a physical cube and the median image is one too; with
   a tight budget on anisotropic voxels of a voxel-cubic image (a 320³ scan at [2, 1, 1])
   nnU-Net's rule drifts towards a voxel cube, the physical rule keeps z about half of y and x.
   Ties go to the last axis (x), as `np.argsort(...)[-1]` picks in nnU-Net.

The result is the first patch the rule reaches within the budget, never below `multiple` per
axis. nnU-Net's budget is a VRAM estimate of its network; here it is a voxel count, which the
caller derives from its own memory estimate (ctseg.network.estimate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Shrink = Literal["physical", "median"]


def _multiple_up(size: float, multiple: int) -> int:
    return max(multiple, -(-int(size) // multiple) * multiple)


def _check(spacing: Sequence[float], median_shape: Sequence[int], voxels: int, multiple: int):
    spacing = tuple(float(s) for s in spacing)
    if len(spacing) != 3 or not all(math.isfinite(s) and s > 0 for s in spacing):
        raise ValueError(f"spacing {spacing!r}: expected three finite positive numbers")
    shape = tuple(int(n) for n in median_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"median_shape {tuple(median_shape)!r}: expected three sizes >= 1")
    if int(multiple) < 1:
        raise ValueError(f"multiple {multiple!r}: expected an integer >= 1")
    if int(voxels) < int(multiple) ** 3:
        raise ValueError(f"voxels {voxels!r}: the budget must hold at least one {multiple}^3 patch")
    return spacing, shape


def plan_patch(
    spacing: Sequence[float],
    median_shape: Sequence[int],
    voxels: int,
    multiple: int = 16,
    *,
    shrink: Shrink = "physical",
) -> tuple[int, int, int]:
    """The patch [z, y, x] for voxels of `spacing` [z, y, x] and images of `median_shape`:
    a physical cube clipped to the median shape, each axis a multiple of `multiple`, at most
    `voxels` voxels in all (the module docstring has the steps and nnU-Net's variant)."""
    spacing, shape = _check(spacing, median_shape, voxels, multiple)
    if shrink not in ("physical", "median"):
        raise ValueError(f"shrink={shrink!r}: expected 'physical' or 'median'")
    inverse = [1.0 / s for s in spacing]
    start: list[float | None] = [None, None, None]  # None: not clipped yet
    while True:
        free = [a for a in range(3) if start[a] is None]
        if not free:
            break
        left = voxels / math.prod(start[a] for a in range(3) if start[a] is not None)
        scale = (left / math.prod(inverse[a] for a in free)) ** (1.0 / len(free))
        over = [a for a in free if inverse[a] * scale >= shape[a]]
        if not over:
            for a in free:
                start[a] = inverse[a] * scale
            break
        for a in over:
            start[a] = float(shape[a])
    patch = [
        _multiple_up(min(round(size), n), multiple) for size, n in zip(start, shape, strict=True)
    ]
    while math.prod(patch) > voxels:
        if shrink == "physical":
            keys = [p * s for p, s in zip(patch, spacing, strict=True)]
        else:
            keys = [p / n for p, n in zip(patch, shape, strict=True)]
        # The largest key among the axes that can still shrink; ties to the last axis.
        candidates = [a for a in range(3) if patch[a] > multiple]
        axis = max(candidates, key=lambda a: (keys[a], a))
        patch[axis] -= multiple
    return (patch[0], patch[1], patch[2])
