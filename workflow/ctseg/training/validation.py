"""Validation during training: loss and hard Dice on a fixed set of validation patches."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ctseg.data.device_batches import to_device
from ctseg.data.loader import build_loader
from ctseg.data.patches import PatchDataset
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.network.losses import compute_losses
from ctseg.training.distributed import Ranks, gathered
from ctseg.training.recipe import memory_format


def dice_score(
    logits: torch.Tensor, batch: Mapping[str, torch.Tensor], labels: LabelSpec = KAGGLE
) -> tuple[float, float]:
    """Hard Dice intersection and denominator over valid voxels (summed over a batch) of a
    binary model (one channel, the mask logits > 0), the label's values as `labels` says (a
    loader's batch: the run's stored spec, `KAGGLE` for the Kaggle data)."""
    valid = (batch["ignore"] == 0) & ~labels.ignored(batch["label"])
    pred = (logits > 0) & valid
    truth = labels.foreground(batch["label"]) & valid
    return float((pred & truth).sum()), float(pred.sum() + truth.sum())


def class_dice_counts(
    logits: torch.Tensor, batch: Mapping[str, torch.Tensor], labels: LabelSpec = KAGGLE
) -> list[tuple[float, float]]:
    """(intersection, denominator) of each foreground class over valid voxels: `dice_score`'s
    one pair for a binary model; for a multi-class one (K+1 channels, background first) the
    argmax against each class 1..K in turn."""
    if labels.is_binary:
        return [dice_score(logits, batch, labels)]
    valid = (batch["ignore"] == 0) & ~labels.ignored(batch["label"])
    predicted = logits.argmax(dim=1, keepdim=True)
    counts = []
    for channel, value in enumerate(labels.foreground_values, start=1):
        pred = (predicted == channel) & valid
        truth = (batch["label"] == value) & valid
        counts.append((float((pred & truth).sum()), float(pred.sum() + truth.sum())))
    return counts


def mean_dice(counts: list[tuple[float, float]]) -> float:
    """The mean over classes of 2 I / D (1 for a class absent from prediction and truth)."""
    return statistics.fmean(2 * i / d if d else 1.0 for i, d in counts)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    exp: Mapping[str, Any],
    phase: Mapping[str, Any],
    scratch: Path,
    val_ids: list[str],
    losses_cfg: Mapping[str, Any],
    ranks: Ranks | None = None,
) -> dict[str, float]:
    """Loss and Dice on a fixed set of validation patches (the same ones every epoch); for a
    multi-class spec (``losses_cfg["labels"]``, the run's stored spec) the Dice is the mean over
    the classes 1..K of each class's Dice of the argmax, ignored voxels excluded.

    Under DDP each rank scores every world-th batch and the results are gathered: the mean
    (an exact fsum) and the voxel counts come out as one process computes them.
    """
    ranks = ranks or Ranks()  # one process
    dev = next(model.parameters()).device
    n_batches = int(exp["train"]["val_batches"])
    if not val_ids or n_batches == 0:
        return {"val_loss": float("nan"), "val_dice": float("nan")}
    batch_size = int(phase["batch_size"])
    labels = losses_cfg.get("labels", KAGGLE)
    dataset = PatchDataset(
        scratch,
        val_ids,
        patch_size=exp["data"]["patch_size"],
        fmt=exp["scratch_format"],
        fg_fraction=exp["data"]["fg_fraction"],
        augment={"flip": False, "permute": False, "intensity": {"prob": 0.0}},
        seed=int(exp["train"]["seed"]) + 1,
        length=n_batches * batch_size,
        labels=labels,
    )
    loader = build_loader(
        dataset, {**phase, "workers": 0}, seed=0, device=dev, rank=ranks.rank, world=ranks.world
    )
    model.eval()
    losses, counts = [], [(0.0, 0.0)] * labels.n_classes
    for host_batch in loader:
        batch = to_device(host_batch, dev)
        logits = model(batch["image"].contiguous(memory_format=memory_format(phase)))
        total, _ = compute_losses(logits, batch, **losses_cfg)
        losses.append(float(total))
        batch_counts = class_dice_counts(logits, batch, labels)
        counts = [(i + bi, d + bd) for (i, d), (bi, bd) in zip(counts, batch_counts, strict=True)]
    model.train()
    if ranks.world > 1:
        shares = gathered(ranks, (losses, counts))
        losses = [loss for share in shares for loss in share[0]]
        counts = [
            (sum(share[1][c][0] for share in shares), sum(share[1][c][1] for share in shares))
            for c in range(labels.n_classes)
        ]
    return {"val_loss": statistics.fmean(losses), "val_dice": mean_dice(counts)}
