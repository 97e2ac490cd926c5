"""The report's post-processing section: the settings `ctseg tune-postprocess` chose on the val
split, against the default (threshold 0.5; a class of a label map: its argmax), and every
candidate it scored (tuned.json and candidates.csv, see ctseg.postprocess.tuning); a multi-class
run's, class by class."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from ctseg.formatting import fmt
from ctseg.report.markup import (
    Sources,
    esc,
    missing,
    png,
    read_json,
    read_table,
    records,
    source_line,
    table,
)

CANDIDATE_COLUMNS = (
    "stage",
    "label",
    "score",
    "surface_dice",
    "voi_score",
    "topo_score",
    "score_bound",
    "pruned",
    "chosen",
)


def postprocess_section(tuned_dir: Path | None, src: Sources) -> str:
    out = ['<h2 id="postprocess">Post-processing</h2>']
    if tuned_dir is None:
        note = (
            "Not tuned in this run (<code>infer.postprocess: fixed</code>): the masks use the "
            "threshold, hysteresis, component size, hole filling, plugging, patching and "
            "closing fixed in the config."
        )
        return "\n".join([*out, f"<p class='note'>{note}</p>"])
    tuned_json = Path(tuned_dir) / "tuned.json"
    candidates_csv = Path(tuned_dir) / "candidates.csv"
    names = []
    tuned: Mapping[str, Any] = {}
    candidates = None
    if tuned_json.exists():
        tuned = read_json(tuned_json)
        names.append(src.use(tuned_json))
    else:
        out.append(missing("Tuned settings", [src.rel(tuned_json)]))
    if candidates_csv.exists():
        candidates = read_table(candidates_csv)
        names.append(src.use(candidates_csv))
    else:
        out.append(missing("Candidates", [src.rel(candidates_csv)]))
    classes: Mapping[str, Any] = tuned.get("classes") or {}
    if classes:
        out.append(
            "<p>Each class of the label map is searched on its own, against its own voxels of "
            "the labels, from its default: its argmax voxels (<b>t&gt;0</b> of the class's "
            "probability where it wins). A voxel that two classes' masks claim goes to the "
            f"more probable. Applied: <b>{esc(tuned.get('label', 'n/a'))}</b>.</p>"
        )
    for name, summary in (classes or {"": tuned}).items():
        if name:
            out.append(f"<h3>Class {esc(name)}</h3>")
        shown = {"volumes": tuned.get("volumes"), **summary}
        if summary:
            out.append(_choice_block(shown))
        if candidates is not None:
            rows = candidates[candidates["class"] == name] if name else candidates
            default = ((summary.get("default") or {}).get("settings") or {}).get("threshold")
            out.append(_candidates_block(rows, summary.get("tuned") is False, name, default))
    out.append(source_line(names))
    return "\n".join(out)


def _choice_block(tuned: Mapping[str, Any]) -> str:
    settings = tuned.get("settings") or {}
    if tuned.get("tuned") is False:
        # The defaults kept (ctseg.postprocess.tuning): the search was not run (no or too little
        # labelled foreground in val), or its best did not beat the defaults by enough.
        setting_rows = [
            [key, "none" if value is None else fmt(value)] for key, value in settings.items()
        ]
        best = tuned.get("best_candidate") or {}
        searched = (
            f" The search scored {fmt(tuned.get('candidates'))} candidates; the best, "
            f"<b>{esc(best.get('label', 'n/a'))}</b>, has mean score "
            f"{fmt(best.get('score'), 4)} against the defaults' "
            f"{fmt((tuned.get('default') or {}).get('score'), 4)}."
            if best
            else ""
        )
        return (
            f"<p class='note'><b>Not tuned:</b> {esc(tuned.get('reason', 'n/a'))}. The masks of "
            f"every predicted volume use the default settings "
            f"(<b>{esc(tuned.get('label', 'n/a'))}</b>).{searched}</p>"
            + table(["setting", "used"], setting_rows)
        )
    search = tuned.get("search") or {}
    volumes = tuned.get("volumes") or []
    default = tuned.get("default") or {}
    rows = [
        ["chosen", str(tuned.get("label", "n/a")), fmt(tuned.get("score"), 4)],
        ["default", str(default.get("label", "t>0.5")), fmt(default.get("score"), 4)],
    ]
    setting_rows = [
        [key, "none" if value is None else fmt(value)] for key, value in settings.items()
    ]
    return (
        f"<p>Chosen by the competition score (TopoScore by <b>{esc(tuned.get('topo_method'))}"
        f"</b>) on the probabilities of {len(volumes)} val volume(s) "
        f"({esc(', '.join(map(str, volumes)))}), held out of training; the masks of every "
        f"predicted volume use it. Gain over the default: "
        f"<b>{fmt(tuned.get('gain_over_default'), 3)}</b> on these volumes. Search: "
        f"{esc(search.get('method', 'n/a'))}; {fmt(tuned.get('candidates'))} candidates scored "
        f"(at most {fmt(search.get('max_candidates'))}) in {fmt(tuned.get('seconds'))} s.</p>"
        + table(["", "settings", "mean score"], rows)
        + table(["setting", "chosen"], setting_rows)
    )


def _candidates_block(
    candidates: pd.DataFrame,
    kept_defaults: bool = False,
    class_name: str = "",
    default_threshold: float | None = None,
) -> str:
    columns = [c for c in CANDIDATE_COLUMNS if c in candidates.columns]
    rows = [[fmt(row[c], 4) for c in columns] for row in records(candidates)]
    note = ""
    if "pruned" in candidates and candidates["pruned"].astype(bool).any():
        note += (
            f"<p class='note'>{int(candidates['pruned'].astype(bool).sum())} of "
            f"{len(candidates)} candidates were pruned: their upper bound "
            "(<code>score_bound</code>: TopoScore with each dimension's matched count at its "
            "maximum) was below a mean score already found, so they could not be chosen and "
            "were not scored exactly (no score).</p>"
        )
    if "chosen" in candidates and "label" in candidates:
        chosen = candidates.loc[candidates["chosen"].astype(bool), "label"]
        why = "the defaults, kept: see above" if kept_defaults else "highest mean score"
        if len(chosen):
            note += f"<p class='note'>Chosen: <b>{esc(chosen.iloc[0])}</b> ({why}).</p>"
    # Under its class's heading for a label map, under the section's for a binary model.
    level, of_class = (4, f" of class {esc(class_name)}") if class_name else (3, "")
    return (
        f"<h{level}>Post-processing candidates{of_class}, scored on the tuning volumes</h{level}>"
        + note
        + _threshold_plot(candidates, 0.5 if default_threshold is None else default_threshold)
        + table(columns, rows)
    )


def _threshold_plot(candidates: pd.DataFrame, default_threshold: float) -> str:
    """Mean score against the threshold for the plain thresholds, the other stages as points;
    the default's threshold dashed (0.5; a class of a label map: 0, its argmax)."""
    needed = {"stage", "threshold", "score"}
    if not needed <= set(candidates.columns) or candidates.empty:
        return ""
    plain = candidates[candidates["stage"].isin(["threshold", "refine"])].sort_values("threshold")
    others = candidates[~candidates["stage"].isin(["threshold", "refine"])]
    fig = Figure(figsize=(5.5, 3.0), layout="constrained")
    ax = fig.subplots()
    ax.plot(plain["threshold"], plain["score"], "o-", color="#4c72b0", label="threshold")
    for stage, group in others.groupby("stage", sort=False):
        ax.plot(group["threshold"], group["score"], "s", alpha=0.7, label=str(stage))
    if "chosen" in candidates and candidates["chosen"].astype(bool).any():
        best = candidates[candidates["chosen"].astype(bool)].iloc[0]
        ax.plot(best["threshold"], best["score"], "*", ms=14, color="#c44e52", label="chosen")
    ax.axvline(default_threshold, color="#999", lw=0.8, ls="--", label="default")
    ax.set(xlabel="threshold (hysteresis: low)", ylabel="mean score", xlim=(0, 1))
    ax.legend(fontsize=7)
    return png(fig, "mean competition score of each post-processing candidate")
