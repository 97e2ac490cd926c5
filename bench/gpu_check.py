"""GPU check: the pipeline's own steps on one CUDA GPU, at sizes that load it, in under 6 minutes.

    python bench/gpu_check.py                 # exp001_full's model and patch, 10 volumes of 128^3
    python bench/gpu_check.py --cpu-smoke     # tiny sizes on the CPU: proves the script end to end

Through the `ctseg` CLI, with the arguments the rules pass and in the rules' order: demo data ->
convert (images, labels) -> targets -> split -> stage -> a trial of every phase in
config/phases.yaml -> train with phase auto -> infer the test volumes -> evaluate -> report.
The trials and the training are shortened (``--trial-steps``, ``--train-steps``); everything else
is the pipeline as shipped. It needs no network: see BENCHMARKS.md for carrying the few
packages a bare CUDA image lacks as wheels.

It writes one JSON (``--json``) and prints

    RESULT gpu_check_phase phase=<n> status=<s> samples_per_s=<x> feed_efficiency=<x> ...
    RESULT gpu_check auto_phase=<n> speedup_vs_phase0=<x> score=<x> dice=<x> val_dice=<x> ...

where speedup_vs_phase0 is the chosen phase's trial samples/s over phase 0's in the same run, and
score is the competition score of the held-out test volumes. The exit status is 1 when a step
fails (the step and the tail of its log are printed) or a phase's trial ends ``failed``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pipeline
from pipeline import REPO, Prepared, Runner, StepFailed

TIME_LIMIT_S = 360  # the check's promise: under 6 minutes on one GPU


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny sizes on the CPU (exp001 shrunk, 3+1 volumes of 48^3, a few steps)",
    )
    parser.add_argument("--experiment", default=None, help="default exp001_full (smoke: exp001)")
    parser.add_argument("--records", type=int, default=None, help="training volumes (default 8)")
    parser.add_argument("--test-records", type=int, default=None, help="test volumes (default 2)")
    parser.add_argument("--size", type=int, default=None, help="volume edge, voxels (default 128)")
    parser.add_argument("--phases", type=int, nargs="+", default=None, help="default: all")
    parser.add_argument("--trial-steps", type=int, default=None, help="per phase (default 30)")
    parser.add_argument("--train-steps", type=int, default=None, help="default 600")
    parser.add_argument(
        "--preset", default=None, help="demo-data preset (default: config demo.preset)"
    )
    parser.add_argument("--jobs", type=int, default=None, help="per-record steps side by side")
    parser.add_argument("--device", default=None, help="default: cuda (smoke: cpu)")
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default a temp dir")
    parser.add_argument(
        "--json", type=Path, default=REPO / "results/bench/gpu_check.json", help="figures file"
    )
    return parser.parse_args()


def configure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The experiment as the check runs it, and the sizes; explicit options win."""
    smoke = args.cpu_smoke
    exp = pipeline.load_experiment(args.experiment or ("exp001" if smoke else "exp001_full"))
    sizes = {
        "records": args.records or (3 if smoke else 8),
        "test_records": args.test_records or (1 if smoke else 2),
        "size": args.size or (48 if smoke else 128),
        "trial_steps": args.trial_steps or (4 if smoke else 30),
        "train_steps": args.train_steps or (6 if smoke else 600),
        "device": args.device or ("cpu" if smoke else None),
        "jobs": args.jobs or (2 if smoke else max(2, (os.cpu_count() or 2) // 2)),
    }
    if smoke:
        # Small enough that every phase, torch.compile included, runs in minutes on 2 cores.
        exp["data"]["patch_size"] = [16, 32, 32]
        exp["model"]["filters"] = [4, 8, 16]
    steps = sizes["trial_steps"]
    # Warm-up steps (allocator, cudnn autotuning, compilation) are left out of the medians.
    exp["trial"].update(
        steps=steps, warmup_steps=max(1, steps // 4), ceiling_steps=max(2, steps // 2)
    )
    pipeline.set_training_budget(exp, sizes["train_steps"], val_batches=2 if smoke else 10)
    return exp, sizes


def machine(device: str | None) -> str:
    import torch

    gpu = "no GPU"
    if device != "cpu" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}"


def chosen_phase(log: Path) -> int | None:
    """The phase `ctseg train --phase auto` says it chose."""
    found = re.search(r"phase auto: chose phase (\d+)", log.read_text(errors="replace"))
    return int(found.group(1)) if found else None


def phase_figures(summary: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "status",
        "samples_per_s",
        "feed_efficiency",
        "data_wait_fraction",
        "median_step_s",
        "peak_vram_gb",
        "peak_host_rss_gb",
        "gpu_util_mean",
        "effective_batch",
        "maths",
        "error",
    )
    return {k: summary[k] for k in keys if k in summary}


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def run_check(args: argparse.Namespace, workdir: Path, record: dict[str, Any]) -> None:
    exp, sizes = configure(args)
    phases = pipeline.load_phases()
    wanted = args.phases or sorted(phases)
    unknown = sorted(set(wanted) - set(phases))
    if unknown:
        raise SystemExit(f"--phases: {unknown} not in config/phases.yaml")
    device = sizes["device"]
    record.update(
        machine=machine(device),
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        ctseg=" ".join(pipeline.ctseg_command()),
        experiment=exp["name"],
        patch_size=exp["data"]["patch_size"],
        filters=exp["model"]["filters"],
        **{k: v for k, v in sizes.items() if k != "jobs"},
        phases={},
    )
    print(f"machine: {record['machine']}")
    print(
        f"experiment {exp['name']}: patch {exp['data']['patch_size']}, filters "
        f"{exp['model']['filters']}; {sizes['records']}+{sizes['test_records']} volumes of "
        f"{sizes['size']}^3; trials of {sizes['trial_steps']} steps for phases {wanted}; "
        f"train {sizes['train_steps']} steps; work dir {workdir}",
        flush=True,
    )
    runner = Runner(workdir, jobs=sizes["jobs"])
    try:
        data: Prepared = pipeline.prepare(
            runner,
            exp,
            n_train=sizes["records"],
            n_test=sizes["test_records"],
            shape=(sizes["size"],) * 3,
            preset=args.preset,
        )
        summaries, previous = [], None
        for phase in wanted:
            previous = pipeline.trial(runner, data, exp, phases, phase, previous, device)
            summaries.append(previous)
            summary = pipeline.read_json(previous)
            record["phases"][phase] = phase_figures(summary)
            print(f"  phase {phase}: {describe(summary)}", flush=True)
        weights = pipeline.train(runner, data, exp, phases, "auto", summaries, device)
        auto = chosen_phase(workdir / "logs/train.log")
        masks = pipeline.infer(runner, data, exp, weights, device)
        run_dir = data.results / exp["name"]
        evaluation = pipeline.evaluate(
            runner, masks, pipeline.test_labels(data), run_dir / "evaluation"
        )
        overlays = [
            arg
            for i, mask in list(zip(data.test_ids, masks, strict=True))[:3]
            for arg in ("--overlay", i, str(data.image(i)), str(data.label_zarr(i)), str(mask))
        ]
        runner.run(
            "report",
            [
                "report",
                "--out",
                str(data.results / "report.html"),
                "--experiment",
                exp["name"],
                "--phases",
                *map(str, summaries),
                "--train-dir",
                str(run_dir / "train"),
                "--evaluation-dir",
                str(run_dir / "evaluation"),
                *overlays,
            ],
        )
    finally:
        record["step_seconds"] = {k: round(v, 2) for k, v in runner.seconds.items()}
        record["total_s"] = round(runner.elapsed(), 1)
    epoch = pipeline.last_epoch(data, exp)
    record.update(
        auto_phase=auto,
        train={k: float(v) for k, v in epoch.items() if v not in ("", None)},
        evaluation=evaluation,
    )


def describe(summary: dict[str, Any]) -> str:
    if summary.get("status") != "ok":
        return f"{summary.get('status')}: {summary.get('error', '')}"
    return (
        f"{summary['samples_per_s']:8.2f} samples/s  feed {summary['feed_efficiency']:.3f}  "
        f"wait {summary['data_wait_fraction']:5.1%}  VRAM {fmt(summary.get('peak_vram_gb'), '.1f')}"
        f" GB  RSS {summary['peak_host_rss_gb']:.1f} GB"
    )


def result_lines(record: dict[str, Any]) -> list[str]:
    """The RESULT lines; adds the run's verdicts to `record`."""
    phases = record["phases"]
    lines = []
    for phase, fig in phases.items():
        lines.append(
            f"RESULT gpu_check_phase phase={phase} status={fig['status']} "
            f"samples_per_s={fmt(fig.get('samples_per_s'), '.2f')} "
            f"feed_efficiency={fmt(fig.get('feed_efficiency'))} "
            f"data_wait_fraction={fmt(fig.get('data_wait_fraction'))} "
            f"vram_gb={fmt(fig.get('peak_vram_gb'), '.1f')}"
        )
    auto = record["auto_phase"]
    speedup = None
    if auto in phases and 0 in phases and phases[0].get("samples_per_s"):
        speedup = phases[auto]["samples_per_s"] / phases[0]["samples_per_s"]
    record["speedup_vs_phase0"] = speedup
    failed = [p for p, fig in phases.items() if fig["status"] == "failed"]
    record["failed_phases"] = failed
    record["under_6_min"] = record["total_s"] < TIME_LIMIT_S
    evaluation = record["evaluation"]
    lines.append(
        f"RESULT gpu_check auto_phase={auto} speedup_vs_phase0={fmt(speedup, '.2f')} "
        f"score={evaluation['mean_score']:.3f} dice={evaluation['mean_dice']:.3f} "
        f"val_dice={fmt(record['train'].get('val_dice'))} "
        f"phases_ok={sum(f['status'] == 'ok' for f in phases.values())}/{len(phases)} "
        f"total_s={record['total_s']:.0f}"
    )
    return lines


def main() -> int:
    args = parse_args()
    if not args.cpu_smoke and args.device in (None, "cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run with --cpu-smoke on a CPU", file=sys.stderr)
            return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ctseg_gpu_check_"))
    record: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        run_check(args, workdir, record)
    except StepFailed as exc:
        record["failed_step"] = exc.step
        print(f"gpu_check: {exc}", file=sys.stderr)
        print(f"gpu_check: work dir kept for inspection: {workdir}", file=sys.stderr)
        pipeline.write_json(args.json, record)
        print(f"RESULT gpu_check failed_step={exc.step.replace(' ', ':')}")
        return 1
    lines = result_lines(record)
    pipeline.write_json(args.json, record)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(lines))
    # oom and over_memory are findings about the machine; a failed trial is a failure of the code.
    return 1 if record["failed_phases"] else 0


if __name__ == "__main__":
    sys.exit(main())
