"""Counted FLOPs (ctseg.network.flops) against a hand count, against torch's own FLOP counter, and
exp001_full's figure the issue quotes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from ctseg.config import load_experiment
from ctseg.network.flops import NORM_FLOPS_PER_ELEMENT, Efficiency, count_flops, padding_warning
from ctseg.network.model import build_model
from ctseg.network.peaks import Peak

REPO = Path(__file__).resolve().parents[1]


def test_two_level_unet_matches_a_hand_count():
    # filters (2, 4), one input and output channel, 4^3 patch (a multiple of 2: no padding),
    # instance norm (affine, no conv bias), LeakyReLU, one head (no deep supervision).
    cfg = {"filters": [2, 4], "deep_supervision": False}
    norm, k3 = NORM_FLOPS_PER_ELEMENT, 27
    full, half = 4**3, 2**3  # voxels at level 0 and level 1
    enc0 = (2 * 1 * k3 * 2 * full) + (2 * 2 * k3 * 2 * full)  # conv 1->2, conv 2->2
    enc0_norm_act = 2 * (2 * full * norm + 2 * full)
    enc1 = (2 * 2 * k3 * 4 * half) + (2 * 4 * k3 * 4 * half)  # stride-2 conv 2->4, conv 4->4
    enc1_norm_act = 2 * (4 * half * norm + 4 * half)
    up = 2 * 4 * 2 * 8 * half + 2 * full  # transposed 4->2, kernel 2^3, per input voxel; bias
    dec = (2 * 4 * k3 * 2 * full) + (2 * 2 * k3 * 2 * full)  # conv (2+2)->2, conv 2->2
    dec_norm_act = 2 * (2 * full * norm + 2 * full)
    head = 2 * 2 * 1 * full + full  # 1x1x1 conv 2->1 with bias
    hand = enc0 + enc0_norm_act + enc1 + enc1_norm_act + up + dec + dec_norm_act + head
    count = count_flops(cfg, (4, 4, 4))
    assert count.forward == hand
    assert count.by_kind["conv_transpose"] == up and count.by_kind["head"] == head
    assert count.backward == 2 * hand and count.train == 3 * hand


def test_convolutions_agree_with_torch_flop_counter():
    """torch's counter counts the convolutions' multiply-adds (no bias, no norms): ours, less
    those, must equal it, deep-supervision heads and padding (20 -> 24) included."""
    cfg = {"filters": [4, 8, 16, 32], "deep_supervision": True}
    patch = (20, 24, 24)
    count = count_flops(cfg, patch)
    with torch.device("meta"):
        model = build_model(cfg).train()
    biases = []  # one add per output element of each layer with a bias
    for module in model.modules():
        if (
            isinstance(module, torch.nn.Conv3d | torch.nn.ConvTranspose3d)
            and module.bias is not None
        ):
            module.register_forward_hook(lambda m, args, out: biases.append(out.numel()))
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, 1, *patch, device="meta"))
    assert biases  # the heads and the transposed convolutions have one
    convs = sum(count.by_kind[k] for k in ("conv", "conv_transpose", "head"))
    assert convs - sum(biases) == counter.get_total_flops()


def test_residual_blocks_are_counted_too():
    plain = count_flops({"filters": [4, 8], "block": "basic"}, (8, 8, 8))
    residual = count_flops({"filters": [4, 8], "block": "residual"}, (8, 8, 8))
    # The residual encoder adds 1x1x1 projection convs (1->4 at level 0, 4->8 at level 1,
    # 16->8 ... in the decoder) and their norms: strictly more FLOPs.
    assert residual.forward > plain.forward


def test_exp001_full_is_about_2_25_tflop_per_sample():
    exp = yaml.safe_load((REPO / "config/experiments/exp001_full.yaml").read_text())
    count = count_flops(exp["model"], exp["data"]["patch_size"])
    assert count.train / 1e12 == pytest.approx(2.25, rel=0.10)


def test_efficiency_columns_are_tflops_and_the_fraction_of_the_peak():
    count = count_flops({"filters": [2, 4]}, (4, 4, 4))
    peak = Peak(2.0, "bf16", "table", "test card", "test")
    eff = Efficiency(count, peak)
    cols = eff.columns(1e9)
    assert cols["tflops"] == pytest.approx(count.train * 1e9 / 1e12)
    assert cols["mfu"] == pytest.approx(cols["tflops"] / 2.0)
    assert cols["useful_mfu"] == cols["mfu"]  # 4^3 with two levels: nothing padded


# Every shipped experiment: its patch, the size its network computes it at, the padding share.
SHIPPED = {
    "exp001": ((32, 48, 48), (32, 48, 48)),
    "exp001_cv": ((32, 48, 48), (32, 48, 48)),
    "exp001_full": ((72, 136, 136), (80, 144, 144)),
    "exp001_full_unpadded": ((80, 144, 144), (80, 144, 144)),
    "mc001": ((32, 48, 48), (32, 48, 48)),
    "resenc_24gb": ((80, 144, 144), (80, 144, 144)),
    "resenc_80gb": ((80, 144, 144), (80, 144, 144)),
}


def test_every_shipped_experiment_is_listed_here():
    assert sorted(p.stem for p in (REPO / "config/experiments").glob("*.yaml")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_patches_padding_share_and_warning(name):
    """Only exp001_full (the starting point's own setup) pads: 72x136x136 runs at 80x144x144,
    19.7% of its FLOPs padding, and its warning names 80x144x144; every other shipped patch is
    planned for its network."""
    exp = load_experiment(REPO / "config/experiments" / f"{name}.yaml")
    patch, computed = SHIPPED[name]
    assert tuple(exp["data"]["patch_size"]) == patch
    count = count_flops(exp["model"], patch)
    assert count.computed_patch == computed
    warning = padding_warning(exp["model"], patch)
    if patch == computed:
        assert count.padding_share == 0 and warning is None
        assert count.useful_train == count.train
    else:
        assert count.padding_share == pytest.approx(1 - (72 * 136 * 136) / (80 * 144 * 144))
        assert round(100 * count.padding_share, 1) == 19.7
        assert count.useful_train == pytest.approx(count.train * (1 - count.padding_share))
        assert "computed at 80x144x144" in warning and "19.7%" in warning
        assert warning.endswith("80x144x144 costs the same with none")


def test_the_unpadded_patch_costs_what_the_padded_one_computes():
    exp = load_experiment(REPO / "config/experiments/exp001_full.yaml")
    padded = count_flops(exp["model"], (72, 136, 136))
    unpadded = count_flops(exp["model"], (80, 144, 144))
    assert unpadded.train == padded.train and unpadded.useful_train > padded.useful_train
    record = padded.to_dict()
    assert record["computed_patch"] == [80, 144, 144] and record["patch"] == [72, 136, 136]
    assert record["padding_share"] == pytest.approx(padded.padding_share)


def test_mfu_is_divided_by_every_device_once_and_useful_mfu_leaves_out_padding():
    count = count_flops({"filters": [2, 4, 8]}, (6, 8, 8))  # computed at 8x8x8
    assert count.computed_patch == (8, 8, 8) and count.padding_share == pytest.approx(0.25)
    peak = Peak(2.0, "bf16", "table", "test card", "test")
    one, four = Efficiency(count, peak), Efficiency(count, peak, devices=4)
    assert four.mfu(1e9) == pytest.approx(one.mfu(1e9) / 4)
    assert four.columns(1e9)["mfu"] == pytest.approx(four.tflops(1e9) / 8.0)
    assert four.useful_mfu(1e9) == pytest.approx(0.75 * four.mfu(1e9))
    assert four.columns(1e9)["useful_mfu"] == pytest.approx(four.useful_mfu(1e9))


def test_layout_instance_norm_counts_as_instance_norm():
    plain = count_flops({"filters": [4, 8], "norm": "instance"}, (8, 8, 8))
    layout = count_flops({"filters": [4, 8], "norm": "instance_layout"}, (8, 8, 8))
    assert layout.by_kind == plain.by_kind and layout.by_kind["norm"] > 0
