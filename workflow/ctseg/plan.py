"""The run plan: one typed, versioned record per run, ``results/plans/<run>.json``, the contract
between the workflow's planning and the steps of that run (modelled on nnU-Net v2's plans file).

Planning (`ctseg.planning.build`) resolves it once from the dataset and the configuration:

- ``dataset``: the label spec (`ctseg.labels.LabelSpec`) and the voxel spacing, with where the
  spacing came from (dataset.yaml, the TIFFs' own tags, or isotropic where neither says);
- ``experiment``: the experiment with every default filled in from the schema, its fold applied
  and its patch resolved (``data.patch_size: auto`` planned from the spacing);
- ``patch``: the patch trained and the patch the network computes (a multiple of its
  downsampling), and whether it was planned;
- ``phase``: the configured phase (an id, or ``auto``) and, for a fixed id, its settings. Under
  ``auto`` the train job chooses after the trials; train/settings.json records the id it chose.

Each section has a digest (`RunPlan.digest`): a rule passes the digests of the sections its step
reads as params, so Snakemake reruns exactly the jobs whose sections changed, whatever else of
the plan moved. `write_plan` leaves an unchanged plan's file untouched.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctseg.config import Experiment, Phase, experiment_from, phases_from, thaw
from ctseg.io import CtsegError, atomic_path, strict_json
from ctseg.labels import LabelSpec

PLAN_VERSION = 1
SECTIONS = ("dataset", "experiment", "patch", "phase")
Shape3 = tuple[int, int, int]
Spacing = tuple[float, float, float]
ISOTROPIC: Spacing = (1.0, 1.0, 1.0)


@dataclass(frozen=True)
class DatasetPlan:
    """The dataset's labels and voxel spacing (z, y, x), and where the spacing came from."""

    labels: LabelSpec
    spacing: Spacing
    spacing_source: str  # "dataset.yaml", "TIFF tags" or "isotropic (nothing records one)"

    @property
    def relative_spacing(self) -> Spacing:
        """The spacing in units of its finest axis: what the metrics' tolerances (in voxels of
        that axis) and the augmentation's symmetries read."""
        finest = min(self.spacing)
        return tuple(s / finest for s in self.spacing)  # type: ignore[return-value]

    @property
    def isotropic(self) -> bool:
        return len(set(self.spacing)) == 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "labels": self.labels.to_dict(),
            "spacing": list(self.spacing),
            "spacing_source": self.spacing_source,
        }

    def digest(self, *keys: str) -> str:
        """A short digest of the named values (``labels``, ``spacing``; both without names):
        what a per-volume rule passes as a param, so its job reruns when they change and not
        when only the spacing's recorded source does."""
        values = {k: v for k, v in self.to_dict().items() if k != "spacing_source"}
        unknown = [k for k in keys if k not in values]
        if unknown:
            raise CtsegError(f"dataset plan: no value {unknown[0]!r}; values: {list(values)}")
        return _digest({k: values[k] for k in (keys or values)})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DatasetPlan:
        return cls(
            labels=LabelSpec.from_dict(data["labels"], source="the run plan"),
            spacing=_triple(data["spacing"], float),
            spacing_source=str(data["spacing_source"]),
        )


@dataclass(frozen=True)
class PatchPlan:
    """The patch a run trains on, and the one its network computes (each axis padded to a
    multiple of the network's downsampling); `planned`: chosen from the spacing (``auto``)."""

    size: Shape3
    computed: Shape3
    planned: bool

    def to_dict(self) -> dict[str, Any]:
        return {"size": list(self.size), "computed": list(self.computed), "planned": self.planned}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PatchPlan:
        return cls(_triple(data["size"], int), _triple(data["computed"], int), data["planned"])


@dataclass(frozen=True)
class PhasePlan:
    """The configured phase: an id of config/phases.yaml with its settings, or ``auto`` (no
    settings: the train job chooses among the trials)."""

    configured: int | str
    settings: Phase | None

    @property
    def id(self) -> int | None:
        return self.configured if isinstance(self.configured, int) else None

    def to_dict(self) -> dict[str, Any]:
        settings = None if self.settings is None else dict(self.settings)
        return {"configured": self.configured, "settings": settings}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PhasePlan:
        configured = data["configured"]
        settings = data.get("settings")
        phase = None
        if settings is not None:
            number = int(configured)
            phase = phases_from({"phases": {number: settings}}, "run plan: phase")[number]
        return cls(configured, phase)


