"""A volume predicted in place (`ctseg.inference.tiles`, `tiled`, `scroll`): tiles, parts and
resumed runs give the in-memory path's probabilities bit for bit; the host memory stays under
the budget; the mask equals the in-memory mask; the OME-Zarr output is valid; remote inputs
(loopback S3, HTTP) work; bad requests are one line."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
import zarr
from conftest import BIN, s3_options, upload
from test_volume_source import http_root  # noqa: F401 (a fixture)

from ctseg.inference.run import infer_volume
from ctseg.inference.settings import InferenceSettings
from ctseg.inference.source import open_source
from ctseg.inference.tiled import MANIFEST, open_work, run_part
from ctseg.inference.tiled import finish as finish_work
from ctseg.inference.tiles import TileGrid, part_tiles
from ctseg.inference.windows import check_coverage, from_fixed, to_fixed, window_starts
from ctseg.io import CtsegError
from ctseg.labels import LabelSpec
from ctseg.network.model import build_model
from ctseg.ome_zarr import check_image
from ctseg.postprocess.masks import PostprocessSettings, binary_mask
from ctseg.store import create_volume, open_volume
from ctseg.training.checkpoint import save_checkpoint

LOW, HIGH = 10.0, 240.0
CPU = torch.device("cpu")


def volume(shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    zz = np.arange(shape[0])[:, None, None]
    data = rng.integers(0, 256, size=shape) * 0.5 + 90 * np.sin(zz / 4) + 60
    return np.clip(data, 0, 255).astype(np.uint8)


def zarr_volume(path: Path, data: np.ndarray, chunks=(16, 16, 16), stats: bool = True) -> Path:
    """A Zarr array of `data`; with `stats`, the intensity range LOW..HIGH as its attributes
    (else predict computes it as `ctseg convert` does)."""
    attributes = {"p0_5": LOW, "p99_5": HIGH} if stats else {}
    arr = create_volume(path, data.shape, np.uint8, chunks, attributes=attributes)
    arr[...] = data
    return path


def unet(out_channels: int = 1, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model({"filters": [4, 8], "out_channels": out_channels}).eval()


def tiled(model, store, work, settings, parts=1, labels=None, cache=1 << 20) -> np.ndarray:
    source = open_source(str(store))
    w = open_work(work, source, settings, CPU, LOW, HIGH, None, labels)
    for k in range(parts):
        run_part(model, w, source, settings, CPU, k, parts, cache)
    finish_work(w, parts)
    return w, w.probabilities()[...]


# ----------------------------------------------------------------------------- exact sums
def test_the_exact_sum_is_ieee_arithmetic_in_any_order():
    # to_fixed and from_fixed are torch, on the device or the host: each step is one IEEE
    # operation, so numpy's same steps give the same bits (as a GPU's do).
    rng = np.random.default_rng(1)
    weighted = (rng.random((6, 7, 8)) ** 4).astype(np.float32)
    fixed = to_fixed(torch.from_numpy(weighted)).numpy()
    np.testing.assert_array_equal(fixed, (weighted * np.float32(2**50)).astype(np.int64))
    total = fixed * 3 + to_fixed(torch.from_numpy(weighted[::-1].copy())).numpy()
    norm_z = (rng.random(6) + 0.5).astype(np.float32)
    norm_yx = (rng.random((7, 8)) + 0.5).astype(np.float32)
    ours = from_fixed(torch.from_numpy(total), norm_z, norm_yx).numpy()
    steps = (total.astype(np.float64) * 2.0**-50).astype(np.float32)
    steps /= norm_yx
    steps /= norm_z[:, None, None]
    np.testing.assert_array_equal(ours, steps.astype(np.float16))
    # The sum is exact: any order of the same terms gives the same integers.
    terms = [to_fixed(torch.rand((4, 4, 4), generator=torch.Generator().manual_seed(i)))
             for i in range(9)]  # fmt: skip
    assert torch.equal(sum(terms), sum(reversed(terms)))
    # and close to the float64 blend
    expected = (weighted.astype(np.float64) * 3 + weighted[::-1]) / norm_yx / norm_z[:, None, None]
    np.testing.assert_allclose(ours.astype(np.float64), expected, rtol=1e-3, atol=1e-6)


def test_an_overlap_whose_windows_overflow_the_sum_is_refused():
    starts = [window_starts(400, 100, 0.95)] * 3
    with pytest.raises(CtsegError, match="overlap=0.95: up to .* windows cover one voxel"):
        check_coverage(starts, (100, 100, 100), 0.95)
    check_coverage([window_starts(400, 100, 0.9)] * 3, (100, 100, 100), 0.9)


# ----------------------------------------------------------------------------- tiles
@pytest.mark.parametrize("tile", [(16, 16, 16), (32, 16, 48), (64, 64, 64)])
def test_every_window_belongs_to_one_tile_and_every_chunk_to_its_contributors(tile):
    shape, window = (50, 40, 60), (12, 16, 10)
    starts = tuple(tuple(window_starts(s, w, 0.5)) for s, w in zip(shape, window, strict=True))
    grid = TileGrid(shape, window, starts, (16, 16, 16), tile)
    owned = [c for t in grid.tiles() for c in grid.corners(t)]
    every = [(z, y, x) for z in starts[0] for y in starts[1] for x in starts[2]]
    assert sorted(owned) == sorted(every)
    for chunk in grid.all_chunks():
        box = grid.chunk_box(chunk)
        reaching = {
            t
            for t in grid.tiles()
            for c in grid.corners(t)
            if all(c[a] < box[a][1] and box[a][0] < c[a] + window[a] for a in range(3))
        }
        assert reaching <= set(grid.contributors(chunk))
    tiles = grid.tiles()
    split = [part_tiles(tiles, 3, k) for k in range(3)]
    assert [t for part in split for t in part] == tiles
    with pytest.raises(CtsegError, match="--part 3: expected 0 <= part < --parts 3"):
        part_tiles(tiles, 3, 3)


# ----------------------------------------------------------------------------- bit for bit
@pytest.mark.parametrize(
    "case",
    [
        {"parts": 1},
        {"parts": 3},
        {"parts": 2, "tta_flips": True, "shape": (24, 40, 36), "budget": 0.55},  # 8 forwards
        {"parts": 3, "background": 0},
        {"parts": 2, "classes": 3},
    ],
)
def test_tiles_and_parts_give_the_in_memory_probabilities_bit_for_bit(tmp_path, case):
    data = volume(case.get("shape", (40, 52, 44)), seed=2)
    data[:, :24, :] = 0  # outside the "scroll": windows there are skipped with a background
    store = zarr_volume(tmp_path / "v.zarr", data)
    classes = case.get("classes", 1)
    labels = None
    if classes > 1:
        labels = LabelSpec(labels={"background": 0, "sheet": 10, "fibre": 20, "pore": 30})
    model = unet(1 if classes == 1 else classes + 1)
    common = {
        "window": (16, 16, 16),
        "batch_size": 3,
        "device": "cpu",
        "tta_flips": case.get("tta_flips", False),
        "background": case.get("background"),
    }
    reference = tmp_path / "ref.zarr"
    info = infer_volume(
        model, store, reference, InferenceSettings(**common, device_budget_mb=64), labels=labels
    )
    assert info["tiles"] == 1  # the whole volume held at once
    # Tiles of one or two chunks (a model of C channels holds C int64 sums a voxel).
    budget = case.get("budget", 0.9 if classes == 1 else 2.6)
    small = InferenceSettings(**common, memory_budget_mb=budget)
    work, probs = tiled(model, store, tmp_path / "work", small, case["parts"], labels)
    assert len(work.grid.tiles()) >= 6
    np.testing.assert_array_equal(probs, open_volume(reference)[...])
    if case.get("background") is not None:
        assert info["skipped_windows"] > 0


def test_the_next_tile_is_read_on_a_thread_while_a_tile_runs(tmp_path, monkeypatch):
    """run_part reads tile i + 1's input on its read-ahead thread while tile i computes, and the
    probabilities are those of the held volume."""
    import threading

    import ctseg.inference.tiled as tiled_module
    from ctseg.inference.source import ChunkCache

    events: list[tuple[str, int]] = []
    read, run_tile = ChunkCache.read, tiled_module._run_tile

    def logged_read(self, box):
        events.append(("read", threading.current_thread().name.startswith("ctseg-read-ahead")))
        return read(self, box)

    def slow_tile(*args, **kwargs):
        events.append(("tile", 0))
        time.sleep(0.2)  # time for the thread to start the next read
        shared = run_tile(*args, **kwargs)
        events.append(("done", 0))
        return shared

    monkeypatch.setattr(ChunkCache, "read", logged_read)
    monkeypatch.setattr(tiled_module, "_run_tile", slow_tile)
    store = zarr_volume(tmp_path / "v.zarr", volume((40, 48, 40), seed=4))
    model = unet()
    settings = InferenceSettings(window=(16, 16, 16), batch_size=3, device="cpu",
                                 memory_budget_mb=0.9)  # fmt: skip
    work, probs = tiled(model, store, tmp_path / "work", settings)
    tiles = len(work.grid.tiles())
    kinds = [kind for kind, _ in events]
    assert tiles >= 3 and kinds.count("read") == tiles == kinds.count("tile")
    assert all(on_thread for kind, on_thread in events if kind == "read")
    # Each read after the first starts before the tile before it ends (it is handed to the
    # thread just before that tile starts: which of the two logs first is the threads' race).
    starts, ends, reads = ([j for j, k in enumerate(kinds) if k == kind]
                           for kind in ("tile", "done", "read"))  # fmt: skip
    assert reads[0] < starts[0]
    assert all(reads[i] < ends[i - 1] for i in range(1, tiles)), kinds
    reference = tmp_path / "ref.zarr"
    held = InferenceSettings(window=(16, 16, 16), batch_size=3, device="cpu", device_budget_mb=64)
    infer_volume(model, store, reference, held)
    np.testing.assert_array_equal(probs, open_volume(reference)[...])


def test_a_killed_run_resumes_and_changed_settings_are_refused(tmp_path, monkeypatch):
    import ctseg.inference.tiled as tiled_module

    store = zarr_volume(tmp_path / "v.zarr", volume((40, 48, 40), seed=3))
    model = unet()
    settings = InferenceSettings(window=(16, 16, 16), batch_size=2, device="cpu",
                                 memory_budget_mb=0.9)  # fmt: skip
    _, whole = tiled(model, store, tmp_path / "whole", settings)

    real, calls = tiled_module._run_tile, []

    def dies_after_three(*args, **kwargs):
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a kill would stop it, between tiles
        calls.append(1)
        return real(*args, **kwargs)

    source = open_source(str(store))
    work = open_work(tmp_path / "work", source, settings, CPU, LOW, HIGH)
    monkeypatch.setattr(tiled_module, "_run_tile", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_part(model, work, source, settings, CPU)
    monkeypatch.setattr(tiled_module, "_run_tile", real)
    # A half-written spill of the killed run is a temporary: never read.
    (work.folder / "spill" / "junk.npy.tmp-1").write_bytes(b"half")
    other = InferenceSettings(window=(16, 16, 16), overlap=0.25, device="cpu")
    with pytest.raises(
        CtsegError, match=r"work: an unfinished predict of other settings .*overlap"
    ):
        open_work(tmp_path / "work", source, other, CPU, LOW, HIGH)
    with pytest.raises(CtsegError, match="weights_sha256"):
        open_work(tmp_path / "work", source, settings, CPU, LOW, HIGH, "f" * 64)
    again = open_work(tmp_path / "work", source, settings, CPU, LOW, HIGH)
    done = run_part(model, again, source, settings, CPU)
    assert done["tiles_resumed"] == 3 and done["tiles_computed"] == done["tiles"] - 3
    finish_work(again)
    np.testing.assert_array_equal(again.probabilities()[...], whole)


def test_finish_before_every_part_is_one_line_naming_the_parts(tmp_path):
    store = zarr_volume(tmp_path / "v.zarr", volume((40, 48, 40)))
    settings = InferenceSettings(window=(16, 16, 16), device="cpu", memory_budget_mb=0.9)
    source = open_source(str(store))
    work = open_work(tmp_path / "work", source, settings, CPU, LOW, HIGH)
    run_part(unet(), work, source, settings, CPU, 1, 3)
    with pytest.raises(CtsegError, match=r"not every part is done: part 0 \(\d+ tiles left\), "
                       r"part 2 \(\d+ tiles left\); run `ctseg predict"):  # fmt: skip
        finish_work(work, 3)


def test_the_seams_of_two_z_ranges_are_made_final_at_once(tmp_path, monkeypatch):
    """Two post jobs make their ranges' seams final at the same time: while one is held inside
    its range (a seam chunk half done), the other's range finishes; then both ranges together
    give the one finish's probabilities."""
    import threading

    import ctseg.inference.tiled as tiled_module

    store = zarr_volume(tmp_path / "v.zarr", volume((48, 32, 32)))
    settings = InferenceSettings(window=(16, 16, 16), device="cpu", memory_budget_mb=0.9)
    source = open_source(str(store))
    works = {}
    for name in ("ranges", "whole"):
        works[name] = open_work(tmp_path / name, source, settings, CPU, LOW, HIGH)
        for k in range(3):
            run_part(unet(), works[name], source, settings, CPU, k, 3)
    finish_work(works["whole"], 3)
    inside, release = threading.Event(), threading.Event()
    real = tiled_module._finalise_shared

    def held(work, chunk, *args):
        if chunk[0] * 16 < 24:  # the first range's: wait inside it
            inside.set()
            assert release.wait(60)
        return real(work, chunk, *args)

    monkeypatch.setattr(tiled_module, "_finalise_shared", held)
    first = threading.Thread(target=finish_work, args=(works["ranges"], 3, (0, 24)))
    first.start()
    assert inside.wait(60)
    finish_work(works["ranges"], 3, (24, 48))  # not refused while the first runs
    release.set()
    first.join(60)
    np.testing.assert_array_equal(
        works["ranges"].probabilities()[...], works["whole"].probabilities()[...]
    )


