"""Training, read top to bottom: setup, step, log, end of epoch (evaluate, checkpoint), finish.

`train` runs a full training, or a phase trial of `max_steps` steps. Each optimizer step logs
one row (`ctseg.summaries.step_columns`): the feed's ``data_wait_s`` (blocked on the batches:
the honest starvation figure) and ``h2d_s`` (`ctseg.training.feeds`), ``step_s`` (on CUDA the
device's own), ``compute_s`` (the rest), ``samples_per_s``, the loss terms, ``grad_norm``
(unscaled, before clipping), ``lr``, GPU use, peak VRAM, host RSS (loader workers included),
and model TFLOP/s, MFU and useful MFU (`ctseg.network.flops`). The step's device values are
read once every ``train.log_every`` steps (`ctseg.training.step_values`), when rank 0 appends
the rows to ``steps.csv``; and before every checkpoint, never ahead of its log.

Checkpoints (`ctseg.training.run_state`, `ctseg.training.checkpoint`): at each epoch's end, and
mid-epoch on a timer or a stop request (`ctseg.training.stopping`). Optional: an EMA of the weights
(`ctseg.training.ema`), a fine-tune's starting weights (`ctseg.training.finetune`). With
``no_data=True`` the feed is `ctseg.training.feeds.ResidentBatches` (the compute ceiling); the loop
is the same for every feed. Several processes under torchrun: `ctseg.training.distributed`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ctseg.labels import KAGGLE, LabelSpec
from ctseg.layout import staged_clip_distance
from ctseg.network.backend import announce_start, run_record
from ctseg.network.flops import Efficiency
from ctseg.network.losses import compute_losses, loss_settings
from ctseg.network.model import build_model, parameter_digest
from ctseg.progress import Progress
from ctseg.training import recipe
from ctseg.training.checkpoint import (
    append_rows,
    data_identity,
    identity_digest,
    publish_logs,
    run_identity,
    save_checkpoint,
)
from ctseg.training.distributed import (
    Ranks,
    across_ranks,
    ddp_wrap,
    gathered,
    pick_device,
    process_group,
    rank_share,
)
from ctseg.training.ema import WeightAverage
from ctseg.training.feeds import Fed, ResidentBatches, training_feed
from ctseg.training.finetune import Source, load_source, source_weights
from ctseg.training.live_view import open_live_view
from ctseg.training.preempt import StopRequest, shielded
from ctseg.training.probes import GpuMonitor, host_rss_bytes
from ctseg.training.run_state import Run, model_config
from ctseg.training.step_values import add_pending, device_event, materialise
from ctseg.training.stopping import Stopping
from ctseg.training.validation import evaluate


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
    init_from: Path | None = None,
    clip_distance: float | None = None,
    max_steps: int | None = None,
    no_data: bool = False,
    device: str | None = None,
    progress: bool = True,
    stop: StopRequest | None = None,
    phase_id: int | None = None,
    phase_auto: bool = False,
    labels: LabelSpec = KAGGLE,
) -> dict[str, Any]:
    """Train `exp` under `phase`; returns a summary. See the module docstring for the logs, and
    `ctseg.training.distributed` for what changes when torchrun starts several processes.
    `labels`: the dataset's label spec (the staged labels are in its stored values; checkpoints
    record it).
    `init_from`: the weights a fine-tune starts from (the experiment's ``init_from`` run's last.pt).
    With a set `stop` request the run checkpoints after its current step and returns early, its
    summary's ``stopped`` naming the signal; no final weights are written then."""
    dev = pick_device(device)
    # Before anything slow: a missing source fails at once.
    source = source_weights(exp, init_from, trial=max_steps is not None)
    with process_group(dev) as ranks:
        data = data_identity(scratch, train_ids, val_ids)
        clip = staged_clip_distance(
            scratch, train_ids + val_ids, exp["scratch_format"], clip_distance
        )
        where = (out_dir, state_dir, source, labels)
        run = setup(exp, phase, ranks, dev, data, clip, max_steps, *where)
        run.stopping.request = stop
        run.phase_id, run.phase_auto = phase_id, phase_auto
        resumed = run.resume()
        run.step_model, run.skip_sync = ddp_wrap(run.model, dev, ranks)
        if phase.get("compile"):
            run.compile_step()
        end = run.sample_index + (run.total_steps - run.step) * run.effective_batch
        with shielded(stop):  # the loader workers start here (or at the first batch)
            batches = training_feed(
                exp, phase, scratch, train_ids, dev, ranks, run.sample_index, end, labels
            )
            if no_data:  # the compute ceiling: the same steps on one step's batches, resident
                batches = iter(ResidentBatches(batches, run.micro_steps))
        run.open_logs()
        run.live = open_live_view(out_dir, run.log_dir, resumed, main=ranks.main, trial=run.trial)
        hide = not progress or not ranks.main
        bar = Progress(total=run.total_steps, initial=run.step, disable=hide, unit="step")
        run.model.train()
        first = True
        while run.step < run.total_steps:
            if run.stopping.requested():
                stop_here(run)
                break
            if first or run.step % run.epoch_steps == 0:
                run.check_checkpoint_space()
            # A loader may start its workers at the first batch rather than at iter().
            with shielded(stop) if first else contextlib.nullcontext():
                numbers = train_step(run, batches)
            first = False
            log_step(run, numbers, None if hide else bar)
            if not run.trial and run.step % run.epoch_steps == 0:
                with shielded(stop):  # validation may start loader workers of its own
                    end_of_epoch(run, scratch, val_ids)
            elif not run.trial and run.stopping.due():
                write_checkpoint(run)
        bar.close()
        return finish(run, final_weights, resumed)


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
    source: Source | None = None,
    labels: LabelSpec = KAGGLE,
) -> Run:
    """Seeds and backend flags, then the step plan, model (from `source`'s weights for a
    fine-tune; its output channels `labels`'), optimizer, schedule, EMA, losses (in `labels`'
    stored values) and the run identity (`data`: the staged records' fingerprints)."""
    tcfg = exp["train"]
    # Before the seeds: off a known card, the peak's probe draws from torch's global RNG.
    efficiency = Efficiency.for_run(exp, phase, dev, ranks.world)
    recipe.seed_and_flags(tcfg, dev)
    accumulate = int(phase.get("accumulate", 1))  # micro-batches per step, all processes
    effective_batch = int(phase["batch_size"]) * accumulate  # batch_size is per process
    epoch_steps = int(tcfg["steps_per_epoch"])
    total_steps = max_steps if max_steps is not None else epoch_steps * int(tcfg["epochs"])
    dtype = recipe.autocast_dtype(phase)
    layout = recipe.memory_format(phase)
    if ranks.main:  # a padded patch, a known-bad convolution backend: said at the start
        announce_start(exp["model"], efficiency.flops.patch, dev, dtype)
    model = build_model(model_config(exp["model"], labels))
    if source is not None:
        load_source(model, source)
    model = model.to(dev, memory_format=layout)
    lr = recipe.scaled_lr(tcfg, effective_batch)
    optimizer = recipe.build_optimizer(model, tcfg, lr, fused=recipe.fused_optimizer(phase))
    losses_cfg = loss_settings({**exp["loss"], "clip_distance": clip_distance})
    losses_cfg["labels"] = labels.stored()
    return Run(
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
        ema=WeightAverage.configured(model, tcfg.get("ema")),
        losses_cfg=losses_cfg,
        step_losses=functools.partial(compute_losses, **losses_cfg),
        autocast_dtype=dtype,
        memory_format=layout,
        micro_steps=rank_share(accumulate, ranks),  # this process's share of the micro-batches
        effective_batch=effective_batch,
        epoch_steps=epoch_steps,
        total_steps=total_steps,
        trial=max_steps is not None,
        identity=run_identity(
            exp,
            phase,
            data=data,
            total_steps=total_steps,
            clip_distance=clip_distance,
            source_weights=source.digest if source is not None else None,
        ),
        out_dir=out_dir,
        log_dir=state_dir if state_dir is not None else out_dir,
        resume_path=state_dir / "resume.pt" if state_dir is not None else None,
        gpu=GpuMonitor(dev),
        efficiency=efficiency,
        stopping=Stopping.every(tcfg.get("checkpoint_minutes"), None, ranks.world),
        log_every=int(tcfg.get("log_every") or 1),
        labels=labels,
    )


