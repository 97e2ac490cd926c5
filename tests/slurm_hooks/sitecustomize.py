"""Test-only, for tests/test_slurm_cluster.py: hold `ctseg train` at chosen samples until a stop
signal has reached it, so that the test's signal lands in a known step.

Imported by every Python process of the test's SLURM jobs, because the test puts this folder on
PYTHONPATH and the jobs inherit the environment (`--export=ALL`). Active only where
CTSEG_TEST_HOLD_DIR is set. When `ctseg.training.feeds` is imported, its `to_device` is wrapped:
fetching sample i, for i in CTSEG_TEST_HOLD_AT (comma-separated), writes `held-<i>` into the hold
folder and waits until `ctseg train` has a stop request (its SIGTERM/SIGURG handler set it) or
`release-<i>` appears, at most 300 s. Then the step goes on as it would have: observation only,
as tests/test_preemption.py's HOOK.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time
from pathlib import Path

HOLD_DIR = os.environ.get("CTSEG_TEST_HOLD_DIR")
HOLD_AT = {int(i) for i in os.environ.get("CTSEG_TEST_HOLD_AT", "").split(",") if i}
MODULE = "ctseg.training.feeds"


def _stop_requested() -> bool:
    """`ctseg.training.preempt.StopRequest` is the handler: has a signal set it?"""
    handler = signal.getsignal(signal.SIGTERM)
    request = getattr(handler, "__self__", None)
    return bool(getattr(request, "requested", False))


def _patch(module) -> None:
    real = module.to_device

    def to_device(batch, *args, **kwargs):
        index = int(batch["index"][0])
        held = Path(HOLD_DIR) / f"held-{index}"
        if index in HOLD_AT and not held.exists():
            held.write_text(str(os.getpid()))
            release = Path(HOLD_DIR) / f"release-{index}"
            deadline = time.monotonic() + 300
            while not (_stop_requested() or release.exists()) and time.monotonic() < deadline:
                time.sleep(0.05)
        return real(batch, *args, **kwargs)

    module.to_device = to_device


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if HOLD_DIR:
    sys.meta_path.insert(0, _Finder())
