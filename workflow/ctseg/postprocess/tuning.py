"""Post-processing chosen by the competition score on the val split's probabilities.

Top solutions of the Vesuvius surface-detection competition gained 0.02 to 0.035 from
post-processing chosen against the score (docs/metric.md, "What the field found"): the threshold,
hysteresis (in 3D and along z), removing small components, filling holes, plugging small holes
slice by slice, patching large holes in sheets, a morphological closing. `tune_postprocess`
searches these settings (`ctseg.postprocess.masks.PostprocessSettings`) on probability stores
already written by `ctseg infer` (the model is not run again) against their labels, scoring every
candidate with the exact competition score (`ctseg.evaluation.metrics`, Betti matching by default),
and writes

* ``tuned.json``: the settings applied, their mean score, the default's (threshold 0.5 and
  nothing else) and the gain over it, the search's best candidate, the search space and its
  size, and ``made_with``: the weights files (their sha256) and ensemble weights the
  probabilities were made with (`made_with`), which `ctseg predict` checks against the run's
  weights before it applies the settings;
* ``candidates.csv``: one row per candidate scored: the stage, the settings, the mean score and
  its three terms, and each volume's score.

The search is a bounded coordinate search, one setting at a time, each stage starting from the
best so far (`dataclasses.replace` of it, so a stage keeps every setting chosen before it; a full
grid over eight settings would cost thousands of exact scores per volume):

1. ``threshold``: every threshold of the grid (0.5 always among them);
2. ``refine``: the best threshold +- ``refine_step``;
3. ``hysteresis``: with the best threshold t, for each offset d the pairs (low t, high t + d),
   which drop weak blobs that never reach t + d, and (low t - d, high t), which keep weak
   voxels attached to surface above t; then each fixed pair of ``hysteresis_pairs`` (the 8th
   place's 0.5/0.9). Every pair in each mode of ``hysteresis_modes``, all 3D ones first: ``z``
   keeps a weak voxel only when its own z-slice connects it to a confident one
   (`ctseg.postprocess.masks.hysteresis_z`);
4. ``min_component``: each minimum component size with the best binarisation;
5. ``fill_holes``: 3D cavity filling on top of the best;
6. ``plug_holes``: each area of ``plug_holes_max_area``: enclosed holes up to that many voxels
   filled in every slice along z, y and x (`ctseg.postprocess.masks.plug_holes`);
7. ``patch_holes``: each area of ``patch_holes_max_area`` above the chosen plug area: larger
   holes filled where they lie inside a sheet (`ctseg.postprocess.masks.patch_holes`);
8. ``closing``: each radius of ``closing_radii`` (`ctseg.postprocess.masks.close`, a cube of side 2r
+ 1).

The order of 4 to 8 is the 1st place's (small components, plug, large holes, closing). At most
``max_candidates`` candidates (`SearchSpace.stage_bounds` per stage: 9 + 2 + 10 + 4 + 1 + 2 + 2
+ 2 = 32 with the defaults; 20 with stages 6 to 8, the fixed pairs and the z mode off, the
search before they existed, which it then repeats candidate for candidate) are scored on each
volume; the log, tuned.json (``search``) and candidates.csv (``max_candidates``) say that bound.
A candidate already scored in an earlier stage is not scored again. A candidate replaces the
best only when it scores strictly higher, so ties keep the simpler settings found first. The
search is greedy: a new kind of candidate that wins a stage (hysteresis along z) changes the
base of every later stage, so it can end below the search without that kind, on the very
volumes it tunes on; where none wins, the later stages are those of the search without it.

Candidates that cannot win are pruned, not scored: the exact TopoScore (Betti matching) is most
of a score's cost, and most of all on the noisy masks of low thresholds. Every candidate first
gets an upper bound of its score: its exact SurfaceDice and VOI, and TopoScore with each
dimension's matched count m_k replaced by min(p_k, g_k) (the feature counts alone, no matching;
the score rises with every m_k), and m_0 also by the bound that the union's components give
(`ctseg.evaluation.betti_matching.dim0_bound`, within a few of m_0 where min(p_0, g_0) is tens
above it). The candidate of highest bound is scored exactly first, then
every other whose bound is not below the best mean known by then; a pruned candidate's exact
mean is at most its bound, so it could not have been chosen, and the search chooses exactly
what scoring every candidate would. candidates.csv keeps pruned candidates with their bound
(``score_bound``, ``pruned``) and no score; the default (threshold 0.5) is always scored.

Each stage's candidates of one volume are scored together, by one process: the label's side of
the score (`ctseg.evaluation.metrics.LabelSide`: its ignore mask, surfel borders, components and
tiles' feature counts) is computed once per volume and reused by every candidate, as are the
tiles and whole masks that a candidate shares bit for bit with one already scored; the
diagnostics Dice and clDice are not computed. Masks are built through
`ctseg.postprocess.masks.MaskCache`: a stage's candidates are the best so far with one later
step changed, so each step's result (the hysteresis, the component removal, the plugging, ...)
is built once per volume and shared, bit for bit, by every candidate built on it (a closing
candidate costs one closing, not the whole mask again). A process keeps these caches for the
last volume it scored only: one that scores another volume in between (several volumes in one
process, or a pool that hands a volume's next job to another process) starts them afresh.
``workers`` is the number of cores: a process per volume up to that many (spawned, like
`ctseg evaluate`), the cores left over as threads inside each
(`ctseg.evaluation.metrics.plan_workers`; a process needs about `metrics.WORKER_MEMORY_GB` at
320^3). The score is the same function either way, so a parallel search gives the same result as
a serial one.

A val split with no labelled foreground, or less than ``MIN_FOREGROUND_VOXELS`` surface voxels
in all, is not searched: the score of near-empty labels is decided by the empty cases of its
terms (a prediction of nothing scores SurfaceDice 0 or 1), so a search there fits noise (on
such a split it once chose threshold 0.1 with hole filling: 99.5% foreground). tuned.json then
keeps the default settings and says why (``tuned: false``, ``reason``), and so do the log and
the report.

A multi-class model's stores (`ctseg.postprocess.classes`) are searched class by class: each
class's probability where it wins the argmax, against its label stores' voxels of that class
(the ignored voxels ignored), from its default ``ARGMAX`` (threshold 0: its argmax voxels, among
the first stage's thresholds; hysteresis pairs may start there), scored by the same competition
score. tuned.json's ``settings`` are then ``{"classes": {name: settings}}``, its ``classes``
each class's summary (as a binary search's), its ``score`` and ``default`` the means over the
classes; candidates.csv has a ``class`` column. The classes are chosen independently: a voxel
that two classes' masks claim goes to the more probable (`ctseg.postprocess.classes.join`),
which the per-class scores do not see; the evaluation of the masks does.

The search's best is applied only when it beats the defaults by more than ``MIN_GAIN`` (0.001)
in mean score; otherwise the defaults are kept, for the same outputs' ``tuned: false`` and
``reason``, with the best candidate in ``best_candidate`` and candidates.csv's ``chosen`` on
the default. So are they when the candidates cannot be told apart (every one scored the same:
on an all-zero probability volume every mask is empty, and the first threshold, 0.1, would
otherwise win the tie).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import zarr

from ctseg.evaluation.classes import read_label_store
from ctseg.evaluation.metrics import (
    TOPO_METHODS,
    UNION_BOUND,
    LabelSide,
    TopoMethod,
    competition_terms,
    overlap_terms,
    plan_workers,
    read_label,
    topo_counts,
    with_topology,
)
from ctseg.io import CtsegError, atomic_path, check_id, strict_json
from ctseg.labels import LabelSpec
from ctseg.postprocess.classes import ARGMAX, ClassSettings, MaskSettings, class_probability
from ctseg.postprocess.masks import (
    CLOSING_RADII,
    HYSTERESIS_MODES,
    MaskCache,
    PostprocessSettings,
    settings_from_mapping,
)
from ctseg.postprocess.write import store_labels
from ctseg.progress import Progress
from ctseg.store import WEIGHTS_ATTRIBUTE

DEFAULT_SETTINGS = PostprocessSettings()
TUNED_JSON = "tuned.json"
CANDIDATES_CSV = "candidates.csv"
STAGES = (
    "threshold",
    "refine",
    "hysteresis",
    "min_component",
    "fill_holes",
    "plug_holes",
    "patch_holes",
    "closing",
)
SCORE_TERMS = ("score", "surface_dice", "voi_score", "topo_score")
# Fewer labelled surface voxels than this over the whole val split (a 2-voxel sheet of about
# 22 x 22 voxels) and the search is not run: see the module docstring.
MIN_FOREGROUND_VOXELS = 1000
# A candidate is pruned only when its bound is below the best exact mean by more than this: the
# bound is computed by the same arithmetic as the score, so it is never below it, and the margin
# keeps the proof free of any assumption about rounding.
PRUNE_MARGIN = 1e-9
# The search's best replaces the defaults only when its mean score is higher by more than this:
# a thousandth of the score's [0, 1] range, a twentieth of the least gain the competition's top
# solutions found in post-processing (0.02). Less is the noise of a val split of a few volumes,
# and with nothing to go on (every candidate tied) it is no gain at all.
MIN_GAIN = 0.001
# The winners' stages off (the fixed hysteresis pair, hysteresis along z, plugging, patching,
# closing): the 20-candidate search as it was before them, `SearchSpace(**WINNERS_STAGES_OFF)`.
WINNERS_STAGES_OFF: dict[str, tuple] = {
    "hysteresis_pairs": (),
    "hysteresis_modes": ("3d",),
    "plug_holes_max_area": (),
    "patch_holes_max_area": (),
    "closing_radii": (),
}


@dataclass(frozen=True)
class SearchSpace:
    thresholds: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    refine_step: float = 0.05
    hysteresis_offsets: tuple[float, ...] = (0.1, 0.2)
    min_component_voxels: tuple[int, ...] = (16, 64, 256, 1024)
    fill_holes: bool = True
    hysteresis_modes: tuple[str, ...] = HYSTERESIS_MODES
    hysteresis_pairs: tuple[tuple[float, float], ...] = ((0.5, 0.9),)  # the 8th place's
    plug_holes_max_area: tuple[int, ...] = (16, 64)
    patch_holes_max_area: tuple[int, ...] = (256, 1024)
    closing_radii: tuple[int, ...] = (1, 2)

    def __post_init__(self) -> None:
        if not self.thresholds or any(not 0 < t < 1 for t in self.thresholds):
            raise CtsegError(f"thresholds {list(self.thresholds)}: expected values in (0, 1)")
        if not 0 <= self.refine_step < 1:
            raise CtsegError(f"refine_step={self.refine_step!r}: expected 0 <= step < 1")
        if any(not 0 < d < 1 for d in self.hysteresis_offsets):
            raise CtsegError(
                f"hysteresis_offsets {list(self.hysteresis_offsets)}: expected values in (0, 1)"
            )
        if any(isinstance(n, bool) or int(n) != n or n < 1 for n in self.min_component_voxels):
            raise CtsegError(
                f"min_component_voxels {list(self.min_component_voxels)}: expected integers "
                ">= 1 (keeping every component is always a candidate)"
            )
        if not self.hysteresis_modes or any(
            m not in HYSTERESIS_MODES for m in self.hysteresis_modes
        ):
            raise CtsegError(
                f"hysteresis_modes {list(self.hysteresis_modes)}: expected one or more of "
                f"{list(HYSTERESIS_MODES)}"
            )
        for pair in self.hysteresis_pairs:
            if len(pair) != 2 or not 0 < pair[0] < pair[1] < 1:
                raise CtsegError(
                    f"hysteresis_pairs {[list(p) for p in self.hysteresis_pairs]}: expected "
                    "[low, high] pairs with 0 < low < high < 1"
                )
        for name in ("plug_holes_max_area", "patch_holes_max_area"):
            areas = getattr(self, name)
            if any(isinstance(a, bool) or int(a) != a or a < 1 for a in areas):
                raise CtsegError(
                    f"{name} {list(areas)}: expected integers >= 1 (none: the stage is off)"
                )
        if any(isinstance(r, bool) or r not in CLOSING_RADII[1:] for r in self.closing_radii):
            raise CtsegError(
                f"closing_radii {list(self.closing_radii)}: expected values among "
                f"{list(CLOSING_RADII[1:])} (none: no closing)"
            )

    def grid(self) -> list[float]:
        """The stage-1 thresholds: the grid plus the default 0.5, sorted, without repeats."""
        return sorted({_round(t) for t in (*self.thresholds, DEFAULT_SETTINGS.threshold)})

    def pairs(self) -> list[tuple[float, float]]:
        """The fixed hysteresis pairs, rounded, without repeats, in the order given."""
        return list(dict.fromkeys((_round(lo), _round(hi)) for lo, hi in self.hysteresis_pairs))

    def modes(self) -> list[str]:
        """The hysteresis modes, 3D first (ties then keep the plain 3D hysteresis)."""
        return [m for m in HYSTERESIS_MODES if m in self.hysteresis_modes]

    def stage_bounds(self) -> dict[str, int]:
        """Each stage's candidates per volume at most (fewer when values leave (0, 1), repeat
        or were scored in an earlier stage)."""
        return {
            "threshold": len(self.grid()),
            "refine": 2 if self.refine_step > 0 else 0,
            "hysteresis": (2 * len(self.hysteresis_offsets) + len(self.pairs()))
            * len(self.modes()),
            "min_component": len(set(self.min_component_voxels)),
            "fill_holes": 1 if self.fill_holes else 0,
            "plug_holes": len(set(self.plug_holes_max_area)),
            "patch_holes": len(set(self.patch_holes_max_area)),
            "closing": len(set(self.closing_radii)),
        }

    def max_candidates(self) -> int:
        """Candidates scored per volume at most: the sum of `stage_bounds`."""
        return sum(self.stage_bounds().values())

    def describe(self) -> str:
        """The bound as the log says it: `at most 32 candidates per volume (threshold 9 + ...)`."""
        parts = " + ".join(f"{k} {n}" for k, n in self.stage_bounds().items() if n)
        return f"at most {self.max_candidates()} candidates per volume ({parts})"

    def bound_sum(self) -> str:
        """The bound as a sum, stage by stage: `9 + 2 + 10 + 4 + 1 + 2 + 2 + 2 = 32`."""
        terms = [str(n) for n in self.stage_bounds().values() if n]
        return f"{' + '.join(terms)} = {self.max_candidates()}"

    def config(self) -> dict[str, Any]:
        """The space as config ``infer.tune`` states it (lists; a pair as ``[low, high]``):
        for the default space, what config/config.yaml, the config schema's defaults and
        config/README.md state (tests/test_tuning.py checks them against it)."""
        return {f.name: _config_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def option_text(self, name: str) -> str:
        """A field's values as ``ctseg tune-postprocess`` takes them (``0.1 0.2``, pairs as
        ``0.5,0.9``, ``none`` for no values): its help reads the default space's here."""
        value = getattr(self, name)
        if isinstance(value, bool):
            return "tried" if value else "not tried"
        if not isinstance(value, tuple):
            return f"{value:g}"
        items = [",".join(f"{x:g}" for x in v) if isinstance(v, tuple) else v for v in value]
        return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in items) or "none"

    def as_dict(self) -> dict[str, Any]:
        return {
            "thresholds": self.grid(),
            "refine_step": self.refine_step,
            "hysteresis_offsets": list(self.hysteresis_offsets),
            "min_component_voxels": sorted(set(self.min_component_voxels)),
            "fill_holes": self.fill_holes,
            "hysteresis_modes": self.modes(),
            "hysteresis_pairs": [list(p) for p in self.pairs()],
            "plug_holes_max_area": sorted(set(self.plug_holes_max_area)),
            "patch_holes_max_area": sorted(set(self.patch_holes_max_area)),
            "closing_radii": sorted(set(self.closing_radii)),
            "stage_bounds": self.stage_bounds(),
            "max_candidates": self.max_candidates(),
        }


