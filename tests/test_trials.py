"""A trial's diagnosis (ctseg.trials.diagnosis) and its summary.json (ctseg.summaries.TrialSummary).

The verdict tests generate summaries over the whole range of figures (data wait, host-to-device,
feed efficiency and its band, step-time spread, step counts) and check every verdict against
the figures written beside it: no verdict may contradict them. The trials themselves run in
test_train (one process) and test_ddp (torchrun); no training here.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import numpy as np
import pytest

from ctseg.formatting import fmt, pct
from ctseg.io import CtsegError
from ctseg.machine import available_cpus
from ctseg.summaries import STEP_COLUMNS, SUMMARY_VERSION, TrialSummary, loss_terms, step_columns
from ctseg.trials.diagnosis import (
    BAND_STANDARD_ERRORS,
    DATA_WAIT_LIMIT,
    FEED_EFFICIENCY_LIMIT,
    H2D_LIMIT,
    LABELS,
    MIN_MEASURED_STEPS,
    THRESHOLDS,
    diagnose,
    feed_efficiency_band,
    step_stats,
)

SETTINGS = {
    "workers": 1,
    "batch_size": 1,
    "prefetch_factor": 1,
    "persistent_workers": False,
    "pin_memory": False,
    "device_prefetch": False,
    "precision": "fp32",
    "channels_last": False,
    "compile": False,
}


def measured(
    *,
    wait: float,
    h2d: float = 0.02,
    feed: float,
    band: float,
    median: float = 0.5,
    iqr: float = 0.01,
    n: int = 10,
    cpu_count: int | None = 8,
    scratch_format: str | None = "raw",
    settings: dict | None = None,
    **extra: object,
) -> TrialSummary:
    """An ok trial's summary with these figures (as ctseg.trials.trials writes them)."""
    stats = {"n": n, "median_s": median, "iqr_s": iqr, "mad_s": iqr / 2, "median_se_s": 0.0}
    return TrialSummary(
        phase=int(extra.pop("phase", 0)),
        status="ok",
        settings={**SETTINGS, **(settings or {})},
        maths={"batch_size": 1, "accumulate": 1, "precision": "fp32", "gpus": 1},
        effective_batch=1,
        trial_steps=n + 2,
        cpu_count=cpu_count,
        device="cuda:0",
        scratch_format=scratch_format,
        median_step_s=median,
        samples_per_s=1 / median,
        data_wait_fraction=wait,
        h2d_fraction=h2d,
        data_wait_s_per_step=wait * median,
        h2d_s_per_step=h2d * median,
        feed_efficiency=feed,
        feed_efficiency_band=band,
        step_stats={"real": stats, "ceiling": dict(stats)},
        **{"peak_vram_gb": 20.0, "vram_limit_gb": 80.0, **extra},
    )


# --------------------------------------------------------------------------- no contradiction
def random_summaries(count: int, seed: int = 0) -> list[TrialSummary]:
    """Summaries over the whole range, with many near the thresholds and near 1."""
    rng = random.Random(seed)
    pick = [0.0, 0.02, DATA_WAIT_LIMIT, 0.11, 0.3, 0.62, 0.9]
    out = []
    for _ in range(count):
        wait = rng.choice(pick) if rng.random() < 0.3 else rng.uniform(0, 0.9)
        h2d = rng.choice(pick) if rng.random() < 0.3 else rng.uniform(0, 0.9 - wait)
        feed = rng.choice([0.41, 0.89, 0.9, 0.95, 1.0, 1.05, 1.9]) + rng.uniform(-0.05, 0.05)
        band = rng.choice([0.0, 0.01, 0.05, 0.2, 1.0]) * rng.random()
        median = rng.uniform(0.01, 3.0)
        iqr = median * rng.choice([0.0, 0.01, 0.1, 0.5, 1.0]) * rng.random()
        n = rng.choice([1, 2, MIN_MEASURED_STEPS, 10, 100])
        out.append(measured(wait=wait, h2d=h2d, feed=feed, band=band, median=median, iqr=iqr, n=n))
    return out


