"""`InferenceSettings`: how a volume is inferred, as one checked, frozen value.

Each default is defined here once: `ctseg infer` and `ctseg predict` take theirs from the fields,
and every function of `ctseg.inference` takes the settings whole (as post-processing takes
`ctseg.postprocess.masks.PostprocessSettings`). The workflow passes the config's `infer` section
(config/README.md) as options. Free of torch at import, so that the command line's parser reads
the defaults without loading it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ctseg.io import CtsegError

if TYPE_CHECKING:
    import torch

Shape3 = tuple[int, int, int]


def check_window(window: Sequence[int]) -> Shape3:
    """Three positive sizes (z, y, x), as a tuple of ints."""
    win = tuple(int(w) for w in window)
    if len(win) != 3 or min(win) < 1:
        raise CtsegError(f"window={tuple(window)!r}: expected three positive sizes")
    return win  # type: ignore[return-value]


@dataclass(frozen=True)
class InferenceSettings:
    """The sliding window and its budgets; checked when made, so a bad value fails before the
    (long) inference."""

    # (z, y, x); None: the training patch size stored with the weights (`with_window`).
    window: Shape3 | None = None
    # Fraction of the window shared by neighbouring windows, 0 <= overlap < 1.
    overlap: float = 0.5
    # (window, flip) pairs per forward pass: with TTA, flips share batches with other windows.
    batch_size: int = 4
    # Average the probabilities over the 8 flipped copies (8x the cost).
    tta_flips: bool = False
    # bf16 autocast of the forward; None: on CUDA only (`use_amp`).
    amp: bool | None = None
    # The weights in channels_last_3d during inference; None: on CUDA only (`memory_format`).
    channels_last: bool | None = None
    # Host memory for the tiles (and chunk cache) of a volume larger than the device budget.
    memory_budget_mb: float = 512
    # Hold a volume as one tile when its working set fits on the device (0: never): about 0.7
    # GB for a 320^3 uint8 volume (config/README.md), so the competition's volumes are whole.
    device_budget_mb: float = 2048
    # "cpu", "cuda", "cuda:1"; None: a GPU where there is one (`torch_device`).
    device: str | None = None
    # Windows whose raw input is all at or below this value (outside a scroll) are not run and
    # add probability 0 (`ctseg.inference.windows.empty_windows`); None: every window runs.
    background: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None:
            object.__setattr__(self, "window", check_window(self.window))
        if self.device is not None:
            object.__setattr__(self, "device", str(self.device))
        if not 0 <= self.overlap < 1:
            raise CtsegError(f"overlap={self.overlap!r}: expected 0 <= overlap < 1")
        batch = self.batch_size
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise CtsegError(f"batch_size={batch!r}: expected a positive integer")
        if not self.memory_budget_mb > 0:
            raise CtsegError(
                f"memory_budget_mb={self.memory_budget_mb!r}: expected a positive number"
            )
        if self.background is not None and not math.isfinite(self.background):
            raise CtsegError(f"background={self.background!r}: expected a finite number")
        if not self.device_budget_mb >= 0:
            raise CtsegError(f"device_budget_mb={self.device_budget_mb!r}: expected a number >= 0")

    def with_window(self, patch: Sequence[int]) -> InferenceSettings:
        """These settings with the window given, else `patch` (the training patch size)."""
        return self if self.window is not None else dataclasses.replace(self, window=patch)

    def checked_window(self) -> Shape3:
        if self.window is None:
            raise CtsegError("window: not given (the training patch size is stored in last.pt)")
        return self.window

    def torch_device(self) -> torch.device:
        from ctseg.training.distributed import pick_device  # torch: not for the CLI's parser

        return pick_device(self.device)

    def use_amp(self, device: torch.device) -> bool:
        """bf16 autocast: as asked, or on CUDA only (CPUs without bf16 units get slower)."""
        return device.type == "cuda" if self.amp is None else bool(self.amp)

    def memory_format(self, device: torch.device) -> torch.memory_format:
        """channels_last_3d as asked, or on CUDA only (where cuDNN's 3D convolutions gain)."""
        import torch  # not for the CLI's parser

        wanted = device.type == "cuda" if self.channels_last is None else bool(self.channels_last)
        return torch.channels_last_3d if wanted else torch.contiguous_format

    def device_budget_bytes(self) -> float:
        return self.device_budget_mb * 2**20

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "window": None if self.window is None else list(self.window),
        }
