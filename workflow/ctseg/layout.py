"""Where things are: the results paths, and the scratch formats, each writer beside its reader.

Results (all under ``results/``, git-ignored):

- ``preprocessed/<dataset>/zarr/{images,labels}/<id>.zarr`` and ``.../targets/<id>.zarr``: the
  store `convert` and `targets` write and `stage` reads (from here or any fsspec URL laid out
  the same way). One root per dataset, so two datasets with a common id never collide.
- ``<run>/`` for the demo, ``<dataset>/<run>/`` for any other dataset (`results_root`):
  ``split.csv``, ``phases/phase<N>/{summary.json,steps.csv}``, ``last.pt``,
  ``train/{steps,epochs}.csv``, ``checkpoints/`` (resumable state, not a declared output),
  ``probabilities/<id>.zarr``, ``predictions/<id>.tif``, ``evaluation/``.
- ``report.html``, ``logs/<rule>/``, ``benchmarks/<rule>/``, under the same root as the runs.

Scratch: one directory per staged record, ``<scratch>/<id>/``, in one of two formats.

- ``raw``: uncompressed ``.npy`` files read through ``np.memmap``: ``image.npy``, ``masks.npy``
  (ignore, foreground, skeleton and tube packed as bit flags, `ctseg.store.MASK_BITS`),
  ``sdt.npy``, ``fg_locations.npy``, and ``meta.json`` (the image attributes, and the targets'
  attributes under ``targets``). `raw_files` and `raw_meta` say what `ctseg.preprocess.stage`
  writes; `open_record` reads it.
- ``zarr``: the store's ``image.zarr`` and ``targets.zarr`` copied byte for byte.

Both carry the targets' own parameters (clip distance, skeleton method, ...) from the store's
attributes; `target_params` is the one place training reads them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctseg.io import CtsegError, strict_json
from ctseg.store import MASK_BITS, open_checked, pack_masks

RESULTS = "results"
# The generated dataset: its runs keep results/<run>/ (any other: results/<dataset>/<run>/).
DEMO_DATASET = "demo"
SCRATCH_FORMATS = ("raw", "zarr")
TARGET_PARAM_KEYS = ("clip_distance", "skeleton_method", "tube_dilations", "halo")
MASK_PLANES = ("foreground", "ignore", "skeleton", "tube")


# ----------------------------------------------------------------------------- results paths
def store_root(dataset: str) -> str:
    """The preprocessed store of one dataset."""
    return f"{RESULTS}/preprocessed/{dataset}"


def image_store(root: str, record_id: str) -> str:
    return f"{root}/zarr/images/{record_id}.zarr"


def label_store(root: str, record_id: str) -> str:
    return f"{root}/zarr/labels/{record_id}.zarr"


def target_store(root: str, record_id: str) -> str:
    return f"{root}/targets/{record_id}.zarr"


def results_root(dataset: str) -> str:
    """Where a dataset's runs, logs, job timings and report go: ``results/`` for the demo,
    ``results/<dataset>/`` for any other, so that no folder ever holds outputs of two datasets
    and ``results/<run>/...`` keeps naming the demo's runs."""
    return RESULTS if dataset == DEMO_DATASET else f"{RESULTS}/{dataset}"


def other_datasets(resources: str | Path, dataset: str) -> list[str]:
    """The datasets in `resources` (its folders) other than `dataset` and the demo, whose runs
    are in ``results/<name>/``: a run of the demo may not take one of their names."""
    folder = Path(resources)
    if not folder.is_dir():
        return []
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_dir() and not p.name.startswith(".") and p.name not in (dataset, DEMO_DATASET)
    )


def scratch_root(scratch: str, dataset: str) -> str:
    """A dataset's staged copies under the configured scratch directory (kept as given, so a
    $VAR in it expands where the job runs): the demo's in it, any other's in <dataset>/."""
    scratch = str(scratch).rstrip("/")
    return scratch if dataset == DEMO_DATASET else f"{scratch}/{dataset}"


def run_dir(run: str, *, root: str) -> str:
    """Everything one run writes, trials to evaluation (`root`: `results_root`)."""
    return f"{root}/{run}"


def trial_summary(run: str, phase: int | str, *, root: str) -> str:
    return f"{run_dir(run, root=root)}/phases/phase{phase}/summary.json"


def prediction(run: str, record_id: str, *, root: str) -> str:
    return f"{run_dir(run, root=root)}/predictions/{record_id}.tif"


def probabilities(run: str, record_id: str, *, root: str) -> str:
    return f"{run_dir(run, root=root)}/probabilities/{record_id}.zarr"


