"""Sliding-window inference over a Zarr image store, streamed in z-slabs, then a binary mask.

`infer_volume` writes the foreground probability of every voxel to a float16 Zarr store;
`postprocess` turns that into the uint8 (0/1) multi-page TIFF of the Kaggle submission layout;
`infer_records` does both for a list of image stores with the weights `ctseg.training.train` wrote.

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
and the window starts form a Cartesian grid, so sum(w) factorises into three 1D sums:
the weight volume is never stored. The analytic Gaussian is >= exp(-8) at the window faces, so
the sum is never zero.

Flip TTA (``tta_flips``) averages the probabilities over all 8 combinations of flips of the
three axes (identity included), at 8x the cost.

Resident or streamed
--------------------
A volume whose working set fits ``device_budget_mb`` (default: ``memory_budget_mb``; on a CPU
run the device is host memory) is *resident*: it is read and normalised once, copied to the
device once, and every window crop, forward, flip, Gaussian weighting and accumulation happens
there; the divided result comes back as float16 and is written in one go. Nothing returns to
the host per window, so a GPU never waits on a copy or on numpy. The working set
(`resident_bytes`) is the float32 input and accumulator of the padded volume (8 bytes a voxel),
the raw volume and the float16 result (on the device and the host), and one batch of windows;
a real 320^3 uint8 volume needs about 0.4 GB. Larger volumes are streamed (below). Both paths
read with the same function, run the same windows in the same order, and divide by the same
factorised weights, so they agree to float32 rounding before the float16 store (bit for bit on
the test's pointwise model).

Batches are made of (window, flip) pairs: with ``tta_flips`` the 8 flipped copies of a window
share forwards with other windows, so every forward but the last is ``batch_size`` inputs. The
Gaussian map is symmetric under every flip, so a flipped output is weighted before it is flipped
back.

Streaming
---------
Windows are processed row by row in z (a row = every window with the same z start). After a
group of rows (a *slab*) the output below the next row's z start is final, since no later
window reaches back there; it is divided by the weights and written to the probability store,
in whole z-chunks of the store when the chunk is no deeper than the window (so no chunk is
written twice), and the accumulator keeps only the remainder. The number of rows per slab comes
from ``memory_budget_mb``: memory is O(slab depth x Y x X) plus the window batch, never the
whole volume. At least one row is always taken; if even that exceeds the budget, the result
reports ``budget_exceeded`` (the plane, Y x X, is not tiled: volumes are streamed along z only).

Speed
-----
``batch_size`` windows go through the model per call, under ``torch.inference_mode``; ``amp``
(default: on CUDA only) runs the forward under bf16 autocast while the blending stays float32.
On a CPU the gain over one window at a time comes from batching (PyTorch sends every
convolution of a batch of two or more to oneDNN) and from keeping freed activation buffers in
the heap (`ctseg.data.tune_malloc`); bench/infer.py measures both.

Memory of `postprocess`: a plain threshold is applied slab by slab and the mask streamed page
by page into the TIFF. Hysteresis, ``min_component_voxels`` (cc3d, 26-connectivity) and
``fill_holes`` need the whole volume (`ctseg.postprocess.masks`): then this step holds the float16
probabilities, a uint8 mask and cc3d's 4-byte labels (about 8 bytes a voxel, plus scipy's
temporaries of the mask's size for hole filling).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
import torch
import zarr
from tqdm import tqdm

from ctseg.data.heap import tune_malloc
from ctseg.io import CtsegError, atomic_path, check_id
from ctseg.network.model import build_model
from ctseg.postprocess.masks import PostprocessSettings, binary_mask
from ctseg.store import create_volume, open_volume
from ctseg.training.distributed import pick_device

Shape3 = tuple[int, int, int]
SIGMA_SCALE = 1 / 8
# All 8 combinations of flips of the spatial dims of a (B, C, Z, Y, X) tensor, identity first.
FLIP_DIMS: tuple[tuple[int, ...], ...] = tuple(
    dims for n in range(4) for dims in itertools.combinations((2, 3, 4), n)
)
WEIGHT_KEYS = ("model", "model_config", "patch_size")


# ----------------------------------------------------------------------------- geometry
def window_starts(size: int, window: int, overlap: float) -> list[int]:
    """Window starts along one axis: 0 .. size - window, step <= window * (1 - overlap)."""
    if size <= window:
        return [0]
    target_step = window * (1 - overlap)
    n = math.ceil((size - window) / target_step) + 1
    actual_step = (size - window) / (n - 1)
    return [round(i * actual_step) for i in range(n)]


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


@dataclass(frozen=True)
class Slab:
    rows: tuple[int, ...]  # z starts of the window rows processed together
    z0: int  # input read [z0, z1)
    z1: int
    flush_to: int  # output below this z is final once the slab is done


def plan_slabs(
    depth: int,
    window_z: int,
    z_starts: Sequence[int],
    chunk_z: int,
    plane_bytes_acc: int,
    plane_bytes_in: int,
    budget_bytes: float,
) -> list[Slab]:
    """Group window rows into slabs that fit the budget (at least one row each).

    The accumulator of a slab spans [last flush, slab end); its input spans [first row, slab
    end). Flushes stop at a chunk boundary of the output (when chunks are no deeper than the
    window), so every output chunk is encoded once.
    """
    align = chunk_z if chunk_z <= window_z else 1
    slabs: list[Slab] = []
    acc_z0, i, n = 0, 0, len(z_starts)
    while i < n:
        j = i
        while j + 1 < n:
            end = min(z_starts[j + 1] + window_z, depth)
            cost = (end - acc_z0) * plane_bytes_acc + (end - z_starts[i]) * plane_bytes_in
            if cost > budget_bytes:
                break
            j += 1
        flush_to = depth if j == n - 1 else (z_starts[j + 1] // align) * align
        slabs.append(
            Slab(
                tuple(z_starts[i : j + 1]),
                z_starts[i],
                min(z_starts[j] + window_z, depth),
                flush_to,
            )
        )
        acc_z0 = max(acc_z0, flush_to)
        i = j + 1
    return slabs


# ----------------------------------------------------------------------------- inputs
def _open_array(path: Path, what: str) -> zarr.Array:
    if not path.exists():
        raise CtsegError(f"{path}: {what} not found")
    try:
        arr = open_volume(path)
    except Exception as exc:
        raise CtsegError(f"{path}: cannot open {what} as a Zarr array: {exc}") from exc
    if arr.ndim != 3:
        raise CtsegError(f"{path}: expected a 3D volume, got shape {tuple(arr.shape)}")
    if 0 in arr.shape:
        raise CtsegError(f"{path}: empty volume of shape {tuple(arr.shape)}")
    return arr


def open_image(image_store: Path) -> tuple[zarr.Array, float, float]:
    """The image array and its normalisation range (p0_5, p99_5), checked."""
    image = _open_array(Path(image_store), "image store")
    attrs = dict(image.attrs)
    if "p0_5" not in attrs or "p99_5" not in attrs:
        raise CtsegError(f"{image_store}: image attributes lack the intensity range p0_5/p99_5")
    if not np.issubdtype(image.dtype, np.number) or np.issubdtype(image.dtype, np.complexfloating):
        raise CtsegError(f"{image_store}: unsupported image dtype {image.dtype}")
    return image, float(attrs["p0_5"]), float(attrs["p99_5"])


def normalise(raw: np.ndarray, low: float, high: float) -> np.ndarray:
    """clip((x - p0_5) / (p99_5 - p0_5), 0, 1) in float32, exactly as `ctseg.data.to_device`."""
    low32, high32 = np.float32(low), np.float32(high)
    span = max(high32 - low32, np.float32(1e-6))
    x = raw.astype(np.float32)
    x -= low32
    x /= span
    return np.clip(x, 0.0, 1.0, out=x)


def _read_slab(
    image: zarr.Array, z0: int, z1: int, low: float, high: float, padded: Shape3
) -> np.ndarray:
    """Normalised input [z0, z1), zero-padded at the far end to at least `padded`."""
    x = normalise(np.asarray(image[z0:z1]), low, high)
    target = tuple(max(a, b) for a, b in zip(x.shape, padded, strict=True))
    if target == x.shape:
        return x
    out = np.zeros(target, np.float32)
    out[: x.shape[0], : x.shape[1], : x.shape[2]] = x
    return out


# ----------------------------------------------------------------------------- model
def _check_window(window: Sequence[int]) -> Shape3:
    win = tuple(int(w) for w in window)
    if len(win) != 3 or min(win) < 1:
        raise CtsegError(f"window={tuple(window)!r}: expected three positive sizes")
    return win  # type: ignore[return-value]


def resolve_amp(amp: bool | None, device: torch.device) -> bool:
    """None means bf16 autocast on CUDA only (CPUs without bf16 units get slower, not faster)."""
    return device.type == "cuda" if amp is None else bool(amp)


def _check_output(logits: torch.Tensor, x: torch.Tensor) -> None:
    if logits.shape != x.shape:
        raise CtsegError(
            f"model output of shape {tuple(logits.shape)} for input {tuple(x.shape)}: "
            "expected one channel of the input's size"
        )


def predict_windows(
    model: torch.nn.Module,
    crops: np.ndarray,
    weight: torch.Tensor,
    *,
    tta_flips: bool,
    device: torch.device,
    amp: bool,
) -> np.ndarray:
    """Gaussian-weighted probabilities (B, Z, Y, X) float32 for a batch of windows (B, Z, Y, X)."""
    x = torch.from_numpy(crops)[:, None].to(device)
    flips = FLIP_DIMS if tta_flips else ((),)
    total: torch.Tensor | None = None
    for dims in flips:
        xi = x.flip(dims) if dims else x
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(xi)
        _check_output(logits, xi)
        p = torch.sigmoid(logits.float())
        p = p.flip(dims) if dims else p
        total = p if total is None else total.add_(p)
    assert total is not None
    prob = total[:, 0].div_(len(flips)).mul_(weight)
    return prob.cpu().numpy()


# ----------------------------------------------------------------------------- inference
def weight_norms(
    shape: Shape3, starts: Sequence[Sequence[int]], window: Shape3
) -> tuple[np.ndarray, np.ndarray]:
    """sum(w) as float32 factors: (Z,) along z and (Y, X) in the plane.

    float32, so the division happens in place and allocates nothing volume-sized; both paths
    divide by these same arrays, first by the plane, then by z.
    """
    norm_z = weight_sum_1d(shape[0], window[0], starts[0]).astype(np.float32)
    norm_yx = np.outer(
        weight_sum_1d(shape[1], window[1], starts[1]),
        weight_sum_1d(shape[2], window[2], starts[2]),
    ).astype(np.float32)
    return norm_z, norm_yx


class BlendAccumulator:
    """Weighted probabilities of the z-range [z0, z0 + depth) that is not yet written.

    The weight sum is not accumulated: it is the outer product of three 1D sums (see the
    module docstring), applied when a finished range is flushed.
    """

    def __init__(self, shape: Shape3, starts: Sequence[Sequence[int]], window: Shape3) -> None:
        self.shape = shape
        self.z0 = 0
        self.acc = np.zeros((0, *shape[1:]), np.float32)
        self.peak_bytes = 0
        self.norm_z, self.norm_yx = weight_norms(shape, starts, window)

    def grow_to(self, z1: int) -> None:
        """Extend the held range to end at z1, keeping the unflushed remainder."""
        if self.z0 + self.acc.shape[0] < z1:
            grown = np.zeros((z1 - self.z0, *self.shape[1:]), np.float32)
            grown[: self.acc.shape[0]] = self.acc
            self.acc = grown
        self.peak_bytes = max(self.peak_bytes, self.acc.nbytes)

    def add(self, probs: np.ndarray, positions: Sequence[Shape3]) -> None:
        """Add each weighted window, cropped to the volume (windows may overhang padded axes)."""
        for (z, y, x), p in zip(positions, probs, strict=True):
            corner = (z, y, x)
            dz, dy, dx = (
                min(w, s - o) for w, s, o in zip(p.shape, self.shape, corner, strict=True)
            )
            self.acc[z - self.z0 : z - self.z0 + dz, y : y + dy, x : x + dx] += p[:dz, :dy, :dx]

    def flush(self, z_to: int, out: zarr.Array) -> None:
        """Divide [z0, z_to) by the weights, write it as float16 and drop it."""
        n = z_to - self.z0
        if n <= 0:
            return
        final = self.acc[:n]
        final /= self.norm_yx
        final /= self.norm_z[self.z0 : z_to, None, None]
        out[self.z0 : z_to] = final.astype(np.float16)
        self.acc = self.acc[n:]
        self.z0 = z_to


def _check_settings(
    overlap: float, batch_size: int, memory_budget_mb: float, device_budget_mb: float | None = None
) -> None:
    if not 0 <= overlap < 1:
        raise CtsegError(f"overlap={overlap!r}: expected 0 <= overlap < 1")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise CtsegError(f"batch_size={batch_size!r}: expected a positive integer")
    if not memory_budget_mb > 0:
        raise CtsegError(f"memory_budget_mb={memory_budget_mb!r}: expected a positive number")
    if device_budget_mb is not None and not device_budget_mb >= 0:
        raise CtsegError(f"device_budget_mb={device_budget_mb!r}: expected a number >= 0")


def _plane_bytes(image: zarr.Array, window: Shape3) -> tuple[int, int]:
    """Bytes per z-plane of the accumulator and of the input slab, for the slab plan."""
    plane = image.shape[1] * image.shape[2]
    padded = max(image.shape[1], window[1]) * max(image.shape[2], window[2])
    # accumulator float32 (4) + growth copy (4) + float16 flush copy (2); raw + float32 input.
    return plane * 10, plane * image.dtype.itemsize + padded * 4


def _crops(x: np.ndarray, z0: int, batch: Sequence[Shape3], window: Shape3) -> np.ndarray:
    wz, wy, wx = window
    return np.stack([x[z - z0 : z - z0 + wz, y : y + wy, xx : xx + wx] for z, y, xx in batch])


# ----------------------------------------------------------------------------- resident
def padded_shape(shape: Sequence[int], window: Sequence[int]) -> Shape3:
    """The volume zero-padded at the far end of every axis shorter than the window."""
    return tuple(max(int(s), int(w)) for s, w in zip(shape, window, strict=True))  # type: ignore[return-value]


def resident_bytes(
    shape: Sequence[int], window: Sequence[int], itemsize: int, batch_size: int
) -> int:
    """Working set of the resident path (see the module docstring), model activations excluded
    as in the streaming budget: float32 input and accumulator of the padded volume, the raw
    volume, the float16 result on the device and on the host, and a batch of crops, outputs and
    flipped outputs in float32."""
    return (
        8 * math.prod(padded_shape(shape, window))
        + (itemsize + 4) * math.prod(shape)
        + 12 * batch_size * math.prod(window)
    )


def _flip(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return t.flip(dims) if dims else t


def _blend_resident(
    model: torch.nn.Module,
    image: zarr.Array,
    low: float,
    high: float,
    win: Shape3,
    starts: Sequence[Sequence[int]],
    *,
    batch_size: int,
    tta_flips: bool,
    device: torch.device,
    amp: bool,
    progress: tqdm | None = None,
) -> np.ndarray:
    """Blended probabilities of the whole volume, computed on `device`, as a float16 host array.

    The caller puts the model in eval mode on `device` and holds `torch.inference_mode`.
    """
    shape: Shape3 = tuple(int(s) for s in image.shape)  # type: ignore[assignment]
    padded = padded_shape(shape, win)
    # Read and normalised on the host by the same function as the streamed slabs (identical
    # inputs on both paths), then one copy to the device.
    x = torch.from_numpy(_read_slab(image, 0, shape[0], low, high, padded)).to(device)
    acc = torch.zeros(padded, dtype=torch.float32, device=device)
    flips = FLIP_DIMS if tta_flips else ((),)
    weight = device_importance_map(win, device)
    if len(flips) > 1:
        weight = weight / len(flips)  # the TTA mean folded into the weight (exact: 2^3)
    # (window, flip) pairs in window-major order; FLIP_DIMS index (B, C, Z, Y, X), a crop is
    # (Z, Y, X).
    items = [
        (pos, tuple(d - 2 for d in dims)) for pos in itertools.product(*starts) for dims in flips
    ]
    wz, wy, wx = win
    for k in range(0, len(items), batch_size):
        batch = items[k : k + batch_size]
        crops = torch.stack(
            [_flip(x[z : z + wz, y : y + wy, xx : xx + wx], dims) for (z, y, xx), dims in batch]
        )[:, None]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(crops)
        _check_output(logits, crops)
        probs = torch.sigmoid(logits.float())[:, 0].mul_(weight)
        for ((z, y, xx), dims), p in zip(batch, probs, strict=True):
            acc[z : z + wz, y : y + wy, xx : xx + wx] += _flip(p, dims)
        if progress is not None:
            progress.update(len(batch) / len(flips))
    del x
    norm_z, norm_yx = weight_norms(shape, starts, win)
    result = acc[: shape[0], : shape[1], : shape[2]]
    result /= torch.from_numpy(norm_yx).to(device)
    result /= torch.from_numpy(norm_z).to(device)[:, None, None]
    return result.half().cpu().numpy()


def predict_volume(
    model: torch.nn.Module,
    image_store: Path,
    *,
    window: Sequence[int],
    overlap: float = 0.5,
    batch_size: int = 4,
    tta_flips: bool = False,
    device: str | torch.device = "cpu",
    amp: bool | None = None,
) -> np.ndarray:
    """Blended probabilities of a whole volume, held on `device`, as a float16 host array.

    The resident path of `infer_volume` without the store: the volume must fit the device.
    """
    win = _check_window(window)
    _check_settings(overlap, batch_size, 1)
    image, low, high = open_image(Path(image_store))
    starts = [window_starts(int(s), w, overlap) for s, w in zip(image.shape, win, strict=True)]
    dev = torch.device(device)
    tune_malloc()
    was_training = model.training
    model.to(dev).eval()
    try:
        with torch.inference_mode():
            return _blend_resident(
                model, image, low, high, win, starts, batch_size=batch_size,
                tta_flips=tta_flips, device=dev, amp=resolve_amp(amp, dev),
            )  # fmt: skip
    finally:
        model.train(was_training)


def infer_volume(
    model: torch.nn.Module,
    image_store: Path,
    prob_store: Path,
    *,
    window: Sequence[int],
    overlap: float = 0.5,
    batch_size: int = 4,
    tta_flips: bool = False,
    device: str | torch.device = "cpu",
    amp: bool | None = None,
    memory_budget_mb: float = 512,
    device_budget_mb: float | None = None,
) -> dict[str, Any]:
    """Blended sliding-window probabilities of `image_store`, written to a float16 Zarr store.

    Resident on `device` when `resident_bytes` fits ``device_budget_mb`` (None: the same as
    ``memory_budget_mb``; 0 always streams), else streamed in z-slabs under
    ``memory_budget_mb`` (module docstring). The model is moved to `device` and run in eval
    mode (its training flag is restored after). The store is chunked like the input and
    written atomically. Returns counts and timings.
    """
    image_store, prob_store = Path(image_store), Path(prob_store)
    win = _check_window(window)
    _check_settings(overlap, batch_size, memory_budget_mb, device_budget_mb)
    image, low, high = open_image(image_store)
    shape: Shape3 = tuple(int(s) for s in image.shape)  # type: ignore[assignment]
    dev = torch.device(device)
    use_amp = resolve_amp(amp, dev)

    starts = [window_starts(s, w, overlap) for s, w in zip(shape, win, strict=True)]
    n_flips = len(FLIP_DIMS) if tta_flips else 1
    needed = resident_bytes(shape, win, image.dtype.itemsize, batch_size)
    device_budget = (memory_budget_mb if device_budget_mb is None else device_budget_mb) * 2**20
    resident = needed <= device_budget
    plane_acc, plane_in = _plane_bytes(image, win)
    budget = memory_budget_mb * 2**20
    slabs = plan_slabs(
        shape[0], win[0], starts[0], int(image.chunks[0]), plane_acc, plane_in, budget
    )
    n_windows = math.prod(len(s) for s in starts)
    attributes = {
        "source": str(image_store),
        "window": list(win),
        "overlap": overlap,
        "tta_flips": bool(tta_flips),
        "blending": f"gaussian sigma=window*{SIGMA_SCALE}",
        "value": "foreground probability (sigmoid)",
    }

    # Each forward frees and reallocates the same activation buffers (28 MB per tensor for a
    # batch of four 48^3 windows at 16 channels); glibc would hand them back to the OS and
    # page-fault them in again every batch, a third of the CPU time in bench/infer.py.
    tune_malloc()
    was_training = model.training
    model.to(dev).eval()
    t0 = time.perf_counter()
    bar = tqdm(total=n_windows, unit="window", desc=f"infer {image_store.name}", file=sys.stderr)
    try:
        with atomic_path(prob_store) as tmp, torch.inference_mode():
            out = create_volume(tmp, shape, np.float16, image.chunks, attributes=attributes)
            if resident:
                out[...] = _blend_resident(
                    model, image, low, high, win, starts, batch_size=batch_size,
                    tta_flips=tta_flips, device=dev, amp=use_amp, progress=bar,
                )  # fmt: skip
                accumulator_bytes = 4 * math.prod(padded_shape(shape, win))
            else:
                accumulator_bytes = _blend_streamed(
                    model, image, low, high, win, starts, slabs, out, batch_size=batch_size,
                    tta_flips=tta_flips, device=dev, amp=use_amp, progress=bar,
                )  # fmt: skip
    finally:
        bar.close()
        model.train(was_training)
    seconds = time.perf_counter() - t0
    return {
        "shape": list(shape),
        "window": list(win),
        "windows": n_windows,
        "forward_windows": n_windows * n_flips,
        "mode": "resident" if resident else "streamed",
        "resident_mb": needed / 2**20,
        "device_budget_mb": device_budget / 2**20,
        "slabs": 1 if resident else len(slabs),
        "accumulator_peak_mb": accumulator_bytes / 2**20,
        "budget_exceeded": not resident and max(slab_costs(slabs, plane_acc, plane_in)) > budget,
        "amp": use_amp,
        "seconds": seconds,
        "voxels_per_s": math.prod(shape) / seconds if seconds > 0 else float("inf"),
    }


def _blend_streamed(
    model: torch.nn.Module,
    image: zarr.Array,
    low: float,
    high: float,
    win: Shape3,
    starts: Sequence[Sequence[int]],
    slabs: Sequence[Slab],
    out: zarr.Array,
    *,
    batch_size: int,
    tta_flips: bool,
    device: torch.device,
    amp: bool,
    progress: tqdm,
) -> int:
    """Slab by slab into `out`; returns the accumulator's peak bytes."""
    shape: Shape3 = tuple(int(s) for s in image.shape)  # type: ignore[assignment]
    padded = (win[0], max(shape[1], win[1]), max(shape[2], win[2]))
    weight = device_importance_map(win, device)
    blend = BlendAccumulator(shape, starts, win)
    for slab in slabs:
        blend.grow_to(slab.z1)
        x = _read_slab(image, slab.z0, slab.z1, low, high, padded)
        positions = list(itertools.product(slab.rows, starts[1], starts[2]))
        for k in range(0, len(positions), batch_size):
            batch = positions[k : k + batch_size]
            probs = predict_windows(
                model,
                _crops(x, slab.z0, batch, win),
                weight,
                tta_flips=tta_flips,
                device=device,
                amp=amp,
            )
            blend.add(probs, batch)
            progress.update(len(batch))
        del x  # the next slab's input is read before this one would be collected
        blend.flush(slab.flush_to, out)
    return blend.peak_bytes


