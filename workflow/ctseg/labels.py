"""The label convention of a dataset, and its voxel spacing: the one owner of both.

Modelled on nnU-Net v2's dataset.json and its LabelManager: a dataset names its labels
(``background`` must be 0), may name one value as ignored (voxels nobody labelled: no loss, no
score), and may group labels into regions (nnU-Net's region-based training, where a region is
a set of labels trained as one channel). Code that needs to know which voxels are foreground or
ignored asks a `LabelSpec` (`foreground`, `ignored`, `check_values`) instead of comparing label
arrays with literal 1s and 2s; tests/test_label_literals.py keeps it that way.

``resources/<name>/dataset.yaml`` gives a dataset's spec (docs/runs.md describes the format)::

    labels: {background: 0, surface: 1}
    ignore: 2
    regions: {sheet: [surface]}      # optional
    spacing: [1.0, 1.0, 1.0]          # optional, z y x

Without one, a dataset has the Kaggle competition's convention, `KAGGLE` (0 background,
1 surface, 2 ignored), and no spacing (isotropic, as every stage assumes today).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctseg.config import closest, read_yaml
from ctseg.io import CtsegError

DATASET_FILE = "dataset.yaml"
BACKGROUND = "background"
KEYS = ("labels", "ignore", "regions", "spacing")
# Label volumes are stored as uint8 (convert writes them so; the Kaggle TIFFs are uint8).
MAX_VALUE = 255
KAGGLE_SOURCE = "the Kaggle default (no dataset.yaml)"


# ---------------------------------------------------------------------------- helpers
def _kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"


def _check_value(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise CtsegError(f"{where}: {value!r} is not an integer; label values are 0..{MAX_VALUE}")
    if not 0 <= value <= MAX_VALUE:
        raise CtsegError(
            f"{where}: {value} is outside 0..{MAX_VALUE}; label volumes are stored as uint8"
        )


def _region_members(
    region: str, members: Any, labels: dict[str, int], where: str
) -> tuple[str, ...]:
    """A region's labels as names in value order; values are taken for the labels they name."""
    key = f"{where}: regions.{region}"
    if isinstance(members, str | int) and not isinstance(members, bool):
        members = [members]
    if not isinstance(members, list | tuple) or not members:
        raise CtsegError(f"{key}: expected a non-empty list of label names or values")
    by_value = {value: name for name, value in labels.items()}
    names: set[str] = set()
    for member in members:
        if isinstance(member, int | np.integer) and not isinstance(member, bool):
            if member not in by_value:
                raise CtsegError(
                    f"{key}: no label has the value {member}; labels are "
                    f"{', '.join(f'{n}: {v}' for n, v in labels.items())}"
                )
            name = by_value[int(member)]
        elif isinstance(member, str) and member in labels:
            name = member
        else:
            close = closest(str(member), list(labels))
            hint = f"did you mean {' or '.join(close)}?" if close else ""
            raise CtsegError(
                f"{key}: unknown label {member!r}; {hint or 'labels are ' + ', '.join(labels)}"
            )
        if name == BACKGROUND:
            raise CtsegError(f"{key}: background cannot be part of a region")
        names.add(name)
    return tuple(name for name in labels if name in names)


def _spacing(value: Any, where: str) -> tuple[float, float, float]:
    ok = isinstance(value, list | tuple) and len(value) == 3
    numbers = (
        ok
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        and all(math.isfinite(v) and v > 0 for v in value)
    )
    if not numbers:
        raise CtsegError(
            f"{where}: expected 3 positive numbers [z, y, x] (the voxel size along each axis); "
            f"found {value!r}"
        )
    return (float(value[0]), float(value[1]), float(value[2]))


def _any_equal(label: Any, values: tuple[int, ...]) -> Any:
    out = label == values[0]
    for value in values[1:]:
        out = out | (label == value)
    return out


