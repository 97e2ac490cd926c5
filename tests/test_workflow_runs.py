"""Many runs in one workflow: experiments named by their paths, folds, cross-validations and
ensembles, planned by real `snakemake` dry runs and built by one real run on tiny data."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
import zarr
from conftest import TINY_CONFIG, TINY_EXPERIMENT, copy_workflow, run_snakemake


def planned(proc) -> str:
    return proc.stdout + proc.stderr


def shell_commands(text: str, command: str) -> list[list[str]]:
    """The printed shell commands (`-p`) that start with `ctseg <command>`."""
    found = []
    for line in text.splitlines():
        line = line.strip().removeprefix("Shell command:").strip()
        # The command after the rule's attempt-log keeping (rule_args.KEEP_ATTEMPT_LOG).
        line = line.rsplit(" && ", 1)[-1].removeprefix("exec ")
        if line.startswith(f"ctseg {command} ") or f" -m ctseg.cli {command} " in line:
            found.append(shlex.split(line.split(" > ")[0]))
    return found


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def demo_workflow(tmp_path: Path) -> Path:
    return copy_workflow(tmp_path, None)


def test_an_experiment_is_built_from_its_path_alone(demo_workflow: Path) -> None:
    # The default config names exp001; asking for exp001_full's weights plans exp001_full.
    text = planned(run_snakemake(demo_workflow, "-n", "-p", "results/exp001_full/last.pt"))
    assert "rule train_model:" in text and "results/exp001_full/last.pt" in text
    [train] = shell_commands(text, "train")
    # It trains the experiment its plan resolved (written before any job runs).
    assert option(train, "--plan") == "results/plans/exp001_full.json"
    assert "--experiment" not in train and "--fold" not in train
    assert "results/exp001/" not in text  # nothing of the default experiment
    # Preprocessing is per dataset: shared by every experiment, under results/preprocessed/.
    assert "results/preprocessed/demo/targets/" in text


def test_a_fold_is_planned_from_its_name(demo_workflow: Path) -> None:
    text = planned(run_snakemake(demo_workflow, "-n", "-p", "results/exp001_cv.fold1/last.pt"))
    [train] = shell_commands(text, "train")
    assert option(train, "--plan") == "results/plans/exp001_cv.fold1.json"  # the fold's plan
    assert option(train, "--split") == "results/exp001_cv.fold1/split.csv"
    # Folds train from their experiment's staged copy.
    assert option(train, "--scratch") == "results/scratch/exp001_cv"
    splits = {s[3]: s for s in shell_commands(text, "split")}  # ctseg split DATASET OUT ...
    assert option(splits["results/exp001_cv.fold1/split.csv"], "--fold") == "1"
    # The experiment's own split (what its staged copy holds) has no fold.
    assert "--fold" not in splits["results/exp001_cv/split.csv"]
    assert "results/exp001_cv.fold0/" not in text
    bad = run_snakemake(demo_workflow, "-n", "results/exp001_cv.fold2/last.pt", check=False)
    assert bad.returncode != 0
    assert "exp001_cv.yaml: fold 2 is out of range" in planned(bad)


def test_an_ensemble_target_plans_its_members(demo_workflow: Path) -> None:
    target = "results/ens_demo/evaluation/summary.json"
    text = planned(run_snakemake(demo_workflow, "-n", "-p", target))
    spec = yaml.safe_load((demo_workflow / "config/ensembles/ens_demo.yaml").read_text())
    trains = shell_commands(text, "train")
    # Each member trains from its own plan, results/plans/<run>.json (a fold: <exp>.fold<i>).
    planned_runs = {
        (name, fold or None)
        for name, _, fold in (Path(option(t, "--plan")).stem.partition(".fold") for t in trains)
    }
    expected = set()
    for member in spec["members"]:
        name, _, fold = member.partition(".fold")
        expected.add((name, fold or None))
    assert planned_runs == expected
    assert "rule ensemble:" in text and "rule evaluate_run:" in text
    # The cross-validation of exp001_cv: both folds, combined.
    cv = planned(
        run_snakemake(demo_workflow, "-n", "-p", "results/exp001_cv.cv/evaluation/summary.json")
    )
    plans = sorted(option(t, "--plan") for t in shell_commands(cv, "train"))
    assert plans == [f"results/plans/exp001_cv.fold{i}.json" for i in (0, 1)]


def test_bad_ensemble_and_run_names_are_one_line_errors(demo_workflow: Path) -> None:
    ensembles = demo_workflow / "config/ensembles"
    (ensembles / "neg.yaml").write_text(
        yaml.safe_dump({"name": "neg", "members": ["exp001", "exp001_full"], "weights": [1, -1]})
    )
    bad = run_snakemake(demo_workflow, "-n", "results/neg/evaluation/summary.json", check=False)
    assert bad.returncode != 0
    assert re.search(r"config/ensembles/neg.yaml: .*weight", planned(bad))
    (ensembles / "neg.yaml").unlink()
    (ensembles / "ghost.yaml").write_text(
        yaml.safe_dump({"name": "ghost", "members": ["exp001", "nope"], "weights": [1, 1]})
    )
    bad = run_snakemake(demo_workflow, "-n", "results/ghost/evaluation/summary.json", check=False)
    assert bad.returncode != 0
    assert re.search(r"config/ensembles/ghost.yaml: .*nope", planned(bad))
    (ensembles / "ghost.yaml").unlink()
    bad = run_snakemake(demo_workflow, "-n", "--config", "experiment=nothing_here", check=False)
    assert bad.returncode != 0 and "run 'nothing_here': not an experiment" in planned(bad)
    bad = run_snakemake(demo_workflow, "-n", "--config", "experiment=exp001.cv", check=False)
    assert "declares no split.folds" in planned(bad)


def test_a_scratch_path_with_a_space_reaches_every_command_whole(tmp_path: Path) -> None:
    work = copy_workflow(tmp_path, TINY_CONFIG)
    text = planned(
        run_snakemake(
            work, "-n", "-p", "results/tiny/last.pt", "--config", "scratch=my scratch/dir"
        )
    )
    [train] = shell_commands(text, "train")
    assert option(train, "--scratch") == "my scratch/dir/tiny"
    [stage] = shell_commands(text, "stage")
    assert stage[4] == "my scratch/dir/tiny"  # ctseg stage SOURCE SPLIT DEST


# ----------------------------------------------------------------------------- a real run
def write_experiment(work: Path, data: dict) -> None:
    (work / "config/experiments" / f"{data['name']}.yaml").write_text(yaml.safe_dump(data))


def run_rows(html: str) -> dict[str, str]:
    """The comparison table's row of each run, as text."""
    start = html.index("comparison")
    table = html[start : html.index("</table>", start)]
    return {
        m.group(1): m.group(0)
        for m in re.finditer(r"<tr[^>]*>\s*<t[dh][^>]*>([^<]+)</t[dh]>.*?</tr>", table, re.S)
    }


