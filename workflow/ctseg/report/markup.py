"""The report's building blocks: escaped text, tables, embedded PNGs, "not found" notes, the
list of files read, and readers that turn a bad input file into a `CtsegError` naming it."""

from __future__ import annotations

import base64
import html
import io
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from ctseg.formatting import fmt
from ctseg.io import CtsegError


def setting(value: Any) -> str:
    if isinstance(value, Mapping | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return fmt(value)


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


# ---------------------------------------------------------------------------------------------
# Page pieces


@dataclass
class Sources:
    """Paths shown relative to `root`, and every file read, for the page's source list."""

    root: Path
    read: list[str] = field(default_factory=list)

    def rel(self, path: Path) -> str:
        try:
            return str(Path(path).resolve().relative_to(self.root.resolve()))
        except ValueError:
            return str(path)

    def use(self, path: Path) -> str:
        name = self.rel(path)
        if name not in self.read:
            self.read.append(name)
        return name


def png(fig: Figure, alt: str) -> str:
    buffer = io.BytesIO()
    # Constrained layout already fits the figure; bbox_inches="tight" would draw it twice.
    fig.savefig(buffer, format="png", dpi=90)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{esc(alt)}">'


def table(
    header: Sequence[str], rows: Iterable[Sequence[str]], *, row_classes: Sequence[str] = ()
) -> str:
    """A plain HTML table of escaped text: number columns right-aligned, text columns left."""
    rows = list(rows)
    # A column is text (left-aligned, header too) if any of its cells is not a number.
    text = {i for row in rows for i, cell in enumerate(row) if not NUMBER_CELL.match(cell)}
    head = "".join(_cell(h, i in text, "th") for i, h in enumerate(header))
    body = []
    for i, row in enumerate(rows):
        klass = f' class="{row_classes[i]}"' if i < len(row_classes) and row_classes[i] else ""
        cells = "".join(_cell(c, j in text) for j, c in enumerate(row))
        body.append(f"<tr{klass}>{cells}</tr>")
    html_table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    return f'<div class="scroll">{html_table}</div>'


# A number, optionally with a unit sign, a "± band" and a parenthesised remark.
NUMBER_CELL = re.compile(r"^(n/a|[-+]?\d[\d.]*(e[-+]?\d+)?\s*[%×]?)(\s*±\s*\d[\d.]*)?(\s*\(.*\))?$")


def _cell(content: str, is_text: bool, tag: str = "td") -> str:
    klass = ' class="t"' if is_text else ""
    return f"<{tag}{klass}>{esc(content)}</{tag}>"


def source_line(names: Iterable[str]) -> str:
    items = ", ".join(f"<code>{esc(n)}</code>" for n in names)
    return f'<p class="source">Read from: {items}</p>' if items else ""


def missing(what: str, paths: Iterable[str] = ()) -> str:
    where = ", ".join(f"<code>{esc(p)}</code>" for p in paths)
    suffix = f": not found ({where})" if where else ": no input given"
    return f'<p class="missing">{esc(what)}{suffix}.</p>'


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows with each column's own type (iterrows would turn an all-number row into floats)."""
    return frame.astype(object).to_dict("records")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CtsegError(f"{path}: cannot read JSON for the report ({exc})") from exc
    if not isinstance(data, dict):
        raise CtsegError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_table(path: Path, **kwargs: Any) -> pd.DataFrame:
    try:
        return pd.read_csv(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise CtsegError(f"{path}: cannot read table for the report ({exc})") from exc