# ----------------------------------------------------------------------------- the command
def save_run(run_dir: Path, patch=(16, 16, 16), filters=(4, 8)) -> Path:
    torch.manual_seed(0)
    cfg = {"filters": list(filters)}
    model = build_model(cfg).eval()
    with torch.no_grad():  # logits spread about 0: masks that are not trivial
        model.heads[0].weight.mul_(8)
        model.heads[0].bias.zero_()
        model.heads[0].bias.sub_(model(torch.rand(1, 1, *patch)).median())
    payload = {"model": model.state_dict(), "model_config": cfg, "patch_size": list(patch)}
    save_checkpoint(run_dir / "last.pt", {**payload, "fingerprint": "0" * 16, "step": 1})
    return run_dir


def ctseg(*args, env=None, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(BIN / "ctseg"), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    if check and done.returncode:
        raise AssertionError(done.stderr[-3000:])
    return done


def in_memory_mask(run_dir: Path, data: np.ndarray, tmp: Path, settings) -> np.ndarray:
    """The TIFF path's mask of the same volume: `ctseg predict` of a folder of TIFFs."""
    (tmp / "tifs").mkdir()
    tifffile.imwrite(tmp / "tifs" / "v.tif", data, photometric="minisblack")
    ctseg("predict", "--run", run_dir, "-i", tmp / "tifs", "-o", tmp / "tif_masks", *settings)
    return tifffile.imread(tmp / "tif_masks" / "v.tif")


def test_predict_in_place_matches_the_tiff_path_in_parts_and_as_ome_zarr(tmp_path):
    """A tuned run whose settings plug and patch holes (each per whole 2D slice, done block by
    block with the halo its area bounds) and close: the run's tuned.json applies in place
    unchanged, in one part and in three, and gives the TIFF path's mask."""
    run = save_run(tmp_path / "results" / "tiny")
    tuned = {"threshold": 0.5, "hysteresis_high": None, "min_component_voxels": 20,
             "fill_holes": True, "plug_holes_max_area": 16, "patch_holes_max_area": 40,
             "closing_radius": 1}  # fmt: skip
    (run / "postprocess").mkdir()
    (run / "postprocess" / "tuned.json").write_text(json.dumps({"settings": tuned, "score": 0.5}))
    data = volume((48, 60, 52), seed=4)
    store = zarr_volume(tmp_path / "v.zarr", data, stats=False)
    options = ["--overlap", "0.5", "--batch-size", "2"]
    reference = in_memory_mask(run, data, tmp_path, options)
    budget = ["--memory-budget-mb", "4"]
    ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "m.zarr", *options, *budget,
          "--probabilities", tmp_path / "p.zarr", "--summary", tmp_path / "s.json")  # fmt: skip
    image = check_image(tmp_path / "m.zarr")
    assert image["dtype"] == "uint8" and image["levels"][0] == data.shape
    np.testing.assert_array_equal(
        zarr.open_group(tmp_path / "m.zarr", mode="r")["0"][...], reference
    )
    assert check_image(tmp_path / "p.zarr")["dtype"] == "float16"
    # The TIFF itself read in place (tifffile's Zarr interface): no converted copy, same mask.
    # Its pages are no chunks to keep: the mask's are 128^3, one here, so the halo needs 23 MB.
    ctseg("predict", "--run", run, "-i", tmp_path / "tifs" / "v.tif", "-o", tmp_path / "t.zarr",
          *options, "--memory-budget-mb", "32")  # fmt: skip
    np.testing.assert_array_equal(
        zarr.open_group(tmp_path / "t.zarr", mode="r")["0"][...], reference
    )
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["tiles"] > 1 and summary["part"]["read_amplification"] <= 1.2
    assert not (tmp_path / ".m.zarr.predict").exists()  # the work folder is gone when done
    # Three parts, one of them killed with SIGKILL half way and run again: the same mask.
    out, work = tmp_path / "parts.tif", tmp_path / ".parts.tif.predict"
    parts = [*options, *budget, "--parts", "3"]
    ctseg("predict", "--run", run, "-i", store, "-o", out, *parts, "--part", "0",
          "--summary", tmp_path / "p0.json")  # fmt: skip
    slow = slow_tiles_env(tmp_path)
    kill_after_a_tile([str(BIN / "ctseg"), "predict", "--run", str(run), "-i", str(store), "-o",
                       str(out), *map(str, parts), "--part", "1"], slow, work, 1, 3)  # fmt: skip
    ctseg("predict", "--run", run, "-i", store, "-o", out, *parts, "--part", "1",
          "--summary", tmp_path / "p1.json")  # fmt: skip
    assert json.loads((tmp_path / "p1.json").read_text())["part"]["tiles_resumed"] >= 1
    ctseg("predict", "--run", run, "-i", store, "-o", out, *parts, "--part", "2")
    # The post-processing's component rounds as jobs of their own, a z-range each (the last
    # first) and a merge; the finish does the rounds left and makes no seam final again.
    asked = ctseg("predict", "--run", run, "-i", store, "-o", out, *parts, "--post", "x",
                  "--part", "0", check=False)  # fmt: skip
    rounds = "filter, fill, filled, plugged, patched, closed"
    assert asked.returncode and f"rounds are {rounds}; give one" in asked.stderr
    # A part's summary lists them, for a scheduler to make the jobs.
    assert json.loads((tmp_path / "p0.json").read_text())["post_rounds"] == rounds.split(", ")
    for name in ("filter", "fill"):
        for k in (2, 1, 0):
            ctseg("predict", "--run", run, "-i", store, "-o", out, *parts, "--post", name,
                  "--part", k, "--summary", tmp_path / "post.json")  # fmt: skip
            assert json.loads((tmp_path / "post.json").read_text())["post"]["range"] == k
        ctseg("predict", "--run", run, "-i", store, "-o", out, *parts, "--post", name)
    ctseg("predict", "--run", run, "-i", store, "-o", out, *parts, "--finish",
          "--summary", tmp_path / "f.json")  # fmt: skip
    np.testing.assert_array_equal(tifffile.imread(out), reference)
    finished = json.loads((tmp_path / "f.json").read_text())
    assert finished["finish"] == [] and finished["outputs"]["post_rounds"] == rounds.split(", ")
    # The volume was read for its statistics once over all the processes: by the first part.
    figures = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("p0", "p1", "f")]
    assert [f["statistics_bytes_read"] for f in figures] == [data.nbytes, 0, 0]
    # Each process's own reads and writes (/proc/self/io): the finish wrote the mask at least.
    assert all(f["bytes_read"] > 0 and f["bytes_written"] > 0 for f in figures), figures
    assert figures[2]["bytes_written"] >= data.size


