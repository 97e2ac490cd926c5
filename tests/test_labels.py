"""ctseg.labels: dataset.yaml's label spec and spacing, their one-line errors, the Kaggle
default and the masks the spec gives in place of literal label values."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ctseg.io import CtsegError
from ctseg.labels import KAGGLE, DatasetSpec, LabelSpec, load_dataset_spec


def write_spec(tmp_path: Path, text: str) -> Path:
    (tmp_path / "dataset.yaml").write_text(text)
    return tmp_path


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(CtsegError) as err:
        load_dataset_spec(write_spec(tmp_path, text))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'dataset.yaml'}")
    return message


def test_good_file(tmp_path):
    spec = load_dataset_spec(
        write_spec(
            tmp_path,
            "labels: {background: 0, sheet: 3, surface: 1}\nignore: 7\n"
            "regions: {papyrus: [sheet, 1], top: 3}\nspacing: [2, 1.0, 0.5]\n",
        )
    )
    labels = spec.labels
    assert list(labels.labels) == ["background", "surface", "sheet"]  # value order
    assert labels.background == 0
    assert labels.ignore == 7
    assert labels.classes == ("surface", "sheet")
    assert labels.foreground_values == (1, 3)
    assert not labels.is_binary
    assert labels.valid_values == (0, 1, 3, 7)
    assert labels.regions == {"papyrus": ("surface", "sheet"), "top": ("sheet",)}
    assert labels.region_values("papyrus") == (1, 3)
    assert spec.spacing == (2.0, 1.0, 0.5)
    assert labels.source == str(tmp_path / "dataset.yaml")
    lab = np.array([0, 1, 3, 7, 1])
    assert labels.foreground(lab).tolist() == [False, True, True, False, True]
    assert labels.ignored(lab).tolist() == [False, False, False, True, False]
    assert labels.in_region(lab, "top").tolist() == [False, False, True, False, False]
    with pytest.raises(CtsegError, match="2 foreground labels"):
        _ = labels.foreground_value


def test_defaults_without_file(tmp_path):
    spec = load_dataset_spec(tmp_path)
    assert spec == DatasetSpec(KAGGLE, None)
    assert spec.labels.labels == {"background": 0, "surface": 1}
    assert spec.labels.ignore == 2
    assert spec.labels.is_binary and spec.labels.foreground_value == 1
    assert spec.labels.classes == ("surface",)
    assert spec.labels.valid_values == (0, 1, 2)
    assert spec.labels.describe() == "0 background, 1 surface, 2 unlabelled"


def test_round_trip(tmp_path):
    spec = load_dataset_spec(
        write_spec(
            tmp_path,
            "labels: {background: 0, surface: 1, sheet: 2}\nignore: 255\n"
            "regions: {all: [surface, sheet]}\nspacing: [1, 2, 3]\n",
        )
    )
    again = DatasetSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    assert hash(again.labels) == hash(spec.labels)
    kaggle = DatasetSpec.from_dict(json.loads(json.dumps(DatasetSpec().to_dict())))
    assert kaggle == DatasetSpec(KAGGLE, None)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("- 1\n", r"expected a mapping with labels .*found list"),
        ("ignore: 2\n", r": labels: missing; give e\.g\. labels: \{background: 0, surface: 1\}"),
        ("labels: [0, 1]\n", r": labels: expected a mapping of name: value"),
        ("labels: {surface: 1}\n", r": labels: background must be 0 \(found none\)"),
        ("labels: {background: 1, surface: 0}\n", r": labels: background must be 0 \(found 1\)"),
        ("labels: {background: 0}\n", r": labels: only background; give at least one"),
        ("labels: {background: 0, a: 1, b: 1}\n", r": labels: a and b both have the value 1"),
        ("labels: {background: 0, a: x}\n", r": labels\.a: 'x' is not an integer"),
        ("labels: {background: 0, a: true}\n", r": labels\.a: True is not an integer"),
        ("labels: {background: 0, a: 256}\n", r": labels\.a: 256 is outside 0\.\.255"),
        ("labels: {background: 0, 1: 1}\n", r": labels: label name 1 is not text"),
        (
            "labels: {background: 0, surface: 1, ignore: 2}\n",
            r": labels\.ignore: the ignored value is a key of its own; .*`ignore: 2`",
        ),
        (
            "labels: {background: 0, surface: 1}\nignore: 1\n",
            r": ignore: 1 is also the value of label surface",
        ),
        ("labels: {background: 0, surface: 1}\nignore: -1\n", r": ignore: -1 is outside 0\.\.255"),
        (
            "labels: {background: 0, surface: 1}\nregions: {r: [surfac]}\n",
            r": regions\.r: unknown label 'surfac'; did you mean surface\?",
        ),
        (
            "labels: {background: 0, surface: 1}\nregions: {r: [zzz]}\n",
            r": regions\.r: unknown label 'zzz'; labels are background, surface",
        ),
        (
            "labels: {background: 0, surface: 1}\nregions: {r: [5]}\n",
            r": regions\.r: no label has the value 5",
        ),
        (
            "labels: {background: 0, surface: 1}\nregions: {r: []}\n",
            r": regions\.r: expected a non-empty list",
        ),
        (
            "labels: {background: 0, surface: 1}\nregions: {r: [background]}\n",
            r": regions\.r: background cannot be part of a region",
        ),
        ("labels: {background: 0, surface: 1}\nregions: [a]\n", r": regions: expected a mapping"),
        ("labels: {background: 0, surface: 1}\nspacing: [1, 1]\n", r": spacing: expected 3 pos"),
        ("labels: {background: 0, surface: 1}\nspacing: [1, 0, 1]\n", r": spacing: expected 3"),
        ("labels: {background: 0, surface: 1}\nspacing: [1, -2, 1]\n", r": spacing: expected"),
        ("labels: {background: 0, surface: 1}\nspacing: [1, a, 1]\n", r": spacing: expected"),
        ("labels: {background: 0, surface: 1}\nspacing: 1.0\n", r": spacing: expected 3"),
        ("labels: {background: 0, surface: 1}\nspacing: [1, .nan, 1]\n", r": spacing: expected"),
        (
            "labels: {background: 0, surface: 1}\nspasing: [1, 1, 1]\n",
            r": spasing: unknown key; did you mean spacing\?$",
        ),
        (
            "labels: {background: 0, surface: 1}\nignroe: 2\nzzz: 1\n",
            r": ignroe: unknown key; did you mean ignore\? \(also unknown: zzz\)$",
        ),
        (
            "labels: {background: 0, surface: 1}\nqqqq: 2\n",
            r": qqqq: unknown key; it takes labels, ignore, regions, spacing$",
        ),
        ("labels: {background: 0, surface: 1}\nlabels: {background: 0}\n", r"appears twice"),
    ],
)
def test_bad_fields(tmp_path, text, pattern):
    assert re.search(pattern, error_of(tmp_path, text))


def test_check_values(tmp_path):
    KAGGLE.check_values(np.array([0, 1, 2, 2]), "x.tif")
    KAGGLE.check_values([], "x.tif")
    with pytest.raises(CtsegError) as err:
        KAGGLE.check_values(np.array([0, 3, 7, 1]), "a/x.tif")
    assert str(err.value) == (
        "a/x.tif: label values outside 0/1/2: [3, 7] (0 background, 1 surface, 2 unlabelled); "
        "fix the volume, or declare the values in the dataset's dataset.yaml (without one: "
        "0 background, 1 surface, 2 unlabelled)"
    )
    spec = load_dataset_spec(write_spec(tmp_path, "labels: {background: 0, surface: 5}\n"))
    with pytest.raises(CtsegError) as err:
        spec.labels.check_values({0, 1, 5}, "y.tif", fix="re-export it")
    assert str(err.value) == (
        "y.tif: label values outside 0/5: [1] (0 background, 5 surface); re-export it"
    )
    with pytest.raises(CtsegError, match=re.escape(str(tmp_path / "dataset.yaml"))):
        spec.labels.check_values([2], "y.tif")


def test_kaggle_masks_reproduce_the_literals():
    rng = np.random.default_rng(0)
    label = rng.integers(0, 3, size=(5, 6, 7)).astype(np.uint8)
    np.testing.assert_array_equal(KAGGLE.foreground(label), label == 1)
    np.testing.assert_array_equal(KAGGLE.ignored(label), label == 2)
    np.testing.assert_array_equal(~KAGGLE.ignored(label), label != 2)
    assert KAGGLE.foreground(label).dtype == bool
    t = torch.from_numpy(label)
    assert torch.equal(KAGGLE.foreground(t), t == 1)
    assert torch.equal(KAGGLE.ignored(t), t == 2)
    no_ignore = LabelSpec({"background": 0, "surface": 1})
    assert not no_ignore.ignored(label).any() and no_ignore.ignored(label).shape == label.shape
    assert no_ignore.ignored(t).dtype == torch.bool and not no_ignore.ignored(t).any()
    assert no_ignore.valid_values == (0, 1)


FOUR = LabelSpec(
    {"background": 0, "pore": 30, "sheet": 10, "fibre": 20}, ignore=255, source="four.yaml"
)


def test_stored_spec():
    assert KAGGLE.stored() == KAGGLE
    assert KAGGLE.n_classes == 1 and KAGGLE.out_channels == 1
    stored = FOUR.stored()
    assert dict(stored.labels) == {"background": 0, "sheet": 1, "fibre": 2, "pore": 3}
    assert stored.ignore == 4 and stored.classes == ("sheet", "fibre", "pore")
    assert FOUR.n_classes == 3 and FOUR.out_channels == 4
    assert stored.stored() == stored
    no_ignore = LabelSpec({"background": 0, "a": 7, "b": 3})
    assert no_ignore.stored().ignore is None
    assert dict(no_ignore.stored().labels) == {"background": 0, "b": 1, "a": 2}
    regions = LabelSpec({"background": 0, "a": 7, "b": 3}, regions={"r": ["a"]})
    assert regions.stored().region_values("r") == (2,)


def test_to_and_from_stored():
    values = np.array([[0, 10, 20], [30, 255, 0]], dtype=np.uint8)
    stored = FOUR.to_stored(values)
    assert stored.dtype == np.uint8
    np.testing.assert_array_equal(stored, [[0, 1, 2], [3, 4, 0]])
    np.testing.assert_array_equal(FOUR.from_stored(stored), values)
    rng = np.random.default_rng(1)
    kaggle = rng.integers(0, 3, size=(4, 5, 6)).astype(np.uint8)
    assert KAGGLE.to_stored(kaggle).tobytes() == kaggle.tobytes()
    assert KAGGLE.from_stored(kaggle).tobytes() == kaggle.tobytes()
    np.testing.assert_array_equal(FOUR.to_stored(values.astype(np.int64)), stored)


@pytest.mark.parametrize(
    ("call", "bad", "pattern"),
    [
        ("to_stored", [0, 5], r"^v\.tif: label values outside 0/10/20/30/255: \[5\] .*four\.yaml$"),
        ("from_stored", [0, 7], r"^v\.tif: label values outside 0/1/2/3/4: \[7\] .*four\.yaml"),
        ("to_stored", [0, 300], r"^v\.tif: label values outside 0/10/20/30/255: \[300\]"),
        ("to_stored", [0.5], r"^v\.tif: label values of type float64; .*uint8$"),
    ],
)
def test_unknown_values_are_refused(call, bad, pattern):
    with pytest.raises(CtsegError) as err:
        getattr(FOUR, call)(np.array(bad), "v.tif")
    assert "\n" not in str(err.value)
    assert re.search(pattern, str(err.value))


def test_spec_is_frozen():
    with pytest.raises(AttributeError):
        KAGGLE.ignore = 3  # type: ignore[misc]


# ------------------------------------------------------------------ spacing in the targets


def sheet_volume(axis: int, shape=(12, 10, 9), at: int = 5) -> np.ndarray:
    """A one-voxel plane of surface (1) across `axis`, background (0) elsewhere."""
    label = np.zeros(shape, np.uint8)
    index = [slice(None)] * 3
    index[axis] = at
    label[tuple(index)] = 1
    return label


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_sdt_spacing_against_hand_computed(axis):
    from ctseg.preprocess.targets import _signed_distance, targets_reference

    spacing = (2.0, 0.5, 1.5)
    clip = 4.0
    label = sheet_volume(axis)
    steps = np.abs(np.arange(label.shape[axis]) - 5) * spacing[axis]
    # Outside: the distance to the plane along `axis`; inside: one step off the plane.
    expected = np.where(steps == 0, -spacing[axis], np.minimum(steps, clip))
    shape = [1, 1, 1]
    shape[axis] = -1
    expected = np.broadcast_to(expected.reshape(shape), label.shape).astype(np.float16)
    got = targets_reference(label, clip_distance=clip, spacing=spacing)["sdt"]
    np.testing.assert_array_equal(got, expected)
    fg = (label == 1).astype(np.uint8)
    np.testing.assert_array_equal(_signed_distance(fg, clip, spacing=spacing), expected)


def test_sdt_spacing_against_brute_force():
    """Every voxel's clipped signed distance with spacing (2, 1, 0.5), against the minimum over
    all voxels of the other class of the anisotropic Euclidean distance, computed pair by pair."""
    from ctseg.preprocess.targets import _signed_distance, targets_reference

    rng = np.random.default_rng(3)
    label = (rng.random((6, 9, 10)) > 0.8).astype(np.uint8)
    spacing = np.array([2.0, 1.0, 0.5])
    clip = 3.0
    points = np.argwhere(np.ones(label.shape, bool)) * spacing
    fg = label.ravel() == 1
    gaps = np.sqrt(((points[:, None, :] - points[None, :, :]) ** 2).sum(-1))
    nearest_bg = np.where(~fg[None, :], gaps, np.inf).min(axis=1)
    nearest_fg = np.where(fg[None, :], gaps, np.inf).min(axis=1)
    expected = np.where(fg, -np.minimum(nearest_bg, clip), np.minimum(nearest_fg, clip))
    expected = expected.reshape(label.shape).astype(np.float16)
    got = targets_reference(label, clip_distance=clip, spacing=tuple(spacing))["sdt"]
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(_signed_distance(label, clip, spacing=tuple(spacing)), expected)


def test_default_spacing_is_todays_output():
    from ctseg.preprocess.targets import targets_reference

    rng = np.random.default_rng(5)
    label = rng.integers(0, 3, size=(10, 12, 11)).astype(np.uint8)
    for key, value in targets_reference(label, clip_distance=3.0).items():
        np.testing.assert_array_equal(
            value, targets_reference(label, clip_distance=3.0, spacing=(1, 1, 1))[key]
        )


@pytest.mark.parametrize("method", ["distance_ridge", "medial_surface_fast"])
def test_blockwise_spacing_equals_reference(tmp_path, method):
    """The blockwise path with spacing (its halo widened to ceil(d / min spacing)) equals the
    whole-volume reference, and a spec with other values gives the same targets."""
    import zarr

    from ctseg.preprocess.targets import compute_targets, targets_reference
    from ctseg.store import create_volume

    rng = np.random.default_rng(7)
    label = np.where(rng.random((24, 20, 22)) > 0.9, 1, 0).astype(np.uint8)
    label[rng.random(label.shape) > 0.8] = 2
    spacing = (2.5, 1.0, 0.5)
    ref = targets_reference(label, clip_distance=3.0, skeleton_method=method, spacing=spacing)
    other = LabelSpec({"background": 0, "surface": 7}, ignore=9)
    relabelled = np.choose(label, np.array([0, 7, 9], np.uint8))
    for spec, values in ((KAGGLE, label), (other, relabelled)):
        store = tmp_path / f"label-{spec.foreground_value}.zarr"
        create_volume(store, values.shape, values.dtype, (8, 8, 8))[...] = values
        dest = tmp_path / f"targets-{method}-{spec.foreground_value}.zarr"
        compute_targets(
            store,
            dest,
            clip_distance=3.0,
            skeleton_method=method,
            block_shape=(8, 8, 8),
            spacing=spacing,
            labels=spec,
        )
        group = zarr.open_group(str(dest), mode="r")
        for name in ("sdt", "ignore", "foreground", "skeleton", "tube"):
            np.testing.assert_array_equal(group[name][...], ref[name], err_msg=name)
