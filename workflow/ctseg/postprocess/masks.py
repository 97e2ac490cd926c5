"""Probabilities to a binary mask: threshold or hysteresis, small components, holes, closing.

One function, `binary_mask`, turns a probability volume into the uint8 0/1 mask under a
`PostprocessSettings`; `ctseg.postprocess.write.write_mask` (the submitted masks) and
`ctseg.postprocess.tuning` (the search that chooses the settings) both call it, so the settings the
search scored are exactly the ones applied. The search builds its many masks through `MaskCache`,
which keeps each step's result so that candidates sharing their first steps build them once,
and gives the same masks bit for bit. Kept free of torch so that the search's worker processes
start quickly.

The steps, in the order `binary_mask` applies them (each off by default; with every new one off
the mask is the one this module always made):

* ``threshold``: a voxel is surface where prob > threshold.
* ``hysteresis_high``: when set (above ``threshold``), the mask keeps only the connected
  components of prob > threshold that contain at least one voxel with prob > hysteresis_high:
  weak surface attached to confident surface stays, weak blobs on their own go.
  ``hysteresis_mode`` says what "connected" means (`hysteresis`, `hysteresis_z`): ``3d``,
  26-connected in the volume; ``z``, 8-connected within each z-slice (the 8th place's
  "hysteresis along z"), so a weak piece of a slice needs a confident voxel in that slice.
* ``min_component_voxels``: drop 26-connected components with fewer voxels (cc3d.dust).
* ``fill_holes``: fill 3D cavities (scipy binary_fill_holes on the whole volume, after the
  component removal). Per volume, not per slice: a sheet crossing a slice is a curve there,
  and unbounded per-slice filling would fill the background enclosed between wraps.
* ``plug_holes_max_area``: hole plugging per slice along each axis (`plug_holes`): in every
  slice across z, y and x, fill the enclosed holes of the 2D mask of at most this many voxels.
  A tear in a sheet shows as such a hole in the slices that run along the sheet; the bound
  keeps the background between wraps (large in the slices that cross them) as it is.
* ``patch_holes_max_area``: patching of large holes (`patch_holes`): the same per-slice holes up
  to this larger size, but only those lying inside a sheet that runs along the slice: at least
  `PATCH_MIN_FOREGROUND` of the ring `PATCH_RING` voxels wide around the hole in its slice is
  mask. The background between two sheets that cross the slice is bounded by thin curves, so its
  ring is mostly background and it stays.
* ``closing_radius``: morphological closing (`close`): dilation then erosion by a cube of side
  2r + 1. It fills gaps of up to 2r voxels (r = 1: cracks of 1-2 voxels) and never removes a
  voxel; it also joins sheets that run within 2r voxels of each other, which is what the search
  weighs. A cube, not a Euclidean ball: a ball cannot close a crack in a sheet one or two voxels
  thick (the crack is wider than the sheet is thick), a cube can.

Order: the 1st place's (small components, hole plugging, large holes, closing), the 3D cavity
fill where it always was, after the component removal. 26-connectivity for 3D components
throughout, the connectivity of the competition's VOI term; in a 2D slice the mask is
8-connected and its holes 4-connected, the pair that makes a diagonal step of a sheet close.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import cc3d
import numpy as np
from scipy import ndimage

from ctseg.io import CtsegError

# The keys every settings mapping (tuned.json) has; those after them were added later and may be
# absent from an older file, where their defaults (off) are what it was scored with.
REQUIRED_KEYS = ("threshold", "hysteresis_high", "min_component_voxels", "fill_holes")
SETTING_KEYS = (
    *REQUIRED_KEYS,
    "hysteresis_mode",
    "plug_holes_max_area",
    "patch_holes_max_area",
    "closing_radius",
)
HYSTERESIS_MODES = ("3d", "z")
CLOSING_RADII = (0, 1, 2)
PATCH_RING = 3  # voxels: the width of the ring `patch_holes` looks at around a hole
PATCH_MIN_FOREGROUND = 0.9  # the part of that ring that must be mask


@dataclass(frozen=True)
class PostprocessSettings:
    threshold: float = 0.5
    hysteresis_high: float | None = None
    min_component_voxels: int = 0
    fill_holes: bool = False
    hysteresis_mode: str = "3d"
    plug_holes_max_area: int = 0
    patch_holes_max_area: int = 0
    closing_radius: int = 0

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def whole_volume(self) -> bool:
        """Whether the mask needs the whole volume at once (anything beyond a threshold)."""
        return (
            self.hysteresis_high is not None
            or self.min_component_voxels > 0
            or self.fill_holes
            or self.plug_holes_max_area > 0
            or self.patch_holes_max_area > 0
            or self.closing_radius > 0
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        """A short description for tables and logs, e.g. `t>0.35 hyst 0.55 min 64 fill`, or
        `t>0.5 hyst-z 0.9 plug 64 patch 1024 close 1`."""
        parts = [f"t>{self.threshold:g}"]
        if self.hysteresis_high is not None:
            mode = "" if self.hysteresis_mode == "3d" else f"-{self.hysteresis_mode}"
            parts.append(f"hyst{mode} {self.hysteresis_high:g}")
        if self.min_component_voxels:
            parts.append(f"min {self.min_component_voxels}")
        if self.fill_holes:
            parts.append("fill")
        if self.plug_holes_max_area:
            parts.append(f"plug {self.plug_holes_max_area}")
        if self.patch_holes_max_area:
            parts.append(f"patch {self.patch_holes_max_area}")
        if self.closing_radius:
            parts.append(f"close {self.closing_radius}")
        return " ".join(parts)


def check_settings(s: PostprocessSettings) -> None:
    if isinstance(s.threshold, bool) or not 0 <= s.threshold < 1:
        raise CtsegError(f"threshold={s.threshold!r}: expected 0 <= threshold < 1")
    if s.hysteresis_high is not None and not s.threshold < s.hysteresis_high < 1:
        raise CtsegError(
            f"hysteresis_high={s.hysteresis_high!r}: expected threshold ({s.threshold}) < "
            "hysteresis_high < 1, or null"
        )
    if (
        isinstance(s.min_component_voxels, bool)
        or not isinstance(s.min_component_voxels, int)
        or s.min_component_voxels < 0
    ):
        raise CtsegError(f"min_component_voxels={s.min_component_voxels!r}: expected >= 0")
    if not isinstance(s.fill_holes, bool):
        raise CtsegError(f"fill_holes={s.fill_holes!r}: expected true or false")
    if s.hysteresis_mode not in HYSTERESIS_MODES:
        raise CtsegError(
            f"hysteresis_mode={s.hysteresis_mode!r}: expected one of {list(HYSTERESIS_MODES)}"
        )
    if s.hysteresis_mode != "3d" and s.hysteresis_high is None:
        # Refused rather than ignored, so that two candidates of a search never differ only in
        # a setting that does nothing.
        raise CtsegError(f"hysteresis_mode={s.hysteresis_mode!r} needs hysteresis_high")
    for name in ("plug_holes_max_area", "patch_holes_max_area"):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CtsegError(f"{name}={value!r}: expected an integer >= 0 (0: off)")
    if isinstance(s.closing_radius, bool) or s.closing_radius not in CLOSING_RADII:
        raise CtsegError(
            f"closing_radius={s.closing_radius!r}: expected one of {list(CLOSING_RADII)} (0: off)"
        )


def settings_from_mapping(values: dict[str, Any], source: str) -> PostprocessSettings:
    """Settings from a dict such as tuned.json's "settings"; unknown keys, or a missing one of
    `REQUIRED_KEYS`, are an error naming `source` (the later keys default to off)."""
    if not isinstance(values, dict):
        raise CtsegError(f"{source}: expected a mapping of post-processing settings")
    unknown = sorted(set(values) - set(SETTING_KEYS))
    missing = sorted(set(REQUIRED_KEYS) - set(values))
    if unknown or missing:
        raise CtsegError(
            f"{source}: post-processing settings need {list(REQUIRED_KEYS)} and may have "
            f"{list(SETTING_KEYS[len(REQUIRED_KEYS) :])} (unknown {unknown}, missing {missing})"
        )
    high = values["hysteresis_high"]
    later = {k: values[k] for k in SETTING_KEYS[len(REQUIRED_KEYS) :] if k in values}
    try:
        return PostprocessSettings(
            threshold=float(values["threshold"]),
            hysteresis_high=None if high is None else float(high),
            min_component_voxels=values["min_component_voxels"],
            fill_holes=values["fill_holes"],
            **later,
        )
    except (TypeError, ValueError) as exc:
        raise CtsegError(f"{source}: bad post-processing settings: {exc}") from exc
    except CtsegError as exc:
        raise CtsegError(f"{source}: {exc}") from exc


def _keep_seeded(labels: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """uint8 mask of the labelled components (label > 0) that contain a seed voxel."""
    keep = np.zeros(int(labels.max()) + 1, np.uint8)
    keep[np.unique(labels[seeds])] = 1
    keep[0] = 0  # background: never a component, even when a seed lies outside every one
    return keep[labels]


def hysteresis(probs: np.ndarray, low: float, high: float) -> np.ndarray:
    """uint8 mask of the 26-connected components of probs > low that reach probs > high."""
    labels = cc3d.connected_components(probs > low, connectivity=26)
    return _keep_seeded(labels, probs > high)


# 8-connected within a z-slice, nothing across slices: one labelling call does every slice.
_Z_SLICE_8 = np.zeros((3, 3, 3), bool)
_Z_SLICE_8[1] = True


def hysteresis_z(probs: np.ndarray, low: float, high: float) -> np.ndarray:
    """Hysteresis along z: uint8 mask of the voxels with probs > low whose 8-connected
    component *within their own z-slice* (axis 0) contains a voxel with probs > high.

    Each z-slice is thresholded on its own, as a 2D image: a weak region is kept in slice k only
    if it reaches the high threshold in slice k, whatever it touches in slices k - 1 and k + 1.
    The result is therefore never more than `hysteresis`'s (a 2D component lies inside the 3D
    component of its voxels), and it is less exactly where weak surface hangs on confident
    surface only through other slices."""
    labels, _ = ndimage.label(probs > low, structure=_Z_SLICE_8)
    return _keep_seeded(labels, probs > high)


def slice_holes(plane: np.ndarray, max_area: int) -> np.ndarray:
    """Labels of the holes of a 2D mask with at most `max_area` pixels (0 elsewhere). A hole is
    a 4-connected component of the background that does not touch the border."""
    labels, count = cc3d.connected_components(plane == 0, connectivity=4, return_N=True)
    if count == 0:
        return labels
    small = np.bincount(labels.ravel(), minlength=count + 1) <= max_area
    small[0] = False
    for edge in (labels[0], labels[-1], labels[:, 0], labels[:, -1]):
        small[edge] = False
    return np.where(small[labels], labels, 0)


def _slices(mask: np.ndarray, out: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every slice across z, then y, then x: (the slice of `mask`, a view of the same slice of
    `out` to write into). Slice by slice, so that one 2D slice's labels are all that is held
    beside the volume."""
    for axis in range(3):
        source, target = np.moveaxis(mask, axis, 0), np.moveaxis(out, axis, 0)
        for k in range(source.shape[0]):
            yield np.ascontiguousarray(source[k]), target[k]


