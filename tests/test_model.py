"""UNet3D: shapes on odd patch sizes, deep supervision, checkpointing, channels_last, config."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ctseg.io import CtsegError
from ctseg.model import BLOCKS, NORMS, UNet3D, build_model, count_parameters

SMALL = (4, 8, 16, 32)


def seeded_input(shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("block", BLOCKS)
def test_every_block_and_norm_keeps_an_odd_input_shape(block, norm):
    torch.manual_seed(0)
    # Not a multiple of 2**(depth-1) = 4 on any axis.
    model = UNet3D(filters=(2, 4, 8), block=block, norm=norm)
    x = seeded_input((2, 1, 6, 10, 14))
    out = model(x)
    assert out.shape == x.shape
    assert torch.isfinite(out).all()
    out.mean().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("shape", [(1, 1, 16, 16, 16), (1, 1, 7, 9, 13), (1, 1, 1, 5, 8)])
@pytest.mark.parametrize("downsample", ["conv", "maxpool"])
def test_any_spatial_shape_works(shape, downsample):
    model = UNet3D(filters=(2, 4, 8), downsample=downsample, norm="group").eval()
    with torch.no_grad():
        assert model(seeded_input(shape)).shape == shape


def test_padding_is_at_the_far_end_and_cropped_back():
    """An odd input gives the same output as the same input zero-padded by hand."""
    model = UNet3D(filters=(2, 2, 2, 2), norm="group").eval()
    x = seeded_input((1, 1, 18, 34, 34))
    padded = F.pad(x, [0, 6, 0, 6, 0, 6])  # to 24x40x40, multiples of 8
    with torch.no_grad():
        out = model(x)
        ref = model(padded)[:, :, :18, :34, :34]
    torch.testing.assert_close(out, ref)


def test_multiple_output_channels_and_input_channels():
    model = UNet3D(in_channels=2, out_channels=3, filters=(2, 4, 8))
    assert model(seeded_input((1, 2, 8, 8, 8))).shape == (1, 3, 8, 8, 8)
    with pytest.raises(CtsegError, match="expected"):
        model(seeded_input((1, 1, 8, 8, 8)))
    with pytest.raises(CtsegError, match="expected"):
        model(seeded_input((2, 8, 8, 8)))


def test_deep_supervision_returns_one_head_per_decoder_level_in_training_only():
    model = UNet3D(filters=SMALL, deep_supervision=True)
    x = seeded_input((1, 1, 18, 34, 34))
    outs = model.train()(x)
    assert isinstance(outs, list)
    assert [tuple(o.shape[2:]) for o in outs] == [(18, 34, 34), (9, 17, 17), (5, 9, 9)]
    with torch.no_grad():
        single = model.eval()(x)
        assert torch.is_tensor(single) and single.shape == x.shape
        # Eval's single output is the training list's full-resolution head (norm: instance).
        torch.testing.assert_close(single, model.train()(x)[0])
    plain = UNet3D(filters=SMALL).train()(x)
    assert torch.is_tensor(plain)


def test_deep_supervision_shapes_at_the_seed_depth():
    """Five levels, exp001_full's 72x136x136 at 1/4 in z and 1/8 in y, x: 18x17x17."""
    model = UNet3D(filters=(2, 2, 2, 2, 2), deep_supervision=True, norm="none")
    outs = model(seeded_input((1, 1, 18, 17, 17)))
    expected = [(18, 17, 17), (9, 9, 9), (5, 5, 5), (3, 3, 3)]
    assert [tuple(o.shape[2:]) for o in outs] == expected


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("norm", "block", "deep_supervision"),
    [("instance", "basic", False), ("batch", "residual", True), ("group", "basic", True)],
)
def test_checkpointing_gives_the_same_outputs_gradients_and_running_stats(
    norm, block, deep_supervision
):
    torch.manual_seed(1)
    kw = {"filters": (2, 4, 8), "norm": norm, "block": block, "deep_supervision": deep_supervision}
    plain = UNet3D(**kw)
    ckpt = UNet3D(**kw, checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    x = seeded_input((2, 1, 6, 10, 10))
    outs = []
    for model in (plain, ckpt):
        model.train()
        out = model(x)
        out = out if isinstance(out, list) else [out]
        sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in out).backward()
        outs.append(out)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    grads_plain, grads_ckpt = _grads(plain), _grads(ckpt)
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # The recomputation for backward must not fold the batch into BatchNorm's stats twice.
    for (name, a), (_, b) in zip(plain.named_buffers(), ckpt.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    # The momentum that was zeroed during recomputation is restored.
    assert all(m.momentum == 0.1 for m in ckpt.modules() if isinstance(m, torch.nn.BatchNorm3d))


def test_checkpointing_is_off_in_eval_and_without_grad(monkeypatch):
    import ctseg.model

    calls = []
    real = ctseg.model.checkpoint

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ctseg.model, "checkpoint", spy)
    model = UNet3D(filters=(2, 4), checkpointing=True)
    x = seeded_input((1, 1, 4, 4, 4))
    with torch.no_grad():
        model.train()(x)
    model.eval()(x)
    assert calls == []
    model.train()(x)
    assert len(calls) == 3  # two encoders and one decoder


