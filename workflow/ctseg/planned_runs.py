"""The run model as the workflow plans with it (`workflow/rules/common.smk`): the dataset's
records and runs built from the config, the default runs and their checks, and what the plan
does with each trained run's train job, read from its run folder as planning starts, with the
lines printed about it before any job runs.

Snakemake's objects stay in the workflow and are passed in (the config's values, `sys.argv`,
the DAG's jobs); so are the stages' functions a step needs (the loss registry's `check_terms`,
`ctseg.training.restart.restart_line`, `ctseg.training.start.start_lines`), so that this
module stays at the top level. A CtsegError is raised, for the workflow's `planning` to refuse.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ctseg import layout
from ctseg.config import ENSEMBLES_DIR, EXPERIMENTS_DIR
from ctseg.io import CtsegError
from ctseg.records import read_recorded_split, read_records
from ctseg.run_settings import SETTINGS_JSON, read_run_settings
from ctseg.runs import Runs, TrainingPlan, forced_on_command_line
from ctseg.summaries import TrialSummary
from ctseg.workflow_checks import say


def load_records(
    dataset: str, dataset_dir: Path, demo_records: Mapping[str, Any] | None = None
) -> Mapping[str, Any]:
    """The dataset's records by id: the generated demo's (`demo_records`), or the rows of the
    dataset's csv files (`ctseg.records.read_records`), an error naming the dataset."""
    if demo_records is not None:
        return demo_records
    try:
        table = read_records(dataset_dir)
    except CtsegError as exc:
        raise CtsegError(f"dataset {dataset!r}: {exc}") from exc
    return {row["id"]: row for row in table.to_dict("records")}


def dataset_runs(
    records: Mapping[str, Any],
    dataset: str,
    phases: Mapping[int, Any],
    check_terms: Callable[[Mapping[str, float]], None],
) -> Runs:
    """The runs of `dataset` (`ctseg.runs.Runs`) from the experiment and ensemble files of
    config/experiments and config/ensembles; each loaded experiment's loss terms are checked
    by `check_terms` (the loss registry's: an unregistered term is refused at planning, naming
    the experiment's file)."""
    return Runs(
        records,
        dataset=dataset,
        experiments_dir=EXPERIMENTS_DIR,
        ensembles_dir=ENSEMBLES_DIR,
        phases=phases,
        demo=dataset == layout.DEMO_DATASET,
        other_datasets=layout.other_datasets("resources", dataset),
        recorded_split=read_recorded_split,
        check_experiment=lambda exp: check_terms(exp["loss"]["weights"]),
    )


def default_runs(experiment: str | Sequence[str], runs: Runs) -> list[str]:
    """Config `experiment` (a run, or a list of runs) as a list, each run checked to exist."""
    names = [experiment] if isinstance(experiment, str) else list(experiment)
    for name in names:
        runs.kind(name)
    return names


def check_default_runs(runs: Runs, default: Sequence[str]) -> None:
    """Every experiment and ensemble file, checked when the workflow loads: a bad one that the
    default runs read stops planning, naming its file; any other is a warning line. Then each
    default run's record counts (`Runs.check_record_counts`)."""
    for line in runs.check_all(default):
        say(line)
    for run in default:
        runs.check_record_counts(run)


def trainings_to_run(jobs: Iterable[Any]) -> list[str]:
    """The trained runs whose train_model job is among `jobs` (Snakemake's
    `workflow.dag.needrun_jobs()`: forced reruns included)."""
    return sorted({job.wildcards["exp"] for job in jobs if job.rule.name == "train_model"})


