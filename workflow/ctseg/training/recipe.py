"""The training recipe, as the experiment's ``train`` section and the phase set it: seeds and
arithmetic flags (determinism, TF32), the precision of the forward pass, and the optimizer with
its learning rate (scaled to the step's batch, then a linear warmup and a cosine decay)."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ctseg.io import CtsegError

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def seed_and_flags(train_cfg: Mapping[str, Any], device: torch.device) -> None:
    """Seed python, numpy and torch; set determinism, cuDNN autotuning and TF32 both ways (a
    trial or training must not inherit another run's mode in the same process)."""
    seed = int(train_cfg["seed"])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    deterministic = bool(train_cfg["deterministic"])
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if deterministic or torch.are_deterministic_algorithms_enabled():
        # warn_only: max_pool3d's CUDA backward (clDice's soft skeleton) has no deterministic
        # kernel; torch warns about it rather than stopping the run. CPU runs are exact.
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.benchmark = not deterministic and device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = bool(train_cfg["tf32"])
    torch.backends.cudnn.allow_tf32 = bool(train_cfg["tf32"])


def autocast_dtype(phase: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype the phase's ``precision`` runs the forward pass in (None: fp32, no autocast)."""
    precision = phase.get("precision") or "fp32"
    if precision not in PRECISIONS:
        raise CtsegError(f"phase precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def memory_format(phase: Mapping[str, Any]) -> torch.memory_format:
    """The layout of the model's weights and inputs: channels_last_3d where the phase asks."""
    return torch.channels_last_3d if phase.get("channels_last") else torch.contiguous_format


def fused_optimizer(phase: Mapping[str, Any]) -> bool:
    """The phase's ``fused_optimizer``, fused where it does not say: one kernel for all
    parameters instead of a loop of small launches, with its step counts on the parameters'
    device, where torch's loop reads each parameter's count back to the host (`.item()`) every
    step. torch has the fused AdamW and SGD on CUDA and on the CPU."""
    return bool(phase.get("fused_optimizer", True))


def lr_at(step: int, *, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to min_ratio * base_lr at `total` steps."""
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def scaled_lr(train_cfg: Mapping[str, Any], effective_batch: int) -> float:
    """The learning rate for `effective_batch`, scaled from `lr` at `base_batch_size`."""
    ratio = effective_batch / train_cfg["base_batch_size"]
    factors = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}
    rule = train_cfg["lr_scaling"]
    if rule not in factors:
        raise CtsegError(f"train.lr_scaling must be one of {list(factors)}, got {rule!r}")
    return train_cfg["lr"] * factors[rule]


def build_optimizer(
    model: torch.nn.Module, train_cfg: Mapping[str, Any], lr: float, *, fused: bool = False
) -> torch.optim.Optimizer:
    """AdamW, or SGD with Nesterov momentum, at learning rate `lr`; `fused`: torch's fused
    kernel (one launch for all parameters instead of a loop of small ones: a speed setting)."""
    name, decay = train_cfg["optimizer"], train_cfg["weight_decay"]
    fused_arg = {"fused": True} if fused else {}
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=decay, **fused_arg)
    if name == "sgd":
        momentum = train_cfg["momentum"]
        return torch.optim.SGD(
            model.parameters(),
            lr=lr,
            momentum=momentum,
            weight_decay=decay,
            nesterov=True,
            **fused_arg,
        )
    raise CtsegError(f"train.optimizer must be adamw or sgd, got {name!r}")


def build_schedule(
    optimizer: torch.optim.Optimizer, train_cfg: Mapping[str, Any], total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_at` over `total_steps` steps, as a factor on the optimizer's learning rate."""
    warmup, min_ratio = int(train_cfg["warmup_steps"]), float(train_cfg["min_lr_ratio"])

    def factor(step: int) -> float:
        return lr_at(step, base_lr=1.0, warmup=warmup, total=total_steps, min_ratio=min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
