"""ctseg.runs: the run model as pure functions of the records, the experiment and ensemble files
and the phases, checked without Snakemake."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from ctseg import layout
from ctseg.config import load_phases
from ctseg.io import CtsegError
from ctseg.records import RECORDED_SPLIT, read_recorded_split, write_split
from ctseg.runs import (
    Runs,
    TrainingPlan,
    alternatives,
    auto_phase,
    base_of,
    cv_base,
    fold_of,
    forced_on_command_line,
)
from ctseg.summaries import TrialSummary

REPO = Path(__file__).resolve().parents[1]


def records(n_train: int = 8, n_test: int = 2, labelled_test: bool = False) -> dict:
    rows = {}
    for i in range(n_train):
        rows[f"t{i}"] = {"split": "train", "scroll_id": 1 + i % 2, "label": f"l{i}.tif"}
    for i in range(n_test):
        rows[f"x{i}"] = {"split": "test", "scroll_id": 1, "label": "y.tif" if labelled_test else ""}
    return rows


@pytest.fixture
def config_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """The shipped experiments and ensembles, copied so a test can add files."""
    experiments = tmp_path / "experiments"
    ensembles = tmp_path / "ensembles"
    shutil.copytree(REPO / "config" / "experiments", experiments)
    shutil.copytree(REPO / "config" / "ensembles", ensembles)
    return experiments, ensembles


def make_runs(config_dirs, rows=None, demo=False) -> Runs:
    experiments, ensembles = config_dirs
    return Runs(
        rows if rows is not None else records(),
        dataset="mine",
        experiments_dir=experiments,
        ensembles_dir=ensembles,
        phases=load_phases(REPO / "config" / "phases.yaml"),
        demo=demo,
    )


def test_run_names_split_into_experiment_fold_and_cross_validation() -> None:
    assert base_of("exp001_cv.fold1") == "exp001_cv" and fold_of("exp001_cv.fold1") == 1
    assert base_of("exp001") == "exp001" and fold_of("exp001") is None
    assert cv_base("exp001_cv.cv") == "exp001_cv" and cv_base("exp001") is None
    assert alternatives([]) == "(?!)" and alternatives(["a.b", "c"]) == r"a\.b|c"


def test_each_kind_of_run_is_recognised(config_dirs) -> None:
    runs = make_runs(config_dirs)
    assert runs.kind("exp001") == "trained"
    assert runs.kind("exp001_cv.fold0") == "trained"
    assert runs.kind("exp001_cv.cv") == "cv"
    assert runs.kind("ens_demo") == "ensemble"
    with pytest.raises(CtsegError, match="exp001.yaml: fold 0 is out of range|no split.folds"):
        runs.kind("exp001.cv")
    with pytest.raises(CtsegError, match="not an experiment"):
        runs.kind("nope")
    with pytest.raises(CtsegError, match="exp001_cv.yaml: fold 2 is out of range"):
        runs.kind("exp001_cv.fold2")


def test_members_and_trained_runs(config_dirs) -> None:
    runs = make_runs(config_dirs)
    assert runs.members("exp001_cv.cv") == ["exp001_cv.fold0", "exp001_cv.fold1"]
    assert runs.members("ens_demo") == ["exp001", "exp001_cv.fold0", "exp001_cv.fold1"]
    assert runs.members("exp001") == []
    assert runs.trained_runs("ens_demo") == ["exp001", "exp001_cv.fold0", "exp001_cv.fold1"]


def test_folds_hold_out_every_non_test_record_once(config_dirs) -> None:
    runs = make_runs(config_dirs)
    oof = runs.out_of_fold("exp001_cv")
    assert sorted(oof) == sorted(runs.ids(split="train", labelled=True))
    assert set(oof.values()) == {0, 1}
    for fold in (0, 1):
        val = runs.split_ids(f"exp001_cv.fold{fold}", "val")
        assert sorted(val) == sorted(r for r, f in oof.items() if f == fold)
    # A cross-validation tunes on every out-of-fold volume, each from the fold that held it out.
    assert runs.tune_ids("exp001_cv.cv") == sorted(oof)
    record = sorted(oof)[0]
    assert runs.tune_probability("exp001_cv.cv", record) == (
        f"results/mine/exp001_cv.fold{oof[record]}/probabilities/{record}.zarr"
    )
    [(path, weight)] = runs.ensemble_inputs("exp001_cv.cv", record)
    assert path == runs.tune_probability("exp001_cv.cv", record) and weight == 1.0


def test_held_out_ids_never_include_a_test_split(config_dirs) -> None:
    experiments, _ = config_dirs
    exp = yaml.safe_load((experiments / "exp001.yaml").read_text())
    exp["name"] = "held"
    exp["split"]["test_fraction"] = 0.25
    (experiments / "held.yaml").write_text(yaml.safe_dump(exp))
    runs = make_runs(config_dirs)
    test = runs.test_split_ids("held")
    assert len(test) == 2
    assert not set(test) & set(runs.tune_ids("held"))
    assert runs.eval_ids("held") == test
    assert runs.provenance("held", "tuned")["scored_on"] == "test_split"
    assert runs.provenance("held", "tuned")["fitted_on_scored"] == "no"
    assert set(runs.infer_ids("held")) == set(test) | {"x0", "x1"}


def test_without_a_test_split_the_score_says_it_is_fitted_on_its_volumes(config_dirs) -> None:
    runs = make_runs(config_dirs)
    assert runs.eval_ids("exp001") == runs.tune_ids("exp001") == runs.split_ids("exp001", "val")
    assert runs.provenance("exp001", "tuned") == {
        "run": "exp001",
        "dataset": "mine",
        "kind": "trained",
        "scored_on": "val",
        "postprocess": "tuned",
        "fitted_on_scored": "yes",
    }
    assert runs.provenance("exp001", "fixed")["fitted_on_scored"] == "no"
    assert runs.provenance("exp001_cv.cv", "tuned")["scored_on"] == "oof"


def test_the_demo_is_scored_on_its_labelled_test_volumes(config_dirs) -> None:
    runs = make_runs(config_dirs, records(labelled_test=True), demo=True)
    assert runs.eval_ids("exp001") == ["x0", "x1"]
    assert runs.provenance("exp001", "tuned")["scored_on"] == "demo_test_volumes"


def test_an_ensemble_tunes_on_what_its_members_hold_out_in_common(config_dirs) -> None:
    runs = make_runs(config_dirs)
    common = set(runs.split_ids("exp001", "val")) & set(runs.out_of_fold("exp001_cv"))
    assert runs.tune_ids("ens_demo") == sorted(common)
    weights = [w for _, w in runs.ensemble_inputs("ens_demo", "x0")]
    assert weights == [2, 1, 1]


def test_record_counts_are_checked_before_anything_runs(config_dirs) -> None:
    runs = make_runs(config_dirs, records(n_train=1, n_test=0))
    with pytest.raises(CtsegError, match="run 'exp001'.*selects 1 labelled record"):
        runs.check_record_counts("exp001")
    demo = make_runs(config_dirs, records(n_test=0), demo=True)
    with pytest.raises(CtsegError, match="demo.n_test is 0"):
        demo.check_record_counts("exp001")
    make_runs(config_dirs).check_record_counts("exp001")


def test_phases_gpus_and_settings_of_a_train_job(config_dirs) -> None:
    runs = make_runs(config_dirs)
    assert runs.chosen_phases("exp001", 3) == [3]
    assert runs.chosen_phases("exp001", "auto") == list(
        runs.experiment("exp001")["trial"]["phases"]
    )
    with pytest.raises(CtsegError, match="config 'phase': 99 is not in config/phases.yaml"):
        runs.chosen_phases("exp001", 99)
    assert runs.train_gpus("exp001", 0) == 1
    # The train job's settings are the experiment's: a phase changes how it trains.
    assert runs.train_settings("exp001", "auto") == runs.train_settings("exp001", 3)
    assert set(runs.train_settings("exp001", 0)) == {
        "scratch_format",
        "data",
        "model",
        "loss",
        "train",
    }
    phases = runs.experiment("exp001")["trial"]["phases"]
    assert runs.previous_trial("exp001", phases[0]) == []
    assert runs.previous_trial("exp001", phases[1]) == [
        f"results/mine/exp001/phases/phase{phases[0]}/summary.json"
    ]


def test_a_fine_tune_needs_a_trained_source(config_dirs) -> None:
    experiments, _ = config_dirs
    (experiments / "ft.yaml").write_text(
        yaml.safe_dump({"name": "ft", "extends": "exp001", "init_from": "exp001"})
    )
    (experiments / "ftbad.yaml").write_text(
        yaml.safe_dump({"name": "ftbad", "extends": "exp001", "init_from": "ens_demo"})
    )
    runs = make_runs(config_dirs)
    assert runs.init_weights("ft") == ["results/mine/exp001/last.pt"]
    assert runs.init_weights("exp001") == []
    with pytest.raises(CtsegError, match="ftbad.yaml: init_from: 'ens_demo' is not a trained run"):
        runs.init_weights("ftbad")


def test_names_are_checked_when_the_model_is_built(config_dirs) -> None:
    experiments, ensembles = config_dirs
    shutil.copy(experiments / "exp001.yaml", ensembles / "exp001.yaml")
    with pytest.raises(CtsegError, match=r"ensemble\(s\) \['exp001'\] have the name"):
        make_runs(config_dirs)
    (ensembles / "exp001.yaml").unlink()
    (experiments / "results.yaml").write_text("name: results\n")
    make_runs(config_dirs)  # not reserved
    (experiments / "logs.yaml").write_text("name: logs\n")
    with pytest.raises(CtsegError, match="logs.yaml: a run's name"):
        make_runs(config_dirs)


def test_constraints_match_exactly_the_runs_of_each_kind(config_dirs) -> None:
    import re

    patterns = make_runs(config_dirs).constraints()
    assert re.fullmatch(patterns["trained"], "exp001_cv.fold3")
    assert not re.fullmatch(patterns["trained"], "exp001_cv.cv")
    assert re.fullmatch(patterns["combined"], "exp001_cv.cv")
    assert re.fullmatch(patterns["combined"], "ens_demo")
    assert not re.fullmatch(patterns["any"], "unknown")


def test_a_dataset_other_than_the_demo_has_its_own_results_folder(config_dirs) -> None:
    runs = make_runs(config_dirs)
    assert runs.root == "results/mine"
    assert runs.tune_probability("exp001", "t1") == "results/mine/exp001/probabilities/t1.zarr"
    assert runs.trial_summaries("exp001")[0].startswith("results/mine/exp001/phases/")
    demo = make_runs(config_dirs, records(labelled_test=True), demo=True)
    assert demo.root == "results/mine"  # the root follows the name, not the flag
    experiments, ensembles = config_dirs
    for taken in ("exp001", "ens_demo", "logs"):
        with pytest.raises(CtsegError, match=f"config 'dataset': '{taken}' is also the name"):
            Runs(
                records(),
                dataset=taken,
                experiments_dir=experiments,
                ensembles_dir=ensembles,
                phases=load_phases(REPO / "config" / "phases.yaml"),
                demo=False,
            )


def test_a_run_of_the_demo_may_not_take_another_datasets_folder(config_dirs, tmp_path) -> None:
    """The demo's runs are in results/<run>/, another dataset's in results/<dataset>/: an
    experiment named like a dataset in resources/ would write into that dataset's folder."""
    experiments, ensembles = config_dirs
    (tmp_path / "resources" / "exp001").mkdir(parents=True)
    (tmp_path / "resources" / "demo").mkdir()
    others = layout.other_datasets(tmp_path / "resources", "demo")
    assert others == ["exp001"]
    with pytest.raises(CtsegError, match=r"run 'exp001' \(exp001.yaml\) has the name of the "):
        Runs(
            records(labelled_test=True),
            dataset="demo",
            experiments_dir=experiments,
            ensembles_dir=ensembles,
            phases=load_phases(REPO / "config" / "phases.yaml"),
            demo=True,
            other_datasets=others,
        )
    # Another dataset's own runs are under results/<dataset>/: no clash with a third one.
    make_runs(config_dirs)  # dataset "mine", given no other datasets


