"""`ctseg convert`: a TIFF volume to a Zarr v3 array, streamed by slabs of z slices.

The source is a multi-page 3D TIFF (one 2D page per z slice) or a directory of 2D slice TIFFs
in natural order of file name. The array is written once, slab by slab, each slab a whole number
of chunk (or shard) rows, so peak memory follows ``memory_budget_mb`` and not the volume. The
intensity statistics come from an exact histogram that is accumulated on the way, so they cost
no second pass. Percentiles use numpy's default definition (``np.percentile(method="linear")``).
The statistics leave out saturated voxels (the dtype's maximum) and empty slices (one value
throughout), which would otherwise set the normalisation range (`Histogram`); the attributes
``stats_voxels`` and ``stats_left_out`` say how many voxels they are of and what was left out.

Throughput: the work is spread over threads that release the GIL. The source's sha256 is
computed on its own thread from the start; pixel data stored plainly (uncompressed, page after
page, as most volumes are) are read with one read per chunk row; zarr writes each chunk row on a
background thread while the calling thread counts the histogram. With room for two slabs in the
budget, one slab is read while the previous one is written.

Nothing silently wrong: a truncated or corrupt TIFF, a volume that is not 3D, an unsupported
dtype, a shape that disagrees with the image, label values outside {0, 1, 2}, a slice directory
with a gap or a stray file, or too little free space raise `CtsegError` naming the file, and
nothing is left behind at ``dest``: `ctseg.io.fresh_output` writes to a temporary sibling,
removes it on any error (a full disk included), and removes a killed run's before starting.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tifffile
import zarr

from ctseg.io import CtsegError, bytes_on_disk, fresh_output, sha256_file, sha256_files
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.progress import Progress
from ctseg.store import create_volume, make_compressors

Shape3 = tuple[int, int, int]
SlabReader = Callable[[int, int, np.ndarray], None]

TIFF_SUFFIXES = (".tif", ".tiff")
PERCENTILES = {"p0_5": 0.5, "p99_5": 99.5}
NATIVE_BYTEORDER = "<" if sys.byteorder == "little" else ">"

# Share of the memory budget the slab buffers may take together. The rest is for the
# histogram's temporary (np.bincount casts its input to intp, 8 bytes per value) and the chunk
# copies being encoded (two chunks per write thread, or zarr's own buffers).
SLAB_SHARE = 0.5
HISTOGRAM_SHARE = 0.125
# Larger histogram pieces are no faster (measured), only bigger: 2 MiB of intp.
MAX_HISTOGRAM_PIECE = 1 << 18
# Counting uint8 in pairs allocates 65536 counts (512 KiB) per piece: below this piece size
# that costs more than it saves, and more memory than the budget's histogram share.
MIN_PAIR_PIECE = 1 << 17
# Room for a chunk's codec header (blosc stores what does not compress behind 16-32 bytes) and
# for zarr.json, in the free-space estimate.
CHUNK_OVERHEAD = 64
METADATA_BYTES = 64 << 10


@dataclass(frozen=True)
class _Source:
    path: Path
    files: tuple[Path, ...]  # the one multi-page file, or the slice files in z order
    shape: Shape3
    dtype: np.dtype
    pages_are_series: bool = False  # a multi-page file whose pages tifffile sees as 1-page series
    is_slice_directory: bool = False
    # Where the pixels start when they are stored plainly (uncompressed, row by row, page after
    # page with nothing between): a slab is then one read at a known offset.
    data_offset: int | None = None
    swap_bytes: bool = False  # uint16 pixels in the other byte order than this machine's


# --- header checks ---------------------------------------------------------------------------


def read_header(source: Path) -> tuple[Shape3, np.dtype]:
    """Shape and dtype without reading pixel data; validates dimensionality.

    Raises `CtsegError` on problems: a missing, truncated or corrupt file, a volume that is not
    3D, an unsupported dtype, a zero size, or slices that disagree.
    """
    src = _inspect(Path(source))
    return src.shape, src.dtype


# The last run of digits in a slice file's name is its z number: "slice_0042.tif" is slice 42 of
# the naming ("slice_", ".tif"). The prefix is lazy so that the number is the last one.
SLICE_NAME = re.compile(r"^(.*?)(\d+)(\D*)$")


def slice_files(directory: Path) -> list[Path]:
    """The slice files in z order, after checking that they form one gapless numbered series.

    A directory of slices has no header that says how many there are, so a stray file
    ("extra.tif", "slice_0005 (copy).tif") would become a slice, and a missing one would make a
    shorter volume, both without a word. Every TIFF in the directory must follow the naming of
    the others, one number each, with no number left out.
    """
    # Hidden files are skipped: macOS leaves "._slice_0001.tif" resource forks beside the slices.
    files = [
        p
        for p in directory.iterdir()
        if p.suffix.lower() in TIFF_SUFFIXES and not p.name.startswith(".") and p.is_file()
    ]
    if not files:
        return []
    series: dict[tuple[str, str], list[tuple[int, Path]]] = {}
    unnumbered = []
    for path in files:
        match = SLICE_NAME.match(path.name)
        if match is None:
            unnumbered.append(path)
        else:
            key = (match[1], match[3].lower())
            series.setdefault(key, []).append((int(match[2]), path))
    if not series:
        raise CtsegError(
            f"{directory}: slice files must be numbered (e.g. slice_0000.tif), found "
            f"{_names(unnumbered)}"
        )
    # The naming most files share is the series; anything else is a stray file.
    (prefix, suffix), numbered = max(series.items(), key=lambda item: (len(item[1]), item[0]))
    stray = unnumbered + [
        p for key, items in series.items() if key != (prefix, suffix) for _, p in items
    ]
    if stray:
        raise CtsegError(
            f"{directory}: {len(stray)} file(s) do not follow the naming {prefix}<number>{suffix} "
            f"of the other {len(numbered)} slices: {_names(stray)}; move them out of the directory"
        )
    numbered.sort(key=lambda item: (item[0], item[1].name))
    numbers = [n for n, _ in numbered]
    for (a, first), (b, second) in itertools.pairwise(numbered):
        if a == b:
            raise CtsegError(
                f"{directory}: {first.name} and {second.name} are both slice {a}; remove one"
            )
    missing = sorted(set(range(numbers[0], numbers[-1] + 1)) - set(numbers))
    if missing:
        shown = ", ".join(str(n) for n in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise CtsegError(
            f"{directory}: {len(missing)} slice(s) missing between {numbered[0][1].name} and "
            f"{numbered[-1][1].name}: number(s) {shown}; restore them (the volume would be "
            "silently shorter)"
        )
    return [p for _, p in numbered]


def _names(paths: list[Path]) -> str:
    names = sorted(p.name for p in paths)
    return ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")


# What fixes a damaged source: ctseg cannot repair it, and a rerun would read the same bytes.
COPY_AGAIN = "copy the file again from its source"
# tifffile names its own objects in its messages ("<tifffile.TiffPages @8> invalid page offset").
TIFFFILE_OBJECT = re.compile(r"<tifffile\.[^>]*>\s*")


def _damaged(path: Path, problem: str) -> CtsegError:
    return CtsegError(f"{path}: truncated or damaged TIFF: {problem}; {COPY_AGAIN}")


def _file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _tifffile_problem(path: Path, message: str) -> str:
    """What tifffile found, in the file's terms rather than its own object names."""
    text = TIFFFILE_OBJECT.sub("", message).strip()
    size = _file_size(path)
    offset = re.fullmatch(r"invalid page offset (\d+)", text)
    if offset is not None:
        at = int(offset[1])
        if size is not None and at >= size:
            return f"a page should start at byte {at}, but the file has only {size} bytes"
        return f"what should be a page at byte {at} is not one"
    tags = re.match(r"corrupted tag list of page (\d+)", text)
    if tags is not None:
        return f"the directory of page {tags[1]} is garbled"
    if "ImageJ series metadata invalid" in text:
        return "its ImageJ header does not match the pages the file holds"
    return text


