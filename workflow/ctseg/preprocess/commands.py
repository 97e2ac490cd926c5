"""`ctseg demo-data`, `convert`, `targets`, `split` and `stage`: a dataset, before training."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path

from ctseg.cli_types import (
    AddParser,
    _codec,
    _experiment,
    _fold_arg,
    _json,
    _shape,
    dataset_of,
    dataset_plan_arg,
)
from ctseg.io import CtsegError, strict_json


def cmd_demo_data(args: argparse.Namespace) -> None:
    from ctseg.preprocess.demo_data import generate_demo

    if args.preset == "multiclass":
        from ctseg.preprocess.demo_multiclass import write_multiclass_demo

        write_multiclass_demo(
            Path(args.out),
            n_train=args.n_train,
            n_test=args.n_test,
            shape=args.shape,
            scroll_ids=args.scroll_ids,
            seed=args.seed,
        )
        return
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
        labels=dataset_of(args).labels,
    )
    print(strict_json(attrs, indent=1))


def cmd_targets(args: argparse.Namespace) -> None:
    from ctseg.preprocess.targets import compute_targets

    dataset = dataset_of(args)
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
        labels=dataset.labels.stored(),
        # The signed distance in voxels of the finest axis; isotropic: edt's own (None).
        spacing=None if dataset.isotropic else dataset.relative_spacing,
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
        choices=("simple", "realistic", "multiclass"),
        default="simple",
        help="simple: easy sheets; realistic: pressed sheets, low drifting contrast, artefacts; "
        "multiclass: sheets, fibres and pores (labels 10/20/30, ignore 255, a dataset.yaml)",
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
        help="image: intensity statistics; label: values checked against the dataset's labels "
        "(--dataset-plan; default 0, 1 or 2) and stored as 0 background, 1..K classes, K+1 "
        "ignored",
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
    dataset_plan_arg(p)
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
    dataset_plan_arg(p)
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


# Each subcommand's name and the builder that adds its parser.
PARSERS: dict[str, Callable[[AddParser], None]] = {
    "demo-data": _demo_data_parser,
    "convert": _convert_parser,
    "targets": _targets_parser,
    "split": _split_parser,
    "stage": _stage_parser,
}


def add_commands(add_parser: AddParser, names: Iterable[str] = PARSERS) -> None:
    """Adds the subcommands `names` (by default all of this stage's) with `add_parser`."""
    for name in names:
        PARSERS[name](add_parser)