@dataclass(frozen=True)
class Volume:
    """A val volume: its probability store and its label. `channel`: the class searched, for
    a multi-class store (its `class_probability`, against its label store's voxels of that
    class); None for a binary store and its label TIFF."""

    id: str
    probabilities: Path
    label: Path
    channel: int | None = None


@dataclass
class Candidate:
    stage: str
    settings: PostprocessSettings
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # volume id -> terms
    # volume id -> terms with TopoScore's upper bound (m_k = min(p_k, g_k)): what the search
    # knows of a candidate before, or instead of, its exact score
    bounds: dict[str, dict[str, float]] = field(default_factory=dict)

    def mean(self, term: str = "score") -> float:
        """The mean over the volumes of the exact term; NaN for a pruned candidate."""
        if not self.scores:
            return math.nan
        return float(np.mean([s[term] for s in self.scores.values()]))

    def bound(self) -> float:
        """The mean score's upper bound (each volume's score with TopoScore's bound)."""
        return float(np.mean([s["score"] for s in self.bounds.values()]))

    @property
    def pruned(self) -> bool:
        """Not scored exactly: its bound was below a score the search already had."""
        return not self.scores


def _config_value(value: Any) -> Any:
    return [_config_value(v) for v in value] if isinstance(value, tuple) else value


