"""Training, read top to bottom: setup, loop, evaluation, checkpoint.

One function, `train`, runs a full training or a phase trial (`max_steps`). Every number it
logs is computed in the loop below, per optimizer step:

- ``data_wait_s``: time blocked in ``next(loader)``: the honest starvation figure (NVML
  utilisation is a coarse sample);
- ``h2d_s``: host-to-device copy and uint8 -> float conversion;
- ``compute_s``: forward, loss, backward and optimizer step, synchronised on CUDA;
- ``step_s`` (wall time of the whole step) and ``samples_per_s`` = samples / step_s;
- each loss term, ``grad_norm`` (of the unscaled gradients, before clipping), the learning
  rate, GPU utilisation (NVML), peak VRAM and the host RSS of this process plus its loader
  workers.

With ``device_prefetch`` the next batch's transfer is issued before the current step runs, so
``h2d_s`` is only the time spent issuing it; the copy itself overlaps the compute.

With ``no_data=True`` the same model trains on batches that are already on the device: the
compute ceiling. Real throughput divided by that ceiling is the feed efficiency.

Several GPUs (DDP): under ``torchrun`` (``WORLD_SIZE`` > 1) every process runs `train` in one
process group (NCCL on CUDA, each process on ``cuda:LOCAL_RANK``; gloo on the CPU), and the
model is wrapped in ``DistributedDataParallel``, which averages the gradients over the
processes in the backward pass of each step's last micro-batch (``no_sync`` on the others).

- The phase's ``batch_size`` is per process; its ``accumulate`` counts the micro-batches of one
  optimizer step over all processes, each process running ``accumulate / world`` of them
  (`ddp_phase` turns the configured per-GPU ``accumulate`` into that). A step therefore uses
  the same ``batch_size * accumulate`` consecutive samples of the one stream as a single
  process with that accumulation: rank r takes micro-batches r, r + world, ...
  (`ctseg.data.StreamSampler`), so the ranks' streams are disjoint and a resumed run goes on
  where the checkpoint's ``sample_index`` says.
- Logged per step, over all ranks: the loss terms, ``data_wait_s``, ``h2d_s`` and GPU
  utilisation averaged; ``step_s`` and peak VRAM of the slowest/largest rank (``compute_s`` is
  the rest of the step, waiting for the gradient all-reduce included); host RSS summed (the
  whole job); ``samples_per_s`` counts the samples of all ranks.
- Validation splits the fixed validation batches over the ranks and gathers the results (the
  same numbers as one process computes).
- Only rank 0 shows the progress bar and writes logs, checkpoints and weights; every rank
  loads the resume checkpoint. The summary lists each rank's parameter digest
  (``param_sha256``), which DDP keeps identical.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ctseg.data import DevicePrefetcher, PatchDataset, build_loader, to_device
from ctseg.io import CtsegError, atomic_path, check_free_space, disk_full, free_bytes
from ctseg.losses import compute_losses, loss_settings
from ctseg.model import build_model, portable_state_dict, tensor_bytes

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- helpers
def lr_at(step: int, *, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to min_ratio * base_lr at `total` steps."""
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def scaled_lr(train_cfg: Mapping[str, Any], effective_batch: int) -> float:
    """The learning rate for `effective_batch`, scaled from `lr` at `base_batch_size`."""
    ratio = effective_batch / train_cfg["base_batch_size"]
    factors = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}
    rule = train_cfg["lr_scaling"]
    if rule not in factors:
        raise CtsegError(f"train.lr_scaling must be one of {list(factors)}, got {rule!r}")
    return train_cfg["lr"] * factors[rule]


def host_rss_bytes() -> int:
    """RSS of this process and all its children (the loader workers)."""
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.memory_info().rss
    return total


class GpuMonitor:
    """NVML utilisation where present; NaN elsewhere (CPU, or no NVML)."""

    def __init__(self, device: torch.device) -> None:
        self.handle = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                index = device.index if device.index is not None else torch.cuda.current_device()
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self._nvml = pynvml
            except Exception:  # NVML missing or unusable: utilisation is simply not reported
                self.handle = None

    def utilisation(self) -> float:
        if self.handle is None:
            return float("nan")
        return float(self._nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)


