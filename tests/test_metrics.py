"""The competition metric on hand-built volumes whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tifffile

from ctseg.evaluation import metrics
from ctseg.evaluation.metrics import (
    axis_cuts,
    betti_numbers,
    cldice,
    evaluate_pairs,
    medial_surface,
    octant_slices,
    score_files,
    score_volume,
    tile_feature_counts,
    topo_counts,
)
from ctseg.io import CtsegError

N = 32  # small enough that the whole file runs in seconds


def _sheet(n: int = N, z: int = 10, thickness: int = 2, margin: int = 4) -> np.ndarray:
    """A flat sheet parallel to the yx plane, spanning all four z-lower octants."""
    vol = np.zeros((n, n, n), dtype=np.uint8)
    vol[z : z + thickness, margin : n - margin, margin : n - margin] = 1
    return vol


def _grid(size: int, center: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z, y, x = np.indices((size, size, size), dtype=float)
    return z - center, y - center, x - center


def _torus(size: int = 20, big: float = 5.0, small: float = 2.0) -> np.ndarray:
    z, y, x = _grid(size, (size - 1) / 2)
    return (np.hypot(y, x) - big) ** 2 + z**2 <= small**2


def _ball(size: int = 20, radius: float = 7.0) -> np.ndarray:
    z, y, x = _grid(size, (size - 1) / 2)
    return z**2 + y**2 + x**2 <= radius**2


def _shell(size: int = 20, outer: float = 7.0, inner: float = 4.0) -> np.ndarray:
    z, y, x = _grid(size, (size - 1) / 2)
    r2 = z**2 + y**2 + x**2
    return (r2 <= outer**2) & (r2 >= inner**2)


def _in_octant(obj: np.ndarray, n: int = 40, corner: tuple[int, int, int] = (0, 0, 0)):
    """Place `obj` inside one octant of an n^3 volume so the tiling does not cut it."""
    vol = np.zeros((n, n, n), dtype=np.uint8)
    s = obj.shape[0]
    vol[corner[0] : corner[0] + s, corner[1] : corner[1] + s, corner[2] : corner[2] + s] = obj
    return vol


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, float) and math.isnan(x):
            if not (isinstance(y, float) and math.isnan(y)):
                return False
        elif x != y:
            return False
    return True


# --- empty cases ---------------------------------------------------------------------------


def test_both_empty_scores_one_everywhere():
    empty = np.zeros((N, N, N), dtype=np.uint8)
    r = score_volume(empty, empty)
    for key in ("surface_dice", "voi_score", "topo_score", "dice", "cldice"):
        assert r[key] == 1.0, key
    assert r["score"] == 1.0
    assert r["voi_total"] == 0.0
    # Every topology dimension is dropped (no features on either side): NaN by convention.
    assert all(math.isnan(r[f"topo_f1_{k}"]) for k in range(3))


def test_empty_prediction_against_one_sheet():
    """The reference's documented values: only SurfaceDice (and Dice) see an empty prediction.

    VOI on the union compares one GT label with one (all-background) prediction label, so it is
    0; the sheet is a single component in each tile, so no topology feature exists and Topo
    is 1. Score = 0.30 * 1 + 0.35 * 0 + 0.35 * 1 = 0.65.
    """
    gt = _sheet()
    empty = np.zeros_like(gt)
    r = score_volume(empty, gt)
    assert r["surface_dice"] == 0.0
    assert r["dice"] == 0.0 and r["cldice"] == 0.0
    assert r["voi_total"] == 0.0 and r["voi_score"] == 1.0
    assert r["topo_score"] == 1.0
    assert r["score"] == pytest.approx(0.65)
    # Swapped roles give the same values.
    assert _same(score_volume(gt, empty) | {"topo_method": None}, r | {"topo_method": None})


def test_empty_prediction_against_two_sheets_is_a_merge():
    gt = np.maximum(_sheet(z=4), _sheet(z=10))
    r = score_volume(np.zeros_like(gt), gt)
    assert r["voi_merge"] > 0 and r["voi_split"] == 0.0
    # Two components per z-lower tile: 4 GT dim-0 features, none predicted.
    assert (r["topo_p0"], r["topo_g0"], r["topo_f1_0"]) == (0, 4, 0.0)


# --- identical masks -------------------------------------------------------------------------


def _feature_rich_volume() -> np.ndarray:
    """A torus, a hollow shell and two blobs in three different octants: features in 0, 1, 2."""
    vol = _in_octant(_torus())
    vol = np.maximum(vol, _in_octant(_shell(), corner=(20, 0, 0)))
    vol[22:25, 22:25, 22:25] = 1
    vol[30:34, 30:34, 30:34] = 1
    return vol


def test_identical_masks_score_one():
    gt = _feature_rich_volume()
    r = score_volume(gt.copy(), gt)
    assert r["surface_dice"] == 1.0
    assert r["voi_total"] == 0.0 and r["voi_score"] == 1.0
    assert r["dice"] == 1.0 and r["cldice"] == 1.0
    assert r["topo_score"] == 1.0
    assert r["score"] == 1.0
    for k, expected in zip(range(3), (1, 1, 1), strict=True):
        assert r[f"topo_m{k}"] == r[f"topo_p{k}"] == r[f"topo_g{k}"] == expected
        assert r[f"topo_f1_{k}"] == 1.0


# --- SurfaceDice -----------------------------------------------------------------------------


def test_surface_dice_shift_within_tolerance():
    gt = _sheet()
    assert score_volume(np.roll(gt, 1, axis=0), gt)["surface_dice"] == 1.0
    assert score_volume(np.roll(gt, 2, axis=0), gt)["surface_dice"] == 1.0


def test_surface_dice_shift_beyond_tolerance():
    """A 2-thick sheet shifted by 3 keeps its near faces 1 voxel apart, so about half the
    surface still matches (measured 0.537); shifted by 5 nothing is within 2 voxels."""
    gt = _sheet()
    shifted3 = score_volume(np.roll(gt, 3, axis=0), gt)["surface_dice"]
    assert 0.4 < shifted3 < 0.6
    assert score_volume(np.roll(gt, 5, axis=0), gt)["surface_dice"] == 0.0


# --- Betti numbers and TopoScore -------------------------------------------------------------


def test_betti_numbers_of_known_shapes():
    assert betti_numbers(_torus()) == (1, 1, 0)
    assert betti_numbers(_shell()) == (1, 0, 1)
    assert betti_numbers(_ball()) == (1, 0, 0)
    assert betti_numbers(np.zeros((5, 5, 5), bool)) == (0, 0, 0)
    two = np.zeros((10, 10, 10), bool)
    two[1:3, 1:3, 1:3] = two[6:9, 6:9, 6:9] = True
    assert betti_numbers(two) == (2, 0, 0)
    # Diagonal neighbours are separate components for the 6-connected foreground.
    diag = np.zeros((4, 4, 4), bool)
    diag[1, 1, 1] = diag[2, 2, 2] = True
    assert betti_numbers(diag) == (2, 0, 0)


def test_tile_counts_drop_the_essential_component():
    assert tile_feature_counts(_torus()) == (0, 1, 0)
    assert tile_feature_counts(_shell()) == (0, 0, 1)
    assert tile_feature_counts(np.zeros((4, 4, 4), bool)) == (0, 0, 0)


def test_missing_handle_lowers_topo():
    torus, ball = _in_octant(_torus()), _in_octant(_ball())
    r = score_volume(ball, torus)  # GT has a handle, prediction does not
    assert (r["topo_m1"], r["topo_p1"], r["topo_g1"]) == (0, 0, 1)
    assert r["topo_f1_1"] == 0.0
    assert math.isnan(r["topo_f1_0"]) and math.isnan(r["topo_f1_2"])
    assert r["topo_score"] == 0.0  # the only active dimension scores 0

    spurious = score_volume(torus, ball)  # g_1 = 0: the pseudo-count rule 0.5 / (p + 0.5)
    assert spurious["topo_f1_1"] == pytest.approx(1 / 3)
    assert spurious["topo_score"] == pytest.approx(1 / 3)


def test_tiling_hides_a_handle_cut_by_the_octant_planes():
    """A property of the reference: a centred torus falls apart into 8 contractible pieces."""
    z, y, x = _grid(N, (N - 1) / 2)
    torus = (np.hypot(y, x) - 9) ** 2 + z**2 <= 9
    assert betti_numbers(torus) == (1, 1, 0)
    counts, _ = topo_counts(torus, torus, "betti_counts")
    assert counts.sum() == 0


def test_topo_weights_renormalise_over_active_dims():
    score, f1 = metrics.topo_score_from_counts(np.array([[1, 2, 2], [0, 0, 0], [0, 0, 1]]))
    assert f1[0] == 0.5 and math.isnan(f1[1]) and f1[2] == 0.0
    assert score == pytest.approx((0.34 * 0.5 + 0.33 * 0.0) / 0.67)


def test_topo_method_reporting():
    gt = _feature_rich_volume()
    pred = np.roll(gt, 1, axis=0)
    exact = score_volume(pred, gt)
    assert exact["topo_method"] == "betti_matching"
    bound = score_volume(pred, gt, topo_method="betti_counts")
    assert bound["topo_method"] == "betti_counts"
    # Same feature counts; the bound can only overstate the matched counts and the score.
    for k in range(3):
        assert exact[f"topo_p{k}"] == bound[f"topo_p{k}"]
        assert exact[f"topo_g{k}"] == bound[f"topo_g{k}"]
        assert exact[f"topo_m{k}"] <= bound[f"topo_m{k}"]
    assert exact["topo_score"] <= bound["topo_score"]
    with pytest.raises(ValueError, match="topo_method"):
        score_volume(gt, gt, topo_method="nope")  # type: ignore[arg-type]


def test_shifted_handle_is_not_matched():
    """A torus shifted along its axis by more than its tube's thickness: the count bound pairs
    the two handles, Betti matching does not (the label's handle dies first)."""
    gt = _in_octant(_torus(size=20, big=5.0, small=1.0))
    pred = np.roll(gt, 4, axis=0)
    exact = score_volume(pred, gt)
    assert (exact["topo_m1"], exact["topo_p1"], exact["topo_g1"]) == (0, 1, 1)
    assert score_volume(pred, gt, topo_method="betti_counts")["topo_m1"] == 1


# --- VOI -------------------------------------------------------------------------------------


def test_split_sheet_is_a_split_and_the_reverse_a_merge():
    gt = _sheet()
    cut = gt.copy()
    cut[:, :, 12] = 0  # one plane removed: no 26-neighbours across the gap
    forward = score_volume(cut, gt)
    assert forward["voi_split"] > 0 and forward["voi_merge"] == pytest.approx(0.0, abs=1e-12)
    assert forward["voi_score"] < 1.0
    assert forward["voi_score"] == 1.0 / (1.0 + 0.3 * forward["voi_total"])

    reverse = score_volume(gt, cut)
    assert reverse["voi_merge"] == pytest.approx(forward["voi_split"])
    assert reverse["voi_split"] == pytest.approx(forward["voi_merge"], abs=1e-12)


def test_voi_alpha_is_a_parameter():
    gt = _sheet()
    cut = gt.copy()
    cut[:, :, 12] = 0
    r = score_volume(cut, gt, voi_alpha=1.0)
    assert r["voi_score"] == 1.0 / (1.0 + r["voi_total"])


# --- input handling --------------------------------------------------------------------------


def test_ignore_label_hides_everything_under_it():
    gt = _feature_rich_volume()
    gt[:, :, 26:] = np.where(gt[:, :, 26:] == 1, 1, 2)  # a slab of unlabeled voxels
    pred = np.where(gt == 1, 1, 0).astype(np.uint8)
    baseline = score_volume(pred, gt)

    rng = np.random.default_rng(0)
    noisy = pred.copy()
    ignored = gt == 2
    noisy[ignored] = rng.integers(0, 3, size=int(ignored.sum()), dtype=np.uint8)
    assert _same(score_volume(noisy, gt), baseline)
    # GT == 2 counts as background for the GT itself: a GT of only 2 equals an empty GT.
    all_ignored = np.full_like(gt, 2)
    assert score_volume(pred, all_ignored)["score"] == pytest.approx(1.0)


def test_nan_in_prediction_counts_as_background():
    gt = _sheet()
    pred = gt.astype(np.float32)
    pred[10, 8:12, 8:12] = np.nan  # inside the sheet: lost foreground
    pred[20, 3, 3] = np.nan  # in background: stays background
    as_zero = np.nan_to_num(pred, nan=0.0)
    assert _same(score_volume(pred, gt), score_volume(as_zero, gt))
    assert score_volume(pred, gt)["dice"] < 1.0


def test_non_binary_prediction_values_are_foreground():
    gt = _sheet()
    assert score_volume(gt.astype(np.float32) * 0.3, gt)["score"] == pytest.approx(1.0)


def test_shape_mismatch_is_a_value_error_naming_both_shapes():
    with pytest.raises(ValueError, match=r"\(4, 5, 6\).*\(4, 5, 7\)"):
        score_volume(np.zeros((4, 5, 6)), np.zeros((4, 5, 7)))
    with pytest.raises(ValueError, match="3D"):
        score_volume(np.zeros((4, 5)), np.zeros((4, 5)))


def test_octant_tiling_on_odd_shapes():
    assert axis_cuts(5) == [(0, 3), (3, 5)]  # the first half gets the extra voxel
    assert axis_cuts(1) == [(0, 1)]
    for n in (5, 8, 33):
        sizes = [len(part) for part in np.array_split(np.arange(n), 2)]
        assert [b - a for a, b in axis_cuts(n)] == sizes
    shape = (5, 6, 7)
    tiles = list(octant_slices(shape))
    assert len(tiles) == 8
    cover = np.zeros(shape, dtype=int)
    for tile in tiles:
        cover[tile] += 1
    assert (cover == 1).all()
    for axis in range(3):
        sizes = {t[axis].stop - t[axis].start for t in tiles}
        assert max(sizes) - min(sizes) <= 1


def test_score_weights_are_exact():
    gt = _feature_rich_volume()
    pred = np.roll(gt, 3, axis=2)
    pred[30:34, 30:34, 30:34] = 0
    r = score_volume(pred, gt)
    assert 0 < r["score"] < 1
    total = 0.30 + 0.35 + 0.35
    expected = (
        0.30 / total * r["topo_score"]
        + 0.35 / total * r["surface_dice"]
        + 0.35 / total * r["voi_score"]
    )
    assert r["score"] == expected


def test_perfect_prediction_scores_exactly_one():
    """The weights sum to 0.9999999999999999 in floats; the competition divides by that sum and
    clips, so a perfect prediction scores 1.0 exactly, never above."""
    assert 0.30 + 0.35 + 0.35 != 1.0
    gt = _feature_rich_volume()
    assert score_volume(gt.copy(), gt)["score"] == 1.0
    assert metrics.combined_score(1.0, 1.0, 1.0) == 1.0
    assert metrics.combined_score(0.0, 0.0, 0.0) == 0.0


# --- clDice ----------------------------------------------------------------------------------


def test_medial_surface_of_a_slab_is_thin_in_its_normal_direction():
    slab = _sheet(thickness=5).astype(bool)
    skeleton = medial_surface(slab)
    assert skeleton.any() and (skeleton <= slab).all()
    # The cross-sections along y and x put the surface on the middle plane z = 12.
    assert skeleton[12].sum() > 0.8 * slab[12].sum()


def test_cldice_drops_for_spurious_prediction():
    gt = _sheet().astype(bool)
    pred = gt.copy()
    pred[20:24, 4:28, 4:28] = True  # a second, wrong sheet
    value = cldice(pred, gt)
    assert 0 < value < 1


# --- files -----------------------------------------------------------------------------------


def test_score_files(tmp_path):
    gt = _sheet()
    tifffile.imwrite(tmp_path / "gt.tif", gt)
    tifffile.imwrite(tmp_path / "pred.tif", gt)
    tifffile.imwrite(tmp_path / "small.tif", gt[:-1])
    assert score_files(tmp_path / "pred.tif", tmp_path / "gt.tif")["score"] == pytest.approx(1.0)
    with pytest.raises(CtsegError, match=r"small\.tif.*gt\.tif"):
        score_files(tmp_path / "small.tif", tmp_path / "gt.tif")
    with pytest.raises(CtsegError, match=r"missing\.tif"):
        score_files(tmp_path / "missing.tif", tmp_path / "gt.tif")


# --- evaluate ----------------------------------------------------------------------------------


def test_parallel_evaluation_equals_serial(tmp_path):
    rng = np.random.default_rng(3)
    predictions, labels = [], []
    for i in range(3):
        gt = _sheet(z=6 + 3 * i)
        gt[:, :, 20:] = np.where(gt[:, :, 20:] == 1, 1, 2)  # an ignored slab
        pred = np.roll(gt == 1, i, axis=0).astype(np.uint8)
        pred[rng.random(pred.shape) < 0.02] = 1  # speckle: dimension-0 and -1 features
        predictions.append(tmp_path / f"vol{i}.tif")
        labels.append(tmp_path / f"label{i}.tif")
        tifffile.imwrite(predictions[-1], pred)
        tifffile.imwrite(labels[-1], gt)
    serial = evaluate_pairs(predictions, labels, tmp_path / "serial", workers=1)
    parallel = evaluate_pairs(predictions, labels, tmp_path / "parallel", workers=2)
    assert serial == parallel
    assert serial["topo_method"] == "betti_matching" and serial["volumes"] == 3
    csv = (tmp_path / "serial" / "scores.csv").read_bytes()
    assert csv == (tmp_path / "parallel" / "scores.csv").read_bytes()
    assert csv.decode().splitlines()[1].startswith("vol0,")  # input order is kept
    with pytest.raises(CtsegError, match="workers"):
        evaluate_pairs(predictions, labels, tmp_path / "bad", workers=0)


# --- the fast path against the previous one -----------------------------------------------------


def _noisy_pair(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs with features in every dimension: the feature-rich volume shifted and speckled, or
    dense random masks (many loops and cavities), part of each label ignored."""
    rng = np.random.default_rng(seed)
    if seed == 0:
        gt = _feature_rich_volume().astype(np.uint8)
        pred = np.roll(gt, 1, axis=2) ^ (rng.random(gt.shape) < 0.01)
    else:
        gt = (rng.random((22, 24, 26)) < 0.6).astype(np.uint8)
        pred = gt ^ (rng.random(gt.shape) < 0.1)
    gt[:, :, -5:] = np.where(gt[:, :, -5:] == 1, 1, 2)
    return pred.astype(np.uint8), gt


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_score_equals_the_reference_path(seed):
    """Every value of the score equals the previous implementation's (surface-distance and the
    Betti matching run in every dimension of every tile, one tile at a time)."""
    pred, gt = _noisy_pair(seed)
    fast = score_volume(pred, gt, threads=2)
    reference = score_volume(pred, gt, implementation="reference")
    assert fast.keys() == reference.keys()
    for key, value in reference.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(fast[key]), key
        elif isinstance(value, float):
            assert fast[key] == pytest.approx(value, abs=1e-12), key
        else:
            assert fast[key] == value, key
    assert 0 < fast["score"] < 1 and fast["topo_m0"] > 0 and fast["topo_m1"] > 0


def test_label_side_and_tile_cache_give_the_same_counts():
    pred, gt = _noisy_pair(2)
    p, g = metrics.prepare_masks(pred, gt)
    expected, _ = topo_counts(p, g, every_dim=True)
    side = metrics.LabelSide.of(gt)
    cache: dict = {}
    for _ in range(2):  # the second time every tile comes from the cache
        counts, _ = topo_counts(p, g, label_tiles=side.tiles, threads=2, tile_cache=cache)
        np.testing.assert_array_equal(counts, expected)
    # Per tile: its counts, and its feature counts, shared with the other method (the bound).
    assert sorted(k[0] for k in cache) == ["betti_matching"] * 8 + ["features"] * 8
    bound, _ = topo_counts(p, g, "betti_counts", label_tiles=side.tiles, tile_cache=cache)
    np.testing.assert_array_equal(bound[:, 1:], expected[:, 1:])  # the same p_k and g_k
    assert (bound[:, 0] >= expected[:, 0]).all()  # m_k <= min(p_k, g_k)
    assert len(cache) == 24


# --- raw TIFFs: values that are not a label or a mask ---------------------------------------------


def test_label_with_a_value_3_is_an_error_naming_the_file(tmp_path):
    gt = _sheet()
    bad = gt.copy()
    bad[0, 0, :3] = [3, 7, 3]
    tifffile.imwrite(tmp_path / "gt.tif", bad)
    tifffile.imwrite(tmp_path / "pred.tif", gt)
    with pytest.raises(CtsegError, match=r"gt\.tif: label values outside 0/1/2: \[3, 7\]") as e:
        score_files(tmp_path / "pred.tif", tmp_path / "gt.tif")
    assert "\n" not in str(e.value)
    with pytest.raises(CtsegError, match=r"gt\.tif.*\[3, 7\]"):
        evaluate_pairs([tmp_path / "pred.tif"], [tmp_path / "gt.tif"], tmp_path / "eval")
    assert not (tmp_path / "eval" / "summary.json").exists()


@pytest.mark.parametrize(
    "values, ok", [((0, 1), True), ((0, 255), True), ((0, 2), False), ((0, 1, 255), False)]
)
def test_prediction_values_other_than_a_mask_are_an_error(tmp_path, values, ok):
    gt = _sheet()
    pred = np.where(gt == 1, values[1], values[0]).astype(np.uint8)
    if len(values) > 2:
        pred[0, 0, 0] = values[2]
    tifffile.imwrite(tmp_path / "gt.tif", gt)
    tifffile.imwrite(tmp_path / "pred.tif", pred)
    if ok:  # 0/255 is the same mask as 0/1
        assert score_files(tmp_path / "pred.tif", tmp_path / "gt.tif")["score"] == 1.0
    else:
        with pytest.raises(CtsegError, match=r"pred\.tif: prediction values .* not a binary"):
            score_files(tmp_path / "pred.tif", tmp_path / "gt.tif")


def test_probabilities_as_a_prediction_are_an_error(tmp_path):
    gt = _sheet()
    tifffile.imwrite(tmp_path / "gt.tif", gt)
    tifffile.imwrite(tmp_path / "probs.tif", gt.astype(np.float32) * 0.3)
    with pytest.raises(CtsegError, match=r"probs\.tif: prediction values \[0\.3\]"):
        score_files(tmp_path / "probs.tif", tmp_path / "gt.tif")


def test_evaluate_records_provenance(tmp_path, capsys):
    from ctseg import cli

    gt = _sheet()
    tifffile.imwrite(tmp_path / "gt.tif", gt)
    tifffile.imwrite(tmp_path / "vol.tif", gt)
    argv = ["evaluate", "--predictions", str(tmp_path / "vol.tif"), "--labels"]
    argv += [str(tmp_path / "gt.tif"), "--out", str(tmp_path / "eval")]
    argv += ["--provenance", "scored_split=test", "--provenance", "tuned_on=val=a"]
    assert cli.main(argv) == 0
    import json

    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["provenance"] == {"scored_split": "test", "tuned_on": "val=a"}
    capsys.readouterr()
    with pytest.raises(SystemExit):  # argparse's usage error
        cli.main([*argv[:-1], "nonsense"])
    assert "KEY=VALUE" in capsys.readouterr().err


def test_euler_characteristic_equals_skimage():
    """The one-pass Euler characteristic that the feature counts use is skimage's
    euler_number with 6-connected foreground, on masks of every density and thin shapes."""
    from skimage.measure import euler_number

    rng = np.random.default_rng(11)
    for _ in range(150):
        shape = tuple(int(s) for s in rng.integers(1, 14, size=3))
        mask = rng.random(shape) < rng.uniform(0.1, 0.9)
        assert metrics.euler_characteristic(mask) == euler_number(mask, connectivity=1)
    assert metrics.euler_characteristic(_torus()) == 0
    assert metrics.euler_characteristic(_shell()) == 2


def test_medial_surface_equals_whole_slice_skeletons():
    """The per-slice skeletons taken on each slice's bounding box equal skimage's skeletons of
    the whole slices, for blobs, noise and shapes touching the array's faces."""
    from scipy import ndimage
    from skimage.morphology import skeletonize

    from ctseg.evaluation.metrics import medial_surface

    rng = np.random.default_rng(5)
    for i in range(12):
        shape = tuple(int(s) for s in rng.integers(5, 30, size=3))
        smooth = ndimage.gaussian_filter(rng.standard_normal(shape), 1.5)
        mask = smooth > rng.uniform(-0.3, 0.3) if i % 3 else rng.random(shape) < 0.3
        if i % 4 == 0:
            mask[0] = mask[:, -1] = True  # faces of the array
        expected = np.zeros_like(mask)
        for axis in range(3):
            moved = np.moveaxis(mask, axis, 0)
            whole = np.stack([skeletonize(s) for s in moved])
            expected |= np.moveaxis(whole, 0, axis)
        np.testing.assert_array_equal(medial_surface(mask), expected)
