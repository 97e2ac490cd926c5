"""The field's winning recipe, one part at a time: what each rung of the ladder adds to the score.

    python bench/recipe.py --quick    # CPU-sized: 8+4 realistic volumes of 96^3, 1 seed, bootstrap
    python bench/recipe.py            # GPU-sized: 8+4 volumes of 128^3, 3 seeds

On the realistic demo preset, with the same data, training budget and seeds for every rung, each
rung adds one part of the recipe to the rung before it (the last one that ran):

  1. base      the starting point's recipe: exp001's plain U-Net, all five loss terms;
  2. ema       + an EMA of the weights (``train.ema: {decay, start_step}``);
  3. resenc    + a residual encoder (``model.block: residual``, ``blocks_per_stage``,
               ``decoder_convs: 1``), sized for the CPU: exp001's widths, 1-2-3-3 blocks;
  4. finetune  + fine-tuning the rung-3 model at a larger patch for a short schedule
               (``init_from`` and ``ctseg train --init-from``);
  5. ensemble  + the mean of two rung-4 models of different seeds (``ctseg ensemble``);
  6. postproc  + the post-processing search (``ctseg tune-postprocess`` on the val split's
               ensemble probabilities, then ``ctseg postprocess --settings tuned.json``)
               instead of the fixed threshold 0.5 that rungs 1-5 use.

A rung whose part ctseg lacks (EMA, ``init_from``) prints ``skipped: ... not available`` and is
not counted; the next rung builds on the last one that ran. Every step goes through the
`ctseg` CLI as the rules run it (bench/pipeline.py). Each trained model's own resumable
checkpoint is read back after training, and its run identity must show the rung's part (the EMA
settings, the residual blocks, the source weights' digest), or the bench stops: a rung never
claims what it did not run.

Every figure is the exact competition score (`ctseg evaluate`, TopoScore by Betti matching) of
the demo's held-out test volumes, which neither training nor the post-processing search sees.
Spread: with 3 or more seeds, the standard error across seeds (each seed's mean over the test
volumes; differences paired by seed); with fewer, a bootstrap over the test volumes (2,000
resamples, the seeds averaged per volume; differences paired by volume). The output says which.
Each rung prints its delta against the previous rung and against rung 1 with that standard
error, and whether it helps (delta above twice its SE), hurts (below minus twice) or makes no
clear difference. Rung 4 trains more steps than rung 3 (its fine-tuning comes on top) and rung
5 twice as many models: the table's last columns say how much training each rung had.

The run ends with

    RESULT recipe base=<x> best=<x> gain=<x> gain_se=<x> rungs=<n>

base: rung 1's mean score; best: the highest rung's; gain = best - base; gain_se: its standard
error (as above); rungs: how many rungs ran. All figures go to --json.

    python bench/recipe.py --quick --batch-rung    # batch 4 against batch 16 at equal samples

The batch rung asks whether a larger batch keeps the score: rung 1's recipe trained at the batch
of phase 6 (4) and at that of phase 8 (16, --batch-phases), each on the same number of training
samples (steps = samples / batch, the warm-up the same samples as near as whole steps allow), the
same data and seeds, and the learning rate the experiment's ``train.lr_scaling`` gives each batch
from ``train.base_batch_size`` (--lr-scaling tries another rule). Every other phase setting is
the run's phase (--phase: the CPU's 2, the GPU's 6), so on a GPU the pair is phases 6 and 8.
The larger batch is within the spread when its delta (larger - smaller, paired as above) is
within twice its standard error; it ends with

    RESULT recipe_batch batches=<a>,<b> samples=<n> lr_scaling=<rule> score_a=<x> score_b=<x>
        delta=<x> delta_se=<x> verdict=<within|below|above|too_few>
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pipeline
import postprocess
import yaml
from pipeline import REPO, Prepared, Runner, StepFailed

TERMS = ("score", "surface_dice", "voi_score", "topo_score")
BOOTSTRAP_RESAMPLES = 2000
MIN_SEEDS_FOR_SEED_SPREAD = 3
MIN_UNITS_FOR_VERDICT = 3  # seeds or test volumes behind a "helps" / "hurts"
SECOND_MEMBER_SEED = 1000  # the ensemble's second member: seed s + this, never a ladder seed
FIXED_THRESHOLD = 0.5
# The CPU-sized residual encoder: exp001's widths, nnU-Net ResEnc's deeper encoder and one
# conv-norm-act per decoder level. 0.89 M parameters, 2.2 GFLOP a forward at exp001's patch
# (exp001: 0.35 M, 2.0 GFLOP), so it costs about what the plain U-Net does on the CPU.
CPU_RESENC = {"block": "residual", "blocks_per_stage": [1, 2, 3, 3], "decoder_convs": 1}
# The batch rung: phase 6's batch against phase 8's (phase 6 at batch 16).
BATCH_PHASES = (6, 8)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized, 20 min of 2 cores")
    parser.add_argument("--experiment", default=None, help="rung 1 (default exp001)")
    parser.add_argument("--steps", type=int, default=None, help="steps per model (500; quick 150)")
    parser.add_argument(
        "--finetune-steps", type=int, default=None, help="rung 4's steps (150; quick 40)"
    )
    parser.add_argument(
        "--finetune-patch",
        type=int,
        nargs=3,
        default=None,
        help="rung 4's patch (default: the base patch x 1.5 in z, x 4/3 in y and x)",
    )
    parser.add_argument("--phase", type=int, default=None, help="loader phase (6; quick 2)")
    parser.add_argument("--seeds", type=int, default=None, help="training seeds per rung (3; q 1)")
    parser.add_argument("--records", type=int, default=8, help="labelled training volumes")
    parser.add_argument("--test-records", type=int, default=4, help="held-out test volumes")
    parser.add_argument("--size", type=int, default=None, help="volume edge (128; quick 96)")
    parser.add_argument("--data-seed", type=int, default=0, help="demo data seed")
    parser.add_argument("--preset", default="realistic", help="demo-data preset")
    parser.add_argument(
        "--ema-decay", type=float, default=None, help="default 1 - 5/steps, at least 0.5"
    )
    parser.add_argument("--rungs", type=int, default=6, help="stop after this rung (1-6)")
    parser.add_argument("--workers", type=int, default=pipeline.EVALUATE_WORKERS)
    parser.add_argument("--device", default=None, help="default: cuda if any")
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default a temp dir")
    parser.add_argument(
        "--json", type=Path, default=None, help="figures file (results/bench/recipe[_batch].json)"
    )
    parser.add_argument(
        "--batch-rung",
        action="store_true",
        help="instead of the ladder: rung 1 at two batches, equal samples",
    )
    parser.add_argument(
        "--batch-phases",
        type=int,
        nargs=2,
        default=list(BATCH_PHASES),
        metavar=("SMALL", "LARGE"),
        help="the phases whose batch_size the batch rung compares (6 8)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="training samples a model in the batch rung, a multiple of both batches (default: "
        "a ladder model's, --steps x the phase's batch, rounded up to one: 2000; quick 304)",
    )
    parser.add_argument(
        "--lr-scaling",
        choices=lr_rules(),
        default=None,
        help="the batch rung's lr rule (default: the experiment's train.lr_scaling)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.rungs <= 6:
        parser.error("--rungs: expected 1 to 6")
    if args.samples is not None and args.samples < 1:
        parser.error("--samples: expected a positive number of samples")
    if args.json is None:
        args.json = REPO / (
            "results/bench/recipe_batch.json" if args.batch_rung else "results/bench/recipe.json"
        )
    return args


# --- what ctseg offers ------------------------------------------------------------------------


def _schema() -> dict[str, Any]:
    return yaml.safe_load((REPO / "workflow/schemas/experiment.schema.yaml").read_text())


def lr_rules() -> list[str]:
    """The experiment schema's `train.lr_scaling` rules."""
    return list(_schema()["properties"]["train"]["properties"]["lr_scaling"]["enum"])


