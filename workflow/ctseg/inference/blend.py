"""The window kernel: a model's Gaussian-weighted probabilities of the windows of one box,
summed exactly on the device. `ctseg.inference.tiled` runs it over every box of a volume.

One session, one kernel
-----------------------
`model_session` puts a model on the device in eval mode (in channels_last_3d where the settings
ask: cuDNN's 3D convolutions are about 1.5x faster in it on a GPU, BENCHMARKS.md) under
`torch.inference_mode`, keeps freed activation buffers in the heap
(`ctseg.data.heap.tune_malloc`), and gives the model back as it came. `blend_windows` adds the
exact sums (`ctseg.inference.windows.to_fixed`) of the windows at some corners of a normalised
box (`device_input`) into an int64 buffer of that box on the same device. Everything per window
(crop, flip, forward, sigmoid or softmax, Gaussian weight, sum) stays on the device, so a GPU
never waits on a copy or on numpy.

Batches are made of (window, flip) pairs: with ``tta_flips`` the 8 flipped copies of a window
share forwards with other windows, so every forward but the last is ``batch_size`` inputs, and
the last is padded to that size (`_forward_full_batch`): at one batch shape a window's
probabilities have the same bits whichever windows share its batch, so every tiling of the
volume gives the same sums. ``amp`` (default: on CUDA only) runs the forward under bf16
autocast while the blending stays float32. On a CPU the gain over one window at a time comes
from batching (PyTorch sends every convolution of a batch of two or more to oneDNN) and from
keeping freed activation buffers in the heap; bench/infer.py measures both.

Multi-class models
------------------
A model of a multi-class label spec (background and K classes, K >= 2) has C = K + 1 output
channels (`ctseg.labels.LabelSpec.out_channels`): each window's probabilities are the softmax
over them (in float32, after the forward) and every channel is blended with the same weights,
so the sums are (C, Z, Y, X). A binary model (one channel, sigmoid) gives (Z, Y, X).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ctseg.data.heap import tune_malloc
from ctseg.inference.settings import InferenceSettings, Shape3
from ctseg.inference.windows import FLIP_DIMS, device_importance_map, to_fixed
from ctseg.io import CtsegError
from ctseg.labels import LabelSpec
from ctseg.progress import Progress

# Raw dtypes torch holds and converts exactly: these cross to the device as they are (a quarter
# of the float32 bytes for uint8) and are normalised there.
_DEVICE_RAW_DTYPES = (np.uint8, np.int8, np.int16, np.int32, np.float32)


def normalise(raw: np.ndarray, low: float, high: float) -> np.ndarray:
    """clip((x - p0_5) / (p99_5 - p0_5), 0, 1) in float32 on the host, exactly as
    `ctseg.data.to_device` and `device_input`."""
    low32, high32 = np.float32(low), np.float32(high)
    span = max(high32 - low32, np.float32(1e-6))
    x = raw.astype(np.float32)
    x -= low32
    x /= span
    return np.clip(x, 0.0, 1.0, out=x)


def device_input(
    raw: np.ndarray, low: float, high: float, padded: Sequence[int], device: torch.device
) -> torch.Tensor:
    """`raw` normalised on `device`, zero-padded at the far end to `padded`.

    The raw voxels cross to the device in their own dtype and are normalised there with the
    operations of `normalise`, in the same order and in float32 (IEEE subtraction, division and
    clamp), so the input equals the host normalisation bit for bit.
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


def output_channels(labels: LabelSpec | None) -> int:
    """The model's output channels for `labels`: 1 for none or a binary spec."""
    return 1 if labels is None else labels.out_channels


# ----------------------------------------------------------------------------- the session
def weights_layout(model: torch.nn.Module) -> torch.memory_format:
    """The memory format of the model's 3D convolution weights."""
    for param in model.parameters():
        if param.ndim == 5 and param.shape[1] > 1 and param.shape[2:].numel() > 1:
            if param.is_contiguous(memory_format=torch.channels_last_3d):
                return torch.channels_last_3d
            return torch.contiguous_format
    return torch.contiguous_format


