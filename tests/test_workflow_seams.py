"""The seams of a user's day, by real `snakemake` runs on tiny data: a phase override that the
next command keeps, a second dataset beside the demo, a planning error and a failed job as one
line on the console."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import BIN, TINY_CONFIG, run_snakemake

pytestmark = pytest.mark.slow


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def planned_rules(proc: subprocess.CompletedProcess) -> set[str]:
    return {
        line.strip().removeprefix("local").removeprefix("rule ").rstrip(":")
        for line in output(proc).splitlines()
        if line.strip().startswith(("rule ", "localrule "))
    }


def test_a_phase_override_sticks_to_what_it_trained(workflow_dir: Path) -> None:
    run_snakemake(workflow_dir, "report", "--config", "experiment=tiny")
    weights = workflow_dir / "results" / "tiny" / "last.pt"
    trained = weights.stat().st_mtime_ns

    # Phase 1 changes only the loader: nothing downstream reruns, last.pt is left as it was.
    loader_only = run_snakemake(
        workflow_dir, "-n", "report", "--config", "experiment=tiny", "phase=1"
    )
    assert planned_rules(loader_only) == set(), output(loader_only)
    assert "tiny: keeps its last.pt, trained under phase 0 (config phase 1)" in output(loader_only)
    run_snakemake(workflow_dir, "report", "--config", "experiment=tiny", "phase=1")
    assert weights.stat().st_mtime_ns == trained

    # Trained under phase 3 on request, the next plain command reports that model.
    run_snakemake(
        workflow_dir, "train", "--forcerun", "train_model", "--config", "experiment=tiny", "phase=3"
    )
    report = run_snakemake(workflow_dir, "-n", "report", "--config", "experiment=tiny")
    assert "train_model" not in planned_rules(report)
    assert "tiny: keeps its last.pt, trained under phase 3 (config phase 0)" in output(report)

    # A change of the maths never reuses the model, and the plan says why in one line.
    experiment = workflow_dir / "config" / "experiments" / "tiny.yaml"
    settings = yaml.safe_load(experiment.read_text())
    settings["train"]["lr"] = 0.0123
    experiment.write_text(yaml.safe_dump(settings))
    changed = run_snakemake(workflow_dir, "-n", "report", "--config", "experiment=tiny")
    assert "train_model" in planned_rules(changed)
    assert "tiny: retrains: its experiment's train changed since its last.pt" in output(changed)


def make_dataset(workdir: Path, name: str) -> None:
    """A user's dataset in the Kaggle layout, made with `ctseg demo-data` (it writes the same
    csv and TIFF files a user would put there)."""
    demo = TINY_CONFIG["demo"]
    subprocess.run(
        [
            str(BIN / "ctseg"),
            "demo-data",
            "--out",
            str(workdir / "resources" / name),
            "--n-train",
            "2",
            "--n-test",
            "1",
            "--shape",
            ",".join(map(str, demo["shape"])),
            "--scroll-ids",
            "7",
            "8",
            "--seed",
            "11",
        ],
        check=True,
        capture_output=True,
    )


def files_by_folder(root: Path) -> dict[Path, set[Path]]:
    found: dict[Path, set[Path]] = {}
    for path in root.rglob("*"):
        if path.is_file():
            found.setdefault(path.parent, set()).add(path)
    return found


def test_two_datasets_never_share_a_folder(workflow_dir: Path) -> None:
    make_dataset(workflow_dir, "mine")
    results = workflow_dir / "results"
    run_snakemake(workflow_dir, "stage", "--config", "experiment=tiny")
    demo = files_by_folder(results)
    run_snakemake(workflow_dir, "stage", "--config", "experiment=tiny", "dataset=mine")
    both = files_by_folder(results)
    mine = {folder: files - demo.get(folder, set()) for folder, files in both.items()}
    mine = {folder: files for folder, files in mine.items() if files}
    assert (results / "mine" / "tiny" / "split.csv").exists()
    assert any("scratch/mine/tiny" in str(folder) for folder in mine)
    shared = sorted(str(folder) for folder in mine if folder in demo)
    assert shared == [], f"folders with outputs of both datasets: {shared}"
    # The demo's plan never touches the other dataset's runs, and the other way round.
    demo_plan = run_snakemake(workflow_dir, "-n", "-p", "report", "--config", "experiment=tiny")
    assert "results/mine/" not in output(demo_plan)
    mine_plan = run_snakemake(
        workflow_dir, "-n", "-p", "report", "--config", "experiment=tiny", "dataset=mine"
    )
    assert "results/tiny/" not in output(mine_plan)
    assert "--provenance dataset=mine" in output(mine_plan)
    assert "results/mine/report.html" in output(mine_plan)


def test_a_dataset_named_like_a_run_is_refused(workflow_dir: Path) -> None:
    make_dataset(workflow_dir, "tiny")
    proc = run_snakemake(workflow_dir, "-n", "--config", "dataset=tiny", check=False)
    assert proc.returncode != 0
    assert "config 'dataset': 'tiny' is also the name of a run" in output(proc)


def one_line_error(proc: subprocess.CompletedProcess, needle: str) -> str:
    text = output(proc)
    assert proc.returncode != 0
    assert "Traceback" not in text and 'File "' not in text, text
    [line] = [line for line in text.splitlines() if needle in line]
    return line


def test_planning_errors_are_one_line_naming_the_file(workflow_dir: Path) -> None:
    bad = workflow_dir / "config" / "experiments" / "bad.yaml"
    bad.write_text("name: bad\nextends: tiny\nmodel: {filters: 3}\n")
    proc = run_snakemake(workflow_dir, "-n", "results/bad/last.pt", check=False)
    line = one_line_error(proc, "ctseg: config/experiments/bad.yaml")
    assert line.startswith("ctseg: config/experiments/bad.yaml: model.filters")
    # A plan no run of which reads it goes on, with a warning naming it.
    again = run_snakemake(workflow_dir, "-n", "precompute_targets", check=False)
    assert again.returncode == 0, output(again)
    warnings = [line for line in output(again).splitlines() if "bad.yaml" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        "ctseg: warning: config/experiments/bad.yaml: model.filters"
    ), warnings
    bad.unlink()
    phase = run_snakemake(workflow_dir, "-n", "train", "--config", "phase=9", check=False)
    assert one_line_error(phase, "phase").startswith("ctseg: config 'phase': 9 is not in")
    fold = run_snakemake(workflow_dir, "-n", "results/tiny.fold1/last.pt", check=False)
    assert "tiny" in one_line_error(fold, "ctseg: ")


def test_a_failed_job_shows_its_message_on_the_console(workflow_dir: Path) -> None:
    make_dataset(workflow_dir, "broken")
    images = sorted((workflow_dir / "resources" / "broken" / "train_images").glob("*.tif"))
    images[0].write_bytes(b"II*\x00 this is not a TIFF any more")
    proc = run_snakemake(
        workflow_dir, "precompute_targets", "--config", "dataset=broken", check=False
    )
    assert proc.returncode != 0
    lines = [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("ctseg: ") and "ctseg convert: error:" in line
    ]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert f"convert_image/{images[0].stem}.log" in lines[0] and images[0].name in lines[0]