def slab_costs(slabs: Sequence[Slab], plane_acc: int, plane_in: int) -> list[int]:
    """The bytes each slab of a plan holds (the quantity `plan_slabs` keeps under budget)."""
    costs, acc_z0 = [], 0
    for s in slabs:
        costs.append((s.z1 - acc_z0) * plane_acc + (s.z1 - s.z0) * plane_in)
        acc_z0 = max(acc_z0, s.flush_to)
    return costs


# ----------------------------------------------------------------------------- postprocess
def postprocess(
    prob_store: Path,
    out_tif: Path,
    *,
    threshold: float = 0.5,
    min_component_voxels: int = 0,
    fill_holes: bool = False,
    hysteresis_high: float | None = None,
) -> dict[str, Any]:
    """Binary mask of a probability store, optionally cleaned, as a uint8 0/1 multi-page TIFF.

    The settings are those of `ctseg.postprocess.masks.PostprocessSettings` (threshold or
    hysteresis, small-component removal, 3D hole filling; `ctseg.postprocess.masks.binary_mask`
    applies them, the same function the tuning search scores with).
    """
    settings = PostprocessSettings(
        threshold=threshold,
        hysteresis_high=hysteresis_high,
        min_component_voxels=min_component_voxels,
        fill_holes=fill_holes,
    )
    return write_mask(Path(prob_store), Path(out_tif), settings)


