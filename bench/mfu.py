"""MFU sweep: the starting point's model under the shipped compiled phases, then variants of the
fastest, each measured on one GPU and told apart by what its step spends time on.

    python bench/mfu.py                  # one CUDA GPU; about 5 min on an H200, compiling included
    python bench/mfu.py --cpu-smoke      # end to end at toy size on the CPU (CI runs this)

Variants (`VARIANTS`), in the order they run:
- the shipped phases first, each compiled as config/phases.yaml ships it: phase 6 on exp001_full
  (the baseline: its 72x136x136 patch is computed at 80x144x144), phase 6 on
  exp001_full_unpadded (80x144x144, nothing padded: the README's GPU command), phase 8 (phase 6
  at batch 16) on exp001_full_unpadded, phase 7 (CUDA graphs) on exp001_full;
- then one change to phase 8 at a time: CUDA graphs (compile mode reduce-overhead, possible once
  nothing in the step reads the device), torch's ``nn.InstanceNorm3d`` instead of the
  layout-keeping norm, the contiguous layout, and exp001_full's padded patch.
Everything else is the experiment's model, losses and recipe as shipped (filters 32-512, deep
supervision, all five loss terms). The package builds, compiles and steps the run itself:
`ctseg.training.train.setup` and `Run.compile_step`, and `train_step` on device-resident batches
(`ctseg.training.feeds.ResidentBatches`: the compute ceiling, no loader).

Per variant it prints and writes (``--json``, rewritten after every variant, so a cut run keeps
what it measured): samples/s and useful voxels/s (samples/s x the patch's own voxels) over
``--steps`` steps timed as a block (one synchronisation at the end, as training reads the device
once every log_every steps), TFLOP/s, MFU on the computed and the useful FLOPs
(ctseg.network.flops), peak VRAM, the first step's seconds (compilation), the profiled step's
kernel classes (ctseg.trials.kernel_profile: the five largest, the idle and copy shares, the
largest copy kernels by name), and two counts, made on any device:

- ``layout_copies``: operators in one eager step (forward, losses, backward, optimizer) that
  write a 5D tensor in another memory format than their inputs'
  (`ctseg.training.probes.count_layout_changes`); eager, because a compiled graph's operators
  are not visible one by one (its copies are in the kernel classes);
- ``host_syncs``: reads of a tensor's value by the host (``item``, ``float``, ``tolist``, ...)
  and ``torch.cuda.synchronize`` calls per step, over steps between two logged ones
  (`ctseg.training.probes.count_host_syncs`).

The last line is

    RESULT mfu best=<v> useful_voxels_per_s=<x> useful_mfu=<x> samples_per_s=<x>
        layout_copies=<n> host_syncs=<x> idle=<x> copies=<x> best_shipped=<v>
        best_shipped_useful_voxels_per_s=<x> best_shipped_layout_copies=<n>
        best_shipped_host_syncs=<x> baseline_useful_voxels_per_s=<x> speedup_vs_baseline=<x>
        variants_ok=<k>/<n> total_s=<x>

(one line): the best variant, the best shipped phase, and the baseline (phase 6 as shipped).
``--budget-s`` (280 s) starts no variant that the slowest so far would carry past it, so the
sweep ends inside 5 minutes on an H200 with what it has.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

BASELINE = "phase6"
# name, experiment, phase and the settings it changes (model.norm, or phase keys).
VARIANTS: tuple[dict[str, Any], ...] = (
    {"name": "phase6", "experiment": "exp001_full", "phase": 6},
    {"name": "phase6/unpadded", "experiment": "exp001_full_unpadded", "phase": 6},
    {"name": "phase8", "experiment": "exp001_full_unpadded", "phase": 8},
    {"name": "phase7", "experiment": "exp001_full", "phase": 7},
    {
        "name": "phase8+cudagraphs",
        "experiment": "exp001_full_unpadded",
        "phase": 8,
        "phase_changes": {"compile_mode": "reduce-overhead"},
    },
    {
        "name": "phase8/norm=instance",
        "experiment": "exp001_full_unpadded",
        "phase": 8,
        "norm": "instance",
    },
    {
        "name": "phase8/contiguous",
        "experiment": "exp001_full_unpadded",
        "phase": 8,
        "phase_changes": {"channels_last": False},
    },
    {"name": "phase8/exp001_full", "experiment": "exp001_full", "phase": 8},
)
SHIPPED = ("phase6", "phase6/unpadded", "phase8", "phase7")
BUDGET_S = 280  # the sweep's promise is 5 minutes on an H200, compilation included
# --cpu-smoke: the experiments' five levels at a sixteenth of the width, toy patches of the same
# kind (12x24x24 is computed at 16x32x32 as 72x136x136 is at 80x144x144), an eighth of the batch,
# eager (inductor on 2 cores takes minutes per variant).
SMOKE_PATCHES = {"exp001_full": [12, 24, 24], "exp001_full_unpadded": [16, 32, 32]}
TOP_CLASSES = 5


def experiment(name: str, cpu_smoke: bool) -> dict[str, Any]:
    """The shipped experiment, its defaults filled and its ``extends`` resolved."""
    from ctseg.config import load_experiment, thaw

    exp = thaw(load_experiment(REPO / "config/experiments" / f"{name}.yaml"))
    if cpu_smoke:
        exp["model"]["filters"] = [f // 16 for f in exp["model"]["filters"]]
        exp["data"]["patch_size"] = list(SMOKE_PATCHES[name])
    return exp


def shipped_phase(number: int) -> dict[str, Any]:
    from ctseg.config import load_phases

    return dict(load_phases(REPO / "config/phases.yaml")[number])


def variant_settings(spec: dict[str, Any], cpu_smoke: bool) -> tuple[dict, dict]:
    """The experiment and phase a variant runs: the shipped ones with its changes."""
    exp = experiment(spec["experiment"], cpu_smoke)
    if "norm" in spec:
        exp["model"]["norm"] = spec["norm"]
    phase = {**shipped_phase(spec["phase"]), **spec.get("phase_changes", {})}
    if cpu_smoke:
        phase = {**phase, "compile": False, "batch_size": max(1, phase["batch_size"] // 8)}
    return exp, phase


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


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_variant(
    spec: dict[str, Any], dev: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """One variant: an eager step with its layout changes counted, compilation as the phase
    ships it, warm-up, timed steps, steps with their host reads counted, profiled steps."""
    from ctseg.training.feeds import ResidentBatches
    from ctseg.training.probes import count_host_syncs, count_layout_changes
    from ctseg.training.train import train_step
    from ctseg.trials.kernel_profile import PROFILE_WARMUP, profiled_steps

    exp, phase = variant_settings(spec, args.cpu_smoke)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    torch._dynamo.reset()
    run = build_run(exp, phase, dev, Path(args.workdir))
    batch = synthetic_batch(phase["batch_size"], exp["data"]["patch_size"], dev)
    batches = iter(ResidentBatches(iter([(batch, 0.0, 0.0)]), run.micro_steps))
    run.model.train()
    with count_layout_changes() as changes:
        train_step(run, batches)  # eager: every operator is seen
    if phase.get("compile"):
        run.compile_step()
    t0 = time.perf_counter()
    train_step(run, batches)
    synchronize(dev)
    first_step_s = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        train_step(run, batches)
    synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step(run, batches)
    synchronize(dev)
    step_s = (time.perf_counter() - t0) / args.steps
    with count_host_syncs() as reads:
        for _ in range(args.sync_steps):
            train_step(run, batches)
    synchronize(dev)
    with profiled_steps(0, args.profile_steps, dev.type, phase) as profile:
        for _ in range(PROFILE_WARMUP + args.profile_steps):
            train_step(run, batches)
    return figures(
        run, exp, phase, spec, step_s, first_step_s, dict(profile), dev,
        layout_copies=sum(changes.values()),
        layout_detail=dict(changes.most_common(8)),
        host_syncs=sum(reads.values()) / args.sync_steps,
    )  # fmt: skip


def figures(
    run: Any,
    exp: dict,
    phase: dict,
    spec: dict,
    step_s: float,
    first_step_s: float,
    profile: dict,
    dev: torch.device,
    **counts: Any,
) -> dict[str, Any]:
    """samples/s, useful voxels/s, TFLOP/s, both MFUs (ctseg.network.flops.Efficiency), peak
    VRAM, the kernel classes and the counts."""
    eff = run.efficiency
    sps = phase["batch_size"] / step_s
    classes = profile.get("classes") or {}
    top = sorted(classes.items(), key=lambda kv: -(kv[1].get("fraction") or 0.0))[:TOP_CLASSES]

    def share(name: str) -> float | None:
        return (classes.get(name) or {}).get("fraction")

    return {
        "name": spec["name"],
        "experiment": spec["experiment"],
        "phase": spec["phase"],
        "patch": list(exp["data"]["patch_size"]),
        "norm": exp["model"]["norm"],
        "batch": phase["batch_size"],
        "channels_last": phase["channels_last"],
        "compile": phase["compile"],
        "compile_mode": phase.get("compile_mode"),
        "status": "ok",
        "step_s": step_s,
        "samples_per_s": sps,
        "useful_voxels_per_s": sps * math.prod(exp["data"]["patch_size"]),
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
        "idle": share("idle"),
        "copies": share("copies"),
        "copy_kernels": (profile.get("kernels") or {}).get("copies", []),
        "conv3d_backend": profile.get("conv3d_backend"),
        "profile_error": profile.get("error"),
        **counts,
    }


def describe(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['name']:<22} {r['status']}: {r.get('reason', '')}"
    vram = "-" if r["peak_vram_gb"] is None else f"{r['peak_vram_gb']:.1f} GB"
    top = ", ".join(f"{name} {100 * (share or 0):.0f}%" for name, share in r["top_kernel_classes"])
    lines = [
        f"{r['name']:<22} {r['samples_per_s']:8.2f} samples/s  "
        f"{r['useful_voxels_per_s'] / 1e6:8.2f} M useful voxels/s  {r['tflops']:7.2f} TFLOP/s  "
        f"MFU {100 * r['mfu']:.1f}% (useful {100 * r['useful_mfu']:.1f}%)  VRAM {vram}  "
        f"first step {r['first_step_s']:.1f} s  layout_copies={r['layout_copies']} "
        f"host_syncs={r['host_syncs']:g}  idle={_pct(r['idle'])} copies={_pct(r['copies'])}  "
        f"[{top}]"
    ]
    lines += [f"{'':<22}   copy kernel {share:.1%} of the step: {name}" for name, share in
              r["copy_kernels"]]  # fmt: skip
    lines += [f"{'':<22}   layout change x{n}: {what}" for what, n in r["layout_detail"].items()]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def result_line(results: list[dict], total_s: float) -> str:
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return f"RESULT mfu best=none variants_ok=0/{len(results)} total_s={total_s:.0f}"
    best = max(ok, key=lambda r: r["useful_voxels_per_s"])
    shipped = [r for r in ok if r["name"] in SHIPPED]
    best_shipped = max(shipped, key=lambda r: r["useful_voxels_per_s"]) if shipped else None
    base = next((r for r in ok if r["name"] == BASELINE), None)
    base_v = base["useful_voxels_per_s"] if base else float("nan")
    fields = {
        "best": best["name"],
        "useful_voxels_per_s": f"{best['useful_voxels_per_s']:.4g}",
        "useful_mfu": f"{best['useful_mfu']:.4f}",
        "samples_per_s": f"{best['samples_per_s']:.4g}",
        "layout_copies": best["layout_copies"],
        "host_syncs": f"{best['host_syncs']:g}",
        "idle": _fraction(best["idle"]),
        "copies": _fraction(best["copies"]),
        "best_shipped": best_shipped["name"] if best_shipped else "none",
    }
    if best_shipped:
        fields.update(
            best_shipped_useful_voxels_per_s=f"{best_shipped['useful_voxels_per_s']:.4g}",
            best_shipped_layout_copies=best_shipped["layout_copies"],
            best_shipped_host_syncs=f"{best_shipped['host_syncs']:g}",
        )
    fields.update(
        baseline_useful_voxels_per_s=f"{base_v:.4g}",
        speedup_vs_baseline=f"{best['useful_voxels_per_s'] / base_v:.3f}",
        variants_ok=f"{len(ok)}/{len(results)}",
        total_s=f"{total_s:.0f}",
    )
    return "RESULT mfu " + " ".join(f"{k}={v}" for k, v in fields.items())


def _fraction(value: float | None) -> str:
    return "nan" if value is None else f"{value:.3f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="toy sizes, eager, on the CPU")
    parser.add_argument("--device", default=None)
    parser.add_argument("--variants", nargs="+", default=None, help="names (default: all)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--sync-steps", type=int, default=2, help="steps with reads counted")
    parser.add_argument("--profile-steps", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--json", type=Path, default=REPO / "results/bench/mfu.json")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.warmup = max(1, args.warmup or (1 if smoke else 3))
    args.steps = args.steps or (2 if smoke else 10)
    args.profile_steps = args.profile_steps or (1 if smoke else 3)
    known = [v["name"] for v in VARIANTS]
    unknown = sorted(set(args.variants or ()) - set(known))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {known}")
    return args


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [v for v in VARIANTS if args.variants is None or v["name"] in args.variants]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ctseg.network.backend import conv_backend
    from ctseg.training.distributed import pick_device

    dev = pick_device("cpu" if args.cpu_smoke else args.device)
    record: dict[str, Any] = {
        "machine": f"{platform.machine()}, "
        f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'no GPU'}",
        "torch": torch.__version__,
        "backend": conv_backend(dev, torch.bfloat16),
        "variants": [],
    }
    print(f"machine: {record['machine']}, torch {torch.__version__}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    start, slowest = time.perf_counter(), 0.0
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        args.workdir = tmp
        for spec in plan(args):
            began = time.perf_counter()
            result = run_one(spec, dev, args, began - start + slowest)
            slowest = max(slowest, time.perf_counter() - began)
            record["variants"].append(result)
            args.json.write_text(json.dumps(record, indent=1, default=str))
            print(describe(result), flush=True)
    line = result_line(record["variants"], time.perf_counter() - start)
    record["result"] = line
    args.json.write_text(json.dumps(record, indent=1, default=str))
    print(line)
    return 0 if " best=none " not in f"{line} " else 1


def run_one(
    spec: dict[str, Any], dev: torch.device, args: argparse.Namespace, expected_end_s: float
) -> dict[str, Any]:
    """One variant's record: measured, or why not (budget, out of memory, failure)."""
    base = {"name": spec["name"], "experiment": spec["experiment"], "phase": spec["phase"]}
    if expected_end_s > args.budget_s:
        return {**base, "status": "skipped", "reason": f"time budget {args.budget_s:.0f} s"}
    try:
        return measure_variant(spec, dev, args)
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
