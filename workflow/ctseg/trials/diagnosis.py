"""A phase trial's diagnosis: how precise its figures are, its bottleneck verdict and the next
knob worth turning. The trial (ctseg.trials.trials) records all of it in summary.json; the report
only shows it.

Precision. Each run's measured step times are summarised by their median, quartiles (IQR),
median absolute deviation (MAD), min and max. The median's standard error is taken as
1.2533 * sigma / sqrt(n) with sigma = 1.4826 * MAD (the normal-theory values, robust to the
odd slow step). The feed efficiency is ceiling median / real median, so its relative standard
error is the root sum of squares of the two medians' relative ones; its band is
±`BAND_STANDARD_ERRORS` of those (about a 95% interval).

Verdict rules, in order (thresholds in `THRESHOLDS`):

1. fewer than `MIN_MEASURED_STEPS` measured steps in either run: not measurable (no spread);
2. feed efficiency above 1 beyond its band: not measurable. The run with the loader was faster
   than the compute ceiling, so the two runs did not measure the same thing (a loaded machine,
   a ceiling run too short to warm up);
3. host-to-device > 10% of step time, at least the data wait, and per step larger than the
   step-time IQR: h2d-bound, if the feed efficiency is below 1 beyond its band (else the
   figures disagree: not measurable);
4. data wait > 10% of step time and per step larger than the step-time IQR: data-bound, on
   the same condition;
5. data wait or host-to-device above 10% but smaller than the step-time IQR: not measurable;
6. otherwise (little waiting): the band of the feed efficiency decides. Wholly below 0.90:
   host-contended (the model itself ran slower beside the loader: its workers took the cores or
   the memory bandwidth); wholly at or above 0.90: compute-bound; across 0.90: not measurable.

So a verdict never contradicts the figures beside it: data-bound always has a data wait above
10% that the noise cannot explain and a feed efficiency below 1 beyond its band, and
compute-bound always has little data wait and a feed efficiency measurably at the ceiling.

Knobs. More workers only while a core is free (one is kept for the training process), judged
on the CPU count of the machine that ran the trial; raw scratch only when the trial did not
read raw scratch; a larger batch only when VRAM headroom (limit / peak) > 2x, so doubling it
fits.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ctseg.formatting import fmt, num, pct
from ctseg.summaries import TrialSummary

DATA_WAIT_LIMIT = 0.10
# nnU-Net's benchmarking notes (an epoch with the real loader against one on batches already on
# the device) give 0.986 for a well-fed A100 (47.16 s vs 46.52 s) and 0.82 for a starved V100:
# below 0.90 the loader visibly costs throughput.
FEED_EFFICIENCY_LIMIT = 0.90
H2D_LIMIT = 0.10
VRAM_HEADROOM_FOR_BATCH = 2.0
MIN_MEASURED_STEPS = 3
BAND_STANDARD_ERRORS = 2.0
THRESHOLDS = {
    "data_wait_fraction": DATA_WAIT_LIMIT,
    "feed_efficiency": FEED_EFFICIENCY_LIMIT,
    "h2d_fraction": H2D_LIMIT,
    "vram_headroom_for_batch": VRAM_HEADROOM_FOR_BATCH,
    "min_measured_steps": MIN_MEASURED_STEPS,
    "band_standard_errors": BAND_STANDARD_ERRORS,
}
# The median's standard error for normal data is sqrt(pi / 2) sigma / sqrt(n); sigma is
# 1.4826 MAD for normal data.
_MEDIAN_SE = math.sqrt(math.pi / 2)
_MAD_SIGMA = 1.4826

LABELS = (
    "data-bound",
    "h2d-bound",
    "host-contended",
    "compute-bound",
    "not measurable",
    "out of memory",
    "over memory",
    "failed",
)


@dataclass(frozen=True)
class Verdict:
    label: str  # one of LABELS
    reason: str  # the figures it used and the rule that fired
    next_knob: str


# ---------------------------------------------------------------------------------------------
# Precision


def step_stats(times: Sequence[float]) -> dict[str, float]:
    """Median, spread and the median's standard error of a run's measured step times (s)."""
    values = sorted(float(t) for t in times)
    if not values:
        return {"n": 0}
    median = statistics.median(values)
    # "inclusive": the quartiles of the sample itself (2 values: a quarter of their gap).
    quartiles = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else []
    q25, q75 = (quartiles[0], quartiles[2]) if quartiles else (median, median)
    mad = statistics.median(abs(v - median) for v in values)
    return {
        "n": len(values),
        "median_s": median,
        "q25_s": q25,
        "q75_s": q75,
        "iqr_s": q75 - q25,
        "mad_s": mad,
        "min_s": values[0],
        "max_s": values[-1],
        "median_se_s": _MEDIAN_SE * _MAD_SIGMA * mad / math.sqrt(len(values)),
    }


def feed_efficiency_band(real: dict[str, float], ceiling: dict[str, float]) -> float:
    """Half-width of the feed efficiency's band: `BAND_STANDARD_ERRORS` standard errors of
    ceiling median / real median."""
    ratio = ceiling["median_s"] / real["median_s"]
    relative = math.hypot(
        real["median_se_s"] / real["median_s"], ceiling["median_se_s"] / ceiling["median_s"]
    )
    return BAND_STANDARD_ERRORS * ratio * relative


# ---------------------------------------------------------------------------------------------
# Verdict


def diagnose(summary: TrialSummary) -> Verdict:
    """The verdict of one trial from its own figures and machine facts; see the module doc."""
    settings = summary.settings or {}
    if summary.status == "oom":
        return _oom(summary, settings)
    if summary.status == "over_memory":
        return _over_memory(summary, settings)
    if summary.status != "ok":
        error = _short(summary.error or "no error recorded")
        return Verdict("failed", f"trial {summary.status}: {error}", "fix this error, rerun")
    verdict = _speed_verdict(summary, settings)
    profile = profile_text(summary)
    if not profile:
        return verdict
    knob = verdict.next_knob
    if verdict.label == "compute-bound":
        knob += f"; the profile's: {summary.profile['next_knob']}"
    return Verdict(verdict.label, f"{verdict.reason}; {profile}", knob)


def efficiency_text(s: TrialSummary) -> str:
    """How far the phase is from the device's peak: achieved TFLOP/s, MFU and the peak."""
    mfu, tflops, peak = num(s.mfu), num(s.tflops), s.peak or {}
    if mfu is None or tflops is None or not peak:
        return "MFU not recorded"
    devices = int(peak.get("devices", 1) or 1)
    total = num(peak.get("tflops"))
    where = "measured" if peak.get("source") == "measured" else f"table: {peak.get('detail')}"
    times = f"{devices} x " if devices > 1 else ""
    below = f", {1 / mfu:.1f}x below it" if mfu > 0 else ""
    return (
        f"{fmt(tflops)} TFLOP/s = MFU {100 * mfu:.1f}% of the {peak.get('precision')} peak "
        f"{times}{fmt(total)} TFLOP/s ({where}){below}"
    )


