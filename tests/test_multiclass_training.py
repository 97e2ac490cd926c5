"""A multi-class dataset trains end to end: a dataset.yaml-style spec with values 10/20/30 and
ignore 255 is converted to stored values, its targets carry the class in the mask byte, the
loader gives stored labels, and a tiny 4-channel U-Net trains on ce + dice, its checkpoints
recording the spec; the binary-only terms are refused for it."""

from __future__ import annotations

import copy
import csv
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from training_setup import CLIP, EXPERIMENT, PHASE, SHAPE, torch_globals

from ctseg.data.packing import pack_bits, unpack_bits
from ctseg.data.patches import PatchDataset
from ctseg.io import CtsegError
from ctseg.labels import LabelSpec
from ctseg.network.losses import compute_losses
from ctseg.network.terms import check_terms
from ctseg.preprocess.convert import convert_volume
from ctseg.preprocess.stage import stage_records
from ctseg.preprocess.targets import compute_targets
from ctseg.store import create_volume
from ctseg.training.train import train

SPEC = LabelSpec(
    {"background": 0, "sheet": 10, "fibre": 20, "pore": 30}, ignore=255, source="four/dataset.yaml"
)
IDS = ["a", "b"]


def dataset_label(k: int) -> np.ndarray:
    """Bands of the three classes across an oblique axis, background between, a slab ignored."""
    z, y, x = np.indices(SHAPE)
    band = (z + 0.5 * y + 0.3 * x + 2 * k) % 12
    label = np.select([band < 3, band < 6, band < 9], [10, 20, 30], 0).astype(np.uint8)
    label[:3] = 255
    return label


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("multiclass")
    source = root / "store"
    for k, rid in enumerate(IDS):
        label = dataset_label(k)
        tifffile.imwrite(root / f"{rid}.tif", label, photometric="minisblack")
        convert_volume(root / f"{rid}.tif", root / f"labels/{rid}.zarr", kind="label", labels=SPEC)
        stored = SPEC.to_stored(label)
        noise = np.random.default_rng(k).integers(0, 30, SHAPE)
        image = (np.where(stored == 4, 0, stored) * 60 + noise).astype(np.uint8)
        attrs = {"shape": list(SHAPE), "dtype": "uint8", "p0_5": 0.0, "p99_5": 220.0}
        path = source / f"zarr/images/{rid}.zarr"
        create_volume(path, SHAPE, "uint8", (16, 16, 16), attributes=attrs)[:] = image
        compute_targets(
            root / f"labels/{rid}.zarr",
            source / f"targets/{rid}.zarr",
            clip_distance=CLIP,
            block_shape=(32, 32, 32),
            max_samples=200,
            labels=SPEC.stored(),
        )
    dest = root / "scratch"
    stage_records(str(source), IDS, dest, fmt="raw", workers=1)
    return dest


def multiclass_experiment(**loss: object) -> dict:
    exp = copy.deepcopy(EXPERIMENT)
    exp["model"]["out_channels"] = 4
    exp["loss"] = {"weights": {"ce": 1.0, "dice": 1.0}, **loss}
    exp["data"]["fg_fraction"] = 0.9
    exp["data"]["augment"] = {**exp["data"]["augment"], "intensity": {"prob": 0.0}}
    exp["train"].update(lr=0.01, warmup_steps=0, epochs=2, steps_per_epoch=12, log_every=12)
    return exp


def run(scratch: Path, out: Path, exp: dict) -> dict:
    with torch_globals():
        return train(
            exp,
            PHASE,
            scratch=scratch,
            train_ids=IDS[:1],
            val_ids=IDS[1:],
            out_dir=out / "train",
            state_dir=out / "state",
            final_weights=out / "last.pt",
            clip_distance=CLIP,
            device="cpu",
            progress=False,
            labels=SPEC,
        )


def test_the_loader_gives_stored_labels_from_the_mask_byte(scratch: Path) -> None:
    no_aug = {"flip": False, "permute": False, "intensity": {"prob": 0.0}}
    kwargs = dict(patch_size=(16, 16, 16), fmt="raw", fg_fraction=0.5, augment=no_aug, seed=3)
    dataset = PatchDataset(scratch, IDS[:1], length=4, labels=SPEC, **kwargs)
    stored = SPEC.to_stored(dataset_label(0))
    for i in range(4):
        plan = dataset.plan(i)
        sample = dataset[i]
        start = np.array(plan.start)
        lo, hi = np.maximum(start, 0), np.minimum(start + 16, SHAPE)
        inside = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start, strict=True))
        truth = stored[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]
        label = sample["label"][0].numpy()
        np.testing.assert_array_equal(label[inside], truth)
        assert set(np.unique(label)) <= {0, 1, 2, 3, 4}  # outside the volume: ignored, 4
        np.testing.assert_array_equal(sample["ignore"][0].numpy(), label == 4)
    # The same spec through the runtime path: label -> bits -> label.
    bits = pack_bits(stored, stored == 1, stored == 2, SPEC.stored())
    np.testing.assert_array_equal(unpack_bits(bits, 3)["label"], stored)
    assert np.all(bits[stored == 3] >> 4 == 3) and np.all(bits[stored == 4] >> 4 == 0)


