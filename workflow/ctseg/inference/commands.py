"""`ctseg infer`, `predict`, `ensemble` and `tune-ensemble`: trained runs applied to volumes."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctseg.cli_types import AddParser, _shape
from ctseg.io import CtsegError, strict_json
from ctseg.postprocess.commands import fixed_given, fixed_postprocess, postprocess_options

if TYPE_CHECKING:
    from ctseg.inference.predict import PredictRun
    from ctseg.inference.run import LoadedModel
    from ctseg.inference.settings import InferenceSettings
    from ctseg.postprocess.masks import PostprocessSettings


def _inference_settings(args: argparse.Namespace) -> InferenceSettings:
    from ctseg.inference.settings import InferenceSettings

    return InferenceSettings(
        window=args.window,
        overlap=args.overlap,
        batch_size=args.batch_size,
        tta_flips=args.tta_flips,
        memory_budget_mb=args.memory_budget_mb,
        device_budget_mb=args.device_budget_mb,
        device=args.device,
        background=getattr(args, "background", None),
    )


def cmd_infer(args: argparse.Namespace) -> None:
    from ctseg.inference.run import load_checkpoint, predict_record
    from ctseg.training.checkpoint import stored_digest

    # Both settings are checked when made, before the (long) inference, which would otherwise
    # run only to have postprocess refuse them.
    postprocess = fixed_postprocess(args)
    inference = _inference_settings(args)
    loaded = load_checkpoint(Path(args.weights), inference.torch_device())
    row = predict_record(
        loaded.model,
        Path(args.image),
        Path(args.probabilities),
        Path(args.mask) if args.mask else None,
        inference.with_window(loaded.patch),
        postprocess,
        stored_digest(Path(args.weights)),
        labels=loaded.labels,
    )
    print(strict_json(row, indent=1, default=str))


def cmd_predict(args: argparse.Namespace) -> None:
    from ctseg.inference.predict import (
        DEFAULT_TRAINED_WEIGHTS,
        SUMMARY_FILE,
        load_models,
        predict_folder,
        resolve_run,
        run_postprocess,
        write_summary,
    )
    from ctseg.postprocess.tuning import load_tuned

    inference = _inference_settings(args)
    if args.statistics is not None:  # no model needed: it may run while the run trains
        _statistics_in_place(args, inference)
        return
    run = resolve_run(
        Path(args.run),
        Path(args.experiments_dir),
        Path(args.ensembles_dir),
        args.weights or DEFAULT_TRAINED_WEIGHTS,
    )
    # The weights first: a damaged file is named as such, not taken for retrained weights by
    # the check of the settings tuned for them.
    models = load_models(run, inference.torch_device())
    if args.settings:
        if fixed_given(args):
            raise CtsegError(
                f"--settings {args.settings} and the fixed options {sorted(fixed_given(args))} "
                "exclude each other: give one"
            )
        postprocess, source = load_tuned(Path(args.settings)), args.settings
    else:
        postprocess, source = run_postprocess(run, fixed_postprocess(args), bool(fixed_given(args)))
    if _in_place(args):
        _predict_in_place(args, run, models, inference, postprocess)
        return
    summary = predict_folder(
        run,
        models,
        Path(args.input),
        Path(args.output),
        inference,
        postprocess,
        probabilities_dir=Path(args.probabilities) if args.probabilities else None,
        only=args.only,
        scratch=Path(args.scratch) if args.scratch else None,
        postprocess_from=source,
        summary=Path(args.summary) if args.summary else None,
        overwrite=args.overwrite,
        command=args.argv,
    )
    figures = write_summary(Path(args.summary or Path(args.output) / SUMMARY_FILE), summary)
    print(
        f"ctseg predict: wrote {len(summary['volumes'])} mask(s) to {args.output} by "
        f"{run.name}, {summary['masks']} (figures: {figures})"
    )


def _in_place(args: argparse.Namespace) -> bool:
    """A Zarr array or OME-Zarr group as --input (`ctseg.inference.scroll`); the options that
    only such a predict takes are refused for a folder of TIFFs."""
    from ctseg.inference.scroll import is_volume_store

    if is_volume_store(args.input):
        tiff, output = Path(args.input), Path(args.output)
        if tiff.is_file() and output.suffix.lower() not in (".zarr", ".tif", ".tiff"):
            raise CtsegError(
                f"{output}: {tiff} is one volume, read in place, and its mask one image "
                f"<name>.zarr or <name>.tif; for a folder of masks give its folder "
                f"({tiff.parent}) with --only {tiff.name.split('.')[0]}"
            )
        return True
    only_in_place = [
        name
        for name, value in (
            ("--level", args.level),
            ("--parts", args.parts),
            ("--post", args.post),
            ("--cache-mb", args.cache_mb),
            ("--intensity-range", args.intensity_range),
            ("--storage-options", args.storage_options),
        )
        if value is not None
    ]
    if only_in_place:
        raise CtsegError(
            f"{args.input}: {', '.join(only_in_place)} go with a volume read in place (a Zarr "
            "array or OME-Zarr group), not a folder of TIFFs"
        )
    return False


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    import json

    try:
        return json.loads(args.storage_options) if args.storage_options else None
    except ValueError as exc:
        raise CtsegError(f"--storage-options {args.storage_options!r}: not JSON ({exc})") from exc


def _statistics_in_place(args: argparse.Namespace, inference: InferenceSettings) -> None:
    from ctseg.inference.scroll import is_volume_store, predict_statistics

    if not is_volume_store(args.input) or args.parts is None or args.part is not None:
        raise CtsegError(
            f"--statistics {args.statistics}: a statistics job of a volume read in place goes "
            "with --parts N (its pieces), without --part or --finish"
        )
    if args.finish or args.post is not None:
        other = "--finish" if args.finish else f"--post {args.post}"
        raise CtsegError(f"--statistics {args.statistics} and {other}: give one")
    summary = predict_statistics(
        args.input,
        Path(args.output),
        args.statistics,
        args.parts,
        inference.memory_budget_mb,
        level=args.level,
        storage_options=_storage_options(args),
        overwrite=args.overwrite,
        command=args.argv,
    )
    if args.summary:
        Path(args.summary).write_text(strict_json(summary, indent=1))
    print(
        f"ctseg predict: statistics {args.statistics + 1} of {args.parts} (--statistics "
        f"{args.statistics}) of {args.input} done ({summary['statistics_bytes_read']} bytes read)"
    )


def _predict_in_place(
    args: argparse.Namespace,
    run: PredictRun,
    models: Sequence[LoadedModel],
    inference: InferenceSettings,
    postprocess: PostprocessSettings,
) -> None:
    from ctseg.inference.predict import run_spacing
    from ctseg.inference.scroll import predict_scroll
    from ctseg.training.checkpoint import stored_digest

    options = _storage_options(args)
    summary = predict_scroll(
        run.name,
        models,
        [stored_digest(weights) for weights in run.weight_files],
        args.input,
        Path(args.output),
        inference,
        postprocess,
        weights=run.weights,
        weights_from=run.weights_from,
        dataset_spacing=run_spacing(run),
        level=args.level,
        storage_options=options,
        probabilities=Path(args.probabilities) if args.probabilities else None,
        parts=args.parts,
        part=args.part,
        finish_only=args.finish,
        post=args.post,
        cache_mb=args.cache_mb,
        given_range=tuple(args.intensity_range) if args.intensity_range else None,
        overwrite=args.overwrite,
        command=args.argv,
    )
    if args.summary:
        Path(args.summary).write_text(strict_json(summary, indent=1))
    if args.post is not None:
        post = summary["post"]
        where = "its merge" if args.part is None else f"range {args.part} of {args.parts}"
        print(f"ctseg predict: post-processing round {args.post}, {where}, done "
              f"({post['seconds']:.1f} s)")  # fmt: skip
        return
    if args.part is not None:
        # Counted from 1, as the log's progress line counts it; --part takes it from 0.
        print(f"ctseg predict: part {args.part + 1} of {args.parts} (--part {args.part}) of "
              f"{args.input} done")  # fmt: skip
        return
    print(
        f"ctseg predict: wrote {args.output} ({summary['outputs']['foreground_voxels']} "
        f"foreground voxels) by {run.name} from {args.input}; peak RSS "
        f"{summary['peak_rss_mb']:.0f} MB"
    )


def cmd_ensemble(args: argparse.Namespace) -> None:
    from ctseg.inference.ensemble import ensemble_volume, load_weights

    if args.weights_file:
        weights, where = load_weights(Path(args.weights_file), args.names), args.weights_file
    else:
        weights, where = args.weights, "--weights"
    info = ensemble_volume(
        [Path(p) for p in args.members],
        weights,
        Path(args.out),
        memory_budget_mb=args.memory_budget_mb,
        where=where,
    )
    print(strict_json(info, indent=1))


def cmd_tune_ensemble(args: argparse.Namespace) -> None:
    from ctseg.inference.ensemble import tune_weights

    members = [(m[0], [Path(p) for p in m[1:]]) for m in args.member]
    summary = tune_weights(
        members,
        [Path(p) for p in args.labels],
        Path(args.out),
        step=args.step,
        topo_method=args.topo_method,
        workers=args.workers,
    )
    print(strict_json({k: v for k, v in summary.items() if k != "grid"}, indent=1))


def _inference_options(p: argparse.ArgumentParser) -> None:
    """The sliding window's options (`infer`, `predict`), defaults from `InferenceSettings`."""
    from ctseg.inference.settings import InferenceSettings

    default = InferenceSettings()
    p.add_argument(
        "--window", type=_shape, default=None, help="Z,Y,X window (default: the training patch)"
    )
    p.add_argument(
        "--overlap",
        type=float,
        default=default.overlap,
        help="fraction of the window shared by neighbouring windows, 0 <= overlap < 1 "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=default.batch_size,
        help="windows per forward pass (default: %(default)s)",
    )
    p.add_argument(
        "--tta-flips",
        action="store_true",
        default=default.tta_flips,
        help="average the 8 flipped copies (8x the cost)",
    )
    p.add_argument(
        "--memory-budget-mb",
        type=float,
        default=default.memory_budget_mb,
        help="host memory for the tiles and chunk cache of a volume too large for the device "
        "budget, or of a volume read in place, MB (default: %(default)s)",
    )
    p.add_argument(
        "--device-budget-mb",
        type=float,
        default=default.device_budget_mb,
        help="hold the whole volume on the device when it fits, MB (default: %(default)s; "
        "0: always stream)",
    )
    p.add_argument(
        "--device",
        default=default.device,
        help="cuda, cuda:1, cpu (default: cuda if there is one, else cpu)",
    )


