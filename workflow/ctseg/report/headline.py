"""The report's headline, first on the page: for each run, its score against the baseline's on
the same volumes, whether those volumes were held out or fitted on, and "smoke test" when its
training was too short for the score to say how good the model is.

Every figure is one the comparison table below shows (`compare.RunFacts`): the mean score of
``evaluation/scores.csv`` and of ``baseline/scores.csv``, the provenance's verdict, and the
training samples summed over ``train/steps.csv`` (a combined run: its members', read from
``results/<member>/train/steps.csv``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ctseg.formatting import fmt
from ctseg.report.classes import PER_CLASS_FILE
from ctseg.report.compare import RunFacts, read_steps
from ctseg.report.markup import Sources, esc

# Fewer training samples (patches) than this make a run a smoke test. A network that has seen
# so few patches is still close to its initial weights, so its score shows that the pipeline
# ran end to end, not how good the model can be. The demo's 24 CPU steps see a few dozen
# patches; exp001_full sees 128,000, and nnU-Net's default schedule 500,000 (1000 epochs of
# 250 steps of 2): a real training is two orders of magnitude above this line.
SMOKE_TEST_SAMPLES = 1000
SCORE_DIGITS = 4  # as the comparison table shows the scores


def trained_samples(steps: pd.DataFrame) -> int:
    """The patches a training saw: each step's samples/s times its seconds, summed."""
    return int(round(float((steps["samples_per_s"] * steps["step_s"]).sum())))


def _mean_score(scores: pd.DataFrame | None) -> float | None:
    if scores is None or scores.empty:
        return None
    return float(scores["score"].astype(float).mean())


def _samples(facts: RunFacts, src: Sources) -> tuple[int | None, str]:
    """The samples the run's model(s) trained on (a combined run: its least trained member's)
    and how to say it; None where no steps.csv tells."""
    if facts.run.trained:
        if facts.steps is None:
            return None, "training: no train/steps.csv yet"
        samples = trained_samples(facts.steps)
        return samples, f"trained on {samples:,} samples"
    counts = []
    for member in facts.members:
        steps_csv = Path(member.directory) / "train" / "steps.csv"
        if steps_csv.exists():
            counts.append(trained_samples(read_steps(steps_csv)))
            src.use(steps_csv)
    if not counts or len(counts) < len(facts.members):
        return None, "members' training: not every member has a train/steps.csv"
    return min(counts), f"its least trained member saw {min(counts):,} samples"


def _held_out(facts: RunFacts) -> str:
    verdict, _ = facts.provenance.fitted()
    n = len(facts.scores) if facts.scores is not None else 0
    volumes = f"{n} {facts.provenance.scored_split} volume(s)"
    if verdict == "no":
        return f"held out: {volumes} nothing was fitted on"
    if verdict == "yes":
        return f"fitted: {volumes} that training or tuning saw, so the score is optimistic"
    return f"{volumes}; held out or fitted on: not recorded"


def _against_baseline(facts: RunFacts, score: float) -> tuple[str, str]:
    """The comparison with the baseline, and the line's class (better, worse, none)."""
    baseline = _mean_score(facts.baseline)
    if baseline is None:
        return "no baseline score (no <code>baseline/</code> for this run)", "none"
    difference = score - baseline
    signed = f"{difference:+.{SCORE_DIGITS}f}".replace("-", "−")
    how = "better than" if difference > 0 else "not better than"
    text = (
        f"{how} the baseline's <b>{fmt(baseline, SCORE_DIGITS)}</b> on the same volumes "
        f"({esc(signed)})"
    )
    return text, "better" if difference > 0 else "worse"


def headline_line(facts: RunFacts, src: Sources) -> str:
    """One run's headline, as an HTML list item."""
    name = f"<b>{esc(facts.run.name)}</b>"
    score = _mean_score(facts.scores)
    if score is None:
        return f"<li class='hl-none'>{name}: not scored yet (no evaluation/scores.csv)</li>"
    against, klass = _against_baseline(facts, score)
    samples, trained = _samples(facts, src)
    if samples is not None and samples < SMOKE_TEST_SAMPLES:
        smoke = (
            f" <span class='smoke'>smoke test</span>: {esc(trained)}, fewer than "
            f"{SMOKE_TEST_SAMPLES:,}; the score shows that the pipeline runs, not how good the "
            "model can be."
        )
    else:
        smoke = f" {esc(trained[0].upper() + trained[1:])}."
    return (
        f"<li class='hl-{klass}'>{name}: score <b>{fmt(score, SCORE_DIGITS)}</b>, {against}; "
        f"{esc(_held_out(facts))}.{smoke}</li>"
    )


def headline_section(facts: Sequence[RunFacts], src: Sources) -> str:
    """The headline: one line per run, in the comparison's order."""
    items = "".join(headline_line(f, src) for f in facts)
    per_class = any(
        f.run.evaluation_dir is not None and (f.run.evaluation_dir / PER_CLASS_FILE).is_file()
        for f in facts
    )
    score = (
        "mean score (the competition score; a multi-class run's: its mean Dice over the "
        "classes, class by class in the run's Per-class scores)"
        if per_class
        else "mean competition score"
    )
    return (
        '<div id="headline" class="headline"><p class="headline-title"><b>How good</b>: each '
        f"run's {score} on its scored volumes, against a trivial baseline's on "
        "the same volumes (details under <a href='#comparison'>Runs compared</a>)</p>"
        f"<ul>{items}</ul></div>"
    )
