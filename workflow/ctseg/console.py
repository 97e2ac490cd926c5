"""What the workflow prints on the console when it ends: ctseg's own message of each failed job
(a job's console output goes to its log, so Snakemake alone shows only a traceback of the shell
command and the log's path), each training that resumed from its checkpoint, and on success
where the report is and the score each run got, or that the report is out of date.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

# The one line `ctseg <step>` prints for a CtsegError (ctseg.cli.main), and what Python prints
# last for an exception nothing caught.
CTSEG_ERROR = re.compile(r"^ctseg [\w-]+: error: .+")
PYTHON_ERROR = re.compile(r"^\w+(Error|Exception)\b.*")
# The line a training that picked up its checkpoint writes to its log (Run.resume).
RESUMED = re.compile(r"^resumed at step \d+ \(epoch \d+\) from \S+")


def _last_error(log: Path) -> str | None:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if CTSEG_ERROR.match(line) or PYTHON_ERROR.match(line):
            return line.strip()
    return None


def _logs_since(log_dir: Path, since: float) -> list[Path]:
    found = []
    for log in sorted(Path(log_dir).rglob("*.log")):
        try:
            if log.stat().st_mtime >= since:
                found.append(log)
        except OSError:
            continue
    return found


def failed_job_errors(log_dir: Path, since: float) -> list[str]:
    """``<log>: <message>`` for every log under `log_dir` written since `since` (a time.time())
    whose last error line is ctseg's one-line message or an uncaught exception."""
    found = []
    for log in _logs_since(log_dir, since):
        message = _last_error(log)
        if message is not None:
            found.append(f"{log}: {message}")
    return found


def resumed_trainings(log_dir: Path, since: float) -> list[str]:
    """``<log>: resumed at step N (epoch E) from <checkpoint>`` for every log under `log_dir`
    written since `since` in which a training picked up its checkpoint: a resume is said on the
    console, not only in the job's log (`ctseg.training.run_state.Run.resume` writes the line)."""
    found = []
    for log in _logs_since(log_dir, since):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        found += [f"{log}: {line.strip()}" for line in lines if RESUMED.match(line)]
    return found


def out_of_date(report: Path, inputs: Sequence[Path]) -> str | None:
    """Why the report is behind its `inputs` (the files it reads): the first one written after
    it, or not written at all; None when it is up to date with them, as one this run built is."""
    built = Path(report).stat().st_mtime
    for path in inputs:
        try:
            if Path(path).stat().st_mtime > built:
                return f"{path} changed after it"
        except OSError:
            return f"{path} is not written yet"
    return None


def headline(report: Path, runs: Sequence[tuple[str, Path]], inputs: Sequence[Path]) -> list[str]:
    """The report's path, then each run's mean competition score and what it is a mean of,
    read from its evaluation/summary.json (`runs`: (name, run directory)). Only for a report up
    to date with `inputs`, the files it reads: after a run that left it behind (`snakemake train`
    retrained a model), its scores are an older model's, so one line says it is out of date."""
    if not Path(report).exists():
        return []
    behind = out_of_date(report, inputs)
    if behind is not None:
        return [f"report: {report} is out of date: {behind}; `snakemake report` rebuilds it"]
    lines = [f"report: {report}"]
    for name, directory in runs:
        summary = Path(directory) / "evaluation" / "summary.json"
        try:
            data = json.loads(summary.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        score = data.get("mean_score")
        if not isinstance(score, int | float):
            continue
        scored = (data.get("provenance") or {}).get("scored_on", "volumes")
        # A multi-class run's score is its mean Dice over classes (its summary says so).
        meaning = data.get("score_is") or "the competition score"
        lines.append(
            f"{name}: score {score:.4f}, the mean over {data.get('volumes', '?')} volume(s) "
            f"({scored}); {meaning} is 1.0 for a perfect mask"
        )
    return lines
