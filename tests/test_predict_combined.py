"""A cross-validation and an ensemble predict a volume read in place, in two parts with one of
them killed and run again, and give their folder predict's mask bit for bit: each model's
probabilities are tiled exactly (`ctseg.inference.tiled`), each in its own work folder, and
their weighted mean is `ctseg.inference.ensemble.weighted_mean`'s, as in the folder path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tifffile
from conftest import BIN
from test_predict import (
    project,  # noqa: F401 (a fixture)
    write_volume,
)
from test_predict import volume as tiff_volume
from test_predict_scroll import ctseg, kill_after_a_tile, slow_tiles_env, zarr_volume

from ctseg.inference.outputs import read_record
from ctseg.inference.scroll import member_folders, work_folder_of
from ctseg.training.checkpoint import stored_digest


@pytest.mark.parametrize("run, members", [("tiny_cv.cv", 2), ("ens", 2)])
def test_a_combined_run_predicts_in_place_in_parts_as_its_folder_predict(
    project,  # noqa: F811
    tmp_path,
    run,
    members,
):
    data = tiff_volume((40, 44, 36), seed=8)
    write_volume(tmp_path / "tifs" / "v.tif", data)
    store = zarr_volume(tmp_path / "v.zarr", data, stats=False)
    where = ["--experiments-dir", project / "config" / "experiments", "--ensembles-dir",
             project / "config" / "ensembles", "--device", "cpu",
             "--memory-budget-mb", "2"]  # fmt: skip
    ctseg("predict", "--run", project / "results" / run, "-i", tmp_path / "tifs", "-o",
          tmp_path / "tif_masks", *where)  # fmt: skip
    reference = tifffile.imread(tmp_path / "tif_masks" / "v.tif")
    assert 0 < reference.sum() < reference.size
    out = tmp_path / "m.zarr"
    parts = ["predict", "--run", project / "results" / run, "-i", store, "-o", out, *where,
             "--parts", "2"]  # fmt: skip
    # Part 0 is killed once its first model has a tile done, then run again: it resumes.
    first = member_folders(work_folder_of(out), members)[0]
    kill_after_a_tile([str(BIN / "ctseg"), *map(str, parts), "--part", "0"],
                      slow_tiles_env(tmp_path), first, 0, 2)  # fmt: skip
    ctseg(*parts, "--part", "0", "--summary", tmp_path / "p0.json")
    figures = json.loads((tmp_path / "p0.json").read_text())
    assert figures["models"] == members and figures["part"]["tiles_resumed"] >= 1
    assert len(figures["part"]["models"]) == members
    ctseg(*parts, "--part", "1")
    ctseg(*parts, "--finish")
    import zarr

    np.testing.assert_array_equal(zarr.open_group(out, mode="r")["0"][...], reference)
    record = read_record(out)
    assert record["run"] == run and len(record["weights_sha256"]) == members
    weights = sorted((project / "results").glob("*/last.pt"))
    assert set(record["weights_sha256"]) <= {stored_digest(w) for w in weights}
    assert abs(sum(record["weights"]) - 1) < 1e-12
    assert not work_folder_of(out).exists()
