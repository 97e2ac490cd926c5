"""Training, read top to bottom: setup, step, log, end of epoch (evaluate, checkpoint), finish.

`train` runs a full training, or a phase trial of `max_steps` steps. Each optimizer step logs
one row (`ctseg.summaries.step_columns`, read by the trials and the report), computed in
`train_step` and `log_step`:

- ``data_wait_s``: time blocked waiting for the batches (the honest starvation figure; NVML
  utilisation is a coarse sample), ``h2d_s``: their host-to-device copy and uint8 -> float
  conversion, both as the feed timed them (`ctseg.feeds`); ``compute_s``: the rest of the
  step (forward, loss, backward, optimizer step; synchronised on CUDA); ``step_s``: the whole
  step; ``samples_per_s`` = samples / step_s;
- each loss term, ``grad_norm`` (unscaled, before clipping), the learning rate, GPU
  utilisation, peak VRAM and the host RSS of this process and its loader workers.

Rank 0 appends the rows to ``steps.csv`` beside the checkpoint every ``train.log_every``
steps (and prints one line of them to the log when the progress bar is on), and always
before a checkpoint, so a checkpoint never gets ahead of its log.

Checkpoints: at the end of every epoch, every ``train.checkpoint_minutes`` of training
(mid-epoch: the stream goes on from ``sample_index``), and when a stop is requested
(`ctseg.preempt`: SIGTERM or SIGUSR1 finish the current step, checkpoint and return with
``stopped`` set). Free space for a checkpoint is checked before each epoch's first step.

With ``no_data=True`` the feed is `ctseg.feeds.ResidentBatches`: the compute ceiling, on
batches already on the device; the loop is the same for every feed. Several processes under
torchrun: `ctseg.distributed`. Run identity, checkpoints, resuming: `ctseg.checkpoint`.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ctseg import recipe
from ctseg.checkpoint import (
    append_rows,
    checkpoint_bytes,
    data_identity,
    identity_digest,
    resume_state,
    rng_state,
    run_identity,
    save_checkpoint,
    set_rng_state,
    trim_logs,
)
from ctseg.distributed import (
    Ranks,
    across_ranks,
    ddp_wrap,
    gathered,
    pick_device,
    process_group,
    rank_share,
)
from ctseg.feeds import Fed, ResidentBatches, training_feed
from ctseg.io import atomic_path, check_free_space
from ctseg.layout import staged_clip_distance
from ctseg.losses import compute_losses, loss_settings
from ctseg.model import build_model, parameter_digest, portable_state_dict
from ctseg.preempt import StopRequest, shielded
from ctseg.probes import GpuMonitor, host_rss_bytes
from ctseg.summaries import step_columns
from ctseg.validation import evaluate

# isort: split
# Re-exported: the CLI, the trials and the tests import these from ctseg.train.
from ctseg.checkpoint import identity_changes, load_checkpoint, write_csv  # noqa: F401
from ctseg.distributed import configured_gpus, ddp_phase, torchrun_ranks  # noqa: F401
from ctseg.recipe import lr_at, scaled_lr  # noqa: F401


@dataclass
class Run:
    """What `setup` builds once, and where the run stands: step, epoch, unwritten log rows."""

    exp: Mapping[str, Any]
    phase: Mapping[str, Any]
    ranks: Ranks
    dev: torch.device
    model: torch.nn.Module  # the plain module: checkpoints, digests, validation
    step_model: Callable[[torch.Tensor], Any]  # what the step calls: DDP and/or compiled
    skip_sync: Callable[[], contextlib.AbstractContextManager]  # DDP's no_sync, or nothing
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    losses_cfg: dict[str, Any]
    autocast_dtype: torch.dtype | None
    memory_format: torch.memory_format
    micro_steps: int  # this process's micro-batches per optimizer step
    effective_batch: int  # samples per optimizer step, all processes together
    epoch_steps: int
    total_steps: int
    trial: bool  # max_steps given: a phase trial, without validation or checkpoints
    identity: dict[str, Any]  # see ctseg.checkpoint.run_identity
    out_dir: Path
    log_dir: Path  # state_dir where there is one: see `open_logs`
    resume_path: Path | None
    gpu: GpuMonitor
    step: int = 0
    epoch: int = 0
    sample_index: int = 0  # the next sample of the stream this run's feed takes
    steps_log: list[dict[str, Any]] = field(default_factory=list)  # rows not yet on disk
    epoch_rows: list[dict[str, Any]] = field(default_factory=list)  # this epoch's, for its row
    epochs_log: list[dict[str, Any]] = field(default_factory=list)  # rows not yet on disk
    peak_rss_mb: float = 0.0
    log_every: int = 1  # steps between appends of steps.csv
    checkpoint_s: float | None = None  # seconds between mid-epoch checkpoints; None: off
    saved_step: int = 0  # the step of the checkpoint on disk
    saved_at: float = 0.0  # time.monotonic() of that checkpoint (or of the start)
    stop: StopRequest | None = None
    stop_agreed: bool = False  # some rank was asked to stop (combined in `log_step`)
    stopped: str | None = None  # the signal that stopped this run before its end


def train(
    exp: Mapping[str, Any],
    phase: Mapping[str, Any],
    *,
    scratch: Path,
    train_ids: list[str],
    val_ids: list[str],
    out_dir: Path,
    state_dir: Path | None = None,
    final_weights: Path | None = None,
    clip_distance: float | None = None,
    max_steps: int | None = None,
    no_data: bool = False,
    device: str | None = None,
    progress: bool = True,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    """Train `exp` under `phase`; returns a summary. See the module docstring for the logs, and
    `ctseg.distributed` for what changes when torchrun starts several processes. With a set
    `stop` request the run checkpoints after its current step and returns early, its summary's
    ``stopped`` naming the signal; no final weights are written then."""
    dev = pick_device(device)
    with process_group(dev) as ranks:
        data = data_identity(scratch, train_ids, val_ids)
        clip = staged_clip_distance(
            scratch, train_ids + val_ids, exp["scratch_format"], clip_distance
        )
        run = setup(exp, phase, ranks, dev, data, clip, max_steps, out_dir, state_dir)
        run.stop = stop
        resumed = resume(run)
        run.step_model, run.skip_sync = ddp_wrap(run.model, dev, ranks)
        if phase.get("compile"):
            run.step_model = torch.compile(run.step_model, mode=phase.get("compile_mode"))
        end = run.sample_index + (run.total_steps - run.step) * run.effective_batch
        with shielded(stop):  # the loader workers start here (or at the first batch)
            batches = training_feed(
                exp, phase, scratch, train_ids, dev, ranks, start=run.sample_index, stop=end
            )
            if no_data:  # the compute ceiling: the same steps on one step's batches, resident
                batches = iter(ResidentBatches(batches, run.micro_steps))
        open_logs(run)
        hide = not progress or not ranks.main
        bar = tqdm(total=run.total_steps, initial=run.step, disable=hide, unit="step", desc="train")
        run.model.train()
        first = True
        while run.step < run.total_steps:
            if stopping(run):
                stop_here(run)
                break
            if run.resume_path is not None and (first or run.step % run.epoch_steps == 0):
                check_checkpoint_space(run)
            # A loader may start its workers at the first batch rather than at iter().
            with shielded(stop) if first else contextlib.nullcontext():
                numbers = train_step(run, batches)
            first = False
            log_step(run, numbers, None if hide else bar)
            if not run.trial and run.step % run.epoch_steps == 0:
                with shielded(stop):  # validation may start loader workers of its own
                    end_of_epoch(run, scratch, val_ids)
            elif run.checkpoint_s is not None and not run.trial and checkpoint_due(run):
                write_checkpoint(run)
        bar.close()
        return finish(run, final_weights, resumed)


# Optimizer settings that pick a kernel, not an update (kept from the phase on resume).
SPEED_FLAGS = ("fused", "foreach")


# ----------------------------------------------------------------------------- setup
def setup(
    exp: Mapping[str, Any],
    phase: Mapping[str, Any],
    ranks: Ranks,
    dev: torch.device,
    data: Mapping[str, str],
    clip_distance: float,
    max_steps: int | None,
    out_dir: Path,
    state_dir: Path | None,
) -> Run:
    """Seeds and backend flags, then the step plan, model, optimizer, schedule, losses and the
    run identity (`data`: the staged records' fingerprints)."""
    tcfg = exp["train"]
    recipe.seed_and_flags(tcfg, dev)
    accumulate = int(phase.get("accumulate", 1))  # micro-batches per step, all processes
    micro_steps = rank_share(accumulate, ranks)  # this process's share of them
    effective_batch = int(phase["batch_size"]) * accumulate  # batch_size is per process
    epoch_steps = int(tcfg["steps_per_epoch"])
    total_steps = max_steps if max_steps is not None else epoch_steps * int(tcfg["epochs"])
    base_lr = recipe.scaled_lr(tcfg, effective_batch)
    dtype = recipe.autocast_dtype(phase)
    layout = recipe.memory_format(phase)
    model = build_model(exp["model"]).to(dev, memory_format=layout)
    fused = bool(phase.get("fused_optimizer"))
    optimizer = recipe.build_optimizer(model, tcfg, base_lr, fused=fused)
    minutes = tcfg.get("checkpoint_minutes")
    return Run(
        log_every=int(tcfg.get("log_every") or 1),
        checkpoint_s=60.0 * float(minutes) if minutes else None,
        saved_at=time.monotonic(),
        exp=exp,
        phase=phase,
        ranks=ranks,
        dev=dev,
        model=model,
        step_model=model,
        skip_sync=contextlib.nullcontext,
        optimizer=optimizer,
        scheduler=recipe.build_schedule(optimizer, tcfg, total_steps),
        scaler=torch.amp.GradScaler(dev.type, enabled=dtype is torch.float16),
        losses_cfg=loss_settings({**exp["loss"], "clip_distance": clip_distance}),
        autocast_dtype=dtype,
        memory_format=layout,
        micro_steps=micro_steps,
        effective_batch=effective_batch,
        epoch_steps=epoch_steps,
        total_steps=total_steps,
        trial=max_steps is not None,
        identity=run_identity(
            exp, phase, data=data, total_steps=total_steps, clip_distance=clip_distance
        ),
        out_dir=out_dir,
        log_dir=state_dir if state_dir is not None else out_dir,
        resume_path=state_dir / "resume.pt" if state_dir is not None else None,
        gpu=GpuMonitor(dev),
    )


def resume(run: Run) -> dict[str, Any]:
    """Every rank loads this run's checkpoint (rank 0 wrote it) and goes on from its state."""
    if run.resume_path is None:
        if run.ranks.main:  # a trial's logs in out_dir are its own: start them afresh
            trim_logs(run.log_dir, 0)
        return {"resume": "fresh"}
    state, resumed = resume_state(run.resume_path.parent, run.identity, run.ranks)
    if state is not None:
        speed = [{k: g.get(k) for k in SPEED_FLAGS} for g in run.optimizer.param_groups]
        for part in ("model", "optimizer", "scheduler", "scaler"):
            getattr(run, part).load_state_dict(state[part])
        for group, flags in zip(run.optimizer.param_groups, speed, strict=True):
            group.update(flags)
        set_rng_state(state["rng"])
        run.step, run.epoch = int(state["step"]), int(state["epoch"])
        run.sample_index = int(state["sample_index"])  # where the interrupted run's loader was
        run.saved_step = run.step
        # A mid-epoch checkpoint carries the epoch's rows so far: its epochs.csv row needs them.
        run.epoch_rows = [dict(r) for r in state.get("epoch_rows", [])]
        if run.ranks.main:
            where = f"step {run.step} (epoch {run.epoch}) from {run.resume_path}"
            print(f"resumed at {where}", file=sys.stderr)
    return resumed


def open_logs(run: Run) -> None:
    """Snakemake deletes a job's declared outputs before it reruns it, so the logs that a
    resumed run appends to live beside its checkpoint (`run.log_dir`); `finish` copies them."""
    if run.dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.dev)
    if run.ranks.main:
        run.log_dir.mkdir(parents=True, exist_ok=True)
        run.out_dir.mkdir(parents=True, exist_ok=True)
    run.peak_rss_mb = host_rss_bytes() / 2**20


