"""Counted FLOPs (ctseg.network.flops) against a hand count, against torch's own FLOP counter, and
exp001_full's figure the issue quotes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from ctseg.network.flops import NORM_FLOPS_PER_ELEMENT, Efficiency, count_flops
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