# Experiment keys that cannot change the trained weights: where the data comes from and how it
# is laid out on scratch (the staged data enters the identity by its fingerprints), the
# trials, and what is logged or validated.
NOT_MATHS = {
    "name": None,
    "source": None,
    "scratch_format": None,
    "trial": None,
    "subset": None,
    "split": None,
    "train": ("log_every", "val_batches"),
}


def run_identity(
    exp: Mapping[str, Any],
    phase: Mapping[str, Any],
    *,
    data: Mapping[str, str],
    total_steps: int,
    clip_distance: float,
) -> dict[str, Any]:
    """Everything that determines a run's trained weights, as a JSON-able dict.

    A checkpoint is resumed only by a run with the same identity: the experiment's settings
    that change the maths, the phase's maths keys (workers or prefetch do not change the sample
    stream, so a preempted run may resume under another loader phase), the staged data (each
    record's role and source fingerprint) and the total step count.
    """
    settings: dict[str, Any] = {}
    for key, value in exp.items():
        dropped = NOT_MATHS.get(key, ())
        if dropped is None:
            continue
        if isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k not in dropped}
        settings[key] = value
    maths = {
        "batch_size": int(phase["batch_size"]),
        "accumulate": int(phase.get("accumulate", 1)),
        "precision": phase.get("precision") or "fp32",
        "gpus": int(phase.get("gpus", 1)),
    }
    return json.loads(
        json.dumps(
            {
                "experiment": settings,
                "phase": maths,
                "data": dict(sorted(data.items())),
                "total_steps": int(total_steps),
                "clip_distance": float(clip_distance),
            },
            sort_keys=True,
        )
    )


