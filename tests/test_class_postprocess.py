"""A label map post-processed class by class (ctseg.postprocess.classes): every class at its
default is the argmax, bit for bit; a class's settings act on the voxels it wins; a voxel two
classes claim goes to the more probable; block by block gives the whole volume's bits; settings
of other classes, or binary ones, are refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ctseg.io import CtsegError
from ctseg.labels import LabelSpec
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
