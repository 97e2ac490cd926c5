"""The report's comparison of runs: one table row per run, and every run's loss curves in one
plot.

Each cell is read from the run's own files (named under the table, run by run):

- score and its three terms: mean ± sample standard deviation (ddof 1) over the volumes of
  ``evaluation/scores.csv``, and n, the number of volumes;
- the scored split and whether anything was fitted on those volumes (`provenance`);
- val Dice: the last row of ``train/epochs.csv``; steps: the rows of ``train/steps.csv`` (one
  per optimizer step); samples/s: their mean;
- phase and device: the phase train/settings.json records (`ctseg.run_settings.recorded_phase`)
  and the device ``ctseg train`` printed into its log (`runs.train_log_facts`);
- job hours and device hours: the run's Snakemake benchmark TSVs (`timings.run_hours`); a
  cross-validation's or an ensemble's row adds those of its members (its folds, or the runs it
  averages), named by the ``members`` of its ``evaluation/summary.json`` provenance (the
  workflow records them) and read from their own folders beside it, ``results/<member>/``.
  Device hours are GPU-hours or CPU-hours by the device the training printed (`hours_unit`):
  the jobs of the GPU rules run on the CPU on a machine without a GPU.

`members_block` shows a combined run's members, each one's weight (the provenance's
``weights``, or ``ensemble/weights.json`` for tuned weights) and hours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ctseg.formatting import fmt, num
from ctseg.io import CtsegError
from ctseg.report.classes import PER_CLASS_FILE
from ctseg.report.markup import Sources, esc, missing, png, read_json, read_table, table
from ctseg.report.provenance import Provenance, read_provenance
from ctseg.report.runs import Run, run_from_dir, train_log_facts
from ctseg.report.timings import GPU_RULES, RunHours, run_hours
from ctseg.report.training import unlabelled_note, unlabelled_steps
from ctseg.run_settings import SETTINGS_JSON, read_run_settings, recorded_phase
from ctseg.summaries import STEP_REQUIRED

# scores.csv column -> header: the competition score and its three terms.
SCORE_TERMS = {
    "score": "score",
    "surface_dice": "SurfaceDice",
    "voi_score": "VOI score",
    "topo_score": "TopoScore",
}


@dataclass
class RunFacts:
    run: Run
    provenance: Provenance
    scores: pd.DataFrame | None = None
    steps: pd.DataFrame | None = None
    epochs: pd.DataFrame | None = None
    log: dict[str, Any] = field(default_factory=dict)
    hours: RunHours = RunHours(None, None, 0, ())
    files: list[str] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)  # a combined run's, in its order
    baseline: pd.DataFrame | None = None  # baseline/scores.csv (ctseg.evaluation.baseline)
    baseline_summary: dict[str, Any] = field(default_factory=dict)
    weights_note: str = ""  # where the members' weights come from
    phase: tuple[int | None, bool] = (None, False)  # train/settings.json's (phase_id, auto)

    @property
    def total_hours(self) -> tuple[float | None, float | None]:
        """(job, GPU) seconds of the run and its members together."""
        job = [h for h in (self.hours.job_s, *(m.hours.job_s for m in self.members)) if h]
        gpu = [h for h in (self.hours.gpu_s, *(m.hours.gpu_s for m in self.members)) if h]
        return (sum(job) if job else None, sum(gpu) if gpu else None)


@dataclass
class Member:
    """One member of a cross-validation or an ensemble: its folder, weight and hours."""

    name: str
    directory: Path
    weight: str = "not recorded"
    hours: RunHours = RunHours(None, None, 0, ())
    device: str | None = None  # as its training printed it


# The competition's VOI and TopoScore are for one class: a multi-class run's scores.csv, beside
# its per_class.csv (`ctseg.evaluation.classes.evaluate_multiclass`: score = the mean Dice over
# the classes), has neither.
ONE_CLASS_TERMS = ("voi_score", "topo_score")


def _read_scores(path: Path) -> pd.DataFrame:
    scores = read_table(path, dtype={"id": str})
    per_class = (Path(path).parent / PER_CLASS_FILE).is_file()
    needed = [c for c in SCORE_TERMS if not (per_class and c in ONE_CLASS_TERMS)]
    absent = [c for c in needed if c not in scores.columns]
    if absent:
        raise CtsegError(f"{path}: not an evaluation scores.csv (no {', '.join(absent)} column)")
    return scores


def read_steps(path: Path) -> pd.DataFrame:
    steps = read_table(path)
    needed = set(STEP_REQUIRED) - set(steps.columns)
    if needed or steps.empty:
        problem = f"missing columns {sorted(needed)}" if needed else "no rows"
        raise CtsegError(f"{path}: not a training steps.csv ({problem})")
    return steps


def read_run(run: Run, src: Sources) -> RunFacts:
    """Everything the comparison shows of one run; unreadable files raise, naming the file."""
    facts = RunFacts(run, read_provenance(run, src))
    facts.files += facts.provenance.files
    if run.evaluation_dir is not None and (run.evaluation_dir / "scores.csv").exists():
        facts.scores = _read_scores(run.evaluation_dir / "scores.csv")
    if run.train_dir is not None:
        steps_csv, epochs_csv = run.train_dir / "steps.csv", run.train_dir / "epochs.csv"
        if steps_csv.exists():
            facts.steps = read_steps(steps_csv)
            facts.files.append(src.use(steps_csv))
        if epochs_csv.exists():
            facts.epochs = read_table(epochs_csv)
            facts.files.append(src.use(epochs_csv))
    if run.train_dir is not None and (run.train_dir / SETTINGS_JSON).exists():
        settings_path = run.train_dir / SETTINGS_JSON
        facts.phase = recorded_phase(read_run_settings(settings_path))
        facts.files.append(src.use(settings_path))
    facts.log, log_path = train_log_facts(run)
    if facts.log and log_path is not None:
        facts.files.append(src.use(log_path))
    gpus = int(num(facts.log.get("world_size")) or 1)
    facts.hours = run_hours(run.benchmarks_dir, src, train_gpus=gpus)
    facts.files += facts.hours.files
    _read_members(facts, src)
    _read_baseline(facts, src)
    return facts


def _read_baseline(facts: RunFacts, src: Sources) -> None:
    """The run's reference score, where `ctseg baseline` wrote one (results/<run>/baseline/)."""
    if facts.run.directory is None:
        return
    folder = facts.run.directory / "baseline"
    scores, summary = folder / "scores.csv", folder / "summary.json"
    if scores.exists() and summary.exists():
        facts.baseline = _read_scores(scores)
        facts.baseline_summary = read_json(summary)
        facts.files += [src.use(scores), src.use(summary)]


