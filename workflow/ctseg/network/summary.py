"""`ctseg model-summary`: a configuration's parameters per level, the activation memory autograd
keeps per training step and the peak it suggests, and the counted FLOPs with the patch's computed
(padded) size and the share of them spent on padding, and a warning naming the unpadded patch of
the same cost when there is padding. Apart from `model` so
that `flops`, which builds models on the meta device, and this summary, which prints its counts,
import in one direction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ctseg.io import CtsegError
from ctseg.network.flops import count_flops, padding_warning
from ctseg.network.model import (
    build_model,
    count_parameters,
    saved_activation_bytes,
    stage_parameters,
)
from ctseg.network.sizes import computed_patch

# Measured peak VRAM over `saved_activation_bytes` + 16 bytes a parameter, for exp001_full on an
# H200 (BENCHMARKS.md, bench/train.py): 1.19 (fp32, batch 1), 1.26 (fp32, batch 4), 1.10 (bf16,
# batch 4, compiled). The rest is the loss terms, backward's transients, workspaces and slack.
PEAK_FACTOR = 1.25
# fp32 weights, their gradients and AdamW's two moments.
BYTES_PER_PARAMETER = 16


def model_summary(model_cfg: Mapping[str, object], patch: Sequence[int], batch: int = 1) -> str:
    """A text table of the configuration's parameters per level and in total; the activation
    memory autograd keeps per training step at `batch` patches of shape `patch`
    (`saved_activation_bytes`, bf16 and fp32) and the peak it suggests (`PEAK_FACTOR`); the
    counted FLOPs (`ctseg.network.flops`)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise CtsegError(f"batch={batch!r}: expected a positive integer")
    model = build_model(model_cfg)
    total = count_parameters(model)
    patch = tuple(int(s) for s in patch)
    padded = computed_patch(patch, model.size_multiple)
    lines = [
        f"model: filters {list(model.filters)}, blocks per stage {list(model.blocks_per_stage)}, "
        f"patch {'x'.join(map(str, patch))} (computed at {'x'.join(map(str, padded))}), "
        f"batch {batch}",
        f"{'part':<12}{'parameters':>14}",
    ]
    lines += [f"{name:<12}{count:>14,}" for name, count in stage_parameters(model)]
    lines.append(f"{'total':<12}{total:>14,}")
    for dtype, label in [(torch.bfloat16, "bf16"), (torch.float32, "fp32")]:
        saved = saved_activation_bytes(model_cfg, patch, batch=batch, dtype=dtype)
        peak = PEAK_FACTOR * (saved + BYTES_PER_PARAMETER * total)
        lines.append(
            f"{label}: activations saved for backward {saved / 2**30:.2f} GiB, estimated peak "
            f"{peak / 2**30:.1f} GiB ({PEAK_FACTOR} x (activations + "
            f"{BYTES_PER_PARAMETER} B a parameter))"
        )
    lines += _flops_lines(model_cfg, patch, batch)
    return "\n".join(lines)


def _flops_lines(model_cfg: Mapping[str, object], patch: Sequence[int], batch: int) -> list[str]:
    counted = count_flops(model_cfg, patch)  # by forward hooks on the meta device
    lines = [
        f"FLOPs per sample: forward {counted.forward / 1e9:,.1f} G, forward + backward "
        f"{counted.train / 1e9:,.1f} G (batch {batch}: {batch * counted.train / 1e9:,.1f} G a "
        f"step); padding {100 * counted.padding_share:.1f}% of them, useful "
        f"{counted.useful_train / 1e9:,.1f} G"
    ]
    warning = padding_warning(model_cfg, patch)
    return lines + ([f"warning: {warning}"] if warning else [])
