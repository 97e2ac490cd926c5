"""The packed sample: one row of bytes per sample, one uint8 tensor per batch.

A DataLoader worker hands each tensor of a batch to the main process through its own
shared-memory segment (create, fill, send a file descriptor, map it again there). With ten
tensors a sample that fixed cost was 10-20 ms per sample on 2 cores, several times the 3 ms of
reading a raw patch, and made two workers slower than none. So a sample travels as one row of
bytes (`PackedLayout`) and a batch as one uint8 tensor (`PackedBatch`): the four binary targets
as one bit-flag byte per voxel (`ctseg.store.MASK_BITS`), the image in its stored dtype (uint8
or uint16), sdt in float16 (as stored: exact), and the small per-sample values in a 48-byte
header. `ctseg.data.device_batches.to_device` unpacks it on the device.

The host layout, `SAMPLE_KEYS`, is what `ctseg.data.patches.PatchDataset.__getitem__` returns and
`default_collate` batches (and what ``packed_batch[key]`` unpacks on the host): image and sdt
as stored, the planes label (stored values, `ctseg.labels.LabelSpec.stored`: 0/1/2 for
Kaggle's), ignore, skeleton, tube as uint8, intensity (p0_5, p99_5) and aug float32, index int64,
worker an int.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ctseg.data import augment as aug
from ctseg.data.slots import Slot, mapped_rows
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.store import CLASS_SHIFT, MASK_BITS

SAMPLE_KEYS = (
    "image",
    "label",
    "ignore",
    "skeleton",
    "tube",
    "sdt",
    "intensity",
    "aug",
    "index",
    "worker",
)


def pack_bits(
    label: np.ndarray, skeleton: np.ndarray, tube: np.ndarray, labels: LabelSpec = KAGGLE
) -> np.ndarray:
    """Bit flags as in `ctseg.store.MASK_BITS`, from a label (values as `labels` says) and two
    binary targets. The flags keep foreground and ignore, and for a multi-class spec the class
    (bits 4-7, `ctseg.store.CLASS_SHIFT`): `unpack_bits` gives the label back in stored values
    (`LabelSpec.stored`: 0/1/2 for a binary spec with an ignored value), whatever the dataset's."""
    foreground = labels.foreground(label).view(np.uint8)
    packed = foreground * np.uint8(MASK_BITS["foreground"])
    if not labels.is_binary:
        packed |= (labels.to_stored(label) * foreground) << np.uint8(CLASS_SHIFT)
    packed |= labels.ignored(label).view(np.uint8) * np.uint8(MASK_BITS["ignore"])
    packed |= np.asarray(skeleton, bool).view(np.uint8) * np.uint8(MASK_BITS["skeleton"])
    packed |= np.asarray(tube, bool).view(np.uint8) * np.uint8(MASK_BITS["tube"])
    return packed


def unpack_bits(bits: Any, n_classes: int = 1) -> dict[str, Any]:
    """label, ignore, skeleton and tube (0/1) from `ctseg.store.MASK_BITS` flags; the label in
    stored values (`LabelSpec.stored`) of a spec with `n_classes` (K) foreground classes: 0..K,
    and K+1 where ignored.

    `bits` is a uint8 NumPy array or torch tensor (on any device); each plane comes back as the
    same kind, dtype and shape. Binary (K = 1): foreground is bit 1 and ignore bit 2, so bits & 3
    is the label; should both be set, XOR with (ignore & foreground) turns the 3 into 2 (ignore
    wins). Multi-class: the class is bits 4-7, and ignore wins there too. Bit operations only:
    np.minimum on uint8 measured 10x slower than a shift here.
    """
    shift = {name: bit.bit_length() - 1 for name, bit in MASK_BITS.items()}
    ignore = (bits >> shift["ignore"]) & 1
    if n_classes == 1:
        label = (bits & 3) ^ (ignore & bits)
    else:
        label = (bits >> CLASS_SHIFT) * (ignore ^ 1) + ignore * (n_classes + 1)
    return {
        "label": label,
        "ignore": ignore,
        "skeleton": (bits >> shift["skeleton"]) & 1,
        "tube": (bits >> shift["tube"]) & 1,
    }


