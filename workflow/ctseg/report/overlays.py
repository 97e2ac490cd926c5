"""The report's slice overlays: the middle slice of image, label and prediction per volume.

Only the middle slice of each store is read, so memory is bounded by one slice.

A binary spec draws the label's foreground in green, its ignored voxels in hatched grey and the
prediction in red. A multi-class spec (`labels` with K >= 2 classes) gives each class its own
colour (`CLASS_COLOURS`: Okabe and Ito's colour-blind-safe palette, then Paul Tol's muted one
past its seven colours), fills the label's classes on the label panel and the prediction's on
the prediction panels, outlines the label's classes in the same colours over the prediction,
keeps ignored voxels grey and hatched, and names each class in the legend. Label stores hold the
stored values (`LabelSpec.stored`); predicted label maps hold the dataset's values and are mapped
with `LabelSpec.to_stored`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ctseg.formatting import num
from ctseg.io import CtsegError
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.report.markup import Sources, esc, missing, png, source_line
from ctseg.store import open_volume

# (id, image zarr, label zarr or None, prediction tif or None)
Overlay = tuple[str, Path, Path | None, Path | None]


def _middle_slice_zarr(path: Path) -> tuple[np.ndarray, int, int, Mapping[str, Any]]:
    try:
        # open_volume refuses a store that lost chunks (a partial copy): zarr would draw
        # them as zeros.
        array = open_volume(path)
    except CtsegError:
        raise
    except Exception as exc:  # zarr raises several types for a missing or broken store
        raise CtsegError(f"{path}: cannot open Zarr array for the report ({exc})") from exc
    depth = int(array.shape[0])
    # Only the middle slice is read, so memory is bounded by one slice.
    return np.asarray(array[depth // 2]), depth // 2, depth, dict(array.attrs)


def _middle_slice_tif(path: Path, index: int) -> np.ndarray:
    try:
        with tifffile.TiffFile(path) as tif:
            if len(tif.pages) > 1:
                return tif.pages[index].asarray()
            return tif.asarray()[index]
    except (OSError, IndexError, ValueError, tifffile.TiffFileError) as exc:
        raise CtsegError(f"{path}: cannot read slice {index} for the report ({exc})") from exc


def _display_range(image: np.ndarray, attrs: Mapping[str, Any]) -> tuple[float, float]:
    low, high = num(attrs.get("p0_5")), num(attrs.get("p99_5"))
    if low is None or high is None or high <= low:
        low, high = (float(v) for v in np.percentile(image, [0.5, 99.5]))
    return low, max(high, low + 1e-6)


def _overlay_figure(
    name: str,
    image: np.ndarray,
    attrs: Mapping[str, Any],
    label: np.ndarray | None,
    pred: np.ndarray | None,
    index: int,
    labels: LabelSpec = KAGGLE,
) -> Figure:
    if not labels.is_binary:
        return _classes_figure(name, image, attrs, label, pred, index, labels)
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, 3)
    low, high = _display_range(image, attrs)
    for ax in axes:
        ax.imshow(image, cmap="gray", vmin=low, vmax=high, interpolation="nearest")
        ax.set_axis_off()
    axes[0].set_title(f"{name}: image, z = {index}", fontsize=10)
    if label is not None:
        _draw_label(axes[1], label, fill=True, labels=labels.stored())
        _draw_label(axes[2], label, fill=False, labels=labels.stored())
    axes[1].set_title("label: 1 green, 2 (ignore) grey hatch", fontsize=10)
    if pred is not None:
        axes[2].imshow(_tint(pred != 0, PRED_RGBA), interpolation="nearest")
        if pred.any() and not pred.all():
            axes[2].contour(pred != 0, levels=[0.5], colors="red", linewidths=1.0)
    axes[2].set_title("prediction (red) over label contours", fontsize=10)
    handles = [
        Patch(facecolor=LABEL_RGBA, edgecolor="#2ca02c", label="label 1"),
        Patch(facecolor=IGNORE_RGBA, hatch="//", label="label 2 (ignore)"),
        Patch(facecolor=PRED_RGBA, edgecolor="red", label="prediction"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8)
    return fig


LABEL_RGBA = (0.17, 0.63, 0.17, 0.45)
IGNORE_RGBA = (0.6, 0.6, 0.6, 0.5)
PRED_RGBA = (1.0, 0.0, 0.0, 0.3)


def _tint(mask: np.ndarray, rgba: tuple[float, float, float, float]) -> np.ndarray:
    """An RGBA layer: `rgba` where `mask` is set, transparent elsewhere."""
    layer = np.zeros((*mask.shape, 4), np.float32)
    layer[mask] = rgba
    return layer


def _draw_label(ax: Any, label: np.ndarray, *, fill: bool, labels: LabelSpec = KAGGLE) -> None:
    fg, ignore = labels.foreground(label), labels.ignored(label)
    if fill:
        ax.imshow(_tint(fg, LABEL_RGBA), interpolation="nearest")
        ax.imshow(_tint(ignore, IGNORE_RGBA), interpolation="nearest")
    if ignore.any() and not ignore.all():
        ax.contourf(ignore, levels=[0.5, 1.5], colors="none", hatches=["//"])
    if fg.any() and not fg.all():
        ax.contour(fg, levels=[0.5], colors="#2ca02c", linewidths=1.0)


# Okabe & Ito (2008), black left out (it hides in the CT's dark voxels), then Paul Tol's muted
# palette: 15 colours, one per class of the largest spec (15 classes).
CLASS_COLOURS = (
    "#E69F00",
    "#56B4E9",
    "#009E73",
    "#F0E442",
    "#0072B2",
    "#D55E00",
    "#CC79A7",
    "#CC6677",
    "#332288",
    "#DDCC77",
    "#117733",
    "#88CCEE",
    "#882255",
    "#44AA99",
    "#999933",
)
CLASS_ALPHA = 0.5


def class_colour(index: int, alpha: float = CLASS_ALPHA) -> tuple[float, float, float, float]:
    """The RGBA colour of the class at `index` (0 for the first class) of `CLASS_COLOURS`."""
    code = CLASS_COLOURS[index % len(CLASS_COLOURS)]
    rgb = tuple(int(code[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return (rgb[0], rgb[1], rgb[2], alpha)


def class_layer(plane: np.ndarray, labels: LabelSpec) -> np.ndarray:
    """An RGBA layer of a slice in stored values: each class of `labels` in its colour, the
    ignored voxels grey, background transparent."""
    stored = labels.stored()
    layer = np.zeros((*plane.shape, 4), np.float32)
    for index, name in enumerate(stored.classes):
        layer[plane == stored.labels[name]] = class_colour(index)
    layer[stored.ignored(plane)] = IGNORE_RGBA
    return layer


def _class_contours(ax: Any, plane: np.ndarray, labels: LabelSpec) -> None:
    stored = labels.stored()
    for index, name in enumerate(stored.classes):
        mask = plane == stored.labels[name]
        if mask.any() and not mask.all():
            ax.contour(mask, levels=[0.5], colors=[CLASS_COLOURS[index]], linewidths=1.0)


def _ignore_hatch(ax: Any, plane: np.ndarray, labels: LabelSpec) -> None:
    ignore = labels.stored().ignored(plane)
    if ignore.any() and not ignore.all():
        ax.contourf(ignore, levels=[0.5, 1.5], colors="none", hatches=["//"])


def class_legend(labels: LabelSpec) -> list[Patch]:
    """A legend entry per class (its name and its value in the dataset), then the ignored value."""
    handles = [
        Patch(
            facecolor=class_colour(index),
            edgecolor=CLASS_COLOURS[index % len(CLASS_COLOURS)],
            label=f"{name} ({labels.labels[name]})",
        )
        for index, name in enumerate(labels.classes)
    ]
    if labels.ignore is not None:
        handles.append(Patch(facecolor=IGNORE_RGBA, hatch="//", label=f"ignore ({labels.ignore})"))
    return handles


def _draw_classes(
    ax: Any, label: np.ndarray | None, pred: np.ndarray | None, labels: LabelSpec
) -> None:
    """A multi-class panel: the label filled (`pred` None), or the prediction filled and the
    label outlined, its ignored voxels hatched either way."""
    if pred is not None:
        ax.imshow(class_layer(pred, labels), interpolation="nearest")
    if label is None:
        return
    if pred is None:
        ax.imshow(class_layer(label, labels), interpolation="nearest")
    else:
        _class_contours(ax, label, labels)
    _ignore_hatch(ax, label, labels)


def _outline_classes(ax: Any, label: np.ndarray | None, labels: LabelSpec) -> None:
    """A prediction panel without its prediction: the label's outlines only."""
    if label is not None:
        _class_contours(ax, label, labels)
        _ignore_hatch(ax, label, labels)


