"""`ctseg tune-postprocess` and `ctseg postprocess`: the post-processing search, and a mask
written under its settings; the fixed post-processing options `infer` and `predict` share."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctseg.cli_types import AddParser
from ctseg.io import CtsegError, strict_json

if TYPE_CHECKING:
    from ctseg.postprocess.masks import PostprocessSettings


def fixed_given(args: argparse.Namespace) -> dict[str, object]:
    from ctseg.postprocess.masks import SETTING_KEYS

    return {k: getattr(args, k) for k in SETTING_KEYS if getattr(args, k, None) is not None}


def fixed_postprocess(args: argparse.Namespace) -> PostprocessSettings:
    """The fixed post-processing options given, the others at `PostprocessSettings`' defaults."""
    from ctseg.postprocess.masks import PostprocessSettings

    given = fixed_given(args)
    try:
        return PostprocessSettings(**given)  # type: ignore[arg-type]
    except CtsegError as exc:
        # Named as the user typed them: the options, not the settings' field names.
        options = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in given.items())
        raise CtsegError(f"{options}: {exc}") from exc


def postprocess_options(p: argparse.ArgumentParser, names: Sequence[str] | None = None) -> None:
    """The fixed post-processing options (`postprocess`, `predict`; `infer` takes three). Each
    defaults to None: what is not given keeps `PostprocessSettings`' default (`fixed_postprocess`).
    """
    options: dict[str, dict[str, object]] = {
        "threshold": {"type": float, "help": "probability above which a voxel is foreground "
                      "(default: 0.5)"},
        "hysteresis_high": {"type": float, "help": "keep only the components above --threshold "
                            "that reach this probability (default: off)"},
        "min_component_voxels": {"type": int, "help": "remove 26-connected components smaller "
                                 "than this (default: 0, keep all)"},
        "fill_holes": {"action": "store_true", "help": "fill enclosed 3D cavities"},
        "hysteresis_mode": {"choices": ["3d", "z"], "help": "hysteresis components in 3D, or z: "
                            "within each z-slice (default: 3d)"},
        "plug_holes_max_area": {"type": int, "help": "fill 2D holes up to this area in every "
                                "slice (default: 0, off)"},
        "patch_holes_max_area": {"type": int, "help": "fill larger holes lying inside a sheet "
                                 "(default: 0, off)"},
        "closing_radius": {"type": int, "choices": [0, 1, 2], "help": "closing by a (2r+1)^3 "
                           "cube (default: 0, off)"},
    }  # fmt: skip
    for name in names or options:
        p.add_argument(f"--{name.replace('_', '-')}", default=None, **options[name])  # type: ignore[arg-type]


def cmd_tune_postprocess(args: argparse.Namespace) -> None:
    from ctseg.postprocess.tuning import SearchSpace, tune_postprocess, volumes_from_paths

    given = {
        "thresholds": args.thresholds,
        "refine_step": args.refine_step,
        "hysteresis_offsets": args.hysteresis_offsets,
        "min_component_voxels": args.min_component_voxels,
        "hysteresis_modes": args.hysteresis_modes,
        "hysteresis_pairs": args.hysteresis_pairs,
        "plug_holes_max_area": args.plug_holes_max_area,
        "patch_holes_max_area": args.patch_holes_max_area,
        "closing_radii": args.closing_radii,
    }
    space = SearchSpace(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None},
        fill_holes=not args.no_fill_holes,
    )
    volumes = volumes_from_paths(
        [Path(p) for p in args.probabilities], [Path(p) for p in args.labels]
    )
    print(
        f"tune-postprocess: {space.describe()}, x {len(volumes)} volume(s), {args.topo_method}",
        file=sys.stderr,
    )
    summary = tune_postprocess(
        volumes, Path(args.out), space, workers=args.workers, topo_method=args.topo_method
    )
    print(strict_json(summary, indent=1))


def cmd_postprocess(args: argparse.Namespace) -> None:
    from ctseg.postprocess.tuning import load_tuned
    from ctseg.postprocess.write import write_mask

    settings = load_tuned(Path(args.settings)) if args.settings else fixed_postprocess(args)
    info = write_mask(Path(args.probabilities), Path(args.mask), settings)
    print(strict_json(info, indent=1))


def _hysteresis_pair(text: str) -> tuple[float, float]:
    """`LOW,HIGH` of `tune-postprocess --hysteresis-pairs` (SearchSpace checks the values)."""
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW,HIGH such as 0.5,0.9") from None
    return low, high


