"""ctseg.training.train and ctseg.trials.trials: the training loop, its checkpoints and logs, and
phase trials.

Everything runs on the CPU with a two-level U-Net on 16^3 patches from three 24^3 records, one
thread per process. The kill-and-resume check runs real `ctseg train` processes; the rest call
`train` / `run_trial` in this process.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
import torch
from conftest import settings_args
from training_setup import (
    CLIP,
    EXPERIMENT,
    PHASE,
    TRAIN_IDS,
    VAL_IDS,
    build_scratch,
    torch_globals,
    weights,
)

import ctseg.training.feeds
import ctseg.training.train
from ctseg.console import RESUMED
from ctseg.data.device_batches import to_device
from ctseg.data.loader import build_loader
from ctseg.data.patches import PatchDataset
from ctseg.inference.run import load_model
from ctseg.io import CtsegError
from ctseg.machine import available_cpus
from ctseg.network.flops import Efficiency, count_flops
from ctseg.network.losses import TERMS, compute_losses, loss_settings
from ctseg.network.model import build_model, portable_state_dict
from ctseg.summaries import SUMMARY_VERSION
from ctseg.training.checkpoint import (
    CHECKSUM_TAG,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from ctseg.training.live_view import NoLiveView
from ctseg.training.preempt import StopRequest
from ctseg.training.recipe import lr_at, scaled_lr
from ctseg.training.train import train
from ctseg.trials.kernel_profile import PROFILE_STEPS, PROFILE_WARMUP
from ctseg.trials.trials import choose_phase, run_trial

BIN = Path(sys.executable).parent
# The terms the tiny experiment weights: every registered term for one foreground class.
TRAINED_TERMS = [name for name in TERMS if name in EXPERIMENT["loss"]["weights"]]
STEP_COLUMNS = [
    "data_wait_s",
    "h2d_s",
    "compute_s",
    "step_s",
    "samples_per_s",
    "loss",
    *TRAINED_TERMS,
    "grad_norm",
    "lr",
    "gpu_util",
    "vram_peak_mb",
    "host_rss_mb",
]


def experiment(**sections: dict) -> dict:
    """EXPERIMENT with some keys of some sections replaced."""
    exp = copy.deepcopy(EXPERIMENT)
    for name, values in sections.items():
        exp[name].update(values)
    return exp


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scratch(tmp_path_factory.mktemp("train_data"))


@pytest.fixture(autouse=True)
def _isolated_torch_state():
    with torch_globals():
        yield


def run(scratch: Path, out: Path, exp: dict | None = None, phase: dict | None = None, **kw):
    """train() in this process on the CPU, quietly; returns its summary."""
    return train(
        exp or EXPERIMENT,
        phase or PHASE,
        scratch=scratch,
        train_ids=TRAIN_IDS,
        val_ids=VAL_IDS,
        out_dir=out,
        clip_distance=CLIP,
        device="cpu",
        progress=False,
        **kw,
    )


def initial_weights(exp: dict) -> dict[str, torch.Tensor]:
    """The model train() starts from: it seeds torch with train.seed, then builds the model."""
    torch.manual_seed(int(exp["train"]["seed"]))
    return {k: v.clone() for k, v in build_model(exp["model"]).state_dict().items()}


def record_indices(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Observe which samples each micro-batch of train() holds (the feed's to_device sees every
    one)."""
    seen: list[list[int]] = []
    real = ctseg.training.feeds.to_device

    def spy(batch, *args, **kwargs):
        seen.append(batch["index"].tolist())
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(ctseg.training.feeds, "to_device", spy)
    return seen


# --------------------------------------------------------------------------- schedule


def test_lr_at_warms_up_linearly_then_decays_by_cosine_to_min_ratio() -> None:
    lr = functools.partial(lr_at, base_lr=0.1, warmup=4, total=24, min_ratio=0.05)
    assert [lr(s) for s in range(4)] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    assert lr(4) == pytest.approx(0.1)  # the peak, where the cosine starts
    assert lr(14) == pytest.approx(0.1 * (0.05 + 0.95 * 0.5))  # halfway through the decay
    assert lr(24) == pytest.approx(0.005)
    assert lr(1000) == pytest.approx(0.005)  # past the end: stays at the floor
    decay = [lr(s) for s in range(4, 25)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    assert lr_at(0, base_lr=0.1, warmup=0, total=10, min_ratio=0.0) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("rule", "expected"), [("none", 0.01), ("linear", 0.08), ("sqrt", 0.01 * math.sqrt(8))]
)
def test_scaled_lr_rules(rule: str, expected: float) -> None:
    cfg = {"lr": 0.01, "base_batch_size": 2, "lr_scaling": rule}
    assert scaled_lr(cfg, 16) == pytest.approx(expected)
    assert scaled_lr(cfg, 2) == pytest.approx(0.01)


def test_scaled_lr_unknown_rule_is_a_clear_error() -> None:
    with pytest.raises(CtsegError, match="lr_scaling"):
        scaled_lr({"lr": 0.01, "base_batch_size": 1, "lr_scaling": "cubic"}, 4)


# --------------------------------------------------------------------------- checkpoints


def test_rng_state_survives_a_weights_only_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    np.random.standard_normal()  # numpy's legacy state also caches a Gaussian: keep it too
    torch.manual_seed(3)
    path = tmp_path / "nested" / "dirs" / "resume.pt"  # parents are created
    save_checkpoint(path, {"rng": rng_state(), "step": 7})
    expected = (random.random(), np.random.standard_normal(3), torch.rand(3))

    state = torch.load(path, map_location="cpu", weights_only=True)  # must not raise
    set_rng_state(state["rng"])
    assert random.random() == expected[0]
    np.testing.assert_array_equal(np.random.standard_normal(3), expected[1])
    assert torch.equal(torch.rand(3), expected[2])