def profile_text(s: TrialSummary) -> str:
    """The kernel profile's largest class and its share; empty where none was recorded."""
    profile = s.profile or {}
    largest = profile.get("largest")
    if not largest:
        return ""
    share = (profile.get("classes", {}).get(largest) or {}).get("fraction")
    text = f"kernel profile: largest class {largest} ({pct(share)} of the profiled step)"
    return f"{text}, its knob: {profile['next_knob']}" if profile.get("next_knob") else text


def _speed_verdict(s: TrialSummary, settings: dict[str, Any]) -> Verdict:
    wait, h2d = num(s.data_wait_fraction), num(s.h2d_fraction)
    feed, band = num(s.feed_efficiency), num(s.feed_efficiency_band)
    real, ceiling = s.step_stats.get("real") or {}, s.step_stats.get("ceiling") or {}
    spread = num(real.get("iqr_s"))
    figures = (
        f"data wait {pct(wait)} of step time, feed efficiency "
        f"{_band(feed, band)}, host-to-device {pct(h2d)}"
    )
    if spread is not None:
        figures += f", step time {fmt(real.get('median_s'))} s (IQR {fmt(spread)} s)"

    def verdict(label: str, rule: str, knob: str) -> Verdict:
        return Verdict(label, f"{figures} → {label} ({rule})", knob)

    rerun = _rerun_knob(s)
    steps = min(int(real.get("n", 0)), int(ceiling.get("n", 0)))
    if wait is None or feed is None or band is None or spread is None:
        return verdict("not measurable", "no step-time spread or feed efficiency recorded", rerun)
    if steps < MIN_MEASURED_STEPS:
        rule = f"{steps} measured steps; at least {MIN_MEASURED_STEPS} are needed for a spread"
        return verdict("not measurable", rule, rerun)
    if feed - band > 1:
        rule = (
            f"feed efficiency above 1 beyond its ±{fmt(band, 2)}: the run with the loader was "
            "faster than the compute ceiling, so the two runs did not measure the same thing"
        )
        return verdict("not measurable", rule, rerun)
    at_ceiling = feed - band >= FEED_EFFICIENCY_LIMIT
    below = feed + band < FEED_EFFICIENCY_LIMIT
    below_one = feed + band < 1
    wait_s, h2d_s = num(s.data_wait_s_per_step) or 0.0, num(s.h2d_s_per_step) or 0.0
    costs = "feed efficiency below 1 beyond its band"
    disagree = "but the feed efficiency is not below 1 beyond its band: the figures disagree"
    if h2d is not None and h2d > H2D_LIMIT and h2d >= wait and h2d_s > spread:
        rule = (
            f"host-to-device > {pct(H2D_LIMIT)} of step time, ≥ data wait, "
            f"{fmt(h2d_s)} s per step > IQR"
        )
        if not below_one:
            return verdict("not measurable", f"{rule}, {disagree}", rerun)
        return verdict("h2d-bound", f"{rule}, {costs}", _h2d_knobs(settings))
    if wait > DATA_WAIT_LIMIT and wait_s > spread:
        rule = f"data wait > {pct(DATA_WAIT_LIMIT)} of step time, {fmt(wait_s)} s per step > IQR"
        if not below_one:
            return verdict("not measurable", f"{rule}, {disagree}", rerun)
        return verdict("data-bound", f"{rule}, {costs}", _data_knobs(s, settings))
    if wait > DATA_WAIT_LIMIT or (h2d is not None and h2d > H2D_LIMIT):
        which = "data wait" if wait > DATA_WAIT_LIMIT else "host-to-device"
        rule = f"{which} above {pct(DATA_WAIT_LIMIT)} but smaller than the step-time IQR"
        return verdict("not measurable", rule, rerun)
    little = f"data wait and host-to-device ≤ {pct(DATA_WAIT_LIMIT)}"
    if below:
        rule = (
            f"{little}, yet feed efficiency < {FEED_EFFICIENCY_LIMIT} beyond its band: the model "
            "ran slower beside the loader"
        )
        return verdict("host-contended", rule, _contended_knobs(s, settings))
    if at_ceiling:
        rule = (
            f"{little}, feed efficiency ≥ {FEED_EFFICIENCY_LIMIT} beyond its band; "
            f"{efficiency_text(s)}"
        )
        return verdict("compute-bound", rule, _compute_knobs(s, settings))
    rule = f"{little}, feed efficiency's band spans {FEED_EFFICIENCY_LIMIT}"
    return verdict("not measurable", rule, rerun)