def test_no_verdict_contradicts_the_figures_beside_it():
    seen = set()
    for s in random_summaries(4000):
        v = diagnose(s)
        seen.add(v.label)
        wait, h2d = s.data_wait_fraction, s.h2d_fraction
        feed, band = s.feed_efficiency, s.feed_efficiency_band
        iqr, n = s.step_stats["real"]["iqr_s"], s.step_stats["real"]["n"]
        case = f"{v.label}: {v.reason} (wait {wait}, h2d {h2d}, feed {feed} ± {band}, n {n})"
        assert v.label in LABELS, case
        # The figures written beside the verdict are the summary's own.
        assert v.reason.startswith(f"data wait {pct(wait)} of step time, feed efficiency "), case
        assert f"feed efficiency {fmt(feed, 2)} ± {fmt(band, 2)}" in v.reason, case
        assert f"host-to-device {pct(h2d)}" in v.reason, case
        assert f"→ {v.label} (" in v.reason and v.next_knob, case
        if v.label == "data-bound":
            assert wait > DATA_WAIT_LIMIT and s.data_wait_s_per_step > iqr, case
            assert feed + band < 1, case  # the loader measurably costs throughput
        if v.label == "h2d-bound":
            assert h2d > H2D_LIMIT and h2d >= wait and s.h2d_s_per_step > iqr, case
            assert feed + band < 1, case
        if v.label == "compute-bound":
            assert wait <= DATA_WAIT_LIMIT and h2d <= H2D_LIMIT, case
            assert FEED_EFFICIENCY_LIMIT <= feed - band <= 1, case
        if v.label == "host-contended":
            assert wait <= DATA_WAIT_LIMIT and h2d <= H2D_LIMIT, case
            assert feed + band < FEED_EFFICIENCY_LIMIT, case
        # Above 1 beyond noise, too few steps, or a wait below the noise: nothing to conclude.
        if feed - band > 1 or n < MIN_MEASURED_STEPS:
            assert v.label == "not measurable", case
        if wait == 0:
            assert v.label != "data-bound", case
    # The generator reaches every speed verdict, so each invariant above was exercised.
    assert seen >= {"data-bound", "h2d-bound", "compute-bound", "host-contended", "not measurable"}


def test_feed_efficiency_above_one_is_never_data_bound():
    """The demo on 2 shared cores: feed efficiency 1.9 from a short ceiling, data wait 0%."""
    v = diagnose(measured(wait=0.0, h2d=0.0, feed=1.9, band=0.2))
    assert v.label == "not measurable"
    assert "faster than the compute ceiling" in v.reason
    assert "rerun the trial with more steps (trial.steps 12 → 24)" in v.next_knob
    # Even with a large data wait, a real run faster than its ceiling is no diagnosis.
    assert diagnose(measured(wait=0.5, feed=1.3, band=0.1)).label == "not measurable"


def test_effects_within_the_noise_are_not_measurable():
    # Feed efficiency 1.0 ± 0.3: cannot tell data-bound from compute-bound.
    v = diagnose(measured(wait=0.01, feed=1.0, band=0.3))
    assert v.label == "not measurable" and "band spans 0.9" in v.reason
    # A data wait of 15% that is smaller than the step-time spread.
    v = diagnose(measured(wait=0.15, feed=0.8, band=0.05, median=0.5, iqr=0.2))
    assert v.label == "not measurable"
    assert "data wait above 10% but smaller than the step-time IQR" in v.reason
    # A wait the noise cannot explain, but a feed efficiency at the ceiling: they disagree.
    v = diagnose(measured(wait=0.3, feed=1.0, band=0.02))
    assert v.label == "not measurable" and "the figures disagree" in v.reason
    # Two measured steps give no spread worth the name.
    v = diagnose(measured(wait=0.6, feed=0.4, band=0.01, n=2))
    assert v.label == "not measurable" and "2 measured steps" in v.reason


# --------------------------------------------------------------------------- verdicts and knobs
def test_data_bound_with_free_cores_suggests_more_workers():
    v = diagnose(measured(wait=0.6234, h2d=0.031, feed=0.4127, band=0.03))
    assert v.label == "data-bound"
    assert v.reason.startswith("data wait 62% of step time, feed efficiency 0.41 ± 0.030")
    assert v.next_knob.startswith("more workers (1 → 2; 8 CPU cores, 6 free)")
    assert "raw scratch" not in v.next_knob  # the trial read raw scratch already


