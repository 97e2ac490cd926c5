"""A trained run's model applied to image stores: the weights `ctseg.training.train` wrote
(last.pt) loaded into the model (`load_model`), then, per volume, the probabilities
(`ctseg.inference.volume.infer_volume`) and the post-processed mask
(`ctseg.postprocess.write.write_mask`): `predict_record` for one volume (`ctseg infer`),
`infer_records` for several, each named by its id.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ctseg.inference.settings import InferenceSettings, Shape3, check_window
from ctseg.inference.volume import infer_volume
from ctseg.io import CtsegError, check_id
from ctseg.network.model import build_model
from ctseg.postprocess.masks import PostprocessSettings
from ctseg.postprocess.write import write_mask
from ctseg.training.checkpoint import stored_digest, verify_checksum
from ctseg.training.distributed import pick_device

WEIGHT_KEYS = ("model", "model_config", "patch_size")


def load_model(
    weights: Path, device: str | torch.device | None = None
) -> tuple[torch.nn.Module, Shape3]:
    """The model (eval mode, on `device`) and training patch size from train.py's final weights.

    Loaded with ``weights_only=True``: a weights file cannot run code. train.py writes it with
    a sha256 trailer (`ctseg.training.checkpoint.save_checkpoint`), checked first: a copy cut
    short or damaged on the way would otherwise load, or fail with torch's own message.
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
    return model.to(pick_device(device)).eval(), patch


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
    model, patch = load_model(weights, inference.torch_device())
    settings = inference.with_window(patch)
    rows = []
    for rid, store in zip(ids, image_stores, strict=True):
        prob, tif = Path(prob_dir) / f"{rid}.zarr", Path(out_dir) / f"{rid}.tif"
        row = predict_record(
            model, Path(store), prob, tif, settings, postprocess, stored_digest(Path(weights))
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
) -> dict[str, Any]:
    """One volume: the probabilities (`infer_volume`), then the post-processed mask (none when
    `mask` is None: the workflow post-processes in a step of its own, with settings tuned on the
    val split's probabilities). Both settings are checked when made, before the long inference.
    `weights_sha256`: the weights file's digest, kept with the probabilities."""
    info = infer_volume(model, Path(image_store), Path(probabilities), inference, weights_sha256)
    post = None if mask is None else write_mask(Path(probabilities), Path(mask), postprocess)
    return {
        "prediction": None if mask is None else str(mask),
        "probabilities": str(probabilities),
        "inference": info,
        "mask": post or {},
    }