@contextlib.contextmanager
def model_session(
    model: torch.nn.Module, settings: InferenceSettings, device: torch.device
) -> Iterator[None]:
    """The model on `device`, in eval mode and the settings' memory format, under
    `torch.inference_mode`; its training flag and weights' layout restored after."""
    # Each forward frees and reallocates the same activation buffers (28 MB per tensor for a
    # batch of four 48^3 windows at 16 channels); glibc would hand them back to the OS and
    # page-fault them in again every batch, a third of the CPU time in bench/infer.py.
    tune_malloc()
    was_training, layout = model.training, weights_layout(model)
    model.to(device, memory_format=settings.memory_format(device)).eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.to(memory_format=layout).train(was_training)


def warm_up(model: torch.nn.Module, settings: InferenceSettings, device: torch.device) -> None:
    """One forward of a full batch of windows, so that the memory of the model's activations
    is taken (and can be counted with the model) before any box's."""
    crops = torch.zeros((settings.batch_size, 1, *settings.checked_window()), device=device)
    with model_session(model, settings, device):
        _forward_full_batch(model, crops, settings.batch_size, settings.use_amp(device))


# ----------------------------------------------------------------------------- the kernel
def _check_output(logits: torch.Tensor, x: torch.Tensor, channels: int) -> None:
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


def _forward_full_batch(
    model: torch.nn.Module, crops: torch.Tensor, batch_size: int, amp: bool
) -> torch.Tensor:
    """The model's logits of `crops` (B, 1, Z, Y, X), run as a batch of `batch_size` (a short
    batch is padded with copies of its last crop, whose outputs are dropped). A convolution
    library picks its algorithm by the batch's shape, and a window's output can differ in the
    last bits between algorithms: at one batch shape, a window's probabilities are the same
    whichever windows share its batch."""
    n = crops.shape[0]
    if n < batch_size:
        crops = torch.cat([crops, crops[-1:].expand(batch_size - n, *crops.shape[1:])])
    with torch.autocast(crops.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(crops)
    return logits[:n]


def _flip(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return t.flip(dims) if dims else t


def blend_windows(
    model: torch.nn.Module,
    x: torch.Tensor,
    total: torch.Tensor,
    corners: Sequence[Shape3],
    settings: InferenceSettings,
    progress: Progress | None = None,
    channels: int = 1,
) -> None:
    """Add the exact sums of the windows at `corners` into `total` (int64, (Z, Y, X) or
    (C, Z, Y, X)), on the device of `x`, the normalised input (Z, Y, X) in the same
    coordinates; every window lies inside both. The caller holds `model_session`.
    `progress`: a bar updated by windows done (a flip is a share of its window)."""
    win = settings.checked_window()
    flips = FLIP_DIMS if settings.tta_flips else ((),)
    weight = device_importance_map(win, x.device)
    if len(flips) > 1:
        weight = weight / len(flips)  # the TTA mean folded into the weight (exact: 2^3)
    # FLIP_DIMS index (B, C, Z, Y, X), a crop is (Z, Y, X) and a window's probabilities (Z, Y, X)
    # or (C, Z, Y, X): counted from the end.
    items = [(pos, tuple(d - 5 for d in dims)) for pos in corners for dims in flips]
    wz, wy, wx = win
    amp = settings.use_amp(x.device)
    for k in range(0, len(items), settings.batch_size):
        batch = items[k : k + settings.batch_size]
        crops = torch.stack(
            [_flip(x[z : z + wz, y : y + wy, xx : xx + wx], dims) for (z, y, xx), dims in batch]
        )[:, None]
        logits = _forward_full_batch(model, crops, settings.batch_size, amp)
        _check_output(logits, crops, channels)
        if channels == 1:
            probs = torch.sigmoid(logits.float())[:, 0]
        else:
            probs = torch.softmax(logits.float(), dim=1)
        fixed = to_fixed(probs.mul_(weight))
        for ((z, y, xx), dims), f in zip(batch, fixed, strict=True):
            total[..., z : z + wz, y : y + wy, xx : xx + wx] += _flip(f, dims)
        if progress is not None:
            progress.update(len(batch) / len(flips))
