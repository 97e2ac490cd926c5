"""The window maths of sliding-window inference: where the windows go, how they are weighted and
how their sums stay exact. Pure arithmetic (the weight map's device copy and the exact sums are
torch, on the device or the host); `ctseg.inference.blend` and `ctseg.inference.tiled` use it.

Windows
-------
Along each axis the window starts are spread evenly from 0 to ``size - window`` with a step of
at most ``window * (1 - overlap)`` (as nnU-Net), so the actual overlap is never less than the
requested one and the last window ends exactly at the far face. An axis shorter than the window
gets one window at 0 and the input is zero-padded (the value training sees outside a volume
after normalisation, see `ctseg.data`); the padded part of the output is cropped away.

Blending
--------
Each window's probabilities (sigmoid of the logits, so a convex combination stays in [0, 1] and
TTA averages probabilities) are weighted by a Gaussian importance map, sigma = window / 8 per
axis, normalised to a maximum of 1 (as nnU-Net; the scale cancels in the division below), and
summed; the result is sum(w * p) / sum(w). The map is the outer product of three 1D Gaussians
and the window starts form a Cartesian grid, so sum(w) factorises into three 1D sums
(`weight_norms`): the weight volume is never stored. The analytic Gaussian is >= exp(-8) at the
window faces, so the sum is never zero. A model with several output channels (a multi-class
model: background and each class) gives each window the softmax over its channels instead, and
every channel is blended with the same weights, so the blended channels still sum to 1.

Flip TTA averages the probabilities over all 8 combinations of flips of the three axes
(`FLIP_DIMS`, identity included), at 8x the cost. The Gaussian map is symmetric under every
flip, so a flipped output is weighted before it is flipped back.

The sum is exact
----------------
Each (window, flip) adds its weighted probabilities ``p * w / flips`` (float32) as an integer
of `FIXED_POINT_BITS` fractional bits (`to_fixed`: a float32 of at least 2^-27 has no bits
below 2^-50, so it converts exactly; smaller ones lose what lies below). Integer sums do
not depend on their order, so every tiling (the whole volume as one tile, 3D tiles, tiles split
over processes and jobs, a run resumed half way) gives the same sum bit for bit, and
`from_fixed` turns it into the same float16 probabilities: the sum to float64, scaled to
float32, divided by the plane's norm and then by z's, each an IEEE-rounded operation, so a GPU
and a CPU give the same bits. Both are torch functions, one implementation for the device and
the host (a numpy array passes through `torch.from_numpy`). int64 holds 2^(63 - 50) = 8192
units, so up to `MAX_COVERING` windows may cover a voxel (an overlap of 0.9 gives 10^3);
`check_coverage` refuses more.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from ctseg.inference.settings import InferenceSettings, Shape3
from ctseg.io import CtsegError

SIGMA_SCALE = 1 / 8
# All 8 combinations of flips of the spatial dims of a (B, C, Z, Y, X) tensor, identity first.
FLIP_DIMS: tuple[tuple[int, ...], ...] = tuple(
    dims for n in range(4) for dims in itertools.combinations((2, 3, 4), n)
)


# ----------------------------------------------------------------------------- geometry
def window_starts(size: int, window: int, overlap: float) -> list[int]:
    """Window starts along one axis: 0 .. size - window, step <= window * (1 - overlap)."""
    if size <= window:
        return [0]
    target_step = window * (1 - overlap)
    n = math.ceil((size - window) / target_step) + 1
    actual_step = (size - window) / (n - 1)
    return [round(i * actual_step) for i in range(n)]


def padded_shape(shape: Sequence[int], window: Sequence[int]) -> Shape3:
    """The volume zero-padded at the far end of every axis shorter than the window."""
    return tuple(max(int(s), int(w)) for s, w in zip(shape, window, strict=True))  # type: ignore[return-value]


# ----------------------------------------------------------------------------- weights
def gaussian_1d(window: int, sigma_scale: float = SIGMA_SCALE) -> np.ndarray:
    """exp(-d^2 / 2 sigma^2) about the window's centre, sigma = window * sigma_scale, max 1."""
    centre = (window - 1) / 2
    sigma = window * sigma_scale
    d = np.arange(window, dtype=np.float64) - centre
    g = np.exp(-(d**2) / (2 * sigma**2))
    return g / g.max()


def gaussian_importance_map(window: Sequence[int], sigma_scale: float = SIGMA_SCALE) -> np.ndarray:
    """The 3D Gaussian importance map (float32, maximum 1): an outer product of 1D Gaussians."""
    gz, gy, gx = (gaussian_1d(int(w), sigma_scale) for w in window)
    return (gz[:, None, None] * gy[None, :, None] * gx[None, None, :]).astype(np.float32)


