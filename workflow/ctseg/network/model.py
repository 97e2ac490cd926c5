"""A 3D U-Net for sheet segmentation, with deep supervision and gradient checkpointing.

Layout (depth = len(filters)): level 0 works at full resolution, level i at 1/2**i. By default
each level has one block of two 3x3x3 convolutions; the decoder upsamples with a transposed
convolution and concatenates the encoder's output of the same level (the skip).

Residual-encoder option (nnU-Net's ResEnc U-Net, Isensee et al. 2024, "nnU-Net Revisited"):
``blocks_per_stage`` gives encoder level i that many blocks: the first one downsamples (a stride-2
first conv with ``downsample: conv``) and changes the width, the others keep both, so with
``block: residual`` they are ResNet basic blocks with an identity shortcut. nnU-Net's ResEnc M/L
use (1, 3, 4, 6, 6, 6) blocks, widths min(32 * 2**i, 320) and one conv-norm-act per decoder
level, which ``decoder_convs: 1`` gives. Two differences, both kept for the existing weights'
sake: there is no separate stem conv (level 0's first block reads the image itself), and a
stride-2 block's shortcut is a strided 1x1x1 conv rather than ResNet-D's average pool + 1x1x1.
Left out (``blocks_per_stage: null``, ``decoder_convs: 2``) the network is exactly the one
before these options: same parameter names, same initial weights for the same seed.

Any input shape is accepted: ``forward`` pads the input at the far end of each spatial axis to a
multiple of 2**(depth-1) and crops every output back. exp001_full's 72x136x136 patches need this
with 5 levels (72 is not a multiple of 16): they are computed at 80x144x144 (`computed_patch`),
so a fifth of their FLOPs go to padding (`ctseg.network.flops`), and 80x144x144 itself costs
the same with nothing padded. Because padding is only at the far end, output voxel j
of the 1/2**k head covers input voxels [j*2**k, (j+1)*2**k), and its shape is ceil(size / 2**k):
exactly what `ctseg.network.losses` expects when it pools the targets for deep supervision.

Norms (``norm``): ``instance`` is ``nn.InstanceNorm3d``; ``instance_layout`` is the same
normalisation written as reductions over the spatial axes and element-wise ops
(`LayoutInstanceNorm3d`), so a channels_last_3d tensor stays channels_last (torch's
``instance_norm`` reshapes and copies to contiguous on the way in and out, pytorch issue 59168)
and torch.compile can fuse it with the activation; same parameter names, so either loads the
other's checkpoints. ``batch``, ``group`` and ``none`` as named.

`model_summary` prints a configuration's parameters per level and its activation memory (what
autograd saves for backward, counted on the meta device, so without computing anything).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ctseg.io import CtsegError
from ctseg.network.sizes import DEFAULT_FILTERS, size_multiple

BLOCKS = ("basic", "residual")
NORMS = ("instance", "instance_layout", "batch", "group", "none")
DOWNSAMPLES = ("conv", "maxpool")
ACTIVATIONS = ("leakyrelu", "relu")
# build_model accepts exactly these keys; an unknown key is a typo, not something to ignore.
CONFIG_KEYS = (
    "filters",
    "block",
    "norm",
    "deep_supervision",
    "checkpointing",
    "in_channels",
    "out_channels",
    "downsample",
    "activation",
    "blocks_per_stage",
    "decoder_convs",
)
DECODER_CONVS = (1, 2)
GROUP_NORM_GROUPS = 8
INSTANCE_NORM_EPS = 1e-5  # nn.InstanceNorm3d's default


def _choice(name: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise CtsegError(f"{name}={value!r}: expected one of {list(allowed)}")
    return value


_SPATIAL = (2, 3, 4)


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs (as torch's own norms), the input's dtype above it."""
    return torch.promote_types(x.dtype, torch.float32)


