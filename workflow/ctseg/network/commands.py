"""`ctseg model-summary`: an experiment's model, counted."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

from ctseg.cli_types import AddParser, _experiment, _shape


def cmd_model_summary(args: argparse.Namespace) -> None:
    from ctseg.network.summary import model_summary

    exp = _experiment(args.experiment)
    patch = args.patch or exp["data"]["patch_size"]  # type: ignore[index]
    print(model_summary(exp["model"], patch, batch=args.batch))  # type: ignore[index]


def _model_summary_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "model-summary",
        help="an experiment's model: parameters per level, activation memory, FLOPs",
    )
    p.add_argument("experiment", help="config/experiments/<name>.yaml")
    p.add_argument("--patch", type=_shape, default=None, help="Z,Y,X; default: the experiment's")
    p.add_argument("--batch", type=int, default=1, help="patches per step (the phase's batch)")
    p.set_defaults(func=cmd_model_summary)


# Each subcommand's name and the builder that adds its parser.
PARSERS: dict[str, Callable[[AddParser], None]] = {
    "model-summary": _model_summary_parser,
}


def add_commands(add_parser: AddParser, names: Iterable[str] = PARSERS) -> None:
    """Adds the subcommands `names` (by default all of this stage's) with `add_parser`."""
    for name in names:
        PARSERS[name](add_parser)