def baseline_row(facts: RunFacts) -> list[str]:
    """The reference row under a run's: the same columns, the baseline's scores."""
    summary, scores = facts.baseline_summary, facts.baseline
    assert scores is not None
    tuned = set(map(str, summary.get("tuned_on") or []))
    fitted = "yes (threshold)" if tuned & set(scores["id"].astype(str)) else "no"
    name = f"↳ baseline: image > {fmt(summary.get('threshold'))}"
    return [
        name,
        f"{facts.provenance.scored_split} ({len(scores)})",
        fitted,
        *(_spread(scores, column) for column in SCORE_TERMS),
        *["reference"] * 3,
        "n/a",
        "n/a",
        "n/a",
    ]


def _listed(value: Any) -> list[str]:
    return [v.strip() for v in str(value).split(",") if v.strip()] if value else []


def _read_members(facts: RunFacts, src: Sources) -> None:
    """A combined run's members (provenance ``members``), their weights and their hours."""
    run, recorded = facts.run, facts.provenance.recorded
    names = _listed(recorded.get("members"))
    if not names or run.directory is None:
        return
    weights = _listed(recorded.get("weights"))
    weights_json = run.directory / "ensemble" / "weights.json"
    if weights_json.exists():
        data = read_json(weights_json)
        chosen = dict(zip(data.get("members") or [], data.get("weights") or [], strict=False))
        weights = [fmt(chosen.get(n)) for n in names]
        facts.weights_note = f"tuned: {src.use(weights_json)}"
        facts.files.append(src.rel(weights_json))
    elif weights == ["tuned"]:
        weights, facts.weights_note = [], "tuned, but ensemble/weights.json is not there"
    elif weights:
        facts.weights_note = "as the ensemble file sets them (evaluation/summary.json provenance)"
    for i, name in enumerate(names):
        member = Member(name, run.directory.parent / name)
        if i < len(weights):
            member.weight = weights[i]
        if member.directory.is_dir():
            member_run = run_from_dir(member.directory)
            log, log_path = train_log_facts(member_run)
            if log and log_path is not None:
                facts.files.append(src.use(log_path))
            gpus = int(num(log.get("world_size")) or 1)
            member.device = log.get("device")
            member.hours = run_hours(member_run.benchmarks_dir, src, train_gpus=gpus)
            facts.files += member.hours.files
        facts.members.append(member)


