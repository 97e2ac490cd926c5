"""MFU sweep: the starting point's model at phase 6's settings on one GPU, variant by variant.

    python bench/mfu.py                  # one CUDA GPU; < 12 min on an H200, compilation included
    python bench/mfu.py --cpu-smoke      # end to end at toy size on the CPU (CI runs this)

It crosses
- patch: exp001_full's 72x136x136 (computed at 80x144x144: 19.7% of the FLOPs padding) and the
  unpadded patch of the same cost, 80x144x144 (exp001_full_unpadded's);
- norm: ``instance`` (nn.InstanceNorm3d) and ``instance_layout`` (the same maths in the
  tensor's own memory format, ctseg.network.model.LayoutInstanceNorm3d);
- memory format: channels_last_3d and contiguous;
- batch: 4, 8, 16, while memory allows (a batch is skipped once the one before it ran out of
  memory, or its estimate from the one before it exceeds the card);
everything else is exp001_full's model, losses and recipe under phase 6 (config/phases.yaml:
bf16 autocast, torch.compile). The model is built, stepped and measured by the package itself:
`ctseg.training.train.setup` builds the run (model, optimizer, schedule, losses, counted FLOPs
and peak) and `ctseg.training.train.train_step` runs each optimizer step on device-resident
batches (`ctseg.training.feeds.ResidentBatches`: the compute ceiling, no loader, as a trial's
ceiling run; phase 6's data wait is 0.3% of its step), and `ctseg.trials.kernel_profile`
profiles the last steps.

Per variant it prints and writes (``--json``, rewritten after every variant, so a cut run keeps
what it measured): samples/s, useful voxels/s (samples/s x the patch's own voxels), TFLOP/s
(computed FLOPs), MFU on the computed and on the useful FLOPs (ctseg.network.flops), peak VRAM,
the first step's seconds (compilation) and the five largest kernel classes with their share of
the profiled step. The last line is

    RESULT mfu best=<variant> useful_voxels_per_s=<x> useful_mfu=<x> samples_per_s=<x>
        baseline_useful_voxels_per_s=<x> speedup_vs_baseline=<x> variants_ok=<k>/<n> total_s=<x>

(one line) where the baseline is phase 6 as shipped: 72x136x136, instance, channels_last, batch
4. The variants run in an order that puts the informative ones first; ``--budget-s`` (660 s)
stops starting new ones, so the sweep ends inside 12 minutes with what it has.

Compilation: one torch.compile per (patch, norm, memory format), its batch dimension dynamic
(``torch._dynamo.mark_dynamic``), so the three batches share it: 8 compilations instead of 24.
``--static-shapes`` compiles every variant afresh with static shapes, as phase 6 itself does
(fairer, 3x the compilation).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

PHASE = 6
PATCHES = {"padded": [72, 136, 136], "unpadded": [80, 144, 144]}
NORMS = ("instance", "instance_layout")
LAYOUTS = ("channels_last", "contiguous")
BATCHES = (4, 8, 16)
# The order the groups run in: phase 6 as shipped first (the baseline), then one change at a
# time, the contiguous layout (expected slower) last.
GROUPS = (
    ("padded", "instance", "channels_last"),
    ("unpadded", "instance", "channels_last"),
    ("unpadded", "instance_layout", "channels_last"),
    ("padded", "instance_layout", "channels_last"),
    ("unpadded", "instance_layout", "contiguous"),
    ("unpadded", "instance", "contiguous"),
    ("padded", "instance", "contiguous"),
    ("padded", "instance_layout", "contiguous"),
)
BUDGET_S = 660  # no variant starts after this: the sweep's promise is 12 minutes on an H200
MEMORY_MARGIN = 0.9  # a batch whose estimate exceeds this share of the card is not tried
# --cpu-smoke: exp001_full's five levels at a sixteenth of the width, toy patches (12x24x24 is
# computed at 16x32x32), batches 1 and 2, eager (compiling 8 groups on 2 cores takes minutes).
SMOKE_PATCHES = {"padded": [12, 24, 24], "unpadded": [16, 32, 32]}
SMOKE_BATCHES = (1, 2)


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def experiment(cpu_smoke: bool) -> dict:
    """exp001_full as its file has it (the shipped files list every key)."""
    exp = load_yaml(REPO / "config/experiments/exp001_full.yaml")
    if cpu_smoke:
        exp["model"]["filters"] = [f // 16 for f in exp["model"]["filters"]]
    return exp


def variant_name(patch: str, norm: str, layout: str, batch: int) -> str:
    return f"{patch}/{norm}/{layout}/b{batch}"


def synthetic_batch(
    batch: int, patch: list[int], dev: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """One device batch as `ctseg.data.device_batches.to_device` hands it to the step: image
    float32 in [0, 1], label (0/1/2), ignore, skeleton and tube uint8, sdt float32, each
    (B, 1, Z, Y, X). Sheets are planes every 8 voxels in z, so every loss term has work."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, 1, *patch)
    z = torch.arange(patch[0]).view(1, 1, -1, 1, 1).expand(shape)
    distance = ((z % 8) - 4).abs().float() - 1.0  # <= 0 on the sheets
    label = (distance <= 0).to(torch.uint8)
    label[:, :, :, :2] = 2  # a few unlabelled rows
    image = (label == 1).float() * 0.6 + 0.2 + 0.05 * torch.randn(shape, generator=gen)
    host = {
        "image": image.clamp(0, 1),
        "label": label,
        "ignore": (label == 2).to(torch.uint8),
        "skeleton": (distance == -1.0).to(torch.uint8),
        "tube": (distance <= 1).to(torch.uint8),
        "sdt": distance.clamp(-8, 8),
    }
    return {k: v.contiguous().to(dev) for k, v in host.items()}


