"""When a training writes a checkpoint between epochs, and when it stops early.

Two reasons to checkpoint mid-epoch, both decided between optimizer steps:

- a stop request (`ctseg.training.preempt`: SIGTERM, SIGUSR1 or SIGURG set it): the loop
  finishes its current step, checkpoints it and returns, its summary's ``stopped`` naming the
  signal. Under torchrun the signal may reach the ranks a step apart, so each step's
  all-reduce carries every rank's flag (`Stopping.flag`, `Stopping.agree`) and all of them
  stop after the same step;
- a timer (``train.checkpoint_minutes``): rank 0's clock decides, since only rank 0 writes.

`Stopping` also remembers which step is on disk, so a stop right after an epoch's checkpoint
does not write the same step twice.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ctseg.training.preempt import StopRequest


@dataclass
class Stopping:
    """A run's stop request, checkpoint timer and the step of its checkpoint on disk."""

    request: StopRequest | None = None
    world: int = 1  # processes of the run
    every_s: float | None = None  # seconds between mid-epoch checkpoints; None: off
    saved_step: int = 0  # the step of the checkpoint on disk
    saved_at: float = field(default_factory=time.monotonic)  # when it was written (or the start)
    agreed: bool = False  # some rank was asked to stop (as the last step's all-reduce found)
    stopped: str | None = None  # the signal that stopped the run before its end

    @classmethod
    def every(cls, minutes: float | None, request: StopRequest | None, world: int) -> Stopping:
        """`minutes` of training between mid-epoch checkpoints (None or 0: only at epoch ends)."""
        return cls(request, world, 60.0 * float(minutes) if minutes else None)

    def flag(self) -> float:
        """This process's request, for the step's all-reduce (the largest over the ranks)."""
        return float(self.request is not None and self.request.requested)

    def agree(self, largest: float) -> None:
        self.agreed = largest > 0

    def requested(self) -> bool:
        """A stop was requested: by this process's signal with one process, else as the ranks
        agreed after the last step (a rank's own flag may be set a step earlier than another's)."""
        if self.world == 1:
            return self.request is not None and self.request.requested
        return self.agreed

    def due(self) -> bool:
        """`checkpoint_minutes` have passed since the last checkpoint."""
        return self.every_s is not None and time.monotonic() - self.saved_at >= self.every_s

    def saved(self, step: int) -> None:
        """A checkpoint of `step` is on disk (or, for a run without one, would be)."""
        self.saved_step, self.saved_at = step, time.monotonic()

    def stop(self) -> str:
        """Mark the run stopped; returns the signal's name for the log."""
        request = self.request
        self.stopped = request.name if request is not None and request.requested else "a signal"
        return self.stopped

    def report(self, step: int, epoch: int, checkpoint: Path) -> None:
        print(
            f"stopped by {self.stopped} at step {step} (epoch {epoch}): checkpoint "
            f"{checkpoint} holds step {self.saved_step}; run again to resume",
            file=sys.stderr,
        )