def _classes_figure(
    name: str,
    image: np.ndarray,
    attrs: Mapping[str, Any],
    label: np.ndarray | None,
    pred: np.ndarray | None,
    index: int,
    labels: LabelSpec,
) -> Figure:
    """The one-run overlay of a multi-class spec: image, label, prediction over the label."""
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, 3)
    low, high = _display_range(image, attrs)
    for ax in axes:
        ax.imshow(image, cmap="gray", vmin=low, vmax=high, interpolation="nearest")
        ax.set_axis_off()
    axes[0].set_title(f"{name}: image, z = {index}", fontsize=10)
    _draw_classes(axes[1], label, None, labels)
    axes[1].set_title("label: a colour per class, ignore grey hatch", fontsize=10)
    if pred is not None:
        _draw_classes(axes[2], label, pred, labels)
    else:
        _outline_classes(axes[2], label, labels)
    axes[2].set_title("prediction (filled) over label contours", fontsize=10)
    handles = class_legend(labels)
    fig.legend(handles=handles, loc="outside lower center", ncols=min(8, len(handles)), fontsize=8)
    return fig


def _prediction_slice(path: Path, index: int, labels: LabelSpec) -> np.ndarray:
    """The prediction's slice: as written for a binary spec (drawn as `!= 0`), in stored values
    for a multi-class one (a value outside the dataset's labels is an error naming the file)."""
    plane = _middle_slice_tif(path, index)
    return plane if labels.is_binary else labels.to_stored(plane, path)


