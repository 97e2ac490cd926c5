"""A whole-scroll prediction (mask, probabilities) as an OME-Zarr image (NGFF 0.5, zarr v3) with a
pyramid, written chunk by chunk, that a viewer (napari, neuroglancer) opens as it is.

A scroll is up to 14000 x 8000 x 8000 voxels: nothing here holds a whole level in memory.
`create_image` lays out the group (arrays ``0``, ``1``, ... of `pyramid_shapes`, the ``ome``
attributes); the caller fills level 0 with `write_level0`, whole chunks at a time, in any order
and from several processes at once; `build_pyramid` then fills the coarser levels from the
level above, block by block within a memory budget; `check_image` says whether a group is such
an image. Chunks that stay all fill value (0) are never written: most of a scroll's mask is
background, and a viewer reads an absent chunk as zeros.

The group is written where the caller says, a temporary path it renames into place
(`ctseg.io.fresh_output`): nothing here renames.

Pyramid rule (`pyramid_shapes`): each level halves (rounding up) every axis whose size at the
level above is at least ``2 * min_size``, and keeps the others: an anisotropic volume's short axes
stay whole while its long one is halved. The pyramid stops at `max_levels` levels, at a level no
axis of which can be halved, or at a level that fits in one chunk (a viewer reads it at once).
Each level's scale transform is the voxel spacing times its cumulative factor per axis, so the
factors are recorded per axis in the metadata and read back from it (`check_image`).

Downsampling (`build_pyramid`) makes each level from the level above, each output voxel from its
group of (up to) 2 x 2 x 2 voxels there; at an odd-sized axis's end the group is smaller, and only
its real voxels count:
- ``mode`` (masks, label maps; integer dtypes): the most frequent value of the group, a tie going
  to the larger value, so that a thin foreground structure (a papyrus sheet one or two voxels
  thick, half of a group) survives at coarse levels instead of fading into background;
- ``mean`` (probabilities): the group's mean; float dtypes average in float32 (float64 for
  float64) and are cast back, integer dtypes (uint8 0-255) are rounded half up.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from ctseg.io import CtsegError, remove_path
from ctseg.store import make_compressors

NGFF_VERSION = "0.5"
AXES = ("z", "y", "x")
UNIT = "micrometer"
METHODS = ("mode", "mean")
METHOD_DESCRIPTIONS = {
    "mode": "the most frequent value of each group of up to 2x2x2 voxels of the level above, "
    "a tie going to the larger value",
    "mean": "the mean of each group of up to 2x2x2 voxels of the level above (integers rounded "
    "half up)",
}
# Relative tolerance of a scale ratio against its integer factor (`_factors`).
FACTOR_TOLERANCE = 1e-6


# --------------------------------------------------------------------------- layout


def pyramid_shapes(
    shape: Sequence[int], chunks: Sequence[int], min_size: int = 64, max_levels: int = 8
) -> list[tuple[int, int, int]]:
    """The shape of each level, level 0 first (the module's pyramid rule).

    An axis is halved (rounding up) while its size is at least ``2 * min_size``, so no halved
    axis falls below `min_size`; the pyramid stops at `max_levels` levels, when no axis can be
    halved, or at a level that fits in one chunk of `chunks`: a coarser level would only save a
    viewer a read it makes at once.
    """
    level = _three_positive(shape, "shape")
    chunk = _three_positive(chunks, "chunks")
    if int(min_size) < 1 or int(max_levels) < 1:
        raise ValueError(f"min_size {min_size} and max_levels {max_levels} must be at least 1")
    shapes = [level]
    while len(shapes) < max_levels:
        if all(s <= c for s, c in zip(level, chunk, strict=True)):
            break
        halved = tuple(-(-s // 2) if s >= 2 * min_size else s for s in level)
        if halved == level:
            break
        level = halved  # type: ignore[assignment]
        shapes.append(level)
    return shapes


def _three_positive(values: Sequence[int], what: str) -> tuple[int, int, int]:
    out = tuple(int(v) for v in values)
    if len(out) != 3 or min(out) < 1:
        raise ValueError(f"{what} {tuple(values)}: expected three positive sizes (z, y, x)")
    return out  # type: ignore[return-value]


def _level_factors(shapes: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """Each level's cumulative downsampling factor per axis (level 0: 1, 1, 1)."""
    factors = [(1, 1, 1)]
    for above, below in itertools.pairwise(shapes):
        step = tuple(1 if a == b else 2 for a, b in zip(above, below, strict=True))
        factors.append(tuple(f * s for f, s in zip(factors[-1], step, strict=True)))
    return factors  # type: ignore[return-value]


def create_image(
    path: str | Path,
    shape: Sequence[int],
    dtype: Any,
    chunks: Sequence[int],
    *,
    levels: int | None = None,
    min_size: int = 64,
    spacing: Sequence[float] | None = None,
    name: str = "mask",
    attributes: Mapping[str, Any] | None = None,
    codec: Mapping[str, Any] | None = None,
) -> zarr.Group:
    """Create (replacing whatever is at `path`) an empty OME-Zarr image group: arrays ``0``,
    ``1``, ... of `pyramid_shapes` (at most `levels` of them; default its `max_levels`), each
    chunked by `chunks` clipped to its shape, fill value 0, all-zero chunks left unwritten, the
    config's codec (`ctseg.store.make_compressors`); and the NGFF 0.5 ``ome`` attributes, with
    `attributes` beside them.

    `min_size` is `pyramid_shapes`'s: no axis is halved below it (small test volumes lower it).
    `spacing` is the voxel size in micrometres (z, y, x; default 1): each level's scale is it
    times the level's factor. Every array names its dimensions z, y, x, as NGFF 0.5 requires
    of a level (``dimension_names`` matching the axes).
    """
    extra = dict(attributes or {})
    if "ome" in extra:
        raise ValueError("attributes: 'ome' is this image's NGFF metadata, written here")
    voxel = tuple(float(s) for s in (spacing if spacing is not None else (1.0, 1.0, 1.0)))
    if len(voxel) != 3 or not all(math.isfinite(s) and s > 0 for s in voxel):
        raise ValueError(f"spacing {spacing}: expected three positive sizes (z, y, x)")
    if levels is not None and int(levels) < 1:
        raise ValueError(f"levels {levels}: at least 1 (level 0 alone)")
    max_levels = 8 if levels is None else int(levels)
    shapes = pyramid_shapes(shape, chunks, min_size=min_size, max_levels=max_levels)
    chunk = _three_positive(chunks, "chunks")
    datasets = [
        {
            "path": str(index),
            "coordinateTransformations": [
                {"type": "scale", "scale": [s * f for s, f in zip(voxel, factor, strict=True)]}
            ],
        }
        for index, factor in enumerate(_level_factors(shapes))
    ]
    ome = {
        "version": NGFF_VERSION,
        "multiscales": [
            {
                "name": name,
                "axes": [{"name": axis, "type": "space", "unit": UNIT} for axis in AXES],
                "datasets": datasets,
            }
        ],
    }
    remove_path(Path(path))
    group = zarr.create_group(
        store=str(path), zarr_format=3, attributes={"ome": ome, **extra}, overwrite=True
    )
    for index, level in enumerate(shapes):
        group.create_array(
            str(index),
            shape=level,
            chunks=tuple(min(c, s) for c, s in zip(chunk, level, strict=True)),
            dtype=np.dtype(dtype),
            compressors=make_compressors(codec),
            fill_value=0,
            dimension_names=AXES,
            config={"write_empty_chunks": False},
        )
    return group


def _sparse(array: zarr.Array) -> zarr.Array:
    """`array` as it must be written here: all-zero chunks left out (or removed), whatever the
    config it was opened with."""
    return array.with_config({"write_empty_chunks": False})


def write_level0(group: zarr.Group, box: tuple[slice, slice, slice], data: np.ndarray) -> None:
    """Write `data` into level 0 at `box`, which must cover whole chunks (a box may end at the
    array's end): several processes write their boxes into one store at once, and a box sharing
    a chunk with another's would have zarr read, merge and rewrite that chunk under the other
    writer's feet. Nothing but the chunks inside `box` is touched; all-zero ones are not written.
    """
    array = group["0"]
    assert isinstance(array, zarr.Array)
    starts, stops = [], []
    for axis, (cut, size, chunk) in enumerate(zip(box, array.shape, array.chunks, strict=True)):
        start, stop, step = cut.indices(size)
        if step != 1 or start % chunk or (stop % chunk and stop != size) or stop <= start:
            raise ValueError(
                f"box {box}: axis {axis} is not whole chunks of {chunk} of the size {size}"
            )
        starts.append(start)
        stops.append(stop)
    expected = tuple(b - a for a, b in zip(starts, stops, strict=True))
    if tuple(data.shape) != expected:
        raise ValueError(f"data of shape {data.shape} for box {box} of shape {expected}")
    _sparse(array)[tuple(slice(a, b) for a, b in zip(starts, stops, strict=True))] = data


# --------------------------------------------------------------------------- the pyramid


def build_pyramid(group: zarr.Group, method: str, memory_budget_bytes: int) -> None:
    """Fill levels 1, 2, ... each from the level above (the module's downsampling), block by
    block: a block is a whole number of the level's chunks (so each output chunk is written
    once) with the voxels above it, read at once, as many chunks as fit `memory_budget_bytes`
    (never fewer than one). A block whose input is all zero writes nothing. Finally records
    the method as the multiscales' ``type`` (what NGFF 0.5 asks of a pyramid's maker).

    Run it once level 0 is complete, in one process: it rewrites the group's metadata.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {', '.join(METHODS)}")
    label = str(getattr(group.store, "root", group.store))
    arrays, steps, _ = _describe(group, label)
    dtype = arrays[0].dtype
    if method == "mode" and dtype.kind not in "biu":
        raise ValueError(f"{label}: mode of {dtype} values; mode is for masks and label maps")
    for source, target, step in zip(arrays, arrays[1:], steps[1:], strict=False):
        per_voxel = _bytes_per_output_voxel(dtype, step)
        blocks = _block_chunks(target.shape, target.chunks, per_voxel, memory_budget_bytes)
        for out_box in _boxes(target.shape, target.chunks, blocks):
            in_box = tuple(
                slice(b.start * f, min(b.stop * f, s))
                for b, f, s in zip(out_box, step, source.shape, strict=True)
            )
            block = source[in_box]
            if block.any():
                _sparse(target)[out_box] = downsample(block, step, method)
            del block  # before the next block is read: one block at a time
    if len(arrays) > 1:
        ome = dict(group.attrs["ome"])  # type: ignore[arg-type]
        multiscale = dict(ome["multiscales"][0])  # type: ignore[index]
        multiscale["type"] = method
        multiscale["metadata"] = {
            "description": METHOD_DESCRIPTIONS[method],
            "method": f"{__name__}.build_pyramid",
        }
        ome["multiscales"] = [multiscale, *ome["multiscales"][1:]]  # type: ignore[index]
        group.update_attributes({"ome": ome})


def _bytes_per_output_voxel(dtype: np.dtype, step: Sequence[int]) -> int:
    """What `build_pyramid` holds per voxel of an output block: the input block and its padded
    copy (at an odd end), and `downsample`'s working arrays (the mode's value, count and
    comparison; the mean's accumulator, quotient and result)."""
    inputs = math.prod(step) * dtype.itemsize
    return 2 * inputs + 24 + dtype.itemsize


def _block_chunks(
    shape: Sequence[int], chunks: Sequence[int], per_voxel: int, budget: int
) -> tuple[int, ...]:
    """Chunks per axis of a block: grown one chunk at a time, x, y, z in turn, while the block
    stays within `budget` bytes at `per_voxel` bytes per voxel (at least one chunk)."""
    grid = [-(-s // c) for s, c in zip(shape, chunks, strict=True)]
    count = [1, 1, 1]

    def cost(counts: Sequence[int]) -> int:
        sizes = (min(n * c, s) for n, c, s in zip(counts, chunks, shape, strict=True))
        return math.prod(sizes) * per_voxel

    grown = True
    while grown:
        grown = False
        for axis in (2, 1, 0):
            trial = list(count)
            trial[axis] += 1
            if count[axis] < grid[axis] and cost(trial) <= budget:
                count, grown = trial, True
    return tuple(count)


def _boxes(
    shape: Sequence[int], chunks: Sequence[int], blocks: Sequence[int]
) -> Iterator[tuple[slice, ...]]:
    """The blocks of `blocks` chunks each tiling an array of `shape`, in C order."""
    sizes = [n * c for n, c in zip(blocks, chunks, strict=True)]
    starts = [range(0, s, b) for s, b in zip(shape, sizes, strict=True)]
    for corner in itertools.product(*starts):
        yield tuple(slice(a, min(a + b, s)) for a, b, s in zip(corner, sizes, shape, strict=True))


def downsample(block: np.ndarray, step: Sequence[int], method: str) -> np.ndarray:
    """`block` reduced by the integer factors `step` per axis with `method` ("mode" or "mean",
    see the module); an axis whose length is not a multiple of its factor ends in a smaller
    group, of its real voxels only."""
    step = tuple(int(f) for f in step)
    out_shape = tuple(-(-s // f) for s, f in zip(block.shape, step, strict=True))
    pad = [(0, o * f - s) for o, f, s in zip(out_shape, step, block.shape, strict=True)]
    padded = np.pad(block, pad) if any(p for _, p in pad) else block
    offsets = list(itertools.product(*(range(f) for f in step)))
    views = [
        padded[tuple(slice(o, None, f) for o, f in zip(off, step, strict=True))] for off in offsets
    ]
    # Per axis, how many real voxels each output voxel's group has, and per offset whether it
    # falls on a real voxel (None: everywhere).
    counts, valid = _group_sizes(block.shape, out_shape, step, offsets)
    if method == "mean":
        return _mean(views, counts, block.dtype)
    if method == "mode":
        return _mode(views, valid, block.dtype)
    raise ValueError(f"method {method!r}: expected one of {', '.join(METHODS)}")


def _group_sizes(
    in_shape: Sequence[int],
    out_shape: Sequence[int],
    step: Sequence[int],
    offsets: Sequence[tuple[int, ...]],
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """The number of real voxels in each output voxel's group (broadcastable to the output),
    and for each offset of `offsets` a mask of the output voxels whose voxel at that offset is
    real (broadcastable; None where all are)."""
    count: np.ndarray = np.ones((1, 1, 1), np.int64)
    for axis, (s, o, f) in enumerate(zip(in_shape, out_shape, step, strict=True)):
        sizes = np.full(o, f, np.int64)
        sizes[-1] = s - (o - 1) * f
        count = count * sizes.reshape([-1 if a == axis else 1 for a in range(3)])
    valid: list[np.ndarray | None] = []
    for off in offsets:
        mask: np.ndarray | None = None
        for axis, (s, o, f, d) in enumerate(zip(in_shape, out_shape, step, off, strict=True)):
            if (o - 1) * f + d < s:
                continue
            real = np.ones(o, bool)
            real[-1] = False
            real = real.reshape([-1 if a == axis else 1 for a in range(3)])
            mask = real if mask is None else mask & real
        valid.append(mask)
    return count, valid


def _mean(views: Sequence[np.ndarray], counts: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Mean of each group; the padding is zero, so the sum over all views is the real sum."""
    if dtype.kind == "f":
        total = np.zeros(views[0].shape, np.float64 if dtype.itemsize > 4 else np.float32)
        for view in views:
            np.add(total, view, out=total, casting="unsafe")
        total /= counts.astype(total.dtype)
        return total.astype(dtype)
    total = np.zeros(views[0].shape, np.int64)
    for view in views:
        np.add(total, view, out=total, casting="unsafe")
    # Rounded half up, exactly: floor((sum + n / 2) / n).
    total *= 2
    total += counts
    total //= 2 * counts
    return total.astype(dtype)


def _mode(
    views: Sequence[np.ndarray], valid: Sequence[np.ndarray | None], dtype: np.dtype
) -> np.ndarray:
    """Most frequent value of each group, ties to the larger value: each real voxel's value is a
    candidate, its count the real voxels equal to it; the first offset is always real."""
    best = views[0].copy()
    best_count = np.zeros(best.shape, np.uint8)
    for candidate, candidate_valid in zip(views, valid, strict=True):
        count = np.zeros(best.shape, np.uint8)
        for other, other_valid in zip(views, valid, strict=True):
            same = other == candidate
            if other_valid is not None:
                same &= other_valid
            count += same
        if candidate_valid is not None:
            count *= candidate_valid
        better = (count > best_count) | ((count == best_count) & (candidate > best))
        np.copyto(best, candidate, where=better)
        np.copyto(best_count, count, where=better)
    return best.astype(dtype, copy=False)


# --------------------------------------------------------------------------- checking


def check_image(path: str | Path) -> dict[str, Any]:
    """Open the image at `path` read-only and check it is one a viewer can open as this module
    writes it: the NGFF 0.5 ``ome`` attributes (version, multiscales, three space axes z, y, x,
    datasets each with one positive scale of three), an array of three dimensions named z, y, x
    for each dataset, all of one dtype, each level's shape the one above divided (rounding up)
    by the ratio of their scales. Returns {"levels": shapes, "scales": scales, "dtype": name};
    anything wrong is one line naming `path` and the problem."""
    try:
        group = zarr.open_group(store=str(path), mode="r")
    except (FileNotFoundError, ValueError) as exc:  # zarr's errors are ValueErrors
        raise _refusal(path, f"no zarr group there ({type(exc).__name__})") from exc
    if group.metadata.zarr_format != 3:
        raise _refusal(path, f"a zarr v{group.metadata.zarr_format} group; NGFF 0.5 is zarr v3")
    arrays, _, scales = _describe(group, str(path))
    return {
        "levels": [tuple(int(s) for s in a.shape) for a in arrays],
        "scales": scales,
        "dtype": str(arrays[0].dtype),
    }


def _refusal(path: str | Path, problem: str) -> CtsegError:
    return CtsegError(
        f"{path}: not an OME-Zarr {NGFF_VERSION} image as ctseg writes it: {problem}; "
        "write it again (ctseg predict)"
    )


def _describe(
    group: zarr.Group, label: str
) -> tuple[list[zarr.Array], list[tuple[int, int, int]], list[list[float]]]:
    """The image's level arrays, each level's factor per axis against the level above (level 0:
    1, 1, 1) and each level's scale; a `CtsegError` (`_refusal`) where the metadata or the
    arrays are not an image's."""
    ome = group.attrs.get("ome")
    if not isinstance(ome, dict):
        raise _refusal(label, "no 'ome' attributes")
    if ome.get("version") != NGFF_VERSION:
        raise _refusal(label, f"ome version {ome.get('version')!r}, not {NGFF_VERSION!r}")
    multiscales = ome.get("multiscales")
    if not isinstance(multiscales, list) or not multiscales or not isinstance(multiscales[0], dict):
        raise _refusal(label, "no ome 'multiscales' list")
    multiscale = multiscales[0]
    axes = multiscale.get("axes")
    names = [a.get("name") for a in axes] if isinstance(axes, list) else []
    kinds = [a.get("type") for a in axes] if isinstance(axes, list) else []
    if (
        not all(isinstance(a, dict) for a in axes or [None])
        or names != list(AXES)
        or kinds != ["space"] * 3
    ):
        raise _refusal(label, f"multiscales axes {axes!r}, where three space axes z, y, x")
    datasets = multiscale.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise _refusal(label, "no multiscales 'datasets'")
    arrays, scales = [], []
    for index, dataset in enumerate(datasets):
        arrays.append(_level_array(group, label, index, dataset))
        scales.append(_scale(label, index, dataset))
    steps = _factors(label, arrays, scales)
    return arrays, steps, scales


def _level_array(group: zarr.Group, label: str, index: int, dataset: Any) -> zarr.Array:
    where = f"multiscales dataset {index}"
    path = dataset.get("path") if isinstance(dataset, dict) else None
    if not isinstance(path, str) or not path:
        raise _refusal(label, f"{where} has no 'path'")
    try:
        array = group[path]
    except KeyError:
        array = None
    if not isinstance(array, zarr.Array):
        raise _refusal(label, f"{where}: no array at {path!r}")
    if array.ndim != 3:
        raise _refusal(label, f"level {path!r} has {array.ndim} dimensions, where 3 (z, y, x)")
    if tuple(array.metadata.dimension_names or ()) != AXES:
        raise _refusal(
            label,
            f"level {path!r} names its dimensions {array.metadata.dimension_names}, "
            "where z, y, x (the axes)",
        )
    return array


def _scale(label: str, index: int, dataset: Mapping[str, Any]) -> list[float]:
    where = f"multiscales dataset {index}"
    transforms = dataset.get("coordinateTransformations")
    if not isinstance(transforms, list) or not all(isinstance(t, dict) for t in transforms):
        raise _refusal(label, f"{where} has no 'coordinateTransformations' list")
    kinds = [t.get("type") for t in transforms]
    if kinds not in (["scale"], ["scale", "translation"]):
        raise _refusal(label, f"{where}: transformations {kinds}, where one scale (translation)")
    scale = transforms[0].get("scale")
    if (
        not isinstance(scale, list)
        or len(scale) != 3
        or not all(isinstance(s, int | float) and not isinstance(s, bool) for s in scale)
        or not all(math.isfinite(s) and s > 0 for s in scale)
    ):
        raise _refusal(label, f"{where}: scale {scale!r}, where three positive numbers")
    translation = transforms[1].get("translation") if len(transforms) > 1 else [0, 0, 0]
    if not isinstance(translation, list) or len(translation) != 3:
        raise _refusal(label, f"{where}: translation {translation!r}, where three numbers")
    return [float(s) for s in scale]


def _factors(
    label: str, arrays: Sequence[zarr.Array], scales: Sequence[Sequence[float]]
) -> list[tuple[int, int, int]]:
    """Each level's integer factor per axis against the level above, from the ratio of their
    scales, with its shape checked against it."""
    steps = [(1, 1, 1)]
    for index in range(1, len(arrays)):
        above, below = arrays[index - 1], arrays[index]
        if below.dtype != arrays[0].dtype:
            raise _refusal(label, f"level {index} is {below.dtype}, level 0 {arrays[0].dtype}")
        ratios = [b / a for a, b in zip(scales[index - 1], scales[index], strict=True)]
        step = tuple(round(r) for r in ratios)
        if any(
            f < 1 or abs(r - f) > FACTOR_TOLERANCE * r for r, f in zip(ratios, step, strict=True)
        ):
            raise _refusal(
                label,
                f"level {index}'s scale is {ratios} times level {index - 1}'s, where whole factors",
            )
        expected = tuple(-(-s // f) for s, f in zip(above.shape, step, strict=True))
        if tuple(below.shape) != expected:
            raise _refusal(
                label,
                f"level {index} has the shape {tuple(below.shape)}, where {expected} "
                f"(level {index - 1}'s {tuple(above.shape)} by the factors {step})",
            )
        steps.append(step)  # type: ignore[arg-type]
    return steps  # type: ignore[return-value]
