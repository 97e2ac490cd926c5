"""Counted FLOPs of the model: forward and backward per sample at a patch, from its layers.

The model is built on the meta device (no memory, no arithmetic) and run forward once in
training mode, so every deep-supervision head runs; a forward hook on each layer adds its
FLOPs from its input and output shapes. The count is generic over layer types, not over one
network: any model `ctseg.network.model.build_model` builds (plain or residual blocks, whatever
their depth) is counted by the same hooks.

Convention (the one MFU figures use, e.g. the PaLM paper's appendix B):

- one multiply-add is 2 FLOPs;
- convolution: 2 · (C_in / groups) · prod(kernel) · C_out per output voxel, + 1 per output
  element for a bias;
- transposed convolution: 2 · C_in · (C_out / groups) · prod(kernel) per *input* voxel (each
  input voxel scatters a kernel's worth of products), + 1 per output element for a bias;
- normalisation (instance, batch, group): `NORM_FLOPS_PER_ELEMENT` per element: statistics
  (sum, subtract the mean, square, sum: 4), normalise (subtract, multiply: 2), affine (2);
- activation: 1 per element;
- backward = 2 × forward (gradients with respect to the inputs and to the weights, each about
  a forward's work). Gradient checkpointing's recomputation is not counted: MFU counts the
  model's FLOPs, not the ones a memory saving repeats.

The forward runs at the padded size the model computes at (it pads each axis to a multiple of
2**(depth-1): 72x136x136 runs as 80x144x144), because those voxels are computed. Residual adds,
padding, concatenation and cropping move or add elements once and are left out (well under 0.1%
of the convolutions). exp001_full at 72x136x136 counts 0.755 TFLOP forward (convolutions
0.740, transposed convolutions 0.013, norms 0.002, the deep-supervision heads 0.0001) and 2.27
TFLOP forward and backward; torch.utils.flop_counter, which counts only the convolutions and
their actual backward (the first layer needs no input gradient), gives 2.25 TFLOP.

Padding: every layer's cost is proportional to its voxel count and every level is padded in the
same proportion, so the *useful* FLOPs (those of the patch itself) are the computed ones times
patch voxels / computed voxels, and the rest is the padding share (`FlopCount.padding_share`:
19.7% at 72x136x136). `padding_warning` names the unpadded patch of the same cost: the computed
size itself.

MFU (`Efficiency`, its one definition) is achieved FLOP/s over the peak of every device the
samples/s ran on, on the computed FLOPs (``mfu``: what the hardware did) and on the useful ones
(``useful_mfu``: what the training got, the figure the report shows).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ctseg.network.model import LayoutInstanceNorm3d, build_model
from ctseg.network.sizes import computed_patch, config_size_multiple

NORM_FLOPS_PER_ELEMENT = 8  # 6 without an affine transform: see the module doc
NORM_TYPES = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
    LayoutInstanceNorm3d,
)
ACTIVATION_TYPES = (nn.ReLU, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.PReLU, nn.ELU)
BACKWARD_FACTOR = 2.0
# Kinds in the breakdown, in the order they are shown.
KINDS = ("conv", "conv_transpose", "head", "norm", "activation")


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one sample at `patch` (forward, and forward + backward), with the forward's
    breakdown by layer kind; `computed` is the padded size the network ran it at."""

    patch: tuple[int, ...]
    forward: float
    by_kind: dict[str, float] = field(default_factory=dict)
    computed: tuple[int, ...] | None = None  # None: as `patch`

    @property
    def computed_patch(self) -> tuple[int, ...]:
        return self.computed or self.patch

    @property
    def useful_fraction(self) -> float:
        """Patch voxels over computed voxels: the share of the FLOPs that is not padding."""
        return math.prod(self.patch) / math.prod(self.computed_patch)

    @property
    def padding_share(self) -> float:
        return 1.0 - self.useful_fraction

    @property
    def useful_train(self) -> float:
        """The training FLOPs a sample of `patch` would cost unpadded: `train` less padding."""
        return self.train * self.useful_fraction

    @property
    def backward(self) -> float:
        return BACKWARD_FACTOR * self.forward

    @property
    def train(self) -> float:
        """Forward + backward: the FLOPs of one training sample."""
        return self.forward + self.backward

    def to_dict(self) -> dict[str, Any]:
        return {
            "patch": list(self.patch),
            "forward_per_sample": self.forward,
            "backward_per_sample": self.backward,
            "train_per_sample": self.train,
            "computed_patch": list(self.computed_patch),
            "padding_share": self.padding_share,
            "useful_train_per_sample": self.useful_train,
            "forward_by_kind": dict(self.by_kind),
            "convention": "1 multiply-add = 2 FLOPs; backward = 2 x forward",
        }


def _voxels(t: torch.Tensor) -> int:
    return math.prod(t.shape[2:])


