"""The live view of a training: TensorBoard event files and a progress plot in the run folder.

Rank 0 of a full training (not a phase trial) writes, in the run folder (the parent of the
``train/`` output directory, ``results/<run>/``):

- ``tensorboard/events.out.tfevents.*``: TensorBoard event files, written with
  ``torch.utils.tensorboard.SummaryWriter``. Per optimizer step (the x axis is the step, as in
  steps.csv): ``loss/total`` and ``loss/<term>`` for each loss term, ``optim/lr``,
  ``optim/grad_norm``, ``speed/samples_per_s`` and ``speed/data_wait_s``; per epoch, at the
  epoch's last step: ``val/loss``, ``val/dice``, ``epoch/train_loss`` and
  ``epoch/data_wait_fraction`` (the row of epochs.csv). ``tensorboard --logdir results`` shows
  every run, named by its folder.
- ``progress.png``: the same curves drawn at every epoch's end from steps.csv and epochs.csv,
  for a reader without TensorBoard (as nnU-Net's progress.png).

The training loop hands over the rows it appends to steps.csv and epochs.csv (every
``train.log_every`` steps and at each checkpoint), so the event files never run ahead of the
logs.

Resume (`open_live_view`): each process start writes a new event file (SummaryWriter names it
by time, host and pid). The files of earlier attempts are cut back to the resumed step, as
steps.csv is (`ctseg.training.checkpoint.trim_logs`): the records past it, which the resumed run
logs again, and a record cut short by a kill are dropped, so no step appears twice and no file
ends garbled. A new file is started only once its name sorts after every earlier one (its time
stamp, in seconds, is later), since TensorBoard reads a run's files in name order. A run that
starts afresh removes the earlier files; one whose checkpoint was set aside (another run's)
moves them into the same set-aside folder.
"""

from __future__ import annotations

import csv
import math
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ctseg.io import atomic_path
from ctseg.summaries import loss_terms

EVENTS_DIR = "tensorboard"
PROGRESS_PNG = "progress.png"
EVENT_PREFIX = "events.out.tfevents."
# steps.csv column -> TensorBoard tag; the loss terms go under loss/<term>.
STEP_TAGS = {
    "loss": "loss/total",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "samples_per_s": "speed/samples_per_s",
    "data_wait_s": "speed/data_wait_s",
}
# epochs.csv column -> tag.
EPOCH_TAGS = {
    "val_loss": "val/loss",
    "val_dice": "val/dice",
    "train_loss": "epoch/train_loss",
    "data_wait_fraction": "epoch/data_wait_fraction",
}


def run_folder(out_dir: Path) -> Path:
    """The run folder the live view writes into: the parent of the ``train/`` outputs."""
    return Path(out_dir).parent


