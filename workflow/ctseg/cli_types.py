"""The argparse pieces several stages' `ctseg <step>` subcommands share: the type of a
subcommand's `add_parser` and the converters of its option values.

A converter's name is what argparse prints when a value fails to convert
(`invalid _shape value: 'a'`), so each keeps the name the error lines have always shown.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

# `ArgumentParser.add_subparsers().add_parser`: each subcommand's builder adds itself with it.
AddParser = Callable[..., argparse.ArgumentParser]

# The codec parameters that are integers (blosc's `clevel`, zstd's and gzip's `level`).
CODEC_INTEGERS = ("clevel", "level")


def _shape(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.replace("x", ",").split(",") if p]
    if len(parts) == 1:
        parts = parts * 3
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected Z,Y,X positive integers, got {text!r}")
    return tuple(parts)  # type: ignore[return-value]


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({exc})") from exc


def _codec(text: str) -> dict[str, object]:
    """``NAME[,KEY=VALUE...]``, e.g. ``blosc,cname=lz4,clevel=5,shuffle=shuffle``."""
    name, *pairs = [part.strip() for part in text.split(",") if part.strip()] or [""]
    codec: dict[str, object] = {"name": name}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise argparse.ArgumentTypeError(f"codec {text!r}: expected KEY=VALUE, got {pair!r}")
        try:
            codec[key] = int(value) if key in CODEC_INTEGERS else value
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"codec {text!r}: {key} must be an integer") from exc
    return codec


def _experiment(path: str) -> object:
    from ctseg.config import load_experiment

    return load_experiment(path)


def _phases(path: str) -> object:
    from ctseg.config import load_phases

    return load_phases(path)


def _fold_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fold",
        type=int,
        default=None,
        help="run fold I of an experiment with split.folds (the run <experiment>.fold<I>)",
    )


def _plan(path: str) -> object:
    from ctseg.plan import read_plan

    return read_plan(path)


def plan_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plan",
        type=_plan,
        default=None,
        help="results/plans/<run>.json: the run's experiment (fold applied, patch resolved) and "
        "dataset (labels, spacing), instead of --experiment and --fold",
    )


def from_plan(args: argparse.Namespace) -> None:
    """--plan in place of --experiment and --fold: the plan's experiment is the run's own."""
    from ctseg.io import CtsegError

    if args.plan is None:
        if args.experiment is None:
            raise CtsegError("give --experiment (config/experiments/<name>.yaml) or --plan")
        return
    if args.experiment is not None or args.fold is not None:
        raise CtsegError("give --plan or --experiment (with --fold), not both")
    args.experiment = args.plan.experiment


def _dataset_plan(path: str) -> object:
    from ctseg.plan import read_dataset_plan

    return read_dataset_plan(path)


def dataset_plan_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset-plan",
        type=_dataset_plan,
        default=None,
        help="results/plans/dataset.json: the dataset's labels and voxel spacing (default: "
        "the Kaggle labels 0/1/2, isotropic)",
    )


def dataset_of(args: argparse.Namespace) -> Any:
    """The `ctseg.plan.DatasetPlan` a step was given: its run plan's (--plan) or the dataset
    plan (--dataset-plan); without either, the Kaggle layout's own."""
    from ctseg.labels import KAGGLE
    from ctseg.plan import ISOTROPIC, DatasetPlan

    if getattr(args, "plan", None) is not None:
        return args.plan.dataset
    if getattr(args, "dataset_plan", None) is not None:
        return args.dataset_plan
    return DatasetPlan(KAGGLE, ISOTROPIC, "the Kaggle default (no --plan or --dataset-plan)")
