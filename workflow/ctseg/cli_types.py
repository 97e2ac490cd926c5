"""The argparse pieces several stages' `ctseg <step>` subcommands share: the type of a
subcommand's `add_parser` and the converters of its option values.

A converter's name is what argparse prints when a value fails to convert
(`invalid _shape value: 'a'`), so each keeps the name the error lines have always shown.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

# `ArgumentParser.add_subparsers().add_parser`: each subcommand's builder adds itself with it.
AddParser = Callable[..., argparse.ArgumentParser]

# The codec parameters that are integers (blosc's `clevel`, zstd's and gzip's `level`).
CODEC_INTEGERS = ("clevel", "level")


def _shape(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.replace("x", ",").split(",") if p]
    if len(parts) == 1:
        parts = parts * 3
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected Z,Y,X positive integers, got {text!r}")
    return tuple(parts)  # type: ignore[return-value]


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({exc})") from exc


def _codec(text: str) -> dict[str, object]:
    """``NAME[,KEY=VALUE...]``, e.g. ``blosc,cname=lz4,clevel=5,shuffle=shuffle``."""
    name, *pairs = [part.strip() for part in text.split(",") if part.strip()] or [""]
    codec: dict[str, object] = {"name": name}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise argparse.ArgumentTypeError(f"codec {text!r}: expected KEY=VALUE, got {pair!r}")
        try:
            codec[key] = int(value) if key in CODEC_INTEGERS else value
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"codec {text!r}: {key} must be an integer") from exc
    return codec


def _experiment(path: str) -> object:
    from ctseg.config import load_experiment

    return load_experiment(path)


def _phases(path: str) -> object:
    from ctseg.config import load_phases

    return load_phases(path)


def _fold_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fold",
        type=int,
        default=None,
        help="run fold I of an experiment with split.folds (the run <experiment>.fold<I>)",
    )