def trained_record(runs: Runs, run: str, phase: int) -> dict:
    """What train/settings.json holds of a run trained with its current settings."""
    import json

    from ctseg.config import thaw

    return json.loads(
        json.dumps(
            {
                "experiment": thaw(dict(runs.settings(run))),
                "phase": thaw(dict(runs.phases[phase])),
                "phase_id": phase,
                "phase_auto": False,
            },
            default=str,
        )
    )


def plan_of(runs: Runs, phase, record, *, after_trials=False, trials=None, last_pt=True):
    return runs.training_plan(
        "exp001", phase, last_pt=last_pt, trained=record, after_trials=after_trials, trials=trials
    )


def trial(phase: int, samples_per_s: float | None, status: str = "ok") -> TrialSummary:
    return TrialSummary(phase=phase, status=status, samples_per_s=samples_per_s)


KEEPS = "a phase changes how a run trains, not its result"


def test_a_run_not_trained_yet_waits_on_the_trials_under_auto_only(config_dirs) -> None:
    runs = make_runs(config_dirs)
    assert plan_of(runs, "auto", None, last_pt=False) == TrainingPlan(True, "auto", None)
    assert plan_of(runs, 0, None, last_pt=False) == TrainingPlan(False, 0, None)


def test_a_fixed_phase_keeps_a_model_and_declares_the_trials_its_training_did(config_dirs):
    runs = make_runs(config_dirs)
    record = trained_record(runs, "exp001", 3)
    assert plan_of(runs, 3, record) == TrainingPlan(False, 3, None)
    kept = (
        f"exp001: keeps its last.pt, trained under phase 3 (config phase 0): {KEEPS}; "
        "--forcerun train_model retrains it from step 0 under phase 0"
    )
    # Should its job run (--forcerun), it trains from step 0, not resumed at its last step.
    assert plan_of(runs, 0, record) == TrainingPlan(False, 0, kept, restart_from="phase 3")
    # Trained under auto: the job waited on the trials, so it still does under a fixed phase
    # (another set of inputs would retrain it).
    trials = [trial(0, 1.0), trial(3, 2.0)]
    assert plan_of(runs, 0, record, after_trials=True, trials=trials) == TrainingPlan(
        True, 0, kept, restart_from="phase 3"
    )
    # Its trials gone: a changed set of inputs either way, so it retrains (under a fixed phase
    # without waiting on trials it does not need).
    gone = (
        "exp001: retrains: its last.pt was trained after its trials, which are not all written now"
    )
    assert plan_of(runs, 0, record, after_trials=True) == TrainingPlan(False, 0, gone)
    assert plan_of(runs, "auto", record, after_trials=True) == TrainingPlan(True, "auto", gone)


