"""The multiclass demo: Kaggle layout plus dataset.yaml, the spec's values only, every class in
every training volume, determinism, and classes a model can tell apart by intensity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tifffile

from ctseg.io import CtsegError, sha256_file
from ctseg.labels import load_dataset_spec
from ctseg.preprocess.demo_data import demo_records
from ctseg.preprocess.demo_multiclass import (
    IGNORE_FRACTION,
    NOISE_SIGMA,
    SPEC,
    synthesize_multiclass,
    write_multiclass_demo,
)
from ctseg.records import read_records

SHAPE = (40, 48, 56)  # not a cube, so swapped axes would show
N_TRAIN, N_TEST = 3, 2


def _write(out: Path, seed: int = 0) -> Path:
    write_multiclass_demo(
        out, n_train=N_TRAIN, n_test=N_TEST, shape=SHAPE, scroll_ids=[7, 9], seed=seed
    )
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("multiclass"))


def _pairs(demo: Path, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
    return [
        (tifffile.imread(path), tifffile.imread(demo / f"{split}_labels" / path.name))
        for path in sorted((demo / f"{split}_images").glob("*.tif"))
    ]


def test_layout_and_records(demo: Path) -> None:
    expected = {"dataset.yaml", "train.csv", "test.csv"}
    for r in demo_records(N_TRAIN, N_TEST, [7, 9]):
        expected |= {f"{r['split']}_images/{r['id']}.tif", f"{r['split']}_labels/{r['id']}.tif"}
    # Exact equality also proves no temporary sibling was left behind.
    assert {str(p.relative_to(demo)) for p in demo.rglob("*") if p.is_file()} == expected
    records = read_records(demo)
    assert records["split"].value_counts().to_dict() == {"train": N_TRAIN, "test": N_TEST}
    assert sorted(records["scroll_id"].unique()) == ["7", "9"]
    # Test labels are written too, as the binary demo does, so predictions can be scored.
    assert all(Path(p).is_file() for p in [*records["image"], *records["label"]])


def test_dataset_yaml_declares_three_classes_and_ignore(demo: Path) -> None:
    spec = load_dataset_spec(demo)
    assert dict(spec.labels.labels) == {"background": 0, "sheet": 10, "fibre": 20, "pore": 30}
    assert spec.labels.classes == ("sheet", "fibre", "pore")
    assert spec.labels.ignore == 255
    assert spec.spacing is None
    assert spec.labels == SPEC


def test_only_spec_values_and_every_class_in_every_training_volume(demo: Path) -> None:
    for split in ("train", "test"):
        for image, label in _pairs(demo, split):
            assert image.shape == label.shape == SHAPE
            assert image.dtype == label.dtype == np.uint8
            present = set(np.unique(label).tolist())
            assert present <= set(SPEC.valid_values), (split, present)
            if split == "train":
                assert present == set(SPEC.valid_values), present


def test_deterministic_for_a_seed(demo: Path, tmp_path: Path) -> None:
    again = _write(tmp_path / "again")
    other = _write(tmp_path / "other", seed=1)
    files = sorted(p.relative_to(demo) for p in demo.rglob("*.tif"))
    assert files
    for rel in files:
        assert sha256_file(demo / rel) == sha256_file(again / rel), rel
    assert any(sha256_file(demo / rel) != sha256_file(other / rel) for rel in files)


def test_classes_separable_by_intensity(demo: Path) -> None:
    for image, label in _pairs(demo, "train"):
        background = image[label == SPEC.background]
        noise = max(NOISE_SIGMA, float(background.std()))
        means = sorted(
            float(image[label == value].mean())
            for value in (SPEC.background, *SPEC.foreground_values)
        )
        gaps = np.diff(means)
        assert (gaps > noise).all(), (means, noise)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ignore_is_one_slab_at_a_face(seed: int) -> None:
    volume = synthesize_multiclass(SHAPE, np.random.default_rng([seed, 5]))
    assert volume.ignore_axis != volume.sheet_axis
    index = [slice(None)] * 3
    index[volume.ignore_axis] = volume.ignore_slab
    slab = np.zeros(SHAPE, bool)
    slab[tuple(index)] = True
    np.testing.assert_array_equal(SPEC.ignored(volume.label), slab)
    side = SHAPE[volume.ignore_axis]
    assert volume.ignore_slab.start == 0 or volume.ignore_slab.stop == side
    width = volume.ignore_slab.stop - volume.ignore_slab.start
    assert IGNORE_FRACTION[0] * side - 1 <= width <= IGNORE_FRACTION[1] * side + 1
    # The slab's image still shows structures: brighter and darker than the background.
    assert volume.image[slab].std() > volume.image[volume.label == SPEC.background].std()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(CtsegError, match="shape"):
        write_multiclass_demo(tmp_path, shape=(8, 96, 96))
    with pytest.raises(CtsegError, match="seed"):
        write_multiclass_demo(tmp_path, seed=-1)
    assert not any(tmp_path.iterdir())
