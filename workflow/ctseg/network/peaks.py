"""The device's peak: dense TFLOP/s per precision for the common cards, or a short matmul probe.

MFU (model FLOPs utilisation) is achieved FLOP/s over the peak of the precision in use. The
table holds the vendors' published *dense* figures (the datasheets print the 2:4-sparsity
figure first, twice the dense one; sparsity is not used here). Keyed on the name CUDA reports
(`torch.cuda.get_device_name`), matched on lowercase fragments, most specific first.

A device the table does not know, and a CPU, get a figure from `probe_peak`: the best of a few
large matrix products in that precision, recorded as measured (`Peak.source == "measured"`).
A measured peak is what the machine reached, not a vendor's ceiling: its MFU reads higher than
a table figure's would.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

PRECISIONS = ("bf16", "fp16", "tf32", "fp32")

# (fragments the lowercased, space-free name must all contain, card, {precision: TFLOP/s}).
# bf16 and fp16 are the tensor-core figures with FP32 accumulation.
_A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
# NVIDIA A100 Tensor Core GPU datasheet (all four variants, 40/80 GB, SXM4/PCIe: same clocks
# for the tensor figures): BF16 312 (624 sparse), TF32 156 (312 sparse), FP32 19.5.
_H100_SXM = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}
# NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 1,979 sparse, TF32 989 sparse, FP32 67.
# The H200 SXM datasheet prints the same compute figures (it changes the memory).
_H100_PCIE = {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}
# H100 datasheet, H100 PCIe: BF16 1,513 sparse, TF32 756 sparse, FP32 51.
_NVL = {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}
# H100 NVL (H100 datasheet) and H200 NVL (H200 datasheet): BF16 1,671 sparse, TF32 835 sparse,
# FP32 60.
_L40S = {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}
# NVIDIA L40S datasheet: BF16 733 sparse (362.05 dense), TF32 366 sparse, FP32 91.6.
_RTX_4090 = {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}
# NVIDIA Ada GPU architecture whitepaper, appendix table: GeForce RTX 4090, FP16/BF16 tensor
# with FP32 accumulate 165.2 (330.3 sparse), TF32 82.6 (165.2 sparse), FP32 82.6.
_RTX_6000_ADA = {"bf16": 364.2, "fp16": 364.2, "tf32": 182.1, "fp32": 91.1}
# Ada whitepaper, RTX 6000 Ada Generation: FP16/BF16 with FP32 accumulate 364.2 (728.5
# sparse), TF32 182.1 (364.2 sparse), FP32 91.1.

PEAKS: tuple[tuple[tuple[str, ...], str, dict[str, float]], ...] = (
    (("h100", "pcie"), "H100 PCIe", _H100_PCIE),
    (("h100", "nvl"), "H100 NVL", _NVL),
    (("h100",), "H100 SXM", _H100_SXM),  # "NVIDIA H100 80GB HBM3" is the SXM card
    (("h200", "nvl"), "H200 NVL", _NVL),
    (("h200",), "H200 SXM", _H100_SXM),
    (("a100",), "A100", _A100),
    (("l40s",), "L40S", _L40S),
    (("rtx", "4090"), "RTX 4090", _RTX_4090),
    (("rtx", "6000", "ada"), "RTX 6000 Ada", _RTX_6000_ADA),
)


@dataclass(frozen=True)
class Peak:
    """A peak in TFLOP/s for one precision; `source` "table" (with the card it matched) or
    "measured" (with the probe's matrix size)."""

    tflops: float
    precision: str
    source: str
    device_name: str
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def precision_in_use(precision: str | None, tf32: bool, device_type: str) -> str:
    """The tensor-core precision a phase's convolutions run in: bf16/fp16 autocast, else TF32
    where the experiment allows it on CUDA (train.tf32), else fp32."""
    if precision in ("bf16", "fp16"):
        return precision
    return "tf32" if tf32 and device_type == "cuda" else "fp32"


def table_peak(device_name: str, precision: str) -> Peak | None:
    """The table's dense peak for this card and precision; None for a card it does not know."""
    key = "".join(device_name.lower().split())
    for fragments, card, peaks in PEAKS:
        if all(f in key for f in fragments):
            return Peak(peaks[precision], precision, "table", device_name, card)
    return None


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "tf32": torch.float32,
    "fp32": torch.float32,
}


@functools.lru_cache(maxsize=8)
def probe_peak(device: str, precision: str, size: int | None = None, budget_s: float = 0.3) -> Peak:
    """The best TFLOP/s of `size`² matrix products in `precision` on `device`, over at most
    `budget_s` seconds (a warm-up product first). Once per process and device."""
    dev = torch.device(device)
    size = size or (4096 if dev.type == "cuda" else 512)
    dtype = _DTYPES[precision]
    a = torch.randn(size, size, device=dev).to(dtype)
    b = torch.randn(size, size, device=dev).to(dtype)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        best = float("inf")
        torch.mm(a, b)  # warm-up: kernel choice, allocation
        deadline = time.perf_counter() + budget_s
        for _ in range(20):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            torch.mm(a, b)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - start)
            if time.perf_counter() > deadline:
                break
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    tflops = 2 * size**3 / best / 1e12
    detail = f"matmul probe {size}x{size} {precision}, best of the products in {budget_s:g} s"
    return Peak(tflops, precision, "measured", device_name(dev), detail)


def device_peak(device: torch.device | str, precision: str) -> Peak:
    """The table's peak for a known card, else a probe's measurement."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {PRECISIONS}")
    name = device_name(device)
    return table_peak(name, precision) or probe_peak(str(torch.device(device)), precision)
