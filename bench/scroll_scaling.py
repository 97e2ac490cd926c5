"""Scaling of a whole-volume predict over parts: what the pipeline itself costs, process by
process, as the volume grows (`python bench/scroll.py --scaling`, or this file).

    python bench/scroll_scaling.py                      # z 64 and 192 (x 96 x 96); 1, 4, 16 parts
    python bench/scroll_scaling.py --z 32 64 --parts 1 4   # ~1 min: a smoke run

For each volume (uint8, no recorded intensity range, chunks of 16) and each part count N, the
predict runs as jobs, each its own `ctseg predict` process, one after another: N statistics
jobs (`--parts N --statistics K`), N parts (`--part K`), then for each post-processing round
the first part's summary lists, N range jobs (`--post ROUND --part K`) and, for a component
round, its merge (`--post ROUND`), then one finish (`--finish`). The post-processing needs the
whole volume (hysteresis, the component filter, hole filling, a closing). The network is a
cheap one (a two-level U-Net of 4 and 8 filters, window 16): the pipeline's own work shows.
Each process's wall seconds are timed here; its bytes come from its `--summary`
(`statistics_bytes_read`, and `bytes_read` / `bytes_written`: /proc/self/io over the predict).

It prints a table per volume and

    RESULT scroll_scaling stats_reads=<x> serial_fraction=<x> projected_hours=<x>
        masks_identical=<bool> ... finish_hours=<x> parts=<N> z=<Z>   (one line)

* ``stats_reads``: the volume's reads for statistics, summed over every process of the largest
  volume at the most parts (1.0: read once);
* ``serial_fraction``: the bytes the serial steps (the merges and the finish) read and wrote,
  over the volume's probability bytes (float16, 2 a voxel), at the most parts, as the slope
  between the smallest and the largest volume: what grows with the volume (a process's
  constant start-up, the weights and modules it reads, does not; ``serial_mb`` gives the
  largest volume's raw figure);
* ``projected_hours``: a 10^12-voxel volume on ``--gpus`` GPUs (8) at ``--gpu-rate`` voxels/s
  per GPU (36 M: exp001_full's model on one H200, BENCHMARKS.md), from the per-voxel costs
  measured here as slopes between the smallest and the largest volume (the processes' start-up
  cancels out; the statistics', the parts' and the post jobs' from the 1-part runs, the serial
  steps' at the most parts): the statistics jobs, the parts' own work (the cheap network's CPU
  forwards included: an upper bound of a part's host work) and the post jobs spread over as
  many nodes as GPUs, the real network at the GPU rate, the merges and the finish serial
  (``statistics_hours``, ``parts_hours``, ``post_hours``, ``merge_hours``, ``finish_hours``);
* ``masks_identical``: every part count's mask equals the 1-part mask, bit for bit, for every
  volume.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BIN = Path(sys.executable).parent
WINDOW = 16
CHUNK = 16
YX = 96
BUDGET_MB = 8  # a few tiles per part at these sizes
VOXELS = 1e12  # a scroll (PHerc. Paris 4 at 7.91 um is about 0.9e12)
COMPONENT_ROUNDS = ("binarise", "filter", "fill")  # the rounds with a merge
POSTPROCESS = ["--threshold", "0.4", "--hysteresis-high", "0.6", "--min-component-voxels",
               "16", "--fill-holes", "--closing-radius", "1"]  # fmt: skip


def make_run(run_dir: Path) -> Path:
    """A trained run's last.pt of the cheap network, its head scaled and centred so that the
    mask is neither empty nor full."""
    import torch

    from ctseg.network.model import build_model
    from ctseg.training.checkpoint import save_checkpoint

    torch.manual_seed(0)
    config = {"filters": [4, 8]}
    model = build_model(config).eval()
    with torch.no_grad():
        model.heads[0].weight.mul_(8)
        model.heads[0].bias.zero_()
        model.heads[0].bias.sub_(model(torch.rand(1, 1, WINDOW, WINDOW, WINDOW)).median())
    payload = {"model": model.state_dict(), "model_config": config,
               "patch_size": [WINDOW] * 3, "fingerprint": "0" * 16, "step": 1}  # fmt: skip
    save_checkpoint(run_dir / "last.pt", payload)
    return run_dir


def make_volume(path: Path, z: int, seed: int = 0) -> Path:
    """Noise over sheets along z, as the tests' volumes, without a recorded intensity range."""
    from ctseg.store import create_volume

    rng = np.random.default_rng(seed)
    zz = np.arange(z)[:, None, None]
    data = rng.integers(0, 256, size=(z, YX, YX)) * 0.5 + 90 * np.sin(zz / 4) + 60
    create_volume(path, data.shape, np.uint8, (CHUNK,) * 3)[...] = np.clip(data, 0, 255).astype(
        np.uint8
    )
    return path


