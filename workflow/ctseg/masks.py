"""Probabilities to a binary mask: threshold or hysteresis, small components, holes.

One function, `binary_mask`, turns a probability volume into the uint8 0/1 mask under a
`PostprocessSettings`; `ctseg.infer.postprocess` (the submitted masks) and `ctseg.tuning` (the
search that chooses the settings) both call it, so the settings the search scored are exactly
the ones applied. Kept free of torch so that the search's worker processes start quickly.

* ``threshold``: a voxel is surface where prob > threshold.
* ``hysteresis_high``: when set (above ``threshold``), the mask keeps only the 26-connected
  components of prob > threshold that contain at least one voxel with prob > hysteresis_high:
  weak surface attached to confident surface stays, weak blobs on their own go.
* ``min_component_voxels``: drop 26-connected components with fewer voxels (cc3d.dust).
* ``fill_holes``: fill 3D cavities (scipy binary_fill_holes on the whole volume, after the
  component removal). Per volume, not per slice: a sheet crossing a slice is a curve there,
  and per-slice filling would fill the background enclosed between wraps of the scroll.

26-connectivity throughout, the connectivity of the competition's VOI term.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import cc3d
import numpy as np
from scipy import ndimage

from ctseg.io import CtsegError

SETTING_KEYS = ("threshold", "hysteresis_high", "min_component_voxels", "fill_holes")


@dataclass(frozen=True)
class PostprocessSettings:
    threshold: float = 0.5
    hysteresis_high: float | None = None
    min_component_voxels: int = 0
    fill_holes: bool = False

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def whole_volume(self) -> bool:
        """Whether the mask needs the whole volume at once (anything beyond a threshold)."""
        return self.hysteresis_high is not None or self.min_component_voxels > 0 or self.fill_holes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        """A short description for tables and logs, e.g. `t>0.35 hyst 0.55 min 64 fill`."""
        parts = [f"t>{self.threshold:g}"]
        if self.hysteresis_high is not None:
            parts.append(f"hyst {self.hysteresis_high:g}")
        if self.min_component_voxels:
            parts.append(f"min {self.min_component_voxels}")
        if self.fill_holes:
            parts.append("fill")
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


def settings_from_mapping(values: dict[str, Any], source: str) -> PostprocessSettings:
    """Settings from a dict such as tuned.json's "settings"; unknown or missing keys are an
    error naming `source`."""
    if not isinstance(values, dict):
        raise CtsegError(f"{source}: expected a mapping of post-processing settings")
    unknown = sorted(set(values) - set(SETTING_KEYS))
    missing = sorted(set(SETTING_KEYS) - set(values))
    if unknown or missing:
        raise CtsegError(
            f"{source}: post-processing settings need exactly {list(SETTING_KEYS)} "
            f"(unknown {unknown}, missing {missing})"
        )
    high = values["hysteresis_high"]
    try:
        return PostprocessSettings(
            threshold=float(values["threshold"]),
            hysteresis_high=None if high is None else float(high),
            min_component_voxels=values["min_component_voxels"],
            fill_holes=values["fill_holes"],
        )
    except (TypeError, ValueError) as exc:
        raise CtsegError(f"{source}: bad post-processing settings: {exc}") from exc
    except CtsegError as exc:
        raise CtsegError(f"{source}: {exc}") from exc


def hysteresis(probs: np.ndarray, low: float, high: float) -> np.ndarray:
    """uint8 mask of the 26-connected components of probs > low that reach probs > high."""
    labels = cc3d.connected_components(probs > low, connectivity=26)
    seeds = np.unique(labels[probs > high])
    keep = np.zeros(int(labels.max()) + 1, np.uint8)
    keep[seeds] = 1
    keep[0] = 0  # background: never a component, even when probs > high cannot reach it
    return keep[labels]


def binary_mask(probs: np.ndarray, settings: PostprocessSettings) -> tuple[np.ndarray, dict]:
    """The uint8 0/1 mask of a whole probability volume, and counts of what each step did."""
    if settings.hysteresis_high is None:
        mask = (np.asarray(probs) > settings.threshold).view(np.uint8)
        dropped_weak = 0
    else:
        plain = int(np.count_nonzero(np.asarray(probs) > settings.threshold))
        mask = hysteresis(np.asarray(probs), settings.threshold, settings.hysteresis_high)
        dropped_weak = plain - int(np.count_nonzero(mask))
    mask = np.ascontiguousarray(mask)
    before = int(np.count_nonzero(mask))
    if settings.min_component_voxels > 0:
        cc3d.dust(mask, threshold=settings.min_component_voxels, connectivity=26, in_place=True)
    after_dust = int(np.count_nonzero(mask))
    if settings.fill_holes:
        mask = ndimage.binary_fill_holes(mask).view(np.uint8)
    foreground = int(np.count_nonzero(mask))
    return mask, {
        "foreground_voxels": foreground,
        "hysteresis_dropped_voxels": dropped_weak,
        "removed_voxels": before - after_dust,
        "filled_voxels": foreground - after_dust,
    }