def _spread(scores: pd.DataFrame | None, column: str) -> str:
    if scores is None or scores.empty:
        return "n/a"
    if column not in scores.columns:  # a multi-class run's VOI and TopoScore
        return "n/a (per class)"
    values = scores[column].astype(float)
    if len(values) < 2:
        return fmt(values.mean(), 4)
    return f"{fmt(values.mean(), 4)} ± {fmt(values.std(ddof=1), 4)}"


def _last(frame: pd.DataFrame | None, column: str) -> Any:
    if frame is None or frame.empty or column not in frame.columns:
        return None
    return frame[column].iloc[-1]


def _phase(facts: RunFacts) -> str:
    """The phase train/settings.json records (its id, and whether phase auto chose it) and the
    device the training printed."""
    phase_id, auto = facts.phase
    if phase_id is None and "device" not in facts.log:
        return "not recorded"
    phase = "phase not recorded" if phase_id is None else str(phase_id)
    if phase_id is not None and auto:
        phase += " (auto)"
    return f"{phase}, {facts.log.get('device', 'device not recorded')}"


def _hours(seconds: float | None) -> str:
    return fmt(None if seconds is None else seconds / 3600)


def _total(total: float | None, own: float | None, members: int, unit: str = "") -> str:
    shown = f"{_hours(total if members else own)} {unit}".rstrip()
    if not members:
        return shown
    return f"{shown} (own {_hours(own)} + {members} members)"


def hours_unit(devices: Sequence[str | None]) -> str:
    """What the GPU rules' hours were on: the devices the trainings printed (``cpu``,
    ``cuda:0``, ...). A machine without a GPU runs those jobs on its CPU."""
    kinds = sorted({"CPU" if str(d).startswith("cpu") else "GPU" for d in devices if d})
    if not kinds:
        return "device hours (device not recorded)"
    return " and ".join(kinds) + "-hours"


def run_devices(facts: RunFacts) -> list[str | None]:
    """The devices the run's own training and its members' printed."""
    own = [facts.log.get("device")] if facts.run.trained else []
    return own + [m.device for m in facts.members]


def comparison_row(facts: RunFacts) -> list[str]:
    verdict, _ = facts.provenance.fitted()
    steps = facts.steps
    n = "n/a" if facts.scores is None else str(len(facts.scores))
    trained = facts.run.trained
    job_s, gpu_s = facts.total_hours
    members = len(facts.members)
    untrained = f"{members} members trained" if members else "no training"
    return [
        facts.run.name,
        f"{facts.provenance.scored_split} ({n})",
        verdict,
        *(_spread(facts.scores, column) for column in SCORE_TERMS),
        # A combined run trained nothing of its own: the steps column says so, once.
        fmt(_last(facts.epochs, "val_dice"), 3) if trained else "n/a",
        fmt(len(steps)) if steps is not None else ("n/a" if trained else untrained),
        _phase(facts) if trained else "n/a",
        fmt(steps["samples_per_s"].mean()) if steps is not None else "n/a",
        _total(job_s, facts.hours.job_s, members),
        _total(gpu_s, facts.hours.gpu_s, members, hours_unit(run_devices(facts))),
    ]