# ----------------------------------------------------------------------------- raw: writer
@dataclasses.dataclass(frozen=True)
class RawFile:
    """One .npy file of the raw format and the source arrays it is made from."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    inputs: tuple[str, ...]  # "image" or target array names
    chunk0: int

    @property
    def size(self) -> int:
        return len(npy_header(self.shape, self.dtype)) + math.prod(self.shape) * self.dtype.itemsize

    def combine(self, blocks: Sequence[np.ndarray]) -> np.ndarray:
        if len(self.inputs) > 1:
            return pack_masks(dict(zip(self.inputs, blocks, strict=True)))
        return blocks[0]


def raw_files(image: Any, targets: Mapping[str, Any]) -> tuple[RawFile, ...]:
    """The raw format's .npy files for a record whose source arrays (each with ``shape``,
    ``dtype`` and ``chunk0``, the chunk depth along the first axis) are `image` and `targets`."""
    t = targets
    return (
        RawFile("image.npy", image.shape, image.dtype, ("image",), image.chunk0),
        RawFile(
            "masks.npy", image.shape, np.dtype(np.uint8), tuple(MASK_BITS), t["foreground"].chunk0
        ),
        RawFile("sdt.npy", t["sdt"].shape, t["sdt"].dtype, ("sdt",), t["sdt"].chunk0),
        RawFile(
            "fg_locations.npy",
            t["fg_locations"].shape,
            t["fg_locations"].dtype,
            ("fg_locations",),
            t["fg_locations"].chunk0,
        ),
    )


def npy_header(shape: Sequence[int], dtype: np.dtype) -> bytes:
    """The header np.lib.format.open_memmap writes, so np.load(mmap_mode="r") reads the file."""
    buffer = io.BytesIO()
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": tuple(shape),
    }
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def raw_meta(
    attributes: Mapping[str, Any],
    target_attributes: Mapping[str, Any],
    shape: Sequence[int],
    dtype: Any,
) -> bytes:
    """meta.json of a raw record: the image's attributes, the targets' under ``targets``."""
    meta = dict(attributes)
    meta.setdefault("shape", list(shape))
    meta.setdefault("dtype", str(dtype))
    if target_attributes:
        # What the zarr format keeps on targets.zarr (clip distance, skeleton method, ...).
        meta["targets"] = dict(target_attributes)
    return (strict_json(meta, indent=2, sort_keys=True) + "\n").encode()


# ----------------------------------------------------------------------------- both: reader
@dataclass
class ScratchRecord:
    """Per-process handles of one staged record (memmaps or zarr arrays); never pickled."""

    path: Path
    shape: tuple[int, int, int]
    image: Any  # np.memmap or zarr.Array
    sdt: Any
    masks: Any = None  # raw: packed uint8 bit flags
    planes: dict[str, Any] = field(default_factory=dict)  # zarr: foreground, ignore, ...
    fg_locations: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))
    intensity: np.ndarray = field(default_factory=lambda: np.zeros(2, np.float32))
    params: dict[str, Any] = field(default_factory=dict)


def open_record(
    path: Path,
    fmt: str,
    *,
    target_params: Mapping[str, Any] | None = None,
    needed: Sequence[str] = ("clip_distance",),
) -> ScratchRecord:
    """One staged record of format `fmt`; `target_params` override the stored ones, and the
    `needed` ones must be known one way or the other."""
    attrs = record_attributes(path, fmt)
    record, shapes = _open_raw(path) if fmt == "raw" else _open_zarr(path)
    if len(record.shape) != 3 or any(tuple(s) != record.shape for s in shapes):
        raise CtsegError(
            f"{record.path}: image shape {record.shape} and target shapes "
            f"{[tuple(s) for s in shapes]} disagree"
        )
    image_at, image_attrs = attrs["image"]
    if "p0_5" not in image_attrs or "p99_5" not in image_attrs:
        raise CtsegError(f"{image_at}: image attributes lack the intensity range p0_5/p99_5")
    record.intensity = np.array([image_attrs["p0_5"], image_attrs["p99_5"]], np.float32)
    record.params = _target_params(attrs["targets"], target_params, needed)
    return record


def record_attributes(path: Path, fmt: str) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The image's and the targets' attributes of one staged record, each with the file they
    come from: raw keeps both in meta.json, zarr on the two stores (no array is opened)."""
    if fmt not in SCRATCH_FORMATS:
        raise CtsegError(f"{path}: unknown scratch format {fmt!r}; expected {SCRATCH_FORMATS}")
    if fmt == "raw":
        meta_path = path / "meta.json"
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            raise CtsegError(f"{path}: cannot open raw scratch record: {exc}") from exc
        # The targets' attributes may sit in their own mapping or beside the image's.
        targets = {**meta, **(meta.get("targets") or {})}
        return {"image": (meta_path, meta), "targets": (meta_path, targets)}
    import zarr  # only the zarr format needs it

    try:
        image = dict(zarr.open_array(str(path / "image.zarr"), mode="r").attrs)
        targets = dict(zarr.open_group(str(path / "targets.zarr"), mode="r").attrs)
    except (OSError, KeyError, ValueError, FileNotFoundError) as exc:
        raise CtsegError(f"{path}: cannot open zarr scratch record: {exc}") from exc
    return {"image": (path / "image.zarr", image), "targets": (path / "targets.zarr", targets)}