def build_run(exp: dict, phase: dict, dev: torch.device, workdir: Path) -> Any:
    """The package's own run setup (model, optimizer, schedule, losses, FLOPs and peak)."""
    from ctseg.training.distributed import Ranks
    from ctseg.training.train import setup

    return setup(exp, phase, Ranks(), dev, {}, 8.0, 10**6, workdir, None)


def _compile(run: Any, phase: dict, cache: dict, group: tuple, static: bool) -> None:
    """The step model, compiled as phase 6 compiles it. Variants of one group share dynamo's
    cache (compiled code takes the module's parameters as inputs and the batch dimension is
    dynamic), so only the group's first variant compiles; a new group, or ``static``, starts
    from an empty cache."""
    if not phase.get("compile"):
        return
    if static or cache.get("group") != group:
        torch._dynamo.reset()
        cache["group"] = group
    run.step_model = torch.compile(run.model, mode=phase.get("compile_mode"))


def measure_variant(
    exp: dict, phase: dict, dev: torch.device, spec: dict, args: argparse.Namespace, cache: dict
) -> dict[str, Any]:
    """One variant: warm-up (compilation), measured steps, profiled steps; its figures."""
    from ctseg.training.feeds import ResidentBatches
    from ctseg.training.train import train_step
    from ctseg.trials.kernel_profile import PROFILE_WARMUP, profiled_steps

    exp = copy.deepcopy(exp)
    exp["model"]["norm"] = spec["norm"]
    exp["data"]["patch_size"] = list(spec["patch"])
    phase = {**phase, "batch_size": spec["batch"], "channels_last": spec["layout"] != "contiguous"}
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    run = build_run(exp, phase, dev, Path(args.workdir))
    group = (spec["patch_name"], spec["norm"], spec["layout"])
    _compile(run, phase, cache, group, args.static_shapes)
    batch = synthetic_batch(spec["batch"], spec["patch"], dev)
    batch["image"] = batch["image"].contiguous(memory_format=run.memory_format)
    if phase.get("compile") and not args.static_shapes:
        torch._dynamo.mark_dynamic(batch["image"], 0)
    batches = iter(ResidentBatches(iter([(batch, 0.0, 0.0)]), run.micro_steps))
    run.model.train()
    t0 = time.perf_counter()
    train_step(run, batches)
    first_step_s = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        train_step(run, batches)
    step_s = [train_step(run, batches)["step_s"] for _ in range(args.steps)]
    with profiled_steps(0, args.profile_steps, dev.type, phase) as profile:
        for _ in range(PROFILE_WARMUP + args.profile_steps):
            train_step(run, batches)
    return figures(run, spec, step_s, first_step_s, dict(profile), dev)


