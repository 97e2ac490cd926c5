"""The files a run leaves for others to read: the per-step log (steps.csv) columns.

The training loop writes steps.csv with these columns and the report and the trials read them,
so the names live here, in a module that imports nothing heavy (the training loop imports it
without importing the trials or the report).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# The columns every steps.csv row has, in file order. The loss terms (one column per term with
# weight > 0, named as ctseg.losses names them) come between "loss" and "grad_norm": see
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
_TERMS_AFTER = STEP_COLUMNS.index("loss") + 1


def step_columns(terms: Sequence[str]) -> list[str]:
    """A steps.csv header: the fixed columns with the loss-term columns after "loss"."""
    return [*STEP_COLUMNS[:_TERMS_AFTER], *terms, *STEP_COLUMNS[_TERMS_AFTER:]]


def loss_terms(columns: Iterable[str]) -> list[str]:
    """The loss-term columns of a steps.csv header, in file order."""
    return [c for c in columns if c not in STEP_COLUMNS]
