"""Inference benchmark: ctseg's inference against a one-window loop and against MONAI, same run.

    python bench/infer.py            # window 64^3 on 128x160x160; RSS at z = 160 and 640;
                                     # MONAI: window 72x136x136 on 144x128x128
    python bench/infer.py --quick    # window 48^3 on 72x96x96;    RSS at z = 96 and 384;
                                     # MONAI: window 48x64x64 on 64x96x96
    python bench/infer.py --smoke    # window 16^3 on 24x32x32: every path in seconds (CI);
                                     # its figures say nothing about speed
    python bench/infer.py --monai-only --full-model   # on a GPU: exp001_full's model vs MONAI
    python bench/infer.py --monai-only --pointwise    # a 1x1x1 conv: all but the forward

MONAI is a bench-only extra: ``.venv/bin/pip install -e '.[bench]'`` (``--skip-monai`` runs
the rest without it).

Figures:
- voxels/s of `ctseg.inference.run.infer_volume` (batch 4 by default, Gaussian blending; the
  volume is one tile) against the baseline below, on the same
  U-Net (filters 16-32-64-128, instance norm: a realistic width for a CPU, so the forward
  dominates) and the same volume. Both use the same window positions, Gaussian map, device
  and precision (bf16 autocast on CUDA, fp32 on a CPU), and both run one warm-up forward at
  their batch size first; the table shows the largest difference between the probability
  volumes as a check that they compute the same thing. Another row runs the baseline with the
  allocator setting that `infer_volume` makes, to split the speedup into its two parts.
- peak RSS of the inference in tiles at two volume depths (z grows 4x), with a 32 MB budget:
  bounded memory shows as a flat line. The loop baseline is measured beside it. These runs use a
  1x1x1 convolution in place of the U-Net so that volumes big enough for volume-sized buffers
  to show run in seconds; a U-Net's activations depend on the window batch only, and the speed
  runs show their RSS.

The baseline ("loop") is a plain, reasonable implementation, not a strawman: for every window
it reads the window from the Zarr store (zero-padded where it overhangs), normalises it, runs
the model on a batch of one under torch.inference_mode, applies the sigmoid and the Gaussian
map (computed once, not per window), and adds p * g and g into two whole-volume float32 arrays;
at the end it divides and writes the float16 store. What it lacks: batching windows, reading
each input tile once, the bounded tiles and the allocator setting.

Where the speedup comes from on a CPU (2 shared cores, torch 2.13, fp32):
the forward is more than 95% of the time (cProfile), so only a faster forward
counts. Two things make it faster, and both are real properties of the implementation:
- glibc hands the freed activation buffers (7 MB per tensor for one 48^3 window, 28 MB for
  four) back to the OS after each forward and page-faults them in again on the next: about
  37,000 minor faults per window at batch 1. `ctseg.data.tune_malloc` (mmap threshold 32 MB,
  trim threshold 256 MB) keeps them in the heap: about 1.4x. Tensors above 32 MB (batches of
  eight 48^3 windows, or four 64^3 ones) are still mmapped: glibc caps that threshold there.
- batching: with a batch of one PyTorch sends the 3x3x3 convolutions at 6^3-24^3 to
  ``slow_conv3d`` (im2col + GEMM), from two on every convolution to oneDNN (torch.profiler),
  and instance norm parallelises over batch x channels: about 1.5-1.8x.
Measured together about 2.5x, not 3x. Tried and dropped, as they did not help here:
channels_last_3d (no gain), TorchScript freezing with optimize_for_inference (1.7x slower), bf16
autocast on this CPU (no bf16 units: 100x slower). On a GPU, batching and bf16 matter more: an
H200 (``--quick --batch-size 16 --shape 192,192,192``) gave 8.6x, with bf16 on both sides.

MONAI comparison (``monai_ratio``): MONAI's ``sliding_window_inference`` on the same model,
volume, window, overlap (0.5), Gaussian blending (sigma = window / 8), batch size, device and
precision. Both are timed from the same Zarr store to a float16 probability store, what ``ctseg
infer`` gives: ctseg's `infer_volume` (the volume one tile) and, for MONAI, the store read and
normalised by the same function, copied to the device, ``sliding_window_inference`` with a
sigmoid predictor, the result copied back and written as float16 with the same chunks. Both
run in one child, alternating, after one warm-up forward; the fastest of the rounds counts.
``monai_ratio`` = ctseg's voxels/s / MONAI's.

The two must agree: mean |dp| at most MEAN_ABS_TOLERANCE and masks (p > 0.5) differing on at
most MASK_TOLERANCE of the voxels, else the bench fails. For that check to mean anything MONAI
is given exactly ctseg's inputs: an axis shorter than the window is zero-padded at the far end
(MONAI would pad both sides, which shifts the content by a few voxels inside the window), and
the Gaussian map is ctseg's, passed as ``roi_weight_map`` and fetched inside the timed region
from the same per-process cache that ctseg uses (MONAI's own map is the same Gaussian, clamped
below at 1e-3). On the random-init model used here either difference alone moves the
probabilities a lot (a one-off check on 2 cores: MONAI's own map gave mean |dp| 0.025 and 2.7% of
masks on a 64x96x96 volume with a 48x64x64 window, its padding 0.17 and 20% on 64x56x56 with
40x64x64), because a random network's windows disagree near their borders and under shifts
that a trained one is robust to (an earlier measurement gave mean |dp| 0.0009 with MONAI's defaults
and a trained model). The window positions must be the same in both, and are checked first: MONAI
steps by window * (1 - overlap) and clamps its last window to the far face, ctseg spreads them
evenly; they coincide when the step divides evenly, hence z = 144 rather than 128, where MONAI's z
starts are 0, 36, 56 and ctseg's 0, 28, 56. The model's output head is rescaled so that about half
the voxels are foreground (a random-init U-Net puts nearly every voxel on one side of 0.5, which
would make the mask check vacuous).

Each measurement runs in a fresh child process; peak RSS is sampled over the child and all its
descendants, and time is measured inside the child, excluding start-up, imports and the model
load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from measure import run_child  # noqa: E402  (bench/measure.py, beside this script)

UNET = {"filters": [16, 32, 64, 128]}
CHUNKS = (64, 64, 64)
OVERLAP = 0.5
BATCH = 4
RSS_BUDGET_MB = 32
LOW, HIGH = 30.0, 220.0
# MONAI comparison (window, volume): exp001_full's window and a 128x128 plane (padded to the
# window in y and x), with z = 144, not 128, so that both place their windows alike (see
# monai_grid).
MONAI_GEOMETRY = ((72, 136, 136), (144, 128, 128))
MONAI_QUICK_GEOMETRY = ((48, 64, 64), (64, 96, 96))
MONAI_SMOKE_GEOMETRY = ((16, 16, 16), (24, 32, 32))
# (window, speed volume, RSS window, RSS plane, RSS depths, timed runs) of each size.
SIZES = {
    "full": ((64,) * 3, (128, 160, 160), (48,) * 3, 256, (160, 640), 3),
    "quick": ((48,) * 3, (72, 96, 96), (48,) * 3, 192, (96, 384), 2),
    "smoke": ((16,) * 3, (24, 32, 32), (16,) * 3, 32, (16, 64), 1),
}
# Same inputs, windows and weights: what remains is ctseg's float16 store (2^-12 at p ~ 0.5)
# and the order of float32 sums.
MEAN_ABS_TOLERANCE = 0.001  # mean |p_ctseg - p_monai|
MASK_TOLERANCE = 0.002  # fraction of voxels whose mask (p > 0.5) differs
HEAD_GAIN = 4.0  # logit scale of the rescaled output head (see the module docstring)
INSTALL_MONAI = ".venv/bin/pip install -e '.[bench]'"


# ---------------------------------------------------------------- volumes and weights
def make_store(path: Path, shape: tuple[int, int, int], seed: int = 0) -> Path:
    """A uint8 CT-like volume (smooth sheets plus noise) with the normalisation attributes."""
    from ctseg.store import create_volume

    rng = np.random.default_rng(seed)
    arr = create_volume(path, shape, np.uint8, CHUNKS, attributes={"p0_5": LOW, "p99_5": HIGH})
    yy, xx = np.mgrid[: shape[1], : shape[2]]
    for z0 in range(0, shape[0], CHUNKS[0]):
        z = np.arange(z0, min(z0 + CHUNKS[0], shape[0]))[:, None, None]
        sheets = 100 * np.sin((z + 0.3 * yy + 0.1 * xx) / 4.0) ** 8
        noise = rng.normal(0, 15, (len(z), *shape[1:]))
        arr[z0 : z0 + len(z)] = np.clip(80 + sheets + noise, 0, 255).astype(np.uint8)
    return path


def save_weights(path: Path, config: dict, window: tuple[int, int, int]) -> Path:
    """Random-init weights in the format train.py writes (last.pt)."""
    import torch

    from ctseg.network.model import build_model
    from ctseg.training.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = build_model(config)
    payload = {
        "model": model.state_dict(),
        "model_config": config,
        "patch_size": list(window),
        "fingerprint": "bench",
        "step": 0,
    }
    save_checkpoint(path, payload)  # as train.py writes last.pt: with its checksum
    return path


def decisive_weights(path: Path, config: dict, window, store: Path) -> Path:
    """Random-init weights whose output head is scaled by HEAD_GAIN and centred on the median
    logit of the volume's first window, so that about half the voxels are foreground."""
    import torch

    from ctseg.inference.blend import normalise
    from ctseg.network.model import build_model
    from ctseg.store import open_volume
    from ctseg.training.checkpoint import save_checkpoint
    from ctseg.training.distributed import pick_device

    torch.manual_seed(0)
    device = pick_device()  # exp001_full's model is slow on a CPU, even for one window
    model = build_model(config).eval().to(device)
    image = open_volume(store)
    crop = normalise(np.asarray(image[tuple(slice(0, w) for w in window)]), LOW, HIGH)
    head = model.heads[0]
    with torch.no_grad():
        head.weight.mul_(HEAD_GAIN)
        head.bias.zero_()
        head.bias.sub_(model(torch.from_numpy(crop)[None, None].to(device)).median())
    payload = {
        "model": model.cpu().state_dict(),
        "model_config": config,
        "patch_size": list(window),
        "fingerprint": "bench",
        "step": 0,
    }
    save_checkpoint(path, payload)  # as train.py writes last.pt: with its checksum
    return path