def plug_holes(mask: np.ndarray, max_area: int) -> np.ndarray:
    """Hole plugging per slice along each axis: uint8 mask with every enclosed 2D hole of at
    most `max_area` voxels filled, in every slice across z, y and x. The three axes are done on
    the same input and united, so the order does not matter. A hole touching the volume's
    border is not enclosed and stays."""
    mask = np.asarray(mask)
    if max_area <= 0:
        return mask.astype(bool).view(np.uint8)
    out = mask.astype(bool)
    for plane, target in _slices(mask, out):
        target |= slice_holes(plane, max_area) > 0
    return out.view(np.uint8)


def patched_pixels(
    plane: np.ndarray,
    max_area: int,
    ring: int = PATCH_RING,
    min_foreground: float = PATCH_MIN_FOREGROUND,
) -> np.ndarray:
    """bool: the pixels `patch_holes` adds to one 2D slice: its holes of at most `max_area`
    pixels at least `min_foreground` of whose ring, `ring` pixels wide, is mask. Where two holes'
    rings overlap, a pixel counts for the one with the larger label (grey dilation of the
    labels): an approximation only where holes lie within 2 * ring pixels of each other."""
    holes = slice_holes(plane, max_area)
    if not holes.any():
        return np.zeros(plane.shape, bool)
    around = ndimage.grey_dilation(holes, size=2 * ring + 1, mode="constant", cval=0)
    ring_pixels = (around > 0) & (holes == 0)
    count = int(holes.max()) + 1
    total = np.bincount(around[ring_pixels], minlength=count)
    solid = np.bincount(around[ring_pixels & (plane > 0)], minlength=count)
    inside = solid >= min_foreground * np.maximum(total, 1)
    inside[0] = False
    return inside[holes]


