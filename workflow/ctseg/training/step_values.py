"""A training step's values on the device, and their read-back once every ``log_every`` steps.

`ctseg.training.train.train_step` leaves the loss, its terms and the gradient norm on the device
as tensors (and on CUDA an event at the step's end), so the host queues the next step while the
device runs this one; `materialise` reads every pending step's values with one read and fills
their steps.csv rows.
"""

from __future__ import annotations

import torch

from ctseg.summaries import step_columns
from ctseg.training.distributed import across_ranks
from ctseg.training.run_state import Run


def add_pending(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if total is None else total + value


def device_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def materialise(run: Run) -> None:
    """Fill the pending rows' device values (loss, terms, gradient norm, averaged over the ranks)
    and their step times, with one read from the device for all of them. On CUDA a step's time
    is the device's, between the events at the ends of consecutive steps (the first from the
    window's start), so it holds the step's own kernels and idle time whatever the host did; on
    a CPU it is the host's (the step ran synchronously)."""
    if not run.pending:
        return
    names = list(run.pending[0][1]["terms"])
    stacked = torch.stack(
        [
            torch.stack([n["loss"], *(n["terms"][k] for k in names), n["grad_norm"]]).float()
            for _, n in run.pending
        ]
    )
    if run.ranks.world > 1:  # the loss and terms are each rank's; the gradient norm is shared
        torch.distributed.all_reduce(stacked)
        stacked /= run.ranks.world
    values = stacked.tolist()  # the one host read of the window
    times = _step_times(run)
    times = across_ranks(run.ranks, run.dev, largest=dict(enumerate(times)))
    pending = [row for row, _ in run.pending]
    for i, (row, (loss, *terms, grad_norm)) in enumerate(zip(pending, values, strict=True)):
        step_s = times[i]
        row.update(
            loss=loss,
            **dict(zip(names, terms, strict=True)),
            grad_norm=grad_norm,
            step_s=step_s,
            compute_s=step_s - row["data_wait_s"] - row["h2d_s"],
            samples_per_s=run.effective_batch / step_s,
        )
        row.update(run.efficiency.columns(row["samples_per_s"]))  # every rank's devices
        ordered = {c: row[c] for c in step_columns(names, efficiency=True)}
        row.clear()
        row.update(ordered)
    run.pending, run.window_event = [], None


def _step_times(run: Run) -> list[float]:
    if run.window_event is None:  # CPU: the host's own times
        return [n["host_s"] for _, n in run.pending]
    ends = [n["end_event"] for _, n in run.pending]
    ends[-1].synchronize()
    starts = [run.window_event, *ends[:-1]]
    return [a.elapsed_time(b) / 1000 for a, b in zip(starts, ends, strict=True)]
