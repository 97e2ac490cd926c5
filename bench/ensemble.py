"""Ensemble benchmark: `ctseg.inference.ensemble.ensemble_volume` against a whole-volume mean, same
run.

    python bench/ensemble.py           # 3 members of 64 x 256 x 256 and of 256 x 256 x 256
    python bench/ensemble.py --quick   # 3 members of 32 x 128 x 128 and of 128 x 128 x 128

Figures, for each depth (z grows 4x between the two):
- peak traced memory (tracemalloc, which numpy's and zarr's buffers go through) and seconds of
  the streamed mean under a 16 MB budget, against the baseline;
- the largest difference between the two results (both compute sum w p / sum w in float32).

The baseline ("whole") is the plain way: read every member whole as float32, take the
weighted mean with numpy, write the float16 store. Bounded memory shows as a flat streamed
peak while the baseline's grows with z. The streamed peak exceeds its budget by zarr's decoded
chunk buffers (a chunk per read and per write), which do not grow with z.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from ctseg.inference.ensemble import ensemble_volume  # noqa: E402
from ctseg.store import create_volume, open_volume  # noqa: E402

ATTRS = {
    "source": "bench",
    "window": [32, 48, 48],
    "overlap": 0.5,
    "tta_flips": False,
    "blending": "gaussian sigma=window*0.125",
    "value": "foreground probability (sigmoid)",
}
WEIGHTS = [1.0, 2.0, 1.0]
BUDGET_MB = 16.0


def make_members(root: Path, shape: tuple[int, int, int]) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(len(WEIGHTS)):
        path = root / f"m{i}.zarr"
        store = create_volume(path, shape, np.float16, (16, 64, 64), attributes=ATTRS)
        store[...] = rng.random(shape, np.float32).astype(np.float16)
        paths.append(path)
    return paths


def whole(paths: list[Path], out: Path) -> None:
    total = sum(
        w * np.asarray(open_volume(p)[...], np.float32) for p, w in zip(paths, WEIGHTS, strict=True)
    )
    ref = open_volume(paths[0])
    store = create_volume(out, ref.shape, np.float16, ref.chunks, attributes=dict(ref.attrs))
    store[...] = (total / sum(WEIGHTS)).astype(np.float16)


def measure(fn, *args, **kwargs) -> tuple[float, float]:
    tracemalloc.start()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return peak, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    yx = 128 if args.quick else 256
    depths = (32, 128) if args.quick else (64, 256)
    rows = []
    print(f"{len(WEIGHTS)} members, weights {WEIGHTS}, budget {BUDGET_MB} MB, Y = X = {yx}")
    print(f"{'z':>5} {'way':>9} {'peak MB':>9} {'seconds':>8}")
    for z in depths:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            paths = make_members(root, (z, yx, yx))
            s_peak, s_sec = measure(
                ensemble_volume, paths, WEIGHTS, root / "s.zarr", memory_budget_mb=BUDGET_MB
            )
            w_peak, w_sec = measure(whole, paths, root / "w.zarr")
            a = np.asarray(open_volume(root / "s.zarr")[...], np.float32)
            b = np.asarray(open_volume(root / "w.zarr")[...], np.float32)
            diff = float(np.abs(a - b).max())
        for way, peak, sec in (("streamed", s_peak, s_sec), ("whole", w_peak, w_sec)):
            print(f"{z:>5} {way:>9} {peak:>9.3g} {sec:>8.3g}")
        print(f"      max |streamed - whole| = {diff:.2e}")
        rows.append((s_peak, s_sec, w_peak, w_sec, diff))
    (s1, _, w1, _, _), (s4, s4_sec, w4, w4_sec, diff) = rows
    print(
        f"RESULT ensemble streamed_peak_growth={s4 / s1:.3g} whole_peak_growth={w4 / w1:.3g} "
        f"peak_ratio_vs_whole={s4 / w4:.3g} time_ratio_vs_whole={s4_sec / w4_sec:.3g} "
        f"max_diff={diff:.1e}"
    )


if __name__ == "__main__":
    main()
