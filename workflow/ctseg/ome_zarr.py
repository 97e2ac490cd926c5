"""A whole-scroll prediction (mask, label map, probabilities) as an OME-Zarr image (NGFF 0.5,
zarr v3) with a pyramid, written chunk by chunk, that a viewer (napari, neuroglancer) opens as it
is.

A scroll is up to 14000 x 8000 x 8000 voxels: nothing here holds a whole level in memory.
`create_image` lays out the group (arrays ``0``, ``1``, ... of `pyramid_shapes`, the ``ome``
attributes, the caller's own attributes beside them); the caller fills level 0 with
`write_level0`, whole chunks at a time, in any order and from several processes at once;
`build_pyramid` then fills the coarser levels from the level above, block by block within a
memory budget; `check_image` says whether a group is such an image and returns what it records.
Chunks that stay all fill value (0) are never written: most of a scroll's mask is background, and
a viewer reads an absent chunk as zeros.

The group is written where the caller says, a temporary path it renames into place
(`ctseg.io.fresh_output`): nothing here renames.

Three kinds of image, each a standalone group:
- a plain image, axes z, y, x (space, micrometres);
- a channel image (`create_image`'s `channels`, e.g. one probability per class): axes c
  (channel), z, y, x, arrays (C, Z, Y, X) chunked one channel at a time, the channel names and
  colours in the ``omero`` block under ``ome`` (NGFF 0.5's transitional rendering metadata, what
  napari and OMERO read a channel's name from);
- a label image (`create_image`'s `label_values`: a mask or a label map, integer voxels): a plain
  image plus the NGFF 0.5 ``image-label`` block under ``ome``, each label value's colour
  (``colors``) and class name (``properties``), so a viewer shows it as labels. NGFF puts label
  images in an image's ``labels/`` group; ctseg writes the label image alone (the scan it was
  predicted from is elsewhere, often remote), so there is no ``source`` (its ``image`` is a
  relative path to that scan's group). The same group validates where it stands and moved under
  an image's ``labels/`` (ome-zarr-models' ``ImageLabel`` and ``Image``, tests/test_ome_zarr.py).
`label_colors` and `default_label_values` give distinct colours to N classes, 0 transparent.

Pyramid rule (`pyramid_shapes`), toward isotropic voxels: each level halves (rounding up) every
axis whose physical voxel size (spacing times the cumulative factor) is less than twice the
smallest one among the axes still longer than one voxel, and keeps the others. An isotropic
volume halves all axes together; a 2.5 x 1 x 1 one halves y and x first (2.5 x 2 x 2), then all
three. An axis one voxel long is never halved (it would only double that voxel's extent) and
leaves the comparison, so the others go on. The pyramid stops at `max_levels` levels, or at a
level that fits in one chunk (a viewer reads it at once), which a level of all one-voxel axes
does. Each level's scale transform is the voxel spacing times its cumulative factor per axis
(1 for the channel axis), so the factors are recorded per axis in the metadata and read back
from it (`check_image`).

Downsampling (`build_pyramid`) makes each level from the level above, channel by channel, each
output voxel from its group of (up to) 2 x 2 x 2 voxels there (1 along an axis that level keeps);
at an odd-sized axis's end the group is smaller, and only its real voxels count:
- ``mode`` (masks, label maps; integer dtypes): the most frequent value of the group, a tie going
  to the larger value, so that a thin foreground structure (a papyrus sheet one or two voxels
  thick, half of a group) survives at coarse levels instead of fading into background;
- ``mean`` (probabilities): the group's mean; float dtypes average in float32 (float64 for
  float64) and are cast back, integer dtypes (uint8 0-255) are rounded half up. Refused for a
  label image: the mean of two labels is neither.
"""

from __future__ import annotations

import colorsys
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import zarr

from ctseg.io import CtsegError, remove_path
from ctseg.store import make_compressors

NGFF_VERSION = "0.5"
AXES = ("z", "y", "x")
CHANNEL_AXIS = "c"
UNIT = "micrometer"
METHODS = ("mode", "mean")
METHOD_DESCRIPTIONS = {
    "mode": "the most frequent value of each group of up to 2x2x2 voxels of the level above, "
    "a tie going to the larger value",
    "mean": "the mean of each group of up to 2x2x2 voxels of the level above (integers rounded "
    "half up)",
}
# Relative tolerance of a scale ratio against its integer factor (`_factors`), and of two
# physical voxel sizes compared by the pyramid rule (`pyramid_shapes`).
FACTOR_TOLERANCE = 1e-6
MAX_LEVELS = 8
# The hue step of `label_colors`: the golden ratio's fraction, which spreads any number of hues.
_GOLDEN = (math.sqrt(5) - 1) / 2

