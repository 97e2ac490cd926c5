"""`ctseg <step>`: one subcommand per pipeline step. The Snakemake rules call these.

Each subcommand parses its arguments, calls one function of the module named for the step and
turns a `CtsegError` into a one-line message and exit status 2, so the rule's log names the
file and the problem instead of ending in a traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ctseg import __version__
from ctseg.io import CtsegError, disk_full, os_error_line, strict_json

# `ArgumentParser.add_subparsers().add_parser`: each subcommand's builder adds itself with it.
AddParser = Callable[..., argparse.ArgumentParser]

if TYPE_CHECKING:
    from ctseg.inference.settings import InferenceSettings
    from ctseg.postprocess.masks import PostprocessSettings
    from ctseg.training.distributed import Ranks


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


CODEC_INTEGERS = ("clevel", "level")


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


def cmd_demo_data(args: argparse.Namespace) -> None:
    from ctseg.preprocess.demo_data import generate_demo

    generate_demo(
        Path(args.out),
        n_train=args.n_train,
        n_test=args.n_test,
        shape=args.shape,
        scroll_ids=args.scroll_ids,
        seed=args.seed,
        preset=args.preset,
    )


def cmd_convert(args: argparse.Namespace) -> None:
    from ctseg.preprocess.convert import convert_volume
    from ctseg.store import open_volume

    expect_shape = like = None
    if args.like is not None:
        if not Path(args.like).is_dir():
            raise CtsegError(f"{args.like}: image store not found (needed to compare shapes)")
        image = open_volume(args.like)
        expect_shape = tuple(image.shape)
        # The image as the user knows it: the TIFF the store was converted from.
        source = image.attrs.get("source")
        like = f"{args.like}, converted from {source}" if source else args.like
    attrs = convert_volume(
        Path(args.source),
        Path(args.dest),
        kind=args.kind,
        chunks=args.chunks,
        codec=args.codec,
        shards=args.shards,
        memory_budget_mb=args.memory_budget_mb,
        expect_shape=expect_shape,
        like_source=like,
    )
    print(strict_json(attrs, indent=1))


def cmd_targets(args: argparse.Namespace) -> None:
    from ctseg.preprocess.targets import compute_targets

    summary = compute_targets(
        Path(args.label),
        Path(args.dest),
        clip_distance=args.clip_distance,
        skeleton_method=args.skeleton_method,
        tube_dilations=args.tube_dilations,
        block_shape=args.block,
        max_samples=args.max_samples,
        seed=args.seed,
        codec=args.codec,
        workers=args.workers,
    )
    print(strict_json(summary, indent=1))


def cmd_split(args: argparse.Namespace) -> None:
    from ctseg.records import read_records, select_records, write_split

    records = read_records(args.dataset)
    labelled = records[(records["split"] == "train") & (records["label"] != "")]
    exp = args.experiment
    table = select_records(labelled[["id", "scroll_id"]], exp["subset"], exp["split"])
    write_split(table, Path(args.out))
    print(table["split"].value_counts().to_string())


def cmd_stage(args: argparse.Namespace) -> None:
    import pandas as pd

    from ctseg.preprocess.stage import expand_scratch, stage_records

    # The records training reads; a test split is never staged (nor trained on).
    table = pd.read_csv(args.split_csv, dtype={"id": str})
    ids = table.loc[table["split"] != "test", "id"].tolist()
    summary = stage_records(
        args.source,
        ids,
        expand_scratch(args.dest),
        fmt=args.format,
        storage_options=args.storage_options,
        workers=args.workers,
    )
    print(strict_json(summary, indent=1, default=str))


def _split_ids(split_csv: str) -> tuple[list[str], list[str]]:
    import pandas as pd

    table = pd.read_csv(split_csv, dtype={"id": str})
    return (
        table.loc[table["split"] == "train", "id"].tolist(),
        table.loc[table["split"] == "val", "id"].tolist(),
    )


def _phase_settings(phases: dict, phase: str) -> tuple[int, dict]:
    from ctseg.config import select_phase

    return select_phase(phases, phase, "--phases")


def _scratch(args: argparse.Namespace, ranks: Ranks) -> Path:
    """The scratch copy to train from; with --stage-from, staged here first (per_job): by rank
    0 under torchrun, while the others wait."""
    from ctseg.preprocess.stage import check_staged, expand_scratch, stage_records

    scratch = expand_scratch(args.scratch)
    if args.stage_from:
        if ranks.main:
            train_ids, val_ids = _split_ids(args.split)
            summary = stage_records(
                args.stage_from,
                train_ids + val_ids,
                scratch,
                fmt=args.experiment["scratch_format"],
            )
            print(strict_json({"staged": summary}, default=str))
        ranks.barrier()
    # A file deleted or cut short since staging would fail deep inside the loader workers.
    check_staged(scratch, [i for ids in _split_ids(args.split) for i in ids])
    return scratch


# `ctseg train` and `ctseg trial` run as one process, or as `gpus` processes under
# `torchrun --standalone --nproc_per_node <gpus> -m ctseg.cli ...` (DDP, see ctseg.training.train):
# each process joins the process group for the whole command, and only rank 0 prints and writes.


def cmd_trial(args: argparse.Namespace) -> None:
    from ctseg.training.distributed import ddp_phase, pick_device, process_group, torchrun_ranks
    from ctseg.trials.trials import run_trial, summary_json

    device = pick_device(args.device)
    phase_id, phase = _phase_settings(args.phases, args.phase)
    phase = ddp_phase(args.experiment, phase, torchrun_ranks().world)
    train_ids, _ = _split_ids(args.split)
    with process_group(device) as ranks:
        scratch = _scratch(args, ranks)
        # Every rank runs the same trial (its runs are collective); rank 0 alone writes.
        summary = run_trial(
            args.experiment,
            phase_id,
            phase,
            scratch=scratch,
            train_ids=train_ids,
            out_dir=Path(args.out),
            previous=Path(args.previous) if args.previous else None,
            device=str(device),
            ranks=ranks,
        )
    if ranks.main:
        print(summary_json(summary))
    elif summary.error:  # rank 0 records the failure; this rank only says so in the log
        print(f"rank {ranks.rank}: trial run failed: {summary.error}", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> None:
    from ctseg.training.distributed import ddp_phase, pick_device, process_group, torchrun_ranks
    from ctseg.training.preempt import RESUMABLE_EXIT, stop_on_signals
    from ctseg.training.train import train
    from ctseg.trials.trials import choose_phase

    device = pick_device(args.device)
    first = torchrun_ranks().main
    phase = args.phase
    if phase == "auto":
        phase = str(choose_phase([Path(p) for p in args.trials]))
        if first:
            print(f"phase auto: chose phase {phase}")
    phase_id, settings = _phase_settings(args.phases, phase)
    settings = ddp_phase(args.experiment, settings, torchrun_ranks().world)
    train_ids, val_ids = _split_ids(args.split)
    with process_group(device) as ranks:
        scratch = _scratch(args, ranks)  # staging still stops at once on SIGTERM
        # From here SIGTERM, SIGUSR1 and SIGURG ask the loop to checkpoint after its current step.
        with stop_on_signals() as stop:
            summary = train(
                args.experiment,
                settings,
                scratch=scratch,
                train_ids=train_ids,
                val_ids=val_ids,
                out_dir=Path(args.out),
                state_dir=Path(args.state_dir),
                final_weights=Path(args.weights),
                init_from=Path(args.init_from) if args.init_from else None,
                device=str(device),
                stop=stop,
            )
    if first:
        print(strict_json({"phase": phase_id, **summary}, indent=1, default=str))
    if summary.get("stopped"):
        raise SystemExit(RESUMABLE_EXIT)  # "stopped with a checkpoint: run me again"


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
    )


def _fixed_given(args: argparse.Namespace) -> dict[str, object]:
    from ctseg.postprocess.masks import SETTING_KEYS

    return {k: getattr(args, k) for k in SETTING_KEYS if getattr(args, k, None) is not None}


def _fixed_postprocess(args: argparse.Namespace) -> PostprocessSettings:
    """The fixed post-processing options given, the others at `PostprocessSettings`' defaults."""
    from ctseg.postprocess.masks import PostprocessSettings

    given = _fixed_given(args)
    try:
        return PostprocessSettings(**given)  # type: ignore[arg-type]
    except CtsegError as exc:
        # Named as the user typed them: the options, not the settings' field names.
        options = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in given.items())
        raise CtsegError(f"{options}: {exc}") from exc


