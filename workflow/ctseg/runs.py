"""The run model: which runs exist, what each is built from, and which volumes it trains, tunes
and is scored on.

A run is what has a ``results/<run>/`` directory, named by its path:

- an experiment, ``config/experiments/<exp>.yaml`` (`extends` resolved by `ctseg.config`);
- a fold of an experiment with ``split.folds``: ``<exp>.fold<i>`` (fold i held out as val);
- the cross-validation of such an experiment: ``<exp>.cv`` (its folds' mean on held-out
  volumes; post-processing tuned on the out-of-fold probabilities);
- an ensemble, ``config/ensembles/<name>.yaml`` (`ctseg.config.load_ensemble`).

`Runs` answers every question the workflow asks of them from four inputs: the dataset's records,
the experiment and ensemble files, and the phases. It holds no other state, so the answers are
pure functions of those inputs, and tests reach them without Snakemake (tests/test_runs.py).
Every refusal is a `CtsegError` naming the file or the run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ctseg import layout
from ctseg.config import (
    FOLD_RUN,
    RUN_NAME,
    Ensemble,
    LazyFolds,
    check_trial_phases,
    configured_gpus,
    load_ensemble,
    load_experiment,
    settings_used,
    thaw,
    with_fold,
)
from ctseg.io import CtsegError
from ctseg.records import (
    RECORDED_SPLIT,
    assign_folds,
    folds_by_scroll,
    keep_recorded,
    select_records,
)
from ctseg.run_settings import recorded_phase
from ctseg.summaries import TrialSummary

# Directories of results/ that are not runs.
RESERVED = frozenset({"preprocessed", "scratch", "logs", "benchmarks", "bench", "report", "plans"})
KINDS = ("trained", "cv", "ensemble")
CV_SUFFIX = ".cv"


def base_of(run: str) -> str:
    """The experiment a trained run (an experiment or one of its folds) comes from."""
    found = FOLD_RUN.fullmatch(run)
    return found["experiment"] if found else run


def fold_of(run: str) -> int | None:
    found = FOLD_RUN.fullmatch(run)
    return int(found["fold"]) if found else None


def cv_base(run: str) -> str | None:
    """The experiment of a cross-validation run ``<exp>.cv``; None for any other name."""
    return run[: -len(CV_SUFFIX)] if run.endswith(CV_SUFFIX) else None


def auto_phase(trials: Sequence[TrialSummary]) -> int | None:
    """The phase `phase: auto` trains under, given its experiment's trials: the fastest
    (samples/s) that finished ok, the lower number on a tie; None when none did. The rule of
    `ctseg.trials.trials.choose_phase`, which the train job runs, here on summaries already read
    and without torch, for the plan's notice (tests/test_runs.py holds the two together)."""
    ok = [
        (t.samples_per_s, -t.phase, t.phase)
        for t in trials
        if t.status == "ok" and t.samples_per_s is not None
    ]
    return max(ok)[2] if ok else None


@dataclass(frozen=True)
class TrainingPlan:
    """What a plan holds for a trained run's train job (`Runs.training_plan`)."""

    trials: bool  # the job waits on its experiment's trials: they are among its inputs
    phase: int | str  # the --phase it is given: a phase number, or auto
    notice: str | None  # the one line the plan prints about it, if any
    # The phase its last.pt was trained under, when the job trains under another one: should
    # the job run (--forcerun), it trains from step 0, its finished checkpoints set aside
    # (`ctseg.training.restart`), not resumed at their last step. None: nothing to set aside.
    restart_from: str | None = None


def yaml_names(folder: Path) -> list[str]:
    return sorted(p.stem for p in Path(folder).glob("*.yaml"))


def alternatives(names: Sequence[str]) -> str:
    """A regex matching exactly these names (one that matches nothing for none)."""
    return "|".join(re.escape(n) for n in names) or "(?!)"


def _common(groups: list[set[str]]) -> list[str]:
    common: set[str] | None = None
    for these in groups:
        common = these if common is None else common & these
    return sorted(common or [])