def _round(x: float) -> float:
    """Grid values without float noise (0.1 + 0.2 is not 0.3)."""
    return round(float(x), 4)


# ----------------------------------------------------------------------------- scoring
def competition_score(
    pred: np.ndarray, gt: np.ndarray, topo_method: TopoMethod = "betti_matching"
) -> dict[str, float]:
    """The competition score of one volume and its three terms, as
    `ctseg.evaluation.metrics.score_volume` computes them (its functions), without the diagnostics
    Dice and clDice that the search does
    not need (clDice's skeletons cost more than the score's other terms)."""
    label = LabelSide.of(np.asarray(gt))
    result = competition_terms(label.prepare(pred), label, topo_method=topo_method)
    return {term: result[term] for term in SCORE_TERMS}


def _open_probabilities(path: str | Path) -> zarr.Array:
    from ctseg.store import open_volume

    try:
        return open_volume(path)
    except Exception as exc:
        raise CtsegError(f"{path}: cannot open the probability store: {exc}") from exc


def store_classes(path: str | Path) -> LabelSpec | None:
    """The label spec of a multi-class probability store (`store_labels`' checks), or None for
    a binary one."""
    arr = _open_probabilities(path)
    return store_labels(arr, Path(path)) if arr.ndim == 4 else None


@functools.lru_cache(maxsize=1)
def _volume_masks(path: str, channel: int | None) -> MaskCache:
    """A probability volume's masks (of class `channel`'s `class_probability` for a
    multi-class store), each step's result kept while its candidates are scored
    (`ctseg.postprocess.masks.MaskCache`)."""
    arr = _open_probabilities(path)
    if channel is not None:
        store_labels(arr, Path(path))
        return MaskCache(class_probability(np.asarray(arr[...]), channel))
    if arr.ndim != 3:
        raise CtsegError(f"{path}: expected a 3D probability volume, got shape {arr.shape}")
    return MaskCache(np.asarray(arr[...]))


