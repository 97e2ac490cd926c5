"""Several GPUs: DDP under torchrun, run here as 2 CPU processes with the gloo backend.

Real `python -m torch.distributed.run --standalone --nproc_per_node 2 ... ctseg.cli train`
runs on the tiny staged scratch of test_train (a two-level U-Net on 16^3 patches). A hook
script observes each rank without changing what it computes: the training samples it takes
and the files it writes (and, once, it stops rank 0 the way a preempted job stops).

- One run is stopped at the start of step 4, after epoch 0's checkpoint, and run again: the
  rerun resumes at step 3 and ends with the same weights as one process that takes the same
  global batch (batch 1 x accumulate 2) without stopping, bit for bit (the trained weights and
  their EMA, which last.pt holds).
- Both ranks end with the same parameters, draw disjoint streams that together are the
  one-process stream, and only rank 0 writes: one resume.pt, one last.pt, one steps.csv.
- A phase trial under torchrun writes one summary of the whole job.
- A dry run shows the rules launching torchrun and asking for the GPUs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import TINY_CONFIG, TINY_EXPERIMENT, copy_workflow, run_snakemake, settings_args
from training_setup import (
    CLIP,
    PHASE,
    TRAIN_IDS,
    VAL_IDS,
    build_scratch,
    torch_globals,
)
from training_setup import EXPERIMENT as TRAIN_EXPERIMENT

from ctseg.config import configured_gpus
from ctseg.data.loader import StreamSampler
from ctseg.io import CtsegError
from ctseg.network.flops import count_flops
from ctseg.training.distributed import ddp_phase
from ctseg.training.train import train
from ctseg.trials.kernel_profile import PROFILE_STEPS, PROFILE_WARMUP

EXPERIMENT = copy.deepcopy(TRAIN_EXPERIMENT)
EXPERIMENT["name"] = "tddp"
EXPERIMENT["train"].update(val_batches=3, gpus=2)  # validation batches split 2 + 1 over ranks
EXPERIMENT["train"]["ema"] = {"decay": 0.5, "start_step": 2}  # kept from the plain module's weights
EXPERIMENT["trial"]["phases"] = [0]
STOP_AT = 6  # the first sample of step 4: 3 steps x 2 ranks x 1 sample came before

HOOK = """
import json, os, sys
from pathlib import Path

import ctseg.training.feeds
import ctseg.training.train
from ctseg.cli import main

rank = int(os.environ["RANK"])
record = Path(os.environ["CTSEG_TEST_RECORD"]) / f"rank{rank}.jsonl"
stop_at = int(os.environ.get("CTSEG_TEST_STOP_AT", "-1"))


def note(**event):
    with open(record, "a") as handle:
        handle.write(json.dumps(event) + "\\n")


# The training feed's to_device sees every training batch (validation has its own).
real_to_device = ctseg.training.feeds.to_device


def to_device(batch, *args, **kwargs):
    indices = batch["index"].tolist()
    if rank == 0 and 0 <= stop_at <= min(indices):
        os._exit(3)  # stopped like a preempted job: no cleanup, no more writes
    note(kind="train", indices=indices)
    return real_to_device(batch, *args, **kwargs)


def recorded(kind, real):
    def wrapper(path, *args, **kwargs):
        note(kind=kind, path=str(path))
        return real(path, *args, **kwargs)

    return wrapper