def ema_available() -> str | None:
    """None when `train.ema` is an experiment key; else why the EMA rung cannot run."""
    train = _schema()["properties"].get("train", {}).get("properties", {})
    return None if "ema" in train else "train.ema not available"


def init_from_available() -> str | None:
    """None when the schema has `init_from` and `ctseg train` takes --init-from; else why not."""
    if "init_from" not in _schema()["properties"]:
        return "init_from not available"
    help_text = subprocess.run(
        [*pipeline.ctseg_command(), "train", "--help"],
        capture_output=True,
        text=True,
        env=pipeline.child_env(),
        check=False,
    ).stdout
    return None if "--init-from" in help_text else "ctseg train --init-from not available"


# --- the steps this bench needs beyond bench/pipeline.py ---------------------------------------


def infer_fixed(
    runner: Runner,
    data: Prepared,
    name: str,
    ids: Sequence[str],
    weights: Path,
    device: str | None,
    masks: bool,
) -> dict[str, Path]:
    """`ctseg infer` of each record with the config's window settings; with `masks`, also the
    mask at the fixed threshold 0.5 and nothing else (the comparison of rung 6), written to
    results/<name>/predictions/<id>.tif. Returns the probability stores."""
    icfg = pipeline.load_config()["infer"]
    stores = {}
    for record_id in ids:
        store = data.results / name / "probabilities" / f"{record_id}.zarr"
        mask = data.results / name / "predictions" / f"{record_id}.tif"
        args = [
            "infer",
            str(weights),
            str(data.image(record_id)),
            "--probabilities",
            str(store),
            *(["--mask", str(mask), "--threshold", str(FIXED_THRESHOLD)] if masks else []),
            "--min-component-voxels",
            "0",
            "--overlap",
            str(icfg["overlap"]),
            "--batch-size",
            str(icfg["batch_size"]),
            *(["--tta-flips"] if icfg["tta_flips"] else []),
            "--memory-budget-mb",
            str(icfg["memory_budget_mb"]),
            "--device-budget-mb",
            str(icfg["device_budget_mb"]),
            *(["--device", device] if device else []),
        ]
        runner.run("infer", args, f"{name}_{record_id}")
        stores[record_id] = store
    return stores


def ensemble_stores(
    runner: Runner,
    a: Mapping[str, Path],
    b: Mapping[str, Path],
    out_dir: Path,
    ids: Sequence[str],
) -> dict[str, Path]:
    """`ctseg ensemble` of two members' probabilities, weights 0.5 / 0.5, per record."""
    stores = {}
    for record_id in ids:
        out = out_dir / f"{record_id}.zarr"
        args = ["ensemble", "--members", str(a[record_id]), str(b[record_id])]
        args += ["--weights", "0.5", "0.5", "--out", str(out)]
        runner.run("ensemble", args, f"{out_dir.parent.name}_{record_id}")
        stores[record_id] = out
    return stores


def scores_of(summary_dir: Path) -> dict[str, dict[str, float]]:
    """scores.csv of `ctseg evaluate`: volume id -> the score and its three terms."""
    with open(summary_dir / "scores.csv", newline="") as handle:
        return {row["id"]: {t: float(row[t]) for t in TERMS} for row in csv.DictReader(handle)}


def identity_of(run_dir: Path) -> dict[str, Any]:
    """The run identity in the model's own resumable checkpoint (what training really ran)."""
    sys.path.insert(0, str(REPO / "workflow"))
    from ctseg.training.checkpoint import load_checkpoint

    state = load_checkpoint(run_dir / "checkpoints" / "resume.pt")
    return dict(state.get("identity") or {})


