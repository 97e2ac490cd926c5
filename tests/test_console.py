"""ctseg.console: the lines the workflow prints when it ends."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from ctseg.console import failed_job_errors, headline, resumed_trainings
from ctseg.io import CtsegError


def test_failed_jobs_show_ctseg_s_message_or_the_exception(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    (logs / "convert_image").mkdir(parents=True)
    (logs / "train").mkdir()
    convert = logs / "convert_image" / "a.log"
    convert.write_text("reading a.tif\nctseg convert: error: a.tif: not a TIFF file\n")
    crash = logs / "train" / "r.log"
    crash.write_text("Traceback (most recent call last):\n  File x\nRuntimeError: CUDA OOM\n")
    fine = logs / "convert_image" / "b.log"
    fine.write_text("converted b.tif\n")
    old = logs / "convert_image" / "c.log"
    old.write_text("ctseg convert: error: an earlier run's failure\n")
    since = time.time() - 60
    os.utime(old, (since - 100, since - 100))
    assert failed_job_errors(logs, since) == [
        f"{convert}: ctseg convert: error: a.tif: not a TIFF file",
        f"{crash}: RuntimeError: CUDA OOM",
    ]
    assert failed_job_errors(tmp_path / "none", since) == []


def test_the_headline_names_the_report_and_each_run_s_score(tmp_path: Path) -> None:
    report = tmp_path / "report.html"
    run = tmp_path / "exp001"
    (run / "evaluation").mkdir(parents=True)
    summary = {"volumes": 2, "mean_score": 0.61234, "provenance": {"scored_on": "test_split"}}
    scores = run / "evaluation" / "summary.json"
    scores.write_text(json.dumps(summary))
    assert headline(report, [("exp001", run)], [scores]) == []  # no report, nothing to point at
    report.write_text("<html></html>")
    assert headline(report, [("exp001", run), ("missing", tmp_path / "missing")], [scores]) == [
        f"report: {report}",
        "exp001: score 0.6123, the mean over 2 volume(s) (test_split); the competition score "
        "is 1.0 for a perfect mask",
    ]


def test_a_report_behind_its_inputs_is_out_of_date_and_shows_no_score(tmp_path: Path) -> None:
    report = tmp_path / "report.html"
    run = tmp_path / "exp001"
    (run / "evaluation").mkdir(parents=True)
    scores = run / "evaluation" / "summary.json"
    scores.write_text(json.dumps({"volumes": 2, "mean_score": 0.5}))
    report.write_text("<html></html>")
    # A model retrained after the report (by `snakemake train`): its scores are the old model's.
    steps = run / "train" / "steps.csv"
    steps.parent.mkdir()
    steps.write_text("step\n1\n")
    built = report.stat().st_mtime
    os.utime(steps, (built + 10, built + 10))
    assert headline(report, [("exp001", run)], [scores, steps]) == [
        f"report: {report} is out of date: {steps} changed after it; `snakemake report` rebuilds it"
    ]
    gone = run / "evaluation" / "scores.csv"
    assert headline(report, [("exp001", run)], [gone]) == [
        f"report: {report} is out of date: {gone} is not written yet; `snakemake report` "
        "rebuilds it"
    ]


def test_a_resumed_training_is_one_console_line(tmp_path: Path) -> None:
    """Each log written since the start that says its training resumed gives one line; older
    logs and other lines do not (the real line is matched in tests/test_train.py)."""
    logs = tmp_path / "logs"
    (logs / "train").mkdir(parents=True)
    resumed = logs / "train" / "a.log"
    resumed.write_text(
        "step 1/8\nresumed at step 24 (epoch 3) from results/a/checkpoints/resume.pt\nstep 25/32\n"
    )
    fresh = logs / "train" / "b.log"
    fresh.write_text("step 1/8\nstep 2/8\n")
    old = logs / "train" / "c.log"
    old.write_text("resumed at step 4 (epoch 0) from results/c/checkpoints/resume.pt\n")
    since = time.time() - 60
    os.utime(old, (since - 3600, since - 3600))
    assert resumed_trainings(logs, since) == [
        f"{resumed}: resumed at step 24 (epoch 3) from results/a/checkpoints/resume.pt"
    ]


class _Refusing(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        raise CtsegError("/scratch/a.zarr: chunk c/0/0/0 does not match its recorded digest")


def test_an_error_in_a_loader_worker_is_its_own_one_line() -> None:
    """torch re-raises a worker's CtsegError with the worker's traceback as its text; the
    line `ctseg <step>` prints is the original message."""
    loader = torch.utils.data.DataLoader(_Refusing(), num_workers=1)
    with pytest.raises(CtsegError) as caught:
        next(iter(loader))
    assert "Original Traceback" in str(caught.value)  # what torch hands back
    assert caught.value.line() == (
        "/scratch/a.zarr: chunk c/0/0/0 does not match its recorded digest"
    )
    assert CtsegError("one: line").line() == "one: line"