def test_parts_run_at_once_read_the_volume_for_its_statistics_once(tmp_path):
    """Two parts started together: one computes the intensity range under the lock on the work
    folder's intensity.json, the other waits and reads it; the finish reads it too."""
    run = save_run(tmp_path / "results" / "tiny")
    data = volume((40, 48, 40), seed=3)
    store = zarr_volume(tmp_path / "v.zarr", data, stats=False)
    args = [str(BIN / "ctseg"), "predict", "--run", str(run), "-i", str(store), "-o",
            str(tmp_path / "m.tif"), "--parts", "2", "--memory-budget-mb", "4"]  # fmt: skip
    parts = [
        subprocess.Popen([*args, "--part", str(k), "--summary", str(tmp_path / f"p{k}.json")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for k in (0, 1)
    ]  # fmt: skip
    for part in parts:
        _, err = part.communicate(timeout=600)
        assert part.returncode == 0, err[-2000:]
    ctseg(*args[1:], "--finish", "--summary", tmp_path / "f.json")
    summaries = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("p0", "p1", "f")]
    assert sorted(s["statistics_bytes_read"] for s in summaries) == [0, 0, data.nbytes]
    assert len({tuple(s["intensity_range"]) for s in summaries}) == 1
    assert tifffile.imread(tmp_path / "m.tif").shape == data.shape


def run_at_once(*commands: list) -> None:
    """`ctseg` commands started together, each to succeed."""
    running = [subprocess.Popen([str(BIN / "ctseg"), *map(str, c)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True) for c in commands]  # fmt: skip
    for process in running:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-2000:]


def test_post_jobs_at_once_write_the_ome_mask_and_its_pyramid_by_range(tmp_path):
    """Two parts, then each post-processing round's two range jobs started together (and the
    hysteresis's merge): the range jobs of the last round build their ranges' pyramid chunks,
    and the finish gives the one-process OME-Zarr mask, every level, bit for bit."""
    run = save_run(tmp_path / "results" / "tiny")
    store = zarr_volume(tmp_path / "v.zarr", volume((64, 40, 36), seed=5), stats=False)
    settings = ["--threshold", "0.4", "--hysteresis-high", "0.7", "--closing-radius", "1",
                "--memory-budget-mb", "4"]  # fmt: skip
    ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "one.zarr", *settings)
    common = ["predict", "--run", run, "-i", store, "-o", tmp_path / "m.zarr", *settings,
              "--parts", "2"]  # fmt: skip
    run_at_once(*([*common, "--part", k] for k in (0, 1)))
    for name in ("binarise", "filled", "closed"):
        run_at_once(*([*common, "--post", name, "--part", k] for k in (0, 1)))
        if name == "binarise":
            ctseg(*common, "--post", name)
    work_masks = list((tmp_path / ".m.zarr.predict" / "postprocess").glob("*/mask.zarr"))
    assert len(work_masks) == 1 and any((work_masks[0] / "1").rglob("c/*"))  # by the jobs
    ctseg(*common, "--finish")
    one, parted = (zarr.open_group(tmp_path / n, mode="r") for n in ("one.zarr", "m.zarr"))
    levels = check_image(tmp_path / "one.zarr")["levels"]
    assert len(levels) > 1 and check_image(tmp_path / "m.zarr")["levels"] == levels
    for level in range(len(levels)):
        np.testing.assert_array_equal(one[str(level)][...], parted[str(level)][...])
    assert one["0"][...].any() and not (tmp_path / ".m.zarr.predict").exists()