Shape3 = tuple[int, int, int]
RGBA = tuple[int, int, int, int]


class LabelClass(NamedTuple):
    """A label value's class name and display colour (red, green, blue, alpha; 0-255): what a
    label image records per value (NGFF ``image-label``'s ``properties`` and ``colors``). A plain
    ``(name, rgba)`` tuple is one too."""

    name: str
    rgba: RGBA


# --------------------------------------------------------------------------- layout


def pyramid_shapes(
    shape: Sequence[int],
    chunks: Sequence[int],
    spacing: Sequence[float] | None = None,
    max_levels: int = MAX_LEVELS,
) -> list[Shape3]:
    """The (z, y, x) shape of each level, level 0 first (the module's pyramid rule): at voxel
    size `spacing` (z, y, x; default isotropic), each level halves, rounding up, the axes longer
    than one voxel whose physical voxel size is less than twice the smallest of theirs; the
    pyramid stops at `max_levels` levels, or at a level that fits in one chunk of `chunks` (a
    coarser level would only save a viewer a read it makes at once)."""
    return [level for level, _ in _pyramid(shape, chunks, spacing, max_levels)]


def _pyramid(
    shape: Sequence[int],
    chunks: Sequence[int],
    spacing: Sequence[float] | None,
    max_levels: int,
) -> list[tuple[Shape3, Shape3]]:
    """Each level's shape and cumulative factor per axis (`pyramid_shapes`)."""
    level = _three_positive(shape, "shape")
    chunk = _three_positive(chunks, "chunks")
    voxel = _spacing(spacing)
    if int(max_levels) < 1:
        raise ValueError(f"max_levels {max_levels}: at least 1 (level 0 alone)")
    factor: Shape3 = (1, 1, 1)
    out = [(level, factor)]
    while len(out) < max_levels and not all(s <= c for s, c in zip(level, chunk, strict=True)):
        # Not all one voxel long: such a level fits in any chunk.
        sizes = [v * f for v, f in zip(voxel, factor, strict=True)]
        smallest = min(p for p, s in zip(sizes, level, strict=True) if s > 1)
        limit = 2 * smallest * (1 - FACTOR_TOLERANCE)
        halve = [s > 1 and p < limit for p, s in zip(sizes, level, strict=True)]
        level = tuple(-(-s // 2) if h else s for s, h in zip(level, halve, strict=True))  # type: ignore[assignment]
        factor = tuple(f * 2 if h else f for f, h in zip(factor, halve, strict=True))  # type: ignore[assignment]
        out.append((level, factor))
    return out


def _three_positive(values: Sequence[int], what: str) -> Shape3:
    out = tuple(int(v) for v in values)
    if len(out) != 3 or min(out) < 1:
        raise ValueError(f"{what} {tuple(values)}: expected three positive sizes (z, y, x)")
    return out  # type: ignore[return-value]


def _spacing(spacing: Sequence[float] | None) -> tuple[float, float, float]:
    voxel = tuple(float(s) for s in (spacing if spacing is not None else (1.0, 1.0, 1.0)))
    if len(voxel) != 3 or not all(math.isfinite(s) and s > 0 for s in voxel):
        raise ValueError(f"spacing {spacing}: expected three positive sizes (z, y, x)")
    return voxel  # type: ignore[return-value]


def label_colors(count: int) -> list[RGBA]:
    """`count` distinct display colours, one per label value 0, 1, ..., count - 1: value 0
    (background) transparent black, the others opaque, their hues a golden-ratio step apart
    (red first), in three alternating saturation and brightness pairs so that hues that come
    close are told apart by shade; a colour already given is nudged to the next free one. The
    same every time."""
    if int(count) < 0:
        raise ValueError(f"count {count}: at least 0")
    colors: list[RGBA] = [(0, 0, 0, 0)][: int(count)]
    shades = ((0.85, 1.0), (0.55, 0.85), (1.0, 0.65))
    seen = set(colors)
    for index in range(1, int(count)):
        hue = ((index - 1) * _GOLDEN) % 1.0
        saturation, value = shades[(index - 1) % len(shades)]
        red, green, blue = (round(255 * c) for c in colorsys.hsv_to_rgb(hue, saturation, value))
        while (red, green, blue, 255) in seen:  # close hues rounded alike (hundreds of classes)
            blue = (blue + 1) % 256
            green = (green + (blue == 0)) % 256
        colors.append((red, green, blue, 255))
        seen.add(colors[-1])
    return colors


def default_label_values(names: Sequence[str]) -> dict[int, LabelClass]:
    """Label value i named ``names[i]`` and coloured ``label_colors(len(names))[i]`` (value 0,
    the background, transparent): `create_image`'s `label_values` for a mask (e.g.
    ``["background", "papyrus"]``) or a label map of ``len(names)`` classes."""
    colors = label_colors(len(names))
    return {value: LabelClass(str(name), colors[value]) for value, name in enumerate(names)}


def create_image(
    path: str | Path,
    shape: Sequence[int],
    dtype: Any,
    chunks: Sequence[int],
    *,
    levels: int | None = None,
    spacing: Sequence[float] | None = None,
    name: str = "mask",
    channels: Sequence[str] | None = None,
    label_values: Mapping[int, LabelClass | tuple[str, Sequence[int]]] | None = None,
    attributes: Mapping[str, Any] | None = None,
    codec: Mapping[str, Any] | None = None,
) -> zarr.Group:
    """Create (replacing whatever is at `path`) an empty OME-Zarr image group: arrays ``0``,
    ``1``, ... of `pyramid_shapes` of the (z, y, x) `shape` at `spacing` (at most `levels` of
    them; default 8), each chunked by `chunks` clipped to its shape, fill value 0, all-zero
    chunks left unwritten, the config's codec (`ctseg.store.make_compressors`); and the NGFF 0.5
    ``ome`` attributes, with `attributes` (any JSON, e.g. ctseg's provenance) beside them.

    `spacing` is the voxel size in micrometres (z, y, x; default 1): each level's scale is it
    times the level's factor. Every array names its dimensions after the axes, as NGFF 0.5
    requires of a level (``dimension_names`` matching the axes).

    `channels` (names, unique) makes a channel image: arrays (C, *shape), chunks (1, *chunks),
    a leading channel axis ``c`` of scale 1, and an ``omero`` block naming and colouring each
    channel (`label_colors`' colour of value i, white for 0) with a display window of the dtype's
    range (0-1 for floats). `label_values` (label value -> `LabelClass` or ``(name, rgba)``) makes
    a label image (integer `dtype`, no channels): the ``image-label`` block. See the module.
    """
    extra = dict(attributes or {})
    if "ome" in extra:
        raise ValueError("attributes: 'ome' is this image's NGFF metadata, written here")
    voxel = _spacing(spacing)
    if levels is not None and int(levels) < 1:
        raise ValueError(f"levels {levels}: at least 1 (level 0 alone)")
    dtype = np.dtype(dtype)
    chunk = _three_positive(chunks, "chunks")
    pyramid = _pyramid(shape, chunk, voxel, MAX_LEVELS if levels is None else int(levels))
    names = _channel_names(channels)
    lead: tuple[int, ...] = () if names is None else (len(names),)
    axes = [{"name": axis, "type": "space", "unit": UNIT} for axis in AXES]
    if names is not None:
        axes.insert(0, {"name": CHANNEL_AXIS, "type": "channel"})
    datasets = [
        {
            "path": str(index),
            "coordinateTransformations": [
                {
                    "type": "scale",
                    "scale": [1.0] * len(lead)
                    + [v * f for v, f in zip(voxel, factor, strict=True)],
                }
            ],
        }
        for index, (_, factor) in enumerate(pyramid)
    ]
    ome: dict[str, Any] = {
        "version": NGFF_VERSION,
        "multiscales": [{"name": name, "axes": axes, "datasets": datasets}],
    }
    if names is not None:
        ome["omero"] = _omero(names, dtype)
    if label_values is not None:
        if dtype.kind not in "iu":
            raise ValueError(f"label_values of a {dtype} image: labels are integers")
        if names is not None:
            raise ValueError("label_values and channels: a label image has one value per voxel")
        ome["image-label"] = _image_label(label_values, dtype)
    remove_path(Path(path))
    group = zarr.create_group(
        store=str(path), zarr_format=3, attributes={"ome": ome, **extra}, overwrite=True
    )
    dimension_names = tuple(axis["name"] for axis in axes)
    for index, (level, _) in enumerate(pyramid):
        group.create_array(
            str(index),
            shape=(*lead, *level),
            chunks=(1,) * len(lead) + tuple(min(c, s) for c, s in zip(chunk, level, strict=True)),
            dtype=dtype,
            compressors=make_compressors(codec),
            fill_value=0,
            dimension_names=dimension_names,
            config={"write_empty_chunks": False},
        )
    return group


def _channel_names(channels: Sequence[str] | None) -> list[str] | None:
    if channels is None:
        return None
    if isinstance(channels, str):
        raise ValueError(f"channels {channels!r}: a sequence of names, not one string")
    names = list(channels)
    if (
        not names
        or not all(isinstance(n, str) and n for n in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(f"channels {channels!r}: expected one or more distinct names")
    return names


def _omero(names: Sequence[str], dtype: np.dtype) -> dict[str, Any]:
    """NGFF's ``omero`` rendering block: each channel's name (``label``), colour (hex RGB) and
    display window."""
    low, high = 0.0, 1.0  # probabilities
    if dtype.kind in "iu":
        low, high = float(np.iinfo(dtype).min), float(np.iinfo(dtype).max)
    colors = label_colors(len(names))
    return {
        "channels": [
            {
                "label": channel,
                "color": "FFFFFF"
                if index == 0
                else "{:02X}{:02X}{:02X}".format(*colors[index][:3]),
                "window": {"min": low, "max": high, "start": max(low, 0.0), "end": high},
                "active": True,
            }
            for index, channel in enumerate(names)
        ]
    }


def _image_label(label_values: Mapping[int, Any], dtype: np.dtype) -> dict[str, Any]:
    """NGFF 0.5's ``image-label`` block of `label_values` (value -> (name, rgba)), in value
    order; each value one that `dtype` holds."""
    if not label_values:
        raise ValueError("label_values: expected at least one label value")
    info = np.iinfo(dtype)
    for value in label_values:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | np.integer)
            or not info.min <= value <= info.max
        ):
            raise ValueError(f"label_values: label value {value!r} is not an integer of {dtype}")
    colors, properties = [], []
    for value in sorted(label_values):
        entry = label_values[value]
        try:
            class_name, rgba = entry
            rgba = [int(c) for c in rgba]
        except (TypeError, ValueError):
            rgba = []
            class_name = None
        if (
            not isinstance(class_name, str)
            or len(rgba) != 4
            or not all(0 <= c <= 255 for c in rgba)
        ):
            raise ValueError(
                f"label_values[{value}] = {entry!r}: expected (class name, (r, g, b, a) in 0-255)"
            )
        colors.append({"label-value": int(value), "rgba": rgba})
        properties.append({"label-value": int(value), "class": class_name})
    return {"version": NGFF_VERSION, "colors": colors, "properties": properties}


def _sparse(array: zarr.Array) -> zarr.Array:
    """`array` as it must be written here: all-zero chunks left out (or removed), whatever the
    config it was opened with."""
    return array.with_config({"write_empty_chunks": False})


def write_level0(group: zarr.Group, box: tuple[slice, slice, slice], data: np.ndarray) -> None:
    """Write `data` into level 0 at the (z, y, x) `box`, all channels of a channel image at once
    (`data` of shape (C, *box's shape)). The box must cover whole chunks (it may end at the
    array's end): several processes write their boxes into one store at once, and a box sharing
    a chunk with another's would have zarr read, merge and rewrite that chunk under the other
    writer's feet. Nothing but the chunks inside `box` is touched; all-zero ones are not written.
    """
    array = group["0"]
    assert isinstance(array, zarr.Array)
    lead = array.ndim - 3
    if len(box) != 3:
        raise ValueError(f"box {box}: expected three slices (z, y, x)")
    starts, stops = [], []
    spatial = zip(box, array.shape[lead:], array.chunks[lead:], strict=True)
    for axis, (cut, size, chunk) in enumerate(spatial):
        start, stop, step = cut.indices(size)
        if step != 1 or start % chunk or (stop % chunk and stop != size) or stop <= start:
            raise ValueError(
                f"box {box}: axis {AXES[axis]} is not whole chunks of {chunk} of the size {size}"
            )
        starts.append(start)
        stops.append(stop)
    expected = tuple(array.shape[:lead]) + tuple(b - a for a, b in zip(starts, stops, strict=True))
    if tuple(data.shape) != expected:
        raise ValueError(f"data of shape {data.shape} for box {box}: expected {expected}")
    cut = (slice(None),) * lead + tuple(slice(a, b) for a, b in zip(starts, stops, strict=True))
    _sparse(array)[cut] = data


# --------------------------------------------------------------------------- the pyramid


def build_pyramid(
    group: zarr.Group,
    method: str,
    memory_budget_bytes: int,
    *,
    z_range: tuple[int, int] | None = None,
    done: Sequence[tuple[int, int]] = (),
) -> None:
    """Fill levels 1, 2, ... each from the level above (the module's downsampling), channel by
    channel and block by block: a block is a whole number of the level's chunks (so each output
    chunk is written once) with the voxels above it, read at once, as many chunks as fit
    `memory_budget_bytes` (never fewer than one). A block whose input is all zero writes nothing.
    Finally records the method as the multiscales' ``type`` (what NGFF 0.5 asks of a pyramid's
    maker). ``mean`` is refused for a label image.

    Run it once level 0 is complete, in one process: it rewrites the group's metadata. Or in
    parts: with `z_range` (level 0's voxels [start, stop) along z, final there), only the chunks
    of each level whose voxels all come from that range, and no metadata: jobs of disjoint
    ranges write disjoint chunks, at once; then once with `done` (those ranges), every other
    chunk and the metadata.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {', '.join(METHODS)}")
    label = str(getattr(group.store, "root", group.store))
    image = _describe(group, label)
    arrays = image.arrays
    dtype = arrays[0].dtype
    if method == "mode" and dtype.kind not in "biu":
        raise ValueError(f"{label}: mode of {dtype} values; mode is for masks and label maps")
    if method != "mode" and image.label_values is not None:
        raise ValueError(f"{label}: {method} of a label image; its pyramid is the mode")
    lead = arrays[0].ndim - 3
    channels = [()] if not lead else [(c,) for c in range(arrays[0].shape[0])]
    depth, factor = arrays[0].shape[lead], 1  # level 0's z, and the level's z-factor to it
    selected = z_range is not None or bool(done)

    def chosen(rows: slice) -> bool:
        """Whether this call writes the level's chunk rows `rows` (along z)."""
        first, last = rows.start * factor, min(rows.stop * factor, depth)

        def inside(r: tuple[int, int]) -> bool:
            return r[0] <= first and last <= r[1]

        return inside(z_range) if z_range is not None else not any(map(inside, done))

    for source, target, step in zip(arrays, arrays[1:], image.steps[1:], strict=False):
        per_voxel = _bytes_per_output_voxel(dtype, step)
        shape, chunks = target.shape[lead:], target.chunks[lead:]
        factor *= step[0]
        blocks = _block_chunks(shape, chunks, per_voxel, memory_budget_bytes)
        if selected:  # one row of chunks along z a block: each row is chosen on its own
            blocks = (1, *blocks[1:])
        for channel, out_box in itertools.product(channels, _boxes(shape, chunks, blocks)):
            if selected and not chosen(out_box[0]):
                continue
            in_box = tuple(
                slice(b.start * f, min(b.stop * f, s))
                for b, f, s in zip(out_box, step, source.shape[lead:], strict=True)
            )
            block = source[(*channel, *in_box)]
            if block.any():
                _sparse(target)[(*channel, *out_box)] = downsample(block, step, method)
            del block  # before the next block is read: one block at a time
    if len(arrays) > 1 and z_range is None:
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


def multiscales_of(attributes: Mapping[str, Any]) -> Any:
    """A group's multiscales list where NGFF keeps it: under ``ome`` (0.5), or at the top level
    (0.4); None where there is none. Not checked: the callers check what they need."""
    ome = attributes.get("ome")
    return ome.get("multiscales") if isinstance(ome, dict) else attributes.get("multiscales")


def scale_of(transforms: Any) -> list[float] | None:
    """The scale of a coordinateTransformations list (its first ``scale`` transform), or None."""
    for transform in transforms if isinstance(transforms, list) else []:
        if isinstance(transform, Mapping) and transform.get("type") == "scale":
            return [float(s) for s in transform.get("scale", [])]
    return None


@dataclass(frozen=True)
class _Image:
    """What `_describe` reads of an image: its level arrays, each level's (z, y, x) factor
    against the level above (level 0: 1, 1, 1), each level's scale (one number per axis), the
    channel names (None: no channel axis) and the label values (None: not a label image)."""

    arrays: list[zarr.Array]
    steps: list[Shape3]
    scales: list[list[float]]
    channels: list[str] | None
    label_values: dict[int, LabelClass] | None


def check_image(path: str | Path) -> dict[str, Any]:
    """Open the image at `path` read-only and check it is one a viewer can open as this module
    writes it: the NGFF 0.5 ``ome`` attributes (version, multiscales with space axes z, y, x,
    optionally after a channel axis c, datasets each with one positive scale per axis, 1 for the
    channel), an array per dataset whose dimensions are named after the axes, all of one dtype,
    each level's shape the one above divided (rounding up) by the ratio of their scales; a
    channel image's ``omero`` block naming each channel; a label image's ``image-label`` block
    (integer dtype, unique label values, the same values coloured and named).

    Returns {"levels": shapes (whole arrays, the channel first), "scales": scales (one per axis),
    "dtype": name, "axes": axis names, "channels": names or None, "label_values": {value:
    `LabelClass`} or None, "attributes": the group's attributes other than ``ome`` (e.g.
    provenance)}; anything wrong is one line naming `path` and the problem."""
    try:
        group = zarr.open_group(store=str(path), mode="r")
    except (FileNotFoundError, ValueError) as exc:  # zarr's errors are ValueErrors
        raise _refusal(path, f"no zarr group there ({type(exc).__name__})") from exc
    if group.metadata.zarr_format != 3:
        raise _refusal(path, f"a zarr v{group.metadata.zarr_format} group; NGFF 0.5 is zarr v3")
    image = _describe(group, str(path))
    return {
        "levels": [tuple(int(s) for s in a.shape) for a in image.arrays],
        "scales": image.scales,
        "dtype": str(image.arrays[0].dtype),
        "axes": ([CHANNEL_AXIS] if image.channels is not None else []) + list(AXES),
        "channels": image.channels,
        "label_values": image.label_values,
        "attributes": {k: v for k, v in group.attrs.asdict().items() if k != "ome"},
    }


def _refusal(path: str | Path, problem: str) -> CtsegError:
    return CtsegError(
        f"{path}: not an OME-Zarr {NGFF_VERSION} image as ctseg writes it: {problem}; "
        "write it again (ctseg predict)"
    )


def _describe(group: zarr.Group, label: str) -> _Image:
    """The image's arrays and what its metadata says of them (`_Image`); a `CtsegError`
    (`_refusal`) where the metadata or the arrays are not an image's."""
    ome = group.attrs.get("ome")
    if not isinstance(ome, dict):
        raise _refusal(label, "no 'ome' attributes")
    if ome.get("version") != NGFF_VERSION:
        raise _refusal(label, f"ome version {ome.get('version')!r}, not {NGFF_VERSION!r}")
    multiscales = multiscales_of(group.attrs)
    if not isinstance(multiscales, list) or not multiscales or not isinstance(multiscales[0], dict):
        raise _refusal(label, "no ome 'multiscales' list")
    multiscale = multiscales[0]
    axes = multiscale.get("axes")
    if not isinstance(axes, list) or not all(isinstance(a, dict) for a in axes):
        axes_ok = False
    else:
        found = [(a.get("name"), a.get("type")) for a in axes]
        space = [(axis, "space") for axis in AXES]
        axes_ok = found in (space, [(CHANNEL_AXIS, "channel"), *space])
    if not axes_ok:
        raise _refusal(
            label,
            f"multiscales axes {axes!r}, where space axes z, y, x (after a channel axis c "
            "in a channel image)",
        )
    names = tuple(a["name"] for a in axes)  # type: ignore[union-attr]
    datasets = multiscale.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise _refusal(label, "no multiscales 'datasets'")
    arrays, scales = [], []
    for index, dataset in enumerate(datasets):
        arrays.append(_level_array(group, label, index, dataset, names))
        scales.append(_scale(label, index, dataset, names))
    steps = _factors(label, arrays, scales)
    channels = _omero_names(label, ome, arrays[0]) if len(names) == 4 else None
    label_values = None
    if "image-label" in ome:
        label_values = _label_values(label, ome["image-label"], arrays[0].dtype)
    return _Image(arrays, steps, scales, channels, label_values)


def _level_array(
    group: zarr.Group, label: str, index: int, dataset: Any, names: tuple[str, ...]
) -> zarr.Array:
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
    if array.ndim != len(names):
        raise _refusal(
            label,
            f"level {path!r} has {array.ndim} dimensions, where {len(names)} ({', '.join(names)})",
        )
    if tuple(array.metadata.dimension_names or ()) != names:
        raise _refusal(
            label,
            f"level {path!r} names its dimensions {array.metadata.dimension_names}, "
            f"where {', '.join(names)} (the axes)",
        )
    return array


def _scale(
    label: str, index: int, dataset: Mapping[str, Any], names: tuple[str, ...]
) -> list[float]:
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
        or len(scale) != len(names)
        or not all(isinstance(s, int | float) and not isinstance(s, bool) for s in scale)
        or not all(math.isfinite(s) and s > 0 for s in scale)
    ):
        raise _refusal(
            label, f"{where}: scale {scale!r}, where {len(names)} positive numbers, one per axis"
        )
    if len(names) == 4 and scale[0] != 1:
        raise _refusal(label, f"{where}: scale {scale!r}, where 1 for the channel axis")
    translation = transforms[1].get("translation") if len(transforms) > 1 else [0] * len(names)
    if not isinstance(translation, list) or len(translation) != len(names):
        raise _refusal(label, f"{where}: translation {translation!r}, where {len(names)} numbers")
    return [float(s) for s in scale]


def _factors(
    label: str, arrays: Sequence[zarr.Array], scales: Sequence[Sequence[float]]
) -> list[Shape3]:
    """Each level's integer (z, y, x) factor against the level above, from the ratio of their
    scales, with its shape checked against it (the channel axis: factor 1)."""
    steps: list[Shape3] = [(1, 1, 1)]
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
        steps.append(step[-3:])  # type: ignore[arg-type]
    return steps


def _omero_names(label: str, ome: Mapping[str, Any], array: zarr.Array) -> list[str]:
    """A channel image's channel names, from its ``omero`` block: one named channel per index
    of the channel axis."""
    omero = ome.get("omero")
    channels = omero.get("channels") if isinstance(omero, dict) else None
    count = int(array.shape[0])
    if (
        not isinstance(channels, list)
        or len(channels) != count
        or not all(isinstance(c, dict) and isinstance(c.get("label"), str) for c in channels)
    ):
        raise _refusal(
            label, f"ome 'omero' channels {channels!r}, where {count} with a 'label' each"
        )
    return [c["label"] for c in channels]


def _label_values(label: str, block: Any, dtype: np.dtype) -> dict[int, LabelClass]:
    """A label image's values, from its ``image-label`` block: integer voxels, each label
    value coloured once and named once, the same values in both lists."""
    if dtype.kind not in "iu":
        raise _refusal(label, f"an image-label of {dtype} voxels, where integers")
    colors = block.get("colors") if isinstance(block, dict) else None
    properties = block.get("properties") if isinstance(block, dict) else None
    if not isinstance(colors, list) or not isinstance(properties, list):
        raise _refusal(label, "ome 'image-label' without 'colors' and 'properties' lists")
    rgba: dict[int, RGBA] = {}
    for color in colors:
        value = color.get("label-value") if isinstance(color, dict) else None
        channels = color.get("rgba") if isinstance(color, dict) else None
        if (
            not _is_int(value)
            or value in rgba
            or not isinstance(channels, list)
            or len(channels) != 4
            or not all(_is_int(c) and 0 <= c <= 255 for c in channels)
        ):
            raise _refusal(
                label, f"image-label colour {color!r}, where a new label-value and rgba 0-255"
            )
        rgba[value] = tuple(channels)  # type: ignore[assignment]
    classes: dict[int, str] = {}
    for entry in properties:
        value = entry.get("label-value") if isinstance(entry, dict) else None
        if not _is_int(value) or value in classes:
            raise _refusal(label, f"image-label property {entry!r}, where a new label-value")
        classes[value] = str(entry.get("class", ""))  # type: ignore[union-attr]
    if set(classes) != set(rgba):
        raise _refusal(
            label,
            f"image-label colours the values {sorted(rgba)} and names {sorted(classes)}, "
            "where the same",
        )
    return {value: LabelClass(classes[value], rgba[value]) for value in sorted(rgba)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