# ----------------------------------------------------------------------------- step and log
def train_step(run: Run, batches: Iterator[Fed]) -> dict[str, Any]:
    """One optimizer step over this process's micro-batches; returns this process's numbers:
    the loss and its terms averaged over the micro-batches, the feed's times summed."""
    step_start = time.perf_counter()
    numbers = {"data_wait_s": 0.0, "h2d_s": 0.0, "loss": 0.0}
    terms_sum: dict[str, float] = {}
    run.optimizer.zero_grad(set_to_none=True)
    for micro in range(run.micro_steps):
        batch, wait_s, h2d_s = next(batches)
        numbers["data_wait_s"] += wait_s
        numbers["h2d_s"] += h2d_s
        image = batch["image"].contiguous(memory_format=run.memory_format)
        last_micro = micro == run.micro_steps - 1
        with contextlib.nullcontext() if last_micro else run.skip_sync():
            dtype = run.autocast_dtype
            with torch.autocast(run.dev.type, dtype=dtype, enabled=dtype is not None):
                logits = run.step_model(image)
            total, terms = compute_losses(logits, batch, **run.losses_cfg)
            run.scaler.scale(total / run.micro_steps).backward()
        numbers["loss"] += float(total.detach()) / run.micro_steps
        for name, value in terms.items():
            terms_sum[name] = terms_sum.get(name, 0.0) + float(value.detach()) / run.micro_steps
    # The norm of the true (unscaled) gradients, before clipping; inf max_norm: no clip.
    run.scaler.unscale_(run.optimizer)
    max_norm = float(run.exp["train"]["grad_clip"] or 0) or math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_norm))
    run.scaler.step(run.optimizer)
    run.scaler.update()
    lr = run.optimizer.param_groups[0]["lr"]  # the lr this step used
    run.scheduler.step()
    if run.dev.type == "cuda":
        torch.cuda.synchronize(run.dev)
    step_s = time.perf_counter() - step_start
    run.step += 1
    run.sample_index += run.effective_batch
    return {**numbers, "terms": terms_sum, "step_s": step_s, "grad_norm": grad_norm, "lr": lr}