def test_the_finish_and_post_jobs_run_without_the_parts_gpu(tmp_path):
    """Parts whose manifest records a GPU with autocast (as on a GPU node): a part run again
    on this CPU is refused, naming the device; a post job and the finish, which compute no
    tile, take the recorded device and run here."""
    run = save_run(tmp_path / "results" / "tiny")
    store = zarr_volume(tmp_path / "v.zarr", volume((32, 24, 24), seed=6), stats=False)
    common = ["predict", "--run", run, "-i", store, "-o", tmp_path / "m.zarr", "--parts", "2",
              "--memory-budget-mb", "4"]  # fmt: skip
    run_at_once(*([*common, "--part", k] for k in (0, 1)))
    manifest = tmp_path / ".m.zarr.predict" / "manifest.json"
    recorded = json.loads(manifest.read_text())
    assert (recorded["device_type"], recorded["amp"]) == ("cpu", False)
    manifest.write_text(json.dumps({**recorded, "device_type": "cuda", "amp": True}))
    again = ctseg(*common, "--part", "0", check=False)
    error = again.stderr.strip().splitlines()[-1]
    assert again.returncode and error.startswith("ctseg predict: error:") and "device_type" in error
    ctseg(*common, "--post", "filled", "--part", "1")
    ctseg(*common, "--finish")
    ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "one.zarr",
          "--memory-budget-mb", "4")  # fmt: skip
    np.testing.assert_array_equal(
        zarr.open_group(tmp_path / "m.zarr", mode="r")["0"][...],
        zarr.open_group(tmp_path / "one.zarr", mode="r")["0"][...],
    )


