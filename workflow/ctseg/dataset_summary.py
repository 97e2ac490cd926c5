"""A run's dataset before it trains: its volumes, their shapes, intensity percentiles and label
fractions, and the volumes smaller than its patch; one JSON file for the report and a few lines
for the console (rule dataset_summary, `python -m ctseg.dataset_summary`).

Read from the converted stores' attributes only (`ctseg.preprocess.convert` records shape,
dtype, the intensity percentiles and each label value's count), so it costs no pass over the
data. The label fractions are the dataset's classes' (its plan's labels, `ctseg.plan`), and the
spacing is its plan's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import zarr

from ctseg import layout
from ctseg.io import CtsegError, atomic_path, strict_json
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.plan import ISOTROPIC, read_dataset_plan

SHOWN_SMALL = 3  # the smaller-than-patch volumes a console line names


def store_attributes(path: str | Path) -> dict[str, Any]:
    """A converted store's attributes (metadata only: no chunk is read)."""
    try:
        return dict(zarr.open_array(str(path), mode="r").attrs)
    except (OSError, ValueError, KeyError) as exc:
        raise CtsegError(f"{path}: cannot read the converted store's attributes: {exc}") from exc


def smaller_than_patch(shape: Sequence[int], patch: Sequence[int]) -> bool:
    return any(int(s) < int(p) for s, p in zip(shape, patch, strict=True))


def summarise(
    parts: Mapping[str, str],
    images: Mapping[str, Mapping[str, Any]],
    labels: Mapping[str, Mapping[str, Any]],
    patch: Sequence[int],
    spec: LabelSpec = KAGGLE,
    spacing: Sequence[float] = ISOTROPIC,
) -> dict[str, Any]:
    """The summary of the volumes `parts` names (id -> train/val/test), from their image and
    label stores' attributes (`store_attributes`, counts by stored value), against the training
    `patch`; `spec`: the dataset's labels, `spacing` its voxel spacing."""
    stored = spec.stored()
    values = {name: str(stored.labels[name]) for name in stored.classes}
    ignored = None if stored.ignore is None else str(stored.ignore)
    volumes = []
    for record_id, part in sorted(parts.items()):
        image, label = images[record_id], labels.get(record_id, {})
        counts = {k: int(v) for k, v in (label.get("label_counts") or {}).items()}
        total = sum(counts.values())
        volumes.append(
            {
                "id": record_id,
                "split": part,
                "shape": list(image["shape"]),
                "dtype": image.get("dtype"),
                "p0_5": image.get("p0_5"),
                "p99_5": image.get("p99_5"),
                "class_fractions": {
                    name: counts.get(value, 0) / total if total else None
                    for name, value in values.items()
                },
                "unlabelled_fraction": (
                    counts.get(ignored, 0) / total if total and ignored else None
                ),
                "smaller_than_patch": smaller_than_patch(image["shape"], patch),
            }
        )
    return {
        "patch": list(patch),
        "spacing": list(spacing),
        "classes": list(stored.classes),
        "volumes": volumes,
    }


def _span(values: Sequence[float], form: str) -> str:
    low, high = min(values), max(values)
    return format(low, form) if low == high else f"{low:{form}}–{high:{form}}"


def summary_lines(run: str, summary: Mapping[str, Any]) -> list[str]:
    """The console's lines: counts, shapes, intensities, label fractions, small volumes."""
    volumes = summary["volumes"]
    if not volumes:
        return [f"{run}: dataset: no volume"]
    parts = pd.Series([v["split"] for v in volumes]).value_counts()
    counted = ", ".join(f"{parts[p]} {p}" for p in ("train", "val", "test") if p in parts)
    shapes = " × ".join(_span([v["shape"][a] for v in volumes], "d") for a in range(3))
    lines = [f"{run}: dataset: {len(volumes)} volumes ({counted}), shapes {shapes} (z × y × x)"]
    low = [v["p0_5"] for v in volumes if v["p0_5"] is not None]
    high = [v["p99_5"] for v in volumes if v["p99_5"] is not None]
    shares = []
    for name in summary["classes"]:
        values = [v["class_fractions"][name] for v in volumes if v["class_fractions"][name]]
        shares.append(f"{name} {_span([100 * f for f in values or [0.0]], '.1f')}%")
    unlabelled = [v["unlabelled_fraction"] for v in volumes if v["unlabelled_fraction"] is not None]
    if unlabelled:
        shares.append(f"unlabelled {_span([100 * u for u in unlabelled], '.1f')}%")
    if low and high:
        lines.append(
            f"{run}: dataset: intensity p0.5 {_span(low, 'g')}, p99.5 {_span(high, 'g')}; "
            f"{' and '.join(shares)} of each label's voxels"
        )
    warning = small_volumes_line(run, {v["id"]: v["shape"] for v in volumes}, summary["patch"])
    return lines + ([warning] if warning else [])


def small_volumes_line(
    run: str, shapes: Mapping[str, Sequence[int]], patch: Sequence[int]
) -> str | None:
    """One warning naming the volumes smaller than `patch` along an axis; None when none is."""
    small = sorted(i for i, shape in shapes.items() if smaller_than_patch(shape, patch))
    if not small:
        return None
    named = ", ".join(f"{i} ({'x'.join(map(str, shapes[i]))})" for i in small[:SHOWN_SMALL])
    more = f" and {len(small) - SHOWN_SMALL} more" if len(small) > SHOWN_SMALL else ""
    return (
        f"{run}: warning: {len(small)} volume(s) smaller than the patch "
        f"{'x'.join(map(str, patch))} along an axis: {named}{more}; their patches are padded, "
        "so they train on less than a patch of data: a smaller data.patch_size fits them"
    )


def write_summary(summary: Mapping[str, Any], path: Path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(strict_json(summary, indent=1))


def main(argv: Sequence[str] | None = None) -> None:
    """Rule dataset_summary: summarise a run's split from its dataset's converted stores."""
    parser = argparse.ArgumentParser(prog="ctseg dataset-summary", description=__doc__)
    parser.add_argument("--run", required=True)
    parser.add_argument("--split", required=True, help="the run's split.csv")
    parser.add_argument("--store", required=True, help="the dataset's preprocessed store")
    parser.add_argument("--patch", type=int, nargs=3, required=True)
    parser.add_argument("--out", required=True, help="the summary's JSON file")
    parser.add_argument("--dataset-plan", default=None, help="results/plans/dataset.json")
    args = parser.parse_args(argv)
    try:
        table = pd.read_csv(args.split, dtype={"id": str})
        parts = dict(zip(table["id"], table["split"], strict=True))
        images = {i: store_attributes(layout.image_store(args.store, i)) for i in parts}
        labels = {i: store_attributes(layout.label_store(args.store, i)) for i in parts}
        plan = read_dataset_plan(args.dataset_plan) if args.dataset_plan else None
        summary = summarise(
            parts,
            images,
            labels,
            args.patch,
            plan.labels if plan else KAGGLE,
            plan.spacing if plan else ISOTROPIC,
        )
        write_summary(summary, Path(args.out))
    except CtsegError as exc:
        print(f"ctseg dataset-summary: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    for line in summary_lines(args.run, summary):
        print(f"ctseg: {line}")


if __name__ == "__main__":
    main()
