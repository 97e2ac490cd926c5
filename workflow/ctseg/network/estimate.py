"""How long a planned training takes: its samples × the counted FLOPs of one (`ctseg.network.flops`)
÷ a rate, printed before its job runs.

The rate is measured where it can be: the samples/s of the experiment's phase trial for the
phase the training uses (`ctseg.summaries.TrialSummary`; under phase auto, the phase its trials
choose), so the FLOPs cancel out. Without a trial it is the device's peak in the precision in
use (`ctseg.network.peaks`: a datasheet figure, or a CPU's measured matmul peak) at
`STATED_MFU`. On a machine without a GPU, a training too long for it also gets the figure of
one reference GPU at the same efficiency, so a GPU setup planned on a laptop says what it would
cost where it is meant to run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ctseg.config import configured_gpus
from ctseg.runs import auto_phase
from ctseg.summaries import TrialSummary

# The share of a device's peak a training reaches, for a plan without a trial to measure it.
# GPU: BENCHMARKS.md's H200 check of exp001_full, phase 6 (bf16): 44.10 samples/s × 2.27 TFLOP
# = 100 TFLOP/s, 10.1% of the dense bf16 peak (phase 0, fp32/TF32: 30 TFLOP/s, 6.1%). CPU, 2
# cores: exp001_full's widths at 32×48×48 and 48×64×64 reached 10–18% of the matmul probe's
# fp32 peak (ctseg.network.peaks.probe_peak) fwd+bwd+AdamW; exp001's small widths ~1%, as
# per-layer overhead dominates a small network. One figure: 10%.
STATED_MFU = 0.10
# The card a CPU plan also gives a figure for: the one BENCHMARKS.md's MFU was measured on.
REFERENCE_GPU = "NVIDIA H200"
# A training estimated longer than this on a machine without a GPU also gets the GPU figure.
GPU_FIGURE_AFTER_S = 3600.0

_UNITS = (("week", 7 * 86400.0), ("day", 86400.0), ("h", 3600.0), ("min", 60.0))


def duration(seconds: float) -> str:
    """A duration as a person plans with it: ~40 s, ~12 min, ~3.4 h, ~2.5 days, ~3.1 weeks."""
    for unit, size in _UNITS:
        if seconds >= 1.5 * size or (unit == "min" and seconds >= 60):
            value = seconds / size
            shown = f"{value:.1f}" if value < 10 else f"{value:.0f}"
            plural = "s" if unit in ("week", "day") and shown != "1.0" else ""
            return f"~{shown} {unit}{plural}"
    return f"~{max(seconds, 1):.0f} s"


def training_samples(exp: Mapping[str, Any], phase: Mapping[str, Any]) -> int:
    """Samples a training under `phase` takes: every optimizer step's effective batch."""
    steps = int(exp["train"]["epochs"]) * int(exp["train"]["steps_per_epoch"])
    batch = int(phase["batch_size"]) * int(phase.get("accumulate", 1))
    return steps * batch * configured_gpus(exp, phase)


@dataclass(frozen=True)
class Rate:
    """Samples/s, and what they rest on, as a line says it."""

    samples_per_s: float
    basis: str


def trial_rate(trials: Sequence[TrialSummary], phase: int) -> Rate | None:
    """The samples/s `phase`'s trial measured, if it finished ok."""
    for summary in trials:
        if summary.phase == phase and summary.status == "ok" and summary.samples_per_s:
            where = f" on {summary.device}" if summary.device else ""
            basis = f"its phase {phase} trial{where}: {summary.samples_per_s:.3g} samples/s"
            return Rate(float(summary.samples_per_s), basis)
    return None


def peak_rate(flops_per_sample: float, peak: Any, devices: int) -> Rate:
    """`STATED_MFU` of `devices` × `peak` (a `ctseg.network.peaks.Peak`), in samples/s."""
    achieved = peak.tflops * 1e12 * devices * STATED_MFU
    source = "measured" if peak.source == "measured" else "datasheet"
    card = peak.detail if peak.source == "table" else peak.device_name
    card = "this CPU" if card == "cpu" else card
    many = f"{devices} × " if devices > 1 else ""
    basis = (
        f"{100 * STATED_MFU:.0f}% of {many}{card}'s {source} {peak.tflops:.3g} TFLOP/s "
        f"{peak.precision} peak"
    )
    return Rate(achieved / flops_per_sample, basis)


def _precision(exp: Mapping[str, Any], phase: Mapping[str, Any], device_type: str) -> str:
    from ctseg.network.peaks import precision_in_use

    return precision_in_use(phase.get("precision"), bool(exp["train"].get("tf32")), device_type)


def reference_gpu_line(
    exp: Mapping[str, Any], phase: Mapping[str, Any], samples: int, flops_per_sample: float
) -> str:
    """The same training on `REFERENCE_GPU`(s) at `STATED_MFU`."""
    from ctseg.network.peaks import table_peak

    peak = table_peak(REFERENCE_GPU, _precision(exp, phase, "cuda"))
    if peak is None:  # REFERENCE_GPU is in the table: only a table without it gets here
        return f"no peak of {REFERENCE_GPU} to compare with"
    gpus = configured_gpus(exp, phase)
    rate = peak_rate(flops_per_sample, peak, gpus)
    many = "one" if gpus == 1 else str(gpus)
    return (
        f"on {many} {peak.detail} at {100 * STATED_MFU:.0f}% MFU: "
        f"{duration(samples / rate.samples_per_s)}"
    )


def estimate_line(
    run: str,
    exp: Mapping[str, Any],
    phases: Mapping[int, Mapping[str, Any]],
    phase: int | str,
    trials: Sequence[TrialSummary],
    device: str,
) -> str:
    """The plan's line for a training of `run`'s experiment `exp` under `phase` (under auto:
    the phase its trials choose, or before they ran, the range over its trialled phases) on
    `device` ("cpu" or "cuda"): samples, FLOPs a sample, the estimate and its basis, and on a
    CPU, for a long one, the reference GPU's figure."""
    import torch

    from ctseg.network.flops import count_flops
    from ctseg.network.peaks import device_peak

    chosen = [phase] if phase != "auto" else list(exp["trial"]["phases"])
    if phase == "auto" and auto_phase(trials) is not None:
        chosen = [auto_phase(trials)]
    flops = count_flops(exp["model"], exp["data"]["patch_size"])
    cases = []
    for number in chosen:
        settings = phases[number]
        samples = training_samples(exp, settings)
        rate = trial_rate(trials, number)
        if rate is None:
            peak = device_peak(torch.device(device), _precision(exp, settings, device))
            devices = configured_gpus(exp, settings) if device == "cuda" else 1
            rate = peak_rate(flops.train, peak, devices)
        cases.append((samples / rate.samples_per_s, number, samples, rate))
    seconds, number, samples, rate = max(cases)
    fastest = min(cases)[0]
    span = (
        duration(seconds) if fastest == seconds else f"{duration(fastest)}–{duration(seconds)[1:]}"
    )
    which = f"phase {number}" if len(cases) == 1 else f"phase auto: {chosen}, trials first"
    line = (
        f"{run}: training of {samples:,} samples × {flops.train / 1e12:.3g} TFLOP ({which}): "
        f"{span} on this machine ({rate.basis})"
    )
    if device != "cuda" and seconds > GPU_FIGURE_AFTER_S:
        line += f"; {reference_gpu_line(exp, phases[number], samples, flops.train)}"
    return line