def _all_false(label: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(label, torch.Tensor):
        return torch.zeros_like(label, dtype=torch.bool)
    return np.zeros(np.shape(label), dtype=bool)


@dataclass(frozen=True)
class LabelSpec:
    """Label names and values, the ignored value and the regions of one dataset.

    `labels` maps name -> value and includes ``background: 0``; `ignore` is the value of voxels
    that count nowhere (None: there are none); `regions` maps a region's name to the names of the
    labels it joins. `source` says where the spec came from, for error messages only."""

    labels: Mapping[str, int]
    ignore: int | None = None
    regions: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    source: str = field(default=KAGGLE_SOURCE, compare=False)

    def __post_init__(self) -> None:
        where = self.source
        labels = {str(k): v for k, v in dict(self.labels).items()}
        for name, value in labels.items():
            _check_value(value, f"{where}: labels.{name}")
        if labels.get(BACKGROUND) != 0:
            raise CtsegError(
                f"{where}: labels: background must be 0 (found "
                f"{labels.get(BACKGROUND, 'none')}); nnU-Net's convention, and ctseg's"
            )
        seen: dict[int, str] = {}
        for name, value in labels.items():
            if value in seen:
                raise CtsegError(
                    f"{where}: labels: {seen[value]} and {name} both have the value {value}; "
                    "give each label its own value"
                )
            seen[value] = name
        if len(labels) < 2:
            raise CtsegError(
                f"{where}: labels: only background; give at least one foreground label "
                "(e.g. surface: 1)"
            )
        if self.ignore is not None:
            _check_value(self.ignore, f"{where}: ignore")
            if self.ignore in seen:
                raise CtsegError(
                    f"{where}: ignore: {self.ignore} is also the value of label "
                    f"{seen[self.ignore]}; the ignored value must be one no label uses"
                )
        ordered = dict(sorted(labels.items(), key=lambda item: item[1]))
        regions: dict[str, tuple[str, ...]] = {}
        for name, members in dict(self.regions).items():
            regions[str(name)] = _region_members(str(name), members, ordered, where)
        object.__setattr__(self, "labels", ordered)
        object.__setattr__(self, "regions", regions)

    def __hash__(self) -> int:
        return hash((tuple(self.labels.items()), self.ignore, tuple(self.regions.items())))

    # ------------------------------------------------------------------ what the code needs
    @property
    def background(self) -> int:
        return self.labels[BACKGROUND]

    @property
    def classes(self) -> tuple[str, ...]:
        """The foreground labels' names in value order (neither background nor ignore)."""
        return tuple(name for name in self.labels if name != BACKGROUND)

    @property
    def foreground_values(self) -> tuple[int, ...]:
        return tuple(self.labels[name] for name in self.classes)

    @property
    def is_binary(self) -> bool:
        """One foreground class: the task is foreground against background."""
        return len(self.classes) == 1

    @property
    def foreground_value(self) -> int:
        """The one foreground value of a binary spec."""
        if not self.is_binary:
            raise CtsegError(
                f"{self.source}: {len(self.classes)} foreground labels "
                f"({', '.join(self.classes)}); this step handles one foreground label only"
            )
        return self.foreground_values[0]

    @property
    def valid_values(self) -> tuple[int, ...]:
        """Every value a label volume may hold, ascending."""
        values = list(self.labels.values())
        if self.ignore is not None:
            values.append(self.ignore)
        return tuple(sorted(values))

    @property
    def n_classes(self) -> int:
        """K, the number of foreground classes (1 for a binary spec)."""
        return len(self.classes)

    @property
    def out_channels(self) -> int:
        """A network's output channels for this spec: 1 (sigmoid) when binary, else K+1
        (softmax, background first)."""
        return 1 if self.is_binary else self.n_classes + 1

    # ------------------------------------------------------------------ stored values
    def stored(self) -> LabelSpec:
        """The spec of the values `ctseg convert --kind label` stores: background 0, the classes
        1..K in this spec's value order (names kept), the ignored value (if any) K+1. The Kaggle
        spec's stored spec is itself."""
        labels = {BACKGROUND: 0} | {name: i + 1 for i, name in enumerate(self.classes)}
        ignore = None if self.ignore is None else self.n_classes + 1
        stored = LabelSpec(labels=labels, ignore=ignore, regions=dict(self.regions))
        object.__setattr__(stored, "source", f"{self.source} (stored values)")
        return stored if stored != self else self

    def _values(self) -> list[int]:
        return list(self.labels.values()) + ([self.ignore] if self.ignore is not None else [])

    def _map(self, array: Any, to_stored: bool, path: str | Path) -> np.ndarray:
        stored = self.stored()
        source, target = (self, stored) if to_stored else (stored, self)
        table = np.zeros(MAX_VALUE + 1, dtype=np.uint8)
        known = np.zeros(MAX_VALUE + 1, dtype=bool)
        table[source._values()] = target._values()
        known[source._values()] = True
        values = np.asarray(array)
        if values.dtype != np.uint8:
            if not np.issubdtype(values.dtype, np.integer):
                raise CtsegError(
                    f"{path}: label values of type {values.dtype}; label volumes hold integers "
                    f"0..{MAX_VALUE}; convert the volume to uint8"
                )
            outside = (values < 0) | (values > MAX_VALUE)
            if outside.any():
                source.check_values(np.unique(values[outside]), path)
            values = values.astype(np.uint8)
        bad = ~known[values]
        if bad.any():
            source.check_values(np.unique(values[bad]), path)
        return table[values]

    def to_stored(self, array: Any, path: str | Path = "label volume") -> np.ndarray:
        """`array` (this spec's values) as stored uint8 values (`stored`); a value outside the spec
        is refused with `check_values`' one-line error naming `path`."""
        return self._map(array, True, path)

    def from_stored(self, array: Any, path: str | Path = "label volume") -> np.ndarray:
        """`array` (stored values, `stored`) as this spec's uint8 values: the inverse of
        `to_stored`; a value outside the stored spec is refused naming `path`."""
        return self._map(array, False, path)

    def region_values(self, region: str) -> tuple[int, ...]:
        return tuple(self.labels[name] for name in self.regions[region])

    def foreground(self, label: Any) -> Any:
        """A bool mask (numpy or torch, as `label` is) of the foreground voxels: ``label == 1``
        for the Kaggle spec; any foreground class for a spec with several."""
        return _any_equal(label, self.foreground_values)

    def ignored(self, label: Any) -> Any:
        """A bool mask of the ignored voxels (``label == 2`` for the Kaggle spec); all False
        where the spec has no ignored value."""
        if self.ignore is None:
            return _all_false(label)
        return label == self.ignore

    def in_region(self, label: Any, region: str) -> Any:
        return _any_equal(label, self.region_values(region))

    def describe(self) -> str:
        """The values and their meaning, "0 background, 1 surface, 2 unlabelled"."""
        parts = [f"{value} {name}" for name, value in self.labels.items()]
        if self.ignore is not None:
            parts.append(f"{self.ignore} unlabelled")
        return ", ".join(sorted(parts, key=lambda part: int(part.split()[0])))

    def values_text(self, sep: str = "/") -> str:
        """The valid values joined, "0/1/2" (sep "/") or "0, 1, 2"."""
        return sep.join(str(v) for v in self.valid_values)

    def invalid(self, values: Iterable[Any]) -> list[Any]:
        """The values (ascending, once each) that the spec does not allow."""
        present = np.unique(np.asarray(list(values) if not hasattr(values, "shape") else values))
        return present[~np.isin(present, self.valid_values)].tolist()

    def check_values(self, values: Iterable[Any], path: str | Path, fix: str | None = None) -> None:
        """One-line CtsegError naming `path`, the values outside the spec and the spec, unless
        every value in `values` (an array or the distinct values) is valid. `fix` says what to
        do; by default: fix the file, or the labels where the spec came from."""
        bad = self.invalid(values)
        if not bad:
            return
        limit = 6
        shown = ", ".join(f"{v:g}" for v in bad[:limit]) + (", ..." if len(bad) > limit else "")
        hint = fix or f"fix the volume, or declare the values in {self._fix_place()}"
        raise CtsegError(
            f"{path}: label values outside {self.values_text()}: [{shown}] "
            f"({self.describe()}); {hint}"
        )

    def _fix_place(self) -> str:
        if self.source == KAGGLE_SOURCE:
            return f"the dataset's {DATASET_FILE} (without one: {self.describe()})"
        return self.source

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"labels": dict(self.labels), "ignore": self.ignore}
        if self.regions:
            out["regions"] = {name: list(members) for name, members in self.regions.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = KAGGLE_SOURCE) -> LabelSpec:
        return cls(
            labels=dict(data["labels"]),
            ignore=data.get("ignore"),
            regions={k: tuple(v) for k, v in (data.get("regions") or {}).items()},
            source=source,
        )


