"""The HTML report: phase trials with the verdict each recorded, loss curves, scores, slice
overlays and stage timings, in one self-contained file.

The report only renders. Every figure in the page is read from a file under ``results/`` and
each section names the files it read (relative paths), so every number traces back to its
source; the phase trials' verdicts, next knobs, precision and machine facts are the trials' own
(ctseg.trials), shown as recorded, and "not recorded" where an older summary lacks them. Plots
are PNGs embedded as base64 data URIs and the CSS is inline: the page opens offline and makes no
requests. A section whose inputs are missing says so; an input that exists but cannot be read
is a `CtsegError` naming the file (a report built on a corrupt file would be silently wrong).

The page carries one small inline script, inert for a reader: once the page has loaded it
draws every image onto a canvas and writes how many rendered (a size and more than one pixel
value) onto ``<body data-images-ok data-images-total>``, so a headless browser's
``--dump-dom`` can prove the images render (tests/browser_check.py).

One module per section: `phases`, `training`, `scores` (evaluation), `overlays`, `timings`;
`markup` holds the shared HTML pieces and `page` the page around them.
"""

from __future__ import annotations

from pathlib import Path

from ctseg.formatting import fmt, pct
from ctseg.io import atomic_path
from ctseg.report.markup import Sources
from ctseg.report.overlays import Overlay, overlay_section
from ctseg.report.page import IMAGE_CHECK_SCRIPT, page, sources_section
from ctseg.report.phases import phase_section
from ctseg.report.postprocess import postprocess_section
from ctseg.report.scores import evaluation_section
from ctseg.report.timings import timing_section
from ctseg.report.training import training_section

__all__ = ["IMAGE_CHECK_SCRIPT", "Overlay", "build_report", "fmt", "pct"]


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
) -> None:
    """Write the report to `out_html` atomically; see the module docstring.

    `overlays` holds (id, image zarr, label zarr or None, prediction tif or None). Paths in the
    page are shown relative to `root` (default: the working directory, the workflow root).
    """
    src = Sources(Path(root) if root is not None else Path.cwd())
    sections = [
        phase_section(phase_summaries, src),
        training_section(train_dir, src),
        evaluation_section(evaluation_dir, src),
        postprocess_section(postprocess_dir, src),
        overlay_section(overlays, src),
        timing_section(benchmarks_dir, src),
    ]
    sections.append(sources_section(src))
    html = page(title, experiment, sections)
    with atomic_path(Path(out_html)) as tmp:
        tmp.write_text(html, encoding="utf-8")
