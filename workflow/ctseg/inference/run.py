"""A trained run's model applied to image stores: the weights `ctseg.training.train` wrote
(last.pt) loaded into the model (`load_model`; `load_checkpoint` also gives the label spec the
model was trained on), then, per volume, the probabilities
(`ctseg.inference.volume.infer_volume`) and the post-processed mask
(`ctseg.postprocess.write.write_mask`): `predict_record` for one volume (`ctseg infer`),
`infer_records` for several, each named by its id.

A weights file records its dataset's label spec (``state["labels"]``, `LabelSpec.to_dict`; a file
without it is of the Kaggle spec, `ctseg.labels.KAGGLE`). The model's output head gives its
channels, which must be the spec's (`ctseg.labels.LabelSpec.out_channels`: 1 for a binary
spec, background and each class for a multi-class one); a multi-class model's probabilities
have a channel per class and its mask is a label map in the dataset's values.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ctseg.inference.settings import InferenceSettings, Shape3, check_window
from ctseg.inference.volume import infer_volume
from ctseg.io import CtsegError, check_id
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.network.model import build_model
from ctseg.postprocess.masks import PostprocessSettings
from ctseg.postprocess.write import (
    channel_names,
    check_label_map_settings,
    write_mask,
)
from ctseg.training.checkpoint import stored_digest, verify_checksum
from ctseg.training.distributed import pick_device

WEIGHT_KEYS = ("model", "model_config", "patch_size")
LABELS_KEY = "labels"


class LoadedModel(NamedTuple):
    """A weights file's model (eval mode, on its device), training patch size and label spec."""

    model: torch.nn.Module
    patch: Shape3
    labels: LabelSpec


def load_model(
    weights: Path, device: str | torch.device | None = None
) -> tuple[torch.nn.Module, Shape3]:
    """The model (eval mode, on `device`) and training patch size from train.py's final weights
    (`load_checkpoint` without the label spec)."""
    loaded = load_checkpoint(weights, device)
    return loaded.model, loaded.patch


def load_checkpoint(weights: Path, device: str | torch.device | None = None) -> LoadedModel:
    """The model (eval mode, on `device`), training patch size and label spec from train.py's
    final weights.

    Loaded with ``weights_only=True``: a weights file cannot run code. train.py writes it with
    a sha256 trailer (`ctseg.training.checkpoint.save_checkpoint`), checked first: a copy cut
    short or damaged on the way would otherwise load, or fail with torch's own message. The
    label spec is ``state["labels"]`` (KAGGLE without it); a model whose output channels are not
    the spec's is a one-line error naming the file.
    """
    weights = Path(weights)
    if not weights.is_file():
        raise CtsegError(f"{weights}: weights file not found")
    verified = verify_checksum(weights)
    if not verified:
        problem = (
            "its bytes do not match the checksum written with it"
            if verified is False
            else "it has no checksum trailer (cut short, or not written by ctseg train)"
        )
        raise CtsegError(
            f"{weights}: damaged weights file: {problem}; copy it again from where the run "
            "trained, or retrain the run"
        )
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CtsegError(
            f"{weights}: cannot load weights (corrupt or not a torch.save file): {exc}"
        ) from exc
    if not isinstance(state, dict) or any(k not in state for k in WEIGHT_KEYS):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CtsegError(f"{weights}: expected a dict with keys {list(WEIGHT_KEYS)}, found {found}")
    try:
        model = build_model(state["model_config"])
        model.load_state_dict(state["model"])
        patch = check_window(state["patch_size"])
    except (ValueError, RuntimeError, TypeError, CtsegError) as exc:
        problem = " ".join(str(exc).split())  # torch's is several lines
        raise CtsegError(f"{weights}: weights do not match their model config: {problem}") from exc
    labels = _checkpoint_labels(weights, state, model)
    return LoadedModel(model.to(pick_device(device)).eval(), patch, labels)


def _checkpoint_labels(weights: Path, state: dict[str, Any], model: torch.nn.Module) -> LabelSpec:
    """The label spec a weights file records, checked against its model's output channels."""
    if state.get(LABELS_KEY) is None:
        labels = KAGGLE
    else:
        data = state[LABELS_KEY]
        try:
            labels = LabelSpec.from_dict(data, source=f"{weights}: {LABELS_KEY}")
        except CtsegError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CtsegError(
                f"{weights}: unreadable {LABELS_KEY!r} entry {data!r} ({exc!r}); expected a "
                "label spec as LabelSpec.to_dict writes it"
            ) from exc
    heads = getattr(model, "heads", None)
    channels = int(heads[0].out_channels) if heads is not None else None
    expected = labels.out_channels
    if channels is not None and channels != expected:
        names = ", ".join(channel_names(labels))
        wanted = "1 (sigmoid)" if expected == 1 else f"{expected} ({names})"
        raise CtsegError(
            f"{weights}: the model has {channels} output channel(s) but its labels "
            f"({labels.describe()}) need {wanted}; the file's labels and model disagree: "
            "retrain the run, or give the labels it was trained on"
        )
    return labels


def record_id(image_store: Path) -> str:
    """`results/zarr/images/<id>.zarr` -> id."""
    path = Path(image_store)
    return check_id(path.name.removesuffix(".zarr"), path)


def infer_records(
    weights: Path,
    image_stores: Sequence[Path],
    out_dir: Path,
    prob_dir: Path,
    inference: InferenceSettings,
    postprocess: PostprocessSettings,
) -> list[dict[str, Any]]:
    """`<out_dir>/<id>.tif` and `<prob_dir>/<id>.zarr` for every image store; one row each.

    The window defaults to the training patch size stored with the weights.
    """
    ids = [record_id(Path(p)) for p in image_stores]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise CtsegError(f"image stores with the same id {duplicates}: outputs would collide")
    model, patch, labels = load_checkpoint(weights, inference.torch_device())
    settings = inference.with_window(patch)
    rows = []
    for rid, store in zip(ids, image_stores, strict=True):
        prob, tif = Path(prob_dir) / f"{rid}.zarr", Path(out_dir) / f"{rid}.tif"
        row = predict_record(
            model,
            Path(store),
            prob,
            tif,
            settings,
            postprocess,
            stored_digest(Path(weights)),
            labels=labels,
        )
        flat = {k: v for k, v in row.items() if k not in ("inference", "mask")}
        rows.append({"id": rid, **flat, **row["inference"], **row["mask"]})
    return rows


def predict_record(
    model: torch.nn.Module,
    image_store: Path,
    probabilities: Path,
    mask: Path | None,
    inference: InferenceSettings,
    postprocess: PostprocessSettings,
    weights_sha256: str | None = None,
    labels: LabelSpec | None = None,
) -> dict[str, Any]:
    """One volume: the probabilities (`infer_volume`), then the post-processed mask (none when
    `mask` is None: the workflow post-processes in a step of its own, with settings tuned on the
    val split's probabilities). Both settings are checked when made, before the long inference;
    so is, for the multi-class spec `labels`, that the post-processing is the default (its mask
    is the label map, `ctseg.postprocess.write.write_mask`).
    `weights_sha256`: the weights file's digest, kept with the probabilities."""
    if mask is not None and labels is not None and not labels.is_binary:
        check_label_map_settings(postprocess, probabilities)
    info = infer_volume(
        model, Path(image_store), Path(probabilities), inference, weights_sha256, labels
    )
    post = None if mask is None else write_mask(Path(probabilities), Path(mask), postprocess)
    return {
        "prediction": None if mask is None else str(mask),
        "probabilities": str(probabilities),
        "inference": info,
        "mask": post or {},
    }