def pointwise_weights(path: Path) -> Path:
    """A 1x1x1 convolution, saved as a state dict."""
    import torch

    torch.manual_seed(0)
    torch.save(torch.nn.Conv3d(1, 1, 1).state_dict(), path)
    return path


def load(weights: str, device):
    import torch

    from ctseg.inference.run import load_model

    if weights.endswith(".pointwise.pt"):
        model = torch.nn.Conv3d(1, 1, 1)
        model.load_state_dict(torch.load(weights, weights_only=True))
        return model.to(device).eval()
    model, _ = load_model(Path(weights), device)
    return model


# ---------------------------------------------------------------- child-side measurements
def warm_up(model, window, batch: int, device) -> None:
    """oneDNN builds its kernels on the first call of each shape: not part of either method."""
    import torch

    with torch.inference_mode():
        model(torch.zeros(batch, 1, *window, device=device))


def child_stream(
    weights: str,
    store: str,
    dest: str,
    window: str,
    budget: str,
    batch: str = str(BATCH),
    device_budget: str = "",
) -> float:
    """`infer_volume` into a float16 store, with the product's settings but for those given:
    `device_budget` "0" cuts the volume in tiles under `budget`; empty keeps
    `InferenceSettings`' own device budget (one tile where the volume fits it, as `ctseg infer`
    runs)."""
    from ctseg.inference.run import infer_volume
    from ctseg.inference.settings import InferenceSettings
    from ctseg.training.distributed import pick_device

    device = pick_device()
    win = tuple(int(w) for w in window.split(","))
    given = {"device_budget_mb": float(device_budget)} if device_budget else {}
    settings = InferenceSettings(
        window=win,
        overlap=OVERLAP,
        batch_size=int(batch),
        device=str(device),
        memory_budget_mb=float(budget),
        **given,
    )
    model = load(weights, device)
    warm_up(model, win, int(batch), device)
    start = time.perf_counter()
    infer_volume(model, Path(store), Path(dest), settings)
    return time.perf_counter() - start


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def child_compare(
    weights: str, store: str, outdir: str, window: str, batch: str, rounds: str
) -> float:
    """ctseg's `infer_volume` and MONAI's `sliding_window_inference`, alternating; both from
    the Zarr store to a float16 store. Writes timings and both arrays to `outdir`."""
    import torch
    from monai.inferers import sliding_window_inference

    from ctseg.inference.blend import normalise
    from ctseg.inference.run import infer_volume
    from ctseg.inference.settings import InferenceSettings
    from ctseg.inference.windows import device_importance_map
    from ctseg.store import create_volume, open_volume
    from ctseg.training.distributed import pick_device

    device = pick_device()
    amp = InferenceSettings().use_amp(device)
    win = tuple(int(w) for w in window.split(","))
    model = load(weights, device)
    warm_up(model, win, int(batch), device)

    def predictor(x):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            return torch.sigmoid(model(x).float())

    def run_ctseg() -> tuple[np.ndarray, float]:
        dest = Path(outdir) / "ctseg.zarr"
        infer_volume(
            model, Path(store), dest, InferenceSettings(
                window=win, overlap=OVERLAP, batch_size=int(batch), device=str(device), amp=amp
            ),
        )  # fmt: skip
        return open_volume(dest), float("nan")

    def run_monai() -> tuple[np.ndarray, float]:
        image = open_volume(store)
        low, high = float(image.attrs["p0_5"]), float(image.attrs["p99_5"])
        shape = image.shape
        x = torch.from_numpy(normalise(np.asarray(image[...]), low, high))
        x = x[None, None].to(device)
        _synchronize(device)
        on_device = time.perf_counter()
        # The same input and weights as ctseg (module docstring): zero padding at the far end
        # of a short axis, and ctseg's Gaussian map in place of MONAI's clamped one.
        far = [max(w - s, 0) for s, w in zip(shape, win, strict=True)]
        x = torch.nn.functional.pad(x, (0, far[2], 0, far[1], 0, far[0]))
        weight = device_importance_map(win, device)  # cached as ctseg's is
        # The model in the layout ctseg's inference holds it in (channels_last_3d on CUDA), so
        # both run the same kernels: bf16 convolutions in another layout round differently.
        model.to(memory_format=InferenceSettings().memory_format(device))
        with torch.inference_mode():
            out = sliding_window_inference(
                x, win, int(batch), predictor, overlap=OVERLAP, mode="gaussian",
                roi_weight_map=weight,
            )  # fmt: skip
        probs = out[0, 0, : shape[0], : shape[1], : shape[2]].cpu().numpy()
        store_out = create_volume(Path(outdir) / "monai.zarr", shape, np.float16, image.chunks)
        store_out[...] = probs.astype(np.float16)
        return store_out, time.perf_counter() - on_device

    runs: dict[str, list[float]] = {"ctseg": [], "monai": [], "monai_from_device": []}
    methods = {"ctseg": run_ctseg, "monai": run_monai}
    arrays = {}
    for r in range(int(rounds)):
        # Alternate which goes first: a shared machine's load drifts.
        for name in ("ctseg", "monai") if r % 2 == 0 else ("monai", "ctseg"):
            _synchronize(device)
            start = time.perf_counter()
            arrays[name], inner = methods[name]()
            runs[name].append(time.perf_counter() - start)
            if name == "monai":
                runs["monai_from_device"].append(inner)
    for name, arr in arrays.items():
        np.save(Path(outdir) / f"{name}.npy", np.asarray(arr[...]))
    (Path(outdir) / "runs.json").write_text(json.dumps(runs))
    return min(runs["ctseg"])


