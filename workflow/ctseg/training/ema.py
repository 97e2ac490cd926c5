"""An exponential moving average (EMA) of a model's weights, kept beside the training.

``train.ema: {decay, start_step}`` turns it on (null or absent: off). After every optimizer
step ``s`` (counted from 1, as steps.csv numbers them) each parameter's average becomes

    ema = decay * ema + (1 - decay) * w      if s >= start_step
    ema = w                                   if s <  start_step

(computed as ``ema + (1 - decay) * (w - ema)``: see `update`), so the average starts from the
weights at ``start_step - 1`` rather than from the random initial ones. Buffers (a batch
norm's running statistics) are copied, not averaged: they are running averages already.

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

from ctseg.network.model import portable_state_dict


class WeightAverage:
    """The EMA of `model`'s parameters, held in a copy of the model (`averaged`)."""

    def __init__(self, model: torch.nn.Module, decay: float, start_step: int = 0) -> None:
        self.decay, self.start_step = float(decay), int(start_step)
        self.averaged = copy.deepcopy(model)
        self.averaged.requires_grad_(False)
        self.averaged.eval()
        # The tensor lists, built once: a Python walk over the modules every step costs more
        # on the CPU than the update's kernels on a GPU (load_state_dict copies in place).
        self._lists = (list(self.averaged.parameters()), list(self.averaged.buffers()))
        self._live: tuple[torch.nn.Module, list[torch.Tensor], list[torch.Tensor]] | None = None

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
        if self._live is None or self._live[0] is not model:
            self._live = (model, list(model.parameters()), list(model.buffers()))
        (average, buffers), (_, live, live_buffers) = self._lists, self._live
        if step < self.start_step:
            torch._foreach_copy_(average, live)
        else:
            # ema + (1 - decay) * (w - ema), the same average in one pass over all parameters
            # (bench/ema.py, 63 M parameters on an H200: 0.21 ms; a foreach mul and add 0.36 ms,
            # a loop over the tensors 3.4 ms), without the drift of decay * w + (1 - decay) * w
            # (which need not round to w).
            torch._foreach_lerp_(average, live, 1.0 - self.decay)
        if buffers:
            torch._foreach_copy_(buffers, live_buffers)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights, as the checkpoints store any model's (plain CPU tensors)."""
        return portable_state_dict(self.averaged)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.averaged.load_state_dict(state)
