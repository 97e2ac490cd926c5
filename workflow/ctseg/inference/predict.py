"""`ctseg predict`: a trained run's post-processed masks of new volumes, in one command.

The run is a folder ``results/<run>/`` (`resolve_run`), of any kind `ctseg.runs` knows:

- an experiment or a fold (``<exp>.fold<i>``): its own ``last.pt``;
- a cross-validation ``<exp>.cv``: its folds' ``last.pt``, weighing the same (a new volume is
  held out by every fold);
- an ensemble, ``config/ensembles/<name>.yaml``: its members' ``last.pt`` under the same
  ``results/``, with the file's weights, or, when they are ``tuned``,
  ``results/<name>/ensemble/weights.json``.

``best.pt`` instead of each ``last.pt`` with ``trained_weights="best"`` (config
``infer.weights``).

These are the models and weights the workflow's own rules (infer, ensemble) use for a test
volume. The post-processing is the run's own too: ``results/<run>/postprocess/tuned.json`` when it
exists, else the fixed settings the caller passes (`ctseg.postprocess.masks.PostprocessSettings`'
defaults unless given); the log says which.

The input is a folder of volumes (`ctseg.inference.inputs.input_volumes`): multi-page TIFFs
``<id>.tif``/``<id>.tiff``, or folders ``<id>/`` of 2D slice TIFFs, which are what `ctseg
convert` takes. Every volume's header is checked first (`ctseg.preprocess.convert.read_header`),
so a bad input stops the command before any inference, with convert's one-line error. Then, one
volume at a time, the workflow's steps with no converted copy: the TIFF read in place
(`ctseg.inference.source.open_source`, tifffile's Zarr interface) and normalised with the
intensity range `ctseg convert` would record (`intensity_range`), the one engine per model
(`ctseg.inference.run.infer_source`), the members' `ctseg.inference.ensemble.ensemble_volume`
for a combined run, and `ctseg.postprocess.write.write_mask` to ``<out>/<id>.tif`` (uint8 0/1,
the submission layout). Memory stays bounded by the settings' budgets; the temporary stores are
removed as each volume is done, from a work folder under ``scratch`` (the system's temporary
folder by default) that a killed predict leaves behind and the next predict of the same volumes
into the same ``out`` removes. With ``probabilities``, ``<probabilities>/<id>.zarr`` is kept as
well. No output folder may be the input folder or lie inside it.

The run's weights files are loaded (`load_models`, each checked against its checksum) before
anything else reads them, so a damaged one is named as such, not taken for retrained weights by
the check of its tuned settings (`run_postprocess`).

Each volume's mask is claimed in ``out`` itself for the whole predict (a lock file
``.<id>.tif.predict.lock`` there, `_claimed`), so a second predict of the same volume into the same
folder is refused whatever its scratch folder, while the workflow's one job per volume into one
folder run side by side. A disk that fills while a mask is written is one line naming the mask.
The figures of every mask in ``out`` are kept in one JSON file (`SUMMARY_FILE` there, unless
another path is given; `write_summary`), to which each predict adds its volumes' rows.

A run of a multi-class model (its weights record a label spec of K >= 2 classes,
`ctseg.inference.run.load_checkpoint`) predicts label maps: each ``<out>/<id>.tif`` is the argmax
over the classes' probabilities in the dataset's own label values
(`ctseg.postprocess.write.write_mask`), its row in the summary names the classes, their values
and each one's voxel count, and the post-processing must be the defaults (refused otherwise,
before any inference). The members of a combined run must have the same label spec.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ctseg.config import check_weights, load_ensemble, load_experiment
from ctseg.inference.ensemble import ensemble_volume, load_weights
from ctseg.inference.inputs import input_volumes
from ctseg.inference.outputs import (
    LABEL_MAP,
    MASK,
    check_folder_outputs,
    provenance,
    tiff_description,
)
from ctseg.inference.run import LoadedModel, infer_source, load_checkpoint
from ctseg.inference.settings import InferenceSettings
from ctseg.inference.source import intensity_range, open_source
from ctseg.io import (
    DISK_FULL_ERRNOS,
    CtsegError,
    OutputBusy,
    atomic_path,
    free_bytes,
    output_lock,
    remove_path,
    strict_json,
    work_folder,
)
from ctseg.labels import LabelSpec
from ctseg.plan import read_dataset_plan
from ctseg.postprocess.classes import MaskSettings, check_mask_settings, label_map_settings
from ctseg.postprocess.masks import PostprocessSettings
from ctseg.postprocess.tuning import load_tuned
from ctseg.postprocess.write import channel_names, write_mask
from ctseg.preprocess.convert import read_header
from ctseg.progress import Progress
from ctseg.runs import cv_base
from ctseg.store import WEIGHTS_ATTRIBUTE
from ctseg.training.checkpoint import stored_digest

EXPERIMENTS_DIR = Path("config/experiments")
ENSEMBLES_DIR = Path("config/ensembles")
# Which weights of each trained run predict: <choice>.pt in its folder, both written by ctseg
# train (last.pt at the end of training, best.pt at the best validation: ctseg.training.run_state).
TRAINED_WEIGHTS = ("last", "best")
DEFAULT_TRAINED_WEIGHTS = "last"
TUNED_FILE = Path("postprocess") / "tuned.json"
ENSEMBLE_WEIGHTS = Path("ensemble") / "weights.json"
SUMMARY_FILE = "predict.json"  # in the output folder, unless another path is given
SUMMARY_WAIT_S = 60.0  # how long a predict waits for another one writing the summary


# ----------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class PredictRun:
    """What predicts with a run: its members' weights files and their weights (one member of
    weight 1 for a trained run), and where the weights came from."""

    name: str
    directory: Path
    kind: str  # trained, cv or ensemble
    members: tuple[str, ...]
    weight_files: tuple[Path, ...]
    weights: tuple[float, ...]
    weights_from: str

    def describe(self) -> str:
        if self.kind == "trained":
            return f"{self.directory} (trained: {self.weight_files[0]})"
        listed = ", ".join(f"{m} {w:g}" for m, w in zip(self.members, self.weights, strict=True))
        return f"{self.directory} ({self.kind}: {listed}; weights from {self.weights_from})"


def resolve_run(
    run_dir: Path,
    experiments_dir: Path = EXPERIMENTS_DIR,
    ensembles_dir: Path = ENSEMBLES_DIR,
    trained_weights: str = DEFAULT_TRAINED_WEIGHTS,
) -> PredictRun:
    """The run at ``results/<run>``: an ensemble when ``<ensembles_dir>/<run>.yaml`` exists, a
    cross-validation when the run is ``<exp>.cv`` of an experiment in `experiments_dir`, else a
    trained run (an experiment or a fold), whose folder holds its last.pt. A combined run's
    members live beside it (its own folder need not exist yet, unless its weights are tuned).
    `trained_weights` (one of `TRAINED_WEIGHTS`) picks each trained run's last.pt or best.pt."""
    if trained_weights not in TRAINED_WEIGHTS:
        raise CtsegError(f"weights {trained_weights!r}: not one of {', '.join(TRAINED_WEIGHTS)}")
    weights_file = f"{trained_weights}.pt"
    run_dir = Path(run_dir)
    name, root = run_dir.name, run_dir.parent
    base = cv_base(name)
    ensemble_file = Path(ensembles_dir) / f"{name}.yaml"
    if ensemble_file.is_file():
        spec = load_ensemble(ensemble_file, _folds_lookup(Path(experiments_dir)))
        members = tuple(spec.member_names)
        if spec.tuned:
            tuned = run_dir / ENSEMBLE_WEIGHTS
            mix, where = tuple(load_weights(tuned, members)), str(tuned)
        else:
            mix, where = tuple(spec.weights or ()), str(ensemble_file)
        kind = "ensemble"
    elif base is not None and (Path(experiments_dir) / f"{base}.yaml").is_file():
        exp_file = Path(experiments_dir) / f"{base}.yaml"
        folds = load_experiment(exp_file)["split"]["folds"] or 0
        if not folds:
            raise CtsegError(
                f"{exp_file}: run {name!r}: experiment {base!r} declares no split.folds, so it "
                "has no cross-validation"
            )
        members = tuple(f"{base}.fold{i}" for i in range(folds))
        mix, where, kind = (1.0,) * folds, "equal weights", "cv"
    elif not run_dir.is_dir():
        raise CtsegError(
            f"{run_dir}: no such run folder, and not an ensemble of {ensembles_dir} or a "
            f"cross-validation of {experiments_dir} (give results/<run>, e.g. results/exp001)"
        )
    else:
        return PredictRun(name, run_dir, "trained", (name,), (run_dir / weights_file,), (1.0,), "")
    files = tuple(root / m / weights_file for m in members)
    return PredictRun(name, run_dir, kind, members, files, mix, where)