def evidence(run_dir: Path) -> dict[str, Any]:
    """The parts of the identity each rung claims: EMA, model block, patch, source weights."""
    ident = identity_of(run_dir)
    exp = ident.get("experiment", {})
    return {
        "ema": exp.get("train", {}).get("ema"),
        "block": exp.get("model", {}).get("block"),
        "blocks_per_stage": exp.get("model", {}).get("blocks_per_stage"),
        "patch_size": exp.get("data", {}).get("patch_size"),
        "seed": exp.get("train", {}).get("seed"),
        "source_weights": ident.get("source_weights"),
        "total_steps": ident.get("total_steps"),
        "batch_size": ident.get("phase", {}).get("batch_size"),
        "lr_scaling": exp.get("train", {}).get("lr_scaling"),
        "warmup_steps": exp.get("train", {}).get("warmup_steps"),
    }


class ClaimFailed(RuntimeError):
    """A trained model's identity does not show the part its rung adds."""


def check_claim(
    name: str, ev: Mapping[str, Any], claims: Mapping[str, Callable[[Any], bool]]
) -> None:
    for key, ok in claims.items():
        if not ok(ev.get(key)):
            raise ClaimFailed(f"{name}: its run identity has {key}={ev.get(key)!r}")


# --- statistics -------------------------------------------------------------------------------


def per_seed_means(scores: Mapping[int, Mapping[str, Mapping[str, float]]], term: str):
    return np.array([np.mean([v[term] for v in vols.values()]) for vols in scores.values()])


def per_volume_means(scores: Mapping[int, Mapping[str, Mapping[str, float]]], term: str):
    ids = sorted(next(iter(scores.values())))
    return np.array([np.mean([scores[s][i][term] for s in scores]) for i in ids])


def spread_method(n_seeds: int) -> str:
    return "seeds" if n_seeds >= MIN_SEEDS_FOR_SEED_SPREAD else "bootstrap"


def standard_error(values: np.ndarray, method: str, seed: int = 0) -> float:
    """SE of the mean of `values` (per seed or per volume, paired differences included)."""
    n = len(values)
    if n < 2:
        return float("nan")
    if method == "seeds":
        return float(np.std(values, ddof=1) / math.sqrt(n))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))
    return float(np.std(values[idx].mean(axis=1), ddof=1))


def unit_values(rung: Rung, term: str, method: str) -> np.ndarray:
    if method == "seeds":
        return per_seed_means(rung.scores, term)
    return per_volume_means(rung.scores, term)


def verdict(delta: float, se: float, units: int) -> str:
    """helps / hurts when the delta is beyond twice its SE; with fewer than
    MIN_UNITS_FOR_VERDICT seeds or volumes the SE itself is too rough for either."""
    if units < MIN_UNITS_FOR_VERDICT or not math.isfinite(se):
        return ("higher" if delta > 0 else "not higher") + f" (n={units}: too few to tell)"
    if delta > 2 * se:
        return "helps"
    if delta < -2 * se:
        return "hurts"
    return "no clear difference" + (" (does not help)" if delta <= 0 else "")


def spread_verdict(delta: float, se: float, units: int) -> str:
    """The batch rung's verdict: "within" when |delta| is at most twice its SE (the ladder's
    "no clear difference"), else "below" or "above"; "too_few" with fewer than
    MIN_UNITS_FOR_VERDICT seeds or volumes behind the SE, or none."""
    if units < MIN_UNITS_FOR_VERDICT or not math.isfinite(se):
        return "too_few"
    if abs(delta) <= 2 * se:
        return "within"
    return "above" if delta > 0 else "below"


# --- the ladder -------------------------------------------------------------------------------


def derived(parent: Mapping[str, Any], name: str, seed: int) -> dict[str, Any]:
    """A copy of an experiment under another name and training seed."""
    exp = copy.deepcopy(dict(parent))
    exp["name"] = name
    exp["train"]["seed"] = seed
    return exp


@dataclass
class Rung:
    number: int
    key: str
    what: str
    status: str = "not run"  # ran | skipped: <why> | not run
    scores: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)  # seed -> id
    models: dict[int, list[str]] = field(default_factory=dict)  # seed -> trained experiments
    evidence: dict[str, dict[str, Any]] = field(default_factory=dict)  # experiment -> identity
    train_steps: int = 0  # per seed, every model it needed counted
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def ran(self) -> bool:
        return self.status == "ran"


@dataclass
class Ladder:
    args: argparse.Namespace
    runner: Runner
    data: Prepared
    base_exp: dict[str, Any]
    phases: dict[int, dict[str, Any]]
    phase: int
    seeds: list[int]
    steps: int
    finetune_steps: int
    finetune_patch: list[int]
    ema: dict[str, Any]
    rungs: list[Rung] = field(default_factory=list)
    # per seed, the last trained recipe: (experiment, weights, steps so far) and test stores
    current: dict[int, dict[str, Any]] = field(default_factory=dict)
    # per seed, the recipe rung 4 fine-tuned from (rung 5 trains its second member's source so)
    sources: dict[int, dict[str, Any]] = field(default_factory=dict)

    def train_and_score(
        self,
        rung: Rung,
        seed: int,
        exp: dict[str, Any],
        claims: Mapping[str, Callable[[Any], bool]],
        init_from: Path | None = None,
        phases: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Train `exp` under the ladder's phase (from `phases` when given, else the ladder's
        table), check its identity's `claims`, and infer the test volumes."""
        weights = pipeline.train(
            self.runner,
            self.data,
            exp,
            phases if phases is not None else self.phases,
            self.phase,
            [],
            self.args.device,
            init_from,
            what=exp["name"],
        )
        run_dir = self.data.results / exp["name"]
        ev = evidence(run_dir)
        check_claim(exp["name"], ev, claims)
        rung.evidence[exp["name"]] = ev
        rung.models.setdefault(seed, []).append(exp["name"])
        stores = infer_fixed(
            self.runner,
            self.data,
            exp["name"],
            self.data.test_ids,
            weights,
            self.args.device,
            masks=True,
        )
        return {"exp": exp, "weights": weights, "test": stores}

    def evaluate(self, rung: Rung, seed: int, masks: Sequence[Path], out: Path) -> None:
        pipeline.evaluate(
            self.runner, masks, pipeline.test_labels(self.data), out, f"{rung.key}_s{seed}"
        )
        rung.scores[seed] = scores_of(out)

    def masks_of(self, name: str) -> list[Path]:
        return [self.data.results / name / "predictions" / f"{i}.tif" for i in self.data.test_ids]


