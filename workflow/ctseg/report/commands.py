"""`ctseg report`: one self-contained HTML report of one or more runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path

from ctseg.cli_types import AddParser, dataset_of, dataset_plan_arg
from ctseg.io import CtsegError


def cmd_report(args: argparse.Namespace) -> None:
    from ctseg.report import build_runs_report

    for item in args.overlay or []:
        if len(item) != 3:
            raise CtsegError(f"--overlay {' '.join(item)}: expected ID IMAGE LABEL")
    if not args.run:
        raise CtsegError("report: give --run results/<run> (repeatable)")
    build_runs_report(
        Path(args.out),
        [Path(r) for r in args.run],
        overlays=[(i, Path(image), Path(label)) for i, image, label in args.overlay or []],
        benchmarks_dir=Path(args.benchmarks_dir) if args.benchmarks_dir else None,
        labels=dataset_of(args).labels,
    )


def _report_parser(add_parser: AddParser) -> None:
    p = add_parser("report", help="one self-contained HTML report of one or more runs")
    p.add_argument("--out", required=True, help="report.html to write")
    p.add_argument(
        "--run",
        action="append",
        default=[],
        help="results/<run>: an experiment, fold or ensemble (repeatable; compared side by side)",
    )
    p.add_argument(
        "--overlay",
        nargs="+",
        action="append",
        metavar="ID IMAGE LABEL",
        help="a volume to show: its image and label .zarr, beside each run's "
        "predictions/<ID>.tif (repeatable)",
    )
    p.add_argument("--benchmarks-dir", default=None, help="Snakemake benchmark: TSVs")
    dataset_plan_arg(p)
    p.set_defaults(func=cmd_report)


# Each subcommand's name and the builder that adds its parser.
PARSERS: dict[str, Callable[[AddParser], None]] = {
    "report": _report_parser,
}


def add_commands(add_parser: AddParser, names: Iterable[str] = PARSERS) -> None:
    """Adds the subcommands `names` (by default all of this stage's) with `add_parser`."""
    for name in names:
        PARSERS[name](add_parser)