def cmd_infer(args: argparse.Namespace) -> None:
    from ctseg.inference.run import load_model, predict_record
    from ctseg.training.checkpoint import stored_digest

    # Both settings are checked when made, before the (long) inference, which would otherwise
    # run only to have postprocess refuse them.
    postprocess = _fixed_postprocess(args)
    inference = _inference_settings(args)
    model, patch = load_model(Path(args.weights), inference.torch_device())
    row = predict_record(
        model,
        Path(args.image),
        Path(args.probabilities),
        Path(args.mask) if args.mask else None,
        inference.with_window(patch),
        postprocess,
        stored_digest(Path(args.weights)),
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
        if _fixed_given(args):
            raise CtsegError(
                f"--settings {args.settings} and the fixed options {sorted(_fixed_given(args))} "
                "exclude each other: give one"
            )
        postprocess, source = load_tuned(Path(args.settings)), args.settings
    else:
        postprocess, source = run_postprocess(
            run, _fixed_postprocess(args), bool(_fixed_given(args))
        )
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
    )
    figures = write_summary(Path(args.summary or Path(args.output) / SUMMARY_FILE), summary)
    print(
        f"ctseg predict: wrote {len(summary['volumes'])} mask(s) to {args.output} by "
        f"{run.name}, post-processing {postprocess.label()} (figures: {figures})"
    )


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

    settings = load_tuned(Path(args.settings)) if args.settings else _fixed_postprocess(args)
    info = write_mask(Path(args.probabilities), Path(args.mask), settings)
    print(strict_json(info, indent=1))


