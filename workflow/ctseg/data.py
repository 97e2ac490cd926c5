"""Training data: a reproducible patch stream over the scratch copy, its loader and device feed.

The starting point's GPU (README.md, "The starting point") waited 15-17 s of every 18 s step
because distance transforms ran in the data workers. Here the targets are precomputed
(`ctseg.targets`) and staged to scratch (`ctseg.layout` defines the formats and opens a
record); a worker only slices arrays, applies an exact cube symmetry and writes the sample
into its batch buffer.
`runtime_targets=True` puts that status quo back (targets recomputed per sample from the label
plus a halo) as a benchmark baseline; it yields the same samples.

Sample `i` is a pure function of `(seed, i)`: the stream does not depend on the number of
workers, and a run resumes by starting the sampler at the next index (`build_loader(start=)`).

A sample is packed into one row of bytes (`PackedLayout`): the four binary targets as one
bit-flag byte per voxel, the image as stored (uint8 or uint16), sdt as stored (float16) and a
48-byte header; `build_loader` yields a batch as one uint8 tensor (`PackedBatch`), which a worker
writes in place into a reused shared-memory buffer (`_SlotPool`, `PackedLoader`). Ten tensors
of 9 MB a sample used to cost more to hand over than the sample cost to read. `to_device`
copies the rows to the device in one transfer and unpacks them there into what the model and
the losses use:
- ``image``: float32 (B, 1, Z, Y, X), scaled to [0, 1] by the volume's [p0_5, p99_5] and
  clipped, then intensity-augmented (values outside [0, 1] only from the added noise);
- ``label`` (0/1/2), ``ignore``, ``skeleton``, ``tube`` (0/1): uint8 (B, 1, Z, Y, X), a quarter
  of the bytes of float; losses cast them (`.float()`, `== 1`) where they need to;
- ``sdt``: float32 (B, 1, Z, Y, X), clipped signed distance, positive outside the foreground;
- ``intensity``, ``aug``: float32 (B, 2) and (B, 6) on the device; ``index``, ``worker``:
  int64 (B,) left on the host for logging.
`to_device` also takes the host layout, `SAMPLE_KEYS`, that `PatchDataset.__getitem__` returns
and `default_collate` batches (and that ``packed_batch[key]`` unpacks on the host): image and
sdt as stored, the planes as uint8, intensity and aug float32, index int64, worker an int.
Both give the same device batch, bit for bit.

Padding outside the volume: image 0, label 2 (so ``ignore`` 1: the loss must skip voxels that do
not exist), skeleton and tube 0, sdt +clip_distance (outside the foreground).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import platform
import random
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from ctseg import augment as aug
from ctseg.io import CtsegError, check_id
from ctseg.layout import SCRATCH_FORMATS, TARGET_PARAM_KEYS, ScratchRecord, open_record
from ctseg.store import MASK_BITS

MP_CONTEXTS = ("fork", "spawn", "forkserver")
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
MASK_PAD = MASK_BITS["ignore"]  # label 2 outside the volume


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


# glibc mallopt parameters (malloc.h). Every sample allocates ~10 MB of short-lived arrays at
# 72x136x136; with glibc's defaults the freed top of the heap is trimmed and the next sample
# page-faults all of it in again, which measured as half of a worker's time per sample.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MALLOC_TUNED: set[int] = set()


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Keep freed patch buffers in the heap of this process (glibc only; once per process).

    Costs at most `trim_threshold` of retained free heap per process; returns whether it
    applied.
    """
    pid = os.getpid()
    if pid in _MALLOC_TUNED:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
        ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    except (OSError, AttributeError):
        return False
    if ok:
        _MALLOC_TUNED.add(pid)
    return ok


def _pack(label: np.ndarray, skeleton: np.ndarray, tube: np.ndarray) -> np.ndarray:
    """Bit flags as in `ctseg.store.MASK_BITS`, from a 0/1/2 label and two binary targets."""
    packed = (label == 1).view(np.uint8) * np.uint8(MASK_BITS["foreground"])
    packed |= (label == 2).view(np.uint8) * np.uint8(MASK_BITS["ignore"])
    packed |= np.asarray(skeleton, bool).view(np.uint8) * np.uint8(MASK_BITS["skeleton"])
    packed |= np.asarray(tube, bool).view(np.uint8) * np.uint8(MASK_BITS["tube"])
    return packed


