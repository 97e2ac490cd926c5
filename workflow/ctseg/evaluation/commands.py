"""`ctseg score`, `evaluate` and `baseline`: the competition score."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path

from ctseg.cli_types import AddParser, dataset_of, dataset_plan_arg
from ctseg.io import strict_json


def cmd_score(args: argparse.Namespace) -> None:
    from ctseg.evaluation.metrics import score_files

    dataset = dataset_of(args)
    scores = score_files(
        Path(args.pred), Path(args.gt), labels=dataset.labels, spacing=dataset.relative_spacing
    )
    print(strict_json(scores, indent=1))


def cmd_evaluate(args: argparse.Namespace) -> None:
    from ctseg.evaluation.metrics import evaluate_pairs

    dataset = dataset_of(args)
    if not dataset.labels.is_binary:
        from ctseg.evaluation.classes import evaluate_multiclass

        summary = evaluate_multiclass(
            [Path(p) for p in args.predictions],
            [Path(p) for p in args.labels],
            Path(args.out),
            dataset.labels,
            dataset.spacing,
            threads=args.workers,
            provenance=dict(args.provenance or []),
        )
        print(strict_json(summary, indent=1))
        return
    summary = evaluate_pairs(
        [Path(p) for p in args.predictions],
        [Path(p) for p in args.labels],
        Path(args.out),
        workers=args.workers,
        topo_method=args.topo_method,
        provenance=dict(args.provenance or []),
        label_spec=dataset.labels,
        spacing=dataset.relative_spacing,
    )
    print(strict_json(summary, indent=1))


def _key_value(text: str) -> tuple[str, str]:
    """KEY=VALUE of `evaluate --provenance`."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. scored_split=test")
    return key, value


def cmd_baseline(args: argparse.Namespace) -> None:
    from ctseg.evaluation.baseline import threshold_baseline

    summary = threshold_baseline(
        [Path(p) for p in args.tune_images],
        [Path(p) for p in args.tune_labels],
        [Path(p) for p in args.images],
        [Path(p) for p in args.labels],
        Path(args.out),
        threads=args.threads,
    )
    print(strict_json(summary, indent=1))


def _score_parser(add_parser: AddParser) -> None:
    p = add_parser("score", help="every part of the competition score for one pair")
    p.add_argument("pred", help="predicted mask, multi-page TIFF")
    p.add_argument("gt", help="ground-truth label TIFF (0/1/2)")
    dataset_plan_arg(p)
    p.set_defaults(func=cmd_score)


def _evaluate_parser(add_parser: AddParser) -> None:
    p = add_parser("evaluate", help="score predictions against labels; scores.csv + summary")
    p.add_argument(
        "--predictions", nargs="+", required=True, help="predicted mask TIFFs (<id>.tif)"
    )
    p.add_argument(
        "--labels",
        nargs="+",
        required=True,
        help="their labels in the same order: label TIFFs (a binary dataset), or label .zarr "
        "stores (a multi-class one, scored per class)",
    )
    p.add_argument("--out", required=True, help="evaluation directory")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="cores: a process per volume up to this many, the rest as threads in each",
    )
    p.add_argument(
        "--topo-method",
        choices=["betti_matching", "betti_counts"],
        default="betti_matching",
        help="exact Betti matching, or the faster upper bound min(p_k, g_k)",
    )
    p.add_argument(
        "--provenance",
        type=_key_value,
        action="append",
        metavar="KEY=VALUE",
        help="recorded verbatim under provenance in summary.json (repeatable)",
    )
    dataset_plan_arg(p)
    p.set_defaults(func=cmd_evaluate)


def _baseline_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "baseline",
        help="a reference score: the image above a threshold tuned on the tuning volumes",
    )
    p.add_argument(
        "--tune-images", nargs="+", required=True, help="image stores (.zarr) to tune on"
    )
    p.add_argument("--tune-labels", nargs="+", required=True, help="their label TIFFs, in order")
    p.add_argument("--images", nargs="+", required=True, help="image stores (.zarr) to score")
    p.add_argument("--labels", nargs="+", required=True, help="their label TIFFs, in order")
    p.add_argument("--out", required=True, help="directory for scores.csv and summary.json")
    p.add_argument("--threads", type=int, default=1, help="cores one volume's score may use")
    p.set_defaults(func=cmd_baseline)


# Each subcommand's name and the builder that adds its parser.
PARSERS: dict[str, Callable[[AddParser], None]] = {
    "score": _score_parser,
    "evaluate": _evaluate_parser,
    "baseline": _baseline_parser,
}


def add_commands(add_parser: AddParser, names: Iterable[str] = PARSERS) -> None:
    """Adds the subcommands `names` (by default all of this stage's) with `add_parser`."""
    for name in names:
        PARSERS[name](add_parser)
