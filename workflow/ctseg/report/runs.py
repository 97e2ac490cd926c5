"""What the report reads of one run: the files under ``results/<run>/``, found by name.

A run is an experiment, a fold (``<exp>.fold<i>``) or an ensemble. Each has its own directory
with, where they exist, ``phases/phase<N>/summary.json``, ``train/{steps,epochs}.csv``,
``evaluation/{scores.csv,summary.json}``, ``postprocess/{tuned.json,candidates.csv}``,
``predictions/<id>.tif``, ``split.csv`` and its jobs' Snakemake benchmark TSVs under
``benchmarks/<rule>[/<job>].tsv``. An ensemble has no ``phases/`` or ``train/``: it trained
nothing of its own.

The phase a training ran at is in no results file: ``ctseg train`` prints it (with the number
of processes, ``world_size``) as its last output, a JSON object, into the train job's log.
`train_log_facts` reads that object back from ``results/logs/train/<run>.log`` (the train
rule's log) or ``results/<run>/logs/train.log``.

`scored_runs` lists the runs of a results root that were scored, so that a dataset's report
keeps the runs of earlier invocations beside those of the current one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctseg.io import CtsegError


@dataclass(frozen=True)
class Run:
    """One run's inputs; a path that is None was not given (legacy single-run options)."""

    name: str
    directory: Path | None
    phase_summaries: tuple[Path, ...] = ()
    train_dir: Path | None = None
    evaluation_dir: Path | None = None
    postprocess_dir: Path | None = None
    benchmarks_dir: Path | None = None
    predictions_dir: Path | None = None
    split_csv: Path | None = None
    train_logs: tuple[Path, ...] = ()

    @property
    def trained(self) -> bool:
        """Whether the run trained a model of its own (an ensemble did not)."""
        if self.directory is None:
            return True
        return (self.directory / "phases").is_dir() or (self.directory / "train").is_dir()

    def prediction(self, record_id: str) -> Path | None:
        return None if self.predictions_dir is None else self.predictions_dir / f"{record_id}.tif"


def _phase_number(path: Path) -> int:
    match = re.fullmatch(r"phase(\d+)", path.parent.name)
    return int(match.group(1)) if match else 1 << 30


def run_from_dir(directory: Path) -> Run:
    """The run whose results are under `directory` (results/<run>)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CtsegError(
            f"{directory}: no such run directory; pass --run results/<run> for a run that has "
            "results (an experiment, a fold <exp>.fold<i> or an ensemble)"
        )
    postprocess = directory / "postprocess"
    summaries = sorted(directory.glob("phases/phase*/summary.json"), key=_phase_number)
    return Run(
        name=directory.name,
        directory=directory,
        phase_summaries=tuple(summaries),
        train_dir=directory / "train",
        evaluation_dir=directory / "evaluation",
        # No postprocess/ means the masks used the fixed settings (infer.postprocess: fixed).
        postprocess_dir=postprocess if postprocess.is_dir() else None,
        benchmarks_dir=directory / "benchmarks",
        predictions_dir=directory / "predictions",
        split_csv=directory / "split.csv",
        train_logs=(
            directory.parent / "logs" / "train" / f"{directory.name}.log",
            directory / "logs" / "train.log",
        ),
    )


# What makes a folder of a results root a run the report shows: the evaluate rule's summary.
# Nothing else writes it, so no other folder there (logs/, benchmarks/, preprocessed/, another
# dataset's results/<dataset>/) is taken for a run, and a run whose jobs have not all finished
# (a training still going, or one that failed) is left out until it is scored.
SCORED_MARK = Path("evaluation") / "summary.json"


def scored_runs(root: Path) -> list[str]:
    """The runs under `root` (`ctseg.layout.results_root`) that have been scored, by name."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / SCORED_MARK).is_file())


def train_log_facts(run: Run) -> tuple[dict[str, Any], Path | None]:
    """The JSON object `ctseg train` printed last into its log, and the log it came from; ({},
    None) when no log exists or it has no such object (a run still going, or one that
    failed)."""
    for path in run.train_logs:
        if not path.exists():
            continue
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            raise CtsegError(f"{path}: cannot read the train log for the report ({exc})") from exc
        # `ctseg train` prints json.dumps(..., indent=1): an object from a line "{" to "}".
        for match in reversed(list(re.finditer(r"^\{\n", text, re.M))):
            try:
                data, _ = json.JSONDecoder().raw_decode(text, match.start())
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict) and "phase" in data:
                return data, path
        return {}, path
    return {}, None