def rung_base(lad: Ladder, rung: Rung) -> None:
    for seed in lad.seeds:
        exp = derived(lad.base_exp, f"r1_base_s{seed}", seed)
        got = lad.train_and_score(rung, seed, exp, {"ema": lambda v: v is None})
        lad.evaluate(rung, seed, lad.masks_of(exp["name"]), lad.data.results / exp["name"] / "ev")
        lad.current[seed] = {**got, "steps": lad.steps}
    rung.train_steps = lad.steps


def rung_ema(lad: Ladder, rung: Rung) -> None:
    rung.settings = {"train.ema": lad.ema}
    for seed in lad.seeds:
        exp = derived(lad.current[seed]["exp"], f"r2_ema_s{seed}", seed)
        exp["train"]["ema"] = dict(lad.ema)
        got = lad.train_and_score(rung, seed, exp, {"ema": lambda v: bool(v)})
        lad.evaluate(rung, seed, lad.masks_of(exp["name"]), lad.data.results / exp["name"] / "ev")
        lad.current[seed] = {**got, "steps": lad.steps}
    rung.train_steps = lad.steps


def rung_resenc(lad: Ladder, rung: Rung) -> None:
    rung.settings = {"model": CPU_RESENC}
    for seed in lad.seeds:
        exp = derived(lad.current[seed]["exp"], f"r3_resenc_s{seed}", seed)
        exp["model"].update(copy.deepcopy(CPU_RESENC))
        claims = {
            "block": lambda v: v == "residual",
            "blocks_per_stage": lambda v: list(v or []) == CPU_RESENC["blocks_per_stage"],
        }
        got = lad.train_and_score(rung, seed, exp, claims)
        lad.evaluate(rung, seed, lad.masks_of(exp["name"]), lad.data.results / exp["name"] / "ev")
        lad.current[seed] = {**got, "steps": lad.steps}
    rung.train_steps = lad.steps