def identity_digest(identity: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def identity_changes(old: Any, new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys where two identities differ (what a user changed), sorted."""
    if not isinstance(old, Mapping):
        return [prefix.rstrip(".") or "identity"]
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            changed += identity_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append(f"{prefix}{key}")
    return changed


def save_checkpoint(path: Path, payload: Mapping[str, Any]) -> None:
    """Write a checkpoint atomically, refusing up front when it cannot fit.

    torch.save reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc]
    ... unexpected pos``, which never mentions space; a failed write is therefore checked
    against the free space it needed, and reported as what it is.
    """
    needed = _payload_bytes(payload)
    check_free_space(path.parent, needed, "save the checkpoint")
    try:
        with atomic_path(path) as tmp:
            torch.save(dict(payload), tmp)
    except Exception as exc:
        if disk_full(exc) is None and free_bytes(path.parent) >= needed:
            raise
        raise CtsegError(
            f"{path}: no space left to save the checkpoint ({needed} bytes needed, "
            f"{free_bytes(path.parent)} free); the partial file was removed and the previous "
            "checkpoint is intact: free some space and rerun, and training resumes from it"
        ) from exc


def _payload_bytes(payload: Any) -> int:
    """The tensor bytes in a (nested) checkpoint payload: what torch.save will write, roughly."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, Mapping):
        return sum(_payload_bytes(v) for v in payload.values())
    if isinstance(payload, list | tuple):
        return sum(_payload_bytes(v) for v in payload)
    return 0


def rng_state() -> dict[str, Any]:
    """The global RNG states, in types `torch.load(weights_only=True)` accepts.

    numpy's legacy state is a tuple holding an ndarray, which the weights-only unpickler
    refuses; its key travels as a tensor instead.
    """
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(kind),
            "key": torch.from_numpy(np.asarray(key, np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["bit_generator"],
            numpy_state["key"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint is the same user problem
        raise CtsegError(
            f"{path}: cannot load checkpoint: {exc}; move it aside to start this run afresh"
        ) from exc


def resume_state(
    state_dir: Path, identity: Mapping[str, Any], ranks: Ranks
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The checkpoint to resume from, if it was written by this run, and what happened.

    A checkpoint of another run (changed settings, data or length, or a saved step beyond this
    run's end) is never resumed and never deleted: rank 0 moves it, and the logs beside it,
    into ``state_dir/set-aside/<time>-<digest>/``, and this run starts fresh. Every rank reads
    the checkpoint before anything moves, so all of them take the same decision.
    """
    path = state_dir / "resume.pt"
    if not path.exists():
        return None, {"resume": "fresh"}
    state = load_checkpoint(path)
    changes = identity_changes(state.get("identity"), identity)
    if int(state.get("step", 0)) > int(identity["total_steps"]) and not changes:
        changes = ["step beyond total_steps"]
    if not changes:
        return state, {"resume": "resumed", "from_step": int(state["step"])}
    ranks.barrier()  # every rank has read the checkpoint before rank 0 moves it
    aside = state_dir / "set-aside" / f"{time.strftime('%Y%m%dT%H%M%S')}-{state.get('fingerprint')}"
    if ranks.main:
        aside.mkdir(parents=True, exist_ok=True)
        for name in ("resume.pt", "steps.csv", "epochs.csv"):
            if (state_dir / name).exists():
                os.replace(state_dir / name, aside / name)
        print(
            f"{path} was written by a different run (changed: {', '.join(changes)}); "
            f"set it aside in {aside} and started this run afresh",
            file=sys.stderr,
        )
    ranks.barrier()
    return None, {"resume": "set_aside", "set_aside": str(aside), "changed": changes}


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def dice_score(logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """Hard Dice intersection and denominator over valid voxels (summed over a batch)."""
    valid = (batch["ignore"] == 0) & (batch["label"] != 2)
    pred = (logits > 0) & valid
    truth = (batch["label"] == 1) & valid
    return float((pred & truth).sum()), float(pred.sum() + truth.sum())


# ----------------------------------------------------------------------------- several GPUs
@dataclass(frozen=True)
class Ranks:
    """This process's place among torchrun's processes; rank 0 of 1 without torchrun."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the one that shows progress and writes logs, checkpoints and weights."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def torchrun_ranks() -> Ranks:
    """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them."""
    env = os.environ
    return Ranks(
        int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))
    )


def pick_device(requested: str | None = None) -> torch.device:
    """The device asked for, else CUDA where present; under torchrun each process takes the GPU
    of its local rank (``cuda:LOCAL_RANK``), whatever index was asked for."""
    if requested:
        device = torch.device(requested)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ranks = torchrun_ranks()
    if device.type == "cuda" and ranks.world > 1:
        return torch.device("cuda", ranks.local_rank)
    return device


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[Ranks]:
    """Join torchrun's process group for the duration: NCCL on CUDA, gloo on the CPU.

    Without torchrun there is nothing to join. Inside a group already joined (``ctseg train``
    and ``ctseg trial`` join one around the whole command) it only says where this process
    stands. The group is left on the way out, on an exception too.
    """
    ranks = torchrun_ranks()
    if ranks.world == 1 or dist.is_initialized():
        yield ranks
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    try:
        yield ranks
    finally:
        dist.destroy_process_group()


def configured_gpus(exp: Mapping[str, Any], phase: Mapping[str, Any]) -> int:
    """GPUs (torchrun processes) a run trains on: the phase's ``gpus`` where it sets one, else
    the experiment's ``train.gpus``, else 1."""
    return int(phase.get("gpus") or exp["train"].get("gpus") or 1)


def ddp_phase(exp: Mapping[str, Any], phase: Mapping[str, Any], world: int) -> dict[str, Any]:
    """The phase as `train` takes it in `world` processes: ``accumulate`` per step over all of
    them, i.e. the configured per-GPU ``accumulate`` times the GPUs (so trial summaries state
    the whole step's batch). A process count other than the configured ``gpus`` is an error:
    it would change the batch, hence the maths, without saying so."""
    gpus = configured_gpus(exp, phase)
    if gpus != world:
        launch = f"torchrun --standalone --nproc_per_node {gpus} -m ctseg.cli"
        raise CtsegError(
            f"the experiment/phase asks for gpus: {gpus}, but this run has {world} "
            f"process(es); start it as `{launch} ...` (the train and train_trial rules do)"
        )
    if world == 1:
        return dict(phase)
    return {**phase, "gpus": world, "accumulate": int(phase.get("accumulate", 1)) * world}


def across_ranks(
    ranks: Ranks,
    device: torch.device,
    *,
    mean: Mapping[str, float] | None = None,
    largest: Mapping[str, float] | None = None,
    total: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Each rank's numbers combined over the ranks: averaged, the largest, or summed. With one
    process: the numbers as they are."""
    groups = {"mean": dict(mean or {}), "largest": dict(largest or {}), "total": dict(total or {})}
    if ranks.world == 1:
        return {k: v for values in groups.values() for k, v in values.items()}
    out: dict[str, float] = {}
    summed = {**groups["mean"], **groups["total"]}
    for values, op in ((summed, dist.ReduceOp.SUM), (groups["largest"], dist.ReduceOp.MAX)):
        if not values:
            continue
        tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=op)
        out.update(zip(values, tensor.tolist(), strict=True))
    for key in groups["mean"]:
        out[key] /= ranks.world
    return out


def parameter_digest(model: torch.nn.Module) -> str:
    """sha256 over the parameters' names and bytes: equal digests, equal weights."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(tensor_bytes(param))
    return digest.hexdigest()


def gathered(ranks: Ranks, value: Any) -> list[Any]:
    """`value` from every rank, in rank order (a collective: every rank must call it)."""
    if ranks.world == 1:
        return [value]
    values: list[Any] = [None] * ranks.world
    dist.all_gather_object(values, value)
    return values


# ----------------------------------------------------------------------------- train
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
    clip_distance: float = 8.0,
    max_steps: int | None = None,
    no_data: bool = False,
    device: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train `exp` under `phase`; returns a summary. See the module docstring for the logs,
    and for what changes when torchrun starts several processes."""
    # --- setup ----------------------------------------------------------------------------
    dev = pick_device(device)
    with process_group(dev) as ranks:
        tcfg, dcfg = exp["train"], exp["data"]
        seed = int(tcfg["seed"])
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        deterministic = bool(tcfg["deterministic"])
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if deterministic or torch.are_deterministic_algorithms_enabled():  # set both ways
            # warn_only: max_pool3d's CUDA backward (clDice's soft skeleton) has no
            # deterministic kernel; torch warns about it rather than stopping the run. CPU runs
            # are exact.
            torch.use_deterministic_algorithms(deterministic, warn_only=True)
        torch.backends.cudnn.benchmark = not deterministic and dev.type == "cuda"
        torch.backends.cuda.matmul.allow_tf32 = bool(tcfg["tf32"])
        torch.backends.cudnn.allow_tf32 = bool(tcfg["tf32"])

        batch_size = int(phase["batch_size"])  # per process
        accumulate = int(phase.get("accumulate", 1))  # micro-batches per step, all processes
        if accumulate % ranks.world:
            raise CtsegError(
                f"phase accumulate {accumulate} is not a multiple of the {ranks.world} "
                "processes (train() takes a step's micro-batches over all of them; see ddp_phase)"
            )
        micro_steps = accumulate // ranks.world  # this process's share of them
        effective_batch = batch_size * accumulate
        steps_per_epoch = int(tcfg["steps_per_epoch"])
        epochs = int(tcfg["epochs"])
        total_steps = max_steps if max_steps is not None else steps_per_epoch * epochs
        base_lr = scaled_lr(tcfg, effective_batch)
        precision = phase.get("precision") or "fp32"
        if precision not in PRECISIONS:
            raise CtsegError(
                f"phase precision must be one of {list(PRECISIONS)}, got {precision!r}"
            )
        autocast_dtype = PRECISIONS[precision]
        memory_format = (
            torch.channels_last_3d if phase.get("channels_last") else torch.contiguous_format
        )

        model = build_model(exp["model"]).to(dev, memory_format=memory_format)
        if tcfg["optimizer"] == "adamw":
            optimizer = torch.optim.AdamW(
                model.parameters(), lr=base_lr, weight_decay=tcfg["weight_decay"]
            )
        elif tcfg["optimizer"] == "sgd":
            optimizer = torch.optim.SGD(
                model.parameters(),
                lr=base_lr,
                momentum=tcfg["momentum"],
                weight_decay=tcfg["weight_decay"],
                nesterov=True,
            )
        else:
            raise CtsegError(f"train.optimizer must be adamw or sgd, got {tcfg['optimizer']!r}")

        def schedule(step: int) -> float:
            return lr_at(
                step,
                base_lr=1.0,
                warmup=int(tcfg["warmup_steps"]),
                total=total_steps,
                min_ratio=float(tcfg["min_lr_ratio"]),
            )

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        scaler = torch.amp.GradScaler(dev.type, enabled=autocast_dtype is torch.float16)
        losses_cfg = loss_settings({**exp["loss"], "clip_distance": clip_distance})
        identity = run_identity(
            exp,
            phase,
            data=_data_identity(scratch, train_ids, val_ids),
            total_steps=total_steps,
            clip_distance=clip_distance,
        )
        fp = identity_digest(identity)

        # Every rank loads the checkpoint (rank 0 wrote it) and goes on from the same state.
        step, epoch, sample_index = 0, 0, 0
        resume_path = state_dir / "resume.pt" if state_dir is not None else None
        state, resumed = (None, {"resume": "fresh"})
        if state_dir is not None:
            state, resumed = resume_state(state_dir, identity, ranks)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            scaler.load_state_dict(state["scaler"])
            set_rng_state(state["rng"])
            step, epoch = int(state["step"]), int(state["epoch"])
            sample_index = int(state["sample_index"])  # where the interrupted run's loader was
            if ranks.main:
                print(f"resumed at step {step} (epoch {epoch}) from {resume_path}", file=sys.stderr)

        # DDP: the weights are broadcast from rank 0 once, then every synchronised backward
        # averages the gradients over the ranks.
        if ranks.world > 1:
            ddp_model = DistributedDataParallel(
                model, device_ids=[dev.index] if dev.type == "cuda" else None
            )
            skip_sync = ddp_model.no_sync  # micro-batches before a step's last: local grads
        else:
            ddp_model, skip_sync = model, contextlib.nullcontext
        step_model = torch.compile(ddp_model) if phase.get("compile") else ddp_model

        dataset = PatchDataset(
            scratch,
            train_ids,
            patch_size=dcfg["patch_size"],
            fmt=exp["scratch_format"],
            fg_fraction=dcfg["fg_fraction"],
            augment=dcfg["augment"],
            seed=seed,
            length=sample_index + (total_steps - step) * effective_batch,
            runtime_targets=dcfg["runtime_targets"],
        )
        loader = build_loader(
            dataset,
            phase,
            seed=seed,
            start=sample_index,
            device=dev,
            rank=ranks.rank,
            world=ranks.world,
        )
        # device_prefetch: batches come converted on the device, the next one's copy issued (on
        # a side CUDA stream) before this one is handed out; `feed` reports the time it spent.
        feed = DevicePrefetcher(loader, dev) if phase.get("device_prefetch") else None
        batches = iter(loader if feed is None else feed)
        if no_data:
            # The compute ceiling: the same steps on batches that are already on the device.
            resident = [
                next(batches) if feed is not None else to_device(next(batches), dev)
                for _ in range(micro_steps)
            ]

        gpu = GpuMonitor(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        # Snakemake deletes a job's declared outputs before it reruns it, so the logs a resumed
        # run appends to live beside the resumable checkpoint and are copied out at the end.
        log_dir = state_dir if state_dir is not None else out_dir
        if ranks.main:
            log_dir.mkdir(parents=True, exist_ok=True)
            out_dir.mkdir(parents=True, exist_ok=True)
        steps_log: list[dict[str, Any]] = []
        epochs_log: list[dict[str, Any]] = []
        peak_rss_mb = host_rss_bytes() / 2**20

        # --- loop -------------------------------------------------------------------------
        bar = tqdm(
            total=total_steps,
            initial=step,
            disable=not progress or not ranks.main,
            unit="step",
            desc="train",
        )
        model.train()
        while step < total_steps:
            step_start = time.perf_counter()
            data_wait = h2d = 0.0
            terms_sum: dict[str, float] = {}
            loss_sum = 0.0
            optimizer.zero_grad(set_to_none=True)
            for micro in range(micro_steps):
                if no_data:
                    batch = resident[micro]
                else:
                    if feed is not None:
                        feed.transfer_s = 0.0  # stays 0 where no next batch was left to send
                    t0 = time.perf_counter()
                    fetched = next(batches)
                    t1 = time.perf_counter()
                    if feed is None:
                        batch = to_device(fetched, dev, non_blocking=True)
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        data_wait += t1 - t0
                        h2d += time.perf_counter() - t1
                    else:
                        # The call blocked in the loader, then issued the next batch's transfer.
                        batch = fetched
                        data_wait += (t1 - t0) - feed.transfer_s
                        h2d += feed.transfer_s
                image = batch["image"].contiguous(memory_format=memory_format)
                last_micro = micro == micro_steps - 1
                with contextlib.nullcontext() if last_micro else skip_sync():
                    with torch.autocast(
                        dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
                    ):
                        logits = step_model(image)
                    total, terms = compute_losses(logits, batch, **losses_cfg)
                    scaler.scale(total / micro_steps).backward()
                loss_sum += float(total.detach()) / micro_steps
                for name, value in terms.items():
                    terms_sum[name] = terms_sum.get(name, 0.0) + float(value.detach()) / micro_steps
            # The norm of the true (unscaled) gradients, before clipping; inf max_norm: no clip.
            scaler.unscale_(optimizer)
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), float(tcfg["grad_clip"] or 0) or math.inf
                )
            )
            scaler.step(optimizer)
            scaler.update()
            lr = optimizer.param_groups[0]["lr"]
            scheduler.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            step_s = time.perf_counter() - step_start
            step += 1
            sample_index += effective_batch

            # One row for the step of all ranks together (see the module docstring).
            shared = across_ranks(
                ranks,
                dev,
                mean={
                    "data_wait_s": data_wait,
                    "h2d_s": h2d,
                    "loss": loss_sum,
                    **terms_sum,
                    "gpu_util": gpu.utilisation(),
                },
                largest={
                    "step_s": step_s,
                    "vram_peak_mb": torch.cuda.max_memory_allocated(dev) / 2**20
                    if dev.type == "cuda"
                    else float("nan"),
                },
                total={"host_rss_mb": host_rss_bytes() / 2**20},
            )
            peak_rss_mb = max(peak_rss_mb, shared["host_rss_mb"])
            row = {
                "epoch": epoch,
                "step": step,
                "data_wait_s": shared["data_wait_s"],
                "h2d_s": shared["h2d_s"],
                "compute_s": shared["step_s"] - shared["data_wait_s"] - shared["h2d_s"],
                "step_s": shared["step_s"],
                "samples_per_s": effective_batch / shared["step_s"],
                "loss": shared["loss"],
                **{name: shared[name] for name in terms_sum},
                "grad_norm": grad_norm,
                "lr": lr,
                "gpu_util": shared["gpu_util"],
                "vram_peak_mb": shared["vram_peak_mb"],
                "host_rss_mb": shared["host_rss_mb"],
            }
            steps_log.append(row)
            wait_pct = (
                100 * sum(r["data_wait_s"] for r in steps_log) / sum(r["step_s"] for r in steps_log)
            )
            bar.set_postfix(loss=f"{row['loss']:.3f}", wait=f"{wait_pct:.0f}%", refresh=False)
            bar.update(1)

            # --- evaluation and checkpoint, once per epoch --------------------------------
            if max_steps is None and step % steps_per_epoch == 0:
                val = evaluate(
                    model, exp, phase, scratch, val_ids, dev, losses_cfg, memory_format, ranks
                )
                epoch_rows = [r for r in steps_log if r["epoch"] == epoch]
                epochs_log.append(
                    {
                        "epoch": epoch,
                        "step": step,
                        "train_loss": statistics.fmean(r["loss"] for r in epoch_rows),
                        "samples_per_s": effective_batch
                        * len(epoch_rows)
                        / sum(r["step_s"] for r in epoch_rows),
                        "data_wait_fraction": sum(r["data_wait_s"] for r in epoch_rows)
                        / sum(r["step_s"] for r in epoch_rows),
                        **val,
                    }
                )
                epoch += 1
                # Logs first, then the checkpoint: a run killed between the two redoes the
                # epoch and its rows replace the ones already written, so no row is lost or
                # doubled. Rank 0 writes; the others hold the same rows and weights.
                if ranks.main:
                    write_csv(
                        log_dir / "epochs.csv", _merge_log(log_dir / "epochs.csv", epochs_log)
                    )
                    write_csv(log_dir / "steps.csv", _merge_log(log_dir / "steps.csv", steps_log))
                epochs_log, steps_log = [], []
                if resume_path is not None and ranks.main:
                    save_checkpoint(
                        resume_path,
                        {
                            "model": portable_state_dict(model),
                            "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                            "scaler": scaler.state_dict(),
                            "rng": rng_state(),
                            "step": step,
                            "epoch": epoch,
                            "sample_index": sample_index,
                            "world_size": ranks.world,
                            "fingerprint": fp,
                            "identity": identity,
                        },
                    )
        bar.close()

        if ranks.main:
            if steps_log or max_steps is not None:
                write_csv(log_dir / "steps.csv", _merge_log(log_dir / "steps.csv", steps_log))
            if log_dir != out_dir:
                for name in ("steps.csv", "epochs.csv"):
                    if (log_dir / name).exists():
                        with atomic_path(out_dir / name) as tmp:
                            shutil.copyfile(log_dir / name, tmp)
            if final_weights is not None:
                save_checkpoint(
                    final_weights,
                    {
                        "model": portable_state_dict(model),
                        "model_config": dict(exp["model"]),
                        "patch_size": list(dcfg["patch_size"]),
                        "fingerprint": fp,
                        "step": step,
                    },
                )
        # A collective: no rank returns before rank 0's files are written.
        digests = gathered(ranks, parameter_digest(model))
        peak_vram = across_ranks(
            ranks,
            dev,
            largest={
                "mb": torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else 0.0
            },
        )["mb"]
        return {
            "steps": step,
            "peak_host_rss_mb": peak_rss_mb,
            "peak_vram_mb": peak_vram if dev.type == "cuda" else None,
            "device": str(dev),
            "world_size": ranks.world,
            "param_sha256": digests,
            "run_identity": fp,
            **resumed,
        }


def _data_identity(scratch: Path, train_ids: list[str], val_ids: list[str]) -> dict[str, str]:
    """Each record's role and staged source fingerprint, as the run identity names the data."""
    from ctseg.stage import staged_fingerprints

    prints = staged_fingerprints(scratch, [*train_ids, *val_ids])
    roles = {**{i: "val" for i in val_ids}, **{i: "train" for i in train_ids}}
    return {f"{roles[i]}:{i}": fp for i, fp in prints.items()}


def _merge_log(path: Path, new_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows already on disk (from before a resume or an earlier epoch) followed by new ones."""
    if not path.exists() or not new_rows:
        return new_rows
    with open(path, newline="") as handle:
        old = list(csv.DictReader(handle))
    first_new = (int(new_rows[0]["epoch"]), int(new_rows[0]["step"]))
    kept = [r for r in old if (int(r["epoch"]), int(r["step"])) < first_new]
    return kept + new_rows


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    exp: Mapping[str, Any],
    phase: Mapping[str, Any],
    scratch: Path,
    val_ids: list[str],
    dev: torch.device,
    losses_cfg: Mapping[str, Any],
    memory_format: torch.memory_format,
    ranks: Ranks = Ranks(),
) -> dict[str, float]:
    """Loss and Dice on a fixed set of validation patches (the same ones every epoch).

    Under DDP each rank scores every world-th batch and the results are gathered: the mean
    (an exact fsum) and the voxel counts come out as one process computes them.
    """
    n_batches = int(exp["train"]["val_batches"])
    if not val_ids or n_batches == 0:
        return {"val_loss": float("nan"), "val_dice": float("nan")}
    batch_size = int(phase["batch_size"])
    dataset = PatchDataset(
        scratch,
        val_ids,
        patch_size=exp["data"]["patch_size"],
        fmt=exp["scratch_format"],
        fg_fraction=exp["data"]["fg_fraction"],
        augment={"flip": False, "permute": False, "intensity": {"prob": 0.0}},
        seed=int(exp["train"]["seed"]) + 1,
        length=n_batches * batch_size,
    )
    loader = build_loader(
        dataset, {**phase, "workers": 0}, seed=0, device=dev, rank=ranks.rank, world=ranks.world
    )
    model.eval()
    losses, intersection, denominator = [], 0.0, 0.0
    for host_batch in loader:
        batch = to_device(host_batch, dev)
        logits = model(batch["image"].contiguous(memory_format=memory_format))
        total, _ = compute_losses(logits, batch, **losses_cfg)
        losses.append(float(total))
        inter, denom = dice_score(logits, batch)
        intersection += inter
        denominator += denom
    model.train()
    if ranks.world > 1:
        shares = gathered(ranks, (losses, intersection, denominator))
        losses = [loss for share in shares for loss in share[0]]
        intersection = sum(share[1] for share in shares)
        denominator = sum(share[2] for share in shares)
    dice = 2 * intersection / denominator if denominator else 1.0
    return {"val_loss": statistics.fmean(losses), "val_dice": dice}