def volume_label(v: Volume) -> np.ndarray:
    """The volume's label as the competition codes it (0 background, 1 foreground, 2 ignored):
    the label TIFF of a binary store (`read_label`'s checks); for a class of a multi-class
    store, its label store's voxels of that class, the ignored ones ignored."""
    if v.channel is None:
        return read_label(v.label)
    spec = store_classes(v.probabilities)
    assert spec is not None
    gt = read_label_store(v.label, spec)
    return np.where(spec.stored().ignored(gt), 2, gt == v.channel).astype(np.uint8)


@dataclass
class _LabelState:
    """A val volume's label side and what its candidates share: the tiles' counts, each
    candidate's mask (bit-packed, with its digest) and each mask's SurfaceDice and VOI."""

    side: LabelSide
    tiles: dict = field(default_factory=dict)
    masks: dict = field(default_factory=dict)  # settings -> (digest, packed bits)
    overlap: dict = field(default_factory=dict)  # digest -> overlap_terms

    def mask_of(self, masks: MaskCache, settings: dict[str, Any]) -> tuple[bytes, np.ndarray]:
        """The candidate's prepared mask and its digest (built once per candidate: the exact
        pass comes after the bound pass; on the steps it shares with earlier candidates,
        `masks`)."""
        from ctseg.evaluation.metrics import _digest

        key = tuple(sorted(settings.items()))
        if key in self.masks:
            digest, packed = self.masks[key]
            shape = self.side.gt.shape
            return digest, np.unpackbits(packed, count=int(np.prod(shape))).view(bool).reshape(
                shape
            )
        mask = masks.mask(PostprocessSettings(**settings))
        pred_bin = self.side.prepare(mask)
        digest = _digest(pred_bin)
        self.masks[key] = (digest, np.packbits(pred_bin))
        return digest, pred_bin


@functools.lru_cache(maxsize=1)
def _label_state(volume: Volume, threads: int) -> _LabelState:
    # The same reader (and checks) as evaluate's; kept while this volume's candidates are scored.
    return _LabelState(LabelSide.of(volume_label(volume), threads))


