"""Learning quality: the competition score a fixed training budget reaches, against a threshold.

    python bench/quality.py --quick    # exp001 on the CPU: 4+2 volumes of 96^3, 80 steps
    python bench/quality.py --smoke    # a 2-level model, 2+1 volumes of 32^3, 2 steps: every
                                       # step in seconds (CI); its scores mean nothing
    python bench/quality.py            # exp001_full on a GPU: 8+2 volumes of 128^3, 1000 steps

Through the `ctseg` CLI, as the rules run them: demo data -> convert -> targets -> split ->
stage -> train (one fixed phase, a fixed number of steps) -> infer the test volumes ->
evaluate. The demo's test volumes are held out of training and have labels (test_labels/),
which is what the workflow's evaluate rule scores on the demo dataset.

The baseline, scored in the same run on the same test volumes, learns nothing: the image
thresholded at a percentile of its own intensities. The percentile is the one of a small grid
that scores best (competition score, through `ctseg evaluate`) on the labelled training
volumes. The run ends with

    RESULT quality score=<x> baseline=<x> dice=<x> train_s=<x> steps=<n>

score and dice: the model's mean competition score and Dice on the test volumes; baseline: the
threshold's mean competition score there; train_s: the wall time of the `ctseg train` step.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pipeline
import tifffile
from pipeline import REPO, Prepared, Runner, StepFailed

PERCENTILES = (70.0, 75.0, 80.0, 84.0, 87.0, 90.0, 93.0, 96.0)
SMOKE_PERCENTILES = (80.0, 90.0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="exp001, under 5 min on 2 CPU cores")
    size.add_argument("--smoke", action="store_true", help="toy model and volumes: seconds (CI)")
    parser.add_argument(
        "--experiment", default=None, help="default exp001_full (quick, smoke: exp001)"
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps (1000; quick 80)")
    parser.add_argument("--phase", type=int, default=None, help="loader phase (6; quick 2)")
    parser.add_argument("--records", type=int, default=None, help="training volumes (8; quick 4)")
    parser.add_argument(
        "--test-records", type=int, default=None, help="held-out test volumes (2; smoke 1)"
    )
    parser.add_argument("--size", type=int, default=None, help="volume edge (128; quick 96)")
    parser.add_argument("--seed", type=int, default=0, help="demo data seed")
    parser.add_argument(
        "--preset", default=None, help="demo-data preset (default: config demo.preset)"
    )
    parser.add_argument("--percentiles", type=float, nargs="+", default=None, help="baseline grid")
    parser.add_argument("--device", default=None, help="default: cuda if any")
    parser.add_argument("--jobs", type=int, default=None, help="per-record steps side by side")
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default a temp dir")
    parser.add_argument(
        "--json", type=Path, default=REPO / "results/bench/quality.json", help="figures file"
    )
    return parser.parse_args()


def threshold_masks(
    images: dict[str, Path], percentile: float, out_dir: Path, suffix: str = ""
) -> list[Path]:
    """Each image above its own `percentile`-th intensity percentile, as a 0/1 mask TIFF named
    <id><suffix>.tif (the sheets are brighter than the background). The percentile is per
    volume, so it follows each volume's contrast, as a fixed grey value would not."""
    out_dir.mkdir(parents=True, exist_ok=True)
    masks = []
    for record_id, path in images.items():
        image = tifffile.imread(path)
        mask = (image > np.percentile(image, percentile)).astype(np.uint8)
        target = out_dir / f"{record_id}{suffix}.tif"
        tmp = target.with_name(target.name + ".tmp")
        tifffile.imwrite(tmp, mask)
        tmp.replace(target)
        masks.append(target)
    return masks


def baseline(runner: Runner, data: Prepared, percentiles: list[float]) -> dict[str, Any]:
    """Choose the percentile on the labelled training volumes, score it on the test volumes.

    The whole grid is scored by one `ctseg evaluate` (one process start instead of one per
    percentile): each mask is named <id>_p<percentile>, which scores.csv keeps as its id.
    """
    work = runner.workdir / "baseline"
    train_ids = data.labelled_train_ids
    train_images = {i: data.dataset / "train_images" / f"{i}.tif" for i in train_ids}
    train_labels = [data.dataset / "train_labels" / f"{i}.tif" for i in train_ids]
    masks: list[Path] = []
    for p in percentiles:
        masks += threshold_masks(train_images, p, work / "train", f"_p{p:g}")
    pipeline.evaluate(
        runner, masks, train_labels * len(percentiles), work / "train_evaluation", "baseline_grid"
    )
    with open(work / "train_evaluation" / "scores.csv", newline="") as handle:
        scores = {row["id"]: float(row["score"]) for row in csv.DictReader(handle)}
    grid = {p: statistics.fmean(scores[f"{i}_p{p:g}"] for i in train_ids) for p in percentiles}
    for p, score in grid.items():
        print(f"  baseline: percentile {p:g} scores {score:.3f} on the training volumes")
    best = max(grid, key=lambda p: grid[p])
    test_images = {i: data.dataset / "test_images" / f"{i}.tif" for i in data.test_ids}
    test_masks = threshold_masks(test_images, best, work / "test")
    test = pipeline.evaluate(
        runner, test_masks, pipeline.test_labels(data), work / "test_evaluation", "baseline_test"
    )
    return {"percentile": best, "train_scores": grid, "test": test}


