"""What the training loop reads from the machine (GPU utilisation, host memory), and two probes
of a training step that `bench/mfu.py` and the tests use: host synchronisations and layout
changes, counted."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def host_rss_bytes() -> int:
    """RSS of this process and all its children (the loader workers)."""
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.memory_info().rss
    return total


class GpuMonitor:
    """NVML utilisation where present; NaN elsewhere (CPU, or no NVML)."""

    def __init__(self, device: torch.device) -> None:
        self.handle = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                index = device.index if device.index is not None else torch.cuda.current_device()
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self._nvml = pynvml
            except Exception:  # NVML missing or unusable: utilisation is simply not reported
                self.handle = None

    def utilisation(self) -> float:
        if self.handle is None:
            return float("nan")
        return float(self._nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)


# ----------------------------------------------------------------------------- step probes
# The ways Python code reads a tensor's value on the host: each waits for the device to finish
# everything queued before it (a host synchronisation on CUDA).
_HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


@contextlib.contextmanager
def count_host_syncs() -> Iterator[collections.Counter]:
    """Count the host reads of tensor values (`_HOST_READS`) and ``torch.cuda.synchronize``
    calls made inside the block, by name: on any device, so a CPU run shows the syncs a CUDA
    run would make. Reads inside a compiled graph are not Python calls and are not seen; a
    graph break that reads a value is."""
    counts: collections.Counter = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
    saved_sync = torch.cuda.synchronize

    def counted(name: str, original: Callable) -> Callable:
        def read(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(*args, **kwargs)

        return read

    for name, original in saved.items():
        setattr(torch.Tensor, name, counted(name, original))
    torch.cuda.synchronize = counted("cuda.synchronize", saved_sync)
    try:
        yield counts
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        torch.cuda.synchronize = saved_sync


def layout_of(tensor: Any) -> str | None:
    """The memory format a 5D tensor's strides follow: ``channels_last`` (channels innermost),
    ``contiguous`` (channels outermost after the batch) or ``other``; None for anything else,
    and for a tensor whose layout is ambiguous (one channel, or no spatial axis longer than 1,
    where both formats have the same order)."""
    if not isinstance(tensor, torch.Tensor) or tensor.ndim != 5 or tensor.shape[1] == 1:
        return None
    spatial = [tensor.stride(d) for d in (2, 3, 4) if tensor.shape[d] > 1]
    if not spatial:
        return None
    channel = tensor.stride(1)
    if channel < min(spatial):
        return "channels_last"
    if channel > max(spatial):
        return "contiguous"
    return "other"


class _LayoutChanges(TorchDispatchMode):
    """Counts every operator that writes a new 5D tensor in a layout none of its 5D inputs has."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in tree_flatten((args, kwargs))[0] if layout_of(a)]
        if not inputs:
            return out
        held = {layout_of(a) for a in inputs}
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        for result in tree_flatten(out)[0]:
            layout = layout_of(result)
            new = layout and result.untyped_storage().data_ptr() not in storages  # not a view
            if new and layout not in held:
                shape = "x".join(map(str, result.shape))
                self.counts[f"{func} {'/'.join(sorted(held))} -> {layout} {shape}"] += 1
        return out


@contextlib.contextmanager
def count_layout_changes() -> Iterator[collections.Counter]:
    """Count the operators run inside the block (forward, backward and optimizer, eager) that
    write a 5D tensor in another memory format than their inputs': the copies a channels_last
    step pays when something converts to contiguous (or back). Views are not counted (they copy
    nothing), nor are one-channel tensors (both formats are the same there). Operators inside a
    compiled graph are not seen: a compiled step's copies are in its kernel profile."""
    mode = _LayoutChanges()
    with mode:
        yield mode.counts
