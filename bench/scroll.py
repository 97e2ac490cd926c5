"""Whole-scroll predict benchmark: `ctseg predict -i <volume.zarr>`'s tiled path against the
in-memory path and MONAI, in the same run.

    python bench/scroll.py                 # window 24^3; 72x132x132 and 96x160x160; ~3 min
    python bench/scroll.py --quick         # window 16^3; 48x80x80 and 64x112x112; ~1 min
    python bench/scroll.py --repeat 3      # the fastest of 3 runs of each path (sections 1-2)
    python bench/scroll.py --section2-size large --skip-monai --parts 1   # ~5 min: see below
    python bench/scroll.py --device cuda --threads 0 --window 64 \\
        --fits-shape 192,320,320 --large-shape 256,512,512       # a GPU: voxels/s per GPU
    python bench/scroll.py --scaling [--z 64 192 --parts 1 4 16]  # bench/scroll_scaling.py

Three sections, each a table and a ``RESULT`` line:

1. **A volume that fits in memory** (``--fits-shape``), the same model, window, overlap (0.5),
   batch and device for each of (a) MONAI's ``sliding_window_inference`` (``mode="gaussian"``,
   ``sigma_scale=0.125``: ctseg's sigma, with MONAI's own map), (b) ctseg's
   `ctseg.inference.run.infer_volume` (the volume one tile), (c) the engine as ``ctseg predict``
   runs it (`open_source`, `open_work`, `run_part` (0 of 1), `finish`) under a generous budget
   (one tile). Each is timed from the Zarr store to a float16 Zarr store of probabilities (the
   tiled path's mask post-processing and OME-Zarr pyramid are not included: the in-memory path
   has no such step to compare with). Ratios (b)/(a) and (c)/(b); (b) and (c) must agree bit for
   bit (the blend is an exact integer sum); MONAI's agreement with (b) is printed as mean |dp|.
2. **A volume 4x the memory budget** (``--large-shape``): the budget is set so that the in-memory
   working set counted as 8 bytes a voxel (float32 input + float32 accumulator) is 4x it; the
   uint8 volume itself is then half the budget. The tiled path under that budget, split and
   with the allocator set as ``ctseg predict --memory-budget-mb`` does (`budget_split`: a
   quarter to the chunk cache, half to the tiles; `_heap_policy`) against the in-memory path
   on the same volume (one tile: its working set fits the default device budget); ratio
   tiled / in-memory (target >= 0.9), and the tiled path's peak RSS increase against the
   budget.
3. **Parts** (``--parts``, default 1 and 3): the volume of section 2 split over N parts, each
   `run_part(k, N)` in its own process one after another, then `finish` in another: voxels/s of
   each part (the voxels of its tiles / its seconds) and in total (the volume / the sum of the
   parts' and the finish's seconds), against 1 part (section 2's tiled run); the probabilities
   must be the same bits for every N. With ``--device cuda``, one part is one GPU's share.

Every measurement runs in a fresh child process (this script with ``--one``), after the model is
loaded, the modules imported and one warm-up forward at the batch size; its wall and CPU time
(``time.process_time``: every thread of the child) are measured inside the child. On a shared
machine the CPU time is the steadier of the two: a child that waits for a core loses wall time
only. Memory, in MB, of the child: "peak RSS", its whole life's high-water mark (``VmHWM`` of
/proc/self/status; ``ru_maxrss`` only where that is missing: after fork+exec it keeps the peak
of the process that forked it, this script's, which has held whole volumes); "+run", the peak
during the timed run (VmHWM, reset after the warm-up) less the RSS just before it: what the run
adds to a loaded, warm model. Section 2 also runs the forwards alone, so that the activations'
share of "+run" (which the budget does not count) shows; what glibc keeps of freed activations
between forwards varies from run to run, so "+run" is an upper bound of what a path holds live.
"faults k": the run's minor page faults, in thousands (``ru_minflt``): memory the process
touches for the first time or again after handing it back to the system.

Allocator: the tiled, part, finish and forward children set glibc's thresholds as
``ctseg predict`` does before its warm-up (`ctseg.data.heap.tune_malloc`: freed activations stay
in the heap, so a forward does not fault them in again); `run_part` itself hands each tile's
freed memory back (`ctseg.data.heap.release_heap`, ``malloc_trim(0)``) so that the RSS stays
under the budget. `infer_volume` calls `tune_malloc` itself.

Threads: ``--threads 1`` by default on a CPU (0: torch's default). On a shared 2-core machine
torch's second thread waits for a busy core at every operation (a batch of four 16^3 windows
took 0.64 s with 2 threads and 0.018 s with 1); one thread gives every path the same, steady
conditions. The model is a random-init ctseg U-Net (filters 16-32-64-128, instance norm, as
bench/infer.py's), its output head rescaled so that about half the voxels are foreground.

``--section2-size large`` runs sections 2-3 on a 192x288x288 volume (15.2 MB uint8, so a 30.4
MB budget) with the same model, window (24^3) and batch: 64 tiles of 48x72x72 hold about 120
windows each, against about 6 windows a tile for the default 96x160x160 (4.69 MB budget, 196
tiles), where the per-tile `release_heap` (each tile's first forward faults the activations
back in) and the per-tile file work are spread over few forwards. Each of its two section 2
paths takes about 2 min on a 2-core CPU; with ``--skip-monai --parts 1`` the run takes about
5 min. ``--large-shape`` still overrides the preset's volume; the default size is unchanged.

``--profile FILE`` runs section 2's tiled child once more, under cProfile, and prints its top
costs.
MONAI is a bench-only extra: ``.venv/bin/pip install -e '.[bench]'``; ``--skip-monai`` leaves
(a) out.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import infer  # noqa: E402  (bench/infer.py, beside this script: model, weights, MONAI helpers)

UNET = infer.UNET
OVERLAP = infer.OVERLAP
BATCH = infer.BATCH
LOW, HIGH = infer.LOW, infer.HIGH
SIGMA_SCALE = 0.125  # ctseg's Gaussian: sigma = window / 8
GENEROUS_MB = 1024  # section 1's budget for the tiled path: the whole volume in one tile
WORKING_BYTES_PER_VOXEL = 8  # the in-memory path's float32 input + float32 accumulator
BUDGET_FACTOR = 4  # section 2: that working set is this many times the budget
TARGET_RATIO = 0.9  # section 2: tiled voxels/s / in-memory voxels/s
# (window edge, section 1 volume, section 2-3 volume). The section 1 volume is (a multiple of
# half the window) + the window on every axis, so MONAI (steps of window / 2, last window
# clamped) and ctseg (starts spread evenly) place their windows alike, and section 1 compares
# implementations, not grids.
# The section 2 volume is about the smallest whose budget holds a tile of one chunk (the window)
# with its halo: 22 bytes a voxel of (2 x window)^3 in the tiles' half of the budget.
SIZES = {
    "full": (24, (72, 132, 132), (96, 160, 160)),
    "quick": (16, (48, 80, 80), (64, 112, 112)),
}
# --section2-size: the sections 2-3 volume, by preset ("default": the --quick/full one above).
# "large": 15.2 MB uint8, a 30.4 MB budget: 64 tiles of 48x72x72, ~120 24^3 windows each.
SECTION2_SIZES = {"large": (192, 288, 288)}
INSTALL_MONAI = ".venv/bin/pip install -e '.[bench]'"


class BenchError(RuntimeError):
    """A problem the bench reports in one line."""


# ---------------------------------------------------------------- inputs
def make_volume(path: Path, shape: tuple[int, int, int], chunks: int, seed: int = 0) -> Path:
    """A uint8 CT-like volume (smooth sheets plus noise) as a Zarr array with the normalisation
    attributes, chunked `chunks`^3 (the read unit of the tiled path and its output chunks)."""
    from ctseg.store import create_volume

    rng = np.random.default_rng(seed)
    arr = create_volume(
        path, shape, np.uint8, (chunks,) * 3, attributes={"p0_5": LOW, "p99_5": HIGH}
    )
    yy, xx = np.mgrid[: shape[1], : shape[2]]
    for z0 in range(0, shape[0], chunks):
        z = np.arange(z0, min(z0 + chunks, shape[0]))[:, None, None]
        sheets = 100 * np.sin((z + 0.3 * yy + 0.1 * xx) / 4.0) ** 8
        noise = rng.normal(0, 15, (len(z), *shape[1:]))
        arr[z0 : z0 + len(z)] = np.clip(80 + sheets + noise, 0, 255).astype(np.uint8)
    return path


def check_monai_grid(shape: tuple[int, int, int], window: tuple[int, int, int]) -> None:
    import itertools

    from ctseg.inference.windows import window_starts

    ours = sorted(
        itertools.product(
            *(window_starts(s, w, OVERLAP) for s, w in zip(shape, window, strict=True))
        )
    )
    if ours != infer.monai_grid(shape, window):
        raise BenchError(
            f"on {fmt_shape(shape)} with window {fmt_shape(window)} MONAI and ctseg place their "
            "windows differently (MONAI steps by window / 2 and clamps the last), so the "
            "comparison would compare grids: give a --fits-shape whose sizes are the window plus "
            "a multiple of half the window, or --skip-monai"
        )


def budget_split(budget_bytes: int) -> tuple[int, int]:
    """The chunk cache's and the tiles' bytes of a --memory-budget-mb, as `ctseg predict`
    splits it (`ctseg.inference.scroll.predict_scroll`: CACHE_SHARE to the cache, TILE_SHARE to
    the tiles where the module has one, else the rest)."""
    from ctseg.inference import scroll as product

    cache = int(budget_bytes * product.CACHE_SHARE)
    tile_share = getattr(product, "TILE_SHARE", None)
    tiles = int(budget_bytes * tile_share) if tile_share is not None else budget_bytes - cache
    return cache, tiles


def check_tile_fits(shape: tuple[int, int, int], window: int, budget_mb: float) -> None:
    """Refuse, before any child runs, a section 2 volume whose budget holds no tile."""
    from ctseg.inference.tiled import working_bytes_per_voxel
    from ctseg.inference.tiles import plan_tile
    from ctseg.io import CtsegError

    chunks = tuple(min(window, s) for s in shape)
    _, tiles = budget_split(int(budget_mb * 2**20))
    per_voxel = working_bytes_per_voxel(1, 1)
    try:
        plan_tile(shape, (window,) * 3, chunks, per_voxel, tiles)
    except CtsegError:
        need = per_voxel * (2 * window) ** 3 * budget_mb * 2**20 / tiles / 2  # voxels
        raise BenchError(
            f"--large-shape {fmt_shape(shape)}: its budget ({budget_mb:.3g} MB, a quarter of its "
            f"in-memory working set) leaves the tiles {tiles / 2**20:.3g} MB, less than one tile "
            f"of a {window}^3 chunk with its window needs; give a volume of about {need:.0f} "
            "voxels or more"
        ) from None


# ---------------------------------------------------------------- child side (--one)
def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peak_mb() -> float:
    """This process's peak RSS since exec or the last `_reset_high_water` (VmHWM); where Linux
    gives none, ``ru_maxrss``, which includes this script's peak (it forked the child)."""
    peak = _high_water_mb()
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _reset_high_water() -> bool:
    """Reset this process's peak RSS (VmHWM; Linux >= 4.0), so that the peak read after a run
    is the run's own, not the warm-up's; False where it cannot be reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _high_water_mb() is not None


def _high_water_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _settings(spec: dict) -> Any:
    from ctseg.inference.settings import InferenceSettings

    given = {}
    if spec.get("device_budget_mb") is not None:
        given["device_budget_mb"] = float(spec["device_budget_mb"])
    return InferenceSettings(
        window=tuple(spec["window"]),
        overlap=OVERLAP,
        batch_size=int(spec["batch"]),
        memory_budget_mb=float(spec["budget_mb"]),
        device=spec["device"],
        **given,
    )


def _tiled_pieces(spec: dict, settings: Any, device: Any) -> tuple[Any, Any, Any, int]:
    """The source, its work folder and tile settings, as `ctseg predict` makes them
    (`budget_split`)."""
    import dataclasses

    from ctseg.inference.source import intensity_range, open_source
    from ctseg.inference.tiled import open_work

    budget = int(settings.memory_budget_mb * 2**20)
    cache, tiles = budget_split(budget)
    tile_settings = dataclasses.replace(settings, memory_budget_mb=tiles / 2**20)
    source = open_source(spec["store"])
    low, high, _ = intensity_range(source, None, budget)
    work = open_work(Path(spec["out"]), source, tile_settings, device, low, high)
    return source, work, tile_settings, cache


def _tile_voxels(work: Any, tiles: list) -> int:
    """Voxels of the tiles' boxes (whole chunks, clipped to the volume)."""
    grid = work.grid
    return sum(
        math.prod(
            min((i + 1) * t, s) - i * t for i, t, s in zip(tile, grid.tile, grid.shape, strict=True)
        )
        for tile in tiles
    )