def figures(
    run: Any, spec: dict, step_s: list[float], first_step_s: float, profile: dict, dev: torch.device
) -> dict[str, Any]:
    """samples/s, useful voxels/s, TFLOP/s, both MFUs (ctseg.network.flops.Efficiency), peak
    VRAM and the five largest kernel classes."""
    eff = run.efficiency
    median = statistics.median(step_s)
    sps = spec["batch"] / median
    classes = (profile.get("classes") or {}).items()
    top = sorted(classes, key=lambda kv: -(kv[1].get("fraction") or 0.0))[:5]
    return {
        **{k: v for k, v in spec.items() if k != "patch_name"},
        "status": "ok",
        "median_step_s": median,
        "samples_per_s": sps,
        "useful_voxels_per_s": sps * math.prod(spec["patch"]),
        "computed_patch": list(eff.flops.computed_patch),
        "padding_share": eff.flops.padding_share,
        "tflops": eff.tflops(sps),
        "mfu": eff.mfu(sps),
        "useful_mfu": eff.useful_mfu(sps),
        "peak": eff.peak.to_dict(),
        "peak_vram_gb": torch.cuda.max_memory_allocated(dev) / 2**30
        if dev.type == "cuda"
        else None,
        "first_step_s": first_step_s,
        "top_kernel_classes": [[name, value.get("fraction")] for name, value in top],
        "conv3d_backend": profile.get("conv3d_backend"),
        "profile_error": profile.get("error"),
    }


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    patches = SMOKE_PATCHES if args.cpu_smoke else PATCHES
    batches = args.batches or (SMOKE_BATCHES if args.cpu_smoke else BATCHES)
    return [
        {
            "name": variant_name(p, n, layout, b),
            "patch_name": p,
            "patch": patches[p],
            "norm": n,
            "layout": layout,
            "batch": b,
        }
        for (p, n, layout), b in itertools.product(GROUPS, batches)
    ]


def too_big(spec: dict, done: list[dict], dev: torch.device) -> str | None:
    """Why this batch is not tried: its group ran out of memory at a smaller batch, or the
    group's largest measured peak, scaled to this batch, exceeds the card."""
    group = [
        r
        for r in done
        if (r["patch"], r["norm"], r["layout"]) == (spec["patch"], spec["norm"], spec["layout"])
    ]
    if any(r["status"] == "oom" for r in group):
        return "a smaller batch ran out of memory"
    measured = [r for r in group if r["status"] == "ok" and r.get("peak_vram_gb")]
    if dev.type != "cuda" or not measured:
        return None
    last = max(measured, key=lambda r: r["batch"])
    estimate = last["peak_vram_gb"] * spec["batch"] / last["batch"]
    total = torch.cuda.get_device_properties(dev).total_memory / 2**30
    if estimate > MEMORY_MARGIN * total:
        return f"estimated {estimate:.0f} GiB of {total:.0f}"
    return None


def describe(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['name']:<42} {r['status']}: {r.get('reason', '')}"
    vram = "-" if r["peak_vram_gb"] is None else f"{r['peak_vram_gb']:.1f} GB"
    top = ", ".join(f"{name} {100 * (share or 0):.0f}%" for name, share in r["top_kernel_classes"])
    return (
        f"{r['name']:<42} {r['samples_per_s']:8.2f} samples/s  "
        f"{r['useful_voxels_per_s'] / 1e6:8.2f} M useful voxels/s  {r['tflops']:7.2f} TFLOP/s  "
        f"MFU {100 * r['mfu']:.1f}% (useful {100 * r['useful_mfu']:.1f}%)  VRAM {vram}  "
        f"first step {r['first_step_s']:.1f} s  [{top}]"
    )