def test_channels_last_3d_matches_contiguous():
    torch.manual_seed(2)
    model = UNet3D(filters=SMALL, block="residual", deep_supervision=True)
    cl_model = copy.deepcopy(model).to(memory_format=torch.channels_last_3d)
    x = seeded_input((1, 1, 10, 18, 18))
    x_cl = x.to(memory_format=torch.channels_last_3d)
    assert x_cl.is_contiguous(memory_format=torch.channels_last_3d)
    out = model(x)
    out_cl = cl_model(x_cl)
    for a, b in zip(out, out_cl, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    sum(o.sum() for o in out_cl).backward()
    assert all(torch.isfinite(p.grad).all() for p in cl_model.parameters())


def test_parameter_count_of_a_tiny_network_by_hand():
    # filters (2, 4), no norm (so convs have biases), in 1, out 1:
    #   enc0 1->2, 2->2: 27*2+2, 27*4+2; enc1 2->4, 4->4: 27*8+4, 27*16+4
    #   up 4->2 (k=2): 4*2*8+2; dec0 4->2, 2->2: 27*8+2, 27*4+2; head 2->1: 2+1
    expected = 56 + 110 + 220 + 436 + 66 + 218 + 110 + 3
    assert count_parameters(UNet3D(filters=(2, 4), norm="none")) == expected
    # Residual blocks add a 1x1x1 projection (+ its bias) per block: 1->2, 2->4, 4->2.
    residual = UNet3D(filters=(2, 4), norm="none", block="residual")
    assert count_parameters(residual) == expected + (2 + 2) + (8 + 4) + (8 + 2)
    # Deep supervision with two levels has a single head: nothing extra.
    assert count_parameters(UNet3D(filters=(2, 4), norm="none", deep_supervision=True)) == expected


def test_parameter_count_grows_with_filters_and_frozen_ones_do_not_count():
    counts = [count_parameters(UNet3D(filters=f)) for f in [(2, 4), (4, 8), (4, 8, 16), SMALL]]
    assert counts == sorted(counts) and len(set(counts)) == 4
    model = UNet3D(filters=(2, 4))
    model.heads.requires_grad_(False)
    assert count_parameters(model) == counts[0] - sum(p.numel() for p in model.heads.parameters())


def test_build_model_from_a_mapping():
    cfg = {
        "filters": [4, 8, 16],
        "block": "residual",
        "norm": "group",
        "deep_supervision": True,
        "checkpointing": True,
    }
    model = build_model(cfg)
    assert model.filters == (4, 8, 16)
    assert model.deep_supervision and model.checkpointing
    assert isinstance(model.encoders[0].block.norm1, torch.nn.GroupNorm)
    assert model.encoders[0].block.shortcut is not None
    assert len(model(seeded_input((1, 1, 8, 8, 8)))) == 2
    assert build_model({}).filters == (32, 64, 128, 256, 512)


@pytest.mark.parametrize(
    "cfg",
    [
        {"block": "dense"},
        {"norm": "layer"},
        {"filters": [8]},
        {"filters": []},
        {"filters": [8, 0]},
        {"filters": [8, 16.5]},
        {"filters": "8,16"},
        {"downsample": "avgpool"},
        {"activation": "gelu"},
        {"in_channels": 0},
        {"deep_supervision": "yes"},
        {"filter": [8, 16]},
    ],
    ids=str,
)
def test_bad_config_is_a_ctseg_error(cfg):
    with pytest.raises(CtsegError):
        build_model(cfg)
