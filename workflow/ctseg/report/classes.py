"""The report's per-class section: Dice and SurfaceDice of each class over the scored volumes.

It renders a run's ``evaluation/per_class.csv`` (written by `ctseg.evaluation.classes`: one row
per volume and class, then each volume's ``mean`` row) as one table row per class, in the file's
order, with the mean over the volumes ± their standard deviation (sample, ddof 1; the mean alone
for one volume), the number of volumes where the class is in neither the label nor the
prediction (such a volume scores 1.0 for the class), and the mean voxel counts.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ctseg.formatting import fmt, num
from ctseg.io import CtsegError
from ctseg.report.markup import Sources, missing, read_table, source_line, table

PER_CLASS_FILE = "per_class.csv"
PER_CLASS_COLUMNS = ("id", "class", "value", "dice", "surface_dice", "gt_voxels", "pred_voxels")
MEAN_ROW = "mean"
HEADER = (
    "class",
    "value",
    "volumes",
    "Dice",
    "SurfaceDice",
    "empty in",
    "label voxels",
    "predicted voxels",
)


def read_per_class(path: Path) -> pd.DataFrame:
    """per_class.csv, its columns checked; a file that is not one is an error naming it."""
    frame = read_table(path, dtype={"id": str, "class": str})
    absent = [c for c in PER_CLASS_COLUMNS if c not in frame.columns]
    if absent:
        raise CtsegError(
            f"{path}: not an evaluation per_class.csv (no {', '.join(absent)} column); "
            "re-run the evaluate rule"
        )
    if frame.empty:
        raise CtsegError(f"{path}: per_class.csv has no rows; re-run the evaluate rule")
    return frame


def spread(values: pd.Series) -> str:
    """Mean ± sample standard deviation to 4 significant figures; the mean alone for one."""
    values = values.astype(float)
    if len(values) < 2:
        return fmt(values.mean(), 4)
    return f"{fmt(values.mean(), 4)} ± {fmt(values.std(ddof=1), 4)}"


def class_rows(frame: pd.DataFrame) -> list[list[str]]:
    """One row per class (the file's order, the mean row last): the cells of `HEADER`."""
    rows, mean_row = [], None
    for name, group in frame.groupby("class", sort=False):
        value = num(group["value"].iloc[0])
        empty = int((~group[["gt_voxels", "pred_voxels"]].astype(bool).any(axis=1)).sum())
        row = [
            str(name) if name != MEAN_ROW else "mean over classes",
            "" if value is None else str(int(value)),
            str(group["id"].nunique()),
            spread(group["dice"]),
            spread(group["surface_dice"]),
            str(empty),
            fmt(group["gt_voxels"].astype(float).mean(), 4),
            fmt(group["pred_voxels"].astype(float).mean(), 4),
        ]
        if name == MEAN_ROW:
            mean_row = row
        else:
            rows.append(row)
    return rows + ([mean_row] if mean_row is not None else [])


def per_class_section(evaluation_dir: Path | None, src: Sources, *, required: bool = True) -> str:
    """The per-class table of ``evaluation_dir/per_class.csv``; a "not found" note when the file
    is absent, or nothing at all when it is not `required` (a binary run, which has none)."""
    out = ['<h2 id="per-class">Per-class scores</h2>']
    path = None if evaluation_dir is None else Path(evaluation_dir) / PER_CLASS_FILE
    if path is None or not path.exists():
        if not required:
            return ""
        return "\n".join([*out, missing("Per-class scores", [src.rel(path)] if path else [])])
    frame = read_per_class(path)
    name = src.use(path)
    volumes = frame["id"].nunique()
    out.append(
        f"<p class='note'>Dice and SurfaceDice (tolerance 2 voxels of the finest axis) of each "
        f"class over {volumes} scored volume{'s' if volumes != 1 else ''}: mean ± standard "
        "deviation over the volumes. Ignored voxels count in neither mask; a class in neither "
        "the label nor the prediction of a volume scores 1.0 there (<i>empty in</i> counts "
        "those volumes). The last row is each volume's mean over the classes.</p>"
    )
    out.append(table(HEADER, class_rows(frame)))
    out.append(source_line([name]))
    return "\n".join(out)