def log_step(run: Run, numbers: dict[str, Any], bar: tqdm | None) -> None:
    """One steps.csv row for the step of all ranks together (see `ctseg.distributed`); every
    `log_every` steps, rank 0 appends the rows so far to steps.csv and prints one line."""
    terms, cuda = numbers["terms"], run.dev.type == "cuda"
    shared = across_ranks(
        run.ranks,
        run.dev,
        mean={
            **{name: numbers[name] for name in ("data_wait_s", "h2d_s", "loss")},
            **terms,
            "gpu_util": run.gpu.utilisation(),
        },
        largest={
            "step_s": numbers["step_s"],
            "vram_peak_mb": torch.cuda.max_memory_allocated(run.dev) / 2**20 if cuda else math.nan,
            # Folded into this step's collective: every rank stops after the same step.
            "stop": float(run.stop is not None and run.stop.requested),
        },
        total={"host_rss_mb": host_rss_bytes() / 2**20},
    )
    run.stop_agreed = shared.pop("stop") > 0
    run.peak_rss_mb = max(run.peak_rss_mb, shared["host_rss_mb"])
    values = {
        **shared,
        "epoch": run.epoch,
        "step": run.step,
        "compute_s": shared["step_s"] - shared["data_wait_s"] - shared["h2d_s"],
        "samples_per_s": run.effective_batch / shared["step_s"],
        "grad_norm": numbers["grad_norm"],
        "lr": numbers["lr"],
    }
    row = {column: values[column] for column in step_columns(list(terms))}
    run.steps_log.append(row)
    run.epoch_rows.append(row)
    waited = sum(r["data_wait_s"] for r in run.epoch_rows)
    wait_pct = 100 * waited / sum(r["step_s"] for r in run.epoch_rows)
    if run.step % run.log_every == 0:
        flush_logs(run)
        if bar is not None:
            bar.write(
                f"step {run.step}/{run.total_steps} (epoch {run.epoch}): loss {values['loss']:.4f}"
                f", {values['samples_per_s']:.2f} samples/s, data wait {wait_pct:.0f}%",
                file=sys.stderr,
            )
    if bar is not None:
        bar.set_postfix(loss=f"{values['loss']:.3f}", wait=f"{wait_pct:.0f}%", refresh=False)
        bar.update(1)


