"""The shipped residual-encoder experiments (config/experiments/resenc_*.yaml): the starting
point's recipe on its unpadded patch (exp001_full_unpadded) with another model, sized by the
activation estimate for their card, and each trains a step on the CPU at its own model settings
(a tiny patch)."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest
import torch
from training_setup import (
    CLIP,
    EXPERIMENT,
    PHASE,
    TRAIN_IDS,
    VAL_IDS,
    build_scratch,
    torch_globals,
)

from ctseg.config import load_experiment, load_phases
from ctseg.network.model import (
    build_model,
    count_parameters,
    parameter_digest,
    saved_activation_bytes,
)
from ctseg.network.summary import BYTES_PER_PARAMETER, PEAK_FACTOR
from ctseg.training.train import train

CONFIG = Path(__file__).resolve().parents[1] / "config"
STARTING_POINT = "exp001_full"
UNPADDED = "exp001_full_unpadded"  # the starting point on the size its patch is computed at
# Every shipped experiment with a residual encoder (a blocks_per_stage of its own).
PRESETS = sorted(
    p.stem
    for p in (CONFIG / "experiments").glob("*.yaml")
    if load_experiment(p).model.get("blocks_per_stage") is not None
)
# The records of training_setup are 24^3; five levels pad that to 32^3, whose 1/16 level keeps
# two voxels an axis (instance norm needs more than one).
TINY_PATCH = [24, 24, 24]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def experiment(name: str):
    return load_experiment(CONFIG / "experiments" / f"{name}.yaml")


def test_both_cards_are_shipped():
    assert PRESETS == ["resenc_24gb", "resenc_80gb"]


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_is_the_starting_point_with_another_model(name):
    """Same data, patch, losses, schedule and seed as exp001_full_unpadded (exp001_full on
    80x144x144, the size its 72x136x136 is computed at): only the model and the trials' memory
    limit and phases differ, so a comparison isolates the model, and no FLOP goes to padding."""
    preset, base = experiment(name), experiment(UNPADDED)
    for section in ("subset", "split", "data", "loss", "train"):
        assert preset[section] == base[section], section
    assert preset["data"]["patch_size"] == [80, 144, 144]
    start = experiment(STARTING_POINT)
    assert {**base["data"], "patch_size": start["data"]["patch_size"]} == start["data"]
    assert base["model"] == start["model"]
    trial = {k: v for k, v in preset["trial"].items() if k not in ("vram_limit_gb", "phases")}
    assert trial == {k: v for k, v in base["trial"].items() if k in trial}
    assert preset["model"]["block"] == "residual" and preset["model"]["decoder_convs"] == 1


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_fits_its_card_under_each_of_its_phases_by_the_estimate(name):
    """The sizing in the file's comment, recomputed: under every phase the trials run, the
    estimated peak (ctseg.network.model.PEAK_FACTOR x (saved activations + weights, gradients and
    AdamW state)) stays within trial.vram_limit_gb with a quarter to spare."""
    exp = experiment(name)
    phases = load_phases(CONFIG / "phases.yaml")
    patch = exp["data"]["patch_size"]
    with torch.device("meta"):  # shapes only: counting needs no values
        weights = BYTES_PER_PARAMETER * count_parameters(build_model(exp["model"]))
    per_sample = {}  # activations scale with the batch (test_model checks it)
    for number in exp["trial"]["phases"]:
        phase = phases[number]
        if phase.precision not in per_sample:
            per_sample[phase.precision] = saved_activation_bytes(
                exp["model"], patch, dtype=DTYPES[phase.precision]
            )
        peak = PEAK_FACTOR * (phase.batch_size * per_sample[phase.precision] + weights)
        assert peak / 2**30 <= 0.75 * exp["trial"]["vram_limit_gb"], (number, peak / 2**30)


def _train_one_step(exp: dict, root: Path) -> tuple[str, dict]:
    """train() for one step on the CPU; the initial weights' digest and the summary."""
    with torch_globals():
        torch.manual_seed(int(exp["train"]["seed"]))  # what train() does before building
        initial = parameter_digest(build_model(exp["model"]))
        summary = train(
            exp,
            PHASE,
            scratch=root / "scratch",
            train_ids=TRAIN_IDS,
            val_ids=VAL_IDS,
            out_dir=root / exp["name"],
            clip_distance=CLIP,
            device="cpu",
            progress=False,
            max_steps=1,
        )
    return initial, summary


def _tiny(name: str, width_divisor: int) -> dict:
    """training_setup's experiment with the preset's model (widths divided) on tiny patches."""
    model = dict(experiment(name)["model"])
    model["filters"] = [f // width_divisor for f in model["filters"]]
    exp = copy.deepcopy(EXPERIMENT)
    exp["name"] = f"{name}_w{width_divisor}"
    exp["model"] = model
    exp["data"]["patch_size"] = TINY_PATCH
    return exp


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resenc")
    build_scratch(root)
    return root


def _assert_trained(initial: str, summary: dict, out: Path) -> None:
    assert summary["steps"] == 1
    assert summary["param_sha256"][0] != initial  # the step moved the weights
    steps = pd.read_csv(out / "steps.csv")
    assert len(steps) == 1 and steps["loss"].notna().all() and (steps["grad_norm"] > 0).all()


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_topology_trains_a_step_at_an_eighth_of_the_width(name, root):
    """The fast tier's check: the preset's blocks, decoder and depth, eight times narrower."""
    exp = _tiny(name, 8)
    _assert_trained(*_train_one_step(exp, root), root / exp["name"])


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_trains_a_step_at_its_own_settings_on_the_cpu(name, root):
    """The acceptance check: the shipped model itself (full width), one training step."""
    exp = _tiny(name, 1)
    assert exp["model"] == experiment(name)["model"]
    _assert_trained(*_train_one_step(exp, root), root / exp["name"])
