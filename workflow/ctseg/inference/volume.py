"""The volume driver: a model's sliding-window probabilities of one Zarr image store, blended on
the device or streamed in z-slabs, written as a float16 Zarr store (`infer_volume`) or returned
(`predict_volume`). The windows, weights and slabs are `ctseg.inference.windows`'; the settings
are one `ctseg.inference.settings.InferenceSettings`.

Resident or streamed
--------------------
A volume whose working set fits ``device_budget_mb`` (default 2048 MB; on a CPU run the device
is host memory) is *resident*: it is read once, copied to the device once in its own dtype
(a uint8 volume is a quarter of its float32 bytes) and normalised there, and every window crop,
forward, flip, Gaussian weighting and accumulation happens there; the divided result comes
back as float16 and is written in one go. Nothing returns to the host per window, so a GPU
never waits on a copy or on numpy. The working set
(`ctseg.inference.windows.resident_bytes`) is the float32 input and accumulator of the padded
volume (8 bytes a voxel), the raw volume and the float16 result (on the device and the host),
and one batch of windows; a real 320^3 uint8 volume needs about 0.4 GB. Larger volumes are
streamed (below). Both paths read with the same function, run the same windows in the same
order, and divide by the same factorised weights, so they agree to float32 rounding before the
float16 store (bit for bit on the test's pointwise model).

Multi-class models
------------------
A model of a multi-class label spec (background and K classes, K >= 2) has C = K + 1 output
channels (`ctseg.labels.LabelSpec.out_channels`): each window's probabilities are the softmax over
them (in float32, after the forward), flips are averaged and windows blended per channel with
the same weights, and the store is float16 of shape (C, Z, Y, X), chunked (1, *the input's
chunks*), with the attributes of a binary store plus ``classes`` (the channels' names, background
first) and ``labels`` (the dataset's spec), ``value`` saying "class probabilities (softmax)".
Every buffer that holds probabilities holds C channels, and the budgets count them
(`ctseg.inference.windows.resident_bytes`, `_plane_bytes`). A binary model (one channel,
sigmoid) is run and written as it always was.

Batches are made of (window, flip) pairs: with ``tta_flips`` the 8 flipped copies of a window
share forwards with other windows, so every forward but the last is ``batch_size`` inputs.

Streaming
---------
Slab by slab (`ctseg.inference.windows.plan_slabs`), the output that is final is divided by the
weights and written to the probability store, in whole z-chunks of the store when the chunk is
no deeper than the window (so no chunk is written twice), and the accumulator keeps only the
remainder. If even one row of windows exceeds ``memory_budget_mb``, the result reports
``budget_exceeded`` (the plane, Y x X, is not tiled: volumes are streamed along z only).

Speed
-----
``batch_size`` windows go through the model per call, under ``torch.inference_mode``; ``amp``
(default: on CUDA only) runs the forward under bf16 autocast while the blending stays float32,
and ``channels_last`` (default: on CUDA only) holds the weights in channels_last_3d for the
forwards, as training does (cuDNN's 3D convolutions are about 1.5x faster in it on a GPU;
BENCHMARKS.md), and gives the model back in the layout it came in.
On a CPU the gain over one window at a time comes from batching (PyTorch sends every
convolution of a batch of two or more to oneDNN) and from keeping freed activation buffers in
the heap (`ctseg.data.heap.tune_malloc`); bench/infer.py measures both.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from ctseg.data.heap import tune_malloc
from ctseg.inference.settings import InferenceSettings, Shape3
from ctseg.inference.windows import (
    FIXED_ONE,
    FLIP_DIMS,
    SIGMA_SCALE,
    Slab,
    check_coverage,
    device_importance_map,
    empty_windows,
    from_fixed,
    padded_shape,
    plan_slabs,
    resident_bytes,
    slab_costs,
    weight_norms,
    window_starts,
)
from ctseg.io import CtsegError, fresh_output
from ctseg.labels import LabelSpec
from ctseg.postprocess.write import (
    CLASSES_ATTRIBUTE,
    LABELS_ATTRIBUTE,
    MULTICLASS_VALUE,
    channel_names,
    open_checked,
)
from ctseg.progress import Progress
from ctseg.store import WEIGHTS_ATTRIBUTE, create_volume


# ----------------------------------------------------------------------------- inputs
def open_image(image_store: Path) -> tuple[zarr.Array, float, float]:
    """The image array and its normalisation range (p0_5, p99_5), checked."""
    image = open_checked(Path(image_store), "image store")
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


def padded_input(raw: np.ndarray, low: float, high: float, padded: Sequence[int]) -> np.ndarray:
    """`raw` normalised, zero-padded at the far end to at least `padded`."""
    x = normalise(raw, low, high)
    target = tuple(max(a, int(b)) for a, b in zip(x.shape, padded, strict=True))
    if target == x.shape:
        return x
    out = np.zeros(target, np.float32)
    out[: x.shape[0], : x.shape[1], : x.shape[2]] = x
    return out


# Raw dtypes torch holds and converts exactly: the resident path copies these to the device
# as they are (a quarter of the float32 bytes for uint8) and normalises there.
_DEVICE_RAW_DTYPES = (np.uint8, np.int8, np.int16, np.int32, np.float32)


def device_input(
    raw: np.ndarray, low: float, high: float, padded: Sequence[int], device: torch.device
) -> torch.Tensor:
    """`raw` normalised on `device`, zero-padded at the far end to `padded`.

    The raw voxels cross to the device in their own dtype and are normalised there with the
    operations of `normalise`, in the same order and in float32 (IEEE subtraction, division and
    clamp), so the input equals the streamed path's host normalisation bit for bit.
    """
    if raw.dtype.type not in _DEVICE_RAW_DTYPES:
        # uint16/uint32/float64...: converted to float32 on the host, as `normalise` does.
        raw = raw.astype(np.float32)
    x = torch.from_numpy(raw).to(device).to(torch.float32)
    low32, high32 = np.float32(low), np.float32(high)
    span = max(high32 - low32, np.float32(1e-6))
    x.sub_(float(low32)).div_(float(span)).clamp_(0.0, 1.0)
    if tuple(x.shape) == tuple(padded):
        return x
    out = torch.zeros(tuple(padded), dtype=torch.float32, device=device)
    out[: x.shape[0], : x.shape[1], : x.shape[2]] = x
    return out


# ----------------------------------------------------------------------------- model
def _check_output(logits: torch.Tensor, x: torch.Tensor, channels: int = 1) -> None:
    expected = (x.shape[0], channels, *x.shape[2:])
    if tuple(logits.shape) == expected:
        return
    if channels == 1:
        raise CtsegError(
            f"model output of shape {tuple(logits.shape)} for input {tuple(x.shape)}: "
            "expected one channel of the input's size (a model with several channels is a "
            "multi-class model: pass the labels its checkpoint records)"
        )
    raise CtsegError(
        f"model output of shape {tuple(logits.shape)} for input {tuple(x.shape)}: expected "
        f"{channels} channels (background and each class of the labels) of the input's size"
    )


def _probabilities(logits: torch.Tensor, channels: int) -> torch.Tensor:
    """(B, C, Z, Y, X) float32 probabilities: sigmoid of one channel, softmax of several."""
    if channels == 1:
        return torch.sigmoid(logits.float())
    return torch.softmax(logits.float(), dim=1)


def output_channels(labels: LabelSpec | None) -> int:
    """The model's output channels for `labels`: 1 for none or a binary spec."""
    return 1 if labels is None else labels.out_channels


