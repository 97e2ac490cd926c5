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
    """Hard Dice intersection and denominator over valid voxels (summed over a batch).

    A batch from the loader holds its label in Kaggle's values whatever the dataset's
    (`ctseg.data.packing.unpack_bits`), so `labels` stays `KAGGLE` for those."""
    valid = (batch["ignore"] == 0) & ~labels.ignored(batch["label"])
    pred = (logits > 0) & valid
    truth = labels.foreground(batch["label"]) & valid
    return float((pred & truth).sum()), float(pred.sum() + truth.sum())


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
    """Loss and Dice on a fixed set of validation patches (the same ones every epoch).

    Under DDP each rank scores every world-th batch and the results are gathered: the mean
    (an exact fsum) and the voxel counts come out as one process computes them.
    """
    ranks = ranks or Ranks()  # one process
    dev = next(model.parameters()).device
    n_batches = int(exp["train"]["val_batches"])
    if not val_ids or n_batches == 0:
        return {"val_loss": float("nan"), "val_dice": float("nan")}
    batch_size = int(phase["batch_size"])
    dataset = PatchDataset(
        scratch,
        val_ids,
        patch_size=exp["data"]["patch_size"],
        fmt=exp["scratch_format"],
        fg_fraction=exp["data"]["fg_fraction"],
        augment={"flip": False, "permute": False, "intensity": {"prob": 0.0}},
        seed=int(exp["train"]["seed"]) + 1,
        length=n_batches * batch_size,
    )
    loader = build_loader(
        dataset, {**phase, "workers": 0}, seed=0, device=dev, rank=ranks.rank, world=ranks.world
    )
    model.eval()
    losses, intersection, denominator = [], 0.0, 0.0
    for host_batch in loader:
        batch = to_device(host_batch, dev)
        logits = model(batch["image"].contiguous(memory_format=memory_format(phase)))
        total, _ = compute_losses(logits, batch, **losses_cfg)
        losses.append(float(total))
        inter, denom = dice_score(logits, batch)
        intersection += inter
        denominator += denom
    model.train()
    if ranks.world > 1:
        shares = gathered(ranks, (losses, intersection, denominator))
        losses = [loss for share in shares for loss in share[0]]
        intersection = sum(share[1] for share in shares)
        denominator = sum(share[2] for share in shares)
    dice = 2 * intersection / denominator if denominator else 1.0
    return {"val_loss": statistics.fmean(losses), "val_dice": dice}
