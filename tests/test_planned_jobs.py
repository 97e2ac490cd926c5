"""The jobs `snakemake -n` plans for every shipped target, against the plans recorded in
tests/data/planned_jobs.json. A change of the package's layout or of the run model must plan the
same jobs; a change that means to plan others rewrites the file on purpose:

    .venv/bin/python tests/test_planned_jobs.py --write
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import copy_workflow, run_snakemake

PLANS = Path(__file__).parent / "data" / "planned_jobs.json"

# (name, target, extra arguments): every target a user is told to type, and the run kinds.
TARGETS = [
    ("all", [], []),
    ("precompute_targets", ["precompute_targets"], []),
    ("stage", ["stage"], []),
    ("trials", ["trials"], []),
    ("train", ["train"], []),
    ("train_phase3", ["train"], ["--config", "phase=3"]),
    ("train_auto", ["train"], ["--config", "phase=auto"]),
    ("predict", ["predict"], []),
    ("evaluate", ["evaluate"], []),
    ("report", ["report"], []),
    ("last_pt", ["results/exp001/last.pt"], []),
    ("full_last_pt", ["results/exp001_full/last.pt"], []),
    ("resenc", ["results/resenc_24gb/last.pt", "results/resenc_80gb/last.pt"], []),
    ("fold", ["results/exp001_cv.fold1/last.pt"], []),
    ("cv", ["results/exp001_cv.cv/evaluation/summary.json"], []),
    ("ensemble", ["results/ens_demo/evaluation/summary.json"], []),
    ("per_job", ["train"], ["--config", "stage=per_job"]),
    ("fixed", ["predict"], ["--config", "infer={'postprocess': 'fixed'}"]),
]

# Lines of a planned job that say what it is; dates, job ids and reasons are not compared.
KEYS = ("rule ", "input:", "output:", "log:", "benchmark:", "wildcards:", "Shell command:")


def jobs(text: str) -> list[str]:
    """Each planned job as its rule, files, wildcards and shell command, sorted."""
    found, current = [], []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("rule ", "localrule ", "checkpoint ", "localcheckpoint ")):
            if current:
                found.append("\n".join(current))
            # A checkpoint is a rule whose jobs its dependants' plans are made after.
            current = ["rule " + line.removeprefix("local").split(" ", 1)[1]]
        elif current and line.startswith(KEYS[1:]):
            current.append(" ".join(line.split()))
    if current:
        found.append("\n".join(current))
    return sorted(found)


def plan(workdir: Path, targets: list[str], extra: list[str]) -> list[str]:
    proc = run_snakemake(workdir, "-n", "-p", *targets, *extra)
    return jobs(proc.stdout + proc.stderr)


def plans(workdir: Path) -> dict[str, list[str]]:
    return {name: plan(workdir, targets, extra) for name, targets, extra in TARGETS}


@pytest.mark.slow
def test_every_shipped_target_plans_the_recorded_jobs(tmp_path: Path) -> None:
    recorded = json.loads(PLANS.read_text())
    workdir = copy_workflow(tmp_path, None)
    for name, targets, extra in TARGETS:
        assert plan(workdir, targets, extra) == recorded[name], name


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    with tempfile.TemporaryDirectory() as tmp:
        PLANS.write_text(json.dumps(plans(copy_workflow(Path(tmp), None)), indent=1) + "\n")
