"""Read and check a dataset in the Kaggle layout before any work is scheduled.

``<dataset>/{train,test}.csv`` list ``id,scroll_id``; each id has ``{split}_images/<id>.tif``
(or ``.tiff``, or a directory of 2D slices) and, for train, ``train_labels/<id>.tif``.
The Snakefile calls `read_records` while it builds the DAG, so a bad csv fails at once with the
file and the row named, instead of as a "missing input" deep inside a run.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ctseg.io import CtsegError, check_id

SPLITS = ("train", "test")


def find_volume(folder: Path, record_id: str) -> Path | None:
    """The file or slice directory holding one volume, or None."""
    candidates = (folder / f"{record_id}.tif", folder / f"{record_id}.tiff", folder / record_id)
    for candidate in candidates:
        if candidate.exists():
            return candidate
    return None


def read_csv(path: Path, require_rows: bool = False) -> pd.DataFrame:
    """The id and scroll_id columns of a dataset csv, both as text, checked row by row.

    Scroll ids stay text: read as numbers, one empty cell turns the column into floats
    ("2.0"), which then no longer match the config's scroll ids.
    """
    if not path.exists():
        raise CtsegError(f"{path}: file not found (expected columns id,scroll_id)")
    try:
        table = pd.read_csv(path, dtype={"id": str, "scroll_id": str}, skipinitialspace=True)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise CtsegError(f"{path}: cannot be read as csv: {exc}") from exc
    missing = {"id", "scroll_id"} - set(table.columns)
    if missing:
        raise CtsegError(f"{path}: missing column(s) {sorted(missing)}; expected id,scroll_id")
    if require_rows and table.empty:
        raise CtsegError(f"{path}: no records, only a header; list one id,scroll_id per row")
    for column in ("id", "scroll_id"):
        empty = table[column].isna() | (table[column].str.strip() == "")
        if empty.any():
            rows = list(table.index[empty] + 2)  # 1-based, after the header line
            raise CtsegError(f"{path}: empty {column} in row(s) {rows}")
    table["scroll_id"] = table["scroll_id"].str.strip()
    for record_id in table["id"]:
        check_id(record_id, path)
    duplicated = table["id"][table["id"].duplicated()].unique().tolist()
    if duplicated:
        raise CtsegError(f"{path}: duplicate id(s) {duplicated}")
    return table[["id", "scroll_id"]]


def read_records(dataset_dir: str | Path, require_files: bool = True) -> pd.DataFrame:
    """All records, with columns id, scroll_id, split, image and label ("" when absent)."""
    dataset_dir = Path(dataset_dir)
    frames = []
    for split in SPLITS:
        csv_path = dataset_dir / f"{split}.csv"
        if split == "test" and not csv_path.exists():
            continue
        table = read_csv(csv_path, require_rows=split == "train").assign(split=split)
        images, labels = [], []
        for record_id in table["id"]:
            image = find_volume(dataset_dir / f"{split}_images", record_id)
            label = find_volume(dataset_dir / f"{split}_labels", record_id)
            if require_files and image is None:
                raise CtsegError(
                    f"{csv_path}: id {record_id!r} is listed but "
                    f"{dataset_dir / f'{split}_images' / record_id}.tif does not exist"
                )
            if require_files and split == "train" and label is None:
                raise CtsegError(
                    f"{csv_path}: id {record_id!r} is listed but "
                    f"{dataset_dir / 'train_labels' / record_id}.tif does not exist"
                )
            images.append(str(image) if image else "")
            labels.append(str(label) if label else "")
        frames.append(table.assign(image=images, label=labels))
    records = pd.concat(frames, ignore_index=True)
    clash = records["id"][records["id"].duplicated()].unique().tolist()
    if clash:
        raise CtsegError(f"{dataset_dir}: id(s) {clash} appear in both train.csv and test.csv")
    return records
