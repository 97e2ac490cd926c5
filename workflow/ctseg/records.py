"""Read and check a dataset in the Kaggle layout before any work is scheduled, and choose an
experiment's records from it (`select_records`, written as split.csv by `write_split`).

A run's split stays stable when records are added or removed: `write_split` records it beside
split.csv (`RECORDED_SPLIT`), and the next selection keeps every recorded id where it was, the
new ids taking their part from the fresh selection (`keep_recorded`). A change that would move
an id recorded in val or test (other selection settings, folds redrawn, a record deselected) is
refused, naming the file whose deletion accepts it.

``<dataset>/{train,test}.csv`` list ``id,scroll_id``; each id has ``{split}_images/<id>.tif``
(or ``.tiff``, or a directory of 2D slices) and, for train, ``train_labels/<id>.tif``.
The Snakefile calls `read_records` while it builds the DAG, so a bad csv fails at once with the
file and the row named, instead of as a "missing input" deep inside a run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ctseg.io import CtsegError, atomic_path, check_id

SPLITS = ("train", "test")
# Beside split.csv: the split as written and the selection settings it was drawn under, so the
# next selection keeps its ids where they were. Not a Snakemake output: a rerun of the split
# job (records added) finds it where the job's declared output is deleted first.
RECORDED_SPLIT = "split.recorded.json"
HELD_OUT = ("val", "test")
# The moved ids a refusal names, before "and N more".
MOVED_SHOWN = 3


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
    frames, lacking = [], []
    for split in SPLITS:
        csv_path = dataset_dir / f"{split}.csv"
        if split == "test" and not csv_path.exists():
            continue
        table = read_csv(csv_path, require_rows=split == "train").assign(split=split)
        images, labels = [], []
        missing: dict[str, list[Path]] = {}  # id -> the files it lacks
        for record_id in table["id"]:
            image = find_volume(dataset_dir / f"{split}_images", record_id)
            label = find_volume(dataset_dir / f"{split}_labels", record_id)
            if image is None:
                missing.setdefault(record_id, []).append(
                    dataset_dir / f"{split}_images" / f"{record_id}.tif"
                )
            if split == "train" and label is None:
                missing.setdefault(record_id, []).append(
                    dataset_dir / "train_labels" / f"{record_id}.tif"
                )
            images.append(str(image) if image else "")
            labels.append(str(label) if label else "")
        if require_files and missing:
            lacking.append(missing_files_message(csv_path, missing))
        frames.append(table.assign(image=images, label=labels))
    if lacking:  # both csv files at once, too
        raise CtsegError("; also ".join(lacking))
    records = pd.concat(frames, ignore_index=True)
    clash = records["id"][records["id"].duplicated()].unique().tolist()
    if clash:
        raise CtsegError(f"{dataset_dir}: id(s) {clash} appear in both train.csv and test.csv")
    return records


# The missing files a message names, before "and N more": enough to see a pattern.
MISSING_SHOWN = 3


def missing_files_message(csv_path: Path, missing: Mapping[str, list[Path]]) -> str:
    """Every listed id without its files in one line (the count and the first few), so that a
    copy that lost many volumes is not found one rerun at a time."""

    def lacks(files: list[Path]) -> str:
        return " and ".join(str(f) for f in files) + (" do" if len(files) > 1 else " does")

    if len(missing) == 1:
        [(record_id, files)] = missing.items()
        return (
            f"{csv_path}: id {record_id!r} is listed but {lacks(files)} not exist; remove its "
            f"row from {csv_path}, or add the file"
        )
    shown = [f"{i!r} ({lacks(files)} not exist)" for i, files in missing.items()]
    more = len(missing) - MISSING_SHOWN
    listed = ", ".join(shown[:MISSING_SHOWN]) + (f" and {more} more" if more > 0 else "")
    return (
        f"{csv_path}: {len(missing)} listed ids lack their files: {listed}; remove those rows "
        f"from {csv_path}, or add their files"
    )


# --------------------------------------------------------------------------- record selection


def select_records(records: pd.DataFrame, subset: Mapping, split: Mapping) -> pd.DataFrame:
    """Pick the experiment's records and split them into train, val and test.

    records: columns id, scroll_id (the labelled training records). subset: {ids, scroll_ids,
    fraction} (at most one of ids / scroll_ids; fraction in (0, 1] applies after them).
    split: {val_ids, val_fraction, seed, test_ids, test_fraction, folds, fold, group_by}:
    - test (test_ids, else test_fraction) is taken first; neither training nor tuning sees it;
    - val is fold `fold` of `folds` (see `assign_folds`) when a fold is given, else val_ids,
      else val_fraction of the rest;
    - with group_by: scroll, or with subset.scroll_ids, whole scrolls go to one side.
    Returns columns id, scroll_id, split ('train' | 'val' | 'test'), sorted by id; the same
    inputs and seed always give the same table, whatever the row order of `records`.
    """
    table = records[["id", "scroll_id"]].copy()
    table["id"] = table["id"].astype(str)
    if table.empty:
        raise CtsegError("subset: there are no labelled training records to choose from")
    table = table.sort_values("id", kind="stable").reset_index(drop=True)
    seed = _seed(split)
    table = _filter_subset(table, subset)
    table = _take_fraction(table, subset.get("fraction", 1.0), seed)
    by_scroll = split.get("group_by") == "scroll"
    test = _choose_test(table, split, seed, by_scroll)
    rest = table[~table["id"].isin(test)].reset_index(drop=True)
    if split.get("fold") is not None:
        folds = assign_folds(rest, split, folds_by_scroll(subset, split))
        val = {i for i, f in folds.items() if f == split["fold"]}
    elif by_scroll and split.get("val_ids") is None:
        val = _choose_groups(rest, split.get("val_fraction", 0.0) or 0.0, [seed, 1], "val")
    else:
        _check_val_not_test(split, test)
        val = _choose_val(rest, split, seed)
        if by_scroll:
            _check_whole_scrolls(rest, val, "split.val_ids")
    table["split"] = np.where(
        table["id"].isin(test), "test", np.where(table["id"].isin(val), "val", "train")
    )
    if (table["split"] == "train").sum() == 0:
        raise CtsegError(
            f"split: every selected record ({len(table)}) is in val or test; "
            "at least one train record is needed"
        )
    table = table.reset_index(drop=True)
    # What `keep_recorded` compares with a recorded split: the settings and every candidate id
    # (a recorded val id that is still a candidate but no longer selected has moved).
    table.attrs["selection"] = selection_settings(subset, split)
    table.attrs["candidates"] = sorted(records["id"].astype(str))
    return table


def folds_by_scroll(subset: Mapping, split: Mapping) -> bool:
    """Folds keep scrolls whole with group_by: scroll, and whenever the subset is chosen by
    scroll (a model is then meant to generalise across scrolls)."""
    return split.get("group_by") == "scroll" or subset.get("scroll_ids") is not None


def assign_folds(table: pd.DataFrame, split: Mapping, by_scroll: bool) -> dict[str, int]:
    """Each record's fold, 0..folds-1, for the records of `table` (the selection less its test
    split). Groups (records, or scrolls with `by_scroll`) are shuffled with the seed, then the
    largest first go to the fold with the fewest records: folds as even as the groups allow,
    and the same for the same records and seed."""
    folds = split.get("folds")
    if folds is None or isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise CtsegError(f"split.folds: expected an integer of at least 2, got {folds!r}")
    fold = split.get("fold")
    if fold is not None and not 0 <= fold < folds:
        raise CtsegError(f"split.fold: fold {fold} is out of range 0..{folds - 1}")
    key = (table["scroll_id"] if by_scroll else table["id"]).astype(str)
    groups = sorted(set(key))
    if len(groups) < folds:
        what = "scrolls" if by_scroll else "records"
        raise CtsegError(
            f"split.folds: {folds} folds need at least {folds} {what}, and the selection "
            f"(less its test split) has {len(groups)}: lower split.folds or select more records"
        )
    order = np.random.default_rng([_seed(split), 3]).permutation(len(groups))
    shuffled = [groups[i] for i in order]
    sizes = {g: int((key == g).sum()) for g in groups}
    shuffled.sort(key=lambda g: -sizes[g])  # stable: ties keep the shuffled order
    load = [0] * folds
    fold_of_group = {}
    for group in shuffled:
        target = min(range(folds), key=lambda f: (load[f], f))
        fold_of_group[group] = target
        load[target] += sizes[group]
    return {i: fold_of_group[k] for i, k in zip(table["id"], key, strict=True)}


def _choose_test(table: pd.DataFrame, split: Mapping, seed: int, by_scroll: bool) -> set[str]:
    test_ids = split.get("test_ids")
    if test_ids is not None:
        wanted = {str(i) for i in test_ids}
        unknown = sorted(wanted - set(table["id"]))
        if unknown:
            raise CtsegError(f"split.test_ids: id(s) {unknown} are not among the selected records")
        if by_scroll:
            _check_whole_scrolls(table, wanted, "split.test_ids")
        return wanted
    fraction = split.get("test_fraction", 0.0) or 0.0
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction < 1:
        raise CtsegError(f"split.test_fraction: expected a number in [0, 1), got {fraction!r}")
    if fraction == 0:
        return set()
    if by_scroll:
        return _choose_groups(table, fraction, [seed, 2], "test")
    n = len(table)
    n_test = min(max(_round_half_up(fraction * n), 1), n - 1) if n >= 2 else 0
    order = np.random.default_rng([seed, 2]).permutation(n)
    return set(table["id"].iloc[order[:n_test]])


def _choose_groups(table: pd.DataFrame, fraction: float, stream: list[int], what: str) -> set[str]:
    """Whole scrolls, shuffled, until they hold `fraction` of the records (at least one scroll
    when fraction > 0, never every scroll)."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction < 1:
        raise CtsegError(f"split.{what}_fraction: expected a number in [0, 1), got {fraction!r}")
    scroll = table["scroll_id"].astype(str)
    scrolls = sorted(set(scroll))
    if fraction == 0 or not scrolls:
        return set()
    if len(scrolls) < 2:
        raise CtsegError(
            f"split.{what}_fraction: whole scrolls go to {what}, and the selection has one "
            f"scroll ({scrolls[0]}); select records of at least 2 scrolls or set group_by: record"
        )
    order = np.random.default_rng(stream).permutation(len(scrolls))
    want = fraction * len(table)
    chosen: list[str] = []
    for i in order[:-1]:  # never every scroll
        chosen.append(scrolls[i])
        if scroll.isin(chosen).sum() >= want:
            break
    return set(table.loc[scroll.isin(chosen), "id"])


