"""A label map post-processed class by class (ctseg.postprocess.classes): every class at its
default is the argmax, bit for bit; a class's settings act on the voxels it wins; a voxel two
classes claim goes to the more probable; block by block gives the whole volume's bits; settings
of other classes, or binary ones, are refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile
import zarr

from ctseg.io import CtsegError
from ctseg.labels import LabelSpec
from ctseg.postprocess import tuning
from ctseg.postprocess.classes import (
    ARGMAX,
    ClassSettings,
    binary_settings,
    blockwise_class_masks,
    class_label_map,
    class_probability,
    join,
    join_block,
    label_map_settings,
    pointwise_label_map,
)
from ctseg.postprocess.masks import PostprocessSettings, binary_mask
from ctseg.postprocess.write import CLASSES_ATTRIBUTE, LABELS_ATTRIBUTE, channel_names, write_mask
from ctseg.store import create_volume

LABELS = LabelSpec(labels={"background": 0, "vessel": 4, "nerve": 8}, ignore=200)
SHAPE = (14, 13, 11)


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=0))
    return (e / e.sum(axis=0)).astype(np.float16)


def structures(seed: int = 0) -> np.ndarray:
    """Class probabilities with blobs of each class, small specks, holes and noise."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1.0, (3, *SHAPE)).astype(np.float32)
    logits[0] += 2  # mostly background, with noise that wins here and there
    logits[1, 2:9, 2:9, 2:9] += 4  # a vessel block ...
    logits[1, 5, 5, 5] -= 8  # ... with a cavity
    logits[2, 3:12, 8:11, 1:10] += 4  # a nerve slab next to it
    logits[0, 11:14, 0:3, 0:3] += 6  # background around ...
    logits[1, 12, 1, 1] += 12  # ... a vessel speck
    return softmax(logits)


def test_every_class_at_its_default_is_the_argmax_bit_for_bit() -> None:
    probs = structures()
    ties = probs.copy()
    ties[:, 0] = np.float16(1 / 3)  # a slice where every channel ties: background
    ties[1, 1] = ties[2, 1] = np.float16(0.5)  # and one where two classes tie: the first
    ties[0, 1] = 0
    settings = ClassSettings.argmax(LABELS)
    assert settings.is_argmax and settings.label() == "argmax"
    for p in (probs, ties):
        argmax = np.argmax(p, axis=0).astype(np.uint8)
        np.testing.assert_array_equal(pointwise_label_map(p, settings), argmax)
        np.testing.assert_array_equal(class_label_map(p, settings)[0], argmax)


def test_a_class_setting_acts_on_the_voxels_the_class_wins() -> None:
    probs = structures()
    argmax = np.argmax(probs, axis=0)
    vessel = PostprocessSettings(threshold=0.0, min_component_voxels=4, fill_holes=True)
    settings = ClassSettings((("vessel", vessel), ("nerve", ARGMAX)))
    assert settings.label() == "vessel: t>0 min 4 fill"
    stored, steps = class_label_map(probs, settings)
    expected, counts = binary_mask(class_probability(probs, 1), vessel)
    assert steps["vessel"] == counts and counts["removed_voxels"] > 0
    assert counts["filled_voxels"] > 0
    assert stored[12, 1, 1] == 0 and argmax[12, 1, 1] == 1  # the speck is background now
    assert stored[5, 5, 5] == 1 and argmax[5, 5, 5] != 1  # the cavity is vessel
    np.testing.assert_array_equal(stored == 2, argmax == 2)  # nerve: its argmax, untouched
    np.testing.assert_array_equal(stored == 1, expected.astype(bool) & (argmax != 2))


def test_a_voxel_two_classes_claim_goes_to_the_more_probable() -> None:
    probs = np.zeros((3, 1, 1, 4), np.float16)
    probs[:, 0, 0] = [[0.2, 0.5, 0.3, 0.4], [0.5, 0.3, 0.3, 0.3], [0.3, 0.2, 0.4, 0.3]]
    both = np.ones((1, 1, 4), bool)
    # vessel 0.5 > nerve 0.3; 0.3 > 0.2; 0.3 < 0.4; a tie: the earlier class
    np.testing.assert_array_equal(join(probs, [both, both])[0, 0], [1, 1, 2, 1])
    np.testing.assert_array_equal(join(probs, [both, ~both])[0, 0], [1, 1, 1, 1])
    np.testing.assert_array_equal(join(probs, [~both, ~both])[0, 0], [0, 0, 0, 0])


@pytest.mark.parametrize("block", [(4, 4, 4), (5, 13, 3), (14, 13, 11)])
def test_block_by_block_is_the_whole_volume_s_label_map(tmp_path: Path, block) -> None:
    probs = structures(1)
    vessel = PostprocessSettings(0.0, None, 4, fill_holes=True, closing_radius=1)
    nerve = PostprocessSettings(0.5, 0.8, plug_holes_max_area=4)
    settings = ClassSettings((("vessel", vessel), ("nerve", nerve)))
    whole, steps = class_label_map(probs, settings)
    masks, block_steps = blockwise_class_masks(probs, settings, block, tmp_path)
    assert block_steps == steps
    out = np.full(SHAPE, 99, np.uint8)
    for z in range(0, SHAPE[0], block[0]):
        for y in range(0, SHAPE[1], block[1]):
            for x in range(0, SHAPE[2], block[2]):
                box = (slice(z, z + block[0]), slice(y, y + block[1]), slice(x, x + block[2]))
                out[box] = join_block(probs[(slice(None), *box)], settings, masks, box)
    np.testing.assert_array_equal(out, whole)
    assert not np.array_equal(whole, np.argmax(probs, axis=0))