def test_auto_keeps_a_model_trained_after_its_trials(config_dirs) -> None:
    runs = make_runs(config_dirs)
    record = trained_record(runs, "exp001", 3)
    chose_3 = [trial(0, 1.0), trial(3, 2.0)]
    assert plan_of(runs, "auto", record, after_trials=True, trials=chose_3) == TrainingPlan(
        True, "auto", None
    )
    chose_0 = [trial(0, 3.0), trial(3, 2.0)]
    assert plan_of(runs, "auto", record, after_trials=True, trials=chose_0) == TrainingPlan(
        True,
        "auto",
        f"exp001: keeps its last.pt, trained under phase 3 (config phase auto; its trials "
        f"choose phase 0): {KEEPS}; --forcerun train_model retrains it from step 0 under "
        "phase auto",
        restart_from="phase 3",
    )
    failed = [trial(0, None, "oom")]
    assert "(config phase auto; none of its trials finished ok)" in str(
        plan_of(runs, "auto", record, after_trials=True, trials=failed).notice
    )


def test_auto_keeps_a_model_trained_without_trials_on_its_phase(config_dirs) -> None:
    runs = make_runs(config_dirs)
    record = trained_record(runs, "exp001", 3)
    # It waits on no trial (its set of inputs stays the one it was trained with) and is given
    # the phase it was trained under, so that a rerun for another reason, or --forcerun, trains
    # as the line says.
    assert plan_of(runs, "auto", record, trials=None) == TrainingPlan(
        False,
        3,
        f"exp001: keeps its last.pt, trained under phase 3 without trials (config phase auto): "
        f"{KEEPS}, so it stays on phase 3, --forcerun train_model included, until its training "
        "settings change or its last.pt is removed",
    )
    assert plan_of(runs, "auto", record, trials=[trial(3, 2.0)]) == TrainingPlan(False, 3, None)
    # The phase is the recorded id: a phase whose settings config/phases.yaml has changed
    # since is still that phase, not found again by comparing settings.
    record["phase"]["workers"] = 99
    assert plan_of(runs, "auto", record, trials=[trial(3, 2.0)]) == TrainingPlan(False, 3, None)
    # Trained under a phase config/phases.yaml no longer defines: nothing to stay on.
    record["phase_id"] = 99
    assert plan_of(runs, "auto", record) == TrainingPlan(
        True,
        "auto",
        "exp001: retrains under phase auto, after its trials: its last.pt was trained without "
        "them, under phase 99, which config/phases.yaml does not define",
    )
    # A settings.json that records no id (written before ids were): no phase to stay on.
    del record["phase_id"]
    assert "under a phase no train/settings.json records" in str(
        plan_of(runs, "auto", record).notice
    )