def test_data_bound_judges_cores_and_scratch_on_what_the_trial_recorded():
    s = measured(wait=0.4, feed=0.6, band=0.05, cpu_count=2, scratch_format="zarr")
    v = diagnose(s)
    assert v.label == "data-bound"
    assert v.next_knob.startswith("raw scratch format (uncompressed memmap reads; zarr now)")
    assert "no free CPU core for more workers (2 cores, 1 workers)" in v.next_knob
    v = diagnose(measured(wait=0.4, feed=0.6, band=0.05, cpu_count=None, scratch_format=None))
    assert "the trial recorded no CPU count" in v.next_knob
    assert "format not recorded" in v.next_knob


def test_compute_bound_with_and_without_vram_headroom():
    v = diagnose(measured(wait=0.04, feed=0.97, band=0.02, settings={"batch_size": 2}))
    assert v.label == "compute-bound"
    assert v.next_knob.startswith("bf16 autocast")
    assert "VRAM headroom 4.0x (peak 20.0 of 80.0 GB) > 2x: batch 2 → 4" in v.next_knob
    on = {"precision": "bf16", "channels_last": True, "compile": True}
    v = diagnose(measured(wait=0.0, feed=0.99, band=0.01, settings=on, peak_vram_gb=50.0))
    assert v.label == "compute-bound"
    assert v.next_knob.startswith("none left on the loader side")
    assert "VRAM headroom 1.6x (peak 50.0 of 80.0 GB) ≤ 2x" in v.next_knob


def test_compute_bound_says_how_far_from_the_peak_and_names_the_profile():
    on = {"precision": "bf16", "channels_last": True, "compile": True}
    peak = {"tflops": 989.4, "precision": "bf16", "source": "table", "detail": "H200 SXM"}
    profile = {
        "classes": {"conv backward": {"fraction": 0.41}, "idle": {"fraction": 0.1}},
        "largest": "conv backward",
        "next_knob": "the convolutions themselves",
    }
    s = measured(
        wait=0.0, feed=0.99, band=0.01, settings=on, tflops=105.7, mfu=0.1068, peak=peak,
        profile=profile,
    )  # fmt: skip
    v = diagnose(s)
    assert v.label == "compute-bound"
    assert (
        "106 TFLOP/s = MFU 10.7% of the bf16 peak 989 TFLOP/s (table: H200 SXM), 9.4x below it"
        in v.reason
    )
    assert v.reason.endswith(
        "kernel profile: largest class conv backward (41% of the profiled step), its knob: "
        "the convolutions themselves"
    )
    assert v.next_knob.endswith("; the profile's: the convolutions themselves")
    # Without the figures (an older summary) the verdict says so rather than guessing.
    old = diagnose(measured(wait=0.0, feed=0.99, band=0.01, settings=on))
    assert "MFU not recorded" in old.reason and "kernel profile" not in old.reason


def test_h2d_bound_and_host_contended():
    v = diagnose(measured(wait=0.08, h2d=0.22, feed=0.7, band=0.05))
    assert v.label == "h2d-bound"
    assert "pin_memory (off now); then device-side prefetch" in v.next_knob
    v = diagnose(measured(wait=0.0, h2d=0.0, feed=0.5, band=0.05, settings={"workers": 4}))
    assert v.label == "host-contended"
    assert "fewer workers (4 workers on 8 CPU cores: 4 → 2)" in v.next_knob


def test_memory_and_failure_verdicts():
    base = {"phase": 2, "settings": {**SETTINGS, "batch_size": 8}, "effective_batch": 8}
    maths = {"batch_size": 8, "accumulate": 1, "precision": "fp32"}
    oom = TrialSummary(**base, maths=maths, status="oom", error="OutOfMemoryError: CUDA oom")
    v = diagnose(oom)
    assert v.label == "out of memory"
    assert "batch 8 × accum. 1 = 8, fp32" in v.reason and "CUDA oom" in v.reason
    assert v.next_knob.startswith("batch 8 → 4 with accumulate ×2 (same effective batch)")
    over = TrialSummary(
        phase=3,
        status="over_memory",
        settings={**SETTINGS, "workers": 6, "prefetch_factor": 4},
        peak_host_rss_gb=170.0,
        host_ram_limit_gb=150.0,
        checks={"vram_ok": True, "host_ram_ok": False},
    )
    v = diagnose(over)
    assert v.label == "over memory" and "peak host RSS 170 GB > limit 150 GB" in v.reason
    assert "fewer workers (6 → 3)" in v.next_knob and "prefetch_factor 4 → 2" in v.next_knob
    v = diagnose(TrialSummary(phase=7, status="failed", error="RuntimeError: boom"))
    assert v.label == "failed" and "RuntimeError: boom" in v.reason


