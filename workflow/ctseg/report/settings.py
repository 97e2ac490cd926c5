"""The report's settings section: what each run was trained with, side by side.

Each trained run's ``train/settings.json`` (`ctseg.run_settings`, written by `ctseg train`)
gives the experiment as training used it (``extends`` resolved, the fold applied, defaults
filled in), the loader phase, which weights last.pt holds (EMA or trained) and a fine-tune's
source-weights digest. The table has a row per dotted key and a column per run; the keys whose
values differ between runs come first, the ones equal in every run after them, so the
difference between two runs (``train.ema``, ``init_from``, ``model.blocks_per_stage``, the
patch) is the first thing a reader sees. A run that trained nothing of its own (an ensemble, a
cross-validation's collection) has no column values; a trained run without the file says so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ctseg.report.markup import Sources, esc, source_line, table
from ctseg.report.runs import Run
from ctseg.run_settings import SETTINGS_JSON, flat_settings, read_run_settings

NOT_TRAINED = "(no training)"
NOT_RECORDED = "not recorded"


def settings_path(run: Run) -> Path | None:
    return None if run.train_dir is None else Path(run.train_dir) / SETTINGS_JSON


def _value(value: Any) -> str:
    """As the config file would hold it (exact: 0.001 stays 0.001), in JSON's spelling."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def settings_section(runs: Sequence[Run], src: Sources) -> str:
    out = ['<h2 id="settings">Settings</h2>']
    columns: dict[str, dict[str, Any] | str] = {}
    names = []
    for run in runs:
        path = settings_path(run)
        if not run.trained:
            columns[run.name] = NOT_TRAINED
        elif path is None or not path.exists():
            columns[run.name] = NOT_RECORDED
            if path is not None:
                out.append(
                    f"<p class='missing'>{esc(run.name)}: no <code>{esc(src.rel(path))}</code> "
                    "(written by <code>ctseg train</code> when a run ends; a run trained before "
                    "it existed has none until it is retrained).</p>"
                )
        else:
            columns[run.name] = flat_settings(read_run_settings(path))
            names.append(src.use(path))
    recorded = [c for c in columns.values() if isinstance(c, dict)]
    if not recorded:
        out.append("<p class='note'>No run recorded its settings.</p>")
        return "\n".join(out)
    keys = sorted({k for c in recorded for k in c})

    def cell(column: dict[str, Any] | str, key: str) -> str:
        if isinstance(column, str):
            return column
        return _value(column[key]) if key in column else "(not set)"

    differ = [k for k in keys if len({cell(c, k) for c in recorded}) > 1]
    same = [k for k in keys if k not in differ]
    header = ["setting", *columns]
    if len(recorded) > 1:
        out.append(
            f"<p>{len(differ)} of {len(keys)} settings differ between the runs that recorded "
            "them; they come first.</p>"
        )
        out.append(table(header, [[k, *(cell(c, k) for c in columns.values())] for k in differ]))
        out.append("<h3>Settings equal in every run</h3>")
    out.append(table(header, [[k, *(cell(c, k) for c in columns.values())] for k in same]))
    out.append(source_line(names))
    return "\n".join(out)
