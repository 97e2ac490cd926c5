"""Config `infer`'s post-processing values, checked while the workflow is planned."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ctseg.io import CtsegError
from ctseg.postprocess.masks import PostprocessSettings
from ctseg.postprocess.tuning import SearchSpace


def as_tuples(value: Any) -> Any:
    """A search-space value as `ctseg tune-postprocess` gives it: lists as tuples."""
    return tuple(as_tuples(v) for v in value) if isinstance(value, list) else value


def check_infer_config(infer: Mapping[str, Any]) -> None:
    """The fixed post-processing values and the search space of config `infer` (defaults filled
    in), checked by the very classes the postprocess and tune_postprocess jobs build from them,
    so that a bad combination (hysteresis_high below threshold, hysteresis_mode z without
    hysteresis_high, a pair [high, low]) stops planning, not a job after training and
    inference. Both are checked whichever infer.postprocess uses, as every other value of the
    config is. A CtsegError names the section: `infer: ...` or `infer.tune: ...`."""
    fixed = {f.name: infer[f.name] for f in dataclasses.fields(PostprocessSettings)}
    try:
        PostprocessSettings(**fixed)
    except CtsegError as exc:
        raise CtsegError(f"infer: {exc}") from exc
    try:
        SearchSpace(**{key: as_tuples(value) for key, value in infer["tune"].items()})
    except CtsegError as exc:
        raise CtsegError(f"infer.tune: {exc}") from exc