def _unreadable(path: Path, exc: Exception) -> CtsegError:
    """One line for an error tifffile raised: not a TIFF at all, or a damaged one."""
    size = _file_size(path)
    if size == 0:
        return CtsegError(f"{path}: an empty file (0 bytes), not a TIFF; {COPY_AGAIN}")
    text = str(exc)
    if text.startswith("not a TIFF file"):
        with contextlib.suppress(OSError), open(path, "rb") as handle:
            first = handle.read(4).hex(" ")
            text = f"its first bytes are {first}, where a TIFF's are 49 49 (II) or 4d 4d (MM)"
        return CtsegError(
            f"{path}: not a TIFF file ({text}); save the volume as a multi-page TIFF, or "
            f"{COPY_AGAIN} if it is one"
        )
    if isinstance(exc, struct.error):  # a header read past the end of the file
        return _damaged(path, f"a header runs past the end of the file ({size} bytes)")
    return _damaged(path, _tifffile_problem(path, text))


@contextlib.contextmanager
def _tifffile_errors(path: Path) -> Iterator[None]:
    """Turn what tifffile logs and then tolerates (a broken page chain, a bad tag) into errors.

    tifffile recovers from a truncated page chain by logging an error and returning the pages
    it could reach, which for a file without shape metadata would be a shorter, valid-looking
    volume.
    """
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("tifffile")
    logger.addHandler(handler)

    def logged_error() -> CtsegError:
        return _damaged(path, _tifffile_problem(path, records[0].getMessage()))

    try:
        yield
    except Exception as exc:
        # A logged structural error is the cause of whatever failed after it (a truncated file
        # can look 2D), so it is reported first.
        if records:
            raise logged_error() from exc
        if isinstance(exc, CtsegError):
            raise
        # tifffile raises many types for damaged files.
        raise _unreadable(path, exc) from exc
    else:
        if records:
            raise logged_error()
    finally:
        logger.removeHandler(handler)


