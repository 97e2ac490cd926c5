"""A trained run's model applied to image stores: the weights `ctseg.training.train` wrote
(last.pt) loaded into the model (`load_model`; `load_checkpoint` also gives the label spec the
model was trained on), then, per volume, the probabilities (`infer_volume`) and the
post-processed mask (`ctseg.postprocess.write.write_mask`): `predict_record` for one volume
(`ctseg infer`), `infer_records` for several, each named by its id.

`infer_volume` is the one engine of `ctseg.inference.tiled` over a converted image store: its
work folder is a scratch folder beside the store it writes, and the whole volume is one tile
when the tile's working set (`ctseg.inference.tiled.working_bytes_per_voxel`: a 320^3 uint8
volume needs about 0.7 GB) fits ``device_budget_mb``: read once, blended on the device, each
chunk divided there and written once. A larger volume is cut into tiles under
``memory_budget_mb``; the exact sums make both the same bits.

A weights file records its dataset's label spec (``state["labels"]``, `LabelSpec.to_dict`; a file
without it is of the Kaggle spec, `ctseg.labels.KAGGLE`). The model's output head gives its
channels, which must be the spec's (`ctseg.labels.LabelSpec.out_channels`: 1 for a binary
spec, background and each class for a multi-class one); a multi-class model's probabilities
have a channel per class and its mask is a label map in the dataset's values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ctseg.inference.blend import output_channels
from ctseg.inference.settings import InferenceSettings, Shape3, check_window
from ctseg.inference.source import VolumeSource
from ctseg.inference.tiled import (
    finish,
    open_work,
    output_chunks,
    run_part,
    working_bytes_per_voxel,
)
from ctseg.inference.tiles import extent_voxels
from ctseg.io import CtsegError, check_id, fresh_output, work_folder
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.network.model import build_model
from ctseg.postprocess.classes import MaskSettings, check_mask_settings
from ctseg.postprocess.write import (
    CLASSES_ATTRIBUTE,
    channel_names,
    open_checked,
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
    postprocess: MaskSettings,
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
    postprocess: MaskSettings,
    weights_sha256: str | None = None,
    labels: LabelSpec | None = None,
) -> dict[str, Any]:
    """One volume: the probabilities (`infer_volume`), then the post-processed mask (none when
    `mask` is None: the workflow post-processes in a step of its own, with settings tuned on the
    val split's probabilities). Both settings are checked when made, before the long inference;
    so is, for the spec `labels`, that the post-processing fits the store
    (`ctseg.postprocess.classes.check_mask_settings`).
    `weights_sha256`: the weights file's digest, kept with the probabilities."""
    if mask is not None and labels is not None:
        check_mask_settings(postprocess, labels, probabilities)
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


# ----------------------------------------------------------------------------- one store
def open_image(image_store: Path) -> tuple[VolumeSource, float, float]:
    """A converted image store (`ctseg convert`) as a source read in place, its chunks checked
    against the record its writer left (`ctseg.postprocess.write.open_checked`), and its
    normalisation range (p0_5, p99_5)."""
    image = open_checked(Path(image_store), "image store")
    attrs = dict(image.attrs)
    if "p0_5" not in attrs or "p99_5" not in attrs:
        raise CtsegError(f"{image_store}: image attributes lack the intensity range p0_5/p99_5")
    if not np.issubdtype(image.dtype, np.number) or np.issubdtype(image.dtype, np.complexfloating):
        raise CtsegError(f"{image_store}: unsupported image dtype {image.dtype}")
    source = VolumeSource(
        url=str(image_store),
        level=None,
        array=image,
        shape=tuple(int(n) for n in image.shape),  # type: ignore[arg-type]
        chunks=tuple(int(n) for n in (image.shards or image.chunks)),  # type: ignore[arg-type]
        dtype=np.dtype(image.dtype),
        spacing=None,
        attributes=attrs,
    )
    return source, float(attrs["p0_5"]), float(attrs["p99_5"])


def infer_volume(
    model: torch.nn.Module,
    image_store: Path,
    prob_store: Path,
    settings: InferenceSettings,
    weights_sha256: str | None = None,
    labels: LabelSpec | None = None,
) -> dict[str, Any]:
    """Blended sliding-window probabilities of the converted `image_store` (`open_image`),
    written to a float16 Zarr store: `infer_source` with the range the store records."""
    source, low, high = open_image(Path(image_store))
    return infer_source(model, source, low, high, prob_store, settings, weights_sha256, labels)


def infer_source(
    model: torch.nn.Module,
    source: VolumeSource,
    low: float,
    high: float,
    prob_store: Path,
    settings: InferenceSettings,
    weights_sha256: str | None = None,
    labels: LabelSpec | None = None,
) -> dict[str, Any]:
    """Blended sliding-window probabilities of `source` normalised with the intensity range
    `low`..`high`, written to a float16 Zarr store (module docstring). `weights_sha256`: the
    digest of the weights file the model was loaded from, kept in the store's attributes
    (`ctseg.store.WEIGHTS_ATTRIBUTE`). `labels`: the label spec the model was trained on
    (`load_checkpoint`); a multi-class one gives a store of one channel per class, (C, Z, Y, X)
    with the attributes ``classes`` and ``labels``; None or a binary spec, the one-channel
    store. The model is run in eval mode on the device (its training flag and layout are
    restored after). The store is written atomically; returns counts and timings."""
    prob_store = Path(prob_store)
    win = settings.checked_window()
    device = settings.torch_device()
    channels = output_channels(labels)
    per_voxel = working_bytes_per_voxel(source.dtype.itemsize, channels)
    whole = extent_voxels(source.shape, win, source.shape) * per_voxel
    if whole <= settings.device_budget_bytes():
        tile_budget, budget_from = settings.device_budget_mb, "device_budget_mb"
    else:
        tile_budget, budget_from = settings.memory_budget_mb, "memory_budget_mb"
    tile_settings = dataclasses.replace(settings, memory_budget_mb=tile_budget)
    name = Path(source.url).name
    scratch = prob_store.with_name(f".{prob_store.name}.infer")
    with (
        work_folder(scratch) as folder,
        fresh_output(prob_store, what=f"write the probabilities of {name}") as tmp,
    ):
        work = open_work(folder, source, tile_settings, device, low, high, weights_sha256,
                         labels, f"{budget_from} {tile_budget:g}", store=tmp)  # fmt: skip
        done = run_part(model, work, source, tile_settings, device,
                        cache_bytes=int(settings.memory_budget_mb * 2**20) // 4,
                        desc=f"infer {name}")  # fmt: skip
        finish(work)
    classes = {CLASSES_ATTRIBUTE: channel_names(labels)} if channels > 1 else {}  # type: ignore[arg-type]
    n_flips = 8 if settings.tta_flips else 1
    return {
        **classes,
        "shape": list(source.shape),
        "window": list(win),
        "chunks": list(output_chunks(source)),
        "windows": done["windows"] + done["skipped_windows"],
        "forward_windows": done["windows"] * n_flips,
        "skipped_windows": done["skipped_windows"],
        "tile": done["tile"],
        "tiles": done["tiles"],
        "tile_budget_mb": tile_budget,
        "amp": settings.use_amp(device),
        "seconds": done["seconds"],
        "voxels_per_s": math.prod(source.shape) / done["seconds"] if done["seconds"] else 0.0,
    }