def test_a_threshold_alone_is_pointwise() -> None:
    probs = structures(2)
    settings = ClassSettings((("vessel", PostprocessSettings(threshold=0.7)), ("nerve", ARGMAX)))
    assert not settings.whole_volume
    stored = pointwise_label_map(probs, settings)
    np.testing.assert_array_equal(stored, class_label_map(probs, settings)[0])
    argmax = np.argmax(probs, axis=0)
    np.testing.assert_array_equal(stored == 1, (argmax == 1) & (probs[1] > 0.7))


def test_settings_of_other_classes_or_binary_ones_are_refused() -> None:
    assert label_map_settings(PostprocessSettings(), LABELS, "s.zarr").is_argmax
    with pytest.raises(CtsegError, match=r"s\.zarr: multi-class .* t>0\.3 .* per-class"):
        label_map_settings(PostprocessSettings(threshold=0.3), LABELS, "s.zarr")
    other = ClassSettings((("nerve", ARGMAX), ("vessel", ARGMAX)))
    with pytest.raises(CtsegError, match=r"s\.zarr: per-class settings for the classes"):
        label_map_settings(other, LABELS, "s.zarr")
    with pytest.raises(CtsegError, match=r"b\.zarr: binary probabilities, but per-class"):
        binary_settings(ClassSettings.argmax(LABELS), "b.zarr")
    tuned = ClassSettings((("vessel", PostprocessSettings(0.2, None, 8, True)), ("nerve", ARGMAX)))
    assert ClassSettings.from_mapping(tuned.as_dict(), "t.json") == tuned
    for bad in ({"vessel": {}}, {"classes": {}}, {"classes": {"vessel": {"threshold": 2}}}):
        with pytest.raises(CtsegError, match=r"t\.json"):
            ClassSettings.from_mapping(bad, "t.json")


# --------------------------------------------------------------------------- tuned per class
def class_case(directory: Path, name: str, seed: int) -> tuning.Volume:
    """A multi-class store and its label store (stored values): a vessel block and a nerve
    slab, each won by its class, plus vessel specks that no threshold of the argmax removes (they
    are as sure as the block), and an ignored slab."""
    rng = np.random.default_rng(seed)
    label = np.zeros((28, 28, 28), np.uint8)
    label[4:16, 4:16, 4:16] = 1
    label[20:24, 2:26, 2:26] = 2
    label[:, :, 26:] = 3  # ignored (stored K + 1)
    logits = rng.normal(0, 0.3, (3, *label.shape)).astype(np.float32)
    logits[0] += 2
    logits[1][label == 1] += 4
    logits[2][label == 2] += 4
    for z, y, x in [(2, 22, 4), (10, 22, 20), (17, 6, 22)]:
        logits[1, z, y, x : x + 2] += 8  # a two-voxel vessel speck
    store = directory / f"{name}.zarr"
    arr = zarr.create_array(store, shape=logits.shape, chunks=(3, 14, 14, 14), dtype=np.float16)
    arr[...] = softmax(logits)
    arr.attrs.update({LABELS_ATTRIBUTE: LABELS.to_dict(), CLASSES_ATTRIBUTE: channel_names(LABELS)})
    label_store = directory / f"{name}_label.zarr"
    create_volume(label_store, label.shape, np.uint8, (14, 14, 14))[...] = label
    return tuning.Volume(name, store, label_store)


def test_each_class_is_tuned_on_its_own_label_and_the_choice_applies(tmp_path: Path) -> None:
    volume = class_case(tmp_path, "v1", 0)
    space = tuning.SearchSpace(
        thresholds=(0.5,), refine_step=0, hysteresis_offsets=(), min_component_voxels=(8,),
        fill_holes=False, **tuning.WINNERS_STAGES_OFF,
    )  # fmt: skip
    summary = tuning.tune_postprocess([volume], tmp_path / "tuned", space)
    vessel, nerve = summary["classes"]["vessel"], summary["classes"]["nerve"]
    # Each from the argmax, scored against its own class's voxels of the label.
    assert vessel["default"]["settings"] == ARGMAX.as_dict() == nerve["default"]["settings"]
    assert vessel["foreground_voxels"] == {"v1": 12 * 12 * 12}
    assert nerve["foreground_voxels"] == {"v1": 4 * 24 * 24}
    assert vessel["tuned"] and vessel["settings"]["min_component_voxels"] == 8
    assert vessel["gain_over_default"] > tuning.MIN_GAIN
    assert summary["tuned"] and summary["label"].startswith("vessel: t>0 min 8")
    table = pd.read_csv(tmp_path / "tuned" / "candidates.csv")
    assert list(table.columns)[0] == "class" and set(table["class"]) == {"vessel", "nerve"}
    assert table.groupby("class")["chosen"].sum().to_dict() == {"nerve": 1, "vessel": 1}

    settings = tuning.load_tuned(tmp_path / "tuned" / "tuned.json")
    assert isinstance(settings, ClassSettings) and settings.names == LABELS.classes
    info = write_mask(volume.probabilities, tmp_path / "m.tif", settings)
    written = LABELS.to_stored(tifffile.imread(tmp_path / "m.tif"))
    probs = np.asarray(zarr.open_array(volume.probabilities)[...])
    np.testing.assert_array_equal(written, class_label_map(probs, settings)[0])
    argmax = np.argmax(probs, axis=0)
    assert argmax[2, 22, 4] == 1 and written[2, 22, 4] == 0  # the speck is gone
    assert info["class_steps"]["vessel"]["removed_voxels"] == 6
    assert info["class_settings"] == settings.as_dict()["classes"]
