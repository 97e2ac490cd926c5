"""The training DataLoader: a resumable, rank-sharded stream of packed batches.

`build_loader` turns a phase's loader settings (config/phases.yaml) into a DataLoader. For a
`ctseg.data.patches.PatchDataset` it is a `PackedLoader`: each fetch is a whole batch written by the
dataset into one uint8 tensor (`ctseg.data.packing.PackedBatch`), in a worker's reused shared-memory
buffer (`ctseg.data.slots`), which the loader hands back to its worker once the caller no longer
uses the batch.

`PackedLoader` is built on private torch APIs (`DataLoader._get_iterator`, the fetcher's use of
`Dataset.__getitems__`); `build_loader` checks them first (`ctseg.data.torch_private.require`), so a
torch without them fails there with one line naming the torch this was written for.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from ctseg.data import torch_private
from ctseg.data.packing import PackedBatch
from ctseg.data.patches import PatchDataset
from ctseg.data.slots import SlotPool, SlotReturns
from ctseg.io import CtsegError

MP_CONTEXTS = ("fork", "spawn", "forkserver")


class PackedStream(Dataset):
    """What `build_loader` gives the DataLoader: a whole batch per fetch, as a `PackedBatch`.

    The DataLoader calls `__getitems__` with a batch's indices when a dataset has it; the
    collate function then passes the batch through (`_as_batch`). In a worker the rows are
    that worker's shared slots (`SlotPool`), handed back through `returns[worker id]` by the
    main process's `SlotReturns` (set up by `PackedLoader` before the workers start).
    """

    def __init__(self, dataset: PatchDataset) -> None:
        self.dataset = dataset
        self.returns: list[Any] | None = None
        self._pool: SlotPool | None = None

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
            self._pool = SlotPool(returns)
        return self.dataset.packed(indices, self._pool)

    def __getitem__(self, index: int) -> PackedBatch:
        return self.__getitems__([index])


def _as_batch(batch: PackedBatch) -> PackedBatch:
    """The collate function of a packed loader: the batch is already one tensor.

    Anything else (a list of one-sample batches) means torch's fetcher no longer asks the
    dataset for whole batches through `__getitems__`.
    """
    if not isinstance(batch, PackedBatch):
        raise CtsegError(torch_private.message(torch_private.GETITEMS))
    return batch


class PackedLoader(DataLoader):
    """The DataLoader of `build_loader`: yields `PackedBatch`es and recycles worker slots.

    A worker's batch arrives in one of that worker's shared slots (`SlotPool`); `SlotReturns`
    decides when the slot may be written again: never while the caller still refers to the
    batch.
    """

    slot_returns: SlotReturns | None = None

    def _get_iterator(self) -> Any:
        if self.num_workers > 0 and isinstance(self.dataset, PackedStream):
            # Fresh queues for the workers this call starts (persistent ones start once).
            context = self.multiprocessing_context or torch.multiprocessing
            self.dataset.returns = [context.SimpleQueue() for _ in range(self.num_workers)]
            self.slot_returns = SlotReturns(self.dataset.returns)
        return super()._get_iterator()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = super().__iter__()
        returns = self.slot_returns
        try:
            for batch in batches:
                if returns is not None and isinstance(batch, PackedBatch) and batch.slot:
                    # No local name for the rows: one would keep this batch's slot busy
                    # through the next claim, and every worker would need one slot more.
                    batch = PackedBatch(
                        returns.claim(batch.rows, batch.slot, batch.in_slot), batch.layout
                    )
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
    if packed:
        torch_private.require()  # one line naming the torch this was written for, not a traceback
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
    return PackedLoader(PackedStream(dataset), **kwargs)