def _score_volume_job(
    job: tuple[Volume, list[dict[str, Any]], str, int, bool],
) -> list[dict[str, float]]:
    """One volume's terms for a list of candidates: with `exact`, the exact score; else the
    score with TopoScore's upper bound (no Betti matching: `UNION_BOUND`, or under
    "betti_counts", the search's own method, that method's score). Module-level so a
    process pool can pickle it. Candidates whose masks (after the ignore step) are equal share
    their SurfaceDice and VOI, and tiles equal bit for bit share their counts."""
    volume, settings_list, topo_method, threads, exact = job
    masks = _volume_masks(str(volume.probabilities), volume.channel)
    state = _label_state(volume, threads)
    if masks.probs.shape != state.side.gt.shape:
        raise CtsegError(
            f"shape mismatch: probabilities {volume.probabilities} have shape "
            f"{masks.probs.shape}, label {volume.label} has shape {state.side.gt.shape}"
        )
    method = topo_method if exact or topo_method == "betti_counts" else UNION_BOUND
    results = []
    for settings in settings_list:
        digest, pred_bin = state.mask_of(masks, settings)
        if digest not in state.overlap:
            state.overlap[digest] = overlap_terms(pred_bin, state.side, threads=threads)
        counts, used = topo_counts(
            pred_bin,
            state.side.gt,
            method,  # type: ignore[arg-type]
            label_tiles=state.side.tiles,
            threads=threads,
            tile_cache=state.tiles,
        )
        terms = with_topology(state.overlap[digest], counts, used)
        results.append({term: terms[term] for term in SCORE_TERMS})
    return results


def _pool_init(threads: int) -> None:
    """A scoring process keeps to its share of the cores (numba's pool would take them all)."""
    import numba

    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


class _Scorer:
    """Scores candidates on every volume, in-process or in a pool, with one progress bar."""

    def __init__(
        self,
        volumes: Sequence[Volume],
        workers: int,
        topo_method: str,
        total: int,
        default: PostprocessSettings,
    ) -> None:
        self.volumes = list(volumes)
        self.topo_method = topo_method
        self.default = default
        processes, self.threads = plan_workers(workers, len(self.volumes))
        self.pool = (
            ProcessPoolExecutor(
                processes,
                mp_context=get_context("spawn"),
                initializer=_pool_init,
                initargs=(self.threads,),
            )
            if processes > 1
            else None
        )
        self.bar = Progress(total=total * len(self.volumes), desc="tune-postprocess", unit="score")

    def score(self, candidates: Sequence[Candidate], exact: bool) -> None:
        """Each candidate's terms on every volume: exact (`Candidate.scores`) or with
        TopoScore's bound (`Candidate.bounds`)."""
        if not candidates:
            return
        settings = [c.settings.as_dict() for c in candidates]
        jobs = [(v, settings, self.topo_method, self.threads, exact) for v in self.volumes]
        mapped = (
            self.pool.map(_score_volume_job, jobs) if self.pool else map(_score_volume_job, jobs)
        )
        for v, results in zip(self.volumes, mapped, strict=True):
            for c, result in zip(candidates, results, strict=True):
                (c.scores if exact else c.bounds)[v.id] = result
            if exact:
                self.bar.update(len(candidates))

    def score_stage(self, fresh: Sequence[Candidate], best: float) -> None:
        """Score a stage's candidates exactly where they could win; prune the rest.

        Every candidate first gets its bound (SurfaceDice, VOI, and TopoScore with m_k =
        min(p_k, g_k), which needs no Betti matching). The candidate of highest bound is then
        scored exactly, and after it every candidate whose bound is not below the best exact
        mean known (`best`, the search's best so far, or this stage's first). A pruned
        candidate's exact mean is at most its bound, so below a mean the stage has: the
        search chooses what it would have chosen by scoring every candidate. The default
        settings are always scored (tuned.json reports the gain over them)."""
        self.score(fresh, exact=False)
        if self.topo_method == "betti_counts":  # the bound is the score itself
            for c in fresh:
                c.scores = dict(c.bounds)
            self.bar.update(len(fresh) * len(self.volumes))
            return
        # The highest bound first, with the default: their exact scores set the bar. The rest
        # that could still beat it are then scored together, one job per volume (a worker
        # reads a volume's label side once per job, so one job per candidate would read it
        # again and again on a real val split).
        ranked = sorted(fresh, key=Candidate.bound, reverse=True)  # stable: ties in order
        first = [c for c in fresh if c.settings == self.default or c is ranked[0]]
        self.score(first, exact=True)
        known = max([best, *(c.mean() for c in first)])
        rest = [c for c in ranked if c.pruned and c.bound() >= known - PRUNE_MARGIN]
        self.score(rest, exact=True)
        self.bar.update(sum(c.pruned for c in fresh) * len(self.volumes))  # decided by bound

    def close(self) -> None:
        self.bar.close()
        if self.pool is not None:
            self.pool.shutdown()


# ----------------------------------------------------------------------------- search
def _stage_candidates(
    stage: str,
    best: PostprocessSettings,
    space: SearchSpace,
    lowest: float = DEFAULT_SETTINGS.threshold,
) -> list[PostprocessSettings]:
    """A stage's candidates, each the best so far with that stage's setting changed (replace,
    never a constructor call by position: a later stage must keep what an earlier one chose).
    `lowest`: the default's threshold, the lowest a hysteresis pair may start at (a class's
    default 0 is its argmax voxels; a binary model's thresholds are above 0)."""
    return list(dict.fromkeys(_stage_settings(stage, best, space, lowest)))