def flush_logs(run: Run) -> None:
    """Rank 0 appends the rows not yet on disk; the other ranks hold the same rows."""
    if run.ranks.main:
        append_rows(run.log_dir / "steps.csv", run.steps_log)
        append_rows(run.log_dir / "epochs.csv", run.epochs_log)
    run.steps_log, run.epochs_log = [], []


# ----------------------------------------------------------------------------- checkpoints
def stopping(run: Run) -> bool:
    """A stop was requested: by this process's signal with one process, else as the ranks
    agreed after the last step (a rank's own flag may be set a step earlier than another's)."""
    if run.ranks.world == 1:
        return run.stop is not None and run.stop.requested
    return run.stop_agreed


def stop_here(run: Run) -> None:
    """Checkpoint the step just finished (unless it is on disk already) and say so."""
    signame = run.stop.name if run.stop is not None and run.stop.requested else "a signal"
    run.stopped = signame
    if run.resume_path is None:
        return
    if run.step > run.saved_step:
        write_checkpoint(run)
    if run.ranks.main:
        print(
            f"stopped by {signame} at step {run.step} (epoch {run.epoch}): checkpoint "
            f"{run.resume_path} holds step {run.saved_step}; run again to resume",
            file=sys.stderr,
        )


def checkpoint_due(run: Run) -> bool:
    """`checkpoint_minutes` have passed since the last checkpoint (rank 0's clock decides:
    only rank 0 writes)."""
    return time.monotonic() - run.saved_at >= (run.checkpoint_s or math.inf)