def child_loop(weights: str, store: str, dest: str, window: str, tuned: str = "0") -> float:
    """The baseline: one window at a time into whole-volume arrays (see the module docstring).

    ``tuned="1"`` applies the allocator setting that `infer_volume` uses, to separate its share
    of the speedup from batching's.
    """
    import torch

    from ctseg.data.heap import tune_malloc
    from ctseg.inference.blend import normalise
    from ctseg.inference.settings import InferenceSettings
    from ctseg.inference.windows import gaussian_importance_map, window_starts
    from ctseg.store import create_volume, open_volume
    from ctseg.training.distributed import pick_device

    if tuned == "1":
        tune_malloc()
    device = pick_device()
    amp = InferenceSettings().use_amp(device)
    win = tuple(int(w) for w in window.split(","))
    model = load(weights, device)
    warm_up(model, win, 1, device)
    start = time.perf_counter()
    image = open_volume(store)
    low, high = float(image.attrs["p0_5"]), float(image.attrs["p99_5"])
    shape = image.shape
    g = gaussian_importance_map(win)
    weighted = np.zeros(shape, np.float32)
    weights_sum = np.zeros(shape, np.float32)
    starts = [window_starts(s, w, OVERLAP) for s, w in zip(shape, win, strict=True)]
    with torch.inference_mode():
        for z in starts[0]:
            for y in starts[1]:
                for x in starts[2]:
                    box = tuple(
                        slice(o, min(o + w, s))
                        for o, w, s in zip((z, y, x), win, shape, strict=True)
                    )
                    size = tuple(b.stop - b.start for b in box)
                    crop = np.zeros(win, np.float32)
                    crop[: size[0], : size[1], : size[2]] = normalise(image[box], low, high)
                    inp = torch.from_numpy(crop)[None, None].to(device)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                        logits = model(inp)
                    p = torch.sigmoid(logits.float())[0, 0].cpu().numpy()
                    local = tuple(slice(0, n) for n in size)
                    weighted[box] += (p * g)[local]
                    weights_sum[box] += g[local]
    out = create_volume(dest, shape, np.float16, image.chunks)
    out[...] = (weighted / weights_sum).astype(np.float16)
    return time.perf_counter() - start


