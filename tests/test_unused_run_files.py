"""Only what is used must be valid: a broken experiment or ensemble file that no run of the
invocation reads is one warning line while the workflow is planned, not a stop; one that a run
reads still stops planning with its one line, as does a target that names its run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import TINY_CONFIG, TINY_EXPERIMENT, copy_workflow, run_snakemake

TYPO = "config/experiments/typo.yaml: data.patch_sise: unknown key; did you mean patch_size?"
BAD_ENSEMBLE = "config/ensembles/bad_ens.yaml: weights: negative weight in [-1, 1]"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny workflow beside an experiment with a typo and an ensemble with a bad weight."""
    workdir = copy_workflow(
        tmp_path_factory.mktemp("workflow"), {**TINY_CONFIG, "experiment": "tiny"}
    )
    data = {**TINY_EXPERIMENT["data"], "patch_sise": [8, 8, 8]}
    typo = {**TINY_EXPERIMENT, "name": "typo", "data": data}
    (workdir / "config" / "experiments" / "typo.yaml").write_text(yaml.safe_dump(typo))
    ensemble = {"name": "bad_ens", "members": ["tiny", "exp001"], "weights": [-1, 1]}
    (workdir / "config" / "ensembles" / "bad_ens.yaml").write_text(yaml.safe_dump(ensemble))
    return workdir


def ctseg_lines(workdir: Path, *args: str, status: int) -> list[str]:
    proc = run_snakemake(workdir, "-n", *args, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == status, text
    assert "Traceback" not in text and 'File "' not in text, text
    return [
        line.removeprefix("ctseg: ") for line in text.splitlines() if line.startswith("ctseg: ")
    ]


def test_broken_files_no_run_reads_are_warnings_and_the_plan_goes_on(workdir: Path) -> None:
    lines = ctseg_lines(workdir, status=0)
    left_out = (
        "(no run of config 'experiment' ['tiny'] reads it: it is left out of the plan until it "
        "is fixed)"
    )
    assert lines == [
        f"warning: {TYPO} {left_out}",
        f"warning: {BAD_ENSEMBLE}: weights must be >= 0 {left_out}",
    ]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--config", "experiment=typo"], TYPO),
        # A target of its run: refused when the rules reach it, as one line.
        (["results/typo/last.pt"], TYPO),
        (["--config", "experiment=bad_ens"], f"{BAD_ENSEMBLE}: weights must be >= 0"),
    ],
    ids=["experiment", "target", "ensemble"],
)
def test_a_broken_file_a_run_reads_stops_planning_with_its_line(workdir, args, line) -> None:
    lines = ctseg_lines(workdir, *args, status=1)
    assert lines[-1] == line, lines