class TrainingPlans:
    """What the plan does with each trained run's train job under the configured `phase`
    (`Runs.training_plan`), from the run's folder (`run_dir(run)`) as planning starts.

    The plan reads the run's results (last.pt, train/settings.json and train/trials.txt exist;
    what settings.json holds; the trial summaries), so the train rule's input functions are not
    functions of the config alone. That is the point: Snakemake reruns a job whose set of
    inputs differs from the one its last run recorded, so whether a finished run's job declares
    the trials must follow what its last training declared, not the phase configured now, or a
    phase change would retrain it. Each run's plan is read once."""

    def __init__(self, runs: Runs, phase: int | str, run_dir: Callable[[str], str]) -> None:
        self.runs = runs
        self.configured_phase = phase
        self.run_dir = run_dir
        self._plans: dict[str, TrainingPlan] = {}

    def trials_record(self, run: str) -> str:
        """train/trials.txt: the trials the job that wrote the run's last.pt waited on, one a
        line; absent when it waited on none (`rule_args.RECORD_TRIALS` writes it)."""
        return f"{self.run_dir(run)}/train/trials.txt"

    def state_dir(self, run: str) -> str:
        """A trained run's resumable checkpoints: outside the declared outputs, which Snakemake
        deletes before a rerun, so that a preempted run resumes rather than starts over."""
        return f"{self.run_dir(run)}/checkpoints"

    def trials_written(self, run: str) -> list[TrialSummary] | None:
        """Its experiment's trial summaries as they are now; None while any is not written. One
        that does not read is left out (the train job refuses it, naming it)."""
        paths = [Path(p) for p in self.runs.trial_summaries(run)]
        if not all(p.exists() for p in paths):
            return None
        found = []
        for path in paths:
            with contextlib.suppress(CtsegError):
                found.append(TrialSummary.read(path))
        return found

    def plan(self, run: str) -> TrainingPlan:
        """Which phase the run's train job is given, whether it waits on the trials, and the
        line printed about it."""
        if run not in self._plans:
            folder = Path(self.run_dir(run))
            last_pt = (folder / "last.pt").exists()
            settings = folder / "train" / SETTINGS_JSON
            after_trials = last_pt and Path(self.trials_record(run)).exists()
            self._plans[run] = self.runs.training_plan(
                run,
                self.configured_phase,
                last_pt=last_pt,
                trained=read_run_settings(settings) if last_pt and settings.exists() else None,
                after_trials=after_trials,
                trials=(
                    self.trials_written(run)
                    if self.configured_phase == "auto" or after_trials
                    else None
                ),
            )
        return self._plans[run]

    def phase(self, run: str) -> int | str:
        """The train job's --phase: the configured one, or for auto, the phase a run trained
        without trials stays on."""
        return self.plan(run).phase

    def chosen_phases(self, run: str) -> list[int]:
        """The phases the train job may use: its phase, or any trialled one for auto."""
        return self.runs.chosen_phases(run, self.phase(run))

    def gpus(self, run: str) -> int:
        """The GPUs the train job asks for under its phase."""
        return self.runs.train_gpus(run, self.phase(run))

    def settings(self, run: str) -> dict[str, Any]:
        """The settings the train job's `settings` param records under its phase."""
        return self.runs.train_settings(run, self.phase(run))

    def forced(self, run: str, argv: Sequence[str]) -> bool:
        """Whether the command line `argv` forces the run's train job (--forcerun/-R
        train_model or its last.pt or best.pt, --forceall): the plan then says it retrains,
        not that it keeps its last.pt."""
        forceall, forced = forced_on_command_line(argv)
        outputs = {f"{self.run_dir(run)}/last.pt", f"{self.run_dir(run)}/best.pt"}
        return forceall or bool({"train_model", *outputs} & forced)

    def notices(
        self,
        default: Sequence[str],
        argv: Sequence[str],
        restart_line: Callable[[str, str, int | str], str],
    ) -> None:
        """A line for each trained run of the `default` runs whose last.pt the plan keeps under
        another phase or retrains for changed settings, printed before any job runs; a forced
        one retrains from step 0 (`restart_line`: `ctseg.training.restart.restart_line`)."""
        for run in sorted({t for r in default for t in self.runs.trained_runs(r)}):
            plan = self.plan(run)
            notice = plan.notice
            if plan.restart_from is not None and self.forced(run, argv):
                notice = restart_line(run, plan.restart_from, plan.phase)
            if notice:
                say(notice)

    def start_lines(
        self,
        run: str,
        *,
        start: Callable[..., list[str]],
        image_store: str,
        settings: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """The lines printed before any job runs for a training this invocation runs (`start`:
        `ctseg.training.start.start_lines`: its checkpoints set aside for a retraining under
        another phase, its estimated time, its volumes smaller than the patch, whose stores are
        `image_store` with each {id} of the run's split). `settings`: the experiment as the
        run's plan resolved it (its planned patch), by default the experiment's own."""
        plan = self.plan(run)
        return start(
            run,
            restart_from=plan.restart_from,
            phase=plan.phase,
            settings=self.runs.settings(run) if settings is None else settings,
            phases=self.runs.phases,
            trials=self.trials_written(run) or [],
            image_stores={
                i: Path(image_store.format(id=i)) for i in self.runs.split_table(run)["id"]
            },
            state_dir=Path(self.state_dir(run)),
        )
