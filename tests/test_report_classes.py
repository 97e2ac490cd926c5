"""The report's per-class table (ctseg.report.classes) and the multi-class overlay colours
(ctseg.report.overlays): the table's numbers are per_class.csv's, a missing or malformed file
is said, and each class is drawn in its own colour with its name in the legend."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
import tifffile
from matplotlib.backends.backend_agg import FigureCanvasAgg

from ctseg.evaluation.classes import write_per_class
from ctseg.formatting import fmt
from ctseg.io import CtsegError
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.report import overlays
from ctseg.report.classes import per_class_section
from ctseg.report.markup import Sources
from ctseg.store import create_volume

SPEC = LabelSpec(labels={"background": 0, "bone": 3, "vessel": 7}, ignore=9)


def table_rows(html: str) -> list[list[str]]:
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", html, re.S)
    return [
        [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", r)]
        for r in rows
    ]


def per_class_rows() -> list[dict]:
    rows = []
    for rid, (bone, vessel) in {"a": (0.9, 0.2), "b": (0.7, 1.0), "c": (0.65, 1.0)}.items():
        empty = rid != "a"  # vessel is in neither volume b nor c
        rows += [
            {"id": rid, "class": "bone", "value": 3, "dice": bone, "surface_dice": bone + 0.05,
             "gt_voxels": 100, "pred_voxels": 90},
            {"id": rid, "class": "vessel", "value": 7, "dice": vessel, "surface_dice": vessel,
             "gt_voxels": 0 if empty else 40, "pred_voxels": 0 if empty else 12},
            {"id": rid, "class": "mean", "value": None, "dice": (bone + vessel) / 2,
             "surface_dice": (bone + 0.05 + vessel) / 2, "gt_voxels": 0, "pred_voxels": 0},
        ]  # fmt: skip
    return rows


def test_the_table_shows_the_csv_mean_and_spread_per_class(tmp_path):
    path = write_per_class(per_class_rows(), tmp_path / "evaluation" / "per_class.csv")
    src = Sources(tmp_path)
    html = per_class_section(tmp_path / "evaluation", src)
    rows = table_rows(html)
    assert rows[0][:5] == ["class", "value", "volumes", "Dice", "SurfaceDice"]
    assert [r[0] for r in rows[1:]] == ["bone", "vessel", "mean over classes"]
    frame = pd.read_csv(path)
    for row, name in zip(rows[1:], ("bone", "vessel", "mean"), strict=True):
        group = frame[frame["class"] == name]
        for cell, column in ((row[3], "dice"), (row[4], "surface_dice")):
            mean, std = group[column].mean(), group[column].std(ddof=1)
            assert cell == f"{fmt(mean, 4)} ± {fmt(std, 4)}"
        assert row[2] == "3"
    assert rows[1][1:3] == ["3", "3"] and rows[3][1] == ""
    assert rows[1][3] == "0.7500 ± 0.1323"  # (0.9, 0.7, 0.65), by hand
    assert rows[2][5] == "2" and rows[1][5] == "0"  # vessel empty in b and c
    assert rows[2][6] == fmt(40 / 3, 4)
    assert src.read == ["evaluation/per_class.csv"]
    assert "evaluation/per_class.csv" in html


def test_one_volume_shows_the_mean_alone(tmp_path):
    write_per_class([r for r in per_class_rows() if r["id"] == "a"], tmp_path / "per_class.csv")
    rows = table_rows(per_class_section(tmp_path, Sources(tmp_path)))
    assert rows[1][3] == "0.9000" and rows[2][3] == "0.2000"


def test_a_missing_or_malformed_file_is_said(tmp_path):
    src = Sources(tmp_path)
    html = per_class_section(tmp_path / "evaluation", src)
    assert "Per-class scores: not found (<code>evaluation/per_class.csv</code>)" in html
    assert per_class_section(tmp_path / "evaluation", src, required=False) == ""
    assert "no input given" in per_class_section(None, src)
    bad = tmp_path / "evaluation" / "per_class.csv"
    bad.parent.mkdir()
    bad.write_text("id,class,dice\na,bone,0.5\n")
    with pytest.raises(CtsegError, match=r"per_class\.csv: not an evaluation per_class\.csv"):
        per_class_section(tmp_path / "evaluation", src)


# ----------------------------------------------------------------------------------- colours
def rendered(fig) -> np.ndarray:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].astype(int)


def pixel(fig, pixels: np.ndarray, ax, y: int, x: int) -> np.ndarray:
    """The drawn colour at data point (row y, column x) of `ax`."""
    px, py = ax.transData.transform((x, y))
    return pixels[int(round(pixels.shape[0] - py)), int(round(px))]


def slices() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A flat grey image; label (stored values) bone on rows 0..9, vessel 20..29, ignore 40..;
    the prediction (dataset values) the same classes."""
    image = np.full((48, 48), 100, np.uint8)
    label = np.zeros((48, 48), np.uint8)
    label[0:10], label[20:30], label[40:] = 1, 2, 3
    pred = SPEC.from_stored(np.where(label == 3, 0, label).astype(np.uint8))
    return image, label, pred