def result_line(results: list[dict], total_s: float) -> str:
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return f"RESULT mfu best=none variants_ok=0/{len(results)} total_s={total_s:.0f}"
    best = max(ok, key=lambda r: r["useful_voxels_per_s"])
    base = next((r for r in ok if r["name"] == results[0]["name"]), None)
    base_v = base["useful_voxels_per_s"] if base else float("nan")
    return (
        f"RESULT mfu best={best['name']} useful_voxels_per_s={best['useful_voxels_per_s']:.4g} "
        f"useful_mfu={best['useful_mfu']:.4f} samples_per_s={best['samples_per_s']:.4g} "
        f"baseline_useful_voxels_per_s={base_v:.4g} "
        f"speedup_vs_baseline={best['useful_voxels_per_s'] / base_v:.3f} "
        f"variants_ok={len(ok)}/{len(results)} total_s={total_s:.0f}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="toy sizes, eager, on the CPU")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--warmup", type=int, default=None, help="steps before the measured ones")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per variant")
    parser.add_argument("--profile-steps", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--static-shapes", action="store_true")
    parser.add_argument("--json", type=Path, default=REPO / "results/bench/mfu.json")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.warmup = max(1, args.warmup or (1 if smoke else 3))
    args.steps = args.steps or (2 if smoke else 10)
    args.profile_steps = args.profile_steps or (1 if smoke else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ctseg.network.backend import conv_backend
    from ctseg.training.distributed import pick_device

    dev = pick_device("cpu" if args.cpu_smoke else args.device)
    phase = load_yaml(REPO / "config/phases.yaml")["phases"][PHASE]
    if args.cpu_smoke:
        phase = {**phase, "compile": False}
    exp = experiment(args.cpu_smoke)
    record: dict[str, Any] = {
        "machine": f"{platform.machine()}, "
        f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'no GPU'}",
        "backend": conv_backend(dev, torch.bfloat16),
        "phase": phase,
        "model": exp["model"],
        "variants": [],
    }
    print(f"machine: {record['machine']}, torch {torch.__version__}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    start, cache = time.perf_counter(), {}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        args.workdir = tmp
        for spec in plan(args):
            result = run_one(exp, phase, dev, spec, args, cache, record["variants"], start)
            record["variants"].append(result)
            args.json.write_text(json.dumps(record, indent=1, default=str))
            print(describe(result), flush=True)
    line = result_line(record["variants"], time.perf_counter() - start)
    record["result"] = line
    args.json.write_text(json.dumps(record, indent=1, default=str))
    print(line)
    return 0 if line.split()[2] != "best=none" else 1


def run_one(
    exp: dict,
    phase: dict,
    dev: torch.device,
    spec: dict,
    args: argparse.Namespace,
    cache: dict,
    done: list[dict],
    start: float,
) -> dict[str, Any]:
    """One variant's record: measured, or why not (budget, memory, out of memory, failure)."""
    base = {k: v for k, v in spec.items() if k != "patch_name"}
    if time.perf_counter() - start > args.budget_s:
        return {**base, "status": "skipped", "reason": f"time budget {args.budget_s:.0f} s"}
    reason = too_big(spec, done, dev)
    if reason:
        return {**base, "status": "skipped", "reason": reason}
    try:
        return measure_variant(exp, phase, dev, spec, args, cache)
    except torch.cuda.OutOfMemoryError as exc:
        return {**base, "status": "oom", "reason": str(exc).splitlines()[0]}
    except Exception as exc:  # noqa: BLE001 - one failed variant must not end the sweep
        return {**base, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    finally:
        with contextlib.suppress(Exception):
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
