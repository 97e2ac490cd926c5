"""The synthetic volume both demo presets build (`demo_data`'s simple one, `demo_realistic`), and
the smooth basis their random fields share."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DemoVolume:
    image: np.ndarray  # uint8
    label: np.ndarray  # uint8 in {0, 1, 2}
    sheet_ids: np.ndarray  # uint8, before ignore masking: 0 background, k + 1 for sheet k
    normal_axis: int  # the axis the sheets are stacked along
    # Pairs of sheet indices pressed into contact (realistic: that run together, touching in
    # patches).
    touching: tuple[tuple[int, int], ...]
    holes: tuple[int, ...]  # gaps cut into each sheet


def smooth_basis(size: int, n_ctrl: int) -> np.ndarray:
    """Gaussian bumps centred on `n_ctrl` points spread over `size` voxels, one column each."""
    centres = np.linspace(0.0, size - 1.0, n_ctrl)
    sigma = 0.6 * (size - 1.0) / (n_ctrl - 1)
    x = np.arange(size, dtype=np.float64)[:, None]
    return np.exp(-0.5 * ((x - centres) / sigma) ** 2).astype(np.float32)
