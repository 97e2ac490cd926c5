"""The report's dataset section: the volumes a run trained and was scored on, as
``results/<run>/dataset_summary.json`` records them (`ctseg.dataset_summary`, written before
training; a fold's is its experiment's): split, shape, intensity percentiles, label fractions,
and whether a volume is smaller than the training patch along an axis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ctseg.formatting import fmt, num
from ctseg.report.markup import Sources, esc, missing, read_json, source_line, table
from ctseg.runs import base_of

DATASET_SUMMARY = "dataset_summary.json"  # ctseg.dataset_summary's file in the run folder


def _share(fraction: Any) -> str:
    value = num(fraction)
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _shape(shape: Any) -> str:
    return "×".join(str(s) for s in shape) if isinstance(shape, list) else fmt(shape)


def dataset_section(run_dir: Path | None, src: Sources) -> str:
    out = ['<h2 id="dataset">Dataset</h2>']
    if run_dir is None:
        return "\n".join([*out, missing("Dataset summary")])
    run_dir = Path(run_dir)
    path = run_dir.parent / base_of(run_dir.name) / DATASET_SUMMARY
    if not path.exists():
        return "\n".join([*out, missing("Dataset summary", [src.rel(path)])])
    summary = read_json(path)
    volumes = summary.get("volumes") or []
    patch = _shape(summary.get("patch"))
    small = [v for v in volumes if v.get("smaller_than_patch")]
    counts = ", ".join(
        f"{sum(v.get('split') == part for v in volumes)} {part}"
        for part in ("train", "val", "test")
        if any(v.get("split") == part for v in volumes)
    )
    out.append(
        f"<p>{len(volumes)} volumes ({esc(counts or 'no split recorded')}); training patch "
        f"{esc(patch)} (z×y×x); voxel spacing {esc(_shape(summary.get('spacing')))} (z×y×x). "
        + (
            f"<b>{len(small)} volume(s) smaller than the patch</b> along an axis: their patches "
            "are padded, so they train on less than a patch of data.</p>"
            if small
            else "No volume is smaller than the patch.</p>"
        )
    )
    header = ["id", "split", "shape (z×y×x)", "dtype", "intensity p0.5", "intensity p99.5"]
    classes = list(summary.get("classes") or [])
    header += [*classes, "unlabelled", "smaller than patch"]
    rows = [
        [
            str(v.get("id")),
            str(v.get("split")),
            _shape(v.get("shape")),
            str(v.get("dtype")),
            fmt(v.get("p0_5")),
            fmt(v.get("p99_5")),
            *(_share((v.get("class_fractions") or {}).get(name)) for name in classes),
            _share(v.get("unlabelled_fraction")),
            fmt(bool(v.get("smaller_than_patch"))),
        ]
        for v in volumes
    ]
    out.append(table(header, rows))
    out.append(
        "<p class='note'>From the converted stores' attributes: the intensity percentiles "
        "conversion recorded, and each label value's share of the label's voxels.</p>"
    )
    out.append(source_line([src.use(path)]))
    return "\n".join(out)
