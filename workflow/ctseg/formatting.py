"""Numbers in words: one way to print a figure, shared by the trials' verdicts and the report."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def num(value: Any) -> float | None:
    """A finite float, or None for missing / NaN / non-numeric values."""
    if value is None or isinstance(value, bool | np.bool_):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fmt(value: Any, digits: int = 3) -> str:
    """Numbers to `digits` significant figures (fixed notation); None / NaN as 'n/a'."""
    if isinstance(value, bool | np.bool_):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if isinstance(value, int | np.integer):
        return str(int(value))
    number = num(value)
    if number is None:
        return "n/a"
    if number == 0:
        return "0"
    if abs(number) >= 10 ** (digits - 1):
        return f"{number:.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(number))))
    return f"{number:.{decimals}f}"


def pct(value: Any) -> str:
    """A fraction as a whole percentage; None / NaN as 'n/a'."""
    number = num(value)
    return "n/a" if number is None else f"{100 * number:.0f}%"
