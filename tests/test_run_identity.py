"""A run never resumes a checkpoint it did not write, and never loses one.

The run identity (ctseg.training.checkpoint.run_identity) names everything that determines the
trained weights. These tests change one thing at a time and check what resumes, what is set aside
and what the weights come out as; the end-to-end check goes through `snakemake train`.
"""

from __future__ import annotations

import copy
import io
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY_CONFIG, TINY_EXPERIMENT, copy_workflow, run_snakemake
from training_setup import CLIP, EXPERIMENT, PHASE, TRAIN_IDS, VAL_IDS, build_scratch, weights

import ctseg.io
import ctseg.training.checkpoint
import ctseg.training.recipe
from ctseg.io import CtsegError
from ctseg.training.checkpoint import identity_changes, run_identity, save_checkpoint
from ctseg.training.train import train

DATA = {"train:a": "f1", "train:b": "f2", "val:c": "f3"}


def identity(exp: dict | None = None, phase: dict | None = None, **kw) -> dict:
    args = {"data": DATA, "total_steps": 6, "clip_distance": CLIP, **kw}
    return run_identity(exp or EXPERIMENT, phase or PHASE, **args)


def changed(**sections: dict) -> dict:
    exp = copy.deepcopy(EXPERIMENT)
    for name, values in sections.items():
        exp[name] = {**exp[name], **values} if isinstance(exp.get(name), dict) else values
    return exp


# --------------------------------------------------------------------------- the identity


@pytest.mark.parametrize(
    ("exp", "key"),
    [
        (changed(train={"lr": 0.006}), "experiment.train.lr"),
        (changed(loss={"pos_weight": 3.0}), "experiment.loss.pos_weight"),
        (changed(model={"filters": [4, 4]}), "experiment.model.filters"),
        (changed(data={"fg_fraction": 0.9}), "experiment.data.fg_fraction"),
        (changed(train={"seed": 1}), "experiment.train.seed"),
    ],
)
def test_settings_that_change_the_maths_change_the_identity(exp: dict, key: str) -> None:
    assert identity_changes(identity(), identity(exp)) == [key]


@pytest.mark.parametrize(
    "exp",
    [
        changed(train={"log_every": 99, "val_batches": 7}),
        changed(trial={"steps": 50}),
        changed(name="renamed", scratch_format="zarr", source="s3://elsewhere"),
    ],
)
def test_settings_that_cannot_change_the_weights_keep_the_identity(exp: dict) -> None:
    assert identity(exp) == identity()


def test_phase_maths_keys_change_the_identity_and_loader_keys_do_not() -> None:
    assert identity(phase={**PHASE, "workers": 6, "prefetch_factor": 4}) == identity()
    assert identity(phase={**PHASE, "pin_memory": True, "compile": True}) == identity()
    for key, value in {"batch_size": 2, "accumulate": 2, "precision": "bf16", "gpus": 2}.items():
        assert identity_changes(identity(), identity(phase={**PHASE, key: value})) == [
            f"phase.{key}"
        ]


def test_data_steps_and_clip_distance_change_the_identity() -> None:
    assert identity_changes(identity(), identity(data={**DATA, "train:b": "fixed"})) == [
        "data.train:b"
    ]
    assert identity_changes(identity(), identity(total_steps=9)) == ["total_steps"]
    assert identity_changes(identity(), identity(clip_distance=8.0)) == ["clip_distance"]


# --------------------------------------------------------------------------- in one process


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scratch(tmp_path_factory.mktemp("identity_data"))


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


