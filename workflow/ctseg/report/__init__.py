"""The HTML report: phase trials with the verdict each recorded, loss curves, scores, slice
overlays and stage timings, in one self-contained file.

The report only renders. Every figure in the page is read from a file under ``results/`` and
each section names the files it read (relative paths), so every number traces back to its
source; the phase trials' verdicts, next knobs, precision and machine facts are the trials' own
(ctseg.trials.trials), shown as recorded, and "not recorded" where an older summary lacks them.
Plots are PNGs embedded as base64 data URIs and the CSS is inline: the page opens offline and makes
no requests. A section whose inputs are missing says so; an input that exists but cannot be read
is a `CtsegError` naming the file (a report built on a corrupt file would be silently wrong).

The page carries one small inline script, inert for a reader: once the page has loaded it
draws every image onto a canvas and writes how many rendered (a size and more than one pixel
value) onto ``<body data-images-ok data-images-total>``, so a headless browser's
``--dump-dom`` can prove the images render (tests/browser_check.py).

Several runs (`build_runs_report`: experiments, folds and ensembles, each a directory
results/<run>/, see `runs`) share one page: a headline of each run's score against its baseline
(`headline`), a comparison table with every run's loss curves (`compare`), every run's settings
side by side (`settings`), the same slice of each volume for every run (`overlays`), then each
run's own sections (dataset, phases, training, evaluation, provenance, post-processing,
timings), and the shared (preprocessing) timings. `build_report` is one run's page from its
files named one by one.

One module per section: `dataset` (the run's volumes, as `ctseg.dataset_summary` recorded them
before training), `phases`, `training`, `settings`, `scores` (evaluation), `provenance` (which
volumes a score comes from and whether anything was fitted on them), `postprocess`,
`overlays`, `timings`, `compare`, `headline`; `runs` finds a run's files, `markup` holds the
shared HTML pieces, `page` the page around them and `build` puts a page together.

`build_report` and `build_runs_report` are imported from `build` on first use: the workflow's
planning imports `runs` (`runs.scored_runs`) and should not pay for matplotlib.
"""

from __future__ import annotations

from typing import Any

BUILDERS = ("build_report", "build_runs_report")


def __getattr__(name: str) -> Any:
    if name in BUILDERS:
        from ctseg.report import build

        return getattr(build, name)
    raise AttributeError(f"module 'ctseg.report' has no attribute {name!r}")
