"""`infer_volume`: the whole volume as one tile on the device against several tiles, the
device budget's choice between them, full batches, and the device's normalisation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from torch import nn

from ctseg.cli import main as cli_main
from ctseg.inference.blend import device_input, normalise
from ctseg.inference.run import infer_volume
from ctseg.inference.settings import InferenceSettings
from ctseg.inference.tiled import working_bytes_per_voxel
from ctseg.inference.tiles import extent_voxels
from ctseg.inference.windows import device_importance_map, gaussian_importance_map
from ctseg.io import CtsegError
from ctseg.network.model import build_model
from ctseg.postprocess.masks import PostprocessSettings
from ctseg.postprocess.write import write_mask
from ctseg.store import create_volume, open_volume
from ctseg.training.checkpoint import save_checkpoint

LOW, HIGH = 20.0, 220.0
# Tiles of one 16^3 chunk with a 16^3 window: at most 32^3 voxels of 21 bytes, 0.66 MB.
TILES_MB = 0.7


def image_store(path: Path, shape, chunks=(16, 16, 16), seed=0) -> Path:
    rng = np.random.default_rng(seed)
    zz = np.arange(shape[0])[:, None, None]
    volume = np.clip(rng.integers(0, 256, size=shape) * 0.5 + 100 * np.sin(zz / 5.0) + 60, 0, 255)
    attributes = {"p0_5": LOW, "p99_5": HIGH}
    arr = create_volume(path, shape, np.uint8, chunks, attributes=attributes)
    arr[...] = volume.astype(np.uint8)
    return path


def decisive_unet(seed=0) -> nn.Module:
    """A random U-Net whose logits are spread out (so the mask is not a coin toss at 0.5)."""
    torch.manual_seed(seed)
    model = build_model({"filters": [4, 8]}).eval()
    head = model.heads[0]
    with torch.no_grad():
        head.weight.mul_(8)
        head.bias.zero_()
        # Centre the logits on an input like the test volumes: about half the mask is 1.
        head.bias.sub_(model(torch.rand(1, 1, 16, 16, 16)).median())
    return model


class Recorder(nn.Module):
    """Records the batch size of every forward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.batches: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(x.shape[0])
        return self.inner(x)


def run(tmp_path, store, name, model, **kw):
    kw.setdefault("window", (16, 16, 16))
    kw.setdefault("batch_size", 3)
    info = infer_volume(model, store, tmp_path / f"{name}.zarr", InferenceSettings(**kw))
    prob = open_volume(tmp_path / f"{name}.zarr")
    assert prob.dtype == np.float16
    mask = tmp_path / f"{name}.tif"
    write_mask(tmp_path / f"{name}.zarr", mask, PostprocessSettings(threshold=0.5))
    return info, prob[...].astype(np.float32), tifffile.imread(mask)


@pytest.mark.parametrize(
    "shape,tta,budget",
    [
        ((44, 30, 34), False, TILES_MB),  # tiles along every axis
        ((40, 12, 20), False, 0.25),  # y smaller than the window: padded in every tile
        ((36, 18, 16), True, 0.2),  # flip TTA, with flips batched across windows
    ],
)
def test_one_tile_equals_several_bit_for_bit(tmp_path, shape, tta, budget):
    store = image_store(tmp_path / "img.zarr", shape)
    model = decisive_unet()
    tiled, p_t, m_t = run(
        tmp_path, store, "t", model, memory_budget_mb=budget, device_budget_mb=0, tta_flips=tta
    )
    whole, p_w, m_w = run(
        tmp_path, store, "w", model, memory_budget_mb=budget, device_budget_mb=64, tta_flips=tta
    )
    assert whole["tiles"] == 1 and tiled["tiles"] > 1
    assert whole["tile_budget_mb"] == 64 and tiled["tile_budget_mb"] == budget
    # The exact sums: any tiling gives the same bits.
    np.testing.assert_array_equal(p_w, p_t)
    assert 0.05 < m_w.mean() < 0.95  # the mask comparison is not trivial
    np.testing.assert_array_equal(m_w, m_t)


def test_the_device_budget_decides_one_tile_or_several(tmp_path):
    shape, window, batch = (40, 24, 24), (16, 16, 16), 3
    store = image_store(tmp_path / "img.zarr", shape)
    needed = extent_voxels(shape, window, shape) * working_bytes_per_voxel(1, 1)
    model = nn.Conv3d(1, 1, 1)
    kw = {"window": window, "batch_size": batch, "memory_budget_mb": 0.45}  # 2 tiles
    fits = infer_volume(
        model, store, tmp_path / "a.zarr", InferenceSettings(device_budget_mb=needed / 2**20, **kw)
    )
    over = infer_volume(
        model, store, tmp_path / "b.zarr",
        InferenceSettings(device_budget_mb=(needed - 1) / 2**20, **kw),
    )  # fmt: skip
    never = infer_volume(
        model, store, tmp_path / "c.zarr", InferenceSettings(device_budget_mb=0, **kw)
    )
    # No device budget given: the shipped one (config.yaml's infer.device_budget_mb, the same
    # default), whatever the host budget.
    default = infer_volume(model, store, tmp_path / "d.zarr", InferenceSettings(**kw))
    assert InferenceSettings().device_budget_mb * 2**20 > needed
    assert fits["tiles"] == default["tiles"] == 1
    assert over["tiles"] == never["tiles"] > 1
    reference = open_volume(tmp_path / "a.zarr")[...]
    for name in "bcd":
        np.testing.assert_array_equal(open_volume(tmp_path / f"{name}.zarr")[...], reference)