def predict_windows(
    model: torch.nn.Module,
    crops: np.ndarray,
    weight: torch.Tensor,
    *,
    tta_flips: bool,
    device: torch.device,
    amp: bool,
    channels: int = 1,
    batch_size: int = 1,
) -> np.ndarray:
    """The exact sums (int64, `ctseg.inference.windows.to_fixed`) of the Gaussian-weighted
    probabilities of a batch of windows (B, Z, Y, X), over its flips when `tta_flips`: (B, Z,
    Y, X), or (B, C, Z, Y, X) for a model of C > 1 channels."""
    x = torch.from_numpy(crops)[:, None].to(device)
    flips = FLIP_DIMS if tta_flips else ((),)
    item_weight = weight / len(flips) if len(flips) > 1 else weight
    total: torch.Tensor | None = None
    for dims in flips:
        xi = x.flip(dims) if dims else x
        logits = _forward_full_batch(model, xi, batch_size, amp)
        _check_output(logits, xi, channels)
        p = _probabilities(logits, channels)
        p = (p[:, 0] if channels == 1 else p).mul_(item_weight)
        fixed = _flip(_to_fixed(p), tuple(d - 5 for d in dims))
        total = fixed if total is None else total.add_(fixed)
    assert total is not None
    return total.cpu().numpy()