CHILDREN = {"stream": child_stream, "loop": child_loop, "compare": child_compare}


# ---------------------------------------------------------------- parent-side driver
def measure(mode: str, *args: str, repeat: int = 1) -> dict:
    """Run one measurement in a child; return its seconds (the fastest of `repeat` runs: the
    machine may be shared) and the peak RSS of its process tree."""
    command = [sys.executable, __file__, "--repeat", str(repeat), "--child", mode, *args]
    return run_child(command, mode)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} cores (torch threads {torch.get_num_threads()}), {gpu}; "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def max_difference(a: Path, b: Path) -> float:
    from ctseg.store import open_volume

    x, y = open_volume(a), open_volume(b)
    return float(max(np.abs(x[z : z + 64].astype(np.float32) - y[z : z + 64]).max()
                     for z in range(0, x.shape[0], 64)))  # fmt: skip


def speed(
    workdir: Path,
    window: tuple[int, int, int],
    shape: tuple[int, int, int],
    batch: int,
    repeat: int,
) -> float:
    from ctseg.inference.windows import window_starts

    store = make_store(workdir / "speed.zarr", shape)
    weights = save_weights(workdir / "unet.pt", UNET, window)
    win = ",".join(map(str, window))
    ours = measure(
        "stream", str(weights), str(store), str(workdir / "s.zarr"), win, "512", str(batch),
        repeat=repeat,
    )  # fmt: skip
    loop = measure("loop", str(weights), str(store), str(workdir / "l.zarr"), win, repeat=repeat)
    tuned = measure("loop", str(weights), str(store), str(workdir / "t.zarr"), win, "1")
    n = math.prod(len(window_starts(s, w, OVERLAP)) for s, w in zip(shape, window, strict=True))
    voxels = math.prod(shape)
    print(
        f"\nspeed: U-Net filters {UNET['filters']}, window {window[0]}^3, overlap {OVERLAP}, "
        f"volume {'x'.join(map(str, shape))} uint8, {n} windows; fastest of {repeat} runs"
    )
    print(f"  {'method':<30}{'seconds':>9}{'voxels/s':>12}{'peak RSS MB':>14}")
    rows = [
        (f"one tile, batch {batch}", ours),
        ("loop, batch 1", loop),
        ("loop + tuned malloc (1 run)", tuned),
    ]
    for name, m in rows:
        print(f"  {name:<30}{m['seconds']:9.3g}{voxels / m['seconds']:12.0f}{m['rss_mb']:14.0f}")
    diff = max_difference(workdir / "s.zarr", workdir / "l.zarr")
    print(f"  max |one tile - loop| probability: {diff:.4f} (float16 storage)")
    return loop["seconds"] / ours["seconds"]


