"""Training benchmark: one measured trial per loader phase, same data, same run.

    python bench/train.py --quick                    # exp001 on CPU, phases 0-5, a few steps
    python bench/train.py --smoke                    # a 2-level model on 16^3, phases 0-1:
                                                     # every path in seconds (CI), no figures
    python bench/train.py --experiment exp001_full   # the starting point's model, phases 0-6

For each phase it runs `ctseg.trials.trials.run_trial`: `trial.steps` training steps with the
phase's loader settings, then the same model on batches already on the device (the compute ceiling).
It prints samples/s, the data-wait fraction and the feed efficiency (samples/s / ceiling) per
phase; with ``--status-quo`` it first runs the real starting point (README.md, "The starting
point"): phase 0 with the targets computed in the data workers (``runtime_targets``), then

    RESULT train best_phase=<n> speedup_vs_phase0=<x> feed_efficiency=<x> data_wait_fraction=<x>

where the last two are the best phase's (and ``speedup_vs_status_quo=<x>`` is appended with
``--status-quo``). The data are generated demo volumes, converted,
given offline targets and staged to the raw scratch format, as the pipeline does.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import pipeline  # bench/pipeline.py, beside this script
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))


def load_experiment(name: str) -> dict:
    """The experiment file as the workflow reads it (the shipped files list every key)."""
    exp = yaml.safe_load((REPO / "config/experiments" / f"{name}.yaml").read_text())
    try:
        import jsonschema
    except ImportError:  # a bare GPU machine: the files are complete, validation is a check
        return exp
    schema = yaml.safe_load((REPO / "workflow/schemas/experiment.schema.yaml").read_text())
    jsonschema.validate(exp, schema)
    return exp


def build_scratch(workdir: Path, n_records: int, size: int, clip: float) -> tuple[Path, list[str]]:
    """Demo volumes -> Zarr -> targets -> raw scratch, exactly the pipeline's steps."""
    from ctseg.preprocess.convert import convert_volume
    from ctseg.preprocess.demo_data import generate_demo
    from ctseg.preprocess.stage import stage_records
    from ctseg.preprocess.targets import compute_targets

    demo = workdir / "demo"
    generate_demo(demo, n_train=n_records, n_test=0, shape=(size,) * 3, scroll_ids=[1, 2], seed=0)
    store = workdir / "store"
    ids = []
    for image in sorted((demo / "train_images").glob("*.tif")):
        record = image.stem
        ids.append(record)
        convert_volume(image, store / "zarr/images" / f"{record}.zarr", kind="image")
        label_store = workdir / "labels" / f"{record}.zarr"
        convert_volume(demo / "train_labels" / image.name, label_store, kind="label")
        compute_targets(
            label_store, store / "targets" / f"{record}.zarr", clip_distance=clip, workers=2
        )
    scratch = workdir / "scratch"
    stage_records(str(store), ids, scratch, fmt="raw")
    return scratch, ids


