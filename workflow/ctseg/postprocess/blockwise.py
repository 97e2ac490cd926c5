"""`binary_mask` block by block: the same mask, bit for bit, of a volume too large for memory.

`blockwise_mask(probs, out, settings, block)` reads the probabilities from an array-like (a numpy
array, a memmap, a zarr array: anything with ``shape`` that a tuple of slices indexes) one block
at a time and writes the uint8 0/1 mask into `out` (anything a tuple of slices assigns to) one
block at a time. Each step it supports gives exactly `masks.binary_mask`'s result, on any volume
and any block shape (blocks that do not divide the shape, blocks one voxel thin):

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
* ``closing_radius`` r: the pre-closing mask goes to `scratch` (a uint8 array-like of the
  volume's shape; by default a memmap in a temporary directory, on disk), then each block is
  closed from its block grown by 2r (the dilation's r plus the erosion's r), the part of that
  halo outside the volume filled as `masks.close` fills it (the face voxels repeated).

Refused, with one line (`CtsegError`): ``plug_holes_max_area`` and ``patch_holes_max_area``.
Both work per whole 2D slice along z, y and x (a hole is a 2D component of a slice's background
that does not reach the slice's border), so a slice in one axis spans whole planes of the
others: no block short of the whole volume is exact.

Memory: one block of probabilities and the block's masks and labels (the closing's block also
with its halo), the component tables (a count, a flag and a merged id per component per block),
the touching pairs found on the block faces, and the label planes on the faces of two layers of
blocks along z (what the next blocks merge with).
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cc3d
import numpy as np
from scipy import ndimage
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from ctseg.io import CtsegError
from ctseg.postprocess.masks import PostprocessSettings

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


def refused_step(settings: PostprocessSettings) -> str | None:
    """The one line saying which step of `settings` cannot be done blockwise, or None."""
    for name, value in (
        ("plug_holes_max_area", settings.plug_holes_max_area),
        ("patch_holes_max_area", settings.patch_holes_max_area),
    ):
        if value > 0:
            return (
                f"{name}={value} works per whole slice along z, y and x (a hole is a 2D "
                "component of a whole plane): not available blockwise"
            )
    return None


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
    scratch: Any = None,
) -> dict[str, int]:
    """Write `masks.binary_mask(probs, settings)`'s mask into `out`, block by block, and return
    its counts (the same dict; ``plugged_voxels`` and ``patched_voxels`` 0). `probs`: an
    array-like (Z, Y, X) read a block at a time; `out`: an array-like of the same shape written
    a block at a time (uint8 0/1); `scratch`: with a closing, a uint8 array-like of the same
    shape for the mask before the closing (default: a memmap in a temporary directory).
    Plugging and patching are refused (`refused_step`)."""
    shape = tuple(int(n) for n in probs.shape)
    block = tuple(block)  # type: ignore[assignment]
    _check_block(shape, block)
    if tuple(out.shape) != shape:
        raise CtsegError(f"blockwise mask: output shape {tuple(out.shape)} != input {shape}")
    refused = refused_step(settings)
    if refused is not None:
        raise CtsegError(refused)
    plain, binarised, filtered, filled = _stages(probs, settings, block)
    counts = _write(
        probs, out, settings.closing_radius, block, scratch, plain, binarised, filtered, filled
    )
    return {
        "foreground_voxels": counts["closed"],
        "hysteresis_dropped_voxels": counts["plain"] - counts["binarised"],
        "removed_voxels": counts["binarised"] - counts["filtered"],
        "filled_voxels": counts["filled"] - counts["filtered"],
        "plugged_voxels": 0,
        "patched_voxels": 0,
        "closed_voxels": counts["closed"] - counts["filled"],
    }


def _write(
    probs: Any, out: Any, radius: int, block: tuple[int, ...], scratch: Any, *stages: Stage
) -> dict[str, int]:
    """The last passes: the mask after the cavity fill to `out` (with a closing, to `scratch`,
    then each block closed to `out`); the voxels of each stage's mask."""
    shape = tuple(int(n) for n in probs.shape)
    plain, binarised, filtered, filled = stages
    counts = dict.fromkeys(("plain", "binarised", "filtered", "filled", "closed"), 0)
    temporary, target = None, None
    if radius > 0 and scratch is None:
        temporary = tempfile.TemporaryDirectory(prefix="ctseg-blockwise-")
        scratch = np.lib.format.open_memmap(
            Path(temporary.name) / "mask.npy", mode="w+", dtype=np.uint8, shape=shape
        )
    try:
        target = scratch if radius > 0 else out
        for index, sl in _blocks(shape, block):
            p = np.asarray(probs[sl])
            for name, stage in (
                ("plain", plain),
                ("binarised", binarised),
                ("filtered", filtered),
                ("filled", filled),
            ):
                counts[name] += int(np.count_nonzero(stage(index, sl, p)))
            target[sl] = filled(index, sl, p).view(np.uint8)
        if radius > 0:
            for _, sl in _blocks(shape, block):
                closed = _close_block(scratch, sl, shape, radius)
                counts["closed"] += int(np.count_nonzero(closed))
                out[sl] = closed
        else:
            counts["closed"] = counts["filled"]
    finally:
        if temporary is not None:
            del scratch, target  # the memmap's last references, before its file goes
            temporary.cleanup()
    return counts
