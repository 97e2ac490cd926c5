"""`ctseg predict -i <volume.zarr>`: a whole scroll's mask by any run (one model, or the weighted
models of a cross-validation or an ensemble), read in place, tiled under the budgets, split over
parts, resumable, written as an OME-Zarr image (or a TIFF) that records how it was made.

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

Each model of a combined run has its own work folder (`member_folders`), so each resumes on its
own tiles; a part computes its tiles of every model. Before anything is read, and before any
folder is made, the request is checked: the outputs (`ctseg.inference.outputs.
check_output_paths`: nothing of the input, and nothing ctseg did not write, is ever replaced;
ctseg's own outputs only with ``overwrite``), ``--part``'s range, and whether the
post-processing's blocks and the tile fit the budget. The intensity range, where neither given
nor recorded in the array, is computed once for the whole predict
(`ctseg.inference.tiled.shared_intensity_range`): the first process reads the volume for it,
every other part and the finish read the work folder's ``intensity.json``.

Finishing makes the seams final, averages the models' probabilities with the run's weights block by
block (`ctseg.inference.ensemble.weighted_mean`, the folder predict's arithmetic), then makes the
mask: a binary model's post-processing block by block under every setting
(`ctseg.postprocess.blockwise.blockwise_mask`, the in-memory mask bit for bit; its blocks, halos
included, are sized before any tile, `ctseg.postprocess.classes.mask_block`), a multi-class model's
label map block by block, each class's settings applied as the binary ones are
(`ctseg.postprocess.classes.blockwise_class_masks`: the in-memory label map bit for bit). An output
ending in ``.zarr`` is an OME-Zarr label image (NGFF 0.5, class names and colours) with a pyramid
toward isotropic voxels (`ctseg.ome_zarr`), chunks left empty unwritten; one ending in
``.tif``/``.tiff`` is a TIFF (for volumes of competition size). ``--probabilities P.zarr`` keeps
the float16 probabilities as an OME-Zarr image too, with a channel per class for a multi-class run.
Each records its provenance (`ctseg.inference.outputs.provenance`) and is renamed into place whole;
the work folder is then removed.

Memory: ``memory_budget_mb`` bounds the host memory this adds to the loaded model: a quarter to
the chunk cache (unless ``cache_mb`` is given), half to the tile's working set
(`ctseg.inference.tiles.plan_tile`), the rest to what passes through (chunks decoded and
encoded, the sums' float copies); the post-processing and the pyramid to a quarter each. The
model and its activations for one batch are not counted: they do not grow with the volume. On a
GPU the tile also fits ``device_budget_mb``. The summary records the process's RSS before the
tiles and its peak.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
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

from ctseg.config import check_weights
from ctseg.data.heap import release_heap, tune_malloc
from ctseg.inference.blend import output_channels, warm_up
from ctseg.inference.ensemble import weighted_mean
from ctseg.inference.outputs import (
    LABEL_MAP,
    MASK,
    PROBABILITIES,
    PROVENANCE_KEY,
    check_output_paths,
    provenance,
    tiff_description,
    written_kind,
)
from ctseg.inference.run import LoadedModel
from ctseg.inference.settings import InferenceSettings, Shape3
from ctseg.inference.source import ZARR_MARKERS, VolumeSource, open_source
from ctseg.inference.tiled import (
    Work,
    finish,
    open_work,
    output_chunks,
    planned_tile,
    run_part,
    shared_intensity_range,
    statistics_piece,
)
from ctseg.io import CtsegError, disk_full_is_an_error, fresh_output, made_once, remove_path
from ctseg.labels import LabelSpec
from ctseg.ome_zarr import LabelClass, build_pyramid, create_image, label_colors
from ctseg.postprocess.blockwise import COMPONENTS, BlockwiseJobs, post_rounds, z_ranges
from ctseg.postprocess.classes import (
    ClassSettings,
    MaskSettings,
    blockwise_class_masks,
    check_mask_settings,
    join_block,
    mask_block,
)
from ctseg.postprocess.write import channel_names
from ctseg.preprocess.convert import TIFF_SUFFIXES
from ctseg.store import create_volume

OME_SUFFIXES = (".zarr",)
# Of the memory budget: the chunk cache's (unless --cache-mb is given) and the tile's working
# set's shares; the rest is for what passes through (decoded and encoded chunks, the sums'
# float copies as chunks are made final, spills).
CACHE_SHARE = 0.25
TILE_SHARE = 0.5
RESUME_AFTER_FULL = (
    "the tiles it finished are kept: free some space there and rerun the same command to go on"
)


def is_volume_store(text: str) -> bool:
    """Whether `--input` names one volume read in place (a URL, a folder with zarr metadata, or
    a multi-page TIFF file) rather than a folder of volumes."""
    if "://" in text:
        return True
    path = Path(text)
    if path.suffix.lower() in TIFF_SUFFIXES and path.is_file():
        return True
    return path.suffix == ".zarr" or any((path / m).is_file() for m in ZARR_MARKERS)


def work_folder_of(output: Path) -> Path:
    """Where a predict into `output` keeps its tiles until it is finished: beside the output,
    so every part (on every node) and every rerun finds it."""
    return output.with_name(f".{output.name}.predict")


def predict_statistics(
    url: str,
    output: Path,
    piece: int,
    pieces: int,
    memory_budget_mb: float,
    *,
    level: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Statistics job `piece` of `pieces` of a predict into `output` (module docstring): the
    histogram of its z-range, kept in the work folder for the process that computes the
    intensity range; returns the figures. It needs no model: it may run while the run trains.
    Checked first as the predict is: an existing `output` must be ctseg's, the work folder a
    predict's, neither inside the input."""
    if not 0 <= piece < pieces:  # before any read, and whether or not there is work to do
        raise CtsegError(f"--statistics {piece}: expected 0 <= piece < --parts {pieces}")
    output = Path(output)
    io_start = _io_bytes()
    root = work_folder_of(output)
    kind = written_kind(output) if output.exists() else None
    check_output_paths(url, {"-o": (output, kind or MASK)}, root, overwrite, command)
    source = open_source(url, level, storage_options)
    budget = int(memory_budget_mb * 2**20)
    read = statistics_piece(root, source, piece, pieces, budget)
    return {
        "input": source.describe(),
        "statistics_piece": [piece, pieces],
        "statistics_bytes_read": read,
        "work": str(root),
        **_process_figures(io_start),
    }


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