def _infer_parser(add_parser: AddParser) -> None:
    p = add_parser("infer", help="sliding-window inference of one volume")
    p.add_argument("weights", help="last.pt written by ctseg train")
    p.add_argument("image", help="image .zarr written by ctseg convert")
    p.add_argument(
        "--mask", default=None, help="uint8 mask TIFF to write (default: probabilities only)"
    )
    p.add_argument("--probabilities", required=True, help="float16 probability .zarr to write")
    _inference_options(p)
    postprocess_options(p, ["threshold", "min_component_voxels", "fill_holes"])
    p.set_defaults(func=cmd_infer)


def _in_place_options(p: argparse.ArgumentParser) -> None:
    """The options of a volume read in place (`ctseg.inference.scroll`)."""
    whole = p.add_argument_group("a volume read in place (docs/whole-scrolls.md)")
    whole.add_argument("--level", default=None, help="the OME-Zarr level to read (default: 0)")
    whole.add_argument(
        "--parts", type=int, default=None, help="split the volume into N parts (jobs, GPUs)"
    )
    whole.add_argument("--part", type=int, default=None, help="compute part K (0..N-1) only")
    whole.add_argument(
        "--finish", action="store_true", help="after every part: blend the seams, write the mask"
    )
    whole.add_argument(
        "--post",
        default=None,
        metavar="ROUND",
        help="after every part: post-process z-range --part K of the mask in round ROUND, or "
        "without --part merge the round's ranges (a component round); --finish does what is "
        "left (docs/whole-scrolls.md)",
    )
    whole.add_argument(
        "--statistics",
        type=int,
        default=None,
        metavar="K",
        help="count piece K (0..N-1) of the volume's intensity histogram only, for the parts "
        "to merge (no model is loaded)",
    )
    whole.add_argument(
        "--cache-mb",
        type=float,
        default=None,
        help="chunk cache (default: a quarter of --memory-budget-mb)",
    )
    whole.add_argument(
        "--background",
        type=float,
        default=None,
        help="skip windows whose input is all <= this value (outside the scroll); default: none",
    )
    whole.add_argument(
        "--intensity-range",
        type=float,
        nargs=2,
        default=None,
        metavar=("LOW", "HIGH"),
        help="the normalisation range (default: the array's p0_5/p99_5, else one pass over it)",
    )
    whole.add_argument(
        "--storage-options", default=None, help="fsspec storage options as JSON (s3 endpoint...)"
    )