KAGGLE = LabelSpec(labels={BACKGROUND: 0, "surface": 1}, ignore=2)


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset's labels and its voxel spacing (z, y, x; None: not given, taken as isotropic)."""

    labels: LabelSpec = KAGGLE
    spacing: tuple[float, float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "labels": self.labels.to_dict(),
            "spacing": list(self.spacing) if self.spacing is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DatasetSpec:
        spacing = data.get("spacing")
        return cls(
            labels=LabelSpec.from_dict(data["labels"]),
            spacing=_spacing(spacing, "spacing") if spacing is not None else None,
        )


def load_dataset_spec(dataset_dir: str | Path) -> DatasetSpec:
    """`dataset_dir`/dataset.yaml as a DatasetSpec, every field checked with a one-line error
    naming the file and the key; the Kaggle spec and no spacing without the file."""
    path = Path(dataset_dir) / DATASET_FILE
    if not path.is_file():
        return DatasetSpec(KAGGLE, None)
    data = read_yaml(path)
    if not isinstance(data, Mapping):
        raise CtsegError(
            f"{path}: expected a mapping with labels (and optionally {', '.join(KEYS[1:])}); "
            f"found {_kind(data)}"
        )
    unknown = sorted(str(k) for k in data if k not in KEYS)
    if unknown:
        name = unknown[0]
        close = closest(name, KEYS)
        hint = f"did you mean {' or '.join(close)}?" if close else f"it takes {', '.join(KEYS)}"
        others = f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
        raise CtsegError(f"{path}: {name}: unknown key; {hint}{others}")
    if "labels" not in data:
        raise CtsegError(
            f"{path}: labels: missing; give e.g. labels: {{background: 0, surface: 1}}"
        )
    labels = data["labels"]
    if not isinstance(labels, Mapping) or not labels:
        raise CtsegError(
            f"{path}: labels: expected a mapping of name: value such as "
            f"{{background: 0, surface: 1}}; found {_kind(labels)}"
        )
    for name in labels:
        if not isinstance(name, str):
            raise CtsegError(f"{path}: labels: label name {name!r} is not text; name each label")
        if name == "ignore":
            raise CtsegError(
                f"{path}: labels.ignore: the ignored value is a key of its own; move it to the "
                f"top level as `ignore: {labels[name]}`"
            )
    regions = data.get("regions") or {}
    if not isinstance(regions, Mapping):
        raise CtsegError(
            f"{path}: regions: expected a mapping of name: [labels] such as "
            f"{{sheet: [surface]}}; found {_kind(regions)}"
        )
    spacing = data.get("spacing")
    spec = LabelSpec(
        labels=dict(labels),
        ignore=data.get("ignore"),
        regions=dict(regions),
        source=str(path),
    )
    return DatasetSpec(spec, _spacing(spacing, f"{path}: spacing") if spacing is not None else None)
