"""The report's evaluation section: the mean scores and the per-volume scores.csv."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from ctseg.formatting import fmt, num
from ctseg.report.markup import (
    Sources,
    esc,
    missing,
    read_json,
    read_table,
    records,
    source_line,
    table,
)

# scores.csv's columns in two tables, so that each fits a 900 px window: the score with its
# terms and diagnostics, then the parts of the VOI and TopoScore terms.
SCORE_COLUMNS = ("id", "score", "surface_dice", "voi_score", "topo_score", "topo_method")
SCORE_COLUMNS += ("dice", "cldice")
PART_COLUMNS = ("id", "voi_split", "voi_merge", "voi_total", "topo_f1_0", "topo_f1_1", "topo_f1_2")


def evaluation_section(evaluation_dir: Path | None, src: Sources) -> str:
    out = ['<h2 id="evaluation">Evaluation</h2>']
    if evaluation_dir is None:
        return "\n".join([*out, missing("Evaluation")])
    scores_csv = Path(evaluation_dir) / "scores.csv"
    summary_json = Path(evaluation_dir) / "summary.json"
    names = []
    summary = None
    if summary_json.exists():
        summary = read_json(summary_json)
        names.append(src.use(summary_json))
        out.append(_means_block(summary))
    else:
        out.append(missing("Evaluation means", [src.rel(summary_json)]))
    if scores_csv.exists():
        scores = read_table(scores_csv, dtype={"id": str})
        names.append(src.use(scores_csv))
        out.append("<h3>Score and its terms, per scored volume</h3>" + _scores_table(scores))
    else:
        out.append(missing("Per-volume scores", [src.rel(scores_csv)]))
    out.append(source_line(names))
    return "\n".join(out)


def _topo_note(method: Any) -> str:
    note = f"Topology term computed with <b>{esc(method)}</b>"
    if method == "betti_counts":
        note += (
            " (the faster upper bound, chosen explicitly: matched counts taken as min(p, g) "
            "instead of exact Betti matching, so TopoScore is overstated on noisy predictions)"
        )
    return f"<p>{note}.</p>"


def _means_block(summary: Mapping[str, Any]) -> str:
    rows = [[k, fmt(v, 4)] for k, v in summary.items() if num(v) is not None]
    rows += [[k, str(v)] for k, v in summary.items() if isinstance(v, str) and k != "topo_method"]
    method = summary.get("topo_method", "not stated in summary.json")
    return (
        "<h3>Mean score and terms over the scored volumes</h3>"
        + _topo_note(method)
        + table(["summary.json", "value"], rows)
    )


def _scores_table(scores: pd.DataFrame) -> str:
    shown = ""
    for names in (SCORE_COLUMNS, PART_COLUMNS):
        columns = [c for c in names if c in scores.columns]
        if len(columns) > 1:
            shown += table(columns, [[fmt(row[c], 4) for c in columns] for row in records(scores)])
    extra = [c for c in scores.columns if c not in SCORE_COLUMNS + PART_COLUMNS]
    if extra:
        shown += f"<p class='note'>Also in the file, not shown: {esc(', '.join(extra))}.</p>"
    return shown
