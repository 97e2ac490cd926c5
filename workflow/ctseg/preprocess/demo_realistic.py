"""The `realistic` demo preset: synthetic volumes with the hard parts of real scroll CT.

The `simple` preset (`ctseg.preprocess.demo_data`) is easy: bright sheets on a dark background with
a mild drift, so a model separates them almost perfectly (exp001_full scored 0.94 on it, against
0.61-0.63 for the best private-leaderboard entries on real scrolls). Real data is hard where the
competition's VOI (merged sheets) and TopoScore (holes, fragments) look. Each setting below
imitates one property of real scroll CT (docs/metric.md, "The data": uint8 volumes, label 1
the papyrus surface about 2 voxels thick, label 2 about 58% of a volume):

* **Sheets that run together** (`CLOSE_PROBABILITY`, `CLOSE_GAP`, `CLOSE_GAP_SPREAD`): in a
  compressed scroll neighbouring wraps lie pressed together. About half the pairs of adjacent
  sheets follow each other at about one voxel of background over the whole volume, and touch
  outright in patches where the gap field falls below zero; 35-55% of the label-1 voxels of
  a 320^3 volume lie within one voxel of another sheet (simple: ~2%). Blurred, a one-voxel
  gap is ~90% as bright as the sheets beside it, so the pair looks like one thick sheet: a
  prediction merges them and VOI pays.
* **Tilted, bent sheets** (`MAX_SLOPE`, `BEND`): wraps cross a crop at any angle and leave
  through its faces, not only parallel to one axis; each gap also varies from place to place,
  so the sheets deform progressively through the stack.
* **Varying thickness** (`THICKNESS_MEDIAN`, `THICKNESS_SPREAD`, `THICKNESS_RANGE`): papyrus
  thickness varies along a sheet, from 1.2 voxels to 6, median about two.
* **Holes** (`HOLE_FRACTION`): real sheets are torn and have missing pieces; a few percent of
  each sheet's area is cut out in blobs that are holes in both label and image (TopoScore's
  dimension-1 features).
* **Low and drifting contrast** (`CONTRAST`, `CONTRAST_SPREAD`, `BACKGROUND`, `DRIFT`):
  papyrus is only a little denser than the air and debris around it, its density varies, and
  the reconstruction drifts across a volume by more than that contrast, so no global threshold
  works: the contrast-to-noise ratio of sheet against background is 0.9-1.8 (simple: 3.5-5).
  In patches a sheet fades nearly into the background although the label goes on, as
  annotators follow a sheet through a damaged stretch.
* **Partial-volume blur** (`PSF_SIGMA`): the image renders each sheet's exact occupancy of a
  voxel (a sheet covering half a voxel gives half its density) and then blurs it with a
  Gaussian point-spread function, which fills the one-voxel gaps between pressed sheets.
* **Noise** (`NOISE_SIGMA`, `NOISE_CORRELATION`): reconstruction noise, a little correlated
  within each slice, so speckles are larger than one voxel.
* **Ring artefacts** (`RINGS`): a detector defect reconstructs as concentric rings around the
  rotation axis in every z slice; in 3D they are thin, faint cylindrical shells that look
  like sheets.
* **Bright inclusions and streaks** (`INCLUSIONS_PER_VOXEL`, `STREAK_PROBABILITY`): dense grains
  (minerals, ink, debris) appear as small bright blobs; the densest throw straight bright and
  dark streaks through their slices, like metal artefacts in CT. They are label 0.
* **Mostly ignored** (`IGNORE_FRACTION`): 55-68% of each volume is label 2, in a few large
  smooth regions, as in the real data (about 58%).

Memory stays bounded at any size: every field is a sum of separable Gaussian bumps that can be
evaluated on any block of rows, and the volume is built in z slabs of `SLAB` slices (plus a blur
halo); only the three uint8 outputs are full-size. Measured on the 2-core machine (shared with
other work, load average 6-11): a 320^3 volume takes 7-11 s and the whole `ctseg demo-data
--preset realistic --shape 320,320,320` process peaks at about 285 MB resident (`/usr/bin/time
-v`, 1 or 2 volumes); the simple preset takes 3-6 s and 335-345 MB. A 64^3 volume takes about
0.1 s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from ctseg.preprocess.demo_volume import DemoVolume, smooth_basis

SLAB = 32  # z slices built at a time: bounds the float32 working set at 320^3 to ~20 MB each
TILE = 64  # sheet columns handled at a time, so each sheet is evaluated only near itself
HALO = 6  # voxels beyond the volume that the sheet stack must cover (the blur reaches ~5)

CLOSE_PROBABILITY = 0.45  # chance that a pair of adjacent sheets runs together
CLOSE_GAP = 1.2  # mean gap of such a pair, voxels along the normal
CLOSE_GAP_SPREAD = 0.8  # std of that gap: it falls below 0 (contact) on ~7% of the pair
OPEN_GAP = (16.0, 28.0)  # mean gap range of the other pairs, voxels
MAX_SLOPE = 0.6  # tilt of the stack against its axis (0.6 is 31 degrees)
BEND = 0.05  # amplitude of the common bend, times the depth
THICKNESS_MEDIAN = 2.2
THICKNESS_SPREAD = 0.4  # std of log thickness
THICKNESS_RANGE = (1.2, 6.0)
HOLE_FRACTION = (0.02, 0.06)  # area of each sheet cut out
SHEET_GAIN = (0.75, 1.15)  # per-sheet density factor
CONTRAST = (55.0, 80.0)  # sheet density above the background, grey levels
CONTRAST_SPREAD = 0.3  # the contrast field is CONTRAST * clip(0.65 + 0.3 * N(0, 1), 0.08, 1.2)
BACKGROUND = (85.0, 115.0)
DRIFT = (30.0, 50.0)  # grey levels of linear drift across the volume
PSF_SIGMA = (0.9, 1.3)
NOISE_SIGMA = (9.0, 13.0)
NOISE_CORRELATION = 0.7  # in-slice Gaussian sigma of the noise, voxels
RINGS = (4, 12)  # rings per volume
RING_AMPLITUDE = (6.0, 16.0)
INCLUSIONS_PER_VOXEL = 1 / 45**3
INCLUSION_RADIUS = (1.5, 4.0)
INCLUSION_AMPLITUDE = (60.0, 140.0)
STREAK_PROBABILITY = 0.3
STREAK_LENGTH = (15.0, 40.0)
IGNORE_FRACTION = (0.55, 0.68)
MAX_SHEETS = 250  # sheet ids are uint8


class _Field:
    """A smooth random field of about unit variance, evaluated one block of rows at a time."""

    def __init__(self, rng: np.random.Generator, shape: Sequence[int], n_ctrl: int) -> None:
        self.coef = rng.standard_normal((n_ctrl,) * len(shape)).astype(np.float32)
        self.bases = [smooth_basis(int(size), n_ctrl) for size in shape]
        # Moments and quantiles from every 4th voxel: exact values of the field at those points,
        # and plenty of them for a field that varies over tens of voxels.
        self.sample = self._evaluate([b[::4] for b in self.bases]).ravel()
        self.mean = float(self.sample.mean())
        self.scale = 1.0 / max(float(self.sample.std()), 1e-6)

    def _evaluate(self, bases: list[np.ndarray]) -> np.ndarray:
        field = self.coef
        for basis in bases:
            field = np.tensordot(field, basis, axes=([0], [1]))
        return field

    def rows(self, start: int, stop: int) -> np.ndarray:
        field = self._evaluate([self.bases[0][start:stop], *self.bases[1:]])
        field -= self.mean
        field *= self.scale
        return field

    def full(self) -> np.ndarray:
        return self.rows(0, self.bases[0].shape[0])

    def quantile(self, q: float) -> float:
        return (float(np.quantile(self.sample, q)) - self.mean) * self.scale


@dataclass
class _Sheet:
    centre: np.ndarray  # float32 over the plane: mid-surface position along the stack axis
    half: np.ndarray  # float32 over the plane: half thickness along the sheet normal
    keep: np.ndarray  # bool over the plane: False in the holes
    gain: float
    holes: int


@dataclass
class _Inclusion:
    centre: np.ndarray  # z, y, x
    radius: float
    amplitude: float
    streaks: list[tuple[float, float, float]]  # (angle, signed amplitude, decay length)


def _stack(
    rng: np.random.Generator, shape: tuple[int, int, int], axis: int
) -> tuple[list[_Sheet], np.ndarray, list[tuple[int, int]]]:
    """The sheets, the column stretch (column length per unit of normal length), close pairs."""
    depth = shape[axis]
    plane = tuple(s for a, s in enumerate(shape) if a != axis)
    uu, vv = (np.arange(n, dtype=np.float32) - (n - 1) / 2 for n in plane)
    a = rng.uniform(0, 2 * np.pi)
    slope = rng.uniform(0, MAX_SLOPE) * np.array([np.cos(a), np.sin(a)], np.float32)
    bend = BEND * depth * _Field(rng, plane, 3).full()
    shift = bend + slope[0] * uu[:, None] + slope[1] * vv[None, :]
    grad_u, grad_v = np.gradient(shift)
    stretch = np.sqrt(1 + grad_u**2 + grad_v**2).astype(np.float32)

    # Positions are built in normal units p and placed at column position shift + stretch * p,
    # which keeps gaps and thicknesses along the normal what they were drawn as.
    lowest = float(((-HALO - shift) / stretch).min())
    highest = float(((depth + HALO - shift) / stretch).max())
    n_ctrl_holes = max(6, round(min(plane) / 16))
    open_gap = rng.uniform(*OPEN_GAP)

    def thickness() -> np.ndarray:
        log_t = np.log(THICKNESS_MEDIAN) + THICKNESS_SPREAD * _Field(rng, plane, 4).full()
        return np.clip(np.exp(log_t), *THICKNESS_RANGE).astype(np.float32)

    sheets: list[_Sheet] = []
    close: list[tuple[int, int]] = []
    t = thickness()
    p = lowest - t / 2 - rng.uniform(0, open_gap)
    while float(p.min()) - float(t.max()) / 2 < highest and len(sheets) < MAX_SHEETS:
        holes = _Field(rng, plane, n_ctrl_holes)
        keep = holes.full() < holes.quantile(1 - rng.uniform(*HOLE_FRACTION))
        sheets.append(
            _Sheet(
                centre=(shift + stretch * p).astype(np.float32),
                half=t / 2,
                keep=keep,
                gain=float(rng.uniform(*SHEET_GAIN)),
                holes=int(ndimage.label(~keep)[1]),
            )
        )
        t_next = thickness()
        gap_field = _Field(rng, plane, 4).full()
        if rng.random() < CLOSE_PROBABILITY:
            close.append((len(sheets) - 1, len(sheets)))
            # Never much below 0: a slight overlap fuses the two, but they must not cross.
            gap = np.maximum(CLOSE_GAP + CLOSE_GAP_SPREAD * gap_field, -0.4)
        else:
            gap = open_gap * np.exp(0.25 * gap_field)
        p = p + (t + t_next) / 2 + gap
        t = t_next
    close = [pair for pair in close if pair[1] < len(sheets)]
    return sheets, stretch, close


def _rings(rng: np.random.Generator, plane: tuple[int, int]) -> np.ndarray:
    """Concentric rings around a rotation axis near the crop, added to every z slice."""
    centre = rng.uniform(-0.5, 1.5, size=2) * np.array(plane)
    yy, xx = np.ogrid[: plane[0], : plane[1]]
    radius = np.hypot(yy - centre[0], xx - centre[1]).astype(np.float32)
    low, high = float(radius.min()), float(radius.max())
    pattern = np.zeros(plane, np.float32)
    for _ in range(int(rng.integers(RINGS[0], RINGS[1] + 1))):
        r0 = rng.uniform(low, high)
        width = rng.uniform(0.6, 1.5)
        amplitude = rng.choice([-1.0, 1.0]) * rng.uniform(*RING_AMPLITUDE)
        pattern += amplitude * np.exp(-0.5 * ((radius - r0) / width) ** 2)
    return pattern


def _inclusions(rng: np.random.Generator, shape: tuple[int, int, int]) -> list[_Inclusion]:
    count = int(rng.poisson(np.prod(shape) * INCLUSIONS_PER_VOXEL))
    found = []
    for _ in range(count):
        streaks = []
        if rng.random() < STREAK_PROBABILITY:
            for _ in range(int(rng.integers(2, 5))):
                sign = rng.choice([-1.0, 1.0])
                streaks.append(
                    (rng.uniform(0, np.pi), sign * rng.uniform(15, 35), rng.uniform(*STREAK_LENGTH))
                )
        found.append(
            _Inclusion(
                centre=rng.uniform(0, 1, size=3) * (np.array(shape) - 1),
                radius=float(rng.uniform(*INCLUSION_RADIUS)),
                amplitude=float(rng.uniform(*INCLUSION_AMPLITUDE)),
                streaks=streaks,
            )
        )
    return found


def _paint_sheets(
    occupancy: np.ndarray,
    ids: np.ndarray,
    rows: tuple[int, int],
    axis: int,
    sheets: list[_Sheet],
    stretch: np.ndarray,
) -> None:
    """Render the sheets into a slab of z rows: soft occupancy for the image, ids for the label.

    Occupancy is the part of each voxel (a unit length along the normal) that lies inside the
    sheet, clip(half + 0.5 - |d|, 0, 1): the partial-volume effect. The label is |d| < half.
    """
    # View the slab as [depth, plane u, plane v], with offsets into the full volume.
    occ = np.moveaxis(occupancy, axis, 0)
    lab = np.moveaxis(ids, axis, 0)
    depth_offset, u_offset = (rows[0], 0) if axis == 0 else (0, rows[0])
    n_depth, n_u, n_v = occ.shape
    for k, sheet in enumerate(sheets):
        for u0 in range(0, n_u, TILE):
            for v0 in range(0, n_v, TILE):
                us = slice(u_offset + u0, u_offset + min(u0 + TILE, n_u))
                vs = slice(v0, min(v0 + TILE, n_v))
                centre, half = sheet.centre[us, vs], sheet.half[us, vs]
                reach = (half + 1) * stretch[us, vs]
                lo = max(int(np.floor((centre - reach).min())) - depth_offset, 0)
                hi = min(int(np.ceil((centre + reach).max())) + 1 - depth_offset, n_depth)
                if lo >= hi:
                    continue
                z = np.arange(lo + depth_offset, hi + depth_offset, dtype=np.float32)
                distance = np.abs(z[:, None, None] - centre) / stretch[us, vs]
                keep = sheet.keep[us, vs]
                inside = (distance < half) & keep
                soft = np.clip(half + 0.5 - distance, 0, 1) * (sheet.gain * keep)
                block = (slice(lo, hi), slice(u0, u0 + centre.shape[0]), vs)
                np.maximum(occ[block], soft, out=occ[block])
                lab[block][inside] = k + 1


def _paint_inclusions(slab: np.ndarray, z0: int, inclusions: list[_Inclusion]) -> None:
    """Soft balls added to a slab whose first row is z0 of the volume."""
    for inc in inclusions:
        offset = np.array([z0, 0, 0])
        lo = np.maximum(np.floor(inc.centre - inc.radius - 1).astype(int) - offset, 0)
        hi = np.minimum(np.ceil(inc.centre + inc.radius + 2).astype(int) - offset, slab.shape)
        if (lo >= hi).any():
            continue
        box = tuple(slice(int(s), int(e)) for s, e in zip(lo, hi, strict=True))
        grid = np.ogrid[box]
        r2 = sum((g + o - c) ** 2 for g, o, c in zip(grid, offset, inc.centre, strict=True))
        ball = np.clip(inc.radius + 0.5 - np.sqrt(r2), 0, 1)
        slab[box] += (inc.amplitude * ball).astype(np.float32)


def _paint_streaks(slab: np.ndarray, z0: int, inclusions: list[_Inclusion]) -> None:
    """Straight streaks through a dense grain, in the slices it crosses (a reconstruction effect,
    so they are added after the blur)."""
    n_y, n_x = slab.shape[1:]
    for inc in inclusions:
        if not inc.streaks:
            continue
        cz, cy, cx = inc.centre
        first = max(int(np.ceil(cz - inc.radius)), z0)
        last = min(int(cz + inc.radius) + 1, z0 + slab.shape[0])
        for z in range(first, last):
            weight = 1 - abs(z - cz) / (inc.radius + 1)
            for angle, amplitude, length in inc.streaks:
                reach = int(2.5 * length)
                ys = slice(max(int(cy) - reach, 0), min(int(cy) + reach + 1, n_y))
                xs = slice(max(int(cx) - reach, 0), min(int(cx) + reach + 1, n_x))
                yy = np.arange(ys.start, ys.stop, dtype=np.float32)[:, None] - cy
                xx = np.arange(xs.start, xs.stop, dtype=np.float32)[None, :] - cx
                along = yy * np.cos(angle) + xx * np.sin(angle)
                across = -yy * np.sin(angle) + xx * np.cos(angle)
                slab[z - z0, ys, xs] += (weight * amplitude) * np.exp(
                    -0.5 * (across / 0.8) ** 2 - np.abs(along) / length
                )


def synthesize_realistic(shape: tuple[int, int, int], rng: np.random.Generator) -> DemoVolume:
    """One image/label pair with the hard parts of real scroll CT (see the module docstring)."""
    shape = tuple(int(s) for s in shape)  # type: ignore[assignment]
    axis = int(rng.integers(3))
    sheets, stretch, close = _stack(rng, shape, axis)
    ignore = _Field(rng, shape, 4)
    ignore_threshold = ignore.quantile(rng.uniform(*IGNORE_FRACTION))
    contrast = _Field(rng, shape, 5)
    contrast_level = rng.uniform(*CONTRAST)
    background = _Field(rng, shape, 3)
    background_level = rng.uniform(*BACKGROUND)
    direction = rng.standard_normal(3)
    direction *= rng.uniform(*DRIFT) / np.linalg.norm(direction)
    psf = rng.uniform(*PSF_SIGMA)
    noise_sigma = rng.uniform(*NOISE_SIGMA)
    rings = _rings(rng, shape[1:])
    inclusions = _inclusions(rng, shape)
    # White noise blurred in the slice loses variance; this puts its std back at noise_sigma.
    kernel = ndimage.gaussian_filter1d(np.eye(1, 31, 15, dtype=np.float64)[0], NOISE_CORRELATION)
    noise_gain = noise_sigma / float(np.sum(kernel**2))

    image = np.empty(shape, np.uint8)
    label = np.empty(shape, np.uint8)
    sheet_ids = np.zeros(shape, np.uint8)
    seen = np.zeros(256, bool)
    halo = int(4 * psf + 0.5)  # gaussian_filter's own reach with truncate=4
    ramps = [
        np.linspace(-0.5, 0.5, size, dtype=np.float32) * np.float32(direction[a])
        for a, size in enumerate(shape)
    ]
    for z0 in range(0, shape[0], SLAB):
        z1 = min(z0 + SLAB, shape[0])
        a, b = max(z0 - halo, 0), min(z1 + halo, shape[0])
        occupancy = np.zeros((b - a, *shape[1:]), np.float32)
        ids = np.zeros_like(occupancy, dtype=np.uint8)
        _paint_sheets(occupancy, ids, (a, b), axis, sheets, stretch)
        sheet_ids[z0:z1] = ids[z0 - a : z1 - a]
        seen |= np.bincount(sheet_ids[z0:z1].ravel(), minlength=256) > 0
        del ids

        level = contrast.rows(a, b)
        level *= CONTRAST_SPREAD
        level += 0.65
        np.clip(level, 0.08, 1.2, out=level)
        occupancy *= level
        occupancy *= np.float32(contrast_level)
        del level
        slab = occupancy  # the image, from here on
        slab += background_level
        bg = background.rows(a, b)
        bg *= 10.0
        slab += bg
        del bg
        slab += ramps[0][a:b, None, None] + ramps[1][None, :, None] + ramps[2][None, None, :]
        _paint_inclusions(slab, a, inclusions)
        ndimage.gaussian_filter(slab, psf, output=slab)
        core = slab[z0 - a : z1 - a]

        noise = rng.standard_normal(core.shape, dtype=np.float32)
        ndimage.gaussian_filter(noise, (0, NOISE_CORRELATION, NOISE_CORRELATION), output=noise)
        noise *= np.float32(noise_gain)
        core += noise
        del noise
        core += rings
        _paint_streaks(core, z0, inclusions)
        np.clip(core, 0, 255, out=core)
        np.rint(core, out=core)
        image[z0:z1] = core

        ignored = ignore.rows(z0, z1) < ignore_threshold
        label[z0:z1] = sheet_ids[z0:z1] > 0
        label[z0:z1][ignored] = 2

    # Sheets that miss the volume (the stack reaches past it) get no id; renumber the rest,
    # a slab at a time (a whole-volume bincount would cast 8 bytes per voxel).
    present = np.flatnonzero(seen[1:])
    lut = np.zeros(256, np.uint8)
    lut[present + 1] = np.arange(1, len(present) + 1)
    for z0 in range(0, shape[0], SLAB):
        sheet_ids[z0 : z0 + SLAB] = lut[sheet_ids[z0 : z0 + SLAB]]
    new = {int(k): i for i, k in enumerate(present)}
    touching = tuple((new[i], new[j]) for i, j in close if i in new and j in new)
    holes = tuple(sheets[int(k)].holes for k in present)
    return DemoVolume(image, label, sheet_ids, axis, touching, holes)
