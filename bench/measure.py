"""Shared by the benchmarks: run one measurement in a fresh child process and sample its memory.

The child prints a JSON line ``{"seconds": ...}`` last; its time is measured inside the child,
so interpreter start-up and imports are excluded. Peak RSS is sampled every 10 ms over the
child and all its descendants together, so worker processes count. A child that fails raises
with the last lines of its own stderr, so its error shows, not only its exit status.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import psutil

STDERR_TAIL_LINES = 20  # of a failed child's stderr, in the raised error


class ChildFailed(RuntimeError):
    """A measurement's child exited non-zero or printed no figures; the message ends with the
    tail of its stderr."""


def _failure(what: str, problem: str, stderr: str) -> ChildFailed:
    tail = stderr.strip().splitlines()[-STDERR_TAIL_LINES:]
    shown = "\n".join(f"  {line}" for line in tail) if tail else "  (nothing on stderr)"
    return ChildFailed(f"{what} child {problem}; its stderr ends:\n{shown}")


def run_child(command: list[str], what: str) -> dict:
    """Run `command`; return the seconds it reported and the peak RSS (MB) of its process tree."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise _failure(what, f"failed with status {proc.returncode}", err)
    lines = out.strip().splitlines()
    try:
        seconds = json.loads(lines[-1])["seconds"]
    except (IndexError, ValueError, KeyError, TypeError):
        raise _failure(what, 'printed no {"seconds": ...} line last', err) from None
    return {"seconds": seconds, "rss_mb": peak / 2**20}
