"""`ctseg predict -i <volume.zarr>`: a whole scroll's mask, read in place, tiled under the budgets,
split over parts, resumable, written as an OME-Zarr image (or a TIFF).

`predict_scroll` takes a Zarr array or one level of an OME-Zarr pyramid, on a disk, on ``s3://``
or behind ``https://`` (`ctseg.inference.source.open_source`), and never copies it: the tiles
(`ctseg.inference.tiles`) read their extents through a bounded chunk cache, and the log reports
the read amplification. The probabilities are computed by `ctseg.inference.tiled` in the work
folder `work_folder_of(output)` (beside the output, kept until the predict is finished), so that:

- without ``--parts``, one process computes every tile, then finishes;
- with ``--parts N --part K``, a process computes part K only (one per GPU, or one SLURM job
  each); ``--parts N --finish``, run once every part is done, finishes;
- a killed run, or part, run again goes on from the tiles it finished, and gives the same bits
  as a run never stopped; a run of other settings, weights or input is refused while the work
  folder holds another's tiles.

Finishing makes the seams final, then the mask: a binary model's post-processing block by block
(`ctseg.postprocess.blockwise.blockwise_mask`, the in-memory mask bit for bit; plugging and
patching work per whole plane and are refused), a multi-class model's argmax label map block by
block. An output ending in ``.zarr`` is an OME-Zarr image (NGFF 0.5) with a pyramid
(`ctseg.ome_zarr`), chunks left empty unwritten; one ending in ``.tif``/``.tiff`` is a TIFF (for
volumes of competition size). ``--probabilities P.zarr`` keeps the float16 probabilities as an
OME-Zarr image too (binary models). Both are renamed into place whole; the work folder is then
removed.

Memory: ``memory_budget_mb`` bounds the host memory this adds to the loaded model: a quarter to
the chunk cache (unless ``cache_mb`` is given), half to the tile's working set
(`ctseg.inference.tiles.plan_tile`), the rest to what passes through (chunks decoded and
encoded, the sums' float copies); the post-processing and the pyramid to a quarter each. The
model and its activations for one batch are not counted: they do not grow with the volume. On a
GPU the tile also fits ``device_budget_mb``. The summary records the process's RSS before the
tiles and its peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import resource
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
import torch
import zarr

from ctseg.data.heap import release_heap, tune_malloc
from ctseg.inference.outputs import (
    LABEL_MAP,
    MASK,
    PROBABILITIES,
    PROVENANCE_KEY,
    check_output_paths,
    provenance,
    tiff_description,
)
from ctseg.inference.run import LoadedModel
from ctseg.inference.settings import InferenceSettings, Shape3
from ctseg.inference.source import VolumeSource, intensity_range, open_source
from ctseg.inference.tiled import Work, finish, open_work, run_part
from ctseg.inference.volume import weights_layout
from ctseg.io import CtsegError, disk_full, fresh_output, remove_path
from ctseg.labels import LabelSpec
from ctseg.ome_zarr import build_pyramid, create_image
from ctseg.postprocess.blockwise import blockwise_mask, refused_step
from ctseg.postprocess.masks import PostprocessSettings
from ctseg.postprocess.write import channel_names, check_label_map_settings, label_map
from ctseg.store import create_volume

OME_SUFFIXES = (".zarr",)
TIFF_SUFFIXES = (".tif", ".tiff")
# Of the memory budget: the chunk cache's (unless --cache-mb is given) and the tile's working
# set's shares; the rest is for what passes through (decoded and encoded chunks, the sums'
# float copies as chunks are made final, spills).
CACHE_SHARE = 0.25
TILE_SHARE = 0.5
ZARR_MARKERS = ("zarr.json", ".zarray", ".zattrs", ".zgroup")


def is_volume_store(text: str) -> bool:
    """Whether `--input` names a Zarr array or OME-Zarr group (a URL, or a folder with zarr
    metadata) rather than a folder of TIFFs."""
    if "://" in text:
        return True
    path = Path(text)
    return path.suffix == ".zarr" or any((path / m).is_file() for m in ZARR_MARKERS)


def work_folder_of(output: Path) -> Path:
    """Where a predict into `output` keeps its tiles until it is finished: beside the output,
    so every part (on every node) and every rerun finds it."""
    return output.with_name(f".{output.name}.predict")


def _peak_rss_mb() -> float:
    """This process's peak RSS: its memory's high-water mark (``VmHWM``), which starts anew
    at exec, where ``ru_maxrss`` keeps the peak of the process that forked it (a 550 MB test
    runner's, for a predict it started)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _check_request(
    models: Sequence[LoadedModel],
    run_name: str,
    output: Path,
    probabilities: Path | None,
    postprocess: PostprocessSettings,
    parts: int | None,
    part: int | None,
    finish_only: bool,
) -> None:
    if len(models) != 1:
        raise CtsegError(
            f"{run_name}: a combined run ({len(models)} models) predicts folders of TIFFs; a "
            "volume read in place takes one trained run (give results/<experiment>)"
        )
    if output.suffix not in OME_SUFFIXES + TIFF_SUFFIXES:
        raise CtsegError(
            f"{output}: the output of a volume read in place is an OME-Zarr image <name>.zarr "
            "or a TIFF <name>.tif"
        )
    labels = models[0].labels
    if labels.is_binary:
        refused = refused_step(postprocess)
        if refused is not None:
            raise CtsegError(f"{output}: {refused}; give 0 for it")
    else:
        check_label_map_settings(postprocess, output)
        if probabilities is not None:
            raise CtsegError(
                f"{probabilities}: --probabilities of a multi-class run read in place is not "
                "written (an OME-Zarr image is one channel); leave it out"
            )
    if probabilities is not None and probabilities.suffix != ".zarr":
        raise CtsegError(f"{probabilities}: --probabilities here is an OME-Zarr <name>.zarr")
    if parts is None and (part is not None or finish_only):
        raise CtsegError("--part and --finish go with --parts N")
    if parts is not None:
        if parts < 1:
            raise CtsegError(f"--parts {parts}: expected a positive number")
        if (part is None) == (not finish_only):
            raise CtsegError(f"--parts {parts}: give --part K (0..{parts - 1}) or --finish")


