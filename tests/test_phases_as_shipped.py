"""Every phase of config/phases.yaml, exactly as the file defines it, through the `ctseg` CLI.

The phases are read from the shipped file, so a phase added there is covered without editing
this test. For each one, on the CPU: a trial, a training run that writes last.pt, `ctseg infer`
with those weights, and a run killed after its first checkpoint and rerun, which must resume
and end with the same weights bit for bit. bf16 autocast, channels_last and torch.compile (the
real default backend, inductor) run as they are; pin_memory and device_prefetch take their CPU
paths.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import tifffile
import torch
import yaml
import zarr
from conftest import REPO
from training_setup import EXPERIMENT, TRAIN_IDS, VAL_IDS, build_scratch, torch_globals

from ctseg.cli import main
from ctseg.config import load_phases

SHIPPED = yaml.safe_load((REPO / "config" / "phases.yaml").read_text())["phases"]
SHIPPED_LOADED = load_phases(REPO / "config" / "phases.yaml")
STEPS_PER_EPOCH, EPOCHS = 2, 2
EXP = copy.deepcopy(EXPERIMENT)
EXP["train"].update(steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS, deterministic=True)
EXP["trial"].update(steps=3, warmup_steps=1, ceiling_steps=2)
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

# Runs `ctseg` with one observation: the loader stalls when it is asked for sample `pause_at`,
# after writing a marker, so that the test can kill the run at a known point.
PAUSE_HOOK = """
import os, sys, time
from pathlib import Path

import ctseg.data.patches
from ctseg.cli import main
from ctseg.config import load_phases

pause_at = int(os.environ["CTSEG_TEST_PAUSE_AT"])
marker = Path(os.environ["CTSEG_TEST_MARKER"])
real_plan = ctseg.data.patches.PatchDataset.plan


def plan(self, index):
    # Every sample, packed or not, in a worker or in the main process, is planned first.
    if index == pause_at:
        marker.write_text(str(index))
        time.sleep(600)
    return real_plan(self, index)