def unpack_bits(bits: Any) -> dict[str, Any]:
    """label (0/1/2), ignore, skeleton and tube (0/1) from `ctseg.store.MASK_BITS` flags.

    `bits` is a uint8 NumPy array or torch tensor (on any device); each plane comes back as the
    same kind, dtype and shape. foreground is bit 1 and ignore bit 2, so bits & 3 is the label;
    should both be set, XOR with (ignore & foreground) turns the 3 into 2 (ignore wins). Bit
    operations only: np.minimum on uint8 measured 10x slower than a shift here.
    """
    shift = {name: bit.bit_length() - 1 for name, bit in MASK_BITS.items()}
    ignore = (bits >> shift["ignore"]) & 1
    return {
        "label": (bits & 3) ^ (ignore & bits),
        "ignore": ignore,
        "skeleton": (bits >> shift["skeleton"]) & 1,
        "tube": (bits >> shift["tube"]) & 1,
    }


# -- the packed sample ----------------------------------------------------------------------
# A DataLoader worker hands each tensor of a batch to the main process through its own
# shared-memory segment (create, fill, send a file descriptor, map it again there). With ten
# tensors a sample that fixed cost was 10-20 ms per sample on 2 cores, several times the 3 ms
# of reading a raw patch, and made two workers slower than none. So a sample travels as one
# row of bytes and a batch as one uint8 tensor: the four binary targets as one bit-flag byte
# per voxel, the image in its stored dtype, sdt in float16 (as stored: exact), and the small
# per-sample values in a 48-byte header. `to_device` unpacks it on the device.

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
    comment above `PackedLayout`); `to_device` copies it to the device in one transfer and
    unpacks it there. Reading a key of `SAMPLE_KEYS` (``batch["label"]``, ``batch["index"]``)
    unpacks just that field on the host, in the layout `default_collate` of samples gives, for
    inspection and logging; the training path never does.

    `slot` names the worker buffer the batch came in (worker id, worker pid, slot number), and
    `in_slot` says whether `rows` still are that buffer; `PackedLoader` keeps that bookkeeping
    to itself and hands the buffer back once the batch is no longer used (`_SlotReturns`).
    """

    __slots__ = ("by_name", "in_slot", "layout", "rows", "slot")

    def __init__(
        self,
        rows: torch.Tensor,
        layout: PackedLayout,
        slot: tuple[int, int, int] | None = None,
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
            return _unpack_planes(self.layout.fields(self.rows)["bits"])[key]
        return self.unpacked(keys=(key,))[key]

    def unpacked(self, keys: Sequence[str] = SAMPLE_KEYS) -> dict[str, torch.Tensor]:
        """Fields on the host in the layout of `default_collate` of samples (`SAMPLE_KEYS`):
        planes unpacked, nothing converted; the image and sdt are views of `rows`."""
        fields = self.layout.fields(self.rows)
        out: dict[str, torch.Tensor] = {}
        if any(k in keys for k in ("label", "ignore", "skeleton", "tube")):
            out.update(_unpack_planes(fields["bits"]))
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


def _unpack_planes(bits: torch.Tensor) -> dict[str, torch.Tensor]:
    """`unpack_bits` of a uint8 tensor: NumPy on the host, torch elsewhere.

    On the host torch spreads each uint8 op over its OpenMP threads; on 2 busy cores that
    measured 24 ms per op on a 72x136x136 patch, NumPy 0.05 ms.
    """
    if bits.device.type == "cpu":
        return {k: torch.from_numpy(v) for k, v in unpack_bits(bits.numpy()).items()}
    return {k: v.contiguous() for k, v in unpack_bits(bits).items()}


class _SlotPool:
    """A loader worker's shared-memory batch buffers, reused once the main process is done.

    Filling fresh shared memory costs a page fault per 4 KiB in the worker: measured 0.74 ms
    per MB on 2 cores, 3.9 ms for a 72x136x136 sample, more than reading the sample. So each
    worker keeps its buffers ("slots"). A batch names its slot; the main process sends the
    slot back on `returns`, this worker's queue, once nothing there refers to the batch any
    more (`_SlotReturns`); the worker takes back its returned slots before each batch. A slot
    is never written while the main process may still read it, and a worker with no free slot
    allocates a new one, so nothing waits on the main process: the slots grow to the number of
    this worker's batches in flight, which the DataLoader bounds (prefetch_factor).
    """

    def __init__(self, returns: Any) -> None:
        self.pid = os.getpid()
        self.returns = returns  # None: nobody hands slots back; every batch gets a new one
        self.slots: list[torch.UntypedStorage | None] = []
        self.free: list[int] = []
        self.mapped: set[int] = set()  # slots the main process keeps mapped

    def rows(self, batch: int, nbytes: int) -> tuple[torch.Tensor, tuple[int, int, int], bool]:
        """A (batch, nbytes) uint8 view of a free slot, the slot's name, and whether the main
        process has the slot mapped already (then the batch travels as the name alone: a
        tensor costs 0.5 ms of CPU per batch to hand over, mostly passing its descriptor)."""
        info = get_worker_info()
        worker = -1 if info is None else int(info.id)
        while self.returns is not None and not self.returns.empty():
            pid, slot, mapped = self.returns.get()
            if pid == self.pid:  # a slot of an earlier worker process with this id: not ours
                self.free.append(slot)
                (self.mapped.add if mapped else self.mapped.discard)(slot)
        need = batch * nbytes
        while self.free:
            slot = self.free.pop()
            storage = self.slots[slot]
            if storage is not None and storage.nbytes() >= need:
                break
            self.slots[slot] = None  # too small for this layout: let it go
            self.mapped.discard(slot)
        else:
            # As torch's default_collate does in a worker: allocated shared, so the batch
            # crosses to the main process as a file descriptor, without a copy.
            storage = torch.UntypedStorage._new_shared(need)
            slot = len(self.slots)
            self.slots.append(storage)
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        return flat[:need].view(batch, nbytes), (worker, self.pid, slot), slot in self.mapped


# Slots the main process keeps mapped, by (worker pid, slot number); each is held by the
# `_SlotReturns` of a running loader, and leaves this mapping with it.
_MAPPED_SLOTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _from_mapped_slot(layout: PackedLayout, slot: tuple[int, int, int], batch: int) -> PackedBatch:
    """Unpickle, in the main process, a batch that a worker sent by its slot's name."""
    storage = _MAPPED_SLOTS.get(slot[1:])
    if storage is None:
        raise RuntimeError(f"loader worker {slot[1]} sent slot {slot[2]}, which is not mapped here")
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    rows = flat[: batch * layout.nbytes].view(batch, layout.nbytes)
    return PackedBatch(rows, layout, slot, in_slot=True)


