"""Fine-tuning (`init_from`, `ctseg train --init-from`, ctseg.training.finetune): the run starts
from the source weights with a fresh optimizer and schedule, refuses a source of another model
naming the layer, and its identity follows the source's weights.

The same tiny training as test_train (tests/training_setup.py), shortened to 2 steps.
"""

from __future__ import annotations

import copy
from hashlib import sha256
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import settings_args
from training_setup import CLIP, EXPERIMENT, PHASE, TRAIN_IDS, VAL_IDS, build_scratch, torch_globals

import ctseg.training.train
from ctseg.cli import main
from ctseg.io import CtsegError
from ctseg.network.model import build_model, portable_state_dict
from ctseg.run_settings import read_run_settings
from ctseg.training.checkpoint import CHECKSUM_TAG, load_checkpoint, save_checkpoint
from ctseg.training.finetune import source_weights, state_digest
from ctseg.training.recipe import lr_at, scaled_lr
from ctseg.training.train import train

FINE_TUNE = copy.deepcopy(EXPERIMENT)
FINE_TUNE.update(name="tiny_finetune", init_from="tiny_source")
FINE_TUNE["train"].update(epochs=1, steps_per_epoch=2, log_every=1)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scratch(tmp_path_factory.mktemp("finetune_data"))


@pytest.fixture(autouse=True)
def _isolated_torch_state():
    with torch_globals():
        yield


def source_file(path: Path, seed: int, model_cfg: dict | None = None) -> dict[str, torch.Tensor]:
    """A last.pt as `ctseg train` writes it, of a model initialised from `seed`."""
    torch.manual_seed(seed)
    state = portable_state_dict(build_model(model_cfg or EXPERIMENT["model"]))
    payload = {"model": state, "model_config": model_cfg or EXPERIMENT["model"], "step": 6}
    save_checkpoint(path, {**payload, "patch_size": [16, 16, 16], "weights": "trained"})
    return state


def fine_tune(scratch: Path, root: Path, source: Path, **kw) -> dict:
    return train(
        FINE_TUNE,
        PHASE,
        scratch=scratch,
        train_ids=TRAIN_IDS,
        val_ids=VAL_IDS,
        out_dir=root / "out",
        state_dir=root / "state",
        final_weights=root / "last.pt",
        init_from=source,
        clip_distance=CLIP,
        device="cpu",
        progress=False,
        **kw,
    )


