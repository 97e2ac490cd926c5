"""The one inference engine: a model's probabilities of a volume of any size, tile by tile, in
parts, resumable, over `ctseg.inference.tiles`' grid of a `ctseg.inference.source.VolumeSource`
read in place. Every predict runs it: a converted store held whole is one tile
(`ctseg.inference.run.infer_volume`), a scroll is many (`ctseg.inference.scroll`). Each tile's
windows go through the one kernel (`ctseg.inference.blend.blend_windows`) into exact sums on the
device; a chunk only that tile reaches is divided there and written final.

Work folder
-----------
Everything a predict of one volume has done lives in one folder (`Work`), kept until the
predict is finished, so that a killed predict, or a part of one on another node, goes on where
it stopped:

- ``manifest.json``: what is computed (the source, its level, shape and dtype, the intensity
  range, the window, overlap, flips, background, autocast, device type, the weights' digest,
  the labels, the output chunks and the tile). A later run with any of these changed is refused
  (`open_work`): its tiles would be mixed with this run's. The tile is the first run's, so that
  every part cuts the volume the same way.
- ``probabilities.zarr``: the float16 probabilities, written chunk by chunk as chunks become
  final; chunks left all zero are not written.
- ``tiles/<z>_<y>_<x>.done``: a tile whose windows are computed and whose sums are written
  (the chunks it alone meets as final probabilities, its share of the others as spills).
- ``spill/<chunk>/<tile>.npy``: a tile's exact sums (int64) over a chunk other tiles' windows
  also reach, until the chunk is final (``.zero``: the share is all zero).
- ``chunks/<z>_<y>_<x>.done``: a shared chunk made final; its spills are then removed.

Every file is written under a temporary name and renamed, so a killed run leaves whole files or
temporaries, never a half file under a final name; a tile without its marker is computed again
(and writes the same bytes). The sums are exact integers (`ctseg.inference.windows.to_fixed`), so
the order in which tiles, parts and resumed runs add them cannot change a bit: a volume in one
process, in any number of parts, or resumed after a kill gives the same store.

Parts
-----
`run_part(k, n)` computes the tiles of part k (`ctseg.inference.tiles.part_tiles`) and makes
final the chunks only its tiles meet; `finish` checks every tile is done, then makes the seams'
chunks final from the spills. One process is `run_part(0, 1)` then `finish`. Parts of one volume
may run at once (on GPUs of one node or on nodes sharing the folder): each part holds a lock on
its own name, and they write disjoint files. Within a part, the next tile's input is read and
decoded on a thread while the current tile runs, so the device does not wait on the store
(`working_bytes_per_voxel` counts that second input).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from ctseg.data.heap import release_heap
from ctseg.inference.blend import blend_windows, device_input, model_session, output_channels
from ctseg.inference.settings import InferenceSettings, Shape3
from ctseg.inference.source import (
    ChunkCache,
    VolumeSource,
    count_planes,
    histogram_range,
    intensity_range,
    statistics_pieces,
)
from ctseg.inference.tiles import Box, Index, TileGrid, part_tiles, plan_tile
from ctseg.inference.windows import (
    SIGMA_SCALE,
    check_coverage,
    empty_windows,
    from_fixed,
    weight_sum_1d,
    window_starts,
)
from ctseg.io import CtsegError, OutputBusy, free_bytes, output_lock, remove_path, strict_json
from ctseg.labels import LabelSpec
from ctseg.postprocess.write import (
    CLASSES_ATTRIBUTE,
    LABELS_ATTRIBUTE,
    MULTICLASS_VALUE,
    channel_names,
)
from ctseg.preprocess.convert import Histogram
from ctseg.progress import Progress
from ctseg.store import WEIGHTS_ATTRIBUTE, create_volume

MANIFEST = "manifest.json"
PROBABILITIES = "probabilities.zarr"
STATISTICS = "intensity.json"  # the volume's intensity range, computed once per predict
STATISTICS_WAIT_S = 0.5  # how often a process waiting for another's statistics looks again
# The histograms of the statistics jobs (`statistics_piece`): piece-<K>-of-<N>.npz each.
STATISTICS_PIECES = "statistics"
FORMAT = 1
DEFAULT_CHUNK = 128  # output chunks along each axis when the input's are outside 16..256


def _name(index: Sequence[int]) -> str:
    return "_".join(str(int(i)) for i in index)


def _write_atomic(path: Path, data: bytes, writer: str) -> None:
    """`path` written under ``<name>.tmp-<writer>`` and renamed: `writer` names the part (or
    the finish) that writes it, which holds a lock on that name, so its next run may remove
    what a killed one left (`_remove_temporaries`)."""
    tmp = path.with_name(f"{path.name}.tmp-{writer}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _save_atomic(path: Path, array: np.ndarray, writer: str) -> None:
    """`array` saved under a temporary name and renamed (`_write_atomic`). numpy reports a
    disk that fills as a short write without an errno ("problem writing element 2560 to file"
    for a strided array): with less room left than the array takes, that is a full disk."""
    tmp = path.with_name(f"{path.name}.tmp-{writer}.npy")
    try:
        np.save(tmp, np.ascontiguousarray(array))
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno is None and free_bytes(path.parent) < array.nbytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from exc
        raise
    os.replace(tmp, path)


def _remove_temporaries(folder: Path, writer: str) -> None:
    """The temporaries a killed run of `writer` left in the work folder (the caller holds the
    lock on `writer`: no living process writes them)."""
    for pattern in (f"*/*.tmp-{writer}*", f"spill/*/*.tmp-{writer}*"):
        for stale in folder.glob(pattern):
            stale.unlink(missing_ok=True)


def output_chunks(source: VolumeSource) -> Shape3:
    """The probabilities' and masks' chunks: the input's read unit where it is a sensible size
    (16 to 256 per axis, or the whole of a shorter axis), else `DEFAULT_CHUNK`, never larger
    than the volume."""
    sensible = all(
        16 <= c <= 256 or c >= s for c, s in zip(source.chunks, source.shape, strict=True)
    )
    chunks = source.chunks if sensible else (DEFAULT_CHUNK,) * 3
    return tuple(min(c, s) for c, s in zip(chunks, source.shape, strict=True))  # type: ignore[return-value]


def working_bytes_per_voxel(itemsize: int, channels: int) -> int:
    """Bytes a tile holds per voxel of its extent: the raw input and the next tile's, read
    ahead (`run_part`), its float32 copy on the device, and for every channel the int64 sums on
    the device and the int64 of its seams' chunks copied to the host (at most all of it). Its
    final chunks are divided on the device one at a time, so their float copies count one
    chunk, not the tile."""
    return 2 * itemsize + 4 + 16 * channels


def store_attributes(
    source_url: str,
    settings: InferenceSettings,
    weights_sha256: str | None,
    labels: LabelSpec | None,
) -> dict[str, Any]:
    """What a probability store records: its source, the sliding-window settings, what its
    values are, the weights' digest, and a multi-class store's classes and label spec."""
    attributes: dict[str, Any] = {
        "source": source_url,
        "window": list(settings.checked_window()),
        "overlap": settings.overlap,
        "tta_flips": bool(settings.tta_flips),
        "blending": f"gaussian sigma=window*{SIGMA_SCALE}",
        "value": "foreground probability (sigmoid)",
    }
    if weights_sha256 is not None:
        attributes[WEIGHTS_ATTRIBUTE] = [weights_sha256]
    if labels is not None and not labels.is_binary:
        attributes["value"] = MULTICLASS_VALUE
        attributes[CLASSES_ATTRIBUTE] = channel_names(labels)
        attributes[LABELS_ATTRIBUTE] = labels.to_dict()
    return attributes


# ----------------------------------------------------------------------------- the work folder
@dataclass(frozen=True)
class Work:
    """An open work folder: its place, its manifest, the grid its tiles follow and the
    probability store its chunks are written to."""

    folder: Path
    manifest: dict[str, Any]
    grid: TileGrid
    channels: int
    store: Path

    def tile_done(self, tile: Index) -> Path:
        return self.folder / "tiles" / f"{_name(tile)}.done"

    def chunk_done(self, chunk: Index) -> Path:
        return self.folder / "chunks" / f"{_name(chunk)}.done"

    def spill(self, chunk: Index, tile: Index) -> Path:
        return self.folder / "spill" / _name(chunk) / f"{_name(tile)}.npy"

    def probabilities(self) -> zarr.Array:
        return zarr.open_array(str(self.store), mode="r+")


# What the tiles' arithmetic depends on beside the settings: the device type and autocast.
DEVICE_KEYS = ("device_type", "amp")


def _identity(
    source: VolumeSource,
    settings: InferenceSettings,
    device: torch.device,
    low: float,
    high: float,
    weights_sha256: str | None,
    labels: LabelSpec | None,
) -> dict[str, Any]:
    """What the probabilities depend on: a resumed run must have all of it unchanged."""
    return {
        "format": FORMAT,
        "source": source.url,
        "level": source.level,
        "shape": list(source.shape),
        "dtype": str(source.dtype),
        "intensity_range": [low, high],
        "window": list(settings.checked_window()),
        "overlap": settings.overlap,
        "tta_flips": bool(settings.tta_flips),
        "background": settings.background,
        "amp": settings.use_amp(device),
        "device_type": device.type,
        "weights_sha256": weights_sha256,
        "labels": None if labels is None or labels.is_binary else labels.to_dict(),
        "chunks": list(output_chunks(source)),
    }


def _statistics_identity(source: VolumeSource) -> dict[str, Any]:
    return {"source": source.url, "level": source.level, "shape": list(source.shape),
            "dtype": str(source.dtype)}  # fmt: skip


def shared_intensity_range(
    root: Path,
    source: VolumeSource,
    given: tuple[float, float] | None,
    budget_bytes: int,
) -> tuple[float, float, str, int]:
    """The normalisation range of `source` (`ctseg.inference.source.intensity_range`), the
    volume read for it at most once over all the processes of one predict: given, or recorded
    in the array's attributes, it reads nothing; else the first process to need it writes it
    to ``<root>/intensity.json``, under a lock on it, and every other part, the finish and a
    rerun read that file, waiting while another process computes it. That first process merges
    the histograms of the statistics jobs where every piece of them is there
    (`statistics_piece`), else reads the volume itself. Returns the range, where it came from,
    and the bytes of the volume this process read for it."""
    if given is not None or {"p0_5", "p99_5"} <= source.attributes.keys():
        return (*intensity_range(source, given, budget_bytes), 0)
    path = Path(root) / STATISTICS
    identity = _statistics_identity(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            with output_lock(path):
                if path.exists():
                    return (*_read_statistics(path, identity), 0)
                merged = _merged_pieces(Path(root) / STATISTICS_PIECES, source, identity)
                read = 0
                if merged is None:
                    low, high, how = intensity_range(source, None, budget_bytes)
                    read = math.prod(source.shape) * source.dtype.itemsize
                else:
                    low, high, how = merged
                record = {**identity, "intensity_range": [low, high], "how": how}
                _write_atomic(path, strict_json(record, indent=1).encode(), "statistics")
                return low, high, how, read
        except OutputBusy:  # another process of this predict is computing them
            time.sleep(STATISTICS_WAIT_S)


def statistics_piece(
    root: Path, source: VolumeSource, piece: int, pieces: int, budget_bytes: int
) -> int:
    """The histogram of piece `piece` of `pieces` of the volume's planes (`statistics_pieces`),
    written to ``<root>/statistics/piece-<K>-of-<N>.npz`` for the process that computes the
    range (`shared_intensity_range`) to merge; returns the bytes of the volume read (0: the
    piece was there already, or the range needs no pass)."""
    if {"p0_5", "p99_5"} <= source.attributes.keys():
        return 0
    identity = _statistics_identity(source)
    folder = Path(root) / STATISTICS_PIECES
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"piece-{piece}-of-{pieces}.npz"
    with output_lock(path):
        if path.exists():
            _read_piece(path, identity)  # one of another input is refused
            return 0
        z0, z1 = statistics_pieces(source, pieces)[piece]
        histogram = count_planes(source, z0, z1, budget_bytes, f"statistics {piece + 1}/{pieces}")
        data = io.BytesIO()
        np.savez(data, counts=histogram.counts, empty=histogram.empty,
                 empty_slices=histogram.empty_slices, z=[z0, z1],
                 identity=json.dumps(identity))  # fmt: skip
        _write_atomic(path, data.getvalue(), "statistics")
    return (z1 - z0) * math.prod(source.shape[1:]) * source.dtype.itemsize


def _read_piece(path: Path, identity: dict[str, Any]) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        piece = {key: data[key] for key in data.files}
    was = _changes(json.loads(str(piece["identity"])), identity)
    if was:
        raise CtsegError(
            f"{path}: the statistics of another input are kept here ({was}); finish that "
            f"predict, or remove {path.parent.parent} to start again"
        )
    return piece


def _merged_pieces(
    folder: Path, source: VolumeSource, identity: dict[str, Any]
) -> tuple[float, float, str] | None:
    """The range of the statistics jobs' histograms summed, where every piece of N is in
    `folder` (their z-ranges tile the volume); None where none is complete."""
    found: dict[int, set[int]] = {}
    for path in folder.glob("piece-*-of-*.npz"):
        k, n = (int(v) for v in path.stem.removeprefix("piece-").split("-of-"))
        found.setdefault(n, set()).add(k)
    complete = [n for n, ks in found.items() if ks == set(range(n))]
    if not complete:
        return None
    n = max(complete)
    histogram = Histogram(source.dtype, 1)
    for k in range(n):
        piece = _read_piece(folder / f"piece-{k}-of-{n}.npz", identity)
        histogram.counts += piece["counts"]
        histogram.empty += piece["empty"]
        histogram.empty_slices += int(piece["empty_slices"])
    how = f"merged from the histograms of {n} statistics jobs over {source.url}"
    return (*histogram_range(histogram), how)


def _changes(recorded: dict[str, Any], identity: dict[str, Any]) -> str:
    """What differs between a work folder's record and this run ("key old now new", ...);
    empty when nothing does."""
    changed = sorted(k for k in identity if recorded.get(k) != identity[k])
    return ", ".join(f"{k} {recorded.get(k)!r} now {identity[k]!r}" for k in changed)


def _read_statistics(path: Path, identity: dict[str, Any]) -> tuple[float, float, str]:
    record = json.loads(path.read_text())
    was = _changes(record, identity)
    if was:
        raise CtsegError(
            f"{path}: the statistics of another input are kept here ({was}); finish that "
            f"predict, or remove {path.parent} to start again"
        )
    low, high = record["intensity_range"]
    return float(low), float(high), f"{record['how']}, by an earlier process of this predict"


def planned_tile(
    folder: Path,
    source: VolumeSource,
    settings: InferenceSettings,
    device: torch.device,
    channels: int,
    budget_from: str | None = None,
) -> Shape3 | None:
    """The tile a first run of this predict cuts the volume into: the largest that fits
    ``settings.memory_budget_mb`` (on a GPU also ``device_budget_mb``), a budget too small a
    one-line refusal saying where it comes from (`budget_from`); None where `folder` holds a
    manifest already (a later run keeps its tile). Reads nothing but the folder, so a caller
    checks it before any long step."""
    if (Path(folder) / MANIFEST).exists():
        return None
    budget = settings.memory_budget_mb * 2**20
    what = budget_from or f"memory_budget_mb {settings.memory_budget_mb:g}"
    if device.type == "cuda" and settings.device_budget_bytes() < budget:
        budget = settings.device_budget_bytes()
        what = f"--device-budget-mb {settings.device_budget_mb:g}"
    per_voxel = working_bytes_per_voxel(source.dtype.itemsize, channels)
    win = settings.checked_window()
    return plan_tile(source.shape, win, output_chunks(source), per_voxel, budget, what)


def open_work(
    folder: Path,
    source: VolumeSource,
    settings: InferenceSettings,
    device: torch.device,
    low: float,
    high: float,
    weights_sha256: str | None = None,
    labels: LabelSpec | None = None,
    budget_from: str | None = None,
    store: Path | None = None,
    computes: bool = True,
) -> Work:
    """The work folder of this predict: made (manifest, empty probability store) by the first
    run, checked against the manifest by every later one. The first run's tile fits
    ``settings.memory_budget_mb`` (on a GPU also ``device_budget_mb``); `budget_from` says
    where that budget comes from, for the refusal of one too small. The probabilities go to
    `store` (default ``probabilities.zarr`` in the folder). A process that computes no tile
    (`computes` false: the finish, a post-processing job) takes the device type and autocast
    the parts recorded: it may run on a node without their GPU."""
    folder = Path(folder)
    store = folder / PROBABILITIES if store is None else Path(store)
    identity = _identity(source, settings, device, low, high, weights_sha256, labels)
    if not computes and (folder / MANIFEST).exists():
        recorded = json.loads((folder / MANIFEST).read_text())
        identity.update({key: recorded[key] for key in DEVICE_KEYS if key in recorded})
    win = settings.checked_window()
    starts = tuple(
        tuple(window_starts(s, w, settings.overlap)) for s, w in zip(source.shape, win, strict=True)
    )
    check_coverage(starts, win, settings.overlap)
    channels = output_channels(labels)
    chunks: Shape3 = tuple(identity["chunks"])  # type: ignore[assignment]
    manifest_file = folder / MANIFEST
    tile = planned_tile(folder, source, settings, device, channels, budget_from)
    if tile is not None:
        for sub in ("tiles", "chunks", "spill"):  # after every refusal: nothing left by one
            (folder / sub).mkdir(parents=True, exist_ok=True)
        manifest = {**identity, "tile": list(tile)}
        tmp = folder / f"{MANIFEST}.tmp-{os.getpid()}"
        tmp.write_text(strict_json(manifest, indent=1))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, manifest_file)  # the first part to get here writes it
        tmp.unlink()
    manifest = json.loads(manifest_file.read_text())
    was = _changes(manifest, identity)
    if was:
        raise CtsegError(
            f"{folder}: an unfinished predict of other settings is kept here ({was}); rerun it "
            f"with its settings to finish it, or remove {folder} to start again"
        )
    grid = TileGrid(source.shape, win, starts, chunks, tuple(manifest["tile"]))  # type: ignore[arg-type]
    _create_probabilities(store, source, settings, weights_sha256, labels, chunks, channels)
    return Work(folder, manifest, grid, channels, store)


def _create_probabilities(
    final: Path,
    source: VolumeSource,
    settings: InferenceSettings,
    weights_sha256: str | None,
    labels: LabelSpec | None,
    chunks: Shape3,
    channels: int,
) -> None:
    if final.exists():
        return
    shape: tuple[int, ...] = source.shape
    store_chunks: tuple[int, ...] = chunks
    if channels > 1:
        shape, store_chunks = (channels, *shape), (1, *chunks)
    attributes = store_attributes(source.url, settings, weights_sha256, labels)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    create_volume(
        tmp, shape, np.float16, store_chunks, attributes=attributes, write_empty_chunks=False
    )
    try:
        os.rename(tmp, final)
    except OSError:  # another part made it first
        if not final.exists():
            raise
        remove_path(tmp)


# ----------------------------------------------------------------------------- final chunks
class _Norms:
    """The weight sums' 1D factors (float64), and a chunk's float32 norms from them: the same
    values as `ctseg.inference.windows.weight_norms` gives for the whole volume."""

    def __init__(self, grid: TileGrid) -> None:
        self.sums = [
            weight_sum_1d(s, w, st)
            for s, w, st in zip(grid.shape, grid.window, grid.starts, strict=True)
        ]

    def of(self, box: Box) -> tuple[np.ndarray, np.ndarray]:
        (z0, z1), (y0, y1), (x0, x1) = box
        norm_z = self.sums[0][z0:z1].astype(np.float32)
        norm_yx = np.outer(self.sums[1][y0:y1], self.sums[2][x0:x1]).astype(np.float32)
        return norm_z, norm_yx


def _slices(box: Box, origin: Sequence[int] = (0, 0, 0)) -> tuple[slice, slice, slice]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, origin, strict=True))  # type: ignore[return-value]


def _intersect(a: Box, b: Box) -> Box:
    return tuple((max(p[0], q[0]), min(p[1], q[1])) for p, q in zip(a, b, strict=True))  # type: ignore[return-value]


def _write_chunk(out: zarr.Array, box: Box, total: torch.Tensor, norms: _Norms) -> None:
    """The chunk at `box` made final from its exact sums, divided where they lie (the device,
    or the host for a seam's spills)."""
    out[(..., *_slices(box))] = from_fixed(total, *norms.of(box)).cpu().numpy()


def _finalise_shared(work: Work, chunk: Index, out: zarr.Array, norms: _Norms, writer: str) -> None:
    """Sum the spills of a shared chunk, write its probabilities, mark it, drop the spills."""
    grid = work.grid
    box = grid.chunk_box(chunk)
    lead = () if work.channels == 1 else (work.channels,)
    total = np.zeros((*lead, *(hi - lo for lo, hi in box)), np.int64)
    for tile in grid.contributors(chunk):
        spill = work.spill(chunk, tile)
        if spill.with_suffix(".zero").exists():
            continue
        if not spill.exists():  # never read as zeros: the chunk's value would be wrong
            raise CtsegError(
                f"{spill}: tile {_name(tile)}'s share of chunk {_name(chunk)} is missing from "
                f"the work folder, though the tile is marked done; remove {work.folder} and "
                "predict again"
            )
        piece = _intersect(box, grid.extent(tile))
        total[(..., *_slices(piece, [lo for lo, _ in box]))] += np.load(spill)
    _write_chunk(out, box, torch.from_numpy(total), norms)
    _write_atomic(work.chunk_done(chunk), b"", writer)
    spill_dir = work.folder / "spill" / _name(chunk)
    for f in spill_dir.glob("*"):
        f.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        spill_dir.rmdir()


# ----------------------------------------------------------------------------- one tile
def _input_box(grid: TileGrid, tile: Index) -> tuple[slice, slice, slice]:
    """The input a tile reads: its extent, inside the volume (the rest is padding)."""
    inside = tuple(
        (lo, min(hi, s)) for (lo, hi), s in zip(grid.extent(tile), grid.shape, strict=True)
    )
    return _slices(inside)  # type: ignore[arg-type]


@dataclass
class _Counts:
    windows: int = 0
    skipped: int = 0
    tiles: int = 0
    resumed_tiles: int = 0
    final_chunks: int = 0


def _run_tile(
    model: torch.nn.Module,
    work: Work,
    tile: Index,
    raw: np.ndarray,
    low: float,
    high: float,
    settings: InferenceSettings,
    device: torch.device,
    out: zarr.Array,
    norms: _Norms,
    bar: Progress,
    counts: _Counts,
    writer: str,
) -> list[Index]:
    """Compute `tile` from its input `raw`, write what it alone makes final and spill the rest;
    returns its shared chunks."""
    grid = work.grid
    extent = grid.extent(tile)
    origin = [lo for lo, _ in extent]
    every = [
        tuple(c - o for c, o in zip(corner, origin, strict=True)) for corner in grid.corners(tile)
    ]
    empty = empty_windows(raw, every, grid.window, settings)
    corners = [c for c, e in zip(every, empty, strict=True) if not e]
    counts.skipped += len(every) - len(corners)
    bar.update(len(every) - len(corners))
    size = [hi - lo for lo, hi in extent]
    lead = () if work.channels == 1 else (work.channels,)
    total = torch.zeros((*lead, *size), dtype=torch.int64, device=device)
    if corners:
        x = device_input(raw, low, high, size, device)
        blend_windows(model, x, total, corners, settings, bar, work.channels)  # type: ignore[arg-type]
        del x
    counts.windows += len(corners)
    del raw
    shared = []
    chunks = grid.chunks_in(extent)
    if all(grid.contributors(chunk) == [tile] for chunk in chunks):
        # No seams (the whole volume one tile): one division and one write of every chunk, which
        # zarr encodes in parallel.
        boxes = [grid.chunk_box(chunk) for chunk in chunks]
        box = tuple((min(b[a][0] for b in boxes), max(b[a][1] for b in boxes)) for a in range(3))
        _write_chunk(out, box, total[(..., *_slices(box, origin))], norms)  # type: ignore[arg-type]
        counts.final_chunks += len(chunks)
        chunks = []
    for chunk in chunks:
        box = grid.chunk_box(chunk)
        if grid.contributors(chunk) == [tile]:
            _write_chunk(out, box, total[(..., *_slices(box, origin))], norms)
            counts.final_chunks += 1
            continue
        piece = total[(..., *_slices(_intersect(box, extent), origin))].cpu().numpy()
        spill = work.spill(chunk, tile)
        spill.parent.mkdir(exist_ok=True)
        if piece.any():
            _save_atomic(spill, piece, writer)
        else:
            _write_atomic(spill.with_suffix(".zero"), b"", writer)
        shared.append(chunk)
    _write_atomic(work.tile_done(tile), b"", writer)
    return shared


# ----------------------------------------------------------------------------- parts
@contextlib.contextmanager
def _holding(work: Work, name: str) -> Iterator[None]:
    try:
        with output_lock(work.folder / name):
            yield
    except OutputBusy as exc:
        raise CtsegError(
            f"{work.folder}: another ctseg predict is running {name} of this volume now; wait "
            "for it to finish"
        ) from exc


def run_part(
    model: torch.nn.Module,
    work: Work,
    source: VolumeSource,
    settings: InferenceSettings,
    device: torch.device,
    part: int = 0,
    parts: int = 1,
    cache_bytes: int = 64 * 2**20,
    desc: str | None = None,
) -> dict[str, Any]:
    """Compute part `part` of `parts` of the volume into `work` (module docstring), skipping the
    tiles already done; returns counts, the read amplification and timings. `desc` names the
    progress bar (default: the part)."""
    grid = work.grid
    low, high = work.manifest["intensity_range"]
    writer = f"part-{part}-of-{parts}"
    mine = part_tiles(grid.tiles(), parts, part)
    own = set(mine)
    todo = [t for t in mine if not work.tile_done(t).exists()]
    counts = _Counts(resumed_tiles=len(mine) - len(todo))
    reader = ChunkCache(source, cache_bytes, [_input_box(grid, t) for t in todo])
    norms = _Norms(grid)
    out = work.probabilities()
    n_windows = sum(len(grid.corners(t)) for t in todo)
    t0 = time.perf_counter()
    bar = Progress(total=n_windows, unit="window", desc=desc or f"part {part + 1}/{parts}",
                   file=sys.stderr)  # fmt: skip
    # The next tile's input is read and decoded on a thread while this tile runs: the reader
    # is used by that one thread only, one read at a time.
    inputs = [_input_box(grid, t) for t in todo]
    try:
        with (
            _holding(work, writer),
            model_session(model, settings, device),
            ThreadPoolExecutor(1, thread_name_prefix="ctseg-read-ahead") as ahead,
        ):
            _remove_temporaries(work.folder, writer)
            pending = ahead.submit(reader.read, inputs[0]) if todo else None
            for i, tile in enumerate(todo):
                raw = pending.result()  # type: ignore[union-attr]
                if i + 1 < len(todo):
                    pending = ahead.submit(reader.read, inputs[i + 1])
                shared = _run_tile(
                    model, work, tile, raw, low, high, settings, device, out, norms, bar,
                    counts, writer,
                )  # fmt: skip
                del raw
                counts.tiles += 1
                if tile != todo[-1]:
                    release_heap()  # the tile's buffers, before the next tile's
                for chunk in shared:
                    ready = grid.contributors(chunk)
                    if work.chunk_done(chunk).exists() or not set(ready) <= own:
                        continue
                    if all(work.tile_done(t).exists() for t in ready):
                        _finalise_shared(work, chunk, out, norms, writer)
                        counts.final_chunks += 1
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    region = _region_bytes(grid, todo, source.dtype.itemsize)
    return {
        "part": part,
        "parts": parts,
        "tiles": len(mine),
        "tiles_computed": counts.tiles,
        "tiles_resumed": counts.resumed_tiles,
        "tile": list(grid.tile),
        "windows": counts.windows,
        "skipped_windows": counts.skipped,
        "chunks_final": counts.final_chunks,
        "bytes_fetched": reader.bytes_fetched,
        "bytes_of_region": region,
        "read_amplification": reader.bytes_fetched / region if region else 0.0,
        "peak_cached_bytes": reader.peak_cached_bytes,
        "seconds": seconds,
    }


def _region_bytes(grid: TileGrid, tiles: Sequence[Index], itemsize: int) -> int:
    """Bytes of the input region the tiles cover: the union of their extents (within the
    volume), counted exactly over the grid of the extents' own edges, so that a part's tiles
    that do not fill their bounding box are not counted as if they did."""
    if not tiles:
        return 0
    boxes = [
        [(lo, min(hi, grid.shape[a])) for a, (lo, hi) in enumerate(grid.extent(t))] for t in tiles
    ]
    edges = [sorted({e for box in boxes for e in box[a]}) for a in range(3)]
    covered = np.zeros([len(e) - 1 for e in edges], dtype=bool)
    for box in boxes:
        covered[
            tuple(slice(edges[a].index(lo), edges[a].index(hi)) for a, (lo, hi) in enumerate(box))
        ] = True
    sizes = [np.diff(e) for e in edges]
    voxels = np.einsum("zyx,z,y,x->", covered, *sizes, dtype=np.int64)
    return int(voxels) * itemsize


def finish(work: Work, parts: int = 1, z_range: tuple[int, int] | None = None) -> dict[str, Any]:
    """Make the seams final: every tile must be done (else one line naming the parts to run);
    then every shared chunk not yet final (with `z_range`, every one starting in [start, stop)
    along z) is summed from its spills."""
    grid = work.grid
    tiles = grid.tiles()
    missing: dict[int, int] = {}
    for k in range(parts):
        for tile in part_tiles(tiles, parts, k):
            if not work.tile_done(tile).exists():
                missing[k] = missing.get(k, 0) + 1
    if missing:
        listed = ", ".join(f"part {k} ({n} tiles left)" for k, n in sorted(missing.items()))
        raise CtsegError(
            f"{work.folder}: not every part is done: {listed}; run `ctseg predict ... --parts "
            f"{parts} --part K` for each, then --finish again"
        )
    out = work.probabilities()
    norms = _Norms(grid)
    made = 0
    # The jobs of z-ranges run at once, each under its own name (ended by "-", so that no
    # range's name begins another's: `_remove_temporaries` matches by prefix).
    writer = "finish" if z_range is None else f"seams-{z_range[0]}-{z_range[1]}-"
    with _holding(work, writer):
        _remove_temporaries(work.folder, writer)
        for chunk in grid.all_chunks():
            if z_range is not None and not z_range[0] <= chunk[0] * grid.chunks[0] < z_range[1]:
                continue
            if work.chunk_done(chunk).exists():
                continue
            contributors = grid.contributors(chunk)
            if len(contributors) == 1:
                continue  # written final by its tile
            _finalise_shared(work, chunk, out, norms, writer)
            made += 1
    return {"seam_chunks_final": made}
