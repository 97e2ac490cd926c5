"""The EMA of the weights (`train.ema`, ctseg.training.ema): its update, what validation and last.pt
use, a bit-exact resume, and its place in the run identity.

The same tiny training as test_train (tests/training_setup.py), on the CPU, one thread.
"""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import pandas as pd
import pytest
import torch
from training_setup import CLIP, EXPERIMENT, PHASE, TRAIN_IDS, VAL_IDS, build_scratch, torch_globals

import ctseg.training.feeds
import ctseg.training.train
from ctseg.network.model import portable_state_dict
from ctseg.run_settings import flat_settings, read_run_settings
from ctseg.training.checkpoint import identity_changes, load_checkpoint, run_identity
from ctseg.training.ema import WeightAverage
from ctseg.training.preempt import stop_on_signals
from ctseg.training.train import train

EMA = {"decay": 0.5, "start_step": 2}


def experiment(ema: dict | None) -> dict:
    exp = copy.deepcopy(EXPERIMENT)
    exp["train"]["ema"] = ema
    return exp


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scratch(tmp_path_factory.mktemp("ema_data"))


@pytest.fixture(autouse=True)
def _isolated_torch_state():
    with torch_globals():
        yield


def run(scratch: Path, root: Path, exp: dict, **kw) -> dict:
    return train(
        exp,
        PHASE,
        scratch=scratch,
        train_ids=TRAIN_IDS,
        val_ids=VAL_IDS,
        out_dir=root / "out",
        state_dir=root / "state",
        final_weights=root / "last.pt",
        clip_distance=CLIP,
        device="cpu",
        progress=False,
        **kw,
    )


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- the update