def rss(workdir: Path, window: tuple[int, int, int], plane: int, depths: tuple[int, int]) -> float:
    weights = pointwise_weights(workdir / "conv.pointwise.pt")
    win = ",".join(map(str, window))
    print(
        f"\npeak RSS (MB), 1x1x1-conv model, window {window[0]}^3, budget {RSS_BUDGET_MB} MB, "
        f"planes {plane}x{plane}"
    )
    print(f"  {'z':>5}{'float32 volume':>16}{'in tiles':>11}{'loop':>8}")
    peaks = {}
    for depth in depths:
        store = make_store(workdir / f"rss{depth}.zarr", (depth, plane, plane), seed=depth)
        ours = measure(
            "stream",
            str(weights),
            str(store),
            str(workdir / f"rs{depth}.zarr"),
            win,
            str(RSS_BUDGET_MB),
            str(BATCH),
            "0",  # in tiles: the bounded memory is what this measures
        )
        loop = measure("loop", str(weights), str(store), str(workdir / f"rl{depth}.zarr"), win)
        peaks[depth] = ours["rss_mb"]
        f32 = 4 * depth * plane * plane / 2**20
        print(f"  {depth:5d}{f32:16.1f}{ours['rss_mb']:11.0f}{loop['rss_mb']:8.0f}")
    return peaks[depths[1]] / peaks[depths[0]]


