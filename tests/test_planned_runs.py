"""ctseg.planned_runs: the run model as the workflow plans with it (common.smk), without
Snakemake: the records and runs built from the config, the default runs' checks, and each trained
run's training plan read from its run folder, with the lines printed about it."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from ctseg import layout
from ctseg.config import load_phases, thaw
from ctseg.io import CtsegError
from ctseg.planned_runs import (
    TrainingPlans,
    check_default_runs,
    dataset_runs,
    default_runs,
    load_records,
    trainings_to_run,
)
from ctseg.runs import Runs, TrainingPlan
from ctseg.summaries import TrialSummary
from ctseg.training.restart import restart_line

REPO = Path(__file__).resolve().parents[1]
PHASES = load_phases(REPO / "config" / "phases.yaml")


def records(n_train: int = 8, n_test: int = 2) -> dict:
    rows = {
        f"t{i}": {"split": "train", "scroll_id": 1 + i % 2, "label": f"l{i}.tif"}
        for i in range(n_train)
    }
    rows.update({f"x{i}": {"split": "test", "scroll_id": 1, "label": ""} for i in range(n_test)})
    return rows


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch) -> Path:
    """A copy of the shipped config as the workflow's working directory: the run model's paths
    (config/experiments, results/<dataset>/...) are relative to it."""
    shutil.copytree(REPO / "config", tmp_path / "config")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def make_runs(rows: dict | None = None, check_terms=lambda weights: None) -> Runs:
    return dataset_runs(records() if rows is None else rows, "mine", PHASES, check_terms)


def test_the_demo_records_are_used_as_generated() -> None:
    demo = {"a": {"split": "train"}}
    assert load_records("demo", Path("resources/demo"), demo) is demo


def test_a_datasets_records_are_read_from_its_csv_files(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    for part in ("train_images", "train_labels"):
        (folder / part).mkdir(parents=True)
        (folder / part / "v1.tif").write_bytes(b"")
    (folder / "train.csv").write_text("id,scroll_id\nv1,1\n")
    found = load_records("mine", folder)
    assert list(found) == ["v1"]
    assert found["v1"]["split"] == "train" and found["v1"]["label"].endswith("v1.tif")
    (folder / "train.csv").write_text("id,scroll_id\nv2,1\n")
    with pytest.raises(CtsegError, match=r"^dataset 'mine': .*train\.csv: id 'v2' is listed"):
        load_records("mine", folder)


def test_the_runs_check_each_experiments_loss_terms(workdir: Path) -> None:
    seen = []
    runs = make_runs(check_terms=lambda weights: seen.append(dict(weights)))
    assert runs.dataset == "mine" and runs.root == "results/mine" and not runs.demo
    assert runs.experiment("exp001")["loss"]["weights"] == seen[-1]

    def refuse_boundary(weights) -> None:
        if weights.get("boundary"):
            raise CtsegError("loss term 'boundary' is not registered")

    (workdir / "config" / "experiments" / "no_boundary.yaml").write_text(
        "extends: exp001\nname: no_boundary\nloss: {weights: {boundary: 0.0}}\n"
    )
    with pytest.raises(CtsegError, match=r"exp001\.yaml: loss term 'boundary'"):
        make_runs(check_terms=refuse_boundary).experiment("exp001")
    assert make_runs(check_terms=refuse_boundary).experiment("no_boundary")


def test_the_default_runs_are_a_list_of_known_runs(workdir: Path) -> None:
    runs = make_runs()
    assert default_runs("exp001", runs) == ["exp001"]
    assert default_runs(["exp001", "ens_demo"], runs) == ["exp001", "ens_demo"]
    with pytest.raises(CtsegError, match="not an experiment"):
        default_runs(["exp001", "nope"], runs)


def test_a_bad_file_no_default_run_reads_is_a_warning_line(workdir: Path, capsys) -> None:
    (workdir / "config" / "experiments" / "typo.yaml").write_text("extends: exp001\nmodel: 3\n")
    check_default_runs(make_runs(), ["exp001"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("ctseg: warning: ") and "typo.yaml" in err[0]
    assert err[0].endswith(
        "(no run of config 'experiment' ['exp001'] reads it: it is left out of the plan until "
        "it is fixed)"
    )


def test_the_default_runs_record_counts_are_checked(workdir: Path) -> None:
    with pytest.raises(CtsegError, match="run 'exp001'.*selects 1 labelled record"):
        check_default_runs(make_runs(records(n_train=1, n_test=0)), ["exp001"])


def test_the_trainings_to_run_are_the_train_model_jobs() -> None:
    def job(rule: str, exp: str) -> SimpleNamespace:
        return SimpleNamespace(rule=SimpleNamespace(name=rule), wildcards={"exp": exp})

    jobs = [
        job("train_model", "b"),
        job("infer", "c"),
        job("train_model", "a"),
        job("train_model", "b"),
    ]
    assert trainings_to_run(jobs) == ["a", "b"]
    assert trainings_to_run([]) == []


# ----------------------------------------------------------------------------- training plans
def plans(phase) -> TrainingPlans:
    runs = make_runs()
    return TrainingPlans(runs, phase, functools.partial(layout.run_dir, root=runs.root))


def train(plans: TrainingPlans, run: str, phase: int, *, after_trials: bool = False) -> Path:
    """The run's folder as a finished training under `phase` leaves it."""
    folder = Path(plans.run_dir(run))
    (folder / "train").mkdir(parents=True)
    (folder / "last.pt").write_bytes(b"")
    record = {
        "experiment": thaw(dict(plans.runs.settings(run))),
        "phase": thaw(dict(PHASES[phase])),
        "phase_id": phase,
        "phase_auto": False,
    }
    (folder / "train" / "settings.json").write_text(json.dumps(record, default=str))
    if after_trials:
        Path(plans.trials_record(run)).write_text("")
    return folder


