"""The synthetic dataset: Kaggle layout, determinism, and volumes that look like the real ones."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import tifffile
from scipy import ndimage

from ctseg.cli import build_parser
from ctseg.evaluation.metrics import (
    WEIGHT_SURFACE_DICE,
    WEIGHT_TOPO,
    WEIGHT_VOI,
    prepare_masks,
    surface_dice,
    topo_counts,
    topo_score_from_counts,
    voi,
    voi_score_from_total,
)
from ctseg.io import CtsegError, check_id, sha256_file
from ctseg.preprocess import demo_realistic
from ctseg.preprocess.demo_data import demo_records, generate_demo, synthesize, synthesize_volume
from ctseg.preprocess.demo_volume import DemoVolume

SHAPE = (48, 40, 56)  # not a cube, so swapped axes would show
FULL = np.ones((3, 3, 3), bool)  # 26-connectivity, as the competition's VOI uses


def _generate(out: Path, seed: int = 0) -> Path:
    generate_demo(out, n_train=3, n_test=2, shape=SHAPE, scroll_ids=[7, 9], seed=seed)
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _generate(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module", params=[0, 1, 2, 3])
def volume(request: pytest.FixtureRequest) -> DemoVolume:
    return synthesize_volume((64, 56, 72), np.random.default_rng([request.param, 12345]))


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == ["id", "scroll_id"]
        return list(reader)


# --- layout and records ----------------------------------------------------------------------


def test_layout_csvs_and_no_leftovers(demo: Path) -> None:
    records = demo_records(3, 2, [7, 9])
    expected = {"train.csv", "test.csv"}
    for r in records:
        for kind in ("images", "labels"):
            expected.add(f"{r['split']}_{kind}/{r['id']}.tif")
    # Exact equality also proves no temporary sibling was left behind.
    assert _files(demo) == expected
    for split in ("train", "test"):
        rows = _read_csv(demo / f"{split}.csv")
        assert [(row["id"], int(row["scroll_id"])) for row in rows] == [
            (r["id"], r["scroll_id"]) for r in records if r["split"] == split
        ]
    assert len({row["scroll_id"] for row in _read_csv(demo / "train.csv")}) >= 2


def test_progress_bar_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    generate_demo(tmp_path, n_train=1, n_test=0, shape=(16, 16, 16), scroll_ids=[1], seed=0)
    captured = capsys.readouterr()
    assert "demo-data" in captured.err
    assert captured.out == ""


def test_tiffs_are_3d_uint8_one_page_per_slice(demo: Path) -> None:
    for r in demo_records(3, 2, [7, 9]):
        image_path = demo / f"{r['split']}_images/{r['id']}.tif"
        label_path = demo / f"{r['split']}_labels/{r['id']}.tif"
        image, label = tifffile.imread(image_path), tifffile.imread(label_path)
        assert image.dtype == np.uint8 and label.dtype == np.uint8
        assert image.shape == label.shape == SHAPE
        with tifffile.TiffFile(image_path) as tif:
            assert len(tif.pages) == SHAPE[0]
        assert set(np.unique(label)) == {0, 1, 2}
        assert len(np.unique(image)) > 50  # grey levels, not a mask


def test_same_seed_same_bytes_other_seed_other_volumes(demo: Path, tmp_path: Path) -> None:
    again = _generate(tmp_path / "again", seed=0)
    other = _generate(tmp_path / "other", seed=1)
    names = sorted(_files(demo))
    assert sorted(_files(again)) == names == sorted(_files(other))
    for name in names:
        assert sha256_file(again / name) == sha256_file(demo / name), name
        if name.endswith(".tif"):
            assert sha256_file(other / name) != sha256_file(demo / name), name
        else:  # ids and scroll ids depend on the counts only
            assert sha256_file(other / name) == sha256_file(demo / name), name


def test_records_depend_on_counts_only() -> None:
    records = demo_records(500, 300, [34117, 35360, 26010])
    assert records == demo_records(500, 300, [34117, 35360, 26010])
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids)  # train and test never collide
    for r in records:
        assert check_id(r["id"], "test") == r["id"]
        assert r["id"].isdigit()
    assert [r["split"] for r in records] == ["train"] * 500 + ["test"] * 300
    # Adding test volumes does not rename the training ones.
    assert demo_records(500, 0, [34117, 35360, 26010]) == records[:500]
    assert {r["scroll_id"] for r in demo_records(2, 0, [5, 6])} == {5, 6}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shape": (16, 15, 16)}, "shape"),
        ({"shape": (32, 32)}, "shape"),
        ({"n_train": 0}, "n_train"),
        ({"n_test": -1}, "n_test"),
        ({"scroll_ids": []}, "scroll_ids"),
        ({"scroll_ids": [1, 1]}, "duplicates"),
        ({"seed": -1}, "seed"),
        ({"preset": "fancy"}, "preset"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    args = {"n_train": 1, "n_test": 1, "shape": (16, 16, 16), "scroll_ids": [1, 2], "seed": 0}
    args.update(kwargs)
    with pytest.raises(CtsegError, match=message):
        generate_demo(tmp_path / "out", **args)
    assert not (tmp_path / "out").exists()


# --- what the volumes look like --------------------------------------------------------------


def _runs_along(mask: np.ndarray, axis: int) -> np.ndarray:
    """Lengths of the runs of True along `axis`, over every line of the volume."""
    lines = np.moveaxis(mask, axis, -1).reshape(-1, mask.shape[axis]).astype(np.int8)
    edges = np.diff(np.pad(lines, ((0, 0), (1, 1))), axis=1)
    starts, ends = np.nonzero(edges == 1), np.nonzero(edges == -1)
    return ends[1] - starts[1]


def test_label_is_sheets_outside_the_ignore_region(volume: DemoVolume) -> None:
    sheets, label = volume.sheet_ids > 0, volume.label
    assert np.array_equal(label == 1, sheets & (label != 2))
    assert np.array_equal(label == 0, ~sheets & (label != 2))
    assert (sheets & (label == 2)).any()  # ignore overrides sheets


def test_ignore_is_about_half_in_a_few_large_regions(volume: DemoVolume) -> None:
    ignore = volume.label == 2
    assert 0.35 <= ignore.mean() <= 0.65
    components, count = ndimage.label(ignore)
    sizes = np.sort(np.bincount(components.ravel())[1:])[::-1]
    assert sizes[:3].sum() >= 0.9 * ignore.sum()
    assert count <= 10
    assert ndimage.label(~ignore)[1] <= 10
    # Smooth regions: most ignore voxels lie inside, with all 6 neighbours ignored too
    # (about 0.55**6 = 3% would for salt and pepper, which can still percolate into one piece).
    assert ndimage.binary_erosion(ignore).sum() >= 0.8 * ignore.sum()


def test_sheets_are_2_to_4_voxels_thick_along_their_normal(volume: DemoVolume) -> None:
    runs = _runs_along(volume.sheet_ids > 0, volume.normal_axis)
    assert runs.size > 0
    # Only contact patches, where two sheets merge, give longer runs.
    assert np.mean((runs >= 2) & (runs <= 4)) >= 0.9
    assert np.median(runs) in (2, 3)
    # Across the sheets the runs are long: they are surfaces, not needles stacked along z.
    across = (volume.normal_axis + 1) % 3
    assert np.median(_runs_along(volume.sheet_ids > 0, across)) > 10


def test_sheets_are_curved() -> None:
    v = synthesize_volume((64, 64, 64), np.random.default_rng(5))
    for k in range(1, int(v.sheet_ids.max()) + 1):
        sheet = v.sheet_ids == k
        present = sheet.any(axis=v.normal_axis)  # gaps have no position
        position = np.argmax(sheet, axis=v.normal_axis)[present]
        assert np.ptp(position) >= 3, f"sheet {k} is flat"


def test_several_sheets_some_touching(volume: DemoVolume) -> None:
    n_sheets = int(volume.sheet_ids.max())
    assert n_sheets >= 3
    assert set(np.unique(volume.sheet_ids)) == set(range(n_sheets + 1))
    assert volume.touching
    n_components = ndimage.label(volume.sheet_ids > 0, FULL)[1]
    assert 2 <= n_components < n_sheets
    for a in range(1, n_sheets):
        grown = ndimage.binary_dilation(volume.sheet_ids == a, FULL)
        # Even a diagonal contact counts, so sheets meet only where the generator says so.
        contact = bool((grown & (volume.sheet_ids == a + 1)).any())
        assert contact == ((a - 1, a) in volume.touching), (a, volume.touching)


def test_some_sheets_have_gaps(volume: DemoVolume) -> None:
    assert sum(volume.holes) >= 1
    for k, n_holes in enumerate(volume.holes):
        footprint = (volume.sheet_ids == k + 1).any(axis=volume.normal_axis)
        gaps = ndimage.binary_fill_holes(footprint) & ~footprint
        if n_holes:
            assert gaps.sum() >= 4, f"sheet {k} should have a gap"
        else:
            assert footprint.all(), f"sheet {k} should be whole"


def test_orientation_varies_between_volumes() -> None:
    axes = {
        synthesize_volume((16, 16, 16), np.random.default_rng(seed)).normal_axis
        for seed in range(8)
    }
    assert len(axes) >= 2


def test_image_shows_the_sheets_but_is_not_the_label(volume: DemoVolume) -> None:
    image = volume.image.astype(np.float64)
    sheets = volume.sheet_ids > 0
    assert image[sheets].mean() > image[~sheets].mean() + 40
    assert np.corrcoef(image.ravel(), sheets.ravel())[0, 1] > 0.5
    # No threshold separates sheets from background without error.
    hist_sheet = np.bincount(volume.image[sheets], minlength=256)
    hist_bg = np.bincount(volume.image[~sheets], minlength=256)
    errors = np.cumsum(hist_sheet)[:-1] + (hist_bg.sum() - np.cumsum(hist_bg)[:-1])
    assert errors.min() > 0


def test_image_has_blur_noise_and_drift(volume: DemoVolume) -> None:
    image = volume.image.astype(np.float64)
    sheets = volume.sheet_ids > 0
    near = ndimage.binary_dilation(sheets) & ~sheets
    far = ~ndimage.binary_dilation(sheets, iterations=3)
    assert image[near].mean() > image[far].mean() + 10  # blur spreads the sheets
    # Noise: neighbouring background voxels differ, beyond what the slow drift explains.
    assert np.diff(image, axis=0)[far[1:] & far[:-1]].std() > 8
    # Drift: background on one side of the volume is brighter than on the other.
    differences = []
    for axis, size in enumerate(image.shape):
        quarter = size // 4
        low = np.take(far, range(quarter), axis=axis)
        high = np.take(far, range(size - quarter, size), axis=axis)
        low_mean = np.take(image, range(quarter), axis=axis)[low].mean()
        high_mean = np.take(image, range(size - quarter, size), axis=axis)[high].mean()
        differences.append(abs(high_mean - low_mean))
    assert max(differences) > 10


# --- the realistic preset --------------------------------------------------------------------

REALISTIC_SHAPE = (64, 56, 72)
SEEDS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def pairs() -> list[tuple[DemoVolume, DemoVolume]]:
    """(simple, realistic) volumes from the same seeds."""
    return [
        (
            synthesize(REALISTIC_SHAPE, np.random.default_rng([seed, 12345]), "simple"),
            synthesize(REALISTIC_SHAPE, np.random.default_rng([seed, 12345]), "realistic"),
        )
        for seed in SEEDS
    ]


def _near_other_sheet(sheet_ids: np.ndarray) -> np.ndarray:
    """Sheet voxels with another sheet within Chebyshev distance 2 (at most one voxel between)."""
    others_above = ndimage.maximum_filter(sheet_ids, size=5) > sheet_ids
    others_below = ndimage.minimum_filter(np.where(sheet_ids == 0, 255, sheet_ids), size=5)
    return (sheet_ids > 0) & (others_above | (others_below < sheet_ids))


def _far_background(volume: DemoVolume) -> np.ndarray:
    return ~ndimage.binary_dilation(volume.sheet_ids > 0, iterations=3)


def _contrast_to_noise(volume: DemoVolume) -> float:
    image, far = volume.image.astype(np.float64), _far_background(volume)
    return (image[volume.sheet_ids > 0].mean() - image[far].mean()) / image[far].std()


def test_realistic_generation_is_deterministic_and_differs_from_simple(tmp_path: Path) -> None:
    args = {"n_train": 1, "n_test": 1, "shape": (40, 48, 40), "scroll_ids": [7], "seed": 4}
    generate_demo(tmp_path / "a", preset="realistic", **args)
    generate_demo(tmp_path / "b", preset="realistic", **args)
    generate_demo(tmp_path / "other", preset="realistic", **{**args, "seed": 5})
    generate_demo(tmp_path / "simple", **args)
    names = sorted(_files(tmp_path / "a"))
    assert len(names) == 6
    for name in names:
        digest = sha256_file(tmp_path / "a" / name)
        assert sha256_file(tmp_path / "b" / name) == digest, name
        if name.endswith(".tif"):
            assert sha256_file(tmp_path / "other" / name) != digest, name
            assert sha256_file(tmp_path / "simple" / name) != digest, name
        if "labels" in name:
            label = tifffile.imread(tmp_path / "a" / name)
            assert label.dtype == np.uint8 and label.shape == (40, 48, 40)
            assert set(np.unique(label)) == {0, 1, 2}


def test_cli_preset_option() -> None:
    parser = build_parser()
    assert parser.parse_args(["demo-data", "--out", "x"]).preset == "simple"
    assert parser.parse_args(["demo-data", "--out", "x", "--preset", "realistic"]).preset == (
        "realistic"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["demo-data", "--out", "x", "--preset", "fancy"])


def test_realistic_labels_are_sheets_and_mostly_ignored(pairs: list) -> None:
    for _, volume in pairs:
        sheets, label = volume.sheet_ids > 0, volume.label
        assert set(np.unique(label)) <= {0, 1, 2}
        assert np.array_equal(label == 1, sheets & (label != 2))
        assert np.array_equal(label == 0, ~sheets & (label != 2))
        ignore = label == 2
        assert 0.5 < ignore.mean() < 0.75
        # In large smooth regions, as in the real data, not salt and pepper.
        assert ndimage.binary_erosion(ignore).sum() >= 0.8 * ignore.sum()
        n_sheets = int(volume.sheet_ids.max())
        assert set(np.unique(volume.sheet_ids)) == set(range(n_sheets + 1))


def test_realistic_sheets_run_together(pairs: list) -> None:
    near = {"simple": [], "realistic": []}
    for simple, realistic in pairs:
        for name, volume in (("simple", simple), ("realistic", realistic)):
            labelled = volume.label == 1
            near[name].append(_near_other_sheet(volume.sheet_ids)[labelled].mean())
    # Pooled over the volumes: a large part of the surface lies within one voxel of another
    # sheet, where the simple preset has almost none.
    assert np.mean(near["realistic"]) > 0.4
    assert np.mean(near["realistic"]) > 5 * np.mean(near["simple"])
    for _, volume in pairs:
        ids = volume.sheet_ids
        touching = set(volume.touching)
        in_contact = 0
        for a in range(1, int(ids.max())):
            grown = ndimage.binary_dilation(ids == a, FULL)
            contact = bool((grown & (ids == a + 1)).any())
            # Only the pairs the generator pressed together ever touch.
            assert not contact or (a - 1, a) in touching, (a, touching)
            in_contact += contact
            if (a - 1, a) in touching and (ids == a).sum() > 500 and (ids == a + 1).sum() > 500:
                # Long stretches: most of a pressed pair's overlap runs within one voxel.
                both = np.where((ids == a) | (ids == a + 1), ids, 0)
                assert _near_other_sheet(both)[ids == a].mean() > 0.5, a
        assert in_contact >= 1


def test_realistic_thickness_varies(pairs: list) -> None:
    for simple, realistic in pairs:
        runs = {}
        for name, volume in (("simple", simple), ("realistic", realistic)):
            ids = volume.sheet_ids
            runs[name] = np.concatenate(
                [_runs_along(ids == k, volume.normal_axis) for k in range(1, int(ids.max()) + 1)]
            )
        # The simple preset: 2 to 4 voxels (a run of 1 only where a touching sheet overlaps).
        assert runs["simple"].max() <= 4 and np.mean(runs["simple"] == 1) < 0.01
        assert np.median(runs["realistic"]) in (2, 3)
        assert np.mean(runs["realistic"] == 1) > 0.05  # thin stretches
        assert np.mean(runs["realistic"] >= 5) > 0.01  # and thick ones


def test_realistic_contrast_is_low_and_drifts(pairs: list) -> None:
    ratios = []
    for simple, realistic in pairs:
        ratios.append(_contrast_to_noise(realistic) / _contrast_to_noise(simple))
        image, far = realistic.image.astype(np.float64), _far_background(realistic)
        contrast = image[realistic.sheet_ids > 0].mean() - image[far].mean()
        # The background mean over 16^3 blocks varies by more than the sheets stand out.
        blocks = []
        for z in range(0, 64, 16):
            for y in range(0, 56, 16):
                for x in range(0, 72, 16):
                    part = far[z : z + 16, y : y + 16, x : x + 16]
                    if part.sum() > 200:
                        blocks.append(image[z : z + 16, y : y + 16, x : x + 16][part].mean())
        assert np.ptp(blocks) > 1.5 * contrast
    assert max(ratios) < 0.75
    assert np.mean(ratios) < 0.5


def _local_mean(image: np.ndarray, mask: np.ndarray, size: int) -> np.ndarray:
    """Mean of image over the mask voxels in a size^3 window around each voxel."""
    total = ndimage.uniform_filter(np.where(mask, image, 0.0), size)
    count = ndimage.uniform_filter(mask.astype(np.float64), size)
    return total / np.maximum(count, 1e-9)


def test_realistic_blur_fills_the_gaps_between_pressed_sheets(pairs: list) -> None:
    for _, volume in pairs:
        ids = volume.sheet_ids
        image = volume.image.astype(np.float64)
        high = ndimage.maximum_filter(ids, size=3)
        low = ndimage.minimum_filter(np.where(ids == 0, 255, ids), size=3)
        gap = (ids == 0) & (low < 255) & (high != low)  # one voxel between two sheets
        assert gap.sum() > 50
        # Against the sheets right beside the gap and the background nearby (drift is local).
        sheet = _local_mean(image, ids > 0, 3)[gap].mean()
        background = _local_mean(image, _far_background(volume), 15)[gap].mean()
        # Partial volume and blur: the gap lies well above the background, part-way up to the
        # sheets, so the pair looks like one thick sheet.
        assert background + 0.3 * (sheet - background) < image[gap].mean() < sheet


def test_realistic_sheets_have_holes(pairs: list) -> None:
    holed = 0
    for _, volume in pairs:
        assert sum(volume.holes) >= 1
        for k in range(1, int(volume.sheet_ids.max()) + 1):
            footprint = (volume.sheet_ids == k).any(axis=volume.normal_axis)
            gaps = ndimage.binary_fill_holes(footprint) & ~footprint
            holed += bool(gaps.sum() >= 4)
    assert holed >= len(pairs)


def test_realistic_artefacts() -> None:
    rng = np.random.default_rng(0)
    rings = demo_realistic._rings(rng, (96, 96))
    assert np.abs(rings).max() >= demo_realistic.RING_AMPLITUDE[0] * 0.9
    # Thin rings: neighbouring pixels differ by far more than a smooth shading would.
    assert np.abs(np.diff(rings, axis=1)).max() > 2
    inclusions = demo_realistic._inclusions(np.random.default_rng(1), (96, 96, 96))
    assert len(inclusions) >= 3 and any(inc.streaks for inc in inclusions)
    slab = np.zeros((96, 96, 96), np.float32)
    demo_realistic._paint_inclusions(slab, 0, inclusions)
    assert ndimage.label(slab > 30)[1] >= len(inclusions) // 2
    painted = slab.copy()
    demo_realistic._paint_streaks(painted, 0, inclusions)
    assert (painted < 0).any() or (painted > slab + 5).any()


def _best_threshold_score(volume: DemoVolume) -> float:
    """The competition score of the image thresholded at its best percentile (no learning)."""
    best = 0.0
    for percentile in (80, 86, 92):
        threshold = np.percentile(volume.image, percentile)
        pred, gt = prepare_masks(volume.image > threshold, volume.label)
        # score_volume's parts without its clDice diagnostic, which costs more than all of them.
        topo, _ = topo_score_from_counts(topo_counts(pred, gt, "betti_counts")[0])
        score = (
            WEIGHT_TOPO * topo
            + WEIGHT_SURFACE_DICE * surface_dice(pred, gt)
            + WEIGHT_VOI * voi_score_from_total(sum(voi(pred, gt)))
        )
        best = max(best, score)
    return best


def test_a_percentile_threshold_scores_worse_on_realistic(pairs: list) -> None:
    simple, realistic = pairs[0]
    assert _best_threshold_score(realistic) < _best_threshold_score(simple) - 0.05


def test_the_workflow_knows_the_demo_files_before_they_exist(tmp_path):
    """`demo_dataset`: the ids, splits and files the Snakefile plans equal what generate_demo
    writes."""
    from ctseg.preprocess.demo_data import demo_dataset

    demo = {"n_train": 2, "n_test": 1, "scroll_ids": [7, 8]}
    planned = demo_dataset(str(tmp_path), demo)
    generate_demo(tmp_path, shape=(16, 16, 16), seed=0, **demo)
    for record_id, row in planned.items():
        assert Path(row["image"]).is_file() and Path(row["label"]).is_file()
        assert row["image"].endswith(f"{row['split']}_images/{record_id}.tif")
    assert sorted(r["split"] for r in planned.values()) == ["test", "train", "train"]