def _check_whole_scrolls(table: pd.DataFrame, ids: set[str], key: str) -> None:
    scrolls = table["scroll_id"].astype(str)
    for scroll in sorted(set(scrolls[table["id"].isin(ids)])):
        members = set(table.loc[scrolls == scroll, "id"])
        if not members <= ids:
            raise CtsegError(
                f"{key}: scroll {scroll} would span two sides (missing {sorted(members - ids)}); "
                "list every record of a scroll, or set split.group_by: record"
            )


def _seed(split: Mapping) -> int:
    seed = split.get("seed", 0)
    if seed is None:
        seed = 0
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise CtsegError(f"split.seed: expected a non-negative integer, got {seed!r}")
    return int(seed)


def _filter_subset(table: pd.DataFrame, subset: Mapping) -> pd.DataFrame:
    ids, scroll_ids = subset.get("ids"), subset.get("scroll_ids")
    if ids is not None and scroll_ids is not None:
        raise CtsegError("subset: give ids or scroll_ids, not both")
    if ids is not None:
        wanted = [str(i) for i in ids]
        unknown = sorted(set(wanted) - set(table["id"]))
        if unknown:
            raise CtsegError(f"subset.ids: unknown id(s) {unknown}: not labelled training records")
        table = table[table["id"].isin(wanted)]
    if scroll_ids is not None:
        if table["scroll_id"].isna().any():
            # pandas keeps a missing value missing through astype(str); records.read_csv
            # rejects them, so only a table built elsewhere gets here.
            empty = table.loc[table["scroll_id"].isna(), "id"].tolist()
            raise CtsegError(f"subset.scroll_ids: record(s) {empty} have no scroll_id")
        # Compare as text: the csv column may be read as int while config gives str, or back.
        wanted = {str(s) for s in scroll_ids}
        have = set(table["scroll_id"].astype(str))
        unknown = sorted(wanted - have)
        if unknown:
            raise CtsegError(
                f"subset.scroll_ids: unknown scroll id(s) {unknown}; known: {sorted(have)}"
            )
        table = table[table["scroll_id"].astype(str).isin(wanted)]
    if table.empty:
        raise CtsegError("subset: selects no records")
    return table.reset_index(drop=True)


