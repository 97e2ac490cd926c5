"""`ctseg plan-dataset` and `ctseg plan`: the dataset's plan and a run's plan (`ctseg.plan`),
as the workflow writes them into results/plans/ before any step that reads them."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path

from ctseg.cli_types import AddParser, _phases


def cmd_plan_dataset(args: argparse.Namespace) -> None:
    from ctseg.plan import write_dataset_plan
    from ctseg.planning.build import dataset_plan

    plan = dataset_plan(Path(args.dataset), args.first_image)
    write_dataset_plan(Path(args.out), plan)
    spacing = f"spacing {plan.spacing} ({plan.spacing_source})"
    print(f"{args.out}: labels {plan.labels.describe()}; {spacing}")


def cmd_plan(args: argparse.Namespace) -> None:
    from ctseg.config import load_run
    from ctseg.plan import read_dataset_plan, write_plan
    from ctseg.planning.build import image_shapes_of, run_plan

    experiment_file = Path(args.experiments) / f"{args.run.split('.fold')[0]}.yaml"
    plan = run_plan(
        args.run,
        load_run(args.experiments, args.run),
        read_dataset_plan(args.dataset_plan),
        phase=args.phase if args.phase == "auto" else int(args.phase),
        phases=args.phases,
        image_shapes=lambda: image_shapes_of(args.images),
        where=str(experiment_file),
    )
    write_plan(Path(args.out), plan)
    print(
        f"{args.out}: patch {plan.patch.size} (computed {plan.patch.computed}); phase "
        f"{plan.phase.configured}"
    )


def _plan_dataset_parser(add_parser: AddParser) -> None:
    p = add_parser("plan-dataset", help="the dataset's labels and voxel spacing, as a plan")
    p.add_argument("dataset", help="resources/<name>: its dataset.yaml, if any, gives the labels")
    p.add_argument(
        "--first-image",
        default=None,
        help="the TIFF whose tags give the spacing where dataset.yaml does not",
    )
    p.add_argument("--out", required=True, help="results/plans/dataset.json")
    p.set_defaults(func=cmd_plan_dataset)


def _plan_parser(add_parser: AddParser) -> None:
    p = add_parser("plan", help="a run's plan: its experiment, patch and phase, and its dataset")
    p.add_argument("run", help="an experiment's name, or <experiment>.fold<i>")
    p.add_argument("--experiments", default="config/experiments", help="the experiments folder")
    p.add_argument("--dataset-plan", required=True, help="results/plans/dataset.json")
    p.add_argument("--phases", type=_phases, required=True, help="config/phases.yaml")
    p.add_argument("--phase", required=True, help="the configured phase: a number, or auto")
    p.add_argument(
        "--images",
        nargs="*",
        default=[],
        help="the labelled images' TIFFs, whose shapes plan a patch_size: auto",
    )
    p.add_argument("--out", required=True, help="results/plans/<run>.json")
    p.set_defaults(func=cmd_plan)


# Each subcommand's name and the builder that adds its parser.
PARSERS: dict[str, Callable[[AddParser], None]] = {
    "plan-dataset": _plan_dataset_parser,
    "plan": _plan_parser,
}


def add_commands(add_parser: AddParser, names: Iterable[str] = PARSERS) -> None:
    """Adds the subcommands `names` (by default all of this stage's) with `add_parser`."""
    for name in names:
        PARSERS[name](add_parser)