ctseg.training.feeds.to_device = to_device
ctseg.training.train.save_checkpoint = recorded("save_checkpoint",
ctseg.training.train.save_checkpoint)
ctseg.training.train.append_rows = recorded("append_rows", ctseg.training.train.append_rows)
sys.exit(main(sys.argv[1:]))
"""


# --------------------------------------------------------------------------- units


def test_stream_sampler_deals_each_rank_every_world_th_micro_batch() -> None:
    """Step s, rank r, micro-batch m of `accum` per rank takes the batch of samples from
    ((s * accum + m) * world + r) * batch on; a resumed stream goes on where it stopped."""
    batch, accum, world, steps = 2, 3, 2, 4
    stop = steps * accum * world * batch
    streams = [list(StreamSampler(0, stop, rank=r, world=world, chunk=batch)) for r in range(world)]
    for r, stream in enumerate(streams):
        expected = [
            ((s * accum + m) * world + r) * batch + i
            for s in range(steps)
            for m in range(accum)
            for i in range(batch)
        ]
        assert stream == expected
        assert len(StreamSampler(0, stop, rank=r, world=world, chunk=batch)) == len(stream)
    assert not set(streams[0]) & set(streams[1])
    assert sorted(streams[0] + streams[1]) == list(range(stop))
    resume_at = 2 * accum * world * batch  # after step 2
    for r, stream in enumerate(streams):
        resumed = list(StreamSampler(resume_at, stop, rank=r, world=world, chunk=batch))
        assert resumed == stream[len(stream) - len(resumed) :]
    # One process: the plain stream, whatever the chunk.
    assert list(StreamSampler(3, 9, chunk=4)) == list(range(3, 9))
    # A short tail: what is left, in turn, and the lengths say so.
    tail = [StreamSampler(0, 5, rank=r, world=2, chunk=2) for r in range(2)]
    assert [list(s) for s in tail] == [[0, 1, 4], [2, 3]]
    assert [len(s) for s in tail] == [3, 2]
    with pytest.raises(CtsegError, match="rank 2 of world 2"):
        StreamSampler(0, 4, rank=2, world=2)


def test_gpus_setting_phase_wins_and_accumulate_counts_all_processes() -> None:
    exp = {"train": {"gpus": 2}}
    assert configured_gpus(exp, {}) == 2
    assert configured_gpus(exp, {"gpus": 4}) == 4
    assert configured_gpus({"train": {}}, {}) == 1
    phase = {**PHASE, "accumulate": 3}
    assert ddp_phase(exp, phase, 2) == {**phase, "gpus": 2, "accumulate": 6}
    assert ddp_phase({"train": {}}, phase, 1) == phase
    with pytest.raises(CtsegError, match="gpus: 2.*1 process.*nproc_per_node 2"):
        ddp_phase(exp, phase, 1)
    with pytest.raises(CtsegError, match="gpus: 1.*2 process"):
        ddp_phase({"train": {"gpus": 1}}, phase, 2)


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scratch(tmp_path_factory.mktemp("ddp_data"))


def torchrun(command: str, args: list[str], records: Path, **env: str) -> dict:
    """`ctseg <command> ...` as 2 processes under torchrun, through the hook; returns the
    exit status, the output and each rank's observed events (kept in `records`)."""
    records.mkdir(parents=True)
    hook = records / "hook.py"
    hook.write_text(HOOK)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    environ = dict(os.environ, CTSEG_TEST_RECORD=str(records), OMP_NUM_THREADS="1", **env)
    proc = subprocess.run(
        [*argv, str(hook), command, *args], capture_output=True, text=True, env=environ, timeout=300
    )
    events = {}
    for rank in (0, 1):
        path = records / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        events[rank] = [json.loads(line) for line in lines]
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "events": events}


def cli_args(scratch: Path, run_dir: Path, command: str = "train") -> list[str]:
    split = run_dir / "split.csv"
    split.parent.mkdir(parents=True, exist_ok=True)
    rows = [f"{i},1,train" for i in TRAIN_IDS] + [f"{i},1,val" for i in VAL_IDS]
    split.write_text("id,scroll_id,split\n" + "\n".join(rows) + "\n")
    common = [
        *settings_args(run_dir / "settings", EXPERIMENT, {0: PHASE}),
        *("--phase", "0", "--scratch", str(scratch), "--split", str(split)),
        *("--device", "cpu"),
    ]
    if command == "trial":
        return [*common, "--out", str(run_dir / "phase0")]
    return [
        *common,
        *("--out", str(run_dir / "train"), "--state-dir", str(run_dir / "checkpoints")),
        *("--weights", str(run_dir / "last.pt")),
    ]