def write_mask(prob_store: Path, out_tif: Path, settings: PostprocessSettings) -> dict[str, Any]:
    """`postprocess` with its settings as one value (how the tuned settings are applied)."""
    prob_store, out_tif = Path(prob_store), Path(out_tif)
    probs = _open_array(prob_store, "probability store")
    shape = tuple(int(s) for s in probs.shape)
    whole = settings.whole_volume
    info: dict[str, Any] = {**settings.as_dict(), "holds_whole_mask": whole}
    with atomic_path(out_tif) as tmp:
        if not whole:
            counter = [0]
            pages = _threshold_pages(probs, settings.threshold, counter)
            tifffile.imwrite(tmp, pages, shape=shape, dtype=np.uint8, photometric="minisblack")
            info["foreground_voxels"] = counter[0]
        else:
            # float16, as stored: 2 bytes a voxel, the same values the search thresholded.
            mask, counts = binary_mask(np.asarray(probs[...]), settings)
            info.update(counts)
            tifffile.imwrite(tmp, mask, photometric="minisblack")
    return info


def _threshold_slabs(probs: zarr.Array, threshold: float) -> Iterator[tuple[int, np.ndarray]]:
    step = int(probs.chunks[0])
    for z0 in range(0, probs.shape[0], step):
        yield z0, (np.asarray(probs[z0 : z0 + step]) > threshold).view(np.uint8)


