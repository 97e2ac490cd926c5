"""Fine-tuning: a training that starts from another run's final weights (``init_from``).

An experiment's ``init_from: <run>`` names the run; the workflow passes that run's
``results/<run>/last.pt`` as ``ctseg train --init-from``. The weights are loaded into the
freshly built model before training; the optimizer, the schedule and the step count start
from zero as for any training. The source must fit this experiment's model exactly: every
parameter and buffer by name and shape (an error names the first that does not).

The run identity (`ctseg.training.checkpoint.run_identity`) records the source weights' digest
(`state_digest`), so a retrained source makes every fine-tune of it a new run: its old
checkpoint is set aside, not resumed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ctseg.io import CtsegError
from ctseg.network.model import tensor_bytes
from ctseg.training.checkpoint import DamagedCheckpoint, load_checkpoint


@dataclass(frozen=True)
class Source:
    """The weights a fine-tune starts from: their file, model state and digest."""

    path: Path
    state: Mapping[str, torch.Tensor]
    digest: str


def source_weights(
    exp: Mapping[str, Any], init_from: Path | None, *, trial: bool = False
) -> Source | None:
    """The weights to start from: `init_from`'s, where the experiment asks for them. A phase
    `trial` (speed only) may go without them: its steps take as long from any weights."""
    wanted = exp.get("init_from")
    if (wanted is None or trial) and init_from is None:
        return None
    name = exp.get("name", "the experiment")
    if init_from is None:
        raise CtsegError(
            f"experiment {name} fine-tunes from {wanted!r} (init_from) but no weights were "
            f"given: pass --init-from results/{wanted}/last.pt"
        )
    if wanted is None:
        raise CtsegError(
            f"--init-from {init_from}: experiment {name} has no init_from; add "
            "'init_from: <run>' to it so that the run records what it starts from"
        )
    path = Path(init_from)
    if not path.is_file():
        raise CtsegError(f"--init-from {path}: weights file not found (train {wanted} first)")
    try:
        state = load_checkpoint(path)  # its checksum is verified on the way
    except DamagedCheckpoint as exc:
        why = str(exc).split(": ", 1)[-1].rsplit(";", 1)[0]  # without the resume advice
        why = " ".join(why.split())  # torch's own message may run over several lines
        raise CtsegError(
            f"--init-from {path}: {why}; train {wanted} again to rewrite its weights"
        ) from exc
    if not isinstance(state, Mapping) or not isinstance(state.get("model"), Mapping):
        raise CtsegError(f"--init-from {path}: not a ctseg weights file (no 'model' state in it)")
    return Source(path, state["model"], state_digest(state["model"]))


def load_source(model: torch.nn.Module, weights: Source) -> None:
    """Copy the source weights into `model`, refusing any layer whose name or shape differs."""
    source, path, own = weights.state, weights.path, model.state_dict()
    for name, tensor in own.items():
        if name not in source:
            raise CtsegError(
                f"--init-from {path}: layer {name} {tuple(tensor.shape)} of this model is "
                "missing from the source weights: init_from needs the same model settings"
            )
        if tuple(source[name].shape) != tuple(tensor.shape):
            raise CtsegError(
                f"--init-from {path}: layer {name} has shape {tuple(source[name].shape)} in "
                f"the source weights but {tuple(tensor.shape)} in this model: init_from needs "
                "the same model settings"
            )
    extra = sorted(set(source) - set(own))
    if extra:
        raise CtsegError(
            f"--init-from {path}: layer {extra[0]} of the source weights is not in this model: "
            "init_from needs the same model settings"
        )
    model.load_state_dict(source)


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over a model state's names, shapes, dtypes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()
