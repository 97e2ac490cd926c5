"""Where the training step takes its batches from, and how long each one cost it.

A feed yields ``(batch on the device, data_wait_s, h2d_s)``: the seconds the step was blocked
waiting for the batch, and the seconds spent moving it to the device (copy and uint8 -> float
conversion). The training loop picks one at setup (`training_feed` picks between the first
two) and is the same for all of them:

- `host_batches`: the loader's host batches, moved to the device in the step;
- `prefetched_batches` (the phase's ``device_prefetch``): batches already converted on the
  device, the next one's copy issued before this one is handed out (`ctseg.data.device_batches
  .DevicePrefetcher`), so ``h2d_s`` is only the time spent issuing it and the copy itself
  overlaps the compute;
- `ResidentBatches` (``no_data``): the compute ceiling, one step's batches put on the device
  once and handed out again and again with no wait and no copy. Real throughput divided by
  this ceiling is the feed efficiency.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ctseg.data.device_batches import DevicePrefetcher, to_device
from ctseg.data.loader import build_loader
from ctseg.data.patches import PatchDataset
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.training.distributed import Ranks

Fed = tuple[dict[str, Any], float, float]  # (batch on the device, data_wait_s, h2d_s)


def host_batches(loader: Iterator[Any], dev: torch.device) -> Iterator[Fed]:
    """The loader's host batches, moved to the device here: the wait and the copy timed."""
    while True:
        t0 = time.perf_counter()
        try:
            host = next(loader)
        except StopIteration:
            return
        t1 = time.perf_counter()
        batch = to_device(host, dev, non_blocking=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        yield batch, t1 - t0, time.perf_counter() - t1


def prefetched_batches(feed: DevicePrefetcher) -> Iterator[Fed]:
    """Batches that come converted on the device, the next one's copy issued (on a side CUDA
    stream) before this one is handed out; `feed` reports the host time spent issuing it."""
    batches = iter(feed)
    while True:
        feed.transfer_s = 0.0  # stays 0 where no next batch was left to send
        t0 = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            return
        waited = time.perf_counter() - t0  # blocked in the loader, then issued the next copy
        yield batch, waited - feed.transfer_s, feed.transfer_s


class ResidentBatches:
    """The compute ceiling: the first `count` batches of `source` (one step's), kept on the
    device and handed out in turn for ever, with no wait and no copy. The source is let go."""

    def __init__(self, source: Iterator[Fed], count: int) -> None:
        self.batches = [next(source)[0] for _ in range(count)]

    def __iter__(self) -> Iterator[Fed]:
        for batch in itertools.cycle(self.batches):
            yield batch, 0.0, 0.0


def training_feed(
    exp: Mapping[str, Any],
    phase: Mapping[str, Any],
    scratch: Path,
    train_ids: list[str],
    dev: torch.device,
    ranks: Ranks,
    start: int,
    stop: int,
    labels: LabelSpec = KAGGLE,
) -> Iterator[Fed]:
    """This rank's share of the training stream's samples ``start`` to ``stop``, on `dev`, their
    labels in `labels`' stored values (`ctseg.labels.LabelSpec.stored`)."""
    dcfg, seed = exp["data"], int(exp["train"]["seed"])
    dataset = PatchDataset(
        scratch,
        train_ids,
        patch_size=dcfg["patch_size"],
        fmt=exp["scratch_format"],
        fg_fraction=dcfg["fg_fraction"],
        augment=dcfg["augment"],
        seed=seed,
        length=stop,
        runtime_targets=dcfg["runtime_targets"],
        labels=labels,
    )
    loader = build_loader(
        dataset, phase, seed=seed, start=start, device=dev, rank=ranks.rank, world=ranks.world
    )
    if phase.get("device_prefetch"):
        return prefetched_batches(DevicePrefetcher(loader, dev))
    return host_batches(iter(loader), dev)  # iter(): the loader workers start now