def test_flips_and_windows_share_full_batches(tmp_path):
    shape, batch = (20, 18, 16), 5
    store = image_store(tmp_path / "img.zarr", shape)
    recorder = Recorder(nn.Conv3d(1, 1, 1))
    info, _, _ = run(
        tmp_path, store, "t", recorder, window=(12, 12, 12), batch_size=batch,
        tta_flips=True, device_budget_mb=64,
    )  # fmt: skip
    items = info["windows"] * 8
    assert info["tiles"] == 1 and info["forward_windows"] == items
    # Every forward is a full batch (the last one padded: one batch shape, the same bits for a
    # window whatever shares its batch), ceil(items / batch) of them, not 8 * ceil(windows / batch).
    assert items % batch and recorder.batches == [batch] * math.ceil(items / batch)


def test_the_model_is_given_back_as_it_came(tmp_path):
    store = image_store(tmp_path / "img.zarr", (30, 20, 26))
    model = decisive_unet(seed=2).to(memory_format=torch.channels_last_3d)
    model.train()
    settings = InferenceSettings(window=(16, 16, 16), batch_size=2, channels_last=False)
    infer_volume(model, store, tmp_path / "p.zarr", settings)
    assert model.training  # the training flag is restored
    assert model.heads[0].weight.is_contiguous(memory_format=torch.channels_last_3d)


def test_errors_leave_no_output(tmp_path):
    store = image_store(tmp_path / "img.zarr", (16, 16, 16))
    with pytest.raises(CtsegError, match="expected one channel"):
        infer_volume(
            nn.Conv3d(1, 2, 1), store, tmp_path / "p.zarr",
            InferenceSettings(window=(8, 8, 8), device_budget_mb=64),
        )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img.zarr"]  # no store, no scratch
    with pytest.raises(CtsegError, match="device_budget_mb"):
        infer_volume(
            nn.Conv3d(1, 1, 1), store, tmp_path / "p.zarr",
            InferenceSettings(window=(8, 8, 8), device_budget_mb=-1),
        )  # fmt: skip


def test_cli_passes_the_device_budget(tmp_path, capsys):
    store = image_store(tmp_path / "img.zarr", (40, 20, 20))
    model = decisive_unet()
    weights = tmp_path / "last.pt"
    save_checkpoint(
        weights,
        {"model": model.state_dict(), "model_config": {"filters": [4, 8]},
         "patch_size": [16, 16, 16]},
    )  # fmt: skip
    tiles = []
    for budget in ("0", "64"):
        assert cli_main([
            "infer", str(weights), str(store), "--mask", str(tmp_path / f"m{budget}.tif"),
            "--probabilities", str(tmp_path / f"p{budget}.zarr"), "--memory-budget-mb", "0.3",
            "--device-budget-mb", budget, "--device", "cpu",
        ]) == 0  # fmt: skip
        tiles.append(json.loads(capsys.readouterr().out)["inference"]["tiles"])
    assert tiles[0] > 1 and tiles[1] == 1


def test_device_importance_map_is_built_once_and_equals_the_host_map():
    cpu = torch.device("cpu")
    first = device_importance_map((6, 8, 10), cpu)
    assert device_importance_map((6, 8, 10), cpu) is first  # cached per window and device
    np.testing.assert_array_equal(first.numpy(), gaussian_importance_map((6, 8, 10)))
    assert not first.is_inference()  # usable outside inference mode


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int16, np.float32, np.float64])
@pytest.mark.parametrize("low,high", [(LOW, HIGH), (-3.25, 1000.5), (7.0, 7.0)])
def test_device_normalisation_equals_the_host_normalisation(tmp_path, dtype, low, high):
    """A tile's raw voxels are copied to the device and normalised there; training and the
    benchmarks' baselines normalise on the host. Both must give the same input, bit for bit (a
    degenerate span too), and the padding is zeros."""
    rng = np.random.default_rng(3)
    shape, padded = (10, 9, 7), (12, 16, 7)
    values = rng.uniform(-50, 1200, size=shape)
    if dtype == np.uint8:
        values = rng.integers(0, 256, shape)
    if np.issubdtype(dtype, np.unsignedinteger):
        values = np.abs(values)
    arr = create_volume(tmp_path / "v.zarr", shape, dtype, (4, 9, 7), attributes={})
    arr[...] = values.astype(dtype)
    host = np.zeros(padded, np.float32)
    host[:10, :9, :7] = normalise(np.asarray(arr[...]), low, high)
    device = device_input(np.asarray(arr[...]), low, high, padded, torch.device("cpu")).numpy()
    assert device.dtype == np.float32 and device.shape == padded
    assert 0 < np.count_nonzero(host) < host.size
    np.testing.assert_array_equal(device, host)