def _take_fraction(table: pd.DataFrame, fraction: Any, seed: int) -> pd.DataFrame:
    fraction = 1.0 if fraction is None else fraction
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise CtsegError(f"subset.fraction: expected a number in (0, 1], got {fraction!r}")
    keep = max(1, _round_half_up(fraction * len(table)))
    if keep >= len(table):
        return table
    # Separate streams for subset and split, so changing val_fraction keeps the subset.
    order = np.random.default_rng([seed, 0]).permutation(len(table))
    return table.iloc[np.sort(order[:keep])].reset_index(drop=True)


def _check_val_not_test(split: Mapping, test: set[str]) -> None:
    val_ids = split.get("val_ids")
    both = sorted({str(i) for i in val_ids or ()} & test)
    if both:
        chosen = "split.test_ids" if split.get("test_ids") is not None else "split.test_fraction"
        raise CtsegError(
            f"split.val_ids: id(s) {both} are also in the test split ({chosen}); a record is in "
            "val or in test, not both: remove them from split.val_ids or from the test split"
        )


def _choose_val(table: pd.DataFrame, split: Mapping, seed: int) -> set[str]:
    val_ids = split.get("val_ids")
    if val_ids is not None:
        wanted = {str(i) for i in val_ids}
        unknown = sorted(wanted - set(table["id"]))
        if unknown:
            raise CtsegError(f"split.val_ids: id(s) {unknown} are not among the selected records")
        return wanted
    fraction = split.get("val_fraction", 0.0)
    fraction = 0.0 if fraction is None else fraction
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction < 1:
        raise CtsegError(f"split.val_fraction: expected a number in [0, 1), got {fraction!r}")
    n = len(table)
    # At least one val record whenever asked for and possible, and always one train record.
    n_val = min(max(_round_half_up(fraction * n), 1), n - 1) if n >= 2 and fraction > 0 else 0
    order = np.random.default_rng([seed, 1]).permutation(n)
    return set(table["id"].iloc[order[:n_val]])