def test_checkpoint_is_replaced_atomically(tmp_path: Path) -> None:
    path = tmp_path / "state" / "resume.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(3)})
    with pytest.raises(Exception):  # noqa: B017 - whatever torch.save raises for a lambda
        save_checkpoint(path, {"step": 2, "bad": lambda: None})
    # The failed write left the old checkpoint as it was, and no temporary file beside it.
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["resume.pt"]


def test_load_checkpoint_names_the_file_when_it_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "resume.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CtsegError, match="resume.pt: unverifiable checkpoint: it has no checksum"):
        load_checkpoint(path)
    # Its checksum right, its bytes still not a torch file: torch's reason, with the file.
    junk = b"not a checkpoint"
    path.write_bytes(junk + CHECKSUM_TAG + hashlib.sha256(junk).hexdigest().encode())
    with pytest.raises(CtsegError, match="resume.pt: cannot load checkpoint"):
        load_checkpoint(path)


# --------------------------------------------------------------------------- a full run


@pytest.fixture(scope="module")
def basic_run(scratch: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epochs of three steps with AdamW, checkpoints and final weights."""
    root = tmp_path_factory.mktemp("basic_run")
    with torch_globals():
        summary = run(
            scratch, root / "out", state_dir=root / "state", final_weights=root / "last.pt"
        )
    assert summary["steps"] == 6
    assert summary["peak_vram_mb"] is None and summary["device"] == "cpu"
    assert summary["peak_host_rss_mb"] > 0
    return root


def test_steps_csv_logs_every_measure_for_every_step(basic_run: Path) -> None:
    steps = pd.read_csv(basic_run / "out" / "steps.csv")
    assert list(steps["step"]) == [1, 2, 3, 4, 5, 6]
    assert list(steps["epoch"]) == [0, 0, 0, 1, 1, 1]
    missing = [c for c in STEP_COLUMNS if c not in steps.columns]
    assert not missing, f"steps.csv lacks {missing}"
    timing = steps[["data_wait_s", "h2d_s", "compute_s", "step_s"]]
    assert (timing >= 0).all().all()
    np.testing.assert_allclose(
        steps["data_wait_s"] + steps["h2d_s"] + steps["compute_s"], steps["step_s"], rtol=1e-9
    )
    np.testing.assert_allclose(steps["samples_per_s"], 1 / steps["step_s"])
    # The total is the weighted sum of the logged terms.
    weights_ = EXPERIMENT["loss"]["weights"]
    np.testing.assert_allclose(
        sum(w * steps[name] for name, w in weights_.items()), steps["loss"], rtol=1e-5
    )
    # The logged lr is the one each step used: warmup, then cosine over the 6 steps.
    base = scaled_lr(EXPERIMENT["train"], 1)
    expected = [lr_at(s, base_lr=base, warmup=2, total=6, min_ratio=0.05) for s in range(6)]
    np.testing.assert_allclose(steps["lr"], expected, rtol=1e-6)
    # No GPU here: utilisation and VRAM are not measured, host RSS is.
    assert steps["gpu_util"].isna().all() and steps["vram_peak_mb"].isna().all()
    assert (steps["host_rss_mb"] > 50).all()
    assert np.isfinite(steps["grad_norm"]).all() and (steps["grad_norm"] > 0).all()


def test_steps_csv_has_the_model_flops_and_mfu_of_each_step(basic_run: Path) -> None:
    steps = pd.read_csv(basic_run / "out" / "steps.csv")
    # last: optional to every reader
    assert list(steps.columns[-3:]) == ["tflops", "mfu", "useful_mfu"]
    efficiency = Efficiency.for_run(EXPERIMENT, PHASE, "cpu")  # the process's cached probe
    flops = count_flops(EXPERIMENT["model"], EXPERIMENT["data"]["patch_size"]).train
    assert efficiency.flops.train == flops > 0
    np.testing.assert_allclose(steps["tflops"], flops * steps["samples_per_s"] / 1e12, rtol=1e-9)
    np.testing.assert_allclose(steps["mfu"], steps["tflops"] / efficiency.peak.tflops, rtol=1e-9)
    assert steps["mfu"].between(0, 1, inclusive="neither").all()
    # The patch is not padded (a multiple of 2**(depth-1)): every FLOP is useful.
    np.testing.assert_allclose(steps["useful_mfu"], steps["mfu"], rtol=1e-9)


def test_validation_runs_every_epoch(basic_run: Path) -> None:
    epochs = pd.read_csv(basic_run / "out" / "epochs.csv")
    assert list(epochs["epoch"]) == [0, 1] and list(epochs["step"]) == [3, 6]
    assert np.isfinite(epochs["val_loss"]).all()
    assert epochs["val_dice"].between(0, 1).all()
    assert np.isfinite(epochs["train_loss"]).all()
    assert epochs["data_wait_fraction"].between(0, 1).all()
    # The logs a resumed run appends to live beside the checkpoint and are copied out.
    for name in ("steps.csv", "epochs.csv"):
        assert (basic_run / "out" / name).read_bytes() == (basic_run / "state" / name).read_bytes()


def test_checkpoint_holds_the_whole_training_state(basic_run: Path) -> None:
    state = torch.load(basic_run / "state" / "resume.pt", map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "scheduler", "scaler", "rng", "step", "epoch"} <= set(state)
    assert state["step"] == 6 and state["epoch"] == 2
    assert state["sample_index"] == 6  # the loader's position in the sample stream
    assert set(state["rng"]) >= {"python", "numpy", "torch"}
    assert state["scheduler"]["last_epoch"] == 6
    assert "exp_avg" in state["optimizer"]["state"][0]  # AdamW's moments
    assert len(state["fingerprint"]) == 16
    final = torch.load(basic_run / "last.pt", map_location="cpu", weights_only=True)
    assert final["model_config"] == EXPERIMENT["model"] and final["step"] == 6
    for name, tensor in final["model"].items():
        assert torch.equal(tensor, state["model"][name])
    # No temporary file was left beside the checkpoint or the weights.
    assert not [p for p in (basic_run / "state").iterdir() if p.name.startswith(".")]
    assert not [p for p in basic_run.iterdir() if p.name.startswith(".")]


def test_resume_with_another_model_config_sets_the_checkpoint_aside(
    basic_run: Path, scratch: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "resume.pt").write_bytes((basic_run / "state" / "resume.pt").read_bytes())
    other = experiment(model={"filters": [4, 4]})
    summary = run(scratch, tmp_path / "out", other, state_dir=state)
    assert summary["resume"] == "set_aside" and summary["steps"] == 6
    assert "experiment.model.filters" in summary["changed"]
    kept = Path(summary["set_aside"]) / "resume.pt"
    assert kept.read_bytes() == (basic_run / "state" / "resume.pt").read_bytes()


def test_resume_of_a_finished_run_trains_no_further(
    basic_run: Path, scratch: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    for name in ("resume.pt", "best.pt", "steps.csv", "epochs.csv"):
        (state / name).write_bytes((basic_run / "state" / name).read_bytes())
    summary = run(scratch, tmp_path / "out", state_dir=state, final_weights=tmp_path / "w.pt")
    assert summary["steps"] == 6
    before, after = weights(basic_run / "last.pt"), weights(tmp_path / "w.pt")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert len(pd.read_csv(tmp_path / "out" / "steps.csv")) == 6
    assert (tmp_path / "best.pt").read_bytes() == (basic_run / "best.pt").read_bytes()


# --------------------------------------------------------------------------- loop features


def test_accumulation_averages_the_micro_batch_gradients(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """batch 1 x accumulate 2: one optimizer step on the mean gradient of samples 0 and 1.

    This is not the same update as batch 2 x accumulate 1, and should not be: the Dice-type
    terms sum over the whole batch (batch Dice), so the loss of a batch of two is not the mean
    of two single-sample losses (instance norm alone would have kept them independent). What
    the loop promises is checked instead: which samples it used, how many optimizer steps it
    took, and the update, against the same step done by hand.
    """
    exp = experiment(train={"optimizer": "sgd", "warmup_steps": 0, "grad_clip": None})
    seen = record_indices(monkeypatch)
    phase = {**PHASE, "batch_size": 1, "accumulate": 2}
    run(scratch, tmp_path / "out", exp, phase, max_steps=1, final_weights=tmp_path / "w.pt")
    assert seen == [[0], [1]]

    model = build_model(exp["model"])
    model.load_state_dict(initial_weights(exp))
    tcfg = exp["train"]
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=scaled_lr(tcfg, 2),
        momentum=tcfg["momentum"],
        weight_decay=tcfg["weight_decay"],
        nesterov=True,
    )
    dataset = PatchDataset(
        scratch,
        TRAIN_IDS,
        patch_size=exp["data"]["patch_size"],
        fmt="raw",
        fg_fraction=exp["data"]["fg_fraction"],
        augment=exp["data"]["augment"],
        seed=tcfg["seed"],
        length=2,
    )
    losses = loss_settings({**exp["loss"], "clip_distance": CLIP})
    for host_batch in build_loader(dataset, {"batch_size": 1}, seed=0):
        batch = to_device(host_batch, "cpu")
        total, _ = compute_losses(model(batch["image"]), batch, **losses)
        (total / 2).backward()
    optimizer.step()
    trained = weights(tmp_path / "w.pt")
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(trained[name], tensor, msg=name)

    # Two steps consume four samples, in stream order, and log two rows of 2 samples each.
    seen.clear()
    run(scratch, tmp_path / "out2", exp, phase, max_steps=2)
    assert seen == [[0], [1], [2], [3]]
    steps = pd.read_csv(tmp_path / "out2" / "steps.csv")
    np.testing.assert_allclose(steps["samples_per_s"] * steps["step_s"], [2.0, 2.0])


def test_batch_of_two_takes_consecutive_samples(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = record_indices(monkeypatch)
    run(scratch, tmp_path / "out", phase={**PHASE, "batch_size": 2}, max_steps=2)
    assert seen == [[0, 1], [2, 3]]


def test_grad_clip_bounds_the_update(scratch: Path, tmp_path: Path) -> None:
    """SGD's first (Nesterov) step moves the weights by lr * (1 + momentum) * clipped grad."""
    clip = 1e-3
    # A large lr, so the update is well above float32 rounding of the weights it changes.
    exp = experiment(
        train={
            "optimizer": "sgd",
            "lr": 1.0,
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "grad_clip": clip,
        }
    )
    run(scratch, tmp_path / "out", exp, max_steps=1, final_weights=tmp_path / "w.pt")
    assert not list(tmp_path.rglob("best.pt"))  # a trial keeps no best weights
    before, after = initial_weights(exp), weights(tmp_path / "w.pt")
    update = torch.cat([(after[k] - before[k]).flatten() for k in before])
    tcfg = exp["train"]
    clipped_norm = float(update.norm()) / (scaled_lr(tcfg, 1) * (1 + tcfg["momentum"]))
    grad_norm = pd.read_csv(tmp_path / "out" / "steps.csv")["grad_norm"].iloc[0]
    assert grad_norm > 10 * clip  # so the clip was active
    assert clipped_norm <= clip * (1 + 1e-4)
    assert clipped_norm == pytest.approx(clip, rel=1e-3)


def test_sgd_keeps_a_momentum_buffer(scratch: Path, tmp_path: Path) -> None:
    exp = experiment(train={"optimizer": "sgd", "epochs": 1, "steps_per_epoch": 2})
    run(scratch, tmp_path / "out", exp, state_dir=tmp_path / "state")
    state = torch.load(tmp_path / "state" / "resume.pt", weights_only=True)
    assert "momentum_buffer" in state["optimizer"]["state"][0]
    assert state["optimizer"]["param_groups"][0]["nesterov"] is True


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("train", "optimizer", "adam"), ("phase", "precision", "fp8")],
)
def test_unknown_optimizer_or_precision_is_a_clear_error(
    scratch: Path, tmp_path: Path, section: str, key: str, value: str
) -> None:
    exp, phase = EXPERIMENT, PHASE
    if section == "train":
        exp = experiment(train={key: value})
    else:
        phase = {**PHASE, key: value}
    with pytest.raises(CtsegError, match=f"{key}.*{value}"):
        run(scratch, tmp_path / "out", exp, phase, max_steps=1)