def _predict_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "predict",
        help="a trained run's post-processed masks (or label maps) of new volumes",
        description="The masks of every volume in --input (<id>.tif/.tiff, or <id>/ of slice "
        "TIFFs), or of one volume read in place, by the run's models, as <output>/<id>.tif "
        "(uint8 0/1; a multi-class run's: label maps in the dataset's values). "
        "Post-processing: <run>/postprocess/tuned.json when it exists and no fixed option is "
        "given (a multi-class run's: each class's settings), else the fixed options (their "
        "defaults unless given; a multi-class run takes none: its label maps are the argmax).",
    )
    p.add_argument(
        "--run",
        required=True,
        help="results/<run>: an experiment, a fold <exp>.fold<i>, a cross-validation <exp>.cv "
        "or an ensemble",
    )
    p.add_argument(
        "-i",
        "--input",
        required=True,
        help="folder of TIFF volumes or slice folders; or one volume read in place: a Zarr array "
        "or OME-Zarr group (a path, s3://..., https://...)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="folder for the masks <id>.tif; for a volume read in place, <name>.zarr (an "
        "OME-Zarr image with a pyramid) or <name>.tif",
    )
    _in_place_options(p)
    p.add_argument(
        "--probabilities", default=None, help="also keep the probabilities as <DIR>/<id>.zarr"
    )
    p.add_argument("--only", nargs="+", default=None, metavar="ID", help="only these volumes")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the masks (and probabilities) an earlier ctseg predict wrote there; "
        "nothing ctseg did not write is ever replaced",
    )
    p.add_argument(
        "--weights",
        default=None,
        metavar="{last,best}",
        help="which weights file of each trained run predicts: last.pt (the default) or best.pt "
        "(its best validation)",
    )
    p.add_argument(
        "--settings", default=None, help="a tuned.json to apply instead of the run's own"
    )
    p.add_argument(
        "--experiments-dir",
        default="config/experiments",
        help="where a cross-validation's experiment is (default: %(default)s)",
    )
    p.add_argument(
        "--ensembles-dir",
        default="config/ensembles",
        help="where an ensemble's file is (default: %(default)s)",
    )
    p.add_argument(
        "--scratch", default=None, help="folder for the temporary stores (default: $TMPDIR)"
    )
    p.add_argument(
        "--summary",
        default=None,
        help="JSON file the figures of each mask are added to (default: <output>/predict.json)",
    )
    _inference_options(p)
    postprocess_options(p)
    p.set_defaults(func=cmd_predict)