@dataclass(frozen=True)
class RunPlan:
    """One run's plan (module docstring)."""

    run: str
    dataset: DatasetPlan
    experiment: Experiment
    patch: PatchPlan
    phase: PhasePlan
    version: int = PLAN_VERSION

    def sections(self) -> dict[str, Any]:
        """Each section as plain JSON data."""
        return {
            "dataset": self.dataset.to_dict(),
            "experiment": thaw(self.experiment),
            "patch": self.patch.to_dict(),
            "phase": self.phase.to_dict(),
        }

    def digest(self, *names: str) -> str:
        """A short digest of the named sections (all of them without names): what a rule
        passes as a param so that its job reruns when, and only when, those sections change."""
        sections = self.sections()
        unknown = [n for n in names if n not in sections]
        if unknown:
            raise CtsegError(f"run plan: no section {unknown[0]!r}; sections: {list(SECTIONS)}")
        return _digest({n: sections[n] for n in (names or SECTIONS)})

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "run": self.run, **self.sections()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "run plan") -> RunPlan:
        version = data.get("version")
        if version != PLAN_VERSION:
            raise CtsegError(
                f"{where}: plan version {version!r}, this ctseg reads version {PLAN_VERSION}; "
                "rerun the workflow to write it again"
            )
        missing = [key for key in ("run", *SECTIONS) if key not in data]
        if missing:
            raise CtsegError(f"{where}: not a run plan (no {missing[0]!r}); rerun the workflow")
        return cls(
            run=str(data["run"]),
            dataset=DatasetPlan.from_dict(data["dataset"]),
            experiment=experiment_from(data["experiment"], f"{where}: experiment"),
            patch=PatchPlan.from_dict(data["patch"]),
            phase=PhasePlan.from_dict(data["phase"]),
            version=version,
        )


def _digest(data: Mapping[str, Any]) -> str:
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _triple(values: Any, kind: type) -> Any:
    if not isinstance(values, list | tuple) or len(values) != 3:
        raise CtsegError(f"run plan: expected three values (z, y, x), found {values!r}")
    return tuple(kind(v) for v in values)


def plan_text(plan: RunPlan) -> str:
    return strict_json(plan.to_dict(), indent=1, sort_keys=True, default=str) + "\n"


def write_plan(path: str | Path, plan: RunPlan) -> bool:
    """Write `plan` to `path` atomically; an unchanged plan leaves the file (and its time)
    as it is. Returns whether it wrote."""
    path = Path(path)
    text = plan_text(plan)
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return True


def write_dataset_plan(path: str | Path, plan: DatasetPlan) -> bool:
    """The dataset's plan (`DatasetPlan`) beside its runs, for the steps that run per volume
    rather than per run (convert, targets, evaluation); unchanged, the file is left as is."""
    path = Path(path)
    text = strict_json({"version": PLAN_VERSION, **plan.to_dict()}, indent=1, sort_keys=True)
    try:
        if path.read_text() == text + "\n":
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(text + "\n")
    return True


def read_dataset_plan(path: str | Path) -> DatasetPlan:
    """A dataset plan written by `write_dataset_plan`, checked as `read_plan` checks a run's."""
    data = _read_json(Path(path), "dataset plan")
    if data.get("version") != PLAN_VERSION:
        raise CtsegError(
            f"{path}: dataset plan version {data.get('version')!r}, this ctseg reads version "
            f"{PLAN_VERSION}; rerun snakemake to write it again"
        )
    try:
        return DatasetPlan.from_dict(data)
    except (KeyError, TypeError) as exc:
        raise CtsegError(f"{path}: not a dataset plan ({exc}); rerun snakemake") from exc


def _read_json(path: Path, what: str) -> Mapping[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CtsegError(
            f"{path}: cannot read the {what} ({exc.strerror or exc}); the workflow writes it: "
            "rerun snakemake"
        ) from exc
    except json.JSONDecodeError as exc:
        raise CtsegError(
            f"{path}: the {what} is not valid JSON (line {exc.lineno}); delete it and rerun "
            "snakemake"
        ) from exc
    if not isinstance(data, Mapping):
        raise CtsegError(f"{path}: not a {what}; delete it and rerun snakemake")
    return data


def read_plan(path: str | Path) -> RunPlan:
    """A run's plan (results/plans/<run>.json), checked: a missing, damaged or other-version
    file is one line naming it and the fix."""
    return RunPlan.from_dict(_read_json(Path(path), "run plan"), str(path))
