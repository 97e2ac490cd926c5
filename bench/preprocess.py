"""Preprocessing benchmark: convert and precompute_targets against their baselines, same run.

    python bench/preprocess.py            # 256^3 for the speed ratios, 256^3 vs 384^3 for RSS
    python bench/preprocess.py --quick    # 256^3 for the speed ratios, 128^3 vs 256^3 for RSS
    python bench/preprocess.py --smoke    # 48^3 and 40^3: every path in seconds (CI); its
                                          # figures say nothing about speed or memory

Figures:
- convert MB/s (TIFF -> Zarr, whole step) vs the configured codec compressing the same bytes in
  memory, chunk by chunk (``convert_vs_codec``), and vs zarr-python writing the same array from
  memory with the same chunks and codec (``convert_vs_zarr_write``: the ceiling of any convert
  that writes through zarr). Also printed, each alone in memory: the sha256 convert records,
  the exact histogram it counts, and the codec plus plain chunk-file writes.
- precompute_targets time and peak RSS, in one process, with the default ``distance_ridge``
  skeleton vs the naive whole-volume method the starting point's workers used (README.md); the
  same for the 8-orientation ``medial_surface`` (the previous default,
  ``precompute_speedup_medial_surface``), the one-orientation ``medial_surface_fast`` and a
  ridge run with one worker per core. The naive method: scipy.ndimage.distance_transform_edt
  inside and outside, skimage.morphology.skeletonize on the whole volume, then the tube
  dilation.
- peak RSS of convert and precompute at two volume sizes: bounded memory shows as a flat line.
- skeleton quality of ``distance_ridge`` and ``medial_surface`` on the same volume (from the
  stores just written): voxels per foreground voxel, mean thickness (the shortest axis-aligned
  run of skeleton through each voxel), foreground inside the tube, 26-connected pieces (of the
  foreground too), and the share of each skeleton within one voxel of the other.

Each measurement runs in a fresh child process; peak RSS is sampled over the child and all its
descendants together (so worker processes count), and time is measured inside the child,
excluding interpreter start-up and imports. The convert-side figures, a tenth of a second each,
are the fastest of ``REPEATS`` runs in their child; the distance_ridge, medial_surface and naive
precompute runs are made twice each, interleaved, and the faster of each pair is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from measure import run_child  # noqa: E402  (bench/measure.py, beside this script)

CODEC = {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "shuffle"}
CHUNKS = (64, 64, 64)
CLIP = 8.0
TUBE = 2
# The convert figures are a tenth of a second each: the fastest of a few runs in the same child,
# so that one burst of load from other processes on a shared machine does not decide a ratio.
REPEATS = 3
# (edge of the volume of the speed ratios and the skeleton quality, edges of the RSS pair).
SIZES = {"full": (256, (256, 384)), "quick": (256, (128, 256)), "smoke": (48, (40, 48))}


def fastest(run: Callable[[int], float]) -> float:
    """The smallest of `run(i)` for i < REPEATS; each call times its own work."""
    return min(run(i) for i in range(REPEATS))


# ---------------------------------------------------------------- child-side measurements
def child_convert(source: str, dest: str) -> float:
    from ctseg.preprocess.convert import convert_volume

    def once(i: int) -> float:
        start = time.perf_counter()
        convert_volume(Path(source), Path(f"{dest}.{i}"), kind="image", chunks=CHUNKS, codec=CODEC)
        return time.perf_counter() - start

    return fastest(once)


def child_codec(source: str) -> float:
    """The configured codec alone, on the same bytes already in memory."""
    import numpy as np
    import tifffile
    from numcodecs import Blosc

    volume = tifffile.imread(source)
    codec = Blosc(cname=CODEC["cname"], clevel=CODEC["clevel"], shuffle=Blosc.SHUFFLE)
    chunks = [
        np.ascontiguousarray(volume[z : z + 64, y : y + 64, x : x + 64])
        for z in range(0, volume.shape[0], 64)
        for y in range(0, volume.shape[1], 64)
        for x in range(0, volume.shape[2], 64)
    ]

    def once(_: int) -> float:
        start = time.perf_counter()
        for chunk in chunks:
            codec.encode(chunk)
        return time.perf_counter() - start

    return fastest(once)


def child_zarr_write(source: str, dest: str) -> float:
    """zarr-python writing the volume from memory: same chunks and codec, no reading or stats."""
    import tifffile

    from ctseg.store import create_volume

    volume = tifffile.imread(source)

    def once(i: int) -> float:
        array = create_volume(Path(f"{dest}.{i}"), volume.shape, volume.dtype, CHUNKS, CODEC)
        start = time.perf_counter()
        array[...] = volume
        return time.perf_counter() - start

    return fastest(once)


def child_files(source: str, dest: str) -> float:
    """The codec plus one plain file per chunk: the bytes a store must write, without zarr."""
    import tifffile
    from numcodecs import Blosc

    volume = tifffile.imread(source)
    codec = Blosc(cname=CODEC["cname"], clevel=CODEC["clevel"], shuffle=Blosc.SHUFFLE)

    def once(i: int) -> float:
        folder = Path(f"{dest}.{i}")
        folder.mkdir()
        start = time.perf_counter()
        for z in range(0, volume.shape[0], 64):
            for y in range(0, volume.shape[1], 64):
                for x in range(0, volume.shape[2], 64):
                    chunk = np.ascontiguousarray(volume[z : z + 64, y : y + 64, x : x + 64])
                    (folder / f"{z}.{y}.{x}").write_bytes(codec.encode(chunk))
        return time.perf_counter() - start

    return fastest(once)


def child_histogram(source: str) -> float:
    """The exact histogram convert counts (its default budget's piece size), whole volume."""
    import tifffile

    from ctseg.preprocess.convert import HISTOGRAM_SHARE, Histogram

    volume = tifffile.imread(source)

    def once(_: int) -> float:
        histogram = Histogram(volume.dtype, int(256 * 2**20 * HISTOGRAM_SHARE) // 8)
        start = time.perf_counter()
        histogram.add(volume)
        return time.perf_counter() - start

    return fastest(once)


def child_sha256(source: str) -> float:
    """Hashing the source: convert must do it (the source_sha256 attribute), so it bounds it."""
    from ctseg.io import sha256_file

    def once(_: int) -> float:
        start = time.perf_counter()
        sha256_file(source)
        return time.perf_counter() - start

    return fastest(once)


def child_precompute(
    label_store: str, dest: str, workers: str, method: str = "distance_ridge"
) -> float:
    from ctseg.preprocess.targets import compute_targets

    start = time.perf_counter()
    compute_targets(
        Path(label_store),
        Path(dest),
        clip_distance=CLIP,
        skeleton_method=method,
        tube_dilations=TUBE,
        workers=int(workers),
        codec=CODEC,
    )
    return time.perf_counter() - start


def child_naive(label_tif: str) -> float:
    """What run-time target code does: whole volume in RAM, float64 EDTs, 3D skeleton."""
    import numpy as np
    import tifffile
    from scipy import ndimage
    from skimage.morphology import skeletonize

    label = tifffile.imread(label_tif)
    start = time.perf_counter()
    foreground = label == 1
    inside = ndimage.distance_transform_edt(foreground)
    outside = ndimage.distance_transform_edt(~foreground)
    sdt = np.clip(outside - inside, -CLIP, CLIP).astype(np.float16)
    skeleton = skeletonize(foreground)
    tube = ndimage.binary_dilation(skeleton, iterations=TUBE)
    del sdt, tube
    return time.perf_counter() - start


CHILDREN = {
    "convert": child_convert,
    "codec": child_codec,
    "sha256": child_sha256,
    "zarr_write": child_zarr_write,
    "files": child_files,
    "histogram": child_histogram,
    "precompute": child_precompute,
    "naive": child_naive,
}


# ---------------------------------------------------------------- parent-side driver
def measure(mode: str, *args: str) -> dict:
    """Run one measurement in a child; return its seconds and the peak RSS of its process tree."""
    return run_child([sys.executable, __file__, "--child", mode, *args], mode)


def make_volume(workdir: Path, size: int) -> tuple[Path, Path]:
    from ctseg.preprocess.convert import convert_volume
    from ctseg.preprocess.demo_data import generate_demo

    dataset = workdir / f"demo{size}"
    if not dataset.exists():
        generate_demo(
            dataset, n_train=1, n_test=0, shape=(size, size, size), scroll_ids=[1], seed=size
        )
    image = next((dataset / "train_images").glob("*.tif"))
    label = dataset / "train_labels" / image.name
    label_store = workdir / f"label{size}.zarr"
    if not label_store.exists():
        convert_volume(label, label_store, kind="label", chunks=CHUNKS, codec=CODEC)
    return image, label


def skeleton_quality(skeleton: np.ndarray, fg: np.ndarray, other: np.ndarray) -> dict:
    """How thin, how covering and how connected a skeleton is, and how close to `other`."""
    from scipy import ndimage

    runs = np.full(skeleton.shape, np.iinfo(np.int64).max)
    for axis in range(3):
        line = np.zeros((3, 3, 3), dtype=bool)
        line[tuple(slice(None) if a == axis else 1 for a in range(3))] = True
        pieces, _ = ndimage.label(skeleton, line)
        runs = np.minimum(runs, np.bincount(pieces.ravel())[pieces])
    cube = np.ones((3, 3, 3), dtype=bool)
    tube = ndimage.binary_dilation(skeleton, ndimage.generate_binary_structure(3, 1), 2)
    return {
        "per_fg": skeleton.sum() / fg.sum(),
        "thickness": runs[skeleton].mean(),
        "fg_in_tube": (tube & fg).sum() / fg.sum(),
        "pieces": ndimage.label(skeleton, cube)[1],
        "near_other": (skeleton & ndimage.binary_dilation(other, cube)).sum() / skeleton.sum(),
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller second size; under 2 min")
    size.add_argument("--smoke", action="store_true", help="toy volumes: every path in seconds")
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="also time precompute with this many worker processes (the RESULT uses 1)",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        mode, *rest = args.child
        print(json.dumps({"seconds": CHILDREN[mode](*rest)}))
        return

    edge, sizes = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        workdir = Path(tmp)
        print(f"machine: {machine()}")
        volumes = {size: make_volume(workdir, size) for size in sorted({edge, *sizes})}

        image, label = volumes[edge]
        mb = image.stat().st_size / 2**20
        convert = measure("convert", str(image), str(workdir / f"c{edge}.zarr"))
        codec = measure("codec", str(image))
        sha = measure("sha256", str(image))
        zarr_write = measure("zarr_write", str(image), str(workdir / f"z{edge}.zarr"))
        files = measure("files", str(image), str(workdir / f"files{edge}"))
        histogram = measure("histogram", str(image))
        label_store = str(workdir / f"label{edge}.zarr")
        # One process against the single-process naive method: the RESULT's time and memory.
        # The RESULT's three runs twice each, interleaved, keeping each one's faster run: the
        # ratios then compare like with like when the shared machine's load comes and goes.
        runs: dict[str, list[dict]] = {"ours": [], "union8": [], "naive": []}
        for i in range(2):
            runs["ours"].append(measure("precompute", label_store, f"{workdir}/t{i}.zarr", "1"))
            runs["union8"].append(
                measure("precompute", label_store, f"{workdir}/m{i}.zarr", "1", "medial_surface")
            )
            runs["naive"].append(measure("naive", str(label)))
        ours, union8, naive = (min(runs[k], key=lambda r: r["seconds"]) for k in runs)
        fast = measure(
            "precompute", label_store, str(workdir / f"f{edge}.zarr"), "1", "medial_surface_fast"
        )
        parallel = measure(
            "precompute", label_store, str(workdir / f"p{edge}.zarr"), str(args.workers)
        )

        convert_mb_s = mb / convert["seconds"]
        codec_mb_s = mb / codec["seconds"]
        print(f"\n{edge}^3 uint8 volume ({mb:.3g} MB)")
        print(
            f"  convert           {convert_mb_s:8.1f} MB/s   peak RSS {convert['rss_mb']:7.1f} MB"
        )
        print(f"  codec in memory   {codec_mb_s:8.1f} MB/s")
        zarr_mb_s = mb / zarr_write["seconds"]
        print(f"  zarr write, memory{zarr_mb_s:8.1f} MB/s   (same chunks and codec, no reading)")
        print(f"  codec + chunk files{mb / files['seconds']:7.1f} MB/s   (the same bytes, no zarr)")
        print(f"  sha256 of source  {mb / sha['seconds']:8.1f} MB/s   (recorded as source_sha256)")
        print(f"  exact histogram   {mb / histogram['seconds']:8.1f} MB/s")
        for name, run in (
            ("precompute", ours),
            ("  medial_surface", union8),
            ("  _fast skeleton", fast),
            (f"  {args.workers} workers", parallel),
        ):
            print(f"  {name:<17} {run['seconds']:8.2f} s      peak RSS {run['rss_mb']:7.1f} MB")
        print(
            f"  naive whole-vol   {naive['seconds']:8.2f} s      peak RSS {naive['rss_mb']:7.1f} MB"
        )

        import zarr
        from scipy import ndimage

        fg = zarr.open_array(label_store, mode="r")[...] == 1
        ridge = zarr.open_array(f"{workdir}/t0.zarr/skeleton", mode="r")[...].astype(bool)
        thinned = zarr.open_array(f"{workdir}/m0.zarr/skeleton", mode="r")[...].astype(bool)
        print(f"\nskeleton quality, {edge}^3 (thickness: shortest axis-aligned run, voxels)")
        print(f"  foreground: 26-connected pieces {ndimage.label(fg, np.ones((3, 3, 3)))[1]}")
        for name, skel, other in (
            ("distance_ridge", ridge, thinned),
            ("medial_surface", thinned, ridge),
        ):
            q = skeleton_quality(skel, fg, other)
            print(
                f"  {name:<15} per fg voxel {q['per_fg']:.3f}  thickness {q['thickness']:.2f}  "
                f"fg in tube {q['fg_in_tube']:.4f}  pieces {q['pieces']}  "
                f"within 1 voxel of the other {q['near_other']:.4f}"
            )

        rss = {}
        print("\npeak RSS by volume size (MB)")
        for size in sizes:
            image_s, _ = volumes[size]
            rss[("convert", size)] = (
                convert
                if size == edge
                else measure("convert", str(image_s), str(workdir / f"c{size}.zarr"))
            )["rss_mb"]
            rss[("precompute", size)] = (
                ours
                if size == edge
                else measure(
                    "precompute",
                    str(workdir / f"label{size}.zarr"),
                    str(workdir / f"t{size}.zarr"),
                    "1",
                )
            )["rss_mb"]
            print(
                f"  {size}^3   convert {rss[('convert', size)]:7.1f}   "
                f"precompute {rss[('precompute', size)]:7.1f}"
            )

    small, large = sizes
    growth = max(
        rss[("convert", large)] / rss[("convert", small)],
        rss[("precompute", large)] / rss[("precompute", small)],
    )
    print(
        f"\nRESULT preprocess convert_vs_codec={convert_mb_s / codec_mb_s:.3g} "
        f"convert_vs_zarr_write={convert_mb_s / zarr_mb_s:.3g} "
        f"precompute_speedup={naive['seconds'] / ours['seconds']:.3g} "
        f"precompute_speedup_medial_surface={naive['seconds'] / union8['seconds']:.3g} "
        f"precompute_rss_ratio={ours['rss_mb'] / naive['rss_mb']:.3g} "
        f"rss_growth={growth:.3g}"
    )
    print(
        "also: precompute_speedup with medial_surface_fast="
        f"{naive['seconds'] / fast['seconds']:.3g}, "
        f"with {args.workers} workers={naive['seconds'] / parallel['seconds']:.3g}"
    )


if __name__ == "__main__":
    main()