def _one_overlay(item: Overlay, src: Sources, labels: LabelSpec = KAGGLE) -> str:
    name, image_path, label_path, pred_path = item
    image_path = Path(image_path)
    if not image_path.exists():
        return missing(f"Overlay {name}: image", [src.rel(image_path)])
    image, index, depth, attrs = _middle_slice_zarr(image_path)
    names, notes = [src.use(image_path)], []
    label = pred = None
    if label_path is not None and Path(label_path).exists():
        label, _, _, _ = _middle_slice_zarr(Path(label_path))
        names.append(src.use(Path(label_path)))
    else:
        notes.append(missing(f"Overlay {name}: label", [src.rel(label_path)] if label_path else []))
    if pred_path is not None and Path(pred_path).exists():
        pred = _prediction_slice(Path(pred_path), index, labels)
        names.append(src.use(Path(pred_path)))
    else:
        notes.append(
            missing(f"Overlay {name}: prediction", [src.rel(pred_path)] if pred_path else [])
        )
    for what, plane in (("label", label), ("prediction", pred)):
        if plane is not None and plane.shape != image.shape:
            raise CtsegError(
                f"overlay {name}: {what} slice shape {plane.shape} != image slice {image.shape}"
            )
    fig = _overlay_figure(name, image, attrs, label, pred, index, labels)
    caption = f"<h3>{esc(name)} (slice {index} of {depth})</h3>"
    return caption + "".join(notes) + png(fig, f"overlay {name}") + source_line(names)


def overlay_section(overlays: Sequence[Overlay], src: Sources, labels: LabelSpec = KAGGLE) -> str:
    """The one-run overlays; `labels`: the dataset's spec (a colour per class when it has
    several)."""
    out = ['<h2 id="overlays">Slice overlays</h2>']
    if not overlays:
        return "\n".join([*out, missing("Slice overlays")])
    out += [_one_overlay(item, src, labels) for item in overlays]
    return "\n".join(out)


# ----------------------------------------------------------------------------- several runs
# (id, image zarr, label zarr or None): each run's prediction is its predictions/<id>.tif.
Volume = tuple[str, Path, Path | None]
PANELS_PER_ROW = 6


