"""The 3D tiling of a volume too large for memory: which windows each tile computes, which tiles
write into each output chunk, how large a tile is under the budgets, and how tiles are split
into parts. Pure arithmetic; `ctseg.inference.tiled` drives it.

Tiles
-----
The output is cut into tiles: boxes of whole output chunks, the same size along each axis
(the last one shorter). A tile *owns* the windows whose centre (start + window // 2) lies in it,
so every window is computed by exactly one tile. Its windows reach past its faces by up to half
a window: the tile's *extent* is the box its windows cover, and its input is read over the
extent. The exact sums (`ctseg.inference.windows.to_fixed`) of its windows are summed over the
extent; an output chunk that only one tile's extent meets is final when that tile is done, one
that several meet is final when all of them are (`contributors`).

Parts
-----
Tiles are numbered in z-major order (z, then y, then x) and split into `parts` runs of
consecutive tiles of (nearly) equal length (`part_tiles`): part k is a z-range of the volume,
and its seams with parts k - 1 and k + 1 are the chunks their extents share.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ctseg.inference.settings import Shape3
from ctseg.io import CtsegError

Index = tuple[int, int, int]
Box = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


@dataclass(frozen=True)
class TileGrid:
    """The tiles of a volume of `shape` (z, y, x), windows of `window` at `starts` (per axis),
    output chunks of `chunks` and tiles of `tile` voxels (whole chunks)."""

    shape: Shape3
    window: Shape3
    starts: tuple[tuple[int, ...], ...]
    chunks: Shape3
    tile: Shape3

    def __post_init__(self) -> None:
        for t, c in zip(self.tile, self.chunks, strict=True):
            if t < 1 or c < 1 or t % c:
                raise ValueError(f"tile {self.tile} is not a whole number of chunks {self.chunks}")

    # ------------------------------------------------------------------ per axis
    def counts(self) -> Shape3:
        """Tiles along each axis."""
        return tuple(math.ceil(s / t) for s, t in zip(self.shape, self.tile, strict=True))  # type: ignore[return-value]

    @functools.cached_property
    def _owned(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Per axis, per tile of that axis, the window starts whose centres lie in it."""
        owned = []
        for axis, n in enumerate(self.counts()):
            per_tile: list[list[int]] = [[] for _ in range(n)]
            for start in self.starts[axis]:
                centre = start + self.window[axis] // 2
                per_tile[min(centre // self.tile[axis], n - 1)].append(start)
            owned.append(tuple(tuple(t) for t in per_tile))
        return tuple(owned)

    def owned_starts(self, axis: int, i: int) -> list[int]:
        """The window starts along `axis` whose centres lie in tile `i` of that axis."""
        return list(self._owned[axis][i])

    def axis_extent(self, axis: int, i: int) -> tuple[int, int] | None:
        """[first owned start, last owned start + window) along `axis`, or None: no window."""
        owned = self._owned[axis][i]
        if not owned:
            return None
        return owned[0], owned[-1] + self.window[axis]

    # ------------------------------------------------------------------ tiles
    def tiles(self) -> list[Index]:
        """Every tile that owns a window, in z-major order."""
        ranges = [
            [i for i in range(n) if self.axis_extent(a, i) is not None]
            for a, n in enumerate(self.counts())
        ]
        return list(itertools.product(*ranges))  # type: ignore[arg-type]

    def extent(self, tile: Index) -> Box:
        """The box tile's windows cover (may pass the far face where an axis is shorter than
        the window: the input there is padding)."""
        boxes = [self.axis_extent(a, i) for a, i in enumerate(tile)]
        if any(b is None for b in boxes):
            raise ValueError(f"tile {tile} owns no window")
        return tuple(boxes)  # type: ignore[return-value]

    def corners(self, tile: Index) -> list[Shape3]:
        """The corners of the windows `tile` owns, in z-major order."""
        owned = [self.owned_starts(a, i) for a, i in enumerate(tile)]
        return list(itertools.product(*owned))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ chunks
    def chunk_box(self, chunk: Index) -> Box:
        return tuple(  # type: ignore[return-value]
            (c * n, min((c + 1) * n, s))
            for c, n, s in zip(chunk, self.chunks, self.shape, strict=True)
        )

    def chunks_in(self, box: Box) -> list[Index]:
        """The output chunks a box (clipped to the volume) meets, in z-major order."""
        ranges = [
            range(lo // n, math.ceil(min(hi, s) / n))
            for (lo, hi), n, s in zip(box, self.chunks, self.shape, strict=True)
        ]
        return list(itertools.product(*ranges))  # type: ignore[arg-type]

    def contributors(self, chunk: Index) -> list[Index]:
        """The tiles whose extents meet output chunk `chunk`: its value is their sum."""
        per_axis = []
        for a, (lo, hi) in enumerate(self.chunk_box(chunk)):
            hits = []
            for i in range(self.counts()[a]):
                ext = self.axis_extent(a, i)
                if ext is not None and ext[0] < hi and lo < ext[1]:
                    hits.append(i)
            per_axis.append(hits)
        return list(itertools.product(*per_axis))  # type: ignore[arg-type]

    def all_chunks(self) -> Iterator[Index]:
        counts = [math.ceil(s / n) for s, n in zip(self.shape, self.chunks, strict=True)]
        return itertools.product(*(range(n) for n in counts))  # type: ignore[return-value]


def part_tiles(tiles: Sequence[Index], parts: int, part: int) -> list[Index]:
    """Part `part` (0-based) of `parts`: a run of consecutive tiles, the runs of equal length
    give or take one."""
    if not 0 <= part < parts:
        raise CtsegError(f"--part {part}: expected 0 <= part < --parts {parts}")
    n = len(tiles)
    return list(tiles[n * part // parts : n * (part + 1) // parts])


def extent_voxels(tile: Shape3, window: Shape3, shape: Shape3) -> int:
    """An upper bound of a tile's extent in voxels: the tile grown by a window (half on each
    side, rounded up), no larger than the padded volume."""
    return math.prod(min(t + w, max(s, w)) for t, w, s in zip(tile, window, shape, strict=True))


def plan_tile(
    shape: Shape3,
    window: Shape3,
    chunks: Shape3,
    bytes_per_voxel: int,
    budget_bytes: float,
    what: str = "the budget",
) -> Shape3:
    """The largest tile of whole chunks whose extent's working set (`bytes_per_voxel` for each
    of its voxels) fits `budget_bytes`: the whole volume if it fits, else the longest side
    (in chunks) halved until it does. A budget smaller than one chunk's tile is refused, the
    error saying where the budget comes from (`what`)."""
    tile = [math.ceil(s / c) * c for s, c in zip(shape, chunks, strict=True)]
    while extent_voxels(tuple(tile), window, shape) * bytes_per_voxel > budget_bytes:  # type: ignore[arg-type]
        in_chunks = [t // c for t, c in zip(tile, chunks, strict=True)]
        axis = max(range(3), key=lambda a: (in_chunks[a], tile[a]))
        if in_chunks[axis] == 1:
            need = extent_voxels(tuple(chunks), window, shape) * bytes_per_voxel  # type: ignore[arg-type]
            raise CtsegError(
                f"a tile of one chunk {chunks} with its window {window} needs "
                f"{need / 2**20:.3g} MB, more than the {budget_bytes / 2**20:.3g} MB the tiles "
                f"get ({what}); give a larger budget"
            )
        tile[axis] = (in_chunks[axis] + 1) // 2 * chunks[axis]
    return tuple(tile)  # type: ignore[return-value]
