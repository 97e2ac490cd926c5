"""The command line describes itself: every option of every subcommand has a help text,
`ctseg --version` prints the package's version, and what ctseg prints as JSON is strict JSON."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

import ctseg
from ctseg.cli import build_parser, main
from ctseg.io import strict_json


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def undescribed(parser: argparse.ArgumentParser) -> list[str]:
    return [
        "/".join(a.option_strings) or a.dest
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction) and not a.help
    ]


def test_every_option_of_every_subcommand_has_help() -> None:
    parser = build_parser()
    commands = subcommands(parser)
    assert {"infer", "predict", "postprocess", "convert", "score"} <= set(commands)
    missing = {name: undescribed(sub) for name, sub in commands.items() if undescribed(sub)}
    assert missing == {}
    assert undescribed(parser) == []


def test_the_walk_finds_an_option_without_help() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--described", help="yes")
    parser.add_argument("--bare")
    assert undescribed(parser) == ["--bare"]


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"ctseg {ctseg.__version__}"


def test_strict_json_writes_null_for_non_finite_numbers() -> None:
    value = {"a": math.nan, "b": [np.float32("inf"), 1.5, (2, -math.inf)], "c": np.float64("nan")}
    text = strict_json(value, indent=1)
    assert json.loads(text) == {"a": None, "b": [None, 1.5, [2, None]], "c": None}
    assert "NaN" not in text and "Infinity" not in text


def test_score_prints_strict_json(tmp_path, capsys) -> None:
    """Two empty masks: terms that divide by nothing are null, not NaN."""
    import tifffile

    empty = np.zeros((8, 8, 8), np.uint8)
    for name in ("pred", "gt"):
        tifffile.imwrite(tmp_path / f"{name}.tif", empty, photometric="minisblack")
    assert main(["score", str(tmp_path / "pred.tif"), str(tmp_path / "gt.tif")]) == 0
    out = capsys.readouterr().out
    json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