def _stage_settings(
    stage: str,
    best: PostprocessSettings,
    space: SearchSpace,
    lowest: float = DEFAULT_SETTINGS.threshold,
) -> list[PostprocessSettings]:
    replace = dataclasses.replace
    t = best.threshold
    if stage == "refine":
        step = space.refine_step
        return [
            replace(best, threshold=_round(x))
            for x in (t - step, t + step)
            if step > 0 and 0 < x < 1
        ]
    if stage == "hysteresis":
        pairs = []
        for d in space.hysteresis_offsets:
            pairs += [(t, t + d), (t - d, t)]
        pairs += space.pairs()
        return [
            replace(best, threshold=_round(low), hysteresis_high=_round(high), hysteresis_mode=m)
            for m in space.modes()
            for low, high in pairs
            if (low > 0 or low == lowest) and low < high < 1
        ]
    if stage == "min_component":
        return [
            replace(best, min_component_voxels=int(n))
            for n in sorted(set(space.min_component_voxels))
        ]
    if stage == "fill_holes":
        if not space.fill_holes or best.fill_holes:
            return []
        return [replace(best, fill_holes=True)]
    if stage == "plug_holes":
        return [
            replace(best, plug_holes_max_area=int(a))
            for a in sorted(set(space.plug_holes_max_area))
        ]
    if stage == "patch_holes":
        # Holes up to the plug area are already filled: patching up to it would change nothing.
        return [
            replace(best, patch_holes_max_area=int(a))
            for a in sorted(set(space.patch_holes_max_area))
            if a > best.plug_holes_max_area
        ]
    if stage == "closing":
        return [replace(best, closing_radius=int(r)) for r in sorted(set(space.closing_radii))]
    raise ValueError(f"unknown stage {stage!r}")


def search(
    volumes: Sequence[Volume],
    space: SearchSpace = SearchSpace(),
    *,
    workers: int = 1,
    topo_method: TopoMethod = "betti_matching",
    default: PostprocessSettings = DEFAULT_SETTINGS,
) -> tuple[Candidate, list[Candidate]]:
    """The best candidate (highest mean score over the volumes) and every candidate scored.
    `default`: the settings the gain is measured against, always scored, its threshold among
    the first stage's (a class of a label map: `ctseg.postprocess.classes.ARGMAX`)."""
    if not volumes:
        raise CtsegError("nothing to tune on: no volume with probabilities and a label")
    if workers < 1:
        raise CtsegError(f"workers must be at least 1, got {workers}")
    if topo_method not in TOPO_METHODS:
        raise CtsegError(f"unknown topo_method {topo_method!r}; use one of {TOPO_METHODS}")
    scored: dict[PostprocessSettings, Candidate] = {}
    thresholds = sorted({*space.grid(), default.threshold})
    bound = search_bound(space, default)
    scorer = _Scorer(volumes, min(workers, bound * len(volumes)), topo_method, bound, default)
    try:
        first = [Candidate("threshold", PostprocessSettings(threshold=t)) for t in thresholds]
        scorer.score_stage(first, -math.inf)
        scored.update((c.settings, c) for c in first)
        # The first of equals (the simplest); pruned candidates score below the best.
        best = max((c for c in first if not c.pruned), key=Candidate.mean)
        for stage in STAGES[1:]:
            fresh = [
                Candidate(stage, s)
                for s in _stage_candidates(stage, best.settings, space, default.threshold)
                if s not in scored
            ]
            scorer.score_stage(fresh, best.mean())
            scored.update((c.settings, c) for c in fresh)
            for c in fresh:
                if not c.pruned and c.mean() > best.mean():
                    best = c
    finally:
        scorer.close()
        # The in-process path caches volumes by path: a later search must read them afresh.
        _volume_masks.cache_clear()
        _label_state.cache_clear()
    return best, list(scored.values())


def search_bound(space: SearchSpace, default: PostprocessSettings = DEFAULT_SETTINGS) -> int:
    """Candidates `search` scores per volume at most: the space's, and the default's
    threshold where the grid lacks it."""
    return space.max_candidates() + (default.threshold not in space.grid())


def candidates_table(
    candidates: Sequence[Candidate], best: Candidate, max_candidates: int | None = None
) -> pd.DataFrame:
    """One row per candidate; ``max_candidates`` (the search's bound, on every row) says how
    many rows the search could have had."""
    rows = []
    for i, c in enumerate(candidates):
        row: dict[str, Any] = {"candidate": i, "stage": c.stage, **c.settings.as_dict()}
        row["label"] = c.settings.label()
        row.update({term: c.mean(term) for term in SCORE_TERMS})
        row["score_bound"] = c.bound() if c.bounds else math.nan
        row["pruned"] = c.pruned
        row.update({f"score_{vid}": s["score"] for vid, s in c.scores.items()})
        row["chosen"] = c is best
        row["max_candidates"] = max_candidates
        rows.append(row)
    return pd.DataFrame(rows)


def _method(space: SearchSpace) -> str:
    stages = [k for k, n in space.stage_bounds().items() if n]
    return "coordinate search: " + ", ".join(stages)


def tune_postprocess(
    volumes: Sequence[Volume],
    out_dir: Path,
    space: SearchSpace = SearchSpace(),
    *,
    workers: int = 1,
    topo_method: TopoMethod = "betti_matching",
) -> dict[str, Any]:
    """Search, then write ``<out_dir>/tuned.json`` and ``<out_dir>/candidates.csv``
    (each to a temporary path, renamed when complete); returns what tuned.json holds. The
    stores of a multi-class model are searched class by class (`_tune_classes`)."""
    ids = [v.id for v in volumes]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise CtsegError(f"volumes with the same id {duplicates}: their scores would collide")
    if not volumes:
        raise CtsegError("nothing to tune on: no volume with probabilities and a label")
    t0 = time.perf_counter()
    made = made_with(volumes)
    specs = {v.probabilities: store_classes(v.probabilities) for v in volumes}
    classes = specs[volumes[0].probabilities]
    for path, spec in specs.items():
        if spec != classes:
            raise CtsegError(
                f"{path}: {spec.describe() if spec else 'binary'} probabilities, but "
                f"{volumes[0].probabilities} holds {classes.describe() if classes else 'binary'} "
                "ones: the val volumes' probabilities must come from one model's classes"
            )
    if classes is None:
        summary, table = _tune(volumes, space, workers, topo_method, DEFAULT_SETTINGS, "")
    else:
        summary, table = _tune_classes(volumes, classes, space, workers, topo_method)
    summary.update(volumes=ids, made_with=made, seconds=time.perf_counter() - t0)
    _write_outputs(Path(out_dir), summary, table)
    return summary


