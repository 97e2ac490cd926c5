"""Tests for the patch stream (ctseg.data.patches, ctseg.data.loader, ctseg.data.device_batches) and
ctseg.data.augment on tiny synthetic scratch directories.

Each scratch record is written here from a synthetic label: oblique sheets (tilted away from
every slicing plane, so the medial surface is local enough for the targets' halo) plus a ball of
ignore. Targets come from `ctseg.preprocess.targets.targets_reference` on the whole volume.
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from ctseg.data import augment as aug
from ctseg.data.device_batches import DevicePrefetcher, to_device
from ctseg.data.loader import build_loader
from ctseg.data.packing import SAMPLE_KEYS
from ctseg.data.patches import LABELLED_TRIES, PatchDataset
from ctseg.io import CtsegError
from ctseg.preprocess.targets import SKELETON_HALO, targets_reference
from ctseg.store import create_in_group, create_volume, pack_masks

PATCH = (16, 24, 24)
CLIP = 4.0
TUBE = 2
METHOD = "medial_surface"
HALO = max(math.ceil(CLIP), TUBE + SKELETON_HALO)  # what ctseg.preprocess.targets records as `halo`
PARAMS = {"clip_distance": CLIP, "skeleton_method": METHOD, "tube_dilations": TUBE, "halo": HALO}
AUGMENT = {
    "flip": True,
    "permute": True,
    "intensity": {
        "prob": 0.5,
        "scale": [0.9, 1.1],
        "shift": [-0.1, 0.1],
        "gamma": [0.8, 1.25],
        "noise_std": 0.05,
    },
    "elastic": False,
    "scale": False,
}
IDS = ("a", "b")
PAD = {"image": 0, "label": 2, "ignore": 1, "skeleton": 0, "tube": 0, "sdt": CLIP}


def synthetic_label(shape, normal, fg_box=None, seed=0) -> np.ndarray:
    z, y, x = np.indices(shape, dtype=np.float32)
    n = np.asarray(normal, np.float32) / np.linalg.norm(normal)
    s = n[0] * z + n[1] * y + n[2] * x + 1.5 * np.sin(y / 6)
    label = ((s % 11) < 3).astype(np.uint8)
    if fg_box is not None:
        keep = np.zeros(shape, bool)
        keep[fg_box] = True
        label[~keep] = 0
    rng = np.random.default_rng(seed)
    c = rng.uniform(0, shape)
    label[(z - c[0]) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2 < 64] = 2
    return label


def reference(label: np.ndarray) -> dict[str, np.ndarray]:
    return targets_reference(
        np.ascontiguousarray(label),
        clip_distance=CLIP,
        skeleton_method=METHOD,
        tube_dilations=TUBE,
    )


def write_record(scratch: Path, rid: str, label: np.ndarray, image: np.ndarray, fmt: str) -> None:
    targets = reference(label)
    fg = np.argwhere(targets["foreground"]).astype(np.int32)
    fg = fg[np.random.default_rng(1).permutation(len(fg))[:500]]
    attrs = {
        "shape": list(image.shape),
        "dtype": str(image.dtype),
        "p0_5": float(np.percentile(image, 0.5)),
        "p99_5": float(np.percentile(image, 99.5)),
    }
    folder = scratch / rid
    folder.mkdir(parents=True)
    if fmt == "raw":
        np.save(folder / "image.npy", image)
        np.save(folder / "masks.npy", pack_masks(targets))
        np.save(folder / "sdt.npy", targets["sdt"])
        np.save(folder / "fg_locations.npy", fg)
        (folder / "meta.json").write_text(json.dumps({**attrs, "targets": PARAMS}))
        return
    import zarr

    array = create_volume(
        folder / "image.zarr", image.shape, image.dtype, (16,) * 3, None, None, attrs
    )
    array[...] = image
    group = zarr.open_group(str(folder / "targets.zarr"), mode="w", zarr_format=3)
    for name, values in targets.items():
        create_in_group(group, name, values.shape, values.dtype, (16,) * 3)[...] = values
    create_in_group(group, "fg_locations", fg.shape, np.int32, fg.shape)[...] = fg
    group.attrs.update(PARAMS)


def synthetic_image(label: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    image = 60 + 120 * (label == 1) + rng.normal(0, 10, label.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


VOLUMES: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def volumes() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    if not VOLUMES:
        # a: foreground only in x < 12, so uniform patches often miss it; b: sheets everywhere.
        la = synthetic_label((40, 40, 40), (0.8, 0.5, 0.33), np.s_[:, :, :12], seed=0)
        # b is larger than patch + 2 x halo, so some runtime windows do not touch a face.
        lb = synthetic_label((60, 68, 68), (0.4, 0.7, 0.6), seed=1)
        VOLUMES["a"] = (synthetic_image(la, 0), la)
        VOLUMES["b"] = (synthetic_image(lb, 1), lb)
    return VOLUMES


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for fmt in ("raw", "zarr"):
        root = tmp_path_factory.mktemp(f"scratch_{fmt}")
        for rid, (image, label) in volumes().items():
            write_record(root, rid, label, image, fmt)
        out[fmt] = root
    return out


def dataset(scratch, fmt="raw", ids=IDS, **kw) -> PatchDataset:
    args = {
        "patch_size": PATCH,
        "fmt": fmt,
        "fg_fraction": 0.5,
        "augment": AUGMENT,
        "seed": 0,
        "length": 64,
    }
    args.update(kw)
    return PatchDataset(scratch[fmt], ids, **args)


def assert_same(s1: dict, s2: dict, keys=SAMPLE_KEYS) -> None:
    for key in keys:
        a, b = s1[key], s2[key]
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a, b), key
        else:
            assert a == b, key


def padded_crop(volume: np.ndarray, start, size, fill) -> np.ndarray:
    """Independent of ctseg.data.patches: pad generously with np.pad, then slice."""
    m = max(size)
    big = np.pad(volume, m, constant_values=fill)
    return big[tuple(slice(s + m, s + m + n) for s, n in zip(start, size, strict=True))]


def transformed_box(start, size, shape, geometry: aug.Geometry):
    """Where the patch box lands in the whole volume after the same permutation and flips."""
    perm = geometry.perm
    start = [start[p] for p in perm]
    size = [size[p] for p in perm]
    shape = [shape[p] for p in perm]
    for axis, flip in enumerate(geometry.flips):
        if flip:
            start[axis] = shape[axis] - start[axis] - size[axis]
    return start, size


def transform_volume(volume: np.ndarray, geometry: aug.Geometry) -> np.ndarray:
    out = volume.transpose(geometry.perm)
    axes = tuple(a for a, f in enumerate(geometry.flips) if f)
    return np.ascontiguousarray(np.flip(out, axes) if axes else out)


# ----------------------------------------------------------------------------- samples


@pytest.mark.parametrize("fmt", ["raw", "zarr"])
def test_sample_keys_shapes_dtypes(scratch, fmt):
    sample = dataset(scratch, fmt)[3]
    assert set(sample) == set(SAMPLE_KEYS)
    for key in ("image", "label", "ignore", "skeleton", "tube", "sdt"):
        assert sample[key].shape == (1, *PATCH), key
    assert sample["image"].dtype == torch.uint8
    for key in ("label", "ignore", "skeleton", "tube"):
        assert sample[key].dtype == torch.uint8, key
    assert set(sample["label"].unique().tolist()) <= {0, 1, 2}
    for key in ("ignore", "skeleton", "tube"):
        assert set(sample[key].unique().tolist()) <= {0, 1}, key
    assert torch.equal(sample["ignore"], (sample["label"] == 2).to(torch.uint8))
    assert sample["sdt"].dtype == torch.float16
    assert sample["intensity"].dtype == torch.float32 and sample["intensity"].shape == (2,)
    assert sample["aug"].dtype == torch.float32 and sample["aug"].shape == (len(aug.AUG_FIELDS),)
    assert sample["index"].dtype == torch.int64 and int(sample["index"]) == 3
    assert sample["worker"] == -1


def test_raw_and_zarr_give_the_same_samples(scratch):
    raw, zarr_ds = dataset(scratch, "raw"), dataset(scratch, "zarr")
    for i in range(0, 64, 5):
        assert_same(raw[i], zarr_ds[i])


def test_fg_oversampling(scratch):
    n = 120
    every = dataset(scratch, ids=("a",), fg_fraction=1.0, augment={}, length=n)
    half = PATCH[0] // 2, PATCH[1] // 2, PATCH[2] // 2
    for i in range(n):
        assert every[i]["label"][0][half] == 1, i  # without geometry the centre stays put
    never = dataset(scratch, ids=("a",), fg_fraction=0.0, augment={}, length=n)
    hits = sum(bool((never[i]["label"] == 1).any()) for i in range(n))
    # Foreground only fills x < 12 of 40: a uniform 24-wide patch reaches it ~55% of the time;
    # 0.8 is > 5 binomial standard deviations above that.
    assert hits / n < 0.8


def test_border_padding_at_corners(scratch):
    ds = dataset(scratch, ids=("a",), fg_fraction=0.0, augment={}, length=400)
    image, label = volumes()["a"]
    shape = label.shape
    targets = reference(label)
    found = {"low": False, "high": False}
    for i in range(400):
        plan = ds.plan(i)
        start = np.array(plan.start)
        stop = start + PATCH
        corner = "low" if (start < 0).all() else "high" if (stop > shape).all() else None
        if corner is None or found[corner]:
            continue
        found[corner] = True
        sample = ds[i]
        expected = {
            "image": padded_crop(image, start, PATCH, PAD["image"]),
            "label": padded_crop(label, start, PATCH, PAD["label"]),
            "ignore": padded_crop(targets["ignore"], start, PATCH, PAD["ignore"]),
            "skeleton": padded_crop(targets["skeleton"], start, PATCH, PAD["skeleton"]),
            "tube": padded_crop(targets["tube"], start, PATCH, PAD["tube"]),
            "sdt": padded_crop(targets["sdt"], start, PATCH, np.float16(CLIP)),
        }
        outside = padded_crop(np.zeros(shape, bool), start, PATCH, True)
        assert outside.any() and not outside.all()
        for key, value in expected.items():
            got = sample[key][0].numpy()
            np.testing.assert_array_equal(got, value, err_msg=key)
            assert (got[outside] == PAD[key]).all(), key
    assert all(found.values()), found


# ----------------------------------------------------------------------------- augmentation


def test_flips_and_permutations_keep_precomputed_targets_exact(scratch):
    """Recompute targets on the whole flipped/permuted volume, crop, and compare: all equal.

    The medial surface is the union of per-slice skeletons in all 8 orientations of the square
    (ctseg.preprocess.targets), so it is equivariant under the cube's symmetries like the distance
    is.
    """
    ds = dataset(scratch, fg_fraction=1.0, length=24)
    seen_perm = seen_flip = 0
    for i in range(ds.length):
        plan = ds.plan(i)
        image, label = volumes()[IDS[plan.record]]
        geometry = plan.geometry
        seen_perm += geometry.perm != (0, 1, 2)
        seen_flip += any(geometry.flips)
        start, size = transformed_box(plan.start, PATCH, label.shape, geometry)
        ref = reference(transform_volume(label, geometry))
        sample = ds[i]
        assert tuple(size) == PATCH
        np.testing.assert_array_equal(
            sample["label"][0].numpy(),
            padded_crop(ref["ignore"] * 2 + ref["foreground"], start, size, 2),
        )
        np.testing.assert_array_equal(
            sample["image"][0].numpy(),
            padded_crop(transform_volume(image, geometry), start, size, 0),
        )
        np.testing.assert_array_equal(
            sample["ignore"][0].numpy(), padded_crop(ref["ignore"], start, size, 1)
        )
        np.testing.assert_array_equal(
            sample["sdt"][0].numpy(), padded_crop(ref["sdt"], start, size, np.float16(CLIP))
        )
        for name in ("skeleton", "tube"):
            np.testing.assert_array_equal(
                sample[name][0].numpy(), padded_crop(ref[name], start, size, 0), err_msg=name
            )
    assert seen_perm and seen_flip


def test_permutation_refused_for_unequal_axes():
    patch = np.zeros((16, 24, 32), np.uint8)
    with pytest.raises(CtsegError, match="exchanges axes"):
        aug.check_permutation((0, 2, 1), patch.shape)
    with pytest.raises(CtsegError, match="exchanges axes"):
        aug.apply_geometric(patch, aug.Geometry(perm=(1, 0, 2), flips=(False,) * 3))
    # Equal sizes but anisotropic voxels: distances would be wrong, so refused too.
    with pytest.raises(CtsegError, match="spacing"):
        aug.check_permutation((0, 2, 1), (16, 24, 24), spacing=(1.0, 1.0, 2.0))
    rng = np.random.default_rng(0)
    perms = {aug.draw_geometry(rng, (16, 24, 24), AUGMENT).perm for _ in range(200)}
    assert perms == {(0, 1, 2), (0, 2, 1)}
    perms = {aug.draw_geometry(rng, (16, 24, 32), AUGMENT).perm for _ in range(50)}
    assert perms == {(0, 1, 2)}
    perms = {aug.draw_geometry(rng, (24, 24, 24), AUGMENT).perm for _ in range(400)}
    assert len(perms) == 6
    anisotropic = {**AUGMENT, "spacing": [1.0, 1.0, 2.0]}
    perms = {aug.draw_geometry(rng, (24, 24, 24), anisotropic).perm for _ in range(200)}
    assert perms == {(0, 1, 2), (1, 0, 2)}


def test_intensity_augmentation_touches_only_the_image(scratch):
    on = {**AUGMENT, "intensity": {**AUGMENT["intensity"], "prob": 1.0}}
    off = {**AUGMENT, "intensity": {**AUGMENT["intensity"], "prob": 0.0}}
    ds_on, ds_off = dataset(scratch, augment=on), dataset(scratch, augment=off)
    batch_on = torch.utils.data.default_collate([ds_on[i] for i in range(4)])
    batch_off = torch.utils.data.default_collate([ds_off[i] for i in range(4)])
    # The worker only draws the parameters: the uint8 patches and the geometry are unchanged.
    assert_same(batch_on, batch_off, keys=[k for k in SAMPLE_KEYS if k != "aug"])
    assert (batch_on["aug"][:, 0] == 1).all() and (batch_off["aug"][:, 0] == 0).all()
    dev_on, dev_off = to_device(batch_on, "cpu"), to_device(batch_off, "cpu")
    for key in ("label", "ignore", "skeleton", "tube", "sdt"):
        assert torch.equal(dev_on[key], dev_off[key]), key
    for i in range(4):
        assert not torch.allclose(dev_on["image"][i], dev_off["image"][i])
    # Applied on the device in a fixed, seeded way: the same batch gives the same image.
    assert torch.equal(to_device(batch_on, "cpu")["image"], dev_on["image"])


def test_intensity_formula():
    image = torch.linspace(0, 1, 1000).reshape(1, 1, 10, 10, 10)
    params = torch.tensor([[1.0, 1.1, -0.05, 0.8, 0.0, 0.0]])
    expected = torch.clamp(image.pow(0.8) * 1.1 - 0.05, 0, 1)
    torch.testing.assert_close(aug.apply_intensity(image, params), expected)
    identity = torch.from_numpy(aug.AUG_IDENTITY)[None]
    assert torch.equal(aug.apply_intensity(image, identity), image)
    noisy = aug.apply_intensity(image, torch.tensor([[1.0, 1, 0, 1, 0.05, 123.0]]))
    assert 0.03 < float((noisy - image).std()) < 0.07


def test_elastic_and_scale_are_approximate_but_well_formed(scratch):
    warped = {**AUGMENT, "elastic": True, "scale": [0.8, 1.2]}
    ds = dataset(scratch, augment=warped)
    plain = dataset(scratch)
    for i in range(3):
        s, p = ds[i], plain[i]
        assert s["image"].shape == p["image"].shape and s["image"].dtype == torch.uint8
        assert set(s["label"].unique().tolist()) <= {0, 1, 2}
        assert torch.equal(s["ignore"], (s["label"] == 2).to(torch.uint8))
        assert float(s["sdt"].abs().max()) <= CLIP
        assert not torch.equal(s["image"], p["image"])


# ----------------------------------------------------------------------------- runtime targets


@pytest.mark.parametrize("fmt", ["raw", "zarr"])
def test_runtime_targets_match_precomputed(scratch, fmt):
    n = 20000  # plans are cheap; windows clear of every face are rare at these sizes
    pre = dataset(scratch, fmt, length=n, fg_fraction=0.5)
    run = dataset(scratch, fmt, length=n, fg_fraction=0.5, runtime_targets=True)
    interior = border = 0
    for i in range(n):
        plan = pre.plan(i)
        shape = np.array(volumes()[IDS[plan.record]][1].shape)
        start = np.array(plan.start)
        inside = bool((start - HALO >= 0).all() and (start + PATCH + HALO <= shape).all())
        at_border = bool((start < 0).any() or (start + PATCH > shape).any())
        if (inside and interior < 3) or (at_border and border < 5):
            assert_same(pre[i], run[i])
            interior += inside
            border += at_border
        if interior >= 3 and border >= 5:
            break
    assert interior >= 3 and border >= 5


def test_runtime_targets_need_the_parameters(scratch, tmp_path):
    image, label = volumes()["a"]
    write_record(tmp_path, "c", label, image, "raw")
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    del meta["targets"]
    (tmp_path / "c" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CtsegError, match="clip_distance"):
        dataset({"raw": tmp_path}, ids=("c",))[0]
    # Parameters passed explicitly are enough.
    ds = dataset({"raw": tmp_path}, ids=("c",), runtime_targets=True, target_params=PARAMS)
    assert ds[0]["sdt"].shape == (1, *PATCH)


def test_bad_inputs(scratch):
    with pytest.raises(CtsegError, match="format"):
        PatchDataset(
            scratch["raw"],
            IDS,
            patch_size=PATCH,
            fmt="tiff",
            fg_fraction=0.5,
            augment={},
            seed=0,
            length=1,
        )
    with pytest.raises(CtsegError, match="not in scratch"):
        dataset(scratch, ids=("a", "missing"))
    with pytest.raises(CtsegError, match="bad id"):
        dataset(scratch, ids=("../a",))
    with pytest.raises(IndexError):
        dataset(scratch, length=4)[4]
    with pytest.raises(CtsegError, match="gamma"):
        dataset(scratch, augment={"intensity": {"prob": 1, "gamma": [0, 2]}})
    with pytest.raises(CtsegError, match="unknown keys"):
        dataset(scratch, augment={"rotate": True})


# ----------------------------------------------------------------------------- the stream


def test_stream_is_a_function_of_seed_and_index(scratch):
    a, b, c = dataset(scratch, seed=5), dataset(scratch, seed=5), dataset(scratch, seed=6)
    for i in (0, 7, 30):
        assert_same(a[i], b[i])
    assert any(not torch.equal(a[i]["image"], c[i]["image"]) for i in range(4))
    assert not torch.equal(a[0]["image"], a[1]["image"])


PHASE = {
    "workers": 2,
    "batch_size": 2,
    "prefetch_factor": 2,
    "persistent_workers": False,
    "pin_memory": False,
    "mp_context": "fork",
    "drop_last": True,
}


def collect(loader) -> list[dict]:
    return list(loader)


def test_fork_workers_give_the_in_process_stream(scratch):
    ds = dataset(scratch, "zarr", length=12)
    single = collect(build_loader(ds, {**PHASE, "workers": 0}, seed=0))
    forked = collect(build_loader(ds, PHASE, seed=0))
    assert len(single) == len(forked) == 6
    keys = [k for k in SAMPLE_KEYS if k != "worker"]
    for s, f in zip(single, forked, strict=True):
        assert_same(s, f, keys)
    workers = torch.cat([b["worker"] for b in forked])
    assert set(workers.tolist()) == {0, 1}
    assert set(torch.cat([b["worker"] for b in single]).tolist()) == {-1}
    # The two workers serve different parts of the stream, hence different patches.
    images = torch.cat([b["image"] for b in forked])
    w0, w1 = images[workers == 0], images[workers == 1]
    assert all(not torch.equal(x, y) for x in w0 for y in w1)


def test_spawn_workers(scratch):
    ds = dataset(scratch, "raw", length=4)
    single = collect(build_loader(ds, {**PHASE, "workers": 0}, seed=0))
    spawned = collect(build_loader(ds, {**PHASE, "mp_context": "spawn"}, seed=0))
    keys = [k for k in SAMPLE_KEYS if k != "worker"]
    for s, f in zip(single, spawned, strict=True):
        assert_same(s, f, keys)
    assert set(torch.cat([b["worker"] for b in spawned]).tolist()) == {0, 1}


def test_resume_continues_the_stream(scratch):
    ds = dataset(scratch, length=16)
    phase = {**PHASE, "workers": 0, "batch_size": 2}
    full = collect(build_loader(ds, phase, seed=0))
    resumed = collect(build_loader(ds, phase, seed=0, start=6))
    assert len(resumed) == len(full) - 3
    for a, b in zip(full[3:], resumed, strict=True):
        assert_same(a, b)


def test_stores_open_lazily(scratch):
    for fmt in ("raw", "zarr"):
        ds = dataset(scratch, fmt)
        assert ds._records is None
        size = len(pickle.dumps(ds))
        assert size < 4096
        ds[0]
        assert ds._records  # opened in this process on first use
        clone = pickle.loads(pickle.dumps(ds))
        assert clone._records is None
        assert len(pickle.dumps(ds)) == size
        assert_same(clone[1], ds[1])


# ----------------------------------------------------------------------------- loader, device


def test_build_loader_maps_phase_keys(scratch):
    ds = dataset(scratch, length=8)
    phase = {**PHASE, "workers": 2, "batch_size": 4, "prefetch_factor": 5}
    phase.update(persistent_workers=True, mp_context="spawn", drop_last=False, pin_memory=True)
    loader = build_loader(ds, phase, seed=0, start=2)
    assert loader.num_workers == 2 and loader.batch_size == 4 and loader.prefetch_factor == 5
    assert loader.persistent_workers and not loader.drop_last
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert not loader.pin_memory  # no CUDA device here
    assert list(loader.sampler) == list(range(2, 8))
    assert len(loader) == 2
    inline = build_loader(ds, {**phase, "workers": 0}, seed=0)
    assert inline.num_workers == 0 and inline.prefetch_factor is None
    assert not inline.persistent_workers
    with pytest.raises(CtsegError, match="mp_context"):
        build_loader(ds, {**PHASE, "mp_context": "thread"}, seed=0)


def test_to_device_cpu(scratch):
    ds = dataset(scratch, augment={})
    batch = torch.utils.data.default_collate([ds[i] for i in range(3)])
    assert batch["image"].dtype == torch.uint8
    out = to_device(batch, "cpu")
    image = out["image"]
    assert image.dtype == torch.float32 and image.shape == (3, 1, *PATCH)
    assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0
    lo, hi = batch["intensity"][:, 0], batch["intensity"][:, 1]
    expected = (batch["image"].float() - lo.view(-1, 1, 1, 1, 1)) / (hi - lo).view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(image, expected.clamp(0, 1))
    assert out["label"].dtype == torch.uint8 and out["sdt"].dtype == torch.float32
    # uint16 volumes convert the same way.
    wide = dict(batch, image=batch["image"].to(torch.int32).mul(200).to(torch.uint16))
    wide["intensity"] = batch["intensity"] * 200
    torch.testing.assert_close(to_device(wide, "cpu")["image"], image)


def test_device_prefetcher_cpu_passthrough(scratch):
    ds = dataset(scratch, length=6)
    loader = build_loader(ds, {**PHASE, "workers": 0}, seed=0)
    prefetched = list(DevicePrefetcher(loader, "cpu"))
    assert len(prefetched) == len(DevicePrefetcher(loader, "cpu")) == 3
    for got, batch in zip(prefetched, loader, strict=True):
        expected = to_device(batch, "cpu")
        for key in ("image", "label", "sdt", "tube"):
            assert torch.equal(got[key], expected[key]), key


# ----------------------------------------------------------------------------- labelled patches


@pytest.mark.parametrize("fmt", ["raw", "zarr"])
def test_no_patch_without_a_labelled_voxel(tmp_path, fmt):
    """A volume labelled only in one corner: a uniform centre mostly lands on an all-ignore patch
    (a step on it has every loss term and the gradient exactly 0). Such patches are redrawn, the
    rest are untouched, and sample i is still a function of (seed, i) alone."""
    image, label = volumes()["b"]
    label = label.copy()
    label[:, 20:, :] = 2
    label[:, :, 20:] = 2  # labelled: y < 20 and x < 20, a quarter of each slice or less
    write_record(tmp_path, "corner", label, image, fmt)
    kw = {"ids": ("corner",), "fg_fraction": 0.0, "length": 80}
    ds = dataset({fmt: tmp_path}, fmt, augment=AUGMENT, **kw)
    plans = [ds.plan(i) for i in range(ds.length)]
    assert sum(p.redrawn > 0 for p in plans) >= 10, "the volume should have unlabelled windows"
    for i, plan in enumerate(plans):
        sample = ds[i]
        assert (sample["ignore"] == 0).any(), i
        assert plan.redrawn <= LABELLED_TRIES + 1
    # A fresh dataset (another process, another worker count) draws the same samples.
    again = dataset({fmt: tmp_path}, fmt, augment=AUGMENT, **kw)
    for i in range(0, ds.length, 7):
        plan = again.plan(i)
        assert (plan.start, plan.geometry, plan.redrawn) == (
            plans[i].start,
            plans[i].geometry,
            plans[i].redrawn,
        )
        assert_same(ds[i], again[i])
    # A sample whose first patch is labelled is what it always was: its plan on the same
    # volume fully labelled (no redraw possible) is the same.
    write_record(tmp_path, "full", volumes()["b"][1], image, fmt)
    full = dataset({fmt: tmp_path}, fmt, augment=AUGMENT, **{**kw, "ids": ("full",)})
    kept = [i for i, p in enumerate(plans) if p.redrawn == 0]
    assert kept
    for i in kept:
        first = full.plan(i)
        assert first.start == plans[i].start and first.geometry == plans[i].geometry