def test_two_experiments_a_cross_validation_and_an_ensemble_in_one_run(tmp_path: Path) -> None:
    work = copy_workflow(tmp_path, {**TINY_CONFIG, "phase": 0})
    # tiny (conftest's); tiny_b changes only its seed and learning rate; tiny_cv
    # cross-validates it in 2 folds; ens_t averages tiny and tiny_b with tuned weights.
    # One trial phase each (the report shows every trained experiment's trials).
    write_experiment(
        work, {**TINY_EXPERIMENT, "trial": {**TINY_EXPERIMENT["trial"], "phases": [0]}}
    )
    write_experiment(work, {"name": "tiny_b", "extends": "tiny", "train": {"lr": 0.004, "seed": 1}})
    write_experiment(work, {"name": "tiny_cv", "extends": "tiny", "split": {"folds": 2}})
    (work / "config/ensembles/ens_t.yaml").write_text(
        yaml.safe_dump({"name": "ens_t", "members": ["tiny", "tiny_b"], "weights": "tuned"})
    )
    runs = ["tiny", "tiny_b", "tiny_cv.cv", "ens_t"]
    config = ["--config", f"experiment=[{', '.join(runs)}]"]
    run_snakemake(work, "--cores", "2", *config)
    results = work / "results"

    # Every run was evaluated, each saying where its score comes from.
    summaries = {r: json.loads((results / r / "evaluation/summary.json").read_text()) for r in runs}
    for run, summary in summaries.items():
        assert summary["provenance"]["run"] == run
        assert summary["provenance"]["scored_on"] == "demo_test_volumes"
        assert summary["provenance"]["fitted_on_scored"] == "no"

    # The folds held out different records, together every non-test record: each is predicted
    # by a model that never trained on it, and the cross-validation was tuned on those.
    val = [
        set(
            pd.read_csv(results / f"tiny_cv.fold{i}/split.csv", dtype={"id": str}).query(
                "split == 'val'"
            )["id"]
        )
        for i in range(2)
    ]
    train_ids = set(pd.read_csv(work / "resources/demo/train.csv", dtype={"id": str})["id"])
    assert val[0] & val[1] == set() and val[0] | val[1] == train_ids
    tune_log = (results / "logs/tune_postprocess/tiny_cv.cv.log").read_text()
    assert (results / "tiny_cv.cv/postprocess/tuned.json").exists() and tune_log

    # The ensemble's weights were tuned on the members' common val split, and its test
    # probabilities are the weighted mean of theirs.
    weights = json.loads((results / "ens_t/ensemble/weights.json").read_text())
    test_id = pd.read_csv(work / "resources/demo/test.csv", dtype={"id": str})["id"][0]
    members = [
        zarr.open_array(str(results / m / "probabilities" / f"{test_id}.zarr"))[:]
        for m in ("tiny", "tiny_b")
    ]
    w = np.array(weights["weights"], dtype=np.float64)
    expected = (
        w[0] * members[0].astype(np.float64) + w[1] * members[1].astype(np.float64)
    ) / w.sum()
    got = zarr.open_array(str(results / "ens_t/probabilities" / f"{test_id}.zarr"))[:]
    np.testing.assert_allclose(got.astype(np.float64), expected, atol=1e-3)

    # One report compares them all.
    html = (results / "report.html").read_text()
    rows = run_rows(html)
    for run in runs:
        assert run in rows, f"{run} has no row in the comparison table"
        score = summaries[run]["mean_score"]
        shown = [float(x) for x in re.findall(r">(-?\d+\.\d+)<", rows[run])]
        assert any(abs(x - score) < 5e-4 for x in shown), (run, score, rows[run])

    # Its settings table puts first what tiny_b changed (from each run's train/settings.json).
    settings = html[html.index('id="settings"') :]
    differ = re.search(r"<table>.*?</table>", settings, re.S).group(0)
    differ_rows = {
        cells[0]: cells[1:]
        for cells in (
            re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row)
            for row in re.findall(r"<tr>(.*?)</tr>", differ, re.S)
        )
    }
    assert differ_rows["setting"] == runs
    assert differ_rows["train.lr"][:2] == ["0.001", "0.004"]  # the schema default, and its own
    assert differ_rows["train.seed"][1] == "1" and differ_rows["train.lr"][3] == "(no training)"
    assert "model.filters" not in differ_rows

    # An edit to one experiment reruns that experiment's jobs (and what is built from them),
    # never another experiment's.
    exp_b = work / "config/experiments/tiny_b.yaml"
    data = yaml.safe_load(exp_b.read_text())
    data["train"]["lr"] = 0.003
    exp_b.write_text(yaml.safe_dump(data))
    again = planned(run_snakemake(work, "-n", *config))
    outputs = re.findall(r"output: (.+)", again)
    touched = {
        p.split("/")[1] for line in outputs for p in line.split(", ") if p.startswith("results/")
    }
    assert "tiny_b" in touched
    assert touched <= {"tiny_b", "ens_t", "report.html"}, touched