def _tune_classes(
    volumes: Sequence[Volume],
    classes: LabelSpec,
    space: SearchSpace,
    workers: int,
    topo_method: TopoMethod,
) -> tuple[dict[str, Any], pd.DataFrame]:
    """Each class of a label map searched on its own (`Volume.channel`), from its default
    (`ARGMAX`): tuned.json's "settings" are the `ClassSettings` of the classes' choices, its
    "classes" each class's summary; candidates.csv has a row per class and candidate."""
    per_class, tables = {}, []
    for channel, name in enumerate(classes.classes, start=1):
        class_volumes = [dataclasses.replace(v, channel=channel) for v in volumes]
        t0 = time.perf_counter()
        summary, table = _tune(class_volumes, space, workers, topo_method, ARGMAX, f" {name}")
        per_class[name] = {**summary, "seconds": time.perf_counter() - t0}
        tables.append(table.assign(**{"class": name}))
    chosen = ClassSettings(
        tuple((name, settings_from_mapping(c["settings"], name)) for name, c in per_class.items())
    )
    scores = [c["score"] for c in per_class.values()]
    defaults = [c["default"]["score"] for c in per_class.values()]
    scored = None not in scores and None not in defaults
    tuned = [name for name, c in per_class.items() if c["tuned"]]
    table = pd.concat(tables, ignore_index=True)
    summary = {
        "tuned": bool(tuned),
        "reason": None if tuned else "no class's search beat its default (the argmax)",
        "settings": chosen.as_dict(),
        "label": chosen.label(),
        "score": float(np.mean(scores)) if scored else None,
        "default": {
            "settings": ClassSettings.argmax(classes).as_dict(),
            "label": ClassSettings.argmax(classes).label(),
            "score": float(np.mean(defaults)) if scored else None,
        },
        "gain_over_default": float(np.mean(scores) - np.mean(defaults)) if scored else None,
        "classes": per_class,
        "min_gain": MIN_GAIN,
        "topo_method": topo_method,
        "candidates": sum(c["candidates"] for c in per_class.values()),
        "pruned": sum(c["pruned"] for c in per_class.values()),
        "search": {"method": "per class: " + _method(space), **space.as_dict()},
        "candidates_csv": CANDIDATES_CSV,
    }
    return summary, table[["class", *(c for c in table.columns if c != "class")]]


def _tune(
    volumes: Sequence[Volume],
    space: SearchSpace,
    workers: int,
    topo_method: TopoMethod,
    default_settings: PostprocessSettings,
    what: str,
) -> tuple[dict[str, Any], pd.DataFrame]:
    """One search from `default_settings` (`what`: the class searched, for the log), or none
    where the labels have too little foreground; its summary and candidates' table."""
    log = f"tune-postprocess{what}"
    foreground = labelled_foreground(volumes)
    reason = untunable_reason(foreground)
    default_dict = {
        "settings": default_settings.as_dict(),
        "label": default_settings.label(),
        "score": None,
    }
    common = {
        "min_gain": MIN_GAIN,
        "topo_method": topo_method,
        "foreground_voxels": foreground,
        "min_foreground_voxels": MIN_FOREGROUND_VOXELS,
        "candidates_csv": CANDIDATES_CSV,
    }
    if reason is not None:
        print(f"{log}: not tuned, default settings kept: {reason}", file=sys.stderr)
        summary = {
            "tuned": False,
            "reason": reason,
            "settings": default_settings.as_dict(),
            "label": default_settings.label(),
            "score": None,
            "terms": {},
            "default": default_dict,
            "gain_over_default": None,
            "best_candidate": None,
            "candidates": 0,
            "pruned": 0,
            "search": {"method": "not run: " + reason, **space.as_dict()},
            **common,
        }
        return summary, pd.DataFrame(columns=_CANDIDATE_COLUMNS)
    best, candidates = search(
        volumes, space, workers=workers, topo_method=topo_method, default=default_settings
    )
    default = next(c for c in candidates if c.settings == default_settings)
    reason = keep_defaults_reason(best, default, candidates)
    applied = best if reason is None else default
    summary = {
        "tuned": reason is None,
        "reason": reason,
        "settings": applied.settings.as_dict(),
        "label": applied.settings.label(),
        "score": applied.mean(),
        "terms": {term: applied.mean(term) for term in SCORE_TERMS[1:]},
        "default": {**default_dict, "score": default.mean()},
        "gain_over_default": applied.mean() - default.mean(),
        "best_candidate": {
            "settings": best.settings.as_dict(),
            "label": best.settings.label(),
            "score": best.mean(),
            "gain_over_default": best.mean() - default.mean(),
        },
        "candidates": len(candidates),
        "pruned": sum(c.pruned for c in candidates),
        "search": {"method": _method(space), **space.as_dict()},
        **common,
    }
    bound = search_bound(space, default_settings)
    table = candidates_table(candidates, applied, bound)
    outcome = (
        f"chosen {best.settings.label()} (mean score {best.mean():.4f}, default "
        f"{default.mean():.4f})"
        if reason is None
        else f"best {best.settings.label()} (mean score {best.mean():.4f}, default "
        f"{default.mean():.4f}), not applied"
    )
    print(
        f"{log}: {len(candidates)} candidates scored of at most {bound} per volume "
        f"({summary['pruned']} pruned: their bound was below a score already found); {outcome}",
        file=sys.stderr,
    )
    if reason is not None:
        print(f"{log}: not tuned, default settings kept: {reason}", file=sys.stderr)
    return summary, table