def _band(value: float | None, band: float | None) -> str:
    if value is None:
        return "n/a"
    return fmt(value, 2) if band is None else f"{fmt(value, 2)} ± {fmt(band, 2)}"


def _short(text: str, limit: int = 160) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _knobs(knobs: list[str], fallback: str) -> str:
    if not knobs:
        return fallback
    rest = f"; then {'; '.join(knobs[1:])}" if len(knobs) > 1 else ""
    return f"{knobs[0]}{rest}"


def _rerun_knob(s: TrialSummary) -> str:
    steps = int(s.trial_steps or 0)
    more = f" (trial.steps {steps} → {2 * steps})" if steps else ""
    return f"rerun the trial with more steps{more}, on a machine nothing else is using"


def _data_knobs(s: TrialSummary, settings: dict[str, Any]) -> str:
    workers = int(settings.get("workers", 0) or 0)
    knobs = []
    cpus = s.cpu_count
    spare = None if cpus is None else cpus - 1 - workers  # one core for the training process
    if spare is None:
        knobs.append(f"more workers ({workers} now; the trial recorded no CPU count)")
    elif spare > 0:
        more = min(cpus - 1, max(2 * workers, workers + 1))
        knobs.append(f"more workers ({workers} → {more}; {cpus} CPU cores, {spare} free)")
    if s.scratch_format != "raw":
        now = f"{s.scratch_format} now" if s.scratch_format else "format not recorded"
        knobs.append(f"raw scratch format (uncompressed memmap reads; {now})")
    prefetch = int(settings.get("prefetch_factor", 2) or 2)
    if workers > 0 and prefetch < 4:
        knobs.append(f"larger prefetch_factor ({prefetch} → {2 * prefetch})")
    if workers > 0 and not settings.get("persistent_workers"):
        knobs.append("persistent workers")
    if spare is not None and spare <= 0:
        knobs.append(f"no free CPU core for more workers ({cpus} cores, {workers} workers)")
    return _knobs(knobs, "cheaper augmentation or smaller patches: the loader knobs are spent")