def run_spacing(run: PredictRun) -> tuple[float, float, float] | None:
    """The voxel spacing (z, y, x) of the run's dataset, from the dataset plan beside its
    results (``results/plans/dataset.json``), or None where there is none."""
    plan = run.directory.parent / "plans" / "dataset.json"
    return read_dataset_plan(plan).spacing if plan.is_file() else None


def _folds_lookup(experiments_dir: Path) -> Callable[[str], int | None]:
    """`ctseg.config.load_ensemble`'s view of the experiments: an unknown one is a KeyError."""

    def folds(name: str) -> int | None:
        path = experiments_dir / f"{name}.yaml"
        if not path.is_file():
            raise KeyError(name)
        return load_experiment(path)["split"]["folds"]

    return folds


def run_postprocess(
    run: PredictRun, fixed: PostprocessSettings, fixed_given: bool
) -> tuple[MaskSettings, str]:
    """The run's post-processing and where it comes from: ``postprocess/tuned.json`` when it
    exists and no fixed setting was given, else `fixed`. A tuned.json made with other weights
    than the run's now (the run was retrained, and its search not rerun) is refused: its
    settings were chosen for another model's probabilities."""
    tuned = run.directory / TUNED_FILE
    if fixed_given:
        return fixed, "the fixed settings given"
    if not tuned.is_file():
        return fixed, f"the fixed defaults ({tuned} does not exist)"
    settings = load_tuned(tuned)
    made_with = json.loads(tuned.read_text()).get("made_with")
    if made_with is None:  # written before ctseg recorded its weights: nothing to check
        return settings, str(tuned)
    # The search's volumes were made with some of the run's weights files (a cross-validation
    # scores each out-of-fold volume with one fold); every one must still be the run's.
    current = {stored_digest(f) for f in run.weight_files}
    same_files = set(made_with.get(WEIGHTS_ATTRIBUTE) or ["none"]) <= current
    mix = (
        None
        if run.kind == "trained"
        else check_weights(run.weights, len(run.weights), run.weights_from)
    )
    tuned_mix = made_with.get("ensemble_weights")
    same_mix = tuned_mix is None or (
        mix is not None
        and len(tuned_mix) == len(mix)
        and all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(tuned_mix, mix, strict=True))
    )
    if not (same_files and same_mix):
        raise CtsegError(
            f"{tuned}: tuned on the probabilities of other weights than {run.name}'s now "
            f"({'its weights files' if not same_files else 'its ensemble weights'} changed "
            f"since: retrained?); rerun the search (snakemake {tuned}), or give fixed settings "
            "(--threshold ...) or --settings"
        )
    return settings, str(tuned)


