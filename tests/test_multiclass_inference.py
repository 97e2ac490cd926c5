"""Multi-class inference: softmax probabilities per class, blended per channel on both paths,
the label map in the dataset's own values, `ctseg predict` of a multi-class run, ensembles of
multi-class stores; a binary model's store unchanged."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from torch import nn

from ctseg.cli import main as cli_main
from ctseg.inference.ensemble import ensemble_volume, tune_weights
from ctseg.inference.run import infer_volume, load_checkpoint, load_model
from ctseg.inference.settings import InferenceSettings
from ctseg.inference.tiled import working_bytes_per_voxel
from ctseg.inference.tiles import extent_voxels
from ctseg.io import CtsegError
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.network.model import build_model
from ctseg.postprocess.masks import PostprocessSettings
from ctseg.postprocess.write import write_mask
from ctseg.store import create_volume, open_volume
from ctseg.training.checkpoint import save_checkpoint

LOW, HIGH = 20.0, 220.0
# A dataset whose values are not the stored 0..K: the label map must come back in these.
SPEC = LabelSpec(labels={"background": 0, "sheet": 10, "fibre": 20, "pore": 30}, ignore=255)
CLASSES = ["background", "sheet", "fibre", "pore"]
MODEL = {"filters": [4, 8], "out_channels": 4}
PATCH = [16, 16, 16]
# float16 rounding: one unit in the last place at 0.5..1.
ULP = 2**-11


@pytest.fixture(autouse=True)
def _quiet_tifffile():
    logging.getLogger("tifffile").setLevel(logging.ERROR)


def image_store(path: Path, shape, chunks=(16, 16, 16), seed=0) -> Path:
    rng = np.random.default_rng(seed)
    zz = np.arange(shape[0])[:, None, None]
    volume = np.clip(rng.integers(0, 256, size=shape) * 0.5 + 100 * np.sin(zz / 5.0) + 60, 0, 255)
    arr = create_volume(path, shape, np.uint8, chunks, attributes={"p0_5": LOW, "p99_5": HIGH})
    arr[...] = volume.astype(np.uint8)
    return path


def multiclass_unet(seed=0, out_channels=4) -> nn.Module:
    """A random U-Net of `out_channels` whose logits are spread out and centred per channel, so
    every class wins somewhere."""
    torch.manual_seed(seed)
    model = build_model({**MODEL, "out_channels": out_channels}).eval()
    head = model.heads[0]
    with torch.no_grad():
        head.weight.mul_(8)
        head.bias.zero_()
        logits = model(torch.rand(1, 1, 16, 16, 16))
        head.bias.sub_(logits.flatten(2).median(dim=2).values[0])
    return model


def infer(tmp_path, store, name, model, labels=SPEC, **kw):
    kw.setdefault("window", (16, 16, 16))
    kw.setdefault("batch_size", 3)
    out = tmp_path / f"{name}.zarr"
    info = infer_volume(model, store, out, InferenceSettings(**kw), labels=labels)
    return info, open_volume(out)


@pytest.mark.parametrize(
    "shape,tta,budget",
    [
        ((36, 20, 22), False, 1.0),  # tiles along z
        ((36, 12, 18), True, 0.65),  # y smaller than the window; flip TTA batched across windows
    ],
)
def test_one_tile_equals_several_and_the_store_is_per_class(tmp_path, shape, tta, budget):
    store = image_store(tmp_path / "img.zarr", shape)
    model = multiclass_unet()
    common = {"memory_budget_mb": budget, "tta_flips": tta}
    tiled, p_t = infer(tmp_path, store, "s", model, device_budget_mb=0, **common)
    whole, p_w = infer(tmp_path, store, "r", model, device_budget_mb=64, **common)
    assert tiled["tiles"] > 1 and whole["tiles"] == 1
    assert tiled["classes"] == whole["classes"] == CLASSES
    assert tiled["shape"] == list(shape)  # the volume's shape; the store has the channels

    for arr in (p_t, p_w):
        assert arr.dtype == np.float16
        assert arr.shape == (4, *shape)
        assert arr.chunks == (1, 16, min(16, shape[1]), 16)
        assert arr.attrs["classes"] == CLASSES
        assert arr.attrs["value"] == "class probabilities (softmax)"
        assert arr.attrs["labels"] == SPEC.to_dict()
        assert arr.attrs["tta_flips"] is tta and arr.attrs["window"] == [16, 16, 16]
    probs = p_w[...].astype(np.float32)
    np.testing.assert_array_equal(p_t[...], p_w[...])  # the exact sums: any tiling, same bits
    # Softmax per window, blended with the same weights per channel: the channels sum to 1,
    # up to the float16 rounding of each of the 4 channels.
    np.testing.assert_allclose(probs.sum(axis=0), 1.0, atol=4 * ULP, rtol=0)
    assert probs.min() >= 0 and probs.max() <= 1

    # The mask: the argmax in the dataset's own values.
    info = write_mask(tmp_path / "r.zarr", tmp_path / "r.tif", PostprocessSettings())
    mask = tifffile.imread(tmp_path / "r.tif")
    assert info["classes"] == CLASSES and info["values"] == [0, 10, 20, 30]
    assert sum(info["class_voxels"].values()) == math.prod(shape)
    assert info["foreground_voxels"] == int(np.count_nonzero(mask))
    assert mask.dtype == np.uint8 and mask.shape == shape
    assert set(np.unique(mask).tolist()) == {0, 10, 20, 30}  # every class wins somewhere
    expected = np.array([0, 10, 20, 30], np.uint8)[np.argmax(p_w[...], axis=0)]
    np.testing.assert_array_equal(mask, expected)


def test_the_budgets_count_every_channel(tmp_path):
    shape, window = (40, 24, 24), (16, 16, 16)
    one = extent_voxels(shape, window, shape) * working_bytes_per_voxel(1, 1)
    four = extent_voxels(shape, window, shape) * working_bytes_per_voxel(1, 4)
    # The int64 sums on the device and the seams' on the host, per channel.
    assert four - one == 3 * 16 * math.prod(shape)
    store = image_store(tmp_path / "img.zarr", shape)
    model = multiclass_unet()
    # Room for one channel's whole volume, not for four's: the multi-class model is tiled.
    small = {"device_budget_mb": one / 2**20, "memory_budget_mb": 1.4, "window": window}
    binary, _ = infer(tmp_path, store, "b", nn.Conv3d(1, 1, 1), labels=None, **small)
    multi, _ = infer(tmp_path, store, "m", model, **small)
    assert binary["tiles"] == 1 and multi["tiles"] > 1


def test_a_binary_model_writes_the_one_channel_store(tmp_path):
    store = image_store(tmp_path / "img.zarr", (20, 18, 16))
    torch.manual_seed(0)
    model = build_model({"filters": [4, 8]}).eval()
    for name, labels in (("none", None), ("kaggle", KAGGLE)):
        for budget in (0, 64):
            infer(tmp_path, store, f"{name}{budget}", model, labels=labels, device_budget_mb=budget)
    reference = open_volume(tmp_path / "none64.zarr")
    assert reference.shape == (20, 18, 16) and "classes" not in reference.attrs
    assert reference.attrs["value"] == "foreground probability (sigmoid)"
    for name in ("none0", "kaggle0", "kaggle64"):
        other = open_volume(tmp_path / f"{name}.zarr")
        assert dict(other.attrs) == dict(reference.attrs)
        np.testing.assert_allclose(
            other[...].astype(np.float32), reference[...].astype(np.float32), atol=ULP, rtol=0
        )
    info = write_mask(tmp_path / "kaggle64.zarr", tmp_path / "m.tif", PostprocessSettings())
    assert "classes" not in info
    assert set(np.unique(tifffile.imread(tmp_path / "m.tif")).tolist()) <= {0, 1}


def test_model_and_labels_that_disagree_are_one_line(tmp_path):
    store = image_store(tmp_path / "img.zarr", (16, 16, 16))
    kw = {"window": (8, 8, 8), "device_budget_mb": 64}
    # A four-channel model without its labels; a binary model with a multi-class spec.
    with pytest.raises(CtsegError, match="expected one channel.*multi-class model"):
        infer(tmp_path, store, "a", multiclass_unet(), labels=None, **kw)
    with pytest.raises(CtsegError, match=r"expected 4 channels \(background and each class"):
        infer(tmp_path, store, "b", nn.Conv3d(1, 1, 1), **kw)
    assert not (tmp_path / "a.zarr").exists() and not (tmp_path / "b.zarr").exists()


def save_run(run_dir: Path, labels: LabelSpec | None, seed=0, out_channels=4) -> Path:
    model = multiclass_unet(seed, out_channels)
    state = {
        "model": model.state_dict(),
        "model_config": {**MODEL, "out_channels": out_channels},
        "patch_size": PATCH,
        "fingerprint": "0123456789abcdef",
        "step": 1,
    }
    if labels is not None:
        state["labels"] = labels.to_dict()
    save_checkpoint(run_dir / "last.pt", state)
    return run_dir / "last.pt"


def test_the_checkpoint_gives_the_labels_and_its_head_must_match_them(tmp_path):
    weights = save_run(tmp_path / "mc", SPEC)
    loaded = load_checkpoint(weights, "cpu")
    assert loaded.labels == SPEC and loaded.patch == (16, 16, 16)
    assert loaded.model.heads[0].out_channels == 4
    assert load_model(weights, "cpu")[1] == (16, 16, 16)
    # Without labels: the Kaggle spec, which a binary head matches and a 4-channel one does not.
    binary = save_run(tmp_path / "bin", None, out_channels=1)
    assert load_checkpoint(binary, "cpu").labels == KAGGLE
    for run, labels, channels in (("nolabels", None, 4), ("three", SPEC, 3)):
        bad = save_run(tmp_path / run, labels, out_channels=channels)
        with pytest.raises(CtsegError) as err:
            load_checkpoint(bad, "cpu")
        message = str(err.value)
        assert message.startswith(f"{bad}: the model has {channels} output channel(s)")
        assert "\n" not in message


def test_predict_writes_label_maps_in_the_datasets_values(tmp_path, capsys):
    save_run(tmp_path / "results" / "mc", SPEC)
    (tmp_path / "exps").mkdir()
    (tmp_path / "ens").mkdir()
    rng = np.random.default_rng(3)
    zz = np.arange(20)[:, None, None]
    data = np.clip(rng.integers(0, 256, (20, 24, 28)) * 0.5 + 90 * np.sin(zz / 4) + 60, 0, 255)
    (tmp_path / "in").mkdir()
    tifffile.imwrite(tmp_path / "in" / "vol.tif", data.astype(np.uint8), photometric="minisblack")

    def predict(out: str, *extra: str) -> int:
        return cli_main([
            "predict", "--run", str(tmp_path / "results" / "mc"), "-i", str(tmp_path / "in"),
            "-o", str(tmp_path / out), "--experiments-dir", str(tmp_path / "exps"),
            "--ensembles-dir", str(tmp_path / "ens"), "--device", "cpu", *extra,
        ])  # fmt: skip

    capsys.readouterr()
    assert predict("masks", "--probabilities", str(tmp_path / "p")) == 0
    log = capsys.readouterr().err
    assert "label maps (argmax of 4 class probabilities: background 0, sheet 10" in log
    mask = tifffile.imread(tmp_path / "masks" / "vol.tif")
    probs = open_volume(tmp_path / "p" / "vol.zarr")
    assert probs.shape == (4, 20, 24, 28) and probs.attrs["classes"] == CLASSES
    assert mask.dtype == np.uint8 and mask.shape == (20, 24, 28)
    np.testing.assert_array_equal(mask, SPEC.from_stored(np.argmax(probs[...], axis=0)))
    assert len(np.unique(mask)) >= 3
    row = json.loads((tmp_path / "masks" / "predict.json").read_text())["volumes"]["vol"]
    assert row["classes"] == CLASSES and row["values"] == [0, 10, 20, 30]
    assert row["shape"] == [20, 24, 28]
    assert row["class_voxels"]["pore"] == int(np.count_nonzero(mask == SPEC.labels["pore"]))

    # Binary post-processing options do not apply to a label map: refused before any work.
    assert predict("masks2", "--threshold", "0.3") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "multi-class probabilities" in err[0] and "t>0.3" in err[0]
    assert not (tmp_path / "masks2" / "vol.tif").exists()


def test_write_mask_refuses_binary_settings_for_a_label_map(tmp_path):
    store = image_store(tmp_path / "img.zarr", (12, 12, 12))
    infer(tmp_path, store, "p", multiclass_unet(), window=(8, 8, 8))
    for settings in (PostprocessSettings(threshold=0.4), PostprocessSettings(fill_holes=True)):
        with pytest.raises(
            CtsegError, match=r"p\.zarr: multi-class probabilities.*label map.*per-class"
        ):
            write_mask(tmp_path / "p.zarr", tmp_path / "m.tif", settings)
    assert not (tmp_path / "m.tif").exists()


def test_ensembles_average_each_channel_of_members_of_the_same_classes(tmp_path):
    store = image_store(tmp_path / "img.zarr", (20, 12, 14))
    kw = {"window": (8, 8, 8)}
    _, a = infer(tmp_path, store, "a", multiclass_unet(seed=0), **kw)
    _, b = infer(tmp_path, store, "b", multiclass_unet(seed=1), **kw)
    info = ensemble_volume(
        [tmp_path / "a.zarr", tmp_path / "b.zarr"], [3, 1], tmp_path / "e.zarr",
        memory_budget_mb=12 * 4 * 12 * 14 * 5 / 2**20,
    )  # fmt: skip
    assert info["slab_depth"] == 5 and info["slabs"] == 4
    mean = open_volume(tmp_path / "e.zarr")
    assert mean.shape == (4, 20, 12, 14) and mean.attrs["classes"] == CLASSES
    assert mean.attrs["labels"] == SPEC.to_dict()
    expected = 0.75 * a[...].astype(np.float32) + 0.25 * b[...].astype(np.float32)
    np.testing.assert_allclose(mean[...].astype(np.float32), expected, atol=ULP, rtol=0)
    write_mask(tmp_path / "e.zarr", tmp_path / "e.tif", PostprocessSettings())
    assert set(np.unique(tifffile.imread(tmp_path / "e.tif")).tolist()) <= {0, 10, 20, 30}

    # Other classes, or a binary member: one line naming both files.
    other = LabelSpec(labels={"background": 0, "sheet": 1, "fibre": 2, "crack": 3})
    infer(tmp_path, store, "c", multiclass_unet(seed=2), labels=other, **kw)
    infer(tmp_path, store, "d", nn.Conv3d(1, 1, 1), labels=None, **kw)
    for member, problem in (("c.zarr", "classes"), ("d.zarr", "classes none")):
        with pytest.raises(CtsegError) as err:
            ensemble_volume([tmp_path / "a.zarr", tmp_path / member], [1, 1], tmp_path / "x.zarr")
        message = str(err.value)
        assert f"a.zarr has {problem.split()[0]}" in message and member in message
        assert problem in message and "\n" not in message
    assert not (tmp_path / "x.zarr").exists()
    # The weights are tuned by the binary competition score only.
    for name in "ab":
        (tmp_path / name).mkdir()
        (tmp_path / f"{name}.zarr").rename(tmp_path / name / "v.zarr")
    with pytest.raises(CtsegError, match="member 'a'.*classes.*give the ensemble fixed weights"):
        tune_weights(
            [("a", [tmp_path / "a" / "v.zarr"]), ("b", [tmp_path / "b" / "v.zarr"])],
            [tmp_path / "e.tif"], tmp_path / "w.json",
        )  # fmt: skip
