"""The private torch APIs the packed loader relies on, checked before it uses them.

The loader's speed comes from four things torch does not promise to keep (`ctseg.data.slots`,
`ctseg.data.loader`). Each is listed here with what relies on it; `missing()` says which the
installed torch lacks, `require()` turns a missing one into a one-line `CtsegError` naming the
torch version this code was written for and what to do, and tests/test_torch_private.py fails
on an upgrade that drops one, so a torch upgrade fails a test instead of a training run.

- `torch.UntypedStorage._new_shared`: a worker's batch buffer in shared memory, so the batch
  crosses to the main process as a file descriptor (as torch's own default_collate does).
- `torch.utils.data.DataLoader._get_iterator`: `PackedLoader` overrides it to give the workers
  it is about to start fresh queues for handing slots back; without the hook every batch
  would fill fresh shared memory again.
- `Dataset.__getitems__`: torch's map-style fetcher asks the dataset for a whole batch through
  it (torch.utils.data._utils.fetch); a packed batch is written in one call.
- `torch._C._storage_Use_Count` with `UntypedStorage._cdata`: how many references a slot's
  memory has, so a slot goes back to its worker only once nothing uses the batch. Optional:
  without it each batch is copied out of its slot (slower, still correct), with a warning.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader

from ctseg.io import CtsegError

WRITTEN_FOR = "2.13.0"  # pyproject.toml pins torch==2.13.0
NEW_SHARED = "torch.UntypedStorage._new_shared"
GET_ITERATOR = "torch.utils.data.DataLoader._get_iterator"
GETITEMS = "Dataset.__getitems__ called by torch.utils.data._utils.fetch._MapDatasetFetcher"
USE_COUNT = "torch._C._storage_Use_Count"


def _fetcher_calls_getitems() -> bool:
    try:  # a private module too: its absence is a missing API, not an import error here
        from torch.utils.data._utils import fetch
    except ImportError:
        return False
    fetcher = getattr(fetch, "_MapDatasetFetcher", None)
    code = getattr(getattr(fetcher, "fetch", None), "__code__", None)
    return code is not None and "__getitems__" in code.co_names + code.co_consts


# name -> (whether the installed torch has it, which ctseg module relies on it)
PRIVATE_APIS: dict[str, tuple[Callable[[], bool], str]] = {
    NEW_SHARED: (
        lambda: hasattr(torch.UntypedStorage, "_new_shared"),
        "ctseg.data.slots.SlotPool",
    ),
    GET_ITERATOR: (
        lambda: callable(getattr(DataLoader, "_get_iterator", None)),
        "ctseg.data.loader.PackedLoader",
    ),
    GETITEMS: (
        _fetcher_calls_getitems,
        "ctseg.data.loader.PackedStream",
    ),
    USE_COUNT: (
        lambda: (
            callable(getattr(torch._C, "_storage_Use_Count", None))
            and hasattr(torch.UntypedStorage(0), "_cdata")
        ),
        "ctseg.data.slots.SlotReturns",
    ),
}
# With a fallback: missing, it costs speed, not correctness (see the module docstring).
OPTIONAL = frozenset({USE_COUNT})


def missing() -> list[str]:
    """The private APIs of `PRIVATE_APIS` that the installed torch lacks."""
    return [name for name, (present, _) in PRIVATE_APIS.items() if not present()]


def message(name: str) -> str:
    """One line: what is missing, which torch the code was written for, and what to do."""
    user = PRIVATE_APIS[name][1]
    return (
        f"torch {torch.__version__} lacks {name} (private to torch), which {user} relies on; "
        f"ctseg was written for torch {WRITTEN_FOR}: install torch=={WRITTEN_FOR} (as "
        f"pyproject.toml pins it), or port {user} to this torch and update "
        f"ctseg.data.torch_private.WRITTEN_FOR"
    )


@functools.cache
def require() -> None:
    """Raise `CtsegError` if a required private API is missing; warn once for an optional one.

    Cached: the answer cannot change within a process, and the packed loader calls this each
    time one is built.
    """
    gone = missing()
    for name in gone:
        if name in OPTIONAL:
            warnings.warn(
                message(name) + " (meanwhile batches are copied out of their slots)",
                RuntimeWarning,
                stacklevel=2,
            )
    required = [name for name in gone if name not in OPTIONAL]
    if required:
        raise CtsegError(message(required[0]))