_META_F32 = ("p0_5", "p99_5", *(f"aug_{name}" for name in aug.AUG_FIELDS))
_META_I64 = ("index", "worker")
_META_BYTES = 4 * len(_META_F32) + 8 * len(_META_I64)
_ALIGN = 8  # every section starts on 8 bytes, so any dtype view of it is aligned


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class PackedLayout:
    """Where each field of a sample lies in its row of bytes (one row of a `PackedBatch`).

    Sections, each 8-byte aligned: a header of float32 p0_5, p99_5 and the `aug` vector, then
    int64 index and worker; sdt (float16, the patch); the image (its stored dtype); the bit
    flags (uint8, `ctseg.store.MASK_BITS`). At 72x136x136 and uint8 that is 4 bytes a voxel,
    against 7 bytes in ten tensors before.
    """

    patch: tuple[int, int, int]
    image_dtype: str
    n_classes: int = 1  # K of the run's label spec: how the bit flags hold the label

    @property
    def voxels(self) -> int:
        return math.prod(self.patch)

    @property
    def offsets(self) -> dict[str, int]:
        image_bytes = self.voxels * np.dtype(self.image_dtype).itemsize
        sdt = _aligned(_META_BYTES)
        image = _aligned(sdt + 2 * self.voxels)
        bits = _aligned(image + image_bytes)
        return {"sdt": sdt, "image": image, "bits": bits, "end": _aligned(bits + self.voxels)}

    @property
    def nbytes(self) -> int:
        return self.offsets["end"]

    @property
    def gaps(self) -> list[tuple[int, int]]:
        """The alignment padding between sections, as byte ranges."""
        at = self.offsets
        ends = {
            "sdt": _META_BYTES,
            "image": at["sdt"] + 2 * self.voxels,
            "bits": at["image"] + self.voxels * np.dtype(self.image_dtype).itemsize,
            "end": at["bits"] + self.voxels,
        }
        return [(ends[k], at[k]) for k in ends if ends[k] < at[k]]

    def arrays(self, row: np.ndarray) -> dict[str, np.ndarray]:
        """Writable NumPy views of one row (uint8, `nbytes`): header parts and patches."""
        at = self.offsets
        n = self.voxels
        f32 = row[: 4 * len(_META_F32)].view(np.float32)
        i64 = row[4 * len(_META_F32) : _META_BYTES].view(np.int64)
        image_bytes = n * np.dtype(self.image_dtype).itemsize
        return {
            "intensity": f32[:2],
            "aug": f32[2:],
            "index": i64[:1],
            "worker": i64[1:],
            "sdt": row[at["sdt"] : at["sdt"] + 2 * n].view(np.float16).reshape(self.patch),
            "image": row[at["image"] : at["image"] + image_bytes]
            .view(self.image_dtype)
            .reshape(self.patch),
            "bits": row[at["bits"] : at["bits"] + n].reshape(self.patch),
        }

    def fields(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a batch (B, `nbytes`) uint8 tensor on any device, without copying.

        intensity (B, 2) and aug (B, 6) float32, index and worker (B,) int64, and the patches
        as (B, 1, Z, Y, X): sdt float16, image in its stored dtype, bits uint8.
        """
        at = self.offsets
        n = self.voxels
        batch = rows.shape[0]
        shape = (batch, 1, *self.patch)
        f32 = rows[:, : 4 * len(_META_F32)].view(torch.float32)
        i64 = rows[:, 4 * len(_META_F32) : _META_BYTES].view(torch.int64)
        image_dtype = torch.from_numpy(np.empty(0, self.image_dtype)).dtype
        image_bytes = n * np.dtype(self.image_dtype).itemsize
        return {
            "intensity": f32[:, :2],
            "aug": f32[:, 2:],
            "index": i64[:, 0],
            "worker": i64[:, 1],
            "sdt": rows[:, at["sdt"] : at["sdt"] + 2 * n].view(torch.float16).reshape(shape),
            "image": rows[:, at["image"] : at["image"] + image_bytes]
            .view(image_dtype)
            .reshape(shape),
            "bits": rows[:, at["bits"] : at["bits"] + n].reshape(shape),
        }


class PackedBatch:
    """A batch as the training loader yields it: `rows`, one uint8 tensor (B, layout.nbytes).

    One tensor per batch, so a worker hands the main process one shared-memory buffer (see the
    module docstring); `to_device` copies it to the device in one transfer and
    unpacks it there. Reading a key of `SAMPLE_KEYS` (``batch["label"]``, ``batch["index"]``)
    unpacks just that field on the host, in the layout `default_collate` of samples gives, for
    inspection and logging; the training path never does.

    `slot` names the worker buffer the batch came in (worker id, worker pid, slot number), and
    `in_slot` says whether `rows` still are that buffer; `PackedLoader` keeps that bookkeeping
    to itself and hands the buffer back once the batch is no longer used
    (`ctseg.data.slots.SlotReturns`).
    """

    __slots__ = ("by_name", "in_slot", "layout", "rows", "slot")

    def __init__(
        self,
        rows: torch.Tensor,
        layout: PackedLayout,
        slot: Slot | None = None,
        in_slot: bool = False,
        by_name: bool = False,
    ) -> None:
        if rows.dtype != torch.uint8 or rows.ndim != 2 or rows.shape[1] != layout.nbytes:
            raise ValueError(
                f"packed rows must be uint8 (B, {layout.nbytes}), got {rows.dtype} "
                f"{tuple(rows.shape)}"
            )
        self.rows = rows
        self.layout = layout
        self.slot = slot
        self.in_slot = in_slot and slot is not None
        # The main process has this slot mapped: a worker sends its name, not its memory.
        self.by_name = by_name and self.in_slot

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.by_name:
            return _from_mapped_slot, (self.layout, self.slot, self.batch_size)
        return PackedBatch, (self.rows, self.layout, self.slot, self.in_slot)

    def __len__(self) -> int:
        return len(SAMPLE_KEYS)

    def __iter__(self) -> Iterator[str]:
        return iter(SAMPLE_KEYS)

    def __contains__(self, key: object) -> bool:
        return key in SAMPLE_KEYS

    def keys(self) -> tuple[str, ...]:
        return SAMPLE_KEYS

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in SAMPLE_KEYS:
            raise KeyError(key)
        if key in ("label", "ignore", "skeleton", "tube"):
            return unpack_planes(self.layout.fields(self.rows)["bits"], self.layout.n_classes)[key]
        return self.unpacked(keys=(key,))[key]

    def unpacked(self, keys: Sequence[str] = SAMPLE_KEYS) -> dict[str, torch.Tensor]:
        """Fields on the host in the layout of `default_collate` of samples (`SAMPLE_KEYS`):
        planes unpacked, nothing converted; the image and sdt are views of `rows`."""
        fields = self.layout.fields(self.rows)
        out: dict[str, torch.Tensor] = {}
        if any(k in keys for k in ("label", "ignore", "skeleton", "tube")):
            out.update(unpack_planes(fields["bits"], self.layout.n_classes))
        for key in ("image", "sdt"):
            out[key] = fields[key]
        for key in ("intensity", "aug", "index", "worker"):
            out[key] = fields[key].clone()  # small; keeps no view of the big buffer alive
        return {key: out[key] for key in keys}

    def pin_memory(self) -> PackedBatch:
        """Called by the DataLoader's pin-memory thread (it looks for this method first)."""
        return PackedBatch(self.rows.pin_memory(), self.layout, self.slot, in_slot=False)

    @property
    def batch_size(self) -> int:
        return int(self.rows.shape[0])


def unpack_planes(bits: torch.Tensor, n_classes: int = 1) -> dict[str, torch.Tensor]:
    """`unpack_bits` of a uint8 tensor: NumPy on the host, torch elsewhere.

    On the host torch spreads each uint8 op over its OpenMP threads; on 2 busy cores that
    measured 24 ms per op on a 72x136x136 patch, NumPy 0.05 ms.
    """
    if bits.device.type == "cpu":
        planes = unpack_bits(bits.numpy(), n_classes)
        return {k: torch.from_numpy(v) for k, v in planes.items()}
    return {k: v.contiguous() for k, v in unpack_bits(bits, n_classes).items()}


def _from_mapped_slot(layout: PackedLayout, slot: Slot, batch: int) -> PackedBatch:
    """Unpickle, in the main process, a batch that a worker sent by its slot's name."""
    rows = mapped_rows(slot, batch, layout.nbytes)
    return PackedBatch(rows, layout, slot, in_slot=True)