def test_a_fine_tune_plans_its_source_first(demo_workflow: Path) -> None:
    (demo_workflow / "config/experiments/ft.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "ft",
                "extends": "exp001",
                "init_from": "exp001_cv.fold0",
                "data": {"patch_size": [48, 64, 64]},
            }
        )
    )
    text = planned(run_snakemake(demo_workflow, "-n", "-p", "results/ft/last.pt"))
    trains = {Path(option(t, "--weights")).parent.name: t for t in shell_commands(text, "train")}
    assert set(trains) == {"ft", "exp001_cv.fold0"}
    assert option(trains["ft"], "--init-from") == "results/exp001_cv.fold0/last.pt"
    assert "--init-from" not in trains["exp001_cv.fold0"]
    (demo_workflow / "config/experiments/ft.yaml").write_text(
        yaml.safe_dump({"name": "ft", "extends": "exp001", "init_from": "ens_demo"})
    )
    bad = run_snakemake(demo_workflow, "-n", "results/ft/last.pt", check=False)
    assert bad.returncode != 0 and "init_from: 'ens_demo' is not a trained run" in planned(bad)


def planned_rules(proc) -> set[str]:
    return {
        line.strip().removeprefix("local").removeprefix("rule ").rstrip(":")
        for line in planned(proc).splitlines()
        if line.strip().startswith(("rule ", "localrule "))
    }


def one_trial_workflow(tmp_path: Path) -> tuple[Path, Path]:
    """The tiny workflow with experiment tiny2, whose only trial is phase 2 (so that phase auto
    trains under phase 2 and the config's phase 0 differs); returns it and tiny2's last.pt."""
    work = copy_workflow(tmp_path, TINY_CONFIG)
    trial = {**TINY_EXPERIMENT["trial"], "phases": [2]}
    (work / "config/experiments/tiny2.yaml").write_text(
        yaml.safe_dump({**TINY_EXPERIMENT, "name": "tiny2", "trial": trial})
    )
    return work, work / "results" / "tiny2" / "last.pt"