# ----------------------------------------------------------------------------- step and log
def train_step(run: Run, batches: Iterator[Fed]) -> dict[str, Any]:
    """One optimizer step over this process's micro-batches; returns this process's numbers:
    the loss, its terms and the gradient norm as device tensors (the loss and terms averaged
    over the micro-batches), the feed's times summed, and on CUDA the event that marks the
    step's end on the device. Nothing here reads a value back to the host, so the host queues
    the next step while the device runs this one (`materialise` reads them, once a window)."""
    step_start = time.perf_counter()
    if run.dev.type == "cuda" and run.window_event is None:
        run.window_event = device_event()  # the device's start of this logging window
    numbers: dict[str, Any] = {"data_wait_s": 0.0, "h2d_s": 0.0}
    loss_sum: torch.Tensor | None = None
    terms_sum: dict[str, torch.Tensor] = {}
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
            total, terms = run.step_losses(logits, batch)
            run.scaler.scale(total / run.micro_steps).backward()
        loss_sum = add_pending(loss_sum, total.detach() / run.micro_steps)
        for name, value in terms.items():
            terms_sum[name] = add_pending(terms_sum.get(name), value.detach() / run.micro_steps)
    # The norm of the true (unscaled) gradients, before clipping; inf max_norm: no clip.
    run.scaler.unscale_(run.optimizer)
    max_norm = float(run.exp["train"]["grad_clip"] or 0) or math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_norm)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    lr = run.optimizer.param_groups[0]["lr"]  # the lr this step used (a float: no device read)
    run.scheduler.step()
    run.step += 1
    if run.ema is not None:
        run.ema.update(run.model, run.step)
    run.sample_index += run.effective_batch
    numbers.update(loss=loss_sum, terms=terms_sum, grad_norm=grad_norm.detach(), lr=lr)
    end_event = device_event() if run.dev.type == "cuda" else None
    return {**numbers, "host_s": time.perf_counter() - step_start, "end_event": end_event}


