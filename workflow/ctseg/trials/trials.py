"""Phase trials: a short measured run per loader phase, its diagnosis, and the choice of phase
for `auto`.

A trial trains `trial.steps` steps with the phase's loader settings, then the compute ceiling:
the same model on batches already on the device, for max(`trial.ceiling_steps`,
`trial.steps`) steps. The ceiling runs at least as long as the real run and both leave out the
same `trial.warmup_steps`, so the two medians in the feed efficiency rest on at least as many
steps each (a 4-step ceiling gave feed efficiencies of 1.9 on a loaded 2-core machine). From
the measured steps it records the median step time, samples/s, the data-wait and
host-to-device fractions, the feed efficiency (real samples/s / ceiling samples/s) with its
uncertainty band, each run's step-time spread, the memory checks and the speed against
the previous phase; then its verdict and next knob (ctseg.trials.diagnosis) and the machine facts
the verdict used (CPU count, device, scratch format). The report only shows them.

Efficiency: the model's counted FLOPs per sample (ctseg.network.flops) and the peak of the
precision in use (ctseg.network.peaks) turn samples/s into achieved TFLOP/s and MFU, on the
computed FLOPs and on the useful ones (padding left out; the patch, its computed size and the
padding share are in ``flops``, and a padded patch is a note naming the unpadded one of the same
cost), in summary.json and as more columns of both runs' steps.csv. The ceiling run goes on for a
few profiled steps after its measured ones (ctseg.trials.kernel_profile; left out of its
figures): the time per kernel class. ``backend``: torch, CUDA and cuDNN versions and which
library ran the 3D convolutions (ctseg.network.backend; the profile's answer where it has one),
with the known-bad combination's warning as a note.

A trial that runs out of memory or fails is recorded, not raised, so the workflow goes on to
the next phase. Under torchrun every rank runs this same code (both runs are collective); rank
0 alone measures and writes.
"""

from __future__ import annotations

import contextlib
import csv
import statistics
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import torch

from ctseg.io import CtsegError, strict_json
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.machine import available_cpus
from ctseg.network.backend import conv_backend
from ctseg.network.flops import Efficiency, padding_warning
from ctseg.summaries import STEP_COLUMNS, SUMMARY_VERSION, TrialSummary, add_efficiency_columns
from ctseg.training.distributed import Ranks, pick_device
from ctseg.training.recipe import autocast_dtype
from ctseg.training.train import train
from ctseg.trials.diagnosis import THRESHOLDS, diagnose, feed_efficiency_band, step_stats
from ctseg.trials.kernel_profile import (
    PROFILE_STEPS,
    PROFILE_WARMUP,
    prepare,
    profiled_steps,
)

MATHS_KEYS = ("batch_size", "accumulate", "precision", "gpus")


# What an exhausted allocator says: CUDA ("CUDA out of memory"), torch's CPU allocator
# ("DefaultCPUAllocator: can't allocate memory: ... Error code 12 (Cannot allocate memory)")
# and ENOMEM from elsewhere; a loader worker killed by the kernel's OOM killer surfaces as a
# RuntimeError that names the signal.
OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory")


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    text = str(exc)
    return any(m in text.lower() for m in OOM_MESSAGES) or "killed by signal: Killed" in text


def _measured(steps_csv: Path, warmup: int, last: int | None = None) -> list[dict[str, float]]:
    """The rows after the warm-up (up to row `last`: the profiled steps come after it)."""
    with open(steps_csv, newline="") as handle:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(handle)]
    rows = rows[:last]
    return rows[warmup:] if len(rows) > warmup else rows


def profile_steps(trial: Mapping[str, Any]) -> int:
    """Steps the kernel profile covers (trial.profile_steps; 0: no profile)."""
    return int(trial.get("profile_steps", PROFILE_STEPS))


def ceiling_steps(trial: Mapping[str, Any]) -> int:
    """Steps of the compute-ceiling run: at least as many as the real run (see the module doc)."""
    return max(int(trial["ceiling_steps"]), int(trial["steps"]))


