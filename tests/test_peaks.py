"""The device peak (ctseg.network.peaks): the table's lookup by the names CUDA reports, the
precision in
use, and the measured fallback for a CPU or an unknown card."""

from __future__ import annotations

import pytest
import torch

from ctseg.network import peaks
from ctseg.network.peaks import device_peak, precision_in_use, probe_peak, table_peak


@pytest.mark.parametrize(
    ("name", "card", "bf16", "tf32"),
    [
        ("NVIDIA A100-SXM4-40GB", "A100", 312.0, 156.0),
        ("NVIDIA A100 80GB PCIe", "A100", 312.0, 156.0),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 494.7),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 378.0),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5, 417.5),
        ("NVIDIA H200", "H200 SXM", 989.4, 494.7),
        ("NVIDIA H200 NVL", "H200 NVL", 835.5, 417.5),
        ("NVIDIA L40S", "L40S", 362.05, 183.0),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2, 82.6),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 364.2, 182.1),
    ],
)
def test_table_lookup_by_the_reported_name(name, card, bf16, tf32):
    peak = table_peak(name, "bf16")
    assert peak is not None and peak.detail == card and peak.source == "table"
    assert peak.tflops == bf16
    assert table_peak(name, "tf32").tflops == tf32
    # Dense tensor-core figures: fp32 (no tensor cores) is always the smallest.
    assert table_peak(name, "fp32").tflops <= table_peak(name, "tf32").tflops


def test_unknown_cards_are_not_guessed():
    assert table_peak("NVIDIA RTX A6000", "bf16") is None  # Ampere, not the Ada card
    assert table_peak("NVIDIA Tesla V100-SXM2-16GB", "bf16") is None


def test_precision_in_use():
    assert precision_in_use("bf16", True, "cuda") == "bf16"
    assert precision_in_use("fp16", False, "cuda") == "fp16"
    assert precision_in_use("fp32", True, "cuda") == "tf32"
    assert precision_in_use(None, False, "cuda") == "fp32"
    assert precision_in_use("fp32", True, "cpu") == "fp32"  # TF32 is a CUDA mode


def test_cpu_gets_a_measured_peak():
    peak = device_peak("cpu", "fp32")
    assert peak.source == "measured" and peak.device_name == "cpu"
    assert peak.precision == "fp32" and "matmul probe" in peak.detail
    # A 2-core machine's fp32 matmul: well above 0.1 GFLOP/s, well below 100 TFLOP/s.
    assert 1e-4 < peak.tflops < 100


def test_unknown_cuda_card_falls_back_to_the_probe(monkeypatch):
    monkeypatch.setattr(peaks, "device_name", lambda device: "NVIDIA Tesla V100-SXM2-16GB")
    calls = []

    def probe(device: str, precision: str) -> peaks.Peak:
        calls.append((device, precision))
        return peaks.Peak(100.0, precision, "measured", "V100", "probe")

    monkeypatch.setattr(peaks, "probe_peak", probe)
    peak = device_peak(torch.device("cuda", 0), "bf16")
    assert calls == [("cuda:0", "bf16")] and peak.source == "measured"


def test_probe_runs_at_the_size_asked_and_says_so():
    small = probe_peak.__wrapped__("cpu", "fp32", 64, 0.05)
    assert small.tflops > 0 and "64x64" in small.detail
