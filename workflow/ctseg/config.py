"""The one place that reads and checks ctseg's settings.

config/config.yaml, config/experiments/<name>.yaml and config/phases.yaml are validated
against the JSON schemas in workflow/schemas/ (the same files Snakemake's `validate()` uses);
every default is the schema's, filled in here and nowhere else. What comes back is frozen:

- `Experiment` and `Phase`: typed dataclasses whose sections are read-only mappings, so a
  step cannot change a setting that another step (or the run identity) relies on. Both can
  also be read like the mappings they were loaded from (``exp["train"]["lr"]``).
- `load_config` returns the workflow config as a read-only mapping with its defaults.

The rules hand `ctseg` the file paths and a phase id; each command loads what it needs
through this module, so a setting is parsed once, by the same code, wherever it is used.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ctseg.io import CtsegError

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
# Where the workflow reads its settings (relative to the working directory, as Snakemake runs).
CONFIG_FILE = "config/config.yaml"
PHASES_FILE = "config/phases.yaml"
EXPERIMENTS_DIR = Path("config/experiments")
ENSEMBLES_DIR = Path("config/ensembles")


class SettingError(CtsegError):
    """A value a schema refuses. `key` is where it sits (``("infer", "threshold")``) and `value`
    what it is, for a caller that can say more than the schema about what the key may be."""

    def __init__(self, message: str, key: tuple[str, ...], value: Any) -> None:
        super().__init__(message)
        self.key = key
        self.value = value


class Frozen(dict):
    """A dict that refuses changes (a plain dict to json, pandas and torch's loaders)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("settings are read-only; copy them with dict(...) to change one")

    __setitem__ = __delitem__ = _refuse
    clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple:  # copy and pickle build it whole, never item by item
        return (Frozen, (dict(self),))


def freeze(value: Any) -> Any:
    """Mappings become `Frozen`, recursively; lists stay lists of frozen items."""
    if isinstance(value, Mapping):
        return Frozen({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return [freeze(v) for v in value]
    return value


def thaw(value: Any) -> Any:
    """Plain dicts and lists again (for writing YAML or JSON by hand)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [thaw(v) for v in value]
    return value


# ----------------------------------------------------------------------------- validation
def _filling_validator() -> type:
    """Draft 2020-12, where checking an object's ``properties`` first fills the defaults of
    the ones that are missing (so nested sections get theirs too)."""
    base = jsonschema.Draft202012Validator
    check_properties = base.VALIDATORS["properties"]

    def properties(validator: Any, props: Mapping, instance: Any, schema: Mapping) -> Iterator:
        if isinstance(instance, dict):
            for name, sub in props.items():
                if isinstance(sub, Mapping) and "default" in sub and name not in instance:
                    instance[name] = thaw(sub["default"])
        yield from check_properties(validator, props, instance, schema)

    return jsonschema.validators.extend(base, {"properties": properties})


FillingValidator = _filling_validator()


def schema(name: str) -> dict[str, Any]:
    return read_yaml(SCHEMAS / f"{name}.schema.yaml")


def validated(data: Any, schema_name: str, where: str) -> dict[str, Any]:
    """`data` (a copy) with the schema's defaults filled in; an error names `where` and the key."""
    data = thaw(data if data is not None else {})
    errors = sorted(
        FillingValidator(schema(schema_name)).iter_errors(data), key=lambda e: list(e.path)
    )
    if errors:
        first = errors[0]
        path = tuple(str(p) for p in first.absolute_path)
        if first.validator == "additionalProperties":
            raise unknown_key_error(first, path, where)
        key = ".".join(path) or "(top level)"
        raise SettingError(f"{where}: {key}: {first.message}", path, first.instance)
    return data


def closest(name: str, valid: Sequence[str]) -> list[str]:
    """The valid names closest to `name` (difflib's ratio, its default cutoff of 0.6): all of
    those that tie for the best, as `trian` is as close to `train` as to `trial`."""
    close = difflib.get_close_matches(name, valid, n=len(valid))
    if not close:
        return []
    best = difflib.SequenceMatcher(None, name, close[0]).ratio()
    return [c for c in close if difflib.SequenceMatcher(None, name, c).ratio() == best]


def unknown_key_error(
    error: jsonschema.ValidationError, path: tuple[str, ...], where: str
) -> SettingError:
    """A key the schema does not define, named with its closest valid key (a typo such as
    `patch_sise`), or else with the keys its section takes."""
    valid = sorted(error.schema.get("properties", {}))
    unknown = sorted(str(k) for k in error.instance if k not in valid)
    name = unknown[0]
    key = (*path, name)
    close = closest(name, valid)
    section = ".".join(path) or "the top level"
    takes = f"{section} takes {', '.join(valid)}"
    hint = f"did you mean {' or '.join(close)}?" if close else takes
    others = f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
    return SettingError(
        f"{where}: {'.'.join(key)}: unknown key; {hint}{others}", key, error.instance[name]
    )


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data (as yaml.safe_load reads it), refusing a key given twice in one
    mapping: YAML keeps the last, so a second `train:` block would silently drop every key of
    the first (and the schema would then fill in its defaults)."""
    path = Path(path)
    try:
        loader = yaml.SafeLoader(path.read_text())
    except FileNotFoundError as exc:
        raise CtsegError(f"{path}: file not found") from exc
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_unique_keys(loader, node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise CtsegError(
            f"{yaml_position(path, exc)}: not valid YAML: {yaml_problem(exc)}"
        ) from exc
    finally:
        loader.dispose()


def check_unique_keys(loader: yaml.SafeLoader, node: yaml.Node, path: Path) -> None:
    """Every mapping under `node`, at any depth, has each key once (a `<<` merge key may
    override what it merges: that is YAML's way of doing so on purpose)."""
    seen_nodes: set[int] = set()

    def walk(node: yaml.Node, where: tuple[str, ...]) -> None:
        if id(node) in seen_nodes:  # an alias of a node checked already
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    walk(value_node, where)
                    continue
                key = loader.construct_object(key_node, deep=True)
                try:
                    earlier = first_line.get(key)
                except TypeError:  # an unhashable key: PyYAML refuses it itself
                    continue
                line = key_node.start_mark.line + 1
                name = ".".join((*where, str(key)))
                if earlier is not None:
                    raise CtsegError(
                        f"{path}:{line}: key {name!r} appears twice (first at line {earlier}); "
                        "YAML would keep only this one and drop the first silently: merge the "
                        "two into one"
                    )
                first_line[key] = line
                walk(value_node, (*where, str(key)))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                walk(item, (*where, str(index)))

    walk(node, ())


def yaml_position(path: Path, exc: yaml.YAMLError) -> str:
    """path:line:column of a YAML error (1-based, as editors count), or the path alone."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)


def yaml_problem(exc: yaml.YAMLError) -> str:
    parts = [getattr(exc, "context", None), getattr(exc, "problem", None)]
    text = "; ".join(p for p in parts if p) or str(exc)
    return " ".join(text.split())


def command_line_values(config: dict[str, Any]) -> dict[str, Any]:
    """Snakemake reads the top-level values of `--config KEY=VALUE` as YAML but leaves the
    values of a nested mapping as text (`--config 'infer={threshold: 0.3}'` gives '0.3', which
    the schema then refuses). Read such nested text as a YAML scalar again, in place; a value
    that is not a number, boolean or null stays text."""

    def scalar(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: scalar(v) for k, v in value.items()}
        if isinstance(value, list):
            return [scalar(v) for v in value]
        if isinstance(value, str):
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                return value
            if parsed is None or isinstance(parsed, bool | int | float):
                return parsed if value.strip() not in ("", "~") else value
        return value

    for key, value in list(config.items()):
        if isinstance(value, Mapping):
            config[key] = scalar(value)
    return config


# ----------------------------------------------------------------------------- objects
class _Readable(Mapping):
    """Item access over a dataclass's fields, so settings read as they were written."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def _keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, eq=False)
class Experiment(_Readable):
    """One experiment (config/experiments/<name>.yaml), validated, defaults filled."""

    name: str
    subset: Mapping[str, Any]
    split: Mapping[str, Any]
    source: str | None
    scratch_format: str
    data: Mapping[str, Any]
    model: Mapping[str, Any]
    loss: Mapping[str, Any]
    train: Mapping[str, Any]
    trial: Mapping[str, Any]
    # The run whose final weights a fine-tune starts from (its last.pt; the workflow builds it).
    init_from: str | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and thaw(self) == thaw(other)

    __hash__ = None  # type: ignore[assignment]


@dataclasses.dataclass(frozen=True, eq=False)
class Phase(_Readable):
    """One loader/training phase of config/phases.yaml, as the file defines it (plus the
    schema's defaults). `gpus` is None where the phase leaves it to the experiment."""

    workers: int
    batch_size: int
    prefetch_factor: int
    persistent_workers: bool
    pin_memory: bool
    mp_context: str
    drop_last: bool
    device_prefetch: bool
    precision: str
    channels_last: bool
    compile: bool
    accumulate: int = 1
    compile_mode: str = "default"
    fused_optimizer: bool = True
    gpus: int | None = None

    def _keys(self) -> tuple[str, ...]:
        # A phase that leaves gpus to the experiment does not list it (as in the file).
        names = super()._keys()
        return names if self.gpus is not None else tuple(n for n in names if n != "gpus")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self) == dict(other)

    __hash__ = None  # type: ignore[assignment]


def experiment_from(data: Mapping[str, Any], where: str) -> Experiment:
    """An `Experiment` from a mapping (as read from YAML), validated against its schema."""
    if isinstance(data, Experiment):
        return data
    if not isinstance(data, Mapping):
        raise CtsegError(f"{where}: expected a mapping of experiment settings")
    checked = validated(data, "experiment", where)
    return Experiment(
        **{f.name: freeze(checked.get(f.name)) for f in dataclasses.fields(Experiment)}
    )


def load_experiment(path: str | Path) -> Experiment:
    """config/experiments/<name>.yaml, with `extends` resolved; its `name` must be the file's
    name. What comes back are the effective settings: the ones the run identity, the rules'
    `settings` params and the report use."""
    path = Path(path)
    exp = experiment_from(extended(path), str(path))
    if exp.name != path.stem:
        raise CtsegError(f"{path}: name {exp.name!r} differs from the file name {path.stem!r}")
    if not RUN_NAME.fullmatch(path.stem):
        raise CtsegError(
            f"{path}: an experiment's file name may hold only letters, digits, _ and - "
            "(a '.' would be read as <experiment>.fold<i>); rename the file and its name"
        )
    folds = exp.split.get("folds")
    if folds is not None and folds < 2:
        raise CtsegError(
            f"{path}: split.folds: {folds} is below 2: cross-validation needs at least 2 "
            "folds (or remove split.folds)"
        )
    if exp.split.get("fold") is not None:
        raise CtsegError(
            f"{path}: split.fold is set by the run name <experiment>.fold<i> "
            "(e.g. results/exp001.fold1/last.pt), not in the file; remove it"
        )
    return exp


def extended(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The file's settings over those of the experiment it `extends` (recursively): mappings
    merge key by key, anything else (lists included) is replaced whole."""
    data = read_yaml(path) or {}
    if not isinstance(data, Mapping):
        raise CtsegError(f"{path}: expected a mapping of experiment settings")
    data = thaw(data)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not RUN_NAME.fullmatch(parent):
        raise CtsegError(f"{path}: extends: expected an experiment name, got {parent!r}")
    parent_path = path.parent / f"{parent}.yaml"
    if parent_path.resolve() in seen or parent_path.resolve() == path.resolve():
        chain = " -> ".join(p.stem for p in (*seen, path.resolve(), parent_path.resolve()))
        raise CtsegError(f"{path}: extends: a cycle ({chain})")
    if not parent_path.exists():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise CtsegError(f"{path}: extends: {parent_path} does not exist (experiments: {known})")
    base = extended(parent_path, (*seen, path.resolve()))
    return merged(base, data)


def merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


# An experiment's name (and file stem); a run is an experiment, or one of its folds.
RUN_NAME = re.compile(r"[A-Za-z0-9_-]+")
FOLD_RUN = re.compile(r"(?P<experiment>[A-Za-z0-9_-]+)\.fold(?P<fold>[0-9]+)")


def with_fold(exp: Experiment, fold: int, where: str = "--fold") -> Experiment:
    """Fold `fold` of an experiment that declares split.folds: named <name>.fold<i>, with that
    fold held out as its val split (`ctseg.records.select_records`)."""
    folds = exp.split.get("folds")
    if folds is None:
        raise CtsegError(
            f"{where}: experiment {exp.name!r} declares no split.folds, so it has no fold {fold}"
        )
    if not 0 <= fold < folds:
        raise CtsegError(
            f"{where}: fold {fold} is out of range: "
            f"experiment {exp.name!r} has folds 0..{folds - 1}"
        )
    split = {**thaw(exp.split), "fold": fold}
    return dataclasses.replace(exp, name=f"{exp.name}.fold{fold}", split=freeze(split))


def load_run(experiments_dir: str | Path, run: str) -> Experiment:
    """The experiment a run name stands for: <name> or <name>.fold<i>."""
    found = FOLD_RUN.fullmatch(run)
    name = found["experiment"] if found else run
    path = Path(experiments_dir) / f"{name}.yaml"
    exp = load_experiment(path)
    return with_fold(exp, int(found["fold"]), str(path)) if found else exp


def phases_from(data: Mapping[str, Any], where: str) -> dict[int, Phase]:
    """Every phase of a phases mapping (``{"phases": {0: {...}, ...}}``), by number."""
    if not isinstance(data, Mapping):
        raise CtsegError(f"{where}: expected a mapping with the key 'phases'")
    raw = dict(data)
    # YAML reads the phase numbers as ints; JSON schema keys are strings.
    raw["phases"] = {str(k): v for k, v in (raw.get("phases") or {}).items()}
    checked = validated(raw, "phases", where)
    return {
        int(k): Phase(**v) for k, v in sorted(checked["phases"].items(), key=lambda kv: int(kv[0]))
    }


def load_phases(path: str | Path) -> dict[int, Phase]:
    return phases_from(read_yaml(path) or {}, str(path))


def select_phase(phases: Mapping[int, Phase], phase: int | str, where: str) -> tuple[int, Phase]:
    """Phase `phase` (a number, possibly as text) of `phases`, with a clear error if absent."""
    try:
        number = int(phase)
    except (TypeError, ValueError) as exc:
        raise CtsegError(f"phase {phase!r}: expected a phase number") from exc
    if number not in phases:
        raise CtsegError(f"{where}: phase {number} is not defined (it defines {sorted(phases)})")
    return number, phases[number]


def check_configured_phase(phase: Any, phases: Mapping[int, Phase]) -> None:
    """Config `phase`: auto, or a phase of `phases` as a whole number. The schema takes 3.0 for
    an integer and 3.0 in `phases` is true, so without this the train job would be the first to
    refuse it."""
    if phase == "auto":
        return
    if isinstance(phase, bool) or not isinstance(phase, int):
        raise CtsegError(
            f"config 'phase': {phase!r} is not a phase number: {PHASES_FILE} defines "
            f"{sorted(phases)}; choose one of them (as 3, not 3.0), or auto"
        )
    if phase not in phases:
        raise CtsegError(
            f"config 'phase': {phase} is not in {PHASES_FILE} (it defines {sorted(phases)}); "
            "choose one of them, or auto"
        )


def check_trial_phases(exp: Experiment, phases: Mapping[int, Phase], exp_path: str) -> None:
    unknown = [p for p in exp.trial["phases"] if p not in phases]
    if unknown:
        raise CtsegError(
            f"{exp_path}: trial.phases names phase(s) {unknown} that config/phases.yaml does "
            f"not define (it defines {sorted(phases)})"
        )


def load_config(data: Mapping[str, Any], where: str = "config/config.yaml") -> Frozen:
    """The workflow config (config/config.yaml plus any --config), defaults filled."""
    return freeze(validated(data, "config", where))


# ----------------------------------------------------------------------------- what a job uses
def settings_used(exp: Experiment, phase: Phase | None, step: str) -> dict[str, Any]:
    """The settings one workflow step reads, as plain data: a rule passes this as a param, so
    that Snakemake reruns the step when one of them changes and not on any other edit."""
    sections = {
        "split": ("subset", "split"),
        "stage": ("source", "scratch_format"),
        "trial": ("scratch_format", "data", "model", "loss", "train", "trial"),
        "train": ("scratch_format", "data", "model", "loss", "train"),
    }
    if step not in sections:
        raise CtsegError(f"settings_used: unknown step {step!r}; expected one of {list(sections)}")
    used: dict[str, Any] = {key: thaw(exp[key]) for key in sections[step]}
    if phase is not None:
        used["phase"] = thaw(dict(phase))
    return used


def configured_gpus(exp: Mapping[str, Any], phase: Mapping[str, Any]) -> int:
    """GPUs (torchrun processes) a run trains on: the phase's ``gpus`` where it sets one, else
    the experiment's ``train.gpus``, else 1."""
    return int(phase.get("gpus") or exp["train"].get("gpus") or 1)


# ----------------------------------------------------------------------------- ensembles
# config/ensembles/<name>.yaml: members (experiments or folds) and their weights, or tuned.
# Run names as ctseg.config spells them: <experiment> or <experiment>.fold<i>.
FOLD_MEMBER = re.compile(r"(?P<experiment>[A-Za-z0-9_-]+)\.fold(?P<fold>[0-9]+)")


# Which runs exist: experiment name -> its split.folds (None: no folds), a set of names (none
# with folds), or a callable giving the folds and raising KeyError for an unknown name.
KnownRuns = Mapping[str, int | None] | Collection[str] | Callable[[str], int | None]


class LazyFolds(Mapping[str, int | None]):
    """`KnownRuns` for experiments loaded only when asked: name -> its split.folds, through
    `folds_of`. An ensemble is then checked against the experiments it names, and a broken
    file of an experiment it does not name is no concern of its."""

    def __init__(self, names: Collection[str], folds_of: Callable[[str], int | None]) -> None:
        self.names = sorted(names)
        self.folds_of = folds_of

    def __getitem__(self, name: str) -> int | None:
        if name not in self.names:
            raise KeyError(name)
        return self.folds_of(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class Member:
    name: str  # as written: exp001 or exp001.fold2
    experiment: str
    fold: int | None


@dataclass(frozen=True)
class Ensemble:
    name: str
    members: tuple[Member, ...]
    weights: tuple[float, ...] | None  # None: tuned
    tune_step: float
    path: str

    @property
    def tuned(self) -> bool:
        return self.weights is None

    @property
    def member_names(self) -> list[str]:
        return [m.name for m in self.members]


def default_step(n_members: int) -> float:
    """The tuning grid's step: 0.25 up to 4 members (at most 35 points), 0.5 above."""
    return 0.25 if n_members <= 4 else 0.5


def _folds_of(known: KnownRuns) -> Callable[[str], int | None]:
    if isinstance(known, Mapping):
        return lambda name: known[name]
    if callable(known):
        return known
    names = set(known)

    def lookup(name: str) -> int | None:
        if name not in names:
            raise KeyError(name)
        return None

    return lookup


def _known_list(known: KnownRuns) -> str:
    if callable(known) and not isinstance(known, Mapping):
        return ""
    return f" (experiments: {', '.join(sorted(known)) or 'none'})"


def check_weights(weights: Sequence[float], n_members: int, where: str) -> list[float]:
    """The weights divided by their sum; a wrong count, a negative, non-finite or all-zero list
    is a one-line error naming `where`."""
    values = list(weights)
    if len(values) != n_members:
        raise CtsegError(
            f"{where}: {len(values)} weights for {n_members} members: give one per member"
        )
    if any(isinstance(w, bool) or not isinstance(w, int | float) for w in values):
        raise CtsegError(f"{where}: weights {values}: expected numbers")
    if any(not math.isfinite(w) for w in values):
        raise CtsegError(f"{where}: weights {values}: expected finite numbers")
    if any(w < 0 for w in values):
        raise CtsegError(f"{where}: negative weight in {values}: weights must be >= 0")
    total = float(sum(values))
    if total <= 0:
        raise CtsegError(f"{where}: weights {values} are all zero: give at least one > 0")
    return [float(w) / total for w in values]


def _member(
    text: str, folds_of: Callable[[str], int | None], known: KnownRuns, where: str
) -> Member:
    found = FOLD_MEMBER.fullmatch(text)
    experiment = found["experiment"] if found else text
    try:
        folds = folds_of(experiment)
    except KeyError:
        raise CtsegError(
            f"{where}: unknown member {text!r}: no experiment {experiment!r}{_known_list(known)}"
        ) from None
    if not found:
        return Member(text, experiment, None)
    fold = int(found["fold"])
    if not folds:
        raise CtsegError(
            f"{where}: member {text!r}: experiment {experiment!r} declares no split.folds, "
            "so it has no folds; name the experiment itself or give it split.folds"
        )
    if not 0 <= fold < folds:
        raise CtsegError(
            f"{where}: member {text!r}: fold index {fold} out of range: experiment "
            f"{experiment!r} has split.folds: {folds} (folds 0..{folds - 1})"
        )
    return Member(text, experiment, fold)


def ensemble_from(data: Any, where: str, known: KnownRuns) -> Ensemble:
    """An `Ensemble` from a mapping (as read from YAML), checked against the runs in `known`."""
    if not isinstance(data, Mapping):
        raise CtsegError(f"{where}: expected a mapping with name, members and weights")
    checked = validated(data, "ensemble", where)
    name = checked["name"]
    folds_of = _folds_of(known)
    try:
        folds_of(name)
    except KeyError:
        pass
    else:
        raise CtsegError(
            f"{where}: name {name!r} is also an experiment's: both would write results/{name}/; "
            "rename the ensemble"
        )
    texts = checked["members"]
    duplicates = sorted({m for m in texts if texts.count(m) > 1})
    if duplicates:
        raise CtsegError(f"{where}: members listed twice: {duplicates}; list each once")
    members = tuple(_member(t, folds_of, known, where) for t in texts)

    weights: tuple[float, ...] | None = None
    if checked["weights"] != "tuned":
        check_weights(checked["weights"], len(members), f"{where}: weights")
        weights = tuple(float(w) for w in checked["weights"])
    else:
        # Folds of one experiment have no common held-out data: fold i's val records are in
        # fold j's training set, so any score of their mean would be optimistic.
        fold_experiments = [m.experiment for m in members if m.fold is not None]
        shared = sorted({e for e in fold_experiments if fold_experiments.count(e) > 1})
        if shared:
            raise CtsegError(
                f"{where}: weights: tuned needs held-out data no member trained on, and folds of "
                f"{shared[0]!r} hold out different records; give numbers (e.g. equal weights)"
            )

    step = checked["tune_step"] if checked["tune_step"] is not None else default_step(len(members))
    if abs(1 / step - round(1 / step)) > 1e-9:
        raise CtsegError(f"{where}: tune_step: {step} does not divide 1 (e.g. 0.25, 0.2, 0.5)")
    return Ensemble(name, members, weights, float(step), where)


def load_ensemble(path: str | Path, known: KnownRuns) -> Ensemble:
    """config/ensembles/<name>.yaml, checked; its `name` must be the file's name."""
    path = Path(path)
    ens = ensemble_from(read_yaml(path), str(path), known)
    if ens.name != path.stem:
        raise CtsegError(f"{path}: name {ens.name!r} differs from the file name {path.stem!r}")
    return ens