def test_the_training_plan_names_what_changed(config_dirs) -> None:
    runs = make_runs(config_dirs)
    record = trained_record(runs, "exp001", 0)
    record["experiment"]["train"]["lr"] = 1.0
    record["experiment"]["model"]["filters"] = [1, 2]
    changed = (
        "exp001: retrains: its experiment's model, train changed since its last.pt was trained"
    )
    assert plan_of(runs, 0, record) == TrainingPlan(False, 0, changed)
    # Under auto it retrains after its trials, whatever its last training waited on.
    assert plan_of(runs, "auto", record) == TrainingPlan(True, "auto", changed)
    # A change outside the training sections (the split) is not training's to report.
    record = trained_record(runs, "exp001", 0)
    record["experiment"]["split"]["seed"] = 99
    assert plan_of(runs, 0, record).notice is None
    # The trial section counts for a run trained after its trials: they rerun, and it waited
    # on them.
    record = trained_record(runs, "exp001", 0)
    record["experiment"]["trial"]["steps"] = 99
    assert plan_of(runs, 0, record).notice is None
    assert plan_of(runs, 0, record, after_trials=True, trials=[]).notice == (
        "exp001: retrains: its experiment's trial changed since its last.pt was trained"
    )


def test_auto_phase_is_the_train_jobs_choice(tmp_path: Path) -> None:
    from ctseg.trials.trials import choose_phase

    cases = [
        [trial(0, 1.0), trial(1, 2.0), trial(2, 1.5)],
        [trial(0, 2.0), trial(1, 2.0)],  # a tie: the lower phase
        [trial(0, 9.0, "oom"), trial(1, 1.0), trial(2, None)],
    ]
    for i, trials in enumerate(cases):
        paths = []
        for t in trials:
            paths.append(tmp_path / f"{i}-{t.phase}.json")
            t.write(paths[-1])
        assert auto_phase(trials) == choose_phase(paths)
    assert auto_phase([trial(0, 9.0, "oom")]) is None and auto_phase([]) is None