def _io_bytes() -> tuple[int, int] | None:
    """This process's bytes read and written through system calls so far (Linux's
    /proc/self/io ``rchar`` and ``wchar``: every file, its threads' too, whether or not the
    page cache served it), or None where the system does not say."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["rchar"]), int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


def _process_figures(io_start: tuple[int, int] | None) -> dict[str, Any]:
    """This process's peak RSS, and the bytes it read and wrote since `io_start` (None: not
    known)."""
    now = _io_bytes()
    known = now is not None and io_start is not None
    return {
        "peak_rss_mb": _peak_rss_mb(),
        "bytes_read": now[0] - io_start[0] if known else None,  # type: ignore[index]
        "bytes_written": now[1] - io_start[1] if known else None,  # type: ignore[index]
    }


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _check_request(
    models: Sequence[LoadedModel],
    inference: InferenceSettings,
    output: Path,
    probabilities: Path | None,
    postprocess: MaskSettings,
    parts: int | None,
    part: int | None,
    finish_only: bool,
    post: str | None = None,
) -> MaskSettings:
    """The post-processing the mask applies (`check_mask_settings`), after checking the request
    before any read: a request the predict cannot do is one line."""
    if output.suffix not in OME_SUFFIXES + TIFF_SUFFIXES:
        raise CtsegError(
            f"{output}: the output of a volume read in place is an OME-Zarr image <name>.zarr "
            "or a TIFF <name>.tif"
        )
    windows = {inference.with_window(m.patch).window for m in models}
    if len(windows) > 1:
        raise CtsegError(
            f"{output}: the run's models were trained on the patches {sorted(windows)}; the "
            "members of a combined run are blended with one window: give --window Z,Y,X"
        )
    labels = models[0].labels
    applied = check_mask_settings(postprocess, labels, output)
    if probabilities is not None and probabilities.suffix != ".zarr":
        raise CtsegError(f"{probabilities}: --probabilities here is an OME-Zarr <name>.zarr")
    if parts is None and (part is not None or finish_only or post is not None):
        raise CtsegError("--part, --post and --finish go with --parts N")
    if parts is not None:
        if parts < 1:
            raise CtsegError(f"--parts {parts}: expected a positive number")
        if post is not None and finish_only:
            raise CtsegError(f"--post {post} and --finish: give one")
        if post is None and (part is None) == (not finish_only):
            raise CtsegError(f"--parts {parts}: give --part K (0..{parts - 1}) or --finish")
        if part is not None and not 0 <= part < parts:
            raise CtsegError(f"--part {part}: expected 0 <= part < --parts {parts}")
    return applied


def _kinds(
    output: Path, probabilities: Path | None, labels: LabelSpec
) -> dict[str, tuple[Path, str]]:
    """Each output option's path and the kind of output it will be."""
    kinds = {"-o": (output, MASK if labels.is_binary else LABEL_MAP)}
    if probabilities is not None:
        kinds["--probabilities"] = (probabilities, PROBABILITIES)
    return kinds


