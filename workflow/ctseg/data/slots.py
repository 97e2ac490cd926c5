"""Shared-memory batch buffers ("slots") that loader workers reuse, and handing them back.

Filling fresh shared memory costs a page fault per 4 KiB in the worker: measured 0.74 ms per MB
on 2 cores, 3.9 ms for a 72x136x136 sample, more than reading the sample. So each worker keeps
its buffers (`SlotPool`) and the main process hands a slot back (`SlotReturns`) once nothing
there refers to the batch in it any more. A slot is named ``(worker id, worker pid, number)``.

Both sides deal in rows (a uint8 tensor (batch, nbytes)) and slot names only; what the bytes
mean is `ctseg.data.packing`'s business, and `ctseg.data.loader` wires the two sides to the
DataLoader. Relies on two private torch APIs (`ctseg.data.torch_private`):
`UntypedStorage._new_shared` and `torch._C._storage_Use_Count`.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ctseg.data.heap import tune_malloc

Slot = tuple[int, int, int]  # (worker id, worker pid, slot number)


class SlotPool:
    """A loader worker's shared-memory batch buffers, reused once the main process is done.

    A batch names its slot; the main process sends the slot back on `returns`, this worker's
    queue, once nothing there refers to the batch any more (`SlotReturns`); the worker takes
    back its returned slots before each batch. A slot is never written while the main process
    may still read it, and a worker with no free slot allocates a new one, so nothing waits on
    the main process: the slots grow to the number of this worker's batches in flight, which
    the DataLoader bounds (prefetch_factor).
    """

    def __init__(self, returns: Any) -> None:
        self.pid = os.getpid()
        self.returns = returns  # None: nobody hands slots back; every batch gets a new one
        self.slots: list[torch.UntypedStorage | None] = []
        self.free: list[int] = []
        self.mapped: set[int] = set()  # slots the main process keeps mapped

    def rows(self, batch: int, nbytes: int) -> tuple[torch.Tensor, Slot, bool]:
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
# `SlotReturns` of a running loader, and leaves this mapping with it.
MAPPED_SLOTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def mapped_rows(slot: Slot, batch: int, nbytes: int) -> torch.Tensor:
    """In the main process, the rows of a slot it keeps mapped (a batch sent by name)."""
    storage = MAPPED_SLOTS.get(slot[1:])
    if storage is None:
        raise RuntimeError(f"loader worker {slot[1]} sent slot {slot[2]}, which is not mapped here")
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return flat[: batch * nbytes].view(batch, nbytes)


# The number of references to a storage's memory (tensors, views, NumPy arrays of them, storage
# objects). Private to torch; without it, batches are copied out of their slots instead.
use_count = getattr(torch._C, "_storage_Use_Count", None)


class SlotReturns:
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
        self.mapped: dict[Slot, torch.UntypedStorage] = {}
        self.lent: set[Slot] = set()

    def claim(self, rows: torch.Tensor, slot: Slot, in_slot: bool) -> torch.Tensor:
        """The rows of a batch from `slot` as the caller may keep them; slots no longer used
        go back first. `in_slot`: the rows still are the slot's memory (not a pinned copy)."""
        self.give_back_unused()
        if in_slot:
            storage = rows.untyped_storage()
            # The worker may send this slot's next batch by name (`mapped_rows`).
            self.mapped[slot] = storage
            MAPPED_SLOTS[slot[1:]] = storage
            if use_count is not None:
                self.lent.add(slot)
                return rows
            tune_malloc()  # the copies come from a warm heap, not fresh pages each time
            own = torch.empty(rows.shape, dtype=torch.uint8)
            np.copyto(own.numpy(), rows.numpy())  # one thread; torch's copy_ would use OpenMP
            rows = own
        self._give_back(slot)
        return rows

    def give_back_unused(self) -> None:
        for slot in list(self.lent):
            # One reference: the storage object in `mapped`.
            if use_count is not None and use_count(self.mapped[slot]._cdata) <= 1:
                self.lent.discard(slot)
                self._give_back(slot)

    def _give_back(self, slot: Slot) -> None:
        worker, pid, number = slot
        if 0 <= worker < len(self.returns):
            self.returns[worker].put((pid, number, slot in self.mapped))