def cmd_score(args: argparse.Namespace) -> None:
    from ctseg.evaluation.metrics import score_files

    print(strict_json(score_files(Path(args.pred), Path(args.gt)), indent=1))


def cmd_evaluate(args: argparse.Namespace) -> None:
    from ctseg.evaluation.metrics import evaluate_pairs

    summary = evaluate_pairs(
        [Path(p) for p in args.predictions],
        [Path(p) for p in args.labels],
        Path(args.out),
        workers=args.workers,
        topo_method=args.topo_method,
        provenance=dict(args.provenance or []),
    )
    print(strict_json(summary, indent=1))


def _key_value(text: str) -> tuple[str, str]:
    """KEY=VALUE of `evaluate --provenance`."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. scored_split=test")
    return key, value


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
    )


def _fold_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fold",
        type=int,
        default=None,
        help="run fold I of an experiment with split.folds (the run <experiment>.fold<I>)",
    )


def _training_args(p: argparse.ArgumentParser) -> None:
    """What `trial` and `train` share: the settings files, the data and the device."""
    p.add_argument(
        "--experiment", type=_experiment, required=True, help="config/experiments/<name>.yaml"
    )
    _fold_arg(p)
    p.add_argument("--phases", type=_phases, required=True, help="config/phases.yaml")
    p.add_argument("--scratch", required=True, help="staged scratch directory ($VARS)")
    p.add_argument("--stage-from", default=None, help="stage the split's records from here first")
    p.add_argument("--split", required=True, help="split.csv (id, scroll_id, split)")
    p.add_argument("--out", required=True, help="directory for steps.csv etc.")
    p.add_argument(
        "--device",
        default=None,
        help="cuda, cuda:1, cpu; default: cuda if any (under torchrun: cuda:LOCAL_RANK)",
    )


def _demo_data_parser(add_parser: AddParser) -> None:
    p = add_parser("demo-data", help="generate the synthetic dataset in the Kaggle layout")
    p.add_argument("--out", required=True, help="dataset directory, e.g. resources/demo")
    p.add_argument("--n-train", type=int, default=4, help="labelled training volumes")
    p.add_argument("--n-test", type=int, default=2, help="test volumes (labelled, for scoring)")
    p.add_argument("--shape", type=_shape, default=(96, 96, 96), help="Z,Y,X voxels")
    p.add_argument(
        "--scroll-ids", type=int, nargs="+", default=[1, 2], help="scroll ids, dealt in turn"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the generated volumes")
    p.add_argument(
        "--preset",
        choices=("simple", "realistic"),
        default="simple",
        help="simple: easy sheets; realistic: pressed sheets, low drifting contrast, artefacts",
    )
    p.set_defaults(func=cmd_demo_data)


def _convert_parser(add_parser: AddParser) -> None:
    p = add_parser("convert", help="TIFF (multi-page or directory of slices) to Zarr v3")
    p.add_argument("source", help="a 3D .tif/.tiff or a directory of 2D slice TIFFs")
    p.add_argument("dest", help="the .zarr store to write")
    p.add_argument(
        "--kind",
        choices=["image", "label"],
        default="image",
        help="image: intensity statistics; label: values checked to be 0, 1 or 2",
    )
    p.add_argument("--like", default=None, help="image .zarr whose shape the label must match")
    p.add_argument("--chunks", type=_shape, default=(64, 64, 64), help="Z,Y,X chunk shape")
    p.add_argument(
        "--shards", type=_shape, default=None, help="Z,Y,X shard shape (default: no shards)"
    )
    p.add_argument(
        "--codec", type=_codec, default=None, help="NAME[,KEY=VALUE...], e.g. blosc,cname=lz4"
    )
    p.add_argument(
        "--memory-budget-mb", type=float, default=256.0, help="bound on the slabs held, MB"
    )
    p.set_defaults(func=cmd_convert)


def _targets_parser(add_parser: AddParser) -> None:
    p = add_parser("targets", help="precompute training targets from a label store")
    p.add_argument("label", help="label .zarr written by `ctseg convert --kind label`")
    p.add_argument("dest", help="the targets .zarr group to write")
    p.add_argument(
        "--clip-distance", type=float, default=8.0, help="signed distance clipped to [-d, d]"
    )
    p.add_argument(
        "--skeleton-method",
        choices=["distance_ridge", "medial_surface", "medial_surface_fast", "lee3d"],
        default="distance_ridge",
        help="how the skeleton is made (config/README.md, targets.skeleton_method)",
    )
    p.add_argument(
        "--tube-dilations", type=int, default=2, help="dilations of the skeleton: the tube"
    )
    p.add_argument(
        "--block", type=_shape, default=(128, 128, 128), help="Z,Y,X block computed at a time"
    )
    p.add_argument(
        "--max-samples", type=int, default=20000, help="foreground locations kept at most"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the foreground sample")
    p.add_argument("--codec", type=_codec, default=None, help="as for convert")
    p.add_argument("--workers", type=int, default=1, help="processes computing blocks")
    p.set_defaults(func=cmd_targets)


def _split_parser(add_parser: AddParser) -> None:
    p = add_parser("split", help="select the experiment's records and split train/val")
    p.add_argument("dataset", help="dataset directory in the Kaggle layout")
    p.add_argument("out", help="split.csv to write (id, scroll_id, split)")
    p.add_argument(
        "--experiment", type=_experiment, required=True, help="config/experiments/<name>.yaml"
    )
    _fold_arg(p)
    p.set_defaults(func=cmd_split)


def _stage_parser(add_parser: AddParser) -> None:
    p = add_parser("stage", help="copy the experiment's subset to local scratch")
    p.add_argument("source", help="preprocessed store: a local path or an fsspec URL")
    p.add_argument("split_csv", help="split.csv naming the ids to stage")
    p.add_argument("dest", help="scratch directory ($VARS expand)")
    p.add_argument(
        "--format",
        choices=["raw", "zarr"],
        default="raw",
        help="raw: uncompressed .npy files; zarr: a copy of the stores",
    )
    p.add_argument("--storage-options", type=_json, default=None, help="fsspec options, JSON")
    p.add_argument("--workers", type=int, default=4, help="records copied in parallel")
    p.set_defaults(func=cmd_stage)


def _trial_parser(add_parser: AddParser) -> None:
    p = add_parser("trial", help="a short measured run of one loader phase")
    _training_args(p)
    p.add_argument("--phase", required=True, help="the phase of --phases to run")
    p.add_argument("--previous", default=None, help="the previous phase's summary.json")
    p.set_defaults(func=cmd_trial)


def _train_parser(add_parser: AddParser) -> None:
    p = add_parser("train", help="train the experiment under a phase (or auto)")
    _training_args(p)
    p.add_argument("--phase", required=True, help="a phase number or auto")
    p.add_argument("--trials", nargs="*", default=[], help="trial summaries, for auto")
    p.add_argument("--state-dir", required=True, help="resumable checkpoint directory")
    p.add_argument("--weights", required=True, help="final weights (last.pt)")
    p.add_argument(
        "--init-from",
        default=None,
        help="a fine-tune's starting weights: results/<init_from>/last.pt of the experiment's "
        "init_from run (required when it has one)",
    )
    p.set_defaults(func=cmd_train)


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
        help="host memory for the z-slabs of a streamed volume (default: %(default)s)",
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


def _postprocess_options(p: argparse.ArgumentParser, names: Sequence[str] | None = None) -> None:
    """The fixed post-processing options (`postprocess`, `predict`; `infer` takes three). Each
    defaults to None: what is not given keeps `PostprocessSettings`' default (`_fixed_postprocess`).
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


