"""Scoring speed: the competition score of one volume, and the post-processing search, at 128^3
and 320^3, against the previous implementation measured in the same run.

The data are the demo generator's volumes: its label, and as the prediction a thresholded,
smoothed copy of its noisy image (fragments, speckle and holes, like a weak model's output);
the search tunes on that smoothed image scaled to [0, 1] as probabilities.

Before any size, a warm-up score at 24^3 loads numba's kernels (from its cache, or compiles them
in a fresh clone: `warmup_s`). Per size:
1. `score_volume` (every core given, `--threads`): its first call at that size on its own
   (`first_score_s`: it also pays the loading or compiling of any kernel the warm-up did not
   reach), then `score_s`, the median of three calls after it, the "one score" that every ratio
   below divides by; and its SurfaceDice alone;
2. right after it (a shared machine's load drifts within minutes), the previous
   implementation, `score_volume(implementation="reference")`: SurfaceDice through
   surface-distance (scipy's EDT) and the Betti matching of every dimension of every tile, one
   after another; and surface-distance's SurfaceDice alone;
3. the agreement of every term with that oracle (largest absolute difference, and whether the
   Betti counts are identical);
4. `tune_s_per_volume`: the 20-candidate search of issue 18 (`PREVIOUS_SEARCH`: the default
   space without the winners' stages added since) on the one volume, and its ratio to one
   score; `tune32_...`: the same for today's default search (32 candidates,
   `ctseg.postprocess.tuning.SearchSpace()`); `tune_pruned_...`: how many candidates each search
   decided by their bound, without an exact score (`ctseg.postprocess.tuning`, "pruned"). Each
   search's seconds over `score_s` is its cost in scores (`..._over_score`). With `--unpruned`,
   the 20-candidate search again with nothing pruned (every candidate scored exactly: the search
   before pruning), its time and whether it chose the same. With `--whole-masks`, the default
   search again building every candidate's mask whole (`binary_mask`, nothing shared between
   candidates: the search before `ctseg.postprocess.masks.MaskCache`), its time and whether it
   chose the same.

Run: python bench/metrics.py [--sizes 128 320] [--threads N] [--no-tune] [--unpruned]
[--whole-masks]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tifffile
from scipy import ndimage

from ctseg.evaluation.metrics import (
    prepare_masks,
    score_volume,
    surface_dice,
    surface_dice_reference,
)
from ctseg.machine import available_cpus
from ctseg.postprocess import tuning
from ctseg.postprocess.masks import MaskCache, binary_mask
from ctseg.postprocess.tuning import SearchSpace, Volume, search
from ctseg.preprocess.demo_data import synthesize_volume
from ctseg.store import create_volume

TERMS = ("score", "surface_dice", "voi_score", "topo_score", "dice", "cldice")
COUNTS = tuple(f"topo_{c}{k}" for k in range(3) for c in "mpg")
# The default search of issue 18 (20 candidates): today's without the winners' stages.
PREVIOUS_SEARCH = tuning.WINNERS_STAGES_OFF
WARM_SCORES = 3  # score_s: the median of this many calls after the first


def make_pair(size: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prediction uint8 0/1, label uint8 0/1/2, probabilities float32) of shape size^3."""
    volume = synthesize_volume((size, size, size), np.random.default_rng(seed))
    smooth = ndimage.gaussian_filter(volume.image.astype(np.float32), 1.0)
    probs = np.clip((smooth - 60.0) / 130.0, 0.0, 1.0)  # 125 (the mask's cut) maps to 0.5
    return (smooth > 125).astype(np.uint8), volume.label, probs


def figure(value: float) -> float:
    """`value` to three significant digits: a time of milliseconds stays positive, where a fixed
    number of decimals would print it as 0."""
    return float(f"{value:.3g}")


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def bench_search(row: dict, key: str, volume: Volume, space: SearchSpace, threads: int) -> None:
    (best, candidates), row[f"{key}_s"] = timed(search, [volume], space, workers=threads)
    row[f"{key}_candidates"] = len(candidates)
    row[f"{key}_pruned"] = sum(c.pruned for c in candidates)
    row[f"{key}_choice"] = best.settings.label()
    row[f"{key}_mean"] = best.mean()
    row[f"{key}_rss_gb"] = peak_rss_gb()  # the process's high-water mark so far


