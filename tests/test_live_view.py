"""ctseg.training.live_view: TensorBoard event files and progress.png in the run folder, read
back with TensorBoard's own reader; a resumed run's files hold every step once.

The tiny CPU training of training_setup: two epochs of three steps.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from training_setup import CLIP, EXPERIMENT, PHASE, TRAIN_IDS, VAL_IDS, build_scratch, torch_globals

from ctseg.network.losses import TERMS
from ctseg.training.live_view import (
    EVENTS_DIR,
    PROGRESS_PNG,
    _rows,
    event_files,
    progress_figure,
)
from ctseg.training.train import train

STEP_TAGS = {
    "loss": "loss/total",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "samples_per_s": "speed/samples_per_s",
    "data_wait_s": "speed/data_wait_s",
}
EPOCH_TAGS = {"val_loss": "val/loss", "val_dice": "val/dice", "train_loss": "epoch/train_loss"}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scratch(tmp_path_factory.mktemp("live_data"))


def run_in(scratch: Path, run_dir: Path, exp: dict | None = None) -> dict:
    with torch_globals():
        return train(
            exp or EXPERIMENT,
            PHASE,
            scratch=scratch,
            train_ids=TRAIN_IDS,
            val_ids=VAL_IDS,
            out_dir=run_dir / "train",
            state_dir=run_dir / "checkpoints",
            final_weights=run_dir / "last.pt",
            clip_distance=CLIP,
            device="cpu",
            progress=False,
        )


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run folder's event files, as TensorBoard reads them."""
    reader = EventAccumulator(str(run_dir / EVENTS_DIR))
    reader.Reload()
    return {
        tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]
    }


@pytest.fixture(scope="module")
def reference(scratch: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("live") / "run"
    run_in(scratch, run_dir)
    return run_dir


def test_event_files_hold_every_logged_scalar(reference: Path) -> None:
    found = scalars(reference)
    steps = pd.read_csv(reference / "train" / "steps.csv")
    epochs = pd.read_csv(reference / "train" / "epochs.csv")
    # Each loss term the run trains has its column (steps.csv) and its tag.
    terms = {term: f"loss/{term}" for term in TERMS if term in steps.columns}
    assert len(terms) >= 2 and {"bce", "dice"} <= set(terms)
    step_tags = {**STEP_TAGS, **terms}
    assert set(step_tags.values()) | set(EPOCH_TAGS.values()) <= set(found)
    assert {tag for tag in found if tag.startswith("loss/")} == {"loss/total", *terms.values()}
    for column, tag in step_tags.items():
        assert [s for s, _ in found[tag]] == list(steps["step"]), tag
        # Event files hold float32: the csv's values, rounded to float32.
        expected = steps[column].to_numpy(np.float32)
        np.testing.assert_array_equal(np.float32([v for _, v in found[tag]]), expected, tag)
    for column, tag in EPOCH_TAGS.items():
        assert [s for s, _ in found[tag]] == list(epochs["step"]), tag
        np.testing.assert_array_equal(
            np.float32([v for _, v in found[tag]]), epochs[column].to_numpy(np.float32), tag
        )


def test_progress_png_is_drawn_in_the_run_folder(reference: Path) -> None:
    png = reference / PROGRESS_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def legends_over_plots(fig: Figure) -> list[str]:
    """Legends of a panel that cover part of its plotting area (or its twin's)."""
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    covering = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        if any(box.overlaps(other.get_window_extent(renderer)) for other in fig.axes):
            covering.append(ax.get_title() or legend.get_title().get_text())
    return covering


def test_progress_png_legends_sit_outside_the_curves(reference: Path) -> None:
    train = reference / "train"
    fig = progress_figure(_rows(train / "steps.csv"), _rows(train / "epochs.csv"))
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert len(legends) == 4  # one per panel, a twin axis's curves in its panel's legend
    assert legends_over_plots(fig) == []
    assert "val Dice" in [t.get_text() for t in legends[1].get_texts()]


def test_resume_cuts_the_event_files_back_to_the_checkpoint(
    scratch: Path, reference: Path, tmp_path: Path
) -> None:
    """Resumed from epoch 0's checkpoint (step 3) with the earlier attempt's files holding all
    six steps and a record cut short by a kill: every step is read once, with the values of the
    uninterrupted run."""
    run_dir = tmp_path / "run"
    state = run_dir / "checkpoints"
    state.mkdir(parents=True)
    shutil.copyfile(reference / "checkpoints" / "resume.previous.pt", state / "resume.pt")
    for name in ("steps.csv", "epochs.csv"):  # the logs ran ahead of the checkpoint
        shutil.copyfile(reference / "checkpoints" / name, state / name)
    shutil.copytree(reference / EVENTS_DIR, run_dir / EVENTS_DIR)
    (earlier,) = event_files(run_dir / EVENTS_DIR)
    with open(earlier, "ab") as handle:  # a record torn by the kill
        handle.write(b"\x20\x00\x00\x00\x00\x00\x00\x00\x01\x02")
    summary = run_in(scratch, run_dir)
    assert summary["resume"] == "resumed" and summary["from_step"] == 3
    assert len(event_files(run_dir / EVENTS_DIR)) == 2  # one file per attempt
    resumed, uninterrupted = scalars(run_dir), scalars(reference)
    assert resumed.keys() == uninterrupted.keys()
    for tag, points in resumed.items():
        assert [s for s, _ in points] == [s for s, _ in uninterrupted[tag]], tag
        if not tag.startswith(("speed/", "epoch/data_wait")):  # the maths, not the timings
            assert points == uninterrupted[tag], tag


def test_a_fresh_start_removes_the_earlier_events(scratch: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stale = run_dir / EVENTS_DIR / "events.out.tfevents.1.old.1.0"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"")
    (run_dir / PROGRESS_PNG).write_bytes(b"stale")
    exp = {**EXPERIMENT, "train": {**EXPERIMENT["train"], "epochs": 1, "steps_per_epoch": 2}}
    run_in(scratch, run_dir, exp)
    assert not stale.exists()
    assert [s for s, _ in scalars(run_dir)["loss/total"]] == [1, 2]
    assert (run_dir / PROGRESS_PNG).read_bytes()[:4] == b"\x89PNG"


def test_a_phase_trial_writes_no_live_view(scratch: Path, tmp_path: Path) -> None:
    with torch_globals():
        train(
            EXPERIMENT,
            PHASE,
            scratch=scratch,
            train_ids=TRAIN_IDS,
            val_ids=VAL_IDS,
            out_dir=tmp_path / "phases" / "phase0",
            clip_distance=CLIP,
            max_steps=2,
            device="cpu",
            progress=False,
        )
    assert not (tmp_path / "phases" / EVENTS_DIR).exists()
    assert not (tmp_path / "phases" / PROGRESS_PNG).exists()