def test_each_class_has_its_own_colour_and_the_legend_names_it():
    image, label, pred = slices()
    fig = overlays._overlay_figure("v", image, {}, label, SPEC.to_stored(pred), 24, SPEC)
    pixels = rendered(fig)
    label_ax, pred_ax = fig.axes[1], fig.axes[2]
    grey = pixel(fig, pixels, label_ax, 14, 24)  # background: the image only
    colours = {}
    for ax in (label_ax, pred_ax):
        bone, vessel = pixel(fig, pixels, ax, 5, 24), pixel(fig, pixels, ax, 25, 24)
        assert not np.array_equal(bone, vessel)
        assert not np.array_equal(bone, grey) and not np.array_equal(vessel, grey)
        colours[ax] = (tuple(bone), tuple(vessel))
    assert colours[label_ax] == colours[pred_ax]  # one colour per class on both panels
    # Orange-ish bone (E69F00) and blue-ish vessel (56B4E9) over the grey image.
    bone, vessel = colours[label_ax]
    assert bone[0] > bone[2] and vessel[2] > vessel[0]
    ignore = pixel(fig, pixels, label_ax, 44, 24)
    assert not np.array_equal(ignore, grey)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["bone (3)", "vessel (7)", "ignore (9)"]


def test_class_layer_colours_are_the_palette():
    _, label, _ = slices()
    layer = overlays.class_layer(label, SPEC)
    assert tuple(layer[5, 5]) == pytest.approx(overlays.class_colour(0))
    assert tuple(layer[25, 5]) == pytest.approx(overlays.class_colour(1))
    assert tuple(layer[45, 5]) == pytest.approx(overlays.IGNORE_RGBA)
    assert layer[15, 5, 3] == 0.0  # background transparent
    assert len(set(overlays.CLASS_COLOURS)) == 15


def test_binary_overlay_keeps_its_legend():
    image = np.full((16, 16), 100, np.uint8)
    label = np.zeros((16, 16), np.uint8)
    label[4:8] = 1
    fig = overlays._overlay_figure("v", image, {}, label, label.copy(), 8, KAGGLE)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["label 1", "label 2 (ignore)", "prediction"]


def test_overlay_sections_read_a_multi_class_prediction(tmp_path):
    image, label, pred = slices()
    volume = lambda plane: np.repeat(plane[None], 4, axis=0)  # noqa: E731
    image_path, label_path = tmp_path / "image.zarr", tmp_path / "label.zarr"
    create_volume(image_path, (4, 48, 48), np.uint8, (4, 48, 48))[:] = volume(image)
    create_volume(label_path, (4, 48, 48), np.uint8, (4, 48, 48))[:] = volume(label)
    pred_path = tmp_path / "run" / "v.tif"
    pred_path.parent.mkdir()
    tifffile.imwrite(pred_path, volume(pred), photometric="minisblack")
    src = Sources(tmp_path)
    html = overlays.overlay_section([("v", image_path, label_path, pred_path)], src, SPEC)
    assert html.count("<img") == 1 and "run/v.tif" in html
    runs = overlays.runs_overlay_section(
        [("v", image_path, label_path)], [("run", pred_path.parent)], src, SPEC
    )
    assert runs.count("<img") == 1 and "a colour per class" in runs
    bad = volume(pred)
    bad[2, 0, 0] = 5  # no label of the dataset has the value 5
    tifffile.imwrite(pred_path, bad, photometric="minisblack")
    with pytest.raises(CtsegError, match=r"v\.tif: label values outside"):
        overlays.overlay_section([("v", image_path, label_path, pred_path)], src, SPEC)