def patch_holes(
    mask: np.ndarray,
    max_area: int,
    ring: int = PATCH_RING,
    min_foreground: float = PATCH_MIN_FOREGROUND,
) -> np.ndarray:
    """Patching of large holes: like `plug_holes` up to `max_area` voxels, but a hole is filled
    only when at least `min_foreground` of the pixels within `ring` of it in its slice (a
    square neighbourhood, the hole itself left out) are mask: the hole is a tear in a sheet
    that runs along the slice (`patched_pixels`, slice by slice along each axis)."""
    mask = np.asarray(mask)
    if max_area <= 0:
        return mask.astype(bool).view(np.uint8)
    out = mask.astype(bool)
    for plane, target in _slices(mask, out):
        target |= patched_pixels(plane, max_area, ring, min_foreground)
    return out.view(np.uint8)


def close(mask: np.ndarray, radius: int) -> np.ndarray:
    """Morphological closing by a cube of side 2 * radius + 1: uint8 mask. The volume is taken
    to go on past its faces as its face voxels do (edge padding by `radius`, then both filters
    in `nearest` mode, which is then exact within the padding): a sheet that leaves the volume
    is not trimmed at the face, a mask that stops short of a face is not stretched out to it
    (treating the outside as mask would do that), and the result contains every voxel of
    `mask`."""
    mask = np.asarray(mask, dtype=np.uint8)
    if radius <= 0:
        return mask.copy()
    size = 2 * radius + 1
    padded = np.pad(mask, radius, mode="edge")
    grown = ndimage.maximum_filter(padded, size=size, mode="nearest")
    closed = ndimage.minimum_filter(grown, size=size, mode="nearest")
    inner = tuple(slice(radius, radius + n) for n in mask.shape)
    return np.ascontiguousarray(closed[inner])


