"""The files a run leaves for others to read: the per-step log (steps.csv) and a phase trial's
summary.json.

The training loop writes steps.csv and the trials write summary.json; the trials and the report
read them. Their columns and fields are defined here once, in a module that imports nothing
heavy, so the training loop can import `STEP_COLUMNS` without importing the trials or the report.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ctseg.io import CtsegError, atomic_path, strict_json

# The columns every steps.csv row has, in file order. The loss terms (one column per term with
# weight > 0, named as ctseg.network.losses names them) come between "loss" and "grad_norm": see
# `step_columns`.
STEP_COLUMNS: tuple[str, ...] = (
    "epoch",
    "step",
    "data_wait_s",
    "h2d_s",
    "compute_s",
    "step_s",
    "samples_per_s",
    "loss",
    "grad_norm",
    "lr",
    "gpu_util",
    "vram_peak_mb",
    "host_rss_mb",
)
# Diagnostics a reader must not insist on: logs written before they were added lack them.
STEP_OPTIONAL: tuple[str, ...] = ("grad_norm",)
STEP_REQUIRED: tuple[str, ...] = tuple(c for c in STEP_COLUMNS if c not in STEP_OPTIONAL)
# Achieved TFLOP/s (computed model FLOPs, forward and backward) and MFU (a fraction of the peak of
# the precision in use, every device's) on the computed FLOPs and on the useful ones (padding left
# out) at the row's samples/s: ctseg.network.flops.Efficiency.columns. Last in the row, and
# optional: logs written before them lack them (and before useful_mfu, that one).
EFFICIENCY_COLUMNS: tuple[str, ...] = ("tflops", "mfu", "useful_mfu")
_TERMS_AFTER = STEP_COLUMNS.index("loss") + 1


def step_columns(terms: Sequence[str], *, efficiency: bool = False) -> list[str]:
    """A steps.csv header: the fixed columns with the loss-term columns after "loss" (and the
    efficiency columns last, where the writer has them)."""
    extra = EFFICIENCY_COLUMNS if efficiency else ()
    return [*STEP_COLUMNS[:_TERMS_AFTER], *terms, *STEP_COLUMNS[_TERMS_AFTER:], *extra]


def loss_terms(columns: Iterable[str]) -> list[str]:
    """The loss-term columns of a steps.csv header, in file order."""
    return [c for c in columns if c not in STEP_COLUMNS and c not in EFFICIENCY_COLUMNS]


def add_efficiency_columns(path: Path, columns: Callable[[float], Mapping[str, float]]) -> None:
    """Rewrite a steps.csv with `EFFICIENCY_COLUMNS` from each row's samples/s (`columns`:
    ctseg.network.flops.Efficiency.columns), atomically; a file that has them already is left as
    is."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    absent = [c for c in EFFICIENCY_COLUMNS if c not in header]
    if not header or not absent:
        return
    for row in rows:
        speed = row.get("samples_per_s") or ""
        values = columns(float(speed)) if speed else {}
        row.update({k: values.get(k, "") for k in absent})
    with atomic_path(Path(path)) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*header, *absent])
        writer.writeheader()
        writer.writerows(rows)


# ---------------------------------------------------------------------------------------------
# summary.json of a phase trial

# 2: the trial records its verdict, next knob, step-time spread and the machine facts it used.
# 3: and its counted FLOPs, the peak, achieved TFLOP/s and MFU, and a kernel profile.
# 4: and the padding share (in flops), the useful MFU, and the convolution backend.
# Files without "version" were written before; their verdicts are "not recorded".
SUMMARY_VERSION = 4


@dataclass
class TrialSummary:
    """One phase trial's summary.json: what ran, what it measured, and its diagnosis.

    Every field but `phase` may be absent from a file (a failed trial has no figures; a summary
    from an older version has no verdict, spread or machine facts): absent is None (or empty),
    and a reader shows it as not recorded rather than working it out itself.
    """

    phase: int
    status: str = "failed"  # ok / over_memory / oom / failed
    settings: dict[str, Any] = field(default_factory=dict)
    # Settings that change the maths (batch_size, accumulate, precision, gpus), shown beside
    # the speed: a phase should change speed only.
    maths: dict[str, Any] = field(default_factory=dict)
    effective_batch: int | None = None
    trial_steps: int | None = None
    ceiling_steps: int | None = None
    warmup_steps: int | None = None
    # The machine facts the diagnosis used.
    cpu_count: int | None = None
    device: str | None = None
    scratch_format: str | None = None
    error: str | None = None
    traceback: str | None = None
    # Figures over the measured steps (after the warm-up).
    median_step_s: float | None = None
    samples_per_s: float | None = None
    data_wait_fraction: float | None = None
    h2d_fraction: float | None = None
    data_wait_s_per_step: float | None = None
    h2d_s_per_step: float | None = None
    ceiling_samples_per_s: float | None = None
    feed_efficiency: float | None = None
    # Half-width of the feed efficiency's uncertainty band (see ctseg.trials.diagnosis).
    feed_efficiency_band: float | None = None
    gpu_util_mean: float | None = None
    peak_vram_gb: float | None = None
    peak_host_rss_gb: float | None = None
    vram_limit_gb: float | None = None
    host_ram_limit_gb: float | None = None
    # "real" and "ceiling": n, median_s, q25_s, q75_s, iqr_s, mad_s, min_s, max_s, median_se_s.
    step_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    # The diagnosis: a label, the figures and rule behind it, and the next knob to turn.
    verdict: str | None = None
    verdict_reason: str | None = None
    next_knob: str | None = None
    thresholds: dict[str, float] = field(default_factory=dict)
    # Efficiency (version 3): ctseg.network.flops.FlopCount.to_dict,
    # ctseg.network.peaks.Peak.to_dict (with "devices": how many the samples/s ran on), achieved
    # TFLOP/s and MFU (a fraction of the peak) of the real and the ceiling run.
    flops: dict[str, Any] | None = None
    peak: dict[str, Any] | None = None
    tflops: float | None = None
    mfu: float | None = None
    ceiling_tflops: float | None = None
    ceiling_mfu: float | None = None
    # Version 4: MFU on the useful FLOPs (padding left out; flops has padding_share), and the
    # convolution backend with its versions (ctseg.network.backend.conv_backend).
    useful_mfu: float | None = None
    ceiling_useful_mfu: float | None = None
    backend: dict[str, Any] | None = None
    # The kernel profile (ctseg.trials.kernel_profile.summarise), or {"error": ...}.
    profile: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    version: int | None = None
    # Keys this version does not know (a newer writer's), kept so a rewrite loses nothing.
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**self.extra, **data}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: Path | str = "summary") -> TrialSummary:
        """A summary from its JSON object; `source` names the file in errors."""
        if not isinstance(data, Mapping):
            raise CtsegError(f"{source}: expected a JSON object, got {type(data).__name__}")
        phase = data.get("phase")
        if isinstance(phase, bool) or not isinstance(phase, int):
            raise CtsegError(f"{source}: not a trial summary ('phase' is {phase!r}, not a number)")
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v for k, v in data.items() if k in known and v is not None}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**values, extra=extra)

    @classmethod
    def read(cls, path: Path) -> TrialSummary:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CtsegError(f"{path}: cannot read trial summary JSON ({exc})") from exc
        return cls.from_dict(data, path)

    def write(self, path: Path) -> None:
        """Write atomically (a reader never sees half a summary)."""
        with atomic_path(Path(path)) as tmp:
            tmp.write_text(strict_json(self.to_dict(), indent=1, default=str))