def _heap_policy() -> None:
    """The allocator settings `ctseg predict` makes before its warm-up (`tune_malloc`: freed
    activations stay in the heap); the per-tile `release_heap` is `run_part`'s own."""
    from ctseg.data.heap import tune_malloc

    tune_malloc()


def one(which: str, spec: dict) -> dict:
    """One measurement in this process (`which`: one of `RUNS`)."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    # Imported before the clock starts, as `ctseg predict` has them imported when it starts.
    import ctseg.inference.run
    import ctseg.inference.scroll  # noqa: F401

    if which == "monai":
        import monai.inferers  # noqa: F401
    settings = _settings(spec)
    device = settings.torch_device()
    win = settings.checked_window()
    amp = settings.use_amp(device)
    rss_loaded = _rss_mb()
    if which in ("tiled", "part", "finish", "forward"):
        _heap_policy()  # as `ctseg predict`: the model loaded, before the warm-up
    model = None
    if which != "finish":
        model = infer.load(spec["weights"], device)
        rss_loaded = _rss_mb()
        model.to(memory_format=settings.memory_format(device))
        with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=amp):
            model(torch.zeros(settings.batch_size, 1, *win, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    peak_warm = _peak_mb()
    rss_before = _rss_mb()
    _reset_high_water()
    profiler = None
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start, cpu_start = time.perf_counter(), time.process_time()
    figures = RUNS[which](model, spec, settings, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(spec["profile"])
    # The run's own peak: VmHWM reset after the warm-up, else the process's (an upper bound).
    run_peak = _peak_mb()
    return {
        **figures,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "minor_faults": faults,
        "peak_mb": max(peak_warm, run_peak),
        "run_peak_mb": run_peak,
        "rss_loaded_mb": rss_loaded,
        "peak_warm_mb": peak_warm,
        "rss_before_mb": rss_before,
        "threads": torch.get_num_threads(),
    }


def run_monai(model: Any, spec: dict, settings: Any, device: Any) -> dict:
    """MONAI from the store to a float16 store, as `infer_volume` goes: read, normalise (ctseg's
    function), to the device, `sliding_window_inference`, back, written chunked like the input."""
    import torch
    from monai.inferers import sliding_window_inference

    from ctseg.inference.blend import normalise
    from ctseg.store import create_volume, open_volume

    amp = settings.use_amp(device)

    def predictor(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            return torch.sigmoid(model(x).float())

    image = open_volume(spec["store"])
    low, high = float(image.attrs["p0_5"]), float(image.attrs["p99_5"])
    x = torch.from_numpy(normalise(np.asarray(image[...]), low, high))[None, None].to(device)
    with torch.inference_mode():
        out = sliding_window_inference(
            x, settings.checked_window(), settings.batch_size, predictor, overlap=OVERLAP,
            mode="gaussian", sigma_scale=SIGMA_SCALE,
        )  # fmt: skip
    probs = out[0, 0].cpu().numpy().astype(np.float16)
    dest = create_volume(spec["out"], image.shape, np.float16, image.chunks)
    dest[...] = probs
    return {}


def run_memory(model: Any, spec: dict, settings: Any, device: Any) -> dict:
    from ctseg.inference.run import infer_volume

    done = infer_volume(model, Path(spec["store"]), Path(spec["out"]), settings)
    return {"tiles": done["tiles"], "windows": done["windows"]}


def run_tiled(model: Any, spec: dict, settings: Any, device: Any) -> dict:
    """`ctseg predict`'s probabilities in one process: open, part 0 of 1, finish."""
    from ctseg.inference.tiled import finish, run_part

    source, work, tile_settings, cache = _tiled_pieces(spec, settings, device)
    part = run_part(model, work, source, tile_settings, device, 0, 1, cache)
    t0 = time.perf_counter()
    finish(work, 1)
    return {
        **_part_figures(part),
        "tiles": len(work.grid.tiles()),
        "voxels": math.prod(source.shape),
        "finish_seconds": time.perf_counter() - t0,
    }


