"""An exponential moving average (EMA) of a model's weights, kept beside the training.

``train.ema: {decay, start_step}`` turns it on (null or absent: off). After every optimizer
step ``s`` (counted from 1, as steps.csv numbers them) each parameter's average becomes

    ema = decay * ema + (1 - decay) * w      if s >= start_step
    ema = w                                   if s <  start_step

so the average starts from the weights at ``start_step - 1`` rather than from the random
initial ones. Buffers (a batch norm's running statistics) are copied, not averaged: they are
already running averages of their own.

When it is on, the averaged weights are what the run is for: validation scores them, and the
final weights file (last.pt) holds them as its ``model`` (with ``"weights": "ema"``), so
inference and a fine-tune's ``init_from`` use them without knowing about the EMA. The live
weights stay in the resume checkpoint (``model``) beside the average (``ema``), and a resumed
run goes on with both, bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from ctseg.model import portable_state_dict


class WeightAverage:
    """The EMA of `model`'s parameters, held in a copy of the model (`averaged`)."""

    def __init__(self, model: torch.nn.Module, decay: float, start_step: int = 0) -> None:
        self.decay, self.start_step = float(decay), int(start_step)
        self.averaged = copy.deepcopy(model)
        self.averaged.requires_grad_(False)
        self.averaged.eval()

    @classmethod
    def configured(
        cls, model: torch.nn.Module, settings: Mapping[str, Any] | None
    ) -> WeightAverage | None:
        """The EMA that ``train.ema`` asks for, or None when it is off."""
        if not settings:
            return None
        return cls(model, settings["decay"], settings.get("start_step", 0))

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        """After optimizer step `step` of `model` (the plain module, not a DDP or compiled
        wrapper: every rank holds the same weights after the all-reduce)."""
        average = [p.detach() for p in self.averaged.parameters()]
        live = [p.detach() for p in model.parameters()]
        if step < self.start_step:
            torch._foreach_copy_(average, live)
        else:
            # One fused kernel per op over all parameters, not a Python loop of small ones.
            torch._foreach_mul_(average, self.decay)
            torch._foreach_add_(average, live, alpha=1.0 - self.decay)
        buffers = list(self.averaged.buffers())
        if buffers:
            torch._foreach_copy_(buffers, list(model.buffers()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights, as the checkpoints store any model's (plain CPU tensors)."""
        return portable_state_dict(self.averaged)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.averaged.load_state_dict(state)