HEADER = [
    "run",
    "scored split (n volumes)",
    "fitted on them",
    *(f"{name} (mean ± std)" for name in SCORE_TERMS.values()),
    "val Dice (patches, last epoch)",
    "steps",
    "phase, train device",
    "samples/s (mean)",
    "job hours (with members)",
    "GPU- or CPU-hours (with members)",
]


# What the two Dice figures of the page are (ctseg.training.validation, ctseg.evaluation.metrics).
DICE_NOTE = (
    "<p class='note'><em>val Dice</em> and the score columns measure different things on "
    "different volumes. val Dice (<code>train/epochs.csv</code>) is computed during training: "
    "the hard voxel Dice of the network's raw output (logit above 0, no post-processing) on "
    "a fixed set of <code>train.val_batches</code> random patches of the <em>val</em> volumes, "
    "over their labelled voxels only; with few patches it is noisy, and it drives nothing but "
    "the curve. The score and SurfaceDice columns (<code>evaluation/scores.csv</code>) are the "
    "competition's metric on whole <em>scored</em> volumes (the scored split: test, or val / "
    "out-of-fold where there is no test split), after post-processing: SurfaceDice counts "
    "surface points within 2 voxels of the label's surface as matched, so it reads well above "
    "a voxel Dice of the same mask. Compare runs by the score columns.</p>"
)

BASELINE_NOTE = (
    "<p class='note'><em>↳ baseline</em> rows: what a trivial rule scores on the same volumes, "
    "so that a reader sees what the model adds (<code>baseline/</code>, written by "
    "<code>ctseg baseline</code>): a voxel is surface where the image is brighter than a "
    "threshold, chosen among a few quantiles of the tuning volumes' intensities by the mean "
    "score there, and scored with the same exact metric. <em>fitted on them</em> says whether "
    "that threshold was tuned on the scored volumes themselves.</p>"
)

LINE_STYLES = ("-", "--", ":", "-.")


def _loss_steps(item: RunFacts) -> pd.DataFrame:
    """The steps drawn: those on patches without a labelled voxel left out (`unlabelled_steps`)."""
    steps = item.steps
    assert steps is not None
    return steps[~unlabelled_steps(steps)]