def _threshold_pages(
    probs: zarr.Array, threshold: float, counter: list[int]
) -> Iterator[np.ndarray]:
    for _, slab in _threshold_slabs(probs, threshold):
        counter[0] += int(np.count_nonzero(slab))
        yield from slab


# ----------------------------------------------------------------------------- weights
def load_model(
    weights: Path, device: str | torch.device | None = None
) -> tuple[torch.nn.Module, Shape3]:
    """The model (eval mode, on `device`) and training patch size from train.py's final weights.

    Loaded with ``weights_only=True``: a weights file cannot run code.
    """
    weights = Path(weights)
    if not weights.is_file():
        raise CtsegError(f"{weights}: weights file not found")
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CtsegError(
            f"{weights}: cannot load weights (corrupt or not a torch.save file): {exc}"
        ) from exc
    if not isinstance(state, dict) or any(k not in state for k in WEIGHT_KEYS):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CtsegError(f"{weights}: expected a dict with keys {list(WEIGHT_KEYS)}, found {found}")
    try:
        model = build_model(state["model_config"])
        model.load_state_dict(state["model"])
        patch = _check_window(state["patch_size"])
    except (ValueError, RuntimeError, TypeError, CtsegError) as exc:
        raise CtsegError(f"{weights}: weights do not match their model config: {exc}") from exc
    return model.to(pick_device(device)).eval(), patch


