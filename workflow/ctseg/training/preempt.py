"""Stopping a training early on request, at a step boundary, so that it can resume.

SIGTERM (Snakemake stopping a job, a scheduler's preemption or time limit), SIGUSR1 (what a job
script's ``#SBATCH --signal=USR1@<seconds>`` sends ahead of a time limit) and SIGURG (the same
early signal under the SLURM profile, ``--signal=URG@<seconds>``) only set a flag here
(`stop_on_signals`). The training loop reads it after each optimizer step, writes a
checkpoint and stops; `ctseg train` then exits with `RESUMABLE_EXIT`, which says "stopped
on request with a checkpoint: run me again". Other commands keep turning SIGTERM into an
immediate exit that removes their temporaries (`ctseg.cli.main`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing
import multiprocessing.util  # registers multiprocessing's exit handler now, before ours
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

# EX_TEMPFAIL of sysexits.h: "a temporary failure; the user is invited to retry". Snakemake
# counts any non-zero status as a failure, so a profile with retries resubmits the job.
RESUMABLE_EXIT = 75
# SIGURG is ignored by default, so among the processes of a SLURM job step only this one acts on
# it: the Snakemake that runs the rule (and a bash or torchrun around `ctseg train`) goes on, and
# a training that ends before it stops is a job that succeeded (docs/cluster.md).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGURG)


@dataclass
class StopRequest:
    """Set by a signal handler; read by the training loop between steps."""

    signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: object) -> None:
        # A second signal while the checkpoint is being written changes nothing: the loop
        # stops as soon as it is on disk.
        self.signum = self.signum or signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """A `StopRequest` set by SIGTERM, SIGUSR1 or SIGURG inside the block; the previous
    handlers are put back after it. Off the main thread (where Python cannot install handlers)
    the request is never set."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.signal(sig, stop._handle) for sig in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def shielded(stop: StopRequest | None) -> Iterator[None]:
    """Block the stop signals while child processes (loader workers) start in the block.

    A scheduler signals every process of a job, loader workers included; torch's workers die
    of a SIGTERM that is not their parent's, and the training would then fail mid-step
    instead of checkpointing. A child inherits the mask of the thread that starts it, so
    these never see the signals. (This process still gets them, through another thread if
    this one blocks them; the loop reads the request only between steps anyway.)

    Nor do they see the SIGTERM with which multiprocessing ends its daemonic children at exit,
    before it waits for them: a worker still alive then (its loader not yet collected, or an
    error on the way out) would hold the exit for ever. `_kill_daemonic_children` runs first
    and kills them.
    """
    if stop is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    _kill_at_exit()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _kill_daemonic_children() -> None:
    """SIGKILL the daemonic children still alive: what multiprocessing's own exit handler
    means to do with its SIGTERM, which a child started in `shielded` blocks."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join()


@functools.cache
def _kill_at_exit() -> None:
    # atexit runs its handlers last registered first, and multiprocessing.util registered its
    # own when it was imported (above): this one runs before it.
    atexit.register(_kill_daemonic_children)