def _forward_full_batch(
    model: torch.nn.Module, crops: torch.Tensor, batch_size: int, amp: bool
) -> torch.Tensor:
    """The model's logits of `crops` (B, 1, Z, Y, X), run as a batch of `batch_size` (a short
    batch is padded with copies of its last crop, whose outputs are dropped). A convolution
    library picks its algorithm by the batch's shape, and a window's output can differ in the
    last bits between algorithms: at one batch shape, a window's probabilities are the same
    whichever windows share its batch, so every tiling and split of the volume gives the same
    bits (`ctseg.inference.windows`, "The sum is exact")."""
    n = crops.shape[0]
    if n < batch_size:
        crops = torch.cat([crops, crops[-1:].expand(batch_size - n, *crops.shape[1:])])
    with torch.autocast(crops.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(crops)
    return logits[:n]


def _to_fixed(weighted: torch.Tensor) -> torch.Tensor:
    """`ctseg.inference.windows.to_fixed` on the device: the same float32 scaling and
    truncation."""
    return (weighted * FIXED_ONE).to(torch.int64)


def _from_fixed(total: torch.Tensor, norm_z: np.ndarray, norm_yx: np.ndarray) -> torch.Tensor:
    """`ctseg.inference.windows.from_fixed` on the device, operation for operation."""
    value = (total.to(torch.float64) * (1.0 / FIXED_ONE)).to(torch.float32)
    value /= torch.from_numpy(norm_yx).to(value.device)
    value /= torch.from_numpy(norm_z).to(value.device)[:, None, None]
    return value.half()


# ----------------------------------------------------------------------------- streamed
class BlendAccumulator:
    """The exact sums of the weighted probabilities of the z-range [z0, z0 + depth) that is not
    yet written, of one channel (Z, Y, X), or of `channels` > 1 (C, Z, Y, X).

    The weight sum is not accumulated: it is the outer product of three 1D sums
    (`ctseg.inference.windows.weight_norms`), applied when a finished range is flushed.
    """

    def __init__(
        self,
        shape: Shape3,
        starts: Sequence[Sequence[int]],
        window: Shape3,
        channels: int = 1,
    ) -> None:
        self.shape = shape
        self.lead: tuple[int, ...] = () if channels == 1 else (channels,)
        self.z0 = 0
        self.acc = np.zeros((*self.lead, 0, *shape[1:]), np.int64)
        self.peak_bytes = 0
        self.norm_z, self.norm_yx = weight_norms(shape, starts, window)

    def grow_to(self, z1: int) -> None:
        """Extend the held range to end at z1, keeping the unflushed remainder."""
        held = self.acc.shape[-3]
        if self.z0 + held < z1:
            grown = np.zeros((*self.lead, z1 - self.z0, *self.shape[1:]), np.int64)
            grown[..., :held, :, :] = self.acc
            self.acc = grown
        self.peak_bytes = max(self.peak_bytes, self.acc.nbytes)

    def add(self, probs: np.ndarray, positions: Sequence[Shape3]) -> None:
        """Add each window's exact sums, cropped to the volume (windows may overhang padded
        axes)."""
        for (z, y, x), p in zip(positions, probs, strict=True):
            corner = (z, y, x)
            dz, dy, dx = (
                min(w, s - o) for w, s, o in zip(p.shape[-3:], self.shape, corner, strict=True)
            )
            z_in = z - self.z0
            self.acc[..., z_in : z_in + dz, y : y + dy, x : x + dx] += p[..., :dz, :dy, :dx]

    def flush(self, z_to: int, out: zarr.Array) -> None:
        """Divide [z0, z_to) by the weights, write it as float16 and drop it."""
        n = z_to - self.z0
        if n <= 0:
            return
        final = from_fixed(self.acc[..., :n, :, :], self.norm_z[self.z0 : z_to], self.norm_yx)
        if self.lead:
            out[:, self.z0 : z_to] = final
        else:
            out[self.z0 : z_to] = final
        self.acc = self.acc[..., n:, :, :]
        self.z0 = z_to


def _plane_bytes(image: zarr.Array, window: Shape3, channels: int = 1) -> tuple[int, int]:
    """Bytes per z-plane of the accumulator (of every channel) and of the input slab, for the
    slab plan."""
    plane = image.shape[1] * image.shape[2]
    padded = max(image.shape[1], window[1]) * max(image.shape[2], window[2])
    # Per channel: the int64 sums (8) and their growth copy (8), and the flush's float64 (8),
    # float32 (4) and float16 (2) copies; raw + float32 input.
    return plane * 30 * channels, plane * image.dtype.itemsize + padded * 4


def _crops(x: np.ndarray, z0: int, batch: Sequence[Shape3], window: Shape3) -> np.ndarray:
    wz, wy, wx = window
    return np.stack([x[z - z0 : z - z0 + wz, y : y + wy, xx : xx + wx] for z, y, xx in batch])


def _blend_streamed(
    model: torch.nn.Module,
    image: zarr.Array,
    low: float,
    high: float,
    starts: Sequence[Sequence[int]],
    slabs: Sequence[Slab],
    out: zarr.Array,
    settings: InferenceSettings,
    device: torch.device,
    progress: Progress,
    channels: int = 1,
) -> tuple[int, int]:
    """Slab by slab into `out`; returns the accumulator's peak bytes and the number of windows
    skipped as empty (`ctseg.inference.windows.empty_windows`)."""
    shape: Shape3 = tuple(int(s) for s in image.shape)  # type: ignore[assignment]
    win = settings.checked_window()
    padded = (win[0], max(shape[1], win[1]), max(shape[2], win[2]))
    weight = device_importance_map(win, device)
    blend = BlendAccumulator(shape, starts, win, channels)
    amp = settings.use_amp(device)
    skipped = 0
    for slab in slabs:
        blend.grow_to(slab.z1)
        raw = np.asarray(image[slab.z0 : slab.z1])
        x = padded_input(raw, low, high, padded)
        every = list(itertools.product(slab.rows, starts[1], starts[2]))
        empty = empty_windows(raw, [(z - slab.z0, y, xx) for z, y, xx in every], win, settings)
        positions = [p for p, e in zip(every, empty, strict=True) if not e]
        skipped += len(every) - len(positions)
        progress.update(len(every) - len(positions))
        for k in range(0, len(positions), settings.batch_size):
            batch = positions[k : k + settings.batch_size]
            probs = predict_windows(
                model,
                _crops(x, slab.z0, batch, win),
                weight,
                tta_flips=settings.tta_flips,
                device=device,
                amp=amp,
                channels=channels,
                batch_size=settings.batch_size,
            )
            blend.add(probs, batch)
            progress.update(len(batch))
        del x, raw  # the next slab's input is read before this one would be collected
        blend.flush(slab.flush_to, out)
    return blend.peak_bytes, skipped


# ----------------------------------------------------------------------------- resident
def _flip(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return t.flip(dims) if dims else t


def accumulate_windows(
    model: torch.nn.Module,
    x: torch.Tensor,
    total: torch.Tensor,
    corners: Sequence[Shape3],
    settings: InferenceSettings,
    progress: Progress | None = None,
    channels: int = 1,
) -> None:
    """Add the exact sums (`ctseg.inference.windows.to_fixed`) of the windows at `corners` into
    `total` (int64, (Z, Y, X) or (C, Z, Y, X)), on the device of `x`, the normalised input
    (Z, Y, X) in the same coordinates; every window lies inside both.

    Batches are made of (window, flip) pairs in window-major order, so with ``tta_flips`` the 8
    flipped copies of a window share forwards with other windows. The caller puts the model in
    eval mode on the device and holds `torch.inference_mode`.
    """
    win = settings.checked_window()
    device = x.device
    flips = FLIP_DIMS if settings.tta_flips else ((),)
    weight = device_importance_map(win, device)
    if len(flips) > 1:
        weight = weight / len(flips)  # the TTA mean folded into the weight (exact: 2^3)
    # FLIP_DIMS index (B, C, Z, Y, X), a crop is (Z, Y, X) and a window's probabilities (Z, Y, X)
    # or (C, Z, Y, X): counted from the end.
    items = [(pos, tuple(d - 5 for d in dims)) for pos in corners for dims in flips]
    wz, wy, wx = win
    amp = settings.use_amp(device)
    for k in range(0, len(items), settings.batch_size):
        batch = items[k : k + settings.batch_size]
        crops = torch.stack(
            [_flip(x[z : z + wz, y : y + wy, xx : xx + wx], dims) for (z, y, xx), dims in batch]
        )[:, None]
        logits = _forward_full_batch(model, crops, settings.batch_size, amp)
        _check_output(logits, crops, channels)
        probs = _probabilities(logits, channels)
        fixed = _to_fixed((probs[:, 0] if channels == 1 else probs).mul_(weight))
        for ((z, y, xx), dims), f in zip(batch, fixed, strict=True):
            total[..., z : z + wz, y : y + wy, xx : xx + wx] += _flip(f, dims)
        if progress is not None:
            progress.update(len(batch) / len(flips))


def _blend_resident(
    model: torch.nn.Module,
    image: zarr.Array,
    low: float,
    high: float,
    starts: Sequence[Sequence[int]],
    settings: InferenceSettings,
    device: torch.device,
    progress: Progress | None = None,
    channels: int = 1,
) -> tuple[np.ndarray, int]:
    """Blended probabilities of the whole volume, computed on `device`, as a float16 host array
    (Z, Y, X), or (C, Z, Y, X) for a model of `channels` > 1, and the number of windows skipped
    as empty (`ctseg.inference.windows.empty_windows`).

    The caller puts the model in eval mode on `device` and holds `torch.inference_mode`.
    """
    shape: Shape3 = tuple(int(s) for s in image.shape)  # type: ignore[assignment]
    win = settings.checked_window()
    padded = padded_shape(shape, win)
    raw = np.asarray(image[...])
    every = list(itertools.product(*starts))
    empty = empty_windows(raw, every, win, settings)
    corners = [c for c, e in zip(every, empty, strict=True) if not e]
    x = device_input(raw, low, high, padded, device)
    del raw
    lead = () if channels == 1 else (channels,)
    total = torch.zeros((*lead, *padded), dtype=torch.int64, device=device)
    if progress is not None:
        progress.update(len(every) - len(corners))
    accumulate_windows(model, x, total, corners, settings, progress, channels)
    del x
    norm_z, norm_yx = weight_norms(shape, starts, win)
    result = _from_fixed(total[..., : shape[0], : shape[1], : shape[2]], norm_z, norm_yx)
    return result.cpu().numpy(), len(every) - len(corners)


# ----------------------------------------------------------------------------- volumes
def weights_layout(model: torch.nn.Module) -> torch.memory_format:
    """The memory format of the model's 3D convolution weights: restored after inference, so
    that the caller's model is left as it came."""
    for param in model.parameters():
        if param.ndim == 5 and param.shape[1] > 1 and param.shape[2:].numel() > 1:
            if param.is_contiguous(memory_format=torch.channels_last_3d):
                return torch.channels_last_3d
            return torch.contiguous_format
    return torch.contiguous_format


def _starts(shape: Sequence[int], settings: InferenceSettings) -> list[list[int]]:
    win = settings.checked_window()
    return [window_starts(int(s), w, settings.overlap) for s, w in zip(shape, win, strict=True)]


def predict_volume(
    model: torch.nn.Module,
    image_store: Path,
    settings: InferenceSettings,
    labels: LabelSpec | None = None,
) -> np.ndarray:
    """Blended probabilities of a whole volume, held on the device, as a float16 host array:
    (Z, Y, X), or (C, Z, Y, X) for a model of the multi-class spec `labels`.

    The resident path of `infer_volume` without the store: the volume must fit the device.
    """
    settings.checked_window()
    image, low, high = open_image(Path(image_store))
    starts = _starts(image.shape, settings)
    dev = settings.torch_device()
    tune_malloc()
    was_training, layout = model.training, weights_layout(model)
    model.to(dev, memory_format=settings.memory_format(dev)).eval()
    try:
        with torch.inference_mode():
            probabilities, _ = _blend_resident(
                model, image, low, high, starts, settings, dev, channels=output_channels(labels)
            )
            return probabilities
    finally:
        model.to(memory_format=layout).train(was_training)


def store_attributes(
    image_store: Path,
    settings: InferenceSettings,
    weights_sha256: str | None,
    labels: LabelSpec | None,
) -> dict[str, Any]:
    """What a probability store records: its source, the sliding-window settings, what its
    values are, the weights' digest, and a multi-class store's classes and label spec."""
    attributes: dict[str, Any] = {
        "source": str(image_store),
        "window": list(settings.checked_window()),
        "overlap": settings.overlap,
        "tta_flips": bool(settings.tta_flips),
        "blending": f"gaussian sigma=window*{SIGMA_SCALE}",
        "value": "foreground probability (sigmoid)",
    }
    if weights_sha256 is not None:
        attributes[WEIGHTS_ATTRIBUTE] = [weights_sha256]
    if labels is not None and not labels.is_binary:
        attributes["value"] = MULTICLASS_VALUE
        attributes[CLASSES_ATTRIBUTE] = channel_names(labels)
        attributes[LABELS_ATTRIBUTE] = labels.to_dict()
    return attributes


def infer_volume(
    model: torch.nn.Module,
    image_store: Path,
    prob_store: Path,
    settings: InferenceSettings,
    weights_sha256: str | None = None,
    labels: LabelSpec | None = None,
) -> dict[str, Any]:
    """Blended sliding-window probabilities of `image_store`, written to a float16 Zarr store.
    `weights_sha256`: the digest of the weights file the model was loaded from, kept in the
    store's attributes (`ctseg.store.WEIGHTS_ATTRIBUTE`). `labels`: the label spec the model
    was trained on (`ctseg.inference.run.load_checkpoint`); a multi-class one gives a store of
    one channel per class (module docstring); None or a binary spec, the one-channel store.

    Resident on the device when `resident_bytes` fits the device budget (module docstring),
    else streamed in z-slabs under ``memory_budget_mb``. The model is moved to the device and
    run in eval mode (its training flag is restored after). The store is chunked like the input
    and written atomically. Returns counts and timings.
    """
    image_store, prob_store = Path(image_store), Path(prob_store)
    win = settings.checked_window()
    image, low, high = open_image(image_store)
    shape: Shape3 = tuple(int(s) for s in image.shape)  # type: ignore[assignment]
    dev = settings.torch_device()
    starts = _starts(shape, settings)
    check_coverage(starts, win, settings.overlap)
    n_flips = len(FLIP_DIMS) if settings.tta_flips else 1
    channels = output_channels(labels)
    needed = resident_bytes(shape, win, image.dtype.itemsize, settings.batch_size, channels)
    device_budget = settings.device_budget_bytes()
    resident = needed <= device_budget
    plane_acc, plane_in = _plane_bytes(image, win, channels)
    budget = settings.memory_budget_mb * 2**20
    slabs = plan_slabs(
        shape[0], win[0], starts[0], int(image.chunks[0]), plane_acc, plane_in, budget
    )
    n_windows = math.prod(len(s) for s in starts)
    attributes = store_attributes(image_store, settings, weights_sha256, labels)
    store_shape: tuple[int, ...] = shape
    store_chunks: tuple[int, ...] = tuple(int(c) for c in image.chunks)
    if channels > 1:
        store_shape, store_chunks = (channels, *shape), (1, *store_chunks)

    # Each forward frees and reallocates the same activation buffers (28 MB per tensor for a
    # batch of four 48^3 windows at 16 channels); glibc would hand them back to the OS and
    # page-fault them in again every batch, a third of the CPU time in bench/infer.py.
    tune_malloc()
    was_training, layout = model.training, weights_layout(model)
    model.to(dev, memory_format=settings.memory_format(dev)).eval()
    t0 = time.perf_counter()
    bar = Progress(
        total=n_windows, unit="window", desc=f"infer {image_store.name}", file=sys.stderr
    )
    try:
        # fresh_output: a full disk is one line naming the store, and zarr's writes still in
        # flight are waited for before the partial store is removed.
        with (
            fresh_output(prob_store, what=f"write the probabilities of {image_store.name}") as tmp,
            torch.inference_mode(),
        ):
            out = create_volume(tmp, store_shape, np.float16, store_chunks, attributes=attributes)
            if resident:
                out[...], skipped = _blend_resident(
                    model, image, low, high, starts, settings, dev, bar, channels
                )
                accumulator_bytes = 8 * channels * math.prod(padded_shape(shape, win))
            else:
                accumulator_bytes, skipped = _blend_streamed(
                    model, image, low, high, starts, slabs, out, settings, dev, bar, channels
                )
    finally:
        bar.close()
        model.to(memory_format=layout).train(was_training)
    seconds = time.perf_counter() - t0
    classes = {CLASSES_ATTRIBUTE: attributes[CLASSES_ATTRIBUTE]} if channels > 1 else {}
    return {
        **classes,
        "shape": list(shape),
        "window": list(win),
        "windows": n_windows,
        "forward_windows": (n_windows - skipped) * n_flips,
        "skipped_windows": skipped,
        "mode": "resident" if resident else "streamed",
        "resident_mb": needed / 2**20,
        "device_budget_mb": device_budget / 2**20,
        "slabs": 1 if resident else len(slabs),
        "accumulator_peak_mb": accumulator_bytes / 2**20,
        "budget_exceeded": not resident and max(slab_costs(slabs, plane_acc, plane_in)) > budget,
        "amp": settings.use_amp(dev),
        "seconds": seconds,
        "voxels_per_s": math.prod(shape) / seconds if seconds > 0 else float("inf"),
    }
