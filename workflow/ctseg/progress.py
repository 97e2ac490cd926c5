"""A step's progress bar that a log can keep: `Progress`, tqdm's bar on a terminal, and plain
lines anywhere else.

tqdm redraws its bar in place with carriage returns (and cursor moves for a second bar), ten
times a second. A terminal shows one bar; a log file (a job's stderr under Snakemake or a
scheduler) keeps every redraw, and `less` or an editor shows escape codes and one endless line.
Where the stream is not a terminal, `Progress` writes the bar's state as a line of its own: the
first, one every `LOG_EVERY_S` seconds, and the last when the bar ends.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

# How often a bar in a log writes a line: often enough to see a long step move, seldom enough
# that a day's training is a few thousand lines.
LOG_EVERY_S = 30.0


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


class Progress(tqdm):
    """tqdm, with the same arguments. Its stream (`file`, stderr by default) decides how it
    draws: redrawn in place on a terminal; else a plain line at its start, every `every_s`
    seconds and at its end, with no carriage return or escape code."""

    def __init__(self, *args: Any, every_s: float = LOG_EVERY_S, **kwargs: Any) -> None:
        # Set before tqdm's own __init__, which draws the bar once already.
        self.plain = not is_terminal(kwargs.get("file") or sys.stderr)
        self.every_s = every_s
        self.last_line_at: float | None = None
        self.last_line = ""
        self.end_written = False
        self.end_postfix: str | None = None
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if not self.plain:
            return super().display(msg, pos)
        if msg == "":  # tqdm clearing the bar: nothing was drawn to clear
            return False
        now = time.monotonic()
        ended = self.total is not None and self.n >= self.total
        due = self.last_line_at is None or now - self.last_line_at >= self.every_s
        if due or (ended and not self.end_written):
            self._line(str(self) if msg is None else msg, now)
            self.end_written = ended
            self.end_postfix = self.postfix if ended else None
        return True

    def _line(self, text: str, now: float) -> None:
        text = text.strip()
        if text and text != self.last_line:
            self.fp.write(text + "\n")
            self.fp.flush()
            self.last_line = text
        self.last_line_at = now

    def clear(self, nolock: bool = False) -> None:
        if not self.plain:
            super().clear(nolock)

    def moveto(self, n: int) -> None:
        if not self.plain:
            super().moveto(n)

    def close(self) -> None:
        # The state it ends in, once, unless its last line already said it; tqdm's own close
        # would then draw it again and end the line with a newline of its own. A postfix set
        # after the count reached its total (the last record done after its last byte) is news.
        if self.plain and not self.disable and getattr(self, "sp", None) is not None:
            if not self.end_written or self.postfix != self.end_postfix:
                self._line(str(self), time.monotonic())
                self.end_written = True
            self.leave = False
        super().close()