class Runs:
    """The runs of one dataset: `records` maps each record id to its row of the dataset
    (split, scroll_id, label); `demo` says the dataset is the generated demo, whose test
    volumes are labelled."""

    def __init__(
        self,
        records: Mapping[str, Mapping[str, Any]],
        *,
        dataset: str,
        experiments_dir: Path,
        ensembles_dir: Path,
        phases: Mapping[int, Mapping[str, Any]],
        demo: bool,
        other_datasets: Sequence[str] = (),
        recorded_split: Callable[[Path], Mapping[str, Any] | None] | None = None,
        check_experiment: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.records = records
        self.dataset = dataset
        self.experiments_dir = Path(experiments_dir)
        self.ensembles_dir = Path(ensembles_dir)
        self.phases = phases
        self.demo = demo
        # Datasets beside this one (`layout.other_datasets`): their runs are in
        # results/<dataset>/, a folder no run of the demo's may take as its own.
        self.other_datasets = list(other_datasets)
        # The split a run recorded beside its split.csv (`ctseg.records.read_recorded_split`),
        # kept by its next selection; None: no run has recorded one.
        self.recorded_split = recorded_split or (lambda path: None)
        # What the stages check of a loaded experiment beyond its schema (the workflow passes
        # the loss registry's `check_terms`): its CtsegError is refused naming the file.
        self.check_experiment = check_experiment or (lambda exp: None)
        # The experiment a run's train job trains: its own settings, or (the workflow sets
        # this) its plan's, with what the plan resolved (the patch, the output channels).
        self.trained_settings: Callable[[str], Any] = self.settings
        self.root = layout.results_root(dataset)
        self.experiment_names = yaml_names(self.experiments_dir)
        self.ensemble_names = yaml_names(self.ensembles_dir)
        self._experiments: dict[str, Any] = {}
        self._splits: dict[str, pd.DataFrame] = {}
        self._out_of_fold: dict[str, dict[str, int]] = {}
        self._ensembles: dict[str, Ensemble] = {}
        self._check_names()
        self._check_dataset()

    # ------------------------------------------------------------------------- names
    def _check_names(self) -> None:
        for name in self.experiment_names + self.ensemble_names:
            if not RUN_NAME.fullmatch(name) or name in RESERVED:
                raise CtsegError(
                    f"{name}.yaml: a run's name may hold only letters, digits, _ and -, and not "
                    f"be one of {sorted(RESERVED)}; rename the file"
                )
        if self.root == layout.RESULTS:
            taken = sorted(
                set(self.experiment_names + self.ensemble_names) & set(self.other_datasets)
            )
            if taken:
                raise CtsegError(
                    f"run {taken[0]!r} ({taken[0]}.yaml) has the name of the dataset "
                    f"resources/{taken[0]}/, whose runs are in results/{taken[0]}/: both would "
                    "write there; rename the run's file or the dataset's folder"
                )
        clash = sorted(set(self.experiment_names) & set(self.ensemble_names))
        if clash:
            raise CtsegError(
                f"{self.ensembles_dir}: ensemble(s) {clash} have the name of an experiment in "
                f"{self.experiments_dir}; both would write results/<name>/: rename one"
            )

    def _check_dataset(self) -> None:
        """A dataset other than the demo keeps its runs in results/<dataset>/: that folder must
        not be a run's or one of results/'s own."""
        if self.root == layout.RESULTS:
            return
        if not RUN_NAME.fullmatch(self.dataset):
            raise CtsegError(
                f"config 'dataset': {self.dataset!r}: a dataset's name may hold only letters, "
                "digits, _ and -; rename resources/<dataset>/"
            )
        taken = set(self.experiment_names) | set(self.ensemble_names) | RESERVED
        if self.dataset in taken:
            raise CtsegError(
                f"config 'dataset': {self.dataset!r} is also the name of a run or of a folder of "
                f"results/ ({self.root}/ would hold both): rename resources/{self.dataset}/"
            )

    def constraints(self) -> dict[str, str]:
        """Regexes of the run names each kind of rule makes, so that two rules never claim the
        same results/<run>/... path: trained (an experiment or a fold), combined (a
        cross-validation or an ensemble), and any."""
        base = alternatives(self.experiment_names)
        trained = rf"(?:{base})(?:\.fold[0-9]+)?"
        combined = alternatives(
            [f"{n}{CV_SUFFIX}" for n in self.experiment_names] + self.ensemble_names
        )
        return {
            "base": base,
            "trained": trained,
            "combined": combined,
            "any": f"{trained}|{combined}",
        }

    # ------------------------------------------------------------------------- experiments
    def experiment_file(self, run: str) -> str:
        return str(self.experiments_dir / f"{base_of(run)}.yaml")

    def experiment(self, name: str) -> Any:
        """The effective settings of experiment `name` (no fold), checked."""
        if name not in self._experiments:
            path = self.experiments_dir / f"{name}.yaml"
            if name not in self.experiment_names:
                raise CtsegError(
                    f"{path}: no such experiment ({self.experiments_dir}/ has "
                    f"{self.experiment_names})"
                )
            exp = load_experiment(path)
            check_trial_phases(exp, self.phases, str(path))
            try:
                self.check_experiment(exp)
            except CtsegError as exc:
                raise CtsegError(f"{path}: {exc}") from exc
            self._experiments[name] = exp
        return self._experiments[name]

    def folds_of(self, name: str) -> int:
        return self.experiment(name)["split"]["folds"] or 0

    def settings(self, run: str) -> Any:
        """The experiment as a trained run uses it: with its fold, if it is one."""
        exp = self.experiment(base_of(run))
        fold = fold_of(run)
        if fold is None:
            return exp
        try:
            return with_fold(exp, fold, self.experiment_file(run))
        except CtsegError as exc:
            raise CtsegError(f"run {run!r}: {exc}") from exc

    def kind(self, run: str) -> str:
        """trained (an experiment or a fold), cv or ensemble; a clear error for anything else."""
        if run in self.ensemble_names:
            return "ensemble"
        base = cv_base(run)
        if base is not None and base in self.experiment_names:
            if not self.folds_of(base):
                raise CtsegError(
                    f"run {run!r}: experiment {base!r} declares no split.folds "
                    f"({self.experiment_file(base)}), so it has no cross-validation"
                )
            return "cv"
        if base_of(run) in self.experiment_names:
            self.settings(run)  # a fold out of range fails here, naming the file
            return "trained"
        raise CtsegError(
            f"run {run!r}: not an experiment of {self.experiments_dir}/ "
            f"({self.experiment_names}), a fold <experiment>.fold<i>, a cross-validation "
            f"<experiment>.cv, or an ensemble of {self.ensembles_dir}/ ({self.ensemble_names})"
        )

    def check_all(self, used: Sequence[str]) -> list[str]:
        """Load every experiment and ensemble file. Those the runs in `used` read (their own,
        an ensemble's members', a fine-tune's source run's, what each extends) must load: a bad
        one is refused, naming its file. A bad one that none of them reads is a warning line,
        returned: a typo in an experiment no run uses does not stop the others (a target that
        names its run is refused when the rules reach it)."""
        todo, seen = list(used), set()
        while todo:
            run = todo.pop()
            if run in seen:
                continue
            seen.add(run)
            for trained in self.trained_runs(run):
                source = self.experiment(base_of(trained)).get("init_from")
                if source:
                    todo.append(source)
        warnings = []
        files = [(name, self.experiment) for name in self.experiment_names]
        files += [(name, self.ensemble) for name in self.ensemble_names]
        for name, load in files:
            try:
                load(name)
            except CtsegError as exc:
                warnings.append(
                    f"warning: {exc} (no run of config 'experiment' {list(used)} reads it: "
                    "it is left out of the plan until it is fixed)"
                )
        return warnings

    # ------------------------------------------------------------------------- records
    def ids(self, split: str | None = None, labelled: bool | None = None) -> list[str]:
        return [
            record_id
            for record_id, row in self.records.items()
            if (split is None or row["split"] == split)
            and (labelled is None or bool(row["label"]) == labelled)
        ]

    def training_records(self) -> pd.DataFrame:
        """The labelled training records an experiment may draw from."""
        return pd.DataFrame(
            [
                {"id": i, "scroll_id": self.records[i]["scroll_id"]}
                for i in self.ids(split="train", labelled=True)
            ],
            columns=["id", "scroll_id"],
        )

    def split_table(self, run: str) -> pd.DataFrame:
        """The train/val/test table of a trained run (what rule split writes): its recorded
        split's ids where they were (`ctseg.records.keep_recorded`)."""
        if run not in self._splits:
            exp = self.settings(run)
            try:
                table = select_records(self.training_records(), exp["subset"], exp["split"])
            except CtsegError as exc:
                raise CtsegError(f"{self.experiment_file(run)}: run {run!r}: {exc}") from exc
            recorded = Path(layout.run_dir(run, root=self.root)) / RECORDED_SPLIT
            self._splits[run] = keep_recorded(table, self.recorded_split(recorded), recorded)
        return self._splits[run]

    def split_ids(self, run: str, part: str) -> list[str]:
        table = self.split_table(run)
        return list(table.loc[table["split"] == part, "id"])

    def out_of_fold(self, base: str) -> dict[str, int]:
        """{record: the fold that holds it out}, for every non-test record of `base`."""
        if base not in self._out_of_fold:
            exp = self.experiment(base)
            table = self.split_table(base)
            rest = table[table["split"] != "test"].reset_index(drop=True)
            try:
                self._out_of_fold[base] = assign_folds(
                    rest, exp["split"], folds_by_scroll(exp["subset"], exp["split"])
                )
            except CtsegError as exc:
                raise CtsegError(f"{self.experiment_file(base)}: {exc}") from exc
        return self._out_of_fold[base]

    def fold_runs(self, base: str) -> list[str]:
        return [f"{base}.fold{i}" for i in range(self.folds_of(base))]

    # ------------------------------------------------------------------------- ensembles
    def ensemble(self, name: str) -> Ensemble:
        """config/ensembles/<name>.yaml, checked against the experiments that exist."""
        if name not in self._ensembles:
            known = LazyFolds(self.experiment_names, self.folds_of)
            self._ensembles[name] = load_ensemble(self.ensembles_dir / f"{name}.yaml", known)
        return self._ensembles[name]

    def members(self, run: str) -> list[str]:
        """The runs a combined run averages."""
        kind = self.kind(run)
        if kind == "cv":
            return self.fold_runs(cv_base(run))  # type: ignore[arg-type]
        if kind == "ensemble":
            return self.ensemble(run).member_names
        return []

    def tuned_ensemble(self, run: str) -> bool:
        return self.kind(run) == "ensemble" and self.ensemble(run).tuned

    def trained_runs(self, run: str) -> list[str]:
        """Every trained run a run needs, itself included for a trained one."""
        if self.kind(run) == "trained":
            return [run]
        return [t for m in self.members(run) for t in self.trained_runs(m)]

    def ensemble_inputs(self, run: str, record_id: str) -> list[tuple[str, float]]:
        """(probabilities, weight) of each member for one volume. A cross-validation's
        out-of-fold volume comes from the one fold that held it out; elsewhere its folds weigh
        the same. An ensemble's weights are its file's, or 1 each when tuned (the weights then
        come from weights.json)."""
        if self.kind(run) == "cv":
            base = cv_base(run)
            oof = self.out_of_fold(base)  # type: ignore[arg-type]
            if record_id in oof:
                return [
                    (
                        layout.probabilities(
                            f"{base}.fold{oof[record_id]}", record_id, root=self.root
                        ),
                        1.0,
                    )
                ]
            return [
                (layout.probabilities(m, record_id, root=self.root), 1.0) for m in self.members(run)
            ]
        spec = self.ensemble(run)
        weights = spec.weights or [1.0] * len(spec.members)
        held_out = record_id in self.tune_ids(run)
        return [
            (
                self.member_probability(m, record_id)
                if held_out
                else layout.probabilities(m, record_id, root=self.root),
                w,
            )
            for m, w in zip(spec.member_names, weights, strict=True)
        ]

    # ------------------------------------------------------------------------- held-out ids
    def tune_ids(self, run: str) -> list[str]:
        """Labelled volumes whose probabilities the post-processing (and ensemble weights) are
        fitted on: a trained run's val split; out-of-fold for a cross-validation; the members'
        common ones for an ensemble. Never a test split."""
        kind = self.kind(run)
        if kind == "trained":
            return self.split_ids(run, "val")
        if kind == "cv":
            return sorted(self.out_of_fold(cv_base(run)))  # type: ignore[arg-type]
        return _common([set(self.member_held_out(m)) for m in self.members(run)])

    def member_held_out(self, member: str) -> list[str]:
        """The held-out volumes an ensemble member offers: its val split, or, for a fold, its
        experiment's out-of-fold volumes (each predicted by the fold that held it out)."""
        if fold_of(member) is not None:
            return sorted(self.out_of_fold(base_of(member)))
        return self.tune_ids(member)

    def member_probability(self, member: str, record_id: str) -> str:
        """A member's held-out probabilities of a volume (see member_held_out)."""
        if fold_of(member) is not None:
            base = base_of(member)
            return layout.probabilities(
                f"{base}.fold{self.out_of_fold(base)[record_id]}", record_id, root=self.root
            )
        return self.tune_probability(member, record_id)

    def tune_probability(self, run: str, record_id: str) -> str:
        """The held-out probabilities a run is tuned on: a cross-validation's come from the
        fold that held the record out."""
        base = cv_base(run)
        if self.kind(run) == "cv":
            return layout.probabilities(
                f"{base}.fold{self.out_of_fold(base)[record_id]}",  # type: ignore[arg-type]
                record_id,
                root=self.root,
            )
        return layout.probabilities(run, record_id, root=self.root)

    def test_split_ids(self, run: str) -> list[str]:
        """The labelled test split of a run's experiment(s), that nothing trains or tunes on."""
        kind = self.kind(run)
        if kind == "trained":
            return self.split_ids(run, "test")
        if kind == "cv":
            return self.split_ids(cv_base(run), "test")  # type: ignore[arg-type]
        return _common([set(self.test_split_ids(m)) for m in self.members(run)])

    def eval_ids(self, run: str) -> list[str]:
        """Labelled volumes the run is scored on: its test split; else the demo's test volumes;
        else (real data without a test split) the tuning volumes, an optimistic score that the
        evaluation's provenance and the report say is fitted on them."""
        test = self.test_split_ids(run)
        if test:
            return test
        if self.demo:
            return self.ids(split="test", labelled=True)
        return self.tune_ids(run)

    def infer_ids(self, run: str) -> list[str]:
        """Volumes a run makes masks of: the dataset's test volumes (the submission) and the
        volumes it is scored on. (Its tuning volumes' probabilities are made as tuning inputs.)
        """
        return sorted(set(self.ids(split="test")) | set(self.eval_ids(run)))

    def provenance(self, run: str, postprocess: str) -> dict[str, str]:
        """What evaluation/summary.json records of where its volumes come from."""
        if self.test_split_ids(run):
            scored = "test_split"
        elif self.demo:
            scored = "demo_test_volumes"
        else:
            scored = "oof" if self.kind(run) == "cv" else "val"
        fitted_on_scored = postprocess == "tuned" and scored in ("val", "oof")
        recorded = {
            "run": run,
            "dataset": self.dataset,
            "kind": self.kind(run),
            "scored_on": scored,
            "postprocess": postprocess,
            "fitted_on_scored": "yes" if fitted_on_scored else "no",
        }
        # A combined run's members (the report adds their hours and shows their weights).
        if self.members(run):
            recorded["members"] = ",".join(self.members(run))
        if self.kind(run) == "ensemble":
            weights = self.ensemble(run).weights
            recorded["weights"] = "tuned" if weights is None else ",".join(map(str, weights))
        return recorded

    def check_record_counts(self, run: str) -> None:
        """Training needs a record to train on and evaluation one to score: say so before any
        job runs, not as a usage error of `ctseg evaluate` after training."""
        if self.eval_ids(run):
            return
        if self.demo:
            why = "demo.n_test is 0 and it has no split.test_fraction; set either"
        elif self.kind(run) == "trained" and len(self.split_table(run)) < 2:
            why = (
                f"it selects {len(self.split_table(run))} labelled record(s), so its val split "
                "is empty: label at least 2 records in train.csv/train_labels"
            )
        else:
            why = (
                "it has no labelled test split and no val split: set split.test_fraction, "
                "split.val_fraction above 0, or list split.test_ids / split.val_ids"
            )
        raise CtsegError(f"dataset {self.dataset!r}, run {run!r}: no record to evaluate: {why}")

    def check_tunable(self, run: str) -> None:
        """infer.postprocess: tuned needs held-out volumes to tune on."""
        if not self.tune_ids(run):
            raise CtsegError(
                f"infer.postprocess: tuned needs held-out volumes to tune on, and run {run!r} "
                "has none: set split.val_fraction above 0 or list split.val_ids (an ensemble's "
                "members need val volumes in common), or set infer.postprocess: fixed"
            )

    # ------------------------------------------------------------------------- training
    def phase_gpus(self, run: str, phase: int) -> int:
        """GPUs a phase trains on, one torchrun process each (`ctseg.config.configured_gpus`)."""
        return configured_gpus(self.experiment(base_of(run)), self.phases[phase])

    def chosen_phases(self, run: str, phase: int | str) -> list[int]:
        """The phases the train job may use: the configured one, or any trialled one for auto."""
        if phase == "auto":
            return list(self.experiment(base_of(run))["trial"]["phases"])
        if phase not in self.phases:
            raise CtsegError(f"config 'phase': {phase} is not in config/phases.yaml")
        return [phase]  # type: ignore[list-item]

    def train_gpus(self, run: str, phase: int | str) -> int:
        """GPUs of the train job. torchrun's process count is fixed before `auto` chooses the
        phase, so the trialled phases must agree on it."""
        chosen = self.chosen_phases(run, phase)
        counts = {self.phase_gpus(run, p) for p in chosen}
        if len(counts) > 1:
            raise CtsegError(
                f"phase auto: the trialled phases {chosen} ask for different gpus "
                f"({sorted(counts)}); trial phases with one GPU count, or choose a phase"
            )
        return counts.pop()

    def train_settings(self, run: str, phase: int | str) -> dict[str, Any]:
        """What the train job's result depends on among the settings: the experiment's training
        sections. Not the phase: a phase changes how a run trains (and a checkpoint is resumed
        only under the same maths, `ctseg.training.checkpoint`), so a last.pt trained under one
        phase is kept when the config names another (`training_plan` says so)."""
        self.chosen_phases(run, phase)  # an unknown phase is refused here
        return settings_used(self.settings(run), None, "train")

    def init_weights(self, run: str) -> list[str]:
        """The weights a fine-tune starts from (`init_from: <run>`): the DAG builds them first."""
        source = self.experiment(base_of(run)).get("init_from")
        if not source:
            return []
        if self.kind(source) != "trained":
            raise CtsegError(
                f"{self.experiment_file(run)}: init_from: {source!r} is not a trained run (an "
                "experiment or a fold): it has no last.pt to start from"
            )
        return [f"{layout.run_dir(source, root=self.root)}/last.pt"]

    def trial_summaries(self, run: str) -> list[str]:
        """The phase trials of a trained run's experiment (folds share their experiment's)."""
        base = base_of(run)
        return [
            layout.trial_summary(base, p, root=self.root)
            for p in self.experiment(base)["trial"]["phases"]
        ]

    def training_changes(
        self, run: str, trained: Mapping[str, Any], after_trials: bool
    ) -> list[str]:
        """The experiment's sections that changed since `trained` (a train/settings.json) was
        written, among those its train job's result depends on: the training sections, and the
        trial section for a run trained after its trials (they rerun, and it waits on them)."""
        used = settings_used(self.trained_settings(run), None, "trial" if after_trials else "train")
        return sorted(key for key in used if thaw(trained["experiment"].get(key)) != used[key])

    def training_plan(
        self,
        run: str,
        phase: int | str,
        *,
        last_pt: bool,
        trained: Mapping[str, Any] | None,
        after_trials: bool,
        trials: Sequence[TrialSummary] | None,
    ) -> TrainingPlan:
        """What the plan does with a trained run's train job under the configured `phase`,
        given the run's results: `last_pt`, whether its last.pt exists; `trained`, its
        train/settings.json (None: not written); `after_trials`, whether the job that wrote
        last.pt waited on the trials (its train/trials.txt exists); `trials`, the trial
        summaries as they are now (None while any is not written).

        A phase changes how a run trains, not its result, so a phase change keeps a last.pt.
        Snakemake reruns a job whose set of inputs differs from the set its last run recorded,
        so a finished run's job declares the trials exactly when the job that wrote its last.pt
        did, whatever the phase now; phase auto declares them when the run trains anyway. Under
        auto, a run trained without its trials stays on the phase it was trained under (the
        job's --phase) until its training settings change. The phase a run trained under is
        the id its settings.json records (`ctseg.run_settings.recorded_phase`). A change of
        those settings retrains the run, naming the keys. A last.pt kept under another phase
        than the job's is set aside should the job run (`TrainingPlan.restart_from`)."""
        auto = phase == "auto"
        if not last_pt:
            return TrainingPlan(auto, phase, None)
        changed = [] if trained is None else self.training_changes(run, trained, after_trials)
        if changed:
            return TrainingPlan(
                auto,
                phase,
                f"{run}: retrains: its experiment's {', '.join(changed)} changed since its "
                "last.pt was trained",
            )
        recorded, _ = recorded_phase(trained)
        number = recorded if recorded in self.phases else None
        if recorded is None:
            under = "a phase no train/settings.json records"
        elif number is None:
            under = f"phase {recorded}, which config/phases.yaml does not define"
        else:
            under = f"phase {number}"
        chosen = None if trials is None else auto_phase(trials)
        chosen_same = number is not None and chosen == number
        if after_trials and trials is None:  # its set of inputs changes either way
            return TrainingPlan(
                auto,
                phase,
                f"{run}: retrains: its last.pt was trained after its trials, which are not all "
                "written now",
            )
        if not auto:
            if trained is None or number == phase:
                return TrainingPlan(after_trials, phase, None)
            return TrainingPlan(
                after_trials,
                phase,
                f"{run}: keeps its last.pt, trained under {under} (config phase {phase}): a "
                "phase changes how a run trains, not its result; --forcerun train_model "
                f"retrains it from step 0 under phase {phase}",
                restart_from=under,
            )
        if after_trials:
            if chosen_same:
                return TrainingPlan(True, phase, None)
            choice = (
                "none of its trials finished ok"
                if chosen is None
                else f"its trials choose phase {chosen}"
            )
            return TrainingPlan(
                True,
                phase,
                f"{run}: keeps its last.pt, trained under {under} (config phase auto; {choice}): "
                "a phase changes how a run trains, not its result; --forcerun train_model "
                "retrains it from step 0 under phase auto",
                restart_from=under,
            )
        if number is None:  # no phase to stay on: declaring the trials retrains it
            return TrainingPlan(
                True,
                phase,
                f"{run}: retrains under phase auto, after its trials: its last.pt was trained "
                f"without them, under {under}",
            )
        return TrainingPlan(
            False,
            number,
            None
            if chosen_same
            else (
                f"{run}: keeps its last.pt, trained under phase {number} without trials (config "
                "phase auto): a phase changes how a run trains, not its result, so it stays on "
                f"phase {number}, --forcerun train_model included, until its training settings "
                "change or its last.pt is removed"
            ),
        )

    def previous_trial(self, experiment: str, phase: int) -> list[str]:
        """Trials run in order, each compared with the one before (and one GPU runs one at a
        time)."""
        order = self.experiment(experiment)["trial"]["phases"]
        if phase in order and order.index(phase) > 0:
            before = order[order.index(phase) - 1]
            return [layout.trial_summary(experiment, before, root=self.root)]
        return []


def forced_on_command_line(argv: Sequence[str]) -> tuple[bool, frozenset[str]]:
    """What a snakemake command line forces: (--forceall/-F given, the rules and files given to
    --forcerun/-R). The plan is made before Snakemake hands its own settings to the workflow,
    so a forced train job's line comes from here."""
    forceall, forced, taking = False, set(), False
    for token in argv[1:]:
        if token in ("-F", "--forceall"):
            forceall, taking = True, False
        elif token in ("-R", "--forcerun"):
            taking = True
        elif token.startswith("--forcerun="):
            forced.add(token.split("=", 1)[1])
            taking = True
        elif token.startswith("-"):
            taking = False
        elif taking:
            forced.add(token)
    return forceall, frozenset(forced)
