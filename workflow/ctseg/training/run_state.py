"""What a training run holds, where it stands, and what its checkpoints keep of it.

`ctseg.training.train.setup` builds a `Run` once; the loop moves its step, epoch and sample index on
and collects its log rows. `Run.resume` picks up this run's checkpoint where there is one
(`ctseg.training.checkpoint.resume_state` decides which). A resume checkpoint
(`Run.checkpoint_state`) is everything a rerun needs to go on bit for bit: the model,
optimizer, scheduler, grad scaler and EMA states, the RNG states, the position in the sample
stream and the current epoch's log rows; `Run.restore` puts them back. The final weights
(`Run.final_state`) are what inference and a fine-tune read: the EMA's weights where the run
keeps one (`ctseg.training.ema`), else the trained ones, with the model settings, patch size and
the dataset's label spec (``labels``, `ctseg.labels.LabelSpec.to_dict`).
best.pt (`Run.keep_best`, `Run.publish_best`) is the same for the epoch whose validation scored
best so far; the resume checkpoint keeps that score, so a resumed run keeps the same best.pt.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ctseg.io import CtsegError, check_free_space
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.network.flops import Efficiency
from ctseg.network.model import portable_state_dict
from ctseg.run_settings import write_run_settings
from ctseg.training.checkpoint import (
    BEST,
    checkpoint_bytes,
    identity_digest,
    publish_copy,
    restore,
    resume_state,
    rng_state,
    save_checkpoint,
    trim_logs,
)
from ctseg.training.distributed import Ranks
from ctseg.training.ema import WeightAverage
from ctseg.training.probes import GpuMonitor, host_rss_bytes
from ctseg.training.stopping import Stopping

# What picks best.pt: the hard Dice of the validation patches (`ctseg.training.validation`),
# higher is better. Dice, not the validation loss: the loss is a training objective whose terms
# and weights are the experiment's choice, while Dice scores the thresholded masks that inference
# delivers, and is comparable between runs. A tie keeps the earlier epoch's weights.
BEST_BY = "val_dice"


def model_config(model: Mapping[str, Any], labels: LabelSpec = KAGGLE) -> dict[str, Any]:
    """The experiment's model settings for a dataset of `labels`: its ``out_channels`` (the run
    plan fills it) must be the spec's (`LabelSpec.out_channels`: 1 binary, K+1 multi-class); a
    multi-class spec's is filled in where the settings leave it out."""
    channels, given = labels.out_channels, model.get("out_channels")
    if given is not None and int(given) != channels:
        raise CtsegError(
            f"{labels.source}: {labels.n_classes} foreground class(es) need model.out_channels "
            f"{channels}, the experiment has {given}; set it to {channels} (the run plan fills "
            "it: 1 binary, K+1 multi-class)"
        )
    if given is None and channels != 1:
        return {**model, "out_channels": channels}
    return dict(model)