def _round_half_up(value: float) -> int:
    # round() rounds 2.5 to 2; a user asking for half of 5 records expects 3.
    return math.floor(value + 0.5)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def selection_settings(subset: Mapping, split: Mapping) -> dict[str, Any]:
    """The settings a selection is drawn under, as plain JSON values (what a recorded split
    keeps to tell added records from changed settings)."""
    return {"subset": _plain(subset), "split": _plain(split)}


def read_recorded_split(path: Path) -> dict[str, Any] | None:
    """The split recorded beside a split.csv (`RECORDED_SPLIT`), or None when there is none."""
    if not path.exists():
        return None
    try:
        recorded = json.loads(path.read_text())
        parts = {str(k): str(v) for k, v in recorded["parts"].items()}
        return {"selection": recorded["selection"], "parts": parts}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CtsegError(
            f"{path}: unreadable recorded split ({type(exc).__name__}); delete it to draw the "
            "split afresh (the run's val and test ids may then change)"
        ) from exc


def keep_recorded(
    fresh: pd.DataFrame, recorded: Mapping[str, Any] | None, where: Path
) -> pd.DataFrame:
    """`fresh` (a `select_records` table) with the ids of `recorded` (`read_recorded_split`,
    read from `where`) kept where they were.

    Under the recorded selection settings, every recorded id still selected keeps its part and
    a new id takes its part from `fresh` (with split.group_by: scroll, the part of its scroll's
    recorded ids): added records leave the split as it was. Anything else that would move an
    id recorded in val or test (other settings, a fold redrawn, a record no longer selected)
    is refused; deleting `where` accepts the new split."""
    if recorded is None:
        return fresh
    parts = recorded["parts"]
    now = dict(zip(fresh["id"], fresh["split"], strict=True))
    candidates = set(fresh.attrs.get("candidates", now))
    moved = sorted(
        i
        for i, part in parts.items()
        if part in HELD_OUT and i in candidates and now.get(i) != part
    )
    selection = fresh.attrs.get("selection")
    same = selection is not None and selection == recorded["selection"]
    split = (selection or {}).get("split", {})
    if same and split.get("fold") is None and all(i in now for i in moved):
        return _extend(fresh, parts, by_scroll=split.get("group_by") == "scroll")
    if not moved:
        return fresh
    shown = ", ".join(f"{i} ({parts[i]} -> {now.get(i, 'not selected')})" for i in moved[:3])
    more = len(moved) - MOVED_SHOWN
    why = "its selection settings changed" if not same else "the records changed"
    raise CtsegError(
        f"{where}: {why}, and the new split would move {len(moved)} id(s) recorded in val or "
        f"test: {shown}{f' and {more} more' if more > 0 else ''}; scores before and after "
        f"would be on different volumes. To accept the new split, delete {where}"
    )