def bench_size(
    size: int, threads: int, tune: bool, unpruned: bool, whole_masks: bool, workdir: Path
) -> dict:
    pred, label, probs = make_pair(size, seed=size)
    p, g = prepare_masks(pred, label)
    row: dict = {}
    fast, row["first_score_s"] = timed(score_volume, pred, label, threads=threads)
    warm = [timed(score_volume, pred, label, threads=threads)[1] for _ in range(WARM_SCORES)]
    row["score_s"] = statistics.median(warm)
    row["rss_fast_gb"] = peak_rss_gb()
    _, row["sd_s"] = timed(surface_dice, p, g, threads=threads)
    _, row["sd_reference_s"] = timed(surface_dice_reference, p, g)
    reference, row["reference_s"] = timed(score_volume, pred, label, implementation="reference")
    if tune:
        store = workdir / f"v{size}.zarr"
        create_volume(store, probs.shape, np.float16, (64, 64, 64))[...] = probs.astype(np.float16)
        tifffile.imwrite(workdir / f"v{size}.tif", label)
        volume = Volume(f"v{size}", store, workdir / f"v{size}.tif")
        bench_search(row, "tune", volume, SearchSpace(**PREVIOUS_SEARCH), threads)
        bench_search(row, "tune32", volume, SearchSpace(), threads)
        if whole_masks:
            shared = MaskCache.mask
            MaskCache.mask = lambda self, settings: binary_mask(self.probs, settings)[0]
            try:
                bench_search(row, "whole_masks", volume, SearchSpace(), threads)
            finally:
                MaskCache.mask = shared
        if unpruned:
            margin = tuning.PRUNE_MARGIN
            tuning.PRUNE_MARGIN = math.inf  # no bound is ever below the best: nothing pruned
            try:
                bench_search(row, "unpruned", volume, SearchSpace(**PREVIOUS_SEARCH), threads)
            finally:
                tuning.PRUNE_MARGIN = margin
    row["agreement"] = {
        term: abs(fast[term] - reference[term])
        if not (math.isnan(fast[term]) and math.isnan(reference[term]))
        else 0.0
        for term in TERMS
    }
    row["counts_identical"] = all(fast[c] == reference[c] for c in COUNTS)
    row["counts"] = {c: fast[c] for c in COUNTS}
    row["values"] = {term: fast[term] for term in TERMS}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 320])
    parser.add_argument("--threads", type=int, default=available_cpus(), help="cores to use")
    parser.add_argument("--no-tune", action="store_true", help="skip the search")
    parser.add_argument(
        "--unpruned", action="store_true", help="also the 20-candidate search without pruning"
    )
    parser.add_argument(
        "--whole-masks",
        action="store_true",
        help="also the default search building every mask whole (no MaskCache)",
    )
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} used"
    )
    print("load average at start: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()), flush=True)

    warm_pred, warm_label, _ = make_pair(24, seed=0)  # numba's kernels: cache or compile
    _, warmup_s = timed(score_volume, warm_pred, warm_label, threads=args.threads)
    print(f"warm-up score at 24^3 (loading or compiling numba's kernels): {warmup_s:.2f} s")

    result: dict = {"threads": args.threads, "warmup_s": figure(warmup_s)}
    with tempfile.TemporaryDirectory(prefix="bench_metrics_") as tmp:
        for size in args.sizes:
            tune = not args.no_tune
            row = bench_size(size, args.threads, tune, args.unpruned, args.whole_masks, Path(tmp))
            worst = max(row["agreement"].values())
            print(
                f"{size}^3: score {row['score_s']:.3g} s (median of {WARM_SCORES} after a first "
                f"of {row['first_score_s']:.3g} s; previous {row['reference_s']:.3g} s, "
                f"x{row['reference_s'] / row['score_s']:.1f}); SurfaceDice {row['sd_s']:.3g} s "
                f"(surface-distance {row['sd_reference_s']:.3g} s, "
                f"x{row['sd_reference_s'] / row['sd_s']:.1f}); peak RSS {row['rss_fast_gb']:.2f} "
                f"GB; largest difference from the oracle {worst:.1e} "
                f"({json.dumps(row['agreement'])}), Betti counts identical: "
                f"{row['counts_identical']}; values {json.dumps(row['values'])}; "
                f"counts {json.dumps(row['counts'])}",
                flush=True,
            )
            result[f"first_score_s_{size}"] = figure(row["first_score_s"])
            result[f"score_s_{size}"] = figure(row["score_s"])
            result[f"reference_score_s_{size}"] = figure(row["reference_s"])
            result[f"score_speedup_{size}"] = figure(row["reference_s"] / row["score_s"])
            result[f"sd_s_{size}"] = figure(row["sd_s"])
            result[f"sd_speedup_{size}"] = figure(row["sd_reference_s"] / row["sd_s"])
            result[f"max_term_diff_{size}"] = figure(worst)
            result[f"counts_identical_{size}"] = row["counts_identical"]
            for key, what in (
                ("tune", "20-candidate search"),
                ("tune32", "default search"),
                ("unpruned", "20-candidate search, nothing pruned"),
                ("whole_masks", "default search, every mask built whole"),
            ):
                if f"{key}_s" not in row:
                    continue
                print(
                    f"{size}^3: {what} {row[f'{key}_s']:.3g} s per volume, "
                    f"{row[f'{key}_candidates']} candidates ({row[f'{key}_pruned']} pruned), "
                    f"x{row[f'{key}_s'] / row['score_s']:.1f} one score; chose "
                    f"{row[f'{key}_choice']} (mean {row[f'{key}_mean']:.6f}); peak RSS so far "
                    f"{row[f'{key}_rss_gb']:.2f} GB",
                    flush=True,
                )
                name = {
                    "tune": "tune",
                    "tune32": "tune32",
                    "unpruned": "tune_unpruned",
                    "whole_masks": "tune32_whole_masks",
                }[key]
                result[f"{name}_s_per_volume_{size}"] = figure(row[f"{key}_s"])
                result[f"{name}_over_score_{size}"] = figure(row[f"{key}_s"] / row["score_s"])
                if key in ("tune", "tune32"):
                    result[f"{name}_pruned_{size}"] = row[f"{key}_pruned"]
            if "whole_masks_s" in row:
                same = (row["whole_masks_choice"], row["whole_masks_mean"]) == (
                    row["tune32_choice"],
                    row["tune32_mean"],
                )
                result[f"shared_masks_same_choice_{size}"] = same
                if not same:
                    raise SystemExit(f"{size}^3: sharing the masks changed the search's choice")
            if "unpruned_s" in row:
                same = (row["unpruned_choice"], row["unpruned_mean"]) == (
                    row["tune_choice"],
                    row["tune_mean"],
                )
                result[f"pruned_same_choice_{size}"] = same
                if not same:
                    raise SystemExit(f"{size}^3: pruning changed the search's choice")
            if row["agreement"]["score"] > 1e-12 or not row["counts_identical"]:
                raise SystemExit(f"{size}^3: the fast score differs from the reference")
    result["peak_rss_gb"] = figure(peak_rss_gb())
    print("load average at end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    print(json.dumps(result))
    print("RESULT metrics " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