def test_losses_of_a_multiclass_batch() -> None:
    label = torch.from_numpy(SPEC.to_stored(dataset_label(0))[None, None, :16, :16, :16])
    batch = {"label": label, "ignore": (label == 4).to(torch.uint8)}
    stored = SPEC.stored()
    onehot = torch.nn.functional.one_hot(label[:, 0].long().clamp(max=3), 4).permute(0, 4, 1, 2, 3)
    perfect = (onehot.float() * 40 - 20).requires_grad_()
    _, terms = compute_losses(perfect, batch, {"ce": 1.0, "dice": 1.0}, labels=stored)
    terms = {k: v.detach() for k, v in terms.items()}
    assert float(terms["ce"]) < 1e-6 and float(terms["dice"]) < 1e-3
    wrong = torch.roll(perfect.detach(), 1, dims=1).requires_grad_()
    worse, terms = compute_losses(wrong, batch, {"ce": 1.0, "dice": 1.0}, labels=stored)
    assert float(terms["ce"].detach()) > 10 and float(terms["dice"].detach()) > 0.9
    worse.backward()
    assert torch.all(wrong.grad[:, :, label[0, 0] == 4] == 0)  # ignored voxels: no gradient
    assert wrong.grad.abs().sum() > 0
    with pytest.raises(CtsegError, match=r"expected \(B, 4, Z, Y, X\)"):
        compute_losses(perfect[:, :1], batch, {"dice": 1.0}, labels=stored)


@pytest.mark.parametrize("term", ["bce", "cldice", "skel_recall", "boundary"])
def test_binary_only_terms_are_refused_in_one_line(term: str) -> None:
    with pytest.raises(CtsegError) as caught:
        check_terms({term: 0.5, "dice": 1.0}, labels=SPEC)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"loss term '{term}' is for one foreground class")
    assert "four/dataset.yaml has 3 (sheet, fibre, pore): use dice, ce" in message
    # A weight of 0 is never computed: not refused.
    assert term in check_terms({term: 0, "dice": 1.0, "ce": 1.0}, labels=SPEC)
    assert check_terms({term: 1.0}) == [term]  # the Kaggle spec (binary) takes it


def test_a_multiclass_dataset_trains_and_its_checkpoints_record_the_spec(
    scratch: Path, tmp_path: Path
) -> None:
    summary = run(scratch, tmp_path, multiclass_experiment())
    assert summary["steps"] == 24
    with open(tmp_path / "train/steps.csv") as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    assert len(losses) == 24 and all(np.isfinite(losses))
    # Noisy per patch, but a clear fall: the last steps' mean well under the first steps'.
    assert np.mean(losses[-6:]) < 0.8 * np.mean(losses[:6]), losses
    with open(tmp_path / "train/epochs.csv") as f:
        dice = [float(row["val_dice"]) for row in csv.DictReader(f)]
    assert all(0 <= d <= 1 for d in dice)
    for name in ("last.pt", "best.pt"):
        state = torch.load(tmp_path / name, map_location="cpu", weights_only=True)
        assert state["labels"] == SPEC.to_dict()
        assert LabelSpec.from_dict(state["labels"]) == SPEC
        assert state["model_config"]["out_channels"] == 4
        heads = [v for k, v in state["model"].items() if k.startswith("heads.0.weight")]
        assert heads[0].shape[0] == 4
    resume = torch.load(tmp_path / "state/resume.pt", map_location="cpu", weights_only=False)
    assert resume["labels"] == SPEC.to_dict()


def test_a_binary_only_term_or_one_channel_is_refused_before_training(
    scratch: Path, tmp_path: Path
) -> None:
    exp = multiclass_experiment()
    exp["loss"]["weights"] = {"dice": 1.0, "skel_recall": 1.0}
    with pytest.raises(CtsegError, match="'skel_recall' is for one foreground class"):
        run(scratch, tmp_path / "a", exp)
    exp = multiclass_experiment()
    exp["model"]["out_channels"] = 1
    with pytest.raises(CtsegError, match="need model.out_channels 4, the experiment has 1"):
        run(scratch, tmp_path / "b", exp)
    assert not (tmp_path / "a/last.pt").exists() and not (tmp_path / "b/last.pt").exists()