def test_a_combined_run_records_its_members_and_weights(config_dirs) -> None:
    runs = make_runs(config_dirs)
    recorded = runs.provenance("exp001_cv.cv", "tuned")
    assert recorded["members"] == ",".join(runs.fold_runs("exp001_cv"))
    assert "weights" not in recorded
    assert "members" not in runs.provenance("exp001", "tuned")


@pytest.mark.parametrize(
    ("argv", "forced"),
    [
        (
            ["snakemake", "train", "--forcerun", "train_model", "--config", "phase=1"],
            (False, {"train_model"}),
        ),
        (
            ["snakemake", "-R", "train_model", "results/x/last.pt", "-n"],
            (False, {"train_model", "results/x/last.pt"}),
        ),
        (["snakemake", "--forcerun=train_model"], (False, {"train_model"})),
        (["snakemake", "-F", "train"], (True, set())),
        (["snakemake", "train", "--config", "phase=1"], (False, set())),
    ],
)
def test_the_command_line_s_forced_jobs_are_read_for_the_plan_s_line(argv, forced) -> None:
    assert forced_on_command_line(argv) == forced


def test_the_plan_s_split_keeps_a_recorded_split_when_a_record_is_added(
    config_dirs, tmp_path, monkeypatch
) -> None:
    # The plan reads the split the split job recorded (results/mine/exp001/), as the job does.
    monkeypatch.chdir(tmp_path)
    recorded = Path("results/mine/exp001") / RECORDED_SPLIT
    before = write_split(make_runs(config_dirs).split_table("exp001"), recorded.parent / "s.csv")
    for n in range(9, 20):  # records added until a fresh draw would move the split
        more = records(n_train=n)
        fresh = make_runs(config_dirs, more).split_table("exp001").set_index("id")["split"]
        if list(fresh.loc[before["id"]]) != list(before["split"]):
            break
    else:
        pytest.fail("no added record moved the fresh split")
    plan = Runs(
        more,
        dataset="mine",
        experiments_dir=config_dirs[0],
        ensembles_dir=config_dirs[1],
        phases=load_phases(REPO / "config" / "phases.yaml"),
        demo=False,
        recorded_split=read_recorded_split,
    )
    kept = plan.split_table("exp001").set_index("id")["split"]
    assert list(kept.loc[before["id"]]) == list(before["split"])