def predict_scroll(
    run_name: str,
    models: Sequence[LoadedModel],
    weights_sha256: str | None,
    url: str,
    output: Path,
    inference: InferenceSettings,
    postprocess: PostprocessSettings,
    *,
    level: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    probabilities: Path | None = None,
    parts: int | None = None,
    part: int | None = None,
    finish_only: bool = False,
    cache_mb: float | None = None,
    given_range: tuple[float, float] | None = None,
    overwrite: bool = False,
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The mask of the volume at `url` by the run's one model into `output`, or, with `parts`,
    part `part` of its probabilities, or the finish (module docstring). Returns the figures.
    An output that would replace or enter the input, or replace what ctseg did not write, is
    refused before the input is read; one of ctseg's is replaced only with `overwrite`
    (`ctseg.inference.outputs.check_output_paths`, which repeats `command` in its fix)."""
    output = Path(output)
    _check_request(models, run_name, output, probabilities, postprocess, parts, part, finish_only)
    model, patch, labels = models[0]
    kinds = {"-o": (output, MASK if labels.is_binary else LABEL_MAP)}
    if probabilities is not None:
        kinds["--probabilities"] = (probabilities, PROBABILITIES)
    check_output_paths(url, kinds, work_folder_of(output), overwrite, command)
    # Freed activations stay in the heap (no page faults each forward); each tile's memory is
    # handed back when the tile is done (`ctseg.inference.tiled`), so the budget holds for RSS.
    tune_malloc()
    settings = inference.with_window(patch)
    device = settings.torch_device()
    budget = int(settings.memory_budget_mb * 2**20)
    cache = int(cache_mb * 2**20) if cache_mb is not None else int(budget * CACHE_SHARE)
    tile_settings = _with_budget(settings, (budget * TILE_SHARE) / 2**20, budget - cache)
    source = open_source(url, level, storage_options)
    _warm_up(model, settings, device)
    rss_before = _rss_mb()  # the model and its activations, the store's libraries imported
    low, high, how = intensity_range(source, given_range, budget)
    print(f"predict: {source.describe()}\npredict: intensity range {low:g}..{high:g}, {how}",
          file=sys.stderr)  # fmt: skip
    share = f"half of --memory-budget-mb {settings.memory_budget_mb:g}"
    work = open_work(work_folder_of(output), source, tile_settings, device, low, high,
                     weights_sha256, labels, share)  # fmt: skip
    summary: dict[str, Any] = {
        "run": run_name,
        "input": source.describe(),
        "intensity_range": [low, high],
        "tile": list(work.grid.tile),
        "tiles": len(work.grid.tiles()),
        "work": str(work.folder),
        "rss_before_mb": rss_before,
    }
    if not finish_only:
        k, n = (part, parts) if part is not None else (0, 1)
        with _resumable_when_full(work.folder, k, n):
            done = run_part(model, work, source, tile_settings, device, k, n, cache)  # type: ignore[arg-type]
        summary["part"] = done
        print(_part_line(done), file=sys.stderr)
        if part is not None:
            return {**summary, "peak_rss_mb": _peak_rss_mb()}
    t0 = time.perf_counter()
    summary["finish"] = finish(work, parts or 1)
    release_heap()
    record = functools.partial(
        provenance,
        run=run_name,
        weights_sha256=[weights_sha256],
        weights=[1.0],
        inference=settings.as_dict(),
        postprocess=postprocess.as_dict() if labels.is_binary else None,
        labels=labels.to_dict(),
        source={"url": source.url, "level": source.level, "intensity_range": [low, high]},
    )
    summary["outputs"] = _write_outputs(work, source, output, probabilities, postprocess, labels,
                                        budget, record)  # fmt: skip
    summary["finish_seconds"] = time.perf_counter() - t0
    summary["peak_rss_mb"] = _peak_rss_mb()
    remove_path(work.folder)
    return summary


@contextlib.contextmanager
def _resumable_when_full(folder: Path, part: int, parts: int) -> Iterator[None]:
    """A disk that fills while a part writes its tiles is one line; the tiles it finished are
    kept (each is renamed into place whole), so the same command goes on once there is room."""
    try:
        yield
    except CtsegError:
        raise
    except Exception as exc:
        full = disk_full(exc)
        if full is None:
            raise
        who = f"part {part + 1} of {parts} (--part {part})" if parts > 1 else "the predict"
        raise CtsegError(
            f"{folder}: no space left on the device while {who} wrote its tiles "
            f"({full.strerror or full}); the tiles it finished are kept: free some space there "
            "and rerun the same command to go on"
        ) from exc


def _warm_up(model: torch.nn.Module, settings: InferenceSettings, device: torch.device) -> None:
    """One forward of a batch of windows, so that the memory the model's activations take is
    counted with the model (what the budget leaves out) before the tiles' is measured."""
    was_training, layout = model.training, weights_layout(model)
    model.to(device, memory_format=settings.memory_format(device)).eval()
    try:
        with torch.inference_mode():
            crops = torch.zeros((settings.batch_size, 1, *settings.checked_window()), device=device)
            amp = settings.use_amp(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                model(crops)
    finally:
        model.to(memory_format=layout).train(was_training)


def _with_budget(
    settings: InferenceSettings, memory_budget_mb: float, left_by_cache: int
) -> InferenceSettings:
    if left_by_cache <= memory_budget_mb * 2**20:
        raise CtsegError(
            f"--cache-mb leaves nothing of --memory-budget-mb {settings.memory_budget_mb} "
            "for the tiles; give a smaller cache"
        )
    return dataclasses.replace(settings, memory_budget_mb=memory_budget_mb)


def _part_line(done: Mapping[str, Any]) -> str:
    low = done["read_amplification"] < 1 and done["skipped_windows"] > 0
    return (
        f"predict: part {done['part'] + 1} of {done['parts']}: {done['tiles_computed']} tiles "
        f"computed ({done['tiles_resumed']} done before), {done['windows']} windows, "
        f"{done['skipped_windows']} skipped as empty; read amplification "
        f"{done['read_amplification']:.3f} ({done['bytes_fetched'] / 2**20:.1f} MB fetched for "
        f"{done['bytes_of_region'] / 2**20:.1f} MB of input"
        + ("; below 1: the chunks only skipped windows meet are not read" if low else "")
        + f"), {done['seconds']:.1f} s"
    )


# ----------------------------------------------------------------------------- outputs
def _blocks(shape: Shape3, block: Shape3) -> Iterator[tuple[slice, slice, slice]]:
    ranges = [range(0, s, b) for s, b in zip(shape, block, strict=True)]
    for corner in itertools.product(*ranges):
        yield tuple(  # type: ignore[misc]
            slice(c, min(c + b, s)) for c, b, s in zip(corner, block, shape, strict=True)
        )


def _post_block(chunks: Shape3, shape: Shape3, budget: int) -> Shape3:
    """Whole chunks whose post-processing (about 40 bytes a voxel) fits a quarter of the budget."""
    block = list(chunks)
    while True:
        grown = list(block)
        axis = min(range(3), key=lambda a: block[a])
        grown[axis] = min(grown[axis] * 2, max(shape[axis], chunks[axis]))
        if grown == block or math.prod(grown) * 40 > budget / 4:
            return tuple(block)  # type: ignore[return-value]
        block = grown


def _write_mask(
    probs: zarr.Array,
    out: Any,
    postprocess: PostprocessSettings,
    labels: LabelSpec,
    block: Shape3,
    scratch: Path,
) -> dict[str, Any]:
    shape: Shape3 = tuple(int(s) for s in probs.shape[-3:])  # type: ignore[assignment]
    if labels.is_binary:
        closing = None
        if postprocess.closing_radius:
            closing = create_volume(scratch, shape, np.uint8, block, write_empty_chunks=False)
        return blockwise_mask(probs, out, postprocess, block, closing)
    names = channel_names(labels)
    values = np.array([labels.labels[name] for name in names])
    counts = np.zeros(len(names), dtype=np.int64)
    for box in _blocks(shape, block):
        block_map = label_map(np.asarray(probs[(slice(None), *box)]), labels)
        out[box] = block_map
        counts += (block_map[..., None] == values).sum(axis=tuple(range(block_map.ndim)))
    return {
        "classes": labels.n_classes,
        "class_voxels": {name: int(n) for name, n in zip(names, counts, strict=True)},
        "foreground_voxels": int(counts[1:].sum()),
    }


def _write_outputs(
    work: Work,
    source: VolumeSource,
    output: Path,
    probabilities: Path | None,
    postprocess: PostprocessSettings,
    labels: LabelSpec,
    budget: int,
    record: Callable[[str], dict[str, Any]],
) -> dict[str, Any]:
    """The mask (or label map) and the probabilities asked for, each with `record` of its kind
    (`ctseg.inference.outputs.provenance`)."""
    probs = work.probabilities()
    shape: Shape3 = source.shape
    chunks: Shape3 = tuple(work.manifest["chunks"])  # type: ignore[assignment]
    block = _post_block(chunks, shape, budget)
    scratch = work.folder / "closing.zarr"
    done: dict[str, Any] = {"mask": str(output)}
    mask_record = record(MASK if labels.is_binary else LABEL_MAP)
    if output.suffix in OME_SUFFIXES:
        with fresh_output(output, what=f"write the mask of {source.url}") as tmp:
            group = create_image(tmp, shape, np.uint8, chunks, spacing=source.spacing,
                                 name="mask", attributes={PROVENANCE_KEY: mask_record})  # fmt: skip
            done.update(_write_mask(probs, group["0"], postprocess, labels, block, scratch))
            build_pyramid(group, "mode", budget // 4)
    else:
        mask = create_volume(work.folder / "mask.zarr", shape, np.uint8, chunks)
        done.update(_write_mask(probs, mask, postprocess, labels, block, scratch))
        with fresh_output(output, what=f"write the mask of {source.url}") as tmp:
            pages = (np.asarray(mask[z]) for z in range(shape[0]))
            tifffile.imwrite(tmp, pages, shape=shape, dtype=np.uint8, photometric="minisblack",
                             description=tiff_description(mask_record), metadata=None)  # fmt: skip
    if probabilities is not None:
        with fresh_output(probabilities, what="write the probabilities") as tmp:
            group = create_image(tmp, shape, np.float16, chunks, spacing=source.spacing,
                                 name="probabilities",
                                 attributes={PROVENANCE_KEY: record(PROBABILITIES)})  # fmt: skip
            for box in _blocks(shape, block):
                group["0"][box] = probs[box]
            build_pyramid(group, "mean", budget // 4)
        done["probabilities"] = str(probabilities)
    return done