@functools.lru_cache(maxsize=8)
def device_importance_map(window: Shape3, device: torch.device) -> torch.Tensor:
    """`gaussian_importance_map` on `device`, built once per window and device: a 72x136x136
    map takes about 13 ms on the host, half of what a GPU needs for a whole 128^3 volume.
    Shared: read it, never write it."""
    with torch.inference_mode(False):  # a plain tensor, usable outside inference mode too
        return torch.from_numpy(gaussian_importance_map(window)).to(device)


def weight_sum_1d(size: int, window: int, starts: Sequence[int]) -> np.ndarray:
    """Sum over the window starts of the 1D Gaussian, on [0, size): one factor of sum(w)."""
    g = gaussian_1d(window)
    total = np.zeros(max(size, window), np.float64)
    for s in starts:
        total[s : s + window] += g
    return total[:size]


def weight_norms(
    shape: Shape3, starts: Sequence[Sequence[int]], window: Shape3
) -> tuple[np.ndarray, np.ndarray]:
    """sum(w) as float32 factors: (Z,) along z and (Y, X) in the plane.

    float32, so the division happens in place and allocates nothing volume-sized; `from_fixed`
    divides by these arrays (or a block's slices of them), first by the plane, then by z.
    """
    norm_z = weight_sum_1d(shape[0], window[0], starts[0]).astype(np.float32)
    norm_yx = np.outer(
        weight_sum_1d(shape[1], window[1], starts[1]),
        weight_sum_1d(shape[2], window[2], starts[2]),
    ).astype(np.float32)
    return norm_z, norm_yx


# ----------------------------------------------------------------------------- exact sums
FIXED_POINT_BITS = 50
FIXED_ONE = float(2**FIXED_POINT_BITS)
MAX_COVERING = 2 ** (62 - FIXED_POINT_BITS)  # windows over one voxel, each summing to <= 1


def to_fixed(weighted: torch.Tensor) -> torch.Tensor:
    """Weighted probabilities (float32, in [0, 1]) as int64 of `FIXED_POINT_BITS` fractional
    bits: scaled by a power of two (exact in float32) and truncated."""
    return (weighted * FIXED_ONE).to(torch.int64)


def from_fixed(total: torch.Tensor, norm_z: np.ndarray, norm_yx: np.ndarray) -> torch.Tensor:
    """float16 probabilities of the exact sums `total` (..., Z, Y, X) of a block, on its
    device, divided by the block's weight norms: `norm_z` (Z,) and `norm_yx` (Y, X), float32
    (`weight_norms`)."""
    value = (total.to(torch.float64) * (1.0 / FIXED_ONE)).to(torch.float32)
    value /= torch.from_numpy(norm_yx).to(value.device)
    value /= torch.from_numpy(norm_z).to(value.device)[:, None, None]
    return value.half()


def max_covering(starts: Sequence[int], window: int) -> int:
    """The most windows of one axis that cover a single position."""
    ends = sorted(s + window for s in starts)
    covering, j = 0, 0
    for i, s in enumerate(sorted(starts)):
        while ends[j] <= s:
            j += 1
        covering = max(covering, i + 1 - j)
    return covering


def check_coverage(starts: Sequence[Sequence[int]], window: Shape3, overlap: float) -> None:
    """Refuse an overlap under which more windows cover a voxel than the exact sum holds."""
    covering = math.prod(max_covering(s, w) for s, w in zip(starts, window, strict=True))
    if covering > MAX_COVERING:
        raise CtsegError(
            f"overlap={overlap}: up to {covering} windows cover one voxel, more than the "
            f"{MAX_COVERING} the exact blend sums in 64 bits; choose an overlap of at most 0.9"
        )


def empty_windows(
    raw: np.ndarray, corners: Sequence[Sequence[int]], window: Shape3, settings: InferenceSettings
) -> list[bool]:
    """Which windows at `corners` (in `raw`'s coordinates; a window may overhang `raw`, where
    the input is padding) hold only raw values at or below ``settings.background``: they are
    not run, and add nothing (their probabilities count as 0 in the blend, their weights still
    count). None of them when the background is None."""
    if settings.background is None:
        return [False] * len(corners)
    level = settings.background
    wz, wy, wx = window
    return [
        not bool((raw[z : z + wz, y : y + wy, x : x + wx] > level).any()) for z, y, x in corners
    ]