# The steps of `binary_mask`, in the order it applies them, with the settings each reads. A step
# whose settings are at their defaults is off: it leaves the mask as it is.
MASK_STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("binarise", ("threshold", "hysteresis_high", "hysteresis_mode")),
    ("min_component", ("min_component_voxels",)),
    ("fill_holes", ("fill_holes",)),
    ("plug_holes", ("plug_holes_max_area",)),
    ("patch_holes", ("patch_holes_max_area",)),
    ("closing", ("closing_radius",)),
)
_OFF = PostprocessSettings()


def step_prefix(settings: PostprocessSettings, step: int) -> PostprocessSettings:
    """`settings` with every step after `step` off: the settings whose whole mask is the mask
    `settings` has after `step`. Two settings with the same prefix share that mask."""
    later = {f: getattr(_OFF, f) for _, fields in MASK_STEPS[step + 1 :] for f in fields}
    return replace(settings, **later)


def _apply_step(
    step: int, settings: PostprocessSettings, probs: np.ndarray, mask: np.ndarray | None
) -> np.ndarray:
    """The uint8 0/1 mask after `step`, from the mask after the step before (`mask`, left as it
    is) or, for the first, from the probabilities."""
    if step == 0:
        if settings.hysteresis_high is None:
            return np.ascontiguousarray((probs > settings.threshold).view(np.uint8))
        keep = hysteresis_z if settings.hysteresis_mode == "z" else hysteresis
        return np.ascontiguousarray(keep(probs, settings.threshold, settings.hysteresis_high))
    assert mask is not None
    if step == 1:
        out = np.array(mask, dtype=np.uint8, order="C")  # a copy: dust works in place
        cc3d.dust(out, threshold=settings.min_component_voxels, connectivity=26, in_place=True)
        return out
    if step == 2:
        return ndimage.binary_fill_holes(mask).view(np.uint8)
    if step == 3:
        return np.ascontiguousarray(plug_holes(mask, settings.plug_holes_max_area))
    if step == 4:
        return np.ascontiguousarray(patch_holes(mask, settings.patch_holes_max_area))
    return np.ascontiguousarray(close(mask, settings.closing_radius))