ctseg.data.patches.PatchDataset.plan = plan
sys.exit(main(sys.argv[1:]))
"""


def training_args(phase_id: int, scratch: Path, run_dir: Path) -> list[str]:
    split = run_dir.parent / "split.csv"
    if not split.exists():
        rows = [f"{i},1,train" for i in TRAIN_IDS] + [f"{i},1,val" for i in VAL_IDS]
        split.write_text("id,scroll_id,split\n" + "\n".join(rows) + "\n")
    return [
        *("--experiment", str(experiment_file(scratch.parent))),
        *("--phases", str(REPO / "config" / "phases.yaml")),
        *("--phase", str(phase_id)),
        *("--scratch", str(scratch), "--split", str(split)),
        *("--device", "cpu"),
    ]


def train_args(phase_id: int, scratch: Path, run_dir: Path) -> list[str]:
    return [
        "train",
        *training_args(phase_id, scratch, run_dir),
        *("--out", str(run_dir / "train"), "--state-dir", str(run_dir / "checkpoints")),
        *("--weights", str(run_dir / "last.pt")),
    ]


def kill_tree(proc: subprocess.Popen) -> None:
    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=30)
    for child in alive:
        child.kill()


def interrupted_then_resumed(phase_id: int, phase: dict, scratch: Path, run_dir: Path) -> dict:
    """`ctseg train` killed while it waits for the first sample of epoch 1's second step (after
    epoch 0's checkpoint), then the same command again."""
    run_dir.mkdir(parents=True)
    batch = int(phase["batch_size"]) * int(phase.get("accumulate", 1))
    pause_at = (STEPS_PER_EPOCH + 1) * batch
    marker = run_dir / "paused"
    env = dict(ENV, CTSEG_TEST_PAUSE_AT=str(pause_at), CTSEG_TEST_MARKER=str(marker))
    argv = [sys.executable, "-c", PAUSE_HOOK, *train_args(phase_id, scratch, run_dir)]
    with open(run_dir / "killed.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    checkpoint = run_dir / "checkpoints" / "resume.pt"
    deadline = time.monotonic() + 300
    while not (marker.exists() and checkpoint.exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc) if proc.poll() is None else None
            raise AssertionError(
                f"phase {phase_id}: the run never paused after its checkpoint:\n"
                + (run_dir / "killed.log").read_text()[-3000:]
            )
        time.sleep(0.05)
    killed_at = torch.load(checkpoint, weights_only=True)["step"]
    kill_tree(proc)
    rerun = subprocess.run(
        [sys.executable, "-m", "ctseg.cli", *train_args(phase_id, scratch, run_dir)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    return {"checkpoint_step": killed_at, "stderr": rerun.stderr, "stdout": rerun.stdout}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shipped_data")
    experiment_file(root).write_text(yaml.safe_dump(EXP))
    return build_scratch(root)


def experiment_file(data_root: Path) -> Path:
    """The experiment as a file beside the staged data (the CLI takes files, as rules pass)."""
    return data_root / f"{EXP['name']}.yaml"


@pytest.fixture(scope="module", params=sorted(SHIPPED), ids=lambda p: f"phase{p}")
def shipped(request: pytest.FixtureRequest, scratch: Path, tmp_path_factory) -> dict:
    phase_id = int(request.param)
    phase = SHIPPED[request.param]
    root = tmp_path_factory.mktemp(f"phase{phase_id}")
    with torch_globals():
        trial_dir = root / "trial"
        main(["trial", *training_args(phase_id, scratch, trial_dir), "--out", str(trial_dir)])
        main(train_args(phase_id, scratch, root / "run"))
        image = scratch.parent / "store" / "zarr" / "images" / f"{VAL_IDS[0]}.zarr"
        infer = root / "infer"
        main(
            [
                *("infer", str(root / "run" / "last.pt"), str(image)),
                *("--mask", str(infer / "mask.tif"), "--probabilities", str(infer / "p.zarr")),
                *("--batch-size", "2", "--device", "cpu"),
            ]
        )
    resumed = interrupted_then_resumed(phase_id, phase, scratch, root / "killed")
    return {"id": phase_id, "phase": phase, "root": root, "image": image, "resumed": resumed}


def test_every_shipped_phase_is_covered() -> None:
    # The fixture's params come from the file; this guards against reading an empty file.
    assert len(SHIPPED) >= 7 and all(isinstance(k, int) for k in SHIPPED)


def test_trial_finishes_ok(shipped: dict) -> None:
    summary = json.loads((shipped["root"] / "trial" / "summary.json").read_text())
    assert summary["status"] == "ok", summary.get("traceback", summary)
    # The phase as the file defines it, with the schema's defaults (ctseg.config) filled in.
    assert summary["settings"] == dict(SHIPPED_LOADED[shipped["id"]])
    assert all(summary["settings"][k] == v for k, v in shipped["phase"].items())
    assert summary["samples_per_s"] > 0 and 0 < summary["feed_efficiency"] < 100


def test_train_writes_weights_that_infer_loads(shipped: dict) -> None:
    final = torch.load(shipped["root"] / "run" / "last.pt", weights_only=True)
    assert final["step"] == STEPS_PER_EPOCH * EPOCHS
    # Saved in the plain layout whatever the phase trained in.
    assert all(t.is_contiguous() for t in final["model"].values())
    probs = zarr.open_array(str(shipped["root"] / "infer" / "p.zarr"), mode="r")[:]
    shape = zarr.open_array(str(shipped["image"]), mode="r").shape
    mask = tifffile.imread(shipped["root"] / "infer" / "mask.tif")
    assert probs.shape == shape and mask.shape == shape
    assert np.isfinite(probs).all() and probs.min() >= 0 and probs.max() <= 1
    assert set(np.unique(mask)) <= {0, 1}
    assert np.array_equal(mask, (probs > 0.5).astype(np.uint8))


def test_a_killed_run_resumes_to_the_same_weights(shipped: dict) -> None:
    resumed = shipped["resumed"]
    assert resumed["checkpoint_step"] == STEPS_PER_EPOCH
    assert re.search(rf"resumed at step {STEPS_PER_EPOCH} \(epoch 1\)", resumed["stderr"])
    reference = torch.load(shipped["root"] / "run" / "last.pt", weights_only=True)["model"]
    actual = torch.load(shipped["root"] / "killed" / "last.pt", weights_only=True)["model"]
    different = [k for k in reference if not torch.equal(reference[k], actual[k])]
    assert not different, f"phase {shipped['id']}: tensors differ after resume: {different}"
