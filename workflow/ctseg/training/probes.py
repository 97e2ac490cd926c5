"""What the training loop reads from the machine: GPU utilisation and host memory."""

from __future__ import annotations

import contextlib

import psutil
import torch


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