def run_trial(
    exp: Mapping[str, Any],
    phase_id: int,
    phase: Mapping[str, Any],
    *,
    scratch: Path,
    train_ids: list[str],
    out_dir: Path,
    clip_distance: float | None = None,
    previous: Path | None = None,
    device: str | None = None,
    ranks: Ranks | None = None,
    labels: LabelSpec = KAGGLE,
) -> TrialSummary:
    """Run one phase trial; rank 0 writes ``out_dir/summary.json`` (train writes steps.csv),
    training with `labels`, the dataset's label spec.

    Every rank of a torchrun job calls this with its `ranks` (default: one process). Each runs
    the same two collective runs; a failure on any rank is recorded by rank 0 alone.
    """
    ranks = ranks or Ranks()
    trial = exp["trial"]
    summary = TrialSummary(
        phase=phase_id,
        settings=dict(phase),
        # Settings that change the maths, reported beside the speed (a phase should only
        # change speed; these do not).
        maths={
            key: phase.get(key, 1 if key in ("accumulate", "gpus") else None) for key in MATHS_KEYS
        },
        effective_batch=int(phase["batch_size"]) * int(phase.get("accumulate", 1)),
        trial_steps=int(trial["steps"]),
        ceiling_steps=ceiling_steps(trial),
        warmup_steps=int(trial["warmup_steps"]),
        cpu_count=available_cpus(),
        device=str(pick_device(device)),
        # What the loader read: training takes the experiment's format (the one staged).
        scratch_format=exp.get("scratch_format"),
        thresholds=dict(THRESHOLDS),
        version=SUMMARY_VERSION,
    )
    _setup_notes(summary, exp, phase)
    if ranks.main:
        out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(scratch=scratch, train_ids=train_ids, val_ids=[], labels=labels)
    common.update(clip_distance=clip_distance, device=device)
    # The profile watches the ceiling's last steps, after its measured ones; every rank runs
    # them (the runs are collective), rank 0 profiles.
    profiled = profile_steps(trial)
    extra = PROFILE_WARMUP + profiled if profiled else 0
    device_type = pick_device(device).type
    watch = (
        profiled_steps(summary.ceiling_steps, profiled, device_type, phase)
        if profiled and ranks.main
        else contextlib.nullcontext({})
    )
    if profiled and ranks.main and phase.get("compile_mode") == "reduce-overhead":
        prepare(device_type)  # before the real run captures its CUDA graphs
    try:
        real = train(exp, phase, out_dir=out_dir, max_steps=int(trial["steps"]), **common)
        with watch as profile:
            train(
                exp,
                phase,
                out_dir=out_dir / "ceiling",
                max_steps=summary.ceiling_steps + extra,
                no_data=True,
                **common,
            )
        summary.profile = dict(profile) or None
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, then the workflow goes on
        summary.status = "oom" if _is_out_of_memory(exc) else "failed"
        summary.error = f"{type(exc).__name__}: {exc}"
        summary.traceback = traceback.format_exc(limit=8)
        _record_verdict(summary)
        if ranks.main:
            if not (out_dir / "steps.csv").exists():  # the rule's declared output
                (out_dir / "steps.csv").write_text(",".join(STEP_COLUMNS) + "\n")
            summary.write(out_dir / "summary.json")
        return summary
    if not ranks.main:  # rank 0 measures from the logs it wrote, and writes the summary
        summary.status = "ok"
        return summary
    _measure(summary, real, out_dir, exp)
    _backend(summary)
    if previous is not None and previous.exists():
        before = TrialSummary.read(previous)
        if before.status == "ok" and before.median_step_s and before.samples_per_s:
            summary.checks["previous_phase"] = before.phase
            summary.checks["step_time_vs_previous"] = summary.median_step_s / before.median_step_s
            summary.checks["speedup_vs_previous"] = summary.samples_per_s / before.samples_per_s
    _record_verdict(summary)
    summary.write(out_dir / "summary.json")
    return summary


def _setup_notes(summary: TrialSummary, exp: Mapping[str, Any], phase: Mapping[str, Any]) -> None:
    """What the settings say before anything runs: a padded patch, a scratch format the phase
    asks for but training does not read."""
    padded = padding_warning(exp["model"], exp["data"]["patch_size"])
    if padded:
        summary.notes.append(padded)
    if "scratch_format" in phase and phase["scratch_format"] != summary.scratch_format:
        summary.notes.append(
            f"the phase sets scratch_format {phase['scratch_format']!r}, but training reads the "
            f"staged scratch in the experiment's format {summary.scratch_format!r}"
        )


def _backend(summary: TrialSummary) -> None:
    """The convolution backend and its versions (the profile's answer where it has one); the
    known-bad combination's warning as a note."""
    seen = (summary.profile or {}).get("conv3d_backend")
    summary.backend = conv_backend(str(summary.device), autocast_dtype(summary.settings), seen)
    if summary.backend["warning"]:
        summary.notes.append(summary.backend["warning"])