def layer_flops(module: nn.Module, inputs: Sequence[torch.Tensor], output: torch.Tensor) -> float:
    """One layer's forward FLOPs for this call (whole batch); 0 for layers not counted."""
    if isinstance(module, nn.ConvTranspose3d | nn.ConvTranspose2d | nn.ConvTranspose1d):
        x = inputs[0]
        per_voxel = 2 * module.in_channels * (module.out_channels // module.groups)
        macs = per_voxel * math.prod(module.kernel_size) * _voxels(x) * x.shape[0]
        return macs + (output.numel() if module.bias is not None else 0)
    if isinstance(module, nn.Conv3d | nn.Conv2d | nn.Conv1d):
        per_voxel = 2 * (module.in_channels // module.groups) * module.out_channels
        macs = per_voxel * math.prod(module.kernel_size) * _voxels(output) * output.shape[0]
        return macs + (output.numel() if module.bias is not None else 0)
    if isinstance(module, NORM_TYPES):
        affine = getattr(module, "affine", True)
        return (NORM_FLOPS_PER_ELEMENT if affine else NORM_FLOPS_PER_ELEMENT - 2) * output.numel()
    if isinstance(module, ACTIVATION_TYPES):
        return float(output.numel())
    return 0.0


def _kind(name: str, module: nn.Module) -> str | None:
    if isinstance(module, nn.ConvTranspose3d | nn.ConvTranspose2d | nn.ConvTranspose1d):
        return "conv_transpose"
    if isinstance(module, nn.Conv3d | nn.Conv2d | nn.Conv1d):
        # The output heads (deep supervision) are the modules under a "heads" container.
        return "head" if "head" in name.split(".")[0] else "conv"
    if isinstance(module, NORM_TYPES):
        return "norm"
    if isinstance(module, ACTIVATION_TYPES):
        return "activation"
    return None


def count_model(model: nn.Module, patch: Sequence[int], in_channels: int) -> FlopCount:
    """FLOPs of `model` (any device, meta included) for one sample of `patch`, counted by
    forward hooks in training mode (deep-supervision heads run); the model's mode is restored."""
    totals = dict.fromkeys(KINDS, 0.0)
    handles = []
    for name, module in model.named_modules():
        kind = _kind(name, module)
        if kind is None:
            continue

        def hook(mod: nn.Module, args: tuple, out: Any, kind: str = kind) -> None:
            totals[kind] += layer_flops(mod, args, out)

        handles.append(module.register_forward_hook(hook))
    device = next(model.parameters()).device
    was_training = model.training
    model.train()
    try:
        with torch.no_grad():  # no autograd graph (and no checkpointing) for a count
            model(torch.empty(1, in_channels, *patch, device=device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    computed = computed_patch(patch, int(getattr(model, "size_multiple", 1)))
    return FlopCount(tuple(int(p) for p in patch), sum(totals.values()), totals, computed)


@functools.lru_cache(maxsize=16)
def _count_cached(model_json: str, patch: tuple[int, ...]) -> FlopCount:
    cfg = json.loads(model_json)
    with torch.device("meta"):
        model = build_model(cfg)
    return count_model(model, patch, int(cfg.get("in_channels", 1)))


def count_flops(model_cfg: Mapping[str, Any], patch: Sequence[int]) -> FlopCount:
    """The counted FLOPs of the experiment's model (its `model` section) at `patch`, per sample.
    Built on the meta device: takes well under a second and no memory, whatever the model."""
    key = json.dumps(dict(model_cfg), sort_keys=True, default=list)
    return _count_cached(key, tuple(int(p) for p in patch))


def padding_warning(model_cfg: Mapping[str, Any], patch: Sequence[int]) -> str | None:
    """One line when the network pads `patch`, naming the unpadded patch of the same cost (the
    size it is computed at, so the same FLOPs a sample); None when nothing is padded."""
    multiple = config_size_multiple(model_cfg)
    computed = computed_patch(patch, multiple)
    if computed == tuple(int(s) for s in patch):
        return None
    share = 1.0 - math.prod(patch) / math.prod(computed)
    shown, planned = "x".join(map(str, patch)), "x".join(map(str, computed))
    return (
        f"patch {shown} is computed at {planned} (the network pads each axis to a multiple of "
        f"{multiple}): {100 * share:.1f}% of its FLOPs are padding; {planned} costs the same "
        "with none"
    )


@dataclass(frozen=True)
class Efficiency:
    """What a run's samples/s mean in FLOPs: its counted FLOPs per training sample and the peak
    of the precision it runs in (`ctseg.network.peaks`), times the `devices` the samples/s ran
    on (samples/s are all processes' together). `columns` gives steps.csv's efficiency columns;
    this is the one place MFU is divided by the devices."""

    flops: FlopCount
    peak: Any  # ctseg.network.peaks.Peak
    devices: int = 1

    @classmethod
    def for_run(
        cls,
        exp: Mapping[str, Any],
        phase: Mapping[str, Any],
        device: torch.device | str,
        devices: int = 1,
    ) -> Efficiency:
        """For an experiment (its model, patch and train.tf32) under a phase (its precision)
        on `devices` devices like `device`. The peak's lookup is free on a known card;
        elsewhere it probes (0.3 s)."""
        from ctseg.network.peaks import device_peak, precision_in_use

        device = torch.device(device)
        precision = precision_in_use(
            phase.get("precision"), bool(exp["train"].get("tf32")), device.type
        )
        flops = count_flops(exp["model"], exp["data"]["patch_size"])
        return cls(flops, device_peak(device, precision), int(devices))

    @property
    def peak_tflops(self) -> float:
        """The peak of all `devices` together."""
        return self.peak.tflops * self.devices

    def tflops(self, samples_per_s: float) -> float:
        """Achieved TFLOP/s (computed model FLOPs, forward and backward) at `samples_per_s`."""
        return self.flops.train * samples_per_s / 1e12

    def mfu(self, samples_per_s: float) -> float:
        """Computed FLOP/s over the peak: padding counted as work."""
        return self.tflops(samples_per_s) / self.peak_tflops

    def useful_mfu(self, samples_per_s: float) -> float:
        """Useful FLOP/s (`FlopCount.useful_train`) over the peak: padding left out."""
        return self.mfu(samples_per_s) * self.flops.useful_fraction

    def columns(self, samples_per_s: float) -> dict[str, float]:
        """steps.csv's ``tflops``, ``mfu`` and ``useful_mfu`` at `samples_per_s`."""
        return {
            "tflops": self.tflops(samples_per_s),
            "mfu": self.mfu(samples_per_s),
            "useful_mfu": self.useful_mfu(samples_per_s),
        }
