"""ctseg.layout: the scratch formats (writer beside reader) and the targets' own parameters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from training_setup import CLIP, TRAIN_IDS, VAL_IDS, build_scratch

from ctseg.io import CtsegError
from ctseg.layout import (
    image_store,
    label_store,
    npy_header,
    open_record,
    staged_clip_distance,
    store_root,
    target_params,
    target_store,
)
from ctseg.preprocess.stage import stage_records

IDS = TRAIN_IDS + VAL_IDS


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layout")
    raw = build_scratch(root)
    zarr_copy = root / "scratch_zarr"
    stage_records(str(root / "store"), IDS, zarr_copy, fmt="zarr", workers=1)
    return {"raw": raw, "zarr": zarr_copy}


def test_results_paths_keep_each_dataset_under_its_own_root() -> None:
    a, b = store_root("mine"), store_root("theirs")
    assert image_store(a, "x") != image_store(b, "x")
    assert {image_store(a, "x"), label_store(a, "x"), target_store(a, "x")} == {
        "results/preprocessed/mine/zarr/images/x.zarr",
        "results/preprocessed/mine/zarr/labels/x.zarr",
        "results/preprocessed/mine/targets/x.zarr",
    }


def test_both_formats_read_back_the_same_record(staged: dict[str, Path]) -> None:
    raw = open_record(staged["raw"] / "a", "raw")
    other = open_record(staged["zarr"] / "a", "zarr")
    assert raw.shape == other.shape
    np.testing.assert_array_equal(np.asarray(raw.image), other.image[...])
    np.testing.assert_array_equal(np.asarray(raw.sdt), other.sdt[...])
    np.testing.assert_array_equal(raw.fg_locations, other.fg_locations)
    np.testing.assert_array_equal(raw.intensity, other.intensity)
    assert raw.params == other.params and raw.params["clip_distance"] == CLIP


def test_the_raw_writer_header_is_what_numpy_reads(tmp_path: Path) -> None:
    data = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    path = tmp_path / "x.npy"
    path.write_bytes(npy_header(data.shape, data.dtype) + data.tobytes())
    np.testing.assert_array_equal(np.load(path, mmap_mode="r"), data)


@pytest.mark.parametrize("fmt", ["raw", "zarr"])
def test_training_reads_the_clip_distance_from_the_staged_targets(
    staged: dict[str, Path], fmt: str
) -> None:
    assert target_params(staged[fmt], IDS, fmt)["clip_distance"] == CLIP
    assert staged_clip_distance(staged[fmt], IDS, fmt) == CLIP
    assert staged_clip_distance(staged[fmt], IDS, fmt, expected=CLIP) == CLIP
    with pytest.raises(CtsegError, match=r"clipped at 4.0, not 8.0.*snakemake -R targets"):
        staged_clip_distance(staged[fmt], IDS, fmt, expected=8.0)


def test_records_clipped_differently_are_refused(staged: dict[str, Path], tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    shutil.copytree(staged["raw"], scratch)
    meta_path = scratch / "b" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["targets"]["clip_distance"] = 6.0
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CtsegError, match=r"b: target parameters .* differ"):
        target_params(scratch, IDS, "raw")


def test_a_record_without_its_intensity_range_is_named(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch"
    shutil.copytree(staged["raw"] / "a", scratch / "a")
    meta_path = scratch / "a" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["p0_5"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CtsegError, match=r"a/meta.json: image attributes lack"):
        open_record(scratch / "a", "raw")