def write_trials(plans: TrainingPlans, run: str, rates: dict[int, float]) -> None:
    for path in plans.runs.trial_summaries(run):
        phase = int(Path(path).parent.name.removeprefix("phase"))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        TrialSummary(phase=phase, status="ok", samples_per_s=rates[phase]).write(Path(path))


def test_the_run_folders_paths(workdir: Path) -> None:
    p = plans(0)
    assert p.trials_record("exp001") == "results/mine/exp001/train/trials.txt"
    assert p.state_dir("exp001") == "results/mine/exp001/checkpoints"


def test_a_run_not_trained_yet(workdir: Path) -> None:
    assert plans(0).plan("exp001") == TrainingPlan(False, 0, None)
    auto = plans("auto")
    assert auto.plan("exp001") == TrainingPlan(True, "auto", None)
    assert auto.phase("exp001") == "auto"
    assert auto.chosen_phases("exp001") == list(auto.runs.experiment("exp001")["trial"]["phases"])
    assert auto.gpus("exp001") == 1
    assert set(auto.settings("exp001")) == {"scratch_format", "data", "model", "loss", "train"}


def test_a_trained_run_is_planned_from_its_folder_once(workdir: Path) -> None:
    p = plans(0)
    folder = train(p, "exp001", 3)
    plan = p.plan("exp001")
    assert plan.phase == 0 and plan.restart_from == "phase 3" and not plan.trials
    assert plan.notice.startswith(
        "exp001: keeps its last.pt, trained under phase 3 (config phase 0)"
    )
    # Read as planning starts: what happens to the folder later does not change it.
    (folder / "last.pt").unlink()
    assert p.plan("exp001") is plan


def test_the_trials_written_are_read_when_all_are(workdir: Path) -> None:
    p = plans("auto")
    assert p.trials_written("exp001") is None
    phases = p.runs.experiment("exp001")["trial"]["phases"]
    write_trials(p, "exp001", {phase: 1.0 + phase for phase in phases})
    assert [t.phase for t in p.trials_written("exp001")] == list(phases)
    # One that does not read is left out (the train job refuses it, naming it).
    Path(p.runs.trial_summaries("exp001")[0]).write_text("not json")
    assert [t.phase for t in p.trials_written("exp001")] == list(phases[1:])


def test_under_auto_a_run_trained_after_its_trials_keeps_waiting_on_them(workdir: Path) -> None:
    p = plans("auto")
    phases = p.runs.experiment("exp001")["trial"]["phases"]
    chosen = max(phases)
    train(p, "exp001", chosen, after_trials=True)
    write_trials(p, "exp001", {phase: 1.0 + phase for phase in phases})
    assert p.plan("exp001") == TrainingPlan(True, "auto", None)


def test_the_notices_say_what_the_plan_keeps_or_retrains(workdir: Path, capsys) -> None:
    p = plans(0)
    train(p, "exp001", 3)
    p.notices(["exp001"], ["snakemake"], restart_line)
    err = capsys.readouterr().err
    assert err == f"ctseg: {p.plan('exp001').notice}\n"
    # Forced, it retrains from step 0 instead; only the command line's own targets count.
    for argv in (["snakemake", "-R", "train_model"], ["snakemake", "--forceall"]):
        assert p.forced("exp001", argv)
        p.notices(["exp001"], argv, restart_line)
        assert capsys.readouterr().err == (f"ctseg: {restart_line('exp001', 'phase 3', 0)}\n")
    assert p.forced("exp001", ["snakemake", "--forcerun", "results/mine/exp001/best.pt"])
    assert not p.forced("exp001", ["snakemake", "-R", "infer"])
    # A run with nothing to say prints nothing.
    plans(0).notices(["exp001_full"], ["snakemake"], restart_line)
    assert capsys.readouterr().err == ""


def test_the_start_lines_are_given_the_runs_plan(workdir: Path) -> None:
    p = plans(0)
    train(p, "exp001", 3)
    given = {}

    def start(run, **kwargs):
        given.update(kwargs, run=run)
        return ["a line"]

    lines = p.start_lines("exp001", start=start, image_store="store/{id}.zarr")
    assert lines == ["a line"]
    ids = list(p.runs.split_table("exp001")["id"])
    assert given == {
        "run": "exp001",
        "restart_from": "phase 3",
        "phase": 0,
        "settings": p.runs.settings("exp001"),
        "phases": PHASES,
        "trials": [],
        "image_stores": {i: Path(f"store/{i}.zarr") for i in ids},
        "state_dir": Path("results/mine/exp001/checkpoints"),
    }
