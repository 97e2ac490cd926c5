"""A probability store to the submitted mask: the uint8 (0/1) multi-page TIFF of the Kaggle
submission layout, one page per z-slice, under one `ctseg.postprocess.masks.PostprocessSettings`
(`write_mask`; `ctseg postprocess`, `ctseg infer --mask` and `ctseg predict` all write with it).

Memory: a plain threshold is applied slab by slab (a z-chunk of the store at a time) and the mask
streamed page by page into the TIFF. Hysteresis, ``min_component_voxels`` (cc3d,
26-connectivity), hole filling, plugging, patching and closing need the whole volume
(`ctseg.postprocess.masks.binary_mask`, the function the tuning search scores with): then this
step holds the float16 probabilities, a uint8 mask and cc3d's 4-byte labels (about 8 bytes a
voxel, plus scipy's temporaries of the mask's size for hole filling).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
import zarr

from ctseg.io import CtsegError, atomic_path
from ctseg.postprocess.masks import PostprocessSettings, binary_mask
from ctseg.store import open_volume


def open_checked(path: Path, what: str) -> zarr.Array:
    """A non-empty 3D Zarr array (`what`: "probability store", or the image store inference
    reads); a missing, unreadable, not 3D or empty one is a one-line error naming it."""
    if not Path(path).exists():
        raise CtsegError(f"{path}: {what} not found")
    try:
        arr = open_volume(path)
    except Exception as exc:
        raise CtsegError(f"{path}: cannot open {what} as a Zarr array: {exc}") from exc
    if arr.ndim != 3:
        raise CtsegError(f"{path}: expected a 3D volume, got shape {tuple(arr.shape)}")
    if 0 in arr.shape:
        raise CtsegError(f"{path}: empty volume of shape {tuple(arr.shape)}")
    return arr


def write_mask(prob_store: Path, out_tif: Path, settings: PostprocessSettings) -> dict[str, Any]:
    """The mask of `prob_store` under `settings`, written atomically to `out_tif`; returns the
    settings, whether the whole mask was held, and the voxel counts of each step."""
    prob_store, out_tif = Path(prob_store), Path(out_tif)
    probs = open_checked(prob_store, "probability store")
    if not np.issubdtype(probs.dtype, np.floating):
        raise CtsegError(
            f"{prob_store}: a {probs.dtype} store, not probabilities (an image or a mask?); "
            "pass the float16 probability store that ctseg infer writes"
        )
    shape = tuple(int(s) for s in probs.shape)
    whole = settings.whole_volume
    info: dict[str, Any] = {**settings.as_dict(), "holds_whole_mask": whole}
    with atomic_path(out_tif) as tmp:
        if not whole:
            counter = [0]
            pages = _threshold_pages(probs, settings.threshold, counter)
            tifffile.imwrite(tmp, pages, shape=shape, dtype=np.uint8, photometric="minisblack")
            info["foreground_voxels"] = counter[0]
        else:
            # float16, as stored: 2 bytes a voxel, the same values the search thresholded.
            mask, counts = binary_mask(np.asarray(probs[...]), settings)
            info.update(counts)
            tifffile.imwrite(tmp, mask, photometric="minisblack")
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