def member_folders(root: Path, members: int) -> list[Path]:
    """Each model's work folder: the predict's own for one model; ``member-<i>/`` in it for
    each model of a combined run, so that each resumes on its own tiles."""
    return [root] if members == 1 else [root / f"member-{i}" for i in range(members)]


def predict_scroll(
    run_name: str,
    models: Sequence[LoadedModel],
    weights_sha256: Sequence[str | None],
    url: str,
    output: Path,
    inference: InferenceSettings,
    postprocess: MaskSettings,
    *,
    weights: Sequence[float] = (1.0,),
    weights_from: str = "--weights",
    level: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    probabilities: Path | None = None,
    parts: int | None = None,
    part: int | None = None,
    finish_only: bool = False,
    post: str | None = None,
    cache_mb: float | None = None,
    given_range: tuple[float, float] | None = None,
    dataset_spacing: tuple[float, float, float] | None = None,
    overwrite: bool = False,
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The mask of the volume at `url` by the run's models (averaged with `weights`) into
    `output`, or with `parts` part `part` or the finish (module docstring); returns the figures.
    Outputs are checked first; their spacing is the input's NGFF scale, else `dataset_spacing`."""
    output = Path(output)
    io_start = _io_bytes()
    postprocess = _check_request(models, inference, output, probabilities, postprocess,
                                 parts, part, finish_only, post)  # fmt: skip
    norm = check_weights(weights, len(models), weights_from)
    labels = models[0].labels
    root = work_folder_of(output)
    check_output_paths(url, _kinds(output, probabilities, labels), root, overwrite, command)
    # Freed activations stay in the heap (no page faults each forward); each tile's memory is
    # handed back when the tile is done (`ctseg.inference.tiled`), so the budget holds for RSS.
    tune_malloc()
    settings = inference.with_window(models[0].patch)
    device = settings.torch_device()
    budget = int(settings.memory_budget_mb * 2**20)
    cache = int(cache_mb * 2**20) if cache_mb is not None else int(budget * CACHE_SHARE)
    tile_settings = _with_budget(settings, (budget * TILE_SHARE) / 2**20, budget - cache)
    source = open_source(url, level, storage_options)
    share = f"half of --memory-budget-mb {settings.memory_budget_mb:g}"
    folders = member_folders(root, len(models))
    block = _fits_budget(source, postprocess, budget, folders, tile_settings, device, labels, share)
    for loaded in models:
        warm_up(loaded.model, settings, device)
    rss_before = _rss_mb()  # the models and their activations, the store's libraries imported
    low, high, how, stats_read = shared_intensity_range(root, source, given_range, budget)
    print(f"predict: {source.describe()}\npredict: intensity range {low:g}..{high:g}, {how}",
          file=sys.stderr)  # fmt: skip
    computes = not finish_only and post is None  # the others run where the parts ran or not
    works = [
        open_work(
            folder, source, tile_settings, device, low, high, sha, labels, share, computes=computes
        )  # fmt: skip
        for folder, sha in zip(folders, weights_sha256, strict=True)
    ]
    summary: dict[str, Any] = {
        "run": run_name,
        "input": source.describe(),
        "intensity_range": [low, high],
        "statistics_bytes_read": stats_read,
        "tile": list(works[0].grid.tile),
        "tiles": len(works[0].grid.tiles()),
        "models": len(models),
        "work": str(root),
        "rss_before_mb": rss_before,
        # What `--post` runs between the parts and the finish (none: the finish does a label map)
        "post_rounds": [name for name, _ in post_rounds(postprocess)] if labels.is_binary else [],
    }
    if not finish_only and post is None:
        k, n = (part, parts) if part is not None else (0, 1)
        summary["part"] = _compute_part(models, works, source, tile_settings, device, k, n, cache)
        if part is not None:
            return {**summary, **_process_figures(io_start)}
    t0 = time.perf_counter()
    spacing, spacing_from = _spacing(source, dataset_spacing)
    source_record = {"url": source.url, "level": source.level, "intensity_range": [low, high],
                     "spacing": spacing, "spacing_from": spacing_from}  # fmt: skip
    record = functools.partial(provenance, run=run_name, weights_sha256=list(weights_sha256),
                               weights=norm, inference=settings.as_dict(),
                               postprocess=postprocess.as_dict(), labels=labels.to_dict(),
                               source=source_record)  # fmt: skip
    made = _Finishing(works, norm, root, block, parts or 1, postprocess, labels, source, output,
                      record, spacing, budget)  # fmt: skip
    if post is not None:
        summary["post"] = made.post_job(post, part)
    else:
        summary["finish"] = made.seams()
        release_heap()
        summary["outputs"] = made.outputs(probabilities)
        remove_path(root)
    summary.update(finish_seconds=time.perf_counter() - t0, **_process_figures(io_start))
    return summary


def _fits_budget(
    source: VolumeSource,
    postprocess: MaskSettings,
    budget: int,
    folders: Sequence[Path],
    tile_settings: InferenceSettings,
    device: torch.device,
    labels: LabelSpec,
    share: str,
) -> Shape3:
    """The post-processing's blocks (`mask_block`), after checking that they and each model's
    first tile fit the budget: settings whose halos or tiles do not fit are refused before the
    volume is read and before any folder is made, not after hours of tiles."""
    block = mask_block(output_chunks(source), source.shape, postprocess, budget)
    for folder in folders:
        planned_tile(folder, source, tile_settings, device, output_channels(labels), share)
    return block


def _spacing(
    source: VolumeSource, dataset_spacing: tuple[float, float, float] | None
) -> tuple[tuple[float, ...] | None, str]:
    """The outputs' voxel spacing and where it comes from (said in the log): the input's own
    NGFF scale, else the run's dataset plan, else none (1 per axis)."""
    if source.spacing is not None:
        spacing, where = source.spacing, "the input's NGFF scale"
    elif dataset_spacing is not None:
        spacing, where = dataset_spacing, "the run's dataset plan"
    else:
        spacing, where = None, "none recorded: 1 per axis"
    print(f"predict: voxel spacing {spacing or '1, 1, 1'} ({where})", file=sys.stderr)
    return spacing, where


def _compute_part(
    models: Sequence[LoadedModel],
    works: Sequence[Work],
    source: VolumeSource,
    settings: InferenceSettings,
    device: torch.device,
    part: int,
    parts: int,
    cache: int,
) -> dict[str, Any]:
    """Part `part` of `parts` of every model's tiles, one model after another; the log's line
    and the figures are over them all."""
    done = []
    who = f"part {part + 1} of {parts} (--part {part})" if parts > 1 else "the predict"
    for loaded, work in zip(models, works, strict=True):
        # Each tile is renamed into place whole, so a part stopped by a full disk goes on.
        with disk_full_is_an_error(work.folder, f"{who} wrote its tiles", after=RESUME_AFTER_FULL):
            done.append(run_part(loaded.model, work, source, settings, device, part, parts, cache))
    merged = _merged_parts(done)
    print(_part_line(merged), file=sys.stderr)
    return merged


def _merged_parts(done: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One part's figures over the models of a combined run: the counts and bytes summed (each
    model reads the input for its own tiles), the read amplification over them all."""
    if len(done) == 1:
        return dict(done[0])
    summed = ("tiles", "tiles_computed", "tiles_resumed", "windows", "skipped_windows",
              "chunks_final", "bytes_fetched", "bytes_of_region", "seconds")  # fmt: skip
    merged = {**done[0], **{key: sum(d[key] for d in done) for key in summed}}
    region = merged["bytes_of_region"]
    merged["read_amplification"] = merged["bytes_fetched"] / region if region else 0.0
    merged["models"] = [dict(d) for d in done]
    return merged


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
def _blocks(
    shape: Shape3, block: Shape3, z_range: tuple[int, int] | None = None
) -> Iterator[tuple[slice, slice, slice]]:
    """The blocks of a volume, z-major; with `z_range`, those starting in [start, stop)."""
    ranges = [range(0, s, b) for s, b in zip(shape, block, strict=True)]
    if z_range is not None:
        ranges[0] = range(z_range[0], z_range[1], block[0])
    for corner in itertools.product(*ranges):
        yield tuple(  # type: ignore[misc]
            slice(c, min(c + b, s)) for c, b, s in zip(corner, block, shape, strict=True)
        )


class _Finishing:
    """What comes after the tiles, for the finish and the post-processing jobs (``--post``):
    the final probabilities of a z-range (its seams, the members' weighted mean), the mask's
    store and its post-processing's jobs (`ctseg.postprocess.blockwise.BlockwiseJobs`, over
    as many z-ranges as there are parts) in the work folder, then the outputs renamed into
    place. The store and the jobs' folder are named by a digest of the mask's record, the
    block and the parts: a finish of other settings starts its own."""

    def __init__(
        self,
        works: Sequence[Work],
        weights: Sequence[float],
        root: Path,
        block: Shape3,
        parts: int,
        postprocess: MaskSettings,
        labels: LabelSpec,
        source: VolumeSource,
        output: Path,
        record: Callable[[str], dict[str, Any]],
        spacing: tuple[float, ...] | None,
        budget: int,
    ) -> None:
        self.budget = budget
        self.works, self.weights, self.root, self.block = works, weights, root, block
        self.postprocess, self.labels, self.source, self.output = (
            postprocess,
            labels,
            source,
            output,
        )
        self.record, self.spacing, self.shape = record, spacing, source.shape
        self.parts = parts
        self.ranges = z_ranges(self.shape, block, parts)  # the post-processing jobs' z-ranges
        self.chunks: Shape3 = tuple(works[0].manifest["chunks"])  # type: ignore[assignment]
        self.mask_record = record(MASK if labels.is_binary else LABEL_MAP)
        plan = {"mask": self.mask_record, "block": list(block), "parts": parts,
                "output": output.suffix}  # fmt: skip
        digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
        self.folder = root / "postprocess" / digest
        self.probs = self._probabilities()
        self.store = made_once(self.folder / "mask.zarr", self._make_store)
        level = zarr.open_array(self.store / "0" if self._ome() else self.store, mode="r+")
        self.out = level
        self.jobs = (
            BlockwiseJobs(self.probs, level, postprocess, block, self.folder / "jobs", parts)
            if labels.is_binary
            else None
        )

    def _ome(self) -> bool:
        return self.output.suffix in OME_SUFFIXES

    def _make_store(self, path: Path) -> None:
        """An NGFF label image (its classes' names and colours) for an OME-Zarr output, a plain
        array for a TIFF's."""
        if not self._ome():
            create_volume(path, self.shape, np.uint8, self.chunks)
            return
        names = channel_names(self.labels)
        colours = label_colors(len(names))
        if self.labels.is_binary:  # a mask holds 0 and 1 whatever the dataset's foreground value
            classes = {0: LabelClass(names[0], colours[0]), 1: LabelClass(names[1], colours[1])}
        else:
            classes = {
                self.labels.labels[n]: LabelClass(n, c) for n, c in zip(names, colours, strict=True)
            }
        create_image(path, self.shape, np.uint8, self.chunks, spacing=self.spacing,
                     name="mask" if self.labels.is_binary else "labels", label_values=classes,
                     attributes={PROVENANCE_KEY: self.mask_record})  # fmt: skip

    def _probabilities(self) -> zarr.Array:
        """The one model's probabilities, or the store of the models' weighted mean."""
        members = [work.probabilities() for work in self.works]
        if len(members) == 1:
            return members[0]
        first = members[0]
        path = made_once(self.root / "probabilities.zarr", lambda tmp: create_volume(
            tmp, first.shape, np.float16, first.chunks, write_empty_chunks=False))  # fmt: skip
        return zarr.open_array(path, mode="r+")

    def seams(self, k: int | None = None) -> list[dict[str, Any]]:
        """Make the probabilities of z-range `k` (None: all) final: each model's seams (every
        tile must be done), then the weighted mean of the models (`ctseg.inference.ensemble.
        weighted_mean`, block by block: the folder predict's arithmetic). Each range once: a
        marker records it."""
        ranges = range(self.parts) if k is None else [k]
        done = []
        for r in ranges:
            marker = self.root / "postprocess" / f"probabilities-{r}-of-{self.parts}.done"
            if marker.exists():
                continue
            z_range = self.ranges[r]
            done.append([finish(work, self.parts, z_range) for work in self.works])
            if len(self.works) > 1:
                self._mean(z_range)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        return [figures for per_range in done for figures in per_range]

    def _mean(self, z_range: tuple[int, int]) -> None:
        members = [work.probabilities() for work in self.works]
        lead = (slice(None),) * (self.probs.ndim - 3)
        for box in _blocks(self.shape, self.block, z_range):
            where = (*lead, *box)
            shape = (*self.probs.shape[:-3], *(b.stop - b.start for b in box))
            self.probs[where] = weighted_mean(
                lambda i, where=where: np.asarray(members[i][where]), self.weights, shape
            )

    def post_job(self, name: str, k: int | None) -> dict[str, Any]:
        """Post-processing job `name` (a round of `BlockwiseJobs.rounds`): its range `k`, after
        making that range's probabilities final; or with `k` None its merge."""
        if self.jobs is None:
            raise CtsegError(
                f"--post {name}: a label map is post-processed by --finish; --post is for a "
                "binary mask"
            )
        rounds = dict(self.jobs.rounds)
        if name not in rounds:
            raise CtsegError(
                f"--post {name}: these settings' post-processing rounds are "
                f"{', '.join(rounds)}; give one of them"
            )
        t0 = time.perf_counter()
        if k is None:
            if rounds[name] != COMPONENTS:
                raise CtsegError(
                    f"--post {name}: only a component round has a merge; give --part K"
                )
            self.jobs.merge(name)
        else:
            self.seams(k)
            self.jobs.run_range(name, k)
            if name == self.jobs.rounds[-1][0]:  # the range's mask is final: its pyramid
                self._range_pyramid(k)
        return {"round": name, "range": k, "seconds": time.perf_counter() - t0}

    def _range_pyramid(self, k: int) -> None:
        """The pyramid levels' chunks that range `k` of the mask alone makes (`build_pyramid`
        with its z-range), once: a marker records it."""
        marker = self.folder / "jobs" / f"pyramid-{k}.done"  # goes with the jobs' results
        if self._ome() and not marker.exists():
            group = zarr.open_group(self.store, mode="r+")
            build_pyramid(group, "mode", self.budget // 4, z_range=self.ranges[k])
            marker.touch()

    def outputs(self, probabilities: Path | None) -> dict[str, Any]:
        """The mask (or label map), then the probabilities asked for; each renamed into place
        whole, with its record (`ctseg.inference.outputs.provenance`) and the voxel spacing as
        its scale. A multi-class run's probabilities are an image with a channel per class."""
        done: dict[str, Any] = {"mask": str(self.output)}
        if self.jobs is not None:
            self.jobs.run()
            done.update(self.jobs.counts(), post_rounds=[name for name, _ in self.jobs.rounds])
        else:
            done.update(self._label_map())
        if self._ome() and self.jobs is not None:  # the ranges' chunks, then the rest
            for k in range(self.parts):
                self._range_pyramid(k)
            group = zarr.open_group(self.store, mode="r+")
            build_pyramid(group, "mode", self.budget // 4, done=self.ranges)
        elif self._ome():
            build_pyramid(zarr.open_group(self.store, mode="r+"), "mode", self.budget // 4)
        # The jobs' results go first: were the mask lost in the rename below, a rerun would
        # make it again rather than find every job done.
        remove_path(self.folder / "jobs")
        with fresh_output(self.output, what=f"write the mask of {self.source.url}") as tmp:
            if self._ome():
                os.replace(self.store, tmp)
            else:
                pages = (np.asarray(self.out[z]) for z in range(self.shape[0]))
                tifffile.imwrite(tmp, pages, shape=self.shape, dtype=np.uint8,
                                 photometric="minisblack", metadata=None,
                                 description=tiff_description(self.mask_record))  # fmt: skip
        if probabilities is not None:
            self._write_probabilities(probabilities, self.budget)
            done["probabilities"] = str(probabilities)
        return done

    def _label_map(self) -> dict[str, Any]:
        """A multi-class run's label map block by block, each class's settings applied as the
        binary ones are (`ctseg.postprocess.classes.blockwise_class_masks`)."""
        postprocess, labels = self.postprocess, self.labels
        assert isinstance(postprocess, ClassSettings)  # check_mask_settings made it one
        names = channel_names(labels)
        counts = np.zeros(len(names), dtype=np.int64)
        scratch = self.folder / "classes"
        masks, steps = blockwise_class_masks(self.probs, postprocess, self.block, scratch)
        for box in _blocks(self.shape, self.block):
            stored = join_block(
                np.asarray(self.probs[(slice(None), *box)]), postprocess, masks, box
            )
            self.out[box] = labels.from_stored(stored)
            counts += np.bincount(stored.ravel(), minlength=len(names))
        remove_path(scratch)
        return {
            "classes": labels.n_classes,
            "class_settings": postprocess.as_dict()["classes"],
            "class_steps": steps,
            "class_voxels": {name: int(n) for name, n in zip(names, counts, strict=True)},
            "foreground_voxels": int(counts[1:].sum()),
        }

    def _write_probabilities(self, probabilities: Path, budget: int) -> None:
        names = channel_names(self.labels)
        with fresh_output(probabilities, what="write the probabilities") as tmp:
            group = create_image(tmp, self.shape, np.float16, self.chunks, spacing=self.spacing,
                                 name="probabilities",
                                 channels=None if self.labels.is_binary else names,
                                 attributes={PROVENANCE_KEY: self.record(PROBABILITIES)},
                                 )  # fmt: skip
            lead = (slice(None),) * (self.probs.ndim - 3)  # a multi-class store's channels
            for box in _blocks(self.shape, self.block):
                group["0"][(*lead, *box)] = self.probs[(*lead, *box)]
            build_pyramid(group, "mean", budget // 4)
