"""Weights trained in channels_last_3d are saved, digested and loaded like any others.

A 1x1x1 convolution's weight in channels_last_3d counts as contiguous while its last stride is
not 1, so `.contiguous()` returns it unchanged and `.view(torch.uint8)` refuses it: this ended
every phase-6 run. These tests pin the fix at each place that reads weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ctseg.inference.run import load_model
from ctseg.network.model import build_model, parameter_digest, portable_state_dict, tensor_bytes
from ctseg.training.checkpoint import save_checkpoint

CONFIG = {"filters": [4, 8], "deep_supervision": False}
PATCH = [16, 16, 16]
CHANNELS_LAST = torch.channels_last_3d


def test_a_one_by_one_conv_weight_in_channels_last_is_the_trap() -> None:
    weight = torch.nn.Conv3d(32, 1, 1).to(memory_format=CHANNELS_LAST).weight.detach()
    assert weight.is_contiguous() and weight.stride(-1) != 1
    with pytest.raises(RuntimeError):
        weight.contiguous().view(torch.uint8)
    assert tensor_bytes(weight) == weight.numpy().tobytes()


def trained_model(memory_format: torch.memory_format) -> torch.nn.Module:
    """The same weights every call, held in `memory_format`."""
    torch.manual_seed(0)
    model = build_model(CONFIG)
    with torch.no_grad():  # move the weights off their initial values
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    return model.to(memory_format=memory_format).eval()


def test_the_digest_does_not_depend_on_the_memory_format() -> None:
    plain, last = trained_model(torch.contiguous_format), trained_model(CHANNELS_LAST)
    # The output head is a 1x1x1 convolution: the trap is in this model.
    assert any(p.dim() == 5 and p.is_contiguous() and p.stride(-1) != 1 for p in last.parameters())
    assert parameter_digest(last) == parameter_digest(plain)


def test_the_portable_state_is_row_major_and_equal() -> None:
    last = trained_model(CHANNELS_LAST)
    state = portable_state_dict(last)
    for name, tensor in last.state_dict().items():
        plain = state[name]
        assert plain.device.type == "cpu" and torch.equal(plain, tensor.cpu())
        expected = torch.empty(plain.shape).stride()
        assert plain.stride() == expected, name


@pytest.mark.parametrize("load_as", [torch.contiguous_format, CHANNELS_LAST])
def test_weights_saved_from_channels_last_load_in_either_format(
    tmp_path: Path, load_as: torch.memory_format
) -> None:
    last = trained_model(CHANNELS_LAST)
    path = tmp_path / "last.pt"
    save_checkpoint(
        path, {"model": portable_state_dict(last), "model_config": CONFIG, "patch_size": PATCH}
    )
    x = torch.randn(1, 1, 16, 16, 16)
    with torch.no_grad():
        expected = last(x.contiguous(memory_format=CHANNELS_LAST))
    # Through ctseg.inference.run.load_model, as `ctseg infer` loads them.
    loaded, patch = load_model(path, "cpu")
    loaded = loaded.to(memory_format=load_as)
    with torch.no_grad():
        actual = loaded(x.contiguous(memory_format=load_as))
    assert patch == tuple(PATCH)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert parameter_digest(loaded) == parameter_digest(last)
