"""Many experiments: `extends`, folds, the labelled test split, and the config fixes that make
`--config` and a broken config.yaml say what is wrong (ctseg.config, ctseg.records)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import REPO

from ctseg.config import (
    command_line_values,
    load_experiment,
    load_run,
    read_yaml,
    settings_used,
    with_fold,
)
from ctseg.io import CtsegError
from ctseg.records import assign_folds, select_records

EXPERIMENTS = REPO / "config" / "experiments"
SUBSET = {"ids": None, "scroll_ids": None, "fraction": 1.0}


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


# ----------------------------------------------------------------------------- extends
def test_extends_overrides_only_the_keys_it_gives(tmp_path: Path) -> None:
    write(
        tmp_path / "base.yaml",
        yaml.safe_load((EXPERIMENTS / "exp001.yaml").read_text()) | {"name": "base"},
    )
    child = write(
        tmp_path / "child.yaml",
        {"name": "child", "extends": "base", "train": {"lr": 0.01}, "model": {"filters": [4, 8]}},
    )
    base, exp = load_experiment(tmp_path / "base.yaml"), load_experiment(child)
    assert exp.name == "child"
    assert exp.train["lr"] == 0.01
    # Mappings merge key by key: the rest of train is the parent's ...
    assert exp.train["epochs"] == base.train["epochs"] == 2
    assert exp.train["steps_per_epoch"] == base.train["steps_per_epoch"]
    # ... lists are replaced whole.
    assert exp.model["filters"] == [4, 8]
    assert exp.data == base.data and exp.loss == base.loss
    # The effective settings are what the rules' settings params (and so reruns) use.
    assert settings_used(exp, None, "train")["train"]["lr"] == 0.01
    assert settings_used(exp, None, "train")["data"] == settings_used(base, None, "train")["data"]


def test_extends_chains_and_a_change_to_the_parent_reaches_the_child(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", {"name": "a", "train": {"lr": 0.1, "epochs": 3}})
    write(tmp_path / "b.yaml", {"name": "b", "extends": "a", "train": {"epochs": 5}})
    write(tmp_path / "c.yaml", {"name": "c", "extends": "b", "split": {"seed": 4}})
    c = load_experiment(tmp_path / "c.yaml")
    assert (c.train["lr"], c.train["epochs"], c.split["seed"]) == (0.1, 5, 4)
    write(tmp_path / "a.yaml", {"name": "a", "train": {"lr": 0.2, "epochs": 3}})
    assert load_experiment(tmp_path / "c.yaml").train["lr"] == 0.2


def test_extends_errors_name_the_file(tmp_path: Path) -> None:
    write(tmp_path / "x.yaml", {"name": "x", "extends": "y"})
    write(tmp_path / "y.yaml", {"name": "y", "extends": "x"})
    with pytest.raises(CtsegError, match=r"y.yaml: extends: a cycle \(x -> y -> x\)"):
        load_experiment(tmp_path / "x.yaml")
    write(tmp_path / "lost.yaml", {"name": "lost", "extends": "missing"})
    with pytest.raises(CtsegError, match=r"lost.yaml: extends: .*missing.yaml does not exist"):
        load_experiment(tmp_path / "lost.yaml")


def test_shipped_experiments_that_extend_load() -> None:
    cv = load_experiment(EXPERIMENTS / "exp001_cv.yaml")
    base = load_experiment(EXPERIMENTS / "exp001.yaml")
    assert cv.split["folds"] == 2 and cv.model == base.model and cv.train == base.train


# ----------------------------------------------------------------------------- folds
def test_fold_runs_are_named_by_their_path(tmp_path: Path) -> None:
    write(tmp_path / "cv.yaml", {"name": "cv", "split": {"folds": 3}})
    fold = load_run(tmp_path, "cv.fold2")
    assert fold.name == "cv.fold2" and fold.split["fold"] == 2 and fold.split["folds"] == 3
    assert load_run(tmp_path, "cv").split["fold"] is None
    with pytest.raises(CtsegError, match=r"cv.yaml: fold 3 is out of range: .* folds 0..2"):
        load_run(tmp_path, "cv.fold3")
    write(tmp_path / "plain.yaml", {"name": "plain"})
    with pytest.raises(CtsegError, match=r"declares no split.folds"):
        with_fold(load_experiment(tmp_path / "plain.yaml"), 0)


def test_bad_fold_settings_are_one_line_errors_naming_the_file(tmp_path: Path) -> None:
    write(tmp_path / "one.yaml", {"name": "one", "split": {"folds": 1}})
    with pytest.raises(CtsegError, match=r"one.yaml: split.folds: 1 is below 2") as info:
        load_experiment(tmp_path / "one.yaml")
    assert "\n" not in str(info.value)
    write(tmp_path / "set.yaml", {"name": "set", "split": {"folds": 2, "fold": 1}})
    with pytest.raises(CtsegError, match=r"set.yaml: split.fold is set by the run name"):
        load_experiment(tmp_path / "set.yaml")
    write(tmp_path / "a.b.yaml", {"name": "a.b"})
    with pytest.raises(CtsegError, match=r"a.b.yaml: an experiment's file name"):
        load_experiment(tmp_path / "a.b.yaml")


def records(n: int, scrolls: int = 1) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "id": [f"r{i:02d}" for i in range(n)],
            "scroll_id": [str(100 + i % scrolls) for i in range(n)],
        }
    )


def test_folds_cover_every_record_once_and_each_fold_holds_its_own_out() -> None:
    table = records(11)
    split = {"val_fraction": 0.25, "seed": 5, "folds": 3}
    folds = assign_folds(table, split, by_scroll=False)
    assert sorted(folds) == sorted(table["id"])
    sizes = sorted(list(folds.values()).count(f) for f in range(3))
    assert sizes == [3, 4, 4]  # as even as 11 records allow
    for fold in range(3):
        chosen = select_records(table, SUBSET, {**split, "fold": fold})
        val = set(chosen.loc[chosen["split"] == "val", "id"])
        assert val == {i for i, f in folds.items() if f == fold}
        assert set(chosen.loc[chosen["split"] == "train", "id"]) == set(table["id"]) - val
    # Deterministic from the seed, whatever the row order; another seed, other folds.
    shuffled = table.sample(frac=1, random_state=1)
    assert assign_folds(shuffled, split, by_scroll=False) == folds
    assert assign_folds(table, {**split, "seed": 6}, by_scroll=False) != folds


def test_no_scroll_spans_two_folds_when_grouped_by_scroll() -> None:
    table = records(12, scrolls=4)
    for subset, split in (
        (SUBSET, {"seed": 0, "folds": 2, "group_by": "scroll"}),
        ({**SUBSET, "scroll_ids": [100, 101, 102, 103]}, {"seed": 3, "folds": 2}),
    ):
        for fold in range(2):
            chosen = select_records(table, subset, {**split, "fold": fold})
            for _scroll, rows in chosen.groupby("scroll_id"):
                assert rows["split"].nunique() == 1
    with pytest.raises(CtsegError, match=r"3 folds need at least 3 scrolls.* has 2"):
        assign_folds(records(6, scrolls=2), {"seed": 0, "folds": 3}, by_scroll=True)


def test_the_test_split_is_held_out_of_training_validation_and_folds() -> None:
    table = records(10)
    split = {"val_fraction": 0.25, "seed": 1, "test_fraction": 0.2}
    chosen = select_records(table, SUBSET, split)
    test = set(chosen.loc[chosen["split"] == "test", "id"])
    assert len(test) == 2
    for fold in range(2):
        fold_table = select_records(table, SUBSET, {**split, "folds": 2, "fold": fold})
        # The same test split for every fold, never in a fold's train or val.
        assert set(fold_table.loc[fold_table["split"] == "test", "id"]) == test
    fixed = select_records(table, SUBSET, {"seed": 0, "test_ids": ["r03"], "val_ids": ["r04"]})
    assert list(fixed.loc[fixed["split"] == "test", "id"]) == ["r03"]
    assert list(fixed.loc[fixed["split"] == "val", "id"]) == ["r04"]
    # Adding no test split leaves an existing experiment's split as it was.
    plain = select_records(table, SUBSET, {"val_fraction": 0.25, "seed": 1})
    with_zero = select_records(
        table, SUBSET, {"val_fraction": 0.25, "seed": 1, "test_fraction": 0.0}
    )
    pd.testing.assert_frame_equal(plain, with_zero)
    with pytest.raises(CtsegError, match=r"split.test_ids: id\(s\) \['nope'\]"):
        select_records(table, SUBSET, {"seed": 0, "test_ids": ["nope"]})


# ----------------------------------------------------------------------------- config fixes
def test_nested_command_line_values_are_read_as_yaml_scalars() -> None:
    config = {
        "phase": 3,
        "infer": {"threshold": "0.3", "hysteresis_high": "null", "postprocess": "fixed"},
        "convert": {"codec": {"clevel": "5", "cname": "lz4"}, "chunks": ["16", "16", "16"]},
    }
    command_line_values(config)
    assert config["infer"] == {"threshold": 0.3, "hysteresis_high": None, "postprocess": "fixed"}
    assert config["convert"] == {"codec": {"clevel": 5, "cname": "lz4"}, "chunks": [16, 16, 16]}


def test_malformed_yaml_names_the_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("dataset: demo\ninfer:\n  threshold: [0.3\n  overlap: 0.5\n")
    with pytest.raises(CtsegError) as info:
        read_yaml(path)
    message = str(info.value)
    assert message.startswith(f"{path}:4:") and "not valid YAML" in message
    assert "\n" not in message
