"""The patch stream: sample `i` of a training run, read from the scratch copy and augmented.

The starting point's GPU (README.md, "The starting point") waited 15-17 s of every 18 s step
because distance transforms ran in the data workers. Here the targets are precomputed
(`ctseg.preprocess.targets`) and staged to scratch (`ctseg.layout` defines the formats and opens a
record); a worker only slices arrays, applies an exact cube symmetry and writes the sample
straight into its row of a packed batch (`ctseg.data.packing`).
`runtime_targets=True` puts that status quo back (targets recomputed per sample from the label
plus a halo) as a benchmark baseline; it yields the same samples.

Sample `i` is a pure function of `(seed, i)`: the stream does not depend on the number of
workers, and a run resumes by starting the sampler at the next index (`ctseg.data.loader`).

Padding outside the volume: image 0, label 2 (so ``ignore`` 1: the loss must skip voxels that do
not exist), skeleton and tube 0, sdt +clip_distance (outside the foreground).

No patch without a labelled voxel: every loss term is masked by ``ignore``, so a patch that is all
ignore (unlabelled, or outside the volume) gives a loss of exactly 0 and no gradient, and a batch
of such patches would spend an optimizer step on nothing. `PatchDataset.plan` redraws such a
patch's centre (see there); sample `i` stays a pure function of `(seed, i)`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ctseg.data import augment as aug
from ctseg.data.heap import tune_malloc
from ctseg.data.packing import PackedBatch, PackedLayout, pack_bits, unpack_bits
from ctseg.data.slots import SlotPool
from ctseg.io import CtsegError, check_id
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.layout import SCRATCH_FORMATS, TARGET_PARAM_KEYS, ScratchRecord, open_record
from ctseg.store import CLASS_BITS, CLASS_SHIFT, MASK_BITS

MASK_PAD = MASK_BITS["ignore"]  # ignored outside the volume (label 2 for Kaggle's, K+1)
# Redraws of a centre whose patch holds no labelled voxel, uniform over the volume, before the
# last resort of a foreground location.
LABELLED_TRIES = 16


def _write_window(
    dst: np.ndarray,
    source: Any,
    origin: Sequence[int],
    start: Sequence[int],
    fill: float,
) -> None:
    """Write the box [start, start + dst.shape) of a volume into `dst`, `fill` outside the data.

    `source` holds the volume's voxels [origin, origin + source.shape): a memmap or zarr array
    of the whole volume (origin 0) or an in-memory crop. `dst` may be any view (flipped,
    transposed), so the read, the padding and the geometry cost one pass over the patch; only
    the slabs outside the data are filled.
    """
    size = dst.shape
    lo = [max(int(s), int(o)) for s, o in zip(start, origin, strict=True)]
    hi = [
        min(int(s) + int(n), int(o) + int(m))
        for s, n, o, m in zip(start, size, origin, source.shape, strict=True)
    ]
    if any(b <= a for a, b in zip(lo, hi, strict=True)):
        dst[...] = fill
        return
    for axis in range(dst.ndim):
        before, after = lo[axis] - int(start[axis]), hi[axis] - int(start[axis])
        if before > 0:
            dst[(slice(None),) * axis + (slice(0, before),)] = fill
        if after < size[axis]:
            dst[(slice(None),) * axis + (slice(after, None),)] = fill
    inner = tuple(slice(a - int(o), b - int(o)) for a, b, o in zip(lo, hi, origin, strict=True))
    dst[tuple(slice(a - int(s), b - int(s)) for a, b, s in zip(lo, hi, start, strict=True))] = (
        source[inner]
    )


@dataclass(frozen=True)
class SamplePlan:
    """The random choices behind one sample: which record, where, and which augmentation."""

    index: int
    record: int  # position in the dataset's ids
    start: tuple[int, int, int]  # patch corner in volume coordinates (may lie outside)
    geometry: aug.Geometry
    intensity: np.ndarray  # the `aug` vector, see ctseg.data.augment.AUG_FIELDS
    redrawn: int = 0  # centres redrawn because the patch held no labelled voxel


class PatchDataset(Dataset):
    """Map-style dataset of augmented patches; sample `i` is a function of `(seed, i)` only.

    Each sample draws, from ``np.random.default_rng([seed, i])`` and in this order: a record,
    a centre (a random precomputed foreground location with probability `fg_fraction`, else
    uniform over the volume), the geometry (`ctseg.data.augment.draw_geometry`) and the intensity
    parameters. Stores are opened lazily, once per process, on first use of each record.

    `augment` is the experiment's ``data.augment`` mapping (flip, permute, intensity, elastic,
    scale, optional spacing). `target_params` (clip_distance, skeleton_method, tube_dilations,
    halo) override what the scratch metadata says; clip_distance is needed always (it pads sdt),
    the rest only with `runtime_targets`. `labels` is the run's label spec (the dataset's or
    its stored one): the samples' labels are in its stored values (`LabelSpec.stored`), with a
    multi-class spec's class in the mask byte (`ctseg.store.CLASS_SHIFT`).
    """

    def __init__(
        self,
        scratch: str | Path,
        ids: Sequence[str],
        *,
        patch_size: Sequence[int],
        fmt: str,
        fg_fraction: float,
        augment: Mapping[str, Any] | None,
        seed: int,
        length: int,
        runtime_targets: bool = False,
        target_params: Mapping[str, Any] | None = None,
        labels: LabelSpec = KAGGLE,
    ) -> None:
        self.scratch = Path(scratch)
        if fmt not in SCRATCH_FORMATS:
            raise CtsegError(
                f"{self.scratch}: unknown scratch format {fmt!r}; expected {SCRATCH_FORMATS}"
            )
        if not ids:
            raise CtsegError(f"{self.scratch}: no record ids to sample from")
        self.ids = [check_id(i, self.scratch) for i in ids]
        for record_id in self.ids:
            if not (self.scratch / record_id).is_dir():
                raise CtsegError(f"{self.scratch / record_id}: record {record_id!r} not in scratch")
        self.patch_size = tuple(int(s) for s in patch_size)
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise CtsegError(f"patch_size must be 3 positive ints, got {list(patch_size)}")
        if not 0.0 <= float(fg_fraction) <= 1.0:
            raise CtsegError(f"fg_fraction must be in [0, 1], got {fg_fraction}")
        if int(length) < 0:
            raise CtsegError(f"length must be >= 0, got {length}")
        self.fmt = fmt
        self.fg_fraction = float(fg_fraction)
        self.augment = dict(augment or {})
        aug.check_augment(self.augment)
        self.spacing = aug.spacing_of(self.augment)
        self.seed = int(seed)
        self.length = int(length)
        self.runtime_targets = bool(runtime_targets)
        self.target_params = dict(target_params or {})
        self.labels = labels.stored()
        # Opened per process on first use; a pid change (a forked worker) starts afresh, so
        # no handle opened in the parent is ever used in a child.
        self._records: dict[int, ScratchRecord] | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_records"] = None
        state["_pid"] = None
        return state

    # -- opening -----------------------------------------------------------------------------

    def _record(self, k: int) -> ScratchRecord:
        pid = os.getpid()
        if self._records is None or self._pid != pid:
            self._records, self._pid = {}, pid
            tune_malloc()
        record = self._records.get(k)
        if record is None:
            path = self.scratch / self.ids[k]
            needed = TARGET_PARAM_KEYS if self.runtime_targets else ("clip_distance",)
            record = open_record(path, self.fmt, target_params=self.target_params, needed=needed)
            self._records[k] = record
        return record

    # -- reading -----------------------------------------------------------------------------
    # Each reader returns (source, origin): an array holding the volume's voxels from `origin`
    # on, which `_write_window` crops and pads into the patch.

    @staticmethod
    def _clipped_box(record: ScratchRecord, start: np.ndarray, size: Sequence[int]) -> tuple:
        lo = np.clip(start, 0, record.shape)
        hi = np.clip(start + np.array(size), 0, record.shape)
        return lo, tuple(slice(int(a), int(b)) for a, b in zip(lo, hi, strict=True))

    def _bits_source(
        self, record: ScratchRecord, start: np.ndarray, size: Sequence[int]
    ) -> tuple[Any, Any]:
        if record.masks is not None:
            return record.masks, (0, 0, 0)
        # zarr keeps one array per target: read the part inside the volume and pack it.
        lo, box = self._clipped_box(record, start, size)
        bits = None
        for name, bit in MASK_BITS.items():
            plane = np.asarray(record.planes[name][box])
            if name == "foreground":  # with a multi-class spec's class in bits 4-7
                flag = plane & np.uint8(bit | CLASS_BITS)
            else:
                flag = (plane != 0).view(np.uint8) * np.uint8(bit)
            bits = flag if bits is None else np.bitwise_or(bits, flag, out=bits)
        return bits, lo

    def _read_label(
        self, record: ScratchRecord, start: np.ndarray, size: Sequence[int]
    ) -> np.ndarray:
        """The label (stored values) of a box inside the volume (no padding)."""
        box = tuple(slice(int(a), int(a) + int(n)) for a, n in zip(start, size, strict=True))
        k = self.labels.n_classes
        if record.masks is not None:
            return unpack_bits(np.asarray(record.masks[box]), k)["label"]
        foreground = np.asarray(record.planes["foreground"][box])
        if k == 1:
            label = (foreground != 0).view(np.uint8).copy()
        else:
            label = foreground >> np.uint8(CLASS_SHIFT)
        label[np.asarray(record.planes["ignore"][box]) != 0] = k + 1
        return label

    def _runtime_sources(
        self, record: ScratchRecord, start: np.ndarray, size: Sequence[int]
    ) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        """The starting point's way: targets from the label patch plus a halo, per sample.

        The halo window is cut at the volume faces rather than padded, exactly as the
        whole-volume computation sees them, so border patches match the precomputed ones too.
        """
        from ctseg.preprocess.targets import targets_reference  # heavy; only the baseline needs it

        params = record.params
        halo = math.ceil(float(params["halo"]))
        shape = np.array(record.shape)
        lo = np.clip(start - halo, 0, shape)
        hi = np.clip(start + np.array(size) + halo, 0, shape)
        label = self._read_label(record, lo, hi - lo)
        targets = targets_reference(
            label,
            clip_distance=params["clip_distance"],
            skeleton_method=params["skeleton_method"],
            tube_dilations=params["tube_dilations"],
            labels=self.labels,
        )
        packed = pack_bits(label, targets["skeleton"], targets["tube"], self.labels)
        sdt = np.asarray(targets["sdt"]).astype(np.float16, copy=False)
        return (packed, lo), (sdt, lo)

    def _patch(
        self,
        out: np.ndarray,
        source: Any,
        origin: Any,
        start: np.ndarray,
        fill: float,
        order: int,
        geometry: aug.Geometry,
    ) -> None:
        """Write the augmented, padded patch into `out` (a C-contiguous view of a packed row).

        `out` may be of a wider dtype than `source` (a uint8 volume in a batch with a uint16
        one): the values are then written unchanged.
        """
        if geometry.warp is None:
            # Write through a view that undoes the flips/permutation: one pass, no extra copy.
            _write_window(aug.source_view(out, geometry, self.spacing), source, origin, start, fill)
            return
        # Warps interpolate in the source's dtype, as they always did, and are then copied.
        window = np.empty(self.patch_size, source.dtype)
        _write_window(window, source, origin, start, fill)
        out[...] = aug.apply_geometric(
            window, geometry, order=order, cval=fill, spacing=self.spacing
        )

    def plan(self, index: int) -> SamplePlan:
        """Everything random about sample `index`, drawn from ``default_rng([seed, index])``."""
        index = int(index)
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} outside the stream of {self.length}")
        rng = np.random.default_rng([self.seed, index])
        k = int(rng.integers(len(self.ids)))
        record = self._record(k)
        fg = record.fg_locations
        if rng.random() < self.fg_fraction and len(fg):
            centre = fg[rng.integers(len(fg))]
        else:
            centre = rng.integers(0, record.shape)
        half = np.array(self.patch_size) // 2
        geometry = aug.draw_geometry(rng, self.patch_size, self.augment)
        intensity = aug.draw_intensity(rng, self.augment.get("intensity"))
        # A patch without a labelled voxel is redrawn: a new centre from its own generator
        # ([seed, index, try]), so a sample whose first patch is labelled is exactly what it was,
        # and the geometry and intensity draws stay those of the first.
        redrawn = 0
        while not self._labelled(record, np.asarray(centre, np.int64) - half, geometry):
            redrawn += 1
            retry = np.random.default_rng([self.seed, index, redrawn])
            if redrawn <= LABELLED_TRIES:
                centre = retry.integers(0, record.shape)
            elif len(fg) and redrawn == LABELLED_TRIES + 1:
                centre = fg[retry.integers(len(fg))]  # a foreground voxel is labelled
            else:
                break  # a volume with no labelled voxel within reach: keep the last patch
        start = np.asarray(centre, np.int64) - half
        return SamplePlan(
            index=index,
            record=k,
            start=tuple(int(s) for s in start),
            geometry=geometry,
            intensity=intensity,
            redrawn=redrawn,
        )

    def _labelled(self, record: ScratchRecord, start: np.ndarray, geometry: aug.Geometry) -> bool:
        """Whether the patch at `start` under `geometry` holds a voxel whose ignore flag is clear,
        judged on the patch exactly as `_write` makes it (padding and warps included)."""
        if record.masks is not None:
            source, fill, flag = record.masks, MASK_PAD, MASK_PAD
        else:
            source, fill, flag = record.planes["ignore"], 1, None
        patch = np.empty(self.patch_size, source.dtype)
        self._patch(patch, source, (0, 0, 0), start, fill, 0, geometry)
        if flag is None:
            return not bool(patch.all())
        return not bool(np.all(patch & flag))

    def _write(self, plan: SamplePlan, out: Mapping[str, np.ndarray]) -> None:
        """Read, pad and augment the sample of `plan` into `out` (`PackedLayout.arrays`)."""
        record = self._record(plan.record)
        start = np.array(plan.start)
        clip = float(record.params["clip_distance"])
        if self.runtime_targets:
            bits_source, sdt_source = self._runtime_sources(record, start, self.patch_size)
        else:
            bits_source = self._bits_source(record, start, self.patch_size)
            sdt_source = (record.sdt, (0, 0, 0))
        self._patch(out["image"], record.image, (0, 0, 0), start, 0, 1, plan.geometry)
        self._patch(out["bits"], *bits_source, start, MASK_PAD, 0, plan.geometry)
        self._patch(out["sdt"], *sdt_source, start, clip, 0, plan.geometry)
        out["intensity"][...] = record.intensity
        out["aug"][...] = plan.intensity
        out["index"][...] = plan.index
        info = get_worker_info()
        out["worker"][...] = -1 if info is None else int(info.id)

    def packed(self, indices: Sequence[int], pool: SlotPool | None = None) -> PackedBatch:
        """Samples `indices` as one `PackedBatch`, each written straight into its row.

        The rows come from `pool` (a loader worker's shared buffers) or else from the heap.
        """
        plans = [self.plan(i) for i in indices]
        if not plans:
            raise IndexError("a packed batch needs at least one sample")
        # One layout per batch: a batch mixing uint8 and uint16 volumes carries uint16.
        dtype = np.result_type(*(self._record(p.record).image.dtype for p in plans))
        layout = PackedLayout(self.patch_size, np.dtype(dtype).name, self.labels.n_classes)
        slot, by_name = None, False
        if pool is None:
            rows = torch.empty((len(plans), layout.nbytes), dtype=torch.uint8)
        else:
            rows, slot, by_name = pool.rows(len(plans), layout.nbytes)
        host = rows.numpy()
        for plan, row in zip(plans, host, strict=True):
            for lo, hi in layout.gaps:
                row[lo:hi] = 0  # alignment padding: a row's bytes are a function of the sample
            self._write(plan, layout.arrays(row))
        return PackedBatch(rows, layout, slot, in_slot=slot is not None, by_name=by_name)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample `index` unpacked on the host, as `SAMPLE_KEYS` (`ctseg.data.packing`): the image
        and sdt as stored, the four binary targets as uint8 planes, each patch (1, Z, Y, X)."""
        sample = {k: v[0] for k, v in self.packed([index]).unpacked().items()}
        sample["worker"] = int(sample["worker"])
        return sample