def _check_dtype(path: Path, dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind != "u" or dtype.itemsize not in (1, 2):
        raise CtsegError(f"{path}: unsupported dtype {dtype}; expected uint8 or uint16")
    return dtype.newbyteorder("=")


def _ifd_end(tif: tifffile.TiffFile, page: Any) -> int:
    """Offset one past the page's directory (its tags and its next-directory offset)."""
    fmt = tif.tiff
    handle = tif.filehandle
    handle.seek(page.offset)
    raw = handle.read(fmt.tagnosize)
    if len(raw) < fmt.tagnosize:
        return handle.size + 1
    (tagno,) = struct.unpack(fmt.tagnoformat, raw)
    return page.offset + fmt.tagnosize + tagno * fmt.tagsize + fmt.offsetsize


def _check_page_data(path: Path, tif: tifffile.TiffFile, page: Any, z: int) -> None:
    """Reject pages whose directory, strips or tiles run past the end of the file or are missing.

    tifffile fills missing or short segments with zeros, and reads a directory cut short by the
    end of the file as far as it goes, so a truncated file would otherwise read back as a volume
    with a black tail, or with no complaint at all.
    """
    if page is None:
        raise _damaged(path, f"page {z} cannot be read")
    file_size = tif.filehandle.size
    if _ifd_end(tif, page) > file_size:
        raise _damaged(path, f"the directory of page {z} is cut off")
    offsets, counts = page.dataoffsets, page.databytecounts
    if not offsets or len(offsets) != len(counts):
        raise _damaged(path, f"page {z} has no image data")
    for offset, count in zip(offsets, counts, strict=True):
        if count <= 0 or offset <= 0:
            raise _damaged(path, f"page {z} has a missing strip or tile")
        if offset + count > file_size:
            raise _damaged(
                path, f"page {z} needs bytes up to {offset + count} but the file has {file_size}"
            )
    keyframe = page.keyframe
    if keyframe.compression == 1 and sum(counts) < keyframe.nbytes:
        raise _damaged(
            path,
            f"page {z} holds {sum(counts)} bytes of uncompressed data, {keyframe.nbytes} expected",
        )


def _describe_ndim(shape: tuple[int, ...]) -> str:
    if len(shape) == 2:
        return f"is a 2D image {shape} (a single page); expected a 3D volume (z, y, x)"
    return f"has {len(shape)} dimensions {shape}; expected a 3D volume (z, y, x) of grey values"


def _stack_layout(path: Path, tif: tifffile.TiffFile) -> tuple[tuple[int, ...], Any, list, bool]:
    """Shape, dtype, the pages in z order, and whether each page is its own series."""
    series = tif.series
    if not series:
        raise _damaged(path, "it holds no image data")
    if len(series) == 1:
        return tuple(int(n) for n in series[0].shape), series[0].dtype, list(series[0].pages), False
    # Pages written one at a time with shape metadata each form their own series; that is still
    # a stack of z slices, as long as every series is one 2D page of the same shape and type.
    kinds = {(s.shape, s.dtype) for s in series}
    if len(kinds) != 1 or any(len(s.pages) != 1 or len(s.shape) != 2 for s in series):
        shapes = sorted({str(s.shape) for s in series})
        raise CtsegError(
            f"{path}: holds {len(series)} images of different shapes, types or dimensions "
            f"({', '.join(shapes)}); expected one 3D volume"
        )
    return (len(series), *series[0].shape), series[0].dtype, [s.pages[0] for s in series], True


def _plain_data_offset(
    tif: tifffile.TiffFile, pages: list, shape: Any, dtype: np.dtype
) -> int | None:
    """Offset of the first pixel if the pixels of all pages are one plain run of bytes, else None.

    Plain: uncompressed, no predictor, no bit reversal, strips (not tiles) of whole bytes per
    sample, and every page's strips exactly following the previous ones, page after page, so
    slice z starts at ``offset + z * plane_bytes``. Derived from every page's own offsets, not
    from the first page, so a file that only starts out contiguous is read page by page.
    """
    plane = shape[1] * shape[2] * dtype.itemsize
    for keyframe in {id(page.keyframe): page.keyframe for page in pages}.values():
        if (
            keyframe.compression != 1
            or keyframe.predictor != 1
            or keyframe.fillorder != 1
            or keyframe.is_tiled
            or keyframe.samplesperpixel != 1
            or keyframe.bitspersample != 8 * dtype.itemsize
            or keyframe.sampleformat != 1
        ):
            return None
    start = int(pages[0].dataoffsets[0])
    expected = start
    for page in pages:
        for offset, count in zip(page.dataoffsets, page.databytecounts, strict=True):
            if offset != expected:
                return None
            expected += count
        if (expected - start) % plane:
            return None
    if expected != start + len(pages) * plane or expected > tif.filehandle.size:
        return None
    return start


def _inspect_file(path: Path) -> _Source:
    """Validate a multi-page TIFF's structure from its headers alone."""
    with _tifffile_errors(path), tifffile.TiffFile(path) as tif:
        tif.pages.useframes = True  # light page objects: offsets and shape are all we need
        shape, dtype, pages, pages_are_series = _stack_layout(path, tif)
        if pages and pages[0] is not None and len(pages[0].shape) != 2:
            raise CtsegError(
                f"{path}: pages have shape {pages[0].shape} (several samples per pixel, "
                "e.g. RGB); expected 2D grey slices"
            )
        if len(shape) != 3:
            raise CtsegError(f"{path}: {_describe_ndim(shape)}")
        _check_nonempty(path, shape)
        dtype = _check_dtype(path, dtype)
        if len(pages) != shape[0]:
            raise _damaged(
                path, f"{len(pages)} readable pages, {shape[0]} expected for shape {shape}"
            )
        for z, page in enumerate(pages):
            _check_page_data(path, tif, page, z)
            if page.shape != shape[1:]:
                raise CtsegError(f"{path}: page {z} has shape {page.shape}, expected {shape[1:]}")
        data_offset = _plain_data_offset(tif, pages, shape, dtype)
        swap_bytes = dtype.itemsize > 1 and tif.byteorder != NATIVE_BYTEORDER
    return _Source(
        path,
        (path,),
        shape,  # type: ignore[arg-type]
        dtype,
        pages_are_series=pages_are_series,
        data_offset=data_offset,
        swap_bytes=swap_bytes,
    )


def _inspect_slice(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    with _tifffile_errors(path), tifffile.TiffFile(path) as tif:
        pages = tif.pages
        if len(pages) != 1:
            raise CtsegError(f"{path}: a slice file must hold one 2D page, found {len(pages)}")
        page = pages.first
        if len(page.shape) != 2:
            raise CtsegError(f"{path}: slice has shape {page.shape}; expected a 2D grey image")
        _check_page_data(path, tif, page, 0)
        return tuple(page.shape), _check_dtype(path, page.dtype)


def _inspect_directory(directory: Path) -> _Source:
    files = slice_files(directory)
    if not files:
        raise CtsegError(f"{directory}: no .tif/.tiff slice files in this directory")
    plane, dtype = _inspect_slice(files[0])
    for path in files[1:]:
        other_plane, other_dtype = _inspect_slice(path)
        if (other_plane, other_dtype) != (plane, dtype):
            raise CtsegError(
                f"{directory}: slices differ: {files[0].name} is {plane} {dtype}, "
                f"{path.name} is {other_plane} {other_dtype}"
            )
    shape: Shape3 = (len(files), plane[0], plane[1])
    _check_nonempty(directory, shape)
    return _Source(directory, tuple(files), shape, dtype, is_slice_directory=True)


def _check_nonempty(path: Path, shape: tuple[int, ...]) -> None:
    if math.prod(shape) == 0:
        raise CtsegError(f"{path}: zero-size volume {shape}")


def _inspect(source: Path) -> _Source:
    if source.is_dir():
        return _inspect_directory(source)
    if not source.exists():
        raise CtsegError(f"{source}: no such file or directory")
    return _inspect_file(source)


# --- reading -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _open_reader(src: _Source) -> Iterator[SlabReader]:
    """Yield ``read(z0, z1, out)``, which fills ``out`` with slices z0..z1-1."""
    if src.is_slice_directory:

        def read_slices(z0: int, z1: int, out: np.ndarray) -> None:
            for z in range(z0, z1):
                path = src.files[z]
                with _tifffile_errors(path):
                    tifffile.imread(path, out=out[z - z0])

        yield read_slices
        return

    path = src.files[0]
    if src.data_offset is not None:
        plane = src.shape[1] * src.shape[2] * src.dtype.itemsize
        offset = src.data_offset
        with open(path, "rb", buffering=0) as handle:

            def read_plain(z0: int, z1: int, out: np.ndarray) -> None:
                # One read straight into the slab (the GIL is released while it runs).
                view = memoryview(out.reshape(-1).view(np.uint8))
                handle.seek(offset + z0 * plane)
                done = 0
                while done < len(view):
                    got = handle.readinto(view[done:])
                    if not got:
                        raise _damaged(
                            path,
                            f"the file ends inside slice {z0 + done // plane} (was it changed "
                            "while being converted?)",
                        )
                    done += got
                if src.swap_bytes:
                    out.byteswap(inplace=True)

            yield read_plain
        return

    with _tifffile_errors(path):
        tif = tifffile.TiffFile(path)
    # Errors raised by the caller's block (zarr, label checks) pass through unchanged.
    with tif:
        tif.pages.useframes = True
        series = None if src.pages_are_series else 0

        def read_pages(z0: int, z1: int, out: np.ndarray) -> None:
            with _tifffile_errors(path):
                # A view: tifffile reshapes `out` in place, to 2D when the range is one page.
                tif.asarray(key=range(z0, z1), series=series, out=out.view())

        yield read_pages


# --- statistics --------------------------------------------------------------------------------


class Histogram:
    """Exact value counts, accumulated slab by slab, from which the statistics follow.

    The statistics (mean, std, `PERCENTILES`) leave out what would skew a CT volume's
    normalisation range: saturated voxels (the dtype's maximum, e.g. 65535 where the detector
    clipped) and empty slices (a z slice holding one value throughout: padding, a blank or
    fully saturated slice). A volume with nothing else (constant, or all saturated) gets the
    statistics of every voxel. What was left out is recorded beside them (`stats`).
    """

    def __init__(self, dtype: np.dtype, piece_elements: int) -> None:
        self.counts = np.zeros(1 << (8 * dtype.itemsize), dtype=np.int64)
        # The voxels of empty slices, by value: left out of the statistics.
        self.empty = np.zeros_like(self.counts)
        self.empty_slices = 0
        self.piece = min(max(1, piece_elements), MAX_HISTOGRAM_PIECE)
        # uint8 is counted two bytes at a time, as uint16 values: half the elements for
        # bincount's cast to intp (its main cost), then the 65536 pair counts are folded back
        # into 256. Only where a piece is large enough to pay for the 65536-entry counts.
        self.pairs = dtype.itemsize == 1 and self.piece >= MIN_PAIR_PIECE

    def add(self, slab: np.ndarray) -> np.ndarray:
        """Count a slab (z slices, or any 1D run of values); returns the slab's own counts
        (used to find bad label values)."""
        flat = slab.reshape(-1)
        if self.pairs:
            even = flat.size - flat.size % 2
            pairs = self._count(flat[:even].view(np.uint16), 1 << 16).reshape(256, 256)
            # A pair's value is first + 256 * second byte or the reverse: either way every
            # byte value is counted once per row and once per column it appears in.
            counts = pairs.sum(axis=0) + pairs.sum(axis=1)
            if even < flat.size:
                counts[flat[-1]] += 1
        else:
            counts = self._count(flat, self.counts.size)
        self.counts += counts
        if slab.ndim == 3 and slab.size:
            planes = slab.reshape(len(slab), -1)
            low, high = planes.min(axis=1), planes.max(axis=1)
            for value in low[low == high]:
                self.empty[value] += planes.shape[1]
                self.empty_slices += 1
        return counts

    def _count(self, values: np.ndarray, size: int) -> np.ndarray:
        counts = np.zeros(size, dtype=np.int64)
        # In pieces: bincount's intp copy of a whole slab would be 8x the slab.
        for start in range(0, values.size, self.piece):
            counts += np.bincount(values[start : start + self.piece], minlength=size)
        return counts

    def kept(self) -> tuple[np.ndarray, dict[str, int]]:
        """The counts the statistics are of, and what was left out of them."""
        kept = self.counts - self.empty
        saturated = int(kept[-1])
        kept[-1] = 0
        if not kept.any():
            return self.counts, {"saturated_voxels": 0, "empty_slices": 0}
        return kept, {"saturated_voxels": saturated, "empty_slices": self.empty_slices}

    def stats(self) -> dict[str, Any]:
        counts_by_value, left_out = self.kept()
        values = np.flatnonzero(counts_by_value)
        counts = counts_by_value[values]
        # Python integers: the sum of squares of a large uint16 volume overflows int64.
        n = sum(int(c) for c in counts)
        s1 = sum(int(v) * int(c) for v, c in zip(values, counts, strict=True))
        s2 = sum(int(v) * int(v) * int(c) for v, c in zip(values, counts, strict=True))
        stats: dict[str, Any] = {"mean": s1 / n, "std": math.sqrt((n * s2 - s1 * s1) / (n * n))}
        for key, q in PERCENTILES.items():
            stats[key] = _percentile(counts_by_value, q)
        stats["stats_voxels"] = n
        stats["stats_left_out"] = left_out
        return stats


def _percentile(counts: np.ndarray, q: float) -> float:
    """`np.percentile(values, q, method="linear")` of the values counted in `counts`, reproduced
    step for step."""
    cumulative = np.cumsum(counts)
    n = int(cumulative[-1])
    index = (n - 1) * (q / 100)
    below = min(math.floor(index), n - 1)
    above = min(below + 1, n - 1)
    a, b = (int(np.searchsorted(cumulative, k, side="right")) for k in (below, above))
    gamma = index - below
    # numpy's _lerp: interpolating from the nearer end keeps the result exact near b.
    if gamma >= 0.5:
        return float(b - (b - a) * (1 - gamma))
    return float(a + (b - a) * gamma)


# --- writing -----------------------------------------------------------------------------------


def _slab_depth(shape: Shape3, itemsize: int, unit_depth: int, budget_bytes: float) -> int:
    """Slices per slab: whole write units (chunk or shard rows) within the budget, at least one."""
    row_bytes = unit_depth * shape[1] * shape[2] * itemsize
    units = max(1, int(budget_bytes * SLAB_SHARE // row_bytes))
    return min(units * unit_depth, math.ceil(shape[0] / unit_depth) * unit_depth)


def _slab_plan(shape: Shape3, itemsize: int, unit_depth: int, budget: float) -> tuple[int, int]:
    """Slices per slab and the number of slab buffers, within the slab's share of the budget.

    Two buffers, so that one slab is read and counted while the previous one is written, when
    the volume takes more than one slab and two slabs of whole write units fit in the share.
    """
    depth = _slab_depth(shape, itemsize, unit_depth, budget)
    if depth >= shape[0]:
        return depth, 1
    half = _slab_depth(shape, itemsize, unit_depth, budget / 2)
    if 2 * half * shape[1] * shape[2] * itemsize <= budget * SLAB_SHARE:
        return half, 2
    return depth, 1


class _SlabWriter:
    """Writes slabs through zarr on a background thread while the caller reads and counts.

    zarr encodes the chunks of one write concurrently inside; the thread only takes the write
    off the caller's thread. `submit` returns the futures to wait for before the slab's buffer
    is used again; leaving the block waits for (or cancels) everything still pending, so that
    nothing writes into the store after an error has made `atomic_path` remove it.
    """

    def __init__(self, arr: zarr.Array) -> None:
        self.arr = arr
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ctseg-convert")

    def __enter__(self) -> _SlabWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, z0: int, slab: np.ndarray) -> list[Future]:
        return [self.pool.submit(self.arr.__setitem__, slice(z0, z0 + len(slab)), slab)]

    @staticmethod
    def wait(futures: list[Future]) -> None:
        wait(futures)
        for future in futures:
            future.result()  # the first error, if any


def _bytes_needed(dest: Path, src: _Source, chunks: Shape3, shards: Shape3 | None) -> int:
    """Disk space the store may take: every chunk stored uncompressed (what a volume that does
    not compress, such as CT noise, comes close to), each chunk or shard file in whole blocks."""
    # The grid `ctseg.store.create_volume` makes: chunks clipped to the shape, shards whole chunks.
    chunk = [min(int(c), s) for c, s in zip(chunks, src.shape, strict=True)]
    per_file = chunk
    if shards is not None:
        per_file = [
            max(c, min(s, int(n)) // c * c)
            for s, c, n in zip(src.shape, chunk, shards, strict=True)
        ]
    chunks_per_file = math.prod(-(-f // c) for f, c in zip(per_file, chunk, strict=True))
    n_files = math.prod(-(-s // f) for s, f in zip(src.shape, per_file, strict=True))
    # Per chunk: its bytes plus a codec header; per shard: its index (16 bytes a chunk).
    file_size = chunks_per_file * (math.prod(chunk) * src.dtype.itemsize + CHUNK_OVERHEAD + 16)
    return bytes_on_disk(dest.parent, file_size, n_files) + METADATA_BYTES


def _check_grid(name: str, value: Any) -> None:
    try:
        valid = len(value) == 3 and all(int(v) >= 1 for v in value)
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise CtsegError(f"{name} must be three positive integers (z, y, x), got {value!r}")


def _check_settings(chunks: Any, shards: Any, codec: Any, memory_budget_mb: float) -> None:
    _check_grid("chunks", chunks)
    if shards is not None:
        _check_grid("shards", shards)
    if not memory_budget_mb > 0:
        raise CtsegError(f"memory_budget_mb must be positive, got {memory_budget_mb!r}")
    try:
        make_compressors(codec)
    except (ValueError, TypeError) as exc:
        raise CtsegError(f"bad codec {codec!r}: {exc}") from exc


# Bad label values named in the error, and runs of slices named for each.
SHOWN_BAD_VALUES = 10
SHOWN_SLICE_RUNS = 5


class _BadLabels:
    """The z slices where each value outside the label spec's occurs, over the whole volume, so
    that the error names exactly where to look (a chunk row's range would point at 64 slices)."""

    def __init__(self, labels: LabelSpec = KAGGLE) -> None:
        self.labels = labels
        self.slices: dict[int, list[int]] = {}

    @property
    def found(self) -> bool:
        return bool(self.slices)

    def add(self, rows: np.ndarray, z0: int, counts: np.ndarray) -> None:
        """Rows z0.. of the label and their value counts (`Histogram.add`)."""
        for value in np.flatnonzero(counts):
            if value not in self.labels.valid_values:
                where = np.flatnonzero((rows == value).any(axis=(1, 2)))
                self.slices.setdefault(int(value), []).extend(int(z0 + z) for z in where)

    def error(self, path: Path) -> CtsegError:
        values = sorted(self.slices)
        shown = [f"{v} in {_slice_runs(self.slices[v])}" for v in values[:SHOWN_BAD_VALUES]]
        more = len(values) - SHOWN_BAD_VALUES
        first, rest = self.labels.describe().split(" ", 1)
        unsure = f" ({self.labels.ignore} where unsure)" if self.labels.ignore is not None else ""
        return CtsegError(
            f"{path}: label values outside {{{self.labels.values_text(', ')}}}: {'; '.join(shown)}"
            + (f"; and {more} more values" if more > 0 else "")
            + f" ({first} is {rest}): set those voxels to one of them{unsure}"
        )


def _slice_runs(slices: list[int]) -> str:
    """ "slice 4", "slices 10..11, 40", with at most `SHOWN_SLICE_RUNS` runs."""
    runs: list[list[int]] = []
    for z in sorted(set(slices)):
        if runs and z == runs[-1][1] + 1:
            runs[-1][1] = z
        else:
            runs.append([z, z])
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs[:SHOWN_SLICE_RUNS])
    if len(runs) > SHOWN_SLICE_RUNS:
        text += f" and {len(runs) - SHOWN_SLICE_RUNS} more runs"
    return ("slice " if len(slices) == 1 else "slices ") + text


def _shape_error(
    source: Path, kind: str, shape: Shape3, expected: Shape3, like: str | Path | None
) -> CtsegError:
    image = f" ({like})" if like is not None else ""
    if kind == "label":
        return CtsegError(
            f"{source}: label shape {shape} differs from its image's {expected}{image}; a label "
            "holds one value per image voxel (z, y, x): replace it with the label volume made "
            "for that image"
        )
    return CtsegError(f"{source}: shape {shape} differs from the expected {expected}{image}")


def convert_volume(
    source: Path,
    dest: Path,
    *,
    kind: Literal["image", "label"],
    chunks: Shape3 = (64, 64, 64),
    codec: Mapping[str, Any] | None = None,
    shards: Shape3 | None = None,
    memory_budget_mb: float = 256.0,
    expect_shape: Shape3 | None = None,
    like_source: str | Path | None = None,
    labels: LabelSpec = KAGGLE,
) -> dict[str, Any]:
    """Convert a TIFF volume to a Zarr v3 array at ``dest``. Returns the attributes written.
    A label volume's values must be `labels`' (Kaggle's 0/1/2 by default); they are stored as
    `labels.stored()` values (background 0, classes 1..K, ignored K+1: Kaggle's unchanged), and
    the attribute ``label_counts`` counts the voxels by stored value."""
    source, dest = Path(source), Path(dest)
    if kind not in ("image", "label"):
        raise CtsegError(f"kind must be 'image' or 'label', got {kind!r}")
    _check_settings(chunks, shards, codec, memory_budget_mb)
    # The digest is computed beside everything else: hashlib and file reads release the GIL.
    hasher = ThreadPoolExecutor(1, thread_name_prefix="ctseg-sha256")
    try:
        digest = hasher.submit(sha256_file, source) if source.is_file() else None
        src = _inspect(source)
        if expect_shape is not None:
            expected = tuple(int(n) for n in expect_shape)
            if expected != src.shape:
                raise _shape_error(source, kind, src.shape, expected, like_source)
        if digest is None:
            digest = hasher.submit(sha256_files, list(src.files))
        return _convert(src, dest, kind, chunks, codec, shards, memory_budget_mb, digest, labels)
    finally:
        hasher.shutdown(wait=False, cancel_futures=True)


def _convert(
    src: _Source,
    dest: Path,
    kind: str,
    chunks: Shape3,
    codec: Mapping[str, Any] | None,
    shards: Shape3 | None,
    memory_budget_mb: float,
    digest: Future,
    labels: LabelSpec = KAGGLE,
) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "source": str(src.path),
        "source_sha256": "",  # filled in once the hash is done; keeps the key order
        "shape": list(src.shape),
        "dtype": src.dtype.name,
        "kind": kind,
    }
    budget = memory_budget_mb * 2**20
    nz = src.shape[0]
    needed = _bytes_needed(dest, src, chunks, shards)
    with fresh_output(dest, needed, f"convert {src.path.name}") as tmp:
        arr = create_volume(tmp, src.shape, src.dtype, chunks, codec, shards, attrs)
        unit_depth = (arr.shards or arr.chunks)[0]
        depth, n_buffers = _slab_plan(src.shape, src.dtype.itemsize, unit_depth, budget)
        histogram = Histogram(src.dtype, int(budget * HISTOGRAM_SHARE) // 8)
        buffers = [
            np.empty((min(depth, nz), *src.shape[1:]), dtype=src.dtype) for _ in range(n_buffers)
        ]
        pending: list[list[Future]] = [[] for _ in buffers]
        bad_labels = _BadLabels(labels)
        # A label is stored in `labels.stored()` values; the Kaggle spec's are its own.
        remap = kind == "label" and labels.stored() != labels
        with (
            _SlabWriter(arr) as writer,
            _open_reader(src) as read,
            Progress(total=nz, unit="slice", desc=f"convert {src.path.name}") as progress,
        ):
            for i, z0 in enumerate(range(0, nz, depth)):
                z1 = min(z0 + depth, nz)
                k = i % n_buffers
                writer.wait(pending[k])  # the buffer is free again
                pending[k] = []
                slab = buffers[k][: z1 - z0]
                # Write unit by write unit (chunk or shard rows): the first ones are written
                # while the rest is read, and each is counted while it is being written.
                for r0 in range(z0, z1, unit_depth):
                    r1 = min(r0 + unit_depth, z1)
                    rows = slab[r0 - z0 : r1 - z0]
                    read(r0, r1, rows)
                    if remap:  # counted and checked in the dataset's values, then mapped
                        bad_labels.add(rows, r0, histogram.add(rows))
                        if not bad_labels.found:
                            rows[...] = labels.to_stored(rows, src.path)
                    if not bad_labels.found:  # past a bad value, only the search goes on
                        pending[k] += writer.submit(r0, rows)
                    if not remap:
                        counts = histogram.add(rows)
                        if kind == "label":
                            bad_labels.add(rows, r0, counts)
                    progress.update(r1 - r0)
            writer.wait([future for futures in pending for future in futures])
        if bad_labels.found:
            raise bad_labels.error(src.path)
        attrs["source_sha256"] = digest.result()
        attrs.update(histogram.stats())
        if kind == "label":
            values = np.array(labels.valid_values, dtype=np.uint8)
            stored = dict(zip(labels.valid_values, labels.to_stored(values).tolist(), strict=True))
            attrs["label_counts"] = {
                str(stored[v]): int(histogram.counts[v]) for v in labels.valid_values
            }
        arr.update_attributes(attrs)  # one metadata write, not one per key
    return attrs