def log_step(run: Run, numbers: dict[str, Any], bar: Progress | None) -> None:
    """One steps.csv row for the step of all ranks together (see `ctseg.training.distributed`),
    its device values still pending; every `log_every` steps `materialise` reads the pending
    values at once, rank 0 appends the rows so far to steps.csv and prints one line."""
    cuda = run.dev.type == "cuda"
    largest = {
        "vram_peak_mb": torch.cuda.max_memory_allocated(run.dev) / 2**20 if cuda else math.nan,
        "stop": run.stopping.flag(),  # in this step's collective: all ranks stop after it
    }
    shared = across_ranks(
        run.ranks,
        run.dev,
        mean={
            **{k: numbers[k] for k in ("data_wait_s", "h2d_s")},
            "gpu_util": run.gpu.utilisation(),
        },
        largest=largest,
        total={"host_rss_mb": host_rss_bytes() / 2**20},
    )
    run.stopping.agree(shared.pop("stop"))
    run.peak_rss_mb = max(run.peak_rss_mb, shared["host_rss_mb"])
    row = {**shared, "epoch": run.epoch, "step": run.step, "lr": numbers["lr"]}
    run.pending.append((row, numbers))
    run.steps_log.append(row)
    run.epoch_rows.append(row)
    if run.step % run.log_every == 0:
        flush_logs(run)
        rows = run.epoch_rows
        wait_pct = 100 * sum(r["data_wait_s"] for r in rows) / sum(r["step_s"] for r in rows)
        if bar is not None:
            bar.write(
                f"step {run.step}/{run.total_steps} (epoch {run.epoch}): loss {row['loss']:.4f}"
                f", {row['samples_per_s']:.2f} samples/s, data wait {wait_pct:.0f}%",
                file=sys.stderr,
            )
            bar.set_postfix(loss=f"{row['loss']:.3f}", wait=f"{wait_pct:.0f}%", refresh=False)
    if bar is not None:
        bar.update(1)