def full_model_config() -> dict:
    """exp001_full's model (filters 32-512, deep supervision: one head in eval mode)."""
    import yaml

    experiment = yaml.safe_load((REPO / "config/experiments/exp001_full.yaml").read_text())
    return dict(experiment["model"])


def monai_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("monai") is not None


def monai_grid(shape, window) -> list[tuple[int, ...]]:
    """The window corners MONAI uses on the volume padded at the far end, as it reports them
    to a ``with_coord`` predictor (no model: an identity on zeros)."""
    import torch
    from monai.inferers import sliding_window_inference

    padded = [max(s, w) for s, w in zip(shape, window, strict=True)]
    seen: set[tuple[int, ...]] = set()

    def record(x, slices):
        seen.update(tuple(int(s.start) for s in box[2:]) for box in slices)
        return x

    with torch.inference_mode():
        sliding_window_inference(
            torch.zeros(1, 1, *padded), window, 64, record, overlap=OVERLAP, with_coord=True
        )
    return sorted(seen)


def check_same_grid(shape, window) -> None:
    """The agreement check compares implementations only where both use the same windows."""
    import itertools

    from ctseg.inference.windows import window_starts

    ours = [window_starts(s, w, OVERLAP) for s, w in zip(shape, window, strict=True)]
    theirs = monai_grid(shape, window)
    if sorted(itertools.product(*ours)) != theirs:
        axes = [sorted({c[a] for c in theirs}) for a in range(3)]
        raise SystemExit(
            f"bench/infer.py: on {'x'.join(map(str, shape))} with window "
            f"{'x'.join(map(str, window))} MONAI places its windows at {axes}, ctseg at {ours} "
            "(MONAI steps by window * (1 - overlap) and clamps the last window; ctseg spreads "
            "them evenly), so the agreement check would compare window grids, not "
            "implementations: choose a size where (size - window) is a multiple of the step"
        )


