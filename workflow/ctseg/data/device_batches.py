"""Batches on the device: one transfer, converted there, and the next one prefetched.

`to_device` copies a packed batch's rows (`ctseg.data.packing.PackedBatch`) to the device in one
transfer and unpacks them there into what the model and the losses use:
- ``image``: float32 (B, 1, Z, Y, X), scaled to [0, 1] by the volume's [p0_5, p99_5] and
  clipped, then intensity-augmented (values outside [0, 1] only from the added noise);
- ``label`` (stored values: 0/1/2 for Kaggle's, 0..K+1 for K classes), ``ignore``,
  ``skeleton``, ``tube`` (0/1): uint8 (B, 1, Z, Y, X), a quarter
  of the bytes of float; losses cast them (`.float()`, `== 1`) where they need to;
- ``sdt``: float32 (B, 1, Z, Y, X), clipped signed distance, positive outside the foreground;
- ``intensity``, ``aug``: float32 (B, 2) and (B, 6) on the device; ``index``, ``worker``:
  int64 (B,) left on the host for logging.
`to_device` also takes the host layout (`ctseg.data.packing.SAMPLE_KEYS`, `default_collate` of
`PatchDataset` samples); both give the same device batch, bit for bit. `DevicePrefetcher`
issues the next batch's transfer while the current step runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ctseg.data import augment as aug
from ctseg.data.packing import PackedBatch, unpack_planes


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
    out.update(unpack_planes(fields["bits"], batch.layout.n_classes))
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
    """Move a batch to `device` and convert it there (module docstring).

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