def _measure(
    summary: TrialSummary, real: Mapping[str, Any], out_dir: Path, exp: Mapping[str, Any]
) -> None:
    """The figures of both runs' measured steps, and the memory checks, into `summary`."""
    trial = exp["trial"]
    warmup = int(trial["warmup_steps"])
    rows = _measured(out_dir / "steps.csv", warmup)
    ceiling_rows = _measured(out_dir / "ceiling" / "steps.csv", warmup, summary.ceiling_steps)
    real_stats = step_stats([r["step_s"] for r in rows])
    ceiling_stats = step_stats([r["step_s"] for r in ceiling_rows])
    batch = int(summary.effective_batch or 1)
    step_total = sum(r["step_s"] for r in rows)
    device = str(real["device"])
    device_total = (
        torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30
        if device.startswith("cuda")
        else None
    )
    vram_limit = trial["vram_limit_gb"] or device_total
    host_limit = trial["host_ram_limit_gb"] or 0.9 * psutil.virtual_memory().total / 2**30
    peak_vram_gb = None if real["peak_vram_mb"] is None else real["peak_vram_mb"] / 1024
    peak_rss_gb = real["peak_host_rss_mb"] / 1024
    checks = {
        "vram_ok": None if peak_vram_gb is None else peak_vram_gb <= vram_limit,
        "host_ram_ok": peak_rss_gb <= host_limit,
    }
    samples_per_s = batch / real_stats["median_s"]
    ceiling_samples_per_s = batch / ceiling_stats["median_s"]
    summary.status = (
        "ok" if checks["vram_ok"] is not False and checks["host_ram_ok"] else "over_memory"
    )
    summary.device = device
    summary.median_step_s = real_stats["median_s"]
    summary.samples_per_s = samples_per_s
    summary.data_wait_fraction = sum(r["data_wait_s"] for r in rows) / step_total
    summary.h2d_fraction = sum(r["h2d_s"] for r in rows) / step_total
    summary.data_wait_s_per_step = statistics.fmean(r["data_wait_s"] for r in rows)
    summary.h2d_s_per_step = statistics.fmean(r["h2d_s"] for r in rows)
    summary.ceiling_samples_per_s = ceiling_samples_per_s
    summary.feed_efficiency = samples_per_s / ceiling_samples_per_s
    summary.feed_efficiency_band = feed_efficiency_band(real_stats, ceiling_stats)
    summary.step_stats = {"real": real_stats, "ceiling": ceiling_stats}
    summary.gpu_util_mean = _nanmean([r.get("gpu_util", float("nan")) for r in rows])
    summary.peak_vram_gb = peak_vram_gb
    summary.peak_host_rss_gb = peak_rss_gb
    summary.vram_limit_gb = vram_limit
    summary.host_ram_limit_gb = host_limit
    summary.checks = checks
    _efficiency(summary, real, out_dir, exp)


def _efficiency(
    summary: TrialSummary, real: Mapping[str, Any], out_dir: Path, exp: Mapping[str, Any]
) -> None:
    """Achieved TFLOP/s and MFU of both runs, into `summary` and both steps.csv files. A
    failure to count is a note, not a failed trial: the speed figures stand without it."""
    try:
        # samples/s are of all processes together, so the peak is every device's.
        devices = int(real.get("world_size", 1) or 1)
        eff = Efficiency.for_run(exp, summary.settings, str(real["device"]), devices)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        summary.notes.append(f"no FLOP count or peak: {type(exc).__name__}: {exc}")
        return
    summary.flops = eff.flops.to_dict()
    summary.peak = {**eff.peak.to_dict(), "devices": eff.devices}
    real_sps, ceiling_sps = summary.samples_per_s, summary.ceiling_samples_per_s
    summary.tflops, summary.ceiling_tflops = eff.tflops(real_sps), eff.tflops(ceiling_sps)
    summary.mfu, summary.ceiling_mfu = eff.mfu(real_sps), eff.mfu(ceiling_sps)
    summary.useful_mfu, summary.ceiling_useful_mfu = (
        eff.useful_mfu(real_sps),
        eff.useful_mfu(ceiling_sps),
    )
    for path in (out_dir / "steps.csv", out_dir / "ceiling" / "steps.csv"):
        add_efficiency_columns(path, eff.columns)


def _record_verdict(summary: TrialSummary) -> None:
    verdict = diagnose(summary)
    summary.verdict, summary.verdict_reason = verdict.label, verdict.reason
    summary.next_knob = verdict.next_knob


def _nanmean(values: list[float]) -> float | None:
    finite = [v for v in values if v == v]
    return statistics.fmean(finite) if finite else None


def choose_phase(summaries: list[Path]) -> int:
    """`phase: auto`: the fastest phase (samples/s) whose trial finished ok."""
    ok = []
    for path in summaries:
        summary = TrialSummary.read(Path(path))
        if summary.status == "ok" and summary.samples_per_s is not None:
            ok.append((summary.samples_per_s, -summary.phase, summary.phase))
    if not ok:
        raise CtsegError(
            f"phase auto: no trial finished ok ({', '.join(str(p) for p in summaries)})"
        )
    return max(ok)[2]


def summary_json(summary: TrialSummary) -> str:
    """The summary as `ctseg trial` prints it."""
    return strict_json(summary.to_dict(), indent=1, default=str)
