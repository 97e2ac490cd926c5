"""ctseg.config: one loader for experiments and phases, schema defaults, frozen results, and the
settings each rule's job uses (so that only a change to those reruns it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TINY_CONFIG, copy_workflow, run_snakemake

from ctseg.cli_types import _codec
from ctseg.config import (
    LazyFolds,
    check_trial_phases,
    load_ensemble,
    load_experiment,
    load_phases,
    select_phase,
    settings_used,
)
from ctseg.io import CtsegError

EXPERIMENTS = REPO / "config" / "experiments"


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_files_load_with_every_default_filled() -> None:
    exp = load_experiment(EXPERIMENTS / "exp001.yaml")
    assert exp.name == "exp001" and exp["train"]["lr"] == exp.train["lr"]
    assert exp.train["gpus"] == 1  # not in the file: the schema's default
    phases = load_phases(REPO / "config" / "phases.yaml")
    assert phases[0].accumulate == 1 and phases[0].compile_mode == "default"
    assert phases[7].fused_optimizer and phases[7].compile_mode == "reduce-overhead"
    assert "gpus" not in dict(phases[0])  # left to the experiment, as in the file


def test_a_minimal_experiment_gets_the_schema_defaults(tmp_path: Path) -> None:
    exp = load_experiment(write(tmp_path / "mini.yaml", {"name": "mini"}))
    assert exp.scratch_format == "raw"
    assert exp.data["augment"]["intensity"]["prob"] == 0.5  # nested defaults too
    assert exp.trial["phases"] == [0]


def test_the_config_states_the_inference_defaults() -> None:
    """`ctseg predict` and `ctseg infer` take their defaults from InferenceSettings and the
    workflow from config.yaml: the two, and the schema's defaults, say the same."""
    from ctseg.inference.settings import InferenceSettings

    default = InferenceSettings().as_dict()
    shipped = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["infer"]
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    schema_infer = schema["properties"]["infer"]["properties"]
    keys = [k for k in default if k in shipped]
    assert set(keys) >= {
        "overlap",
        "batch_size",
        "tta_flips",
        "memory_budget_mb",
        "device_budget_mb",
    }
    for key in keys:
        assert shipped[key] == default[key], key
        assert schema_infer[key].get("default") == default[key], key


def test_settings_are_frozen() -> None:
    exp = load_experiment(EXPERIMENTS / "exp001.yaml")
    with pytest.raises(TypeError, match="read-only"):
        exp.train["lr"] = 1.0
    with pytest.raises(AttributeError):
        exp.name = "other"  # type: ignore[misc]
    assert json.loads(json.dumps(dict(exp)))["train"]["lr"] == exp.train["lr"]


def test_a_bad_value_names_the_file_and_the_key(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.yaml", {"name": "bad", "train": {"lr": -1}})
    with pytest.raises(CtsegError, match=r"bad.yaml: train.lr: -1 is less than"):
        load_experiment(path)
    path = write(tmp_path / "typo.yaml", {"name": "typo", "trian": {}})
    with pytest.raises(CtsegError, match=r"typo.yaml: trian: unknown key; did you mean "):
        load_experiment(path)


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        (
            {"data": {"patch_sise": [8, 8, 8]}},
            "data.patch_sise: unknown key; did you mean patch_size?",
        ),
        # As close to one as to the other: both are named.
        ({"trian": {}}, "trian: unknown key; did you mean trial or train?"),
        (
            {"data": {"zzz": 1, "fg_fracton": 0.5}},
            "data.fg_fracton: unknown key; did you mean fg_fraction? (also unknown: zzz)",
        ),
        # Nothing close: the keys the section takes.
        (
            {"data": {"zzz": 1}},
            "data.zzz: unknown key; data takes augment, fg_fraction, patch_size, patch_voxels, "
            "runtime_targets",
        ),
    ],
)
def test_an_unknown_key_names_the_closest_valid_one(tmp_path: Path, settings, line) -> None:
    path = write(tmp_path / "typo.yaml", {"name": "typo", **settings})
    with pytest.raises(CtsegError) as info:
        load_experiment(path)
    assert str(info.value) == f"{path}: {line}"


def test_the_experiment_name_must_be_the_file_name(tmp_path: Path) -> None:
    with pytest.raises(CtsegError, match="differs from the file name 'other'"):
        load_experiment(write(tmp_path / "other.yaml", {"name": "mine"}))


def test_missing_files_and_bad_yaml_are_named(tmp_path: Path) -> None:
    with pytest.raises(CtsegError, match="nope.yaml: file not found"):
        load_phases(tmp_path / "nope.yaml")
    (tmp_path / "broken.yaml").write_text("phases: [unclosed")
    with pytest.raises(CtsegError, match=r"broken.yaml:1:\d+: not valid YAML"):
        load_phases(tmp_path / "broken.yaml")


