"""Facts about the machine a step runs on, read one way everywhere."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """The CPU cores this process may run on: its affinity mask where the OS has one (a
    scheduler's cgroup or `taskset` narrows it below the machine's count), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this OS (macOS, Windows)
        return os.cpu_count() or 1
