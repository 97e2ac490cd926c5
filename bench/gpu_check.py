"""GPU check: the pipeline's own steps on one CUDA GPU, at sizes that load it, in 6.5 minutes.

    python bench/gpu_check.py                 # exp001_full's model and patch, 4+2 volumes of 128^3
    python bench/gpu_check.py --cpu-smoke     # tiny sizes on the CPU: proves the script end to end

Through the `ctseg` CLI, with the arguments the rules pass and in the rules' order: demo data ->
convert (images, labels) -> targets -> split -> stage -> a trial of every phase in
config/phases.yaml -> train with phase auto -> infer the test volumes -> evaluate -> report.
The trials and the training are shortened (``--trial-steps``, ``--train-steps``); everything else
is the pipeline as shipped. It needs no network: see BENCHMARKS.md for carrying the few
packages a bare CUDA image lacks as wheels.

Then, in the same run, ctseg's GPU-resident inference against MONAI's
``sliding_window_inference`` on a 320^3 volume with exp001_full's model (bench/infer.py
``--monai-only --full-model``; window 80x160x160, so that both place their 63 windows alike and
their outputs are checked to agree).

It writes one JSON (``--json``) and prints a RESULT line for each GPU-only path:

    RESULT gpu_check_phase phase=<n> status=<s> samples_per_s=<x> ... mfu=<x> useful_mfu=<x> ...
    RESULT gpu_check_path path=pinned_unpack status=<s> phases=<n,..> h2d_fraction_max=<x>
    RESULT gpu_check_phase7_vs_6 status=<s> ratio=<x> same_maths=<yes|no>
    RESULT gpu_check_infer status=<s> ctseg_vs_monai=<x> shape=320x320x320 window=80x160x160
    RESULT gpu_check_path path=ema status=<ok|not_ok|failed|skipped> last.pt_is_ema=<bool>
    RESULT gpu_check_path path=fine_tune status=<s> first_loss=<x>_vs_fresh=<x>
    RESULT gpu_check auto_phase=<n> speedup_vs_phase0=<x> score=<x> ... best_mfu=<x> total_s=<x>

The last line is always the summary. speedup_vs_phase0 is the chosen phase's trial samples/s over
phase 0's in the same run, score the competition score of the held-out test volumes; tflops and
mfu are each trial's (ctseg.network.flops, ctseg.network.peaks: counted FLOPs x samples/s, over the
dense peak of the precision in use). The packed-batch unpack from pinned memory runs in the trials
of the phases with pin_memory and device prefetch; its line is ok when every one of them ran ok on
CUDA. The exit status is 1 when a step fails (the step and the tail of its log are printed), a
phase's
trial ends ``failed`` or the inference comparison fails.

Time (an H200, 16 cores): the landed check took 316 s at --trial-steps 20 --train-steps 200
--records 6, 235 s of it in the trials, mostly fixed costs per trial process (start-up, CUDA,
loader workers) and compilation (phase 6: 57 s, phase 7: 39 s), not steps. The defaults here
add a kernel profile per trial and the 320^3 comparison, and pay for them with fewer volumes
(4+2), 12-step trials for the uncompiled phases (20 for compiled ones, whose first steps
compile) and 100 training steps; TIME_LIMIT_S is the promise.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pipeline
from pipeline import REPO, Prepared, Runner, StepFailed

TIME_LIMIT_S = 390  # the check's promise: 6.5 minutes on one H200, compilation included
# Trial steps when --trial-steps is not given: compiled phases spend their first steps compiling
# (left out as warm-up), so they get more.
TRIAL_STEPS, COMPILED_TRIAL_STEPS, SMOKE_TRIAL_STEPS = 12, 20, 4
# The inference comparison: 320^3 with a window whose grid MONAI and ctseg share (320 = 80 x 4
# = 160 x 2: (size - window) is a multiple of window / 2 on every axis).
INFER_SHAPE, INFER_WINDOW = (320, 320, 320), (80, 160, 160)
INFER_TIMEOUT_S = 180  # expected ~30 s on an H200; a hang must not eat the device budget


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
    parser.add_argument(
        "--trial-steps",
        type=int,
        default=None,
        help=f"per phase (default {TRIAL_STEPS}, {COMPILED_TRIAL_STEPS} for compiled phases)",
    )
    parser.add_argument("--train-steps", type=int, default=None, help="default 100")
    parser.add_argument(
        "--skip-infer-compare", action="store_true", help="no 320^3 inference vs MONAI"
    )
    parser.add_argument(
        "--preset", default=None, help="demo-data preset (default: config demo.preset)"
    )
    parser.add_argument(
        "--train-phase",
        default="auto",
        help="phase of the training (default auto: the fastest ok trial); a number skips the "
        "recompilation of a compiled phase when device time is short",
    )
    parser.add_argument(
        "--fine-tune-steps",
        type=int,
        default=None,
        help="steps of the EMA + fine-tune check (default 20; smoke 4; 0 skips it)",
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
        "records": args.records or (3 if smoke else 4),
        "test_records": args.test_records or (1 if smoke else 2),
        "size": args.size or (48 if smoke else 128),
        "trial_steps": args.trial_steps or (SMOKE_TRIAL_STEPS if smoke else None),
        "train_steps": args.train_steps or (6 if smoke else 100),
        "device": args.device or ("cpu" if smoke else None),
        "jobs": args.jobs or (2 if smoke else max(2, (os.cpu_count() or 2) // 2)),
    }
    if smoke:
        # Small enough that every phase, torch.compile included, runs in minutes on 2 cores.
        exp["data"]["patch_size"] = [16, 32, 32]
        exp["model"]["filters"] = [4, 8, 16]
    pipeline.set_training_budget(exp, sizes["train_steps"], val_batches=2 if smoke else 10)
    return exp, sizes


def trial_experiment(
    exp: dict[str, Any], phase: dict[str, Any], steps: int | None
) -> dict[str, Any]:
    """The experiment as one phase's trial runs it: `steps` trial steps (default: by whether the
    phase compiles), a quarter of them warm-up (allocator, cuDNN autotuning, compilation)."""
    steps = steps or (COMPILED_TRIAL_STEPS if phase.get("compile") else TRIAL_STEPS)
    out = copy.deepcopy(exp)
    out["trial"].update(
        steps=steps, warmup_steps=max(1, steps // 4), ceiling_steps=max(2, steps // 2)
    )
    return out


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
        "device",
        "samples_per_s",
        "feed_efficiency",
        "data_wait_fraction",
        "h2d_fraction",
        "median_step_s",
        "peak_vram_gb",
        "peak_host_rss_gb",
        "gpu_util_mean",
        "effective_batch",
        "maths",
        "tflops",
        "mfu",
        "useful_mfu",
        "ceiling_mfu",
        "flops",
        "backend",
        "peak",
        "verdict",
        "error",
    )
    figures = {k: summary[k] for k in keys if k in summary}
    settings = summary.get("settings") or {}
    figures["pinned_unpack"] = bool(settings.get("pin_memory") and settings.get("device_prefetch"))
    profile = summary.get("profile") or {}
    if profile.get("classes"):
        figures["profile"] = {
            "largest": profile.get("largest"),
            "next_knob": profile.get("next_knob"),
            "fractions": {k: v.get("fraction") for k, v in profile["classes"].items()},
        }
    elif profile:
        figures["profile"] = {"error": profile.get("error")}
    return figures


def infer_compare(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """ctseg's GPU-resident inference against MONAI at 320^3, exp001_full's model, through
    bench/infer.py (its agreement check included); skipped with the reason where it cannot
    run."""
    if args.skip_infer_compare:
        return {"status": "skipped", "reason": "--skip-infer-compare"}
    if args.cpu_smoke:
        return {"status": "skipped", "reason": "cpu-smoke: exp001_full at 320^3 is GPU work"}
    if importlib.util.find_spec("monai") is None:
        return {"status": "skipped", "reason": "monai not installed (the bench extra)"}
    log = workdir / "logs" / "infer_compare.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        str(REPO / "bench/infer.py"),
        "--monai-only",
        "--full-model",
        "--monai-shape",
        ",".join(map(str, INFER_SHAPE)),
        "--monai-window",
        ",".join(map(str, INFER_WINDOW)),
        "--repeat",
        "2",
        "--workdir",
        str(workdir),
    ]
    start = time.perf_counter()
    print("  infer_compare: ctseg vs MONAI at 320^3 ...", flush=True)
    try:
        with open(log, "w") as handle:
            proc = subprocess.run(
                command,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=pipeline.child_env(),
                timeout=INFER_TIMEOUT_S,
            )
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"over {INFER_TIMEOUT_S} s", "log": str(log)}
    seconds = round(time.perf_counter() - start, 2)
    text = log.read_text(errors="replace")
    found = re.search(r"RESULT infer .*monai_ratio=([0-9.]+)", text)
    if proc.returncode != 0 or not found:
        tail = " | ".join(text.strip().splitlines()[-3:])
        return {"status": "failed", "reason": tail[-300:], "log": str(log), "seconds": seconds}
    return {"status": "ok", "ratio": float(found.group(1)), "seconds": seconds, "log": str(log)}


def ema_fine_tune(
    runner: Runner,
    data: Prepared,
    exp: dict[str, Any],
    phases: dict[int, dict[str, Any]],
    phase: int,
    source: Path,
    steps: int,
    device: str | None,
) -> dict[str, Any]:
    """A short fine-tune from the trained weights with an EMA of the weights, as the train rule
    runs it (`init_from` + `--init-from`): both GPU paths in one training. It checks that the
    fine-tune starts from the source (its first loss is below the fresh training's first) and
    that the EMA's weights, which last.pt holds, differ from the live weights it averaged."""
    import torch

    ft = copy.deepcopy(exp)
    ft["name"] = f"{exp['name']}_ft"
    ft["init_from"] = exp["name"]
    ft["train"]["ema"] = {"decay": 0.9, "start_step": 2}
    pipeline.set_training_budget(ft, steps, val_batches=2)
    run_dir = data.results / ft["name"]
    started = time.perf_counter()
    try:
        weights = pipeline.train(runner, data, ft, phases, phase, [], device, init_from=source)
    except StepFailed as exc:
        return {"status": "failed", "error": str(exc).splitlines()[0]}
    import pandas as pd

    first_ft = float(pd.read_csv(run_dir / "train/steps.csv")["loss"].iloc[0])
    first_fresh = float(pd.read_csv(data.results / exp["name"] / "train/steps.csv")["loss"].iloc[0])
    saved = torch.load(weights, map_location="cpu", weights_only=False)["model"]
    live = torch.load(run_dir / "checkpoints/resume.pt", map_location="cpu", weights_only=False)
    live_model = live.get("model", {}) if isinstance(live, dict) else {}
    differs = any(
        not torch.equal(saved[k].float(), live_model[k].float())
        for k in saved
        if k in live_model and saved[k].is_floating_point()
    )
    return {
        "status": "ok",
        "phase": phase,
        "steps": steps,
        "seconds": round(time.perf_counter() - started, 1),
        "first_loss_fine_tune": first_ft,
        "first_loss_fresh": first_fresh,
        "starts_from_source": first_ft < first_fresh,
        "ema_differs_from_live": differs,
    }


def optional_paths(check: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The EMA and fine-tune paths, from `ema_fine_tune`'s check (or why it did not run)."""
    if check is None:
        skipped = {"status": "skipped", "reason": "--fine-tune-steps 0"}
        return {"ema": skipped, "fine_tune": skipped}
    if check["status"] != "ok":
        return {"ema": check, "fine_tune": check}
    ema_ok = "ok" if check["ema_differs_from_live"] else "not_ok"
    ft_ok = "ok" if check["starts_from_source"] else "not_ok"
    return {
        "ema": {"status": ema_ok, "detail": f"last.pt_is_ema={check['ema_differs_from_live']}"},
        "fine_tune": {
            "status": ft_ok,
            "detail": f"first_loss={check['first_loss_fine_tune']:.4f}"
            f"_vs_fresh={check['first_loss_fresh']:.4f}",
        },
    }


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
    steps = sizes["trial_steps"] or f"{TRIAL_STEPS} ({COMPILED_TRIAL_STEPS} compiled)"
    print(
        f"experiment {exp['name']}: patch {exp['data']['patch_size']}, filters "
        f"{exp['model']['filters']}; {sizes['records']}+{sizes['test_records']} volumes of "
        f"{sizes['size']}^3; trials of {steps} steps for phases {wanted}; "
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
            trial_exp = trial_experiment(exp, phases[phase], sizes["trial_steps"])
            previous = pipeline.trial(runner, data, trial_exp, phases, phase, previous, device)
            summaries.append(previous)
            summary = pipeline.read_json(previous)
            record["phases"][phase] = phase_figures(summary)
            # Written as it goes: a run cut short by its time limit keeps what it measured.
            pipeline.write_json(args.json, record)
            print(f"  phase {phase}: {describe(summary)}", flush=True)
        train_phase = args.train_phase
        weights = pipeline.train(runner, data, exp, phases, train_phase, summaries, device)
        auto = chosen_phase(workdir / "logs/train.log") if train_phase == "auto" else None
        record["train_phase"] = train_phase
        ft_steps = args.fine_tune_steps
        ft_steps = (4 if args.cpu_smoke else 20) if ft_steps is None else ft_steps
        if ft_steps:
            ft_phase = int(train_phase) if train_phase != "auto" else (auto or 0)
            record["ema_fine_tune"] = ema_fine_tune(
                runner, data, exp, phases, ft_phase, weights, ft_steps, device
            )
            pipeline.write_json(args.json, record)
        masks = pipeline.infer(runner, data, exp, weights, device)
        run_dir = data.results / exp["name"]
        evaluation = pipeline.evaluate(
            runner, masks, pipeline.test_labels(data), run_dir / "evaluation"
        )
        # The run's files are laid out as the workflow's results/<run>/ (phases/, train/,
        # predictions/, evaluation/), so the report reads them as it reads a workflow run.
        overlays = [
            arg
            for i in data.test_ids[:3]
            for arg in ("--overlay", i, str(data.image(i)), str(data.label_zarr(i)))
        ]
        runner.run(
            "report",
            [
                "report",
                "--out",
                str(data.results / "report.html"),
                "--run",
                str(run_dir),
                *overlays,
            ],
        )
    finally:
        record["step_seconds"] = {k: round(v, 2) for k, v in runner.seconds.items()}
        record["total_s"] = round(runner.elapsed(), 1)
    record["infer_compare"] = infer_compare(args, workdir)
    record["step_seconds"]["infer_compare"] = record["infer_compare"].get("seconds")
    record["total_s"] = round(runner.elapsed(), 1)
    record["optional_paths"] = optional_paths(record.get("ema_fine_tune"))
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
        profile = fig.get("profile") or {}
        lines.append(
            f"RESULT gpu_check_phase phase={phase} status={fig['status']} "
            f"samples_per_s={fmt(fig.get('samples_per_s'), '.2f')} "
            f"feed_efficiency={fmt(fig.get('feed_efficiency'))} "
            f"data_wait_fraction={fmt(fig.get('data_wait_fraction'))} "
            f"vram_gb={fmt(fig.get('peak_vram_gb'), '.1f')} "
            f"tflops={fmt(fig.get('tflops'), '.4g')} mfu={fmt(fig.get('mfu'), '.4f')} "
            f"useful_mfu={fmt(fig.get('useful_mfu'), '.4f')} "
            f"conv3d_backend={(fig.get('backend') or {}).get('conv3d_backend')} "
            f"peak_tflops={fmt((fig.get('peak') or {}).get('tflops'), '.4g')} "
            f"profile_largest={(profile.get('largest') or 'none').replace(' ', '_')}"
        )
    lines += path_lines(record)
    auto = record["auto_phase"]
    if auto is None and str(record.get("train_phase", "auto")).isdigit():
        auto = int(record["train_phase"])  # a fixed training phase stands for auto's choice
    speedup = None
    if auto in phases and 0 in phases and phases[0].get("samples_per_s"):
        speedup = phases[auto]["samples_per_s"] / phases[0]["samples_per_s"]
    record["speedup_vs_phase0"] = speedup
    failed = [p for p, fig in phases.items() if fig["status"] == "failed"]
    record["failed_phases"] = failed
    record["within_time_limit"] = record["total_s"] < TIME_LIMIT_S
    mfus = {p: f["mfu"] for p, f in phases.items() if f.get("mfu") is not None}
    best = max(mfus, key=mfus.get) if mfus else None
    record["best_mfu_phase"] = best
    evaluation = record["evaluation"]
    lines.append(
        f"RESULT gpu_check auto_phase={auto} speedup_vs_phase0={fmt(speedup, '.2f')} "
        f"score={evaluation['mean_score']:.3f} dice={evaluation['mean_dice']:.3f} "
        f"val_dice={fmt(record['train'].get('val_dice'))} "
        f"phases_ok={sum(f['status'] == 'ok' for f in phases.values())}/{len(phases)} "
        f"best_mfu={fmt(mfus.get(best), '.4f')} best_mfu_phase={best} "
        f"total_s={record['total_s']:.0f}"
    )
    return lines


def path_lines(record: dict[str, Any]) -> list[str]:
    """One RESULT line per GPU-only path besides the phases; adds their statuses to `record`."""
    phases = record["phases"]
    pinned = [p for p, f in phases.items() if f.get("pinned_unpack")]
    if not pinned:
        status = "not_run"
    elif any(phases[p]["status"] == "failed" for p in pinned):
        status = "failed"
    elif not all(str(phases[p].get("device", "")).startswith("cuda") for p in pinned):
        status = "cpu_path"  # pin_memory and device prefetch take their CPU paths
    else:
        status = "ok" if all(phases[p]["status"] == "ok" for p in pinned) else "not_ok"
    h2d = [phases[p].get("h2d_fraction") for p in pinned if phases[p].get("h2d_fraction")]
    record["pinned_unpack"] = status
    lines = [
        f"RESULT gpu_check_path path=pinned_unpack status={status} "
        f"phases={','.join(map(str, pinned)) or 'none'} "
        f"h2d_fraction_max={fmt(max(h2d) if h2d else None)}"
    ]
    six, seven = phases.get(6), phases.get(7)
    if six and seven and six.get("samples_per_s") and seven.get("samples_per_s"):
        ratio = seven["samples_per_s"] / six["samples_per_s"]
        same = six.get("maths") == seven.get("maths")
        lines.append(
            f"RESULT gpu_check_phase7_vs_6 status=ok ratio={ratio:.2f} "
            f"same_maths={'yes' if same else 'no'}"
        )
        record["phase7_vs_6"] = ratio
    else:
        lines.append("RESULT gpu_check_phase7_vs_6 status=not_run ratio=- same_maths=-")
    compare = record.get("infer_compare") or {}
    shape, window = ("x".join(map(str, v)) for v in (INFER_SHAPE, INFER_WINDOW))
    reason = compare.get("reason", "")
    lines.append(
        f"RESULT gpu_check_infer status={compare.get('status')} "
        f"ctseg_vs_monai={fmt(compare.get('ratio'), '.2f')} shape={shape} window={window}"
        + (f" reason={json.dumps(reason)}" if reason else "")
    )
    for name, found in (record.get("optional_paths") or {}).items():
        detail = (
            found.get("detail")
            or f"reason={json.dumps(found.get('reason') or found.get('error', ''))}"
        )
        lines.append(f"RESULT gpu_check_path path={name} status={found['status']} {detail}")
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
    failed_compare = (record.get("infer_compare") or {}).get("status") == "failed"
    return 1 if record["failed_phases"] or failed_compare else 0


if __name__ == "__main__":
    sys.exit(main())
