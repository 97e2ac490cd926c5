"""UNet3D: shapes on odd patch sizes, deep supervision, checkpointing, channels_last, config; the
residual encoder (blocks per stage, one-conv decoder) and the model summary."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ctseg.io import CtsegError
from ctseg.network.model import (
    BLOCKS,
    NORMS,
    LayoutInstanceNorm3d,
    UNet3D,
    build_model,
    count_parameters,
    parameter_digest,
    saved_activation_bytes,
    stage_parameters,
)
from ctseg.network.summary import model_summary

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
    import ctseg.network.model

    calls = []
    real = ctseg.network.model.checkpoint

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ctseg.network.model, "checkpoint", spy)
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


# ----------------------------------------------------------------------------- residual encoder
def test_the_default_network_is_bit_identical_to_the_one_before_the_residual_encoder():
    """Existing weights must load and existing seeds must give the same start: parameter names,
    shapes and initial values (digests taken from the code before blocks_per_stage existed)."""
    before = {
        "c02c452574ed35a4c0255859c765b368ff3086c8f20e51d68acf36535a8693b3": {
            "filters": [4, 8, 16],
            "deep_supervision": True,
        },
        "23f42cb3f95ce135be6798ec6df901c0f71d70fa8a45246cc0ff344a3f35a791": {
            "filters": [4, 8, 16],
            "block": "residual",
            "norm": "batch",
            "deep_supervision": True,
        },
        "8921992be19c954428b1a0a9061f9495ba0e9d6d47deffb5967feef508751c5c": {},
    }
    for digest, cfg in before.items():
        for explicit in ({}, {"blocks_per_stage": [1] * len(cfg.get("filters", [0] * 5))}):
            torch.manual_seed(0)
            model = build_model({**cfg, **explicit, **({"decoder_convs": 2} if explicit else {})})
            assert parameter_digest(model) == digest, (cfg, explicit)
    names = list(build_model({"filters": [2, 4], "block": "residual"}).state_dict())
    assert names[:9] == [
        "encoders.0.block.conv1.weight",
        "encoders.0.block.norm1.weight",
        "encoders.0.block.norm1.bias",
        "encoders.0.block.conv2.weight",
        "encoders.0.block.norm2.weight",
        "encoders.0.block.norm2.bias",
        "encoders.0.block.shortcut.0.weight",
        "encoders.0.block.shortcut.1.weight",
        "encoders.0.block.shortcut.1.bias",
    ]
    assert len(names) == 31 and names[-2:] == ["heads.0.weight", "heads.0.bias"]


RESENC = {
    "filters": [4, 8, 16],
    "block": "residual",
    "blocks_per_stage": [1, 2, 3],
    "decoder_convs": 1,
    "deep_supervision": True,
}


def test_blocks_per_stage_stacks_identity_residual_blocks_after_the_downsampling_one():
    model = build_model(RESENC)
    assert [1 + len(e.extra) for e in model.encoders] == [1, 2, 3]
    for i, encoder in enumerate(model.encoders):
        assert encoder.block.conv1.stride == ((2,) * 3 if i else (1,) * 3)
        for block in encoder.extra:  # same width and resolution: the identity shortcut
            assert isinstance(block.shortcut, torch.nn.Identity)
            assert (
                block.conv1.stride == (1, 1, 1)
                and block.conv1.in_channels == block.conv1.out_channels
            )
    x = seeded_input((2, 1, 6, 10, 14))  # odd sizes: padded and cropped back
    outs = model(x)
    assert [tuple(o.shape[2:]) for o in outs] == [(6, 10, 14), (3, 5, 7)]
    sum(o.mean() for o in outs).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_decoder_convs_1_is_one_conv_norm_act_per_level():
    plain = build_model({**RESENC, "decoder_convs": 2})
    single = build_model(RESENC)
    for decoder in single.decoders:
        assert [type(m).__name__ for m in decoder.block.children()] == [
            "Conv3d",
            "InstanceNorm3d",
            "LeakyReLU",
        ]
    # The second conv (and norm), and the residual shortcut's 1x1x1 projection and norm, go.
    removed = sum(
        count_parameters(d.block.conv2)
        + count_parameters(d.block.norm2)
        + count_parameters(d.block.shortcut)
        for d in plain.decoders
    )
    assert count_parameters(plain) - count_parameters(single) == removed > 0


def test_parameter_count_of_a_residual_encoder_by_hand():
    # filters (2, 4), blocks (2, 2), no norm (convs keep their bias), decoder_convs 1, in 1, out 1:
    #   enc0: block 1->2 (27*2+2, 27*4+2, shortcut 2+2), extra 2->2 (27*4+2 twice)
    #   enc1: block 2->4 (27*8+4, 27*16+4, shortcut 8+4), extra 4->4 (27*16+4 twice)
    #   dec0: up 4->2 (4*2*8+2), one conv 4->2 (27*8+2); head 2->1 (2+1)
    enc0 = 56 + 110 + 4 + 2 * 110
    enc1 = 220 + 436 + 12 + 2 * 436
    dec0 = 66 + 218
    model = UNet3D(
        filters=(2, 4), norm="none", block="residual", blocks_per_stage=(2, 2), decoder_convs=1
    )
    assert count_parameters(model) == enc0 + enc1 + dec0 + 3
    assert stage_parameters(model) == [
        ("encoder 0", enc0),
        ("encoder 1", enc1),
        ("decoder 0", dec0),
        ("heads", 3),
    ]


def test_checkpointing_a_deep_stage_gives_the_same_gradients():
    torch.manual_seed(3)
    plain = build_model(RESENC)
    ckpt = build_model({**RESENC, "checkpointing": True})
    ckpt.load_state_dict(plain.state_dict())
    x = seeded_input((1, 1, 8, 8, 8))
    for model in (plain, ckpt):
        sum((o * o).sum() for o in model.train()(x)).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "cfg",
    [
        {"filters": [4, 8], "blocks_per_stage": [1]},
        {"filters": [4, 8], "blocks_per_stage": [1, 0]},
        {"filters": [4, 8], "blocks_per_stage": [1, 2.0]},
        {"filters": [4, 8], "blocks_per_stage": "1,2"},
        {"filters": [4, 8], "blocks_per_stage": [True, 1]},
        {"decoder_convs": 3},
        {"decoder_convs": True},
        {"decoder_convs": 1.0},
    ],
    ids=str,
)
def test_bad_residual_encoder_config_is_a_ctseg_error(cfg):
    with pytest.raises(CtsegError, match="blocks_per_stage|decoder_convs"):
        build_model(cfg)


# ----------------------------------------------------------------------------- summary
def _saved_on_cpu(cfg, shape) -> int:
    """What autograd saves, measured on real CPU tensors by their storage."""
    torch.manual_seed(0)
    model = build_model(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(seeded_input(shape))
    return sum(storages.values())


@pytest.mark.parametrize("cfg", [{"filters": [4, 8, 16]}, RESENC], ids=["basic", "resenc"])
def test_saved_activation_bytes_on_meta_equal_what_a_real_forward_saves(cfg):
    counted = saved_activation_bytes(cfg, (12, 16, 16), batch=2, dtype=torch.float32)
    assert counted == _saved_on_cpu(cfg, (2, 1, 12, 16, 16))
    # Activations scale with the batch; bf16 halves them (up to the norms' fp32 statistics).
    assert saved_activation_bytes(cfg, (12, 16, 16), batch=1, dtype=torch.float32) * 2 == counted
    half = saved_activation_bytes(cfg, (12, 16, 16), batch=2)
    assert 0.5 * counted <= half < 0.52 * counted
    # Checkpointing keeps only the stage boundaries.
    ckpt = saved_activation_bytes({**cfg, "checkpointing": True}, (12, 16, 16), batch=2)
    assert ckpt < half / 3


def test_model_summary_lists_every_level_and_the_total():
    text = model_summary(RESENC, (12, 20, 20), batch=2)
    model = build_model(RESENC)
    rows = dict(line.rsplit(maxsplit=1) for line in text.splitlines()[2:8])
    assert [name.strip() for name in rows] == [
        "encoder 0",
        "encoder 1",
        "encoder 2",
        "decoder 0",
        "decoder 1",
        "heads",
    ]
    assert sum(int(v.replace(",", "")) for v in rows.values()) == count_parameters(model)
    assert f"total {count_parameters(model):>,}".split() == text.splitlines()[8].split()
    assert "computed at 12x20x20" in text and "blocks per stage [1, 2, 3]" in text
    assert "bf16: activations saved for backward" in text and "fp32:" in text
    assert "FLOPs" in text.splitlines()[-1]
    with pytest.raises(CtsegError, match="batch"):
        model_summary(RESENC, (8, 8, 8), batch=0)


def test_ctseg_model_summary_prints_an_experiments_model(capsys, tmp_path):
    from ctseg import cli

    shipped = str(Path(__file__).resolve().parents[1] / "config/experiments/exp001.yaml")
    assert cli.main(["model-summary", shipped, "--batch", "2", "--patch", "16,24,24"]) == 0
    out = capsys.readouterr().out
    assert "patch 16x24x24 (computed at 16x24x24), batch 2" in out
    assert out.count("encoder ") == out.count("decoder ") + 1 and "total" in out
    missing = tmp_path / "nope.yaml"
    assert cli.main(["model-summary", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert "nope.yaml" in err and "\n" not in err


# ----------------------------------------------------------------------------- instance_layout
def _norm_pair(channels: int = 6) -> tuple[torch.nn.Module, torch.nn.Module]:
    """nn.InstanceNorm3d and LayoutInstanceNorm3d with the same (non-default) affine weights."""
    torch.manual_seed(0)
    ref = torch.nn.InstanceNorm3d(channels, affine=True)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-1.0, 1.0)
    new = LayoutInstanceNorm3d(channels)
    new.load_state_dict(ref.state_dict())  # strict: the same names and shapes
    return ref, new


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
def test_layout_instance_norm_equals_instance_norm_forward_and_backward(dtype, tol, layout):
    ref, new = _norm_pair()
    x = (3 * seeded_input((2, 6, 5, 7, 9)) + 1).to(dtype).contiguous(memory_format=layout)
    grad = seeded_input((2, 6, 5, 7, 9), seed=1).to(dtype)
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_new = ref(x_ref), new(x_new)
    y_ref.backward(grad)
    y_new.backward(grad)
    assert y_new.dtype == y_ref.dtype == dtype
    torch.testing.assert_close(y_new, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x_new.grad, x_ref.grad, rtol=tol, atol=tol)
    for name in ("weight", "bias"):
        grads = getattr(new, name).grad, getattr(ref, name).grad
        torch.testing.assert_close(*grads, rtol=1e-4, atol=1e-4)


def test_layout_instance_norm_keeps_channels_last_where_instance_norm_does_not():
    ref, new = _norm_pair()
    x = seeded_input((2, 6, 5, 7, 9)).contiguous(memory_format=torch.channels_last_3d)
    assert new(x).is_contiguous(memory_format=torch.channels_last_3d)
    assert not ref(x).is_contiguous(memory_format=torch.channels_last_3d)  # what it fixes
    plain = seeded_input((2, 6, 5, 7, 9))
    assert new(plain).is_contiguous()


def test_norm_instance_layout_is_selectable_and_loads_instance_checkpoints():
    """model.norm: instance_layout builds the same parameters under the same names: weights of
    an `instance` model load into it (and back) and give the same outputs, and a whole
    channels_last network's output stays channels_last."""
    torch.manual_seed(0)
    cfg = {"filters": [4, 8, 16], "deep_supervision": False}
    plain = build_model({**cfg, "norm": "instance"}).eval()
    layout = build_model({**cfg, "norm": "instance_layout"}).eval()
    assert "instance_layout" in NORMS
    assert any(isinstance(m, LayoutInstanceNorm3d) for m in layout.modules())
    state = plain.state_dict()
    assert list(layout.state_dict()) == list(state)
    layout.load_state_dict(state)
    plain.load_state_dict(layout.state_dict())
    x = seeded_input((1, 1, 12, 16, 16))
    with torch.no_grad():
        torch.testing.assert_close(layout(x), plain(x), rtol=1e-4, atol=1e-5)
        last = layout.to(memory_format=torch.channels_last_3d)
        out = last(x.contiguous(memory_format=torch.channels_last_3d))
    assert out.is_contiguous(memory_format=torch.channels_last_3d)
