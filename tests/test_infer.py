"""Sliding-window inference: geometry, blending, streaming, TTA, postprocessing, weights, errors."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
import zarr
from torch import nn

from ctseg.inference.run import infer_records, infer_volume, load_model
from ctseg.inference.settings import InferenceSettings
from ctseg.inference.tiled import working_bytes_per_voxel
from ctseg.inference.tiles import extent_voxels
from ctseg.inference.windows import gaussian_1d, gaussian_importance_map, window_starts
from ctseg.io import CtsegError
from ctseg.network.model import build_model
from ctseg.postprocess.masks import PostprocessSettings
from ctseg.postprocess.write import write_mask
from ctseg.store import create_volume, open_volume
from ctseg.training.checkpoint import save_checkpoint

LOW, HIGH = 20.0, 220.0
TINY = {"filters": [4, 8]}


def image_store(path: Path, volume: np.ndarray, chunks=(16, 16, 16), **attrs) -> Path:
    attributes = {"p0_5": LOW, "p99_5": HIGH, **attrs}
    create_volume(path, volume.shape, volume.dtype, chunks, attributes=attributes)[...] = volume
    return path


def random_volume(shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Smooth-ish structure plus noise so the U-Net's output varies across windows.
    base = rng.integers(0, 256, size=shape).astype(np.float32)
    zz = np.arange(shape[0])[:, None, None]
    return np.clip(base * 0.5 + 100 * np.sin(zz / 5.0) + 60, 0, 255).astype(np.uint8)


def tiny_unet(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(TINY).eval()


def reference_blend(model, volume, window, overlap) -> np.ndarray:
    """Whole-volume Gaussian blending, one window at a time, weights accumulated explicitly."""
    x = np.clip((volume.astype(np.float64) - LOW) / (HIGH - LOW), 0, 1).astype(np.float32)
    padded = np.zeros([max(s, w) for s, w in zip(x.shape, window, strict=True)], np.float32)
    padded[: x.shape[0], : x.shape[1], : x.shape[2]] = x
    g = gaussian_importance_map(window).astype(np.float64)
    acc = np.zeros(volume.shape)
    wsum = np.zeros(volume.shape)
    starts = [window_starts(s, w, overlap) for s, w in zip(x.shape, window, strict=True)]
    for z in starts[0]:
        for y in starts[1]:
            for xx in starts[2]:
                crop = padded[z : z + window[0], y : y + window[1], xx : xx + window[2]]
                with torch.no_grad():
                    logits = model(torch.from_numpy(np.ascontiguousarray(crop))[None, None])
                p = torch.sigmoid(logits)[0, 0].double().numpy()
                box = tuple(
                    slice(o, min(o + w, s))
                    for o, w, s in zip((z, y, xx), window, x.shape, strict=True)
                )
                local = tuple(slice(0, b.stop - b.start) for b in box)
                acc[box] += (p * g)[local]
                wsum[box] += g[local]
    return acc / wsum


# ----------------------------------------------------------------------------- geometry
def test_gaussian_importance_map_shape_sigma_and_normalisation():
    window = (8, 12, 16)
    g = gaussian_importance_map(window)
    assert g.shape == window and g.dtype == np.float32
    assert g.max() == pytest.approx(1.0) and g.min() > 0
    # Centred and symmetric: the maximum is at the middle and flips leave it unchanged.
    for axis in range(3):
        np.testing.assert_allclose(g, np.flip(g, axis), rtol=1e-6)
    # Separable with sigma = window / 8 along each axis: recover sigma from a 1D profile.
    for axis, w in enumerate(window):
        profile = g.max(axis=tuple(a for a in range(3) if a != axis)).astype(np.float64)
        d2 = (np.arange(w) - (w - 1) / 2) ** 2
        # The peak of an even window lies between two voxels: compare against the nearest ones.
        off = d2 > d2.min()
        sigma = np.sqrt(-(d2[off] - d2.min()) / (2 * np.log(profile[off])))
        np.testing.assert_allclose(sigma, w / 8, rtol=1e-5)
    outer = np.einsum("i,j,k->ijk", *(gaussian_1d(w) for w in window))
    np.testing.assert_allclose(g, outer, rtol=1e-6)


@pytest.mark.parametrize(
    "size,window,overlap",
    [(40, 16, 0.5), (41, 16, 0.5), (100, 32, 0.25), (17, 16, 0.0), (16, 16, 0.5), (10, 16, 0.5),
     (37, 12, 0.75)],
)  # fmt: skip
def test_window_starts_cover_with_requested_overlap(size, window, overlap):
    starts = window_starts(size, window, overlap)
    if size <= window:
        assert starts == [0]  # padded: one window
        return
    assert starts[0] == 0 and starts[-1] + window == size
    gaps = np.diff(starts)
    assert (gaps >= 1).all()
    # Never less overlap than asked (up to rounding a fractional step to whole voxels).
    assert (gaps <= math.ceil(window * (1 - overlap))).all()
    assert (window - gaps >= math.floor(window * overlap)).all()
    covered = np.zeros(size, int)
    for s in starts:
        covered[s : s + window] += 1
    assert (covered >= 1).all()


def test_window_grid_covers_a_non_divisible_volume():
    shape, window = (41, 9, 30), (16, 16, 12)
    count = np.zeros(shape, int)
    starts = [window_starts(s, w, 0.5) for s, w in zip(shape, window, strict=True)]
    for z in starts[0]:
        for y in starts[1]:
            for x in starts[2]:
                count[z : z + 16, y : y + 16, x : x + 12] += 1
    assert count.min() >= 1
    assert starts[1] == [0]  # 9 < 16: padded


# ----------------------------------------------------------------------------- tiles
@pytest.mark.parametrize(
    "shape,chunks,window,budget_mb",
    [
        ((36, 28, 32), (16, 16, 16), (16, 16, 16), 0.62),  # tiles along z
        ((40, 12, 20), (16, 12, 20), (16, 16, 16), 0.22),  # y smaller than the window
        ((10, 40, 40), (16, 16, 16), (16, 16, 16), 0.4),  # z smaller than the window
    ],
)
def test_tiles_equal_the_whole_volume_reference(tmp_path, shape, chunks, window, budget_mb):
    volume = random_volume(shape)
    store = image_store(tmp_path / "img.zarr", volume, chunks)
    model = tiny_unet()
    info = infer_volume(
        model,
        store,
        tmp_path / "prob.zarr",
        # device_budget_mb=0: tiles under the memory budget, whatever the volume's size
        InferenceSettings(
            window=window, overlap=0.5, batch_size=3, memory_budget_mb=budget_mb, device_budget_mb=0
        ),
    )
    prob = open_volume(tmp_path / "prob.zarr")
    assert prob.dtype == np.float16 and prob.shape == shape
    assert prob.chunks == tuple(min(c, s) for c, s in zip(chunks, shape, strict=True))
    expected = reference_blend(model, volume, window, 0.5)
    np.testing.assert_allclose(prob[...].astype(np.float64), expected, atol=1e-3, rtol=0)
    assert info["tiles"] > 1


def test_a_tile_fits_the_budget_whatever_the_volume(tmp_path):
    shape = (640, 32, 32)
    volume = random_volume(shape, seed=1)
    store = image_store(tmp_path / "img.zarr", volume, (16, 16, 16))
    model = nn.Conv3d(1, 1, 1)
    settings = InferenceSettings(window=(16, 16, 16), batch_size=8, memory_budget_mb=0.8,
                                 device_budget_mb=0)  # fmt: skip
    info = infer_volume(model, store, tmp_path / "p.zarr", settings)
    working = extent_voxels(tuple(info["tile"]), (16, 16, 16), shape) * working_bytes_per_voxel(
        1, 1
    )
    whole = extent_voxels(shape, (16, 16, 16), shape) * working_bytes_per_voxel(1, 1)
    assert info["tiles"] >= 20 and working <= 0.8 * 2**20 < whole / 16
    # The same bits as the whole volume held at once.
    infer_volume(
        model, store, tmp_path / "w.zarr", dataclasses.replace(settings, device_budget_mb=64)
    )
    np.testing.assert_array_equal(
        open_volume(tmp_path / "p.zarr")[...], open_volume(tmp_path / "w.zarr")[...]
    )


# ----------------------------------------------------------------------------- TTA
class CountingModel(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


def run(model, store, dest, **kw):
    infer_volume(model, store, dest, InferenceSettings(window=(12, 12, 12), batch_size=4, **kw))
    return open_volume(dest)[...].astype(np.float32)


def test_tta_with_an_equivariant_model_changes_nothing(tmp_path):
    store = image_store(tmp_path / "img.zarr", random_volume((20, 18, 16)))
    torch.manual_seed(0)
    pointwise = CountingModel(nn.Conv3d(1, 1, 1))  # commutes with every flip
    plain = run(pointwise, store, tmp_path / "a.zarr")
    n_plain = pointwise.calls
    tta = run(pointwise, store, tmp_path / "b.zarr", tta_flips=True)
    assert pointwise.calls == 9 * n_plain  # 8 flip combinations per batch
    np.testing.assert_allclose(tta, plain, atol=1e-3)


def test_tta_with_a_non_equivariant_model_differs(tmp_path):
    store = image_store(tmp_path / "img.zarr", random_volume((20, 18, 16)))
    torch.manual_seed(0)
    conv = nn.Conv3d(1, 1, 3, padding=1)
    with torch.no_grad():
        conv.weight.mul_(20)  # an asymmetric 3x3x3 kernel: flipping changes the output
    plain = run(conv, store, tmp_path / "a.zarr")
    tta = run(conv, store, tmp_path / "b.zarr", tta_flips=True)
    assert np.abs(tta - plain).max() > 0.05


# ----------------------------------------------------------------------------- postprocess
def prob_store(path: Path, probs: np.ndarray, chunks=(4, 16, 16)) -> Path:
    create_volume(path, probs.shape, np.float16, chunks)[...] = probs.astype(np.float16)
    return path


def read_mask(path: Path) -> np.ndarray:
    mask = tifffile.imread(path)
    assert mask.dtype == np.uint8 and set(np.unique(mask)) <= {0, 1}
    with tifffile.TiffFile(path) as tif:
        assert len(tif.pages) == mask.shape[0]  # one page per z-slice
    return mask


def test_postprocess_threshold_streams_pages(tmp_path):
    probs = np.random.default_rng(0).random((10, 7, 9)).astype(np.float16)
    store = prob_store(tmp_path / "p.zarr", probs)
    info = write_mask(store, tmp_path / "m.tif", PostprocessSettings(threshold=0.3))
    mask = read_mask(tmp_path / "m.tif")
    np.testing.assert_array_equal(mask, (probs > 0.3).astype(np.uint8))
    assert info["foreground_voxels"] == int(mask.sum()) and not info["holds_whole_mask"]
    # The whole-volume path with a no-op size filter writes the same mask.
    write_mask(
        store, tmp_path / "w.tif", PostprocessSettings(threshold=0.3, min_component_voxels=1)
    )
    np.testing.assert_array_equal(read_mask(tmp_path / "w.tif"), mask)


def test_postprocess_removes_small_components_26_connected(tmp_path):
    probs = np.zeros((12, 12, 12), np.float32)
    probs[1:4, 1:4, 1:4] = 0.9  # 27 voxels
    probs[8, 8, 8] = 0.9  # 1 voxel
    probs[5, 9, 2] = probs[6, 10, 3] = 0.9  # 2 voxels touching at a corner: one component
    store = prob_store(tmp_path / "p.zarr", probs)
    info = write_mask(store, tmp_path / "m.tif", PostprocessSettings(min_component_voxels=2))
    mask = read_mask(tmp_path / "m.tif")
    assert mask.sum() == 29 and mask[8, 8, 8] == 0 and mask[5, 9, 2] == mask[6, 10, 3] == 1
    assert info["removed_voxels"] == 1
    write_mask(store, tmp_path / "m28.tif", PostprocessSettings(min_component_voxels=28))
    assert read_mask(tmp_path / "m28.tif").sum() == 0


def test_postprocess_fills_enclosed_cavities_per_volume(tmp_path):
    probs = np.zeros((14, 14, 14), np.float32)
    probs[1:6, 1:6, 1:6] = 0.9
    probs[2:5, 2:5, 2:5] = 0.1  # a closed shell with a 27-voxel cavity: filled
    probs[:, 8:13, 8:13] = 0.9
    probs[:, 9:12, 9:12] = 0.1  # a tube open at both z ends: a hole per slice, not in 3D
    store = prob_store(tmp_path / "p.zarr", probs)
    info = write_mask(store, tmp_path / "m.tif", PostprocessSettings(fill_holes=True))
    mask = read_mask(tmp_path / "m.tif")
    assert mask[2:5, 2:5, 2:5].all() and info["filled_voxels"] == 27
    assert not mask[:, 9:12, 9:12].any()


# ----------------------------------------------------------------------------- weights, records
def save_weights(path: Path, model: nn.Module, patch=(12, 12, 12)) -> Path:
    """Exactly the payload train.py writes as last.pt."""
    save_checkpoint(
        path,
        {
            "model": model.state_dict(),
            "model_config": dict(TINY),
            "patch_size": list(patch),
            "fingerprint": "0123456789abcdef",
            "step": 7,
        },
    )
    return path


def test_weights_load_with_weights_only_and_give_identical_logits(tmp_path, monkeypatch):
    model = tiny_unet(seed=3)
    weights = save_weights(tmp_path / "last.pt", model)
    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    loaded, patch = load_model(weights, "cpu")
    assert seen == [True] and patch == (12, 12, 12) and not loaded.training
    x = torch.rand(2, 1, 12, 10, 12)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_infer_records_names_outputs_by_id(tmp_path):
    weights = save_weights(tmp_path / "last.pt", tiny_unet())
    stores = [
        image_store(tmp_path / "images" / f"{rid}.zarr", random_volume((14, 16, 18), seed=i))
        for i, rid in enumerate(["1004283650", "vol_b"])
    ]
    rows = infer_records(
        weights, stores, tmp_path / "predictions", tmp_path / "probabilities",
        InferenceSettings(overlap=0.5, batch_size=2, tta_flips=False, device="cpu"),
        PostprocessSettings(threshold=0.5, min_component_voxels=0, fill_holes=False),
    )  # fmt: skip
    assert [r["id"] for r in rows] == ["1004283650", "vol_b"]
    assert sorted(p.name for p in (tmp_path / "predictions").iterdir()) == [
        "1004283650.tif",
        "vol_b.tif",
    ]
    assert sorted(p.name for p in (tmp_path / "probabilities").iterdir()) == [
        "1004283650.zarr",
        "vol_b.zarr",
    ]
    for rid in ("1004283650", "vol_b"):
        prob = open_volume(tmp_path / "probabilities" / f"{rid}.zarr")
        mask = read_mask(tmp_path / "predictions" / f"{rid}.tif")
        assert prob.dtype == np.float16 and mask.shape == prob.shape == (14, 16, 18)
        np.testing.assert_array_equal(mask, (prob[...] > 0.5).astype(np.uint8))
    assert rows[0]["window"] == [12, 12, 12]  # the training patch by default


# ----------------------------------------------------------------------------- errors
def test_weight_errors_name_the_file(tmp_path):
    with pytest.raises(CtsegError, match="missing.pt: weights file not found"):
        load_model(tmp_path / "missing.pt", "cpu")
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CtsegError, match="corrupt.pt: damaged weights file: it has no checksum"):
        load_model(tmp_path / "corrupt.pt", "cpu")
    save_checkpoint(tmp_path / "partial.pt", {"model": {}})
    with pytest.raises(CtsegError, match="partial.pt: expected a dict with keys"):
        load_model(tmp_path / "partial.pt", "cpu")
    weights = save_weights(tmp_path / "wrong.pt", build_model({"filters": [4, 16]}))
    with pytest.raises(CtsegError, match="wrong.pt: weights do not match"):
        load_model(weights, "cpu")


def test_a_weights_file_cut_short_or_damaged_is_refused(tmp_path):
    """A partial copy of last.pt (its end cut off) or one with a flipped byte is refused with
    one line naming the file and the fix, before torch reads it."""
    weights = save_weights(tmp_path / "last.pt", build_model(dict(TINY)))
    data = weights.read_bytes()
    load_model(weights, "cpu")  # intact: loads
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CtsegError, match=r"cut.pt: damaged weights file: it has no checksum"):
        load_model(tmp_path / "cut.pt", "cpu")
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0xFF
    (tmp_path / "flipped.pt").write_bytes(bytes(flipped))
    with pytest.raises(CtsegError, match=r"flipped.pt: damaged weights file: its bytes do not"):
        load_model(tmp_path / "flipped.pt", "cpu")


def test_an_image_store_given_as_probabilities_is_refused(tmp_path):
    image = image_store(tmp_path / "img.zarr", random_volume((8, 8, 8)), (8, 8, 8))
    with pytest.raises(CtsegError, match=r"img.zarr: a uint8 store, not probabilities"):
        write_mask(image, tmp_path / "m.tif", PostprocessSettings())
    assert not (tmp_path / "m.tif").exists()


def test_image_errors_name_the_store_and_leave_no_output(tmp_path):
    model = nn.Conv3d(1, 1, 1)
    kw = {"window": (8, 8, 8)}
    with pytest.raises(CtsegError, match="nope.zarr: image store not found"):
        infer_volume(model, tmp_path / "nope.zarr", tmp_path / "p.zarr", InferenceSettings(**kw))
    flat = tmp_path / "flat.zarr"
    attributes = {"p0_5": 0, "p99_5": 1}
    zarr.create_array(str(flat), shape=(8, 8), dtype=np.uint8, attributes=attributes)[...] = 1
    with pytest.raises(CtsegError, match="flat.zarr: expected a 3D volume"):
        infer_volume(model, flat, tmp_path / "p.zarr", InferenceSettings(**kw))
    bare = tmp_path / "bare.zarr"
    create_volume(bare, (8, 8, 8), np.uint8, (8, 8, 8))[...] = 1
    with pytest.raises(CtsegError, match="bare.zarr: image attributes lack"):
        infer_volume(model, bare, tmp_path / "p.zarr", InferenceSettings(**kw))
    good = image_store(tmp_path / "good.zarr", random_volume((8, 8, 8)))
    with pytest.raises(CtsegError, match="overlap"):
        infer_volume(model, good, tmp_path / "p.zarr", InferenceSettings(overlap=1.0, **kw))
    with pytest.raises(CtsegError, match="expected one channel"):
        infer_volume(nn.Conv3d(1, 2, 1), good, tmp_path / "p.zarr", InferenceSettings(**kw))
    assert not (tmp_path / "p.zarr").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(CtsegError, match="missing.zarr: probability store not found"):
        write_mask(tmp_path / "missing.zarr", tmp_path / "m.tif", PostprocessSettings())
    assert not (tmp_path / "m.tif").exists()


def test_duplicate_ids_are_refused(tmp_path):
    stores = [tmp_path / "a" / "x1.zarr", tmp_path / "b" / "x1.zarr"]
    with pytest.raises(CtsegError, match="same id"):
        infer_records(
            tmp_path / "w.pt", stores, tmp_path / "o", tmp_path / "p",
            InferenceSettings(overlap=0.5, batch_size=1, tta_flips=False),
            PostprocessSettings(threshold=0.5, min_component_voxels=0, fill_holes=False),
        )  # fmt: skip
