"""The plan's estimate of a training's time (ctseg.network.estimate)."""

from __future__ import annotations

import pytest

from ctseg.config import load_experiment, load_phases, thaw
from ctseg.network import estimate, peaks
from ctseg.network.flops import count_flops
from ctseg.summaries import TrialSummary

PHASES = load_phases("config/phases.yaml")
FULL = load_experiment("config/experiments/exp001_full.yaml")
# exp001's small network (counted in well under a second) on exp001_full's schedule.
LONG = thaw(load_experiment("config/experiments/exp001.yaml"))
LONG["train"].update(epochs=32, steps_per_epoch=4000)


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (40, "~40 s"),
        (59.4, "~59 s"),
        (60, "~1.0 min"),
        (720, "~12 min"),
        (5400, "~1.5 h"),
        (3 * 86400, "~3.0 days"),
        (27 * 86400, "~3.9 weeks"),
    ],
)
def test_durations_read_as_a_person_plans(seconds: float, shown: str) -> None:
    assert estimate.duration(seconds) == shown


def test_samples_are_every_step_s_effective_batch() -> None:
    # 32 epochs x 4000 steps; phase 0 batch 1, phase 4 batch 4.
    assert estimate.training_samples(FULL, PHASES[0]) == 128_000
    assert estimate.training_samples(FULL, PHASES[4]) == 512_000


def test_a_trial_s_samples_per_s_is_the_rate(monkeypatch) -> None:
    trials = [
        TrialSummary(phase=0, status="ok", samples_per_s=2.0, device="cpu"),
        TrialSummary(phase=1, status="oom", samples_per_s=None),
    ]
    line = estimate.estimate_line("long", LONG, PHASES, 0, trials, "cuda")
    # 128,000 samples at 2 samples/s: 64,000 s, on no peak at all (cuda is never touched).
    assert line.startswith("long: training of 128,000 samples × 0.00607 TFLOP (phase 0): ")
    assert (
        f"{estimate.duration(64_000)} on this machine (its phase 0 trial on cpu: 2 samples/s)"
        in line
    )
    assert estimate.trial_rate(trials, 1) is None


def test_without_trials_a_cpu_plan_uses_its_peak_and_gives_the_gpu_figure(monkeypatch) -> None:
    probed = peaks.Peak(0.002, "fp32", "measured", "cpu", "matmul probe")
    monkeypatch.setattr(peaks, "probe_peak", lambda device, precision: probed)
    line = estimate.estimate_line("long", LONG, PHASES, 0, [], "cpu")
    train = count_flops(LONG["model"], LONG["data"]["patch_size"]).train
    on_cpu = 128_000 * train / (0.002e12 * estimate.STATED_MFU)
    # It trains in TF32 on a GPU (train.tf32, phase 0 fp32): the H200's 494.7 TFLOP/s.
    on_gpu = 128_000 * train / (494.7e12 * estimate.STATED_MFU)
    assert (
        f"{estimate.duration(on_cpu)} on this machine (10% of this CPU's measured 0.002 TFLOP/s "
        f"fp32 peak); on one H200 SXM at 10% MFU: {estimate.duration(on_gpu)}"
    ) in line
    assert on_cpu > 86400 and on_gpu < 60  # days here, seconds there
    # A short training on a CPU gets no GPU figure.
    short = estimate.estimate_line(
        "exp001", load_experiment("config/experiments/exp001.yaml"), PHASES, 0, [], "cpu"
    )
    assert "H200" not in short


def test_auto_before_its_trials_gives_the_range_of_its_phases(monkeypatch) -> None:
    probed = peaks.Peak(1.0, "fp32", "measured", "cpu", "matmul probe")
    monkeypatch.setattr(peaks, "probe_peak", lambda device, precision: probed)
    exp = load_experiment("config/experiments/exp001.yaml")  # trials phases 0, 1, 2
    line = estimate.estimate_line("exp001", exp, PHASES, "auto", [], "cpu")
    assert "(phase auto: [0, 1, 2], trials first)" in line
    # batch 1 (phases 0, 1) and 2 (phase 2): two figures, and no GPU figure for a short one.
    assert "–" in line and "H200" not in line
    chose = [TrialSummary(phase=p, status="ok", samples_per_s=s) for p, s in [(0, 1), (2, 4)]]
    assert "(phase 2)" in estimate.estimate_line("exp001", exp, PHASES, "auto", chose, "cpu")
