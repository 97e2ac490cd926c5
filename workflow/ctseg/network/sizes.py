"""The network's sizes without torch: the default filters, the multiple a network of a given
depth computes spatial sizes in, and the size it computes a patch at. Planning reads them
(`ctseg.planning.build`) without importing the network."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

DEFAULT_FILTERS = (32, 64, 128, 256, 512)


def size_multiple(depth: int) -> int:
    """Spatial sizes that are multiples of this need no padding in a network of `depth` levels."""
    return 2 ** (depth - 1)


def config_size_multiple(model_cfg: Mapping[str, object]) -> int:
    """`size_multiple` of the network an experiment's ``model`` section builds."""
    filters = model_cfg.get("filters", DEFAULT_FILTERS)
    return size_multiple(len(filters))  # type: ignore[arg-type]


def computed_patch(patch: Sequence[int], multiple: int) -> tuple[int, ...]:
    """The size `forward` computes a `patch` at: each axis padded up to a multiple of `multiple`.
    It is also the unpadded patch of the same cost, the one to plan instead of a padded one."""
    return tuple(-(-int(s) // multiple) * multiple for s in patch)