# ----------------------------------------------------------------------------- predicting
def _selected(volumes: dict[str, Path], only: Sequence[str] | None, folder: Path) -> list[str]:
    if only is None:
        return list(volumes)
    missing = sorted(set(only) - set(volumes))
    if missing:
        raise CtsegError(f"{folder}: no volume with the id(s) {missing} (it has {list(volumes)})")
    return [i for i in volumes if i in set(only)]


def _check_outside(folder: Path, outputs: dict[str, Path | None]) -> None:
    """Refuse an output folder that is the input folder or inside it: the masks would replace
    the volumes they were made from (same names), or be read as volumes by the next run."""
    inputs = folder.resolve()
    for option, where in outputs.items():
        if where is None:
            continue
        resolved = Path(where).resolve()
        if resolved == inputs or inputs in resolved.parents:
            raise CtsegError(
                f"{where}: {option} is inside the input folder {folder}, where its files would "
                "replace the volumes or be read as volumes next time; choose a folder outside it"
            )


def load_models(run: PredictRun, device: torch.device) -> list[LoadedModel]:
    """Each member's model, training patch and label spec, its weights file checked against its
    checksum first (`ctseg.inference.run.load_checkpoint`): a damaged file is named as damaged.
    Members of different label specs are refused, naming both files."""
    models = [load_checkpoint(f, device) for f in run.weight_files]
    first = models[0].labels
    for path, loaded in zip(run.weight_files[1:], models[1:], strict=True):
        if loaded.labels != first:
            raise CtsegError(
                f"{path}: labels {loaded.labels.describe()}, but {run.weight_files[0]} has "
                f"{first.describe()}: the members of {run.name} must be models of the same classes"
            )
    return models


def describe_masks(labels: LabelSpec, postprocess: MaskSettings) -> str:
    """What the masks are, for the log and the summary line: the post-processing of a binary
    run's masks, or a multi-class run's classes, their values and their post-processing."""
    if labels.is_binary:
        return f"post-processing {postprocess.label()}"
    values = ", ".join(f"{name} {value}" for name, value in labels.labels.items())
    classes = label_map_settings(postprocess, labels, "the masks")
    how = "argmax" if classes.is_argmax else f"argmax, then {classes.label()}"
    return f"label maps ({how} of {labels.out_channels} class probabilities: {values})"