def flush_logs(run: Run) -> None:
    """Rank 0 appends the rows not yet on disk; the other ranks hold the same rows."""
    materialise(run)
    if run.ranks.main:
        append_rows(run.log_dir / "steps.csv", run.steps_log)
        append_rows(run.log_dir / "epochs.csv", run.epochs_log)
        run.live.log(run.steps_log, run.epochs_log)  # TensorBoard, progress.png (live_view)
    run.steps_log, run.epochs_log = [], []


# ----------------------------------------------------------------------------- checkpoints
def stop_here(run: Run) -> None:
    """Checkpoint the step just finished (unless it is on disk already) and say so."""
    run.stopping.stop()
    if run.resume_path is None:
        return
    if run.step > run.stopping.saved_step:
        write_checkpoint(run)
    if run.ranks.main:
        run.stopping.report(run.step, run.epoch, run.resume_path)


def write_checkpoint(run: Run) -> None:
    """The logs first, then the checkpoint, keeping the one before it (`ctseg.training.checkpoint`).
    Rank 0 writes; the others hold the same weights."""
    flush_logs(run)
    if run.resume_path is not None and run.ranks.main:
        save_checkpoint(run.resume_path, run.checkpoint_state(), keep_previous=True)
    run.stopping.saved(run.step)


# ----------------------------------------------------------------------------- end of epoch
def end_of_epoch(run: Run, scratch: Path, val_ids: list[str]) -> None:
    """Validation (of the EMA where there is one) and best.pt when it scored best so far, the
    epoch's row, the logs, the checkpoint (which records the best score)."""
    materialise(run)  # the epoch's rows, before validation's time can reach their step times
    val = evaluate(run.weights, run.exp, run.phase, scratch, val_ids, run.losses_cfg, run.ranks)
    run.keep_best(val)
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
    """The last logs and the weights (rank 0): last.pt, and best.pt beside it unless a trial
    (`Run.publish_best`); then the run's summary (every rank). Both hold the EMA's weights
    where there is one (``"weights": "ema"``): see `ctseg.training.ema`."""
    flush_logs(run)
    if run.ranks.main and run.stopping.stopped is None:
        publish_logs(run.log_dir, run.out_dir)
        if not run.trial:
            run.write_settings()
        if final_weights is not None:
            save_checkpoint(final_weights, run.final_state())
            if not run.trial:
                run.publish_best(final_weights.parent)
    # A collective: no rank returns before rank 0's files are written.
    digests = gathered(run.ranks, parameter_digest(run.model))
    cuda = run.dev.type == "cuda"
    vram_mb = torch.cuda.max_memory_allocated(run.dev) / 2**20 if cuda else 0.0
    peak_vram = across_ranks(run.ranks, run.dev, largest={"mb": vram_mb})["mb"]
    stop = run.stopping
    stopped = {"stopped": stop.stopped, "saved_step": stop.saved_step} if stop.stopped else {}
    return {
        "steps": run.step,
        "peak_host_rss_mb": run.peak_rss_mb,
        "peak_vram_mb": peak_vram if cuda else None,
        "device": str(run.dev),
        "world_size": run.ranks.world,
        **run_record(run.efficiency, run.dev, run.autocast_dtype),  # FLOPs, padding, backend
        "param_sha256": digests,
        "run_identity": identity_digest(run.identity),
        **resumed,
        **stopped,
    }
