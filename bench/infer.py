"""Inference benchmark: batched, blended, streaming inference against a one-window loop, same run.

    python bench/infer.py            # window 64^3 on 128x160x160; RSS at z = 160 and 640
    python bench/infer.py --quick    # window 48^3 on 72x96x96;    RSS at z = 96 and 384

Figures:
- voxels/s of `ctseg.infer.infer_volume` (batch 4 by default, Gaussian blending, z-slab
  streaming to a float16 Zarr store) against the baseline below, on the same U-Net (filters
  16-32-64-128, instance norm: a realistic width for a CPU, so the forward dominates) and the
  same volume. Both use the same window positions, Gaussian map, device and precision (bf16
  autocast on CUDA, fp32 on a CPU), and both run one warm-up forward at their batch size first;
  the table shows the largest difference between the two probability volumes as a check that
  they compute the same thing. A third row runs the baseline with the allocator setting that
  `infer_volume` makes, to split the speedup into its two parts.
- peak RSS of the streaming inference at two volume depths (z grows 4x), with a 32 MB budget:
  bounded memory shows as a flat line. The loop baseline is measured beside it. These runs use a
  1x1x1 convolution in place of the U-Net so that volumes big enough for volume-sized buffers
  to show run in seconds; a U-Net's activations depend on the window batch only, and the speed
  runs show their RSS.

The baseline ("loop") is a plain, reasonable implementation, not a strawman: for every window
it reads the window from the Zarr store (zero-padded where it overhangs), normalises it, runs
the model on a batch of one under torch.inference_mode, applies the sigmoid and the Gaussian
map (computed once, not per window), and adds p * g and g into two whole-volume float32 arrays;
at the end it divides and writes the float16 store. What it lacks: batching windows, reading
each input slab once, the bounded accumulator and the allocator setting.

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
RSS_WINDOW = (48, 48, 48)
LOW, HIGH = 30.0, 220.0


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

    from ctseg.model import build_model

    torch.manual_seed(0)
    model = build_model(config)
    payload = {
        "model": model.state_dict(),
        "model_config": config,
        "patch_size": list(window),
        "fingerprint": "bench",
        "step": 0,
    }
    torch.save(payload, path)
    return path


def pointwise_weights(path: Path) -> Path:
    """A 1x1x1 convolution, saved as a state dict."""
    import torch

    torch.manual_seed(0)
    torch.save(torch.nn.Conv3d(1, 1, 1).state_dict(), path)
    return path


def load(weights: str, device):
    import torch

    from ctseg import infer

    if weights.endswith(".pointwise.pt"):
        model = torch.nn.Conv3d(1, 1, 1)
        model.load_state_dict(torch.load(weights, weights_only=True))
        return model.to(device).eval()
    model, _ = infer.load_model(Path(weights), device)
    return model


# ---------------------------------------------------------------- child-side measurements
def warm_up(model, window, batch: int, device) -> None:
    """oneDNN builds its kernels on the first call of each shape: not part of either method."""
    import torch

    with torch.inference_mode():
        model(torch.zeros(batch, 1, *window, device=device))


def child_stream(
    weights: str, store: str, dest: str, window: str, budget: str, batch: str = str(BATCH)
) -> float:
    from ctseg import infer

    device = infer.pick_device()
    win = tuple(int(w) for w in window.split(","))
    model = load(weights, device)
    warm_up(model, win, int(batch), device)
    start = time.perf_counter()
    infer.infer_volume(
        model,
        Path(store),
        Path(dest),
        window=win,
        overlap=OVERLAP,
        batch_size=int(batch),
        device=device,
        memory_budget_mb=float(budget),
    )
    return time.perf_counter() - start


def child_loop(weights: str, store: str, dest: str, window: str, tuned: str = "0") -> float:
    """The baseline: one window at a time into whole-volume arrays (see the module docstring).

    ``tuned="1"`` applies the allocator setting that `infer_volume` uses, to separate its share
    of the speedup from batching's.
    """
    import torch

    from ctseg import infer
    from ctseg.data import tune_malloc
    from ctseg.store import create_volume, open_volume

    if tuned == "1":
        tune_malloc()
    device = infer.pick_device()
    amp = infer.resolve_amp(None, device)
    win = tuple(int(w) for w in window.split(","))
    model = load(weights, device)
    warm_up(model, win, 1, device)
    start = time.perf_counter()
    image = open_volume(store)
    low, high = float(image.attrs["p0_5"]), float(image.attrs["p99_5"])
    shape = image.shape
    g = infer.gaussian_importance_map(win)
    weighted = np.zeros(shape, np.float32)
    weights_sum = np.zeros(shape, np.float32)
    starts = [infer.window_starts(s, w, OVERLAP) for s, w in zip(shape, win, strict=True)]
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
                    crop[: size[0], : size[1], : size[2]] = infer.normalise(image[box], low, high)
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


CHILDREN = {"stream": child_stream, "loop": child_loop}


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
    from ctseg import infer

    store = make_store(workdir / "speed.zarr", shape)
    weights = save_weights(workdir / "unet.pt", UNET, window)
    win = ",".join(map(str, window))
    ours = measure(
        "stream", str(weights), str(store), str(workdir / "s.zarr"), win, "512", str(batch),
        repeat=repeat,
    )  # fmt: skip
    loop = measure("loop", str(weights), str(store), str(workdir / "l.zarr"), win, repeat=repeat)
    # Informational (not in the RESULT), so timed once.
    tuned = measure("loop", str(weights), str(store), str(workdir / "t.zarr"), win, "1")
    n = math.prod(
        len(infer.window_starts(s, w, OVERLAP)) for s, w in zip(shape, window, strict=True)
    )
    voxels = math.prod(shape)
    print(
        f"\nspeed: U-Net filters {UNET['filters']}, window {window[0]}^3, overlap {OVERLAP}, "
        f"volume {'x'.join(map(str, shape))} uint8, {n} windows; fastest of {repeat} runs"
    )
    print(f"  {'method':<28}{'seconds':>9}{'voxels/s':>12}{'peak RSS MB':>14}")
    rows = [
        (f"streaming, batch {batch}", ours),
        ("loop, batch 1", loop),
        ("loop + tuned malloc (1 run)", tuned),
    ]
    for name, m in rows:
        print(f"  {name:<28}{m['seconds']:9.1f}{voxels / m['seconds']:12.0f}{m['rss_mb']:14.0f}")
    diff = max_difference(workdir / "s.zarr", workdir / "l.zarr")
    print(f"  max |streaming - loop| probability: {diff:.4f} (float16 storage)")
    return loop["seconds"] / ours["seconds"]


def rss(workdir: Path, plane: int, depths: tuple[int, int]) -> float:
    weights = pointwise_weights(workdir / "conv.pointwise.pt")
    win = ",".join(map(str, RSS_WINDOW))
    print(
        f"\npeak RSS (MB), 1x1x1-conv model, window {RSS_WINDOW[0]}^3, budget {RSS_BUDGET_MB} MB, "
        f"planes {plane}x{plane}"
    )
    print(f"  {'z':>5}{'float32 volume':>16}{'streaming':>11}{'loop':>8}")
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
        )
        loop = measure("loop", str(weights), str(store), str(workdir / f"rl{depth}.zarr"), win)
        peaks[depth] = ours["rss_mb"]
        f32 = 4 * depth * plane * plane / 2**20
        print(f"  {depth:5d}{f32:16.1f}{ours['rss_mb']:11.0f}{loop['rss_mb']:8.0f}")
    return peaks[depths[1]] / peaks[depths[0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller window and volumes; < 2 min")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--batch-size", type=int, default=BATCH, help="windows per forward")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per method (min)")
    parser.add_argument("--shape", default=None, help="speed volume Z,Y,X (a GPU wants more)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        mode, *rest = args.child
        times = [CHILDREN[mode](*rest) for _ in range(args.repeat)]
        print(json.dumps({"seconds": min(times)}))
        return

    if args.quick:
        window, shape, plane, depths, repeat = (48,) * 3, (72, 96, 96), 192, (96, 384), 2
    else:
        window, shape, plane, depths, repeat = (64,) * 3, (128, 160, 160), 256, (160, 640), 3
    repeat = args.repeat or repeat
    if args.shape:
        shape = tuple(int(v) for v in args.shape.split(","))
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        speedup = speed(Path(tmp), window, shape, args.batch_size, repeat)
        growth = rss(Path(tmp), plane, depths)
    print(f"\nRESULT infer speedup_vs_loop={speedup:.2f} rss_growth={growth:.2f}")


if __name__ == "__main__":
    main()