@contextlib.contextmanager
def _claimed(out_dir: Path, ids: Sequence[str]) -> Iterator[None]:
    """Hold ``<out_dir>/.<id>.tif.predict.lock`` of every volume while this predict runs: a
    second predict of one of them into the same folder is refused, whatever its scratch."""
    with contextlib.ExitStack() as held:
        for rid in ids:
            try:
                held.enter_context(output_lock(out_dir / f"{rid}.tif.predict"))
            except OutputBusy as exc:
                raise CtsegError(
                    f"{out_dir}: another ctseg predict is writing {rid}.tif into this folder "
                    "now; wait for it to finish, or choose another --output"
                ) from exc
        yield


@contextlib.contextmanager
def _work_folder(scratch: Path | None, out_dir: Path, ids: Sequence[str]) -> Iterator[Path]:
    """``<scratch>/ctseg-predict-<digest of out_dir and ids>``: the temporary stores of one
    predict of `ids` into `out_dir` (the workflow's jobs, one volume each into one folder, get
    one each). A predict killed on the way leaves it behind; the next one of the same volumes
    into the same folder removes it first (`ctseg.io.work_folder`)."""
    root = Path(scratch) if scratch is not None else Path(tempfile.gettempdir())
    key = "\0".join([str(out_dir.resolve()), *sorted(ids)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    with work_folder(root / f"ctseg-predict-{digest}") as work:
        yield work


def predict_folder(
    run: PredictRun,
    models: Sequence[LoadedModel],
    folder: Path,
    out_dir: Path,
    inference: InferenceSettings,
    postprocess: MaskSettings,
    *,
    probabilities_dir: Path | None = None,
    only: Sequence[str] | None = None,
    scratch: Path | None = None,
    postprocess_from: str = "given",
    summary: Path | None = None,
    overwrite: bool = False,
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """``<out_dir>/<id>.tif`` of every volume of `folder` (or of the ids in `only`) by `run`,
    whose `models` are `load_models`'; returns what was done, one row per volume (module
    docstring). The log (stderr) names the run, its models and weights, and the
    post-processing with `postprocess_from`, its source (a multi-class run: its classes).
    The summary's ``masks`` says what the masks are (`describe_masks`). Masks, probability
    stores and the `summary` file already there are checked first: only ctseg's are replaced,
    and only with `overwrite` (`ctseg.inference.outputs.check_folder_outputs`)."""
    folder, out_dir = Path(folder), Path(out_dir)
    outputs = {"--output": out_dir, "--probabilities": probabilities_dir, "--scratch": scratch}
    labels = models[0].labels
    check_mask_settings(postprocess, labels, f"{run.directory} ({postprocess_from})")
    _check_outside(folder, outputs)
    volumes = input_volumes(folder)
    ids = _selected(volumes, only, folder)
    for rid in ids:
        read_header(volumes[rid])  # convert's checks, before any long step
    check_folder_outputs(
        [out_dir / f"{rid}.tif" for rid in ids],
        [Path(probabilities_dir) / f"{rid}.zarr" for rid in ids] if probabilities_dir else [],
        Path(summary or out_dir / SUMMARY_FILE),
        overwrite,
        command,
    )
    device = inference.torch_device()
    digests = [stored_digest(f) for f in run.weight_files]  # kept with each probability store
    for where in (out_dir, probabilities_dir):
        if where is not None:
            Path(where).mkdir(parents=True, exist_ok=True)  # a folder in the way: now
    rows = []
    with _claimed(out_dir, ids), _work_folder(scratch, out_dir, ids) as work:
        masks = (
            f"post-processing {postprocess.label()}: {postprocess_from}"
            if labels.is_binary
            else describe_masks(labels, postprocess)
        )
        print(
            f"predict: {len(ids)} volume(s) of {folder} by {run.describe()} on {device}\n"
            f"predict: {masks}",
            file=sys.stderr,
        )
        for rid in Progress(ids, unit="volume", desc="predict", file=sys.stderr):
            rows.append(
                _predict_volume(
                    run,
                    models,
                    digests,
                    rid,
                    volumes[rid],
                    work,
                    out_dir,
                    probabilities_dir,
                    inference,
                    postprocess,
                )  # fmt: skip
            )
    classes = {} if labels.is_binary else {"classes": channel_names(labels)}
    return {
        **classes,
        "masks": describe_masks(labels, postprocess),
        "run": str(run.directory),
        "kind": run.kind,
        "members": list(run.members),
        "weights": list(run.weights),
        "input": str(folder),
        "output": str(out_dir),
        "postprocess": {**postprocess.as_dict(), "from": postprocess_from},
        "volumes": rows,
    }


def _predict_volume(
    run: PredictRun,
    models: Sequence[LoadedModel],
    digests: Sequence[str | None],
    rid: str,
    source: Path,
    work: Path,
    out_dir: Path,
    probabilities_dir: Path | None,
    inference: InferenceSettings,
    postprocess: MaskSettings,
) -> dict[str, Any]:
    volume = open_source(str(source))  # read in place: a multi-page TIFF or a slice folder
    budget = int(inference.memory_budget_mb * 2**20)
    low, high, _ = intensity_range(volume, None, budget)  # as `ctseg convert` records it
    prob = Path(probabilities_dir) / f"{rid}.zarr" if probabilities_dir else work / f"{rid}.zarr"
    members = [work / "members" / m / f"{rid}.zarr" for m in run.members]
    member_probs = [prob] if len(models) == 1 else members
    for loaded, member_prob, digest in zip(models, member_probs, digests, strict=True):
        window = inference.with_window(loaded.patch)
        info = infer_source(loaded.model, volume, low, high, member_prob, window, digest,
                            loaded.labels)  # fmt: skip
    if len(models) > 1:
        budget_mb = inference.memory_budget_mb
        ensemble_volume(member_probs, run.weights, prob, memory_budget_mb=budget_mb,
                        where=run.weights_from)  # fmt: skip
        for member_prob in member_probs:
            remove_path(member_prob)
    labels = models[0].labels
    record = provenance(
        MASK if labels.is_binary else LABEL_MAP,
        run=run.name,
        weights_sha256=digests,
        weights=[w / sum(run.weights) for w in run.weights],
        inference=inference.with_window(models[0].patch).as_dict(),
        postprocess=postprocess.as_dict() if labels.is_binary else None,
        labels=labels.to_dict(),
        source={"url": str(source), "level": None, "intensity_range": [low, high]},
    )
    mask = _write_mask(
        prob, out_dir / f"{rid}.tif", postprocess, info["shape"][-3:], tiff_description(record)
    )
    if not probabilities_dir:
        remove_path(prob)
    return {
        "id": rid,
        "source": str(source),
        "mask": str(out_dir / f"{rid}.tif"),
        "probabilities": str(prob) if probabilities_dir else None,
        "shape": info["shape"][-3:],
        **{k: v for k, v in mask.items() if k in ("classes", "values") or k.endswith("_voxels")},
    }


def _write_mask(
    prob: Path,
    mask: Path,
    postprocess: MaskSettings,
    shape: Sequence[int],
    description: str,
) -> dict[str, Any]:
    """`write_mask`, with a disk that fills on the way one line naming the mask. tifffile says
    a short write without an errno ("110592 requested and 40704 written"): with less room
    left than the mask takes, that is a full disk too."""
    try:
        return write_mask(prob, mask, postprocess, description)
    except OSError as exc:
        free, needed = free_bytes(mask.parent), math.prod(shape)
        short_write = exc.errno is None and free < needed
        if exc.errno not in DISK_FULL_ERRNOS and not short_write:
            raise
        raise CtsegError(
            f"{mask}: no space left on the device while writing this mask ({exc}; {free} bytes "
            f"free now, the mask takes {needed}); the partial mask was removed: free some space "
            "there and rerun"
        ) from exc


def write_summary(path: Path, summary: dict[str, Any]) -> Path:
    """Add `summary`'s volumes to the JSON file at `path` ({"volumes": {id: row}}), each row
    with the run and the post-processing that made it; rows of masks no longer in their folder
    are dropped. Written atomically; a predict writing it meanwhile is waited for."""
    run_keys = ("run", "kind", "members", "weights", "input", "postprocess")
    rows = {v["id"]: {**v, **{k: summary[k] for k in run_keys}} for v in summary["volumes"]}
    deadline = time.monotonic() + SUMMARY_WAIT_S
    while True:
        try:
            with atomic_path(path) as tmp:
                kept = {**_summary_rows(path), **rows}
                kept = {rid: row for rid, row in kept.items() if Path(row["mask"]).is_file()}
                tmp.write_text(strict_json({"volumes": dict(sorted(kept.items()))}, indent=1))
            return path
        except OutputBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _summary_rows(path: Path) -> dict[str, Any]:
    """The rows of an existing summary file; none from one that is not ours (or damaged)."""
    try:
        volumes = json.loads(path.read_text()).get("volumes")
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(volumes, dict):
        return {}
    return {k: v for k, v in volumes.items() if isinstance(v, dict) and "mask" in v}