@dataclass(frozen=True)
class SamplePlan:
    """The random choices behind one sample: which record, where, and which augmentation."""

    index: int
    record: int  # position in the dataset's ids
    start: tuple[int, int, int]  # patch corner in volume coordinates (may lie outside)
    geometry: aug.Geometry
    intensity: np.ndarray  # the `aug` vector, see ctseg.augment.AUG_FIELDS


class PatchDataset(Dataset):
    """Map-style dataset of augmented patches; sample `i` is a function of `(seed, i)` only.

    Each sample draws, from ``np.random.default_rng([seed, i])`` and in this order: a record,
    a centre (a random precomputed foreground location with probability `fg_fraction`, else
    uniform over the volume), the geometry (`ctseg.augment.draw_geometry`) and the intensity
    parameters. Stores are opened lazily, once per process, on first use of each record.

    `augment` is the experiment's ``data.augment`` mapping (flip, permute, intensity, elastic,
    scale, optional spacing). `target_params` (clip_distance, skeleton_method, tube_dilations,
    halo) override what the scratch metadata says; clip_distance is needed always (it pads sdt),
    the rest only with `runtime_targets`.
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
            flag = (np.asarray(record.planes[name][box]) != 0).view(np.uint8) * np.uint8(bit)
            bits = flag if bits is None else np.bitwise_or(bits, flag, out=bits)
        return bits, lo

    def _read_label(
        self, record: ScratchRecord, start: np.ndarray, size: Sequence[int]
    ) -> np.ndarray:
        """The 0/1/2 label of a box inside the volume (no padding)."""
        box = tuple(slice(int(a), int(a) + int(n)) for a, n in zip(start, size, strict=True))
        if record.masks is not None:
            return unpack_bits(np.asarray(record.masks[box]))["label"]
        label = (np.asarray(record.planes["foreground"][box]) != 0).view(np.uint8).copy()
        label[np.asarray(record.planes["ignore"][box]) != 0] = 2
        return label

    def _runtime_sources(
        self, record: ScratchRecord, start: np.ndarray, size: Sequence[int]
    ) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        """The starting point's way: targets from the label patch plus a halo, per sample.

        The halo window is cut at the volume faces rather than padded, exactly as the
        whole-volume computation sees them, so border patches match the precomputed ones too.
        """
        from ctseg.targets import targets_reference  # heavy; only the baseline needs it

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
        )
        packed = _pack(label, targets["skeleton"], targets["tube"])
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
        start = np.asarray(centre, np.int64) - np.array(self.patch_size) // 2
        return SamplePlan(
            index=index,
            record=k,
            start=tuple(int(s) for s in start),
            geometry=aug.draw_geometry(rng, self.patch_size, self.augment),
            intensity=aug.draw_intensity(rng, self.augment.get("intensity")),
        )

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

    def packed(self, indices: Sequence[int], pool: _SlotPool | None = None) -> PackedBatch:
        """Samples `indices` as one `PackedBatch`, each written straight into its row.

        The rows come from `pool` (a loader worker's shared buffers) or else from the heap.
        """
        plans = [self.plan(i) for i in indices]
        if not plans:
            raise IndexError("a packed batch needs at least one sample")
        # One layout per batch: a batch mixing uint8 and uint16 volumes carries uint16.
        dtype = np.result_type(*(self._record(p.record).image.dtype for p in plans))
        layout = PackedLayout(self.patch_size, np.dtype(dtype).name)
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
        """Sample `index` unpacked on the host, as `SAMPLE_KEYS` (module docstring): the image
        and sdt as stored, the four binary targets as uint8 planes, each patch (1, Z, Y, X)."""
        sample = {k: v[0] for k, v in self.packed([index]).unpacked().items()}
        sample["worker"] = int(sample["worker"])
        return sample


class _PackedStream(Dataset):
    """What `build_loader` gives the DataLoader: a whole batch per fetch, as a `PackedBatch`.

    The DataLoader calls `__getitems__` with a batch's indices when a dataset has it; the
    collate function then passes the batch through (`_as_batch`). In a worker the rows are
    that worker's shared slots (`_SlotPool`), handed back through `returns[worker id]` by the
    main process's `_SlotReturns` (set up by `PackedLoader` before the workers start).
    """

    def __init__(self, dataset: PatchDataset) -> None:
        self.dataset = dataset
        self.returns: list[Any] | None = None
        self._pool: _SlotPool | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: Sequence[int]) -> PackedBatch:
        info = get_worker_info()
        if info is None:
            return self.dataset.packed(indices)
        if self._pool is None or self._pool.pid != os.getpid():
            returns = None if self.returns is None else self.returns[info.id]
            self._pool = _SlotPool(returns)
        return self.dataset.packed(indices, self._pool)

    def __getitem__(self, index: int) -> PackedBatch:
        return self.__getitems__([index])


def _as_batch(batch: PackedBatch) -> PackedBatch:
    """The collate function of a packed loader: the batch is already one tensor."""
    return batch


# The number of references to a storage's memory (tensors, views, NumPy arrays of them, storage
# objects). Private to torch; without it, batches are copied out of their slots instead.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class _SlotReturns:
    """The main process's side of the slots: which it holds, and handing them back.

    A batch is yielded in its slot, without a copy, and the slot stays mapped here (so the
    slot's next batch needs no new mapping). The slot goes back to its worker once nothing but
    that mapping refers to its memory: no tensor, view or NumPy array of the batch is left,
    checked at every batch (a loop that keeps its last batch until the next frees it one
    batch later). Where torch cannot count references the batch is copied out instead, and
    the slot goes back at once, as it does when the pin-memory thread has already copied it.
    """

    def __init__(self, returns: list[Any]) -> None:
        self.returns = returns
        self.mapped: dict[tuple[int, int, int], torch.UntypedStorage] = {}
        self.lent: set[tuple[int, int, int]] = set()

    def claim(self, batch: PackedBatch) -> PackedBatch:
        """The batch as the caller may keep it; slots no longer used go back first."""
        self.give_back_unused()
        rows = batch.rows
        if batch.in_slot:
            storage = rows.untyped_storage()
            # The worker may send this slot's next batch by name (`_from_mapped_slot`).
            self.mapped[batch.slot] = storage
            _MAPPED_SLOTS[batch.slot[1:]] = storage
            if _use_count is not None:
                self.lent.add(batch.slot)
                return PackedBatch(rows, batch.layout)
            tune_malloc()  # the copies come from a warm heap, not fresh pages each time
            own = torch.empty(rows.shape, dtype=torch.uint8)
            np.copyto(own.numpy(), rows.numpy())  # one thread; torch's copy_ would use OpenMP
            rows = own
        self._give_back(batch.slot)
        return PackedBatch(rows, batch.layout)

    def give_back_unused(self) -> None:
        for slot in list(self.lent):
            # One reference: the storage object in `mapped`.
            if _use_count is not None and _use_count(self.mapped[slot]._cdata) <= 1:
                self.lent.discard(slot)
                self._give_back(slot)

    def _give_back(self, slot: tuple[int, int, int]) -> None:
        worker, pid, number = slot
        if 0 <= worker < len(self.returns):
            self.returns[worker].put((pid, number, slot in self.mapped))


class PackedLoader(DataLoader):
    """The DataLoader of `build_loader`: yields `PackedBatch`es and recycles worker slots.

    A worker's batch arrives in one of that worker's shared slots (`_SlotPool`); `_SlotReturns`
    decides when the slot may be written again: never while the caller still refers to the
    batch.
    """

    slot_returns: _SlotReturns | None = None

    def _get_iterator(self) -> Any:
        if self.num_workers > 0 and isinstance(self.dataset, _PackedStream):
            # Fresh queues for the workers this call starts (persistent ones start once).
            context = self.multiprocessing_context or torch.multiprocessing
            self.dataset.returns = [context.SimpleQueue() for _ in range(self.num_workers)]
            self.slot_returns = _SlotReturns(self.dataset.returns)
        return super()._get_iterator()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = super().__iter__()
        returns = self.slot_returns
        try:
            for batch in batches:
                if returns is not None and isinstance(batch, PackedBatch) and batch.slot:
                    batch = returns.claim(batch)
                yield batch
        finally:
            if not self.persistent_workers and self.slot_returns is returns:
                # These workers are gone: unmap their slots (batches still held keep theirs).
                self.slot_returns = None


class StreamSampler(Sampler[int]):
    """One process's share of the stream start, start + 1, ..., stop - 1; resumable at any index.

    With `world` processes (DDP ranks) the stream from `start` is cut into blocks of `chunk`
    consecutive indices (a micro-batch each) and dealt out in turn: rank `r` takes blocks
    r, r + world, r + 2 * world, ... So the ranks' streams are disjoint, together they are the
    one-process stream, and one optimizer step of `accumulate` micro-batches per rank consumes
    ``accumulate * world * chunk`` consecutive indices: a run resumed at a step boundary
    continues exactly. With ``world=1`` it is the plain stream.
    """

    def __init__(
        self, start: int, stop: int, *, rank: int = 0, world: int = 1, chunk: int = 1
    ) -> None:
        if start < 0:
            raise CtsegError(f"loader start must be >= 0, got {start}")
        if world < 1 or not 0 <= rank < world:
            raise CtsegError(f"sampler rank {rank} of world {world}: need 0 <= rank < world")
        if chunk < 1:
            raise CtsegError(f"sampler chunk must be >= 1, got {chunk}")
        self.start, self.stop = int(start), int(stop)
        self.rank, self.world, self.chunk = int(rank), int(world), int(chunk)

    def __iter__(self) -> Iterator[int]:
        stride = self.chunk * self.world
        for block in range(self.start + self.rank * self.chunk, self.stop, stride):
            yield from range(block, min(block + self.chunk, self.stop))

    def __len__(self) -> int:
        total = max(0, self.stop - self.start)
        whole, rest = divmod(total, self.chunk * self.world)
        return whole * self.chunk + min(self.chunk, max(0, rest - self.rank * self.chunk))


def seed_worker(worker_id: int, *, seed: int) -> None:
    """Seed the global RNGs of a worker from (seed, worker id).

    The samples themselves use their own generators; this only makes any library that draws
    from the global state reproducible.
    """
    state = np.random.SeedSequence([int(seed), int(worker_id)]).generate_state(2)
    np.random.seed(int(state[0]))
    random.seed(int(state[0]))
    torch.manual_seed(int(state[1]))


def build_loader(
    dataset: Dataset,
    phase: Mapping[str, Any],
    *,
    seed: int,
    start: int = 0,
    device: str | torch.device = "cpu",
    rank: int = 0,
    world: int = 1,
) -> DataLoader:
    """A DataLoader from a phase's loader settings (config/phases.yaml).

    For a `PatchDataset` it is a `PackedLoader` yielding `PackedBatch`es (module docstring).
    Keys: workers (0: samples are read in the main process, which on a small machine can be
    the fastest setting), batch_size, prefetch_factor and persistent_workers (only with
    workers > 0; torch refuses them otherwise, so they are dropped),
    pin_memory (only with a CUDA device that exists), mp_context (fork, spawn or forkserver;
    only with workers > 0), drop_last. The sampler walks the stream from `start`, so a run
    resumed at sample `start` gets the batches the interrupted run would have got next (when
    `start` is a multiple of the batch size). Under DDP, rank `rank` of `world` gets every
    world-th batch of that stream (`StreamSampler`).
    """
    workers = int(phase.get("workers", 0))
    batch_size = int(phase.get("batch_size", 1))
    if workers < 0:
        raise CtsegError(f"phase workers must be >= 0, got {workers}")
    if batch_size < 1:
        raise CtsegError(f"phase batch_size must be >= 1, got {batch_size}")
    on_cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    packed = isinstance(dataset, PatchDataset)
    kwargs: dict[str, Any] = {
        "batch_size": batch_size,
        "sampler": StreamSampler(start, len(dataset), rank=rank, world=world, chunk=batch_size),
        "num_workers": workers,
        "drop_last": bool(phase.get("drop_last", True)),
        "pin_memory": bool(phase.get("pin_memory", False)) and on_cuda,
        "worker_init_fn": functools.partial(seed_worker, seed=int(seed)),
        "generator": torch.Generator().manual_seed(int(seed)),
    }
    if packed:
        kwargs["collate_fn"] = _as_batch
    if workers > 0:
        context = phase.get("mp_context") or "fork"
        if context not in MP_CONTEXTS:
            raise CtsegError(f"phase mp_context must be one of {MP_CONTEXTS}, got {context!r}")
        prefetch = int(phase.get("prefetch_factor") or 2)
        if prefetch < 1:
            raise CtsegError(f"phase prefetch_factor must be >= 1, got {prefetch}")
        kwargs.update(
            multiprocessing_context=context,
            prefetch_factor=prefetch,
            persistent_workers=bool(phase.get("persistent_workers", False)),
        )
    if not packed:
        return DataLoader(dataset, **kwargs)
    return PackedLoader(_PackedStream(dataset), **kwargs)


def _normalised(
    image: torch.Tensor, intensity: torch.Tensor, aug_host: torch.Tensor
) -> torch.Tensor:
    """float32 image scaled by [p0_5, p99_5] to [0, 1], clipped, then intensity-augmented."""
    image = image.to(torch.float32)
    view = (-1,) + (1,) * (image.ndim - 1)
    low = intensity[:, 0].reshape(view)
    span = (intensity[:, 1] - intensity[:, 0]).clamp_min(1e-6).reshape(view)
    image = image.sub_(low).div_(span).clamp_(0.0, 1.0)
    return aug.apply_intensity(image, aug_host)


def _packed_to_device(
    batch: PackedBatch, device: torch.device, non_blocking: bool
) -> dict[str, Any]:
    """One host-to-device copy of the rows, then every field unpacked and converted there."""
    host = batch.layout.fields(batch.rows)
    fields = batch.layout.fields(batch.rows.to(device, non_blocking=non_blocking))
    intensity = fields["intensity"].contiguous()
    out: dict[str, Any] = {"image": _normalised(fields["image"], intensity, host["aug"].clone())}
    out.update(_unpack_planes(fields["bits"]))
    out["sdt"] = fields["sdt"].to(torch.float32).contiguous()
    out["intensity"] = intensity
    out["aug"] = fields["aug"].contiguous()
    out["index"] = host["index"].clone()
    out["worker"] = host["worker"].clone()
    return out


def to_device(
    batch: Mapping[str, Any] | PackedBatch,
    device: str | torch.device,
    non_blocking: bool = False,
) -> dict[str, Any]:
    """Move a batch to `device` and convert it there (see the module docstring).

    `batch` is what `build_loader` yields (a `PackedBatch`: one transfer, unpacked on the
    device) or `default_collate` of `PatchDataset` samples (the host layout, one transfer per
    field); both give the same result, bit for bit.
    """
    device = torch.device(device)
    if isinstance(batch, PackedBatch):
        return _packed_to_device(batch, device, non_blocking)
    out: dict[str, Any] = {}
    intensity = batch["intensity"].to(device, torch.float32, non_blocking=non_blocking)
    image = batch["image"].to(device, non_blocking=non_blocking)
    out["image"] = _normalised(image, intensity, batch["aug"])
    for name in ("label", "ignore", "skeleton", "tube"):
        out[name] = batch[name].to(device, non_blocking=non_blocking)
    out["sdt"] = batch["sdt"].to(device, non_blocking=non_blocking).to(torch.float32)
    out["intensity"] = intensity
    out["aug"] = batch["aug"].to(device, non_blocking=non_blocking)
    for name in ("index", "worker"):
        if name in batch:
            out[name] = batch[name]
    return out


class DevicePrefetcher:
    """Iterate a loader with batches already on the device (converted by `to_device`).

    On CUDA the next batch is copied and converted on a side stream while the current step
    runs; the compute stream waits for that stream before a batch is handed out, and every
    tensor is marked as used by the compute stream so the allocator cannot recycle it early.
    Elsewhere it is a plain pass-through with the same interface.

    After each `next`, `wait_s` is the time spent blocked in the loader for the batch fetched
    during that call and `transfer_s` the host time spent issuing its transfer.
    """

    def __init__(self, loader: Any, device: str | torch.device) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.wait_s = 0.0
        self.transfer_s = 0.0

    def __len__(self) -> int:
        return len(self.loader)

    def _fetch(self, iterator: Iterator[Any]) -> Any:
        t0 = time.perf_counter()
        try:
            batch = next(iterator)
        finally:
            self.wait_s = time.perf_counter() - t0
        return batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        iterator = iter(self.loader)
        if not self.cuda:
            while True:
                try:
                    batch = self._fetch(iterator)
                except StopIteration:
                    return
                t0 = time.perf_counter()
                out = to_device(batch, self.device)
                self.transfer_s = time.perf_counter() - t0
                yield out
        else:
            yield from self._cuda_iter(iterator)

    def _cuda_iter(self, iterator: Iterator[Any]) -> Iterator[dict[str, Any]]:
        stream = torch.cuda.Stream(device=self.device)

        def preload() -> dict[str, Any] | None:
            try:
                batch = self._fetch(iterator)
            except StopIteration:
                return None
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                out = to_device(batch, self.device, non_blocking=True)
            self.transfer_s = time.perf_counter() - t0
            return out

        upcoming = preload()
        while upcoming is not None:
            current_stream = torch.cuda.current_stream(self.device)
            current_stream.wait_stream(stream)
            batch = upcoming
            for value in batch.values():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(current_stream)
            # Issue the next copy before handing this batch out, so it overlaps this step.
            upcoming = preload()
            yield batch