def check_checkpoint_space(run: Run) -> None:
    """Before an epoch's first step (and a resumed run's first): the checkpoint at its end
    must fit, or the epoch would be trained only to be lost."""
    if run.ranks.main and run.resume_path is not None:
        needed = checkpoint_bytes(run.model, run.optimizer)
        check_free_space(
            run.resume_path.parent, needed, f"save the checkpoint of epoch {run.epoch}"
        )


def write_checkpoint(run: Run) -> None:
    """The logs first, then the checkpoint, keeping the one before it (`ctseg.checkpoint`).
    Rank 0 writes; the others hold the same weights."""
    flush_logs(run)
    if run.resume_path is not None and run.ranks.main:
        save_checkpoint(
            run.resume_path,
            {
                "model": portable_state_dict(run.model),
                "optimizer": run.optimizer.state_dict(),
                "scheduler": run.scheduler.state_dict(),
                "scaler": run.scaler.state_dict(),
                "rng": rng_state(),
                "step": run.step,
                "epoch": run.epoch,
                "sample_index": run.sample_index,
                "epoch_rows": run.epoch_rows,
                "world_size": run.ranks.world,
                "fingerprint": identity_digest(run.identity),
                "identity": run.identity,
            },
            keep_previous=True,
        )
    run.saved_step, run.saved_at = run.step, time.monotonic()


# ----------------------------------------------------------------------------- end of epoch
def end_of_epoch(run: Run, scratch: Path, val_ids: list[str]) -> None:
    """Validation, the epoch's row, the logs and then the checkpoint."""
    val = evaluate(run.model, run.exp, run.phase, scratch, val_ids, run.losses_cfg, run.ranks)
    rows = run.epoch_rows
    step_s = sum(r["step_s"] for r in rows)
    run.epochs_log.append(
        {
            "epoch": run.epoch,
            "step": run.step,
            "train_loss": statistics.fmean(r["loss"] for r in rows),
            "samples_per_s": run.effective_batch * len(rows) / step_s,
            "data_wait_fraction": sum(r["data_wait_s"] for r in rows) / step_s,
            **val,
        }
    )
    run.epoch += 1
    run.epoch_rows = []
    if run.resume_path is not None:
        write_checkpoint(run)  # the logs, then the checkpoint
    else:
        flush_logs(run)


# ----------------------------------------------------------------------------- finish
def finish(run: Run, final_weights: Path | None, resumed: Mapping[str, Any]) -> dict[str, Any]:
    """The last logs and the weights (rank 0), then the run's summary (every rank)."""
    flush_logs(run)
    if run.ranks.main and run.stopped is None:
        if run.log_dir != run.out_dir:
            for name in ("steps.csv", "epochs.csv"):
                if (run.log_dir / name).exists():
                    with atomic_path(run.out_dir / name) as tmp:
                        shutil.copyfile(run.log_dir / name, tmp)
        if final_weights is not None:
            save_checkpoint(
                final_weights,
                {
                    "model": portable_state_dict(run.model),
                    "model_config": dict(run.exp["model"]),
                    "patch_size": list(run.exp["data"]["patch_size"]),
                    "fingerprint": identity_digest(run.identity),
                    "step": run.step,
                },
            )
    # A collective: no rank returns before rank 0's files are written.
    digests = gathered(run.ranks, parameter_digest(run.model))
    cuda = run.dev.type == "cuda"
    vram_mb = torch.cuda.max_memory_allocated(run.dev) / 2**20 if cuda else 0.0
    peak_vram = across_ranks(run.ranks, run.dev, largest={"mb": vram_mb})["mb"]
    return {
        "steps": run.step,
        "peak_host_rss_mb": run.peak_rss_mb,
        "peak_vram_mb": peak_vram if cuda else None,
        "device": str(run.dev),
        "world_size": run.ranks.world,
        "param_sha256": digests,
        "run_identity": identity_digest(run.identity),
        **resumed,
        **({"stopped": run.stopped, "saved_step": run.saved_step} if run.stopped else {}),
    }
