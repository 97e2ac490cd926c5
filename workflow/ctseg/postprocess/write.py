"""A probability store to the submitted mask: the uint8 (0/1) multi-page TIFF of the Kaggle
submission layout, one page per z-slice, under one `ctseg.postprocess.masks.PostprocessSettings`
(`write_mask`; `ctseg postprocess`, `ctseg infer --mask` and `ctseg predict` all write with it).

Memory: a plain threshold is applied slab by slab (a z-chunk of the store at a time) and the mask
streamed page by page into the TIFF. Hysteresis, ``min_component_voxels`` (cc3d,
26-connectivity), hole filling, plugging, patching and closing need the whole volume
(`ctseg.postprocess.masks.binary_mask`, the function the tuning search scores with): then this
step holds the float16 probabilities, a uint8 mask and cc3d's 4-byte labels (about 8 bytes a
voxel, plus scipy's temporaries of the mask's size for hole filling).

Multi-class stores
------------------
A multi-class model's store (`ctseg.inference.run.infer_volume`) holds one softmax channel
per class, background first: shape (C, Z, Y, X), attributes ``classes`` (the channels' names)
and ``labels`` (the dataset's `ctseg.labels.LabelSpec`, as `LabelSpec.to_dict`). Its mask is a
label map: the stored values 0..K, mapped to the dataset's own values with
`LabelSpec.from_stored`. With no settings given it is the argmax over the channels (a tie goes to
the earlier channel); per-class settings (`ctseg.postprocess.classes.ClassSettings`, a
multi-class tuned.json's) post-process each class's voxels. A label map whose classes are each
thresholded alone is written slab by slab like a thresholded mask; any other setting holds the
whole store (`ctseg.postprocess.classes.class_label_map`). Binary settings other than the
defaults are refused for a multi-class store, and per-class settings for a binary one
(`ctseg.postprocess.classes.label_map_settings`, `binary_settings`), rather than ignored.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
import zarr

from ctseg.io import CtsegError, atomic_path
from ctseg.labels import BACKGROUND, LabelSpec
from ctseg.postprocess.classes import (
    ClassSettings,
    MaskSettings,
    binary_settings,
    class_label_map,
    label_map_settings,
    pointwise_label_map,
)
from ctseg.postprocess.masks import binary_mask
from ctseg.store import open_volume

# The attributes of a multi-class probability store: the channels' names (background first) and
# the dataset's label spec.
CLASSES_ATTRIBUTE = "classes"
LABELS_ATTRIBUTE = "labels"
MULTICLASS_VALUE = "class probabilities (softmax)"


def open_checked(path: Path, what: str, channels: bool = False) -> zarr.Array:
    """A non-empty 3D Zarr array (`what`: "probability store", or the image store inference
    reads), or with `channels` also a 4D one (C, Z, Y, X); a missing, unreadable, not 3D (4D)
    or empty one is a one-line error naming it."""
    if not Path(path).exists():
        raise CtsegError(f"{path}: {what} not found")
    try:
        arr = open_volume(path)
    except Exception as exc:
        raise CtsegError(f"{path}: cannot open {what} as a Zarr array: {exc}") from exc
    if arr.ndim != 3 and not (channels and arr.ndim == 4):
        raise CtsegError(f"{path}: expected a 3D volume, got shape {tuple(arr.shape)}")
    if 0 in arr.shape:
        raise CtsegError(f"{path}: empty volume of shape {tuple(arr.shape)}")
    return arr


# ----------------------------------------------------------------------------- classes
def channel_names(labels: LabelSpec) -> list[str]:
    """The names of a multi-class model's channels: background, then the classes in the order
    of their values (the stored values 0..K)."""
    return [BACKGROUND, *labels.classes]


def store_labels(probs: zarr.Array, path: Path) -> LabelSpec:
    """The label spec a multi-class probability store records, checked against its channels
    and their names; a missing or inconsistent one is a one-line error naming the store."""
    attrs = dict(probs.attrs)
    data = attrs.get(LABELS_ATTRIBUTE)
    if not isinstance(data, dict):
        raise CtsegError(
            f"{path}: a {probs.ndim}D store of shape {tuple(probs.shape)} without the "
            f"{LABELS_ATTRIBUTE!r} attribute: not a multi-class probability store of ctseg infer"
        )
    try:
        spec = LabelSpec.from_dict(data, source=str(path))
    except CtsegError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CtsegError(f"{path}: unreadable {LABELS_ATTRIBUTE!r} attribute: {exc!r}") from exc
    names = channel_names(spec)
    if spec.is_binary or len(names) != probs.shape[0] or attrs.get(CLASSES_ATTRIBUTE) != names:
        raise CtsegError(
            f"{path}: {probs.shape[0]} channels named {attrs.get(CLASSES_ATTRIBUTE)} do not "
            f"match its labels ({spec.describe()}: channels {names}); write the store again "
            "with ctseg infer"
        )
    return spec


def _from_stored(stored: np.ndarray, labels: LabelSpec) -> np.ndarray:
    return np.asarray(labels.from_stored(stored), dtype=np.uint8)


def write_mask(
    prob_store: Path,
    out_tif: Path,
    settings: MaskSettings,
    description: str | None = None,
) -> dict[str, Any]:
    """The mask of `prob_store` under `settings`, written atomically to `out_tif` (with
    `description` as the TIFF's ImageDescription, when given: what made it); returns the
    settings, whether the whole mask was held, and the voxel counts of each step (of each
    class, for a label map)."""
    prob_store, out_tif = Path(prob_store), Path(out_tif)
    probs = open_checked(prob_store, "probability store", channels=True)
    if not np.issubdtype(probs.dtype, np.floating):
        raise CtsegError(
            f"{prob_store}: a {probs.dtype} store, not probabilities (an image or a mask?); "
            "pass the float16 probability store that ctseg infer writes"
        )
    # tifffile's own shape description is left out where ours is given: a TIFF has one.
    tags = {"description": description, "metadata": None} if description is not None else {}
    if probs.ndim == 4:
        return _write_label_map(prob_store, probs, out_tif, settings, tags)
    settings = binary_settings(settings, prob_store)
    shape = tuple(int(s) for s in probs.shape)
    whole = settings.whole_volume
    info: dict[str, Any] = {**settings.as_dict(), "holds_whole_mask": whole}
    with atomic_path(out_tif) as tmp:
        if not whole:
            counter = [0]
            pages = _threshold_pages(probs, settings.threshold, counter)
            tifffile.imwrite(
                tmp, pages, shape=shape, dtype=np.uint8, photometric="minisblack", **tags
            )
            info["foreground_voxels"] = counter[0]
        else:
            # float16, as stored: 2 bytes a voxel, the same values the search thresholded.
            mask, counts = binary_mask(np.asarray(probs[...]), settings)
            info.update(counts)
            tifffile.imwrite(tmp, mask, photometric="minisblack", **tags)
    return info


def _threshold_pages(
    probs: zarr.Array, threshold: float, counter: list[int]
) -> Iterator[np.ndarray]:
    """The mask's pages, thresholded a z-chunk of the store at a time; counts the foreground."""
    step = int(probs.chunks[0])
    for z0 in range(0, probs.shape[0], step):
        slab = (np.asarray(probs[z0 : z0 + step]) > threshold).view(np.uint8)
        counter[0] += int(np.count_nonzero(slab))
        yield from slab


def _write_label_map(
    prob_store: Path,
    probs: zarr.Array,
    out_tif: Path,
    settings: MaskSettings,
    tags: dict[str, Any],
) -> dict[str, Any]:
    """The label map of a multi-class store (module docstring), written atomically; returns
    the per-class settings, the voxel count of each class and of all the foreground, and each
    post-processed class's step counts."""
    labels = store_labels(probs, prob_store)
    classes = label_map_settings(settings, labels, prob_store)
    shape = tuple(int(s) for s in probs.shape[1:])
    names = channel_names(labels)
    counts = np.zeros(len(names), np.int64)
    info: dict[str, Any] = {
        CLASSES_ATTRIBUTE: names,
        "values": [labels.background, *labels.foreground_values],
        "class_settings": classes.as_dict()["classes"],
        "holds_whole_mask": classes.whole_volume,
    }
    with atomic_path(out_tif) as tmp:
        if classes.whole_volume:
            stored, info["class_steps"] = class_label_map(np.asarray(probs[...]), classes)
            counts += np.bincount(stored.ravel(), minlength=len(counts))
            tifffile.imwrite(tmp, _from_stored(stored, labels), photometric="minisblack", **tags)
        else:
            pages = _label_pages(probs, labels, classes, counts)
            tifffile.imwrite(
                tmp, pages, shape=shape, dtype=np.uint8, photometric="minisblack", **tags
            )
    info["class_voxels"] = {name: int(n) for name, n in zip(names, counts, strict=True)}
    info["foreground_voxels"] = int(counts[1:].sum())
    return info


def _label_pages(
    probs: zarr.Array, labels: LabelSpec, classes: ClassSettings, counts: np.ndarray
) -> Iterator[np.ndarray]:
    """The label map's pages, a z-chunk of the store at a time; counts each class's voxels."""
    step = int(probs.chunks[1])
    for z0 in range(0, probs.shape[1], step):
        stored = pointwise_label_map(np.asarray(probs[:, z0 : z0 + step]), classes)
        counts += np.bincount(stored.ravel(), minlength=len(counts))
        yield from _from_stored(stored, labels)
