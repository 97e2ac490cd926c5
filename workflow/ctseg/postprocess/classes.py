"""A multi-class model's label map, post-processed class by class.

A multi-class store holds one softmax channel per class, background first (stored values 0..K,
`ctseg.postprocess.write`). Its plain label map is the argmax over the channels. Each foreground
class c may have its own `PostprocessSettings`, the binary ones, applied to the class's
probability *where it wins the argmax* and 0 elsewhere (`class_probability`):

* a class's voxels at threshold t are those where c wins the argmax and its probability is
  above t. At t = 0 (`ARGMAX`, every class's default) they are exactly the argmax's voxels of c,
  since a winning channel's probability is at least 1/(K+1);
* hysteresis, the component filter, hole filling, plugging, patching and closing then act on that
  mask as they do on a binary model's (`ctseg.postprocess.masks.binary_mask`, or
  `ctseg.postprocess.blockwise.blockwise_mask` block by block, the same bits).

The classes' masks are then joined into one label map (`join`): a voxel no class claims is
background; one claimed by several classes (a hole filled or a closing grown into a neighbour)
goes to the claimant of highest probability, the earlier class on a tie, as the argmax breaks
ties. A class's own argmax voxels therefore stay its own unless it drops them. With every
class at `ARGMAX` the label map is the argmax's, bit for bit.

`ClassSettings` holds one setting per class in the classes' order; tuned.json of a multi-class
run holds them (`ctseg.postprocess.tuning`), each class searched on its own against its own
label, as a binary model's settings are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctseg.io import CtsegError
from ctseg.labels import LabelSpec
from ctseg.postprocess.blockwise import SCRATCH_MIN_CHUNK, blockwise_mask, post_block
from ctseg.postprocess.masks import PostprocessSettings, binary_mask, settings_from_mapping
from ctseg.store import create_volume

# A class's default: its voxels are the argmax's (the threshold 0 of its argmax probability).
ARGMAX = PostprocessSettings(threshold=0.0)


@dataclass(frozen=True)
class ClassSettings:
    """The post-processing of each foreground class of a label map, in the classes' order
    (`LabelSpec.classes`: channel c is the c-th class)."""

    classes: tuple[tuple[str, PostprocessSettings], ...]

    @classmethod
    def argmax(cls, labels: LabelSpec) -> ClassSettings:
        return cls(tuple((name, ARGMAX) for name in labels.classes))

    @classmethod
    def from_mapping(cls, values: Any, source: str) -> ClassSettings:
        """From ``{"classes": {name: settings, ...}}`` (tuned.json's "settings" of a
        multi-class run); a bad entry is an error naming `source`."""
        classes = values.get("classes") if isinstance(values, dict) else None
        if not isinstance(classes, dict) or not classes or set(values) != {"classes"}:
            raise CtsegError(f'{source}: expected {{"classes": {{<class>: <settings>, ...}}}}')
        return cls(
            tuple(
                (str(name), settings_from_mapping(s, f"{source}, class {name!r}"))
                for name, s in classes.items()
            )
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.classes)

    @property
    def is_argmax(self) -> bool:
        return all(s == ARGMAX for _, s in self.classes)

    @property
    def whole_volume(self) -> bool:
        """Whether a class's mask needs more than its own voxel (anything beyond a threshold)."""
        return any(s.whole_volume for _, s in self.classes)

    def as_dict(self) -> dict[str, Any]:
        return {"classes": {name: s.as_dict() for name, s in self.classes}}

    def label(self) -> str:
        """`argmax`, or each class that differs from it: `vessel: t>0 min 64; nerve: t>0.6`."""
        if self.is_argmax:
            return "argmax"
        return "; ".join(f"{name}: {s.label()}" for name, s in self.classes if s != ARGMAX)


MaskSettings = PostprocessSettings | ClassSettings


def label_map_settings(
    settings: MaskSettings, labels: LabelSpec, where: str | Path
) -> ClassSettings:
    """The per-class settings a multi-class store (or run), `where`, applies: the argmax for
    the binary defaults (no setting given), `settings` itself when it names the store's classes
    in their order; other binary settings, or other classes, are a one-line error."""
    if isinstance(settings, PostprocessSettings):
        if settings == PostprocessSettings():
            return ClassSettings.argmax(labels)
        raise CtsegError(
            f"{where}: multi-class probabilities, whose mask is a label map; the binary "
            f"post-processing {settings.label()} does not apply to it: drop the threshold and "
            "mask options, or give the per-class settings of a multi-class tuned.json"
        )
    if settings.names != labels.classes:
        raise CtsegError(
            f"{where}: per-class settings for the classes {list(settings.names)}, but its "
            f"classes are {list(labels.classes)}: tune the settings on this run's probabilities"
        )
    return settings


def binary_settings(settings: MaskSettings, where: str | Path) -> PostprocessSettings:
    """The settings a binary store, `where`, applies; per-class ones are a one-line error."""
    if isinstance(settings, ClassSettings):
        raise CtsegError(
            f"{where}: binary probabilities, but per-class settings for {list(settings.names)} "
            "were given: use the settings tuned on this run's (binary) probabilities"
        )
    return settings


