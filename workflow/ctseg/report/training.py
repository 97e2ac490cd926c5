"""The report's training section: the run's steps.csv and epochs.csv as tables and curves."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ctseg.formatting import fmt, pct
from ctseg.io import CtsegError
from ctseg.report.markup import Sources, missing, png, read_table, records, source_line, table
from ctseg.summaries import STEP_OPTIONAL, STEP_REQUIRED, loss_terms


def unlabelled_steps(steps: pd.DataFrame) -> pd.Series:
    """Rows of a step spent on patches without one labelled voxel: the loss, every term and the
    gradient norm exactly 0 (every term is masked by the ignore label; the boundary term is
    negative wherever a voxel is labelled). The sampler no longer draws such patches
    (`ctseg.data.patches`); older runs' logs may hold them, and the plots leave them out."""
    columns = ["loss", *loss_terms(steps.columns), "grad_norm"]
    present = [c for c in columns if c in steps]
    if not present:
        return pd.Series(False, index=steps.index)
    return (steps[present] == 0).all(axis=1)


def unlabelled_note(count: int) -> str:
    if not count:
        return ""
    return (
        f"<p class='note'>{count} step(s) left out of the loss curves: the loss, every term and "
        "the gradient norm are exactly 0 there, a step on patches without one labelled voxel "
        "(nothing to learn from, not a perfect prediction).</p>"
    )


def _smooth(series: pd.Series) -> pd.Series:
    window = max(1, len(series) // 50)
    return series.rolling(window, min_periods=1).mean()


def _loss_figure(steps: pd.DataFrame, epochs: pd.DataFrame | None) -> Figure:
    panels = ["loss", *loss_terms(steps.columns)]
    has_dice = epochs is not None and "val_dice" in epochs and epochs["val_dice"].notna().any()
    count = len(panels) + int(has_dice)
    cols = min(3, count)
    rows = math.ceil(count / cols)
    fig = Figure(figsize=(4.3 * cols, 3.0 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
    for ax, name in zip(axes, panels, strict=False):
        smooth = _smooth(steps[name])
        if not smooth.equals(steps[name]):
            ax.plot(
                steps["step"], steps[name], color="#4c72b0", alpha=0.3, lw=0.8, label="per step"
            )
        ax.plot(steps["step"], smooth, color="#4c72b0", lw=1.5, label="train")
        if name == "loss" and epochs is not None:
            _epoch_lines(ax, epochs)
        ax.set(title="total loss" if name == "loss" else name, xlabel="step")
        ax.legend(fontsize=7)
    if has_dice:
        ax = axes[len(panels)]
        ax.plot(epochs["step"], epochs["val_dice"], marker="o", color="#c44e52")
        ax.set(title="validation Dice", xlabel="step", ylim=(0, 1))
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig


def _epoch_lines(ax: Any, epochs: pd.DataFrame) -> None:
    if "train_loss" in epochs:
        ax.plot(epochs["step"], epochs["train_loss"], "s-", color="#55a868", label="train (epoch)")
    if "val_loss" in epochs and epochs["val_loss"].notna().any():
        ax.plot(epochs["step"], epochs["val_loss"], "o-", color="#c44e52", label="validation")


def _throughput_figure(steps: pd.DataFrame) -> Figure:
    extra = [c for c in sorted(STEP_OPTIONAL) if c in steps]
    fig = Figure(figsize=(13, 3.0), layout="constrained")
    axes = fig.subplots(1, 3 + len(extra))
    axes[0].plot(steps["step"], _smooth(steps["samples_per_s"]), color="#4c72b0")
    axes[0].set(title="samples/s (smoothed)", xlabel="step")
    wait = steps["data_wait_s"] / steps["step_s"]
    axes[1].plot(steps["step"], _smooth(wait), color="#c44e52")
    axes[1].set(title="data-wait fraction (smoothed)", xlabel="step", ylim=(0, 1))
    axes[2].plot(steps["step"], steps["lr"], color="#55a868")
    axes[2].set(title="learning rate", xlabel="step")
    for ax, name in zip(axes[3:], extra, strict=True):
        ax.plot(steps["step"], steps[name], color="#8172b2", lw=0.8)
        ax.set(title=name.replace("_", " "), xlabel="step", yscale="log")
    return fig


def _training_table(steps: pd.DataFrame) -> str:
    step_time = steps["step_s"].sum()
    rows = [
        ["optimizer steps", fmt(len(steps))],
        ["epochs logged", fmt(int(steps["epoch"].nunique()))],
        ["median step s", fmt(steps["step_s"].median())],
        ["mean samples/s", fmt(steps["samples_per_s"].mean())],
        ["data wait (share of step time)", pct(steps["data_wait_s"].sum() / step_time)],
        ["host-to-device (share of step time)", pct(steps["h2d_s"].sum() / step_time)],
        ["mean GPU util %", fmt(steps["gpu_util"].mean())],
        ["peak VRAM MB", fmt(steps["vram_peak_mb"].max())],
        ["peak host RSS MB", fmt(steps["host_rss_mb"].max())],
        ["final loss (last step)", fmt(steps["loss"].iloc[-1])],
    ]
    # A training on the CPU logs no GPU utilisation or VRAM (empty cells): no rows for them.
    if steps["gpu_util"].isna().all() and steps["vram_peak_mb"].isna().all():
        rows = [r for r in rows if r[0] not in ("mean GPU util %", "peak VRAM MB")]
    return table(["steps.csv", "value"], rows)


def _epochs_table(epochs: pd.DataFrame) -> str:
    digits = {"data_wait_fraction": pct}
    rows = [[digits.get(c, fmt)(row[c]) for c in epochs.columns] for row in records(epochs)]
    return table(list(epochs.columns), rows)


def training_section(train_dir: Path | None, src: Sources) -> str:
    out = ['<h2 id="training">Training</h2>']
    if train_dir is None:
        return "\n".join([*out, missing("Training logs")])
    steps_csv, epochs_csv = Path(train_dir) / "steps.csv", Path(train_dir) / "epochs.csv"
    if not steps_csv.exists():
        return "\n".join([*out, missing("Training steps", [src.rel(steps_csv)])])
    steps = read_table(steps_csv)
    needed = set(STEP_REQUIRED) - set(steps.columns)
    if needed or steps.empty:
        problem = f"missing columns {sorted(needed)}" if needed else "no rows"
        raise CtsegError(f"{steps_csv}: not a training steps.csv ({problem})")
    empty = unlabelled_steps(steps)
    names = [src.use(steps_csv)]
    epochs = None
    if epochs_csv.exists():
        epochs = read_table(epochs_csv)
        names.append(src.use(epochs_csv))
    else:
        out.append(missing("Epoch log (validation)", [src.rel(epochs_csv)]))
    out.append(_training_table(steps))
    out.append("<h3>Loss curves</h3>")
    out.append(png(_loss_figure(steps[~empty], epochs), "training and validation loss curves"))
    out.append(unlabelled_note(int(empty.sum())))
    out.append(
        "<p class='note'>Validation logs the total loss and Dice once per epoch "
        "(<code>epochs.csv</code>): both on the same fixed patches of the val volumes every "
        "epoch, Dice as the hard voxel Dice of the network's output (logit above 0) over the "
        "labelled voxels of those patches. The per-term curves are training only.</p>"
    )
    out.append(png(_throughput_figure(steps), "training throughput"))
    if epochs is not None and not epochs.empty:
        out.append(
            "<h3>Per epoch: training loss, validation loss and Dice, speed</h3>"
            + _epochs_table(epochs)
        )
    out.append(source_line(names))
    return "\n".join(out)