def run(args: argparse.Namespace, workdir: Path, record: dict[str, Any]) -> None:
    quick, smoke = args.quick, args.smoke
    exp = pipeline.load_experiment(
        args.experiment or ("exp001" if quick or smoke else "exp001_full")
    )
    if smoke:
        pipeline.shrink_for_smoke(exp)
    steps = args.steps or (2 if smoke else 80 if quick else 1000)
    phase = args.phase if args.phase is not None else (0 if smoke else 2 if quick else 6)
    phases = pipeline.load_phases()
    if phase not in phases:
        raise SystemExit(f"--phase {phase}: not in config/phases.yaml")
    pipeline.set_training_budget(exp, steps, val_batches=1 if smoke else 4 if quick else 20)
    n_train = args.records or (2 if smoke else 4 if quick else 8)
    n_test = args.test_records or (1 if smoke else 2)
    size = args.size or (pipeline.SMOKE_SIZE if smoke else 96 if quick else 128)
    percentiles = args.percentiles or list(SMOKE_PERCENTILES if smoke else PERCENTILES)
    preset = args.preset or pipeline.load_config()["demo"]["preset"]
    record.update(
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        experiment=exp["name"],
        patch_size=exp["data"]["patch_size"],
        filters=exp["model"]["filters"],
        phase=phase,
        steps=steps,
        volumes={"train": n_train, "test": n_test, "size": size},
        preset=preset,
    )
    print(
        f"experiment {exp['name']}: patch {exp['data']['patch_size']}, filters "
        f"{exp['model']['filters']}; {n_train}+{n_test} volumes of {size}^3"
        f" (demo preset {preset}); {steps} steps under phase "
        f"{phase}; work dir {workdir}",
        flush=True,
    )
    runner = Runner(workdir, jobs=args.jobs or max(2, (os.cpu_count() or 2) // 2))
    try:
        data = pipeline.prepare(
            runner,
            exp,
            n_train=n_train,
            n_test=n_test,
            shape=(size,) * 3,
            seed=args.seed,
            preset=preset,
        )
        weights = pipeline.train(runner, data, exp, phases, phase, [], args.device)
        masks = pipeline.infer(runner, data, exp, weights, args.device)
        model = pipeline.evaluate(
            runner, masks, pipeline.test_labels(data), data.results / exp["name"] / "evaluation"
        )
        record["model"] = model
        record["train"] = pipeline.last_epoch(data, exp)
        record["train_s"] = runner.seconds["train"]
        record["baseline"] = baseline(runner, data, percentiles)
    finally:
        record["step_seconds"] = {k: round(v, 2) for k, v in runner.seconds.items()}
        record["total_s"] = round(runner.elapsed(), 1)


def main() -> int:
    args = parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ctseg_quality_"))
    record: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        run(args, workdir, record)
    except StepFailed as exc:
        print(f"quality: {exc}", file=sys.stderr)
        print(f"quality: work dir kept for inspection: {workdir}", file=sys.stderr)
        record["failed_step"] = exc.step
        pipeline.write_json(args.json, record)
        print(f"RESULT quality failed_step={exc.step.replace(' ', ':')}")
        return 1
    model, base = record["model"], record["baseline"]
    print(
        f"model:    score {model['mean_score']:.3f}  dice {model['mean_dice']:.3f}  "
        f"SurfaceDice {model['mean_surface_dice']:.3f}  VOI {model['mean_voi_score']:.3f}  "
        f"Topo {model['mean_topo_score']:.3f}  (val Dice {record['train'].get('val_dice', '-')})"
    )
    test = base["test"]
    print(
        f"baseline: score {test['mean_score']:.3f}  dice {test['mean_dice']:.3f}  "
        f"SurfaceDice {test['mean_surface_dice']:.3f}  VOI {test['mean_voi_score']:.3f}  "
        f"Topo {test['mean_topo_score']:.3f}  (percentile {base['percentile']:g})"
    )
    ratio = model["mean_score"] / test["mean_score"] if test["mean_score"] else float("nan")
    record["score_vs_baseline"] = ratio
    print(f"score vs baseline: {ratio:.2f}x; total {record['total_s']:.0f} s")
    pipeline.write_json(args.json, record)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"RESULT quality score={model['mean_score']:.3f} baseline={test['mean_score']:.3f} "
        f"dice={model['mean_dice']:.3f} train_s={record['train_s']:.3g} steps={record['steps']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