@pytest.mark.parametrize("pieces", [1, 3, 7])
def test_statistics_pieces_merge_to_the_one_pass_range(tmp_path, pieces):
    """Histograms of z-ranges, empty and saturated slices among them, sum to the whole volume's
    exactly: the range merged from N pieces is the one pass's, for N up to more than the
    chunks along z (empty pieces)."""
    from ctseg.inference.source import intensity_range, statistics_pieces
    from ctseg.inference.tiled import shared_intensity_range, statistics_piece

    rng = np.random.default_rng(pieces)
    data = rng.integers(200, 4000, size=(40, 24, 20)).astype(np.uint16)
    data[3] = 0  # an empty slice (padding): left out
    data[17:19] = 65535  # saturated slices
    data[25, :4] = 65535  # saturated voxels
    path = tmp_path / "v.zarr"
    create_volume(path, data.shape, np.uint16, (8, 12, 10))[...] = data
    source = open_source(str(path))
    ranges = statistics_pieces(source, pieces)
    assert ranges[0][0] == 0 and ranges[-1][1] == 40
    assert all(a[1] == b[0] and a[0] % 8 == 0 for a, b in itertools.pairwise(ranges))  # tiled
    root = tmp_path / "work"
    read = [statistics_piece(root, source, k, pieces, 2**20) for k in range(pieces)]
    assert sum(read) == data.nbytes
    assert [statistics_piece(root, source, k, pieces, 2**20) for k in range(pieces)] == [0] * pieces
    low, high, how, stats_read = shared_intensity_range(root, source, None, 2**20)
    assert (low, high) == intensity_range(source, None, 2**20)[:2] and stats_read == 0
    assert how.startswith(f"merged from the histograms of {pieces} statistics jobs")


