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
  `scipy.sparse.csgraph.connected_components` over the global component ids), with each
  component's voxel count and flag (holds a seed voxel; touches the volume's border) summed over
  its blocks; a later pass labels each block again (the same labels: the labelling is
  deterministic) and keeps, drops or fills whole components by the merged tables. Hysteresis
  3D and the component filter share one pass (a kept hysteresis component is a whole component
  of prob > threshold); hysteresis along z, then the component filter, then the cavity fill
  each need their own.
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
component tables (a count, a flag and a merged id per component per block), the touching pairs
found on the block faces, and the label planes on the faces of two layers of blocks along z
(what the next blocks merge with). `post_block` picks a block of whole chunks whose working set,
halos included, fits the post-processing's part of the memory budget.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import shutil
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

from ctseg.io import CtsegError
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
    chunk = [min(n, max(b, SCRATCH_MIN_CHUNK)) for b, n in zip(sizes, shape, strict=True)]

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


class _Components:
    """Components of a binary volume, labelled block by block and merged across blocks.

    `add` is called for every block in `_blocks` order (the binary block, and a same-shaped
    bool array of the voxels that flag their component); `finish` merges; then `keep` (from a
    choice over the merged counts and flags) and `mask` give a block's voxels in the chosen
    components."""

    def __init__(self, connectivity: int) -> None:
        self.connectivity = connectivity
        self.offsets = _OFFSETS[connectivity]
        self.start: dict[Index, int] = {}  # the global id before a block's first component
        self.next_id = 1  # global ids start at 1: 0 is outside every component
        self.counts: Any = []  # per block while adding, then per merged component
        self.flags: Any = []
        self.merged = np.zeros(1, np.int64)
        self.pairs: list[np.ndarray] = []
        self.faces: dict[Index, tuple[dict[tuple[int, int], np.ndarray], int]] = {}
        self.layer = -1

    def add(self, index: Index, binary: np.ndarray, flagged: np.ndarray | None) -> None:
        ids = _label(binary, self.connectivity)
        count = int(ids.max()) if ids.size else 0
        start = self.next_id - 1
        self.start[index] = start
        self.next_id += count
        self.counts.append(np.bincount(ids.ravel(), minlength=count + 1)[1:])
        flag = np.zeros(count + 1, bool)
        if flagged is not None:
            flag[ids[flagged]] = True
        self.flags.append(flag[1:])
        if index[0] != self.layer:  # a new layer of blocks: the one before last is done
            self.layer = index[0]
            self.faces = {k: v for k, v in self.faces.items() if k[0] >= self.layer - 1}
        for d in _EARLIER:
            other = tuple(i + s for i, s in zip(index, d, strict=True))
            if other in self.faces:
                self._merge_faces(ids, start, d, *self.faces[other])  # type: ignore[arg-type]
        # What later blocks merge with: the layers on this block's faces (copies, not views, so
        # the block's labels go), keyed by (axis, -1 for the last layer, +1 for the first).
        self.faces[index] = (
            {
                (axis, side): np.ascontiguousarray(
                    ids[(slice(None),) * axis + (slice(-1, None) if side < 0 else slice(0, 1),)]
                )
                for axis in range(3)
                for side in (-1, 1)
            },
            start,
        )

    def _merge_faces(
        self,
        ids: np.ndarray,
        start: int,
        d: tuple[int, ...],
        other: dict[tuple[int, int], np.ndarray],
        other_start: int,
    ) -> None:
        """The pairs of global ids of touching voxels, one in this block and one in the block
        at offset `d` (earlier): on an axis where d is -1, this block's first layer touches the
        other's last; where +1, its last the other's first; where 0, they run side by side."""
        mine = tuple(slice(0, 1) if s < 0 else slice(-1, None) if s > 0 else slice(None) for s in d)
        theirs = tuple(
            slice(-1, None) if s < 0 else slice(0, 1) if s > 0 else slice(None) for s in d
        )
        axis = next(a for a, s in enumerate(d) if s != 0)
        theirs = theirs[:axis] + (slice(None),) + theirs[axis + 1 :]  # the face is that layer
        a, b = ids[mine], other[(axis, d[axis])][theirs]
        if not a.any() or not b.any():
            return
        for offset in self.offsets:
            if any(s != 0 and o != s for o, s in zip(offset, d, strict=True)):
                continue
            cut_a, cut_b = [], []
            for o, s, n in zip(offset, d, a.shape, strict=True):
                if s != 0:
                    cut_a.append(slice(None))
                    cut_b.append(slice(None))
                else:
                    sa, sb = _shifted(n, o)
                    cut_a.append(sa)
                    cut_b.append(sb)
            pa, pb = a[tuple(cut_a)], b[tuple(cut_b)]
            both = (pa > 0) & (pb > 0)
            if both.any():
                found = np.stack(
                    [pa[both].astype(np.int64) + start, pb[both].astype(np.int64) + other_start],
                    axis=1,
                )
                self.pairs.append(np.unique(found, axis=0))

    def finish(self) -> None:
        """Merge the components that touch across blocks: `counts` and `flags` then hold each
        merged component's voxel count and flag."""
        self.faces = {}
        total = self.next_id
        pairs = np.concatenate(self.pairs) if self.pairs else np.zeros((0, 2), np.int64)
        self.pairs = []
        graph = coo_matrix(
            (np.ones(len(pairs), np.int8), (pairs[:, 0], pairs[:, 1])), shape=(total, total)
        )
        _, self.merged = connected_components(graph, directed=False)
        counts = np.concatenate([np.zeros(1, np.int64), *self.counts])
        flags = np.concatenate([np.zeros(1, bool), *self.flags])
        size = int(self.merged.max()) + 1
        self.counts = np.bincount(self.merged, weights=counts, minlength=size)
        self.flags = np.bincount(self.merged, weights=flags, minlength=size) > 0

    def keep(self, chosen: np.ndarray) -> np.ndarray:
        """Per global id, whether its merged component is `chosen` (bool per merged one)."""
        keep = np.asarray(chosen, bool)[self.merged]
        keep[0] = False
        return keep

    def mask(self, index: Index, binary: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """The bool mask of the block's voxels in components that `keep` keeps."""
        ids = _label(binary, self.connectivity).astype(np.int64)
        ids[ids > 0] += self.start[index]
        return keep[ids]


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


def _memo(stage: Stage) -> Stage:
    """`stage`, computed once per block (a block's value is the same in every pass)."""
    last: dict[str, Any] = {}

    def cached(index: Index, sl: Block, p: np.ndarray) -> np.ndarray:
        if last.get("index") != index:
            last["index"], last["value"] = index, stage(index, sl, p)
        return last["value"]

    return cached


def _components(
    probs: Any,
    block: tuple[int, ...],
    connectivity: int,
    source: Stage,
    flagged: Callable[[Block, np.ndarray], np.ndarray] | None = None,
) -> _Components:
    """One pass over the blocks: the merged components of the mask `source` gives."""
    parts = _Components(connectivity)
    for index, sl in _blocks(probs.shape, block):
        p = np.asarray(probs[sl])
        parts.add(index, source(index, sl, p), None if flagged is None else flagged(sl, p))
    parts.finish()
    return parts


def _stages(
    probs: Any, settings: PostprocessSettings, block: tuple[int, ...]
) -> tuple[Stage, Stage, Stage, Stage]:
    """The masks after thresholding, binarising (hysteresis), the component filter and the
    cavity fill, each as a function of (block index, slices, the block's probabilities) to the
    block's bool mask; the component passes they need are done here."""
    shape = tuple(int(n) for n in probs.shape)
    t, high = settings.threshold, settings.hysteresis_high
    minimum = settings.min_component_voxels

    def components(
        connectivity: int,
        source: Stage,
        flagged: Callable[[Block, np.ndarray], np.ndarray] | None = None,
    ) -> _Components:
        return _components(probs, block, connectivity, source, flagged)

    # Each stage: (block index, slices, the block's probabilities) to the bool mask after that
    # step of binary_mask's, from the stage before and its merged tables.
    @_memo
    def plain(index: Index, sl: Block, p: np.ndarray) -> np.ndarray:
        return p > t

    binarised = filtered = plain
    if high is not None and settings.hysteresis_mode == "3d":
        # One labelling for both: a kept hysteresis component is a whole component of
        # prob > threshold, so the component filter sees the same components.
        above = components(26, plain, lambda sl, p: p > high)
        seeded = above.keep(above.flags)
        large = above.keep(above.flags & (above.counts >= minimum))
        binarised = _memo(lambda index, sl, p: above.mask(index, plain(index, sl, p), seeded))
        filtered = binarised
        if minimum > 0:
            filtered = _memo(lambda index, sl, p: above.mask(index, plain(index, sl, p), large))
    else:
        if high is not None:  # along z
            in_slice = components(8, plain, lambda sl, p: p > high)
            seeded = in_slice.keep(in_slice.flags)
            binarised = _memo(
                lambda index, sl, p: in_slice.mask(index, plain(index, sl, p), seeded)
            )
        filtered = binarised
        if minimum > 0:
            sized = components(26, binarised)
            large = sized.keep(sized.counts >= minimum)
            filtered = _memo(lambda index, sl, p: sized.mask(index, binarised(index, sl, p), large))

    filled = filtered
    if settings.fill_holes:
        # A cavity: a 6-connected component of the background that does not reach the border.
        outside = components(
            6, lambda index, sl, p: ~filtered(index, sl, p), lambda sl, p: _border(sl, shape)
        )
        cavity = outside.keep(~outside.flags)
        filled = _memo(
            lambda index, sl, p: (
                filtered(index, sl, p) | outside.mask(index, ~filtered(index, sl, p), cavity)
            )
        )

    return plain, binarised, filtered, filled


def blockwise_mask(
    probs: Any,
    out: Any,
    settings: PostprocessSettings,
    block: tuple[int, int, int] = (64, 64, 64),
    scratch_dir: Path | None = None,
) -> dict[str, int]:
    """Write `masks.binary_mask(probs, settings)`'s mask into `out`, block by block, and return
    its counts (the same dict). `probs`: an array-like (Z, Y, X) read a block at a time; `out`:
    an array-like of the same shape written a block at a time (uint8 0/1); `scratch_dir`: the
    folder (made if missing) for the masks that plugging, patching and closing read with halos,
    uint8 zarr arrays chunked by `block` (at least `SCRATCH_MIN_CHUNK` a side), each removed
    once read (None: a temporary directory).
    `block`: from `post_block`, to keep the working set within the memory budget."""
    shape = tuple(int(n) for n in probs.shape)
    block = tuple(block)  # type: ignore[assignment]
    _check_block(shape, block)
    if tuple(out.shape) != shape:
        raise CtsegError(f"blockwise mask: output shape {tuple(out.shape)} != input {shape}")
    stages = _stages(probs, settings, block)
    counts = _write(probs, out, block, scratch_dir, stages, _later_steps(settings, shape))
    return {
        "foreground_voxels": counts["closed"],
        "hysteresis_dropped_voxels": counts["plain"] - counts["binarised"],
        "removed_voxels": counts["binarised"] - counts["filtered"],
        "filled_voxels": counts["filled"] - counts["filtered"],
        "plugged_voxels": counts["plugged"] - counts["filled"],
        "patched_voxels": counts["patched"] - counts["plugged"],
        "closed_voxels": counts["closed"] - counts["patched"],
    }


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


def _write(
    probs: Any,
    out: Any,
    block: tuple[int, ...],
    scratch_dir: Path | None,
    stages: tuple[Stage, Stage, Stage, Stage],
    later: list[tuple[str, HaloStep]],
) -> dict[str, int]:
    """The last passes: the mask after the cavity fill, then after each of the `later` steps,
    each to a scratch array the next step reads, the last to `out`; the voxels of each mask (a
    step that is off: the mask before it)."""
    shape = tuple(int(n) for n in probs.shape)
    plain, binarised, filtered, filled = stages
    counts = dict.fromkeys(("plain", "binarised", "filtered", "filled"), 0)
    names = ["filled", *(name for name, _ in later)]  # the masks, in the order they are made
    with contextlib.ExitStack() as stack:
        folder = stack.enter_context(_scratch_folder(scratch_dir)) if later else None

        def target_for(name: str) -> Any:
            """`out` for the last mask, a scratch array in `folder` for the others."""
            if name == names[-1]:
                return out
            assert folder is not None
            chunks = tuple(max(b, SCRATCH_MIN_CHUNK) for b in block)
            return create_volume(folder / f"{name}.zarr", shape, np.uint8, chunks,
                                 write_empty_chunks=False)  # fmt: skip

        target = target_for("filled")
        for index, sl in _blocks(shape, block):
            p = np.asarray(probs[sl])
            for name, stage in zip(counts, stages, strict=True):
                counts[name] += int(np.count_nonzero(stage(index, sl, p)))
            target[sl] = filled(index, sl, p).view(np.uint8)
        for before, (name, step) in zip(names[:-1], later, strict=True):
            source, target = target, target_for(name)
            counts[name] = 0
            for _, sl in _blocks(shape, block):
                result = step(source, sl)
                counts[name] += int(np.count_nonzero(result))
                target[sl] = result.astype(np.uint8, copy=False)
            assert folder is not None
            shutil.rmtree(folder / f"{before}.zarr")  # no later step reads it
    previous = counts["filled"]
    for name in ("plugged", "patched", "closed"):
        previous = counts.setdefault(name, previous)
    return counts
