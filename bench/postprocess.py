"""Tuned post-processing against the default threshold 0.5, on the realistic demo's test volumes.

    python bench/postprocess.py --quick    # exp001 on the CPU: 4+2 volumes of 96^3, 200 steps
    python bench/postprocess.py --smoke    # a 2-level model, 2+1 volumes of 32^3, 2 steps: every
                                           # step in seconds (CI); its scores mean nothing
    python bench/postprocess.py            # exp001_full on a GPU: 8+2 volumes of 128^3

Through the `ctseg` CLI, as the rules run them: demo data (preset realistic) -> convert ->
targets -> split -> stage -> train -> `ctseg infer` (probabilities only) for the val split and
the test volumes -> `ctseg tune-postprocess` on the val split (the experiment's held-out
training records) -> `ctseg postprocess` of the test volumes twice, with the tuned settings and
with the default (threshold 0.5, nothing else) -> `ctseg evaluate` of both. The test volumes
are never seen by training or by the search.

Also scored in the same run, on the same test volumes: bench/quality.py's baseline, the image
thresholded at the intensity percentile that scores best on the labelled training volumes (no
learning). The run ends with

    RESULT postprocess tuned=<x> default=<x> tuned_gain=<x> ratio=<x> baseline=<x> gap=<x>

tuned / default: mean competition score of the test volumes with each post-processing;
tuned_gain = tuned - default; ratio = tuned / default; baseline: the percentile threshold's
score; gap = tuned - baseline.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pipeline
import quality
from pipeline import REPO, Prepared, Runner, StepFailed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="exp001 on 2 CPU cores")
    size.add_argument("--smoke", action="store_true", help="toy model and volumes: seconds (CI)")
    parser.add_argument(
        "--experiment", default=None, help="default exp001_full (quick, smoke: exp001)"
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps (1000; quick 200)")
    parser.add_argument("--phase", type=int, default=None, help="loader phase (6; quick 2)")
    parser.add_argument("--records", type=int, default=None, help="training volumes (8; quick 4)")
    parser.add_argument(
        "--test-records", type=int, default=None, help="held-out test volumes (2; smoke 1)"
    )
    parser.add_argument("--size", type=int, default=None, help="volume edge (128; quick 96)")
    parser.add_argument("--seed", type=int, default=0, help="demo data seed")
    parser.add_argument("--preset", default="realistic", help="demo-data preset")
    parser.add_argument("--workers", type=int, default=pipeline.EVALUATE_WORKERS)
    parser.add_argument("--device", default=None, help="default: cuda if any")
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default a temp dir")
    parser.add_argument(
        "--json", type=Path, default=REPO / "results/bench/postprocess.json", help="figures file"
    )
    return parser.parse_args()


def probabilities(
    runner: Runner, data: Prepared, name: str, ids: list[str], weights: Path, device: str | None
) -> dict[str, Path]:
    """`ctseg infer` without --mask, as the infer rule runs it: the probability stores only."""
    icfg = pipeline.load_config()["infer"]
    stores = {}
    for record_id in ids:
        store = data.results / name / "probabilities" / f"{record_id}.zarr"
        args = [
            "infer",
            str(weights),
            str(data.image(record_id)),
            "--probabilities",
            str(store),
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
        runner.run("infer", args, record_id)
        stores[record_id] = store
    return stores


def tune(runner: Runner, data: Prepared, stores: dict[str, Path], out: Path, workers: int) -> Path:
    """`ctseg tune-postprocess` on the val split, with the config's search space."""
    tcfg = pipeline.load_config()["infer"]["tune"]
    args = [
        "tune-postprocess",
        "--probabilities",
        *(str(stores[i]) for i in data.val_ids),
        "--labels",
        *(str(data.dataset / "train_labels" / f"{i}.tif") for i in data.val_ids),
        "--out",
        str(out),
        "--thresholds",
        *map(str, tcfg["thresholds"]),
        "--refine-step",
        str(tcfg["refine_step"]),
        "--hysteresis-offsets",
        *map(str, tcfg["hysteresis_offsets"]),
        "--min-component-voxels",
        *map(str, tcfg["min_component_voxels"]),
        *([] if tcfg["fill_holes"] else ["--no-fill-holes"]),
        "--workers",
        str(workers),
    ]
    runner.run("tune_postprocess", args)
    return out / "tuned.json"


def masks(
    runner: Runner, data: Prepared, stores: dict[str, Path], out: Path, options: list[str]
) -> list[Path]:
    paths = []
    for record_id in data.test_ids:
        mask = out / f"{record_id}.tif"
        runner.run("postprocess", ["postprocess", str(stores[record_id]), str(mask), *options])
        paths.append(mask)
    return paths


