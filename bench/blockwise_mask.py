"""Peak memory and time of the blockwise mask against the whole-volume `binary_mask`.

    python bench/blockwise_mask.py           # 128^3 volume, 32^3 blocks
    python bench/blockwise_mask.py --smoke   # 24^3, 8^3 blocks: seconds (CI)

Both read the same float32 probabilities from a .npy memmap on disk (smoothed noise, so there
are components, cavities and cracks) with hysteresis 3D, a component filter, the cavity fill
and a closing of radius 1 on; the blockwise mask writes into a memmap (the mask before the
closing into a zarr array in a scratch folder beside it), the whole-volume mask is an array.
Each runs in its own child process: its time, its peak RSS (ru_maxrss, less the child's RSS
before the run: the interpreter and imports) and its peak of Python-tracked allocations
(tracemalloc, which sees numpy's arrays), in a second run.
The masks must be identical. The run ends with

    RESULT blockwise_mask size=<n> block=<b> identical=1 tracemalloc_ratio=<x> rss_ratio=<x>
        time_ratio=<x> whole_tracemalloc_mb=<x> blockwise_tracemalloc_mb=<x> ...

ratios: blockwise / whole volume (below 1: the blockwise mask holds less).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
from scipy import ndimage

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from ctseg.postprocess.blockwise import blockwise_mask  # noqa: E402
from ctseg.postprocess.masks import PostprocessSettings, binary_mask  # noqa: E402

SETTINGS = PostprocessSettings(
    threshold=0.5, hysteresis_high=0.6, min_component_voxels=32, fill_holes=True, closing_radius=1
)


def make_probs(path: Path, size: int) -> None:
    rng = np.random.default_rng(0)
    smooth = ndimage.gaussian_filter(rng.random((size,) * 3, dtype=np.float32), 1.5)
    smooth = (smooth - smooth.min()) / (smooth.max() - smooth.min())
    np.save(path, smooth.astype(np.float32))


def child(mode: str, probs_path: Path, out_path: Path, block: int) -> None:
    """One measurement in this process: prints its figures as JSON."""

    def run() -> None:
        probs = np.load(probs_path, mmap_mode="r")
        if mode == "whole":
            mask, _ = binary_mask(probs, SETTINGS)
            np.save(out_path, mask)
        else:
            out = np.lib.format.open_memmap(out_path, mode="w+", dtype=np.uint8, shape=probs.shape)
            scratch_dir = out_path.with_suffix(".scratch")
            blockwise_mask(probs, out, SETTINGS, block=(block,) * 3, scratch_dir=scratch_dir)
            out.flush()
            del out

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    tracemalloc.start()
    run()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(json.dumps({"seconds": seconds, "rss_mb": rss / 1024, "tracemalloc_mb": peak / 2**20}))


def measure(mode: str, probs: Path, out: Path, block: int) -> dict:
    command = [sys.executable, __file__, "--child", mode, str(probs), str(out), str(block)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} child failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="24^3, 8^3 blocks: seconds (CI)")
    parser.add_argument("--size", type=int, default=None, help="volume edge (128; smoke 24)")
    parser.add_argument("--block", type=int, default=None, help="block edge (32; smoke 8)")
    parser.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, probs, out, block = args.child
        child(mode, Path(probs), Path(out), int(block))
        return
    size = args.size or (24 if args.smoke else 128)
    block = args.block or (8 if args.smoke else 32)
    with tempfile.TemporaryDirectory(prefix="ctseg-bench-blockwise-") as tmp:
        probs = Path(tmp) / "probs.npy"
        make_probs(probs, size)
        whole = measure("whole", probs, Path(tmp) / "whole.npy", block)
        blocks = measure("blockwise", probs, Path(tmp) / "blockwise.npy", block)
        identical = np.array_equal(
            np.load(Path(tmp) / "whole.npy"), np.load(Path(tmp) / "blockwise.npy")
        )
    print(f"settings: {SETTINGS.label()}")
    for name, figures in (("whole volume", whole), (f"blockwise {block}^3", blocks)):
        print(
            f"{name:>16}: {figures['seconds']:.2f} s, peak RSS +{figures['rss_mb']:.1f} MB, "
            f"tracemalloc peak {figures['tracemalloc_mb']:.1f} MB"
        )
    print(
        f"RESULT blockwise_mask size={size} block={block} identical={int(identical)} "
        f"tracemalloc_ratio={blocks['tracemalloc_mb'] / whole['tracemalloc_mb']:.4f} "
        f"rss_ratio={max(blocks['rss_mb'], 0.01) / max(whole['rss_mb'], 0.01):.4f} "
        f"time_ratio={blocks['seconds'] / whole['seconds']:.4f} "
        f"whole_tracemalloc_mb={whole['tracemalloc_mb']:.3f} "
        f"blockwise_tracemalloc_mb={blocks['tracemalloc_mb']:.3f} "
        f"whole_rss_mb={whole['rss_mb']:.1f} blockwise_rss_mb={blocks['rss_mb']:.1f} "
        f"whole_s={whole['seconds']:.3f} blockwise_s={blocks['seconds']:.3f}"
    )
    if not identical:
        raise SystemExit("the blockwise mask differs from binary_mask")


if __name__ == "__main__":
    main()
