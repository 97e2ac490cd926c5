"""ctseg.inference.ensemble: the ensemble file's checks, the streamed weighted mean, and tuned
weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tifffile
import yaml

from ctseg.cli import main
from ctseg.config import load_ensemble
from ctseg.inference.ensemble import (
    BYTES_PER_VOXEL,
    ensemble_volume,
    load_weights,
    slab_depth,
    tune_weights,
    weight_grid,
)
from ctseg.io import CtsegError
from ctseg.store import create_volume, open_volume

REPO = Path(__file__).resolve().parents[1]
# What ctseg.inference.run.infer_volume records (tests/test_infer.py checks infer writes these).
INFER_ATTRS = {
    "source": "results/preprocessed/demo/zarr/images/a.zarr",
    "window": [8, 16, 16],
    "overlap": 0.5,
    "tta_flips": False,
    "blending": "gaussian sigma=window*0.125",
    "value": "foreground probability (sigmoid)",
}
SHAPE = (20, 16, 16)


def write_probs(path: Path, values: np.ndarray, chunks=(4, 16, 16), **attrs) -> Path:
    store = create_volume(
        path, values.shape, np.float16, chunks, attributes={**INFER_ATTRS, **attrs}
    )
    store[...] = values.astype(np.float16)
    return path


def read(path: Path) -> np.ndarray:
    return np.asarray(open_volume(path)[...])


@pytest.fixture
def probs(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    a = write_probs(tmp_path / "a" / "v.zarr", rng.random(SHAPE))
    b = write_probs(tmp_path / "b" / "v.zarr", rng.random(SHAPE))
    return a, b


# ----------------------------------------------------------------------------- the mean
def test_members_that_are_the_same_equal_them_and_are_streamed(probs, tmp_path):
    a, _ = probs
    out = tmp_path / "ens" / "v.zarr"
    # Room for 6 planes of 16 x 16: rounded down to one 4-plane chunk per slab, so 5 slabs.
    budget = 6 * BYTES_PER_VOXEL * 16 * 16 / 2**20
    info = ensemble_volume([a, a, a], [1, 1, 1], out, memory_budget_mb=budget)
    assert (info["slab_depth"], info["slabs"]) == (4, 5)
    got, want = read(out), read(a)
    assert got.dtype == np.float16
    # Within float16 rounding: at most one float16 step apart.
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=0, atol=2**-11)
    attrs = dict(open_volume(out).attrs)
    assert {k: attrs[k] for k in INFER_ATTRS} == INFER_ATTRS
    assert attrs["ensemble"]["weights"] == pytest.approx([1 / 3] * 3)


def test_weights_one_zero_reproduce_the_first_member_exactly(probs, tmp_path):
    a, b = probs
    out = tmp_path / "ens" / "v.zarr"
    rc = main(["ensemble", "--members", str(a), str(b), "--weights", "1", "0", "--out", str(out)])
    assert rc == 0
    assert np.array_equal(read(out), read(a))
    assert not np.array_equal(read(out), read(b))


def test_the_mean_is_weighted_and_postprocess_reads_it(probs, tmp_path):
    from ctseg.postprocess.masks import PostprocessSettings
    from ctseg.postprocess.write import write_mask

    a, b = probs
    out = tmp_path / "ens" / "v.zarr"
    ensemble_volume([a, b], [3, 1], out, memory_budget_mb=0.001)  # one plane at a time
    want = (0.75 * read(a).astype(np.float32) + 0.25 * read(b).astype(np.float32)).astype(
        np.float16
    )
    np.testing.assert_allclose(read(out).astype(np.float32), want.astype(np.float32), atol=2**-11)
    tif = tmp_path / "mask.tif"
    write_mask(out, tif, PostprocessSettings(threshold=0.5))
    assert np.array_equal(tifffile.imread(tif), (read(out) > 0.5).astype(np.uint8))


def test_slab_depth_stays_under_the_budget():
    plane_mb = BYTES_PER_VOXEL * 100 * 100 / 2**20
    assert slab_depth((64, 100, 100), 8, 20 * plane_mb) == 16  # whole chunks
    assert slab_depth((64, 100, 100), 8, 5 * plane_mb) == 5  # less than a chunk fits
    assert slab_depth((64, 100, 100), 8, 1e-9) == 1
    assert slab_depth((10, 100, 100), 8, 1000 * plane_mb) == 10


@pytest.mark.parametrize(
    "other, problem",
    [
        ({"shape": (20, 16, 15)}, "shape"),
        ({"window": [8, 8, 8]}, "window"),
        ({"overlap": 0.25}, "overlap"),
        ({"tta_flips": True}, "tta_flips"),
    ],
)
def test_members_that_disagree_are_an_error_naming_both(probs, tmp_path, other, problem):
    a, _ = probs
    shape = other.pop("shape", SHAPE)
    c = write_probs(tmp_path / "c" / "v.zarr", np.zeros(shape), **other)
    out = tmp_path / "ens" / "v.zarr"
    with pytest.raises(CtsegError) as err:
        ensemble_volume([a, c], [1, 1], out)
    msg = str(err.value)
    assert str(a) in msg and str(c) in msg and problem in msg and "\n" not in msg
    assert not out.exists()


def test_a_store_not_written_by_infer_is_an_error(tmp_path, probs):
    a, _ = probs
    bare = create_volume(tmp_path / "bare.zarr", SHAPE, np.float16, (4, 16, 16))
    bare[...] = 0
    with pytest.raises(CtsegError, match="bare.zarr: no window"):
        ensemble_volume([a, tmp_path / "bare.zarr"], [1, 1], tmp_path / "o.zarr")
    with pytest.raises(CtsegError, match="missing.zarr: probability store not found"):
        ensemble_volume([a, tmp_path / "missing.zarr"], [1, 1], tmp_path / "o.zarr")


@pytest.mark.parametrize(
    "weights, problem",
    [(["-1", "2"], "negative weight"), (["0", "0"], "all zero"), (["1"], "1 weights for 2")],
)
def test_bad_weights_on_the_command_line(probs, tmp_path, capsys, weights, problem):
    a, b = probs
    out = tmp_path / "o.zarr"
    rc = main(["ensemble", "--members", str(a), str(b), "--weights", *weights, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and problem in err and "--weights" in err and "\n" not in err
    assert not out.exists()


# ----------------------------------------------------------------------------- the file
KNOWN = {"exp001": None, "exp002": None, "cv": 2}


def ensemble_file(tmp_path: Path, name: str = "ens", **data) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, **data}))
    return path


def test_a_good_file_loads(tmp_path):
    ens = load_ensemble(
        ensemble_file(tmp_path, members=["exp001", "cv.fold1"], weights=[1, 3]), KNOWN
    )
    assert ens.member_names == ["exp001", "cv.fold1"]
    assert [(m.experiment, m.fold) for m in ens.members] == [("exp001", None), ("cv", 1)]
    assert ens.weights == (1.0, 3.0) and not ens.tuned and ens.tune_step == 0.25
    tuned = load_ensemble(
        ensemble_file(tmp_path, members=["exp001", "exp002"], weights="tuned"), {"exp001", "exp002"}
    )
    assert tuned.tuned


def test_the_shipped_example_loads():
    # exp001 and the two folds of exp001_cv (config/experiments/ declares split.folds: 2).
    known = {"exp001": None, "exp001_full": None, "exp001_cv": 2}
    ens = load_ensemble(REPO / "config" / "ensembles" / "ens_demo.yaml", known)
    assert ens.member_names == ["exp001", "exp001_cv.fold0", "exp001_cv.fold1"]
    assert ens.weights == (2.0, 1.0, 1.0)


@pytest.mark.parametrize(
    "data, problem",
    [
        ({"members": ["exp001", "exp009"], "weights": [1, 1]}, "unknown member 'exp009'"),
        ({"members": ["exp001", "exp002"], "weights": [-1, 2]}, "negative weight"),
        ({"members": ["exp001", "exp002"], "weights": [1, 1, 1]}, "3 weights for 2 members"),
        ({"members": ["exp001", "exp002"], "weights": [0, 0]}, "all zero"),
        ({"members": ["exp001", "exp001"], "weights": [1, 1]}, "listed twice"),
        ({"members": ["exp001", "cv.fold2"], "weights": [1, 1]}, "fold index 2 out of range"),
        ({"members": ["exp001", "exp002.fold0"], "weights": [1, 1]}, "declares no split.folds"),
        ({"members": ["cv.fold0", "cv.fold1"], "weights": "tuned"}, "tuned needs held-out"),
        ({"members": ["exp001", "exp002"], "weights": "best"}, "weights"),
        ({"members": ["exp001"], "weights": [1]}, "members"),
        ({"members": ["exp001", "exp002"], "weights": [1, 1], "tune_step": 0.3}, "divide 1"),
        ({"members": ["exp001", "exp002"], "weights": [1, 1], "extra": 1}, "extra"),
    ],
)
def test_bad_files_are_one_line_errors_naming_the_file(tmp_path, data, problem):
    path = ensemble_file(tmp_path, **data)
    with pytest.raises(CtsegError) as err:
        load_ensemble(path, KNOWN)
    msg = str(err.value)
    assert msg.startswith(str(path)) and problem in msg and "\n" not in msg


def test_name_clash_and_file_name(tmp_path):
    clash = ensemble_file(tmp_path, name="exp002", members=["exp001", "cv.fold0"], weights=[1, 1])
    with pytest.raises(CtsegError, match="also an experiment's"):
        load_ensemble(clash, KNOWN)
    renamed = tmp_path / "other.yaml"
    renamed.write_text(
        yaml.safe_dump({"name": "ens", "members": ["exp001", "exp002"], "weights": [1, 1]})
    )
    with pytest.raises(CtsegError, match="differs from the file name"):
        load_ensemble(renamed, KNOWN)
    with pytest.raises(CtsegError, match="file not found"):
        load_ensemble(tmp_path / "none.yaml", KNOWN)


def test_a_callable_says_which_runs_exist(tmp_path):
    def folds(name: str) -> int | None:
        return {"exp001": 3}[name]

    path = ensemble_file(tmp_path, members=["exp001.fold0", "exp001.fold2"], weights=[1, 1])
    assert [m.fold for m in load_ensemble(path, folds).members] == [0, 2]
    path = ensemble_file(tmp_path, members=["exp001.fold0", "exp009"], weights=[1, 1])
    with pytest.raises(CtsegError, match="unknown member 'exp009'"):
        load_ensemble(path, folds)


# ----------------------------------------------------------------------------- tuning
def test_weight_grid_sizes_and_order():
    assert [len(weight_grid(m, 0.25)) for m in (2, 3, 4)] == [5, 15, 35]
    assert weight_grid(2, 0.25)[0] == (0.5, 0.5)
    assert all(sum(w) == pytest.approx(1) for w in weight_grid(3, 0.25))
    with pytest.raises(CtsegError, match="coarser"):
        weight_grid(12, 0.05)


def sheet_case(tmp_path: Path, rid: str, z: int) -> tuple[Path, Path, Path]:
    """A label with one sheet; member a sees it at 0.6, member b sees a wrong sheet at 0.9."""
    label = np.zeros(SHAPE, np.uint8)
    label[z : z + 2] = 1
    good = np.full(SHAPE, 0.05)
    good[z : z + 2] = 0.6
    bad = np.full(SHAPE, 0.05)
    bad[(z + 8) % 18 : (z + 8) % 18 + 2] = 0.9
    tif = tmp_path / "labels" / f"{rid}.tif"
    tif.parent.mkdir(exist_ok=True)
    tifffile.imwrite(tif, label)
    a = write_probs(tmp_path / "a" / f"{rid}.zarr", good)
    b = write_probs(tmp_path / "b" / f"{rid}.zarr", bad)
    return a, b, tif


def test_tuned_weights_pick_the_better_member(tmp_path):
    cases = [sheet_case(tmp_path, rid, z) for rid, z in (("v1", 4), ("v2", 10))]
    out = tmp_path / "weights.json"
    rc = main(
        [
            "tune-ensemble",
            "--member", "bad", *[str(b) for _, b, _ in cases],
            "--member", "good", *[str(a) for a, _, _ in cases],
            "--labels", *[str(t) for _, _, t in cases],
            "--out", str(out),
            "--topo-method", "betti_counts",  # the exact matching costs ~25 s here
        ]
    )  # fmt: skip
    assert rc == 0
    summary = json.loads(out.read_text())
    # Only all the weight on `good` keeps its 0.6 above the 0.5 threshold.
    assert summary["weights"] == [0.0, 1.0]
    assert summary["member_scores"]["good"] > summary["member_scores"]["bad"]
    assert summary["score"] == summary["member_scores"]["good"]
    assert summary["grid_size"] == 5 and len(summary["grid"]) == 5
    assert summary["ids"] == ["v1", "v2"]

    # ensemble --weights-file applies them: the result is the good member.
    ens = tmp_path / "ens" / "v1.zarr"
    a, b, _ = cases[0]
    args = ["ensemble", "--members", str(b), str(a), "--weights-file", str(out), "--out", str(ens)]
    assert main([*args, "--names", "bad", "good"]) == 0
    assert np.array_equal(read(ens), read(a))
    with pytest.raises(CtsegError, match="not \\['good', 'bad'\\]"):
        load_weights(out, ["good", "bad"])


def test_tuning_inputs_are_checked(tmp_path):
    a1, b1, t1 = sheet_case(tmp_path, "v1", 4)
    a2, _, t2 = sheet_case(tmp_path, "v2", 10)
    with pytest.raises(CtsegError, match="member 'b' has stores for ids"):
        tune_weights([("a", [a1, a2]), ("b", [b1])], [t1, t2], tmp_path / "w.json")
    with pytest.raises(CtsegError, match="2 volumes per member but 1 labels"):
        tune_weights([("a", [a1, a2]), ("b", [a1, a2])], [t1], tmp_path / "w.json")
    assert not (tmp_path / "w.json").exists()


@pytest.mark.slow  # two spawned workers import numpy, zarr and ctseg: ~10 s here
def test_parallel_tuning_gives_the_serial_result(tmp_path):
    cases = [sheet_case(tmp_path, rid, z) for rid, z in (("v1", 4), ("v2", 10))]
    members = [("a", [a for a, _, _ in cases]), ("b", [b for _, b, _ in cases])]
    labels = [t for _, _, t in cases]
    kwargs = {"step": 0.5, "topo_method": "betti_counts"}
    serial = tune_weights(members, labels, tmp_path / "w1.json", **kwargs)
    parallel = tune_weights(members, labels, tmp_path / "w2.json", workers=2, **kwargs)
    assert parallel["grid"] == serial["grid"] and parallel["weights"] == [1.0, 0.0]
    assert len(serial["grid"]) == 3


def test_stores_written_by_infer_are_ensembled_and_checked(tmp_path):
    """The attributes compared are the ones infer writes: the same model's probabilities
    ensembled give them back, and a different overlap is refused."""
    import torch

    from ctseg.inference.run import infer_volume
    from ctseg.inference.settings import InferenceSettings
    from ctseg.network.model import build_model

    image = tmp_path / "img.zarr"
    volume = np.random.default_rng(1).integers(0, 256, size=(16, 16, 16), dtype=np.uint8)
    attributes = {"p0_5": 20.0, "p99_5": 220.0}
    create_volume(image, volume.shape, np.uint8, (8, 16, 16), attributes=attributes)[...] = volume
    torch.manual_seed(0)
    model = build_model({"filters": [4, 8]}).eval()
    kw = {"window": (8, 8, 8), "batch_size": 8}
    a, c = tmp_path / "a.zarr", tmp_path / "c.zarr"
    infer_volume(model, image, a, InferenceSettings(overlap=0.5, **kw))
    infer_volume(model, image, c, InferenceSettings(overlap=0.25, **kw))
    out = tmp_path / "ens.zarr"
    ensemble_volume([a, a], [1, 1], out)
    assert np.array_equal(read(out), read(a))
    with pytest.raises(CtsegError, match="overlap"):
        ensemble_volume([a, c], [1, 1], out)


def test_the_ensemble_names_its_members_weights_files_in_order(tmp_path):
    """Each member's store names the weights file it was made with; the ensemble's names them
    all, in member order (tuned.json keeps this, and ctseg predict checks it). A member that
    does not say leaves the ensemble saying nothing, rather than half."""
    rng = np.random.default_rng(1)
    a = write_probs(tmp_path / "a" / "v.zarr", rng.random(SHAPE), weights_sha256=["aa"])
    b = write_probs(tmp_path / "b" / "v.zarr", rng.random(SHAPE), weights_sha256=["bb"])
    plain = write_probs(tmp_path / "c" / "v.zarr", rng.random(SHAPE))
    ensemble_volume([b, a], [1, 3], tmp_path / "ba.zarr")
    attrs = dict(open_volume(tmp_path / "ba.zarr").attrs)
    assert attrs["weights_sha256"] == ["bb", "aa"]
    assert attrs["ensemble"]["weights"] == [0.25, 0.75]
    ensemble_volume([a, plain], [1, 1], tmp_path / "ac.zarr")
    assert "weights_sha256" not in dict(open_volume(tmp_path / "ac.zarr").attrs)