def _infer_parser(add_parser: AddParser) -> None:
    p = add_parser("infer", help="sliding-window inference of one volume")
    p.add_argument("weights", help="last.pt written by ctseg train")
    p.add_argument("image", help="image .zarr written by ctseg convert")
    p.add_argument(
        "--mask", default=None, help="uint8 mask TIFF to write (default: probabilities only)"
    )
    p.add_argument("--probabilities", required=True, help="float16 probability .zarr to write")
    _inference_options(p)
    _postprocess_options(p, ["threshold", "min_component_voxels", "fill_holes"])
    p.set_defaults(func=cmd_infer)


def _predict_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "predict",
        help="a trained run's post-processed masks of a folder of new volumes",
        description="The masks of every volume in --input (<id>.tif/.tiff, or <id>/ of slice "
        "TIFFs) by the run's models, as <output>/<id>.tif (uint8 0/1). Post-processing: "
        "<run>/postprocess/tuned.json when it exists and no fixed option is given, else the "
        "fixed options (their defaults unless given).",
    )
    p.add_argument(
        "--run",
        required=True,
        help="results/<run>: an experiment, a fold <exp>.fold<i>, a cross-validation <exp>.cv "
        "or an ensemble",
    )
    p.add_argument("-i", "--input", required=True, help="folder of TIFF volumes or slice folders")
    p.add_argument("-o", "--output", required=True, help="folder for the masks <id>.tif")
    p.add_argument(
        "--probabilities", default=None, help="also keep the probabilities as <DIR>/<id>.zarr"
    )
    p.add_argument("--only", nargs="+", default=None, metavar="ID", help="only these volumes")
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
    _postprocess_options(p)
    p.set_defaults(func=cmd_predict)


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
    p.add_argument("--labels", nargs="+", required=True, help="label TIFFs, in the same order")
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
    p = add_parser("postprocess", help="probabilities to the uint8 mask of the submission")
    p.add_argument("probabilities", help="float16 probability .zarr written by ctseg infer")
    p.add_argument("mask", help="uint8 mask TIFF to write")
    p.add_argument("--settings", default=None, help="tuned.json; overrides the options below")
    _postprocess_options(p)
    p.set_defaults(func=cmd_postprocess)