def _extend(fresh: pd.DataFrame, parts: Mapping[str, str], by_scroll: bool) -> pd.DataFrame:
    """Recorded ids in their recorded part; new ids in their fresh part, or with `by_scroll`
    in the part their scroll's recorded ids are in."""
    scroll_part = {}
    if by_scroll:
        for record_id, scroll in zip(fresh["id"], fresh["scroll_id"].astype(str), strict=True):
            if record_id in parts:
                scroll_part[scroll] = parts[record_id]
    table = fresh.copy()
    table["split"] = [
        parts.get(i) or scroll_part.get(s) or part
        for i, s, part in zip(
            table["id"], table["scroll_id"].astype(str), table["split"], strict=True
        )
    ]
    table.attrs = dict(fresh.attrs)
    return table


def write_split(table: pd.DataFrame, path: Path) -> pd.DataFrame:
    """Write the split table (id, scroll_id, split) as csv, keeping the ids of the split
    recorded beside it where they were (`keep_recorded`), and record it; both atomically.
    Returns the table written."""
    path = Path(path)
    recorded_path = path.parent / RECORDED_SPLIT
    table = keep_recorded(table, read_recorded_split(recorded_path), recorded_path)
    recorded = {
        "selection": table.attrs.get("selection"),
        "parts": dict(zip(table["id"], table["split"], strict=True)),
    }
    with atomic_path(path) as tmp:
        table[["id", "scroll_id", "split"]].to_csv(tmp, index=False)
    with atomic_path(recorded_path) as tmp:
        tmp.write_text(json.dumps(recorded, indent=1, sort_keys=True))
    return table
