"""ctseg.progress: a progress bar redrawn in place on a terminal, plain lines in a log (no
carriage returns, no escape codes)."""

from __future__ import annotations

import io
import itertools
import re
from pathlib import Path

import numpy as np
import tifffile

from ctseg.cli import main as cli_main
from ctseg.progress import Progress

REDRAW = re.compile(r"\r|\x1b")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_log_a_bar_is_a_line_at_its_start_and_one_at_its_end(tmp_path: Path) -> None:
    log = io.StringIO()
    with Progress(total=40, file=log, desc="convert a.tif", unit="slice", mininterval=0) as bar:
        for _ in range(40):
            bar.update(1)
    lines = log.getvalue().splitlines()
    assert not REDRAW.search(log.getvalue())
    assert len(lines) == 2, lines
    assert lines[0].startswith("convert a.tif:   0%") and " 0/40 " in lines[0]
    assert lines[1].startswith("convert a.tif: 100%") and " 40/40 " in lines[1]


def test_in_a_log_the_last_line_holds_a_postfix_set_after_the_total(tmp_path: Path) -> None:
    # Staging counts bytes and records: a record's last byte ends the count before the record
    # is marked done, so the end line said "records 1/3" while the step had done all three.
    log = io.StringIO()
    with Progress(total=3, file=log, desc="stage", mininterval=0) as bar:
        bar.set_postfix_str("records 0/3")
        bar.update(3)
        for done in (1, 2, 3):
            bar.set_postfix_str(f"records {done}/3")
    lines = log.getvalue().splitlines()
    assert lines[-1].startswith("stage: 100%") and lines[-1].endswith("records 3/3]"), lines
    assert sum(line.startswith("stage: 100%") for line in lines) == 2, lines


def test_in_a_log_a_bar_writes_a_line_each_interval_and_where_it_stopped() -> None:
    log = io.StringIO()
    with Progress(total=4, file=log, desc="train", every_s=0, mininterval=0) as bar:
        for _ in range(3):
            bar.update(1)
            bar.write("validation: dice 0.5", file=log)  # as training reports between steps
    text = log.getvalue()
    assert not REDRAW.search(text)
    # A redraw for the message may repeat the state it follows (a second ticked over).
    states = (line.split("|")[0] for line in text.splitlines())
    assert [state for state, _ in itertools.groupby(states)] == [
        "train:   0%",
        "train:  25%",
        "validation: dice 0.5",
        "train:  50%",
        "validation: dice 0.5",
        "train:  75%",
        "validation: dice 0.5",
    ]  # stopped at 3 of 4: its last line says so, and no 100% line follows


def test_nested_bars_in_a_log_move_no_cursor() -> None:
    log = io.StringIO()
    with Progress(total=2, file=log, desc="predict", mininterval=0) as outer:
        for _ in range(2):
            with Progress(total=3, file=log, desc="convert", mininterval=0) as inner:
                inner.update(3)
            outer.update(1)
    text = log.getvalue()
    assert not REDRAW.search(text)
    assert [line.split(":")[0] for line in text.splitlines()] == [
        "predict", "convert", "convert", "convert", "convert", "predict",
    ]  # fmt: skip


def test_on_a_terminal_the_bar_is_redrawn_in_place() -> None:
    terminal = Terminal()
    with Progress(total=3, file=terminal, desc="infer", mininterval=0) as bar:
        bar.update(3)
    assert terminal.getvalue().count("\r") >= 2 and terminal.getvalue().endswith("\n")


def test_a_step_s_log_holds_no_redraws(tmp_path: Path, capsys) -> None:
    """stderr captured, as Snakemake's `2> {log}` does: plain lines only."""
    source = tmp_path / "a.tif"
    volume = np.random.default_rng(0).integers(0, 255, (40, 16, 16), dtype=np.uint8)
    tifffile.imwrite(source, volume, photometric="minisblack")
    args = ["convert", str(source), str(tmp_path / "a.zarr"), "--chunks", "8"]
    assert cli_main([*args, "--memory-budget-mb", "0.01"]) == 0
    err = capsys.readouterr().err
    assert not REDRAW.search(err), repr(err)
    assert err.splitlines()[-1].startswith("convert a.tif: 100%")