def _score_parser(add_parser: AddParser) -> None:
    p = add_parser("score", help="every part of the competition score for one pair")
    p.add_argument("pred", help="predicted mask, multi-page TIFF")
    p.add_argument("gt", help="ground-truth label TIFF (0/1/2)")
    p.set_defaults(func=cmd_score)


def _evaluate_parser(add_parser: AddParser) -> None:
    p = add_parser("evaluate", help="score predictions against labels; scores.csv + summary")
    p.add_argument(
        "--predictions", nargs="+", required=True, help="predicted mask TIFFs (<id>.tif)"
    )
    p.add_argument("--labels", nargs="+", required=True, help="in the same order")
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
    p.set_defaults(func=cmd_evaluate)


def cmd_baseline(args: argparse.Namespace) -> None:
    from ctseg.evaluation.baseline import threshold_baseline
    from ctseg.io import strict_json

    summary = threshold_baseline(
        [Path(p) for p in args.tune_images],
        [Path(p) for p in args.tune_labels],
        [Path(p) for p in args.images],
        [Path(p) for p in args.labels],
        Path(args.out),
        threads=args.threads,
    )
    print(strict_json(summary, indent=1))


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
    p.set_defaults(func=cmd_report)


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
    p.add_argument("--memory-budget-mb", type=float, default=512, help="per z-slab")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctseg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ctseg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, help="the step to run")
    for add in (
        _demo_data_parser,
        _convert_parser,
        _targets_parser,
        _split_parser,
        _stage_parser,
        _trial_parser,
        _train_parser,
        _infer_parser,
        _predict_parser,
        _tune_postprocess_parser,
        _postprocess_parser,
        _score_parser,
        _evaluate_parser,
        _baseline_parser,
        _report_parser,
        _model_summary_parser,
        _ensemble_parser,
        _tune_ensemble_parser,
    ):
        add(sub.add_parser)
    return parser


def _terminated(signum: int, frame: object) -> None:
    # SIGTERM (Snakemake stopping a job, a scheduler's preemption) unwinds like an error, so
    # each step's temporary output is removed on the way out instead of being left behind.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if on_main_thread else None
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        if getattr(args, "fold", None) is not None:
            from ctseg.config import with_fold

            args.experiment = with_fold(args.experiment, args.fold)
        func(args)
    except CtsegError as exc:
        print(f"ctseg {args.command}: error: {exc.line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Each step's temporary output was removed on the way out (`io.atomic_path`).
        print(f"ctseg {args.command}: interrupted; nothing partial was kept", file=sys.stderr)
        return 130
    except Exception as exc:
        # A folder that cannot be written, a full disk, a file where a folder should be: the
        # user's to fix, so one line naming the path rather than a traceback. Anything else
        # is ctseg's own error and keeps its traceback.
        line = os_error_line(disk_full(exc) or exc)  # a full disk, however deep it was raised
        if line is None:
            raise
        print(f"ctseg {args.command}: error: {line}", file=sys.stderr)
        return 2
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
