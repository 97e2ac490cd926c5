"""A volume to predict on, read in place: a Zarr array or an OME-Zarr pyramid, on a local disk,
on S3 or over HTTP(S), or a local TIFF volume (a multi-page file or a folder of numbered slices).

A whole CT scroll (14000 x 8000 x 8000 uint8 is 0.9 TB) is not copied before `ctseg predict`
reads it. `open_source` opens it read-only where it is (fsspec for ``s3://``, ``http://`` and
``https://``), picks one level of an OME-Zarr multiscale group (NGFF 0.4, zarr v2; NGFF 0.5,
zarr v3) and refuses anything that is not a 3D volume. A TIFF volume is checked as `ctseg
convert` checks it (`ctseg.preprocess.convert.read_header`) and read through tifffile's Zarr
interface, a page (one z slice) per chunk: the same voxels its converted copy would hold.
`ChunkCache` reads the boxes the sliding windows need from whole chunks (the store's read unit:
its shards where it is sharded), each fetched with one zarr read and kept decoded in an LRU
cache of bounded size, and counts what it fetched, so the caller can report the read
amplification (bytes fetched / bytes of the region).
Tiles taken in z-major order, each grown by its halo, through a cache that holds about one slab
of chunk rows, fetch each chunk about once.

`intensity_range` gives the normalisation range: given on the command line, recorded in the
array's attributes (`ctseg convert` writes them), or else computed in one pass with the
converter's own histogram (`ctseg.preprocess.convert.Histogram`), so a volume read in place is
normalised exactly as its converted copy would be.

Every problem is a `CtsegError` of one line: the url, what is wrong, and what to do.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
import zarr
from zarr.abc.store import Store
from zarr.errors import NodeNotFoundError
from zarr.storage import FsspecStore, LocalStore

from ctseg.io import CtsegError
from ctseg.ome_zarr import multiscales_of, scale_of
from ctseg.preprocess.convert import (
    HISTOGRAM_SHARE,
    SLAB_SHARE,
    TIFF_SUFFIXES,
    Histogram,
    read_header,
    slice_files,
)
from ctseg.progress import Progress

Box = tuple[slice, slice, slice]
ZARR_MARKERS = ("zarr.json", ".zarray", ".zattrs", ".zgroup")


def _remote_errors() -> tuple[type[BaseException], ...]:
    """What a store can raise when a server or the network fails: OSError (aiohttp's connection
    errors and s3fs' translated ones are OSErrors), and the client libraries' own bases where
    they are installed. Never BaseException: an interrupt stays an interrupt."""
    errors: list[type[BaseException]] = [OSError, TimeoutError]
    try:
        import aiohttp

        errors.append(aiohttp.ClientError)
    except ImportError:
        pass
    try:
        import botocore.exceptions

        errors += [botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError]
    except ImportError:
        pass
    return tuple(errors)


READ_ERRORS = _remote_errors()


def _line(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


@dataclass(frozen=True)
class VolumeSource:
    """One 3D array opened read-only where it lies, and what the prediction needs to know of it.

    `chunks` is the read unit (the shard shape where the array is sharded): the smallest region
    one store read returns, so the unit a cache keeps. `spacing` is the chosen level's
    OME-Zarr scale (z, y, x), None where the metadata gives none."""

    url: str
    level: str | None
    array: zarr.Array
    shape: tuple[int, int, int]
    chunks: tuple[int, int, int]
    dtype: np.dtype
    spacing: tuple[float, float, float] | None
    attributes: dict

    def describe(self) -> str:
        """One line for the log: which volume, which level, and how it is laid out."""
        level = "" if self.level is None else f" level {self.level}"
        shape = "x".join(str(n) for n in self.shape)
        chunks = "x".join(str(n) for n in self.chunks)
        return f"{self.url}{level}: shape {shape} {self.dtype.name}, chunks {chunks}"


def _store(url: str, storage_options: Mapping | None) -> Store:
    """A read-only store at `url`: fsspec for a URL with a protocol, the local disk otherwise."""
    if url.startswith("file://"):
        return LocalStore(url[len("file://") :], read_only=True)
    if "://" in url:
        return FsspecStore.from_url(
            url, storage_options=dict(storage_options or {}), read_only=True
        )
    return LocalStore(url, read_only=True)


def _open_node(url: str, storage_options: Mapping | None) -> zarr.Array | zarr.Group:
    try:
        return zarr.open(store=_store(url, storage_options), mode="r")
    except NodeNotFoundError as exc:  # a FileNotFoundError too: tested first
        raise CtsegError(
            f"{url}: not a Zarr array or OME-Zarr group (no zarr.json/.zarray/.zattrs found); "
            "give the path of the array or of the OME-Zarr group"
        ) from exc
    except FileNotFoundError as exc:
        raise CtsegError(f"{url}: no such file or directory; check the path") from exc
    except READ_ERRORS as exc:
        raise CtsegError(
            f"{url}: cannot be read ({_line(exc)}); check the address, the server and the "
            "credentials (storage options)"
        ) from exc
    except (ValueError, KeyError, TypeError, ImportError) as exc:
        # Unparsable metadata, an unknown protocol, a bad storage option, a missing fsspec backend.
        raise CtsegError(
            f"{url}: cannot be opened as Zarr ({_line(exc)}); check the url, the storage "
            "options and that the protocol's fsspec package is installed"
        ) from exc


def _multiscales(url: str, group: zarr.Group) -> dict[str, Any]:
    """The group's first multiscale, NGFF 0.5 (under "ome") or 0.4 (top level)."""
    found = multiscales_of(dict(group.attrs))
    if not found:
        raise CtsegError(
            f"{url}: a group without multiscales metadata: give the array inside it, "
            f"e.g. {url.rstrip('/')}/{_first_array_name(group)}"
        )
    first = found[0] if isinstance(found, list) else None
    if not isinstance(first, dict) or not first.get("datasets"):
        raise CtsegError(
            f"{url}: the multiscales metadata lists no datasets; give the array inside the "
            f"group, e.g. {url.rstrip('/')}/<name>"
        )
    return first


def _first_array_name(group: zarr.Group) -> str:
    """An array's name inside `group`, for the error's example; "<name>" where a store cannot
    be listed (HTTP)."""
    try:
        return next(iter(sorted(group.array_keys())), "<name>")
    except (*READ_ERRORS, NotImplementedError, ValueError, KeyError, TypeError):
        return "<name>"


def _pick_level(url: str, datasets: Sequence[Mapping], level: str | int | None) -> int:
    """The index of `level` (an index, a digit string, or a dataset's path) among `datasets`."""
    paths = [str(d.get("path")) for d in datasets]
    if level is None:
        return 0
    text = str(level)
    if isinstance(level, int) or text.isdigit():
        index = int(text)
        if 0 <= index < len(paths):
            return index
    elif text in paths:
        return paths.index(text)
    last = len(paths) - 1
    raise CtsegError(
        f"{url}: level {text}: the pyramid has levels 0-{last} (paths {', '.join(paths)}); "
        f"give --level 0..{last} or one of those paths"
    )


def _spacing(multiscale: Mapping, dataset: Mapping) -> tuple[float, ...] | None:
    """The dataset's scale, times the multiscale's own where it has one (NGFF applies both)."""
    scale = scale_of(dataset.get("coordinateTransformations"))
    if scale is None:
        return None
    overall = scale_of(multiscale.get("coordinateTransformations"))
    if overall is not None and len(overall) == len(scale):
        scale = [a * b for a, b in zip(scale, overall, strict=True)]
    return tuple(scale)


def _check_axes(url: str, multiscale: Mapping) -> None:
    """ctseg reads arrays as (z, y, x): a pyramid whose axes say otherwise is refused rather
    than read transposed."""
    axes = multiscale.get("axes")
    if not axes:
        return
    names = [a.get("name") if isinstance(a, Mapping) else a for a in axes]
    if len(names) == 3 and names != ["z", "y", "x"]:
        raise CtsegError(
            f"{url}: axes ({', '.join(map(str, names))}): ctseg reads volumes as (z, y, x); "
            "give a volume stored in that order"
        )


def _tiff_array(url: str) -> zarr.Array | None:
    """A local multi-page TIFF, or a folder of numbered 2D slice TIFFs (no zarr metadata in it),
    as a read-only Zarr array through tifffile's Zarr interface, after `ctseg convert`'s header
    checks; None for anything else."""
    if "://" in url and not url.startswith("file://"):
        return None
    path = Path(url.removeprefix("file://"))
    if path.is_file() and path.suffix.lower() in TIFF_SUFFIXES:
        read_header(path)
        tif = tifffile.TiffFile(path)
        if len(tif.series) > 1:  # pages written one at a time: each its own shaped series
            tif.close()
            tif = tifffile.TiffFile(path, is_shaped=False)
        store = tif.series[0].aszarr()
    elif path.is_dir() and not any((path / m).exists() for m in ZARR_MARKERS):
        if not slice_files(path):
            return None
        read_header(path)
        store = tifffile.TiffSequence(slice_files(path)).aszarr()
    else:
        return None
    return zarr.open_array(store, mode="r")


def open_source(
    url: str, level: str | int | None = None, storage_options: Mapping | None = None
) -> VolumeSource:
    """Open the 3D volume at `url` read-only, where it lies: a Zarr array (v2 or v3), or one
    level of an OME-Zarr multiscale group (`level`: an index, a digit string or a dataset's
    path; default 0, the full resolution). Nothing is read but the metadata."""
    tiff = _tiff_array(str(url))
    node = tiff if tiff is not None else _open_node(str(url), storage_options)
    chosen: str | None = None
    spacing = None
    if isinstance(node, zarr.Array):
        if level not in (None, 0, "0"):
            raise CtsegError(
                f"{url}: level {level}: a plain Zarr array has no levels; leave out --level"
            )
        array = node
    else:
        multiscale = _multiscales(url, node)
        datasets = multiscale["datasets"]
        dataset = datasets[_pick_level(url, datasets, level)]
        chosen = str(dataset.get("path"))
        _check_axes(url, multiscale)
        try:
            array = node[chosen]
        except (KeyError, NodeNotFoundError, FileNotFoundError) as exc:
            raise CtsegError(
                f"{url}: level {chosen}: the multiscales metadata names it, but there is no "
                f"array at {url.rstrip('/')}/{chosen}; check the store is complete"
            ) from exc
        except READ_ERRORS as exc:
            raise CtsegError(f"{url}: level {chosen} cannot be read ({_line(exc)})") from exc
        if not isinstance(array, zarr.Array):
            raise CtsegError(f"{url}: level {chosen} is a group, where an array is expected")
        spacing = _spacing(multiscale, dataset)
    if array.ndim != 3:
        where = "" if chosen is None else f" level {chosen}"
        raise CtsegError(
            f"{url}{where}: shape {tuple(array.shape)} is not 3D; ctseg predicts on 3D "
            "volumes (z, y, x): give a 3D array"
        )
    if spacing is not None and len(spacing) != 3:
        raise CtsegError(f"{url}: level {chosen}: scale {list(spacing)} has not 3 values")
    return VolumeSource(
        url=str(url),
        level=chosen,
        array=array,
        shape=tuple(int(n) for n in array.shape),
        chunks=tuple(int(n) for n in (array.shards or array.chunks)),
        dtype=np.dtype(array.dtype),
        spacing=spacing,
        attributes=dict(array.attrs),
    )


class ChunkCache:
    """Boxes of a volume assembled from whole read units (chunks, or shards where sharded),
    each fetched with one zarr read and kept decoded in a cache of at most `budget_bytes`, so
    overlapping windows do not fetch a chunk again while it is cached.

    Which chunk leaves a full cache: with a `schedule` (every box the caller will read, in
    order), the one needed again furthest ahead, and a chunk needed never again is not kept
    (Belady's rule, optimal for a known order: ctseg's tiles go in z-major order, and a chunk
    row is needed again one plane of tiles later, which a least-recently-used cache smaller
    than that plane would always have dropped: 1.65x the reads against 1.08x on the test of
    tests/test_predict_scroll.py). Without one, the least recently used.

    A chunk larger than the budget is read but not kept; a budget of 0 keeps nothing. The
    counters say what the reads cost: `bytes_fetched` (decoded bytes of every chunk read from
    the store, re-reads counted; an edge chunk counts its part inside the volume),
    `bytes_requested` (bytes of the boxes asked for), `chunks_fetched`, `hits` (chunks found
    in the cache) and `peak_cached_bytes`. Not thread-safe."""

    def __init__(
        self, source: VolumeSource, budget_bytes: int, schedule: Sequence[Box] | None = None
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes}: expected >= 0")
        self.source = source
        self.budget_bytes = int(budget_bytes)
        self._chunks: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()
        # With a schedule: the read numbers at which each chunk is needed, the number of the
        # read under way, and a heap of (-next use, chunk) for the chunks held (entries go
        # stale as reads advance; `_evict` skips those).
        self._uses: dict[tuple[int, int, int], collections.deque[int]] | None = None
        self._reads = 0
        self._furthest: list[tuple[float, tuple[int, int, int]]] = []
        if schedule is not None:
            self._uses = {}
            for n, box in enumerate(schedule):
                self._check(box)
                for index in self._indices(box):
                    self._uses.setdefault(index, collections.deque()).append(n)
        self.cached_bytes = 0
        self.bytes_fetched = 0
        self.bytes_requested = 0
        self.chunks_fetched = 0
        self.hits = 0
        self.peak_cached_bytes = 0

    def _check(self, box: Box) -> None:
        if len(box) != 3:
            raise ValueError(f"box {box}: expected three slices (z, y, x)")
        for axis, (part, size) in enumerate(zip(box, self.source.shape, strict=True)):
            if (
                not isinstance(part, slice)
                or not isinstance(part.start, int | np.integer)
                or not isinstance(part.stop, int | np.integer)
                or part.step not in (None, 1)
                or not 0 <= part.start <= part.stop <= size
            ):
                raise ValueError(
                    f"box {box}: axis {axis} must be a slice with explicit start and stop "
                    f"within 0..{size} and no step"
                )

    def read(self, box: Box) -> np.ndarray:
        """The voxels of `box` (explicit, in-volume slices), from cached or fetched chunks."""
        self._check(box)
        starts = [int(part.start) for part in box]
        stops = [int(part.stop) for part in box]
        out = np.empty([b - a for a, b in zip(starts, stops, strict=True)], self.source.dtype)
        self.bytes_requested += out.nbytes
        if self._uses is not None:
            for index in self._indices(box):  # this read's use of each chunk is now
                uses = self._uses.get(index)
                while uses and uses[0] <= self._reads:
                    uses.popleft()
        self._reads += 1
        if out.size == 0:
            return out
        unit = self.source.chunks
        indices = self._indices(box)
        if self._uses is not None and not any(
            i in self._chunks or self._next_use(i) < math.inf for i in indices
        ):
            # None of its chunks is held or needed again (a tile that is the whole volume): one
            # store read of their hull, which zarr decodes in parallel.
            hull = tuple(
                slice(i0 * u, min((i1 + 1) * u, n))
                for i0, i1, u, n in zip(indices[0], indices[-1], unit, self.source.shape,
                                        strict=True)
            )  # fmt: skip
            block = self._fetch(hull)
            self.chunks_fetched += len(indices)
            self.bytes_fetched += block.nbytes
            return block[tuple(slice(a - h.start, b - h.start)
                               for a, b, h in zip(starts, stops, hull, strict=True))]  # fmt: skip
        for index in indices:
            chunk = self._chunk(index)
            origin = [i * u for i, u in zip(index, unit, strict=True)]
            lo = [max(a, o) for a, o in zip(starts, origin, strict=True)]
            hi = [min(b, o + n) for b, o, n in zip(stops, origin, chunk.shape, strict=True)]
            into = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, starts, strict=True))
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin, strict=True))
            out[into] = chunk[src]
        return out

    def _indices(self, box: Box) -> list[tuple[int, int, int]]:
        """The grid indices of the chunks `box` meets, in z-major order."""
        ranges = [
            range(int(part.start) // u, (int(part.stop) - 1) // u + 1)
            for part, u in zip(box, self.source.chunks, strict=True)
        ]
        return list(itertools.product(*ranges))  # type: ignore[arg-type]

    def _next_use(self, index: tuple[int, int, int]) -> float:
        uses = None if self._uses is None else self._uses.get(index)
        return float(uses[0]) if uses else math.inf

    def _chunk(self, index: tuple[int, int, int]) -> np.ndarray:
        """The chunk at grid `index`, from the cache (then the most recently used) or fetched."""
        cached = self._chunks.get(index)
        if cached is not None:
            self._chunks.move_to_end(index)
            self.hits += 1
            if self._uses is not None:
                next_use = self._next_use(index)
                if next_use == math.inf:  # this read was its last
                    self.cached_bytes -= self._chunks.pop(index).nbytes
                else:
                    heapq.heappush(self._furthest, (-next_use, index))
            return cached
        region = tuple(
            slice(i * u, min((i + 1) * u, n))
            for i, u, n in zip(index, self.source.chunks, self.source.shape, strict=True)
        )
        chunk = self._fetch(region)  # type: ignore[arg-type]
        chunk.flags.writeable = False  # shared by every box that reads it
        self.chunks_fetched += 1
        self.bytes_fetched += chunk.nbytes
        self._keep(index, chunk)
        return chunk

    def _fetch(self, region: Box) -> np.ndarray:
        """One store read of `region`; a failed one is a line naming the volume and the box."""
        try:
            return np.asarray(self.source.array[region])
        except READ_ERRORS as exc:
            where = ", ".join(f"{r.start}:{r.stop}" for r in region)
            raise CtsegError(
                f"{self.source.url}: reading [{where}] failed ({_line(exc)}); check the "
                "connection and rerun"
            ) from exc

    def _keep(self, index: tuple[int, int, int], chunk: np.ndarray) -> None:
        if chunk.nbytes > self.budget_bytes:
            return
        if self._uses is not None:
            next_use = self._next_use(index)
            if next_use == math.inf:
                return  # never needed again
            while self.cached_bytes + chunk.nbytes > self.budget_bytes:
                furthest = self._furthest_held()
                if furthest is None or furthest < next_use:
                    return  # every chunk held is needed sooner than this one
                self.cached_bytes -= self._chunks.pop(heapq.heappop(self._furthest)[1]).nbytes
            heapq.heappush(self._furthest, (-next_use, index))
        while self.cached_bytes + chunk.nbytes > self.budget_bytes:
            _, old = self._chunks.popitem(last=False)
            self.cached_bytes -= old.nbytes
        self._chunks[index] = chunk
        self.cached_bytes += chunk.nbytes
        self.peak_cached_bytes = max(self.peak_cached_bytes, self.cached_bytes)

    def _furthest_held(self) -> float | None:
        """When the held chunk needed again furthest ahead is needed (the heap's top, once the
        entries that went stale as reads advanced are dropped); None if nothing is held."""
        while self._furthest:
            negative, index = self._furthest[0]
            if index in self._chunks and -negative == self._next_use(index):
                return -negative
            heapq.heappop(self._furthest)
        return None

    def read_amplification(self, region_bytes: int | None = None) -> float:
        """Bytes fetched per byte of the region: `region_bytes` (e.g. the volume's bytes, when
        the windows cover it), or with None the bytes of the boxes asked for, overlaps counted
        each time. 1.0 means every chunk was fetched once; 0.0 when nothing was asked."""
        denominator = self.bytes_requested if region_bytes is None else int(region_bytes)
        return self.bytes_fetched / denominator if denominator > 0 else 0.0


def _block_plan(
    shape: Sequence[int], unit: Sequence[int], itemsize: int, budget: float
) -> list[int]:
    """The block (depth, height, width) of one statistics read, in whole read units: whole
    planes, as many unit rows as fit in `budget`; where one unit row of whole planes does not
    fit, one unit row cut in bands of whole units along y, then along x; at least one unit."""
    block = list(shape)
    for axis in range(3):
        block[axis] = min(unit[axis], shape[axis])
        one = math.prod(block) * itemsize  # one unit along `axis`, whole extents after it
        block[axis] = min(max(1, int(budget // one)) * unit[axis], shape[axis])
        if one <= budget:
            break
    return block


def _count_slab(
    source: VolumeSource, histogram: Histogram, z0: int, z1: int, block: Sequence[int]
) -> None:
    """Count planes z0..z1-1 into `histogram`, as `Histogram.add` counts a slab of them.

    Where whole planes fit, the slab is given to `add` as it is. Otherwise the planes are read
    in bands of whole read units, counted as plain values, and the slab's empty slices (one
    value throughout: `add` leaves them out of the statistics) are found from each plane's
    minimum and maximum over its bands and recorded as `add` would."""
    _, ny, nx = source.shape
    array = source.array
    if block[1] == ny and block[2] == nx:
        histogram.add(np.asarray(array[z0:z1]))
        return
    low = np.full(z1 - z0, np.iinfo(source.dtype).max, dtype=np.int64)
    high = np.full(z1 - z0, -1, dtype=np.int64)
    for y0 in range(0, ny, block[1]):
        for x0 in range(0, nx, block[2]):
            part = np.asarray(array[z0:z1, y0 : y0 + block[1], x0 : x0 + block[2]])
            histogram.add(part.reshape(-1))
            planes = part.reshape(len(part), -1)
            low = np.minimum(low, planes.min(axis=1))
            high = np.maximum(high, planes.max(axis=1))
    for value in low[low == high]:
        histogram.empty[value] += ny * nx
        histogram.empty_slices += 1


def statistics_pieces(source: VolumeSource, pieces: int) -> list[tuple[int, int]]:
    """The z-ranges of the volume's statistics read in `pieces` jobs: as equal as whole chunks
    along z allow (a piece may be empty where there are fewer chunks than pieces)."""
    unit = int(source.chunks[0])
    nz = int(source.shape[0])
    units = math.ceil(nz / unit)
    bounds = [min(nz, (units * k // pieces) * unit) for k in range(pieces + 1)]
    return list(itertools.pairwise(bounds))


def _check_countable(source: VolumeSource) -> None:
    dtype = source.dtype
    if dtype.kind != "u" or dtype.itemsize not in (1, 2):
        raise CtsegError(
            f"{source.url}: dtype {dtype.name} without p0_5/p99_5 attributes: the statistics "
            "pass counts uint8 or uint16 only; give --intensity-range LOW HIGH"
        )


def count_planes(
    source: VolumeSource, z0: int, z1: int, memory_budget_bytes: int, desc: str = "statistics"
) -> Histogram:
    """The converter's histogram of planes z0..z1-1, read slab by slab within
    `memory_budget_bytes`: whole planes, or bands of them (`_count_slab`). Histograms of
    disjoint z-ranges sum (counts, empty slices) to the whole volume's, exactly."""
    _check_countable(source)
    dtype = source.dtype
    histogram = Histogram(dtype, int(memory_budget_bytes * HISTOGRAM_SHARE) // 8)
    block = _block_plan(
        source.shape, source.chunks, dtype.itemsize, memory_budget_bytes * SLAB_SHARE
    )
    with Progress(total=z1 - z0, unit="slice", desc=f"{desc} {source.url}") as progress:
        for start in range(z0, z1, block[0]):
            end = min(start + block[0], z1)
            _count_slab(source, histogram, start, end, block)
            progress.update(end - start)
    return histogram


def histogram_range(histogram: Histogram) -> tuple[float, float]:
    """The normalisation range (p0_5, p99_5) the converter records for these counts."""
    stats = histogram.stats()
    return float(stats["p0_5"]), float(stats["p99_5"])


def intensity_range(
    source: VolumeSource,
    given: tuple[float, float] | None = None,
    memory_budget_bytes: int = 256 * 2**20,
) -> tuple[float, float, str]:
    """The normalisation range (p0_5, p99_5) and one line saying where it came from.

    `given` (an option) wins; then the array's attributes p0_5 and p99_5, which `ctseg convert`
    records; else one pass over the whole array (`count_planes`), through the converter's
    histogram, so the range is exactly what `ctseg convert` would record for the same voxels
    (saturated voxels and empty slices left out alike). The pass needs uint8 or uint16, as the
    converter does: other dtypes need the range given."""
    if given is not None:
        low, high = (float(v) for v in given)
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise CtsegError(
                f"--intensity-range {given[0]} {given[1]}: expected two finite numbers, LOW "
                "below HIGH"
            )
        return low, high, "given"
    attrs = source.attributes
    if "p0_5" in attrs and "p99_5" in attrs:
        return float(attrs["p0_5"]), float(attrs["p99_5"]), "the array's attributes p0_5/p99_5"
    histogram = count_planes(source, 0, source.shape[0], memory_budget_bytes)
    voxels = math.prod(source.shape)
    level = "" if source.level is None else f" level {source.level}"
    how = (
        f"computed from all {voxels} voxels of {source.url}{level} (one pass, "
        f"{voxels * source.dtype.itemsize / 1e6:.1f} MB read)"
    )
    return (*histogram_range(histogram), how)