def event_files(directory: Path) -> list[Path]:
    """A run's event files in the order TensorBoard reads them (by name)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.startswith(EVENT_PREFIX))


def _stamp(path: Path) -> int:
    match = re.match(re.escape(EVENT_PREFIX) + r"(\d+)\.", path.name)
    return int(match.group(1)) if match else 0


def trim_events(directory: Path, step: int) -> None:
    """Cut every event file in `directory` back to the records up to `step`.

    Records are rewritten unchanged (bytes as written); a record cut short at the end of a file
    (a kill during a write) is dropped with the rest past `step`. A file left with no record
    past its header (the file version, step 0) is removed. A file that needs no cut is left
    untouched.
    """
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    for path in event_files(directory):
        size = path.stat().st_size
        records = list(RawEventFileLoader(str(path)).Load())
        kept = []
        for raw in records:
            event = event_pb2.Event.FromString(raw)
            if event.HasField("file_version") or event.step <= step:
                kept.append((raw, event.HasField("file_version")))
        if all(header for _, header in kept):
            path.unlink()
            continue
        # Framing: 8-byte length, 4-byte CRC, data, 4-byte CRC per record.
        if len(kept) == len(records) and sum(len(r) + 16 for r in records) == size:
            continue
        with atomic_path(path) as tmp, open(tmp, "wb") as handle:
            writer = RecordWriter(handle)
            for raw, _ in kept:
                writer.write(raw)
            writer.flush()


class LiveView:
    """Rank 0's event writer and progress plot for one training process (see the module)."""

    def __init__(self, folder: Path, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self.log_dir = log_dir  # where steps.csv and epochs.csv grow during the run
        events = folder / EVENTS_DIR
        events.mkdir(parents=True, exist_ok=True)
        earlier = max((_stamp(p) for p in event_files(events)), default=0)
        while int(time.time()) <= earlier:  # the new file must sort after the earlier ones
            time.sleep(0.05)
        self.writer = SummaryWriter(str(events), flush_secs=10)

    def log(self, steps: Sequence[Mapping[str, Any]], epochs: Sequence[Mapping[str, Any]]) -> None:
        """The rows just appended to steps.csv and epochs.csv, as scalars at their steps, flushed
        to the event file at once; after an epoch's row, progress.png is redrawn from the two
        files."""
        for row in steps:
            for column, tag in STEP_TAGS.items():
                _scalar(self.writer, tag, row.get(column), int(row["step"]))
            for term in loss_terms(row):
                _scalar(self.writer, f"loss/{term}", row[term], int(row["step"]))
        for row in epochs:
            for column, tag in EPOCH_TAGS.items():
                _scalar(self.writer, tag, row.get(column), int(row["step"]))
        self.writer.flush()  # as far as the csv files: a stop or a kill loses nothing logged
        if epochs:
            draw_progress(self.log_dir / "steps.csv", self.log_dir / "epochs.csv", self.folder)

    def close(self) -> None:
        self.writer.close()


class NoLiveView:
    """The other ranks' and a phase trial's: nothing is written."""

    def log(self, steps: Sequence[Mapping[str, Any]], epochs: Sequence[Mapping[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


def _scalar(writer: Any, tag: str, value: Any, step: int) -> None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return
    if math.isfinite(number):
        writer.add_scalar(tag, number, step)


def open_live_view(
    out_dir: Path, log_dir: Path, resumed: Mapping[str, Any], *, main: bool, trial: bool
) -> LiveView | NoLiveView:
    """Rank 0's live view of a full training, its earlier files settled first (see the module);
    a `NoLiveView` on the other ranks and for a phase trial."""
    if not main or trial:
        return NoLiveView()
    folder = run_folder(out_dir)
    events = folder / EVENTS_DIR
    how = resumed.get("resume")
    if how == "resumed":
        trim_events(events, int(resumed["from_step"]))
    elif how == "set_aside" and resumed.get("set_aside"):
        aside = Path(str(resumed["set_aside"]))
        aside.mkdir(parents=True, exist_ok=True)
        for name in (EVENTS_DIR, PROGRESS_PNG):
            if (folder / name).exists():
                os.replace(folder / name, aside / name)
    else:
        shutil.rmtree(events, ignore_errors=True)
        (folder / PROGRESS_PNG).unlink(missing_ok=True)
    return LiveView(folder, log_dir)


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _column(rows: list[dict[str, str]], name: str) -> list[float]:
    out = []
    for row in rows:
        try:
            out.append(float(row.get(name) or "nan"))
        except ValueError:
            out.append(math.nan)
    return out


def progress_figure(steps: list[dict[str, str]], epochs: list[dict[str, str]]) -> Any:
    """The figure of ``progress.png`` from the rows of steps.csv and epochs.csv. Each panel's
    legend sits above its plotting area, under the panel's title, so no curve is hidden."""
    from matplotlib.figure import Figure

    x = _column(steps, "step")
    fig = Figure(figsize=(12, 7.5), layout="constrained")
    (loss_ax, val_ax), (lr_ax, speed_ax) = fig.subplots(2, 2)
    terms = loss_terms(steps[0])
    loss_ax.plot(x, _column(steps, "loss"), color="k", lw=1.2, label="total")
    for term in terms:
        loss_ax.plot(x, _column(steps, term), lw=0.8, label=term)
    loss_ax.set(xlabel="optimizer step")
    _legend_above(loss_ax, "training loss per step")
    if epochs:
        ex = _column(epochs, "step")
        val_ax.plot(ex, _column(epochs, "train_loss"), marker="o", label="train loss (epoch mean)")
        val_ax.plot(ex, _column(epochs, "val_loss"), marker="o", label="val loss")
        dice = val_ax.twinx()
        dice.plot(ex, _column(epochs, "val_dice"), marker="s", color="C3", label="val Dice")
        dice.set_ylabel("val Dice (patches)")
        _legend_above(val_ax, "per epoch", dice)
    else:
        val_ax.set_title("per epoch")
    val_ax.set(xlabel="optimizer step")
    lr_ax.plot(x, _column(steps, "lr"), color="C0", label="learning rate")
    lr_ax.set(xlabel="optimizer step")
    norm = lr_ax.twinx()
    norm.plot(x, _column(steps, "grad_norm"), color="C1", lw=0.8, label="grad norm")
    _legend_above(lr_ax, "learning rate and gradient norm", norm)
    speed_ax.plot(x, _column(steps, "samples_per_s"), color="C2", label="samples/s")
    speed_ax.set(xlabel="optimizer step")
    wait = speed_ax.twinx()
    wait.plot(x, _column(steps, "data_wait_s"), color="C3", lw=0.8, label="data wait s")
    _legend_above(speed_ax, "speed and data wait", wait)
    return fig


def _legend_above(ax: Any, title: str, twin: Any = None) -> None:
    """One legend for a panel (and its twin axis) above its plotting area, headed by the
    panel's title: constrained layout makes room for it there."""
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(
        handles,
        labels,
        fontsize=7,
        title=title,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncols=min(len(labels), 4),
        frameon=False,
        borderaxespad=0.2,
    )


def draw_progress(steps_csv: Path, epochs_csv: Path, folder: Path) -> Path | None:
    """``progress.png`` in `folder`: loss terms, validation, learning rate and speed."""
    steps, epochs = _rows(steps_csv), _rows(epochs_csv)
    if not steps:
        return None
    fig = progress_figure(steps, epochs)
    out = folder / PROGRESS_PNG
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=80)
    return out