def test_the_update_copies_before_start_step_then_averages_with_decay() -> None:
    """By hand, on values exact in binary: decay 0.75, start_step 2."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.BatchNorm1d(1))
    linear, norm = model[0], model[1]
    average = WeightAverage(model, decay=0.75, start_step=2)

    def step(weight: list[float], bias: float, running_mean: float) -> None:
        with torch.no_grad():
            linear.weight.copy_(torch.tensor([weight]))
            linear.bias.fill_(bias)
            norm.running_mean.fill_(running_mean)

    step([1.0, -2.0], 4.0, 0.5)
    average.update(model, 1)  # before start_step: the weights themselves
    ema = average.averaged
    assert ema[0].weight.tolist() == [[1.0, -2.0]] and ema[0].bias.tolist() == [4.0]
    step([3.0, 2.0], 0.0, 0.25)
    average.update(model, 2)  # 0.75 * ema + 0.25 * w
    assert ema[0].weight.tolist() == [[1.5, -1.0]] and ema[0].bias.tolist() == [3.0]
    step([-1.0, 3.0], 8.0, 0.125)
    average.update(model, 3)
    assert ema[0].weight.tolist() == [[0.875, 0.0]] and ema[0].bias.tolist() == [4.25]
    # Buffers are copied, not averaged; the norm's affine parameters were averaged (equal).
    assert ema[1].running_mean.tolist() == [0.125]
    assert ema[1].weight.tolist() == [1.0] and not ema[0].weight.requires_grad
    # The live model is untouched.
    assert linear.weight.tolist() == [[-1.0, 3.0]]


def test_ema_is_off_when_null_and_part_of_the_identity_when_set() -> None:
    assert WeightAverage.configured(torch.nn.Linear(1, 1), None) is None

    def identity(exp: dict) -> dict:
        return run_identity(exp, PHASE, data={"train:a": "x"}, total_steps=6, clip_distance=4.0)

    # null (the schema's default) is the identity of an experiment that never had the key:
    # adding the setting does not set aside every earlier checkpoint.
    assert identity(experiment(None)) == identity(copy.deepcopy(EXPERIMENT))
    on = identity(experiment(EMA))
    assert identity_changes(identity(experiment(None)), on) == ["experiment.train.ema"]
    other = identity(experiment({**EMA, "decay": 0.9}))
    assert identity_changes(on, other) == ["experiment.train.ema.decay"]


# --------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def runs(scratch: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two epochs of three steps with the EMA, and the same without it."""
    root = tmp_path_factory.mktemp("ema_runs")
    evaluated: list[dict[str, torch.Tensor]] = []
    real = ctseg.training.train.evaluate

    def spy(model, *args, **kwargs):
        evaluated.append(portable_state_dict(model))
        return real(model, *args, **kwargs)

    with torch_globals(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(ctseg.training.train, "evaluate", spy)
        run(scratch, root / "ema", experiment(EMA))
    with torch_globals():
        run(scratch, root / "plain", experiment(None))
    return {"root": root, "evaluated": evaluated}


def test_validation_and_last_pt_use_the_average_and_training_is_unchanged(runs: dict) -> None:
    root = runs["root"]
    final = load_checkpoint(root / "ema" / "last.pt")
    state = load_checkpoint(root / "ema" / "state" / "resume.pt")
    assert final["weights"] == "ema" and load_checkpoint(root / "plain" / "last.pt")["weights"]
    assert same(final["model"], state["ema"])  # last.pt holds the average ...
    assert not same(final["model"], state["model"])  # ... not the trained weights
    # The plain run's trained weights are the EMA run's: the average never feeds back.
    assert same(state["model"], load_checkpoint(root / "plain" / "state" / "resume.pt")["model"])
    # Validation scored the average: at the last epoch's end, last.pt's weights.
    assert len(runs["evaluated"]) == 2 and same(runs["evaluated"][-1], final["model"])
    steps = pd.read_csv(root / "ema" / "out" / "steps.csv")
    plain_steps = pd.read_csv(root / "plain" / "out" / "steps.csv")
    assert list(steps["loss"]) == list(plain_steps["loss"])
    val = pd.read_csv(root / "ema" / "out" / "epochs.csv")["val_loss"]
    assert list(val) != list(pd.read_csv(root / "plain" / "out" / "epochs.csv")["val_loss"])
    # settings.json (the report's settings table) says what each run was trained with.
    recorded = {n: read_run_settings(root / n / "out" / "settings.json") for n in ("ema", "plain")}
    assert recorded["ema"]["weights"] == "ema" and recorded["plain"]["weights"] == "trained"
    flat = {name: flat_settings(r) for name, r in recorded.items()}
    assert flat["ema"]["train.ema.decay"] == EMA["decay"]
    assert flat["plain"]["train.ema"] is None
    assert recorded["ema"]["run_identity"] == final["fingerprint"]


def test_an_interrupted_run_with_ema_resumes_bit_for_bit(
    scratch: Path, runs: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped by SIGUSR1 during step 5 (mid-epoch checkpoint of step 5), then run again: the
    same average, weights and logs as the uninterrupted run's."""
    real = ctseg.training.feeds.to_device

    def to_device(batch, *args, **kwargs):
        if int(batch["index"][0]) == 4:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(ctseg.training.feeds, "to_device", to_device)
    with stop_on_signals() as stop:
        assert run(scratch, tmp_path, experiment(EMA), stop=stop)["saved_step"] == 5
    monkeypatch.undo()
    assert "ema" in load_checkpoint(tmp_path / "state" / "resume.pt")
    assert run(scratch, tmp_path, experiment(EMA))["from_step"] == 5

    reference = runs["root"] / "ema"
    for name in ("last.pt", "state/resume.pt"):
        ours, theirs = load_checkpoint(tmp_path / name), load_checkpoint(reference / name)
        for part in ("model", "ema") if name != "last.pt" else ("model",):
            assert same(ours[part], theirs[part]), (name, part)
    for log in ("steps.csv", "epochs.csv"):
        ours, theirs = pd.read_csv(tmp_path / "out" / log), pd.read_csv(reference / "out" / log)
        column = "loss" if log == "steps.csv" else "val_loss"
        assert list(ours[column]) == list(theirs[column]), log