@dataclass
class Run:
    """What `setup` builds once, and where the run stands: step, epoch, unwritten log rows."""

    exp: Mapping[str, Any]
    phase: Mapping[str, Any]
    ranks: Ranks
    dev: torch.device
    model: torch.nn.Module  # the plain module: checkpoints, digests, the EMA's updates
    step_model: Callable[[torch.Tensor], Any]  # what the step calls: DDP and/or compiled
    skip_sync: Callable[[], contextlib.AbstractContextManager]  # DDP's no_sync, or nothing
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    ema: WeightAverage | None  # train.ema; None: off
    losses_cfg: dict[str, Any]
    step_losses: Callable[..., Any]  # (logits, batch) -> (total, terms): compiled with the model
    autocast_dtype: torch.dtype | None
    memory_format: torch.memory_format
    micro_steps: int  # this process's micro-batches per optimizer step
    effective_batch: int  # samples per optimizer step, all processes together
    epoch_steps: int
    total_steps: int
    trial: bool  # max_steps given: a phase trial, without validation or checkpoints
    identity: dict[str, Any]  # see ctseg.training.checkpoint.run_identity
    out_dir: Path
    log_dir: Path  # state_dir where there is one (see Run.open_logs)
    resume_path: Path | None
    gpu: GpuMonitor
    efficiency: Efficiency  # counted FLOPs per sample and the device's peak: steps.csv's MFU
    stopping: Stopping  # stop requests and the checkpoint timer (ctseg.training.stopping)
    log_every: int = 1  # steps between appends of steps.csv
    phase_id: int | None = None  # the phase's number in config/phases.yaml (settings.json)
    phase_auto: bool = False  # chosen by phase auto (settings.json)
    step: int = 0
    epoch: int = 0
    sample_index: int = 0  # the next sample of the stream this run's feed takes
    steps_log: list[dict[str, Any]] = field(default_factory=list)  # rows not yet on disk
    epoch_rows: list[dict[str, Any]] = field(default_factory=list)  # this epoch's, for its row
    epochs_log: list[dict[str, Any]] = field(default_factory=list)  # rows not yet on disk
    peak_rss_mb: float = 0.0
    # Steps logged whose device values (loss, terms, gradient norm, step time) are not read yet
    # (ctseg.training.step_values.materialise), and on CUDA the event that opened their window.
    pending: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    window_event: Any = None
    # The best validation so far ({BEST_BY: score, "epoch", "step"}), whose weights are best.pt
    # in log_dir; None before a validation has scored (`keep_best`).
    best: dict[str, Any] | None = None
    live: Any = None  # rank 0's TensorBoard writer and progress plot (ctseg.training.live_view)
    labels: LabelSpec = KAGGLE  # the dataset's label spec: checkpoints record it

    @property
    def weights(self) -> torch.nn.Module:
        """The weights the run is for: validated, and saved as its final weights (the EMA's
        where there is one)."""
        return self.ema.averaged if self.ema is not None else self.model

    def open_logs(self) -> None:
        """Snakemake deletes a job's declared outputs before it reruns it, so the logs that a
        resumed run appends to live beside its checkpoint (`log_dir`); `finish` copies them."""
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dev)
        if self.ranks.main:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.peak_rss_mb = host_rss_bytes() / 2**20

    def compile_step(self) -> None:
        """torch.compile the step's model and, as a region of its own, its losses (their many
        small element-wise kernels and pools fuse), in the phase's compile mode."""
        mode = self.phase.get("compile_mode")
        self.step_model = torch.compile(self.step_model, mode=mode)
        self.step_losses = torch.compile(self.step_losses, mode=mode)

    def parts(self) -> dict[str, Any]:
        """What a resume checkpoint keeps the state of, by its entry's name."""
        parts = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}
        return {**parts, "scaler": self.scaler, **({"ema": self.ema} if self.ema else {})}

    def checkpoint_state(self) -> dict[str, Any]:
        """A resume checkpoint's contents."""
        return {
            **{name: part.state_dict() for name, part in self.parts().items()},
            "model": portable_state_dict(self.model),  # plain strides: see the function
            "rng": rng_state(),
            "step": self.step,
            "epoch": self.epoch,
            "sample_index": self.sample_index,
            "epoch_rows": self.epoch_rows,
            "best": self.best,
            "world_size": self.ranks.world,
            "fingerprint": identity_digest(self.identity),
            "identity": self.identity,
            "labels": self.labels.to_dict(),
        }

    def resume(self) -> dict[str, Any]:
        """Every rank loads this run's checkpoint (rank 0 wrote it) and goes on from its state;
        returns what happened (`ctseg.training.checkpoint.resume_state`)."""
        if self.resume_path is None:
            if self.ranks.main:  # a trial's logs in out_dir are its own: start them afresh
                trim_logs(self.log_dir, 0)
            return {"resume": "fresh"}
        state, resumed = resume_state(self.resume_path.parent, self.identity, self.ranks)
        if state is not None:
            self.restore(state)
            self.forget_lost_best()
            if self.ranks.main:
                where = f"step {self.step} (epoch {self.epoch}) from {self.resume_path}"
                print(f"resumed at {where}", file=sys.stderr)
        return resumed

    def restore(self, state: Mapping[str, Any]) -> None:
        """Go on from a resume checkpoint of this run (`checkpoint_state`)."""
        restore(state, self.parts())
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.sample_index = int(state["sample_index"])  # where the interrupted run's loader was
        self.stopping.saved(self.step)
        # A mid-epoch checkpoint carries the epoch's rows so far: its epochs.csv row needs them.
        self.epoch_rows = [dict(r) for r in state.get("epoch_rows", [])]
        # A checkpoint written before best.pt was kept has no score: the next validation sets it.
        self.best = dict(state["best"]) if state.get("best") is not None else None

    def forget_lost_best(self) -> None:
        """On resume: `keep_best` writes best.pt before the checkpoint that records it, so it is
        missing only when the checkpoint was copied without it. Those weights are gone; rather
        than retrain from step 0, the run says so and keeps the best of the validations from
        here on (or its final weights: `publish_best`)."""
        kept = self.log_dir / BEST
        if self.best is None or kept.is_file():
            return
        if self.ranks.main:
            print(
                f"{kept}: missing: {self.resume_path} records the best weights of step "
                f"{self.best['step']} there; best.pt will hold the best validation after step "
                f"{self.step}",
                file=sys.stderr,
            )
        self.best = None

    def check_checkpoint_space(self) -> None:
        """Before an epoch's first step (and a resumed run's first): the checkpoint at its end
        must fit, or the epoch would be trained only to be lost; and best.pt's weights with it."""
        if self.ranks.main and self.resume_path is not None:
            copies = [self.ema.averaged] if self.ema is not None else []
            copies.append(self.weights)  # a new best.pt, written before the old one goes
            needed = checkpoint_bytes(self.model, self.optimizer, *copies)
            check_free_space(
                self.resume_path.parent, needed, f"save the checkpoint of epoch {self.epoch}"
            )

    def final_state(self) -> dict[str, Any]:
        """The final weights file's contents (last.pt: see `ctseg.inference.run.load_model`)."""
        return {
            "model": portable_state_dict(self.weights),
            "weights": "ema" if self.ema is not None else "trained",
            "model_config": model_config(self.exp["model"], self.labels),
            "patch_size": list(self.exp["data"]["patch_size"]),
            "fingerprint": identity_digest(self.identity),
            "step": self.step,
            "labels": self.labels.to_dict(),  # the dataset's values, for its masks
        }

    def keep_best(self, val: Mapping[str, float]) -> None:
        """After an epoch's validation (`val`, before the epoch's checkpoint, which records the
        score): when it beats the best so far, the weights it validated become best.pt in
        `log_dir` (rank 0 writes). A NaN score (no validation volumes or ``val_batches: 0``:
        `ctseg.training.validation.evaluate`) never does."""
        score = float(val[BEST_BY])
        if math.isnan(score) or (self.best is not None and score <= self.best[BEST_BY]):
            return
        self.best = {BEST_BY: score, "epoch": self.epoch, "step": self.step}
        if self.ranks.main:
            save_checkpoint(self.log_dir / BEST, self.final_state())

    def publish_best(self, folder: Path) -> None:
        """At the end of a full run (rank 0): best.pt into `folder`, beside last.pt. A run that
        no validation scored (no validation volumes) knows no better weights than its final
        ones: its best.pt holds them."""
        if self.best is None:
            save_checkpoint(folder / BEST, self.final_state())
        elif self.log_dir / BEST != folder / BEST:
            publish_copy(self.log_dir / BEST, folder / BEST)

    def write_settings(self) -> None:
        """train/settings.json (`ctseg.run_settings`): what this run was trained with, the
        phase's id included, and which weights last.pt holds."""
        write_run_settings(
            self.out_dir,
            self.exp,
            self.phase,
            phase_id=self.phase_id,
            phase_auto=self.phase_auto,
            weights="ema" if self.ema is not None else "trained",
            source_weights=self.identity.get("source_weights"),
            run_identity=identity_digest(self.identity),
        )