def test_a_run_trained_under_auto_is_kept_under_a_fixed_phase(tmp_path: Path) -> None:
    work, weights = one_trial_workflow(tmp_path)
    run_snakemake(work, "train", "--config", "experiment=tiny2", "phase=auto")
    trained = weights.stat().st_mtime_ns
    # It waited on its trial; the plan of a fixed phase keeps that set of inputs, so Snakemake
    # sees no change, and the line says what happens.
    for target in ("train", "report"):
        plan = run_snakemake(work, "-n", target, "--config", "experiment=tiny2")
        assert "train_model" not in planned_rules(plan), planned(plan)
        assert "ctseg: tiny2: keeps its last.pt, trained under phase 2 (config phase 0)" in planned(
            plan
        )
    run_snakemake(work, "train", "--config", "experiment=tiny2")
    assert weights.stat().st_mtime_ns == trained
    # Back to auto, whose trial chose phase 2: nothing to do, nothing to say.
    back = run_snakemake(work, "-n", "train", "--config", "experiment=tiny2", "phase=auto")
    assert planned_rules(back) == set() and "ctseg: tiny2" not in planned(back)
    # Forced under phase 0, it retrains from step 0 as the console says, its finished
    # checkpoints (at their last step) set aside rather than resumed.
    forced = planned(
        run_snakemake(work, "train", "--forcerun", "train_model", "--config", "experiment=tiny2")
    )
    assert (
        "ctseg: tiny2: retrains from step 0 under phase 0 (--forcerun): its last.pt was trained "
        "under phase 2" in forced
    )
    assert "keeps its last.pt" not in forced
    assert "ctseg: tiny2: its finished checkpoints are set aside in results/tiny2/checkpoints/" in (
        forced
    )
    assert "ctseg: tiny2: training of " in forced  # the plan's estimate
    log = (work / "results" / "logs" / "train" / "tiny2.log").read_text()
    assert '"resume": "fresh"' in log and "resumed at" not in log
    assert weights.stat().st_mtime_ns != trained


def test_a_run_trained_under_a_fixed_phase_is_kept_under_auto(tmp_path: Path) -> None:
    work, weights = one_trial_workflow(tmp_path)
    run_snakemake(work, "train", "--config", "experiment=tiny2")
    trained = weights.stat().st_mtime_ns
    stays = (
        "ctseg: tiny2: keeps its last.pt, trained under phase 0 without trials (config phase "
        "auto): a phase changes how a run trains, not its result, so it stays on phase 0"
    )
    plan = run_snakemake(work, "-n", "-p", "train", "--config", "experiment=tiny2", "phase=auto")
    assert planned_rules(plan) == set() and stays in planned(plan)
    # The report shows its trial: that runs, the training does not.
    report = run_snakemake(work, "-n", "report", "--config", "experiment=tiny2", "phase=auto")
    assert "train_trial" in planned_rules(report) and "train_model" not in planned_rules(report)
    run_snakemake(work, "train", "--config", "experiment=tiny2", "phase=auto")
    assert weights.stat().st_mtime_ns == trained
    # Retrained on request, it trains under the phase the line names.
    forced = planned(
        run_snakemake(
            work,
            "-n",
            "-p",
            "train",
            "--forcerun",
            "train_model",
            "--config",
            "experiment=tiny2",
            "phase=auto",
        )
    )
    [train] = shell_commands(forced, "train")
    assert option(train, "--phase") == "0"
    # A change of its training settings retrains it under auto, after its trial.
    experiment = work / "config" / "experiments" / "tiny2.yaml"
    settings = yaml.safe_load(experiment.read_text())
    settings["train"]["lr"] = 0.0123
    experiment.write_text(yaml.safe_dump(settings))
    changed = run_snakemake(work, "train", "--config", "experiment=tiny2", "phase=auto")
    assert "ctseg: tiny2: retrains: its experiment's train changed" in planned(changed)
    assert weights.stat().st_mtime_ns != trained
    log = (work / "results" / "logs" / "train" / "tiny2.log").read_text()
    assert "phase auto: chose phase 2" in log
    record = work / "results" / "tiny2" / "train" / "trials.txt"
    assert record.read_text().split() == ["results/tiny2/phases/phase2/summary.json"]


def test_the_last_lines_show_a_score_only_for_a_report_up_to_date(tmp_path: Path) -> None:
    work = copy_workflow(tmp_path, TINY_CONFIG)
    built = planned(run_snakemake(work, "report", "--config", "experiment=tiny"))
    assert "ctseg: report: results/report.html\n" in built and "ctseg: tiny: score 0." in built
    # A changed setting retrains the model; the report, not rebuilt, still shows the old one.
    experiment = work / "config" / "experiments" / "tiny.yaml"
    settings = yaml.safe_load(experiment.read_text())
    settings["train"]["lr"] = 0.0123
    experiment.write_text(yaml.safe_dump(settings))
    trained = planned(run_snakemake(work, "train", "--config", "experiment=tiny"))
    assert "ctseg: tiny: score" not in trained
    assert (
        "ctseg: report: results/report.html is out of date: results/tiny/train/steps.csv "
        "changed after it; `snakemake report` rebuilds it"
    ) in trained
