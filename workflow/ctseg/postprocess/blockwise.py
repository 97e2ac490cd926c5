"""`binary_mask` block by block: the same mask, bit for bit, of a volume too large for memory.

`blockwise_mask(probs, out, settings, block, scratch_dir)` reads the probabilities from an
array-like (a numpy array, a memmap, a zarr array: anything with ``shape`` that a tuple of slices
indexes) one block at a time and writes the uint8 0/1 mask into `out` (anything a tuple of slices
assigns to) one block at a time. Every step gives exactly `masks.binary_mask`'s result, on any
volume and any block shape (blocks that do not divide the shape, blocks one voxel thin):

* ``threshold``: per block.
* ``hysteresis_high`` (``3d``: 26-connected; ``z``: 8-connected within each z-slice),
  ``min_component_voxels`` (26-connected) and ``fill_holes`` (the background's 6-connected
  components that do not reach the volume's border): components are labelled per block, merged
  across block faces, edges and corners from the pairs of touching voxels on them (a union-find:
  `scipy.sparse.csgraph.connected_components` over the components' node ids), with each
  component's voxel count and flag (holds a seed voxel; touches the volume's border) summed over
  its blocks; a later pass labels each block again (the same labels: the labelling is
  deterministic) and keeps, drops or fills whole components by the merged tables. Hysteresis
  3D and the component filter share one pass (a kept hysteresis component is a whole component
  of prob > threshold); hysteresis along z, then the component filter, then the cavity fill
  each need their own.
* The passes run as jobs over z-ranges of the blocks (`BlockwiseJobs`): each component pass
  merges within its range, writes the node ids on the range's first and last z-planes, and a
  small merge joins the ranges from those planes alone; so the passes can run in parallel
  processes (``ctseg predict --post``), and `blockwise_mask` runs them one after another.
* ``plug_holes_max_area``, ``patch_holes_max_area`` and ``closing_radius``: each reads the whole
  mask of the step before, so that mask is written to a uint8 zarr array in `scratch_dir` (on
  disk, compressed; a temporary directory by default; removed once the step has read it), and
  each block of the step's result is computed from the block grown by a halo read back from
  it. A halo past the volume's faces is cut off there, so the grown block's sides on the
  volume's faces are the faces the whole-volume step sees; its other sides are cut by the halo.
* Plugging, holes of at most A pixels: per slice along each axis (as `masks.plug_holes`), each
  block's slices grown by ``plug_halo(A)`` = A pixels in their two in-plane axes. A hole (a
  4-connected background component of the slice not touching its border) of at most A pixels
  that has a pixel in the block lies within A - 1 of that pixel: whole in the grown slice, off
  its cut sides, so a hole of the grown slice too. Conversely a background component of the
  grown slice touching none of its sides has all its neighbours in the grown slice: it is a
  whole component of the full slice, off its border, a hole there too.
* Patching, holes of at most P pixels with a ring of width R (`masks.PATCH_RING`): grown by
  ``patch_halo(P)`` = 2P + 2R - 1. A hole meeting the block lies within P - 1 of it and its ring
  within P - 1 + R; each ring pixel counts for the hole with the largest label within R of it,
  and such a hole lies whole within 2P - 2 + 2R of the block: inside the grown slice and off its
  cut sides, so found as above. cc3d numbers a slice's components in the order of their first
  pixel in a raster scan, which a crop does not change for two components lying whole in it:
  the larger label wins the same ring pixels.
* Closing, radius r: grown by 2r in all three axes (the dilation's r then the erosion's r), the
  part of that halo outside the volume filled as `masks.close` fills it (the face voxels
  repeated).

The plugging and the patching grow one axis's slices at a time (a slab one block thick across
that axis, grown in the other two), not the block in all three axes: a halo of P is far larger
than a block, and the slab holds (b + 2h)^2 b voxels where the grown block would hold
(b + 2h)^3.

Memory: one block of probabilities and the block's masks and labels; for the plugging and the
patching one grown slab and one grown slice's labels; for the closing the grown block; the
component tables of one z-range (a node id, a merged id, a count and a flag per component per
block), the touching pairs found on the block faces, and the node ids on the faces of two
layers of blocks along z (what the next blocks merge with). `post_block` picks a block of
whole chunks whose working set, halos included, fits the post-processing's part of the memory
budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import cc3d
import numpy as np
import zarr
from scipy import ndimage
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from ctseg.io import CtsegError, made_once, remove_path
from ctseg.postprocess.masks import (
    PATCH_RING,
    PostprocessSettings,
    patched_pixels,
    slice_holes,
)
from ctseg.store import create_volume

Block = tuple[slice, slice, slice]
Index = tuple[int, int, int]
Stage = Callable[[Index, Block, np.ndarray], np.ndarray]

# The connectivities, as the neighbour offsets of a voxel: 26 (3D components), 8 within a
# z-slice (hysteresis along z), 6 (the background of `ndimage.binary_fill_holes`).
_OFFSETS = {
    26: [o for o in itertools.product((-1, 0, 1), repeat=3) if o != (0, 0, 0)],
    8: [(0, dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)],
    6: [o for o in itertools.product((-1, 0, 1), repeat=3) if sum(map(abs, o)) == 1],
}
# The neighbouring blocks earlier in z, y, x order: every touching pair of blocks once.
_EARLIER = [d for d in itertools.product((-1, 0, 1), repeat=3) if d < (0, 0, 0)]
_Z_SLICE_8 = np.zeros((3, 3, 3), bool)
_Z_SLICE_8[1] = True


# The post-processing's part of --memory-budget-mb (the rest goes to the chunk cache, the tile
# and the pyramid: `ctseg.inference.scroll`).
POST_SHARE = 0.25
# The scratch arrays' chunks: a block, at least this many voxels along each axis (fewer, larger
# files where blocks are small; a block is written into part of a chunk then).
SCRATCH_MIN_CHUNK = 32
# Bytes a voxel of a block holds in the component passes: its probabilities, its mask after each
# step, its labels and their global ids (int64).
COMPONENT_BYTES_PER_VOXEL = 40
# Bytes a pixel of one grown slice holds while it is plugged or patched: its copy, its hole
# labels (uint32) and their dilation, the masks between them, the pixels added. tracemalloc
# measured 12-13 for the labels, the dilation and the masks on 500^2 and 1500^2 slices.
SLICE_BYTES_PER_PIXEL = 16
# Bytes a voxel of the grown block holds in the closing: the block read, padded, dilated, eroded
# (tracemalloc: 2.8).
CLOSING_BYTES_PER_VOXEL = 4


def plug_halo(max_area: int) -> int:
    """The in-plane halo that makes plugging holes of at most `max_area` pixels exact: such a
    hole lies within `max_area` - 1 pixels of any of its pixels (module docstring)."""
    return max(0, max_area)


def patch_halo(max_area: int, ring: int = PATCH_RING) -> int:
    """The in-plane halo that makes patching holes of at most `max_area` pixels exact: the hole
    (within `max_area` - 1), its ring (`ring` more), each hole whose dilation by `ring` reaches
    that ring (`ring` and `max_area` - 1 more), one pixel past them (module docstring)."""
    return 2 * max_area + 2 * ring - 1 if max_area > 0 else 0


def _widest_halo(settings: PostprocessSettings) -> tuple[int, str]:
    """The largest halo the settings' steps read, and the step's setting, e.g. `plug 64`."""
    halos = [
        (plug_halo(settings.plug_holes_max_area), f"plug {settings.plug_holes_max_area}"),
        (patch_halo(settings.patch_holes_max_area), f"patch {settings.patch_holes_max_area}"),
        (2 * settings.closing_radius, f"close {settings.closing_radius}"),
    ]
    return max(halos)


def _working_set(block: Sequence[int], shape: Sequence[int], settings: PostprocessSettings) -> int:
    """Bytes `blockwise_mask` holds at once for one block of this shape (estimated): the most of
    the component passes, the plugging's and the patching's grown slabs and slices, and the
    closing's grown block. Beside each grown read: the block's result and the scratch array's
    chunks zarr decodes at once (up to its ``async.concurrency``)."""
    sizes = [min(b, n) for b, n in zip(block, shape, strict=True)]
    voxels = math.prod(sizes)
    chunk = scratch_chunks(sizes, shape)

    def beside(read: Sequence[int]) -> int:
        """The block's result, and the chunks zarr decodes at once for a read of this shape."""
        touched = math.prod(-(-r // c) + 1 for r, c in zip(read, chunk, strict=True))
        decoded = min(int(zarr.config.get("async.concurrency")), touched)
        return voxels + decoded * math.prod(chunk)

    need = COMPONENT_BYTES_PER_VOXEL * voxels
    for halo in (
        plug_halo(settings.plug_holes_max_area),
        patch_halo(settings.patch_holes_max_area),
    ):
        if halo == 0:
            continue
        for axis in range(3):
            slab = [
                b if a == axis else min(n, b + 2 * halo)
                for a, (b, n) in enumerate(zip(sizes, shape, strict=True))
            ]
            read = math.prod(slab)
            need = max(need, read + beside(slab) + SLICE_BYTES_PER_PIXEL * (read // slab[axis]))
    if settings.closing_radius:
        halo = 2 * settings.closing_radius
        grown = [min(n, b + 2 * halo) for b, n in zip(sizes, shape, strict=True)]
        need = max(need, CLOSING_BYTES_PER_VOXEL * math.prod(grown) + beside(grown))
    return need


def post_block(
    chunks: Sequence[int],
    shape: Sequence[int],
    settings: PostprocessSettings,
    memory_budget_bytes: int,
) -> tuple[int, int, int]:
    """A block of whole `chunks` for `blockwise_mask` of a volume of `shape` whose working set,
    halos included, fits `POST_SHARE` of `memory_budget_bytes` (the whole --memory-budget-mb):
    from one chunk, the shortest axis that can still grow doubled while it fits (larger blocks
    read their halos fewer times). One chunk that does not fit is an error naming the budget it
    needs."""
    chunks = tuple(int(c) for c in chunks)
    shape = tuple(int(n) for n in shape)
    _check_block(shape, chunks)
    budget = memory_budget_bytes * POST_SHARE
    need = _working_set(chunks, shape, settings)
    if need > budget:
        halo, step = _widest_halo(settings)
        read = f" read with a halo of {halo} voxels ({step})" if halo else ""
        raise CtsegError(
            f"post-processing {settings.label()} needs {need / 2**20:.3g} MB for one chunk "
            f"{chunks}{read}, more than {POST_SHARE:.0%} of --memory-budget-mb "
            f"{memory_budget_bytes / 2**20:.3g}: raise --memory-budget-mb to at least "
            f"{math.ceil(need / POST_SHARE / 2**20 * 10) / 10:g}"
        )
    block = list(chunks)
    while True:
        growable = [a for a in range(3) if block[a] < shape[a]]
        if not growable:
            return tuple(block)  # type: ignore[return-value]
        axis = min(growable, key=lambda a: block[a])
        grown = list(block)
        grown[axis] = min(block[axis] * 2, max(shape[axis], chunks[axis]))
        if _working_set(grown, shape, settings) > budget:
            return tuple(block)  # type: ignore[return-value]
        block = grown


def _check_block(shape: tuple[int, ...], block: tuple[int, ...]) -> None:
    if len(shape) != 3 or len(block) != 3:
        raise CtsegError(f"blockwise mask: expected a 3D volume and block, got {shape}, {block}")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block):
        raise CtsegError(f"blockwise mask: block={block!r}: expected three integers >= 1")


def _grid(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, int, int]:
    return tuple(-(-n // b) for n, b in zip(shape, block, strict=True))  # type: ignore[return-value]


def _blocks(shape: tuple[int, ...], block: tuple[int, ...]) -> Iterator[tuple[Index, Block]]:
    """Every block, in z, y, x order: its index in the grid and its slices."""
    for index in itertools.product(*(range(g) for g in _grid(shape, block))):
        yield (
            index,  # type: ignore[misc]
            tuple(  # type: ignore[misc]
                slice(i * b, min((i + 1) * b, n))
                for i, b, n in zip(index, block, shape, strict=True)
            ),
        )


def _border(block: Block, shape: tuple[int, ...]) -> np.ndarray:
    """bool: the block's voxels on a face of the volume."""
    sizes = tuple(s.stop - s.start for s in block)
    out = np.zeros(sizes, bool)
    for axis, (s, n) in enumerate(zip(block, shape, strict=True)):
        if s.start == 0:
            out[(slice(None),) * axis + (0,)] = True
        if s.stop == n:
            out[(slice(None),) * axis + (-1,)] = True
    return out


def _close_block(scratch: Any, block: Block, shape: tuple[int, ...], radius: int) -> np.ndarray:
    """`masks.close` of the whole mask in `scratch`, on `block` only: read with a halo of
    2 * radius, the halo past the volume's faces their voxels repeated (as `close` pads)."""
    halo = 2 * radius
    read = tuple(
        slice(max(0, s.start - halo), min(n, s.stop + halo))
        for s, n in zip(block, shape, strict=True)
    )
    pad = [
        (halo - (s.start - r.start), halo - (r.stop - s.stop))
        for s, r in zip(block, read, strict=True)
    ]
    grown = np.pad(np.asarray(scratch[read], dtype=np.uint8), pad, mode="edge")
    size = 2 * radius + 1
    grown = ndimage.maximum_filter(grown, size=size, mode="nearest")
    closed = ndimage.minimum_filter(grown, size=size, mode="nearest")
    inner = tuple(slice(halo, halo + s.stop - s.start) for s in block)
    return np.ascontiguousarray(closed[inner])


def _per_slice_block(
    source: Any,
    block: Block,
    shape: tuple[int, ...],
    halo: int,
    added: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """bool: the block of the mask in `source` with the pixels `added` gives for each 2D slice
    (C-contiguous, oriented as `masks` orients it) set, in every slice across z, y and x; the
    three axes read the same `source`, as `masks.plug_holes` and `masks.patch_holes` do. Each
    axis reads a slab one block thick across it and grown by `halo` in its two in-plane axes."""
    result = None
    for axis in range(3):
        read = tuple(
            s if a == axis else slice(max(0, s.start - halo), min(n, s.stop + halo))
            for a, (s, n) in enumerate(zip(block, shape, strict=True))
        )
        slab = np.asarray(source[read], dtype=np.uint8)
        inner = tuple(
            slice(s.start - r.start, s.stop - r.start) for s, r in zip(block, read, strict=True)
        )
        if result is None:
            result = slab[inner].astype(bool)
        in_plane = inner[:axis] + inner[axis + 1 :]
        planes, target = np.moveaxis(slab, axis, 0), np.moveaxis(result, axis, 0)
        for k in range(planes.shape[0]):
            target[k] |= added(np.ascontiguousarray(planes[k]))[in_plane]
        del slab, planes  # before the next axis's slab is read
    assert result is not None
    return result


def _plugged(plane: np.ndarray, max_area: int) -> np.ndarray:
    """bool: the pixels `masks.plug_holes` adds to one 2D slice."""
    return slice_holes(plane, max_area) > 0


# A step that reads the whole mask of the step before with a halo: (scratch array, the block's
# slices) to the block's mask after the step.
HaloStep = Callable[[Any, Block], np.ndarray]


def _later_steps(
    settings: PostprocessSettings, shape: tuple[int, ...]
) -> list[tuple[str, HaloStep]]:
    """The steps after the cavity fill that are on, in `binary_mask`'s order, each with the name
    of the mask it makes."""
    steps: list[tuple[str, HaloStep]] = []
    plug, patch = settings.plug_holes_max_area, settings.patch_holes_max_area

    def per_slice(halo: int, added: Callable[[np.ndarray], np.ndarray]) -> HaloStep:
        return functools.partial(_per_slice_block, shape=shape, halo=halo, added=added)

    if plug > 0:
        plugged = functools.partial(_plugged, max_area=plug)
        steps.append(("plugged", per_slice(plug_halo(plug), plugged)))
    if patch > 0:
        patched = functools.partial(patched_pixels, max_area=patch)
        steps.append(("patched", per_slice(patch_halo(patch), patched)))
    if settings.closing_radius > 0:
        radius = settings.closing_radius
        steps.append(("closed", functools.partial(_close_block, shape=shape, radius=radius)))
    return steps


@contextlib.contextmanager
def _scratch_folder(scratch_dir: Path | None) -> Iterator[Path]:
    """The caller's folder, made if missing, or a temporary one removed afterwards."""
    if scratch_dir is None:
        with tempfile.TemporaryDirectory(prefix="ctseg-blockwise-") as tmp:
            yield Path(tmp)
    else:
        Path(scratch_dir).mkdir(parents=True, exist_ok=True)
        yield Path(scratch_dir)


def scratch_chunks(block: Sequence[int], shape: Sequence[int]) -> tuple[int, int, int]:
    """The chunks of the masks the halo steps read: one block along z, so that jobs over
    z-ranges of blocks never write into one chunk together; at least `SCRATCH_MIN_CHUNK` along
    y and x (fewer, larger files where blocks are small); never past the volume."""
    sizes = [block[0], *(max(b, SCRATCH_MIN_CHUNK) for b in block[1:])]
    return tuple(min(c, n) for c, n in zip(sizes, shape, strict=True))  # type: ignore[return-value]


def _label(binary: np.ndarray, connectivity: int) -> np.ndarray:
    """Component ids (0 outside `binary`) of one block; the same ids for the same block."""
    if connectivity == 8:
        ids, _ = ndimage.label(binary, structure=_Z_SLICE_8)
        return ids
    return cc3d.connected_components(binary, connectivity=connectivity)


def _shifted(length: int, shift: int) -> tuple[slice, slice]:
    """The slices of two aligned lines whose positions p and p + shift both lie in [0, length)."""
    return slice(max(0, -shift), length - max(0, shift)), slice(
        max(0, shift), length - max(0, -shift)
    )


def _faces(nodes: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """The layers on a block's faces (copies, so the block's arrays go), keyed by (axis, -1 for
    the last layer, +1 for the first): what later blocks find their touching voxels in."""
    return {
        (axis, side): nodes[
            (slice(None),) * axis + (slice(-1, None) if side < 0 else slice(0, 1),)
        ].copy()  # a copy, not a view: a view of a z-face would keep the whole block
        for axis in range(3)
        for side in (-1, 1)
    }


def _touching(
    nodes: np.ndarray,
    other: dict[tuple[int, int], np.ndarray],
    d: Sequence[int],
    offsets: Sequence[tuple[int, int, int]],
) -> np.ndarray:
    """The pairs (node here, node there) of touching voxels of a block's `nodes` and the
    `_faces` of the block at offset `d` (earlier): on an axis where d is -1, this block's first
    layer touches the other's last; where +1, its last the other's first; where 0, they run side
    by side. `nodes` may be the block's first layer alone where d's first axis is z."""
    mine = tuple(slice(0, 1) if s < 0 else slice(-1, None) if s > 0 else slice(None) for s in d)
    theirs = tuple(slice(-1, None) if s < 0 else slice(0, 1) if s > 0 else slice(None) for s in d)
    axis = next(a for a, s in enumerate(d) if s != 0)
    theirs = theirs[:axis] + (slice(None),) + theirs[axis + 1 :]  # the face is that layer
    a, b = nodes[mine], other[(axis, d[axis])][theirs]
    found: list[np.ndarray] = []
    if not a.any() or not b.any():
        return np.zeros((0, 2), np.int64)
    for offset in offsets:
        if any(s != 0 and o != s for o, s in zip(offset, d, strict=True)):
            continue
        cut_a, cut_b = [], []
        for o, s, n in zip(offset, d, a.shape, strict=True):
            sa, sb = (slice(None), slice(None)) if s != 0 else _shifted(n, o)
            cut_a.append(sa)
            cut_b.append(sb)
        pa, pb = a[tuple(cut_a)], b[tuple(cut_b)]
        both = (pa > 0) & (pb > 0)
        if both.any():
            found.append(np.unique(np.stack([pa[both], pb[both]], axis=1), axis=0))
    return np.concatenate(found) if found else np.zeros((0, 2), np.int64)


def _merged(nodes: np.ndarray, pairs: Sequence[np.ndarray]) -> np.ndarray:
    """The merged component of each of the sorted `nodes` (0, 1, ...), from the `pairs` of
    nodes that touch (a union-find: connected components of the graph of pairs)."""
    if not len(nodes):
        return np.zeros(0, np.int64)
    both = np.concatenate(pairs) if pairs else np.zeros((0, 2), np.int64)
    a, b = np.searchsorted(nodes, both[:, 0]), np.searchsorted(nodes, both[:, 1])
    graph = coo_matrix((np.ones(len(a), np.int8), (a, b)), shape=(len(nodes), len(nodes)))
    return connected_components(graph, directed=False)[1].astype(np.int64)


def _save(path: Path, write: Callable[[Path], None]) -> None:
    """`write` to a temporary name beside `path`, then renamed onto it: a file that exists is
    whole (the job's done marker)."""
    tmp = path.with_name(f".{path.name}.tmp")  # one job writes it: its stale copy is its own
    write(tmp)
    os.replace(tmp, path)


COMPONENTS, WRITE, HALO = "components", "write", "halo"


def _layer_ranges(layers: int, ranges: int) -> list[tuple[int, int]]:
    """The layers of blocks [start, stop) along z of each of `ranges` z-ranges: as equal as
    they can be (a range may hold none where there are fewer layers than ranges)."""
    return [(k * layers // ranges, (k + 1) * layers // ranges) for k in range(ranges)]


def z_ranges(shape: Sequence[int], block: Sequence[int], ranges: int) -> list[tuple[int, int]]:
    """The voxels [start, stop) along z of each z-range of `BlockwiseJobs` (its blocks')."""
    layers = -(-int(shape[0]) // int(block[0]))
    return [
        (min(a * block[0], shape[0]), min(b * block[0], shape[0]))
        for a, b in _layer_ranges(layers, ranges)
    ]


def post_rounds(settings: PostprocessSettings) -> list[tuple[str, str]]:
    """The rounds of `BlockwiseJobs` under `settings`, in order, each with its kind: the
    component passes the settings need, the write of the mask after them, the halo steps."""
    s = settings
    rounds = []
    if s.hysteresis_high is not None:
        rounds.append(("binarise", COMPONENTS))
    if s.min_component_voxels > 0 and not (
        s.hysteresis_high is not None and s.hysteresis_mode == "3d"
    ):  # 3D hysteresis and the filter share a pass: a kept component is a whole one
        rounds.append(("filter", COMPONENTS))
    if s.fill_holes:
        rounds.append(("fill", COMPONENTS))
    rounds.append(("filled", WRITE))
    later = (
        ("plugged", s.plug_holes_max_area),
        ("patched", s.patch_holes_max_area),
        ("closed", s.closing_radius),
    )
    rounds.extend((name, HALO) for name, on in later if on > 0)
    return rounds


@dataclasses.dataclass(frozen=True)
class _Tables:
    """A component round's result for one z-range: each node's merged component, and for each
    decision of the round (`BlockwiseJobs._decisions`) whether it keeps that component."""

    nodes: np.ndarray
    merged: np.ndarray
    decisions: dict[str, np.ndarray]


class BlockwiseJobs:
    """`blockwise_mask`'s passes as jobs over `ranges` z-ranges of the blocks, so that the
    post-processing of a volume too large for one process runs in parallel processes (or
    SLURM jobs): `rounds` in order, each round's `run_range` for every range (in any order, at
    once), then its `merge` (a component round's only); `counts` at the end. A job whose result
    file exists is done and skipped: a killed job run again starts its range afresh.

    - A component round labels each block of its range, merges the components that touch
      across the range's blocks, and writes its tables (`<round>/range-<k>.npz`) and the node ids
      on the range's first and last z-planes (`<round>/faces-<k>.zarr`). A node is a block's
      component, numbered `flat block index * (block voxels + 1) + label`: every job numbers any
      block's components alike, whatever the other ranges hold.
    - Its merge joins the components that touch across ranges, from those planes alone, and
      sums their voxel counts and flags (`<round>/merge.npz`): a component that meets no
      range's first or last plane is decided by its own range.
    - The write round writes each block's mask after the cavity fill; each halo round (plug,
      patch, close) reads the mask of the round before with its halo, across ranges too.

    The folder holds one plan (settings, block, shape, ranges): a job of another plan is an
    error naming it."""

    def __init__(
        self,
        probs: Any,
        out: Any,
        settings: PostprocessSettings,
        block: Sequence[int],
        folder: Path,
        ranges: int = 1,
    ) -> None:
        self.probs, self.out, self.settings = probs, out, settings
        self.shape = tuple(int(n) for n in probs.shape)
        self.block = tuple(int(b) for b in block)
        _check_block(self.shape, self.block)
        if tuple(out.shape) != self.shape:
            raise CtsegError(
                f"blockwise mask: output shape {tuple(out.shape)} != input {self.shape}"
            )
        if ranges < 1:
            raise CtsegError(f"blockwise mask: ranges={ranges}: expected a positive number")
        self.grid = _grid(self.shape, self.block)
        self.ranges = _layer_ranges(self.grid[0], ranges)
        self.folder = Path(folder)
        self.stride = math.prod(self.block) + 1  # a block's labels are 1..its voxels
        self.later = dict(_later_steps(settings, self.shape))
        self.rounds = post_rounds(settings)
        self._loaded: dict[tuple[str, int], _Tables] = {}
        self._check_plan()

    def _check_plan(self) -> None:
        plan = {
            "settings": self.settings.as_dict(),
            "block": list(self.block),
            "shape": list(self.shape),
            "ranges": len(self.ranges),
        }
        path = self.folder / "plan.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        if not path.exists():  # the jobs of a round start at once: the first one's is kept
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(plan, sort_keys=True))
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
            tmp.unlink()
        recorded = json.loads(path.read_text())
        if recorded != plan:
            raise CtsegError(
                f"{path}: this folder holds the post-processing of another plan ({recorded}); "
                "remove it to start this one"
            )

    # ------------------------------------------------------------------ the masks, per block
    def _base(self, index: Index) -> int:
        return int(np.ravel_multi_index(index, self.grid)) * self.stride

    def _connectivity(self, name: str) -> int:
        if name == "binarise":
            return 26 if self.settings.hysteresis_mode == "3d" else 8
        return {"filter": 26, "fill": 6}[name]

    def _decisions(self, name: str, counts: np.ndarray, flags: np.ndarray) -> dict[str, np.ndarray]:
        minimum = self.settings.min_component_voxels
        if name == "binarise":  # seeded: holds a voxel above hysteresis_high
            decided = {"seeded": flags}
            if self.settings.hysteresis_mode == "3d" and minimum > 0:
                decided["large"] = flags & (counts >= minimum)
            return decided
        if name == "filter":
            return {"large": counts >= minimum}
        return {"cavity": ~flags}  # a background component that does not reach the border

    def _kept(self, name: str, index: Index, binary: np.ndarray) -> dict[str, np.ndarray]:
        """For each decision of component round `name`, the block's voxels of `binary` in the
        components it keeps."""
        tables = self._tables(name, self._range_of(index[0]))
        ids = _label(binary, self._connectivity(name))
        inside = ids > 0
        nodes = ids[inside].astype(np.int64) + self._base(index)
        merged = tables.merged[np.searchsorted(tables.nodes, nodes)]
        kept = {}
        for key, decided in tables.decisions.items():
            mask = np.zeros(ids.shape, bool)
            mask[inside] = decided[merged]
            kept[key] = mask
        return kept

    def _masks(self, index: Index, p: np.ndarray, upto: str = "filled") -> dict[str, np.ndarray]:
        """The block's masks after thresholding, binarising (hysteresis), the component filter
        and the cavity fill, up to `upto`, from the component rounds' tables."""
        names = [name for name, _ in self.rounds]
        plain = p > self.settings.threshold
        masks = {"plain": plain, "binarised": plain, "filtered": plain}
        if "binarise" in names and upto != "plain":
            kept = self._kept("binarise", index, plain)
            masks["binarised"] = masks["filtered"] = kept["seeded"]
            masks["filtered"] = kept.get("large", kept["seeded"])
        if "filter" in names and upto in ("filtered", "filled"):
            masks["filtered"] = self._kept("filter", index, masks["binarised"])["large"]
        masks["filled"] = masks["filtered"]
        if "fill" in names and upto == "filled":
            cavity = self._kept("fill", index, ~masks["filtered"])["cavity"]
            masks["filled"] = masks["filtered"] | cavity
        return masks

    def _source(
        self, name: str, index: Index, sl: Block, p: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """What component round `name` labels in a block, and the voxels flagging their
        component (None: none)."""
        if name == "binarise":
            return self._masks(index, p, "plain")["plain"], p > self.settings.hysteresis_high
        if name == "filter":
            return self._masks(index, p, "binarised")["binarised"], None
        return ~self._masks(index, p, "filtered")["filtered"], _border(sl, self.shape)

    # ------------------------------------------------------------------ the jobs
    def _range_of(self, layer: int) -> int:
        return next(k for k, (z0, z1) in enumerate(self.ranges) if z0 <= layer < z1)

    def _range_blocks(self, k: int) -> Iterator[tuple[Index, Block]]:
        z0, z1 = self.ranges[k]
        for index, sl in _blocks(self.shape, self.block):
            if z0 <= index[0] < z1:
                yield index, sl

    def _file(self, name: str, k: int | None) -> Path:
        kind = dict(self.rounds)[name]
        stem = "merge" if k is None else f"range-{k}"
        return self.folder / name / (f"{stem}.npz" if kind == COMPONENTS else f"{stem}.json")

    def done(self, name: str, k: int | None = None) -> bool:
        """Whether range job `k` of round `name` (None: its merge) has written its result."""
        if k is None and dict(self.rounds)[name] != COMPONENTS:
            return True  # only a component round has a merge
        return self._file(name, k).exists()

    def run_range(self, name: str, k: int) -> None:
        """Range job `k` of round `name`; every range job and merge of the rounds before must
        be done."""
        if not 0 <= k < len(self.ranges):
            raise CtsegError(f"blockwise mask: range {k}: expected 0 <= range < {len(self.ranges)}")
        if self.done(name, k):
            return
        before = self.rounds[: [n for n, _ in self.rounds].index(name)]
        for earlier, kind in before:
            if not self.done(earlier):
                raise CtsegError(
                    f"{self.folder}: post-processing round {earlier!r} is not merged yet; run "
                    f"its jobs and its merge before round {name!r}"
                )
            # A halo round reads the round before across ranges: never a range not yet written
            # (its absent chunks would read as zeros).
            missing = [r for r in range(len(self.ranges)) if not self.done(earlier, r)]
            if kind != COMPONENTS and missing:
                raise CtsegError(
                    f"{self.folder}: post-processing round {earlier!r} has ranges {missing} "
                    f"not done; run them before round {name!r}"
                )
        (self.folder / name).mkdir(parents=True, exist_ok=True)
        kind = dict(self.rounds)[name]
        if kind == COMPONENTS:
            self._label_range(name, k)
        else:
            self._write_range(name, k)

    def _label_range(self, name: str, k: int) -> None:
        connectivity = self._connectivity(name)
        offsets = _OFFSETS[connectivity]
        z0, z1 = self.ranges[k]
        planes = create_volume(
            self.folder / name / f"faces-{k}.zarr", (2, *self.shape[1:]), np.int64,
            (1, *self.block[1:]), write_empty_chunks=False,
        )  # fmt: skip
        nodes, counts, flags, pairs, on_planes = [], [], [], [], []
        faces: dict[Index, dict[tuple[int, int], np.ndarray]] = {}
        layer = -1
        for index, sl in self._range_blocks(k):
            p = np.asarray(self.probs[sl])
            binary, flagged = self._source(name, index, sl, p)
            ids = _label(binary, connectivity)
            count = int(ids.max()) if ids.size else 0
            base = self._base(index)
            block_nodes = np.where(ids > 0, ids.astype(np.int64) + base, 0)
            nodes.append(np.arange(1, count + 1, dtype=np.int64) + base)
            counts.append(np.bincount(ids.ravel(), minlength=count + 1)[1:])
            flag = np.zeros(count + 1, bool)
            if flagged is not None:
                flag[ids[flagged]] = True
            flags.append(flag[1:])
            if index[0] != layer:  # a new layer of blocks: the one before last is done
                layer = index[0]
                faces = {i: f for i, f in faces.items() if i[0] >= layer - 1}
            for d in _EARLIER:
                other = tuple(i + s for i, s in zip(index, d, strict=True))
                if other in faces:
                    pairs.append(_touching(block_nodes, faces[other], d, offsets))
            faces[index] = _faces(block_nodes)
            for row, at in ((0, z0), (1, z1 - 1)):
                plane = block_nodes[0 if row == 0 else -1]
                if index[0] == at and plane.any():
                    planes[row, sl[1], sl[2]] = plane
                    on_planes.append(np.unique(plane[plane > 0]))
        all_nodes = np.concatenate(nodes) if nodes else np.zeros(0, np.int64)
        merged = _merged(all_nodes, pairs)
        size = int(merged.max()) + 1 if len(merged) else 0
        summed = np.bincount(merged, weights=np.concatenate(counts or [[]]), minlength=size)
        flagged_merged = np.bincount(merged, weights=np.concatenate(flags or [[]]), minlength=size)
        open_nodes = np.unique(np.concatenate(on_planes or [np.zeros(0, np.int64)]))
        open_merged = merged[np.searchsorted(all_nodes, open_nodes)]
        opened = np.unique(open_merged)
        total = summed.astype(np.int64)
        _save(self._file(name, k), lambda tmp: np.savez(
            tmp.open("wb"), nodes=all_nodes, merged=merged, counts=total,
            flags=flagged_merged > 0, size=size, open_nodes=open_nodes, open_merged=open_merged,
            open_ids=opened, open_counts=total[opened], open_flags=(flagged_merged > 0)[opened],
        ))  # fmt: skip

    def merge(self, name: str) -> None:
        """The merge of component round `name`, once every range job is done: the components
        that touch across ranges (on the planes between them), their summed counts and
        flags."""
        if self.done(name):
            return
        missing = [k for k in range(len(self.ranges)) if not self.done(name, k)]
        if missing:
            raise CtsegError(
                f"{self.folder}: post-processing round {name!r}: ranges {missing} are not done; "
                "run them before the merge"
            )
        offsets = _OFFSETS[self._connectivity(name)]
        tables = [np.load(self._file(name, k)) for k in range(len(self.ranges))]
        starts = np.cumsum([0, *(int(t["size"]) for t in tables)])  # not the whole counts
        keys = [starts[k] + t["open_ids"] for k, t in enumerate(tables)]

        def key(k: int, nodes: np.ndarray) -> np.ndarray:
            t = tables[k]
            return starts[k] + t["open_merged"][np.searchsorted(t["open_nodes"], nodes)]

        pairs = []
        filled = [k for k, (z0, z1) in enumerate(self.ranges) if z1 > z0]
        for lower, upper in itertools.pairwise(filled):
            for found in self._across(name, lower, upper, offsets):
                pairs.append(np.stack([key(upper, found[:, 0]), key(lower, found[:, 1])], 1))
        every = np.concatenate(keys)
        merged = _merged(every, pairs)  # `every` is sorted: the ranges' ids do not overlap
        size = int(merged.max()) + 1 if len(merged) else 0
        counts = np.concatenate([t["open_counts"] for t in tables])
        flags = np.concatenate([t["open_flags"] for t in tables])
        total = np.bincount(merged, weights=counts, minlength=size).astype(np.int64)[merged]
        flagged = (np.bincount(merged, weights=flags, minlength=size) > 0)[merged]
        for t in tables:
            t.close()
        _save(self._file(name, None), lambda tmp: np.savez(
            tmp.open("wb"), keys=every, counts=total, flags=flagged, starts=starts))  # fmt: skip

    def _across(
        self, name: str, lower: int, upper: int, offsets: Sequence[tuple[int, int, int]]
    ) -> Iterator[np.ndarray]:
        """The pairs (node of `upper`, node of `lower`) touching across the planes between two
        ranges: `upper`'s first plane against `lower`'s last, a band of block rows at a time
        (each plane read once, its rows beside a band twice)."""
        steps = [(o[1], o[2]) for o in offsets if o[0] == -1]  # the in-plane shifts across z
        if not steps:
            return  # within z-slices only: nothing touches across ranges
        below = zarr.open_array(self.folder / name / f"faces-{lower}.zarr", mode="r")
        above = zarr.open_array(self.folder / name / f"faces-{upper}.zarr", mode="r")
        height, width = self.shape[1], self.shape[2]
        for y0 in range(0, height, self.block[1]):
            y1 = min(y0 + self.block[1], height)
            first = np.asarray(above[0, y0:y1])
            if not first.any():
                continue
            l0, l1 = max(0, y0 - 1), min(height, y1 + 1)
            last = np.asarray(below[1, l0:l1])
            for dy, dx in steps:  # first[y, x] touches last[y + dy, x + dx]
                rows = slice(max(0, l0 - y0 - dy), min(y1 - y0, l1 - y0 - dy))
                if rows.start >= rows.stop:
                    continue
                beside = slice(rows.start + y0 + dy - l0, rows.stop + y0 + dy - l0)
                mine, theirs = _shifted(width, dx)
                a, b = first[rows, mine], last[beside, theirs]
                both = (a > 0) & (b > 0)
                if both.any():
                    yield np.unique(np.stack([a[both], b[both]], axis=1), axis=0)

    def _tables(self, name: str, k: int) -> _Tables:
        """Range `k`'s tables of component round `name`, its open components' counts and
        flags those of the merge."""
        if (name, k) not in self._loaded:
            with np.load(self._file(name, k)) as t, np.load(self._file(name, None)) as m:
                counts, flags = t["counts"].copy(), t["flags"].copy()
                mine = slice(*np.searchsorted(m["keys"], m["starts"][k : k + 2]))
                ids = m["keys"][mine] - m["starts"][k]
                counts[ids], flags[ids] = m["counts"][mine], m["flags"][mine]
                self._loaded[(name, k)] = _Tables(
                    t["nodes"], t["merged"], self._decisions(name, counts, flags)
                )
        return self._loaded[(name, k)]

    def _target(self, name: str) -> Any:
        """`out` for the last round's mask, a scratch array in the folder for the others (made
        by the first job to need it: a job beside it finds it made)."""
        if name == self.rounds[-1][0]:
            return self.out
        path = made_once(self.folder / f"{name}.zarr", lambda tmp: create_volume(
            tmp, self.shape, np.uint8, scratch_chunks(self.block, self.shape),
            write_empty_chunks=False,
        ))  # fmt: skip
        return zarr.open_array(path, mode="r+")

    def _write_range(self, name: str, k: int) -> None:
        target = self._target(name)
        counts: dict[str, int] = {}
        if name == "filled":
            for index, sl in self._range_blocks(k):
                masks = self._masks(index, np.asarray(self.probs[sl]))
                for stage, mask in masks.items():
                    counts[stage] = counts.get(stage, 0) + int(np.count_nonzero(mask))
                target[sl] = masks["filled"].view(np.uint8)
        else:
            names = [n for n, _ in self.rounds]
            source = zarr.open_array(self.folder / f"{names[names.index(name) - 1]}.zarr", mode="r")
            counts[name] = 0
            for _, sl in self._range_blocks(k):
                result = self.later[name](source, sl)
                counts[name] += int(np.count_nonzero(result))
                target[sl] = result.astype(np.uint8, copy=False)
        _save(self._file(name, k), lambda tmp: tmp.write_text(json.dumps(counts)))

    def run(self) -> None:
        """Every job, one after another: one process's whole post-processing. Each scratch mask
        is removed once the round after it has read it."""
        names = [n for n, _ in self.rounds]
        for position, (name, kind) in enumerate(self.rounds):
            for k in range(len(self.ranges)):
                self.run_range(name, k)
            if kind == COMPONENTS:
                self.merge(name)
            if kind == HALO and names[position - 1] != names[-1]:
                remove_path(self.folder / f"{names[position - 1]}.zarr")

    def counts(self) -> dict[str, int]:
        """`binary_mask`'s counts, summed over the ranges once every job is done."""
        counts: dict[str, int] = {}
        for name, _ in self.rounds[self._first_written() :]:
            for k in range(len(self.ranges)):
                for stage, n in json.loads(self._file(name, k).read_text()).items():
                    counts[stage] = counts.get(stage, 0) + n
        previous = counts["filled"]
        for name in ("plugged", "patched", "closed"):
            previous = counts.setdefault(name, previous)
        return {
            "foreground_voxels": counts["closed"],
            "hysteresis_dropped_voxels": counts["plain"] - counts["binarised"],
            "removed_voxels": counts["binarised"] - counts["filtered"],
            "filled_voxels": counts["filled"] - counts["filtered"],
            "plugged_voxels": counts["plugged"] - counts["filled"],
            "patched_voxels": counts["patched"] - counts["plugged"],
            "closed_voxels": counts["closed"] - counts["patched"],
        }

    def _first_written(self) -> int:
        return [kind for _, kind in self.rounds].index(WRITE)


def blockwise_mask(
    probs: Any,
    out: Any,
    settings: PostprocessSettings,
    block: tuple[int, int, int] = (64, 64, 64),
    scratch_dir: Path | None = None,
    ranges: int = 1,
) -> dict[str, int]:
    """Write `masks.binary_mask(probs, settings)`'s mask into `out`, block by block, and return
    its counts (the same dict). `probs`: an array-like (Z, Y, X) read a block at a time; `out`:
    an array-like of the same shape written a block at a time (uint8 0/1); `scratch_dir`: the
    folder (made if missing) for the component tables and the masks that plugging, patching and
    closing read with halos (uint8 zarr arrays, `scratch_chunks`), each removed once read (None:
    a temporary directory); `ranges`: the z-ranges its jobs run over, one after another (the
    same mask whatever the number: `BlockwiseJobs`).
    `block`: from `post_block`, to keep the working set within the memory budget."""
    with _scratch_folder(scratch_dir) as folder:
        jobs = BlockwiseJobs(probs, out, settings, block, folder / "jobs", ranges)
        jobs.run()
        counts = jobs.counts()
        remove_path(folder / "jobs")
    return counts
