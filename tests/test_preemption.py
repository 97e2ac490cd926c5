"""Preemption and damage: checksummed checkpoints, a stop on SIGTERM/SIGUSR1 at a step boundary,
mid-epoch checkpoints on a timer, the free-space check before an epoch, and `log_every`.

The same tiny training as test_train (tests/training_setup.py), on the CPU, one thread. The
acceptance check runs real `ctseg train` processes and signals their whole process group, as
a scheduler does.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
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

import ctseg.io
import ctseg.training.feeds
import ctseg.training.train
from ctseg.io import CtsegError
from ctseg.training.checkpoint import (
    PREVIOUS,
    TRAILER_BYTES,
    append_rows,
    load_checkpoint,
    read_rows,
    run_identity,
    trim_logs,
    verify_checksum,
)
from ctseg.training.preempt import RESUMABLE_EXIT, shielded, stop_on_signals
from ctseg.training.train import train

BIN = Path(sys.executable).parent


def experiment(**train_keys: object) -> dict:
    exp = copy.deepcopy(EXPERIMENT)
    exp["train"].update(train_keys)
    return exp


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scratch(tmp_path_factory.mktemp("preempt_data"))


@pytest.fixture(autouse=True)
def _isolated_torch_state():
    with torch_globals():
        yield


def run(scratch: Path, root: Path, exp: dict | None = None, **kw) -> dict:
    return train(
        exp or EXPERIMENT,
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


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def signal_at_sample(monkeypatch: pytest.MonkeyPatch, index: int, signum: int) -> None:
    """Send `signum` to this process when the loop fetches sample `index` (mid-step)."""
    real = ctseg.training.feeds.to_device

    def to_device(batch, *args, **kwargs):
        if int(batch["index"][0]) == index:
            os.kill(os.getpid(), signum)
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(ctseg.training.feeds, "to_device", to_device)


@pytest.fixture(scope="module")
def reference(scratch: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epochs of three steps, uninterrupted."""
    root = tmp_path_factory.mktemp("reference")
    with torch_globals():
        assert run(scratch, root)["steps"] == 6
    return root


# --------------------------------------------------------------------------- signals


def test_stop_signals_set_a_flag_inside_the_block_and_the_old_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    with stop_on_signals() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)  # handled at once, on this (the main) thread
        assert stop.requested and stop.name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first one's name
        assert stop.name == "SIGUSR1"
    assert {sig: signal.getsignal(sig) for sig in before} == before


def _worker(started) -> None:
    # Like a torch loader worker: SIGTERM from anyone but the parent kills it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    started.set()
    time.sleep(1)


def _exit_after_sigterm(shield: bool) -> int | None:
    context = multiprocessing.get_context("fork")
    started = context.Event()
    with stop_on_signals() as stop:
        with shielded(stop) if shield else contextlib.nullcontext():
            child = context.Process(target=_worker, args=(started,))
            child.start()
        assert started.wait(30)
        os.kill(child.pid, signal.SIGTERM)  # as a scheduler signals every process of a job
        child.join(30)
    return child.exitcode


def test_a_child_started_while_shielded_outlives_a_sigterm() -> None:
    assert _exit_after_sigterm(shield=False) == -signal.SIGTERM
    assert _exit_after_sigterm(shield=True) == 0


# --------------------------------------------------------------------------- checksums


def test_a_checkpoint_carries_a_checksum_that_finds_64_changed_bytes(tmp_path: Path) -> None:
    path = tmp_path / "resume.pt"
    ctseg.training.train.save_checkpoint(path, {"step": 3, "w": torch.arange(4096.0)})
    assert verify_checksum(path) is True
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    path.write_bytes(bytes(data))
    assert verify_checksum(path) is False
    with pytest.raises(CtsegError, match=r"resume.pt: damaged checkpoint"):
        load_checkpoint(path)
    # One rewritten by plain torch.save has no checksum: it cannot be verified, so it is refused.
    torch.save({"step": 3}, path)
    assert verify_checksum(path) is None
    with pytest.raises(CtsegError, match=r"resume.pt: unverifiable checkpoint: it has no checksum"):
        load_checkpoint(path)