class _SearchSpaceHelp(argparse.Action):
    """`tune-postprocess --help`: the search options' defaults and the search's bound filled
    in from `ctseg.postprocess.tuning.SearchSpace`, their one definition, when the help is shown
    (importing the search costs seconds that no other command should pay). `const`: each
    option's SearchSpace field and its action, whose help has `{}` where the default goes."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, const=None, help=None) -> None:
        super().__init__(option_strings, dest, nargs=0, const=const, default=dest, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from ctseg.postprocess.tuning import SearchSpace

        space = SearchSpace()
        for name, action in self.const.items():
            action.help = action.help.format(space.option_text(name))
        parser.description = (parser.description or "").format(space.describe())
        parser.print_help()
        parser.exit()


def _tune_postprocess_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "tune-postprocess",
        help="choose threshold, hysteresis, small-component removal, hole filling, plugging "
        "and patching, and closing by the competition score on probabilities with labels; "
        "tuned.json + candidates.csv",
        description="A bounded coordinate search, one setting at a time from the best so far, "
        "each candidate scored exactly on every volume: with the defaults {}; the log, "
        "tuned.json and candidates.csv say the bound of the search run. An option given with "
        "no values turns its stage off.",
        add_help=False,
    )
    # Each search option's default (None) is SearchSpace's; its help shows it (`{}`).
    search: dict[str, argparse.Action] = {}
    p.add_argument(
        "-h", "--help", action=_SearchSpaceHelp, const=search, help="show this help and exit"
    )
    p.add_argument("--probabilities", nargs="+", required=True, help="<id>.zarr from infer")
    p.add_argument(
        "--labels",
        nargs="+",
        required=True,
        help="in the same order: label TIFFs; for a multi-class model's stores (each class "
        "searched on its own), the label stores of ctseg convert --kind label",
    )
    p.add_argument("--out", required=True, help="directory for tuned.json and candidates.csv")
    search["thresholds"] = p.add_argument(
        "--thresholds", type=float, nargs="+", default=None, help="{}"
    )
    search["refine_step"] = p.add_argument(
        "--refine-step", type=float, default=None, help="{}; 0: no refinement"
    )
    search["hysteresis_offsets"] = p.add_argument(
        "--hysteresis-offsets", type=float, nargs="*", default=None, help="{}; none: off"
    )
    search["min_component_voxels"] = p.add_argument(
        "--min-component-voxels",
        type=int,
        nargs="*",
        default=None,
        help="{}: sizes tried beside keeping every component; none: off",
    )
    search["fill_holes"] = p.add_argument(
        "--no-fill-holes", action="store_true", help="do not try hole filling (default: {})"
    )
    search["hysteresis_modes"] = p.add_argument(
        "--hysteresis-modes",
        nargs="+",
        choices=["3d", "z"],
        default=None,
        help="{}: every hysteresis pair in each (z: connected within a z-slice)",
    )
    search["hysteresis_pairs"] = p.add_argument(
        "--hysteresis-pairs",
        type=_hysteresis_pair,
        nargs="*",
        default=None,
        help="LOW,HIGH fixed pairs tried beside the offsets: {}; none: off",
    )
    search["plug_holes_max_area"] = p.add_argument(
        "--plug-holes-max-area",
        type=int,
        nargs="*",
        default=None,
        help="{}: per-slice hole plugging up to each area; none: off",
    )
    search["patch_holes_max_area"] = p.add_argument(
        "--patch-holes-max-area",
        type=int,
        nargs="*",
        default=None,
        help="{}: patching of large holes in sheets up to each area; none: off",
    )
    search["closing_radii"] = p.add_argument(
        "--closing-radii",
        type=int,
        nargs="*",
        choices=[1, 2],
        default=None,
        help="{}: morphological closing by a cube of side 2r+1; none: off",
    )
    p.add_argument(
        "--workers", type=int, default=1, help="cores: a process per volume, the rest as threads"
    )
    p.add_argument(
        "--topo-method",
        choices=["betti_matching", "betti_counts"],
        default="betti_matching",
        help="exact Betti matching, or the faster upper bound min(p_k, g_k)",
    )
    p.set_defaults(func=cmd_tune_postprocess)


def _postprocess_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "postprocess", help="probabilities to the uint8 mask of the submission, or a label map"
    )
    p.add_argument("probabilities", help="float16 probability .zarr written by ctseg infer")
    p.add_argument("mask", help="uint8 mask TIFF to write (a label map for a multi-class store)")
    p.add_argument("--settings", default=None, help="tuned.json; overrides the options below")
    postprocess_options(p)
    p.set_defaults(func=cmd_postprocess)


# Each subcommand's name and the builder that adds its parser.
PARSERS: dict[str, Callable[[AddParser], None]] = {
    "tune-postprocess": _tune_postprocess_parser,
    "postprocess": _postprocess_parser,
}


def add_commands(add_parser: AddParser, names: Iterable[str] = PARSERS) -> None:
    """Adds the subcommands `names` (by default all of this stage's) with `add_parser`."""
    for name in names:
        PARSERS[name](add_parser)


# The keys of config infer that are post-processing settings (`ctseg.postprocess.masks`).
CONFIG_KEYS = (
    "threshold",
    "hysteresis_high",
    "hysteresis_mode",
    "min_component_voxels",
    "fill_holes",
    "plug_holes_max_area",
    "patch_holes_max_area",
    "closing_radius",
)


def configured_rounds(
    infer: Mapping[str, Any], settings: str | None, binary: bool
) -> list[tuple[str, str]]:
    """The rounds of `ctseg predict --post` for a scroll's mask, each with its kind (a
    ``components`` round has a merge job): from tuned.json (`settings`) when infer.postprocess
    is tuned, else from config infer's fixed values; none for a label map (`binary` false),
    which its finish post-processes."""
    from ctseg.postprocess.blockwise import post_rounds
    from ctseg.postprocess.masks import settings_from_mapping
    from ctseg.postprocess.tuning import load_tuned

    if not binary:
        return []
    if infer["postprocess"] == "tuned":
        chosen = load_tuned(Path(str(settings)))
    else:
        chosen = settings_from_mapping({k: infer[k] for k in CONFIG_KEYS}, "config infer")
    return post_rounds(chosen)  # type: ignore[arg-type]