def test_precisions_run_under_autocast_and_fp16_uses_a_grad_scaler(
    scratch: Path, tmp_path: Path
) -> None:
    exp = experiment(train={"epochs": 1, "steps_per_epoch": 2})
    first_loss, scalers = {}, {}
    for precision in ("fp32", "bf16", "fp16"):
        out = tmp_path / precision
        run(scratch, out / "out", exp, {**PHASE, "precision": precision}, state_dir=out / "st")
        steps = pd.read_csv(out / "out" / "steps.csv")
        assert np.isfinite(steps[["loss", *TRAINED_TERMS, "grad_norm"]]).all().all(), precision
        first_loss[precision] = steps["loss"].iloc[0]
        scalers[precision] = torch.load(out / "st" / "resume.pt", weights_only=True)["scaler"]
    # Same weights, same batch: only the network's arithmetic differs, and it does.
    for low in ("bf16", "fp16"):
        assert first_loss[low] != first_loss["fp32"]
        assert first_loss[low] == pytest.approx(first_loss["fp32"], rel=0.05)
    assert scalers["fp32"] == {} and scalers["bf16"] == {}  # no scaler outside fp16
    assert scalers["fp16"]["scale"] > 1  # a live GradScaler on the CPU too (torch >= 2.3)


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_setting_sets_the_backend_flags(scratch: Path, tmp_path: Path, tf32: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    torch.backends.cudnn.allow_tf32 = not tf32
    run(scratch, tmp_path / "out", experiment(train={"tf32": tf32}), max_steps=1)
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.backends.cudnn.allow_tf32 is tf32


def test_deterministic_setting_is_applied_both_ways(scratch: Path, tmp_path: Path) -> None:
    """Off after on, in one process: a trial or training must not inherit the other's mode."""
    run(scratch, tmp_path / "on", max_steps=1)
    assert torch.are_deterministic_algorithms_enabled()
    # CUDA's max_pool3d backward (clDice) has no deterministic kernel: warn, don't stop.
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    run(scratch, tmp_path / "off", experiment(train={"deterministic": False}), max_steps=1)
    assert not torch.are_deterministic_algorithms_enabled()


def test_compile_flag_trains_through_torch_compile(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor takes ~90 s to compile this net on a CPU, so the graph runs on dynamo's eager
    backend: still real torch.compile wrappers, one that captured the model's forward and one
    the losses (a region of their own, so their small kernels fuse)."""
    import torch._dynamo

    compiled = []
    real_compile = torch.compile

    def eager_compile(model, **kwargs):
        compiled.append(model)
        return real_compile(model, backend="eager")

    monkeypatch.setattr(torch, "compile", eager_compile)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run(scratch, tmp_path / "out", phase={**PHASE, "compile": True}, max_steps=2)
    assert len(compiled) == 2 and isinstance(compiled[0], torch.nn.Module)
    assert compiled[1].func is compute_losses
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2
    torch._dynamo.reset()

    compiled.clear()
    run(scratch, tmp_path / "plain", max_steps=1)
    assert compiled == []  # off: no wrapper


def test_no_data_mode_never_waits_for_data(scratch: Path, tmp_path: Path) -> None:
    run(scratch, tmp_path / "out", phase={**PHASE, "workers": 1}, max_steps=3, no_data=True)
    steps = pd.read_csv(tmp_path / "out" / "steps.csv")
    assert len(steps) == 3
    assert (steps["data_wait_s"] == 0).all() and (steps["h2d_s"] == 0).all()
    assert np.isfinite(steps["loss"]).all()


def test_device_prefetch_feeds_the_same_batches(scratch: Path, tmp_path: Path) -> None:
    run(scratch, tmp_path / "plain", max_steps=2)
    run(scratch, tmp_path / "pref", phase={**PHASE, "device_prefetch": True}, max_steps=2)
    plain = pd.read_csv(tmp_path / "plain" / "steps.csv")
    pref = pd.read_csv(tmp_path / "pref" / "steps.csv")
    assert list(pref["loss"]) == list(plain["loss"])
    assert (pref[["data_wait_s", "h2d_s"]] >= 0).all().all()


def test_host_rss_includes_the_loader_workers(scratch: Path, tmp_path: Path) -> None:
    phase = {**PHASE, "workers": 2, "prefetch_factor": 2}
    run(scratch, tmp_path / "out", phase=phase, max_steps=4)
    logged = pd.read_csv(tmp_path / "out" / "steps.csv")["host_rss_mb"]
    own = psutil.Process().memory_info().rss / 2**20  # this process alone, after the run
    # Two forked workers each hold a good part of this process's pages.
    assert logged.max() > 1.3 * own, (list(logged), own)


# --------------------------------------------------------------------------- kill and resume

PAUSE_HOOK = """
import os, sys, time
from pathlib import Path

import ctseg.training.feeds
from ctseg.console import RESUMED
from ctseg.cli import main

pause_at = int(os.environ["CTSEG_TEST_PAUSE_AT"])
marker = Path(os.environ["CTSEG_TEST_MARKER"])
real_to_device = ctseg.training.feeds.to_device


def to_device(batch, *args, **kwargs):
    # Observation only: stall when the loop takes sample `pause_at`, so the test can kill it.
    if int(batch["index"][0]) == pause_at:
        marker.write_text(str(pause_at))
        time.sleep(600)
    return real_to_device(batch, *args, **kwargs)


ctseg.training.feeds.to_device = to_device
sys.exit(main(sys.argv[1:]))
"""
RESUME_EXP = experiment(train={"epochs": 3, "steps_per_epoch": 4})
PAUSE_AT = 6  # epoch 1 (steps 5-8) has done steps 5 and 6 and is fetching step 7's sample


def train_command(scratch: Path, run_dir: Path, workers: int) -> list[str]:
    split = run_dir / "split.csv"
    split.parent.mkdir(parents=True, exist_ok=True)
    rows = [f"{i},1,train" for i in TRAIN_IDS] + [f"{i},1,val" for i in VAL_IDS]
    split.write_text("id,scroll_id,split\n" + "\n".join(rows) + "\n")
    phase = {**PHASE, "workers": workers, "prefetch_factor": 2}
    return [
        "train",
        *settings_args(run_dir / "settings", RESUME_EXP, {0: phase}),
        *("--phase", "0", "--scratch", str(scratch), "--split", str(split)),
        *("--out", str(run_dir / "train"), "--state-dir", str(run_dir / "checkpoints")),
        *("--weights", str(run_dir / "last.pt")),
        *("--device", "cpu"),
    ]


def start(argv: list[str], run_dir: Path, env: dict) -> tuple[subprocess.Popen, Path]:
    """Start a process with stderr to a file (forked loader workers share a pipe's write end,
    so a killed run's pipe would stay open until they notice and exit)."""
    log = run_dir / f"stderr-{len(list(run_dir.glob('stderr-*')))}.txt"
    with open(log, "w") as handle:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=handle, env=env)
    return proc, log


def finish(proc: subprocess.Popen, log: Path, timeout: float = 400) -> None:
    rc = proc.wait(timeout=timeout)
    assert rc == 0, f"{proc.args[:3]} exited {rc}:\n{log.read_text()[-3000:]}"


@pytest.fixture(scope="module")
def resume_runs(scratch: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """For workers 0 and 2, a `ctseg train` SIGKILLed mid-epoch and then rerun; and the same
    training uninterrupted (in this process, one thread like the others, while they start)."""
    root = tmp_path_factory.mktemp("resume")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    ctseg_bin = str(BIN / "ctseg")
    killed: dict[int, dict] = {}
    for workers in (0, 2):
        run_dir = root / f"workers{workers}"
        run_dir.mkdir()
        marker = run_dir / "paused"
        pause_env = dict(env, CTSEG_TEST_PAUSE_AT=str(PAUSE_AT), CTSEG_TEST_MARKER=str(marker))
        argv = [sys.executable, "-c", PAUSE_HOOK, *train_command(scratch, run_dir, workers)]
        proc, log = start(argv, run_dir, pause_env)
        killed[workers] = {"dir": run_dir, "proc": proc, "log": log, "marker": marker}

    reference = root / "reference"
    with torch_globals():
        train(
            RESUME_EXP,
            PHASE,
            scratch=scratch,
            train_ids=TRAIN_IDS,
            val_ids=VAL_IDS,
            out_dir=reference / "train",
            state_dir=reference / "checkpoints",
            final_weights=reference / "last.pt",
            clip_distance=CLIP,
            device="cpu",
            progress=False,
        )

    deadline = time.monotonic() + 400
    for info in killed.values():
        proc = info["proc"]
        while not info["marker"].exists():
            assert proc.poll() is None, f"run exited early:\n{info['log'].read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the run never reached the pause"
            time.sleep(0.1)
        # The first epoch's checkpoint is there, and the second epoch has taken steps since.
        checkpoint = info["dir"] / "checkpoints" / "resume.pt"
        info["checkpoint_step"] = torch.load(checkpoint, weights_only=True)["step"]
        workers_before = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        # Orphaned loader workers notice their parent is gone and exit by themselves.
        _, alive = psutil.wait_procs(workers_before, timeout=30)
        for child in alive:
            child.kill()
        info["killed_steps"] = pd.read_csv(info["dir"] / "checkpoints" / "steps.csv")["step"]
        info["killed_checkpoint"] = info["dir"] / "checkpoint-at-kill.pt"
        info["killed_checkpoint"].write_bytes(checkpoint.read_bytes())
        info["left_weights"] = (info["dir"] / "last.pt").exists()

    reruns = {
        w: start([ctseg_bin, *train_command(scratch, info["dir"], w)], info["dir"], env)
        for w, info in killed.items()
    }
    for proc, log in reruns.values():
        finish(proc, log)
    return {
        "reference": reference,
        "killed": killed,
        "rerun_stderr": {w: log.read_text() for w, (_, log) in reruns.items()},
    }


def test_progress_bar_shows_rate_and_data_wait(resume_runs: dict) -> None:
    stderr = resume_runs["rerun_stderr"][0]  # a plain `ctseg train`
    assert re.search(r"\d+/12 \[", stderr), stderr[-2000:]
    assert re.search(r"\d+(\.\d+)?(s/step|step/s)", stderr), stderr[-2000:]
    assert re.search(r"wait=\d+%", stderr), stderr[-2000:]


@pytest.mark.parametrize("workers", [0, 2])
def test_sigkill_mid_epoch_then_resume_gives_bit_identical_weights(
    resume_runs: dict, workers: int
) -> None:
    info = resume_runs["killed"][workers]
    assert info["checkpoint_step"] == 4  # killed in epoch 1, after epoch 0's checkpoint
    assert list(info["killed_steps"]) == [1, 2, 3, 4]
    assert not info["left_weights"]
    rerun = resume_runs["rerun_stderr"][workers]
    assert " 4/12 [" in rerun and " 1/12 [" not in rerun  # it went on from the checkpoint
    # The line the workflow's console repeats (ctseg.console.resumed_trainings).
    assert sum(bool(RESUMED.match(line)) for line in rerun.splitlines()) == 1, rerun[-2000:]
    assert "resumed at step 4 (epoch 1) from " in rerun
    expected = weights(resume_runs["reference"] / "last.pt")
    actual = weights(info["dir"] / "last.pt")
    assert expected.keys() == actual.keys()
    different = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not different, f"tensors differ after resume: {different}"


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_logs_have_one_row_per_step_and_epoch(resume_runs: dict, workers: int) -> None:
    run_dir = resume_runs["killed"][workers]["dir"]
    reference = resume_runs["reference"]
    steps = pd.read_csv(run_dir / "train" / "steps.csv")
    epochs = pd.read_csv(run_dir / "train" / "epochs.csv")
    assert list(steps["step"]) == list(range(1, 13))
    assert list(steps["epoch"]) == [0] * 4 + [1] * 4 + [2] * 4
    assert list(epochs["epoch"]) == [0, 1, 2] and list(epochs["step"]) == [4, 8, 12]
    # The redone steps computed exactly what the uninterrupted run computed.
    ref_steps = pd.read_csv(reference / "train" / "steps.csv")
    ref_epochs = pd.read_csv(reference / "train" / "epochs.csv")
    for column in ("loss", *TRAINED_TERMS, "grad_norm", "lr"):
        assert list(steps[column]) == list(ref_steps[column]), column
    for column in ("train_loss", "val_loss", "val_dice"):
        assert list(epochs[column]) == list(ref_epochs[column]), column


def test_logs_written_ahead_of_the_checkpoint_are_not_doubled(
    resume_runs: dict, scratch: Path, tmp_path: Path
) -> None:
    """A run killed after an epoch's logs were written but before its checkpoint was: the
    logs run ahead of the checkpoint, and the redone steps must replace those rows."""
    reference = resume_runs["reference"]
    state = tmp_path / "checkpoints"
    state.mkdir()
    (state / "resume.pt").write_bytes(resume_runs["killed"][0]["killed_checkpoint"].read_bytes())
    for name in ("steps.csv", "epochs.csv"):  # all 12 steps and 3 epochs
        (state / name).write_bytes((reference / "checkpoints" / name).read_bytes())
    train(
        RESUME_EXP,
        PHASE,
        scratch=scratch,
        train_ids=TRAIN_IDS,
        val_ids=VAL_IDS,
        out_dir=tmp_path / "train",
        state_dir=state,
        clip_distance=CLIP,
        device="cpu",
        progress=False,
    )
    steps = pd.read_csv(tmp_path / "train" / "steps.csv")
    epochs = pd.read_csv(tmp_path / "train" / "epochs.csv")
    assert list(steps["step"]) == list(range(1, 13))
    assert list(epochs["epoch"]) == [0, 1, 2]
    ref_steps = pd.read_csv(reference / "train" / "steps.csv")
    assert list(steps["loss"]) == list(ref_steps["loss"])


@pytest.mark.parametrize("workers", [0, 2])
def test_sigkill_then_resume_keeps_the_best_pt_of_an_uninterrupted_run(
    resume_runs: dict, workers: int
) -> None:
    run_dir = resume_runs["killed"][workers]["dir"]
    reference = resume_runs["reference"]
    expected = load_checkpoint(reference / "best.pt")
    scores = pd.read_csv(reference / "train" / "epochs.csv")["val_dice"]
    assert expected["step"] == 4 * (int(scores.idxmax()) + 1)  # the first of the highest scores
    actual = load_checkpoint(run_dir / "best.pt")
    assert actual["step"] == expected["step"] and same(actual["model"], expected["model"])
    record = load_checkpoint(run_dir / "checkpoints" / "resume.pt")["best"]
    assert record == load_checkpoint(reference / "checkpoints" / "resume.pt")["best"]
    assert record == {
        "val_dice": scores.max(),
        "epoch": int(scores.idxmax()),
        "step": 4 * (int(scores.idxmax()) + 1),
    }


# --------------------------------------------------------------------------- best.pt


def scripted_validation(
    monkeypatch: pytest.MonkeyPatch,
    scores: list[float],
    state: Path,
    stop: StopRequest | None = None,
) -> list[dict]:
    """Validation replaced by `scores`, one per epoch in turn. Each call records the model it
    was given and a copy of its weights, and the step of the best.pt in `state` before it;
    with `stop`, the first call asks the run to stop (it does so after that epoch's checkpoint)."""
    calls: list[dict] = []
    left = list(scores)

    def evaluate(model, *args, **kwargs) -> dict[str, float]:
        best = state / "best.pt"
        calls.append(
            {
                "model": model,
                "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "best_step": load_checkpoint(best)["step"] if best.exists() else None,
            }
        )
        if stop is not None:
            stop.signum = signal.SIGTERM
        return {"val_loss": 1.0, "val_dice": left.pop(0)}

    monkeypatch.setattr(ctseg.training.train, "evaluate", evaluate)
    # Not looked at here, and a matplotlib figure drawn every epoch would be most of the time.
    monkeypatch.setattr(ctseg.training.train, "open_live_view", lambda *a, **k: NoLiveView())
    return calls


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_best_pt_holds_the_validated_ema_weights_of_the_first_best_score(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ema = {"decay": 0.5, "start_step": 0}
    exp = experiment(train={"epochs": 4, "steps_per_epoch": 1, "ema": ema})
    state = tmp_path / "state"
    calls = scripted_validation(monkeypatch, [0.2, 0.5, 0.5, 0.3], state)
    run(scratch, tmp_path / "out", exp, state_dir=state, final_weights=tmp_path / "last.pt")
    # Written when the score beat the best so far (steps 1 and 2), not on a tie or a drop.
    assert [c["best_step"] for c in calls] == [None, 1, 2, 2]
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["step"] == 2 and best["weights"] == "ema"
    assert best.keys() == load_checkpoint(tmp_path / "last.pt").keys()
    assert same(best["model"], calls[1]["weights"])  # the weights validated at step 2
    assert (tmp_path / "best.pt").read_bytes() == (state / "best.pt").read_bytes()
    resume = load_checkpoint(state / "resume.pt")
    assert resume["best"] == {"val_dice": 0.5, "epoch": 1, "step": 2}
    # Validation was given the EMA: the one model it saw ends as last.pt's (the EMA's) weights,
    # which are not the trained ones.
    assert len({id(c["model"]) for c in calls}) == 1
    last = weights(tmp_path / "last.pt")
    assert same(portable_state_dict(calls[-1]["model"]), last)
    assert not same(resume["model"], last)
    assert load_model(tmp_path / "best.pt")[1] == (16, 16, 16)


def test_a_resumed_run_keeps_the_best_score_of_its_checkpoint(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exp = experiment(train={"epochs": 3, "steps_per_epoch": 1})

    def trained(root: Path, scores: list[float], stop: StopRequest | None = None) -> dict:
        scripted_validation(monkeypatch, scores, root / "state", stop)
        out = root / "out"
        return run(
            scratch, out, exp, state_dir=root / "state", final_weights=root / "last.pt", stop=stop
        )

    trained(tmp_path / "whole", [0.5, 0.3, 0.4])
    stopped = tmp_path / "stopped"
    assert trained(stopped, [0.5], StopRequest())["saved_step"] == 1
    # The same checkpoint as one written before best.pt was kept: no score, no best.pt.
    older = tmp_path / "older"
    (older / "state").mkdir(parents=True)
    state = load_checkpoint(stopped / "state" / "resume.pt")
    save_checkpoint(older / "state" / "resume.pt", {k: v for k, v in state.items() if k != "best"})

    summary = trained(stopped, [0.3, 0.4])
    assert summary["from_step"] == 1
    # Without the score of step 1 kept, the resumed run would take step 3's 0.4 for its best.
    assert (stopped / "best.pt").read_bytes() == (tmp_path / "whole" / "best.pt").read_bytes()
    assert load_checkpoint(stopped / "best.pt")["step"] == 1

    summary = trained(older, [0.3, 0.4])
    assert summary["from_step"] == 1
    assert load_checkpoint(older / "best.pt")["step"] == 3  # the best of what it validated


def test_without_validation_volumes_best_pt_is_the_final_weights(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ctseg.training.train, "open_live_view", lambda *a, **k: NoLiveView())
    exp = experiment(train={"epochs": 2, "steps_per_epoch": 1})
    train(
        exp,
        PHASE,
        scratch=scratch,
        train_ids=TRAIN_IDS,
        val_ids=[],
        out_dir=tmp_path / "out",
        state_dir=tmp_path / "state",
        final_weights=tmp_path / "last.pt",
        clip_distance=CLIP,
        device="cpu",
        progress=False,
    )
    assert pd.read_csv(tmp_path / "out" / "epochs.csv")["val_dice"].isna().all()
    assert not (tmp_path / "state" / "best.pt").exists()
    best, last = load_checkpoint(tmp_path / "best.pt"), load_checkpoint(tmp_path / "last.pt")
    assert best["step"] == last["step"] == 2 and same(best["model"], last["model"])


def test_a_checkpoint_copied_without_its_best_pt_says_so_and_keeps_the_final_weights(
    basic_run: Path, scratch: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "resume.pt").write_bytes((basic_run / "state" / "resume.pt").read_bytes())
    run(scratch, tmp_path / "out", state_dir=state, final_weights=tmp_path / "w.pt")
    step = load_checkpoint(basic_run / "best.pt")["step"]
    line = (
        f"{state}/best.pt: missing: {state}/resume.pt records the best weights of step {step} "
        "there; best.pt will hold the best validation after step 6"
    )
    assert line in capsys.readouterr().err.splitlines()
    assert same(weights(tmp_path / "best.pt"), weights(tmp_path / "w.pt"))


# --------------------------------------------------------------------------- phase trials


def trial(scratch: Path, out: Path, phase: dict, exp: dict | None = None, **kw) -> dict:
    """run_trial's summary, as a dict (what summary.json holds)."""
    return run_trial(
        exp or EXPERIMENT,
        kw.pop("phase_id", 0),
        phase,
        scratch=scratch,
        train_ids=TRAIN_IDS,
        out_dir=out,
        clip_distance=CLIP,
        device="cpu",
        **kw,
    ).to_dict()


def test_trial_summary_and_comparison_with_the_previous_phase(
    scratch: Path, tmp_path: Path
) -> None:
    first = trial(scratch, tmp_path / "phase0", PHASE)
    second_phase = {**PHASE, "batch_size": 2}
    second = trial(
        scratch,
        tmp_path / "phase1",
        second_phase,
        phase_id=1,
        previous=tmp_path / "phase0" / "summary.json",
    )
    on_disk = json.loads((tmp_path / "phase1" / "summary.json").read_text())
    assert on_disk["status"] == "ok" and on_disk["phase"] == 1
    for summary in (first, on_disk):
        assert summary["status"] == "ok"
        assert summary["median_step_s"] > 0 and summary["samples_per_s"] > 0
        assert 0 <= summary["data_wait_fraction"] <= 1
        assert summary["feed_efficiency"] > 0 and summary["ceiling_samples_per_s"] > 0
        assert summary["peak_vram_gb"] is None  # CPU
        assert summary["peak_host_rss_gb"] > 0
        assert summary["checks"]["host_ram_ok"] is True and summary["checks"]["vram_ok"] is None
        # The machine facts the diagnosis used, and the diagnosis itself.
        assert summary["cpu_count"] == available_cpus() and summary["device"] == "cpu"
        assert summary["scratch_format"] == "raw" and summary["version"] == SUMMARY_VERSION
        assert summary["verdict"] and summary["verdict_reason"] and summary["next_knob"]
        assert summary["thresholds"]["feed_efficiency"] == 0.9
    steps = pd.read_csv(tmp_path / "phase1" / "steps.csv")
    ceiling = pd.read_csv(tmp_path / "phase1" / "ceiling" / "steps.csv")
    # trial.ceiling_steps is 2, but the ceiling runs at least as many steps as the real run.
    # + the profiler's warm-up step and the profiled steps (ctseg.trials.kernel_profile)
    assert len(steps) == 3 and len(ceiling) == 3 + PROFILE_WARMUP + PROFILE_STEPS
    assert steps["data_wait_s"].gt(0).all()
    measured = steps["step_s"].iloc[1:]  # trial.warmup_steps = 1 left out
    assert second["median_step_s"] == pytest.approx(measured.median())
    assert second["samples_per_s"] == pytest.approx(2 / measured.median())
    # Precision: each run's spread over its measured steps, and the feed efficiency's band.
    real, top = second["step_stats"]["real"], second["step_stats"]["ceiling"]
    assert real["n"] == top["n"] == 2
    assert (real["min_s"], real["max_s"]) == (measured.min(), measured.max())
    assert top["median_s"] == pytest.approx(ceiling["step_s"].iloc[1:3].median())
    assert second["feed_efficiency"] == pytest.approx(top["median_s"] / real["median_s"])
    assert second["feed_efficiency_band"] >= 0
    # Two measured steps per run are too few for a spread: the verdict says so.
    assert second["verdict"] == "not measurable" and "2 measured steps" in second["verdict_reason"]
    assert second["maths"] == {"batch_size": 2, "accumulate": 1, "precision": "fp32", "gpus": 1}
    checks = second["checks"]
    assert checks["previous_phase"] == 0
    assert checks["speedup_vs_previous"] == pytest.approx(
        second["samples_per_s"] / first["samples_per_s"]
    )
    assert checks["step_time_vs_previous"] == pytest.approx(
        second["median_step_s"] / first["median_step_s"]
    )


def test_trial_over_the_host_memory_limit_is_over_memory(scratch: Path, tmp_path: Path) -> None:
    exp = experiment(trial={"host_ram_limit_gb": 0.001})
    summary = trial(scratch, tmp_path / "phase0", PHASE, exp)
    assert summary["status"] == "over_memory"
    assert summary["checks"]["host_ram_ok"] is False
    assert summary["peak_host_rss_gb"] > 0.001


def test_trial_whose_loader_workers_fail_is_recorded(scratch: Path, tmp_path: Path) -> None:
    """A record that cannot be read fails in the worker process; the trial says so and the
    workflow goes on."""
    broken = tmp_path / "scratch"
    for rid in TRAIN_IDS:
        (broken / rid).mkdir(parents=True)
        for path in (scratch / rid).iterdir():
            (broken / rid / path.name).write_bytes(path.read_bytes())
        (broken / rid / "image.npy").write_bytes(b"\x93NUMPY truncated")
    summary = trial(broken, tmp_path / "phase1", {**PHASE, "workers": 1}, phase_id=1)
    assert summary["status"] == "failed"
    assert "DataLoader worker" in summary["error"]
    assert "cannot open raw scratch record" in summary["error"]
    assert str(broken) in summary["error"] and "traceback" in summary
    on_disk = json.loads((tmp_path / "phase1" / "summary.json").read_text())
    assert on_disk["status"] == "failed" and on_disk["verdict"] == "failed"
    assert on_disk["cpu_count"] == available_cpus() and on_disk["device"] == "cpu"
    assert (tmp_path / "phase1" / "steps.csv").exists()  # the rule's declared output


OOM_WRAPPER = """
import resource, sys

import pandas  # noqa: F401
import ctseg.trials.trials  # torch, the model, the data path: everything a trial imports
from ctseg.cli import main

# A hard address-space limit 1 GiB above what the process maps now: a real allocation failure
# once the trial's first big activation no longer fits.
with open("/proc/self/status") as handle:
    mapped = next(int(line.split()[1]) for line in handle if line.startswith("VmSize:")) * 1024
limit = mapped + 2**30
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.exit(main(sys.argv[1:]))
"""


def test_trial_out_of_memory_is_recorded_and_the_cli_goes_on(scratch: Path, tmp_path: Path) -> None:
    # 256^3 patches: each 4-channel activation of the first level is 256 MiB.
    exp = experiment(data={"patch_size": [256, 256, 256]})
    split = tmp_path / "split.csv"
    split.write_text("id,scroll_id,split\na,1,train\nb,1,train\nc,1,val\n")
    out = tmp_path / "phase0"
    argv = [
        sys.executable,
        "-c",
        OOM_WRAPPER,
        "trial",
        *settings_args(tmp_path / "settings", exp, {0: PHASE}),
        *("--phase", "0", "--scratch", str(scratch), "--split", str(split)),
        *("--out", str(out), "--device", "cpu"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "oom", summary
    assert summary["verdict"] == "out of memory" and summary["next_knob"]
    assert "allocate" in summary["error"].lower() or "memory" in summary["error"].lower()
    assert (out / "steps.csv").exists()


def write_summary(path: Path, phase: int, status: str, samples_per_s: float = 1.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = {"phase": phase, "status": status}
    if status != "failed":
        summary["samples_per_s"] = samples_per_s
    path.write_text(json.dumps(summary))
    return path


def test_choose_phase_picks_the_fastest_ok_phase(tmp_path: Path) -> None:
    summaries = [
        write_summary(tmp_path / "p0.json", 0, "ok", 2.0),
        write_summary(tmp_path / "p1.json", 1, "ok", 5.0),
        write_summary(tmp_path / "p2.json", 2, "over_memory", 9.0),
        write_summary(tmp_path / "p3.json", 3, "oom"),
        write_summary(tmp_path / "p4.json", 4, "failed"),
        write_summary(tmp_path / "p5.json", 5, "ok", 5.0),  # a tie goes to the earlier phase
    ]
    assert choose_phase(summaries) == 1
    assert choose_phase(summaries[:1]) == 0


def test_choose_phase_without_an_ok_trial_is_a_clear_error(tmp_path: Path) -> None:
    summaries = [
        write_summary(tmp_path / "p0.json", 0, "oom"),
        write_summary(tmp_path / "p1.json", 1, "failed"),
    ]
    with pytest.raises(CtsegError, match="no trial finished ok.*p0.json"):
        choose_phase(summaries)