def keep_defaults_reason(
    best: Candidate, default: Candidate, candidates: Sequence[Candidate]
) -> str | None:
    """Why the search's best should not replace the defaults, or None: the candidates cannot
    be told apart (every one scored the same mean: the probabilities carry nothing the score
    can see, as an all-zero volume does), or the best beats the defaults by no more than
    `MIN_GAIN`."""
    means = {c.mean() for c in candidates if not c.pruned}
    if len(means) == 1 and not any(c.pruned for c in candidates):
        return (
            f"the candidates cannot be told apart: all {len(candidates)} have the same mean "
            f"score ({best.mean():.4f})"
        )
    gain = best.mean() - default.mean()
    if gain <= MIN_GAIN:
        return (
            f"the best candidate, {best.settings.label()} (mean score {best.mean():.4f}), beats "
            f"the defaults ({default.mean():.4f}) by {gain:.4f}, not by more than the "
            f"{MIN_GAIN} needed to replace them"
        )
    return None


_CANDIDATE_COLUMNS = ["candidate", "stage", *PostprocessSettings().as_dict(), "label"]
_CANDIDATE_COLUMNS += [*SCORE_TERMS, "score_bound", "pruned", "chosen", "max_candidates"]


def _write_outputs(out_dir: Path, summary: dict[str, Any], table: pd.DataFrame) -> None:
    text = strict_json(summary, indent=1)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Both written to temporaries first, then renamed one after the other: a failure on the
    # way leaves the previous pair as it was, never a new table beside an old choice.
    with (
        atomic_path(out_dir / CANDIDATES_CSV) as csv_tmp,
        atomic_path(out_dir / TUNED_JSON) as json_tmp,
    ):
        table.to_csv(csv_tmp, index=False)
        json_tmp.write_text(text)


def made_with(volumes: Sequence[Volume]) -> dict[str, Any] | None:
    """The weights files the volumes' probabilities were made with (their sha256, from
    `ctseg.store.WEIGHTS_ATTRIBUTE`: each volume's own, so a cross-validation's out-of-fold
    volumes name one fold each) and an ensemble's weights, or None where a store does not say
    (written before ctseg recorded it). tuned.json keeps it, so that `ctseg predict` refuses
    settings tuned for weights the run no longer has. Ensemble weights that differ between
    volumes are an error: the search would tune on a mix of ensembles."""
    from ctseg.store import open_volume

    files: set[str] = set()
    mixes: dict[str, Volume] = {}
    for v in volumes:
        attrs = dict(open_volume(v.probabilities).attrs)
        digests = attrs.get(WEIGHTS_ATTRIBUTE)
        if not isinstance(digests, list):
            return None
        files.update(digests)
        mixes.setdefault(json.dumps((attrs.get("ensemble") or {}).get("weights")), v)
    if len(mixes) > 1:
        first, other = list(mixes.values())[:2]
        raise CtsegError(
            f"{other.probabilities}: made with other ensemble weights than "
            f"{first.probabilities}: the val volumes' probabilities must come from one "
            "ensemble; rerun the ensemble for the run"
        )
    if not mixes:
        return None
    return {WEIGHTS_ATTRIBUTE: sorted(files), "ensemble_weights": json.loads(next(iter(mixes)))}


def labelled_foreground(volumes: Sequence[Volume]) -> dict[str, int]:
    """Foreground voxels (label 1: surface, or the class searched) of each volume's label,
    read with evaluate's checks (`volume_label`)."""
    return {v.id: int(np.count_nonzero(volume_label(v) == 1)) for v in volumes}


def untunable_reason(foreground: dict[str, int]) -> str | None:
    """Why a search on volumes with these foreground counts would fit noise, or None."""
    total = sum(foreground.values())
    if total == 0:
        return f"no labelled foreground (label 1) in the {len(foreground)} val volume(s)"
    if total < MIN_FOREGROUND_VOXELS:
        return (
            f"only {total} labelled foreground voxels (label 1) in the {len(foreground)} val "
            f"volume(s), fewer than the {MIN_FOREGROUND_VOXELS} needed to tune on"
        )
    return None


def volumes_from_paths(probabilities: Sequence[Path], labels: Sequence[Path]) -> list[Volume]:
    """Pair `<id>.zarr` probability stores with their labels (same order), ids from the names."""
    if len(probabilities) != len(labels):
        raise CtsegError(f"{len(probabilities)} probability stores but {len(labels)} labels")
    return [
        Volume(check_id(Path(p).name.removesuffix(".zarr"), p), Path(p), Path(g))
        for p, g in zip(probabilities, labels, strict=True)
    ]


def load_tuned(path: Path) -> MaskSettings:
    """The settings tuned.json chose, checked (a multi-class run's: per class); a bad file is
    a one-line error naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CtsegError(f"{path}: tuned settings not found (run ctseg tune-postprocess)") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CtsegError(f"{path}: cannot read the tuned settings: {exc}") from exc
    if not isinstance(data, dict) or "settings" not in data:
        raise CtsegError(f'{path}: no "settings" entry (not written by ctseg tune-postprocess?)')
    if isinstance(data["settings"], dict) and "classes" in data["settings"]:
        return ClassSettings.from_mapping(data["settings"], str(path))
    return settings_from_mapping(data["settings"], str(path))
