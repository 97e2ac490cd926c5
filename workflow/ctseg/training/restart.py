"""A finished run retrained under another phase starts from step 0.

A run's checkpoints outlive its last.pt (`ctseg.training.checkpoint`): a preempted job resumes
from them, under whichever loader phase it is given, since a phase does not change the maths.
A *finished* run's checkpoint is at its last step, so a job forced to rerun it under another
phase (``--forcerun train_model --config phase=1``) would resume there, run no step, and record
the new phase for weights trained under the old one. The plan knows when that is about to
happen (`ctseg.runs.TrainingPlan.restart_from`: the last.pt it keeps was trained under another
phase than the job's) and, when the job does run, sets the checkpoints aside first, as a
checkpoint of another run is set aside: moved, never deleted. This runs once, before any job is
scheduled, so a resubmitted attempt of the retraining resumes its own checkpoints.

Torch-free: it runs in the workflow's own process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# What a run's state directory holds for its resume (`ctseg.training.checkpoint`): the
# checkpoint, the one before it, and the logs cut back to them on resume.
STATE_FILES = ("resume.pt", "resume.previous.pt", "best.pt", "steps.csv", "epochs.csv")
SET_ASIDE = "set-aside"


def set_aside_for_phase(state_dir: Path, trained_under: str) -> Path | None:
    """Move the resume state of `state_dir` into ``set-aside/<time>-<trained_under>/`` (spaces
    as dashes); returns that folder, or None when there was nothing to move."""
    present = [name for name in STATE_FILES if (Path(state_dir) / name).exists()]
    if not present:
        return None
    label = "-".join(trained_under.split())
    aside = Path(state_dir) / SET_ASIDE / f"{time.strftime('%Y%m%dT%H%M%S')}-{label}"
    aside.mkdir(parents=True, exist_ok=True)
    for name in present:
        os.replace(Path(state_dir) / name, aside / name)
    return aside


def restart_line(run: str, trained_under: str, phase: int | str) -> str:
    """What the console says, as the plan is made, of a run whose train job is forced under
    another phase than its last.pt was trained under."""
    return (
        f"{run}: retrains from step 0 under phase {phase} (--forcerun): its last.pt was trained "
        f"under {trained_under}"
    )


def set_aside_line(run: str, aside: Path) -> str:
    """What the console says once that job's finished checkpoints are set aside."""
    return f"{run}: its finished checkpoints are set aside in {aside}, not resumed"
