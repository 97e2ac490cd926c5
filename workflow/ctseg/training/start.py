"""What the workflow says and does before a training job of this invocation runs (the onstart
of workflow/rules/train.smk): a finished run retrained under another phase has its checkpoints
set aside (`ctseg.training.restart`), the training's estimated time on this machine
(`ctseg.network.estimate`), and the volumes smaller than its patch, once they are converted
(`ctseg.dataset_summary`). It runs in the workflow's own process; torch is loaded only for the
estimate, and only when a training is about to run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ctseg.dataset_summary import small_volumes_line, store_attributes
from ctseg.network.estimate import estimate_line
from ctseg.summaries import TrialSummary
from ctseg.training.restart import set_aside_for_phase, set_aside_line


def start_lines(
    run: str,
    *,
    restart_from: str | None,
    phase: int | str,
    settings: Mapping[str, Any],
    phases: Mapping[int, Mapping[str, Any]],
    trials: Sequence[TrialSummary],
    image_stores: Mapping[str, Path],
    state_dir: Path,
) -> list[str]:
    """The lines for `run`'s training, in order; sets its finished checkpoints aside first when
    the plan retrains it under another phase (`restart_from`: the phase its last.pt had)."""
    import torch

    lines: list[str | None] = []
    if restart_from is not None:
        aside = set_aside_for_phase(state_dir, restart_from)
        lines.append(set_aside_line(run, aside) if aside else None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines.append(estimate_line(run, settings, phases, phase, trials, device))
    if all(store.exists() for store in image_stores.values()):
        shapes = {i: store_attributes(store)["shape"] for i, store in image_stores.items()}
        lines.append(small_volumes_line(run, shapes, settings["data"]["patch_size"]))
    return [line for line in lines if line]