# --------------------------------------------------------------------------- precision
def test_step_stats_are_the_samples_own():
    times = [0.5, 0.52, 0.49, 0.51, 2.0, 0.5, 0.48]  # one slow step
    stats = step_stats(times)
    assert stats["n"] == 7 and stats["median_s"] == 0.5
    assert (stats["min_s"], stats["max_s"]) == (0.48, 2.0)
    q25, q75 = np.percentile(times, [25, 75])  # numpy's default is the inclusive method
    assert stats["iqr_s"] == pytest.approx(q75 - q25)
    assert stats["mad_s"] == pytest.approx(statistics.median(abs(t - 0.5) for t in times))
    # Robust: the slow step barely moves the median's standard error.
    assert stats["median_se_s"] < 0.02


def test_feed_efficiency_band_adds_both_runs_relative_errors():
    real = {"median_s": 1.0, "median_se_s": 0.03}
    ceiling = {"median_s": 0.5, "median_se_s": 0.02}
    band = feed_efficiency_band(real, ceiling)
    assert band == pytest.approx(BAND_STANDARD_ERRORS * 0.5 * (0.03**2 + 0.04**2) ** 0.5)
    exact = {"median_s": 1.0, "median_se_s": 0.0}
    assert feed_efficiency_band(exact, exact) == 0.0


# --------------------------------------------------------------------------- summary.json
def test_summary_round_trip_and_an_older_summary(tmp_path: Path):
    s = measured(wait=0.3, feed=0.7, band=0.05, thresholds=dict(THRESHOLDS))
    s.version = SUMMARY_VERSION
    path = tmp_path / "phase0" / "summary.json"
    path.parent.mkdir()
    s.write(path)
    assert [p.name for p in path.parent.iterdir()] == ["summary.json"]  # no temporary left
    assert TrialSummary.read(path) == s
    # A summary from before trials recorded their diagnosis: read, not worked out.
    old = {"phase": 1, "status": "ok", "samples_per_s": 2.5, "feed_efficiency": 0.97}
    (tmp_path / "old.json").write_text(json.dumps({**old, "future_field": [1]}))
    read = TrialSummary.read(tmp_path / "old.json")
    assert (read.verdict, read.cpu_count, read.device, read.step_stats) == (None, None, None, {})
    assert read.version is None and read.samples_per_s == 2.5
    assert read.to_dict()["future_field"] == [1]  # kept for a rewrite


@pytest.mark.parametrize(
    ("text", "problem"),
    [("{not json", "cannot read trial summary JSON"), ("[1, 2]", "expected a JSON object"),
     ('{"status": "ok"}', "not a trial summary")],
)  # fmt: skip
def test_a_bad_summary_is_an_error_naming_the_file(tmp_path: Path, text: str, problem: str):
    path = tmp_path / "phase4" / "summary.json"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(CtsegError, match=f"phase4/summary.json.*{problem}"):
        TrialSummary.read(path)


def test_step_columns_put_the_loss_terms_after_the_total():
    header = step_columns(["bce", "skel_recall"])
    assert header[: header.index("loss") + 1] == list(STEP_COLUMNS[: header.index("loss") + 1])
    assert header[header.index("loss") + 1 : header.index("loss") + 3] == ["bce", "skel_recall"]
    assert loss_terms(header) == ["bce", "skel_recall"]  # not grad_norm, not lr
    assert set(header) - {"bce", "skel_recall"} == set(STEP_COLUMNS)


def test_one_cpu_count_for_the_package():
    import ctseg.preprocess.targets

    assert 1 <= available_cpus() <= (__import__("os").cpu_count() or 1)
    assert ctseg.preprocess.targets.available_cpus is available_cpus
