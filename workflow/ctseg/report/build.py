"""The page put together: one run's (`build_report`) or several runs' (`build_runs_report`);
see the package's docstring."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ctseg.io import CtsegError, atomic_path
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.report.classes import per_class_section
from ctseg.report.compare import RunFacts, comparison_section, members_block, read_run
from ctseg.report.dataset import dataset_section
from ctseg.report.headline import headline_section
from ctseg.report.markup import Sources, esc
from ctseg.report.overlays import Overlay, Volume, overlay_section, runs_overlay_section
from ctseg.report.page import anchor, nest, page, sources_section
from ctseg.report.phases import phase_section
from ctseg.report.postprocess import postprocess_section
from ctseg.report.provenance import provenance_block, read_provenance
from ctseg.report.runs import Run, run_from_dir
from ctseg.report.scores import evaluation_section
from ctseg.report.settings import settings_section
from ctseg.report.timings import timing_section
from ctseg.report.training import training_section


def _write(out_html: Path, html: str) -> None:
    with atomic_path(Path(out_html)) as tmp:
        tmp.write_text(html, encoding="utf-8")


def build_report(
    out_html: Path,
    *,
    experiment: str,
    phase_summaries: list[Path],
    train_dir: Path | None,
    evaluation_dir: Path | None,
    overlays: list[Overlay],
    benchmarks_dir: Path | None,
    title: str = "ctseg report",
    root: Path | None = None,
    postprocess_dir: Path | None = None,
    labels: LabelSpec = KAGGLE,
) -> None:
    """Write the one-run report to `out_html` atomically; see the module docstring.

    `overlays` holds (id, image zarr, label zarr or None, prediction tif or None). Paths in the
    page are shown relative to `root` (default: the working directory, the workflow root).
    """
    src = Sources(Path(root) if root is not None else Path.cwd())
    run = Run(
        name=experiment,
        directory=None,
        phase_summaries=tuple(Path(p) for p in phase_summaries),
        train_dir=train_dir,
        evaluation_dir=evaluation_dir,
        postprocess_dir=postprocess_dir,
    )
    sections = [
        phase_section(list(run.phase_summaries), src),
        training_section(train_dir, src),
        settings_section([run], src),
        evaluation_section(evaluation_dir, src),
        per_class_section(evaluation_dir, src, required=not labels.is_binary),
        provenance_block(read_provenance(run, src)),
        postprocess_section(postprocess_dir, src),
        overlay_section(overlays, src, labels),
        timing_section(benchmarks_dir, src),
    ]
    sections.append(sources_section(src))
    _write(out_html, page(title, experiment, sections))


def _run_sections(
    run: Run, src: Sources, facts: RunFacts | None = None, labels: LabelSpec = KAGGLE
) -> str:
    """One run's own sections, as the one-run page has them, nested under the run's heading."""
    parts = []
    if run.trained:
        parts += [
            dataset_section(run.directory, src),
            phase_section(list(run.phase_summaries), src),
            training_section(run.train_dir, src),
        ]
    else:
        parts.append(
            f"<p class='note'>No <code>phases/</code> or <code>train/</code> in "
            f"<code>{esc(src.rel(run.directory))}</code>: this run trained nothing of its own "
            "(an ensemble of other runs, or a cross-validation's out-of-fold collection of its "
            "folds' predictions), so it has no phase trials or loss curves.</p>"
        )
        if facts is not None and facts.members:
            parts.append(members_block(facts))
    parts += [
        evaluation_section(run.evaluation_dir, src),
        per_class_section(run.evaluation_dir, src, required=not labels.is_binary),
        provenance_block(read_provenance(run, src)),
        postprocess_section(run.postprocess_dir, src),
        timing_section(run.benchmarks_dir, src),
    ]
    body = "\n".join(nest(part, run.name) for part in parts)
    return f'<h2 id="run-{anchor(run.name)}">Run {esc(run.name)}</h2>\n{body}'


def build_runs_report(
    out_html: Path,
    runs: Sequence[Path],
    *,
    overlays: Sequence[Volume] = (),
    benchmarks_dir: Path | None = None,
    title: str = "ctseg report",
    root: Path | None = None,
    labels: LabelSpec = KAGGLE,
) -> None:
    """Write one report of several runs (results/<run> directories) to `out_html` atomically.
    `labels`: the dataset's label spec (a multi-class one adds the per-class tables and colours
    each class in the overlays).

    `overlays` holds (id, image zarr, label zarr or None); each run's prediction of a volume
    is its predictions/<id>.tif. `benchmarks_dir` holds the timings of jobs no run owns
    (preprocessing). One run gives the same page with a one-row comparison.
    """
    if not runs:
        raise CtsegError("report: no run given; pass --run results/<run> (repeatable)")
    loaded = [run_from_dir(Path(r)) for r in runs]
    names = [r.name for r in loaded]
    if len(set(names)) != len(names):
        raise CtsegError(f"report: a run is named twice ({', '.join(map(str, runs))})")
    src = Sources(Path(root) if root is not None else Path.cwd())
    facts = [read_run(run, src) for run in loaded]
    headline = headline_section(facts, src)
    sections = [
        comparison_section(facts),
        settings_section(loaded, src),
        runs_overlay_section(
            overlays, [(r.name, r.predictions_dir) for r in loaded], src, labels=labels
        ),
        *(_run_sections(run, src, f, labels) for run, f in zip(loaded, facts, strict=True)),
        timing_section(benchmarks_dir, src, "Shared timings (jobs of no run: preprocessing)"),
        sources_section(src),
    ]
    _write(out_html, page(title, "", sections, runs=names, headline=headline))
