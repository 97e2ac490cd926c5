"""Shared by the benchmarks: run one measurement in a fresh child process and sample its memory.

The child prints a JSON line ``{"seconds": ...}`` last; its time is measured inside the child,
so interpreter start-up and imports are excluded. Peak RSS is sampled every 10 ms over the
child and all its descendants together, so worker processes count.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import psutil


def run_child(command: list[str], what: str) -> dict:
    """Run `command`; return the seconds it reported and the peak RSS (MB) of its process tree."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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
    out, _ = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{what} child failed with status {proc.returncode}")
    return {"seconds": json.loads(out.strip().splitlines()[-1])["seconds"], "rss_mb": peak / 2**20}