def run(args: argparse.Namespace, workdir: Path, record: dict[str, Any]) -> None:
    quick, smoke = args.quick, args.smoke
    exp = pipeline.load_experiment(
        args.experiment or ("exp001" if quick or smoke else "exp001_full")
    )
    if smoke:
        pipeline.shrink_for_smoke(exp)
    steps = args.steps or (2 if smoke else 200 if quick else 1000)
    phase = args.phase if args.phase is not None else (0 if smoke else 2 if quick else 6)
    phases = pipeline.load_phases()
    pipeline.set_training_budget(exp, steps, val_batches=1 if smoke else 4 if quick else 20)
    n_train = args.records or (2 if smoke else 4 if quick else 8)
    n_test = args.test_records or (1 if smoke else 2)
    size = args.size or (pipeline.SMOKE_SIZE if smoke else 96 if quick else 128)
    percentiles = quality.SMOKE_PERCENTILES if smoke else quality.PERCENTILES
    record.update(
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        experiment=exp["name"],
        steps=steps,
        phase=phase,
        volumes={"train": n_train, "test": n_test, "size": size},
        preset=args.preset,
    )
    print(
        f"experiment {exp['name']}: {n_train}+{n_test} volumes of {size}^3 (preset "
        f"{args.preset}); {steps} steps under phase {phase}; work dir {workdir}",
        flush=True,
    )
    runner = Runner(workdir, jobs=max(2, (os.cpu_count() or 2) // 2))
    try:
        data = pipeline.prepare(
            runner,
            exp,
            n_train=n_train,
            n_test=n_test,
            shape=(size,) * 3,
            seed=args.seed,
            preset=args.preset,
        )
        if not data.val_ids:
            raise SystemExit(f"experiment {exp['name']}: the val split is empty; nothing to tune")
        weights = pipeline.train(runner, data, exp, phases, phase, [], args.device)
        name = exp["name"]
        stores = probabilities(
            runner, data, name, data.val_ids + data.test_ids, weights, args.device
        )
        tuned_json = tune(runner, data, stores, data.results / name / "postprocess", args.workers)
        tuned = pipeline.read_json(tuned_json)
        labels = pipeline.test_labels(data)
        out = data.results / name
        tuned_masks = masks(runner, data, stores, out / "tuned", ["--settings", str(tuned_json)])
        default_masks = masks(runner, data, stores, out / "default", ["--threshold", "0.5"])
        record["tuned"] = tuned
        record["test_tuned"] = pipeline.evaluate(
            runner, tuned_masks, labels, out / "evaluation_tuned", "tuned"
        )
        record["test_default"] = pipeline.evaluate(
            runner, default_masks, labels, out / "evaluation_default", "default"
        )
        record["baseline"] = quality.baseline(runner, data, list(percentiles))
    finally:
        record["step_seconds"] = {k: round(v, 2) for k, v in runner.seconds.items()}
        record["total_s"] = round(runner.elapsed(), 1)


def main() -> int:
    args = parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ctseg_postprocess_"))
    record: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        run(args, workdir, record)
    except StepFailed as exc:
        print(f"postprocess: {exc}", file=sys.stderr)
        print(f"postprocess: work dir kept for inspection: {workdir}", file=sys.stderr)
        record["failed_step"] = exc.step
        pipeline.write_json(args.json, record)
        print(f"RESULT postprocess failed_step={exc.step.replace(' ', ':')}")
        return 1
    tuned, default = record["test_tuned"], record["test_default"]
    base = record["baseline"]["test"]["mean_score"]
    t, d = tuned["mean_score"], default["mean_score"]
    print(
        f"val search: chose {record['tuned']['label']} ({record['tuned']['candidates']} "
        f"candidates; val score {record['tuned']['score']:.3f} vs "
        f"{record['tuned']['default']['score']:.3f} at 0.5)"
    )
    for what, s in (("tuned", tuned), ("default 0.5", default)):
        print(
            f"test, {what:11s}: score {s['mean_score']:.3f}  SurfaceDice "
            f"{s['mean_surface_dice']:.3f}  VOI {s['mean_voi_score']:.3f}  "
            f"Topo {s['mean_topo_score']:.3f}"
        )
    print(f"test, percentile baseline: score {base:.3f}")
    ratio = t / d if d > 0 else float("inf")
    record["result"] = {
        "tuned": t,
        "default": d,
        "tuned_gain": t - d,
        "ratio": ratio,
        "baseline": base,
        "gap": t - base,
    }
    pipeline.write_json(args.json, record)
    print(
        f"RESULT postprocess tuned={t:.4f} default={d:.4f} tuned_gain={t - d:.4f} "
        f"ratio={ratio:.3f} baseline={base:.4f} gap={t - base:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
