import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile

from ctseg.io import CtsegError, check_id
from ctseg.records import RECORDED_SPLIT, read_records, select_records, write_split


def make_dataset(root: Path, ids: list[str], test_ids: tuple[str, ...] = ()) -> Path:
    volume = np.zeros((4, 8, 8), np.uint8)

    def write(path: Path) -> None:
        tifffile.imwrite(path, volume, photometric="minisblack")

    for folder in ("train_images", "train_labels", "test_images"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for record_id in ids:
        write(root / "train_images" / f"{record_id}.tif")
        write(root / "train_labels" / f"{record_id}.tif")
    for record_id in test_ids:
        write(root / "test_images" / f"{record_id}.tif")
    (root / "train.csv").write_text("id,scroll_id\n" + "".join(f"{i},1\n" for i in ids))
    (root / "test.csv").write_text("id,scroll_id\n" + "".join(f"{i},2\n" for i in test_ids))
    return root


def test_reads_train_and_test_with_paths(tmp_path):
    records = read_records(make_dataset(tmp_path, ["a1", "b.2"], ("t_3",)))
    assert list(records["id"]) == ["a1", "b.2", "t_3"]
    assert list(records["split"]) == ["train", "train", "test"]
    assert records.loc[0, "image"].endswith("train_images/a1.tif")
    assert records.loc[2, "label"] == ""


def test_slice_directory_is_a_volume(tmp_path):
    root = make_dataset(tmp_path, ["a"])
    (root / "train_images" / "a.tif").unlink()
    (root / "train_images" / "a").mkdir()
    records = read_records(root)
    assert records.loc[0, "image"].endswith("train_images/a")


@pytest.mark.parametrize("bad", ["../etc", "a/b", "x y", "semi;colon", "..", "a..b"])
def test_bad_ids_are_rejected_with_the_file_named(tmp_path, bad):
    root = make_dataset(tmp_path, ["ok"])
    (root / "train.csv").write_text(f"id,scroll_id\nok,1\n{bad},1\n")
    with pytest.raises(CtsegError, match=r"train\.csv.*bad id"):
        read_records(root)


def test_duplicate_ids_rejected(tmp_path):
    root = make_dataset(tmp_path, ["a", "b"])
    (root / "train.csv").write_text("id,scroll_id\na,1\nb,1\na,2\n")
    with pytest.raises(CtsegError, match=r"train\.csv: duplicate id\(s\) \['a'\]"):
        read_records(root)


def test_id_in_both_splits_rejected(tmp_path):
    root = make_dataset(tmp_path, ["a"], ("a",))
    with pytest.raises(CtsegError, match="both train.csv and test.csv"):
        read_records(root)


def test_missing_listed_file_is_named(tmp_path):
    root = make_dataset(tmp_path, ["a", "b"])
    (root / "train_labels" / "b.tif").unlink()
    with pytest.raises(CtsegError, match=r"train\.csv: id 'b' is listed but .*train_labels/b\.tif"):
        read_records(root)


def test_missing_columns_and_missing_csv(tmp_path):
    root = make_dataset(tmp_path, ["a"])
    (root / "train.csv").write_text("name\na\n")
    with pytest.raises(CtsegError, match="missing column"):
        read_records(root)
    (root / "train.csv").unlink()
    with pytest.raises(CtsegError, match="train.csv: file not found"):
        read_records(root)


def test_check_id_accepts_kaggle_ids():
    assert check_id("1004283650", "x.csv") == "1004283650"


def test_train_csv_with_only_a_header_is_named(tmp_path):
    root = make_dataset(tmp_path, [])
    with pytest.raises(CtsegError, match=r"train\.csv: no records, only a header"):
        read_records(root)


def test_test_csv_with_only_a_header_means_no_test_records(tmp_path):
    records = read_records(make_dataset(tmp_path, ["a"]))
    assert list(records["split"]) == ["train"]


@pytest.mark.parametrize("empty", ["", "  "])
def test_empty_scroll_id_is_named_with_its_row(tmp_path, empty):
    root = make_dataset(tmp_path, ["a", "b", "c"])
    (root / "train.csv").write_text(f"id,scroll_id\na,1\nb,{empty}\nc,2\n")
    with pytest.raises(CtsegError, match=r"train\.csv: empty scroll_id in row\(s\) \[3\]"):
        read_records(root)


def test_scroll_ids_stay_as_written(tmp_path):
    root = make_dataset(tmp_path, ["a", "b", "c"])
    (root / "train.csv").write_text("id,scroll_id\na,2\nb,034117\nc, 2\n")
    records = read_records(root)
    # Not 2.0, not 34117: the config names scroll ids as they are written.
    assert list(records["scroll_id"]) == ["2", "034117", "2"]


# --------------------------------------------------------------------------- select_records


def records_table(n: int = 10) -> pd.DataFrame:
    ids = [f"id{i:02d}" for i in range(n)]
    return pd.DataFrame({"id": ids, "scroll_id": [34117 if i % 2 else 35360 for i in range(n)]})


SUBSET = {"ids": None, "scroll_ids": None, "fraction": 1.0}
SPLIT = {"val_ids": None, "val_fraction": 0.2, "seed": 0}


def test_select_records_is_sorted_deterministic_and_independent_of_row_order() -> None:
    records = records_table()
    table = select_records(records, SUBSET, SPLIT)
    assert list(table.columns) == ["id", "scroll_id", "split"]
    assert list(table["id"]) == sorted(records["id"])
    assert (table["split"] == "val").sum() == 2
    shuffled = records.sample(frac=1.0, random_state=5)
    pd.testing.assert_frame_equal(select_records(shuffled, SUBSET, SPLIT), table)
    val_sets = {
        tuple(select_records(records, SUBSET, {**SPLIT, "seed": s}).query("split == 'val'")["id"])
        for s in range(8)
    }
    assert len(val_sets) > 1, "the seed must decide the split"


def test_select_records_subset_by_ids_scroll_ids_and_fraction() -> None:
    records = records_table()
    by_ids = select_records(records, {**SUBSET, "ids": ["id07", "id03"]}, SPLIT)
    assert list(by_ids["id"]) == ["id03", "id07"]
    by_scroll = select_records(records, {**SUBSET, "scroll_ids": ["34117"]}, SPLIT)
    assert set(by_scroll["scroll_id"]) == {34117} and len(by_scroll) == 5
    half = select_records(records, {**SUBSET, "fraction": 0.5}, SPLIT)
    assert len(half) == 5
    assert len(select_records(records_table(5), {**SUBSET, "fraction": 0.5}, SPLIT)) == 3
    assert half.equals(select_records(records, {**SUBSET, "fraction": 0.5}, SPLIT))
    # The subset must not move when only the validation share changes.
    other_split = select_records(
        records, {**SUBSET, "fraction": 0.5}, {**SPLIT, "val_fraction": 0.4}
    )
    assert list(other_split["id"]) == list(half["id"])


def test_select_records_val_ids_win_over_val_fraction() -> None:
    table = select_records(records_table(), SUBSET, {**SPLIT, "val_ids": ["id04"]})
    assert list(table.loc[table["split"] == "val", "id"]) == ["id04"]


@pytest.mark.parametrize("group_by", [None, "scroll"])
def test_val_ids_in_the_test_split_are_refused_by_name(group_by: str | None) -> None:
    ids = ["id02", "id04"] if group_by is None else [f"id{i:02d}" for i in range(0, 10, 2)]
    split = {**SPLIT, "val_ids": ids, "test_ids": ids, "group_by": group_by}
    with pytest.raises(CtsegError) as err:
        select_records(records_table(), SUBSET, split)
    assert str(err.value) == (
        f"split.val_ids: id(s) {ids} are also in the test split (split.test_ids); a record is "
        "in val or in test, not both: remove them from split.val_ids or from the test split"
    )
    # Only the overlap is named, also when the test split was drawn by test_fraction.
    drawn = select_records(records_table(), SUBSET, {**SPLIT, "test_fraction": 0.3})
    test = sorted(drawn.loc[drawn["split"] == "test", "id"])
    other = next(i for i in drawn["id"] if i not in test)
    split = {**SPLIT, "val_ids": [test[0], other]}
    with pytest.raises(
        CtsegError,
        match=rf"id\(s\) \['{test[0]}'\] are also in the test split \(split.test_fraction\)",
    ):
        select_records(records_table(), SUBSET, {**split, "test_fraction": 0.3})


def test_select_records_keeps_one_train_and_one_val() -> None:
    two = select_records(records_table(2), SUBSET, {**SPLIT, "val_fraction": 0.01})
    assert sorted(two["split"]) == ["train", "val"]
    two = select_records(records_table(2), SUBSET, {**SPLIT, "val_fraction": 0.9})
    assert sorted(two["split"]) == ["train", "val"]
    one = select_records(records_table(1), SUBSET, {**SPLIT, "val_fraction": 0.5})
    assert list(one["split"]) == ["train"]


@pytest.mark.parametrize(
    ("subset", "split", "named"),
    [
        ({"ids": ["id01", "nope"]}, {}, "nope"),
        ({"scroll_ids": [99999]}, {}, "99999"),
        ({}, {"val_ids": ["ghost"]}, "ghost"),
        ({"ids": ["id01"]}, {"val_ids": ["id02"]}, "id02"),
        ({"ids": ["id01"]}, {"val_ids": ["id01"]}, "at least one train"),
        ({"fraction": 0}, {}, "subset.fraction"),
        ({"fraction": 1.5}, {}, "subset.fraction"),
        ({"ids": ["id01"], "scroll_ids": [34117]}, {}, "not both"),
        ({}, {"val_fraction": 1.0}, "split.val_fraction"),
    ],
)
def test_select_records_rejects_bad_choices(subset: dict, split: dict, named: str) -> None:
    with pytest.raises(CtsegError, match=named):
        select_records(records_table(), {**SUBSET, **subset}, {**SPLIT, **split})


def test_select_records_names_records_without_a_scroll_id() -> None:
    # A table that did not come through records.read_csv (which rejects empty scroll ids).
    records = pd.DataFrame({"id": ["a", "b", "c"], "scroll_id": pd.array(["1", None, "2"])})
    with pytest.raises(CtsegError, match=r"record\(s\) \['b'\] have no scroll_id"):
        select_records(records, {**SUBSET, "scroll_ids": [1]}, SPLIT)


def test_write_split_writes_csv_atomically(tmp_path: Path) -> None:
    table = select_records(records_table(), SUBSET, SPLIT)
    path = tmp_path / "results" / "exp" / "split.csv"
    write_split(table, path)
    back = pd.read_csv(path, dtype={"id": str})
    pd.testing.assert_frame_equal(back, table)
    assert sorted(os.listdir(path.parent)) == ["split.csv", RECORDED_SPLIT]


# --------------------------------------------------------------------------- a stable split


def test_added_records_leave_the_recorded_val_and_test_ids_where_they_were(tmp_path) -> None:
    split = {**SPLIT, "val_fraction": 0.25, "test_fraction": 0.2}
    path = tmp_path / "exp" / "split.csv"
    before = write_split(select_records(records_table(12), SUBSET, split), path)
    assert sorted(os.listdir(path.parent)) == ["split.csv", RECORDED_SPLIT]
    held = before.loc[before["split"] != "train", ["id", "split"]]
    # Drawn afresh, one more record moves the split (the permutation is over n records)...
    fresh = select_records(records_table(13), SUBSET, split)
    moved = fresh.set_index("id").loc[held["id"], "split"]
    assert list(moved) != list(held["split"]), "the fresh draw must move some held-out id"
    # ...and kept: every recorded id where it was, the new record in its fresh part.
    after = write_split(fresh, path)
    kept = after.set_index("id")["split"]
    assert list(kept.loc[before["id"]]) == list(before["split"])
    assert kept["id12"] == fresh.set_index("id").loc["id12", "split"]
    assert pd.read_csv(path, dtype={"id": str})["split"].tolist() == list(after["split"])


def test_a_recorded_split_keeps_whole_scrolls_together(tmp_path) -> None:
    split = {**SPLIT, "val_fraction": 0.3, "group_by": "scroll"}
    records = pd.DataFrame(
        {"id": [f"r{i}" for i in range(9)], "scroll_id": [str(i % 3) for i in range(9)]}
    )
    path = tmp_path / "split.csv"
    before = write_split(select_records(records, SUBSET, split), path)
    more = pd.concat([records, pd.DataFrame({"id": ["r9", "r10"], "scroll_id": ["0", "1"]})])
    after = write_split(select_records(more, SUBSET, split), path)
    for scroll, rows in after.groupby("scroll_id"):
        assert rows["split"].nunique() == 1, f"scroll {scroll} spans two sides"
    kept = after.set_index("id")["split"]
    assert list(kept.loc[before["id"]]) == list(before["split"])


def test_a_change_that_moves_recorded_held_out_ids_is_refused_with_the_way_to_accept_it(
    tmp_path,
) -> None:
    path = tmp_path / "exp" / "split.csv"
    recorded = path.parent / RECORDED_SPLIT
    write_split(select_records(records_table(), SUBSET, SPLIT), path)
    other_seed = select_records(records_table(), SUBSET, {**SPLIT, "seed": 5})
    with pytest.raises(CtsegError) as refused:
        write_split(other_seed, path)
    message = str(refused.value)
    assert message.startswith(f"{recorded}: its selection settings changed, and the new split ")
    assert message.endswith(
        "; scores before and after would be on different volumes. To accept the new split, "
        f"delete {recorded}"
    )
    assert "(val -> train)" in message
    # Nothing was written; deleting the record accepts the new split.
    assert json.loads(recorded.read_text())["selection"]["split"]["seed"] == 0
    recorded.unlink()
    assert list(write_split(other_seed, path)["split"]) == list(other_seed["split"])


def test_a_recorded_val_id_no_longer_selected_is_refused(tmp_path) -> None:
    path = tmp_path / "split.csv"
    subset = {**SUBSET, "fraction": 0.6}
    before = write_split(select_records(records_table(10), subset, SPLIT), path)
    val = before.loc[before["split"] == "val", "id"].tolist()
    for n in range(11, 20):  # added records redraw the subset until a val id drops out
        fresh = select_records(records_table(n), subset, SPLIT)
        if not set(val) <= set(fresh["id"]):
            break
    else:
        pytest.fail("no added record redrew the subset without a val id")
    with pytest.raises(CtsegError, match=r"the records changed, .*-> not selected\)"):
        write_split(fresh, path)


def test_an_unreadable_recorded_split_names_the_fix(tmp_path) -> None:
    (tmp_path / RECORDED_SPLIT).write_text("{not json")
    with pytest.raises(
        CtsegError, match=r"split.recorded.json: unreadable recorded split .*delete it"
    ):
        write_split(select_records(records_table(), SUBSET, SPLIT), tmp_path / "split.csv")