def record_id(image_store: Path) -> str:
    """`results/zarr/images/<id>.zarr` -> id."""
    path = Path(image_store)
    return check_id(path.name.removesuffix(".zarr"), path)


def infer_records(
    weights: Path,
    image_stores: Sequence[Path],
    out_dir: Path,
    prob_dir: Path,
    *,
    overlap: float = 0.5,
    batch_size: int = 4,
    tta_flips: bool = False,
    threshold: float = 0.5,
    min_component_voxels: int = 0,
    fill_holes: bool = False,
    device: str | torch.device | None = None,
    window: Sequence[int] | None = None,
    amp: bool | None = None,
    memory_budget_mb: float = 512,
    device_budget_mb: float | None = None,
) -> list[dict[str, Any]]:
    """`<out_dir>/<id>.tif` and `<prob_dir>/<id>.zarr` for every image store; one row each.

    The window defaults to the training patch size stored with the weights.
    """
    ids = [record_id(Path(p)) for p in image_stores]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise CtsegError(f"image stores with the same id {duplicates}: outputs would collide")
    dev = pick_device(device)
    model, patch = load_model(weights, dev)
    win = _check_window(window) if window is not None else patch
    rows = []
    for rid, store in zip(ids, image_stores, strict=True):
        prob, tif = Path(prob_dir) / f"{rid}.zarr", Path(out_dir) / f"{rid}.tif"
        row = predict_record(
            model,
            Path(store),
            prob,
            tif,
            window=win,
            overlap=overlap,
            batch_size=batch_size,
            tta_flips=tta_flips,
            device=dev,
            amp=amp,
            memory_budget_mb=memory_budget_mb,
            device_budget_mb=device_budget_mb,
            threshold=threshold,
            min_component_voxels=min_component_voxels,
            fill_holes=fill_holes,
        )
        flat = {k: v for k, v in row.items() if k not in ("inference", "mask")}
        rows.append({"id": rid, **flat, **row["inference"], **row["mask"]})
    return rows


def predict_record(
    model: torch.nn.Module,
    image_store: Path,
    probabilities: Path,
    mask: Path | None,
    *,
    threshold: float,
    min_component_voxels: int,
    fill_holes: bool,
    hysteresis_high: float | None = None,
    **inference: Any,
) -> dict[str, Any]:
    """One volume: the probabilities (`infer_volume`, with `inference`'s settings), then the
    post-processed mask (none when `mask` is None: the workflow post-processes in a step of its
    own, with settings tuned on the val split's probabilities). The settings are checked first,
    before the long inference."""
    settings = PostprocessSettings(
        threshold=threshold,
        hysteresis_high=hysteresis_high,
        min_component_voxels=min_component_voxels,
        fill_holes=fill_holes,
    )
    info = infer_volume(model, Path(image_store), Path(probabilities), **inference)
    post = None if mask is None else write_mask(Path(probabilities), Path(mask), settings)
    return {
        "prediction": None if mask is None else str(mask),
        "probabilities": str(probabilities),
        "inference": info,
        "mask": post or {},
    }
