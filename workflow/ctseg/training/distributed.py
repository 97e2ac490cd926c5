"""Several GPUs: where this process stands among torchrun's, and the collectives training uses.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every process runs `ctseg.training.train.train` in one
process
group (NCCL on CUDA, each process on ``cuda:LOCAL_RANK``; gloo on the CPU), and the model is
wrapped in ``DistributedDataParallel``, which averages the gradients over the processes in the
backward pass of each step's last micro-batch (``no_sync`` on the others).

- The phase's ``batch_size`` is per process; its ``accumulate`` counts the micro-batches of one
  optimizer step over all processes, each process running ``accumulate / world`` of them
  (`ddp_phase` turns the configured per-GPU ``accumulate`` into that). A step therefore uses
  the same ``batch_size * accumulate`` consecutive samples of the one stream as a single
  process with that accumulation: rank r takes micro-batches r, r + world, ...
  (`ctseg.data.loader.StreamSampler`), so the ranks' streams are disjoint and a resumed run goes on
  where the checkpoint's ``sample_index`` says.
- Logged per step, over all ranks (`across_ranks`): the loss terms, ``data_wait_s``, ``h2d_s``
  and GPU utilisation averaged; ``step_s`` and peak VRAM of the slowest/largest rank
  (``compute_s`` is the rest of the step, waiting for the gradient all-reduce included); host
  RSS summed (the whole job); ``samples_per_s`` counts the samples of all ranks.
- Validation splits the fixed validation batches over the ranks and gathers the results
  (`gathered`): the same numbers as one process computes.
- Only rank 0 shows the progress bar and writes logs, checkpoints and weights; every rank
  loads the resume checkpoint. The summary lists each rank's parameter digest
  (``param_sha256``), which DDP keeps identical.

With one process (no torchrun) every helper here is a no-op that returns its input.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ctseg.config import configured_gpus
from ctseg.io import CtsegError


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


def pick_device(requested: str | torch.device | None = None) -> torch.device:
    """The device asked for, else CUDA where present; under torchrun each process takes the GPU
    of its local rank (``cuda:LOCAL_RANK``), whatever index was asked for."""
    if requested:
        device = _checked_device(requested)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ranks = torchrun_ranks()
    if device.type == "cuda" and ranks.world > 1:
        return torch.device("cuda", ranks.local_rank)
    return device


def _checked_device(requested: str | torch.device) -> torch.device:
    """`requested` as a torch device this machine has, or a one-line error naming the ones
    it has (torch's own errors are an assertion or a list of every device type it knows)."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    have = ["cpu", *(["cuda"] + [f"cuda:{i}" for i in range(cuda)] if cuda else [])]
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as exc:
        raise CtsegError(
            f"device {str(requested)!r}: not a device name; this machine has {', '.join(have)}"
        ) from exc
    missing = (device.type == "cuda" and (not cuda or (device.index or 0) >= cuda)) or (
        device.type not in ("cpu", "cuda")
        and not getattr(getattr(torch.backends, device.type, None), "is_available", bool)()
    )
    if missing:
        build = "a CUDA build" if torch.version.cuda else "a CPU-only build"
        raise CtsegError(
            f"device {str(requested)!r}: not on this machine (torch {torch.__version__}, "
            f"{build}); this machine has {', '.join(have)}"
        )
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


def rank_share(accumulate: int, ranks: Ranks) -> int:
    """This process's micro-batches of a step's `accumulate` (counted over all processes)."""
    if accumulate % ranks.world:
        raise CtsegError(
            f"phase accumulate {accumulate} is not a multiple of the {ranks.world} "
            "processes (train() takes a step's micro-batches over all of them; see ddp_phase)"
        )
    return accumulate // ranks.world


def ddp_wrap(
    model: torch.nn.Module, device: torch.device, ranks: Ranks
) -> tuple[torch.nn.Module, Callable[[], contextlib.AbstractContextManager]]:
    """The module a training step calls, and the context for micro-batches before a step's last.

    Under DDP the weights are broadcast from rank 0 once, then every synchronised backward
    averages the gradients over the ranks; ``no_sync`` keeps the earlier micro-batches'
    gradients local. With one process: the model itself, and no context at all.
    """
    if ranks.world == 1:
        return model, contextlib.nullcontext
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    return ddp, ddp.no_sync


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


def gathered(ranks: Ranks, value: Any) -> list[Any]:
    """`value` from every rank, in rank order (a collective: every rank must call it)."""
    if ranks.world == 1:
        return [value]
    values: list[Any] = [None] * ranks.world
    dist.all_gather_object(values, value)
    return values