def _ensemble_parser(add_parser: AddParser) -> None:
    p = add_parser("ensemble", help="weighted mean of several runs' probabilities of one volume")
    p.add_argument("--members", nargs="+", required=True, help="<id>.zarr of each member")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--weights", type=float, nargs="+", help="one per member, >= 0")
    given.add_argument("--weights-file", help="weights.json from ctseg tune-ensemble")
    p.add_argument(
        "--names", nargs="+", default=None, help="member names, checked against --weights-file"
    )
    p.add_argument("--out", required=True, help="<id>.zarr to write")
    p.add_argument("--memory-budget-mb", type=float, default=512, help="per z-slab of the mean")
    p.set_defaults(func=cmd_ensemble)


def _tune_ensemble_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "tune-ensemble",
        help="ensemble weights chosen by the competition score on held-out probabilities",
    )
    p.add_argument(
        "--member",
        nargs="+",
        action="append",
        required=True,
        metavar="NAME_THEN_ZARRS",
        help="a member's name, then its <id>.zarr for every held-out volume (repeat per member; "
        "the same ids in the same order)",
    )
    p.add_argument("--labels", nargs="+", required=True, help="label TIFFs, in the same order")
    p.add_argument("--out", required=True, help="weights.json to write")
    p.add_argument("--step", type=float, default=None, help="grid step; 0.25 up to 4 members")
    p.add_argument("--workers", type=int, default=1, help="volumes scored in parallel")
    p.add_argument(
        "--topo-method",
        choices=["betti_matching", "betti_counts"],
        default="betti_matching",
        help="exact Betti matching, or the faster upper bound min(p_k, g_k)",
    )
    p.set_defaults(func=cmd_tune_ensemble)


# Each subcommand's name and the builder that adds its parser.
PARSERS: dict[str, Callable[[AddParser], None]] = {
    "infer": _infer_parser,
    "predict": _predict_parser,
    "ensemble": _ensemble_parser,
    "tune-ensemble": _tune_ensemble_parser,
}


def add_commands(add_parser: AddParser, names: Iterable[str] = PARSERS) -> None:
    """Adds the subcommands `names` (by default all of this stage's) with `add_parser`."""
    for name in names:
        PARSERS[name](add_parser)
