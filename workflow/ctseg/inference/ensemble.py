"""Ensembles: the weighted mean of several runs' probabilities, and weights tuned by the score.

An ensemble is ``config/ensembles/<name>.yaml`` (schema: workflow/schemas/ensemble.schema.yaml)::

    name: ens_demo
    members: [exp001, exp001_cv.fold0, exp001_cv.fold1]  # experiments, or folds <exp>.fold<i>
    weights: [2, 1, 1]          # one number >= 0 per member (divided by their sum), or `tuned`
    tune_step: null             # grid step for `tuned` (null: `default_step`)

`load_ensemble` checks it against the runs that exist (the caller says which: a mapping of
experiment name to its ``split.folds``, a set of names, or a callable). Every problem is a
one-line `CtsegError` naming the file.

`ensemble_volume` writes ``results/<name>/probabilities/<id>.zarr``: sum_i w_i p_i / sum_i w_i
of the members' float16 stores, in the format `ctseg.inference.run.infer_volume` writes (float16,
the first member's chunks, the same attributes plus ``ensemble``), so post-processing, tuning and
evaluation read it unchanged. It streams z-slabs: at most ``memory_budget_mb`` holds the slab's
float32 sum, one member's float16 slab, its float32 product and the float16 result (12 bytes a
voxel), whatever the number of members (zarr's decoded chunks come on top: bench/ensemble.py
measured a flat 12.7 MB peak under a 16 MB budget as the volume grew 4x). Members must agree
on the shape and on the sliding-window settings infer records (`WINDOW_ATTRIBUTES`): a mean of
differently blended maps is not what either model was scored with, so that is an error naming
both files.

Multi-class members (stores of shape (C, Z, Y, X), one softmax channel per class) are averaged
channel by channel, the same weighted mean of every channel, so the mean's channels still sum to
1; the members must agree on their classes and label spec (the ``classes`` and ``labels``
attributes `ctseg.inference.run.infer_volume` writes), which the result keeps. A member of
other classes, or a binary member among multi-class ones, is an error naming both files.
`tune_weights` scores binary masks only: it refuses multi-class members.

`tune_weights` chooses the weights by the exact competition score (`ctseg.postprocess.tuning.
competition_score`, the functions of `ctseg.evaluation.metrics`) of the ensemble thresholded with
the default post-processing (`ctseg.postprocess.masks.PostprocessSettings()`: threshold 0.5, nothing
else), on held-out probabilities with labels: the members' common val split, or out-of-fold
probabilities, never the test split (the caller passes the files). The candidates are the
points of the weight simplex on a grid of step 1/k (`weight_grid`: C(k + m - 1, m - 1) points
for m members; step 0.25 gives 5, 15 and 35 points for 2, 3 and 4 members), scored in order of
distance from equal weights, and a point replaces the best only when it scores strictly higher,
so ties keep the most even weights. The threshold is fixed while the weights are chosen:
post-processing is tuned afterwards on the ensemble's own probabilities (`ctseg
tune-postprocess`), as for an experiment. Each candidate's mean is computed by the same
function as `ensemble_volume`'s, so the values scored are the values written.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from ctseg.config import check_weights, default_step
from ctseg.io import CtsegError, atomic_path, check_id, strict_json
from ctseg.postprocess.write import CLASSES_ATTRIBUTE, LABELS_ATTRIBUTE
from ctseg.store import WEIGHTS_ATTRIBUTE, create_volume, open_volume

# What ctseg.inference.run.infer_volume records about its blending; members must agree on all of
# them.
WINDOW_ATTRIBUTES = ("window", "overlap", "tta_flips", "blending")
# float32 sum + float32 weighted member + float16 member slab + float16 result, per voxel (and
# per channel of a multi-class store).
BYTES_PER_VOXEL = 12
MAX_GRID_POINTS = 512
WEIGHTS_JSON = "weights.json"


# ----------------------------------------------------------------------------- stores
def open_member(path: Path) -> zarr.Array:
    """A probability store written by `ctseg infer` (or `ctseg ensemble`), checked: 3D, or 4D
    (C, Z, Y, X) with the names of its C channels."""
    path = Path(path)
    if not path.exists():
        raise CtsegError(f"{path}: probability store not found")
    try:
        arr = open_volume(path)
    except Exception as exc:
        raise CtsegError(
            f"{path}: cannot open the probability store as a Zarr array: {exc}"
        ) from exc
    if arr.ndim not in (3, 4) or 0 in arr.shape:
        raise CtsegError(f"{path}: expected a non-empty 3D probability volume, got {arr.shape}")
    if arr.ndim == 4 and not isinstance(arr.attrs.get(CLASSES_ATTRIBUTE), list):
        raise CtsegError(
            f"{path}: a 4D store of shape {arr.shape} without the {CLASSES_ATTRIBUTE!r} "
            "attribute: not a multi-class probability store of ctseg infer"
        )
    missing = [k for k in WINDOW_ATTRIBUTES if k not in arr.attrs]
    if missing:
        raise CtsegError(
            f"{path}: no {'/'.join(missing)} attribute: not a probability store of ctseg infer"
        )
    return arr


def open_members(paths: Sequence[Path]) -> list[zarr.Array]:
    """Every member store; classes, a shape or a sliding-window setting that differs from the
    first member's is an error naming both files."""
    arrays = [open_member(Path(p)) for p in paths]
    first, ref = Path(paths[0]), arrays[0]
    for path, arr in zip(paths[1:], arrays[1:], strict=True):
        for key in (CLASSES_ATTRIBUTE, LABELS_ATTRIBUTE):
            a, b = ref.attrs.get(key), arr.attrs.get(key)
            if a != b:
                raise CtsegError(
                    f"members disagree: {first} has {key} {_or_binary(a)}, {path} has "
                    f"{key} {_or_binary(b)}: an ensemble averages models of the same classes"
                )
        if tuple(arr.shape) != tuple(ref.shape):
            raise CtsegError(
                f"members disagree: {first} has shape {tuple(ref.shape)}, {path} has shape "
                f"{tuple(arr.shape)}: ensemble probabilities of the same volume"
            )
        for key in WINDOW_ATTRIBUTES:
            a, b = ref.attrs[key], arr.attrs[key]
            if a != b:
                raise CtsegError(
                    f"members disagree: {first} has {key}={a!r}, {path} has {key}={b!r}: "
                    "infer every member with the same window, overlap and TTA"
                )
    return arrays