def test_a_phase_cannot_claim_a_scratch_format(tmp_path: Path) -> None:
    phases = yaml.safe_load((REPO / "config" / "phases.yaml").read_text())
    phases["phases"][0]["scratch_format"] = "zarr"  # training only reads the experiment's
    with pytest.raises(CtsegError, match="scratch_format"):
        load_phases(write(tmp_path / "phases.yaml", phases))


def test_phase_selection_and_trial_phases_are_checked() -> None:
    phases = load_phases(REPO / "config" / "phases.yaml")
    assert select_phase(phases, "3", "phases.yaml")[0] == 3
    with pytest.raises(CtsegError, match=r"phase 42 is not defined \(it defines \[0, 1"):
        select_phase(phases, 42, "phases.yaml")
    exp = load_experiment(EXPERIMENTS / "exp001.yaml")
    check_trial_phases(exp, phases, "exp001.yaml")
    odd = load_phases(REPO / "config" / "phases.yaml")
    del odd[1]
    with pytest.raises(CtsegError, match=r"trial.phases names phase\(s\) \[1\]"):
        check_trial_phases(exp, odd, "exp001.yaml")


def test_each_job_sees_only_the_settings_it_uses() -> None:
    exp = load_experiment(EXPERIMENTS / "exp001.yaml")
    phase = load_phases(REPO / "config" / "phases.yaml")[2]
    assert set(settings_used(exp, None, "split")) == {"subset", "split"}
    train = settings_used(exp, phase, "train")
    assert "trial" not in train and "subset" not in train and train["phase"]["batch_size"] == 2
    assert "trial" in settings_used(exp, phase, "trial")
    with pytest.raises(CtsegError, match="unknown step"):
        settings_used(exp, None, "nonsense")


def test_the_codec_travels_as_name_and_pairs() -> None:
    assert _codec("blosc,clevel=5,cname=lz4,shuffle=shuffle") == {
        "name": "blosc",
        "clevel": 5,
        "cname": "lz4",
        "shuffle": "shuffle",
    }
    assert _codec("zstd,level=3") == {"name": "zstd", "level": 3}


@pytest.mark.slow
def test_an_unrelated_edit_reruns_nothing_and_a_used_setting_reruns_the_job(
    tmp_path: Path,
) -> None:
    """The split job's settings are the experiment's subset and split: a change to the
    learning rate leaves split.csv alone, a change to val_fraction reruns it."""
    work = copy_workflow(tmp_path, TINY_CONFIG)
    config = ("--config", "experiment=tiny")
    run_snakemake(work, "--cores", "1", "results/tiny/split.csv", *config)
    exp_file = work / "config" / "experiments" / "tiny.yaml"
    exp = yaml.safe_load(exp_file.read_text())

    exp["train"]["lr"] = 0.5
    exp_file.write_text(yaml.safe_dump(exp))
    unrelated = run_snakemake(work, "-n", "results/tiny/split.csv", *config)
    assert "Nothing to be done" in unrelated.stdout + unrelated.stderr

    exp["split"]["val_fraction"] = 0.34
    exp_file.write_text(yaml.safe_dump(exp))
    used = run_snakemake(work, "-n", "results/tiny/split.csv", *config)
    text = used.stdout + used.stderr
    assert "rule split:" in text and "Params have changed" in text
    shutil.rmtree(work / "results", ignore_errors=True)


def test_an_ensemble_loads_only_the_experiments_it_names(tmp_path: Path) -> None:
    """A broken experiment file that an ensemble does not name is no concern of the ensemble's."""
    asked: list[str] = []

    def folds_of(name: str) -> int | None:
        asked.append(name)
        if name == "broken":
            raise CtsegError("config/experiments/broken.yaml: data.patch_sise: unknown key")
        return {"a": None, "b": 3}[name]

    known = LazyFolds(["a", "b", "broken"], folds_of)
    path = write(
        tmp_path / "ens.yaml", {"name": "ens", "members": ["a", "b.fold2"], "weights": [1, 1]}
    )
    assert [m.name for m in load_ensemble(path, known).members] == ["a", "b.fold2"]
    assert "broken" not in asked
    write(path, {"name": "ens", "members": ["a", "c"], "weights": [1, 1]})
    with pytest.raises(CtsegError, match=r"unknown member 'c': no experiment 'c' \(experiments: "):
        load_ensemble(path, known)
    assert "a, b, broken)" in str(load_ensemble_error(path, known)) and "broken" not in asked
    write(path, {"name": "ens", "members": ["a", "broken"], "weights": [1, 1]})
    with pytest.raises(CtsegError, match="broken.yaml: data.patch_sise: unknown key"):
        load_ensemble(path, known)


def load_ensemble_error(path: Path, known: LazyFolds) -> CtsegError:
    with pytest.raises(CtsegError) as info:
        load_ensemble(path, known)
    return info.value
