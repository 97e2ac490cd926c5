"""Cost of the post-processing search with the winners' operations (issue 17): the default
search (hysteresis in 3D and along z, plugging, patching, closing: at most 32 candidates per
volume) against the search without them (the 20 candidates of before), in the same run, on the
same volume.

The volume is bench/metrics.py's: the demo generator's label, and as probabilities its noisy
image smoothed and scaled to [0, 1] (fragments, speckle and holes, like a weak model's output).
After a one-candidate search that warms numba's kernels, each search once, then the time of
each new operation alone added to the settings the old search chose.

Ends with `RESULT postprocess_search size=<n> old_s=<x> new_s=<x> ratio=<new/old>
old_candidates=<n> new_candidates=<n> old_score=<x> new_score=<x> gain=<x>`.

Run: python bench/postprocess_search.py [--size 128] [--workers 2] [--topo-method ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tifffile

sys.path.insert(0, str(Path(__file__).parent))
from metrics import make_pair  # noqa: E402  (bench/metrics.py's volume, the same data)

from ctseg.postprocess.masks import binary_mask  # noqa: E402
from ctseg.postprocess.tuning import SearchSpace, Volume, search  # noqa: E402
from ctseg.store import create_volume  # noqa: E402

OLD = SearchSpace(
    hysteresis_pairs=(),
    hysteresis_modes=("3d",),
    plug_holes_max_area=(),
    patch_holes_max_area=(),
    closing_radii=(),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--topo-method", choices=["betti_matching", "betti_counts"], default="betti_matching"
    )
    args = parser.parse_args()
    _, label, probs = make_pair(args.size, seed=args.size)
    with tempfile.TemporaryDirectory(prefix="ctseg_search_") as tmp:
        store = Path(tmp) / "v.zarr"
        create_volume(store, probs.shape, np.float16, (64, 64, 64))[...] = probs.astype(np.float16)
        tifffile.imwrite(Path(tmp) / "v.tif", label)
        volume = [Volume("v", store, Path(tmp) / "v.tif")]
        warm = dataclasses.replace(
            OLD, thresholds=(0.5,), refine_step=0, hysteresis_offsets=(), min_component_voxels=()
        )
        search(volume, dataclasses.replace(warm, fill_holes=False), topo_method=args.topo_method)
        rows = {}
        for name, space in (("old", OLD), ("new", SearchSpace())):
            start = time.perf_counter()
            best, candidates = search(
                volume, space, workers=args.workers, topo_method=args.topo_method
            )
            seconds = time.perf_counter() - start
            rows[name] = (best, len(candidates), seconds, space.max_candidates())
            print(
                f"{name}: {seconds:.3g} s, {len(candidates)} of at most {space.max_candidates()}"
                f" candidates, chosen {best.settings.label()}, score {best.mean():.4f}"
            )
    probs16 = probs.astype(np.float16)
    base = rows["old"][0].settings
    for field, value in (
        ("hysteresis_mode", "z"),
        ("plug_holes_max_area", 64),
        ("patch_holes_max_area", 1024),
        ("closing_radius", 1),
        ("closing_radius", 2),
    ):
        settings = dataclasses.replace(
            base,
            **{field: value},
            **({"hysteresis_high": 0.9} if field == "hysteresis_mode" else {}),
        )
        start = time.perf_counter()
        _, counts = binary_mask(probs16, settings)
        seconds = time.perf_counter() - start
        print(f"  binary_mask {settings.label()}: {seconds:.3g} s {counts}")
    (old_best, old_n, old_s, _), (new_best, new_n, new_s, _) = rows["old"], rows["new"]
    print(
        f"RESULT postprocess_search size={args.size} old_s={old_s:.3g} new_s={new_s:.3g} "
        f"ratio={new_s / old_s:.3g} old_candidates={old_n} new_candidates={new_n} "
        f"old_score={old_best.mean():.4f} new_score={new_best.mean():.4f} "
        f"gain={new_best.mean() - old_best.mean():.4f}"
    )


if __name__ == "__main__":
    main()