def agreement(ours: np.ndarray, theirs: np.ndarray) -> dict:
    diff = np.abs(ours.astype(np.float32) - theirs.astype(np.float32))
    mask_ours, mask_theirs = ours > 0.5, theirs > 0.5
    differ = int(np.count_nonzero(mask_ours != mask_theirs))
    union = int(np.count_nonzero(mask_ours | mask_theirs))
    return {
        "mean_abs": float(diff.mean()),
        "max_abs": float(diff.max()),
        "mask_differ": differ / ours.size,
        "mask_differ_of_union": differ / max(union, 1),
        "foreground": float(mask_theirs.mean()),
    }


def monai(
    workdir: Path,
    window: tuple[int, int, int],
    shape: tuple[int, int, int],
    batch: int,
    rounds: int,
    full_model: bool,
    pointwise: bool = False,
) -> float:
    """ctseg's voxels/s / MONAI's, after checking that the two agree (module docstring)."""
    from ctseg.inference.windows import window_starts

    check_same_grid(shape, window)
    config = full_model_config() if full_model else UNET
    store = make_store(workdir / "monai.zarr", shape, seed=1)
    if pointwise:
        weights = pointwise_weights(workdir / "conv.pointwise.pt")
    else:
        weights = decisive_weights(workdir / "decisive.pt", config, window, store)
    out = workdir / "compare"
    out.mkdir()
    win = ",".join(map(str, window))
    child = measure("compare", str(weights), str(store), str(out), win, str(batch), str(rounds))
    runs = json.loads((out / "runs.json").read_text())
    n = math.prod(len(window_starts(s, w, OVERLAP)) for s, w in zip(shape, window, strict=True))
    voxels = math.prod(shape)
    model = f"U-Net filters {config['filters']}" + (" (exp001_full)" if full_model else "")
    if pointwise:
        model = "1x1x1 conv (everything but the forward)"
    print(
        f"\nMONAI: {model}, window {'x'.join(map(str, window))}, overlap {OVERLAP}, "
        f"Gaussian, batch {batch}, volume {'x'.join(map(str, shape))} uint8, {n} windows; "
        f"fastest of {rounds} alternating rounds, Zarr store to float16 store; child peak RSS "
        f"{child['rss_mb']:.0f} MB"
    )
    print(f"  {'method':<44}{'seconds':>9}{'voxels/s':>12}  runs")
    rows = [
        ("ctseg infer_volume (one tile)", runs["ctseg"]),
        ("MONAI sliding_window_inference", runs["monai"]),
        ("  of which MONAI from a device tensor", runs["monai_from_device"]),
    ]
    for name, times in rows:
        best = min(times)
        listed = ", ".join(f"{t:.3f}" for t in times)
        print(f"  {name:<44}{best:9.3f}{voxels / best:12.0f}  {listed}")
    agree = agreement(np.load(out / "ctseg.npy"), np.load(out / "monai.npy"))
    print(
        f"  agreement: mean |dp| {agree['mean_abs']:.5f} (max {agree['max_abs']:.4f}); masks "
        f"(p > 0.5) differ on {100 * agree['mask_differ']:.3f}% of voxels "
        f"({100 * agree['mask_differ_of_union']:.3f}% of their union; MONAI foreground "
        f"{100 * agree['foreground']:.1f}%); tolerance mean |dp| <= {MEAN_ABS_TOLERANCE}, "
        f"masks <= {100 * MASK_TOLERANCE:.1f}%"
    )
    if agree["mean_abs"] > MEAN_ABS_TOLERANCE or agree["mask_differ"] > MASK_TOLERANCE:
        raise SystemExit(
            f"bench/infer.py: ctseg and MONAI disagree beyond tolerance: mean |dp| "
            f"{agree['mean_abs']:.5f} (tolerance {MEAN_ABS_TOLERANCE}), masks differ on "
            f"{100 * agree['mask_differ']:.3f}% of voxels (tolerance {100 * MASK_TOLERANCE}%)"
        )
    return min(runs["monai"]) / min(runs["ctseg"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller window and volumes; < 2 min")
    size.add_argument(
        "--smoke", action="store_true", help="toy window and volumes: every path in seconds (CI)"
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--batch-size", type=int, default=BATCH, help="windows per forward")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per method (min)")
    parser.add_argument("--shape", default=None, help="speed volume Z,Y,X (a GPU wants more)")
    parser.add_argument("--skip-monai", action="store_true", help="no MONAI comparison")
    parser.add_argument("--monai-only", action="store_true", help="only the MONAI comparison")
    parser.add_argument(
        "--full-model", action="store_true", help="MONAI comparison with exp001_full's model"
    )
    parser.add_argument("--monai-shape", default=None, help="MONAI comparison volume Z,Y,X")
    parser.add_argument(
        "--monai-window",
        default=None,
        help="MONAI comparison window Z,Y,X (both must place their windows alike: "
        "(size - window) a multiple of window / 2 on every axis)",
    )
    parser.add_argument(
        "--pointwise",
        action="store_true",
        help="MONAI comparison with a 1x1x1 conv: times the machinery around the forward",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        mode, *rest = args.child
        times = [CHILDREN[mode](*rest) for _ in range(args.repeat)]
        print(json.dumps({"seconds": min(times)}))
        return

    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    window, shape, rss_window, plane, depths, repeat = SIZES[size]
    repeat = args.repeat or repeat
    if args.shape:
        shape = tuple(int(v) for v in args.shape.split(","))
    monai_window, monai_shape = {
        "smoke": MONAI_SMOKE_GEOMETRY,
        "quick": MONAI_QUICK_GEOMETRY,
        "full": MONAI_GEOMETRY,
    }[size]
    if args.monai_shape:
        monai_shape = tuple(int(v) for v in args.monai_shape.split(","))
    if args.monai_window:
        monai_window = tuple(int(v) for v in args.monai_window.split(","))
    if args.skip_monai and args.monai_only:
        raise SystemExit("bench/infer.py: --skip-monai and --monai-only exclude each other")
    if not args.skip_monai and not monai_installed():
        raise SystemExit(
            "bench/infer.py: the MONAI comparison needs MONAI, a bench-only extra: install it "
            f"with `{INSTALL_MONAI}` (or pass --skip-monai)"
        )
    print(f"machine: {machine()}")
    figures = []
    if args.workdir is not None:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        if not args.monai_only:
            speedup = speed(Path(tmp), window, shape, args.batch_size, repeat)
            growth = rss(Path(tmp), rss_window, plane, depths)
            figures += [f"speedup_vs_loop={speedup:.3g}", f"rss_growth={growth:.3g}"]
        if not args.skip_monai:
            ratio = monai(
                Path(tmp), monai_window, monai_shape, args.batch_size, max(repeat, 2),
                args.full_model, args.pointwise,
            )  # fmt: skip
            figures.append(f"monai_ratio={ratio:.3g}")
    print(f"\nRESULT infer {' '.join(figures)}")


if __name__ == "__main__":
    main()
