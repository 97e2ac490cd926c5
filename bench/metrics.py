"""Evaluation speed: exact TopoScore (Betti matching) at 128^3 and 320^3, and `evaluate`'s
speedup from scoring volumes in parallel.

The data are the demo generator's volumes: its label, and as the prediction a thresholded,
smoothed copy of its noisy image (fragments, speckle and holes, like a weak model's output).

1. TopoScore: `topo_counts` with the exact method and with the count bound (the baseline,
   min(p_k, g_k)) on one pair per size, in this process after a warm-up that compiles numba's
   kernels (they are cached on disk after the first run anyway).
2. evaluate: `evaluate_pairs` on the same TIFF pairs with 1 worker and with --workers (default:
   every core), in the same run; the outputs must be identical.

Run: python bench/metrics.py [--sizes 128 320] [--volumes 4] [--eval-size 192] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import tifffile
from scipy import ndimage

from ctseg.demo_data import synthesize_volume
from ctseg.metrics import evaluate_pairs, prepare_masks, topo_counts, topo_score_from_counts


def make_pair(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(prediction uint8 0/1, label uint8 0/1/2) of shape size^3."""
    volume = synthesize_volume((size, size, size), np.random.default_rng(seed))
    smooth = ndimage.gaussian_filter(volume.image.astype(np.float32), 1.0)
    return (smooth > 125).astype(np.uint8), volume.label


def time_topo(size: int) -> dict:
    pred, label = make_pair(size, seed=size)
    pred_bin, gt_bin = prepare_masks(pred, label)
    row: dict = {"size": size}
    for method in ("betti_counts", "betti_matching"):
        start = time.perf_counter()
        counts, _ = topo_counts(pred_bin, gt_bin, method)
        row[f"{method}_s"] = time.perf_counter() - start
        row[f"{method}_topo"] = topo_score_from_counts(counts)[0]
        row[f"{method}_m"] = counts[:, 0].tolist()
    row["p"], row["g"] = counts[:, 1].tolist(), counts[:, 2].tolist()
    return row


def time_evaluate(workdir: Path, volumes: int, size: int, workers: int) -> dict:
    predictions, labels = [], []
    for i in range(volumes):
        pred, label = make_pair(size, seed=1000 + i)
        predictions.append(workdir / f"vol{i}.tif")
        labels.append(workdir / f"label{i}.tif")
        tifffile.imwrite(predictions[-1], pred)
        tifffile.imwrite(labels[-1], label)
    seconds, outputs = {}, {}
    for n in (1, workers):
        out = workdir / f"eval_{n}"
        start = time.perf_counter()
        evaluate_pairs(predictions, labels, out, workers=n)
        seconds[n] = time.perf_counter() - start
        outputs[n] = (out / "scores.csv").read_bytes(), (out / "summary.json").read_bytes()
    return {
        "serial_s": seconds[1],
        "parallel_s": seconds[workers],
        "speedup": seconds[1] / seconds[workers],
        "identical": outputs[1] == outputs[workers],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 320])
    parser.add_argument("--volumes", type=int, default=4, help="volumes for the evaluate part")
    parser.add_argument("--eval-size", type=int, default=192)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print("load average at start: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))

    # Warm-up: load (or on a first run compile) the numba kernels outside the timings.
    warm_pred, warm_gt = make_pair(16, seed=0)
    topo_counts(*prepare_masks(warm_pred, warm_gt), "betti_matching")

    result: dict = {}
    print("TopoScore per volume (8 octant tiles), exact Betti matching vs the count bound:")
    for size in args.sizes:
        row = time_topo(size)
        print(
            f"  {size}^3: exact {row['betti_matching_s']:.2f} s,"
            f" bound {row['betti_counts_s']:.2f} s"
            f" (x{row['betti_matching_s'] / row['betti_counts_s']:.1f});"
            f" TopoScore exact {row['betti_matching_topo']:.4f}, bound "
            f"{row['betti_counts_topo']:.4f}; m exact {row['betti_matching_m']}, "
            f"bound {row['betti_counts_m']}, p {row['p']}, g {row['g']}",
            flush=True,
        )
        result[f"topo_exact_s_{size}"] = round(row["betti_matching_s"], 2)
        result[f"topo_bound_s_{size}"] = round(row["betti_counts_s"], 2)
        result[f"topo_overstated_{size}"] = round(
            row["betti_counts_topo"] - row["betti_matching_topo"], 4
        )

    with tempfile.TemporaryDirectory(prefix="bench_metrics_") as tmp:
        ev = time_evaluate(Path(tmp), args.volumes, args.eval_size, args.workers)
    print(
        f"evaluate, {args.volumes} volumes of {args.eval_size}^3: 1 worker {ev['serial_s']:.1f} s,"
        f" {args.workers} workers {ev['parallel_s']:.1f} s, speedup x{ev['speedup']:.2f},"
        f" outputs identical: {ev['identical']}"
    )
    if not ev["identical"]:
        raise SystemExit("parallel evaluation differs from the serial one")
    result.update(
        evaluate_workers=args.workers,
        evaluate_serial_s=round(ev["serial_s"], 1),
        evaluate_parallel_s=round(ev["parallel_s"], 1),
        evaluate_speedup=round(ev["speedup"], 2),
    )
    print("load average at end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    print(json.dumps(result))
    print("RESULT metrics " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