def _loss_figure(facts: Sequence[RunFacts]) -> Figure | None:
    trained = [f for f in facts if f.steps is not None]
    if not trained:
        return None
    has_val = any(f.epochs is not None and "val_loss" in f.epochs for f in trained)
    has_dice = any(f.epochs is not None and "val_dice" in f.epochs for f in trained)
    panels = 1 + int(has_val) + int(has_dice)
    fig = Figure(figsize=(4.6 * panels, 3.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, panels))
    # Colour and line style per run: runs that share their first steps (an experiment and one
    # extending it, same seed) draw the same curve, and a dashed one stays visible on top.
    styles = [(f"C{i % 10}", LINE_STYLES[i % len(LINE_STYLES)]) for i in range(len(facts))]
    for (colour, style), item in zip(styles, facts, strict=True):
        if item.steps is None:
            continue
        steps = _loss_steps(item)
        window = max(1, len(steps) // 50)
        smooth = steps["loss"].rolling(window, min_periods=1).mean()
        axes[0].plot(steps["step"], smooth, color=colour, ls=style, lw=1.3, label=item.run.name)
        epochs = item.epochs
        panel = 1
        for column, shown in (("val_loss", has_val), ("val_dice", has_dice)):
            if not shown:
                continue
            if epochs is not None and column in epochs and epochs[column].notna().any():
                axes[panel].plot(
                    epochs["step"],
                    epochs[column],
                    marker="o",
                    color=colour,
                    ls=style,
                    label=item.run.name,
                )
            panel += 1
    axes[0].set(title="training loss (smoothed)", xlabel="optimizer step")
    titles = [t for t, shown in (("validation loss", has_val), ("val Dice", has_dice)) if shown]
    for ax, title in zip(axes[1:], titles, strict=True):
        ax.set(title=title, xlabel="optimizer step")
    for ax in axes:
        ax.legend(fontsize=7)
    return fig


def comparison_section(facts: Sequence[RunFacts]) -> str:
    out = ['<h2 id="comparison">Runs compared</h2>']
    if not facts:
        return "\n".join([*out, missing("Runs (--run results/<run>)")])
    rows, classes = [], []
    for f in facts:
        rows.append(comparison_row(f))
        classes.append("")
        if f.baseline is not None:
            rows.append(baseline_row(f))
            classes.append("baseline")
    out.append(table(HEADER, rows, row_classes=classes))
    gpu_rules = ", ".join(GPU_RULES)
    out.append(
        "<p class='note'>Score columns: mean ± sample standard deviation (n − 1) over the "
        "n volumes of the run's <code>evaluation/scores.csv</code> (one volume: the mean "
        "alone). <em>fitted on them</em>: whether training or tuning saw the scored volumes "
        "(see each run's provenance). <em>steps</em>: rows of <code>train/steps.csv</code>, "
        "one per optimizer step; samples/s: their mean. <em>phase, train "
        "device</em>: as <code>ctseg train</code> printed them into its log. "
        "<em>job hours</em>: the wall seconds of every job in the run's "
        "<code>benchmarks/</code> TSVs, summed (jobs that ran at once each count)."
        f" <em>GPU- or CPU-hours</em>: the same for the jobs of rules "
        f"{esc(gpu_rules)} (those that request a GPU), times the job's GPUs: the train job's "
        "<code>world_size</code> from its log, one for every other job. They are CPU-hours "
        "where the training printed device <code>cpu</code> (a machine without a GPU runs "
        "these jobs on its CPU), and say so where no training log tells. A cross-validation's "
        "or an ensemble's row adds the hours of its members (folds, or averaged runs: see "
        "the run's members), so it reads what the whole result cost; a member that is also a "
        "row of its own is counted in both rows.</p>"
    )
    out.append(DICE_NOTE)
    if any(f.baseline is not None for f in facts):
        out.append(BASELINE_NOTE)
    fig = _loss_figure(facts)
    if fig is None:
        out.append(missing("Loss curves (train/steps.csv of any run)"))
    else:
        out.append("<h3>Loss curves, every run</h3>")
        out.append(png(fig, "loss curves of every run"))
        left_out = sum(int(unlabelled_steps(f.steps).sum()) for f in facts if f.steps is not None)
        out.append(unlabelled_note(left_out))
    items = "".join(
        f"<li><b>{esc(f.run.name)}</b>: "
        + (", ".join(f"<code>{esc(n)}</code>" for n in f.files) or "no files")
        + "</li>"
        for f in facts
    )
    out.append(f'<p class="source">Read from, run by run:</p><ul class="source">{items}</ul>')
    return "\n".join(out)


def members_block(facts: RunFacts) -> str:
    """A combined run's members, their weights and the hours each cost."""
    if not facts.members:
        return ""
    kind = facts.provenance.recorded.get("kind")
    rows = [
        [
            m.name,
            m.weight,
            "yes" if m.directory.is_dir() else "no folder",
            _hours(m.hours.job_s),
            f"{_hours(m.hours.gpu_s)} {hours_unit([m.device])}",
        ]
        for m in facts.members
    ]
    if kind == "cv":
        how = (
            "A cross-validation's folds: each out-of-fold volume's probabilities come from the "
            "one fold that held it out; a test volume's are the folds' mean, equal weights."
        )
    else:
        how = (
            "The ensemble's probabilities are the members' weighted mean (weights divided by "
            f"their sum); weights: {esc(facts.weights_note or 'not recorded')}."
        )
    header = ["member", "weight", "results folder", "job hours", "GPU- or CPU-hours"]
    return (
        '<h2 id="members">Members, their weights and hours</h2>'
        + table(header, rows)
        + f"<p class='note'>{how} Hours: each member's own benchmark TSVs under "
        "<code>results/&lt;member&gt;/benchmarks/</code>, as in the comparison.</p>"
    )