def run_one_part(model: Any, spec: dict, settings: Any, device: Any) -> dict:
    from ctseg.inference.tiled import run_part
    from ctseg.inference.tiles import part_tiles

    source, work, tile_settings, cache = _tiled_pieces(spec, settings, device)
    k, n = int(spec["part"]), int(spec["parts"])
    part = run_part(model, work, source, tile_settings, device, k, n, cache)
    mine = part_tiles(work.grid.tiles(), n, k)
    return {**_part_figures(part), "tiles": len(mine), "voxels": _tile_voxels(work, mine)}


def run_finish(model: Any, spec: dict, settings: Any, device: Any) -> dict:
    from ctseg.inference.tiled import finish

    _, work, _, _ = _tiled_pieces(spec, settings, device)
    return finish(work, int(spec["parts"]))


def run_forward(model: Any, spec: dict, settings: Any, device: Any) -> dict:
    """Forwards alone, on batches of zeros: the memory a forward takes in a warm process (its
    activations, as the allocator keeps or returns them), to tell apart from a path's own."""
    import torch

    win = settings.checked_window()
    amp = settings.use_amp(device)
    with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=amp):
        for _ in range(int(spec["forwards"])):
            model(torch.zeros(settings.batch_size, 1, *win, device=device))
    return {}