def machine(device: str) -> str:
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else "no GPU"
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="under 3 minutes on 2 CPU cores")
    size.add_argument(
        "--smoke", action="store_true", help="toy model, patch and volumes: seconds, for CI"
    )
    parser.add_argument("--experiment", default="exp001")
    parser.add_argument("--phases", type=int, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=None, help="override trial.steps")
    parser.add_argument("--records", type=int, default=None)
    parser.add_argument("--size", type=int, default=None, help="demo volume edge, voxels")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--status-quo",
        action="store_true",
        help="also run the starting point: phase 0 with targets computed in the workers",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    from ctseg.training.distributed import pick_device
    from ctseg.trials.trials import run_trial

    exp = load_experiment(args.experiment)
    phases = yaml.safe_load((REPO / "config/phases.yaml").read_text())["phases"]
    device = str(pick_device(args.device))
    on_gpu = device.startswith("cuda")
    default_phases = [0, 1] if args.smoke else [0, 1, 2, 3, 4, 5] if not on_gpu else sorted(phases)
    wanted = args.phases or default_phases
    if args.quick:
        exp["trial"].update(steps=8, warmup_steps=2, ceiling_steps=4)
    if args.smoke:
        exp["trial"].update(steps=3, warmup_steps=1, ceiling_steps=2)
        pipeline.shrink_for_smoke(exp)
    if args.steps:
        exp["trial"]["steps"] = args.steps
    default_size = (
        pipeline.SMOKE_SIZE
        if args.smoke
        else 96
        if args.quick
        else max(160, *exp["data"]["patch_size"])
    )
    size = args.size or default_size
    n_records = args.records or (2 if args.quick or args.smoke else 4)
    clip = 8.0

    print(f"machine: {machine(device)}")
    print(
        f"experiment {exp['name']}: patch {exp['data']['patch_size']}, "
        f"filters {exp['model']['filters']}, {exp['trial']['steps']} trial steps"
    )
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        t0 = time.perf_counter()
        scratch, ids = build_scratch(Path(tmp), n_records, size, clip)
        print(f"data: {n_records} volumes of {size}^3 staged in {time.perf_counter() - t0:.1f} s")
        results = {}
        previous = None
        if args.status_quo:
            seeds = copy.deepcopy(exp)
            seeds["data"]["runtime_targets"] = True
            results["seeds"] = run_trial(
                seeds,
                0,
                phases[0],
                scratch=scratch,
                train_ids=ids,
                out_dir=Path(tmp) / "status_quo",
                clip_distance=clip,
                device=device,
            ).to_dict()
            print("status quo:", describe(0, phases[0], results["seeds"]), flush=True)
        for phase_id in wanted:
            out = Path(tmp) / f"phase{phase_id}"
            summary = run_trial(
                copy.deepcopy(exp),
                phase_id,
                phases[phase_id],
                scratch=scratch,
                train_ids=ids,
                out_dir=out,
                clip_distance=clip,
                previous=previous,
                device=device,
            ).to_dict()
            previous = out / "summary.json"
            results[phase_id] = summary
            print(describe(phase_id, phases[phase_id], summary), flush=True)

    ok = {p: s for p, s in results.items() if s["status"] == "ok"}
    if not ok or 0 not in ok:
        print("RESULT train failed: phase 0 or every phase did not finish ok")
        sys.exit(1)
    best = max((p for p in ok if p != "seeds"), key=lambda p: ok[p]["samples_per_s"])
    status_quo = ""
    if "seeds" in ok:
        ratio = ok[best]["samples_per_s"] / ok["seeds"]["samples_per_s"]
        status_quo = f" speedup_vs_status_quo={ratio:.3g}"
    print(
        f"RESULT train best_phase={best} "
        f"speedup_vs_phase0={ok[best]['samples_per_s'] / ok[0]['samples_per_s']:.3g} "
        f"feed_efficiency={ok[best]['feed_efficiency']:.3g} "
        f"data_wait_fraction={ok[best]['data_wait_fraction']:.3g}{status_quo}"
    )


def describe(phase_id: int, phase: dict, summary: dict) -> str:
    settings = (
        f"w{phase['workers']} b{phase['batch_size']} pf{phase['prefetch_factor']} "
        f"{'pers ' if phase['persistent_workers'] else ''}{phase['precision']}"
        f"{' cl' if phase['channels_last'] else ''}{' compile' if phase['compile'] else ''}"
    )
    if summary["status"] != "ok":
        return f"phase {phase_id} [{settings}]: {summary['status']} {summary.get('error', '')}"
    vram = summary["peak_vram_gb"]
    return (
        f"phase {phase_id} [{settings}]: {summary['samples_per_s']:7.2f} samples/s  "
        f"step {summary['median_step_s']:6.3f} s  wait {summary['data_wait_fraction']:5.1%}  "
        f"feed {summary['feed_efficiency']:.3f}  "
        f"VRAM {'-' if vram is None else f'{vram:.1f} GB'}  "
        f"RSS {summary['peak_host_rss_gb']:.2f} GB  "
        f"GPU util {summary['gpu_util_mean'] if summary['gpu_util_mean'] is not None else '-'}  "
        f"{summary['verdict']} (feed ± {summary['feed_efficiency_band']:.3f})"
    )


if __name__ == "__main__":
    main()
