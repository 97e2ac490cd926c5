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


def test_spec_is_frozen():
    with pytest.raises(AttributeError):
        KAGGLE.ignore = 3  # type: ignore[misc]
