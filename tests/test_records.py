from pathlib import Path

import numpy as np
import pytest
import tifffile

from ctseg.io import CtsegError, check_id
from ctseg.records import read_records


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
