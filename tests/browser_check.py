"""Load an HTML report in headless Chromium at 900 and 1400 px, check that its images render,
that every table fits the window and breaks no word across lines, save a screenshot of each.

Usage: python tests/browser_check.py report.html screenshot.png

The report carries a tiny inline script that, once the page has loaded, draws each image onto
a canvas and writes how many rendered onto ``<body data-images-ok data-images-total>``;
``--dump-dom`` prints the DOM after scripts ran, so the counts come back without DevTools. The
same script writes how many tables reach past the page's width (``data-tables-wide``), how many
words in table cells break across lines (``data-words-broken``) and where the headline is
(``data-headline-top`` ...), which `page_facts` reads back with a screenshot from one launch
(``--dump-dom`` and ``--screenshot`` together) per window width.

Chromium is Debian's ``chromium`` package; see `INSTALL_HINT` (a font package too, since
without recommends none may come with it). Set ``CHROMIUM`` to use another binary.
Network, sync and component updates are off, so the page is checked offline.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import image as mpimg

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",  # the tests run as root in a container, where the sandbox cannot start
    "--disable-gpu",
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)
INSTALL_HINT = (
    "apt-get update && apt-get install -y --no-install-recommends chromium fonts-dejavu-core"
)
MIN_SCREENSHOT_BYTES = 10_000


class BrowserCheckError(RuntimeError):
    """The page did not render as expected, or Chromium could not run."""


def find_chromium() -> str | None:
    """The Chromium binary: $CHROMIUM if set, else the first known name on PATH."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    for name in CHROMIUM_NAMES:
        if found := shutil.which(name):
            return found
    return None


def _run(chromium: str, args: list[str], timeout: float) -> str:
    # A fresh profile per run: no state from an earlier run, nothing written to $HOME.
    with tempfile.TemporaryDirectory(prefix="ctseg-chromium-") as profile:
        command = [chromium, *FLAGS, f"--user-data-dir={profile}", *args]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise BrowserCheckError(f"chromium timed out after {timeout} s: {command}") from exc
    if done.returncode != 0:
        raise BrowserCheckError(
            f"chromium exited {done.returncode}: {command}\n{done.stderr[-2000:]}"
        )
    return done.stdout


WINDOW_WIDTH = 1400  # the widest window checked (issue 25: a laptop's browser)
NARROW_WIDTH = 900  # the narrowest (issue 34: a half-screen window)
WIDTHS = (NARROW_WIDTH, WINDOW_WIDTH)
SHOT_HEIGHT = 2000  # px of the page's top in each screenshot


def page_facts(
    chromium: str,
    page: Path,
    width: int = WINDOW_WIDTH,
    png: Path | None = None,
    timeout: float = 120,
) -> dict[str, str]:
    """The data-* attributes the page's script wrote on <body>, in a window `width` px wide,
    and with `png` a screenshot of the page's top from the same load: one Chromium launch."""
    shot = []
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        png.unlink(missing_ok=True)
        shot = [f"--screenshot={png.resolve()}"]
    # Virtual time lets the load event run before the DOM dump, however busy the machine.
    dom = _run(
        chromium,
        [
            f"--window-size={width},{SHOT_HEIGHT}",
            "--virtual-time-budget=15000",
            "--dump-dom",
            *shot,
            page.resolve().as_uri(),
        ],
        timeout,
    )
    body = re.search(r"<body[^>]*>", dom)
    if body is None:
        raise BrowserCheckError(f"{page}: no <body> in chromium's DOM dump")
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body.group(0)))
    if attrs.get("images-checked") != "done":
        raise BrowserCheckError(
            f"{page}: the page's image check did not run (body tag: {body.group(0)[:300]})"
        )
    if png is not None and not png.exists():
        raise BrowserCheckError(f"chromium wrote no screenshot to {png}")
    attrs["dom"] = dom
    return attrs


def image_counts(chromium: str, page: Path, timeout: float = 120) -> tuple[int, int]:
    """(images that rendered, images in the page), as the page's own check recorded them."""
    attrs = page_facts(chromium, page, timeout=timeout)
    return int(attrs["images-ok"]), int(attrs["images-total"])


def table_widths(attrs: dict[str, str], page: Path) -> dict[str, Any]:
    """From `page_facts`: the page's width, its tables, how many reach past the page and the
    right edge of the widest, and how many words in table cells broke across lines."""
    keys = ("page-width", "tables-total", "tables-wide", "tables-widest", "words-broken")
    if not all(k in attrs for k in keys):
        raise BrowserCheckError(f"{page}: the page's table check did not run ({attrs})")
    widths: dict[str, Any] = {k.replace("-", "_"): int(attrs[k]) for k in keys}
    if "tables-first-wide" in attrs:  # the first header cell of the first table too wide
        widths["first_wide"] = attrs["tables-first-wide"]
    widths["words_broken_first"] = attrs.get("words-broken-first", "")
    return widths


def check_screenshot(png: Path) -> dict[str, Any]:
    """The screenshot is a real PNG with content: big enough and not one flat colour."""
    size = png.stat().st_size
    if size < MIN_SCREENSHOT_BYTES:
        raise BrowserCheckError(f"{png}: screenshot only {size} bytes: the page looks blank")
    pixels = mpimg.imread(png)
    spread = float(np.asarray(pixels, dtype=float).std())
    if spread < 0.01:
        raise BrowserCheckError(f"{png}: screenshot is uniform (pixel std {spread:.4f})")
    return {"bytes": size, "shape": tuple(pixels.shape), "pixel_std": spread}


def check_page(page: Path, png: Path, timeout: float = 120) -> dict[str, Any]:
    """At each of `WIDTHS`: every image decoded, every table fits the page, no word in a table
    cell broke across lines, and the screenshot is real; raise BrowserCheckError otherwise.
    The screenshot of width W is `png` with ``_W`` before its suffix."""
    chromium = find_chromium()
    if chromium is None:
        raise BrowserCheckError(f"chromium is not on PATH; install it with: {INSTALL_HINT}")
    result: dict[str, Any] = {"chromium": chromium}
    for width in WIDTHS:
        shot = png.with_name(f"{png.stem}_{width}{png.suffix}")
        start = time.perf_counter()
        attrs = page_facts(chromium, page, width, shot, timeout)
        seconds = time.perf_counter() - start
        ok, total = int(attrs["images-ok"]), int(attrs["images-total"])
        if total == 0 or ok != total:
            raise BrowserCheckError(f"{page}: {ok} of {total} images decoded in chromium")
        widths = table_widths(attrs, page)
        if widths["tables_wide"]:
            raise BrowserCheckError(
                f"{page}: {widths['tables_wide']} of {widths['tables_total']} tables are wider "
                f"than the page in a {width} px window (widest ends at "
                f"{widths['tables_widest']} px of {widths['page_width']}; the first is headed "
                f"{widths.get('first_wide')!r})"
            )
        if widths["words_broken"]:
            raise BrowserCheckError(
                f"{page}: {widths['words_broken']} words in table cells break across lines in "
                f"a {width} px window, e.g. {widths['words_broken_first']!r}"
            )
        result[width] = {
            "images_ok": ok,
            "images_total": total,
            **widths,
            "seconds": round(seconds, 2),
            "screenshot": str(shot),
            **check_screenshot(shot),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    try:
        result = check_page(Path(args[0]), Path(args[1]))
    except BrowserCheckError as exc:
        print(f"browser check FAILED: {exc}", file=sys.stderr)
        return 1
    for key, value in result.items():
        shown = " ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value
        print(f"{key}: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