def test_a_damaged_checkpoint_is_set_aside_and_the_previous_one_resumed(
    scratch: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stopped by SIGUSR1 during step 5 (sample 4): checkpoints at step 3 (epoch end) and 5.
    signal_at_sample(monkeypatch, 4, signal.SIGUSR1)
    with stop_on_signals() as stop:
        stopped = run(scratch, tmp_path, stop=stop)
    monkeypatch.undo()
    assert stopped["stopped"] == "SIGUSR1" and stopped["saved_step"] == 5
    assert not (tmp_path / "last.pt").exists()  # no final weights from a stopped run
    state = tmp_path / "state"
    assert load_checkpoint(state / PREVIOUS)["step"] == 3

    resume_pt = state / "resume.pt"
    data = bytearray(resume_pt.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = b"\xff" * 64
    resume_pt.write_bytes(bytes(data))

    summary = run(scratch, tmp_path)
    assert summary["resume"] == "resumed" and summary["from_step"] == 3
    (damaged,) = summary["damaged"]
    assert Path(damaged).read_bytes() == bytes(data)  # set aside as it was, never deleted
    assert Path(damaged).parent.parent == state / "set-aside"
    assert same_weights(tmp_path / "last.pt", reference / "last.pt")
    steps = pd.read_csv(tmp_path / "out" / "steps.csv")
    ref_steps = pd.read_csv(reference / "out" / "steps.csv")
    assert list(steps["step"]) == [1, 2, 3, 4, 5, 6]  # rows 4-5 redone, not doubled
    assert list(steps["loss"]) == list(ref_steps["loss"])
    assert list(pd.read_csv(tmp_path / "out" / "epochs.csv")["epoch"]) == [0, 1]


def test_a_checkpoint_without_its_checksum_is_set_aside_and_the_previous_one_resumed(
    scratch: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # Stopped during step 5: checkpoints at step 3 (resume.previous.pt) and 5 (resume.pt).
    signal_at_sample(monkeypatch, 4, signal.SIGUSR1)
    with stop_on_signals() as stop:
        run(scratch, tmp_path, stop=stop)
    monkeypatch.undo()
    state = tmp_path / "state"
    resume_pt = state / "resume.pt"
    # The trailer cut off (a copy cut short at the end, or a plain torch.save): torch would
    # still load it, and nothing could tell whether its weights are the ones saved.
    stripped = resume_pt.read_bytes()[:-TRAILER_BYTES]
    resume_pt.write_bytes(stripped)
    assert torch.load(resume_pt, weights_only=True)["step"] == 5
    capsys.readouterr()

    summary = run(scratch, tmp_path)

    assert summary["resume"] == "resumed" and summary["from_step"] == 3
    (aside,) = summary["damaged"]
    assert Path(aside).read_bytes() == stripped  # set aside as it was, never deleted
    err = capsys.readouterr().err
    assert f"{resume_pt}: unverifiable checkpoint: it has no checksum trailer" in err
    assert f"resuming from the intact checkpoint {state / PREVIOUS}" in err
    assert same_weights(tmp_path / "last.pt", reference / "last.pt")


def test_with_no_intact_checkpoint_the_run_starts_afresh_and_says_so(
    scratch: Path, reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    for name in ("resume.pt", PREVIOUS):
        (state / name).write_bytes(b"PK\x03\x04 not a checkpoint any more")
    summary = run(scratch, tmp_path)
    assert summary["resume"] == "fresh" and len(summary["damaged"]) == 2
    assert "no intact checkpoint is left: this run starts afresh" in capsys.readouterr().err
    assert same_weights(tmp_path / "last.pt", reference / "last.pt")


def test_logs_are_cut_back_to_the_resumed_step_and_a_cut_short_line_is_dropped(
    tmp_path: Path,
) -> None:
    append_rows(tmp_path / "steps.csv", [{"epoch": 0, "step": s, "loss": s / 10} for s in (1, 2)])
    append_rows(tmp_path / "steps.csv", [{"epoch": 0, "step": 3, "loss": 0.3}])
    with open(tmp_path / "steps.csv", "a") as handle:
        handle.write("0,4")  # a kill during an append
    assert [r["step"] for r in read_rows(tmp_path / "steps.csv")] == ["1", "2", "3"]
    trim_logs(tmp_path, 2)
    assert (tmp_path / "steps.csv").read_text() == "epoch,step,loss\n0,1,0.1\n0,2,0.2\n"
    trim_logs(tmp_path, 0)  # a fresh start keeps no row
    assert not (tmp_path / "steps.csv").exists()


def test_a_run_resumed_from_a_log_without_the_efficiency_columns_goes_on(
    scratch: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A steps.csv written before tflops and mfu were logged: the resumed run rewrites it
    with the new columns (empty in the old rows) and appends its rows."""
    signal_at_sample(monkeypatch, 4, signal.SIGUSR1)
    with stop_on_signals() as stop:
        assert run(scratch, tmp_path, stop=stop)["saved_step"] == 5
    monkeypatch.undo()
    log = tmp_path / "state" / "steps.csv"
    pd.read_csv(log).drop(columns=["tflops", "mfu"]).to_csv(log, index=False)

    assert run(scratch, tmp_path)["from_step"] == 5
    steps = pd.read_csv(tmp_path / "out" / "steps.csv")
    assert list(steps["step"]) == [1, 2, 3, 4, 5, 6]
    assert list(steps.columns[-2:]) == ["tflops", "mfu"]
    assert steps["mfu"].isna().tolist() == [True] * 5 + [False]
    ref_steps = pd.read_csv(reference / "out" / "steps.csv")
    assert list(steps["loss"]) == list(ref_steps["loss"])
    assert same_weights(tmp_path / "last.pt", reference / "last.pt")


# --------------------------------------------------------------------------- timer, space, log


def test_checkpoint_minutes_checkpoints_mid_epoch_without_changing_the_run(
    scratch: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved: list[int] = []
    real = ctseg.training.train.save_checkpoint

    def spy(path, payload, **kw):
        if path.name == "resume.pt":
            saved.append(int(payload["step"]))
        return real(path, payload, **kw)

    monkeypatch.setattr(ctseg.training.train, "save_checkpoint", spy)
    exp = experiment(checkpoint_minutes=1e-9)  # due after every step
    summary = run(scratch, tmp_path, exp)
    assert saved == [1, 2, 3, 4, 5, 6]  # steps 1, 2, 4, 5 are mid-epoch
    assert summary["steps"] == 6 and load_checkpoint(tmp_path / "state" / PREVIOUS)["step"] == 5
    assert same_weights(tmp_path / "last.pt", reference / "last.pt")


def test_checkpoint_minutes_is_not_part_of_the_run_identity() -> None:
    def identity(exp: dict) -> dict:
        return run_identity(exp, PHASE, data={"train:a": "x"}, total_steps=6, clip_distance=4.0)

    assert identity(experiment(checkpoint_minutes=5)) == identity(experiment())
    assert identity(experiment(log_every=1)) == identity(experiment())


def test_a_disk_too_small_for_the_checkpoint_stops_before_the_epoch(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[int] = []
    real = ctseg.training.train.train_step

    def counting(run_, batches):
        steps.append(run_.step)
        return real(run_, batches)

    monkeypatch.setattr(ctseg.training.train, "train_step", counting)
    monkeypatch.setattr(ctseg.io, "free_bytes", lambda _path: 1000)
    with pytest.raises(CtsegError, match=r"free space to save the checkpoint of epoch 0"):
        run(scratch, tmp_path)
    assert steps == []  # refused before the first step, not after the epoch's training


def test_log_every_appends_the_rows_every_n_steps_and_prints_a_line(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    appended: list[list[int]] = []
    real = ctseg.training.train.append_rows

    def spy(path, rows):
        if path.name == "steps.csv" and rows:
            appended.append([int(r["step"]) for r in rows])
        return real(path, rows)

    monkeypatch.setattr(ctseg.training.train, "append_rows", spy)
    train(
        experiment(log_every=2),
        PHASE,
        scratch=scratch,
        train_ids=TRAIN_IDS,
        val_ids=VAL_IDS,
        out_dir=tmp_path / "out",
        state_dir=tmp_path / "state",
        clip_distance=CLIP,
        device="cpu",
        progress=True,
    )
    # Every 2 steps, and at each epoch's end before its checkpoint (step 3).
    assert appended == [[1, 2], [3], [4], [5, 6]]
    assert list(pd.read_csv(tmp_path / "out" / "steps.csv")["step"]) == [1, 2, 3, 4, 5, 6]
    err = capsys.readouterr().err
    assert "step 2/6 (epoch 0): loss " in err and "step 4/6 (epoch 1)" in err
    assert "step 3/6" not in err


# --------------------------------------------------------------------------- a real SIGTERM

HOOK = """
import os, sys, time
from pathlib import Path

import ctseg.training.feeds
from ctseg.cli import main

pause_at = int(os.environ["CTSEG_TEST_PAUSE_AT"])
marker = Path(os.environ["CTSEG_TEST_MARKER"])
real_to_device = ctseg.training.feeds.to_device


def to_device(batch, *args, **kwargs):
    # Observation only: hold the step that takes sample `pause_at` for a few seconds, so the
    # test's signal lands mid-step; the step then goes on.
    if int(batch["index"][0]) == pause_at and not marker.exists():
        marker.write_text(str(pause_at))
        time.sleep(4)
    return real_to_device(batch, *args, **kwargs)


ctseg.training.feeds.to_device = to_device
sys.exit(main(sys.argv[1:]))
"""
SIGNAL_EXP = experiment(epochs=2, steps_per_epoch=5, checkpoint_minutes=30, log_every=2)
SIGNAL_AT = 6  # the second step of epoch 1 (steps 6-10)


def train_argv(scratch: Path, run_dir: Path) -> list[str]:
    split = run_dir / "split.csv"
    split.parent.mkdir(parents=True, exist_ok=True)
    rows = [f"{i},1,train" for i in TRAIN_IDS] + [f"{i},1,val" for i in VAL_IDS]
    split.write_text("id,scroll_id,split\n" + "\n".join(rows) + "\n")
    phase = {**PHASE, "workers": 2, "prefetch_factor": 2}
    return [
        "train",
        *settings_args(run_dir / "settings", SIGNAL_EXP, {0: phase}),
        *("--phase", "0", "--scratch", str(scratch), "--split", str(split)),
        *("--out", str(run_dir / "train"), "--state-dir", str(run_dir / "checkpoints")),
        *("--weights", str(run_dir / "last.pt"), "--device", "cpu"),
    ]


@pytest.mark.slow
def test_sigterm_to_the_job_mid_epoch_checkpoints_and_the_rerun_is_bit_exact(
    scratch: Path, tmp_path: Path
) -> None:
    """SIGTERM to the whole process group (the loader workers too, as SLURM and Snakemake
    send it) during step 7: `ctseg train` finishes that step, checkpoints it mid-epoch and
    exits 75; the rerun resumes at step 7 (no step is repeated: less than one
    checkpoint_minutes of work), its weights and logs equal an uninterrupted run's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    run_dir = tmp_path / "run"
    marker = run_dir / "paused"
    hook_env = dict(env, CTSEG_TEST_PAUSE_AT=str(SIGNAL_AT), CTSEG_TEST_MARKER=str(marker))
    argv = [sys.executable, "-c", HOOK, *train_argv(scratch, run_dir)]
    log = run_dir / "stopped.txt"
    with open(log, "w") as handle:
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=handle, env=hook_env, start_new_session=True
        )

    reference = tmp_path / "reference"  # meanwhile, the uninterrupted run in this process
    run(scratch, reference, SIGNAL_EXP)

    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, f"run exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the run never reached the signal point"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == RESUMABLE_EXIT, log.read_text()[-3000:]
    stopped_log = log.read_text()
    assert "stopped by SIGTERM at step 7 (epoch 1)" in stopped_log, stopped_log[-3000:]
    assert load_checkpoint(run_dir / "checkpoints" / "resume.pt")["step"] == 7
    assert not (run_dir / "last.pt").exists()

    rerun = subprocess.run(
        [str(BIN / "ctseg"), *train_argv(scratch, run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed at step 7 (epoch 1)" in rerun.stderr
    assert same_weights(run_dir / "last.pt", reference / "last.pt")
    steps = pd.read_csv(run_dir / "train" / "steps.csv")
    ref_steps = pd.read_csv(reference / "out" / "steps.csv")
    assert list(steps["step"]) == list(range(1, 11))
    assert list(steps["loss"]) == list(ref_steps["loss"])
    epochs = pd.read_csv(run_dir / "train" / "epochs.csv")
    ref_epochs = pd.read_csv(reference / "out" / "epochs.csv")
    assert list(epochs["step"]) == [5, 10]
    for column in ("train_loss", "val_loss", "val_dice"):
        assert list(epochs[column]) == list(ref_epochs[column]), column