def test_an_experiment_the_stages_refuse_is_refused_at_planning_naming_its_file(
    config_dirs,
) -> None:
    """The workflow passes the loss registry's check (`ctseg.network.terms.check_terms`): an
    experiment whose terms it refuses stops planning with one line naming the file."""
    from ctseg.network.terms import check_terms

    experiments, ensembles = config_dirs

    def check(exp) -> None:
        # The registry's check as if `boundary` were in the schema with no registered function.
        # (A term weighted 0 is off: the simulated missing function is never called.)
        weights = exp["loss"]["weights"]
        check_terms([n + "_unregistered" * (n == "boundary") for n, w in weights.items() if w])

    (experiments / "no_boundary.yaml").write_text(
        "extends: exp001\nname: no_boundary\nloss: {weights: {boundary: 0.0}}\n"
    )
    runs = Runs(
        records(labelled_test=True),
        dataset="mine",
        experiments_dir=experiments,
        ensembles_dir=ensembles,
        phases=load_phases(REPO / "config" / "phases.yaml"),
        demo=False,
        check_experiment=check,
    )
    with pytest.raises(CtsegError, match=r"exp001\.yaml: loss term 'boundary_unregistered' is"):
        runs.experiment("exp001")  # its weights include boundary
    # Loaded: boundary is off in it, so its terms pass the check.
    assert runs.experiment("no_boundary")["loss"]["weights"]["boundary"] == 0.0