def test_a_fine_tune_starts_from_the_source_with_a_fresh_optimizer_and_schedule(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = source_file(tmp_path / "source.pt", seed=123)
    first: list[dict] = []
    real = ctseg.training.train.train_step

    def spy(run, batches):
        if not first:
            weights = portable_state_dict(run.model)
            first.append({"weights": weights, "step": run.step, "adam": dict(run.optimizer.state)})
        return real(run, batches)

    monkeypatch.setattr(ctseg.training.train, "train_step", spy)
    fine_tune(scratch, tmp_path, tmp_path / "source.pt")
    (start,) = first
    assert start["step"] == 0 and start["adam"] == {}
    assert start["weights"].keys() == source.keys()
    assert all(torch.equal(start["weights"][k], source[k]) for k in source)
    torch.manual_seed(EXPERIMENT["train"]["seed"])  # not the seed's own initial weights
    own = build_model(EXPERIMENT["model"]).state_dict()
    assert any(not torch.equal(own[k], source[k]) for k in own)
    # The schedule starts over: step 1 used the warmup's first learning rate.
    base = scaled_lr(FINE_TUNE["train"], 1)
    lr = pd.read_csv(tmp_path / "out" / "steps.csv")["lr"]
    assert lr[0] == pytest.approx(lr_at(0, base_lr=base, warmup=2, total=2, min_ratio=0.05))


def test_ctseg_train_init_from_fine_tunes_from_the_file(scratch: Path, tmp_path: Path) -> None:
    source_file(tmp_path / "source.pt", seed=123)
    split = tmp_path / "split.csv"
    rows = [f"{i},1,train" for i in TRAIN_IDS] + [f"{i},1,val" for i in VAL_IDS]
    split.write_text("id,scroll_id,split\n" + "\n".join(rows) + "\n")
    argv = [
        "train",
        *settings_args(tmp_path / "settings", FINE_TUNE, {0: PHASE}),
        *("--phase", "0", "--scratch", str(scratch), "--split", str(split)),
        *("--out", str(tmp_path / "out"), "--state-dir", str(tmp_path / "state")),
        *("--weights", str(tmp_path / "last.pt"), "--device", "cpu"),
        *("--init-from", str(tmp_path / "source.pt")),
    ]
    assert main(argv) == 0
    identity = load_checkpoint(tmp_path / "state" / "resume.pt")["identity"]
    assert identity["experiment"]["init_from"] == "tiny_source"
    assert identity["source_weights"] == state_digest(
        load_checkpoint(tmp_path / "source.pt")["model"]
    )
    # The report's settings table reads the source and its digest from settings.json.
    recorded = read_run_settings(tmp_path / "out" / "settings.json")
    assert recorded["experiment"]["init_from"] == "tiny_source"
    assert recorded["source_weights"] == identity["source_weights"]


def test_a_source_of_another_model_is_refused_naming_the_layer_and_both_shapes(
    scratch: Path, tmp_path: Path
) -> None:
    other = {**EXPERIMENT["model"], "filters": [4, 4]}
    source_file(tmp_path / "source.pt", seed=1, model_cfg=other)
    with pytest.raises(CtsegError) as error:
        fine_tune(scratch, tmp_path, tmp_path / "source.pt")
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "source.pt") in message
    assert (
        "shape (4, 4, 3, 3, 3) in the source weights but (8, 4, 3, 3, 3) in this model" in message
    )
    assert "layer " in message and not (tmp_path / "state" / "resume.pt").exists()


def test_retraining_the_source_makes_the_fine_tune_another_run(
    scratch: Path, tmp_path: Path
) -> None:
    source = tmp_path / "source.pt"
    state_a = source_file(source, seed=1)
    first = fine_tune(scratch, tmp_path, source)
    assert first["resume"] == "fresh" and first["steps"] == 2
    again = fine_tune(scratch, tmp_path, source)  # the same source: its checkpoint resumes
    assert again["resume"] == "resumed" and again["run_identity"] == first["run_identity"]

    state_b = source_file(source, seed=2)  # the source run was trained again
    assert state_digest(state_a) != state_digest(state_b)
    retrained = fine_tune(scratch, tmp_path, source)
    assert retrained["resume"] == "set_aside" and retrained["changed"] == ["source_weights"]
    assert retrained["run_identity"] != first["run_identity"]


def test_init_from_and_the_weights_go_together(tmp_path: Path) -> None:
    with pytest.raises(
        CtsegError, match=r"init_from.*pass --init-from results/tiny_source/last.pt"
    ):
        source_weights(FINE_TUNE, None)
    assert source_weights(FINE_TUNE, None, trial=True) is None  # a speed trial needs none
    with pytest.raises(CtsegError, match=r"has no init_from; add 'init_from: <run>'"):
        source_weights(EXPERIMENT, tmp_path / "source.pt")
    with pytest.raises(CtsegError, match=r"source.pt: weights file not found"):
        source_weights(FINE_TUNE, tmp_path / "source.pt")
    (tmp_path / "source.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(
        CtsegError, match=r"source.pt: unverifiable checkpoint: .*train tiny_source again"
    ) as error:
        source_weights(FINE_TUNE, tmp_path / "source.pt")
    assert "\n" not in str(error.value)
    # With a checksum that matches, but not a torch file: torch's own reason.
    junk = b"not a checkpoint"
    (tmp_path / "source.pt").write_bytes(junk + CHECKSUM_TAG + sha256(junk).hexdigest().encode())
    with pytest.raises(
        CtsegError, match=r"source.pt: cannot load checkpoint: .*train tiny_source"
    ) as error:
        source_weights(FINE_TUNE, tmp_path / "source.pt")
    assert "\n" not in str(error.value)
    assert source_weights(EXPERIMENT, None) is None
