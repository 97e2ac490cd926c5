"""Phase trials: a short measured run per loader phase, and the choice of phase for `auto`.

A trial trains `trial.steps` steps with the phase's loader settings, then `trial.ceiling_steps`
steps of the same model on batches already on the device. From the steps after the first
`trial.warmup_steps` it reports the median step time, samples/s, the data-wait fraction and
the feed efficiency (real samples/s / ceiling samples/s), with the seeds' checks: VRAM and host
RAM under their limits, and the speed against the previous phase. A trial that runs out of
memory or fails is recorded, not raised, so the workflow goes on to the next phase.
"""

from __future__ import annotations

import csv
import json
import statistics
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import torch

from ctseg.io import CtsegError, atomic_path
from ctseg.train import train

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


def _measured(steps_csv: Path, warmup: int) -> list[dict[str, float]]:
    with open(steps_csv, newline="") as handle:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(handle)]
    return rows[warmup:] if len(rows) > warmup else rows


def run_trial(
    exp: Mapping[str, Any],
    phase_id: int,
    phase: Mapping[str, Any],
    *,
    scratch: Path,
    train_ids: list[str],
    out_dir: Path,
    clip_distance: float,
    previous: Path | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Run one phase trial and write ``out_dir/summary.json`` (and ``steps.csv``)."""
    trial = exp["trial"]
    effective_batch = int(phase["batch_size"]) * int(phase.get("accumulate", 1))
    summary: dict[str, Any] = {
        "phase": phase_id,
        "settings": dict(phase),
        # Settings that change the maths, reported beside the speed (a phase should only
        # change speed; these do not).
        "maths": {
            key: phase.get(key, 1 if key in ("accumulate", "gpus") else None) for key in MATHS_KEYS
        },
        "effective_batch": effective_batch,
        "trial_steps": int(trial["steps"]),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(
        scratch=scratch, train_ids=train_ids, val_ids=[], clip_distance=clip_distance, device=device
    )
    try:
        real = train(exp, phase, out_dir=out_dir, max_steps=int(trial["steps"]), **common)
        train(
            exp,
            phase,
            out_dir=out_dir / "ceiling",
            max_steps=int(trial["ceiling_steps"]),
            no_data=True,
            **common,
        )
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, then the workflow goes on
        status = "oom" if _is_out_of_memory(exc) else "failed"
        summary.update(status=status, error=f"{type(exc).__name__}: {exc}")
        summary["traceback"] = traceback.format_exc(limit=8)
        if not (out_dir / "steps.csv").exists():
            (out_dir / "steps.csv").write_text("step\n")
        write_summary(out_dir / "summary.json", summary)
        return summary

    warmup = int(trial["warmup_steps"])
    rows = _measured(out_dir / "steps.csv", warmup)
    ceiling_rows = _measured(out_dir / "ceiling" / "steps.csv", min(warmup, 2))
    median_step = statistics.median(r["step_s"] for r in rows)
    ceiling_step = statistics.median(r["step_s"] for r in ceiling_rows)
    samples_per_s = effective_batch / median_step
    ceiling_samples_per_s = effective_batch / ceiling_step
    device_total = (
        torch.cuda.get_device_properties(torch.device(real["device"])).total_memory / 2**30
        if real["device"].startswith("cuda")
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
    summary.update(
        status="ok" if checks["vram_ok"] is not False and checks["host_ram_ok"] else "over_memory",
        device=real["device"],
        median_step_s=median_step,
        samples_per_s=samples_per_s,
        data_wait_fraction=sum(r["data_wait_s"] for r in rows) / sum(r["step_s"] for r in rows),
        h2d_fraction=sum(r["h2d_s"] for r in rows) / sum(r["step_s"] for r in rows),
        ceiling_samples_per_s=ceiling_samples_per_s,
        feed_efficiency=samples_per_s / ceiling_samples_per_s,
        gpu_util_mean=_nanmean([r.get("gpu_util", float("nan")) for r in rows]),
        peak_vram_gb=peak_vram_gb,
        peak_host_rss_gb=peak_rss_gb,
        vram_limit_gb=vram_limit,
        host_ram_limit_gb=host_limit,
        checks=checks,
    )
    if previous is not None and previous.exists():
        before = json.loads(previous.read_text())
        if before.get("status") == "ok":
            checks["previous_phase"] = before["phase"]
            checks["step_time_vs_previous"] = median_step / before["median_step_s"]
            checks["speedup_vs_previous"] = samples_per_s / before["samples_per_s"]
    write_summary(out_dir / "summary.json", summary)
    return summary


def _nanmean(values: list[float]) -> float | None:
    finite = [v for v in values if v == v]
    return statistics.fmean(finite) if finite else None


def write_summary(path: Path, summary: Mapping[str, Any]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(summary, indent=1, default=str))


def choose_phase(summaries: list[Path]) -> int:
    """`phase: auto`: the fastest phase (samples/s) whose trial finished ok."""
    ok = []
    for path in summaries:
        summary = json.loads(Path(path).read_text())
        if summary.get("status") == "ok":
            ok.append((summary["samples_per_s"], -summary["phase"], summary["phase"]))
    if not ok:
        raise CtsegError(
            f"phase auto: no trial finished ok ({', '.join(str(p) for p in summaries)})"
        )
    return max(ok)[2]