class _LayoutInstanceNormFunction(torch.autograd.Function):
    """Instance norm with an affine transform, forward and backward written as reductions over
    the spatial axes and element-wise ops on tensors of the input's own layout. Autograd's
    backward of the forward's `var_mean` would divide an expanded (stride-0) gradient and so
    write a full-size contiguous tensor for every norm of a channels_last network; this one
    writes nothing in another layout. Statistics and gradients are computed in float32."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # noqa: ANN001, ANN205 - autograd's signature
        xf = x.to(_stats_dtype(x))  # keeps the layout; a no-op for float32
        var, mean = torch.var_mean(xf, dim=_SPATIAL, keepdim=True, correction=0)
        rstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, mean, rstd, weight)
        scale = rstd * weight.to(xf.dtype).view(1, -1, 1, 1, 1)
        return ((xf - mean) * scale + bias.to(xf.dtype).view(1, -1, 1, 1, 1)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, mean, rstd, weight = ctx.saved_tensors
        grad = grad.to(mean.dtype)
        normalised = (x.to(mean.dtype) - mean) * rstd
        grad_weight = (grad * normalised).sum(dim=(0, *_SPATIAL))
        grad_bias = grad.sum(dim=(0, *_SPATIAL))
        g = grad * weight.to(mean.dtype).view(1, -1, 1, 1, 1)
        g_mean = g.mean(dim=_SPATIAL, keepdim=True)
        gn_mean = (g * normalised).mean(dim=_SPATIAL, keepdim=True)
        grad_x = ((g - g_mean - normalised * gn_mean) * rstd).to(x.dtype)
        return grad_x, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), None


class LayoutInstanceNorm3d(nn.Module):
    """Instance normalisation with an affine transform, as ``nn.InstanceNorm3d(c, affine=True)``
    computes it (biased variance, eps 1e-5, statistics in float32, output in the input's dtype),
    written as a reduction over the spatial axes and element-wise ops, forward and backward
    (`_LayoutInstanceNormFunction`). Every op keeps the input's memory format, so a
    channels_last_3d input gives a channels_last_3d output and gradient with no copy, and
    torch.compile fuses the lot (with the activation after it). Parameters ``weight`` and
    ``bias`` (shape (C,)), as nn.InstanceNorm3d's: checkpoints load either way."""

    def __init__(self, num_features: int, eps: float = INSTANCE_NORM_EPS) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.affine = True  # what ctseg.network.flops reads of a norm
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 5 or x.shape[1] != self.num_features:
            raise CtsegError(
                f"input of shape {tuple(x.shape)}: expected (B, {self.num_features}, Z, Y, X)"
            )
        return _LayoutInstanceNormFunction.apply(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine=True"


def make_norm(kind: str, channels: int) -> nn.Module:
    if kind == "instance":
        return nn.InstanceNorm3d(channels, affine=True)
    if kind == "instance_layout":
        return LayoutInstanceNorm3d(channels)
    if kind == "batch":
        return nn.BatchNorm3d(channels)
    if kind == "group":
        # gcd keeps the group count a divisor of the channel count for small test networks.
        return nn.GroupNorm(math.gcd(channels, GROUP_NORM_GROUPS), channels)
    return nn.Identity()


def make_activation(kind: str) -> nn.Module:
    # Not in-place: checkpointed blocks are run twice and must see the same inputs.
    return nn.LeakyReLU(0.01) if kind == "leakyrelu" else nn.ReLU()


def conv3(in_ch: int, out_ch: int, stride: int, norm: str) -> nn.Conv3d:
    # A bias in front of a normalisation is cancelled by it, so only "none" keeps one.
    return nn.Conv3d(in_ch, out_ch, 3, stride=stride, padding=1, bias=norm == "none")


class ConvBlock(nn.Module):
    """conv-norm-act twice; ``residual`` adds a 1x1x1 projection shortcut before the last act."""

    def __init__(
        self, in_ch: int, out_ch: int, *, stride: int, block: str, norm: str, activation: str
    ) -> None:
        super().__init__()
        self.conv1 = conv3(in_ch, out_ch, stride, norm)
        self.norm1 = make_norm(norm, out_ch)
        self.act1 = make_activation(activation)
        self.conv2 = conv3(out_ch, out_ch, 1, norm)
        self.norm2 = make_norm(norm, out_ch)
        self.act2 = make_activation(activation)
        self.shortcut: nn.Module | None = None
        if block == "residual":
            if in_ch == out_ch and stride == 1:
                self.shortcut = nn.Identity()
            else:
                self.shortcut = nn.Sequential(
                    nn.Conv3d(in_ch, out_ch, 1, stride=stride, bias=norm == "none"),
                    make_norm(norm, out_ch),
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act1(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        if self.shortcut is not None:
            y = y + self.shortcut(x)
        return self.act2(y)


class ConvNormAct(nn.Module):
    """One conv-norm-act: the decoder block of nnU-Net's ResEnc U-Nets (``decoder_convs: 1``)."""

    def __init__(self, in_ch: int, out_ch: int, *, norm: str, activation: str) -> None:
        super().__init__()
        self.conv1 = conv3(in_ch, out_ch, 1, norm)
        self.norm1 = make_norm(norm, out_ch)
        self.act1 = make_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act1(self.norm1(self.conv1(x)))


class Encoder(nn.Module):
    """Downsampling (a stride-2 first conv, or a 2x max-pool) followed by a block, then
    ``n_blocks - 1`` more blocks at the same width and resolution (``extra``; empty by default,
    so the default network's parameter names are those it always had)."""

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        *,
        downsample: str | None,
        n_blocks: int = 1,
        **block_kw: str,
    ) -> None:
        super().__init__()
        self.pool = nn.MaxPool3d(2) if downsample == "maxpool" else nn.Identity()
        stride = 2 if downsample == "conv" else 1
        self.block = ConvBlock(in_ch, out_ch, stride=stride, **block_kw)
        self.extra = nn.ModuleList(
            ConvBlock(out_ch, out_ch, stride=1, **block_kw) for _ in range(n_blocks - 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(self.pool(x))
        for block in self.extra:
            x = block(x)
        return x


class Decoder(nn.Module):
    """Transposed-conv upsampling, concatenation with the skip, then a block (two convs, or
    one conv-norm-act with ``convs=1``)."""

    def __init__(self, in_ch: int, out_ch: int, *, convs: int = 2, **block_kw: str) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(in_ch, out_ch, 2, stride=2)
        if convs == 1:
            self.block: nn.Module = ConvNormAct(
                2 * out_ch, out_ch, norm=block_kw["norm"], activation=block_kw["activation"]
            )
        else:
            self.block = ConvBlock(2 * out_ch, out_ch, stride=1, **block_kw)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.block(torch.cat([self.up(x), skip], dim=1))


@contextlib.contextmanager
def _frozen_batchnorm_stats(module: nn.Module) -> Iterator[None]:
    """Momentum 0 while a checkpointed block is recomputed for backward.

    The recomputation runs the block's forward a second time in training mode; without this,
    BatchNorm would fold the same batch into its running statistics (and its batch counter)
    twice. Outputs do not change: training-mode BatchNorm normalises with the batch statistics
    either way.
    """
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [(m.momentum, m.num_batches_tracked) for m in norms]
    for m in norms:
        m.momentum = 0.0
        if m.num_batches_tracked is not None:
            m.num_batches_tracked = m.num_batches_tracked.clone()
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved, strict=True):
            m.momentum = momentum
            m.num_batches_tracked = tracked


class UNet3D(nn.Module):
    """3D U-Net. In training with ``deep_supervision`` the forward returns a list of logits
    [full resolution, 1/2, 1/4, ...] (one head per decoder level, depth-1 in all); otherwise
    (eval mode, or no deep supervision) a single full-resolution tensor (B, out_channels, Z, Y, X).
    """

    def __init__(
        self,
        in_channels: int = 1,
        out_channels: int = 1,
        filters: Sequence[int] = DEFAULT_FILTERS,
        block: str = "basic",
        norm: str = "instance",
        deep_supervision: bool = False,
        checkpointing: bool = False,
        downsample: str = "conv",
        activation: str = "leakyrelu",
        blocks_per_stage: Sequence[int] | None = None,
        decoder_convs: int = 2,
    ) -> None:
        super().__init__()
        filters = tuple(filters)
        if len(filters) < 2:
            raise CtsegError(f"filters={filters!r}: need at least 2 levels")
        for name, value in [("in_channels", in_channels), ("out_channels", out_channels)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CtsegError(f"{name}={value!r}: expected a positive integer")
        if any(isinstance(f, bool) or not isinstance(f, int) or f < 1 for f in filters):
            raise CtsegError(f"filters={filters!r}: expected positive integers")
        for name, flag in [
            ("deep_supervision", deep_supervision),
            ("checkpointing", checkpointing),
        ]:
            if not isinstance(flag, bool):
                raise CtsegError(f"{name}={flag!r}: expected true or false")
        block_kw = {
            "block": _choice("block", block, BLOCKS),
            "norm": _choice("norm", norm, NORMS),
            "activation": _choice("activation", activation, ACTIVATIONS),
        }
        _choice("downsample", downsample, DOWNSAMPLES)
        blocks = _blocks_per_stage(blocks_per_stage, len(filters))
        if (
            isinstance(decoder_convs, bool)
            or not isinstance(decoder_convs, int)
            or decoder_convs not in DECODER_CONVS
        ):
            raise CtsegError(f"decoder_convs={decoder_convs!r}: expected one of {DECODER_CONVS}")

        self.filters = filters
        self.blocks_per_stage = blocks
        self.depth = len(filters)
        self.deep_supervision = deep_supervision
        self.checkpointing = checkpointing
        self.encoders = nn.ModuleList(
            Encoder(
                in_channels if i == 0 else filters[i - 1],
                filters[i],
                downsample=None if i == 0 else downsample,
                n_blocks=blocks[i],
                **block_kw,
            )
            for i in range(self.depth)
        )
        # decoders[i] produces level i from level i+1 (the bottleneck is level depth-1).
        self.decoders = nn.ModuleList(
            Decoder(filters[i + 1], filters[i], convs=decoder_convs, **block_kw)
            for i in range(self.depth - 1)
        )
        n_heads = self.depth - 1 if self.deep_supervision else 1
        self.heads = nn.ModuleList(nn.Conv3d(filters[i], out_channels, 1) for i in range(n_heads))
        self._init_weights(negative_slope=0.01 if activation == "leakyrelu" else 0.0)

    def _init_weights(self, negative_slope: float) -> None:
        # He initialisation as in nnU-Net; PyTorch's default is tuned for linear layers.
        for m in self.modules():
            if isinstance(m, nn.Conv3d | nn.ConvTranspose3d):
                nn.init.kaiming_normal_(m.weight, a=negative_slope)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @property
    def size_multiple(self) -> int:
        """Spatial sizes that are multiples of this need no padding."""
        return size_multiple(self.depth)

    def _run(self, module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(
                module,
                *args,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), _frozen_batchnorm_stats(module)),
            )
        return module(*args)

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        if x.ndim != 5 or x.shape[1] != self.encoders[0].block.conv1.in_channels:
            raise CtsegError(
                f"input of shape {tuple(x.shape)}: expected (B, "
                f"{self.encoders[0].block.conv1.in_channels}, Z, Y, X)"
            )
        size = x.shape[2:]
        m = self.size_multiple
        pad = [(-s) % m for s in size]
        if any(pad):
            x = F.pad(x, _pad_arg(pad))

        skips = []
        for encoder in self.encoders:
            x = self._run(encoder, x)
            skips.append(x)
        x = skips.pop()
        levels = []
        for i in reversed(range(self.depth - 1)):
            x = self._run(self.decoders[i], x, skips[i])
            levels.append(x)
        levels.reverse()  # levels[i] is decoder output at 1/2**i

        if self.deep_supervision and self.training:
            return [_crop(head(levels[i]), size, 2**i) for i, head in enumerate(self.heads)]
        return _crop(self.heads[0](levels[0]), size, 1)


def _blocks_per_stage(value: Sequence[int] | None, depth: int) -> tuple[int, ...]:
    """One block per level when absent; else one positive count per level of ``filters``."""
    if value is None:
        return (1,) * depth
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise CtsegError(f"blocks_per_stage={value!r}: expected a list of integers or null")
    counts = tuple(value)
    if len(counts) != depth or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts
    ):
        raise CtsegError(
            f"blocks_per_stage={list(counts)!r}: expected {depth} positive integers, one per "
            "entry of filters"
        )
    return counts


def _pad_arg(pad: Sequence[int]) -> list[int]:
    """F.pad's argument for padding (z, y, x) at the far end: (x0, x1, y0, y1, z0, z1)."""
    return [0, pad[2], 0, pad[1], 0, pad[0]]


def _crop(t: torch.Tensor, size: Sequence[int], factor: int) -> torch.Tensor:
    z, y, x = (-(-s // factor) for s in size)  # ceil division
    return t[:, :, :z, :y, :x]


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build_model(cfg: Mapping[str, object]) -> UNet3D:
    """A UNet3D from a config mapping (the experiment's ``model`` section); absent keys keep the
    defaults, unknown keys raise CtsegError."""
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        raise CtsegError(f"model config: unknown key(s) {unknown}; allowed: {list(CONFIG_KEYS)}")
    kwargs = dict(cfg)
    if "filters" in kwargs:
        filters = kwargs["filters"]
        if isinstance(filters, str | bytes) or not isinstance(filters, Sequence):
            raise CtsegError(f"model config: filters={filters!r}: expected a list of integers")
        kwargs["filters"] = tuple(filters)
    return UNet3D(**kwargs)


# ----------------------------------------------------------------------------- summary
def stage_parameters(model: UNet3D) -> list[tuple[str, int]]:
    """Trainable parameters per part: each encoder level, each decoder level (its upsampling
    included), the output heads. They sum to `count_parameters`."""
    rows = [(f"encoder {i}", count_parameters(m)) for i, m in enumerate(model.encoders)]
    rows += [(f"decoder {i}", count_parameters(m)) for i, m in enumerate(model.decoders)]
    rows.append(("heads", count_parameters(model.heads)))
    return rows


def saved_activation_bytes(
    model_cfg: Mapping[str, object],
    patch: Sequence[int],
    *,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Bytes that autograd keeps for backward in one training forward of the model, at `batch`
    patches with every activation in `dtype` (eager mode, no checkpointing's savings counted
    unless the config has it on).

    Counted, not guessed: the model is built on the meta device (shapes only, no memory, no
    compute) and every tensor that autograd saves is recorded through saved_tensors_hooks, once
    per tensor, leaving out the parameters. bf16 here stands for phase 6's autocast, where the
    convolutions, norms and activations run in bf16. What it leaves out: the loss terms (one
    channel at full resolution each, small beside the 32-channel level-0 maps), the transient
    memory of the backward pass, cuDNN workspaces and the allocator's slack, and what
    torch.compile saves by fusing norm + activation (it keeps fewer tensors, so compiled runs
    need less).
    """
    with torch.device("meta"):
        model = build_model(model_cfg)
    model = model.to(dtype).train()
    params = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # holds each tensor so that no id is reused during the count

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params:
            keep.append(t)
            saved[id(t)] = t.numel() * t.element_size()
        return t

    x = torch.empty((batch, model.encoders[0].block.conv1.in_channels, *patch), device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.to(dtype))
    return sum(saved.values())


def portable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as CPU tensors in the standard (row-major) layout.

    A channels_last_3d model holds its weights with permuted strides, and a tensor whose
    non-unit dimensions happen to be in order (a 1x1x1 conv's weight) even counts as
    contiguous while its last stride is not 1, so ``.contiguous()`` leaves it as it is. Every
    reader of saved weights (checkpoints, digests, inference) therefore gets this copy: plain
    strides, the same bytes whatever memory format the model trained in.
    """
    return {
        name: tensor.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        for name, tensor in model.state_dict().items()
    }


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's values as bytes in row-major order, whatever its strides or device."""
    plain = tensor.detach().to("cpu").clone(memory_format=torch.contiguous_format).reshape(-1)
    return plain.view(torch.uint8).numpy().tobytes()


def parameter_digest(model: nn.Module) -> str:
    """sha256 over the parameters' names and bytes: equal digests, equal weights."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(tensor_bytes(param))
    return digest.hexdigest()