def test_statistics_jobs_leave_the_parts_nothing_to_read(tmp_path):
    """The workflow's statistics jobs (`--statistics K`, no model loaded), then the parts and
    the finish: no part reads the volume for its statistics, and the mask is the one process's
    bit for bit."""
    run = save_run(tmp_path / "results" / "tiny")
    data = volume((40, 48, 40), seed=5)
    store = zarr_volume(tmp_path / "v.zarr", data, stats=False)
    common = ["--run", run, "-i", store, "-o", tmp_path / "m.tif", "--memory-budget-mb", "4"]
    ctseg("predict", *common, "--summary", tmp_path / "whole.json")
    whole = tifffile.imread(tmp_path / "m.tif")
    (tmp_path / "m.tif").unlink()
    for k in range(3):
        done = ctseg("predict", *common, "--parts", "3", "--statistics", k,
                     "--summary", tmp_path / f"s{k}.json")  # fmt: skip
        assert f"statistics {k + 1} of 3 (--statistics {k})" in done.stdout
    for k in range(3):
        ctseg("predict", *common, "--parts", "3", "--part", k, "--summary", tmp_path / f"p{k}.json")
    ctseg("predict", *common, "--parts", "3", "--finish", "--summary", tmp_path / "f.json")
    np.testing.assert_array_equal(tifffile.imread(tmp_path / "m.tif"), whole)
    read = {name: json.loads((tmp_path / f"{name}.json").read_text())["statistics_bytes_read"]
            for name in ("s0", "s1", "s2", "p0", "p1", "p2", "f")}  # fmt: skip
    assert sum(read[f"s{k}"] for k in range(3)) == data.nbytes
    assert all(read[k] > 0 for k in ("s0", "s1", "s2"))
    assert [read[k] for k in ("p0", "p1", "p2", "f")] == [0, 0, 0, 0]
    first = json.loads((tmp_path / "whole.json").read_text())["intensity_range"]
    assert json.loads((tmp_path / "f.json").read_text())["intensity_range"] == first
    # A statistics job checks the outputs as the predict does, before any read.
    (tmp_path / "theirs.tif").write_bytes(b"not ctseg's")
    refused = ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "theirs.tif",
                    "--parts", "2", "--statistics", "0", check=False)  # fmt: skip
    assert refused.returncode != 0 and "not an output of ctseg" in refused.stderr
    assert not (tmp_path / ".theirs.tif.predict").exists()
    refused = ctseg("predict", *common, "--statistics", "0", check=False)
    assert "goes with --parts N" in refused.stderr.strip().splitlines()[-1]
    refused = ctseg("predict", *common, "--parts", "3", "--statistics", "3", check=False)
    assert "--statistics 3: expected 0 <= piece < --parts 3" in refused.stderr


