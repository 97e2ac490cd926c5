"""Tests for the packed loader: one uint8 tensor per batch, unpacked on the device.

The reference is the host layout (`SAMPLE_KEYS`: ten tensors per sample, as the loader sent
them before) built by `default_collate` from `PatchDataset.__getitem__`; the packed batch must
give the same device batch bit for bit. Scratch records are written here: uint8 and uint16
images, targets from `ctseg.preprocess.targets.targets_reference`.
"""

from __future__ import annotations

import json
import os
import pickle
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from jsonschema import Draft202012Validator
from torch.utils.data import default_collate

import ctseg.data.slots
from ctseg.data.device_batches import DevicePrefetcher, to_device
from ctseg.data.loader import build_loader
from ctseg.data.packing import SAMPLE_KEYS, PackedBatch, PackedLayout, unpack_bits
from ctseg.data.patches import PatchDataset
from ctseg.preprocess.targets import targets_reference
from ctseg.store import MASK_BITS, pack_masks

PATCH = (12, 20, 20)
CLIP = 4.0
PARAMS = {"clip_distance": CLIP, "skeleton_method": "medial_surface", "tube_dilations": 2}
AUGMENT = {
    "flip": True,
    "permute": True,
    "intensity": {"prob": 0.7, "scale": [0.9, 1.1], "gamma": [0.8, 1.25], "noise_std": 0.05},
}
PHASE = {
    "workers": 2,
    "batch_size": 3,
    "prefetch_factor": 2,
    "persistent_workers": False,
    "pin_memory": False,
    "mp_context": "fork",
    "drop_last": True,
}
SCHEMA = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "phases.schema.yaml"