@pytest.fixture(scope="module")
def runs(scratch: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A DDP training stopped at step 4 and run again; the same global batch in one process."""
    root = tmp_path_factory.mktemp("ddp_runs")
    run_dir = root / "ddp"
    stopped = torchrun(
        "train", cli_args(scratch, run_dir), root / "stopped", CTSEG_TEST_STOP_AT=str(STOP_AT)
    )
    stopped_state = torch.load(run_dir / "checkpoints" / "resume.pt", weights_only=True)
    stopped_steps = pd.read_csv(run_dir / "checkpoints" / "steps.csv")
    stopped_left_weights = (run_dir / "last.pt").exists()
    resumed = torchrun("train", cli_args(scratch, run_dir), root / "resumed")

    reference = root / "one_process"
    with torch_globals():
        train(
            {**EXPERIMENT, "train": {**EXPERIMENT["train"], "gpus": 1}},
            {**PHASE, "accumulate": 2},
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
    return {
        "dir": run_dir,
        "stopped": stopped,
        "stopped_state": stopped_state,
        "stopped_steps": stopped_steps,
        "stopped_left_weights": stopped_left_weights,
        "resumed": resumed,
        "reference": reference,
    }


def taken(run: dict, rank: int) -> list[int]:
    """The training samples a rank took, in order."""
    return [i for e in run["events"][rank] if e["kind"] == "train" for i in e["indices"]]


def summary_of(run: dict) -> dict:
    assert run["rc"] == 0, run["stderr"][-3000:]
    return json.loads(run["stdout"][run["stdout"].index("{") :])


def test_stopped_run_left_the_first_epoch_checkpoint(runs: dict) -> None:
    stopped = runs["stopped"]
    assert stopped["rc"] != 0  # rank 0 stopped; torchrun ended rank 1 and failed
    assert runs["stopped_state"]["step"] == 3 and runs["stopped_state"]["epoch"] == 1
    assert runs["stopped_state"]["sample_index"] == 6  # 3 steps x 2 ranks x batch 1
    assert runs["stopped_state"]["world_size"] == 2
    assert list(runs["stopped_steps"]["step"]) == [1, 2, 3]
    assert not runs["stopped_left_weights"]


def test_resumed_run_continues_from_the_checkpoint(runs: dict) -> None:
    resumed = runs["resumed"]
    assert summary_of(resumed)["steps"] == 6
    assert "resumed at step 3 (epoch 1)" in resumed["stderr"]
    assert " 3/6 [" in resumed["stderr"] and " 1/6 [" not in resumed["stderr"]
    steps = pd.read_csv(runs["dir"] / "train" / "steps.csv")
    epochs = pd.read_csv(runs["dir"] / "train" / "epochs.csv")
    assert list(steps["step"]) == [1, 2, 3, 4, 5, 6]
    assert list(epochs["epoch"]) == [0, 1] and list(epochs["step"]) == [3, 6]
    # It took the samples after the checkpoint's: steps 4-6, each rank its own.
    assert taken(resumed, 0) == [6, 8, 10] and taken(resumed, 1) == [7, 9, 11]


def test_ddp_trains_what_one_process_trains_with_the_same_global_batch(runs: dict) -> None:
    """2 ranks x batch 1 = 1 process x batch 1 x accumulate 2: the gradients are all-reduced
    (averaged), the loss terms averaged over the ranks, and the stop and resume change nothing.
    On the CPU every step is exact, so the weights agree bit for bit."""
    for name, part in (
        ("last.pt", "model"),
        *(("checkpoints/resume.pt", p) for p in ("model", "ema")),
    ):
        expected = torch.load(runs["reference"] / name, weights_only=True)[part]
        actual = torch.load(runs["dir"] / name, weights_only=True)[part]
        different = [k for k in expected if not torch.equal(expected[k], actual[k])]
        assert not different, f"{name} {part}: tensors differ: {different}"
    ddp = pd.read_csv(runs["dir"] / "train" / "steps.csv")
    one = pd.read_csv(runs["reference"] / "train" / "steps.csv")
    for column in ("loss", "bce", "dice", "cldice", "skel_recall", "boundary", "grad_norm", "lr"):
        assert list(ddp[column]) == list(one[column]), column
    # Throughput counts the samples of both ranks: 2 per step; so do the model FLOP/s.
    np.testing.assert_allclose(ddp["samples_per_s"] * ddp["step_s"], 2.0)
    flops = count_flops(EXPERIMENT["model"], EXPERIMENT["data"]["patch_size"]).train
    np.testing.assert_allclose(ddp["tflops"], flops * ddp["samples_per_s"] / 1e12, rtol=1e-9)
    np.testing.assert_allclose(
        ddp["data_wait_s"] + ddp["h2d_s"] + ddp["compute_s"], ddp["step_s"], rtol=1e-9
    )
    # Validation split its 3 batches over the ranks and gathered the same numbers.
    ddp_epochs = pd.read_csv(runs["dir"] / "train" / "epochs.csv")
    one_epochs = pd.read_csv(runs["reference"] / "train" / "epochs.csv")
    for column in ("train_loss", "val_loss", "val_dice"):
        assert list(ddp_epochs[column]) == list(one_epochs[column]), column


def test_ranks_end_with_identical_parameters(runs: dict) -> None:
    digests = summary_of(runs["resumed"])["param_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert summary_of(runs["resumed"])["world_size"] == 2


def test_ranks_draw_disjoint_streams_that_make_the_one_process_stream(runs: dict) -> None:
    # Epoch 0 from the stopped run (rank 1 may have taken step 4's sample before it was
    # stopped too), the rest from the resumed one.
    streams = {r: taken(runs["stopped"], r)[:3] + taken(runs["resumed"], r) for r in (0, 1)}
    assert streams == {0: [0, 2, 4, 6, 8, 10], 1: [1, 3, 5, 7, 9, 11]}
    assert taken(runs["stopped"], 0) == [0, 2, 4]  # stopped as it went for sample 6


def test_only_rank_0_writes(runs: dict) -> None:
    for run in ("stopped", "resumed"):
        writes = [e for e in runs[run]["events"][1] if e["kind"] != "train"]
        assert writes == [], (run, writes)
    saved = [
        Path(e["path"]).name for e in runs["resumed"]["events"][0] if e["kind"] == "save_checkpoint"
    ]
    assert saved == ["resume.pt", "last.pt"]  # epoch 1's checkpoint, then the weights
    files = sorted(str(p.relative_to(runs["dir"])) for p in runs["dir"].rglob("*") if p.is_file())
    # An event file is named by its time, host and pid: one per attempt, stopped then resumed.
    files = [re.sub(r"tfevents\..*", "tfevents.*", name) for name in files]
    assert files == [
        "best.pt",  # the best validation's weights, published beside last.pt
        "checkpoints/best.pt",
        "checkpoints/epochs.csv",
        "checkpoints/resume.previous.pt",  # epoch 0's checkpoint, kept by epoch 1's save
        "checkpoints/resume.pt",
        "checkpoints/steps.csv",
        "last.pt",
        "progress.png",  # the live view (ctseg.training.live_view), drawn every epoch
        "settings/phases.yaml",  # the settings files and split.csv are this test's inputs
        "settings/tddp.yaml",
        "split.csv",
        "tensorboard/events.out.tfevents.*",
        "tensorboard/events.out.tfevents.*",
        "train/epochs.csv",
        "train/settings.json",  # what the run was trained with (the report's settings)
        "train/steps.csv",
    ]
    # Rank 0 alone printed the summary.
    assert runs["resumed"]["stdout"].count('"param_sha256"') == 1


def test_phase_trial_under_torchrun_writes_one_summary(scratch: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "trial"
    run = torchrun("trial", cli_args(scratch, run_dir, "trial"), tmp_path / "records")
    summary = summary_of(run)
    on_disk = json.loads((run_dir / "phase0" / "summary.json").read_text())
    assert on_disk["status"] == summary["status"] == "ok", on_disk
    # The whole job's step: batch 1 on each of 2 processes.
    assert on_disk["effective_batch"] == 2
    assert on_disk["settings"]["gpus"] == 2 and on_disk["maths"]["accumulate"] == 2
    steps = pd.read_csv(run_dir / "phase0" / "steps.csv")
    assert len(steps) == 3
    np.testing.assert_allclose(steps["samples_per_s"] * steps["step_s"], 2.0)
    # trial.ceiling_steps is 2, but the ceiling runs at least as many steps as the real run.
    # + the kernel profile's warm-up and profiled steps (every rank runs them; rank 0 profiles)
    ceiling = pd.read_csv(run_dir / "phase0" / "ceiling" / "steps.csv")
    assert len(ceiling) == 3 + PROFILE_WARMUP + PROFILE_STEPS
    assert [e for e in run["events"][1] if e["kind"] != "train"] == []
    # The measured run's 3 steps (then the ceiling's resident batch).
    assert taken(run, 0)[:3] == [0, 2, 4] and taken(run, 1)[:3] == [1, 3, 5]


# --------------------------------------------------------------------------- the rules


@pytest.fixture
def ddp_workflow(tmp_path: Path) -> Path:
    """The workflow with an experiment on 2 GPUs, and a phase 1 that asks for 3 itself."""
    workdir = copy_workflow(tmp_path, TINY_CONFIG)
    exp = copy.deepcopy(TINY_EXPERIMENT)
    exp["name"] = "tiny_ddp"
    exp["train"]["gpus"] = 2
    (workdir / "config" / "experiments" / "tiny_ddp.yaml").write_text(yaml.safe_dump(exp))
    phases = yaml.safe_load((workdir / "config" / "phases.yaml").read_text())
    phases["phases"][1]["gpus"] = 3
    (workdir / "config" / "phases.yaml").write_text(yaml.safe_dump(phases))
    return workdir


def dry_run_jobs(output: str) -> dict[str, dict[str, str]]:
    """rule name (with the trial's phase) -> its `resources:` and `Shell command:` lines."""
    jobs: dict[str, dict[str, str]] = {}
    current = None
    for line in output.splitlines():
        text = line.strip()
        if text.startswith("rule "):
            current = {"rule": text[5:].rstrip(":")}
        elif current is not None and text.startswith(("threads:", "resources:")):
            current[text.split(":")[0]] = text
        elif current is not None and text.startswith("Shell command:"):
            # The command after the rule's attempt-log keeping (rule_args.KEEP_ATTEMPT_LOG).
            command = text.removeprefix("Shell command:").strip().rsplit(" && ", 1)[-1]
            current["shell"] = f"Shell command: {command}"
            name = current["rule"]
            if name == "train_trial":
                name += text.split("--phase ")[1].split()[0]
            jobs[name] = current
            current = None
    return jobs


def test_rules_launch_torchrun_and_ask_for_the_gpus(ddp_workflow: Path) -> None:
    proc = run_snakemake(
        ddp_workflow,
        *("trials", "train", "-n", "-p", "--cores", "16", "--resources", "gpu=3"),
        *("--config", "experiment=tiny_ddp", "phase=0"),
    )
    jobs = dry_run_jobs(proc.stdout + proc.stderr)
    train_job, trial0, trial1 = jobs["train_model"], jobs["train_trial0"], jobs["train_trial1"]
    # The experiment's gpus: 2 for train and phase 0; phase 1's own gpus: 3 wins over it. The
    # training replaces the shell (exec), so a scheduler's SIGTERM reaches torchrun.
    assert train_job["shell"].startswith(
        "Shell command: exec torchrun --standalone --nproc_per_node 2 -m ctseg.cli train "
    )
    assert "torchrun --standalone --nproc_per_node 2 -m ctseg.cli trial " in trial0["shell"]
    assert "torchrun --standalone --nproc_per_node 3 -m ctseg.cli trial " in trial1["shell"]
    for job, gpus, workers in ((train_job, 2, 1), (trial0, 2, 1), (trial1, 3, 2)):
        assert f"gpu={gpus}" in job["resources"], job
        # Per process: 4000 MB plus 1500 per loader worker; threads for the workers + 1.
        assert f"mem_mb={gpus * (4000 + 1500 * workers)}," in job["resources"], job
        assert job["threads"] == f"threads: {gpus * (workers + 1)}", job


def test_auto_over_phases_with_different_gpus_is_a_clear_error(ddp_workflow: Path) -> None:
    proc = run_snakemake(
        ddp_workflow, "-n", "train", "--config", "experiment=tiny_ddp", "phase=auto", check=False
    )
    assert proc.returncode != 0
    assert "ask for different gpus" in proc.stdout + proc.stderr