def slow_tiles_env(tmp: Path) -> dict[str, str]:
    """The environment of a process whose every tile takes 0.3 s longer (`_slow_tiles_hook`)."""
    path = os.pathsep.join(
        p for p in (str(_slow_tiles_hook(tmp)), os.environ.get("PYTHONPATH")) if p
    )
    return {**os.environ, "PYTHONPATH": path, "SLOW_TILES_S": "0.3"}


def _slow_tiles_hook(tmp: Path) -> Path:
    """A sitecustomize that makes each tile of the process it starts in take 0.3 s longer, so
    that the test's SIGKILL lands between a part's first and last tile; it changes no result."""
    folder = tmp / "hook"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import os, time\n"
        "import ctseg.inference.tiled as tiled\n"
        "real = tiled._run_tile\n"
        "def slow(*args, **kwargs):\n"
        "    done = real(*args, **kwargs)\n"
        "    time.sleep(float(os.environ['SLOW_TILES_S']))\n"
        "    return done\n"
        "tiled._run_tile = slow\n"
    )
    return folder


def kill_after_a_tile(
    command: list[str], env: dict[str, str], work: Path, part: int, parts: int
) -> None:
    """Start `command` (a part), SIGKILL it once one of its tiles is done (in `work`)."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (work / MANIFEST).exists() or not set(_part_tile_names(work, parts, part)) & {
        p.stem for p in (work / "tiles").glob("*.done")
    }:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _part_tile_names(work: Path, parts: int, part: int) -> list[str]:
    manifest = json.loads((work / MANIFEST).read_text())
    shape, window, chunks = manifest["shape"], manifest["window"], manifest["chunks"]
    starts = tuple(
        tuple(window_starts(s, w, manifest["overlap"])) for s, w in zip(shape, window, strict=True)
    )
    grid = TileGrid(tuple(shape), tuple(window), starts, tuple(chunks), tuple(manifest["tile"]))
    return ["_".join(map(str, t)) for t in part_tiles(grid.tiles(), parts, part)]


# ----------------------------------------------------------------------------- remote, memory
@pytest.mark.slow
def test_a_volume_7x_the_budget_from_s3_stays_under_it_and_masks_as_in_memory(
    tmp_path, s3_endpoint
):
    """128 x 256 x 448 uint8 from the loopback S3 server: at 8 bytes a voxel (the in-memory
    path's float32 input and sums) 112 MB, 7x the 16 MB budget it is given."""
    patch, budget = (32, 32, 32), 16
    run = save_run(tmp_path / "results" / "small", patch, filters=(2, 4))
    data = volume((128, 256, 448), seed=5)
    local = tmp_path / "bucket"
    zarr_volume(local / "scroll.zarr", data, chunks=(32, 32, 32))
    upload(s3_endpoint, local, "scrolls", "v1")
    inference = ["--overlap", "0.25", "--batch-size", "2"]
    ctseg("predict", "--run", run, "-i", "s3://scrolls/v1/scroll.zarr", "-o", tmp_path / "m.zarr",
          "--storage-options", json.dumps(s3_options(s3_endpoint)), "--memory-budget-mb",
          budget, *inference, "--summary", tmp_path / "s.json")  # fmt: skip
    summary = json.loads((tmp_path / "s.json").read_text())
    assert 8 * data.size >= 7 * budget * 2**20 and summary["tiles"] >= 8
    # The host memory the tiles, cache and post-processing added to the loaded model.
    assert summary["peak_rss_mb"] - summary["rss_before_mb"] <= budget, summary
    assert summary["part"]["read_amplification"] <= 1.2, summary["part"]
    # The in-memory path: the whole volume on the "device", then the whole mask at once.
    from ctseg.inference.run import load_checkpoint

    loaded = load_checkpoint(run / "last.pt", CPU)
    settings = InferenceSettings(window=patch, overlap=0.25, batch_size=2, device="cpu",
                                 device_budget_mb=4096)  # fmt: skip
    info = infer_volume(loaded.model, local / "scroll.zarr", tmp_path / "p.zarr", settings)
    assert info["tiles"] == 1  # the whole volume held at once
    mask, _ = binary_mask(open_volume(tmp_path / "p.zarr")[...], PostprocessSettings())
    assert 0 < mask.sum() < mask.size
    np.testing.assert_array_equal(zarr.open_group(tmp_path / "m.zarr", mode="r")["0"][...], mask)


def test_an_https_like_http_input_predicts_as_the_local_one(tmp_path, http_root):  # noqa: F811
    root, base = http_root
    run = save_run(tmp_path / "results" / "tiny")
    data = volume((40, 48, 40), seed=6)
    zarr_volume(root / "v.zarr", data)
    zarr_volume(tmp_path / "v.zarr", data)
    for name, url in (("local", tmp_path / "v.zarr"), ("http", f"{base}/v.zarr")):
        ctseg("predict", "--run", run, "-i", url, "-o", tmp_path / f"{name}.zarr",
              "--memory-budget-mb", "4")  # fmt: skip
    opened = [
        zarr.open_group(tmp_path / f"{n}.zarr", mode="r")["0"][...] for n in ("local", "http")
    ]
    np.testing.assert_array_equal(*opened)


def test_a_multiclass_run_writes_its_tuned_label_map_as_the_folder_predict_does(tmp_path):
    """A multi-class run's tuned.json (each class's settings) applies to a volume read in place,
    in parts, as to the folder predict, and the label map records it."""
    from test_multiclass_inference import SPEC
    from test_multiclass_inference import save_run as save_multiclass_run

    from ctseg.inference.outputs import PROVENANCE_KEY
    from ctseg.postprocess.classes import ARGMAX, ClassSettings, class_label_map

    run = tmp_path / "results" / "mc"
    save_multiclass_run(run, SPEC)
    sheet = PostprocessSettings(0.0, None, 8, fill_holes=True)
    fibre = PostprocessSettings(0.0, 0.6, plug_holes_max_area=4, closing_radius=1)
    settings = ClassSettings((("sheet", sheet), ("fibre", fibre), ("pore", ARGMAX)))
    (run / "postprocess").mkdir()
    (run / "postprocess" / "tuned.json").write_text(json.dumps({"settings": settings.as_dict()}))
    data = volume((32, 40, 36), seed=7)
    store = zarr_volume(tmp_path / "v.zarr", data, stats=False)
    (tmp_path / "tifs").mkdir()
    tifffile.imwrite(tmp_path / "tifs" / "v.tif", data, photometric="minisblack")
    ctseg("predict", "--run", run, "-i", tmp_path / "tifs", "-o", tmp_path / "tif_masks")
    common = ["--parts", "2", "--memory-budget-mb", "6", "--probabilities", tmp_path / "p.zarr"]
    for part in ("0", "1"):
        ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "m.zarr", *common,
              "--part", part)  # fmt: skip
    ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "m.zarr", *common, "--finish",
          "--summary", tmp_path / "s.json")  # fmt: skip
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["tiles"] >= 2
    assert summary["outputs"]["class_settings"] == settings.as_dict()["classes"]
    reference = tifffile.imread(tmp_path / "tif_masks" / "v.tif")
    group = zarr.open_group(tmp_path / "m.zarr", mode="r")
    assert set(np.unique(reference)) <= {0, 10, 20, 30} and len(np.unique(reference)) > 2
    np.testing.assert_array_equal(group["0"][...], reference)
    assert group.attrs[PROVENANCE_KEY]["postprocess"] == settings.as_dict()
    probs = np.asarray(zarr.open_group(tmp_path / "p.zarr", mode="r")["0"][...])
    stored, steps = class_label_map(probs, settings)
    np.testing.assert_array_equal(SPEC.to_stored(reference), stored)
    assert stored.tolist() != np.argmax(probs, axis=0).tolist()  # the settings changed it
    assert summary["outputs"]["class_steps"] == steps


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--part", "1"], "--part, --post and --finish go with --parts N"),
        (["--parts", "3"], "--parts 3: give --part K (0..2) or --finish"),
        (["--parts", "3", "--part", "3"], "--part 3: expected 0 <= part < --parts 3"),
        (
            ["--memory-budget-mb", "1", "--window", "32,32,32"],
            "MB the tiles get (half of --memory-budget-mb 1)",
        ),
        (["--memory-budget-mb", "0.5"], "raise --memory-budget-mb to at least 0.7"),
    ],
)
def test_requests_the_in_place_predict_cannot_do_are_one_line(tmp_path, extra, message):
    """Each is refused before the volume is read (its statistics too) and leaves no folder."""
    run = save_run(tmp_path / "results" / "tiny")
    store = zarr_volume(tmp_path / "v.zarr", volume((20, 24, 20)), stats=False)
    done = ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "m.zarr", *extra,
                 check=False)  # fmt: skip
    assert done.returncode != 0 and message in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("ctseg predict: error: ")
    assert [line for line in done.stderr.splitlines() if "error" in line] == [
        done.stderr.strip().splitlines()[-1]
    ]
    assert not (tmp_path / "m.zarr").exists() and not (tmp_path / ".m.zarr.predict").exists()
    assert "statistics" not in done.stderr and "intensity range" not in done.stderr
    bad = ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "m.nii", check=False)
    assert "the output of a volume read in place is an OME-Zarr image" in bad.stderr


def test_post_processing_whose_halo_does_not_fit_is_refused_before_any_tile(tmp_path):
    """Patching holes of 4096 pixels reads each block with a halo of 8197 voxels in-plane: on a
    600 x 600 plane that does not fit a quarter of 4 MB, and the refusal gives the budget."""
    run = save_run(tmp_path / "results" / "tiny")
    store = zarr_volume(
        tmp_path / "v.zarr", np.zeros((16, 600, 600), np.uint8), chunks=(16, 64, 64)
    )
    patch = ["--patch-holes-max-area", "4096", "--memory-budget-mb", "4"]
    done = ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "m.zarr", *patch,
                 check=False)  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "raise --memory-budget-mb to at least" in last, done.stderr
    assert "windows" not in done.stderr  # no tile was started
    assert not (tmp_path / ".m.zarr.predict").exists()