@pytest.fixture(scope="module")
def finished(scratch: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("finished")
    assert run(scratch, root)["resume"] == "fresh"
    return root


def copy_run(source: Path, dest: Path) -> Path:
    (dest / "state").mkdir(parents=True)
    for name in ("resume.pt", "steps.csv", "epochs.csv"):
        (dest / "state" / name).write_bytes((source / "state" / name).read_bytes())
    return dest


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_unchanged_rerun_resumes_and_trains_no_further(
    scratch: Path, finished: Path, tmp_path: Path
) -> None:
    root = copy_run(finished, tmp_path / "again")
    summary = run(scratch, root)
    assert summary["resume"] == "resumed" and summary["from_step"] == 6
    assert same_weights(finished / "last.pt", root / "last.pt")


def test_a_changed_lr_sets_the_old_run_aside_and_trains_afresh(
    scratch: Path, finished: Path, tmp_path: Path
) -> None:
    faster = changed(train={"lr": EXPERIMENT["train"]["lr"] * 3})
    root = copy_run(finished, tmp_path / "changed")
    summary = run(scratch, root, faster)
    assert summary["resume"] == "set_aside" and summary["changed"] == ["experiment.train.lr"]
    assert summary["steps"] == 6
    aside = Path(summary["set_aside"])
    assert aside.parent == root / "state" / "set-aside"
    assert (aside / "resume.pt").read_bytes() == (finished / "state" / "resume.pt").read_bytes()
    assert (aside / "steps.csv").exists() and (aside / "epochs.csv").exists()
    # The new logs start at step 1: nothing of the old run is mixed in.
    assert (root / "out" / "steps.csv").read_text().count("\n") == 1 + 6
    fresh = run(scratch, tmp_path / "fresh", faster)
    assert fresh["resume"] == "fresh"
    assert same_weights(root / "last.pt", tmp_path / "fresh" / "last.pt")
    assert not same_weights(root / "last.pt", finished / "last.pt")


def test_a_longer_run_starts_afresh_rather_than_past_its_end(
    scratch: Path, finished: Path, tmp_path: Path
) -> None:
    shorter = changed(train={"epochs": 1})
    root = copy_run(finished, tmp_path / "shorter")
    summary = run(scratch, root, shorter)
    assert summary["resume"] == "set_aside" and "total_steps" in summary["changed"]
    assert summary["steps"] == 3 and (root / "last.pt").exists()


def test_a_saved_step_beyond_the_end_is_a_mismatch(
    scratch: Path, finished: Path, tmp_path: Path
) -> None:
    root = copy_run(finished, tmp_path / "beyond")
    state = torch.load(root / "state" / "resume.pt", weights_only=True)
    state["step"] = 99
    save_checkpoint(root / "state" / "resume.pt", state)
    summary = run(scratch, root)
    assert summary["resume"] == "set_aside" and summary["changed"] == ["step beyond total_steps"]
    assert summary["steps"] == 6


def test_a_checkpoint_without_an_identity_is_set_aside(
    scratch: Path, finished: Path, tmp_path: Path
) -> None:
    root = copy_run(finished, tmp_path / "old_format")
    state = torch.load(root / "state" / "resume.pt", weights_only=True)
    del state["identity"]
    save_checkpoint(root / "state" / "resume.pt", state)
    assert run(scratch, root)["resume"] == "set_aside"


# --------------------------------------------------------------------------- a full disk


def test_a_checkpoint_that_cannot_fit_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "resume.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(4)})
    monkeypatch.setattr(ctseg.io, "free_bytes", lambda _path: 10)
    with pytest.raises(CtsegError, match="not enough free space to save the checkpoint"):
        save_checkpoint(path, {"step": 2, "w": torch.ones(1000)})
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["resume.pt"]


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A real 1 MiB filesystem (tmpfs; the tests run as root, as CI does)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_disk_that_fills_during_the_save_is_a_message_about_space(
    tiny_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_disk / "resume.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(16)})
    # Another process fills the disk between the up-front check and the write.
    monkeypatch.setattr(ctseg.training.checkpoint, "check_free_space", lambda *args, **kwargs: None)
    with pytest.raises(CtsegError) as info:
        save_checkpoint(path, {"step": 2, "w": torch.ones(2**19)})  # 2 MiB
    message = str(info.value)
    assert message.startswith(str(path)) and "no space left" in message
    assert "free some space and rerun" in message
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in tiny_disk.iterdir()] == ["resume.pt"]


# --------------------------------------------------------------------------- through snakemake


@pytest.mark.slow
def test_snakemake_train_after_an_lr_change_trains_the_new_run(tmp_path: Path) -> None:
    """Finish a run, multiply lr by 3 and rerun `snakemake train`: new weights, equal to a
    fresh run with the new lr, and the first run's checkpoint still on disk."""
    work = copy_workflow(tmp_path, TINY_CONFIG)
    exp_file = work / "config" / "experiments" / "tiny.yaml"
    exp = copy.deepcopy(TINY_EXPERIMENT)
    exp["train"] = {**exp["train"], "deterministic": True}
    exp_file.write_text(yaml.safe_dump(exp))
    weights_path = work / "results" / "tiny" / "last.pt"
    checkpoints = work / "results" / "tiny" / "checkpoints"

    run_snakemake(work, "--cores", "2", "train", "--config", "experiment=tiny")
    first = weights_path.read_bytes()
    first_checkpoint = (checkpoints / "resume.pt").read_bytes()

    exp["train"]["lr"] = 3 * float(exp["train"].get("lr", 0.002))
    exp_file.write_text(yaml.safe_dump(exp))
    run_snakemake(work, "--cores", "2", "train", "--config", "experiment=tiny")
    log = (work / "results" / "logs" / "train" / "tiny.log").read_text()
    assert "set it aside" in log and "experiment.train.lr" in log
    changed_run = weights(weights_path)
    assert not same_weights_bytes(first, weights_path)
    aside = list((checkpoints / "set-aside").glob("*/resume.pt"))
    assert [p.read_bytes() for p in aside] == [first_checkpoint]

    # A fresh run with the new lr, from nothing but the staged data.
    (checkpoints / "resume.pt").unlink()
    run_snakemake(
        work, "--cores", "2", "train", "--forcerun", "train", "--config", "experiment=tiny"
    )
    fresh = weights(weights_path)
    assert all(torch.equal(changed_run[k], fresh[k]) for k in fresh)


def same_weights_bytes(saved: bytes, path: Path) -> bool:
    old = torch.load(io.BytesIO(saved), weights_only=True)["model"]
    new = weights(path)
    return all(torch.equal(old[k], new[k]) for k in new)


def test_a_run_resumes_under_a_faster_phase_with_its_kernels(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same maths, other speed settings (phase 7's fused optimizer): the checkpoint resumes,
    and the optimizer keeps the resuming phase's kernel choice, not the saved one's."""
    root = tmp_path / "run"
    run(scratch, root, changed(train={"epochs": 1}))
    exp = changed(train={"epochs": 2})
    state = torch.load(root / "state" / "resume.pt", weights_only=True)
    # Make the checkpoint one of the two-epoch run, interrupted after its first epoch.
    state["identity"] = run_identity(
        exp, PHASE, data=state["identity"]["data"], total_steps=6, clip_distance=CLIP
    )
    save_checkpoint(root / "state" / "resume.pt", state)
    seen = []
    real = ctseg.training.recipe.build_optimizer

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(ctseg.training.recipe, "build_optimizer", spy)
    summary = train(
        exp,
        {**PHASE, "fused_optimizer": True},
        scratch=scratch,
        train_ids=TRAIN_IDS,
        val_ids=VAL_IDS,
        out_dir=root / "out",
        state_dir=root / "state",
        clip_distance=CLIP,
        device="cpu",
        progress=False,
    )
    assert summary["resume"] == "resumed" and summary["from_step"] == 3
    assert summary["steps"] == 6
    assert all(group["fused"] for group in seen[0].param_groups)