def write_record(root: Path, rid: str, shape: tuple[int, ...], dtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    z, y, x = np.indices(shape)
    label = (((z + 2 * y + 3 * x) % 9) < 2).astype(np.uint8)
    label[: shape[0] // 3] = np.where(
        rng.random(label[: shape[0] // 3].shape) < 0.5, 2, label[: shape[0] // 3]
    )
    targets = targets_reference(label, **PARAMS)
    top = 60000 if dtype == "uint16" else 250
    image = (rng.random(shape) * top).astype(dtype)
    folder = root / rid
    folder.mkdir(parents=True)
    np.save(folder / "image.npy", image)
    np.save(folder / "masks.npy", pack_masks(targets))
    np.save(folder / "sdt.npy", targets["sdt"])
    np.save(folder / "fg_locations.npy", np.argwhere(targets["foreground"]).astype(np.int32))
    meta = {"p0_5": float(np.percentile(image, 0.5)), "p99_5": float(np.percentile(image, 99.5))}
    (folder / "meta.json").write_text(json.dumps({**meta, "targets": PARAMS}))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("packed_scratch")
    write_record(root, "a", (30, 34, 34), "uint8", 0)
    write_record(root, "b", (26, 30, 30), "uint8", 1)
    write_record(root, "w", (28, 32, 32), "uint16", 2)
    return root


def dataset(root: Path, ids=("a", "b"), length: int = 24) -> PatchDataset:
    return PatchDataset(
        root,
        ids,
        patch_size=PATCH,
        fmt="raw",
        fg_fraction=0.5,
        augment=AUGMENT,
        seed=3,
        length=length,
    )


def assert_equal_batches(got: dict, expected: dict, keys=SAMPLE_KEYS) -> None:
    for key in keys:
        a, b = got[key], expected[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), key


def rows_but_worker(batch: PackedBatch) -> torch.Tensor:
    """The batch's bytes with the worker ids zeroed: the rest is a function of the samples."""
    rows = batch.rows.clone()
    batch.layout.fields(rows)["worker"][:] = 0
    return rows


def test_unpack_bits_inverts_pack_masks_for_numpy_and_torch():
    rng = np.random.default_rng(0)
    label = rng.integers(0, 3, (5, 6, 7)).astype(np.uint8)
    targets = {
        "foreground": label == 1,
        "ignore": label == 2,
        "skeleton": rng.random(label.shape) < 0.3,
        "tube": rng.random(label.shape) < 0.5,
    }
    bits = pack_masks(targets)
    for planes in (
        unpack_bits(bits),
        {k: v.numpy() for k, v in unpack_bits(torch.from_numpy(bits)).items()},
    ):
        np.testing.assert_array_equal(planes["label"], label)
        for name in ("ignore", "skeleton", "tube"):
            np.testing.assert_array_equal(
                planes[name], targets[name].astype(np.uint8), err_msg=name
            )
    # Should foreground and ignore both be set, ignore wins: the voxel is unlabelled.
    both = np.array([MASK_BITS["foreground"] | MASK_BITS["ignore"]], np.uint8)
    assert unpack_bits(both)["label"].tolist() == [2]


def test_layout_sections_are_aligned_and_disjoint():
    for dtype in ("uint8", "uint16"):
        layout = PackedLayout((7, 9, 11), dtype)  # odd voxel count: padding is needed
        at = layout.offsets
        assert all(v % 8 == 0 for v in at.values())
        assert at["sdt"] >= 48 and at["image"] >= at["sdt"] + 2 * 693
        assert at["bits"] >= at["image"] + 693 * np.dtype(dtype).itemsize
        assert layout.nbytes == at["end"] >= at["bits"] + 693
    # 4 bytes a uint8 voxel plus the header, against 7 in the host layout.
    assert PackedLayout((72, 136, 136), "uint8").nbytes < 4.001 * 72 * 136 * 136


def test_packed_device_batch_equals_the_host_layout_batch(scratch):
    ds = dataset(scratch)
    loader = build_loader(ds, {**PHASE, "workers": 0}, seed=0)
    seen_noise = False
    for k, batch in enumerate(loader):
        assert isinstance(batch, PackedBatch) and batch.rows.dtype == torch.uint8
        indices = range(k * 3, k * 3 + 3)
        host = default_collate([ds[i] for i in indices])
        assert batch["index"].tolist() == list(indices)
        # The host view of the packed batch is the old host batch, field by field.
        assert_equal_batches(batch, host, [k for k in SAMPLE_KEYS if k != "worker"])
        got, expected = to_device(batch, "cpu"), to_device(host, "cpu")
        assert set(got) == set(expected)
        assert_equal_batches(got, expected)
        for key in ("image", "label", "ignore", "skeleton", "tube", "sdt"):
            assert got[key].is_contiguous(), key
        assert got["image"].dtype == torch.float32 and got["sdt"].dtype == torch.float32
        seen_noise |= bool((host["aug"][:, 4] > 0).any())
    assert seen_noise  # the comparison covered on-device noise too


def test_uint16_and_mixed_batches(scratch):
    ds = dataset(scratch, ids=("a", "w"), length=12)
    dtypes = set()
    for start in range(0, 12, 2):
        batch = ds.packed([start, start + 1])
        records = {ds.ids[ds.plan(i).record] for i in (start, start + 1)}
        dtypes.add(batch.layout.image_dtype)
        if records == {"a", "w"}:
            # Mixed: the uint8 patch travels widened, with its values unchanged.
            assert batch.layout.image_dtype == "uint16"
            for i, sample in zip(
                (start, start + 1), (batch["image"][0], batch["image"][1]), strict=True
            ):
                assert torch.equal(sample.to(torch.int32), ds[i]["image"].to(torch.int32))
            continue
        host = default_collate([ds[i] for i in (start, start + 1)])
        assert_equal_batches(to_device(batch, "cpu"), to_device(host, "cpu"))
    assert dtypes == {"uint8", "uint16"}


def spy_slots(monkeypatch) -> list[tuple[int, int, int]]:
    """Record the slot of every worker batch the main process receives."""
    slots: list[tuple[int, int, int]] = []
    claim = ctseg.data.slots.SlotReturns.claim

    def spy(self, rows, slot, in_slot):
        slots.append(slot)
        return claim(self, rows, slot, in_slot)

    monkeypatch.setattr(ctseg.data.slots.SlotReturns, "claim", spy)
    return slots


class LookUps(weakref.WeakValueDictionary):
    def __init__(self) -> None:
        super().__init__()
        self.keys_looked_up: list = []

    def get(self, key, default=None):
        self.keys_looked_up.append(key)
        return super().get(key, default)


@pytest.mark.parametrize("count_references", [True, False])
def test_workers_reuse_their_buffers_without_corrupting_held_batches(
    scratch, monkeypatch, count_references
):
    """Slots of dropped batches are reused; batches the caller keeps stay intact."""
    if not count_references:  # as where torch has no reference count: copies instead
        monkeypatch.setattr(ctseg.data.slots, "use_count", None)
    slots = spy_slots(monkeypatch)
    # The main process looks a slot up here when a batch arrives by the slot's name.
    mapped = LookUps()
    monkeypatch.setattr(ctseg.data.slots, "MAPPED_SLOTS", mapped)
    ds = dataset(scratch, length=60)
    inline = list(build_loader(ds, {**PHASE, "workers": 0}, seed=0))
    assert not slots  # no workers, no slots
    for context in ("fork", "spawn"):
        slots.clear()
        loader = build_loader(ds, {**PHASE, "mp_context": context}, seed=0)
        kept = {}
        for k, batch in enumerate(loader):
            assert batch.slot is None and not batch.in_slot  # the bookkeeping stays inside
            if k % 4 == 0:
                kept[k] = batch
                kept[k + 100] = batch["image"][1:]  # a view keeps the slot busy too
            # Touch the batch the way training does, then drop it.
            to_device(batch, "cpu")
        assert len(slots) == len(inline) == 20
        # 10 batches per worker; the slots of dropped ones came back and were written again.
        assert len(set(slots)) < 20 - len(inline[::4])
        assert mapped.keys_looked_up  # reused slots came by name
        assert set(mapped.keys_looked_up) <= {slot[1:] for slot in slots}
        mapped.keys_looked_up.clear()
        for k, batch in kept.items():
            if k < 100:
                assert torch.equal(rows_but_worker(batch), rows_but_worker(inline[k])), k
            else:
                assert torch.equal(batch, inline[k - 100]["image"][1:]), k
    # A second epoch of the same loader (new workers) gives the same stream again.
    for a, b in zip(loader, inline, strict=True):
        assert torch.equal(rows_but_worker(a), rows_but_worker(b))


def test_a_batch_dropped_at_once_frees_its_slot_in_time(scratch, monkeypatch):
    """With one batch in flight per worker, a loop that drops each batch needs two slots a
    worker: the one being filled and the one the caller has just been handed. The slot comes
    back at the next batch's arrival, before the worker starts its next batch but one; any
    reference the loader itself kept to the batch would hold it one batch longer (3 slots).
    A worker slow to pick up its next index may find the slot already back and use one slot
    only (seen on a loaded 2-core CI machine), so the bound is at most 2, not exactly 2."""
    slots = spy_slots(monkeypatch)
    loader = build_loader(dataset(scratch, length=60), {**PHASE, "prefetch_factor": 1}, seed=0)
    batches = iter(loader)
    for _ in range(20):
        next(batches)  # dropped at once (a loop variable would keep it until the next one)
    assert len(slots) == 20
    per_worker = {w: {s for s in slots if s[0] == w} for w in (0, 1)}
    assert all(1 <= len(s) <= 2 for s in per_worker.values()), per_worker


def test_persistent_workers_keep_their_slots_across_epochs(scratch):
    ds = dataset(scratch, length=24)
    phase = {**PHASE, "persistent_workers": True}
    loader = build_loader(ds, phase, seed=0)
    first, second = list(loader), list(loader)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.rows, b.rows)


def test_device_prefetcher_gives_the_host_layout_result(scratch):
    ds = dataset(scratch, length=9)
    loader = build_loader(ds, {**PHASE, "workers": 0}, seed=0)
    for k, got in enumerate(DevicePrefetcher(loader, "cpu")):
        host = default_collate([ds[i] for i in range(3 * k, 3 * k + 3)])
        assert_equal_batches(got, to_device(host, "cpu"))


def test_a_phase_may_run_without_workers(scratch):
    """workers: 0 passes the schema with every key listed, and the loader drops the keys
    torch refuses without workers."""
    schema = yaml.safe_load(SCHEMA.read_text())
    phase = {
        "workers": 0,
        "batch_size": 2,
        "prefetch_factor": 4,
        "persistent_workers": True,
        "pin_memory": True,
        "mp_context": "spawn",
        "drop_last": True,
        "device_prefetch": True,
        "precision": "fp32",
        "channels_last": False,
        "compile": False,
    }
    Draft202012Validator(schema).validate({"phases": {"7": phase}})
    with pytest.raises(Exception, match="-1"):
        Draft202012Validator(schema).validate({"phases": {"7": {**phase, "workers": -1}}})
    loader = build_loader(dataset(scratch, length=4), phase, seed=0)
    assert loader.num_workers == 0 and loader.prefetch_factor is None
    assert not loader.persistent_workers
    batches = list(DevicePrefetcher(loader, "cpu"))
    assert [b["index"].tolist() for b in batches] == [[0, 1], [2, 3]]
    assert all(b["worker"].tolist() == [-1, -1] for b in batches)


def test_slot_goes_back_when_nothing_refers_to_the_batch(scratch, monkeypatch):
    """What PackedLoader does with each worker batch, step by step."""
    import queue

    pool = ctseg.data.slots.SlotPool(None)
    ds = dataset(scratch)
    returns = [queue.SimpleQueue(), queue.SimpleQueue()]
    lender = ctseg.data.slots.SlotReturns(returns)
    sent = ds.packed([0, 1], pool)
    assert sent.in_slot and not sent.by_name and sent.slot[1:] == (os.getpid(), 0)
    slot = (1, *sent.slot[1:])  # as if worker 1 had sent it
    layout, expected = sent.layout, sent.rows.clone()
    got = PackedBatch(lender.claim(sent.rows, slot, in_slot=True), layout)
    assert got.rows.data_ptr() == sent.rows.data_ptr()  # no copy
    del sent
    view = got["sdt"]
    lender.give_back_unused()
    assert returns[1].empty()  # the batch and a view of it are alive
    del got
    lender.give_back_unused()
    assert returns[1].empty()  # the view still is
    del view
    lender.give_back_unused()
    # Back to worker 1, marked as mapped here: the slot's next batch may come by name.
    assert returns[1].get_nowait() == (*slot[1:], True) and returns[0].empty()
    rows = torch.empty(0, dtype=torch.uint8).set_(pool.slots[0])[: 2 * layout.nbytes]
    named = PackedBatch(rows.view(2, layout.nbytes), layout, slot, in_slot=True, by_name=True)
    message = pickle.dumps(named)
    assert len(message) < 1000  # the slot's name, not its 2 x 20 kB
    arrived = pickle.loads(message)
    assert arrived.in_slot and arrived.rows.data_ptr() == rows.data_ptr()
    assert torch.equal(arrived.rows, expected)
    # Without a reference count the batch is copied and the slot goes back at once.
    monkeypatch.setattr(ctseg.data.slots, "use_count", None)
    batch = ds.packed([2])
    copied = lender.claim(batch.rows, (0, 11, 3), in_slot=True)
    assert copied.data_ptr() != batch.rows.data_ptr()
    assert torch.equal(copied, batch.rows)
    assert returns[0].get_nowait() == (11, 3, True)
    # As the pin-memory thread hands it over: already a copy, so none is made, and the worker
    # must send the slot's memory again.
    assert lender.claim(batch.rows, (0, 11, 4), in_slot=False).data_ptr() == batch.rows.data_ptr()
    assert returns[0].get_nowait() == (11, 4, False)