def check_mask_settings(
    settings: MaskSettings, labels: LabelSpec, where: str | Path
) -> MaskSettings:
    """The settings a store of `labels` applies (`binary_settings`, `label_map_settings`):
    refused, before any long step, where the store would refuse them."""
    if labels.is_binary:
        return binary_settings(settings, where)
    return label_map_settings(settings, labels, where)


def mask_block(
    chunks: Sequence[int], shape: Sequence[int], settings: MaskSettings, budget: int
) -> tuple[int, int, int]:
    """`post_block` of the settings, or of a label map the block of the class that needs the
    most (the smallest along each axis: every class's block is whole chunks doubled)."""
    if isinstance(settings, PostprocessSettings):
        return post_block(chunks, shape, settings, budget)
    blocks = [post_block(chunks, shape, s, budget) for _, s in settings.classes]
    return (min(b[0] for b in blocks), min(b[1] for b in blocks), min(b[2] for b in blocks))


# ----------------------------------------------------------------------------- the maps
def class_probability(probs: np.ndarray, channel: int) -> np.ndarray:
    """Channel `channel`'s probability where it wins the argmax over `probs` (C, ...), 0
    elsewhere, in the store's dtype."""
    probs = np.asarray(probs)
    wins = np.argmax(probs, axis=0) == channel
    return np.where(wins, probs[channel], np.zeros((), probs.dtype))


def join(probs: np.ndarray, masks: Sequence[np.ndarray]) -> np.ndarray:
    """The stored label map (uint8 0..K) of the classes' masks (`masks[c - 1]` for class c):
    each voxel to the claimant of highest probability, the earlier on a tie; 0 unclaimed."""
    probs = np.asarray(probs)
    out = np.zeros(probs.shape[1:], np.uint8)
    best = np.full(probs.shape[1:], -np.inf, np.float32)
    for channel, mask in enumerate(masks, start=1):
        p = probs[channel].astype(np.float32)
        take = np.asarray(mask, bool) & (p > best)
        out[take] = channel
        best[take] = p[take]
    return out


def _pointwise_masks(probs: np.ndarray, settings: ClassSettings) -> list[np.ndarray]:
    """Each class's `class_probability` above its threshold (t >= 0: where it wins and is
    above t), the argmax taken once."""
    probs = np.asarray(probs)
    winner = np.argmax(probs, axis=0)
    return [
        (winner == c) & (probs[c] > s.threshold) for c, (_, s) in enumerate(settings.classes, 1)
    ]


def pointwise_label_map(probs: np.ndarray, settings: ClassSettings) -> np.ndarray:
    """The stored label map of a block of class probabilities under settings that are each a
    threshold alone (`ClassSettings.whole_volume` false)."""
    return join(probs, _pointwise_masks(probs, settings))


def class_label_map(
    probs: np.ndarray, settings: ClassSettings
) -> tuple[np.ndarray, dict[str, dict[str, int]]]:
    """The stored label map of whole class probabilities (C, Z, Y, X) under `settings`, and
    the step counts (`binary_mask`'s) of each class whose settings go beyond a threshold."""
    masks, steps = [], {}
    for channel, (name, s) in enumerate(settings.classes, start=1):
        mask, counts = binary_mask(class_probability(probs, channel), s)
        masks.append(mask)
        if s.whole_volume:
            steps[name] = counts
    return join(probs, masks), steps


class _ClassView:
    """Channel `channel`'s `class_probability` of a (C, Z, Y, X) array-like, read a block at a
    time, as `blockwise_mask` reads a binary store."""

    def __init__(self, probs: Any, channel: int) -> None:
        self.probs, self.channel = probs, channel
        self.shape = tuple(int(n) for n in probs.shape[1:])

    def __getitem__(self, box: tuple[slice, ...]) -> np.ndarray:
        return class_probability(np.asarray(self.probs[(slice(None), *box)]), self.channel)


def blockwise_class_masks(
    probs: Any, settings: ClassSettings, block: tuple[int, int, int], scratch: Path
) -> tuple[dict[int, Any], dict[str, dict[str, int]]]:
    """The mask of each class whose settings need more than its voxel, written block by block
    (`blockwise_mask`: the same bits as `class_label_map`'s) to a uint8 array in `scratch`
    (by channel), and their step counts; the other classes are thresholded as they are read."""
    shape = tuple(int(n) for n in probs.shape[1:])
    chunks = tuple(max(b, SCRATCH_MIN_CHUNK) for b in block)
    masks, steps = {}, {}
    for channel, (name, s) in enumerate(settings.classes, start=1):
        if not s.whole_volume:
            continue
        target = create_volume(scratch / f"class{channel}.zarr", shape, np.uint8, chunks)
        view = _ClassView(probs, channel)
        steps[name] = blockwise_mask(view, target, s, block, scratch / f"class{channel}")
        masks[channel] = target
    return masks, steps


def join_block(
    probs: np.ndarray, settings: ClassSettings, masks: dict[int, Any], box: tuple[slice, ...]
) -> np.ndarray:
    """The stored label map of one block (`probs`: its class probabilities, `box`: where it
    lies) from the classes' masks written by `blockwise_class_masks` and the thresholds of
    the rest."""
    pointwise = _pointwise_masks(probs, settings)
    chosen = [
        np.asarray(masks[c][box]) if c in masks else pointwise[c - 1]
        for c in range(1, len(settings.classes) + 1)
    ]
    return join(probs, chosen)
