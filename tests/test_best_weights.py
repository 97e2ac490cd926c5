"""config infer.weights: which weights file of a trained run predicts, last.pt or best.pt (both
written by train_model: ctseg.training.run_state), in the workflow's rules and in `ctseg predict`.
What training writes into best.pt is tested in test_train."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tifffile
from conftest import TINY_CONFIG, copy_workflow, run_snakemake

from ctseg.cli import main
from ctseg.config import CONFIG_FILE, SettingError, load_config, read_yaml
from ctseg.inference.predict import resolve_run
from ctseg.io import CtsegError


def planned(text: str, rule: str) -> list[str]:
    """The planned jobs of `rule`, each as the lines `snakemake -n -p` prints for it."""
    jobs = [job.split("\n\n")[0] for job in text.split("\nrule ")[1:]]
    return [job for job in jobs if job.startswith(f"{rule}:")]


def test_infer_weights_best_predicts_with_best_pt(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    workdir = copy_workflow(tmp_path / "work", TINY_CONFIG)
    new = tmp_path / "new"
    new.mkdir()
    tifffile.imwrite(new / "vol1.tif", np.zeros((8, 8, 8), np.uint8))
    proc = run_snakemake(
        workdir,
        *("-n", "-p", "predict", "predict_folder", "--config"),
        "infer={'weights': 'best'}",
        f"predict={{'input': '{new}'}}",
    )
    text = proc.stdout
    (train,) = planned(text, "train_model")
    assert "output: results/exp001/last.pt, results/exp001/best.pt," in train
    infers = planned(text, "infer")
    assert infers and all("ctseg infer results/exp001/best.pt " in job for job in infers)
    (predict,) = planned(text, "predict_volume")
    assert "input: " in predict and "results/exp001/best.pt" in predict
    assert "ctseg predict --run results/exp001 " in predict and " --weights best " in predict
    assert "last.pt" not in "".join(infers + [predict])


def test_infer_weights_is_last_or_best_and_last_by_default() -> None:
    """The check the workflow runs on its config when it loads (settings.smk)."""
    config = read_yaml(Path(__file__).resolve().parents[1] / CONFIG_FILE)
    assert config["infer"]["weights"] == "last"
    del config["infer"]["weights"]
    assert load_config(config)["infer"]["weights"] == "last"
    with pytest.raises(SettingError) as info:
        load_config({**config, "infer": {**config["infer"], "weights": "worst"}})
    assert str(info.value) == (
        "config/config.yaml: infer.weights: 'worst' is not one of ['last', 'best']"
    )


def test_predict_resolves_each_trained_run_to_the_chosen_weights_file(tmp_path: Path) -> None:
    run = tmp_path / "results" / "exp001"
    run.mkdir(parents=True)
    assert resolve_run(run).weight_files == (run / "last.pt",)
    assert resolve_run(run, trained_weights="best").weight_files == (run / "best.pt",)
    with pytest.raises(CtsegError, match=r"weights 'worst': not one of last, best"):
        resolve_run(run, trained_weights="worst")


def test_predict_weights_option_is_checked_before_anything_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["predict", "--run", str(tmp_path / "nowhere"), "-i", str(tmp_path), "-o"]
    assert main([*argv, str(tmp_path / "out"), "--weights", "worst", "--device", "cpu"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == "ctseg predict: error: weights 'worst': not one of last, best"