def _contended_knobs(s: TrialSummary, settings: dict[str, Any]) -> str:
    workers = int(settings.get("workers", 0) or 0)
    cpus = s.cpu_count
    where = f"{workers} workers on {cpus} CPU cores" if cpus else f"{workers} workers"
    knobs = []
    if workers > 1:
        knobs.append(f"fewer workers ({where}: {workers} → {workers // 2})")
    knobs.append("fewer torch threads in the training process (torch.set_num_threads)")
    return _knobs(knobs, "")


def _h2d_knobs(settings: dict[str, Any]) -> str:
    knobs = []
    if not settings.get("pin_memory"):
        knobs.append("pin_memory (off now)")
    if not settings.get("device_prefetch"):
        knobs.append("device-side prefetch (off now), so the copy overlaps compute")
    return _knobs(knobs, "pin_memory and device prefetch are on: send smaller dtypes (uint8)")


def _compute_knobs(s: TrialSummary, settings: dict[str, Any]) -> str:
    knobs = []
    if settings.get("precision", "fp32") == "fp32":
        knobs.append("bf16 autocast (fp32 now; changes the maths, reported beside the result)")
    if not settings.get("channels_last"):
        knobs.append("channels_last")
    if not settings.get("compile"):
        knobs.append("torch.compile")
    peak, limit = num(s.peak_vram_gb), num(s.vram_limit_gb)
    batch = int(settings.get("batch_size", 0) or 0)
    if not (peak and limit):
        batch_note = "no VRAM figure (CPU run), so no batch headroom to judge"
    else:
        room = f"VRAM headroom {limit / peak:.1f}x (peak {fmt(peak)} of {fmt(limit)} GB)"
        if limit / peak > VRAM_HEADROOM_FOR_BATCH and batch:
            knobs.append(
                f"a larger batch, {room} > {VRAM_HEADROOM_FOR_BATCH:g}x: batch {batch} → "
                f"{2 * batch} (changes the maths; scale the LR)"
            )
            batch_note = ""
        else:
            batch_note = f"keep the batch: {room} ≤ {VRAM_HEADROOM_FOR_BATCH:g}x"
    if not knobs:
        return f"none left on the loader side, the device is the limit ({batch_note})"
    return _knobs(knobs, "") + (f"; {batch_note}" if batch_note else "")


def maths_text(s: TrialSummary) -> str:
    maths = s.maths or {}
    return (
        f"batch {fmt(maths.get('batch_size'))} × accum. {fmt(maths.get('accumulate', 1))} = "
        f"{fmt(s.effective_batch)}, {maths.get('precision') or 'fp32'}"
    )


def _oom(s: TrialSummary, settings: dict[str, Any]) -> Verdict:
    batch = int(settings.get("batch_size", 1) or 1)
    error = _short(s.error or "no error recorded", 120)
    # The largest divisor up to half the batch keeps the effective batch exactly.
    smaller = next((d for d in range(batch // 2, 0, -1) if batch % d == 0), None)
    knobs = []
    if smaller is not None:
        knobs.append(
            f"batch {batch} → {smaller} with accumulate ×{batch // smaller} (same effective batch)"
        )
    knobs.append("gradient checkpointing")
    if settings.get("precision", "fp32") == "fp32":
        knobs.append("bf16 autocast (halves activation memory)")
    reason = f"status oom at {maths_text(s)} ({error}) → out of memory"
    return Verdict("out of memory", reason, _knobs(knobs, ""))


def _over_memory(s: TrialSummary, settings: dict[str, Any]) -> Verdict:
    checks = s.checks or {}
    parts, knobs = [], []
    if checks.get("vram_ok") is False:
        parts.append(f"peak VRAM {fmt(s.peak_vram_gb)} GB > limit {fmt(s.vram_limit_gb)} GB")
        knobs.append("a smaller batch with gradient accumulation, or gradient checkpointing")
    if checks.get("host_ram_ok") is False:
        parts.append(
            f"peak host RSS {fmt(s.peak_host_rss_gb)} GB > limit {fmt(s.host_ram_limit_gb)} GB"
        )
        workers = int(settings.get("workers", 0) or 0)
        prefetch = int(settings.get("prefetch_factor", 1) or 1)
        # Host memory in flight grows with workers x prefetch_factor x batch.
        knobs.append(f"fewer workers ({workers} → {max(1, workers // 2)})")
        if prefetch > 1:
            knobs.append(f"prefetch_factor {prefetch} → {max(1, prefetch // 2)}")
    measured = "; ".join(parts) or "a memory check failed"
    return Verdict("over memory", f"{measured} → over memory", _knobs(knobs, "a smaller batch"))