def _runs_figure(
    name: str,
    image: np.ndarray,
    attrs: Mapping[str, Any],
    label: np.ndarray | None,
    preds: Sequence[tuple[str, np.ndarray | None]],
    index: int,
    labels: LabelSpec = KAGGLE,
) -> Figure:
    multi = not labels.is_binary
    panels = 2 + len(preds)
    cols = min(PANELS_PER_ROW, panels)
    rows = -(-panels // cols)
    fig = Figure(figsize=(3.0 * cols, 3.0 * rows + 0.5), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
    low, high = _display_range(image, attrs)
    for ax in axes[:panels]:
        ax.imshow(image, cmap="gray", vmin=low, vmax=high, interpolation="nearest")
        ax.set_axis_off()
    for ax in axes[panels:]:
        ax.set_visible(False)
    axes[0].set_title(f"{name}: image, z = {index}", fontsize=9)
    axes[1].set_title("label" if label is not None else "label: not found", fontsize=9)
    if label is not None:
        if multi:
            _draw_classes(axes[1], label, None, labels)
        else:
            _draw_label(axes[1], label, fill=True, labels=labels.stored())
    for ax, (run, pred) in zip(axes[2:], preds, strict=False):
        if multi and pred is not None:
            _draw_classes(ax, label, pred, labels)
        elif multi:
            _outline_classes(ax, label, labels)
        elif label is not None:
            _draw_label(ax, label, fill=False, labels=labels.stored())
        if pred is None:
            ax.set_title(f"{run}: no prediction", fontsize=9, color="#a33")
            continue
        if multi:
            ax.set_title(f"{run}: prediction", fontsize=9)
            continue
        ax.imshow(_tint(pred != 0, PRED_RGBA), interpolation="nearest")
        if pred.any() and not pred.all():
            ax.contour(pred != 0, levels=[0.5], colors="red", linewidths=1.0)
        ax.set_title(f"{run}: prediction", fontsize=9)
    handles = [
        Patch(facecolor=LABEL_RGBA, edgecolor="#2ca02c", label="label 1 (contour on the runs)"),
        Patch(facecolor=IGNORE_RGBA, hatch="//", label="label 2 (ignore)"),
        Patch(facecolor=PRED_RGBA, edgecolor="red", label="prediction"),
    ]
    if multi:
        handles = class_legend(labels)
    ncols = min(8, len(handles))
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=8)
    return fig


def _one_volume(
    volume: Volume,
    runs: Sequence[tuple[str, Path | None]],
    src: Sources,
    labels: LabelSpec = KAGGLE,
) -> str:
    name, image_path, label_path = volume
    image_path = Path(image_path)
    if not image_path.exists():
        return missing(f"Overlay {name}: image", [src.rel(image_path)])
    image, index, depth, attrs = _middle_slice_zarr(image_path)
    names, notes = [src.use(image_path)], []
    label = None
    if label_path is not None and Path(label_path).exists():
        label, _, _, _ = _middle_slice_zarr(Path(label_path))
        names.append(src.use(Path(label_path)))
    else:
        notes.append(missing(f"Overlay {name}: label", [src.rel(label_path)] if label_path else []))
    preds: list[tuple[str, np.ndarray | None]] = []
    for run, pred_path in runs:
        if pred_path is not None and pred_path.exists():
            preds.append((run, _prediction_slice(pred_path, index, labels)))
            names.append(src.use(pred_path))
        else:
            preds.append((run, None))
            where = [src.rel(pred_path)] if pred_path is not None else []
            notes.append(missing(f"Overlay {name}: prediction of {run}", where))
    planes = [("label", label), *((f"prediction of {r}", p) for r, p in preds)]
    for what, plane in planes:
        if plane is not None and plane.shape != image.shape:
            raise CtsegError(
                f"overlay {name}: {what} slice shape {plane.shape} != image slice {image.shape}"
            )
    fig = _runs_figure(name, image, attrs, label, preds, index, labels)
    caption = f"<h3>{esc(name)} (slice {index} of {depth}, every run)</h3>"
    return caption + "".join(notes) + png(fig, f"overlay {name}, every run") + source_line(names)


def runs_overlay_section(
    volumes: Sequence[Volume],
    runs: Sequence[tuple[str, Path | None]],
    src: Sources,
    labels: LabelSpec = KAGGLE,
) -> str:
    """The same slice of each volume for every run side by side; `runs` holds (run name, its
    predictions directory or None); `labels`: the dataset's spec (a colour per class when it
    has several)."""
    out = ['<h2 id="overlays">Slice overlays, every run</h2>']
    if not volumes:
        return "\n".join([*out, missing("Slice overlays (--overlay ID IMAGE LABEL)")])
    drawn = (
        "(filled, a colour per class) over the label's contours (the same colours)"
        if not labels.is_binary
        else "(red) over the label's contour (green)"
    )
    out.append(
        "<p class='note'>The middle slice of each volume; each run's panel is its "
        f"<code>predictions/&lt;id&gt;.tif</code> {drawn}.</p>"
    )
    for volume in volumes:
        paths = [
            (run, None if folder is None else Path(folder) / f"{volume[0]}.tif")
            for run, folder in runs
        ]
        out.append(_one_volume(volume, paths, src, labels))
    return "\n".join(out)