def _is_on(settings: PostprocessSettings, step: int) -> bool:
    return step == 0 or step_prefix(settings, step) != step_prefix(settings, step - 1)


def binary_mask(probs: np.ndarray, settings: PostprocessSettings) -> tuple[np.ndarray, dict]:
    """The uint8 0/1 mask of a whole probability volume, and counts of what each step did."""
    probs = np.asarray(probs)
    mask = None
    sizes = []  # foreground voxels after each step
    for step in range(len(MASK_STEPS)):
        if _is_on(settings, step):
            mask = _apply_step(step, settings, probs, mask)
        sizes.append(int(np.count_nonzero(mask)))
    assert mask is not None
    plain = sizes[0]
    if settings.hysteresis_high is not None:
        plain = int(np.count_nonzero(probs > settings.threshold))
    return mask, {
        "foreground_voxels": sizes[-1],
        "hysteresis_dropped_voxels": plain - sizes[0],
        "removed_voxels": sizes[0] - sizes[1],
        "filled_voxels": sizes[2] - sizes[1],
        "plugged_voxels": sizes[3] - sizes[2],
        "patched_voxels": sizes[4] - sizes[3],
        "closed_voxels": sizes[5] - sizes[4],
    }


class MaskCache:
    """The masks of one probability volume under many settings, each step's result kept
    (bit-packed, 1 bit a voxel): settings that share their first steps build them once.

    A search's candidates are the best settings so far with one step changed, so each stage's
    candidates share every step before theirs (`step_prefix`), and the best's whole mask is the
    next stage's base: a closing candidate costs a closing, not the hysteresis, component
    removal, cavity fill, plugging and patching under it again. Each mask is `binary_mask`'s,
    bit for bit: the same steps (`_apply_step`) on the same input, a cached step's result
    unpacked exactly as it was packed."""

    def __init__(self, probs: np.ndarray) -> None:
        self.probs = np.asarray(probs)
        self._packed: dict[PostprocessSettings, np.ndarray] = {}
        self.steps_run = 0  # steps computed, not read from the cache (for tests and benches)

    def _unpack(self, key: PostprocessSettings) -> np.ndarray:
        count = int(np.prod(self.probs.shape))
        return np.unpackbits(self._packed[key], count=count).reshape(self.probs.shape)

    def mask(self, settings: PostprocessSettings) -> np.ndarray:
        """The uint8 0/1 mask `binary_mask(probs, settings)` gives."""
        prefixes = [step_prefix(settings, step) for step in range(len(MASK_STEPS))]
        start, mask = 0, None
        for step in reversed(range(len(MASK_STEPS))):
            if prefixes[step] in self._packed:
                start, mask = step + 1, self._unpack(prefixes[step])
                break
        for step in range(start, len(MASK_STEPS)):
            if not _is_on(settings, step):
                continue
            mask = _apply_step(step, settings, self.probs, mask)
            self._packed[prefixes[step]] = np.packbits(mask)
            self.steps_run += 1
        assert mask is not None
        return mask