def finetune_exp(lad: Ladder, source: Mapping[str, Any], name: str, seed: int) -> dict[str, Any]:
    """The source recipe at the larger patch, a short schedule at half the learning rate (a
    fresh optimizer at the full rate would undo part of what the source learnt)."""
    exp = derived(source, name, seed)
    exp["init_from"] = source["name"]
    exp["data"]["patch_size"] = list(lad.finetune_patch)
    exp["train"]["lr"] = float(exp["train"]["lr"]) * 0.5
    pipeline.set_training_budget(exp, lad.finetune_steps, exp["train"]["val_batches"])
    if exp["train"].get("ema"):
        ema = dict(exp["train"]["ema"])
        ema["start_step"] = min(int(ema["start_step"]), lad.finetune_steps // 5)
        exp["train"]["ema"] = ema
    return exp


def finetune_claims(lad: Ladder) -> dict[str, Callable[[Any], bool]]:
    return {
        "source_weights": lambda v: bool(v),
        "patch_size": lambda v: list(v or []) == list(lad.finetune_patch),
    }


def rung_finetune(lad: Ladder, rung: Rung) -> None:
    rung.settings = {"patch_size": lad.finetune_patch, "steps": lad.finetune_steps, "lr": "x0.5"}
    for seed in lad.seeds:
        source = lad.current[seed]
        lad.sources[seed] = copy.deepcopy(source["exp"])
        exp = finetune_exp(lad, source["exp"], f"r4_finetune_s{seed}", seed)
        got = lad.train_and_score(rung, seed, exp, finetune_claims(lad), source["weights"])
        lad.evaluate(rung, seed, lad.masks_of(exp["name"]), lad.data.results / exp["name"] / "ev")
        lad.current[seed] = {**got, "steps": source["steps"] + lad.finetune_steps}
    rung.train_steps = lad.steps + lad.finetune_steps


def second_member(lad: Ladder, rung: Rung, seed: int, previous: Rung) -> dict[str, Any]:
    """The previous rung's recipe again, seed s + SECOND_MEMBER_SEED (its source too)."""
    other = seed + SECOND_MEMBER_SEED
    first = lad.current[seed]["exp"]
    if previous.key == "finetune":
        source = derived(lad.sources[seed], f"r5_member_src_s{seed}", other)
        src = lad.train_and_score(rung, seed, source, {"seed": lambda v: v == other})
        exp = finetune_exp(lad, source, f"r5_member_s{seed}", other)
        return lad.train_and_score(rung, seed, exp, finetune_claims(lad), src["weights"])
    exp = derived(first, f"r5_member_s{seed}", other)
    return lad.train_and_score(rung, seed, exp, {"seed": lambda v: v == other})


def rung_ensemble(lad: Ladder, rung: Rung, previous: Rung) -> None:
    rung.settings = {"members": 2, "weights": [0.5, 0.5], "recipe": f"rung {previous.number}"}
    ids = lad.data.test_ids + lad.data.val_ids
    for seed in lad.seeds:
        first = lad.current[seed]
        second = second_member(lad, rung, seed, previous)
        # The val split's probabilities too: rung 6 tunes on them.
        for member in (first, second):
            member["val"] = infer_fixed(
                lad.runner,
                lad.data,
                member["exp"]["name"],
                lad.data.val_ids,
                member["weights"],
                lad.args.device,
                masks=False,
            )
        out = lad.data.results / f"r5_ensemble_s{seed}"
        both = ({**a["test"], **a["val"]} for a in (first, second))
        stores = ensemble_stores(lad.runner, *both, out / "probabilities", ids)
        masks = postprocess.masks(
            lad.runner, lad.data, stores, out / "predictions", ["--threshold", "0.5"]
        )
        lad.evaluate(rung, seed, masks, out / "ev")
        lad.current[seed] = {"exp": first["exp"], "stores": stores, "dir": out}
    rung.train_steps = 2 * previous.train_steps


def rung_postproc(lad: Ladder, rung: Rung, previous: Rung) -> None:
    chosen = {}
    for seed in lad.seeds:
        cur = lad.current[seed]
        stores = cur.get("stores")
        out = lad.data.results / f"r6_postproc_s{seed}"
        if stores is None:  # no ensemble ran: the last model's val probabilities
            val = infer_fixed(
                lad.runner,
                lad.data,
                cur["exp"]["name"],
                lad.data.val_ids,
                cur["weights"],
                lad.args.device,
                masks=False,
            )
            stores = {**cur["test"], **val}
        tuned = postprocess.tune(lad.runner, lad.data, stores, out / "tune", lad.args.workers)
        chosen[seed] = pipeline.read_json(tuned)
        masks = postprocess.masks(
            lad.runner, lad.data, stores, out / "predictions", ["--settings", str(tuned)]
        )
        lad.evaluate(rung, seed, masks, out / "ev")
    rung.settings = {
        "tuned_on": "val split",
        "chosen": {
            s: {k: c.get(k) for k in ("label", "score", "candidates")} for s, c in chosen.items()
        },
    }
    rung.train_steps = previous.train_steps


RUNGS = (
    (1, "base", "the starting point's recipe"),
    (2, "ema", "+ EMA of the weights"),
    (3, "resenc", "+ residual encoder"),
    (4, "finetune", "+ fine-tune at a larger patch"),
    (5, "ensemble", "+ ensemble of two seeds"),
    (6, "postproc", "+ post-processing search"),
)


def run_rung(lad: Ladder, rung: Rung) -> None:
    previous = next((r for r in reversed(lad.rungs) if r.ran), None)
    if rung.key == "ema" and (why := ema_available()):
        rung.status = f"skipped: {why}"
        return
    if rung.key == "finetune" and (why := init_from_available()):
        rung.status = f"skipped: {why}"
        return
    if previous is None and rung.key != "base":
        rung.status = "not run: rung 1 did not run"
        return
    # A later rung that fails is reported as FAILED and not counted; the ones after it build
    # on the last rung that ran, as after a skipped one. Rung 1 failing ends the ladder.
    saved = copy.deepcopy((lad.current, lad.sources))
    try:
        if rung.key == "base":
            rung_base(lad, rung)
        elif rung.key == "ema":
            rung_ema(lad, rung)
        elif rung.key == "resenc":
            rung_resenc(lad, rung)
        elif rung.key == "finetune":
            rung_finetune(lad, rung)
        elif rung.key == "ensemble":
            rung_ensemble(lad, rung, previous)
        else:
            rung_postproc(lad, rung, previous)
    except (StepFailed, ClaimFailed) as exc:
        if rung.key == "base":
            raise
        last_line = str(exc).strip().splitlines()[-1].strip()
        print(f"recipe: rung {rung.number} {rung.key}: {exc}", file=sys.stderr, flush=True)
        rung.status = f"FAILED at {getattr(exc, 'step', 'the claim check')}: {last_line}"
        rung.scores, rung.models, rung.evidence = {}, {}, {}
        lad.current, lad.sources = saved
        return
    rung.status = "ran"


# --- report -----------------------------------------------------------------------------------


def rung_figures(rung: Rung, base: Rung, previous: Rung | None, method: str) -> dict[str, Any]:
    fig: dict[str, Any] = {}
    for term in TERMS:
        values = unit_values(rung, term, method)
        fig[term] = float(np.mean(values))
        fig[f"{term}_se"] = standard_error(values, method)
    score = unit_values(rung, "score", method)
    for label, other in (("prev", previous), ("base", base)):
        if other is None or other is rung:
            continue
        diff = score - unit_values(other, "score", method)
        fig[f"delta_{label}"] = float(np.mean(diff))
        fig[f"delta_{label}_se"] = standard_error(diff, method)
        fig[f"delta_{label}_vs"] = other.number
    if "delta_prev" in fig:
        fig["verdict"] = verdict(fig["delta_prev"], fig["delta_prev_se"], len(score))
    return fig


def report(lad: Ladder, method: str, record: dict[str, Any]) -> tuple[Rung, Rung, float] | None:
    ran = [r for r in lad.rungs if r.ran]
    if not ran or ran[0].key != "base":
        return None
    base = ran[0]
    n_units = len(lad.seeds) if method == "seeds" else len(lad.data.test_ids)
    unit = "seeds" if method == "seeds" else "test volumes"
    print(
        f"\nspread: {method} ({'SE across' if method == 'seeds' else 'bootstrap SE over'} "
        f"{n_units} {unit}"
        f"{'' if method == 'seeds' else f', {BOOTSTRAP_RESAMPLES} resamples, seeds averaged'}"
        "); deltas paired; mean ± SE"
    )
    header = (
        f"{'rung':<30} {'score':>13} {'SurfDice':>13} {'VOI':>13} {'Topo':>13} "
        f"{'Δ prev':>15} {'Δ rung 1':>15} {'steps':>6}  verdict"
    )
    print(header)
    figures = {}
    previous = None
    for rung in lad.rungs:
        label = f"{rung.number} {rung.key}: {rung.what}"[:30]
        if not rung.ran:
            print(f"{label:<30} {rung.status[:110]}")  # the whole of it is in the JSON
            continue
        fig = rung_figures(rung, base, previous, method)
        figures[rung.key] = fig
        cells = " ".join(f"{fig[t]:.3f}±{fig[t + '_se']:.3f}".rjust(13) for t in TERMS)
        dprev = (
            f"{fig['delta_prev']:+.3f}±{fig['delta_prev_se']:.3f}" if "delta_prev" in fig else "-"
        )
        dbase = (
            f"{fig['delta_base']:+.3f}±{fig['delta_base_se']:.3f}" if "delta_base" in fig else "-"
        )
        print(
            f"{label:<30} {cells} {dprev:>15} {dbase:>15} {rung.train_steps:>6}  "
            f"{fig.get('verdict', '(reference)')}"
        )
        previous = rung
    best = max(ran, key=lambda r: figures[r.key]["score"])
    diff = unit_values(best, "score", method) - unit_values(base, "score", method)
    gain_se = standard_error(diff, method) if best is not base else 0.0
    record["figures"] = figures
    return base, best, gain_se


def rung_record(rung: Rung) -> dict[str, Any]:
    return {
        "number": rung.number,
        "key": rung.key,
        "what": rung.what,
        "status": rung.status,
        "settings": rung.settings,
        "train_steps_per_seed": rung.train_steps,
        "models": rung.models,
        "evidence": rung.evidence,
        "scores": rung.scores,
    }


# --- the batch rung ---------------------------------------------------------------------------


def equal_sample_schedules(
    samples: int, batches: Sequence[int], warmup_steps: int
) -> dict[int, dict[str, int]]:
    """Per batch, the steps and warm-up steps that train on `samples` samples. The warm-up is
    what set_training_budget gives the smallest batch (`warmup_steps`, at most a tenth of its
    steps) in samples, as whole steps of each batch (at least 1). A batch that does not divide
    `samples` raises ValueError: the models would not see the same number of samples."""
    uneven = [b for b in batches if samples % b]
    if uneven:
        lcm = math.lcm(*batches)
        nearest = max(lcm, round(samples / lcm) * lcm)
        raise ValueError(
            f"--samples {samples}: not a multiple of batch {uneven[0]}; give a multiple of "
            f"{lcm}, e.g. --samples {nearest}"
        )
    smallest = min(batches)
    warmup_samples = min(warmup_steps, max(1, samples // smallest // 10)) * smallest
    return {
        b: {"steps": samples // b, "warmup_steps": max(1, round(warmup_samples / b))}
        for b in batches
    }


def ladder_samples(steps: int, run_batch: int, batches: Sequence[int]) -> int:
    """The batch rung's default samples a model: a ladder model's (`steps` at the run phase's
    batch), rounded up to a multiple of every batch compared."""
    lcm = math.lcm(*batches)
    return math.ceil(steps * run_batch / lcm) * lcm


def batch_phase(
    phases: Mapping[int, Mapping[str, Any]], run_phase: int, batch: int
) -> dict[int, dict[str, Any]]:
    """The phase table with the run's phase at `batch`: every other setting as it is."""
    table = {k: dict(v) for k, v in phases.items()}
    table[run_phase] = {**table[run_phase], "batch_size": int(batch)}
    return table


def scaled_lr(train_cfg: Mapping[str, Any], batch: int) -> float:
    """The learning rate `ctseg train` gives this batch (ctseg.training.recipe.scaled_lr)."""
    sys.path.insert(0, str(REPO / "workflow"))
    from ctseg.training.recipe import scaled_lr as ctseg_scaled_lr

    return ctseg_scaled_lr(train_cfg, batch)


def batch_claims(batch: int, schedule: Mapping[str, int], rule: str):
    return {
        "ema": lambda v: v is None,
        "batch_size": lambda v: v == batch,
        "total_steps": lambda v: v == schedule["steps"],
        "warmup_steps": lambda v: v == schedule["warmup_steps"],
        "lr_scaling": lambda v: v == rule,
    }


def run_batch_rung(
    args: argparse.Namespace, workdir: Path, record: dict[str, Any]
) -> tuple[Ladder, list[Rung]]:
    """Rung 1's recipe at each batch of --batch-phases, equal samples; returns its rungs."""
    exp = pipeline.load_experiment(args.experiment or "exp001")
    exp["name"] = "b0_data"
    plan = sizes(args, exp["data"]["patch_size"])
    phases = pipeline.load_phases()
    for flag, phase in (
        ("--phase", plan["phase"]),
        *(("--batch-phases", p) for p in args.batch_phases),
    ):
        if phase not in phases:
            raise SystemExit(f"{flag} {phase}: not in config/phases.yaml")
    batches = [int(phases[p]["batch_size"]) for p in args.batch_phases]
    if batches[0] >= batches[1]:
        raise SystemExit(
            f"--batch-phases {args.batch_phases[0]} {args.batch_phases[1]}: batch_size "
            f"{batches[0]} and {batches[1]}; name the smaller batch's phase first"
        )
    run_batch = int(phases[plan["phase"]]["batch_size"])
    plan["samples"] = args.samples or ladder_samples(plan["steps"], run_batch, batches)
    try:
        schedules = equal_sample_schedules(
            plan["samples"], batches, int(exp["train"]["warmup_steps"])
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    rule = args.lr_scaling or exp["train"]["lr_scaling"]
    exp["train"]["lr_scaling"] = rule
    val_patches = (4 if args.quick else 20) * batches[0]  # the same validation samples
    lrs = {b: scaled_lr(exp["train"], b) for b in batches}
    record.update(
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        plan={**plan, "batches": batches, "schedules": schedules, "lr_scaling": rule, "lr": lrs},
        volumes={"train": args.records, "test": args.test_records, "size": plan["size"]},
        preset=args.preset,
        spread=spread_method(len(plan["seeds"])),
    )
    print(
        f"batch rung on the {args.preset} demo: {args.records}+{args.test_records} volumes of "
        f"{plan['size']}^3; {plan['samples']} samples a model; phase {plan['phase']}'s settings "
        f"at batch {batches[0]} (phase {args.batch_phases[0]}'s) and {batches[1]} (phase "
        f"{args.batch_phases[1]}'s); lr_scaling {rule} from base batch "
        f"{exp['train']['base_batch_size']}; seeds {plan['seeds']}; work dir {workdir}",
        flush=True,
    )
    runner = Runner(workdir, jobs=max(2, (os.cpu_count() or 2) // 2))
    record["load_start"] = os.getloadavg()
    pipeline.set_training_budget(exp, schedules[batches[0]]["steps"], val_batches=1)
    data = pipeline.prepare(
        runner,
        exp,
        n_train=args.records,
        n_test=args.test_records,
        shape=(plan["size"],) * 3,
        seed=args.data_seed,
        preset=args.preset,
    )
    lad = Ladder(
        args=args,
        runner=runner,
        data=data,
        base_exp=exp,
        phases=phases,
        phase=plan["phase"],
        seeds=plan["seeds"],
        steps=schedules[batches[0]]["steps"],
        finetune_steps=0,
        finetune_patch=list(exp["data"]["patch_size"]),
        ema={},
    )
    rungs = []
    record["rungs"] = []
    try:
        for number, batch in enumerate(batches, start=1):
            schedule = schedules[batch]
            rung = Rung(number, f"batch{batch}", f"batch {batch}, lr {lrs[batch]:.4g}")
            rung.settings = {**schedule, "batch_size": batch, "lr": lrs[batch]}
            table = batch_phase(phases, plan["phase"], batch)
            start = runner.elapsed()
            for seed in lad.seeds:
                exp_b = derived(exp, f"b{batch}_s{seed}", seed)
                pipeline.set_training_budget(
                    exp_b, schedule["steps"], val_batches=max(1, val_patches // batch)
                )
                exp_b["train"]["warmup_steps"] = schedule["warmup_steps"]
                claims = batch_claims(batch, schedule, rule)
                lad.train_and_score(rung, seed, exp_b, claims, phases=table)
                out = data.results / exp_b["name"] / "ev"
                lad.evaluate(rung, seed, lad.masks_of(exp_b["name"]), out)
            rung.status, rung.train_steps = "ran", schedule["steps"]
            rungs.append(rung)
            took = runner.elapsed() - start
            print(f"batch {batch}: {schedule['steps']} steps a model ({took:.0f} s)", flush=True)
            record["rungs"].append({**rung_record(rung), "seconds": round(took, 1)})
            pipeline.write_json(args.json, record)
    finally:
        record["step_seconds"] = {k: round(v, 2) for k, v in runner.seconds.items()}
        record["total_s"] = round(runner.elapsed(), 1)
        record["load_end"] = os.getloadavg()
        record["cpu_s_children"] = round(sum(os.times()[2:4]), 1)
    return lad, rungs


def batch_figures(small: Rung, large: Rung, method: str) -> dict[str, Any]:
    """Each batch's mean score and terms with their SE, and the paired delta large - small."""
    fig: dict[str, Any] = {}
    for rung in (small, large):
        for term in TERMS:
            values = unit_values(rung, term, method)
            fig[f"{rung.key}_{term}"] = float(np.mean(values))
            fig[f"{rung.key}_{term}_se"] = standard_error(values, method)
    diff = unit_values(large, "score", method) - unit_values(small, "score", method)
    fig["delta"] = float(np.mean(diff))
    fig["delta_se"] = standard_error(diff, method)
    fig["units"] = len(diff)
    fig["verdict"] = spread_verdict(fig["delta"], fig["delta_se"], len(diff))
    return fig


VERDICT_WORDS = {
    "within": "within the spread (|delta| <= 2 SE): the larger batch keeps the score",
    "below": "below the spread (delta < -2 SE): the larger batch loses score under this rule",
    "above": "above the spread (delta > 2 SE): the larger batch changes the score under this rule",
    "too_few": f"too few seeds or volumes to tell (fewer than {MIN_UNITS_FOR_VERDICT})",
}


def report_batch(rungs: Sequence[Rung], method: str, record: dict[str, Any]) -> dict[str, Any]:
    small, large = rungs
    fig = batch_figures(small, large, method)
    plan = record["plan"]
    unit = "seeds" if method == "seeds" else "test volumes"
    print(f"\nspread: {method} over {fig['units']} {unit}; delta paired; mean ± SE")
    print(
        f"{'batch':>5} {'steps':>6} {'warm-up':>7} {'lr':>8} " + " ".join(f"{t:>13}" for t in TERMS)
    )
    for rung in rungs:
        s = rung.settings
        cells = " ".join(
            f"{fig[f'{rung.key}_{t}']:.3f}±{fig[f'{rung.key}_{t}_se']:.3f}".rjust(13) for t in TERMS
        )
        print(
            f"{s['batch_size']:>5} {s['steps']:>6} {s['warmup_steps']:>7} {s['lr']:>8.4g} {cells}"
        )
    print(
        f"delta (batch {plan['batches'][1]} - batch {plan['batches'][0]}): "
        f"{fig['delta']:+.4f} ± {fig['delta_se']:.4f} under lr_scaling {plan['lr_scaling']}: "
        f"{VERDICT_WORDS[fig['verdict']]}"
    )
    record["figures"] = fig
    return fig


def main_batch(args: argparse.Namespace) -> int:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ctseg_recipe_batch_"))
    record: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        _, rungs = run_batch_rung(args, workdir, record)
    except (StepFailed, ClaimFailed) as exc:
        print(f"recipe: {exc}", file=sys.stderr)
        print(f"recipe: work dir kept for inspection: {workdir}", file=sys.stderr)
        step = getattr(exc, "step", "claim")
        record["failed_step"] = step
        pipeline.write_json(args.json, record)
        print(f"RESULT recipe_batch failed_step={step.replace(' ', ':')}")
        return 1
    fig = report_batch(rungs, record["spread"], record)
    print(
        f"total {record['total_s']:.0f} s wall, {record['cpu_s_children']:.0f} s CPU (children); "
        f"load average {record['load_start'][0]:.1f} at start, {record['load_end'][0]:.1f} at end"
    )
    pipeline.write_json(args.json, record)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    plan, (small, large) = record["plan"], rungs
    print(
        f"RESULT recipe_batch batches={plan['batches'][0]},{plan['batches'][1]} "
        f"samples={plan['samples']} lr_scaling={plan['lr_scaling']} "
        f"score_a={fig[f'{small.key}_score']:.4f} score_b={fig[f'{large.key}_score']:.4f} "
        f"delta={fig['delta']:.4f} delta_se={fig['delta_se']:.4f} verdict={fig['verdict']}"
    )
    return 0


# --- main -------------------------------------------------------------------------------------


def sizes(args: argparse.Namespace, base_patch: Sequence[int]) -> dict[str, Any]:
    quick = args.quick
    steps = args.steps or (150 if quick else 500)
    finetune_steps = args.finetune_steps or (40 if quick else 150)
    z, y, x = base_patch
    patch = args.finetune_patch or [z * 3 // 2, y * 4 // 3, x * 4 // 3]
    # An average over about the last fifth of the run (1 / (1 - decay) steps)
    decay = args.ema_decay if args.ema_decay is not None else round(1 - 1 / max(2, steps // 5), 4)
    return {
        "steps": steps,
        "finetune_steps": finetune_steps,
        "finetune_patch": [int(v) for v in patch],
        # the winners' 0.999 after 1,000 of many thousand steps, scaled to this budget
        "ema": {"decay": decay, "start_step": steps // 5},
        "seeds": list(range(args.seeds or (1 if quick else 3))),
        "phase": args.phase if args.phase is not None else (2 if quick else 6),
        "size": args.size or (96 if quick else 128),
    }


def run(args: argparse.Namespace, workdir: Path, record: dict[str, Any]) -> Ladder:
    exp = pipeline.load_experiment(args.experiment or "exp001")
    exp["name"] = "r0_data"
    plan = sizes(args, exp["data"]["patch_size"])
    phases = pipeline.load_phases()
    if plan["phase"] not in phases:
        raise SystemExit(f"--phase {plan['phase']}: not in config/phases.yaml")
    pipeline.set_training_budget(exp, plan["steps"], val_batches=4 if args.quick else 20)
    record.update(
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        plan=plan,
        volumes={"train": args.records, "test": args.test_records, "size": plan["size"]},
        preset=args.preset,
        spread=spread_method(len(plan["seeds"])),
    )
    print(
        f"recipe ladder on the {args.preset} demo: {args.records}+{args.test_records} volumes of "
        f"{plan['size']}^3; {plan['steps']} steps a model under phase {plan['phase']}; seeds "
        f"{plan['seeds']}; fine-tune {plan['finetune_steps']} steps at "
        f"{plan['finetune_patch']}; EMA {plan['ema']}; work dir {workdir}",
        flush=True,
    )
    runner = Runner(workdir, jobs=max(2, (os.cpu_count() or 2) // 2))
    record["load_start"] = os.getloadavg()
    data = pipeline.prepare(
        runner,
        exp,
        n_train=args.records,
        n_test=args.test_records,
        shape=(plan["size"],) * 3,
        seed=args.data_seed,
        preset=args.preset,
    )
    if not data.val_ids:
        raise SystemExit("the val split is empty: rung 6 has nothing to tune on; add --records")
    lad = Ladder(
        args=args,
        runner=runner,
        data=data,
        base_exp=exp,
        phases=phases,
        phase=plan["phase"],
        seeds=plan["seeds"],
        steps=plan["steps"],
        finetune_steps=plan["finetune_steps"],
        finetune_patch=plan["finetune_patch"],
        ema=plan["ema"],
    )
    record["rungs"] = []
    try:
        for number, key, what in RUNGS[: args.rungs]:
            rung = Rung(number, key, what)
            start = runner.elapsed()
            run_rung(lad, rung)
            lad.rungs.append(rung)
            took = runner.elapsed() - start
            print(f"rung {number} {key}: {rung.status} ({took:.0f} s)", flush=True)
            record["rungs"].append({**rung_record(rung), "seconds": round(took, 1)})
            pipeline.write_json(args.json, record)  # partial figures survive a cut-off run
    finally:
        record["step_seconds"] = {k: round(v, 2) for k, v in runner.seconds.items()}
        record["total_s"] = round(runner.elapsed(), 1)
        record["load_end"] = os.getloadavg()
        record["cpu_s_children"] = round(sum(os.times()[2:4]), 1)
    return lad


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.batch_rung:
        return main_batch(args)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ctseg_recipe_"))
    record: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        lad = run(args, workdir, record)
    except (StepFailed, ClaimFailed) as exc:
        print(f"recipe: {exc}", file=sys.stderr)
        print(f"recipe: work dir kept for inspection: {workdir}", file=sys.stderr)
        step = getattr(exc, "step", "claim")
        record["failed_step"] = step
        pipeline.write_json(args.json, record)
        print(f"RESULT recipe failed_step={step.replace(' ', ':')}")
        return 1
    method = record["spread"]
    out = report(lad, method, record)
    ran = sum(r.ran for r in lad.rungs)
    failed = [r.number for r in lad.rungs if r.status.startswith("FAILED")]
    print(
        f"total {record['total_s']:.0f} s wall, {record['cpu_s_children']:.0f} s CPU (children); "
        f"load average {record['load_start'][0]:.1f} at start, {record['load_end'][0]:.1f} at end"
    )
    if out is None:
        pipeline.write_json(args.json, record)
        print(f"RESULT recipe base=nan best=nan gain=nan gain_se=nan rungs={ran}")
        return 1
    base, best, gain_se = out
    b, x = record["figures"][base.key]["score"], record["figures"][best.key]["score"]
    record["result"] = {
        "base": b,
        "best": x,
        "best_rung": best.key,
        "gain": x - b,
        "gain_se": gain_se,
        "rungs": ran,
    }
    print(f"best: rung {best.number} {best.key}")
    pipeline.write_json(args.json, record)
    if args.workdir is None and not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    if failed:
        print(f"recipe: rung(s) {failed} FAILED and are not counted (see above)")
    print(
        f"RESULT recipe base={b:.4f} best={x:.4f} gain={x - b:.4f} gain_se={gain_se:.4f} "
        f"rungs={ran}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