def _or_binary(value: Any) -> str:
    return "none (a binary store)" if value is None else repr(value)


def weighted_mean(
    read: Callable[[int], np.ndarray], weights: Sequence[float], shape: Sequence[int]
) -> np.ndarray:
    """sum_i weights[i] * read(i) in float32, as float16; members of weight 0 are not read.

    `weights` are already divided by their sum. Both `ensemble_volume` and `tune_weights` use
    this, so the tuned values are the written ones; a weight of 1 reproduces a member exactly.
    """
    total = np.zeros(tuple(shape), np.float32)
    term = np.empty_like(total)
    for i, w in enumerate(weights):
        if w == 0:
            continue
        np.multiply(read(i), np.float32(w), out=term)
        total += term
    return total.astype(np.float16)


def slab_depth(shape: Sequence[int], chunk_z: int, memory_budget_mb: float) -> int:
    """z-planes per slab under the budget: whole output chunks when one fits, else fewer.
    `shape` is (Z, Y, X), or (C, Z, Y, X): a plane of each of the C channels."""
    channels = math.prod(int(s) for s in shape[:-3])
    depth, height, width = (int(s) for s in shape[-3:])
    plane = BYTES_PER_VOXEL * channels * height * width
    planes = max(1, int(memory_budget_mb * 2**20) // plane)
    if planes >= chunk_z:
        planes -= planes % chunk_z  # every output chunk written once
    return min(planes, depth)


def ensemble_volume(
    members: Sequence[Path],
    weights: Sequence[float],
    out: Path,
    *,
    memory_budget_mb: float = 512,
    where: str = "--weights",
) -> dict[str, Any]:
    """The weighted mean of the members' probability stores, written atomically to `out`."""
    members = [Path(p) for p in members]
    if len(members) < 1:
        raise CtsegError("ensemble: no members")
    if not memory_budget_mb > 0:
        raise CtsegError(f"memory_budget_mb={memory_budget_mb!r}: expected > 0")
    norm = check_weights(weights, len(members), where)
    arrays = open_members(members)
    ref = arrays[0]
    shape = tuple(int(s) for s in ref.shape)
    lead = (slice(None),) * (len(shape) - 3)  # a multi-class store's channels
    depth = slab_depth(shape, int(ref.chunks[-3]), memory_budget_mb)
    attributes = {
        **{k: v for k, v in dict(ref.attrs).items() if k not in ("ensemble", WEIGHTS_ATTRIBUTE)},
        "ensemble": {"members": [str(p) for p in members], "weights": norm},
    }
    weights_files = [a.attrs.get(WEIGHTS_ATTRIBUTE) for a in arrays]
    if all(isinstance(w, list) for w in weights_files):  # every member says what made it
        attributes[WEIGHTS_ATTRIBUTE] = [d for w in weights_files for d in w]
    t0 = time.perf_counter()
    with atomic_path(out) as tmp:
        store = create_volume(tmp, shape, np.float16, ref.chunks, attributes=attributes)
        for z0 in range(0, shape[-3], depth):
            z1 = min(z0 + depth, shape[-3])
            where_z = (*lead, slice(z0, z1))
            store[where_z] = weighted_mean(
                lambda i, where_z=where_z: np.asarray(arrays[i][where_z]),
                norm,
                (*shape[:-3], z1 - z0, *shape[-2:]),
            )
    seconds = time.perf_counter() - t0
    return {
        "out": str(out),
        "shape": list(shape),
        "members": [str(p) for p in members],
        "weights": norm,
        "slab_depth": depth,
        "slabs": math.ceil(shape[-3] / depth),
        "slab_mb": BYTES_PER_VOXEL * math.prod(shape[:-3]) * depth * shape[-2] * shape[-1] / 2**20,
        "seconds": seconds,
    }


# ----------------------------------------------------------------------------- tuning
def weight_grid(n_members: int, step: float) -> list[tuple[float, ...]]:
    """Every point of the simplex {w >= 0, sum w = 1} with coordinates multiple of `step`,
    nearest to equal weights first (ties: more weight on earlier members first)."""
    k = round(1 / step)
    if n_members < 1 or k < 1 or abs(k * step - 1) > 1e-9:
        raise CtsegError(f"weight grid: step {step} for {n_members} members: expected 1/k")
    size = math.comb(k + n_members - 1, n_members - 1)
    if size > MAX_GRID_POINTS:
        raise CtsegError(
            f"weight grid: {size} points for {n_members} members at step {step} (more than "
            f"{MAX_GRID_POINTS}): use a coarser tune_step"
        )
    points = [
        tuple(c / k for c in combo)
        for combo in itertools.product(range(k + 1), repeat=n_members)
        if sum(combo) == k
    ]
    even = 1 / n_members
    return sorted(points, key=lambda w: (sum((x - even) ** 2 for x in w), tuple(-x for x in w)))


def _record_id(path: Path) -> str:
    return check_id(Path(path).name.removesuffix(".zarr"), path)


def check_held_out(
    members: Sequence[tuple[str, Sequence[Path]]], labels: Sequence[Path]
) -> list[str]:
    """The ids every member's stores cover, in order; the same count and ids for every member
    and one label per id, else an error naming the member."""
    if len(members) < 2:
        raise CtsegError(f"tune-ensemble: {len(members)} member(s): an ensemble needs at least 2")
    names = [name for name, _ in members]
    if len(set(names)) != len(names):
        raise CtsegError(f"tune-ensemble: member names repeat: {names}")
    first_name, first = members[0]
    ids = [_record_id(Path(p)) for p in first]
    if not ids:
        raise CtsegError(f"tune-ensemble: member {first_name!r} has no probability stores")
    for name, paths in members[1:]:
        other = [_record_id(Path(p)) for p in paths]
        if other != ids:
            raise CtsegError(
                f"tune-ensemble: member {name!r} has stores for ids {other}, member "
                f"{first_name!r} for {ids}: pass the same volumes in the same order"
            )
    if len(labels) != len(ids):
        raise CtsegError(f"tune-ensemble: {len(ids)} volumes per member but {len(labels)} labels")
    return ids


def _score_grid(job: tuple[list[Path], Path, list[tuple[float, ...]], str]) -> list[float]:
    """One held-out volume's score at every grid point (module-level: a pool pickles it)."""
    from ctseg.evaluation.metrics import read_volume
    from ctseg.postprocess.masks import PostprocessSettings, binary_mask
    from ctseg.postprocess.tuning import competition_score

    paths, label_path, grid, topo_method = job
    arrays = [np.asarray(a[...]) for a in open_members(paths)]
    label = read_volume(Path(label_path))
    if label.shape != arrays[0].shape:
        raise CtsegError(
            f"shape mismatch: probabilities {paths[0]} have shape {arrays[0].shape}, "
            f"label {label_path} has shape {label.shape}"
        )
    out = []
    for weights in grid:
        mean = weighted_mean(arrays.__getitem__, weights, label.shape)
        mask, _ = binary_mask(mean, PostprocessSettings())
        out.append(competition_score(mask, label, topo_method)["score"])  # type: ignore[arg-type]
    return out


def tune_weights(
    members: Sequence[tuple[str, Sequence[Path]]],
    labels: Sequence[Path],
    out: Path,
    *,
    step: float | None = None,
    topo_method: str = "betti_matching",
    workers: int = 1,
) -> dict[str, Any]:
    """Weights chosen by the competition score on held-out volumes; writes `out` (weights.json).

    `members` are (name, probability stores) pairs, every member's stores for the same ids in
    the same order, `labels` the label TIFFs of those ids. A volume's member probabilities are
    held whole (float16, plus the float32 mean: the score needs the whole mask); ``workers``
    processes score volumes in parallel, one volume each, with the same result as one.
    """
    from ctseg.evaluation.metrics import TOPO_METHODS
    from ctseg.postprocess.masks import PostprocessSettings

    if topo_method not in TOPO_METHODS:
        raise CtsegError(f"topo_method={topo_method!r}: expected one of {list(TOPO_METHODS)}")
    if workers < 1:
        raise CtsegError(f"workers={workers!r}: expected >= 1")
    ids = check_held_out(members, labels)
    for name, stores in members:
        first = open_member(Path(stores[0]))
        if first.ndim == 4:
            raise CtsegError(
                f"tune-ensemble: member {name!r}: {stores[0]} holds the probabilities of "
                f"classes {first.attrs[CLASSES_ATTRIBUTE]}; the weights are tuned by the binary "
                "competition score only: give the ensemble fixed weights"
            )
    n = len(members)
    step = default_step(n) if step is None else float(step)
    grid = weight_grid(n, step)
    jobs = [
        ([Path(stores[v]) for _, stores in members], Path(labels[v]), grid, topo_method)
        for v in range(len(ids))
    ]
    t0 = time.perf_counter()
    if workers > 1 and len(jobs) > 1:
        # spawn, as tune-postprocess and evaluate: no fork of a process holding threads.
        context = get_context("spawn")
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
            per_volume = list(pool.map(_score_grid, jobs))
    else:
        per_volume = [_score_grid(job) for job in jobs]
    scores = [
        {rid: vol[g] for rid, vol in zip(ids, per_volume, strict=True)} for g in range(len(grid))
    ]
    settings = PostprocessSettings()
    rows = [
        {"weights": list(w), "score": float(np.mean(list(s.values()))), "scores": s}
        for w, s in zip(grid, scores, strict=True)
    ]
    best = rows[0]
    for row in rows[1:]:
        if row["score"] > best["score"]:  # strictly: ties keep the more even weights
            best = row
    names = [name for name, _ in members]
    singles = {
        name: next(r["score"] for r in rows if r["weights"][i] == 1.0)
        for i, name in enumerate(names)
    }
    summary = {
        "members": names,
        "weights": best["weights"],
        "score": best["score"],
        "first_candidate": rows[0],
        "member_scores": singles,
        "ids": ids,
        "step": step,
        "grid_size": len(grid),
        "postprocess": settings.as_dict(),
        "topo_method": topo_method,
        "seconds": time.perf_counter() - t0,
        "grid": rows,
    }
    with atomic_path(out) as tmp:
        tmp.write_text(strict_json(summary, indent=1) + "\n")
    return summary


def load_weights(path: Path, names: Sequence[str] | None = None) -> list[float]:
    """The weights weights.json chose; with `names`, the members must be those, in that order."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CtsegError(f"{path}: weights not found (run ctseg tune-ensemble)") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CtsegError(f"{path}: cannot read the ensemble weights: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("weights"), list):
        raise CtsegError(f'{path}: no "weights" list (not written by ctseg tune-ensemble?)')
    if names is not None and list(data.get("members", [])) != list(names):
        raise CtsegError(
            f"{path}: weights are for members {data.get('members')}, not {list(names)}: "
            "rerun ctseg tune-ensemble for these members"
        )
    check_weights(data["weights"], len(data["weights"]), str(path))
    return [float(w) for w in data["weights"]]