def ctseg(args: list, summary: Path) -> tuple[float, dict]:
    """One `ctseg predict` process (one torch thread: each process the same steady share of a
    small machine): its wall seconds and its summary."""
    t0 = time.perf_counter()
    done = subprocess.run([str(BIN / "ctseg"), "predict", *map(str, args), "--summary",
                           str(summary)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"bench/scroll_scaling.py: ctseg predict failed:\n{done.stderr[-3000:]}")
    return seconds, json.loads(summary.read_text())


def predict_in_parts(run: Path, volume: Path, parts: int, out: Path) -> dict:
    """The workflow's jobs of one predict, one process each; per kind of job: seconds, bytes
    read for statistics, bytes read and written."""
    common = ["--run", run, "-i", volume, "-o", out, "--memory-budget-mb", BUDGET_MB,
              "--parts", parts, "--overwrite", *POSTPROCESS]  # fmt: skip
    jobs = [("statistics", ["--statistics", k]) for k in range(parts)]
    jobs += [("part", ["--part", k]) for k in range(parts)]
    figures: dict[str, dict[str, float]] = {}
    while jobs:
        kind, extra = jobs.pop(0)
        seconds, summary = ctseg([*common, *extra], out.with_suffix(f".{kind}.json"))
        if extra == ["--part", 0]:  # the post-processing's rounds, then the finish
            for name in summary["post_rounds"]:
                jobs += [("post", ["--post", name, "--part", k]) for k in range(parts)]
                if name in COMPONENT_ROUNDS:
                    jobs += [("merge", ["--post", name])]
            jobs += [("finish", ["--finish"])]
        fields = ("processes", "seconds", "stats_bytes", "bytes_read", "bytes_written")
        row = figures.setdefault(kind, dict.fromkeys(fields, 0.0))
        row["processes"] += 1
        row["seconds"] += seconds
        row["stats_bytes"] += summary["statistics_bytes_read"]
        row["bytes_read"] += summary["bytes_read"] or 0
        row["bytes_written"] += summary["bytes_written"] or 0
    return figures


def read_mask(path: Path) -> np.ndarray:
    import zarr

    return np.asarray(zarr.open_group(str(path), mode="r")["0"][...])


def slope(figures: dict, kind: str, small: int, large: int, voxels: dict) -> float:
    """Seconds per voxel of one kind of job, summed over its processes: the slope between the
    smallest and the largest volume."""
    return (figures[large][kind]["seconds"] - figures[small][kind]["seconds"]) / (
        voxels[large] - voxels[small]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--z", type=int, nargs="+", default=[64, 192], help="volume depths")
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 4, 16], help="part counts")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the projection (8)")
    parser.add_argument("--gpu-rate", type=float, default=36e6,
                        help="voxels/s of the real network per GPU (36e6)")  # fmt: skip
    args = parser.parse_args(argv)
    if 1 not in args.parts or len(args.z) < 2:
        raise SystemExit("bench/scroll_scaling.py: needs --parts with 1 and two --z or more")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} "
          f"cores; Python {platform.python_version()}; volumes z x {YX} x {YX}, chunks {CHUNK}, "
          f"budget {BUDGET_MB} MB, post-processing {' '.join(POSTPROCESS)}")  # fmt: skip
    started = time.perf_counter()
    identical = True
    figures: dict[int, dict[int, dict]] = {}
    voxels = {z: z * YX * YX for z in args.z}
    with tempfile.TemporaryDirectory(prefix="ctseg-bench-scaling-") as tmp:
        run = make_run(Path(tmp) / "run")
        for z in args.z:
            volume = make_volume(Path(tmp) / f"v{z}.zarr", z)
            reference = None
            for parts in sorted(args.parts):
                out = Path(tmp) / f"m{z}-{parts}.zarr"
                figures.setdefault(parts, {})[z] = predict_in_parts(run, volume, parts, out)
                mask = read_mask(out)
                reference = mask if reference is None else reference
                identical &= bool(np.array_equal(mask, reference))
                shutil.rmtree(out)
                rows = figures[parts][z]
                print(f"\nz {z} ({voxels[z]} voxels), {parts} part(s):")
                print(f"  {'job':<11}{'procs':>6}{'seconds':>9}{'stats MB':>10}"
                      f"{'read MB':>9}{'written MB':>11}")  # fmt: skip
                for kind, r in rows.items():
                    print(f"  {kind:<11}{r['processes']:>6.0f}{r['seconds']:>9.1f}"
                          f"{r['stats_bytes'] / 1e6:>10.2f}{r['bytes_read'] / 1e6:>9.2f}"
                          f"{r['bytes_written'] / 1e6:>11.2f}")  # fmt: skip
    most, small, large = max(args.parts), min(args.z), max(args.z)
    at = figures[most][large]
    stats_reads = sum(r["stats_bytes"] for r in at.values()) / voxels[large]
    serial_kinds = [kind for kind in ("merge", "finish") if kind in at]

    def serial_bytes(z: int) -> float:
        return sum(
            figures[most][z][k]["bytes_read"] + figures[most][z][k]["bytes_written"]
            for k in serial_kinds
        )

    # What the serial steps move per byte of probabilities as the volume grows: their constant
    # start-up (the weights, metadata, the modules a process imports late) does not grow with a
    # scroll, and at these sizes it would hide what does.
    serial = (serial_bytes(large) - serial_bytes(small)) / (2 * (voxels[large] - voxels[small]))
    # The statistics', the parts' and the post jobs' work per voxel from one process each (the
    # least start-up noise: the work itself does not change with the split); the serial
    # steps' (the merges, the finish) at the most parts.
    per_voxel = {kind: slope(figures[1], kind, small, large, voxels) for kind in at}
    for kind in serial_kinds:
        per_voxel[kind] = slope(figures[most], kind, small, large, voxels)
    hours = {
        "statistics": per_voxel["statistics"] * VOXELS / args.gpus / 3600,
        "parts": (VOXELS / (args.gpus * args.gpu_rate) + per_voxel["part"] * VOXELS / args.gpus)
        / 3600,
        "post": per_voxel["post"] * VOXELS / args.gpus / 3600,
        **{kind: max(0.0, per_voxel[kind]) * VOXELS / 3600 for kind in serial_kinds},
    }
    print(f"\nprojected for {VOXELS:.0e} voxels on {args.gpus} GPUs at {args.gpu_rate:.3g} "
          "voxels/s each (per-voxel seconds from the slope z "
          f"{small} -> {large}: 1 part's statistics and part, {most} parts' finish): " + ", ".join(
              f"{k} {h:.2f} h" for k, h in hours.items()))  # fmt: skip
    print(
        f"RESULT scroll_scaling stats_reads={stats_reads:.3f} serial_fraction={serial:.3f} "
        f"serial_mb={serial_bytes(large) / 1e6:.2f} "
        f"projected_hours={sum(hours.values()):.2f} masks_identical={identical} "
        f"statistics_hours={hours['statistics']:.2f} parts_hours={hours['parts']:.2f} "
        f"post_hours={hours['post']:.2f} merge_hours={hours.get('merge', 0.0):.2f} "
        f"finish_hours={hours['finish']:.2f} parts={most} z={large}"
    )
    print(f"(whole run {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