def _part_figures(part: dict) -> dict:
    keys = ("windows", "read_amplification", "bytes_fetched", "bytes_of_region",
            "peak_cached_bytes", "tile", "chunks_final")  # fmt: skip
    return {**{k: part[k] for k in keys}, "part_seconds": part["seconds"]}


RUNS = {
    "monai": run_monai,
    "memory": run_memory,
    "tiled": run_tiled,
    "part": run_one_part,
    "finish": run_finish,
    "forward": run_forward,
}


# ---------------------------------------------------------------- parent side
def fmt_shape(shape: Any) -> str:
    return "x".join(str(int(s)) for s in shape)


def measure(which: str, spec: dict, timeout: float) -> dict:
    """Run one measurement in a fresh child; its figures, or a BenchError of one line."""
    command = [sys.executable, __file__, "--one", which, "--spec", json.dumps(spec)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{which} child: no result within {timeout:g} s (--timeout)") from None
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else "(nothing on stderr)"
        raise BenchError(f"{which} child failed (status {proc.returncode}): {last}")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise BenchError(f"{which} child printed no figures") from None


def read_probs(path: Path) -> np.ndarray:
    import zarr

    return np.asarray(zarr.open_array(str(path), mode="r")[...])


def same_bits(a: Path, b: Path) -> bool:
    x, y = read_probs(a), read_probs(b)
    return x.shape == y.shape and np.array_equal(x.view(np.uint16), y.view(np.uint16))


def rate(voxels: int, seconds: float) -> float:
    return voxels / seconds if seconds > 0 else float("inf")


def increase(m: dict) -> float:
    """MB the run adds to the warm process: its own peak less the RSS just before it."""
    return m["run_peak_mb"] - m["rss_before_mb"]


def row(name: str, m: dict, voxels: int) -> str:
    return (
        f"  {name:<50}{m['seconds']:8.2f}{m['cpu_seconds']:8.2f}{rate(voxels, m['seconds']):10.0f}"
        f"{m['peak_mb']:9.0f}{increase(m):+7.1f}{m['minor_faults'] / 1e3:9.0f}"
    )


HEADER = (
    f"  {'path':<50}{'seconds':>8}{'cpu s':>8}{'voxels/s':>10}{'peak RSS':>9}{'+run':>7}"
    f"{'faults k':>9}"
)


def ratios(fast: dict, slow: dict) -> str:
    """fast's voxels/s over slow's, by wall time and by CPU time."""
    return (
        f"{slow['seconds'] / fast['seconds']:.3f} (by CPU time "
        f"{slow['cpu_seconds'] / fast['cpu_seconds']:.3f})"
    )


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.base = {
            "window": [args.window] * 3,
            "batch": args.batch_size,
            "device": args.device,
            "threads": args.threads,
        }

    def run(self, which: str, **spec: Any) -> dict:
        return measure(which, {**self.base, **spec}, self.args.timeout)

    def fastest(self, plan: dict[str, tuple[str, dict]]) -> dict[str, dict]:
        """Each of `plan` (key: (which, spec)) run --repeat times, the order rotated each round
        (a shared machine's load drifts), into a fresh output each round (`out` + ``-r<i>``);
        the fastest run of each, with the output of its first round as ``first_out``."""
        keys = list(plan)
        best: dict[str, dict] = {}
        for r in range(self.args.repeat):
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                which, spec = plan[key]
                out = Path(spec["out"])
                m = self.run(which, **{**spec, "out": str(out.with_name(f"{out.name}-r{r}"))})
                m["first_out"] = str(out.with_name(f"{out.name}-r0"))
                m["rounds"] = best.get(key, {}).get("rounds", []) + [m["seconds"]]
                if key not in best or m["seconds"] < best[key]["seconds"]:
                    best[key] = m
                else:
                    best[key]["rounds"] = m["rounds"]
        return best

    # -------------------------------------------------------------- section 1
    def fits(self, weights: Path, shape: tuple[int, int, int]) -> str:
        args, tmp = self.args, self.tmp
        store = make_volume(tmp / "fits.zarr", shape, args.window, seed=1)
        voxels = math.prod(shape)
        common = {"weights": str(weights), "store": str(store), "budget_mb": GENEROUS_MB}
        plan = {}
        if not args.skip_monai:
            check_monai_grid(shape, (args.window,) * 3)
            plan["monai"] = ("monai", {**common, "out": str(tmp / "fits-monai.zarr")})
        plan["memory"] = ("memory", {**common, "out": str(tmp / "fits-memory.zarr")})
        plan["tiled"] = ("tiled", {**common, "out": str(tmp / "fits-tiled.work")})
        runs = self.fastest(plan)
        memory, tiled, monai = runs["memory"], runs["tiled"], runs.get("monai")
        identical = same_bits(
            Path(memory["first_out"]), Path(tiled["first_out"]) / "probabilities.zarr"
        )
        print(
            f"\n1. A volume that fits: {fmt_shape(shape)} uint8, window {args.window}^3, overlap "
            f"{OVERLAP}, batch {args.batch_size}, {memory['windows']} windows, {args.device}, "
            f"{tiled['threads']} thread(s); Zarr store to float16 Zarr store; fastest of "
            f"{args.repeat}; memory in MB"
        )
        print(HEADER)
        names = {
            "monai": "(a) MONAI sliding_window_inference",
            "memory": f"(b) ctseg infer_volume ({memory['tiles']} tile(s))",
            "tiled": f"(c) ctseg tiled, budget {GENEROUS_MB} MB",
        }
        for key, m in runs.items():
            print(row(names[key], m, voxels))
        c_over_b = memory["seconds"] / tiled["seconds"]
        print(
            f"  voxels/s (c)/(b): {ratios(tiled, memory)}; tiled: {tiled['tiles']} tile(s) of "
            f"{fmt_shape(tiled['tile'])}, read amplification {tiled['read_amplification']:.3f}, "
            f"finish {tiled['finish_seconds']:.2f} s"
        )
        fields = [f"c_over_b={c_over_b:.3f}", f"identical={int(identical)}",
                  f"read_amplification={tiled['read_amplification']:.3f}"]  # fmt: skip
        if monai:
            b_over_a = monai["seconds"] / memory["seconds"]
            print(f"  voxels/s (b)/(a): {ratios(memory, monai)}")
            fields.insert(0, f"b_over_a={b_over_a:.3f}")
        print(f"  (b) and (c) bit for bit: {'yes' if identical else 'NO'}")
        if monai:
            agree = infer.agreement(
                read_probs(Path(memory["first_out"])), read_probs(Path(monai["first_out"]))
            )
            print(
                f"  MONAI vs (b): mean |dp| {agree['mean_abs']:.5f} (max {agree['max_abs']:.4f}), "
                f"masks (p > 0.5) differ on {100 * agree['mask_differ']:.2f}% of voxels: MONAI "
                "clamps its Gaussian map at 1e-3 (ctseg's falls to ~1e-10 at a window's corners) "
                "and a random-init network's windows disagree near their borders"
            )
            fields.append(f"monai_mean_abs_dp={agree['mean_abs']:.5f}")
        fields += [f"{k}_voxels_per_s={rate(voxels, m['seconds']):.0f}" for k, m in runs.items()]
        fields += [f"{k}_rss_increase_mb={increase(m):.0f}" for k, m in runs.items()]
        if not identical:
            raise BenchError("the tiled path's probabilities differ from the in-memory path's")
        return f"RESULT scroll_fits {' '.join(fields)}"

    # -------------------------------------------------------------- section 2
    def large(self, weights: Path, shape: tuple[int, int, int]) -> tuple[str, dict, Path]:
        args, tmp = self.args, self.tmp
        store = make_volume(tmp / "large.zarr", shape, args.window, seed=2)
        voxels = math.prod(shape)
        volume_mb = voxels / 2**20
        budget_mb = WORKING_BYTES_PER_VOXEL * volume_mb / BUDGET_FACTOR
        common = {"weights": str(weights), "store": str(store)}
        plan = {
            "memory": ("memory", {**common, "out": str(tmp / "large-memory.zarr"),
                                  "budget_mb": GENEROUS_MB}),
            "tiled": ("tiled", {**common, "out": str(tmp / "large-parts1.work"),
                                "budget_mb": budget_mb}),
        }  # fmt: skip
        runs = self.fastest(plan)
        memory, tiled = runs["memory"], runs["tiled"]
        # The forwards alone (as many as a tile's), for the memory that is not the path's own.
        forward = self.run("forward", **common, out="", budget_mb=budget_mb, forwards=4)
        if args.profile:
            profiled = {"out": str(tmp / "large-profiled.work"), "profile": str(args.profile)}
            self.run("tiled", **{**plan["tiled"][1], **profiled})
        identical = same_bits(
            Path(memory["first_out"]), Path(tiled["first_out"]) / "probabilities.zarr"
        )
        ratio = memory["seconds"] / tiled["seconds"]
        met = ratio >= TARGET_RATIO
        print(
            f"\n2. A volume 4x the budget: {fmt_shape(shape)} uint8 ({volume_mb:.2f} MB), "
            f"budget {budget_mb:.2f} MB: the in-memory working set counted at "
            f"{WORKING_BYTES_PER_VOXEL} B/voxel (float32 input + accumulator) is "
            f"{WORKING_BYTES_PER_VOXEL * volume_mb / budget_mb:.1f}x the budget, the uint8 volume "
            f"{volume_mb / budget_mb:.2f}x; {memory['windows']} windows; fastest of {args.repeat}"
        )
        print(HEADER)
        print(row(f"in-memory infer_volume ({memory['tiles']} tile(s))", memory, voxels))
        print(row(f"tiled, budget {budget_mb:.2f} MB", tiled, voxels))
        print(row("forwards alone (4 batches; no voxels)", forward, 0))
        print(
            f"  voxels/s tiled / in-memory: {ratios(tiled, memory)}, target >= {TARGET_RATIO}: "
            f"{'met' if met else 'NOT met'}; {tiled['tiles']} tiles of {fmt_shape(tiled['tile'])} "
            f"({tiled['windows'] / tiled['tiles']:.1f} windows a tile), "
            f"read amplification {tiled['read_amplification']:.3f}, chunk cache peak "
            f"{tiled['peak_cached_bytes'] / 2**20:.2f} MB, finish {tiled['finish_seconds']:.2f} s"
        )
        own = increase(tiled) - increase(forward)
        print(
            f"  tiled peak RSS increase over the warm model: {increase(tiled):+.1f} MB = "
            f"{increase(tiled) / budget_mb:.2f}x the budget; less the forwards' own "
            f"({increase(forward):+.1f} MB, which the budget does not count): {own:+.1f} MB = "
            f"{own / budget_mb:.2f}x the budget"
        )
        print(f"  in-memory and tiled bit for bit: {'yes' if identical else 'NO'}")
        if args.profile:
            print_profile(args.profile)
        if not identical:
            raise BenchError("the tiled path's probabilities differ from the in-memory path's")
        fields = [
            f"tiled_over_memory={ratio:.3f}",
            f"tiled_over_memory_cpu={memory['cpu_seconds'] / tiled['cpu_seconds']:.3f}",
            f"target={TARGET_RATIO}",
            f"met={int(met)}",
            f"budget_mb={budget_mb:.2f}",
            f"working_set_over_budget={WORKING_BYTES_PER_VOXEL * volume_mb / budget_mb:.1f}",
            f"uint8_over_budget={volume_mb / budget_mb:.2f}",
            f"tiled_rss_increase_mb={increase(tiled):.1f}",
            f"forward_rss_increase_mb={increase(forward):.1f}",
            f"tiled_own_over_budget={own / budget_mb:.2f}",
            f"read_amplification={tiled['read_amplification']:.3f}",
            f"tiles={tiled['tiles']}",
            f"windows_per_tile={tiled['windows'] / tiled['tiles']:.1f}",
            f"memory_faults={memory['minor_faults']}",
            f"tiled_faults={tiled['minor_faults']}",
            f"identical={int(identical)}",
            f"memory_voxels_per_s={rate(voxels, memory['seconds']):.0f}",
            f"tiled_voxels_per_s={rate(voxels, tiled['seconds']):.0f}",
        ]
        return f"RESULT scroll_budget {' '.join(fields)}", {**tiled, "budget_mb": budget_mb}, store

    # -------------------------------------------------------------- section 3
    def parts(self, weights: Path, store: Path, shape: tuple[int, int, int], single: dict) -> str:
        args, tmp = self.args, self.tmp
        voxels = math.prod(shape)
        budget_mb = single["budget_mb"]
        reference = Path(single["first_out"]) / "probabilities.zarr"
        print(
            f"\n3. Parts run one after another, each in its own process: {fmt_shape(shape)}, "
            f"budget {budget_mb:.2f} MB, {single['tiles']} tiles; a part's voxels/s counts the "
            "voxels of its tiles"
        )
        print(f"  {'N':>3}  {'part':<7}{'tiles':>6}{'windows':>9}{'seconds':>9}{'cpu s':>8}"
              f"{'voxels/s':>10}{'read amp':>10}{'+run MB':>9}")  # fmt: skip

        def part_row(n: int, name: str, p: dict, seconds: float, part_voxels: int) -> None:
            print(f"  {n:>3}  {name:<7}{p['tiles']:6d}{p['windows']:9d}{seconds:9.2f}"
                  f"{p['cpu_seconds']:8.2f}{rate(part_voxels, seconds):10.0f}"
                  f"{p['read_amplification']:10.3f}{increase(p):+9.1f}")  # fmt: skip

        def total_row(n: int, seconds: float, cpu: float, note: str) -> None:
            print(f"  {n:>3}  {'total':<7}{'':>6}{'':>9}{seconds:9.2f}{cpu:8.2f}"
                  f"{rate(voxels, seconds):10.0f}  {note}")  # fmt: skip

        one_total = single["seconds"]
        part_row(1, "0", single, single["part_seconds"], voxels)
        note = f"(open + part + finish {single['finish_seconds']:.2f} s: section 2's run)"
        total_row(1, one_total, single["cpu_seconds"], note)
        fields = [f"parts1_voxels_per_s={rate(voxels, one_total):.0f}"]
        all_identical = True
        for n in args.parts:
            if n == 1:
                continue
            folder = tmp / f"large-parts{n}.work"
            spec = {"weights": str(weights), "store": str(store), "out": str(folder),
                    "budget_mb": budget_mb, "parts": n}  # fmt: skip
            done = [self.run("part", **spec, part=k) for k in range(n)]
            end = self.run("finish", **spec)
            for k, p in enumerate(done):
                part_row(n, str(k), p, p["seconds"], p["voxels"])
            print(f"  {n:>3}  {'finish':<7}{'':>6}{'':>9}{end['seconds']:9.2f}"
                  f"{end['cpu_seconds']:8.2f}{'':>10}{'':>10}{increase(end):+9.1f}  "
                  f"({end['seam_chunks_final']} seam chunks)")  # fmt: skip
            total = sum(p["seconds"] for p in done) + end["seconds"]
            cpu = sum(p["cpu_seconds"] for p in done) + end["cpu_seconds"]
            identical = same_bits(reference, folder / "probabilities.zarr")
            all_identical &= identical
            total_row(n, total, cpu, f"({one_total / total:.3f}x 1 part, by CPU time "
                      f"{single['cpu_seconds'] / cpu:.3f}x; the same bits as 1 part: "
                      f"{'yes' if identical else 'NO'})")  # fmt: skip
            per_part = [rate(p["voxels"], p["seconds"]) for p in done]
            windows = [p["windows"] for p in done]
            fields += [
                f"parts{n}_voxels_per_s={rate(voxels, total):.0f}",
                f"parts{n}_over_1={one_total / total:.3f}",
                f"parts{n}_over_1_cpu={single['cpu_seconds'] / cpu:.3f}",
                f"parts{n}_part_voxels_per_s={min(per_part):.0f}-{max(per_part):.0f}",
                f"parts{n}_part_windows={min(windows)}-{max(windows)}",
                f"parts{n}_finish_s={end['seconds']:.2f}",
                f"parts{n}_identical={int(identical)}",
            ]
        if not all_identical:
            raise BenchError("a split run's probabilities differ from the 1-part run's")
        return f"RESULT scroll_parts {' '.join(fields)}"


def print_profile(path: Path) -> None:
    import io
    import pstats

    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(str(path), stream=out).sort_stats(key).print_stats(15)
        text = out.getvalue()
        start = text.find("   ncalls")
        print(f"\n  cProfile of section 2's tiled child, by {key}:\n{text[start:]}")


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected Z,Y,X (three positive integers)")
    return shape  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="window 16^3, small volumes: ~40 s")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads in each child (default: 1 on a CPU, torch's own on a "
                        "GPU; 0: torch's own)")  # fmt: skip
    parser.add_argument("--window", type=int, default=None, help="window edge (24; quick 16)")
    parser.add_argument("--fits-shape", type=parse_shape, default=None, help="section 1 Z,Y,X")
    parser.add_argument("--large-shape", type=parse_shape, default=None, help="sections 2-3 Z,Y,X")
    parser.add_argument("--section2-size", choices=["default", *SECTION2_SIZES],
                        default="default", help="sections 2-3 volume preset: default (96x160x160, "
                        "budget 4.69 MB) or large (192x288x288, budget 30.4 MB; ~5 min with "
                        "--skip-monai --parts 1)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=BATCH, help="windows per forward")
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 3], help="part counts (1 3)")
    parser.add_argument("--skip-monai", action="store_true", help="leave MONAI (a) out")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each path in sections 1-2 (fastest)"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per child (900)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the temp dir goes")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="cProfile section 2's tiled child into FILE; print its top",
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="instead: the scaling over parts (bench/scroll_scaling.py; its options follow)",
    )
    parser.add_argument("--one", default=None, choices=sorted(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    if "--scaling" in sys.argv[1:]:  # its own options (--parts among them) follow
        import scroll_scaling

        scroll_scaling.main([a for a in sys.argv[1:] if a != "--scaling"])
        return
    args = parser.parse_args()

    if args.one:
        print(json.dumps(one(args.one, json.loads(args.spec))))
        return

    window, fits_shape, large_shape = SIZES["quick" if args.quick else "full"]
    args.window = args.window or window
    fits_shape = args.fits_shape or fits_shape
    large_shape = args.large_shape or SECTION2_SIZES.get(args.section2_size, large_shape)
    if args.threads is None:
        args.threads = 0 if args.device.startswith("cuda") else 1
    if args.repeat < 1:
        raise SystemExit("bench/scroll.py: --repeat: expected a positive number")
    if any(n < 1 for n in args.parts):
        raise SystemExit("bench/scroll.py: --parts: expected positive part counts")
    if not args.skip_monai and not infer.monai_installed():
        raise SystemExit(
            "bench/scroll.py: section 1's MONAI comparison needs MONAI, a bench-only extra: "
            f"install it with `{INSTALL_MONAI}` (or pass --skip-monai)"
        )
    print(f"machine: {infer.machine()}; children run {args.threads or 'torch default'} thread(s)")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        budget_mb = WORKING_BYTES_PER_VOXEL * math.prod(large_shape) / 2**20 / BUDGET_FACTOR
        check_tile_fits(large_shape, args.window, budget_mb)
        with tempfile.TemporaryDirectory(prefix="ctseg-bench-scroll-", dir=args.workdir) as tmp:
            bench = Bench(args, Path(tmp))
            weights = infer.decisive_weights(
                Path(tmp) / "unet.pt", UNET, (args.window,) * 3,
                make_volume(Path(tmp) / "head.zarr", (args.window,) * 3, args.window, seed=0),
            )  # fmt: skip
            print(bench.fits(weights, fits_shape))
            line, single, store = bench.large(weights, large_shape)
            print(line)
            print(bench.parts(weights, store, large_shape, single))
    except BenchError as exc:
        raise SystemExit(f"bench/scroll.py: {exc}") from None
    print(f"\n(whole run {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
