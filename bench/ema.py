"""The EMA update's cost (`ctseg.training.ema.WeightAverage.update`, torch._foreach ops) against a
plain per-parameter loop of the same arithmetic, on one experiment's model.

    python bench/ema.py [--experiment config/experiments/resenc_24gb.yaml] [--device cuda]
    python bench/ema.py --model '{"filters": [32, 64], ...}'   # a model section, no config

As built, the update is one `torch._foreach_lerp_` (ema + (1 - decay) * (w - ema)). Against it:
the formula as written in two foreach ops (mul, then add), and the baseline, a Python loop of
the same two ops per parameter tensor (two kernel launches each on a GPU). All run in the same
process, alternated, best of `--repeats` rounds of `--updates` updates each. The weights stay
put, so each average should stay equal to them: its largest deviation is its rounding drift.

    RESULT ema model=<name> tensors=<n> params_m=<x> foreach_ms=<x> mul_add_ms=<x> loop_ms=<x>
        speedup=<loop / foreach> drift=<largest deviation of the built average>
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from ctseg.network.model import build_model  # noqa: E402
from ctseg.training.ema import WeightAverage  # noqa: E402


def timed(update, device: torch.device, updates: int) -> float:
    """Milliseconds per update, over `updates` updates."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(updates):
        update()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / updates * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default=str(REPO / "config/experiments/resenc_24gb.yaml"))
    parser.add_argument("--model", default=None, help="a model section as JSON, instead")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--decay", type=float, default=0.999)
    parser.add_argument("--updates", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.model is not None:
        name, model_cfg = "model", json.loads(args.model)
    else:
        from ctseg.config import load_experiment  # jsonschema: only for an experiment file

        name, model_cfg = Path(args.experiment).stem, load_experiment(args.experiment).model
    model = build_model(model_cfg).to(device)
    params = list(model.parameters())
    tensors, count = len(params), sum(p.numel() for p in params)
    decay = args.decay
    built = WeightAverage(model, decay)  # as ctseg trains: torch._foreach_lerp_
    copies = {key: WeightAverage(model, decay).averaged for key in ("mul_add", "loop")}
    mul_add = list(copies["mul_add"].parameters())

    @torch.no_grad()
    def two_ops() -> None:  # the formula as written, over all parameters: two foreach ops
        torch._foreach_mul_(mul_add, decay)
        torch._foreach_add_(mul_add, params, alpha=1.0 - decay)

    @torch.no_grad()
    def loop() -> None:  # the same, parameter by parameter: the baseline
        for average, live in zip(copies["loop"].parameters(), params, strict=True):
            average.mul_(decay).add_(live, alpha=1.0 - decay)

    variants = {"foreach": lambda: built.update(model, 1), "mul_add": two_ops, "loop": loop}
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.repeats):  # alternated: drift on a shared machine hits all of them
        for key, update in variants.items():
            best[key] = min(best[key], timed(update, device, args.updates))
    # The weights stay put, so the exact average is the weights themselves: each variant's
    # largest deviation from them is its rounding drift over all the updates.
    averages = {"foreach": built.averaged, **copies}
    drift = {}
    for key, averaged in averages.items():
        pairs = zip(averaged.parameters(), params, strict=True)
        drift[key] = max(float((a - p).detach().abs().max()) for a, p in pairs)
    print(
        f"{name} on {device}: {tensors} parameter tensors, {count / 1e6:.3g} M parameters, "
        f"{args.repeats * args.updates} updates each; per update: "
        + ", ".join(f"{k} {best[k]:.3g} ms (drift {drift[k]:.1e})" for k in variants)
    )
    print(
        f"RESULT ema model={name} tensors={tensors} params_m={count / 1e6:.3g} "
        + " ".join(f"{k}_ms={best[k]:.3g}" for k in variants)
        + f" speedup={best['loop'] / best['foreach']:.3g} drift={drift['foreach']:.1e}"
    )


if __name__ == "__main__":
    main()
