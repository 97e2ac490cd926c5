"""The report does not mislead (issue 25, item 7): no false 0.0 loss point, combined runs'
members with their weights and hours, headings that say what their tables hold, the two Dice
figures explained, and no MFU or GPU advice where no peak is known.

The several-run page of test_report_compare is reused (its `rendered` fixture builds an
experiment, a fine-tune and an ensemble of both); the headless-Chromium width check is in
browser_check.check_page, run by the chromium tests of test_report and test_report_compare.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from test_report_compare import block, rendered, table_rows, write_train  # noqa: F401

from ctseg.report import build_runs_report
from ctseg.report.markup import Sources
from ctseg.report.phases import phase_section
from ctseg.report.training import unlabelled_steps
from ctseg.summaries import TrialSummary


def test_a_step_on_unlabelled_patches_is_no_point_of_the_loss_curves(tmp_path: Path) -> None:
    run = tmp_path / "results" / "exp"
    write_train(run / "train", 30, rate=4.0, val_dice=[0.3, 0.5])
    steps_csv = run / "train" / "steps.csv"
    lines = steps_csv.read_text().splitlines()
    header = lines[0].split(",")
    row = lines[9].split(",")  # step 9: the loss, both terms and the gradient norm exactly 0
    for column in ("loss", "bce", "dice", "grad_norm"):
        row[header.index(column)] = "0"
    lines[9] = ",".join(row)
    steps_csv.write_text("\n".join(lines) + "\n")
    out = tmp_path / "page.html"
    build_runs_report(out, [run], root=tmp_path)
    page = out.read_text()
    note = "1 step(s) left out of the loss curves"
    assert page.count(note) == 2  # the comparison's curves and the run's own
    import pandas as pd

    steps = pd.read_csv(steps_csv)
    assert list(steps.loc[unlabelled_steps(steps), "step"]) == [9]


def test_an_ensemble_shows_its_members_weights_and_hours(rendered) -> None:  # noqa: F811
    _, page, _ = rendered
    members = block(page, "ens1-members", until="<h3")
    rows = table_rows(members)
    assert rows[0] == ["member", "weight", "results folder", "job hours", "GPU- or CPU-hours"]
    assert rows[1][:3] == ["exp001", "2", "yes"] and rows[2][:3] == ["exp001_full", "1", "yes"]
    assert rows[1][3] == "1.80"  # exp001's own hours, as its row has them
    assert rows[1][4].endswith(" GPU-hours")  # exp001 trained on cuda:0
    assert "weighted mean" in members


def test_headings_say_what_their_tables_hold(rendered) -> None:  # noqa: F811
    _, page, _ = rendered
    headings = re.findall(r"<h[2-4][^>]*>([^<]+)</h[2-4]>", page)
    assert "Precision" not in headings
    assert not any(h.strip() in ("Means", "Per volume", "Epochs") for h in headings), headings


def test_val_and_test_dice_are_explained(rendered) -> None:  # noqa: F811
    _, page, _ = rendered
    comparison = block(page, "comparison")
    assert "val Dice (patches, last epoch)" in comparison
    for fact in ("val.batches", "logit above 0", "different volumes", "within 2 voxels"):
        assert re.search(fact, comparison), fact


def cpu_trial(phase: int, **kw) -> TrialSummary:
    return TrialSummary(
        phase=phase,
        status="ok",
        settings={"workers": phase, "batch_size": 2, "precision": "fp32"},
        samples_per_s=2.0,
        device="cpu",
        tflops=0.05,
        version=3,
        **kw,
    )


def test_without_a_known_peak_the_report_says_why_there_is_no_mfu(tmp_path: Path) -> None:
    paths = []
    for phase in (0, 1):
        path = tmp_path / f"phase{phase}" / "summary.json"
        path.parent.mkdir()
        cpu_trial(phase).write(path)
        paths.append(path)
    html = phase_section(paths, Sources(tmp_path))
    assert "No MFU for phase(s) 0, 1 (device cpu)" in html
    assert "no peak is known" in html


def test_with_a_known_peak_there_is_no_such_note(tmp_path: Path) -> None:
    path = tmp_path / "phase0" / "summary.json"
    path.parent.mkdir()
    peak = {"tflops": 156.0, "precision": "tf32", "source": "table", "detail": "A100"}
    cpu_trial(0, mfu=0.03, peak=peak).write(path)
    assert "No MFU" not in phase_section([path], Sources(tmp_path))


def test_a_baseline_row_sits_under_its_run(rendered, tmp_path: Path) -> None:  # noqa: F811
    """The reference row renders baseline/ as `ctseg baseline` writes it (tests/test_baseline)."""
    from test_report_compare import write_scores

    run = tmp_path / "results" / "exp"
    write_scores(
        run / "evaluation", {"v1": (0.9, 0.4, 0.6), "v2": (0.7, 0.3, 0.5)}, {"scored_on": "test"}
    )
    write_scores(run / "baseline", {"v1": (0.3, 0.2, 0.1), "v2": (0.5, 0.2, 0.3)}, {})
    summary = run / "baseline" / "summary.json"
    recorded = json.loads(summary.read_text())
    summary.write_text(json.dumps({**recorded, "threshold": 131.5, "tuned_on": ["v3"]}))
    out = tmp_path / "page.html"
    build_runs_report(out, [run], root=tmp_path)
    rows = table_rows(block(out.read_text(), "comparison"))
    assert rows[1][0] == "exp"
    reference = rows[2]
    assert reference[:3] == ["↳ baseline: image &gt; 132", "test (2)", "no"]
    assert reference[3] == "0.2700 ± 0.09192"  # (0.205 + 0.335) / 2, and the sample spread
    assert "what a trivial rule scores on the same volumes" in out.read_text()