def _target_params(
    found: tuple[Path, Mapping[str, Any]],
    given: Mapping[str, Any] | None,
    needed: Sequence[str],
) -> dict[str, Any]:
    where, attrs = found
    params = {k: attrs[k] for k in TARGET_PARAM_KEYS if k in attrs}
    params.update(given or {})
    missing = [k for k in needed if params.get(k) is None]
    if missing:
        raise CtsegError(
            f"{where}: target parameters {missing} are neither in the scratch metadata nor given"
        )
    return params


def _open_raw(path: Path) -> tuple[ScratchRecord, list[tuple[int, ...]]]:
    try:
        image = np.load(path / "image.npy", mmap_mode="r")
        masks = np.load(path / "masks.npy", mmap_mode="r")
        sdt = np.load(path / "sdt.npy", mmap_mode="r")
        fg = np.asarray(np.load(path / "fg_locations.npy"), np.int64).reshape(-1, 3)
    except (OSError, ValueError) as exc:
        raise CtsegError(f"{path}: cannot open raw scratch record: {exc}") from exc
    record = ScratchRecord(
        path=path, shape=tuple(image.shape), image=image, sdt=sdt, masks=masks, fg_locations=fg
    )
    return record, [masks.shape, sdt.shape]


def _open_zarr(path: Path) -> tuple[ScratchRecord, list[tuple[int, ...]]]:
    try:
        # Each chunk's bytes checked as it is read, against the record copied with the store
        # (staging verified the copy: no listing per worker).
        image = open_checked(path / "image.zarr", listed=False)
        targets = open_checked(path / "targets.zarr", listed=False)
        planes = {k: targets[k] for k in MASK_PLANES}
        sdt = targets["sdt"]
        fg = np.asarray(targets["fg_locations"][...], np.int64).reshape(-1, 3)
    except (OSError, KeyError, ValueError, FileNotFoundError) as exc:
        raise CtsegError(f"{path}: cannot open zarr scratch record: {exc}") from exc
    record = ScratchRecord(
        path=path, shape=tuple(image.shape), image=image, sdt=sdt, planes=planes, fg_locations=fg
    )
    return record, [p.shape for p in planes.values()] + [sdt.shape]


def target_params(scratch: Path, ids: Sequence[str], fmt: str) -> dict[str, Any]:
    """The targets' parameters of the staged records `ids`, which must agree: what the losses
    must use (the sdt was clipped at this clip distance, whatever the config says now). Only
    the attributes are read; the arrays are opened where they are used (the loader workers)."""
    found: dict[str, Any] | None = None
    for record_id in ids:
        path = Path(scratch) / record_id
        params = _target_params(record_attributes(path, fmt)["targets"], None, ("clip_distance",))
        if found is None:
            found = params
        elif params != found:
            raise CtsegError(
                f"{path}: target parameters {params} differ from the other records' {found}; "
                "recompute the targets with one setting (snakemake -R targets)"
            )
    if found is None:
        raise CtsegError(f"{scratch}: no staged records to read target parameters from")
    return found


def staged_clip_distance(
    scratch: Path, ids: Sequence[str], fmt: str, expected: float | None = None
) -> float:
    """The clip distance the staged sdt was computed with (the store's own attribute), which
    the boundary loss must use; `expected`, if given, must agree with it."""
    clip = float(target_params(scratch, ids, fmt)["clip_distance"])
    if expected is not None and float(expected) != clip:
        raise CtsegError(
            f"{scratch}: the staged targets were clipped at {clip}, not {expected}; recompute "
            "the targets with the clip distance you want (snakemake -R targets)"
        )
    return clip
