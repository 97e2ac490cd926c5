"""Keep freed patch-sized buffers in this process's heap (glibc `mallopt`).

Every sample allocates ~10 MB of short-lived arrays at 72x136x136; with glibc's defaults the
freed top of the heap is trimmed and the next sample page-faults all of it in again, which
measured as half of a worker's time per sample. The loader workers, the main process copying
batches out of their slots, and inference (`ctseg.inference.blend.model_session`) all call
`tune_malloc`.
"""

from __future__ import annotations

import ctypes
import os
import platform

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MALLOC_TUNED: set[int] = set()


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Keep freed patch buffers in the heap of this process (glibc only; once per process).

    Costs at most `trim_threshold` of retained free heap per process; returns whether it
    applied.
    """
    pid = os.getpid()
    if pid in _MALLOC_TUNED:
        return True
    ok = _mallopt(mmap_threshold, trim_threshold)
    if ok:
        _MALLOC_TUNED.add(pid)
    return ok


def release_heap() -> bool:
    """Hand the free memory of every arena of this process's heap back to the system (glibc
    `malloc_trim`); whether it ran. With `tune_malloc`'s thresholds freed buffers stay in the
    heap, so that a forward's activations are not faulted in again each time; a process held
    to a memory budget (`ctseg.inference.tiled`, after each tile) calls this where a unit of
    work ends: a 128x256x448 predict under a 16 MB budget grew by 144 MB without it, the
    freed buffers of the threads' arenas."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
        return ok and libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    except (OSError, AttributeError):
        return False
