"""Where a run's score comes from: which volumes were scored, and whether anything was fitted
on them.

Facts, each from a file the page names:

- the scored volumes: the ids of ``evaluation/scores.csv``;
- what the run recorded: the ``provenance`` mapping of ``evaluation/summary.json`` (written by
  ``ctseg evaluate --provenance KEY=VALUE``), shown as it is. ``scored_on`` (or
  ``scored_split``) names the split scored; ``fitted_on_scored`` (yes/no) is the workflow's own
  answer; any other key ending in ``_on`` (``tuned_on``, ``trained_on``, ``weights_tuned_on``)
  names the split something was fitted on;
- post-processing: the ``volumes`` that ``postprocess/tuned.json`` was tuned on (no
  ``postprocess/`` at all: the fixed settings, nothing tuned);
- training: the ``train`` ids of the run's ``split.csv``.

The verdict "fitted on the scored volumes" is *yes* when any of these overlaps the scored
volumes, when ``fitted_on_scored`` says yes or when a ``*_on`` split is the scored split; *no*
when every fact at hand is disjoint or says no
and says which facts those were, and *not recorded* when there is none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctseg.io import CtsegError
from ctseg.report.markup import Sources, esc, missing, read_json, read_table, setting, table
from ctseg.report.runs import Run

SHOWN_IDS = 30
# Keys of the provenance mapping that name the scored split, and the recorded answer.
SCORED_KEYS = ("scored_on", "scored_split")
FITTED_KEY = "fitted_on_scored"


@dataclass
class Provenance:
    scored: list[str] | None = None  # None: no scores.csv
    recorded: dict[str, Any] = field(default_factory=dict)
    tuned: list[str] | None = None  # None: not known; []: fixed post-processing
    tuned_note: str = ""
    train_ids: list[str] | None = None
    files: list[str] = field(default_factory=list)
    scores_path: str | None = None  # where scores.csv was looked for (None: no evaluation dir)

    @property
    def split(self) -> Any:
        return next((self.recorded[k] for k in SCORED_KEYS if k in self.recorded), None)

    @property
    def scored_split(self) -> str:
        value = self.split
        return "not recorded" if value is None else setting(value)

    def fitted(self) -> tuple[str, str]:
        """("yes" / "no" / "not recorded", the facts behind it)."""
        scored = set(self.scored or [])
        hits, checked = [], []
        if self.scored is not None and self.tuned is not None:
            overlap = scored & set(self.tuned)
            if overlap:
                hits.append(f"post-processing tuned on {len(overlap)} of the scored volumes")
            else:
                checked.append(
                    f"{self.tuned_note}: none of them scored" if self.tuned else self.tuned_note
                )
        if self.scored is not None and self.train_ids is not None:
            overlap = scored & set(self.train_ids)
            if overlap:
                hits.append(f"trained on {len(overlap)} of the scored volumes")
            else:
                checked.append(f"training ({len(self.train_ids)} train ids in split.csv): none")
        answer = self.recorded.get(FITTED_KEY)
        if answer is not None:
            said = f"{FITTED_KEY} = {setting(answer)}, as the workflow recorded it"
            (hits if str(answer).lower() in ("yes", "true") else checked).append(said)
        split = self.split
        # A split something was fitted on can only be compared with a recorded scored split.
        for key, value in self.recorded.items() if split is not None else ():
            if not key.endswith("_on") or key in SCORED_KEYS:
                continue
            if value == split:
                hits.append(f"{key} = {setting(value)}, the scored split")
            else:
                checked.append(f"{key} = {setting(value)}, not the scored split")
        if hits:
            return "yes", "; ".join(hits) + ": the score is optimistic"
        if checked:
            return "no", "checked: " + "; ".join(checked)
        return "not recorded", "no tuned.json, split.csv or provenance to check"


def _ids(path: Path, column: str = "id") -> list[str]:
    frame = read_table(path, dtype={column: str})
    if column not in frame.columns:
        raise CtsegError(f"{path}: no '{column}' column (read for the report's provenance)")
    return [str(v) for v in frame[column]]


def read_provenance(run: Run, src: Sources) -> Provenance:
    """The facts above, each file that exists read and named in `src`."""
    out = Provenance()
    if run.evaluation_dir is not None:
        scores = run.evaluation_dir / "scores.csv"
        out.scores_path = src.rel(scores)
        if scores.exists():
            out.scored = _ids(scores)
            out.files.append(src.use(scores))
        summary = run.evaluation_dir / "summary.json"
        if summary.exists():
            recorded = read_json(summary).get("provenance") or {}
            if not isinstance(recorded, dict):
                raise CtsegError(f"{summary}: 'provenance' is not a mapping of KEY to VALUE")
            out.recorded = dict(recorded)
            out.files.append(src.use(summary))
    if run.postprocess_dir is None:
        out.tuned, out.tuned_note = [], "post-processing fixed (no postprocess/ directory)"
    else:
        tuned = run.postprocess_dir / "tuned.json"
        if tuned.exists():
            volumes = read_json(tuned).get("volumes")
            if not isinstance(volumes, list):
                raise CtsegError(f"{tuned}: no 'volumes' list (the volumes tuning was fitted on)")
            out.tuned = [str(v) for v in volumes]
            out.tuned_note = f"tuning ({len(volumes)} volume(s) in tuned.json)"
            out.files.append(src.use(tuned))
    if run.split_csv is not None and run.split_csv.exists():
        frame = read_table(run.split_csv, dtype={"id": str, "split": str})
        if not {"id", "split"} <= set(frame.columns):
            raise CtsegError(f"{run.split_csv}: expected columns id, split (read for the report)")
        out.train_ids = [str(v) for v in frame.loc[frame["split"] == "train", "id"]]
        out.files.append(src.use(run.split_csv))
    return out


def _id_list(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:SHOWN_IDS])
    more = f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else ""
    return esc(shown + more)


def provenance_block(facts: Provenance) -> str:
    """A run's provenance: the scored volumes, the recorded mapping and the verdict."""
    out = ['<h2 id="provenance">Where the score comes from</h2>']
    if facts.scored is None:
        where = [facts.scores_path] if facts.scores_path else []
        out.append(missing("Scored volumes", where))
    else:
        out.append(
            f"<p>Scored on <b>{len(facts.scored)}</b> volume(s) of split "
            f"<b>{esc(facts.scored_split)}</b>: {_id_list(facts.scored)}.</p>"
        )
    verdict, why = facts.fitted()
    out.append(f"<p>Anything fitted on the scored volumes: <b>{esc(verdict)}</b> ({esc(why)}).</p>")
    if facts.recorded:
        rows = [[key, setting(value)] for key, value in facts.recorded.items()]
        out.append(table(["provenance (summary.json)", "value"], rows))
    else:
        out.append(
            "<p class='note'>No <code>provenance</code> recorded in evaluation/summary.json "
            "(<code>ctseg evaluate --provenance KEY=VALUE</code> writes it).</p>"
        )
    if facts.tuned:
        out.append(f"<p class='note'>Tuned on: {_id_list(facts.tuned)}.</p>")
    names = ", ".join(f"<code>{esc(n)}</code>" for n in facts.files)
    if names:
        out.append(f'<p class="source">Read from: {names}</p>')
    return "\n".join(out)
